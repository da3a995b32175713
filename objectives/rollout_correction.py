"""Rollout correction: the importance weight between the trainer's proximal policy and the sampler, for every
objective (``train.rollout_correction``; a loop option, not an objective: nothing here is registered).

When the behaviour log-probs come from a sampler that differs from the trainer (a bf16 copy, vLLM, FP8), the
loop recomputes the trainer's log-probs ``old_logp`` before updating (the proximal policy of decoupled PPO)
and weights each token's loss by the ratio between the two, as verl's rollout correction
(``verl/trainer/ppo/rollout_corr_helper.py``, "decoupled" mode) and TRL's ``vllm_importance_sampling_*``
(``GRPOTrainer._generate_and_score_completions``) do. With d_t = old_logp_t - sampler_logp_t on valid tokens:

    rho_t = exp(d_t)                                   token modes
    rho_i = exp(sum_t d_t) = prod_t rho_t              sequence modes: the product (verl's ``rollout_is:
                                                       sequence`` and TRL's ``sequence_*``; verl's geometric mean
                                                       exists only for its rejection sampling), broadcast to the
                                                       tokens of sequence i
    w = min(rho, C)                                    *_truncate (truncated IS; verl ``rollout_is``, TRL)
    w = rho * 1[C_low <= rho <= C]                     *_mask (masked IS; TRL's ``*_mask``, verl's IS + RS)

C = ``threshold`` (verl's ``rollout_is_threshold`` default 2; TRL's ``vllm_importance_sampling_clip_max``
default 3). C_low = ``threshold_lower``; unset, it is 1/C for the mask modes (two-sided) and absent for the truncate
modes (upper truncation only, as verl's ``rollout_is`` and TRL's default). The mask modes' unset C_low = 1/C is the
rejection-sampling bound of verl 0.6.1 to 0.7.0 (``rollout_rs`` token / sequence with ``rollout_rs_threshold`` and
``rollout_rs_threshold_lower``, whose default is 1 / upper; ``verl/trainer/ppo/rollout_corr_helper.py``
``compute_rollout_rejection_mask``, tag v0.7.0): our keep set [C_low, C] equals its mask. verl >= 0.8 (commit
97eac90) replaced that API by divergence rules (``rollout_rs`` token_k1 / seq_sum_k1 / ... with
``rollout_rs_threshold`` strings, "lower_upper" for the k1 rules) that map asymmetric bounds differently, so
our mask modes no longer equal current verl's rejection sampling except through IcePop (below). Set, C_low is
TRL's ``vllm_importance_sampling_clip_min``, which defaults to None in TRL 1.16 (no lower bound: TRL's ``*_mask``
modes mask only ratios above C by default, our threshold_lower=0; with a truncate mode, a lower clamp
w = clamp(rho, C_low, C)). Requires 0 <= C_low <= 1 <= C, C_low < C, so that a token with no mismatch (rho = 1)
keeps weight exactly 1.

IcePop (OpenRLHF ``--algo.advantage.is_correction_type icepop``, ``openrlhf/models/loss.py``, default bounds [0.5,
5.0]; verl's ``rollout_is: token`` with ``rollout_is_threshold: "0.5_5.0"``, ``compute_rollout_correction_weights``
in verl 0.10): w_t = rho_t if 0.5 <= rho_t <= 5 else 0, per token, is the mode ``token_mask`` with ``threshold: 5``,
``threshold_lower: 0.5`` (tested against both). It is a rollout correction, not an objective: it depends only on the
trainer's old log-probs and the sampler's, so it is computed once per rollout batch and multiplies any objective's
loss, as both references apply it to whatever loss is configured. Off-policy sequence masking (OPSM) is instead an
objective option (``Objective.off_policy_mask``, objectives/base.py): its test reads the current policy's log-probs
and the advantage's sign at every update (TRL's ``get_off_policy_mask`` inside ``_compute_loss``).

Decoupled PPO (AReaL, Fu et al., arXiv 2505.24298; ``decoupled_ppo``): the objective's ratio and clip against the
proximal policy (``old_logp``, recomputed), times the behaviour weight w = pi_prox / pi_behaviour taken at the level
of the objective's own ratio (``Objective.ratio_level``), masked outside [C_low, C] (C_low unset: no lower bound):

    w_t = rho_t * 1[rho_t <= C]                          ratio_level "token"
    w_i = g_i * 1[g_i <= C],  g_i = exp(mean_t d_t)      ratio_level "sequence": the geometric mean, as the
                                                         objective's own ratio (GSPO), broadcast to sequence i

Reference: AReaL 4aef98d8 (inclusionAI/AReaL) ``areal/utils/functional/functional.py`` ``ppo_actor_loss_fn`` with
``apply_rejection_sampling`` (``use_decoupled_loss: true``; ``rejection_sampling`` level token, action mask, metric
ratio, upper C: its former default ``behave_imp_weight_cap: 5`` with ``token_mask``; level sequence with metric
ratio and agg mean: the geometric-mean weight and mask). At ratio_level "token" the mode equals ``token_mask`` with
``threshold_lower: 0``; it differs from the other modes in following the objective's level (tested).

The weights are detached, 0 on padding, and computed once per rollout batch (they do not depend on the current
policy, so micro-batching leaves them unchanged). A masked token or sequence has weight 0 and keeps its place in
the token / sequence counts the loss is normalised by (TRL's convention: its ``*_mask`` zeroes the ratio and keeps
``completion_mask``). verl instead removes rejected tokens from ``response_mask``, so its denominators count only
the kept tokens (its token-mean loss is ours divided by the kept fraction) and its objectives' own statistics
(GSPO's sequence mean, ...) skip them; here the objective sees the whole rollout and only the weight changes.

Metrics (:func:`correction_metrics`, over valid tokens unless stated; the ratio clamped to exp(+-20) as verl's
``SAFETY_BOUND`` so that statistics stay finite): ``rollout_corr_ratio_mean/min/max/std`` of rho at the mode's
level (tokens, or one value per valid sequence), ``rollout_corr_weight_mean`` (w over valid tokens),
``rollout_corr_truncated_frac`` / ``rollout_corr_masked_frac`` (valid tokens whose weight was truncated /
masked; every token of a sequence at a sequence level), ``rollout_corr_chi2_token`` = E_t[rho_t^2] - 1 and
``rollout_corr_chi2_seq`` = E_i[(prod_t rho_t)^2] - 1 (verl's chi2_token / chi2_seq: the chi-square divergence
of the trainer's old policy from the sampler, the variance of the IS weights), ``rollout_corr_k3_kl`` = E_t[rho_t
- log rho_t - 1] (verl's k3_kl: KL(sampler || trainer's old policy), >= 0).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

CORRECTION_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "decoupled_ppo")
DEFAULT_THRESHOLD = 2.0  # verl's rollout_is_threshold
SAFETY_BOUND = 20.0  # |log rho| bound of the metrics (verl's); the weights use rho itself, as TRL


def lower_threshold(mode: str, threshold: float, threshold_lower: float | None) -> float | None:
    """C_low of ``mode``: ``threshold_lower`` if set, else 1/C for the mask modes (verl) and None (no lower bound)
    for the truncate modes."""
    if threshold_lower is not None:
        return float(threshold_lower)
    return 1.0 / threshold if mode.endswith("_mask") else None


def check_settings(mode: str, threshold: float, threshold_lower: float | None) -> str | None:
    """What is wrong with the settings (one sentence naming the key), or None."""
    if mode not in CORRECTION_MODES:
        return f"train.rollout_correction.mode must be one of {', '.join(CORRECTION_MODES)}, got {mode!r}"
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold) \
            or threshold < 1:
        return (f"train.rollout_correction.threshold must be a finite number >= 1 (a ratio of 1, no mismatch, keeps "
                f"weight 1), got {threshold!r}")
    if threshold_lower is not None and (isinstance(threshold_lower, bool)
                                        or not isinstance(threshold_lower, int | float)
                                        or not 0 <= threshold_lower <= 1 or threshold_lower >= threshold):
        return (f"train.rollout_correction.threshold_lower must be in [0, 1] and below threshold={threshold} "
                f"(unset: 1/threshold for the mask modes), got {threshold_lower!r}")
    low = lower_threshold(mode, threshold, threshold_lower)
    if low is not None and low >= threshold:
        return (f"train.rollout_correction: the mask keeps ratios in [threshold_lower, threshold] = [{low}, "
                f"{threshold}], which is empty or a single point; raise threshold above 1")
    return None


def log_ratio(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> Tensor:
    """d = old_logp - sampler_logp on valid tokens, exactly 0 on padding, [B, T] (detached)."""
    mask = mask.bool()
    return torch.where(mask, old_logp.detach() - sampler_logp.detach(), torch.zeros_like(old_logp))


def level_log_ratio(d: Tensor, mask: Tensor, mode: str, ratio_level: str = "token") -> Tensor:
    """log rho at ``mode``'s level from d [B, T] (0 on padding): d itself for the token modes (and decoupled_ppo at
    ratio_level token), sum_t d_t [B, 1] for the sequence modes, mean_t d_t [B, 1] for decoupled_ppo at ratio_level
    sequence."""
    if mode.startswith("token") or (mode == "decoupled_ppo" and ratio_level == "token"):
        return d
    if mode == "decoupled_ppo":
        return d.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1).to(d.dtype)
    return d.sum(-1, keepdim=True)


def correction_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, mode: str, threshold: float,
                       threshold_lower: float | None = None, ratio_level: str = "token") -> Tensor:
    """The correction weight w [B, T] of ``mode`` (module docstring): detached, in old_logp's dtype, 0 on padding;
    exactly 1 on every valid token when old_logp == sampler_logp (no sampler difference). ``mode='none'``: ones.
    ``ratio_level``: the objective's (``Objective.ratio_level``), the level decoupled_ppo takes."""
    if check_settings(mode, threshold, threshold_lower):
        raise ValueError(check_settings(mode, threshold, threshold_lower))
    mask = mask.bool()
    if mode == "none":
        return mask.to(old_logp.dtype)
    d = log_ratio(old_logp, sampler_logp, mask)
    level = level_log_ratio(d, mask, mode, ratio_level)
    rho = torch.exp(level)  # a sequence's product may overflow to inf: it is then truncated to C or masked
    low = lower_threshold(mode, threshold, threshold_lower)
    if mode.endswith("_truncate"):
        weight = rho.clamp(min=low, max=threshold)
    else:
        keep = (rho <= threshold) if low is None else (rho >= low) & (rho <= threshold)
        weight = torch.where(keep, rho, torch.zeros_like(rho))
    return torch.where(mask, weight.expand_as(d), torch.zeros_like(d))


def correction_metrics(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, mode: str, threshold: float,
                       threshold_lower: float | None = None, weights: Tensor | None = None,
                       ratio_level: str = "token") -> dict[str, float]:
    """The metrics of the correction (module docstring), in float64; ``weights`` = :func:`correction_weights`'s
    (computed if not given). Empty batches (no valid token) give {}."""
    mask = mask.bool()
    if not mask.any():
        return {}
    if weights is None:
        weights = correction_weights(old_logp, sampler_logp, mask, mode, threshold, threshold_lower, ratio_level)
    d = log_ratio(old_logp, sampler_logp, mask).double()
    n = mask.sum().item()
    valid_seq = mask.any(-1)
    token_rho = torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_log = d.sum(-1)
    seq_rho = torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    metrics = {
        "rollout_corr_chi2_token": (token_rho.square() * mask).sum().item() / n - 1.0,
        "rollout_corr_chi2_seq": seq_rho[valid_seq].square().mean().item() - 1.0,
        "rollout_corr_k3_kl": (torch.where(mask, torch.expm1(d) - d, torch.zeros_like(d))).sum().item() / n,
        "rollout_corr_weight_mean": (weights.double() * mask).sum().item() / n,
    }
    sequence = mode.startswith("sequence") or (mode == "decoupled_ppo" and ratio_level == "sequence")
    if sequence:  # the sequence's level: the product, or decoupled_ppo's geometric mean
        seq_log = level_log_ratio(d, mask, mode, ratio_level)[:, 0]
        seq_rho = torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    rho = seq_rho[valid_seq] if sequence else token_rho[mask]
    metrics.update({"rollout_corr_ratio_mean": rho.mean().item(), "rollout_corr_ratio_min": rho.min().item(),
                    "rollout_corr_ratio_max": rho.max().item(),
                    "rollout_corr_ratio_std": rho.std(correction=0).item() if rho.numel() > 1 else 0.0})
    if mode == "none":
        return metrics
    # which tokens had their weight changed, judged in log space (exact for the sequence products, which may
    # overflow): truncated above C (or below C_low), or masked outside [C_low, C]
    level = d if not sequence else seq_log[:, None].expand_as(d)
    low = lower_threshold(mode, threshold, threshold_lower)
    outside = level > math.log(threshold)
    if low is not None:
        outside = outside | (level < (math.log(low) if low > 0 else -math.inf))
    key = "rollout_corr_truncated_frac" if mode.endswith("_truncate") else "rollout_corr_masked_frac"
    metrics[key] = (outside & mask).sum().item() / n
    return metrics


# ---------------------------------------------------------------------------------------------------------------------
# Trust-region masking (Li et al., "Trust Region Masking for Long-Horizon LLM Reinforcement Learning",
# arXiv 2512.23075): verl's divergence rules ``rollout_rs`` (``verl/trainer/ppo/rollout_corr_helper.py``
# ``compute_rollout_rejection_mask``, verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9; the k3 average and
# the max "veto" added by 97eac90, PR 4544), its k2 / k3 ones (single upper bounds). With
# d_t = clamp(old_logp_t - sampler_logp_t, -20, 20) on valid tokens:
#
#     k2_t = d_t^2 / 2          k3_t = exp(d_t) - 1 - d_t      (>= 0; its mean estimates KL(sampler || old policy))
#     token_kX:    keep token t         if kX_t <= bound
#     seq_sum_kX:  keep all of i        if sum_t kX_t <= bound
#     seq_mean_kX: keep all of i        if mean_t kX_t <= bound      (verl divides by L_i + 1e-8, here by L_i)
#     seq_max_kX:  keep all of i        if max_t kX_t <= bound       (the veto: one token past it drops the
#                                                                     sequence; k2 is symmetric in log rho, as the
#                                                                     paper's |log rho| detector)
#
# Several rules: a token is kept only if every rule keeps it. The keep mask multiplies the correction weight, so a
# rejected token keeps its place in the counts (verl removes it from ``response_mask`` and its denominators). The
# paper's trust-region masking is ``seq_mean_k3`` (average) with ``seq_max_k2`` (veto); verl's k1 rules are bounds on
# the ratio, which the *_mask modes above cover.
REJECTION_RULES = ("token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
                   "seq_max_k3")


def check_rejection(rules: list[str], thresholds: list[float]) -> str | None:
    """What is wrong with the trust-region rules and their bounds (one sentence naming the key), or None."""
    unknown = [r for r in rules if r not in REJECTION_RULES]
    if unknown:
        return (f"train.rollout_correction.rejection: unknown rule {unknown[0]!r}; choose among "
                f"{', '.join(REJECTION_RULES)}")
    repeated = [r for i, r in enumerate(rules) if r in rules[:i]]
    if repeated:  # the tokens within both bounds: the tighter rule alone, under another run id
        return (f"train.rollout_correction.rejection lists {repeated[0]} more than once: a token must pass every rule, "
                "so a repeated rule is its tightest bound alone; give each rule once")
    if rules and len(thresholds) not in (1, len(rules)):
        return (f"train.rollout_correction.rejection_threshold needs one bound for all rules or one per rule "
                f"({len(rules)}), got {len(thresholds)}")
    bad = [t for t in thresholds if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < math.inf]
    if bad or (thresholds and not rules):
        return ("train.rollout_correction.rejection_threshold: positive finite bounds, given with rules in "
                f"train.rollout_correction.rejection, got {list(thresholds)}")
    return None


def canonical_rejection(rules: list[str], thresholds: list[float]) -> tuple[list[str], list[float]]:
    """The trust-region rules in REJECTION_RULES' order with their bounds, one bound if all are equal: the same
    computation in any order or spelling (a token must pass every rule), so the same run. Settings
    :func:`check_rejection` refuses come back as given."""
    if check_rejection(rules, thresholds) or not rules:
        return rules, thresholds
    bounds = [float(t) for t in (thresholds * len(rules) if len(thresholds) == 1 else thresholds)]
    pairs = sorted(zip(rules, bounds, strict=True), key=lambda pair: REJECTION_RULES.index(pair[0]))
    ordered = [bound for _, bound in pairs]
    return [rule for rule, _ in pairs], ordered[:1] if len(set(ordered)) == 1 else ordered


def rejection_keep(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, rules: list[str],
                   thresholds: list[float]) -> Tensor:
    """Bool [B, T]: the valid tokens every trust-region rule keeps (block comment above); detached."""
    problem = check_rejection(rules, thresholds)
    if problem:
        raise ValueError(problem)
    mask = mask.bool()
    d = log_ratio(old_logp, sampler_logp, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    divergence = {"k2": 0.5 * d.square(), "k3": torch.expm1(d) - d}
    keep = mask.clone()
    for rule, bound in zip(rules, thresholds * len(rules) if len(thresholds) == 1 else thresholds, strict=True):
        level, estimator = rule.rsplit("_", 1)
        per_token = torch.where(mask, divergence[estimator], torch.zeros_like(d))
        if level == "token":
            keep &= per_token <= bound
            continue
        if level == "seq_sum":
            statistic = per_token.sum(-1)
        elif level == "seq_mean":
            statistic = per_token.sum(-1) / mask.sum(-1).clamp(min=1)
        else:  # seq_max
            statistic = torch.where(mask, per_token, torch.full_like(d, -math.inf)).amax(-1).clamp(min=0)
        keep &= (statistic <= bound)[:, None]
    return keep


def rejection_metrics(keep: Tensor, mask: Tensor) -> dict[str, float]:
    """``rollout_corr_rejected_frac`` (valid tokens the trust-region rules dropped) and
    ``rollout_corr_rejected_seq_frac`` (valid sequences with a dropped token): verl's ``rollout_rs_masked_fraction`` /
    ``rollout_rs_seq_masked_fraction``."""
    mask = mask.bool()
    dropped, valid_seq = mask & ~keep, mask.any(-1)
    return {"rollout_corr_rejected_frac": dropped.sum().item() / max(mask.sum().item(), 1),
            "rollout_corr_rejected_seq_frac": dropped.any(-1).sum().item() / max(valid_seq.sum().item(), 1)}
