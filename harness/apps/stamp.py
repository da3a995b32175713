"""What generated pages say about where their numbers come from: the checkout's commit and the machine. The code and
the torch threads of the runs a page summarises are their own records' (harness/run/provenance.py runs_stamp), not
these: runs may have been made, or resumed, by other code and with other threads. And how long a sweep took
(timed_sweep), kept beside its runs so that a page regenerated from them states the time of the command that ran
them."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import transformers

from harness.run.atomic import atomic_write
from harness.run.provenance import cpu
from harness.run.records import ENDED, run_status

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    def git(*args) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("-dirty" if git("status", "--porcelain") else "")


def machine(jobs: int) -> str:
    """The machine line of a generated page: the CPU's name, its vendor, family and model and torch's vector
    capability (what rounds a run's floats: harness/run/provenance.py cpu), the cores, the runs at a time, the
    versions."""
    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    cores = os.cpu_count() or 1
    return (f"{name} ({cpu()}; {torch.backends.cpu.get_cpu_capability()}), {cores} cores, "
            f"{jobs} run{'s' * (jobs != 1)} at a time; "
            f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()} "
            "here")


KEPT = "stamp.json"  # in a sweep's folder: the timing of the command that ran every one of its runs, and their ids


@dataclass(frozen=True)
class SweepTime:
    """How long a command took to run (or resume) a sweep, under what load, on what machine; ``before``: runs that
    had ended before it; ``kept``: this command found every run ended, and these are the figures of the command that
    ran them all (timed_sweep)."""
    wall_s: float
    load_before: float
    load_after: float
    machine: str
    before: int = 0
    kept: bool = False

    def note(self) -> str:
        """The sentence a page adds after the wall time: whose figures they are."""
        if self.kept:
            return (" (This command found every run ended: the wall time, load and machine are those of the command "
                    f"that ran them all: {self.machine}.)")
        if self.before:
            return (f" {self.before} of them had ended before this command (resumed, not rerun: the wall time covers "
                    "the rest).")
        return ""


def timed_sweep(folder: Path, ids: list[str], jobs: int,
                sweep: Callable[[], list[dict]]) -> tuple[list[dict], SweepTime]:
    """Call ``sweep`` (it runs or resumes the runs ``ids`` in ``folder``, ``jobs`` at a time) and time it. A command
    that ran every one of the runs to its end keeps its figures in ``folder``/KEPT; called again once every run has
    ended, the figures given back are those (a page regenerated from ended runs must not report the seconds it took
    to find them ended). Resumed part-way, the timing says how many runs had ended before."""
    ids = sorted(ids)
    before = sum(run_status(folder / rid) in ENDED for rid in ids)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    entries = sweep()
    timing = SweepTime(time.perf_counter() - start, load_before, os.getloadavg()[0], machine(jobs), before)
    if before == 0 and all(e["status"] in ENDED for e in entries):  # every run, measured by this command
        atomic_write(folder / KEPT, json.dumps({"runs": ids, **asdict(timing)}))
    elif before == len(ids) and (earlier := read_kept(folder / KEPT, ids)):
        timing = earlier
    return entries, timing


def read_kept(path: Path, ids: list[str]) -> SweepTime | None:
    """The timing kept at ``path`` by the command that ran exactly the runs ``ids`` (None: none, or other runs')."""
    try:
        kept = json.loads(path.read_text())
        if not isinstance(kept, dict) or kept.pop("runs", None) != ids:
            return None
        return replace(SweepTime(**kept), before=len(ids), kept=True)
    except (OSError, ValueError, TypeError):  # no record, or not one of these (an older stamp.json's text)
        return None
