"""P3O — "Trust the Batch" (arXiv 2605.12380): no clip range; each token's importance weight is capped at the
batch's normalised effective sample size, and a KL to the behaviour policy is added with weight 1 - ESS.
Reference: the authors' code, FeynRL-project/FeynRL ``algs/P3O/p3o.py`` (commit
2dbc6bebea7dcc208b6bd891c2def1bfae551663; ``calculate_ess``, ``compute_policy_loss``) and
``algs/RL/common.py`` (``compute_kl_distance``).

    r_t   = exp(d_t),  d_t = logp_t - old_logp_t
    e_B   = (sum_t r_t)^2 / (sum_t r_t^2 + 1e-8) / n        over the n valid tokens of the batch (in (0, 1])
    w_t   = sg(clamp(r_t, 0, e_B)) = sg(min(r_t, e_B))      (e_B is a number: no gradient through it)
    KL_t  = d_t + exp(clamp(-d_t, -10, 10)) - 1             (k3 estimator of KL(pi || pi_old), the authors' clamp)
    l_t   = -w_t A_t logp_t + (1 - e_B) KL_t
    loss  = sum_{i,t} mask * l_t / N_tokens                  (token-mean, as the authors' normalize_loss)
    grad  = [-w_t A_t + (1 - e_B)(1 - exp(-d_t))] grad logp_t / N_tokens     (|d_t| <= 10)

Choices, following the authors' code:
- e_B is computed in float64 from the ratios of the valid tokens of the *whole minibatch* (the authors sum the
  three statistics across data-parallel ranks for each micro-batch, then normalise the loss by the global token
  count). Summing micro-batch losses is exact only if every micro-batch sees the same e_B: the objective
  implements ``minibatch_statistics`` (n, sum r, sum r^2 over a batch's valid tokens), and when the loop splits a
  minibatch into micro-batches (natively, or TRL's gradient accumulation / several GPUs) it sums them over the
  minibatch in a no-grad forward pass of the current policy before the losses and passes the totals as
  ``PolicyBatch.minibatch_stats`` (one extra forward per minibatch, only then; without micro-batching e_B comes
  from the batch itself). If the sums are not finite or there is no valid token, e_B = 1 (theirs).
- the policy term multiplies logp (not r): its value is not a surrogate (it contains logp), its gradient is
  the point, as in CISPO; at r = 1 for every token e_B = 1 and the loss is the vanilla policy gradient.
- there is no clip range: the authors' ``clip_low/high`` feed only a diagnostic ``clipfrac`` (r outside
  [0.8, 1.2]); here ``clip_frac_high`` = fraction of valid tokens whose weight was capped (r_t > e_B, either
  sign of A; those keep the gradient -e_B A), ``clip_frac_low`` = 0 (no token loses its gradient).
- with equal rewards (A = 0) the KL term still pulls towards the behaviour policy when off-policy.
Metrics: ``ess_batch`` (e_B), ``p3o_kl_behavior`` (token mean of KL_t); ratio metrics over r_t.
``aggregation`` (default token_mean) applies to the whole l_t, KL term included, and so does the loop's rollout
correction weight (``PolicyBatch.correction``, through ``aggregate``); e_B is computed from the unweighted r_t.
"""

from __future__ import annotations

import math

import torch

from objectives.base import Objective, PolicyBatch, aggregate, clip_metrics, masked, ratio_metrics, register_objective

ESS_EPS = 1e-8  # the authors' guard in the ESS denominator
KL_EXPONENT_CLAMP = 10.0  # the authors' clamp of old_logp - logp inside exp


def ratio_sums(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """n, sum r, sum r^2 over the valid tokens, as float64 0-dim tensors (P3O's minibatch statistics)."""
    values = ratio.detach()[mask].to(torch.float64)
    return {"n": values.new_tensor(float(values.numel())), "sum_r": values.sum(), "sum_r2": values.pow(2).sum()}


def ess_of(sums: dict[str, torch.Tensor]) -> float:
    """e_B = (sum r)^2 / (sum r^2 + 1e-8) / n; 1.0 if there is no valid token or a sum is not finite."""
    n, total, squares = (float(sums[k]) for k in ("n", "sum_r", "sum_r2"))
    if n == 0 or not math.isfinite(total) or not math.isfinite(squares):
        return 1.0
    return total**2 / (squares + ESS_EPS) / n


def batch_ess(ratio: torch.Tensor, mask: torch.Tensor) -> float:
    """e_B over the valid tokens of one batch, in float64; 1.0 if empty or not finite."""
    return ess_of(ratio_sums(ratio, mask))


@register_objective("p3o")
class P3O(Objective):
    default_advantage = "grpo"
    default_aggregation = "token_mean"

    def minibatch_statistics(self, batch: PolicyBatch) -> dict[str, torch.Tensor]:
        return ratio_sums(torch.exp(batch.log_ratio()), batch.mask)

    def policy_loss(self, batch: PolicyBatch):
        mask = batch.mask
        d = batch.log_ratio()
        ratio = torch.exp(d)
        ess = ess_of(batch.minibatch_stats if batch.minibatch_stats is not None else ratio_sums(ratio, mask))
        weight = ratio.clamp(min=0.0, max=ess).detach()
        kl = d + torch.exp((-d).clamp(-KL_EXPONENT_CLAMP, KL_EXPONENT_CLAMP)) - 1.0
        per_token = -weight * batch.token_advantages * masked(batch.logp, mask) + (1.0 - ess) * kl
        loss = aggregate(per_token, batch, self.aggregation)
        n = mask.sum().clamp(min=1).item()
        metrics = clip_metrics(torch.zeros_like(mask), ratio > ess, batch)
        metrics["ess_batch"] = ess
        metrics["p3o_kl_behavior"] = masked(kl, mask).sum().item() / n
        return loss, {**metrics, **ratio_metrics(ratio, mask)}
