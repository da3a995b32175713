"""Advantage estimators, registered by name: rewards [B] and group ids [B] (same id = same prompt) in,
[B] out.

A group of size 1 has no baseline: its advantage is defined as 0 (no learning signal), for every estimator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from objectives.registry import Registry

AdvantageEstimator = Callable[[Tensor, Tensor], Tensor]
ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator")

STD_EPS = 1e-6


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


def _singletons_to_zero(adv: Tensor, size: Tensor, like: Tensor) -> Tensor:
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return torch.where(size > 1, adv, torch.zeros_like(adv)).to(dtype)


@ADVANTAGES.register("grpo")
def grpo_advantage(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """A_i = (R_i - mean_g) / (std_g + 1e-6), unbiased group std (DeepSeekMath; verl, TRL default)."""
    mean, std, size = group_stats(rewards, group_ids)
    return _singletons_to_zero((rewards - mean) / (std + STD_EPS), size, rewards)


@ADVANTAGES.register("mean_only")
def mean_only_advantage(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """A_i = R_i - mean_g (Dr. GRPO: no std division, which biases towards easy/hard prompts)."""
    mean, _, size = group_stats(rewards, group_ids)
    return _singletons_to_zero(rewards - mean, size, rewards)


@ADVANTAGES.register("rloo")
def rloo_advantage(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """A_i = R_i - mean_{j != i} R_j = n/(n-1) (R_i - mean_g) (leave-one-out baseline)."""
    mean, _, size = group_stats(rewards, group_ids)
    return _singletons_to_zero(size / (size - 1).clamp(min=1) * (rewards - mean), size, rewards)


@ADVANTAGES.register("batch_std")
def batch_std_advantage(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """A_i = (R_i - mean_g) / (std_batch + 1e-6): group-centred, scaled by the unbiased std of the whole
    batch's rewards (TRL ``scale_rewards="batch"``)."""
    mean, _, size = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    std = r.std() if r.numel() > 1 else r.new_zeros(())
    return _singletons_to_zero((r - mean) / (std + STD_EPS), size, rewards)


def get_advantage(name: str) -> AdvantageEstimator:
    return ADVANTAGES.get(name)


def available_advantages() -> list[str]:
    return ADVANTAGES.names()
