"""Folder locks: a process holds an exclusive ``flock`` on a lock file while it writes a folder (a run's
``.run.lock``, a sweep's ``.sweep.lock``, the lab's ``.lab.lock``). The kernel drops the lock when the process dies,
even by SIGKILL, so :func:`is_held` tells a live writer from a dead one. No third-party imports: the analysis
reads it too."""

from __future__ import annotations

import fcntl
from pathlib import Path

RUN_LOCK = ".run.lock"  # in a run folder, held by the process that trains it
SWEEP_LOCK = ".sweep.lock"  # in results/<exp>/, held by the sweep that runs it


class FolderBusyError(RuntimeError):
    pass


def lock_folder(path: Path, busy: str):
    """An exclusive lock held while the returned file stays open; raises FolderBusyError(``busy``) if another
    process holds it."""
    handle = open(path, "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise FolderBusyError(f"{busy}; wait for it or stop it") from None
    return handle


def is_held(path: Path) -> bool:
    """Whether a live process holds the lock file ``path`` (False when the file does not exist). Probes with a
    non-blocking shared lock, released at once, and never creates or truncates the file."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False
