"""TBPO — Trust-Band Policy Optimization, from QaRL (Gu et al., "QaRL: Rollout-Aligned Quantization-Aware RL for
Fast and Stable Training under Training-Inference Mismatch", arXiv 2604.07853). No public code; the paper's
description: a sequence-level objective, the geometric-mean sequence ratio against the proximal (trainer)
policy times a sequence-level training-inference mismatch weight, sequences outside a trust band dropped,
and a dual clip for negative samples. Its equations and defaults could not be consulted while writing this
file: every formula detail and every default below is OUR CHOICE, stated so it can be checked against the paper.

    s_i   = exp((1/L_i) sum_t (logp_t - old_logp_t))          geometric-mean sequence ratio vs the proximal policy
                                                               (old_logp = the trainer's recomputed log-probs)
    w_i   = exp((1/L_i) sum_t (old_logp_t - sampler_logp_t))  sequence mismatch weight, proximal vs the sampler
                                                               (quantised / bf16 / vLLM), a constant (no gradient)
    keep_i = band_low <= w_i <= band_high                     the trust band; other sequences are dropped
    l_i   = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high))                     (GSPO's clip)
    l_i   = min(l_i, -A_i clip_ratio_c)        where A_i < 0                               (dual clip, as verl)
    loss  = aggregate_i( keep_i * w_i * l_i )                 (default: mean over sequences, dropped ones count 0)

Choices (ours, not the paper's verified text):
- the mismatch weight multiplies the clipped loss (decoupled PPO, as verl's rollout-correction weights
  multiply ``pg_losses``), it is the geometric mean over tokens (the same length normalisation as s_i), and
  it is not truncated beyond the band; the band applies to w_i only (the policy ratio s_i has the clip);
- a dropped sequence keeps its place in the denominator (N_seqs / N_tokens), like masked importance sampling;
- defaults: clip_low = 3e-4, clip_high = 4e-4 (GSPO's, for the same geometric-mean ratio), clip_ratio_c = 3
  (verl's dual clip; must be > 1), band [band_low, band_high] = [0.9, 1.1] (about +-0.1 nats/token of
  average sampler-trainer disagreement);
- fallback: ``PolicyBatch.sampler_logp`` None (the sampler's log-probs are the proximal ones: no separate
  sampler, or the loop recomputed nothing) gives w_i = 1 for every sequence: nothing is dropped and the
  objective is GSPO with a dual clip.
- with the loop's rollout correction on (``train.rollout_correction.mode`` not none) the loop passes no
  ``sampler_logp``: the sampler difference is corrected once, by the loop's weight (``PolicyBatch.correction``,
  applied by ``sequence_loss`` like for every objective), and TBPO's own w_i and band are off (w_i = 1). TBPO's
  trust band itself needs ``train.old_logp: recompute`` and ``rollout_correction.mode: none``.
Advantages must be per sequence. Clip fractions over valid tokens, counting tokens whose gradient is removed
(disjoint): ``tbpo_drop_frac`` (tokens of dropped sequences), and among kept sequences clip_frac_high (A > 0,
s > 1 + clip_high), clip_frac_low (A < 0, s < 1 - clip_low), clip_frac_dual (A < 0, s > clip_ratio_c);
clip_frac is the sum of the four. Ratio metrics are over s_i; ``mismatch_weight_mean`` / ``_min`` / ``_max``
report w_i over valid sequences.
"""

from __future__ import annotations

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
    validate_dual_clip,
)


@register_objective("tbpo")
class TBPO(Objective):
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    clip_ratio_c: float = 3.0
    band_low: float = 0.9
    band_high: float = 1.1

    default_advantage = "grpo"
    default_aggregation = "seq_mean_token_mean"
    below_one = frozenset({"clip_low"})
    positive = frozenset({"band_high"})

    def validate(self):
        validate_dual_clip(self)
        if not self.band_low <= 1.0 <= self.band_high:
            raise ValueError(f"objective {self.name!r}: the trust band [band_low, band_high] must contain 1, got "
                             f"[{self.band_low}, {self.band_high}]")

    def policy_loss(self, batch: PolicyBatch):
        adv = sequence_advantages(batch, self.name)
        mask = batch.mask
        seq_ratio = torch.exp(batch.sequence_mean(batch.log_ratio()))
        if batch.sampler_logp is None:
            weight = torch.ones_like(seq_ratio)
        else:
            weight = torch.exp(batch.sequence_mean(masked(batch.old_logp - batch.sampler_logp, mask)))
        keep = (weight >= self.band_low) & (weight <= self.band_high)
        clipped = seq_ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        ppo = torch.maximum(-adv * seq_ratio, -adv * clipped)
        bound = -adv * self.clip_ratio_c
        per_sequence = torch.where(adv < 0, torch.minimum(ppo, bound), ppo)
        per_sequence = torch.where(keep, weight * per_sequence, torch.zeros_like(per_sequence))
        loss = sequence_loss(per_sequence, batch, self.aggregation)

        low = keep & (adv < 0) & (seq_ratio < 1.0 - self.clip_low)
        high = keep & (adv > 0) & (seq_ratio > 1.0 + self.clip_high)
        metrics = clip_metrics(low, high, batch)
        dual = clip_metrics(keep & (adv < 0) & (ppo > bound), ~keep, batch)
        metrics["clip_frac_dual"], metrics["tbpo_drop_frac"] = dual["clip_frac_low"], dual["clip_frac_high"]
        metrics["clip_frac"] += metrics["clip_frac_dual"] + metrics["tbpo_drop_frac"]
        valid = mask.any(-1)
        w = ratio_metrics(weight, valid, prefix="mismatch_weight")
        return loss, {**metrics, **ratio_metrics(seq_ratio, valid), "mismatch_weight_mean": w["mismatch_weight_mean"],
                      "mismatch_weight_min": w["mismatch_weight_min"], "mismatch_weight_max": w["mismatch_weight_max"]}
