"""Advantage estimators, hand-checked on small groups."""

import math

import pytest
import torch

from objectives import available_advantages, get_advantage
from objectives.registry import UnknownNameError

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 0.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1, 2])  # sizes 3, 3, 1


def close(actual, expected, tol=1e-9):
    assert actual.shape == (len(expected),)
    for a, e in zip(actual.tolist(), expected, strict=True):
        assert math.isclose(a, e, rel_tol=tol, abs_tol=tol), (actual.tolist(), expected)


def test_registered_names():
    assert set(available_advantages()) >= {"grpo", "mean_only", "rloo", "batch_std"}


def test_grpo_unbiased_std_plus_eps():
    # group 0: mean 1/3, unbiased var = ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3 -> std 0.57735
    std0 = math.sqrt(1 / 3)
    # group 1: mean 5/6, deviations (1/6, -1/3, 1/6): var = (1/36 + 1/9 + 1/36) / 2 = 1/12
    std1 = math.sqrt(1 / 12)
    expected = [(2 / 3) / (std0 + 1e-6), (-1 / 3) / (std0 + 1e-6), (-1 / 3) / (std0 + 1e-6),
                (1 / 6) / (std1 + 1e-6), (-1 / 3) / (std1 + 1e-6), (1 / 6) / (std1 + 1e-6), 0.0]
    close(get_advantage("grpo")(REWARDS, GROUPS), expected, tol=1e-6)


def test_mean_only():
    expected = [2 / 3, -1 / 3, -1 / 3, 1 / 6, -1 / 3, 1 / 6, 0.0]
    close(get_advantage("mean_only")(REWARDS, GROUPS), expected, tol=1e-6)


def test_rloo_leave_one_out():
    # R_i - mean of the others: group 0: 1 - 0 = 1, 0 - 1/2, 0 - 1/2; group 1: 1 - 3/4, 0.5 - 1, 1 - 3/4
    expected = [1.0, -0.5, -0.5, 0.25, -0.5, 0.25, 0.0]
    close(get_advantage("rloo")(REWARDS, GROUPS), expected, tol=1e-6)


def test_batch_std():
    mean = sum(REWARDS.tolist()) / 7
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS.tolist()) / 6)  # unbiased, whole batch
    centred = [2 / 3, -1 / 3, -1 / 3, 1 / 6, -1 / 3, 1 / 6]
    expected = [c / (std + 1e-4) for c in centred] + [0.0]  # TRL's epsilon
    close(get_advantage("batch_std")(REWARDS, GROUPS), expected, tol=1e-6)
    tiny = torch.tensor([0.0, -1e-4, 0.0, -2e-4], dtype=torch.float64)  # a batch std near TRL's 1e-4
    shaped = (tiny - torch.tensor([-5e-5, -5e-5, -1e-4, -1e-4], dtype=torch.float64)) / (tiny.std() + 1e-4)
    close(get_advantage("batch_std")(tiny, torch.tensor([0, 0, 1, 1])), shaped.tolist(), tol=1e-12)


@pytest.mark.parametrize("name", ["grpo", "mean_only", "rloo", "batch_std"])
def test_group_of_one_and_equal_rewards_give_exactly_zero(name):
    # 0.1 + 0.1 + 0.1 != 0.3 in floating point: equal rewards must still give exactly 0, not ~1e-11 / 1e-6.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 3.0], dtype=torch.float64)
    groups = torch.tensor([4, 4, 4, 9, 2])
    adv = get_advantage(name)(rewards, groups)
    assert adv.dtype == torch.float64
    assert torch.equal(adv, torch.zeros(5, dtype=torch.float64))


def test_non_contiguous_group_ids_and_integer_rewards():
    rewards = torch.tensor([1, 0, 0, 1])  # integer rewards come back as float32
    groups = torch.tensor([7, 3, 7, 3])
    adv = get_advantage("mean_only")(rewards, groups)
    assert adv.dtype == torch.float32
    close(adv, [0.5, -0.5, -0.5, 0.5])


def test_unknown_estimator():
    with pytest.raises(UnknownNameError, match="Did you mean 'rloo'"):
        get_advantage("rlooo")


@pytest.mark.parametrize("output, said", [
    (lambda r: torch.full_like(r, float("nan")), r"non-finite advantages \(7 of 7 rows, NaN or inf\)"),
    (lambda r: r[:-1], r"6 advantages for 7 completions"),
    (lambda r: r[:, None, None], r"advantages of shape \[7, 1, 1\]"),
    (lambda r: r.tolist(), r"a list, not a tensor"),
])
def test_a_broken_estimator_is_named_in_one_line(monkeypatch, output, said):
    """A new estimator file whose function returns NaN, too few rows, a wrong shape or no tensor is named in one line
    when the loop calls it, instead of a non-finite loss blamed on the learning rate or an IndexError deep in the
    update."""
    from objectives.advantages import ADVANTAGES

    monkeypatch.setitem(ADVANTAGES._items, "broken_test", lambda rewards, group_ids, lengths=None: output(rewards))
    with pytest.raises(ValueError, match=rf"advantage estimator 'broken_test' returned {said}"):
        get_advantage("broken_test")(REWARDS, GROUPS, torch.full((7,), 3))


def test_a_checked_estimator_keeps_its_declarations():
    """The loop reads an estimator's declarations (loop_inputs, nonnegative_rewards) on what get_advantage returns."""
    from objectives.advantages import loop_inputs, needs_nonnegative_rewards

    assert loop_inputs(get_advantage("remax")) == loop_inputs(get_advantage("remax").__wrapped__) != ()
    assert needs_nonnegative_rewards(get_advantage("maxrl"))
    assert get_advantage("grpo").__name__ == "grpo_advantage"


def test_the_documented_estimator_example_registers_and_runs(monkeypatch):
    """docs/objectives.md's "Adding an advantage estimator" block, as a new file of objectives/ would run it: the
    estimator and its objective register, get_advantage runs it checked, and the objective names it as its default."""
    import re
    import sys
    import types
    from pathlib import Path

    from objectives import OBJECTIVES
    from objectives.advantages import ADVANTAGES

    text = (Path(__file__).parents[1] / "docs" / "objectives.md").read_text()
    section = text.partition("## Adding an advantage estimator")[2]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "docs/objectives.md lost its section on adding an advantage estimator"
    monkeypatch.setattr(ADVANTAGES, "_items", dict(ADVANTAGES._items))
    monkeypatch.setattr(OBJECTIVES, "_items", dict(OBJECTIVES._items))
    module = types.ModuleType("objectives.documented_estimator")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(block.group(1), "docs/objectives.md", "exec"), module.__dict__)
    name = re.search(r'@ADVANTAGES.register\("(\w+)"\)', block.group(1)).group(1)
    close(get_advantage(name)(REWARDS, GROUPS), [1.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0])
    objective = next(cls for cls in OBJECTIVES._items.values() if cls.__module__ == module.__name__)
    assert objective.default_advantage == name and re.search(r"arXiv \d{4}\.\d{4,5}", module.__doc__)
