"""Token-level advantage estimators: the optimal token baseline pinned to a transcription of verl's
``compute_optimal_token_baseline_advantage`` (volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7,
verl/trainer/ppo/core_algos.py), the sum of pi^2 that the trainer's forward gives it, and where [B, T] advantages
cannot go (sequence-level objectives, the TRL backend).
"""

from collections import defaultdict

import pytest
import torch
from omegaconf import OmegaConf

from harness.apps.lab import validate_lab
from harness.loop.trl_limits import trl_unsupported
from harness.policy import forward
from harness.policy.forward import SUM_PI_SQUARED, completion_forward, completion_logprobs
from harness.run.config import load_experiment
from harness.run.errors import ConfigError
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
                                rollout_is_weights=None, epsilon=1e-8):
    """verl's compute_optimal_token_baseline_advantage (handle_zero_tail False), transcribed."""
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
    advantages = (returns - baselines) * response_mask
    return advantages, returns


@pytest.mark.parametrize("with_weights", [False, True])
def test_optimal_token_baseline_matches_verl_up_to_its_group_of_one(with_weights):
    token_rewards, mask, old_logp, sum_pi_squared = inputs()
    weights = None
    if with_weights:
        weights = (0.5 + torch.rand(len(REWARDS), T, generator=torch.Generator().manual_seed(1), dtype=DT)) * mask
    ours = get_advantage("optimal_token_baseline")(REWARDS, GROUPS, LENGTHS, old_logp=old_logp,
                                                   sum_pi_squared=sum_pi_squared, mask=mask, correction=weights)
    ref, _ = verl_optimal_token_baseline(token_rewards, mask, GROUPS.tolist(), old_logp, sum_pi_squared, weights)
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
                         max_completion_len=5)
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
    assert trl_unsupported(OmegaConf.merge(run, {"objective": {"advantage": "grpo"}})) is None


def test_the_gradient_lab_refuses_a_token_level_estimator_in_one_line():
    with pytest.raises(ConfigError, match=r"^lab.params.grpo.advantage: an estimator that reads the old policy's"):
        validate_lab(load_experiment("lab", ["lab.objectives=[grpo]",
                                             "lab.params={grpo: {advantage: optimal_token_baseline}}"]))
