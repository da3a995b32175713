"""Token-level advantage estimators: the optimal token baseline pinned to a transcription of verl's
``compute_optimal_token_baseline_advantage`` (volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7,
verl/trainer/ppo/core_algos.py), the sum of pi^2 that the trainer's forward gives it, and where [B, T] advantages
cannot go (sequence-level objectives, the TRL backend).
"""

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from harness.apps.lab import validate_lab
from harness.loop.batch import collect_batch, reward_components, rewards_of
from harness.loop.build import build_policy, build_task
from harness.loop.native import train
from harness.loop.trl_limits import trl_unsupported
from harness.policy import forward
from harness.policy.forward import SUM_PI_SQUARED, completion_forward, completion_logprobs
from harness.policy.sampler import sample_problems
from harness.run.config import load_experiment
from harness.run.errors import ConfigError
from harness.run.records import read_jsonl
from harness.run.seeding import step_seed
from harness.tasks import Arith, Score
from objectives import OBJECTIVES, available_advantages, get_advantage, get_objective
from objectives.advantages import needs_sum_pi_squared
from objectives.base import PolicyBatch
from tests.helpers.architectures import build
from tests.helpers.tiny import tiny_run
from tests.test_forward import batch as forward_batch

DT = torch.float64
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 0.0, 0.3, 0.3, 2.0], dtype=DT)
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 3])  # sizes 3, 4, 2 (equal rewards), 1
LENGTHS = torch.tensor([3, 5, 2, 4, 1, 6, 2, 3, 3, 2])
T = 7


def inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < LENGTHS[:, None]).to(DT)
    old_logp = -torch.rand(len(REWARDS), T, generator=generator, dtype=DT) * 3  # pi_t in (0.05, 1]
    sum_pi_squared = torch.exp(old_logp) ** 2 + torch.rand(len(REWARDS), T, generator=generator, dtype=DT) * 0.3
    token_rewards = torch.zeros(len(REWARDS), T, dtype=DT)
    token_rewards[torch.arange(len(REWARDS)), LENGTHS - 1] = REWARDS
    junk = ~mask.bool()  # padding holds garbage: it must not matter
    old_logp, sum_pi_squared = old_logp.masked_fill(junk, -50.0), sum_pi_squared.masked_fill(junk, 9.0)
    return token_rewards, mask, old_logp, sum_pi_squared


def verl_optimal_token_baseline(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8):
    """verl's compute_optimal_token_baseline_advantage (verl-project/verl 1dda039b), transcribed."""
    batch_size, seq_len = token_level_rewards.shape
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    pi_t = torch.exp(old_log_probs)
    w_per_timestep = 1 - 2 * pi_t + sum_pi_squared
    if rollout_is_weights is not None:
        w_per_timestep = w_per_timestep * (rollout_is_weights**2)
    w_cumulative = (w_per_timestep * response_mask).cumsum(dim=-1)
    prompt_groups = defaultdict(list)
    for i in range(batch_size):
        prompt_groups[index[i]].append(i)
    baselines = torch.zeros_like(returns)
    for _, trajectory_indices in prompt_groups.items():
        N = len(trajectory_indices)
        if N == 1:
            continue
        traj_idx = torch.tensor(trajectory_indices)
        returns_group = returns[traj_idx]
        w_cumulative_group = w_cumulative[traj_idx]
        mask_group = response_mask[traj_idx]
        numerator = (returns_group * w_cumulative_group * mask_group).sum(dim=0)
        denominator = (w_cumulative_group * mask_group).sum(dim=0) + epsilon
        baseline_per_step = numerator / denominator
        baselines[traj_idx] = baseline_per_step.unsqueeze(0).expand(N, -1)
        if handle_zero_tail:
            response_lengths = mask_group.sum(dim=-1)
            sorted_lengths, _ = torch.sort(response_lengths)
            max_length = int(sorted_lengths[-1].item())
            second_max_length = int(sorted_lengths[-2].item())
            max_length_idx = (response_lengths == max_length).nonzero(as_tuple=True)[0]
            if max_length_idx.numel() == 1 and max_length > second_max_length:
                baselines[trajectory_indices[int(max_length_idx[0])], second_max_length:] = 0.0
    advantages = (returns - baselines) * response_mask
    return advantages, returns


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])  # True: verl's default since 8acd940f1 (and ours)
def test_optimal_token_baseline_matches_verl_up_to_its_group_of_one(with_weights, zero_tail):
    token_rewards, mask, old_logp, sum_pi_squared = inputs()
    weights = None
    if with_weights:
        weights = (0.5 + torch.rand(len(REWARDS), T, generator=torch.Generator().manual_seed(1), dtype=DT)) * mask
    options = {} if zero_tail else {"handle_zero_tail": False}
    ours = get_advantage("optimal_token_baseline")(REWARDS, GROUPS, LENGTHS, old_logp=old_logp,
                                                   sum_pi_squared=sum_pi_squared, mask=mask, correction=weights,
                                                   **options)
    ref, _ = verl_optimal_token_baseline(token_rewards, mask, GROUPS.tolist(), old_logp, sum_pi_squared, weights,
                                         zero_tail)
    # the unique longest responses of groups 0 (row 1: 5 > 3) and 1 (row 5: 6 > 4) get A = G past the second longest
    assert ((ours[1, 3:5] == REWARDS[1]) & (ours[5, 4:6] == REWARDS[5])).all() == zero_tail
    assert ours.shape == (len(REWARDS), T) and ours.dtype == DT
    keep = GROUPS != 3
    torch.testing.assert_close(ours[keep], ref[keep], atol=1e-7, rtol=1e-7)  # equal rewards: verl's 1e-8 leaves ~1e-9
    assert (ref[9, :2] == 2.0).all() and (ours[9] == 0).all()  # verl: no baseline for a group of one; ours 0
    assert (ours[7:9] == 0).all()  # equal rewards: exactly 0
    assert (ours[~mask.bool()] == 0).all()
    # the baseline varies along the sequence (a per-sequence baseline would not): group 1 at tokens 0 and 3
    assert not torch.isclose(ours[3, 0], ours[3, 3])
    # and it is not the group mean: the weights W_t matter
    assert not torch.allclose(ours[0, :2], (REWARDS[0] - REWARDS[:3].mean()).expand(2))


def test_optimal_token_baseline_zero_tail_by_hand():
    """One group of lengths [3, 1], R = [1, 0], old log-probs log 0.5, sum pi^2 = 0.5 (w_t = 0.5, W = 0.5 t): position
    0 has both responses, B_0 = (1 x 0.5) / (0.5 + 0.5) = 0.5; positions 1-2 only row 0, whose baseline the zero tail
    sets to 0 (verl's default since 8acd940f1): A = [0.5, 1, 1]; without it B ~ 1 and A ~ 0 there."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=DT)
    args = dict(old_logp=torch.full((2, 3), math.log(0.5), dtype=DT), sum_pi_squared=torch.full((2, 3), 0.5, dtype=DT),
                mask=mask)
    rewards, groups, lengths = torch.tensor([1.0, 0.0], dtype=DT), torch.tensor([0, 0]), torch.tensor([3, 1])
    ours = get_advantage("optimal_token_baseline")(rewards, groups, lengths, **args)
    torch.testing.assert_close(ours, torch.tensor([[0.5, 1.0, 1.0], [-0.5, 0.0, 0.0]], dtype=DT), atol=1e-8, rtol=0)
    off = get_advantage("optimal_token_baseline")(rewards, groups, lengths, handle_zero_tail=False, **args)
    assert off[0, 1:].abs().max() < 1e-7


def test_optimal_token_baseline_refuses_to_run_without_the_old_policy():
    with pytest.raises(ValueError, match="needs old_logp, sum_pi_squared and mask"):
        get_advantage("optimal_token_baseline")(REWARDS, GROUPS, LENGTHS)
    assert needs_sum_pi_squared(get_advantage("optimal_token_baseline"))
    assert not any(needs_sum_pi_squared(get_advantage(n)) for n in available_advantages()
                   if n != "optimal_token_baseline")


@pytest.mark.parametrize("chunk", [0, 4])
def test_the_forward_gives_the_sum_of_pi_squared_at_the_temperature(chunk):
    model, args = build("llama").eval(), forward_batch()
    forward.set_memory_settings(model, lm_head_chunk=chunk)
    with torch.no_grad():
        logp, squares = completion_logprobs(model, *args, 0.7, with_entropy=SUM_PI_SQUARED)
        plain, _, hidden = completion_forward(model, *args, 0.7)
        pi = torch.softmax(model.get_output_embeddings()(hidden).float() / 0.7, dim=-1)
    valid = args[3].bool()
    torch.testing.assert_close(logp, plain, atol=0, rtol=0)
    torch.testing.assert_close(squares[valid], (pi ** 2).sum(-1), atol=1e-6, rtol=1e-5)
    assert (squares[~valid] == 0).all() and (squares[valid] <= 1).all()
    assert (squares[valid] >= logp[valid].exp() ** 2 - 1e-6).all()


def test_sequence_level_objectives_declare_it_and_token_advantages_reach_the_others():
    """An objective that takes one advantage per sequence says so (needs_sequence_advantages); every other one
    computes its loss from [B, T] advantages."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 2, 4])[:, None]
    logp = (-torch.rand(4, 5, generator=generator)).requires_grad_()
    for name in OBJECTIVES.names():
        objective = get_objective(name)
        if objective.needs_hidden_states:
            continue  # POPO reads hidden states and rewards; its advantages are not used
        pb = PolicyBatch(logp=logp, old_logp=logp.detach() - 0.01, mask=mask, advantages=torch.randn(4, 5),
                         rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), group_ids=torch.tensor([0, 0, 1, 1]),
                         max_completion_len=5, ref_logp=logp.detach() + 0.02, entropy=torch.rand(4, 5))
        # (reference log-probs and entropies as the loop passes them to adaptive_kl and adaptive_entropy)
        if type(objective).needs_sequence_advantages:
            with pytest.raises(ValueError, match="per-sequence advantages"):
                objective(pb)
        else:
            assert torch.isfinite(objective(pb).loss), name


def test_a_token_level_estimator_with_a_sequence_level_objective_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="one advantage per token and objective 'gspo' needs one per sequence"):
        tiny_run(tmp_path, "objective.name=gspo", "objective.advantage=optimal_token_baseline")
    run = tiny_run(tmp_path, "objective.name=grpo", "objective.advantage=optimal_token_baseline")
    assert "backend trl: advantage estimator 'optimal_token_baseline' reads" in trl_unsupported(run)
    remax = OmegaConf.merge(run, {"objective": {"advantage": "remax"}})
    assert "backend trl: advantage estimator 'remax' reads what only the native loop" in trl_unsupported(remax)
    for estimator in ("gdpo", "optimal_token_baseline"):  # centred within groups: nothing to learn from one sample
        with pytest.raises(ConfigError, match=f"train.group_size=1 with advantage estimator '{estimator}'"):
            tiny_run(tmp_path, f"objective.advantage={estimator}", "train.group_size=1")
    assert tiny_run(tmp_path, "objective.advantage=remax", "train.group_size=1").train.group_size == 1
    gdpo = OmegaConf.merge(run, {"objective": {"advantage": "gdpo"}})
    assert "backend trl: advantage estimator 'gdpo' reads what only the native loop" in trl_unsupported(gdpo)
    assert trl_unsupported(OmegaConf.merge(run, {"objective": {"advantage": "grpo"}})) is None


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "remax", "gdpo"])
def test_the_gradient_lab_refuses_a_loop_only_estimator_in_one_line(estimator):
    with pytest.raises(ConfigError, match=r"^lab.params.grpo.advantage: an estimator that reads what only the"):
        validate_lab(load_experiment("lab", ["lab.objectives=[grpo]",
                                             f"lab.params={{grpo: {{advantage: {estimator}}}}}"]))


def verl_remax(token_level_rewards, reward_baselines, response_mask):
    """verl's compute_remax_outcome_advantage, transcribed."""
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


def test_remax_matches_verl_and_needs_its_baselines():
    token_rewards, mask, _, _ = inputs()
    baselines = torch.tensor([0.0, 1.0, 0.5, 2.0], dtype=DT)[GROUPS]  # one greedy reward per prompt
    ours = get_advantage("remax")(REWARDS, GROUPS, LENGTHS, baselines=baselines)
    ref, _ = verl_remax(token_rewards, baselines, mask)
    torch.testing.assert_close(ours[:, None] * mask, ref, atol=0, rtol=0)
    assert ours[0] == 1.0 and ours[4] == -0.5 and ours[9] == 0.0  # by hand; a group of one keeps R - b (2 - 2)
    with pytest.raises(ValueError, match="'remax' needs baselines"):
        get_advantage("remax")(REWARDS, GROUPS, LENGTHS)


def test_the_greedy_baseline_is_the_reward_of_a_greedy_completion_and_its_tokens_are_counted(tmp_path, monkeypatch):
    # a reward that tells completions apart (the untrained tiny model's are all wrong and full length)
    monkeypatch.setattr(Arith, "score", lambda self, completion, problem: Score(len(set(completion)) / 8, 0.0))
    cfg = tiny_run(tmp_path, "objective.advantage=remax", "task.overlong_buffer=6", "train.temperature=3.0")
    task = build_task(cfg)
    model, tokenizer, _ = build_policy(cfg, task, torch.device("cpu"))
    plain = collect_batch(model, tokenizer, task, task.train_problems(), cfg, step=1)
    remax = collect_batch(model, tokenizer, task, task.train_problems(), cfg, step=1, greedy_baseline=True)
    assert plain.baselines is None and remax.rollout.texts == plain.rollout.texts  # the rollout is unchanged
    assert torch.equal(remax.rewards, plain.rewards)
    problems = [task.train_problems()[i] for i in np.random.default_rng(step_seed(cfg.seed, 1)).choice(
        len(task.train_problems()), cfg.train.prompts_per_step, replace=False)]
    greedy = sample_problems(model, tokenizer, problems, cfg.train, group_size=1, greedy=True)
    scores = [task.score(x, p) for x, p in zip(greedy.texts, problems, strict=True)]
    expected = rewards_of(scores, greedy.completion_mask.sum(-1), cfg)
    assert torch.equal(remax.baselines, expected.repeat_interleave(cfg.train.group_size))
    tokens = int(greedy.completion_mask.sum())
    assert remax.stats["greedy_baseline_tokens"] == tokens > 0
    assert remax.stats["sampled_tokens"] == plain.stats["sampled_tokens"] + tokens


@pytest.mark.slow
def test_a_remax_run_counts_the_greedy_rollouts_in_rollout_tokens(tmp_path):
    run = tiny_run(tmp_path, "objective.advantage=remax", "train.group_size=1", "train.prompts_per_step=4")
    assert train(run, tmp_path / "run", progress=False)["steps_done"] == 2
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")[1:]
    greedy = [row["greedy_baseline_tokens"] for row in rows]
    assert all(g > 0 for g in greedy) and all(math.isfinite(row["loss"]) for row in rows)
    sampled = [row["completion_len_mean"] * run.train.prompts_per_step * run.train.group_size for row in rows]
    assert rows[-1]["rollout_tokens"] == pytest.approx(sum(sampled) + sum(greedy))


def trl_nanstd(tensor, dim=None, keepdim=False):
    """TRL 1.16 trl/trainer/utils.py nanstd (unbiased), transcribed."""
    variance = torch.nanmean((tensor - torch.nanmean(tensor, dim=dim, keepdim=True)) ** 2, dim=dim, keepdim=keepdim)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=keepdim)
    variance *= count / (count - 1)
    return torch.sqrt(variance)


def trl_normalize_then_sum(rewards_per_func, reward_weights, num_generations):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, multi_objective_aggregation="normalize_then_sum"."""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = trl_nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    std_rewards = trl_nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)


@pytest.mark.parametrize("group_size", [4, 1])
def test_gdpo_matches_trls_normalize_then_sum(group_size):
    components = torch.tensor([[1, 1, 0], [0, 1, -0.5], [0, 0, 0], [1, 1, -1.0],  # group 0
                               [0, 1, 0], [0, 1, 0], [0, 1, 0], [0, 1, 0],  # group 1: equal components
                               [1, 0, 0], [1, 1, 0], [0, 1, -0.25], [0, 0, -0.25]], dtype=DT)
    weights = torch.tensor([1.0, 0.1, 1.0], dtype=DT)
    rewards = components @ weights
    groups = torch.arange(12 // group_size).repeat_interleave(group_size)
    ours = get_advantage("gdpo")(rewards, groups, LENGTHS.repeat(2)[:12], components=components, weights=weights)
    ref = trl_normalize_then_sum(components, weights, group_size)
    torch.testing.assert_close(ours, ref, atol=1e-7, rtol=1e-7)  # TRL: n / (n - 1) of int tensors is float32
    if group_size == 4:  # not GRPO on the summed reward: each component is normalised in its group first
        assert not torch.allclose(ours, get_advantage("batch_std")(rewards, groups), atol=1e-3)
        assert ours[4:8].abs().max() < 1e-9  # equal components: every a_ik 0, s = 0 = the batch mean of s
    else:
        assert (ours == 0).all()
    with pytest.raises(ValueError, match="'gdpo' needs components"):
        get_advantage("gdpo")(rewards, groups)


def test_the_reward_is_the_weighted_sum_of_its_components(tmp_path):
    cfg = tiny_run(tmp_path, "task.overlong_buffer=6", "task.format_weight=0.3")
    scores = [Score(1.0, 1.0), Score(0.0, 1.0), Score(0.0, 0.0), Score(0.5, 0.3)]
    lengths = torch.tensor([2, 8, 5, 7])
    components, weights = reward_components(scores, lengths, cfg)
    assert torch.equal(weights, torch.tensor([1.0, 0.3, 1.0], dtype=DT))
    assert torch.equal(components[:, :2], torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.3]], dtype=DT))
    assert components[0, 2] == 0 and components[1, 2] < components[3, 2] < 0  # the overlong punishment
    # the rewards as before the components existed: python's c + w f, in float32, minus the punishment
    before = torch.tensor([s.correct + 0.3 * s.format for s in scores], dtype=torch.float32)
    before = before - 1.0 * (lengths.float() - (cfg.train.max_new_tokens - 6)).clamp(min=0) / 6
    assert cfg.task.overlong_penalty == 1.0 and torch.equal(rewards_of(scores, lengths, cfg), before)
