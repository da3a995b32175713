"""The objective interface: a batch of log-probs in, a scalar loss and float metrics out.

Notation used by every objective's docstring: tensors are [B, T] over completion tokens,
``d = logp - old_logp``, ``r = exp(d)``, ``sg`` = stop-gradient (``detach``), ``L_i`` = number of
valid tokens of sequence i, ``A`` = advantage (per sequence, broadcast over tokens, or per token).

Aggregation is part of each algorithm and lives in two helpers, :func:`aggregate` (a per-token loss) and
:func:`sequence_loss` (a per-sequence loss). Every objective has the hyperparameter ``aggregation`` (verl's
``loss_agg_mode``): by default the objective's own (``default_aggregation``), overridable by any mode in
``AGGREGATIONS`` that the objective accepts (``aggregations``; ConSPO accepts only its own). With
micro-batching the caller passes the *global* token / sequence counts of the minibatch (``num_tokens``,
``num_sequences``), so that summing the losses of the micro-batches gives exactly the minibatch loss
(verl's "global batch info"), in every mode. Objectives whose loss needs statistics of the whole minibatch
beyond these counts (P3O's effective sample size) implement :meth:`Objective.minibatch_statistics` (sums over a
micro-batch's valid tokens): the loop sums them over the minibatch's micro-batches in a no-grad pass before the
losses and hands the totals back as ``PolicyBatch.minibatch_stats`` (an objective that cannot do so sets
``needs_whole_minibatch`` instead, and the loop refuses to micro-batch it).

Rollout correction (``train.rollout_correction``, objectives/rollout_correction.py) reaches every objective
through ``PolicyBatch.correction``: a detached per-token weight [B, T] (the importance weight between the
trainer's old policy and the sampler; 0 for masked tokens) that :func:`aggregate`, :func:`sequence_loss` and
:func:`sequence_aggregate` multiply into the objective's per-token / per-sequence loss (a sequence's loss by the
token mean of its weights), so no objective has code for it. The token and sequence counts of the normalisation
are unchanged (a masked token keeps its place in N_tokens, L_i, N_seqs); the beta * KL to the reference is not
weighted. None, or weights exactly 1, leave the loss and its gradient bit-identical.

An objective with state of its own (a coefficient, a moving copy of the policy, a trained predictor) declares
``stateful`` and implements the lifecycle hooks (:class:`Objective`: ``setup``, ``trainable_parameters``,
``after_optimizer_step``, ``after_update``, ``state_dict`` / ``load_state_dict``), checked when it registers.
:meth:`Objective.needs` says what it needs of a trainer ("state", "hidden_states"); each trainer declares what it
provides, and :func:`lifecycle_unsupported` checks one against the other before a run starts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from objectives.advantages import reference_samples
from objectives.registry import Registry

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum", "prompt_mean")
RATIO_LEVELS = ("token", "sequence", "other")  # Objective.ratio_level
SEED_BOUND = 2**32  # seeds are in [0, 2**32), numpy's and torch's: a run's and an objective's own (Objective.seeds)


@functools.cache
def _type_hints(cls: type) -> dict:
    """``typing.get_type_hints`` of an objective class (its fields' types; the annotations are strings here), worked
    out once per class rather than for every objective built: it evaluates the annotations of the class and its
    bases."""
    return typing.get_type_hints(cls)


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
    group_tokens: Tensor | None = None  # [B] valid tokens of each row's group (prompt) in the whole minibatch, and ...
    num_groups: int | None = None  # ... the groups with a row in it: prompt_mean's normalisers (default: this batch's)
    # Optional inputs (None unless the loop passes them; each objective that reads one documents its fallback):
    rollout_step: int | None = None  # rollout (prompt-batch) steps done before this update, 0 for the first
    #   rollout: HölderPO's ``p_schedule="rollout_steps"`` (which adds 1: the authors count rollouts from 1)
    sampler_logp: Tensor | None = None  # [B, T] the behaviour log-probs: what the sampler (vLLM / bf16 / quantised
    #   rollout engine, an older policy version, or both) gave each token it drew, when ``old_logp`` is instead the
    #   trainer's proximal policy, recomputed before the update; None: ``old_logp`` is the behaviour itself. Read by
    #   TBPO's mismatch weight exp(mean_t(old_logp - sampler_logp)), M2PO's mask (behaviour vs proximal) and OPSM
    #   (behaviour vs current).
    correction: Tensor | None = None  # [B, T] detached rollout-correction weight (train.rollout_correction), applied
    #   by aggregate / sequence_loss / sequence_aggregate to the objective's loss; 0 = masked. None: weight 1.
    behaviour_corrected: bool = False  # the loop's rollout correction weighs the proximal against the behaviour
    #   already (in ``correction``): an objective's own such weight (TBPO's) is then off, so none is applied twice
    minibatch_stats: dict[str, Tensor] | None = None  # the objective's ``minibatch_statistics`` summed over the
    #   whole minibatch, when the loop splits it into micro-batches; None: this batch is the whole minibatch.
    entropy: Tensor | None = None  # [B, T] the current policy's entropy at each completion position (0 on padding),
    #   when the objective asks for it (:meth:`Objective.entropy_need`); carries the gradient for the entropy bonus
    hidden: Tensor | None = None  # [B, T, D] the policy's final (post-norm) hidden states that predict the completion
    #   tokens (0 on padding), with gradient, when the objective sets ``needs_hidden_states`` (POPO)
    hidden_of: Callable[[torch.nn.Module], Tensor] | None = None  # the same [B, T, D] of another model of the policy's
    #   architecture on these rows (no gradient), e.g. the objective's moving copy of the policy; with ``hidden``

    def __post_init__(self):
        if self.logp.dim() != 2:
            raise ValueError(f"logp must be [B, T], got shape {tuple(self.logp.shape)}")
        for name in ("old_logp", "mask", "ref_logp", "sampler_logp", "correction", "entropy"):
            value = getattr(self, name)
            if value is not None and value.shape != self.logp.shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, logp has {tuple(self.logp.shape)}")
        if self.group_tokens is not None and self.group_tokens.shape != self.logp.shape[:1]:
            raise ValueError(f"group_tokens must be [B] = {tuple(self.logp.shape[:1])}, got "
                             f"{tuple(self.group_tokens.shape)}")
        if self.advantages.shape not in (self.logp.shape[:1], self.logp.shape):
            raise ValueError(
                f"advantages must be [B] or [B, T] = {tuple(self.logp.shape)}, "
                f"got {tuple(self.advantages.shape)}"
            )
        self.mask = self.mask.bool()
        self.old_logp = self.old_logp.detach()
        if self.ref_logp is not None:
            self.ref_logp = self.ref_logp.detach()
        if self.sampler_logp is not None:
            self.sampler_logp = self.sampler_logp.detach()
        if self.correction is not None:
            self.correction = self.correction.detach().to(self.logp.dtype)

    @property
    def token_count(self) -> Tensor | float:
        return self.num_tokens if self.num_tokens is not None else self.mask.sum().clamp(min=1)

    @property
    def sequence_count(self) -> int:
        return self.num_sequences if self.num_sequences is not None else self.logp.shape[0]

    def prompt_counts(self) -> tuple[Tensor, int]:
        """prompt_mean's normalisers: N_p of each row's prompt [B] (its group's valid tokens in the whole minibatch,
        at least 1) and P, the prompts with a row in it (``group_tokens`` / ``num_groups``, else this batch's)."""
        if self.group_tokens is not None and self.num_groups is not None:
            return self.group_tokens.to(self.logp.dtype).clamp(min=1), self.num_groups
        if self.group_ids is None:
            raise ValueError("aggregation prompt_mean needs PolicyBatch.group_ids (the prompt of each row)")
        tokens, groups = group_totals(self.mask.sum(-1).to(self.logp.dtype), self.group_ids)
        return tokens.clamp(min=1), groups

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

    def sequence_correction(self) -> Tensor | None:
        """c_i = the token mean of ``correction`` over the valid tokens of sequence i [B] (the weight of a
        per-sequence loss; exactly 1 when every weight is 1; 1 for a row with no valid token), or None."""
        if self.correction is None:
            return None
        return torch.where(self.mask.any(-1), self.sequence_mean(self.correction), torch.ones_like(self.lengths))


@dataclass
class ObjectiveOutput:
    loss: Tensor  # 0-dim, to minimise
    metrics: dict[str, float]


# Metrics that are a micro-batch's share of its minibatch's value, not a mean over the micro-batch: the policy loss
# and the entropy bonus are aggregated with the minibatch's counts (``num_tokens``, ``num_sequences``), so that the
# micro-batches' values sum to the whole minibatch's; the trainers add them up per optimizer step
# (harness.loop.metrics.MetricMeter); an objective adds its own (``Objective.share_metrics``). Every other metric is
# the micro-batch's own mean, averaged by tokens.
MINIBATCH_SHARES = frozenset({"pg_loss", "entropy_bonus"})


def group_totals(values: Tensor, group_ids: Tensor) -> tuple[Tensor, int]:
    """Each row's group's sum of ``values`` [B] (a group: the rows of one ``group_ids`` value) and the number of
    groups."""
    _, index = torch.unique(group_ids, return_inverse=True)
    groups = int(index.max()) + 1 if index.numel() else 0
    return values.new_zeros(groups).index_add_(0, index, values)[index], groups


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """x on valid positions, 0 elsewhere (also where x is inf/NaN on padding)."""
    return torch.where(mask, x, torch.zeros_like(x))


def aggregate(per_token: Tensor, batch: PolicyBatch, mode: str, correct: bool = True) -> Tensor:
    """Reduce a per-token loss [B, T] to the scalar loss of the (micro-)batch.

    token_mean:              sum(l * mask) / N_tokens                      (DAPO, CISPO, CTPO, verl default)
    seq_mean_token_mean:     sum_i( sum_t(l * mask) / L_i ) / N_seqs       (GRPO paper, GSPO-token, SAPO)
    seq_mean_token_sum_norm: sum(l * mask) / (N_seqs * max_completion_len) (Dr. GRPO)
    seq_mean_token_sum:      sum(l * mask) / N_seqs                        (verl's seq-mean-token-sum; LUSPO)
    prompt_mean:             sum_p( sum_{i in p} sum_t(l * mask) / N_p ) / P   (SkyRL's prompt_mean: the token
                             mean within each prompt's rows, N_p their valid tokens, then the mean over the P prompts)
    N_tokens / N_seqs / N_p and P are the minibatch's global counts when given, else this batch's (a minibatch that
    splits a group holds part of it: N_p counts the tokens of the rows it holds). With
    ``PolicyBatch.correction`` (and ``correct``; the KL to the reference passes False) l is first multiplied by
    the rollout-correction weight w: l * w * mask, the counts unchanged. N_seqs counts every row, one whose mask is
    all zero too (verl's sequence means leave such rows out of their count by default).
    """
    if correct and batch.correction is not None:
        per_token = per_token * batch.correction
    total = masked(per_token, batch.mask)
    if mode == "token_mean":
        return total.sum() / batch.token_count
    if mode == "seq_mean_token_mean":
        return (total.sum(-1) / batch.lengths).sum() / batch.sequence_count
    if mode == "seq_mean_token_sum_norm":
        if batch.max_completion_len is None:
            raise ValueError("seq_mean_token_sum_norm needs PolicyBatch.max_completion_len")
        return total.sum() / (batch.sequence_count * batch.max_completion_len)
    if mode == "seq_mean_token_sum":
        return total.sum() / batch.sequence_count
    if mode == "prompt_mean":
        prompt_tokens, prompts = batch.prompt_counts()
        return (total.sum(-1) / prompt_tokens).sum() / prompts
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")


def sequence_aggregate(per_sequence: Tensor, batch: PolicyBatch) -> Tensor:
    """Mean of a per-sequence loss [B] over the minibatch's sequences (GSPO, GMPO, HölderPO, ConSPO); with
    ``PolicyBatch.correction``, l_i is weighted by the token mean c_i of its weights (``sequence_correction``)."""
    weight = batch.sequence_correction()
    if weight is not None:
        per_sequence = per_sequence * weight
    return per_sequence.sum() / batch.sequence_count


def sequence_loss(per_sequence: Tensor, batch: PolicyBatch, mode: str) -> Tensor:
    """Reduce a per-sequence loss l_i [B] as the per-token loss l_i broadcast over the valid tokens of i would be
    reduced by :func:`aggregate` (TRL's ``importance_sampling_level="sequence"``: its (B, 1) loss broadcast over the
    completion mask and reduced by the ``loss_type``'s normaliser):

    seq_mean_token_mean:     sum_i l_i / N_seqs                         (= :func:`sequence_aggregate`; TRL ``grpo``)
    token_mean:              sum_i L_i l_i / N_tokens                   (longer sequences weigh more; TRL ``dapo``,
                                                                         and ``bnpo`` over one micro-batch)
    seq_mean_token_sum_norm: sum_i L_i l_i / (N_seqs * max_completion_len)   (TRL ``dr_grpo``)
    seq_mean_token_sum:      sum_i L_i l_i / N_seqs                     (TRL ``luspo``)
    prompt_mean:             sum_i L_i l_i / N_p(i) / P                 (each prompt's sequences by their length)
    (verl's ``gspo`` broadcasts the same way but hard-codes seq-mean-token-mean, whatever ``loss_agg_mode`` says.)
    With ``PolicyBatch.correction`` w, each is the aggregate of l_i w_t over the tokens of i (seq_mean_token_mean:
    sum_i c_i l_i / N_seqs with c_i the token mean of w over sequence i).
    A row with no valid token adds 0 in every mode (TRL's broadcast over its empty mask) and counts in N_seqs.
    """
    if mode == "seq_mean_token_mean":
        return sequence_aggregate(masked(per_sequence, batch.mask.any(-1)), batch)
    return aggregate(per_sequence[:, None].expand_as(batch.logp), batch, mode)


def sequence_advantages(batch: PolicyBatch, objective: str) -> Tensor:
    """The advantages A_i [B] (detached, in logp's dtype) of a sequence-level objective; ValueError if [B, T]."""
    if batch.advantages.dim() != 1:
        raise ValueError(f"objective {objective!r} is sequence-level and needs per-sequence advantages [B], "
                         f"got shape {tuple(batch.advantages.shape)}")
    return batch.advantages.detach().to(batch.logp.dtype)


CUM_LOG_RATIO_CLAMP = 20.0  # CTPO: per-token |d| bound before the prefix sum (the authors')
CUM_LOG_RATIO_CAP = 10.0  # CTPO: upper cap of log rho_t, the prefix log-ratio (the authors'; ctpo and ctpo_clip)
CUM_RATIO_MODES = ("cumprod", "geomean")


def cumulative_log_ratio(batch: PolicyBatch, mode: str) -> Tensor:
    """CTPO's prefix log-ratio with the stop-gradient decomposition, [B, T], 0 on padding (before any cap):

        c_t = sum_{u <= t, valid} clamp(d_u, -20, 20)        mode "cumprod"  (log of the prefix product)
        c_t = c_t(cumprod) / n_t,  n_t = valid tokens <= t    mode "geomean"  (log of the prefix geometric mean)
        log rho_t = sg(c_t) + logp_t - sg(logp_t)             (value c_t; gradient through the current token only)
    """
    if mode not in CUM_RATIO_MODES:
        raise ValueError(f"unknown cumulative ratio mode {mode!r}; choose one of {CUM_RATIO_MODES}")
    cumulative = torch.cumsum(batch.log_ratio().clamp(-CUM_LOG_RATIO_CLAMP, CUM_LOG_RATIO_CLAMP), dim=-1)
    if mode == "geomean":
        cumulative = cumulative / torch.cumsum(batch.mask.to(batch.logp.dtype), dim=-1).clamp(min=1)
    return masked(cumulative.detach() + batch.logp - batch.logp.detach(), batch.mask)


def ppo_clipped_loss(
    batch: PolicyBatch, clip_low: float, clip_high: float, aggregation: str, log_ratio: Tensor | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate per token, aggregated, with its clip and ratio metrics.

        l_t = max(-r_t A_t, -clip(r_t, 1 - clip_low, 1 + clip_high) A_t),   loss = aggregate(l, aggregation)
        clip_frac_low = A < 0 and r < 1 - clip_low,   clip_frac_high = A > 0 and r > 1 + clip_high

    r = exp(``log_ratio``) ([B, T], 0 on padding), by default exp(logp - old_logp); GSPO-token passes its own.
    ``clip_ratio_c`` (> 1; verl's dual clip, Ye et al. arXiv 1912.09729): where A < 0, l_t = min(l_t, -c A_t),
    so a token with r > c keeps the loss -c A and loses its gradient; reported as ``clip_frac_dual`` (A < 0 and
    r > c; disjoint from the other two) and added to ``clip_frac``.
    The log-ratio is not clamped (TRL's GRPO); verl's ``compute_policy_loss_vanilla`` and OpenRLHF clamp it to
    [-20, 20] first, which differs only where a ratio passes e^20 (there verl's clipped side carries no gradient).
    """
    ratio = torch.exp(batch.log_ratio() if log_ratio is None else log_ratio)
    adv = batch.token_advantages
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(-ratio * adv, -clipped_ratio * adv)
    low = (ratio < 1.0 - clip_low) & (adv < 0)
    high = (ratio > 1.0 + clip_high) & (adv > 0)
    dual = None
    if clip_ratio_c is not None:
        bound = -adv * clip_ratio_c
        dual = (adv < 0) & (per_token > bound)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
    loss = aggregate(per_token, batch, aggregation)
    metrics = clip_metrics(low, high, batch)
    if dual is not None:
        metrics["clip_frac_dual"] = (dual & batch.mask).sum().item() / batch.mask.sum().clamp(min=1).item()
        metrics["clip_frac"] += metrics["clip_frac_dual"]
    return loss, {**metrics, **ratio_metrics(ratio, batch.mask)}


def validate_dual_clip(objective) -> None:
    """``clip_ratio_c`` must exceed 1 (verl asserts the same): below, the dual bound would cut unclipped ratios."""
    if objective.clip_ratio_c <= 1.0:
        raise ValueError(f"objective {objective.name!r}: hyperparameter clip_ratio_c must be > 1 (verl's dual-clip "
                         f"bound on the ratio for A < 0), got {objective.clip_ratio_c}")


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


KL_ESTIMATORS = ("k3", "k1", "kl", "k2", "mse", "low_var_kl", "abs")  # each also with a "+" suffix (straight-through)
LOW_VAR_KL_LOG_CLAMP = 20.0  # verl's low_var_kl: the log-ratio ref - logp clamped to +-20 before exp ...
LOW_VAR_KL_VALUE_CLAMP = 10.0  # ... and the estimate to [-10, 10]


def check_kl_estimator(name: str) -> str | None:
    """What is wrong with a ``kl_estimator`` name (one sentence listing the choices), or None."""
    base = name[:-1] if name.endswith("+") else name
    if base in KL_ESTIMATORS:
        return None
    return (f"unknown kl_estimator {name!r}; choose one of {', '.join(KL_ESTIMATORS)}, each optionally with '+' "
            "(value of the estimator, gradient of k2: verl's straight-through variants)")


def reference_kl(batch: PolicyBatch, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) [B, T], 0 on padding, x = logp - ref_logp (J. Schulman, "Approximating
    KL divergence", 2020; verl ``kl_penalty`` / ``kl_loss_type``, core_algos.py):

        k3          exp(-x) + x - 1                        (default; TRL's GRPO term, unclamped)
        low_var_kl  clamp(exp(c) - c - 1, -10, 10), c = clamp(-x, -20, 20)   (verl's k3 with its clamps)
        k1 / kl     x
        k2 / mse    x^2 / 2                                 (its gradient x is the unbiased reverse-KL gradient)
        abs         |x|
        name + "+"  value of the named estimator, gradient of k2 (straight-through: k2 - sg(k2) + sg(value));
                    k2+ / mse+ are k2.
    verl treats k3 and low_var_kl as one name (both clamped); here k3 is the unclamped form, so that the default is
    the formula the objectives always had, and low_var_kl is verl's.
    """
    problem = check_kl_estimator(estimator)
    if problem:
        raise ValueError(problem)
    straight_through = estimator.endswith("+")
    base = estimator[:-1] if straight_through else estimator
    diff = torch.where(batch.mask, batch.ref_logp - batch.logp, torch.zeros_like(batch.logp))  # -x
    if base == "k3":
        value = torch.exp(diff) - diff - 1
    elif base == "low_var_kl":
        c = diff.clamp(-LOW_VAR_KL_LOG_CLAMP, LOW_VAR_KL_LOG_CLAMP)
        value = (torch.exp(c) - c - 1).clamp(-LOW_VAR_KL_VALUE_CLAMP, LOW_VAR_KL_VALUE_CLAMP)
    elif base in ("k1", "kl"):
        value = -diff
    elif base in ("k2", "mse"):
        value = 0.5 * diff.square()
    else:  # abs
        value = diff.abs()
    if not straight_through or base in ("k2", "mse"):
        return value
    k2 = 0.5 * diff.square()
    return k2 - k2.detach() + value.detach()


def off_policy_keep(batch: PolicyBatch, threshold: float) -> Tensor:
    """Off-policy sequence masking (OPSM; DeepSeek-V3.2, arXiv 2512.02556, Eq. 9; TRL 1.16 ``get_off_policy_mask``):
    keep = A >= 0  or  mean_t(sampler_logp - sg(logp)) <= threshold, a bool [B, T] over the tokens of each sequence
    (per token when the advantages are per token, as TRL's broadcast). The sampler's log-probs are
    ``batch.sampler_logp`` when the loop passes them (``old_logp`` is then the proximal policy), else ``old_logp`` (the
    behaviour policy itself, TRL's fallback)."""
    behaviour = batch.old_logp if batch.sampler_logp is None else batch.sampler_logp
    drift = masked(behaviour - batch.logp.detach(), batch.mask)
    mean_drift = drift.sum(-1) / batch.mask.sum(-1).clamp(min=1).to(drift.dtype)
    return (batch.token_advantages >= 0) | (mean_drift <= threshold)[:, None]


def high_entropy_keep(batch: PolicyBatch, top_quantile: float) -> Tensor:
    """Top-entropy token masking ("Beyond the 80/20 rule", Wang et al., arXiv 2506.01939; TRL 1.16
    ``get_high_entropy_mask`` with ``threshold = 1 - top_entropy_quantile``): keep = H_t >= q and valid, q the
    (1 - top_quantile) quantile (``torch.quantile``, linear interpolation) of the entropies of the batch's valid tokens,
    a bool [B, T]. top_quantile 0 keeps the highest-entropy token(s) only; no valid token: nothing kept."""
    if batch.entropy is None:
        raise ValueError("top-entropy token masking needs PolicyBatch.entropy (the loop passes it when the objective's "
                         "entropy_need() asks)")
    entropy = batch.entropy.detach()
    valid = entropy[batch.mask].float()
    if valid.numel() == 0:
        return torch.zeros_like(batch.mask)
    threshold = torch.quantile(valid, 1.0 - top_quantile)
    return (masked(entropy, batch.mask) >= threshold) & batch.mask


OBJECTIVES: Registry[type[Objective]] = Registry("objective")


@dataclass
class Objective:
    """Base class. Subclasses are dataclasses whose fields are the hyperparameters (defaults = paper's).

    A subclass implements :meth:`policy_loss` and sets the class variables below that differ from the
    defaults. Every objective takes ``beta``: the coefficient of the KL to the reference policy (estimator
    ``kl_estimator``, default k3: :func:`reference_kl`), added per token and aggregated with ``kl_aggregation``, and
    ``off_policy_mask`` / ``off_policy_mask_threshold`` (OPSM: :func:`off_policy_keep`, applied through the correction
    weight, so to the policy loss and not to the KL term). Numeric hyperparameters are checked before
    :meth:`validate`: finite, >= 0 unless in ``signed``, > 0 if in ``positive``, < 1 if in ``below_one``, <= 1 if in
    ``shares``, below 2**32 if in ``seeds``.
    """

    name: ClassVar[str] = ""  # the registered name (set by register_objective)
    default_advantage: ClassVar[str] = "grpo"  # advantage estimator used when the run's config names none
    # the objective's own reduction (one of AGGREGATIONS), the default of the ``aggregation`` hyperparameter;
    # a sequence-level objective's "mean over sequences" is seq_mean_token_mean (see sequence_loss)
    default_aggregation: ClassVar[str] = "token_mean"
    aggregations: ClassVar[tuple[str, ...]] = AGGREGATIONS  # the modes ``aggregation`` may be set to
    # reduction of the beta * k3 KL term; None: the objective's ``aggregation`` (override included)
    kl_aggregation: ClassVar[str | None] = None
    signed: ClassVar[frozenset[str]] = frozenset()  # numeric hyperparameters allowed to be negative
    positive: ClassVar[frozenset[str]] = frozenset()  # numeric hyperparameters that must be > 0
    # lower clip widths eps of a ratio floor 1 - eps, which must stay > 0: eps < 1
    below_one: ClassVar[frozenset[str]] = frozenset()
    # shares of the tokens (a fraction that selects a top k of them), which cannot exceed all of them: <= 1
    shares: ClassVar[frozenset[str]] = frozenset()
    # integer seeds of the objective's own generators, in [0, 2**32) as a run's seeds (a generator seeded by seed *
    # stride + step must stay within torch's 64-bit seed)
    seeds: ClassVar[frozenset[str]] = frozenset()
    # True if the loss compares the samples of a group (micro-batches must then hold whole groups)
    needs_whole_groups: ClassVar[bool] = False
    # True if the loss uses a statistic of the whole minibatch beyond its token / sequence counts and the objective
    # does not implement ``minibatch_statistics``: the loop must then evaluate it on the whole minibatch at once
    # (no micro-batching). P3O implements the hook instead.
    needs_whole_minibatch: ClassVar[bool] = False
    # True if the loss reads the policy's hidden states (``PolicyBatch.hidden`` and ``hidden_of``; POPO)
    needs_hidden_states: ClassVar[bool] = False
    # True if the loss reads the reference policy's log-probs (``PolicyBatch.ref_logp``) whatever its beta (A*-PO's
    # implicit reward beta_2 log(pi / pi_ref)); without it the loop computes them only for a KL term (beta > 0)
    needs_reference: ClassVar[bool] = False
    # True if the objective keeps state of its own across updates (the lifecycle below: ``setup``, the hooks,
    # ``state_dict`` in every checkpoint): declared, and checked at registration against the hooks it implements
    stateful: ClassVar[bool] = False
    # how many copies of the policy the objective keeps beside it (POPO: its moving target), which the memory floor
    # counts with the policy's weights (harness/policy/memory.py)
    policy_copies: ClassVar[int] = 0
    # the objective's own metrics that are, like its loss, a micro-batch's share of the minibatch's value (normalised
    # by the minibatch's counts): the trainers sum them per optimizer step (:meth:`minibatch_shares`)
    share_metrics: ClassVar[frozenset[str]] = frozenset()
    # True if the loss needs one advantage per sequence (``sequence_advantages``: GSPO, GMPO, HolderPO, ConSPO, TBPO),
    # so a token-level estimator's [B, T] advantages (optimal_token_baseline) cannot feed it
    needs_sequence_advantages: ClassVar[bool] = False
    # the level of the importance ratio, which decoupled PPO's behaviour weight pi_prox / pi_behaviour takes
    # (train.rollout_correction.mode=decoupled_ppo): "token" (a ratio per token, or no ratio: the weight per token),
    # "sequence" (the geometric mean of a sequence's token ratios: the weight's geometric mean per sequence), or
    # "other" (no such weight composes with it: ``ratio_note`` says what the ratio is, and the loop refuses the mode)
    ratio_level: ClassVar[str] = "token"
    ratio_note: ClassVar[str] = ""  # with ratio_level "other": what the objective's ratio is (one phrase)

    beta: float = 0.0  # coefficient of the KL to the reference policy (estimator: ``kl_estimator``)
    # reduction of the per-token (or per-sequence) loss, one of ``aggregations``; "" = ``default_aggregation``
    aggregation: str = ""
    # estimator of KL(pi || pi_ref) that beta multiplies (verl's kl_loss_type): k3 (default), low_var_kl, k1/kl,
    # k2/mse, abs, each with "+" for verl's straight-through variant (value of the estimator, gradient of k2)
    kl_estimator: str = "k3"
    # off-policy sequence masking (OPSM, DeepSeek-V3.2; TRL's off_policy_mask_threshold): drop from the policy loss
    # the sequences with A < 0 whose mean drift mean_t(sampler_logp - logp) exceeds off_policy_mask_threshold
    off_policy_mask: bool = False
    off_policy_mask_threshold: float = 0.5  # delta of DeepSeek-V3.2 Eq. 9 (TRL's example value 0.5)
    # entropy bonus (TRL entropy_coef, verl actor.entropy_coeff): the loss minus entropy_coef times the mean entropy of
    # the current policy over the valid tokens (those top_entropy_quantile keeps); 0 = off
    entropy_coef: float = 0.0
    # top-entropy token masking (TRL top_entropy_quantile, rho of arXiv 2506.01939, which recommends 0.2): only the
    # tokens whose entropy is in the top quantile of the minibatch's tokens enter the policy loss; 1 = all tokens
    top_entropy_quantile: float = 1.0

    def __post_init__(self):
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, self._checked(f.name, getattr(self, f.name), hints[f.name]))
        if self.aggregation == "":
            self.aggregation = self.default_aggregation
        if self.aggregation not in self.aggregations:
            where = f"objective {self.name!r}: hyperparameter aggregation"
            if self.aggregation not in AGGREGATIONS:
                raise ValueError(f"{where}: unknown mode {self.aggregation!r}; choose one of {AGGREGATIONS}")
            raise ValueError(f"{where} {self.aggregation!r} is not meaningful for this objective; it accepts "
                             f"only {self.aggregations}")
        if check_kl_estimator(self.kl_estimator):
            raise ValueError(f"objective {self.name!r}: hyperparameter kl_estimator: "
                             f"{check_kl_estimator(self.kl_estimator)}")
        if self.top_entropy_quantile > 1:
            raise ValueError(f"objective {self.name!r}: hyperparameter top_entropy_quantile must be in [0, 1] (the "
                             f"share of tokens kept by entropy; 1 keeps all), got {self.top_entropy_quantile}")
        self.validate()

    def _checked(self, name: str, value, kind):
        where = f"objective {self.name!r}: hyperparameter {name}"
        if not of_kind(value, kind):
            raise TypeError(f"{where} must be {KIND_WORDS[kind]}, got {value!r}"
                            + ("" if kind in (bool, str) else f" ({type(value).__name__})"))
        if kind is float:
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{where} must be finite, got {value}")
            if value <= 0 and name in self.positive:  # before the sign: "must be >= 0" would offer 0, refused too
                raise ValueError(f"{where} must be > 0, got {value}")
            if value < 0 and name not in self.signed:
                raise ValueError(f"{where} must be >= 0, got {value}")
            if value >= 1 and name in self.below_one:
                raise ValueError(f"{where} must be < 1 (ratio floor 1 - {name} > 0), got {value}")
            if value > 1 and name in self.shares:
                raise ValueError(f"{where} must be <= 1 (a share of the valid tokens; 1 is all of them), got {value}")
        elif kind is int:
            if value < 0 and name not in self.signed:
                raise ValueError(f"{where} must be >= 0, got {value}")
            if value >= SEED_BOUND and name in self.seeds:
                raise ValueError(f"{where} must be a seed in [0, 2**32) (numpy's and torch's seeds), got {value}")
        return value

    def validate(self) -> None:
        """Checks beyond the declared ones (e.g. a string among choices); raise ValueError with a clear message."""

    def policy_loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError

    def minibatch_statistics(self, batch: PolicyBatch) -> dict[str, Tensor] | None:
        """Sums over ``batch`` (0-dim tensors) of whatever the loss needs over the whole minibatch (P3O: the count,
        sum and sum of squares of the ratios of valid tokens); None (the default): nothing beyond the counts.

        An objective that implements this reads ``PolicyBatch.minibatch_stats`` in :meth:`policy_loss` when it is
        given (the loop summed this method's output over the minibatch's micro-batches, with the current policy's
        log-probs from a no-grad forward: one extra forward per minibatch, only for such objectives and only when
        the minibatch is split) and calls this method on the batch itself otherwise."""
        return None

    def entropy_need(self) -> str:
        """What the objective needs of the current policy's entropy (``PolicyBatch.entropy``): "gradient" (the entropy
        bonus), "value" (top-entropy masking only) or "" (nothing)."""
        if self.entropy_bonus_coef() is not None:
            return "gradient"
        return "value" if self.top_entropy_quantile < 1 else ""

    def entropy_bonus_coef(self) -> float | None:
        """The coefficient of the entropy bonus this loss subtracts, or None for no bonus term: ``entropy_coef`` when
        > 0 (an adaptive controller returns its current coefficient, 0 included)."""
        return self.entropy_coef if self.entropy_coef > 0 else None

    def inert_hyperparameters(self) -> frozenset[str]:
        """The hyperparameters that change nothing at this objective's values, declared by the objective: the run id
        leaves them out and a resume may change them (harness/run/config.py ``unused_setting``). Here kl_estimator
        without a KL term (beta 0: no reference forward, no term, no metric) and off_policy_mask_threshold without
        the mask (off_policy_mask false); an objective that reads one otherwise says so by overriding this."""
        inert = {"kl_estimator"} if self.beta == 0 else set()
        return frozenset(inert | ({"off_policy_mask_threshold"} if not self.off_policy_mask else set()))

    def reference_kl_coef(self) -> float:
        """The coefficient of the KL to the reference in this loss: ``beta`` (an adaptive controller's current one)."""
        return self.beta

    def needs_minibatch_at_once(self) -> bool:
        """Whether the loss must see the whole minibatch at once (no micro-batching): the class's
        ``needs_whole_minibatch``, or top-entropy masking (a quantile over the minibatch's tokens)."""
        return self.needs_whole_minibatch or self.top_entropy_quantile < 1

    # --- the lifecycle of an objective with state of its own (``stateful``; POPO: a trained predictor and a moving copy
    # of the policy; adaptive_entropy / adaptive_kl: a coefficient). A trainer that provides "state" (:data:`NEEDS`,
    # :func:`lifecycle_unsupported`) calls, with no objective-specific code: ``setup`` once before making the optimizer,
    # ``trainable_parameters`` in a parameter group of their own, ``after_optimizer_step`` after each applied optimizer
    # step, ``after_update`` once per rollout step after its last optimizer step, ``state_dict`` in every checkpoint and
    # ``load_state_dict`` on resume (after ``setup``). State that does not depend on the policy is made in
    # ``__post_init__``, so that a fresh instance is a fresh state (the registry-wide tests evaluate one per case).

    def setup(self, policy: torch.nn.Module) -> None:
        """Build what the objective keeps beside the policy (on the policy's device and dtype)."""

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters the objective trains beside the policy's (the loop's optimizer: a group of their own)."""
        return []

    def trained_parameter_count(self, hidden_size: int) -> int:
        """How many parameters :meth:`trainable_parameters` will hold once :meth:`setup` has run on a policy of hidden
        size ``hidden_size``, known before anything is built: the memory check counts them in float32 with their
        gradients and AdamW's two moments (harness/policy/memory.py ``held_weights``). 0: none."""
        return 0

    def after_optimizer_step(self, policy: torch.nn.Module, metrics: dict[str, float]) -> None:
        """Called after each optimizer step that updated the policy, with that step's metrics: the objective's (and
        the loop's ``entropy``) averaged over the step's micro-batches weighted by their valid tokens, the shares
        (:data:`MINIBATCH_SHARES`, ``pg_loss``) summed (an EMA copy
        follows the policy here; TRL's adaptive entropy coefficient moves here)."""

    def after_update(self, metrics: dict[str, float], sequences: int) -> None:
        """Called once per rollout step, after its last optimizer step, with the step's update metrics (the
        objective's averaged over all its micro-batches, weighted by valid tokens; the shares summed per optimizer
        step and averaged over the optimizer steps, as ``loss`` and ``grad_norm``) and the
        number of sequences the step trained on (verl's adaptive KL controller moves here)."""

    def state_dict(self) -> dict:
        """What a checkpoint must hold to resume the objective exactly (tensors, numbers; {} without state)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (after :meth:`setup`)."""
        if state:
            raise ValueError(f"objective {self.name!r} keeps no state, but the checkpoint has {sorted(state)}")

    @classmethod
    def needs(cls) -> frozenset[str]:
        """What the objective needs of the trainer that runs it beyond log-probs and advantages (keys of
        :data:`NEEDS`), as its class declares: "state" (``stateful``), "hidden_states" (``needs_hidden_states``),
        "reference" (``needs_reference``)."""
        declared = {"state": cls.stateful, "hidden_states": cls.needs_hidden_states, "reference": cls.needs_reference}
        return frozenset(need for need, flag in declared.items() if flag)

    @classmethod
    def minibatch_shares(cls) -> frozenset[str]:
        """The metrics the trainers sum over an optimizer step's micro-batches (:data:`MINIBATCH_SHARES` and the
        class's ``share_metrics``) rather than average."""
        return MINIBATCH_SHARES | cls.share_metrics

    @classmethod
    def uses_minibatch_statistics(cls) -> bool:
        """Whether the class implements :meth:`minibatch_statistics` (the loop's extra no-grad pass)."""
        return cls.minibatch_statistics is not Objective.minibatch_statistics

    def token_masks(self, batch: PolicyBatch) -> tuple[PolicyBatch, Tensor | None, dict[str, float]]:
        """OPSM and top-entropy masking as 0/1 factors of the correction weight, so that every objective's shared
        aggregation applies them to the policy loss and not to the KL term (as TRL multiplies its per-token loss
        before adding the KL). Returns the batch, the top-entropy keep mask (None when off) and their metrics."""
        n_valid, metrics, entropy_keep = batch.mask.sum().clamp(min=1).item(), {}, None
        keeps = []
        if self.off_policy_mask:
            keeps.append(off_policy_keep(batch, self.off_policy_mask_threshold))
            metrics["off_policy_masked_frac"] = ((~keeps[-1]) & batch.mask).sum().item() / n_valid
        if self.top_entropy_quantile < 1:
            entropy_keep = high_entropy_keep(batch, self.top_entropy_quantile)
            keeps.append(entropy_keep)
            metrics["entropy_masked_frac"] = ((~entropy_keep) & batch.mask).sum().item() / n_valid
        for keep in keeps:
            factor = keep.to(batch.logp.dtype)
            batch = dataclasses.replace(batch, correction=factor if batch.correction is None
                                        else batch.correction * factor)
        return batch, entropy_keep, metrics

    def entropy_bonus(self, batch: PolicyBatch, keep: Tensor | None) -> Tensor:
        """H = sum_t(H_t m_t) / N: the mean entropy over the tokens m the policy loss keeps (TRL 1.16's entropy bonus:
        a token mean whatever the aggregation; verl aggregates it with ``loss_agg_mode``, the same for token-mean).
        N is the minibatch's token count (micro-batches sum to the minibatch's mean), or with top-entropy masking
        (whole minibatches only) the kept tokens; OPSM and rollout-correction weights do not enter (as in TRL). Over
        micro-batches of different token counts TRL averages each micro-batch's mean (its own comment says so);
        this is the token mean of the whole minibatch, TRL's with one micro-batch."""
        if batch.entropy is None:
            raise ValueError(f"objective {self.name!r} adds an entropy bonus (entropy_coef={self.entropy_coef}, or an "
                             "adaptive coefficient) but the batch has no entropy")
        if keep is None:
            return masked(batch.entropy, batch.mask).sum() / batch.token_count
        return masked(batch.entropy, keep).sum() / keep.sum().clamp(min=1)

    def __call__(self, batch: PolicyBatch) -> ObjectiveOutput:
        n_valid = batch.mask.sum().clamp(min=1)
        batch, entropy_keep, masking = self.token_masks(batch)
        loss, metrics = self._checked_output(self._policy_loss_named(batch))
        metrics = {**metrics, **masking}
        metrics["pg_loss"] = loss.item()
        entropy_coef = self.entropy_bonus_coef()
        if entropy_coef is not None:
            bonus = self.entropy_bonus(batch, entropy_keep)
            loss = loss - entropy_coef * bonus
            metrics["entropy_bonus"] = bonus.item()
            # H over this batch's own kept tokens (what an adaptive controller measures; token-weighted over the
            # micro-batches of an optimizer step it is the step's mean)
            kept = batch.mask if entropy_keep is None else entropy_keep
            metrics["entropy_kept_mean"] = (masked(batch.entropy.detach(), kept).sum() / kept.sum().clamp(min=1)).item()
        # KL(behaviour || current) over the behaviour's samples, token means: k1 = -d (verl's ppo_kl; an unbiased
        # estimate that can be negative) and k3 = (r - 1) - d (never negative; Schulman's low-variance estimator)
        d = batch.log_ratio()
        metrics["kl_behavior"] = (masked(-d, batch.mask).sum() / n_valid).item()
        metrics["kl_behavior_k3"] = (masked(torch.expm1(d) - d, batch.mask).sum() / n_valid).item()
        if self.beta > 0:
            if batch.ref_logp is None:
                raise ValueError(
                    f"objective {self.name!r} has beta={self.beta} > 0 but the batch has no ref_logp"
                )
            kl = reference_kl(batch, self.kl_estimator)
            term = aggregate(kl, batch, self.kl_aggregation or self.aggregation, correct=False)
            loss = loss + self.reference_kl_coef() * term
            metrics["kl_ref"] = (masked(kl, batch.mask).sum() / n_valid).item()
        return ObjectiveOutput(loss=loss, metrics=metrics)

    def _policy_loss_named(self, batch: PolicyBatch):
        """:meth:`policy_loss` on ``batch``; where it raises an error about None while the batch lacks an input the
        loop passes only to an objective that declares it (UNDECLARED_INPUTS), the error (its type and traceback
        unchanged) carries a note naming the declaration: Python's NoneType message alone does not say it."""
        try:
            return self.policy_loss(batch)
        except (TypeError, AttributeError) as e:
            absent = [f"{' or '.join(f'batch.{f}' for f in fields)}, declare {declaration} = True"
                      for declaration, fields in UNDECLARED_INPUTS.items()
                      if not getattr(self, declaration) and any(getattr(batch, f) is None for f in fields)]
            if "NoneType" in str(e) and absent:
                e.add_note(f"objective {self.name!r}: if policy_loss reads {'; if it reads '.join(absent)} on its "
                           "class (the loop passes these only to an objective that declares them)")
            raise

    def _checked_output(self, output) -> tuple[Tensor, dict[str, float]]:
        """:meth:`policy_loss`'s output when it is (a 0-dim loss tensor, a dict of metrics that are numbers); else one
        line naming what is wrong and the fix, at the first loss rather than where the metrics are written."""
        if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], dict)):
            raise TypeError(f"objective {self.name!r}: policy_loss must return (loss, metrics), a 0-dim tensor and a "
                            f"dict of floats; it returned {type(output).__name__}")
        loss, metrics = output
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise ValueError(f"objective {self.name!r}: policy_loss returned a loss of shape "
                             f"{list(getattr(loss, 'shape', []))} ({type(loss).__name__}); reduce it to one number "
                             "with aggregate or sequence_aggregate")
        for key, value in metrics.items():
            if not isinstance(value, int | float):
                raise TypeError(f"objective {self.name!r}: metric {key!r} is a {type(value).__name__}, not a number: "
                                "report a float (a tensor's .item())")
        return loss, metrics

    @classmethod
    def hyperparameters(cls) -> dict[str, object]:
        params = {f.name: f.default for f in dataclasses.fields(cls)}
        if params.get("aggregation") == "":
            params["aggregation"] = cls.default_aggregation
        return params

    @classmethod
    def hyperparameter_kinds(cls) -> dict[str, type]:
        """Each hyperparameter's declared kind (float, int, bool or str: :data:`HYPERPARAMETER_KINDS`), as its field
        is annotated. A float hyperparameter given as an integer is that float (``__post_init__`` converts it)."""
        hints = _type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# What an objective may need of the trainer that runs it beyond log-probs and advantages (``Objective.needs``); each
# trainer declares the ones it provides (harness/loop/backends.py BACKENDS, the gradient lab) and
# :func:`lifecycle_unsupported` checks an objective against them before anything starts
NEEDS = {
    "state": "keeps state of its own across updates (its lifecycle hooks, its state in every checkpoint)",
    "hidden_states": "reads the policy's hidden states",
    "reference": "reads the reference policy's log-probs whatever its beta",
}
# The declarations of an objective's class -> PolicyBatch's inputs the loop fills only for one that declares it
UNDECLARED_INPUTS = {"needs_reference": ("ref_logp",), "needs_hidden_states": ("hidden", "hidden_of")}
LIFECYCLE_HOOKS = ("setup", "trainable_parameters", "after_optimizer_step", "after_update", "state_dict",
                   "load_state_dict")


def lifecycle_unsupported(objective: type[Objective], trainer: str, provides: frozenset[str]) -> str | None:
    """Why ``trainer`` (e.g. "backend trl", "lab") cannot run ``objective`` (one sentence, the caller adds the fix), or
    None: the needs the objective declares (:meth:`Objective.needs`) that the trainer does not provide."""
    missing = sorted(objective.needs() - provides)
    if not missing:
        return None
    return (f"{trainer}: objective {objective.name!r} {' and '.join(NEEDS[m] for m in missing)}, which {trainer} does "
            "not provide")


def check_lifecycle_declared(name: str, cls: type[Objective]) -> None:
    """An objective that implements a lifecycle hook declares ``stateful`` (so no trainer that lacks the hooks runs it
    silently without adapting or saving), and a stateful one implements ``state_dict`` and ``load_state_dict`` (so a
    resume restores it)."""
    hooks = [h for h in LIFECYCLE_HOOKS if getattr(cls, h) is not getattr(Objective, h)]
    if hooks and not cls.stateful:
        raise ValueError(f"objective {name!r} implements {', '.join(hooks)} but does not declare stateful = True")
    missing = [h for h in ("state_dict", "load_state_dict") if h not in hooks]
    if cls.stateful and missing:
        raise ValueError(f"objective {name!r} declares stateful = True but does not implement {' and '.join(missing)} "
                         "(a resumed run could not restore its state)")


HYPERPARAMETER_KINDS = (float, int, bool, str)  # what a hyperparameter field may be (anything else: a ClassVar)
KIND_WORDS = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}  # each kind, in a message


def check_declared(name: str, cls) -> None:
    """Before a class is registered: that it is an Objective, the lifecycle hooks it declares (each refusal one line
    naming the objective and what to change; the registry checks the name)."""
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise TypeError(f"objective {name!r}: {cls!r} is not a subclass of objectives.base.Objective")
    check_lifecycle_declared(name, cls)


def as_dataclass(name: str, cls: type[Objective]) -> type[Objective]:
    """``cls`` as a dataclass of its hyperparameters, each with a default and of a kind :meth:`Objective._checked`
    checks (float, int, bool, str)."""
    if "__dataclass_fields__" not in cls.__dict__:
        try:
            cls = dataclass(cls)
        except TypeError as error:  # the base's fields all have defaults, so a field without one comes after them
            raise TypeError(f"objective {name!r}: {error}: give every hyperparameter a default (scale: float = 1.0)"
                            ) from None
    hints = _type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if kind not in HYPERPARAMETER_KINDS:
            shown = kind.__name__ if isinstance(kind, type) else kind
            raise TypeError(f"objective {name!r}: hyperparameter {field.name} is annotated {shown}; a "
                            "hyperparameter is a float, int, bool or str (anything else: a ClassVar, or an attribute "
                            "set in __post_init__ or setup)")
        if not of_kind(field.default, kind):
            raise TypeError(f"objective {name!r}: hyperparameter {field.name}'s default {field.default!r} is not "
                            f"{KIND_WORDS[kind]}, as its annotation {kind.__name__} says: give a default of that kind")
    return cls


def of_kind(value, kind: type) -> bool:
    """Whether ``value`` is a hyperparameter value of ``kind`` (:data:`HYPERPARAMETER_KINDS`): a float takes an
    integer (it is converted), no number takes a bool."""
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def check_plain_attributes(name: str, cls: type[Objective]) -> None:
    """Refuse a number or string set on the class without an annotation, unless it overrides one of the base's
    ClassVars (``default_aggregation = "token_mean"``): dataclass leaves such an attribute out of the hyperparameters
    (``scale = 1.0``), or keeps an inherited hyperparameter's old default under it (``clip_high = 0.28``), silently."""
    own = cls.__dict__.get("__annotations__", {})
    hints = typing.get_type_hints(cls)
    for attr, value in vars(cls).items():
        if attr.startswith("_") or attr.isupper() or attr in own or not isinstance(value, int | float | str):
            continue
        if typing.get_origin(hints.get(attr)) is ClassVar:
            continue
        inherited = " (the inherited hyperparameter keeps its default)" if attr in hints else ""
        raise TypeError(f"objective {name!r}: {attr} = {value!r} has no annotation, so it is no hyperparameter"
                        f"{inherited}: write {attr}: {type(value).__name__} = {value!r}, or ClassVar[...] for a "
                        "constant")


def register_objective(name: str):
    """Class decorator: make the class a dataclass of its hyperparameters and register it under ``name``."""

    register = OBJECTIVES.register(name)  # refuses a name a config could not give

    def decorator(cls):
        documented = (getattr(sys.modules.get(cls.__module__), "__doc__", None), cls.__dict__.get("__doc__"))
        if not any(isinstance(doc, str) and doc.strip() for doc in documented):  # the site's page shows the module's
            raise TypeError(f"objective {name!r}: neither {cls.__module__} nor {cls.__qualname__} has a docstring; "
                            "write its formula, its paper (arXiv id) and its reference implementation (repo, path, "
                            "commit) in its module's (README.md, Adding an objective)")
        check_declared(name, cls)
        legacy = cls.__dict__.get("aggregation")
        if isinstance(legacy, str) and "aggregation" not in cls.__dict__.get("__annotations__", {}):
            cls.default_aggregation = legacy  # an old-style ``aggregation = "..."`` class attribute: its default
            delattr(cls, "aggregation")
        for mode in (cls.default_aggregation, cls.kl_aggregation, *cls.aggregations):
            if mode is not None and mode not in AGGREGATIONS:
                raise ValueError(f"objective {name!r}: unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")
        if cls.default_aggregation not in cls.aggregations:
            raise ValueError(f"objective {name!r}: default_aggregation {cls.default_aggregation!r} is not among "
                             f"its aggregations {cls.aggregations}")
        if cls.ratio_level not in RATIO_LEVELS or (cls.ratio_level == "other") != bool(cls.ratio_note):
            raise ValueError(f"objective {name!r}: ratio_level must be one of {RATIO_LEVELS}, with a ratio_note "
                             f"exactly when it is 'other'; got {cls.ratio_level!r}, {cls.ratio_note!r}")
        if cls.policy_loss is Objective.policy_loss:
            raise TypeError(f"objective {name!r}: {cls.__qualname__} defines no policy_loss(self, batch) -> (loss, "
                            "metrics)")
        check_plain_attributes(name, cls)
        cls.name = name
        return register(as_dataclass(name, cls))

    return decorator


def sum_statistics(parts: list[dict[str, Tensor] | None]) -> dict[str, Tensor] | None:
    """The micro-batches' :meth:`Objective.minibatch_statistics`, summed key by key (None if they are None)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return {key: sum(p[key] for p in parts) for key in parts[0]}


def estimator_name(objective: str, advantage: str | None) -> str:
    """The advantage estimator a run of ``objective`` uses: ``advantage`` (a config's ``objective.advantage``, a lab's
    ``advantage`` key) when given, else the objective's ``default_advantage``."""
    return advantage or OBJECTIVES.get(objective).default_advantage


def reads_reference_policy(objective: Objective, estimator: Callable) -> bool:
    """Whether a run of ``objective`` with advantage ``estimator`` needs the reference policy: a KL term (beta > 0),
    an objective that reads its log-probs (``needs_reference``: A*-PO), an estimator that samples it
    (``reference_samples``)."""
    return objective.beta > 0 or objective.needs_reference or reference_samples(estimator) > 0


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


SHARED_HYPERPARAMETERS = tuple(f.name for f in dataclasses.fields(Objective))  # every objective's: beta, aggregation...


def alias_of(name: str) -> tuple[str, dict[str, object]] | None:
    """``(parent, changed defaults)`` when objective ``name`` is another registered objective under other defaults,
    registered in that objective's own module (``bnpo``: ``grpo`` with ``aggregation=token_mean``); else None. The
    changed defaults include ``advantage`` when the default advantage estimator differs."""
    cls = OBJECTIVES.get(name)
    parent = next((p for p in cls.__mro__[1:] if "name" in p.__dict__ and p.name in OBJECTIVES), None)
    if parent is None or parent.__module__ != cls.__module__:
        return None
    mine, theirs = cls.hyperparameters(), parent.hyperparameters()
    changed = {k: v for k, v in mine.items() if theirs.get(k, v) != v}
    if cls.default_advantage != parent.default_advantage:
        changed["advantage"] = cls.default_advantage
    return parent.name, changed
