"""The verdict: per cell, the objectives ranked by final eval accuracy, each with its paired difference to a baseline
objective (analysis/paired.py: by seed and eval problem), and one plain sentence saying which objective ends above or
below the baseline, with how many of the paired seeds agree.

Several objectives compared to one baseline are several tests: a difference counts when its Holm-adjusted p-value
(Holm's step-down correction of the paired t-tests' p-values, family-wise error rate LEVEL's complement over the
cell's comparisons) is below 1 - LEVEL. With one comparison that is the paired 95% interval excluding 0. Intervals
are shown unadjusted. The baseline: ``--baseline`` / ``sweep.baseline`` (recorded in manifest.json by the sweep),
else grpo when it has runs, else the sweep grid's first objective (analysis.paired.default_baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.accuracy import NO_INTERVAL
from analysis.stats import INDICATIVE_BELOW, LEVEL, indicative, indicative_units, num, p_text, top_units

ALPHA = 1 - LEVEL


def holm(p_values) -> np.ndarray:
    """Holm's adjusted p-values: sorted ascending, p_(i) (m - i + 1) made non-decreasing, capped at 1 (NaN kept)."""
    p = np.asarray(p_values, dtype=float)
    finite = np.flatnonzero(np.isfinite(p))
    adjusted = np.full(p.shape, np.nan)
    order = finite[np.argsort(p[finite], kind="stable")]
    m = len(order)
    running = 0.0
    for i, j in enumerate(order):
        running = max(running, min(1.0, (m - i) * p[j]))
        adjusted[j] = running
    return adjusted


@dataclass(frozen=True)
class CellVerdict:
    cell: str  # the cell's label ("all runs" when nothing is swept)
    table: pd.DataFrame  # the ranking: objective, final accuracy, vs baseline, seeds, Holm-adjusted p
    sentence: str


def interval_text(low, high) -> str:
    return "" if pd.isna(low) else f" [{num(low)}, {num(high)}]"


def seeds_note(n: int, top: int | None = None) -> str:
    """The indicative mark of a cell's sentence, by its comparisons' fewest top-level units (report.top_units)."""
    if not indicative(top_units(n, top)):
        return ""
    return f"; {indicative_units(n, top)}: indicative (coverage short of 95% below {INDICATIVE_BELOW})"


def seeds_only(problems, low) -> str:
    """The tables' mark of an interval over seeds only (``problems`` False), beside one that is shown (``low``)."""
    return " (seeds only)" if not pd.isna(low) and not bool(problems) else ""


def seeds_only_note(rows: pd.DataFrame) -> str:
    """What a cell's sentence says of its tested comparisons whose interval is over seeds only (``problems`` False: a
    run's per-problem scores are missing, do not give its value (analysis/accuracy.py run_scores) or are on other
    problems than its pair's), which leaves
    out the eval set's noise, as the tables mark "(seeds only)"."""
    if "problems" not in rows:
        return ""
    thin = rows[rows["holm"].notna() & ~rows["problems"].fillna(False).astype(bool)]["a"].tolist()
    return (f"; over seeds only for {' and '.join(thin)} (a run's per-problem scores, eval_samples.jsonl, are "
            "missing, do not give its accuracy, or are not on the same eval problems as the runs it is paired with: "
            "the interval leaves out the eval set's noise)" if thin else "")


def one_policy_note(tested: pd.DataFrame) -> str:
    """What a cell's sentence adds when every tested comparison rests on one starting policy (``top`` 0: its top level
    is the seeds): the finding, or the absence of one, is about that policy, which intervals over seeds and eval
    problems do not vary; with 2 or more starting policies for some comparisons, the others named; "" where every
    one has 2 or more, or where the rows do not say (no ``top`` column)."""
    if tested.empty or "top" not in tested:
        return ""
    one = tested[tested["top"].fillna(0) < 2]["a"].tolist()
    if len(one) < len(tested):  # the others resample their starting policies: name the comparisons that do not
        return (f"; {' and '.join(one)} paired with the baseline on one starting policy only: about that policy"
                if one else "")
    return ("; from one starting policy: about that policy, another may rank them otherwise (replicate it with "
            "sweep.grid.model.seed: docs/replicates.md)")


def sentence(rows: pd.DataFrame, baseline: str) -> str:
    """The cell's sentence from its comparisons to the baseline (a, n, difference, bounds, wins, losses, holm; with
    ``problems``, whether each interval holds the eval problems' spread)."""
    if rows.empty:
        return f"nothing to compare: no objective shares an ended seed with {baseline} here"
    tested = rows[rows["holm"].notna()]  # without an interval, no p-value: not in Holm's family
    family = f" (Holm-corrected over {len(tested)} comparisons)" if len(tested) > 1 else ""
    differ = rows[rows["holm"] < ALPHA]
    # the comparison of fewest top-level units decides the mark, among those with an interval (2 seeds or more)
    tops = rows["top"] if "top" in rows else pd.Series([None] * len(rows), index=rows.index)
    units = [unit for unit in zip(rows["n"], tops, strict=True) if unit[0] >= 2] or list(zip(rows["n"], tops,
                                                                                                strict=True))
    fewest = min(units, key=lambda unit: top_units(*unit))
    n, top = int(fewest[0]), fewest[1]
    if differ.empty:
        alone = tested[tested["p_value"] < ALPHA]["a"].tolist()  # the t-test: describe's range of 2 seeds is no test
        shown_excludes = ((tested["difference_low"] > 0) | (tested["difference_high"] < 0)).any()  # a range
        why = (": no paired interval" if tested.empty else
               ": every paired interval includes 0" if not alone and not shown_excludes else
               ": no paired t-test excludes 0 at 95% (the range of 2 seeds is not a 95% interval)" if not alone else
               f": {' and '.join(alone)}'s interval{'s' * (len(alone) > 1)} alone exclude{'s' * (len(alone) == 1)} 0, "
               "not after the correction")
        untested = rows[rows["holm"].isna()]["a"].tolist()
        none = f"; none for {' and '.join(untested)}" if untested and not tested.empty else ""
        reason = f" ({NO_INTERVAL})" if untested else ""
        said = (f"cannot tell whether any objective differs from {baseline} at this budget" if tested.empty else
                f"no objective differs from {baseline} at this budget")  # no test made: no finding of no difference
        return f"{said}{why}{none}{reason}{family}{seeds_note(n, top)}{seeds_only_note(rows)}{one_policy_note(tested)}"
    parts = []
    for row in differ.itertuples():
        above = row.difference > 0
        agree = row.wins if above else row.losses
        parts.append(f"{row.a} ends {'above' if above else 'below'} {baseline} by {num(abs(row.difference))}"
                     f"{interval_text(row.difference_low, row.difference_high)}, {agree} of {row.n} seeds")
    others = len(rows) - len(differ)
    tail = f"; the other {others} do not differ from it" if others > 1 else "; the other does not" if others else ""
    return "; ".join(parts) + tail + family + seeds_note(n, top) + seeds_only_note(rows) + one_policy_note(tested)


def ranking(group: pd.DataFrame, versus: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """The cell's objectives (eval_table rows, best first) with their comparison to the baseline (versus: paired rows
    against it, with `holm`)."""
    by = versus.set_index("a")

    def against(o: str, text) -> str:
        return text(by.loc[o]) if o in by.index else ""

    objectives = list(group["objective"])
    return pd.DataFrame({
        "objective": [o + (" (baseline)" if o == baseline else "") for o in objectives],
        "final accuracy": [f"{num(m)}{interval_text(lo, hi)}{seeds_only(p, lo)}" for m, lo, hi, p in
                           zip(group["final_mean"], group["final_ci_low"], group["final_ci_high"],
                               group.get("final_problems", pd.Series(True, index=group.index)), strict=True)],
        f"− {baseline}": [against(o, lambda r: num(r["difference"]) + interval_text(r["difference_low"],
                                                                                    r["difference_high"])
                                  + seeds_only(r.get("problems", True), r["difference_low"]))
                          for o in objectives],
        "seeds above/paired": [against(o, lambda r: f"{r['wins']}/{r['n']}") for o in objectives],
        "Holm p": [against(o, lambda r: p_text(r["holm"])) for o in objectives]})


def versus_baseline(pairs: pd.DataFrame, baseline: str | None) -> pd.DataFrame:
    """The rows of paired.per_cell that compare an objective (A) to the baseline (B), with ``holm``: their p-values
    Holm-adjusted within each cell (the family the verdict corrects over)."""
    versus = pairs[pairs["b"] == baseline].copy()
    versus["holm"] = np.nan
    for _, group in versus.groupby("cell_id", sort=True):
        versus.loc[group.index, "holm"] = holm(group["p_value"])
    return versus


def code_note(objectives: list[str], codes: dict[str, str]) -> str:
    """What a verdict (or a leaderboard) says when the ``objectives`` it compares were run by different code versions
    (``codes``: objective -> version, where the version is constant within each objective, analysis/cells.py; a
    baseline that `make compare` kept from an earlier sweep is not run again): each difference then includes the
    change between the versions. "" when they were run by one."""
    compared = [o for o in dict.fromkeys(objectives) if o in codes]
    if len({codes[o] for o in compared}) < 2:
        return ""
    by_code: dict[str, list[str]] = {}
    for objective in compared:
        by_code.setdefault(codes[objective], []).append(objective)
    shown = "; ".join(f"{', '.join(objectives)} by `{code}`" for code, objectives in by_code.items())
    return (f"run by different code: {shown}; each difference includes the change between them: to compare the "
            "objectives alone, run them under one code version, e.g. into another results_dir")


def cell_verdicts(table: pd.DataFrame, pairs: pd.DataFrame, labels: list[str], baseline: str | None,
                  codes: dict[str, str] | None = None) -> list[CellVerdict]:
    """Per cell with an ended run: the ranking and the sentence. table: report.eval_table; pairs: paired.per_cell
    (pairs against the baseline first, A the objective); codes: each objective's code version when it differs
    between objectives and not within one (else the cells keep versions apart): :func:`code_note`."""
    out = []
    against = versus_baseline(pairs, baseline)
    for cell_id, cell in table.groupby("cell_id", sort=True):
        group = cell[cell["final_n"] > 0].sort_values("final_mean", ascending=False, kind="stable")
        if group.empty:
            continue
        versus = against[against["cell_id"] == cell_id]
        if baseline not in set(group["objective"]):
            text = f"no verdict: the baseline {baseline} has no ended run here"
        else:
            note = code_note([baseline, *versus["a"]], codes or {})
            text = sentence(versus, baseline) + (f" ({note})" if note else "")
        out.append(CellVerdict(labels[cell_id], ranking(group, versus, baseline), text + left_out(cell)))
    return out


def left_out(cell: pd.DataFrame) -> str:
    """What the cell's sentence adds of the runs its numbers leave out because they did not end (``not_ended`` of
    report.eval_table): a comparison over the seeds that survived a failure the objective may cause is biased, so the
    reader is told which and how many."""
    if "not_ended" not in cell:
        return ""
    shown = [f"{row.objective} {row.not_ended}" for row in cell.itertuples() if row.not_ended]
    return f"; not counted, as they did not end: {'; '.join(shown)}" if shown else ""


def lines(verdicts: list[CellVerdict]) -> list[str]:
    """One line per cell (the cell named when there are several)."""
    several = len(verdicts) > 1
    return [(f"cell `{v.cell}`: " if several else "") + v.sentence + "." for v in verdicts]
