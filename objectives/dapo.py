"""DAPO — Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv 2503.14476).

    r_t  = exp(logp_t - old_logp_t)
    l_t  = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)       (clip-higher: 0.2 / 0.28)
    loss = sum_{i,t} mask * l_t / sum_{i,t} mask                      (token-mean over the whole minibatch)

GRPO's loss (objectives/grpo.py) with DAPO's defaults: clip_high 0.28 and token-mean aggregation. No KL in the
paper (beta = 0; if beta > 0 the KL is token-mean aggregated as well). DAPO's other two ingredients act on the
rollouts, not on the loss, and live in the training loop (harness/loop/batch.py), available to every objective:
dynamic sampling (``train.dynamic_sampling``: drop groups whose rewards are all equal and refill) and soft overlong
punishment (``task.overlong_buffer`` / ``task.overlong_penalty``). The full recipe:
``objective.name=dapo train.dynamic_sampling=true task.overlong_buffer=<L_cache>``.

Options: GRPO's (``dual_clip`` / ``clip_ratio_c``: verl's dual clip, objectives/grpo.py) and ``aggregation``.
"""

from __future__ import annotations

from objectives.base import register_objective
from objectives.grpo import GRPO


@register_objective("dapo")
class DAPO(GRPO):
    clip_high: float = 0.28

    default_aggregation = "token_mean"
