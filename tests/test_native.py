"""harness/loop/native.py, the shared loop end to end with a tiny model: sampling, log-probs, every objective,
determinism, resume, non-finite handling, train-inference mismatch, dynamic sampling, exports (the update's parts:
tests/test_update.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from harness.loop import batch as batch_module
from harness.loop.batch import collect_batch, rewards_of
from harness.loop.build import build_policy, build_task
from harness.loop.native import train
from harness.policy.forward import completion_logprobs
from harness.policy.models import build_prompt, load_model
from harness.policy.sampler import generate
from harness.run.config import load_experiment, run_configs
from harness.run.errors import ConfigError
from harness.run.records import read_jsonl
from harness.tasks import Arith, Score, get_task
from objectives import ADVANTAGES, ObjectiveOutput, available_advantages, available_objectives, get_objective
from objectives.advantages import needs_nonnegative_rewards
from tests.helpers.interrupt import stopped_before
from tests.helpers.tiny import TINY_SPEC, VARIED_REWARD, tiny_run, without_timing


@pytest.fixture(scope="module")
def tiny_policy():
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC, seed=0)
    task = get_task("arith")
    prompts = [build_prompt(tokenizer, p.question) for p in task.train_problems()[:6]]
    return model, tokenizer, prompts


@pytest.mark.parametrize("top_p, group_size", [(1.0, 1), (0.7, 1), (1.0, 3)])
def test_sampler_logprobs_equal_trainer_logprobs(tiny_policy, top_p, group_size):
    model, tokenizer, prompts = tiny_policy
    torch.manual_seed(0)
    ro = generate(model, tokenizer, prompts, group_size=group_size, max_new_tokens=12, temperature=0.9, top_p=top_p)
    assert ro.completion_ids.shape[0] == len(prompts) * group_size
    logp, _ = completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, 0.9)
    assert torch.allclose(logp.masked_fill(~ro.completion_mask, 0), ro.sampler_logp, atol=1e-5)
    assert (ro.sampler_logp[ro.completion_mask] < 0).all()


def test_shared_prompt_prefill_matches_repeated_prompts(tiny_policy):
    model, tokenizer, prompts = tiny_policy
    grouped = generate(model, tokenizer, prompts, group_size=3, max_new_tokens=10, greedy=True)
    repeated = generate(model, tokenizer, [p for p in prompts for _ in range(3)], max_new_tokens=10, greedy=True)
    assert torch.equal(grouped.completion_ids, repeated.completion_ids)
    assert torch.allclose(grouped.sampler_logp, repeated.sampler_logp, atol=1e-5)


def test_completion_mask_ends_at_first_eos(tiny_policy):
    model, tokenizer, prompts = tiny_policy
    torch.manual_seed(1)
    ro = generate(model, tokenizer, prompts, max_new_tokens=40, temperature=3.0)  # hot: EOS appears early
    eos = tokenizer.eos_token_id
    for ids, mask, truncated in zip(ro.completion_ids, ro.completion_mask, ro.truncated, strict=True):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()
        if truncated:
            assert n == ids.shape[0] and eos not in ids.tolist()
        else:
            assert ids[n - 1] == eos and eos not in ids[: n - 1].tolist()


@pytest.mark.parametrize("padding_free", [True, False])
def test_lm_head_sees_only_real_completion_positions(tiny_policy, padding_free):
    model, tokenizer, prompts = tiny_policy
    ro = generate(model, tokenizer, prompts, max_new_tokens=5, greedy=True)
    ro.completion_mask[0, 2:] = False  # a row that ended early: its padding gets no logits
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].shape))
    try:
        logp, _ = completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                      padding_free=padding_free)
    finally:
        hook.remove()
    assert seen == [torch.Size([int(ro.completion_mask.sum()), model.config.hidden_size])]
    assert (logp[~ro.completion_mask] == 0).all()


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("rows", [slice(0, 12), slice(2, 7)])  # whole groups; a micro-batch cutting two groups
def test_shared_prompt_pass_gives_per_row_logprobs_and_gradients(tiny_policy, rows, padding_free):
    model, tokenizer, prompts = tiny_policy
    torch.manual_seed(0)
    ro = generate(model, tokenizer, [prompts[0], "7*" + prompts[1], *prompts[2:4]], group_size=3, max_new_tokens=9,
                  temperature=1.5)
    assert ro.prompt_mask.sum(1).unique().numel() > 1  # prompts of different lengths: left padding is exercised
    ids, mask, comp, comp_mask = (x[rows] for x in (ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                                    ro.completion_mask))

    def logp_and_grads(per_row: bool):
        model.zero_grad()
        if per_row:
            logp = torch.cat([completion_logprobs(model, ids[i : i + 1], mask[i : i + 1], comp[i : i + 1],
                                                  comp_mask[i : i + 1], 0.9, padding_free=False)[0]
                              for i in range(len(ids))])
        else:
            logp = completion_logprobs(model, ids, mask, comp, comp_mask, 0.9, padding_free=padding_free)[0]
        (logp * comp_mask * torch.linspace(-1, 2, len(ids))[:, None]).sum().backward()
        return logp.detach()[comp_mask], [p.grad.clone() for p in model.parameters()]

    positions = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: positions.append(i[0].numel()))
    try:
        shared, shared_grads = logp_and_grads(per_row=False)
    finally:
        hook.remove()
    distinct = len({tuple(r.tolist()) for r in ids})
    tail = int(comp_mask.sum()) if padding_free else len(ids) * (comp.shape[1] + 1)
    assert positions == [distinct * (ids.shape[1] - 1), tail]  # the prompt ran once (padding-free: no padding)
    single, single_grads = logp_and_grads(per_row=True)
    assert torch.allclose(shared, single, atol=1e-5)
    for a, b in zip(shared_grads, single_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    model.zero_grad()


@pytest.mark.slow
@pytest.mark.parametrize("objective", available_objectives())
def test_every_objective_trains_through_the_loop(tmp_path, objective):
    # the overlong penalty makes rewards vary within groups, so every objective has a gradient to follow (POPO
    # learns from positives only: with rewards in [-1, 0], tau_r = -1.5 makes every completion one)
    popo = ["objective.params.tau_r=-1.5", "objective.params.predictor_hidden_dim=16"] if objective == "popo" else []
    run = tiny_run(tmp_path, f"objective.name={objective}", "task.overlong_buffer=6", *popo)
    summary = train(run, tmp_path / "run", progress=False)
    assert summary["status"] == "finished" and summary["steps_done"] == 2
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward_mean", "accuracy", "completion_len_mean", "frac_truncated", "frac_zero_std_groups",
                "adv_std", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_std", "ratio_max",
                "entropy", "grad_norm", "lr", "rollout_tok_s", "update_tok_s", "peak_mem_mb", "kl_behavior",
                "mismatch_logp_abs", "nonfinite_skips"):
        assert key in rows[1], key
    assert any(row["adv_std"] > 0 for row in rows[1:])
    for row in rows[1:]:
        assert (row["grad_norm"] > 0 or row["adv_std"] == 0) and row["nonfinite_skips"] == 0
        assert 0 <= row["clip_frac"] <= 1 and row["ratio_min"] <= row["ratio_mean"] <= row["ratio_max"]
        assert row["lr"] == run.train.lr and row["mismatch_logp_abs"] < 1e-4  # one model, one precision
        assert math.isfinite(row["loss"]) and row["entropy"] > 0
    assert rows[2]["rollout_tokens"] - rows[1]["rollout_tokens"] == round(  # (A*-PO's: and the reference's)
        rows[2]["completion_len_mean"] * run.train.prompts_per_step * run.train.group_size) + rows[2].get(
        "reference_tokens", 0)
    policy = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=False)["policy"]
    start, _ = load_model("tiny", tiny=TINY_SPEC, seed=0)
    assert any(not torch.equal(policy[k], v) for k, v in start.state_dict().items())  # the update moved it
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[2]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "finished"
    samples = read_jsonl(tmp_path / "run" / "eval_samples.jsonl")  # one record per eval problem and eval
    assert [(r["step"], r["problem"]) for r in samples] == [(s, i) for s in (0, 2) for i in range(8)]
    assert all(isinstance(r["completion"], str) and r["answer"] for r in samples)
    for step in (0, 2):
        assert np.mean([r["correct"] for r in samples if r["step"] == step]) == rows[step]["eval_accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("estimator", available_advantages())
def test_every_advantage_estimator_trains_through_the_loop(tmp_path, estimator, monkeypatch):
    """Each registered estimator gets what it needs from the loop (the completion lengths: REINFORCE++, OPO). The
    rewards vary within groups: by the overlong penalty (negative), or for an estimator that takes only rewards >= 0
    (MaxRL) by a format score of every third sample (the random tiny model is never correct)."""
    if needs_nonnegative_rewards(ADVANTAGES.get(estimator)):
        components = batch_module.reward_components

        def every_third_formatted(scores, lengths, cfg):
            parts, weights = components(scores, lengths, cfg)
            parts[:, 1] = (torch.arange(len(parts)) % 3 == 0).double()
            return parts, weights

        monkeypatch.setattr(batch_module, "reward_components", every_third_formatted)
        rewards = ["task.format_weight=0.5"]
    else:
        rewards = ["task.overlong_buffer=6"]
    run = tiny_run(tmp_path, "objective.name=grpo", f"objective.advantage={estimator}", *rewards)
    assert train(run, tmp_path / "run", progress=False)["steps_done"] == 2
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert any(row["adv_std"] > 0 for row in rows[1:]) and all(math.isfinite(row["loss"]) for row in rows[1:])


@pytest.mark.slow  # a whole run (or several): make test
@pytest.mark.parametrize("threads", [1, 2])
def test_same_config_and_seed_give_identical_metrics(tmp_path, threads):
    run = tiny_run(tmp_path, "objective.name=gspo", "train.epochs=2", f"threads={threads}")
    train(run, tmp_path / "a", progress=False)
    train(run, tmp_path / "b", progress=False)
    a, b = (without_timing(read_jsonl(tmp_path / d / "metrics.jsonl")) for d in "ab")
    assert a == b
    assert any(r.get("ratio_std", 0) > 0 for r in a)  # several minibatches move the ratios off 1


@pytest.mark.slow  # a whole run (or several): make test
def test_resume_from_checkpoint_continues_exactly(tmp_path):
    run = tiny_run(tmp_path, VARIED_REWARD, "train.steps=3")
    train(run, tmp_path / "full", progress=False)
    # a kill after step 2 of 3: the checkpoint of step 2, and a torn line at the end of the metrics file
    with stopped_before(3):
        train(run, tmp_path / "part", progress=False)
    with open(tmp_path / "part" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward_me')
    train(run, tmp_path / "part", progress=False)
    full = without_timing(read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    part = without_timing(read_jsonl(tmp_path / "part" / "metrics.jsonl"))
    assert [r["step"] for r in part] == [0, 1, 2, 3] and part == full
    # the first attempt's records (the eval at 0) are kept, the resumed step 3 appends its own, none repeats
    assert [r["step"] for r in read_jsonl(tmp_path / "part" / "eval_samples.jsonl")] == [0] * 8 + [3] * 8
    # the resumed step 3's update (its optimizer state restored, not restarted) gives the same final weights
    weights = [load_file(tmp_path / name / "final" / "model.safetensors") for name in ("full", "part")]
    assert full[3]["grad_norm"] > 0 and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.slow  # an end-to-end run in this process: make test
def test_nonfinite_updates_are_skipped_then_the_run_diverges_with_its_records(tmp_path, monkeypatch, capsys):
    real = get_objective("grpo")

    def nan_objective(batch):
        out = real(batch)
        return ObjectiveOutput(out.loss * float("nan"), out.metrics)

    monkeypatch.setattr("harness.loop.build.get_objective", lambda name, **kw: _Wrap(nan_objective, real))
    run = tiny_run(tmp_path, "train.steps=3", "train.max_nonfinite_in_row=3", "train.save_every=1")
    summary = train(run, tmp_path / "nan", progress=False)
    rows = read_jsonl(tmp_path / "nan" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 2 (the 4th skip in a row) is logged, then the run stops
    assert rows[1]["nonfinite_skips"] == 2 and rows[2]["nonfinite_skips"] == 4
    on_disk = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert on_disk == summary and summary["status"] == "diverged" and summary["error"] is None
    assert summary["steps_done"] == 2 and summary["start_eval_accuracy"] is not None
    assert summary["collapse"]["step"] == 1 and summary["collapse"]["cause"] == "non_finite_loss"
    assert summary["collapse"]["detail"]["key"] == "nonfinite_skips"  # the NaN loss itself is not logged
    assert not (tmp_path / "nan" / "final").exists()  # a diverged policy is not exported
    # no update was ever applied: the learning rate is not what the line blames
    assert "no update was applied yet, so the learning rate is not the cause" in capsys.readouterr().err
    # run again, it resumes from step 1's checkpoint (the diverging step saved none) and diverges the same way,
    # nothing written twice
    again = train(run, tmp_path / "nan", progress=False)
    assert without_timing(read_jsonl(tmp_path / "nan" / "metrics.jsonl")) == without_timing(rows)
    assert again["status"] == "diverged" and again["collapse"] == summary["collapse"]


class _Wrap:
    """``real`` with its loss replaced by ``fn``: every other attribute (hooks, state) is the real objective's."""

    def __init__(self, fn, real):
        self.fn, self.real = fn, real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __call__(self, batch):
        return self.fn(batch)


@pytest.mark.slow  # an end-to-end run in this process: make test
def test_bf16_sampler_mismatch_is_measured(tmp_path):
    run = tiny_run(tmp_path, "model.sampler_dtype=bfloat16", "train.steps=1")
    train(run, tmp_path / "mm", progress=False)
    step = read_jsonl(tmp_path / "mm" / "metrics.jsonl")[1]
    assert step["mismatch_logp_abs"] > 1e-4 and math.isfinite(step["mismatch_kl"])
    run = tiny_run(tmp_path, "train.old_logp=recompute", "train.steps=1")
    train(run, tmp_path / "same", progress=False)
    step = read_jsonl(tmp_path / "same" / "metrics.jsonl")[1]
    assert step["mismatch_logp_abs"] < 1e-5


@pytest.mark.slow  # a whole run (or several): make test
def test_kl_reference_is_loaded_and_logged_when_beta_positive(tmp_path):
    # the overlong penalty gives the random model's groups unequal rewards, so the first minibatch moves the policy
    # and the second one sees a positive KL to the (frozen) reference; without beta there is no reference at all
    run = tiny_run(tmp_path, "objective.params.beta=0.04", "train.steps=1", "task.overlong_buffer=6")
    train(run, tmp_path / "kl", progress=False)
    step = read_jsonl(tmp_path / "kl" / "metrics.jsonl")[1]
    assert step["adv_std"] > 0 and step["kl_ref"] > 1e-9
    train(tiny_run(tmp_path, "train.steps=1", "task.overlong_buffer=6"), tmp_path / "nokl", progress=False)
    assert "kl_ref" not in read_jsonl(tmp_path / "nokl" / "metrics.jsonl")[1]


@pytest.mark.slow
def test_embedded_smollm2_trains_one_gsm8k_step(tmp_path, gsm8k_dir, monkeypatch):
    monkeypatch.setenv("GSM8K_DIR", str(gsm8k_dir))
    (run,) = run_configs(load_experiment("gsm8k_ablation", [
        "objective.name=ctpo", "model.warm_start_steps=0", "task.eval_size=2", "train.prompts_per_step=2",
        "train.group_size=2", "train.max_new_tokens=24", "train.num_minibatches=2", "train.steps=1",
        f"results_dir={tmp_path}"]))
    summary = train(run, tmp_path / "smol", progress=False)
    step = read_jsonl(tmp_path / "smol" / "metrics.jsonl")[1]
    assert summary["status"] == "finished" and step["completion_len_mean"] > 0
    assert step["mismatch_logp_abs"] < 1e-3 and math.isfinite(step["grad_norm"])


def parity(completion: str) -> float:
    """A reward that varies within a group of a random model's completions: the parity of the first character."""
    return float(ord(completion[0]) % 2 == 0) if completion else 0.0


def dynamic_sampling_setup(tmp_path, monkeypatch, score):
    monkeypatch.setattr(Arith, "score", lambda self, completion, problem: score(completion))
    cfg = tiny_run(tmp_path, "train.dynamic_sampling=true", "train.group_size=2", "train.max_sampling_rounds=6")
    task = build_task(cfg)
    model, tokenizer, _ = build_policy(cfg, task, torch.device("cpu"))
    plain = collect_batch(model, tokenizer, task, task.train_problems(),
                         OmegaConf.merge(cfg, {"train": {"dynamic_sampling": False}}), step=1)
    return cfg, task, model, tokenizer, plain, collect_batch(model, tokenizer, task, task.train_problems(), cfg, 1)


def test_dynamic_sampling_refills_the_batch_with_informative_groups(tmp_path, monkeypatch):
    cfg, task, model, tokenizer, plain, (ro, rewards, stats, *_) = dynamic_sampling_setup(
        tmp_path, monkeypatch, lambda completion: Score(parity(completion), 0.0))  # varies within groups
    plain_rewards = plain[1].view(4, 2)
    assert torch.equal(plain[1], torch.tensor([parity(x) for x in plain[0].texts]))
    assert 0 < plain[2]["frac_zero_std_groups"] < 1 and stats["sampling_rounds"] > 1  # round 1 was not enough
    assert torch.equal(rewards, torch.tensor([parity(x) for x in ro.texts]))  # each row's own reward
    rewards = rewards.view(4, 2)
    assert (rewards[:, 0] != rewards[:, 1]).all() and stats["frac_zero_std_groups_trained"] == 0
    # round 1 is the plain step's sample: its informative groups open the batch, in order, unchanged
    kept = [g for g in range(4) if plain_rewards[g, 0] != plain_rewards[g, 1]]
    assert ro.texts[: 2 * len(kept)] == [plain[0].texts[2 * g + j] for g in kept for j in range(2)]
    # re-padded rows still carry their own sampler log-probs: the trainer's agree
    logp, _ = completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    assert torch.allclose(logp.masked_fill(~ro.completion_mask, 0), ro.sampler_logp, atol=1e-5)
    assert stats["sampled_tokens"] > plain[2]["sampled_tokens"] == int(plain[0].completion_mask.sum())


def test_dynamic_sampling_fills_with_dropped_groups_when_rounds_run_out(tmp_path, monkeypatch):
    cfg, task, model, tokenizer, plain, (ro, rewards, stats, *_) = dynamic_sampling_setup(
        tmp_path, monkeypatch, lambda completion: Score(0.0, 0.0))  # every group has equal rewards
    assert stats["sampling_rounds"] == 6 and stats["frac_zero_std_groups_trained"] == 1.0
    assert stats["frac_zero_std_groups"] == 1.0 and ro.texts == plain[0].texts  # round 1's groups, in order
    assert stats["sampled_tokens"] > plain[2]["sampled_tokens"]


@pytest.mark.slow  # an end-to-end run in this process: make test
def test_dynamic_sampling_through_the_loop_counts_every_sampled_token(tmp_path, monkeypatch):
    monkeypatch.setattr(Arith, "score", lambda self, completion, problem: Score(parity(completion), 0.0))
    train(tiny_run(tmp_path, "train.dynamic_sampling=true", "train.group_size=2"), tmp_path / "run", progress=False)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")[1:]
    assert all(r["frac_zero_std_groups_trained"] == 0 and r["adv_std"] > 0 for r in rows)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert any(r["sampling_rounds"] > 1 for r in rows)  # dropped groups were sampled, and their tokens count
    assert summary["rollout_tokens"] == rows[-1]["rollout_tokens"] > summary["update_tokens"]
    everything = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    for phase in ("rollout", "update", "eval"):  # the run's peak memory per phase: the largest of its steps'
        key = f"peak_mem_{phase}_mb"
        assert summary[key] == max(r[key] for r in everything if key in r) > 0


def test_overlong_penalty_matches_dapo_by_hand(tmp_path):
    cfg = tiny_run(tmp_path, "train.max_new_tokens=20", "task.overlong_buffer=4", "task.overlong_penalty=0.5",
                   "task.format_weight=0.1")
    scores = [Score(1.0, 1.0), Score(0.0, 1.0), Score(1.0, 0.0), Score(0.0, 0.0), Score(1.0, 1.0)]
    lengths = torch.tensor([3, 16, 17, 19, 20])  # penalty starts after 20 - 4 = 16 tokens, reaches 0.5 at 20
    expected = torch.tensor([1.1, 0.1, 1.0 - 0.125, 0.0 - 0.375, 1.1 - 0.5])
    assert torch.allclose(rewards_of(scores, lengths, cfg), expected)
    assert torch.allclose(rewards_of(scores, lengths, OmegaConf.merge(cfg, {"task": {"overlong_buffer": 0}})),
                          torch.tensor([1.1, 0.1, 1.0, 0.0, 1.1]))
    with pytest.raises(ConfigError, match="overlong_buffer"):
        tiny_run(tmp_path, "train.max_new_tokens=20", "task.overlong_buffer=21")


@pytest.mark.slow  # an end-to-end run in this process: make test
def test_a_finished_run_exports_a_policy_transformers_loads_with_the_same_logprobs(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train(tiny_run(tmp_path, "train.steps=1", "task.overlong_buffer=6"), tmp_path / "run", progress=False)
    trained, tokenizer = load_model("tiny", tiny=TINY_SPEC, seed=0)
    trained.load_state_dict(torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=False)["policy"])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").eval()
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    assert reloaded("What is 1+2?").input_ids == tokenizer("What is 1+2?").input_ids
    ro = generate(trained, tokenizer, [build_prompt(tokenizer, "What is 1+2?")], group_size=2, max_new_tokens=6)
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    with torch.no_grad():
        before, after = (completion_logprobs(model, *args)[0] for model in (trained, exported))
    assert torch.allclose(before, after, atol=1e-6)


def _lr_spy(monkeypatch, used: list):
    """Record the learning rate of every optimizer step the loop makes (as the optimizer reads it when it steps)."""
    from harness.loop import build as build_module

    build = build_module.build_optimizer

    def spied(params, t):
        optimizer = build(params, t)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
        return optimizer

    monkeypatch.setattr(build_module, "build_optimizer", spied)


@pytest.mark.slow  # a whole run (or several): make test
def test_every_optimizer_step_uses_its_warm_up_value_across_a_resume_and_none_is_skipped(tmp_path, monkeypatch):
    """Warm-up over 3 updates, 2 updates per step, 3 steps: the k-th update uses lr x min(1, (k + 1) / 4), also when
    the run is stopped after step 1 and resumed; torch never warns that a schedule value was skipped. A row's ``lr``
    is the schedule's value after the step's updates (the next update's), as transformers' Trainer logs it."""
    import warnings

    run = tiny_run(tmp_path, "train.warmup_steps=3", "train.steps=3", "train.lr=0.01")
    expected = [0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01]
    used: list[float] = []
    _lr_spy(monkeypatch, used)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(run, tmp_path / "full", progress=False)
        with stopped_before(2):
            train(run, tmp_path / "part", progress=False)
        train(run, tmp_path / "part", progress=False)
    # the stopped attempt made steps 1 and 2 (4 updates) before its stop at step 2's record; the resume redoes
    # step 2 from step 1's checkpoint, with the schedule's state of then
    assert used[:6] == pytest.approx(expected) and used[6:] == pytest.approx(expected[:4] + expected[2:])
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    for folder in ("full", "part"):
        assert [r["lr"] for r in read_jsonl(tmp_path / folder / "metrics.jsonl")[1:]] == \
            pytest.approx([0.0075, 0.01, 0.01])




@pytest.mark.slow  # an end-to-end run in this process: make test
def test_a_run_does_not_depend_on_random_numbers_drawn_while_its_model_loads(tmp_path, monkeypatch):
    """Building the embedded model's cache in the run's own process draws from torch's generator; every stage that
    samples seeds itself (per step), so the run's metrics are the same."""
    import harness.loop.native

    rows, real = [], harness.loop.native.setup_run
    for draws in (0, 5):
        monkeypatch.setattr(harness.loop.native, "setup_run", lambda *a, draws=draws: (torch.rand(draws), real(*a))[1])
        train(tiny_run(tmp_path, "train.eval_every=1"), tmp_path / f"d{draws}", progress=False)
        rows.append(without_timing(read_jsonl(tmp_path / f"d{draws}" / "metrics.jsonl")))
    assert rows[0] == rows[1]
