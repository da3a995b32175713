"""The gradient lab: every objective's gradient on the same rollout batches, along two axes.

    python -m harness lab EXP [key=value ...]        # make lab EXP=lab; writes results/lab/<name>/

Fix a policy (the experiment's starting policy, or ``lab.policy``: a saved policy folder) and, for each of
``lab.batches`` independent batches (``prompts_per_step`` prompts x ``group_size`` completions, seeded by (seed,
batch) as the loop seeds its steps):

1. sample the batch from the fp32 policy at ``train.temperature``, and again, with the same random stream, from
   each ``lab.mismatch`` sampler: a bf16 (or fp16) copy, or the policy at ``lab.mismatch_temperature``; each
   rollout keeps its sampler's log-probs as the behaviour log-probs (as the loop does with ``sampler_dtype``);
2. split the fp32 rollout into ``train.num_minibatches`` minibatches as the loop does (groups whole); the first is
   the *evaluation minibatch*; **staleness axis**: take k = 1 .. max(``lab.staleness``) optimizer steps (AdamW,
   ``train.lr`` after ``train.warmup_steps``' linear warm-up, as a run's) with the ``lab.mover`` objective on the
   other minibatches in turn, as the loop's later minibatches see a policy moved by the earlier ones. The moves
   are the same for every objective, so at each k all objectives are evaluated at the same policy theta_k on the
   same tokens;
3. at each axis point (theta_k with the fp32 behaviour; theta_0 with each mismatch sampler's rollout), one
   forward pass of the evaluation minibatch, then per objective its token weights c = dL/dlogp and its
   parameter gradient (one vector-Jacobian product; harness/apps/gradient_stats.py), its loss and metrics (clip
   fractions, ratio statistics, ...), which tokens carry gradient, Kish ESS, length bias, and a count sketch of
   the gradient (``lab.sketch_dim``) for the cosines and the SNR;
4. the **reference direction** at theta_k: the REINFORCE gradient with leave-one-out baselines of
   ``lab.reference_samples`` fresh completions per prompt of the evaluation minibatch, sampled on-policy
   (fp32, ``train.temperature``): an unbiased estimate of -grad E[R] on those prompts;
5. the variance of the log ratios (token, cumulative prefix, prefix mean, sequence) against position;
6. **routing axis** (Mixture-of-Experts policies, ``lab.routing``): at the largest staleness K, the same theta_K on
   the same tokens with the behaviour routing forced (harness/policy/routing.py): ``r2`` theta_0's teacher-forced
   routing of the fp32 rollout, ``r3`` the fp32 sampler's own routing; the staleness-K point is replay off. What
   routing changes add to the ratios' spread and take from each objective's gradient, at the same policy.

Each batch is written atomically to ``batches/batch_<b>.pt`` when done, so a killed lab resumes where it stopped
and reruns give the same files; the tables, the SNR across batches and the report come from analysis/lab.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from analysis.lab import CODE_FILE, POLICY_FILE, LabError, build_lab_report, lab_policy, lab_version
from harness.apps.gradient_stats import CountSketch, ratio_by_position, reinforce_loss, token_weights, weight_metrics
from harness.loop.batch import TrainBatch, rewards_of
from harness.loop.behaviour import no_grad_logprobs
from harness.loop.build import build_learner, frozen_copy, setup_run
from harness.loop.update import Minibatch, RunState, UpdatePlan, microbatch_loss, minibatch_order, optimizer_step
from harness.policy.device import DTYPES, resolve_device
from harness.policy.forward import completion_logprobs
from harness.policy.matmul import cpu_matmul
from harness.policy.memory import sampling_memory_problem
from harness.policy.routing import Routing, RoutingRecord, config_is_moe, routing_of
from harness.policy.sampler import Rollout, sample_problems
from harness.policy.warm_start import WarmStartError, weights_digest
from harness.run.atomic import atomic_write, failure_line, to_file
from harness.run.config import (
    alias_undone,
    beyond_own_values,
    check_single_sample_groups,
    check_this_machine,
    load_experiment,
    minibatch_size,
    rollout_size,
    schema_defaults,
    validate,
)
from harness.run.errors import ConfigError
from harness.run.locks import FolderBusyError, lock_folder
from harness.run.provenance import code_record
from harness.run.records import DamagedConfigError, listed, plain_differences, read_run_config
from harness.run.seeding import step_seed
from harness.run.threads import check_count as check_thread_count
from harness.run.threads import run_threads
from objectives import OBJECTIVES, PolicyBatch, estimator_name, get_advantage, get_objective
from objectives.advantages import loop_inputs
from objectives.base import lifecycle_unsupported

# what the lab provides an objective beyond log-probs and advantages (objectives/base.py NEEDS): nothing; its fixed
# batches are evaluated once per objective, with no state carried between them
LAB_PROVIDES: frozenset[str] = frozenset()

MISMATCH_SAMPLERS = ("bfloat16", "float16", "temperature")
STREAM_PROMPTS, STREAM_ORDER, STREAM_SAMPLING, STREAM_REFERENCE = 0, 1, 2, 3


@dataclass(frozen=True)
class AxisPoint:
    axis: str  # "staleness", "mismatch" or "routing"
    value: str  # the point on its axis: "0", "4", "bfloat16", "temperature=1.3", "r2"
    staleness: int  # optimizer steps between the behaviour policy and the evaluated one
    sampler: str  # "float32" or one of MISMATCH_SAMPLERS

    @property
    def key(self) -> str:
        return f"{self.axis}={self.value}"


def axis_points(lab: DictConfig) -> list[AxisPoint]:
    """The measured points: every staleness k (fp32 behaviour), then every mismatch sampler at k = 0, then every
    routing replay at the largest k. The mismatch axis's fp32 point is staleness 0 (analysis/lab.py shows it on both
    axes)."""
    points = [AxisPoint("staleness", str(k), k, "float32") for k in lab.staleness]
    for sampler in lab.mismatch:
        value = f"temperature={lab.mismatch_temperature:g}" if sampler == "temperature" else sampler
        points.append(AxisPoint("mismatch", value, 0, sampler))
    routing = OmegaConf.select(lab, "routing", default=None) or []
    return points + [AxisPoint("routing", mode, max(lab.staleness), "float32") for mode in routing]


def lab_objective(cfg: DictConfig, name: str):
    """(objective, advantage estimator) of ``name`` with ``lab.params[name]`` (its key ``advantage``: the
    estimator, else the objective's default)."""
    params = dict(OmegaConf.to_container(cfg.lab.params).get(name) or {})
    estimator = params.pop("advantage", None)
    objective = get_objective(name, **params)
    return objective, get_advantage(estimator_name(name, estimator))


def lab_objectives(cfg: DictConfig) -> dict:
    """name -> (objective, advantage estimator) for every objective of ``lab.objectives`` (empty: all but those that
    need what the lab's fixed batches do not provide, :data:`LAB_PROVIDES`: state of their own, hidden states)."""
    names = list(cfg.lab.objectives) or [n for n in OBJECTIVES.names()
                                         if not lifecycle_unsupported(OBJECTIVES.get(n), "lab", LAB_PROVIDES)]
    return {name: lab_objective(cfg, name) for name in names}


def validate_lab(cfg: DictConfig) -> None:
    """The lab's settings, checked before anything runs (one-line ConfigError naming the key)."""
    lab, t = cfg.lab, cfg.train
    try:
        lab_objectives(cfg)
        lab_objective(cfg, lab.mover)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"lab: {e}") from None
    for name in dict.fromkeys([*lab.objectives, lab.mover]):  # an alias undone by its params: its parent, renamed
        params = dict(OmegaConf.to_container(lab.params).get(name) or {})
        problem = alias_undone(name, params, params.pop("advantage", None), where=f"lab.params.{name}.")
        if problem:
            raise ConfigError(f"lab: {problem}")
    if len(set(lab.objectives)) != len(lab.objectives):  # measured once each: a repeat said nothing
        raise ConfigError(f"lab.objectives must be distinct objectives, got {list(lab.objectives)}")
    for name in [*lab.objectives, lab.mover]:
        reason = lifecycle_unsupported(OBJECTIVES.get(name), "lab", LAB_PROVIDES)
        if reason:
            raise ConfigError(f"{reason}; leave it out of lab.objectives and lab.mover")
    unknown = sorted(set(lab.params) - set(OBJECTIVES.names()))
    if unknown:
        raise ConfigError(f"lab.params: {OBJECTIVES.unknown_message(unknown[0])}")
    unused = sorted(set(lab.params) - {*lab.objectives, lab.mover})
    if unused:
        raise ConfigError(f"lab.params.{unused[0]}: the lab runs no {unused[0]} (lab.objectives: "
                          f"{', '.join(lab.objectives)}; lab.mover: {lab.mover}); add it to lab.objectives or drop "
                          "its params")
    if t.group_size == 1:  # each measured objective's estimator and the mover's (the run's objective: the mover)
        for name in dict.fromkeys([*lab_objectives(cfg), lab.mover]):
            given = (OmegaConf.to_container(lab.params).get(name) or {}).get("advantage")
            check_single_sample_groups(estimator_name(name, given), f"lab.params.{name}.advantage",
                                       lambda estimator: not loop_inputs(get_advantage(estimator)))
    loop_only = [(n, estimator) for n, (_, estimator) in {**lab_objectives(cfg),
                                                          lab.mover: lab_objective(cfg, lab.mover)}.items()
                 if loop_inputs(estimator)]
    if loop_only:
        name, estimator = loop_only[0]
        raise ConfigError(f"lab.params.{name}.advantage: an estimator that reads what only the training loop provides "
                          f"(here: {', '.join(loop_inputs(estimator))}) cannot run on the lab's batches; choose "
                          "another")
    staleness = list(lab.staleness)
    if not staleness or 0 not in staleness or min(staleness) < 0 or len(set(staleness)) != len(staleness):
        raise ConfigError(f"lab.staleness must be distinct steps >= 0 including 0 (the fresh point), got {staleness}")
    if max(staleness) > 0 and t.num_minibatches < 2:
        raise ConfigError("lab.staleness > 0 moves the policy on the batch's other minibatches: set "
                          "train.num_minibatches >= 2")
    for sampler in lab.mismatch:
        if sampler not in MISMATCH_SAMPLERS:
            raise ConfigError(f"lab.mismatch entries must be among {', '.join(MISMATCH_SAMPLERS)}, got {sampler!r}")
    if len(set(lab.mismatch)) != len(lab.mismatch):  # each would be measured twice on the same batches
        raise ConfigError(f"lab.mismatch must be distinct samplers, got {list(lab.mismatch)}")
    if minibatch_size(t) < 2:
        raise ConfigError(f"lab: the evaluation minibatch holds {minibatch_size(t)} sequence (train.prompts_per_step x "
                          f"train.group_size / train.num_minibatches = {t.prompts_per_step} x {t.group_size} / "
                          f"{t.num_minibatches}); the spreads across its sequences need >= 2: raise "
                          "train.prompts_per_step or lower train.num_minibatches")
    if lab.batches < 2 or lab.reference_samples < 2:
        raise ConfigError(f"lab.batches and lab.reference_samples must be >= 2 (SNR across batches, leave-one-out "
                          f"baselines), got {lab.batches} and {lab.reference_samples}")
    check_lab_routing(cfg)
    if lab.sketch_dim < 0 or lab.mismatch_temperature <= 0:
        raise ConfigError(f"need lab.sketch_dim >= 0 and lab.mismatch_temperature > 0, got {lab.sketch_dim} and "
                          f"{lab.mismatch_temperature}")
    if lab.policy is not None and Path(lab.policy).is_file():
        raise ConfigError(f"lab.policy {lab.policy!r} is a file: give the saved policy folder that holds it "
                          f"({Path(lab.policy).parent})")
    if lab.policy is not None and not (Path(lab.policy) / "config.json").exists():
        raise ConfigError(f"lab.policy {lab.policy!r} is not a saved policy folder (no config.json): give a run's "
                          "final/ folder (a LoRA run's: final/merged/, model.lora.export_merged)")
    if cfg.model.lora.rank:
        raise ConfigError("lab: the lab compares gradients of the whole policy; model.lora (adapters) is a training "
                          "setting: set model.lora.rank=0")
    check_lab_reads_it(cfg)


# settings of training runs that the lab does not read, and what the lab measures instead: given, they would be
# written to the lab's config.yaml as if they had been measured under
NOT_READ_BY_THE_LAB = {
    "train.rollout_lag": "the lab's policy lag is lab.staleness",
    "train.lag_mode": "the lab's policy lag is lab.staleness",
    "train.in_flight_tokens": "the lab's policy lag is lab.staleness",
    "train.rollout_correction": "the lab measures the objectives' own ratios and weights, uncorrected",
    "train.epochs": "lab.staleness moves the policy on the batch's other minibatches",
    "train.dynamic_sampling": "the lab measures every batch it samples",
    "objective.name": "the lab measures lab.objectives, and lab.mover moves the policy",
    "objective.params": "give an objective's settings as lab.params.<name>.<key>",
    "objective.advantage": "give an objective's estimator as lab.params.<name>.advantage",
}


def check_lab_reads_it(cfg: DictConfig) -> None:
    """Refuse a setting of :data:`NOT_READ_BY_THE_LAB` that differs from the schema's default, naming the first
    differing key and what the lab measures instead."""
    defaults = OmegaConf.create(schema_defaults())
    for key, instead in NOT_READ_BY_THE_LAB.items():
        given, default = (OmegaConf.select(c, key, default=None) for c in (cfg, defaults))
        differs = _first_difference(key, *(OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
                                           for v in (given, default)))
        if differs:
            raise ConfigError(f"lab: {differs[0]}={json.dumps(differs[1])} is a setting of training runs that the lab "
                              f"does not read ({instead}); leave it out")


def _first_difference(key: str, value, default) -> tuple[str, object] | None:
    """The first dotted key under ``key`` whose value differs from the default, with its value; None if none."""
    if isinstance(value, dict) and isinstance(default, dict):
        return next((d for k in sorted({*value, *default}, key=str)
                     if (d := _first_difference(f"{key}.{k}", value.get(k), default.get(k)))), None)
    return (key, value) if value != default else None


def check_lab_routing(cfg: DictConfig) -> None:
    """``lab.routing``: distinct r2 / r3, on a Mixture-of-Experts policy, at a staleness > 0; r3 with the native,
    uncompiled sampler (whose routing can be recorded)."""
    modes, t = list(cfg.lab.routing), cfg.train
    if not modes:
        return
    if any(mode not in ("r2", "r3") for mode in modes) or len(set(modes)) != len(modes):
        raise ConfigError(f"lab.routing must be distinct entries among r2, r3, got {modes}")
    if config_is_moe(cfg.lab.policy or cfg.model.name) is False:
        raise ConfigError(f"lab.routing needs a Mixture-of-Experts policy ({cfg.lab.policy or cfg.model.name!r} is "
                          "dense): use model.name=tiny_moe, or lab.routing=[]")
    if max(cfg.lab.staleness) == 0:
        raise ConfigError("lab.routing replays at the largest lab.staleness, which is 0 (nothing moved): add a "
                          "staleness > 0")
    if "r3" in modes and (t.sampler != "native" or t.compile_sampler):
        raise ConfigError("lab.routing r3 records the sampler's routing: use train.sampler=native with "
                          "train.compile_sampler=false")


def lab_config(cfg: DictConfig) -> DictConfig:
    """The experiment's config as the lab uses it: ``lab.policy`` replaces the model (no warm start); checked."""
    cfg = copy.deepcopy(cfg)
    cfg.sweep.grid, cfg.sweep.per_objective = {}, {}
    if cfg.lab.policy is not None:
        cfg.model.name, cfg.model.tiny = cfg.lab.policy, {}
        cfg.model.warm_start_steps, cfg.model.warm_start_target = 0, None
    validate_lab(cfg)
    run = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in ("sweep", "profiles", "lab")])
    run.objective.name = cfg.lab.mover  # what trains in the lab (its moves), with the estimator lab.params gives it
    run.objective.advantage = (OmegaConf.to_container(cfg.lab.params).get(cfg.lab.mover) or {}).get("advantage")
    validate(run)
    return cfg


def lab_dir(cfg: DictConfig) -> Path:
    return Path(cfg.results_dir) / "lab" / cfg.name


def run_lab(cfg: DictConfig, progress: bool = True) -> Path:
    """Measure every missing batch into ``lab_dir(cfg)/batches/``; returns the folder. The caller writes the
    report (analysis/lab.py)."""
    cfg = lab_config(cfg)
    try:
        check_this_machine([cfg])
    except ConfigError as e:  # lab.policy is the model here: named as the user gave it
        given = f"model.name {cfg.lab.policy!r}"
        raise ConfigError(str(e).replace(given, f"lab.policy {cfg.lab.policy!r}", 1) if cfg.lab.policy else str(e)) \
            from None
    t = cfg.train  # the reference directions' completions, sampled at once: at least one prompt's per group of rows
    problem = sampling_memory_problem(cfg, cfg.lab.reference_samples * -(-minibatch_size(t) // t.group_size),
                                      "lab.reference_samples x the evaluation minibatch's prompts")
    if problem:
        raise ConfigError(problem)
    check_thread_count(cfg.threads, "threads")
    out = lab_dir(cfg)
    check_lab_folder(out)
    (out / "batches").mkdir(parents=True, exist_ok=True)
    lock = lock_folder(out / ".lab.lock", f"another lab is already running in {out}")
    try:
        try:
            saved = read_run_config(out / "config.yaml")
        except DamagedConfigError as e:  # its batches cannot be checked against these settings
            raise ConfigError(f"{e}: the lab's batches there cannot be checked against these settings; delete "
                              f"{out} or choose another name=...") from None
        if saved is not None and not isinstance(saved.get("lab"), dict):  # e.g. a run's: never overwritten
            raise ConfigError(f"{out / 'config.yaml'} is not a lab's settings (it has no lab section): {out} is not "
                              "a lab's folder; choose another name=... or results_dir=...")
        differences = [] if saved is None else plain_differences(comparable(OmegaConf.create(saved)), comparable(cfg))
        if differences and any((out / "batches").glob("batch_*.pt")):  # one that measured nothing (a start that
            # failed) has nothing to keep: these settings take its folder over
            raise ConfigError(f"{out} holds a lab with other settings ({listed(differences)}; only lab.batches may "
                              "change between calls): delete it or choose another name=...")
        atomic_write(out / "config.yaml", OmegaConf.to_yaml(cfg))
        todo = [b for b in range(cfg.lab.batches) if not batch_path(out, b).exists()]
        if todo:
            check_lab_code(out)
            lab = Lab(cfg)
            check_lab_policy(out, cfg.model.name, weights_digest(lab.policy))
            lab.measure(todo, out, progress)
    finally:
        lock.close()
    return out


def check_lab_folder(out: Path) -> None:
    """Refuse (ConfigError, one line, before anything is written) a lab folder (``out``: results_dir/lab/<name>), the
    folder above it, its batches/ or a batch in it that is a symbolic link: the lab writes its settings, code record,
    batches, tables and a failure's traceback there by name, and reads its batches back as its own measurements."""
    batches = out / "batches"
    linked = [path for path in (out.parent, out, batches) if path.is_symlink()]
    if not linked and batches.is_dir():
        linked = sorted(path for path in batches.iterdir() if path.is_symlink())
    if linked:
        raise ConfigError(f"{linked[0]} is a symbolic link (to {os.readlink(linked[0])}): the lab does not write or "
                          "read its measurements through a link; remove it, or choose another name=... or "
                          "results_dir=...")


def check_lab_code(out: Path) -> None:
    """Before batches are added to the lab in ``out``: its batches are one code version's. A lab without batches records
    this process's code (``code.json``); one measured by other code is refused (ConfigError, one line); one from before
    labs recorded their code is extended with a warning and stays unrecorded (its report says so)."""
    current = code_record()
    check_lab_record(out, CODE_FILE, lab_version(out), current, "version", "measured by code",
                     f"check out {lab_version(out)} to add to it")


def check_lab_policy(out: Path, source: str, digest: str) -> None:
    """Before batches are added to the lab in ``out``: its batches measure one policy's gradients. As
    :func:`check_lab_code`, for the digest of the policy's weights (``policy.json``): ``lab.policy`` names a folder,
    whose weights can be replaced between two calls, and a starting policy built on another CPU has other weights
    under the same settings (harness/policy/warm_start.py)."""
    measured = any((out / "batches").glob("batch_*.pt"))
    if measured and lab_policy(out) is None and lab_version(out) == code_record()["version"]:
        raise ConfigError(f"{out}: {POLICY_FILE} is missing or damaged, though this code measured the lab and records "
                          "it: the policy its batches measured cannot be checked; delete the folder or choose another "
                          "name=...")
    check_lab_record(out, POLICY_FILE, lab_policy(out), {"weights_sha256": digest, "policy": source},
                     "weights_sha256", f"measured on {source} with weights of digest",
                     "restore those weights to add to it")


def check_lab_record(out: Path, file: str, recorded: str | None, current: dict, key: str, what: str,
                     fix: str) -> None:
    """``out/file`` records ``current`` (its ``key``: what the lab's batches share) when the lab has no batches; with
    batches, a ``recorded`` value other than ``current[key]`` is refused (``what``: the refusal's words, ``fix``: how
    to add to it) and a lab from before the record is extended with a warning, unrecorded."""
    measured = any((out / "batches").glob("batch_*.pt"))
    if recorded is not None and recorded != current[key]:
        raise ConfigError(f"{out} holds a lab {what} {recorded}, not {current[key]}: its batches would be pooled "
                          f"with this call's; {fix}, or delete it or choose another name=...")
    if recorded is None and measured:
        print(f"warning: {out}: its batches were measured before labs recorded {file} (none readable there); adding "
              f"batches with {key} {current[key]}, the lab's stays unrecorded", file=sys.stderr)
    elif recorded is None:
        atomic_write(out / file, json.dumps(current, indent=1) + "\n")


def comparable(cfg: DictConfig) -> dict:
    """The settings that must match for batches to be pooled: all but the number of batches, an objective's
    ``lab.params`` less those at the objective's own value (``advantage: grpo`` for grpo is grpo's lab)."""
    values = OmegaConf.to_container(cfg, resolve=True)
    values["lab"].pop("batches")
    params = {name: beyond_own_values(name, settings or {})
              for name, settings in (values["lab"].get("params") or {}).items()}
    values["lab"]["params"] = {name: settings for name, settings in params.items() if settings}
    return values


def batch_path(out: Path, b: int) -> Path:
    return out / "batches" / f"batch_{b:03d}.pt"


class Lab:
    """The policy, its frozen copies and the objectives, built once; :meth:`measure_batch` is one batch."""

    def __init__(self, cfg: DictConfig):
        run_threads(cfg.threads)
        self.cfg, self.t = cfg, cfg.train
        setup = setup_run(cfg, resolve_device(cfg.device))  # harness/loop/build.py, as a run's
        self.task, self.problems, self.tokenizer = setup.task, setup.train_problems, setup.tokenizer
        self.policy = setup.policy.requires_grad_(False).eval()
        self.objectives = lab_objectives(cfg)
        self.mover, self.mover_estimator = lab_objective(cfg, cfg.lab.mover)
        self.samplers = {s: frozen_copy(self.policy, DTYPES[s]) for s in cfg.lab.mismatch if s in DTYPES}
        shapes = [p.shape for p in self.policy.parameters()]
        self.sketch = CountSketch(shapes, cfg.lab.sketch_dim, seed=cfg.seed)
        self.points = axis_points(cfg.lab)
        self.routing = list(cfg.lab.routing)
        if self.routing:  # record (and replay) the policy's routing (harness/policy/routing.py)
            Routing(self.policy)

    def measure(self, batches: list[int], out: Path, progress: bool) -> None:
        bar = tqdm(total=len(batches) * len(self.points), desc=f"lab {self.cfg.name}", disable=not progress,
                   leave=False)
        for b in batches:
            start = time.time()
            with cpu_matmul(self.t.cpu_matmul):  # the linear layers' kernel of a run (harness/loop/native.py)
                result = self.measure_batch(b, bar)
            result["seconds"] = time.time() - start
            atomic_write(batch_path(out, b), write=to_file(lambda f, result=result: torch.save(result, f)))
        bar.close()

    # ------------------------------------------------------------------------------------------ one batch

    def sample(self, problems, b: int, sampler: str) -> Rollout:
        """The batch's completions from ``sampler``, all drawn from the same random stream (seed, batch)."""
        t = self.t
        model = self.samplers.get(sampler, self.policy)
        temperature = self.cfg.lab.mismatch_temperature if sampler == "temperature" else t.temperature
        torch.manual_seed(step_seed(self.cfg.seed, b, STREAM_SAMPLING))
        return sample_problems(model, self.tokenizer, problems, t, temperature=temperature,
                               record_routing=sampler == "float32" and "r3" in self.routing)

    def rewards(self, ro: Rollout, problems, group_size: int) -> torch.Tensor:
        scores = [self.task.score(text, problems[i // group_size]) for i, text in enumerate(ro.texts)]
        return rewards_of(scores, ro.completion_mask.sum(-1), self.cfg)

    def moved_policies(self, ro: Rollout, rewards, group_ids, order,
                       per_minibatch: int) -> tuple[dict[int, dict], list[int]]:
        """theta_k (state dicts) for every k of lab.staleness: k AdamW steps of the mover objective on
        minibatches 1, 2, ..., M-1, 1, 2, ... of ``order`` (minibatch 0 is the evaluation minibatch); and the steps
        k that the loop's rule skipped (a non-finite loss or gradient: theta_k is then theta_{k-1})."""
        t, staleness = self.t, sorted(self.cfg.lab.staleness)
        states, skipped = {0: self.policy.state_dict()}, []
        if staleness[-1] == 0:
            return states, skipped
        learner = build_learner(copy.deepcopy(self.policy).requires_grad_(True).train(), self.mover, t)
        batch = TrainBatch(ro, rewards, self.mover_estimator(rewards, group_ids, ro.completion_mask.sum(-1)),
                           group_ids, ro.sampler_logp)
        # one minibatch per step, the sampler's log-probs as behaviour, outside a run's rollout steps
        plan = dataclasses.replace(UpdatePlan.of(batch, self.cfg, 0), rollout_step=None, behaviour="sampler")
        state = RunState(total_optimizer_steps=staleness[-1])
        for k in range(1, staleness[-1] + 1):
            m = 1 + (k - 1) % (t.num_minibatches - 1)
            rows = order[m * per_minibatch : (m + 1) * per_minibatch]
            learner.optimizer.zero_grad(set_to_none=True)
            minibatch = Minibatch(rows, ro.completion_mask[rows].sum().clamp(min=1))
            part = microbatch_loss(learner, plan, minibatch, rows, state)
            skips = state.nonfinite_skips
            optimizer_step(learner, part.loss, t.max_grad_norm, state, part.metrics)
            if state.nonfinite_skips > skips:
                skipped.append(k)
            if k in staleness:
                states[k] = {name: value.detach().clone() for name, value in learner.policy.state_dict().items()}
        return states, skipped

    def reference_gradient(self, model, problems, b: int, k: int) -> torch.Tensor:
        """Sketch of the REINFORCE (leave-one-out) gradient of ``reference_samples`` on-policy completions of
        each of ``problems``, accumulated in chunks of one minibatch's size."""
        t, n = self.t, self.cfg.lab.reference_samples
        torch.manual_seed(step_seed(self.cfg.seed, b * 1000 + k, STREAM_REFERENCE))
        ro = sample_problems(model, self.tokenizer, problems, t, group_size=n)
        rewards = self.rewards(ro, problems, n)
        advantages = get_advantage("rloo")(rewards, torch.arange(len(problems)).repeat_interleave(n))
        params = list(model.parameters())
        model.requires_grad_(True).zero_grad(set_to_none=True)
        chunk = max(minibatch_size(self.t), n)
        for i in range(0, len(ro.texts), chunk):
            rows = slice(i, i + chunk)
            width = int(ro.completion_mask[rows].sum(-1).max())
            logp, _ = completion_logprobs(model, ro.prompt_ids[rows], ro.prompt_mask[rows],
                                          ro.completion_ids[rows, :width], ro.completion_mask[rows, :width],
                                          t.temperature, padding_free=t.padding_free)
            (reinforce_loss(logp, ro.completion_mask[rows, :width], advantages[rows]) * logp.shape[0]
             / len(ro.texts)).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        model.requires_grad_(False)
        return self.sketch(grads)

    def behaviour_routing(self, ro: Rollout) -> dict[str, RoutingRecord]:
        """The routing each ``lab.routing`` mode forces: r2 theta_0's teacher-forced routing of the fp32 rollout
        (harness/loop/behaviour.py's recompute forward), r3 the sampler's own (recorded while sampling)."""
        records = {"r3": ro.routing} if "r3" in self.routing else {}
        if "r2" in self.routing:
            records["r2"] = no_grad_logprobs(self.policy, ro, self.t, record=True)[1]
        return records

    def measure_point(self, model, point: AxisPoint, ro: Rollout, rewards, rows, group_ids, batch_index: int,
                      replay: RoutingRecord | None = None):
        """Per objective: a table row and the gradient's sketch, at ``model`` on the ``rows`` of ``ro`` (with
        ``replay``'s routing forced: a routing point)."""
        t = self.t
        width = int(ro.completion_mask[rows].sum(-1).max())
        mask = ro.completion_mask[rows, :width]
        params = list(model.requires_grad_(True).parameters())
        with nullcontext() if replay is None else routing_of(model).capture(replay=replay.select(rows, width)):
            logp, _ = completion_logprobs(model, ro.prompt_ids[rows], ro.prompt_mask[rows],
                                          ro.completion_ids[rows, :width], mask, t.temperature,
                                          padding_free=t.padding_free)
        old_logp = ro.sampler_logp[rows, :width]
        ref_logp = None
        if any(obj.beta > 0 for obj, _ in self.objectives.values()):
            with torch.no_grad():
                ref_logp, _ = completion_logprobs(self.policy, ro.prompt_ids[rows], ro.prompt_mask[rows],
                                                  ro.completion_ids[rows, :width], mask, t.temperature,
                                                  padding_free=t.padding_free)
        rows_out, sketches = [], {}
        for name, (objective, estimator) in self.objectives.items():
            advantages = estimator(rewards, group_ids, ro.completion_mask.sum(-1))[rows]
            batch = PolicyBatch(logp=logp.detach(), old_logp=old_logp, mask=mask, advantages=advantages,
                                rewards=rewards[rows], group_ids=group_ids[rows], ref_logp=ref_logp,
                                max_completion_len=t.max_new_tokens, rollout_step=0)
            weights, out = token_weights(objective, batch)
            grads = torch.autograd.grad(logp, params, grad_outputs=weights, retain_graph=True, allow_unused=True)
            grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params, strict=True)]
            sketches[name] = self.sketch(grads)
            rows_out.append({"batch": batch_index, "objective": name, "axis": point.axis, "point": point.value,
                             "staleness": point.staleness, "sampler": point.sampler, "loss": out.loss.item(),
                             "grad_norm": torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item(),
                             **weight_metrics(weights, batch), **out.metrics})
        model.requires_grad_(False)
        positions = [{"batch": batch_index, "axis": point.axis, "point": point.value, "staleness": point.staleness,
                      **row} for row in ratio_by_position(logp.detach(), old_logp, mask)]
        return rows_out, sketches, positions

    def measure_batch(self, b: int, bar) -> dict:
        """Everything the lab records of batch ``b``: table rows, position rows, gradient sketches per point."""
        t, cfg = self.t, self.cfg
        rng = np.random.default_rng(step_seed(cfg.seed, b, STREAM_PROMPTS))
        problems = [self.problems[i] for i in rng.choice(len(self.problems), t.prompts_per_step, replace=False)]
        n, per_minibatch = rollout_size(t), minibatch_size(t)
        group_ids = torch.arange(t.prompts_per_step).repeat_interleave(t.group_size)
        order = minibatch_order(n, t.group_size, per_minibatch,
                                torch.Generator().manual_seed(step_seed(cfg.seed, b, STREAM_ORDER)))
        rows = order[:per_minibatch]
        eval_problems = [problems[g] for g in dict.fromkeys(int(i) // t.group_size for i in rows)]
        rollouts = {"float32": self.sample(problems, b, "float32")}
        rollouts.update({s: self.sample(problems, b, s) for s in cfg.lab.mismatch})
        rewards = {s: self.rewards(ro, problems, t.group_size) for s, ro in rollouts.items()}
        states, skipped = self.moved_policies(rollouts["float32"], rewards["float32"], group_ids, order,
                                              per_minibatch)
        records = self.behaviour_routing(rollouts["float32"])
        model = copy.deepcopy(self.policy)
        if records:
            Routing(model)
        table, positions, sketches, references = [], [], {}, {}
        for point in self.points:
            model.load_state_dict(states[point.staleness])
            if point.staleness not in references:
                references[point.staleness] = self.reference_gradient(model, eval_problems, b, point.staleness)
            found, point_sketches, point_positions = self.measure_point(
                model, point, rollouts[point.sampler], rewards[point.sampler], rows, group_ids, b,
                records.get(point.value) if point.axis == "routing" else None)
            for row in found:
                row["reward_mean"] = rewards[point.sampler][rows].mean().item()
            table += found
            positions += point_positions
            sketches[point.key] = point_sketches
            bar.update(1)
        return {"rows": table, "positions": positions, "sketches": sketches,
                "references": {f"staleness={k}": v for k, v in references.items()},
                "eval_prompts": len(eval_problems), "sketch_exact": self.sketch.exact, "sketch_dim": self.sketch.dim,
                "parameters": self.sketch.numel, "batch": b, "mover_skipped": skipped}


def main(experiment: str, overrides: list[str], progress: bool = True) -> int:
    """``python -m harness lab``: measure, then write the tables and the report. A sweep's setting given on the command
    line is refused (the lab leaves the experiment's sweep aside: its grid would be measured as nothing)."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "sweep" or key.startswith("sweep."):
            raise ConfigError(f"lab: {key} is a sweep's setting, which the lab leaves aside (it measures every "
                              "objective of lab.objectives at each lab.staleness on the same batches; an objective's "
                              "settings: lab.params.<name>.<key>); leave it out")
    cfg = load_experiment(experiment, overrides)
    start = time.time()
    try:
        out = run_lab(cfg, progress)
    except (ConfigError, FolderBusyError, WarmStartError, OSError, KeyboardInterrupt):
        raise  # said in one line by the command line (harness/apps/cli.py's failure_status)
    except Exception as e:  # the lab's own failure (torch's, beyond memory: 'can't allocate'): one line, the
        print(f"error: {failure_line(e, lab_dir(cfg))}", file=sys.stderr)  # traceback in its folder
        return 1
    try:
        report = build_lab_report(out)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    measured = len(list((out / "batches").glob("batch_*.pt")))
    more = (f" (lab.batches={cfg.lab.batches}; the folder holds {measured} measured, all reported: delete it or "
            "choose another name=... for fewer)" if measured > cfg.lab.batches else "")
    print(f"lab {cfg.name}: {measured} batches in {out}{more} ({time.time() - start:.0f} s this call); "
          f"report {report}", file=sys.stderr)
    return 0
