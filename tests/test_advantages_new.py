"""The advantage estimators grpo_passk, gpg, reinforce_plus_plus(_baseline) and opo, pinned to transcriptions of
verl's ``core_algos.py`` estimators (verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9; REINFORCE++ the same
at volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7, verl/trainer/ppo/core_algos.py): the token-level [B, T]
output of verl (outcome reward on the last valid token) equals ours broadcast over each sequence's valid tokens.
Groups of several sizes, ties, equal rewards, a group of one (where our convention differs from verl's, stated per
estimator), float64.
"""

from collections import defaultdict

import pytest
import torch

from harness.run.config import load_experiment, run_configs
from harness.run.errors import ConfigError
from objectives import available_advantages, get_advantage
from objectives.advantages import (
    loop_inputs,
    opo_advantage,
    reinforce_plus_plus_advantage,
    reinforce_plus_plus_baseline_advantage,
)

DT = torch.float64
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 0.0, 0.3, 0.3, 2.0, 0.0, 1.0], dtype=DT)
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 4, 4])  # sizes 3, 4, 2 (equal rewards), 1, 2
LENGTHS = torch.tensor([3, 5, 2, 4, 1, 6, 2, 3, 3, 2, 5, 1])
T = 7


def token_inputs():
    mask = (torch.arange(T)[None, :] < LENGTHS[:, None]).to(DT)
    token_rewards = torch.zeros(len(REWARDS), T, dtype=DT)
    token_rewards[torch.arange(len(REWARDS)), LENGTHS - 1] = REWARDS
    return token_rewards, mask, GROUPS.tolist()


def masked_whiten(values, mask):
    """verl_F.masked_whiten (masked_mean with +1e-8, unbiased masked_var), written out."""
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = (((values - mean) ** 2) * mask).sum() / (mask.sum() + 1e-8) * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_grpo_passk(token_rewards, mask, index, eps=1e-6):
    scores = token_rewards.sum(-1)
    adv = torch.zeros_like(scores)
    members = defaultdict(list)
    for i, g in enumerate(index):
        members[g].append(i)
    for rows in members.values():
        if len(rows) < 2:
            continue  # verl raises for a group of one
        r = scores[rows]
        top, idx = torch.topk(r, 2)
        adv[rows[idx[0].item()]] = (top[0] - top[1]) / (torch.std(r) + eps)
    return adv[:, None] * mask


def verl_gpg(token_rewards, mask, index, f_norm=1.0):
    scores = token_rewards.sum(-1)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    members = defaultdict(list)
    for i, g in enumerate(index):
        members[g].append(scores[i])
    mean = {g: (torch.stack(v).mean() if len(v) > 1 else torch.tensor(0.0, dtype=DT)) for g, v in members.items()}
    out = torch.stack([alpha * (scores[i] - mean[g]) / f_norm for i, g in enumerate(index)])
    return out[:, None] * mask


def verl_reinforce_pp(token_rewards, mask, gamma=1.0):
    """compute_reinforce_plus_plus_outcome_advantage, line for line (config.gamma = 1.0, verl's default)."""
    returns = torch.zeros_like(token_rewards)
    running_return = 0
    for t in reversed(range(token_rewards.shape[1])):
        running_return = token_rewards[:, t] + gamma * running_return
        returns[:, t] = running_return
        running_return = running_return * mask[:, t]  # reset after EOS
    return masked_whiten(returns, mask) * mask


def verl_reinforce_pp_baseline(token_rewards, mask, index):
    scores = token_rewards.sum(-1)
    members = defaultdict(list)
    for i, g in enumerate(index):
        members[g].append(scores[i])
    mean = {g: (torch.stack(v).mean() if len(v) > 1 else torch.tensor(0.0, dtype=DT)) for g, v in members.items()}
    centred = torch.stack([scores[i] - mean[g] for i, g in enumerate(index)])
    tiled = centred[:, None].tile([1, token_rewards.shape[1]]) * mask
    return masked_whiten(tiled, mask) * mask


def verl_opo(token_rewards, mask, index):
    lengths, scores = mask.sum(-1), token_rewards.sum(-1)
    by_score, by_len = defaultdict(list), defaultdict(list)
    for i, g in enumerate(index):
        by_score[g].append(scores[i])
        by_len[g].append(lengths[i])
    baseline = {}
    for g in by_score:
        if len(by_score[g]) == 1:
            baseline[g] = torch.tensor(0.0, dtype=DT)
        else:
            s, n = torch.stack(by_score[g]), torch.stack(by_len[g])
            baseline[g] = (n * s).sum() / n.sum()
    return torch.stack([scores[i] - baseline[g] for i, g in enumerate(index)])[:, None] * mask


def broadcast(adv, mask):
    return adv.to(DT)[:, None] * mask


def close(a, b, tol=1e-12):
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a, b)


def without_singletons(x, mask):
    """Our convention gives a group of one 0 where verl does not: zero verl's row of the singleton group 3."""
    x = x.clone()
    x[(GROUPS == 3)] = 0.0
    return x


LENGTH_ESTIMATORS = {"reinforce_plus_plus": reinforce_plus_plus_advantage, "opo": opo_advantage,
                     "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantage}


def test_new_names_are_registered():
    assert {"grpo_passk", "gpg", *LENGTH_ESTIMATORS} <= set(available_advantages())


@pytest.mark.parametrize("name", sorted(LENGTH_ESTIMATORS))
def test_registered_length_estimators_take_the_lengths_and_refuse_to_guess_them(name):
    estimator = get_advantage(name)
    assert torch.equal(estimator(REWARDS, GROUPS, LENGTHS), LENGTH_ESTIMATORS[name](REWARDS, GROUPS, LENGTHS))
    with pytest.raises(ValueError, match=f"{name}' needs the completion lengths"):
        estimator(REWARDS, GROUPS)
    # the lengths matter: equal lengths give another answer than these (a length-blind estimator would not)
    assert not torch.allclose(estimator(REWARDS, GROUPS, torch.full_like(LENGTHS, 3)), estimator(REWARDS, GROUPS,
                                                                                                 LENGTHS))


@pytest.mark.parametrize("name", sorted(n for n in set(available_advantages()) - set(LENGTH_ESTIMATORS)
                                         if not loop_inputs(get_advantage(n))))  # tests/test_advantages_token.py
def test_every_other_estimator_ignores_the_lengths(name):
    estimator = get_advantage(name)
    assert torch.equal(estimator(REWARDS, GROUPS), estimator(REWARDS, GROUPS, LENGTHS))


def test_grpo_passk_matches_verl():
    token_rewards, mask, index = token_inputs()
    keep = GROUPS != 3  # verl raises for the group of one
    ours = get_advantage("grpo_passk")(REWARDS, GROUPS)
    rows = keep.nonzero().squeeze(-1)
    ref = verl_grpo_passk(token_rewards[rows], mask[rows], [index[i] for i in rows.tolist()])
    close(broadcast(ours[rows], mask[rows]), ref)
    assert ours[9] == 0.0
    # by hand: group 0 (1, 0, 0): only response 0, (1 - 0) / std; equal rewards (group 2): 0; group 1 max 1 twice: 0
    assert (ours[[1, 2, 3, 4, 5, 6, 7, 8]] == 0).all() and ours[0] > 0 and ours[11] > 0


def test_gpg_matches_verl_up_to_its_group_of_one():
    token_rewards, mask, index = token_inputs()
    ours = get_advantage("gpg")(REWARDS, GROUPS)
    ref = verl_gpg(token_rewards, mask, index)
    close(broadcast(ours, mask), without_singletons(ref, mask))
    assert ref[9].abs().sum() > 0 and ours[9] == 0.0  # verl: alpha R for a group of one; ours 0
    # by hand: 8 nonzero rewards of 12 -> alpha = 12 / 8; response 0: 1.5 (1 - 1/3) = 1
    assert abs(ours[0].item() - 1.0) < 1e-12


def test_reinforce_plus_plus_matches_verl():
    token_rewards, mask, index = token_inputs()
    ours = reinforce_plus_plus_advantage(REWARDS, GROUPS, LENGTHS)
    close(broadcast(ours, mask), verl_reinforce_pp(token_rewards, mask), tol=1e-9)  # verl's +1e-8 in the means
    assert ours[9] != 0  # no group baseline: the group of one keeps its advantage


def test_reinforce_plus_plus_baseline_matches_verl():
    token_rewards, mask, index = token_inputs()
    ours = reinforce_plus_plus_baseline_advantage(REWARDS, GROUPS, LENGTHS)
    close(broadcast(ours, mask), verl_reinforce_pp_baseline(token_rewards, mask, index), tol=1e-9)


def test_opo_matches_verl_up_to_its_group_of_one():
    token_rewards, mask, index = token_inputs()
    ours = opo_advantage(REWARDS, GROUPS, LENGTHS)
    close(broadcast(ours, mask), without_singletons(verl_opo(token_rewards, mask, index), mask))
    # by hand, group 0 (lengths 3, 5, 2; rewards 1, 0, 0): baseline 3 / 10
    assert abs(ours[0].item() - 0.7) < 1e-12 and abs(ours[1].item() + 0.3) < 1e-12
    assert (ours[7:9] == 0).all()  # equal rewards: exactly 0


@pytest.mark.parametrize("name", ["grpo_passk", "gpg"])
def test_equal_rewards_and_groups_of_one_give_exactly_zero(name):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 3.0], dtype=DT)
    groups = torch.tensor([4, 4, 4, 9, 2])
    adv = get_advantage(name)(rewards, groups)
    assert adv.dtype == DT and torch.equal(adv, torch.zeros(5, dtype=DT))


def test_reinforce_plus_plus_trains_with_one_sample_per_prompt():
    """REINFORCE++ has no group baseline (verl's recipe samples once per prompt): train.group_size=1 is accepted,
    where a group-centred estimator is refused."""
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        (run,) = run_configs(load_experiment("quickstart", ["train.group_size=1", f"objective.advantage={name}",
                                                            "seed=0", "objective.name=grpo"]))
        assert run.objective.advantage == name
    with pytest.raises(ConfigError, match="objective.advantage one of a2po, reinforce_plus_plus, "):
        run_configs(load_experiment("quickstart", ["train.group_size=1", "objective.advantage=opo", "seed=0",
                                                   "objective.name=grpo"]))


def test_length_estimators_need_two_tokens():
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        reinforce_plus_plus_advantage(torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1]))
