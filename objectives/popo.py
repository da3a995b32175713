"""POPO — positive-only policy optimisation (arXiv 2605.06650): the tensor math of its loss, as pure functions.
Reference: the authors' momo1443/colm2026-POPO (commit 7f22607bcf406fe05e2667a0da6d74d0f6f6b311):
``src/popo/weights.py`` (``compute_popo_weights``, ``compute_sequence_log_probs``), ``src/popo/loss.py``
(``POPOLoss``), ``src/popo/ema.py`` (``EMATarget.update``), ``src/popo/trainer.py`` (``_masked_mean_pool``,
``_precompute_popo_weights``), ``configs/popo/default.yaml``.

NOT an objective yet (nothing here is registered): POPO trains extra parameters (a predictor MLP on the policy's
pooled hidden states), keeps an EMA copy of the policy (updated after each optimizer step) and reads hidden states
and entropies with gradient. The loop has no interface for an objective's own parameters, target model or hidden
states (issue 35, phase 2); these functions are what that objective will call, tested against the authors' code.

With positives S+(x) = {y : R(y) > tau_r} (tau_r = 0 for binary rewards) in each prompt's group:

    s(y)    = (1/|y|) sum_t logp_t(y)                                 (length-normalised, from the rollout policy)
    w(y)    = softmax_{y' in S+(x)} (s(y') / T)[y]  for y in S+(x), 0 otherwise       weight_mode "softmax" (Eq. 8)
    w(y)    = 1 / |S+(x)|                            for y in S+(x), 0 otherwise       weight_mode "uniform"
              (length_normalize: w / |y| renormalised over S+(x)); a group with no positive: all 0
    L_NLL   = sum_y w(y) sum_t (-logp_t(y)) / (number of tokens of the responses with w > 0)
    L_sim   = -sum_y w(y) cos(h_phi(z(y)), sg(z_target(y) + noise)) / max(sum_y w(y), 1e-8)
    L_ent   = -(mean entropy over valid tokens)
    L_POPO  = L_NLL + alpha L_sim + beta_entropy L_ent      (alpha 0.1, beta_entropy 0.01 in the authors' config)
    z(y)    = mean over y's valid tokens of the last-layer hidden states (``masked_mean_pool``)
    EMA     xi <- tau xi + (1 - tau) theta after each optimizer step (tau 0.995 in the config)

The weights are computed once per rollout batch without gradient (the authors' ``_precompute_popo_weights`` runs the
policy under ``torch.no_grad`` right after generation), so they are constants of the loss. The authors group by
contiguous blocks of ``num_generations``; here by ``group_ids`` (the same when the groups are contiguous, tested).
Their target-feature noise (std 0.02, training only) is drawn inside their loss; here it is an argument, so the
function is deterministic and the loop owns the random stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

WEIGHT_MODES = ("softmax", "uniform")
WEIGHT_SUM_EPS = 1e-8  # the authors' clamp of sum(w) in L_sim and of the renormalisation


def length_normalised_logp(logp: Tensor, mask: Tensor) -> Tensor:
    """s_i = sum_t mask * logp / max(L_i, 1) [B] (the authors' ``compute_sequence_log_probs``)."""
    m = mask.to(logp.dtype)
    return (logp * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def popo_weights(logp: Tensor, mask: Tensor, positive: Tensor, group_ids: Tensor, temperature: float = 1.0,
                 mode: str = "softmax", length_normalize: bool = False) -> Tensor:
    """w [B] (module docstring): self-normalised over each group's positives, 0 for negatives and for every
    response of a group with no positive; detached."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"POPO weight mode must be one of {WEIGHT_MODES}, got {mode!r}")
    positive = positive.bool()
    logp = logp.detach()
    _, index = torch.unique(group_ids, return_inverse=True)
    groups = int(index.max()) + 1 if index.numel() else 0
    if mode == "softmax":
        score = torch.where(positive, length_normalised_logp(logp, mask) / temperature,
                            torch.full_like(logp[:, 0], -torch.inf))
        top = torch.full((groups,), -torch.inf, dtype=score.dtype).scatter_reduce(0, index, score, "amax")
        shifted = torch.where(positive, torch.exp(score - top[index]), torch.zeros_like(score))
    else:
        shifted = positive.to(logp.dtype)
    total = torch.zeros(groups, dtype=shifted.dtype).index_add_(0, index, shifted)
    weights = torch.where(positive, shifted / total[index].clamp(min=torch.finfo(shifted.dtype).tiny),
                          torch.zeros_like(shifted))
    if length_normalize:
        weights = weights / mask.to(weights.dtype).sum(-1).clamp(min=1.0)
        total = torch.zeros(groups, dtype=weights.dtype).index_add_(0, index, weights)
        weights = weights / total[index].clamp(min=WEIGHT_SUM_EPS)
    return weights


def popo_nll(logp: Tensor, mask: Tensor, weights: Tensor) -> Tensor:
    """L_NLL: the weighted negative log-likelihood over the positives' tokens, normalised by their token count."""
    m = mask.to(logp.dtype)
    weighted = weights[:, None] * torch.where(mask.bool(), -logp, torch.zeros_like(logp)) * m
    count = ((weights > 0)[:, None].to(m.dtype) * m).sum().clamp(min=1.0)
    return weighted.sum() / count


def popo_similarity(predicted: Tensor, target: Tensor, weights: Tensor, noise: Tensor | None = None) -> Tensor:
    """L_sim: minus the weighted cosine between the predictor's output h_phi(z) [B, D] and the stop-gradient EMA
    target features (+ ``noise``, the authors' Gaussian N(0, 0.02^2) in training), normalised by sum(w)."""
    target = target.detach() if noise is None else target.detach() + noise
    cos = (F.normalize(predicted, dim=-1) * F.normalize(target, dim=-1)).sum(-1)
    return -(weights * cos).sum() / weights.sum().clamp(min=WEIGHT_SUM_EPS)


def popo_entropy(entropies: Tensor, mask: Tensor) -> Tensor:
    """L_ent = -mean entropy over the valid tokens (minimising it raises the entropy)."""
    m = mask.to(entropies.dtype)
    return -(entropies * m).sum() / m.sum().clamp(min=1.0)


def popo_loss(logp: Tensor, mask: Tensor, weights: Tensor, entropies: Tensor, predicted: Tensor, target: Tensor,
              alpha: float = 0.1, beta_entropy: float = 0.01, noise: Tensor | None = None) -> Tensor:
    """L_POPO = L_NLL + alpha L_sim + beta_entropy L_ent (the authors' ``POPOLoss.__call__``)."""
    return (popo_nll(logp, mask, weights) + alpha * popo_similarity(predicted, target, weights, noise)
            + beta_entropy * popo_entropy(entropies, mask))


def masked_mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """z [B, D]: the mean of the hidden states [B, T, D] over each response's valid tokens."""
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


@torch.no_grad()
def ema_update(target: list[Tensor], online: list[Tensor], tau: float) -> None:
    """xi <- tau xi + (1 - tau) theta, in place, parameter by parameter (the authors' ``EMATarget.update``)."""
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"EMA tau must be in [0, 1], got {tau}")
    for xi, theta in zip(target, online, strict=True):
        xi.mul_(tau).add_(theta.to(xi.device), alpha=1.0 - tau)
