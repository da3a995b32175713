"""A run's files, crash-safe and the same for both backends:

    <run_dir>/config.yaml          the resolved config
    <run_dir>/metrics.jsonl        one line per step (step 0: the starting policy's evaluation), flushed and fsynced
    <run_dir>/eval_samples.jsonl   one line per eval problem and evaluation (greedy completion, answer, score)
    <run_dir>/summary.json         status (running | finished | failed | interrupted), progress, eval accuracies,
                                   the starting policy's record, the error of a failed run; written atomically
    <run_dir>/checkpoints/         the native loop's last two checkpoints (last.pt, previous.pt)
    <run_dir>/final/               the trained policy in transformers' format (save_pretrained), at the end
    <run_dir>/exports/step_<N>/    the same every ``train.export_every`` steps (both backends)
    <run_dir>/tensorboard/, wandb/ the trackers of ``logging.backends`` beyond jsonl (harness/tracking.py)

On resume both JSON-lines files keep exactly the steps up to the checkpoint's, so no step is ever written twice.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from harness.locks import RUN_LOCK, lock_folder
from harness.tracking import Trackers

# per-step metrics that measure time or memory: they differ between otherwise identical runs (resume checks skip them)
TIMING_METRICS = frozenset({"rollout_s", "update_s", "rollout_tok_s", "update_tok_s", "step_s", "peak_mem_mb",
                            "eval_s", "update_logp_forward_s", "update_stats_forward_s", "update_backward_s",
                            "update_optimizer_s"})


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; analysis reads null as missing
    return value


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({k: _clean(v) for k, v in data.items()}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_jsonl(path: Path, warn: bool = False) -> list[dict]:
    """The complete JSON lines of a file; a truncated last line (a kill mid-write) is dropped silently, any other
    unreadable line with a warning on stderr naming the file and line when ``warn``."""
    if not path.exists():
        return []
    rows, lines = [], path.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if warn and number < len(lines):
                print(f"warning: {path}, line {number} is not valid JSON: dropped (the step it held is listed in "
                      "summary.json's missing_steps)", file=sys.stderr)
    return rows


class MetricsLog:
    """A JSON-lines file of per-step records: on (re)open, keeps only complete lines with step <= ``resume_step``
    (None: keep nothing), so a resumed run never writes a step twice; then appends, flushed and fsynced."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        keep = -1 if resume_step is None else resume_step
        self.rows = [r for r in read_jsonl(path, warn=True) if r.get("step", math.inf) <= keep]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        os.replace(tmp, path)
        self.file = open(path, "a")

    def append(self, row: dict) -> None:
        self.extend([row])

    def extend(self, rows: list[dict]) -> None:
        rows = [{k: _clean(v) for k, v in row.items()} for row in rows]
        self.file.write("".join(json.dumps(row) + "\n" for row in rows))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.rows.extend(rows)

    def close(self) -> None:
        self.file.close()


class RunRecords:
    """The files of one run. ``resume_step``: the step of the checkpoint the run continues from (None: a fresh
    start, whatever an earlier attempt logged is dropped). Only the ``main`` process of a distributed run writes.
    Counters that go into summary.json are set by the backend in ``progress``."""

    def __init__(self, cfg: DictConfig, run_dir: Path, resume_step: int | None, start_policy: dict | None,
                 backend: str, main: bool = True):
        self.cfg, self.run_dir, self.main, self.backend = cfg, run_dir, main, backend
        self.start_policy = start_policy
        self.progress = {"steps_done": resume_step or 0, "rollout_tokens": 0, "update_tokens": 0,
                         "nonfinite_skips": None}
        self.started, self.elapsed_before = time.time(), 0.0
        self.metrics = self.eval_samples = self.lock = self.trackers = None
        if not main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.lock = lock_folder(run_dir / RUN_LOCK, f"run folder {run_dir} is being written by another process")
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        self.metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step)
        self.eval_samples = MetricsLog(run_dir / "eval_samples.jsonl", resume_step)
        self.trackers = Trackers(cfg, run_dir, resume_step)  # logging.backends besides jsonl (harness/tracking.py)
        previous = run_dir / "summary.json"
        if resume_step and previous.exists():
            self.elapsed_before = json.loads(previous.read_text()).get("wall_time_s") or 0.0

    @property
    def rows(self) -> list[dict]:
        return self.metrics.rows if self.metrics else []

    def log(self, row: dict, eval_records: list[dict] | None = None) -> None:
        """Append one step's metrics (and its evaluation's records) and refresh summary.json."""
        if self.main:
            if eval_records:
                self.eval_samples.extend(eval_records)
            self.metrics.append(row)
            self.trackers.log(self.metrics.rows[-1])
        self.progress["steps_done"] = row["step"]
        self.summary("running")

    def wall_time_s(self) -> float:
        return self.elapsed_before + time.time() - self.started

    def summary(self, status: str, error: str | None = None) -> dict:
        evals = [r["eval_accuracy"] for r in self.rows if r.get("eval_accuracy") is not None]
        logged = {r["step"] for r in self.rows}
        start_eval = self.rows[0].get("eval_accuracy") if self.rows and self.rows[0]["step"] == 0 else None
        data = {"run_id": self.run_dir.name, "objective": self.cfg.objective.name, "seed": self.cfg.seed,
                "backend": self.backend, "status": status, **self.progress, "total_steps": self.cfg.train.steps,
                "start_eval_accuracy": start_eval, "final_eval_accuracy": evals[-1] if evals else None,
                "best_eval_accuracy": max(evals) if evals else None, "start_policy": self.start_policy,
                "missing_steps": sorted(set(range(self.progress["steps_done"] + 1)) - logged) if self.rows else [],
                "wall_time_s": self.wall_time_s(), "error": error}
        if self.main:
            write_json_atomic(self.run_dir / "summary.json", data)
        return data

    @contextmanager
    def recording(self):
        """Marks the run running; on an exception, failed (interrupted for Ctrl-C / SIGTERM) with the error in
        summary.json and on stderr; closes the files."""
        self.summary("running")
        failed = True
        try:
            yield self
            failed = False
        except BaseException as e:
            status = "failed" if isinstance(e, Exception) else "interrupted"
            self.summary(status, f"{type(e).__name__}: {e}")
            raise
        finally:
            if self.main:
                self.metrics.close()
                self.eval_samples.close()
                self.trackers.close(failed)
                self.lock.close()


def export_policy(policy, tokenizer, folder: Path) -> None:
    """The policy as transformers saves it (weights, config, tokenizer, chat template), so that transformers, vLLM
    or lm-evaluation-harness load it directly; written to a temporary folder, then renamed into place."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


# ------------------------------------------------------------------------- the native loop's checkpoints


def save_checkpoint(run_dir: Path, payload: dict) -> None:
    """Writes checkpoints/last.pt atomically; the one it replaces is kept as previous.pt until then."""
    folder = run_dir / "checkpoints"
    folder.mkdir(exist_ok=True)
    last, tmp = folder / "last.pt", folder / "last.pt.tmp"
    torch.save(payload, tmp)
    if last.exists():
        os.replace(last, folder / "previous.pt")
    os.replace(tmp, last)


def load_checkpoint(run_dir: Path, device: torch.device) -> dict | None:
    """The newest readable checkpoint (last.pt, else previous.pt with a warning), or None when there is none.
    Raises RuntimeError naming the file and the fix when none of them can be read."""
    folder = run_dir / "checkpoints"
    errors = []
    for name in ("last.pt", "previous.pt"):
        path = folder / name
        if not path.exists():
            continue
        try:
            payload = torch.load(path, map_location=device, weights_only=False)
        except Exception as e:  # a torn or corrupted file: zip errors, EOFError, unpickling errors
            errors.append(f"{path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            continue
        if errors:
            print(f"warning: unreadable checkpoint {errors[0]}; resuming from {path}", file=sys.stderr)
        return payload
    if errors:
        raise RuntimeError(f"unreadable checkpoint {'; '.join(errors)}: delete {folder} to restart this run "
                           "from step 0")
    return None
