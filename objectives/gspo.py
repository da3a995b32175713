"""GSPO — Zheng et al., "Group Sequence Policy Optimization" (arXiv 2507.18071): sequence-level ratio, clip.

    log s_i = (1/L_i) sum_t (logp_t - old_logp_t)            (length-normalised sequence ratio)
    J = mean_i min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i),     loss = -J
    grad = s_i A_i (1/L_i) sum_t grad logp_t   for unclipped sequences; clipping removes whole responses.

Defaults clip_low = 3e-4, clip_high = 4e-4 (the paper's). Advantages must be per sequence.
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
    sequence_aggregate,
)


@register_objective("gspo")
class GSPO(Objective):
    clip_low: float = 3e-4
    clip_high: float = 4e-4

    default_advantage = "grpo"
    below_one = frozenset({"clip_low"})

    def policy_loss(self, batch: PolicyBatch):
        adv = sequence_advantages(batch, self.name)
        seq_ratio = torch.exp(batch.sequence_mean(batch.log_ratio()))
        clipped = seq_ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        per_sequence = torch.maximum(-seq_ratio * adv, -clipped * adv)
        low = (seq_ratio < 1.0 - self.clip_low) & (adv < 0)
        high = (seq_ratio > 1.0 + self.clip_high) & (adv > 0)
        valid = batch.mask.any(-1)
        loss = sequence_aggregate(per_sequence, batch)
        return loss, {**clip_metrics(low, high, batch), **ratio_metrics(seq_ratio, valid)}
