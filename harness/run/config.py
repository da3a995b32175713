"""The typed run configuration (the schema: every key, its one default and its meaning), experiment files,
overrides, sweep expansion and the schema's own checks.

An experiment is the schema below merged with ``experiments/<name>.yaml``, then with command-line overrides
(``key=value``, omegaconf dotlist; TRL's names are translated first, harness/run/aliases.py). Its ``sweep`` section
expands into runs: every point of ``sweep.grid`` (dotted key -> list of values), with
``sweep.per_objective[<name>]`` applied to the runs of that objective before the grid point; a per-objective value of
a swept key pins that axis for that objective's runs (moe_stability: grpo with every routing replay, the others with
none). A command-line override of a swept key pins that axis to the given value (``seed=3`` runs seed 3 only).

Everything is validated before any run starts: here what the schema alone decides (sizes, batching, the objective
and its hyperparameters, the rollout correction, seeds); then each component's own check of its settings (the task's
arguments, the model's name and shape, the device, the sampler's decoders, the trackers, the backends), registered in
harness/run/checks.py, so that this module imports nothing above it. Errors name the key and the fix.

Each field's comment is its meaning: ``python -m harness explain KEY`` and docs/trl.md show it (harness/run/names.py).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import hashlib
import io
import itertools
import json
import math
import pickle
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.run.aliases import ALIASES, translate_overrides
from harness.run.checks import run_checks
from harness.run.errors import ConfigError
from harness.run.experiments import experiment_path
from harness.run.offpolicy import recompute_forced
from objectives import ADVANTAGES, OBJECTIVES, estimator_name, get_objective
from objectives.advantages import (
    needs_greedy_baseline,
    needs_nonnegative_rewards,
    needs_reward_components,
    needs_sum_pi_squared,
    reference_samples,
)
from objectives.base import SEED_BOUND, alias_of
from objectives.rollout_correction import (
    CORRECTION_MODES,
    DEFAULT_THRESHOLD,
    canonical_rejection,
    check_rejection,
    check_settings,
    lower_threshold,
)

GRID = "sweep.grid."  # prefix of a command-line grid override
PER_OBJECTIVE = "sweep.per_objective."  # prefix of a command-line per-objective setting
NOT_RUN_SECTIONS = ("sweep", "profiles", "lab", "launcher")  # an experiment's, not in a run's config.yaml
# settings that do not change a run (nor its id, nor a resume's check): where results go (results_dir; name, the
# experiment's folder and the trackers' group) and where metrics are also sent; equal runs of two experiments share id
NOT_IN_RUN_ID = ("results_dir", "name", "logging")
# settings that bound a run's memory and change no number it computes beyond float32 round-off (docs/benchmark.md):
# not part of its id, and a run that ran out of memory may be resumed with them changed (records.check_resume)
MEMORY_SETTINGS = ("train.lm_head_chunk", "train.activation_checkpointing", "train.eval_batch_size")
OLD_LOGP = ("sampler", "recompute")


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the Llama family's


@dataclass
class LoraSettings:
    """model.lora: low-rank adapters (LoRA, the peft library) trained on a frozen base (harness/policy/lora.py); the
    base with the adapters disabled is the KL reference. Both backends (TRL: its peft_config)."""

    rank: int = 0  # the adapters' rank r; 0 = no adapters (full fine-tuning)
    alpha: float | None = None  # the adapters' scale is alpha / rank; null = 2 x rank (scale 2)
    dropout: float = 0.0  # dropout on the adapters' input while training (the update's forwards); 0 = none
    # the linear layers that get adapters (module names; default: every attention and MLP projection of the Llama
    # family)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    export_merged: bool = False  # also write the base with the adapters merged in to final/merged/ (transformers')


TINY_MOE = "tiny_moe"  # model.name of the char-level Qwen3-MoE (harness/policy/tiny_moe.py)
TINY_MODELS = ("tiny", TINY_MOE)  # built at random from model.seed (model.tiny: their shape), not loaded
# the settings that decide whether model.seed draws anything (draws_from_model_seed), with the schema's defaults
MODEL_SEED_DRAWN_BY = {"model.name": "tiny", "model.warm_start_steps": 0, "model.lora.rank": 0}


@dataclass
class ModelConfig:
    # tiny (the char-level Llama), tiny_moe (a char-level Qwen3-MoE), smollm2-135m-instruct (embedded), a hub id or a
    # folder
    name: str = "tiny"
    # the tiny model's shape: tiny's (hidden_size, num_layers, ...) or tiny_moe's (+ num_experts, top_k, ...)
    tiny: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"  # trainer precision: float32, bfloat16, float16 (weights and compute)
    sampler_dtype: str | None = None  # sample with a copy in this precision (train-inference mismatch); null = policy
    # the starting policy: the tiny model's init, the warm start's batch order (its cache key) and LoRA's initial A;
    # several values (sweep.grid.model.seed) are starting-policy replicates, the level above the seeds
    # (analysis/cells.py); a pretrained model without a warm start or adapters has one (model.seed changes nothing)
    seed: int = 0
    warm_start_steps: int = 0  # supervised steps on the task's solutions before RL (cached); with a target: the cap
    # [low, high]: stop at the first check whose held-out greedy accuracy is in the band (an error if the cap is hit
    # outside it)
    warm_start_target: list[float] | None = None
    warm_start_check_every: int = 50  # warm-start steps between the target's accuracy checks
    warm_start_lr: float = 1e-3  # warm-start learning rate (AdamW, constant)
    warm_start_batch_size: int = 32  # warm-start problems per step
    lora: LoraSettings = field(default_factory=LoraSettings)  # low-rank adapters on a frozen base (off by default)


@dataclass
class TaskConfig:
    name: str = "arith"  # arith, gsm8k, reasoning_gym (`make list`)
    data_dir: str | None = None  # local GSM8K folder (train.jsonl, test.jsonl); else $GSM8K_DIR, else the hub
    eval_size: int = 128  # held-out problems of each evaluation (greedy)
    # which held-out set of eval_size problems: 0 the task's own; k >= 1 the k-th after it, disjoint from it, from the
    # other sets and from the train problems, which it leaves as they are (arith, gsm8k; the zoo's confirmation: the
    # screen's + 1, problems its selection never saw)
    eval_set: int = 0
    format_weight: float = 0.0  # reward = correct + format_weight x format (+ the overlong penalty)
    overlong_buffer: int = 0  # DAPO's soft overlong penalty over the last N tokens before max_new_tokens; 0 = off
    overlong_penalty: float = 1.0  # the overlong penalty reached at max_new_tokens
    # the task's own arguments (arith: digits, operators; reasoning_gym: dataset, params)
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ObjectiveConfig:
    name: str = "grpo"  # the loss (`make list`)
    # the objective's hyperparameters; omitted ones take the paper's defaults (all of them: `make list`)
    params: dict[str, Any] = field(default_factory=dict)
    advantage: str | None = None  # advantage estimator; null = the objective's default


@dataclass
class RolloutCorrectionConfig:
    """train.rollout_correction: weight every token's loss by the importance ratio between the trainer's old policy
    and the sampler (verl's rollout correction, TRL's vllm_importance_sampling_*); objectives/rollout_correction.py.
    A mode other than none, or a rejection rule, makes the loop recompute the trainer's old log-probs (train.old_logp
    is then ignored)."""

    # importance weights between the trainer's old (proximal) policy and the sampler: none, token_truncate,
    # token_mask, sequence_truncate, sequence_mask, decoupled_ppo (AReaL's: masked above threshold, per token or, for
    # a sequence-ratio objective, the sequence's geometric mean)
    mode: str = "none"
    threshold: float = DEFAULT_THRESHOLD  # the weights' upper bound C (truncate at C / mask above C); >= 1
    # mask weights below it (null: 1/C, two-sided as verl; 0: one-sided as TRL); truncate modes: a lower clamp (null:
    # none, as verl and TRL; 0 is then the same run)
    threshold_lower: float | None = None
    # trust-region masking (verl's rollout_rs, arXiv 2512.23075): divergence rules between the trainer's old policy and
    # the sampler that drop a token or a whole sequence past their bound: token_k2, token_k3, seq_sum_k2, seq_sum_k3,
    # seq_mean_k2, seq_mean_k3, seq_max_k2, seq_max_k3 (the paper's: [seq_mean_k3, seq_max_k2]); empty = off
    rejection: list[str] = field(default_factory=list)
    rejection_threshold: list[float] = field(default_factory=list)  # the rules' bounds: one for all, or one per rule


@dataclass
class TrainConfig:
    steps: int = 20  # rollout steps
    prompts_per_step: int = 8  # prompts per rollout step
    group_size: int = 8  # completions per prompt (the group)
    max_new_tokens: int = 16  # longest completion (tokens)
    temperature: float = 1.0  # sampling temperature (also divides the trainer's logits)
    top_p: float = 1.0  # nucleus sampling
    epochs: int = 1  # passes (μ) over each rollout batch
    num_minibatches: int = 4  # optimizer steps per pass
    micro_batch_size: int = 0  # sequences per forward/backward (per GPU); 0 = the whole minibatch
    lr: float = 1e-4  # AdamW learning rate
    warmup_steps: int = 0  # linear warm-up (optimizer steps)
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping (global norm)
    old_logp: str = "sampler"  # behaviour log-probs: sampler (the sampler's) or recompute (the trainer's, recomputed)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # policy lag k (asynchronous RL, docs/async.md): the batch trained at step t was sampled by the policy after step
    # t-1-k (the starting policy's for t <= k+1); 0 = synchronous, sampled by the policy it trains; below train.steps
    rollout_lag: int = 0
    # fixed (every group of a batch has lag rollout_lag) or mixed (each group's lag drawn uniformly in [0,
    # rollout_lag], the ages a bounded-staleness buffer delivers)
    lag_mode: str = "fixed"
    # in-flight weight updates (PipelineRL): a lagged batch's completions switch to the newer policy every this many
    # tokens, so one completion's tokens come from several versions; 0 = off
    in_flight_tokens: int = 0
    max_nonfinite_in_row: int = 3  # stop after this many non-finite updates in a row
    dynamic_sampling: bool = False  # DAPO: drop groups with equal rewards, sample more prompts to refill
    max_sampling_rounds: int = 10  # dynamic sampling's rounds of prompts per step (verl's max_num_gen_batches)
    sampler: str = "native"  # native (our decode loop) or hf (transformers' generate, the reference)
    # the native sampler's decode step: auto, shared_prefix (Llama-family: a group's prompt keys/values stored once),
    # per_row (Llama-family: one key/value slab per row, the step that compiles) or cache (the model's forward, per-row
    # KV cache)
    decoder: str = "auto"
    # torch.compile the native sampler's decode step (the per-row decoder's; other models: the cache decoder's forward)
    compile_sampler: bool = False
    # the trainer's forward runs its token-wise layers on real completion tokens only (Llama-family models; others: the
    # model's forward on the padded batch)
    padding_free: bool = True
    # the x86 CPU kernel of a run's float32 linear layers, forward and backward, from 16 rows
    # (harness/policy/matmul.py): onednn (oneDNN's), torch (torch's default, MKL) or auto: oneDNN's on AMD processors
    # with AVX512 (where MKL's GEMM takes a narrower code path), torch's elsewhere. The two agree to float round-off,
    # not bit for bit; the warm start always runs auto's
    cpu_matmul: str = "auto"
    # Mixture-of-Experts routing replay (harness/policy/routing.py): none; r2 (the experts each token's router chose in
    # the trainer's old-policy forward of the batch, forced in every update forward); r3 (the sampler's own routing,
    # forced in the old-policy recompute and every update forward). r2/r3 recompute the behaviour log-probs; MoE
    # models only, native backend
    routing_replay: str = "none"
    # positions per chunk of the trainer's LM head (logits, log-softmax, entropy), so that no [positions, vocab] tensor
    # larger than a chunk's exists; with gradients each chunk is recomputed in the backward pass (the same gradient);
    # 0 = all positions at once (native backend). A memory setting: not in the run id, may change on resume
    lm_head_chunk: int = 0
    # recompute each layer's activations in the backward pass instead of keeping them (transformers' activation
    # checkpointing; on the TRL backend TRL's gradient_checkpointing): less memory for one more forward of the layers;
    # an MoE layer's recompute forces its forward's experts. A memory setting: not in the run id, may change on resume
    activation_checkpointing: bool = False
    # micro-batches of consecutive rows up to this many real prompt + completion tokens (whole groups for objectives
    # that compare a group's samples; a larger row or group alone) instead of train.micro_batch_size rows; 0 = off
    # (native backend)
    max_tokens_per_micro_batch: int = 0
    eval_every: int = 5  # held-out evaluation every N steps; 0 = start and end only
    eval_max_new_tokens: int = 0  # evaluation's longest completion; 0 = max_new_tokens
    # problems per greedy generate call at evaluation (pass@k: this many completions per call): the evaluation's
    # keys/values and logits grow with it; lower it to bound the evaluation's memory, at more, smaller calls. Without
    # pass_k a memory setting: not in the run id, may change on resume
    eval_batch_size: int = 64
    pass_k: int = 0  # also pass@k at evaluation (k samples per problem); 0 = off
    save_every: int = 1  # a checkpoint every N steps (resume): a kill loses at most the unfinished steps since
    # keep both last checkpoints, the optimizer's state included, once the run has ended; default: only the newest,
    # without the optimizer's state (no update follows; AdamW's moments are two copies of the weights per checkpoint)
    keep_checkpoints: bool = False
    export_every: int = 0  # save_pretrained the policy to exports/step_N/ every N steps; 0 = final/ only


@dataclass
class SweepConfig:
    grid: dict[str, list[Any]] = field(default_factory=dict)  # dotted key -> list of values: every combination is a run
    # objective -> settings for its runs (a swept key's value pins that axis for them)
    per_objective: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the objective the report's verdict compares the others to; null = grpo when it has runs, else the grid's first
    baseline: str | None = None


@dataclass
class LabConfig:
    """The gradient lab (harness/apps/lab.py): every objective's gradient on the same rollout batches."""

    objectives: list[str] = field(default_factory=list)  # the objectives compared; empty = every registered one
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # per objective, hyperparameters to set
    batches: int = 8  # independent rollout batches (prompts_per_step x group_size each): CIs and SNR across them
    staleness: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8])  # optimizer steps away from the behaviour
    mover: str = "grpo"  # the objective whose optimizer steps move the policy (the same moves for every objective)
    mismatch: list[str] = field(default_factory=lambda: ["bfloat16", "temperature"])  # behaviour samplers besides fp32
    mismatch_temperature: float = 1.3  # the temperature sampler's temperature (the trainer keeps train.temperature)
    # MoE policies: routing-replay points (r2: theta_0's teacher-forced routing; r3: the sampler's) at the largest
    # staleness: the same moved policy with the behaviour routing forced, beside the staleness point without
    routing: list[str] = field(default_factory=list)
    reference_samples: int = 64  # completions per prompt of the on-policy reference gradient
    sketch_dim: int = 65536  # size of the gradients' count sketch (exact if the model is smaller; 0: always exact)
    policy: str | None = None  # a saved policy folder (final/, exports/step_N/); null = the starting policy


@dataclass
class LoggingConfig:
    """Where every metrics row goes besides metrics.jsonl (harness/run/tracking.py); not part of the run id."""

    backends: list[str] = field(default_factory=lambda: ["jsonl"])  # jsonl (always), tensorboard, wandb, trackio
    project: str = "rlvr-harness"  # wandb / trackio project; runs are named by run id, grouped by experiment name


@dataclass
class LauncherConfig:
    """Where a sweep's runs execute (`sweep --launcher local|ray|slurm`, harness/apps/launchers.py); not part of a run
    (nor of its run id): the same runs, wherever they go."""

    # local: runs one worker process trains one after another, sharing its start-up (0: no limit; 1: a process per run)
    runs_per_process: int = 0
    cpus_per_run: int = 1  # CPU cores per run: the Ray task's num_cpus, SLURM's cpus_per_task, the run's torch threads
    gpus_per_run: int = 0  # GPUs per run: the Ray task's num_gpus, SLURM's gpus_per_node
    address: str | None = None  # ray: the cluster (host:port, ray://host:10001, auto); null = a local Ray cluster
    cluster: str = "slurm"  # slurm: submit with sbatch; local: submitit's local executor on this machine (a dry run)
    partition: str | None = None  # slurm: the partition (null: the cluster's default)
    time_min: int = 240  # slurm: each run's time limit in minutes (a run stopped by it resumes on the next sweep)
    mem_gb: int | None = None  # slurm: memory per run in GB (null: the partition's default)
    # slurm: other sbatch options, named as submitit's slurm_<name> without the prefix (account, qos, constraint, ...)
    slurm_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    name: str = "run"  # experiment name: results/<name>/, the trackers' group (the experiment file's by default)
    seed: int = 0  # the run's seed (prompts, sampling, minibatch order)
    device: str = "auto"  # auto (cuda if available), cpu, cuda, cuda:N
    threads: int = 0  # torch CPU threads; 0 = the cores free when the run starts (its resumes keep that count)
    backend: str = "native"  # native (harness/loop/native.py) or trl (TRL's GRPOTrainer with our loss)
    results_dir: str = "results"  # root of results/<name>/<run_id>/
    profile: str | None = None  # apply profiles[profile] of the experiment (e.g. the papers' GPU-scale settings)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)  # named sets of overrides (gpu scale, ...)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    lab: LabConfig = field(default_factory=LabConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


def rollout_size(t: DictConfig) -> int:
    """Sequences of one rollout step (``train.prompts_per_step x train.group_size``)."""
    return t.prompts_per_step * t.group_size


def minibatch_size(t: DictConfig) -> int:
    """Sequences of one optimizer step (the rollout split into ``train.num_minibatches``)."""
    return rollout_size(t) // t.num_minibatches


def microbatch_size(t: DictConfig) -> int:
    """Sequences of one forward/backward (``train.micro_batch_size``, 0 = the whole minibatch)."""
    return t.micro_batch_size or minibatch_size(t)


def updates_per_step(t: DictConfig) -> int:
    """Optimizer steps per rollout step (``train.num_minibatches x train.epochs``)."""
    return t.num_minibatches * t.epochs


@functools.cache
def schema() -> DictConfig:
    """The schema with its defaults, built once (OmegaConf.structured is the slow part of expanding a sweep).
    Read only: merge copies it."""
    return OmegaConf.structured(RunConfig)


@functools.cache
def schema_defaults() -> dict:
    """The schema's defaults as plain values, for :func:`run_id` (read only)."""
    return OmegaConf.to_container(schema(), resolve=True)


@functools.cache
def _pickled_schema() -> bytes:
    return pickle.dumps(schema())


def _merge(*configs, onto: DictConfig | None = None) -> DictConfig:
    """``configs`` merged in order onto a copy of ``onto`` (a config already merged onto the schema), or of the
    schema: OmegaConf.merge, whose deep copy of the first config (every node) is most of a sweep's expansion, with the
    copy made by pickle (the same config, in a third of the time; nothing read from a file)."""
    try:
        target = pickle.loads(_pickled_schema() if onto is None else pickle.dumps(onto))
        target.merge_with(*configs)
        return target
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e)) from None
    except TypeError as e:  # a list where a section goes (sweep.grid=[], train=[]): omegaconf cannot merge them
        raise ConfigError(f"a list or value was given where a section of settings goes ({e}): give the section's keys, "
                          "e.g. sweep.grid.seed=[0,1] or train.lr=1e-4, not sweep.grid=[] or train=[]") from None


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
    merge = re.match(r"Merge error: (\w+) is not a subclass of (\w+)\. value: (.*)", msg)
    if merge and not key:  # `train: 3` in a file or `train=3` on the command line
        key = next(_sections_of_type(RunConfig(), merge[2]), merge[2])  # `train.rollout_correction=none` too
        return (f"{key} is a section of settings, not a value: got {key}={merge[3]}; give its keys (e.g. "
                f"{key}.<key>=..., or `{key}:` then indented `<key>: ...` in a file)")
    if key and "is not a ListConfig" in msg:  # a scalar where a list is wanted
        return f"{key} takes a list: give {key}=[a,b] (in a file: `[a, b]`)"
    if key and msg.startswith("Incompatible value 'None'"):  # `key=` (nothing after =) on the command line
        return f"{key} takes a value: give {key}=<value> (nothing after = means null, which it does not take)"
    return f"invalid config value at {key!r}: {msg}" if key else f"invalid config: {msg}"


def _bad_override(overrides: list[str], grid: dict[str, str], error: Exception) -> str:
    """One line naming the override that does not parse (each tried alone) and the parser's first line."""
    for override in [*overrides, *(f"{GRID}{k}={v}" for k, v in grid.items())]:
        try:
            if override.startswith(GRID):
                yaml.safe_load(override.partition("=")[2])
            else:
                OmegaConf.from_dotlist([override])
        except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
            error = e
            break
    else:  # each parses alone: two of them clash (train=[] then train.steps=6), named as a pair
        override = " ".join(overrides)
        for i in range(1, len(overrides) + 1):
            try:
                OmegaConf.from_dotlist(overrides[:i])
            except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
                key = overrides[i - 1].partition("=")[0]
                earlier = [o for o in overrides[: i - 1] if key.startswith(o.partition("=")[0] + ".")
                           or o.partition("=")[0].startswith(key + ".")]
                override, error = " with ".join([*earlier[-1:], overrides[i - 1]]), e
                break
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    shown = override if len(override) <= 200 else f"{override[:100]}...{override[-20:]}"  # one readable line
    return f"bad override {shown!r}: {reason}. Use key=value with a YAML value, e.g. train.steps=20"


def _hyperparameter_names() -> set[str]:
    return {k for name in OBJECTIVES.names() for k in OBJECTIVES.get(name).hyperparameters()}


def experiment_description(path: Path) -> str:
    """The comment block that opens an experiment file, its lines joined into one text (what `list` and the
    documentation site show)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return " ".join(line for line in lines if line)


def yaml_problem(error: Exception) -> str:
    """A file's YAML error in one line: its position and problem (the parser's message spans lines, quotes the file)."""
    where = getattr(error, "problem_mark", None)
    line = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
    return f"not valid YAML{line} ({getattr(error, 'problem', None) or type(error).__name__})"


def experiment_layer(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    """An experiment file's settings; ``inherit: <experiment>`` puts that experiment's settings underneath (its
    own ``inherit`` too), so experiments sharing a starting policy and a budget say so once."""
    try:
        top, layer = _parsed_layer(path.read_text(encoding="utf-8"))
    except Exception as e:  # yaml's ParserError / ScannerError: keep its first line and position
        raise ConfigError(f"{path}: {yaml_problem(e)}") from None
    if top is not None and not isinstance(top, dict):  # empty (or only comments, as base.yaml): the defaults
        kind = "a list" if isinstance(top, list) else f"the {type(top).__name__} {str(top)[:40]!r}"
        raise ConfigError(f"{path}: the top level must be a mapping of settings (e.g. `train:` then `  steps: 20`), "
                          f"not {kind}")
    layer = copy.deepcopy(layer)  # the cached one stays as read
    parent = layer.pop("inherit", None) if isinstance(layer, DictConfig) else None
    if parent is None:
        return layer
    if not isinstance(parent, str):  # a list or a mapping would be looked for as one experiment's name
        given = OmegaConf.to_container(parent) if isinstance(parent, DictConfig | ListConfig) else parent
        raise ConfigError(f"{path}: inherit takes one experiment (a name or a .yaml path), got {given!r}")
    parent_path = experiment_path(str(parent))
    if parent_path in seen or parent_path == path:
        raise ConfigError(f"{path}: inherit: {parent} makes a cycle")
    underneath = experiment_layer(parent_path, (*seen, path))
    clash = _section_clash(OmegaConf.to_container(underneath), OmegaConf.to_container(layer))
    if clash:  # omegaconf's merge would raise a TypeError ("Cannot merge incompatible container types")
        raise ConfigError(f"{path}: {clash} is a section of settings in {parent}, not a value or a list: give its "
                          "keys as a mapping (`<key>: ...` lines indented under it)")
    return OmegaConf.merge(underneath, layer)


def _section_clash(under: dict, over: dict, prefix: str = "") -> str | None:
    """The first key that is a section (a mapping) on one side and a value or a list on the other."""
    for key in over.keys() & under.keys():
        a, b = under[key], over[key]
        if isinstance(a, dict) != isinstance(b, dict) and None not in (a, b):
            return f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            found = _section_clash(a, b, f"{prefix}{key}.")
            if found:
                return found
    return None


@functools.lru_cache(maxsize=64)
def _parsed_layer(text: str) -> tuple[Any, DictConfig]:
    """An experiment file's text as YAML (its top level, to check) and as OmegaConf reads it; parsed once per text
    (a sweep of the zoo loads its regimes' files dozens of times). Read only."""
    top = yaml.safe_load(text)
    return top, OmegaConf.load(io.StringIO(text)) if isinstance(top, dict) else OmegaConf.create()


SWEEP_MAPPINGS = ("sweep.grid", "sweep.per_objective")  # an override of {} merges into them and changes nothing


def load_experiment(name: str, overrides: list[str] | None = None) -> DictConfig:
    """The schema's defaults < experiments/<name>.yaml (or a path) < overrides; validated against the schema."""
    path = experiment_path(name)
    layers = [experiment_layer(path)]
    overrides = translate_overrides(list(overrides or []), layers[0])  # TRL names (num_generations=8, ...) -> ours
    grid_overrides = {o.partition("=")[0][len(GRID) :]: o.partition("=")[2] for o in overrides if o.startswith(GRID)}
    pinned = [o for o in overrides if o.startswith(PER_OBJECTIVE) and "." in o.partition("=")[0][len(PER_OBJECTIVE) :]]
    overrides = [o for o in overrides if not o.startswith(GRID) and o not in pinned]
    empty = next((o for o in overrides if o.partition("=")[0].strip() in SWEEP_MAPPINGS
                  and o.partition("=")[2].strip() == "{}"), None)
    if empty:  # merged into the sweep's mapping, {} changes nothing (sweep.grid={} ran the whole grid)
        key = empty.partition("=")[0].strip()
        one = "; one run of a sweep: give each grid key one value" if key == "sweep.grid" else ""
        raise ConfigError(f"{empty}: an empty mapping merges into {key} and changes nothing; give its keys (e.g. "
                          f"{key}.<key>=...){one}")
    try:
        layers.append(OmegaConf.from_dotlist(overrides))
        # sweep.grid.<dotted key>=[values]: the grid's keys are dotted paths themselves, not nested keys
        layers.append({"sweep": {"grid": {k: yaml.safe_load(v) for k, v in grid_overrides.items()}}})
        # sweep.per_objective.<objective>.<dotted key>=value likewise (as nested keys, no grid value saw the pin)
        for override in pinned:
            name, _, key = override.partition("=")[0][len(PER_OBJECTIVE) :].partition(".")
            value = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={override.partition('=')[2]}"]))["value"]
            layers.append({"sweep": {"per_objective": {name: {key: value}}}})
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:  # ValueError: e.g. over 4300 digits
        raise ConfigError(_bad_override(overrides, grid_overrides, e)) from None
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
    _resolve(cfg)
    both = [key for key in keys if key in grid_overrides]  # one command line that sweeps a key and pins it
    if both:
        raise ConfigError(f"{both[0]} is given twice on the command line: {GRID}{both[0]}={grid_overrides[both[0]]} "
                          f"sweeps it and {both[0]}={keys[both[0]]} pins it; give one (make compare's OBJECTIVES and "
                          f"SEEDS are {GRID}objective.name and {GRID}seed)")
    for override in overrides:  # a command-line value of a swept key pins that axis of the grid
        key, _, _ = override.partition("=")
        if key in cfg.sweep.grid:
            cfg.sweep.grid[key] = [OmegaConf.select(cfg, key)]
    if cfg.name == "run":
        cfg.name = path.stem
    return cfg


def _resolve(cfg: DictConfig) -> None:
    """Replace every interpolation (``${oc.env:LR}``, ``${train.lr}``) by its value, typed by the schema, so that
    what a run records, compares on resume and names its folder by is the value itself; one that cannot be resolved
    is a ConfigError naming the key."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        key = getattr(e, "full_key", None) or "a setting"
        raise ConfigError(f"{key}: cannot resolve its interpolation ({reason}); give the value itself, or set what it "
                          "reads (e.g. the environment variable of ${oc.env:NAME})") from None


MANY_POINTS = 500  # a grid larger than this is said before its points are checked (seconds)


def run_configs(cfg: DictConfig) -> list[DictConfig]:
    """Expand the sweep into validated run configs (the sweep section removed). No grid = one run. Refused in one
    line: an objective of the grid that its per-objective settings leave without a run, and two grid points that
    make the same run (:func:`_distinct`)."""
    grid = OmegaConf.to_container(cfg.sweep.grid)
    per_objective = OmegaConf.to_container(cfg.sweep.per_objective)
    for name, own in per_objective.items():  # the runs are written where the sweep is: one objective's elsewhere
        outside = [key for key in own or {} if str(key).split(".")[0] in NOT_IN_RUN_ID]  # would be recorded, not used
        if outside:
            raise ConfigError(f"sweep.per_objective.{name}.{outside[0]}: where results go and where metrics are sent "
                              f"are the sweep's, not one objective's; set {outside[0]} for the whole sweep")
    for key, values in grid.items():
        if not isinstance(values, list):
            raise ConfigError(f"sweep.grid.{key} must be a list of values, got {values!r}")
    points = math.prod(len(values) for values in grid.values())
    if points > MANY_POINTS:  # each merged and checked before anything prints: said first
        print(f"checking the {points:,} points of the grid before any run starts (a few ms each)", file=sys.stderr)
    names = [v for v in grid.get("objective.name", []) if not isinstance(v, str)]
    if names:  # a list or mapping in the objectives' place: e.g. OBJECTIVES="[grpo]" (make compare)
        raise ConfigError(f"sweep.grid.objective.name holds {names[0]!r}, not an objective's name: give names, e.g. "
                          "[grpo,gspo] (make compare OBJECTIVES=grpo,gspo)")
    base = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in NOT_RUN_SECTIONS])
    base.profile = None  # its values are applied; a run's config.yaml is complete without it
    base = _merge(base)  # onto the schema once: each run merges only its grid point onto it
    runs, points, pins = [], [], {}  # pins: objective -> the (key, value) that pinned a grid point of it out
    refused: list[tuple[dict, ConfigError]] = []  # (grid point, why): all of them, or those it names
    for point in itertools.product(*grid.values()):
        assignment = dict(zip(grid, point, strict=True))
        objective = assignment.get("objective.name", base.objective.name)
        own = per_objective.get(objective, {})
        pinned = [(key, own[key]) for key, value in assignment.items()
                  if key in own and not _parsed_same(own[key], value)]
        if pinned:  # a per-objective value of a swept key pins that axis for the objective's runs
            pins.setdefault(objective, pinned[0])
            continue
        dotlist = {**own, **assignment}
        run = _run_part(_merge(OmegaConf.from_dotlist([f"{k}={_dot(v)}" for k, v in dotlist.items()]), onto=base))
        try:
            validate(run)
        except ConfigError as e:  # named by the grid's keys of several values
            refused.append(({k: v for k, v in assignment.items() if len(grid[k]) > 1}, e))
            continue
        runs.append(run)
        points.append((objective, assignment))
    raise_refused(refused, len(runs), "grid points")
    for name in per_objective:
        if name not in OBJECTIVES:
            raise ConfigError(f"sweep.per_objective: {OBJECTIVES.unknown_message(name)}")
    if cfg.sweep.baseline is not None and cfg.sweep.baseline not in OBJECTIVES:
        raise ConfigError(f"sweep.baseline: {OBJECTIVES.unknown_message(cfg.sweep.baseline)}")
    _check_pins(pins, {objective for objective, _ in points})
    if not runs:
        raise ConfigError("the sweep expands to zero runs: some sweep.grid list is empty")
    runs = _distinct(runs, [point for _, point in points], grid)
    _check_alias_twins(runs)
    return runs


def _run_part(merged: DictConfig) -> DictConfig:
    """``merged`` (a config just merged, not used after) less the experiment's sections (:data:`NOT_RUN_SECTIONS`):
    OmegaConf.masked_copy with its nodes moved into the copy rather than deep-copied (that copy was a third of a
    sweep's expansion)."""
    kept = DictConfig(content={key: merged._get_node(key) for key in merged if key not in NOT_RUN_SECTIONS},
                      flags={"no_deepcopy_set_nodes": True})
    kept._set_flag("no_deepcopy_set_nodes", None)
    return kept


def _check_pins(pins: dict[str, tuple[str, object]], ran: set[str]) -> None:
    """Refuse a sweep in which an objective's per-objective value of a swept key pins out every grid point of it
    (e.g. moe_stability's ``train.routing_replay: none`` for gspo, with ``train.routing_replay=r2`` on the command
    line): its runs would be dropped without a word."""
    lost = [objective for objective in pins if objective not in ran]
    if not lost:
        return
    by_pin: dict[str, list[str]] = {}
    for objective in lost:
        by_pin.setdefault(f"{pins[objective][0]}={_dot(pins[objective][1])}", []).append(objective)
    pinned = "; ".join(f"{pin} for {', '.join(objectives)}" for pin, objectives in by_pin.items())
    if not ran:
        raise ConfigError(f"the sweep expands to zero runs: sweep.per_objective pins {pinned}, and the grid or a "
                          "command-line override asks for another value")
    raise ConfigError(f"sweep.per_objective pins {pinned}, and the grid or a command-line override asks for another "
                      f"value: {', '.join(lost)} would have no run; run the others alone with "
                      f"sweep.grid.objective.name=[{','.join(sorted(ran))}], or include the pinned value")


def _distinct(runs: list[DictConfig], points: list[dict], grid: dict[str, list]) -> list[DictConfig]:
    """The runs of the grid, each once. Two grid points that make the same run (the same run id) are refused: a value
    listed twice (``seed=[0,0]``), two spellings of one value (``1e-4`` and ``0.0001``, equal once parsed into the
    run's config), values of a memory setting (not part of the run id: they change no number), of where results go
    (:data:`NOT_IN_RUN_ID`), of a setting that changes nothing in any of the grid's runs (:func:`unused_setting`),
    or an objective's own value and its default (``objective.advantage=[null, grpo]`` for grpo: :func:`_is_own`).
    Two values that make two runs elsewhere in the grid (``threshold`` crossed with
    ``rollout_correction.mode=[none, token_mask]``; that estimator crossed with objective.name=[grpo, a2po];
    ``aggregation=['', token_mean]`` crossed with [grpo, dapo]) make one run where they are one, not a refusal."""
    first: dict[str, tuple[dict, DictConfig]] = {}
    kept = []
    for run, point in zip(runs, points, strict=True):
        other, other_run = first.setdefault(run_id(run), (point, run))
        if other is point:
            kept.append(run)
            continue
        differing = [key for key in point if point[key] != other[key]]
        if differing and all(_two_runs_elsewhere(runs, key, point[key], other[key]) for key in differing):
            continue  # the same run as an earlier point: the setting changes nothing here, and acts elsewhere
        if not differing:
            key = next(k for k in grid if sum(v == point[k] for v in grid[k]) > 1)
            raise ConfigError(f"sweep.grid.{key} lists {_dot(point[key])} more than once: the same run twice; "
                              "list each value once")
        key = differing[0]
        if key.split(".")[0] in NOT_IN_RUN_ID:
            raise ConfigError(f"sweep.grid.{key}: where results go and where metrics are sent are not part of a run, "
                              f"so its values make the same runs; run one sweep per value ({key}=...)")
        own = objective_defaults(run.objective.name)
        unused = unused_setting(run, key) or unused_setting(other_run, key)  # either point may hold the inert value
        why = "a memory setting changes no number, so it is not part of the run id" if key in MEMORY_SETTINGS \
            else unused or (f"objective {run.objective.name}'s own is {_dot(own[key])}" if key in own
                            else "null stands for 2 x model.lora.rank" if key == "model.lora.alpha"
                            else "equal once parsed")
        raise ConfigError(f"sweep.grid.{key}: {_dot(other[key])} and {_dot(point[key])} make the same run ({why}); "
                          "list each value once")
    return kept


def _two_runs_elsewhere(runs: list[DictConfig], key: str, value, other) -> bool:
    """Whether two values of the grid's ``key`` that make one run here make two runs for another of the grid's runs
    (other ids with each written in): a threshold at mode none acts at token_mask; null and grpo, one estimator for
    grpo, are two for a2po."""
    for run in runs:
        one, two = copy.deepcopy(run), copy.deepcopy(run)
        OmegaConf.update(one, key, value, force_add=True)
        OmegaConf.update(two, key, other, force_add=True)
        if run_id(one) != run_id(two):
            return True
    return False


def _sections_of_type(node, type_name: str, prefix: str = ""):
    """The dotted keys of the sections (dataclass fields, at any depth) whose class is named ``type_name``."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            if type(value).__name__ == type_name:
                yield prefix + f.name
            yield from _sections_of_type(value, type_name, f"{prefix}{f.name}.")


def _dot(value) -> str:
    """A value as a dotlist's right-hand side (None: null, not the string 'None'; booleans as YAML writes them; the
    empty string quoted: ``key=`` is null; infinities and NaN as YAML's ``.inf`` and ``.nan``: ``inf`` reads back as
    text)."""
    if value == "":
        return "''"
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ".inf" if value > 0 else "-.inf"
    return json.dumps(value) if isinstance(value, list | dict | bool) or value is None else str(value)


def run_id(run: DictConfig) -> str:
    """Readable and stable: <objective>-s<seed>-<hash of the run's values that differ from the schema defaults and
    from the objective's own (:func:`objective_defaults`)>. Hashing only the differences keeps ids (and so
    resumability) when a new setting is added at its default, and gives a setting written out at its default the
    run's own id. A task's own arguments (``task.args``, which no schema holds) count as written: a task's default
    written out (``score_timeout_s: 10``) makes another run id."""
    def changed(values: dict, defaults: dict) -> dict:
        return {k: changed(v, defaults[k]) if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
                for k, v in values.items() if k not in defaults or v != defaults[k]}

    values = scale_written_once(canonical_values(OmegaConf.to_container(run, resolve=True)))
    content = changed(values, schema_defaults())
    for key in NOT_IN_RUN_ID:  # where results go and where metrics are tracked do not change the run
        content.pop(key, None)
    memory = memory_settings(run)  # nor how much memory it takes (the run resumed under less is the same run), nor
    keys = _dotted(content)  # what changes nothing, nor an objective's setting given at its own value
    unused, flat = unused_settings(run, keys), flattened(values)
    for key in keys:
        if key in memory or key in unused or _is_own(run.objective.name, key, flat.get(key)):
            _drop(content, key.split("."))
    digest = hashlib.sha1(json.dumps(content, sort_keys=True).encode()).hexdigest()[:8]
    return f"{run.objective.name}-s{run.seed}-{digest}"


def _section(tree, *path) -> dict:
    """The section of a nested dict at ``path`` (itself, not a copy), or an empty dict where there is none."""
    for name in path:
        tree = tree.get(name) if isinstance(tree, dict) else None
    return tree if isinstance(tree, dict) else {}


def canonical_values(values: dict) -> dict:
    """A run's values (nested, changed in place) written one way for what computes the same: its float
    hyperparameters given as integers as those floats (``objective.params.beta: 1`` is ``1.0``: the objective
    converts it) and its sets in one order (:func:`_ordered_sets`)."""
    objective = _section(values, "objective")
    name, params = objective.get("name"), _section(objective, "params")
    kinds = OBJECTIVES.get(name).hyperparameter_kinds() if isinstance(name, str) and name in OBJECTIVES else {}
    for key, value in params.items():
        if kinds.get(key) is float and isinstance(value, int) and not isinstance(value, bool):
            params[key] = float(value)
    return _ordered_sets(values)


def _ordered_sets(values: dict) -> dict:
    """A run's values with its sets in one order: LoRA's target layers (the same adapters in any order) and the
    trust-region rules with their bounds (a token must pass every rule: :func:`canonical_rejection`)."""
    lora = _section(values, "model", "lora")
    if isinstance(lora.get("target_modules"), list):
        lora["target_modules"] = sorted(lora["target_modules"], key=lambda name: (
            LORA_TARGETS.index(name) if name in LORA_TARGETS else len(LORA_TARGETS), str(name)))
    correction = _section(values, "train", "rollout_correction")
    if isinstance(correction.get("rejection"), list) and isinstance(correction.get("rejection_threshold"), list):
        correction["rejection"], correction["rejection_threshold"] = canonical_rejection(
            correction["rejection"], correction["rejection_threshold"])
    return values


def scale_written_once(values: dict) -> dict:
    """A run's values (nested, changed in place) with LoRA's ``alpha`` at ``2 x rank`` written as null, the value it
    stands for (harness/policy/lora.py): one run, one id, one folder, whichever way it was written. Only the run id
    and the resume check read it so; the report's cells keep ``alpha`` as written, since at rank 0 (no adapters) it
    is free and a rank sweep's runs write one ``alpha`` for every rank."""
    lora = _section(values, "model", "lora")
    rank, alpha = lora.get("rank"), lora.get("alpha")
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in (rank, alpha)) and rank >= 1 \
            and alpha == 2 * rank:
        lora["alpha"] = None
    return values


def objective_defaults(name) -> Mapping[str, object]:
    """What objective ``name`` uses when a run does not say (``objective.advantage``: its default estimator;
    ``objective.params.<hyperparameter>``: its default): given explicitly at these values, a setting makes the same
    run (the same run id, and a resume of the run without it). Empty for an objective that is not registered."""
    return _objective_values(name)[0] if isinstance(name, str) else MappingProxyType({})


@functools.cache
def _objective_values(name: str) -> tuple[Mapping[str, object], Mapping[str, object]]:
    """(objective_defaults, its hyperparameters' field defaults by dotted key), read-only, read once per name (a
    registered objective's class does not change)."""
    if name not in OBJECTIVES:
        return MappingProxyType({}), MappingProxyType({})
    cls = OBJECTIVES.get(name)
    own = {"objective.advantage": cls.default_advantage,
           **{f"objective.params.{k}": v for k, v in cls.hyperparameters().items()}}
    fields = {f"objective.params.{f.name}": f.default for f in dataclasses.fields(cls)}
    return MappingProxyType(own), MappingProxyType(fields)


def _stands_for(name, key: str, value):
    """The value objective ``name``'s setting ``key`` takes when written ``value``: ``objective.advantage: null`` is
    its own estimator, a hyperparameter at its field's default that stands for another (``aggregation: ""``, the
    objective's own aggregation) is that one; anything else is itself."""
    own, fields = _objective_values(name) if isinstance(name, str) else ({}, {})
    if key == "objective.advantage" and value is None:
        return own.get(key)
    field_default = fields.get(key)
    return own[key] if field_default is not None and _same_setting(value, field_default) else value


def _same_setting(given, other) -> bool:
    """Equal as a setting: equal and of the same kind (``True`` is not ``1``)."""
    return given == other and isinstance(given, bool) == isinstance(other, bool)


def _is_own(name, key: str, value) -> bool:
    """Whether objective ``name``'s setting ``key`` (dotted) written ``value`` is the objective's own value
    (:func:`objective_defaults`, :func:`_stands_for`: ``objective.advantage: null`` names its own estimator)."""
    own = objective_defaults(name)
    return key in own and _same_setting(_stands_for(name, key, value), own[key])


def beyond_own_values(name: str, settings: dict) -> dict:
    """An objective's ``settings`` as the lab writes them (``lab.params.<name>``: ``advantage`` and its
    hyperparameters by name) less those at objective ``name``'s own value: the same lab with them or without."""
    dotted = {key: "objective.advantage" if key == "advantage" else f"objective.params.{key}" for key in settings}
    try:  # and those it declares inert at these values (kl_estimator at beta 0)
        inert = get_objective(name, **{k: v for k, v in settings.items() if k != "advantage"}).inert_hyperparameters()
    except (KeyError, TypeError, ValueError):
        inert = frozenset()
    return {key: value for key, value in settings.items() if not _is_own(name, dotted[key], value) and key not in inert}


def own_values_written(flat: dict) -> dict:
    """``flat`` (a run's settings, dotted keys) with its objective's settings written as the values they stand for
    (:func:`_stands_for`: ``objective.advantage`` null, or left out, as the objective's estimator): two configs of one
    objective compare equal exactly when they compute the same (a resume). An unregistered objective's settings are
    returned as they are."""
    name = flat.get("objective.name")
    own = objective_defaults(name)
    if not own:
        return flat
    written = {key: _stands_for(name, key, value) if key in own else value for key, value in flat.items()}
    return {"objective.advantage": own["objective.advantage"], **written}


def nested(dotted: dict) -> dict:
    """A dict of dotted keys (``{"train.lr": 1e-4}``) as the nested dict a config.yaml holds."""
    tree: dict = {}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def flattened(tree, prefix: str = "") -> dict:
    """A nested dict (a config.yaml's settings) as dotted keys (``{"train": {"lr": 1e-4}}`` -> ``{"train.lr":
    1e-4}``; an empty section makes no key): :func:`nested`'s inverse."""
    if not isinstance(tree, dict):
        return {prefix.removesuffix("."): tree}
    flat = {}
    for key, value in tree.items():
        flat.update(flattened(value, f"{prefix}{key}."))
    return flat


def settings_digest(flat: dict) -> str:
    """The digest of a run's settings (``flat``: its config.yaml's, dotted keys) written one way
    (:func:`canonical_values`: a resume under the same rules in another order, or ``beta: 1.0`` for ``1``, rewrites
    config.yaml so) less where its results go and where metrics are sent (:data:`NOT_IN_RUN_ID`: a later sweep
    rewrites an ended run's trackers) and its memory settings (:data:`MEMORY_SETTINGS`: a sweep rewrites them for a
    run it continues): summary.json's ``settings_digest``, which the report checks the config.yaml it reads against
    (an edit after the run wrote it)."""
    return _digest(flattened(canonical_values(nested(flat))))


def _digest(flat: dict) -> str:
    kept = {key: value for key, value in flat.items()
            if key.split(".")[0] not in NOT_IN_RUN_ID and key not in MEMORY_SETTINGS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def edited_after_written(flat: dict, summary: dict) -> bool:
    """Whether a run's config.yaml settings (``flat``, dotted keys) are not those the run wrote, by the digest its
    summary.json records (:func:`settings_digest`; a run of older code recorded none: False, or the digest of the
    settings as written, or with only their sets ordered: any of them matches)."""
    recorded = summary.get("settings_digest") if isinstance(summary, dict) else None
    return bool(flat) and isinstance(recorded, str) and recorded not in (
        settings_digest(flat), _digest(flattened(_ordered_sets(nested(flat)))), _digest(flat))


def counted_settings(flat: dict, left_out: list[str] | None = None) -> dict:
    """``flat`` (a run's settings as its config.yaml holds them, dotted keys) less what the run id leaves out as
    making no other run: its objective's settings at the objective's own value (:func:`_is_own`: a run that writes
    grpo's estimator out is the run that does not; a hyperparameter left out stands for each objective's own value,
    whose raw value means another thing for each), and its hyperparameters that change nothing at its other values
    (:func:`unused_setting`: kl_estimator at beta 0), with its sets in one order (:func:`canonical_values`: LoRA's
    targets, the trust-region rules). Other settings stay as written, the ones that change nothing
    too (LoRA's at rank 0, which every config.yaml holds: left out of some runs, they would be cells' axes beside the
    rank). The report's cells pool runs on these. ``left_out``: the keys the run's own code judged so
    (:func:`settings_left_out`, which summary.json records), read instead of this code's objectives' own values."""
    flat = flattened(canonical_values(nested(flat)))  # a set's members in one order: one setting, one cell
    if left_out is not None:
        return {key: value for key, value in flat.items() if key not in set(left_out)}
    name = flat.get("objective.name")
    kept = {key: value for key, value in flat.items() if not _is_own(name, key, value)}
    try:
        inert = unused_settings(OmegaConf.create(nested(flat)), [k for k in kept if k.startswith("objective.")])
    except Exception:  # noqa: BLE001 - a config.yaml of an older or odd shape: its settings as written
        return kept
    return {key: value for key, value in kept.items() if key not in inert}


def settings_left_out(run: DictConfig) -> list[str]:
    """The dotted keys of ``run``'s config.yaml that :func:`counted_settings` leaves out by this code's objectives:
    what a run records (summary.json's ``settings_left_out``) so that a report read by later code, whose objectives'
    own values may differ, pools it by the values it ran with."""
    flat = flattened(OmegaConf.to_container(run, resolve=False))
    return sorted(set(flat) - set(counted_settings(flat)))


def unused_setting(run: DictConfig, key: str) -> str | None:
    """Why the setting ``key`` (dotted) changes nothing in ``run``, or None: it is then neither part of the run id nor
    a difference on resume, and a sweep over it is the same run. LoRA's settings but the rank at rank 0 (no
    adapters); the rollout correction's thresholds at mode none (its rules' bounds without rules are refused); an
    objective's hyperparameters that it declares inert at its values (``Objective.inert_hyperparameters``:
    kl_estimator at beta 0); ``train.old_logp`` where the loop recomputes the behaviour log-probs whatever it says
    (harness/run/offpolicy.py ``recompute_forced``); ``model.seed`` where nothing is drawn from it
    (:func:`draws_from_model_seed`: a pretrained model without a warm start or adapters)."""
    return unused_settings(run, [key]).get(key)


def _bounds_nothing(run: DictConfig, mode) -> bool:
    """Whether ``run``'s threshold_lower is 0 in a mode whose lower bound unset is none: the same weights and
    metrics as unset (objectives/rollout_correction.py :func:`lower_threshold`)."""
    low = OmegaConf.select(run, "train.rollout_correction.threshold_lower", default=None)
    return (not isinstance(low, bool) and isinstance(low, int | float) and low == 0 and mode in CORRECTION_MODES
            and lower_threshold(mode, DEFAULT_THRESHOLD, None) is None)


def unused_settings(run: DictConfig, keys) -> dict[str, str]:
    """:func:`unused_setting` for each of ``keys``, the run's values read once: {key: why} for those that change
    nothing."""
    # a config written before a setting existed lacks it: its default then
    lora_rank, mode = (OmegaConf.select(run, k, default=d) for k, d in (("model.lora.rank", 0),
                                                                      ("train.rollout_correction.mode", "none")))
    inert = _inert(run) if any(key.startswith("objective.params.") for key in keys) else frozenset()
    why = {}
    for key in keys:
        if key.startswith("model.lora.") and key != "model.lora.rank" and not lora_rank:
            why[key] = "LoRA's settings change nothing at model.lora.rank=0 (no adapters)"
        elif key in ("train.rollout_correction.threshold", "train.rollout_correction.threshold_lower") \
                and mode == "none":
            why[key] = "the correction's thresholds change nothing at train.rollout_correction.mode=none"
        elif key == "train.rollout_correction.threshold_lower" and _bounds_nothing(run, mode):
            why[key] = (f"threshold_lower 0 bounds nothing at train.rollout_correction.mode={mode} (its weights are "
                        ">= 0, and unset it has no lower bound)")
        elif key == "train.old_logp" and "train" in run and recompute_forced(run.train):
            why[key] = ("train.old_logp changes nothing where the loop recomputes the behaviour log-probs (a rollout "
                        "correction, trust-region rules or routing replay)")
        elif key == "model.seed" and not draws_from_model_seed(
                {k: OmegaConf.select(run, k, default=d) for k, d in MODEL_SEED_DRAWN_BY.items()}):
            why[key] = ("model.seed changes nothing for a pretrained model without a warm start or LoRA adapters, "
                        "whose one starting policy it is; model.warm_start_steps or model.lora.rank > 0 make others")
        elif key.startswith("objective.params.") and key.removeprefix("objective.params.") in inert:
            why[key] = (f"objective {run.objective.name} declares {key.removeprefix('objective.params.')} inert at "
                        "these values")
    return why


def draws_from_model_seed(values: Mapping) -> bool:
    """Whether a run draws its starting policy from model.seed: a tiny model's init, a warm start's batch order,
    LoRA's initial A (harness/loop/build.py). ``values``: the run's settings by dotted key, those of
    :data:`MODEL_SEED_DRAWN_BY` read (one left out: the schema's default)."""
    name, warm_start_steps, lora_rank = (values.get(key, default) for key, default in MODEL_SEED_DRAWN_BY.items())
    return name in TINY_MODELS or bool(warm_start_steps) or bool(lora_rank)


def _inert(run: DictConfig) -> frozenset[str]:
    """The run's objective's inert hyperparameters (none when its settings do not build it: validation says why)."""
    try:
        params = OmegaConf.to_container(OmegaConf.select(run, "objective.params", default=None) or OmegaConf.create())
        return get_objective(run.objective.name, **params).inert_hyperparameters()
    except (KeyError, TypeError, ValueError):
        return frozenset()


def _dotted(tree: dict, prefix: str = "") -> list[str]:
    """The dotted keys of the leaves of a nested dict."""
    return [key for name, value in tree.items()
            for key in (_dotted(value, f"{prefix}{name}.") if isinstance(value, dict) and value else [prefix + name])]


def _drop(tree: dict, path: list[str]) -> None:
    """Remove the leaf at ``path`` from a nested dict, and every section it leaves empty."""
    if len(path) > 1:
        _drop(tree[path[0]], path[1:])
        if tree[path[0]] == {}:
            del tree[path[0]]
    else:
        del tree[path[0]]


def memory_settings(run: DictConfig) -> tuple[str, ...]:
    """The :data:`MEMORY_SETTINGS` that change no number of ``run``: :func:`memory_keys` of its ``train.pass_k``."""
    return memory_keys(run.train.pass_k)


def memory_keys(pass_k) -> tuple[str, ...]:
    """The :data:`MEMORY_SETTINGS` that change no number of a run with this ``train.pass_k``:
    ``train.eval_batch_size`` only without pass@k (with it, it decides which random numbers each problem's samples
    draw: the sampler draws one per row of each call). The run id and the report's cells (analysis/cells.py) both
    leave out these."""
    return tuple(key for key in MEMORY_SETTINGS if key != "train.eval_batch_size" or not pass_k)


def validate(run: DictConfig) -> None:
    """Every check of a run's settings, before anything starts: the schema's own here, then each component's
    (harness/run/checks.py). Raises ConfigError (one line naming the key and the fix)."""
    _check_finite(OmegaConf.to_container(run, resolve=True))
    _check_objective(run)
    _check_train(run.train)
    _check_batching(run)
    _check_seeds(run)
    _check_name(run.name)
    run_checks(run)


def check_this_machine(runs: list[DictConfig], node: bool = True) -> None:
    """What :func:`validate` leaves to the moment runs start on this machine, so that configs still expand anywhere
    (e.g. whether a hub model is cached or reachable). Called by ``train``, ``sweep`` and the lab before any folder
    exists. ``node``: the runs also execute here, so its devices and their memory are checked (a sweep on a cluster
    leaves those to each run's node). Of several runs, the refused one is named by its settings that differ between
    them."""
    refused = []
    for run in runs:
        try:
            run_checks(run, when="machine")
            if node:
                run_checks(run, when="node")
        except ConfigError as e:
            if len(runs) == 1:
                raise
            refused.append((run, e))
    if refused:
        flat = [flattened(OmegaConf.to_container(run, resolve=True)) for run in runs]
        # the keys with more than one value among the runs (NaN equal to NaN; absent as a value of its own)
        varying = {key for key in {key for one in flat for key in one}
                   if len({json.dumps(one[key], sort_keys=True, default=str) if key in one else "<absent>"
                           for one in flat}) > 1}
        points = {id(run): {key: one[key] for key in sorted(varying) if key in one}  # the keys the run has
                  for run, one in zip(runs, flat, strict=True)}
        raise_refused([(points[id(run)], e) for run, e in refused], len(runs) - len(refused), "runs")


def _parsed_same(one, other) -> bool:
    """Equal as settings whichever parser read them: YAML's reads a grid's ``1e-4`` as text, OmegaConf's a
    command-line ``1e-4`` as a number (the schema makes both the number)."""
    if _same_value(one, other):
        return True
    try:
        return not isinstance(one, bool) and not isinstance(other, bool) and float(one) == float(other)
    except (TypeError, ValueError):
        return False


def _same_value(one, other) -> bool:
    """Equal as a setting's value, NaN equal to NaN (a grid may list .nan, which the config check refuses)."""
    return one == other or isinstance(one, float) and isinstance(other, float) and math.isnan(one) and math.isnan(other)


def raise_refused(refused: list[tuple[dict, ConfigError]], accepted: int, what: str) -> None:
    """The first of a sweep's refusals (``refused``: each refused run's grid point, the dotted settings that vary
    between the sweep's ``what`` (runs, grid points), and why): as raised when every one is refused (a setting they
    share), else naming the grid values all refused ones share (the first one's grid point where they share none, or
    their reasons differ) and how many of the sweep's are refused."""
    if not refused:
        return
    point, error = refused[0]
    if not accepted or not point:
        raise error
    one_reason = all(str(e) == str(error) for _, e in refused)
    shared = {key: value for key, value in point.items()
              if all(key in other and _same_value(other[key], value) for other, _ in refused)}
    shown = ", ".join(f"{key}={_dot(value)}" for key, value in (shared if shared and one_reason else point).items())
    count = f"{len(refused)} of the sweep's {len(refused) + accepted} {what}"
    where = f"{count} at {shown}" if shared and one_reason else f"the sweep's run at {shown} ({count} refused)"
    raise ConfigError(f"{where}: {error}") from None


INFINITY_MEANS = frozenset({"train.max_grad_norm"})  # settings whose .inf means "no bound": no clipping


def _check_finite(value: Any, key: str = "") -> None:
    """No setting is NaN or infinite (`.nan`, `.inf` in YAML) but those where infinity means something
    (:data:`INFINITY_MEANS`): every range check passes NaN (each comparison is false) and a bound such as `> 0`
    passes infinity, so the run would start and fail, train on NaN, or train nothing and read as a collapse, later."""
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"{key} is NaN: give a number")
    if isinstance(value, float) and math.isinf(value) and key not in INFINITY_MEANS:
        raise ConfigError(f"{key} is {value}: give a finite number")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for name, item in items:
        _check_finite(item, f"{key}.{name}" if key else str(name))


def _check_objective(run: DictConfig) -> None:
    """The objective exists and takes its hyperparameters; its advantage estimator exists, with one sample per
    group does not make every advantage 0, and gives advantages of the shape the objective takes; the rollout
    correction's settings are valid."""
    try:
        get_objective(run.objective.name, **OmegaConf.to_container(run.objective.params))
        if run.objective.advantage is not None:
            ADVANTAGES.get(run.objective.advantage)
    except (KeyError, TypeError, ValueError) as e:
        trl = sorted(set(run.objective.params) & set(ALIASES)) if run.objective.name in OBJECTIVES.names() else []
        trl = [name for name in trl if name not in OBJECTIVES.get(run.objective.name).hyperparameters()]
        raise ConfigError(str(e) + (f"; `{trl[0]}` is TRL's name: give {trl[0]}=... on its own (translated) or "
                                    f"{ALIASES[trl[0]].key} (`python -m harness explain {trl[0]}`)"
                                    if trl else "")) from None
    _check_alias_kept(run)
    estimator = estimator_name(run.objective.name, run.objective.advantage)
    if run.train.group_size == 1:
        check_single_sample_groups(estimator)
    if needs_sum_pi_squared(ADVANTAGES.get(estimator)) and OBJECTIVES.get(run.objective.name).needs_sequence_advantages:
        raise ConfigError(f"advantage estimator {estimator!r} gives one advantage per token and objective "
                          f"{run.objective.name!r} needs one per sequence: use a token-level objective or another "
                          "objective.advantage")
    negative_rewards = run.task.overlong_buffer or run.task.format_weight < 0
    if needs_nonnegative_rewards(ADVANTAGES.get(estimator)) and negative_rewards:
        raise ConfigError(f"advantage estimator {estimator!r} assumes rewards >= 0 (it divides by the group's mean "
                          "reward), and task.overlong_buffer > 0 or task.format_weight < 0 makes negative ones: set "
                          "task.overlong_buffer=0 and task.format_weight >= 0, or choose another objective.advantage")
    rc = run.train.rollout_correction
    problem = check_settings(rc.mode, rc.threshold, rc.threshold_lower)  # no sampler difference is fine: weights 1
    problem = problem or check_rejection(list(rc.rejection), list(rc.rejection_threshold))
    if problem:
        raise ConfigError(problem)
    objective = OBJECTIVES.get(run.objective.name)
    if rc.mode == "decoupled_ppo" and objective.ratio_level == "other":
        raise ConfigError(f"train.rollout_correction.mode=decoupled_ppo weighs the objective's ratio against the "
                          f"proximal policy by pi_prox / pi_behaviour at the ratio's own level, and the ratio of "
                          f"objective {run.objective.name!r} is {objective.ratio_note}, which no such weight composes "
                          "with: use a token_* or sequence_* mode")


def _check_alias_twins(runs: list[DictConfig]) -> None:
    """Refuse two runs of a sweep that are one computation under two objective names: an alias and its parent given
    the alias's defining settings (``luspo`` and ``gspo`` with ``aggregation=seq_mean_token_sum``): the report would
    compare the computation with itself."""
    seen: dict[str, DictConfig] = {}
    for run in runs:
        alias = alias_of(run.objective.name)
        canonical = run
        if alias is not None and alias[1]:  # the alias as its parent with its defining settings given
            canonical = copy.deepcopy(run)
            canonical.objective.name = alias[0]
            for key, value in alias[1].items():
                OmegaConf.update(canonical, "objective.advantage" if key == "advantage" else f"objective.params.{key}",
                                 value, force_add=True)
        other = seen.setdefault(run_id(canonical), run)
        if other is not run and other.objective.name != run.objective.name:
            named = {r.objective.name: r for r in (other, run)}
            name = next(n for n in named if alias_of(n) and alias_of(n)[1])
            parent, defining = alias_of(name)
            settings = ", ".join(f"{key}={value}" for key, value in defining.items())
            raise ConfigError(f"the sweep runs {run_id(other)} and {run_id(run)}, one computation under two names "
                              f"({name} is {parent} with {settings}): leave {name} out, or {parent}'s {settings}")


def _check_alias_kept(run: DictConfig) -> None:
    """The run's objective is not an alias whose defining setting it undoes (:func:`alias_undone`)."""
    problem = alias_undone(run.objective.name, OmegaConf.to_container(run.objective.params), run.objective.advantage)
    if problem:
        raise ConfigError(problem)


def alias_undone(name: str, params: dict, advantage: str | None, where: str = "objective.params.") -> str | None:
    """Why objective ``name`` with hyperparameters ``params`` (and estimator ``advantage``; ``where``: how their keys
    are given) is its parent under another name, or None: an alias (``luspo``: ``gspo`` with
    ``aggregation=seq_mean_token_sum``) whose every defining setting is given another value (a sweep would compare
    ``gspo`` with itself under two names)."""
    alias = alias_of(name)
    if alias is None or not alias[1]:
        return None
    parent, defining = alias
    given = {**params, "advantage": advantage}
    if not all(given.get(key) not in (None, "", value) for key, value in defining.items()):
        return None
    settings = ", ".join(f"{key}={value}" for key, value in defining.items())
    mine = " ".join(f"{where if key != 'advantage' or where != 'objective.params.' else 'objective.'}{key}={given[key]}"
                    for key in defining)
    return (f"objective.name={name} is {parent} with {settings}, and {mine} undoes it: that is objective.name="
            f"{parent} with {mine} (a sweep grid over {', '.join(defining)}: leave {name} out, {parent}'s runs cover "
            "its values)")


def check_single_sample_groups(estimator: str, key: str = "objective.advantage", usable=None) -> None:
    """With one sample per group, a group-centred estimator gives every advantage 0: the run would learn nothing.
    ``key``: the setting that chooses the estimator, named in the error (the lab's: lab.params.<name>.advantage);
    ``usable``: which estimators the error may suggest (the lab's: those it can run), else every one."""
    working = [name for name in ADVANTAGES.names()
               if _learns_from_single_samples(name) and (usable is None or usable(name))]
    if estimator not in working:
        raise ConfigError(f"train.group_size=1 with advantage estimator {estimator!r} makes every advantage 0 (it "
                          f"centres rewards within a group): use train.group_size >= 2"
                          + (f", or {key} one of {', '.join(working)}" if working else ""))


def _learns_from_single_samples(name: str) -> bool:
    """Whether estimator ``name`` gives nonzero advantages to groups of one (the optimal token baseline and GDPO,
    centred within each group, do not; ReMax's baseline is a greedy completion's reward, so it does)."""
    estimator = ADVANTAGES.get(name)
    if needs_sum_pi_squared(estimator) or needs_reward_components(estimator):
        return False
    rewards, groups, lengths = torch.tensor([0.0, 1.0, 3.0]), torch.arange(3), torch.tensor([2, 3, 4])
    extra = {"baselines": torch.tensor([1.0, 0.0, 1.0])} if needs_greedy_baseline(estimator) else {}
    if reference_samples(estimator):
        extra = {"reference_rewards": torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])}
    return bool(estimator(rewards, groups, lengths, **extra).abs().sum() > 0)


def _check_train(t: DictConfig) -> None:
    """The train section's numbers are in range and its choices known."""
    for key in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "epochs", "num_minibatches",
                "max_sampling_rounds", "max_nonfinite_in_row", "eval_batch_size"):
        if t[key] < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {t[key]}")
    for key in ("lr", "weight_decay", "warmup_steps", "eval_every", "eval_max_new_tokens", "pass_k", "save_every",
                "export_every"):
        if not 0 <= t[key] < math.inf:
            raise ConfigError(f"train.{key} must be >= 0 and finite, got {t[key]}")
    if t.max_grad_norm <= 0:
        raise ConfigError(f"train.max_grad_norm must be > 0, got {t.max_grad_norm}")
    if t.old_logp not in OLD_LOGP:
        raise ConfigError(f"train.old_logp must be 'sampler' or 'recompute', got {t.old_logp!r}")
    if t.dynamic_sampling and t.group_size < 2:
        raise ConfigError("train.dynamic_sampling keeps groups with unequal rewards: it needs train.group_size >= 2")


def _check_batching(run: DictConfig) -> None:
    """Minibatches and micro-batches split the rollout evenly, and keep whole what the objective compares; the
    overlong penalty fits the completions."""
    t, task = run.train, run.task
    if not 0 <= task.overlong_buffer <= t.max_new_tokens or task.overlong_penalty < 0:
        raise ConfigError(f"task.overlong_buffer must be in [0, train.max_new_tokens={t.max_new_tokens}] and "
                          f"task.overlong_penalty >= 0, got {task.overlong_buffer} and {task.overlong_penalty}")
    if rollout_size(t) % t.num_minibatches:
        raise ConfigError(f"train.num_minibatches={t.num_minibatches} must divide "
                          f"prompts_per_step x group_size = {rollout_size(t)}")
    minibatch = minibatch_size(t)
    if t.micro_batch_size < 0 or minibatch % microbatch_size(t):
        raise ConfigError(f"train.micro_batch_size={t.micro_batch_size} must divide the minibatch "
                          f"({minibatch} sequences), or be 0")
    if t.lm_head_chunk < 0 or t.max_tokens_per_micro_batch < 0:
        raise ConfigError(f"train.lm_head_chunk and train.max_tokens_per_micro_batch must be >= 0 (0: off), got "
                          f"{t.lm_head_chunk} and {t.max_tokens_per_micro_batch}")
    if t.max_tokens_per_micro_batch and t.micro_batch_size:
        raise ConfigError("set train.micro_batch_size (rows) or train.max_tokens_per_micro_batch (tokens), not both")
    objective = get_objective(run.objective.name, **OmegaConf.to_container(run.objective.params))
    if objective.needs_whole_groups and (minibatch % t.group_size or microbatch_size(t) % t.group_size):
        raise ConfigError(f"objective {run.objective.name!r} compares the samples of a group: the minibatch "
                          f"({minibatch}) and train.micro_batch_size must be multiples of "
                          f"train.group_size={t.group_size}")
    if objective.needs_minibatch_at_once() and (microbatch_size(t) != minibatch or t.max_tokens_per_micro_batch):
        raise ConfigError(f"objective {run.objective.name!r} needs statistics of the whole minibatch: use "
                          f"train.micro_batch_size=0 and train.max_tokens_per_micro_batch=0 (micro-batching would "
                          f"make it inexact)")


NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")  # an experiment name: one path component of these


def _check_name(name) -> None:
    """The experiment name is one folder under results_dir (results/<name>/): letters, digits, '.', '_', '-', not
    starting with '.', at most 100 characters; so it never leaves results_dir and never becomes a line of a script."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(f"name must be one folder name of letters, digits, '.', '_' and '-' (not starting with '.', "
                          f"at most 100 characters): it names results_dir/<name>/; got {str(name)[:120]!r}")


def _check_seeds(run: DictConfig) -> None:
    """Seeds numpy and torch accept; a thread count."""
    for key, value in (("seed", run.seed), ("model.seed", run.model.seed)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_BOUND:
            raise ConfigError(f"{key} must be an integer in [0, 2**32) (numpy's and torch's seeds), got {value!r}")
    if run.threads < 0:
        raise ConfigError(f"threads must be >= 0 (0: the cores free when the run starts), got {run.threads}")
