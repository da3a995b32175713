"""Nothing written twice, nothing lost without a word, every failure one line (issue: reliability gaps)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.loop.native import train
from harness.run.config import load_experiment, run_configs
from harness.run.errors import ConfigError
from harness.run.locks import FolderBusyError
from harness.run.records import RunRecords, read_jsonl
from tests.interrupt import stopped_before
from tests.tiny import TINY_RUN, tiny_run, without_timing

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True, **kw)


def test_an_interruption_after_the_step0_evaluation_writes_step0_once(tmp_path, monkeypatch):
    run = tiny_run(tmp_path, "train.eval_every=1")
    train(run, tmp_path / "full", progress=False)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:  # Ctrl-C right after the step-0 line, before the first checkpoint
        patch.setattr("harness.loop.native.collect_batch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train(run, tmp_path / "part", progress=False)
    assert [r["step"] for r in read_jsonl(tmp_path / "part" / "metrics.jsonl")] == [0]
    assert json.loads((tmp_path / "part" / "summary.json").read_text())["status"] == "interrupted"
    train(run, tmp_path / "part", progress=False)
    part, full = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("part", "full"))
    assert [r["step"] for r in part] == [0, 1, 2] and without_timing(part) == without_timing(full)
    samples = [r["step"] for r in read_jsonl(tmp_path / "part" / "eval_samples.jsonl")]
    assert samples == [0] * 8 + [1] * 8 + [2] * 8


def test_a_garbage_line_inside_the_metrics_is_reported_and_listed_as_missing(tmp_path, capsys):
    run = tiny_run(tmp_path, "train.steps=3")
    with stopped_before(3):
        train(run, tmp_path / "run", progress=False)
    path = tmp_path / "run" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = "{garbage"
    path.write_text("\n".join(lines) + "\n")
    summary = train(run, tmp_path / "run", progress=False)
    assert f"{path}, line 2 is not valid JSON" in capsys.readouterr().err
    assert summary["status"] == "finished" and summary["missing_steps"] == [1]
    assert [r["step"] for r in read_jsonl(path)] == [0, 2, 3]


def test_a_corrupted_checkpoint_falls_back_to_the_previous_one_or_says_what_to_do(tmp_path):
    run = tiny_run(tmp_path, "train.steps=3")
    train(run, tmp_path / "full", progress=False)
    with stopped_before(3):
        train(run, tmp_path / "part", progress=False)
    folder = tmp_path / "part" / "checkpoints"
    assert (folder / "previous.pt").exists()  # step 1's, kept while step 2's was written
    (folder / "last.pt").write_bytes(b"torn")
    train(run, tmp_path / "part", progress=False)  # resumes from step 1: steps 2 and 3 again, nothing twice
    part, full = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("part", "full"))
    assert without_timing(part) == without_timing(full)
    for name in ("last.pt", "previous.pt"):
        (folder / name).write_bytes(b"torn")
    with pytest.raises(RuntimeError, match=r"unreadable checkpoint .*last\.pt.*delete .*checkpoints to restart"):
        train(run, tmp_path / "part", progress=False)


def test_two_processes_cannot_write_one_run_folder(tmp_path):
    run = tiny_run(tmp_path)
    holder = RunRecords(run, tmp_path / "run", None, None, "native")
    with pytest.raises(FolderBusyError, match="is being written by another process"):
        train(run, tmp_path / "run", progress=False)
    holder.lock.close()
    assert train(run, tmp_path / "run", progress=False)["status"] == "finished"


@pytest.mark.parametrize("override, message", [
    ("train.lr=-1", "train.lr must be >= 0"),
    ("task.eval_size=0", "eval_size must be an integer >= 1"),
    ("task.args.digit=3", "has no argument digit"),
    ("model.tiny.hidden=8", "model.tiny has no field hidden"),
    ("model.tiny.num_heads=3", "a multiple of num_heads"),
    ("train.group_size=1", "makes every advantage 0"),
    ("model.warm_start_target=[0.5,0.2]", "warm_start_target must be"),
    ("train.rollout_correction.mode=token_clip", "train.rollout_correction.mode must be one of none, "),
    ("train.rollout_correction.threshold=0.5", "train.rollout_correction.threshold must be a finite number >= 1"),
    ("train.decoder=flash", "train.decoder must be one of auto, shared_prefix, per_row, cache"),
    ("train.compile_sampler=true train.decoder=shared_prefix", "compiles the native sampler's per-row or cache"),
])
def test_settings_that_would_fail_or_train_nothing_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        run_configs(load_experiment("quickstart", override.split()))


def test_replacing_the_task_replaces_its_arguments():
    (run,) = run_configs(load_experiment("quickstart", ["task.name=gsm8k", "seed=0", "objective.name=grpo"]))
    assert run.task.args == {}
    (run,) = run_configs(load_experiment("quickstart", ["task.args={}", "seed=0", "objective.name=grpo"]))
    assert run.task.args == {}
    # another task with arguments of its own: those, not the experiment's (arith's digits, ...) as well
    (run,) = run_configs(load_experiment("quickstart", ["task.name=reasoning_gym", "task.args.dataset=chain_sum",
                                                        "seed=0", "objective.name=grpo"]))
    assert run.task.args == {"dataset": "chain_sum"}
    (run,) = run_configs(load_experiment("quickstart", ["task.name=arith", "task.args.digits=3", "seed=0",
                                                        "objective.name=grpo"]))  # the same task: merged
    assert run.task.args == {"num_operands": 2, "digits": 3, "operators": "+-"}


def test_a_misspelt_generator_of_another_task_is_named_not_the_experiments_arguments():
    with pytest.raises(ConfigError) as error:
        run_configs(load_experiment("quickstart", ["task.name=reasoning_gym", "task.args.dataset=chain_summ"]))
    assert "Did you mean 'chain_sum'" in str(error.value) and "digits" not in str(error.value)
    with pytest.raises(ConfigError) as error:  # the task's arguments with their defaults, a factory's too
        run_configs(load_experiment("quickstart", ["task.name=reasoning_gym", "task.args.digit=3"]))
    assert "params={}" in str(error.value) and "MISSING" not in str(error.value)
    assert not str(error.value).startswith("task 'reasoning_gym': task")  # the task named once


def test_a_warm_start_band_without_steps_names_both_settings_of_no_warm_start():
    with pytest.raises(ConfigError, match=r"model.warm_start_steps=0 model.warm_start_target=null$"):
        run_configs(load_experiment("quickstart", ["model.warm_start_steps=0"]))


@pytest.mark.slow
def test_cli_errors_are_one_line_with_exit_code_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1,\n")
    for args, message in [((str(bad),), "not valid YAML at line 3"), (("quickstart", "train.lr=-1"), "train.lr")]:
        out = cli("train", *args)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    for jobs in ("0", "-1"):
        out = cli("sweep", "quickstart", "--jobs", jobs)
        assert out.returncode == 2 and "--jobs: must be an integer >= 1" in out.stderr



@pytest.mark.parametrize("installed", ["5.23.0", "6.0.0"])
def test_a_transformers_outside_the_requirement_is_refused_in_one_line_before_anything_starts(
        installed, monkeypatch, capsys, tmp_path):
    import importlib.metadata

    from harness.apps.cli import main, unmet_requirement

    assert unmet_requirement() is None  # the environment the suite runs in meets pyproject's requirements
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: installed if name == "transformers" else version(name))
    assert main(["train", "quickstart", f"results_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: transformers {installed} is installed, the harness needs transformers<6,>=5.24: "
                   "run `make setup` (or `pip install -e .`) again\n")
    assert not any(tmp_path.iterdir())  # nothing started

@pytest.mark.slow
def test_ctrl_c_prints_how_to_resume(tmp_path):
    # a suite started in the background by a non-interactive shell inherits SIGINT ignored: give the run Ctrl-C back
    proc = subprocess.Popen([sys.executable, "-m", "harness", "train", "base", *TINY_RUN, "train.steps=500",
                             "--run-dir", str(tmp_path / "run"), "--no-progress"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) < 2:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted: run the same command again to resume" in err, (proc.returncode, err)
    assert "Traceback" not in err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_soak_kills_and_resumes_without_loss():
    out = cli("soak", "--kills", "3", "--seed", "1", timeout=600)
    assert out.returncode == 0 and "soak: PASS: 3 kills" in out.stdout, out.stdout + out.stderr


def test_the_cli_stops_on_sigint_even_when_started_with_sigint_ignored():
    """A shell's background job starts with SIGINT ignored; the CLI installs Python's handler itself, so Ctrl-C /
    kill -INT still stops it (the soak's SIGINT kills and users' `kill -INT` of a background sweep rely on it)."""
    from harness.apps.cli import main

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["list"]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
