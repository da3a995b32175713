"""`make soak`: kill sweeps and runs at random moments, resume, and check that nothing was lost or written twice.

    python -m harness soak [--kills 20] [--seed 0] [--steps 30] [--jobs 2] [--out results/soak]

A tiny two-objective sweep (``steps`` steps each) is started again and again; each time it is killed with SIGKILL,
SIGTERM or SIGINT, aimed at the sweep process or at one of its runs, at a random moment, in the step-0 window (after the
starting policy's evaluation line, before the first checkpoint; a sweep's first kill aims there, or comes at once where
every run is past it already, logged as random) or while a checkpoint is being written. A kill counts once its signal is
sent; a sweep that ends on its own before the kills planned is followed by a new one in a folder of its own, so that
every kill planned lands. After ``kills`` kills each sweep runs to the end. Then every run must be finished, every file
must parse, metrics.jsonl must hold steps 0..steps once each, and every run's metrics and eval records must equal those
of the same run trained without interruption (trained here, in the soak's own process, after the sweep). Writes
``soak.json`` into ``--out`` (default results/soak) and prints one line. The sweeps run in a temporary folder of the
soak's own, removed when the soak passes and kept (named in that line) when it finds a problem. A soak stopped
by Ctrl-C or SIGTERM stops its sweeps (each in a session of its own, out of the Ctrl-C's reach) and removes the
folder; it does not resume.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harness.apps.worker import output_to
from harness.run.atomic import atomic_write
from harness.run.records import TIMING_METRICS, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
            "model.tiny.intermediate_size=64", "task.eval_size=8", "train.prompts_per_step=4", "train.group_size=4",
            "train.max_new_tokens=8", "train.num_minibatches=2", "train.eval_every=5", "threads=1", "train.lr=1e-3",
            "task.overlong_buffer=6"]
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
STOP_ROUNDS = 3  # stop_processes_in: rounds of SIGKILL (a sweep may start a run as its siblings die)


def harness(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, **kwargs)


def processes_naming(folder: Path, kinds: tuple[str, ...] = ()) -> list[int]:
    """Pids of the harness's processes (``python -m harness ...``) whose command line names ``folder`` (and one of
    ``kinds``, the harness's commands, where given); a process of the user's that names it (``tail -f``) is none."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if (" -m harness " in command and str(folder) in command
                    and (not kinds or any(f" {kind} " in command for kind in kinds))):
                pids.append(int(entry.name))
    return pids


def run_processes(exp_dir: Path) -> list[int]:
    """Pids of the runs a sweep of ``exp_dir`` has started: ``train`` processes (their command line names their run
    folder) and the workers that train its runs one after another (theirs names the results folder:
    harness/apps/worker.py)."""
    return processes_naming(exp_dir, ("train", "worker"))


def stop_processes_in(work: Path) -> None:
    """SIGKILL every process of the soak's own folder ``work`` (its sweeps, their workers and runs: each command line
    names a folder in it), in at most STOP_ROUNDS rounds (a process this user may not kill does not hold the soak
    for ever); each sweep runs in a session of its own, so a Ctrl-C to the soak does not reach them."""
    for _ in range(STOP_ROUNDS):
        if not (pids := processes_naming(work)):
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not set(pids) & set(processes_naming(work)), 5)


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def in_step0_window(exp_dir: Path) -> bool:
    return any(len(read_jsonl(run / "metrics.jsonl")) == 1 and not (run / "checkpoints").exists()
               for run in exp_dir.glob("*-s*-*"))


def past_step0(exp_dir: Path) -> bool:
    """Whether every run folder begun is past step 0's window (a second metrics line, or a checkpoint)."""
    runs = list(exp_dir.glob("*-s*-*"))
    return bool(runs) and all(len(read_jsonl(run / "metrics.jsonl")) > 1 or (run / "checkpoints").exists()
                              for run in runs)


def writing_checkpoint(exp_dir: Path) -> bool:
    return any(exp_dir.glob("*/checkpoints/last.pt.tmp"))


def check_files(exp_dir: Path) -> list[str]:
    """Problems with the files as a reader finds them at this moment (a torn last JSON line is allowed; no manifest
    where no run has begun: a sweep killed before its first write, as a loaded machine lets a kill come early)."""
    problems = []
    begun = any(exp_dir.glob("*/config.yaml")) or (exp_dir / "manifest.json").exists()
    for path in [exp_dir / "manifest.json"] * begun + [*exp_dir.glob("*/summary.json")]:
        try:
            json.loads(path.read_text())
        except (OSError, ValueError) as e:  # not JSON, or not UTF-8
            problems.append(f"{path}: {e}")
    for path in exp_dir.glob("*/metrics.jsonl"):
        steps = [r["step"] for r in read_jsonl(path)]
        if len(steps) != len(set(steps)):
            problems.append(f"{path}: a step written twice: {steps}")
    return problems


def train_uninterrupted(run_dir: Path, folder: Path, cli: Callable[[list[str]], int]) -> Path:
    """The run of ``run_dir``'s config.yaml trained from scratch into ``folder``/<its name> by ``cli`` (the CLI's
    ``main``: ``train`` in this process, as a sweep's worker trains it: bit-equal to a process of its own,
    tests/test_worker.py), its output in ``folder``/<its name>.log; that folder."""
    reference = folder / run_dir.name
    folder.mkdir(parents=True, exist_ok=True)
    with output_to(str(folder / f"{run_dir.name}.log")):
        cli(["train", str(run_dir / "config.yaml"), "--run-dir", str(reference), "--no-progress"])
    return reference


def sweep_args(experiment: Path, folder: Path, steps: int, jobs: int) -> list[str]:
    """The soak's sweep command, its results under ``folder``."""
    return ["sweep", str(experiment), *SETTINGS, f"train.steps={steps}", f"results_dir={folder}", "--no-progress",
            "--no-report", "--jobs", str(jobs)]


def kill_round(rng: random.Random, args: list[str], exp_dir: Path, log: list[dict], kills: int) -> list[str]:
    """Start the sweep of ``args`` again and again, each time killing it or one of its runs (module docstring), until
    ``log`` holds ``kills`` kills or the sweep ends first; a kill is logged only when its signal was sent. The
    problems of the files as found after each kill."""
    problems = []
    while len(log) < kills:
        sweep = harness(*args)
        moment = "step0" if not (exp_dir / "manifest.json").exists() else rng.choice(["random", "random", "checkpoint"])
        if moment == "step0":  # a brief window in each run: once every run is past it, the kill comes at once
            hit = wait_for(lambda: in_step0_window(exp_dir) or past_step0(exp_dir), 30) and in_step0_window(exp_dir)
        elif moment == "checkpoint":
            hit = wait_for(lambda: writing_checkpoint(exp_dir), 30)
        else:
            hit = not wait_for(lambda process=sweep: process.poll() is not None, rng.uniform(0.5, 8.0))
        name = rng.choice(list(SIGNALS))
        runs = run_processes(exp_dir)
        target = "run" if runs and rng.random() < 0.4 else "sweep"
        killed = sweep.poll() is None
        if killed:
            os.kill(rng.choice(runs) if target == "run" else sweep.pid, SIGNALS[name])
            log.append({"moment": moment if hit else "random", "signal": name, "target": target})
        if target == "run" and sweep.poll() is None:
            sweep.kill()  # the sweep goes on after a run dies; stop it too, so each round starts afresh
        sweep.wait()
        wait_for(lambda: not run_processes(exp_dir), 30)
        problems += check_files(exp_dir)
        if not killed:  # it ended before the kills planned: nothing left to interrupt in this folder
            return problems + ([] if sweep.returncode == 0 else [f"the sweep failed on its own (exit "
                                                                  f"{sweep.returncode}): {' '.join(args)}"])
    return problems


def check_resumed(exp_dir: Path, manifest: dict, reference: Path, cli: Callable[[list[str]], int],
                  steps: int) -> list[str]:
    """After the final resume: every run of ``manifest`` finished, its metrics and eval records equal to those of
    the same run trained without interruption (into ``reference``), its steps 0..``steps`` once each."""
    problems = []
    for entry in manifest["runs"]:
        run_dir = exp_dir / entry["dir"]
        if entry["status"] != "finished":
            problems.append(f"{entry['run_id']}: {entry['status']} after the final resume")
            continue
        uninterrupted = train_uninterrupted(run_dir, reference, cli)
        for name in ("metrics.jsonl", "eval_samples.jsonl"):
            got = [{k: v for k, v in r.items() if k not in TIMING_METRICS} for r in read_jsonl(run_dir / name)]
            want = [{k: v for k, v in r.items() if k not in TIMING_METRICS} for r in read_jsonl(uninterrupted / name)]
            if got != want:
                problems.append(f"{run_dir / name} differs from the uninterrupted run's")
        if [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] != list(range(steps + 1)):
            problems.append(f"{run_dir}/metrics.jsonl does not hold steps 0..{steps} once each")
    return problems


def main(cli: Callable[[list[str]], int], kills: int = 20, seed: int = 0, steps: int = 30, jobs: int = 2,
         out: Path = ROOT / "results" / "soak") -> int:
    """The soak (module docstring); ``cli``: the CLI's ``main``, which trains the uninterrupted runs; ``out``: the
    folder of soak.json."""
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    try:
        return soak_in(work, cli, kills, seed, steps, jobs, out)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C or SIGTERM: nothing concluded, nothing worth keeping
        stop_processes_in(work)
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        stop_processes_in(work)  # whatever ended the soak: none of its sweeps outlives it


def soak_in(work: Path, cli: Callable[[list[str]], int], kills: int, seed: int, steps: int, jobs: int,
            out: Path) -> int:
    """:func:`main`'s soak, its sweeps in the folder ``work``."""
    rng = random.Random(seed)
    experiment = work / "soak.yaml"
    experiment.write_text("sweep:\n  grid:\n    objective.name: [grpo, gspo]\n")
    log, problems, started, rounds = [], [], time.time(), []
    while len(log) < kills and not problems:  # a sweep that ends before the kills planned: a round in a new folder
        rounds.append(work / f"round{len(rounds)}")
        before = len(log)
        problems += kill_round(rng, sweep_args(experiment, rounds[-1], steps, jobs), rounds[-1] / "soak", log, kills)
        if len(log) == before:
            problems.append("a sweep ended before any kill could reach it: raise --steps")
    runs = 0
    for folder in rounds:
        final = harness(*sweep_args(experiment, folder, steps, jobs))
        final.wait()
        try:
            manifest = json.loads((folder / "soak" / "manifest.json").read_text())
        except (OSError, ValueError) as e:
            problems.append(f"{folder / 'soak'}: no manifest after the final resume ({e})")
            continue
        runs += len(manifest["runs"])
        problems += check_resumed(folder / "soak", manifest, work / "reference" / folder.name, cli, steps)
    result = {"kills": len(log), "by_moment": {m: sum(e["moment"] == m for e in log) for m in
                                               ("random", "step0", "checkpoint")},
              "by_target": {t: sum(e["target"] == t for e in log) for t in ("sweep", "run")},
              "by_signal": {s: sum(e["signal"] == s for e in log) for s in SIGNALS}, "runs": runs,
              "problems": problems, "passed": not problems, "seed": seed, "wall_time_s": time.time() - started,
              "log": log, "sweeps_kept_in": str(work) if problems else None}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "soak.json", json.dumps(result, indent=2))
    if not problems:
        shutil.rmtree(work, ignore_errors=True)  # the soak's own temporary folder: nothing in it is the user's
    record = out.resolve() / "soak.json"
    record = record.relative_to(ROOT) if record.is_relative_to(ROOT) else record  # as docs/results.md quotes it
    print(f"soak: {'PASS' if not problems else 'FAIL'}: {len(log)} kills ({result['by_moment']}, "
          f"{result['by_target']}, {result['by_signal']}), {runs} runs resumed to the end in {len(rounds)} "
          f"sweep{'s' * (len(rounds) > 1)}, "
          f"{len(problems)} problems{': ' + '; '.join(problems[:3]) if problems else ''} "
          f"({result['wall_time_s']:.0f} s; {record}{f'; the sweeps kept in {work}' if problems else ''})")
    return 0 if not problems else 1
