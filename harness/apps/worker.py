"""A worker: one process that trains a local sweep's runs one after another, so that they share its start-up (the
interpreter and the imports of torch and transformers, several seconds of CPU per process) instead of paying it per
run. harness/apps/launchers.py's LocalLauncher starts one per job (``launcher.runs_per_process``).

    python -m harness worker <results folder>     # reads requests on stdin, one JSON line each:
        {"args": ["train", "<run_dir>/config.yaml", "--run-dir", "<run_dir>", ...], "log": "<run_dir>/train.log"}
    # and answers each on stdout with one line: the run's exit status, as `python -m harness <args>` would exit

Each request runs exactly as its own process would: ``harness.apps.cli.main(args)``, which the CLI passes in (the
same checks, the same ``train``), with the process's stdout and stderr appended to the request's log for its
duration, so a run's train.log, lock, summary and provenance are what a process of its own writes. Every run sets its
own random streams and torch threads (harness/loop/native.py, harness/run/threads.py), so its metrics are bit-equal
to those of a process of its own (tests/test_worker.py). A signal that stops the run (SIGTERM: "interrupted") ends
the worker with it; the sweep starts another for the next run. The results folder on the command line only names the
worker in a process list (``make soak`` finds a sweep's runs by it).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import IO


@contextmanager
def output_to(log: str):
    """This process's stdout and stderr (the file descriptors, so that tqdm's and logging's streams follow) appended
    to ``log`` inside the block, restored after it."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for descriptor in (fd, *saved):
            os.close(descriptor)


def serve(requests: IO[str], main: Callable[[list[str]], int]) -> int:
    """Run each request of ``requests`` (module docstring) with ``main`` (the CLI's: ``main(args)`` as
    ``python -m harness <args>``) and answer its exit status on this process's stdout (a copy of it: stdout itself
    goes to stderr between runs, so that nothing else reaches the sweep's pipe); 0 when the requests end (the sweep
    closed the pipe)."""
    from harness.run.provenance import code_record

    code_record()  # the code this process imported, recorded before a later edit of the checkout could be read
    gc.freeze()  # the imports' objects live as long as the process: a run's gc.collect (loop/build.py) skips them
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in requests:
        try:
            request = json.loads(line)
            log, args = request["log"], request["args"]
            if not (isinstance(log, str) and os.path.isdir(os.path.dirname(log) or ".") and isinstance(args, list)):
                raise TypeError("a log in a folder that exists, and a list of arguments")
        except (ValueError, TypeError, KeyError) as e:  # not the sweep's protocol: said in one line, not run
            print(f"error: a worker request is one JSON object per line with 'log' and 'args' (the sweep sends them; "
                  f"harness/apps/worker.py), got {line.strip()[:80]!r} ({type(e).__name__}: {e})", file=sys.stderr)
            answers.write("2\n")
            answers.flush()
            continue
        with output_to(log):
            status = main(args)
        answers.write(f"{status}\n")
        answers.flush()
    return 0
