"""The TRL backend is the native loop's math: (a) on a fixed batch, its loss and gradient equal the native loop's
(harness.loop.native.update); (b) the registry's objectives equal TRL's built-in loss types where TRL has one; (c) a
run through the backend writes the native results files.

The batch is fixed by calling the trainer's ``_compute_loss`` on a hand-made ``inputs`` dict (the one TRL builds
in ``_generate_and_score_completions``): sampled completions of a tiny model, behaviour and reference
log-probs perturbed so that ratios move off 1 and clipping is active.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from omegaconf import OmegaConf
from trl import GRPOTrainer

from harness.loop import trl_backend
from harness.loop.batch import TrainBatch
from harness.loop.metrics import MetricMeter
from harness.loop.native import update
from harness.loop.trl_backend import (
    ROUTING_KEY,
    RegistryGRPOTrainer,
    grpo_config,
    problems_dataset,
    reward_functions,
    train_trl,
)
from harness.loop.update import Learner, RunState, UpdatePlan, forward_rows
from harness.policy.expert_volatility import capture_metrics, merge_volatility
from harness.policy.models import build_prompt
from harness.run.errors import ConfigError
from harness.run.records import TIMING_METRICS, read_jsonl
from objectives import get_objective
from tests.helpers.interrupt import stopped_before
from tests.helpers.tiny import TINY_SPEC
from tests.helpers.tiny_moe import perturb_routers, tiny_moe_run
from tests.helpers.trl import (
    GradCapture,
    NoSchedule,
    assert_same,
    loss_and_grad,
    make_trainer,
    run_config,
    trl_inputs,
)
from tests.test_native_moe import moe_step


@pytest.mark.parametrize("objective, params", [("grpo", {}), ("gspo", {"clip_low": 0.1, "clip_high": 0.1}),
                                               ("ctpo", {"beta": 0.04}),
                                               ("grpo", {"entropy_coef": 0.05, "top_entropy_quantile": 0.5})])
def test_trl_backend_loss_and_gradient_equal_the_native_loop(fixed, tmp_path, objective, params):
    model, _, _, _, ro, old_logp, ref_logp, rewards, group_ids, advantages = fixed
    run = run_config(tmp_path, f"objective.name={objective}", *(f"objective.params.{k}={v}" for k, v in
                                                                  params.items()))
    policy = copy.deepcopy(model)
    capture = GradCapture(policy)
    batch = TrainBatch(ro, rewards, advantages, group_ids, old_logp, ref_logp if params.get("beta") else None)
    native = update(Learner(policy, get_objective(objective, **params), capture, NoSchedule()),
                    UpdatePlan.of(batch, run, 1), RunState(total_optimizer_steps=1))
    inputs = trl_inputs(fixed)
    if not params.get("beta"):
        inputs.pop("ref_per_token_logps")
    trainer = make_trainer(fixed, run, tmp_path)
    loss, grads = loss_and_grad(trainer, inputs)
    assert_same(native["loss"], capture.grads, loss, grads)
    assert 0 < native["clip_frac"] < 1  # the batch exercises the clipping
    assert trainer.meter.result()["clip_frac"] == pytest.approx(native["clip_frac"])
    assert trainer.meter.result()["entropy"] == pytest.approx(native["entropy"])  # over the valid tokens only


@pytest.mark.parametrize("objective", ["grpo", "dapo", "p3o"])
def test_accumulated_micro_batches_give_the_minibatch_gradient(fixed, tmp_path, objective):
    """2 minibatches of 8 sequences, micro-batches of 4: TRL's steps_per_generation 4, accumulation 2. The two
    micro-batches of the first optimizer step, summed as Trainer does, give the objective on their minibatch with
    its exact token count (seq-mean: GRPO, token-mean: DAPO) and, for P3O, its minibatch ESS (the no-grad first
    pass at the step's first micro-batch)."""
    run = run_config(tmp_path, f"objective.name={objective}", "train.num_minibatches=2", "train.micro_batch_size=4")
    trainer = make_trainer(fixed, run, tmp_path)
    assert (trainer.args.steps_per_generation, trainer.args.gradient_accumulation_steps) == (4, 2)
    trainer._generate_and_score_completions = lambda generation_batch: trl_inputs(fixed)  # the fixed rollout
    trainer.current_gradient_accumulation_steps = 2
    trainer.model.zero_grad(set_to_none=True)
    micro, loss = [], 0.0
    for step in range(2):
        trainer._step = step
        micro.append(trainer._prepare_inputs(None))
        part = trainer._compute_loss(trainer.model, micro[-1])
        part.backward()
        loss += part.detach()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    tokens = sum(m["completion_mask"].sum() for m in micro)
    assert micro[0]["num_tokens_step"] == micro[1]["num_tokens_step"] == tokens
    assert ("minibatch_stats.n" in micro[1]) == (objective == "p3o")
    minibatch = {k: torch.cat([m[k] for m in micro]) for k, v in micro[0].items() if v.dim() > 0}
    trainer.current_gradient_accumulation_steps = 1
    micro_metrics, trainer.meter = trainer.meter.result(), MetricMeter(trainer.objective.minibatch_shares())
    assert_same(loss, grads, *loss_and_grad(trainer, {**minibatch, "num_tokens_step": tokens}))
    for key in ("clip_frac", "pg_loss"):  # the step's, logged: a token-weighted mean, a sum of micro-batch shares
        assert micro_metrics[key] == pytest.approx(trainer.meter.result()[key]), key


def test_grpo_config_carries_the_runs_schedule_sampling_and_correction(tmp_path):
    run = run_config(tmp_path, "train.epochs=2", "train.steps=3", "train.num_minibatches=2", "train.temperature=0.7",
                     "train.top_p=0.9", "train.max_grad_norm=0.5", "train.rollout_correction.mode=token_mask",
                     "train.rollout_correction.threshold=2.0", "train.rollout_correction.threshold_lower=0.25")
    args = grpo_config(run, tmp_path / "trl")
    assert (args.num_iterations, args.steps_per_generation, args.max_steps) == (2, 2, 3 * 2 * 2)
    assert (args.temperature, args.top_p, args.max_grad_norm) == (0.7, 0.9, 0.5)
    assert (args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max) == (0.25, 2.0)


def test_prompts_are_chat_messages_only_for_a_tokenizer_with_a_chat_template(fixed):
    """TRL applies the template to a message; a tokenizer without one gets the native prompt text."""
    _, tokenizer, _, problems = fixed[:4]
    assert problems_dataset(problems, tokenizer)["prompt"] == [build_prompt(tokenizer, p.question) for p in problems]
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = "{{ messages[0]['content'] }}"
    assert problems_dataset(problems, templated)["prompt"] == [[{"role": "user", "content": p.question}]
                                                               for p in problems]


def test_reward_functions_are_the_tasks_correct_and_format_in_that_order(fixed):
    """TRL weights them by position (1, task.format_weight) and logs them by name."""
    task = fixed[2]
    problem = task.eval_problems()[0]
    fields = {"question": [problem.question] * 2, "answer": [problem.answer] * 2, "solution": [problem.solution] * 2}
    completions = [[{"role": "assistant", "content": "#### 99999"}], problem.solution]  # a chat's, a plain one
    functions = reward_functions(task)
    assert [f.__name__ for f in functions] == ["correct", "format"]
    assert [f(completions, **fields) for f in functions] == [[0.0, 1.0], [1.0, 1.0]]


def test_the_rollouts_rewards_groups_and_advantages_are_the_native_ones(fixed, tmp_path, monkeypatch):
    """After TRL's generation and scoring: the weighted reward (correct + format_weight x format), groups of
    group_size consecutive rows, the objective's advantages of them, and the rollout correction's weights when a
    mode is set (1 without vLLM) with NaN-free metrics where vLLM could not score a token."""
    run = run_config(tmp_path, "task.format_weight=0.5", "train.rollout_correction.mode=token_truncate")
    trainer = make_trainer(fixed, run, tmp_path, train=run.train, reward_weights=[1.0, 0.5])
    inputs = trl_inputs(fixed)
    rows = len(inputs["advantages"])
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions",
                        lambda self, batch: {**inputs, "advantages": torch.zeros(rows)})
    correct = torch.tensor([1.0, 0.0, 0.0, 1.0] * (rows // 4))
    trainer._rewards_per_func = torch.stack([correct, torch.arange(rows) % 3 / 2.0], 1)
    out = trainer._generate_and_score_completions([None] * rows)
    rewards, groups = correct + 0.5 * (torch.arange(rows) % 3 / 2.0), torch.arange(rows) // run.train.group_size
    assert torch.equal(out["rewards"], rewards) and torch.equal(out["group_ids"], groups)
    lengths = inputs["completion_mask"].sum(-1)
    assert torch.allclose(out["advantages"], trainer.estimator(rewards, groups, lengths).float())
    mask = inputs["completion_mask"].bool()
    assert torch.equal(out["rollout_correction"][mask], torch.ones(int(mask.sum())))
    sampled = inputs["old_per_token_logps"] - 0.1
    sampled[0, 0] = float("nan")  # a token vLLM could not score: no correction
    out = {**inputs, "sampling_per_token_logps": sampled}
    trainer.add_rollout_correction(out)
    assert torch.isfinite(out["rollout_correction"]).all()
    assert all(math.isfinite(v) for v in trainer.meter.result().values())


def test_a_batch_without_behaviour_logps_takes_the_current_ones_as_constants(fixed, tmp_path):
    """TRL leaves old_per_token_logps out where they equal the current log-probs (one optimizer step per generation):
    the loss and gradient are those of the batch with the current log-probs given (a ratio of 1 whose gradient is
    the policy gradient, not a constant)."""
    trainer = make_trainer(fixed, run_config(tmp_path), tmp_path)
    inputs = trl_inputs(fixed)
    inputs.pop("ref_per_token_logps")
    with torch.no_grad():
        current, _ = trainer.completion_logp(trainer.model, inputs)
    given = loss_and_grad(trainer, {**inputs, "old_per_token_logps": current})
    inputs.pop("old_per_token_logps")
    assert_same(*given, *loss_and_grad(trainer, inputs))


def test_the_policy_batch_carries_the_schedules_steps_and_the_samplers_logps(fixed, tmp_path):
    """Schedules (ConsPO's margin, HölderPO's p) read the optimizer step of the run's max_steps and the rollout step
    (optimizer steps / (steps_per_generation x epochs)); vLLM's log-probs (NaN: unscored, the trainer's there) are
    the sampler's where the behaviour is the trainer's (train.old_logp recompute)."""
    trainer = make_trainer(fixed, run_config(tmp_path, "train.epochs=2", "train.steps=3"), tmp_path)
    trainer.state.global_step, trainer.state.max_steps = 5, 6
    inputs = trl_inputs(fixed)
    old = inputs["old_per_token_logps"]
    sampled = old - 0.1
    sampled[0, 0] = float("nan")
    batch = trainer.policy_batch({**inputs, "sampling_per_token_logps": sampled}, old.clone())
    assert (batch.step, batch.total_steps, batch.rollout_step) == (5, 6, 2)
    assert torch.equal(batch.old_logp, old)
    assert torch.equal(batch.sampler_logp, torch.where(torch.isnan(sampled), old, sampled))


# (registry objective, its hyperparameters, TRL's built-in options giving the same math)
TRL_BUILTINS = [
    ("grpo", {}, {"loss_type": "grpo", "epsilon": 0.2, "epsilon_high": 0.2}),
    ("grpo", {"beta": 0.04}, {"loss_type": "grpo", "epsilon": 0.2, "epsilon_high": 0.2, "beta": 0.04}),
    ("dapo", {"beta": 0.04}, {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04}),
    ("dr_grpo", {"beta": 0.04}, {"loss_type": "dr_grpo", "epsilon": 0.2, "epsilon_high": 0.2, "beta": 0.04}),
    # TRL's CISPO bound is an absolute cap on r (no floor): epsilon_high = 1 + clip_high, clip_low >= 1
    ("cispo", {"clip_low": 1.0, "clip_high": 0.5}, {"loss_type": "cispo", "epsilon_high": 1.5}),
    ("sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, {"loss_type": "sapo", "sapo_temperature_pos": 1.0,
                                                   "sapo_temperature_neg": 1.05}),
    ("gspo", {"clip_low": 0.1, "clip_high": 0.1, "beta": 0.04},
     {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.1, "epsilon_high": 0.1,
      "beta": 0.04}),
    # the entropy bonus and top-entropy token masking: TRL's own options of the same names
    ("grpo", {"entropy_coef": 0.05, "top_entropy_quantile": 0.3},
     {"loss_type": "grpo", "epsilon": 0.2, "epsilon_high": 0.2, "entropy_coef": 0.05, "top_entropy_quantile": 0.3}),
    ("dapo", {"entropy_coef": 0.05, "beta": 0.04},
     {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "entropy_coef": 0.05, "beta": 0.04}),
]


@pytest.mark.parametrize("objective, params, options", TRL_BUILTINS,
                         ids=[f"{o}{'-kl' if p.get('beta') else ''}{'-entropy' if 'entropy_coef' in p else ''}"
                              for o, p, _ in TRL_BUILTINS])
@pytest.mark.slow
def test_registry_objective_equals_trl_builtin_loss(fixed, tmp_path, objective, params, options):
    run = run_config(tmp_path, f"objective.name={objective}", *(f"objective.params.{k}={v}" for k, v in
                                                                  params.items()))
    options = dict(options)
    beta = options.pop("beta", 0.0)
    # TRL multiplies the k3 KL by the ratio unless told not to; it loads its reference model from the policy's
    # hub path when beta > 0, so beta is set after construction (the batch carries the reference log-probs)
    builtin = make_trainer(fixed, run, tmp_path, cls=GRPOTrainer, use_bias_correction_kl=False, **options)
    builtin.beta = beta
    registry = make_trainer(fixed, run, tmp_path)
    inputs = trl_inputs(fixed)
    assert_same(*loss_and_grad(builtin, inputs), *loss_and_grad(registry, inputs))
    if objective not in ("sapo",):
        assert 0 < registry.meter.result()["clip_frac"] < 1


@pytest.mark.slow
def test_backend_run_writes_the_native_results_files_and_resumes_exactly(tmp_path, rlvr_cache):
    """A warm-started tiny model (so that rewards vary), 2 minibatches of 2 micro-batches, a KL term; a run killed
    after step 2 of 3 (its last checkpoint, a torn metrics line) resumes into the uninterrupted run's metrics."""
    run = run_config(tmp_path, "objective.name=dapo", "train.steps=3", "train.num_minibatches=2",
                     "train.micro_batch_size=4", "train.max_new_tokens=16", "train.lr=1e-3", "task.args.digits=1",
                     "task.format_weight=0.5", "objective.params.beta=0.04", "model.warm_start_steps=100",
                     "model.warm_start_lr=1e-2", "model.warm_start_batch_size=32")
    summary = train_trl(run, tmp_path / "full", progress=False)
    assert summary["status"] == "finished" and summary["steps_done"] == 3 and summary["backend"] == "trl"
    rows = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in ("reward_mean", "reward_std", "accuracy", "completion_len_mean", "frac_truncated", "clip_frac",
                "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_std", "entropy", "grad_norm", "lr", "kl_ref",
                "kl_behavior", "loss", "rollout_tokens", "update_tok_s"):
        assert key in rows[1], key
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[3] and "eval_accuracy" not in rows[1]
    assert rows[1]["reward_std"] > 0 and rows[1]["kl_ref"] > 0 and rows[1]["grad_norm"] > 0
    for row in rows[1:]:  # the reward TRL trains on weighs format by task.format_weight, as natively
        assert row["reward_mean"] == pytest.approx(row["accuracy"] + 0.5 * row["format_reward"])
    assert rows[1]["ratio_std"] > 0  # the second minibatch sees the first one's update through recomputed old logp
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["status"] == "finished"
    assert OmegaConf.load(tmp_path / "full" / "config.yaml").backend == "trl"
    samples = read_jsonl(tmp_path / "full" / "eval_samples.jsonl")
    assert sorted({r["step"] for r in samples}) == [0, 3] and all("completion" in r for r in samples)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final")  # the trained policy, exported
    assert exported.config.hidden_size == TINY_SPEC["hidden_size"] and not (tmp_path / "full" / "final.tmp").exists()

    with stopped_before(3):  # a kill after step 2 of 3: its checkpoint, and a torn metrics line
        train_trl(run, tmp_path / "part", progress=False)
    with open(tmp_path / "part" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward_me')
    train_trl(run, tmp_path / "part", progress=False)
    for key in ("peak_mem_rollout_mb", "peak_mem_update_mb", "peak_mem_mb"):  # every step's memory, and the eval's
        assert all(r[key] > 0 for r in read_jsonl(tmp_path / "full" / "metrics.jsonl")[1:])
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["peak_mem_eval_mb"] > 0
    full, part = ([{k: v for k, v in r.items() if k not in TIMING_METRICS}
                   for r in read_jsonl(tmp_path / d / "metrics.jsonl")]
                  for d in ("full", "part"))
    assert part == full


def test_config_errors_name_the_backends(tmp_path):
    with pytest.raises(ConfigError, match="backend must be one of native, trl"):
        run_config(tmp_path, "backend=jax")
    with pytest.raises(ConfigError, match="sampler_dtype"):
        run_config(tmp_path, "model.sampler_dtype=bfloat16")
    with pytest.raises(ConfigError, match="dynamic_sampling is not supported"):
        run_config(tmp_path, "train.dynamic_sampling=true")
    with pytest.raises(ConfigError, match="overlong_buffer is not supported"):
        run_config(tmp_path, "task.overlong_buffer=4")


EXPERT_KEYS = ("expert_changed_frac", "expert_token_changed_frac", "expert_layer_changed_max", "expert_load_entropy",
               "router_aux_loss", "routed_tokens")


def spied_volatility(monkeypatch) -> list:
    """Every loss forward's expert volatility on the TRL backend, in order (capture_metrics spied on)."""
    seen = []

    def spy(behaviour, capture):
        volatility, metrics = capture_metrics(behaviour, capture)
        seen.append(volatility)
        return volatility, metrics

    monkeypatch.setattr(trl_backend, "capture_metrics", spy)
    return seen


@pytest.mark.slow  # a TRL run: make test
@pytest.mark.parametrize("lora", [(), pytest.param(("model.lora.rank=4",), marks=pytest.mark.slow)])  # TRL's peft
def test_moe_run_logs_expert_volatility_against_the_old_policy_pass(tmp_path, monkeypatch, lora):
    """tiny_moe, 2 minibatches per rollout batch (TRL records the behaviour routing in its old-policy pass), an
    entropy bonus so that every optimizer step moves the routers: each step logs the native loop's routing metrics;
    the step's first minibatch sees the weights the record was made with (volatility exactly 0, which a record
    misaligned with TRL's shuffled rows breaks), the second the moved ones (> 0, which comparing the live routing
    with itself would hide)."""
    seen = spied_volatility(monkeypatch)
    run = tiny_moe_run(tmp_path, "backend=trl", "device=cpu", "objective.params.entropy_coef=0.1", "train.lr=1e-2",
                       *lora)
    train_trl(run, tmp_path / "moe", progress=False)
    rows = read_jsonl(tmp_path / "moe" / "metrics.jsonl")[1:]
    assert [r["step"] for r in rows] == [1, 2] and len(seen) == 4  # 2 steps x 2 minibatches of one micro-batch
    for row, forwards in zip(rows, (seen[:2], seen[2:]), strict=True):
        assert all(math.isfinite(row[key]) for key in EXPERT_KEYS), row
        assert 0 < row["expert_load_entropy"] <= 1 and row["router_aux_loss"] > 0
        assert forwards[0].tokens > 0 and forwards[0].changed_frac == 0.0 and forwards[0].token_changed_frac == 0.0
        assert forwards[1].changed_frac > 0
        assert row["expert_changed_frac"] == merge_volatility(forwards).changed_frac
        assert row["routed_tokens"] == forwards[0].tokens + forwards[1].tokens


@pytest.mark.slow  # a TRL run: make test
def test_one_minibatch_behaviour_routing_is_the_loss_forwards_own(tmp_path, monkeypatch):
    """One optimizer step per rollout batch: TRL skips its old-policy pass (the behaviour log-probs are the loss
    forward's own, at the weights that sampled), so the behaviour routing is that forward's: volatility 0, while the
    load entropy and the aux loss are still measured."""
    seen = spied_volatility(monkeypatch)
    run = tiny_moe_run(tmp_path, "backend=trl", "device=cpu", "objective.params.entropy_coef=0.1", "train.lr=1e-2",
                       "train.num_minibatches=1", "train.steps=1")
    train_trl(run, tmp_path / "moe", progress=False)
    (row,) = read_jsonl(tmp_path / "moe" / "metrics.jsonl")[1:]
    assert len(seen) == 1 and seen[0].tokens > 0 and row["expert_changed_frac"] == 0.0
    assert math.isfinite(row["router_aux_loss"]) and math.isfinite(row["expert_load_entropy"])


@pytest.mark.slow  # a TRL run: make test
def test_dense_run_logs_no_expert_metrics(tmp_path):
    run = run_config(tmp_path, "train.num_minibatches=2")
    train_trl(run, tmp_path / "dense", progress=False)
    rows = read_jsonl(tmp_path / "dense" / "metrics.jsonl")
    assert len(rows) == 2 and "loss" in rows[1] and not any(key in row for row in rows for key in EXPERT_KEYS)


def test_loss_forward_measures_routing_as_the_native_update(tmp_path):
    """The same tiny_moe, rows and behaviour routing (the native recompute's record), routers moved after it: the TRL
    trainer's loss forward and the native loop's update forward (forward_rows) give the same volatility, load entropy
    and aux loss, although the native forward routes a group's shared prompt once and TRL's once per row (the aux
    loss counts every row's tokens, in grid order)."""
    cfg, run, batch, behaviour = moe_step(tmp_path, "none", "train.old_logp=recompute")
    assert behaviour.routing is not None
    perturb_routers(run.policy)
    rows = torch.arange(len(batch.rewards))
    native = forward_rows(run.policy, UpdatePlan.of(batch, cfg, 1), rows)
    assert native.volatility.changed_frac > 0
    ro = batch.rollout
    trainer = RegistryGRPOTrainer(
        model=run.policy, reward_funcs=reward_functions(run.task), args=grpo_config(cfg, tmp_path / "trl"),
        train_dataset=problems_dataset(run.train_problems[:8], run.tokenizer), processing_class=run.tokenizer,
        objective=run.objective, estimator=run.estimator)
    trainer.current_gradient_accumulation_steps = 1
    inputs = {"prompt_ids": ro.prompt_ids[rows], "prompt_mask": ro.prompt_mask[rows],
              "completion_ids": ro.completion_ids[rows], "completion_mask": ro.completion_mask[rows].long(),
              "advantages": batch.advantages[rows], "old_per_token_logps": batch.old_logp[rows],
              "num_items_in_batch": ro.completion_mask[rows].sum(), "rewards": batch.rewards[rows],
              "group_ids": batch.group_ids[rows], ROUTING_KEY: behaviour.routing.select(rows).indices.transpose(0, 1)}
    trainer._compute_loss(trainer.model, inputs)
    (volatility,) = trainer.volatility
    assert volatility == native.volatility
    logged = trainer.meter.result()
    for key in ("expert_load_entropy", "router_aux_loss"):
        assert logged[key] == pytest.approx(native.routing_metrics[key], rel=1e-6), key


@pytest.mark.slow
def test_moe_loss_with_activation_checkpointing_is_the_loss_without(tmp_path):
    """backend=trl, tiny_moe, train.activation_checkpointing: TRL's Trainer enables it with the harness's checkpoint
    arguments (grpo_config), so each layer's recompute in backward forces the routing its forward took, although
    the backward runs after the capture of the loss forward ended. Loss and gradients equal those without
    checkpointing bit for bit (TRL's loss forward has the same shapes either way)."""
    cfg, run, batch, behaviour = moe_step(tmp_path, "none", "train.old_logp=recompute")
    perturb_routers(run.policy)  # the behaviour routing is not the live one: the routing metrics see it
    ro = batch.rollout
    inputs = {"prompt_ids": ro.prompt_ids, "prompt_mask": ro.prompt_mask, "completion_ids": ro.completion_ids,
              "completion_mask": ro.completion_mask.long(), "advantages": batch.advantages,
              "old_per_token_logps": batch.old_logp, "num_items_in_batch": ro.completion_mask.sum(),
              "rewards": batch.rewards, "group_ids": batch.group_ids,
              ROUTING_KEY: behaviour.routing.indices.transpose(0, 1)}
    results = []
    for checkpointing in (False, True):
        args = grpo_config(OmegaConf.merge(cfg, {"train": {"activation_checkpointing": checkpointing}}),
                           tmp_path / f"trl-{checkpointing}")
        trainer = RegistryGRPOTrainer(
            model=run.policy, reward_funcs=reward_functions(run.task), args=args, objective=run.objective,
            train_dataset=problems_dataset(run.train_problems[:8], run.tokenizer), processing_class=run.tokenizer,
            estimator=run.estimator)
        if args.activation_checkpointing:  # as Trainer.train enables it
            trainer.model.activation_checkpointing_enable(dict(args.activation_checkpointing_kwargs))
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        results.append((*loss_and_grad(trainer, inputs), trainer.volatility, trainer.meter.result()))
    (plain_loss, plain_grads, plain_volatility, plain_logged), (loss, grads, volatility, logged) = results
    assert torch.equal(loss, plain_loss) and volatility == plain_volatility and logged == plain_logged
    assert plain_volatility[0].changed_frac > 0 and plain_grads.keys() == grads.keys()
    assert all(torch.equal(grads[name], grad) for name, grad in plain_grads.items())


def test_a_logged_step_counts_its_rollout_tokens_once_and_its_update_tokens_once_per_epoch():
    """TRL logs once per rollout step: the step's sampled tokens (mean length x prompts x group size) add to
    rollout_tokens, and every epoch trains on them again (update_tokens = rollout_tokens x train.epochs), as the native
    loop counts them."""
    from types import SimpleNamespace

    from harness.loop.metrics import PhaseMemory
    from harness.run.config import updates_per_step

    train = OmegaConf.create({"prompts_per_step": 4, "group_size": 2, "epochs": 3, "num_minibatches": 2, "steps": 5,
                              "eval_every": 0, "export_every": 0})
    rows, progress = [], {"rollout_tokens": 40, "update_tokens": 120}
    records = SimpleNamespace(progress=progress, log=lambda row, samples: rows.append(row))
    callback = trl_backend.RecordsCallback(OmegaConf.create({"train": train}), records, None, None)
    callback.trainer = SimpleNamespace(phase_s={"rollout": 0.5}, memory=PhaseMemory(torch.device("cpu")),
                                       accelerator=SimpleNamespace(device=torch.device("cpu")))
    state = SimpleNamespace(global_step=2 * updates_per_step(train))  # the second rollout step's optimizer steps
    callback.on_log(None, state, None, logs={"reward": 0.5, "completions/mean_length": 10.0})
    assert rows[0]["step"] == 2 and rows[0]["rollout_tokens"] == 40 + 10 * 4 * 2
    assert progress == {"rollout_tokens": 120, "update_tokens": 120 * 3}
