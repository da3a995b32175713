"""The one exception a bad setting raises, everywhere: one line naming the key at fault and how to fix it; and the
one line an entry point says for a file of objectives/ that does not import."""

from __future__ import annotations

import sys
from contextlib import contextmanager

INTERRUPTED = "interrupted: run the same command again to resume (finished steps are kept)"  # Ctrl-C's one line


class ConfigError(ValueError):
    """A configuration problem, stated with the key at fault and how to fix it."""


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
