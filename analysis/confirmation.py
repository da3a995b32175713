"""The zoo's confirmation (harness/apps/zoo.py's second stage): per objective of its plan, the paired difference of
final eval accuracy to the baseline over the planned design, Holm's correction over the plan's family, a verdict.

    write_confirmation(screen_dir, confirm_dir, plan, out_dir, stamp)   # -> leaderboard.csv, .md, .html

The unit of replication is a (starting policy, seed) pair: its runs in every cell of the plan start from one starting
policy (model.seed) with one seed. Per unit and eval problem the objective's score minus the baseline's (the same
problem, starting policy and seed: analysis.accuracy.paired_units), averaged over the cells; a unit that lacks a cell
is left out. These differences are a hierarchical design, levels starting policy -> seed -> eval problem
(analysis.stats.HIERARCHY, the problems crossed with the units): analysis.accuracy.interval_of's mean, variance parts
and t-test. Averaging over the cells inside a unit keeps the cells' shared starting policy in one unit: the cells'
estimates are not independent (they share the starting policies), so their variances do not add.

The family is every comparison of the plan (each planned objective with the baseline), m of them. Holm's step-down
(analysis.verdict.holm) adjusts their p-values: an objective is *confirmed above* (or *below*) the baseline when its
adjusted p is below the family-wise error rate ALPHA, with the sign of its difference; *not confirmed* otherwise; *not
tested* when the plan left it out; *incomplete* when a planned run of it or of the baseline did not end (no verdict on
a design other than the plan's). Each interval is drawn at the level at which Holm's procedure tests it (the i-th
smallest p at 1 - ALPHA / (m - i + 1) while every earlier one is rejected, the rest at the level of the first that is
not), so an interval excludes 0 exactly when Holm confirms: the intervals are adjusted, not simultaneous (Bonferroni's,
at 1 - ALPHA / m each, would be, and are wider). Holm rather than Benjamini–Hochberg: "confirmed" is a claim made of
each objective, so the error rate that matters is that of any false confirmation in the family (FWER); BH's false
discovery rate suits the screen, which only chooses what to test again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.accuracy import DIFFERENCE_RANGE, FINAL, Estimate, across_cells, interval_of, paired_units, runs_scores
from analysis.load import load_experiment
from analysis.report import render_html, render_md
from analysis.stats import INDICATIVE_BELOW, indicative, num, p_text, top_units
from analysis.verdict import ALPHA, holm
from harness.run.atomic import atomic_write
from harness.run.provenance import check_one_version, runs_stamp

VERDICTS = ("confirmed above", "confirmed below", "not confirmed", "not tested", "incomplete", "baseline")


def cell_units(runs: pd.DataFrame, samples: dict, objective: str, cells: list[int]) -> list[dict]:
    """The objective's units (analysis.accuracy.runs_scores of its final eval accuracy) in each of ``cells``."""
    return [runs_scores(runs[(runs["cell_id"] == c) & (runs["objective"] == objective)], samples, FINAL)
            for c in cells]


def difference(runs: pd.DataFrame, samples: dict, objective: str, baseline: str, cells: list[int]) -> dict:
    """The objective's paired differences to the baseline per unit, averaged over ``cells`` (module docstring)."""
    pairs = [paired_units(a, b) for a, b in zip(cell_units(runs, samples, objective, cells),
                                                 cell_units(runs, samples, baseline, cells), strict=True)]
    return across_cells(pairs)


def holm_levels(p_values, alpha: float = ALPHA) -> np.ndarray:
    """Per p-value the significance level at which Holm's step-down tests it (module docstring); NaN kept."""
    p = np.asarray(p_values, dtype=float)
    finite = np.flatnonzero(np.isfinite(p))
    order = finite[np.argsort(p[finite], kind="stable")]
    levels = np.full(p.shape, np.nan)
    level, rejecting = np.nan, True
    for i, j in enumerate(order):
        if rejecting:
            level = alpha / (len(order) - i)
            rejecting = p[j] < level
        levels[j] = level
    return levels


def replication(units: dict) -> str:
    """'3 starting policies x 5 seeds' of a unit dict (seeds per policy as a range when they differ)."""
    if not units:
        return "none"
    policies = pd.Series([p for p, _, _ in units.values()]).value_counts()
    seeds = f"{policies.min()}" if policies.min() == policies.max() else f"{policies.min()}-{policies.max()}"
    return f"{len(policies)} starting polic{'y' if len(policies) == 1 else 'ies'} x {seeds} seeds"


def verdicts(estimates: dict[str, Estimate], complete: dict[str, bool], planned: list[str], objectives: list[str],
             baseline: str) -> pd.DataFrame:
    """One row per objective: verdict, difference with its Holm-level interval, adjusted p and the level (see the
    module docstring). estimates: per planned objective (baseline excluded); complete: whether its runs ended."""
    family = [o for o in planned if o != baseline]
    # an incomplete comparison, or one without a p-value, stays in the family (m is the plan's) and is not confirmed
    p = [estimates[o].p_value if complete.get(o) and np.isfinite(estimates[o].p_value) else 1.0 for o in family]
    adjusted = dict(zip(family, holm(p), strict=True)) if family else {}
    levels = dict(zip(family, holm_levels(p), strict=True)) if family else {}
    rows = []
    for o in objectives:
        e = estimates.get(o)
        row = {"objective": o, "verdict": "not tested", "difference": np.nan, "low": np.nan, "high": np.nan,
               "p_value": np.nan, "holm_p": np.nan, "level": np.nan, "units": 0, "indicative": False}
        if o == baseline:
            row["verdict"] = "baseline"
        elif o in family and not complete.get(o):
            row["verdict"] = "incomplete"
        elif o in family:
            low, high = e.at(1 - levels[o])
            confirmed = adjusted[o] < ALPHA
            row.update(verdict=("confirmed above" if e.mean > 0 else "confirmed below") if confirmed else
                       "not confirmed", difference=e.mean, low=float(low), high=float(high), p_value=e.p_value,
                       holm_p=adjusted[o], level=1 - levels[o], units=e.n, indicative=indicative(top_units(e.n, e.top)))
        rows.append(row)
    return pd.DataFrame(rows)


def planned_complete(runs: pd.DataFrame, objective: str, expected: int) -> bool:
    """Whether the objective has ``expected`` counted runs that ended."""
    mine = runs[(runs["objective"] == objective) & runs["counted"] & runs["ended"]]
    return len(mine) >= expected


def confirmation(confirm_dir: Path, plan: dict) -> tuple[pd.DataFrame, dict, pd.DataFrame, str]:
    """The verdict table of the plan's objectives (and every other objective the plan lists as not tested), the
    units of each difference, the runs and the models they trained ("tiny on arith")."""
    exp = load_experiment(confirm_dir)
    runs = exp.runs
    ended = runs.loc[runs["counted"] & runs["ended"], "code"]
    check_one_version(ended.tolist(), confirm_dir, "the confirmation's runs")  # its differences pair objectives' runs
    cells = sorted(runs["cell_id"].unique())
    baseline, planned = plan["baseline"], list(plan["objectives"])
    expected = len(plan["start_seeds"]) * len(plan["seeds"]) * len(cells)
    complete = {o: planned_complete(runs, o, expected) and planned_complete(runs, baseline, expected)
                for o in planned}
    units = {o: difference(runs, exp.samples, o, baseline, cells) for o in planned if o != baseline}
    estimates = {o: interval_of(u, DIFFERENCE_RANGE) for o, u in units.items()}
    objectives = planned + list(plan["not_tested"])
    models = sorted({f"{c.get('model.name')} on {c.get('task.name')}" for c in exp.configs.values() if c})
    return verdicts(estimates, complete, planned, objectives, baseline), units, runs, ", ".join(models)


def shown(table: pd.DataFrame, units: dict, plan: dict) -> pd.DataFrame:
    """The table as leaderboard.md shows it."""
    why = {**plan["objectives"], **plan["not_tested"]}
    baseline = plan["baseline"]
    interval = [("" if pd.isna(d) else f"{num(d)} [{num(lo)}, {num(hi)}] at {lv:.2%}")
                for d, lo, hi, lv in zip(table["difference"], table["low"], table["high"], table["level"],
                                         strict=True)]
    verdict = [f"{v}, indicative" if mark and v.startswith("confirmed") else v
               for v, mark in zip(table["verdict"], table["indicative"], strict=True)]
    return pd.DataFrame({"objective": table["objective"], "verdict": verdict,
                         f"− {baseline} [Holm-level CI]": interval,
                         "Holm p": [("" if pd.isna(p) else p_text(p)) for p in table["holm_p"]],
                         "replication": [replication(units.get(o, {})) if o in units else "" for o in
                                         table["objective"]],
                         "why (the plan)": [why.get(o, "") for o in table["objective"]]})


def which_eval_problems(plan: dict) -> str:
    """The confirmation's eval problems in words: its own set (task.eval_set), or, in a plan made before the
    confirmation had one, the screen's."""
    if "eval_set" not in plan:
        return ("the screen's (a plan made before the confirmation had eval problems of its own: the luck on those "
                "problems that selected an objective is scored again)")
    if plan["eval_set"] is None:
        return ("the screen's (the task has one held-out set, no task.eval_set: the luck on those problems that "
                "selected an objective is scored again)")
    return (f"task.eval_set {plan['eval_set']}, none of them the screen's (set {plan['screen']['eval_set']}) or a "
            "train problem: the luck on the screen's problems that selected an objective is not scored again")


def write_confirmation(screen_dir: Path, confirm_dir: Path, plan: dict, out_dir: Path, stamp: str) -> Path:
    """leaderboard.csv, .md and .html of the confirmation into ``out_dir`` (each written whole, then renamed into
    place); returns the .md's path."""
    table, units, runs, models = confirmation(confirm_dir, plan)
    counted = runs[runs["counted"] & runs["ended"]]
    correction = plan["correction"]
    size = correction["size"]
    family = (f"Family: {size} comparison{'s' * (size != 1)} with {plan['baseline']} (every planned objective's); "
              f"correction: Holm's step-down, family-wise error rate {correction['alpha']:g}; each interval at the "
              "level at which Holm tests it (it excludes 0 exactly when the difference is confirmed; adjusted, not "
              "simultaneous). Replication per comparison: "
              f"{len(plan['start_seeds'])} starting policies (model.seed {plan['start_seeds']}) x "
              f"{len(plan['seeds'])} seeds ({plan['seeds']}) x {len(plan['cells'])} cells "
              f"({'; '.join(f'{e}: {a}' for e, a in plan['cells'].items())}); starting policies and seeds none of "
              f"the screen's; eval problems {which_eval_problems(plan)}; the difference is per (starting policy, "
              "seed) the mean over the cells, by eval problem. Each interval's degrees of freedom: Welch–Satterthwaite "
              "over the starting policies' spread (theirs) and the eval problems' own (analysis/stats.py). "
              f"\"Indicative\": from fewer than {INDICATIVE_BELOW} starting policies, where the interval's coverage "
              "falls short of its level in some simulated case (tests/test_coverage.py): a confirmation from them "
              f"says where to look, not a verdict. Model: {models}.")
    blocks = [("h1", "Objective leaderboard: the zoo, confirmed"), ("p", stamp), ("p", family),
              ("p", runs_stamp(counted.to_dict("records"))), ("table", shown(table, units, plan)),
              ("p", f"Plan: {confirm_dir / 'plan.md'} (written before the confirmation ran: {plan['rule']}). The "
                    f"screen's leaderboard, every objective from one starting policy with unadjusted intervals: "
                    f"{screen_dir / 'leaderboard.md'}. Module: analysis/confirmation.py.")]
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "leaderboard.csv", table.to_csv(index=False))
    atomic_write(out_dir / "leaderboard.md", render_md(blocks))
    atomic_write(out_dir / "leaderboard.html", render_html(blocks, out_dir, "Objective leaderboard: the zoo"))
    return out_dir / "leaderboard.md"
