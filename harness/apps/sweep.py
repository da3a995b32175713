"""Run every point of an experiment's sweep, each run in its own process, resumable and in parallel.

results/<exp>/manifest.json lists the runs and their status (pending, running, finished, diverged, failed,
interrupted, or stopped: killed, its summary still saying running while no process holds its lock). Running the same
sweep again skips ended runs (finished or diverged), follows the ones still running elsewhere to their end (an
earlier sweep's SLURM job, a process holding the run's lock: never a second process for one run) and resumes the
others from their last checkpoint. A run's id depends on its settings only (not on the experiment's name), so
another sweep into the same folder (`make compare`) runs only what is not there yet; the manifest keeps the runs
earlier sweeps listed (their folders still there) before this sweep's, and records the report's baseline
(sweep.baseline) and the grid's objectives. ``jobs`` runs go at once, CPU threads split between them; if the sweep
process dies (even SIGKILL), its children die with it. Where a run's process executes is the launcher's business
(harness/apps/launchers.py: this machine, a Ray cluster, SLURM); the loop is the same.
"""

from __future__ import annotations

import functools
import gc
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from tqdm import tqdm

from harness.apps.launchers import (
    JOB_FOLDER,
    AdoptedHandle,
    Job,
    Launcher,
    LocalLauncher,
    RunHandle,
    adopt_lock_holder,
    check_run_gpus,
    earlier_job,
    make_launcher,
    run_each,
)
from harness.loop.build import build_policy, build_task
from harness.loop.metrics import progress_fields
from harness.policy.device import resolve_device
from harness.policy.warm_start import MISSED_BAND, WarmStartError
from harness.run.allocator import release_freed_memory
from harness.run.atomic import atomic_write, check_writable, remove_stale_temporaries
from harness.run.config import check_this_machine, memory_settings, run_configs, run_id, unused_setting
from harness.run.errors import ConfigError
from harness.run.locks import (
    RUN_LOCK,
    STALE_S,
    SWEEP_LOCK,
    check_lock_file,
    is_held,
    lock_folder,
    stale_elsewhere,
    taken_over,
    writer_elsewhere,
)
from harness.run.provenance import (
    ALLOW_FLAG,
    check_code,
    check_one_version,
    code_record,
    ended_version,
    version_counts,
)
from harness.run.records import (
    ENDED,
    DamagedConfigError,
    check_run_folder,
    edited_run,
    memory_changes,
    other_settings,
    read_jsonl,
    read_run_config,
    run_status,
    say_memory_changes,
    write_json_atomic,
)
from harness.run.threads import check_count as check_thread_count
from harness.run.threads import run_threads

START_POLICIES = "start_policies.json"  # first_landing's record, in the folder of its policies' build logs


class PreparationError(RuntimeError):
    """A starting policy's build through a launcher failed (its process's own error and its log): said in one line
    (harness/apps/cli.py), before any run started."""


def stopped_error(run_dir: Path) -> str | None:
    """A stopped run's error: summary.json's, else the last line of its train.log (e.g. a full disk's, when the
    summary could not be written)."""
    try:
        error = json.loads((run_dir / "summary.json").read_text()).get("error")
    except (OSError, ValueError, AttributeError):  # ValueError: not JSON, or not UTF-8
        error = None
    return error or last_line(run_dir / "train.log")


def signal_name(number: int) -> str:
    """'SIGKILL' for 9; 'signal N' for a number no signal has."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def last_line(log: Path) -> str | None:
    """The last line of ``log`` that is not blank (a failed command's one-line error); None if it has none."""
    if log.is_symlink():  # a link's target is not the run's log: never read (check_run_folder refuses it)
        return None
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def _grid_point(run: DictConfig, cfg: DictConfig) -> dict:
    """The values of the swept keys (grid and per-objective) in this run."""
    keys = dict.fromkeys([*cfg.sweep.grid, *(k for o in cfg.sweep.per_objective.values() for k in o)])
    values = {k: OmegaConf.select(run, k) for k in keys}
    return {k: OmegaConf.to_container(v) if isinstance(v, DictConfig | ListConfig) else v for k, v in values.items()}


def prepare_starting_policies(runs: list[DictConfig], progress: bool) -> None:
    """Build each distinct warm-started starting policy once, with all cores, before the runs start (they
    then load it from the cache instead of training it in parallel, one core each). The process then drops the
    policy and gives its freed heap back to the kernel: the sweep's parent waits on its runs for the rest of the
    sweep, and would otherwise hold the warm start's peak memory (harness/run/allocator.py keeps freed memory)."""
    if any(run.model.warm_start_steps for run in runs):
        run_threads(runs[0].threads)
    done = set()
    for run in runs:
        key = _policy_key(run)
        if run.model.warm_start_steps and key not in done:
            build_policy(run, build_task(run), resolve_device(run.device), progress)  # says "loaded" or "building"
            done.add(key)
    if done:
        gc.collect()  # the policy's autograd graph and optimizer may hold reference cycles
        release_freed_memory()


def _policy_key(run: DictConfig) -> str:
    """What a starting policy depends on: runs with the same key start from the same cached policy."""
    return json.dumps(OmegaConf.to_container(OmegaConf.masked_copy(run, ["model", "task", "device"])), sort_keys=True)


def prepare_through(pending: list[tuple[DictConfig, Path]], runner: Launcher, progress: bool, at_once: int,
                    missed_ok: bool = False, enough: Callable[[dict[Path, bool]], bool] | None = None,
                    write_config: bool = False) -> list[Path]:
    """Build each distinct warm-started starting policy once through ``runner`` (``python -m harness prepare
    <run config>``, logged in that run's train.log), ``at_once`` of them at a time, and wait for all of them before
    the runs start, so that every run of the sweep loads the same cached policy ($RLVR_CACHE on a shared file system)
    instead of training its own. A warm start trains on one thread whatever the process's count
    (harness/policy/warm_start.py), so the policies built side by side are those built one after another. The first
    that fails stops the others and raises; with ``missed_ok`` one whose warm start missed its band (exit
    MISSED_BAND) does not, and the folders of those that missed are returned. ``enough``: called with the builds
    ended so far ({folder: landed}); once it says True, the builds still running are stopped (a warm start is cached
    whole or not at all) and those not begun are not: the caller takes none of them. ``write_config``: each run's
    folder and config.yaml are written as its build begins (a sweep's runs have theirs already), so one never begun
    leaves no folder."""
    first, missed, done = {}, [], {}
    for run, run_dir in pending:
        if run.model.warm_start_steps:
            first.setdefault(_policy_key(run), (run, run_dir))
    if not first:
        return missed
    at_once = min(at_once, len(first))  # no more at once than policies to build: each its share of the cores
    threads = runner.threads(at_once)  # once: the jobs started here would count as other load
    if progress:
        tqdm.write(f"preparing {'up to ' if enough else ''}{len(first)} starting polic"
                   f"{'y' if len(first) == 1 else 'ies'}{', until enough land,' if enough else ''} through --launcher "
                   f"{runner.name}, {at_once} at a time (each logged in its run folder's train.log"
                   f"{', the folder written as its build begins' if write_config else ''}: "
                   f"{', '.join(str(d) for _, d in first.values())})")

    told = []  # the spares' line, said once

    def ended(job: Job, code: int, handle) -> bool:
        if code == MISSED_BAND and missed_ok:
            missed.append(job.key)
        elif code:
            raise PreparationError(f"preparing the starting policy failed (exit {code}): "
                               f"{handle.error or stopped_error(job.key) or 'no output'}; log in {job.log}")
        done[job.key] = code == 0
        if enough is None or not enough(done):
            return False
        if progress and len(done) < len(first) and not told:
            told.append(True)
            tqdm.write(f"starting policies: enough landed; {len(first) - len(done)} spare build(s) stopped or not "
                       "begun")
        return True

    run_each([Job(run_dir, ["prepare", str(run_dir / "config.yaml"), "--threads", str(threads)],
                  run_dir / "train.log", f"prepare-{run_dir.name}",
                  functools.partial(_write_config, run, run_dir) if write_config else None)
              for run, run_dir in first.values()], runner, at_once, ended)
    return missed


def _write_config(run: DictConfig, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "config.yaml", OmegaConf.to_yaml(run))


def first_landing(runs_for: Callable[[list[int]], list[DictConfig]], candidates: Sequence[int], wanted: int,
                  folder: Path, at_once: int, progress: bool, first: list[DictConfig] = ()) -> dict:
    """The starting policies of a replicated design: the first ``wanted`` of ``candidates`` (model.seed values) whose
    warm start lands in its band, built or loaded, as ``{"landed": [...], "missed": {model.seed: its error}}`` (also
    written to ``folder``/start_policies.json). A recipe's starting policy is one that lands in its band; a value
    that misses it (another CPU rounds the warm start otherwise) is passed over, in order, never stretched to fit.
    ``runs_for(seeds)``: run configs, the first of each model.seed naming its policy. ``first``'s policies (which
    must land) and then the candidates in order go to ``at_once`` processes side by side, each through
    prepare_through into the cache every run loads them from, a process taking the next candidate as soon as it is
    free: a cached policy is loaded and a recorded miss read (harness/policy/warm_start.py) in seconds, so the builds
    still needed run side by side, and a process that would be idle builds the next candidate as a spare (if one
    before it misses, its successor is under way). Once ``first`` has ended and the first ``wanted`` candidates in
    order have landed, every candidate before them ended, the spares still building are stopped and the rest not
    begun (_decided): a later one that landed beside an earlier one is not taken before it. Each policy's config and
    build log: ``folder``/model_seed_<N>/, written as its build begins. WarmStartError if one of ``first`` misses or
    fewer than ``wanted`` land."""
    extra = _first_of_each(first)
    left = [seed for seed in candidates if seed not in extra]
    check_prepare_folder(folder, [*extra, *left])
    landed, missed = [], {}
    if wanted > 0:
        decided = functools.partial(_decided, first=list(extra), candidates=left, still=wanted)
        errors = _prepare_seeds({**extra, **_first_of_each(runs_for(left))}, folder, at_once, progress, decided)
        if failed := [f"model.seed {seed}: {errors[seed]}" for seed in extra if seed in errors]:
            raise WarmStartError(f"a starting policy that must land missed its band, {'; '.join(failed)}")
        for seed in left:  # in order; once enough have landed, the rest (spares, or never begun) are not taken
            if len(landed) == wanted:
                break
            if seed in errors:
                missed[seed] = errors[seed]
            else:
                landed.append(seed)
    if len(landed) < wanted:
        raise WarmStartError(f"only {len(landed)} of model.seed {list(candidates)} reached their warm start's "
                             f"band ({wanted} wanted): {'; '.join(f'{s}: {e}' for s, e in missed.items())}")
    found = {"candidates": list(candidates), "landed": landed, "missed": missed}
    folder.mkdir(parents=True, exist_ok=True)  # no build may have begun (none warm-started): no folder written yet
    atomic_write(folder / START_POLICIES, json.dumps(found, indent=1) + "\n")
    return {"landed": landed, "missed": missed}


def check_prepare_folder(folder: Path, seeds: Sequence[int]) -> None:
    """Refuse (ConfigError, one line, before any build) what first_landing would write through or over: ``folder``
    a link, its START_POLICIES a link or not a file, a model_seed_<N> folder of ``seeds`` that is a link or holds what
    no build wrote (check_run_folder)."""
    if folder.is_symlink():
        raise ConfigError(f"{folder} is a symbolic link: the starting policies' build logs are not written through "
                          "one; remove the link, or choose another results_dir")
    record = folder / START_POLICIES
    if record.is_symlink() or (record.exists() and not record.is_file()):
        raise ConfigError(f"{record} is a link or not a file: the starting policies found are written there; remove "
                          "it (they are decided again, the cached ones loaded in seconds)")
    for seed in seeds:
        check_run_folder(folder / f"model_seed_{seed}")


def _decided(done: dict[int, bool], first: list[int], candidates: list[int], still: int) -> bool:
    """Whether the builds ended so far (``done``: model.seed -> landed) decide first_landing: every one of ``first``
    has ended, and ``still`` of ``candidates`` have landed with every candidate before them ended (the
    candidates are taken in order, so a later one still building could not be taken)."""
    if any(seed not in done for seed in first):
        return False
    for seed in candidates:
        if seed not in done:
            return False
        still -= done[seed]
        if still == 0:
            return True
    return False


def _first_of_each(runs: list[DictConfig]) -> dict[int, DictConfig]:
    """model.seed -> the first of ``runs`` with it, in order."""
    first: dict[int, DictConfig] = {}
    for run in runs:
        first.setdefault(int(run.model.seed), run)
    return first


def _prepare_seeds(runs: dict[int, DictConfig], folder: Path, at_once: int, progress: bool,
                   decided: Callable[[dict[int, bool]], bool]) -> dict[int, str]:
    """Build (or load) each ``model.seed -> run``'s starting policy through prepare_through, ``at_once`` side by side,
    logged in ``folder``/model_seed_<N>/, until ``decided`` by those ended (model.seed -> landed); the errors of those
    whose warm start missed its band."""
    pending = {folder / f"model_seed_{seed}": seed for seed in runs}
    missed = prepare_through([(run, where) for where, run in zip(pending, runs.values(), strict=True)],
                             LocalLauncher(), progress, at_once, missed_ok=True,
                             enough=lambda done: decided({pending[where]: landed for where, landed in done.items()}),
                             write_config=True)
    return {pending[where]: (stopped_error(where) or "missed its band").removeprefix("error: ") for where in missed}


def distinct_policies(runs: list[DictConfig]) -> int:
    """How many warm-started starting policies ``runs`` start from."""
    return len({_policy_key(run) for run in runs if run.model.warm_start_steps})


def run_sweep(cfg: DictConfig, jobs: int | None = None, progress: bool = True, launcher: str = "local",
              runs: list[DictConfig] | None = None, allow_code_change: bool = False, command: str = "sweep",
              cpu_jobs: int = 1) -> list[dict]:
    """Run (or resume) the sweep through ``launcher`` (local, ray, slurm: harness/apps/launchers.py), ``jobs`` runs at
    once (None: locally one per GPU, ``cpu_jobs`` on a machine without GPUs; every run on a cluster, whose scheduler
    queues them); returns the manifest's run entries.
    ``runs``: these run configs instead of ``cfg``'s grid (the zoo's union of several experiments' grids; ``cfg``
    then names the folder and the keys the manifest records). Raises ConfigError (a launcher that cannot start: a
    missing extra, no cluster; a run to resume that other code began, unless ``allow_code_change``, which is passed
    on to the runs; ``command``: the command the refusal names) before any folder is touched, and FolderBusyError if
    another sweep holds the folder."""
    runs = run_configs(cfg) if runs is None else runs
    check_start_seeds(runs)
    check_this_machine(runs, node=launcher == "local")  # on a cluster each run checks its node's devices
    if launcher == "local":  # the runs start on this machine (on a cluster each run checks its node's cores)
        for run in runs:
            check_thread_count(run.threads, "threads")
    exp_dir = Path(cfg.results_dir) / cfg.name
    check_writable(exp_dir)
    check_runs_code(cfg, runs, allow_code_change, command)
    check_baseline(cfg.sweep.baseline, runs, exp_dir)
    check_lock_file(exp_dir / SWEEP_LOCK)
    if launcher != "local":
        check_run_gpus(runs, cfg.launcher, launcher)
    runner = make_launcher(launcher, cfg.launcher, exp_dir)
    runner.check()
    try:
        default = runner.default_jobs(cpu_jobs) if launcher == "local" else len(runs)
        return _sweep(cfg, runs, exp_dir, runner, jobs or default, progress, allow_code_change)
    finally:
        runner.close()


def check_baseline(baseline: str | None, runs: list[DictConfig], exp_dir: Path) -> None:
    """Refuse (ConfigError) a ``sweep.baseline`` that no run of the sweep is, nor any run an earlier sweep left in the
    folder (its manifest.json): the report's verdict would find no baseline, after every run had trained."""
    if baseline is None or any(run.objective.name == baseline for run in runs):
        return
    earlier = earlier_manifest(exp_dir / "manifest.json", exp_dir, set())["runs"]
    if any(entry.get("objective") == baseline for entry in earlier):
        return
    names = sorted({run.objective.name for run in runs})
    raise ConfigError(f"sweep.baseline={baseline}: no run of this sweep is {baseline}, nor any earlier run in "
                      f"{exp_dir}: add it to the objectives (make compare OBJECTIVES={baseline},...) or name one of "
                      f"{', '.join(names)}")


def check_start_seeds(runs: list[DictConfig]) -> None:
    """Refuse (ConfigError) a sweep whose runs differ in model.seed where it changes nothing: a hub model without a
    warm start or adapters starts every run from the same pretrained policy, so its model.seed values are not
    starting policies (harness/run/config.py ``unused_setting``; one grid's such points are one run id, refused as the
    same run: this says it of runs given together, the zoo's)."""
    if len({run.model.seed for run in runs}) < 2:
        return
    same = sorted({run.model.name for run in runs if unused_setting(run, "model.seed")})
    if same:
        raise ConfigError(f"model.seed takes several values, but model {same[0]} has no warm start or adapters "
                          "(model.warm_start_steps=0, model.lora.rank=0): each value is the same pretrained starting "
                          "policy, not another one; sweep model.seed with a warm start, LoRA adapters or a tiny model")


def check_runs_code(cfg: DictConfig, runs: list[DictConfig], allow: bool, command: str) -> None:
    """Refuse (ConfigError, one line) to resume any of the sweep's runs that other code began, unless ``allow``
    (harness/run/provenance.py check_code): every run folder to resume is checked before any run starts (not one
    still running, here or on another host: it is followed or left to its writer, not continued)."""
    exp_dir = Path(cfg.results_dir) / cfg.name
    check_code([d for d in (exp_dir / run_id(run) for run in runs) if run_status(d) not in (*ENDED, "running")],
               allow, command)


def say_other_versions(exp_dir: Path, entries: list[dict], todo: int) -> None:
    """One note when runs that ended in the folder (``entries``: the manifest's, this sweep's and those earlier sweeps
    left) are of other code than the ``todo`` runs this sweep starts or resumes: the report keeps each version's runs
    apart (never pooled as seeds of one condition), which a sweep continued after a commit would otherwise learn only
    from its report."""
    current = code_record()["version"]
    ended = version_counts([ended_version(exp_dir / e["dir"]) for e in entries if e["status"] in ENDED])
    others = {version: n for version, n in ended.items() if version != current}
    if todo and others:
        shown = ", ".join(f"{n} by {version}" for version, n in sorted(others.items()))
        tqdm.write(f"note: runs that ended in {exp_dir} are of other code ({shown}) than the {todo} this sweep runs "
                   f"({current}): the report keeps each version's runs apart, never pooled as seeds of one condition "
                   "(check that version out to extend its runs, or give another name=... for a fresh folder)",
                   file=sys.stderr)


def check_runs_one_version(cfg: DictConfig, runs: list[DictConfig], what: str) -> None:
    """Before runs are added to a design whose verdicts pair its runs (a claim's, the zoo's confirmation): refuse
    (harness/run/provenance.py check_one_version) when its ended runs and those still to run (under this code) are of
    different code versions."""
    exp_dir = Path(cfg.results_dir) / cfg.name
    ended = {exp_dir / run_id(run): run_status(exp_dir / run_id(run)) in ENDED for run in runs}
    todo = sum(not done for done in ended.values())
    if todo:
        versions = [ended_version(d) for d, done in ended.items() if done]
        check_one_version(versions + [code_record()["version"]] * todo, exp_dir, what)


def _sweep(cfg: DictConfig, runs: list[DictConfig], exp_dir: Path, runner: Launcher, jobs: int,
           progress: bool, allow_code_change: bool) -> list[dict]:
    exp_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_folder(exp_dir / SWEEP_LOCK, f"another sweep is already running in {exp_dir}")
    remove_stale_temporaries(exp_dir, own=("manifest.json",))  # a manifest.json.tmp a full disk or a kill left
    for run in runs:  # every run's folder checked before any is made or written
        check_run_folder(exp_dir / run_id(run))  # a link, a folder in a file's place
        check_saved_settings(run, exp_dir / run_id(run))
    entries = [run_entry(run, cfg, exp_dir) for run in runs]
    manifest = exp_dir / "manifest.json"
    earlier = earlier_manifest(manifest, exp_dir, {e["run_id"] for e in entries})
    objectives = list(dict.fromkeys([run.objective.name for run in runs] + earlier.get("objectives", [])))
    baseline = cfg.sweep.baseline or earlier.get("baseline")

    def save_manifest() -> None:
        write_json_atomic(manifest, {"experiment": cfg.name, "baseline": baseline, "objectives": objectives,
                                     "runs": earlier["runs"] + entries})

    save_manifest()
    todo = [e for e in entries if e["status"] not in ENDED]  # a diverged run would diverge again
    say_other_versions(exp_dir, earlier["runs"] + entries, len(todo))
    queued = queued_elsewhere(todo, exp_dir, runner, cfg.launcher.cluster)  # first in todo
    steps_of = {e["run_id"]: run.train.steps for run, e in zip(runs, entries, strict=True)}
    pending = [(run, exp_dir / e["dir"]) for run, e in zip(runs, entries, strict=True)
               if e in todo and e["run_id"] not in queued]
    jobs = max(1, min(jobs, len(todo) - len(queued)))  # --jobs 100 for 4 runs: 4 at once, each its share of the cores
    if runner.name == "local" and (jobs < 2 or distinct_policies([run for run, _ in pending]) < 2):
        prepare_starting_policies([run for run, _ in pending], progress)
    else:  # several side by side, each a process; on a cluster as jobs (the runs' nodes may not be this one)
        prepare_through(pending, runner, progress, jobs)
    threads = runner.threads(jobs)
    sweep_bar = tqdm(total=len(entries), initial=len(entries) - len(todo), desc=f"sweep {cfg.name}",
                     unit="run", disable=not progress, position=0)
    active: dict[str, Child] = {}
    done = False
    try:
        while todo or active:
            while todo and sum(child.slot for child in active.values()) < jobs:  # start runs up to `jobs` at once
                entry = todo.pop(0)
                child = Child.start(runner, exp_dir / entry["dir"], threads, progress, 1 + len(active),
                                    steps_of[entry["run_id"]], allow_code_change, queued.get(entry["run_id"]))
                entry["status"] = "running"
                if child is None:  # running on another host: left to it
                    sweep_bar.update(1)
                else:
                    active[entry["run_id"]] = child
                save_manifest()
            time.sleep(1.0)
            for rid, child in list(active.items()):  # progress bars; the runs that ended
                if child.poll():
                    continue
                entry = next(e for e in entries if e["run_id"] == rid)
                entry["status"], error = child.ended(rid)
                if error and error.startswith(("error: disk full", "error: disk quota")):
                    todo.clear()  # the next runs would stop the same way: free space, then run the sweep again
                save_manifest()
                del active[rid]
                sweep_bar.update(1)
        done = True
    finally:
        for child in active.values():
            child.stop()
        for entry in entries:
            if entry["status"] == "running":
                entry["status"] = run_status(exp_dir / entry["dir"])
        try:
            save_manifest()
        except OSError:
            if done:
                raise  # else already on the way out with an error (a full disk's, ...): that one is reported
        finally:
            sweep_bar.close()
            lock.close()
    return entries


def queued_elsewhere(todo: list[dict], exp_dir: Path, runner: Launcher, cluster: str) -> dict[str, AdoptedHandle]:
    """The runs of ``todo`` whose SLURM job an earlier sweep (``--launcher slurm``, its process since dead) submitted
    and that is still queued or running, when this sweep's launcher is another (the SLURM launcher follows its own):
    each job will train its run whatever this sweep does, so the sweep follows it to its end (it takes none of its
    ``jobs``; stopping the sweep leaves the job alone) rather than train the run a second time; said in one line naming
    the runs and the scancel command that frees them. Those runs are moved to the front of ``todo``."""
    if runner.name == "slurm":
        return {}
    queued = {e["run_id"]: handle for e in todo
              if (handle := earlier_job(exp_dir / JOB_FOLDER, e["dir"], cluster)) is not None}
    if not queued:
        return {}
    for handle in queued.values():
        handle.cancel = None  # another launcher's job: left queued when this sweep stops (the next one follows it)
    todo.sort(key=lambda e: e["run_id"] not in queued)
    tqdm.write(f"note: {len(queued)} run(s) belong to SLURM jobs an earlier sweep submitted that are still queued or "
               f"running ({', '.join(f'{rid}: job {h.job}' for rid, h in queued.items())}): this sweep (--launcher "
               f"{runner.name}) follows them to their end instead of training them a second time; to run them here "
               f"instead, stop it, cancel them (scancel {' '.join(h.job for h in queued.values())}) and run it again",
               file=sys.stderr)
    return queued


def earlier_manifest(manifest: Path, exp_dir: Path, listed: set[str]) -> dict:
    """What an earlier sweep's manifest.json in the folder holds that this sweep keeps: its runs not in ``listed``
    whose folders are still there (a plain folder of the experiment's, no link), with their status as it is now;
    its baseline and objectives. An unreadable manifest keeps nothing (the report still finds the run folders)."""
    try:
        old = json.loads(manifest.read_text())
    except (OSError, ValueError):  # not JSON, or not UTF-8
        return {"runs": []}
    old = old if isinstance(old, dict) else {}
    runs = []
    for entry in old.get("runs") if isinstance(old.get("runs"), list) else []:
        folder = entry.get("dir") if isinstance(entry, dict) else None
        if (isinstance(folder, str) and Path(folder).name == folder and folder not in ("", ".", "..")
                and entry.get("run_id") not in listed and (exp_dir / folder).is_dir()
                and not (exp_dir / folder).is_symlink()):
            runs.append({**entry, "status": run_status(exp_dir / folder)})
    objectives = old.get("objectives")
    objectives = [o for o in objectives if isinstance(o, str)] if isinstance(objectives, list) else []
    baseline = old.get("baseline") if isinstance(old.get("baseline"), str) else None
    return {"runs": runs, "objectives": objectives, "baseline": baseline}


def check_saved_settings(run: DictConfig, run_dir: Path) -> None:
    """Refuse (ConfigError, one line) a run to continue whose folder's config.yaml holds other settings than those
    its folder is named for (the run id is their hash): the run would train, and its records say, those written there
    (an edit after the run began). An ended run is not run again: one warning that its records name other settings."""
    try:
        saved = read_run_config(run_dir / "config.yaml")
    except DamagedConfigError:
        return  # run_entry's warning names it
    if not saved:
        return
    differences, _ = other_settings(saved, run)
    if not differences:
        return
    named = ", ".join(list(differences.values())[:4]) + (", ..." if len(differences) > 4 else "")
    what = f"{run_dir / 'config.yaml'} holds other settings than the run its folder is named for ({named})"
    if run_status(run_dir) in ENDED:
        why = ("they were edited after the run wrote them (summary.json's settings_digest), so its report leaves it "
               "out" if edited_run(run_dir, saved) else "its report reads them as written (the run trained with them, "
               "or recorded no digest of its settings)")
        tqdm.write(f"warning: {what}: the run has ended; {why}", file=sys.stderr)
        return
    raise ConfigError(f"{what}: continuing it would train (and record) those; restore them, or move {run_dir} away "
                      "to run it anew")


def run_entry(run: DictConfig, cfg: DictConfig, exp_dir: Path) -> dict:
    """The run's folder with its config.yaml (a resumed run's gets this sweep's trackers, which are not part of the
    run id), and its manifest entry. A damaged config.yaml is named in one warning: an ended or running run's is left
    as it is, another's written anew from the sweep's settings (the run id is their hash: they are the run's)."""
    rid = run_id(run)
    run_dir = exp_dir / rid
    run_dir.mkdir(exist_ok=True)
    status = run_status(run_dir)
    busy = is_held(run_dir / RUN_LOCK) or writer_elsewhere(run_dir / RUN_LOCK) is not None
    try:
        saved = read_run_config(run_dir / "config.yaml")
    except DamagedConfigError as e:
        keep = status in ENDED or busy
        tqdm.write(f"warning: {e}: "
                   + ("left as it is (the run has ended)" if status in ENDED else "left as it is (its run is running)"
                      if busy else "written anew from the settings of this sweep (the run id is their hash)"),
                   file=sys.stderr)
        saved = {} if keep else None
    if saved is None:
        atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(run))
    elif saved and "logging" in run and not busy and status not in ENDED:  # an ended run's are those it sent to
        logging = OmegaConf.to_container(run.logging)
        if saved.get("logging") != logging:
            atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml({**saved, "logging": logging}))
    if status not in ENDED and not busy:
        adopt_memory_settings(run, run_dir)
    return {"run_id": rid, "objective": run.objective.name, "seed": run.seed, "overrides": _grid_point(run, cfg),
            "status": status, "dir": rid}


def adopt_memory_settings(run: DictConfig, run_dir: Path) -> None:
    """A run this sweep continues with other memory settings (not part of the run id: e.g. a run that ran out of
    memory, swept again with ``train.activation_checkpointing=true``): its config.yaml, which its process runs,
    takes this sweep's, said in one line. A config.yaml that cannot be read is left to the run's process."""
    path = run_dir / "config.yaml"
    try:
        saved = OmegaConf.load(path)
        changes = memory_changes(OmegaConf.to_container(saved, resolve=True), run)
    except Exception:  # noqa: BLE001 - damaged: the run's own check_resume says so
        return
    if changes:
        for key in memory_settings(run):
            OmegaConf.update(saved, key, OmegaConf.select(run, key))
        atomic_write(path, OmegaConf.to_yaml(saved))
        say_memory_changes(run_dir, changes)


@dataclass
class Child:
    """One run's process (``python -m harness train <run_dir>/config.yaml``, wherever the launcher started it, its
    output in the run's train.log) and its progress bar."""

    run_dir: Path
    handle: RunHandle
    bar: tqdm
    code: int | None = None
    slot: bool = True  # whether it takes one of the sweep's `jobs` (not a SLURM job of an earlier sweep it follows)

    @classmethod
    def start(cls, runner: Launcher, run_dir: Path, threads: int, progress: bool, position: int, steps: int,
              allow_code_change: bool, queued: RunHandle | None = None) -> Child | None:
        """The run's process: the one still running it (an earlier sweep's job, or whoever holds its lock), waited
        for and followed to its end, else a new one through ``runner``; None, said in one line, for a run whose lock
        records a writer on another host with a fresh heartbeat (harness/run/locks.py): its progress is that host's,
        which this folder (a copy, or a file system whose locks do not reach across hosts) does not show, and a
        process here would be its second writer. A stale one is taken over, said in one line. ``queued``: the run's
        SLURM job an earlier sweep submitted (queued_elsewhere), followed without taking one of the sweep's jobs."""
        handle = queued or runner.adopt(run_dir.name) or adopt_lock_holder(run_dir)
        lock = run_dir / RUN_LOCK
        if handle is None and (elsewhere := writer_elsewhere(lock)) is not None:
            tqdm.write(f"run {run_dir.name} is running {elsewhere.said()}: not started here (a second writer of "
                       "the run); this folder shows its progress as of that heartbeat (copy it again for more), and "
                       f"a later sweep takes it over once the heartbeat is {STALE_S / 60:g} min old, or at once "
                       f"if {lock} is removed")
            return None
        if handle is not None:
            tqdm.write(f"run {run_dir.name} is still running ({handle.what}): following it to its end instead of "
                       "starting it again")
        else:
            if (stale := stale_elsewhere(lock)) is not None:
                tqdm.write(taken_over(run_dir.name, stale))
            handle = runner.start(["train", str(run_dir / "config.yaml"), "--run-dir", str(run_dir), "--threads",
                                   str(threads), "--no-progress", *([ALLOW_FLAG] if allow_code_change else [])],
                                  run_dir / "train.log", run_dir.name)
        bar = tqdm(total=steps, desc=run_dir.name, unit="step", leave=False, disable=not progress, position=position)
        return cls(run_dir, handle, bar, slot=queued is None)

    def poll(self) -> bool:
        """Refresh the progress bar from metrics.jsonl; whether the process is still running."""
        rows = [r for r in read_jsonl(self.run_dir / "metrics.jsonl")  # its own process drops what is no step
                if isinstance(r, dict) and type(r.get("step")) is int]
        if rows:
            self.bar.n = rows[-1]["step"]
            self.bar.set_postfix(progress_fields(rows[-1], rows))
            self.bar.refresh()
        self.code = self.handle.poll()
        return self.code is None

    def ended(self, rid: str) -> tuple[str, str | None]:
        """The ended run's status and error (said on the terminal when it did not finish); closes its bar. A run
        whose process the launcher lost (a Ray worker that died) is `stopped` when it died before it could write its
        status, `interrupted` when the signal that stopped it (e.g. the SIGTERM that Ray sends a dead worker's
        process group) reached it first and it wrote so: both resumable; the launcher's reason is said in both."""
        status, error = run_status(self.run_dir), stopped_error(self.run_dir)
        code = self.code
        if code and status in ENDED:  # it wrote its end, then its process was lost (a worker killed before it
            # answered): the run's own record stands
            tqdm.write(f"run {rid} {status}; its process was lost after it wrote so "
                       f"({self.handle.error or f'exit {code}'})")
        elif code and status not in ("failed", "interrupted"):  # it could not write its summary
            status = "stopped" if code < 0 else "failed"  # killed by a signal (a lost worker) / e.g. a full disk
            killed = f"killed by {signal_name(-code)}" if code < 0 else None  # its log's last line is no reason
            error = self.handle.error or killed or error
        elif code and self.handle.error:  # it wrote its status, then the launcher lost it
            error = f"{self.handle.error}; the run wrote {status} ({error or 'no error'})"
        if code and status not in ENDED:
            how = "" if self.handle.error else f" (exit {code})"  # a lost process's code is the launcher's stand-in
            tqdm.write(f"run {rid} {status}{how}: {error or 'no summary'}; log in {self.run_dir / 'train.log'}")
        self.bar.close()
        return status, error

    def stop(self) -> None:
        """Stop the run (the sweep is stopping: SIGTERM, it writes "interrupted") and close its bar."""
        self.handle.stop()
        self.bar.close()
