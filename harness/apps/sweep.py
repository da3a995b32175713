"""Run every point of an experiment's sweep, each run in its own process, resumable and in parallel.

results/<exp>/manifest.json lists the runs and their status (pending, running, finished, failed, interrupted, or
stopped: killed, its summary still saying running while no process holds its lock). Running the same sweep again
skips finished runs and resumes the others from their last checkpoint. ``jobs`` runs go at once, CPU threads split
between them; if the sweep process dies (even SIGKILL), its children die with it.
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from tqdm import tqdm

from harness.loop.build import build_policy, build_task
from harness.loop.metrics import progress_fields
from harness.policy.device import resolve_device
from harness.run.atomic import atomic_write, remove_stale_temporaries
from harness.run.config import check_this_machine, run_configs, run_id
from harness.run.locks import RUN_LOCK, SWEEP_LOCK, is_held, lock_folder
from harness.run.records import read_jsonl, run_status, write_json_atomic
from harness.run.threads import free_threads, run_threads


def _die_with_parent() -> None:
    try:  # Linux: the child gets SIGKILL when the sweep process dies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def _error(run_dir: Path) -> str | None:
    """A stopped run's error: summary.json's, else the last line of its train.log (e.g. a full disk's, when the
    summary could not be written)."""
    try:
        error = json.loads((run_dir / "summary.json").read_text()).get("error")
    except (OSError, json.JSONDecodeError, AttributeError):
        error = None
    if error:
        return error
    try:
        lines = [line for line in (run_dir / "train.log").read_text().splitlines() if line.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def _grid_point(run: DictConfig, cfg: DictConfig) -> dict:
    """The values of the swept keys (grid and per-objective) in this run."""
    keys = dict.fromkeys([*cfg.sweep.grid, *(k for o in cfg.sweep.per_objective.values() for k in o)])
    values = {k: OmegaConf.select(run, k) for k in keys}
    return {k: OmegaConf.to_container(v) if isinstance(v, DictConfig | ListConfig) else v for k, v in values.items()}


def prepare_starting_policies(runs: list[DictConfig], progress: bool) -> None:
    """Build each distinct warm-started starting policy once, with all cores, before the runs start (they
    then load it from the cache instead of training it in parallel, one core each)."""
    if any(run.model.warm_start_steps for run in runs):
        run_threads(runs[0].threads)
    done = set()
    for run in runs:
        key = json.dumps(OmegaConf.to_container(OmegaConf.masked_copy(run, ["model", "task", "device"])),
                         sort_keys=True)
        if run.model.warm_start_steps and key not in done:
            if progress:
                tqdm.write(f"preparing the starting policy ({run.model.warm_start_steps} warm-start steps, cached)")
            build_policy(run, build_task(run), resolve_device(run.device))
            done.add(key)


def run_sweep(cfg: DictConfig, jobs: int = 1, progress: bool = True) -> list[dict]:
    """Run (or resume) the sweep; returns the manifest's run entries. Raises FolderBusyError if another sweep holds
    the folder."""
    runs = run_configs(cfg)
    check_this_machine(runs)
    exp_dir = Path(cfg.results_dir) / cfg.name
    exp_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_folder(exp_dir / SWEEP_LOCK, f"another sweep is already running in {exp_dir}")
    remove_stale_temporaries(exp_dir)  # a manifest.json.tmp a full disk or a kill left
    entries = [run_entry(run, cfg, exp_dir) for run in runs]
    manifest = exp_dir / "manifest.json"

    def save_manifest() -> None:
        write_json_atomic(manifest, {"experiment": cfg.name, "runs": entries})

    save_manifest()
    todo = [e for e in entries if e["status"] != "finished"]
    prepare_starting_policies([run for run, e in zip(runs, entries, strict=True) if e in todo], progress)
    threads = threads_per_run(jobs)
    sweep_bar = tqdm(total=len(entries), initial=len(entries) - len(todo), desc=f"sweep {cfg.name}",
                     unit="run", disable=not progress, position=0)
    active: dict[str, Child] = {}
    done = False
    try:
        while todo or active:
            while todo and len(active) < jobs:  # start runs up to `jobs` at once
                entry = todo.pop(0)
                active[entry["run_id"]] = Child.start(exp_dir / entry["dir"], threads, progress, 1 + len(active))
                entry["status"] = "running"
                save_manifest()
            time.sleep(1.0)
            for rid, child in list(active.items()):  # progress bars; the runs that ended
                if child.poll():
                    continue
                entry = next(e for e in entries if e["run_id"] == rid)
                entry["status"], error = child.ended(rid)
                if error and error.startswith(("error: disk full", "error: disk quota")):
                    todo.clear()  # the next runs would stop the same way: free space, then run the sweep again
                save_manifest()
                del active[rid]
                sweep_bar.update(1)
        done = True
    finally:
        for child in active.values():
            child.stop()
        for entry in entries:
            if entry["status"] == "running":
                entry["status"] = run_status(exp_dir / entry["dir"])
        try:
            save_manifest()
        except OSError:
            if done:
                raise  # else already on the way out with an error (a full disk's, ...): that one is reported
        finally:
            sweep_bar.close()
            lock.close()
    return entries


def run_entry(run: DictConfig, cfg: DictConfig, exp_dir: Path) -> dict:
    """The run's folder with its config.yaml (a resumed run's gets this sweep's trackers, which are not part of the
    run id), and its manifest entry."""
    rid = run_id(run)
    run_dir = exp_dir / rid
    run_dir.mkdir(exist_ok=True)
    if not (run_dir / "config.yaml").exists():
        atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(run))
    elif "logging" in run and not is_held(run_dir / RUN_LOCK):
        saved = OmegaConf.load(run_dir / "config.yaml")
        if OmegaConf.select(saved, "logging") != run.logging:
            saved.logging = run.logging
            atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(saved))
    return {"run_id": rid, "objective": run.objective.name, "seed": run.seed, "overrides": _grid_point(run, cfg),
            "status": run_status(run_dir), "dir": rid}


def threads_per_run(jobs: int) -> int:
    """Each run's share of the cores free now (harness/run/threads.py), with a note when others keep some busy."""
    free, available, busy = free_threads()
    threads = max(1, free // jobs)
    if free < available:
        tqdm.write(f"note: {busy:.1f} of {available} cores are busy with other processes: {threads} torch "
                   f"thread{'s' if threads > 1 else ''} per run")
    return threads


@dataclass
class Child:
    """One run's process (``python -m harness train <run_dir>/config.yaml``), its log file and progress bar."""

    run_dir: Path
    proc: subprocess.Popen
    bar: tqdm
    logfile: object

    @classmethod
    def start(cls, run_dir: Path, threads: int, progress: bool, position: int) -> Child:
        logfile = open(run_dir / "train.log", "a")
        proc = subprocess.Popen(
            [sys.executable, "-m", "harness", "train", str(run_dir / "config.yaml"), "--run-dir", str(run_dir),
             "--threads", str(threads), "--no-progress"],
            stdout=logfile, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        total = OmegaConf.load(run_dir / "config.yaml").train.steps
        bar = tqdm(total=total, desc=run_dir.name, unit="step", leave=False, disable=not progress, position=position)
        return cls(run_dir, proc, bar, logfile)

    def poll(self) -> bool:
        """Refresh the progress bar from metrics.jsonl; whether the process is still running."""
        rows = read_jsonl(self.run_dir / "metrics.jsonl")
        if rows:
            self.bar.n = rows[-1]["step"]
            self.bar.set_postfix(progress_fields(rows[-1], rows))
            self.bar.refresh()
        return self.proc.poll() is None

    def ended(self, rid: str) -> tuple[str, str | None]:
        """The ended run's status and error (said on the terminal when it did not finish); closes its bar and log."""
        status, error = run_status(self.run_dir), _error(self.run_dir)
        code = self.proc.returncode
        if code and status not in ("failed", "interrupted"):  # it could not write its summary
            status = "stopped" if code < 0 else "failed"  # killed by a signal / e.g. a full disk
        if code:
            tqdm.write(f"run {rid} {status} (exit {code}): {error or 'no summary'}; "
                       f"log in {self.run_dir / 'train.log'}")
        self.bar.close()
        self.logfile.close()
        return status, error

    def stop(self) -> None:
        """Terminate the process (the sweep is stopping) and close its bar and log."""
        self.proc.terminate()
        self.proc.wait()
        self.bar.close()
        self.logfile.close()
