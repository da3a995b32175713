"""CISPO — MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention"
(arXiv 2506.13585), clipped importance-sampling-weight policy optimisation.

    r_t  = exp(logp_t - old_logp_t)
    w_t  = clip(r_t, 1 - clip_low, 1 + clip_high)
    loss = -sum_{i,t} mask * sg(w_t) A_t logp_t / sum_{i,t} mask        (token-mean)
    grad = -sg(w_t) A_t grad logp_t / N_tokens                          (every token keeps a gradient)

Defaults:
- clip_low = 1.0: the paper imposes no lower bound ("epsilon_low set to a large value"); any
  clip_low >= 1 puts the floor 1 - clip_low <= 0 below every ratio, i.e. no lower bound.
- clip_high = 4.0, i.e. w <= 5: the paper tunes only epsilon_high and does not print its value; 5.0 is
  the absolute cap epsilon_max recommended by ScaleRL (arXiv 2510.13786) and TRL 1.16's CISPO docs.
  (verl's defaults 0.2 / 0.28 are PPO-like, not the paper's.)
The loss value itself is not meaningful (it contains logp); its gradient is.

Clip fractions here mean something different from PPO-style objectives: CISPO never removes a token's
gradient. clip_frac_high = fraction of valid tokens whose weight was truncated from above
(r_t > 1 + clip_high), clip_frac_low = from below (r_t < 1 - clip_low; always 0 with the default), for
either sign of A; those tokens keep the gradient -(1 + clip_high) A grad logp (resp. (1 - clip_low)),
smaller than the r_t-weighted one. Ratio metrics are over the unclipped r_t.
"""

from __future__ import annotations

import torch

from objectives.base import Objective, PolicyBatch, aggregate, clip_metrics, ratio_metrics, register_objective


@register_objective("cispo")
class CISPO(Objective):
    clip_low: float = 1.0
    clip_high: float = 4.0

    default_advantage = "grpo"
    default_aggregation = "token_mean"

    def policy_loss(self, batch: PolicyBatch):
        ratio = torch.exp(batch.log_ratio())
        weight = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high).detach()
        per_token = -weight * batch.token_advantages * batch.logp
        loss = aggregate(per_token, batch, self.aggregation)
        low = ratio < 1.0 - self.clip_low
        high = ratio > 1.0 + self.clip_high
        return loss, {**clip_metrics(low, high, batch), **ratio_metrics(ratio, batch.mask)}
