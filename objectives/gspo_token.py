"""GSPO-token — Zheng et al., "Group Sequence Policy Optimization" (arXiv 2507.18071), token-level variant.

    log s_i  = (1/L_i) sum_t d_t                                  (GSPO's length-normalised sequence ratio)
    log s_it = sg(log s_i) + logp_t - sg(logp_t)                 (value s_i on every token of i; gradient
                                                                   flows through the token's own logp only)
    l_t  = max(-s_it A_it, -clip(s_it, 1 - clip_low, 1 + clip_high) A_it)
    loss = mean_i (1/L_i) sum_t l_t                               (seq-mean-token-mean)

With per-sequence advantages every token of a sequence has the same ratio and the same advantage, so the
clip decision is per sequence and loss, gradient (s_i A_i (1/L_i) grad logp_t) and clip fractions equal
those of ``gspo``. Unlike ``gspo`` it also accepts per-token advantages [B, T]. Defaults 3e-4 / 4e-4
(GSPO's). verl's ``gspo`` loss is this form with log s_it capped at 10 (``torch.clamp(max=10)``: a capped
token keeps the value and loses the gradient); here the cap is the option ``cap_log_ratio`` (off by default,
``log_ratio_cap`` = 10), as in ``gspo``, so that with the same options the two objectives stay identical.
``clip_frac_cap`` (capped tokens with A < 0; those with A > 0 are clipped anyway) is reported when it is on.
"""

from __future__ import annotations

import torch

from objectives.base import Objective, PolicyBatch, ppo_clipped_loss, register_objective


@register_objective("gspo_token")
class GSPOToken(Objective):
    ratio_level = "sequence"  # every token carries its sequence's geometric-mean ratio

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    cap_log_ratio: bool = False
    log_ratio_cap: float = 10.0

    default_advantage = "grpo"
    default_aggregation = "seq_mean_token_mean"
    below_one = frozenset({"clip_low"})
    positive = frozenset({"log_ratio_cap"})

    def policy_loss(self, batch: PolicyBatch):
        log_seq = batch.sequence_mean(batch.log_ratio()).detach()
        log_ratio = log_seq[:, None] + batch.logp - batch.logp.detach()
        log_ratio = torch.where(batch.mask, log_ratio, torch.zeros_like(log_ratio))
        if not self.cap_log_ratio:
            return ppo_clipped_loss(batch, self.clip_low, self.clip_high, self.aggregation, log_ratio)
        capped = (log_ratio > self.log_ratio_cap) & batch.mask & (batch.token_advantages < 0)
        loss, metrics = ppo_clipped_loss(batch, self.clip_low, self.clip_high, self.aggregation,
                                         log_ratio.clamp(max=self.log_ratio_cap))
        metrics["clip_frac_cap"] = capped.sum().item() / batch.mask.sum().clamp(min=1).item()
        metrics["clip_frac"] += metrics["clip_frac_cap"]
        return loss, metrics
