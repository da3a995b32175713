"""The native update's shared arithmetic, pinned by values: each objective input comes from its own source, and the
loop's optimizer steps (epochs x minibatches, micro-batches summed, gradients cleared between steps) apply the whole
minibatch's gradient at the run's temperature."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from harness.loop.native import update
from harness.loop.update import Learner, RowsForward, RunState, minibatches, policy_batch
from harness.policy.forward import completion_logprobs
from objectives import get_objective
from tests.test_update import TOY_TRAIN, toy_batch, toy_plan


def test_policy_batch_takes_each_input_from_its_own_source():
    """old log-probs are the batch's behaviour/proximal ones (not the current policy's), the KL's are the reference's
    (not the old policy's), the correction and advantages the batch's rows, the rollout step the one before."""
    batch = toy_batch(correction=True)
    g = torch.Generator().manual_seed(1)
    batch.ref_logp = batch.old_logp - torch.rand(batch.old_logp.shape, generator=g)
    batch.correction = torch.rand(batch.old_logp.shape, generator=g) * batch.rollout.completion_mask
    plan = toy_plan(batch, "old_logp=recompute", step=5)
    minibatch = next(minibatches(plan, torch.Generator().manual_seed(0)))
    rows = minibatch.rows[:4]
    width = int(batch.rollout.completion_mask[rows].sum(-1).max())
    current = batch.old_logp[rows, :width] + 0.5
    seen = policy_batch(plan, minibatch, RowsForward(rows, current, None, batch.rollout.completion_mask[rows, :width],
                                                     width), RunState())
    torch.testing.assert_close(seen.logp, current)
    torch.testing.assert_close(seen.old_logp, batch.old_logp[rows, :width])
    torch.testing.assert_close(seen.ref_logp, batch.ref_logp[rows, :width])
    torch.testing.assert_close(seen.sampler_logp, batch.rollout.sampler_logp[rows, :width])
    torch.testing.assert_close(seen.correction, batch.correction[rows, :width])
    torch.testing.assert_close(seen.advantages, batch.advantages[rows])
    assert seen.rollout_step == 4 and seen.num_sequences == plan.minibatch_size


def test_run_state_counts_every_optimizer_step_of_the_run():
    t = OmegaConf.create({"steps": 3, "epochs": 2, "num_minibatches": 2})
    assert RunState.resumed(None, t).total_optimizer_steps == 12


class Recorder(torch.optim.Optimizer):
    """An optimizer that records each step's gradients and leaves the parameters as they are."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for group in self.param_groups for p in group["params"]])


@pytest.mark.slow  # eight forward/backward passes of the tiny model
def test_each_optimizer_step_applies_its_whole_minibatchs_gradient(tiny_model):
    """epochs x num_minibatches steps; each step's gradient is the one of its minibatch's loss computed at once (not
    scaled by the micro-batch count, not accumulated from the previous step), at train.temperature; the step's
    ``loss`` metric is the minibatch's loss, the micro-batches' sum."""
    policy, _ = tiny_model
    policy.eval()  # no dropout: two forwards give the same log-probs
    batch = toy_batch()
    plan = dataclasses.replace(toy_plan(batch), epochs=2, microbatch_size=2, temperature=0.7)
    params = [p for p in policy.parameters() if p.requires_grad]
    recorder = Recorder(params)
    learner = Learner(policy, get_objective("grpo", beta=0.0), recorder,
                      torch.optim.lr_scheduler.LambdaLR(recorder, lambda _: 1.0))
    policy.train = lambda mode=True: policy  # update() sets train mode; keep eval (no dropout) for exact values
    stats = update(learner, plan, RunState())
    generator = torch.Generator().manual_seed(plan.order_seed)
    expected, losses = [], []
    for _ in range(2):
        for minibatch in minibatches(plan, generator):
            ro, rows = batch.rollout, minibatch.rows
            width = int(ro.completion_mask[rows].sum(-1).max())
            logp, _ = completion_logprobs(policy, ro.prompt_ids[rows], ro.prompt_mask[rows],
                                          ro.completion_ids[rows, :width], ro.completion_mask[rows, :width], 0.7)
            forward = RowsForward(rows, logp, None, ro.completion_mask[rows, :width], width)
            loss = learner.objective(policy_batch(plan, minibatch, forward, RunState())).loss
            expected.append(torch.autograd.grad(loss, params))
            losses.append(loss.item())
    assert len(recorder.grads) == len(expected) == 2 * TOY_TRAIN["num_minibatches"]
    for got, want in zip(recorder.grads, expected, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert stats["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4, abs=1e-7)
