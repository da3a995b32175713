"""harness/run/commandline.py: the arguments are parsed before torch is imported, so `-h` and a mistyped option
answer without the seconds of the imports; what the parser accepts is what the commands run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.run.commandline import parse

ROOT = Path(__file__).resolve().parent.parent
MODEL_LIBRARIES = {"transformers", "trl", "datasets", "reasoning_gym", "pandas", "matplotlib", "peft"}


def harness_importing(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """``python -X importtime -m harness <args>``: the process and the top-level packages it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "harness", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    return done, imported


@pytest.mark.parametrize("args", [["--help"], ["zoo", "--help"], ["sweep", "quickstart", "--help"]])
def test_help_imports_neither_torch_nor_transformers(args):
    done, imported = harness_importing(*args)
    assert done.returncode == 0 and "usage: python -m harness" in done.stdout
    assert not imported & {"torch", "transformers", "objectives", "omegaconf"}, imported


@pytest.mark.parametrize("args, message", [
    (["sweep", "quickstart", "--bogus"], "unrecognized arguments: --bogus"),
    (["zoo", "--objectives", "grpo,,gspo"], "an empty name"),
    (["sweep", "quickstart", "--launcher", "k8s"], "invalid choice: 'k8s'"),
    (["zoo", "--seeds", "10000"], "--seeds: must be at most 100"),  # it planned for minutes without a word
    # a mistyped experiment (it was said after the seconds of the imports)
    (["train", "quickstar"], "config error: no experiment 'quickstar' (looked for "),
    (["sweep", "quickstart.yaml", "seed=1"], "config error: no experiment file quickstart.yaml (not there). Did you "),
    (["lab", "a/b"], "config error: no experiment 'a/b': give an experiment's name ("),
    (["prepare", "nowhere/config.yaml"], "config error: no experiment file nowhere/config.yaml (not there). Give"),
])
def test_a_mistyped_option_is_one_line_before_torch_is_imported(args, message):
    done, imported = harness_importing(*args)
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and len(errors) == 1 and message in errors[0], errors
    assert "torch" not in imported


@pytest.mark.slow  # each a process that imports torch and the objectives
@pytest.mark.parametrize("args, message", [
    (["train", "quickstart", "train.stpes=5"], "config error: unknown config key 'train.stpes'. Did you mean 'train."),
    (["sweep", "quickstart", "--jobs", "1", "train.steps=abc"], "config error: invalid config value at 'train.steps'"),
    (["lab", "lab", "lab.batchez=2"], "config error: unknown config key 'lab.batchez'. Did you mean 'lab.batches'?"),
    (["prepare", "quickstart", "model.nmae=x"], "config error: unknown config key 'model.nmae'. Did you mean "),
])
def test_a_mistyped_setting_is_one_line_before_the_models_libraries_are_imported(args, message):
    """It was said after every component's imports (transformers, the loop, the tasks); the settings need only the
    schema's (torch and the objectives)."""
    done, imported = harness_importing(*args)
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and len(errors) == 1 and errors[0].startswith(message), errors
    assert not imported & MODEL_LIBRARIES, imported


@pytest.mark.slow  # a process that imports torch and the objectives
def test_explain_answers_before_the_models_libraries_are_imported():
    """`make explain KEY=...` imported every component (transformers, the loop, the tasks) to print a key's text,
    which needs the schema and the objectives only (tests/test_names.py: what it prints)."""
    done, imported = harness_importing("explain", "model.tiny")
    assert done.returncode == 0 and "    num_experts = 8: routed experts per layer\n" in done.stdout, done.stdout
    assert not imported & MODEL_LIBRARIES, imported


@pytest.mark.slow  # a process that imports torch and the objectives
def test_explain_into_a_pipe_whose_reader_has_gone_ends_quietly():
    """`python -m harness explain | head`: the reader gone before the table is written is status 0, no traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "harness", "explain"], cwd=ROOT, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


def test_the_parser_module_imports_no_torch():
    code = "import sys, harness.run.commandline; print(sorted({'torch', 'omegaconf', 'objectives'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    assert out.strip() == "[]"


def test_bench_modes_get_their_options_defaults():
    from harness.run.commandline import SCALE_ROWS, SCALE_TOKENS

    args = parse(["bench", "--scale"])
    assert (args.rows, args.tokens, args.jobs, args.against) == (SCALE_ROWS, SCALE_TOKENS, 2, None)
    assert parse(["bench", "--scale", "--rows", "8,16"]).rows == (8, 16)
    assert parse(["bench", "--sweep-throughput", "--jobs", "1"]).jobs == 1


def test_overrides_may_follow_the_options():
    args = parse(["sweep", "quickstart", "--jobs", "2", "seed=3", "train.steps=4"])
    assert (args.command, args.jobs, args.overrides) == ("sweep", 2, ["seed=3", "train.steps=4"])
    with pytest.raises(SystemExit):
        parse(["sweep", "quickstart", "--jobs", "2", "--nope"])


@pytest.mark.parametrize("args, said, unsaid", [
    (["train"], "python -m harness train: the following arguments are required: experiment (", "overrides"),
    (["list", "x"], "python -m harness list: unrecognized arguments: x (`python -m harness list -h`", None),
    (["explain", "a", "b"], "python -m harness explain: unrecognized arguments: b", None),
    (["train", "quickstart", "--run-dir", ""], "argument --run-dir: must name a folder", None),
    (["train", "quickstart", "--run-dir= "], "argument --run-dir: must name a folder", None),
    # a bench option without the mode that reads it was ignored, silently
    (["bench", "--rows", "32"], "python -m harness bench: --rows is read by --scale only: add --scale or leave --rows "
                                "out", None),
    (["bench", "--jobs", "3"], "--jobs is read by --sweep-throughput only", None),
    (["bench", "--scale", "--memory"], "--scale and --memory are separate measurements: give one per command", None),
    (["bench", "--repeats", "3", "--profile"], "--repeats is read by the step's measurement only (no mode): leave "
                                               "--repeats or --profile out", None),  # it was ignored, silently
])
def test_a_mistake_is_named_by_the_commands_own_parser(args, said, unsaid, capsys):
    """An optional list of overrides is not called required; an extra argument is the command's (its `-h` lists
    what it takes); an empty --run-dir is refused, not taken for the default folder."""
    with pytest.raises(SystemExit) as stop:
        parse(args)
    error = capsys.readouterr().err
    assert stop.value.code == 2 and said in error and error.count("\n") == 1, error
    assert unsaid is None or unsaid not in error


@pytest.mark.slow
def test_the_module_entry_point_parses_then_runs_the_command(capsys):
    """``harness.__main__.main(argv)``: what ``python -m harness`` runs and what a launcher's script imports (the
    TRL backend's two-process test does)."""
    from harness.__main__ import main

    assert main(["explain", "train.lr"]) == 0 and "train.lr" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["explain", "--bogus"])
    assert stop.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_ctrl_c_during_the_imports_is_the_commands_one_line(monkeypatch, capsys):
    """A Ctrl-C in the seconds before the command runs (the parse, the imports of torch and transformers) ends with
    the line and status the running command gives (130), not a traceback through the imports."""
    import harness.__main__ as entry

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "parse", interrupted)
    assert entry.main(["list"]) == 130
    assert capsys.readouterr().err == "interrupted: run the command again\n"  # before the command was known


@pytest.mark.parametrize(("command", "kept"), [
    ("train", "(finished steps are kept)"), ("sweep", "(finished runs and steps are kept)"),
    ("lab", "(measured batches are kept)"), ("bench", None), ("explain", None), ("worker", "")])
def test_ctrl_c_says_what_the_command_keeps(monkeypatch, capsys, command, kept):
    """Ctrl-C of a bench (which writes its table at its end) or of explain said 'finished steps are kept' as a
    run's did (the fifth hostile pass); each command now says what it keeps. A sweep's worker says nothing: Ctrl-C
    reaches it with its sweep, which says the line (an idle worker's "it does not resume" contradicted it)."""
    from harness.apps import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, command, interrupted)
    args = {"train": ["quickstart"], "sweep": ["quickstart"], "lab": ["lab"], "bench": [], "explain": ["train.lr"],
            "worker": ["results"]}
    assert cli.main([command, *args[command]]) == 130
    err = capsys.readouterr().err
    assert err == ("" if kept == "" else f"interrupted: run the same command again to resume {kept}\n" if kept else
                   "interrupted: it does not resume; run it again\n")


def test_version_says_the_package_and_the_code(capsys):
    """--version said 'the following arguments are required: command' (the twenty-third hostile pass)."""
    from harness.run.provenance import code_record

    for flag in ("--version", "-V"):
        with pytest.raises(SystemExit) as stop:
            parse([flag])
        assert stop.value.code == 0
        assert capsys.readouterr().out == f"python -m harness {code_record()['packages']['rlvr-objectives-harness']} " \
                                          f"(code {code_record()['version']})\n"


def test_the_help_line_names_every_command_a_user_runs():
    """`python -m harness -h`'s first line lists the commands (the site's command-line reference shows it too): it
    left out `explain`. `worker` is the sweep's own process, not a user's command."""
    from harness.run.commandline import DESCRIPTION, build_parser

    listed = DESCRIPTION.split("{")[1].split("}")[0].split(",")
    assert sorted(listed) == sorted(set(build_parser().commands) - {"worker"})
