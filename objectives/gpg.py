"""GPG — Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning"
(arXiv 2504.02546): the plain policy gradient, no ratio, no clip, no KL.
Reference: verl ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_gpg`` (verl-project/verl
1dda039b9c6311889a9c9a26040677e1254814f9), adapted there from the authors' AMAP-ML/GPG
``VisualThinker-R1-Zero/src/open-r1-multimodal/src/open_r1/trainer/grpo_trainer.py`` (e096da8c, ``pg_name='gpg'``).

    l_t  = -A_t logp_t                     loss = aggregate(l, aggregation), default token_mean (verl's default)
    grad = -A_t grad logp_t / N_tokens     (the on-policy gradient whatever old_logp is: no importance weight)

The default advantage is the ``gpg`` estimator (objectives/advantages.py: alpha (R - mean_group), alpha = B / the
number of nonzero rewards, verl's). Choices: the authors' trainer averages per sequence (seq_mean_token_mean, an
``aggregation`` setting); verl's default token-mean is the default here. With several updates per rollout the
gradient ignores that the data became off-policy (verl's and the authors' loss, by design). The loss value is not a
surrogate (it contains logp); its gradient is. No token is clipped: clip fractions are 0; ratio metrics over r.
"""

from __future__ import annotations

import torch

from objectives.base import Objective, PolicyBatch, aggregate, clip_metrics, masked, ratio_metrics, register_objective


@register_objective("gpg")
class GPG(Objective):
    default_advantage = "gpg"
    default_aggregation = "token_mean"

    def policy_loss(self, batch: PolicyBatch):
        per_token = -batch.token_advantages * masked(batch.logp, batch.mask)
        loss = aggregate(per_token, batch, self.aggregation)
        none = torch.zeros_like(batch.mask)
        return loss, {**clip_metrics(none, none, batch), **ratio_metrics(torch.exp(batch.log_ratio()), batch.mask)}
