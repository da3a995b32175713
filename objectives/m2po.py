"""M2PO — Zheng et al., "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?"
(arXiv 2510.01161), second-moment trust policy optimisation: before each update, drop the tokens with the largest
squared log-ratio to the behaviour policy until the mean of the rest is below a threshold, then take the plain
importance-weighted policy gradient over the kept tokens.
Reference: AReaL ``areal/trainer/ppo/actor.py`` ``_apply_m2po_masking`` / ``_get_m2po_loss_mask`` and
``grpo_loss_fn`` with ``areal/utils/functional/functional.py`` ``ppo_actor_loss_fn``, ``docs/en/algorithms/m2po.md``,
``examples/math/gsm8k_m2po.yaml`` (inclusionAI/AReaL 4aef98d8d818af55b43621aaadba047ae10f4e77).

Over the valid tokens of the minibatch, with d_t = logp_t - old_logp_t, r_t = exp(d_t), and b_t the behaviour
log-probs (``PolicyBatch.sampler_logp``) when old_logp is the proximal policy the loop recomputed:

    m_t     = (b_t - old_logp_t)^2     with b (behaviour vs proximal: AReaL's ``delta = old_logp - prox_logp``)
    m_t     = sg(d_t)^2                without (old_logp is the behaviour itself: current vs behaviour)
    sort the m_t descending: m_(1) >= m_(2) >= ... >= m_(n);   S_j = mean(m_(j), ..., m_(n))
    k       = the first j - 1 with S_j < m2_threshold (0: nothing dropped), or n - 1 if there is none
    M_t     = 0 for the k tokens of largest m_t, 1 otherwise
    l_t     = -M_t r_t A_t          loss = sum_t l_t / sum_t M_t   (token mean over the kept tokens, AReaL's)
    grad    = -M_t r_t A_t grad logp_t / sum_t M_t                 (no clip)

Default m2_threshold = 0.04 (AReaL's example and the authors' ``M2_budget``). On-policy (d = 0) nothing is dropped and
the loss is the vanilla policy gradient.

Choices (the anchors disagree; AReaL's is followed):
- AReaL measures m_t between the behaviour policy and the proximal policy recomputed before the update (detached)
  and takes PPO's ratio against the proximal policy times a behaviour weight pi_prox / pi_behave (decoupled PPO);
  its example runs one minibatch per rollout (``ppo_n_minibatches: 1``, the proximal policy = the current one) with
  ``eps_clip: 0``, where this is -M_t r_t A_t with r against the behaviour policy, as the M2PO paper's objective
  (AReaL's docs) writes it. Here, when the loop recomputes the proximal policy (``train.old_logp: recompute`` or a
  rollout correction, e.g. ``decoupled_ppo``) the mask is AReaL's, behaviour vs proximal, fixed for the step's
  minibatches, and the loss has no clip (AReaL's eps_clip = 0 clamps the proximal ratio into [1, 1]: at r = 1
  both sides of PPO's max carry the same gradient, so its example equals this objective in value and gradient,
  tested); its example's rejection sampling of behaviour ratios above 5 is the loop's rollout correction
  (``decoupled_ppo`` or ``token_mask`` with threshold 5), not part of the objective. Without a recomputed proximal
  (``train.old_logp: sampler``) m_t compares the current policy with the behaviour, the paper's objective at every
  minibatch (AReaL would compare the behaviour with itself there and mask nothing);
- the authors' own code (Infini-AI-Lab/M2PO ``verl/trainer/ppo/core_algos.py`` ``compute_m2po_policy_loss``,
  af54a3e8) instead caps |d| of the tokens moving with their advantage at a threshold tau solving an M2 budget and
  turns tau into PPO clip bounds (at least 0.3 / 0.5): a different mechanism, not implemented;
- the mask is a statistic of the whole minibatch (a sort), so ``needs_whole_minibatch`` (AReaL computes it per
  micro-batch); the normaliser counts the kept tokens only, so the only aggregation is token_mean;
- ties at the cut are broken by a stable sort (AReaL's sort is not stable; hand tests avoid ties).
Metrics: clip_frac_low / high = dropped tokens with A < 0 / A > 0 (they lose the gradient); ``m2po_dropped_frac``;
``m2po_m2`` = mean m_t over valid tokens, ``m2po_m2_kept`` = over the kept ones; ratio metrics over r_t.
"""

from __future__ import annotations

import dataclasses

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


def second_moment_keep(m2: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool [B, T]: AReaL's M2PO mask (module docstring) over the valid entries of ``m2``; padding False."""
    keep = torch.zeros_like(valid)
    values = m2[valid]
    n = values.numel()
    if n == 0:
        return keep
    order = torch.sort(values, descending=True, stable=True)
    suffix_mean = order.values.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=values.dtype)
    below = torch.nonzero(suffix_mean < threshold)
    drop = int(below[0]) if len(below) else n - 1
    kept = torch.ones(n, dtype=torch.bool)
    kept[order.indices[:drop]] = False
    keep[valid] = kept
    return keep


@register_objective("m2po")
class M2PO(Objective):
    m2_threshold: float = 0.04  # drop the tokens of largest squared log-ratio until the rest's mean is below this

    default_advantage = "grpo"
    default_aggregation = "token_mean"
    aggregations = ("token_mean",)
    needs_whole_minibatch = True
    positive = frozenset({"m2_threshold"})

    def policy_loss(self, batch: PolicyBatch):
        mask, adv = batch.mask, batch.token_advantages
        d = batch.log_ratio()
        ratio = torch.exp(d)
        behaviour = batch.sampler_logp
        m2 = (d.detach() if behaviour is None else masked(behaviour - batch.old_logp, mask)).square()
        keep = second_moment_keep(m2, mask, self.m2_threshold)
        kept_batch = dataclasses.replace(batch, mask=keep, num_tokens=None)  # the kept tokens are the normaliser
        loss = aggregate(-ratio * adv, kept_batch, self.aggregation)
        dropped = mask & ~keep
        metrics = clip_metrics(dropped & (adv < 0), dropped & (adv > 0), batch)
        n = mask.sum().clamp(min=1).item()
        metrics["m2po_dropped_frac"] = dropped.sum().item() / n
        metrics["m2po_m2"] = m2[mask].sum().item() / n
        metrics["m2po_m2_kept"] = m2[keep].sum().item() / max(1, keep.sum().item())
        return loss, {**metrics, **ratio_metrics(ratio, mask)}
