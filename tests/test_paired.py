"""analysis/paired.py: the paired statistics pinned on hand-made numbers (rliable's conventions)."""

import numpy as np
import pandas as pd
import pytest
import scipy.stats
from scipy.stats import trim_mean

from analysis import paired
from analysis.stats import BOOT_SEED, N_BOOT


def frame(values: dict) -> pd.DataFrame:
    """{(cell_id, objective): [final accuracy per seed 0, 1, ...]} -> a runs frame (None: that seed did not end)."""
    rows = []
    for (cell, objective), finals in values.items():
        for seed, final in enumerate(finals):
            rows.append({"cell_id": cell, "cell": f"c{cell}", "objective": objective, "seed": seed, "counted": True,
                         "ended": final is not None, "final_eval_accuracy": np.nan if final is None else final})
    return pd.DataFrame(rows)


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


def test_known_difference():
    x, y = np.array([0.4, 0.5, 0.6]), np.array([0.3, 0.4, 0.5])
    row = paired.compare(x, y)
    assert row["n"] == 3 and row["difference"] == pytest.approx(0.1)
    assert (row["difference_low"], row["difference_high"]) == pytest.approx((0.1, 0.1))  # constant differences
    assert (row["wins"], row["ties"], row["losses"]) == (3, 0, 0)
    # all 9 (A, B) pairs: 0.4 beats 0.3, ties 0.4; 0.5 beats 0.3 and 0.4, ties 0.5; 0.6 beats all: 7 / 9
    assert row["p_improvement"] == pytest.approx(7 / 9)
    idx = np.random.default_rng(BOOT_SEED).integers(0, 3, size=(N_BOOT, 3))
    expected = np.percentile(paired.probability_of_improvement(x[idx], y[idx]), [2.5, 97.5])
    assert (row["p_low"], row["p_high"]) == pytest.approx(tuple(expected))


def test_ties_and_too_few_seeds():
    tie = paired.compare(np.array([0.5, 0.5, 0.5]), np.array([0.5, 0.5, 0.5]))
    assert tie["difference"] == 0 and (tie["wins"], tie["ties"], tie["losses"]) == (0, 3, 0)
    assert tie["p_improvement"] == 0.5
    two = paired.compare(np.array([0.5, 0.7]), np.array([0.4, 0.4]))  # two pairs: the range of the differences
    assert (two["difference_low"], two["difference_high"]) == pytest.approx((0.1, 0.3)) and np.isnan(two["p_low"])
    one = paired.compare(np.array([0.5]), np.array([0.4]))
    assert one["n"] == 1 and np.isnan(one["difference_low"]) and np.isnan(one["p_low"])
    assert one["p_improvement"] == 1.0


def test_per_cell_pairs_by_seed_and_never_across_cells():
    runs = frame({(0, "grpo"): [0.3, 0.4, 0.5], (0, "gspo"): [0.4, None, 0.7],
                  (1, "grpo"): [0.9, 0.9], (1, "gspo"): [0.1, 0.1]})
    table = paired.per_cell(runs).set_index("cell_id")
    assert list(table["a"]) == ["grpo", "grpo"] and list(table["b"]) == ["gspo", "gspo"]
    assert table.loc[0, "n"] == 2  # seed 1 of gspo did not end: seeds 0 and 2 are paired
    assert table.loc[0, "difference"] == pytest.approx(((0.3 - 0.4) + (0.5 - 0.7)) / 2)
    assert table.loc[1, "difference"] == pytest.approx(0.8) and table.loc[1, "p_improvement"] == 1.0
    lonely = frame({(0, "grpo"): [0.3], (1, "gspo"): [0.4]})  # never the same cell: nothing to compare
    assert paired.per_cell(lonely).empty and paired.aggregate(lonely).empty


def test_aggregate_is_the_stratified_bootstrap_of_the_mean_over_cells():
    values = {(0, "a"): [0.5, 0.6, 0.7], (0, "b"): [0.4, 0.6, 0.5], (1, "a"): [0.2, 0.1], (1, "b"): [0.3, 0.3]}
    row = paired.aggregate(frame(values)).iloc[0]
    d0, d1 = np.array([0.1, 0.0, 0.2]), np.array([-0.1, -0.2])
    assert (row["cells"], row["n"]) == (2, 5)
    assert row["difference"] == pytest.approx((d0.mean() + d1.mean()) / 2)
    p0 = paired.probability_of_improvement([0.5, 0.6, 0.7], [0.4, 0.6, 0.5])
    assert row["p_improvement"] == pytest.approx((p0 + 0.0) / 2)
    rng = np.random.default_rng(BOOT_SEED)
    i0, i1 = rng.integers(0, 3, size=(N_BOOT, 3)), rng.integers(0, 2, size=(N_BOOT, 2))
    means = (d0[i0].mean(axis=1) + d1[i1].mean(axis=1)) / 2
    assert (row["difference_low"], row["difference_high"]) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])))
    single = paired.aggregate(frame({**values, (2, "a"): [0.5], (2, "b"): [0.4]})).iloc[0]
    assert single["cells"] == 3 and np.isnan(single["difference_low"])  # a one-seed cell: no interval


def test_iqm_over_shared_cells():
    values = {(0, "grpo"): [0.1, 0.2, 0.3], (1, "grpo"): [0.4, 0.5, 0.9],
              (0, "gspo"): [0.5, 0.5, 0.5], (1, "gspo"): [0.5, 0.5, 0.5], (2, "grpo"): [1.0, 1.0, 1.0]}
    table = paired.iqm(frame(values)).set_index("objective")
    grpo = table.loc["grpo"]
    assert (grpo["cells"], grpo["n"]) == (2, 6)  # cell 2 has no gspo run: left out for every objective
    assert grpo["iqm"] == pytest.approx(0.35)  # middle of 0.1 0.2 0.3 0.4 0.5 0.9: 0.2 0.3 0.4 0.5
    rng = np.random.default_rng(BOOT_SEED)
    a, b = np.array([0.1, 0.2, 0.3]), np.array([0.4, 0.5, 0.9])
    resampled = np.concatenate([a[rng.integers(0, 3, size=(N_BOOT, 3))], b[rng.integers(0, 3, size=(N_BOOT, 3))]],
                               axis=1)
    assert (grpo["iqm_low"], grpo["iqm_high"]) == pytest.approx(
        tuple(np.percentile(trim_mean(resampled, 0.25, axis=1), [2.5, 97.5])))
    assert table.loc["gspo", "iqm"] == 0.5 and table.loc["gspo", "iqm_low"] == 0.5
    few = paired.iqm(frame({(0, "grpo"): [0.1, 0.2]})).iloc[0]
    assert few["n"] == 2 and np.isnan(few["iqm"]) and few["mean"] == pytest.approx(0.15)
