"""VESPO — "Variational Sequence-Level Soft Policy Optimization" (arXiv 2602.10693): hard clipping replaced by a
smooth, asymmetric Gamma-shaped weight of the *sequence* importance ratio, applied to the policy-gradient term.
Reference: TRL 1.16.0 ``trl/trainer/grpo_trainer.py`` ``GRPOTrainer.get_gamma_weights`` and ``_compute_loss``
with ``loss_type="vespo"`` (the installed wheel; TRL states it matches the authors' implementation, down to the
1e-8 floor of the weight).

    log w_i = clamp( sum_t clamp(d_t, -20, 20), log 1e-8, 20 )       (the product ratio of the sequence, no mean)
    (k, lam) = (k_pos, lam_pos) if A >= 0 else (k_neg, lam_neg)      (lam floored at 1e-4)
    phi_i   = exp(lam + k log w_i - lam w_i) = e^lam w^k e^{-lam w}   (Gamma shape, phi(1) = 1; detached; NaN/inf -> 0)
    l_t     = -phi_i A_t logp_t                 loss = aggregate(l, aggregation), default token_mean (TRL's vespo
                                                normalises like dapo, by the optimizer step's tokens)
    grad    = -phi_i A_t grad logp_t / N_tokens

phi peaks at w = k / lam (2/3 for A >= 0, 3/2 for A < 0 at the defaults) and vanishes for w -> 0 and w -> inf: a
sample far off-policy in either direction is softly dropped. Defaults k_pos 2, lam_pos 3, k_neg 3, lam_neg 2 (TRL's
``vespo_*``). Advantages per sequence or per token (the sign of A_t picks k, lam, as TRL's broadcast).

Choices / differences: with TRL's vLLM importance sampling on, TRL adds sum_t log(IS ratio) of the sampler mismatch
into log w (token modes only) and does not multiply the loss by the IS ratio; here the loop's rollout correction
(``PolicyBatch.correction``) weights the per-token loss as for every objective, so the two differ when a correction
is on (equal without one: tested). The loss value is not a surrogate (it contains logp); its gradient is. No token is
hard-clipped: clip fractions are 0; ``vespo_phi_mean`` = mean of phi over valid sequences (TRL's
``vespo/phi_seq_mean``), ``vespo_phi_min``; ratio metrics over w_i.
"""

from __future__ import annotations

import math

import torch

from objectives.base import (
    Objective,
    PolicyBatch,
    aggregate,
    clip_metrics,
    masked,
    ratio_metrics,
    register_objective,
)

LOG_W_FLOOR = math.log(1e-8)  # TRL's (and the authors') lower clamp of log w
LOG_CLAMP = 20.0
LAMBDA_FLOOR = 1e-4


def gamma_weights(batch: PolicyBatch, k_pos: float, lam_pos: float, k_neg: float, lam_neg: float):
    """(phi [B, T] detached, w [B]): VESPO's weight of each token (its sequence's, by the sign of its A) and the
    clamped sequence ratio."""
    d = batch.log_ratio().detach().clamp(-LOG_CLAMP, LOG_CLAMP)
    log_w = d.sum(-1, keepdim=True).clamp(LOG_W_FLOOR, LOG_CLAMP)
    w = torch.exp(log_w)
    nonneg = batch.token_advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg).to(d.dtype)
    lam = torch.where(nonneg, lam_pos, lam_neg).to(d.dtype).clamp(min=LAMBDA_FLOOR)
    phi = torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return phi, w.squeeze(-1)


@register_objective("vespo")
class VESPO(Objective):
    ratio_level = "other"
    ratio_note = "a Gamma-shaped weight of the sequence's product ratio"

    k_pos: float = 2.0  # Gamma shape k of the sequence weight for A >= 0 (the weight peaks at w = k / lambda)
    lambda_pos: float = 3.0  # Gamma rate lambda of the sequence weight for A >= 0 (floored at 1e-4)
    k_neg: float = 3.0  # Gamma shape k of the sequence weight for A < 0
    lambda_neg: float = 2.0  # Gamma rate lambda of the sequence weight for A < 0 (floored at 1e-4)

    default_advantage = "grpo"
    default_aggregation = "token_mean"

    def policy_loss(self, batch: PolicyBatch):
        mask = batch.mask
        phi, w = gamma_weights(batch, self.k_pos, self.lambda_pos, self.k_neg, self.lambda_neg)
        per_token = -phi * batch.token_advantages * masked(batch.logp, mask)
        loss = aggregate(per_token, batch, self.aggregation)
        none = torch.zeros_like(mask)
        valid = mask.any(-1)
        phi_seq = phi[:, 0] if batch.advantages.dim() == 1 else masked(phi, mask).sum(-1) / batch.lengths
        metrics = clip_metrics(none, none, batch)
        metrics["vespo_phi_mean"] = phi_seq[valid].mean().item() if valid.any() else float("nan")
        metrics["vespo_phi_min"] = phi_seq[valid].min().item() if valid.any() else float("nan")
        return loss, {**metrics, **ratio_metrics(w, valid)}
