"""Command line: python -m harness {train,sweep,lab,claims,zoo,list,explain,bench,gpu-check,prepare,docs,soak} ...;
see README.md and docs/ (make docs-site). The commands and their arguments: harness/run/commandline.py (parsed there
before this module's imports); what each command does: here."""

from __future__ import annotations

import errno
import functools
import importlib.metadata
import os
import signal
import sys
import textwrap
from pathlib import Path

from packaging.requirements import Requirement

from harness.apps.bench import (
    busy_main,
    lora_main,
    matmuls_main,
    memory_main,
    profile_main,
    scale_main,
    step_main,
)
from harness.apps.bench import main as bench
from harness.apps.soak import main as soak
from harness.apps.sweep import PreparationError, prepare_starting_policies, run_sweep
from harness.apps.worker import serve
from harness.loop.backends import BACKENDS
from harness.policy.device import resolve_device
from harness.policy.models import EMBEDDED_MODELS, cache_dir, prepare_embedded_model
from harness.policy.sampler import SAMPLERS
from harness.policy.warm_start import MISSED_BAND, WarmStartError
from harness.run import names
from harness.run.allocator import keep_freed_memory
from harness.run.atomic import check_writable, disk_full_error, failure_line
from harness.run.commandline import parse
from harness.run.config import (
    check_this_machine,
    experiment_description,
    load_experiment,
    run_configs,
    run_id,
)
from harness.run.errors import INTERRUPTED, MAIN_PROCESS, ConfigError, interrupted, reader_gone, say_config_error
from harness.run.experiments import experiment_paths
from harness.run.locks import FolderBusyError
from harness.run.names import first_sentence
from harness.run.provenance import check_code
from harness.run.records import ENDED, check_resume, say_memory_changes
from harness.run.threads import check_count as check_thread_count
from harness.run.threads import prefer as prefer_threads
from harness.tasks import available_tasks, reasoning_gym_datasets
from objectives import OBJECTIVES, Objective, available_advantages
from objectives.base import alias_of


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # so a terminated run writes status "interrupted" and closes its files


def cmd_train(args) -> int:
    cfg = load_experiment(args.experiment, args.overrides)
    cfg.sweep.grid, cfg.sweep.per_objective = {}, {}  # a single run: the experiment's base settings
    (run,) = run_configs(cfg)
    prefer_threads(args.threads)  # a sweep's share of the cores, for a run without its own threads
    check_thread_count(run.threads, "threads")
    check_thread_count(args.threads, "--threads")
    check_this_machine([run])
    run_dir = Path(args.run_dir) if args.run_dir else Path(run.results_dir) / run.name / run_id(run)
    # another run's folder, or one another process is writing: refused before anything is printed or touched
    # (the folder is probed by the main process only: `accelerate launch`'s others write nothing of the run)
    memory = check_resume(run, run_dir, main=MAIN_PROCESS)
    if MAIN_PROCESS:  # a run begun by other code: refused unless --allow-code-change (harness/run/provenance.py)
        check_code([run_dir], args.allow_code_change, "train")
        if memory:  # said once every check has passed: a refused resume writes nothing
            say_memory_changes(run_dir, memory)
    device = resolve_device(run.device)
    say = print if MAIN_PROCESS else lambda *a, **k: None  # `accelerate launch`: once, not once per process
    lora = f" (LoRA rank {run.model.lora.rank})" if run.model.lora.rank else ""
    say(f"{run.backend} run on {device}{' (device=auto)' if run.device == 'auto' else ''}, {run.model.dtype}, "
        f"model {run.model.name}{lora}, task {run.task.name}, objective {run.objective.name}, seed {run.seed} -> "
        f"{run_dir}", file=sys.stderr)
    try:
        summary = BACKENDS[run.backend].train(run, run_dir, progress=not args.no_progress)
    except (ConfigError, FolderBusyError, KeyboardInterrupt):
        raise
    except Exception as e:  # the run's own failure: one line here, the traceback beside the run
        print(f"error: {failure_line(e, run_dir)}", file=sys.stderr)
        return 1
    say(f"{summary['status']}: eval accuracy {rounded(summary['start_eval_accuracy'])} at the start, "
        f"{rounded(summary['final_eval_accuracy'])} at the end (best {rounded(summary['best_eval_accuracy'])}), "
        f"{summary['wall_time_s']:.0f} s", file=sys.stderr)
    return 0


def rounded(value: float | None) -> str:
    """A figure for the terminal: 3 decimals (an accuracy over 120 problems is 0.008, not 0.008333333333333333)."""
    return "n/a" if value is None else f"{value:.3f}"


def cmd_sweep(args) -> int:
    cfg = load_experiment(args.experiment, args.overrides)
    entries = run_sweep(cfg, jobs=args.jobs, progress=not args.no_progress, launcher=args.launcher,
                        allow_code_change=args.allow_code_change, cpu_jobs=args.cpu_jobs)
    failed = [e["run_id"] for e in entries if e["status"] not in ENDED]  # diverged: an outcome, not a failure
    running = [e["run_id"] for e in entries if e["status"] == "running"]  # left to a writer on another host
    unfinished = [rid for rid in failed if rid not in running]
    finished = sum(e["status"] == "finished" for e in entries)
    print(f"{finished}/{len(entries)} runs finished" + (f", {len(entries) - finished - len(failed)} diverged"
                                                         if finished + len(failed) < len(entries) else "") +
          (f"; still running on another host: {', '.join(running)}" if running else "") +
          (f"; not finished: {', '.join(unfinished)}" if unfinished else ""), file=sys.stderr)
    report_status = 0
    if not args.no_report:  # the report of whatever exists, in the sweep's own results folder
        # imported when a report is written: the plotting stack takes seconds, which every run of a sweep (a
        # `python -m harness train` process of its own) would pay
        from analysis.__main__ import main as analyse

        report_status = analyse([str(Path(cfg.results_dir) / cfg.name)])
    return 1 if failed or report_status else 0


def cmd_list(args) -> int:
    shared = ", ".join(f"{k}={v}" for k, v in Objective.hyperparameters().items() if k != "aggregation")
    print("objectives (objective.name; hyperparameters objective.params.*):")
    print(textwrap.fill(f"every objective also takes: aggregation (its default below), {shared}", 116,
                        initial_indent="  ", subsequent_indent="    "))
    width = max(12, *map(len, OBJECTIVES.names()))  # the columns line up under the longest name
    for name in OBJECTIVES.names():
        alias = alias_of(name)
        if alias is not None:
            changed = ", ".join(f"{k}={v}" for k, v in alias[1].items())
            print(f"  {name:{width}s} alias of {alias[0]}" + (f" with {changed}" if changed else ""))
            continue
        cls = OBJECTIVES.get(name)
        params = ", ".join(f"{k}={v}" for k, v in names.own_hyperparameters(name).items())
        line = (f"  {name:{width}s} advantage={cls.default_advantage:10s} "
                f"aggregation={cls.hyperparameters()['aggregation']:24s} {params}")
        print(textwrap.fill(line, 116, subsequent_indent=" " * (width + 3)))
    print("advantages (objective.advantage): " + ", ".join(available_advantages()))
    print("tasks (task.name):                " + ", ".join(available_tasks()))
    generators = reasoning_gym_datasets()
    print(f"  reasoning_gym generators (task.args.dataset, {len(generators)}):")
    print(textwrap.fill(", ".join(generators), 116, initial_indent="    ", subsequent_indent="    "))
    print("models (model.name):              " + ", ".join(EMBEDDED_MODELS) + ", or a hub id / local folder")
    print("samplers (train.sampler):         " + ", ".join(SAMPLERS))
    print("experiments (EXP=...):")
    for path in experiment_paths():
        print(textwrap.fill(first_sentence(experiment_description(path)), 116, initial_indent=f"  {path.stem:20s} ",
                            subsequent_indent=" " * 23))
    return 0


def cmd_prepare(args) -> int:
    if args.experiment:  # a sweep's starting policies, built on the node a launcher picked (harness/apps/sweep.py)
        runs = run_configs(load_experiment(args.experiment, args.overrides))
        check_this_machine(runs)  # the node that builds them: its cache, its hub access
        prefer_threads(args.threads)
        prepare_starting_policies(runs, progress=True)
        return 0
    print(f"embedded model cached at {prepare_embedded_model()}")
    return 0


def cmd_bench(args) -> int:
    try:
        if args.sweep_throughput:
            from harness.apps.throughput import main as throughput

            return throughput(args.overrides, jobs=args.jobs, rev=args.against, passes=args.passes)
        if args.busy:
            return busy_main(args.overrides)
        if args.step:
            return step_main(args.overrides, full_length=args.full_length)
        if args.scale:
            return scale_main(args.overrides, rows=args.rows, tokens=args.tokens)
        if args.lora:
            return lora_main(args.overrides)
        if args.matmuls or args.profile or args.memory:
            return (matmuls_main if args.matmuls else profile_main if args.profile else memory_main)(args.overrides)
        return bench(args.overrides, repeats=args.repeats)
    except ConfigError:  # the settings: `config error: ...` and status 2, as every command says it
        raise
    except (RuntimeError, ValueError, OSError) as e:  # e.g. no GSM8K data: one line, as for a run
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def cmd_docs(args) -> int:
    from harness.apps.docs import main as docs  # imported when used: the plotting stack (cmd_sweep's note)

    return docs(with_gsm8k=args.with_gsm8k, with_zoo=args.with_zoo, with_moe=args.with_moe, skip_main=args.skip_main,
                with_smollm2=args.with_smollm2, jobs=args.jobs)


def cmd_lab(args) -> int:
    from harness.apps.lab import main as lab  # imported when used: the plotting stack (cmd_sweep's note)

    prefer_threads(args.threads)  # the claims' share of the cores, for a lab without its own threads setting
    check_thread_count(args.threads, "--threads")
    return lab(args.experiment, args.overrides, progress=not args.no_progress)


def cmd_claims(args) -> int:
    from harness.apps.claims import main as claims  # imported when used: the plotting stack (cmd_sweep's note)

    return claims(args.names, jobs=args.jobs, progress=not args.no_progress, run=not args.existing,
                  allow_code_change=args.allow_code_change, with_long=args.with_long)


def cmd_zoo(args) -> int:
    from harness.apps.zoo import main as zoo  # imported when used: the plotting stack (cmd_sweep's note)

    given = {k: v for k, v in (("seeds", args.seeds), ("target", args.target), ("start_policies", args.start_policies))
             if v is not None}  # else zoo.py's
    if args.objectives is not None:  # name_list refused an empty list or name
        given["objectives"] = args.objectives
    return zoo(**given, jobs=args.jobs, overrides=args.overrides, progress=not args.no_progress,
               report=not args.no_report, allow_code_change=args.allow_code_change, stage=args.stage)


def cmd_worker(args) -> int:
    return serve(sys.stdin, main)


def cmd_gpu_check(args) -> int:
    from harness.apps.gpu_check import main as gpu_check  # imported when asked: it builds a model folder

    return gpu_check(device=args.device)


def cmd_soak(args) -> int:
    if args.out is not None:  # checked before the soak's minutes, not when it writes soak.json at their end
        if not args.out.strip():
            raise ConfigError("soak --out is empty: give a folder, or leave --out out for results/soak")
        check_writable(Path(args.out), "soak folder", "give --out a folder you can write")
    where = {"out": Path(args.out)} if args.out is not None else {}
    return soak(main, kills=args.kills, seed=args.seed, steps=args.steps, jobs=args.jobs, **where)


DISTRIBUTION = "rlvr-objectives-harness"  # pyproject.toml's name


def unmet_requirement() -> str | None:
    """The first of the package's own (not optional) requirements that the installed packages miss, e.g. a
    transformers older than the one whose argument names the harness passes; ``None`` when all are met (or when the
    harness runs from a checkout that pip has not installed)."""
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in map(Requirement, requirements):
        if requirement.marker is not None:  # extras (dev, track)
            continue
        installed = installed_version(requirement.name)
        if installed is None:
            return f"{requirement.name} is not installed (needs {requirement})"
        if not requirement.specifier.contains(installed, prereleases=True):
            return f"{requirement.name} {installed} is installed, the harness needs {requirement}"
    return None


@functools.cache
def installed_version(name: str) -> str | None:
    """The installed version of the distribution ``name`` (``None``: not installed), looked up once per process: each
    lookup scans the installed packages' metadata, and a process that calls :func:`main` many times (a test, the soak)
    would scan them each time."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    twice = repeated_key(getattr(args, "overrides", None) or [])
    if twice:
        given = ", ".join(o for o in args.overrides if o.partition("=")[0].strip() == twice)
        print(f"config error: {twice} is given twice on the command line ({given}): the last would win silently; "
              "give it once (make compare sets sweep.grid.objective.name and sweep.grid.seed from OBJECTIVES and "
              "SEEDS)", file=sys.stderr)
        return 2
    unmet = unmet_requirement()
    if unmet:
        print(f"error: {unmet}: run `make setup` (or `pip install -e .`) again", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C / kill -INT stop it even when started in the
    # background by a shell, which makes its children ignore SIGINT (the soak's SIGINT kills rely on it)
    try:
        keep_freed_memory()
        return COMMANDS[args.command](args)
    except Exception as e:
        status = failure_status(e)
        if status is None:
            raise
        return status
    except KeyboardInterrupt:
        if (line := interrupted(args.command)) is not None:
            print(line, file=sys.stderr)
        return INTERRUPTED


def repeated_key(overrides: list[str]) -> str | None:
    """The first key of the sweep's (``sweep.*``: what it compares) that two of the command line's key=value
    overrides set (None: none). Elsewhere the later value wins, as the experiment file's layers do."""
    seen = set()
    for override in overrides:
        key = override.partition("=")[0].strip()
        if key in seen and key.startswith("sweep."):
            return key
        seen.add(key)
    return None


COMMANDS = {"train": cmd_train, "sweep": cmd_sweep, "list": cmd_list, "prepare": cmd_prepare, "bench": cmd_bench,
            "docs": cmd_docs, "soak": cmd_soak, "lab": cmd_lab, "claims": cmd_claims, "explain": names.explain_command,
            "zoo": cmd_zoo, "worker": cmd_worker, "gpu-check": cmd_gpu_check}


def writable_advice(path) -> str:
    """What to do about a file the harness could not write: the cache's (RLVR_CACHE) or a results folder's."""
    if path is not None and Path(os.path.abspath(path)).is_relative_to(cache_dir().absolute()):
        return f"the cache folder {cache_dir()} is not writable: make it writable, or set RLVR_CACHE to another folder"
    return "choose a writable results_dir=..."


def failure_status(e: Exception) -> int | None:
    """A failure the user can fix, said in one line on stderr: the exit status (2: the settings or the place, 1: a
    full disk or a starting policy's build that failed in its own process (a launcher's job), MISSED_BAND (3): a warm
    start that missed its band, 0: the reader of stdout has gone); None for any other (its traceback is raised)."""
    if isinstance(e, ConfigError):
        return say_config_error(e)
    if isinstance(e, FolderBusyError):
        print(f"error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, WarmStartError):  # `sweep`, `prepare`: the starting policy, before any run (a run's: cmd_train)
        print(f"error: {e}", file=sys.stderr)
        return MISSED_BAND
    if isinstance(e, PreparationError):  # its own line is in its log, named here
        print(f"error: {e}", file=sys.stderr)
        return 1
    if isinstance(e, BrokenPipeError):  # `python -m harness list | head`: the reader has gone
        return reader_gone()
    if isinstance(e, PermissionError):
        print(f"error: cannot write {e.filename} ({e.strerror}); {writable_advice(e.filename)}", file=sys.stderr)
        return 2
    if isinstance(e, OSError) and e.errno == errno.ELOOP:  # a link where the harness writes (it never follows one)
        print(f"error: {e.filename} is a symbolic link (or a loop of them), which the harness does not write through; "
              "remove it and run again", file=sys.stderr)
        return 2
    if isinstance(e, OSError) and e.errno == errno.EROFS:
        print(f"error: {e.filename} is on a read-only file system; {writable_advice(e.filename)}", file=sys.stderr)
        return 2
    full = disk_full_error(e)  # a sweep's manifest, a lab's batch, a cache file, ...
    if full is None:
        return None
    print(f"error: {full}", file=sys.stderr)
    return 1


