"""A*-PO: the ``a2po`` estimator (V* from the reference policy's completions) and the ``a2po`` objective (the
regression of beta2 log(pi / pi_ref) onto A = R - V*) pinned to TRL 1.16.0's trl/experimental/a2po/a2po_trainer.py on
hand-made tensors, and the loop's stage that samples the reference for V*."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harness.apps.lab import validate_lab
from harness.loop.backends import BACKENDS
from harness.loop.batch import collect_batch, rewards_of, with_reference_rewards
from harness.loop.build import build_policy, build_task, frozen_copy
from harness.loop.native import train
from harness.loop.trl_limits import trl_unsupported
from harness.policy.sampler import sample_problems
from harness.run.config import load_experiment, run_configs
from harness.run.errors import ConfigError
from harness.run.seeding import step_seed
from harness.tasks import Arith, Score
from objectives import PolicyBatch, get_advantage, get_objective, reads_reference_policy
from objectives.advantages import A2PO_BETA1, A2PO_VALUE_SAMPLES, reference_samples
from tests.helpers.objectives import DT, assert_close, group_batch, num
from tests.helpers.tiny import tiny_run

REFERENCE_REWARDS = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0],
                                  [1.0, 1.0, 1.0, 1.0], [0.5, 0.0, 1.2, -0.1]])
ROLLOUT_REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.3])


def trl_v_star(rewards: torch.Tensor, beta1: float) -> torch.Tensor:
    """TRL 1.16.0 A2POTrainer._estimate_optimal_values, the V* of each prompt from its [prompts, n] rewards,
    transcribed (float32, as TRL's rewards are)."""
    n = rewards.shape[1]
    return beta1 * (torch.logsumexp(rewards / beta1, dim=1) - math.log(n))


def trl_loss(policy_per_token_logps, ref_logps, completion_mask, rewards, v_star, beta2):
    """TRL 1.16.0 A2POTrainer.compute_loss with _get_sequence_logps's masked sum, transcribed."""
    policy_logps = (policy_per_token_logps * completion_mask).sum(dim=1)
    implicit_reward = beta2 * (policy_logps - ref_logps)
    target = rewards - v_star
    return ((implicit_reward - target) ** 2).mean()


def test_the_a2po_estimator_matches_trls_v_star_and_by_hand():
    ours = get_advantage("a2po")(ROLLOUT_REWARDS, torch.arange(5), reference_rewards=REFERENCE_REWARDS)
    expected = ROLLOUT_REWARDS - trl_v_star(REFERENCE_REWARDS, A2PO_BETA1)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)
    assert ours.dtype == torch.float32
    # by hand: none correct, V* = 0 (A = R); all correct, V* = 1; one of four, V* = 0.5 log((e^2 + 3) / 4)
    assert ours[0] == 1.0 and abs(ours[3] - (0.0 - 1.0)) < 1e-7
    assert abs(ours[1] - (0.0 - 0.5 * math.log((math.e ** 2 + 3) / 4))) < 1e-7
    # V* is a soft maximum: between the mean and the best of the reference's rewards
    v_star = ROLLOUT_REWARDS - ours
    assert bool((v_star >= REFERENCE_REWARDS.mean(1) - 1e-7).all())
    assert bool((v_star <= REFERENCE_REWARDS.max(1).values).all())
    # the groups do not enter: one row per prompt (A*-PO) or several rows of one prompt
    grouped = get_advantage("a2po")(ROLLOUT_REWARDS, torch.zeros(5, dtype=torch.long),
                                    reference_rewards=REFERENCE_REWARDS)
    assert torch.equal(grouped, ours)
    with pytest.raises(ValueError, match="'a2po' needs reference_rewards"):
        get_advantage("a2po")(ROLLOUT_REWARDS, torch.arange(5))
    assert reference_samples(get_advantage("a2po")) == A2PO_VALUE_SAMPLES == 8
    assert reference_samples(get_advantage("remax")) == reference_samples(get_advantage("grpo")) == 0


def a2po_batch(garbage: bool = True) -> tuple[PolicyBatch, torch.Tensor, torch.Tensor]:
    """group_batch's 8 rows with A*-PO's targets (the a2po estimator's R - V* of made-up reference rewards), the
    rollout's rewards R and TRL's V*."""
    batch = group_batch(t=5, garbage=garbage)
    reference = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]] * 2, dtype=DT)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0], dtype=DT)
    batch.advantages = get_advantage("a2po")(rewards, torch.arange(8), reference_rewards=reference)
    return batch, rewards, trl_v_star(reference, A2PO_BETA1)


@pytest.mark.parametrize("beta2", [1e-3, 0.7])
def test_the_a2po_objective_matches_trls_loss_and_gradient(beta2):
    batch, rewards, v_star = a2po_batch()
    out = get_objective("a2po", beta2=beta2)(batch)
    (grad,) = torch.autograd.grad(out.loss, batch.logp)
    logp = batch.logp.detach().clone().requires_grad_(True)
    mask = batch.mask.to(DT)
    ref = trl_loss(logp, (batch.ref_logp * mask).sum(1), mask, rewards, v_star, beta2)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert num(out.loss, ref.item(), 1e-12)
    assert_close(grad, ref_grad, tol=1e-12)
    assert float(grad[~batch.mask].abs().max()) == 0.0  # padding (garbage there) carries no gradient
    implicit = beta2 * ((batch.logp - batch.ref_logp) * mask).sum(1)
    assert num(out.metrics["implicit_reward"], implicit.mean().item(), 1e-12)
    assert num(out.metrics["a2po_target"], batch.advantages.mean().item(), 1e-12)
    assert num(out.metrics["a2po_residual"], (implicit - batch.advantages).abs().mean().item(), 1e-12)


def test_the_a2po_objective_by_hand():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 9.0]], dtype=DT, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -3.0]], dtype=DT)
    batch = PolicyBatch(logp=logp, old_logp=logp.detach(), mask=torch.tensor([[1, 1], [1, 0]]),
                        advantages=torch.tensor([0.2, -0.4], dtype=DT), ref_logp=ref)
    out = get_objective("a2po", beta2=0.1)(batch)
    # S = (0.5 - 1.0, 0.0) = (-0.5, 0); residuals 0.1 * -0.5 - 0.2 = -0.25 and 0 + 0.4 = 0.4
    assert num(out.loss, (0.25 ** 2 + 0.4 ** 2) / 2)
    assert_close(torch.autograd.grad(out.loss, logp)[0], [[0.1 * -0.25, 0.1 * -0.25], [0.1 * 0.4, 0.0]])


def test_the_a2po_objective_micro_batched_and_corrected_sums_to_the_whole():
    batch, _, _ = a2po_batch()
    objective = get_objective("a2po")
    whole = objective(batch).loss
    parts = []
    for rows in (slice(0, 3), slice(3, 8)):
        part = PolicyBatch(logp=batch.logp[rows], old_logp=batch.old_logp[rows], mask=batch.mask[rows],
                           advantages=batch.advantages[rows], ref_logp=batch.ref_logp[rows], num_sequences=8)
        parts.append(objective(part).loss)
    assert num(sum(parts), whole.item(), 1e-14)
    weights = torch.rand(batch.logp.shape, generator=torch.Generator().manual_seed(3), dtype=DT)
    corrected = PolicyBatch(logp=batch.logp, old_logp=batch.old_logp, mask=batch.mask, advantages=batch.advantages,
                            ref_logp=batch.ref_logp, correction=weights)
    mask = batch.mask.to(DT)
    squares = (1e-3 * ((batch.logp - batch.ref_logp) * mask).sum(1) - batch.advantages) ** 2
    c = (weights * mask).sum(1) / mask.sum(1)
    assert num(objective(corrected).loss, (c * squares).sum().item() / 8, 1e-12)


def test_the_a2po_objective_is_checked_and_declares_the_reference():
    with pytest.raises(ValueError, match="beta2 must be > 0"):
        get_objective("a2po", beta2=0.0)
    with pytest.raises(ValueError, match="aggregation 'token_mean' is not meaningful"):
        get_objective("a2po", aggregation="token_mean")
    batch, _, _ = a2po_batch()
    batch.ref_logp = None
    with pytest.raises(ValueError, match="needs PolicyBatch.ref_logp"):
        get_objective("a2po")(batch)
    a2po, grpo = get_objective("a2po"), get_objective("grpo")
    assert "reference" in type(a2po).needs() and "reference" not in type(grpo).needs()
    reads = reads_reference_policy
    assert reads(a2po, get_advantage("grpo")) and reads(grpo, get_advantage("a2po"))
    assert not reads(grpo, get_advantage("grpo")) and reads(get_objective("grpo", beta=0.1), get_advantage("grpo"))
    assert "reference" in BACKENDS["native"].provides and "reference" not in BACKENDS["trl"].provides


@pytest.mark.slow
def test_where_a2po_cannot_run_it_is_refused_before_anything(tmp_path):
    with pytest.raises(ConfigError, match="^backend trl: objective 'a2po' reads the reference policy's log-probs"):
        run_configs(load_experiment("base", ["objective.name=a2po", "backend=trl", f"results_dir={tmp_path}"]))
    run = tiny_run(tmp_path, "objective.name=grpo", "objective.advantage=a2po")
    assert "backend trl: advantage estimator 'a2po' reads what only the native loop" in trl_unsupported(run)
    assert tiny_run(tmp_path, "objective.name=a2po", "train.group_size=1").train.group_size == 1
    with pytest.raises(ConfigError, match="an estimator that samples its prompts again"):
        tiny_run(tmp_path, "objective.name=a2po", "train.rollout_lag=1", "train.lag_mode=mixed")
    with pytest.raises(ConfigError, match=r"^lab.params.grpo.advantage: an estimator that reads what only the"):
        validate_lab(load_experiment("lab", ["lab.objectives=[grpo]", "lab.params={grpo: {advantage: a2po}}"]))


@pytest.mark.slow
def test_the_reference_rewards_are_the_rewards_of_the_references_own_completions(tmp_path, monkeypatch):
    # a reward that tells completions apart (the untrained tiny model's are all wrong)
    monkeypatch.setattr(Arith, "score", lambda self, completion, problem: Score(len(set(completion)) / 8, 0.0))
    cfg = tiny_run(tmp_path, "objective.name=a2po", "task.overlong_buffer=6", "train.temperature=3.0")
    task = build_task(cfg)
    policy, tokenizer, _ = build_policy(cfg, task, torch.device("cpu"))
    reference = frozen_copy(policy)
    plain = collect_batch(policy, tokenizer, task, task.train_problems(), cfg, step=1)
    collected = with_reference_rewards(plain, reference, tokenizer, task, cfg, 1, 3)
    assert plain.reference_rewards is None and collected.rollout is plain.rollout
    problems = [task.train_problems()[i] for i in np.random.default_rng(step_seed(cfg.seed, 1)).choice(
        len(task.train_problems()), cfg.train.prompts_per_step, replace=False)]
    assert [p.question for p in collected.problems] == [p.question for p in problems]
    torch.manual_seed(step_seed(cfg.seed, 1, stream=5))
    own = sample_problems(reference, tokenizer, problems, cfg.train, group_size=3)
    expected = rewards_of([task.score(x, problems[i // 3]) for i, x in enumerate(own.texts)],
                          own.completion_mask.sum(-1), cfg)
    assert collected.reference_rewards.shape == (cfg.train.prompts_per_step * cfg.train.group_size, 3)
    assert torch.equal(collected.reference_rewards, expected.view(-1, 3).repeat_interleave(cfg.train.group_size, 0))
    assert len(set(expected.tolist())) > 1  # the reward told them apart
    tokens = int(own.completion_mask.sum())
    assert collected.stats["reference_tokens"] == tokens > 0
    assert collected.stats["sampled_tokens"] == plain.stats["sampled_tokens"] + tokens


@pytest.mark.slow
@pytest.mark.parametrize("lag", [[], ["train.rollout_lag=1"]])
def test_an_a2po_run_trains_against_its_reference_and_resumes_exactly(tmp_path, monkeypatch, lag):
    from tests.helpers.interrupt import full_and_resumed

    monkeypatch.setattr(Arith, "score", lambda self, completion, problem: Score(len(set(completion)) / 8, 0.0))
    run = tiny_run(tmp_path, "objective.name=a2po", "train.group_size=1", "train.prompts_per_step=4",
                   "train.steps=3", *lag)
    assert run.objective.params.get("beta", 0.0) == 0.0  # no KL term: the reference is built for A*-PO alone
    full, part = full_and_resumed(train, run, tmp_path, step=2)  # a lagged batch pending in the checkpoint
    assert part == full
    rows = full[1:]
    assert all(row["reference_tokens"] > 0 and math.isfinite(row["loss"]) and "kl_ref" not in row for row in rows)
    sampled = [row["completion_len_mean"] * 4 for row in rows]
    assert rows[-1]["rollout_tokens"] == pytest.approx(sum(sampled) + sum(row["reference_tokens"] for row in rows))
    assert all(row["a2po_target"] != 0 and row["reference_reward"] > 0 for row in rows)  # something to learn
    assert rows[-1]["implicit_reward"] != 0.0  # the policy left its reference


@pytest.mark.slow
def test_a_lora_policys_reference_completions_are_its_bases(tmp_path, monkeypatch):
    """With LoRA the reference is the policy with its adapters off: its completions (and so V*) must be the base
    model's, not the adapted policy's (the native decoder merges adapters into its matmuls unless they are off)."""
    import copy

    from harness.loop.build import setup_run

    monkeypatch.setattr(Arith, "score", lambda self, completion, problem: Score(len(set(completion)) / 8, 0.0))
    cfg = tiny_run(tmp_path, "objective.name=a2po", "model.lora.rank=4", "train.temperature=3.0")
    run = setup_run(cfg, torch.device("cpu"))
    assert run.reference is run.policy  # the base with the adapters off: no copy
    for name, p in run.policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # adapters that change the policy
    plain = collect_batch(run.policy, run.tokenizer, run.task, run.train_problems, cfg, step=1)
    ours = with_reference_rewards(plain, run.reference, run.tokenizer, run.task, cfg, 1, 2)
    base = copy.deepcopy(run.policy).unload()  # the starting weights without any adapter
    torch.manual_seed(step_seed(cfg.seed, 1, stream=5))
    expected = sample_problems(base, run.tokenizer, ours.problems, cfg.train, group_size=2)
    torch.manual_seed(step_seed(cfg.seed, 1, stream=5))
    adapted = sample_problems(run.policy, run.tokenizer, ours.problems, cfg.train, group_size=2)
    def per_row(ro):  # the rewards of a rollout of 2 completions per problem, as reference_rewards holds them
        rewards = rewards_of([run.task.score(x, ours.problems[i // 2]) for i, x in enumerate(ro.texts)],
                             ro.completion_mask.sum(-1), cfg)
        return rewards.view(-1, 2).repeat_interleave(cfg.train.group_size, 0)

    assert not torch.equal(per_row(adapted), per_row(expected))  # the adapters matter here ...
    assert torch.equal(ours.reference_rewards, per_row(expected))
    assert ours.stats["reference_tokens"] == int(expected.completion_mask.sum())  # ... and the base sampled


def test_the_memory_floor_counts_the_references_completions_when_they_are_more(monkeypatch, tmp_path):
    """A*-PO samples 8 reference completions of each prompt at once: with train.group_size=1 those are the most
    completions a step samples together, and the memory floor counts them."""
    import json

    from harness.policy import memory
    from tests.helpers.tiny import TINY_SPEC

    weights, per_token, _ = memory.model_bytes("tiny", json.dumps(TINY_SPEC, sort_keys=True), "float32")
    weights *= 2  # the policy and its reference copy
    run = tiny_run(tmp_path, "objective.name=a2po", "train.group_size=1")  # 4 prompts: 4 rollout rows, 32 reference
    monkeypatch.setattr(memory, "device_memory", lambda device: weights + 32 * per_token)
    memory.check_memory(run)
    monkeypatch.setattr(memory, "device_memory", lambda device: weights + 32 * per_token - 1)
    with pytest.raises(ConfigError, match="^train.prompts_per_step x the 8 reference completions of estimator 'a2po' "
                                          "= 32 completions sampled at once need"):
        memory.check_memory(run)
    memory.check_memory(tiny_run(tmp_path, "objective.name=grpo",
                                 "objective.advantage=remax", "train.group_size=1"))  # 4 rows: far below
    with pytest.raises(ConfigError, match="^train.prompts_per_step x train.group_size = 36 completions"):
        memory.check_memory(tiny_run(tmp_path, "objective.name=a2po", "train.group_size=9"))


@pytest.mark.parametrize("overrides", [["objective.name=a2po", "objective.advantage=grpo"],
                                       ["objective.name=grpo", "objective.advantage=a2po"],
                                       ["objective.name=grpo", "objective.params.beta=0.1"]])
def test_the_bench_refuses_a_run_that_needs_the_reference_before_building_it(overrides, monkeypatch):
    """The bench's timed step computes no reference log-probs and samples no reference: it failed after the model
    was built ('needs PolicyBatch.ref_logp')."""
    from harness.apps import bench

    def built(*args, **kwargs):
        raise AssertionError("the run was built")

    monkeypatch.setattr(bench, "setup_run", built)
    with pytest.raises(ConfigError, match="^the bench times a step without the reference policy"):
        bench.bench_run(["model.name=tiny", "model.warm_start_steps=0", "model.warm_start_target=null", *overrides])
