"""The update's parts, as data: what every minibatch loss of a step needs is one value (:class:`UpdatePlan`, made
once per step), a minibatch another (:class:`Minibatch`), the policy being trained with its objective, optimizer
and schedule a third (:class:`Learner`). The native loop (harness/loop/native.py's ``update``) runs them:

    for epoch in range(plan.epochs):
        for minibatch in minibatches(plan, generator):           # whole groups stay together when they fit
            minibatch = with_statistics(learner, plan, minibatch, state)   # P3O's statistics, when micro-batched
            for rows in plan.microbatches(minibatch):
                part = microbatch_loss(learner, plan, minibatch, rows, state)  # forward, objective, backward
            grad_norm = optimizer_step(learner, loss, plan.max_grad_norm, state)  # clip, skip if non-finite, step

A minibatch is summed over micro-batches with the minibatch's global token and sequence counts, so its gradient is
exactly the minibatch objective's whatever the micro-batch size.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import Tensor

from harness.loop.batch import TrainBatch
from harness.policy.expert_volatility import Volatility, capture_metrics
from harness.policy.forward import completion_forward, evaluating
from harness.policy.routing import routing_of
from harness.run.config import microbatch_size, minibatch_size, updates_per_step
from harness.run.offpolicy import behaviour_logp, lagged, replay_mode
from harness.run.seeding import step_seed
from objectives import OBJECTIVES, Objective, PolicyBatch
from objectives.base import group_totals, sum_statistics


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

    @classmethod
    def resumed(cls, checkpoint: dict | None, t: DictConfig) -> RunState:
        """The counters a checkpoint saved (a fresh run's without one), with this run's optimizer-step total."""
        fields = {f.name for f in dataclasses.fields(cls)}
        state = cls(**{k: v for k, v in checkpoint["state"].items() if k in fields}) if checkpoint else cls()
        state.total_optimizer_steps = t.steps * updates_per_step(t)
        return state


@dataclass
class Timings:
    """Seconds of the update's phases (CPU clock; on a GPU they count launch, not kernel, time), each None until it
    runs: the loss passes' forwards, P3O's statistics pass, the backward passes, clipping + the optimizer step. The
    rest of the update is the objective, the metrics and the bookkeeping."""

    logp_forward_s: float | None = None
    stats_forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        yield
        setattr(self, phase, (getattr(self, phase) or 0.0) + time.perf_counter() - start)

    def metrics(self) -> dict[str, float]:
        """The phases that ran, as the metrics row's ``update_<phase>`` keys."""
        return {f"update_{k}": v for k, v in dataclasses.asdict(self).items() if v is not None}


@contextmanager
def timed(timings: Timings | None, phase: str):
    """``timings.timed(phase)``, or nothing without timings."""
    if timings is None:
        yield
    else:
        with timings.timed(phase):
            yield


@dataclass(frozen=True)
class Learner:
    """The policy being trained, its objective, optimizer and learning-rate schedule."""

    policy: torch.nn.Module
    objective: Objective  # a registered objective (a test double subclasses Objective)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


@dataclass(frozen=True)
class UpdatePlan:
    """What every minibatch loss of one rollout step needs, made once per step (:meth:`of`)."""

    batch: TrainBatch  # rollout, rewards, advantages, groups; behaviour / reference log-probs; correction weights
    epochs: int  # passes over the batch
    minibatch_size: int  # sequences per optimizer step (the objective's sequence count)
    microbatch_size: int  # sequences per forward/backward
    group_size: int  # minibatches keep groups whole when they hold whole groups
    temperature: float  # divides the trainer's logits, as the sampler's
    padding_free: bool  # the trainer's forward skips completion padding (harness/policy/forward.py)
    max_completion_len: int  # the objective's L (Dr. GRPO's constant normaliser, ...)
    max_grad_norm: float
    rollout_step: int | None  # the rollout step (from 0) for objectives' schedules; None: not in a run
    behaviour: str  # where batch.old_logp came from: "sampler" or "recompute" (harness/loop/behaviour.py)
    order_seed: int  # the random stream of the minibatch order
    timings: Timings | None = None
    replay: bool = False  # force batch.routing's experts in every forward of the update (train.routing_replay)
    max_tokens_per_micro_batch: int = 0  # micro-batches packed to this many tokens instead of microbatch_size rows
    micro_batch_unit: int = 1  # rows a token-budget micro-batch keeps together (a group, for group objectives)
    lagged: bool = False  # train.rollout_lag > 0: the sampler/trainer mismatch also reports the weights' ESS

    def microbatches(self, minibatch: Minibatch) -> list[Tensor]:
        """The minibatch's micro-batches: ``microbatch_size`` rows each, or with ``max_tokens_per_micro_batch``
        consecutive rows up to that many real prompt + completion tokens (:func:`token_budget_chunks`), whole groups
        for objectives that compare a group's samples. Any split gives the minibatch's loss and gradient: every
        micro-batch is normalised by the minibatch's counts (:class:`Minibatch`)."""
        if not self.max_tokens_per_micro_batch:
            return minibatch.chunks(self.microbatch_size)
        ro, rows = self.batch.rollout, minibatch.rows
        tokens = ro.prompt_mask[rows].sum(-1) + ro.completion_mask[rows].sum(-1)
        return token_budget_chunks(rows, tokens, self.max_tokens_per_micro_batch, self.micro_batch_unit)

    @classmethod
    def of(cls, batch: TrainBatch, cfg: DictConfig, step: int, timings: Timings | None = None) -> UpdatePlan:
        """The plan of rollout step ``step`` of a run."""
        t = cfg.train
        return cls(batch=batch, epochs=t.epochs, minibatch_size=minibatch_size(t), microbatch_size=microbatch_size(t),
                   group_size=t.group_size, temperature=t.temperature, padding_free=t.padding_free,
                   max_completion_len=t.max_new_tokens, max_grad_norm=t.max_grad_norm, rollout_step=step - 1,
                   behaviour=behaviour_logp(t), order_seed=step_seed(cfg.seed, step, stream=1), timings=timings,
                   replay=replay_mode(t) != "none", max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
                   micro_batch_unit=t.group_size if OBJECTIVES.get(cfg.objective.name).needs_whole_groups else 1,
                   lagged=lagged(t))


@dataclass(frozen=True)
class Minibatch:
    """The rows of one optimizer step and what their loss is normalised by."""

    rows: Tensor  # row indices into the batch
    num_tokens: Tensor  # their valid tokens (>= 1): every micro-batch's token-mean denominator
    stats: dict | None = None  # the objective's minibatch statistics (P3O); None: each micro-batch's own
    group_tokens: Tensor | None = None  # [batch rows] each of its rows' group's valid tokens among its rows, and ...
    num_groups: int | None = None  # ... its groups: prompt_mean's normalisers; None: each micro-batch's own

    def chunks(self, size: int) -> list[Tensor]:
        """The micro-batches: ``size`` rows each."""
        return [self.rows[j : j + size] for j in range(0, len(self.rows), size)]


def token_budget_chunks(rows: Tensor, tokens: Tensor, budget: int, unit: int = 1) -> list[Tensor]:
    """``rows`` in order, cut into runs of ``unit`` rows (a group), packed greedily into chunks of at most ``budget``
    tokens (``tokens`` per row): a chunk closes when the next run would take it over; a run over the budget alone
    is a chunk of its own (verl's dynamic batch size, ``ppo_max_token_len_per_gpu``, in order)."""
    runs = [(rows[j : j + unit], int(tokens[j : j + unit].sum())) for j in range(0, len(rows), unit)]
    chunks, current, filled = [], [], 0
    for run, size in runs:
        if current and filled + size > budget:
            chunks.append(torch.cat(current))
            current, filled = [], 0
        current.append(run)
        filled += size
    return chunks + [torch.cat(current)] if current else chunks


def minibatch_order(n: int, group_size: int, per_minibatch: int, generator: torch.Generator) -> Tensor:
    """A random order of the ``n`` rows; groups stay whole (and contiguous) when a minibatch holds whole groups,
    as group-contrastive objectives need."""
    if per_minibatch % group_size == 0:
        groups = torch.randperm(n // group_size, generator=generator)
        return (groups[:, None] * group_size + torch.arange(group_size)).flatten()
    return torch.randperm(n, generator=generator)


def minibatches(plan: UpdatePlan, generator: torch.Generator) -> Iterator[Minibatch]:
    """One pass over the batch: its rows in a random order (:func:`minibatch_order`), ``plan.minibatch_size`` each."""
    mask, size = plan.batch.rollout.completion_mask, plan.minibatch_size
    order = minibatch_order(len(mask), plan.group_size, size, generator)
    for k in range(len(mask) // size):
        rows = order[k * size : (k + 1) * size]
        tokens = mask[rows].sum(-1)
        per_row, groups = group_totals(tokens, plan.batch.group_ids[rows])
        yield Minibatch(rows, tokens.sum().clamp(min=1), group_tokens=tokens.new_zeros(len(mask)).index_copy_(
            0, rows, per_row), num_groups=groups)


@dataclass(frozen=True)
class RowsForward:
    """The current policy on some rows: log-probs (and entropies) of their completions, all-padding columns dropped."""

    rows: Tensor
    logp: Tensor  # [rows, width]
    entropy: Tensor | None  # [rows, width], or None
    mask: Tensor  # [rows, width]
    width: int
    volatility: Volatility | None = None  # an MoE's live routing vs the behaviour routing (batch.routing)
    routing_metrics: dict = dataclasses.field(default_factory=dict)  # its expert-load entropy and router aux loss
    hidden: Tensor | None = None  # [rows, width, hidden] final hidden states, when the objective reads them


def forward_rows(policy, plan: UpdatePlan, rows: Tensor, with_entropy: str = "",
                 phase: str = "logp_forward_s", with_hidden: bool = False) -> RowsForward:
    """The current policy's log-probs (and entropies: ``with_entropy`` "value", or "gradient" for an entropy bonus)
    of the ``rows``' completions, all-padding columns dropped (``plan.padding_free``: the rest of the padding too),
    timed as ``phase``. An MoE with a behaviour routing (``batch.routing``): its slice for these rows is forced
    (``plan.replay``) and compared with the live routing."""
    ro = plan.batch.rollout
    width = int(ro.completion_mask[rows].sum(-1).max())  # drop all-padding columns
    mask = ro.completion_mask[rows, :width]
    routing, record = routing_of(policy), plan.batch.routing
    behaviour = None if routing is None or record is None else record.select(rows, width)
    with timed(plan.timings, phase), (nullcontext() if behaviour is None else routing.capture(
            behaviour.grid, replay=behaviour if plan.replay else None, router_logits=True)) as capture:
        logp, entropy, hidden = completion_forward(policy, ro.prompt_ids[rows], ro.prompt_mask[rows],
                                                   ro.completion_ids[rows, :width], mask, plan.temperature,
                                                   with_entropy=with_entropy, padding_free=plan.padding_free)
    if with_hidden:  # [n, hidden] at the valid positions -> [rows, width, hidden], 0 on padding
        hidden = hidden.new_zeros(*mask.shape, hidden.shape[-1]).masked_scatter(mask.bool()[..., None], hidden)
    moe = () if capture is None else capture_metrics(behaviour, capture)
    return RowsForward(rows, logp, entropy, mask, width, *moe, hidden=hidden if with_hidden else None)


def hidden_of(plan: UpdatePlan, rows: Tensor) -> Callable[[torch.nn.Module], Tensor]:
    """model -> its final hidden states on the ``rows``' completions [rows, width, hidden], without gradient (an
    objective's own copy of the policy: ``PolicyBatch.hidden_of``)."""

    @torch.no_grad()
    def forward(model: torch.nn.Module) -> Tensor:
        return forward_rows(model, dataclasses.replace(plan, timings=None), rows, with_hidden=True).hidden

    return forward


def policy_batch(plan: UpdatePlan, minibatch: Minibatch, forward: RowsForward, state: RunState) -> PolicyBatch:
    """The objective's input for the rows of ``forward``: their current log-probs; the old log-probs (the behaviour's,
    or the proximal's with the behaviour's as ``sampler_logp``), reference log-probs, rollout-correction weights,
    advantages, rewards and groups; the minibatch's counts and statistics."""
    batch, rows, width = plan.batch, forward.rows, forward.width
    return PolicyBatch(
        logp=forward.logp, old_logp=batch.old_logp[rows, :width], mask=forward.mask,
        advantages=batch.advantages[rows] if batch.advantages.dim() == 1 else batch.advantages[rows, :width],
        rewards=batch.rewards[rows], group_ids=batch.group_ids[rows],
        ref_logp=None if batch.ref_logp is None else batch.ref_logp[rows, :width],
        step=state.optimizer_steps, total_steps=state.total_optimizer_steps,
        max_completion_len=plan.max_completion_len, num_tokens=minibatch.num_tokens,
        num_sequences=plan.minibatch_size, rollout_step=plan.rollout_step, num_groups=minibatch.num_groups,
        group_tokens=None if minibatch.group_tokens is None else minibatch.group_tokens[rows],
        sampler_logp=None if plan.behaviour == "sampler" else batch.rollout.sampler_logp[rows, :width],
        correction=None if batch.correction is None else batch.correction[rows, :width],
        behaviour_corrected=batch.correction is not None,
        minibatch_stats=minibatch.stats, entropy=forward.entropy, hidden=forward.hidden,
        hidden_of=None if forward.hidden is None else hidden_of(plan, rows))


@torch.no_grad()
def with_statistics(learner: Learner, plan: UpdatePlan, minibatch: Minibatch, state: RunState) -> Minibatch:
    """``minibatch`` with the objective's ``minibatch_statistics`` summed over its micro-batches, from a no-grad forward
    of the current policy (the first of two passes; the same rows and widths as the loss pass, so the same log-probs;
    in eval mode: under LoRA dropout the policy's own, where the loss pass draws its dropout). Unchanged when the
    objective has no such hook or the minibatch is one micro-batch (it then computes them from its batch): the extra
    forward is paid only by objectives that need it (P3O's ESS)."""
    chunks = plan.microbatches(minibatch)
    if len(chunks) < 2 or not learner.objective.uses_minibatch_statistics():
        return minibatch
    with evaluating(learner.policy):  # the policy's statistics, not one draw of its (LoRA) dropout
        parts = [learner.objective.minibatch_statistics(policy_batch(
            plan, minibatch, forward_rows(learner.policy, plan, rows, phase="stats_forward_s"), state))
            for rows in chunks]
    return dataclasses.replace(minibatch, stats=sum_statistics(parts))


@dataclass(frozen=True)
class MicrobatchLoss:
    loss: float  # this micro-batch's part of the minibatch loss
    metrics: dict  # the objective's metrics (and the entropy)
    tokens: int  # valid tokens: the metrics' weight
    forward: RowsForward  # its log-probs, detached


def microbatch_loss(learner: Learner, plan: UpdatePlan, minibatch: Minibatch, rows: Tensor, state: RunState,
                    with_entropy: bool = False) -> MicrobatchLoss:
    """Forward the ``rows`` of the minibatch, evaluate the objective (aggregated with the minibatch's counts and
    statistics) and backpropagate. The entropy is computed for the metric (``with_entropy``) or when the objective
    asks for it (``entropy_need``: top-entropy masking, or with gradient an entropy bonus)."""
    need = learner.objective.entropy_need()
    forward = forward_rows(learner.policy, plan, rows, need or ("value" if with_entropy else ""),
                           with_hidden=learner.objective.needs_hidden_states)
    out = learner.objective(policy_batch(plan, minibatch, forward, state))
    with timed(plan.timings, "backward_s"):
        out.loss.backward()
    tokens = forward.mask.sum().item()
    metrics = {**out.metrics, **forward.routing_metrics}
    if with_entropy:
        metrics["entropy"] = (forward.entropy.detach() * forward.mask).sum().item() / max(tokens, 1)
    detached = dataclasses.replace(forward, logp=forward.logp.detach(), hidden=None,
                                   entropy=None if forward.entropy is None else forward.entropy.detach())
    return MicrobatchLoss(out.loss.item(), metrics, tokens, detached)


def optimizer_step(learner: Learner, loss: float, max_grad_norm: float, state: RunState,
                   metrics: dict[str, float]) -> float:
    """Clip the gradient norm and step, unless the loss or the gradient is non-finite: then drop the gradient and
    count the skip; after an applied step, the objective's ``after_optimizer_step`` with the step's ``metrics`` (its
    micro-batches' metrics, token-weighted). Returns the gradient norm before clipping."""
    params = [p for p in learner.policy.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    state.optimizer_steps += 1
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        learner.optimizer.zero_grad(set_to_none=True)
        state.nonfinite_skips += 1
        state.nonfinite_in_row += 1
        return grad_norm
    state.nonfinite_in_row = 0
    learner.optimizer.step()
    learner.scheduler.step()
    learner.objective.after_optimizer_step(learner.policy, metrics)  # e.g. an EMA copy, an adaptive coefficient
    return grad_norm
