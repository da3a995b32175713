"""results/<exp>/ -> results/<exp>/report/: figures, tables (CSV and Markdown), report.md and a self-contained
report.html (figures embedded as base64 PNG)."""

from __future__ import annotations

import base64
import html
import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import plots
from analysis.load import AnalysisError, AnalysisWarning, Experiment, load_experiment
from analysis.stats import CI_METHOD, IQM_MIN_SEEDS, describe

CONFIG_KEYS = {"experiment": "name", "model": "model.name", "task": "task.name", "steps": "train.steps",
               "group size": "train.group_size", "prompts per step": "train.prompts_per_step"}
FIGURES = {"curves_step": "Accuracy and reward against training step",
           "curves_tokens": "Accuracy and reward against rollout tokens",
           "stability": "Stability diagnostics against training step",
           "clip_fraction": "Clip fraction: this run (measured) vs the GSPO paper (reported)",
           "final_eval": "Final eval accuracy per objective"}
SMOOTHED = ("curves_step", "curves_tokens", "stability")


def eval_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per objective, over its finished runs: final and best eval accuracy (mean, CI, IQM), mean cost per run."""
    rows = []
    for objective, group in runs.groupby("objective"):
        done = group[group["complete"]]
        row = {"objective": objective}
        for kind in ("final", "best"):
            d = describe(done[f"{kind}_eval_accuracy"])
            row.setdefault("seeds", d["n"])
            row.update({f"{kind}_{k}": d[k] for k in ("mean", "ci_low", "ci_high", "iqm")})
        row.update(wall_time_s=done["wall_time_s"].mean(), rollout_tokens=done["rollout_tokens"].mean(),
                   unfinished_runs=len(group) - len(done))
        rows.append(row)
    return pd.DataFrame(rows)


def num(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"


def ci(low, high) -> str:
    return "n/a" if not np.isfinite(low) else f"[{num(low)}, {num(high)}]"


def eval_display(table: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "objective": table["objective"], "seeds (finished)": table["seeds"],
        "final mean": table["final_mean"].map(num),
        "final 95% CI": [ci(lo, hi) for lo, hi in zip(table["final_ci_low"], table["final_ci_high"], strict=True)],
        "final IQM": table["final_iqm"].map(num), "best mean": table["best_mean"].map(num),
        "best 95% CI": [ci(lo, hi) for lo, hi in zip(table["best_ci_low"], table["best_ci_high"], strict=True)],
        "best IQM": table["best_iqm"].map(num), "wall time (s/run)": table["wall_time_s"].map(num),
        "rollout tokens (/run)": table["rollout_tokens"].map(num), "unfinished runs": table["unfinished_runs"]})


def runs_display(runs: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "run_id": runs["run_id"], "objective": runs["objective"], "seed": runs["seed"].astype("string").fillna("?"),
        "status": runs["status"],
        "steps": runs["steps_done"].astype(str) + "/" + runs["total_steps"].astype("string").fillna("?"),
        "last eval acc": runs["final_eval_accuracy"].map(num), "best eval acc": runs["best_eval_accuracy"].map(num),
        "wall time (s)": runs["wall_time_s"].map(num)})


def config_summary(exp: Experiment) -> tuple[list[str], list[str]]:
    """The shared settings, and every config key (other than objective and seed) whose value differs between runs."""
    configs = {run_id: c for run_id, c in exp.configs.items() if c}
    objective_of = exp.runs.set_index("run_id")["objective"]
    counts = exp.runs["objective"].value_counts().sort_index()
    lines = []
    for label, key in CONFIG_KEYS.items() if configs else ():
        values = sorted({str(c.get(key, "unset")) for c in configs.values()})
        lines.append(f"{label}: " + (values[0] if len(values) == 1 else "differs between runs (below)"))
    lines.append("objectives: " + ", ".join(f"{o} ({plural(k, 'run')})" for o, k in counts.items()))
    lines.append("seeds: " + ", ".join(str(s) for s in sorted(exp.runs["seed"].dropna().unique())))
    if len(configs) < len(exp.runs):
        lines.append(f"config.yaml found for {len(configs)} of {plural(len(exp.runs), 'run')}")
    diffs = []
    for key in sorted(set().union(*configs.values()) - {"seed", "objective.name"}):
        values = {run_id: str(c.get(key, "unset")) for run_id, c in configs.items()}
        if len(set(values.values())) < 2:
            continue
        per_objective = {}
        for run_id, value in values.items():
            per_objective.setdefault(objective_of[run_id], set()).add(value)
        if all(len(v) == 1 for v in per_objective.values()):
            diffs.append(f"{key}: per objective: "
                         + ", ".join(f"{o}={v.pop()}" for o, v in sorted(per_objective.items())))
        else:
            by_value = {}
            for run_id, value in values.items():
                by_value.setdefault(value, []).append(run_id)
            diffs.append(f"{key}: " + "; ".join(f"{v} ({', '.join(ids)})" for v, ids in sorted(by_value.items())))
    return lines, diffs


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def md_table(df: pd.DataFrame) -> str:
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(cell, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def render_md(blocks: list[tuple]) -> str:
    out = []
    for kind, *args in blocks:
        if kind in ("h1", "h2"):
            out.append("#" * int(kind[1]) + " " + args[0])
        elif kind == "p":
            out.append(args[0])
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in args[0]))
        elif kind == "table":
            out.append(md_table(args[0]))
        elif kind == "figure":
            stem, text = args
            out.append(f"![{FIGURES[stem]}]({stem}.png)\n\n*{text}*")
    return "\n\n".join(out) + "\n"


def inline(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def render_html(blocks: list[tuple], out_dir: Path, title: str) -> str:
    out = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
           "body{font-family:sans-serif;max-width:1100px;margin:auto;padding:1em}table{border-collapse:collapse;"
           "font-size:0.85em}td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:100%}</style></head><body>"]
    for kind, *args in blocks:
        if kind in ("h1", "h2", "p"):
            out.append(f"<{kind}>{inline(args[0])}</{kind}>")
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li>{inline(item)}</li>" for item in args[0]) + "</ul>")
        elif kind == "table":
            out.append(args[0].to_html(index=False, border=0))
        elif kind == "figure":
            stem, text = args
            data = base64.b64encode((out_dir / f"{stem}.png").read_bytes()).decode()
            out.append(f"<figure><img alt='{html.escape(FIGURES[stem])}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{inline(text)}</figcaption></figure>")
    return "\n".join(out) + "\n</body></html>\n"


def unfinished_lines(runs: pd.DataFrame) -> list[str]:
    return [f"`{r.run_id}` ({r.objective}, seed {'?' if pd.isna(r.seed) else r.seed}): {r.problem}"
            for r in runs.itertuples() if not r.complete]


def build_report(exp_dir: str | Path, out: str | Path | None = None, smooth: int = 1,
                 formats: tuple[str, ...] = ("png", "pdf")) -> Path:
    """Write the report folder; returns the path of report.md. Data problems are warned (AnalysisWarning) and
    listed in the report; a missing or empty results folder raises AnalysisError."""
    unknown = set(formats) - set(plots.SAVE_METADATA)
    if unknown:
        raise AnalysisError(f"unknown figure format(s) {', '.join(sorted(unknown))}; use png, pdf or svg")
    formats = ["png"] + [f for f in formats if f != "png"]  # the report embeds the PNGs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AnalysisWarning)
        exp = load_experiment(exp_dir)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    data_warnings = [str(w.message) for w in caught if issubclass(w.category, AnalysisWarning)]
    out_dir = Path(out) if out else exp.dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    for stem in FIGURES:  # a figure left out this time must not leave a stale file from an earlier report
        for fmt in plots.SAVE_METADATA:
            (out_dir / f"{stem}.{fmt}").unlink(missing_ok=True)

    runs, metrics = exp.runs, exp.metrics
    table = eval_table(runs)
    table.to_csv(out_dir / "eval_accuracy.csv", index=False)
    runs.to_csv(out_dir / "runs.csv", index=False)
    (out_dir / "eval_accuracy.md").write_text(md_table(eval_display(table)) + "\n")
    (out_dir / "runs.md").write_text(md_table(runs_display(runs)) + "\n")

    colors = plots.palette(runs["objective"])
    name = exp.name
    made = {} if metrics.empty else {
        "curves_step": plots.curves_figure(metrics, "step", colors, smooth, f"{name}: accuracy and reward by step"),
        "curves_tokens": plots.curves_figure(metrics, "rollout_tokens", colors, smooth,
                                             f"{name}: accuracy and reward by rollout tokens"),
        "stability": plots.stability_figure(metrics, colors, smooth, f"{name}: stability diagnostics"),
        "clip_fraction": plots.clip_figure(metrics, runs, colors, f"{name}: clip fraction, measured vs paper"),
    }
    made["final_eval"] = plots.final_figure(runs, colors, f"{name}: final eval accuracy")

    config_lines, diffs = config_summary(exp)
    unfinished = unfinished_lines(runs)
    blocks = [("h1", f"Report: {name}"),
              ("p", f"Source: `{exp.dir}`. {plural(len(runs), 'run')} listed, {int(runs['complete'].sum())} finished, "
                    f"{len(unfinished)} not finished. Tables and the final-accuracy figure use finished runs only; "
                    "the curves use every logged step of every run."),
              ("h2", "Configuration"), ("ul", config_lines),
              ("p", "Differences between runs other than objective and seed:" if diffs else
                    "No differences between runs other than objective and seed."),
              *([("ul", diffs)] if diffs else []),
              ("h2", "Runs that did not finish"),
              ("ul", unfinished) if unfinished else ("p", "All runs finished.")]
    if data_warnings:
        blocks += [("h2", "Data warnings"), ("ul", data_warnings)]
    blocks += [("h2", "Eval accuracy per objective"),
               ("p", f"Greedy held-out accuracy at the last step (final) and the best over evaluations (best), over "
                     f"finished runs. Mean over seeds; CI: {CI_METHOD}; n/a with fewer than 2 seeds. IQM: mean of the "
                     f"middle 50% of seeds (scipy.stats.trim_mean(x, 0.25)), shown with {IQM_MIN_SEEDS}+ seeds. "
                     "Wall time and rollout tokens: mean per finished run."),
               ("table", eval_display(table)),
               ("h2", "Runs"),
               ("p", "Last eval acc: the final eval accuracy of a finished run, the latest one of an unfinished run."),
               ("table", runs_display(runs)),
               ("h2", "Figures")]
    if metrics.empty:
        blocks.append(("p", "No run has logged metrics yet: the curves, stability and clip-fraction figures are "
                            "left out."))
    for stem, (fig, notes) in made.items():
        if fig is not None:
            plots.save(fig, out_dir, stem, formats)
            text = f"{FIGURES[stem]}. Mean over seeds, {CI_METHOD}; n (seeds) in the legend or axis labels."
            if smooth > 1 and stem in SMOOTHED:
                text += f" Train metrics smoothed: trailing rolling mean over {smooth} steps."
            blocks.append(("figure", stem, text))
        else:
            blocks.append(("p", f"{FIGURES[stem]}: not drawn."))
        if notes:
            blocks.append(("ul", notes))

    (out_dir / "report.md").write_text(render_md(blocks))
    (out_dir / "report.html").write_text(render_html(blocks, out_dir, f"Report: {name}"))
    return out_dir / "report.md"
