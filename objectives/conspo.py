"""ConSPO — Zhang et al., "Revisiting Reinforcement Learning with Verifiable Rewards from a Contrastive
Perspective" (arXiv 2605.12969): contrastive sequence-level policy optimisation. The paper's code is not
public; this is an implementation from its description, every unstated detail an explicit choice below.

    s_i    = (1/L_i) sum_t mask * logp_t                       (score: length-normalised sequence log-prob)
    P_g    = {i in g : A_i > 0},  N_g = {j in g : A_j <= 0}    (positives / negatives of prompt group g)
    m      = margin(step / total_steps)                         (curriculum: margin_start -> margin_end)
    l_i    = -log[ exp((s_i - m)/T) / (exp((s_i - m)/T) + sum_{j in N_g} exp(s_j / T)) ]
           = log(1 + sum_{j in N_g} exp((s_j - s_i + m) / T))  for i in P_g      (group-wise InfoNCE)
    loss   = (1/N_seqs) sum_{g} sum_{i in P_g} l_i              (per-sequence loss, 0 for negatives)

Gradient: a positive gets -(1/T)(1 - q_i) (1/L_i) grad logp (q_i = its InfoNCE probability: poorly separated
positives get larger updates); a negative j gets +(1/T) sum_i q_ij (1/L_j) grad logp, concentrated on
high-scoring negatives.

Assumptions (not fixed by the paper's text):
- positives are the responses with A_i > 0 (with the ``grpo`` / ``mean_only`` / ``rloo`` estimators: reward
  above the group mean); negatives are all other responses of the same group (A_i <= 0). Only the sign of
  A is used, so the default advantage ``grpo`` and ``mean_only`` give the same loss. Advantages must be
  per sequence;
- the margin is subtracted from the positive's logit (it asks s_i > s_j + m); it starts at margin_start
  and moves to margin_end on ``schedule``: "linear" (default), "cosine" (half-cosine) or "constant"
  (margin_start throughout), with progress = min(1, step / total_steps). Defaults margin 0 -> 0.1
  nats/token, temperature T = 0.1 (our reading: T of the order of the score gaps between rollouts keeps the
  softmax weights score-sensitive; the gradient scale is ~1/T);
- every positive contributes one InfoNCE term against all negatives of its group (other positives are
  not in its denominator); terms are summed and divided by the minibatch's number of sequences (global
  count when micro-batching, so micro-batches holding whole groups sum to the whole loss);
- a group with no negative (all correct) or no positive (all wrong, or all rewards equal) contributes
  exactly 0 loss and 0 gradient: there is nothing to contrast;
- no importance ratio and no clipping: the scores are the current policy's likelihoods, as in the paper's
  description. clip_frac (and _low/_high) are 0; the ratio metrics report the GSPO-style sequence ratio
  exp(mean_t d) as an off-policy diagnostic only.
- ``aggregation`` is fixed (seq_mean_token_mean: the sum over positives divided by N_seqs): the loss is a
  contrast between whole sequences, so weighting its terms by token counts has no meaning; any other mode
  is refused with a ValueError.
``PolicyBatch.group_ids`` is required; micro-batches must hold whole groups (``needs_whole_groups``).
Extra metrics: ``conspo_margin``, ``conspo_contrast_frac`` (fraction of sequences that are positives with
at least one negative), ``conspo_pos_prob`` (mean InfoNCE probability q_i of those positives).
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

SCHEDULES = ("linear", "cosine", "constant")


@register_objective("conspo")
class ConSPO(Objective):
    ratio_level = "other"
    ratio_note = "none: a contrastive loss on length-normalised sequence log-probs"

    needs_sequence_advantages = True  # one A_i per sequence (sequence_advantages)

    temperature: float = 0.1
    margin_start: float = 0.0
    margin_end: float = 0.1
    schedule: str = "linear"

    default_advantage = "grpo"
    default_aggregation = "seq_mean_token_mean"
    aggregations = ("seq_mean_token_mean",)
    positive = frozenset({"temperature"})
    needs_whole_groups = True

    def validate(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"objective {self.name!r}: schedule must be one of {SCHEDULES}, got {self.schedule!r}"
            )

    def margin(self, batch: PolicyBatch) -> float:
        progress = min(1.0, max(0, batch.step) / max(1, batch.total_steps))
        if self.schedule == "constant":
            progress = 0.0
        elif self.schedule == "cosine":
            progress = (1.0 - math.cos(math.pi * progress)) / 2.0
        return self.margin_start + (self.margin_end - self.margin_start) * progress

    def policy_loss(self, batch: PolicyBatch):
        if batch.group_ids is None:
            raise ValueError(f"objective {self.name!r} contrasts the responses of a prompt group and needs "
                             "PolicyBatch.group_ids ([B], same id = same prompt)")
        adv = sequence_advantages(batch, self.name)
        valid = batch.mask.any(-1)
        positive, negative = valid & (adv > 0), valid & (adv <= 0)
        same_group = batch.group_ids[:, None] == batch.group_ids[None, :]
        contrast = same_group & positive[:, None] & negative[None, :]  # [i, j]: positive i vs negative j
        active = contrast.any(-1)

        margin = self.margin(batch)
        scores = batch.sequence_mean(batch.logp)
        logits = (scores[None, :] - scores[:, None] + margin) / self.temperature
        logits = torch.where(contrast, logits, torch.full_like(logits, -math.inf))
        logits = torch.cat([torch.zeros_like(logits[:, :1]), logits], dim=-1)  # the positive's own term
        per_sequence = torch.where(active, torch.logsumexp(logits, dim=-1), torch.zeros_like(scores))
        loss = sequence_aggregate(per_sequence, batch)

        none = torch.zeros_like(valid)
        pos_prob = torch.exp(-per_sequence.detach())[active]
        metrics = {
            **clip_metrics(none, none, batch),
            **ratio_metrics(torch.exp(batch.sequence_mean(batch.log_ratio())), valid),
            "conspo_margin": margin,
            "conspo_contrast_frac": active.sum().item() / max(valid.sum().item(), 1),
            "conspo_pos_prob": pos_prob.mean().item() if pos_prob.numel() else float("nan"),
        }
        return loss, metrics
