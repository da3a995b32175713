"""Dr. GRPO — Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (arXiv 2503.20783).

    A_i  = R_i - mean_g R                                              (no std division: ``mean_only``)
    l_t  = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)        (GRPO's surrogate, 0.2 / 0.2)
    loss = sum_{i,t} mask * l_t / (N_seqs * max_completion_len)        (constant normaliser: no length bias)

``PolicyBatch.max_completion_len`` must be set (the generation budget, the same constant for every batch).
If beta > 0 the KL is aggregated the same way.

Options (off by default; every objective also takes ``aggregation``, see objectives/base.py):
- ``dual_clip`` / ``clip_ratio_c`` (default 3): verl's dual clip (``clip_ratio_c``; Ye et al., arXiv 1912.09729),
  for A < 0 only: l_t = min(l_t, -clip_ratio_c A), so a token of a bad response whose ratio exceeds c keeps
  the bounded loss -c A and loses its gradient. ``clip_frac_dual`` (A < 0 and r > c) is reported (0 when
  off) and included in ``clip_frac``. Neither the paper nor TRL has it; verl's ``vanilla`` loss always does.
"""

from __future__ import annotations

from objectives.base import Objective, PolicyBatch, ppo_clipped_loss, register_objective, validate_dual_clip


@register_objective("dr_grpo")
class DrGRPO(Objective):
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: bool = False
    clip_ratio_c: float = 3.0

    default_advantage = "mean_only"
    default_aggregation = "seq_mean_token_sum_norm"
    below_one = frozenset({"clip_low"})

    def validate(self):
        validate_dual_clip(self)

    def policy_loss(self, batch: PolicyBatch):
        loss, metrics = ppo_clipped_loss(batch, self.clip_low, self.clip_high, self.aggregation,
                                         clip_ratio_c=self.clip_ratio_c if self.dual_clip else None)
        return loss, {"clip_frac_dual": 0.0, **metrics}
