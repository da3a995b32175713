"""DPPO — Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning" (arXiv 2602.04879), divergence
proximal policy optimisation: PPO's ratio clip replaced by a mask on an approximation of the policy divergence of
each token, Binary-TV (``dppo_tv``) or Binary-KL (``dppo_kl``), and a truncated importance weight.
Reference: verl ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_dppo_tv`` / ``compute_policy_loss_dppo_kl``
(verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9, 0.10.0.dev; merged from the authors, PR 5397); the
authors' sail-sg/Stable-RL ``verl/trainer/ppo/core_algos.py`` (c6af1d119c0fe30d16dd9a837d35fdf695acd226,
``dppo_binary_tv[_recompute]`` / ``dppo_binary_kl[_recompute]``); prime-rl
``src/prime_rl/trainer/rl/loss.py`` ``default_loss_fn`` (PrimeIntellect-ai/prime-rl
559b44772e471d1538537b8805cc77f3824a5e64).

With p_t = exp(logp_t), q_t = exp(old_logp_t), r_t = exp(clamp(logp_t - old_logp_t, -20, 20)):

    dppo_tv:  masked_t = p_t - q_t > clip_high              if A_t > 0     (probability rose past the region)
              masked_t = p_t - q_t < -clip_low              otherwise      (fell past it; A = 0 uses this side)
    dppo_kl:  D_t = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))     (binary KL, old || new)
              masked_t = D_t > clip_high and p_t > q_t      if A_t > 0
              masked_t = D_t > clip_low  and p_t < q_t      otherwise
    keep_t = sg(not masked_t)
    l_t    = -keep_t A_t sg(min(r_t, ratio_cap)) logp_t + kl_coef (logp_t - old_logp_t)^2      surrogate "logp"
    l_t    = -keep_t A_t r_t + kl_coef (logp_t - old_logp_t)^2                                 surrogate "ratio"
    loss   = aggregate(l, aggregation)                    (default seq_mean_token_sum_norm, the example's)
    grad   = [-keep_t A_t w_t + 2 kl_coef d_t] grad logp_t,   w_t = min(r_t, ratio_cap) ("logp"), r_t ("ratio")

A masked token keeps its place in the token count and loses its policy gradient; a truncated token (r_t > ratio_cap)
keeps the gradient -ratio_cap A (like CISPO's cap). The mask is one-sided by the sign of A: a token moving against
its advantage is never masked (unlike PPO's ratio clip, the region is in probability space, so low-probability
tokens get a wide ratio range and high-probability tokens a narrow one).

Defaults: one source, verl's DPPO example ``examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh`` at the commit above
(the paper's Qwen3-30B-A3B runs), every setting of the loss that it fixes:
- clip_low = clip_high = 0.15 (``dppo_tv``) and 0.05 (``dppo_kl``): its ``clip_ratio_low/high`` by ``LOSS_MODE``;
- aggregation = seq_mean_token_sum_norm: its ``loss_agg_mode=seq-mean-token-sum-norm`` (sum over each sequence's
  tokens / (N_seqs x max_completion_len); verl's horizon is the padded response length, train.max_new_tokens here);
- ratio_cap = 10000: its ``clip_ratio_c=10000.0``, which these losses read as the truncation cap (so, in effect, no
  truncation);
- kl_coef = 0 (``use_kl_loss=False``), surrogate "logp" (verl's loss), entropy_coef 0 (its default).
The function's own fallbacks differ and are settings: verl's generic ``clip_ratio`` 0.2 when no threshold is set, the
loss's ``config.get("clip_ratio_c", 20.0)`` (but verl's ActorConfig always has the field, default 3.0), token_mean
(``loss_agg_mode`` default; ``aggregation=token_mean``). The authors' fallback cap is 10.
Settings:
- prime-rl's default loss (DPPO-Binary-TV + the Kimi-K2.5 KL term, ``DefaultLossConfig``): ``dppo_tv`` with
  ``clip_low=0.2 clip_high=0.2 kl_coef=1e-3 surrogate=ratio aggregation=token_mean`` (dppo_mask_low / high 0.2, kl_tau
  1e-3, adv_tau 1; its per-sample sums over the global token count are token_mean); its ``ipo`` loss type, a symmetric
  region, is the objective ``ipo`` (objectives/ipo.py). Its policy term has the value -A r, not verl's
  -A sg(r) logp: the gradients agree (A r grad logp, no truncation) and the values differ, both tested;
- the authors' default modes (``dppo_binary_tv`` / ``_kl``) measure the mask and the ratio against the rollout
  engine's log-probs: here ``old_logp`` is the behaviour policy, which is the sampler's log-probs with
  ``train.old_logp: sampler`` (their default) and the recomputed trainer's with ``recompute`` (their ``_recompute``
  modes, verl's losses). Their topk variants need the top-k vocabulary probabilities, which the loop does not pass.
Differences from verl, none of them in the loss: the clip fractions split verl's ``pg_clipfrac`` (every masked
token) by the sign of A, ``clip_frac_high`` = A > 0 and masked, ``clip_frac_low`` = A <= 0 and masked (A = 0 tokens
have no policy gradient anyway); ``dppo_truncated_frac`` = kept tokens with r > ratio_cap (verl's
``pg_clipfrac_lower``; they keep a gradient). Ratio metrics are over r_t.
"""

from __future__ import annotations

from dataclasses import dataclass

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

LOG_RATIO_CLAMP = 20.0  # verl's clamp of logp - old_logp before exp
BINARY_KL_EPS = 1e-8  # verl's / the authors' guard in log((1 - q) / (1 - p))
SURROGATES = ("logp", "ratio")


@dataclass
class DPPO(Objective):
    """The DPPO loss around a divergence mask; subclasses define :meth:`masked` (not registered itself)."""

    clip_low: float = 0.15
    clip_high: float = 0.15
    ratio_cap: float = 10000.0  # surrogate logp: the importance weight is truncated at this (verl's clip_ratio_c)
    kl_coef: float = 0.0  # coefficient of the squared log-ratio KL term (logp - old_logp)^2; 0 = off
    surrogate: str = "logp"  # logp: verl's -A sg(min(r, ratio_cap)) logp; ratio: prime-rl's -A r

    default_advantage = "grpo"
    default_aggregation = "seq_mean_token_sum_norm"
    positive = frozenset({"ratio_cap"})

    def validate(self):
        if self.surrogate not in SURROGATES:
            raise ValueError(f"objective {self.name!r}: hyperparameter surrogate must be one of {SURROGATES} "
                             f"(logp: verl's -A sg(min(r, ratio_cap)) logp; ratio: prime-rl's -A r), "
                             f"got {self.surrogate!r}")

    def masked(self, logp, old_logp, positive):
        """Bool [B, T]: the tokens outside the trust region (logp detached); ``positive`` = A > 0."""
        raise NotImplementedError

    def policy_loss(self, batch: PolicyBatch):
        mask, adv = batch.mask, batch.token_advantages
        d = batch.log_ratio()
        ratio = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        out = masked(self.masked(batch.logp.detach(), batch.old_logp, adv > 0), mask)
        keep = (~out).to(ratio.dtype)
        if self.surrogate == "logp":
            weight = ratio.clamp(max=self.ratio_cap).detach()
            policy = -keep * adv * weight * masked(batch.logp, mask)
            truncated = (ratio > self.ratio_cap) & ~out & mask
        else:
            policy = -keep * adv * ratio
            truncated = torch.zeros_like(mask)
        per_token = policy + self.kl_coef * d.square() if self.kl_coef else policy
        loss = aggregate(per_token, batch, self.aggregation)
        metrics = clip_metrics(out & (adv <= 0), out & (adv > 0), batch)
        metrics["dppo_truncated_frac"] = truncated.sum().item() / mask.sum().clamp(min=1).item()
        return loss, {**metrics, **ratio_metrics(ratio, mask)}


@register_objective("dppo_tv")
class DPPOBinaryTV(DPPO):
    def masked(self, logp, old_logp, positive):
        gap = torch.exp(logp) - torch.exp(old_logp)
        return torch.where(positive, gap > self.clip_high, gap < -self.clip_low)


@register_objective("dppo_kl")
class DPPOBinaryKL(DPPO):
    clip_low: float = 0.05
    clip_high: float = 0.05

    def masked(self, logp, old_logp, positive):
        prob, old_prob = torch.exp(logp), torch.exp(old_logp)
        binary_kl = old_prob * (old_logp - logp) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + BINARY_KL_EPS) / (1.0 - prob + BINARY_KL_EPS))
        return torch.where(positive, (binary_kl > self.clip_high) & (prob > old_prob),
                           (binary_kl > self.clip_low) & (prob < old_prob))
