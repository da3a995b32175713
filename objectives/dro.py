"""DRO — a policy gradient with a quadratic log-ratio penalty instead of a clip, verl's ``dro`` policy loss.
Reference: verl ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_dro`` and ``docs/algo/dro.md``
(verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9; added by ddfbf4ea, PR 7245). verl cites no paper; the name
is Direct Reward Optimisation (Richemond et al., arXiv 2405.19107), whose squared residual
(R - V - tau log(pi / pi_ref))^2 / 2 has, per sequence, the gradient -tau (R - V) grad log pi + tau^2 log(pi / pi_ref)
grad log pi: verl's token form below with A = R - V, the old policy in place of the reference and beta = tau (our
reading of the connection; the loss itself is verl's).

    d_t  = logp_t - old_logp_t
    l_t  = -(logp_t A_t - dro_beta / 2 d_t^2)
    loss = aggregate(l, aggregation)                 (verl's loss_agg_mode; default token_mean, verl's default)
    grad = [-A_t + dro_beta d_t] grad logp_t

No ratio and no clip: the penalty pulls each token back towards the behaviour policy in proportion to its drift, so on
the first minibatch (d = 0) it is plain REINFORCE with the group baseline. The loss value contains logp (its gradient
is what matters). ``dro_beta``: verl has no default (``policy_loss.dro_beta`` is required and must be > 0) and no
recipe that sets one; 0.05 is the value verl's test of this loss uses (``tests/trainer/ppo/
test_dynamic_policy_losses_on_cpu.py`` at the same commit), our choice of a default.
A rollout correction multiplies l_t as for every objective (verl multiplies ``rollout_is_weights`` the same way).
Metrics: no clip (clip fractions 0); ``dro_penalty`` = mean over valid tokens of dro_beta / 2 d^2; ratio metrics over
r = exp(d).
"""

from __future__ import annotations

import torch

from objectives.base import Objective, PolicyBatch, aggregate, clip_metrics, masked, ratio_metrics, register_objective


@register_objective("dro")
class DRO(Objective):
    dro_beta: float = 0.05  # coefficient of the quadratic log-ratio penalty (verl's policy_loss.dro_beta, > 0)

    default_advantage = "grpo"
    default_aggregation = "token_mean"
    positive = frozenset({"dro_beta"})

    def policy_loss(self, batch: PolicyBatch):
        d = batch.log_ratio()
        penalty = 0.5 * self.dro_beta * d.square()
        loss = aggregate(-(masked(batch.logp, batch.mask) * batch.token_advantages - penalty), batch, self.aggregation)
        nothing = torch.zeros_like(batch.mask)
        mean_penalty = masked(penalty, batch.mask).sum().item() / batch.mask.sum().clamp(min=1).item()
        return loss, {**clip_metrics(nothing, nothing, batch), "dro_penalty": mean_penalty,
                      **ratio_metrics(torch.exp(d), batch.mask)}
