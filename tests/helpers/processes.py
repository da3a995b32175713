"""Tests that start processes: the CLI in a fresh interpreter, waiting for a condition, finding processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# the environment of a make the user runs: a make run by `make test` passes its level and flags on to the makes the
# tests start, which would then check nothing of their command line (the Makefile checks only at level 0)
MAKE_ALONE = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True, **kw)


WALL_CAP = 1800.0  # seconds: the longest a wait on a process's progress lasts, however loaded the machine


def wait_until(condition, timeout: float, process: subprocess.Popen | int | None = None, poll: float | None = None):
    """Polls ``condition`` every ``poll`` seconds (default: 0.05, or 0.5 with ``process``, whose tree each poll reads
    from /proc) until it returns something truthy (returned) or ``timeout`` seconds pass (None). A kill that must land
    within a run's few steps polls often: a tiny run's steps take a fraction of the default 0.5 s.

    With ``process`` (a Popen, or a pid whose process outlives the wait) the seconds are the CPU seconds its
    process tree spends from now, not the clock's: on a loaded machine (CI beside other work) the wait stretches
    with the work's own pace, so a test fails for a run that makes no progress, never for the load (up to
    WALL_CAP of the clock); a Popen that ends first ends the wait (the condition checked once more)."""
    pid = process if isinstance(process, int) else getattr(process, "pid", None)
    start = time.monotonic()
    base = tree_cpu_seconds(pid) if pid is not None else 0.0

    def spent() -> float:
        return time.monotonic() - start if pid is None else tree_cpu_seconds(pid) - base

    while spent() < timeout and time.monotonic() - start < WALL_CAP:
        value = condition()
        if value:
            return value
        if isinstance(process, subprocess.Popen) and process.poll() is not None:
            return condition() or None
        time.sleep(poll if poll is not None else 0.05 if pid is None else 0.5)
    return None


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its live descendants, with the children each has reaped
    (/proc's utime, stime, cutime, cstime)."""
    parent, ticks = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()  # from the state on: ppid is 1, utime..cstime 11..14
            parent[int(entry.name)], ticks[int(entry.name)] = int(fields[1]), sum(map(int, fields[11:15]))
    tree, frontier = {pid}, [pid]
    while frontier:
        here = frontier.pop()
        children = [child for child, up in parent.items() if up == here and child not in tree]
        tree.update(children)
        frontier += children
    return sum(ticks.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


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
