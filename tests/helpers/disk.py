"""A full disk on demand (a failing fsync of a named file) and the temporaries a writer left, for the tests of
atomic writes and full disks."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def temporaries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if ".tmp" in p.name)


def fill_disk_at(monkeypatch, name: str, after: int = 0, code: int = errno.ENOSPC):
    """Make the ``after``-th and later flushes to disk (fsync) of a file named ``name`` fail with ``code``, as
    the kernel reports a full disk: what was written stays in the file (a temporary's part, a torn line)."""
    fsync, calls = os.fsync, []

    def failing(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == name:
            calls.append(fd)
            if len(calls) > after:
                raise OSError(code, os.strerror(code))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    return calls
