"""Command line: python -m harness {train,sweep,lab,claims,zoo,list,bench,gpu-check,prepare,docs,soak} ...; see
README.md and docs/ (make docs-site)."""

from __future__ import annotations

import argparse
import errno
import functools
import importlib.metadata
import os
import signal
import sys
import textwrap
import traceback
from pathlib import Path

from packaging.requirements import Requirement

from harness.apps.bench import (
    SCALE_ROWS,
    SCALE_TOKENS,
    busy_main,
    lora_main,
    matmuls_main,
    memory_main,
    profile_main,
    scale_main,
    step_main,
)
from harness.apps.bench import main as bench
from harness.apps.launchers import LAUNCHERS
from harness.apps.soak import main as soak
from harness.apps.sweep import prepare_starting_policies, run_sweep
from harness.apps.worker import serve
from harness.loop.backends import BACKENDS
from harness.policy.device import resolve_device
from harness.policy.models import EMBEDDED_MODELS, prepare_embedded_model
from harness.policy.sampler import SAMPLERS
from harness.policy.warm_start import MISSED_BAND, WarmStartError
from harness.run import names
from harness.run.allocator import keep_freed_memory
from harness.run.atomic import atomic_write, disk_full_error
from harness.run.config import (
    check_this_machine,
    experiment_description,
    experiment_paths,
    load_experiment,
    run_configs,
    run_id,
)
from harness.run.errors import ConfigError
from harness.run.locks import FolderBusyError
from harness.run.names import first_sentence
from harness.run.provenance import ALLOW_FLAG, check_code
from harness.run.records import ENDED, check_resume
from harness.run.threads import prefer as prefer_threads
from harness.tasks import available_tasks, reasoning_gym_datasets
from objectives import OBJECTIVES, Objective, available_advantages
from objectives.base import alias_of

MAIN_PROCESS = os.environ.get("RANK", "0") == "0"  # not a secondary process of `accelerate launch` / torchrun


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # so a terminated run writes status "interrupted" and closes its files


def cmd_train(args) -> int:
    cfg = load_experiment(args.experiment, args.overrides)
    cfg.sweep.grid, cfg.sweep.per_objective = {}, {}  # a single run: the experiment's base settings
    (run,) = run_configs(cfg)
    prefer_threads(args.threads)  # a sweep's share of the cores, for a run without its own threads
    check_this_machine([run])
    run_dir = Path(args.run_dir) if args.run_dir else Path(run.results_dir) / run.name / run_id(run)
    # another run's folder, or one another process is writing: refused before anything is printed or touched
    # (the folder is probed by the main process only: `accelerate launch`'s others write nothing of the run)
    check_resume(run, run_dir, main=MAIN_PROCESS)
    if MAIN_PROCESS:  # a run begun by other code: refused unless --allow-code-change (harness/run/provenance.py)
        check_code([run_dir], args.allow_code_change, "train")
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
        full = disk_full_error(e, run_dir)
        if full is not None:  # no traceback file: there is no room for it, and the line says all
            print(f"error: {full}", file=sys.stderr)
            return 1
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(run_dir / "traceback.txt", traceback.format_exc())
            where = f" (traceback in {run_dir / 'traceback.txt'})"
        except OSError as write_error:
            where = f" (no traceback file: {write_error.strerror or write_error})"
        print(f"error: {type(e).__name__}: {e}{where}", file=sys.stderr)
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
    finished = sum(e["status"] == "finished" for e in entries)
    print(f"{finished}/{len(entries)} runs finished" + (f", {len(entries) - finished - len(failed)} diverged"
                                                         if finished + len(failed) < len(entries) else "") +
          (f"; not finished: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    report_status = 0
    if not args.no_report:  # the report of whatever exists, in the sweep's own results folder
        # imported when a report is written: the plotting stack takes seconds, which every run of a sweep (a
        # `python -m harness train` process of its own) would pay
        from analysis.__main__ import main as analyse

        report_status = analyse([str(Path(cfg.results_dir) / cfg.name)])
    return 1 if failed or report_status else 0


def int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers >= 1 (``--rows 32,64``)."""
    return tuple(positive_int(part) for part in text.split(","))


def int_at_least(low: int):
    """An argparse type: an integer >= ``low``; anything else one line saying so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value
    return parse


positive_int, non_negative_int = int_at_least(1), int_at_least(0)


def name_list(text: str) -> list[str]:
    """A comma-separated list of names, each once (``--objectives grpo,gspo``); an empty list or name is refused."""
    names = [part.strip() for part in text.split(",")]
    if not any(names):
        raise argparse.ArgumentTypeError("give at least one name (comma-separated, e.g. grpo,gspo), or leave the "
                                         "option out for all of them")
    if not all(names):
        raise argparse.ArgumentTypeError(f"an empty name in {text!r}: separate the names by single commas")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} given twice in {text!r}: name each once")
    return names


def accuracy(text: str) -> float:
    """An accuracy a run can reach: a number in (0, 1] (0 is reached at the start; above 1 never)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be an eval accuracy in (0, 1], got {text!r}")
    return value


def cmd_list(args) -> int:
    shared = ", ".join(f"{k}={v}" for k, v in Objective.hyperparameters().items() if k != "aggregation")
    print("objectives (objective.name; hyperparameters objective.params.*):")
    print(textwrap.fill(f"every objective also takes: aggregation (its default below), {shared}", 116,
                        initial_indent="  ", subsequent_indent="    "))
    for name in OBJECTIVES.names():
        alias = alias_of(name)
        if alias is not None:
            changed = ", ".join(f"{k}={v}" for k, v in alias[1].items())
            print(f"  {name:12s} alias of {alias[0]}" + (f" with {changed}" if changed else ""))
            continue
        cls = OBJECTIVES.get(name)
        params = ", ".join(f"{k}={v}" for k, v in names.own_hyperparameters(name).items())
        line = (f"  {name:12s} advantage={cls.default_advantage:10s} "
                f"aggregation={cls.hyperparameters()['aggregation']:24s} {params}")
        print(textwrap.fill(line, 116, subsequent_indent=" " * 15))
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

            return throughput(args.overrides, jobs=args.jobs, rev=args.against)
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
    return lab(args.experiment, args.overrides, progress=not args.no_progress)


def cmd_claims(args) -> int:
    from harness.apps.claims import main as claims  # imported when used: the plotting stack (cmd_sweep's note)

    return claims(args.names, jobs=args.jobs, progress=not args.no_progress, run=not args.existing,
                  allow_code_change=args.allow_code_change, with_long=args.with_long)


def cmd_zoo(args) -> int:
    from harness.apps.zoo import main as zoo  # imported when used: the plotting stack (cmd_sweep's note)

    given = {k: v for k, v in (("seeds", args.seeds), ("target", args.target)) if v is not None}  # else zoo.py's
    if args.objectives is not None:  # name_list refused an empty list or name
        given["objectives"] = args.objectives
    return zoo(**given, jobs=args.jobs, overrides=args.overrides, progress=not args.no_progress,
               report=not args.no_report, allow_code_change=args.allow_code_change, stage=args.stage)


def cmd_explain(args) -> int:
    if args.write:
        changed = names.write_docs()
        print(f"rewrote the generated tables in {', '.join(map(str, changed))}" if changed else
              "the generated tables are up to date", file=sys.stderr)
        return 0
    if args.markdown:
        print(names.names_markdown() if args.key is None else names.generated(args.key), end="")
        return 0
    try:
        print(names.explain(args.key))
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    return 0


def cmd_worker(args) -> int:
    return serve(sys.stdin, main)


def cmd_gpu_check(args) -> int:
    from harness.apps.gpu_check import main as gpu_check  # imported when asked: it builds a model folder

    return gpu_check(device=args.device)


def cmd_soak(args) -> int:
    where = {"out": Path(args.out)} if args.out else {}
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


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors in one line (its own prints the usage first): what is wrong, then where the options
    are listed. Its subcommands' parsers are of this class too (argparse makes them of the parent's)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (`{self.prog} -h` lists the options)\n")


ALLOW_HELP = ("continue runs that other code (another commit or other changes) began; summary.json's segments record "
              "each start's code (refused otherwise)")


def build_parser() -> argparse.ArgumentParser:
    """Every command, its arguments and their help."""
    parser = OneLineParser(prog="python -m harness", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_run_commands, add_lab_and_claims, add_zoo, add_tools, add_bench):
        add(sub)
    return parser


def add_run_commands(sub) -> None:
    """train and sweep."""
    for name, help_text in (("train", "train one run of an experiment (its sweep section is ignored)"),
                            ("sweep", "run or resume every run of an experiment's sweep")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("experiment", help="experiment name in experiments/ or a path to a YAML file")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=20 objective.name=gspo")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        p.add_argument(ALLOW_FLAG, action="store_true", help=ALLOW_HELP)
    sub.choices["train"].add_argument("--run-dir", help="write the run here (default results/<name>/<run_id>)")
    sub.choices["train"].add_argument("--threads", type=non_negative_int, default=0,
                                      help="torch CPU threads of a run without its own threads setting (0: the "
                                           "cores free when it starts; harness/run/threads.py)")
    sub.choices["sweep"].add_argument("--jobs", type=positive_int, default=None,
                                      help="runs at once (default with --launcher local: one per GPU, each on its "
                                           "own, or --cpu-jobs without GPUs; all on a cluster)")
    sub.choices["sweep"].add_argument("--cpu-jobs", type=positive_int, default=1,
                                      help="--launcher local without --jobs on a machine without GPUs: runs at once")
    sub.choices["sweep"].add_argument("--launcher", choices=LAUNCHERS, default="local",
                                      help="where runs execute: child processes here, Ray tasks, SLURM jobs "
                                           "(submitit); settings in the experiment's launcher section")
    sub.choices["sweep"].add_argument("--no-report", action="store_true", help="do not write the report afterwards")


def add_lab_and_claims(sub) -> None:
    """lab and claims."""
    lab = sub.add_parser("lab", help="every objective's gradient on the same batches (docs/lab.md)")
    lab.add_argument("experiment", help="a lab experiment (e.g. lab) or a path to a YAML file")
    lab.add_argument("overrides", nargs="*", help="key=value overrides, e.g. lab.batches=4 lab.objectives=[grpo,gspo]")
    lab.add_argument("--no-progress", action="store_true", help="no progress bar")
    lab.add_argument("--threads", type=non_negative_int, default=0,
                     help="torch CPU threads of a lab without its own threads setting (0: the free cores)")
    claims = sub.add_parser("claims", help="run the paper-claims ledger (experiments/claims/) and write its table")
    claims.add_argument("names", nargs="*", help="claim files to run (default: all but the long ones); the ledger "
                        "keeps a row for every other claim, checked on its runs as they are")
    claims.add_argument("--with-long", action="store_true",
                        help="also the long claims (SmolLM2 sweeps, hours on 2 cores): with no names all of them; "
                             "a long claim named runs only with it")
    claims.add_argument("--jobs", type=positive_int, default=2, help="sweep runs in parallel processes")
    claims.add_argument("--no-progress", action="store_true", help="no progress bars")
    claims.add_argument(ALLOW_FLAG, action="store_true", help=ALLOW_HELP)
    claims.add_argument("--existing", action="store_true",
                        help="check the claims on the results that exist; start no run (those not done are left out)")


def add_zoo(sub) -> None:
    """zoo."""
    zoo = sub.add_parser("zoo", help="every registered objective through the stress regimes; the leaderboard")
    zoo.add_argument("overrides", nargs="*", help="key=value overrides for every run, e.g. train.steps=2")
    zoo.add_argument("--stage", choices=("screen", "confirm", "both"), default="both",
                     help="screen: every objective, one starting policy; confirm: the plan the screen decides, on "
                          "fresh starting policies and seeds; both (default): one, then the other (docs/replicates.md)")
    zoo.add_argument("--seeds", type=positive_int, help="the screen's seeds per objective and cell (default: "
                                                        "harness/apps/zoo.py)")
    zoo.add_argument("--jobs", type=positive_int, default=2, help="runs in parallel processes")
    zoo.add_argument("--target", type=accuracy, help="eval accuracy of the tokens-to-target column (default: zoo.py)")
    zoo.add_argument("--objectives", type=name_list,
                     help="a comma-separated subset (default: every registered objective)")
    zoo.add_argument("--no-progress", action="store_true", help="no progress bars")
    zoo.add_argument("--no-report", action="store_true", help="only the leaderboard, not the per-cell report")
    zoo.add_argument(ALLOW_FLAG, action="store_true", help=ALLOW_HELP)


def add_tools(sub) -> None:
    """list, explain, prepare, docs, worker, soak and gpu-check."""
    sub.add_parser("list", help="registered objectives, advantage estimators, tasks and experiments")
    explain = sub.add_parser("explain", help="a config key's meaning, default, TRL GRPOConfig and verl names")
    explain.add_argument("key", nargs="?", help="our key, or a TRL / verl name (none: the whole table)")
    explain.add_argument("--markdown", action="store_true", help="the table as Markdown (KEY names|aliases|objectives)")
    explain.add_argument("--write", action="store_true", help="rewrite the generated tables in docs/trl.md, README.md")
    prepare = sub.add_parser("prepare", help="dequantize the embedded SmolLM2 once and cache it as safetensors; "
                                             "with an experiment: cache its runs' starting policies (warm starts)")
    prepare.add_argument("experiment", nargs="?", help="an experiment or a run's config.yaml")
    prepare.add_argument("overrides", nargs="*", help="key=value overrides")
    prepare.add_argument("--threads", type=non_negative_int, default=0, help="torch CPU threads (0: the free cores)")
    docs = sub.add_parser("docs", help="re-run what the docs quote; rewrite docs/ figures and docs/results.md")
    docs.add_argument("--with-gsm8k", action="store_true",
                      help="also gsm8k_ablation: docs/results_gsm8k.md (its wall time there)")
    docs.add_argument("--with-zoo", nargs="?", const="both", choices=("screen", "both"),
                      help="also the zoo's leaderboard, docs/zoo.md: both stages, or the screen alone (screen)")
    docs.add_argument("--with-moe", action="store_true",
                      help="also moe_stability and the MoE claims: docs/results_moe.md (its wall time there)")
    docs.add_argument("--with-smollm2", nargs="?", const="both", choices=("rl", "both"),
                      help="also smollm2_rl and smollm2_transfer, or smollm2_rl alone (rl): docs/results_smollm2.md "
                           "(its wall time there)")
    docs.add_argument("--skip-main", action="store_true", help="only the --with-* pages, not docs/results.md")
    docs.add_argument("--jobs", type=positive_int, default=2, help="runs in parallel processes")
    worker = sub.add_parser("worker", help="a local sweep's process that trains its runs one after another, told "
                                           "which on stdin (harness/apps/worker.py; started by the sweep)")
    worker.add_argument("folder", help="the sweep's results folder (names the process only)")
    soak = sub.add_parser("soak", help="kill sweeps and runs at random moments; check nothing is lost or repeated")
    soak.add_argument("--kills", type=positive_int, default=20)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--steps", type=positive_int, default=30, help="steps of each of the sweep's two runs")
    soak.add_argument("--jobs", type=positive_int, default=2, help="the sweep's runs at once (each a worker process)")
    soak.add_argument("--out", help="the folder of soak.json (default: the checkout's results/soak)")
    gpu = sub.add_parser("gpu-check", help="the GPU path in minutes: the tiny model and a Qwen2.5-0.5B-shaped one "
                                           "(random weights), native bf16 with and without LoRA, the TRL backend: "
                                           "tokens/s and peak memory (docs/benchmark.md)")
    gpu.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                     help="cpu: the same checks at tiny shapes (a dry run of the command)")


def add_bench(sub) -> None:
    """bench and its measurements."""
    bench = sub.add_parser("bench", help="time one full step with the embedded SmolLM2 (docs/benchmark.md)")
    bench.add_argument("overrides", nargs="*")
    bench.add_argument("--repeats", type=positive_int, default=1,
                       help="measure N times from the same weights and seed; print the medians and the ratios' range")
    bench.add_argument("--busy", action="store_true",
                       help="one native step per thread setting, on this machine as it is and beside a busy process "
                            "(oversubscription; docs/threads.md)")
    bench.add_argument("--step", action="store_true", help=argparse.SUPPRESS)  # --busy's child: one step, JSON
    bench.add_argument("--full-length", action="store_true", help=argparse.SUPPRESS)  # --scale's child: no EOS
    bench.add_argument("--scale", action="store_true",
                       help="peak memory and step time per (sequences, new tokens) point, a fresh process each, every "
                            "row at full length (docs/benchmark.md, Scaling)")
    bench.add_argument("--rows", type=int_list, default=SCALE_ROWS, metavar="N,N,...",
                       help="--scale: sequences per rollout step (prompts x group size)")
    bench.add_argument("--tokens", type=int_list, default=SCALE_TOKENS, metavar="N,N,...",
                       help="--scale: new tokens per sequence")
    bench.add_argument("--lora", action="store_true",
                       help="one native step with full fine-tuning beside one with LoRA adapters (model.lora.rank, "
                            "else 16): seconds and peak memory, a fresh process each")
    bench.add_argument("--matmuls", action="store_true",
                       help="only the decode step's matmul shapes, MKL vs oneDNN GFLOP/s (harness/policy/decode.py)")
    bench.add_argument("--profile", action="store_true",
                       help="only torch.profiler's operators of one native rollout and one update, after a warm-up")
    bench.add_argument("--sweep-throughput", action="store_true",
                       help="runs per CPU-hour of quickstart's sweep (with the overrides), a process per run against "
                            "worker processes, and whether both give the same runs (harness/apps/throughput.py)")
    bench.add_argument("--jobs", type=positive_int, default=2, help="--sweep-throughput: runs at once")
    bench.add_argument("--against", metavar="REV", default=None,
                       help="--sweep-throughput: also the sweep at commit REV, a process per run, and this code's "
                            "runs per CPU-hour over REV's")
    bench.add_argument("--memory", action="store_true",
                       help="only the peak memory of one native rollout and one update after a warm-up, what the "
                            "model's size implies, and the update's operators by the memory they allocate")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides += extra  # overrides after an option: `sweep quickstart --jobs 2 seed=3`
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
        print("interrupted: run the same command again to resume (finished steps are kept)", file=sys.stderr)
        return 130


COMMANDS = {"train": cmd_train, "sweep": cmd_sweep, "list": cmd_list, "prepare": cmd_prepare, "bench": cmd_bench,
            "docs": cmd_docs, "soak": cmd_soak, "lab": cmd_lab, "claims": cmd_claims, "explain": cmd_explain,
            "zoo": cmd_zoo, "worker": cmd_worker, "gpu-check": cmd_gpu_check}


def failure_status(e: Exception) -> int | None:
    """A failure the user can fix, said in one line on stderr: the exit status (2: the settings or the place, 1: a
    full disk, MISSED_BAND (3): a warm start that missed its band, 0: the reader of stdout has gone); None for any
    other (its traceback is raised)."""
    if isinstance(e, ConfigError):
        if MAIN_PROCESS:  # every process of a distributed launch finds the same
            print(f"config error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, FolderBusyError):
        print(f"error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, WarmStartError):  # `sweep`, `prepare`: the starting policy, before any run (a run's: cmd_train)
        print(f"error: {e}", file=sys.stderr)
        return MISSED_BAND
    if isinstance(e, BrokenPipeError):  # `python -m harness explain | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if isinstance(e, PermissionError):
        print(f"error: cannot write {e.filename} ({e.strerror}); choose a writable results_dir=...", file=sys.stderr)
        return 2
    if isinstance(e, OSError) and e.errno == errno.ELOOP:  # a link where the harness writes (it never follows one)
        print(f"error: {e.filename} is a symbolic link (or a loop of them), which the harness does not write through; "
              "remove it and run again", file=sys.stderr)
        return 2
    if isinstance(e, OSError) and e.errno == errno.EROFS:
        print(f"error: {e.filename} is on a read-only file system; choose a writable results_dir=...", file=sys.stderr)
        return 2
    full = disk_full_error(e)  # a sweep's manifest, a lab's batch, a cache file, ...
    if full is None:
        return None
    print(f"error: {full}", file=sys.stderr)
    return 1


