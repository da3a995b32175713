"""The TRL backend on 2 CPU processes through ``accelerate launch`` (DDP over gloo), as on several GPUs.

``accelerate launch --multi_gpu --num_processes 2`` starts two processes with torch.distributed.run; on a machine
without GPUs accelerate runs them on the CPU with gloo (``--cpu --num_processes 2`` would start one process:
accelerate's simple launcher, without MPI; the harness refuses that launch). The runs use tests/trl_launch.py, which
is ``python -m harness`` plus two test instruments: sampling from a seed per row (so that one and two processes
draw the same completions) and a log of every file each process writes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.loop.trl_backend import trl_checkpoints
from harness.run.records import read_jsonl
from tests.helpers.processes import processes_with, wait_until
from tests.helpers.tiny import TINY_SPEC, without_timing
from tests.helpers.tiny_moe import TINY_MOE_SPEC

ROOT = Path(__file__).resolve().parent.parent
ENTRY = str(ROOT / "tests" / "trl_launch.py")
# One optimizer step per pass over the rollout batch (num_minibatches=1) and two passes (epochs=2: the second pass
# has ratios != 1, so clipping and the behaviour KL are exercised), micro-batches of 2 sequences (gradient
# accumulation: 8 micro-batches on one process, 4 on each of two), a KL term to a reference model, a token-mean
# objective (the global token count matters), and a short warm start so that rewards vary.
SETTINGS = [*(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items()), "threads=1", "task.eval_size=8",
            "train.prompts_per_step=4", "train.group_size=4", "train.max_new_tokens=16", "train.num_minibatches=1",
            "train.epochs=2", "train.micro_batch_size=2", "train.steps=3", "train.eval_every=0", "train.save_every=1",
            "train.lr=1e-3",
            "task.args.digits=1", "task.format_weight=0.5", "objective.name=dapo", "objective.params.beta=0.04",
            "model.warm_start_steps=100", "model.warm_start_target=null", "model.warm_start_lr=1e-2",
            "model.warm_start_batch_size=32"]
# Round-off: the two runs add the same float32 terms in other orders (one process accumulates 8 micro-batch
# gradients; two processes accumulate 4 each and all-reduce the halves; prompts are padded to other widths), which
# moves a gradient by ~1e-7 relative (float32's epsilon); Adam, dividing by sqrt(v), passes that on to the weights,
# and 6 optimizer steps compound it: measured <= 7e-6 relative. A real difference (a process's metrics left out, a
# wrong global token count, the loss not scaled by the processes) is >= 1e-2.
RTOL, ATOL = 1e-4, 1e-7
# Averages over micro-batches of a per-micro-batch statistic (the std of the ratios): they depend on which sequences
# share a micro-batch, which TRL's per-process shuffle of the generation batch changes with the number of processes
# (the native loop's change with micro_batch_size alike). pg_loss is compared: its micro-batches' shares sum to the
# optimizer step's value however the sequences are split.
PER_MICRO_BATCH = {"ratio_std"}
# The same runs on the small tiny_moe from its random start, with an entropy bonus that moves the routers at every
# optimizer step (the random policy's rewards are all 0): the second pass over each batch sees moved routing.
MOE_SETTINGS = [*(s for s in SETTINGS if not s.startswith(("model.", "objective.", "train.lr="))),
                "model.name=tiny_moe", *(f"model.tiny.{k}={v}" for k, v in TINY_MOE_SPEC.items()),
                "model.warm_start_steps=0",
                "model.warm_start_target=null", "objective.name=grpo", "objective.params.entropy_coef=0.1",
                "train.lr=1e-2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir: Path, processes: int, env: dict, settings: list[str] = SETTINGS, **popen) -> subprocess.Popen:
    """``tests/trl_launch.py train trl_quickstart ...`` on ``processes`` processes (1: a plain process)."""
    command = [ENTRY, "train", "trl_quickstart", *settings, "--run-dir", str(run_dir)]
    if processes > 1:
        command = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(free_port()), *command]
    return subprocess.Popen([sys.executable, *command], cwd=ROOT, env={**os.environ, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def one_process(run_dir: Path, env: dict, settings: list[str] = SETTINGS) -> None:
    """The one-process run in this process, with the launcher's row-seeded draws (tests/trl_launch.py), undone
    after it: the same run as ``launch(run_dir, 1, env)`` without a fresh interpreter importing TRL."""
    from harness.apps.cli import main
    from tests.trl_launch import row_seeded_generate

    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        row_seeded_generate(patch.setattr)
        assert main(["train", "trl_quickstart", *settings, "--run-dir", str(run_dir), "--no-progress"]) == 0


def finished(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=540)
    assert proc.returncode == 0, err[-3000:]
    return err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process and two processes, the same global batch and row-seeded draws; the two-process run logs its
    processes' writes."""
    folder = tmp_path_factory.mktemp("trl2")
    env = {"RLVR_CACHE": str(folder / "cache"), "RLVR_TEST_ROW_SEEDS": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    one_process(folder / "one", env)  # first: it caches the starting policy both processes then load
    (folder / "writes").mkdir()
    err = finished(launch(folder / "two", 2, {**env, "RLVR_TEST_WRITES": str(folder / "writes")}))
    return folder, env, err


@pytest.mark.slow
def test_two_processes_give_one_process_metrics_and_weights(runs):
    folder, _, _ = runs
    one, two = (read_jsonl(folder / name / "metrics.jsonl") for name in ("one", "two"))
    assert [r["step"] for r in two] == [r["step"] for r in one] == [0, 1, 2, 3]
    for a, b in zip(without_timing(one), without_timing(two), strict=True):
        assert a.keys() == b.keys()
        for key in sorted(a.keys() - PER_MICRO_BATCH):
            assert b[key] == pytest.approx(a[key], rel=RTOL, abs=ATOL), (a["step"], key)
    row = one[2]  # the rollouts are equal, and the update and its metrics are not trivial
    assert row["reward_std"] > 0 and row["clip_frac"] > 0 and row["kl_ref"] > 0 and row["grad_norm"] > 0
    weights = [load_file(folder / name / "final" / "model.safetensors") for name in ("one", "two")]
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        torch.testing.assert_close(weights[1][key], weights[0][key], rtol=RTOL, atol=1e-6)


@pytest.mark.slow
def test_only_the_main_process_writes_the_run_and_the_terminal_shows_the_progress_line(runs):
    folder, _, err = runs
    run_dir = str(folder / "two")
    writes = [set((folder / "writes" / f"writes.{rank}.txt").read_text().splitlines()) for rank in (0, 1)]
    main, other = ({line.split(" ", 1)[1] for line in w if not line.startswith("os.mkdir")} for w in writes)
    for path in ("metrics.jsonl", "summary.json.tmp", "eval_samples.jsonl", "final.tmp/model.safetensors",
                 "trl/checkpoint-6/optimizer.pt", "trl/checkpoint-6/rng_state_0.pth"):
        assert f"{run_dir}/{path}" in main, path
    # the second process writes only its own RNG state into each checkpoint (Trainer's rng_state_<rank>.pth)
    assert other and all(re.fullmatch(rf"{run_dir}/trl/checkpoint-\d+/rng_state_1\.pth", p) for p in other), other
    assert not main & other
    lines = err.replace("\r", "\n").splitlines()
    assert sum(line.startswith("trl run on cpu") for line in lines) == 1  # once, not once per process
    assert sum(line.startswith("finished: eval accuracy") for line in lines) == 1
    assert any(line.startswith("two: ") and "reward=" in line and "eval=" in line for line in lines)
    assert not any("{'loss'" in line or "'reward':" in line for line in lines)  # no TRL metrics dicts


def killed_after_a_checkpoint(run_dir: Path, env: dict) -> bool:
    """Launch the two-process run into ``run_dir`` and SIGKILL all of it once its first checkpoint is written; False
    where the run had ended before the kill landed (the poll and the process scan take a moment: nothing to resume)."""
    proc = launch(run_dir, 2, env)
    assert wait_until(lambda: trl_checkpoints(run_dir / "trl")[0], timeout=300, process=proc,
                      poll=0.05), "no checkpoint written"  # polled often: the kill lands a poll after the checkpoint
    for pid in processes_with(str(run_dir)):  # the launcher and both processes (torch.distributed.run starts each
        with contextlib.suppress(ProcessLookupError):  # in a session of its own), as a job scheduler kills a job; one
            os.kill(pid, signal.SIGKILL)  # that ended since the scan: the run's record says so below
    proc.communicate()
    assert wait_until(lambda: not processes_with(str(run_dir)), timeout=120)
    summary = run_dir / "summary.json"
    return not (summary.is_file() and json.loads(summary.read_text())["status"] == "finished")


@pytest.mark.slow
def test_a_killed_two_process_run_resumes_exactly(runs, tmp_path):
    """Killed after its first checkpoint, the run resumes to the same metrics as one never killed. Where it ended
    before the kill landed (on a loaded machine), it runs again into a fresh folder: read from its record."""
    folder, env, _ = runs
    for attempt in range(3):
        run_dir = tmp_path / f"killed{attempt}"
        if killed_after_a_checkpoint(run_dir, env):
            break
    else:
        pytest.fail("each of 3 runs ended before the kill landed")
    err = finished(launch(run_dir, 2, env))  # killed before its end (its record): resumed from a checkpoint
    assert re.search(rf"resuming {run_dir.name} from step \d+ \(checkpoint", err)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # every step once
    assert without_timing(rows) == without_timing(read_jsonl(folder / "two" / "metrics.jsonl"))  # exactly


def documented_launches() -> list[str]:
    """Every ``accelerate launch`` command in the code blocks of docs/trl.md, docs/cluster.md and README.md,
    continuations joined."""
    commands = []
    for doc in (ROOT / "docs" / "trl.md", ROOT / "docs" / "cluster.md", ROOT / "README.md"):
        blocks = re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S)
        for block in blocks:
            commands += [line.strip() for line in block.replace("\\\n", " ").splitlines()
                         if "accelerate launch" in line and not line.lstrip().startswith(("#", "for "))]
    return commands


@pytest.mark.slow
def test_the_documented_launch_commands_pass_accelerates_validation_and_ours(monkeypatch):
    """No GPU here: each documented multi-GPU command goes through accelerate's own argument parsing and config
    checks (the launcher it would start is recorded instead of run), and its harness part through the harness's
    validation with that launch's WORLD_SIZE (micro-batches x processes must divide the minibatch)."""
    from accelerate.commands import launch as accelerate_launch

    from harness.run import checks
    from harness.run import config as harness_config

    monkeypatch.setitem(checks._CHECKS["config"], "device", lambda run: None)  # device=cuda: no GPU here
    configs = Path(importlib.util.find_spec("trl").origin).parent / "accelerate_configs"  # not importing trl (slow)
    commands = documented_launches()
    assert len(commands) >= 4, commands
    started = {}
    for name in ("simple_launcher", "multi_gpu_launcher", "deepspeed_launcher"):
        monkeypatch.setattr(accelerate_launch, name, lambda args, name=name: started.update(launcher=name, args=args))
    for command in commands:
        words = shlex.split(command.replace("$ACC", str(configs)))
        env = dict(w.split("=", 1) for w in words[: words.index(next(w for w in words if "accelerate" in w))])
        words = words[words.index(next(w for w in words if w.endswith("accelerate"))) + 2:]  # after `launch`
        started.clear()
        accelerate_launch.launch_command(accelerate_launch.launch_command_parser().parse_args(words))
        args = started["args"]
        config = (re.search(r"--config_file \S*/(\w+)\.yaml", command) or [None, "multi_gpu"])[1]
        expected = {"zero2": "deepspeed_launcher", "zero3": "deepspeed_launcher"}.get(config, "multi_gpu_launcher")
        assert started["launcher"] == expected, command
        assert args.num_processes == int(re.search(r"--num_processes (\d+)", command)[1])
        if config.startswith("zero"):
            assert args.zero_stage == int(config[-1])
        if config == "fsdp2":
            assert args.use_fsdp and str(args.fsdp_version) == "2"
        harness = args.training_script_args  # after `-m harness`
        assert args.module and args.training_script == "harness" and harness[0] == "train", command
        monkeypatch.setenv("WORLD_SIZE", str(args.num_processes))
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        harness_config.run_configs(harness_config.load_experiment(harness[1], [w for w in harness[2:] if "=" in w]))
        for key in env:
            monkeypatch.delenv(key)


@pytest.mark.parametrize("env, message", [
    ({"ACCELERATE_USE_CPU": "True", "MASTER_PORT": "29500"}, "--cpu --num_processes N starts one process"),
    ({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}, "runs an FSDP launch on CPU as plain DDP"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2"}, "runs a DeepSpeed launch on CPU as plain DDP"),
])
def test_a_cpu_launch_accelerate_would_run_otherwise_is_refused_before_the_run_starts(tmp_path, monkeypatch, env,
                                                                                      message):
    from harness.loop.trl_backend import train_trl
    from harness.run.config import ConfigError
    from tests.helpers.tiny import tiny_run

    for key in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    run = tiny_run(tmp_path, "backend=trl", "device=cpu", "train.micro_batch_size=2")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        train_trl(run, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_moe_expert_volatility_on_two_processes_equals_one_process(tmp_path):
    """Every process's loss forwards are gathered into the step's expert volatility, so two processes log exactly one
    process's (the load entropy and the aux loss are each micro-batch's, whose rows the split changes: close)."""
    env = {"RLVR_CACHE": str(tmp_path / "cache"), "RLVR_TEST_ROW_SEEDS": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    one_process(tmp_path / "one", env, MOE_SETTINGS)
    finished(launch(tmp_path / "two", 2, env, settings=MOE_SETTINGS))
    one, two = (read_jsonl(tmp_path / name / "metrics.jsonl")[1:] for name in ("one", "two"))
    assert len(one) == len(two) == 3
    for a, b in zip(one, two, strict=True):
        assert a["expert_changed_frac"] > 0
        for key in ("expert_changed_frac", "expert_token_changed_frac", "expert_layer_changed_max", "routed_tokens"):
            assert b[key] == a[key], (a["step"], key)
        for key in ("expert_load_entropy", "router_aux_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-2), (a["step"], key)
