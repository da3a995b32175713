"""`python -m harness bench --sweep-throughput`: runs per CPU-hour of one sweep, a process per run against the
worker processes (harness/apps/worker.py), and whether the two give the same runs.

    python -m harness bench --sweep-throughput [--jobs 2] [key=value ...]   # quickstart's sweep and the overrides
        -> results/bench/throughput.json, one table on stdout

The sweep is run twice into fresh folders, with the same ``jobs``, first with ``launcher.runs_per_process=1`` (each
run its own ``python -m harness train`` process, as without workers) and then with 0 (a worker per job takes
the runs one after another; on a machine with GPUs both sides are a process per run, as the local launcher runs
them there). Its starting policies are prepared first, in a process of their own, counted in
neither. Each side's CPU time is the user + system time of the sweep's process and of every process it started
(``resource.getrusage(RUSAGE_CHILDREN)`` around it), not the wall time: on a shared machine the wall time measures
the other processes too. Then every run's metrics (without timings) and per-problem eval records are compared
between the two sides: they must be equal, bit for bit.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.run.atomic import atomic_write
from harness.run.config import load_experiment, run_configs, run_id
from harness.run.records import TIMING_METRICS, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = "quickstart"
SIDES = (("a process per run", 1), ("workers", 0))


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def harness(args: list[str]) -> tuple[int, float, float]:
    """``python -m harness <args>`` in the checkout: its exit status, its CPU seconds (its own and its descendants')
    and its wall seconds."""
    cpu, start = children_cpu_s(), time.perf_counter()
    code = subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, stdout=subprocess.DEVNULL).returncode
    return code, children_cpu_s() - cpu, time.perf_counter() - start


def same_runs(first: Path, second: Path, ids: list[str]) -> list[str]:
    """The run ids whose metrics (timings left out) or eval records differ between the two folders."""
    def records(folder: Path, rid: str) -> tuple[list, list]:
        metrics = [{k: v for k, v in row.items() if k not in TIMING_METRICS}
                   for row in read_jsonl(folder / rid / "metrics.jsonl")]
        return metrics, read_jsonl(folder / rid / "eval_samples.jsonl")

    return [rid for rid in ids if records(first, rid) != records(second, rid) or not records(first, rid)[0]]


def main(overrides: list[str], jobs: int = 2) -> int:
    """Measure both sides (module docstring); 0 when every run ended the same on both."""
    cfg = load_experiment(EXPERIMENT, overrides)
    ids = [run_id(run) for run in run_configs(cfg)]
    print(f"sweep throughput: {EXPERIMENT} {' '.join(overrides)}: {len(ids)} runs, {jobs} at a time, each side "
          "into a fresh folder (load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + ")", file=sys.stderr)
    code, prepare_s, _ = harness(["prepare", EXPERIMENT, *overrides])
    if code:
        print(f"error: preparing the starting policy failed (exit {code})", file=sys.stderr)
        return 1
    sides = []
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp:
        for label, per_process in SIDES:
            folder = Path(tmp) / str(per_process)
            code, cpu, wall = harness(["sweep", EXPERIMENT, *overrides, f"results_dir={folder}", "--jobs", str(jobs),
                                       f"launcher.runs_per_process={per_process}", "--no-report", "--no-progress"])
            sides.append({"side": label, "runs_per_process": per_process, "exit": code, "cpu_s": round(cpu, 1),
                          "wall_s": round(wall, 1), "runs_per_cpu_hour": round(len(ids) * 3600 / cpu, 1)})
            print(f"{label}: {cpu:.1f} CPU-s ({cpu / len(ids):.1f} per run), {wall:.0f} s wall, exit {code}",
                  file=sys.stderr)
        differ = same_runs(*(Path(tmp) / str(p) / cfg.name for _, p in SIDES), ids)
    ratio = sides[0]["cpu_s"] / sides[1]["cpu_s"]
    result = {"experiment": EXPERIMENT, "overrides": overrides, "runs": len(ids), "jobs": jobs,
              "prepare_cpu_s": round(prepare_s, 1), "sides": sides, "ratio": round(ratio, 3),
              "runs_differ": differ, "load_after": os.getloadavg()[0]}
    out = Path(cfg.results_dir) / "bench" / "throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(result, indent=1) + "\n")
    print(f"runs per CPU-hour: {sides[0]['runs_per_cpu_hour']:g} ({sides[0]['side']}), "
          f"{sides[1]['runs_per_cpu_hour']:g} ({sides[1]['side']}): {ratio:.2f}x; runs equal on both sides: "
          f"{len(ids) - len(differ)}/{len(ids)}" + (f" (differ: {', '.join(differ)})" if differ else "")
          + f"\nwritten: {out}")
    return 0 if not differ and not any(s["exit"] for s in sides) else 1
