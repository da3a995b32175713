"""What the gradient lab measures, as pure functions of tensors (harness/apps/lab.py runs them; tests pin them by hand).

An objective's loss depends on the policy only through the log-probs of the sampled tokens, so its parameter
gradient is a weighted sum of the tokens' score functions:

    grad_theta L = sum_{i,t} c_it grad_theta logp_it,     c_it = dL / dlogp_it   (the objective's token weights)

:func:`token_weights` gets c by differentiating the loss with respect to a detached copy of logp; the lab then
forms the parameter gradient with one vector-Jacobian product (the forward pass is shared by every objective).
Everything below that reads "weights" reads c: which tokens carry gradient (c != 0), how evenly (Kish ESS), how
the gradient is shared by completion length and by tokens that PPO-clip would silence.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from objectives import PolicyBatch

PPO_CLIP = 0.2  # the reference clip range of grad_share_ppo_clipped: tokens PPO-clip(0.2) gives no gradient


def token_weights(objective, batch: PolicyBatch):
    """(c [B, T] = dL/dlogp, 0 on padding; the objective's output) for ``batch`` (its logp is detached here)."""
    logp = batch.logp.detach().requires_grad_(True)
    out = objective(dataclasses.replace(batch, logp=logp))
    (weights,) = torch.autograd.grad(out.loss, logp, allow_unused=True)
    weights = torch.zeros_like(logp) if weights is None else weights
    return torch.where(batch.mask, weights, torch.zeros_like(weights)), out


def reinforce_loss(logp: Tensor, mask: Tensor, advantages: Tensor) -> Tensor:
    """The REINFORCE estimate of -J: -(1/N) sum_i A_i sum_t logp_it. With leave-one-out advantages (RLOO) its
    gradient is an unbiased estimate of -grad E[R] over the batch's prompts (the lab's reference direction)."""
    per_sequence = torch.where(mask.bool(), logp, torch.zeros_like(logp)).sum(-1)
    return -(advantages.detach().to(logp.dtype) * per_sequence).sum() / logp.shape[0]


class CountSketch:
    """A fixed linear map S: R^n -> R^dim with E[<Sa, Sb>] = <a, b> (Charikar et al., 2002): coordinate j of the
    flattened parameters is added with a random sign to a random bucket, both drawn from one integer in
    [0, 2 dim) (bucket = k mod dim, sign = + if k < dim), seeded. Relative error of an inner product
    ~ 1/sqrt(dim). If n <= dim (or dim = 0) the map is the identity (exact). Identical gradients give identical
    sketches, so a cosine of 1 stays exactly 1."""

    def __init__(self, shapes: list[torch.Size], dim: int, seed: int):
        self.numel = sum(math.prod(s) for s in shapes)
        self.exact = dim == 0 or self.numel <= dim
        self.dim = self.numel if self.exact else dim
        generator = torch.Generator().manual_seed(seed)
        self.buckets = [] if self.exact else [torch.randint(0, 2 * dim, (math.prod(s),), generator=generator,
                                                            dtype=torch.int32) for s in shapes]

    def __call__(self, grads: list[Tensor]) -> Tensor:
        """The sketch (on the CPU, float32) of the gradient given as one tensor per parameter; computed on the
        gradients' device."""
        flat = [g.detach().reshape(-1).float() for g in grads]
        if self.exact:
            return torch.cat(flat).cpu()
        device = flat[0].device
        if self.buckets[0].device != device:
            self.buckets = [b.to(device) for b in self.buckets]
        out = torch.zeros(2 * self.dim, device=device)
        for g, buckets in zip(flat, self.buckets, strict=True):
            out.index_add_(0, buckets, g)
        return (out[: self.dim] - out[self.dim :]).cpu()


def kish_ess(weights: Tensor) -> float:
    """Kish's effective sample size (sum |w|)^2 / sum w^2 of the given weights (N if all equal; 0 if all 0)."""
    w = weights.abs().double()
    total = (w * w).sum()
    return (w.sum() ** 2 / total).item() if total > 0 else 0.0


def weight_metrics(weights: Tensor, batch: PolicyBatch, clip: float = PPO_CLIP) -> dict[str, float]:
    """Token-weight diagnostics of one objective on one batch (``weights`` = c from :func:`token_weights`):

    frac_tokens_with_grad     valid tokens with c != 0, as a fraction of the valid tokens
    ess_token_frac            Kish ESS of |c| over valid tokens / valid tokens      (1: every token weighs alike)
    ess_sequence_frac         Kish ESS of m_i = sum_t |c_it| over sequences / sequences
    grad_share_ppo_clipped    sum |c| over the tokens PPO-clip(``clip``) silences / sum |c|
                              (A > 0 and r > 1 + clip, or A < 0 and r < 1 - clip; r = exp(logp - old_logp))
    token_weight_long_over_short_wrong   among sequences with A_i < 0 (below their group: the wrong answers with
                              a 0/1 reward), mean_t |c_it| / |A_i| over those longer than the median length,
                              divided by the same over the others: 1 = no length bias per token; GRPO's 1/L_i
                              normalisation gives < 1 (long wrong answers are pushed down less per token)
    grad_share_long_wrong     sum |c| of the long wrong sequences / sum |c| of the wrong sequences
    """
    mask = batch.mask
    w = weights.abs().double()
    valid = w[mask]
    per_sequence = w.sum(-1)
    adv = batch.token_advantages.double()
    ratio = torch.exp(batch.log_ratio().double())
    silenced = mask & (((adv > 0) & (ratio > 1 + clip)) | ((adv < 0) & (ratio < 1 - clip)))
    total = valid.sum()
    metrics = {
        "frac_tokens_with_grad": (valid > 0).double().mean().item() if valid.numel() else float("nan"),
        "ess_token_frac": kish_ess(valid) / max(valid.numel(), 1),
        "ess_sequence_frac": kish_ess(per_sequence) / per_sequence.numel(),
        "grad_share_ppo_clipped": (w[silenced].sum() / total).item() if total > 0 else float("nan"),
        "frac_ppo_clipped": silenced.sum().item() / max(mask.sum().item(), 1),
    }
    return {**metrics, **length_bias(w, batch)}


def length_bias(abs_weights: Tensor, batch: PolicyBatch) -> dict[str, float]:
    """The two length-bias metrics of :func:`weight_metrics` (NaN when the wrong answers all have one length)."""
    nan = {"token_weight_long_over_short_wrong": float("nan"), "grad_share_long_wrong": float("nan")}
    if batch.advantages.dim() != 1:
        return nan
    lengths = batch.mask.sum(-1)
    wrong = (batch.advantages < 0) & (lengths > 0)
    if wrong.sum() < 2:
        return nan
    median = lengths[wrong].double().median()
    long, short = wrong & (lengths > median), wrong & (lengths <= median)
    if not long.any() or not short.any():
        return nan
    per_sequence = abs_weights.sum(-1)
    per_token = per_sequence / lengths.clamp(min=1) / batch.advantages.abs().double()
    mass = per_sequence[wrong].sum()
    return {"token_weight_long_over_short_wrong": (per_token[long].mean() / per_token[short].mean()).item(),
            "grad_share_long_wrong": (per_sequence[long].sum() / mass).item() if mass > 0 else float("nan")}


def ratio_by_position(logp: Tensor, old_logp: Tensor, mask: Tensor) -> list[dict]:
    """Variance across sequences of five log importance ratios at each completion position t = 1, 2, ...
    (sequences with at least t tokens; positions with fewer than 2 such sequences are left out):

    var_token          log r_t = d_t                              (GRPO's token ratio)
    var_cumulative     c_t = sum_{u <= t} d_u                     (CTPO's prefix ratio; its sd ~ sqrt(t) if the
                                                                   d_u are independent with equal variance)
    var_prefix_mean    c_t / t                                    (GSPO's ratio of the length-t prefix)
    var_sequence       c_{L_i}                                    (the whole sequence's ratio, PPO-sequence)
    var_sequence_mean  c_{L_i} / L_i                              (GSPO's length-normalised sequence ratio)
    """
    mask = mask.bool()
    d = torch.where(mask, logp.double() - old_logp.double(), torch.zeros_like(logp, dtype=torch.float64))
    cumulative = d.cumsum(-1)
    lengths = mask.sum(-1)
    sequence = cumulative.gather(-1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
    sequence_mean = sequence / lengths.clamp(min=1)
    rows = []
    for t in range(1, int(lengths.max()) + 1):
        alive = lengths >= t
        if alive.sum() < 2:
            break
        rows.append({"position": t, "sequences": int(alive.sum()),
                     "var_token": d[alive, t - 1].var().item(),
                     "var_cumulative": cumulative[alive, t - 1].var().item(),
                     "var_prefix_mean": (cumulative[alive, t - 1] / t).var().item(),
                     "var_sequence": sequence[alive].var().item(),
                     "var_sequence_mean": sequence_mean[alive].var().item()})
    return rows
