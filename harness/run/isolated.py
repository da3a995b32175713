"""A function run in a child process of its own, each call under a time limit: for code that reads text a model wrote
and may never return or may end its process (reasoning-gym's scorers ``eval()`` or sympy-parse a completion's answer:
``9**9**9`` never ends, ``os._exit(0)`` ends the process). The training process only waits, so a call that runs past
its limit is abandoned (the child killed, a new one started at the next call), and one that ends its child is
reported, both as an :class:`Outcome` the caller turns into a score; on Linux a child holds at most MEMORY_LIMIT
bytes of data, so an answer that asks for more raises MemoryError there instead of taking the machine's memory. What
the code does to files it can reach is not contained: this is a time, memory and crash boundary, not a sandbox.

    call = IsolatedCall(functools.partial(method_of, SomeClass, "score", config=config), timeout_s=10.0)
    outcome = call(answer, entry)       # Outcome("value", 1.0) | ("raised", "ZeroDivisionError: ...") |
                                        # ("timed out", ...) | ("ended", "exit code 0")

The child is a fresh interpreter (nothing of the training process's threads or locks; not multiprocessing's ``spawn``,
which would run a user's script again as its main module) that builds its function once; the time limit counts each
call, not the start. Arguments and results cross its standard input and a copy of its standard output, pickled between
this process and its own child, never read from a file; what the function prints goes to standard error.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import NamedTuple

MEMORY_LIMIT = 4 * 2**30  # bytes of data a child may hold (RLIMIT_DATA, Linux): past it, a MemoryError in the call
START_TIMEOUT_S = 600  # a child's start (an interpreter and the imports its function needs), however loaded the machine


class Outcome(NamedTuple):
    """How a call ended: ``kind`` "value" (``detail`` the function's result), "raised" (the exception, as text),
    "timed out" or "ended" (the child process ended during the call: its exit code)."""

    kind: str
    detail: object


def method_of(cls, name: str, /, **kwargs) -> Callable:
    """``getattr(cls(**kwargs), name)``: a bound method built in the child (a partial of this pickles by reference)."""
    return getattr(cls(**kwargs), name)


def serve() -> None:
    """The child: read its function's builder from standard input, build it, say so, then answer calls until the
    parent closes its end. Standard output becomes standard error, so what the function prints stays out of the
    answers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which ends this child
    with contextlib.suppress(ImportError, ValueError, OSError, AttributeError):  # no such limit on this platform
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_LIMIT, MEMORY_LIMIT))  # an answer that asks for more
    calls, answers = Connection(os.dup(0), writable=False), Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    function = calls.recv()()
    answers.send("ready")
    while True:
        try:
            args = calls.recv()
        except (EOFError, OSError):
            return
        try:
            outcome = Outcome("value", function(*args))
        except BaseException as error:  # noqa: BLE001 - SystemExit from an eval()'d "exit()" included
            outcome = Outcome("raised", f"{type(error).__name__}: {error}"[:300])
        answers.send(outcome)


def die_with_parent() -> Callable[[], None] | None:
    """A child's ``preexec_fn``, made here in the parent: on Linux the child gets SIGKILL when the process that
    started it dies, even deep in a call that never returns (a parent killed with SIGKILL closes no pipe in time to
    stop it); elsewhere None. libc is opened before the fork, so the child between fork and exec only calls it (a
    ``dlopen`` there could wait for ever on a lock another thread of the parent held at the fork)."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _stderr_identity() -> tuple[int, int] | None:
    """The file behind this process's standard error (device, inode), which a child started now writes to."""
    try:
        info = os.fstat(2)
    except OSError:
        return None
    return info.st_dev, info.st_ino


class IsolatedCall:
    """``build()``'s function, called in a child process (started at the first call, again after one was killed or
    ended, or once this process's standard error goes to another file, as a worker's next run's log: the child's
    lines go where this process's go), each call within ``timeout_s`` seconds."""

    def __init__(self, build: Callable[[], Callable], timeout_s: float):
        self.build, self.timeout_s = build, timeout_s
        self._process = self._connection = self._calls = self._stderr = None

    def __call__(self, *args) -> Outcome:
        if self._process is not None and self._stderr != _stderr_identity():  # e.g. a worker's next run's log
            self.close()  # the child writes where this process's stderr went when it started: start one for here
        if self._process is None:
            self._start()
        try:
            self._calls.send(args)
            if self._connection.poll(self.timeout_s):
                return self._connection.recv()
            outcome = Outcome("timed out", f"over {self.timeout_s:g} s")
        except (EOFError, OSError):  # the child ended during the call (os._exit, a crash, killed from outside)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(5)
            outcome = Outcome("ended", f"exit code {self._process.returncode}")
        except BaseException:  # interrupted while the child works (Ctrl-C): its answer would be the next call's
            self.close()
            raise
        self.close()
        return outcome

    def _start(self) -> None:
        self._stderr = _stderr_identity()
        paths = [path or os.getcwd() for path in sys.path]  # the imports this process resolves, the same there
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from harness.run.isolated import serve; serve()"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
            preexec_fn=die_with_parent())
        self._calls = Connection(os.dup(self._process.stdin.fileno()), readable=False)
        self._connection = Connection(os.dup(self._process.stdout.fileno()), writable=False)
        self._process.stdin.close()
        self._process.stdout.close()
        try:
            self._calls.send(self.build)  # a builder that does not pickle raises here: the child is ended too
            try:
                ready = self._connection.poll(START_TIMEOUT_S) and self._connection.recv() == "ready"
            except (EOFError, OSError):  # the child ended while it built its function
                ready = False
            if not ready:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._process.wait(5)
                code = self._process.returncode
                raise RuntimeError("the isolated function's process " + (
                    f"was not ready within {START_TIMEOUT_S} s" if code is None else
                    f"ended (exit code {code}) while it built its function (its error is above)"))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the child, if one runs (killed: it may be deep in a call that never returns)."""
        if self._process is None:
            return
        for end in (self._calls, self._connection):
            with contextlib.suppress(OSError):
                end.close()
        self._process.kill()
        self._process.wait()
        self._process = self._connection = self._calls = None
