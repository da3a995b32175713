"""The documentation: the site's reference pages written from the code (docs/hooks.py), the strict offline
build of the whole site (mkdocs.yml), docs/python_api.md's code run as written, and no stale source path in docs/ and
experiments/."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from analysis import AnalysisWarning
from tests.helpers.fake_runs import fake_experiment, fake_run

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hooks():
    """docs/hooks.py, the mkdocs hook that writes the reference pages (a file of the docs, not of the package)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def reference(hooks, monkeypatch):
    monkeypatch.setattr(hooks, "reasoning_gym_datasets", lambda: ["chain_sum", "countdown"])  # imports take seconds
    return hooks


def test_the_reference_has_every_objective_estimator_key_task_experiment_and_command(reference):
    from harness.apps.cli import COMMANDS
    from harness.run import names
    from harness.run.experiments import experiment_paths
    from harness.tasks import TASKS
    from objectives import ADVANTAGES, OBJECTIVES

    pages = reference.pages()
    for name in OBJECTIVES.names():
        page = pages[f"reference/objectives/{name}.md"]
        assert f"`objective.name={name}`" in page and f"]({name}.md)" in pages["reference/objectives/index.md"]
    for key in (n.key for n in names.all_names()):
        assert f"| `{key}` |" in pages["reference/config.md"], key
    for section, registry in (("advantages", ADVANTAGES), ("tasks", TASKS)):
        assert all(f"## `{name}`" in pages[f"reference/{section}.md"] for name in registry.names())
    assert all(f"## `{path.stem}`" in pages["reference/experiments.md"] for path in experiment_paths())
    assert all(f"### `python -m harness {command}`" in pages["reference/cli.md"] for command in COMMANDS)
    assert "| `make docs-site` |" in pages["reference/cli.md"]


def test_an_objective_page_carries_its_docstring_defaults_meanings_and_trl_verl_names(reference):
    page = reference.pages()["reference/objectives/ctpo.md"]
    assert "**CTPO — cumulative-token importance sampling (arXiv 2605.07331);" in page  # the title sentence
    assert "horizon-llm/CTPO (commit acc40211dbeaa8cb37c2347a8b7ad64192b635c4)" in page  # the reference
    assert "```text\nc_t        = sum_{u <= t, valid} clamp(d_u, -20, 20)" in page  # the formula, verbatim
    assert "| `la_power` | `0.5` | length-adaptive window:" in page  # own hyperparameter: default and meaning
    assert "| `clip_low` | `0.025` |" in page and "`epsilon`" in page and "`actor_rollout_ref.actor.clip_ratio_low`" \
        in page
    assert "| `beta` |" not in page and "[shared ones](index.md#shared-hyperparameters)" in page
    alias = reference.pages()["reference/objectives/bnpo.md"]
    assert "An alias: [`grpo`](grpo.md) with `aggregation=token_mean`." in alias


def test_a_new_objective_file_gets_its_page_without_an_edit(reference, monkeypatch):
    from objectives import OBJECTIVES, Objective, aggregate, register_objective

    monkeypatch.setattr(OBJECTIVES, "_items", dict(OBJECTIVES._items))  # registered for this test only

    @register_objective("docs_probe")
    class Probe(Objective):
        scale: float = 0.5  # multiplies the surrogate

        def policy_loss(self, batch):
            return aggregate(-self.scale * batch.logp * batch.token_advantages, batch, self.aggregation), {}

    pages = reference.pages()
    assert "| `scale` | `0.5` | multiplies the surrogate |" in pages["reference/objectives/docs_probe.md"]
    assert "[`docs_probe`](docs_probe.md)" in pages["reference/objectives/index.md"]
    assert {"docs_probe": "reference/objectives/docs_probe.md"} in reference.navigation()[1]["Objectives"]


def test_a_docstring_becomes_markdown_that_shows_it_as_written(reference):
    doc = """Title — Paper (arXiv 1.2); reference: a/b.

        l_t = -min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)      (*per token*)
        loss = sum_t l_t / N

    Options:
    - ``knob`` (default 3): a * b * c with x_1 and [B, T] <tag> and :meth:`Task.config`
      continued here.
    The end.
    """
    assert reference.docstring_markdown(doc) == (
        "Title — Paper (arXiv 1.2); reference: a/b.\n\n"
        "```text\nl_t = -min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)      (*per token*)\nloss = sum_t l_t / N\n```\n\n"
        "Options:\n\n"
        "- ``knob`` (default 3): a \\* b \\* c with x\\_1 and \\[B, T\\] &lt;tag&gt; and `Task.config` continued "
        "here.\n\nThe end.\n")


def test_the_site_shows_the_generated_tables_as_the_code_makes_them(hooks):
    """docs/trl.md's committed tables can lag the code (`explain --write` rewrites them; no test compares them): the
    site fills them from the code at build time (its TRL page showed meanings the code had since mended)."""
    from types import SimpleNamespace

    from harness.run import names

    text = (REPO / "docs" / "trl.md").read_text()
    for kind in names.DOCS[REPO / "docs" / "trl.md"]:
        text = text.replace(names.section(text, kind), "a stale row\n")
    page = SimpleNamespace(file=SimpleNamespace(src_uri="trl.md"))
    shown = hooks.on_page_markdown(text, page, None, None)
    assert "a stale row" not in shown
    assert all(names.section(shown, kind) == names.generated(kind) for kind in ("names", "aliases"))
    other = SimpleNamespace(file=SimpleNamespace(src_uri="loop.md"))
    assert hooks.on_page_markdown("a stale row\n", other, None, None) == "a stale row\n"



    """mkdocs.yml: a link to a missing page or anchor is a warning, which `--strict` (make docs-site, the slow test
    below) turns into a failed build; no web fonts and no plugin that loads a script from the network."""
    from mkdocs.config import load_config

    config = load_config(str(REPO / "mkdocs.yml"))
    links = config.validation.links
    assert links.not_found == links.anchors == config.validation.nav.omitted_files == logging.WARNING
    assert config.theme["font"] is False and "offline" not in config.plugins and not config.repo_url
    assert "--strict" in (REPO / "Makefile").read_text().split("\ndocs-site:")[1].split("\n\n")[0]


@pytest.mark.slow  # mkdocs in a fresh interpreter: imports the harness, writes every page
def test_the_site_builds_strictly_offline(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    from objectives import OBJECTIVES

    assert all((site / "reference" / "objectives" / f"{name}.html").is_file() for name in OBJECTIVES.names())
    for page in ("index", "python_api", "reference/config", "reference/cli", "loop"):
        html = (site / f"{page}.html").read_text()
        external = re.findall(r'(?:src|href)="(https?://[^"]+)"', html)
        assert set(external) <= {"https://squidfunk.github.io/mkdocs-material/"}, (page, external)  # footer link only


@pytest.mark.slow
def test_the_python_api_page_runs_as_written(tmp_path, monkeypatch):
    """docs/python_api.md's code blocks, in order, on a fake results/quickstart (2 objectives x 2 seeds) and
    results/step_size (the same at quickstart's learning rate, the same run ids, and at a larger one)."""
    def runs(folder, lrs):
        return [fake_run(folder, objective, seed, {"train.lr": lr}, run_id=f"{objective}-s{seed}-{lr:g}",
                         final=0.4 + 0.1 * seed + (lr > 1e-4) * 0.05) for lr in lrs for objective in ("grpo", "gspo")
                for seed in (0, 1)]

    quickstart, step_size = tmp_path / "results" / "quickstart", tmp_path / "results" / "step_size"
    fake_experiment(quickstart, runs(quickstart, [5e-5]))
    fake_experiment(step_size, runs(step_size, [5e-5, 5e-4]))
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "python_api.md").read_text(), flags=re.S)
    namespace: dict = {}
    with pytest.warns(AnalysisWarning, match="4 runs held by more than one folder"):
        for block in blocks:
            exec(compile(block, "docs/python_api.md", "exec"), namespace)
    assert len(blocks) == 4 and (tmp_path / "eval_accuracy.png").stat().st_size > 1000
    table = namespace["table"]  # two cells of two objectives, 2 seeds each: the shared runs counted once
    assert list(table["final_n"]) == [2] * 4 and sorted(table["train.lr"]) == [5e-5, 5e-5, 5e-4, 5e-4]
    assert (table["final_ci_low"] < table["final_mean"]).all()
    assert sorted(set(namespace["both"].runs["source"])) == ["quickstart, step_size", "step_size"]
    final = namespace["final"]
    assert list(final["count"]) == [2, 2] and sorted(final.index.get_level_values("objective")) == ["grpo", "gspo"]
    assert final["mean"].tolist() == pytest.approx([0.45, 0.45])
    assert list(namespace["curves"].columns) == ["grpo", "gspo"] and namespace["curves"].index.max() == 6


SOURCE_PATH = re.compile(r"\b(?:harness|objectives|analysis|tests)/[\w/]+\.py\b")


def test_docs_and_experiments_name_no_source_file_that_is_not_there():
    """A module moved (harness/config.py -> harness/run/config.py) leaves no stale pointer in docs/ or experiments/."""
    texts = [*(REPO / "docs").glob("*.md"), *(REPO / "experiments").rglob("*.yaml")]
    stale = {f"{path.relative_to(REPO)}: {found}" for path in texts for found in SOURCE_PATH.findall(path.read_text())
             if not (REPO / found).exists()}
    assert not stale, sorted(stale)
