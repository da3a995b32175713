"""The edges a hostile user finds: resuming a run folder with other settings, a full disk, killed runs
shown as running. Each refuses in one line before anything starts, or recovers exactly and says so."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from harness.apps.cli import main
from harness.loop.native import train
from harness.policy import models
from harness.run.config import load_experiment, run_configs, run_id
from harness.run.errors import ConfigError
from harness.run.locks import RUN_LOCK, lock_folder
from harness.run.records import check_resume, read_jsonl, run_status, say_memory_changes
from objectives import get_objective
from objectives.popo import PredictorMLP
from tests.helpers.disk import fill_disk_at, temporaries
from tests.helpers.interrupt import stopped_before
from tests.helpers.tiny import TINY_RUN, VARIED_REWARD, tiny_run, without_timing
from tests.helpers.tiny_moe import tiny_moe_run

ROOT = Path(__file__).resolve().parent.parent


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(("error", "config error"))]


# ------------------------------------------------------------------------------ 2. one run folder, one run


@pytest.fixture
def stopped_run(tmp_path):
    """A grpo run killed after step 1 of 3 (its checkpoint, rows 0 and 1; summary.json says running)."""
    run = tiny_run(tmp_path, VARIED_REWARD, "train.steps=3")
    with stopped_before(2):
        train(run, tmp_path / "run", progress=False)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    summary["status"] = "running"  # as a SIGKILL leaves it (the interruption above could still write it)
    (tmp_path / "run" / "summary.json").write_text(json.dumps(summary))
    return run, tmp_path / "run"


@pytest.mark.parametrize("override, shown", [
    ("objective.name=gspo", "objective.name grpo -> gspo"), ("train.lr=0.01", "train.lr 0.001 -> 0.01"),
    ("objective.params.clip_low=0.3", "objective.params.clip_low 0.2 -> 0.3")])  # an unset one: its default
@pytest.mark.slow
def test_resuming_with_other_settings_is_refused_in_one_line_and_touches_nothing(stopped_run, override, shown,
                                                                                   capsys):
    run, run_dir = stopped_run
    before = snapshot(run_dir)
    code = main(["train", "base", *TINY_RUN, VARIED_REWARD, "train.steps=3", override, "--run-dir", str(run_dir),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("config error: "), err
    assert shown in err and "mix two runs" in err and f"train {run_dir / 'config.yaml'} --run-dir {run_dir}" in err
    assert snapshot(run_dir) == before  # summary.json, config.yaml, metrics, checkpoints: untouched
    assert run_status(run_dir) == "stopped"  # and it does not claim to be running
    with pytest.raises(ConfigError, match="other settings"):  # the Python entry points refuse as well
        train(OmegaConf.merge(run, OmegaConf.from_dotlist([override])), run_dir, progress=False)
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_the_trl_backend_refuses_another_runs_folder_before_touching_it(stopped_run):
    from harness.loop.trl_backend import train_trl

    run, run_dir = stopped_run
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match="backend native -> trl"):
        # (without the overlong penalty, which TRL's backend refuses first)
        train_trl(OmegaConf.merge(run, {"backend": "trl", "task": {"overlong_buffer": 0}}), run_dir, progress=False)
    assert snapshot(run_dir) == before


@pytest.mark.slow  # a whole run (or several): make test
def test_the_same_settings_resume_and_say_from_which_step(stopped_run, tmp_path, capsys):
    run, run_dir = stopped_run
    elsewhere = OmegaConf.merge(run, {"results_dir": str(tmp_path / "other"), "logging": {"project": "p"}})
    summary = train(elsewhere, run_dir, progress=False)  # results_dir and logging do not change a run
    assert f"resuming {run_dir.name} from step 1 (checkpoint {run_dir / 'checkpoints' / 'last.pt'})" in \
        capsys.readouterr().err
    train(run, tmp_path / "full", progress=False)
    assert summary["status"] == "finished"
    assert without_timing(read_jsonl(run_dir / "metrics.jsonl")) == \
        without_timing(read_jsonl(tmp_path / "full" / "metrics.jsonl"))


MEMORY = {"lm_head_chunk": 5, "activation_checkpointing": True, "eval_batch_size": 3}


def test_resuming_with_other_memory_settings_is_said_in_one_line_and_other_settings_still_refused(tmp_path, capsys):
    """A run that ran out of memory continues with the memory settings turned on (harness/run/config.py
    MEMORY_SETTINGS: they change no number beyond round-off); with pass@k train.eval_batch_size decides the samples
    and train.micro_batch_size the logged metrics: both still refused."""
    run = tiny_run(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(OmegaConf.to_yaml(run))
    changes = check_resume(OmegaConf.merge(run, {"train": MEMORY}), tmp_path / "run")
    assert capsys.readouterr().err == ""  # said by the command once its own checks pass (the code's version)
    say_memory_changes(tmp_path / "run", changes)
    assert capsys.readouterr().err == (
        "continuing run with other memory settings: train.lm_head_chunk 0 -> 5, train.activation_checkpointing False"
        " -> True, train.eval_batch_size 64 -> 3 (they change no number beyond float round-off; config.yaml records"
        " the new ones)\n")
    with pytest.raises(ConfigError, match=r"other settings \(train.micro_batch_size 0 -> 8\)"):
        check_resume(OmegaConf.merge(run, {"train": {**MEMORY, "micro_batch_size": 8}}), tmp_path / "run")
    sampled = OmegaConf.merge(run, {"train": {"pass_k": 2}})
    (tmp_path / "run" / "config.yaml").write_text(OmegaConf.to_yaml(sampled))
    with pytest.raises(ConfigError, match=r"other settings \(train.eval_batch_size 64 -> 3\)"):
        check_resume(OmegaConf.merge(sampled, {"train": MEMORY}), tmp_path / "run")


def assert_equal_but_round_off(rows: list[dict], expected: list[dict]) -> None:
    """Equal rows, but for floats computed from log-probs, which may differ by float32 round-off (1e-6 absolute, 1e-4
    relative); what was sampled and counted (rewards, advantages, accuracies, lengths, tokens) exactly."""
    assert [sorted(r) for r in rows] == [sorted(r) for r in expected]
    sampled = ("reward", "accuracy", "completion_len", "frac_truncated", "frac_zero_std", "adv_", "tokens", "lr")
    for row, want in zip(rows, expected, strict=True):
        for key, value in want.items():
            if isinstance(value, float) and not key.startswith(sampled) and not key.endswith(sampled):
                assert row[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (row["step"], key)
            else:
                assert row[key] == value, (row["step"], key)


@pytest.mark.slow  # three runs: make test
@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_a_run_resumed_with_other_memory_settings_equals_the_uninterrupted_run(tmp_path, capsys, model):
    """Killed after step 1 of 3, continued with the LM head in chunks, activation checkpointing (the MoE with R2
    replay: a checkpointed forward runs whole rows, not the shared-prompt pass) and 3 eval problems per call, as the
    sweep's processes run (its config.yaml plus overrides): the same run id, one line naming the changes, and the
    uninterrupted run's metrics up to float32 round-off (measured: 4e-7 at most; the chunked LM head sums its
    matmuls in other shapes) with the same samples, rewards and accuracies."""
    settings = ["train.steps=3", "train.eval_every=1", "task.overlong_buffer=6"]  # rewards that differ within groups
    run = tiny_run(tmp_path, *settings) if model == "tiny" else \
        tiny_moe_run(tmp_path, *settings, "train.routing_replay=r2", "train.old_logp=recompute")
    train(run, tmp_path / "full", progress=False)
    with stopped_before(2):
        train(run, tmp_path / "part", progress=False)
    capsys.readouterr()
    overrides = [f"train.{key}={str(value).lower()}" for key, value in MEMORY.items()]
    assert run_id(OmegaConf.merge(run, OmegaConf.from_dotlist(overrides))) == run_id(run)
    assert main(["train", str(tmp_path / "part" / "config.yaml"), *overrides, "--run-dir", str(tmp_path / "part"),
                 "--no-progress"]) == 0
    assert "continuing part with other memory settings: train.lm_head_chunk 0 -> 5, " in capsys.readouterr().err
    assert OmegaConf.load(tmp_path / "part" / "config.yaml").train.activation_checkpointing is True
    full, part = (without_timing(read_jsonl(tmp_path / name / "metrics.jsonl")) for name in ("full", "part"))
    assert [r["step"] for r in part] == [0, 1, 2, 3] and part[:2] == full[:2]
    assert_equal_but_round_off(part, full)


@pytest.mark.slow  # a run resumed: make test
@pytest.mark.parametrize("damaged", [b'{"status": "run\xffning"}', b"[]", b"{garbage"])
def test_a_damaged_summary_does_not_block_a_resume(stopped_run, damaged):
    """summary.json not UTF-8, not an object or not JSON (the earlier attempt's times then start from 0): the run
    resumes from its checkpoint and finishes, as it does when the summary is missing."""
    run, run_dir = stopped_run
    (run_dir / "summary.json").write_bytes(damaged)
    summary = train(run, run_dir, progress=False)
    assert summary["status"] == "finished"
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.slow  # a run resumed: make test
def test_a_setting_added_to_the_schema_since_does_not_block_a_resume(stopped_run):
    run, run_dir = stopped_run
    saved = OmegaConf.load(run_dir / "config.yaml")
    del saved.train["pass_k"]  # a run from before train.pass_k existed
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    summary = json.loads((run_dir / "summary.json").read_text())
    del summary["settings_digest"]  # its code recorded none (with one, the deletion here reads as an edit: refused)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert train(run, run_dir, progress=False)["status"] == "finished"


# ------------------------------------------------------------------------------ 5. killed runs are stopped


def test_a_run_whose_summary_says_running_is_stopped_unless_a_process_holds_its_lock(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert run_status(run_dir) == "pending"
    (run_dir / "summary.json").write_text(json.dumps({"status": "running"}))
    assert run_status(run_dir) == "stopped"
    lock = lock_folder(run_dir / RUN_LOCK, "busy")
    try:
        assert run_status(run_dir) == "running"
    finally:
        lock.close()
    (run_dir / "summary.json").write_text(json.dumps({"status": "finished"}))
    assert run_status(run_dir) == "finished"


def test_the_sweep_manifest_shows_a_killed_run_as_stopped(tmp_path, monkeypatch):
    from harness.apps import launchers, sweep
    from harness.run.config import load_experiment, run_configs, run_id

    # a process per run: the stand-in below is that process (a worker's run killed: tests/test_worker.py)
    cfg = load_experiment("base", [*TINY_RUN, f"results_dir={tmp_path}", "name=exp", "launcher.runs_per_process=1"])
    (run,) = run_configs(cfg)
    run_dir = tmp_path / "exp" / run_id(run)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(run))
    (run_dir / "summary.json").write_text(json.dumps({"status": "running"}))  # SIGKILLed
    seen = []

    class Child:  # the run's process: records the manifest it starts with, then exits killed
        returncode = -9

        def __init__(self, *args, **kwargs):
            seen.append(json.loads((tmp_path / "exp" / "manifest.json").read_text())["runs"][0]["status"])

        def poll(self):
            return self.returncode

    monkeypatch.setattr(launchers.subprocess, "Popen", Child)
    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    entries = sweep.run_sweep(cfg, progress=False)
    assert seen == ["stopped"] and entries[0]["status"] == "stopped"
    assert json.loads((tmp_path / "exp" / "manifest.json").read_text())["runs"][0]["status"] == "stopped"


@pytest.mark.slow
def test_a_sigkilled_run_is_stopped_and_a_refused_resume_leaves_it_so(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train", "base", *TINY_RUN, "train.steps=500", "--run-dir", str(run_dir), "--no-progress"]
    proc = subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=ROOT, stderr=subprocess.DEVNULL)
    while len(read_jsonl(run_dir / "metrics.jsonl")) < 2:
        assert proc.poll() is None
        time.sleep(0.05)
    assert run_status(run_dir) == "running"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "running"
    assert run_status(run_dir) == "stopped"
    before = snapshot(run_dir)
    assert main([*args, "objective.name=gspo"]) == 2  # the refused resume: the CLI's code in this process
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "objective.name grpo -> gspo" in err
    assert snapshot(run_dir) == before and run_status(run_dir) == "stopped"


# ------------------------------------------------------------------------------ 3. full disk


@pytest.fixture
def reference(tmp_path):
    run = tiny_run(tmp_path, VARIED_REWARD, "train.steps=3")
    train(run, tmp_path / "reference", progress=False)
    return without_timing(read_jsonl(tmp_path / "reference" / "metrics.jsonl"))


@pytest.mark.parametrize("name, after, code", [
    ("last.pt.tmp", 1, errno.ENOSPC),  # the second checkpoint (step 2)
    pytest.param("metrics.jsonl", 2, errno.ENOSPC, marks=pytest.mark.slow),  # step 2's row (after 0's and 1's)
    pytest.param("summary.json.tmp", 3, errno.EDQUOT, marks=pytest.mark.slow),  # a quota, at step 1's summary
    pytest.param("config.yaml.tmp", 0, errno.ENOSPC, marks=pytest.mark.slow),  # before the first step
])
@pytest.mark.slow  # a run cut short, then resumed: make test
def test_a_full_disk_is_one_line_leaves_no_temporary_and_resumes_exactly(tmp_path, monkeypatch, capsys, reference,
                                                                          name, after, code):
    run_dir = tmp_path / "run"
    args = ["train", "base", *TINY_RUN, VARIED_REWARD, "train.steps=3", "--run-dir", str(run_dir), "--no-progress"]
    with monkeypatch.context() as patch:
        calls = fill_disk_at(patch, name, after, code)
        assert main(args) == 1
    assert len(calls) > after  # the failure happened where intended
    err = capsys.readouterr().err
    assert "Traceback" not in err and "During handling" not in err
    (line,) = error_lines(err)
    assert line.startswith("error: disk full: could not write " if code == errno.ENOSPC else
                           "error: disk quota exceeded: could not write ")
    assert name.removesuffix(".tmp") in line and "free there" in line and "run the same command again" in line
    assert temporaries(run_dir) == [] and not (run_dir / "traceback.txt").exists()
    assert run_status(run_dir) in ("stopped", "failed", "pending")  # never "running": no process holds it
    assert main(args) == 0  # space freed: the same command resumes
    assert without_timing(read_jsonl(run_dir / "metrics.jsonl")) == reference
    assert temporaries(run_dir) == []


@pytest.mark.slow  # a run resumed: make test
def test_stale_temporaries_are_swept_away_when_a_run_resumes(stopped_run):
    run, run_dir = stopped_run
    for stale in (run_dir / "summary.json.tmp", run_dir / "checkpoints" / "last.pt.tmp"):
        stale.write_bytes(b"torn")
    (run_dir / "exports" / "step_1.tmp").mkdir(parents=True)
    train(run, run_dir, progress=False)
    assert temporaries(run_dir) == []


def test_the_sweep_manifest_on_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    with monkeypatch.context() as patch:
        fill_disk_at(patch, "manifest.json.tmp")
        code = main(["sweep", "base", *TINY_RUN, f"results_dir={tmp_path}", "name=exp", "--no-progress",
                     "--no-report"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    (line,) = error_lines(err)
    assert line.startswith("error: disk full: could not write ") and "manifest.json" in line
    assert temporaries(tmp_path / "exp") == []


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MB tmpfs (needs root and mount); skipped where it cannot be mounted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                                                       capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_real_full_disk_stops_the_run_in_one_line_and_it_resumes_exactly_once_space_is_freed(
        small_disk, tmp_path, reference, capsys):
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - 700 * 1024))  # room for two checkpoints only
    args = ["train", "base", *TINY_RUN, VARIED_REWARD, "train.steps=3", "--run-dir", str(small_disk / "run"),
            "--no-progress"]
    out = subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    (line,) = error_lines(out.stderr)
    assert line.startswith("error: disk full: could not write ") and "run the same command again" in line, line
    assert temporaries(small_disk) == []
    assert run_status(small_disk / "run") != "running"
    filler.unlink()
    # the resume and the sweep in this process (the CLI's code; the fresh interpreter above showed its whole stderr)
    assert main(args) == 0
    assert "resuming run from step" in capsys.readouterr().err
    assert without_timing(read_jsonl(small_disk / "run" / "metrics.jsonl")) == reference
    # a sweep whose manifest cannot be written: one line as well
    filler.write_bytes(b"\0" * shutil.disk_usage(small_disk).free)
    assert main(["sweep", "base", *TINY_RUN, f"results_dir={small_disk}", "name=exp", "--no-progress",
                 "--no-report"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = error_lines(err)
    assert "disk full: could not write" in line and temporaries(small_disk) == []


# ------------------------------------------------------------------------------ 6. experiment files


# ------------------------------------------------------------------------------ 7. refused before anything exists

QUICK = ["model.warm_start_steps=0", "model.warm_start_target=null", "train.steps=3", "task.eval_size=16",
         "train.prompts_per_step=4", "threads=1"]


@pytest.mark.parametrize("override, message", [
    ("device=mps", "device=mps, but torch has no MPS"),
    ("device=cuda:7", "device=cuda:7, but "),
    ("device=meta", "device=meta: the harness runs on cpu, cuda or mps"),
    ("threads=-1", "threads must be >= 0"),
    ("seed=-1", r"seed must be an integer in \[0, 2\*\*32\)"),
    ("model.seed=-1", r"model.seed must be an integer in \[0, 2\*\*32\)"),
    ("task.name=gsm8k task.data_dir=/nonexistent", "gsm8k: task.data_dir=/nonexistent does not exist; point it"),
    ("model.name=/nonexistent/model", r"neither a local folder \(there is none at that path\) nor a hub id"),
    (f"model.name={__file__}", r"neither a local folder \(a file is at that path, not a folder\) nor a hub id"),
])
def test_settings_this_machine_cannot_run_are_refused_before_any_folder_exists(tmp_path, capsys, override, message):
    assert main(["train", "quickstart", *QUICK, *override.split(), f"results_dir={tmp_path / 'results'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: ") and re.search(message, err), err
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("command", ["train", "prepare"])
@pytest.mark.parametrize("cache", ["file", "file/below"])
def test_a_cache_folder_that_cannot_be_made_is_refused_before_the_warm_start(tmp_path, capsys, monkeypatch, cache,
                                                                            command):
    """RLVR_CACHE at or under a file: refused in one line before any folder exists, not after the warm start has
    trained (NotADirectoryError when it was cached); also by `prepare <experiment>`, which a launcher runs on the
    node that builds a sweep's starting policies."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / cache))
    warm = ["model.warm_start_steps=5", "model.warm_start_target=null"]
    assert main([command, "quickstart", *QUICK, *warm, f"results_dir={tmp_path / 'results'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"config error: cannot use the cache folder {tmp_path / cache} ($RLVR_CACHE): "
                          f"{tmp_path / 'file'} is a file, not a folder; set RLVR_CACHE to a folder"), err
    assert not (tmp_path / "results").exists()


def test_a_relative_cache_folder_is_refused_before_anything_is_made(tmp_path, capsys, monkeypatch):
    """A relative RLVR_CACHE is found in each process's own working folder (a sweep's workers, a cluster's jobs):
    another cache per process, or one made inside the checkout."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLVR_CACHE", "relcache")
    warm = ["model.warm_start_steps=5", "model.warm_start_target=null"]
    assert main(["train", "quickstart", *QUICK, *warm, f"results_dir={tmp_path / 'results'}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"config error: RLVR_CACHE='relcache' is a relative path: each process (a sweep's runs, a "
                   f"cluster's jobs) would find it in its own working folder; give an absolute path, e.g. "
                   f"RLVR_CACHE={tmp_path / 'relcache'}\n")
    assert not any(tmp_path.iterdir())
    # RLVR_CACHE unset with HOME relative or empty: the message named RLVR_CACHE=None, or (empty) the cache was /.cache
    monkeypatch.delenv("RLVR_CACHE")
    for home, folder in (("relative/dir", "relative/dir/.cache/rlvr-harness"), ("", "/.cache/rlvr-harness")):
        monkeypatch.setenv("HOME", home)
        assert main(["train", "quickstart", *QUICK, *warm, f"results_dir={tmp_path / 'results'}"]) == 2
        assert capsys.readouterr().err == (f"config error: RLVR_CACHE is unset and HOME={home!r} is not an absolute "
                                           f"folder, so the cache folder (~/.cache/rlvr-harness) would be {folder}: "
                                           "set RLVR_CACHE to an absolute folder, or HOME\n")
    assert not any(tmp_path.iterdir())
    # a HOME that does not exist (mistyped): it was made, with the cache in it
    monkeypatch.setenv("HOME", str(tmp_path / "nohome"))
    assert main(["train", "quickstart", *QUICK, *warm, f"results_dir={tmp_path / 'results'}"]) == 2
    assert capsys.readouterr().err == (f"config error: RLVR_CACHE is unset and HOME={str(tmp_path / 'nohome')!r} is "
                                       "not a folder that exists, so the cache folder would be "
                                       f"{tmp_path / 'nohome/.cache/rlvr-harness'}: set HOME to your home folder, "
                                       "or RLVR_CACHE to a folder for the cache\n")
    assert not any(tmp_path.iterdir())
    (tmp_path / "file").write_text("")  # a HOME that is a file: "not a folder that exists" (it exists)
    monkeypatch.setenv("HOME", str(tmp_path / "file"))
    assert main(["train", "quickstart", *QUICK, *warm, f"results_dir={tmp_path / 'results'}"]) == 2
    assert f"HOME={str(tmp_path / 'file')!r} is a file, not a folder, so" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no folder can be made")
@pytest.mark.parametrize("command", [["train", "quickstart"], ["sweep", "quickstart"], ["prepare"]])
def test_a_cache_folder_that_cannot_be_made_is_refused_before_anything_is_made(tmp_path, capsys, monkeypatch,
                                                                              command):
    """RLVR_CACHE=/proc/x (or, for a user other than root, a folder under a read-only one): train had made its run
    folder and failed with a traceback at the warm start's cache, a sweep left every run pending after two
    tracebacks, prepare converted the embedded model first."""
    monkeypatch.setenv("RLVR_CACHE", "/proc/x")
    warm = ["model.warm_start_steps=5", "model.warm_start_target=null", f"results_dir={tmp_path / 'results'}"]
    assert main([*command, *(QUICK + warm if command != ["prepare"] else [])]) == 2
    assert capsys.readouterr().err == ("config error: cannot use the cache folder /proc/x ($RLVR_CACHE): it cannot be "
                                       "made (No such file or directory); set RLVR_CACHE to a folder, or unset it "
                                       "(~/.cache/rlvr-harness)\n")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command", [["train", "quickstart"], ["sweep", "quickstart"], ["prepare"]])
def test_a_cache_folder_that_cannot_be_written_is_refused_before_anything_when_it_lacks_what_the_run_builds(
        tmp_path, capsys, monkeypatch, command):
    """An existing RLVR_CACHE the user cannot write (read-only; root's permissions pass os.access, so the probe is a
    write, failed here as a read-only folder fails it): prepare dequantized the embedded model for seconds first, a
    sweep made its run folders, and the message said to choose a writable results_dir. A read-only cache that holds
    what the run needs still serves."""
    import tempfile

    from harness.policy.models import check_cache
    from harness.run.config import load_experiment as experiment

    cache = tmp_path / "cache"
    cache.mkdir()
    made = tempfile.mkdtemp

    def read_only(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == cache:
            raise PermissionError(1, "Operation not permitted", str(dir))
        return made(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    monkeypatch.setenv("RLVR_CACHE", str(cache))
    warm = ["model.warm_start_steps=5", "model.warm_start_target=null", f"results_dir={tmp_path / 'results'}"]
    assert main([*command, *(QUICK + warm if command != ["prepare"] else [])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"config error: cannot make cache folder {cache}: "), err
    assert err.endswith("make it writable, or set RLVR_CACHE to a folder you can write\n"), err
    assert not (tmp_path / "results").exists() and not any(cache.iterdir())
    (cache / "warm_start").mkdir()  # the starting policies' folder: the policy may be there (looked up when it runs)
    check_cache(experiment("quickstart", warm))
    from harness.apps.cli import failure_status  # a write that fails there later names the cache, not results_dir

    assert failure_status(PermissionError(1, "Operation not permitted", str(cache / "warm_start" / "x.json"))) == 2
    assert f"the cache folder {cache} is not writable: make it writable, or set RLVR_CACHE" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_a_results_folder_under_a_file_is_refused_in_one_line_before_anything_is_printed(tmp_path, capsys, command):
    """Refused before the run starts, not after its header with 'NotADirectoryError ... (no traceback file: ...)'
    (docs/hostile_pass.md, cases 13-14)."""
    (tmp_path / "file").write_text("")
    results = tmp_path / "file" / "results"
    assert main([command, "quickstart", *QUICK, "seed=0", "sweep.grid.objective.name=[grpo]",
                 f"results_dir={results}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: cannot make results folder "), err
    assert f"{tmp_path / 'file'} is a file, not a folder" in err and sorted(tmp_path.iterdir()) == [tmp_path / "file"]


def test_a_gsm8k_dir_that_is_not_there_is_refused_naming_the_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GSM8K_DIR", str(tmp_path / "nonexistent"))
    assert main(["train", "quickstart", *QUICK, "task.name=gsm8k", f"results_dir={tmp_path / 'results'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the environment's GSM8K_DIR={tmp_path / 'nonexistent'} does not exist" in err
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("GSM8K_DIR", str(tmp_path / "empty"))
    assert main(["train", "quickstart", *QUICK, "task.name=gsm8k", f"results_dir={tmp_path / 'results'}"]) == 2
    assert f"GSM8K_DIR={tmp_path / 'empty'}: train.jsonl and test.jsonl do not exist" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


def test_the_memory_floor_is_the_weights_and_each_completions_first_token(monkeypatch):
    """By hand on the tiny model (fp32, 2 layers, 2 heads of 16, the character vocabulary of 100): a token takes
    4 x (100 logits + 2 x 2 x 2 x 16 keys and values) = 912 bytes; refused one byte below weights + rows x 912, not
    at it."""
    from harness.policy import memory
    from tests.helpers.tiny import TINY_SPEC

    (run,) = run_configs(load_experiment("base", TINY_RUN))
    weights, per_token, _ = memory.model_bytes("tiny", json.dumps(TINY_SPEC, sort_keys=True), "float32")
    assert per_token == 4 * (100 + 2 * 2 * 2 * 16) == 912
    assert weights == 4 * sum(p.numel() for p in models.skeleton("tiny", TINY_SPEC).parameters())
    floor = weights + 16 * per_token  # prompts_per_step 4 x group_size 4
    monkeypatch.setattr(memory, "device_memory", lambda device: floor)
    assert memory.sampling_memory_problem(run, 16, "rows") is None
    monkeypatch.setattr(memory, "device_memory", lambda device: floor - 1)
    assert memory.sampling_memory_problem(run, 16, "rows") == (
        f"rows = 16 completions sampled at once need at least 14.6 kB for their first token (its logits, keys and "
        f"values) beside {memory.size(weights)} of weights (the policy's), and this machine's cpu has "
        f"{memory.size(floor - 1)} in all: lower them")
    monkeypatch.setattr(memory, "device_memory", lambda device: weights)  # not one completion: the model's fault
    assert memory.sampling_memory_problem(run, 16, "rows").startswith("model 'tiny' takes at least ")


@pytest.mark.parametrize("limit, expected", [("4096\n", 4096), ("max\n", None), (None, None), ("10**30", None)])
def test_a_containers_memory_limit_is_the_cpus_memory_when_lower(monkeypatch, limit, expected):
    """On CPU the machine's memory, or the cgroup's ``memory.max`` when it is a number below it (a container's limit:
    the floor is checked against what the run may use, not what the host has)."""
    from harness.policy import memory

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    read = Path.read_text

    def read_text(path, *args, **kwargs):
        if str(path) != "/sys/fs/cgroup/memory.max":
            return read(path, *args, **kwargs)
        if limit is None:
            raise FileNotFoundError(path)
        return str(physical * 2) if limit == "10**30" else limit

    monkeypatch.setattr(memory.Path, "read_text", read_text)
    assert memory.device_memory(torch.device("cpu")) == (expected or physical)


@pytest.mark.parametrize("name, spec", [("tiny", {"num_layers": 5, "hidden_size": 32, "num_heads": 2}),
                                        ("tiny_moe", {"num_layers": 3, "num_experts": 3}), ("tiny", {})])
def test_a_tiny_models_floor_counts_its_layers_without_building_them_all(monkeypatch, name, spec):
    """The tiny models' weights: the skeleton of every layer was built (model.tiny.num_layers=20000: minutes before
    the refusal or the run, the sixth hostile pass); now those of one and two layers, the rest counted, and equal
    to the whole skeleton's count."""
    from harness.policy import memory

    whole = sum(p.numel() for p in models.skeleton(name, spec).parameters())
    built = []
    real = models.skeleton
    monkeypatch.setattr(models, "skeleton", lambda n, tiny: built.append(tiny["num_layers"]) or real(n, tiny))
    config, weights, layers = memory.tiny_shape(name, spec)
    assert weights == whole and layers == spec.get("num_layers", 4) and max(built) <= 2
    memory.tiny_shape(name, {**spec, "num_layers": 10**6})
    assert max(built) <= 2


def test_the_memory_floor_reads_a_folders_config_without_building_the_model(tmp_path, monkeypatch):
    """A local folder's config.json with zero heads, a size as text, or 200000 layers: the check raised a traceback
    (ZeroDivisionError, transformers' field validation) or built the model's skeleton for minutes without a word (the
    sixth hostile pass); now it reads the config alone and leaves what it cannot size to the model's load."""
    from harness.policy import memory

    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 3, "vocab_size": 1000, "intermediate_size": 128}
    for name, change in (("zero", {"num_attention_heads": 0}), ("text", {"hidden_size": "576"}),
                         ("deep", {"num_hidden_layers": 200000}), ("plain", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**base, **change}))
    monkeypatch.setattr(models, "skeleton", lambda *a: pytest.fail("a folder's model was built"))
    assert memory.model_bytes(str(tmp_path / "zero"), "{}", "float32") is None
    assert memory.model_bytes(str(tmp_path / "text"), "{}", "float32") is None
    assert memory.model_bytes(str(tmp_path / "plain"), "{}", "float32")[:2] == (0, 4 * (1000 + 3 * 2 * 2 * 16))
    assert memory.model_bytes(str(tmp_path / "deep"), "{}", "float32")[:2] == (0, 4 * (1000 + 200000 * 2 * 2 * 16))


@pytest.mark.parametrize(("settings", "copies", "parts"), [
    ([], 1, "the policy's"),
    (["objective.params.beta=0.04"], 2, "the policy's, its reference copy's"),  # a KL term: a frozen reference
    (["objective.params.beta=0.04", "model.lora.rank=2"], 1, "the policy's"),  # the base, adapters off: no copy
    (["model.sampler_dtype=bfloat16"], 1.5, "the policy's, its bfloat16 sampler copy's"),
    (["objective.name=popo", "objective.params.predictor_hidden_dim=8"], 2,  # its moving target (policy_copies)
     "the policy's, objective popo's copy's, objective popo's trained parameters with their gradients and AdamW "
     "moments"),  # and its predictor, counted in the test below
])
@pytest.mark.slow
def test_the_memory_floor_counts_the_frozen_copies_a_run_holds(monkeypatch, settings, copies, parts):
    """The policy's weights were counted once, whatever the run holds beside them: the reference policy's frozen copy
    (a KL term, a2po), the sampler's copy in another precision (whose keys and values are in its precision too)."""
    from harness.policy import memory
    from tests.helpers.tiny import TINY_SPEC

    (run,) = run_configs(load_experiment("base", [*TINY_RUN, *settings]))
    weights, per_token, hidden = memory.model_bytes("tiny", json.dumps(TINY_SPEC, sort_keys=True), "float32")
    held = int(weights * copies) + (16 * sum(p.numel() for p in PredictorMLP(hidden, 8, 2).parameters())
                                    if "objective.name=popo" in settings else 0)
    sampled = per_token // 2 if "model.sampler_dtype=bfloat16" in settings else per_token
    assert memory.held_weights(run, weights, hidden) == (held, parts)
    monkeypatch.setattr(memory, "device_memory", lambda device: held + 16 * sampled)
    memory.check_memory(run)
    monkeypatch.setattr(memory, "device_memory", lambda device: held + 16 * sampled - 1)
    with pytest.raises(ConfigError, match=rf"beside {memory.size(held)} of weights \({parts}\)"):
        memory.check_memory(run)


def test_an_objectives_trained_parameters_beyond_memory_are_refused_before_the_run(tmp_path):
    """POPO's predictor was not in the memory floor: a width of 1e12 made the run folder, then failed in torch's
    allocator (the thirteenth hostile pass). Its count is the built module's, at every depth."""
    from harness.policy import memory

    for width, layers in ((8, 2), (5, 4), (1, 3)):
        objective = get_objective("popo", predictor_hidden_dim=width, predictor_layers=layers)
        assert objective.trained_parameter_count(32) == sum(p.numel() for p in PredictorMLP(32, width, layers)
                                                            .parameters())
    assert get_objective("grpo").trained_parameter_count(32) == 0
    (run,) = run_configs(load_experiment("base", [*TINY_RUN, "objective.name=popo",
                                                  "objective.params.predictor_hidden_dim=1000000000000"]))
    with pytest.raises(ConfigError, match=r"objective popo's trained parameters with their gradients and AdamW "
                                          r"moments; .*, or settings that hold less beside it$"):
        memory.check_memory(run)
    deep = get_objective("popo", predictor_hidden_dim=1, predictor_layers=10**12)  # a list per layer: MemoryError
    assert deep.trained_parameter_count(32) == 32 * 1 + 3 + (10**12 - 2) * 4 + 1 * 32 + 32
    (run,) = run_configs(load_experiment("base", [*TINY_RUN, "objective.name=popo",
                                                  "objective.params.predictor_layers=1000000000000"]))
    with pytest.raises(ConfigError, match=r"objective popo's trained parameters"):
        memory.check_memory(run)


def test_the_memory_floor_counts_a_folders_weights_from_its_safetensors_headers(tmp_path):
    """A local folder's weights counted 0: the floor of a 7B model in float32 beside its reference was the logits
    alone. Now the parameters of the files transformers loads, from their headers (a sharded folder's index; a
    Mistral-style consolidated file beside them is not loaded, not counted), nothing else read."""
    from safetensors.torch import save_file

    from harness.policy import memory

    tensors = {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
    (tmp_path / "one").mkdir()
    save_file(tensors, tmp_path / "one" / "model.safetensors")
    assert memory.folder_parameters(tmp_path / "one") == 17
    save_file(tensors, tmp_path / "one" / "model.safetensors", metadata={"format": "pt"})  # as transformers saves
    assert memory.folder_parameters(tmp_path / "one") == 17  # the header's __metadata__ entry is not a tensor
    shards = tmp_path / "sharded"
    shards.mkdir()
    save_file({"a": tensors["a"]}, shards / "model-1.safetensors")
    save_file({"b": tensors["b"]}, shards / "model-2.safetensors")
    save_file(tensors, shards / "consolidated.safetensors")
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors",
                                                                                   "b": "model-2.safetensors"}}))
    assert memory.folder_parameters(shards) == 17
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")  # a header length beyond the cap
    assert memory.folder_parameters(tmp_path / "bad") == 0 == memory.folder_parameters(tmp_path / "none")


def test_a_rollout_or_a_lab_beyond_memory_is_refused_in_one_line_before_anything(tmp_path, capsys, monkeypatch):
    """group_size or lab.reference_samples of 10^8: torch's allocation error after the run's or lab's folder, the warm
    start and a traceback (the fifth hostile pass, 10.8); now one line naming the settings, nothing made. The
    machine's memory is fixed at 24 GB here, so that a larger machine runs the same test."""
    from harness.policy import memory

    monkeypatch.setattr(memory, "device_memory", lambda device: 24 * 10**9)
    results = f"results_dir={tmp_path / 'results'}"
    assert main(["train", "quickstart", *QUICK, "train.group_size=100000000", results]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config error: train.prompts_per_step x train.group_size = " in err
    assert re.search(r"completions sampled at once need at least .* GB for their first token \(its logits, keys and "
                     r"values\) beside .* of weights \(the policy's\), and this machine's cpu has 24.0 GB in all: "
                     r"lower them", err)
    assert main(["lab", "base", *TINY_RUN, "lab.reference_samples=100000000", results]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lab.reference_samples x the evaluation minibatch's prompts = 200000000 " in err
    # the evaluation's completions: pass@k's k samples of a problem at once (the sixth pass: not counted)
    assert main(["train", "quickstart", *QUICK, "train.pass_k=100000000", results]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: evaluation: pass@k: train.pass_k=100000000 "
                                                   "completions for each of 1 problem per call (train.eval_batch_size "
                                                   "// train.pass_k, at least 1) = 100000000 completions sampled at "
                                                   "once need at least "), err
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_ctrl_c_says_so_on_a_line_of_its_own(tmp_path, capsys, monkeypatch):
    """Ctrl-C during a run: its line was written after the progress bar, on the bar's own line (the sixth hostile
    pass); the bar is closed (cleared) first, however the loop ends."""
    from harness.loop import native

    real = native.train_step

    def interrupted_at_step_2(run, learner, cfg, step, *rest):
        if step == 2:
            raise KeyboardInterrupt
        return real(run, learner, cfg, step, *rest)

    monkeypatch.setattr(native, "train_step", interrupted_at_step_2)
    assert main(["train", "quickstart", *QUICK, "train.steps=4", f"results_dir={tmp_path}"]) == 130
    err = capsys.readouterr().err
    assert "1/4" in err  # the bar was drawn
    last = err.rstrip("\n").split("\n")[-1].split("\r")[-1]  # what the terminal shows on the line it ends on
    assert last == "interrupted: run the same command again to resume (finished steps are kept)", repr(err[-300:])


@pytest.mark.parametrize("text, reason", [
    (None, "{folder} holds no config.json"),
    ("folder", "its config.json is a folder, not a file"),  # both said "holds no config.json" (the seventh pass)
    ("link", "its config.json is a symbolic link to nothing (or to itself)"),
    ("{not json", "its config.json cannot be read ("),
    ("[1, 2]", "its config.json cannot be read ("),
    ('{"model_type": "nosuchmodel"}', "its config.json cannot be read ("),
])
def test_a_local_model_folder_transformers_cannot_read_is_refused_before_anything(tmp_path, capsys, text, reason):
    """A model folder without config.json, or with one that is not JSON, a list, or of an unknown model_type: the run
    failed in transformers after its folder was made (the sixth hostile pass); now one line before anything."""
    folder = tmp_path / "model"
    folder.mkdir()
    if text == "folder":
        (folder / "config.json").mkdir()
    elif text == "link":
        (folder / "config.json").symlink_to(folder / "config.json")
    elif text is not None:
        (folder / "config.json").write_text(text)
    assert main(["train", "quickstart", *QUICK, f"model.name={folder}", f"results_dir={tmp_path / 'results'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: model.name {str(folder)!r}: {reason.format(folder=folder)}"), err
    assert err.endswith("give a model folder in the hub layout (config.json, the weights, the tokenizer's files), as "
                        "save_pretrained writes it\n") and err.count("\n") == 1
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_a_local_model_folder_without_weights_or_a_tokenizer_is_refused_before_anything(tmp_path, capsys,
                                                                                       monkeypatch):
    """A folder holding config.json alone, or config and weights without the tokenizer's files: the run failed in
    transformers (its file-not-found error; a 6-line tokenizer message) after the run's folder was made (the seventh
    hostile pass). A whole folder passes the check."""
    from harness.run.config import check_this_machine
    from tests.helpers.tiny import TINY_SPEC

    model, tokenizer = models.load_model("tiny", tiny=TINY_SPEC)
    whole, no_tokenizer, config_only = (tmp_path / name for name in ("whole", "no_tokenizer", "config_only"))
    for folder in (whole, no_tokenizer):
        model.save_pretrained(folder)
    tokenizer.save_pretrained(whole)
    config_only.mkdir()
    shutil.copy(whole / "config.json", config_only)
    check_this_machine(run_configs(load_experiment("quickstart", [*QUICK, f"model.name={whole}"])))
    capsys.readouterr()  # save_pretrained's progress
    # the same process after the folder's config.json changed (the Python API, a worker): it read the first one again
    config = json.loads((whole / "config.json").read_text())
    (whole / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16, "vocab_size": 10**12}))
    with pytest.raises(ConfigError, match=r"^train.max_new_tokens=24 leaves no position for the prompt"):
        check_this_machine(run_configs(load_experiment("quickstart", [*QUICK, f"model.name={whole}"])))
    (whole / "config.json").write_text(json.dumps({**config, "vocab_size": 10**12}))
    with pytest.raises(ConfigError, match=r"takes at least 4,000.0 GB for one completion.s first token"):
        check_this_machine(run_configs(load_experiment("quickstart", [*QUICK, f"model.name={whole}"])))
    (whole / "config.json").write_text(json.dumps(config))
    # weights as a pickle (torch.save, as pytorch_model.bin), a model.safetensors cut short, or one that is a pickle:
    # transformers unpickled the first (weights_only) and the others failed after the run's folder was made
    pickled, cut, not_safetensors = (tmp_path / name for name in ("pickled", "cut", "not_safetensors"))
    for folder in (pickled, cut, not_safetensors):
        shutil.copytree(whole, folder)
    (pickled / "model.safetensors").unlink()
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:-100])
    torch.save({"not": "weights"}, not_safetensors / "model.safetensors")
    for folder, reason in ((config_only, f"{config_only} holds no weights (model.safetensors or "),
                           (no_tokenizer, "its tokenizer cannot be built ("),
                           (pickled, f"{pickled} holds its weights as pytorch_model.bin, a pickle, which the harness "
                                     "does not load"),
                           (cut, "its weights file model.safetensors cannot be read (Error while deserializing header: "
                                 "incomplete metadata"),
                           (not_safetensors, "its weights file model.safetensors cannot be read (")):
        assert main(["train", "quickstart", *QUICK, f"model.name={folder}", f"results_dir={tmp_path / 'results'}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"config error: model.name {str(folder)!r}: {reason}") and err.count("\n") == 1, err
    assert not (tmp_path / "results").exists()
    # the embedded model's cached copy cut short (a disk that filled): prepare said "cached", a run failed in
    # safetensors after its folder was made
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    shutil.copytree(cut, tmp_path / "cache" / models.EMBEDDED_NAME)
    for command in (["prepare"], ["train", "quickstart", *QUICK, f"model.name={models.EMBEDDED_NAME}",
                                  f"results_dir={tmp_path / 'results'}"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"config error: the embedded model's cached copy in {tmp_path / 'cache'}"), err
        assert err.endswith("remove that folder and run `python -m harness prepare` (make setup does) to build it "
                            "again\n") and err.count("\n") == 1, err
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_completions_that_fill_the_models_positions_are_refused(tmp_path, capsys):
    """train.max_new_tokens at or past a model's position limit left no room for the prompt: a RoPE model sampled
    past what it was built for without a word (the sixth hostile pass). The tiny models' limit is model.tiny's, a
    folder's its config.json's."""
    with pytest.raises(ConfigError, match=r"^train.max_new_tokens=512 leaves no position for the prompt: model "
                       r"'tiny' takes at most 512 tokens of prompt and completion \(model.tiny.max_position\); "
                       r"lower train.max_new_tokens$"):
        run_configs(load_experiment("quickstart", ["train.max_new_tokens=512"]))
    with pytest.raises(ConfigError, match=r"^train.eval_max_new_tokens=80 leaves no position .*\(model.tiny"):
        run_configs(load_experiment("quickstart", ["train.eval_max_new_tokens=80", "model.tiny.max_position=64"]))
    run_configs(load_experiment("quickstart", ["train.max_new_tokens=511"]))  # one position left: accepted
    # the task's prompts count too, as the run starts (before its warm start): a prompt of 36 characters and 24 new
    # tokens ran on a model of 25 positions (the seventh hostile pass)
    assert main(["train", "quickstart", *QUICK, "model.tiny.max_position=50", "train.max_new_tokens=24",
                 f"results_dir={tmp_path / 'tiny'}"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"config error: the task's longest prompt \((\d+) tokens\) and train.max_new_tokens=24 need "
                     r"\d+ positions, and model 'tiny' takes at most 50 \(its config's max_position_embeddings\): "
                     r"lower train.max_new_tokens to at most \d+, or give a model with more positions\n$", err), err
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 100, "intermediate_size": 128, "max_position_embeddings": 32}))
    assert main(["train", "quickstart", *QUICK, f"model.name={folder}", "train.max_new_tokens=40",
                 f"results_dir={tmp_path / 'results'}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"config error: train.max_new_tokens=40 leaves no position for the prompt: model {str(folder)!r} "
                   f"takes at most 32 tokens of prompt and completion (max_position_embeddings in "
                   f"{folder / 'config.json'}); lower train.max_new_tokens\n")
    assert not (tmp_path / "results").exists()


def test_a_labs_own_failure_is_one_line_with_its_traceback_in_the_labs_folder(tmp_path, capsys, monkeypatch):
    def beyond_memory(self, b, bar):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr("harness.apps.lab.Lab.measure_batch", beyond_memory)
    assert main(["lab", "base", *TINY_RUN, "name=l", f"results_dir={tmp_path}", "--no-progress"]) == 1
    err = capsys.readouterr().err
    folder = tmp_path / "lab" / "l"
    assert err == ("error: RuntimeError: DefaultCPUAllocator: can't allocate memory (traceback in "
                   f"{folder / 'traceback.txt'})\n")
    assert "beyond_memory" in (folder / "traceback.txt").read_text()


@pytest.fixture
def gsm8k_hub(monkeypatch, tmp_path):
    """GSM8K without GSM8K_DIR, with empty datasets and hub caches and a hub that cannot be reached: yields the
    timeouts the hub was asked with; loading the data fails the test (the check came too late)."""
    import datasets.config
    import huggingface_hub

    from harness import tasks

    monkeypatch.delenv("GSM8K_DIR", raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    calls = []

    def dataset_info(name, timeout=None):
        calls.append(timeout)
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "dataset_info", dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the data was loaded: the check came "
                                                                               "too late"))
    tasks._task_data_problem.cache_clear()
    yield calls
    tasks._task_data_problem.cache_clear()


@pytest.mark.slow
def test_gsm8k_from_an_unreachable_hub_is_refused_once_in_seconds_before_anything_starts(tmp_path, capsys, gsm8k_hub,
                                                                                       monkeypatch):
    """Without GSM8K_DIR the hub's copy is asked for in one short request (the datasets library retried for long
    after the run folder was made; the fifth hostile pass, 10.9); a cached copy is not asked for."""
    import datasets.config
    import huggingface_hub

    from harness import tasks
    from harness.run.hub import HUB_TIMEOUT_S

    args = ["quickstart", *QUICK, "task.name=gsm8k", f"results_dir={tmp_path / 'results'}"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "task gsm8k's data (openai/gsm8k: neither task.data_dir nor GSM8K_DIR is set) is " \
        "not in the local Hugging Face cache and the hub cannot be reached" in err and "set GSM8K_DIR" in err
    assert main(["sweep", *args, "sweep.grid.seed=[0,1]"]) == 2 and gsm8k_hub == [HUB_TIMEOUT_S]  # asked once
    assert main(["bench", f"results_dir={tmp_path / 'results'}"]) == 2 and "set GSM8K_DIR" in capsys.readouterr().err
    assert gsm8k_hub == [HUB_TIMEOUT_S] * 2  # the bench's task has other arguments
    assert not (tmp_path / "results").exists()
    tasks._task_data_problem.cache_clear()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["train", *args]) == 2 and gsm8k_hub == [HUB_TIMEOUT_S] * 2  # not asked
    assert "HF_HUB_OFFLINE is set: set GSM8K_DIR" in capsys.readouterr().err
    prepared = datasets.config.HF_DATASETS_CACHE / "openai___gsm8k" / "main" / "0.0.0" / "e53f048"
    prepared.mkdir(parents=True)
    (prepared / "dataset_info.json").write_text("{}")
    tasks._task_data_problem.cache_clear()
    assert "HF_HUB_OFFLINE is set" in tasks.get_task("gsm8k").data_problem()  # an info file alone is no copy
    (prepared / "gsm8k-train.arrow").write_bytes(b"")
    tasks._task_data_problem.cache_clear()
    assert tasks.get_task("gsm8k").data_problem() is None and gsm8k_hub == [HUB_TIMEOUT_S] * 2  # cached: not asked


@pytest.fixture
def hub_check(monkeypatch):
    import huggingface_hub

    from harness.policy import models

    models.hub_model_problem.cache_clear()
    calls = []

    def model_info(name, timeout=None):
        calls.append(timeout)
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    monkeypatch.setattr("harness.policy.models.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded: the check came too late"))
    yield calls
    models.hub_model_problem.cache_clear()


@pytest.mark.slow
def test_an_unreachable_hub_is_asked_once_with_a_short_timeout_before_anything_starts(tmp_path, capsys, hub_check):
    from harness.run.hub import HUB_TIMEOUT_S

    args = ["quickstart", *QUICK, "model.name=nobody/nothing", f"results_dir={tmp_path / 'results'}"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nobody/nothing' is not in the local Hugging Face cache and the hub cannot be " \
        "reached" in err and hub_check == [HUB_TIMEOUT_S]
    assert main(["sweep", *args, "sweep.grid.seed=[0,1]"]) == 2 and hub_check == [HUB_TIMEOUT_S]  # asked once
    assert not (tmp_path / "results").exists()


def test_hf_hub_offline_refuses_an_uncached_model_without_asking_the_hub(tmp_path, capsys, hub_check, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["train", "quickstart", *QUICK, "model.name=nobody/nothing", f"results_dir={tmp_path}/r"]) == 2
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err and hub_check == []


@pytest.mark.slow
def test_a_nonexistent_hub_id_is_refused_whether_or_not_the_hub_answers(tmp_path):
    from harness.policy import models
    from harness.run import config

    models.hub_model_problem.cache_clear()
    run = run_configs(load_experiment("quickstart", [*QUICK, "model.name=nobody-x9/nothing-x9"]))[0]
    with pytest.raises(ConfigError, match="model.name 'nobody-x9/nothing-x9'.*(no such model|cannot be reached)"):
        config.check_this_machine([run])


# ------------------------------------------------------------------------------ 9. a torn line that is not redone


@pytest.mark.slow  # a run resumed: make test
def test_a_killed_runs_cut_short_last_line_is_redone_without_a_warning(stopped_run, capsys):
    run, run_dir = stopped_run
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward_me')  # the step after the checkpoint, torn by the kill
    assert train(run, run_dir, progress=False)["missing_steps"] == []
    assert "warning" not in capsys.readouterr().err


# ------------------------------------------------------------------------------ 10. the terminal


def test_the_final_line_and_the_progress_fields_are_rounded(tmp_path, capsys, monkeypatch):
    from harness.loop.metrics import progress_fields

    monkeypatch.setattr("harness.loop.native.evaluate", lambda policy, tokenizer, task, cfg, step: (
        {"eval_accuracy": 1 / 120 * (step + 1)}, []))
    assert main(["train", "base", *TINY_RUN, "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"finished: eval accuracy 0\.008 at the start, 0\.025 at the end \(best 0\.025\), \d+ s",
                        last), last
    rows = [{"step": 1, "reward_mean": 0.3333333, "clip_frac": 1.23456e-4, "eval_accuracy": 0.008333333333}]
    assert progress_fields(rows[0], rows) == {"reward": "0.333", "clip": "0.000123", "eval": "0.008"}


@pytest.mark.slow
def test_the_trl_backend_shows_our_progress_line_not_trls_metrics_dict_or_warnings(tmp_path, capsys):
    from harness.loop.trl_backend import train_trl

    run = tiny_run(tmp_path, "backend=trl", "train.steps=2", "train.eval_every=1", "train.save_every=1")
    assert train_trl(run, tmp_path / "run", progress=True)["status"] == "finished"
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "reward=" in out and "eval=" in out  # our fields on TRL's bar
    for noise in ("{'loss'", "'learning_rate'", "train_runtime", "is_gradient_checkpointing", "Writing model shards",
                  "mtime may not be reliable"):
        assert noise not in out, noise


def test_a_trl_checkpoint_cut_short_is_not_resumed_from_and_is_removed_under_the_lock(tmp_path):
    from harness.loop.trl_backend import trl_checkpoints

    trl = tmp_path / "trl"
    for step, complete in ((4, True), (8, True), (12, False)):  # checkpoint-12: a kill or a full disk mid-save
        (trl / f"checkpoint-{step}").mkdir(parents=True)
        (trl / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"w")
        if complete:
            (trl / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert trl_checkpoints(trl) == (str(trl / "checkpoint-8"), [trl / "checkpoint-12"])
    assert trl_checkpoints(tmp_path / "none") == (None, [])


@pytest.mark.parametrize("damage", ["train: {steps: [\n", "- a list\n"])
def test_a_damaged_config_yaml_is_named_in_a_warning_when_the_run_continues(stopped_run, capsys, damage):
    """A damaged config.yaml is not silently rewritten from the settings given, which cannot be checked against the
    run's (docs/hostile_pass.md, case 122)."""
    run, run_dir = stopped_run
    (run_dir / "config.yaml").write_text(damage)
    check_resume(run, run_dir)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"warning: {run_dir / 'config.yaml'} is damaged"), err


@pytest.mark.parametrize("text", ["notes: [\n", "- my list\n", "a: !!python/object/apply:os.getpid []\n"])
def test_a_users_config_yaml_that_is_no_runs_is_never_written_over(tmp_path, capsys, text):
    """`train --run-dir` at a folder of the user's holding a config.yaml that is not a run's settings (a note, another
    tool's file): a damaged run config is rewritten as the run continues, so the user's file was written over. Now,
    when nothing else there is a run's (no code line, no metrics or summary), it is refused and left as it is."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"is damaged .*; nothing in .* is a run's .*give a new or empty --run-dir"):
        check_resume(tiny_run(tmp_path), folder)
    assert main(["train", "base", *TINY_RUN, f"results_dir={tmp_path}", "--run-dir", str(folder),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"config error: {folder / 'config.yaml'} is damaged"), err
    assert (folder / "config.yaml").read_text() == text and sorted(p.name for p in folder.iterdir()) == ["config.yaml"]


@pytest.mark.slow  # a run resumed: make test
def test_the_damaged_config_warning_is_said_once_by_a_resuming_command(stopped_run, tmp_path, capsys):
    run, run_dir = stopped_run
    (run_dir / "config.yaml").write_text("- a list\n")
    assert main(["train", "base", *TINY_RUN, VARIED_REWARD, f"results_dir={tmp_path}", "train.steps=3", "--run-dir",
                 str(run_dir), "--no-progress"]) == 0
    assert capsys.readouterr().err.count("config.yaml is damaged") == 1


@pytest.mark.slow
def test_more_prompts_per_step_than_training_problems_is_one_line_before_anything(tmp_path, capsys, monkeypatch):
    """A step draws its prompts without replacement: more than the task has was a ValueError traceback from numpy
    after the run had begun; then a line as the run started, after its folder (a sweep: after every run's). Now one
    line before any folder where the task's arguments say how many problems it makes (arith, reasoning_gym), and as
    the run starts, before its warm start, where only its data says (GSM8K's whole split)."""
    from harness import tasks
    from harness.loop import build

    def no_policy(*args, **kwargs):
        raise AssertionError("the starting policy was built")

    monkeypatch.setattr(build, "build_policy", no_policy)
    problems = len(build.build_task(tiny_run(tmp_path)).train_problems())
    line = (f"config error: train.prompts_per_step={problems + 1} is more than the {problems} training problems of "
            "task 'arith', and a step draws its prompts without replacement: lower it")
    for command in ("train", "sweep"):
        assert main([command, "quickstart", *QUICK, f"train.prompts_per_step={problems + 1}",
                     f"results_dir={tmp_path / 'results'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [line] and not (tmp_path / "results").exists(), err
    monkeypatch.setattr(tasks, "_known_train_size", lambda *args: None)  # the hub.s GSM8K: the run says it
    assert main(["train", "quickstart", *QUICK, f"train.prompts_per_step={problems + 1}",
                 f"results_dir={tmp_path / 'results'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == line  # before the starting policy (no_policy)
