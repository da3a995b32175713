"""The one exception a bad setting raises, everywhere: one line naming the key at fault and how to fix it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, stated with the key at fault and how to fix it."""
