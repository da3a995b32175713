"""The training backends, chosen by ``backend`` from one table: the native loop and TRL's GRPOTrainer.

    summary = BACKENDS[run.backend].train(run, run_dir, progress=True)
    reason = BACKENDS[run.backend].refusal(run)     # what it cannot run, one sentence (or None)

Each backend declares what it provides an objective beyond log-probs and advantages (``provides``: keys of
objectives/base.py ``NEEDS``, checked by ``lifecycle_unsupported``) and names what else of a config it cannot run
(``unsupported``), both checked with the config (harness/run/checks.py) before anything starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from harness.loop import native
from harness.loop.trl_limits import trl_unsupported
from harness.run.checks import register_check
from harness.run.errors import ConfigError
from objectives import OBJECTIVES
from objectives.base import lifecycle_unsupported


def train_trl(cfg: DictConfig, run_dir: Path, progress: bool = True) -> dict:
    """The TRL backend's run (harness/loop/trl_backend.py)."""
    # imported here, when a TRL run starts: trl takes seconds to import, and a native run never needs it
    from harness.loop.trl_backend import train_trl as run

    return run(cfg, run_dir, progress)


@dataclass(frozen=True)
class Backend:
    name: str
    train: Callable[..., dict]  # (cfg, run_dir, progress) -> the run's summary
    unsupported: Callable[[DictConfig], str | None]  # why it cannot run a config (one sentence), or None
    provides: frozenset[str]  # what it provides an objective (objectives/base.py NEEDS): the lifecycle, hidden states

    def refusal(self, run: DictConfig) -> str | None:
        """Why this backend cannot run ``run`` (one sentence naming the fix), or None: the objective's declared
        needs it does not provide, then the rest of the config."""
        lifecycle = lifecycle_unsupported(OBJECTIVES.get(run.objective.name), f"backend {self.name}", self.provides)
        return f"{lifecycle}; use backend=native" if lifecycle else self.unsupported(run)


BACKENDS = {
    "native": Backend("native", native.train, lambda run: None, frozenset({"state", "hidden_states", "reference"})),
    # TRL's trainer calls none of the lifecycle hooks, computes no hidden states for the loss and reference log-probs
    # only for its KL term (beta > 0)
    "trl": Backend("trl", train_trl, trl_unsupported, frozenset()),
}


@register_check("backend")
def check_backend(run: DictConfig) -> None:
    """``backend`` is in the table and can run this config."""
    if run.backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {run.backend!r}")
    reason = BACKENDS[run.backend].refusal(run)
    if reason:
        raise ConfigError(reason)
