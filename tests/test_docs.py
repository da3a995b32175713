"""make docs' pages: which pages each flag writes, and the MoE page's claims checked on its own runs."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.apps import docs
from harness.run import names
from tests.helpers.fake_runs import grid_experiment


def test_with_moe_and_skip_main_write_only_the_moe_page_with_its_claims(tmp_path, monkeypatch):
    monkeypatch.setattr(docs, "DOCS", tmp_path)
    monkeypatch.setattr(names, "DOCS", {})  # the generated tables: tests/test_names.py
    documented, sources = [], []
    monkeypatch.setattr(docs, "document", lambda name, results_dir, jobs: documented.append(name) or f"## {name}\n")
    monkeypatch.setattr(docs, "main_page", lambda *a: documented.append("results.md"))

    def run_source(kind, name, overrides, start_seeds, seeds, jobs, progress):  # under the docs' folder
        sources.append((kind, name, overrides[-1], start_seeds))
        seeds = [0, 1, 2]
        if kind == "probe":  # 8 layers: 8-10% of assignments change, 2 layers fewer
            rows = [{"objective": "grpo", "seed": s, "layers": d, "expert_changed_frac": 0.01 * d}
                    for s in seeds for d in (2, 8)]
            return {"probe": pd.DataFrame(rows)}
        if kind == "lab":
            points = (("grpo", "staleness", "8", 1.3), ("grpo", "routing", "r2", 0.8), ("gspo", "staleness", "8", 0.07))
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
    assert {s[1]: s[3] for s in sources} == {"moe_stability": (2, 3, 4), "lab_moe": (2, 3, 4), "moe_update": ()}


def test_the_mechanics_and_time_tables_are_per_cell_never_pooled(tmp_path):
    """Two values of a swept key are two rows per objective, each with its own seeds (not one row of 6 'seeds')."""
    exp = grid_experiment(tmp_path / "moe", {"train.routing_replay": ["none", "r2"]}, objectives=("grpo",),
                          seeds=(0, 1, 2))
    for table in (docs.mechanics_table(exp), docs.time_table(exp)):
        rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
        assert len(rows) == 2 and all("train.routing_replay=" in row for row in rows), table
    mechanics = docs.mechanics_table(exp)
    assert "| 3 |" in mechanics and "| 6 |" not in mechanics


@pytest.mark.slow  # two reports with their figures
def test_a_resumed_docs_sweep_says_how_many_runs_it_did_not_run(tmp_path, monkeypatch):
    """`make docs` after an interrupted one at the same commit resumes: its wall time covers only the runs left, and
    the page says how many had finished before (else it would credit the resumed runs to that wall time)."""
    results = tmp_path / "results"
    grid_experiment(results / "quickstart", {}, seeds=(0,))  # grpo and gspo, finished before the command
    monkeypatch.setattr(docs, "DOCS", tmp_path)
    entries = [{"status": "finished"}] * 4
    monkeypatch.setattr(docs, "run_sweep", lambda cfg, jobs: entries)
    section = docs.document("quickstart", results, 2)
    assert "4/4 runs finished in" in section and "; 2 of them had finished before this command" in section
    for summary in (results / "quickstart").glob("*/summary.json"):
        summary.unlink()
    assert "had finished before" not in docs.document("quickstart", results, 2)
