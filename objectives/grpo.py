"""GRPO — Shao et al., "DeepSeekMath" (arXiv 2402.03300), token-level PPO clipping.

    r_t = exp(logp_t - old_logp_t)
    l_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)        (+ beta * k3 KL, from the base)
    loss = mean_i (1/L_i) sum_t l_t                                      (seq-mean-token-mean)

Defaults clip 0.2/0.2 and beta = 0 (the paper used beta = 0.04 with G = 64 and one update per rollout).
The KL is the k3 estimator exp(ref - logp) - (ref - logp) - 1, *not* multiplied by r (TRL 1.16 multiplies
it by r unless ``use_bias_correction_kl=False``).
"""

from __future__ import annotations

from objectives.base import Objective, PolicyBatch, ppo_clipped_loss, register_objective


@register_objective("grpo")
class GRPO(Objective):
    clip_low: float = 0.2
    clip_high: float = 0.2

    default_advantage = "grpo"
    aggregation = "seq_mean_token_mean"
    below_one = frozenset({"clip_low"})

    def policy_loss(self, batch: PolicyBatch):
        return ppo_clipped_loss(batch, self.clip_low, self.clip_high, self.aggregation)
