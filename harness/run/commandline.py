"""The command line's commands and arguments, parsed before anything heavy is imported: ``python -m harness -h``, a
subcommand's ``-h`` and a mistyped option answer at once, not after the seconds that importing torch and transformers
take (harness/__main__.py parses first; harness/apps/cli.py runs the command). Nothing here imports torch.

    args = parse(["sweep", "quickstart", "--jobs", "2", "seed=3"])   # overrides may follow the options
"""

from __future__ import annotations

import argparse

from harness.run.errors import ConfigError, say_config_error
from harness.run.experiments import experiment_path
from harness.run.provenance import ALLOW_FLAG, DISTRIBUTION, code_record

DESCRIPTION = ("Command line: python -m harness {train,sweep,lab,claims,zoo,list,explain,bench,gpu-check,prepare,"
               "docs,soak} ...; see README.md and docs/ (make docs-site).")
LAUNCHERS = ("local", "ray", "slurm")  # --launcher: where a sweep's runs execute (harness/apps/launchers.py)
SCALE_ROWS = (32, 64, 128)  # `bench --scale`'s default grid: sequences per rollout step (prompts x group size) ...
SCALE_TOKENS = (128, 256, 512)  # ... and new tokens per sequence


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments of ``argv`` (default: the process's); a mistake ends the process with one line and status 2.
    key=value overrides may also follow the options (``sweep quickstart --jobs 2 seed=3``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides += extra
    elif extra:  # named by the command's own parser (the top-level one knows nothing of the command's arguments)
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "bench":
        given_without_mode(parser.commands["bench"], args)
    return args


def refused_experiment(args: argparse.Namespace) -> int | None:
    """train, sweep, lab, prepare: an experiment that is not there (said before any import), or settings that
    load_experiment refuses, in the file or on the command line (a mistyped key, a value of the wrong type: said after
    the imports that reading them needs, torch and the objectives, not the model's and the runs' libraries), in the
    one line the command would say after all its imports; its exit status, 2, or None. The process's entry point asks
    (harness/__main__.py), so that a worker running a command in its own process gets the command's status."""
    if getattr(args, "experiment", None):
        try:
            experiment_path(args.experiment)
            from harness.run.config import load_experiment  # the schema: torch and the objectives' hyperparameters

            load_experiment(args.experiment, args.overrides)
        except ConfigError as e:
            return say_config_error(e)
    return None


# bench's modes, each its own measurement (its --step and --full-length are --busy's and --scale's children's)
BENCH_MODES = ("busy", "scale", "lora", "matmuls", "profile", "memory", "sweep_throughput")
# bench's options that only one of its modes reads: option -> (the mode's flag, its default)
BENCH_MODE_OPTIONS = {"rows": ("scale", SCALE_ROWS), "tokens": ("scale", SCALE_TOKENS),
                      "jobs": ("sweep_throughput", 2), "against": ("sweep_throughput", None),
                      "passes": ("sweep_throughput", 1)}


def given_without_mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Two bench modes at once, or a bench option given without the mode that reads it (``--rows`` without
    ``--scale``: ignored, silently), end the process with one line; the others get their defaults."""
    modes = [mode for mode in BENCH_MODES if getattr(args, mode)]
    if len(modes) > 1:  # one ran, the others were dropped without a word
        parser.error(f"{' and '.join('--' + m.replace('_', '-') for m in modes)} are separate measurements: give one "
                     "per command")
    if modes and getattr(args, "repeats", None) is not None:  # read by the default measurement alone: ignored
        parser.error(f"--repeats is read by the step's measurement only (no mode): leave --repeats or "
                     f"--{modes[0].replace('_', '-')} out")
    if getattr(args, "repeats", 0) is None:
        args.repeats = 1
    for option, (mode, default) in BENCH_MODE_OPTIONS.items():
        if getattr(args, option) is not None and not getattr(args, mode):
            parser.error(f"--{option.replace('_', '-')} is read by --{mode.replace('_', '-')} only: add "
                         f"--{mode.replace('_', '-')} or leave --{option.replace('_', '-')} out")
        if getattr(args, option) is None:
            setattr(args, option, default)


def int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers >= 1 (``--rows 32,64``)."""
    return tuple(positive_int(part) for part in text.split(","))


def int_at_least(low: int):
    """An argparse type: an integer >= ``low``; anything else one line saying so."""
    def checked(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value
    return checked


positive_int, non_negative_int = int_at_least(1), int_at_least(0)
SCREEN_SEEDS_MAX = 100  # zoo --seeds: the screen's seeds per objective and cell (x objectives x cells runs)


def screen_seeds(text: str) -> int:
    """zoo --seeds: 1 to SCREEN_SEEDS_MAX (100 already makes 100 x objectives x cells runs; 10000 planned for
    minutes without a word)."""
    value = positive_int(text)
    if value > SCREEN_SEEDS_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {SCREEN_SEEDS_MAX} (seeds per objective and cell of the "
                                         f"screen; the confirmation adds its own), got {text!r}")
    return value


def folder(text: str) -> str:
    """A folder's path: not empty (an empty one would be taken for the current folder or for no option at all)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a folder; leave the option out for the default")
    return text


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


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors in one line (its own prints the usage first): what is wrong, then where the options
    are listed. Its subcommands' parsers are of this class too (argparse makes them of the parent's)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (`{self.prog} -h` lists the options)\n")


ALLOW_HELP = ("continue runs that other code (another commit or other changes) began; summary.json's segments record "
              "each start's code (refused otherwise)")


class Version(argparse.Action):
    """``--version``: the package's version and the code's (its commit; +diff-<hash> with changes), as a run
    records them; read when asked (git), not for every command."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="the package's version and the code's (its commit)")

    def __call__(self, parser, namespace, values, option_string=None):
        record = code_record()
        print(f"{parser.prog} {record['packages'].get(DISTRIBUTION)} (code {record['version']})")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    """Every command, its arguments and their help."""
    parser = OneLineParser(prog="python -m harness", description=DESCRIPTION)
    parser.add_argument("--version", "-V", action=Version)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_run_commands, add_lab_and_claims, add_zoo, add_tools, add_bench):
        add(sub)
    parser.commands = sub.choices  # each command's parser, by name
    return parser


def add_run_commands(sub) -> None:
    """train and sweep."""
    for name, help_text in (("train", "train one run of an experiment (its sweep section is ignored)"),
                            ("sweep", "run or resume every run of an experiment's sweep")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("experiment", help="experiment name in experiments/ or a path to a YAML file")
        p.add_argument("overrides", nargs="*", default=[],
                       help="key=value overrides, e.g. train.steps=20 objective.name=gspo")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        p.add_argument(ALLOW_FLAG, action="store_true", help=ALLOW_HELP)
    sub.choices["train"].add_argument("--run-dir", type=folder, help="write the run here (default "
                                      "results/<name>/<run_id>)")
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
    lab.add_argument("overrides", nargs="*", default=[],
                     help="key=value overrides, e.g. lab.batches=4 lab.objectives=[grpo,gspo]")
    lab.add_argument("--no-progress", action="store_true", help="no progress bar")
    lab.add_argument("--threads", type=non_negative_int, default=0,
                     help="torch CPU threads of a lab without its own threads setting (0: the free cores)")
    claims = sub.add_parser("claims", help="run the paper-claims ledger (experiments/claims/) and write its table")
    claims.add_argument("names", nargs="*", default=[], help="claim files to run (default: all but the long ones); "
                        "the ledger keeps a row for every other claim, checked on its runs as they are")
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
    zoo.add_argument("overrides", nargs="*", default=[], help="key=value overrides for every run, e.g. train.steps=2")
    zoo.add_argument("--stage", choices=("screen", "confirm", "both"), default="both",
                     help="screen: every objective, one starting policy; confirm: the plan the screen decides, on "
                          "fresh starting policies and seeds; both (default): one, then the other (docs/replicates.md)")
    zoo.add_argument("--seeds", type=screen_seeds, help="the screen's seeds per objective and cell, at most "
                                                        f"{SCREEN_SEEDS_MAX} (default: harness/apps/zoo.py)")
    zoo.add_argument("--start-policies", type=int_at_least(2),
                     help="the confirmation's starting policies, 2 to the candidates' number (default 3: its verdicts "
                          "then indicative; from 5 not: docs/replicates.md)")
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
    prepare.add_argument("overrides", nargs="*", default=[], help="key=value overrides")
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
    bench.add_argument("overrides", nargs="*", default=[])
    bench.add_argument("--repeats", type=positive_int,
                       help="measure N times from the same weights and seed; print the medians and the ratios' range "
                            "(the step's measurement only, without a mode; default 1)")
    bench.add_argument("--busy", action="store_true",
                       help="one native step per thread setting, on this machine as it is and beside a busy process "
                            "(oversubscription; docs/threads.md)")
    bench.add_argument("--step", action="store_true", help=argparse.SUPPRESS)  # --busy's child: one step, JSON
    bench.add_argument("--full-length", action="store_true", help=argparse.SUPPRESS)  # --scale's child: no EOS
    bench.add_argument("--scale", action="store_true",
                       help="peak memory and step time per (sequences, new tokens) point, a fresh process each, every "
                            "row at full length (docs/benchmark.md, Scaling)")
    bench.add_argument("--rows", type=int_list, default=None, metavar="N,N,...",
                       help="--scale: sequences per rollout step (prompts x group size; "
                            f"default {','.join(map(str, SCALE_ROWS))})")
    bench.add_argument("--tokens", type=int_list, default=None, metavar="N,N,...",
                       help=f"--scale: new tokens per sequence (default {','.join(map(str, SCALE_TOKENS))})")
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
    bench.add_argument("--jobs", type=positive_int, default=None, help="--sweep-throughput: runs at once (2)")
    bench.add_argument("--against", metavar="REV", default=None,
                       help="--sweep-throughput: also the sweep at commit REV, a process per run, and this code's "
                            "runs per CPU-hour over REV's")
    bench.add_argument("--passes", type=positive_int, default=None,
                       help="--sweep-throughput: measure every side N times, each pass in the reverse order of the "
                            "one before, and sum each side's CPU time (2: a drift of this machine's speed that is "
                            "linear in time falls on every side alike; default 1)")
    bench.add_argument("--memory", action="store_true",
                       help="only the peak memory of one native rollout and one update after a warm-up, what the "
                            "model's size implies, and the update's operators by the memory they allocate")
