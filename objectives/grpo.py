"""GRPO — Shao et al., "DeepSeekMath" (arXiv 2402.03300), token-level PPO clipping.

    r_t = exp(logp_t - old_logp_t)
    l_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)        (+ beta * k3 KL, from the base)
    loss = mean_i (1/L_i) sum_t l_t                                      (seq-mean-token-mean)

Defaults clip 0.2/0.2 and beta = 0 (the paper used beta = 0.04 with G = 64 and one update per rollout).
The KL is the k3 estimator exp(ref - logp) - (ref - logp) - 1, *not* multiplied by r (TRL 1.16 multiplies
it by r unless ``use_bias_correction_kl=False``).
"""

from __future__ import annotations

import torch

from objectives.base import Objective, PolicyBatch, aggregate, clip_metrics, ratio_metrics, register_objective


def ppo_clipped_loss(
    batch: PolicyBatch, clip_low: float, clip_high: float, log_ratio: torch.Tensor | None = None
):
    """Per-token PPO loss max(-r A, -clip(r) A) and the boolean masks of tokens whose gradient it clipped.

    ``log_ratio`` ([B, T], 0 on padding) replaces ``batch.log_ratio()`` for objectives whose token ratio is
    built differently (GSPO-token); by default r = exp(logp - old_logp).
    """
    ratio = torch.exp(batch.log_ratio() if log_ratio is None else log_ratio)
    adv = batch.token_advantages
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(-ratio * adv, -clipped_ratio * adv)
    low = (ratio < 1.0 - clip_low) & (adv < 0)
    high = (ratio > 1.0 + clip_high) & (adv > 0)
    return per_token, ratio, low, high


@register_objective("grpo")
class GRPO(Objective):
    clip_low: float = 0.2
    clip_high: float = 0.2

    default_advantage = "grpo"
    aggregation = "seq_mean_token_mean"

    def validate(self):
        if self.clip_low >= 1:
            raise ValueError(
                f"objective {self.name!r}: clip_low must be < 1 (ratio floor 1 - clip_low > 0), "
                f"got {self.clip_low}"
            )

    def policy_loss(self, batch: PolicyBatch):
        per_token, ratio, low, high = ppo_clipped_loss(batch, self.clip_low, self.clip_high)
        loss = aggregate(per_token, batch, self.aggregation)
        return loss, {**clip_metrics(low, high, batch), **ratio_metrics(ratio, batch.mask)}
