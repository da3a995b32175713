"""The one exception a bad setting raises, everywhere: one line naming the key at fault and how to fix it; and the
one line an entry point says for a file of objectives/ that does not import."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

MAIN_PROCESS = os.environ.get("RANK", "0") == "0"  # not a secondary process of `accelerate launch` / torchrun

# what a command interrupted by Ctrl-C keeps, for its one line (:func:`interrupted`); other commands keep nothing
KEPT = {"train": "finished steps are kept", "sweep": "finished runs and steps are kept",
        "zoo": "finished runs and steps are kept", "claims": "finished runs, steps and lab batches are kept",
        "lab": "measured batches are kept"}


INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C (the shell's 128 + SIGINT)
# commands that only a sweep starts, in its process group: Ctrl-C reaches them with their sweep, which says the line
QUIET = ("worker",)


def interrupted(command: str | None) -> str | None:
    """The one line Ctrl-C of ``command`` (None: before it was known) prints; None for a sweep's own process (QUIET):
    a worker idle between runs said "it does not resume" beside its sweep's "run the same command again to resume"."""
    if command is None:  # before the arguments were read: nothing has started
        return "interrupted: run the command again"
    if command in QUIET:
        return None
    if command in KEPT:
        return f"interrupted: run the same command again to resume ({KEPT[command]})"
    return "interrupted: it does not resume; run it again"


class ConfigError(ValueError):
    """A configuration problem, stated with the key at fault and how to fix it."""


def reader_gone() -> int:
    """After a BrokenPipeError on stdout (``python -m harness explain | head``: the reader has gone): stdout goes to
    /dev/null, so that the interpreter's flush at exit does not raise it again; the exit status, 0."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def say_config_error(error: ConfigError) -> int:
    """``config error: ...`` on stderr, once per launch (every process of a distributed one finds the same); the exit
    status of a bad setting, 2."""
    if MAIN_PROCESS:
        print(f"config error: {error}", file=sys.stderr)
    return 2


@contextmanager
def one_line_for_a_broken_module():
    """Around an entry point's imports: a file of objectives/ that does not import (objectives/registry.py's
    ModuleImportError, whose message names the file, the line and the error) ends the process with that line and
    status 2, not a traceback through the imports. The class is looked up in sys.modules: importing it anew would
    import the package that has just failed."""
    try:
        yield
    except ImportError as error:
        registry = sys.modules.get("objectives.registry")
        if registry is None or not isinstance(error, registry.ModuleImportError):
            raise
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
