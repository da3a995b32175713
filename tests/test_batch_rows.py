"""The rollout batch's rows, pinned by values: each completion is scored against its own group's problem, a greedy
baseline and the reference's rewards line up with their groups' rows, dynamic sampling stops once a round has enough
informative groups, and trust-region rules alone switch the rollout correction on."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from harness.loop import batch as batch_module
from harness.loop.batch import collect_batch, greedy_baselines, scored_round, with_reference_rewards
from harness.loop.build import build_policy, build_task
from harness.policy.sampler import Rollout
from harness.run.offpolicy import behaviour_logp, correction_on, lagged
from harness.tasks import Arith, Score
from tests.helpers.tiny import tiny_run

CFG = OmegaConf.create({"seed": 0, "train": {"group_size": 2, "max_new_tokens": 8},
                        "task": {"format_weight": 0.0, "overlong_buffer": 0}})


class Matching:
    """A task whose reward is 1 where the completion is its problem's text."""

    def score(self, text, problem):
        return Score(float(text == problem), 0.0)


def rollout_of_texts(texts: list[str]) -> Rollout:
    n = len(texts)
    return Rollout(prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                   completion_ids=torch.ones(n, 3, dtype=torch.long),
                   completion_mask=torch.ones(n, 3, dtype=torch.bool),
                   sampler_logp=torch.zeros(n, 3), texts=texts, truncated=torch.zeros(n, dtype=torch.bool))


def test_each_completion_is_scored_against_its_own_groups_problem():
    problems = ["a", "b", "c"]
    texts = ["a", "x", "b", "b", "x", "c"]  # groups of 2: (a, x) for a, (b, b) for b, (x, c) for c
    round_ = scored_round(rollout_of_texts(texts), problems, Matching(), CFG)
    assert round_.rewards.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_greedy_baselines_and_reference_rewards_follow_their_groups_rows(monkeypatch):
    problems = ["a", "b", "c"]

    def sampled(model, tokenizer, chosen, t, group_size=None, greedy=False, **_):
        return rollout_of_texts([p if (p != "b") == (group_size == 1) else "x" for p in chosen
                                 for _ in range(group_size)])

    monkeypatch.setattr(batch_module, "sample_problems", sampled)
    baselines, _ = greedy_baselines(None, None, Matching(), problems, CFG)
    assert baselines.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # each group's greedy reward on its own rows
    collected = batch_module.Collected(None, None, {"sampled_tokens": 0}, None, None, None, problems)
    reference = with_reference_rewards(collected, torch.nn.Linear(1, 1), None, Matching(), CFG, 1, 2)
    assert reference.reference_rewards.tolist() == [[0.0, 0.0]] * 2 + [[1.0, 1.0]] * 2 + [[0.0, 0.0]] * 2


@pytest.mark.slow  # builds the tiny policy and samples with it
def test_dynamic_sampling_stops_at_the_round_that_fills_the_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(Arith, "score", lambda self, completion, problem: Score(0.0, 0.0))
    monkeypatch.setattr(batch_module, "varied_groups", lambda rewards, size: [True] * (len(rewards) // size))
    cfg = tiny_run(tmp_path, "train.dynamic_sampling=true", "train.group_size=2", "train.max_sampling_rounds=6")
    task = build_task(cfg)
    model, tokenizer, _ = build_policy(cfg, task, torch.device("cpu"))
    collected = collect_batch(model, tokenizer, task, task.train_problems(), cfg, step=1)
    assert collected.stats["sampling_rounds"] == 1


def test_trust_region_rules_alone_switch_the_correction_on_and_a_lag_of_0_is_no_lag():
    t = OmegaConf.create({"old_logp": "sampler", "rollout_correction": {
        "mode": "none", "threshold": 2.0, "threshold_lower": None, "rejection": ["token_k2"],
        "rejection_threshold": [0.1]}})
    assert correction_on(t) and behaviour_logp(t) == "recompute"
    assert not lagged(OmegaConf.create({"rollout_lag": 0})) and lagged(OmegaConf.create({"rollout_lag": 1}))
