"""Figures (seaborn style, headless Agg backend, deterministic files). Each figure function returns a ``Made``: the
figure (None when there is nothing to draw), its caption and notes, which go into the report's text, never into the
image. ``paper=True``: no suptitle, column widths (3.3 in single, 6.8 in double) and print-sized fonts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from analysis.cells import START_SEED  # noqa: E402
from analysis.scaling import PAPER as SCALING_PAPER  # noqa: E402
from analysis.scaling import ObjectiveFit, sigmoid  # noqa: E402
from analysis.stats import INTERVALS, curve, describe, interval_name, num, on_grid, smooth  # noqa: E402
from objectives import OBJECTIVES  # noqa: E402

PAPER_CLIP_FRAC = {"gspo": 0.15, "grpo": 0.0013}  # read off the bars of the GSPO paper's Fig. 2
PAPER = "GSPO paper (arXiv 2507.18071, Fig. 2)"
X_LABELS = {"step": "training step", "rollout_tokens": "rollout tokens"}
CURVES = {"eval_accuracy": ("Eval accuracy (greedy, held-out)", "accuracy"),
          "accuracy": ("Train accuracy (sampled)", "accuracy"),
          "reward_mean": ("Train reward", "reward (mean)")}
STABILITY = {"clip_frac": ("Clip fraction (token level)", "fraction of tokens clipped"),
             "ratio_std": ("Importance-ratio spread", "std of ratio π/π_old"),
             "ratio_max": ("Importance-ratio max", "max of ratio π/π_old"),
             "kl_ref": ("KL to reference", "KL estimate (nats/token, kl_estimator's)"),  # k1 can be < 0
             # kl_behavior (objectives/base.py): the k1 estimate of KL(π_old || π), token mean of log π_old - log π,
             # unbiased but one batch's value can be < 0; a k3 estimate logged as kl_behavior_k3 is drawn instead
             "kl_behavior_k3": ("KL to behaviour policy (k3)", "k3 KL (nats/token, >= 0)"),
             "kl_behavior": ("KL to behaviour policy (k1 estimate)", "k1 KL (nats/token, can be < 0)"),
             "entropy": ("Entropy", "entropy (nats/token)"),
             "grad_norm": ("Gradient norm", "L2 norm before clipping"),
             "completion_len_mean": ("Completion length", "length (tokens, mean)"),
             "frac_zero_std_groups": ("Zero-variance groups", "fraction of groups")}
# a Mixture-of-Experts policy's routing (harness/policy/expert_volatility.py, docs/loop.md): panels of the stability
# figure where some run reports them, no note where none does (dense policies)
ROUTING = {"expert_changed_frac": ("Expert volatility", "(token, layer, slot) assignments changed"),
           "expert_token_changed_frac": ("Tokens with a changed expert", "fraction of tokens (>= 1 layer)"),
           "expert_layer_changed_max": ("Expert volatility, most volatile layer", "fraction of its assignments"),
           "expert_load_entropy": ("Expert-load entropy", "entropy / log(experts)"),
           "router_aux_loss": ("Router load-balancing loss", "aux loss (measured, not trained on)")}
# policy lag (train.rollout_lag, harness/loop/pipeline.py, docs/async.md): panels of the stability figure where some
# run reports them, no note where none does (synchronous runs)
STALENESS = {"lag_mean": ("Policy lag", "versions behind the trainer (token mean)"),
             "mismatch_kl": ("KL(behaviour || proximal)", "k3 KL (nats/token)"),
             "mismatch_ess": ("Importance-weight ESS", "normalised ESS of π_prox/π_behav"),
             "rollout_corr_masked_frac": ("Masked by the correction", "fraction of tokens"),
             "rollout_corr_truncated_frac": ("Truncated by the correction", "fraction of tokens"),
             "m2po_dropped_frac": ("Masked by M2PO", "fraction of tokens")}
# the range a metric's mean lies in by construction: a line figure's band is drawn inside it (a t-interval over 3
# seeds of a fraction can reach below 0; its part inside the range covers the mean as often, the mean being there)
UNIT, NON_NEGATIVE = (0.0, 1.0), (0.0, np.inf)
RANGES = {**dict.fromkeys(["eval_accuracy", "accuracy", "clip_frac", "frac_zero_std_groups", "expert_changed_frac",
                           "expert_token_changed_frac", "expert_layer_changed_max", "expert_load_entropy",
                           "mismatch_ess", "rollout_corr_masked_frac", "rollout_corr_truncated_frac",
                           "m2po_dropped_frac", "ess_token_frac", "frac_tokens_with_grad"], UNIT),
          **dict.fromkeys(["cos_reference", "cos_fresh"], (-1.0, 1.0)),
          **dict.fromkeys(["ratio_std", "ratio_max", "kl_behavior_k3", "entropy", "grad_norm",
                           "completion_len_mean", "lag_mean", "mismatch_kl", "router_aux_loss"], NON_NEGATIVE)}
BANDS = ("drawn inside the metric's range where it has one (a fraction in [0, 1], a cosine in [-1, 1], a "
         "non-negative quantity from 0: "
         + ", ".join(f"`{m}`" for m in RANGES) + ")")
# per-step keys that are bookkeeping, not measurements of the policy or the objective (also: *_s, *_mb)
BOOKKEEPING = frozenset({"run_id", "objective", "seed", START_SEED, "cell", "cell_id", "counted", "step", "lr",
                         "rollout_tokens", "update_tokens", "sampled_tokens", "nonfinite_skips"})
IDENTITY = frozenset({"run_id", "objective", "seed", START_SEED, "cell", "cell_id", "counted", "step"})
ROUND_OFF = 1e-6  # a metric whose values all lie within this (relative, or absolute below 1) is constant
SAVE_METADATA = {"png": {}, "pdf": {"CreationDate": None}, "svg": {"Date": None}}  # no timestamps
SINGLE, DOUBLE = 3.3, 6.8  # paper column widths (inches)
PAPER_RC = {"font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "xtick.labelsize": 7, "ytick.labelsize": 7,
            "legend.fontsize": 7, "lines.linewidth": 1.2, "lines.markersize": 3.5, "pdf.fonttype": 42}
# Okabe-Ito, colour-blind safe, without its yellow (too pale on white); neighbours in sorted order contrast
COLORS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000"]
LINESTYLES = ["-", (0, (5, 2)), (0, (1, 1.2)), (0, (6, 2, 1, 2)), (0, (3, 1, 1, 1, 1, 1))]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]

sns.set_theme(style="whitegrid", context="paper")
plt.rcParams["svg.hashsalt"] = "analysis"


@dataclass(frozen=True)
class Style:
    color: str
    linestyle: object
    marker: str
    index: int


@dataclass
class Made:
    stem: str
    title: str
    fig: object | None  # None: not drawn (the notes say why)
    caption: str = ""
    notes: list[str] = field(default_factory=list)


def context(paper: bool):
    """matplotlib settings to draw and save in: print-sized fonts in paper mode."""
    return plt.rc_context(PAPER_RC if paper else {})


def styles(objectives) -> dict[str, Style]:
    """Colour, line style and marker per objective, fixed by its place in the registry (objectives.OBJECTIVES), so
    that an objective looks the same in every report; names the registry does not hold follow it, sorted. Markers
    differ between neighbours, so that coinciding curves stay visible."""
    names = OBJECTIVES.names()
    places = {o: names.index(o) if o in names else len(names) + i
              for i, o in enumerate(sorted(set(objectives) - set(names)))} | {o: names.index(o) for o in
                                                                             set(objectives) & set(names)}
    return {o: Style(COLORS[i % len(COLORS)], LINESTYLES[i % len(LINESTYLES)], MARKERS[i % len(MARKERS)], i)
            for o, i in sorted(places.items(), key=lambda item: item[1])}


def reported(metrics: pd.DataFrame, column: str) -> bool:
    return column in metrics and metrics[column].notna().any()


def bookkeeping(column: str) -> bool:
    return column in BOOKKEEPING or column.endswith(("_s", "_mb"))


def lacking(metrics: pd.DataFrame, column: str) -> list[str]:
    """Objectives of which no run reports `column`, among those that logged a training step (or any row for
    eval metrics: step 0 is an evaluation only)."""
    rows = metrics if column.startswith("eval") else metrics[metrics["step"] >= 1]
    has = rows.groupby("objective")[column].apply(lambda s: s.notna().any())
    return sorted(has.index[~has])


def lacking_notes(metrics: pd.DataFrame, columns: list[str]) -> list[str]:
    return [f"`{m}` is not reported by: {', '.join(lacking(metrics, m))}." for m in columns if lacking(metrics, m)]


def same_values(metrics: pd.DataFrame, a: str, b: str) -> bool:
    """Columns a and b are logged on the same rows with equal values (e.g. the reward is the correctness)."""
    x, y = metrics[a], metrics[b]
    return bool((x.isna() == y.isna()).all() and np.allclose(x.dropna(), y.dropna(), rtol=1e-9, atol=0))


def round_off(metrics: pd.DataFrame) -> dict[str, tuple[float, float]]:
    """The per-step metrics (not bookkeeping) constant to round-off: every logged value of every run within
    ROUND_OFF x max(1, largest |value|) of every other (e.g. the mean of normalised advantages, a KL between two
    evaluations of the same weights): column -> (smallest, largest value)."""
    out = {}
    for column in sorted(metrics.columns):
        if column in IDENTITY or bookkeeping(column) or not reported(metrics, column):
            continue
        values = metrics[column].dropna().to_numpy(dtype=float)
        low, high = float(values.min()), float(values.max())
        if np.isfinite([low, high]).all() and high - low <= ROUND_OFF * max(1.0, abs(low), abs(high)):
            out[column] = (low, high)
    return out


def own_scale(column: str) -> bool:
    """A quantity whose scale differs between objectives by construction (each objective's loss), never drawn on one
    axis across objectives."""
    return (column == "loss" or column.endswith("_loss")) and column not in ROUTING


def families(metrics: pd.DataFrame, drawn: set[str]) -> dict[str, list[str]]:
    """Every reported per-step metric not in `drawn` and not bookkeeping, grouped by name prefix (the part before
    the first underscore: clip_frac_low -> clip); prefixes with a single metric are gathered under "other"."""
    groups = {}
    for column in sorted(metrics.columns):
        if column not in drawn and not bookkeeping(column) and reported(metrics, column):
            groups.setdefault(column.split("_")[0], []).append(column)
    out = {prefix: columns for prefix, columns in groups.items() if len(columns) > 1}
    other = [c for columns in groups.values() if len(columns) == 1 for c in columns]
    return out | ({"other": other} if other else {})


def seeds_label(objective: str, n: int, policies: int = 1) -> str:
    return f"{objective} (n={n}, {interval_name(n, policies)})"


def width_of(ncols: int, paper: bool, single: bool) -> float:
    return (SINGLE if single else DOUBLE) if paper else (5.2 if single else 4.2 * ncols)


def grid(n: int, paper: bool, title: str, single: bool = False, legend_rows: int = 1):
    """A constrained-layout figure of n panels (at most 3 a row), with the suptitle except in paper mode."""
    ncols = 1 if single else min(3, n)
    nrows = -(-n // ncols)
    width = width_of(ncols, paper, single)
    if paper:
        height = nrows * (2.4 if single else 0.75 * width / ncols) + 0.2 * legend_rows
    else:
        height = nrows * 3.0 + 0.25 * legend_rows + 0.3
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False, layout="constrained")
    for ax in axes.flat[n:]:
        ax.remove()
    if not paper:
        fig.suptitle(title)
    return fig, list(axes.flat[:n])


def legend_columns(labels, width: float, paper: bool) -> int:
    """As many legend entries a row as fit the figure's width."""
    longest = max(len(label) for label in labels) * (0.055 if paper else 0.075) + 0.5  # inches per entry
    return max(1, min(len(labels), int(width // longest)))


def objective_legend(fig, look: dict[str, Style], labels: dict[str, str], columns: int) -> None:
    """One legend for the whole figure, below the panels."""
    handles = [Line2D([], [], color=s.color, linestyle=s.linestyle, marker=s.marker, label=labels[o])
               for o, s in look.items() if o in labels]
    fig.legend(handles=handles, loc="outside lower center", ncols=columns, frameon=False)


def in_range(metric: str, low, high) -> tuple:
    """The interval (low, high) as drawn: inside ``metric``'s range (RANGES; the whole interval without one)."""
    bottom, top = RANGES.get(metric, (-np.inf, np.inf))
    return np.clip(low, bottom, top), np.clip(high, bottom, top)


def line_panel(ax, metrics: pd.DataFrame, x: str, y: str, look: dict[str, Style]) -> None:
    """Mean over runs per objective with its interval band (inside the metric's range, RANGES): solid where all of
    the objective's runs contribute, faded where fewer do (runs of different length). Rollout tokens differ per run,
    so runs are first interpolated onto a shared token grid. On lines of 6+ points, markers are spaced (every 2nd
    point or sparser, about 8 a line) and offset per objective, so that the markers of coinciding lines alternate."""
    data = on_grid(metrics, x, y) if x == "rollout_tokens" else metrics
    for objective, c in curve(data, x, y).groupby("objective"):
        s = look[objective]
        every = max(2, len(c) // 8) if len(c) >= 6 else 1
        kw = {"color": s.color, "linestyle": s.linestyle, "marker": s.marker, "markevery": (s.index % every, every)}
        full = c["n"] == c["n"].max()
        ax.plot(c[x], c["mean"], alpha=0.35, **kw)
        ax.plot(c[x].where(full), c["mean"].where(full), **kw)
        ax.fill_between(c[x], *in_range(y, c["ci_low"], c["ci_high"]), color=s.color, alpha=0.15, linewidth=0)
    if x == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def axis_note(x: str, window: int) -> str:
    """The caption of a line figure (the lines and bands are described once, above the figures)."""
    note = ("x: cumulative sampled completion tokens; each run is linearly interpolated onto a common rollout-token "
            "grid before averaging." if x == "rollout_tokens" else "x: training step (one rollout batch per step).")
    if window > 1:
        note += f" Train metrics smoothed: trailing rolling mean over {window} steps (eval metrics not smoothed)."
    return note


def lines_figure(metrics: pd.DataFrame, x: str, columns: list[str], look: dict[str, Style], window: int,
                 titles: dict[str, tuple[str, str]], title: str, paper: bool):
    """One panel per column (line_panel), one legend."""
    n = metrics.groupby("objective")["run_id"].nunique()
    policies = metrics.groupby("objective")[START_SEED].nunique() if START_SEED in metrics else {}
    labels = {o: seeds_label(o, k, policies.get(o, 1)) for o, k in n.items()}
    per_row = legend_columns(labels.values(), width_of(min(3, len(columns)), paper, False), paper)
    fig, axes = grid(len(columns), paper, title, legend_rows=-(-len(labels) // per_row))
    for ax, m in zip(axes, columns, strict=True):
        data = metrics if m.startswith("eval") else smooth(metrics, [m], window)
        line_panel(ax, data, x, m, look)
        panel_title, ylabel = titles.get(m, (m, ""))
        ax.set(title=panel_title, xlabel=X_LABELS[x], ylabel=ylabel)
    objective_legend(fig, look, labels, per_row)
    return fig


def curves_figure(metrics: pd.DataFrame, x: str, look: dict[str, Style], window: int, title: str, paper: bool):
    stem = "curves_step" if x == "step" else "curves_tokens"
    present = [m for m in CURVES if reported(metrics, m)]
    notes = [f"`{m}` is reported by no run: panel left out." for m in CURVES if m not in present]
    if {"accuracy", "reward_mean"} <= set(present) and same_values(metrics, "accuracy", "reward_mean"):
        present.remove("reward_mean")
        notes.append("Train reward equals train accuracy at every logged step of every run (the reward is the "
                     "correctness): one panel, train accuracy, is drawn for both.")
    notes += lacking_notes(metrics, present)
    if not reported(metrics, x) or not present:
        return Made(stem, title, None, notes=notes + [f"no run reports `{x}` together with accuracy or reward: "
                                                      "figure left out."])
    fig = lines_figure(metrics, x, present, look, window, CURVES, title, paper)
    return Made(stem, title, fig, axis_note(x, window), notes)


def stability_figure(metrics: pd.DataFrame, look: dict[str, Style], window: int, title: str, paper: bool,
                     flat: frozenset = frozenset()):
    """The stability diagnostics that some run reports, one panel each; `flat`: metrics constant to round-off, left
    out (the report names them)."""
    present = [m for m in STABILITY if reported(metrics, m) and m not in flat]
    notes = [f"`{m}` is reported by no run: panel left out." for m in STABILITY if m not in present
             and m != "kl_behavior_k3" and m not in flat]
    if "kl_behavior_k3" in present and "kl_behavior" in present:
        present.remove("kl_behavior")
        notes.append("KL to behaviour: the k3 estimate (`kl_behavior_k3`, never negative) is drawn; the k1 estimate "
                     "`kl_behavior` is not.")
    elif "kl_behavior" in present:
        notes.append("KL to behaviour: `kl_behavior` is the k1 estimate (token mean of log π_old − log π over the "
                     "sampled tokens): unbiased, but a single batch's value can be negative; a k3 estimate is not "
                     "logged by these runs.")
    present += [m for m in {**ROUTING, **STALENESS} if reported(metrics, m) and m not in flat]
    notes += lacking_notes(metrics, present)
    fig = lines_figure(metrics, "step", present, look, window, {**STABILITY, **ROUTING, **STALENESS}, title, paper) \
        if present else None
    return Made("stability", title, fig, axis_note("step", window), notes)


def family_figure(metrics: pd.DataFrame, family: str, columns: list[str], look: dict[str, Style], window: int,
                  title: str, paper: bool):
    """The metrics of one name prefix (the objectives' own among them), one panel each, titled by key."""
    fig = lines_figure(metrics, "step", columns, look, window, {}, title, paper)
    return Made(f"metrics_{family}", title, fig, axis_note("step", window), lacking_notes(metrics, columns))


def own_scale_figure(metrics: pd.DataFrame, columns: list[str], look: dict[str, Style], window: int, title: str,
                     paper: bool):
    """Each objective's loss-like metrics on axes of their own (own_scale): one panel per (metric, objective)."""
    objectives = [o for o in look if o in set(metrics["objective"])]
    panels = [(m, o) for m in columns for o in objectives if metrics.loc[metrics["objective"] == o, m].notna().any()]
    fig, axes = grid(len(panels), paper, title)
    for ax, (m, o) in zip(axes, panels, strict=True):
        line_panel(ax, smooth(metrics[metrics["objective"] == o], [m], window), "step", m, {o: look[o]})
        ax.set(title=f"{m}: {o}", xlabel=X_LABELS["step"], ylabel=f"{m} ({o}'s own scale)")
    caption = (axis_note("step", window) + " One panel per objective and metric, each on its own y axis: the "
               "objectives' losses differ in scale by construction (their surrogates, ratios and normalisations), so "
               "their values are not compared across objectives. Colour: the objective, as in the other figures.")
    return Made("metrics_loss", title, fig, caption)


def clip_note(objective: str, values: pd.Series, d: dict) -> str:
    text = f"{objective}: measured {num(d['mean'])}"
    if d["n"] > 1:
        text += f" ({interval_name(d['n'], d['policies'])} [{num(d['ci_low'])}, {num(d['ci_high'])}], n={d['n']})"
    else:
        text += " (n=1)"
    zero = int((values <= 0).sum())
    if zero:
        text += (f"; clip fraction 0 (no token clipped at any logged step) in {zero} of {d['n']} runs: "
                 + ("not drawn" if zero == d["n"] else "those runs are not drawn") + " on the log axis")
        if 0 < zero < d["n"] and d["ci_low"] <= 0:
            text += ", and the interval's lower end (0) is left out"
    if objective in PAPER_CLIP_FRAC:
        text += f"; paper {PAPER_CLIP_FRAC[objective]:g}"
    return text + "."


def clip_figure(metrics: pd.DataFrame, runs: pd.DataFrame, look: dict[str, Style], title: str, paper: bool):
    """Per objective: each run's mean clip fraction (small points), their mean with its interval (large filled
    circle), the paper's value (open diamond); log axis, zeros stated in the notes instead of drawn."""
    if not reported(metrics, "clip_frac"):
        return Made("clip_fraction", title, None,
                    notes=["`clip_frac` is reported by no run: clip-fraction comparison left out."])
    per_run = metrics.dropna(subset=["clip_frac"]).groupby(["objective", "run_id"])["clip_frac"].mean()
    policy = runs.set_index("run_id")[START_SEED] if START_SEED in runs else None
    objectives = sorted(set(per_run.index.get_level_values(0)) | set(PAPER_CLIP_FRAC))
    unfinished = set(runs.loc[~runs["complete"], "run_id"])
    fig, (ax,) = grid(1, paper, title, single=True)
    notes, labels = [], []
    size = plt.rcParams["lines.markersize"]
    for i, objective in enumerate(objectives):
        color = look[objective].color if objective in look else "0.3"
        values = per_run[objective] if objective in per_run.index else pd.Series(dtype=float)
        d = describe(values, None if policy is None else policy.reindex(values.index))
        labels.append(f"{objective}\n(n={d['n']})" if d["n"] else f"{objective}\n(not run)")
        if d["n"]:
            shown = values[values > 0]
            ax.plot(np.full(len(shown), i - 0.15), shown, marker="o", markersize=0.7 * size, color=color, alpha=0.5,
                    linestyle="none", markeredgewidth=0, zorder=2)
            if d["mean"] > 0:
                below = d["mean"] - d["ci_low"] if d["ci_low"] > 0 else 0.0
                yerr = [[below], [d["ci_high"] - d["mean"]]] if d["n"] > 1 else None
                ax.errorbar(i - 0.15, d["mean"], yerr=yerr, fmt="o", color=color, markersize=1.4 * size, capsize=3,
                            zorder=3)
            notes.append(clip_note(objective, values, d))
            partial = unfinished & set(values.index)
            if partial:
                notes.append(f"{objective}: {len(partial)} of the {d['n']} runs are unfinished (mean over their "
                             "logged steps).")
        elif objective in PAPER_CLIP_FRAC:
            notes.append(f"{objective}: not run here; paper {PAPER_CLIP_FRAC[objective]:g}.")
        if objective in PAPER_CLIP_FRAC:
            ax.plot(i + 0.15, PAPER_CLIP_FRAC[objective], marker="D", markersize=1.3 * size, markerfacecolor="white",
                    markeredgecolor=color, markeredgewidth=1.5, linestyle="none", zorder=3)
    ax.set_yscale("log")
    ax.margins(y=0.12)
    ax.set_xticks(range(len(objectives)), labels)
    ax.set_xlim(-0.6, len(objectives) - 0.4)
    ax.set(ylabel="fraction of tokens clipped (log)")
    neutral = {"linestyle": "none", "color": "0.3"}
    fig.legend(handles=[Line2D([], [], marker="o", markersize=1.4 * size, label="this run (measured)", **neutral),
                        Line2D([], [], marker="o", markersize=0.7 * size, alpha=0.5, label="one seed (measured)",
                               **neutral),
                        Line2D([], [], marker="D", markersize=1.3 * size, markerfacecolor="white",
                               markeredgewidth=1.5, label="paper (reported)", **neutral)],
               loc="outside lower center", ncols=2 if paper else 3, frameon=False, handletextpad=0.3,
               columnspacing=1.0)
    caption = (f"This run (measured): filled circles; per run (small points), the mean over logged steps of the "
               f"token-level clip fraction; large circle and bar = mean over seeds with its interval ({INTERVALS}). "
               f"Paper (reported): open diamonds, values read off the {PAPER} (different model, task and scale): "
               "compare orders of magnitude, not exact values. Colour: the objective, as in the other figures.")
    return Made("clip_fraction", title, fig, caption, notes)


def final_figure(runs: pd.DataFrame, look: dict[str, Style], title: str, paper: bool, estimates: dict | None = None):
    """Each seed's final accuracy (points) and per objective (registry order) the mean with its interval: the
    report's (``estimates``: objective -> analysis.accuracy.Estimate, over seeds and eval problems), else
    describe's over seeds; the start as a dashed line."""
    done = runs[runs["ended" if "ended" in runs else "complete"] & runs["final_eval_accuracy"].notna()]
    if done.empty:
        return Made("final_eval", title, None,
                    notes=["no finished run with a final eval accuracy yet: figure left out."])
    order = [o for o in look if o in set(done["objective"])]
    fig, (ax,) = grid(1, paper, title, single=True)
    sns.swarmplot(data=done, x="objective", y="final_eval_accuracy", order=order, hue="objective",
                  palette={o: look[o].color for o in order}, size=4 if paper else 6, legend=False, ax=ax)
    labels = []
    for i, objective in enumerate(order):
        mine = done[done["objective"] == objective]
        d = describe(mine["final_eval_accuracy"], mine[START_SEED] if START_SEED in mine else None)
        e = (estimates or {}).get(objective)
        mean, low, high, name = (e.mean, e.low, e.high, "95% CI") if e is not None and e.problems else \
            (d["mean"], d["ci_low"], d["ci_high"], interval_name(d["n"], d["policies"]))
        labels.append(f"{objective}\n(n={d['n']}, {name})")
        low, high = in_range("eval_accuracy", low, high)
        yerr = [[mean - low], [high - mean]] if np.isfinite(low) else None
        ax.errorbar(i + 0.25, mean, yerr=yerr, fmt="D", color=look[objective].color, markerfacecolor="white",
                    markersize=5, capsize=3)
    ax.set_xticks(range(len(order)), labels)
    ax.set(xlabel="", ylabel="final eval accuracy")
    handles = [Line2D([], [], marker="o", linestyle="none", color="0.3", label="one seed"),
               Line2D([], [], marker="D", color="0.3", markerfacecolor="white", label="mean ± interval")]
    start = done["start_eval_accuracy"].mean() if "start_eval_accuracy" in done else np.nan
    if np.isfinite(start):
        ax.axhline(start, color="0.4", linestyle="--", linewidth=1, zorder=1)
        handles.append(Line2D([], [], color="0.4", linestyle="--", label=f"start (step 0): {num(start)}"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False)
    caption = ("Points: each seed's final greedy held-out accuracy (runs that ended: finished, or diverged with their "
               "last eval), coloured by objective. Open diamond: mean over seeds; bar: the interval of the tables "
               f"(over seeds and eval problems; where the runs lack per-problem scores, {INTERVALS}), drawn inside "
               "[0, 1]. Dashed: the "
               "mean step-0 accuracy of these runs (the start), so the axis shows the gain.")
    return Made("final_eval", title, fig, caption)


def scaling_figure(fits: list[ObjectiveFit], look: dict[str, Style], title: str, paper: bool):
    """Per objective whose fit meets its conditions (analysis/scaling.py): its mean eval accuracy at each eval point
    after step 0 against mean rollout tokens (marker; bar: the interval over seeds) and the fitted sigmoid over the
    points only (line); the start (R0) as a dotted line; log x. Every objective not drawn is named with its reason;
    none drawn: no figure, one line."""
    shown = [f for f in fits if f.fit.converged]
    left = [f"{f.objective}: {f.fit.reason}" for f in fits if not f.fit.converged]
    if not shown:
        return Made("scaling", title, None, notes=["No objective's compute-performance fit meets its conditions, so "
                                                   "no curve is drawn (" + "; ".join(left) + ")."])
    fig, (ax,) = grid(1, paper, title, single=True)
    for f in shown:
        s = look[f.objective]
        d = pd.DataFrame([describe(points) for points in f.per_seed.T])
        low, high = in_range("eval_accuracy", d["ci_low"], d["ci_high"])
        yerr = [d["mean"] - low, high - d["mean"]] if f.seeds > 1 else None
        ax.errorbar(f.tokens, d["mean"], yerr=yerr, fmt=s.marker, color=s.color, capsize=2, zorder=3)
        c = np.geomspace(f.tokens.min(), f.tokens.max(), 100)
        ax.plot(c, sigmoid(c, f.fit.r0, f.fit.a, f.fit.b, f.fit.c_mid), color=s.color, linestyle=s.linestyle)
        ax.axhline(f.fit.r0, color=s.color, linestyle=":", linewidth=0.8)
    ax.set_xscale("log")
    ax.set(xlabel=X_LABELS["rollout_tokens"] + " (log)", ylabel="eval accuracy")
    labels = {f.objective: f"{f.objective} (n={f.seeds})" for f in shown}
    objective_legend(fig, look, labels, legend_columns(labels.values(), width_of(1, paper, True), paper))
    caption = (f"Compute-performance fit ({SCALING_PAPER}): R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), C = rollout "
               "tokens, for the objectives whose fit meets its conditions (the table in Compute-performance fit, "
               "below, gives A, B, C_mid and every other objective's reason). Markers: mean greedy eval accuracy over "
               f"finished seeds at each eval point after step 0, at the seeds' mean rollout tokens; bar: {INTERVALS}. "
               "Line: the fit, over the points only; dotted: the start R0 (step-0 accuracy).")
    return Made("scaling", title, fig, caption, [f"Not drawn: {line}." for line in left])


def save(fig, out_dir: Path, stem: str, formats: list[str]) -> list[Path]:
    """At the figure's own size (no tight bounding box: paper widths stay exact). The constrained layout is computed
    once, by the first format's save, and kept for the others (each save would redo it, for a shift of the panels as
    small as the renderers' differences in text metrics); the figure then has no layout engine, not even the
    placeholder of ``"none"``, for which matplotlib would draw it once more before each print, to lay out nothing."""
    paths = []
    for fmt in formats:
        paths.append(out_dir / f"{stem}.{fmt}")
        fig.savefig(paths[-1], dpi=200, metadata=SAVE_METADATA[fmt])
        with plt.rc_context({"figure.autolayout": False, "figure.constrained_layout.use": False}):
            fig.set_layout_engine(None)  # None: whatever layout those rc settings would ask for, none
    plt.close(fig)
    return paths
