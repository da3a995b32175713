"""The training backends, chosen by ``backend`` from one table: the native loop and TRL's GRPOTrainer.

    summary = BACKENDS[run.backend].train(run, run_dir, progress=True)

Each backend names what it cannot run (``unsupported``), checked with the config (harness/run/checks.py) before
anything starts.
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


def train_trl(cfg: DictConfig, run_dir: Path, progress: bool = True) -> dict:
    """The TRL backend's run (harness/loop/trl_backend.py)."""
    # imported here, when a TRL run starts: trl takes seconds to import, and a native run never needs it
    from harness.loop.trl_backend import train_trl as run

    return run(cfg, run_dir, progress)


@dataclass(frozen=True)
class Backend:
    train: Callable[..., dict]  # (cfg, run_dir, progress) -> the run's summary
    unsupported: Callable[[DictConfig], str | None]  # why it cannot run a config (one sentence), or None


BACKENDS = {"native": Backend(native.train, lambda run: None), "trl": Backend(train_trl, trl_unsupported)}


@register_check("backend")
def check_backend(run: DictConfig) -> None:
    """``backend`` is in the table and can run this config."""
    if run.backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {run.backend!r}")
    reason = BACKENDS[run.backend].unsupported(run)
    if reason:
        raise ConfigError(reason)
