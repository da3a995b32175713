"""results/<exp>/ -> results/<exp>/report/: figures, tables (CSV and Markdown), report.md and a self-contained
report.html (figures embedded as base64 PNG). The folder is written beside the target and renamed into place, so a
killed analysis leaves the previous report whole.

Order: the headline (start and end accuracy per objective and cell, what is missing), the figures (over the swept
axes, then per cell), then the tables. Every number is per (objective, cell) (analysis/cells.py): runs that differ
in a setting are never pooled, and n counts distinct seeds. Whatever the folder holds (a sweep still running, an
objective whose runs all failed, a deleted summary.json, a run with only step 0, an empty metrics file) the report
is written and says what is missing.
"""

from __future__ import annotations

import base64
import html
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from scipy.stats import trim_mean

from analysis import axes, paired, plots, scaling, timing, verdict
from analysis.accuracy import ACCURACY_RANGE, estimate, runs_scores
from analysis.accuracy import interval_of as accuracy_interval
from analysis.cells import CODE, START_SEED, UNKNOWN, Cells, show
from analysis.combine import combined_dir, load_experiments, named
from analysis.latex import write_tables
from analysis.load import COLLAPSE_RULE, SCORING_PREFIX, AnalysisError, AnalysisWarning, Experiment
from analysis.stats import (
    ACCURACY_INTERVALS,
    INDICATIVE_BELOW,
    INTERVALS,
    IQM_MIN_SEEDS,
    coinciding,
    indicative,
    indicative_units,
    num,
    p_text,
    rate_interval,
    top_units,
)
from harness.run.atomic import (
    TMP,
    WRITTEN,
    ForeignFileError,
    check_writable,
    remove_dead_writers_temporaries,
    write_into,
)
from harness.run.config import nested, objective_defaults
from harness.run.errors import ConfigError
from harness.run.offpolicy import behaviour_logp
from harness.run.provenance import code_record, versions_lines

CONFIG_KEYS = {"experiment": "name", "model": "model.name", "precision": "model.dtype",
               "LoRA rank (0: full fine-tuning)": "model.lora.rank", "backend": "backend", "task": "task.name",
               "steps": "train.steps", "group size": "train.group_size", "prompts per step": "train.prompts_per_step",
               "rollout correction": "train.rollout_correction.mode", "routing replay": "train.routing_replay"}
# the fixed figures of a cell; besides them, metrics_<prefix> draws the other per-step metrics of one name prefix
FIGURES = {"curves_step": "Accuracy and reward against training step",
           "curves_tokens": "Accuracy and reward against rollout tokens",
           "stability": "Stability diagnostics against training step",
           "clip_fraction": "Clip fraction: this run (measured) vs the GSPO paper (reported)",
           "final_eval": "Final eval accuracy per objective"}
IDENTITY_COLUMNS = {"run_id", "objective", "seed", START_SEED, "cell", "cell_id", "counted"}  # the run's naming columns
ENDED = "ended (finished, or diverged: stopped by the loop for non-finite updates, scored by its last eval)"


def accuracies(runs: pd.DataFrame) -> dict[str, str]:
    """Table prefix -> the run column it summarises: start (step 0), final, best, final per scoring variant."""
    variants = {f"final_{c.removeprefix('final_' + SCORING_PREFIX)}": c for c in runs
                if c.startswith("final_" + SCORING_PREFIX)}
    return {"start": "start_eval_accuracy", "final": "final_eval_accuracy", "best": "best_eval_accuracy", **variants}


def cell_identity(runs: pd.DataFrame) -> pd.DataFrame:
    """The cell columns a table needs; runs loaded without cells (a hand-made frame) form one cell."""
    runs = runs.copy()
    for column, default in (("cell_id", 0), ("cell", "all runs"), ("counted", True), ("duplicate_of", "")):
        if column not in runs:
            runs[column] = default
    if "ended" not in runs:
        runs["ended"] = runs["complete"]
    for column in ("collapse_cause", "collapse_source"):
        if column not in runs:
            runs[column] = None
    return runs


def eval_table(runs: pd.DataFrame, axes_keys: list[str] | tuple = (), samples: dict | None = None) -> pd.DataFrame:
    """One row per (cell, objective) (objectives in the registry's order): over its counted runs that ended (seeds:
    their number, one per distinct seed) the start, final, best (and per scoring variant final) eval accuracy as
    mean, interval (analysis/accuracy.py: over seeds and eval problems where the runs' per-problem scores are in
    ``samples``, else over seeds; ``_problems`` says which), n, IQM; the collapses (k of the runs whose collapse state
    is known, rate, Wilson interval, causes); mean cost per run; the runs not ended and the duplicates left out.
    ``axes_keys``: the swept settings (one may be given as a string)."""
    axes_keys = [axes_keys] if isinstance(axes_keys, str) else axes_keys  # not read one character at a time
    runs = cell_identity(runs)
    rows = []
    order = {o: i for i, o in enumerate(paired.registry_order(runs["objective"]))}
    groups = sorted(runs.groupby(["cell_id", "objective"], sort=True), key=lambda g: (g[0][0], order[g[0][1]]))
    for (cell_id, objective), group in groups:
        counted = group[group["counted"]]
        done = counted[counted["ended"]]
        first = group.iloc[0]
        row = {"cell_id": cell_id, "cell": first["cell"], **{a: first[a] for a in axes_keys}, "objective": objective,
               "seeds": len(done)}
        for kind, column in accuracies(runs).items():
            d = accuracy_interval(runs_scores(group, samples or {}, column), ACCURACY_RANGE)
            values = done[column].astype(float)
            values = values[np.isfinite(values)]
            row.update({f"{kind}_mean": d.mean, f"{kind}_ci_low": d.low, f"{kind}_ci_high": d.high,
                        f"{kind}_n": d.n, f"{kind}_top": d.top, f"{kind}_problems": d.problems,
                        f"{kind}_iqm": trim_mean(values, 0.25) if len(values) >= IQM_MIN_SEEDS else np.nan})
        known = done[done["collapse_source"].notna()]
        k, n = int(known["collapse_cause"].notna().sum()), len(known)
        low, high = rate_interval(k, n)
        causes = known["collapse_cause"].dropna().value_counts().sort_index()
        row.update(collapse_k=k, collapse_n=n, collapse_rate=k / n if n else np.nan, collapse_low=low,
                   collapse_high=high, collapse_causes=", ".join(f"{c} {m}" for c, m in causes.items()),
                   diverged=int((done["status"] == "diverged").sum()),
                   wall_time_s=done["wall_time_s"].mean(), rollout_tokens=done["rollout_tokens"].mean(),
                   rollout_tokens_per_step=(done["rollout_tokens"].astype(float)
                                            / done["steps_done"].astype(float).where(done["steps_done"] > 0)).mean(),
                   unfinished_runs=len(counted) - len(done), not_ended=not_ended(counted),
                   duplicates=int((group["duplicate_of"] != "").sum()))
        rows.append(row)
    return pd.DataFrame(rows)


def not_ended(counted: pd.DataFrame) -> str:
    """How many of an objective's counted runs (of a cell) did not end, by status, of how many: "1 failed of 3 runs"
    ("" when every one ended). A finished run that does not count has incomplete or edited records."""
    left = counted.loc[~counted["ended"], "status"].replace({"finished": "with incomplete records",
                                                           "diverged": "with incomplete records"})
    if left.empty:
        return ""
    states = ", ".join(f"{k} {s}" for s, k in left.value_counts().sort_index().items())
    return f"{states} of {plural(len(counted), 'run')}"


def interval(low, high, n, problems: bool = False, top=None) -> str:
    """An interval as the tables show it: its name, bounds, what it covers and whether it is indicative (by its top
    level's units: its ``top`` starting policies where it has two or more, else its n seeds)."""
    if n < 2 or pd.isna(low):
        return "n/a"
    name = "range" if n == 2 and not problems else "95% CI"
    where = "" if problems else " (seeds only)"
    return f"{name} [{num(low)}, {num(high)}]{where}" + (f", {indicative_units(n, top)}: indicative"
                                                        if indicative(top_units(n, top)) and name != "range" else "")


def summary_columns(table: pd.DataFrame, kind: str, label: str, iqm: bool = True) -> dict:
    problems = table[f"{kind}_problems"] if f"{kind}_problems" in table else [False] * len(table)
    out = {f"{label} mean": table[f"{kind}_mean"].map(num),
           f"{label} interval": [interval(lo, hi, n, p, top) for lo, hi, n, p, top in
                                 zip(table[f"{kind}_ci_low"], table[f"{kind}_ci_high"], table[f"{kind}_n"],
                                     problems, table.get(f"{kind}_top", [None] * len(table)), strict=True)]}
    if iqm:
        out[f"{label} IQM"] = table[f"{kind}_iqm"].map(num)
    return out


def cell_columns(table: pd.DataFrame, cells: Cells) -> dict:
    """One column per axis (its short name) when there is more than one cell; nothing otherwise (Cells.columns)."""
    return cells.columns(table["cell_id"])


def collapsed_column(table: pd.DataFrame) -> list[str]:
    return [f"{k}/{n}" if n else "n/a" for k, n in zip(table["collapse_k"], table["collapse_n"], strict=True)]


def eval_display(table: pd.DataFrame, runs: pd.DataFrame, cells: Cells | None = None) -> pd.DataFrame:
    """Final, then final under each scoring variant (no IQM), then best; collapses; cost."""
    out = {**cell_columns(table, cells or Cells()), "objective": table["objective"], "n (ended)": table["seeds"]}
    out.update(summary_columns(table, "final", "final"))
    for kind in accuracies(runs):
        if kind.startswith("final_"):
            out.update(summary_columns(table, kind, f"final, {kind.removeprefix('final_')} scoring", iqm=False))
    out.update(summary_columns(table, "best", "best"))
    out.update({"collapsed": collapsed_column(table), "wall time (s/run)": table["wall_time_s"].map(num),
                "rollout tokens (/run)": table["rollout_tokens"].map(num),
                "unfinished runs": table["unfinished_runs"]})
    return pd.DataFrame(out)


def same_start(table: pd.DataFrame) -> bool:
    """Whether every row of the table starts alike: the same step-0 mean and, where there is one, interval (one
    starting policy, greedy evaluation: the same scores on every run)."""
    done = table[table["start_n"] > 0]
    bounded = done[done["start_ci_low"].notna()]

    def alike(values: pd.Series) -> bool:  # equal to round-off (means over 2 and 3 equal seeds differ in the last bit)
        return values.empty or bool(np.ptp(values.to_numpy(dtype=float)) <= 1e-12)

    return len(done) > 1 and alike(done["start_mean"]) and alike(bounded["start_ci_low"]) and \
        alike(bounded["start_ci_high"])


def headline_display(table: pd.DataFrame, cells: Cells | None = None) -> pd.DataFrame:
    """Start and end accuracy per (objective, cell); the start's columns left out when every row starts alike
    (start_line says it once)."""
    out = {**cell_columns(table, cells or Cells()), "objective": table["objective"]}
    kinds = (("final", "end"),) if same_start(table) else (("start", "start (step 0)"), ("final", "end"))
    for kind, label in kinds:
        out.update(summary_columns(table, kind, label, iqm=False))
        out[f"{label} n"] = table[f"{kind}_n"]
    out["collapsed"] = collapsed_column(table)
    return pd.DataFrame(out)


def start_line(table: pd.DataFrame) -> str | None:
    """The one start accuracy (and its interval, from the objective with the most seeds) of a table whose rows start
    alike (same_start), else None."""
    if not same_start(table):
        return None
    done = table[table["start_n"] > 0]
    row = done.sort_values("start_n", ascending=False).iloc[0]  # one with an interval, if any
    several = "start_top" in done and bool((done["start_top"].fillna(0) >= 2).any())  # starting policies
    why = ("every objective's runs start from the same starting policies" if several else
           "with one starting policy and greedy evaluation every run scores each problem alike, and the interval is "
           "the eval set's sampling")
    shown = interval(row["start_ci_low"], row["start_ci_high"], int(row["start_n"]), row["start_problems"],
                     row.get("start_top"))
    return (f"Every objective starts at {num(row['start_mean'])} at step 0 ({shown}; "
            f"{why}): the start's columns are left out of the table.")


def collapse_display(table: pd.DataFrame, cells: Cells) -> pd.DataFrame:
    return pd.DataFrame({**cell_columns(table, cells), "objective": table["objective"],
                         "collapsed": collapsed_column(table), "rate": table["collapse_rate"].map(num),
                         "Wilson 95% interval": [f"[{num(lo)}, {num(hi)}]" if n else "n/a" for lo, hi, n in
                                                 zip(table["collapse_low"], table["collapse_high"],
                                                     table["collapse_n"], strict=True)],
                         "causes": table["collapse_causes"].replace("", "none"), "diverged": table["diverged"]})


def rule_text() -> str:
    r = COLLAPSE_RULE
    return (f"A run collapsed (harness/run/collapse.py) when its eval accuracy stays more than {r.eval_margin:g} "
            f"below its step-0 accuracy for {r.eval_consecutive} evaluations in a row (`eval_drop`), a training "
            f"step's loss or gradient is non-finite or skips an update for it (`non_finite_loss`, "
            f"{r.nonfinite_consecutive} step), the entropy stays below {r.entropy_floor:g} nats/token for "
            f"{r.entropy_consecutive} steps (`entropy_floor`) or the clip fraction at or above {r.clip_ceiling:g} "
            f"for {r.clip_consecutive} steps "
            "(`clip_saturation`). The record is summary.json's `collapse` when the run wrote one, else the same rule "
            "applied here to its metrics. Rate: collapsed / ended runs of the cell (n: distinct seeds), with a "
            "Wilson score 95% interval.")


def start_policy_lines(runs: pd.DataFrame) -> list[str]:
    """One line per distinct starting policy (summary.json's start_policy: its key and weights, analysis/load.py),
    naming the runs that used it."""
    lines = []
    written = runs[runs["has_summary"]] if "has_summary" in runs else runs
    if written.empty:
        return ["not known yet: no run has written its summary.json."]
    everyone = "all runs" if len(written) == len(runs) else "every run with a summary.json"
    runs = written
    keys = runs["start_policy"].fillna("")
    for key, group in runs.groupby(keys, sort=True):
        counts = group["objective"].value_counts().sort_index()
        which = everyone if len(group) == len(runs) else ", ".join(f"{o} ({plural(k, 'run')})"
                                                                     for o, k in counts.items())
        if key.partition("/")[0] == "none":
            weights = f", weights `{key.partition('/')[2]}`" if "/" in key else ""
            lines.append(f"no warm start: the runs start from the base model{weights} ({which}).")
        elif not key:
            lines.append(f"not recorded ({which}: summary.json has no `start_policy`, runs written before the field).")
        else:
            first = group.iloc[0]
            steps = first.get("start_policy_steps")
            steps = "?" if pd.isna(steps) else f"{steps:,.0f}"
            key, _, weights = key.partition("/")
            cpu = first.get("start_policy_cpu")
            built = f", weights `{weights}`" + (f" (built on {cpu})" if isinstance(cpu, str) else "") if weights else ""
            lines.append(f"key `{key}`{built}, warm-started {steps} steps, check accuracy "
                         f"{num(first.get('start_policy_check_accuracy'))}, eval accuracy "
                         f"{num(first.get('start_policy_eval_accuracy'))} ({which}).")
    return lines


def collapse_text(run) -> str:
    """'step 12: eval_drop', 'no' (the rule found none) or 'n/a' (no record and no metrics)."""
    if isinstance(run.collapse_cause, str):
        return f"step {num(run.collapse_step)}: {run.collapse_cause}"
    return "no" if isinstance(run.collapse_source, str) else "n/a"


def counted_text(run) -> str:
    """Whether the numbers count a run (counted and ended), and if not why: a duplicate, its seed unknown, another
    starting policy's weights (analysis/cells.py), its status (failed, stopped, running), or records that are
    incomplete or edited (a finished run a data warning names)."""
    if run.counted and run.ended:
        return "yes"
    if run.duplicate_of:
        return f"no: duplicate of {run.duplicate_of}"
    if pd.isna(run.seed):
        return "no: seed unknown"
    if not run.counted:
        return "no: another starting policy's weights under its model.seed (see Data warnings)"
    if run.status in ("finished", "diverged"):
        return "no: its records are incomplete or edited (see Data warnings)"
    return f"no: {run.status}"


def runs_display(runs: pd.DataFrame, cells: Cells | None = None) -> pd.DataFrame:
    runs = cell_identity(runs)
    cells = cells or Cells()
    out = {"run_id": runs["run_id"], "objective": runs["objective"]}
    if len(cells.labels) > 1:
        out["cell"] = runs["cell"]
    if "source" in runs and runs["source"].nunique() > 1:
        out["folder"] = runs["source"]
    out.update({
        "seed": runs["seed"].astype("string").fillna("?"), "status": runs["status"],
        "steps": runs["steps_done"].astype(str) + "/" + runs["total_steps"].astype("string").fillna("?"),
        "last eval acc": runs["final_eval_accuracy"].map(num), "best eval acc": runs["best_eval_accuracy"].map(num),
        "collapse": [collapse_text(r) for r in runs.itertuples()],
        "counted": [counted_text(r) for r in runs.itertuples()],
        "wall time (s)": runs["wall_time_s"].map(num)})
    return pd.DataFrame(out)


def config_summary(exp: Experiment) -> tuple[list[str], list[str]]:
    """The shared settings, and the settings that differ between runs: the swept axes (cells) and the objective
    settings (constant within each objective)."""
    configs = {run_id: c for run_id, c in exp.configs.items() if c}
    counts = exp.runs["objective"].value_counts().sort_index()
    cells = exp.cells
    lines = []
    for label, key in CONFIG_KEYS.items() if configs else ():
        values = sorted({str(c.get(key, "unset")) for c in configs.values()})
        below = key in cells.axes or key in cells.objective_settings  # else not a setting (the experiment's name)
        lines.append(f"{label}: " + (values[0] if len(values) == 1 else "differs between runs (below)" if below
                                     else ", ".join(values)))
    for label, text in DERIVED_CONFIG.items() if configs else ():
        values = sorted({text(c) for c in configs.values()}, key=lambda v: (len(v), v))  # 4 before 16
        lines.append(f"{label}: " + (values[0] if len(values) == 1 else "differs between runs: " + "; ".join(values)))
    lines.append("objectives: " + ", ".join(f"{o} ({plural(k, 'run')})" for o, k in counts.items()))
    lines.append("seeds: " + ", ".join(str(s) for s in sorted(exp.runs["seed"].dropna().unique())))
    if len(configs) < len(exp.runs):
        lines.append(f"config.yaml found for {len(configs)} of {plural(len(exp.runs), 'run')}")
    diffs = []
    for axis in cells.axes:
        values = sorted({show(v) for v in exp.runs[axis]}, key=lambda v: (len(v), v))
        diffs.append(f"{axis}: swept axis (one cell per value): {', '.join(values)}")
    for key, per_objective in cells.objective_settings.items():  # unset: the objective's own value, where it has one
        shown = {o: own_value_text(exp, o, key) if v == "unset" and key in objective_defaults(o) else v
                 for o, v in per_objective.items()}
        diffs.append(f"{key}: per objective: " + ", ".join(f"{o}={v}" for o, v in shown.items()))
    return lines, diffs


def lag_text(config: dict) -> str:
    """A run's policy lag as it ran (its config.yaml's dotted keys): 0 (synchronous), or k with the lag's shape."""
    lag = config.get("train.rollout_lag", "unset")
    if lag in ("unset", 0):
        return str(lag)
    tokens = config.get("train.in_flight_tokens") or 0
    shape = "mixed ages" if config.get("train.lag_mode") == "mixed" else "fixed"
    return f"{lag} ({shape}" + (f", in flight every {tokens} tokens)" if tokens else ")")


def old_logp_text(config: dict) -> str:
    """Where a run's old log-probs came from (its config.yaml's dotted keys): ``train.old_logp``, or recompute where a
    rollout correction or routing replay recomputes them whatever it says (harness/run/offpolicy.py)."""
    train = nested(config).get("train", {})
    if "old_logp" not in train:
        return "unset"
    try:
        source = behaviour_logp(OmegaConf.create(train))
    except OmegaConfBaseException:  # a config.yaml of other code, without the keys this code reads: as written
        return f"{train['old_logp']} (as written)"
    return source + (" (the behaviour policy's)" if source == "sampler" else " (the proximal policy's, recomputed)")


# configuration lines read from each run's settings together: label -> the text of one run's
DERIVED_CONFIG = {"policy lag (train.rollout_lag)": lag_text, "old log-probs": old_logp_text}


def own_value_text(exp: Experiment, objective: str, key: str) -> str:
    """Objective ``objective``'s own value of setting ``key`` as its runs ran it: this code's for runs of this code,
    the value their code recorded (summary.json's ``objective_own``) for the others; runs of other code that recorded
    none say only that it was their code's own (which may differ from this code's)."""
    runs = exp.runs[exp.runs["objective"] == objective]
    this = runs["code"].fillna(UNKNOWN).astype(str) == code_record()["version"]
    texts = runs["objective_own"] if "objective_own" in runs else pd.Series(None, index=runs.index, dtype=object)
    if texts[~this].isna().any():
        return "its own (not recorded by its runs' code)"
    values = {show(json.loads(text).get(key, "unset")) for text in texts[~this]}
    values |= {show(objective_defaults(objective)[key])} if this.any() else set()
    if len(values) == 1:
        return f"{next(iter(values))} (its own)"
    return f"its own ({', '.join(sorted(values))}: as its runs recorded it)"


def sources_text(exp: Experiment) -> str:
    """The results folders the report reads, as the report names them."""
    return ", ".join(f"`{d}`" for d in exp.sources or [exp.dir])


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def save_table(out_dir: Path, name: str, numbers: pd.DataFrame, shown: pd.DataFrame | None = None) -> None:
    """``name``.csv (``numbers``) and ``name``.md (``shown``, the table as the report shows it, else the numbers):
    every table of the report in both formats."""
    numbers.to_csv(out_dir / f"{name}.csv", index=False)
    (out_dir / f"{name}.md").write_text(md_table(numbers if shown is None else shown) + "\n")


def md_table(df: pd.DataFrame) -> str:
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(cell, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def render_md(blocks: list[tuple]) -> str:
    out = []
    for kind, *args in blocks:
        if kind in ("h1", "h2", "h3"):
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
        if kind in ("h1", "h2", "h3", "p"):
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


def coincide_lines(found: dict, prefix: str = "") -> list[str]:
    lines = []
    for (a, b), (same, compared) in found.items():
        if same == compared:
            lines.append(f"{prefix}{a} and {b} coincide on every logged step of every drawn metric both report "
                         f"({plural(len(same), 'metric')}: {', '.join(f'`{m}`' for m in same)}).")
        else:
            lines.append(f"{prefix}{a} and {b} coincide on every logged step of {', '.join(f'`{m}`' for m in same)} "
                         f"({len(same)} of the {len(compared)} drawn metrics both report).")
    return lines


def figures(runs: pd.DataFrame, metrics: pd.DataFrame, name: str, smooth: int, paper: bool,
            fits: list[scaling.ObjectiveFit], look: dict[str, plots.Style], suffix: str = "",
            samples: dict | None = None) -> tuple[list[plots.Made], list[str], list[str]]:
    """Every figure of one cell (drawn or not, with its notes; stems end in `suffix`), the pairs of objectives whose
    curves coincide, and the metrics left out (constant to round-off); `fits`: the cell's compute-performance fits
    (scaling.fit_objectives)."""
    made, coincide, left_out = [], [], []
    flat = plots.round_off(metrics) if not metrics.empty else {}
    if not metrics.empty:
        made += [plots.curves_figure(metrics, "step", look, smooth, f"{name}: accuracy and reward by step", paper),
                 plots.curves_figure(metrics, "rollout_tokens", look, smooth,
                                     f"{name}: accuracy and reward by rollout tokens", paper),
                 plots.scaling_figure(fits, look, f"{name}: compute-performance fit", paper),
                 plots.stability_figure(metrics, look, smooth, f"{name}: stability diagnostics", paper,
                                        frozenset(flat)),
                 plots.clip_figure(metrics, runs, look, f"{name}: clip fraction, measured vs paper", paper)]
    estimates = {o: estimate(g, samples or {}) for o, g in cell_identity(runs).groupby("objective")}
    made.append(plots.final_figure(runs, look, f"{name}: final eval accuracy", paper, estimates))
    if not metrics.empty:
        drawn = [m for m in [*plots.CURVES, *plots.STABILITY, *plots.ROUTING, *plots.STALENESS]
                 if plots.reported(metrics, m) and m not in flat]
        own = [m for m in sorted(metrics.columns) if plots.own_scale(m) and m not in flat
               and not plots.bookkeeping(m) and plots.reported(metrics, m)]
        if own:
            made.append(plots.own_scale_figure(metrics, own, look, smooth, f"{name}: each objective's loss", paper))
        for family, columns in plots.families(metrics, set(drawn) | set(flat) | set(own)).items():
            title = "Other per-step metrics" if family == "other" else f"Metrics {family}_*"
            made.append(plots.family_figure(metrics, family, columns, look, smooth, f"{name}: {title}", paper))
            drawn += columns
        coincide = coincide_lines(coinciding(metrics, drawn))
        if flat:
            left_out.append("Left out of the figures, constant (to round-off: a spread of at most 1e-6 of their "
                            "size) at every logged step of every run: "
                            + ", ".join(f"`{m}` ({low:.2g} throughout)" if low == high else
                                        f"`{m}` (between {low:.2g} and {high:.2g})" for m, (low, high) in flat.items())
                            + ".")
    for figure in made:
        figure.stem += suffix
    return made, coincide, left_out


def check_default_folder(exp_dir: str | Path | list[str | Path], out: str | Path | None) -> None:
    """Several folders of one name (``a/x``, ``b/x``) without ``--out``: refused (AnalysisError). Their default folder,
    ``x+x`` beside the first, is every such pair's: another pair's report would replace this one. One folder given
    twice (``R R``, ``R ./R``) is refused with or without ``--out``."""
    dirs = [Path(d) for d in (exp_dir if isinstance(exp_dir, list | tuple) else [exp_dir])]
    resolved = [d.resolve() for d in dirs]
    again = next((d for d, r in zip(dirs, resolved, strict=True) if resolved.count(r) > 1), None)
    if again is not None:  # its runs would be reported twice, as two sweeps
        raise AnalysisError(f"{again} is given twice (as the same folder): give each results folder once")
    names = [named(d).name for d in dirs]
    if out is None and len(dirs) > 1 and len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise AnalysisError(f"the folders share the name {', '.join(twice)}: the default report folder "
                            f"({combined_dir(dirs) / 'report'}) would be any such pair's; give --out (make plots: "
                            "OUT=folder)")


def build_report(exp_dir: str | Path | list[str | Path], out: str | Path | None = None, smooth: int = 1,
                 formats: tuple[str, ...] = ("png", "pdf"), paper: bool = False, baseline: str | None = None,
                 latex: bool = False) -> Path:
    """Write the report folder; returns the path of report.md. ``exp_dir``: a results folder, or a list of them
    (one report over all their runs, analysis/combine.py; by default into ``<a>+<b>/report`` beside the first).
    Data problems are warned (AnalysisWarning) and listed in the report; a missing or empty results folder raises
    AnalysisError. ``paper``: figures for a paper (see plots), PDF among the formats. ``baseline``: the objective
    the verdict compares the others to (None: manifest.json's, else analysis.paired.default_baseline). ``latex``:
    booktabs tables beside report.md (analysis/latex.py). The files are built in a hidden sibling folder, then
    each renamed into place (harness.run.atomic.write_into): a file the report did not write there (a draft beside
    it) is kept, and one of a report file's name refused (AnalysisError)."""
    unknown = set(formats) - set(plots.SAVE_METADATA)
    if unknown:
        raise AnalysisError(f"unknown figure format(s) {', '.join(sorted(unknown))}; use png, pdf or svg")
    formats = ["png"] + [f for f in formats if f != "png"] + (["pdf"] if paper and "pdf" not in formats else [])
    check_default_folder(exp_dir, out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AnalysisWarning)
        exp = load_experiments(exp_dir if isinstance(exp_dir, list | tuple) else [exp_dir])
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    data_warnings = [str(w.message) for w in caught if issubclass(w.category, AnalysisWarning)]
    if baseline is not None and baseline not in set(exp.runs["objective"]):
        raise AnalysisError(f"--baseline {baseline}: no run of {baseline} in {sources_text(exp)}; its objectives: "
                            + ", ".join(paired.registry_order(exp.runs["objective"])))
    out_dir = Path(out) if out else exp.dir / "report"
    try:
        check_writable(out_dir, "report folder", "choose another --out")
    except ConfigError as e:
        raise AnalysisError(str(e)) from None
    # a folder of one's own is not written into; a killed write may have left only its list's temporary there
    held = [p for p in out_dir.iterdir() if p.name != WRITTEN + TMP] if out_dir.is_dir() else []
    if held and not any((out_dir / n).exists() for n in ("report.md", WRITTEN)):
        raise AnalysisError(f"{out_dir} is not empty and holds no report.md: refusing to write into it; choose another "
                            "--out")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_writers_temporaries(out_dir)  # a killed analysis's (another may be writing now: its writer lives)

    def write(tmp: Path) -> None:
        tmp.mkdir()
        with plots.context(paper):
            write_report(exp, tmp, smooth, formats, paper, data_warnings, baseline, latex)

    try:
        write_into(out_dir, write, earlier=("report.md", "# Report: "), entries=("report.html",))
    except ForeignFileError as e:
        raise AnalysisError(str(e)) from None
    return out_dir / "report.md"


def status_lines(exp: Experiment, table: pd.DataFrame, data_warnings: list[str]) -> list[str]:
    """What the headline's numbers rest on and what is missing: runs by status, the (objective, cell)s without an
    ended run, duplicates and starting policies built apart left out, data warnings."""
    runs = exp.runs
    counts = runs["status"].value_counts()
    what = {"finished": "finished", "diverged": "diverged (stopped by the loop for non-finite updates)",
            "running": "running now", "stopped": "stopped (killed: run the same command to resume)",
            "failed": "failed", "interrupted": "interrupted (Ctrl-C / SIGTERM: run the same command to resume)",
            "pending": "not started"}
    parts = [f"{counts[s]} {label}" for s, label in what.items() if s in counts]
    parts += [f"{k} with status {s}" for s, k in counts.items() if s not in what]
    lines = [f"{plural(len(runs), 'run')}: " + ", ".join(parts) + "."]
    multi = len(exp.cells.labels) > 1
    for row in table[table["seeds"] == 0].itertuples():
        group = runs[(runs["objective"] == row.objective) & (runs["cell_id"] == row.cell_id)]
        states = ", ".join(f"{k} {s}" for s, k in group["status"].value_counts().sort_index().items())
        errors = sorted({e.split("error: ", 1)[1] for e in group["problem"] if "error: " in e})
        where = f" in cell `{row.cell}`" if multi else ""
        lost = (group["status"] == "finished").any()  # the manifest's word; its summary or metrics gone or unreadable
        lines.append(f"{row.objective}{where}: " + (f"no ended run can be read ({states}, a file it needs missing "
                                                     "or damaged: see Data warnings)" if lost else
                                                     f"no run has ended ({states})")
                     + (f"; error: {errors[0]}" if errors else "") + ": its accuracy is n/a.")
    partial = table[(table["seeds"] > 0) & (table["unfinished_runs"] > 0)]
    if len(partial):
        lines.append("Not ended yet (left out of the numbers): " + ", ".join(
            f"{r.objective}{f' [{r.cell}]' if multi else ''} {r.unfinished_runs}" for r in partial.itertuples()) + ".")
    if exp.cells.duplicates:
        lines.append(f"{plural(len(exp.cells.duplicates), 'set')} of duplicate runs (same objective, cell and seed): "
                     "one of each counted (see Data warnings).")
    if exp.cells.mixed_policies:
        n = len(exp.cells.mixed_policies)
        lines.append(f"{n} starting polic{'y' if n == 1 else 'ies'} with other "
                     "weights in some runs (one warm-start key, or one cell without a warm start, and one model.seed): "
                     "the runs of one set of weights counted (see Data warnings).")
    if data_warnings:
        lines.append(f"{plural(len(data_warnings), 'data warning')}: see Data warnings below.")
    return lines


def cell_lines(exp: Experiment) -> list[str]:
    """The cells, named explicitly, with their runs."""
    runs = exp.runs
    lines = []
    for i, label in enumerate(exp.cells.labels):
        group = runs[(runs["cell_id"] == i) & runs["counted"]]
        per = group.groupby("objective")["seed"].nunique()
        lines.append(f"cell {i + 1}: `{label}` — " + (", ".join(f"{o} ({plural(k, 'seed')})" for o, k in per.items())
                                                      or "no counted run"))
    return lines


def cell_subsets(exp: Experiment) -> list[tuple[int, pd.DataFrame, pd.DataFrame]]:
    """(cell id, its counted runs, their metrics) for each cell with a counted run."""
    out = []
    for i in range(len(exp.cells.labels)):
        runs = exp.runs[(exp.runs["cell_id"] == i) & exp.runs["counted"]]
        if len(runs):
            metrics = exp.metrics[exp.metrics["run_id"].isin(set(runs["run_id"]))] if len(exp.metrics) else \
                exp.metrics
            out.append((i, runs, metrics))
    return out


def with_cell(frame: pd.DataFrame, label: str, multi: bool) -> pd.DataFrame:
    if multi and len(frame):
        frame = frame.copy()
        frame.insert(0, "cell", label)
    return frame


def paired_display(frame: pd.DataFrame, cells: Cells) -> pd.DataFrame:
    return pd.DataFrame({
        **cell_columns(frame, cells), "A": frame["a"], "B": frame["b"], "paired seeds": frame["n"],
        "A − B (final acc)": frame["difference"].map(num),
        "interval": [interval(lo, hi, n, p, top) for lo, hi, n, p, top in
                     zip(frame["difference_low"], frame["difference_high"], frame["n"], frame["problems"],
                         frame.get("top", [None] * len(frame)), strict=True)],
        "p (t-test)": frame["p_value"].map(p_text),
        "wins/ties/losses": [f"{w}/{t}/{lo}" for w, t, lo in zip(frame["wins"], frame["ties"], frame["losses"],
                                                                 strict=True)],
        "P(A > B)": frame["p_improvement"].map(num),
        "P interval": [f"[{num(lo)}, {num(hi)}]" if pd.notna(lo) else "n/a"
                       for lo, hi in zip(frame["p_low"], frame["p_high"], strict=True)]})


def ci_text(low, high) -> str:
    return "n/a" if pd.isna(low) else f"[{num(low)}, {num(high)}]"


def aggregate_display(frame: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"A": frame["a"], "B": frame["b"], "cells": frame["cells"], "units in every cell": frame["n"],
                         "mean over cells of A − B": frame["difference"].map(num),
                         "95% CI": [ci_text(lo, hi) for lo, hi in
                                                 zip(frame["difference_low"], frame["difference_high"], strict=True)],
                         "P(A > B)": frame["p_improvement"].map(num),
                         "P 95% CI": [ci_text(lo, hi) for lo, hi in
                                                   zip(frame["p_low"], frame["p_high"], strict=True)]})


def iqm_display(frame: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"objective": frame["objective"], "cells": frame["cells"], "runs": frame["n"],
                         "IQM": frame["iqm"].map(num),
                         "IQM 95% CI": [ci_text(lo, hi) for lo, hi in zip(frame["iqm_low"], frame["iqm_high"],
                                                                          strict=True)],
                         "mean": frame["mean"].map(num),
                         "mean 95% CI": [ci_text(lo, hi) for lo, hi in zip(frame["mean_low"], frame["mean_high"],
                                                                           strict=True)]})


@dataclass(frozen=True)
class Numbers:
    """The report's tables per (objective, cell), as written to its csv / md files."""

    table: pd.DataFrame  # eval_table: accuracies, intervals, collapse rates
    headline: pd.DataFrame
    collapse: pd.DataFrame
    pairs: pd.DataFrame  # paired comparisons per cell
    aggregated: pd.DataFrame  # ... aggregated over cells
    iqms: pd.DataFrame
    baseline: str | None  # the objective the verdict compares the others to
    verdicts: list  # analysis.verdict.CellVerdict per cell


@dataclass(frozen=True)
class CellParts:
    """What each cell adds: its compute-performance fits, where its time went, its figures."""

    fit_table: pd.DataFrame
    times: pd.DataFrame
    blocks: list  # the cells' figure blocks
    coincide: list[str]  # objectives whose curves coincide


def write_report(exp: Experiment, out_dir: Path, smooth: int, formats: list[str], paper: bool,
                 data_warnings: list[str], baseline: str | None = None, latex: bool = False) -> None:
    """report.md and report.html (and every table and figure they show) into ``out_dir``; verdict.txt: the
    verdict's lines and, when the objectives' rollout budgets differ, that line (what the command line prints); with
    ``latex`` the LaTeX tables (analysis/latex.py)."""
    look = plots.styles(exp.runs["objective"])
    numbers = write_numbers(exp, out_dir, baseline)
    if latex:
        write_tables(out_dir, exp.name, sources_text(exp), numbers.table, numbers.pairs, exp.cells, numbers.baseline)
    parts = write_cells(exp, out_dir, smooth, formats, paper, look)
    overview = axes.axis_figures(numbers.table, exp.cells, look, exp.name, paper) if exp.cells.axes else []
    blocks = [*intro_blocks(exp, numbers, data_warnings), *figures_section(exp, parts, overview, out_dir, formats),
              *results_blocks(exp, numbers, parts, data_warnings)]
    (out_dir / "report.md").write_text(render_md(blocks))
    (out_dir / "report.html").write_text(render_html(blocks, out_dir, f"Report: {exp.name}"))


def write_numbers(exp: Experiment, out_dir: Path, baseline: str | None = None) -> Numbers:
    """Per (objective, cell): the eval, headline, collapse and paired tables, as csv and md; the verdict (baseline:
    the --baseline given, else manifest.json's, else paired.default_baseline)."""
    runs, cells = exp.runs, exp.cells
    table = eval_table(runs, cells.axes, exp.samples)
    save_table(out_dir, "eval_accuracy", table, eval_display(table, runs, cells))
    save_table(out_dir, "runs", runs, runs_display(runs, cells))
    headline = headline_display(table, cells)
    save_table(out_dir, "headline", headline)
    collapse = collapse_display(table, cells)
    save_table(out_dir, "collapse", collapse)
    ended = runs.loc[runs["counted"] & runs["ended"], "objective"]
    baseline = baseline or exp.baseline or paired.default_baseline(ended, exp.objectives)
    present = baseline if baseline in set(runs["objective"]) else None  # a sweep's baseline that never ran: no pairs
    pairs = paired.per_cell(runs, samples=exp.samples, baseline=present)  # against it (as before), not an error
    aggregated = paired.aggregate(runs, samples=exp.samples, baseline=baseline)
    iqms = paired.iqm(runs, samples=exp.samples)
    save_table(out_dir, "paired", pairs, paired_display(pairs, cells))
    save_table(out_dir, "paired_aggregate", aggregated)
    save_table(out_dir, "iqm", iqms)
    verdicts = verdict.cell_verdicts(table, pairs, cells.labels, baseline, cells.objective_settings.get(CODE))
    numbers = Numbers(table, headline, collapse, pairs, aggregated, iqms, baseline, verdicts)
    notes = [*beyond_objective_blocks(cells, code=False),  # the terminal says these too
             *budget_blocks(numbers, len(cells.labels) > 1, own_steps(cells))]
    notes = [text for _, text in notes]
    (out_dir / "verdict.txt").write_text("".join(line + "\n" for line in [*verdict.lines(verdicts), *notes]))
    return numbers


def write_cells(exp: Experiment, out_dir: Path, smooth: int, formats: list[str], paper: bool, look) -> CellParts:
    """Per cell: the compute-performance fits (scaling_fit.csv), where the time went, the figures."""
    name, cells = exp.name, exp.cells
    multi = len(cells.labels) > 1
    fit_tables, fit_numbers, time_tables, cell_blocks, coincide = [], [], [], [], []
    for cell_id, cell_runs, cell_metrics in cell_subsets(exp):
        label = cells.labels[cell_id]
        fits = scaling.fit_objectives(cell_metrics, cell_runs)
        fit_tables.append(with_cell(scaling.fit_table(fits), label, multi))
        fit_numbers.append(with_cell(scaling.fit_numbers(fits), label, multi))
        time_tables.append(with_cell(timing.time_table(cell_runs, cell_metrics), label, multi))
        title = f"{name} [{cells.short(cell_id)}]" if multi else name
        made, lines, left_out = figures(cell_runs, cell_metrics, title, smooth, paper, fits, look,
                                        f"_c{cell_id + 1}" if multi else "", exp.samples)
        coincide += [f"cell `{label}`: {line}" if multi else line for line in lines]
        if multi:
            cell_blocks.append(("h3", f"Cell {cell_id + 1}: {label}"))
        if cell_metrics.empty:
            cell_blocks.append(("p", f"No run{' of this cell' if multi else ''} has logged metrics yet: the curves, "
                                     "stability and clip-fraction figures are left out."))
        cell_blocks += figure_blocks(made, out_dir, formats) + [("p", line) for line in left_out]
    fit_table = pd.concat(fit_tables, ignore_index=True) if fit_tables else pd.DataFrame()
    save_table(out_dir, "scaling_fit", pd.concat(fit_numbers, ignore_index=True) if fit_numbers else pd.DataFrame(),
               fit_table)
    times = pd.concat([t for t in time_tables if len(t)], ignore_index=True) if any(len(t) for t in time_tables) \
        else pd.DataFrame()
    return CellParts(fit_table, times, cell_blocks, coincide)


def intro_blocks(exp: Experiment, numbers: Numbers, data_warnings: list[str]) -> list[tuple]:
    """The title, the verdict, what the numbers rest on, the headline table, the cells and the starting policies."""
    runs, name, cells, headline, table = exp.runs, exp.name, exp.cells, numbers.headline, numbers.table
    multi = len(cells.labels) > 1
    unfinished = unfinished_lines(runs)
    start = start_line(table)
    blocks = [("h1", f"Report: {name}"), *verdict_blocks(numbers, multi), *beyond_objective_blocks(cells),
              *budget_blocks(numbers, multi, own_steps(cells)),
              ("p", f"Source: {sources_text(exp)}. {plural(len(runs), 'run')} listed, {int(runs['ended'].sum())} "
                    f"ended, {len(unfinished)} not finished. Every number is per objective and cell (a cell: one "
                    "combination of the settings that differ between runs of an objective; runs that differ in a "
                    "setting are never pooled) and n counts distinct seeds. Tables and the final-accuracy figures "
                    f"use the runs that {ENDED}; the curves use every logged step of every counted run."),
              ("h2", "Start and end accuracy"),
              ("p", "Greedy held-out eval accuracy of each objective's ended runs at step 0 (the starting policy, "
                    "before any update) and at the last step, per cell. Mean over seeds; interval: "
                    + ACCURACY_INTERVALS + "; where the runs lack per-problem scores (eval_samples.jsonl), over "
                    "seeds only, said so. Collapsed: runs that collapsed (see Collapse) of those that ended."),
              *([("p", start)] if start else []),
              ("table", headline), ("ul", status_lines(exp, table, data_warnings))]
    if multi:
        blocks += [("p", f"Cells ({len(cells.labels)}):"), ("ul", cell_lines(exp))]
    blocks += [("p", "Starting policy (summary.json `start_policy`):"), ("ul", start_policy_lines(runs))]
    blocks += [("p", "Code (summary.json `segments`: each start's commit, changes, packages and torch threads; a "
                     "setting like any other):"), ("ul", versions_lines(runs.to_dict("records")) or ["not known yet: "
                                                                                      "no run has started."])]
    return blocks


def beyond_objective_blocks(cells, code: bool = True) -> list[tuple]:
    """Under the verdict: the settings other than their own hyperparameters in which the objectives of a cell differ
    (a sweep's ``per_objective``, runs of several experiments in one folder), which a difference may come from.
    ``code`` False: the code version left out (the verdict's sentence says it: verdict.code_note)."""
    settings = {key: values for key, values in cells.objective_settings.items()
                if not key.startswith("objective.") and (code or key != CODE)}
    if not settings:
        return []
    return [("p", "The objectives compared differ in more than the objective: "
                  + "; ".join(f"{key} ({', '.join(f'{o}={v}' for o, v in values.items())})"
                              for key, values in settings.items())
                  + ". A difference in the verdict may come from these settings as well.")]


BUDGET_TOLERANCE = 0.1  # budget_blocks: a rollout budget per step this far (relative) from the baseline's is said


def own_steps(cells) -> bool:
    """Whether the objectives compared in a cell ran different numbers of steps (train.steps set per objective)."""
    return "train.steps" in cells.objective_settings


def budget_blocks(numbers: Numbers, multi: bool, steps_differ: bool = False) -> list[tuple]:
    """Under the verdict: the objectives whose ended runs sampled a rollout budget per step (rollout tokens over steps
    done, the mean over runs) more than ``BUDGET_TOLERANCE`` away from the baseline's in their cell (an estimator's
    extra completions, e.g. A*-PO's reference samples or ReMax's greedy ones, dynamic sampling's refills, longer
    completions): the verdict compares them at equal steps, not at equal sampling. Per step, so that a run that
    stopped early (diverged) does not read as a smaller budget."""
    table = numbers.table
    if numbers.baseline is None or table.empty or "rollout_tokens_per_step" not in table:
        return []
    parts = []
    for cell, group in table.groupby("cell", sort=False):
        tokens = group.set_index("objective")["rollout_tokens_per_step"].astype(float)
        base = tokens.get(numbers.baseline, np.nan)
        if not np.isfinite(base) or base <= 0:
            continue
        apart = [f"{o} {t / base:.2f}x" for o, t in tokens.items()
                 if o != numbers.baseline and np.isfinite(t) and abs(t / base - 1) > BUDGET_TOLERANCE]
        if apart:
            parts.append((f"cell `{cell}`: " if multi else "") + ", ".join(apart))
    if not parts:
        return []
    return [("p", f"Rollout budgets differ: these objectives sampled more or fewer rollout tokens per step than "
                  f"{numbers.baseline} (rollout tokens over steps done, mean over ended runs; more than "
                  f"{BUDGET_TOLERANCE:.0%} apart): "
                  + "; ".join(parts) + ". The verdict compares final accuracies at "
                  + ("each objective's own train.steps (above)" if steps_differ else "equal steps")
                  + "; the figure against rollout tokens (`curves_tokens`) compares the objectives at equal "
                  "sampling.")]


def verdict_blocks(numbers: Numbers, multi: bool) -> list[tuple]:
    """The verdict: one sentence per cell, then per cell the ranking against the baseline."""
    if not numbers.verdicts:
        return [("h2", "Verdict"), ("p", "No run has ended yet: no verdict.")]
    blocks = [("h2", f"Verdict (baseline: {numbers.baseline})"), ("ul", verdict.lines(numbers.verdicts)),
              ("p", f"Objectives ranked by mean final eval accuracy; − {numbers.baseline}: the paired difference to "
                    f"the baseline (by seed and eval problem) with its 95% interval; seeds above/paired: the seeds "
                    f"where the objective ended above the baseline, of those both ended. A difference counts when its "
                    f"Holm-adjusted p-value (paired t-tests; for scores alike on every problem, the level at which "
                    f"their bound reaches 0; Holm's step-down correction over the cell's comparisons to the "
                    f"baseline) is below 0.05. Intervals below {INDICATIVE_BELOW} seeds are indicative. "
                    "Baseline: `--baseline` / `sweep.baseline`, else grpo, else the grid's first objective "
                    "(analysis/verdict.py).")]
    for v in numbers.verdicts:
        blocks += ([("h3", f"Cell: {v.cell}")] if multi else []) + [("table", v.table)]
    return blocks


def figures_section(exp: Experiment, parts: CellParts, overview: list, out_dir: Path, formats: list[str]) -> list:
    """The figures: how to read them, the coinciding curves, those over the swept axes, each cell's."""
    multi, coincide = len(exp.cells.labels) > 1, parts.coincide
    blocks = [("h2", "Figures"),
              ("p", f"Line figures: the mean over seeds of each objective, told apart by colour, line style and "
                    f"marker (markers alternate between objectives, so coinciding lines stay visible); band: "
                    f"{INTERVALS}, {plots.BANDS}; n in the legend. A line is solid where all of the objective's "
                    "runs contribute and faded where fewer do (runs of different length or unfinished). Every "
                    "numeric per-step metric is drawn except bookkeeping (timings `*_s`, `*_mb`, "
                    + ", ".join(f"`{k}`" for k in sorted(plots.BOOKKEEPING - IDENTITY_COLUMNS))
                    + "); the metrics outside the accuracy and stability figures are grouped by name prefix "
                    "(`metrics_<prefix>`, single ones in `metrics_other`)."
                    + (" One set of figures per cell (stems end in `_c<cell>`), after the figures over the swept "
                       "axes." if multi else ""))]
    if coincide:
        blocks += [("p", "Objectives whose curves coincide (mean over seeds equal to 6 significant digits at every "
                         "step both logged: their lines lie on each other, told apart by line style and marker):"),
                   ("ul", coincide)]
    if overview:
        blocks += [("h3", "Over the swept axes")] + figure_blocks(overview, out_dir, formats)
    blocks += parts.blocks
    return blocks


def results_blocks(exp: Experiment, numbers: Numbers, parts: CellParts, data_warnings: list[str]) -> list[tuple]:
    """Eval accuracy, collapse, paired comparisons, the fit, where the time went, configuration, runs."""
    runs, cells, table, collapse = exp.runs, exp.cells, numbers.table, numbers.collapse
    pairs, aggregated, iqms, fit_table, times = numbers.pairs, numbers.aggregated, numbers.iqms, parts.fit_table, \
        parts.times
    multi = len(cells.labels) > 1
    config_lines, diffs = config_summary(exp)
    unfinished = unfinished_lines(runs)
    scorings = [k.removeprefix("final_") for k in accuracies(runs) if k not in ("start", "final", "best")]
    blocks = [("h2", "Eval accuracy per objective" + (" and cell" if multi else "")),
              ("p", f"Greedy held-out accuracy at the last step (final) and the best over evaluations (best), over "
                    f"the runs that {ENDED}. Mean over seeds; interval: {ACCURACY_INTERVALS}. IQM: mean of the middle "
                    f"50% of seeds (scipy.stats.trim_mean(x, 0.25)), shown with {IQM_MIN_SEEDS}+ seeds. Best: each "
                    "run's best evaluation, chosen on the eval problems its interval resamples and taken as given, so "
                    "the best's mean and interval lean upward. Wall time and rollout tokens: mean per ended run."
                    + (" The same final evaluation scored other ways: "
                       + ", ".join(f"{k} scoring (`{SCORING_PREFIX}{k}`)" for k in scorings)
                       + "; final and best use the task's default scoring (`eval_accuracy`)." if scorings else "")),
              ("table", eval_display(table, runs, cells)),
              ("h2", "Collapse"), ("p", rule_text()), ("table", collapse),
              ("h2", "Paired comparisons"),
              ("p", "Runs of two objectives with the same seed in the same cell share their first rollouts and "
                    "their eval set, so objectives are compared per cell by the differences of final eval accuracy "
                    "per seed and eval problem (A − B over the seeds both ended; interval: "
                    f"{ACCURACY_INTERVALS}), wins/ties/losses over those seeds, and the probability of improvement "
                    "P(A > B) (rliable's: Mann–Whitney U / (n_A n_B), ties 0.5; from 3 pairs a 95% percentile "
                    "bootstrap resampling seeds and eval problems, whose coverage is not measured: indicative). "
                    f"Each objective against the baseline ({numbers.baseline}) first, then the other pairs. Method: "
                    "analysis/paired.py (rliable's conventions, arXiv 2108.13264, computed with numpy/scipy)."),
              ("table", paired_display(pairs, cells)) if len(pairs) else
              ("p", "No pair of objectives has a seed both ended in the same cell: nothing to compare."),
              ("p", "Aggregated over cells (which share their starting policy, seeds and eval problems, so are not "
                    "independent): per (starting policy, seed) unit ended in every cell, its difference averaged over "
                    "the cells, the t-interval over those units (and eval problems) as in one cell; the mean over "
                    "cells of P(A > B), its bootstrap drawing the same units and eval problems in every cell (2000 "
                    "resamples); needs 3 such units."),
              ("table", aggregate_display(aggregated)) if len(aggregated) else ("p", "Nothing to aggregate."),
              ("p", "Per objective over the cells every objective ended a run in: IQM (rliable's aggregate_iqm: "
                    f"trimmed mean of all runs pooled, from {IQM_MIN_SEEDS} runs; 95% hierarchical bootstrap drawing "
                    "the same units in every cell) and the mean over cells of final eval accuracy (t-interval as the "
                    "aggregated differences), over the units ended in every one of those cells."),
              ("table", iqm_display(iqms)) if len(iqms) else ("p", "No objective has an ended run."),
              ("h2", "Compute-performance fit"),
              ("p", scaling.SUMMARY + " Per cell. Numbers only where the fit meets its conditions; otherwise the "
                    "reason. Figure `scaling` draws those fits over their points only (never beyond them)."),
              ("table", fit_table) if len(fit_table) else ("p", "No counted run yet."),
              ("h2", "Where the time went (machine-dependent)"),
              ("p", "Wall-clock times depend on the machine and on its load while the runs ran (runs in parallel, "
                    "and other processes, share its cores): a difference between objectives here is one of the "
                    "objectives only on an otherwise idle machine running one run at a time. "
                    "Mean seconds per finished run of each objective in each phase its metrics log, and the share "
                    "of its wall time (CPU clock; on a GPU the update's parts count launches, not kernels): "
                    + timing.PHASES + " " + timing.MEMORY_NOTE),
              ("table", times) if len(times) else ("p", "No finished run yet."),
              ("h2", "Configuration"), ("ul", config_lines),
              ("p", "Settings that differ between runs (besides objective and seed; an axis makes cells, a "
                    "per-objective setting is part of the objective):" if diffs else
                    "No settings differ between runs besides objective and seed."),
              *([("ul", diffs)] if diffs else []),
              ("h2", "Runs that did not finish"),
              ("ul", unfinished) if unfinished else ("p", "All runs finished.")]
    if data_warnings:
        blocks += [("h2", "Data warnings"), ("ul", data_warnings)]
    blocks += [("h2", "Runs"),
               ("p", "Last eval acc: the final eval accuracy of a finished run, the latest one of an unfinished run. "
                     "Counted: whether the run is one of its cell's seeds (a duplicate of the same objective, cell "
                     "and seed is not)."),
               ("table", runs_display(runs, cells))]

    return blocks


def figure_blocks(made: list[plots.Made], out_dir: Path, formats: list[str]) -> list[tuple]:
    """Save each drawn figure; the report blocks that show it (or say it is not drawn) with its notes."""
    blocks = []
    for figure in made:
        if figure.fig is not None:
            plots.save(figure.fig, out_dir, figure.stem, formats)
            blocks.append(("figure", figure.stem, figure.title, f"Figure `{figure.stem}`. {figure.caption}"))
        else:
            blocks.append(("p", f"{figure.title}: not drawn."))
        if figure.notes:
            blocks.append(("ul", figure.notes))
    return blocks
