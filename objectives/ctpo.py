"""CTPO — cumulative-token importance sampling (arXiv 2605.07331); reference: the authors' code,
horizon-llm/CTPO (commit acc40211dbeaa8cb37c2347a8b7ad64192b635c4), verl/trainer/ppo/core_algos.py,
``_compute_policy_loss_cum_token_la_impl``: losses ``cum-token-cumprod-la`` (the default here) and
``cum-token-geomean-la`` (``ratio_mode="geomean"``). The non-length-adaptive losses ``cum-token-cumprod`` /
``cum-token-geomean`` (ratio-space clip, dual clip 3) are the sibling objective ``ctpo_clip``.

    c_t        = sum_{u <= t, valid} clamp(d_u, -20, 20)                 (ratio_mode "cumprod": log prefix product)
    c_t        = (sum_{u <= t, valid} clamp(d_u, -20, 20)) / n_t          (ratio_mode "geomean": log prefix geo-mean)
    log rho_t  = min(sg(c_t) + logp_t - sg(logp_t), 10)                  (value: exp(c_t); gradient: the
                                                                          current token only, coefficient 1)
    n_t        = number of valid tokens up to and including t            (1-indexed position)
    s_t        = n_t ^ la_power                                           (the authors' clip_ratio_la_power)
    rho^c_t    = exp(clamp(log rho_t, -clip_low s_t, clip_high s_t))
    l_t        = max(-A rho_t, -A rho^c_t)
    l_t        = min(l_t, -A exp(dual_clip s_t))        only where A < 0 (dual clip)
    loss       = sum_{i,t} mask * l_t / sum_{i,t} mask                   (token-mean, as the authors' default)

Unclipped, d loss / d logp_t = -A rho_t / N_tokens. Defaults clip_low = 0.025, clip_high = 0.05,
dual_clip = 0.05, la_power = 0.5 (the authors' ``la_clip_low/high/c`` and ``clip_ratio_la_power``, ctpo.sh):
at t = 1 the window is [0.975, 1.051], at t = 100 [0.78, 1.65]. The authors recommend la_power = +0.5 for
cumprod (Var log rho_t ~ t) and -0.5 for geomean (Var ~ 1/t): ``ratio_mode=geomean la_power=-0.5`` is their
``cum-token-geomean-la``; la_power = 0 gives a uniform log-space window. Choices, all following the
authors' code:
- the +-20 clamp of d (before the prefix sum) and the cap of log rho at 10 are theirs (numerical safety);
- the dual clip applies to A < 0 only, after the PPO max, with threshold exp(dual_clip s_t): with
  the defaults it coincides with the upper edge of the window, so for A < 0 a ratio above the window loses
  its gradient too;
- clip fractions (over valid tokens; each counts tokens whose gradient the clip removed):
  clip_frac_low  = A < 0 and log rho_t < -clip_low s_t;
  clip_frac_high = A > 0 and log rho_t > clip_high s_t (or past the cap at 10);
  clip_frac_dual = A < 0 and the dual clip is active (rho_t > exp(dual_clip s_t), or past the cap);
  clip_frac = clip_frac_low + clip_frac_high + clip_frac_dual (the three are disjoint). The authors log
  the same three counts (``pg_update/clip/{low,high,dual}``); verl's ``pg_clipfrac_lower`` is the dual one.
Ratio metrics are over rho_t (as capped). Advantages may be [B] or [B, T]. ``aggregation`` may be any mode.
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
)


@register_objective("ctpo")
class CTPO(Objective):
    ratio_level = "other"
    ratio_note = "a prefix product (or prefix geometric mean) of token ratios"

    clip_low: float = 0.025
    clip_high: float = 0.05
    dual_clip: float = 0.05
    ratio_mode: str = "cumprod"
    la_power: float = 0.5

    default_advantage = "grpo"
    default_aggregation = "token_mean"
    positive = frozenset({"clip_low", "clip_high", "dual_clip"})  # log-space half-widths of the window
    signed = frozenset({"la_power"})

    def validate(self):
        if self.ratio_mode not in CUM_RATIO_MODES:
            raise ValueError(f"objective {self.name!r}: ratio_mode must be one of {CUM_RATIO_MODES}, "
                             f"got {self.ratio_mode!r}")

    def policy_loss(self, batch: PolicyBatch):
        mask = batch.mask
        raw = cumulative_log_ratio(batch, self.ratio_mode)
        log_rho = raw.clamp(max=CUM_LOG_RATIO_CAP)
        rho = torch.exp(log_rho)
        scale = torch.cumsum(mask.to(batch.logp.dtype), dim=-1).clamp(min=1) ** self.la_power
        low_bound, high_bound = -self.clip_low * scale, self.clip_high * scale
        rho_clipped = torch.exp(torch.clamp(log_rho, low_bound, high_bound))
        adv = batch.token_advantages
        ppo = torch.maximum(-adv * rho, -adv * rho_clipped)
        dual = -adv * torch.exp(self.dual_clip * scale)
        per_token = torch.where(adv < 0, torch.minimum(ppo, dual), ppo)
        loss = aggregate(per_token, batch, self.aggregation)

        capped = raw > CUM_LOG_RATIO_CAP
        low = (adv < 0) & (log_rho < low_bound)
        high = (adv > 0) & ((log_rho > high_bound) | capped)
        dual_clipped = (adv < 0) & ((ppo > dual) | capped)
        metrics = clip_metrics(low, high, batch)
        dual_frac = (dual_clipped & mask).sum().item() / mask.sum().clamp(min=1).item()
        metrics["clip_frac"] += dual_frac
        metrics["clip_frac_dual"] = dual_frac
        return loss, {**metrics, **ratio_metrics(rho, mask)}
