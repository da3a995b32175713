"""What a run is made of, built from its config the same way for the native loop, the TRL backend, the lab and the
bench: task, starting policy (after the cached supervised warm start; with ``model.lora`` its adapters), objective and
advantage estimator, frozen copies (reference, sampler), optimizer and learning-rate schedule.

    setup = setup_run(cfg, device)          # RunSetup: task, problems, policy, tokenizer, objective, copies
    learner = build_learner(setup.policy, setup.objective, cfg.train)   # + AdamW and its warm-up schedule
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from harness.loop.behaviour import routing_recorded_at
from harness.loop.update import Learner
from harness.policy.device import DTYPES, sampler_dtype
from harness.policy.forward import set_memory_settings
from harness.policy.lora import with_adapters
from harness.policy.models import TINY_MODELS, check_prompt_positions, load_model
from harness.policy.routing import Routing, routing_unsupported
from harness.policy.sampler import check_decoder
from harness.policy.warm_start import WarmStartRecipe, warm_start, weights_digest
from harness.run.allocator import release_freed_memory
from harness.run.errors import ConfigError
from harness.run.offpolicy import replay_mode
from harness.tasks import Problem, Task, check_prompts_fit, get_task, problems_digest, task_arguments
from objectives import Objective, estimator_name, get_advantage, get_objective, reads_reference_policy


@dataclass(frozen=True)
class RunSetup:
    """What a run is made of, built from its config (:func:`setup_run`)."""

    device: torch.device
    task: Task
    train_problems: Sequence[Problem]
    policy: torch.nn.Module  # the starting policy (warm-started), trainable
    tokenizer: object
    start_policy: dict | None  # the warm start's record (summary.json's start_policy); None without one
    task_data: str  # the digest of the problems it trains and evaluates on (summary.json's task_data)
    start_weights: str  # the digest of the weights it starts from, warm-started or not (summary.json's start_weights)
    objective: Objective  # the config's objective, with its hyperparameters
    estimator: Callable  # its advantage estimator
    # the reference policy (a KL term, beta > 0; an objective or estimator that reads it: ``references``), else None:
    # a frozen copy of the starting policy, or with LoRA adapters the policy itself, whose base (adapters disabled:
    # harness/policy/lora.py) is the starting policy
    reference: torch.nn.Module | None
    sampler: torch.nn.Module  # the policy itself, or a frozen copy in model.sampler_dtype (refreshed every step)


def setup_run(cfg: DictConfig, device: torch.device, progress: bool = False, adapters: bool = True) -> RunSetup:
    """Build the task, the starting policy (with ``model.lora``'s adapters), the objective and the frozen copies, in
    that order (``progress``: the warm start says whether it loads or builds the starting policy, with a progress bar
    while it builds). ``adapters`` False: the adapters are left to the trainer (the TRL backend's peft_config), which
    then owns the KL reference too (the base with them disabled): no reference here."""
    task = build_task(cfg)
    train_problems = task.train_problems()
    check_prompts_fit(cfg.train.prompts_per_step, len(train_problems), cfg.task.name)  # GSM8K's: known once read
    # with the memory settings: the copies' too
    policy, tokenizer, start_policy = build_policy(cfg, task, device, progress)
    # the weights it starts from (the warm start's record has their digest), before the adapters
    start_weights = (start_policy or {}).get("weights_sha256") or weights_digest(policy)
    objective, estimator = build_objective(cfg)
    lora = cfg.model.lora
    if lora.rank and adapters:
        policy = with_adapters(policy, lora, seed=cfg.model.seed)
    reference = None
    if reads_reference_policy(objective, estimator) and (adapters or not lora.rank):
        reference = policy if lora.rank else frozen_copy(policy)
    dtype = sampler_dtype(cfg)
    sampler = frozen_copy(policy, dtype) if dtype is not None else policy
    task_data = problems_digest(train_problems, task.eval_problems())
    return RunSetup(device, task, train_problems, policy, tokenizer, start_policy, task_data, start_weights, objective,
                    estimator, reference, sampler)


def hook_routing(run: RunSetup, t: DictConfig) -> None:
    """An MoE policy's routing hooks (harness/policy/routing.py), and its sampler copy's when the sampler records the
    routing (R3): idle outside the captures of the native loop's forwards. A dense policy gets none; replay asked of
    one (a hub model whose config was not cached when the config was checked) stops here in one line."""
    reason = routing_unsupported(run.policy)
    if reason is not None:
        if replay_mode(t) != "none":
            raise ConfigError(f"train.routing_replay={replay_mode(t)}: {reason}; use train.routing_replay=none")
        return
    Routing(run.policy)
    if run.sampler is not run.policy and routing_recorded_at(t, moe=True) == "sampler":
        Routing(run.sampler)


def build_learner(policy, objective: Objective, t: DictConfig) -> Learner:
    """``policy`` with its objective, AdamW (:func:`build_optimizer`) over the parameters that require gradients
    (a LoRA policy's adapters) and warm-up schedule (:func:`build_scheduler`). An objective with state of its own
    builds it first (``setup``); the parameters it trains get a group of their own (the run's lr and weight
    decay)."""
    objective.setup(policy)
    own = objective.trainable_parameters()
    trained = [p for p in policy.parameters() if p.requires_grad]  # all of them, or LoRA's adapters
    groups = [{"params": trained}, *([{"params": own}] if own else [])]
    optimizer = build_optimizer(groups, t)
    return Learner(policy, objective, optimizer, build_scheduler(optimizer, t))


def build_task(cfg: DictConfig) -> Task:
    return get_task(cfg.task.name, **task_arguments(cfg))


def check_task_positions(cfg: DictConfig, model, tokenizer, task: Task) -> None:
    """ConfigError when the task's longest prompt (train or eval) and the longest completion need more positions than
    ``model`` takes (its config's; ``model`` may be a skeleton without weights)."""
    check_prompt_positions(cfg, model, tokenizer, [p.question for p in [*task.train_problems(), *task.eval_problems()]])


def build_policy(cfg: DictConfig, task: Task, device: torch.device, progress: bool = False):
    """The starting policy, its tokenizer and the warm start's record (its cache sidecar: key, steps, accuracy on
    the check set, ...; None without a warm start). Every run of a sweep gets the same starting policy. ``progress``:
    the warm start's lines and progress bar on stderr (harness/policy/warm_start.py)."""
    m = cfg.model
    tiny = OmegaConf.to_container(m.tiny) if m.name in TINY_MODELS else None
    model, tokenizer = load_model(m.name, tiny=tiny, device=device, dtype=DTYPES[m.dtype], seed=m.seed)
    check_decoder(model, cfg)
    check_task_positions(cfg, model, tokenizer, task)  # before a warm start
    # before the warm start, which then recomputes activations too when asked (bit-equal gradients, so the same cached
    # policy: tests/test_warm_start.py); the trainer's forward reads them from the model
    set_memory_settings(model, cfg.train.lm_head_chunk, cfg.train.activation_checkpointing)
    start = None
    if m.warm_start_steps:
        target = tuple(m.warm_start_target) if m.warm_start_target is not None else None
        recipe = WarmStartRecipe(max_steps=m.warm_start_steps, lr=m.warm_start_lr, batch_size=m.warm_start_batch_size,
                                 seed=m.seed, target=target, check_every=m.warm_start_check_every)
        model, start = warm_start(model, tokenizer, task, recipe, progress=progress)
        gc.collect()  # a warm start trained here (or loaded from the cache) leaves freed memory: its optimizer
        release_freed_memory()  # state and activations, or the loaded copy's; harness/run/allocator.py keeps freed
        # memory otherwise, and the steps then hold what they use (cheap when nothing was freed)
    return model, tokenizer, start


def build_objective(cfg: DictConfig):
    """The objective (with the config's hyperparameters) and its advantage estimator."""
    objective = get_objective(cfg.objective.name, **OmegaConf.to_container(cfg.objective.params))
    return objective, get_advantage(estimator_name(cfg.objective.name, cfg.objective.advantage))


def build_optimizer(params, t: DictConfig) -> torch.optim.AdamW:
    """AdamW with the run's ``lr`` and ``weight_decay``: the fused kernel (one pass over each parameter, its gradient
    and moments instead of a dozen tensor ops: the same update to round-off, faster on CPU
    (docs/results_benchmark.md); what TRL's Trainer runs by default) where torch has it for every parameter's device,
    the per-tensor loop elsewhere."""
    params = list(params)  # tensors, or parameter groups ({"params": [...]})
    tensors = [p for x in params for p in (x["params"] if isinstance(x, dict) else [x])]
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in tensors)
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=fused)


def build_scheduler(optimizer, t: DictConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule: linear warm-up over ``train.warmup_steps`` applied updates, then constant. The
    k-th update (k = 0, 1, ...) uses lr x min(1, (k + 1) / (warmup_steps + 1)); ``harness.loop.update.optimizer_step``
    steps it only after an applied update (a non-finite one skipped consumes no value, as transformers' Trainer
    does when its optimizer step is skipped). Build it on the optimizer the loop steps: the scheduler counts that
    optimizer's steps (torch warns "lr_scheduler.step() before optimizer.step()" otherwise)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / (t.warmup_steps + 1)))


def frozen_copy(policy, dtype: torch.dtype | None = None):
    """A copy of ``policy`` without gradients (the KL reference, or a sampler in another precision)."""
    model = copy.deepcopy(policy).requires_grad_(False).eval()
    return model.to(dtype) if dtype is not None else model
