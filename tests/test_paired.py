"""analysis/paired.py and analysis/accuracy.py: the paired statistics and the accuracy intervals pinned on hand-made
numbers (rliable's conventions; the hierarchical design of analysis/stats.py)."""

import numpy as np
import pandas as pd
import pytest
import scipy.stats
from scipy.stats import t as student_t

from analysis import paired
from analysis.accuracy import estimate, paired_estimate, run_scores
from analysis.stats import BOOT_SEED, HIERARCHY, N_BOOT, Level, resample, t_bounds, variance_parts


def frame(values: dict) -> pd.DataFrame:
    """{(cell_id, objective): [final accuracy per seed 0, 1, ...]} -> a runs frame (None: that seed did not end)."""
    rows = []
    for (cell, objective), finals in values.items():
        for seed, final in enumerate(finals):
            rows.append({"run_id": f"{objective}-s{seed}-c{cell}", "cell_id": cell, "cell": f"c{cell}",
                         "objective": objective, "seed": seed, "counted": True, "ended": final is not None,
                         "final_eval_accuracy": np.nan if final is None else final, "start_policy": "p"})
    return pd.DataFrame(rows)


def scored(scores: dict) -> tuple[pd.DataFrame, dict]:
    """{(objective, seed): per-problem 0/1 scores at the last eval, step 4} -> one cell's runs and their samples
    (step 0 scores every problem 0)."""
    runs, samples = [], {}
    for (objective, seed), row in scores.items():
        run_id = f"{objective}-s{seed}"
        runs.append({"run_id": run_id, "cell_id": 0, "cell": "all runs", "objective": objective, "seed": seed,
                     "counted": True, "ended": True, "final_eval_accuracy": float(np.mean(row)),
                     "start_eval_accuracy": 0.0, "start_policy": "p"})
        steps = [(0, [0.0] * len(row)), (4, row)]
        samples[run_id] = pd.DataFrame([{"step": step, "problem": p, "answer": str(p), "correct": float(v)}
                                        for step, values in steps for p, v in enumerate(values)])
    return pd.DataFrame(runs), samples


def test_probability_of_improvement_is_mann_whitney_with_ties_as_half():
    assert paired.probability_of_improvement([1, 2, 3], [1, 2, 3]) == 0.5  # identical: 0.5, as rliable
    assert paired.probability_of_improvement([2, 3], [1]) == 1.0
    # (1,2): 0, (1,3): 0, (2,2): tie 0.5, (2,3): 0 -> 0.5 / 4
    assert paired.probability_of_improvement([1, 2], [2, 3]) == 0.125
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 4, 7) / 4, rng.integers(0, 4, 5) / 4  # many ties
    u = scipy.stats.mannwhitneyu(x, y, alternative="greater").statistic  # rliable's formula
    assert paired.probability_of_improvement(x, y) == pytest.approx(u / (7 * 5))
    assert np.isnan(paired.probability_of_improvement([], [1.0]))
    assert paired.probability_of_improvement([1, 2, np.nan], [1.5]) == 0.5  # a missing value is left out


def test_the_variance_adds_the_seeds_and_the_eval_problems():
    """V = the seeds' part + the problems' part, as before; the degrees of freedom count the problems' part only for
    the problems' own spread (their part less the seed x problem interaction, which the seeds' part already holds)."""
    # 3 seeds x 4 problems, shared: problem 0 is easy for every seed, problem 3 hard (a problem main effect)
    x = np.array([[[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 0]]], dtype=float)
    mean, parts = variance_parts(x, HIERARCHY)
    seed_means, problem_means = x[0].mean(1), x[0].mean(0)
    seeds, problems = np.var(seed_means, ddof=1) / 3, np.var(problem_means, ddof=1) / 4
    residual = x[0] - seed_means[:, None] - problem_means[None, :] + x.mean()
    held = (residual ** 2).sum() / ((3 - 1) * (4 - 1) * 3 * 4)  # the interaction mean square over the 12 cells
    assert 0 < held < problems
    assert mean == pytest.approx(7 / 12)
    assert [float(v) for v, _ in parts] == pytest.approx([seeds + held, problems - held])
    assert [df for _, df in parts] == [2, 3]  # the seeds', the problems'
    low, high = t_bounds(mean, parts)
    v1, v2 = seeds + held, problems - held
    df = (v1 + v2) ** 2 / (v1 ** 2 / 2 + v2 ** 2 / 3)  # Welch–Satterthwaite over the two
    half = student_t.ppf(0.975, df) * np.sqrt(seeds + problems)  # the variance is the two parts', as before
    assert (low, high) == pytest.approx((mean - half, mean + half))
    # no problem main effect beyond the interaction: all of the problems' part goes with the seeds' degrees of freedom
    x = np.array([[[1, 0, 1, 0], [1, 1, 0, 1]]], dtype=float)
    mean, parts = variance_parts(x, HIERARCHY)
    seeds, problems = np.var([0.5, 0.75], ddof=1) / 2, np.var([1, 0.5, 0.5, 0.5], ddof=1) / 4
    assert [float(v) for v, _ in parts] == pytest.approx([seeds + problems, 0]) and [df for _, df in parts] == [1, 3]
    # one starting policy: conditioned on; two: its spread is the nested part (df 1), the seeds inside it
    two = np.array([[[1, 0], [1, 1]], [[0, 1], [np.nan, np.nan]]], dtype=float)  # the second policy: one seed
    mean, parts = variance_parts(two, (Level("start_policy"), Level("seed"), Level("problem", shared=True)))
    assert mean == pytest.approx((0.75 + 0.5) / 2) and float(parts[0][1]) == 1
    assert float(parts[0][0]) == pytest.approx(np.var([0.75, 0.5], ddof=1) / 2)


def test_three_seeds_that_agree_do_not_give_a_zero_width_interval():
    """The case that printed `ctpo − grpo 0.0156, 95% CI [0.0156, 0.0156]`: every seed 2 problems of 128 apart."""
    base = [1.0] * 40 + [0.0] * 88
    ahead = base[:40] + [1.0, 1.0] + [0.0] * 86
    runs, samples = scored({**{("grpo", s): base for s in range(3)}, **{("ctpo", s): ahead for s in range(3)}})
    d = paired_estimate(runs, samples, "ctpo", "grpo")
    assert d.problems and d.n == 3 and d.mean == pytest.approx(2 / 128)
    per_problem = np.array([0.0] * 40 + [1.0, 1.0] + [0.0] * 86)  # the same two problems in every seed
    v = per_problem.var(ddof=1) / 128
    half = student_t.ppf(0.975, 127) * np.sqrt(v)
    assert (d.low, d.high) == pytest.approx((2 / 128 - half, 2 / 128 + half))
    assert d.low < 0 < d.high and d.p_value > 0.05  # two problems of 128 are no evidence
    unscored = paired_estimate(runs, {}, "ctpo", "grpo")  # without per-problem scores: the seeds agree, no interval
    assert not unscored.problems and unscored.mean == pytest.approx(2 / 128) and np.isnan(unscored.low)
    assert np.isnan(unscored.p_value)  # no interval, no test: the verdict does not count it
    start = estimate(runs[runs["objective"] == "grpo"], samples, "start_eval_accuracy")
    # 0 on each of 128 problems: the task's other problems may not be 0 (test below), not a zero-width interval
    assert start.problems and start.mean == start.low == 0 and start.high == pytest.approx(1 - 0.025 ** (1 / 128))


def test_scores_that_do_not_match_the_runs_accuracy_are_not_used():
    runs, samples = scored({("grpo", 0): [1, 0, 0, 0], ("grpo", 1): [1, 1, 0, 0], ("grpo", 2): [0, 0, 0, 0]})
    assert list(run_scores(samples["grpo-s0"], "final_eval_accuracy", 0.25)) == [1, 0, 0, 0]
    assert run_scores(samples["grpo-s0"], "final_eval_accuracy", 0.5) is None  # another evaluation's
    assert run_scores(samples["grpo-s0"], "best_eval_accuracy", 0.25).sum() == 1  # step 4, the best
    assert run_scores(None, "final_eval_accuracy", 0.25) is None
    lost = {**samples, "grpo-s2": samples["grpo-s2"][samples["grpo-s2"]["step"] == 0]}
    lost_final = lost["grpo-s2"].assign(step=4).iloc[:3]  # its last evaluation lost a problem: not matched
    lost["grpo-s2"] = pd.concat([lost["grpo-s2"], lost_final])
    e = estimate(runs, lost)
    assert not e.problems and e.mean == pytest.approx(0.25)
    x = np.array([0.25, 0.5, 0.0])
    half = student_t.ppf(0.975, 2) * x.std(ddof=1) / np.sqrt(3)  # the t-interval over seeds
    assert (e.low, e.high) == pytest.approx((0.25 - half, 0.25 + half))


def test_the_hierarchical_bootstrap_draws_seeds_within_policies_and_problems_once_for_all():
    x = np.arange(2 * 3 * 4, dtype=float).reshape(2, 3, 4)  # value = 12 policy + 4 seed + problem
    x[1, 2] = np.nan  # the second policy has 2 seeds
    drawn = resample(x, HIERARCHY, n_boot=500, rng=np.random.default_rng(0))
    assert drawn.shape == (500, 2, 3, 4)
    policy = np.nanmin(drawn, axis=(2, 3)) // 12  # the policy drawn into each slot
    assert set(np.unique(policy)) == {0, 1}
    seeds = np.isfinite(drawn[..., 0]).sum(axis=2)
    assert (seeds == np.where(policy == 0, 3, 2)).all()  # a slot holds as many seeds as its policy has
    seed = (drawn[..., 0] % 12) // 4
    assert np.all((seed < np.where(policy == 0, 3, 2)[..., None]) | np.isnan(seed))  # its own seeds only
    assert ((drawn // 12 == policy[..., None, None]) | np.isnan(drawn)).all()
    problem = drawn % 4
    same = (problem == problem[:, :1, :1]) | np.isnan(problem)
    assert same.all()  # the same problems for every seed of a resample
    assert len(np.unique(problem[:, 0, 0])) == 4  # ... drawn anew for each resample
    assert np.isfinite(resample(x[:1], HIERARCHY, 3)).all()


def test_known_difference_over_seeds_without_problem_scores():
    runs = frame({(0, "a"): [0.4, 0.5, 0.7], (0, "b"): [0.3, 0.4, 0.5]})
    row = paired.per_cell(runs).iloc[0]
    d = np.array([0.1, 0.1, 0.2])
    half = student_t.ppf(0.975, 2) * d.std(ddof=1) / np.sqrt(3)
    assert (row["a"], row["b"], row["n"], row["problems"]) == ("a", "b", 3, False)
    assert (row["difference"], row["difference_low"], row["difference_high"]) == pytest.approx(
        (d.mean(), d.mean() - half, d.mean() + half))
    assert row["p_value"] == pytest.approx(scipy.stats.ttest_1samp(d, 0).pvalue)
    assert (row["wins"], row["ties"], row["losses"]) == (3, 0, 0)
    x, y = np.array([0.4, 0.5, 0.7]), np.array([0.3, 0.4, 0.5])
    assert row["p_improvement"] == pytest.approx(paired.probability_of_improvement(x, y))
    idx = np.random.default_rng(BOOT_SEED).integers(0, 3, size=(N_BOOT, 3))  # seeds only: the former bootstrap
    expected = np.percentile(paired.probability_of_improvement(x[idx], y[idx]), [2.5, 97.5])
    assert (row["p_low"], row["p_high"]) == pytest.approx(tuple(expected))


def test_pairs_put_the_baseline_second_and_follow_the_registry():
    values = {(0, o): [0.3, 0.4, 0.5] for o in ("vespo", "cispo", "grpo", "gspo")}
    pairs = paired.per_cell(frame(values), baseline="grpo")
    assert list(zip(pairs["a"], pairs["b"], strict=True)) == [
        ("cispo", "grpo"), ("gspo", "grpo"), ("vespo", "grpo"), ("cispo", "gspo"), ("cispo", "vespo"),
        ("gspo", "vespo")]
    assert paired.default_baseline(["cispo", "grpo"]) == "grpo"
    assert paired.default_baseline(["cispo", "vespo"], ["vespo", "cispo"]) == "vespo"  # the grid's first
    assert paired.default_baseline(["vespo", "cispo"]) == "cispo"  # no grid: the registry's first


def test_per_cell_pairs_by_seed_and_never_across_cells():
    runs = frame({(0, "grpo"): [0.3, 0.4, 0.5], (0, "gspo"): [0.4, None, 0.7],
                  (1, "grpo"): [0.9, 0.9], (1, "gspo"): [0.1, 0.1]})
    table = paired.per_cell(runs, baseline="grpo").set_index("cell_id")
    assert list(table["a"]) == ["gspo", "gspo"] and list(table["b"]) == ["grpo", "grpo"]
    assert table.loc[0, "n"] == 2  # seed 1 of gspo did not end: seeds 0 and 2 are paired
    assert table.loc[0, "difference"] == pytest.approx(((0.4 - 0.3) + (0.7 - 0.5)) / 2)
    assert table.loc[1, "difference"] == pytest.approx(-0.8) and table.loc[1, "p_improvement"] == 0.0
    assert np.isnan(table.loc[1, "difference_low"])  # seeds alike, problems unknown: no interval
    lonely = frame({(0, "grpo"): [0.3], (1, "gspo"): [0.4]})  # never the same cell: nothing to compare
    assert paired.per_cell(lonely).empty and paired.aggregate(lonely).empty
    # the Python API with a baseline no run has: the pairs were silently between the others (the seventh pass)
    with pytest.raises(ValueError, match=r"^baseline 'cispo': no run of it; these runs' objectives: grpo, gspo$"):
        paired.per_cell(runs, baseline="cispo")
    with pytest.raises(TypeError, match=r"per_cell takes the runs as a DataFrame \(Experiment.runs\), got list"):
        paired.per_cell(runs.to_dict("records"))


def test_aggregate_averages_each_seed_over_the_cells_before_its_interval():
    """The cells share their starting policy, seeds and eval problems: per seed the difference is averaged over the
    cells, and the interval is over those seeds (the cells' variances added as if independent made it too narrow)."""
    values = {(0, "a"): [0.5, 0.6, 0.7], (0, "b"): [0.4, 0.6, 0.5],
              (1, "a"): [0.2, 0.1, 0.3], (1, "b"): [0.3, 0.4, 0.2]}
    row = paired.aggregate(frame(values)).iloc[0]
    units = (np.array([0.1, 0.0, 0.2]) + np.array([-0.1, -0.3, 0.1])) / 2  # per seed, the mean over the two cells
    assert (row["cells"], row["n"]) == (2, 3) and row["difference"] == pytest.approx(units.mean())
    half = student_t.ppf(0.975, 2) * units.std(ddof=1) / np.sqrt(3)
    assert (row["difference_low"], row["difference_high"]) == pytest.approx((units.mean() - half, units.mean() + half))
    p0 = paired.probability_of_improvement([0.5, 0.6, 0.7], [0.4, 0.6, 0.5])
    p1 = paired.probability_of_improvement([0.2, 0.1, 0.3], [0.3, 0.4, 0.2])
    assert row["p_improvement"] == pytest.approx((p0 + p1) / 2)
    single = paired.aggregate(frame({**values, (2, "a"): [0.5], (2, "b"): [0.4]})).iloc[0]
    assert (single["cells"], single["n"]) == (3, 1) and np.isnan(single["difference_low"])  # seed 0 alone in all


@pytest.mark.slow
def test_copies_of_a_cell_add_no_information_to_the_aggregate():
    """Three cells whose runs are one cell's, copied: the aggregate is that cell's comparison, its interval, p-value
    and P(A > B) interval included, with per-problem scores (the bootstrap draws the same seeds and problems in
    every cell)."""
    runs, samples = scored({(o, s): list((np.arange(12) * (s + 2 + (o == "a"))) % 5 < 2 + (o == "a"))
                            for o in ("a", "b") for s in range(5)})
    one = paired.aggregate(runs, samples=samples).iloc[0]
    copies = pd.concat([runs.assign(cell_id=c, cell=f"c{c}") for c in range(3)])
    three = paired.aggregate(copies, samples=samples).iloc[0]
    assert (three["cells"], three["n"]) == (3, 5) and np.isfinite(one["difference_low"])
    for column in ("difference", "difference_low", "difference_high", "p_value", "p_improvement", "p_low", "p_high"):
        assert three[column] == pytest.approx(one[column]), column
    iqm_one, iqm_three = paired.iqm(runs, samples=samples).iloc[0], paired.iqm(copies, samples=samples).iloc[0]
    for column in ("mean_low", "mean_high", "iqm_low", "iqm_high"):
        assert iqm_three[column] == pytest.approx(iqm_one[column]), column


def test_iqm_over_shared_cells():
    values = {(0, "grpo"): [0.1, 0.2, 0.3], (1, "grpo"): [0.4, 0.5, 0.9],
              (0, "gspo"): [0.5, 0.5, 0.5], (1, "gspo"): [0.5, 0.5, 0.5], (2, "grpo"): [1.0, 1.0, 1.0]}
    table = paired.iqm(frame(values)).set_index("objective")
    grpo = table.loc["grpo"]
    assert (grpo["cells"], grpo["n"]) == (2, 6)  # cell 2 has no gspo run: left out for every objective
    assert grpo["iqm"] == pytest.approx(0.35)  # middle of 0.1 0.2 0.3 0.4 0.5 0.9: 0.2 0.3 0.4 0.5
    rng = np.random.default_rng(BOOT_SEED)  # its one starting policy drawn, then 3 of its seeds: the same in each cell
    rng.random((N_BOOT, 1))
    seeds = np.floor(rng.random((N_BOOT, 3)) * 3).astype(int)
    a, b = np.array([0.1, 0.2, 0.3]), np.array([0.4, 0.5, 0.9])
    resampled = np.concatenate([a[seeds], b[seeds]], axis=1)
    assert (grpo["iqm_low"], grpo["iqm_high"]) == pytest.approx(
        tuple(np.percentile(scipy.stats.trim_mean(resampled, 0.25, axis=1), [2.5, 97.5])))
    units = (a + b) / 2  # the mean's interval: over the seeds' means across the cells
    half = student_t.ppf(0.975, 2) * units.std(ddof=1) / np.sqrt(3)
    assert (grpo["mean_low"], grpo["mean_high"]) == pytest.approx((units.mean() - half, units.mean() + half))
    assert table.loc["gspo", "iqm"] == 0.5 and table.loc["gspo", "iqm_low"] == 0.5
    few = paired.iqm(frame({(0, "grpo"): [0.1, 0.2]})).iloc[0]
    assert few["n"] == 2 and np.isnan(few["iqm"]) and few["mean"] == pytest.approx(0.15)


def test_the_counted_draw_of_problems_is_the_generic_resample_in_distribution():
    """resampled_values weighs each problem by how often a resample drew it instead of building the resampled
    scores: per run, the same distribution as analysis.stats.resample's mean over the drawn problems."""
    from analysis.accuracy import dense, resampled_values

    runs, samples = scored({("grpo", s): list((np.arange(16) * (s + 3)) % 5 < 2) for s in range(3)})
    units = {s: ("p", v, run_scores(samples[f"grpo-s{s}"], "final_eval_accuracy", v))
             for s, v in zip(runs["seed"], runs["final_eval_accuracy"], strict=True)}
    fast = resampled_values(units, n_boot=20000)
    x, levels, _ = dense(units)
    generic = resample(x, levels, n_boot=20000, rng=np.random.default_rng(1)).mean(axis=3).reshape(20000, -1)
    assert fast.shape == generic.shape == (20000, 3)
    for statistic in (np.mean, np.std, lambda v: np.mean(v.max(axis=1))):
        assert statistic(fast) == pytest.approx(statistic(generic), rel=0.03)


def test_iqm_tables_mean_is_the_one_its_interval_is_about():
    """With several starting policies of unequal seeds, the mean of the per-objective table is the policies' mean
    (the headline's, the centre of its interval), not the mean of the runs pooled."""
    runs = frame({(0, "grpo"): [0.1, 0.2, 0.9, 0.5]}).assign(**{"model.seed": [1, 1, 2, 2]})
    runs.loc[3, "ended"] = False  # policy 2 lost a seed: 2 seeds of policy 1, 1 of policy 2
    row = paired.iqm(runs).iloc[0]
    policies_mean = ((0.1 + 0.2) / 2 + 0.9) / 2
    assert row["mean"] == pytest.approx(policies_mean) == pytest.approx(estimate(runs, {}).mean)
    assert (row["mean_low"] + row["mean_high"]) / 2 == pytest.approx(policies_mean)


def test_scores_alike_on_every_problem_and_seed_give_no_zero_width_interval():
    """An objective that collapsed to 0 on every eval problem in every seed read `0.00 [0.00, 0.00]`, and two
    objectives that scored every problem alike in every seed `0.00 [0.00, 0.00]`: a t-interval of values that did
    not vary in the sample, as if the task's other problems could not differ. The bound is Clopper-Pearson's for
    none of the n problems differing (a share q = 1 - 0.025^(1/n) may), inside the quantity's range."""
    n = 32
    q = 1 - 0.025 ** (1 / n)
    base = [1.0] * 10 + [0.0] * 22
    runs, samples = scored({**{("grpo", s): base for s in range(3)}, **{("gspo", s): [0.0] * n for s in range(3)},
                            **{("ctpo", s): base for s in range(3)}})
    dead = estimate(runs[runs["objective"] == "gspo"], samples)
    assert dead.mean == 0 and (dead.low, dead.high) == pytest.approx((0.0, q)) and dead.problems
    same = paired_estimate(runs, samples, "ctpo", "grpo")
    assert same.mean == 0 and (same.low, same.high) == pytest.approx((-q, q)) and same.p_value == 1.0
    runs, samples = scored({**{("grpo", s): [0.0] * n for s in range(3)}, **{("gspo", s): [1.0] * n for s in range(3)}})
    apart = paired_estimate(runs, samples, "gspo", "grpo")
    assert apart.mean == 1 and (apart.low, apart.high) == pytest.approx((1 - 2 * q, 1.0)) and apart.p_value < 0.05
    full = estimate(runs[runs["objective"] == "gspo"], samples)
    assert (full.low, full.high) == pytest.approx((1 - q, 1.0))



def test_scores_alike_at_a_fraction_over_cells_give_the_unvaried_bound_not_a_round_off_interval():
    """Per-problem values alike in every seed at a fraction (a mean over 10 cells: 7 of them 1, the others 0) are as
    unvaried as an all-0 collapse, but the seeds' means differ from their mean by round-off: the interval was the
    t-interval of that round-off, 0.700 [0.700, 0.700], and a difference alike at 0.1 had p ~ 1e-32, not the
    unvaried_bounds interval (and its p-value) that values alike exactly get."""
    from analysis.accuracy import ACCURACY_RANGE, DIFFERENCE_RANGE, across_cells, interval_of

    n, q = 32, 1 - 0.025 ** (1 / 32)
    problems = pd.MultiIndex.from_tuples([(f"p{i}", "a") for i in range(n)], names=["problem", "answer"])

    def cells(ones: int) -> dict:  # 10 cells' units, 3 seeds each, every problem scored 1 in `ones` of the cells
        return across_cells([{("", seed): ("", value, pd.Series(np.full(n, value), index=problems))
                               for seed in range(3)} for value in [1.0] * ones + [0.0] * (10 - ones)])

    seventh = interval_of(cells(7), ACCURACY_RANGE)
    assert (seventh.low, seventh.high) == pytest.approx((0.7 - 0.7 * q, 0.7 + 0.3 * q)) and seventh.p_value == 0.0
    tenth = interval_of(cells(1), DIFFERENCE_RANGE)  # as the difference of two objectives' runs
    assert (tenth.low, tenth.high) == pytest.approx((0.1 - 1.1 * q, 0.1 + 0.9 * q))
    # 0 lies inside the interval: the p-value, the level at which the bound reaches 0, is above 0.05 too
    assert tenth.p_value == pytest.approx(2 * (1 - 0.1 / 1.1) ** n) and tenth.p_value > 0.05


def test_the_bootstrap_draws_policies_and_each_policys_seeds_independently_and_problems_once_per_resample():
    """analysis.stats.resample draws the starting policies with replacement (two slots hold one policy in half the
    resamples) and each slot's seeds on its own (two slots of one policy draw the same 3 seeds 1/27 of the time).
    resampled_values, on hand-made runs whose scores name them (run r, policy r // 2, seed r % 2, scores 10 r +
    problem / 10 on 4 problems), draws seeds within their policy only and one set of problems per resample for every
    run, and for both objectives of a stacked pair (their difference, 0.05 on every problem, stays 0.05)."""
    from analysis.accuracy import resampled_values

    x = np.arange(2 * 3 * 4, dtype=float).reshape(2, 3, 4)  # value = 12 policy + 4 seed + problem
    drawn = resample(x, HIERARCHY, n_boot=2000, rng=np.random.default_rng(0))
    policy, seeds = np.nanmin(drawn, axis=(2, 3)) // 12, (drawn[..., 0] % 12) // 4
    both = policy[:, 0] == policy[:, 1]
    assert 0.4 < both.mean() < 0.6  # each slot's policy drawn on its own: the same one in half the resamples
    alike = (seeds[both, 0] == seeds[both, 1]).all(axis=1)
    assert alike.mean() < 0.15  # 1/27 by chance: each slot draws its own seeds, not one draw for every slot
    problems = [f"q{i}" for i in range(4)]
    scores = {r: pd.Series([10 * r + i / 10 for i in range(4)], index=problems) for r in range(4)}
    units = {(f"p{r // 2}", r % 2): (f"p{r // 2}", scores[r].mean(), scores[r]) for r in range(4)}
    values = resampled_values(units, n_boot=500)  # (resample, slot): slots 0, 1 of the first policy drawn, 2, 3
    run, share = values // 10, values % 10  # which run filled the slot, the mean of the problems drawn
    assert ((run[:, :2] // 2 == run[:, :1] // 2).all() and (run[:, 2:] // 2 == run[:, 2:3] // 2).all())
    assert set(np.unique(run[:, 0] // 2)) == {0, 1}
    assert share == pytest.approx(np.repeat(share[:, :1], 4, axis=1))  # one draw of problems for every run
    assert len(np.unique(np.round(share[:, 0], 9))) > 10  # ... drawn anew for each resample
    pair = {key: (p, np.array([v, v + 0.05]), pd.concat([s, s + 0.05], axis=1)) for key, (p, v, s) in units.items()}
    stacked = resampled_values(pair, n_boot=500)
    assert stacked[..., 1] - stacked[..., 0] == pytest.approx(np.full((500, 4), 0.05))


def test_trimmed_means_are_scipys_and_a_tie_is_neither_a_win_nor_a_loss():
    """trimmed_means (the IQM of NaN-padded rows) against scipy.stats.trim_mean(row, 0.25) for 5 to 12 values, where
    the number cut from each end, floor(n / 4), differs from 10%'s and from ceil(n / 4); a seed of equal accuracies
    is a tie, and one starting policy's comparison has top 0 (its top level is its seeds: indicative with 3)."""
    rng = np.random.default_rng(3)
    rows = np.full((8, 12), np.nan)
    for i, n in enumerate(range(5, 13)):
        rows[i, :n] = rng.random(n)
    expected = [scipy.stats.trim_mean(row[np.isfinite(row)], 0.25) for row in rows]
    assert paired.trimmed_means(rows) == pytest.approx(expected)
    row = paired.per_cell(frame({(0, "a"): [0.4, 0.5, 0.7], (0, "b"): [0.4, 0.4, 0.8]})).iloc[0]
    assert (row["wins"], row["ties"], row["losses"], row["top"]) == (1, 1, 1, 0)


def test_the_aggregate_p_improvement_interval_averages_each_cells_p_over_one_draw_of_seeds():
    """aggregate's P(A > B) interval by hand (runs without per-problem scores): each resample draws the one starting
    policy, then 3 seeds, the same in both cells; its P(A > B) is the mean of the cells' (rliable's average over
    tasks), not the P of the cells' runs pooled; the 2.5th and 97.5th percentiles of those means."""
    values = {(0, "a"): [0.5, 0.6, 0.7], (0, "b"): [0.4, 0.6, 0.5],
              (1, "a"): [0.2, 0.1, 0.3], (1, "b"): [0.3, 0.4, 0.2]}
    row = paired.aggregate(frame(values)).iloc[0]
    rng = np.random.default_rng(BOOT_SEED)
    rng.random((N_BOOT, 1))
    seeds = np.floor(rng.random((N_BOOT, 3)) * 3).astype(int)
    cells = [(np.array(values[c, "a"]), np.array(values[c, "b"])) for c in (0, 1)]
    means = np.mean([paired.probability_of_improvement(a[seeds], b[seeds]) for a, b in cells], axis=0)
    assert (row["p_low"], row["p_high"]) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])))
