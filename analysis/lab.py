"""results/lab/<name>/ (written by harness/apps/lab.py) -> tidy tables, statistics across batches, figures, report.

Tables (CSV, in the lab folder):
    lab.csv        one row per objective x axis point x batch: the objective's loss and metrics, its gradient's
                   norm, cosine to the reference direction (``cos_reference``), cosine to its own gradient at the
                   fresh fp32 point of the same batch (``cos_fresh``: 1 at staleness 0), token-weight diagnostics.
                   The fresh point appears on both axes (staleness 0 = mismatch float32).
    positions.csv  variance of the log ratios against completion position, per axis point and batch.
    pairwise.csv   cosine between the gradients of two objectives, per point and batch.
    snr.csv        per objective and point: the gradient's signal-to-noise ratio across batches with its CI.
    summary.csv    per objective and point: mean and interval over batches of the main measurements.

The gradient's SNR across the B batches, from the Gram matrix G_ab = <g_a, g_b> of the gradient sketches:
    |mu|^2    ~ mean of G_ab over pairs a != b              (unbiased for the squared norm of the mean gradient)
    tr Sigma  ~ mean of G_aa - |mu|^2                       (the trace of the gradient's covariance)
    SNR       = |mu|^2 / tr Sigma                           (can be < 0 when the signal is below the noise)
its interval is a percentile bootstrap over batches (analysis/stats.py's resamples and level; pairs of copies of
one batch are left out of the off-diagonal mean).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from analysis import plots
from analysis.report import render_html, render_md
from analysis.stats import BOOT_SEED, CI_MIN_SEEDS, LEVEL, N_BOOT, describe, num
from harness.run.atomic import ForeignFileError, atomic_write, write_into
from harness.run.records import load_tensors, unreadable_reason

FRESH = "staleness=0"
MAX_BANDS = 6  # interval bands are drawn for up to this many objectives (more would hide the lines)
MEASURES = {"cos_reference": "Cosine to the on-policy gradient", "snr": "Gradient SNR across batches",
            "ess_token_frac": "Kish ESS of token weights / tokens",
            "frac_tokens_with_grad": "Fraction of tokens carrying gradient", "clip_frac": "Clip fraction",
            "cos_fresh": "Cosine to its own fresh gradient"}
SUMMARY = ("cos_reference", "cos_fresh", "grad_norm", "frac_tokens_with_grad", "ess_token_frac", "ess_sequence_frac",
           "clip_frac", "grad_share_ppo_clipped", "frac_ppo_clipped", "token_weight_long_over_short_wrong",
           "grad_share_long_wrong", "ratio_std", "loss")


class LabError(Exception):
    pass


def snr_of(gram: np.ndarray, index: np.ndarray) -> float:
    """SNR = |mu|^2 / tr Sigma of the batches ``index`` (repeats allowed) from the Gram matrix of per-batch gradients:
    |mu|^2 = mean of <g_a, g_b> over pairs of distinct batches, tr Sigma = mean of |g_a|^2 - |mu|^2 (module
    docstring); NaN with fewer than 2 distinct batches or no noise."""
    sub = gram[np.ix_(index, index)]
    distinct = index[:, None] != index[None, :]
    if not distinct.any():
        return float("nan")
    signal = sub[distinct].mean()
    noise = np.diag(sub).mean() - signal
    return float(signal / noise) if noise > 0 else float("nan")


def gram_snr(gram: np.ndarray) -> float:
    """The SNR of all the batches of ``gram``."""
    return snr_of(gram, np.arange(len(gram)))


def snr_interval(gram: np.ndarray) -> tuple[float, float, float]:
    """(SNR, low, high): the estimate and its percentile bootstrap interval over batches (none below 3)."""
    n = len(gram)
    estimate = gram_snr(gram)
    if n < 3:
        return estimate, float("nan"), float("nan")
    rng = np.random.default_rng(BOOT_SEED)
    values = [v for v in (snr_of(gram, rng.integers(0, n, n)) for _ in range(N_BOOT)) if np.isfinite(v)]
    if not values:
        return estimate, float("nan"), float("nan")
    low, high = np.percentile(values, [50 * (1 - LEVEL), 50 * (1 + LEVEL)])
    return estimate, float(low), float(high)


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine in float64; NaN if either vector is 0 (e.g. every token of an objective clipped)."""
    a, b = a.double(), b.double()
    norm = (a.norm() * b.norm()).item()
    return (a @ b).item() / norm if norm > 0 else float("nan")


def load_batches(folder: Path) -> list[dict]:
    """The measured batches, read as tensors in plain containers only (:func:`load_tensors`); a file holding anything
    else is refused in one line (LabError) naming it."""
    paths = sorted((folder / "batches").glob("batch_*.pt"))
    if not paths:
        raise LabError(f"{folder} holds no measured batch (batches/batch_*.pt): run `python -m harness lab ...`")
    batches = []
    for path in paths:
        try:
            batches.append(load_tensors(path))
        except Exception as e:  # noqa: BLE001 - torn, corrupted, or not ours: named, never run
            raise LabError(f"unreadable lab batch {path} ({unreadable_reason(e)}): delete it and run the lab again "
                           "to measure that batch anew") from None
    return batches


def tables(batches: list[dict]) -> dict[str, pd.DataFrame]:
    """lab, positions, pairwise and snr tables (module docstring) from the measured batches."""
    rows, pairs = [], []
    for measured in batches:
        sketches, references = measured["sketches"], measured["references"]
        for row in measured["rows"]:
            key = f"{row['axis']}={row['point']}"
            g = sketches[key][row["objective"]]
            reference = references[f"staleness={row['staleness']}"]
            rows.append({**row, "cos_reference": cos(g, reference),
                         "cos_fresh": cos(g, sketches[FRESH][row["objective"]])})
        for key, per_objective in sketches.items():
            for a, b in itertools.combinations(sorted(per_objective), 2):
                pairs.append({"batch": measured["rows"][0]["batch"], "point": key, "objective": a, "other": b,
                              "cosine": cos(per_objective[a], per_objective[b])})
    lab = pd.DataFrame(rows)
    with_mismatch = (lab["axis"] == "mismatch").any()  # then the fresh point is also the mismatch axis's float32
    fresh = lab[(lab["axis"] == "staleness") & (lab["staleness"] == 0)].assign(axis="mismatch", point="float32")
    lab = pd.concat([lab, fresh], ignore_index=True) if with_mismatch else lab
    snr = []
    keys = sorted(batches[0]["sketches"])
    for key in keys:
        for objective in sorted(batches[0]["sketches"][key]):
            vectors = torch.stack([m["sketches"][key][objective] for m in batches]).double()
            estimate, low, high = snr_interval((vectors @ vectors.T).numpy())
            axis, _, point = key.partition("=")
            snr.append({"objective": objective, "axis": axis, "point": point, "snr": estimate, "snr_low": low,
                        "snr_high": high, "batches": len(batches)})
    snr = pd.DataFrame(snr)
    fresh_snr = snr[snr["axis"] == "staleness"].query("point == '0'").assign(axis="mismatch", point="float32")
    positions = pd.DataFrame([r for m in batches for r in m["positions"]])
    return {"lab": lab, "positions": positions, "pairwise": pd.DataFrame(pairs),
            "snr": pd.concat([snr, fresh_snr], ignore_index=True) if with_mismatch else snr}


def summary(lab: pd.DataFrame) -> pd.DataFrame:
    """Mean and interval over batches (analysis/stats.py's describe) of SUMMARY's columns, per objective x point."""
    out = []
    for (objective, axis, point), group in lab.groupby(["objective", "axis", "point"], sort=False):
        row = {"objective": objective, "axis": axis, "point": point, "staleness": group["staleness"].iloc[0],
               "batches": len(group)}
        for column in SUMMARY:
            if column in group:
                d = describe(group[column])
                row.update({column: d["mean"], f"{column}_low": d["ci_low"], f"{column}_high": d["ci_high"],
                            f"{column}_n": d["n"]})
        out.append(row)
    return pd.DataFrame(out)


def staleness_figure(summary_: pd.DataFrame, snr: pd.DataFrame, look, title: str):
    """One panel per measure of MEASURES against staleness: mean over batches per objective, interval band."""
    data = summary_[summary_["axis"] == "staleness"].copy()
    s = snr[snr["axis"] == "staleness"].assign(staleness=lambda d: d["point"].astype(int))
    fig, axes = plots.grid(len(MEASURES), False, title, legend_rows=math.ceil(len(look) / 6))
    for ax, (measure, label) in zip(axes, MEASURES.items(), strict=True):
        source, low, high = (s, "snr_low", "snr_high") if measure == "snr" else (data, f"{measure}_low",
                                                                                  f"{measure}_high")
        for objective, c in source.groupby("objective"):
            if measure not in c or c[measure].isna().all():
                continue
            c = c.sort_values("staleness")
            st = look[objective]
            ax.plot(c["staleness"], c[measure], color=st.color, linestyle=st.linestyle, marker=st.marker)
            if low in c and len(look) <= MAX_BANDS:
                ax.fill_between(c["staleness"], *plots.in_range(measure, c[low], c[high]), color=st.color, alpha=0.12,
                                linewidth=0)
        ax.set(title=label, xlabel="staleness (optimizer steps since sampling)")
        if measure == "snr":
            ax.set_yscale("symlog", linthresh=1e-3)
    plots.objective_legend(fig, look, {o: o for o in look}, 6)
    return fig


def mismatch_figure(summary_: pd.DataFrame, look, title: str):
    """Per objective, cos_fresh (to its fp32-behaviour gradient) and cos_reference at each mismatch sampler."""
    data = summary_[summary_["axis"] == "mismatch"]
    if data.empty:
        return None
    points = list(dict.fromkeys(data["point"]))
    fig, axes = plots.grid(2, False, title, legend_rows=1)
    for ax, measure in zip(axes, ("cos_fresh", "cos_reference"), strict=True):
        objectives = sorted(data["objective"].unique())
        for j, point in enumerate(points):
            c = data[data["point"] == point].set_index("objective").reindex(objectives)
            x = np.arange(len(objectives)) + (j - (len(points) - 1) / 2) * 0.25
            ax.errorbar(x, c[measure], yerr=[c[measure] - c[f"{measure}_low"], c[f"{measure}_high"] - c[measure]],
                        fmt=plots.MARKERS[j], color=plots.COLORS[j], label=point, capsize=2)
        ax.set_xticks(np.arange(len(objectives)), objectives, rotation=60, ha="right")
        ax.set(title=MEASURES.get(measure, measure) if measure != "cos_fresh" else
               "Cosine to its own fp32-behaviour gradient", ylabel="cosine")
    axes[0].legend(title="behaviour sampler", frameon=False)
    return fig


def positions_figure(positions: pd.DataFrame, title: str):
    """Standard deviation of the log ratios against position (log-log), one panel per staleness > 0 point and
    per mismatch sampler, with a sqrt(t) line through the cumulative ratio's first position; None when there is no
    such point or no position with two sequences."""
    if positions.empty:
        return None
    points = [p for p in dict.fromkeys(zip(positions["axis"], positions["point"], strict=True))
              if not (p[0] == "staleness" and p[1] == "0")]
    if not points:
        return None
    fig, axes = plots.grid(len(points), False, title, legend_rows=1)
    kinds = {"var_token": "token d_t", "var_cumulative": "cumulative c_t (CTPO)",
             "var_prefix_mean": "prefix mean c_t/t (GSPO)", "var_sequence_mean": "sequence mean (GSPO)"}
    for ax, (axis, point) in zip(axes, points, strict=True):
        data = positions[(positions["axis"] == axis) & (positions["point"] == point)]
        mean = data.groupby("position")[list(kinds)].mean()
        for j, (column, label) in enumerate(kinds.items()):
            ax.plot(mean.index, np.sqrt(mean[column]), color=plots.COLORS[j], marker=plots.MARKERS[j],
                    markevery=max(1, len(mean) // 8), label=label)
        if len(mean) and mean["var_cumulative"].iloc[0] > 0:
            t = mean.index.to_numpy(dtype=float)
            ax.plot(t, np.sqrt(mean["var_cumulative"].iloc[0] * t), color="grey", linestyle=":", label="∝ √t")
        ax.set(xscale="log", yscale="log", title=f"{axis} {point}", xlabel="position t", ylabel="sd of log ratio")
    axes[0].legend(frameon=False, fontsize="small")
    return fig


def sqrt_growth(positions: pd.DataFrame) -> pd.DataFrame:
    """Per axis point: the slope of log sd(c_t) against log t (1/2 for independent equal-variance increments),
    fitted by least squares over positions with at least half of the first position's sequences, and the fraction
    of positions where var_token <= var_cumulative <= var_sequence; no row when no position had two sequences
    (every completion empty)."""
    out = []
    for (axis, point), data in ([] if positions.empty else positions.groupby(["axis", "point"], sort=False)):
        mean = data.groupby("position").agg({"var_token": "mean", "var_cumulative": "mean", "var_sequence": "mean",
                                             "sequences": "mean"})
        mean = mean[(mean["sequences"] >= mean["sequences"].iloc[0] / 2) & (mean["var_cumulative"] > 0)]
        slope = (np.polyfit(np.log(mean.index), 0.5 * np.log(mean["var_cumulative"]), 1)[0]
                 if len(mean) >= 3 else float("nan"))
        between = ((mean["var_token"] <= mean["var_cumulative"]) & (mean["var_cumulative"] <= mean["var_sequence"]))
        out.append({"axis": axis, "point": point, "cumulative_sd_slope": slope, "positions": len(mean),
                    "frac_positions_ordered": between.mean() if len(mean) else float("nan")})
    return pd.DataFrame(out, columns=["axis", "point", "cumulative_sd_slope", "positions", "frac_positions_ordered"])


def display(summary_: pd.DataFrame, snr: pd.DataFrame, axis: str) -> pd.DataFrame:
    """The report's table of one axis: mean [interval] over batches (:data:`TABLE_NOTE`), with the number of batches
    where a measure is defined on fewer than all (a cosine of a zero gradient is not)."""
    data = summary_[summary_["axis"] == axis].merge(snr, on=["objective", "axis", "point"], how="left",
                                                    suffixes=("", "_snr"))
    fewer = lambda r, c: (f" ({int(r[c + '_n'])} of {int(r['batches'])} batches)"  # noqa: E731
                          if c + "_n" in r and pd.notna(r[c + "_n"]) and r[c + "_n"] < r["batches"] else "")
    cell = lambda r, c: (f"{num(r[c])} [{num(r[c + '_low'])}, {num(r[c + '_high'])}]{fewer(r, c)}"  # noqa: E731
                         if c in r and pd.notna(r[c]) else "n/a")
    columns = ("cos_reference", "snr", "cos_fresh", "frac_tokens_with_grad", "ess_token_frac", "clip_frac")
    return pd.DataFrame([{"objective": r["objective"], axis: r["point"], **{c: cell(r, c) for c in columns}}
                         for _, r in data.iterrows()])


TABLE_NOTE = (f"Each cell: the mean over the batches [its {LEVEL:.0%} Student-t interval over them from "
              f"{CI_MIN_SEEDS} batches, the range (min–max) with 2, none with 1], over the batches where the measure "
              "is defined (a cosine of a zero gradient is not: the cell then says on how many); snr: the estimate from "
              f"every batch's gradient [its {LEVEL:.0%} percentile bootstrap over batches, {N_BOOT} resamples, from 3 "
              "batches, resamples that give none (one distinct batch, no noise) left out; its coverage is not "
              "measured: indicative]. Intervals are shown whole (a cosine's or a fraction's may reach beyond its "
              "range) and unadjusted for the number of cells; summary.csv and snr.csv hold them.")

def skipped_note(batches: list[dict]) -> str | None:
    """The report's warning when the mover skipped steps (``mover_skipped``: a non-finite loss or gradient, the loop's
    rule): a staleness point k of such a batch is fewer than k applied steps."""
    skipped = {m.get("batch", i): m["mover_skipped"] for i, m in enumerate(batches) if m.get("mover_skipped")}
    if not skipped:
        return None
    steps = "; ".join(f"batch {b}: step {', '.join(map(str, k))}" for b, k in skipped.items())
    return (f"Warning: the mover skipped steps with a non-finite loss or gradient ({steps}), so in those batches a "
            "staleness point k holds fewer than k applied steps (each skipped step leaves the policy as it was).")


CODE_FILE = "code.json"  # a lab's folder: the code record (harness/run/provenance.py) of what measured its batches
POLICY_FILE = "policy.json"  # a lab's folder: the digest of the policy whose gradients its batches measured


def lab_version(folder: Path) -> str | None:
    """The code version that measured the lab's batches (``folder/code.json``); None for a lab from before labs
    recorded their code, or whose record is damaged."""
    return _recorded(folder / CODE_FILE, "version")


def lab_policy(folder: Path) -> str | None:
    """The digest of the policy the lab's batches measured (``folder/policy.json``, ``weights_sha256``); None for a
    lab from before labs recorded their policy, or whose record is damaged."""
    return _recorded(folder / POLICY_FILE, "weights_sha256")


def _recorded(path: Path, key: str) -> str | None:
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def build_lab_report(folder: str | Path) -> Path:
    """Write the tables into ``folder`` and the report into ``folder/report``; returns report.md's path."""
    folder = Path(folder)
    batches = load_batches(folder)
    found = tables(batches)
    found["summary"] = summary(found["lab"])
    found["sqrt_growth"] = sqrt_growth(found["positions"])
    for name, table in found.items():
        atomic_write(folder / f"{name}.csv", table.to_csv(index=False))
    try:
        write_into(folder / "report", lambda tmp: write_lab_report(folder, batches, found, tmp),
                   earlier=("report.md", "# Gradient lab: "), entries=("report.html",))
    except ForeignFileError as e:
        raise LabError(str(e)) from None
    return folder / "report" / "report.md"


def write_lab_report(folder: Path, batches: list[dict], found: dict, tmp: Path) -> None:
    """The lab's report (report.md, report.html, figures) into the new folder ``tmp``."""
    tmp.mkdir()
    name = folder.name
    look = plots.styles(found["lab"]["objective"])
    first = batches[0]
    error = 1 / math.sqrt(first["sketch_dim"])
    sketch = ("exact gradients" if first["sketch_exact"] else f"a count sketch of {first['sketch_dim']} dimensions "
              f"(inner products within ~{error:.1%} of the product of the gradients' norms)")
    seconds = sum(m["seconds"] for m in batches)
    figures = [("staleness", staleness_figure(found["summary"], found["snr"], look, f"{name}: against staleness"),
                f"Mean over {len(batches)} batches per objective; "
                + (f"band: the tables' intervals, {plots.BANDS}"
                   if len(look) <= MAX_BANDS else f"intervals (not drawn for more than {MAX_BANDS} objectives): "
                   "the tables above and summary.csv / snr.csv") + ". SNR on a symlog axis."),
               ("mismatch", mismatch_figure(found["summary"], look, f"{name}: behaviour from another sampler"),
                "Point: mean over batches; bar: interval over batches. float32 = the fresh on-policy point."),
               ("positions", positions_figure(found["positions"], f"{name}: log-ratio spread by position"),
                "Square root of the variance across sequences (mean over batches) of each log ratio at position t.")]
    blocks = [("h1", f"Gradient lab: {name}"),
              ("p", f"{len(batches)} batches of {first['eval_prompts']} prompts (the evaluation minibatch), "
                    f"{first['parameters']:,} parameters compared through {sketch}; measured in {seconds:.0f} s "
                    "(sum over batches) by code "
                    + (f"`{lab_version(folder)}` ({CODE_FILE})" if lab_version(folder) else
                       "of no recorded version (a lab from before labs recorded their code)")
                    + (f", on the policy of weights digest `{lab_policy(folder)}` ({POLICY_FILE})" if lab_policy(folder)
                       else ", on a policy whose weights were not recorded (a lab from before labs recorded them)")
                    + ". Tables: lab.csv (one row per objective x point x batch), summary.csv, snr.csv, pairwise.csv, "
                    "positions.csv, sqrt_growth.csv."),
              *([("p", skipped_note(batches))] if skipped_note(batches) else []),
              ("p", TABLE_NOTE),
              ("h2", "Staleness axis"), ("table", display(found["summary"], found["snr"], "staleness")),
              ("h2", "Mismatch axis"), ("table", display(found["summary"], found["snr"], "mismatch")),
              *([("h2", "Routing axis (MoE: the largest staleness with the behaviour routing forced; replay off is "
                        "that staleness point)"), ("table", display(found["summary"], found["snr"], "routing"))]
                if (found["summary"]["axis"] == "routing").any() else []),
              ("h2", "Growth of the cumulative log ratio"), ("table", found["sqrt_growth"].round(3))]
    for stem, fig, caption in figures:
        if fig is None:
            blocks.append(("p", f"{stem}: not drawn (no point with a moved policy or another sampler, or no "
                                "position that two sequences reach)."))
            continue
        plots.save(fig, tmp, stem, ["png"])
        blocks.append(("figure", stem, stem, caption))
    (tmp / "report.md").write_text(render_md(blocks))
    (tmp / "report.html").write_text(render_html(blocks, tmp, f"Gradient lab: {name}"))
