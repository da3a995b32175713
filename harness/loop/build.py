"""What a run is made of, built from its config the same way for every backend: device, task, starting policy
(after the cached supervised warm start), objective and advantage estimator, frozen copies (reference, sampler)."""

from __future__ import annotations

import copy

import torch
from omegaconf import DictConfig, OmegaConf

from harness.policy.device import DTYPES
from harness.policy.models import load_model
from harness.policy.sampler import check_decoder
from harness.policy.warm_start import warm_start
from harness.tasks import Task, get_task
from objectives import get_advantage, get_objective


def build_task(cfg: DictConfig) -> Task:
    data_dir = {"data_dir": cfg.task.data_dir} if cfg.task.data_dir else {}
    return get_task(cfg.task.name, eval_size=cfg.task.eval_size, **data_dir, **OmegaConf.to_container(cfg.task.args))


def build_policy(cfg: DictConfig, task: Task, device: torch.device):
    """The starting policy, its tokenizer and the warm start's record (its cache sidecar: key, steps, accuracy on
    the check set, ...; None without a warm start). Every run of a sweep gets the same starting policy."""
    m = cfg.model
    tiny = OmegaConf.to_container(m.tiny) if m.name == "tiny" else None
    model, tokenizer = load_model(m.name, tiny=tiny, device=device, dtype=DTYPES[m.dtype], seed=m.seed)
    check_decoder(model, cfg)
    start = None
    if m.warm_start_steps:
        target = tuple(m.warm_start_target) if m.warm_start_target is not None else None
        model, start = warm_start(model, tokenizer, task, max_steps=m.warm_start_steps, lr=m.warm_start_lr,
                                  batch_size=m.warm_start_batch_size, seed=m.seed, target=target,
                                  check_every=m.warm_start_check_every)
    return model, tokenizer, start


def build_objective(cfg: DictConfig):
    """The objective (with the config's hyperparameters) and its advantage estimator."""
    objective = get_objective(cfg.objective.name, **OmegaConf.to_container(cfg.objective.params))
    return objective, get_advantage(cfg.objective.advantage or objective.default_advantage)


def build_optimizer(params, t: DictConfig) -> torch.optim.AdamW:
    """AdamW with the run's ``lr`` and ``weight_decay``: the fused kernel (one pass over each parameter, its gradient
    and moments instead of a dozen tensor ops: the same update to round-off, ~4x faster on CPU; what TRL's Trainer
    runs by default) where torch has it for every parameter's device, the per-tensor loop elsewhere."""
    params = list(params)
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
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
