"""The native loop's update: ``epochs`` passes over one rollout batch, each split into ``num_minibatches``
optimizer steps; a minibatch is summed over micro-batches with the minibatch's global token and sequence counts,
so its gradient is exactly the minibatch objective's whatever the micro-batch size.

    order = minibatch_order(...)                    # whole groups stay together when they fit
    stats = minibatch_statistics(...)               # only objectives with the hook (P3O), only when micro-batching
    loss, metrics = microbatch_loss(...)            # forward, objective, backward for some rows
    grad_norm = optimizer_step(...)                 # clip, skip if non-finite, step

Also shared with the TRL backend: where the behaviour log-probs come from (:func:`behaviour_logp`) and the rollout
correction weights and metrics of a batch (:func:`rollout_correction`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from harness.loop.batch import TrainBatch
from harness.loop.metrics import MetricMeter, MismatchMeter
from harness.policy.forward import completion_logprobs
from harness.run.seeding import step_seed
from objectives import PolicyBatch
from objectives.base import sum_statistics
from objectives.rollout_correction import DEFAULT_THRESHOLD, correction_metrics, correction_weights


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


def correction_settings(t: DictConfig) -> tuple[str, float, float | None]:
    """``train.rollout_correction``'s (mode, threshold, threshold_lower); mode 'none' when the config has none."""
    rc = OmegaConf.select(t, "rollout_correction", default=None)
    if rc is None:
        return "none", DEFAULT_THRESHOLD, None
    return rc.mode, rc.threshold, rc.threshold_lower


def behaviour_logp(t: DictConfig) -> str:
    """Where the behaviour (old) log-probs come from: 'recompute' (the trainer's, before the update) whenever a
    rollout correction is on — it weights by the trainer's old policy over the sampler, verl's decoupled mode and
    TRL's ``vllm_importance_sampling_correction`` recompute them too —, else ``train.old_logp``."""
    return "recompute" if correction_settings(t)[0] != "none" else t.old_logp


def rollout_correction(t: DictConfig, old_logp: Tensor, sampler_logp: Tensor | None,
                       mask: Tensor) -> tuple[Tensor | None, dict[str, float]]:
    """The rollout-correction weights [N, T] of a batch and their metrics (objectives/rollout_correction.py), or
    (None, {}) with ``mode: none``. ``sampler_logp`` None: there is no sampler difference (one model in one
    precision samples and trains: the decode path's round-off is not a different policy), so the sampler's
    log-probs are the trainer's and every weight is exactly 1."""
    mode, threshold, lower = correction_settings(t)
    if mode == "none":
        return None, {}
    sampler_logp = old_logp if sampler_logp is None else sampler_logp
    weights = correction_weights(old_logp, sampler_logp, mask, mode, threshold, lower)
    return weights, correction_metrics(old_logp, sampler_logp, mask, mode, threshold, lower, weights=weights)


def minibatch_order(n: int, group_size: int, per_minibatch: int, generator: torch.Generator) -> Tensor:
    """A random order of the ``n`` rows; groups stay whole (and contiguous) when a minibatch holds whole groups,
    as group-contrastive objectives need."""
    if per_minibatch % group_size == 0:
        groups = torch.randperm(n // group_size, generator=generator)
        return (groups[:, None] * group_size + torch.arange(group_size)).flatten()
    return torch.randperm(n, generator=generator)


def forward_rows(policy, batch: TrainBatch, rows: Tensor, temperature: float, with_entropy: bool = False,
                 timings: dict | None = None, timing_key: str = "logp_forward_s", padding_free: bool = True):
    """The current policy's log-probs (and entropies) of the ``rows``' completions, all-padding columns dropped
    (``padding_free``: the rest of the padding too, harness/policy/forward.py). Returns (logp [rows, width], entropy or
    None, mask [rows, width], width)."""
    ro = batch.rollout
    width = int(ro.completion_mask[rows].sum(-1).max())  # drop all-padding columns
    mask = ro.completion_mask[rows, :width]
    start = time.perf_counter()
    logp, entropy = completion_logprobs(policy, ro.prompt_ids[rows], ro.prompt_mask[rows],
                                        ro.completion_ids[rows, :width], mask, temperature, with_entropy=with_entropy,
                                        padding_free=padding_free)
    if timings is not None:
        timings[timing_key] = timings.get(timing_key, 0.0) + time.perf_counter() - start
    return logp, entropy, mask, width


def rows_policy_batch(batch: TrainBatch, rows: Tensor, logp: Tensor, mask: Tensor, width: int, *,
                      num_tokens: Tensor, num_sequences: int, max_completion_len: int, state: RunState,
                      rollout_step: int | None, sampler_is_behaviour: bool,
                      minibatch_stats: dict | None = None) -> PolicyBatch:
    """The objective's input for ``rows`` with the current log-probs ``logp``: behaviour / reference / sampler
    log-probs, the rollout-correction weights and advantages of those rows, the minibatch's counts."""
    ro = batch.rollout
    return PolicyBatch(
        logp=logp, old_logp=batch.old_logp[rows, :width], mask=mask, advantages=batch.advantages[rows],
        rewards=batch.rewards[rows], group_ids=batch.group_ids[rows],
        ref_logp=None if batch.ref_logp is None else batch.ref_logp[rows, :width],
        step=state.optimizer_steps, total_steps=state.total_optimizer_steps, max_completion_len=max_completion_len,
        num_tokens=num_tokens, num_sequences=num_sequences, rollout_step=rollout_step,
        sampler_logp=None if sampler_is_behaviour else ro.sampler_logp[rows, :width],
        correction=None if batch.correction is None else batch.correction[rows, :width],
        minibatch_stats=minibatch_stats)


@torch.no_grad()
def minibatch_statistics(policy, objective, batch: TrainBatch, chunks: list[Tensor], *, temperature: float,
                         padding_free: bool = True, timings: dict | None = None, **batch_fields) -> dict | None:
    """The objective's ``minibatch_statistics`` summed over the micro-batches ``chunks`` of one minibatch, from a
    no-grad forward of the current policy (the first of two passes; the same rows and widths as the loss pass, so
    the same log-probs). None when the objective has no such hook or the minibatch is one micro-batch (it then
    computes them from its batch): the extra forward is paid only by objectives that need it (P3O's ESS)."""
    uses = getattr(objective, "uses_minibatch_statistics", None)  # a wrapped callable (tests, the lab) has none
    if len(chunks) < 2 or uses is None or not uses():
        return None
    parts = []
    for rows in chunks:
        logp, _, mask, width = forward_rows(policy, batch, rows, temperature, timings=timings,
                                            timing_key="stats_forward_s", padding_free=padding_free)
        parts.append(objective.minibatch_statistics(rows_policy_batch(batch, rows, logp, mask, width, **batch_fields)))
    return sum_statistics(parts)


def microbatch_loss(policy, objective, batch: TrainBatch, rows: Tensor, *, temperature: float, num_tokens: Tensor,
                    num_sequences: int, max_completion_len: int, state: RunState, with_entropy: bool,
                    rollout_step: int | None = None, sampler_is_behaviour: bool = True,
                    timings: dict | None = None, minibatch_stats: dict | None = None, padding_free: bool = True):
    """Forward the ``rows`` of the batch, evaluate the objective (aggregated with the minibatch's counts; with the
    minibatch's statistics when given) and backpropagate. Returns (loss, metrics, valid tokens, the rows' log-probs
    [rows, width] detached, width)."""
    logp, entropy, mask, width = forward_rows(policy, batch, rows, temperature, with_entropy, timings,
                                              padding_free=padding_free)
    out = objective(rows_policy_batch(
        batch, rows, logp, mask, width, num_tokens=num_tokens, num_sequences=num_sequences,
        max_completion_len=max_completion_len, state=state, rollout_step=rollout_step,
        sampler_is_behaviour=sampler_is_behaviour, minibatch_stats=minibatch_stats))
    start = time.perf_counter()
    out.loss.backward()
    if timings is not None:
        timings["backward_s"] = timings.get("backward_s", 0.0) + time.perf_counter() - start
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
    behaviour log-probs are the sampler's). ``timings`` (optional) accumulates seconds (CPU clock; on a GPU they
    count launch, not kernel, time): ``logp_forward_s`` (the loss passes' forwards), ``stats_forward_s`` (P3O's
    statistics pass), ``backward_s``, ``optimizer_s`` (clipping + AdamW); the rest of the update is the objective,
    the metrics and the bookkeeping.
    The objective gets the sampler's log-probs (``PolicyBatch.sampler_logp``, TBPO's mismatch weight) only when
    they are not the behaviour log-probs and no rollout correction (``batch.correction``) accounts for them."""
    t = cfg.train
    ro = batch.rollout
    n = len(ro.texts)
    per_minibatch = n // t.num_minibatches
    micro = t.micro_batch_size or per_minibatch
    generator = torch.Generator().manual_seed(step_seed(cfg.seed, step, stream=1))
    meter, mismatch = MetricMeter(), MismatchMeter()
    params = [p for p in policy.parameters() if p.requires_grad]
    sampler_behaviour = behaviour_logp(t) == "sampler"
    policy.train()
    for epoch in range(t.epochs):
        order = minibatch_order(n, t.group_size, per_minibatch, generator)
        for k in range(t.num_minibatches):
            index = order[k * per_minibatch : (k + 1) * per_minibatch]
            num_tokens = ro.completion_mask[index].sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss = 0.0
            chunks = [index[j : j + micro] for j in range(0, per_minibatch, micro)]
            fields = dict(num_tokens=num_tokens, num_sequences=per_minibatch, max_completion_len=t.max_new_tokens,
                          state=state, rollout_step=step - 1,
                          sampler_is_behaviour=sampler_behaviour or batch.correction is not None)
            stats = minibatch_statistics(policy, objective, batch, chunks, temperature=t.temperature,
                                         padding_free=t.padding_free, timings=timings, **fields)
            for rows in chunks:
                part, metrics, tokens, logp, width = microbatch_loss(
                    policy, objective, batch, rows, temperature=t.temperature, with_entropy=epoch == 0,
                    timings=timings, minibatch_stats=stats, padding_free=t.padding_free, **fields)
                if epoch == 0 and k == 0 and sampler_behaviour:
                    mismatch.add(ro.sampler_logp[rows, :width], logp, ro.completion_mask[rows, :width])
                loss += part
                meter.add(metrics, tokens)
            start = time.perf_counter()
            grad_norm = optimizer_step(params, optimizer, scheduler, loss, t.max_grad_norm, state)
            if timings is not None:
                timings["optimizer_s"] = timings.get("optimizer_s", 0.0) + time.perf_counter() - start
            meter.add({"loss": loss, "grad_norm": grad_norm}, 1.0)
    return {**meter.result(), **mismatch.result()}
