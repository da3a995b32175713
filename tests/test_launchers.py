"""Sweeps through the launchers (harness/apps/launchers.py): a local Ray cluster and submitit's local executor run
the same tiny sweep as the local launcher, into the same folder layout, with the same metrics; a Ray worker killed
mid-run leaves a stopped run that the same sweep resumes with no step written twice; every launcher error is one
line before any folder exists."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.apps.launchers import AdoptedHandle, SlurmHandle, SlurmLauncher, init_local_ray
from harness.apps.sweep import run_sweep
from harness.run.config import load_experiment
from harness.run.errors import ConfigError
from harness.run.records import read_jsonl, run_status
from tests.helpers.processes import ROOT, cli, processes_with, wait_until
from tests.helpers.tiny import TINY_RUN, without_timing

# Two objectives on a tiny model with a short warm start (so that rewards vary and grpo and gspo runs differ:
# a launcher that mixed runs up would show), STEPS steps (room to kill a run mid-way: two steps in, the rest ahead).
STEPS = 10
SETTINGS = [*TINY_RUN, "threads=1", f"train.steps={STEPS}", "train.max_new_tokens=16", "train.micro_batch_size=0",
            "task.args.digits=1", "task.format_weight=0.5", "model.warm_start_steps=100", "model.warm_start_lr=1e-2",
            "model.warm_start_batch_size=32", "model.warm_start_target=null"]
EXPERIMENT = "sweep:\n  grid:\n    objective.name: [grpo, gspo]\n"


@pytest.fixture(autouse=True)
def ray_outlives_a_lost_gcs(monkeypatch):
    """Ray ends a process whose GCS has not answered for ``gcs_rpc_server_reconnect_timeout_s`` (60 s), with exit
    status 1 and nothing on its output. Under load, a driver client that a ray.shutdown() here left behind did so 60 s
    later and took the pytest worker with it (xdist: "node down", and the suite hung). The tests' processes, and the
    clusters they start (the variable is inherited), keep their GCS clients for a day instead; a test whose cluster is
    lost still fails on its own waits."""
    monkeypatch.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "86400")


def experiment(folder: Path, results: Path, *overrides: str):
    exp = folder / "launch.yaml"
    exp.write_text(EXPERIMENT)
    return load_experiment(str(exp), [*SETTINGS, f"results_dir={results}", *overrides])


def metrics(exp_dir: Path) -> dict[str, list[dict]]:
    manifest = json.loads((exp_dir / "manifest.json").read_text())
    return {r["run_id"]: without_timing(read_jsonl(exp_dir / r["dir"] / "metrics.jsonl")) for r in manifest["runs"]}


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    """The local launcher's sweep (the reference), with a cache of its own that the other launchers' runs share."""
    folder = tmp_path_factory.mktemp("local")
    previous = os.environ.get("RLVR_CACHE")
    os.environ["RLVR_CACHE"] = str(folder / "cache")
    try:
        entries = run_sweep(experiment(folder, folder / "results"), jobs=2, progress=False)
        assert [e["status"] for e in entries] == ["finished", "finished"]
        reference = metrics(folder / "results" / "launch")
        assert len({json.dumps(rows) for rows in reference.values()}) == 2  # grpo's and gspo's runs differ
        assert all(rows[1]["reward_std"] > 0 for rows in reference.values())
        yield folder, reference
    finally:
        if previous is None:
            os.environ.pop("RLVR_CACHE", None)
        else:
            os.environ["RLVR_CACHE"] = previous


def run_and_its_process(exp_dir: Path, objective: str) -> tuple[Path, int | None] | None:
    """The folder of ``objective``'s run in ``exp_dir`` and its live `train` process, found before the run's first
    step (so that a kill or a freeze waits only on the run's steps, polled often); the process is None where the run
    has already finished; None until the folder and the process are there."""
    runs = sorted(exp_dir.glob(f"{objective}-*")) if exp_dir.is_dir() else []
    found = processes_with(f"--run-dir {runs[0]}") if runs else []
    return (runs[0], found[0]) if found else (runs[0], None) if runs and run_status(runs[0]) == "finished" else None


def kill_a_ray_run_mid_sweep(cfg, exp_dir: Path) -> tuple[Path, str] | None:
    """Run ``cfg``'s sweep on the Ray cluster, SIGKILL the Ray worker of its gspo run once that run has logged two
    steps, and return the run's folder and the status its own record calls for; None where the run had ended before
    the kill landed (the poll and the process scan take a moment, in which a tiny run may finish: nothing to resume)."""
    outcome = {}
    sweep = threading.Thread(target=lambda: outcome.update(entries=run_sweep(cfg, progress=False, launcher="ray")))
    sweep.start()

    started = wait_until(lambda: run_and_its_process(exp_dir, "gspo"), timeout=240, process=os.getpid())
    assert started is not None, "the Ray sweep made no progress"
    killed, train = started
    if train is not None:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # it ended since the scan: see its record
            assert os.getpriority(os.PRIO_PROCESS, train) == os.nice(0)  # not Ray's nice 15, where a run beside
            # any other work gets a sliver of a core
            worker = int(Path(f"/proc/{train}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
            # polled often: the kill lands within a poll of the run's second step, most of its STEPS still ahead
            assert wait_until(lambda: len(read_jsonl(killed / "metrics.jsonl")) >= 3, timeout=240,  # eval + 2 steps
                              process=os.getpid(), poll=0.02), "the Ray run made no progress"
            os.kill(worker, signal.SIGKILL)  # the Ray worker running the task; the run dies with it
    sweep.join(timeout=240)
    assert not sweep.is_alive()
    written = json.loads((killed / "summary.json").read_text())
    if written["status"] == "finished":
        return None
    status = {e["run_id"]: e["status"] for e in outcome["entries"]}
    # The worker's death reaches the run in one of two orders, each with its own right status (both resumable): its
    # SIGKILL first (the run dies without a word: its summary still says running, no process holds its lock:
    # "stopped"), or the SIGTERM Ray sends the dead worker's process group first (the run writes "interrupted",
    # SystemExit 143). Checked: the status is the one the run's own record calls for.
    expected = {"running": "stopped", "interrupted": "interrupted"}[written["status"]]
    assert status[killed.name] == expected and sorted(status.values()) == sorted(["finished", expected])
    if expected == "interrupted":
        assert written["error"] == "SystemExit: 143"
    assert json.loads((exp_dir / "manifest.json").read_text())["runs"][1]["status"] == expected
    return killed, expected


@pytest.mark.slow
def test_a_local_ray_cluster_runs_the_sweep_and_a_killed_worker_leaves_it_resumable(local_sweep, tmp_path):
    """A killed Ray worker's run is resumable and the resumed sweep equals the local launcher's. The kill lands when the
    run has logged two steps; where the run ended before it landed (a tiny run on a loaded machine), the sweep runs
    again into a fresh folder: whether the kill came in time is read from the run's record, not assumed from a clock."""
    ray = pytest.importorskip("ray")
    folder, reference = local_sweep
    init_local_ray(ray, num_cpus=2)  # as the launcher starts one: the runs at this process's priority
    try:
        for attempt in range(5):
            cfg = experiment(folder, tmp_path / f"attempt{attempt}")
            exp_dir = tmp_path / f"attempt{attempt}" / "launch"
            if (killed := kill_a_ray_run_mid_sweep(cfg, exp_dir)) is not None:
                break
        assert killed is not None, "each of 5 sweeps ended its run before the kill landed"
        entries = run_sweep(cfg, progress=False, launcher="ray")  # the same sweep again: resumes the killed run
        assert [e["status"] for e in entries] == ["finished", "finished"]
    finally:
        ray.shutdown()
    assert "resuming" in (killed[0] / "train.log").read_text()
    result = metrics(exp_dir)
    assert list(result) == list(reference)  # the same run ids, in the same order
    for run_id, rows in result.items():
        assert [r["step"] for r in rows] == list(range(STEPS + 1)), run_id  # every step once
        assert rows == reference[run_id], run_id  # the local launcher's metrics, the killed run's too


@pytest.mark.parametrize("written, status, error", [
    ("running", "stopped", "Ray: WorkerCrashedError: the worker died"),  # killed before it could write a word
    ("interrupted", "interrupted",  # the SIGTERM to the dead worker's process group reached it first
     "Ray: WorkerCrashedError: the worker died; the run wrote interrupted (SystemExit: 143)")])
def test_a_run_whose_worker_died_gets_the_status_its_own_record_calls_for(tmp_path, capsys, written, status, error):
    """Both orders in which a dying Ray worker's end reaches its run give a resumable status, with the launcher's
    reason said, and no made-up exit code (-9 is the launcher's stand-in for a process it lost)."""
    from types import SimpleNamespace

    from harness.apps.sweep import Child

    (tmp_path / "summary.json").write_text(json.dumps({"status": written, "error": "SystemExit: 143"
                                                       if written == "interrupted" else None}))
    handle = SimpleNamespace(error="Ray: WorkerCrashedError: the worker died")
    child = Child(tmp_path, handle, SimpleNamespace(close=lambda: None), code=-signal.SIGKILL)
    assert child.ended("gspo-s0") == (status, error)
    captured = capsys.readouterr()
    line = captured.out + captured.err
    assert f"run gspo-s0 {status}: {error}; log in" in line and "exit -9" not in line


@pytest.mark.parametrize("written", ["finished", "diverged"])
def test_a_run_that_wrote_its_end_before_its_process_was_lost_keeps_it(tmp_path, capsys, written):
    """A run whose summary says it ended, whose process (or worker) then died before it answered: the sweep called it
    stopped and "not finished", and exited 1. Its own record stands, and the loss is said."""
    from types import SimpleNamespace

    from harness.apps.sweep import Child

    (tmp_path / "summary.json").write_text(json.dumps({"status": written, "error": None}))
    child = Child(tmp_path, SimpleNamespace(error=None), SimpleNamespace(close=lambda: None), code=-signal.SIGKILL)
    assert child.ended("gspo-s0") == (written, None)
    captured = capsys.readouterr()
    assert f"run gspo-s0 {written}; its process was lost after it wrote so (exit -9)" in captured.out + captured.err


@pytest.mark.slow
def test_the_slurm_launcher_runs_the_sweep_with_submitits_local_executor(local_sweep, tmp_path):
    pytest.importorskip("submitit")
    folder, reference = local_sweep
    entries = run_sweep(experiment(folder, tmp_path, "launcher.cluster=local", "launcher.time_min=30"),
                        progress=False, launcher="slurm")
    assert [e["status"] for e in entries] == ["finished", "finished"]
    assert metrics(tmp_path / "launch") == reference
    jobs = [p for p in (tmp_path / "launch" / ".submitit").iterdir() if p.name.isdigit()]
    assert len(jobs) == 3  # the starting policy's preparation, then one job per run


FOLLOWED_STEPS = 40  # the followed run's steps: frozen one step in, it is rarely past its end (else tried again)


def freeze_a_slurm_run_mid_sweep(folder: Path) -> tuple[list[str], Path, int] | None:
    """Start a one-run sweep into ``folder`` through submitit's local executor, freeze (SIGSTOP) its run's `train`
    once it has logged a step, then SIGKILL the sweep's parent (its job lives on, as on a cluster). Returns the
    sweep's overrides, the run's folder and the frozen process; None where the run had ended before the freeze landed
    (the poll and the process scan take a moment, in which a tiny run may finish: nothing is left running to follow),
    after letting that job end."""
    exp = folder / "follow.yaml"
    exp.write_text("sweep:\n  grid:\n    objective.name: [grpo]\n")
    overrides = [*TINY_RUN, f"train.steps={FOLLOWED_STEPS}", "model.warm_start_steps=0", "model.warm_start_target=null",
                 f"results_dir={folder}", "launcher.cluster=local"]
    first = subprocess.Popen([sys.executable, "-m", "harness", "sweep", str(exp), *overrides, "--launcher", "slurm",
                              "--no-progress"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    exp_dir = folder / "follow"

    started = wait_until(lambda: run_and_its_process(exp_dir, "grpo"), timeout=240, process=first)
    assert started is not None, "the first sweep made no progress"
    run_dir, train = started
    if train is not None:
        # polled often: the freeze lands within a poll of the run's first step, most of its FOLLOWED_STEPS ahead
        assert wait_until(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 2 or process_state(train) is None,
                          timeout=240, process=first, poll=0.02), "the run made no progress"
        with contextlib.suppress(ProcessLookupError):  # it ended since: process_state says so below
            os.kill(train, signal.SIGSTOP)
        stopped = wait_until(lambda: process_state(train) in ("T", None), timeout=60)  # None: it had exited
        assert stopped, "the run's process did not stop"
    first.kill()  # the sweep's parent, SIGKILL; its job lives on
    first.wait()
    if train is not None and process_state(train) == "T" and run_status(run_dir) == "running":  # frozen in time
        return overrides, run_dir, train
    if train is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(train, signal.SIGCONT)
    assert wait_until(lambda: not processes_with(f"--run-dir {run_dir}"), timeout=240), "the ended run lives on"
    return None


def process_state(pid: int) -> str | None:
    """The state letter /proc gives process ``pid`` (T: stopped); None once it has exited (or is a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else state


@pytest.mark.slow  # two sweeps through submitit's local executor
def test_a_rerun_sweep_follows_a_slurm_job_still_running_to_its_end_instead_of_submitting_another(tmp_path, capsys,
                                                                                                 monkeypatch):
    """The sweep's parent dies while its SLURM job runs on (submitit's local executor: the job outlives it, as on a
    cluster). Run again, the sweep submitted a second job for the run, whose `train` stopped on the run's lock, was
    reported failed and left the manifest `failed` after the first job finished. Now it follows the first job: one
    job, every step once, the manifest `finished`. The job's run is frozen (SIGSTOP) while the second sweep starts,
    so that it is still running then, whatever the load; where the run had ended before the freeze landed, it is
    tried again in a fresh folder."""
    pytest.importorskip("submitit")
    for attempt in range(5):
        folder = tmp_path / f"try{attempt}"
        folder.mkdir()
        frozen = freeze_a_slurm_run_mid_sweep(folder)
        if frozen is not None:
            break
    else:
        pytest.fail("in 5 tries, the run ended each time before it could be frozen")
    overrides, run_dir, train = frozen
    exp_dir = run_dir.parent
    adopted, real_poll, outcome = threading.Event(), AdoptedHandle.poll, {}
    monkeypatch.setattr(AdoptedHandle, "poll", lambda self: adopted.set() or real_poll(self))
    try:
        sweep = threading.Thread(target=lambda: outcome.update(entries=run_sweep(
            load_experiment(str(folder / "follow.yaml"), overrides), progress=False, launcher="slurm")))
        sweep.start()
        assert adopted.wait(timeout=240), "the second sweep did not follow the running job"
    finally:
        os.kill(train, signal.SIGCONT)
    sweep.join(timeout=240)
    assert not sweep.is_alive() and [e["status"] for e in outcome["entries"]] == ["finished"]
    assert "is still running (job " in capsys.readouterr().out
    assert [r["status"] for r in json.loads((exp_dir / "manifest.json").read_text())["runs"]] == ["finished"]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(FOLLOWED_STEPS + 1))
    assert len([p for p in (exp_dir / ".submitit").iterdir() if p.name.isdigit()]) == 1  # no second job
    assert "being written by another process" not in (run_dir / "train.log").read_text()


@pytest.mark.parametrize("launcher, override, message", [
    ("ray", "launcher.address=127.0.0.1:9", "no Ray cluster answers at launcher.address=127.0.0.1:9: start one"),
    ("slurm", "launcher.cluster=slurm", "--launcher slurm: no `sbatch` on this machine"),
    ("slurm", "launcher.cluster=pbs", "launcher.cluster must be slurm or local"),
    ("ray", "launcher.cpus_per_run=0", "launcher.cpus_per_run must be >= 1"),
    pytest.param("ray", "launcher.gpus_per_run=1", "launcher.gpus_per_run=1, but no node of the Ray cluster has "
                 "more than 0 GPUs", marks=pytest.mark.slow),  # starts a local Ray cluster
])
@pytest.mark.slow
def test_launcher_errors_stop_the_sweep_before_any_folder_exists(tmp_path, monkeypatch, launcher, override,
                                                                  message):
    pytest.importorskip(launcher if launcher == "ray" else "submitit")
    monkeypatch.setattr("shutil.which", lambda name: None)  # no sbatch here, whatever this machine has
    if "gpus_per_run" in override:  # a local Ray cluster without GPUs
        import ray

        init_local_ray(ray, num_cpus=1)
    try:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            run_sweep(experiment(tmp_path, tmp_path / "results", override), progress=False, launcher=launcher)
    finally:
        if "gpus_per_run" in override:
            import ray

            ray.shutdown()
    assert not (tmp_path / "results").exists()


class FakeRay:
    """What the Ray launcher calls of ``ray``, recording the session's starts and shutdowns."""

    def __init__(self):
        self.inits, self.shutdowns, self.cloudpickle = 0, 0, self

    def register_pickle_by_value(self, module):
        pass

    def remote(self, function):
        return function

    def is_initialized(self) -> bool:
        return self.inits > self.shutdowns

    def init(self, **options):
        self.inits += 1

    def shutdown(self):
        self.shutdowns += 1

    def nodes(self) -> list[dict]:
        return [{"Alive": True, "Resources": {"CPU": 2.0}}]


def test_the_ray_session_a_sweep_starts_lasts_until_the_process_exits(tmp_path, monkeypatch):
    """A sweep that started a local Ray cluster leaves it up when it ends (Ray shuts it down at the process's exit):
    a ray.shutdown() can leave a client that ends the process a minute later, in the report or the next sweep. The
    next sweep of the process joins the same session instead of starting another."""
    from harness.apps.launchers import make_launcher

    ray = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", ray)
    settings = experiment(tmp_path, tmp_path / "results").launcher
    for _ in range(2):  # two sweeps of one Python process
        runner = make_launcher("ray", settings, tmp_path)
        runner.check()
        runner.close()
        assert (ray.inits, ray.shutdowns) == (1, 0)


@pytest.mark.slow
@pytest.mark.parametrize("module, extra", [("ray", "ray"), ("submitit", "slurm")])
def test_a_missing_extra_is_one_line_naming_the_pip_command(tmp_path, monkeypatch, module, extra):
    monkeypatch.setitem(__import__("sys").modules, module, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=rf'--launcher {extra} needs .*: pip install -e "\.\[{extra}\]"'):
        run_sweep(experiment(tmp_path, tmp_path / "results"), progress=False, launcher=extra)
    assert not (tmp_path / "results").exists()


@pytest.mark.slow  # a fresh interpreter
def test_the_cli_says_a_launcher_error_in_one_line(tmp_path):
    (tmp_path / "launch.yaml").write_text(EXPERIMENT)
    out = cli("sweep", str(tmp_path / "launch.yaml"), *SETTINGS, f"results_dir={tmp_path}/results", "--launcher",
              "ray", "launcher.address=127.0.0.1:9")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "config error: no Ray cluster answers at launcher.address=127.0.0.1:9: start one there (ray start --head), "
        "fix the address, or leave it empty for a local Ray cluster"]
    assert not (tmp_path / "results").exists()


POPEN = subprocess.Popen  # the real one (the fake_runs fixture replaces it)


class FakeRun:
    """A run's process for the local launcher: records the GPU it was given; ends after ``polls`` polls (or when
    ``ended`` is set)."""

    started: list[FakeRun] = []

    def __init__(self, args, env=None, polls: int = 10**9, **kwargs):
        self.args, self.gpu = args, None if env is None else env["CUDA_VISIBLE_DEVICES"]
        self.env, self.polls, self.ended = env, polls, False
        self.running_at_start = sum(run.returncode is None for run in FakeRun.started)
        FakeRun.started.append(self)

    @property
    def returncode(self):
        return 0 if self.ended or self.polls <= 0 else None

    def poll(self):
        self.polls -= 1
        return self.returncode


@pytest.fixture
def fake_runs(monkeypatch):
    from harness.apps import launchers

    FakeRun.started = []
    monkeypatch.setattr(launchers.subprocess, "Popen", FakeRun)
    return FakeRun.started


def test_the_local_launcher_gives_each_concurrent_run_its_own_gpu(tmp_path, monkeypatch, fake_runs):
    from harness.apps.launchers import LocalLauncher, visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-5e1f,5")  # the user's list: indices or UUIDs, as given
    monkeypatch.setenv("RLVR_MARK", "kept")
    launcher = LocalLauncher()
    assert launcher.gpus == ["3", "GPU-5e1f", "5"] and launcher.default_jobs(cpu_jobs=2) == 3
    for k in range(4):
        launcher.start(["train"], tmp_path / f"{k}.log", f"run{k}")
    assert [run.gpu for run in fake_runs] == ["3", "GPU-5e1f", "5", "3"]  # round-robin while all run
    assert all(run.env["RLVR_MARK"] == "kept" for run in fake_runs)  # the rest of the environment is the sweep's
    fake_runs[1].ended = True  # GPU-5e1f is free again, 3 holds two runs
    fake_runs[2].ended = True
    launcher.start(["train"], tmp_path / "4.log", "run4")
    launcher.start(["train"], tmp_path / "5.log", "run5")
    assert [run.gpu for run in fake_runs[4:]] == ["GPU-5e1f", "5"]
    for listed, gpus in (("", []), ("0,-1,2", ["0"]), (" 1, 2 ", ["1", "2"])):  # CUDA reads up to a bad entry
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
        assert visible_gpus() == gpus
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    assert visible_gpus() == ["0", "1"]
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    cpu = LocalLauncher()
    assert cpu.gpus == [] and cpu.default_jobs(cpu_jobs=2) == 2
    cpu.start(["train"], tmp_path / "cpu.log", "cpu")
    assert fake_runs[-1].env is None  # no GPU: the sweep's environment, untouched


@pytest.mark.slow
def test_a_local_sweep_runs_one_run_per_gpu_at_once_by_default(tmp_path, monkeypatch, fake_runs):
    from harness.apps import sweep

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    monkeypatch.setattr(sweep, "prepare_starting_policies", lambda runs, progress: None)
    # the sweep's other commands (git, for the code record) still run
    monkeypatch.setattr("harness.apps.launchers.subprocess.Popen", lambda args, **kwargs: POPEN(args, **kwargs)
                        if args[0] == "git" else FakeRun(args, polls=3, **kwargs))
    cfg = load_experiment("base", [*TINY_RUN, f"results_dir={tmp_path}", "name=exp",
                                   "sweep.grid.seed=[0,1,2]"])
    sweep.run_sweep(cfg, progress=False)
    assert len(fake_runs) == 3 and max(run.running_at_start for run in fake_runs) == 1  # two at once
    assert [run.gpu for run in fake_runs[:2]] == ["0", "1"] and {run.gpu for run in fake_runs} == {"0", "1"}
    FakeRun.started.clear()
    sweep.run_sweep(load_experiment("base", [*TINY_RUN, f"results_dir={tmp_path}", "name=again",
                                             "sweep.grid.seed=[0,1,2]"]), jobs=1, progress=False)
    assert [run.running_at_start for run in fake_runs] == [0, 0, 0]  # --jobs wins


def test_more_jobs_than_runs_share_the_cores_among_the_runs(tmp_path, monkeypatch, fake_runs):
    """`sweep --jobs 100` for 3 runs on a machine without GPUs: each run was given 1/100 of the free cores (one torch
    thread on any machine), not a third of them (the sixth hostile pass: accepted silently)."""
    from harness.apps import launchers, sweep

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    monkeypatch.setattr(sweep, "prepare_starting_policies", lambda runs, progress: None)
    monkeypatch.setattr(launchers, "free_threads", lambda: (12, 12, 0.0))  # 12 cores, all free
    monkeypatch.setattr("harness.apps.launchers.subprocess.Popen", lambda args, **kwargs: POPEN(args, **kwargs)
                        if args[0] == "git" else FakeRun(args, polls=3, **kwargs))
    cfg = load_experiment("base", [*TINY_RUN, f"results_dir={tmp_path}", "name=exp", "sweep.grid.seed=[0,1,2]",
                                   "launcher.runs_per_process=1"])  # a process per run: its arguments are seen
    sweep.run_sweep(cfg, jobs=100, progress=False)
    assert [run.args[run.args.index("--threads") + 1] for run in fake_runs] == ["4", "4", "4"]
    assert [run.running_at_start for run in fake_runs] == [0, 1, 2]  # all three at once


def test_a_run_killed_by_a_signal_is_said_so_not_by_its_logs_header(tmp_path, capsys):
    """A run process killed with SIGKILL before it wrote a word: the sweep gave its train.log's last line (the run's
    header, "native run on cpu ...") as the reason."""
    from types import SimpleNamespace

    from harness.apps.sweep import Child

    (tmp_path / "summary.json").write_text(json.dumps({"status": "running", "error": None}))
    (tmp_path / "train.log").write_text("native run on cpu, float32, model tiny ... -> somewhere\n")
    child = Child(tmp_path, SimpleNamespace(error=None), SimpleNamespace(close=lambda: None), code=-signal.SIGKILL)
    assert child.ended("gspo-s0") == ("stopped", "killed by SIGKILL")
    captured = capsys.readouterr()
    assert "run gspo-s0 stopped (exit -9): killed by SIGKILL; log in" in captured.out + captured.err


@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
def test_a_cluster_sweep_leaves_the_gpu_check_to_the_runs_node(tmp_path, monkeypatch, capsys, device):
    """A GPU sweep submitted from a login node without a GPU (docs/cluster.md: profile=gpu, device=cuda) was refused
    there ("device=cuda, but this torch is a CPU-only build"), though its runs execute on the cluster's GPU nodes. The
    device and its memory are now checked where the run executes: the sweep goes on to its launcher's own checks
    (here: no sbatch), while `train` on this machine still refuses the device."""
    import torch

    from harness.apps.cli import main
    from harness.run.config import check_this_machine, run_configs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a login node without a GPU, whatever this is
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr("shutil.which", lambda name: None)  # and without sbatch: the launcher's check is reached
    (tmp_path / "launch.yaml").write_text(EXPERIMENT)
    settings = [*SETTINGS, f"device={device}", f"results_dir={tmp_path / 'results'}"]
    runs = run_configs(load_experiment(str(tmp_path / "launch.yaml"), settings))
    check_this_machine(runs, node=False)
    with pytest.raises(ConfigError, match=f"device={device}, but "):
        check_this_machine(runs)
    assert main(["sweep", str(tmp_path / "launch.yaml"), *settings, "launcher.gpus_per_run=4", "--launcher", "slurm",
                 "launcher.cluster=slurm"]) == 2
    assert capsys.readouterr().err.startswith("config error: --launcher slurm: no `sbatch` on this machine")
    assert main(["train", str(tmp_path / "launch.yaml"), *settings]) == 2
    assert f"config error: device={device}, but " in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("launcher, overrides, message", [
    ("slurm", ["device=cuda"], r"device=cuda, but launcher.gpus_per_run=0: each run's job \(--launcher slurm\) sees "
     "only the GPUs it asks for, as cuda:0 and on; set launcher.gpus_per_run=1"),
    ("ray", ["device=cuda:1", "launcher.gpus_per_run=1"], "device=cuda:1, but launcher.gpus_per_run=1: .*set "
     r"device=cuda \(the job's first GPU\), or launcher.gpus_per_run=2")])
def test_a_cluster_run_on_a_gpu_its_job_does_not_ask_for_is_refused_before_anything_is_submitted(
        tmp_path, monkeypatch, launcher, overrides, message):
    """device=cuda with launcher.gpus_per_run=0 (its default) was submitted: every SLURM job was allocated no GPU,
    and every Ray task (Ray 2.60 leaves a task that asks for none every GPU of its node) put its run on cuda:0 of its
    node, GPUs that Ray had reserved for nobody or for other tasks. Now one line before any folder or job."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the machine the sweep starts from: no GPU
    monkeypatch.setitem(sys.modules, launcher if launcher == "ray" else "submitit", None)  # nothing would start
    with pytest.raises(ConfigError, match=message):
        run_sweep(experiment(tmp_path, tmp_path / "results", *overrides), progress=False, launcher=launcher)
    assert not (tmp_path / "results").exists()


class RecordingTask:
    """What the Ray launcher submits: the options and arguments of each task."""

    def __init__(self):
        self.submitted = []

    def options(self, **options):
        self.submitted.append({"options": options})
        return self

    def remote(self, *args):
        self.submitted[-1]["args"] = args
        return "ref"


@pytest.mark.parametrize("gpus, env", [(0, {"CUDA_VISIBLE_DEVICES": ""}), (1, {})])
def test_a_cluster_run_sees_the_gpus_its_job_asked_for_and_no_others(tmp_path, monkeypatch, gpus, env):
    """With launcher.gpus_per_run=0 a Ray task's run saw every GPU of its node (Ray 2.60 sets no CUDA_VISIBLE_DEVICES
    for a task that asks for none), as did a SLURM job's on a node that does not fence its devices: device=auto put
    each run on cuda:0, beside the runs that reserved it. Its process is now given no GPU; with GPUs, the ones Ray
    or SLURM set."""
    from harness.apps.launchers import SlurmLauncher, make_launcher

    ray = FakeRay()
    task = RecordingTask()
    ray.remote = lambda function: task
    monkeypatch.setitem(sys.modules, "ray", ray)
    settings = experiment(tmp_path, tmp_path / "results", f"launcher.gpus_per_run={gpus}").launcher
    runner = make_launcher("ray", settings, tmp_path)
    ray.nodes = lambda: [{"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}}]
    runner.check()
    runner.start(["train"], tmp_path / "train.log", "run")
    assert task.submitted[0]["options"]["num_gpus"] == gpus and task.submitted[0]["args"][3] == env
    submitted = []
    slurm = SlurmLauncher(settings, tmp_path / ".submitit")
    (tmp_path / ".submitit").mkdir()
    slurm.executor = type("Executor", (), {"update_parameters": lambda self, **kw: None,
                                           "submit": lambda self, *args: submitted.append(args) or
                                           type("Job", (), {"job_id": "7"})()})()
    slurm.start(["train"], tmp_path / "train.log", "run")
    assert submitted[0][4] == env
    # a GPU asked of SLURM through slurm_args (gres) is the job's too: not hidden
    from omegaconf import OmegaConf

    from harness.apps.launchers import gpu_env

    assert gpu_env(OmegaConf.create({"gpus_per_run": 0, "slurm_args": {"gres": "gpu:1"}})) == {}


def test_an_empty_ray_address_starts_a_local_cluster_even_where_ray_address_is_set(tmp_path, monkeypatch):
    """launcher.address empty (docs/cluster.md: the sweep starts a local Ray cluster) with RAY_ADDRESS set, as on a
    Ray cluster's nodes (or after a `ray start` on this machine): ray.init() without an address joined that cluster
    and refused the local cluster's settings, a ValueError traceback ("When connecting to an existing cluster,
    _system_config must not be provided"). The init now asks for a new local cluster, whatever the environment: Ray's
    own reading of its address says so."""
    real = pytest.importorskip("ray")
    from ray._private.services import canonicalize_bootstrap_address

    from harness.apps.launchers import make_launcher

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    ray = FakeRay()
    ray.init = lambda **options: setattr(ray, "options", options) or setattr(ray, "inits", ray.inits + 1)
    monkeypatch.setitem(sys.modules, "ray", ray)
    make_launcher("ray", experiment(tmp_path, tmp_path / "results").launcher, tmp_path).check()
    assert ray.options["_system_config"] == {"worker_niceness": 0}
    assert canonicalize_bootstrap_address(ray.options.get("address")) is None  # None: Ray starts a new cluster
    assert real.is_initialized() is False


def test_settings_the_chosen_launcher_does_not_read_are_named_in_one_note(tmp_path, capsys):
    """--launcher ray with launcher.partition, time_min, mem_gb, slurm_args set (SLURM's) ignored them without a word,
    as --launcher slurm did launcher.address: one note now names them before anything starts (not an error: an
    experiment file may carry both launchers' settings); settings at their defaults are not named."""
    from harness.apps.launchers import make_launcher

    slurm = ["launcher.partition=gpu", "launcher.time_min=60", "launcher.mem_gb=8", "launcher.slurm_args.qos=high"]
    make_launcher("ray", experiment(tmp_path, tmp_path / "results", *slurm, "launcher.address=auto").launcher,
                  tmp_path)
    assert capsys.readouterr().err.splitlines() == [
        "note: --launcher ray does not read launcher.partition, launcher.time_min, launcher.mem_gb, "
        "launcher.slurm_args (another launcher's settings: ignored here; docs/cluster.md)"]
    make_launcher("slurm", experiment(tmp_path, tmp_path / "results", *slurm, "launcher.address=auto").launcher,
                  tmp_path)
    assert capsys.readouterr().err.splitlines() == [
        "note: --launcher slurm does not read launcher.address (another launcher's settings: ignored here; "
        "docs/cluster.md)"]
    for name in ("local", "ray", "slurm"):
        make_launcher(name, experiment(tmp_path, tmp_path / "results").launcher, tmp_path)
    assert capsys.readouterr().err == ""


def fake_slurm_commands(folder: Path, commands: dict[str, str]) -> str:
    """``commands``: name -> shell script body, made executable in ``folder``; the PATH that finds them first."""
    folder.mkdir()
    for name, body in commands.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.parametrize("commands, message", [
    ({"sbatch": "echo 'sbatch: error: invalid partition specified: gpux' >&2; exit 1", "srun": "exit 0"},
     r"config error: sbatch refused the job prepare-grpo-s0-\w+: sbatch: error: invalid partition specified: gpux; "
     r"check launcher.partition, time_min, gpus_per_run, cpus_per_run, mem_gb and slurm_args, or, for a limit on the "
     r"jobs one may queue, give --jobs N \(make: JOBS=N\)"),
    ({"sbatch": "exit 1"}, r'config error: --launcher slurm: Could not detect "srun", are you indeed on a slurm '
     r"cluster\? \(submitit starts each job with srun\): submit from a SLURM login node")])
def test_a_slurm_refusal_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys, commands, message):
    """sbatch refusing a job (a partition, account, QOS or time limit it does not accept; a cap on queued jobs) ended
    the sweep in submitit's FailedJobError traceback, with sbatch's lines printed once more before it; a login node
    with sbatch but no srun in submitit's RuntimeError traceback. Each is now one line, exit 2, before any run."""
    pytest.importorskip("submitit")
    from harness.apps.cli import main

    monkeypatch.setenv("PATH", fake_slurm_commands(tmp_path / "bin", commands))
    (tmp_path / "launch.yaml").write_text(EXPERIMENT)
    assert main(["sweep", str(tmp_path / "launch.yaml"), *SETTINGS, f"results_dir={tmp_path / 'results'}",
                 "launcher.partition=gpux", "--launcher", "slurm", "--no-progress", "--no-report"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.match(message, err), err
    assert not list((tmp_path / "results").glob("launch/*/metrics.jsonl"))


@pytest.mark.slow  # two tiny runs, one through a fake SLURM job, one a local sweep's: make test
def test_a_sweep_under_another_launcher_follows_the_slurm_jobs_a_dead_sweep_left_queued(tmp_path, monkeypatch):
    """A --launcher slurm sweep whose process died while its jobs were queued (fake sbatch / sacct: the job stays
    PENDING until the test runs it), then the sweep run again with --launcher local: it trained the queued job's run
    here without a word, and when the job started later it trained (or re-exported) the run a second time. Now the
    sweep names the queued runs and the scancel command in one line, follows the job (taking none of its --jobs: the
    other run trains here meanwhile) and starts nothing for it; the job trains it once; stopping is not needed."""
    pytest.importorskip("submitit")
    from harness.apps.launchers import make_launcher
    from harness.run.config import run_configs, run_id

    queue, cancelled = tmp_path / "queue", tmp_path / "cancelled"
    queue.touch()
    monkeypatch.setenv("PATH", fake_slurm_commands(tmp_path / "bin", {
        "sbatch": f'id=$((1000 + $(wc -l < {queue}))); echo "$id PENDING" >> {queue}; echo "Submitted batch job $id"',
        "sacct": f'echo "JobID|State|NodeList"; while read id state; do echo "$id|$state|"; done < {queue}',
        "scancel": f'echo "$@" >> {cancelled}', "srun": "exit 0"}))
    cfg = experiment(tmp_path, tmp_path / "results", "model.warm_start_steps=0", "train.steps=2",
                     "launcher.cluster=slurm")
    exp_dir = tmp_path / "results" / "launch"
    grpo, gspo = (exp_dir / run_id(run) for run in run_configs(cfg))
    earlier = make_launcher("slurm", cfg.launcher, exp_dir)  # the earlier sweep: it submitted grpo's job, then died
    earlier.check()
    grpo.mkdir(parents=True)
    (grpo / "config.yaml").write_text(OmegaConf.to_yaml(run_configs(cfg)[0]))
    job_args = ["train", str(grpo / "config.yaml"), "--run-dir", str(grpo), "--threads", "1", "--no-progress"]
    earlier.start(job_args, grpo / "train.log", grpo.name)
    outcome, said = {}, []
    monkeypatch.setattr("harness.apps.sweep.tqdm.write", lambda line, file=None: said.append(line))
    sweep = threading.Thread(target=lambda: outcome.update(entries=run_sweep(cfg, jobs=1, progress=False)))
    sweep.start()
    try:
        assert wait_until(lambda: run_status(gspo) == "finished", timeout=240), "the local run did not finish"
        assert not (grpo / "metrics.jsonl").exists()  # not trained here while its job is queued
        subprocess.run([sys.executable, "-m", "harness", *job_args], cwd=ROOT, check=True,  # the job starts
                       capture_output=True)
    finally:
        queue.write_text("1000 COMPLETED\n")
    sweep.join(timeout=240)
    assert not sweep.is_alive() and [e["status"] for e in outcome["entries"]] == ["finished", "finished"]
    notes = [line for line in said if line.startswith("note: 1 run(s) belong to SLURM jobs")]
    assert notes == [f"note: 1 run(s) belong to SLURM jobs an earlier sweep submitted that are still queued or running "
                     f"({grpo.name}: job 1000): this sweep (--launcher local) follows them to their end instead of "
                     "training them a second time; to run them here instead, stop it, cancel them (scancel 1000) and "
                     "run it again"]
    assert [r["step"] for r in read_jsonl(grpo / "metrics.jsonl")] == [0, 1, 2]
    assert len(json.loads((grpo / "summary.json").read_text())["segments"]) == 1  # one start: trained once
    assert not cancelled.exists()


class Touches:
    """A pickle that creates a file when unpickled: what a job's result put in place of submitit's would hold."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_the_slurm_job_folders_are_this_users_alone_and_a_linked_or_foreign_one_is_refused(tmp_path, monkeypatch):
    """results/<exp>/.submitit holds the pickled call each job unpickles and each job's pickled result, which the
    sweep unpickles: a result pickle put there ran its code in the sweep process (`sweep --launcher slurm`). The
    folder is made 0700 (an earlier sweep's is closed); a link there, or another user's folder, is refused."""
    pytest.importorskip("submitit")
    settings = experiment(tmp_path, tmp_path / "results", "launcher.cluster=local").launcher
    folder = tmp_path / ".submitit"
    SlurmLauncher(settings, folder).check()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    folder.chmod(0o755)
    SlurmLauncher(settings, folder).check()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    folder.rmdir()
    (tmp_path / "theirs").mkdir()
    folder.symlink_to(tmp_path / "theirs")
    with pytest.raises(ConfigError, match=rf"^--launcher slurm: {folder} is a symbolic link \(to {tmp_path}/theirs\): "
                                          "its jobs and the sweep unpickle the files there"):
        SlurmLauncher(settings, folder).check()
    assert not list((tmp_path / "theirs").iterdir())
    folder.unlink()
    folder.mkdir()
    monkeypatch.setattr(os, "getuid", lambda: folder.stat().st_uid + 1)
    with pytest.raises(ConfigError, match=rf"^--launcher slurm: {folder} belongs to another user"):
        SlurmLauncher(settings, folder).check()


def test_a_slurm_result_in_job_folders_open_to_others_is_not_unpickled(tmp_path):
    from types import SimpleNamespace

    result = tmp_path / ".submitit" / "7" / "7_0_result.pkl"
    result.parent.mkdir(parents=True)
    result.write_bytes(pickle.dumps(Touches(tmp_path / "ran")))
    job = SimpleNamespace(job_id="7", done=lambda: True, paths=SimpleNamespace(result_pickle=result),
                          result=lambda: pickle.loads(result.read_bytes()))
    (tmp_path / ".submitit").chmod(0o777)  # open to others: what is in it may be anyone's
    handle = SlurmHandle(job)
    assert handle.poll() == 1 and not (tmp_path / "ran").exists()
    assert handle.error == (f"SLURM job 7: {tmp_path / '.submitit'} is open to other users (mode 777); its result is "
                            "not read (unpickling it runs code)")
    (tmp_path / ".submitit").chmod(0o700)
    handle.poll()  # this user's alone: read as submitit reads it
    assert (tmp_path / "ran").exists()
