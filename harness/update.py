"""The native loop's update: ``epochs`` passes over one rollout batch, each split into ``num_minibatches``
optimizer steps; a minibatch is summed over micro-batches with the minibatch's global token and sequence counts,
so its gradient is exactly the minibatch objective's whatever the micro-batch size.

    order = minibatch_order(...)                    # whole groups stay together when they fit
    loss, metrics = microbatch_loss(...)            # forward, objective, backward for some rows
    grad_norm = optimizer_step(...)                 # clip, skip if non-finite, step
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import Tensor

from harness.batch import TrainBatch
from harness.metrics import MetricMeter, MismatchMeter
from harness.rollout import completion_logprobs
from harness.seeding import step_seed
from objectives import PolicyBatch


@dataclass
class RunState:
    """Counters of a native run; saved in its checkpoint."""

    step: int = 0  # rollout steps done
    optimizer_steps: int = 0
    total_optimizer_steps: int = 0  # steps x epochs x num_minibatches: for objectives' schedules (HölderPO, ConSPO)
    nonfinite_skips: int = 0
    nonfinite_in_row: int = 0
    rollout_tokens: int = 0  # every sampled completion token (dynamic sampling included)
    update_tokens: int = 0  # completion tokens trained on, times epochs


def minibatch_order(n: int, group_size: int, per_minibatch: int, generator: torch.Generator) -> Tensor:
    """A random order of the ``n`` rows; groups stay whole (and contiguous) when a minibatch holds whole groups,
    as group-contrastive objectives need."""
    if per_minibatch % group_size == 0:
        groups = torch.randperm(n // group_size, generator=generator)
        return (groups[:, None] * group_size + torch.arange(group_size)).flatten()
    return torch.randperm(n, generator=generator)


def microbatch_loss(policy, objective, batch: TrainBatch, rows: Tensor, *, temperature: float, num_tokens: Tensor,
                    num_sequences: int, max_completion_len: int, state: RunState, with_entropy: bool,
                    rollout_step: int | None = None, sampler_is_behaviour: bool = True,
                    timings: dict | None = None):
    """Forward the ``rows`` of the batch, evaluate the objective (aggregated with the minibatch's counts) and
    backpropagate. Returns (loss, metrics, valid tokens, the rows' log-probs [rows, width] detached, width)."""
    ro = batch.rollout
    width = int(ro.completion_mask[rows].sum(-1).max())  # drop all-padding columns
    mask = ro.completion_mask[rows, :width]
    start = time.perf_counter()
    logp, entropy = completion_logprobs(policy, ro.prompt_ids[rows], ro.prompt_mask[rows],
                                        ro.completion_ids[rows, :width], mask, temperature, with_entropy=with_entropy)
    if timings is not None:
        timings["logp_forward_s"] = timings.get("logp_forward_s", 0.0) + time.perf_counter() - start
    out = objective(PolicyBatch(
        logp=logp, old_logp=batch.old_logp[rows, :width], mask=mask, advantages=batch.advantages[rows],
        rewards=batch.rewards[rows], group_ids=batch.group_ids[rows],
        ref_logp=None if batch.ref_logp is None else batch.ref_logp[rows, :width],
        step=state.optimizer_steps, total_steps=state.total_optimizer_steps, max_completion_len=max_completion_len,
        num_tokens=num_tokens, num_sequences=num_sequences, rollout_step=rollout_step,
        sampler_logp=None if sampler_is_behaviour else ro.sampler_logp[rows, :width]))
    out.loss.backward()
    tokens = mask.sum().item()
    metrics = dict(out.metrics)
    if entropy is not None:
        metrics["entropy"] = (entropy * mask).sum().item() / max(tokens, 1)
    return out.loss.item(), metrics, tokens, logp.detach(), width


def optimizer_step(params: list, optimizer, scheduler, loss: float, max_grad_norm: float, state: RunState) -> float:
    """Clip the gradient norm and step, unless the loss or the gradient is non-finite: then drop the gradient and
    count the skip. Returns the gradient norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    state.optimizer_steps += 1
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        state.nonfinite_skips += 1
        state.nonfinite_in_row += 1
        return grad_norm
    state.nonfinite_in_row = 0
    optimizer.step()
    scheduler.step()
    return grad_norm


def update(policy, optimizer, scheduler, objective, batch: TrainBatch, cfg: DictConfig, step: int, state: RunState,
           timings: dict | None = None) -> dict:
    """``epochs`` passes x ``num_minibatches`` optimizer steps over one rollout batch; returns the step's metrics
    (the objective's, entropy, loss, grad norm; the sampler/trainer mismatch of the first minibatch when the
    behaviour log-probs are the sampler's). ``timings`` (optional) accumulates the forward passes' seconds."""
    t = cfg.train
    ro = batch.rollout
    n = len(ro.texts)
    per_minibatch = n // t.num_minibatches
    micro = t.micro_batch_size or per_minibatch
    generator = torch.Generator().manual_seed(step_seed(cfg.seed, step, stream=1))
    meter, mismatch = MetricMeter(), MismatchMeter()
    params = [p for p in policy.parameters() if p.requires_grad]
    policy.train()
    for epoch in range(t.epochs):
        order = minibatch_order(n, t.group_size, per_minibatch, generator)
        for k in range(t.num_minibatches):
            index = order[k * per_minibatch : (k + 1) * per_minibatch]
            num_tokens = ro.completion_mask[index].sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss = 0.0
            for j in range(0, per_minibatch, micro):
                rows = index[j : j + micro]
                part, metrics, tokens, logp, width = microbatch_loss(
                    policy, objective, batch, rows, temperature=t.temperature, num_tokens=num_tokens,
                    num_sequences=per_minibatch, max_completion_len=t.max_new_tokens, state=state,
                    with_entropy=epoch == 0, rollout_step=step - 1, sampler_is_behaviour=t.old_logp == "sampler",
                    timings=timings)
                if epoch == 0 and k == 0 and t.old_logp == "sampler":
                    mismatch.add(ro.sampler_logp[rows, :width], logp, ro.completion_mask[rows, :width])
                loss += part
                meter.add(metrics, tokens)
            grad_norm = optimizer_step(params, optimizer, scheduler, loss, t.max_grad_norm, state)
            meter.add({"loss": loss, "grad_norm": grad_norm}, 1.0)
    return {**meter.result(), **mismatch.result()}
