"""Starting policies as replicates (model.seed): the level above the seeds in every interval, never a cell, never
pooled with the seeds; hand-made runs whose numbers are known."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import t as student_t

from analysis import paired
from analysis.accuracy import estimate, interval_of
from analysis.cells import START_SEED
from analysis.load import load_experiment
from analysis.stats import describe
from harness.apps.sweep import check_start_seeds
from harness.run.config import load_experiment as load_config
from harness.run.config import run_configs, run_id
from harness.run.errors import ConfigError
from tests.helpers.fake_runs import fake_experiment, fake_run
from tests.helpers.tiny import tiny_run

# final accuracy per starting policy (model.seed): far apart, so that pooling them as seeds hides their spread
POLICY_MEAN = {1: 0.30, 2: 0.50, 3: 0.70}
SEED_NOISE = (-0.01, 0.0, 0.01, -0.005, 0.005)


@pytest.fixture(scope="module")
def three_policies(tmp_path_factory):
    exp = tmp_path_factory.mktemp("results") / "replicates"
    entries = [fake_run(exp, objective, seed, {START_SEED: policy}, final=mean + noise + (0.02 if objective == "gspo"
                                                                                           else 0.0))
               for objective in ("grpo", "gspo") for policy, mean in POLICY_MEAN.items()
               for seed, noise in enumerate(SEED_NOISE)]
    return fake_experiment(exp, entries)


def policy_t_interval(values_by_policy: dict) -> tuple[float, float, float]:
    """By hand: the mean of the policies' means and its t-interval with (policies - 1) degrees of freedom."""
    means = np.array([np.mean(v) for v in values_by_policy.values()])
    half = student_t.ppf(0.975, len(means) - 1) * means.std(ddof=1) / np.sqrt(len(means))
    return means.mean(), means.mean() - half, means.mean() + half


@pytest.mark.slow
def test_starting_policies_are_one_cell_and_their_seeds_no_duplicates(three_policies):
    exp = load_experiment(three_policies)
    assert exp.cells.axes == [] and exp.runs["cell_id"].nunique() == 1  # model.seed is no axis
    assert exp.runs["counted"].all() and not exp.cells.duplicates  # seed 0 of policy 1 and of policy 2: two units
    assert sorted(exp.runs[START_SEED].unique()) == [1, 2, 3]
    assert set(exp.metrics[START_SEED].unique()) == {1, 2, 3}


def test_describe_takes_the_policies_means_not_the_pooled_runs():
    values = [m + n for m in POLICY_MEAN.values() for n in SEED_NOISE[:3]]
    policies = [p for p in POLICY_MEAN for _ in range(3)]
    mean, low, high = policy_t_interval({p: [m + n for n in SEED_NOISE[:3]] for p, m in POLICY_MEAN.items()})
    d = describe(values, policies)
    assert (d["n"], d["policies"]) == (9, 3)
    assert d["mean"] == pytest.approx(mean) and (d["ci_low"], d["ci_high"]) == pytest.approx((low, high))
    pooled = describe(values)  # the same values as 9 seeds of one policy: far narrower
    assert pooled["ci_high"] - pooled["ci_low"] < 0.3 * (high - low)
    assert describe(values, [1] * 9) == pooled  # one policy: conditioned on, as before


@pytest.mark.slow
def test_accuracy_interval_is_over_the_policies(three_policies):
    exp = load_experiment(three_policies)
    grpo = exp.runs[exp.runs["objective"] == "grpo"]
    e = estimate(grpo, exp.samples)
    mean, low, high = policy_t_interval({p: [m + n for n in SEED_NOISE] for p, m in POLICY_MEAN.items()})
    assert e.n == 15 and e.mean == pytest.approx(mean) and (e.low, e.high) == pytest.approx((low, high))
    assert [df for _, df in e.parts] == [2.0]  # the policies' spread, 3 - 1 degrees of freedom
    assert e.top == 3  # its top level: 3 starting policies, not the 15 (policy, seed) units


def test_an_interval_over_3_starting_policies_is_indicative_whatever_its_seeds():
    """15 runs from 3 starting policies: the report marks the interval by its 3 policies (it marked none by the 15
    units); from 5 policies x 3 seeds, none; one policy: by its seeds, as before."""
    from analysis.latex import interval as latex_interval
    from analysis.report import interval
    from analysis.verdict import seeds_note

    assert interval(0.1, 0.3, 15, True, 3).endswith(", 3 starting policies: indicative")
    assert "indicative" not in interval(0.1, 0.3, 15, True, 5)
    assert interval(0.1, 0.3, 3, True).endswith(", 3 seeds: indicative")  # a table without the column: its seeds
    assert "3 starting policies: indicative" in seeds_note(15, 3) and seeds_note(15, 5) == ""
    # 3 starting policies of one seed each: the 3 units are starting policies (they were worded "3 seeds")
    one_each = interval_of({(str(p), 0): (str(p), 0.1 * p, None) for p in range(3)})
    assert (one_each.n, one_each.top) == (3, 3)
    assert interval(0.1, 0.3, one_each.n, True, one_each.top).endswith(", 3 starting policies: indicative")
    assert interval(0.1, 0.3, 3, True, 0).endswith(", 3 seeds: indicative")  # one policy: its 3 seeds
    assert r"\dagger" in latex_interval(0.1, 0.3, 15, True, 3)[1] and latex_interval(0.1, 0.3, 15, True, 5)[1] == []


@pytest.mark.slow
def test_iqm_bootstrap_resamples_the_policies(three_policies):
    """The IQM's hierarchical bootstrap draws starting policies first: its interval spans most of the policies'
    spread (0.3 .. 0.7), where a bootstrap of 15 pooled seeds would stay near 0.5."""
    exp = load_experiment(three_policies)
    row = paired.iqm(exp.runs, samples=exp.samples).set_index("objective").loc["grpo"]
    assert row["iqm_low"] < 0.4 and row["iqm_high"] > 0.6


@pytest.mark.slow
def test_a_paired_difference_keeps_each_policy_with_its_seeds(three_policies):
    """gspo - grpo is +0.02 in every (policy, seed) unit: pairing by (policy, seed) finds it exactly; pairing by seed
    alone would pair policy 1's runs with policy 3's."""
    exp = load_experiment(three_policies)
    row = paired.per_cell(exp.runs, samples=exp.samples, baseline="grpo").iloc[0]
    assert (row["a"], row["b"], row["n"], row["wins"]) == ("gspo", "grpo", 15, 15)
    assert row["difference"] == pytest.approx(0.02)


@pytest.mark.slow
def test_the_probability_of_improvement_compares_runs_of_one_starting_policy(three_policies):
    """gspo ends 0.02 above grpo in each of the 15 (policy, seed) units, the policies 0.2 apart: within each policy
    gspo's runs beat grpo's in almost every pair, but P(gspo > grpo) over every pair of runs pooled read 0.66 (a run
    of policy 1 against one of policy 3 measures the policies), outside its own bootstrap interval. It is the mean over
    the starting policies of each one's Mann-Whitney P (rliable's mean over tasks), per cell and across cells."""
    exp = load_experiment(three_policies)
    for table in (paired.per_cell, paired.aggregate):
        row = table(exp.runs, samples=exp.samples, baseline="grpo").iloc[0]
        assert (row["a"], row["b"]) == ("gspo", "grpo")
        assert row["p_improvement"] > 0.95 and row["p_low"] <= row["p_improvement"] <= row["p_high"]
    x, y = np.array([0.3, 0.5, 0.7]), np.array([0.29, 0.49, 0.69])
    assert paired.probability_of_improvement(x, y) == pytest.approx(6 / 9)  # one policy's seeds: as before
    assert paired.within_policies(x, y, ["1", "2", "3"]) == 1.0


def test_model_seed_swept_where_it_changes_nothing_is_refused(tmp_path):
    tiny = [tiny_run(tmp_path, f"model.seed={s}") for s in (1, 2)]
    check_start_seeds(tiny)  # a tiny model: its init differs
    hub = [run.copy() for run in tiny]
    for run in hub:
        run.model.name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(ConfigError, match="model.seed takes several values, but model HuggingFaceTB/SmolLM2-135M-"
                                          "Instruct has no warm start or adapters"):
        check_start_seeds(hub)
    for run in hub:
        run.model.lora.rank = 4
    check_start_seeds(hub)  # LoRA's initial A is drawn from model.seed: other starting policies
    for run in hub:
        run.model.lora.rank, run.model.warm_start_steps = 0, 10
    check_start_seeds(hub)  # another warm start per value: other starting policies


@pytest.mark.slow
def test_model_seed_of_a_pretrained_model_without_warm_start_or_adapters_is_one_starting_policy(tmp_path):
    """It draws nothing: two values are one run id (a grid over them is refused as the same run), and runs that
    wrote two values are read as one starting policy, seeds of it (a duplicate counted once), not two replicates."""
    hub = ["model.name=smollm2-135m-instruct"]
    one, two = (run_configs(load_config("base", [*hub, f"model.seed={s}"]))[0] for s in (0, 1))
    assert run_id(one) == run_id(two)
    with pytest.raises(ConfigError, match=r"^sweep.grid.model.seed: 0 and 1 make the same run \(model.seed changes "
                                          r"nothing for a pretrained model without a warm start or LoRA adapters"):
        run_configs(load_config("base", [*hub, "sweep.grid.model.seed=[0,1]"]))
    for drawn in (["model.lora.rank=4"], ["model.warm_start_steps=5"], []):
        extra = drawn or ["model.name=tiny"]
        ids = {run_id(run) for run in run_configs(load_config("base", [*hub, *extra, "sweep.grid.model.seed=[0,1]"]))}
        assert len(ids) == 2, extra
    exp = tmp_path / "pretrained"
    entries = [fake_run(exp, "grpo", 0, {"model.name": "smollm2-135m-instruct", START_SEED: s}, final=0.3)
               for s in (0, 1)]
    entries += [fake_run(exp, "grpo", 1, {"model.name": "smollm2-135m-instruct", START_SEED: 1}, final=0.4)]
    loaded = load_experiment(fake_experiment(exp, entries))
    assert loaded.runs[START_SEED].isna().all() and loaded.runs["counted"].sum() == 2
    assert any(line.startswith("duplicate runs: grpo, seed 0") for line in loaded.cells.duplicates)
    tiny = tmp_path / "tiny"
    kept = load_experiment(fake_experiment(tiny, [fake_run(tiny, "grpo", 0, {START_SEED: s}) for s in (0, 1)]))
    assert sorted(kept.runs[START_SEED]) == [0, 1] and kept.runs["counted"].all()


def test_two_runs_of_two_starting_policies_are_not_called_a_range():
    """Two runs, one per starting policy: describe's interval is the t-interval over the 2 policies' means (1 degree
    of freedom: [-1.07, 1.47] for 0.1 and 0.3), which the figures' notes called a "range" (interval_name of 2 runs)."""
    import pandas as pd

    from analysis.plots import clip_note
    from analysis.stats import interval_name

    d = describe([0.1, 0.3], [2, 3])
    assert d["ci_low"] < 0.1 and interval_name(d["n"], d["policies"]) == "95% CI"
    assert interval_name(2) == "range" and interval_name(2, 1) == "range"
    note = clip_note("grpo", pd.Series([0.1, 0.3]), d)
    assert "95% CI [-1.07, 1.47], n=2" in note and "range" not in note
