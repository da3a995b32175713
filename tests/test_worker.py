"""harness/apps/worker.py and the local launcher's workers: a run trained in a worker after another run is the run a
process of its own trains, bit for bit, with its own train.log, lock, summary and provenance."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.apps.cli import main
from harness.apps.worker import output_to
from harness.run.locks import RUN_LOCK, is_held
from harness.run.records import read_jsonl, run_status
from tests.helpers.processes import ROOT, cli, processes_with, wait_until
from tests.helpers.tiny import TINY_RUN, VARIED_REWARD, without_timing

KILLED_STEPS = 30  # the killed run's steps: killed two steps in, its last 28 are the room the kill has to land in


def test_the_soak_finds_a_sweeps_workers_as_its_runs(tmp_path):
    """`make soak` kills runs it finds by their command line: a worker's names the results folder, not a run's."""
    from harness.apps.soak import run_processes

    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "harness", "worker",
                                 str(tmp_path)])  # as `python -m harness worker <results folder>` reads
    try:  # waited for: /proc may show the command line a moment after Popen returns (seen once)
        assert wait_until(lambda: stand_in.pid in run_processes(tmp_path), timeout=60)
        assert stand_in.pid not in run_processes(tmp_path / "other")
    finally:
        stand_in.kill()
        stand_in.wait()


def test_output_to_appends_both_streams_to_the_log_and_restores_them(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text("before\n")
    with capsys.disabled():  # the real streams: the worker's
        before = os.fstat(1).st_ino, os.fstat(2).st_ino
        with output_to(str(log)):
            print("out line")
            print("err line", file=sys.stderr)
        assert (os.fstat(1).st_ino, os.fstat(2).st_ino) == before
    assert log.read_text() == "before\nout line\nerr line\n"


@pytest.mark.slow
def test_a_run_in_a_worker_after_another_is_the_run_of_its_own_process(tmp_path, capsys):
    exp = tmp_path / "pair.yaml"
    exp.write_text("sweep:\n  grid:\n    objective.name: [gspo, grpo]\n")
    settings = [*TINY_RUN, VARIED_REWARD, "train.steps=3", "train.eval_every=2"]
    # the sweep in this process; one worker process: gspo's run, then grpo's in it
    assert main(["sweep", str(exp), *settings, f"results_dir={tmp_path}/res", "--jobs", "1", "--no-progress",
                 "--no-report"]) == 0, capsys.readouterr().err
    folder = tmp_path / "res" / "pair"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [r["status"] for r in manifest["runs"]] == ["finished", "finished"]
    second = folder / manifest["runs"][1]["dir"]
    alone = tmp_path / "alone"
    out = cli("train", str(exp), *settings, "objective.name=grpo", "--run-dir", str(alone), "--no-progress")
    assert out.returncode == 0, out.stderr  # a process of its own, which trained nothing before
    assert without_timing(read_jsonl(second / "metrics.jsonl")) == without_timing(read_jsonl(alone / "metrics.jsonl"))
    assert read_jsonl(second / "eval_samples.jsonl") == read_jsonl(alone / "eval_samples.jsonl")
    for entry in manifest["runs"]:  # each run's own log, lock released, summary with its code and one segment
        run_dir = folder / entry["dir"]
        log = (run_dir / "train.log").read_text()
        assert f"objective {entry['objective']}, seed 0 -> {run_dir}" in log and log.count(" run on ") == 1
        assert not is_held(run_dir / RUN_LOCK)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "finished" and len(summary["segments"]) == 1 and summary["code"]["version"]


def kill_a_worker_mid_run(args: list[str], folder: Path) -> tuple[Path, int] | None:
    """Start the sweep of ``args`` (its one run in a worker process), SIGKILL the worker once the run has logged two
    steps, and return the run's folder and the sweep's exit status; None where the run had ended before the kill
    landed. The worker is found before the run's first step and the steps are polled often, so the kill lands within
    a poll of the second step, with most of the run's KILLED_STEPS still ahead of it."""
    sweep = subprocess.Popen([sys.executable, "-m", "harness", "sweep", *args], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def run_and_worker() -> tuple[Path, list[int]] | None:  # no workers: the run finished before they were found
        runs = [p for p in folder.glob("grpo-*") if p.is_dir()] if folder.exists() else []
        workers = processes_with(f"harness worker {folder}") if runs else []
        return (runs[0], workers) if workers or runs and run_status(runs[0]) == "finished" else None

    found = wait_until(run_and_worker, timeout=120, process=sweep)
    assert found is not None, "the sweep started no run"
    run_dir, workers = found
    two_steps = wait_until(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 3, timeout=120, process=sweep,
                           poll=0.02)
    assert two_steps, "the run made no progress"
    for worker in workers:
        with contextlib.suppress(ProcessLookupError):  # it ended since the scan: the run's record says so below
            os.kill(worker, signal.SIGKILL)
    status = sweep.wait(timeout=120)
    summary = run_dir / "summary.json"
    ended = summary.is_file() and json.loads(summary.read_text())["status"] == "finished"
    return None if ended else (run_dir, status)


@pytest.mark.slow
def test_a_worker_killed_mid_run_leaves_it_stopped_and_the_sweep_resumes_it(tmp_path, capsys):
    """SIGKILL of the worker (as `make soak` aims at a run): its run says stopped, the next sweep resumes it, and the
    resumed run equals one never interrupted. Where the run ended before the kill landed (a tiny run on a loaded
    machine), the sweep runs again into a fresh folder: read from the run's record, not assumed from a clock."""
    exp, steps = tmp_path / "one.yaml", f"train.steps={KILLED_STEPS}"
    exp.write_text("sweep:\n  grid:\n    objective.name: [grpo]\n")
    for attempt in range(5):
        args = [str(exp), *TINY_RUN, VARIED_REWARD, steps, f"results_dir={tmp_path}/res{attempt}",
                "--no-progress", "--no-report"]
        folder = tmp_path / f"res{attempt}" / "one"
        if (killed := kill_a_worker_mid_run(args, folder)) is not None:
            break
    assert killed is not None, "each of 5 sweeps ended its run before the kill landed"
    run_dir, status = killed
    assert status == 1  # the run did not end: the sweep says so
    assert json.loads((folder / "manifest.json").read_text())["runs"][0]["status"] == "stopped"
    # the resuming sweep (its run in a worker process it starts) and the reference in this process
    assert main(["sweep", *args]) == 0, capsys.readouterr().err
    ref = tmp_path / "ref"
    assert main(["train", str(exp), *TINY_RUN, VARIED_REWARD, steps, "--run-dir", str(ref),
                 "--no-progress"]) == 0
    assert without_timing(read_jsonl(run_dir / "metrics.jsonl")) == without_timing(read_jsonl(ref / "metrics.jsonl"))


def test_a_stopped_throughput_bench_stops_its_sweeps_workers_too(monkeypatch):
    """Ctrl-C or SIGTERM of `bench --sweep-throughput` killed its sweep's process alone: the sweep's workers ran on
    to their runs' ends (the seventh hostile pass). The sweep runs in a process group of its own,
    which the bench stops with SIGTERM (a kill of a sweep: its runs stay resumable) before it ends."""
    import signal

    from harness.apps import throughput

    signalled, started = [], []

    class Sweep:
        pid, waits = 4242, 0

        def __init__(self, args, **kwargs):
            started.append(kwargs)

        def wait(self):
            self.waits += 1
            if self.waits == 1:
                raise KeyboardInterrupt
            return -15

    monkeypatch.setattr(throughput.subprocess, "Popen", Sweep)
    monkeypatch.setattr(throughput.os, "killpg", lambda pid, sig: signalled.append((pid, sig)))
    with pytest.raises(KeyboardInterrupt):
        throughput.harness(["sweep", "quickstart"])
    assert started[0]["start_new_session"] and signalled == [(4242, signal.SIGTERM)]


def test_the_throughput_bench_compares_runs_without_their_timings(tmp_path):
    from harness.apps.throughput import same_runs

    def write(folder: Path, rid: str, loss: float, step_s: float, answer: str = "1") -> None:
        (folder / rid).mkdir(parents=True)
        (folder / rid / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": loss, "step_s": step_s}) + "\n")
        (folder / rid / "eval_samples.jsonl").write_text(json.dumps({"step": 1, "completion": answer}) + "\n")

    first, second = tmp_path / "a", tmp_path / "b"
    for folder, step_s in ((first, 1.0), (second, 2.5)):  # the timings differ: the same run
        write(folder, "same", 0.5, step_s)
    write(first, "metric", 0.5, 1.0)
    write(second, "metric", 0.5000001, 1.0)
    write(first, "sample", 0.5, 1.0)
    write(second, "sample", 0.5, 1.0, answer="2")
    write(first, "absent", 0.5, 1.0)  # never written on the second side
    (second / "absent").mkdir()
    assert same_runs(first, second, ["same", "metric", "sample", "absent"]) == ["metric", "sample", "absent"]


@pytest.mark.slow  # a one-run sweep in a worktree, in processes of its own (seconds): make test
def test_the_throughput_bench_against_a_commit_runs_its_sweep_there_and_removes_the_worktree(tmp_path):
    """``--against HEAD``: the sweep runs in a worktree of the last commit, a process per run; the side names that
    commit, its CPU time and exit, and the worktree is gone after."""
    from harness.apps.throughput import checkout, passes_of

    def worktrees() -> str:
        return subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout

    before = worktrees()
    overrides = ["sweep.grid.objective.name=[grpo]", "sweep.grid.seed=[0]", "train.steps=1", "task.eval_size=8",
                 "model.warm_start_steps=0", "model.warm_start_target=null"]
    with checkout("HEAD", tmp_path, overrides) as (worktree, commit, prepared):
        (side,) = passes_of([(f"{commit}, a process per run", worktree, 1, "rev")], 1, tmp_path, overrides, 1, 1)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert commit == head.strip() and side["side"] == f"{head.strip()}, a process per run" and prepared == 0
    assert side["exit"] == 0 and side["runs_per_process"] == 1 and side["cpu_s"] > 0
    assert len(list((tmp_path / "rev_0" / "quickstart").glob("grpo-s0-*/summary.json"))) == 1
    assert worktrees() == before


def test_the_throughput_benchs_passes_alternate_their_order_and_sum_each_sides_times(tmp_path, monkeypatch):
    """``--passes 3``: REV's side, a process per run, workers; then the reverse; then the first order again, each
    into fresh folders; a side's CPU and wall times are summed over its passes, its runs per CPU-hour over all of
    them, and a side that failed in any pass has failed, with that pass's status (a kill's is negative). A drift of
    the machine's speed in time then falls on every side alike, rather than on the side measured last."""
    from harness.apps import throughput

    calls, cpu = [], {"rev": 30.0, "1": 20.0, "0": 10.0}

    def measured(label, root, per_process, folder, overrides, jobs, runs):
        calls.append(folder.name)
        key = folder.name.split("_")[0]
        exit_code = -9 if folder.name == "0_1" else 0  # killed in its second pass
        return {"side": label, "runs_per_process": per_process, "exit": exit_code, "cpu_s": cpu[key] + len(calls),
                "wall_s": 1.0}

    monkeypatch.setattr(throughput, "measured", measured)
    sides = [("REV, a process per run", tmp_path, 1, "rev"), ("a process per run", tmp_path, 1, "1"),
             ("workers", tmp_path, 0, "0")]
    summed = throughput.passes_of(sides, 3, tmp_path, [], 2, 12)
    assert calls == ["rev_0", "1_0", "0_0", "0_1", "1_1", "rev_1", "rev_2", "1_2", "0_2"]
    rev, process, workers = summed
    assert rev["cpu_s"] == 3 * 30.0 + 1 + 6 + 7 and process["cpu_s"] == 3 * 20.0 + 2 + 5 + 8
    assert workers["cpu_s"] == 3 * 10.0 + 3 + 4 + 9 and workers["wall_s"] == 3.0 and workers["passes"] == 3
    assert workers["runs_per_cpu_hour"] == round(3 * 12 * 3600 / workers["cpu_s"], 1)
    assert (rev["exit"], process["exit"], workers["exit"]) == (0, 0, -9)


def test_the_throughput_bench_against_a_name_that_is_no_commit_is_one_config_error_before_anything_runs(capsys):
    assert main(["bench", "--sweep-throughput", "--against", "no-such-commit-0000"]) == 2
    err = capsys.readouterr().err
    assert "--against no-such-commit-0000: not a commit of this checkout" in err and "sweep throughput" not in err


@contextlib.contextmanager
def answers_in(path: Path):
    """This process's stdout (file descriptor 1, where a worker answers) into ``path`` inside the block."""
    saved = os.dup(1)
    out = os.open(path, os.O_WRONLY | os.O_CREAT)
    os.dup2(out, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(out)
        os.close(saved)


def test_a_request_that_is_not_the_sweeps_protocol_is_one_line_and_the_worker_goes_on(tmp_path, capsys):
    """`python -m harness worker` (listed in --help) raised a traceback on a line that is not JSON, a JSON list, a
    request without its log, or a log in a folder that does not exist; each is now one line and status 2, and the
    next request still runs."""
    import io

    from harness.apps.worker import serve

    ran = []
    good = json.dumps({"log": str(tmp_path / "run.log"), "args": ["list"]})
    lines = ["not json\n", "[1, 2]\n", json.dumps({"args": []}) + "\n",
             json.dumps({"log": str(tmp_path / "no" / "run.log"), "args": []}) + "\n", good + "\n"]
    with answers_in(tmp_path / "answers"):
        assert serve(io.StringIO("".join(lines)), lambda args: ran.append(args) or 0) == 0
    assert (tmp_path / "answers").read_text().split() == ["2", "2", "2", "2", "0"] and ran == [["list"]]
    err = capsys.readouterr().err
    assert err.count("error: a worker request is one JSON object per line") == 4


def test_stopping_a_worker_that_lost_its_sigterm_kills_it_and_does_not_hang(monkeypatch):
    """Ctrl-C reaches a sweep's process group, its workers' runs too: a worker whose run returned 130 went back to
    reading requests, the sweep's SIGTERM to it could be lost (raised in a finalizer), and WorkerHandle.stop waited
    for ever (the twenty-third hostile pass). It closes the worker's requests (an idle worker ends at their end),
    sends SIGTERM and, after the grace, SIGKILL. The stand-in ignores SIGTERM and its closed stdin, so only the
    SIGKILL ends it, whatever the grace; the test's wait bounds a hang, not a duration."""
    import threading

    from harness.apps import launchers

    monkeypatch.setattr(launchers, "STOP_GRACE_S", 0.1)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdout.readline()  # its SIGTERM handler is set
    worker = launchers.Worker.__new__(launchers.Worker)
    worker.proc, worker.busy = proc, True
    stopping = threading.Thread(target=launchers.WorkerHandle(worker).stop, daemon=True)
    try:
        stopping.start()
        stopping.join(timeout=120)
        assert not stopping.is_alive() and proc.returncode == -signal.SIGKILL and not worker.busy
    finally:
        proc.kill()
        proc.wait()
