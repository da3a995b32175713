"""Figures over the swept axes (analysis/cells.py): final and best eval accuracy and the collapse rate against each
axis, one line per objective, and heat maps of final accuracy (and collapse rate) over each pair of axes, one panel
per objective. Every point is one (objective, cell): its mean over seeds with its interval; the other axes are never
pooled: each combination of their values gets its own row of panels."""

from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.cells import Cells, canon, order, short_names, show
from analysis.plots import Made, Style, grid, in_range, legend_columns, objective_legend, width_of
from analysis.stats import INTERVALS

PANELS = {"final": ("Final eval accuracy", "accuracy"), "best": ("Best eval accuracy", "accuracy"),
          "collapse": ("Collapse rate", "runs collapsed (fraction)")}
LOG_SPAN = 8  # a positive numeric axis whose values span this factor or more is drawn on a log scale


def combos(table: pd.DataFrame, others: list[str]) -> list[dict]:
    """The distinct combinations of the other axes' values in the table, in cell order."""
    if not others:
        return [{}]
    seen = {}
    for _, row in table.sort_values("cell_id").iterrows():
        point = {a: row[a] for a in others}
        seen.setdefault(canon(point), point)
    return sorted(seen.values(), key=lambda p: [order(p[a]) for a in others])


def rows_of(table: pd.DataFrame, combo: dict) -> pd.DataFrame:
    keep = np.ones(len(table), dtype=bool)
    for axis, value in combo.items():
        keep &= np.array([canon(v) == canon(value) for v in table[axis]])
    return table[keep]


def positions(values: list) -> tuple[dict, str]:
    """x position of each axis value and the scale: 'log' (positive numbers spanning LOG_SPAN x or more: log10),
    'linear' (other numbers) or 'category' (anything else: 0, 1, ...)."""
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if numeric and min(values) > 0 and max(values) / min(values) >= LOG_SPAN:
        return {canon(v): float(np.log10(v)) for v in values}, "log"
    if numeric:
        return {canon(v): float(v) for v in values}, "linear"
    return {canon(v): float(i) for i, v in enumerate(values)}, "category"


def combo_label(combo: dict, names: dict[str, str]) -> str:
    return ", ".join(f"{names[a]}={show(v)}" for a, v in combo.items())


def n_label(objective: str, ns) -> str:
    ns = [int(n) for n in ns if n > 0]
    if not ns:
        return f"{objective} (no finished run)"
    return f"{objective} (n={min(ns)})" if min(ns) == max(ns) else f"{objective} (n={min(ns)}–{max(ns)})"


def axis_figure(table: pd.DataFrame, cells: Cells, axis: str, look: dict[str, Style], title: str, paper: bool,
                stem: str) -> Made:
    """Final accuracy, best accuracy and collapse rate (columns) against `axis`, one row per combination of the
    other axes' values, one line per objective (mean over seeds, interval bars)."""
    names = short_names(cells.axes)
    others = [a for a in cells.axes if a != axis]
    values = sorted({canon(v): v for v in table[axis]}.values(), key=order)
    x_of, scale = positions(values)
    span = (max(x_of.values()) - min(x_of.values())) or 1.0
    rows = combos(table, others)
    fig, axes = grid(len(PANELS) * len(rows), paper, title, legend_rows=1)
    objectives = sorted(set(table["objective"]))
    dodge = {o: (i - (len(objectives) - 1) / 2) * 0.025 * span for i, o in enumerate(objectives)}
    for r, combo in enumerate(rows):
        part = rows_of(table, combo)
        for c, (kind, (panel, ylabel)) in enumerate(PANELS.items()):
            ax = axes[r * len(PANELS) + c]
            for objective, group in part.groupby("objective"):
                s = look[objective]
                group = group.assign(_x=[x_of[canon(v)] + dodge[objective] for v in group[axis]]).sort_values("_x")
                if kind == "collapse":
                    y, low, high = group["collapse_rate"], group["collapse_low"], group["collapse_high"]
                else:
                    y, low, high = group[f"{kind}_mean"], group[f"{kind}_ci_low"], group[f"{kind}_ci_high"]
                ok = y.notna()
                ax.plot(group["_x"][ok], y[ok], color=s.color, linestyle=s.linestyle, marker=s.marker)
                bars = ok & low.notna()
                low, high = in_range("accuracy", low, high)  # a fraction: the bar inside [0, 1], as the curves'
                if bars.any():
                    ax.errorbar(group["_x"][bars], y[bars], yerr=[y[bars] - low[bars], high[bars] - y[bars]],
                                fmt="none", ecolor=s.color, capsize=3, alpha=0.7)
            if kind != "collapse":
                start_curve(ax, part, axis, x_of)
            ax.set_xticks([x_of[canon(v)] for v in values], [show(v) for v in values])
            ax.set(title=panel + (f"\n{combo_label(combo, names)}" if others else ""),
                   xlabel=axis + (" (log scale)" if scale == "log" else ""), ylabel=ylabel)
            if kind == "collapse":
                ax.set_ylim(-0.04, 1.04)
    labels = {o: n_label(o, table.loc[table["objective"] == o, "final_n"]) for o in objectives}
    objective_legend(fig, look, labels, legend_columns(labels.values(), width_of(3, paper, False), paper))
    caption = (f"x: `{axis}`; each point one (objective, cell): mean over its seeds of the runs that ended; bars: "
               f"{INTERVALS}, drawn inside [0, 1] (the tables give the whole interval); grey dashed line: the start "
               "(step-0 accuracy, mean over the cell's runs); collapse rate: "
               "collapsed / ended runs with a Wilson 95% interval. n in the legend: "
               "seeds per point (the tables give each point's n).")
    if others:
        caption += " One row of panels per value of the other axes (" + ", ".join(f"`{a}`" for a in others) + \
                   "): they are never pooled."
    return Made(stem, title, fig, caption)


def start_curve(ax, part: pd.DataFrame, axis: str, x_of: dict) -> None:
    """The start (step-0 eval accuracy, mean over the objectives' rows of each cell) as a grey dashed line, so that an
    end accuracy reads as a gain or a loss."""
    start = part[part["start_n"] > 0].groupby(part[axis].map(lambda v: x_of[canon(v)]))["start_mean"].mean()
    if not start.empty:
        ax.plot(start.index, start.values, color="0.5", linestyle="--", marker="x", linewidth=1, zorder=1)


def heatmap_figure(table: pd.DataFrame, cells: Cells, pair: tuple[str, str], kind: str, title: str, paper: bool,
                   stem: str) -> Made:
    """Mean final accuracy (kind "final") or collapse rate ("collapse") over two axes: one panel per objective and
    combination of the remaining axes; annotated with the value and n; one colour scale for all panels."""
    names = short_names(cells.axes)
    ya, xa = pair
    others = [a for a in cells.axes if a not in pair]
    y_values = sorted({canon(v): v for v in table[ya]}.values(), key=order)
    x_values = sorted({canon(v): v for v in table[xa]}.values(), key=order)
    column, count = ("final_mean", "final_n") if kind == "final" else ("collapse_rate", "collapse_n")
    objectives = sorted(set(table["objective"]))
    panels = list(itertools.product(combos(table, others), objectives))
    fig, axes = grid(len(panels), paper, title)
    finite = table[column].dropna()
    vmin, vmax = (0.0, 1.0) if kind == "collapse" or finite.empty else (float(finite.min()), float(finite.max()))
    if vmax - vmin < 1e-9:
        vmin, vmax = vmin - 0.05, vmax + 0.05
    cmap = plt.get_cmap("viridis" if kind == "final" else "magma_r").with_extremes(bad="0.85")
    image = None
    for ax, (combo, objective) in zip(axes, panels, strict=True):
        part = rows_of(table[table["objective"] == objective], combo)
        grid_values = np.full((len(y_values), len(x_values)), np.nan)
        for _, row in part.iterrows():
            i = next(k for k, v in enumerate(y_values) if canon(v) == canon(row[ya]))
            j = next(k for k, v in enumerate(x_values) if canon(v) == canon(row[xa]))
            grid_values[i, j] = row[column]
            text = "no run" if pd.isna(row[column]) else f"{row[column]:.2f}\nn={int(row[count])}"
            shade = (row[column] - vmin) / (vmax - vmin) if pd.notna(row[column]) else 1.0
            ax.text(j, i, text, ha="center", va="center", fontsize="small",
                    color=("white" if (shade < 0.55) == (kind == "final") else "black"))
        image = ax.imshow(np.ma.masked_invalid(grid_values), cmap=cmap, vmin=vmin, vmax=vmax, origin="lower",
                          aspect="auto")
        ax.set_xticks(range(len(x_values)), [show(v) for v in x_values])
        ax.set_yticks(range(len(y_values)), [show(v) for v in y_values])
        ax.set(xlabel=names[xa], ylabel=names[ya], title=objective + (f"\n{combo_label(combo, names)}" if others
                                                                      else ""))
        ax.grid(False)
    fig.colorbar(image, ax=axes, shrink=0.8, label="final eval accuracy (mean over seeds)" if kind == "final"
                 else "collapse rate (collapsed / ended runs)")
    what = "mean final eval accuracy over seeds" if kind == "final" else "collapse rate (collapsed / ended runs)"
    caption = (f"Each square one (objective, cell): {what}, with n (seeds); grey: no run ended there. y: `{ya}`, "
               f"x: `{xa}`; one colour scale for all panels.")
    if others:
        caption += " One panel per objective and value of the other axes (" + ", ".join(f"`{a}`" for a in others) \
                   + ")."
    return Made(stem, title, fig, caption)


def axis_figures(table: pd.DataFrame, cells: Cells, look: dict[str, Style], name: str, paper: bool) -> list[Made]:
    """One axis figure per axis, then the heat maps of every pair of axes (collapse-rate maps only when some run
    collapsed); nothing when fewer than one axis."""
    made = []
    names = short_names(cells.axes)
    for i, axis in enumerate(cells.axes, 1):
        made.append(axis_figure(table, cells, axis, look, f"{name}: against {names[axis]}", paper, f"axis_{i}"))
    collapsed = table["collapse_k"].fillna(0).sum() > 0
    for i, pair in enumerate(itertools.combinations(cells.axes, 2), 1):
        label = f"{names[pair[0]]} x {names[pair[1]]}"
        made.append(heatmap_figure(table, cells, pair, "final", f"{name}: final accuracy over {label}", paper,
                                   f"heatmap_{i}"))
        if collapsed:
            made.append(heatmap_figure(table, cells, pair, "collapse", f"{name}: collapse rate over {label}", paper,
                                       f"heatmap_collapse_{i}"))
    return made
