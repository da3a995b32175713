"""GSPO — Zheng et al., "Group Sequence Policy Optimization" (arXiv 2507.18071): sequence-level ratio, clip.

    log s_i = (1/L_i) sum_t (logp_t - old_logp_t)            (length-normalised sequence ratio)
    J = mean_i min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i),     loss = -J
    grad = s_i A_i (1/L_i) sum_t grad logp_t   for unclipped sequences; clipping removes whole responses.

Defaults clip_low = 3e-4, clip_high = 4e-4 (the paper's). Advantages must be per sequence.

Options:
- ``aggregation`` (default seq_mean_token_mean = the paper's mean over sequences, and verl's ``gspo``, which
  hard-codes seq-mean-token-mean whatever its ``loss_agg_mode``): with token_mean the loss is
  sum_i L_i l_i / N_tokens, TRL's sequence-level loss (``importance_sampling_level="sequence"``) with
  ``loss_type="dapo"`` (or ``"bnpo"`` over one micro-batch), tested against a transcription of TRL 1.16's
  ``_compute_loss``; seq_mean_token_sum (sum_i L_i l_i / N_seqs) is TRL's ``luspo`` (objective ``luspo``).
- ``cap_log_ratio`` (off by default) / ``log_ratio_cap`` (10): verl's numerical-safety cap,
  log s_i = min((1/L_i) sum_t d_t, log_ratio_cap). A capped sequence keeps the loss -A exp(cap) (A < 0;
  A > 0 is clipped anyway) and has no gradient; ``clip_frac_cap`` (tokens of capped sequences with A < 0)
  is reported when the cap is on and included in ``clip_frac``. Off by default so that ``gspo`` stays the
  paper's formula; with logp - old_logp averaging above 10 nats/token it only matters for diverged policies.

Alias ``luspo`` (LUSPO, Liu et al., "Length-Unbiased Sequence Policy Optimization", arXiv 2602.05261; reference
TRL 1.16's ``loss_type="luspo"`` with ``importance_sampling_level="sequence"``, ``_compute_loss``, the installed
wheel; the authors' murphy4122/LUSPO verl ``core_algos.py`` could not be read here): this objective with
``aggregation=seq_mean_token_sum`` by default, loss = sum_i L_i l_i / N_seqs (TRL: ``(per_token_loss * mask)
.sum(-1).mean()`` with a (B, 1) loss). GSPO's mean over sequences gives a long response less weight per token; the
L_i factor makes the per-token weight length-independent. Clip defaults GSPO's 3e-4 / 4e-4 (our reading: LUSPO
modifies GSPO; TRL's ``epsilon`` 0.2 is its default for every loss type).
"""

from __future__ import annotations

import torch

from objectives.base import (
    Objective,
    PolicyBatch,
    clip_metrics,
    ratio_metrics,
    register_objective,
    sequence_advantages,
    sequence_loss,
)


@register_objective("gspo")
class GSPO(Objective):
    ratio_level = "sequence"  # the geometric mean of the token ratios

    needs_sequence_advantages = True  # one A_i per sequence (sequence_advantages)

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    cap_log_ratio: bool = False
    log_ratio_cap: float = 10.0

    default_advantage = "grpo"
    default_aggregation = "seq_mean_token_mean"
    below_one = frozenset({"clip_low"})
    positive = frozenset({"log_ratio_cap"})

    def policy_loss(self, batch: PolicyBatch):
        adv = sequence_advantages(batch, self.name)
        log_seq = batch.sequence_mean(batch.log_ratio())
        capped = log_seq > self.log_ratio_cap if self.cap_log_ratio else torch.zeros_like(adv, dtype=torch.bool)
        if self.cap_log_ratio:
            log_seq = log_seq.clamp(max=self.log_ratio_cap)
        seq_ratio = torch.exp(log_seq)
        clipped = seq_ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        per_sequence = torch.maximum(-seq_ratio * adv, -clipped * adv)
        low = (seq_ratio < 1.0 - self.clip_low) & (adv < 0)
        high = (seq_ratio > 1.0 + self.clip_high) & (adv > 0)
        valid = batch.mask.any(-1)
        loss = sequence_loss(per_sequence, batch, self.aggregation)
        metrics = clip_metrics(low, high, batch)
        if self.cap_log_ratio:
            metrics["clip_frac_cap"] = clip_metrics(capped & (adv < 0), capped & (adv < 0), batch)["clip_frac_low"]
            metrics["clip_frac"] += metrics["clip_frac_cap"]
        return loss, {**metrics, **ratio_metrics(seq_ratio, valid)}


@register_objective("luspo")
class LUSPO(GSPO):
    """LUSPO: ``gspo`` with seq_mean_token_sum aggregation (module docstring)."""

    default_aggregation = "seq_mean_token_sum"
