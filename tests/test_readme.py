"""README.md is the contract: at most 250 lines, the report's path in its first 100, set-up and test exactly what CI
runs, every command in it a make target or CLI command that exists and dry-runs in its order, every link a file,
every page of docs/ linked from it and in the site's nav, and its code examples the tested ones (the task example
registers, builds and scores; the objective example: tests/test_objectives.py)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from markdown.extensions.toc import slugify

from harness.tasks import TASKS, get_task
from tests.helpers.processes import MAKE_ALONE

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
REPORT = "results/quickstart/report/report.html"


def shell_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks, in order: continuations joined, comments and blank lines dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def inline_make_commands(text: str) -> list[str]:
    """The `make ...` code spans of the prose (outside code blocks)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [" ".join(span.split()) for span in re.findall(r"`(make [^`]+)`", prose)]


def links(text: str) -> list[str]:
    """The targets of the Markdown links and images of ``text``."""
    return re.findall(r"\]\(([^)\s]+)\)", text)


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_the_readme_is_a_short_contract_that_says_where_the_report_is():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: at most 250 (move detail to docs/)"
    first = "\n".join(lines[:100])
    assert REPORT in first, f"README.md must name {REPORT} within its first 100 lines"
    assert "N seeds: indicative" in first and "verdict" in first.lower()


def test_set_up_and_test_are_exactly_what_ci_runs():
    """The README's first two commands are `make setup` and `make test`, and .ci/run runs those two, in that order."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))]
    assert ci == ["make setup", "make test"], ci
    assert shell_commands(README.read_text())[:2] == ci


def test_every_make_target_and_experiment_the_readme_names_exists():
    """`make X` in the README's shell blocks and prose is a Makefile target; `EXP=name` an experiment file."""
    from harness.run.experiments import EXPERIMENTS_DIR

    text = README.read_text()
    commands = shell_commands(text) + inline_make_commands(text)
    named = {c.split()[1] for c in commands if c.startswith("make ")}
    assert {"setup", "test", "sweep", "compare"} <= named, named
    assert named <= make_targets(), f"README names make targets that do not exist: {named - make_targets()}"
    experiments = set(re.findall(r"EXP=([a-z0-9_]+)", text))
    assert all((EXPERIMENTS_DIR / f"{e}.yaml").exists() for e in experiments), experiments


def test_every_link_of_the_readme_is_a_file_and_every_anchor_a_heading():
    assert links(README.read_text())
    for link in links(README.read_text()):
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {link}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            assert anchor in {slugify(h, "-") for h in headings}, f"README links to {link}: no such heading"


def nav_pages(nav) -> set[str]:
    """The pages of mkdocs.yml's nav (nested sections flattened)."""
    if isinstance(nav, str):
        return {nav}
    items = nav.values() if isinstance(nav, dict) else nav
    return set().union(*(nav_pages(item) for item in items))


def test_every_docs_page_is_linked_from_the_readme_and_in_the_site():
    """Each page of docs/ is one the README points to (its Documentation list or the prose) and one the site's nav
    lists; the site's own reference pages are written at build time (docs/hooks.py), not kept in docs/."""
    linked = {Path(link.partition("#")[0]) for link in links(README.read_text())}
    pages = {page.relative_to(ROOT) for page in (ROOT / "docs").glob("*.md")}
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert pages - linked == set(), f"docs pages the README does not link: {sorted(map(str, pages - linked))}"
    missing = {str(page.relative_to("docs")) for page in pages} - nav
    assert missing == set(), f"docs pages missing from mkdocs.yml's nav: {sorted(missing)}"


@pytest.mark.slow  # one `make -n` subprocess per command, and the configs they would run
@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_every_readme_command_dry_runs_in_order(tmp_path):
    """From a fresh clone, in the README's order: `make setup`, `make test`, then each command. Each make command
    dry-runs (`make -n`: the target exists and its recipe expands, e.g. compare's checks of OBJECTIVES and SEEDS), and
    each `python -m harness` command it would run, or the README gives, parses; a train or sweep's experiment and
    overrides pass the config's validation (the runs they would start are valid), without running anything."""
    from harness.run.commandline import build_parser
    from harness.run.config import load_experiment, run_configs

    text = README.read_text()
    commands = shell_commands(text)
    assert commands[:3] == ["make setup", "make test", "make sweep EXP=quickstart"], commands[:3]
    parser = build_parser()
    checked = []
    runnable = [c for c in inline_make_commands(text) if "=" in c and "<" not in c]  # not `make compare` as a name
    for command in commands + runnable:
        words = shlex.split(command)
        if words[0] == "make":  # PY given: the dry run does not need this checkout's .venv
            done = subprocess.run(["make", "-n", *words[1:], f"PY={sys.executable}"], cwd=ROOT,
                                  capture_output=True, text=True, env=MAKE_ALONE)
            assert done.returncode == 0, f"{command}: {done.stderr.strip()}"
            recipe = done.stdout.replace("\\\n", " ").splitlines()  # continuation lines joined
            harness = [shlex.split(line) for line in recipe if " -m harness " in line]
        else:
            harness = [words]
        for argv in harness:
            argv = argv[argv.index("harness") + 1:] if "harness" in argv else []
            if not argv:
                continue
            args = parser.parse_args(argv)
            if argv[0] in ("train", "sweep") and "vanilla_pg" not in command:  # the example, once added
                cfg = load_experiment(args.experiment, args.overrides)
                assert run_configs(cfg), command
            checked.append(argv[0])
    assert {"sweep", "train", "list", "explain"} <= set(checked), checked


def test_the_readme_task_example_registers_and_scores(monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (code,) = [b for b in blocks if "@register_task(" in b]
    monkeypatch.setattr(TASKS, "_items", dict(TASKS._items))  # register into a copy: other tests see no parity
    exec(compile(code, "README.md", "exec"), {})
    task = get_task("parity", eval_size=8)
    problem = task.eval_problems()[0]
    assert len(task.eval_problems()) == 8 and problem.answer == "1"  # 100 is even
    assert task.score(problem.solution, problem).correct == 1.0
    assert task.score("#### 0", problem).correct == 0.0 and task.score("yes", problem).format == 0.0
