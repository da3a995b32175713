"""analysis: a synthetic results folder (written to tmp_path) -> report; numbers checked by hand."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.stats

from analysis import AnalysisError, AnalysisWarning, build_report, load_experiment
from analysis.__main__ import main
from analysis.report import FIGURES, eval_table
from analysis.stats import bootstrap_ci, describe

STEPS = 6
OFFSET = {"grpo": 0.0, "gspo": 0.1}
# final eval accuracy of the finished runs, by objective and seed
FINAL = {"grpo": {0: 0.40, 1: 0.50, 2: 0.75}, "gspo": {0: 0.55, 1: 0.60, 2: 0.80}}


def write_run(exp: Path, objective: str, seed: int, final: float, steps_done: int = STEPS,
              status: str = "finished", summary: bool = True, truncate: bool = False) -> dict:
    """One run folder as the training loop writes it. eval every 3 steps; gspo reports no kl_ref (beta = 0)."""
    run_id = f"{objective}-s{seed}-abcd1234"
    run_dir = exp / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        f"name: {exp.name}\nseed: {seed}\nmodel:\n  name: tiny\ntask:\n  name: arith\nobjective:\n  name: {objective}\n"
        f"  params:\n    beta: {0.01 if objective == 'grpo' else 0.0}\ntrain:\n  steps: {STEPS}\n  group_size: 4\n"
        f"  prompts_per_step: 2\n  lr: 1.0e-05\n")
    rows = [{"step": 0, "eval_accuracy": 0.1}]
    for step in range(1, steps_done + 1):
        row = {"step": step, "rollout_tokens": step * (100 + 10 * seed),
               "reward_mean": 0.1 * step + OFFSET.get(objective, 0.0), "accuracy": 0.05 * step + 0.01 * seed,
               "clip_frac": 0.002 * (seed + 1) * (10 if objective == "gspo" else 1), "ratio_std": 0.01 * step,
               "ratio_max": 1 + 0.01 * step, "kl_behavior": 1e-3 * step, "entropy": 1.0 - 0.05 * step,
               "grad_norm": 0.5, "completion_len_mean": 20.0 + step, "frac_zero_std_groups": 0.5,
               "eval_accuracy": None}
        if objective == "grpo":
            row["kl_ref"] = 1e-3 * step
        if step % 3 == 0:
            row["eval_accuracy"] = final if step == STEPS else 0.1 + 0.01 * step
        rows.append(row)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / "metrics.jsonl").write_text(text + ('{"step": 99, "reward_me' if truncate else ""))
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({
            "run_id": run_id, "objective": objective, "seed": seed, "status": status, "steps_done": steps_done,
            "total_steps": STEPS, "final_eval_accuracy": final if steps_done == STEPS else 0.13,
            "best_eval_accuracy": max(final, 0.13) if steps_done == STEPS else 0.13, "wall_time_s": 100.0 + seed,
            "rollout_tokens": steps_done * 100, "update_tokens": steps_done * 100, "error": None}))
    return {"run_id": run_id, "objective": objective, "seed": seed, "overrides": {}, "status": status, "dir": run_id}


def write_experiment(exp: Path, finals: dict = FINAL, extra: bool = True) -> Path:
    """finals -> finished runs; extra: an unfinished run (4/6 steps), a killed run with no summary and a truncated
    last line, and a pending run that never started."""
    exp.mkdir(parents=True)
    entries = [write_run(exp, o, s, f) for o, seeds in finals.items() for s, f in seeds.items()]
    if extra:
        entries.append(write_run(exp, "grpo", 3, 0.0, steps_done=4, status="running"))
        entries.append(write_run(exp, "gspo", 3, 0.0, steps_done=2, status="running", summary=False, truncate=True))
        entries.append({"run_id": "grpo-s4-abcd1234", "objective": "grpo", "seed": 4, "overrides": {},
                        "status": "pending", "dir": "grpo-s4-abcd1234"})
    (exp / "manifest.json").write_text(json.dumps({"experiment": exp.name, "runs": entries}))
    return exp


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


def test_iqm_with_six_seeds(tmp_path):
    finals = {"grpo": dict(enumerate([0.9, 0.1, 0.5, 0.2, 0.4, 0.3]))}
    table = eval_table(load_experiment(write_experiment(tmp_path / "six", finals, extra=False)).runs)
    table = table.set_index("objective")
    # middle 50% of 0.1 0.2 0.3 0.4 0.5 0.9 (one cut from each end): 0.2 0.3 0.4 0.5
    assert table.loc["grpo", "final_iqm"] == pytest.approx(0.35)
    assert table.loc["grpo", "final_mean"] == pytest.approx(0.4)
    assert table.loc["grpo", "seeds"] == 6


def test_table_numbers(report):
    out = report[0].parent
    table = pd.read_csv(out / "eval_accuracy.csv").set_index("objective")
    for objective, seeds in FINAL.items():
        x = np.array(list(seeds.values()))
        row = table.loc[objective]
        assert row["seeds"] == 3 and row["unfinished_runs"] == (2 if objective == "grpo" else 1)
        assert row["final_mean"] == pytest.approx(x.mean())
        assert (row["final_ci_low"], row["final_ci_high"]) == pytest.approx((x.min(), x.max()))
        assert np.isnan(row["final_iqm"])  # fewer than 5 seeds
        assert row["best_mean"] == pytest.approx(np.maximum(x, 0.13).mean())
        assert row["wall_time_s"] == pytest.approx(101.0)  # 100 + seed, seeds 0..2
        assert row["rollout_tokens"] == pytest.approx(600)
    md = (out / "eval_accuracy.md").read_text()
    assert "| grpo | 3 | 0.55 | [0.4, 0.75] | n/a |" in md
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == 9 and runs["complete"].sum() == 6


def test_figures_written(report):
    out = report[0].parent
    for stem in FIGURES:
        for fmt in ("png", "pdf", "svg"):
            assert (out / f"{stem}.{fmt}").stat().st_size > 1000, f"{stem}.{fmt}"
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(FIGURES)


def test_report_lists_problems(report):
    md_path, caught = report
    md = md_path.read_text()
    assert "`grpo-s3-abcd1234` (grpo, seed 3): status running; 4/6 steps" in md
    assert "`gspo-s3-abcd1234` (gspo, seed 3): status running; no summary.json; 2/6 steps" in md
    assert "`grpo-s4-abcd1234` (grpo, seed 4): status pending; not started (no folder grpo-s4-abcd1234/)" in md
    assert "`kl_ref` is not reported by: gspo." in md
    assert "objective.params.beta: per objective: grpo=0.01, gspo=0.0" in md
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
    assert f"{metrics}: skipped truncated last line 4" in messages
    assert f"{metrics.with_name('summary.json')}: missing" in messages
    assert list(loaded.metrics.loc[loaded.metrics["run_id"] == "gspo-s3-abcd1234", "step"]) == [0, 1, 2]


def test_deterministic_output(tmp_path, report):
    exp = write_experiment(tmp_path / "toy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = build_report(exp, smooth=2, formats=("png", "pdf", "svg"))
    first = report[0].parent
    for name in ["eval_accuracy.csv"] + [f"{s}.{f}" for s in FIGURES for f in ("png", "pdf", "svg")]:
        assert (md.parent / name).read_bytes() == (first / name).read_bytes(), name
    assert md.read_text().replace(str(exp), "X") == report[0].read_text().replace(str(first.parent), "X")


def test_run_without_metrics(tmp_path):
    exp = write_experiment(tmp_path / "toy", {"grpo": {0: 0.5}}, extra=False)
    (exp / "grpo-s0-abcd1234" / "metrics.jsonl").write_text("")
    with pytest.warns(AnalysisWarning, match="metrics.jsonl: no metrics"):
        md = build_report(exp, formats=("png",))
    text = md.read_text()
    assert "No run has logged metrics yet" in text and not (md.parent / "curves_step.png").exists()
    assert (md.parent / "final_eval.png").exists()  # from summary.json


def test_missing_or_empty_results_dir(tmp_path, capsys):
    with pytest.raises(AnalysisError, match="does not exist"):
        load_experiment(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AnalysisError, match="no runs in"):
        load_experiment(tmp_path / "empty")
    assert main([str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no runs in")
    proc = subprocess.run([sys.executable, "-m", "analysis", str(tmp_path / "nope")], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 1 and proc.stderr.strip() == f"error: results folder {tmp_path / 'nope'} does not exist"


def test_cli_prints_warnings(tmp_path, capsys):
    exp = write_experiment(tmp_path / "toy")
    assert main([str(exp), "--out", str(tmp_path / "out"), "--formats", "png"]) == 0
    captured = capsys.readouterr()
    assert "warning: " in captured.err and "skipped truncated last line" in captured.err
    assert (tmp_path / "out" / "report.html").exists() and not (tmp_path / "out" / "stability.pdf").exists()
