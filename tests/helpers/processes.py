"""Tests that start processes: the CLI in a fresh interpreter, waiting for a condition, finding processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True, **kw)


def wait_until(condition, timeout: float):
    """Polls ``condition`` until it returns something truthy (returned) or ``timeout`` seconds pass (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    return None


def processes_with(marker: str) -> list[int]:
    """Live processes other than this one whose command line contains ``marker`` (zombies have none)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in command:
                pids.append(int(entry.name))
    return pids
