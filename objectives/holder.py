"""HölderPO — Hölder-mean policy optimisation (arXiv 2605.12058); reference: YihangChen9/HolderPO
(train_zero_math_holder.py, ``critic_type_modify=holder``, ``holder_p_schedule=linear_dec``).

    p       = p_start + (p_end - p_start) * min(1, step / total_steps)      (linear anneal, 2 -> -2)
    rho_i   = ( (1/L_i) sum_t mask * r_t^p )^(1/p)          (power mean of the token ratios, |p| >= 1e-6)
            = exp( (logsumexp_t(p d_t) - log L_i) / p )      (computed this way, stable for any d)
    rho_i   = exp( (1/L_i) sum_t d_t )                       (|p| < 1e-6: geometric mean = GSPO's ratio)
    loss    = mean_i max(-A_i rho_i, -A_i clip(rho_i, 1 - clip_low, 1 + clip_high))
    grad    = -A_i rho_i softmax_t(p d)_t grad logp_t  for unclipped sequences (1/L_i weights at p = 0)

p > 1 leans towards the largest token ratios, p < 0 towards the smallest; p = 1 is the arithmetic mean.
Defaults p_start = 2, p_end = -2 (the released script's ``linear_dec`` between holder_p_max/min) and the
sequence-level clip 0.2 / 0.2 (the script's cliprange), i.e. rho in [0.8, 1.2]. The schedule uses
``PolicyBatch.step`` / ``total_steps`` (the authors: optimizer steps / holder_p_schedule_steps, clamped
at 1). Advantages must be per sequence. Clipping removes whole sequences: clip_frac_high = tokens of
sequences with A > 0 and rho > 1 + clip_high, clip_frac_low = A < 0 and rho < 1 - clip_low. Ratio
metrics are over rho_i; ``holder_p`` reports the exponent used.
"""

from __future__ import annotations

import math

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

GEOMETRIC_EPS = 1e-6  # |p| below this uses the geometric mean (the p -> 0 limit)


@register_objective("holder")
class HolderPO(Objective):
    p_start: float = 2.0
    p_end: float = -2.0
    clip_low: float = 0.2
    clip_high: float = 0.2

    default_advantage = "grpo"
    signed = frozenset({"p_start", "p_end"})
    below_one = frozenset({"clip_low"})

    def exponent(self, batch: PolicyBatch) -> float:
        progress = min(1.0, max(0, batch.step) / max(1, batch.total_steps))
        return self.p_start + (self.p_end - self.p_start) * progress

    def policy_loss(self, batch: PolicyBatch):
        adv = sequence_advantages(batch, self.name)
        p = self.exponent(batch)
        d = batch.log_ratio()
        if abs(p) < GEOMETRIC_EPS:
            log_rho = batch.sequence_mean(d)
        else:
            empty = ~batch.mask.any(-1, keepdim=True)
            scaled = torch.where(batch.mask | empty, p * d, torch.full_like(d, -math.inf))
            log_rho = (torch.logsumexp(scaled, dim=-1) - torch.log(batch.lengths)) / p
            log_rho = torch.where(empty.squeeze(-1), torch.zeros_like(log_rho), log_rho)
        seq_ratio = torch.exp(log_rho)
        clipped = seq_ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        loss = sequence_aggregate(torch.maximum(-adv * seq_ratio, -adv * clipped), batch)
        low = (seq_ratio < 1.0 - self.clip_low) & (adv < 0)
        high = (seq_ratio > 1.0 + self.clip_high) & (adv > 0)
        valid = batch.mask.any(-1)
        return loss, {**clip_metrics(low, high, batch), **ratio_metrics(seq_ratio, valid), "holder_p": p}
