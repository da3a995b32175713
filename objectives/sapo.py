"""SAPO — Gao et al., "Soft Adaptive Policy Optimization" (arXiv 2511.20347), a smooth gate instead of a clip.

    r_t   = exp(clamp(d_t, -20, 20))
    tau_t = tau_pos if A_t > 0 else tau_neg
    f_t   = sigmoid(tau_t (r_t - 1)) * 4 / tau_t
    l_t   = -f_t A_t
    loss  = mean_i (1/L_i) sum_t l_t                                    (seq-mean-token-mean)
    d l_t / d logp_t = -A_t * w_t,   w_t = 4 sigma_t (1 - sigma_t) r_t,  sigma_t = sigmoid(tau_t (r_t - 1))

so the gradient weight w (relative to the vanilla policy gradient -A / (B L_i)) is exactly 1 at r = 1 and
decays smoothly away from it (faster for A <= 0, tau_neg > tau_pos). Defaults tau_pos = 1.0,
tau_neg = 1.05 (the paper's). The +-20 clamp of d is verl's, for numerical safety (beyond it w ~ 0).

SAPO has no hard clip: clip_frac, clip_frac_low, clip_frac_high are reported as 0. Gate statistics over
valid tokens: ``gate_weight_mean`` / ``gate_weight_min`` (w_t above) and ``gate_soft_clip_frac``, the
fraction of tokens whose gradient the gate shrank below half (w_t < 0.5). Ratio metrics are over r_t.
"""

from __future__ import annotations

import torch

from objectives.base import Objective, PolicyBatch, aggregate, clip_metrics, ratio_metrics, register_objective


@register_objective("sapo")
class SAPO(Objective):
    tau_pos: float = 1.0
    tau_neg: float = 1.05

    default_advantage = "grpo"
    default_aggregation = "seq_mean_token_mean"
    positive = frozenset({"tau_pos", "tau_neg"})  # gate temperatures

    def policy_loss(self, batch: PolicyBatch):
        ratio = torch.exp(batch.log_ratio().clamp(-20.0, 20.0))
        adv = batch.token_advantages
        tau = torch.where(adv > 0, torch.full_like(adv, self.tau_pos), torch.full_like(adv, self.tau_neg))
        sigma = torch.sigmoid(tau * (ratio - 1.0))
        per_token = -sigma * (4.0 / tau) * adv
        loss = aggregate(per_token, batch, self.aggregation)

        weight = (4.0 * sigma * (1.0 - sigma) * ratio).detach()[batch.mask]
        none = torch.zeros_like(batch.mask)
        metrics = {
            **clip_metrics(none, none, batch),
            **ratio_metrics(ratio, batch.mask),
            "gate_weight_mean": weight.mean().item() if weight.numel() else float("nan"),
            "gate_weight_min": weight.min().item() if weight.numel() else float("nan"),
            "gate_soft_clip_frac": (weight < 0.5).sum().item() / max(weight.numel(), 1),
        }
        return loss, metrics
