"""One step's rollout batch for the native loop: draw prompts, sample a group of completions per prompt, score
them, shape the rewards (format weight, DAPO's overlong penalty), and with DAPO's dynamic sampling refill the
batch with groups that carry a gradient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from omegaconf import DictConfig
from torch import Tensor

from harness.loop.behaviour import routing_recorded_at
from harness.policy.lora import adapters_disabled
from harness.policy.routing import RoutingRecord, routing_of
from harness.policy.sampler import Rollout, sample_problems, select_rows
from harness.run.seeding import step_seed
from harness.tasks import Score


@dataclass
class TrainBatch:
    """What one step trains on: the rollout and, per row, reward, advantage and group; per token, the behaviour
    log-probs (sampler's or recomputed), the reference log-probs (None without a KL term) and the rollout-correction
    weights (None without ``train.rollout_correction``; harness/loop/behaviour.py's ``rollout_correction``)."""

    rollout: Rollout
    rewards: Tensor  # [N]
    advantages: Tensor  # [N], or [N, T] from a token-level estimator (optimal_token_baseline)
    group_ids: Tensor  # [N]
    old_logp: Tensor  # [N, T]
    ref_logp: Tensor | None = None  # [N, T]
    correction: Tensor | None = None  # [N, T], detached; 0 on padding and on masked tokens
    routing: RoutingRecord | None = None  # an MoE's behaviour routing [layers, N, P + T, k] (harness/loop/behaviour.py)


@dataclass
class SampledRound:
    """One round of ``prompts_per_step`` groups: the rollout, each completion's score and reward."""

    rollout: Rollout
    scores: list[Score]
    rewards: Tensor  # [prompts_per_step * group_size]
    problems: list  # [prompts_per_step], the round's problems, one per group
    components: Tensor  # [prompts_per_step * group_size, 3] the rewards' components (reward_components)


class Collected(NamedTuple):
    """:func:`collect_batch`'s result."""

    rollout: Rollout
    rewards: Tensor  # [N]
    stats: dict  # statistics of everything sampled (sampling_stats), greedy baseline rollouts included
    baselines: Tensor | None  # [N] the reward of a greedy completion of each row's prompt (ReMax), else None
    components: Tensor  # [N, 3] the rewards' components (reward_components; GDPO)
    weights: Tensor  # [3] their weights
    problems: list | None = None  # the batch's problems, one per group in order (as sampled; not kept in a checkpoint)
    # [N, n] the rewards of n reference-policy completions of each row's prompt (A*-PO's V*: with_reference_rewards)
    reference_rewards: Tensor | None = None


def rewards_of(scores: list[Score], lengths: Tensor, cfg: DictConfig) -> Tensor:
    """correct + format_weight * format, plus DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13) when
    task.overlong_buffer = B > 0: with L = train.max_new_tokens, -overlong_penalty * clamp(length - (L - B), 0, B) / B
    (0 up to L - B tokens, falling linearly to -overlong_penalty at L; verl's overlong_buffer): the weighted sum of
    :func:`reward_components`, float32 (the first two summed in float64, the punishment computed in float32)."""
    components, weights = reward_components(scores, lengths, cfg)
    return (components[:, 0] * weights[0] + components[:, 1] * weights[1]).float() + \
        (components[:, 2] * weights[2]).float()


def reward_components(scores: list[Score], lengths: Tensor, cfg: DictConfig) -> tuple[Tensor, Tensor]:
    """The reward's components [N, 3] (correct, format, overlong punishment: 0 without ``task.overlong_buffer``) and
    their weights [3] (1, ``task.format_weight``, 1), float64: what GDPO normalises one by one."""
    task = cfg.task
    correct = torch.tensor([s.correct for s in scores], dtype=torch.float64)
    form = torch.tensor([s.format for s in scores], dtype=torch.float64)
    overlong = torch.zeros_like(correct)
    if task.overlong_buffer:
        excess = (lengths.float().cpu() - (cfg.train.max_new_tokens - task.overlong_buffer)).clamp(min=0)
        overlong = -(task.overlong_penalty * excess / task.overlong_buffer).double()
    return torch.stack([correct, form, overlong], -1), reward_weights(task)


def reward_weights(task: DictConfig) -> Tensor:
    """The weights [3] of :func:`reward_components`: 1, ``task.format_weight``, 1 (float64)."""
    return torch.tensor([1.0, task.format_weight, 1.0], dtype=torch.float64)


def collect_batch(sampler, tokenizer, task, train_problems, cfg: DictConfig, step: int, greedy_baseline: bool = False,
                  subset: list[int] | None = None, sampling_seed: int | None = None) -> Collected:
    """The step's rollout (``prompts_per_step`` groups), its rewards [N], and statistics of everything sampled.
    Problems are drawn without replacement by a generator seeded with (seed, step); completions with torch's generator
    seeded with (seed, step, 2), or ``sampling_seed``. ``greedy_baseline`` (ReMax): also one greedy completion of each
    group's prompt, scored and shaped as the others (:func:`greedy_baselines`). ``subset``: only these of the step's
    groups (a lagged batch's groups sampled by one policy version: harness/loop/pipeline.py; no dynamic sampling).

    With ``train.dynamic_sampling`` (DAPO, arXiv 2503.14476, Sec. 3.2): groups whose rewards are all equal
    (every advantage 0, so no gradient) are dropped and ``prompts_per_step`` fresh prompts sampled, up to
    ``train.max_sampling_rounds`` rounds; the first ``prompts_per_step`` informative groups form the batch. The
    filter reads the reward (verl's ``filter_groups.metric: score``); the paper's accuracy filter is the same when
    the reward is correctness alone, and with format or overlong shaping the reward filter keeps the groups that
    still carry a gradient. If the rounds run out, dropped groups fill the batch (logged as
    ``frac_zero_std_groups_trained``) instead of stopping the run as verl does. The statistics (reward,
    accuracy, lengths, zero-variance groups, tokens) cover every sampled completion, so they describe the
    policy, not the filter, and ``sampled_tokens`` counts the whole sampling cost.
    """
    t = cfg.train
    rng = np.random.default_rng(step_seed(cfg.seed, step))
    torch.manual_seed(step_seed(cfg.seed, step, stream=2) if sampling_seed is None else sampling_seed)
    rounds: list[SampledRound] = []
    record = routing_recorded_at(t, routing_of(sampler) is not None) == "sampler"  # the sampler's routing (R3)
    informative, dropped = [], []  # groups as (round, group index)
    for round_ in range(t.max_sampling_rounds if t.dynamic_sampling else 1):
        problems = [train_problems[i] for i in drawn_problems(rng, len(train_problems), t)]
        problems = problems if subset is None else [problems[g] for g in subset]
        rounds.append(scored_round(sample_problems(sampler, tokenizer, problems, t, record_routing=record),
                                   problems, task, cfg))
        for g, varied in enumerate(varied_groups(rounds[-1].rewards, t.group_size)):
            (informative if varied else dropped).append((round_, g))
        if len(informative) >= t.prompts_per_step:
            break
    stats = sampling_stats([r.rollout for r in rounds], torch.cat([r.rewards for r in rounds]),
                           torch.cat([r.components for r in rounds]), zero_std_groups=len(dropped),
                           groups=len(dropped) + len(informative))
    groups = (informative + dropped)[: t.prompts_per_step] if t.dynamic_sampling else \
        [(0, g) for g in range(len(rounds[0].problems))]
    baselines = None
    if greedy_baseline:
        baselines, greedy_stats = greedy_baselines(sampler, tokenizer, task, [rounds[r].problems[g] for r, g in groups],
                                                   cfg)
        stats.update(greedy_stats, sampled_tokens=stats["sampled_tokens"] + greedy_stats["greedy_baseline_tokens"])
    weights = reward_weights(cfg.task)
    if not t.dynamic_sampling:
        return Collected(rounds[0].rollout, rounds[0].rewards, stats, baselines, rounds[0].components, weights,
                         rounds[0].problems)
    rows = [(r, g * t.group_size + j) for r, g in groups for j in range(t.group_size)]
    stats.update(sampling_rounds=len(rounds),
                 frac_zero_std_groups_trained=sum(g in dropped for g in groups) / t.prompts_per_step)
    rollout = select_rows([r.rollout for r in rounds], rows, tokenizer.pad_token_id)
    return Collected(rollout, torch.stack([rounds[r].rewards[i] for r, i in rows]), stats, baselines,
                     torch.stack([rounds[r].components[i] for r, i in rows]), weights,
                     [rounds[r].problems[g] for r, g in groups])


def drawn_problems(rng: np.random.Generator, available: int, t: DictConfig) -> np.ndarray:
    """One round's problems: ``prompts_per_step`` indices among ``available``, drawn without replacement."""
    return rng.choice(available, t.prompts_per_step, replace=False)


def scored_round(ro: Rollout, problems: list, task, cfg: DictConfig) -> SampledRound:
    """A rollout of ``group_size`` completions of each problem, scored by the task, its rewards shaped."""
    scores = [task.score(text, problems[i // cfg.train.group_size]) for i, text in enumerate(ro.texts)]
    lengths = ro.completion_mask.sum(-1)
    return SampledRound(ro, scores, rewards_of(scores, lengths, cfg), problems,
                        reward_components(scores, lengths, cfg)[0])


def varied_groups(rewards: Tensor, group_size: int) -> list[bool]:
    """Per group of ``group_size`` consecutive rows: whether its rewards differ (a group of equal rewards has every
    advantage 0)."""
    grouped = rewards.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(-1).tolist()


def greedy_baselines(sampler, tokenizer, task, problems: list, cfg: DictConfig) -> tuple[Tensor, dict]:
    """ReMax's baselines (verl's ``reward_baselines``: its trainer generates each prompt once more with
    ``do_sample=False`` and scores it with the same reward function): one greedy completion of each problem
    (``train.max_new_tokens`` at most), its reward shaped as the rollout's (:func:`rewards_of`), repeated over the
    group [len(problems) * group_size]; and its statistics, ``greedy_baseline_tokens`` (the extra rollout's tokens,
    which the caller adds to ``sampled_tokens``) and ``greedy_baseline_reward``."""
    ro = sample_problems(sampler, tokenizer, problems, cfg.train, group_size=1, greedy=True)
    lengths = ro.completion_mask.sum(-1)
    rewards = rewards_of([task.score(text, problem) for text, problem in zip(ro.texts, problems, strict=True)],
                         lengths, cfg)
    stats = {"greedy_baseline_tokens": int(lengths.sum()), "greedy_baseline_reward": rewards.mean().item()}
    return rewards.repeat_interleave(cfg.train.group_size), stats


REFERENCE_STREAM = 5  # step_seed stream of the reference policy's completions (with_reference_rewards)


def with_reference_rewards(collected: Collected, reference, tokenizer, task, cfg: DictConfig, step: int,
                           samples: int) -> Collected:
    """``collected`` with ``reference_rewards`` [N, samples]: ``samples`` completions of each of its groups' prompts
    sampled from ``reference`` (the reference policy: a frozen copy of the starting policy, or a LoRA policy's base
    with its adapters off, in the policy's precision, not ``model.sampler_dtype``'s) at the run's sampling settings
    (temperature, top-p, sampler, decoder), seeded by (seed, ``step``, ``REFERENCE_STREAM``), scored and
    shaped as the rollout's (:func:`rewards_of`), repeated over each group's rows (A*-PO's V*: objectives/advantages.py
    ``a2po``). Their tokens join ``sampled_tokens``; ``reference_tokens`` and ``reference_reward`` say what they
    were."""
    problems = collected.problems
    torch.manual_seed(step_seed(cfg.seed, step, stream=REFERENCE_STREAM))
    with adapters_disabled(reference):
        ro = sample_problems(reference, tokenizer, problems, cfg.train, group_size=samples)
    lengths = ro.completion_mask.sum(-1)
    rewards = rewards_of([task.score(text, problems[i // samples]) for i, text in enumerate(ro.texts)], lengths, cfg)
    stats = {**collected.stats, "reference_tokens": int(lengths.sum()), "reference_reward": rewards.mean().item(),
             "sampled_tokens": collected.stats["sampled_tokens"] + int(lengths.sum())}
    per_row = rewards.view(len(problems), samples).repeat_interleave(cfg.train.group_size, dim=0)
    return collected._replace(stats=stats, reference_rewards=per_row)


def sampling_stats(rollouts: list[Rollout], rewards: Tensor, components: Tensor, zero_std_groups: int,
                   groups: int) -> dict:
    """Reward, accuracy, format, lengths and truncation over every sampled completion of the step: the
    ``rollouts``' rows in order, their ``rewards`` [N] and reward components [N, 3] (:func:`reward_components`)."""
    lengths = torch.cat([ro.completion_mask.sum(-1) for ro in rollouts]).float()
    return {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
            "accuracy": components[:, 0].mean().item(), "format_reward": components[:, 1].mean().item(),
            "completion_len_mean": lengths.mean().item(), "completion_len_max": lengths.max().item(),
            "frac_truncated": torch.cat([ro.truncated for ro in rollouts]).float().mean().item(),
            "frac_zero_std_groups": zero_std_groups / groups, "sampled_tokens": int(lengths.sum())}


def collected_round(round_: SampledRound, cfg: DictConfig) -> Collected:
    """One round as a step's batch (no dynamic sampling, no greedy baseline): its rollout, rewards, statistics."""
    zero_std = sum(not varied for varied in varied_groups(round_.rewards, cfg.train.group_size))
    stats = sampling_stats([round_.rollout], round_.rewards, round_.components, zero_std_groups=zero_std,
                           groups=len(round_.problems))
    return Collected(round_.rollout, round_.rewards, stats, None, round_.components, reward_weights(cfg.task),
                     round_.problems)
