"""IPO — prime-rl's ``ipo`` loss type: a symmetric trust region in probability space, the importance-ratio policy
gradient and the Kimi-K2.5 squared log-ratio KL (DPPO, arXiv 2602.04879; Kimi K2.5, arXiv 2602.02276).
Reference: prime-rl ``src/prime_rl/trainer/rl/loss.py`` ``ipo_loss_fn`` and ``IPOLossConfig``
(``packages/prime-rl-configs/src/prime_rl/configs/trainer.py``), PrimeIntellect-ai/prime-rl
559b44772e471d1538537b8805cc77f3824a5e64 (added by 77af0375, "IPO config"; no paper cited).

With p_t = exp(logp_t), q_t = exp(old_logp_t) (prime-rl: the inference engine's), d_t = logp_t - old_logp_t:

    masked_t = p_t - q_t > clip_high  or  p_t - q_t < -clip_low        (whatever the sign of A: symmetric)
    l_t      = -sg(not masked_t) A_t exp(d_t) + kl_coef d_t^2          (surrogate "ratio", prime-rl's)
    loss     = aggregate(l, token_mean)      (prime-rl: per-sample sums over the global loss-token count)
    grad     = [-keep_t A_t r_t + 2 kl_coef d_t] grad logp_t

The loss is DPPO's (objectives/dppo.py, ``dppo_tv`` with another mask: the same surrogate, KL term and metrics) with
prime-rl's symmetric region: DPPO-Binary-TV masks only the side the advantage pushes (A > 0: a rise, A <= 0: a fall);
here a token that moved more than the threshold in either direction is masked. Defaults are ``IPOLossConfig``'s:
``ipo_threshold`` 0.1 (both sides; asymmetric bounds are a setting), ``kl_tau`` 1e-3, ``adv_tau`` 1 (a scale of A,
not a hyperparameter here). The ratio is DPPO's, exp(clamp(d, -20, 20)) (verl's safety clamp); prime-rl's is
unclamped: the two differ only where |d| > 20. prime-rl's default loss (``DefaultLossConfig``: DPPO-Binary-TV + the
same KL term) is ``dppo_tv`` with ``clip_low=0.2 clip_high=0.2 kl_coef=1e-3 surrogate=ratio aggregation=token_mean``
(objectives/dppo.py). Metrics: DPPO's (``clip_frac`` = prime-rl's ``is_masked``, split by the sign of A).
"""

from __future__ import annotations

from objectives.base import register_objective
from objectives.dppo import DPPOBinaryTV


@register_objective("ipo")
class IPO(DPPOBinaryTV):
    clip_low: float = 0.1  # mask tokens whose probability fell by more than this (prime-rl's ipo_threshold)
    clip_high: float = 0.1  # mask tokens whose probability rose by more than this (prime-rl's ipo_threshold)
    kl_coef: float = 1e-3  # coefficient of the squared log-ratio (Kimi-K2.5) KL term (prime-rl's kl_tau)
    surrogate: str = "ratio"  # ratio: prime-rl's -A r; logp: verl's -A sg(min(r, ratio_cap)) logp

    default_aggregation = "token_mean"

    def masked(self, logp, old_logp, positive):
        gap = logp.exp() - old_logp.exp()
        return (gap > self.clip_high) | (gap < -self.clip_low)
