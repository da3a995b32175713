"""The typed run configuration, experiment files, overrides and sweep expansion.

An experiment is the schema below (its dataclass defaults are the one source of defaults) merged with
``experiments/<name>.yaml``, then with command-line overrides (``key=value``, omegaconf dotlist). Its
``sweep`` section expands into runs: every point of ``sweep.grid`` (dotted key -> list of values), with
``sweep.per_objective[<name>]`` applied to the runs of that objective before the grid point. A command-line
override of a swept key pins that axis to the given value (``seed=3`` runs seed 3 only). Everything is
validated before any run starts (including the task's arguments and the tiny model's shape); errors name the
key and list the valid choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.loop.backends import BACKENDS, unsupported
from harness.run.names import translate_overrides

EXPERIMENTS_DIR = Path(__file__).resolve().parents[2] / "experiments"
GRID = "sweep.grid."  # prefix of a command-line grid override
EMBEDDED_MODELS = ("tiny", "smollm2-135m-instruct")
SAMPLERS = ("native", "hf")  # harness/policy/sampler.py: our decode loop, or transformers' generate (the reference)
DECODERS = ("auto", "shared_prefix", "per_row", "cache")  # harness/policy/decode.py
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A configuration problem, stated with the key at fault and how to fix it."""


@dataclass
class ModelConfig:
    name: str = "tiny"  # "tiny" (built from `tiny`), "smollm2-135m-instruct" (embedded), or a hub id / local path
    tiny: dict[str, Any] = field(default_factory=dict)  # TinyModelSpec fields: hidden_size, num_layers, num_heads, ...
    dtype: str = "float32"  # trainer precision
    sampler_dtype: str | None = None  # sample with a copy in this precision (train-inference mismatch); None = policy
    seed: int = 0  # tiny model's init and warm start: the starting policy, shared by all runs like a checkpoint
    warm_start_steps: int = 0  # supervised steps on the task's solutions before RL (cached); with a target: the cap
    warm_start_target: list[float] | None = None  # [low, high]: stop at the first check with held-out greedy
    #                                               accuracy in the band (an error if the cap is hit outside it)
    warm_start_check_every: int = 50  # steps between the target's accuracy checks
    warm_start_lr: float = 1e-3
    warm_start_batch_size: int = 32


@dataclass
class TaskConfig:
    name: str = "arith"
    data_dir: str | None = None  # local GSM8K folder with train.jsonl/test.jsonl (else $GSM8K_DIR, else the hub)
    eval_size: int = 128
    format_weight: float = 0.0  # reward = correct + format_weight * format (+ the overlong penalty)
    overlong_buffer: int = 0  # DAPO's soft overlong punishment: the last N tokens before max_new_tokens; 0 = off
    overlong_penalty: float = 1.0  # the penalty reached at max_new_tokens
    args: dict[str, Any] = field(default_factory=dict)  # task-specific arguments (arith: digits, operators, ...)


@dataclass
class ObjectiveConfig:
    name: str = "grpo"
    params: dict[str, Any] = field(default_factory=dict)  # hyperparameters; omitted ones take the paper's defaults
    advantage: str | None = None  # estimator; None = the objective's default


@dataclass
class RolloutCorrectionConfig:
    """train.rollout_correction: weight every token's loss by the importance ratio between the trainer's old policy
    and the sampler (verl's rollout correction, TRL's vllm_importance_sampling_*); objectives/rollout_correction.py.
    A mode other than none makes the loop recompute the trainer's old log-probs (train.old_logp is then ignored)."""

    mode: str = "none"  # none | token_truncate | token_mask | sequence_truncate | sequence_mask
    threshold: float = 2.0  # C (verl's rollout_is_threshold): truncate at C / mask ratios above C; >= 1
    threshold_lower: float | None = None  # mask ratios below it (None: 1/C, two-sided as verl; 0: one-sided as TRL)
    #                                       with a truncate mode, a lower clamp (None: none, as verl and TRL)


@dataclass
class TrainConfig:
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    epochs: int = 1  # passes (mu) over each rollout batch
    num_minibatches: int = 4  # optimizer steps per pass
    micro_batch_size: int = 0  # sequences per forward/backward; 0 = the whole minibatch
    lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    old_logp: str = "sampler"  # "sampler": the sampler's log-probs; "recompute": the trainer's, before updating
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    max_nonfinite_in_row: int = 3
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample more prompts to refill
    max_sampling_rounds: int = 10  # rounds of prompts_per_step prompts per step (verl DAPO's max_num_gen_batches)
    sampler: str = "native"  # "native": harness/policy/sampler.py's decode loop; "hf": transformers' generate
    decoder: str = "auto"  # the native sampler's step (harness/policy/decode.py): auto|shared_prefix|per_row|cache
    compile_sampler: bool = False  # torch.compile the per-row (or cache) decoder's step: a compile per rollout shape
    padding_free: bool = True  # the trainer's forward skips completion padding (harness/policy/packed.py; Llama family)
    eval_every: int = 5  # 0 = only at the start and the end
    eval_max_new_tokens: int = 0  # 0 = max_new_tokens
    pass_k: int = 0  # also estimate pass@k at eval (k samples per eval problem); 0 = off
    save_every: int = 1  # a checkpoint every N steps: a kill loses at most the unfinished steps since
    export_every: int = 0  # also save_pretrained the policy to <run_dir>/exports/step_<N>/ every N steps; 0 = off


@dataclass
class SweepConfig:
    grid: dict[str, list[Any]] = field(default_factory=dict)
    per_objective: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class LabConfig:
    """The gradient lab (harness/apps/lab.py): every objective's gradient on the same rollout batches."""

    objectives: list[str] = field(default_factory=list)  # objective names; empty = every registered objective
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # per objective: hyperparameters to set
    batches: int = 8  # independent rollout batches (prompts_per_step x group_size each): CIs and SNR across them
    staleness: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8])  # optimizer steps away from behaviour
    mover: str = "grpo"  # the objective whose optimizer steps move the policy (the same moves for every objective)
    mismatch: list[str] = field(default_factory=lambda: ["bfloat16", "temperature"])  # behaviour samplers besides fp32
    mismatch_temperature: float = 1.3  # the "temperature" sampler's temperature (the trainer keeps train.temperature)
    reference_samples: int = 64  # completions per prompt of the on-policy reference gradient
    sketch_dim: int = 65536  # gradients compared through a count sketch this size (exact if the model is smaller)
    policy: str | None = None  # a saved policy folder (a run final/ or exports/step_N/); None: the starting policy


@dataclass
class LoggingConfig:
    """Where every metrics row goes besides metrics.jsonl (harness/run/tracking.py); not part of the run id."""

    backends: list[str] = field(default_factory=lambda: ["jsonl"])  # jsonl (always), tensorboard, wandb, trackio
    project: str = "rlvr-harness"  # wandb / trackio project; runs are named by run id, grouped by experiment name


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 0
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    threads: int = 0  # torch CPU threads; 0 = the cores free when the run starts (kept on resume: run/threads.py)
    backend: str = "native"
    results_dir: str = "results"
    profile: str | None = None  # apply profiles[profile] (e.g. the papers' GPU-scale settings) with one override
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    lab: LabConfig = field(default_factory=LabConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def _merge(*configs) -> DictConfig:
    try:
        return OmegaConf.merge(OmegaConf.structured(RunConfig), *configs)
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e)) from None


def _explain(e: OmegaConfBaseException) -> str:
    msg = str(e).split("\n")[0]
    key = getattr(e, "full_key", None)
    if "not in struct" in msg or "Key '" in msg and "not" in msg:
        parent = key.rsplit(".", 1)[0] if key and "." in key else ""
        node = RunConfig()
        for part in filter(None, parent.split(".")):
            node = getattr(node, part, None)
        valid = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
        leaf = key.rsplit(".", 1)[-1]
        if parent == "objective" and leaf in _hyperparameter_names():
            hint = f" Hyperparameters go under objective.params: did you mean objective.params.{leaf}?"
        else:
            close = difflib.get_close_matches(leaf, valid, n=1, cutoff=0.6)
            hint = f" Did you mean {'.'.join(filter(None, [parent, close[0]]))!r}?" if close else ""
        return f"unknown config key {key!r}.{hint}" + (f" Valid keys here: {', '.join(valid)}." if valid else "")
    return f"invalid config value at {key!r}: {msg}" if key else f"invalid config: {msg}"


def _hyperparameter_names() -> set[str]:
    from objectives import OBJECTIVES

    return {k for name in OBJECTIVES.names() for k in OBJECTIVES.get(name).hyperparameters()}


def experiment_path(name: str) -> Path:
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    path = EXPERIMENTS_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml") if p.stem != "base")
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"no experiment {name!r} (looked for {path}).{hint} Experiments: {', '.join(known)}.")
    return path


def experiment_layer(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    """An experiment file's settings; ``inherit: <experiment>`` puts that experiment's settings underneath (its
    own ``inherit`` too), so experiments sharing a starting policy and a budget say so once."""
    try:
        top = yaml.safe_load(path.read_text())
        layer = OmegaConf.load(path) if isinstance(top, dict) else OmegaConf.create()
    except Exception as e:  # yaml's ParserError / ScannerError: keep its first line and position
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"{path}: not valid YAML{line} ({getattr(e, 'problem', None) or type(e).__name__})") \
            from None
    if top is not None and not isinstance(top, dict):  # empty (or only comments, as base.yaml): the defaults
        kind = "a list" if isinstance(top, list) else f"the {type(top).__name__} {str(top)[:40]!r}"
        raise ConfigError(f"{path}: the top level must be a mapping of settings (e.g. `train:` then `  steps: 20`), "
                          f"not {kind}")
    parent = layer.pop("inherit", None) if isinstance(layer, DictConfig) else None
    if parent is None:
        return layer
    parent_path = experiment_path(str(parent))
    if parent_path in seen or parent_path == path:
        raise ConfigError(f"{path}: inherit: {parent} makes a cycle")
    return OmegaConf.merge(experiment_layer(parent_path, (*seen, path)), layer)


def load_experiment(name: str, overrides: list[str] | None = None) -> DictConfig:
    """The schema's defaults < experiments/<name>.yaml (or a path) < overrides; validated against the schema."""
    path = experiment_path(name)
    layers = [experiment_layer(path)]
    overrides = translate_overrides(list(overrides or []), layers[0])  # TRL names (num_generations=8, ...) -> ours
    grid_overrides = {o.partition("=")[0][len(GRID) :]: o.partition("=")[2] for o in overrides if o.startswith(GRID)}
    overrides = [o for o in overrides if not o.startswith(GRID)]
    try:
        layers.append(OmegaConf.from_dotlist(overrides))
        # sweep.grid.<dotted key>=[values]: the grid's keys are dotted paths themselves, not nested keys
        layers.append({"sweep": {"grid": {k: yaml.safe_load(v) for k, v in grid_overrides.items()}}})
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ConfigError(f"bad override in {overrides}: {e}. Use key=value, e.g. train.steps=20") from None
    cfg = _merge(*layers)
    if cfg.profile is not None:
        if cfg.profile not in cfg.profiles:
            raise ConfigError(f"profile {cfg.profile!r} is not defined in {path.name}; "
                              f"profiles: {', '.join(cfg.profiles) or 'none'}")
        profile = OmegaConf.from_dotlist([f"{k}={_dot(v)}" for k, v in cfg.profiles[cfg.profile].items()])
        cfg = _merge(cfg, profile, *layers[1:])  # command-line overrides still win
    keys = {o.partition("=")[0]: o.partition("=")[2] for o in overrides}
    file_task = OmegaConf.select(layers[0], "task.name", default=None)  # the experiment's own task
    if "task.name" in keys and keys["task.name"] != (file_task or TaskConfig.name):
        # another task: the experiment's task arguments were for its own task; only the command line's apply
        cfg.task.args = OmegaConf.select(layers[1], "task.args", default=None) or {}
    elif keys.get("task.args", "").replace(" ", "") == "{}":
        cfg.task.args = {}
    for override in overrides:  # a command-line value of a swept key pins that axis of the grid
        key, _, _ = override.partition("=")
        if key in cfg.sweep.grid:
            cfg.sweep.grid[key] = [OmegaConf.select(cfg, key)]
    if cfg.name == "run":
        cfg.name = path.stem
    return cfg


def run_configs(cfg: DictConfig) -> list[DictConfig]:
    """Expand the sweep into validated run configs (the sweep section removed). No grid = one run."""
    grid = OmegaConf.to_container(cfg.sweep.grid)
    per_objective = OmegaConf.to_container(cfg.sweep.per_objective)
    for key, values in grid.items():
        if not isinstance(values, list):
            raise ConfigError(f"sweep.grid.{key} must be a list of values, got {values!r}")
    base = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in ("sweep", "profiles", "lab")])
    base.profile = None  # its values are applied; a run's config.yaml is complete without it
    runs = []
    for point in itertools.product(*grid.values()):
        assignment = dict(zip(grid, point, strict=True))
        objective = assignment.get("objective.name", base.objective.name)
        dotlist = {**per_objective.get(objective, {}), **assignment}
        run = _merge(base, OmegaConf.from_dotlist([f"{k}={_dot(v)}" for k, v in dotlist.items()]))
        run = OmegaConf.masked_copy(run, [k for k in run if k not in ("sweep", "profiles", "lab")])
        validate(run)
        runs.append(run)
    from objectives import OBJECTIVES

    for name in per_objective:
        if name not in OBJECTIVES:
            raise ConfigError(f"sweep.per_objective: {OBJECTIVES.unknown_message(name)}")
    if not runs:
        raise ConfigError("the sweep expands to zero runs: some sweep.grid list is empty")
    return runs


def _dot(value) -> str:
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


def run_id(run: DictConfig) -> str:
    """Readable and stable: <objective>-s<seed>-<hash of the run's values that differ from the schema defaults>.
    Hashing only the differences keeps ids (and so resumability) when a new setting is added at its default."""
    def changed(values: dict, defaults: dict) -> dict:
        return {k: changed(v, defaults[k]) if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
                for k, v in values.items() if k not in defaults or v != defaults[k]}

    content = changed(OmegaConf.to_container(run, resolve=True),
                      OmegaConf.to_container(OmegaConf.structured(RunConfig), resolve=True))
    content.pop("results_dir", None)
    content.pop("logging", None)  # where metrics are tracked does not change the run
    digest = hashlib.sha1(json.dumps(content, sort_keys=True).encode()).hexdigest()[:8]
    return f"{run.objective.name}-s{run.seed}-{digest}"


def validate(run: DictConfig) -> None:
    """Semantic checks beyond types: names exist, sizes fit, hyperparameters are valid."""
    from harness.tasks import TASKS
    from objectives import ADVANTAGES, OBJECTIVES, get_objective

    try:
        get_objective(run.objective.name, **OmegaConf.to_container(run.objective.params))
        if run.objective.advantage is not None:
            ADVANTAGES.get(run.objective.advantage)
        TASKS.get(run.task.name)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    t, m = run.train, run.model
    for key in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "epochs", "num_minibatches",
                "max_sampling_rounds", "max_nonfinite_in_row"):
        if t[key] < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {t[key]}")
    for key in ("lr", "weight_decay", "warmup_steps", "eval_every", "eval_max_new_tokens", "pass_k", "save_every",
                "export_every"):
        if t[key] < 0:
            raise ConfigError(f"train.{key} must be >= 0, got {t[key]}")
    if t.max_grad_norm <= 0:
        raise ConfigError(f"train.max_grad_norm must be > 0, got {t.max_grad_norm}")
    if t.group_size == 1:
        _check_single_sample_groups(run.objective.advantage or OBJECTIVES.get(run.objective.name).default_advantage)
    if not 0 <= run.task.overlong_buffer <= t.max_new_tokens or run.task.overlong_penalty < 0:
        raise ConfigError(f"task.overlong_buffer must be in [0, train.max_new_tokens={t.max_new_tokens}] and "
                          f"task.overlong_penalty >= 0, got {run.task.overlong_buffer} and {run.task.overlong_penalty}")
    if t.dynamic_sampling and t.group_size < 2:
        raise ConfigError("train.dynamic_sampling keeps groups with unequal rewards: it needs train.group_size >= 2")
    batch = t.prompts_per_step * t.group_size
    if batch % t.num_minibatches:
        raise ConfigError(f"train.num_minibatches={t.num_minibatches} must divide "
                          f"prompts_per_step x group_size = {batch}")
    if t.micro_batch_size < 0 or (t.micro_batch_size and (batch // t.num_minibatches) % t.micro_batch_size):
        raise ConfigError(f"train.micro_batch_size={t.micro_batch_size} must divide the minibatch "
                          f"({batch // t.num_minibatches} sequences), or be 0")
    objective = OBJECTIVES.get(run.objective.name)
    if objective.needs_whole_groups and ((batch // t.num_minibatches) % t.group_size
                                         or (t.micro_batch_size and t.micro_batch_size % t.group_size)):
        raise ConfigError(f"objective {run.objective.name!r} compares the samples of a group: the minibatch "
                          f"({batch // t.num_minibatches}) and train.micro_batch_size must be multiples of "
                          f"train.group_size={t.group_size}")
    if objective.needs_whole_minibatch and t.micro_batch_size not in (0, batch // t.num_minibatches):
        raise ConfigError(f"objective {run.objective.name!r} needs statistics of the whole minibatch: use "
                          f"train.micro_batch_size=0 (micro-batching would make it inexact)")
    if t.old_logp not in ("sampler", "recompute"):
        raise ConfigError(f"train.old_logp must be 'sampler' or 'recompute', got {t.old_logp!r}")
    from objectives.rollout_correction import check_settings

    rc = t.rollout_correction
    problem = check_settings(rc.mode, rc.threshold, rc.threshold_lower)  # no sampler difference is fine: weights 1
    if problem:
        raise ConfigError(problem)
    if not 0 < t.top_p <= 1 or t.temperature <= 0:
        raise ConfigError(f"need 0 < train.top_p <= 1 and train.temperature > 0, got {t.top_p}, {t.temperature}")
    for key in ("dtype", "sampler_dtype"):
        if m[key] is not None and m[key] not in DTYPES:
            raise ConfigError(f"model.{key} must be one of {', '.join(DTYPES)}, got {m[key]!r}")
    if m.name not in EMBEDDED_MODELS and not os.path.isdir(m.name) and "/" not in m.name:
        raise ConfigError(f"model.name {m.name!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}), "
                          "a local directory, nor a hub id (owner/name)")
    for key, value in (("seed", run.seed), ("model.seed", m.seed)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
            raise ConfigError(f"{key} must be an integer in [0, 2**32) (numpy's and torch's seeds), got {value!r}")
    if run.threads < 0:
        raise ConfigError(f"threads must be >= 0 (0: the cores free when the run starts), got {run.threads}")
    if t.sampler not in SAMPLERS:
        raise ConfigError(f"train.sampler must be one of {', '.join(SAMPLERS)}, got {t.sampler!r}")
    if t.decoder not in DECODERS:
        raise ConfigError(f"train.decoder must be one of {', '.join(DECODERS)}, got {t.decoder!r}")
    if t.compile_sampler and (t.sampler != "native" or t.decoder == "shared_prefix"):
        raise ConfigError("train.compile_sampler compiles the native sampler's per-row or cache decoder: use it "
                          "with train.sampler=native and train.decoder=auto, per_row or cache")
    _check_warm_start(m)
    _check_device(run.device)
    _check_task_and_model(run)
    if "logging" in run:
        from harness.run.tracking import check_backends

        check_backends(list(run.logging.backends))
    if run.backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {run.backend!r}")
    reason = unsupported(run)
    if reason:
        raise ConfigError(reason)


def _check_single_sample_groups(estimator: str) -> None:
    """With one sample per group, a group-centred estimator gives every advantage 0: the run would learn nothing."""
    from objectives import ADVANTAGES

    rewards, groups = torch.tensor([0.0, 1.0, 3.0]), torch.arange(3)
    working = [name for name in ADVANTAGES.names() if ADVANTAGES.get(name)(rewards, groups).abs().sum() > 0]
    if estimator not in working:
        raise ConfigError(f"train.group_size=1 with advantage estimator {estimator!r} makes every advantage 0 (it "
                          f"centres rewards within a group): use train.group_size >= 2"
                          + (f", or objective.advantage one of {', '.join(working)}" if working else ""))


def _check_warm_start(m: DictConfig) -> None:
    if m.warm_start_steps < 0 or m.warm_start_check_every < 1:
        raise ConfigError(f"need model.warm_start_steps >= 0 and model.warm_start_check_every >= 1, got "
                          f"{m.warm_start_steps} and {m.warm_start_check_every}")
    target = m.warm_start_target
    if target is not None and (len(target) != 2 or not 0 <= target[0] <= target[1] <= 1):
        raise ConfigError(f"model.warm_start_target must be [low, high] with 0 <= low <= high <= 1, got "
                          f"{list(target)}")
    if target is not None and not m.warm_start_steps:
        raise ConfigError(f"model.warm_start_target={list(target)} needs model.warm_start_steps > 0 (the step cap); "
                          "for no warm start set both: model.warm_start_steps=0 model.warm_start_target=null")


def _check_device(device: str) -> None:
    """auto, cpu, or a CUDA (or Apple MPS) device this torch can use here."""
    if device == "auto":
        return
    try:
        where = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        hint = ("this torch is a CPU-only build: install a CUDA one with `make setup TORCH=torch`"
                if torch.version.cuda is None else "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)")
        raise ConfigError(f"device={device}, but {hint}; or use device=cpu / device=auto")
    if where.type == "cuda" and where.index is not None and where.index >= torch.cuda.device_count():
        raise ConfigError(f"device={device}, but this machine has {torch.cuda.device_count()} CUDA device(s) "
                          f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}); or use device=auto")
    if where.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={device}, but torch has no MPS (Apple GPU) device here; use device=cpu or "
                          "device=auto")
    if where.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device={device}: the harness runs on cpu, cuda or mps; use device=auto, cpu or cuda:N")


def check_this_machine(runs: list[DictConfig]) -> None:
    """What :func:`validate` leaves to the moment runs start on this machine, so that configs still expand
    anywhere: each hub model is in the local cache or on a reachable hub (at most HUB_TIMEOUT_S each, instead of
    the half minute of retries loading it would take). Called by ``train`` and ``sweep`` before any folder exists."""
    for name in dict.fromkeys(run.model.name for run in runs):
        if name not in EMBEDDED_MODELS and not os.path.isdir(name):
            problem = _hub_model_problem(name)
            if problem:
                raise ConfigError(problem)


HUB_TIMEOUT_S = 5  # how long the check of a hub model id waits for the hub


@functools.lru_cache(maxsize=16)
def _hub_model_problem(name: str) -> str | None:
    """Why the hub model ``name`` cannot be loaded, found out now in at most HUB_TIMEOUT_S (loading it would retry
    for half a minute): not in the local Hugging Face cache and the hub unreachable or offline, or no such
    model. None when it is cached, or the hub has it."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    fix = "give a local model folder, an embedded model (smollm2-135m-instruct, tiny), or a cached hub id"
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
    except HFValidationError:
        return f"model.name {name!r} is neither a local folder (there is none at that path) nor a hub id; {fix}"
    if constants.HF_HUB_OFFLINE:
        return f"model.name {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: {fix}"
    try:
        model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return None  # it exists; loading says what access it needs
    except RepositoryNotFoundError:
        return (f"model.name {name!r}: no such model on the Hugging Face hub (or a private one: `hf auth login`); "
                f"{fix}")
    except HfHubHTTPError:
        return None  # the hub answered: loading will say more
    except Exception as e:  # noqa: BLE001 - no network (httpx's ConnectError, a timeout, ...)
        return (f"model.name {name!r} is not in the local Hugging Face cache and the hub cannot be reached "
                f"({type(e).__name__}); {fix}")
    return None


@functools.lru_cache(maxsize=64)
def _task_error(name: str, arguments: str, gsm8k_dir: str | None = None) -> str | None:
    """The task's error for these arguments (``gsm8k_dir``: $GSM8K_DIR, which the gsm8k task reads: a cache key)."""
    from harness.tasks import get_task

    try:
        get_task(name, **json.loads(arguments))
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _check_task_and_model(run: DictConfig) -> None:
    """Build the task's problem spec and the tiny model's shape now, so that bad ``task.args`` or ``model.tiny``
    stop before any run starts (the task's data is not loaded here)."""
    from harness.policy.models import TinyModelSpec

    arguments = {"eval_size": run.task.eval_size, **OmegaConf.to_container(run.task.args)}
    if run.task.data_dir:
        arguments["data_dir"] = run.task.data_dir
    error = _task_error(run.task.name, json.dumps(arguments, sort_keys=True), os.environ.get("GSM8K_DIR"))
    if error:  # the task's own message, prefixed with its name unless it starts with it
        named = error.startswith((f"task {run.task.name!r}", f"{run.task.name}:", f"{run.task.name} "))
        raise ConfigError(error if named else f"task {run.task.name!r}: {error}")
    if run.model.name != "tiny":
        if run.model.tiny:
            raise ConfigError(f"model.tiny only applies to model.name=tiny, not {run.model.name!r}; remove it")
        return
    valid = [f.name for f in dataclasses.fields(TinyModelSpec)]
    unknown = sorted(set(run.model.tiny) - set(valid))
    if unknown:
        raise ConfigError(f"model.tiny has no field {', '.join(unknown)}; its fields: {', '.join(valid)}")
    spec = TinyModelSpec(**run.model.tiny)
    if min(dataclasses.astuple(spec)) < 1 or spec.hidden_size % spec.num_heads:
        raise ConfigError(f"model.tiny: sizes must be >= 1 and hidden_size ({spec.hidden_size}) a multiple of "
                          f"num_heads ({spec.num_heads})")
