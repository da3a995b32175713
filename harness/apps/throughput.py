"""`python -m harness bench --sweep-throughput`: runs per CPU-hour of one sweep, a process per run against the
worker processes (harness/apps/worker.py), and whether the two give the same runs.

    python -m harness bench --sweep-throughput [--jobs 2] [--against REV] [key=value ...]   # quickstart's sweep
        -> results/bench/throughput.json, one table on stdout

The sweep is run twice into fresh folders, with the same ``jobs``, first with ``launcher.runs_per_process=1`` (each
run its own ``python -m harness train`` process, as without workers) and then with 0 (a worker per job takes
the runs one after another; on a machine with GPUs both sides are a process per run, as the local launcher runs
them there). Its starting policies are prepared first, in a process of their own, counted in
neither. Each side's CPU time is the user + system time of the sweep's process and of every process it started
(``resource.getrusage(RUSAGE_CHILDREN)`` around it), not the wall time: on a shared machine the wall time measures
the other processes too. Then every run's metrics (without timings) and per-problem eval records are compared
between the two sides: they must be equal, bit for bit.

``--against REV``: the same sweep also runs, a process per run, in a checkout of the commit ``REV`` (a git worktree,
removed after; its starting policy prepared there first, counted in neither), and the result adds the runs per
CPU-hour of this code's default launch (workers) over REV's with a process per run: the gain from REV's
launch to this code's, on the same sweep and machine. Its runs are not compared with this code's (another code
version computes otherwise: a kernel, a recipe).

``--passes N``: the sides run N times, each pass in the reverse order of the one before (REV's, a process per run,
workers; then workers, a process per run, REV's; ...), each into fresh folders, and each side's CPU time is summed
over the passes. On a machine whose speed drifts (a shared virtual machine), one pass charges the drift to the side
that runs last; with 2 passes a drift that is linear in time falls on every side alike. Every pass's two sides of
this code must give the same runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.run.atomic import atomic_write
from harness.run.config import load_experiment, run_configs, run_id
from harness.run.errors import ConfigError
from harness.run.records import TIMING_METRICS, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = "quickstart"
SIDES = (("a process per run", 1), ("workers", 0))


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def harness(args: list[str], root: Path = ROOT) -> tuple[int, float, float]:
    """``python -m harness <args>`` in the checkout ``root``: its exit status, its CPU seconds (its own and its
    descendants') and its wall seconds."""
    cpu, start = children_cpu_s(), time.perf_counter()
    # its own process group: stopped (Ctrl-C, SIGTERM), the bench stops the sweep and its workers with it, as a kill
    # of a sweep does (its runs stay resumable); killing the sweep alone left its workers running to their runs' ends
    process = subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=root, stdout=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        code = process.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait()
        raise
    return code, children_cpu_s() - cpu, time.perf_counter() - start


def measured(label: str, root: Path, per_process: int, folder: Path, overrides: list[str], jobs: int,
             runs: int) -> dict:
    """One side: the sweep into ``folder`` from the checkout ``root``, ``per_process`` runs per process."""
    code, cpu, wall = harness(["sweep", EXPERIMENT, *overrides, f"results_dir={folder}", "--jobs", str(jobs),
                               f"launcher.runs_per_process={per_process}", "--no-report", "--no-progress"], root)
    print(f"{label}: {cpu:.1f} CPU-s ({cpu / runs:.1f} per run), {wall:.0f} s wall, exit {code}", file=sys.stderr)
    return {"side": label, "runs_per_process": per_process, "exit": code, "cpu_s": round(cpu, 1),
            "wall_s": round(wall, 1), "runs_per_cpu_hour": round(runs * 3600 / cpu, 1)}


@contextlib.contextmanager
def checkout(rev: str, tmp: Path, overrides: list[str]):
    """A worktree of ``rev`` with its starting policy prepared (module docstring): (its folder, its short commit,
    the exit status of its prepare); removed after."""
    worktree = tmp / "against"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(worktree), rev], cwd=ROOT, check=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=worktree, capture_output=True,
                                text=True, check=True).stdout.strip()
        code, _, _ = harness(["prepare", EXPERIMENT, *overrides], worktree)
        yield worktree, commit, code
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, check=False)


def passes_of(sides: list[tuple], passes: int, tmp: Path, overrides: list[str], jobs: int, runs: int) -> list[dict]:
    """Each side ``(label, root, runs per process, key)`` measured ``passes`` times, each pass in the reverse order of
    the one before, into ``tmp``/<key>_<pass>; per side its CPU and wall time summed over the passes."""
    totals = {side[3]: [] for side in sides}
    for n in range(passes):
        for label, root, per_process, key in (sides if n % 2 == 0 else sides[::-1]):
            totals[key].append(measured(label, root, per_process, tmp / f"{key}_{n}", overrides, jobs, runs))
    summed = []
    for label, _, per_process, key in sides:
        cpu, wall = sum(m["cpu_s"] for m in totals[key]), sum(m["wall_s"] for m in totals[key])
        failed = next((m["exit"] for m in totals[key] if m["exit"]), 0)  # the first pass's that failed (< 0: killed)
        summed.append({"side": label, "runs_per_process": per_process, "exit": failed, "cpu_s": round(cpu, 1),
                       "wall_s": round(wall, 1), "passes": passes,
                       "runs_per_cpu_hour": round(passes * runs * 3600 / cpu, 1)})
    return summed


def same_runs(first: Path, second: Path, ids: list[str]) -> list[str]:
    """The run ids whose metrics (timings left out) or eval records differ between the two folders."""
    def records(folder: Path, rid: str) -> tuple[list, list]:
        metrics = [{k: v for k, v in row.items() if k not in TIMING_METRICS}
                   for row in read_jsonl(folder / rid / "metrics.jsonl")]
        return metrics, read_jsonl(folder / rid / "eval_samples.jsonl")

    return [rid for rid in ids if records(first, rid) != records(second, rid) or not records(first, rid)[0]]


def main(overrides: list[str], jobs: int = 2, rev: str | None = None, passes: int = 1) -> int:
    """Measure both sides, and REV's with ``rev``, ``passes`` times (module docstring); 0 when every run ended the same
    on both sides in every pass."""
    if rev and subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=ROOT,
                              capture_output=True).returncode:
        raise ConfigError(f"--against {rev}: not a commit of this checkout (git rev-parse {rev}); name one that "
                          "`git log` shows")
    cfg = load_experiment(EXPERIMENT, overrides)
    ids = [run_id(run) for run in run_configs(cfg)]
    at_once = min(jobs, len(ids))  # the sweep starts no more processes than runs
    print(f"sweep throughput: {EXPERIMENT} {' '.join(overrides)}: {len(ids)} runs, {at_once} at a time, each side "
          f"into a fresh folder, {passes} pass{'es' * (passes > 1)} (load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()) + ")", file=sys.stderr)
    code, prepare_s, _ = harness(["prepare", EXPERIMENT, *overrides])
    if code:
        print(f"error: preparing the starting policy failed (exit {code})", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp, contextlib.ExitStack() as stack:
        sides = [(label, ROOT, per_process, str(per_process)) for label, per_process in SIDES]
        if rev:
            worktree, commit, prepared = stack.enter_context(checkout(rev, Path(tmp), overrides))
            sides.insert(0, (f"{commit}, a process per run", worktree, 1, "rev"))
        measures = passes_of(sides, passes, Path(tmp), overrides, jobs, len(ids))
        differ = sorted({rid for n in range(passes)
                         for rid in same_runs(*(Path(tmp) / f"{p}_{n}" / cfg.name for _, p in SIDES), ids)})
    before, mine = (measures[0], measures[1:]) if rev else (None, measures)
    if before:
        before.update(commit=commit, exit=prepared or before["exit"])
    ratio = mine[0]["cpu_s"] / mine[1]["cpu_s"]
    result = {"experiment": EXPERIMENT, "overrides": overrides, "runs": len(ids), "jobs": jobs, "passes": passes,
              "prepare_cpu_s": round(prepare_s, 1), "sides": mine, "ratio": round(ratio, 3),
              "runs_differ": differ, "load_after": os.getloadavg()[0]}
    summary = (f"runs per CPU-hour: {mine[0]['runs_per_cpu_hour']:g} ({mine[0]['side']}), "
               f"{mine[1]['runs_per_cpu_hour']:g} ({mine[1]['side']}): {ratio:.2f}x; runs equal on both sides: "
               f"{len(ids) - len(differ)}/{len(ids)}" + (f" (differ: {', '.join(differ)})" if differ else ""))
    if before:
        gain = before["cpu_s"] / mine[1]["cpu_s"]
        result.update(against=before, ratio_against=round(gain, 3))
        summary += (f"\nagainst {before['side']}: {before['runs_per_cpu_hour']:g} runs per CPU-hour; this code's "
                    f"workers {gain:.2f}x that")
    out = Path(cfg.results_dir) / "bench" / "throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(result, indent=1) + "\n")
    print(f"{summary}\nwritten: {out}")
    failed = any(s["exit"] for s in mine) or bool(before and before["exit"])
    return 0 if not differ and not failed else 1
