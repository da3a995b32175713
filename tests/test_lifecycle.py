"""The objective lifecycle (objectives/base.py): statefulness declared and checked at registration, one check of an
objective's needs against what each trainer provides (native, TRL, the gradient lab), the hooks called by the native
loop once per optimizer step / rollout step, and stateful objectives resuming exactly, the documented example
(docs/objectives.md, "Adding an objective with state of its own") included."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.apps.lab import lab_objectives, validate_lab
from harness.loop.backends import BACKENDS
from harness.loop.native import train
from harness.run.config import load_experiment, run_configs
from harness.run.errors import ConfigError
from objectives import OBJECTIVES, Objective, available_objectives, register_objective
from objectives.base import lifecycle_unsupported
from tests.helpers.interrupt import full_and_resumed
from tests.helpers.tiny import tiny_run

REPO = Path(__file__).resolve().parents[1]
STATEFUL = ["adaptive_entropy", "adaptive_kl"]


def test_statefulness_is_declared_and_checked_when_an_objective_registers():
    with pytest.raises(ValueError, match="^objective 'forgot' implements after_update but does not declare stateful"):
        @register_objective("forgot")
        class Forgot(Objective):
            def after_update(self, metrics, sequences):
                pass

    with pytest.raises(ValueError, match="^objective 'unsaved' declares stateful = True but does not implement "
                                         "state_dict and load_state_dict"):
        @register_objective("unsaved")
        class Unsaved(Objective):
            stateful = True

    assert "forgot" not in available_objectives() and "unsaved" not in available_objectives()
    declared = {name: OBJECTIVES.get(name).needs() for name in available_objectives() if OBJECTIVES.get(name).needs()}
    assert declared == {"popo": {"state", "hidden_states"}, "adaptive_entropy": {"state"}, "adaptive_kl": {"state"},
                        "a2po": {"reference"}}


def test_one_function_checks_an_objective_against_what_a_trainer_provides():
    assert lifecycle_unsupported(OBJECTIVES.get("grpo"), "backend trl", frozenset()) is None
    assert lifecycle_unsupported(OBJECTIVES.get("adaptive_kl"), "backend native", BACKENDS["native"].provides) is None
    assert lifecycle_unsupported(OBJECTIVES.get("adaptive_kl"), "lab", frozenset()) == (
        "lab: objective 'adaptive_kl' keeps state of its own across updates (its lifecycle hooks, its state in every "
        "checkpoint), which lab does not provide")


@pytest.mark.parametrize("name", STATEFUL)
def test_trl_and_the_lab_refuse_a_stateful_objective_in_one_line(name, tmp_path):
    with pytest.raises(ConfigError) as error:
        run_configs(load_experiment("base", [f"objective.name={name}", "backend=trl", f"results_dir={tmp_path}"]))
    assert str(error.value) == (f"backend trl: objective {name!r} keeps state of its own across updates (its "
                                "lifecycle hooks, its state in every checkpoint), which backend trl does not provide; "
                                "use backend=native")
    with pytest.raises(ConfigError, match=f"^lab: objective {name!r} keeps state .*; leave it out of lab.objectives"):
        validate_lab(load_experiment("lab", [f"lab.objectives=[grpo,{name}]"]))
    assert name not in lab_objectives(load_experiment("lab", []))
    run_configs(load_experiment("base", [f"objective.name={name}", f"results_dir={tmp_path}"]))  # native: accepted


@pytest.mark.slow  # two tiny native runs of three steps per objective, one of them killed and resumed
@pytest.mark.parametrize("name,settings", [
    # a target above any entropy: the coefficient rises by delta after each of the 3 x 2 optimizer steps
    ("adaptive_entropy", ["objective.params.entropy_target=100.0", "objective.params.entropy_coef=0.01",
                          "objective.params.entropy_coef_delta=0.02"]),
    # a target below any KL: the error is clipped at +0.2, beta x (1 + 0.2 x 16 / 10) after each rollout step
    ("adaptive_kl", ["objective.params.beta=0.01", "objective.params.kl_target=1e-9",
                     "objective.params.kl_horizon=10"]),
])
def test_a_stateful_objective_moves_once_per_hook_and_a_killed_run_resumes_exactly(tmp_path, name, settings):
    """The loop calls after_optimizer_step after each of a step's optimizer steps and after_update once per rollout
    step (the final coefficient says how often); a run killed after step 2 of 3 and resumed has the same metrics, the
    same policy and the same state as the uninterrupted one."""
    # the random tiny policy solves nothing: the overlong penalty (rewards in [-1, 0]) gives the advantages something
    run = tiny_run(tmp_path, f"objective.name={name}", "train.steps=3", "task.overlong_buffer=6", *settings)
    full, part = full_and_resumed(train, run, tmp_path, step=3)
    assert [r["step"] for r in part] == [0, 1, 2, 3] and part == full
    a, b = (torch.load(tmp_path / d / "checkpoints" / "last.pt", weights_only=False) for d in ("full", "part"))
    assert a["objective"] == b["objective"]
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"])
    if name == "adaptive_entropy":
        assert a["objective"]["coefficient"] == pytest.approx(0.01 + 6 * 0.02, abs=1e-15)
        assert [r["adaptive_entropy_applied"] > 0 for r in full[1:]] == [True, True, True]  # from its 2nd update on
    else:
        assert a["objective"]["coefficient"] == pytest.approx(0.01 * 1.32 ** 3, rel=1e-12)
        assert [r["adaptive_kl_coef"] for r in full[1:]] == pytest.approx([0.01, 0.0132, 0.017424], rel=1e-12)


def stateful_example() -> str:
    """The documented stateful example (docs/objectives.md), so that the documented code is the tested one."""
    section = (REPO / "docs" / "objectives.md").read_text().partition("## Adding an objective with state of its own")[2]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block and "stateful = True" in block.group(1), "docs/objectives.md lost its stateful objective example"
    return block.group(1)


RESUME_TEST = """
import torch
import harness.apps
from harness.loop.native import train
from objectives import OBJECTIVES
from tests.helpers.interrupt import full_and_resumed
from tests.helpers.tiny import tiny_run


def test_{name}_resumes_exactly(tmp_path):
    assert OBJECTIVES.get("{name}").stateful and OBJECTIVES.get("{name}").__module__ == "objectives.{name}"
    run = tiny_run(tmp_path, "objective.name={name}", "objective.params.kl_target=1e-9", "train.steps=3",
                   "task.overlong_buffer=6")
    full, part = full_and_resumed(train, run, tmp_path, step=3)
    assert part == full and [r["ppo_kl_beta"] for r in full[1:]] == [0.04, 0.08, 0.16], full
    a, b = (torch.load(tmp_path / d / "checkpoints" / "last.pt", weights_only=False) for d in ("full", "part"))
    assert a["objective"] == b["objective"] == {{"coefficient": 0.32}}
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"])
"""


@pytest.mark.slow  # a copy of the package in a fresh interpreter: the registry-wide tests, then two tiny runs
def test_the_documented_stateful_example_passes_the_registry_tests_and_resumes_exactly(tmp_path):
    package = tmp_path / "objectives"
    shutil.copytree(REPO / "objectives", package, ignore=shutil.ignore_patterns("__pycache__"))
    source = stateful_example()
    name = re.search(r'@register_objective\("(\w+)"\)', source).group(1)
    (package / f"{name}.py").write_text(source)
    resume = tmp_path / "checks" / f"test_{name}_resume.py"  # its own folder: pytest collects nothing else there
    resume.parent.mkdir()
    resume.write_text(RESUME_TEST.format(name=name))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    tests = [str(REPO / "tests" / f) for f in ("test_objectives.py", "test_rollout_correction.py")]
    pytest_args = ["-q", "-rp", "-p", "no:cacheprovider", "--import-mode=append", "-c", str(REPO / "pyproject.toml"),
                   "--basetemp", str(tmp_path / "runs"), "-m", "not slow", "-k", name]
    done = subprocess.run([sys.executable, "-m", "pytest", *pytest_args, *tests, str(resume)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    # padding, micro-batching, equal rewards, ... and the resume
    assert int(re.search(r"(\d+) passed", done.stdout).group(1)) >= 11
    passed = [line for line in done.stdout.splitlines() if line.startswith("PASSED ")]
    assert any(line.endswith(f"::test_{name}_resumes_exactly") for line in passed), done.stdout[-3000:]
    assert name not in available_objectives()  # the real package is untouched
