"""Random streams derived from (seed, step): a resumed run draws exactly what an uninterrupted one would."""

from __future__ import annotations


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """The seed of random stream ``stream`` at ``step`` of a run with ``seed`` (0: prompts, 1: minibatch order,
    2: sampling, 3 and 4: a lagged batch's (harness/loop/pipeline.py), 5: the reference policy's completions
    (harness/loop/batch.py), 7: pass@k sampling)."""
    return (seed * 1_000_003 + step * 101 + stream) % (2**63)
