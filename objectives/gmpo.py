"""GMPO — Zhao et al., "Geometric-Mean Policy Optimization" (arXiv 2507.20673); reference: callsys/GMPO
(train_zero_math_gmpo.py) and verl's ``geo_mean`` loss.

    d'_t  = min(d_t,  clip_high)   if A_i >= 0      (token-level clip in log space, on the side that
    d'_t  = max(d_t, -clip_low)    if A_i <  0       the sign of the advantage selects)
    rho_i = exp( (1/L_i) sum_t mask * d'_t )          (geometric mean of the clipped token ratios)
    loss  = mean_i ( -A_i rho_i )                      (per-sequence scalar, mean over sequences)
    grad  = -A_i rho_i (1/L_i) grad logp_t  on unclipped tokens, 0 on clipped ones

Defaults clip_low = clip_high = 0.4, i.e. token ratios in (e^-0.4, e^0.4) = (0.67, 1.49), the paper's
"wider" clip. A = 0 counts as A >= 0 (as in the authors' code; its loss is 0 either way). Advantages must
be per sequence. Clip fractions over valid tokens: clip_frac_high = A > 0 and d_t > clip_high,
clip_frac_low = A < 0 and d_t < -clip_low (exactly the tokens whose gradient is removed).
Ratio metrics are over the sequence ratios rho_i. ``aggregation`` (default seq_mean_token_mean = the mean over
sequences above) may be token_mean / seq_mean_token_sum_norm: l_i weighted by L_i (base.sequence_loss).
"""

from __future__ import annotations

import torch

from objectives.base import (
    Objective,
    PolicyBatch,
    clip_metrics,
    ratio_metrics,
    register_objective,
    sequence_advantages,
    sequence_loss,
)


@register_objective("gmpo")
class GMPO(Objective):
    ratio_level = "sequence"  # the geometric mean of the (clipped) token ratios

    needs_sequence_advantages = True  # one A_i per sequence (sequence_advantages)

    clip_low: float = 0.4
    clip_high: float = 0.4

    default_advantage = "grpo"
    default_aggregation = "seq_mean_token_mean"

    def policy_loss(self, batch: PolicyBatch):
        adv = sequence_advantages(batch, self.name)
        d = batch.log_ratio()
        positive = (adv >= 0)[:, None]
        clipped_d = torch.where(positive, d.clamp(max=self.clip_high), d.clamp(min=-self.clip_low))
        seq_ratio = torch.exp(batch.sequence_mean(clipped_d))
        loss = sequence_loss(-adv * seq_ratio, batch, self.aggregation)
        high = (adv > 0)[:, None] & (d > self.clip_high)
        low = (adv < 0)[:, None] & (d < -self.clip_low)
        valid = batch.mask.any(-1)
        return loss, {**clip_metrics(low, high, batch), **ratio_metrics(seq_ratio, valid)}
