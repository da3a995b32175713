"""Clip-Cov — Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
(arXiv 2505.22617): PPO's surrogate with the gradient removed from a few randomly chosen tokens whose covariance
between advantage and log-probability is high (the tokens that drive entropy collapse).
Reference: verl ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_clip_cov`` (verl-project/verl
1dda039b9c6311889a9c9a26040677e1254814f9), from the authors' PRIME-RL/Entropy-Mechanism-of-RL
``verl/trainer/ppo/core_algos.py`` (88505792fd97a11993445e93195145e3c1181955) and their recipe
``recipe/dapo/7b_clip_cov.sh``.

Over the valid tokens of the minibatch, with r_t = exp(logp_t - old_logp_t):

    l_t      = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))             (PPO)
    ppo_t    = the clip is active: -A clip(r) > -A r
    cov_t    = (A_t - mean(A)) (logp_t - mean(logp))                                   (means over valid tokens)
    cand     = {t valid, not ppo_t, clip_cov_lb < cov_t < clip_cov_ub}
    chosen   = min(|cand|, max(1, floor(clip_cov_ratio * N_tokens))) tokens of cand drawn uniformly at random
    loss     = aggregate(l_t * (0 if t in chosen else 1), aggregation)     (default token_mean, as verl and the recipe)
A chosen token contributes neither value nor gradient (it keeps its place in the token count).

Defaults (the authors' recipe, the paper's setting): clip_cov_ratio 2e-4, clip_cov_lb 1, clip_cov_ub 5 (also verl's
defaults), and clip_low = clip_high = 1 (``clip_ratio_low/high=1`` in the recipe: the PPO clip is relaxed to
[0, 2] so that the covariance clip does the work; verl's generic default 0.2 is the alternative).

Choices:
- the selection is a statistic of the whole minibatch (means, the count, the draw), so the objective sets
  ``needs_whole_minibatch`` and the loop refuses micro-batching for it. verl evaluates the loss per micro-batch
  (``ppo_micro_batch_size_per_gpu``; the authors' recipe uses 8 sequences), so there the selection and the means
  are per micro-batch; here the minibatch is one batch: equal to verl with the micro-batch = the minibatch;
- the draw: verl calls ``torch.randperm`` on the global generator; here a private generator seeded with
  ``selection_seed`` * 1000003 + ``PolicyBatch.step``, so a run's selection is reproducible and resumable and the
  loop's random stream is untouched (the test feeds the same permutation to the transcription);
- the means are exact (verl divides by N + 1e-8, relative 1e-8 / N).
Metrics: clip_frac_low / clip_frac_high = PPO-clipped tokens (A < 0 / A > 0) plus chosen tokens by the sign of A
(disjoint; both lose the gradient); ``clip_cov_frac`` = chosen tokens (verl's ``pg_clipfrac``); ``clip_cov_candidates``
= candidate tokens; ratio metrics over r_t.
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

SEED_STRIDE = 1_000_003


def token_covariance(batch: PolicyBatch) -> torch.Tensor:
    """cov_t = (A_t - mean A)(logp_t - mean logp) over the valid tokens (detached) [B, T], 0 on padding."""
    mask = batch.mask
    n = mask.sum().clamp(min=1)
    adv = masked(batch.token_advantages, mask)
    logp = masked(batch.logp.detach(), mask)
    return masked((adv - adv.sum() / n) * (logp - logp.sum() / n), mask)


@register_objective("clip_cov")
class ClipCov(Objective):
    clip_low: float = 1.0
    clip_high: float = 1.0
    clip_cov_ratio: float = 2e-4  # the tokens drawn from the candidates: this fraction of the valid ones, at least 1
    clip_cov_lb: float = 1.0  # a candidate's covariance cov_t must exceed this (and lie below clip_cov_ub)
    clip_cov_ub: float = 5.0  # a candidate's covariance cov_t must lie below this (and above clip_cov_lb)
    selection_seed: int = 0  # seeds the draw of the chosen (clipped) tokens: selection_seed * 1000003 + the step

    default_advantage = "grpo"
    default_aggregation = "token_mean"
    needs_whole_minibatch = True
    positive = frozenset({"clip_cov_ratio"})
    seeds = frozenset({"selection_seed"})
    shares = frozenset({"clip_cov_ratio"})
    signed = frozenset({"clip_cov_lb", "clip_cov_ub"})

    def validate(self):
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"objective {self.name!r}: clip_cov_lb must be below clip_cov_ub, got "
                             f"{self.clip_cov_lb} >= {self.clip_cov_ub}")

    def chosen(self, batch: PolicyBatch, ppo_clipped: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Bool [B, T]: the tokens whose gradient the covariance clip removes; and the number of candidates."""
        mask = batch.mask
        cov = token_covariance(batch)
        candidates = mask & ~ppo_clipped & (cov > self.clip_cov_lb) & (cov < self.clip_cov_ub)
        index = torch.nonzero(candidates)  # row-major, as verl
        count = max(int(self.clip_cov_ratio * mask.sum().item()), 1)
        generator = torch.Generator().manual_seed(self.selection_seed * SEED_STRIDE + batch.step)
        pick = index[torch.randperm(len(index), generator=generator)[:count]]
        chosen = torch.zeros_like(mask)
        chosen[pick[:, 0], pick[:, 1]] = True
        return chosen, len(index)

    def policy_loss(self, batch: PolicyBatch):
        mask, adv = batch.mask, batch.token_advantages
        ratio = torch.exp(batch.log_ratio())
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        ppo_clipped = (clipped > unclipped) & mask
        chosen, candidates = self.chosen(batch, ppo_clipped)
        per_token = torch.where(chosen, torch.zeros_like(ratio), torch.maximum(unclipped, clipped))
        loss = aggregate(per_token, batch, self.aggregation)
        removed = ppo_clipped | chosen
        metrics = clip_metrics(removed & (adv < 0), removed & (adv > 0), batch)
        n = mask.sum().clamp(min=1).item()
        metrics["clip_cov_frac"] = chosen.sum().item() / n
        metrics["clip_cov_candidates"] = candidates / n
        return loss, {**metrics, **ratio_metrics(ratio, mask)}
