"""FIPO — Future-KL Influenced Policy Optimization (arXiv 2603.19835): PPO's clipped surrogate with each token's
advantage scaled by a bounded weight of the discounted log-ratio drift of the rest of its response.
Reference: the authors' verl loss ``compute_policy_loss_future_kl`` (``loss_mode=future_kl``, FIPO-main
``verl/trainer/ppo/core_algos.py``; the authors' repository qwenpilot/FIPO could not be read here: the function was
read in third-party copies that vendor it unchanged, with the official 32B script's settings listed beside it);
ms-swift's port ``swift/rlhf_trainers/grpo_trainer.py`` ``_compute_fipo_influence`` (``loss_type fipo``,
modelscope/ms-swift 3602360a562313afbf2ef6065fdf61f271a2c5b9, docs ``Instruction/GRPO/AdvancedResearch/FIPO.md``).

With d_t = clamp(logp_t - old_logp_t, -20, 20), r_t = exp(d_t), gamma = 2^(-1 / decay_rate), c = clip_ratio_c:

    F_t  = sum_{k >= t} gamma^(k - t) m_k 1[d_k <= log c] d_k        (future KL: tokens with r > c do not take part)
    w_t  = sg(clip(exp(F_t), 1 - eps_f, 1 + eps_f))     influence_clip_high_only false
         = sg(clip(exp(F_t), 1, 1 + eps_f))             true (the 32B script's)
         = sg(min(exp(F_t), 10))                        influence_clip = 0
    w_t  = clip(w_t, 0.8, 1.0)  where A_t < 0 and r_t > safety_threshold        (no amplification of such tokens)
    Â_t  = A_t w_t
    l_t  = max(-Â_t r_t, -Â_t clip(r_t, 1 - clip_low, 1 + clip_high));   l_t = min(l_t, -Â_t c) where Â_t < 0
    drop sequence i when it has more than one token with A_t < 0 and r_t > c (dual-clipped)
    loss = aggregate(l * keep, aggregation)      (default token_mean, the DAPO scaffold's; no gradient through w)

Defaults are the official 32B script's (as listed with the vendored function and in ms-swift's docs): clip_low 0.2,
clip_high 0.28, decay_rate 32 (a half-life of 32 tokens), influence_clip 0.2 with high-only clipping, safety_threshold
10, clip_ratio_c 10 (ms-swift: "delta 10.0 to match the official 32B script"); the function's own fallbacks are
decay_rate 128, safety_thresh 4, clip_ratio_c 3 (verl's), settings here.

Our choices, where the loop differs from the authors' verl trainer:
- a dropped sequence keeps its place in the token / sequence counts (as every mask here: objectives/base.py); the
  authors' token-mean divides by the kept tokens only, so where a sequence is dropped their loss is ours times
  N_tokens / N_kept (tested). It enters the loss through the rollout-correction factor, so it is applied exactly as a
  rollout correction's 0 weight would be.
- the future KL runs over the whole completion (the authors' chunked matrix product over the response, equal up to
  summation order, tested in float64).
ms-swift's port differs from the authors': its ``delta`` caps the ratio at c for both signs of A instead of the dual
clip and it drops no sequence; its influence weight is the same, except that with ``fipo_clip_range`` 0 it leaves
exp(F) uncapped where the authors' (and ours) cap it at 10 (ms-swift's port is not implemented).
Metrics: PPO's clip fractions (``clip_frac_dual``: A < 0 and r > c, included in ``clip_frac``), ``fipo_weight_mean``
(w over valid tokens), ``fipo_weight_raw_mean`` (exp(F) before clipping), ``fipo_dropped_frac`` (the dropped
sequences' share of valid tokens), ratio metrics over r.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from objectives.base import Objective, PolicyBatch, masked, ppo_clipped_loss, register_objective, validate_dual_clip

LOG_RATIO_CLAMP = 20.0  # the authors' clamp of logp - old_logp (verl's)
UNCLIPPED_WEIGHT_CAP = 10.0  # the authors' cap on exp(F) when influence_clip = 0
SAFETY_WEIGHT_RANGE = (0.8, 1.0)  # the authors' clamp of the weight of a negative token with a high ratio


def future_kl(d: Tensor, mask: Tensor, gamma: float, ratio_c: float) -> Tensor:
    """F_t = sum_{k >= t} gamma^(k - t) m_k 1[d_k <= log c] d_k, [B, T] (detached; module docstring)."""
    part = torch.where(mask & (d <= math.log(ratio_c)), d, torch.zeros_like(d)).detach()
    positions = torch.arange(d.shape[-1], device=d.device)
    distance = (positions[None, :] - positions[:, None]).to(d.dtype)  # [t, k] = k - t
    decay = torch.where(distance >= 0, torch.full((), gamma, dtype=d.dtype, device=d.device).pow(distance.clamp(min=0)),
                        0.0)
    return part @ decay.T


@register_objective("fipo")
class FIPO(Objective):
    clip_low: float = 0.2  # PPO's lower ratio clip width eps_low (the 32B script's clip_ratio_low)
    clip_high: float = 0.28  # PPO's upper ratio clip width eps_high (the 32B script's clip_ratio_high, DAPO's)
    clip_ratio_c: float = 10.0  # dual-clip bound c for A < 0; tokens with r > c also leave the future KL (> 1)
    decay_rate: float = 32.0  # half-life in tokens of the future-KL discount: gamma = 2^(-1 / decay_rate)
    influence_clip: float = 0.2  # eps_f: the influence weight clipped to [1 - eps_f, 1 + eps_f]; 0: only capped at 10
    influence_clip_high_only: bool = True  # clip the influence weight to [1, 1 + eps_f] (the 32B script's)
    safety_threshold: float = 10.0  # a token with A < 0 and a ratio above this gets its weight clipped to [0.8, 1]

    default_advantage = "grpo"
    default_aggregation = "token_mean"
    below_one = frozenset({"clip_low"})
    positive = frozenset({"decay_rate", "safety_threshold"})

    def validate(self):
        validate_dual_clip(self)
        if self.influence_clip >= 1 and not self.influence_clip_high_only:
            raise ValueError(f"objective 'fipo': hyperparameter influence_clip must be < 1 when clipping both sides "
                             f"(the weight's floor 1 - influence_clip > 0), got {self.influence_clip}")

    def influence_weights(self, d: Tensor, batch: PolicyBatch) -> tuple[Tensor, Tensor]:
        """(w, exp(F)) [B, T], w detached (module docstring)."""
        raw = torch.exp(future_kl(d, batch.mask, 2.0 ** (-1.0 / self.decay_rate), self.clip_ratio_c))
        if self.influence_clip:
            low = 1.0 if self.influence_clip_high_only else 1.0 - self.influence_clip
            weight = raw.clamp(low, 1.0 + self.influence_clip)
        else:
            weight = raw.clamp(max=UNCLIPPED_WEIGHT_CAP)
        guarded = (batch.token_advantages < 0) & (torch.exp(d) > self.safety_threshold)
        return torch.where(guarded, weight.clamp(*SAFETY_WEIGHT_RANGE), weight).detach(), raw

    def policy_loss(self, batch: PolicyBatch):
        d = batch.log_ratio().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        weight, raw = self.influence_weights(d, batch)
        adv = batch.token_advantages
        dual = (adv < 0) & (torch.exp(d) > self.clip_ratio_c) & batch.mask
        keep = (dual.sum(-1) <= 1).to(d.dtype)[:, None].expand_as(d)  # a sequence with > 1 dual-clipped tokens goes
        weighted = dataclasses.replace(batch, advantages=adv * weight,
                                       correction=keep if batch.correction is None else batch.correction * keep)
        loss, metrics = ppo_clipped_loss(weighted, self.clip_low, self.clip_high, self.aggregation, log_ratio=d,
                                         clip_ratio_c=self.clip_ratio_c)
        n = batch.mask.sum().clamp(min=1).item()
        return loss, {**metrics, "fipo_weight_mean": masked(weight, batch.mask).sum().item() / n,
                      "fipo_weight_raw_mean": masked(raw, batch.mask).sum().item() / n,
                      "fipo_dropped_frac": ((keep == 0) & batch.mask).sum().item() / n}
