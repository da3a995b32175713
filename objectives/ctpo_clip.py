"""CTPO with a ratio-space clip — the non-length-adaptive losses of the CTPO authors' code (arXiv 2605.07331;
horizon-llm/CTPO at commit acc40211dbeaa8cb37c2347a8b7ad64192b635c4, verl/trainer/ppo/core_algos.py,
``_compute_policy_loss_cum_token_impl``: ``cum-token-cumprod`` (default) and ``cum-token-geomean``
(``ratio_mode="geomean"``)). The length-adaptive window of the paper is ``ctpo``.

    log rho_t  = min(sg(c_t) + logp_t - sg(logp_t), 10)      c_t: prefix sum (cumprod) or prefix mean (geomean)
                                                             of clamp(d_u, -20, 20) over valid u <= t
    l_t        = max(-A rho_t, -A clip(rho_t, 1 - clip_low, 1 + clip_high))
    l_t        = min(l_t, -A clip_ratio_c)                    only where A < 0 (dual clip)
    loss       = sum_{i,t} mask * l_t / sum_{i,t} mask        (token-mean, the authors' default)

Defaults clip_low = clip_high = 0.2 and clip_ratio_c = 3 (verl's ``clip_ratio`` / ``clip_ratio_c`` defaults,
which these losses read; clip_ratio_c must be > 1, as they assert). The window does not grow with t: with
"cumprod" the prefix product drifts like a sequence ratio, so most late tokens end up clipped; "geomean"
keeps the ratio near 1. Choices: the +-20 clamp and the cap at 10 are the authors' (a capped token keeps
its value and loses its gradient). Clip fractions over valid tokens, counting tokens whose gradient is
removed: clip_frac_low = A < 0 and rho < 1 - clip_low; clip_frac_high = A > 0 and (rho > 1 + clip_high or
capped); clip_frac_dual = A < 0 and (rho > clip_ratio_c or capped); clip_frac = their sum (disjoint).
The authors count ``high`` / ``low`` / ``dual`` the same way except for capped tokens. Ratio metrics are
over rho_t (as capped). Advantages may be [B] or [B, T]; ``aggregation`` may be any mode.
"""

from __future__ import annotations

import torch

from objectives.base import (
    CUM_LOG_RATIO_CAP,
    CUM_RATIO_MODES,
    Objective,
    PolicyBatch,
    aggregate,
    clip_metrics,
    cumulative_log_ratio,
    ratio_metrics,
    register_objective,
    validate_dual_clip,
)


@register_objective("ctpo_clip")
class CTPOClip(Objective):
    ratio_level = "other"
    ratio_note = "a prefix product (or prefix geometric mean) of token ratios"

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float = 3.0
    ratio_mode: str = "cumprod"

    default_advantage = "grpo"
    default_aggregation = "token_mean"
    below_one = frozenset({"clip_low"})

    def validate(self):
        validate_dual_clip(self)
        if self.ratio_mode not in CUM_RATIO_MODES:
            raise ValueError(f"objective {self.name!r}: ratio_mode must be one of {CUM_RATIO_MODES}, "
                             f"got {self.ratio_mode!r}")

    def policy_loss(self, batch: PolicyBatch):
        mask = batch.mask
        raw = cumulative_log_ratio(batch, self.ratio_mode)
        rho = torch.exp(raw.clamp(max=CUM_LOG_RATIO_CAP))
        adv = batch.token_advantages
        ppo = torch.maximum(-adv * rho, -adv * rho.clamp(1.0 - self.clip_low, 1.0 + self.clip_high))
        dual = -adv * self.clip_ratio_c
        per_token = torch.where(adv < 0, torch.minimum(ppo, dual), ppo)
        loss = aggregate(per_token, batch, self.aggregation)

        capped = raw > CUM_LOG_RATIO_CAP
        low = (adv < 0) & (rho < 1.0 - self.clip_low)
        high = (adv > 0) & ((rho > 1.0 + self.clip_high) | capped)
        dual_clipped = (adv < 0) & ((ppo > dual) | capped)
        metrics = clip_metrics(low, high, batch)
        dual_frac = (dual_clipped & mask).sum().item() / mask.sum().clamp(min=1).item()
        metrics["clip_frac"] += dual_frac
        metrics["clip_frac_dual"] = dual_frac
        return loss, {**metrics, **ratio_metrics(rho, mask)}
