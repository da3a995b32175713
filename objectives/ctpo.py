"""CTPO — cumulative-token importance sampling (arXiv 2605.07331); reference: the authors' code,
horizon-llm/CTPO, loss ``cum-token-cumprod-la`` (length-adaptive, cumulative product) in verl's core_algos.py.

    c_t        = sum_{u <= t, valid} clamp(d_u, -20, 20)                 (log of the prefix product of ratios)
    log rho_t  = min(sg(c_t) + logp_t - sg(logp_t), 10)                  (value: prod_{u<=t} r_u;
                                                                          gradient: the current token only)
    n_t        = number of valid tokens up to and including t            (1-indexed position)
    rho^c_t    = exp(clamp(log rho_t, -clip_low sqrt(n_t), clip_high sqrt(n_t)))
    l_t        = max(-A rho_t, -A rho^c_t)
    l_t        = min(l_t, -A exp(dual_clip sqrt(n_t)))      only where A < 0 (dual clip)
    loss       = sum_{i,t} mask * l_t / sum_{i,t} mask                   (token-mean, as the authors' default)

Unclipped, d loss / d logp_t = -A rho_t / N_tokens. Defaults clip_low = 0.025, clip_high = 0.05,
dual_clip = 0.05 (the authors' ``la_clip_low/high/c`` with ``clip_ratio_la_power`` = 0.5): at t = 1 the
window is [0.975, 1.051], at t = 100 [0.78, 1.65]. Choices, all following the authors' code:
- the +-20 clamp of d (before the prefix sum) and the cap of log rho at 10 are theirs (numerical safety);
- the dual clip applies to A < 0 only, after the PPO max, with threshold exp(dual_clip sqrt(n_t)): with
  the defaults it coincides with the upper edge of the window, so for A < 0 a ratio above the window loses
  its gradient too;
- clip fractions (over valid tokens; each counts tokens whose gradient the clip removed):
  clip_frac_low  = A < 0 and log rho_t < -clip_low sqrt(n_t);
  clip_frac_high = A > 0 and log rho_t > clip_high sqrt(n_t) (or past the cap at 10);
  clip_frac_dual = A < 0 and the dual clip is active (rho_t > exp(dual_clip sqrt(n_t)), or past the cap);
  clip_frac = clip_frac_low + clip_frac_high + clip_frac_dual (the three are disjoint). The authors log
  the same three counts (``pg_update/clip/{low,high,dual}``); verl's ``pg_clipfrac_lower`` is the dual one.
Ratio metrics are over rho_t (the prefix products, as capped). Advantages may be [B] or [B, T].
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

LOG_RATIO_CLAMP = 20.0  # per-token |d| bound before the prefix sum
LOG_RHO_CAP = 10.0  # upper cap of log rho_t


@register_objective("ctpo")
class CTPO(Objective):
    clip_low: float = 0.025
    clip_high: float = 0.05
    dual_clip: float = 0.05

    default_advantage = "grpo"
    aggregation = "token_mean"
    kl_aggregation = "token_mean"
    positive = frozenset({"clip_low", "clip_high", "dual_clip"})  # log-space half-widths of the window

    def policy_loss(self, batch: PolicyBatch):
        mask = batch.mask
        cumulative = torch.cumsum(batch.log_ratio().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), dim=-1)
        raw = masked(cumulative.detach() + batch.logp - batch.logp.detach(), mask)
        log_rho = raw.clamp(max=LOG_RHO_CAP)
        rho = torch.exp(log_rho)
        root_n = torch.cumsum(mask.to(batch.logp.dtype), dim=-1).clamp(min=1).sqrt()
        low_bound, high_bound = -self.clip_low * root_n, self.clip_high * root_n
        rho_clipped = torch.exp(torch.clamp(log_rho, low_bound, high_bound))
        adv = batch.token_advantages
        ppo = torch.maximum(-adv * rho, -adv * rho_clipped)
        dual = -adv * torch.exp(self.dual_clip * root_n)
        per_token = torch.where(adv < 0, torch.minimum(ppo, dual), ppo)
        loss = aggregate(per_token, batch, self.aggregation)

        capped = raw > LOG_RHO_CAP
        low = (adv < 0) & (log_rho < low_bound)
        high = (adv > 0) & ((log_rho > high_bound) | capped)
        dual_clipped = (adv < 0) & ((ppo > dual) | capped)
        metrics = clip_metrics(low, high, batch)
        dual_frac = (dual_clipped & mask).sum().item() / mask.sum().clamp(min=1).item()
        metrics["clip_frac"] += dual_frac
        metrics["clip_frac_dual"] = dual_frac
        return loss, {**metrics, **ratio_metrics(rho, mask)}
