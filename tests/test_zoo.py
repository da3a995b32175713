"""harness/apps/zoo.py: the zoo's runs come from the objective registry and the regime cells, each run once."""

from __future__ import annotations

import pytest

from harness.apps import zoo
from harness.apps.cli import main as cli_main
from harness.run.config import run_id
from objectives import OBJECTIVES, available_objectives


@pytest.fixture
def two_cells(monkeypatch):
    monkeypatch.setattr(zoo, "CELLS", {"quickstart": {}, "offpolicy": {"train.num_minibatches": [4, 16]}})


def test_every_registered_objective_each_cell_once(two_cells, monkeypatch):
    monkeypatch.setitem(OBJECTIVES._items, "grpo_copy", OBJECTIVES.get("grpo"))  # registered after the zoo
    objectives = available_objectives()
    assert "grpo_copy" in objectives
    folder, runs = zoo.zoo_runs(1, ["train.steps=2"])
    # quickstart's num_minibatches is 4: offpolicy's 4 is quickstart's cell, run once
    assert len(runs) == len(objectives) * 2 == len({run_id(r) for r in runs})
    assert {(r.objective.name, r.seed, r.train.num_minibatches) for r in runs} == {
        (o, s, m) for o in objectives for s in (0,) for m in (4, 16)}
    assert all(r.name == "zoo" and r.train.steps == 2 for r in runs) and folder.name == "zoo"
    assert set(folder.sweep.grid) == {"objective.name", "seed", "train.num_minibatches"}


@pytest.mark.parametrize("target", ["2", "0", "nan", "x"])
def test_a_target_accuracy_no_run_can_reach_is_refused_in_one_line(target, capsys):
    """`zoo --target 2` is refused before any run, not run to a tokens-to-target column left empty
    (docs/hostile_pass.md, case 132)."""
    with pytest.raises(SystemExit) as e:
        cli_main(["zoo", "--target", target, "--objectives", "grpo"])
    assert e.value.code == 2
    assert f"--target: must be an eval accuracy in (0, 1], got {target!r}" in capsys.readouterr().err


def test_a_setting_a_regime_cannot_take_names_the_regime(capsys):
    """Hostile pass cases 89 / 133: with 4 prompts a step, offpolicy's 16 minibatches leave conspo less than a group
    per minibatch; the one line names the regime that sets the minibatches, before anything starts."""
    assert cli_main(["zoo", "--objectives", "conspo", "--seeds", "1", "train.prompts_per_step=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: the zoo's regime 'offpolicy' "
                                                   "(train.num_minibatches=[16], experiments/offpolicy.yaml) with your "
                                                   "settings: objective 'conspo' compares the samples of a group"), err
