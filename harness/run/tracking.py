"""Experiment trackers: every metrics row of a run also goes to TensorBoard, Weights & Biases or trackio.

    logging:
      backends: [jsonl, tensorboard]    # jsonl always (metrics.jsonl: the record analysis, resume and reports read)
      project: rlvr-harness             # wandb / trackio project

``RunRecords.log`` (harness/run/records.py) hands each row to :class:`Trackers` after writing it to metrics.jsonl, so
both backends (native and TRL) are covered; only the main process of a distributed run tracks. A run is named by its run
id and grouped by its experiment's name; the resolved config is attached (TensorBoard: hparams and a ``config`` text,
wandb / trackio: the run config). Only numeric values are logged, under the metrics.jsonl key, at the row's step.

- ``tensorboard``: event files in ``<run_dir>/tensorboard/`` (``tensorboard --logdir results/<exp>`` lists each run as
  ``<run_id>/tensorboard``).
- ``wandb``: offline (``<run_dir>/wandb/offline-run-*``; upload later with ``wandb sync``) unless ``WANDB_MODE`` or the
  user's wandb settings file (``wandb online``) say otherwise; run id = run id + a hash of the run folder.
- ``trackio``: the local trackio database (``$TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``; ``trackio
  show``); a Space only if ``TRACKIO_SPACE_ID`` is set.

Resume (metrics.jsonl keeps exactly the steps up to the checkpoint's, then the run re-logs the rest, with the values
an uninterrupted run has): TensorBoard writes a purge marker at the first re-logged step, so its reader drops what an
earlier attempt logged from there on and shows each step once; wandb and trackio resume the same run and skip the rows
of steps they already hold. A run restarted from step 0 clears its TensorBoard folder. A tracker that fails while a
run is going is switched off with one warning on stderr: the run and metrics.jsonl go on.
"""

from __future__ import annotations

import configparser
import contextlib
import difflib
import hashlib
import importlib.util
import math
import os
import re
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness.run.checks import register_check
from harness.run.errors import ConfigError

INSTALL = 'pip install -e ".[track]"'


NOT_A_NAME = re.compile(r"^$|^\.|[/\\]|[^ -~\u00a0-\U0010ffff]")  # empty, .., a path, a control character


@register_check("tracking")
def check_trackers(run: DictConfig) -> None:
    """``logging.backends``: a one-line ConfigError for an unknown tracker, a list without jsonl, a wandb / trackio
    project that is not one name (``../x``, a line break), or a tracker that is not installed. (A run's config.yaml
    from before the logging section has none: jsonl only.)"""
    given = OmegaConf.select(run, "logging.backends", default=None)
    backends = ["jsonl"] if given is None else list(given)
    for name in backends:
        if name not in TRACKERS:
            close = difflib.get_close_matches(str(name), TRACKERS, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"logging.backends: unknown backend {name!r}.{hint} Backends: {', '.join(TRACKERS)}")
    twice = sorted({name for name in backends if backends.count(name) > 1})
    if twice:  # each tracker once (a repeat would log each step to it twice, or be dropped without a word)
        raise ConfigError(f"logging.backends lists {', '.join(twice)} more than once: list each backend once")
    if "jsonl" not in backends:
        example = ",".join(["jsonl", *backends])  # [] too: jsonl alone is a run without trackers
        raise ConfigError("logging.backends must include jsonl (metrics.jsonl is what analysis, resume and the report "
                          f"read); add trackers beside it: logging.backends=[{example}]")
    project = OmegaConf.select(run, "logging.project", default=None)
    if {"wandb", "trackio"} & set(backends) and NOT_A_NAME.search(str(project)):
        raise ConfigError(f"logging.project {str(project)[:80]!r}: a tracker project is one name, not empty, not a "
                          "path (no / or \\, no leading .) and without line breaks")
    missing = [name for name in backends
               if TRACKERS[name].requires and importlib.util.find_spec(TRACKERS[name].requires) is None]
    if missing:
        raise ConfigError(f"logging.backends: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                          f"installed: {INSTALL} (or pip install {' '.join(missing)})")


def numeric(row: dict) -> dict[str, float]:
    """The row's finite numbers (bools as 0/1), without ``step``."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and math.isfinite(v)}


def flat_config(cfg: DictConfig) -> dict:
    """The resolved config as {dotted key: value}, values a tracker's hparams accept (lists / None as text)."""
    out = {}

    def walk(node, prefix):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and value:
                walk(value, name + ".")
            else:
                out[name] = value if isinstance(value, bool | int | float | str) else str(value)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


class JsonlTracker:
    """metrics.jsonl itself is written by ``RunRecords`` (harness/run/records.py, ``MetricsLog``); nothing to add."""

    requires = None  # the module it needs (None: nothing beyond the harness)

    def __init__(self, cfg, run_dir, resume_step):
        pass

    def log(self, step: int, values: dict) -> None:
        pass

    def close(self, failed: bool) -> None:
        pass


class TensorBoardTracker:
    """Event files in ``<run_dir>/tensorboard/``: one scalar per metrics.jsonl key; config as hparams and text."""

    requires = "tensorboard"  # the module it needs (None: nothing beyond the harness)

    def __init__(self, cfg: DictConfig, run_dir: Path, resume_step: int | None):
        # an optional dependency, imported only when the tracker is on (pip install -e ".[track]")
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        folder = run_dir / "tensorboard"
        if resume_step is None:
            shutil.rmtree(folder, ignore_errors=True)  # a fresh start: nothing an earlier attempt logged counts
        # purge_step: TensorBoard's reader drops earlier events at steps >= this one (those are logged again)
        self.writer = SummaryWriter(str(folder), purge_step=None if resume_step is None else resume_step + 1,
                                    flush_secs=30)
        if resume_step is None:
            experiment, start, end = hparams(flat_config(cfg), {"eval_accuracy": 0.0})
            for summary in (experiment, start, end):
                self.writer.file_writer.add_summary(summary, 0)
            self.writer.add_text("config", "```\n" + OmegaConf.to_yaml(cfg) + "```", 0)

    def log(self, step: int, values: dict) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


def _wandb_mode_configured() -> bool:
    """WANDB_MODE, or a ``mode`` in the user's wandb settings files (``wandb online`` / ``wandb offline`` write it)."""
    if os.environ.get("WANDB_MODE"):
        return True
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or "~/.config/wandb").expanduser()
    for path in (config_dir / "settings", Path(os.environ.get("WANDB_DIR") or ".") / "wandb" / "settings"):
        parser = configparser.ConfigParser()
        with contextlib.suppress(OSError, configparser.Error):
            parser.read(path)
            if parser.has_option("default", "mode"):
                return True
    return False


class WandbTracker:
    """A W&B run (offline unless configured otherwise) in ``<run_dir>/wandb/``; resumed by id."""

    requires = "wandb"  # the module it needs (None: nothing beyond the harness)

    def __init__(self, cfg: DictConfig, run_dir: Path, resume_step: int | None):
        import wandb  # an optional dependency, imported only when the tracker is on

        folder = str(run_dir.resolve())
        kwargs = {"mode": "offline"} if not _wandb_mode_configured() else {}
        self.run = wandb.init(
            project=cfg.logging.project, name=run_dir.name, group=cfg.name, dir=folder, resume="allow",
            id=f"{run_dir.name}-{hashlib.sha1(folder.encode()).hexdigest()[:6]}",
            config=OmegaConf.to_container(cfg, resolve=True), **kwargs)
        self.next_step = self.run.step or 0  # a resumed online run continues after the steps it holds

    def log(self, step: int, values: dict) -> None:
        if step >= self.next_step:
            self.run.log(values, step=step)
            self.next_step = step + 1

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class TrackioTracker:
    """A trackio run in the local trackio database; resumed by name, skipping the steps it already holds."""

    requires = "trackio"  # the module it needs (None: nothing beyond the harness)

    def __init__(self, cfg: DictConfig, run_dir: Path, resume_step: int | None):
        import trackio  # an optional dependency, imported only when the tracker is on

        with contextlib.redirect_stdout(sys.stderr):  # trackio prints where it logs: keep stdout clean
            self.run = trackio.init(project=cfg.logging.project, name=run_dir.name, group=cfg.name,
                                    config=OmegaConf.to_container(cfg, resolve=True), resume="allow",
                                    auto_log_gpu=False, auto_log_cpu=False, embed=False)
        self.next_step = getattr(self.run, "_next_step", 0)  # after the last step a resumed run holds

    def log(self, step: int, values: dict) -> None:
        if step >= self.next_step:
            self.run.log(values, step=step)
            self.next_step = step + 1

    def close(self, failed: bool) -> None:
        with contextlib.redirect_stdout(sys.stderr):
            self.run.finish()


# logging.backends' names -> trackers
TRACKERS = {"jsonl": JsonlTracker, "tensorboard": TensorBoardTracker, "wandb": WandbTracker,
            "trackio": TrackioTracker}


class Trackers:
    """The run's trackers (``cfg.logging.backends``; none beyond jsonl for a config without a logging section)."""

    def __init__(self, cfg: DictConfig, run_dir: Path, resume_step: int | None):
        self.active = {}
        for name in dict.fromkeys(OmegaConf.select(cfg, "logging.backends", default=None) or ["jsonl"]):
            if name == "jsonl":
                continue
            try:
                self.active[name] = TRACKERS[name](cfg, run_dir, resume_step)
            except Exception as e:  # the run goes on without it: metrics.jsonl has every row
                print(f"warning: logging.backends {name} could not start ({type(e).__name__}: {e}); the run goes on "
                      "without it (metrics.jsonl has every row)", file=sys.stderr)

    def log(self, row: dict) -> None:
        values = numeric(row)
        for name, tracker in list(self.active.items()):
            try:
                tracker.log(int(row["step"]), values)
            except Exception as e:  # the run goes on: metrics.jsonl has the row
                print(f"warning: logging.backends {name} failed at step {row['step']} ({type(e).__name__}: {e}); "
                      "it is switched off for this run (metrics.jsonl has every row)", file=sys.stderr)
                del self.active[name]

    def close(self, failed: bool = False) -> None:
        for name, tracker in self.active.items():
            try:
                tracker.close(failed)
            except Exception as e:
                print(f"warning: closing logging.backends {name} failed ({type(e).__name__}: {e})", file=sys.stderr)
        self.active = {}
