"""harness/loop/update.py: the update's values (plan, minibatches, timings, learner) and parts, and the native loop's
epochs x minibatches over them: micro-batches give exactly the minibatch's update, a non-finite update is skipped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

import harness.loop.native
from harness.loop.batch import TrainBatch
from harness.loop.native import train
from harness.loop.update import (
    Learner,
    RowsForward,
    RunState,
    Timings,
    UpdatePlan,
    microbatch_loss,
    minibatches,
    policy_batch,
    timed,
    token_budget_chunks,
)
from harness.policy.sampler import Rollout
from harness.run.records import read_jsonl
from objectives import OBJECTIVES, Objective, ObjectiveOutput, get_objective
from tests.helpers.tiny import tiny_run


# p3o: its minibatch ESS from the loop's no-grad first pass; conspo compares a group's samples (micro-batches: groups);
# prompt_mean: each prompt's tokens and the prompts counted over the minibatch, not the micro-batch
@pytest.mark.parametrize("objective, extra", [("dapo", ("objective.params.entropy_coef=0.01",)), ("p3o", ()),
                                              ("conspo", ()), ("a2po", ()),
                                              ("grpo", ("objective.params.aggregation=prompt_mean",))])
@pytest.mark.slow
def test_micro_batches_give_the_minibatch_update(tmp_path, objective, extra, monkeypatch):
    passes, real = [], harness.loop.native.with_statistics

    def spy(*args, **kwargs):
        passes.append(real(*args, **kwargs))
        return passes[-1]

    monkeypatch.setattr(harness.loop.native, "with_statistics", spy)
    sizes, real_loss = [], harness.loop.native.microbatch_loss
    monkeypatch.setattr(harness.loop.native, "microbatch_loss",
                        lambda learner, plan, minibatch, rows, *a, **k: sizes.append(len(rows)) or
                        real_loss(learner, plan, minibatch, rows, *a, **k))
    finals, counts, logged = [], [], []
    # whole minibatches, 4 rows, a token budget (rows of 35 or 36 prompt and 6 to 8 completion tokens)
    for k, setting in enumerate(("train.micro_batch_size=0", "train.micro_batch_size=4",
                                 "train.max_tokens_per_micro_batch=130")):
        run = tiny_run(tmp_path, setting, "train.steps=1", f"objective.name={objective}", "task.overlong_buffer=6",
                       *extra)
        sizes.clear()
        train(run, tmp_path / f"m{k}", progress=False)
        finals.append(torch.load(tmp_path / f"m{k}" / "checkpoints" / "last.pt", weights_only=False)["policy"])
        counts.append(list(sizes))
        logged.append(read_jsonl(tmp_path / f"m{k}" / "metrics.jsonl")[1])
    for key in finals[0]:
        assert torch.allclose(finals[0][key], finals[1][key], atol=1e-6), key
        assert torch.allclose(finals[0][key], finals[2][key], atol=1e-6), key
    # the logged loss and its shares (summed over an optimizer step's micro-batches, not averaged) as the whole's
    own = {"dapo": ["entropy_bonus"], "a2po": ["implicit_reward", "a2po_target", "a2po_residual"]}  # means over the
    for key in ["loss", "pg_loss", *own.get(objective, [])]:  # minibatch's sequences: shares of the whole, as pg_loss
        assert [row[key] for row in logged] == pytest.approx([logged[0][key]] * 3, rel=1e-5, abs=1e-7), key
    if objective == "dapo":  # loss = pg_loss - coef x bonus, each a mean over the step's 2 optimizer steps
        for row in logged:
            assert row["loss"] == pytest.approx(row["pg_loss"] - 0.01 * row["entropy_bonus"], rel=1e-6, abs=1e-9)
    assert counts[:2] == [[8, 8], [4] * 4] and sum(counts[2]) == 16 and len(counts[2]) > 2
    if objective == "conspo":  # whole groups of 4: each over the budget, alone
        assert counts[2] == [4] * 4
    else:
        assert len(set(counts[2])) > 1, counts  # packed to the budget: micro-batches of different sizes
    # the extra pass ran only for p3o and only when micro-batching (2 minibatches of 2 or more micro-batches)
    assert [p.stats is not None for p in passes] == [False] * 2 + [objective == "p3o"] * 4


def test_token_budget_micro_batches_pack_consecutive_rows_or_groups():
    rows, tokens = torch.arange(10, 16), torch.tensor([5, 3, 9, 2, 2, 7])
    chunks = [c.tolist() for c in token_budget_chunks(rows, tokens, budget=8)]
    assert chunks == [[10, 11], [12], [13, 14], [15]]  # 8, 9 alone (over the budget), 4 (+7 would be 11), 7
    groups = [c.tolist() for c in token_budget_chunks(rows, tokens, budget=20, unit=2)]
    assert groups == [[10, 11, 12, 13], [14, 15]]  # groups of 8, 11 and 9 tokens
    assert [c.tolist() for c in token_budget_chunks(rows, tokens, budget=100, unit=3)] == [list(range(10, 16))]


def test_a_plan_splits_by_rows_or_by_its_token_budget():
    batch = toy_batch()
    plan = toy_plan(batch)
    minibatch = next(minibatches(plan, torch.Generator().manual_seed(0)))
    assert [len(c) for c in plan.microbatches(minibatch)] == [4, 4]
    budget = dataclasses.replace(plan, max_tokens_per_micro_batch=1)  # every row over the budget: one each
    assert [c.tolist() for c in budget.microbatches(minibatch)] == [[row] for row in minibatch.rows.tolist()]
    groups = dataclasses.replace(budget, micro_batch_unit=4)  # every group over the budget: one each
    assert [c.tolist() for c in groups.microbatches(minibatch)] == [minibatch.rows[:4].tolist(),
                                                                    minibatch.rows[4:].tolist()]
    assert plan.micro_batch_unit == 1 and toy_plan(batch, objective="conspo").micro_batch_unit == 4


@pytest.mark.parametrize("objective", ["grpo", "gspo"])  # a per-token loss, a per-sequence loss
@pytest.mark.parametrize("split", [{"micro_batch_size": 4}, {"max_tokens_per_micro_batch": 17}])
def test_the_loops_micro_batches_sum_to_the_minibatch_in_every_aggregation(objective, split):
    """The loop's own minibatches, splits and objective inputs (``minibatches``, ``UpdatePlan.microbatches``,
    ``policy_batch``), not a test's copy of them: each split's losses sum to the whole minibatch's loss and gradient,
    in every aggregation, with a KL term and correction weights, where minibatches of 6 rows split groups of 4
    (prompt_mean then counts each group's rows in the minibatch)."""
    batch = toy_batch(24)
    g = torch.Generator().manual_seed(3)
    batch.old_logp = batch.old_logp.double()
    batch.ref_logp = batch.old_logp - torch.rand(batch.old_logp.shape, generator=g, dtype=torch.float64)
    batch.correction = torch.rand(batch.old_logp.shape, generator=g, dtype=torch.float64) * 2
    train = {**TOY_TRAIN, "prompts_per_step": 6, "num_minibatches": 4, **split}
    plan = UpdatePlan.of(batch, OmegaConf.create({"seed": 0, "objective": {"name": objective}, "train": train}), 3)
    current = (batch.old_logp + 0.3 * torch.randn(batch.old_logp.shape, generator=g, dtype=torch.float64))
    current.requires_grad_()
    mask, seen = batch.rollout.completion_mask, set()
    for mode in OBJECTIVES.get(objective).aggregations:
        learner_objective = get_objective(objective, aggregation=mode, beta=0.04)
        for minibatch in minibatches(plan, torch.Generator().manual_seed(0)):
            sums = []
            for chunks in ([minibatch.rows], plan.microbatches(minibatch)):
                total = 0.0
                for rows in chunks:
                    width = int(mask[rows].sum(-1).max())
                    forward = RowsForward(rows, current[rows, :width], None, mask[rows, :width], width)
                    total = total + learner_objective(policy_batch(plan, minibatch, forward, RunState())).loss
                sums.append((total, *torch.autograd.grad(total, current)))
                seen.add(len(chunks))
            assert sums[1][0].item() == pytest.approx(sums[0][0].item(), rel=1e-12, abs=1e-12), mode
            torch.testing.assert_close(sums[1][1], sums[0][1], rtol=1e-12, atol=1e-12)
    assert max(seen) > 1


def test_a_skipped_non_finite_update_takes_no_value_of_the_schedule():
    from harness.loop.build import build_optimizer, build_scheduler
    from harness.loop.update import Learner, RunState, optimizer_step

    param = torch.nn.Parameter(torch.ones(3))
    t = OmegaConf.create({"lr": 0.01, "weight_decay": 0.0, "warmup_steps": 3})
    optimizer = build_optimizer([param], t)
    scheduler, state, used = build_scheduler(optimizer, t), RunState(), []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    for loss in (1.0, float("nan"), 1.0, 1.0, 1.0):
        param.grad = torch.ones(3)
        optimizer_step(Learner(torch.nn.ParameterList([param]), get_objective("grpo"), optimizer, scheduler), loss,
                       1.0, state, {})
    assert used == pytest.approx([0.0025, 0.005, 0.0075, 0.01]) and state.nonfinite_skips == 1


def toy_batch(rows: int = 16, width: int = 5, correction: bool = False) -> TrainBatch:
    """A rollout of ``rows`` completions of char tokens (prompts of 3), completions 1..width long, and its batch."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = torch.arange(width)[None] < lengths[:, None]
    ro = Rollout(prompt_ids=torch.randint(5, 60, (rows, 3), generator=g),
                 prompt_mask=torch.ones(rows, 3, dtype=torch.long),
                 completion_ids=torch.randint(5, 60, (rows, width), generator=g), completion_mask=mask,
                 sampler_logp=-torch.rand(rows, width, generator=g) * mask, texts=[""] * rows,
                 truncated=torch.zeros(rows, dtype=torch.bool))
    return TrainBatch(ro, torch.rand(rows, generator=g), torch.randn(rows, generator=g),
                      torch.arange(rows // 4).repeat_interleave(4), ro.sampler_logp - 0.1,
                      correction=torch.ones(rows, width) * mask if correction else None)


TOY_TRAIN = {"prompts_per_step": 4, "group_size": 4, "num_minibatches": 2, "micro_batch_size": 4, "epochs": 1,
             "temperature": 1.0, "padding_free": True, "max_new_tokens": 8, "max_grad_norm": 1.0,
             "old_logp": "sampler", "max_tokens_per_micro_batch": 0}


def toy_plan(batch: TrainBatch, *settings: str, step: int = 3, objective: str = "grpo") -> UpdatePlan:
    return UpdatePlan.of(batch, OmegaConf.create({"seed": 0, "objective": {"name": objective}, "train": {
        **TOY_TRAIN, **dict(s.split("=") for s in settings)}}), step)


@pytest.mark.parametrize("size", [8, 2])  # 8: whole groups of 4 per minibatch; 2: rows shuffled one by one
def test_minibatches_cover_every_row_once_and_keep_groups_whole_when_they_fit(size):
    batch = toy_batch()
    plan = dataclasses.replace(toy_plan(batch), minibatch_size=size, microbatch_size=size // 2)
    parts = list(minibatches(plan, torch.Generator().manual_seed(plan.order_seed)))
    assert sorted(torch.cat([m.rows for m in parts]).tolist()) == list(range(16))
    assert all(len(m.rows) == size for m in parts) and len(parts) == 16 // size
    for m in parts:
        assert m.num_tokens == batch.rollout.completion_mask[m.rows].sum() and m.stats is None
        assert [len(c) for c in m.chunks(plan.microbatch_size)] == [size // 2] * 2
        if size % 4 == 0:  # whole groups, each contiguous
            assert all(len(set((m.rows[i : i + 4] // 4).tolist())) == 1 for i in range(0, size, 4))
    again = list(minibatches(plan, torch.Generator().manual_seed(plan.order_seed)))
    assert all(torch.equal(a.rows, b.rows) for a, b in zip(parts, again, strict=True))  # the seed decides the order


@pytest.mark.parametrize("old_logp, correction, sampler_given", [
    ("sampler", False, False), ("recompute", False, True), ("recompute", True, True)])
def test_the_objective_gets_the_sampler_logprobs_whenever_its_old_logprobs_are_recomputed(
        old_logp, correction, sampler_given, tiny_model):
    """The behaviour (sampler) log-probs reach the objective whenever its old log-probs are the proximal policy's (a
    rollout correction too: M2PO's mask and OPSM read them); ``behaviour_corrected`` says a correction weighs them."""
    policy, _ = tiny_model
    batch = toy_batch(correction=correction)
    plan = toy_plan(batch, f"old_logp={old_logp}")
    assert plan.rollout_step == 2
    seen = []

    class Seen(Objective):  # a test double subclasses Objective: the loop calls its declared hooks, not getattr
        def __call__(self, policy_batch):
            seen.append(policy_batch)
            return ObjectiveOutput((policy_batch.logp * policy_batch.mask).sum(), {"x": 1.0})

    minibatch = next(minibatches(plan, torch.Generator().manual_seed(0)))
    learner = Learner(policy, Seen(), None, None)
    part = microbatch_loss(learner, plan, minibatch, minibatch.rows[:4], RunState(optimizer_steps=5), with_entropy=True)
    (seen_batch,) = seen
    assert seen_batch.num_tokens == minibatch.num_tokens and seen_batch.num_sequences == plan.minibatch_size == 8
    assert (seen_batch.sampler_logp is not None) == sampler_given and seen_batch.step == 5
    assert seen_batch.behaviour_corrected == correction
    assert (seen_batch.correction is None) != correction
    assert part.tokens == int(batch.rollout.completion_mask[minibatch.rows[:4]].sum()) and "entropy" in part.metrics
    assert not part.forward.logp.requires_grad and part.forward.width == seen_batch.logp.shape[1]


def test_timings_report_only_the_phases_that_ran():
    timings = Timings()
    with timings.timed("backward_s"):
        pass
    with timed(None, "optimizer_s"):  # no timings: nothing recorded, nothing fails
        pass
    assert list(timings.metrics()) == ["update_backward_s"] and timings.metrics()["update_backward_s"] >= 0


@pytest.mark.slow
def test_no_gradient_is_held_after_the_update(tmp_path, monkeypatch):
    """The last optimizer step's gradients are dropped: the rollout and evaluation that follow do not hold them."""
    held, real = [], harness.loop.native.evaluate
    monkeypatch.setattr(harness.loop.native, "evaluate", lambda policy, *a, **k: (
        held.append(sum(p.grad is not None for p in policy.parameters())) or real(policy, *a, **k)))
    train(tiny_run(tmp_path, "train.steps=2", "train.eval_every=1"), tmp_path / "run", progress=False)
    assert held == [0, 0, 0]  # at the start, after step 1, after step 2


def test_the_trl_backend_takes_prompt_mean_only_on_one_micro_batch_per_optimizer_step(tmp_path):
    """TRL shuffles and splits a minibatch's groups across micro-batches and processes, so each would count its own
    prompts: refused in one line unless the optimizer step is one micro-batch on one process."""
    from harness.loop.trl_limits import trl_unsupported

    prompt_mean = "objective.params.aggregation=prompt_mean"
    reason = trl_unsupported(tiny_run(tmp_path, prompt_mean))
    assert "normalises by each prompt's tokens in the minibatch (aggregation prompt_mean)" in reason
    assert "\n" not in reason and trl_unsupported(tiny_run(tmp_path)) is None
    assert trl_unsupported(tiny_run(tmp_path, prompt_mean, "train.num_minibatches=1")) is None
