"""A step's behaviour side, before the update: where the behaviour (old) log-probs come from, the reference
log-probs of a KL term, the rollout-correction weights between the trainer's old policy and the sampler, and a
Mixture-of-Experts policy's behaviour routing (what ``train.routing_replay`` forces in the update).

    behaviour = behaviour_logprobs(policy, reference, ro, cfg, separate_sampler)   # the native loop's stage 3

:func:`rollout_correction` is the TRL backend's too; what the settings say (where the behaviour log-probs come from,
the correction's and replay's settings) is read in harness/run/offpolicy.py.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from harness.loop.metrics import MismatchMeter
from harness.policy.expert_volatility import expert_volatility
from harness.policy.forward import SUM_PI_SQUARED, completion_logprobs, evaluating
from harness.policy.lora import adapters_disabled
from harness.policy.routing import Grid, RoutingRecord, routing_of, select_record_rows
from harness.policy.sampler import Rollout
from harness.run.config import microbatch_size
from harness.run.offpolicy import (
    behaviour_logp,
    correction_on,
    correction_settings,
    lagged,
    rejection_settings,
    replay_mode,
)
from objectives import OBJECTIVES
from objectives.rollout_correction import (
    correction_metrics,
    correction_weights,
    rejection_keep,
    rejection_metrics,
)


def routing_recorded_at(t: DictConfig, moe: bool) -> str | None:
    """Where an MoE run records the behaviour routing (what replay forces, what expert volatility compares the
    update's routing with): 'sampler' (R3; without replay when the behaviour log-probs are the native sampler's),
    'recompute' (R2; without replay when the behaviour log-probs are recomputed), None (a dense model, or no replay
    with a sampler whose routing cannot be recorded: then no volatility; so in flight, where a batch's completions
    are continued by several versions, lest only the batches sampled whole log it)."""
    if not moe:
        return None
    if replay_mode(t) == "r3":
        return "sampler"
    if behaviour_logp(t) == "recompute":
        return "recompute"
    in_flight = OmegaConf.select(t, "in_flight_tokens", default=0)
    return "sampler" if t.sampler == "native" and not t.compile_sampler and not in_flight else None


def rollout_correction(t: DictConfig, old_logp: Tensor, sampler_logp: Tensor | None, mask: Tensor,
                       ratio_level: str = "token") -> tuple[Tensor | None, dict[str, float]]:
    """The rollout-correction weights [N, T] of a batch and their metrics (objectives/rollout_correction.py), or
    (None, {}) with ``mode: none``. ``sampler_logp`` None: there is no sampler difference (one model in one
    precision samples and trains, and no older version sampled: the decode path's round-off is not a different
    policy), so the sampler's log-probs are the trainer's and every weight is exactly 1. ``ratio_level``: the
    objective's (``Objective.ratio_level``), the level of mode decoupled_ppo's weight."""
    mode, threshold, lower = correction_settings(t)
    rules, bounds = rejection_settings(t)
    if not correction_on(t):
        return None, {}
    sampler_logp = old_logp if sampler_logp is None else sampler_logp
    weights = correction_weights(old_logp, sampler_logp, mask, mode, threshold, lower, ratio_level)
    keep = rejection_keep(old_logp, sampler_logp, mask, rules, bounds) if rules else None
    weights = weights if keep is None else weights * keep  # trust-region masking: the rules' dropped tokens get 0
    metrics = correction_metrics(old_logp, sampler_logp, mask, mode, threshold, lower, weights=weights,
                                 ratio_level=ratio_level)
    return weights, metrics if keep is None else {**metrics, **rejection_metrics(keep, mask)}


@dataclass(frozen=True)
class Behaviour:
    """The per-token inputs of a step's update besides the current policy's log-probs."""

    old_logp: Tensor  # [N, T] the objective's old log-probs: the behaviour's (the sampler's), or the proximal policy's
    #   (the trainer's before this step's update, recomputed)
    ref_logp: Tensor | None  # [N, T] the frozen reference's (a KL term), else None
    correction: Tensor | None  # [N, T] the rollout-correction weights, else None
    metrics: dict  # the recomputation's mismatch with the sampler (and routing's), the correction's statistics
    routing: RoutingRecord | None = None  # an MoE's behaviour routing on [prompt | completion] (routing_recorded_at)
    sum_pi_squared: Tensor | None = None  # [N, T] sum_v pi_v^2 under the trainer's old policy (with_sum_pi_squared)
    trainer_logp: Tensor | None = None  # [N, T] the trainer's old log-probs of that same forward, else None


def behaviour_logprobs(policy, reference, ro: Rollout, cfg: DictConfig, separate_sampler: bool,
                       with_sum_pi_squared: bool = False) -> Behaviour:
    """The objective's old log-probs (``train.old_logp``: the behaviour's, the sampler's; or the proximal policy's,
    recomputed, always with a rollout correction), the reference's (``reference`` None: no KL term) and the
    correction's weights. ``separate_sampler``: the rollout came from another policy than the trainer's (a copy in
    another precision, ``model.sampler_dtype``; an older version, ``train.rollout_lag``; or both), whose log-probs the
    correction weighs against the proximal's; else the sampler is the policy and every weight is 1. With
    ``train.rollout_lag`` the recomputation's mismatch metrics include the weights' effective sample size
    (``mismatch_ess``). ``with_sum_pi_squared`` (an advantage
    estimator that reads it: ``objectives.advantages.needs_sum_pi_squared``): also sum_v pi_v^2 and the trainer's
    log-probs from a no-grad forward of the trainer's old policy, the recomputation's when there is one, else one
    extra forward (the behaviour log-probs stay ``train.old_logp``'s)."""
    t = cfg.train
    old_logp, metrics, routing, sum_pi_squared, trainer_logp = ro.sampler_logp, {}, ro.routing, None, None
    if behaviour_logp(t) == "recompute":
        replay = ro.routing if replay_mode(t) == "r3" else None  # R3: the sampler's routing, forced here too
        old_logp, recorded, sum_pi_squared = no_grad_logprobs(policy, ro, t, record=routing_of(policy) is not None,
                                                              replay=replay, sum_pi_squared=with_sum_pi_squared)
        trainer_logp = old_logp if with_sum_pi_squared else None
        meter = MismatchMeter(ess=lagged(t))
        meter.add(ro.sampler_logp, old_logp, ro.completion_mask)
        metrics = meter.result()
        if replay is not None:  # the trainer's own routing where R3 forces the sampler's
            metrics.update({f"recompute_{k}": v for k, v in expert_volatility(replay, recorded).metrics().items()})
        elif recorded is not None:
            routing = recorded
    elif with_sum_pi_squared:
        trainer_logp, _, sum_pi_squared = no_grad_logprobs(policy, ro, t, sum_pi_squared=True)
    correction, correction_stats = rollout_correction(
        t, old_logp, ro.sampler_logp if separate_sampler else None, ro.completion_mask,
        OBJECTIVES.get(cfg.objective.name).ratio_level)
    ref_logp = None
    if reference is not None:
        with adapters_disabled(reference):  # a LoRA policy as its own reference: its base, the starting policy
            ref_logp = no_grad_logprobs(reference, ro, t)[0]
    return Behaviour(old_logp, ref_logp, correction, {**metrics, **correction_stats}, routing, sum_pi_squared,
                     trainer_logp)


@torch.no_grad()
def no_grad_logprobs(model, ro: Rollout, t: DictConfig, record: bool = False, replay: RoutingRecord | None = None,
                     sum_pi_squared: bool = False) -> tuple[Tensor, RoutingRecord | None, Tensor | None]:
    """Completion log-probs of the whole rollout under ``model``, one micro-batch (``train.micro_batch_size``) of
    rows at a time, at ``train.temperature``, through the run's forward (``train.padding_free``); with ``record``
    (an MoE with its routing hooks) also the routing of the rollout's real tokens on its [prompt | completion] grid,
    forcing ``replay``'s (R3) when given (else None); with ``sum_pi_squared`` also sum_v pi_v^2 [N, T] (else None)."""
    chunk, rows = microbatch_size(t), len(ro.texts)
    grid = Grid(chunk, ro.prompt_ids.shape[1] + ro.completion_ids.shape[1], ro.prompt_ids.shape[1])
    parts, squares, records = [], [], []
    with evaluating(model):  # the policy's log-probs, not one draw of its (LoRA) dropout
        for i in range(0, rows, chunk):
            part = torch.arange(i, min(i + chunk, rows))
            with (routing_of(model).capture(dataclasses.replace(grid, rows=len(part)),
                                            replay=None if replay is None else replay.select(part))
                  if record or replay is not None else nullcontext()) as capture:
                logp, square = completion_logprobs(model, ro.prompt_ids[part], ro.prompt_mask[part],
                                                   ro.completion_ids[part], ro.completion_mask[part], t.temperature,
                                                   with_entropy=SUM_PI_SQUARED if sum_pi_squared else False,
                                                   padding_free=t.padding_free)
            parts.append(logp)
            squares += [square] if sum_pi_squared else []
            records += [] if capture is None else [capture.record]
    joined = select_record_rows(records, [(k, j) for k, r in enumerate(records) for j in range(r.grid.rows)]) \
        if records else None
    return torch.cat(parts), joined, torch.cat(squares) if sum_pi_squared else None

