"""Folder locks tell a live writer from a dead one (harness/run/locks.py)."""

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.run.locks import FolderBusyError, is_held, lock_folder


def test_lock_is_exclusive_and_is_held_sees_it(tmp_path):
    path = tmp_path / ".run.lock"
    assert not is_held(path) and not path.exists()  # probing never creates the file
    handle = lock_folder(path, "busy")
    assert is_held(path)
    with pytest.raises(FolderBusyError, match="busy; wait for it or stop it"):
        lock_folder(path, "busy")
    handle.close()
    assert not is_held(path)


def test_a_killed_holder_releases_the_lock(tmp_path):
    path = tmp_path / ".run.lock"
    code = ("import sys, time; from pathlib import Path; from harness.run.locks import lock_folder; "
            f"h = lock_folder(Path({str(path)!r}), 'busy'); print('locked', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout.readline().strip() == "locked"
        assert is_held(path)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        time.sleep(0.05)
        assert not is_held(path)  # the kernel dropped the dead process's lock
    finally:
        proc.kill()


def test_a_writer_is_not_refused_by_a_readers_probe_of_its_lock(tmp_path, monkeypatch):
    """is_held probes with a shared lock for a moment; a run that started in that moment was refused as "being written
    by another process". Now the writer tries again for PROBE_GRACE_S; a writer that holds the lock is still refused.
    The probe ends when the writer first waits (no clock: the same whatever the load)."""
    from types import SimpleNamespace

    from harness.run import locks

    path = tmp_path / ".run.lock"
    path.touch()
    with open(path, "rb") as probe:  # a reader's probe, still held when the writer first tries
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        waits = []
        monkeypatch.setattr(locks, "time", raising=False, value=SimpleNamespace(  # the module's clock alone
            monotonic=time.monotonic, sleep=lambda s: waits.append(s) or fcntl.flock(probe, fcntl.LOCK_UN)))
        handle = lock_folder(path, "busy")
    assert waits and is_held(path)
    monkeypatch.undo()
    with pytest.raises(FolderBusyError, match="busy; wait for it or stop it"):
        lock_folder(path, "busy")
    handle.close()


def test_a_folder_a_writer_holds_is_refused_at_once_and_one_readers_hold_only_after_the_grace(tmp_path, monkeypatch):
    """A writer's exclusive hold is told from readers' shared probes: refused without waiting (the writer was waited on
    for PROBE_GRACE_S, as if it were a probe). Readers holding it longer than the grace still get the folder refused.
    The module's clock is a counter: the same whatever the load."""
    from types import SimpleNamespace

    from harness.run import locks

    path = tmp_path / ".run.lock"
    waits = []

    def clock():  # each reading a quarter of the grace later than the one before
        now = iter(range(1000))
        return SimpleNamespace(monotonic=lambda: next(now) * locks.PROBE_GRACE_S / 4, sleep=waits.append)

    monkeypatch.setattr(locks, "time", clock(), raising=False)
    writer = lock_folder(path, "busy")
    with pytest.raises(FolderBusyError, match="busy; wait for it or stop it"):
        lock_folder(path, "busy")
    assert waits == []  # no wait for a writer
    writer.close()
    with open(path, "rb") as reader:  # a reader that holds on past the grace
        fcntl.flock(reader, fcntl.LOCK_SH | fcntl.LOCK_NB)
        monkeypatch.setattr(locks, "time", clock(), raising=False)
        with pytest.raises(FolderBusyError, match="busy; wait for it or stop it"):
            lock_folder(path, "busy")
    assert len(waits) == 3  # tried again at a quarter, a half and three quarters of the grace, then refused
    assert not is_held(path)  # nothing left held
