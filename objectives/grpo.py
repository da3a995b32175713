"""GRPO — Shao et al., "DeepSeekMath" (arXiv 2402.03300), token-level PPO clipping.

    r_t = exp(logp_t - old_logp_t)
    l_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)        (+ beta * k3 KL, from the base)
    loss = mean_i (1/L_i) sum_t l_t                (seq-mean-token-mean: the default of ``aggregation``)

Defaults clip 0.2/0.2 and beta = 0 (the paper used beta = 0.04 with G = 64 and one update per rollout).
The KL is the k3 estimator exp(ref - logp) - (ref - logp) - 1, *not* multiplied by r (TRL 1.16 multiplies
it by r unless ``use_bias_correction_kl=False``).

Options (off by default; every objective also takes ``aggregation``, see objectives/base.py):
- ``dual_clip`` / ``clip_ratio_c`` (default 3): verl's dual clip (``clip_ratio_c``; Ye et al., arXiv 1912.09729),
  for A < 0 only: l_t = min(l_t, -clip_ratio_c A), so a token of a bad response whose ratio exceeds c keeps
  the bounded loss -c A and loses its gradient. ``clip_frac_dual`` (A < 0 and r > c) is reported (0 when
  off) and included in ``clip_frac``. The paper has none; verl's ``vanilla`` loss always does; TRL 1.16's ``delta``
  (two-sided GRPO, INTELLECT-2: the ratio capped at delta before the min) is the same loss and gradient for
  delta >= 1 + clip_high, as TRL recommends (tests/test_objectives.py).

Alias ``bnpo`` (TRL 1.16's ``loss_type="bnpo"``, ``trl/trainer/grpo_trainer.py`` ``_compute_loss``, the installed
wheel): this objective with ``aggregation=token_mean`` by default, i.e. GRPO's 0.2 / 0.2 clip normalised by the valid
tokens, sum(l * mask) / N_tokens (DAPO's token-mean at GRPO's clip range). TRL divides by the *micro-batch's* tokens
and averages the micro-batches (its loss then depends on the micro-batch size, as its documentation warns); the loop
passes the minibatch's token count, so ``bnpo`` equals TRL's when the optimizer step is one micro-batch (tested).
"""

from __future__ import annotations

from objectives.base import Objective, PolicyBatch, ppo_clipped_loss, register_objective, validate_dual_clip


@register_objective("grpo")
class GRPO(Objective):
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: bool = False
    clip_ratio_c: float = 3.0

    default_advantage = "grpo"
    default_aggregation = "seq_mean_token_mean"
    below_one = frozenset({"clip_low"})

    def validate(self):
        validate_dual_clip(self)

    def policy_loss(self, batch: PolicyBatch):
        loss, metrics = ppo_clipped_loss(batch, self.clip_low, self.clip_high, self.aggregation,
                                         clip_ratio_c=self.clip_ratio_c if self.dual_clip else None)
        return loss, {"clip_frac_dual": 0.0, **metrics}


@register_objective("bnpo")
class BNPO(GRPO):
    """TRL's ``bnpo`` loss type: ``grpo`` with token-mean aggregation (module docstring)."""

    default_aggregation = "token_mean"
