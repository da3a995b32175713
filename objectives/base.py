"""The objective interface: a batch of log-probs in, a scalar loss and float metrics out.

Notation used by every objective's docstring: tensors are [B, T] over completion tokens,
``d = logp - old_logp``, ``r = exp(d)``, ``sg`` = stop-gradient (``detach``), ``L_i`` = number of
valid tokens of sequence i, ``A`` = advantage (per sequence, broadcast over tokens, or per token).

Aggregation is part of each algorithm and lives in one helper, :func:`aggregate`. With micro-batching
the caller passes the *global* token / sequence counts of the minibatch (``num_tokens``,
``num_sequences``), so that summing the losses of the micro-batches gives exactly the minibatch loss
(verl's "global batch info").
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from objectives.registry import Registry

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass
class PolicyBatch:
    logp: Tensor  # [B, T] current policy log-probs of the sampled tokens (carries the gradient)
    old_logp: Tensor  # [B, T] behaviour-policy log-probs (no gradient)
    mask: Tensor  # [B, T] 1 for completion tokens that count, 0 for padding
    advantages: Tensor  # [B] per sequence or [B, T] per token
    rewards: Tensor | None = None  # [B]
    group_ids: Tensor | None = None  # [B], same id = same prompt
    ref_logp: Tensor | None = None  # [B, T] frozen reference policy, for the KL term
    step: int = 0  # optimizer step, for schedules
    total_steps: int = 1
    max_completion_len: int | None = None  # constant normaliser of Dr. GRPO
    num_tokens: float | None = None  # valid tokens in the whole minibatch (default: this batch's)
    num_sequences: int | None = None  # sequences in the whole minibatch (default: this batch's)

    def __post_init__(self):
        if self.logp.dim() != 2:
            raise ValueError(f"logp must be [B, T], got shape {tuple(self.logp.shape)}")
        for name in ("old_logp", "mask", "ref_logp"):
            value = getattr(self, name)
            if value is not None and value.shape != self.logp.shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, logp has {tuple(self.logp.shape)}")
        if self.advantages.shape not in (self.logp.shape[:1], self.logp.shape):
            raise ValueError(
                f"advantages must be [B] or [B, T] = {tuple(self.logp.shape)}, "
                f"got {tuple(self.advantages.shape)}"
            )
        self.mask = self.mask.bool()
        self.old_logp = self.old_logp.detach()
        if self.ref_logp is not None:
            self.ref_logp = self.ref_logp.detach()

    @property
    def token_count(self) -> Tensor | float:
        return self.num_tokens if self.num_tokens is not None else self.mask.sum().clamp(min=1)

    @property
    def sequence_count(self) -> int:
        return self.num_sequences if self.num_sequences is not None else self.logp.shape[0]

    @property
    def lengths(self) -> Tensor:
        """L_i, the number of valid tokens per sequence (at least 1, so that empty rows divide safely)."""
        return self.mask.sum(-1).clamp(min=1).to(self.logp.dtype)

    @property
    def token_advantages(self) -> Tensor:
        adv = self.advantages.detach().to(self.logp.dtype)
        return adv if adv.dim() == 2 else adv[:, None].expand_as(self.logp)

    def log_ratio(self) -> Tensor:
        """d = logp - old_logp on valid tokens, exactly 0 on padding (so padding never makes inf/NaN)."""
        return torch.where(self.mask, self.logp - self.old_logp, torch.zeros_like(self.logp))

    def sequence_mean(self, per_token: Tensor) -> Tensor:
        """sum_t(mask * x) / L_i: the per-sequence token mean, [B]."""
        return masked(per_token, self.mask).sum(-1) / self.lengths


@dataclass
class ObjectiveOutput:
    loss: Tensor  # 0-dim, to minimise
    metrics: dict[str, float]


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """x on valid positions, 0 elsewhere (also where x is inf/NaN on padding)."""
    return torch.where(mask, x, torch.zeros_like(x))


def aggregate(per_token: Tensor, batch: PolicyBatch, mode: str) -> Tensor:
    """Reduce a per-token loss [B, T] to the scalar loss of the (micro-)batch.

    token_mean:              sum(l * mask) / N_tokens                      (DAPO, CISPO, CTPO, verl default)
    seq_mean_token_mean:     sum_i( sum_t(l * mask) / L_i ) / N_seqs       (GRPO paper, GSPO-token, SAPO)
    seq_mean_token_sum_norm: sum(l * mask) / (N_seqs * max_completion_len) (Dr. GRPO)
    N_tokens / N_seqs are the minibatch's global counts when given, else this batch's.
    """
    total = masked(per_token, batch.mask)
    if mode == "token_mean":
        return total.sum() / batch.token_count
    if mode == "seq_mean_token_mean":
        return (total.sum(-1) / batch.lengths).sum() / batch.sequence_count
    if mode == "seq_mean_token_sum_norm":
        if batch.max_completion_len is None:
            raise ValueError("seq_mean_token_sum_norm needs PolicyBatch.max_completion_len")
        return total.sum() / (batch.sequence_count * batch.max_completion_len)
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")


def sequence_aggregate(per_sequence: Tensor, batch: PolicyBatch) -> Tensor:
    """Mean of a per-sequence loss [B] over the minibatch's sequences (GSPO, GMPO, HölderPO)."""
    return per_sequence.sum() / batch.sequence_count


def sequence_advantages(batch: PolicyBatch, objective: str) -> Tensor:
    """The advantages A_i [B] (detached, in logp's dtype) of a sequence-level objective; ValueError if [B, T]."""
    if batch.advantages.dim() != 1:
        raise ValueError(f"objective {objective!r} is sequence-level and needs per-sequence advantages [B], "
                         f"got shape {tuple(batch.advantages.shape)}")
    return batch.advantages.detach().to(batch.logp.dtype)


def ppo_clipped_loss(
    batch: PolicyBatch, clip_low: float, clip_high: float, aggregation: str, log_ratio: Tensor | None = None
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate per token, aggregated, with its clip and ratio metrics.

        l_t = max(-r_t A_t, -clip(r_t, 1 - clip_low, 1 + clip_high) A_t),   loss = aggregate(l, aggregation)
        clip_frac_low = A < 0 and r < 1 - clip_low,   clip_frac_high = A > 0 and r > 1 + clip_high

    r = exp(``log_ratio``) ([B, T], 0 on padding), by default exp(logp - old_logp); GSPO-token passes its own.
    """
    ratio = torch.exp(batch.log_ratio() if log_ratio is None else log_ratio)
    adv = batch.token_advantages
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(-ratio * adv, -clipped_ratio * adv)
    low = (ratio < 1.0 - clip_low) & (adv < 0)
    high = (ratio > 1.0 + clip_high) & (adv > 0)
    loss = aggregate(per_token, batch, aggregation)
    return loss, {**clip_metrics(low, high, batch), **ratio_metrics(ratio, batch.mask)}


def ratio_metrics(ratio: Tensor, valid: Tensor, prefix: str = "ratio") -> dict[str, float]:
    """mean / min / max / std of an importance ratio over valid entries (tokens [B,T] or sequences [B])."""
    values = ratio.detach()[valid.bool()].float()
    if values.numel() == 0:
        return {f"{prefix}_mean": float("nan"), f"{prefix}_min": float("nan"),
                f"{prefix}_max": float("nan"), f"{prefix}_std": float("nan")}
    std = values.std(correction=0) if values.numel() > 1 else values.new_zeros(())
    return {
        f"{prefix}_mean": values.mean().item(),
        f"{prefix}_min": values.min().item(),
        f"{prefix}_max": values.max().item(),
        f"{prefix}_std": std.item(),
    }


def clip_metrics(clipped_low: Tensor, clipped_high: Tensor, batch: PolicyBatch) -> dict[str, float]:
    """Fractions of valid tokens whose gradient clipping removed, split by side.

    ``clipped_low`` / ``clipped_high`` are boolean [B, T] (token-level clipping) or [B] (sequence-level
    clipping: every token of a clipped sequence counts).
    """
    mask = batch.mask
    if clipped_low.dim() == 1:
        clipped_low = clipped_low[:, None].expand_as(mask)
        clipped_high = clipped_high[:, None].expand_as(mask)
    n = mask.sum().clamp(min=1).item()
    low = (clipped_low & mask).sum().item() / n
    high = (clipped_high & mask).sum().item() / n
    return {"clip_frac": low + high, "clip_frac_low": low, "clip_frac_high": high}


def k3_kl(batch: PolicyBatch) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 (0 on padding)."""
    diff = torch.where(batch.mask, batch.ref_logp - batch.logp, torch.zeros_like(batch.logp))
    return torch.exp(diff) - diff - 1


OBJECTIVES: Registry[type[Objective]] = Registry("objective")


@dataclass
class Objective:
    """Base class. Subclasses are dataclasses whose fields are the hyperparameters (defaults = paper's).

    A subclass implements :meth:`policy_loss` and sets the class variables below that differ from the
    defaults. Every objective takes ``beta``: the coefficient of the k3 KL to the reference policy, added per
    token and aggregated with ``kl_aggregation``. Numeric hyperparameters are checked before
    :meth:`validate`: finite, >= 0 unless in ``signed``, > 0 if in ``positive``, < 1 if in ``below_one``.
    """

    name: ClassVar[str] = ""  # the registered name (set by register_objective)
    default_advantage: ClassVar[str] = "grpo"  # advantage estimator used when the run's config names none
    # how policy_loss reduces its per-token loss (one of AGGREGATIONS); None: it reduces per sequence instead
    aggregation: ClassVar[str | None] = None
    kl_aggregation: ClassVar[str] = "seq_mean_token_mean"  # reduction of the beta * k3 KL term
    signed: ClassVar[frozenset[str]] = frozenset()  # numeric hyperparameters allowed to be negative
    positive: ClassVar[frozenset[str]] = frozenset()  # numeric hyperparameters that must be > 0
    # lower clip widths eps of a ratio floor 1 - eps, which must stay > 0: eps < 1
    below_one: ClassVar[frozenset[str]] = frozenset()
    # True if the loss compares the samples of a group (micro-batches must then hold whole groups)
    needs_whole_groups: ClassVar[bool] = False

    beta: float = 0.0  # coefficient of the k3 KL to the reference policy

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, self._checked(f.name, getattr(self, f.name), hints[f.name]))
        self.validate()

    def _checked(self, name: str, value, kind):
        where = f"objective {self.name!r}: hyperparameter {name}"
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{where} must be a number, got {value!r} ({type(value).__name__})")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{where} must be finite, got {value}")
            if value < 0 and name not in self.signed:
                raise ValueError(f"{where} must be >= 0, got {value}")
            if value <= 0 and name in self.positive:
                raise ValueError(f"{where} must be > 0, got {value}")
            if value >= 1 and name in self.below_one:
                raise ValueError(f"{where} must be < 1 (ratio floor 1 - {name} > 0), got {value}")
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{where} must be an integer, got {value!r} ({type(value).__name__})")
            if value < 0 and name not in self.signed:
                raise ValueError(f"{where} must be >= 0, got {value}")
        elif kind is bool and not isinstance(value, bool):
            raise TypeError(f"{where} must be true or false, got {value!r}")
        elif kind is str and not isinstance(value, str):
            raise TypeError(f"{where} must be a string, got {value!r}")
        return value

    def validate(self) -> None:
        """Checks beyond the declared ones (e.g. a string among choices); raise ValueError with a clear message."""

    def policy_loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError

    def __call__(self, batch: PolicyBatch) -> ObjectiveOutput:
        loss, metrics = self.policy_loss(batch)
        metrics = dict(metrics)
        metrics["pg_loss"] = loss.item()
        # KL between behaviour and current policy (verl's ppo_kl): token mean of -d.
        n_valid = batch.mask.sum().clamp(min=1)
        metrics["kl_behavior"] = (masked(-batch.log_ratio(), batch.mask).sum() / n_valid).item()
        if self.beta > 0:
            if batch.ref_logp is None:
                raise ValueError(
                    f"objective {self.name!r} has beta={self.beta} > 0 but the batch has no ref_logp"
                )
            kl = k3_kl(batch)
            loss = loss + self.beta * aggregate(kl, batch, self.kl_aggregation)
            metrics["kl_ref"] = (masked(kl, batch.mask).sum() / n_valid).item()
        return ObjectiveOutput(loss=loss, metrics=metrics)

    @classmethod
    def hyperparameters(cls) -> dict[str, object]:
        return {f.name: f.default for f in dataclasses.fields(cls)}


def register_objective(name: str):
    """Class decorator: make the class a dataclass of its hyperparameters and register it under ``name``."""

    def decorator(cls):
        for mode in (cls.aggregation, cls.kl_aggregation):
            if mode is not None and mode not in AGGREGATIONS:
                raise ValueError(f"objective {name!r}: unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")
        cls.name = name
        if "__dataclass_fields__" not in cls.__dict__:
            cls = dataclass(cls)
        return OBJECTIVES.register(name)(cls)

    return decorator


def get_objective(name: str, **hyperparameters) -> Objective:
    """Build a registered objective; unknown names and hyperparameters raise errors listing the choices."""
    cls = OBJECTIVES.get(name)
    valid = cls.hyperparameters()
    unknown = sorted(set(hyperparameters) - set(valid))
    if unknown:
        choices = ", ".join(f"{k}={v!r}" for k, v in valid.items())
        raise TypeError(
            f"objective {name!r} has no hyperparameter {', '.join(unknown)}; its hyperparameters: {choices}"
        )
    return cls(**hyperparameters)


def available_objectives() -> list[str]:
    return OBJECTIVES.names()
