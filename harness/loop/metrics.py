"""Per-step metric bookkeeping shared by both backends: combining micro-batch metrics, the sampler/trainer
mismatch, peak memory."""

from __future__ import annotations

import math
import resource
from collections import defaultdict

import torch


class MetricMeter:
    """Combines metrics over micro-batches and minibatches: *_min by min, *_max by max, the rest by a weighted
    mean (weights: tokens, or 1 per optimizer step)."""

    def __init__(self):
        self.sums, self.weights, self.extremes = defaultdict(float), defaultdict(float), {}

    def add(self, metrics: dict[str, float], weight: float) -> None:
        for key, value in metrics.items():
            if key.endswith("_min") or key.endswith("_max"):
                pick = min if key.endswith("_min") else max
                self.extremes[key] = pick(self.extremes.get(key, value), value)
            elif math.isfinite(value):
                self.sums[key] += value * weight
                self.weights[key] += weight

    def result(self) -> dict[str, float]:
        return {**{k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k]}, **self.extremes}


class MismatchMeter:
    """Mean |sampler - trainer log-prob| (``mismatch_logp_abs``) and the k3 estimate of KL(sampler || trainer)
    (``mismatch_kl``) over the valid tokens added."""

    def __init__(self):
        self.abs_sum, self.kl_sum, self.tokens = 0.0, 0.0, 0.0

    def add(self, sampler_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> None:
        diff = torch.where(mask, trainer_logp - sampler_logp, torch.zeros_like(trainer_logp))
        self.abs_sum += diff.abs().sum().item()
        self.kl_sum += torch.where(mask, diff.exp() - 1 - diff, torch.zeros_like(diff)).sum().item()
        self.tokens += mask.sum().item()

    def result(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        return {"mismatch_logp_abs": self.abs_sum / self.tokens, "mismatch_kl": self.kl_sum / self.tokens}


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated CUDA memory on a GPU, the process's peak resident set size on the CPU (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def progress_fields(row: dict, rows: list[dict]) -> dict[str, str]:
    """What a progress bar shows beside the step: the step's reward and clip fraction, the last eval accuracy;
    rewards and accuracies with 3 decimals, the clip fraction (often 1e-4) with 3 significant digits."""
    evals = [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]
    fields = {"reward": (row.get("reward_mean"), ".3f"), "clip": (row.get("clip_frac"), ".3g"),
              "eval": (evals[-1] if evals else None, ".3f")}
    return {k: format(v, spec) for k, (v, spec) in fields.items() if v is not None}
