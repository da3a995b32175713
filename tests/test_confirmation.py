"""analysis/confirmation.py: the zoo's confirmation on hand-made runs whose numbers are known: the difference per
(starting policy, seed) averaged over the cells, the starting policies as the top level of the interval, Holm's
step-down over the plan's family and its verdicts."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import t as student_t

from analysis.accuracy import interval_of
from analysis.cells import START_SEED
from analysis.confirmation import confirmation, holm_levels, write_confirmation
from analysis.load import AnalysisWarning
from analysis.stats import indicative
from analysis.verdict import holm
from tests.helpers.fake_runs import fake_experiment, fake_run

POLICIES, SEEDS, CELLS = (2, 3, 4), range(5, 10), (1e-4, 3e-4)
# the difference to grpo per starting policy: A's is about the same from every policy, B's depends on the policy
EFFECT = {"grpo": {2: 0.0, 3: 0.0, 4: 0.0}, "a_obj": {2: 0.05, 3: 0.051, 4: 0.049},
          "b_obj": {2: 0.04, 3: 0.0, 4: 0.035}, "c_obj": {2: -0.03, 3: -0.031, 4: -0.029}}
PLAN = {"baseline": "grpo", "objectives": {"grpo": "the baseline", "a_obj": "screen", "b_obj": "screen",
                                           "c_obj": "core objective"},
        "not_tested": {"d_obj": "screen: includes 0"}, "start_seeds": list(POLICIES), "seeds": list(SEEDS),
        "cells": {"offpolicy": {}, "step_size": {}}, "rule": "hand-made",
        "correction": {"method": "holm", "alpha": 0.05, "family": ["a_obj - grpo", "b_obj - grpo", "c_obj - grpo"],
                       "size": 3}}


def final(objective: str, policy: int, seed: int, lr: float) -> float:
    """The run's final accuracy: a policy effect, a seed effect shared by the objectives (it cancels when paired),
    a cell effect, the objective's difference."""
    return 0.3 + 0.1 * (policy - 3) + 0.01 * (seed - 7) + (0.05 if lr == 3e-4 else 0.0) + EFFECT[objective][policy]


@pytest.fixture(scope="module")
def confirm(tmp_path_factory):
    exp = tmp_path_factory.mktemp("results") / "confirm"
    entries = [fake_run(exp, o, s, {"train.lr": lr, START_SEED: p}, final=final(o, p, s, lr))
               for o in EFFECT for p in POLICIES for s in SEEDS for lr in CELLS]
    return fake_experiment(exp, entries)


def test_holm_levels_step_down_and_match_the_adjusted_p():
    p = np.array([0.04, 0.001, 0.3, 0.012, np.nan])
    levels = holm_levels(p)
    # ascending: 0.001 at 0.05/4 (rejected), 0.012 at 0.05/3 (rejected), 0.04 at 0.05/2 (not): 0.3 at 0.05/2 too
    assert levels[:4] == pytest.approx([0.025, 0.0125, 0.025, 0.05 / 3]) and np.isnan(levels[4])
    assert ((p < levels) == (holm(p) < 0.05))[:4].all()  # an interval at its level excludes 0 iff Holm rejects
    assert ((p < 0.05).sum(), (holm(p) < 0.05).sum()) == (3, 2)  # unadjusted, 0.04 would count


@pytest.mark.slow  # a 120-run folder analysed (seconds): make test
def test_verdicts_over_the_policies_with_holm(confirm):
    table, units, _, models = confirmation(confirm, PLAN)
    rows = table.set_index("objective")
    assert rows["verdict"].to_dict() == {"grpo": "baseline", "a_obj": "confirmed above", "b_obj": "not confirmed",
                                         "c_obj": "confirmed below", "d_obj": "not tested"}
    assert models == "tiny on arith" and len(units["a_obj"]) == 15
    # 3 starting policies: fewer than the 5 from which the interval reaches its level in every simulated case
    assert rows["indicative"].to_dict() == {"grpo": False, "a_obj": True, "b_obj": True, "c_obj": True, "d_obj": False}
    assert interval_of(units["a_obj"]).top == 3
    five = {(str(p), s): (str(p), 0.1 * p, None) for p in range(5) for s in range(2)}  # 5 policies x 2 seeds
    assert interval_of(five).top == 5 and not indicative(interval_of(five).top)
    assert interval_of({("", s): ("", 0.1 * s, None) for s in range(4)}).top == 0  # one policy: its seeds (n)
    # b: the mean over the policies of their mean difference, t with 3 - 1 degrees of freedom, Holm over 3
    means = np.array(list(EFFECT["b_obj"].values()))
    se = means.std(ddof=1) / np.sqrt(3)
    p = 2 * student_t.sf(means.mean() / se, 2)
    assert rows.loc["b_obj", "difference"] == pytest.approx(means.mean())
    assert rows.loc["b_obj", "p_value"] == pytest.approx(p) and rows.loc["b_obj", "holm_p"] >= p
    # pooled as 15 seeds of one policy (the old design), b would have been a difference far below any correction
    pooled = np.repeat(means, 5)
    assert 2 * student_t.sf(pooled.mean() / (pooled.std(ddof=1) / np.sqrt(15)), 14) * 3 < 0.001
    # each interval at the level Holm tests it: a and c rejected first (0.05/3, 0.05/2), b at 0.05
    assert rows.loc["b_obj", "low"] < 0 < rows.loc["b_obj", "high"]
    assert rows.loc["a_obj", "low"] > 0 and rows.loc["c_obj", "high"] < 0
    assert sorted(rows.loc[["a_obj", "c_obj"], "level"]) == pytest.approx([1 - 0.05 / 2, 1 - 0.05 / 3])


@pytest.mark.slow  # a 120-run folder analysed (seconds): make test
def test_a_comparison_missing_runs_is_incomplete_and_stays_in_the_family(confirm, tmp_path):
    """Without one of a_obj's runs its verdict is 'incomplete' (no verdict on another design than the plan's), and
    the family still counts it: c is tested at 0.05/3 first, as with every comparison there."""
    import shutil

    exp = tmp_path / "confirm"
    shutil.copytree(confirm, exp)
    (next(exp.glob("a_obj-s5-*")) / "summary.json").unlink()
    (next(exp.glob("a_obj-s5-*")) / "metrics.jsonl").unlink()
    with pytest.warns(AnalysisWarning, match="missing"):
        rows = confirmation(exp, PLAN)[0].set_index("objective")
    assert rows.loc["a_obj", "verdict"] == "incomplete" and rows.loc["c_obj", "verdict"] == "confirmed below"
    assert rows.loc["c_obj", "level"] == pytest.approx(1 - 0.05 / 3)


@pytest.mark.slow  # seconds of runs or reports: make test
def test_runs_of_two_code_versions_are_refused_not_paired(confirm, tmp_path):
    """A confirmation continued after a commit keeps the runs that ended under the old code: its differences would
    pair the old code's runs with the new code's, so it is refused in one line naming the versions."""
    import json
    import shutil

    from harness.run.errors import ConfigError
    from tests.helpers.fake_runs import code_segments

    exp = tmp_path / "confirm"
    shutil.copytree(confirm, exp)
    for folder in exp.glob("c_obj-*"):  # c_obj's runs by another version than the others' (recorded by none)
        summary = json.loads((folder / "summary.json").read_text())
        (folder / "summary.json").write_text(json.dumps({**summary, **code_segments("bbb")}))
    with pytest.raises(ConfigError, match=r"the confirmation's runs in .* are of different code versions \(30 by bbb, "
                                          r"90 by unknown\) and would be paired with each other"):
        confirmation(exp, PLAN)


@pytest.mark.slow  # a 120-run folder analysed (seconds): make test
def test_the_leaderboard_states_family_correction_replication_and_model(confirm, tmp_path):
    path = write_confirmation(tmp_path / "screen", confirm, PLAN, tmp_path, "stamp line")
    text = path.read_text()
    for needle in ("Family: 3 comparisons with grpo", "Holm's step-down", "family-wise error rate 0.05",
                   "3 starting policies (model.seed [2, 3, 4]) x 5 seeds ([5, 6, 7, 8, 9]) x 2 cells",
                   "Model: tiny on arith", "| a_obj | confirmed above, indicative |", "| d_obj | not tested |",
                   "\"Indicative\": from fewer than 5 starting policies",
                   "3 starting policies x 5 seeds", "stamp line"):
        assert needle in text, needle
    assert (tmp_path / "leaderboard.csv").exists() and (tmp_path / "leaderboard.html").exists()
    assert "eval problems the screen's (a plan made before the confirmation had eval problems of its own" in text
    fresh = {**PLAN, "eval_set": 1, "screen": {"start_seeds": [1], "seeds": [0, 1, 2], "eval_set": 0}}
    text = write_confirmation(tmp_path / "screen", confirm, fresh, tmp_path, "stamp line").read_text()
    assert "eval problems task.eval_set 1, none of them the screen's (set 0) or a train problem" in text


def test_a_difference_alike_on_every_problem_has_no_zero_width_holm_interval():
    """An objective that answers every eval problem as the baseline does, in every (starting policy, seed) unit: the
    confirmation's Holm-level interval read `0.00 [0.00, 0.00]` (t_bounds of a zero variance), against the
    report's rule for values alike (analysis/accuracy.py unvaried_bounds). It is that bound at Holm's level, and it
    excludes 0 exactly when the difference is confirmed, also for a difference alike and away from 0."""
    import pandas as pd

    from analysis.accuracy import DIFFERENCE_RANGE, unvaried_bounds
    from analysis.confirmation import verdicts

    def units(value: float, problems: int) -> dict:
        index = pd.MultiIndex.from_tuples([(i, str(i)) for i in range(problems)], names=["problem", "answer"])
        return {(str(p), s): (str(p), value, pd.Series(value, index=index)) for p in (2, 3, 6) for s in range(5)}

    same, apart = interval_of(units(0.0, 32), DIFFERENCE_RANGE), interval_of(units(1.0, 8), DIFFERENCE_RANGE)
    table = verdicts({"same": same, "apart": apart}, dict.fromkeys(["same", "apart"], True),
                     ["grpo", "same", "apart"], ["grpo", "same", "apart"], "grpo").set_index("objective")
    row = table.loc["same"]
    assert row["verdict"] == "not confirmed" and row["low"] < 0 < row["high"]
    assert (row["low"], row["high"]) == pytest.approx(unvaried_bounds(0.0, 32, DIFFERENCE_RANGE, row["level"]))
    row = table.loc["apart"]  # +1 on each of 8 problems: p = 2 (1 - 1/2)^8, confirmed at Holm's first level 97.5%
    assert row["verdict"] == "confirmed above" and row["holm_p"] == pytest.approx(2 * 0.5 ** 8 * 2)
    assert 0 < row["low"] < 1 and row["high"] == pytest.approx(1.0) and row["level"] == pytest.approx(0.975)


def test_verdicts_adjust_over_the_plans_whole_family_by_hand():
    """verdicts() on hand-made estimates (mean, one variance part (v, df)): p-values 0.03, 0.001 and an incomplete
    comparison, which stays in the family at p = 1 (m = 3). Holm by hand: 3 x 0.001 = 0.003 (rejected), 2 x 0.03 =
    0.06 (not), so a is not confirmed though its own p is below 0.05 (with m = 2 or unadjusted it would be); each
    interval at the level Holm tests it: b at 1 - 0.05/3, a at 1 - 0.05/2, mean +- t_{df, 1 - level/2} sqrt(v)."""
    from analysis.accuracy import Estimate
    from analysis.confirmation import verdicts

    v, df = 1e-4, 4.0

    def made(p: float, sign: float) -> Estimate:
        mean = sign * student_t.isf(p / 2, df) * np.sqrt(v)
        return Estimate(mean, mean - 1, mean + 1, 5, ((v, df),), True, 5)  # low, high: unused

    estimates = {"a": made(0.03, 1.0), "b": made(0.001, -1.0), "c": made(0.001, 1.0)}
    assert [estimates[o].p_value for o in "ab"] == pytest.approx([0.03, 0.001])
    rows = verdicts(estimates, {"a": True, "b": True, "c": False}, ["base", "a", "b", "c"], ["base", "a", "b", "c",
                                                                                               "d"], "base")
    rows = rows.set_index("objective")
    assert rows["verdict"].to_dict() == {"base": "baseline", "a": "not confirmed", "b": "confirmed below",
                                         "c": "incomplete", "d": "not tested"}
    assert rows.loc[["a", "b"], "holm_p"].tolist() == pytest.approx([0.06, 0.003])
    assert rows.loc[["a", "b"], "level"].tolist() == pytest.approx([1 - 0.05 / 2, 1 - 0.05 / 3])
    for o, alpha in (("a", 0.05 / 2), ("b", 0.05 / 3)):
        half = student_t.ppf(1 - alpha / 2, df) * np.sqrt(v)
        assert (rows.loc[o, "low"], rows.loc[o, "high"]) == pytest.approx((estimates[o].mean - half,
                                                                           estimates[o].mean + half))
    assert rows.loc["a", "low"] < 0 < rows.loc["a", "high"] and rows.loc["b", "high"] < 0  # excludes 0 iff confirmed
