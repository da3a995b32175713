"""results/<exp>/ -> results/<exp>/report/: figures, tables (CSV and Markdown), report.md and a self-contained
report.html (figures embedded as base64 PNG). The folder is written beside the target and renamed into place, so a
killed analysis leaves the previous report whole."""

from __future__ import annotations

import base64
import html
import os
import re
import secrets
import shutil
import time
import warnings
from pathlib import Path

import pandas as pd

from analysis import plots, scaling, timing
from analysis.load import SCORING_PREFIX, AnalysisError, AnalysisWarning, Experiment, load_experiment
from analysis.stats import INTERVALS, IQM_MIN_SEEDS, coinciding, describe, interval_name, num

CONFIG_KEYS = {"experiment": "name", "model": "model.name", "task": "task.name", "steps": "train.steps",
               "group size": "train.group_size", "prompts per step": "train.prompts_per_step"}
# the fixed figures; besides them, metrics_<prefix> draws the other per-step metrics of one name prefix
FIGURES = {"curves_step": "Accuracy and reward against training step",
           "curves_tokens": "Accuracy and reward against rollout tokens",
           "stability": "Stability diagnostics against training step",
           "clip_fraction": "Clip fraction: this run (measured) vs the GSPO paper (reported)",
           "final_eval": "Final eval accuracy per objective"}
STALE_S = 3600  # a temporary report folder older than this was left by a killed analysis


def accuracies(runs: pd.DataFrame) -> dict[str, str]:
    """Table prefix -> the run column it summarises: start (step 0), final, best, final per scoring variant."""
    variants = {f"final_{c.removeprefix('final_' + SCORING_PREFIX)}": c for c in runs
                if c.startswith("final_" + SCORING_PREFIX)}
    return {"start": "start_eval_accuracy", "final": "final_eval_accuracy", "best": "best_eval_accuracy", **variants}


def eval_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per objective, over its finished runs: start, final, best (and per scoring variant final) eval accuracy:
    mean, interval (see stats), n, IQM; mean cost per run."""
    rows = []
    for objective, group in runs.groupby("objective"):
        done = group[group["complete"]]
        row = {"objective": objective, "seeds": len(done)}
        for kind, column in accuracies(runs).items():
            d = describe(done[column])
            row.update({f"{kind}_{k}": d[k] for k in ("mean", "ci_low", "ci_high", "n", "iqm")})
        row.update(wall_time_s=done["wall_time_s"].mean(), rollout_tokens=done["rollout_tokens"].mean(),
                   unfinished_runs=len(group) - len(done))
        rows.append(row)
    return pd.DataFrame(rows)


def interval(low, high, n) -> str:
    return "n/a" if n < 2 or pd.isna(low) else f"{interval_name(n)} [{num(low)}, {num(high)}]"


def summary_columns(table: pd.DataFrame, kind: str, label: str, iqm: bool = True) -> dict:
    out = {f"{label} mean": table[f"{kind}_mean"].map(num),
           f"{label} interval": [interval(lo, hi, n) for lo, hi, n in
                                 zip(table[f"{kind}_ci_low"], table[f"{kind}_ci_high"], table[f"{kind}_n"],
                                     strict=True)]}
    if iqm:
        out[f"{label} IQM"] = table[f"{kind}_iqm"].map(num)
    return out


def eval_display(table: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Final, then final under each scoring variant (no IQM), then best."""
    out = {"objective": table["objective"], "n (finished)": table["seeds"]}
    out.update(summary_columns(table, "final", "final"))
    for kind in accuracies(runs):
        if kind.startswith("final_"):
            out.update(summary_columns(table, kind, f"final, {kind.removeprefix('final_')} scoring", iqm=False))
    out.update(summary_columns(table, "best", "best"))
    out.update({"wall time (s/run)": table["wall_time_s"].map(num),
                "rollout tokens (/run)": table["rollout_tokens"].map(num), "unfinished runs": table["unfinished_runs"]})
    return pd.DataFrame(out)


def headline_display(table: pd.DataFrame) -> pd.DataFrame:
    out = {"objective": table["objective"]}
    for kind, label in (("start", "start (step 0)"), ("final", "end")):
        out.update(summary_columns(table, kind, label, iqm=False))
        out[f"{label} n"] = table[f"{kind}_n"]
    return pd.DataFrame(out)


def start_policy_lines(runs: pd.DataFrame) -> list[str]:
    """One line per distinct starting policy (summary.json's start_policy), naming the runs that used it."""
    lines = []
    keys = runs["start_policy"].fillna("")
    for key, group in runs.groupby(keys, sort=True):
        counts = group["objective"].value_counts().sort_index()
        which = "all runs" if len(group) == len(runs) else ", ".join(f"{o} ({plural(k, 'run')})"
                                                                     for o, k in counts.items())
        if key == "none":
            lines.append(f"no warm start: the runs start from the base model ({which}).")
        elif not key:
            lines.append(f"not recorded ({which}: summary.json has no `start_policy`, runs written before the field).")
        else:
            first = group.iloc[0]
            steps = first.get("start_policy_steps")
            steps = "?" if pd.isna(steps) else f"{steps:,.0f}"
            lines.append(f"key `{key}`, warm-started {steps} steps, check accuracy "
                         f"{num(first.get('start_policy_check_accuracy'))}, eval accuracy "
                         f"{num(first.get('start_policy_eval_accuracy'))} ({which}).")
    return lines


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
            stem, title, text = args
            out.append(f"![{title}]({stem}.png)\n\n*{text}*")
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
            stem, title, text = args
            data = base64.b64encode((out_dir / f"{stem}.png").read_bytes()).decode()
            out.append(f"<figure><img alt='{html.escape(title)}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{inline(text)}</figcaption></figure>")
    return "\n".join(out) + "\n</body></html>\n"


def unfinished_lines(runs: pd.DataFrame) -> list[str]:
    return [f"`{r.run_id}` ({r.objective}, seed {'?' if pd.isna(r.seed) else r.seed}): {r.problem}"
            for r in runs.itertuples() if not r.complete]


def coincide_lines(found: dict) -> list[str]:
    lines = []
    for (a, b), (same, compared) in found.items():
        if same == compared:
            lines.append(f"{a} and {b} coincide on every logged step of every drawn metric both report "
                         f"({plural(len(same), 'metric')}: {', '.join(f'`{m}`' for m in same)}).")
        else:
            lines.append(f"{a} and {b} coincide on every logged step of {', '.join(f'`{m}`' for m in same)} "
                         f"({len(same)} of the {len(compared)} drawn metrics both report).")
    return lines


def figures(exp: Experiment, smooth: int, paper: bool, fits: list[scaling.ObjectiveFit]
            ) -> tuple[list[plots.Made], list[str]]:
    """Every figure (drawn or not, with its notes), and the pairs of objectives whose curves coincide; `fits`: the
    compute-performance fits (scaling.fit_objectives)."""
    runs, metrics, name = exp.runs, exp.metrics, exp.name
    look = plots.styles(runs["objective"])
    made = []
    if not metrics.empty:
        made += [plots.curves_figure(metrics, "step", look, smooth, f"{name}: accuracy and reward by step", paper),
                 plots.curves_figure(metrics, "rollout_tokens", look, smooth,
                                     f"{name}: accuracy and reward by rollout tokens", paper),
                 plots.scaling_figure(fits, look, f"{name}: compute-performance fit", paper),
                 plots.stability_figure(metrics, look, smooth, f"{name}: stability diagnostics", paper),
                 plots.clip_figure(metrics, runs, look, f"{name}: clip fraction, measured vs paper", paper)]
    made.append(plots.final_figure(runs, look, f"{name}: final eval accuracy", paper))
    if metrics.empty:
        return made, []
    drawn = [m for m in [*plots.CURVES, *plots.STABILITY] if plots.reported(metrics, m)]
    for family, columns in plots.families(metrics, set(drawn)).items():
        title = "Other per-step metrics" if family == "other" else f"Metrics {family}_*"
        made.append(plots.family_figure(metrics, family, columns, look, smooth, f"{name}: {title}", paper))
        drawn += columns
    return made, coincide_lines(coinciding(metrics, drawn))


def replace_dir(new: Path, target: Path) -> None:
    """Put `new` in place of `target` (two renames; the old folder is deleted once the new one is in place)."""
    old = new.with_name(new.name.replace(".tmp-", ".old-"))
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def build_report(exp_dir: str | Path, out: str | Path | None = None, smooth: int = 1,
                 formats: tuple[str, ...] = ("png", "pdf"), paper: bool = False) -> Path:
    """Write the report folder; returns the path of report.md. Data problems are warned (AnalysisWarning) and
    listed in the report; a missing or empty results folder raises AnalysisError. ``paper``: figures for a paper
    (see plots), PDF among the formats. The folder is built as a hidden sibling and renamed into place."""
    unknown = set(formats) - set(plots.SAVE_METADATA)
    if unknown:
        raise AnalysisError(f"unknown figure format(s) {', '.join(sorted(unknown))}; use png, pdf or svg")
    formats = ["png"] + [f for f in formats if f != "png"] + (["pdf"] if paper and "pdf" not in formats else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AnalysisWarning)
        exp = load_experiment(exp_dir)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    data_warnings = [str(w.message) for w in caught if issubclass(w.category, AnalysisWarning)]
    out_dir = Path(out) if out else exp.dir / "report"
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "report.md").exists():
        raise AnalysisError(f"{out_dir} is not empty and holds no report.md: refusing to replace it; choose another "
                            "--out")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for stale in out_dir.parent.glob(pattern):
            if time.time() - stale.stat().st_mtime > STALE_S:
                shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        with plots.context(paper):
            write_report(exp, tmp, smooth, formats, paper, data_warnings)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir / "report.md"


def timing_block(exp: Experiment) -> tuple:
    table = timing.time_table(exp.runs, exp.metrics)
    return ("table", table) if len(table) else ("p", "No finished run yet.")


def write_report(exp: Experiment, out_dir: Path, smooth: int, formats: list[str], paper: bool,
                 data_warnings: list[str]) -> None:
    runs, name = exp.runs, exp.name
    table = eval_table(runs)
    table.to_csv(out_dir / "eval_accuracy.csv", index=False)
    runs.to_csv(out_dir / "runs.csv", index=False)
    (out_dir / "eval_accuracy.md").write_text(md_table(eval_display(table, runs)) + "\n")
    (out_dir / "runs.md").write_text(md_table(runs_display(runs)) + "\n")
    headline = headline_display(table)
    (out_dir / "headline.md").write_text(md_table(headline) + "\n")
    fits = scaling.fit_objectives(exp.metrics, runs)
    scaling.fit_numbers(fits).to_csv(out_dir / "scaling_fit.csv", index=False)
    made, coincide = figures(exp, smooth, paper, fits)

    config_lines, diffs = config_summary(exp)
    unfinished = unfinished_lines(runs)
    blocks = [("h1", f"Report: {name}"),
              ("p", f"Source: `{exp.dir}`. {plural(len(runs), 'run')} listed, {int(runs['complete'].sum())} finished, "
                    f"{len(unfinished)} not finished. Tables and the final-accuracy figure use finished runs only; "
                    "the curves use every logged step of every run."),
              ("h2", "Start and end accuracy"),
              ("p", "Greedy held-out eval accuracy of each objective's finished runs at step 0 (the starting policy, "
                    "before any update) and at the last step. Mean over seeds; interval: " + INTERVALS + "."),
              ("table", headline),
              ("p", "Starting policy (summary.json `start_policy`):"), ("ul", start_policy_lines(runs))]
    if coincide:
        blocks += [("h2", "Objectives whose curves coincide"),
                   ("p", "Mean over seeds equal (to 6 significant digits) at every step both objectives logged: in "
                         "the figures their lines lie on each other, told apart by line style and marker."),
                   ("ul", coincide)]
    blocks += [("h2", "Configuration"), ("ul", config_lines),
               ("p", "Differences between runs other than objective and seed:" if diffs else
                     "No differences between runs other than objective and seed."),
               *([("ul", diffs)] if diffs else []),
               ("h2", "Runs that did not finish"),
               ("ul", unfinished) if unfinished else ("p", "All runs finished.")]
    if data_warnings:
        blocks += [("h2", "Data warnings"), ("ul", data_warnings)]
    scorings = [k.removeprefix("final_") for k in accuracies(runs) if k not in ("start", "final", "best")]
    blocks += [("h2", "Eval accuracy per objective"),
               ("p", f"Greedy held-out accuracy at the last step (final) and the best over evaluations (best), over "
                     f"finished runs. Mean over seeds; interval: {INTERVALS}. IQM: mean of the middle 50% of seeds "
                     f"(scipy.stats.trim_mean(x, 0.25)), shown with {IQM_MIN_SEEDS}+ seeds. Wall time and rollout "
                     "tokens: mean per finished run."
                     + (" The same final evaluation scored other ways: "
                        + ", ".join(f"{k} scoring (`{SCORING_PREFIX}{k}`)" for k in scorings)
                        + "; final and best use the task's default scoring (`eval_accuracy`)." if scorings else "")),
               ("table", eval_display(table, runs)),
               ("h2", "Compute-performance fit"),
               ("p", scaling.SUMMARY + " Numbers only where the fit converged; otherwise the reason. Figure "
                     "`scaling` draws the converged fits over their points."),
               ("table", scaling.fit_table(fits)),
               ("h2", "Where the time went"),
               ("p", "Mean seconds per finished run of each objective in each phase its metrics log, and the share "
                     "of its wall time (CPU clock; on a GPU the update's parts count launches, not kernels): "
                     + timing.PHASES),
               timing_block(exp),
               ("h2", "Runs"),
               ("p", "Last eval acc: the final eval accuracy of a finished run, the latest one of an unfinished run."),
               ("table", runs_display(runs)),
               ("h2", "Figures"),
               ("p", f"Line figures: the mean over seeds of each objective, told apart by colour, line style and "
                     f"marker (markers alternate between objectives, so coinciding lines stay visible); band: "
                     f"{INTERVALS}; n in the legend. A line is solid where all of the objective's runs contribute "
                     "and faded where fewer do (runs of different length or unfinished). Every numeric per-step "
                     "metric is drawn except bookkeeping (timings `*_s`, `*_mb`, "
                     + ", ".join(f"`{k}`" for k in sorted(plots.BOOKKEEPING - {"run_id", "objective", "seed"}))
                     + "); the metrics outside the accuracy and stability figures are grouped by name prefix "
                     "(`metrics_<prefix>`, single ones in `metrics_other`).")]
    if exp.metrics.empty:
        blocks.append(("p", "No run has logged metrics yet: the curves, stability and clip-fraction figures are "
                            "left out."))
    for figure in made:
        if figure.fig is not None:
            plots.save(figure.fig, out_dir, figure.stem, formats)
            blocks.append(("figure", figure.stem, figure.title, f"Figure `{figure.stem}`. {figure.caption}"))
        else:
            blocks.append(("p", f"{figure.title}: not drawn."))
        if figure.notes:
            blocks.append(("ul", figure.notes))

    (out_dir / "report.md").write_text(render_md(blocks))
    (out_dir / "report.html").write_text(render_html(blocks, out_dir, f"Report: {name}"))
