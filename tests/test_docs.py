"""make docs' pages: which pages each flag writes, and the MoE page's claims checked on its own runs."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from harness.apps import claims, docs, stamp
from harness.run import names
from harness.run.config import load_experiment, run_configs, run_id
from tests.helpers.fake_runs import fake_experiment, fake_run, grid_experiment
from tests.helpers.processes import MAKE_ALONE, ROOT


def test_a_page_says_which_starting_policies_its_runs_built_into_the_cache(tmp_path, monkeypatch):
    """A page said only the cache's path, not whether its runs' starting policies were built by the command (its wall
    times include the builds) or loaded: now the builds made since its own runs began, from the cache's sidecars (not
    those an earlier page of the same command made), and none where they built none."""
    monkeypatch.setattr(docs, "DOCS", tmp_path)
    monkeypatch.setattr(names, "DOCS", {})
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    built = tmp_path / "cache" / "warm_start"
    built.mkdir(parents=True)
    (built / "old.json").write_text(json.dumps({"built_at": "2020-01-01T00:00:00+00:00"}))  # before the command
    clock = iter(datetime(2026, 1, 1, 0, 0, second, tzinfo=UTC) for second in (0, 1, 30))  # began, each page's start

    class Clock(datetime):
        @classmethod
        def now(cls, tz=None):
            return next(clock)

    def document(name, results_dir, jobs):  # gsm8k's sweep builds a starting policy and one misses its band
        if name == "gsm8k_ablation":
            for key in ("new.json", "miss.missed.json"):
                (built / key).write_text(json.dumps({"built_at": "2026-01-01T00:00:10+00:00"}))
        return f"## {name}\n"

    monkeypatch.setattr(docs, "datetime", Clock)
    monkeypatch.setattr(docs, "document", document)
    monkeypatch.setattr(docs, "claims_section", lambda *a: "")
    assert docs.main(with_gsm8k=True, with_moe=True, skip_main=True, jobs=1) == 0
    assert (f"Cache: {tmp_path / 'cache'}; this page's runs built 2 starting policies into it (1 of them missed their "
            "band); any other a run used was loaded from it.\n") in (tmp_path / "results_gsm8k.md").read_text()
    moe = (tmp_path / "results_moe.md").read_text()  # built by the page before: not this page's runs'
    assert "this page's runs built no starting policy into it.\n" in moe and "2026-01-01 00:00 UTC" in moe


@pytest.mark.slow
def test_with_moe_and_skip_main_write_only_the_moe_page_with_its_claims(tmp_path, monkeypatch):
    monkeypatch.setattr(docs, "DOCS", tmp_path)
    monkeypatch.setattr(names, "DOCS", {})  # the generated tables: tests/test_names.py
    documented, sources = [], []
    monkeypatch.setattr(docs, "document", lambda name, results_dir, jobs: documented.append(name) or f"## {name}\n")
    monkeypatch.setattr(docs, "main_page", lambda *a: documented.append("results.md"))
    landing = []  # the claims' starting policies: the first candidates that land (none missed here)
    monkeypatch.setattr(claims, "first_landing", lambda runs_for, candidates, wanted, folder, *a: landing.append(
        folder) or {"landed": list(candidates[:wanted]), "missed": {}})

    def run_source(kind, name, overrides, start_seeds, seeds, jobs, progress):  # under the docs' folder
        sources.append((kind, name, overrides[-1], start_seeds))
        seeds = [0, 1, 2]
        if kind == "probe":  # 8 layers: 8-10% of assignments change, 2 layers fewer
            rows = [{"objective": "grpo", "seed": s, "layers": d, "expert_changed_frac": 0.01 * d}
                    for s in seeds for d in (2, 8)]
            return {"probe": pd.DataFrame(rows)}
        if kind == "lab":
            points = (("grpo", "staleness", "8", 1.3), ("grpo", "routing", "r2", 0.8), ("gspo", "staleness", "8", 0.07),
                      ("gspo", "routing", "r2", 0.068))  # the live routing adds less to gspo's spread than to grpo's
            rows = [{"objective": o, "axis": axis, "point": point, "staleness": 8, "batch": b, "ratio_std": v + b / 100}
                    for b in seeds for o, axis, point, v in points]
            return {"lab": pd.DataFrame(rows)}
        rows = [{"objective": o, "seed": s, "step": step, "cell": f"train.routing_replay={cell}", "eval_accuracy": v,
                 "expert_changed_frac": 0.01}
                for s in seeds for step in (15, 30) for o, cell, v in (("grpo", "none", 0.05 + s / 100),
                                                                       ("grpo", "r2", 0.2 + s / 100),
                                                                       ("grpo", "r3", 0.2 + s / 100),
                                                                       ("gspo", "none", 0.25 + s / 100))]
        return {"runs": pd.DataFrame(rows), "final": pd.DataFrame()}

    monkeypatch.setattr(docs, "run_source", run_source)
    assert docs.main(with_moe=True, skip_main=True, jobs=1) == 0
    assert documented == ["moe_stability"]  # not the main page
    assert not (tmp_path / "results.md").exists()
    page = (tmp_path / "results_moe.md").read_text()
    assert "## moe_stability" in page and "moe_routing_replay" in page and "moe_ratio_spread" in page
    # every check holds on these made-up runs, from one starting policy x 3 seeds: short of the confirmation design
    assert page.count("| indicative | 1 starting policy x 3 ") == 3
    assert {s[1] for s in sources} == {"moe_stability", "lab_moe", "moe_update"}
    assert all(s[2].startswith("results_dir=") and "docs" in s[2] for s in sources)  # the page's own runs
    five = (2, 3, 4, 5, 6)
    assert {s[1]: s[3] for s in sources} == {"moe_stability": five, "lab_moe": five, "moe_update": ()}
    assert len(landing) == 2 and all("docs" in str(folder) for folder in landing)  # built under the page's folder


@pytest.mark.slow
def test_the_mechanics_and_time_tables_are_per_cell_never_pooled(tmp_path):
    """Two values of a swept key are two rows per objective, each with its own seeds (not one row of 6 'seeds')."""
    exp = grid_experiment(tmp_path / "moe", {"train.routing_replay": ["none", "r2"]}, objectives=("grpo",),
                          seeds=(0, 1, 2))
    for table in (docs.mechanics_table(exp), docs.time_table(exp)):
        rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
        assert len(rows) == 2 and all("train.routing_replay=" in row for row in rows), table
    mechanics = docs.mechanics_table(exp)
    assert "| 3 |" in mechanics and "| 6 |" not in mechanics


@pytest.mark.slow  # three reports with their figures
def test_a_docs_sweep_resumed_or_found_ended_says_whose_wall_time_it_states(tmp_path, monkeypatch):
    """`make docs` after an interrupted one at the same commit resumes: its wall time covers only the runs left, and
    the page says how many had ended before (else it would credit the resumed runs to that wall time). Run again
    once every run has ended (`make docs WITH_SMOLLM2=1` after `WITH_SMOLLM2=rl`), the page states the time of the
    command that ran them, not the seconds of finding them ended."""
    results, overrides = tmp_path / "results", [f"results_dir={tmp_path / 'results'}"]
    runs = run_configs(load_experiment("quickstart", overrides))

    def finished(some):  # the runs as the sweep leaves them, under their own ids
        fake_experiment(results / "quickstart", [fake_run(results / "quickstart", run.objective.name, run.seed,
                                                          run_id=run_id(run)) for run in some])

    monkeypatch.setattr(docs, "DOCS", tmp_path)
    entries = [{"status": "finished"}] * len(runs)
    finished(runs[:2])  # before the command
    monkeypatch.setattr(docs, "run_sweep", lambda cfg, jobs: entries)
    section = docs.document("quickstart", results, 2)
    assert f"{len(runs)}/{len(runs)} runs finished in" in section
    assert ". 2 of them had ended before this command" in section
    shutil.rmtree(results / "quickstart")
    clock = iter([0.0, 1500.0, 1600.0, 1601.0])
    monkeypatch.setattr(stamp, "time", SimpleNamespace(perf_counter=lambda: next(clock)))  # the timing's clock
    monkeypatch.setattr(docs, "run_sweep", lambda cfg, jobs: finished(runs) or entries)  # all, run by this command
    first = docs.document("quickstart", results, 2)
    assert "runs finished in 25.0 min" in first and "had ended before" not in first
    monkeypatch.setattr(docs, "run_sweep", lambda cfg, jobs: entries)
    again = docs.document("quickstart", results, 2)  # every run ended: the first command's time, said so
    assert "runs finished in 25.0 min" in again and "found every run ended" in again
    assert "found every run ended" not in first


def write_scores(run_dir, scores_by_step: dict[int, list[float]]) -> None:
    """eval_samples.jsonl as the loop writes it: one line per evaluation and eval problem."""
    lines = [{"step": step, "problem": i, "answer": "1", "correct": c, "format": 1.0, "truncated": False,
              "completion": "#### 1"} for step, scores in scores_by_step.items() for i, c in enumerate(scores)]
    (run_dir / "eval_samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.slow
def test_the_gain_over_the_start_is_paired_by_seed_and_problem_with_the_accuracy_interval(tmp_path):
    """Every run starts at 8 of 40 problems; grpo solves 10 + seed more at its end (yes), gspo the same ones (cannot
    tell), ctpo 4 + seed fewer (no); the gain is the last evaluation's minus step 0's, whatever lies between."""
    start = [1.0] * 8 + [0.0] * 32
    end = {"grpo": lambda s: [1.0] * (18 + s) + [0.0] * (22 - s), "gspo": lambda s: start,
           "ctpo": lambda s: [0.0] * (4 + s) + start[4 + s:]}
    exp = grid_experiment(tmp_path / "smol", {}, objectives=tuple(end), seeds=(0, 1, 2),
                          effect=lambda o, point, s: sum(end[o](s)) / 40)
    for run in exp.glob("*/summary.json"):
        objective, seed = run.parent.name.split("-")[0], int(run.parent.name.split("-s")[1][0])
        write_scores(run.parent, {0: start, 3: [0.5] * 40, 6: end[objective](seed)})
    rows = {line.split("|")[2].strip(): line for line in docs.gain_table(exp).splitlines()[2:]}
    assert "| 0.200 | 0.475 | 0.275 [" in rows["grpo"] and rows["grpo"].endswith("| yes |")
    assert "| 0.00 " in rows["gspo"] and rows["gspo"].endswith("| cannot tell |")
    assert "| -0.125 [" in rows["ctpo"] and rows["ctpo"].endswith("| no |")
    assert all("| 3 |" in row and "over seeds only" not in row for row in rows.values())


def test_the_gain_falls_back_on_the_seeds_without_per_problem_scores(tmp_path):
    exp = grid_experiment(tmp_path / "smol", {}, objectives=("grpo",), seeds=(0, 1, 2))
    (row,) = docs.gain_table(exp).splitlines()[2:]
    assert "over seeds only" in row and row.endswith("| yes |")  # 0.2 -> 0.40, 0.41, 0.42


@pytest.mark.parametrize("tiny, smol, verdict", [
    ((0.03, 0.01, 0.06), (0.04, 0.02, 0.07), "holds"),
    ((0.03, 0.01, 0.06), (-0.04, -0.07, -0.02), "does not hold: SmolLM2 reverses it"),
    ((0.03, 0.01, 0.06), (0.04, -0.01, 0.07), "cannot be told apart on SmolLM2 at this budget"),
    ((0.03, 0.00, 0.06), (0.04, 0.02, 0.07), "no tiny-model difference; SmolLM2 separates them"),
    ((-0.01, -0.03, 0.02), (0.0, -0.01, 0.01), "neither separates them"),
])
def test_a_tiny_model_finding_holds_only_when_both_intervals_exclude_0_on_one_side(tiny, smol, verdict):
    assert docs.transfer_verdict(tiny, smol) == verdict


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["both", "rl"])
def test_with_smollm2_writes_its_page_with_the_transfer_table_from_both_models_runs(tmp_path, monkeypatch, stage):
    """The tiny model's cells are swept into their own folders with the SmolLM2 experiments' objectives; the table
    pairs each SmolLM2 experiment with its cell, per pair of objectives (differences oriented A − B by name). Stage
    ``rl``: smollm2_rl alone (its cell, rows and claim), smollm2_transfer said not to have run."""
    results = tmp_path / "results"
    monkeypatch.setattr(docs, "DOCS", tmp_path)
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    monkeypatch.setattr(docs, "code_record", lambda: {"version": "abc"})
    swept = []
    monkeypatch.setattr(docs, "run_sweep", lambda cfg, jobs, progress: swept.append(
        (cfg.name, list(cfg.sweep.grid["objective.name"]), dict(cfg.sweep.grid))))
    objectives = tuple(load_experiment("smollm2_rl", []).sweep.grid["objective.name"])
    assert {"grpo", "gspo", "ctpo"} <= set(objectives)
    above_ctpo = lambda o, point, s: 0.4 if o == "ctpo" else 0.45 + 0.01 * s  # noqa: E731
    for name in ("smollm2_rl", "smollm2_transfer", "transfer_tiny_base", "transfer_tiny_stress"):
        grid_experiment(results / "docs" / "abc" / name, {}, objectives=objectives,
                        effect=above_ctpo if name.endswith(("transfer", "stress")) else None)

    def document(name, results_dir, jobs):
        (results_dir / name / "report").mkdir()
        (results_dir / name / "report" / "paired.md").write_text(f"pairs of {name}\n")
        return f"## {name}\n"

    monkeypatch.setattr(docs, "document", document)
    monkeypatch.setattr(docs, "gain_table", lambda exp_dir: f"gains of {exp_dir.name}")
    monkeypatch.setattr(docs, "claims_section", lambda names, results_dir, jobs: f"claims {', '.join(names)}\n")
    monkeypatch.setattr(docs.names, "write_docs", lambda: [])
    assert docs.main(with_smollm2=stage, skip_main=True, jobs=1) == 0
    page = (tmp_path / "results_smollm2.md").read_text()
    assert "## smollm2_rl\n" in page and "pairs of smollm2_rl" in page
    assert f"### Gain over the start\n\n{docs.GAIN_NOTE}\n\ngains of smollm2_rl" in page  # what the interval covers
    rows = [line for line in page.splitlines() if line.startswith("| smollm2")]
    pairs = list(itertools.combinations(sorted(objectives), 2))
    if stage == "rl":
        assert "gains of smollm2_transfer" not in page and "Not run at this code version: smollm2_transfer" in page
        assert "claims ctpo_outperforms_smollm2\n" in page
        assert [s[:2] for s in swept] == [("transfer_tiny_base", list(objectives))]
        assert len(rows) == len(pairs) and all("smollm2_rl" in row for row in rows)
        return
    assert "gains of smollm2_transfer" in page and "Not run" not in page
    assert f"claims {', '.join(c for claims in docs.SMOLLM2_CLAIMS.values() for c in claims)}\n" in page
    assert [s[:2] for s in swept] == [("transfer_tiny_base", list(objectives)),
                                      ("transfer_tiny_stress", list(objectives))]
    assert swept[1][2]["train.num_minibatches"] == [8]
    assert len(rows) == 2 * len(pairs)  # every pair, in both experiments
    stress = {row.split("|")[3].strip(): row.split("|")[-2].strip() for row in rows if "smollm2_transfer" in row}
    assert stress == {" − ".join(pair): "holds" if "ctpo" in pair else "neither separates them" for pair in pairs}


@pytest.mark.parametrize("stage", ["screen", "both"])
def test_with_zoo_screen_writes_the_screens_leaderboard_as_no_verdict(tmp_path, monkeypatch, stage):
    monkeypatch.setattr(docs, "DOCS", tmp_path)
    monkeypatch.setattr(names, "DOCS", {})  # the generated tables: tests/test_names.py
    stages = []

    def zoo(jobs, overrides, progress, stage):  # writes what the zoo's stages write, under the docs' folder
        stages.append(stage)
        folder = Path(overrides[0].partition("=")[2]) / "zoo"
        (folder / "screen").mkdir(parents=True)
        (folder / "screen" / "leaderboard.md").write_text("# Objective leaderboard: screen\n")
        if stage == "both":
            (folder / "confirm").mkdir()
            (folder / "confirm" / "plan.md").write_text("# plan\n")
            (folder / "leaderboard.md").write_text("# confirmed\n")
        return 0

    monkeypatch.setattr(docs, "zoo", zoo)
    monkeypatch.setattr(docs, "ROOT", tmp_path)  # results/docs/<version>/ under it
    assert docs.main(with_zoo=stage, skip_main=True, jobs=1) == 0
    page = (tmp_path / "zoo.md").read_text()
    assert stages == [stage] and "# Objective leaderboard: screen" in page
    assert ("The confirmation has not run" in page) == (stage == "screen")
    assert ("# confirmed" in page) == (stage == "both")
    assert ("Written by code " in page and " from the runs in " in page) == (stage == "both")  # the analysis' code


@pytest.mark.parametrize("variable, value, flag", [
    ("WITH_ZOO", "1", "--with-zoo both"), ("WITH_ZOO", "screen", "--with-zoo screen"),
    ("WITH_SMOLLM2", "1", "--with-smollm2 both"), ("WITH_SMOLLM2", "rl", "--with-smollm2 rl")])
def test_make_docs_passes_the_zoos_and_smollm2s_stage(variable, value, flag):
    done = subprocess.run(["make", "-n", "docs", f"{variable}={value}"], cwd=ROOT, capture_output=True, text=True,
                          env=MAKE_ALONE)
    assert done.returncode == 0 and flag in done.stdout
