"""KL-Cov — Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
(arXiv 2505.22617): the unclipped policy-gradient surrogate with a KL penalty |logp - old_logp| on the few tokens
whose covariance between advantage and log-probability is largest (the tokens that drive entropy collapse).
Reference: verl ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_kl_cov`` (verl-project/verl
1dda039b9c6311889a9c9a26040677e1254814f9), from the authors' PRIME-RL/Entropy-Mechanism-of-RL
``verl/trainer/ppo/core_algos.py`` (88505792fd97a11993445e93195145e3c1181955) and their recipes
``recipe/dapo/{7b,32b}_kl_cov.sh``.

Over the valid tokens of the minibatch, with d_t = logp_t - old_logp_t, r_t = exp(d_t):

    cov_t    = (A_t - mean(A)) (logp_t - mean(logp))                          (plain means over valid tokens)
    top      = the k = max(1, floor(kl_cov_ratio * N_tokens)) valid tokens of largest cov_t
    l_t      = -A_t r_t + kl_coef |d_t| 1[t in top]          (no clip)
    loss     = aggregate(l, aggregation)                      (default token_mean, as verl and the recipes)
    grad     = [-A_t r_t + kl_coef sign(d_t) 1[t in top]] grad logp_t / N_tokens

Defaults: kl_cov_ratio 2e-4 (verl's default and the authors' 32B recipe, k_percent 0.02 %; their 7B recipe uses
0.2 %, i.e. 2e-3), kl_coef 1 (the authors' ``ppo_kl_coef`` in every recipe and verl's fallback in the loss;
verl's ActorConfig default ``ppo_kl_coef`` is 0.1, the alternative).

Choices: the top-k is a statistic of the whole minibatch, so the objective sets ``needs_whole_minibatch`` (verl
selects per micro-batch; equal with the micro-batch = the minibatch); ties at the k-th covariance are broken by
``torch.topk`` as in verl (hand-made tests avoid them). No token loses its gradient: the clip fractions are 0;
``kl_cov_frac`` = selected tokens; ``kl_cov_abs_kl`` = token mean of |d_t| (verl's ``ppo_kl`` for this loss);
ratio metrics over r_t.
"""

from __future__ import annotations

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


@register_objective("kl_cov")
class KLCov(Objective):
    kl_cov_ratio: float = 2e-4  # fraction of the minibatch's valid tokens of largest covariance that get the penalty
    kl_coef: float = 1.0  # coefficient of the penalty |logp - old_logp| on those tokens

    default_advantage = "grpo"
    default_aggregation = "token_mean"
    needs_whole_minibatch = True
    positive = frozenset({"kl_cov_ratio"})
    shares = frozenset({"kl_cov_ratio"})

    def selected(self, batch: PolicyBatch) -> torch.Tensor:
        """Bool [B, T]: the k valid tokens of largest (A - mean A)(logp - mean logp)."""
        mask = batch.mask
        adv = batch.token_advantages[mask]
        logp = batch.logp.detach()[mask]
        chosen = torch.zeros_like(mask)
        if adv.numel() == 0:
            return chosen
        cov = (adv - adv.mean()) * (logp - logp.mean())
        k = max(1, int(adv.numel() * self.kl_cov_ratio))
        flat = torch.nonzero(mask.reshape(-1)).squeeze(-1)[torch.topk(cov, k, largest=True).indices]
        chosen.view(-1)[flat] = True
        return chosen

    def policy_loss(self, batch: PolicyBatch):
        mask, adv = batch.mask, batch.token_advantages
        d = batch.log_ratio()
        ratio = torch.exp(d)
        top = self.selected(batch)
        per_token = -adv * ratio + torch.where(top, self.kl_coef * d.abs(), torch.zeros_like(d))
        loss = aggregate(per_token, batch, self.aggregation)
        none = torch.zeros_like(mask)
        n = mask.sum().clamp(min=1).item()
        metrics = clip_metrics(none, none, batch)
        metrics["kl_cov_frac"] = top.sum().item() / n
        metrics["kl_cov_abs_kl"] = masked(d.abs(), mask).sum().item() / n
        return loss, {**metrics, **ratio_metrics(ratio, mask)}
