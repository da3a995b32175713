"""Folder locks: a process holds an exclusive ``flock`` on a lock file while it writes a folder (a run's
``.run.lock``, a sweep's ``.sweep.lock``, the lab's ``.lab.lock``). The kernel drops the lock when the process dies,
even by SIGKILL, so :func:`is_held` tells a live writer from a dead one. A lock file is never followed through a
symbolic link. No third-party imports: the analysis reads it too."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from harness.run.errors import ConfigError

RUN_LOCK = ".run.lock"  # in a run folder, held by the process that trains it
SWEEP_LOCK = ".sweep.lock"  # in results/<exp>/, held by the sweep that runs it
PROBE_GRACE_S = 1.0  # how long a writer tries again before calling a folder busy (a probe is a moment)


class FolderBusyError(RuntimeError):
    pass


def lock_folder(path: Path, busy: str):
    """An exclusive lock held while the returned file stays open. Raises FolderBusyError(``busy``) at once if another
    process holds it exclusively (a writer), and only after :data:`PROBE_GRACE_S` if readers hold it shared that long
    (a reader's :func:`is_held` holds it for a moment: a run that starts then is not refused); ConfigError if ``path``
    is a symbolic link or not a plain file (never followed: in a shared results folder a link would let anyone make
    the next writer truncate or create a file of theirs)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ConfigError(_not_a_lock(path)) from None
    handle = os.fdopen(fd, "w")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        handle.close()
        raise ConfigError(_not_a_lock(path))
    deadline = time.monotonic() + PROBE_GRACE_S
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if not _no_writer(handle) or time.monotonic() >= deadline:
                handle.close()
                raise FolderBusyError(f"{busy}; wait for it or stop it") from None
            time.sleep(0.01)


def _no_writer(handle) -> bool:
    """Whether no process holds the lock of ``handle`` exclusively (a writer): a non-blocking shared hold, granted
    only then and released at once. A writer refused while this holds is waiting on readers' probes, a moment each."""
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(handle, fcntl.LOCK_UN)
    return True


def check_lock_file(path: Path) -> None:
    """Refuse (ConfigError, one line) a lock file that is a symbolic link or not a plain file, before anything
    starts (:func:`lock_folder` refuses it too, when it takes the lock)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise ConfigError(_not_a_lock(path))


def _not_a_lock(path: Path) -> str:
    return (f"{path} is a symbolic link or not a plain file, so it is not used as a lock (it is never followed); "
            "remove it, and run again: the harness makes its own empty lock file")


def is_held(path: Path) -> bool:
    """Whether a live process holds the lock file ``path`` (False when the file does not exist, or is a symbolic
    link or not a plain file: no lock of the harness). Probes with a non-blocking shared lock, released at once, and
    never creates, truncates or follows the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        if e.errno == errno.ELOOP:
            return False
        raise
    with os.fdopen(fd, "rb") as handle:
        return stat.S_ISREG(os.fstat(fd).st_mode) and not _no_writer(handle)
