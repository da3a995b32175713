"""Per-step metric bookkeeping shared by both backends: combining micro-batch metrics, the sampler/trainer
mismatch, peak memory."""

from __future__ import annotations

import math
import resource
import sys
from collections import defaultdict

import torch

from objectives.base import MINIBATCH_SHARES
from objectives.rollout_correction import SAFETY_BOUND


class MetricMeter:
    """Combines metrics over micro-batches and minibatches: *_min by min, *_max by max, the rest by a weighted
    mean (weights: tokens, or 1 per optimizer step). A micro-batch's share of its optimizer step's value (``shares``:
    :meth:`objectives.base.Objective.minibatch_shares`, e.g. ``pg_loss``) is not a mean over the micro-batch: with
    ``step_tokens`` (the valid tokens of the micro-batch's whole optimizer step) it adds the value with weight
    ``weight / step_tokens`` (the micro-batch's fraction of its step), so that the result is the mean over optimizer
    steps of their values (the sums of their micro-batches' shares), as ``loss`` is, whatever the micro-batching."""

    def __init__(self, shares: frozenset[str] = MINIBATCH_SHARES):
        self.sums, self.weights, self.extremes = defaultdict(float), defaultdict(float), {}
        self.shares = shares  # the objective's (Objective.minibatch_shares)

    def add(self, metrics: dict[str, float], weight: float, step_tokens: float | None = None) -> None:
        for key, value in metrics.items():
            if key.endswith("_min") or key.endswith("_max"):
                pick = min if key.endswith("_min") else max
                self.extremes[key] = pick(self.extremes.get(key, value), value)
            elif math.isfinite(value):
                fraction = weight / step_tokens if step_tokens and key in self.shares else None
                self.sums[key] += value if fraction is not None else value * weight
                self.weights[key] += weight if fraction is None else fraction

    def result(self) -> dict[str, float]:
        return {**{k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k]}, **self.extremes}


class MismatchMeter:
    """Between the behaviour log-probs (the sampler's: another precision, an older policy version, or both) and the
    trainer's before the update (the proximal policy), over the valid tokens added: the mean |sampler - trainer
    log-prob| (``mismatch_logp_abs``), the k3 estimate of KL(behaviour || proximal) (``mismatch_kl``), and with
    ``ess`` the normalised effective sample size of the importance weights w = pi_trainer / pi_sampler,
    (sum w)^2 / (n sum w^2) in (0, 1] (``mismatch_ess``; 1: equal weights; log w clamped to +-20 as
    objectives/rollout_correction.py's metrics)."""

    def __init__(self, ess: bool = False):
        self.abs_sum, self.kl_sum, self.tokens = 0.0, 0.0, 0.0
        self.ess, self.weight_sum, self.square_sum = ess, 0.0, 0.0

    def add(self, sampler_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> None:
        diff = torch.where(mask, trainer_logp - sampler_logp, torch.zeros_like(trainer_logp))
        self.abs_sum += diff.abs().sum().item()
        self.kl_sum += torch.where(mask, diff.exp() - 1 - diff, torch.zeros_like(diff)).sum().item()
        self.tokens += mask.sum().item()
        if self.ess:
            weight = torch.where(mask, diff.double().clamp(-SAFETY_BOUND, SAFETY_BOUND).exp(), 0.0)
            self.weight_sum += weight.sum().item()
            self.square_sum += weight.square().sum().item()

    def result(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        ess = {"mismatch_ess": self.weight_sum**2 / (self.tokens * self.square_sum)} if self.ess else {}
        return {"mismatch_logp_abs": self.abs_sum / self.tokens, "mismatch_kl": self.kl_sum / self.tokens, **ess}


STATUS, CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"  # Linux: VmHWM, and its reset (write "5")


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated CUDA memory on a GPU (since :func:`reset_peak_memory`), the process's peak resident set size
    on the CPU (MiB): Linux's VmHWM, which :func:`reset_peak_memory` resets; elsewhere ``ru_maxrss``, the peak of the
    process's whole life."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open(STATUS) as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB elsewhere
        return peak / (2**20 if sys.platform == "darwin" else 2**10)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for :func:`peak_memory_mb`: CUDA's peak statistics, or the process's VmHWM (Linux: set to the
    current resident set size; where the kernel does not allow it the peak stays the process's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open(CLEAR_REFS, "w") as clear:
            clear.write("5")
    except OSError:
        pass


class PhaseMemory:
    """Peak memory of each phase of a step (``peak_mem_<phase>_mb``: the rollout, the update, the evaluation) and of
    the step's rollout and update (``peak_mem_mb``, the largest). A phase runs from its :meth:`start` to the next
    phase's start or :meth:`metrics`. On the CPU a phase's peak is the process's resident set size at its highest
    in the phase, so it includes what earlier phases left allocated (weights, optimizer state, and the heap
    harness/run/allocator.py keeps for reuse)."""

    def __init__(self, device: torch.device):
        self.device, self.peaks, self.current = device, {}, None

    def start(self, phase: str) -> None:
        self.stop()
        reset_peak_memory(self.device)
        self.current = phase

    def stop(self) -> None:
        if self.current is not None:
            self.peaks[self.current] = max(self.peaks.get(self.current, 0.0), peak_memory_mb(self.device))
            self.current = None

    def metrics(self, total: bool = True) -> dict[str, float]:
        """``peak_mem_<phase>_mb`` of the phases run, and with ``total`` their largest as ``peak_mem_mb``."""
        self.stop()
        peaks = {f"peak_mem_{name}_mb": mb for name, mb in self.peaks.items()}
        return {**peaks, "peak_mem_mb": max(self.peaks.values())} if total and peaks else peaks


def progress_fields(row: dict, rows: list[dict]) -> dict[str, str]:
    """What a progress bar shows beside the step: the step's reward and clip fraction, the last eval accuracy;
    rewards and accuracies with 3 decimals, the clip fraction (often 1e-4) with 3 significant digits."""
    evals = [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]
    fields = {"reward": (row.get("reward_mean"), ".3f"), "clip": (row.get("clip_frac"), ".3g"),
              "eval": (evals[-1] if evals else None, ".3f")}
    return {k: format(v, spec) for k, (v, spec) in fields.items() if v is not None}
