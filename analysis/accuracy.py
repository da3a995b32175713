"""Eval accuracies and their paired differences with intervals that include the eval set's sampling.

Each run scores every eval problem at every evaluation (eval_samples.jsonl, read by analysis/load.py). The runs of a
cell share one eval set, so an objective's accuracy in a cell is a hierarchical design, levels starting policy ->
seed -> eval problem (analysis.stats.HIERARCHY), the problems crossed with the seeds; ``estimate`` gives its mean and
interval (analysis.stats.variance_parts and t_bounds). Two objectives are compared on the seeds both ended, by the
per-(seed, problem) difference of their scores (``paired_estimate``): the same problem for both runs of a seed.

The evaluation a column means: ``start_eval_accuracy`` step 0; ``final_eval_accuracy`` (and
``final_eval_accuracy_<scoring>``: the score ``correct_<scoring>``) the run's last evaluation; ``best_eval_accuracy``
the first evaluation with the run's highest accuracy (its interval takes that step as given: the choice of the best
of several evaluations is not resampled, so it is optimistic). A run whose per-problem scores at that evaluation are
missing, or do not average to the run's own accuracy (summary.json's), is not resolved by problem: the group then
falls back on the runs' own accuracies with analysis.stats.describe's interval over seeds (``problems`` False), and
on none where the seeds agree exactly (whether the problems vary is then unknown: never a zero-width interval).
Scores alike on every problem in every run (a collapse to 0 everywhere) take ``unvaried_bounds``, not a zero-width
t-interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.stats import t as student_t

from analysis.cells import START_SEED
from analysis.stats import (
    BOOT_SEED,
    CI_MIN_SEEDS,
    HIERARCHY,
    LEVEL,
    N_BOOT,
    resample,
    satterthwaite,
    t_bounds,
    variance_parts,
)

START, FINAL, BEST = "start_eval_accuracy", "final_eval_accuracy", "best_eval_accuracy"
SCORE = "correct"  # eval_samples.jsonl's score under the task's training scoring (eval_accuracy)
ACCURACY_RANGE, DIFFERENCE_RANGE = (0.0, 1.0), (-1.0, 1.0)  # an eval accuracy's, and two accuracies' difference's


@dataclass(frozen=True)
class Estimate:
    """A mean with its interval: n seeds; parts: the variance's independent parts (variance, degrees of freedom);
    problems: whether the eval problems' spread is in it (else the interval is over seeds only); top: its starting
    policies where there are 2 or more (the top level it resamples), else 0 (its top level is then its n seeds:
    analysis.stats.top_units), which decide whether it is indicative (analysis.stats.indicative); unvaried: (eval
    problems, the quantity's range) where every value is alike and the interval is unvaried_bounds', else ()."""

    mean: float
    low: float
    high: float
    n: int
    parts: tuple = ()
    problems: bool = False
    top: int = 0
    unvaried: tuple = ()

    @property
    def p_value(self) -> float:
        """Two-sided p of the t-test of mean = 0 with the interval's variance and degrees of freedom (NaN without
        an interval); for values alike, the smallest 1 - level at which unvaried_bounds reaches 0, so that p < 1 -
        level exactly when the interval at that level excludes 0 (as the t-test's p and interval)."""
        variance, df = satterthwaite(self.parts) if self.parts else (np.nan, np.nan)
        if not np.isfinite(self.low) or not np.isfinite(variance) or not df > 0:
            return np.nan
        if self.unvaried:  # the bound reaches 0 where q >= r = |mean| / |mean - the range's end beyond 0|
            problems, (low, high) = self.unvaried
            end = low if self.mean > 0 else high
            r = abs(self.mean) / abs(self.mean - end) if self.mean != end else 1.0
            return float(min(1.0, 2 * (1 - r) ** problems))
        if variance == 0:  # seeds alike without a range: a zero-width interval, 0 inside it or not
            return 1.0 if self.low <= 0 <= self.high else 0.0
        return float(2 * student_t.sf(abs(self.mean) / np.sqrt(variance), df))

    def at(self, level: float) -> tuple[float, float]:
        """The interval at another ``level`` (the confirmation's Holm levels): unvaried_bounds' for values alike,
        else the t-interval of its parts; NaNs without parts."""
        if self.unvaried:
            return unvaried_bounds(self.mean, *self.unvaried, level)
        if not self.parts:
            return np.nan, np.nan
        low, high = t_bounds(self.mean, self.parts, level)
        return float(low), float(high)


NONE = Estimate(np.nan, np.nan, np.nan, 0)


def evaluation(column: str) -> tuple[str, str]:
    """(which evaluation, which score) a run column stands for."""
    if column.startswith(FINAL + "_"):
        return "final", SCORE + column.removeprefix(FINAL)
    return {START: "start", FINAL: "final", BEST: "best"}[column], SCORE


def run_scores(samples: pd.DataFrame | None, column: str, value: float) -> pd.Series | None:
    """The run's per-problem scores behind its value of ``column`` (index: problem, answer), or None (see the module
    docstring)."""
    which, score = evaluation(column)
    if samples is None or score not in samples or not np.isfinite(value):
        return None
    by_step = samples.dropna(subset=[score]).groupby("step")[score].mean()
    if by_step.empty:
        return None
    step = {"start": 0, "final": by_step.index.max(), "best": by_step.idxmax()}[which]
    part = scores_at(samples, step, score)
    if part.empty or not np.isclose(part.mean(), value, rtol=0, atol=1e-9):
        return None
    return part


def scores_at(samples: pd.DataFrame, step: int, score: str = SCORE) -> pd.Series:
    """The per-problem scores of the evaluation at ``step`` (index: problem, answer; empty without one, or where the
    samples do not name their problems and answers)."""
    if not {"problem", "answer"} <= set(samples.columns):
        return pd.Series(dtype=float)
    part = samples[samples["step"] == step].dropna(subset=[score])
    return part.set_index(["problem", "answer"])[score].astype(float).sort_index()


def steps_scores(samples: pd.DataFrame | None, steps, value: float) -> pd.Series | None:
    """The run's per-problem scores averaged over its evaluations at ``steps``, whose eval accuracies average to
    ``value``; None where one of them lacks its scores, scored other problems, or they do not average to ``value``."""
    if samples is None or SCORE not in samples or not np.isfinite(value):
        return None
    parts = [scores_at(samples, step) for step in steps]
    if not parts or any(part.empty or not part.index.equals(parts[0].index) for part in parts):
        return None
    mean = sum(parts) / len(parts)
    return mean if np.isclose(mean.mean(), value, rtol=0, atol=1e-9) else None


def runs_scores(runs: pd.DataFrame, samples: dict, column: str) -> dict:
    """(starting policy, seed) -> (starting policy, the run's value, its per-problem scores or None) of the runs
    counted and ended with a finite value (two objectives' runs of one key are paired)."""
    done = runs[runs["counted"] & runs["ended"] & np.isfinite(runs[column].astype(float))]
    policy = (done[START_SEED].astype("string").fillna("?") if START_SEED in done
              else pd.Series("", index=done.index))  # the starting policy's replicate (analysis/cells.py)
    return {(p, run.seed): (p, float(getattr(run, column)), run_scores(samples.get(run.run_id), column,
                                                                       float(getattr(run, column))))
            for run, p in zip(done.itertuples(), policy, strict=True)}


def dense(units: dict) -> tuple[np.ndarray, tuple, bool]:
    """The units (key -> (policy, value, scores), keys sortable: (policy, seed)) as a (policies, seeds, problems, ...)
    array, NaN-padded after each policy's seeds; its levels; whether it is resolved by problem (every unit has
    scores, on the same problems). Unresolved: (policies, seeds, ...) of the values."""
    scores = [s for _, _, s in units.values()]
    problems = all(s is not None and s.index.equals(scores[0].index) for s in scores)
    policies = sorted({p for p, _, _ in units.values()})
    rows = {p: [u for u in sorted(units) if units[u][0] == p] for p in policies}
    cells = {seed: np.asarray(score if problems else value, dtype=float) for seed, (_, value, score) in units.items()}
    x = np.full((len(policies), max(map(len, rows.values())), *next(iter(cells.values())).shape), np.nan)
    for i, p in enumerate(policies):
        for j, seed in enumerate(rows[p]):
            x[i, j] = cells[seed]
    return x, HIERARCHY if problems else HIERARCHY[:2], problems


NO_INTERVAL = "fewer than 2 seeds, or seeds that agree exactly and lack per-problem scores"  # when interval_of has none


def unvaried_bounds(value: float, problems: int, bounds: tuple[float, float], level: float = LEVEL
                    ) -> tuple[float, float]:
    """The interval of a mean whose every (unit, eval problem) value is ``value``: none of the ``problems`` differed,
    so by Clopper-Pearson's bound a share q = 1 - ((1 - level) / 2)^(1 / problems) of the task's problems may (at
    level: ~3.7 / problems), each at most to an end of the quantity's range ``bounds``. A t-interval would have zero
    width, as if the problems not drawn could not differ; the seeds, alike too, add nothing that can be measured."""
    q = 1 - ((1 - level) / 2) ** (1 / problems)
    low, high = bounds
    return value - q * (value - low), value + q * (high - value)


def interval_of(units: dict, bounds: tuple[float, float] | None = None) -> Estimate:
    """The mean of the units' values with its interval: by seed and problem when resolved (from 2 seeds), else over
    seeds (describe's convention: the range with 2). ``bounds``: the quantity's range (ACCURACY_RANGE,
    DIFFERENCE_RANGE), for values resolved by problem that are all alike (unvaried_bounds); None: such values' interval
    has zero width."""
    if not units:
        return NONE
    x, levels, problems = dense(units)
    mean, parts = variance_parts(x, levels)
    parts = tuple((float(v), float(df)) for v, df in parts if np.isfinite(v))
    n = len(units)
    if problems or n >= CI_MIN_SEEDS:
        low, high = t_bounds(mean, parts) if parts else (np.nan, np.nan)
    else:
        low, high = (np.nanmin(x), np.nanmax(x)) if n == 2 else (np.nan, np.nan)
    if not problems and high - low <= 1e-12:  # seeds alike (to round-off), how the problems vary unknown: none
        low = high = np.nan
    # every (unit, problem) value alike, to round-off (values of 1/3, a mean over cells, leave a variance that is
    # not exactly 0): unvaried_bounds, and no variance for the p-value either
    unvaried = ()
    if problems and bounds is not None and parts and np.nanmax(x) - np.nanmin(x) <= 1e-12:
        unvaried = (x.shape[2], tuple(bounds))
        low, high = unvaried_bounds(float(mean), *unvaried)
        parts = tuple((0.0, df) for _, df in parts)
    policies = int(np.isfinite(x).any(axis=tuple(range(1, x.ndim))).sum())
    return Estimate(float(mean), float(low), float(high), n, parts, problems, policies if policies >= 2 else 0,
                    unvaried)


def estimate(runs: pd.DataFrame, samples: dict, column: str = FINAL) -> Estimate:
    """One objective's ``column`` over its counted, ended runs (one cell): mean over seeds with its interval."""
    return interval_of(runs_scores(runs, samples, column), ACCURACY_RANGE)


def paired_units(a: dict, b: dict, factor: float = 1.0) -> dict:
    """key -> (policy, A's value - factor x B's, A's scores - factor x B's) over the (policy, seed) keys both have;
    the scores' difference only where both runs scored the same problems."""
    out = {}
    for seed in sorted(set(a) & set(b)):
        (policy, x, sx), (_, y, sy) = a[seed], b[seed]
        same = sx is not None and sy is not None and sx.index.equals(sy.index)
        out[seed] = (policy, x - factor * y, sx - factor * sy if same else None)
    return out


def common_units(strata: list[dict]) -> list[dict]:
    """Each cell's units (key -> (policy, value, scores)) restricted to the keys every cell has, in one order."""
    keys = sorted(set.intersection(*(set(units) for units in strata))) if strata else []
    return [{key: units[key] for key in keys} for units in strata]


def across_cells(per_cell: list[dict]) -> dict:
    """Units (key -> (policy, value, scores)) of several cells as one: the mean over the cells of each unit present
    in all of them; its scores the mean of the cells' where every cell has them on the same problems, else None."""
    common = common_units(per_cell)
    out = {}
    for key in common[0] if common else []:
        parts = [units[key] for units in common]
        scores = [s for _, _, s in parts]
        same = all(s is not None and s.index.equals(scores[0].index) for s in scores)
        out[key] = (parts[0][0], float(np.mean([v for _, v, _ in parts])),
                    sum(scores) / len(scores) if same else None)
    return out


def paired_estimate(runs: pd.DataFrame, samples: dict, a: str, b: str, column: str = FINAL) -> Estimate:
    """A − B of ``column`` in one cell, paired by seed and eval problem, with its interval."""
    return interval_of(paired_units(*(runs_scores(runs[runs["objective"] == o], samples, column) for o in (a, b))),
                       DIFFERENCE_RANGE)


def resampled_values(units: dict, n_boot: int = N_BOOT, rng=None) -> np.ndarray:
    """Each unit's value (a run's accuracy, or a pair of runs' accuracies on a trailing axis) in n_boot hierarchical
    bootstrap resamples of starting policies, seeds and eval problems: (n_boot, units[, ...]), NaN where a resample
    has fewer units (a starting policy with fewer seeds). Drawn as analysis.stats.resample draws them, without
    building every resampled score: the seeds by resampling their positions, the shared eval problems as how often
    each was drawn (a multinomial count), each run's accuracy then the count-weighted mean of its scores."""
    x, levels, problems = dense(units)
    rng = rng if rng is not None else np.random.default_rng(BOOT_SEED)
    policies, seeds = x.shape[:2]
    present = np.isfinite(x).reshape(policies, seeds, -1).any(axis=2)
    positions = np.where(present, np.arange(policies * seeds).reshape(policies, seeds), np.nan)
    drawn = resample(positions, levels[:2], n_boot, rng).reshape(n_boot, -1)  # (n_boot, slots): a unit or NaN
    trailing = x.shape[3:] if problems else x.shape[2:]
    flat = x.reshape(policies * seeds, -1, int(np.prod(trailing))) if problems else \
        x.reshape(policies * seeds, 1, int(np.prod(trailing)))
    if problems:
        n = flat.shape[1]
        picks = rng.integers(0, n, size=(n_boot, n)) + n * np.arange(n_boot)[:, None]
        counts = np.bincount(picks.ravel(), minlength=n_boot * n).reshape(n_boot, n)
        values = np.einsum("bp,upt->but", counts, np.nan_to_num(flat)) / n
    else:
        values = np.broadcast_to(flat[:, 0], (n_boot, *flat[:, 0].shape))
    taken = np.take_along_axis(values, np.nan_to_num(drawn).astype(int)[..., None], axis=1)
    taken = np.where(np.isnan(drawn)[..., None], np.nan, taken)
    return taken.reshape(n_boot, -1, *trailing)
