"""Compute-vs-performance fit per objective, the sigmoid of ScaleRL (Khatri et al., "The Art of Scaling
Reinforcement Learning Compute for LLMs", arXiv 2510.13786):

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)

R: greedy held-out eval accuracy (`eval_accuracy`); C: cumulative sampled completion tokens (`rollout_tokens`; our
stand-in for the paper's GPU-hours); R0: the accuracy before training (R -> R0 as C -> 0); A: the asymptote (the
accuracy the recipe saturates at); B: the scaling exponent (compute efficiency, how steep the rise is); C_mid: the
compute at which half of the gain A - R0 is reached.

What the paper does, and what we do at our scale (a handful of eval points per run, 1-10 seeds):
- Data. The paper fits the mean validation pass rate against compute. We fit the mean curve over seeds of each
  objective's finished runs: at each eval step that every one of those runs logged, R = the mean over seeds of
  `eval_accuracy` and C = the mean over seeds of `rollout_tokens` at that step (the seeds' token counts differ by a
  few %, their steps coincide). Unweighted least squares (scipy.optimize.curve_fit, method "trf").
- R0. The paper's R0 is the initial performance. We fix it to the mean step-0 eval accuracy (a measured point, the
  curve's value at C = 0, which a log-compute axis cannot hold) instead of fitting it: 3 free parameters, not 4.
- The early regime. The paper leaves out the first, noisy part of each run (roughly the first 1.5k GPU-hours) from
  the fit. Our runs have a few eval points each, the first one eval_every steps in: we leave out none. Every eval
  point after step 0 is fitted.
- Bounds. A in [R0, 1] (accuracy cannot exceed 1; a recipe that makes the policy worse has no rising sigmoid),
  B in [0, inf), C_mid > 0 fitted as log C_mid (it spans orders of magnitude) within C_MID_RANGE-fold of the
  fitted points' tokens (further out the curve is flat over the points; the box keeps the optimizer finite).
- Start. The main fit starts from 9 points (B in {0.5, 1, 2} x C_mid at the smallest, middle and largest fitted
  C; A at the best mean accuracy) and keeps the least-squares best.
- Converged, defined: (1) at least MIN_POINTS fitted points (two per free parameter: 4 points leave one degree of
  freedom, which any smooth rise fits), (2) curve_fit returns (no error, no
  evaluation limit), (3) A, B, C_mid finite and none at a bound (within BOUND_TOL; log C_mid for C_mid): at a
  bound the estimate is the bound's, not the data's (A = R0: a flat curve, where B and C_mid drop out; A = 1: a
  rise that shows no saturation), (4) the covariance is not degenerate: the Jacobian of R with respect to
  (A, B, log C_mid) at the fit has full rank and condition number at most COND_MAX (it fails when the points pin
  down only a combination of the parameters, e.g. a step: B -> inf, C_mid anywhere between two points), (5) the
  points span the rise: the fitted curve is at most SPAN[0] of its gain A - R0 at the first fitted point and at least
  SPAN[1] at the last (else A, or R0's side, is an extrapolation of the sigmoid's shape, not a measurement).
  A fit that does not converge is not drawn and not tabulated; the reason is. The figure draws a converged fit
  over its points only, never beyond them.
- Error bars. The paper gauges the run-to-run spread of A from repeated runs of one recipe (as we read it: about
  +-0.02; the sources searched here confirm the formula, the parameters' roles and the left-out early regime,
  not this number). We bootstrap over seeds with
  analysis.stats' conventions: N_BOOT resamples of the seeds with replacement drawn by
  numpy.random.default_rng(BOOT_SEED), the mean curve of each resample refitted (starting from the main fit), the
  LEVEL percentile interval of A and of B over the refits. A resample repeats a multiset of seeds, so each distinct
  multiset is fitted once (the result is the same as refitting every draw). Below CI_MIN_SEEDS seeds: no interval.
  If fewer than LEVEL of the refits converge: no interval either (an interval over the converging ones only would
  be conditional on converging), and the table says how many did.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy.optimize import OptimizeWarning, curve_fit
from scipy.special import expit

from analysis.stats import BOOT_SEED, CI_MIN_SEEDS, LEVEL, N_BOOT, num

X, Y = "rollout_tokens", "eval_accuracy"
PARAMETERS = ("A", "B", "C_mid")
COND_MAX = 1e6  # the largest condition number of the Jacobian (A, B, log C_mid) a converged fit may have
BOUND_TOL = 1e-3  # A, B or log C_mid this close to a bound is at the bound
C_MID_RANGE = 1e6  # C_mid lies within this factor of the fitted points' rollout tokens
START_B = (0.5, 1.0, 2.0)
MIN_POINTS = 2 * 3  # two fitted points per free parameter
SPAN = (0.25, 0.75)  # the fraction of the gain the fit must be below at the first point and above at the last
PAPER = "ScaleRL (arXiv 2510.13786)"
SUMMARY = (f"The sigmoid of {PAPER}, R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), fitted per objective "
           "(scipy.optimize.curve_fit) to the mean over its finished seeds of greedy eval accuracy R against rollout "
           "tokens C at the eval steps they share, every eval point after step 0 fitted; R0 fixed to the step-0 "
           "accuracy; A in [R0, 1], B >= 0, C_mid > 0. A: the asymptote; B: the exponent (compute efficiency); "
           f"C_mid: the rollout tokens at half the gain A - R0. Converged: at least {MIN_POINTS} eval points (two "
           f"per parameter), curve_fit succeeds, no parameter at a bound (within {BOUND_TOL:g}), the Jacobian's "
           f"condition number at most {COND_MAX:.0e}, and the points span the rise (the fit at most "
           f"{SPAN[0]:.0%} of its gain at the first point, at least {SPAN[1]:.0%} at the last). Interval: "
           f"{LEVEL:.0%} percentile bootstrap over seeds ({N_BOOT} resamples, "
           f"seed {BOOT_SEED}) of the refitted A and B, from {CI_MIN_SEEDS} seeds, shown when at least {LEVEL:.0%} "
           "of the refits converge. Every choice: analysis/scaling.py.")
NO_CI = {"A_ci": (np.nan, np.nan), "B_ci": (np.nan, np.nan), "converged": 0, "note": "none"}


def sigmoid(compute, r0: float, a: float, b: float, c_mid: float) -> np.ndarray:
    """R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), computed as R0 + (A - R0) * expit(B (log C - log C_mid))
    (no overflow); C > 0."""
    return r0 + (a - r0) * expit(b * (np.log(compute) - np.log(c_mid)))


def jacobian(compute, r0: float, a: float, b: float, log_c_mid: float) -> np.ndarray:
    """dR / d(A, B, log C_mid), one row per C. With s = expit(B (log C - log C_mid)) = 1 / (1 + (C_mid / C)^B):
    dR/dA = s, dR/dB = (A - R0) s (1 - s) (log C - log C_mid), dR/dlog C_mid = -(A - R0) s (1 - s) B."""
    z = np.log(compute) - log_c_mid
    s = expit(b * z)
    slope = (a - r0) * s * (1 - s)
    return np.column_stack([s, slope * z, -slope * b])


@dataclass(frozen=True)
class Fit:
    """One fit of the sigmoid to one curve; A, B, C_mid are NaN and `reason` says why unless it converged."""
    r0: float
    points: int  # fitted points (C > 0)
    a: float = np.nan
    b: float = np.nan
    c_mid: float = np.nan
    reason: str = ""

    @property
    def converged(self) -> bool:
        return not self.reason


def fit_curve(compute, accuracy, r0: float, start: tuple[float, float, float] | None = None) -> Fit:
    """Least-squares fit of (A, B, log C_mid) with R0 fixed, on the points with C > 0, within the module's bounds;
    from `start` (A, B, C_mid) or else the best of the module's 9 starts. Returns a converged Fit or the reason it
    is not (see the module docstring for the definition)."""
    c, y = np.asarray(compute, dtype=float), np.asarray(accuracy, dtype=float)
    keep = np.isfinite(c) & np.isfinite(y) & (c > 0)
    c, y = c[keep], y[keep]
    n = len(c)
    if n < MIN_POINTS:
        return Fit(r0, n, reason=f"{n} eval points after step 0, {len(PARAMETERS)} parameters: too few to fit (needs "
                                 f"{MIN_POINTS}, two per parameter)")
    if not r0 < 1:
        return Fit(r0, n, reason=f"R0 = {num(r0)}: starts at the top, nothing to fit")
    lower, upper = [r0, 0.0, np.log(c.min() / C_MID_RANGE)], [1.0, np.inf, np.log(c.max() * C_MID_RANGE)]

    def model(x, a, b, log_c_mid):
        return sigmoid(x, r0, a, b, np.exp(log_c_mid))

    def model_jac(x, a, b, log_c_mid):
        return jacobian(x, r0, a, b, log_c_mid)

    if start is None:
        a0 = float(np.clip(y.max(), r0, 1.0))
        starts = [(a0, b0, c0) for b0 in START_B for c0 in np.quantile(c, [0, 0.5, 1])]
    else:
        starts = [start]
    best, error = None, "no start"
    for a0, b0, c0 in starts:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", OptimizeWarning)  # the covariance is judged below, on the Jacobian
                popt, _ = curve_fit(model, c, y, p0=[a0, b0, np.log(c0)], bounds=(lower, upper), jac=model_jac,
                                    method="trf", max_nfev=2000)
        except (RuntimeError, ValueError) as e:
            error = str(e)
            continue
        cost = float(np.sum((model(c, *popt) - y) ** 2))
        if best is None or cost < best[0]:
            best = (cost, popt)
    if best is None:
        return Fit(r0, n, reason=f"curve_fit did not converge ({error})")
    a, b, log_c_mid = best[1]
    if not np.all(np.isfinite(best[1])):
        return Fit(r0, n, reason="curve_fit returned non-finite parameters")
    limits = [(a, r0, f"A at its lower bound R0 = {num(r0)}: a flat curve, B and C_mid not identifiable"),
              (a, 1.0, "A at its upper bound 1: the points show no saturation, the asymptote is the bound's, not "
                       "the data's"),
              (b, 0.0, "B at its bound 0: a flat curve, A and C_mid not identifiable"),
              (log_c_mid, lower[2], f"C_mid at its bound {C_MID_RANGE:.0e}-fold below the points: not identifiable"),
              (log_c_mid, upper[2], f"C_mid at its bound {C_MID_RANGE:.0e}-fold above the points: not identifiable")]
    pinned = [why for value, bound, why in limits if abs(value - bound) <= BOUND_TOL]
    if pinned:
        return Fit(r0, n, reason="; ".join(pinned))
    singular = np.linalg.svd(jacobian(c, r0, a, b, log_c_mid), compute_uv=False)
    cond = singular[0] / singular[-1] if singular[-1] > 0 else np.inf
    if not cond <= COND_MAX:
        return Fit(r0, n, reason=f"degenerate covariance (condition number of the Jacobian {cond:.2g} > "
                                 f"{COND_MAX:.0g}): parameters not identifiable")
    first, last = expit(b * (np.log([c.min(), c.max()]) - log_c_mid))
    if first > SPAN[0] or last < SPAN[1]:
        return Fit(r0, n, reason=f"the points do not span the rise: the fit goes from {first:.0%} to {last:.0%} of its "
                                 f"gain over them (needs at most {SPAN[0]:.0%} to at least {SPAN[1]:.0%})")
    return Fit(r0, n, float(a), float(b), float(np.exp(log_c_mid)))


def bootstrap(compute: np.ndarray, accuracy: np.ndarray, start_accuracy: np.ndarray, fit: Fit) -> dict:
    """Percentile bootstrap over seeds of A and B: compute and accuracy are (seeds, points) matrices of each seed's
    rollout tokens and eval accuracy at the shared eval steps after step 0, start_accuracy each seed's step-0
    accuracy. Each of N_BOOT resamples of the seeds (numpy.random.default_rng(BOOT_SEED)) is refitted on its mean
    curve (R0 = its mean step-0 accuracy) from the main fit. Returns A_ci and B_ci ((low, high), or NaNs: fewer than
    CI_MIN_SEEDS seeds, or fewer than LEVEL of the refits converged), the number converged and `note`."""
    seeds = len(start_accuracy)
    if seeds < CI_MIN_SEEDS:
        return NO_CI | {"note": f"none: {seeds} seed{'s' * (seeds != 1)} (the bootstrap needs {CI_MIN_SEEDS}+)"}
    draws = np.sort(np.random.default_rng(BOOT_SEED).integers(0, seeds, size=(N_BOOT, seeds)), axis=1)
    distinct, which = np.unique(draws, axis=0, return_inverse=True)
    refits = [fit_curve(compute[d].mean(axis=0), accuracy[d].mean(axis=0), start_accuracy[d].mean(),
                        start=(fit.a, fit.b, fit.c_mid)) for d in distinct]
    params = np.array([(f.a, f.b) for f in refits])[which.ravel()]
    ok = np.isfinite(params).all(axis=1)
    converged = int(ok.sum())
    if converged < LEVEL * N_BOOT:
        return NO_CI | {"converged": converged,
                       "note": f"none: {converged} of {N_BOOT} refits converged (< {LEVEL:.0%})"}
    low, high = np.percentile(params[ok], [50 * (1 - LEVEL), 50 * (1 + LEVEL)], axis=0)
    return {"A_ci": (float(low[0]), float(high[0])), "B_ci": (float(low[1]), float(high[1])), "converged": converged,
            "note": f"{LEVEL:.0%} CI, {converged} of {N_BOOT} refits converged"}


@dataclass
class ObjectiveFit:
    """An objective's mean curve (tokens, accuracy: means over seeds at the shared eval steps after step 0;
    per_seed: seeds x points accuracy), its fit and the bootstrap of A and B."""
    objective: str
    seeds: int
    fit: Fit
    tokens: np.ndarray = field(default_factory=lambda: np.empty(0))
    accuracy: np.ndarray = field(default_factory=lambda: np.empty(0))
    per_seed: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))
    ci: dict = field(default_factory=lambda: NO_CI)


def seed_curves(metrics: pd.DataFrame, run_ids) -> pd.DataFrame | None:
    """Eval points of the given runs at the steps all of them logged: rows = runs, columns = (quantity, step) for
    quantity in (rollout_tokens, eval_accuracy); None when there are none."""
    if X not in metrics or Y not in metrics:
        return None
    evals = metrics[metrics["run_id"].isin(list(run_ids))].dropna(subset=[X, Y])
    if evals.empty:
        return None
    table = evals.pivot_table(index="run_id", columns="step", values=[X, Y]).dropna(axis=1)
    if table.empty or X not in table.columns.get_level_values(0) or Y not in table.columns.get_level_values(0):
        return None
    shared = sorted(set(table[X].columns) & set(table[Y].columns))
    if not shared:
        return None
    return table.loc[:, [(q, s) for q in (X, Y) for s in shared]]


def fit_objective(objective: str, metrics: pd.DataFrame, run_ids) -> ObjectiveFit:
    """The fit of one objective on its runs' mean curve (see the module docstring), with the bootstrap of A, B."""
    run_ids = list(run_ids)
    curves = seed_curves(metrics, run_ids) if run_ids else None
    if curves is None:
        return ObjectiveFit(objective, len(run_ids), Fit(np.nan, 0, reason="no eval points shared by its finished "
                                                                            "runs"))
    seeds = len(curves)
    steps = np.array(curves[Y].columns)
    if 0 not in steps:
        return ObjectiveFit(objective, seeds, Fit(np.nan, 0, reason="no step-0 evaluation: R0 unknown"))
    later = steps > 0
    tokens, accuracy = curves[X].to_numpy()[:, later], curves[Y].to_numpy()[:, later]
    start = curves[(Y, 0)].to_numpy()
    fit = fit_curve(tokens.mean(axis=0), accuracy.mean(axis=0), float(start.mean()))
    ci = bootstrap(tokens, accuracy, start, fit) if fit.converged else NO_CI
    return ObjectiveFit(objective, seeds, fit, tokens.mean(axis=0), accuracy.mean(axis=0), accuracy, ci)


def fit_objectives(metrics: pd.DataFrame, runs: pd.DataFrame) -> list[ObjectiveFit]:
    """fit_objective for every objective of `runs` (sorted), on its finished runs."""
    done = runs[runs["complete"]]
    return [fit_objective(o, metrics, done.loc[done["objective"] == o, "run_id"])
            for o in sorted(runs["objective"].unique())]


def with_ci(value: float, ci: tuple[float, float]) -> str:
    return num(value) + ("" if np.isnan(ci[0]) else f" [{num(ci[0])}, {num(ci[1])}]")


def fit_table(fits: list[ObjectiveFit]) -> pd.DataFrame:
    """objective | seeds | points | R0 | A [CI] | B [CI] | C_mid | converged? | interval (numbers only for converged
    fits)."""
    rows = []
    for f in fits:
        ok = f.fit.converged
        rows.append({"objective": f.objective, "seeds": f.seeds, "points": f.fit.points, "R0": num(f.fit.r0),
                     "A [CI]": with_ci(f.fit.a, f.ci["A_ci"]) if ok else "",
                     "B [CI]": with_ci(f.fit.b, f.ci["B_ci"]) if ok else "",
                     "C_mid": num(f.fit.c_mid) if ok else "",
                     "converged?": "yes" if ok else f"no: {f.fit.reason}", "interval": f.ci["note"] if ok else ""})
    return pd.DataFrame(rows)


def fit_numbers(fits: list[ObjectiveFit]) -> pd.DataFrame:
    """The fits as numbers (the CSV): NaN where a fit did not converge or has no interval."""
    return pd.DataFrame([{"objective": f.objective, "seeds": f.seeds, "points": f.fit.points, "R0": f.fit.r0,
                          "A": f.fit.a, "A_ci_low": f.ci["A_ci"][0], "A_ci_high": f.ci["A_ci"][1], "B": f.fit.b,
                          "B_ci_low": f.ci["B_ci"][0], "B_ci_high": f.ci["B_ci"][1], "C_mid": f.fit.c_mid,
                          "converged": f.fit.converged, "reason": f.fit.reason,
                          "bootstrap_converged": f.ci["converged"]} for f in fits])
