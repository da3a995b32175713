"""A step's behaviour side, before the update: where the behaviour (old) log-probs come from, the reference
log-probs of a KL term, and the rollout-correction weights between the trainer's old policy and the sampler.

    behaviour = behaviour_logprobs(policy, reference, ro, cfg, separate_sampler)   # the native loop's stage 3

:func:`behaviour_logp`, :func:`correction_settings` and :func:`rollout_correction` are the TRL backend's too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from harness.loop.metrics import MismatchMeter
from harness.policy.forward import completion_logprobs
from harness.policy.sampler import Rollout
from harness.run.config import microbatch_size
from objectives.rollout_correction import DEFAULT_THRESHOLD, correction_metrics, correction_weights


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


@dataclass(frozen=True)
class Behaviour:
    """The per-token inputs of a step's update besides the current policy's log-probs."""

    old_logp: Tensor  # [N, T] the behaviour log-probs: the sampler's, or the trainer's recomputed
    ref_logp: Tensor | None  # [N, T] the frozen reference's (a KL term), else None
    correction: Tensor | None  # [N, T] the rollout-correction weights, else None
    metrics: dict  # the recomputation's mismatch with the sampler, the correction's statistics


def behaviour_logprobs(policy, reference, ro: Rollout, cfg: DictConfig, separate_sampler: bool) -> Behaviour:
    """The behaviour log-probs (``train.old_logp``; always recomputed with a rollout correction), the reference's
    (``reference`` None: no KL term) and the correction's weights. ``separate_sampler``: the rollout came from a
    copy of the policy in another precision (``model.sampler_dtype``), whose log-probs the correction weighs against
    the trainer's; else the sampler is the policy and every weight is 1."""
    t = cfg.train
    old_logp, metrics = ro.sampler_logp, {}
    if behaviour_logp(t) == "recompute":
        old_logp = no_grad_logprobs(policy, ro, t)
        meter = MismatchMeter()
        meter.add(ro.sampler_logp, old_logp, ro.completion_mask)
        metrics = meter.result()
    correction, correction_stats = rollout_correction(
        t, old_logp, ro.sampler_logp if separate_sampler else None, ro.completion_mask)
    ref_logp = None if reference is None else no_grad_logprobs(reference, ro, t)
    return Behaviour(old_logp, ref_logp, correction, {**metrics, **correction_stats})


@torch.no_grad()
def no_grad_logprobs(model, ro: Rollout, t: DictConfig) -> Tensor:
    """Completion log-probs of the whole rollout under ``model``, one micro-batch (``train.micro_batch_size``) of
    rows at a time, at ``train.temperature``, through the run's forward (``train.padding_free``)."""
    chunk = microbatch_size(t)
    return torch.cat([completion_logprobs(model, ro.prompt_ids[i : i + chunk], ro.prompt_mask[i : i + chunk],
                                          ro.completion_ids[i : i + chunk], ro.completion_mask[i : i + chunk],
                                          t.temperature, padding_free=t.padding_free)[0]
                      for i in range(0, len(ro.texts), chunk)])
