"""mkdocs hook (mkdocs.yml, `make docs-site`): the documentation site's reference pages, written from the code each
time the site is built, so they cannot go stale and a new objective file, estimator, task, experiment, config key or
command appears without an edit here:

    reference/objectives/<name>.md   each registered objective: its module docstring (formula, paper, reference
                                     implementation), its defaults and hyperparameters with their meanings
    reference/advantages.md          each advantage estimator's docstring
    reference/config.md              every config key: meaning, default, TRL and verl names (``explain``'s table)
    reference/tasks.md, experiments.md, cli.md

and fills the generated tables of the pages that hold them (docs/trl.md's) from the code (:func:`on_page_markdown`).

:func:`pages` returns them as ``{path under docs/: Markdown}`` (nothing is written into docs/); mkdocs calls
:func:`on_files`. Tests load this file by its path (tests/test_docs_site.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import sys

import yaml

from harness.run import names
from harness.run.commandline import build_parser
from harness.run.config import experiment_description
from harness.run.experiments import REPO, experiment_paths
from harness.run.names import first_sentence
from harness.tasks import TASKS, reasoning_gym_datasets
from objectives import ADVANTAGES, OBJECTIVES, Objective
from objectives.advantages import loop_inputs
from objectives.base import SHARED_HYPERPARAMETERS, aggregate, alias_of

REFERENCE = "reference"
CODE_SPAN = re.compile(r"(``.+?``|`[^`\n]+`)", re.S)


# ------------------------------------------------------------------------------- docstrings as Markdown


def prose(text: str) -> str:
    """Docstring prose as Markdown that shows it as written: code spans kept, every character Markdown would read
    as markup (emphasis, links, HTML, a heading) escaped."""
    parts = CODE_SPAN.split(re.sub(r":(?:meth|func|class|data|attr|mod):(?=`)", "", text))
    for i in range(0, len(parts), 2):
        part = parts[i].replace("\\", "\\\\")
        for char in "*_[]":
            part = part.replace(char, "\\" + char)
        parts[i] = re.sub(r"^#", r"\\#", part.replace("<", "&lt;").replace(">", "&gt;"), flags=re.M)
    return "".join(parts)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def docstring_markdown(doc: str | None) -> str:
    """A docstring in this repository's style as Markdown: blocks indented by 4 or more (the formulas) verbatim in
    code blocks, ``- `` items as a list (their lines indented by 2 continue them), the rest as paragraphs."""
    lines, out, i = inspect.cleandoc(doc or "").splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif _indent(line) >= 4:
            start = i
            while i < len(lines) and (_indent(lines[i]) >= 4 or not lines[i].strip()):
                i += 1
            while not lines[i - 1].strip():
                i -= 1
            out.append("\n".join(["```text", *(x[4:] for x in lines[start:i]), "```"]))
        elif line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].strip() and (lines[i].startswith("- ") or 0 < _indent(lines[i]) < 4):
                if lines[i].startswith("- "):
                    items.append([])
                items[-1].append(lines[i].strip().removeprefix("- "))
                i += 1
            out.append("\n".join("- " + prose(" ".join(item)) for item in items))
        else:
            start = i
            while i < len(lines) and lines[i].strip() and _indent(lines[i]) < 4 and not lines[i].startswith("- "):
                i += 1
            out.append(prose("\n".join(x.strip() for x in lines[start:i])))
    return "\n\n".join(out) + "\n"


def module_doc(obj) -> str:
    return inspect.getdoc(sys.modules[obj.__module__]) or ""


def source_path(obj) -> str:
    return inspect.getsourcefile(obj).removeprefix(str(REPO) + "/")


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of Markdown cells (a ``|`` not yet escaped is escaped)."""
    def line(cells):
        return "| " + " | ".join(re.sub(r"(?<!\\)\|", r"\\|", c) for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)]) + "\n"


# ------------------------------------------------------------------------------------------- objectives


def _title(name: str) -> str:
    """The first sentence of an objective's docstring (its paper), one line."""
    return " ".join(first_sentence(" ".join(module_doc(OBJECTIVES.get(name)).split("\n\n")[0].split())).split())


def _hyperparameter_rows(name: str, params: list[str]) -> list[list[str]]:
    rows, defaults, keys = [], OBJECTIVES.get(name).hyperparameters(), names.by_key()
    for param in params:
        row = keys.get(names.PARAMS + param)
        rows.append([f"`{param}`", f"`{names.shown(defaults[param])}`",
                     names.cell(names.objective_param_meaning(name, param)), names.cell(row.trl if row else "—"),
                     names.cell(row.verl if row else "—")])
    return rows


def objective_page(name: str) -> str:
    cls = OBJECTIVES.get(name)
    own = [p for p in cls.hyperparameters() if p not in SHARED_HYPERPARAMETERS]
    alias = alias_of(name)
    lines = [f"# `{name}`", ""]
    if alias is not None:
        changed = ", ".join(f"`{k}={names.shown(v)}`" for k, v in alias[1].items())
        lines += [f"An alias: [`{alias[0]}`]({alias[0]}.md) with {changed or 'the same defaults'}.", ""]
    else:
        lines += [f"**{prose(_title(name))}**", ""]
    needs = [text for flag, text in (
        (cls.needs_whole_groups, "micro-batches of whole groups"),
        (cls.needs_whole_minibatch, "the whole minibatch at once (no micro-batching)"),
        (cls.needs_sequence_advantages, "one advantage per sequence"),
        (cls.needs_hidden_states, "the policy's hidden states"),
        (cls.stateful, "state of its own across updates (its lifecycle hooks; checkpointed)"),
        (cls.uses_minibatch_statistics(), "minibatch statistics (an extra no-grad forward when micro-batched)"),
    ) if flag]
    lines += [f"- **config**: `objective.name={name}`",
              f"- **source**: `{source_path(cls)}`, class `{cls.__name__}`",
              f"- **default advantage**: [`{cls.default_advantage}`](../advantages.md#{cls.default_advantage})",
              f"- **aggregation**: `{cls.default_aggregation}` by default; accepts "
              + ", ".join(f"`{mode}`" for mode in cls.aggregations),
              *([f"- **needs**: {'; '.join(needs)}"] if needs else []), ""]
    lines += ["## Hyperparameters", "",
              f"`objective.params.*`, with this objective's defaults. Every objective also takes the "
              f"[shared ones](index.md#shared-hyperparameters) ({', '.join(f'`{p}`' for p in SHARED_HYPERPARAMETERS)})"
              + (": this one has none of its own." if not own else "."), ""]
    if own:
        lines.append(table(["name", "default", "meaning", "TRL", "verl"], _hyperparameter_rows(name, own)))
    lines += ["## Formula, paper and reference implementation", "",
              f"From the docstring of `{source_path(cls)}`:", "", docstring_markdown(module_doc(cls))]
    if cls.__doc__ and cls.__doc__ != Objective.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
        lines += [f"Class `{cls.__name__}`:", "", docstring_markdown(cls.__doc__)]
    return "\n".join(lines)


def objectives_index() -> str:
    rows = []
    for name in OBJECTIVES.names():
        cls, alias = OBJECTIVES.get(name), alias_of(name)
        what = f"alias of `{alias[0]}`" if alias else prose(_title(name))
        rows.append([f"[`{name}`]({name}.md)", what, f"`{cls.default_advantage}`", f"`{cls.default_aggregation}`"])
    shared = _hyperparameter_rows("grpo", list(SHARED_HYPERPARAMETERS))
    for row in shared:
        if row[0] == "`aggregation`":
            row[1] = "the objective's own"
    return "\n".join([
        "# Objectives", "",
        f"Every registered objective ({len(rows)}), one page each, written from its file in `objectives/` when this "
        "site is built. `python -m harness list` prints the same names; `objective.name=<name>` selects one.", "",
        table(["objective", "paper", "default advantage", "default aggregation"], rows),
        "## Shared hyperparameters", "",
        "Every objective takes these (`objective.params.*`), with these defaults:", "",
        table(["name", "default", "meaning", "TRL", "verl"], shared),
        "## Aggregation modes", "", f"From `{source_path(aggregate)}`, `aggregate`:", "",
        docstring_markdown(aggregate.__doc__),
        "## Notation", "", f"From the docstring of `{source_path(Objective)}`:", "",
        docstring_markdown(module_doc(Objective)),
    ])


# ------------------------------------------------------------------------------------------- the rest


def advantages_page() -> str:
    lines = ["# Advantage estimators", "",
             "`objective.advantage=<name>` (default: the objective's own). From `objectives/advantages.py`:", "",
             docstring_markdown(module_doc(ADVANTAGES.get("grpo")))]
    for name in ADVANTAGES.names():
        estimator = ADVANTAGES.get(name)
        default_of = [o for o in OBJECTIVES.names() if OBJECTIVES.get(o).default_advantage == name]
        lines += [f"## `{name}`", ""]
        if default_of:
            lines += ["Default of " + ", ".join(f"[`{o}`](objectives/{o}.md)" for o in default_of) + ".", ""]
        if loop_inputs(estimator):
            lines += ["Reads beyond the rewards (the native loop provides it): " +
                      ", ".join(f"`{x}`" for x in loop_inputs(estimator)) + ".", ""]
        lines += [f"`{source_path(estimator)}`, `{estimator.__name__}`:", "", docstring_markdown(estimator.__doc__)]
    return "\n".join(lines)


def config_page() -> str:
    """Every key of `python -m harness explain`, grouped by its section."""
    sections: dict[str, list[names.Name]] = {}
    for row in names.all_names():
        sections.setdefault(row.key.split(".")[0] if "." in row.key else "", []).append(row)
    lines = ["# Config keys", "",
             "Every setting an experiment file or a `key=value` override may give, with its meaning (the comment of "
             "its field in `harness/run/config.py`), its default and TRL's `GRPOConfig` and verl's names where they "
             "exist: what `python -m harness explain KEY` prints (a TRL or verl name works there too). "
             "Objective hyperparameters are per objective: their defaults are each objective's.", ""]
    for section, rows in sections.items():
        lines += [f"## `{section}`" if section else "## Top level", ""]
        body = []
        for n in rows:
            value = names.default(n.key)
            body.append([f"`{n.key}`", names.cell(n.meaning),
                         names.cell(value) if n.key.startswith(names.PARAMS) else f"`{names.cell(value)}`",
                         names.cell(n.trl), names.cell(n.verl)])
        lines.append(table(["key", "meaning", "default", "TRL `GRPOConfig`", "verl"], body))
    return "\n".join(lines)


def tasks_page() -> str:
    lines = ["# Tasks", "", "`task.name=<name>`; a task's arguments are `task.args.*` (`task.eval_size` and "
             "`task.data_dir` are config keys of their own). From `harness/tasks.py`:", "",
             docstring_markdown(module_doc(TASKS.get("arith")))]
    for name in TASKS.names():
        cls = TASKS.get(name)
        defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                    for f in dataclasses.fields(cls) if f.init}
        shown = [f"`{k}={names.shown(v)}`" for k, v in defaults.items()]
        lines += [f"## `{name}`", "", f"Arguments and defaults: {', '.join(shown)}.", "",
                  f"`{source_path(cls)}`, class `{cls.__name__}`:", "", docstring_markdown(cls.__doc__)]
        if name == "reasoning_gym":
            generators = reasoning_gym_datasets()
            lines += [f"Its generators (`task.args.dataset`, {len(generators)}): " +
                      ", ".join(f"`{g}`" for g in generators) + ".", ""]
    return "\n".join(lines)


def experiments_page() -> str:
    lines = ["# Experiments", "", "Each file of `experiments/`: its opening comment, then its settings (on top of "
             "the defaults of [every config key](config.md); `inherit:` puts another experiment's underneath). "
             "`make sweep EXP=<name>` runs one (`make lab EXP=<name>` a gradient-lab experiment).", ""]
    for path in experiment_paths():
        settings = "\n".join(line for line in path.read_text().splitlines() if not line.startswith("#")).strip()
        lines += [f"## `{path.stem}`", "", prose(experiment_description(path)), "",
                  "```yaml", f"# experiments/{path.name}", settings, "```", ""]
    lines += ["## Claims", "", "The paper-claims ledger (`make claims`, `experiments/claims/`): each claim, its paper "
              "and the experiment whose results check it.", ""]
    rows = []
    for path in sorted((REPO / "experiments" / "claims").glob("*.yaml")):
        claim = yaml.safe_load(path.read_text())
        source = ", ".join(f"{kind} `{value}`" for kind, value in claim.get("experiment", {}).items())
        rows.append([f"`{path.stem}`", names.cell(claim.get("claim", "")), names.cell(claim.get("paper", "")),
                     source])
    lines.append(table(["file", "claim", "paper", "checked on"], rows))
    return "\n".join(lines)


def cli_page() -> str:
    """`make`'s targets (the Makefile's ``## `` help) and every subcommand's ``--help``, 100 columns wide."""
    makefile = (REPO / "Makefile").read_text()
    targets = re.findall(r"^([a-z-]+):.*?## (.*)$", makefile, flags=re.M)
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    lines = ["# Command line", "", "## make", "", "`make` alone prints this list (the Makefile's help).", "",
             table(["target", "what it does"], [[f"`make {t}`", names.cell(text)] for t, text in targets]),
             "## python -m harness", "", "Every subcommand's `--help`:", ""]
    for name, sub in [("", parser), *subcommands.items()]:
        sub.formatter_class = functools.partial(argparse.HelpFormatter, width=100)
        lines += [f"### `python -m harness{' ' + name if name else ''}`", "", "```text", sub.format_help().strip(),
                  "```", ""]
    return "\n".join(lines)


def index_page() -> str:
    return "\n".join([
        "# Reference", "", "Written from the code each time this site is built (`make docs-site`), so it is the code's "
        "own account:", "",
        f"- [Objectives](objectives/index.md): all {len(OBJECTIVES.names())}, each with its formula, paper, reference "
        "implementation and hyperparameters",
        f"- [Advantage estimators](advantages.md): all {len(ADVANTAGES.names())}",
        f"- [Config keys](config.md): all {len(names.all_names())}, with TRL's and verl's names",
        "- [Tasks](tasks.md) and [experiments](experiments.md)",
        "- [Command line](cli.md): `make` and `python -m harness`", ""])


def pages() -> dict[str, str]:
    """Every reference page: ``{path under docs/: Markdown}``."""
    out = {f"{REFERENCE}/index.md": index_page(), f"{REFERENCE}/objectives/index.md": objectives_index()}
    out |= {f"{REFERENCE}/objectives/{name}.md": objective_page(name) for name in OBJECTIVES.names()}
    out |= {f"{REFERENCE}/{page}.md": make() for page, make in (
        ("advantages", advantages_page), ("config", config_page), ("tasks", tasks_page),
        ("experiments", experiments_page), ("cli", cli_page))}
    return out


def navigation() -> list:
    """The Reference section of the site's navigation."""
    return [{"Overview": f"{REFERENCE}/index.md"},
            {"Objectives": [f"{REFERENCE}/objectives/index.md",
                            *({name: f"{REFERENCE}/objectives/{name}.md"} for name in OBJECTIVES.names())]},
            {"Advantage estimators": f"{REFERENCE}/advantages.md"}, {"Config keys": f"{REFERENCE}/config.md"},
            {"Tasks": f"{REFERENCE}/tasks.md"}, {"Experiments": f"{REFERENCE}/experiments.md"},
            {"Command line": f"{REFERENCE}/cli.md"}]


# ------------------------------------------------------------------------------------------- mkdocs hooks


def on_files(files, config):
    """Add the reference pages to the site, then every docs/ page that mkdocs.yml's nav does not list (under "More"),
    so that a new page is never left out of the navigation."""
    from mkdocs.structure.files import File

    for path, text in pages().items():
        files.append(File.generated(config, path, content=text))
    listed = set(_nav_paths(config.nav))
    extra = sorted(f.src_uri for f in files.documentation_pages() if f.src_uri not in listed
                   and not f.src_uri.startswith(REFERENCE + "/"))
    config.nav = [*config.nav, {"Reference": navigation()}, *([{"More": extra}] if extra else [])]
    return files


def on_page_markdown(markdown, page, config, files):
    """A page with tables generated from the code (harness/run/names.py DOCS: docs/trl.md's) shows them as the code
    makes them now, not as they were last committed."""
    kinds = {path.name: kinds for path, kinds in names.DOCS.items() if path.parent == names.REPO / "docs"}
    return names.fill(markdown, kinds[page.file.src_uri], page.file.src_uri) if page.file.src_uri in kinds \
        else markdown


def _nav_paths(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_paths(value)]
    return [p for item in nav or [] for p in _nav_paths(item)]
