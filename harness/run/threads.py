"""Torch's CPU threads, chosen and set in one place.

torch's default is one OpenMP thread per core. Beside another busy process that oversubscribes the cores: a
parallel region waits for its slowest thread, and a thread that lost its core makes the others spin at the
barrier, and a step takes many times longer than with one thread (``python -m harness bench --busy`` measures it
on any machine; docs/threads.md has a measured table). So a run's thread count, unless set, is the number of cores
free when it starts (the cores this process may use minus those other processes keep busy), with a one-line note
when that is fewer than the cores; and it stays with the run: a resume uses the count the run started with, since
CPU reductions may round differently with another count and a resume must reproduce the uninterrupted run.

    threads = run_threads(cfg.threads, previous)   # the one call that sets torch's threads for a run
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from harness.run.errors import ConfigError

_PREFERRED = 0  # the process's --threads (a sweep's share of the cores), set by the CLI; 0: none


def prefer(threads: int) -> None:
    """What a run without its own ``threads`` uses in this process (``python -m harness train --threads N``)."""
    global _PREFERRED
    _PREFERRED = max(0, threads)


def check_count(threads: int, key: str) -> None:
    """Refuse (ConfigError) a thread count given for a run (``key``: the setting or option that gave it) above the
    cores this process may run on, before the run's folder exists: torch would start that many OpenMP threads, and
    beyond the machine's limits the run ends later in a traceback or a segfault (on any machine it crawls)."""
    available = cores()
    if threads > available:
        raise ConfigError(f"{key}={threads} is more than the {available} cores this process may run on: give at most "
                          f"{available} (0: the cores free when the run starts; docs/threads.md)")


def cores() -> int:
    """The cores this process may run on (its CPU affinity; all of them where the OS has no affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_cores(window_s: float = 0.3) -> float:
    """How many cores other processes keep busy: the larger of the 1-minute load average and the busy share of
    the CPUs over ``window_s`` now (/proc/stat; the load average alone lags a process that has just started).
    This process sleeps meanwhile, so it is not counted."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    try:
        first = _cpu_times()
        time.sleep(window_s)
        second = _cpu_times()
    except OSError:
        return load
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])  # idle + iowait
    now = (1 - idle / total) * (os.cpu_count() or 1) if total > 0 else 0.0
    return max(load, now)


def _cpu_times() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def free_threads() -> tuple[int, int, float]:
    """(threads, cores, busy): the cores free now (at least 1), the cores this process may use, the busy ones."""
    available, busy = cores(), busy_cores()
    return max(1, min(available, math.floor(available - busy + 0.5))), available, busy


def run_threads(threads: int = 0, previous: int | None = None) -> int:
    """Set torch's CPU threads for a run and return the count: the run's ``threads`` setting if > 0; else the count
    it started with (``previous``, from its summary.json: a resume keeps it); else the process's preference
    (:func:`prefer`); else $OMP_NUM_THREADS when set; else the cores free now, with a one-line note on stderr when
    that is fewer than the cores."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    if threads == 0 and previous:
        threads = previous
        if _PREFERRED == 0 and free_threads()[0] < previous:
            print(f"note: the machine is busier than when this run started: it keeps its {previous} torch threads "
                  "(a resume with the same count reproduces the uninterrupted run)", file=sys.stderr)
    threads = threads or _PREFERRED
    if threads == 0 and os.environ.get("OMP_NUM_THREADS"):
        threads = torch.get_num_threads()  # the user's (or make test-fast's) OMP_NUM_THREADS
    if threads == 0:
        threads, available, busy = free_threads()
        if threads < available:
            print(f"note: {busy:.1f} of {available} cores are busy with other processes: {threads} torch "
                  f"thread{'s' if threads > 1 else ''} (threads=N sets it)", file=sys.stderr)
    torch.set_num_threads(threads)
    return threads


@contextmanager
def fixed_threads(threads: int) -> Iterator[None]:
    """torch's CPU threads at ``threads`` inside the block, the caller's count restored after it (the warm start's
    fixed count: harness/policy/warm_start.py)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
