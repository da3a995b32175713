"""Torch's CPU threads (harness/run/threads.py): set in one place; a run without its own setting
takes the cores free when it starts, with a one-line note when that is fewer than the cores, and keeps that count
when it resumes (so that the resume reproduces the uninterrupted run)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from harness.loop.native import train
from harness.run import threads
from tests.helpers.interrupt import stopped_before
from tests.helpers.tiny import tiny_run, without_timing

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def machine(monkeypatch):
    """A machine of 4 cores with ``state["busy"]`` of them busy; torch's thread count restored afterwards."""
    state = {"busy": 0.0}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores", lambda: 4)
    monkeypatch.setattr(threads, "busy_cores", lambda window_s=0.3: state["busy"])
    monkeypatch.setattr(threads, "_PREFERRED", 0)
    before = torch.get_num_threads()
    yield state
    torch.set_num_threads(before)


def test_a_run_without_a_thread_setting_takes_the_free_cores_and_says_so_when_they_are_fewer(machine, capsys):
    assert threads.run_threads(0) == 4 and torch.get_num_threads() == 4 and capsys.readouterr().err == ""
    machine["busy"] = 1.2  # one other busy process and a bit
    assert threads.run_threads(0) == 3 and torch.get_num_threads() == 3
    assert capsys.readouterr().err == "note: 1.2 of 4 cores are busy with other processes: 3 torch threads " \
        "(threads=N sets it)\n"
    machine["busy"] = 7.0
    assert threads.run_threads(0) == 1  # never fewer than one


def test_an_explicit_count_wins_then_the_runs_own_then_the_processes_then_omp_num_threads(machine, monkeypatch,
                                                                                          capsys):
    machine["busy"] = 3.0
    assert threads.run_threads(2) == 2  # the run's threads setting
    assert threads.run_threads(0, previous=4) == 4  # a resume keeps the count it started with
    assert "keeps its 4 torch threads" in capsys.readouterr().err
    threads.prefer(2)  # --threads of a sweep's child
    assert threads.run_threads(0) == 2 and threads.run_threads(0, previous=3) == 3
    threads.prefer(0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    assert threads.run_threads(0) == 1 and "busy" not in capsys.readouterr().err


@pytest.mark.slow  # a whole run (or several): make test
def test_a_resumed_run_keeps_the_thread_count_it_started_with(machine, tmp_path, capsys):
    run = tiny_run(tmp_path, "threads=0", "train.steps=3")
    with stopped_before(2):
        train(run, tmp_path / "run", progress=False)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["threads"] == 4
    machine["busy"] = 3.0  # busier now: a fresh run would take 1 thread
    summary = train(run, tmp_path / "run", progress=False)
    assert summary["threads"] == 4 and torch.get_num_threads() == 4
    assert "it keeps its 4 torch threads" in capsys.readouterr().err
    assert train(run, tmp_path / "fresh", progress=False)["threads"] == 1


def test_torch_threads_are_set_in_one_place():
    calls = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "harness").rglob("*.py"))
             if re.search(r"\bset_num_threads\(", path.read_text())]
    assert calls == ["harness/run/threads.py"]


@pytest.mark.slow
def test_bench_step_prints_one_steps_seconds_and_threads(capsys, machine):
    from harness.apps.bench import step_main

    assert step_main(["model.name=tiny", "task.name=arith", "train.max_new_tokens=8", "train.prompts_per_step=2",
                      "train.group_size=2", "train.num_minibatches=1", "threads=1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["threads"] == 1 and result["step_s"] > result["rollout_s"] > 0


@pytest.mark.slow  # two whole runs: make test
def test_the_tiny_runs_metrics_do_not_depend_on_the_thread_count(tmp_path):
    """threads=0 picks the free cores, so a fresh run's count depends on the machine's load; on the tiny model that
    must not change a result: 1 and 2 threads give the same metrics bit for bit (if a torch upgrade breaks this,
    the default must become a fixed count)."""
    rows = {}
    for n in (1, 2):
        train(tiny_run(tmp_path, f"threads={n}", "train.steps=2"), tmp_path / f"t{n}", progress=False)
        lines = (tmp_path / f"t{n}" / "metrics.jsonl").read_text().splitlines()
        rows[n] = without_timing([{k: v for k, v in json.loads(line).items() if k != "threads"} for line in lines])
    assert rows[1] == rows[2] and len(rows[1]) == 3


@pytest.mark.slow
def test_more_threads_than_cores_are_refused_before_the_run_folder_exists(machine, tmp_path, capsys):
    """threads=N or --threads N above the cores this process may use: one line and status 2 before anything is
    written (torch would start N OpenMP threads: a huge N ended the run in a traceback or a segfault after its
    folder was made); the cores themselves are taken."""
    from harness.apps.cli import main
    from harness.apps.sweep import run_sweep
    from harness.run.config import load_experiment
    from harness.run.errors import ConfigError

    threads.check_count(4, "threads")
    for args in (["threads=5"], ["--threads", "100000"]):
        assert main(["train", "quickstart", f"results_dir={tmp_path}", *args]) == 2
        err = capsys.readouterr().err
        key = args[0].split("=")[0] if "=" in args[0] else args[0]
        assert err.startswith(f"config error: {key}=") and "is more than the 4 cores this process may run on: give " \
            "at most 4 (0: the cores free when the run starts" in err and err.count("\n") == 1, err
    with pytest.raises(ConfigError, match=r"^threads=8 is more than the 4 cores"):
        run_sweep(load_experiment("quickstart", [f"results_dir={tmp_path}", "threads=8"]), progress=False)
    for args in (["threads=6"], ["--threads", "7"]):  # the gradient lab likewise
        assert main(["lab", "lab", f"results_dir={tmp_path}", *args]) == 2
        assert "is more than the 4 cores this process may run on" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
