"""Statistics over seeds and eval problems.

Two kinds of quantity, two interval methods, both chosen by their measured coverage (tests/test_coverage.py
simulates runs from known distributions and counts how often the reported 95% interval holds the truth):

- A per-seed value (a train metric at a step, a run's clip fraction or wall time): ``describe``. From CI_MIN_SEEDS
  seeds, the Student-t interval over seeds, mean +- t_{n-1, 0.975} s / sqrt(n); with 2 seeds the range (min–max),
  called so; with 1 none. A percentile bootstrap over 3 seeds covers far less than 95% (its resamples hold at most
  3 distinct values, its spread shrinks by (n-1)/n and it uses normal, not t, quantiles).
- An eval accuracy (and a paired difference of two): its runs record each eval problem's score
  (eval_samples.jsonl), so it is a hierarchical design, levels starting policy -> seed -> eval problem
  (``HIERARCHY``): ``estimate``. The eval problems are a sample of the task's problems, shared by every run of a cell
  (the same eval set: *crossed* with the seeds), so the seeds' spread alone misses the eval set's own noise (about
  sqrt(p(1-p)/n) at n problems). The variance of the mean is the sum of one part per independent source
  (``variance_parts``): the spread of the top-most nested level's unit means (the seeds: each seed's mean holds its
  own problem noise too) over their number, plus for each crossed level the spread of its unit means (each eval
  problem's mean over the runs) over their number; conservative by the seed x problem interaction counted twice.
  The interval is mean +- t_{df, 0.975} sqrt(V), df by Welch–Satterthwaite over the parts, where the crossed part
  counts with its own degrees of freedom only for the crossed units' own spread (its variance less the top level x
  crossed interaction, :func:`interaction`): the rest is noise the top level's part already holds, so it goes with
  the top level's degrees of freedom (counted with the problems' as well, a few starting policies passed for many
  more, and the interval missed its level at Holm's in simulation: tests/test_coverage.py). A level with one unit
  (one starting policy) is conditioned on: the interval is about that policy. Runs without per-problem scores fall
  back to ``describe``'s interval over seeds, and say so.

Below INDICATIVE_BELOW units of the top level (seeds, or starting policies where there are two or more) no method
we tried reaches its level in every simulated case (with skewed seed effects, or a large spread between starting
policies, the t-interval covers less): such intervals are marked "indicative". Statistics that
are not means (P(A > B), the IQM) take a hierarchical percentile bootstrap (``resample``, the same levels; N_BOOT
resamples drawn by ``numpy.random.default_rng(BOOT_SEED)``, deterministic), whose coverage is not measured. The IQM
(rliable) is the mean of the middle 50% of seeds, ``scipy.stats.trim_mean(x, 0.25)``, reported with 5+ seeds.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal

import numpy as np
import pandas as pd
from scipy.stats import binomtest, trim_mean
from scipy.stats import t as student_t

from analysis.cells import START_SEED

N_BOOT, BOOT_SEED, LEVEL = 2000, 0, 0.95
IQM_MIN_SEEDS, CI_MIN_SEEDS = 5, 3
INDICATIVE_BELOW = 5  # seeds: with fewer, the interval's coverage falls short of LEVEL in some simulated case
INTERVALS = (f"{LEVEL:.0%} Student-t interval over seeds with n >= {CI_MIN_SEEDS} seeds (\"indicative\" below "
             f"{INDICATIVE_BELOW}), the range (min–max) with n = 2, none with n = 1 (n = seeds)")
ACCURACY_INTERVALS = (f"{LEVEL:.0%} t-interval whose variance adds the spread between seeds and the spread between "
                      "eval problems (the eval set is a sample of the task's problems, the same for every run of a "
                      f"cell; analysis/stats.py), from 2 seeds; \"indicative\" below {INDICATIVE_BELOW} seeds, "
                      "where its coverage falls short of 95% in simulations")


@dataclass(frozen=True)
class Level:
    """One level of a hierarchical design: one axis of the data array, top level first."""

    name: str
    shared: bool = False  # crossed: the same units under every unit above (the eval problems of one eval set)


HIERARCHY = (Level("start_policy"), Level("seed"), Level("problem", shared=True))


def num(value) -> str:
    """3 significant digits, trailing zeros kept (0.0820, 63.0); integers with separators from 1000 on."""
    if value is None or pd.isna(value):
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:#.3g}".rstrip(".")


def p_text(p) -> str:
    """A p-value to 3 significant digits rounded down, so the text falls on the same side of every threshold of that
    precision as the value does: 0.04996 reads 0.0499, not num's 0.0500, beside a verdict made at p < 0.05."""
    if p is None or pd.isna(p):
        return "n/a"
    if p <= 0:
        return "0"
    exact = Decimal(repr(float(p)))
    floor = exact.quantize(Decimal(1).scaleb(exact.adjusted() - 2), rounding=ROUND_FLOOR)
    return f"{float(floor):#.3g}".rstrip(".")


def interval_name(n: int, policies: int = 1) -> str:
    """What describe()'s interval of n seeds is: '95% CI', 'range' or 'no interval'; from 2 starting policies
    (``policies``, describe's) it is the t-interval over their means, a 95% CI from 2 runs."""
    if n >= CI_MIN_SEEDS or (policies >= 2 and n >= 2):
        return f"{LEVEL:.0%} CI"
    return "range" if n == 2 else "no interval"


def indicative(n: int) -> bool:
    """Whether an interval over n seeds is marked indicative (see the module docstring)."""
    return 2 <= n < INDICATIVE_BELOW


def top_units(n, top) -> int:
    """The units of an interval's top level: its ``top`` starting policies where it has two or more, else its n
    seeds (``top`` 0, or unknown: a table without the column)."""
    return int(n if top is None or pd.isna(top) or not top else top)


def indicative_units(n, top) -> str:
    """'3 seeds' or, where the top level is the starting policies, '3 starting policies' (whatever their seeds: 3
    policies of one seed each are 3 starting policies)."""
    return f"{int(top)} starting policies" if top is not None and not pd.isna(top) and top else f"{n} seeds"


def bootstrap_ci(values) -> tuple[float, float]:
    """The 95% percentile bootstrap of the mean (N_BOOT resamples, BOOT_SEED); NaNs below 2 values."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return np.nan, np.nan
    means = x[np.random.default_rng(BOOT_SEED).integers(0, len(x), size=(N_BOOT, len(x)))].mean(axis=1)
    lo, hi = np.percentile(means, [50 * (1 - LEVEL), 50 * (1 + LEVEL)])
    return float(lo), float(hi)


def describe(values, policies=None) -> dict:
    """mean, ci_low, ci_high (the t-interval over seeds, or the range below CI_MIN_SEEDS: see interval_name), n
    (finite values) and iqm (NaN below IQM_MIN_SEEDS) of per-seed values. ``policies``: each value's starting policy
    (the level above the seeds, analysis/cells.py START_SEED); from 2 of them the mean is that of the policies'
    means and the interval is over those means (variance_parts with HIERARCHY's first two levels: nothing pools two
    starting policies as seeds of one), ``policies`` their number."""
    x = np.asarray(values, dtype=float)
    finite = np.isfinite(x)
    groups = pd.Series(np.asarray(policies, dtype=object)[finite] if policies is not None else 0).astype(str)
    x = x[finite]
    if groups.nunique() >= 2:
        rows = [x[(groups == p).to_numpy()] for p in sorted(groups.unique())]
        dense = np.full((len(rows), max(map(len, rows))), np.nan)
        for i, row in enumerate(rows):
            dense[i, :len(row)] = row
        mean, parts = variance_parts(dense, HIERARCHY[:2])
        lo, hi = t_bounds(mean, parts)
        return {"mean": float(mean), "ci_low": float(lo), "ci_high": float(hi), "n": len(x),
                "iqm": trim_mean(x, 0.25) if len(x) >= IQM_MIN_SEEDS else np.nan, "policies": len(rows)}
    lo, hi = (np.nan, np.nan)
    if len(x) >= CI_MIN_SEEDS:
        lo, hi = t_bounds(*variance_parts(x, (Level("seed"),)))
    elif len(x) == 2:
        lo, hi = x.min(), x.max()
    return {"mean": x.mean() if len(x) else np.nan, "ci_low": float(lo), "ci_high": float(hi), "n": len(x),
            "iqm": trim_mean(x, 0.25) if len(x) >= IQM_MIN_SEEDS else np.nan, "policies": 1 if len(x) else 0}


def unit_means(x: np.ndarray, axis: int, levels: int) -> np.ndarray:
    """The mean of each unit of level ``axis`` over the other level axes (the first ``levels`` axes of x; NaN marks
    no value), as (units, *trailing axes)."""
    others = tuple(a for a in range(levels) if a != axis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the mean of an all-NaN slice: NaN, as meant
        means = np.nanmean(x, axis=others) if others else x
    return means


def spread(means: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, variance of the mean = s^2 / n, degrees of freedom n - 1) of unit means along axis 0, NaNs left out."""
    n = np.isfinite(means).sum(axis=0)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # fewer than 2 units: NaN, as meant
        return np.nanmean(means, axis=0), np.nanvar(means, axis=0, ddof=1) / n, n - 1.0


def variance_parts(x, levels) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The mean of x and its variance as parts (variance, degrees of freedom), one per independent source (see the
    module docstring). x's first len(levels) axes are the levels, top first, NaN where a unit has no value; trailing
    axes are kept apart (several quantities at once). The mean is that of the nested source's unit means (equal
    weight per seed); no nested level with 2+ units: NaN variance."""
    x = np.asarray(x, dtype=float)
    k = len(levels)
    nested = [i for i, level in enumerate(levels) if not level.shared]
    means = [unit_means(x, i, k) for i in range(k)]  # each level's, once
    counts = [int(np.isfinite(m).any(axis=tuple(range(1, x.ndim - k + 1))).sum()) for m in means]
    top = next((i for i in nested if counts[i] >= 2), None)
    if top is None:
        mean = np.nanmean(x, axis=tuple(range(k))) if x.size else np.nan
        return mean, [(np.full_like(mean, np.nan), np.full_like(mean, np.nan))]
    mean, variance, df = spread(means[top])
    parts = [(variance, df)]
    for i, level in enumerate(levels):
        if level.shared and counts[i] >= 2:
            whole, shared_df = spread(means[i])[1:]
            own = np.maximum(whole - interaction(x, top, i, k), 0.0)  # the shared units' own spread
            parts = [(parts[0][0] + whole - own, parts[0][1]), *parts[1:], (own, shared_df)]
    return mean, parts


def interaction(x: np.ndarray, top: int, shared: int, levels: int) -> np.ndarray:
    """The share of the shared level's variance of the mean that the top level's spread also holds: the top x shared
    interaction mean square over the number of (top, shared) cells, sum r^2 / ((a - 1) (c - 1) a c), r the
    interaction residuals of the (top unit, shared unit) means (a top units, c shared ones; NaN cells left out)."""
    others = tuple(a for a in range(levels) if a not in (top, shared))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices: NaN, left out below
        cells = np.nanmean(x, axis=others) if others else x  # (top units, shared units, *trailing)
        if top > shared:
            cells = np.swapaxes(cells, 0, 1)
        residual = (cells - np.nanmean(cells, axis=1, keepdims=True) - np.nanmean(cells, axis=0, keepdims=True)
                    + np.nanmean(cells, axis=(0, 1), keepdims=True))
    a, c = np.isfinite(cells).any(axis=1).sum(axis=0), np.isfinite(cells).any(axis=0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.nansum(residual ** 2, axis=(0, 1)) / ((a - 1) * (c - 1) * a * c)


def t_bounds(mean, parts, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """mean +- t_{df, (1 + level) / 2} sqrt(V): V the sum of the parts' variances, df by Welch–Satterthwaite,
    (sum v)^2 / sum(v^2 / df). Zero variance: the interval is the mean (the quantity does not vary)."""
    variance, df = satterthwaite(parts)
    half = student_t.ppf(0.5 + level / 2, np.where(df > 0, df, np.nan)) * np.sqrt(variance)
    half = np.where(variance == 0, 0.0, half)
    return mean - half, mean + half


def satterthwaite(parts) -> tuple[np.ndarray, np.ndarray]:
    """(total variance, its Welch–Satterthwaite degrees of freedom) of independent parts (variance, df)."""
    variance = sum(v for v, _ in parts)
    with np.errstate(invalid="ignore", divide="ignore"):
        weight = sum(np.where(v > 0, v ** 2 / df, 0.0) for v, df in parts)
        df = np.where(weight > 0, variance ** 2 / weight, sum(df for _, df in parts))
    return variance, df


def smooth(metrics: pd.DataFrame, columns: list[str], window: int) -> pd.DataFrame:
    """Trailing rolling mean over `window` logged steps, per run (NaNs ignored)."""
    if window <= 1:
        return metrics
    out = metrics.copy()
    out[columns] = metrics.groupby("run_id")[columns].transform(lambda s: s.rolling(window, min_periods=1).mean())
    return out


def on_grid(metrics: pd.DataFrame, x: str, y: str, points: int = 100) -> pd.DataFrame:
    """Each run's y linearly interpolated onto a shared grid of x (NaN outside the run's own range), so that
    runs whose x differs (rollout tokens) can be averaged; a run's starting policy (START_SEED) kept when given."""
    data = metrics.dropna(subset=[x, y])
    kept = [c for c in ("run_id", "objective", START_SEED) if c in data]
    if data.empty:
        return data[[*kept, x, y]]
    grid = np.linspace(data[x].min(), data[x].max(), points)
    frames = []
    for names, run in data.groupby(kept, sort=False, dropna=False):
        values = np.interp(grid, run[x], run[y], left=np.nan, right=np.nan)
        frames.append(pd.DataFrame({**dict(zip(kept, names, strict=True)), x: grid, y: values}))
    return pd.concat(frames, ignore_index=True)


def curve(metrics: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """Per objective and x: mean over runs of y, its interval (describe's, over the starting policies' means when
    the runs have several: START_SEED) and the number of runs n."""
    rows = []
    for (objective, xv), group in metrics.dropna(subset=[y]).groupby(["objective", x]):
        rows.append({"objective": objective, x: xv,
                     **describe(group[y], group[START_SEED] if START_SEED in group else None)})
    return pd.DataFrame(rows, columns=["objective", x, "mean", "ci_low", "ci_high", "n"])


def coinciding(metrics: pd.DataFrame, columns: list[str], rtol: float = 1e-6) -> dict[tuple[str, str], tuple]:
    """Pairs of objectives whose mean curves (over seeds, by step) are equal to `rtol` at every step both logged:
    (a, b) -> (the columns where they are, the columns compared: both logged at least 2 shared steps)."""
    found = {}
    for column in columns:
        means = metrics.dropna(subset=[column]).groupby(["step", "objective"])[column].mean().unstack()
        for i, a in enumerate(means.columns):
            for b in means.columns[i + 1:]:
                shared = means[[a, b]].dropna()
                if len(shared) >= 2:
                    same, compared = found.setdefault((a, b), ([], []))
                    compared.append(column)
                    if np.allclose(shared[a], shared[b], rtol=rtol, atol=1e-12):
                        same.append(column)
    return {pair: lists for pair, lists in found.items() if lists[0]}


def rate_interval(k: int, n: int) -> tuple[float, float]:
    """Wilson score 95% interval of a proportion k/n (scipy.stats.binomtest(...).proportion_ci(method="wilson"));
    NaNs when n = 0. Wilson rather than the normal approximation: it stays inside [0, 1] and is not empty at k = 0."""
    if n == 0:
        return np.nan, np.nan
    ci = binomtest(int(k), int(n)).proportion_ci(LEVEL, method="wilson")
    return float(ci.low), float(ci.high)


def resample(x, levels, n_boot: int = N_BOOT, rng=None) -> np.ndarray:
    """n_boot hierarchical bootstrap resamples of x, shape (n_boot, *x.shape); x as in variance_parts, a unit's
    padding (NaN) after its units with values. Level by level from the top: a nested level's units are drawn with
    replacement within each (resampled) unit above, among those with a value; a shared level's units are drawn once
    per resample for every unit above (runs stay paired by eval problem). Trailing axes share the draws (two
    objectives' scores stay paired by seed and problem). rng: numpy.random.default_rng(BOOT_SEED) unless given."""
    x = np.asarray(x, dtype=float)
    rng = rng if rng is not None else np.random.default_rng(BOOT_SEED)
    out = np.broadcast_to(x, (n_boot, *x.shape))
    for i, level in enumerate(levels):
        n, below = x.shape[i], (1,) * (x.ndim - i - 1)
        if level.shared:
            index = rng.integers(0, n, size=(n_boot, *(1,) * i, n))
            out = np.take_along_axis(out, index.reshape(*index.shape, *below), axis=i + 1)
            continue
        count = np.isfinite(out).any(axis=tuple(range(i + 2, out.ndim))).sum(axis=-1, keepdims=True)
        index = np.minimum(np.floor(rng.random((*count.shape[:-1], n)) * count), n - 1).astype(int)
        out = np.take_along_axis(out, index.reshape(*index.shape, *below), axis=i + 1)
        empty = (np.arange(n) >= count).reshape(*count.shape[:-1], n, *below)
        out = np.where(empty, np.nan, out)
    return out
