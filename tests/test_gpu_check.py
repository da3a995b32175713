"""`make gpu-check` (harness/apps/gpu_check.py): its dry run on CPU runs every check end to end at tiny shapes and
writes its JSON line; without CUDA the GPU command refuses in one line; a spent budget skips the checks left."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.apps import cli, gpu_check
from tests.helpers.processes import MAKE_ALONE

ROOT = Path(__file__).resolve().parent.parent


def test_a_spent_budget_skips_the_checks_left_and_the_line_says_so(tmp_path, monkeypatch):
    calls = []

    def check(check, overrides, run_dir, limit_s):
        calls.append((check.name, overrides, limit_s))
        monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: 10.0**6)  # the budget is spent after one check
        return {"check": check.name, "rollout_tok_s": 1.0, "update_tok_s": 2.0, "peak_mem_rollout_mb": 3.0,
                "peak_mem_update_mb": 4.0, "wall_s": 5.0}

    monkeypatch.setattr(gpu_check, "run_check", check)
    assert gpu_check.main(device="cpu", out=tmp_path) == 1
    (record,) = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert record["dry_run"] and record["device"] == "cpu" and record["qwen2_shape"] == gpu_check.QWEN_DRY
    assert [c["check"] for c in record["checks"]] == [c.name for c in gpu_check.CHECKS]
    assert "error" not in record["checks"][0] and all("skipped" in c["error"] for c in record["checks"][1:])
    ((name, overrides, limit_s),) = calls
    assert name == "tiny fp32, native" and "device=cpu" in overrides and limit_s <= gpu_check.DRY_BUDGET_S


def test_a_linked_record_is_refused_before_any_check_and_never_appended_through(tmp_path, monkeypatch, capsys):
    """results/bench/gpu_check.jsonl a link to a file of someone's: the line was appended to that file."""
    monkeypatch.setattr(gpu_check, "run_check", lambda *args: pytest.fail("a check ran"))
    (tmp_path / "theirs.jsonl").write_text("their line\n")
    (tmp_path / "gpu_check.jsonl").symlink_to(tmp_path / "theirs.jsonl")
    assert gpu_check.main(device="cpu", out=tmp_path) == 2
    assert capsys.readouterr().err == (f"gpu-check: {tmp_path / 'gpu_check.jsonl'} is a symbolic link or not a file: "
                                       "its line is never appended through a link; remove it, or run from another "
                                       "folder\n")
    assert (tmp_path / "theirs.jsonl").read_text() == "their line\n"


def test_the_gpu_command_without_cuda_says_how_to_dry_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpu_check.main(device="cuda", out=tmp_path) == 2
    assert "make gpu-check DEVICE=cpu" in capsys.readouterr().err and not (tmp_path / "gpu_check.jsonl").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_gpu_check_passes_the_device():
    done = subprocess.run(["make", "-n", "gpu-check", "DEVICE=cpu"], cwd=ROOT, capture_output=True, text=True,
                          env=MAKE_ALONE)
    assert done.returncode == 0 and "-m harness gpu-check --device cpu" in done.stdout


RUN = subprocess.run


def in_this_process(command, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run, except that a check's ``python -m harness train ...`` is run by the CLI in this process (on a
    CPU a fresh process isolates no GPU memory: it would only import the libraries again)."""
    if command[:3] != [sys.executable, "-m", "harness"]:
        return RUN(command, **kwargs)
    assert kwargs["capture_output"] and kwargs["text"] and kwargs["timeout"] > 0, kwargs
    err, threads = io.StringIO(), torch.get_num_threads()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(command[3:])
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(command, code, "", err.getvalue())


@pytest.mark.slow  # four runs, one of them through TRL: make test
def test_the_dry_run_runs_every_check_and_writes_its_json_line(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check.subprocess, "run", in_this_process)
    assert gpu_check.main(device="cpu", out=tmp_path) == 0
    (record,) = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert record["dry_run"] and record["versions"]["peft"] and record["versions"]["trl"]
    assert [(c["backend"], c["dtype"], c["lora_rank"]) for c in record["checks"]] == [
        ("native", "float32", 0), ("native", "bfloat16", 0), ("native", "bfloat16", 16), ("trl", "bfloat16", 0)]
    for check in record["checks"]:
        assert check["rollout_tok_s"] > 0 and check["update_tok_s"] > 0 and check["loss"] is not None
        assert check["peak_mem_rollout_mb"] > 0 and check["peak_mem_update_mb"] > 0 and check["rollout_tokens"] > 0
