"""harness/run/isolated.py: a function called in a child process of its own, each call under a time limit."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.run import isolated
from harness.run.isolated import IsolatedCall, Outcome


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="a timer signal interrupts the call")
def test_a_call_interrupted_while_its_child_works_leaves_no_answer_for_the_next_call():
    """Ctrl-C (a KeyboardInterrupt caught by the caller: a worker's run returns 130 and the worker goes on, a
    notebook) while the child worked left its answer in the pipe: the next call read the interrupted call's answer,
    and every later call the one before its own."""
    call = IsolatedCall(functools.partial(eval, "eval"), timeout_s=10)
    assert call("1 + 1") == Outcome("value", 2)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            call("__import__('time').sleep(600) or 'interrupted'")  # no answer before the interrupt, whatever the load
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    try:
        assert call("'second'") == Outcome("value", "second")
        assert call("'third'") == Outcome("value", "third")
    finally:
        call.close()


@pytest.mark.slow  # a call run to its 1-second limit, children started again (seconds): make test
def test_a_call_past_its_limit_or_that_ends_its_child_is_said_and_the_next_call_gets_a_new_child():
    call = IsolatedCall(functools.partial(eval, "eval"), timeout_s=1)
    try:
        assert call("__import__('time').sleep(30)") == Outcome("timed out", "over 1 s")
        assert call("__import__('os')._exit(3)") == Outcome("ended", "exit code 3")
        assert call("exit()").kind == "raised"  # SystemExit in the child is an answer, not its end
        assert call(f"{sys.maxsize} + 1") == Outcome("value", sys.maxsize + 1)
    finally:
        call.close()


def test_a_builder_that_does_not_pickle_is_raised_at_every_call_and_leaves_no_child():
    """The builder was sent outside the start's clean-up: its TypeError left the child started, waiting for a builder
    for as long as the caller lived, and the next call sent that child its arguments as the builder ("ended")."""
    call = IsolatedCall(functools.partial(getattr, sys, "exit"), timeout_s=5)  # a module does not pickle
    for _ in range(2):
        with pytest.raises(TypeError, match="pickle"):
            call(0)
        assert call._process is None


def test_a_child_writes_where_this_process_stderr_goes_now(tmp_path):
    """A worker process trains runs one after another, each with stderr on its own train.log: the child, started under
    the first run, went on writing into that run's log during the next ones. A child is started again once stderr
    goes to another file."""
    import os

    call = IsolatedCall(functools.partial(eval, "eval"), timeout_s=60)
    saved = os.dup(2)
    try:
        for name in ("first.log", "second.log"):
            fd = os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT, 0o644)
            os.dup2(fd, 2)
            os.close(fd)
            assert call(f"__import__('sys').stderr.write('{name}\\n') and None") == Outcome("value", None)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        call.close()
    assert [(tmp_path / name).read_text() for name in ("first.log", "second.log")] == ["first.log\n", "second.log\n"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA bounds mappings on Linux")
def test_a_call_that_asks_for_more_memory_than_the_childs_limit_raises_there():
    """An answer that asks for a huge allocation ran in the child with the machine's memory as its only bound (a
    MemoryError now, within MEMORY_LIMIT; the allocation below is never touched, so it costs no memory without the
    limit either)."""
    from harness.run.isolated import MEMORY_LIMIT

    call = IsolatedCall(functools.partial(eval, "eval"), timeout_s=60)
    try:
        outcome = call(f"len(bytearray({2 * MEMORY_LIMIT}))")
        assert outcome.kind == "raised" and outcome.detail.startswith("MemoryError"), outcome
        assert call("1 + 1") == Outcome("value", 2)  # the same child goes on
    finally:
        call.close()


def test_the_childs_death_signal_is_resolved_in_the_parent_and_only_called_in_the_child(monkeypatch):
    """``preexec_fn`` runs in the child between fork and exec, where opening libc (``dlopen``) can wait for ever on a
    lock that another thread of the parent held at the fork: it must only call what the parent resolved."""
    opened, called = [], []

    class FakeLibc:
        def __init__(self, name, use_errno=False):
            opened.append(name)
            self.prctl = lambda *args: called.append(args)

    monkeypatch.setattr(isolated.ctypes, "CDLL", FakeLibc)
    preexec = isolated.die_with_parent()
    assert opened == ["libc.so.6"] and called == []
    monkeypatch.setattr(isolated.ctypes, "CDLL", None)  # nothing left to open in the child
    preexec()
    assert called == [(1, signal.SIGKILL)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_dies_when_its_parent_is_killed(tmp_path):
    """A parent killed with SIGKILL closes no pipe in time: its child, deep in a call that never returns, must go."""
    script = ("import functools, os, sys\n"
              "from harness.run.isolated import IsolatedCall\n"
              "call = IsolatedCall(functools.partial(eval, 'eval'), timeout_s=3600)\n"
              f"call(\"open({str(tmp_path / 'pid')!r}, 'w').write(str(__import__('os').getpid())) "
              "and __import__('time').sleep(3600)\")\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=Path(isolated.__file__).parents[2])
    pid_file = tmp_path / "pid"
    for _ in range(6000):  # the child has written its pid (a few seconds; the bound is far above any load)
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait()

    def gone() -> bool:
        try:
            return "zombie" in Path(f"/proc/{child}/status").read_text()
        except FileNotFoundError:
            return True

    try:
        for _ in range(3000):  # the signal is sent at the parent's death; the bound only ends a failing test
            if gone():
                break
            time.sleep(0.1)
        assert gone(), "the child outlived its killed parent"
    finally:
        if not gone():
            os.kill(child, signal.SIGKILL)
