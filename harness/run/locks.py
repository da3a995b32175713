"""Folder locks: a process holds an exclusive ``flock`` on a lock file while it writes a folder (a run's
``.run.lock``, a sweep's ``.sweep.lock``, the lab's ``.lab.lock``). The kernel drops the lock when the process dies,
even by SIGKILL, so :func:`is_held` tells a live writer from a dead one. A lock file is never followed through a
symbolic link.

The kernel's lock is this machine's (and a file system's that carries it across hosts): a run folder copied from a
cluster while its run goes on (``rsync``) holds no lock here. So a run's lock file also names its writer: the process
holding it records its host, pid and the time of its last heartbeat there (:class:`HeldLock`, refreshed every
:data:`HEARTBEAT_S`; emptied when it lets go), and :func:`writer_elsewhere` reads a record of another host whose
heartbeat is under :data:`STALE_S` old as a writer still alive there. No third-party imports: the analysis reads it
too."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from harness.run.errors import ConfigError

RUN_LOCK = ".run.lock"  # in a run folder, held by the process that trains it
SWEEP_LOCK = ".sweep.lock"  # in results/<exp>/, held by the sweep that runs it
PROBE_GRACE_S = 1.0  # how long a writer tries again before calling a folder busy (a probe is a moment)
HEARTBEAT_S = 30.0  # how often a run's process refreshes the heartbeat its lock file records
STALE_S = 300.0  # a heartbeat of another host older than this is a dead writer's (or that of a copy that old)
HOST = socket.gethostname()
clock = time.time  # the wall clock heartbeats are written and judged by (a test sets its own)


class FolderBusyError(RuntimeError):
    pass


def lock_folder(path: Path, busy: str, heartbeat: bool = False) -> HeldLock:
    """An exclusive lock, held until the returned :class:`HeldLock` is closed (``heartbeat``: which records this
    process and its heartbeat in the file, and refuses, FolderBusyError, a folder whose record names a writer still
    alive on another host: :func:`writer_elsewhere`). Raises FolderBusyError(``busy``) at once if another
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
        except BlockingIOError:
            if not _no_writer(handle) or time.monotonic() >= deadline:
                handle.close()
                raise FolderBusyError(f"{busy}; wait for it or stop it") from None
            time.sleep(0.01)
            continue
        if not heartbeat:
            return HeldLock(handle, heartbeat)
        now = clock()
        if (elsewhere := writer_elsewhere(path, now)) is not None:
            handle.close()
            raise FolderBusyError(f"{busy} {elsewhere.said()}; {TAKE_OVER.format(lock=path)}")
        stale = stale_elsewhere(path, now)  # read before this process's record replaces it
        held = HeldLock(handle, heartbeat)
        held.took_over = stale
        return held


TAKE_OVER = ("wait for it there, or, if it is not running (its job or node died, or this folder is a copy), for its "
             "heartbeat to grow {stale} old, or remove {{lock}} to take the run over now").format(
    stale=f"{STALE_S / 60:g} min")


class HeldLock:
    """A held folder lock (:func:`lock_folder`), released by :meth:`close`. With ``heartbeat``, the lock file holds
    this process's record (:class:`Writer`), rewritten in place every :data:`HEARTBEAT_S` by a daemon thread (the
    file's inode carries the lock: it is never replaced) and emptied when the lock is let go."""

    def __init__(self, handle, heartbeat: bool):
        self.handle, self.heartbeat, self.closed = handle, heartbeat, threading.Event()
        self.thread, self.took_over = None, None  # took_over: another host's stale record found (lock_folder)
        if heartbeat:
            self.beat()
            self.thread = threading.Thread(target=self._beat_until_closed, name="lock-heartbeat", daemon=True)
            self.thread.start()

    def beat(self) -> None:
        data = (json.dumps({"host": HOST, "pid": os.getpid(), "beat": clock()}) + "\n").encode()
        os.pwrite(self.handle.fileno(), data, 0)
        os.ftruncate(self.handle.fileno(), len(data))

    def _beat_until_closed(self) -> None:
        while not self.closed.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):  # a full disk or a lost mount: the next beat tries again
                self.beat()

    def close(self) -> None:
        self.closed.set()
        if self.thread is not None:
            self.thread.join()
        if self.heartbeat:
            with contextlib.suppress(OSError, ValueError):  # ValueError: closed already
                os.ftruncate(self.handle.fileno(), 0)
        self.handle.close()


@dataclass(frozen=True)
class Writer:
    """What a lock file records of the process that holds (or last held) it: its host, pid and last heartbeat (the
    writer's wall clock, seconds since the epoch); ``age``: seconds from that heartbeat to the reader's now."""

    host: str
    pid: int
    beat: float
    age: float

    def said(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.beat))
        return f"on host {self.host} (pid {self.pid}; its last heartbeat at {when}, {_duration(self.age)} ago)"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return (f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200
            else f"{seconds / 3600:.1f} h")


def writer_record(path: Path, now: float | None = None) -> Writer | None:
    """The writer the lock file ``path`` records (its age at ``now``, default :data:`clock`'s), or None: no file, a
    link, an empty file (no holder, or one that let go) or no record of the harness."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        first = handle.read(4096).split(b"\n", 1)[0] if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    try:
        found = json.loads(first)
        host, pid, beat = found["host"], found["pid"], float(found["beat"])
    except (ValueError, TypeError, KeyError):  # ValueError: empty, not JSON or not UTF-8 (a write in progress)
        return None
    if not isinstance(host, str) or type(pid) is not int or beat != beat:
        return None
    return Writer(host, pid, beat, (clock() if now is None else now) - beat)


def writer_elsewhere(path: Path, now: float | None = None) -> Writer | None:
    """The writer the lock file ``path`` records on another host whose heartbeat is less than :data:`STALE_S` old at
    ``now`` (default :data:`clock`'s): alive there as far as this folder tells (a copy of a cluster's run folder, or a
    file system whose locks do not reach across hosts). None for this host's writers (the kernel's lock tells:
    :func:`is_held`) and stale or absent records."""
    writer = writer_record(path, now)
    return writer if writer is not None and writer.host != HOST and writer.age < STALE_S else None


def stale_elsewhere(path: Path, now: float | None = None) -> Writer | None:
    """The writer the lock file ``path`` records on another host whose heartbeat is :data:`STALE_S` old or older at
    ``now``: one a run started here takes over (said in one line)."""
    writer = writer_record(path, now)
    return writer if writer is not None and writer.host != HOST and writer.age >= STALE_S else None


def taken_over(run: str, writer: Writer) -> str:
    """The line a run (or sweep) says when it takes over a run whose lock names a stale writer of another host."""
    return (f"taking over {run}: its lock names a writer {writer.said()}, {STALE_S / 60:g} min or more without a "
            "heartbeat: stopped there (or this folder is a copy that old)")


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
