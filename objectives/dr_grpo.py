"""Dr. GRPO — Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (arXiv 2503.20783).

    A_i  = R_i - mean_g R                                              (no std division: ``mean_only``)
    l_t  = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)        (GRPO's surrogate, 0.2 / 0.2)
    loss = sum_{i,t} mask * l_t / (N_seqs * max_completion_len)        (constant normaliser: no length bias)

GRPO's loss (objectives/grpo.py) with Dr. GRPO's defaults: the ``mean_only`` advantage and the constant
normaliser. ``PolicyBatch.max_completion_len`` must be set (the generation budget, the same constant for every
batch). If beta > 0 the KL is aggregated the same way.

Options: GRPO's (``dual_clip`` / ``clip_ratio_c``: verl's dual clip, objectives/grpo.py) and ``aggregation``.
"""

from __future__ import annotations

from objectives.base import register_objective
from objectives.grpo import GRPO


@register_objective("dr_grpo")
class DrGRPO(GRPO):
    default_advantage = "mean_only"
    default_aggregation = "seq_mean_token_sum_norm"
