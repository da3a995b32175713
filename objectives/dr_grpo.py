"""Dr. GRPO — Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (arXiv 2503.20783).

    A_i  = R_i - mean_g R                                              (no std division: ``mean_only``)
    l_t  = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)        (GRPO's surrogate, 0.2 / 0.2)
    loss = sum_{i,t} mask * l_t / (N_seqs * max_completion_len)        (constant normaliser: no length bias)

``PolicyBatch.max_completion_len`` must be set (the generation budget, the same constant for every batch).
If beta > 0 the KL is aggregated the same way.
"""

from __future__ import annotations

from objectives.base import Objective, PolicyBatch, ppo_clipped_loss, register_objective


@register_objective("dr_grpo")
class DrGRPO(Objective):
    clip_low: float = 0.2
    clip_high: float = 0.2

    default_advantage = "mean_only"
    aggregation = "seq_mean_token_sum_norm"
    kl_aggregation = "seq_mean_token_sum_norm"
    below_one = frozenset({"clip_low"})

    def policy_loss(self, batch: PolicyBatch):
        return ppo_clipped_loss(batch, self.clip_low, self.clip_high, self.aggregation)
