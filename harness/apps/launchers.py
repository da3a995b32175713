"""Where the runs of a sweep execute: ``python -m harness sweep EXP --launcher local|ray|slurm``.

    launcher = make_launcher("ray", cfg.launcher)   # the launcher section of the experiment (harness/run/config.py)
    launcher.check()                                 # one-line ConfigError before any run starts
    handle = launcher.start(["train", config, "--run-dir", run_dir, ...], log=run_dir / "train.log", name=run_id)
    handle.poll()                                    # None while it runs, then its exit code (< 0: killed)
    handle.stop()                                    # SIGTERM (the run writes "interrupted"), then wait
    launcher.adopt(name) or adopt_lock_holder(run_dir)   # a rerun: the earlier sweep's job, or whoever holds the lock

Every launcher executes the same command, ``python -m harness train <run_dir>/config.yaml --run-dir <run_dir>``,
with its output appended to the run's ``train.log``: ``local`` as a child process of the sweep (on a machine with
GPUs, each with a GPU of its own: ``CUDA_VISIBLE_DEVICES``, :class:`LocalLauncher`), ``ray`` as a Ray task
(``launcher.cpus_per_run`` / ``gpus_per_run`` as the task's resources) that starts the same child process on the node
Ray picks, ``slurm`` as one submitit job per run (partition, time, GPUs from the launcher section). So the sweep loop
(harness/apps/sweep.py) is one code path: the results folder, run ids, the run's lock, "skip finished, resume the
rest", the progress bars and the report are the same whichever launcher runs it. On a cluster the checkout, the
results folder and ``$RLVR_CACHE`` (the cached starting policies) must be on a file system every node sees.

A child process dies with the process that started it (the sweep, the Ray worker, the SLURM job's process), so a
killed worker leaves a stopped run (its summary says running, no process holds its lock), which the same sweep
command resumes. A SLURM job outlives the sweep that submitted it: the sweep records each job's id beside the job
folders, and a sweep run again while the job is queued or running waits for it (:meth:`SlurmLauncher.adopt`)
instead of submitting a second job for the same run; so does any sweep whose run's lock another process holds (a
run started by hand, a job whose record is lost: :func:`adopt_lock_holder`). The manifest then follows that run
to its real end. Ray and submitit are optional (``pip install -e ".[ray]"``, ``".[slurm]"``); they are imported here
only when their launcher is chosen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from harness.run import isolated
from harness.run.atomic import atomic_write
from harness.run.commandline import LAUNCHERS
from harness.run.config import LauncherConfig
from harness.run.errors import ConfigError
from harness.run.isolated import die_with_parent
from harness.run.locks import RUN_LOCK, is_held
from harness.run.threads import free_threads

ROOT = Path(__file__).resolve().parents[2]  # the checkout: a job's working directory, so ``-m harness`` imports it
FORWARDED_ENV = ("PYTHONPATH", "GSM8K_DIR", "HF_HOME", "HF_HUB_OFFLINE", "OMP_NUM_THREADS")  # and every RLVR_*
STOP_WAIT_S = 60  # how long stop() waits for a run to write "interrupted" before killing it
JOB_RECORD = "{name}.job"  # beside a SLURM launcher's job folders: the id (and cluster) of the job submitted as <name>
JOB_FOLDER = ".submitit"  # in results/<exp>/: the SLURM launcher's job folders and records


def forwarded_env() -> dict[str, str]:
    """The sweep's settings a run reads from the environment (caches, data, threads), for a Ray task's worker."""
    return {k: v for k, v in os.environ.items() if k in FORWARDED_ENV or k.startswith("RLVR_")}


def open_log(log: str | Path):
    """``log`` opened for appending, never through a symbolic link (OSError ELOOP: in a shared results folder a link
    would let anyone have the run append to a file of theirs)."""
    return os.fdopen(os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "a")


def run_harness(args: list[str], log: str, cwd: str, env: dict[str, str]) -> int:
    """``python -m harness <args>`` with this machine's Python, output appended to ``log``; its exit code. What a Ray
    task or a SLURM job executes. Cancelled (KeyboardInterrupt, SIGTERM), it stops the child with SIGTERM first."""
    with open_log(log) as out:
        proc = subprocess.Popen([sys.executable, "-m", "harness", *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=cwd, env={**os.environ, **env}, preexec_fn=die_with_parent())
        previous = signal.signal(signal.SIGTERM, lambda *_: proc.terminate())  # scancel, a SLURM time limit
        try:
            return proc.wait()
        except BaseException:
            proc.terminate()
            proc.wait()
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)


class RunHandle(Protocol):
    error: str | None  # the launcher's own reason when the run's process was lost (a Ray worker died, ...)

    def poll(self) -> int | None: ...

    def stop(self) -> None: ...


class Launcher(Protocol):
    name: str

    def check(self) -> None: ...

    def threads(self, jobs: int) -> int: ...

    def start(self, args: list[str], log: Path, name: str) -> RunHandle: ...

    def adopt(self, name: str) -> RunHandle | None: ...  # the job an earlier sweep started as ``name``, still alive

    def close(self) -> None: ...


@dataclass
class Job:
    """A ``python -m harness <args>`` command for :func:`run_each`, logged to ``log``, known to the launcher as
    ``name`` (one an earlier call started under that name and still alive is adopted, not started again)."""

    key: Hashable  # the caller's name for it, handed back when it ends
    args: list[str]
    log: Path
    name: str
    begin: Callable[[], None] | None = None  # called just before it is started (not when adopted): what it reads


def run_each(jobs: list[Job], runner: Launcher, at_once: int,
             ended: Callable[[Job, int, RunHandle], bool]) -> None:
    """Run ``jobs`` through ``runner``, in order, ``at_once`` at a time, polling each second. ``ended(job, exit code,
    handle)`` as each one ends: when it returns True, those still running are stopped and those not begun dropped;
    when it raises (or anything else interrupts the loop), those still running are stopped and it propagates."""
    waiting, active = list(jobs), {}
    try:
        while waiting or active:
            while waiting and len(active) < at_once:
                job = waiting.pop(0)
                handle = runner.adopt(job.name)
                if handle is None:
                    if job.begin is not None:
                        job.begin()
                    handle = runner.start(job.args, job.log, job.name)
                active[job.key] = (job, handle)
            done = [(job, code, handle) for job, handle in active.values() if (code := handle.poll()) is not None]
            stop = False
            for job, code, handle in done:
                del active[job.key]
                stop = ended(job, code, handle) or stop
            if stop:
                waiting.clear()
                break
            if active and not done:
                time.sleep(1.0)
    finally:
        for _, handle in active.values():
            handle.stop()


class AdoptedHandle:
    """A run's process this sweep did not start: polled until ``alive()`` says it ended (exit code 0: the run's
    summary.json says how it ended); ``stop()`` calls ``cancel`` (an earlier sweep's job, now this sweep's) and
    waits, or leaves the process alone (None: someone else's). ``what`` names it for the terminal."""

    def __init__(self, alive, what: str, cancel=None, job: str | None = None):
        self.alive, self.what, self.cancel, self.error, self.job = alive, what, cancel, None, job

    def poll(self) -> int | None:
        return None if self.alive() else 0

    def stop(self) -> None:
        if self.cancel is None:
            return
        self.cancel()
        deadline = time.monotonic() + STOP_WAIT_S
        while self.alive() and time.monotonic() < deadline:
            time.sleep(1.0)


def adopt_lock_holder(run_dir: Path) -> AdoptedHandle | None:
    """The process holding ``run_dir``'s lock (a run started by hand, an earlier sweep's job whose record is lost),
    waited for while it holds it; None when nobody does."""
    lock = run_dir / RUN_LOCK
    return AdoptedHandle(lambda: is_held(lock), "another process holds its lock") if is_held(lock) else None


# ------------------------------------------------------------------------------------------------------------- local


class LocalHandle:
    def __init__(self, proc: subprocess.Popen, logfile):
        self.proc, self.logfile, self.error = proc, logfile, None

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None:
            self.logfile.close()
        return code

    def stop(self) -> None:
        end_process(self.proc)
        self.logfile.close()


STOP_GRACE_S = 30.0  # seconds a stopped run's process has to write "interrupted" and end before it is killed


def end_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL when the process has not ended within :data:`STOP_GRACE_S`: one whose SIGTERM was lost
    (raised while Python ran a finalizer, where it ignores exceptions) hung the sweep that stopped it, Ctrl-C and
    all. A run killed so is stopped, resumable from its last checkpoint."""
    proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Worker:
    """A ``python -m harness worker`` process (harness/apps/worker.py): it trains the runs it is sent one after
    another, answering each one's exit status on its stdout; ``runs``: how many it was sent."""

    def __init__(self, folder: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", "harness", "worker", str(folder)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, preexec_fn=die_with_parent())
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.runs, self.busy, self.answer = 0, False, b""

    def send(self, args: list[str], log: Path) -> None:
        self.proc.stdin.write((json.dumps({"args": args, "log": str(log)}) + "\n").encode())
        self.proc.stdin.flush()
        self.runs, self.busy = self.runs + 1, True

    def poll(self) -> int | None:
        """The run's exit status once the worker answered; the worker's own (< 0: killed) if it ended first."""
        try:
            self.answer += os.read(self.proc.stdout.fileno(), 64)
        except BlockingIOError:  # no answer yet
            pass
        if self.answer.endswith(b"\n"):
            code, self.answer, self.busy = int(self.answer), b"", False
            return code
        code = self.proc.poll()
        if code is not None:
            self.busy = False
        return code

    def close(self) -> None:
        """No more runs: the worker ends when its stdin closes."""
        try:
            self.proc.stdin.close()
        except OSError:  # it died: the pipe is broken
            pass
        self.proc.wait()


class WorkerHandle:
    def __init__(self, worker: Worker):
        self.worker, self.error, self.code = worker, None, None

    def poll(self) -> int | None:
        if self.code is None:
            self.code = self.worker.poll()
        return self.code

    def stop(self) -> None:
        """Its requests closed (a worker between runs ends), then SIGTERM: the run writes "interrupted" and the worker
        ends with it (:func:`end_process`)."""
        try:
            self.worker.proc.stdin.close()
        except OSError:  # it died: the pipe is broken
            pass
        end_process(self.worker.proc)
        self.worker.busy = False


def visible_gpus() -> list[str]:
    """The GPUs this machine's runs may use, as ``CUDA_VISIBLE_DEVICES`` names them: the user's list of that variable
    as given (indices or UUIDs, up to its first negative entry, as CUDA reads it; empty: none), else every GPU torch
    sees (none on a machine without CUDA)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        import torch  # the sweep's process has it already; a launcher without GPUs never asks

        return [str(i) for i in range(torch.cuda.device_count())]
    gpus = []
    for entry in (e.strip() for e in listed.split(",")):
        if not entry or entry.startswith("-"):
            break
        gpus.append(entry)
    return gpus


class LocalLauncher:
    """Each run on this machine, ``jobs`` at once, the free cores split between them: on a machine without GPUs in
    a worker process of the sweep that trains runs one after another (``runs_per_process`` of them at most, 0: no
    limit; harness/apps/worker.py: a worker's run is bit-equal to one in its own process, and saves it the process
    start-up), with ``runs_per_process`` 1 (or no ``folder``) each run a ``python -m harness train`` child process
    of its own. With GPUs visible (:func:`visible_gpus`; ``gpus`` gives the list instead) each run is a process of
    its own with a GPU of its own through ``CUDA_VISIBLE_DEVICES``: the GPU with the fewest of this sweep's runs on
    it, the first such in the list (so runs that start together go round-robin, and a run that ends frees its GPU
    for the next); by default as many runs at once as GPUs (:meth:`default_jobs`)."""

    name = "local"

    def __init__(self, gpus: list[str] | None = None, folder: Path | None = None, runs_per_process: int = 1):
        self.gpus = visible_gpus() if gpus is None else gpus
        self.on_gpu: list[tuple[str, subprocess.Popen]] = []  # (GPU, the run's process) of the runs started
        self.folder, self.runs_per_process, self.workers = folder, runs_per_process, []

    def check(self) -> None:
        pass

    def default_jobs(self, cpu_jobs: int) -> int:
        """Runs at once when the sweep is given no number: one per GPU, ``cpu_jobs`` on a machine without one."""
        return len(self.gpus) or cpu_jobs

    def next_gpu(self) -> str:
        """The GPU for the next run: the one with the fewest of this sweep's running runs, the first on a tie."""
        self.on_gpu = [(gpu, proc) for gpu, proc in self.on_gpu if proc.poll() is None]
        running = [gpu for gpu, _ in self.on_gpu]
        return min(self.gpus, key=running.count)

    def threads(self, jobs: int) -> int:
        free, available, busy = free_threads()
        threads = max(1, free // jobs)  # each run's share of the cores free now (harness/run/threads.py)
        if free < available:
            tqdm.write(f"note: {busy:.1f} of {available} cores are busy with other processes: {threads} torch "
                       f"thread{'s' if threads > 1 else ''} per run")
        return threads

    def start(self, args: list[str], log: Path, name: str) -> LocalHandle | WorkerHandle:
        if self.gpus or self.runs_per_process == 1 or self.folder is None:
            return self.start_process(args, log)
        worker = self.idle_worker()
        worker.send(args, log)
        return WorkerHandle(worker)

    def start_process(self, args: list[str], log: Path) -> LocalHandle:
        """The run as a child process of its own, on the next GPU when there are any."""
        gpu = self.next_gpu() if self.gpus else None
        logfile = open_log(log)
        proc = subprocess.Popen([sys.executable, "-m", "harness", *args], stdout=logfile, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent(),
                                env=None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu})
        if gpu is not None:
            self.on_gpu.append((gpu, proc))
        return LocalHandle(proc, logfile)

    def idle_worker(self) -> Worker:
        """A live worker that is not training and may take another run (one that may not is closed), or a new one."""
        for worker in list(self.workers):
            if worker.busy:
                continue
            if worker.proc.poll() is None and not (self.runs_per_process and worker.runs >= self.runs_per_process):
                return worker
            worker.close()
            self.workers.remove(worker)
        self.workers.append(Worker(self.folder))
        return self.workers[-1]

    def adopt(self, name: str) -> None:
        return None  # its runs die with the sweep that started them

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.workers = []


# --------------------------------------------------------------------------------------------------------------- ray


def _reachable(address: str, timeout: float = 5.0) -> bool:
    """Whether something listens at ``[ray://]host:port`` (ray.init would otherwise retry for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def init_local_ray(ray, **options) -> None:
    """Start a local Ray cluster for this process (``options``: ray.init's, e.g. ``num_cpus``) whose workers, and so
    the runs they start, keep this process's priority. Ray's own default starts its workers at nice 15 (its
    ``worker_niceness``), below every other process on the machine: beside any other work a run would get a sliver of
    a core and a sweep would crawl. Ray applies ``worker_niceness`` as an increment (``nice(2)``) to the priority its
    workers inherit from this process through the raylet: 0 keeps it (this process's own nice value would add it
    again, nice 10 -> 19). A cluster the sweep joins (``launcher.address``) keeps its operator's setting. Always a new
    cluster (address "local"): without an address Ray joins the one ``RAY_ADDRESS`` names or a ``ray start`` cluster of
    this machine, and refuses this call's settings there."""
    ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
             _system_config={"worker_niceness": 0}, **options)


class RayHandle:
    def __init__(self, ray, ref):
        self.ray, self.ref, self.error = ray, ref, None

    def poll(self) -> int | None:
        ready, _ = self.ray.wait([self.ref], timeout=0)
        if not ready:
            return None
        try:
            return self.ray.get(self.ref)
        except self.ray.exceptions.RayError as e:  # the worker died (killed, its node lost), the task was cancelled
            self.error = f"Ray: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            return -signal.SIGKILL

    def stop(self) -> None:
        self.ray.cancel(self.ref)  # KeyboardInterrupt in the task: run_harness stops the run with SIGTERM
        ready, _ = self.ray.wait([self.ref], timeout=STOP_WAIT_S)
        if not ready:
            self.ray.cancel(self.ref, force=True)  # kills the worker; the run dies with it


class RayLauncher:
    """Each run a Ray task on the cluster at ``launcher.address`` (none: a local Ray cluster for this sweep, or the
    one this process already joined with ``ray.init``), with ``cpus_per_run`` CPUs and ``gpus_per_run`` GPUs."""

    name = "ray"

    def __init__(self, settings: DictConfig):
        self.settings, self.ray, self.task = settings, None, None

    def check(self) -> None:
        try:
            import ray  # optional extra: only this launcher needs it
        except ImportError:
            raise ConfigError('--launcher ray needs Ray: pip install -e ".[ray]"') from None
        self.ray = ray
        for module in (sys.modules[__name__], isolated):  # a worker runs run_harness (and its die_with_parent)
            ray.cloudpickle.register_pickle_by_value(module)  # without importing the harness (and torch) itself
        self.task = ray.remote(run_harness)
        address = self.settings.address
        if not ray.is_initialized():
            if address and address != "auto" and not _reachable(address):
                raise ConfigError(f"no Ray cluster answers at launcher.address={address}: start one there "
                                  "(ray start --head), fix the address, or leave it empty for a local Ray cluster")
            try:
                if address:
                    ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
                else:
                    init_local_ray(ray)
            except ConnectionError as e:  # address=auto with no cluster on this machine
                raise ConfigError(f"no Ray cluster at launcher.address={address}: {str(e).splitlines()[0]}") \
                    from None
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        for key, need in (("CPU", self.settings.cpus_per_run), ("GPU", self.settings.gpus_per_run)):
            most = max((n.get(key, 0) for n in nodes), default=0)
            if need > most:
                raise ConfigError(f"launcher.{key.lower()}s_per_run={need}, but no node of the Ray cluster has more "
                                  f"than {most:g} {key}s: lower it, or add such nodes")

    def threads(self, jobs: int) -> int:
        return self.settings.cpus_per_run

    def start(self, args: list[str], log: Path, name: str) -> RayHandle:
        task = self.task.options(
            name=name, num_cpus=self.settings.cpus_per_run, num_gpus=self.settings.gpus_per_run, max_retries=0,
            runtime_env={"env_vars": forwarded_env()})
        return RayHandle(self.ray, task.remote(args, str(log), str(ROOT), gpu_env(self.settings)))

    def adopt(self, name: str) -> None:
        return None  # its tasks end with the driver (the sweep) that submitted them

    def close(self) -> None:
        """Nothing: the Ray session this process joined or started stays up until the process exits, when Ray's own
        exit handler shuts it down. After a ray.shutdown() Ray 2.60 can leave a client in the process that ends it
        ("Failed to connect to GCS within 60 seconds", status 1) a minute later: the sweep's report, written after the
        runs, or a later sweep of the same Python process would die there. A later sweep joins the same session
        (``ray.is_initialized``)."""


# ------------------------------------------------------------------------------------------------------------- slurm


class SlurmHandle:
    def __init__(self, job):
        self.job, self.error = job, None

    def poll(self) -> int | None:
        if not self.job.done():
            return None
        from submitit.core.utils import FailedJobError, UncompletedJobError

        problem = private_folder_problem(Path(self.job.paths.result_pickle).parent.parent)
        if problem:  # its result is a pickle: what another user put there would run in this process
            self.error = f"SLURM job {self.job.job_id}: {problem}; its result is not read (unpickling it runs code)"
            return 1
        try:
            return self.job.result()
        except UncompletedJobError as e:  # cancelled, timed out, node failure: the run is resumable
            self.error = f"SLURM job {self.job.job_id}: {str(e).strip().splitlines()[0]}"
            return -signal.SIGKILL
        except FailedJobError as e:
            self.error = f"SLURM job {self.job.job_id}: {str(e).strip().splitlines()[0]}"
            return 1

    def stop(self) -> None:
        self.job.cancel(check=False)  # scancel: SIGTERM to the job, which stops the run with SIGTERM
        deadline = time.monotonic() + STOP_WAIT_S
        while not self.job.done() and time.monotonic() < deadline:
            time.sleep(1.0)


class SlurmLauncher:
    """Each run one job submitted with submitit (``launcher.cluster``: slurm = sbatch, local = submitit's
    LocalExecutor on this machine); job logs in ``<results>/<exp>/.submitit/``."""

    name = "slurm"

    def __init__(self, settings: DictConfig, folder: Path):
        self.settings, self.folder, self.executor = settings, folder, None

    def check(self) -> None:
        s = self.settings
        try:
            import submitit  # optional extra: only this launcher needs it
        except ImportError:
            raise ConfigError('--launcher slurm needs submitit: pip install -e ".[slurm]"') from None
        import cloudpickle  # submitit's

        for module in (sys.modules[__name__], isolated):  # a job runs run_harness without importing torch
            cloudpickle.register_pickle_by_value(module)
        if s.cluster not in ("slurm", "local"):
            raise ConfigError(f"launcher.cluster must be slurm or local, got {s.cluster!r}")
        if s.cluster == "slurm" and shutil.which("sbatch") is None:
            raise ConfigError("--launcher slurm: no `sbatch` on this machine: submit from a SLURM login node, or "
                              "launcher.cluster=local to try the path here with submitit's local executor")
        extra = {f"slurm_{k}": v for k, v in OmegaConf.to_container(s.slurm_args).items()}
        parameters = {"timeout_min": s.time_min, "cpus_per_task": s.cpus_per_run, "gpus_per_node": s.gpus_per_run,
                      **({"slurm_partition": s.partition} if s.partition else {}),
                      **({"mem_gb": s.mem_gb} if s.mem_gb else {}), **extra}
        check_script_values({"the results folder": str(self.folder), **parameters})
        make_private(self.folder)
        try:
            self.executor = submitit.AutoExecutor(folder=self.folder / "%j", cluster=s.cluster)
        except RuntimeError as e:  # submitit's own refusal: sbatch without srun
            raise ConfigError(f"--launcher slurm: {str(e).strip()} (submitit starts each job with srun): submit from a "
                              "SLURM login node, or launcher.cluster=local to try the path here with submitit's local "
                              "executor") from None
        try:
            self.executor.update_parameters(**parameters)
        except (NameError, ValueError, TypeError) as e:  # submitit's words for an option it does not know
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"launcher.slurm_args: {reason.removesuffix('.')}; name each sbatch option as "
                              "submitit's slurm_<name> without the prefix (account, qos, constraint, ...)") from None

    def threads(self, jobs: int) -> int:
        return self.settings.cpus_per_run

    def start(self, args: list[str], log: Path, name: str) -> SlurmHandle:
        from submitit.core.utils import FailedJobError

        self.executor.update_parameters(name=name)
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's refusal too: said once below
                job = self.executor.submit(run_harness, args, str(log), str(ROOT), gpu_env(self.settings))
        except FailedJobError as e:  # sbatch's refusal, on its stderr
            reason = "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or "no reason given"
            raise ConfigError(f"sbatch refused the job {name}: {reason}; check launcher.partition, time_min, "
                              "gpus_per_run, cpus_per_run, mem_gb and slurm_args, or, for a limit on the jobs one may "
                              "queue, give --jobs N (make: JOBS=N)") from None
        # for a sweep run again, whatever its launcher
        atomic_write(self.folder / JOB_RECORD.format(name=name), f"{job.job_id} {self.settings.cluster}\n")
        return SlurmHandle(job)

    def adopt(self, name: str) -> AdoptedHandle | None:
        """The job an earlier sweep submitted as ``name`` while it is queued or running (its sweep may have died; the
        job lives on), to wait for instead of submitting a second one; None when there is none."""
        return earlier_job(self.folder, name, self.settings.cluster)

    def close(self) -> None:
        pass


def earlier_job(folder: Path, name: str, cluster: str) -> AdoptedHandle | None:
    """The SLURM job an earlier sweep (``--launcher slurm``) submitted as ``name``, recorded in ``folder`` (the results
    folder's .submitit/), while it is queued or running: it will run its command whatever launcher a later sweep uses,
    so that sweep follows it (cancel: scancel) rather than race it. None when there is no record, the job has ended,
    or its state cannot be asked here (no ``sacct`` on this machine, or no submitit: e.g. a copy of the folder away
    from the cluster). ``cluster``: the record's own when it names one (older records do not), else this one."""
    try:
        job_id, *kind = (folder / JOB_RECORD.format(name=name)).read_text().split()
    except (OSError, ValueError):  # ValueError: an empty record
        return None
    if (kind[0] if kind else cluster) == "local":  # submitit's local executor: the job id is its controller's pid
        alive = functools.partial(_local_job_alive, job_id, str(folder))
        cancel = functools.partial(_signal_local_job, job_id, str(folder))
    else:
        if shutil.which("sacct") is None:
            return None
        try:
            import submitit  # optional extra: the sweep that submitted the job had it
        except ImportError:
            return None
        job = submitit.SlurmJob(folder=folder / "%j", job_id=job_id)
        alive, cancel = (lambda: not job.done()), functools.partial(job.cancel, check=False)
    return AdoptedHandle(alive, f"job {job_id}, submitted by an earlier sweep", cancel, job_id) if alive() else None


def private_folder_problem(folder: Path) -> str | None:
    """Why ``folder`` (a SLURM launcher's job folders) is not this user's alone: a link, another user's, or open to
    others. Each job unpickles the call the sweep put there, and the sweep each job's result: a file someone else
    put there would run its code. None when it is this user's alone."""
    try:
        found = folder.lstat()
    except OSError as e:
        return f"{folder} cannot be read ({e.strerror or e})"
    if stat.S_ISLNK(found.st_mode):
        return f"{folder} is a symbolic link (to {os.readlink(folder)})"
    if found.st_uid != os.getuid():
        return f"{folder} belongs to another user (uid {found.st_uid})"
    if found.st_mode & 0o077:
        return f"{folder} is open to other users (mode {stat.S_IMODE(found.st_mode):o})"
    return None


def make_private(folder: Path) -> None:
    """Make the job folders ``folder`` (mode 0700; one of this user's from an earlier sweep is closed to others);
    refuse (ConfigError, one line, before any job is submitted) one that is a link or another user's."""
    if not folder.is_symlink():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if folder.stat().st_uid == os.getuid():
            os.chmod(folder, 0o700)
    problem = private_folder_problem(folder)
    if problem:
        raise ConfigError(f"--launcher slurm: {problem}: its jobs and the sweep unpickle the files there, which runs "
                          "any code a file put there holds; remove it, or give another results_dir")


def _local_job_alive(job_id: str, folder: str) -> bool:
    """Whether submitit's local controller of job ``job_id`` (its pid, with ``folder`` on its command line, so not
    another process that took the pid since) still runs."""
    try:
        command = Path(f"/proc/{int(job_id)}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return False
    return "submitit" in command and folder in command


def _signal_local_job(job_id: str, folder: str) -> None:
    """Cancel a local job as submitit does (SIGINT to its controller, which stops the run with SIGTERM)."""
    if _local_job_alive(job_id, folder):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(job_id), signal.SIGINT)
def check_script_values(values: dict) -> None:
    """Refuse (ConfigError, one line) a value that would reach the sbatch script submitit writes with a line break
    or another control character in it: submitit quotes each value, but a quoted newline still ends the
    ``#SBATCH`` line, and the rest would become a line of the script."""
    for key, value in values.items():
        texts = value if isinstance(value, list | tuple) else value.values() if isinstance(value, dict) else [value]
        for text in map(str, texts):
            if any(ord(c) < 32 or ord(c) == 127 for c in text):
                name = key if key.startswith("the ") else f"launcher {key.removeprefix('slurm_')}"
                raise ConfigError(f"{name} holds a line break or another control character ({text[:60]!r}), which "
                                  "would become a line of the SLURM script: give it without one")


GPU_SBATCH_OPTIONS = ("gres", "gpus", "gpus_per_node", "gpus_per_task", "tres_per_node", "tres_per_task")  # slurm_args


def gpu_env(settings: DictConfig) -> dict[str, str]:
    """What a cluster's run process is given beside its environment: with ``launcher.gpus_per_run`` 0 (and no GPU
    asked of SLURM through ``slurm_args``: GPU_SBATCH_OPTIONS), no GPU. Ray leaves a task that asks for none every GPU
    of its node (reserved by other tasks or not), and a SLURM node that does not fence its devices shows them to a job
    that was allocated none: device=auto would put the run on cuda:0."""
    asked = settings.gpus_per_run or any(key in GPU_SBATCH_OPTIONS for key in settings.get("slurm_args") or {})
    return {} if asked else {"CUDA_VISIBLE_DEVICES": ""}


def check_run_gpus(runs: list[DictConfig], settings: DictConfig, name: str) -> None:
    """Refuse (ConfigError, one line, before anything is submitted) runs on a cluster whose ``device`` names a GPU
    that their job would not have: ``launcher.gpus_per_run`` GPUs are all a Ray task or a SLURM job sees
    (:func:`gpu_env` hides them all where it asks for none), so device=cuda with none, or cuda:N beyond them, fails on
    every node."""
    for run in runs:
        if not str(run.device).startswith("cuda"):
            continue
        index = int(run.device.partition(":")[2] or 0)
        if index >= settings.gpus_per_run:
            fix = ("launcher.gpus_per_run=1 (or device=auto / cpu to run on the nodes' CPUs)" if index == 0 else
                   f"device=cuda (the job's first GPU), or launcher.gpus_per_run={index + 1}")
            raise ConfigError(f"device={run.device}, but launcher.gpus_per_run={settings.gpus_per_run}: each run's "
                              f"job (--launcher {name}) sees only the GPUs it asks for, as cuda:0 and on; set {fix}")


# the launcher.* settings each launcher reads (the others are another launcher's)
READS = {"local": ("runs_per_process",), "ray": ("cpus_per_run", "gpus_per_run", "address"),
         "slurm": ("cpus_per_run", "gpus_per_run", "cluster", "partition", "time_min", "mem_gb", "slurm_args")}


def say_unread_settings(name: str, settings: DictConfig) -> None:
    """One note on stderr naming the ``launcher.*`` settings given (not at their defaults) that launcher ``name`` does
    not read: a SLURM partition under --launcher ray was ignored without a word. Not an error: an experiment file may
    carry the settings of several launchers."""
    defaults = dataclasses.asdict(LauncherConfig())
    unread = [f"launcher.{key}" for key, value in OmegaConf.to_container(settings).items()
              if key not in READS[name] and value != defaults.get(key, value)]
    if unread:
        print(f"note: --launcher {name} does not read {', '.join(unread)} (another launcher's settings: ignored "
              "here; docs/cluster.md)", file=sys.stderr)


def make_launcher(name: str, settings: DictConfig, exp_dir: Path) -> Launcher:
    """The launcher ``name`` with the experiment's ``launcher`` settings (checked here: the one place; those it does
    not read, named in a note)."""
    if name in READS:
        say_unread_settings(name, settings)
    if name == "local":
        if settings.runs_per_process < 0:
            raise ConfigError(f"launcher.runs_per_process must be >= 0 (0: no limit), got {settings.runs_per_process}")
        # launcher.gpus_per_run is a cluster's: here one GPU per run, when there are GPUs
        return LocalLauncher(folder=exp_dir, runs_per_process=settings.runs_per_process)
    for key, low in (("cpus_per_run", 1), ("gpus_per_run", 0), ("time_min", 1)):
        if settings[key] < low:
            raise ConfigError(f"launcher.{key} must be >= {low}, got {settings[key]}")
    if settings.mem_gb is not None and settings.mem_gb < 1:
        raise ConfigError(f"launcher.mem_gb must be >= 1 or null, got {settings.mem_gb}")
    if name == "ray":
        return RayLauncher(settings)
    if name == "slurm":
        return SlurmLauncher(settings, exp_dir / JOB_FOLDER)
    raise ConfigError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {name!r}")
