"""The native loop on a Mixture-of-Experts policy (tiny_moe) with routing replay (train.routing_replay): the update's
forwards force the behaviour routing while the routers keep their gradient; with unchanged weights replay changes
nothing, bit for bit; R3's record from the real sampler path equals the trainer's teacher-forced routing; micro-batches
replay as the whole minibatch; a killed run resumes exactly; MoE models never take the padding-free forward; the new
error paths are one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from harness.loop.batch import TrainBatch, collect_batch
from harness.loop.behaviour import behaviour_logprobs, no_grad_logprobs
from harness.loop.build import build_learner, hook_routing, setup_run
from harness.loop.native import train, update
from harness.loop.update import Minibatch, RunState, UpdatePlan, forward_rows, microbatch_loss
from harness.policy import forward as forward_module
from harness.policy.forward import padding_free_unsupported
from harness.policy.routing import find_routers
from harness.policy.sampler import generate
from harness.run.errors import ConfigError
from harness.tasks import Arith, Score
from tests.helpers.interrupt import full_and_resumed
from tests.helpers.tiny import tiny_run
from tests.helpers.tiny_moe import perturb_routers, tiny_moe_run

# the overlong penalty gives the random policy's groups unequal rewards, so the update has a gradient to follow
SIGNAL = ("task.overlong_buffer=6", "train.num_minibatches=1")


def moe_step(tmp_path, mode: str, *overrides):
    """A tiny_moe run's config, setup (routing hooked) and its step-1 batch with the behaviour routing of ``mode``."""
    cfg = tiny_moe_run(tmp_path, f"train.routing_replay={mode}", *SIGNAL, *overrides)
    run = setup_run(cfg, torch.device("cpu"))
    hook_routing(run, cfg.train)
    ro, rewards, *_ = collect_batch(run.sampler, run.tokenizer, run.task, run.train_problems, cfg, step=1)
    group_ids = torch.arange(cfg.train.prompts_per_step).repeat_interleave(cfg.train.group_size)
    behaviour = behaviour_logprobs(run.policy, run.reference, ro, cfg, False)
    batch = TrainBatch(ro, rewards, run.estimator(rewards, group_ids), group_ids, behaviour.old_logp,
                       behaviour.ref_logp, behaviour.correction, behaviour.routing)
    return cfg, run, batch, behaviour


def updated(run, cfg, plan: UpdatePlan, start: dict) -> tuple[dict, dict]:
    """One step's update from the weights ``start``: its metrics and the weights after it."""
    run.policy.load_state_dict(start)
    metrics = update(build_learner(run.policy, run.objective, cfg.train), plan, RunState())
    return metrics, {name: p.detach().clone() for name, p in run.policy.state_dict().items()}


def experts_calls(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every experts call's (top_k_index, top_k_weights), as the forward runs."""
    seen = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(lambda module, args: seen.append((args[1], args[2])))
    return seen


@pytest.mark.slow
def test_update_forwards_force_the_behaviour_routing_and_the_routers_learn(tmp_path, monkeypatch):
    cfg, run, batch, _ = moe_step(tmp_path, "r2")
    assert padding_free_unsupported(run.policy, batch.rollout.prompt_mask, batch.rollout.completion_mask)
    monkeypatch.setattr(forward_module, "completion_hidden", lambda *a: pytest.fail("MoE took the padding-free path"))
    plan = UpdatePlan.of(batch, cfg, 1)
    assert plan.replay and plan.padding_free
    perturb_routers(run.policy)
    calls = experts_calls(run.policy)
    rows = torch.arange(0, len(batch.rewards), cfg.train.group_size)  # one row per group: one full forward
    run.policy.train()
    forward = forward_rows(run.policy, plan, rows)
    (-forward.logp.sum()).backward()
    behaviour = batch.routing.select(rows, forward.width)
    assert forward.volatility.changed_frac > 0  # the moved routers would route otherwise
    valid = behaviour.valid
    for layer, (index, _) in enumerate(calls):
        forced = index.view(*valid.shape, -1)
        assert torch.equal(forced[valid], behaviour.indices[layer][valid].long())
    for router in find_routers(run.policy).values():
        assert router.weight.grad is not None and bool(router.weight.grad.abs().sum() > 0)


@pytest.mark.slow
def test_replay_with_unchanged_weights_equals_no_replay_bit_for_bit(tmp_path):
    cfg, run, batch, _ = moe_step(tmp_path, "r2")
    start = {name: p.detach().clone() for name, p in run.policy.state_dict().items()}
    plan = UpdatePlan.of(batch, cfg, 1)  # one minibatch: its forward sees the weights the record was made with
    replayed, replayed_weights = updated(run, cfg, plan, start)
    plain, plain_weights = updated(run, cfg, dataclasses.replace(plan, replay=False), start)
    assert replayed == plain and replayed["expert_changed_frac"] == 0.0
    assert all(torch.equal(replayed_weights[name], plain_weights[name]) for name in plain_weights)
    assert any(not torch.equal(start[name], plain_weights[name]) for name in start)  # the update moved the policy


def test_r3_sampler_record_equals_the_trainers_teacher_forced_routing(tmp_path):
    cfg, run, batch, behaviour = moe_step(tmp_path, "r3", "task.overlong_buffer=0")
    ro = batch.rollout
    assert batch.routing is ro.routing  # R3's behaviour routing is the sampler's
    _, forced, _ = no_grad_logprobs(run.policy, ro, cfg.train, record=True)
    real = torch.cat([ro.prompt_mask.bool(), ro.completion_mask], 1)
    assert torch.equal(forced.valid, real)
    fed = real.clone()  # every real token but a completion's last one went through the sampler's forward
    fed[torch.arange(len(real)), ro.prompt_ids.shape[1] + ro.completion_mask.sum(-1) - 1] = False
    assert bool(ro.routing.valid[fed].all()) and not bool(ro.routing.valid[~real].any())
    assert torch.equal(ro.routing.indices[:, ro.routing.valid], forced.indices[:, ro.routing.valid])
    assert behaviour.metrics["recompute_expert_changed_frac"] == 0.0


@pytest.mark.slow
def test_microbatched_update_replays_as_the_whole_minibatch(tmp_path):
    cfg, run, batch, _ = moe_step(tmp_path, "r2")
    perturb_routers(run.policy)  # replay now overrides routing: the micro-batches must force the same experts
    start = {name: p.detach().clone() for name, p in run.policy.state_dict().items()}
    plan = UpdatePlan.of(batch, cfg, 1)
    whole, whole_weights = updated(run, cfg, plan, start)
    micro, micro_weights = updated(run, cfg, dataclasses.replace(plan, microbatch_size=cfg.train.group_size), start)
    assert whole["expert_changed_frac"] > 0
    # (the aux loss and the load entropy are each forward's own, nonlinear in its tokens: not compared)
    for key in ("loss", "expert_changed_frac", "expert_token_changed_frac", "expert_layer_changed_max"):
        assert micro[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    for name, weight in whole_weights.items():
        torch.testing.assert_close(micro_weights[name], weight, rtol=1e-4, atol=1e-6)  # an Adam step moves 1e-3


@pytest.mark.parametrize("mode", ["none", "r2", pytest.param("r3", marks=pytest.mark.slow)])  # r3 replays as r2
def test_activation_checkpointing_gives_the_same_loss_and_gradients(tmp_path, mode):
    """train.activation_checkpointing on the MoE: each layer's recompute in backward forces the routing its forward
    took (the behaviour routing where replay forced it), in every replay mode, routers moved first so that replay
    overrides the live routing. Loss, metrics and gradients equal those without checkpointing to 1e-6 (measured
    1e-8): a checkpointed forward runs each row's whole [prompt | completion] (its layers drop the cache of the
    shared-prompt pass), so attention sums in other shapes, float32 round-off; with the same forward shapes the
    recompute is bit-exact (tests/test_routing.py)."""
    cfg, run, batch, _ = moe_step(tmp_path, mode)
    perturb_routers(run.policy)
    plan = UpdatePlan.of(batch, cfg, 1)
    rows = torch.arange(len(batch.rewards))
    minibatch = Minibatch(rows, batch.rollout.completion_mask.sum())
    results = []
    for checkpointing in (False, True):
        forward_module.set_memory_settings(run.policy, activation_checkpointing=checkpointing)
        run.policy.zero_grad()
        run.policy.train()
        part = microbatch_loss(build_learner(run.policy, run.objective, cfg.train), plan, minibatch, rows, RunState())
        results.append((part, {name: p.grad.clone() for name, p in run.policy.named_parameters()}))
    (plain, plain_grads), (checkpointed, checkpointed_grads) = results
    assert plain.forward.volatility.changed_frac > 0  # the moved routers route otherwise than the behaviour
    assert checkpointed.forward.volatility == plain.forward.volatility
    assert checkpointed.loss == pytest.approx(plain.loss, rel=0, abs=1e-6)
    assert checkpointed.metrics == pytest.approx(plain.metrics, rel=0, abs=1e-6)
    assert max(grad.abs().max() for grad in plain_grads.values()) > 1e-2
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=0, atol=1e-6)


@pytest.mark.slow  # two whole runs: make test
def test_a_killed_moe_run_resumes_to_the_uninterrupted_metrics(tmp_path):
    run = tiny_moe_run(tmp_path, "train.routing_replay=r3", "task.overlong_buffer=6", "train.steps=3")
    full, part = full_and_resumed(train, run, tmp_path, step=3)
    assert [r["step"] for r in part] == [0, 1, 2, 3] and part == full
    assert all(r["expert_changed_frac"] > 0 for r in full[2:])  # routing moved, and was measured, after step 1


def test_new_error_paths_are_one_line(tmp_path):
    dense = tiny_run(tmp_path)
    run = setup_run(dense, torch.device("cpu"))
    stale = OmegaConf.merge(dense, {"train": {"routing_replay": "r2"}})  # as a hub id whose config was not cached
    _, moe_run, _, _ = moe_step(tmp_path, "none")
    prompts = ["1+1=\n"]
    cases = [
        (lambda: hook_routing(run, stale.train), ConfigError, "not a Mixture-of-Experts model"),
        (lambda: generate(moe_run.policy, moe_run.tokenizer, prompts, max_new_tokens=2, sampler="hf",
                          record_routing=True), ValueError, "needs the native sampler"),
        (lambda: generate(run.policy, run.tokenizer, prompts, max_new_tokens=2, record_routing=True), ValueError,
         "no routing hooks on the sampler"),
    ]
    for make, error, words in cases:
        with pytest.raises(error, match=words) as info:
            make()
        assert "\n" not in str(info.value)


def test_dynamic_sampling_repads_the_samplers_routing_with_its_rows(tmp_path, monkeypatch):
    """Groups of several sampling rounds (prompts of different widths) keep their own R3 record, re-padded as
    their rows are: it still equals the trainer's teacher-forced routing of the batch."""
    monkeypatch.setattr(Arith, "score", lambda self, completion, problem: Score(float(len(completion) % 2), 0.0))
    cfg = tiny_moe_run(tmp_path, "train.routing_replay=r3", "train.dynamic_sampling=true", "train.group_size=2")
    run = setup_run(cfg, torch.device("cpu"))
    hook_routing(run, cfg.train)
    ro, _, stats, *_ = collect_batch(run.sampler, run.tokenizer, run.task, run.train_problems, cfg, step=1)
    assert stats["sampling_rounds"] > 1 and stats["frac_zero_std_groups_trained"] == 0
    _, forced, _ = no_grad_logprobs(run.policy, ro, cfg.train, record=True)
    valid = ro.routing.valid
    assert bool(valid.any()) and bool(forced.valid[valid].all())
    assert torch.equal(ro.routing.indices[:, valid], forced.indices[:, valid])


def test_r3_records_a_sampler_copy_in_another_precision(tmp_path):
    """model.sampler_dtype: the bf16 copy samples with its own routing hooks; the fp32 recompute replays its record
    and measures how often the trainer would route otherwise (the routing part of the train-inference mismatch)."""
    cfg, run, batch, behaviour = moe_step(tmp_path, "r3", "model.sampler_dtype=bfloat16")
    assert run.sampler is not run.policy and batch.routing is batch.rollout.routing
    assert bool(batch.routing.valid.any())
    assert 0.0 <= behaviour.metrics["recompute_expert_changed_frac"] <= 1.0
    assert behaviour.metrics["recompute_routed_tokens"] > 0


@pytest.mark.slow
def test_an_in_flight_moe_run_logs_its_routing_metrics_at_every_step_or_none(tmp_path):
    """Without replay and on the behaviour log-probs, an in-flight run's batches are sampled by several versions and
    record no sampler routing: expert volatility, load entropy and aux loss were logged at step 1 (its batch sampled
    whole) and missing from every later step, so a report's mean over steps was step 1's alone. None is logged; with
    recomputed old log-probs (the proximal's routing) every step logs them."""
    from harness.run.records import read_jsonl

    in_flight = (*SIGNAL, "train.steps=3", "train.rollout_lag=1", "train.in_flight_tokens=3")
    for extra, logged in (((), False), (("train.old_logp=recompute",), True)):
        run = tiny_moe_run(tmp_path, *in_flight, *extra)
        folder = tmp_path / f"run{len(extra)}"
        train(run, folder, progress=False)
        rows = read_jsonl(folder / "metrics.jsonl")[1:]
        assert [("expert_changed_frac" in r) == ("router_aux_loss" in r) == logged for r in rows] == [True] * 3
