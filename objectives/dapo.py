"""DAPO — Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv 2503.14476).

    r_t  = exp(logp_t - old_logp_t)
    l_t  = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)       (clip-higher: 0.2 / 0.28)
    loss = sum_{i,t} mask * l_t / sum_{i,t} mask                      (token-mean over the whole minibatch)

No KL in the paper (beta = 0; if beta > 0 the KL is token-mean aggregated as well). DAPO's other two
ingredients act on the rollouts, not on the loss, and live in the training loop (harness/loop/native.py), available
to every objective: dynamic sampling (``train.dynamic_sampling``: drop groups whose rewards are all equal and
refill) and soft overlong punishment (``task.overlong_buffer`` / ``task.overlong_penalty``). The full recipe:
``objective.name=dapo train.dynamic_sampling=true task.overlong_buffer=<L_cache>``.

Options (off by default; every objective also takes ``aggregation``, see objectives/base.py):
- ``dual_clip`` / ``clip_ratio_c`` (default 3): verl's dual clip (``clip_ratio_c``; Ye et al., arXiv 1912.09729),
  for A < 0 only: l_t = min(l_t, -clip_ratio_c A), so a token of a bad response whose ratio exceeds c keeps
  the bounded loss -c A and loses its gradient. ``clip_frac_dual`` (A < 0 and r > c) is reported (0 when
  off) and included in ``clip_frac``. Neither the paper nor TRL has it; verl's ``vanilla`` loss always does.
"""

from __future__ import annotations

from objectives.base import Objective, PolicyBatch, ppo_clipped_loss, register_objective, validate_dual_clip


@register_objective("dapo")
class DAPO(Objective):
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: bool = False
    clip_ratio_c: float = 3.0

    default_advantage = "grpo"
    default_aggregation = "token_mean"
    below_one = frozenset({"clip_low"})

    def validate(self):
        validate_dual_clip(self)

    def policy_loss(self, batch: PolicyBatch):
        loss, metrics = ppo_clipped_loss(batch, self.clip_low, self.clip_high, self.aggregation,
                                         clip_ratio_c=self.clip_ratio_c if self.dual_clip else None)
        return loss, {"clip_frac_dual": 0.0, **metrics}
