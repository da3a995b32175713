"""Nothing written twice, nothing lost without a word, every failure one line, end to end through the command line
(the run's files: tests/test_records.py; the config's errors: tests/test_config.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.apps.cli import main
from harness.loop.native import train
from harness.run.records import read_jsonl
from tests.helpers.tiny import TINY_RUN, VARIED_REWARD, tiny_run, without_timing

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True, **kw)


@pytest.mark.slow  # a whole run (or several): make test
def test_an_interruption_after_the_step0_evaluation_writes_step0_once(tmp_path, monkeypatch):
    run = tiny_run(tmp_path, VARIED_REWARD, "train.eval_every=1")
    train(run, tmp_path / "full", progress=False)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:  # Ctrl-C right after the step-0 line, before the first checkpoint
        patch.setattr("harness.loop.pipeline.collect_batch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train(run, tmp_path / "part", progress=False)
    assert [r["step"] for r in read_jsonl(tmp_path / "part" / "metrics.jsonl")] == [0]
    assert json.loads((tmp_path / "part" / "summary.json").read_text())["status"] == "interrupted"
    train(run, tmp_path / "part", progress=False)
    part, full = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("part", "full"))
    assert [r["step"] for r in part] == [0, 1, 2] and without_timing(part) == without_timing(full)
    samples = [r["step"] for r in read_jsonl(tmp_path / "part" / "eval_samples.jsonl")]
    assert samples == [0] * 8 + [1] * 8 + [2] * 8


@pytest.mark.slow  # a fresh interpreter
def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    """Each case through the CLI's main() here (its exit status: what it returns, or argparse's SystemExit), and one
    through a fresh interpreter: its exit code, and nothing else on stderr (an import's warning would be a line)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1,\n")
    cases = [(("train", str(bad)), "not valid YAML at line 3"), (("train", "quickstart", "train.lr=-1"), "train.lr"),
             *((("sweep", "quickstart", "--jobs", jobs), "--jobs: must be an integer >= 1") for jobs in ("0", "-1"))]
    for args, message in cases:
        try:
            status = main(list(args))
        except SystemExit as e:
            status = e.code
        err = capsys.readouterr().err
        assert status == 2 and err.count("\n") == 1 and message in err, (args, err)
    (args, message), *_ = cases
    out = cli(*args)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


@pytest.mark.parametrize("installed", ["5.23.0", "6.0.0"])
def test_a_transformers_outside_the_requirement_is_refused_in_one_line_before_anything_starts(
        installed, monkeypatch, capsys, tmp_path, request):
    import importlib.metadata

    from harness.apps.cli import installed_version, unmet_requirement

    assert unmet_requirement() is None  # the environment the suite runs in meets pyproject's requirements
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: installed if name == "transformers" else version(name))
    installed_version.cache_clear()  # looked up once per process: as if this transformers had been there all along
    request.addfinalizer(installed_version.cache_clear)  # and the real one again for the tests after this one
    assert main(["train", "quickstart", f"results_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: transformers {installed} is installed, the harness needs transformers<6,>=5.24: "
                   "run `make setup` (or `pip install -e .`) again\n")
    assert not any(tmp_path.iterdir())  # nothing started

@pytest.mark.slow
def test_ctrl_c_prints_how_to_resume(tmp_path):
    # a suite started in the background by a non-interactive shell inherits SIGINT ignored: give the run Ctrl-C back
    proc = subprocess.Popen([sys.executable, "-m", "harness", "train", "base", *TINY_RUN, "train.steps=500",
                             "--run-dir", str(tmp_path / "run"), "--no-progress"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) < 2:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted: run the same command again to resume" in err, (proc.returncode, err)
    assert "Traceback" not in err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_a_soak_kill_counts_only_once_its_signal_is_sent_and_a_sweep_that_ends_first_is_reported(tmp_path,
                                                                                                   monkeypatch, capsys):
    """A sweep that has already ended when its kill is due gets no signal, and no kill is logged for it (the soak said
    "2 kills" where one was sent); a soak whose sweeps end before any kill fails with a line saying so, not a loop."""
    import random
    import tempfile

    from harness.apps import soak

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    monkeypatch.setattr(soak, "harness", lambda *args, **kwargs: ended)
    monkeypatch.setattr(soak, "wait_for", lambda condition, timeout: False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the soak's mkdtemp makes its folder
    (tmp_path / "tmp").mkdir()
    (tmp_path / "soak").mkdir()
    (tmp_path / "soak" / "manifest.json").write_text("{}")  # as the sweep left it
    log = []
    assert soak.kill_round(random.Random(0), ["sweep", "x"], tmp_path / "soak", log, kills=3) == [] and log == []
    assert soak.main(main, kills=2, out=tmp_path / "out") == 1  # its soak.json, not over a real soak's in results/
    (kept,) = (tmp_path / "tmp").iterdir()  # a failed soak keeps its sweeps, and says where
    assert "soak: FAIL: 0 kills" in (printed := capsys.readouterr().out) and f"; the sweeps kept in {kept})" in printed
    assert json.loads((tmp_path / "out" / "soak.json").read_text())["sweeps_kept_in"] == str(kept)


@pytest.mark.slow  # starts processes
def test_a_soak_stopped_by_ctrl_c_stops_its_sweeps_and_removes_its_folder(tmp_path, monkeypatch):
    """Each of the soak's sweeps runs in a session of its own, out of a Ctrl-C's reach: a soak stopped by one left its
    sweep running and its temporary folder behind. Now both go; a process of the user's that names the folder (a
    ``tail -f``, here one that is not ``python -m harness``) is left alone."""
    import tempfile

    from harness.apps import soak

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the soak's mkdtemp makes its folder
    (tmp_path / "tmp").mkdir()
    started = []

    def interrupted_round(rng, args, exp_dir, log, kills):  # a sweep of the soak's own started, then Ctrl-C
        work = exp_dir.parent.parent
        sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
        started.append(subprocess.Popen([*sleep, "-m", "harness", "sweep", str(work / "soak.yaml")],
                                        start_new_session=True))
        started.append(subprocess.Popen([*sleep, str(work)]))  # the user's
        raise KeyboardInterrupt

    monkeypatch.setattr(soak, "kill_round", interrupted_round)
    try:
        with pytest.raises(KeyboardInterrupt):
            soak.main(main, kills=2, out=tmp_path / "out")
        sweep, users = started
        assert sweep.wait(timeout=60) == -signal.SIGKILL  # a bound on a hang only: it is killed at once
        assert users.poll() is None and list((tmp_path / "tmp").iterdir()) == []
        assert not (tmp_path / "out").exists()
    finally:
        for process in started:
            process.kill()
            process.wait()


def test_stopping_the_soaks_processes_gives_up_on_one_it_may_not_kill(tmp_path, monkeypatch):
    """A harness process naming the soak's folder that this user may not kill (PermissionError) held the soak's
    stop in a loop for ever; it is tried STOP_ROUNDS times."""
    from harness.apps import soak

    tries = []
    monkeypatch.setattr(soak, "processes_naming", lambda folder, kinds=(): [1])
    monkeypatch.setattr(soak.os, "kill", lambda pid, sig: tries.append(pid) or (_ for _ in ()).throw(PermissionError))
    monkeypatch.setattr(soak, "wait_for", lambda condition, timeout: False)
    soak.stop_processes_in(tmp_path)
    assert tries == [1] * soak.STOP_ROUNDS


def test_a_soaks_first_kill_comes_at_once_where_every_run_is_past_step_0(tmp_path, monkeypatch):
    """The step-0 window is brief in each run. Where the soak missed it in every run (its process off the core a
    moment), it waited 30 s for a window that had passed, the tiny sweep ended on its own first, no kill
    landed and the soak failed: now the kill comes at once, logged as random. A fake clock and a fake sweep."""
    import random
    from types import SimpleNamespace

    from harness.apps import soak

    clock = {"now": 0.0}  # the soak's own clock (its module's `time`), not the time module of everything else
    monkeypatch.setattr(soak, "time", SimpleNamespace(monotonic=lambda: clock["now"],
                                                      sleep=lambda s: clock.update(now=clock["now"] + s)))

    class Sweep:  # ends on its own 15 s in, unless killed first
        pid, returncode = 4242, None

        def poll(self):
            if self.returncode is None and clock["now"] >= 15:
                self.returncode = 0
            return self.returncode

        def wait(self):
            return self.poll()

        def kill(self):
            self.returncode = -9

    exp_dir = tmp_path / "soak"
    for run in ("grpo-s0-aa", "gspo-s0-bb"):  # both past step 0: two metrics lines, a checkpoint
        (exp_dir / run / "checkpoints").mkdir(parents=True)
        (exp_dir / run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    sent = []
    monkeypatch.setattr(soak, "harness", lambda *args, **kwargs: Sweep())
    monkeypatch.setattr(soak, "run_processes", lambda folder: [])
    monkeypatch.setattr(soak, "check_files", lambda folder: [])
    monkeypatch.setattr(soak.os, "kill", lambda pid, sig: sent.append(pid))
    log = []
    assert soak.kill_round(random.Random(0), ["sweep", "x"], exp_dir, log, kills=1) == []
    assert sent == [4242] and [entry["moment"] for entry in log] == ["random"] and clock["now"] < 1


@pytest.mark.slow
def test_soak_kills_and_resumes_without_loss(capsys, tmp_path, monkeypatch):
    """The soak's command in this process (its sweeps are processes it starts and kills), on shorter runs, one at a
    time (make soak KILLS=10 is the real soak: 30 steps, two runs at once). Its record goes where --out says (the
    checkout's results/soak, a user's last real soak, is not touched) and, as it passes, its sweeps' temporary folder
    is removed."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the soak's mkdtemp makes its folder
    (tmp_path / "tmp").mkdir()
    mine = ROOT / "results" / "soak" / "soak.json"
    before = mine.stat().st_mtime_ns if mine.exists() else None
    assert main(["soak", "--kills", "2", "--seed", "1", "--steps", "10", "--jobs", "1",
                 "--out", str(tmp_path / "out")]) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "soak: PASS: 2 kills" in printed and f"; {tmp_path / 'out' / 'soak.json'})" in printed
    record = json.loads((tmp_path / "out" / "soak.json").read_text())
    assert record["passed"] and record["kills"] == 2 and record["sweeps_kept_in"] is None
    assert (mine.stat().st_mtime_ns if mine.exists() else None) == before
    assert not list((tmp_path / "tmp").iterdir())  # the sweeps' folder, gone


def test_the_soak_takes_a_sweep_killed_before_its_first_write_and_not_a_lost_manifest(tmp_path):
    """On a loaded machine the soak's kill came before the sweep wrote anything, and the soak failed on the missing
    manifest (a CI run beside other work); a manifest lost after a run has begun is still a problem."""
    from harness.apps.soak import check_files

    assert check_files(tmp_path) == []
    (tmp_path / "grpo-s0-1234abcd").mkdir()
    (tmp_path / "grpo-s0-1234abcd" / "config.yaml").write_text("seed: 0\n")
    assert [p.split(":")[0] for p in check_files(tmp_path)] == [str(tmp_path / "manifest.json")]


def test_the_cli_stops_on_sigint_even_when_started_with_sigint_ignored():
    """A shell's background job starts with SIGINT ignored; the CLI installs Python's handler itself, so Ctrl-C /
    kill -INT still stops it (the soak's SIGINT kills and users' `kill -INT` of a background sweep rely on it)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["list"]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_soak_out_that_is_a_file_or_empty_is_one_line_before_the_soak(tmp_path, capsys, monkeypatch):
    """soak --out <a file> ran the whole soak (about a minute), then a FileExistsError traceback writing soak.json,
    its temporary folder left behind; --out "" was the default folder (the twenty-third hostile pass)."""
    from harness.apps import soak
    from harness.apps.cli import main

    monkeypatch.setattr(soak, "kill_round", lambda *args: pytest.fail("the soak started"))
    (tmp_path / "file").write_text("")
    for out, said in ((tmp_path / "file", f"cannot make soak folder {tmp_path / 'file'}: {tmp_path / 'file'} is a "
                                          "file, not a folder; give --out a folder you can write"),
                      ("", "soak --out is empty: give a folder, or leave --out out for results/soak")):
        assert main(["soak", "--kills", "1", "--steps", "3", "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"config error: {said}\n"
