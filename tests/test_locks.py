"""Folder locks tell a live writer from a dead one (harness/run/locks.py)."""

import fcntl
import json
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


def foreign_record(path, host="node17", pid=4242, beat=1_000_000.0):
    """The record a run's process on another host leaves in its lock file (a folder copied from a cluster mid-run)."""
    path.write_text(json.dumps({"host": host, "pid": pid, "beat": beat}) + "\n")


def test_a_lock_records_its_writer_and_heartbeat_refreshes_it_and_letting_go_empties_it(tmp_path, monkeypatch):
    """A folder's lock is this machine's: a copy (rsync) of a cluster's run folder holds none here, so the run's lock
    file also records its writer (host, pid, last heartbeat), rewritten by a heartbeat thread and emptied on close.
    The clock is injected: a counter."""
    from harness.run import locks

    beats = iter(range(1000, 2000))
    monkeypatch.setattr(locks, "clock", lambda: float(next(beats)))
    monkeypatch.setattr(locks, "HEARTBEAT_S", 0.01)
    path = tmp_path / ".run.lock"
    held = lock_folder(path, "busy", heartbeat=True)
    first = json.loads(path.read_text())
    assert first["host"] == locks.HOST and first["pid"] == os.getpid() and first["beat"] >= 1000
    deadline = time.monotonic() + 30
    while json.loads(path.read_text() or "{}").get("beat", 0) == first["beat"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert json.loads(path.read_text())["beat"] > first["beat"]  # the thread beat again
    held.close()
    assert path.read_text() == "" and not is_held(path)
    plain = lock_folder(path, "busy")
    assert path.read_text() == ""  # a plain lock records nothing
    plain.close()


def test_a_fresh_writer_of_another_host_is_alive_and_a_stale_one_is_taken_over(tmp_path, monkeypatch):
    """The rule on a recorded writer of another host, at injected times: alive while its heartbeat is under STALE_S
    old (a second writer is refused, naming its host and how to take the run over), stale after (taken over, said
    by took_over); a record of this host is the kernel's lock's business (is_held), never alive by its heartbeat."""
    from harness.run import locks
    monkeypatch.setattr(locks, "HOST", "this-test-host")  # never node17, even on a cluster node of that name

    path = tmp_path / ".run.lock"
    foreign_record(path, beat=1_000_000.0)
    assert locks.writer_elsewhere(path, now=1_000_000.0 + 10).host == "node17"
    assert locks.writer_elsewhere(path, now=1_000_000.0 + locks.STALE_S) is None
    assert locks.stale_elsewhere(path, now=1_000_000.0 + locks.STALE_S).pid == 4242
    monkeypatch.setattr(locks, "clock", lambda: 1_000_000.0 + 40)
    with pytest.raises(FolderBusyError, match=r"busy on host node17 \(pid 4242; its last heartbeat at .*, 40 s ago\); "
                                              r"wait for it there, or, if it is not running .* or remove .*\.run\.lock "
                                              "to take the run over now"):
        lock_folder(path, "busy", heartbeat=True)
    assert json.loads(path.read_text())["host"] == "node17"  # the refused writer left the record as it was
    monkeypatch.setattr(locks, "clock", lambda: 1_000_000.0 + locks.STALE_S + 1)
    held = lock_folder(path, "busy", heartbeat=True)
    assert held.took_over.host == "node17" and json.loads(path.read_text())["host"] == locks.HOST
    held.close()
    foreign_record(path, host=locks.HOST, beat=1_000_000.0)  # this host's writer, dead: no heartbeat makes it alive
    monkeypatch.setattr(locks, "clock", lambda: 1_000_000.0)
    assert locks.writer_elsewhere(path) is None
    held = lock_folder(path, "busy", heartbeat=True)
    assert held.took_over is None
    held.close()
    for junk in ("", "{not json", '{"host": "node17"}', '{"host": "n", "pid": "1", "beat": 1}'):
        path.write_text(junk)
        assert locks.writer_record(path) is None
