"""Config validation, sweep expansion, the CLI, and a real sweep killed with SIGKILL and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from harness.run.config import load_experiment, run_configs, run_id
from harness.run.errors import ConfigError
from harness.run.records import read_jsonl
from tests.tiny import TINY_RUN, without_timing

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True, **kw)


@pytest.mark.parametrize("override, message", [
    (["train.stepz=3"], "unknown config key 'train.stepz'. Did you mean 'train.steps'? Valid keys here: steps,"),
    (["train.steps=abc"], "train.steps"),
    (["objective.name=gspoo"], "Did you mean 'gspo'?"),
    (["objective.params.clip_low=-1"], "clip_low must be >= 0"),
    (["objective.params.eps=0.1"], "has no hyperparameter eps"),
    (["task.name=gsm9k"], "Did you mean 'gsm8k'?"),
    (["train.num_minibatches=3"], "must divide prompts_per_step x group_size"),
    (["model.dtype=fp8"], "model.dtype must be one of"),
    (["sweep.grid.seed=[]"], "zero runs"),
])
def test_bad_configs_stop_with_a_clear_error(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        run_configs(load_experiment("quickstart", override))


def test_unknown_experiment_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="Did you mean 'quickstart'\\? Experiments: .*quickstart"):
        load_experiment("quickstrat")


@pytest.mark.parametrize("override, message", [
    ("objective.clip_low=-1", "did you mean objective.params.clip_low?"),
    ("train.stepz=3", "Did you mean 'train.steps'?"),
])
def test_misplaced_keys_get_a_hint(override, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        load_experiment("quickstart", [override])


def test_grid_overrides_take_the_dotted_form_a_researcher_types():
    cfg = load_experiment("quickstart", ["sweep.grid.objective.name=[grpo,cispo]", "sweep.grid.seed=[0, 1, 2]"])
    assert [(r.objective.name, r.seed) for r in run_configs(cfg)] == [
        (o, s) for o in ("grpo", "cispo") for s in (0, 1, 2)]


def test_make_prints_help_by_default_and_compare_sweeps_the_given_objectives():
    out = subprocess.run(["make", "--no-print-directory"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "make compare" in out.stdout and "make sweep" in out.stdout
    out = subprocess.run(["make", "-n", "--no-print-directory", "compare", "OBJECTIVES=grpo,cispo", "SEEDS=3"],
                         cwd=ROOT, capture_output=True, text=True)
    assert "sweep.grid.objective.name=[grpo,cispo]" in out.stdout and "sweep.grid.seed=[0,1,2]" in out.stdout
    out = subprocess.run(["make", "--no-print-directory", "compare"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and "give OBJECTIVES=" in out.stdout


def test_sweep_expands_grid_with_per_objective_overrides():
    cfg = load_experiment("quickstart", ["sweep.per_objective.gspo={objective.params.clip_high: 0.001}"])
    runs = run_configs(cfg)
    assert [(r.objective.name, r.seed) for r in runs] == [
        (o, s) for o in ("grpo", "gspo", "gspo_token", "ctpo") for s in (0, 1, 2)]
    assert all((r.objective.params.get("clip_high") == 0.001) == (r.objective.name == "gspo") for r in runs)
    ids = [run_id(r) for r in runs]
    assert len(set(ids)) == len(ids) and ids[0].startswith("grpo-s0-")
    assert ids == [run_id(r) for r in run_configs(cfg)]  # stable


def test_run_id_hashes_only_what_differs_from_the_defaults():
    (run,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0"]))
    (spelled_out,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0",
                                                                "train.dynamic_sampling=false", "task.data_dir=null"]))
    (other,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0", "train.lr=1e-6"]))
    assert run_id(run) == run_id(spelled_out) != run_id(other)
    assert run_id(OmegaConf.merge(run, {"results_dir": "elsewhere"})) == run_id(run)


@pytest.mark.slow
def test_cli_reports_config_errors_without_traceback():
    out = cli("train", "quickstart", "objective.name=grpoo")
    assert out.returncode == 2
    assert "config error: unknown objective 'grpoo'. Did you mean 'grpo'?" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # a fresh interpreter importing torch and every reasoning-gym generator (~5 s)
def test_cli_lists_registered_names():
    out = cli("list")
    assert out.returncode == 0
    for name in ("grpo", "gspo", "gspo_token", "ctpo", "arith", "gsm8k", "quickstart", "rloo"):
        assert name in out.stdout


def wait_until(condition, timeout: float):
    """Polls ``condition`` until it returns something truthy (returned) or ``timeout`` seconds pass (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    return None


def processes_with(marker: str) -> list[int]:
    """Live processes other than this one whose command line contains ``marker`` (zombies have none)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in command:
                pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_killed_sweep_resumes_without_losing_or_repeating_steps(tmp_path):
    exp = tmp_path / "killtest.yaml"
    exp.write_text("sweep:\n  grid:\n    objective.name: [grpo, gspo]\n")
    args = [str(exp), *TINY_RUN, "train.steps=6", f"results_dir={tmp_path}/res", "--no-progress"]
    sweep = subprocess.Popen([sys.executable, "-m", "harness", "sweep", *args], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    exp_dir = tmp_path / "res" / "killtest"

    def first_run_has_two_steps():
        runs = sorted(p for p in exp_dir.glob("grpo-*") if p.is_dir()) if exp_dir.exists() else []
        return runs[0] if runs and len(read_jsonl(runs[0] / "metrics.jsonl")) >= 3 else None  # eval + 2 steps

    first = wait_until(first_run_has_two_steps, timeout=120)
    assert first is not None, "the sweep made no progress"
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()
    manifest = json.loads((exp_dir / "manifest.json").read_text())  # readable after the kill
    assert {r["objective"] for r in manifest["runs"]} == {"grpo", "gspo"}
    assert wait_until(lambda: not processes_with(str(first)), timeout=30), "the run outlived the killed sweep"
    assert all("step" in r for r in read_jsonl(first / "metrics.jsonl"))

    out = cli("sweep", *args)
    assert out.returncode == 0, out.stderr
    assert (exp_dir / "report" / "report.md").exists()  # the report follows results_dir
    manifest = json.loads((exp_dir / "manifest.json").read_text())
    assert [r["status"] for r in manifest["runs"]] == ["finished", "finished"]
    for run in manifest["runs"]:
        rows = read_jsonl(exp_dir / run["dir"] / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(7))
    # the resumed run is the run that was never interrupted
    out = cli("train", str(exp), *TINY_RUN, "train.steps=6", "--run-dir", str(tmp_path / "ref"), "--no-progress")
    assert out.returncode == 0, out.stderr
    assert without_timing(read_jsonl(first / "metrics.jsonl")) == \
        without_timing(read_jsonl(tmp_path / "ref" / "metrics.jsonl"))
    again = cli("sweep", *args)  # everything finished: nothing runs again
    assert again.returncode == 0 and "2/2 runs finished" in again.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a CUDA device on a machine without one")
def test_cuda_without_a_cuda_torch_is_a_config_error_saying_how_to_install_one():
    with pytest.raises(ConfigError, match="device=cuda, but .*(make setup TORCH=torch|CUDA_VISIBLE_DEVICES)"):
        run_configs(load_experiment("gsm8k_ablation", ["profile=gpu"]))


def test_profile_selects_gpu_scale_settings_and_command_line_still_wins():
    runs = run_configs(load_experiment("gsm8k_ablation", ["profile=gpu", "train.steps=7", "device=cpu"]))
    assert {r.model.name for r in runs} == {"Qwen/Qwen2.5-1.5B-Instruct"} and runs[0].device == "cpu"
    assert runs[0].train.prompts_per_step == 32 and runs[0].train.steps == 7 and runs[0].profile is None
    with pytest.raises(ConfigError, match="profile 'tpu' is not defined"):
        load_experiment("gsm8k_ablation", ["profile=tpu"])


def test_inherit_puts_an_experiment_underneath_and_refuses_cycles(tmp_path):
    quick, trl = (run_configs(load_experiment(name))[0] for name in ("quickstart", "trl_quickstart"))
    assert trl.backend == "trl" and trl.train.save_every == 5
    assert (trl.model, trl.task, trl.train.steps, trl.train.lr) == (quick.model, quick.task, 20, quick.train.lr)
    (tmp_path / "a.yaml").write_text(f"inherit: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"inherit: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(ConfigError, match="makes a cycle"):
        load_experiment(str(tmp_path / "a.yaml"))
