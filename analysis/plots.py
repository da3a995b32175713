"""Figures (seaborn style, headless Agg backend, deterministic files). Each figure function returns
``(figure or None, notes)``: the notes say what was left out and why, and go under the figure in the report."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from analysis.stats import CI_METHOD, curve, describe, on_grid, smooth  # noqa: E402

PAPER_CLIP_FRAC = {"gspo": 0.15, "grpo": 0.0013}  # read off the bars of the GSPO paper's Fig. 2
PAPER = "GSPO paper (arXiv 2507.18071, Fig. 2)"
X_LABELS = {"step": "training step (one rollout batch per step)",
            "rollout_tokens": "rollout tokens (cumulative sampled completion tokens)"}
CURVES = {"eval_accuracy": ("Eval accuracy (greedy, held-out)", "accuracy (fraction correct)"),
          "accuracy": ("Train accuracy (sampled completions)", "accuracy (fraction correct)"),
          "reward_mean": ("Train reward", "reward (mean per completion)")}
STABILITY = {"clip_frac": ("Clip fraction (token level)", "fraction of tokens clipped"),
             "ratio_std": ("Importance-ratio spread", "std of ratio π/π_old"),
             "ratio_max": ("Importance-ratio max", "max of ratio π/π_old"),
             "kl_ref": ("KL to reference", "k3 KL (nats/token)"),
             "kl_behavior": ("KL to behaviour policy", "KL (nats/token)"),
             "entropy": ("Entropy", "entropy (nats/token)"),
             "grad_norm": ("Gradient norm", "L2 norm before clipping"),
             "completion_len_mean": ("Completion length", "length (tokens, mean)"),
             "frac_zero_std_groups": ("Zero-variance groups", "fraction of groups")}
SAVE_METADATA = {"png": {}, "pdf": {"CreationDate": None}, "svg": {"Date": None}}  # no timestamps

sns.set_theme(style="whitegrid", context="paper")
plt.rcParams["svg.hashsalt"] = "analysis"


def palette(objectives) -> dict:
    objectives = sorted(set(objectives))
    return dict(zip(objectives, sns.color_palette("colorblind", len(objectives)), strict=True))


def reported(metrics: pd.DataFrame, column: str) -> bool:
    return column in metrics and metrics[column].notna().any()


def lacking(metrics: pd.DataFrame, column: str) -> list[str]:
    """Objectives of which no run reports `column`, among those that logged a training step (or any row for
    eval metrics: step 0 is an evaluation only)."""
    rows = metrics if column.startswith("eval") else metrics[metrics["step"] >= 1]
    has = rows.groupby("objective")[column].apply(lambda s: s.notna().any())
    return sorted(has.index[~has])


def seeds_label(objective: str, n) -> str:
    lo, hi = int(np.min(n)), int(np.max(n))
    if hi == 1:
        return f"{objective} (n=1, no CI)"
    return f"{objective} (n={hi})" if lo == hi else f"{objective} (n={lo}–{hi})"


def caption(fig, text: str) -> None:
    width = int(fig.get_figwidth() * 16)
    fig.text(0.01, 0.0, textwrap.fill(text, width), ha="left", va="top", fontsize=7)


def line_panel(ax, metrics: pd.DataFrame, x: str, y: str, colors: dict, markers: bool) -> None:
    """Mean over runs per objective with its CI band: solid where all of the objective's runs contribute, faded
    where fewer do (runs of different length). Rollout tokens differ per run, so runs are first interpolated onto
    a shared token grid."""
    data = on_grid(metrics, x, y) if x == "rollout_tokens" else metrics
    marker = "o" if markers else None
    for objective, c in curve(data, x, y).groupby("objective"):
        full = c["n"] == c["n"].max()
        ax.plot(c[x], c["mean"], color=colors[objective], alpha=0.35, linewidth=1, marker=marker, markersize=2)
        ax.plot(c[x].where(full), c["mean"].where(full), color=colors[objective], marker=marker, markersize=3,
                label=seeds_label(objective, c["n"]))
        ax.fill_between(c[x], c["ci_low"], c["ci_high"], color=colors[objective], alpha=0.2, linewidth=0)
    ax.legend(fontsize=6)


def band_note(x: str, window: int) -> str:
    note = (f"Line: mean over seeds; band: {CI_METHOD}. n = seeds contributing; the line is solid where all n "
            "contribute and faded where fewer do (runs of different length or unfinished).")
    if x == "rollout_tokens":
        note += " Each run is linearly interpolated onto a common rollout-token grid before averaging."
    if window > 1:
        note += f" Train metrics smoothed: trailing rolling mean over {window} steps (eval accuracy not smoothed)."
    return note


def curves_figure(metrics: pd.DataFrame, x: str, colors: dict, window: int, title: str):
    present = [m for m in CURVES if reported(metrics, m)]
    notes = [f"`{m}` is reported by no run: panel left out." for m in CURVES if m not in present]
    notes += [f"`{m}` is not reported by: {', '.join(lacking(metrics, m))}." for m in present if lacking(metrics, m)]
    if not reported(metrics, x) or not present:
        return None, notes + [f"no run reports `{x}` together with accuracy or reward: figure left out."]
    fig, axes = plt.subplots(1, len(present), figsize=(4.3 * len(present), 3.4), squeeze=False)
    for ax, m in zip(axes[0], present, strict=True):
        data = metrics if m == "eval_accuracy" else smooth(metrics, [m], window)
        line_panel(ax, data, x, m, colors, markers=m == "eval_accuracy" and x == "step")
        ax.set(title=CURVES[m][0], xlabel=X_LABELS[x], ylabel=CURVES[m][1])
    fig.suptitle(title)
    fig.tight_layout()
    caption(fig, band_note(x, window))
    return fig, notes


def stability_figure(metrics: pd.DataFrame, colors: dict, window: int, title: str):
    present = [m for m in STABILITY if reported(metrics, m)]
    notes = [f"`{m}` is reported by no run: panel left out." for m in STABILITY if m not in present]
    notes += [f"`{m}` is not reported by: {', '.join(lacking(metrics, m))}." for m in present if lacking(metrics, m)]
    if not present:
        return None, notes
    ncols = min(3, len(present))
    nrows = -(-len(present) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False)
    data = smooth(metrics, present, window)
    for ax, m in zip(axes.flat, present, strict=False):  # extra axes removed below
        line_panel(ax, data, "step", m, colors, markers=False)
        ax.set(title=STABILITY[m][0], xlabel=X_LABELS["step"], ylabel=STABILITY[m][1])
    for ax in axes.flat[len(present):]:
        ax.remove()
    fig.suptitle(title)
    fig.tight_layout()
    caption(fig, band_note("step", window) + (" " + " ".join(notes) if notes else ""))
    return fig, notes


def clip_figure(metrics: pd.DataFrame, runs: pd.DataFrame, colors: dict, title: str):
    if not reported(metrics, "clip_frac"):
        return None, ["`clip_frac` is reported by no run: clip-fraction comparison left out."]
    per_run = metrics.dropna(subset=["clip_frac"]).groupby(["objective", "run_id"])["clip_frac"].mean()
    objectives = sorted(set(per_run.index.get_level_values(0)) | set(PAPER_CLIP_FRAC))
    unfinished = set(runs.loc[~runs["complete"], "run_id"])
    notes, labels = [], []
    fig, ax = plt.subplots(figsize=(1.6 * len(objectives) + 2.5, 3.8))
    for i, objective in enumerate(objectives):
        values = per_run[objective] if objective in per_run.index else pd.Series(dtype=float)
        d = describe(values)
        label = f"{objective} (n={d['n']})\nmeasured {d['mean']:.2g}" if d["n"] else f"{objective}\nnot run here"
        if d["n"]:
            ax.bar(i - 0.2, d["mean"], width=0.38, color=colors[objective], alpha=0.8, label="this run (measured)")
            if d["n"] > 1:
                ax.errorbar(i - 0.2, d["mean"], yerr=[[d["mean"] - d["ci_low"]], [d["ci_high"] - d["mean"]]],
                            color="black", capsize=4)
            ax.scatter(i - 0.2 + np.linspace(-0.1, 0.1, d["n"]) * (d["n"] > 1), values, color="black", s=12, zorder=3)
            if (values <= 0).any():
                notes.append(f"{objective}: a run with clip fraction 0 cannot be drawn on the log axis.")
            partial = unfinished & set(values.index)
            if partial:
                notes.append(f"{objective}: {len(partial)} of the {d['n']} runs are unfinished (mean over their "
                             "logged steps).")
        if objective in PAPER_CLIP_FRAC:
            ax.bar(i + 0.2, PAPER_CLIP_FRAC[objective], width=0.38, color="white", edgecolor="black", hatch="//",
                   label="paper (reported)")
            label += f"\npaper {PAPER_CLIP_FRAC[objective]:g}"
        labels.append(label)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(objectives)), labels)
    ax.set(ylabel="fraction of tokens clipped (log scale)", title=title)
    fig.tight_layout()
    caption(fig, f"This run (measured): per run, the mean over logged steps of the token-level clip fraction; "
                 f"bar = mean over seeds, error bar = {CI_METHOD}, points = seeds. Paper (reported): values read off "
                 f"the {PAPER} (different model, task and scale): compare orders of magnitude, not exact values."
                 + (" " + " ".join(notes) if notes else ""))
    return fig, notes


def final_figure(runs: pd.DataFrame, colors: dict, title: str):
    done = runs[runs["complete"] & runs["final_eval_accuracy"].notna()]
    if done.empty:
        return None, ["no finished run with a final eval accuracy yet: figure left out."]
    order = sorted(done["objective"].unique())
    fig, ax = plt.subplots(figsize=(1.4 * len(order) + 2.5, 3.6))
    sns.swarmplot(data=done, x="objective", y="final_eval_accuracy", order=order, hue="objective", palette=colors,
                  size=6, legend=False, ax=ax)
    labels = []
    for i, objective in enumerate(order):
        d = describe(done.loc[done["objective"] == objective, "final_eval_accuracy"])
        labels.append(f"{objective}\n(n={d['n']}{', no CI' if d['n'] == 1 else ''})")
        yerr = [[d["mean"] - d["ci_low"]], [d["ci_high"] - d["mean"]]] if d["n"] > 1 else None
        ax.errorbar(i + 0.3, d["mean"], yerr=yerr, fmt="D", color="black", capsize=4,
                    label="mean ± 95% CI" if i == 0 else None)
    ax.set_xticks(range(len(order)), labels)
    ax.set(xlabel="", ylabel="final eval accuracy (fraction correct)", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    caption(fig, f"Points: each seed's final greedy held-out accuracy (finished runs only). Diamond: mean over "
                 f"seeds; error bar: {CI_METHOD} (none with 1 seed).")
    return fig, []


def save(fig, out_dir: Path, stem: str, formats: list[str]) -> list[Path]:
    paths = []
    for fmt in formats:
        paths.append(out_dir / f"{stem}.{fmt}")
        fig.savefig(paths[-1], dpi=150, bbox_inches="tight", metadata=SAVE_METADATA[fmt])
    plt.close(fig)
    return paths
