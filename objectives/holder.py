"""HölderPO — Hölder-mean policy optimisation (arXiv 2605.12058); reference: YihangChen9/HolderPO
(train_zero_math_holder.py at commit 1d27a3778cbc47144e88c95e3cbac6318fb06ee2, ``critic_type_modify`` =
``holder`` / ``sequence_w_clip`` / ``holder_token``, ``holder_p_schedule=linear_dec``).

Power mean of per-token values u_t (log-ratios) of sequence i, M_p(u) = log of the Hölder mean of exp(u):
    M_p(u)  = (logsumexp_t(p u_t) - log L_i) / p       (|p| >= 1e-6; = log((1/L_i) sum_t exp(u_t)^p)^(1/p))
    M_0(u)  = (1/L_i) sum_t u_t                        (|p| < 1e-6: geometric mean, GSPO's ratio)

variant = "holder" (default, the paper's HölderPO):
    rho_i   = exp(M_p(d))
    loss    = mean_i max(-A_i rho_i, -A_i clip(rho_i, 1 - clip_low, 1 + clip_high))
    grad    = -A_i rho_i softmax_t(p d)_t grad logp_t  for unclipped sequences (1/L_i weights at p = 0)
variant = "sequence_w_clip" (the authors' code): each token's log-ratio is first clipped,
    d'_t    = clamp(d_t, -log(1 + clip_low), log(1 + clip_high))     (authors: +-log(1 + cliprange))
    rho_i   = exp(M_p(d')),  then the same sequence-level PPO max; a clamped token has no gradient.
variant = "holder_token" (the authors' code): the PPO pessimism is applied per token, before the mean,
    u_t     = log min(r_t, clip(r_t)) = min(d_t, log(1 + clip_high))       if A_i > 0     (C_i)
    u_t     = log max(r_t, clip(r_t)) = max(d_t, log(1 - clip_low))        if A_i < 0     (D_i)
    loss    = mean_i -A_i exp(M_p(u))      (A_i = 0: 0); no sequence-level clip.
    (The authors take log(x + 1e-8) of the clipped ratios; the 1e-8 is dropped here: relative 1e-8.)

p schedule (linear from p_start to p_end, then held at p_end), ``p_schedule``:
    "run_length" (default): progress = min(1, step / total_steps) over the run's optimizer steps
                            (``PolicyBatch.step`` = optimizer steps done before this one, / ``total_steps``): the
                            authors' linear_dec shape on our time base, the run's length (p_start at the first
                            update, p_start + (p_end - p_start)(N - 1)/N at the last of N), so any run sweeps the
                            whole range; the authors' time base is a fixed 500 rollouts ("rollout_steps");
    "rollout_steps":        progress = min(1, k / holder_p_schedule_steps) at rollout k = rollout_step + 1
                            (counted from 1), the authors' schedule: their counter (oat's learner ``steps``)
                            advances once per learning step on a prompt batch, i.e. once per rollout, not per
                            optimizer step, and is already 1 during the first rollout's update (released
                            ``update_interval`` 1), so p(1/500) is their first exponent and p_end is reached at
                            rollout 500; their script sets ``holder_p_schedule_steps`` = 500 (the code's default
                            is 1000), after which p stays at holder_p_min. ``PolicyBatch.rollout_step`` counts the
                            rollouts done *before* this update (the loop passes step - 1, TRL's backend
                            global_step // optimizer steps per rollout, the lab 0 = the first rollout); a
                            ValueError if the loop does not pass it.
p > 1 leans towards the largest token ratios, p < 0 towards the smallest; p = 1 is the arithmetic mean.
Defaults p_start = 2, p_end = -2 (the released script's ``linear_dec`` between holder_p_max/min) and the
sequence-level clip 0.2 / 0.2 (the script's cliprange), i.e. rho in [0.8, 1.2]. Advantages must be per
sequence. ``aggregation`` (default seq_mean_token_mean = the mean over sequences, as the authors' loss with one
sequence per micro-batch) may be token_mean / seq_mean_token_sum_norm (l_i weighted by L_i, base.sequence_loss).
Clip fractions count the tokens whose gradient clipping removed, by the sign of A: "holder": tokens of clipped
sequences (A > 0 and rho > 1 + clip_high: high; A < 0 and rho < 1 - clip_low: low); "sequence_w_clip": those
plus the clamped tokens of the other sequences (``holder_token_clip_frac`` = fraction of tokens clamped, either
sign, the authors' ``logprobs_diff_clipfrac``); "holder_token": A > 0 and d > log(1 + clip_high) (high), A < 0
and d < log(1 - clip_low) (low). Ratio metrics are over rho_i; ``holder_p`` reports the exponent used.
"""

from __future__ import annotations

import math

import torch

from objectives.base import (
    Objective,
    PolicyBatch,
    clip_metrics,
    masked,
    ratio_metrics,
    register_objective,
    sequence_advantages,
    sequence_loss,
)

GEOMETRIC_EPS = 1e-6  # |p| below this uses the geometric mean (the p -> 0 limit)
VARIANTS = ("holder", "sequence_w_clip", "holder_token")
P_SCHEDULES = ("run_length", "rollout_steps")


def log_power_mean(u, batch: PolicyBatch, p: float):
    """M_p(u) per sequence [B]: the log of the Hölder p-mean of exp(u_t) over valid tokens (0 for an empty row)."""
    if abs(p) < GEOMETRIC_EPS:
        return batch.sequence_mean(u)
    empty = ~batch.mask.any(-1, keepdim=True)
    scaled = torch.where(batch.mask | empty, p * masked(u, batch.mask), torch.full_like(u, -math.inf))
    out = (torch.logsumexp(scaled, dim=-1) - torch.log(batch.lengths)) / p
    return torch.where(empty.squeeze(-1), torch.zeros_like(out), out)


@register_objective("holder")
class HolderPO(Objective):
    ratio_level = "other"
    ratio_note = "a power (Hölder) mean of token ratios"

    needs_sequence_advantages = True  # one A_i per sequence (sequence_advantages)

    p_start: float = 2.0
    p_end: float = -2.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    variant: str = "holder"
    p_schedule: str = "run_length"
    holder_p_schedule_steps: int = 500

    default_advantage = "grpo"
    default_aggregation = "seq_mean_token_mean"
    signed = frozenset({"p_start", "p_end"})
    below_one = frozenset({"clip_low"})

    def validate(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"objective {self.name!r}: variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.p_schedule not in P_SCHEDULES:
            raise ValueError(f"objective {self.name!r}: p_schedule must be one of {P_SCHEDULES}, "
                             f"got {self.p_schedule!r}")
        if self.holder_p_schedule_steps < 1:
            raise ValueError(f"objective {self.name!r}: holder_p_schedule_steps must be >= 1, "
                             f"got {self.holder_p_schedule_steps}")

    def exponent(self, batch: PolicyBatch) -> float:
        if self.p_schedule == "rollout_steps":
            if batch.rollout_step is None:
                raise ValueError(f"objective {self.name!r} with p_schedule='rollout_steps' needs "
                                 "PolicyBatch.rollout_step (rollout steps done)")
            rollout = max(0, batch.rollout_step) + 1  # the authors count rollouts from 1
            progress = min(1.0, rollout / self.holder_p_schedule_steps)
        else:
            progress = min(1.0, max(0, batch.step) / max(1, batch.total_steps))
        return self.p_start + (self.p_end - self.p_start) * progress

    def policy_loss(self, batch: PolicyBatch):
        adv = sequence_advantages(batch, self.name)
        p = self.exponent(batch)
        d = batch.log_ratio()
        mask, extra = batch.mask, {}
        up, down = math.log(1.0 + self.clip_high), math.log(1.0 - self.clip_low)
        if self.variant == "holder_token":
            u = torch.where((adv > 0)[:, None], d.clamp(max=up), d.clamp(min=down))
            seq_ratio = torch.exp(log_power_mean(u, batch, p))
            per_sequence = torch.where(adv != 0, -adv * seq_ratio, torch.zeros_like(seq_ratio))
            high = (adv > 0)[:, None] & (d > up)
            low = (adv < 0)[:, None] & (d < down)
        else:
            if self.variant == "sequence_w_clip":
                lower = -math.log(1.0 + self.clip_low)
                clamped = masked((d > up) | (d < lower), mask)
                d = d.clamp(lower, up)
                extra["holder_token_clip_frac"] = clamped.sum().item() / mask.sum().clamp(min=1).item()
            else:
                clamped = torch.zeros_like(mask)
            seq_ratio = torch.exp(log_power_mean(d, batch, p))
            clipped = seq_ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
            per_sequence = torch.maximum(-adv * seq_ratio, -adv * clipped)
            low = ((seq_ratio < 1.0 - self.clip_low)[:, None] | clamped) & (adv < 0)[:, None]
            high = ((seq_ratio > 1.0 + self.clip_high)[:, None] | clamped) & (adv > 0)[:, None]
        loss = sequence_loss(per_sequence, batch, self.aggregation)
        valid = mask.any(-1)
        return loss, {**clip_metrics(low, high, batch), **ratio_metrics(seq_ratio, valid), "holder_p": p, **extra}
