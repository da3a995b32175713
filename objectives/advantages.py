"""Advantage estimators, registered by name: rewards [B], group ids [B] (same id = same prompt) and the completion
lengths [B] (valid tokens L_i of each response) in, [B] out: ``estimator(rewards, group_ids, lengths)``. The
optimal token baseline also reads the old policy's per-token distribution and gives [B, T], ReMax a greedy
completion's reward per prompt, GDPO the reward's components (``loop_inputs``: what only the native training loop
provides).

Most estimators ignore the lengths; those that weigh or whiten by tokens (REINFORCE++, REINFORCE++-baseline, OPO)
raise a ValueError without them. A group of size 1 has no group baseline: its advantage is 0 (no learning signal)
for every group-centred estimator; REINFORCE++ and REINFORCE++-baseline (made for one sample per prompt) keep it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from objectives.registry import Registry

AdvantageEstimator = Callable[..., Tensor]  # (rewards [B], group_ids [B], lengths [B] | None = None) -> [B]
ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator")

STD_EPS = 1e-6
TRL_STD_EPS = 1e-4  # TRL's std + 1e-4: its batch scaling (batch_std) and both of gdpo's normalisations


def group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, unbiased group std (0 for a group of one) and group size, each [B].

    A group whose rewards are all equal gets exactly its reward as mean and exactly 0 as std (a float sum
    such as 0.1 + 0.1 + 0.1 = 0.30000000000000004 would otherwise leave advantages of ~1e-11 / 1e-6).
    """
    _, index = torch.unique(group_ids, return_inverse=True)
    rewards = rewards.to(torch.float64)
    size = torch.bincount(index).to(rewards.dtype)
    total = torch.zeros_like(size).index_add_(0, index, rewards)
    low = torch.full_like(size, torch.inf).scatter_reduce(0, index, rewards, "amin")
    high = torch.full_like(size, -torch.inf).scatter_reduce(0, index, rewards, "amax")
    mean = torch.where((low == high)[index], rewards, (total / size)[index])
    sq = torch.zeros_like(size).index_add_(0, index, (rewards - mean) ** 2)
    std = torch.where(size > 1, (sq / (size - 1).clamp(min=1)).sqrt(), torch.zeros_like(size))
    return mean, std[index], size[index]


def _in_dtype_of(adv: Tensor, like: Tensor) -> Tensor:
    """``adv`` in the rewards' float dtype (float32 for integer rewards)."""
    return adv.to(like.dtype if like.is_floating_point() else torch.float32)


def _singletons_to_zero(adv: Tensor, size: Tensor, like: Tensor) -> Tensor:
    return _in_dtype_of(torch.where(size > 1, adv, torch.zeros_like(adv)), like)


@ADVANTAGES.register("grpo")
def grpo_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None) -> Tensor:
    """A_i = (R_i - mean_g) / (std_g + 1e-6), unbiased group std (DeepSeekMath; verl, TRL default)."""
    mean, std, size = group_stats(rewards, group_ids)
    return _singletons_to_zero((rewards - mean) / (std + STD_EPS), size, rewards)


@ADVANTAGES.register("mean_only")
def mean_only_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None) -> Tensor:
    """A_i = R_i - mean_g (Dr. GRPO: no std division, which biases towards easy/hard prompts)."""
    mean, _, size = group_stats(rewards, group_ids)
    return _singletons_to_zero(rewards - mean, size, rewards)


@ADVANTAGES.register("rloo")
def rloo_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None) -> Tensor:
    """A_i = R_i - mean_{j != i} R_j = n/(n-1) (R_i - mean_g) (leave-one-out baseline)."""
    mean, _, size = group_stats(rewards, group_ids)
    return _singletons_to_zero(size / (size - 1).clamp(min=1) * (rewards - mean), size, rewards)


@ADVANTAGES.register("batch_std")
def batch_std_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None) -> Tensor:
    """A_i = (R_i - mean_g) / (std_batch + 1e-4): group-centred, scaled by the unbiased std of the whole
    batch's rewards (TRL ``scale_rewards="batch"``, huggingface/trl v1.16.0 trl/trainer/grpo_trainer.py
    ``_generate_and_score_completions``, with TRL's 1e-4, not the 1e-6 of the verl-derived group estimators: the two
    differ where the batch std is near 1e-4, e.g. rewards that differ only by small shaping terms)."""
    mean, _, size = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    std = r.std() if r.numel() > 1 else r.new_zeros(())
    return _singletons_to_zero((r - mean) / (std + TRL_STD_EPS), size, rewards)


@ADVANTAGES.register("grpo_passk")
def grpo_passk_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None) -> Tensor:
    """Pass@k training (Chen et al., arXiv 2503.19595; verl ``compute_grpo_passk_outcome_advantage``, verl-project/verl
    1dda039b, ``norm_adv_by_std_in_grpo`` True): in each group only the best response gets an advantage,
    A = (R_max - R_second) / (std_g + 1e-6) (unbiased std); every other response gets 0. Ties for the best give 0
    (R_max = R_second), so which tied response verl's ``topk`` would pick does not matter. verl raises for a group of
    one; here it gets 0, like every estimator."""
    _, index = torch.unique(group_ids, return_inverse=True)
    r = rewards.to(torch.float64)
    _, std, size = group_stats(rewards, group_ids)
    adv = torch.zeros_like(r)
    for g in range(int(index.max()) + 1 if len(index) else 0):
        members = (index == g).nonzero().squeeze(-1)
        if len(members) < 2:
            continue
        top = torch.sort(r[members], descending=True, stable=True)
        adv[members[top.indices[0]]] = (top.values[0] - top.values[1]) / (std[members[0]] + STD_EPS)
    return _singletons_to_zero(adv, size, rewards)


@ADVANTAGES.register("gpg")
def gpg_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None) -> Tensor:
    """GPG (Chu et al., arXiv 2504.02546; verl ``compute_gpg_outcome_advantage``, verl-project/verl 1dda039b, f_norm 1):
    A_i = alpha (R_i - mean_g), alpha = B / max(1, number of nonzero rewards in the batch): no std division, the
    batch scaled up by the inverse share of rewarded responses. The authors' trainer (AMAP-ML/GPG) instead scales by the
    inverse share of responses in groups whose rewards differ (``inverse_alpha``) and also divides by the group std
    unless ``adjust_gd``: verl's reading is the one followed. A group of one gets 0 (verl: alpha R_i)."""
    mean, _, size = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    alpha = r.numel() / max(1, int(torch.count_nonzero(r)))
    return _singletons_to_zero(alpha * (r - mean), size, rewards)


MAXRL_EPS = 1e-6  # the authors' epsilon in the mean normaliser


@ADVANTAGES.register("maxrl")
def maxrl_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None) -> Tensor:
    """MaxRL, maximum-likelihood RL (Tajwar et al., arXiv 2602.02710): the group-centred reward divided by the group's
    mean reward instead of its std,

        A_i = (R_i - mean_g) / (mean_g + 1e-6)

    which, for binary rewards (mean_g = the group's pass rate p), makes the policy gradient an unbiased estimate of
    the gradient of the order-G truncation of the log-likelihood of success, log p (prompts with a low pass rate get
    ~1/p weight). References: the authors' tajwarfahim/maxrl ``verl/trainer/ppo/core_algos.py``
    ``compute_maxrl_outcome_advantage`` (c0698ebb439a81ae1c6b01a842df3f2541816b4d), followed; SkyRL
    ``skyrl/backends/skyrl_train/utils/ppo_utils.py`` ``compute_maxrl_advantage`` (NovaSky-AI/SkyRL
    a9564572eb8e91076be43c1bd5e4615e3de17265, the same formula); prime-rl
    ``src/prime_rl/orchestrator/algo/max_rl.py`` (559b44772e471d1538537b8805cc77f3824a5e64: no epsilon). Rewards must be
    >= 0 (binary in the paper; the config refuses ``task.overlong_buffer``, whose penalty makes them negative).
    Edge cases, where the three differ: a group whose mean is 0 (all rewards 0) gets 0 in all three; a group of one
    gets 0 here (our convention for every group-centred estimator; prime-rl: (R - R) / R = 0; SkyRL: R; the authors:
    R / 1e-6); equal rewards give exactly 0 (``group_stats``)."""
    mean, _, size = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    return _singletons_to_zero((r - mean) / (mean + MAXRL_EPS), size, rewards)


maxrl_advantage.nonnegative_rewards = True


# ----------------------------------------------------------------------------------------------------------------
# Estimators that need the completion lengths L_i (valid tokens of each response), pinned to verl's core_algos.py
# (volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7, verl/trainer/ppo/core_algos.py; the same functions as at
# verl-project/verl 1dda039b): verl's token-level [B, T] output (outcome reward on the last valid token) equals ours
# broadcast over each sequence's valid tokens.
# ----------------------------------------------------------------------------------------------------------------

WHITEN_EPS = 1e-8  # verl masked_whiten: (x - mean) * rsqrt(var + 1e-8)


def token_whiten(values: Tensor, lengths: Tensor) -> Tensor:
    """verl ``masked_whiten`` of a per-sequence value broadcast over each sequence's L_i tokens: mean and unbiased
    variance over all N = sum_i L_i tokens (a sequence weighs by its length), (v_i - mean) / sqrt(var + 1e-8) [B]."""
    v, n_i = values.to(torch.float64), lengths.to(torch.float64)
    n = n_i.sum()
    if n < 2:
        raise ValueError(f"token whitening needs at least 2 valid tokens in the batch, got {int(n)} (verl raises too)")
    mean = (n_i * v).sum() / n
    var = (n_i * (v - mean) ** 2).sum() / n * n / (n - 1)
    return (v - mean) / torch.sqrt(var + WHITEN_EPS)


def needed_lengths(lengths: Tensor | None, estimator: str) -> Tensor:
    """``lengths``, or a ValueError naming the estimator that needs them."""
    if lengths is None:
        raise ValueError(f"advantage estimator {estimator!r} needs the completion lengths: call it as "
                         "estimator(rewards, group_ids, lengths) with lengths = completion_mask.sum(-1)")
    return lengths


@ADVANTAGES.register("reinforce_plus_plus")
def reinforce_plus_plus_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None) -> Tensor:
    """REINFORCE++ (Hu, arXiv 2501.03262; verl ``compute_reinforce_plus_plus_outcome_advantage`` with gamma = 1,
    verl's default): the return of every token is the outcome reward R_i, whitened over the batch's tokens,
    A_i = (R_i - mean_tok) / sqrt(var_tok + 1e-8). No group baseline (made for one sample per prompt), so a group of
    one keeps its advantage. gamma < 1 makes the return per token (gamma^(L_i - 1 - t) R_i): not implemented."""
    del group_ids
    return _in_dtype_of(token_whiten(rewards, needed_lengths(lengths, "reinforce_plus_plus")), rewards)


@ADVANTAGES.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(rewards: Tensor, group_ids: Tensor,
                                           lengths: Tensor | None = None) -> Tensor:
    """REINFORCE++-baseline (verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``): R_i - mean_g, then
    whitened over the batch's tokens as :func:`reinforce_plus_plus_advantage`. verl's group of one has mean 0 (so
    R_i enters the whitening), followed here."""
    mean, _, size = group_stats(rewards, group_ids)
    centred = rewards.to(torch.float64) - torch.where(size > 1, mean, torch.zeros_like(mean))
    return _in_dtype_of(token_whiten(centred, needed_lengths(lengths, "reinforce_plus_plus_baseline")), rewards)


@ADVANTAGES.register("opo")
def opo_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None) -> Tensor:
    """OPO (Hao et al., arXiv 2505.23585; verl ``compute_opo_outcome_advantage``): the length-weighted group baseline,
    A_i = R_i - sum_g L_j R_j / sum_g L_j (the variance-optimal baseline when the gradient's norm grows with length).
    A group of one gets 0 (verl: R_i)."""
    _, index = torch.unique(group_ids, return_inverse=True)
    r, n_i = rewards.to(torch.float64), needed_lengths(lengths, "opo").to(torch.float64)
    _, _, size = group_stats(rewards, group_ids)
    num = r.new_zeros(int(index.max()) + 1).index_add_(0, index, n_i * r)
    den = torch.zeros_like(num).index_add_(0, index, n_i)
    low = torch.full_like(num, torch.inf).scatter_reduce(0, index, r, "amin")
    high = torch.full_like(num, -torch.inf).scatter_reduce(0, index, r, "amax")
    baseline = torch.where((low == high)[index], r, (num / den.clamp(min=1))[index])  # equal rewards: exactly 0
    return _singletons_to_zero(r - baseline, size, rewards)


# ----------------------------------------------------------------------------------------------------------------
# Estimators that read what only the native training loop provides, declared in ``loop_inputs``: the optimal token
# baseline the old policy's per-token distribution (``estimator(rewards, group_ids, lengths, old_logp=,
# sum_pi_squared=, mask=, correction=)``, [B, T] out; the behaviour forward then also gives sum pi^2,
# harness/loop/behaviour.py), ReMax a greedy completion's reward per prompt (``baselines=``; harness/loop/batch.py),
# GDPO the reward's components (``components=, weights=``; harness/loop/batch.py), A*-PO the rewards of the reference
# policy's completions of each row's prompt (``reference_rewards=``; harness/loop/batch.py).
# ----------------------------------------------------------------------------------------------------------------

OTB_EPS = 1e-8  # verl's epsilon in the baseline's denominator


SUM_PI_SQUARED_INPUT = "sum_pi_squared"  # old_logp, sum_pi_squared, mask, correction [B, T] of the old policy
GREEDY_BASELINE_INPUT = "greedy_baseline"  # baselines [B]: the reward of a greedy completion of each row's prompt
REWARD_COMPONENTS_INPUT = "reward_components"  # components [B, K] and their weights [K] (the reward = their sum)
# reference_rewards [B, n]: the rewards of n completions of each row's prompt sampled from the reference policy (the
# starting policy); n is the estimator's ``reference_samples`` attribute
REFERENCE_REWARDS_INPUT = "reference_rewards"


def loop_inputs(estimator: AdvantageEstimator) -> tuple[str, ...]:
    """What ``estimator`` reads beyond (rewards, group_ids, lengths), which only the native training loop provides
    (its ``loop_inputs`` attribute): ``SUM_PI_SQUARED_INPUT``, ``GREEDY_BASELINE_INPUT``; () for most."""
    return getattr(estimator, "loop_inputs", ())


def needs_nonnegative_rewards(estimator: AdvantageEstimator) -> bool:
    """Whether ``estimator`` assumes rewards >= 0 (MaxRL: its normaliser is the group's mean reward, a pass rate)."""
    return getattr(estimator, "nonnegative_rewards", False)


def needs_sum_pi_squared(estimator: AdvantageEstimator) -> bool:
    """Whether ``estimator`` reads the old policy's sum_v pi_v^2 per token (and gives [B, T] advantages)."""
    return SUM_PI_SQUARED_INPUT in loop_inputs(estimator)


def needs_reward_components(estimator: AdvantageEstimator) -> bool:
    """Whether ``estimator`` reads each reward component separately (GDPO)."""
    return REWARD_COMPONENTS_INPUT in loop_inputs(estimator)


def needs_greedy_baseline(estimator: AdvantageEstimator) -> bool:
    """Whether ``estimator`` reads the reward of one greedy completion per prompt (ReMax)."""
    return GREEDY_BASELINE_INPUT in loop_inputs(estimator)


def reference_samples(estimator: AdvantageEstimator) -> int:
    """How many completions of each prompt the reference policy samples for ``estimator`` (A*-PO's V*), 0 if it
    reads none (its ``reference_samples`` attribute, declared beside ``REFERENCE_REWARDS_INPUT``)."""
    return getattr(estimator, "reference_samples", 0) if REFERENCE_REWARDS_INPUT in loop_inputs(estimator) else 0


@ADVANTAGES.register("optimal_token_baseline")
def optimal_token_baseline_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None, *,
                                     old_logp: Tensor | None = None, sum_pi_squared: Tensor | None = None,
                                     mask: Tensor | None = None, correction: Tensor | None = None,
                                     handle_zero_tail: bool = True) -> Tensor:
    """Optimal Token Baseline (verl ``compute_optimal_token_baseline_advantage``, verl-project/verl
    1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py; epsilon 1e-8 and ``handle_zero_tail``
    True, verl's defaults: verl's default was False until 8acd940f1 (PR 5380) made it True): a baseline per token
    position t of each group, weighted by the cumulative path-variance proxy of each response,

        w_t = 1 - 2 pi_t + sum_v pi_v^2      (pi_t = exp(old_logp_t): ||score||^2 of the softmax at token t)
        W_t = sum_{j <= t, valid} w_j rho_j^2 (rho: the rollout-correction weights, when on; verl's rollout_is_weights)
        B_t = sum_g G_t W_t m_t / (sum_g W_t m_t + 1e-8),   A_t = (G_t - B_t) m_t     [B, T]
        zero tail: where a group's longest response is unique and longer than the second longest (L_2), its
                   B_t = 0 for t >= L_2 (there it is the only response, B_t would be ~G_t and A_t ~0)

    with G_t = R_i at every valid token (an outcome reward on the last token: the reward-to-go), ``old_logp`` and
    ``sum_pi_squared`` [B, T] from the trainer's old-policy forward at ``train.temperature`` (verl's actor
    ``calculate_sum_pi_squared``). A group of one gets 0 here (verl: G_t, no baseline), like every group-centred
    estimator; equal rewards give B_t = R exactly (verl: R up to the 1e-8), so 0, except in a zero tail, where
    A_t = R as verl's (a group of equal nonzero rewards pushes its unique longest response's tail).
    ``handle_zero_tail=False`` is verl's option (and its default before 8acd940f1); the loop uses the default.
    Under a rollout correction's masking rules a rejected token's weight is 0 in ``correction``, so it adds nothing
    to its row's W_t, but the row keeps its place in the group's baseline at that position (``mask`` is whole, as in
    every aggregation here); verl removes the token from the response mask, so there its row leaves the baseline."""
    if old_logp is None or sum_pi_squared is None or mask is None:
        raise ValueError("advantage estimator 'optimal_token_baseline' needs old_logp, sum_pi_squared and mask "
                         "[B, T] from the old policy's forward (keywords)")
    _, index = torch.unique(group_ids, return_inverse=True)
    m = mask.to(torch.float64)
    r = rewards.to(torch.float64)
    returns = r[:, None] * m
    w = 1 - 2 * old_logp.to(torch.float64).exp() + sum_pi_squared.to(torch.float64)
    if correction is not None:
        w = w * correction.to(torch.float64) ** 2
    cumulative = (w * m).cumsum(-1)
    groups = int(index.max()) + 1 if len(index) else 0
    num = r.new_zeros(groups, m.shape[1]).index_add_(0, index, returns * cumulative * m)
    den = r.new_zeros(groups, m.shape[1]).index_add_(0, index, cumulative * m) + OTB_EPS
    _, _, size = group_stats(rewards, group_ids)
    low = torch.full((groups,), torch.inf, dtype=r.dtype).scatter_reduce(0, index, r, "amin")
    high = torch.full((groups,), -torch.inf, dtype=r.dtype).scatter_reduce(0, index, r, "amax")
    baseline = torch.where((low == high)[index, None], r[:, None], (num / den)[index])
    if handle_zero_tail:
        baseline = baseline * ~zero_tail(m.sum(-1), index, groups, m.shape[1])
    adv = torch.where(size[:, None] > 1, (returns - baseline) * m, torch.zeros_like(m))
    return _in_dtype_of(adv, rewards)


def zero_tail(lengths: Tensor, index: Tensor, groups: int, width: int) -> Tensor:
    """Bool [B, T]: the positions t >= L_2 of each group's longest response when it is the only one of its length and
    longer than the second longest (L_2): verl's ``handle_zero_tail`` (groups of two or more)."""
    tail = torch.zeros(len(lengths), width, dtype=torch.bool)
    for g in range(groups):
        members = (index == g).nonzero().squeeze(-1)
        if len(members) < 2:
            continue
        ordered = torch.sort(lengths[members], descending=True).values
        longest = members[lengths[members] == ordered[0]]
        if len(longest) == 1 and ordered[0] > ordered[1]:
            tail[longest[0], int(ordered[1]):] = True
    return tail.to(lengths.device)


optimal_token_baseline_advantage.loop_inputs = (SUM_PI_SQUARED_INPUT,)


@ADVANTAGES.register("remax")
def remax_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None, *,
                    baselines: Tensor | None = None) -> Tensor:
    """ReMax (Li et al., arXiv 2310.10505; verl ``compute_remax_outcome_advantage``, volcengine/verl
    b178a3cd56f58b2d502255daba591e92833930a7, verl/trainer/ppo/core_algos.py): A_i = R_i - b_i, b_i the reward of
    one greedy completion of row i's prompt (``baselines`` [B], the same within a group; verl's ``reward_baselines``,
    from its trainer's extra ``do_sample=False`` generation per prompt scored by the same reward function). verl's
    token-level output (returns R_i on every valid token minus b_i) equals this broadcast. No group statistics: a
    group of one keeps its advantage (``train.group_size=1`` works). Cost: one extra greedy rollout per prompt and
    step (``train.max_new_tokens`` at most), whose tokens the loop counts in ``rollout_tokens``."""
    del group_ids, lengths
    if baselines is None:
        raise ValueError("advantage estimator 'remax' needs baselines [B] (keyword): the reward of a greedy "
                         "completion of each row's prompt")
    return _in_dtype_of(rewards.to(torch.float64) - baselines.to(torch.float64), rewards)


remax_advantage.loop_inputs = (GREEDY_BASELINE_INPUT,)



@ADVANTAGES.register("gdpo")
def gdpo_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None, *,
                   components: Tensor | None = None, weights: Tensor | None = None) -> Tensor:
    """GDPO (arXiv 2601.05242, "Group reward-Decoupled Normalization Policy Optimization", NVlabs/GDPO; TRL 1.16.0
    trl/trainer/grpo_trainer.py ``_generate_and_score_completions`` with ``multi_objective_aggregation=
    "normalize_then_sum"``, the PyPI release):
    each reward component k normalised within its group, the weighted sum normalised over the batch,

        a_ik = (r_ik - mean_g r_k) / (std_g r_k + 1e-4)           (unbiased std; 0 for a group of one)
        s_i = sum_k w_k a_ik,    A_i = (s_i - mean_batch s) / (std_batch s + 1e-4)    (unbiased std)

    ``components`` [B, K] and ``weights`` [K] are the task's (correctness weight 1, format ``task.format_weight``,
    DAPO's overlong penalty weight 1: harness/loop/batch.py ``reward_components``; ``rewards`` is their weighted
    sum and unused). TRL's 1e-4 is kept (our group-centred estimators use 1e-6). A group of one: a_ik = 0 (TRL's
    num_generations = 1 too), then the batch normalisation; a batch of one sample gets 0. verl's
    ``compute_gdpo_outcome_advantage`` differs (eps 1e-6, then a whitening over tokens, where a longer response
    weighs more in the batch's mean and std); TRL's per-sample form is the one here."""
    del lengths
    if components is None or weights is None:
        raise ValueError("advantage estimator 'gdpo' needs components [B, K] and weights [K] (keywords): the "
                         "reward's components, whose weighted sum is the reward")
    parts = []
    for k in range(components.shape[1]):
        mean, std, size = group_stats(components[:, k], group_ids)
        r_k = components[:, k].to(torch.float64)
        parts.append(torch.where(size > 1, (r_k - mean) / (std + TRL_STD_EPS), torch.zeros_like(r_k)))
    total = sum(float(w) * a for w, a in zip(weights.tolist(), parts, strict=True))
    if total.numel() < 2:
        return _in_dtype_of(torch.zeros_like(total), rewards)
    return _in_dtype_of((total - total.mean()) / (total.std() + TRL_STD_EPS), rewards)


gdpo_advantage.loop_inputs = (REWARD_COMPONENTS_INPUT,)


A2PO_BETA1 = 0.5  # beta_1 of A*-PO's V* (the KL temperature of stage 1; TRL's and the paper's default)
A2PO_VALUE_SAMPLES = 8  # reference completions per prompt for V* (TRL's num_value_samples default)


@ADVANTAGES.register("a2po")
def a2po_advantage(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None, *,
                   reference_rewards: Tensor | None = None) -> Tensor:
    """A*-PO's optimal advantage (Brantley et al., "Accelerating RL for LLM Reasoning with Optimal Advantage
    Regression", arXiv 2505.20686, Eq. 5 and Algorithm 1; TRL 1.16.0 ``trl/experimental/a2po/a2po_trainer.py``
    ``_estimate_optimal_values`` and ``_prepare_inputs``, the PyPI release): A_i = R_i - V*(x_i), with the optimal
    value of row i's prompt estimated from n completions y_1..y_n of it sampled from the reference policy pi_ref
    (the starting policy):

        V*(x) = beta_1 log( (1/n) sum_j exp(r(x, y_j) / beta_1) ) = beta_1 (logsumexp_j(r_j / beta_1) - log n)

    ``reference_rewards`` [B, n] (keyword; the same within a group; shaped as the rollout's rewards, DAPO's overlong
    punishment and the format weight included: harness/loop/batch.py ``reference_rewards``), beta_1 =
    ``A2PO_BETA1``, n = ``A2PO_VALUE_SAMPLES`` (TRL's ``beta1`` and ``num_value_samples`` defaults; another value
    is another registered estimator). No group statistics: a group of one keeps its advantage (A*-PO samples one
    completion per prompt: ``train.group_size=1``). Our reading where the harness differs from TRL: TRL estimates
    V* once per prompt, over the whole dataset, before training; here the loop samples the reference's completions of
    each step's prompts when the step draws them (seeded by the run seed and the step: the same estimator, drawn when
    needed; a prompt drawn at two steps gets two independent estimates), and counts their tokens in
    ``rollout_tokens``. TRL's ``filter_all_incorrect`` (drop, before training, the prompts none of whose reference
    samples is correct) is not applied: such a prompt has V* = 0 (binary rewards), so A = R."""
    del group_ids, lengths
    if reference_rewards is None or reference_rewards.dim() != 2:
        raise ValueError("advantage estimator 'a2po' needs reference_rewards [B, n] (keyword): the rewards of n "
                         "reference-policy completions of each row's prompt")
    r = reference_rewards.to(torch.float64)
    value = A2PO_BETA1 * (torch.logsumexp(r / A2PO_BETA1, dim=1) - math.log(r.shape[1]))
    return _in_dtype_of(rewards.to(torch.float64) - value, rewards)


a2po_advantage.loop_inputs = (REFERENCE_REWARDS_INPUT,)
a2po_advantage.reference_samples = A2PO_VALUE_SAMPLES


def get_advantage(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``, its output checked at every call (:func:`checked_advantages`); its
    declarations (``loop_inputs``, ``nonnegative_rewards``) read as on the function itself."""
    estimator = ADVANTAGES.get(name)

    @functools.wraps(estimator)  # copies the function's attributes, its declarations
    def checked_estimator(rewards: Tensor, group_ids: Tensor, lengths: Tensor | None = None, **inputs) -> Tensor:
        return checked_advantages(name, estimator(rewards, group_ids, lengths, **inputs), rewards)

    return checked_estimator


def checked_advantages(name: str, advantages, rewards: Tensor) -> Tensor:
    """``advantages`` when they are a tensor of one finite value per completion ([B]) or per token ([B, T]); else a
    ValueError naming the estimator and what is wrong, in one line (a NaN would otherwise stop the run as a diverged
    loss, a wrong length fail deep in the update)."""
    where = f"advantage estimator {name!r} returned"
    fix = "an estimator returns a finite tensor [B] (or [B, T]) for the B completions it is given"
    if not isinstance(advantages, Tensor):
        raise ValueError(f"{where} a {type(advantages).__name__}, not a tensor: {fix}")
    if advantages.dim() not in (1, 2):
        raise ValueError(f"{where} advantages of shape {list(advantages.shape)}: {fix}")
    if len(advantages) != len(rewards):
        raise ValueError(f"{where} {len(advantages)} advantages for {len(rewards)} completions: {fix}")
    bad = ~torch.isfinite(advantages).reshape(len(advantages), -1).all(-1)
    if bool(bad.any()):
        raise ValueError(f"{where} non-finite advantages ({int(bad.sum())} of {len(bad)} rows, NaN or inf) for "
                         f"rewards {rewards.tolist()[:8]}{' ...' if len(rewards) > 8 else ''}: {fix}")
    return advantages


def available_advantages() -> list[str]:
    return ADVANTAGES.names()
