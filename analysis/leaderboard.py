"""The objective leaderboard of a results folder that holds several cells (`make zoo`: results/zoo/).

    write_leaderboard(exp_dir, out_dir, stamp, target)   # -> leaderboard.csv, leaderboard.md, leaderboard.html

One row per objective, over the *shared cells* (analysis.paired.shared_cells: the cells in which every objective that
ended a run has one, so that no objective is ranked on cells another one was never run in), from the counted runs
that ended (finished, or diverged: scored by their last evaluation; analysis/load.py):

- mean rank: per shared cell, the objectives ranked by their mean final eval accuracy over seeds (1 = best, ties share
  the mean of their ranks, pandas' ``rank(method="average")``), averaged over the cells; an objective with runs that
  diverged before any evaluation after step 0 (scored on the starting policy, not on a trained one) ranks below
  those with fewer such runs, whatever its accuracy;
- IQM of final eval accuracy with its hierarchical-bootstrap 95% interval (seeds and eval problems, the same drawn
  in every cell): analysis.paired.iqm (rliable's conventions);
- vs the baseline objective (``baseline``, grpo by default): the mean over cells of the paired difference of final
  accuracy (by seed and eval problem; each unit's difference averaged over the cells first) with its t-interval, and
  P(this > baseline) with the IQM's bootstrap interval: analysis.paired.aggregate; the difference's p-value
  Holm-adjusted over the family of every objective's comparison with the baseline (analysis.verdict.holm), the
  intervals unadjusted;
- collapse rate: runs whose collapse record (harness/run/collapse.py, read by analysis/load.py) names a cause, of the
  ended runs whose collapse state is known, with a Wilson 95% interval (analysis.stats.rate_interval);
- tokens to target: per run, the rollout tokens sampled up to its first evaluation at or above ``target`` (infinite
  when none is); the median over runs ("not reached" when half of them or more never reach it: with an even number
  of runs, half of them infinite, the median is the mean of a finite and an infinite value), and how many reached it;
- rollout tokens per step: the mean over runs of the rollout tokens each sampled per step done, and its ratio to the
  baseline's (the ranking is at equal steps, not at equal sampling);
- clip fraction and ratio spread: per run, the mean over its training steps of ``clip_frac`` and of ``ratio_std``
  (the standard deviation of the importance ratios over the minibatch's tokens, as the objective logs it); the mean
  over runs. "not logged" for objectives that log neither (no ratio, or no clipping).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import paired
from analysis.cells import CODE
from analysis.load import Experiment, load_experiment
from analysis.report import eval_table, not_ended, render_html, render_md
from analysis.stats import LEVEL, num, p_text, rate_interval
from analysis.verdict import code_note, holm
from harness.run.atomic import atomic_write
from harness.run.provenance import runs_stamp

ACCURACY = "final_eval_accuracy"
MECHANICS = {"clip_frac": "clip fraction", "ratio_std": "ratio spread"}  # per-run means over training steps
COLUMNS = ["objective", "cells", "runs", "mean_rank", "iqm", "iqm_low", "iqm_high", "vs_baseline", "vs_baseline_low",
           "vs_baseline_high", "vs_baseline_p", "vs_baseline_holm", "p_baseline", "p_baseline_low", "p_baseline_high",
           "collapse_k", "collapse_n", "collapse_rate", "collapse_low", "collapse_high", "tokens_to_target",
           "reached_target", "rollout_tokens", "rollout_budget", *MECHANICS]


def shared_runs(exp: Experiment) -> tuple[pd.DataFrame, list[int]]:
    """The counted, ended runs of the shared cells, and those cells."""
    cells = paired.shared_cells(exp.runs, ACCURACY)
    runs = exp.runs
    return runs[runs["counted"] & runs["ended"] & runs["cell_id"].isin(cells)], cells


def mean_ranks(exp: Experiment, cells: list[int]) -> pd.Series:
    """Per objective: the mean over ``cells`` of its rank in the cell (1 = best): first by the share of its runs
    scored on the starting policy (:func:`scored_at_start`; fewer first), then by mean final accuracy. A run that
    diverged before its first evaluation after step 0 never ranks above one whose trained policy was evaluated."""
    table = eval_table(exp.runs, exp.cells.axes, exp.samples)
    table = table[table["cell_id"].isin(cells) & table["final_mean"].notna()]
    runs = exp.runs[exp.runs["counted"] & exp.runs["ended"]]
    share = scored_at_start(exp)[runs["run_id"]].groupby([runs["cell_id"].to_numpy(), runs["objective"].to_numpy()]
                                                          ).mean()
    untrained = pd.Series([share.get((c, o), 0.0) for c, o in zip(table["cell_id"], table["objective"], strict=True)],
                          index=table.index)
    # lexicographic: the share's dense rank steps by 2, more than accuracies in [0, 1] can differ
    key = 2 * untrained.groupby(table["cell_id"]).rank(method="dense") - table["final_mean"]
    ranks = key.groupby(table["cell_id"]).rank(method="average")
    return ranks.groupby(table["objective"]).mean()


def scored_at_start(exp: Experiment) -> pd.Series:
    """Per run id: whether no evaluation after step 0 exists (a run that diverged before its first one after
    training: its final accuracy, its last evaluation, is the starting policy's)."""
    metrics = exp.metrics
    if "eval_accuracy" not in metrics:
        return pd.Series(True, index=exp.runs["run_id"])
    evaluated = metrics.loc[(metrics["step"] > 0) & metrics["eval_accuracy"].notna(), "run_id"]
    return pd.Series(~exp.runs["run_id"].isin(evaluated).to_numpy(), index=exp.runs["run_id"])


def tokens_to_target(metrics: pd.DataFrame, runs: pd.DataFrame, target: float) -> pd.Series:
    """Per run id: rollout tokens sampled when its eval accuracy first reached ``target`` (inf: never)."""
    rows = metrics[metrics["run_id"].isin(runs["run_id"])]
    if "eval_accuracy" not in rows or "rollout_tokens" not in rows:
        return pd.Series(np.inf, index=runs["run_id"])
    reached = rows[rows["eval_accuracy"] >= target].sort_values("step").groupby("run_id")["rollout_tokens"].first()
    return reached.reindex(runs["run_id"]).fillna(np.inf)


def run_means(metrics: pd.DataFrame, runs: pd.DataFrame, key: str) -> pd.Series:
    """Per run id: the mean over its training steps (step >= 1) of ``key`` (NaN when it never logged it)."""
    rows = metrics[metrics["run_id"].isin(runs["run_id"]) & (metrics["step"] >= 1)]
    if key not in rows:
        return pd.Series(np.nan, index=runs["run_id"])
    return rows.groupby("run_id")[key].mean().reindex(runs["run_id"])


def per_step(runs: pd.DataFrame) -> float:
    """The mean over ``runs`` of their rollout tokens per step done (a run that stopped early is not a smaller
    budget)."""
    return float((runs["rollout_tokens"].astype(float) / runs["steps_done"].astype(float).where(runs["steps_done"] > 0)
                  ).mean())


def leaderboard(exp: Experiment, target: float, baseline: str = "grpo") -> pd.DataFrame:
    """The leaderboard's numbers, one row per objective, best mean rank first (see the module docstring)."""
    runs, cells = shared_runs(exp)
    ranks = mean_ranks(exp, cells)
    # NaN for an objective with runs in every shared cell but no (starting policy, seed) unit ended in all of them
    iqms = paired.iqm(exp.runs, ACCURACY, exp.samples).set_index("objective").reindex(runs["objective"].unique())
    versus = paired.aggregate(exp.runs[exp.runs["cell_id"].isin(cells)], ACCURACY, exp.samples, baseline)
    tokens = tokens_to_target(exp.metrics, runs, target)
    means = {key: run_means(exp.metrics, runs, key) for key in MECHANICS}
    rows = []
    for objective, group in runs.groupby("objective", sort=True):
        ids = group["run_id"]
        known = group[group["collapse_source"].notna()]
        k, n = int(known["collapse_cause"].notna().sum()), len(known)
        low, high = rate_interval(k, n)
        reach = tokens[ids].to_numpy()
        row = {"objective": objective, "cells": len(cells), "runs": len(group), "mean_rank": ranks.get(objective),
               **iqms.loc[objective, ["iqm", "iqm_low", "iqm_high"]].to_dict(),
               **baseline_columns(versus, objective, baseline),
               "collapse_k": k, "collapse_n": n, "collapse_rate": k / n if n else np.nan, "collapse_low": low,
               "collapse_high": high, "tokens_to_target": float(np.median(reach)) if len(reach) else np.nan,
               "reached_target": int(np.isfinite(reach).sum()), "rollout_tokens": per_step(group),
               **{key: float(means[key][ids].mean()) for key in MECHANICS}}
        rows.append(row)
    for objective in sorted(set(exp.runs["objective"].dropna()) - {r["objective"] for r in rows}):
        rows.append({"objective": objective, "cells": len(cells), "runs": 0})  # no ended run in the shared cells
    frame = pd.DataFrame(rows)
    frame = frame.reindex(columns=[*COLUMNS, *(c for c in frame if c not in COLUMNS)])  # also when no run ended
    frame["vs_baseline_holm"] = holm(frame["vs_baseline_p"])  # over every comparison with the baseline with a p
    base = frame.loc[frame["objective"] == baseline, "rollout_tokens"]
    frame["rollout_budget"] = frame["rollout_tokens"] / base.iloc[0] if len(base) and base.iloc[0] > 0 else np.nan
    return frame.sort_values(["mean_rank", "objective"], ignore_index=True, na_position="last")


def baseline_columns(versus: pd.DataFrame, objective: str, baseline: str) -> dict:
    """analysis.paired.aggregate's row for (objective, baseline), signed as objective - baseline."""
    out = dict.fromkeys(["vs_baseline", "vs_baseline_low", "vs_baseline_high", "vs_baseline_p", "p_baseline",
                         "p_baseline_low", "p_baseline_high"], np.nan)
    pair = versus[(versus["a"].isin([objective, baseline])) & (versus["b"].isin([objective, baseline]))
                  & (versus["a"] != versus["b"])]
    if objective == baseline or pair.empty:
        return out
    row = pair.iloc[0]
    sign = 1 if row["a"] == objective else -1
    low, high = (row["difference_low"], row["difference_high"])[::sign]
    p_low, p_high = (row["p_low"], row["p_high"]) if sign > 0 else (1 - row["p_high"], 1 - row["p_low"])
    return {"vs_baseline": sign * row["difference"], "vs_baseline_low": sign * low, "vs_baseline_high": sign * high,
            "vs_baseline_p": row["p_value"],
            "p_baseline": row["p_improvement"] if sign > 0 else 1 - row["p_improvement"], "p_baseline_low": p_low,
            "p_baseline_high": p_high}


def bracket(value, low, high) -> str:
    return num(value) + ("" if pd.isna(low) else f" [{num(low)}, {num(high)}]")


def display(board: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """The leaderboard as shown in leaderboard.md/.html."""
    tokens = ["n/a" if not n else ("not reached" if not np.isfinite(t) else num(t)) + f" ({r:.0f}/{n})" for t, r, n
              in zip(board["tokens_to_target"], board["reached_target"], board["runs"], strict=True)]
    return pd.DataFrame({
        "objective": board["objective"], "mean rank": board["mean_rank"].map(num),
        "IQM final accuracy [95% CI]": [bracket(*v) for v in zip(board["iqm"], board["iqm_low"], board["iqm_high"],
                                                                  strict=True)],
        f"vs {baseline} [95% CI]": [bracket(*v) for v in zip(board["vs_baseline"], board["vs_baseline_low"],
                                                             board["vs_baseline_high"], strict=True)],
        f"Holm p vs {baseline}": board["vs_baseline_holm"].map(lambda p: "" if pd.isna(p) else p_text(p)),
        f"P(> {baseline}) [95% CI]": [bracket(*v) for v in zip(board["p_baseline"], board["p_baseline_low"],
                                                                board["p_baseline_high"], strict=True)],
        "collapsed [Wilson 95%]": [f"{k:.0f}/{n:.0f} " + bracket(r, lo, hi) if n > 0 else "n/a" for k, n, r, lo, hi in
                                   zip(board["collapse_k"], board["collapse_n"], board["collapse_rate"],
                                       board["collapse_low"], board["collapse_high"], strict=True)],
        "tokens to target (reached)": tokens,
        f"rollout tokens per step (x {baseline})": [
            "n/a" if pd.isna(t) else num(t) + ("" if pd.isna(b) else f" ({b:.2f}x)")
            for t, b in zip(board["rollout_tokens"], board["rollout_budget"], strict=True)],
        **{label: board[key].map(lambda v: "not logged" if pd.isna(v) else num(v)) for key, label in MECHANICS.items()},
        "runs": board["runs"]})


def family_sentence(board: pd.DataFrame, baseline: str) -> str:
    """The leaderboard's family of comparisons with the baseline and what correcting for it leaves."""
    tested = board[board["vs_baseline_holm"].notna()]
    m = len(tested)
    if not m:
        return (f"no comparison with {baseline} has a p-value (too few paired seeds, or seeds that agree with the eval "
                "problems' spread unknown), so none is corrected.")
    raw = int(((tested["vs_baseline_low"] > 0) | (tested["vs_baseline_high"] < 0)).sum())
    holds = int((tested["vs_baseline_holm"] < 1 - LEVEL).sum())
    return (f"the family is {m} comparison{'s' * (m != 1)} with {baseline}, so about {m * (1 - LEVEL):.2f} of them "
            f"would exclude 0 by chance alone; {raw} exclude{'s' * (raw == 1)} 0 unadjusted, {holds} after Holm's "
            f"step-down correction (Holm p < {1 - LEVEL:g}, the family-wise error rate). A difference from one "
            "starting policy is conditioned on it: another starting policy may reverse it (`make zoo`'s "
            "confirmation tests the screen's differences again on fresh starting policies and seeds).")


def explanation(exp: Experiment, cells: list[int], target: float, baseline: str, board: pd.DataFrame
                ) -> list[str]:
    labels = [exp.cells.labels[c] for c in cells]
    left_out = [label for i, label in enumerate(exp.cells.labels) if i not in cells]
    return [f"Cells ({len(cells)}, each objective x its seeds): " + "; ".join(f"`{c}`" for c in labels) + "."
            + (f" Left out (not every objective has an ended run there): {'; '.join(left_out)}." if left_out else ""),
            "Mean rank: per cell, objectives ranked by mean final eval accuracy over seeds (1 = best, ties share "
            "their mean rank; runs that diverged before any evaluation after step 0 are scored on the starting "
            "policy, so an objective with more of them ranks lower whatever its accuracy), averaged over the cells. "
            f"IQM: of every run's final accuracy pooled over the cells, "
            f"{LEVEL:.0%} hierarchical bootstrap (the same seeds and eval problems drawn in every cell: they share "
            f"them; analysis/paired.py). vs {baseline}: mean over cells of the paired difference of final accuracy "
            "(by seed and eval problem; each seed's difference averaged over the cells, then the t-interval over the "
            "seeds, analysis/accuracy.py), and the probability of improvement "
            "P(objective > baseline), same bootstrap as the IQM. Each interval is unadjusted, at 95% for one "
            f"comparison: {family_sentence(board, baseline)} "
            "Collapsed: runs with a collapse record (harness/run/collapse.py) of the runs "
            f"that ended. Tokens to target: median over runs of the rollout tokens sampled when the eval accuracy "
            f"first reached {target:g}, a run that never did counting as infinite (so: not reached when half of "
            "them or more did not; in brackets the runs that reached it). Rollout tokens per step: the mean over its "
            f"runs in these cells of the rollout tokens each sampled per step done, and its ratio to {baseline}'s: "
            "the ranking compares "
            "objectives at equal steps, and one that samples more in a step (A*-PO's reference completions, ReMax's "
            "greedy ones, dynamic sampling's refills) spends more for its accuracy. Clip fraction and ratio spread "
            "(ratio_std): per-run means over training steps, averaged over runs. Module: analysis/leaderboard.py."]


def write_leaderboard(exp_dir: Path, out_dir: Path, stamp: str, target: float, baseline: str = "grpo") -> Path:
    """leaderboard.csv, .md and .html of the runs in ``exp_dir`` into ``out_dir`` (each written whole, then renamed
    into place); ``stamp``: the command, machine and budget line (the ranked runs' own code and threads follow it).
    Returns the .md's path."""
    exp = load_experiment(exp_dir)
    board = leaderboard(exp, target, baseline)
    shown = display(board, baseline) if len(board) else pd.DataFrame({"objective": []})
    ranked, cells = shared_runs(exp)
    codes = exp.cells.objective_settings.get(CODE, {})  # each objective's version, where it differs between them
    note = code_note([baseline, *(board["objective"] if len(board) else [])], codes)
    counted = exp.runs[exp.runs["counted"]]
    left = [f"{o} {text}" for o, group in counted.groupby("objective", sort=True) if (text := not_ended(group))]
    blocks = [("h1", f"Objective leaderboard: {exp.name}"), ("p", stamp),
              ("p", runs_stamp(ranked.to_dict("records"))), *([("p", f"Objectives {note}.")] if note else []),
              ("table", shown),
              *([("p", f"Not counted, as they did not end: {'; '.join(left)}. A run that failed is in no number of "
                       "the board: an objective whose failures come from the objective ranks on its runs that "
                       "survived.")] if left else []),
              *[("p", text) for text in explanation(exp, cells, target, baseline, board)]]
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "leaderboard.csv", board.to_csv(index=False))
    atomic_write(out_dir / "leaderboard.md", render_md(blocks))
    atomic_write(out_dir / "leaderboard.html", render_html(blocks, out_dir, f"Objective leaderboard: {exp.name}"))
    return out_dir / "leaderboard.md"
