"""harness/apps/zoo.py: the zoo's runs come from the objective registry and the regime cells, each run once."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from harness.apps import stamp, sweep, zoo
from harness.apps.cli import main as cli_main
from harness.run.config import run_id
from harness.run.errors import ConfigError
from objectives import OBJECTIVES, available_objectives
from tests.helpers.tiny import TINY_SPEC

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def two_cells(monkeypatch):
    monkeypatch.setattr(zoo, "CELLS", {"quickstart": {}, "offpolicy": {"train.num_minibatches": [4, 16]}})


@pytest.mark.slow  # every objective x two cells validated (seconds): make test
def test_every_registered_objective_each_cell_once(two_cells, monkeypatch):
    monkeypatch.setitem(OBJECTIVES._items, "grpo_copy", OBJECTIVES.get("grpo"))  # registered after the zoo
    objectives = available_objectives()
    assert "grpo_copy" in objectives
    folder, runs = zoo.zoo_runs(1, ["train.steps=2"])
    # quickstart's num_minibatches is 4: offpolicy's 4 is quickstart's cell, run once
    assert len(runs) == len(objectives) * 2 == len({run_id(r) for r in runs})
    assert {(r.objective.name, r.seed, r.train.num_minibatches) for r in runs} == {
        (o, s, m) for o in objectives for s in (0,) for m in (4, 16)}
    assert all(r.name == "screen" and r.train.steps == 2 for r in runs) and folder.name == "screen"
    assert {r.results_dir for r in runs} == {folder.results_dir} and folder.results_dir.endswith("zoo")
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


CORE = ["grpo", "gspo", "gspo_token", "ctpo"]
BOARD = pd.DataFrame({"objective": ["grpo", "popo", "holder", "cispo", "gspo", "tbpo"],
                      "vs_baseline": [np.nan, 0.03, -0.05, 0.01, -0.01, 0.02],
                      "vs_baseline_low": [np.nan, 0.004, -0.07, -0.02, -0.04, np.nan],
                      "vs_baseline_high": [np.nan, 0.05, -0.03, 0.03, 0.01, np.nan]})


SCREEN = {"start_seeds": [1], "seeds": [0, 1, 2], "eval_set": 0}  # screen_design's record of the screen BOARD is


def a_plan(settings: dict) -> dict:
    """A plan as plan_confirmation writes it from BOARD and the screen SCREEN, read back from its JSON."""
    plan = zoo.plan_confirmation(BOARD, SCREEN["seeds"], SCREEN["start_seeds"], CORE, settings,
                                 {"landed": [2, 4, 5], "missed": {3: "warm start missed"}}, SCREEN["eval_set"])
    return json.loads(json.dumps(plan))


def test_the_plan_takes_the_screens_differences_and_the_core_on_fresh_policies_and_seeds():
    starts = {"landed": [2, 4, 5], "missed": {3: "warm start reached max_steps=3000 below its target band"}}
    plan = zoo.plan_confirmation(BOARD, [0, 1, 2], [1], CORE, {"overrides": []}, starts)
    registry = available_objectives()
    assert list(plan["objectives"]) == sorted(["grpo", "gspo", "gspo_token", "ctpo", "popo", "holder"],
                                              key=registry.index)
    assert plan["objectives"]["popo"] == "screen: 0.0300 [0.00400, 0.0500] vs grpo, excludes 0"
    assert plan["objectives"]["gspo"] == "core objective" and plan["objectives"]["grpo"] == "the baseline"
    assert set(plan["not_tested"]) == {"cispo", "tbpo"}  # tbpo: no interval, nothing excluded
    assert "includes 0" in plan["not_tested"]["cispo"]
    assert plan["start_seeds"] == [2, 4, 5] and plan["start_seeds_missed"] == starts["missed"]
    assert len(plan["seeds"]) >= 5 and not set(plan["seeds"]) & {0, 1, 2}  # seeds the screen never used
    assert plan["correction"] == {"method": "holm", "alpha": 0.05, "size": 5,
                                  "family": [f"{o} - grpo" for o in plan["objectives"] if o != "grpo"]}
    assert plan["cells"] == zoo.CELLS and plan["screen"] == {"start_seeds": [1], "seeds": [0, 1, 2], "eval_set": 0}
    assert plan["eval_set"] == 1  # eval problems the screen never saw
    assert zoo.plan_confirmation(BOARD, [0, 1, 2], [1], CORE, {"overrides": []}, starts, 2)["eval_set"] == 3
    one_set = zoo.plan_confirmation(BOARD, [0, 1, 2], [1], CORE, {"overrides": []}, starts, None)
    assert one_set["eval_set"] is None and "the task has one held-out set" in zoo.plan_text(one_set, 300)
    text = zoo.plan_text(plan, 300)
    assert "Eval problems: task.eval_set 1, none of them the screen's (set 0) or a train problem" in text
    assert "Holm's step-down over the family of 5 comparisons" in text and "- cispo: screen:" in text
    assert "(model.seed [2, 4, 5])" in text and "model.seed 3 was passed over: warm start reached max_steps" in text


def _building(monkeypatch, misses=()):
    """Stands in for the processes that build starting policies, one after another in the order offered until
    ``enough`` says so: records the model.seed values built, per call; those in ``misses`` miss their band (their
    log's last line, as `python -m harness prepare` writes it)."""
    calls = []

    def prepare_through(pending, runner, progress, at_once, missed_ok=False, enough=None, write_config=False):
        assert missed_ok and at_once == 2 and write_config
        built, done = [], {}
        calls.append(built)
        for run, folder in pending:
            assert folder.name == f"model_seed_{run.model.seed}"
            sweep._write_config(run, folder)
            built.append(int(run.model.seed))
            if run.model.seed in misses:
                (folder / "train.log").write_text(f"building\nerror: warm start of {run.model.seed} missed\n")
            done[folder] = run.model.seed not in misses
            if enough is not None and enough(done):
                break
        return [folder for folder, landed in done.items() if not landed]

    monkeypatch.setattr(sweep, "prepare_through", prepare_through)
    return calls


@pytest.mark.slow  # expands the zoo's stages round by round: make test
@pytest.mark.parametrize("misses, built, landed", [((), [1, 2, 3, 4], [2, 3, 4]),
                                                   ((3,), [1, 2, 3, 4, 5], [2, 4, 5]),
                                                   ((2, 5), [1, 2, 3, 4, 5, 6], [3, 4, 6])])
def test_the_confirmation_takes_the_first_starting_policies_that_land_in_their_band(misses, built, landed,
                                                                                    monkeypatch, tmp_path):
    """A starting policy whose warm start misses its band on this CPU is passed over, in order, for the next
    candidate (the screen's and every candidate offered in order, in one call: the builds stop once enough have
    landed), and its error is kept for the plan."""
    calls = _building(monkeypatch, misses)
    overrides = [f"results_dir={tmp_path}"]
    _, screen_runs = zoo.zoo_runs(1, overrides, ["grpo"])
    starts = zoo.confirm_start_seeds(overrides, 2, False, screen_runs)
    assert calls == [built] and starts["landed"] == landed
    assert starts["missed"] == {seed: f"warm start of {seed} missed" for seed in misses}
    record = json.loads((tmp_path / "zoo" / "prepare" / sweep.START_POLICIES).read_text())
    assert record["landed"] == landed and record["missed"] == {str(s): e for s, e in starts["missed"].items()}


@pytest.mark.slow  # expands the zoo's stages round by round: make test
def test_the_screens_policy_or_too_few_landing_stop_the_zoo(monkeypatch, tmp_path):
    from harness.policy.warm_start import WarmStartError

    overrides = [f"results_dir={tmp_path}"]
    _, screen_runs = zoo.zoo_runs(1, overrides, ["grpo"])
    _building(monkeypatch, misses=(1,))
    with pytest.raises(WarmStartError, match="a starting policy that must land missed its band, model.seed 1: warm "
                                             "start of 1 missed"):
        zoo.confirm_start_seeds(overrides, 2, False, screen_runs)
    built = _building(monkeypatch, misses=zoo.START_CANDIDATES[1:])
    with pytest.raises(WarmStartError, match=r"only 1 of model.seed \[2, 3, .*\] reached .* \(3 wanted\): 3: warm "
                                             r"start"):
        zoo.confirm_start_seeds(overrides, 2, False, screen_runs)
    assert sum(built, []) == [1, *zoo.START_CANDIDATES]  # every candidate tried once


@pytest.fixture
def one_cell(monkeypatch, tmp_path):
    """One regime cell, results under tmp_path, a finished screen whose leaderboard is BOARD; the confirmation's
    sweep and leaderboard recorded, not run."""
    monkeypatch.setattr(zoo, "CELLS", {"offpolicy": {"train.num_minibatches": [16]}})
    screen = tmp_path / "zoo" / "screen"
    screen.mkdir(parents=True)
    (screen / "manifest.json").write_text(json.dumps({"runs": [{"run_id": "x", "status": "finished"}]}))
    monkeypatch.setattr(zoo, "load_results", lambda folder: SimpleNamespace(runs=None))
    monkeypatch.setattr(zoo, "check_screen", lambda *args: None)  # the screen's runs are not made here
    monkeypatch.setattr(zoo, "leaderboard", lambda exp, target, baseline: BOARD)
    calls = []

    def swept(cfg, runs, *args):
        calls.append((cfg.name, len(runs), (tmp_path / "zoo" / "confirm" / "plan.json").is_file(),
                      sorted({int(run.task.eval_set) for run in runs})))
        return [], "stamp", SimpleNamespace(kept=False)

    monkeypatch.setattr(zoo, "swept", swept)
    monkeypatch.setattr(zoo, "write_confirmation", lambda *args: tmp_path / "leaderboard.md")
    monkeypatch.setattr(zoo, "confirm_start_seeds", lambda *args: {"landed": [2, 3, 4], "missed": {}})
    return tmp_path, calls


@pytest.mark.slow  # three confirmations planned (seconds): make test
def test_the_plan_is_written_before_the_confirmation_runs_and_kept(one_cell):
    tmp_path, calls = one_cell
    overrides = [f"results_dir={tmp_path}", "train.steps=2"]
    assert zoo.confirm(3, 1, 0.4, overrides, False, ["grpo", "popo", "cispo"], False, 3) == 0
    plan = json.loads((tmp_path / "zoo" / "confirm" / "plan.json").read_text())
    assert list(plan["objectives"]) == ["grpo", "popo"]  # the core within --objectives, and popo's difference
    assert calls == [("confirm", 2 * 3 * 5, True, [1])]  # 2 objectives x 3 policies x 5 seeds in the one cell, on
    # the eval set after the screen's
    assert (tmp_path / "zoo" / "confirm" / "plan.md").is_file()
    written = (tmp_path / "zoo" / "confirm" / "plan.json").read_text()
    assert zoo.confirm(3, 1, 0.4, overrides, False, ["grpo", "popo", "cispo"], False, 3) == 0  # resumed
    assert (tmp_path / "zoo" / "confirm" / "plan.json").read_text() == written and calls[-1][3] == [1]
    old = {k: v for k, v in json.loads(written).items() if k != "eval_set"}  # a plan from before eval sets
    (tmp_path / "zoo" / "confirm" / "plan.json").write_text(json.dumps(old))
    assert zoo.confirm(3, 1, 0.4, overrides, False, ["grpo", "popo", "cispo"], False, 3) == 0
    assert calls[-1][3] == [0]  # resumed on the screen's problems, as its runs began
    with pytest.raises(ConfigError, match="was made with other settings"):
        zoo.confirm(3, 1, 0.4, [*overrides, "train.lr=1e-4"], False, ["grpo", "popo", "cispo"], False, 3)
    with pytest.raises(ConfigError, match="was made with other settings"):  # 5 starting policies: another plan
        zoo.confirm(3, 1, 0.4, overrides, False, ["grpo", "popo", "cispo"], False, 5)


@pytest.mark.slow  # a confirmation planned (seconds): make test
def test_a_confirmation_on_a_task_with_one_held_out_set_is_scored_on_the_screens(one_cell, monkeypatch):
    tmp_path, calls = one_cell
    monkeypatch.setattr(zoo, "has_eval_sets", lambda name: False)  # as reasoning_gym or a task of the user's
    assert zoo.confirm(3, 1, 0.4, [f"results_dir={tmp_path}", "train.steps=2"], False, ["grpo", "popo"], False, 3) == 0
    assert json.loads((tmp_path / "zoo" / "confirm" / "plan.json").read_text())["eval_set"] is None
    assert calls == [("confirm", 2 * 3 * 5, True, [0])]


@pytest.mark.slow
def test_the_confirmation_is_planned_only_from_the_screen_its_settings_make(tmp_path, monkeypatch):
    """A screen of other --seeds, --objectives or overrides (the runs of its folder that ended) is refused in one line,
    not planned from and recorded as the screen of these settings; runs of objectives not compared do not count."""
    monkeypatch.setattr(zoo, "CELLS", {"offpolicy": {"train.num_minibatches": [16]}})
    overrides = [f"results_dir={tmp_path}", "train.steps=2"]
    pair = ["grpo", "gspo"]

    def frame(runs, ended=True):
        return pd.DataFrame({"run_id": [run_id(r) for r in runs], "objective": [r.objective.name for r in runs],
                             "ended": ended})

    three, one = zoo.zoo_runs(3, overrides, pair)[1], zoo.zoo_runs(1, overrides, pair)[1]
    zoo.check_screen(frame(three), three, pair, tmp_path)
    cispo = zoo.zoo_runs(1, overrides, ["cispo"])[1]
    zoo.check_screen(pd.concat([frame(three), frame(cispo)]), three, pair, tmp_path)  # not compared
    with pytest.raises(ConfigError, match=rf"^{tmp_path} is not the screen these settings make: 4 of its 6 runs "
                                          r"have not ended there \(e.g. .*\) and 0 ended runs"):
        zoo.check_screen(frame(one), three, pair, tmp_path)  # the screen ran --seeds 1, this says 3
    with pytest.raises(ConfigError, match="6 of its 6 runs have not ended"):
        zoo.check_screen(frame(three, ended=False), three, pair, tmp_path)
    with pytest.raises(ConfigError, match=r"0 of its 2 runs have not ended there and 4 ended runs there are not"):
        zoo.check_screen(frame(three), one, pair, tmp_path)
    with pytest.raises(ConfigError, match="give the screen's --seeds, --objectives and overrides"):
        zoo.check_screen(frame(three), zoo.zoo_runs(3, [*overrides, "train.lr=1e-4"], pair)[1], pair, tmp_path)


@pytest.mark.parametrize("text", ["{garbage", "[]", "\udcff"])
def test_an_unreadable_plan_is_one_line_naming_it(tmp_path, text):
    """A plan.json that is not a JSON object (damaged, or another file's): one line, not a traceback."""
    (tmp_path / "plan.json").write_text(text, errors="surrogateescape")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'plan.json'}: unreadable \(.*\); remove {tmp_path} to plan"):
        zoo.read_plan(tmp_path, {}, SCREEN)


def test_a_plan_is_read_under_the_same_settings_in_another_order(tmp_path):
    """--objectives gspo,grpo, or the overrides swapped, make the same runs: the plan made under grpo,gspo was refused,
    with the advice to remove the confirmation's folder, its finished runs included (the twenty-third hostile pass)."""
    made = zoo.plan_settings(["train.steps=17", "train.eval_every=17"], 3, ["grpo", "gspo"], 3)
    plan = a_plan(made)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    for overrides, objectives in ((["train.eval_every=17", "train.steps=17"], ["gspo", "grpo"]),
                                  (["train.steps=5", "train.eval_every=17", "train.steps=17"], ["grpo", "gspo"])):
        assert zoo.read_plan(tmp_path, zoo.plan_settings(overrides, 3, objectives, 3), SCREEN) == plan
    for overrides, objectives in ((["train.steps=18", "train.eval_every=17"], ["grpo", "gspo"]),
                                  (["train.steps=17", "train.eval_every=17"], ["grpo", "gspo", "cispo"]),
                                  (["train.steps=17"], ["grpo", "gspo"])):
        with pytest.raises(ConfigError, match="was made with other settings"):
            zoo.read_plan(tmp_path, zoo.plan_settings(overrides, 3, objectives, 3), SCREEN)


def refused_plan(folder: Path) -> str:
    """The start and the end of read_plan's one line for a plan it will not run (a pattern around the problem)."""
    return (rf"^{re.escape(str(folder / 'plan.json'))}: (?P<problem>[^\n]*); the confirmation runs only the plan "
            rf"written from its screen, not a damaged or edited one: remove {re.escape(str(folder))} to plan the "
            "confirmation again from the screen$")


@pytest.mark.parametrize("edit, problem", [
    (lambda plan: {"settings": plan["settings"]}, "'objectives' is missing, not a JSON object of objective names"),
    (lambda plan: {**plan, "objectives": ["grpoo"]}, "'objectives' is [\"grpoo\"], not a JSON object"),
    (lambda plan: {**plan, "objectives": {"grpo": "the baseline", "grpoo": "core"}},
     "'objectives' names 'grpoo', not a registered objective"),
    (lambda plan: {**plan, "baseline": "gspo"}, "'baseline' is \"gspo\": the zoo's is 'grpo'"),
    (lambda plan: {k: v for k, v in plan.items() if k != "not_tested"}, "'not_tested' is not a JSON object"),
    (lambda plan: {**plan, "start_seeds": "2,3"}, "'start_seeds' is \"2,3\", not a list of distinct whole numbers"),
    (lambda plan: {**plan, "seeds": [3, 3, 4]}, "'seeds' is [3, 3, 4], not a list of distinct whole numbers"),
    (lambda plan: {**plan, "seeds": [[3], 4]}, "'seeds' is [[3], 4], not a list"),
    (lambda plan: {**plan, "seeds": [3, True]}, "'seeds' is [3, true], not a list"),
    (lambda plan: {**plan, "cells": {}}, "'cells' is {}, not the zoo's regime cells"),
    (lambda plan: {**plan, "correction": {**plan["correction"], "size": 1}}, "'correction' is not Holm's over the 5"),
    (lambda plan: {k: v for k, v in plan.items() if k != "written"}, "'rule' or 'written' is not a text"),
    (lambda plan: {**plan, "eval_set": "1"}, "'eval_set' is \"1\", not a whole number other than the screen's (0)"),
])
def test_a_damaged_plan_is_refused_in_one_line_naming_it(edit, problem, tmp_path):
    """A plan.json whose settings match but that lacks a key the confirmation reads, or holds one of another type,
    was a KeyError's traceback (or a value blamed on "your settings"): one line naming plan.json, the key and how to
    plan again, as for an unreadable plan."""
    settings = zoo.plan_settings([], 3, None, 3)
    (tmp_path / "plan.json").write_text(json.dumps(edit(a_plan(settings))))
    with pytest.raises(ConfigError) as e:
        zoo.read_plan(tmp_path, settings, SCREEN)
    assert re.match(refused_plan(tmp_path), str(e.value))["problem"].startswith(problem), str(e.value)


@pytest.mark.parametrize("edit, problem", [
    ({"start_seeds": [1], "seeds": [0]}, "'start_seeds' [1] holds the screen's starting policies (model.seed) [1]: the "
                                         "confirmation's are none of the screen's"),
    ({"seeds": [2, 3]}, "'seeds' [2, 3] holds the screen's seeds [2]: the confirmation's are none of the screen's"),
    ({"eval_set": 0}, "'eval_set' is 0, not a whole number other than the screen's (0): the confirmation's eval "
                      "problems are none of the screen's"),
    ({"eval_set": None}, "'eval_set' is null, not a whole number other than the screen's (0): the confirmation's "
                         "eval problems are none of the screen's"),
    ({"start_seeds": [1], "screen": {"start_seeds": [9], "seeds": [0, 1, 2], "eval_set": 0}},
     "'screen' is {\"start_seeds\": [9], \"seeds\": [0, 1, 2], \"eval_set\": 0}, not the screen these settings make "
     "({\"start_seeds\": [1], \"seeds\": [0, 1, 2], \"eval_set\": 0})"),
])
def test_a_plan_on_the_screens_policies_seeds_or_problems_is_refused(edit, problem, tmp_path):
    """An edited plan.json naming the screen's own starting policy and seed ran the confirmation on the screen's
    data: the design promises starting policies, seeds and eval problems none of the screen's. Its record of the
    screen is checked against the screen these settings make, so it cannot be edited to hide one."""
    settings = zoo.plan_settings([], 3, None, 3)
    (tmp_path / "plan.json").write_text(json.dumps({**a_plan(settings), **edit}))
    with pytest.raises(ConfigError) as e:
        zoo.read_plan(tmp_path, settings, SCREEN)
    assert re.match(refused_plan(tmp_path), str(e.value))["problem"] == problem, str(e.value)


def test_a_plan_from_before_eval_sets_or_on_a_task_with_one_held_out_set_is_read(tmp_path):
    """Refusing the screen's eval problems leaves the plans that honestly use them: one made before the confirmation
    had eval problems of its own (no eval_set; its text says so), one on a task with a single held-out set."""
    settings = zoo.plan_settings([], 3, None, 3)
    old = {k: v for k, v in a_plan(settings).items() if k != "eval_set"}
    old["screen"] = {k: v for k, v in old["screen"].items() if k != "eval_set"}
    (tmp_path / "plan.json").write_text(json.dumps(old))
    assert zoo.read_plan(tmp_path, settings, SCREEN) == old
    one_set = {**a_plan(settings), "eval_set": None, "screen": {**SCREEN, "eval_set": None}}
    (tmp_path / "plan.json").write_text(json.dumps(one_set))
    assert zoo.read_plan(tmp_path, settings, {**SCREEN, "eval_set": None}) == one_set


def test_a_damaged_or_edited_plan_stops_zoo_confirm_in_one_line(monkeypatch, tmp_path, capsys):
    """`zoo --stage confirm` with a plan.json of the matching settings and no other key: a KeyError's traceback; with
    the screen's starting policy and seed: the confirmation ran on them. Now one line, status 2, nothing run."""
    monkeypatch.setattr(zoo, "swept", lambda *a: pytest.fail("the confirmation ran"))
    overrides = [f"results_dir={tmp_path}"]
    folder = tmp_path / "zoo" / "confirm"
    folder.mkdir(parents=True)
    settings = zoo.plan_settings(overrides, 1, ["grpo"], zoo.CONFIRM_START_POLICIES)
    screen = {"start_seeds": [1], "seeds": [0], "eval_set": 0}  # the screen of these settings (the regimes' model.seed)
    plan = json.loads(json.dumps(zoo.plan_confirmation(BOARD[BOARD["objective"] == "grpo"], screen["seeds"],
                                                       screen["start_seeds"], ["grpo"], settings,
                                                       {"landed": [2, 3, 4], "missed": {}}, screen["eval_set"])))
    for damaged, problem in (({"settings": settings}, "'objectives' is missing"),
                             ({**plan, "start_seeds": screen["start_seeds"], "seeds": screen["seeds"]},
                              "'start_seeds' [1] holds the screen's starting policies")):
        (folder / "plan.json").write_text(json.dumps(damaged))
        assert cli_main(["zoo", "--stage", "confirm", "--objectives", "grpo", "--seeds", "1", *overrides]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.match(refused_plan(folder), err.removeprefix("config error: ").strip()), err
        assert problem in err


@pytest.mark.slow  # two confirmations planned (seconds): make test
def test_a_removed_plan_md_is_written_again_from_plan_json_before_the_runs(one_cell, monkeypatch, capsys):
    """A plan.md removed after the plan was written was never written again: the confirmation ran, and the terminal
    and the leaderboard named the missing file as the plan written before it ran. Now its text is written again from
    plan.json (the text written before the runs, byte for byte), before any run, and said in one line."""
    tmp_path, calls = one_cell
    args = (3, 1, 0.4, [f"results_dir={tmp_path}", "train.steps=2"], False, ["grpo", "popo"], False, 3)
    assert zoo.confirm(*args) == 0
    md = tmp_path / "zoo" / "confirm" / "plan.md"
    written = md.read_text()
    md.unlink()
    capsys.readouterr()
    swept = zoo.swept
    monkeypatch.setattr(zoo, "swept", lambda *a: (calls.append(md.is_file()), swept(*a))[1])
    assert zoo.confirm(*args) == 0
    assert md.read_text() == written and calls[-2] is True  # there before the sweep
    err = capsys.readouterr().err
    assert f"zoo confirmation: {md} was missing; written again from {md.with_name('plan.json')} (the plan made " in err


@pytest.mark.parametrize("linked", ["zoo", "zoo/screen", "zoo/confirm", "zoo/prepare"])
def test_a_linked_zoo_folder_is_refused_before_anything_is_written(linked, monkeypatch, tmp_path):
    """results/zoo (or a stage's folder in it) a link to a folder of the user's holding their own leaderboard.md: the
    screen wrote its runs there and the confirmation replaced that leaderboard.md through the link. Now one line
    before anything starts, as a linked report folder is refused (harness/run/atomic.py write_into)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "leaderboard.md").write_text("my own\n")
    link = tmp_path / "results" / linked
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(mine)
    done = []
    monkeypatch.setattr(zoo, "confirm_start_seeds", lambda *a: done.append("prepare"))
    monkeypatch.setattr(zoo, "swept", lambda *a: done.append("screen") or ([], "stamp", None))
    monkeypatch.setattr(zoo, "write_leaderboard", lambda *a: done.append("screen leaderboard"))
    monkeypatch.setattr(zoo, "confirm", lambda *a: done.append("confirm") or 0)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(link))} is a symbolic link \(to {re.escape(str(mine))}\), "
                                          r"which the harness did not make: the zoo does not write .* through links; "
                                          r"remove the link, or give another results_dir=\.\.\.$"):
        zoo.main(1, 1, overrides=[f"results_dir={tmp_path / 'results'}"], progress=False, report=False,
                 objectives=["grpo"])
    assert done == [] and [p.name for p in mine.iterdir()] == ["leaderboard.md"]
    assert (mine / "leaderboard.md").read_text() == "my own\n"


@pytest.mark.slow  # two confirmations planned (seconds): make test
def test_an_edited_plan_md_is_said_before_the_runs_and_kept(one_cell, capsys):
    """An edited plan.md was named as the plan by the terminal and the leaderboard without a word, while plan.json
    ran: an objective struck out there was still run and compared. Now one line says so before any run, and the
    user's text is left as it is."""
    tmp_path, calls = one_cell
    args = (3, 1, 0.4, [f"results_dir={tmp_path}", "train.steps=2"], False, ["grpo", "popo"], False, 3)
    assert zoo.confirm(*args) == 0
    md = tmp_path / "zoo" / "confirm" / "plan.md"
    edited = md.read_text().replace("- popo:", "- (struck out) popo:")
    md.write_text(edited)
    capsys.readouterr()
    assert zoo.confirm(*args) == 0
    err = capsys.readouterr().err
    assert f"zoo confirmation: {md} is not the text of the plan {md.with_name('plan.json')} holds" in err
    assert err.index("is not the text of the plan") < err.index("zoo confirmation: 30 runs")  # before the runs
    assert md.read_text() == edited and calls[-1][1] == 2 * 3 * 5  # kept; popo still run, as plan.json says
    md.unlink()
    assert zoo.confirm(*args) == 0 and "is not the text" not in capsys.readouterr().err  # written again: the plan's


def test_no_plan_from_a_screen_that_did_not_end(one_cell):
    tmp_path, calls = one_cell
    (tmp_path / "zoo" / "screen" / "manifest.json").write_text(json.dumps({"runs": [{"status": "failed"}]}))
    with pytest.raises(ConfigError, match="run `make zoo STAGE=screen` first"):
        zoo.confirm(3, 1, 0.4, [f"results_dir={tmp_path}"], False, ["grpo"], False, 3)
    assert not calls and not (tmp_path / "zoo" / "confirm").exists()


@pytest.mark.parametrize("stage, ran", [("screen", ["screen"]), ("confirm", ["confirm"]),
                                        ("both", ["prepare", "screen", "confirm"])])
def test_a_stage_runs_alone_or_both_in_order(stage, ran, monkeypatch, tmp_path):
    done = []
    monkeypatch.setattr(zoo, "confirm_start_seeds", lambda *a: done.append("prepare"))
    monkeypatch.setattr(zoo, "swept", lambda cfg, *a: (done.append("screen"), ([], "stamp", None))[1])
    monkeypatch.setattr(zoo, "write_leaderboard", lambda *a: tmp_path / "screen.md")
    monkeypatch.setattr(zoo, "confirm", lambda *a: done.append("confirm") or 0)
    assert zoo.main(1, 1, overrides=[f"results_dir={tmp_path}"], progress=False, report=False, objectives=["grpo"],
                    stage=stage) == 0
    assert done == ran


def test_make_zoo_passes_the_stage_and_the_zoo_sets_its_own_seeds():
    out = subprocess.run(["make", "-n", "--no-print-directory", "zoo", "STAGE=screen"], cwd=ROOT, capture_output=True,
                         text=True)
    assert "--stage screen" in out.stdout
    out = subprocess.run(["make", "-n", "--no-print-directory", "zoo", "START_POLICIES=5"], cwd=ROOT,
                         capture_output=True, text=True)
    assert "--start-policies 5" in out.stdout
    for bad in (1, len(zoo.START_CANDIDATES) + 1):
        with pytest.raises(ConfigError, match="--start-policies must be 2 to"):
            zoo.main(start_policies=bad, stage="screen")
    for override in ("seed=4", "model.seed=2", "objective.name=gspo", "sweep.grid.seed=[0]"):
        with pytest.raises(ConfigError, match="the zoo sets the objectives"):
            zoo.main(overrides=[override], stage="screen")
    # an axis of a regime was refused as 'given twice on the command line' (the zoo's grid is not the user's), the
    # advice naming make compare; a name was dropped without a word (the twenty-third hostile pass)
    for override, why in (("train.rollout_lag=1", "an axis of its async_staleness regime"), ("name=mine", "folder")):
        with pytest.raises(ConfigError, match=rf"^{override}: the zoo sets {override.partition('=')[0]} itself "
                                              rf"\(.*{why}.*\); leave it out$"):
            zoo.main(overrides=[override], stage="screen")



def ending_every_run(folder: Path):
    """A stand-in for run_sweep that ends every run in ``folder`` (or finds it ended)."""
    def run_sweep(cfg, runs, **kwargs):
        for run in runs:
            (folder / run_id(run)).mkdir(parents=True, exist_ok=True)
            (folder / run_id(run) / "summary.json").write_text(json.dumps({"status": "finished"}))
        return [{"status": "finished"}] * len(runs)

    return run_sweep


def test_a_stage_found_ended_keeps_the_stamp_of_the_command_that_ran_it(two_cells, monkeypatch, tmp_path):
    """A zoo command run again after a stage ended (the confirmation after the screen, `make docs WITH_ZOO=1` after
    `STAGE=screen`) must not stamp the stage with the seconds it took to find its runs ended."""
    cfg, runs = zoo.zoo_runs(1, [f"results_dir={tmp_path}", "train.steps=2"], ["grpo"])
    folder = tmp_path / "zoo" / "screen"
    clock = iter([0.0, 600.0, 1000.0, 1001.0, 2000.0, 2002.0, 3000.0, 3001.0])
    monkeypatch.setattr(stamp, "time", SimpleNamespace(perf_counter=lambda: next(clock)))  # the timing's clock

    monkeypatch.setattr(zoo, "run_sweep", ending_every_run(folder))
    _, first, _ = zoo.swept(cfg, runs, 2, False, False, "`make zoo STAGE=screen`")
    assert "run or resumed in 10.0 min" in first and "had ended before" not in first
    _, again, _ = zoo.swept(cfg, runs, 2, False, False, "`make zoo STAGE=screen`")  # every run ended: the first
    # command's stamp
    assert again.startswith(first) and "run or resumed in 10.0 min" in again
    assert "found every run ended" in again and "found every run ended" not in first
    (folder / run_id(runs[0]) / "summary.json").unlink()  # one run left to do: resumed, said so
    _, resumed, _ = zoo.swept(cfg, runs, 2, False, False, "`make zoo STAGE=screen`")
    assert "in 0.0 min" in resumed and f"{len(runs) - 1} of them had ended before" in resumed
    # other runs than the stamp's (a subset): not its stamp
    _, fewer, _ = zoo.swept(cfg, runs[1:], 2, False, False, "`make zoo STAGE=screen`")
    assert "found every run ended" not in fewer and "in 0.0 min" in fewer


def test_a_stamp_names_the_command_that_ran_with_its_options():
    """Every stage's stamp said `make zoo STAGE=screen` (or `make zoo`) whatever ran: other seeds, objectives,
    starting policies, target or overrides. Settings that change no run (results_dir, name, logging) are left out."""
    unread = ["results_dir=/tmp/x", "logging.wandb.project=p"]  # change no run
    defaults = ("screen", zoo.SEEDS, None, unread, zoo.CONFIRM_START_POLICIES, zoo.TARGET)
    assert zoo.zoo_command(*defaults) == "`make zoo STAGE=screen`"
    assert zoo.zoo_command("both", *defaults[1:]) == "`make zoo`"
    assert zoo.zoo_command("screen", 2, ["grpo", "gspo"], ["train.steps=17", "results_dir=/tmp/x", "name=z"], 4,
                           0.5) == ("`python -m harness zoo --stage screen --seeds 2 --objectives grpo,gspo "
                                    "--start-policies 4 --target 0.5 train.steps=17`")
    assert zoo.zoo_command("both", 2, None, [], zoo.CONFIRM_START_POLICIES, zoo.TARGET) == \
        "`python -m harness zoo --seeds 2`"


def test_a_stage_that_did_not_end_keeps_no_stamp(two_cells, monkeypatch, tmp_path):
    cfg, runs = zoo.zoo_runs(1, [f"results_dir={tmp_path}", "train.steps=2"], ["grpo"])
    monkeypatch.setattr(zoo, "run_sweep", lambda cfg, runs, **kwargs: [{"status": "failed"}] * len(runs))
    (tmp_path / "zoo" / "screen").mkdir(parents=True)
    zoo.swept(cfg, runs, 2, False, False, "`make zoo STAGE=screen`")
    assert not (tmp_path / "zoo" / "screen" / stamp.KEPT).exists()  # its stamp would not be the whole stage's


@pytest.mark.slow  # two tiny warm starts side by side, built then loaded: four processes
def test_both_stages_starting_policies_are_built_before_the_screen_side_by_side(monkeypatch, tmp_path):
    """`make zoo` builds the screen's and the confirmation's starting policies before the screen's first run, each
    in a process of its own (its config and log under results/zoo/prepare/), into the cache the runs load from
    (one confirmation policy here: each process costs its imports; how many are taken is test_zoo's fast tests')."""
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(zoo, "CONFIRM_START_POLICIES", 1)
    overrides = [f"results_dir={tmp_path}", "model.warm_start_steps=3", "model.warm_start_target=null",
                 *(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items())]
    _, runs = zoo.zoo_runs(1, overrides, ["grpo"])
    zoo.confirm_start_seeds(overrides, 2, False, runs)
    seeds = [1, *zoo.START_CANDIDATES[: zoo.CONFIRM_START_POLICIES]]  # none misses: no band
    logs = {seed: (tmp_path / "zoo" / "prepare" / f"model_seed_{seed}" / "train.log").read_text() for seed in seeds}
    assert all("starting policy: building it once" in log for log in logs.values())
    assert len(list((tmp_path / "cache" / "warm_start").glob("*.safetensors"))) == len(seeds)
    zoo.confirm_start_seeds(overrides, 2, False, runs)  # again: each loaded from the cache
    assert all("starting policy: loaded" in (tmp_path / "zoo" / "prepare" / f"model_seed_{seed}" / "train.log"
                                             ).read_text() for seed in seeds)


def test_a_plan_made_with_other_settings_is_refused_before_the_screen_runs(monkeypatch, tmp_path):
    """A zoo resumed with another --start-policies ran (or rewrote) its screen first, then refused in one 1,000-
    character line dumping both settings; now refused first, naming only what differs."""
    overrides = [f"results_dir={tmp_path}"]
    folder = tmp_path / "zoo" / "confirm"
    folder.mkdir(parents=True)
    (folder / "plan.json").write_text(json.dumps({"settings": {"overrides": overrides, "seeds": 1,
                                                               "objectives": ["grpo"]}}))
    ran = []
    monkeypatch.setattr(zoo, "swept", lambda *a: ran.append("screen") or ([], "stamp", None))
    with pytest.raises(ConfigError, match=r"was made with other settings \(start_policies None there, 5 now\): "):
        zoo.main(1, 1, overrides=overrides, progress=False, report=False, objectives=["grpo"], start_policies=5)
    assert ran == []


def test_the_whole_zoo_is_timed_from_its_command_start_and_kept_only_for_its_own_runs(monkeypatch, tmp_path):
    """`make zoo` of both stages from a results folder without them states its whole time, the starting policies it
    built (sidecars written since it began) and its load; a command that finds every run ended repeats those figures
    as that command's; a resumed zoo (a confirmation with runs ended before), other runs, or a damaged record state
    none, and a resumed confirmation leaves the kept record as it was."""
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "warm_start"
    cache.mkdir(parents=True)
    began = (datetime(2026, 1, 2, 3, 4, 5, 600000, tzinfo=UTC), 100.0, 0.5)
    for name, at in (("old.json", "2026-01-02T03:04:04+00:00"), ("a.json", "2026-01-02T03:04:05+00:00"),
                     ("b.missed.json", "2026-01-02T05:00:00+00:00"), ("naive.json", "2026-01-02T05:00:00")):
        (cache / name).write_text(json.dumps({"built_at": at}))  # a time without its zone: not a sidecar
    (cache / "c.json").write_text("[1, 2]")  # not a sidecar: not counted
    monkeypatch.setattr(zoo, "time", SimpleNamespace(perf_counter=lambda: 100.0 + 87 * 60))
    monkeypatch.setattr(zoo, "os", SimpleNamespace(getloadavg=lambda: (2.25, 0, 0)))
    monkeypatch.setattr(zoo, "machine", lambda jobs: f"a CPU, {jobs} runs at a time")
    ran, resumed, found = (SimpleNamespace(before=b, kept=k) for b, k in ((0, False), (1, False), (2, True)))
    other = zoo.whole_stamp(tmp_path, ["r2", "r1"], began, ran, 2, "`python -m harness zoo --seeds 2`")
    assert other.startswith("`python -m harness zoo --seeds 2`, both stages from a results folder without them")
    assert zoo.whole_stamp(tmp_path, ["r1", "r2"], None, found, 1).startswith(other)  # kept with its figures
    text = zoo.whole_stamp(tmp_path, ["r2", "r1"], began, ran, 2)
    assert text == ("`make zoo`, both stages from a results folder without them, in one command: 87.0 min, the 2 "
                    "starting-policy builds it made into the cache included (1 of them missed their band, passed over; "
                    "the policies the cache held were loaded) (1-minute load average 0.50 before, 2.25 after). "
                    "Machine: a CPU, 2 runs at a time.")
    kept = (tmp_path / zoo.WHOLE).read_text()
    assert zoo.whole_stamp(tmp_path, ["r1", "r2"], None, found, 1) == text + (
        " These are the figures of the command that ran them all; this one found every run ended.")
    assert zoo.whole_stamp(tmp_path, ["r1", "r2"], None, resumed, 1) == ""  # resumed: no whole time
    assert zoo.whole_stamp(tmp_path, ["r1", "r2"], began, resumed, 1) == ""  # the confirmation resumed
    assert (tmp_path / zoo.WHOLE).read_text() == kept  # ... and the record kept as it was
    assert zoo.whole_stamp(tmp_path, ["r1"], None, found, 1) == ""  # other runs than the figures'
    for damaged in ("{not json", json.dumps({"runs": ["r1", "r2"]}), json.dumps({**json.loads(kept), "wall_s": "5"}),
                    json.dumps({**json.loads(kept), "command": 5})):
        (tmp_path / zoo.WHOLE).write_text(damaged)
        assert zoo.whole_stamp(tmp_path, ["r1", "r2"], None, found, 1) == ""


def test_a_stage_that_runs_any_run_removes_the_kept_whole_time(two_cells, monkeypatch, tmp_path):
    """A whole time names the command that ran both stages; a later command that runs any run of a stage again (the
    screen removed and run alone, then the confirmation found ended) must not leave it to be repeated."""
    cfg, runs = zoo.zoo_runs(1, [f"results_dir={tmp_path}", "train.steps=2"], ["grpo"])
    folder = tmp_path / "zoo" / "screen"

    monkeypatch.setattr(zoo, "run_sweep", ending_every_run(folder))
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / zoo.WHOLE).write_text("{}")
    zoo.swept(cfg, runs, 2, False, False, "`make zoo STAGE=screen`")  # ran the stage's runs
    assert not (tmp_path / "zoo" / zoo.WHOLE).exists()
    (tmp_path / "zoo" / zoo.WHOLE).write_text("{}")
    zoo.swept(cfg, runs, 2, False, False, "`make zoo STAGE=screen`")  # found every run ended: the record stays
    assert (tmp_path / "zoo" / zoo.WHOLE).exists()


@pytest.mark.slow
def test_only_a_zoo_of_both_stages_begun_without_its_folders_is_timed_whole(monkeypatch, tmp_path):
    given = []
    monkeypatch.setattr(zoo, "confirm_start_seeds", lambda *a: None)
    monkeypatch.setattr(zoo, "swept", lambda cfg, *a: ([], "stamp", None))
    monkeypatch.setattr(zoo, "write_leaderboard", lambda *a: tmp_path / "screen.md")
    monkeypatch.setattr(zoo, "confirm", lambda *a: given.append(a[-1]) or 0)
    for stage, made in (("both", "screen"), ("confirm", None), ("both", None), ("both", "confirm")):
        shutil.rmtree(tmp_path / "zoo", ignore_errors=True)
        if made:
            (tmp_path / "zoo" / made).mkdir(parents=True)  # a stage's folder, as its sweep makes it
        assert zoo.main(1, 1, overrides=[f"results_dir={tmp_path}"], progress=False, report=False,
                        objectives=["grpo"], stage=stage) == 0
    assert given[0] is None and given[1] is None and isinstance(given[2], tuple) and given[3] is None


@pytest.mark.slow  # a confirmation planned (seconds): make test
def test_an_objective_whose_screen_runs_all_failed_is_named_and_can_be_left_out(one_cell):
    """A screen in which every run of one objective failed: the confirmation was refused for every --objectives,
    also one that leaves that objective out, with "run `make zoo STAGE=screen` first", which runs the same failures
    again (or, with that --objectives, not at all): no way out but deleting folders, and no run named."""
    tmp_path, calls = one_cell
    runs = [{"run_id": "grpo-s0-aaaa", "objective": "grpo", "status": "finished"},
            *({"run_id": f"holder-s{s}-bbbb", "objective": "holder", "status": "failed"} for s in range(3))]
    (tmp_path / "zoo" / "screen" / "manifest.json").write_text(json.dumps({"runs": runs}))
    args = (3, 1, 0.4, [f"results_dir={tmp_path}"], False)
    with pytest.raises(ConfigError, match=r"3 of its runs did not end \(holder-s0-bbbb: failed, ...\); run `make zoo "
                                          r"STAGE=screen` first to resume them, or leave out their objectives "
                                          r"\(holder\)"):
        zoo.confirm(*args, ["grpo", "holder"], False, 3)
    assert not calls
    assert zoo.confirm(*args, ["grpo", "popo"], False, 3) == 0 and calls  # holder is not compared: planned without it


@pytest.mark.slow  # a confirmation planned (seconds): make test
def test_a_plan_that_tests_nothing_runs_nothing(one_cell, capsys):
    """`python -m harness zoo --objectives grpo,cispo` where cispo's screen interval includes 0 and no core objective
    but grpo is among --objectives: the plan's family is empty (Holm over 0 comparisons), and the confirmation
    still ran grpo's 15 runs per cell (45 for the zoo's three), from which nothing can be confirmed."""
    tmp_path, calls = one_cell
    assert zoo.confirm(3, 1, 0.4, [f"results_dir={tmp_path}"], False, ["grpo", "cispo"], False, 3) == 0
    plan = json.loads((tmp_path / "zoo" / "confirm" / "plan.json").read_text())
    assert plan["correction"]["size"] == 0 and not calls  # the plan is written, as the record of why; no run
    err = capsys.readouterr().err
    assert "the plan tests no objective against grpo (cispo: screen: 0.0100 [-0.0200, 0.0300] vs grpo, includes 0)" \
           in err and "no run started" in err, err


def test_both_stages_say_why_the_confirmation_did_not_run_after_a_screen_run_failed(monkeypatch, tmp_path, capsys):
    """`make zoo` whose screen left a run failed ended with exit 1 and not a word on the confirmation it skipped."""
    monkeypatch.setattr(zoo, "CELLS", {"quickstart": {}})
    monkeypatch.setattr(zoo, "confirm_start_seeds", lambda *args: {"landed": [2, 3, 4], "missed": {}})
    entries = [{"run_id": "grpo-s0-aaaa", "objective": "grpo", "status": "finished"},
               {"run_id": "gspo-s0-bbbb", "objective": "gspo", "status": "failed"}]
    monkeypatch.setattr(zoo, "swept", lambda *args: (entries, "stamp", SimpleNamespace(kept=False)))
    monkeypatch.setattr(zoo, "write_leaderboard", lambda *args: tmp_path / "leaderboard.md")
    confirmed = []
    monkeypatch.setattr(zoo, "confirm", lambda *args: confirmed.append(args) or 0)
    assert zoo.main(1, 1, overrides=[f"results_dir={tmp_path}", "train.steps=2"], progress=False, report=False,
                    objectives=["grpo", "gspo"]) == 1
    assert not confirmed
    assert ("zoo: the confirmation did not run: the confirmation is planned from a finished screen, and 1 of its runs "
            "did not end (gspo-s0-bbbb: failed); run `make zoo STAGE=screen` first to resume them, or leave out their "
            "objectives (gspo) with --objectives") in capsys.readouterr().err
