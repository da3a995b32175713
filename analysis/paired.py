"""Paired comparisons of objectives, following rliable's conventions (Agarwal et al., "Deep RL at the Edge of the
Statistical Precipice", arXiv 2108.13264) where they apply. Implemented with numpy/scipy: the ``rliable`` package
(1.2.0, the last release) needs ``arch`` < 8, whose 7.x releases fail to import with pandas 3 (``deprecate_kwarg()``
changed), so it does not run on this project's stack; the functions below follow its definitions, cited per function.

Runs of two objectives with the same seed in the same cell share their first rollouts (the same prompts, the same
starting policy, the same sampling streams until the objectives' updates differ) and their eval set, so per cell the
comparison is paired by seed and by eval problem:

- difference: mean over the seeds both objectives ended of (A's accuracy - B's); interval: analysis/accuracy.py's
  paired_estimate (a t-interval whose variance adds the spread between seeds and between eval problems of the
  per-(seed, problem) differences; over seeds only where the runs lack per-problem scores), and the p-value of its
  t-test (``p_value``, what the verdict's Holm correction takes);
- wins / ties / losses: seeds where A > B, A = B, A < B;
- P(A > B), the probability of improvement: rliable's ``metrics.probability_of_improvement``, the Mann-Whitney U
  statistic over every (A run, B run) pair divided by n_A n_B, a tie counting 0.5; on the paired seeds, with a
  hierarchical percentile bootstrap of seeds and eval problems (analysis.stats.resample) from 3 pairs, whose
  coverage is not measured. With several starting policies, the mean over them of each one's (``within_policies``):
  a run of one starting policy is never compared with a run of another.

Pairs: each objective against the baseline first (A the objective, B the baseline: the sign answers "does it beat
the baseline?"), then the other pairs; objectives in the registry's order (objectives.OBJECTIVES).

Across cells: the cells of one sweep share their starting policies, seeds and eval problems (every cell's run of a
seed starts from the same policy and rollout streams), so their estimates are not independent and their variances do
not add. The unit is a (starting policy, seed) pair, taken where both objectives ended it in every cell: its
difference (per eval problem where scored) is averaged over the cells, and the mean over the units, its interval and
t-test are analysis/accuracy.py's, as in one cell (analysis/confirmation.py does the same). P(A > B) is the mean over
cells of each cell's (rliable averages P(X > Y) over tasks: cells play the tasks' part), its interval by a
hierarchical bootstrap that draws the same starting policies, seeds and eval problems in every cell (joint_draws).
Per objective the IQM (``aggregate_iqm``: ``scipy.stats.trim_mean(x, 0.25)`` of the runs of all cells pooled) and
the mean, over the cells every objective has a finished run in and the units it ended in all of them, the IQM's
interval by the same joint bootstrap. Aggregate intervals need at least 3 units in all cells; the IQM needs 5 runs
in all (as the per-cell tables).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.accuracy import (
    ACCURACY_RANGE,
    DIFFERENCE_RANGE,
    FINAL,
    across_cells,
    common_units,
    paired_units,
    resampled_values,
    runs_scores,
)
from analysis.accuracy import interval_of as accuracy_interval
from analysis.stats import BOOT_SEED, CI_MIN_SEEDS, IQM_MIN_SEEDS, LEVEL
from objectives import OBJECTIVES

PERCENTILES = [50 * (1 - LEVEL), 50 * (1 + LEVEL)]
PAIR_COLUMNS = ["cell_id", "cell", "a", "b", "n", "top", "difference", "difference_low", "difference_high", "p_value",
                "problems", "wins", "ties", "losses", "p_improvement", "p_low", "p_high"]


def probability_of_improvement(x, y) -> float:
    """P(X > Y) = U / (n_x n_y), the Mann-Whitney U of X over Y counting ties as 0.5 (rliable); NaN if either is
    empty. Over the last axis: x (..., n_x), y (..., n_y) give an array of shape (...); NaNs are left out."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape[-1] == 0 or y.shape[-1] == 0:
        return np.nan
    a, b = x[..., :, None], y[..., None, :]
    valid = np.isfinite(a) & np.isfinite(b)
    score = ((a > b) + 0.5 * (a == b)) * valid
    with np.errstate(invalid="ignore"):
        return score.sum(axis=(-2, -1)) / valid.sum(axis=(-2, -1))


def within_policies(x, y, policies) -> float:
    """P(X > Y) of paired runs (x[i], y[i] of unit i, from starting policy policies[i]): the mean over the starting
    policies of each one's probability_of_improvement, never a run of one policy against a run of another (whose
    difference would measure the policies: rliable averages over tasks alike). One policy: probability_of_improvement
    of its runs."""
    x, y, policies = np.asarray(x, dtype=float), np.asarray(y, dtype=float), np.asarray(policies, dtype=object)
    if not len(x):
        return np.nan
    return float(np.mean([probability_of_improvement(x[policies == p], y[policies == p]) for p in
                          dict.fromkeys(policies)]))


def drawn_within_policies(drawn: np.ndarray, units: dict) -> np.ndarray:
    """within_policies of each bootstrap resample of ``units`` (resampled_values of stacked: (n_boot, slots, 2), the
    slots a (policies, seeds) grid as analysis.accuracy.dense lays them out, NaN where a policy has fewer seeds)."""
    policies = len({policy for policy, _, _ in units.values()})
    grid = drawn.reshape(drawn.shape[0], policies, -1, 2)
    with np.errstate(invalid="ignore"):
        return np.nanmean(probability_of_improvement(grid[..., 0], grid[..., 1]), axis=1)


def registry_order(objectives) -> list[str]:
    """The objectives in the registry's order; names it does not hold after them, sorted."""
    names = OBJECTIVES.names()
    return sorted(set(objectives), key=lambda o: (names.index(o) if o in names else len(names), o))


def default_baseline(objectives, grid: list[str] | None = None) -> str | None:
    """grpo when among the objectives, else the grid's first objective present, else the first in registry order."""
    present = registry_order(objectives)
    if "grpo" in present:
        return "grpo"
    return next((o for o in grid or [] if o in present), present[0] if present else None)


def objective_pairs(objectives, baseline: str | None = None) -> list[tuple[str, str]]:
    """(A, B) pairs: each objective against the baseline (A the objective), then the others in registry order."""
    ordered = registry_order(objectives)
    first = [(o, baseline) for o in ordered if baseline in ordered and o != baseline]
    rest = [(a, b) for i, a in enumerate(ordered) for b in ordered[i + 1:] if baseline not in (a, b)]
    return first + rest


def compare(a: dict, b: dict) -> dict:
    """Paired statistics of two objectives' runs in one cell (analysis.accuracy.runs_scores of each)."""
    pairs = paired_units(a, b)
    d = accuracy_interval(pairs, DIFFERENCE_RANGE)
    seeds = sorted(pairs)
    x, y = np.array([a[s][1] for s in seeds]), np.array([b[s][1] for s in seeds])
    row = {"n": d.n, "top": d.top, "difference": d.mean, "difference_low": d.low, "difference_high": d.high,
           "p_value": d.p_value, "problems": d.problems, "wins": int((x > y).sum()), "ties": int((x == y).sum()),
           "losses": int((x < y).sum()), "p_improvement": within_policies(x, y, [a[s][0] for s in seeds]),
           "p_low": np.nan, "p_high": np.nan}
    if len(seeds) >= CI_MIN_SEEDS:
        units = stacked(a, b, seeds)
        row["p_low"], row["p_high"] = np.percentile(drawn_within_policies(resampled_values(units), units),
                                                    PERCENTILES)
    return row


def stacked(a: dict, b: dict, seeds) -> dict:
    """key -> (policy, (A's value, B's), their scores side by side, or None unless both scored the same problems):
    one unit per seed carrying both objectives, so that a resample draws the same seeds and problems for both."""
    out = {}
    for s in seeds:
        (policy, x, sx), (_, y, sy) = a[s], b[s]
        same = sx is not None and sy is not None and sx.index.equals(sy.index)
        out[s] = (policy, np.array([x, y]), pd.concat([sx, sy], axis=1) if same else None)
    return out


def per_cell(runs: pd.DataFrame, column: str = FINAL, samples: dict | None = None,
             baseline: str | None = None) -> pd.DataFrame:
    """One row per (cell, A, B) (objective_pairs' order) with at least one seed both ended: cell_id, cell, a, b and
    compare()'s numbers. samples: analysis.load.Experiment.samples (none: over seeds only). A ``baseline`` no run
    has is a ValueError, as on the command line (the pairs would silently be between other objectives)."""
    if not isinstance(runs, pd.DataFrame):
        raise TypeError(f"per_cell takes the runs as a DataFrame (Experiment.runs), got {type(runs).__name__}")
    if baseline is not None and baseline not in set(runs["objective"]):
        raise ValueError(f"baseline {baseline!r}: no run of it; these runs' objectives: "
                         + ", ".join(registry_order(runs["objective"])))
    rows = []
    for (cell_id, cell), group in runs.groupby(["cell_id", "cell"], sort=True):
        scores = {o: runs_scores(g, samples or {}, column) for o, g in group.groupby("objective")}
        for a, b in objective_pairs(group["objective"], baseline):
            if set(scores[a]) & set(scores[b]):
                rows.append({"cell_id": cell_id, "cell": cell, "a": a, "b": b, **compare(scores[a], scores[b])})
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)


def joint_draws(strata: list[dict]) -> list[np.ndarray]:
    """resampled_values of each cell's units (common_units': the same keys in each), every cell drawn from a fresh
    generator seeded alike, so that each resample draws the same starting policies, seeds and eval problems in every
    cell: the cells share them, and a draw per cell would treat them as independent."""
    return [resampled_values(units, rng=np.random.default_rng(BOOT_SEED)) for units in strata]


def aggregate(runs: pd.DataFrame, column: str = FINAL, samples: dict | None = None,
              baseline: str | None = None) -> pd.DataFrame:
    """One row per (A, B) over the cells where both ended a seed: cells, n (the (starting policy, seed) units both
    ended in every one of them), the mean difference and P(A > B) over the cells, with their intervals, and the
    difference's t-test p-value (NaN when not computable; see the module docstring)."""
    rows = []
    cells = {c: {o: runs_scores(g, samples or {}, column) for o, g in group.groupby("objective")}
             for c, group in runs.groupby("cell_id", sort=True)}
    for a, b in objective_pairs(runs["objective"], baseline):
        strata = [(s[a], s[b]) for s in cells.values() if a in s and b in s and set(s[a]) & set(s[b])]
        if not strata:
            continue
        units = across_cells([paired_units(x, y) for x, y in strata])  # each unit's difference, mean over cells
        keys = list(units)
        d = accuracy_interval(units, DIFFERENCE_RANGE)
        row = {"a": a, "b": b, "cells": len(strata), "n": len(keys), "difference": d.mean,
               "difference_low": d.low, "difference_high": d.high, "p_value": d.p_value, "p_improvement": np.nan,
               "p_low": np.nan, "p_high": np.nan}
        if keys:
            row["p_improvement"] = float(np.mean([within_policies([x[k][1] for k in keys], [y[k][1] for k in keys],
                                                                  [x[k][0] for k in keys]) for x, y in strata]))
        if len(keys) >= CI_MIN_SEEDS:
            both = [stacked(x, y, keys) for x, y in strata]
            pois = np.mean([drawn_within_policies(v, units) for v, units in zip(joint_draws(both), both, strict=True)],
                           axis=0)
            row["p_low"], row["p_high"] = np.percentile(pois, PERCENTILES)
        rows.append(row)
    return pd.DataFrame(rows, columns=["a", "b", "cells", "n", "difference", "difference_low", "difference_high",
                                       "p_value", "p_improvement", "p_low", "p_high"])


def shared_cells(runs: pd.DataFrame, column: str) -> list[int]:
    """The cells in which every objective that has a counted, ended run with a finite value (anywhere) has one."""
    done = runs[runs["counted"] & runs["ended"] & np.isfinite(runs[column].astype(float))]
    objectives = set(done["objective"])
    return sorted(c for c, g in done.groupby("cell_id") if set(g["objective"]) == objectives)


def trimmed_means(x: np.ndarray) -> np.ndarray:
    """scipy.stats.trim_mean(row, 0.25) of each row of x, leaving out its NaNs."""
    ordered = np.sort(x, axis=1)  # NaNs last
    n = np.isfinite(x).sum(axis=1, keepdims=True)
    cut = np.floor(0.25 * n)
    rank = np.arange(x.shape[1])
    keep = (rank >= cut) & (rank < n - cut)
    return np.where(keep, ordered, 0).sum(axis=1) / keep.sum(axis=1)


def iqm(runs: pd.DataFrame, column: str = FINAL, samples: dict | None = None) -> pd.DataFrame:
    """Per objective over the shared cells and the (starting policy, seed) units it ended in every one of them:
    runs, the IQM of those runs pooled and the mean of the units' means across the cells (as aggregate's: the mean
    of the starting policies' means where there are several, as the headline's), each with its interval (the mean's
    over those units; the IQM's by a hierarchical bootstrap drawing the same units and eval problems in
    every cell: joint_draws) (IQM from IQM_MIN_SEEDS runs; intervals from CI_MIN_SEEDS units)."""
    cells = shared_cells(runs, column)
    rows = []
    for objective in registry_order(runs.loc[runs["cell_id"].isin(cells), "objective"]):
        group = runs[(runs["objective"] == objective) & runs["cell_id"].isin(cells)]
        strata = common_units([runs_scores(g, samples or {}, column) for _, g in group.groupby("cell_id", sort=True)])
        pooled = np.array([value for s in strata for _, value, _ in s.values()])
        if not len(pooled):
            continue
        mean = accuracy_interval(across_cells(strata), ACCURACY_RANGE)
        row = {"objective": objective, "cells": len(strata), "n": len(pooled),
               "iqm": trimmed_means(pooled[None])[0] if len(pooled) >= IQM_MIN_SEEDS else np.nan, "iqm_low": np.nan,
               "iqm_high": np.nan, "mean": mean.mean, "mean_low": np.nan, "mean_high": np.nan}
        if len(strata[0]) >= CI_MIN_SEEDS:
            row["mean_low"], row["mean_high"] = mean.low, mean.high
            if len(pooled) >= IQM_MIN_SEEDS:
                drawn = np.concatenate(joint_draws(strata), axis=1)
                row["iqm_low"], row["iqm_high"] = np.percentile(trimmed_means(drawn), PERCENTILES)
        rows.append(row)
    return pd.DataFrame(rows, columns=["objective", "cells", "n", "iqm", "iqm_low", "iqm_high", "mean", "mean_low",
                                       "mean_high"])
