"""TBPO — Trust-Band Policy Optimization, from QaRL (Gu et al., "QaRL: Rollout-Aligned Quantization-Aware RL for
Fast and Stable Training under Training-Inference Mismatch", arXiv 2604.07853v1; ACL 2026 Findings). No public code.

What the public descriptions of TBPO say (the paper's abstract and the opening of its §1, and secondary summaries:
arxivlens.com, newx.sg, layerthelatestinalattice.com; no method section, no equation, no code):
- QaRL reduces the training-inference mismatch of quantised rollouts upstream, by running the trainer's forward
  pass with the same quantisation as the rollout engine (abstract);
- quantised rollouts produce repetitive / garbled "error tokens" in long responses, and TBPO is introduced
  against them: "a sequence-level objective with dual clipping for negative samples", meant to keep updates
  within the trust region (abstract, arxivlens); "a dual-clipping trust band mechanism to suppress erroneous
  token generation" (newx.sg); "sequence-level clipping" (arxivlens, limitations).
Everything else below — the form of the sequence ratio, the mismatch weight, what the "band" bounds, the
handling of sequences outside it, the aggregation and every default — is OUR READING, unverified against the
paper's equations; each choice is listed with its alternative.

The dual clip. PPO's clip bounds a negative sample's ratio from below only (1 - clip_low);
a dual clip bounds it from above, so negative samples are held in a band [1 - clip_low, c] — our reading of the
"trust band" of "dual clipping for negative samples". On the geometric-mean sequence ratio that band must be on
the ratio's own scale: verl's constant c = 3 fires only when the mean log-ratio exceeds ln 3 = 1.1 nats per token,
i.e. never in practice at GSPO's 3e-4 / 4e-4 clip range (tested), which made TBPO GSPO times a banded mismatch
weight, close to the "MIS GSPO" baseline the paper reports beating. Default ``clip_ratio_c = 0``: c = 1 + clip_high,
the band's upper edge, so a negative sample is clipped on both sides of [1 - clip_low, 1 + clip_high] (its loss is
constant, without gradient, outside the band; a positive sample is clipped above only, as PPO). Alternative:
``clip_ratio_c = 3`` (verl's dual-clip constant; any value > 1).

    s_i   = exp((1/L_i) sum_t (logp_t - old_logp_t))          geometric-mean sequence ratio vs the proximal policy
                                                               (old_logp = the trainer's recomputed log-probs)
    w_i   = exp((1/L_i) sum_t (old_logp_t - sampler_logp_t))  sequence mismatch weight, proximal vs the sampler
                                                               (quantised / bf16 / vLLM), a constant (no gradient)
    keep_i = band_low <= w_i <= band_high                     the trust band (edges inclusive); others dropped
    l_i   = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high))                     (GSPO's clip)
    l_i   = min(l_i, -A_i c)                   where A_i < 0,  c = clip_ratio_c or 1 + clip_high   (dual clip)
    loss  = aggregate_i( keep_i * w_i * l_i )                 (default: mean over sequences, dropped ones count 0)

Gradient per region (kept sequence, seq-mean aggregation over N sequences): d loss / d logp_t =
-A_i w_i s_i / (N L_i) where the unclipped term is the active one — A > 0 with s <= 1 + clip_high, A < 0 with
1 - clip_low <= s <= c — and 0 where the clip (A > 0, s > 1 + clip_high; A < 0, s < 1 - clip_low) or the dual clip
(A < 0, s > c) holds the loss constant, and 0 for a dropped sequence.

Choices (ours) and their alternatives:
- sequence ratio: the length-normalised (geometric-mean) ratio of GSPO, against the proximal policy. Alternative:
  the plain product ratio, or the ratio against the sampler itself (then w_i is folded into s_i and clipped);
- mismatch: a separate detached weight w_i, the geometric mean over tokens, multiplying the clipped loss (decoupled
  PPO, as verl's rollout-correction weights multiply ``pg_losses``), not truncated inside the band. Alternative
  reading: no w_i at all — the paper's abstract puts the mismatch on QaRL's aligned forward, and the "trust band"
  may be only the ratio's band [1 - clip_low, 1 + clip_high] closed above by clip_ratio_c for A < 0; that
  objective is exactly this one with w_i = 1 (no ``sampler_logp``);
- the band bounds w_i only (the policy ratio s_i has the clip); a sequence outside it is dropped (masked IS; whole
  sequences, like Trust Region Masking, arXiv 2512.23075), not truncated to the edge; it keeps its place in the
  denominator (N_seqs / N_tokens);
- defaults: clip_low = 3e-4, clip_high = 4e-4 (GSPO's, for the same geometric-mean ratio), c = 1 + clip_high
  (above; ``clip_ratio_c`` 0, or a constant > 1), band [band_low, band_high] = [0.9, 1.1] (about +-0.1 nats/token of
  average sampler-trainer disagreement); none of them is the paper's (its values could not be read);
- fallback: ``PolicyBatch.sampler_logp`` None (the sampler's log-probs are the proximal ones: no separate
  sampler, or the loop recomputed nothing) gives w_i = 1 for every sequence: nothing is dropped and the
  objective is GSPO with a dual clip;
- with the loop's rollout correction on (``train.rollout_correction.mode`` not none; ``PolicyBatch.
  behaviour_corrected``) the sampler difference is corrected once, by the loop's weight (``PolicyBatch.correction``,
  applied by ``sequence_loss`` like for every objective), and TBPO's own w_i and band are off (w_i = 1). TBPO's
  trust band itself needs ``train.old_logp: recompute`` and ``rollout_correction.mode: none``;
- a dropped sequence's weight is zeroed before it multiplies the loss, so an infinite w_i (a sampler log-prob of
  -inf) drops the sequence without a NaN gradient.
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
)


@register_objective("tbpo")
class TBPO(Objective):
    ratio_level = "sequence"  # GSPO's geometric-mean ratio

    needs_sequence_advantages = True  # one A_i per sequence (sequence_advantages)

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    clip_ratio_c: float = 0.0  # 0: c = 1 + clip_high (the band's top edge); > 1: a constant (verl's 3)
    band_low: float = 0.9
    band_high: float = 1.1

    default_advantage = "grpo"
    default_aggregation = "seq_mean_token_mean"
    below_one = frozenset({"clip_low"})
    positive = frozenset({"band_high"})

    def validate(self):
        if 0.0 < self.clip_ratio_c <= 1.0:
            raise ValueError(f"objective {self.name!r}: hyperparameter clip_ratio_c must be 0 (c = 1 + clip_high, the "
                             f"band's top edge) or > 1 (a constant dual-clip bound, verl's 3), got {self.clip_ratio_c}")
        if not self.band_low <= 1.0 <= self.band_high:
            raise ValueError(f"objective {self.name!r}: the trust band [band_low, band_high] must contain 1, got "
                             f"[{self.band_low}, {self.band_high}]")

    def policy_loss(self, batch: PolicyBatch):
        adv = sequence_advantages(batch, self.name)
        mask = batch.mask
        seq_ratio = torch.exp(batch.sequence_mean(batch.log_ratio()))
        if batch.sampler_logp is None or batch.behaviour_corrected:
            weight = torch.ones_like(seq_ratio)
        else:
            weight = torch.exp(batch.sequence_mean(masked(batch.old_logp - batch.sampler_logp, mask)))
        keep = (weight >= self.band_low) & (weight <= self.band_high)
        clipped = seq_ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        ppo = torch.maximum(-adv * seq_ratio, -adv * clipped)
        bound = -adv * (self.clip_ratio_c or 1.0 + self.clip_high)
        per_sequence = torch.where(adv < 0, torch.minimum(ppo, bound), ppo)
        kept_weight = torch.where(keep, weight, torch.zeros_like(weight))
        per_sequence = kept_weight * per_sequence
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
