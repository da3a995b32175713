"""Statistics over seeds.

Conventions: from 3 seeds on, the interval is a 95% percentile bootstrap of the mean over seeds: 2000 resamples of
the seeds with replacement drawn by ``numpy.random.default_rng(0)`` (deterministic), then the 2.5th and 97.5th
percentiles of the resampled means (``numpy.percentile``, linear). With 2 seeds such a "CI" is just the two values, so
the interval is the range (min–max) and is called so; with 1 seed there is none (NaN). The IQM (rliable) is the mean
of the middle 50% of seeds, ``scipy.stats.trim_mean(x, 0.25)``, reported with 5+ seeds.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.stats import binomtest, trim_mean

N_BOOT, BOOT_SEED, LEVEL = 2000, 0, 0.95
IQM_MIN_SEEDS, CI_MIN_SEEDS = 5, 3
CI_METHOD = f"{LEVEL:.0%} percentile bootstrap CI over seeds ({N_BOOT} resamples, seed {BOOT_SEED})"
INTERVALS = (f"{CI_METHOD} with n >= {CI_MIN_SEEDS} seeds, the range (min–max) with n = 2, none with n = 1 "
             "(n = seeds)")


def num(value) -> str:
    """3 significant digits, trailing zeros kept (0.0820, 63.0); integers with separators from 1000 on."""
    if value is None or pd.isna(value):
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:#.3g}".rstrip(".")


def interval_name(n: int) -> str:
    """What the interval of n seeds is: '95% CI', 'range' or 'no interval'."""
    return f"{LEVEL:.0%} CI" if n >= CI_MIN_SEEDS else "range" if n == 2 else "no interval"


def bootstrap_ci(values) -> tuple[float, float]:
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return np.nan, np.nan
    means = x[np.random.default_rng(BOOT_SEED).integers(0, len(x), size=(N_BOOT, len(x)))].mean(axis=1)
    lo, hi = np.percentile(means, [50 * (1 - LEVEL), 50 * (1 + LEVEL)])
    return float(lo), float(hi)


def describe(values) -> dict:
    """mean, ci_low, ci_high (the bootstrap CI, or the range below CI_MIN_SEEDS: see interval_name), n (finite
    values) and iqm (NaN below IQM_MIN_SEEDS) of per-seed values."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    lo, hi = bootstrap_ci(x) if len(x) >= CI_MIN_SEEDS else (x.min(), x.max()) if len(x) == 2 else (np.nan, np.nan)
    return {"mean": x.mean() if len(x) else np.nan, "ci_low": lo, "ci_high": hi, "n": len(x),
            "iqm": trim_mean(x, 0.25) if len(x) >= IQM_MIN_SEEDS else np.nan}


def smooth(metrics: pd.DataFrame, columns: list[str], window: int) -> pd.DataFrame:
    """Trailing rolling mean over `window` logged steps, per run (NaNs ignored)."""
    if window <= 1:
        return metrics
    out = metrics.copy()
    out[columns] = metrics.groupby("run_id")[columns].transform(lambda s: s.rolling(window, min_periods=1).mean())
    return out


def on_grid(metrics: pd.DataFrame, x: str, y: str, points: int = 100) -> pd.DataFrame:
    """Each run's y linearly interpolated onto a shared grid of x (NaN outside the run's own range), so that
    runs whose x differs (rollout tokens) can be averaged."""
    data = metrics.dropna(subset=[x, y])
    if data.empty:
        return data[["run_id", "objective", x, y]]
    grid = np.linspace(data[x].min(), data[x].max(), points)
    frames = []
    for (run_id, objective), run in data.groupby(["run_id", "objective"], sort=False):
        values = np.interp(grid, run[x], run[y], left=np.nan, right=np.nan)
        frames.append(pd.DataFrame({"run_id": run_id, "objective": objective, x: grid, y: values}))
    return pd.concat(frames, ignore_index=True)


def curve(metrics: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """Per objective and x: mean over runs of y, its bootstrap CI and the number of runs n."""
    rows = []
    for (objective, xv), group in metrics.dropna(subset=[y]).groupby(["objective", x]):
        rows.append({"objective": objective, x: xv, **describe(group[y])})
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
