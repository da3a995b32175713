"""analysis: a synthetic results folder (written to tmp_path) -> report; numbers checked by hand."""

import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import matplotlib.collections
import numpy as np
import pandas as pd
import pytest
import scipy.stats
from matplotlib import pyplot as plt

from analysis import AnalysisError, AnalysisWarning, build_report, load_experiment, plots
from analysis import report as report_module
from analysis.__main__ import main
from analysis.report import FIGURES, eval_table
from analysis.stats import bootstrap_ci, describe, num
from tests.helpers.toy_experiment import FINAL, PROBLEMS, write_experiment, write_run


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    exp = write_experiment(tmp_path_factory.mktemp("results") / "toy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = build_report(exp, smooth=2, formats=("png", "pdf", "svg"))
    return path, [str(w.message) for w in caught if issubclass(w.category, AnalysisWarning)]


def test_bootstrap_is_the_documented_percentile_bootstrap():
    x = np.array([0.4, 0.5, 0.75])
    means = x[np.random.default_rng(0).integers(0, 3, size=(2000, 3))].mean(axis=1)
    assert bootstrap_ci(x) == tuple(np.percentile(means, [2.5, 97.5]))
    # with 3 seeds, P(all resamples equal the minimum) = 1/27 > 2.5%: the interval is exactly [min, max]
    assert bootstrap_ci(x) == pytest.approx((0.4, 0.75))
    ref = scipy.stats.bootstrap((x,), np.mean, method="percentile", n_resamples=2000, rng=1).confidence_interval
    assert (ref.low, ref.high) == pytest.approx((0.4, 0.75))
    assert np.isnan(bootstrap_ci([0.3])).all() and np.isnan(describe([0.3])["ci_low"])


def test_describe_is_the_student_t_interval_over_seeds():
    x = np.array([0.4, 0.5, 0.75])
    d = describe(x)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx(scipy.stats.t.interval(0.95, 2, x.mean(), scipy.stats.sem(x)))
    two = describe([0.4, 0.5])
    assert (two["ci_low"], two["ci_high"]) == (0.4, 0.5)  # the range, called so
    assert describe([0.3, 0.3, 0.3])["ci_low"] == 0.3  # values that do not vary: the interval is the value


def test_iqm_with_six_seeds(tmp_path):
    finals = {"grpo": dict(enumerate([0.9, 0.1, 0.5, 0.2, 0.4, 0.3]))}
    table = eval_table(load_experiment(write_experiment(tmp_path / "six", finals, extra=False)).runs)
    table = table.set_index("objective")
    # middle 50% of 0.1 0.2 0.3 0.4 0.5 0.9 (one cut from each end): 0.2 0.3 0.4 0.5
    assert table.loc["grpo", "final_iqm"] == pytest.approx(0.35)
    assert table.loc["grpo", "final_mean"] == pytest.approx(0.4)
    assert table.loc["grpo", "seeds"] == 6


@pytest.mark.slow
def test_table_numbers(report):
    out = report[0].parent
    table = pd.read_csv(out / "eval_accuracy.csv").set_index("objective")
    for objective, seeds in FINAL.items():
        x = np.array(list(seeds.values()))
        row = table.loc[objective]
        assert row["seeds"] == 3 and row["unfinished_runs"] == (2 if objective == "grpo" else 1)
        assert row["final_mean"] == pytest.approx(x.mean()) and row["final_problems"]
        # over seeds and eval problems: problem p solved by the seeds with p < 100 x accuracy (toy_experiment)
        scores = np.array([[p < round(100 * a) for p in range(PROBLEMS)] for a in x], dtype=float)
        seed_part, problem_part = x.var(ddof=1) / 3, scores.mean(axis=0).var(ddof=1) / PROBLEMS
        residual = scores - scores.mean(1, keepdims=True) - scores.mean(0, keepdims=True) + scores.mean()
        held = (residual ** 2).sum() / (2 * (PROBLEMS - 1) * 3 * PROBLEMS)  # seed x problem: in the seeds' part
        own = max(problem_part - held, 0.0)  # the problems' own spread: the degrees of freedom of PROBLEMS - 1
        df = (seed_part + problem_part) ** 2 / ((seed_part + problem_part - own) ** 2 / 2 + own ** 2 / (PROBLEMS - 1))
        half = scipy.stats.t.ppf(0.975, df) * np.sqrt(seed_part + problem_part)
        assert (row["final_ci_low"], row["final_ci_high"]) == pytest.approx((x.mean() - half, x.mean() + half))
        assert np.isnan(row["final_iqm"])  # fewer than 5 seeds
        assert row["best_mean"] == pytest.approx(np.maximum(x, 0.13).mean())
        assert row["wall_time_s"] == pytest.approx(101.0)  # 100 + seed, seeds 0..2
        assert row["rollout_tokens"] == pytest.approx(600)
    md = (out / "eval_accuracy.md").read_text()
    low, high = table.loc["grpo", ["final_ci_low", "final_ci_high"]]
    shown = f"95% CI [{num(low)}, {num(high)}], 3 seeds: indicative"
    assert f"| grpo | 3 | 0.550 | {shown} | n/a | 0.550 | {shown} | n/a | 0/3 | 101 | 600 | 2 |" in md
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == 9 and runs["complete"].sum() == 6


FAMILIES = ("metrics_clip", "metrics_gate", "metrics_other")  # clip_frac_low/high, gate_weight_*, holder_p


@pytest.mark.slow
def test_figures_written(report):
    out = report[0].parent
    for stem in [*FIGURES, *FAMILIES]:
        for fmt in ("png", "pdf", "svg"):
            assert (out / f"{stem}.{fmt}").stat().st_size > 1000, f"{stem}.{fmt}"
    assert sorted(p.stem for p in out.glob("*.png")) == sorted([*FIGURES, *FAMILIES])
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(FIGURES) + len(FAMILIES)


def test_a_band_stays_inside_its_metrics_range():
    """Three seeds of a fraction near 0: the t-interval reaches below 0, the band stops at 0 (and at 1 above); a
    metric without a range (the k1 KL, which can be < 0) keeps the whole interval."""
    from analysis.cells import START_SEED

    rows = [{"objective": "grpo", "run_id": f"r{seed}", "seed": seed, START_SEED: 1, "step": step,
             "clip_frac": value, "frac_zero_std_groups": 1 - value, "kl_behavior": value - 0.05}
            for seed, value in enumerate([0.0, 0.0, 0.3]) for step in (1, 2)]
    metrics = pd.DataFrame(rows)
    look = plots.styles(["grpo"])
    bands = {}
    for metric in ("clip_frac", "frac_zero_std_groups", "kl_behavior"):
        fig, ax = plt.subplots()
        plots.line_panel(ax, metrics, "step", metric, look)
        (band,) = ax.collections
        ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
        bands[metric] = ys.min(), ys.max()
        plt.close(fig)
    d = describe(metrics[metrics["step"] == 1]["clip_frac"])
    assert d["ci_low"] < 0 < d["ci_high"] < 1  # the interval itself reaches below 0
    assert bands["clip_frac"] == (0.0, pytest.approx(d["ci_high"]))
    assert bands["frac_zero_std_groups"] == (pytest.approx(1 - d["ci_high"]), 1.0)
    assert bands["kl_behavior"][0] == pytest.approx(d["ci_low"] - 0.05)

    runs = pd.DataFrame([{"objective": "grpo", "run_id": f"r{seed}", "seed": seed, START_SEED: 1, "ended": True,
                          "final_eval_accuracy": value, "start_eval_accuracy": 0.5}
                         for seed, value in enumerate([1.0, 1.0, 0.7])])
    made = plots.final_figure(runs, look, "t", False)
    (bar,) = [c for c in made.fig.axes[0].collections if isinstance(c, matplotlib.collections.LineCollection)]
    assert describe(runs["final_eval_accuracy"])["ci_high"] > 1  # the interval reaches above 1, its bar stops there
    assert max(seg[:, 1].max() for seg in bar.get_segments()) == 1.0
    plt.close(made.fig)


@pytest.mark.slow
def test_a_figure_is_laid_out_once_for_all_its_formats(tmp_path, monkeypatch):
    """The constrained layout runs at the first format's save; the others keep its panel positions, and are drawn
    once each: matplotlib draws a figure that has a layout engine, even a placeholder, once more before it prints it
    (for the layout), which after the first format lays out nothing."""
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import ConstrainedLayoutEngine
    runs, draws = [], []
    execute, draw = ConstrainedLayoutEngine.execute, Figure.draw
    monkeypatch.setattr(ConstrainedLayoutEngine, "execute", lambda self, fig: runs.append(1) or execute(self, fig))
    monkeypatch.setattr(Figure, "draw", lambda self, renderer: draws.append(1) or draw(self, renderer))
    fig, axes = plt.subplots(1, 2, figsize=(6, 3), layout="constrained")
    axes[0].set(xlabel="step", ylabel="eval accuracy", title="a")
    real_savefig = fig.savefig
    positions = []
    def savefig(*args, **kw):
        real_savefig(*args, **kw)
        positions.append([ax.get_position().bounds for ax in fig.axes])
    monkeypatch.setattr(fig, "savefig", savefig)
    paths = plots.save(fig, tmp_path, "f", ["png", "pdf", "svg"])
    assert [p.name for p in paths] == ["f.png", "f.pdf", "f.svg"] and all(p.stat().st_size > 1000 for p in paths)
    assert len(runs) == 1 and len(draws) == 4  # the first format's layout draw, then one draw per format
    assert positions[0] == positions[1] == positions[2]


@pytest.mark.slow
def test_every_objective_metric_is_drawn(report):
    """Metrics an objective reports (not in the fixed figures) are drawn, grouped by prefix; bookkeeping is not."""
    metrics = load_experiment(report[0].parent.parent).metrics
    drawn = {m for m in [*plots.CURVES, *plots.STABILITY] if plots.reported(metrics, m)}
    assert plots.families(metrics, drawn) == {"clip": ["clip_frac_high", "clip_frac_low"],
                                              "gate": ["gate_weight_mean", "gate_weight_min"],
                                              "other": ["holder_p"]}
    md = report[0].read_text()
    for title, stem in (("Metrics clip_*", "metrics_clip"), ("Metrics gate_*", "metrics_gate"),
                        ("Other per-step metrics", "metrics_other")):
        assert f"![toy: {title}]({stem}.png)" in md
    assert "`holder_p` is not reported by: gspo." in md and "`gate_weight_mean` is not reported by: grpo." in md
    for key in ("lr", "rollout_s", "update_s", "rollout_tok_s", "peak_mem_mb", "nonfinite_skips", "rollout_tokens"):
        assert plots.bookkeeping(key)
    assert "Every numeric per-step metric is drawn except bookkeeping (timings `*_s`, `*_mb`, `lr`," in md


@pytest.mark.slow
def test_paper_mode(tmp_path):
    """--paper: PDFs at the column widths, no suptitle; captions are in the report text, not in the images."""
    exp = write_experiment(tmp_path / "toy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([str(exp), "--paper", "--formats", "png", "--out", str(tmp_path / "paper")]) == 0
    widths = {stem: float(re.search(rb"/MediaBox \[ *0 0 ([0-9.]+)", (tmp_path / "paper" / f"{stem}.pdf")
                                    .read_bytes()).group(1)) / 72 for stem in [*FIGURES, *FAMILIES]}
    assert widths == pytest.approx({stem: 3.3 if stem in ("clip_fraction", "final_eval") else 6.8
                                    for stem in widths})
    metrics, look = load_experiment(exp).metrics, plots.styles(["grpo", "gspo"])
    for paper in (True, False):
        made = plots.curves_figure(metrics, "step", look, 1, "toy: curves", paper)
        assert made.fig.get_suptitle() == ("" if paper else "toy: curves")
        assert [t.get_text() for t in made.fig.texts] == ([] if paper else ["toy: curves"])  # no footnote
        assert len(made.fig.legends) == 1 and all(ax.get_legend() is None for ax in made.fig.axes)
        assert made.fig.axes[0].xaxis.get_major_locator()._integer  # integer step ticks
        plt.close(made.fig)
    assert "95% Student-t interval over seeds" in (tmp_path / "paper" / "report.md").read_text()  # the caption


def write_objectives(exp: Path, start_policy="absent") -> Path:
    """gspo and gspo_token (identical metrics, 3 seeds each), grpo with 2 seeds, ctpo with 1."""
    exp.mkdir(parents=True)
    kw = {"start_policy": start_policy, "scorings": True}
    entries = [write_run(exp, "gspo", s, 0.5 + 0.05 * s, **kw) for s in range(3)]
    entries += [write_run(exp, "gspo_token", s, 0.5 + 0.05 * s, like="gspo", **kw) for s in range(3)]
    entries += [write_run(exp, "grpo", s, 0.0547 + 0.0078 * s, **kw) for s in range(2)]
    entries += [write_run(exp, "ctpo", 0, 0.45, **kw)]
    (exp / "manifest.json").write_text(json.dumps({"experiment": exp.name, "runs": entries}))
    return exp


@pytest.mark.slow
def test_coinciding_objectives_and_intervals(tmp_path):
    """Identical curves are named; 2 seeds give a "range", 1 seed none; n beside every interval; 3 significant
    digits in every cell; scoring variants next to eval_accuracy."""
    exp = write_objectives(tmp_path / "objs", {"key": "3f2a9c", "steps": 1150, "accuracy": 0.36,
                                               "eval_accuracy": 0.34})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = build_report(exp, formats=("png",))
    text = md.read_text()
    assert ("- gspo and gspo_token coincide on every logged step of every drawn metric both report (15 metrics: "
            "`eval_accuracy`, `accuracy`, `reward_mean`, `clip_frac`,") in text
    assert ("constant (to round-off: a spread of at most 1e-6 of their size) at every logged step of every run: "
            "`frac_zero_std_groups` (0.5 throughout), `grad_norm` (0.5 throughout).") in text  # not drawn
    assert "- ctpo and grpo coincide on every logged step of `reward_mean`," in text  # ctpo logs grpo's metrics
    assert "gspo and grpo" not in text and "grpo and gspo coincide on every logged step of `eval_accuracy`" not in text
    headline = text[text.index("## Start and end accuracy"):text.index("## Figures")]
    # every objective starts alike: said once, the start's columns left out; never a zero-width interval
    assert "Every objective starts at 0.100 at step 0 (95% CI [0.0402, 0.160], 3 seeds: indicative;" in headline
    assert "| objective | end mean | end interval | end n | collapsed |" in headline
    # grpo's accuracies are no multiple of 1/100: its scores do not match, so over seeds only
    assert "| grpo | 0.0586 | range [0.0547, 0.0625] (seeds only) | 2 |" in headline
    assert "| gspo | 0.550 | 95% CI [0.434, 0.666], 3 seeds: indicative | 3 |" in headline
    assert "| ctpo | 0.450 | n/a | 1 |" in headline
    assert "- key `3f2a9c`, warm-started 1,150 steps, check accuracy 0.360, eval accuracy 0.340 (all runs)." in headline
    table = (md.parent / "eval_accuracy.md").read_text()
    assert ("| final mean | final interval | final IQM | final, flexible scoring mean | final, flexible scoring "
            "interval | final, strict scoring mean | final, strict scoring interval | best mean |") in table
    assert ("| grpo | 2 | 0.0586 | range [0.0547, 0.0625] (seeds only) | n/a | 0.109 | range [0.105, 0.113] (seeds "
            "only) | 0.00860 |") in table
    assert "strict scoring (`eval_accuracy_strict`)" in text
    assert plots.seeds_label("grpo", 2) == "grpo (n=2, range)"
    assert plots.seeds_label("gspo", 3) == "gspo (n=3, 95% CI)" and plots.seeds_label("ctpo", 1).endswith("interval)")


@pytest.mark.parametrize("policy, line", [
    ("absent", "not recorded (all runs: summary.json has no `start_policy`, runs written before the field)."),
    (None, "no warm start: the runs start from the base model (all runs).")])
@pytest.mark.slow
def test_headline_without_start_policy(tmp_path, policy, line):
    runs = load_experiment(write_objectives(tmp_path / "objs", policy)).runs
    assert report_module.start_policy_lines(runs) == [line]


def test_headline_with_mixed_start_policies(tmp_path):
    exp = write_objectives(tmp_path / "objs", {"key": "k1", "steps": 10, "accuracy": 0.5})
    summary = exp / "grpo-s0-abcd1234" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "start_policy": None}))
    assert report_module.start_policy_lines(load_experiment(exp).runs) == [
        "key `k1`, warm-started 10 steps, check accuracy 0.500, eval accuracy n/a (ctpo (1 run), grpo (1 run), "
        "gspo (3 runs), gspo_token (3 runs)).",
        "no warm start: the runs start from the base model (grpo (1 run))."]


@pytest.mark.slow
def test_one_key_built_on_two_cpus_is_two_starting_policies(tmp_path):
    """The cache key names what a starting policy is built from; built apart on two CPUs it can differ. Runs that
    recorded other weights under one key are two starting policies: two lines, and never pooled as one."""
    exp = write_objectives(tmp_path / "objs", {"key": "k1", "steps": 10, "accuracy": 0.5,
                                               "weights_sha256": "aaaabbbbccccdddd", "cpu": "CPU A"})
    summary = exp / "grpo-s0-abcd1234" / "summary.json"
    other = {"key": "k1", "steps": 12, "accuracy": 0.4, "weights_sha256": "eeeeffff00001111", "cpu": "CPU B"}
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "start_policy": other}))
    built_apart = r"starting policies built apart: key `k1` has 2 sets of weights in these runs \(8 runs from `k1/aaaa"
    with pytest.warns(AnalysisWarning, match=built_apart + r"bbbb`, 1 run from `k1/eeeeffff`; another CPU"):
        loaded = load_experiment(exp)
    runs = loaded.runs
    assert not loaded.cells.duplicates and len(loaded.cells.mixed_policies) == 1
    status = report_module.status_lines(loaded, report_module.eval_table(runs), [])
    assert ("1 starting policy with other weights in some runs (one warm-start key, or one cell without a warm start, "
            "and one model.seed): the runs of one set of weights counted (see Data warnings).") in status
    grpo = runs[runs["objective"] == "grpo"].set_index("seed")
    assert grpo.loc[0, "start_policy"] == "k1/eeeeffff" and grpo.loc[1, "start_policy"] == "k1/aaaabbbb"
    assert runs["start_policy_steps"].dtype == float
    # the intervals take model.seed as the starting policy: only the runs of one of the two are counted
    assert not grpo.loc[0, "counted"] and runs.loc[runs["start_policy"] == "k1/aaaabbbb", "counted"].all()
    assert report_module.start_policy_lines(runs) == [
        "key `k1`, weights `aaaabbbb` (built on CPU A), warm-started 10 steps, check accuracy 0.500, eval accuracy "
        "n/a (ctpo (1 run), grpo (1 run), gspo (3 runs), gspo_token (3 runs)).",
        "key `k1`, weights `eeeeffff` (built on CPU B), warm-started 12 steps, check accuracy 0.400, eval accuracy "
        "n/a (grpo (1 run))."]


def test_runs_without_a_warm_start_from_other_weights_are_two_starting_policies(tmp_path):
    """Without a warm start a run starts from the model's own weights: a model folder whose weights were replaced
    between runs (the same model.name, the same settings) gave runs from two starting policies, pooled as seeds of
    one (the seventh hostile pass). summary.json's start_weights tells them apart: one set's runs are counted, the
    others named; runs of other cells (another model) are not compared."""
    exp = write_objectives(tmp_path / "objs", None)
    for summary in exp.glob("*/summary.json"):
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "start_weights": "aaaabbbbccccdddd"}))
    summary = exp / "grpo-s0-abcd1234" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "start_weights": "eeeeffff00001111"}))
    with pytest.warns(AnalysisWarning, match=r"starting weights differ: the runs without a warm start of cell `.*` "
                      r"start from 2 sets of weights \(8 runs from `none/aaaabbbb`, 1 run from `none/eeeeffff`: the "
                      r"model's files changed between runs\); only the runs from `none/aaaabbbb` are counted, not "
                      r"`grpo-s0-abcd1234`"):
        loaded = load_experiment(exp)
    runs = loaded.runs
    assert len(loaded.cells.mixed_policies) == 1 and not runs.set_index("run_id").loc["grpo-s0-abcd1234", "counted"]
    assert runs.loc[runs["start_policy"] == "none/aaaabbbb", "counted"].all()
    assert report_module.start_policy_lines(runs) == [
        "no warm start: the runs start from the base model, weights `aaaabbbb` (ctpo (1 run), grpo (1 run), gspo (3 "
        "runs), gspo_token (3 runs)).",
        "no warm start: the runs start from the base model, weights `eeeeffff` (grpo (1 run))."]


@pytest.mark.slow
def test_a_manifest_listing_a_run_twice_or_a_folder_elsewhere_reads_each_run_once(tmp_path):
    """manifest.json edited by hand: a run listed twice was two rows, each the other's duplicate, so counted zero
    times (the verdict changed); a ``dir`` of ``../..`` or an absolute path was read as a run of this experiment (the
    seventh hostile pass). Now each run once, and the entries outside the folder ignored, each said in a warning."""
    exp = write_objectives(tmp_path / "objs")
    manifest = json.loads((exp / "manifest.json").read_text())
    clean = load_experiment(exp).runs
    manifest["runs"] += [manifest["runs"][3], {**manifest["runs"][0], "dir": "../../../etc"},
                         {**manifest["runs"][1], "dir": str(exp / manifest["runs"][1]["dir"])}]
    (exp / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(AnalysisWarning) as caught:
        runs = load_experiment(exp).runs
    said = [str(w.message) for w in caught]
    assert any(f"lists {manifest['runs'][3]['dir']} more than once: each run is read once" in m for m in said), said
    assert any("lists ../../../etc, " in m and "not a folder of this experiment's: ignored" in m for m in said), said
    assert list(runs["run_id"]) == list(clean["run_id"]) and list(runs["counted"]) == list(clean["counted"])
    # a symbolic link to another experiment's run folder: reported as a run of this one, nothing saying so
    other = write_objectives(tmp_path / "other")
    (exp / "grpo-s7-linked").symlink_to(other / manifest["runs"][0]["dir"])
    with pytest.warns(AnalysisWarning) as caught:
        runs = load_experiment(exp).runs
    said = [str(w.message) for w in caught]
    assert any("grpo-s7-linked is a symbolic link to a run folder elsewhere: not read" in m for m in said), said
    assert "grpo-s7-linked" not in set(runs["run_id"])


def test_reward_equal_to_accuracy_is_one_panel(tmp_path):
    exp = write_experiment(tmp_path / "toy", {"grpo": {0: 0.5, 1: 0.6}}, extra=False)
    for run in exp.glob("grpo-*/metrics.jsonl"):
        rows = [json.loads(line) for line in run.read_text().splitlines()]
        run.write_text("".join(json.dumps({**r, "reward_mean": r["accuracy"]} if "accuracy" in r else r) + "\n"
                               for r in rows))
    made = plots.curves_figure(load_experiment(exp).metrics, "step", plots.styles(["grpo"]), 1, "t", False)
    assert [ax.get_title() for ax in made.fig.axes] == ["Eval accuracy (greedy, held-out)", "Train accuracy (sampled)"]
    assert any(note.startswith("Train reward equals train accuracy") for note in made.notes)
    plt.close(made.fig)


def test_clip_fraction_zero_is_stated_not_drawn(tmp_path):
    metrics = pd.DataFrame({"run_id": ["a", "a", "b", "b"], "objective": ["grpo", "grpo", "gspo", "gspo"],
                            "step": [1, 2, 1, 2], "clip_frac": [0.0, 0.0, 0.1, 0.2]})
    runs = pd.DataFrame({"run_id": ["a", "b"], "complete": [True, True]})
    made = plots.clip_figure(metrics, runs, plots.styles(["grpo", "gspo"]), "t", False)
    ax = made.fig.axes[0]
    assert ax.get_yscale() == "log" and not ax.patches  # points, no bars
    drawn = np.concatenate([line.get_ydata() for line in ax.lines if len(line.get_ydata())])
    assert 0 not in drawn and min(drawn) == pytest.approx(0.0013)  # the paper's grpo value is the lowest point
    assert any(n.startswith("grpo: measured 0.00 (n=1); clip fraction 0 (no token clipped at any logged step) in 1 of "
                            "1 runs: not drawn on the log axis") for n in made.notes)
    labels = [t.get_text() for t in made.fig.legends[0].get_texts()]
    assert labels == ["this run (measured)", "one seed (measured)", "paper (reported)"]
    plt.close(made.fig)


@pytest.mark.slow
def test_report_is_replaced_atomically(tmp_path, monkeypatch, capsys):
    """A failure midway leaves the previous report as it was, and no temporary folder; a folder that is not a
    report is never replaced. The first report is written by the CLI (cli_prints_warnings checks what it prints)."""
    exp = write_experiment(tmp_path / "toy", {"grpo": {0: 0.5}}, extra=False)
    with open(exp / "grpo-s0-abcd1234" / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "reward_me')  # a last line cut short: warned
    out = cli_prints_warnings(exp, exp / "report", capsys)  # where build_report writes it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        monkeypatch.setattr(report_module, "figures", lambda *a: (_ for _ in ()).throw(RuntimeError("killed")))
        with pytest.raises(RuntimeError, match="killed"):  # after the tables are written, before the figures
            build_report(exp, formats=("png", "pdf"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in exp.iterdir() if p.name.startswith(".")) == []  # no temporary folder left
    (exp / "notes").mkdir()
    (exp / "notes" / "mine.txt").write_text("x")
    with pytest.raises(AnalysisError, match="holds no report.md: refusing to write into it"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the truncated line, warned by the CLI above
        build_report(exp, out=exp / "notes")
    assert (exp / "notes" / "mine.txt").exists()


def test_the_verdict_names_settings_beyond_the_objective_that_differ_in_a_cell():
    """grpo at lr 5e-5 and gspo at 3e-4 in one folder were compared in one cell, only the configuration section
    saying so, far below the verdict (the seventh hostile pass); now a line under the verdict names them."""
    from types import SimpleNamespace

    cells = SimpleNamespace(objective_settings={"train.lr": {"grpo": "5e-05", "gspo": "0.0003"},
                                                "objective.params.clip_high": {"grpo": "0.2", "gspo": "0.0004"}})
    assert report_module.beyond_objective_blocks(cells) == [("p", (
        "The objectives compared differ in more than the objective: train.lr (grpo=5e-05, gspo=0.0003). A difference "
        "in the verdict may come from these settings as well."))]
    assert report_module.beyond_objective_blocks(SimpleNamespace(objective_settings={})) == []


@pytest.mark.slow
def test_report_lists_problems(report):
    md_path, caught = report
    md = md_path.read_text()
    # summary.json (or the manifest) says running, but no process holds the run's lock: killed
    assert "`grpo-s3-abcd1234` (grpo, seed 3): stopped at step 4/6 (killed; run the same command to resume)" in md
    assert ("`gspo-s3-abcd1234` (gspo, seed 3): stopped at step 2/6 (killed; run the same command to resume); no "
            "summary.json") in md
    assert "| grpo-s3-abcd1234 | grpo | 3 | stopped | 4/6 |" in md and "| running |" not in md
    assert "`grpo-s4-abcd1234` (grpo, seed 4): status pending; not started (no folder grpo-s4-abcd1234/)" in md
    assert "`kl_ref` is not reported by: gspo." in md
    assert "objective.params.beta: per objective: grpo=0.01, gspo=0.0 (its own)" in md
    assert "differ in more than the objective" not in md  # beta is each objective's own hyperparameter
    assert "steps: 6" in md and "group size: 4" in md
    assert any("gspo-s3-abcd1234/metrics.jsonl: skipped truncated last line 4" in w for w in caught)
    assert "skipped truncated last line" in md  # listed under data warnings


def test_truncated_line_skipped_with_warning(tmp_path):
    exp = write_experiment(tmp_path / "toy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_experiment(exp)
    messages = [str(w.message) for w in caught if w.category is AnalysisWarning]
    metrics = exp / "gspo-s3-abcd1234" / "metrics.jsonl"
    assert (f"{metrics}: skipped truncated last line 4 (step 99 lost: the write was cut short, e.g. by a kill or a "
            "full disk)") in messages
    assert f"{metrics.with_name('summary.json')}: missing" in messages
    assert list(loaded.metrics.loc[loaded.metrics["run_id"] == "gspo-s3-abcd1234", "step"]) == [0, 1, 2]
    # a pending run whose folder the sweep has made (its config.yaml written; it has not started): nothing "missing"
    (exp / "grpo-s4-abcd1234").mkdir()
    shutil.copy(exp / "gspo-s3-abcd1234" / "config.yaml", exp / "grpo-s4-abcd1234")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_experiment(exp)
    assert not [w for w in caught if "grpo-s4-abcd1234" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.slow
def test_deterministic_output(tmp_path, report):
    exp = write_experiment(tmp_path / "toy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = build_report(exp, smooth=2, formats=("png", "pdf", "svg"))
    first = report[0].parent
    names = sorted(p.name for p in first.iterdir() if p.suffix in (".csv", ".png", ".pdf", ".svg"))
    assert names == sorted(p.name for p in md.parent.iterdir() if p.suffix in (".csv", ".png", ".pdf", ".svg"))
    for name in names:
        assert (md.parent / name).read_bytes() == (first / name).read_bytes(), name
    assert md.read_text().replace(str(exp), "X") == report[0].read_text().replace(str(first.parent), "X")


@pytest.mark.slow
def test_run_without_metrics(tmp_path):
    exp = write_experiment(tmp_path / "toy", {"grpo": {0: 0.5}}, extra=False)
    (exp / "grpo-s0-abcd1234" / "metrics.jsonl").write_text("")
    with pytest.warns(AnalysisWarning, match="metrics.jsonl: no metrics"):
        md = build_report(exp, formats=("png",))
    text = md.read_text()
    assert "No run has logged metrics yet" in text and not (md.parent / "curves_step.png").exists()
    assert (md.parent / "final_eval.png").exists()  # from summary.json


@pytest.mark.slow
def test_missing_or_empty_results_dir(tmp_path, capsys):
    with pytest.raises(AnalysisError, match="does not exist"):
        load_experiment(tmp_path / "nope")
    with pytest.raises(TypeError, match=r"^load_experiment takes one results folder \(a str or Path\), got list; "
                       r"several: load_experiments"):  # pathlib's TypeError six frames deep
        load_experiment([tmp_path / "nope"])
    with pytest.raises(AnalysisError, match=r"^results folder '' is empty: give an experiment's results folder"):
        load_experiment("")  # it read the current folder
    assert pytest.raises(SystemExit, main, [""]).value.code == 2  # the command's parser: one line
    assert "error: python -m analysis: results folder '' is empty" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(AnalysisError, match="no runs in"):
        load_experiment(tmp_path / "empty")
    assert main([str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no runs in")
    (tmp_path / "lab" / "batches").mkdir(parents=True)  # a gradient lab's folder: its report is the lab's
    (tmp_path / "lab" / "config.yaml").write_text("name: lab\n")
    with pytest.raises(AnalysisError, match="it holds a gradient lab's batches, whose report the lab writes itself"):
        load_experiment(tmp_path / "lab")
    write_experiment(tmp_path / "results" / "toy", {"grpo": {0: 0.5}}, extra=False)  # a results_dir given: named
    with pytest.raises(AnalysisError, match=rf"it holds the experiment folder toy: give {tmp_path / 'results/toy'}$"):
        load_experiment(tmp_path / "results")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "analysis", str(tmp_path / "nope")],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 1 and said == [
        f"error: results folder {tmp_path / 'nope'} does not exist: give an experiment's results folder "
        "(results/<experiment>, the one holding manifest.json)"]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
    assert not imported & {"pandas", "matplotlib", "torch"}, imported  # said before the seconds of the imports
    (tmp_path / "report.md").write_text("")  # a file given for the folder: named as such, not as missing
    with pytest.raises(AnalysisError, match=r"report\.md is not a folder: give an experiment's results folder"):
        load_experiment(tmp_path / "report.md")


@pytest.mark.parametrize("out", ["file", "file/report"])
def test_an_out_folder_that_cannot_be_made_is_one_line(tmp_path, capsys, out):
    """--out at or under a file: one line naming it before anything is read or written, not FileExistsError."""
    exp = write_experiment(tmp_path / "toy")
    (tmp_path / "file").write_text("mine")
    assert main([str(exp), "--out", str(tmp_path / out), "--formats", "png"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: cannot make report folder {tmp_path / out}: {tmp_path / 'file'} is a file, not a "
                       "folder; choose another --out"), err
    assert (tmp_path / "file").read_text() == "mine" and not (exp / "report").exists()


def cli_prints_warnings(exp: Path, out: Path, capsys) -> Path:
    """`python -m analysis` prints the data warnings and writes only the formats asked for; returns the report
    folder (a report the CLI writes anyway in test_report_is_replaced_atomically)."""
    assert main([str(exp), "--out", str(out), "--formats", "png"]) == 0
    captured = capsys.readouterr()
    assert "warning: " in captured.err and "skipped truncated last line" in captured.err
    assert (out / "report.html").exists() and (out / "stability.png").exists()
    assert not (out / "stability.pdf").exists()
    return out


def test_an_moe_runs_routing_metrics_are_panels_of_the_stability_figure():
    rows = [{"objective": "grpo", "run_id": "a", "seed": 0, "step": step, "clip_frac": 0.1,
             "expert_changed_frac": 0.01 * step, "router_aux_loss": 1.0} for step in (1, 2, 3)]
    metrics = pd.DataFrame(rows)
    made = plots.stability_figure(metrics, plots.styles(metrics["objective"]), 1, "t", paper=False)
    titles = {ax.get_title() for ax in made.fig.axes}
    assert {"Expert volatility", "Router load-balancing loss"} <= titles
    assert not any("expert_token_changed_frac" in note for note in made.notes)  # unreported routing: no note
    dense = plots.stability_figure(metrics.drop(columns=["expert_changed_frac", "router_aux_loss"]),
                                   plots.styles(metrics["objective"]), 1, "t", paper=False)
    assert "Expert volatility" not in {ax.get_title() for ax in dense.fig.axes}


def test_a_lagged_runs_staleness_metrics_are_panels_of_the_stability_figure():
    rows = [{"objective": "grpo", "run_id": "a", "seed": 0, "step": step, "clip_frac": 0.1, "lag_mean": 2.0,
             "mismatch_kl": 0.01 * step, "mismatch_ess": 0.9, "m2po_dropped_frac": 0.3} for step in (1, 2, 3)]
    metrics = pd.DataFrame(rows)
    made = plots.stability_figure(metrics, plots.styles(metrics["objective"]), 1, "t", paper=False)
    titles = {ax.get_title() for ax in made.fig.axes}
    assert {"Policy lag", "KL(behaviour || proximal)", "Importance-weight ESS", "Masked by M2PO"} <= titles
    assert not any("rollout_corr" in note or "lag_mean" in note for note in made.notes)  # unreported: no note
    synchronous = plots.stability_figure(metrics.drop(columns=["lag_mean", "mismatch_ess"]),
                                         plots.styles(metrics["objective"]), 1, "t", paper=False)
    assert "Policy lag" not in {ax.get_title() for ax in synchronous.fig.axes}


def test_an_empty_out_is_one_line_not_the_default_folder(capsys):
    """--out "" wrote the report into the default folder without a word (the twenty-second hostile pass); argparse's
    own errors here are one line, as the harness's are."""
    assert pytest.raises(SystemExit, main, ["results/none", "--out", ""]).value.code == 2
    assert capsys.readouterr().err == ('error: python -m analysis: --out is empty: give a folder, or leave --out out '
                                       'for <results>/report (`python -m analysis -h` lists the options)\n')


def test_the_runs_table_says_no_for_every_run_left_out_of_the_numbers(tmp_path):
    """The runs table's `counted` column said "yes" of a run that failed midway (or whose config.yaml was edited)
    though no number counts it, and "no: seed unknown" of a run left out as another starting policy's weights."""
    from tests.helpers.fake_runs import Shape, fake_experiment, fake_run

    exp = tmp_path / "quickstart"
    entries = [fake_run(exp, "grpo", s, final=0.4) for s in range(3)]
    entries += [fake_run(exp, "gspo", 0, final=0.4), fake_run(exp, "gspo", 2, final=0.4),
                fake_run(exp, "gspo", 1, status="failed", shape=Shape(steps_done=2),
                         summary_extra={"error": "RuntimeError: boom"})]
    summary = exp / entries[3]["dir"] / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "settings_digest": "0" * 16}))  # as if edited
    start = {"key": "k1", "weights_sha256": "aaaabbbbcccc"}
    for entry in entries[:2]:
        path = exp / entry["dir"] / "summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "start_policy": start}))
    path = exp / entries[2]["dir"] / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "start_policy": {**start, "weights_sha256": "ffff"}}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AnalysisWarning)
        loaded = load_experiment(fake_experiment(exp, entries))
    shown = report_module.runs_display(loaded.runs).set_index("run_id")["counted"]
    used = loaded.runs.set_index("run_id")
    used = used["counted"] & used["ended"]
    assert [shown[r] == "yes" for r in shown.index] == list(used[shown.index])  # "yes" exactly where it is counted
    assert shown[entries[5]["run_id"]] == "no: failed"
    assert shown[entries[3]["run_id"]].startswith("no: its records are incomplete or edited")
    assert shown[entries[2]["run_id"]].startswith("no: another starting policy's weights")
