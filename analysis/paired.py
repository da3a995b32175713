"""Paired comparisons of objectives, following rliable's conventions (Agarwal et al., "Deep RL at the Edge of the
Statistical Precipice", arXiv 2108.13264). Implemented with numpy/scipy: the ``rliable`` package (1.2.0, the last
release) needs ``arch`` < 8, whose 7.x releases fail to import with pandas 3 (``deprecate_kwarg()`` changed), so it
does not run on this project's stack; the functions below follow its definitions, cited per function.

Runs of two objectives with the same seed in the same cell share their first rollouts (the same prompts, the same
starting policy, the same sampling streams until the objectives' updates differ), so per cell the comparison is paired
by seed:

- difference: mean over the seeds both objectives finished of (A's value - B's value); interval as everywhere in the
  report (analysis/stats.py): a 95% percentile bootstrap over the seed pairs (2000 resamples,
  ``numpy.random.default_rng(0)``) from 3 pairs, the range of the differences with 2, none ("n/a") below;
- wins / ties / losses: seeds where A > B, A = B, A < B;
- P(A > B), the probability of improvement: rliable's ``metrics.probability_of_improvement``, the Mann-Whitney U
  statistic over every (A run, B run) pair divided by n_A n_B, a tie counting 0.5; on the paired seeds, with the same
  bootstrap over seed pairs from 3 pairs.

Across cells (rliable's stratified bootstrap, ``StratifiedBootstrap`` / ``get_interval_estimates``: seeds resampled
with replacement within each cell, cells kept): the mean over cells of each cell's mean difference and of its P(A > B)
(rliable averages P(X > Y) over tasks: cells play the tasks' part), and per objective the IQM (``aggregate_iqm``:
``scipy.stats.trim_mean(x, 0.25)`` of all runs of all cells pooled) and the mean, over the cells every objective
has a finished run in. Aggregate intervals need at least 2 seeds in every cell (a cell of one seed has no resampling
variance) and 3 in all; the IQM needs 5 runs in all (as the per-cell tables).
"""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pandas as pd
from scipy.stats import trim_mean

from analysis.stats import BOOT_SEED, CI_MIN_SEEDS, IQM_MIN_SEEDS, LEVEL, N_BOOT, describe

PERCENTILES = [50 * (1 - LEVEL), 50 * (1 + LEVEL)]


def probability_of_improvement(x, y) -> float:
    """P(X > Y) = U / (n_x n_y), the Mann-Whitney U of X over Y counting ties as 0.5 (rliable); NaN if either is
    empty. Over the last axis: x (..., n_x), y (..., n_y) give an array of shape (...)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape[-1] == 0 or y.shape[-1] == 0:
        return np.nan
    greater = (x[..., :, None] > y[..., None, :]).mean(axis=(-2, -1))
    ties = (x[..., :, None] == y[..., None, :]).mean(axis=(-2, -1))
    return greater + 0.5 * ties


def paired_values(runs: pd.DataFrame, a: str, b: str, column: str) -> pd.DataFrame:
    """Per seed both objectives finished (counted, ended runs with a finite value): columns a, b; index seed."""
    done = runs[runs["counted"] & runs["ended"] & np.isfinite(runs[column].astype(float))]
    per = {o: done[done["objective"] == o].set_index("seed")[column].astype(float) for o in (a, b)}
    return pd.DataFrame(per).dropna().sort_index()


def compare(x: np.ndarray, y: np.ndarray) -> dict:
    """Paired statistics of values x (A) and y (B) of the same seeds (see the module docstring)."""
    d = describe(x - y)
    row = {"n": d["n"], "difference": d["mean"], "difference_low": d["ci_low"], "difference_high": d["ci_high"],
           "wins": int((x > y).sum()), "ties": int((x == y).sum()), "losses": int((x < y).sum()),
           "p_improvement": probability_of_improvement(x, y), "p_low": np.nan, "p_high": np.nan}
    if len(x) >= CI_MIN_SEEDS:
        idx = np.random.default_rng(BOOT_SEED).integers(0, len(x), size=(N_BOOT, len(x)))
        row["p_low"], row["p_high"] = np.percentile(probability_of_improvement(x[idx], y[idx]), PERCENTILES)
    return row


def objective_pairs(objectives) -> list[tuple[str, str]]:
    return list(combinations(sorted(set(objectives)), 2))


def per_cell(runs: pd.DataFrame, column: str = "final_eval_accuracy") -> pd.DataFrame:
    """One row per (cell, A, B) with A < B (names sorted) and at least one seed both finished: cell_id, cell, a, b and
    compare()'s numbers."""
    rows = []
    for (cell_id, cell), group in runs.groupby(["cell_id", "cell"], sort=True):
        for a, b in objective_pairs(group["objective"]):
            pairs = paired_values(group, a, b, column)
            if len(pairs):
                rows.append({"cell_id": cell_id, "cell": cell, "a": a, "b": b,
                             **compare(pairs[a].to_numpy(), pairs[b].to_numpy())})
    return pd.DataFrame(rows, columns=["cell_id", "cell", "a", "b", "n", "difference", "difference_low",
                                       "difference_high", "wins", "ties", "losses", "p_improvement", "p_low", "p_high"])


def stratified_indices(sizes: list[int], rng) -> list[np.ndarray]:
    """rliable's stratified bootstrap: per stratum (cell) of n runs, N_BOOT x n indices drawn with replacement."""
    return [rng.integers(0, n, size=(N_BOOT, n)) for n in sizes]


def can_bootstrap(sizes: list[int]) -> bool:
    return bool(sizes) and min(sizes) >= 2 and sum(sizes) >= CI_MIN_SEEDS


def aggregate(runs: pd.DataFrame, column: str = "final_eval_accuracy") -> pd.DataFrame:
    """One row per (A, B) over the cells where both finished a seed: cells, n (seed pairs in all), the mean over cells
    of the mean difference and of P(A > B), each with its stratified-bootstrap interval (NaN when not computable)."""
    rows = []
    for a, b in objective_pairs(runs["objective"]):
        strata = [paired_values(group, a, b, column) for _, group in runs.groupby("cell_id", sort=True)]
        strata = [p for p in strata if len(p)]
        if not strata:
            continue
        x, y = [p[a].to_numpy() for p in strata], [p[b].to_numpy() for p in strata]
        sizes = [len(p) for p in strata]
        row = {"a": a, "b": b, "cells": len(strata), "n": sum(sizes),
               "difference": float(np.mean([(xi - yi).mean() for xi, yi in zip(x, y, strict=True)])),
               "p_improvement": float(np.mean([probability_of_improvement(xi, yi) for xi, yi in zip(x, y,
                                                                                                   strict=True)])),
               "difference_low": np.nan, "difference_high": np.nan, "p_low": np.nan, "p_high": np.nan}
        if can_bootstrap(sizes):
            idx = stratified_indices(sizes, np.random.default_rng(BOOT_SEED))
            diffs = np.mean([(xi[i] - yi[i]).mean(axis=1) for xi, yi, i in zip(x, y, idx, strict=True)], axis=0)
            pois = np.mean([probability_of_improvement(xi[i], yi[i]) for xi, yi, i in zip(x, y, idx, strict=True)],
                           axis=0)
            row["difference_low"], row["difference_high"] = np.percentile(diffs, PERCENTILES)
            row["p_low"], row["p_high"] = np.percentile(pois, PERCENTILES)
        rows.append(row)
    return pd.DataFrame(rows, columns=["a", "b", "cells", "n", "difference", "difference_low", "difference_high",
                                       "p_improvement", "p_low", "p_high"])


def shared_cells(runs: pd.DataFrame, column: str) -> list[int]:
    """The cells in which every objective that has a counted, ended run with a finite value (anywhere) has one."""
    done = runs[runs["counted"] & runs["ended"] & np.isfinite(runs[column].astype(float))]
    objectives = set(done["objective"])
    return sorted(c for c, g in done.groupby("cell_id") if set(g["objective"]) == objectives)


def iqm(runs: pd.DataFrame, column: str = "final_eval_accuracy") -> pd.DataFrame:
    """Per objective over the shared cells: runs, IQM and mean of all their runs pooled, each with a stratified
    bootstrap interval (IQM from IQM_MIN_SEEDS runs; intervals as in aggregate)."""
    cells = shared_cells(runs, column)
    done = runs[runs["counted"] & runs["ended"] & runs["cell_id"].isin(cells)]
    rows = []
    for objective, group in done.groupby("objective", sort=True):
        strata = [g[column].astype(float).to_numpy() for _, g in group.groupby("cell_id", sort=True)]
        strata = [s[np.isfinite(s)] for s in strata]
        sizes = [len(s) for s in strata]
        pooled = np.concatenate(strata)
        row = {"objective": objective, "cells": len(strata), "n": len(pooled),
               "iqm": trim_mean(pooled, 0.25) if len(pooled) >= IQM_MIN_SEEDS else np.nan, "iqm_low": np.nan,
               "iqm_high": np.nan, "mean": pooled.mean(), "mean_low": np.nan, "mean_high": np.nan}
        if can_bootstrap(sizes):
            idx = stratified_indices(sizes, np.random.default_rng(BOOT_SEED))
            resampled = np.concatenate([s[i] for s, i in zip(strata, idx, strict=True)], axis=1)
            row["mean_low"], row["mean_high"] = np.percentile(resampled.mean(axis=1), PERCENTILES)
            if len(pooled) >= IQM_MIN_SEEDS:
                row["iqm_low"], row["iqm_high"] = np.percentile(trim_mean(resampled, 0.25, axis=1), PERCENTILES)
        rows.append(row)
    return pd.DataFrame(rows, columns=["objective", "cells", "n", "iqm", "iqm_low", "iqm_high", "mean", "mean_low",
                                       "mean_high"])
