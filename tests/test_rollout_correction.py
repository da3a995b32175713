"""Rollout correction (``train.rollout_correction``, objectives/rollout_correction.py) for every objective:

- the weights of every mode equal a hand computation (scalars with ``math``; a tiny model against its bf16 copy);
- with no sampler difference (an fp32 sampler) every weight is exactly 1, and the loss and gradient of every
  objective, and a whole run, are bit-identical to no correction;
- every objective honours ``PolicyBatch.correction`` through the shared aggregation (no per-objective code): a
  constant weight scales the policy loss, a zero weight removes a sequence's gradient, micro-batches still sum
  to the minibatch; the KL to the reference is not weighted;
- config errors, run ids, the loop's metrics, and the TRL backend (TRL 1.16's own vllm_importance_sampling_*
  formula, the mapping, the loss).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

import objectives
from harness.loop.batch import TrainBatch
from harness.loop.behaviour import rollout_correction
from harness.loop.build import frozen_copy
from harness.loop.native import train, update
from harness.loop.update import Learner, RunState, UpdatePlan
from harness.policy.forward import completion_logprobs
from harness.policy.models import build_prompt, load_model
from harness.policy.sampler import generate
from harness.run.config import load_experiment, run_configs, run_id
from harness.run.errors import ConfigError
from harness.run.offpolicy import behaviour_logp
from harness.run.records import read_jsonl
from harness.tasks import get_task
from objectives import PolicyBatch, get_objective
from objectives.base import sum_statistics
from objectives.rollout_correction import CORRECTION_MODES, correction_metrics, correction_weights
from tests.helpers.objectives import DT, ON_BATCHES, group_batch, minibatch_counts, num
from tests.helpers.tiny import TINY_SPEC, tiny_run, without_timing
from tests.helpers.trl import (  # the ``fixed`` batch itself: tests/conftest.py's fixture
    GradCapture,
    NoSchedule,
    assert_same,
    loss_and_grad,
    make_trainer,
    run_config,
    trl_inputs,
)

ALL = ON_BATCHES
MODES = [m for m in CORRECTION_MODES if m not in ("none", "decoupled_ppo")]  # decoupled_ppo: tests/test_async.py


# ----------------------------------------------------------------------------------------------------
# The weights, by hand
# ----------------------------------------------------------------------------------------------------

# two sequences (lengths 3 and 2); d = old - sampler per token, garbage on the padding slot
OLD = [[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]]
DIFF = [[0.9, -0.8, 0.1], [0.05, 0.02, 9.0]]
MASK = [[1, 1, 1], [1, 1, 0]]


def hand_weights(diff, mask, mode, c, low=None):
    """The module docstring's formula on python floats."""
    out = []
    for d, m in zip(diff, mask, strict=True):
        valid = [x for x, v in zip(d, m, strict=True) if v]
        rhos = [math.exp(x) for x in valid] if mode.startswith("token") else [math.exp(sum(valid))] * len(valid)
        if low is None and mode.endswith("_mask"):
            low = 1 / c
        if mode.endswith("_truncate"):
            w = [min(r, c) if low is None else min(max(r, low), c) for r in rhos]
        else:
            w = [r if low <= r <= c else 0.0 for r in rhos]
        out.append(w + [0.0] * (len(d) - len(w)))
    return out


@pytest.mark.parametrize("mode, c, low", [
    ("token_truncate", 2.0, None), ("token_truncate", 1.5, 0.5), ("token_mask", 2.0, None), ("token_mask", 2.0, 0.0),
    ("sequence_truncate", 1.1, None), ("sequence_mask", 1.1, None), ("sequence_mask", 1.25, 0.0),
])
def test_weights_equal_the_hand_computation(mode, c, low):
    old = torch.tensor(OLD, dtype=DT)
    sampler = old - torch.tensor(DIFF, dtype=DT)
    mask = torch.tensor(MASK).bool()
    w = correction_weights(old, sampler, mask, mode, c, low)
    expected = torch.tensor(hand_weights(DIFF, MASK, mode, c, low), dtype=DT)
    assert torch.allclose(w, expected, rtol=1e-14, atol=0), (w, expected)
    assert not w.requires_grad
    # the cases: token ratios e^.9 = 2.46, e^-.8 = .449, e^.1, e^.05, e^.02; sequence products e^.2, e^.07
    m = correction_metrics(old, sampler, mask, mode, c, low, weights=w)
    if mode == "token_truncate":
        assert num(m["rollout_corr_truncated_frac"], (1 + (low is not None)) / 5)  # e^.9 (and e^-.8 below .5)
    elif mode == "token_mask":
        assert num(m["rollout_corr_masked_frac"], (1 + (low is None)) / 5)  # e^.9 (and e^-.8 below 1/2)
    elif mode == "sequence_truncate":
        assert num(m["rollout_corr_truncated_frac"], 3 / 5)  # e^.2 > 1.1: the 3 tokens of sequence 0
    else:
        assert num(m["rollout_corr_masked_frac"], 3 / 5 if c == 1.1 else 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", CORRECTION_MODES[1:])
def test_a_lower_bound_of_0_is_the_run_without_one_where_unset_means_none(mode):
    """threshold_lower 0 bounds nothing where unset means no lower bound (the truncate modes, decoupled_ppo): the
    same weights and metrics, so one run id, and a grid over [0, null] is refused as the same run (it made two run
    ids, two cells of one computation); in the mask modes, whose unset bound is 1/C, 0 is another run. A token's
    ratio and a sequence's product reach e^-40, below any positive bound."""
    old = torch.tensor([*OLD, [-1.0, -1.0, -1.0]], dtype=DT)
    sampler = old - torch.tensor([*DIFF, [-40.0, 0.3, 0.5]], dtype=DT)
    mask = torch.tensor([*MASK, [1, 1, 1]]).bool()
    same = mode != "token_mask" and mode != "sequence_mask"
    pairs = [f(old, sampler, mask, mode, 2.0, low) for low in (None, 0.0) for f in (correction_weights,
                                                                                     correction_metrics)]
    assert torch.equal(pairs[0], pairs[2]) == same and (pairs[1] == pairs[3]) == same
    fixed = ["objective.name=grpo", f"train.rollout_correction.mode={mode}"]
    runs = [run_configs(load_experiment("base", [*fixed, *low]))[0] for low in (
        [], ["train.rollout_correction.threshold_lower=0"], ["train.rollout_correction.threshold_lower=0.0"])]
    assert (len({run_id(run) for run in runs}) == 1) == same
    grid = [*fixed, "sweep.grid.train.rollout_correction.threshold_lower=[0,null]"]
    if same:
        with pytest.raises(ConfigError, match=rf"threshold_lower: .* make the same run \(threshold_lower 0 bounds "
                                              rf"nothing at train.rollout_correction.mode={mode}"):
            run_configs(load_experiment("base", grid))
    else:
        assert len(run_configs(load_experiment("base", grid))) == 2


def test_metrics_by_hand():
    old = torch.tensor(OLD, dtype=DT)
    sampler = old - torch.tensor(DIFF, dtype=DT)
    mask = torch.tensor(MASK).bool()
    d = [0.9, -0.8, 0.1, 0.05, 0.02]
    m = correction_metrics(old, sampler, mask, "token_truncate", 2.0)
    assert num(m["rollout_corr_chi2_token"], sum(math.exp(2 * x) for x in d) / 5 - 1)
    assert num(m["rollout_corr_chi2_seq"], (math.exp(2 * 0.2) + math.exp(2 * 0.07)) / 2 - 1)
    assert num(m["rollout_corr_k3_kl"], sum(math.exp(x) - x - 1 for x in d) / 5)
    assert num(m["rollout_corr_ratio_max"], math.exp(0.9)) and num(m["rollout_corr_ratio_min"], math.exp(-0.8))
    assert num(m["rollout_corr_ratio_mean"], sum(math.exp(x) for x in d) / 5)
    assert num(m["rollout_corr_weight_mean"], (2.0 + sum(math.exp(x) for x in d[1:])) / 5)
    seq = correction_metrics(old, sampler, mask, "sequence_mask", 1.1)
    assert num(seq["rollout_corr_ratio_max"], math.exp(0.2)) and num(seq["rollout_corr_ratio_min"], math.exp(0.07))
    assert num(seq["rollout_corr_weight_mean"], 2 * math.exp(0.07) / 5)


def test_sequence_products_that_overflow_are_truncated_or_masked():
    old = torch.zeros(2, 200)
    sampler = torch.full((2, 200), -0.5)  # prod rho = e^100 = inf in float32
    mask = torch.ones(2, 200, dtype=torch.bool)
    assert (correction_weights(old, sampler, mask, "sequence_truncate", 3.0) == 3.0).all()
    assert (correction_weights(old, sampler, mask, "sequence_mask", 3.0) == 0.0).all()
    m = correction_metrics(old, sampler, mask, "sequence_mask", 3.0)
    assert all(math.isfinite(v) for v in m.values()) and m["rollout_corr_masked_frac"] == 1.0


@pytest.fixture(scope="module")
def bf16_logprobs():
    """A tiny model's completions: the fp32 trainer's log-probs and its bf16 copy's (the sampler's)."""
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC, seed=0)
    task = get_task("arith", eval_size=8)
    prompts = [build_prompt(tokenizer, p.question) for p in task.train_problems()[:4]]
    sampler = frozen_copy(model, torch.bfloat16)
    ro = generate(sampler, tokenizer, prompts, group_size=2, max_new_tokens=8, temperature=1.0)
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    with torch.no_grad():
        old = completion_logprobs(model, *args)[0]
        bf16 = completion_logprobs(sampler, *args)[0].float()
    assert (old - bf16)[ro.completion_mask].abs().max() > 1e-4  # a real mismatch
    return old, bf16, ro.completion_mask


@pytest.mark.parametrize("mode", MODES)
def test_bf16_sampler_weights_equal_the_hand_computation(bf16_logprobs, mode):
    old, bf16, mask = bf16_logprobs
    diff = (old - bf16).masked_fill(~mask, 0.0).tolist()
    level = [[math.exp(x) for x in row] for row in diff] if mode.startswith("token") else \
        [[math.exp(sum(row))] for row in diff]
    deviation = max(abs(r - 1) for row in level for r in row)
    c = 1 + deviation / 2  # some ratios inside, some past the threshold
    w = correction_weights(old, bf16, mask, mode, c)
    expected = torch.tensor(hand_weights(diff, mask.tolist(), mode, c))
    assert torch.allclose(w, expected, rtol=1e-5, atol=1e-7)
    changed = (w != expected.clamp(max=c)) | (w == 0) | (w == c)
    assert (changed & mask).any() and (~changed & mask).any()  # both branches exercised
    assert (w[~mask] == 0).all()


# ----------------------------------------------------------------------------------------------------
# No sampler difference: weights exactly 1, everything bit-identical
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_no_sampler_difference_gives_weights_exactly_one(bf16_logprobs, mode):
    old, _, mask = bf16_logprobs
    assert torch.equal(correction_weights(old, old, mask, mode, 2.0), mask.float())
    t = OmegaConf.create({"old_logp": "sampler", "rollout_correction": {"mode": mode, "threshold": 2.0,
                                                                       "threshold_lower": None}})
    weights, metrics = rollout_correction(t, old, None, mask)  # the loop's call with no separate sampler
    if mode == "none":
        assert weights is None and metrics == {} and behaviour_logp(t) == "sampler"
        return
    assert behaviour_logp(t) == "recompute" and torch.equal(weights, mask.float())
    assert metrics["rollout_corr_chi2_token"] == 0.0 and metrics["rollout_corr_k3_kl"] == 0.0
    assert metrics["rollout_corr_ratio_min"] == metrics["rollout_corr_ratio_max"] == 1.0


def run_objective(name, batch, **hp):
    out = get_objective(name, **hp)(batch)
    (grad,) = torch.autograd.grad(out.loss, batch.logp, allow_unused=True)
    return out, torch.zeros_like(batch.logp) if grad is None else grad


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("name", ALL)
def test_weights_of_one_leave_every_objective_bit_identical(name, beta):
    for mode in objectives.OBJECTIVES.get(name).aggregations:
        plain = group_batch()
        ones = group_batch()
        ones.correction = correction_weights(ones.old_logp, ones.old_logp, ones.mask, "token_truncate", 2.0)
        (a, ga), (b, gb) = (run_objective(name, x, beta=beta, aggregation=mode) for x in (plain, ones))
        assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb), (name, mode)
        assert a.metrics == b.metrics


# ----------------------------------------------------------------------------------------------------
# Every objective honours the weight, through the shared aggregation
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_a_constant_weight_scales_the_policy_loss_not_the_kl(name):
    for mode in objectives.OBJECTIVES.get(name).aggregations:
        base = group_batch()
        (pg, gpg), (full, gfull) = (run_objective(name, base, beta=b, aggregation=mode) for b in (0.0, 0.04))
        half = group_batch()
        half.correction = torch.full_like(half.logp, 0.5)
        out, grad = run_objective(name, half, beta=0.04, aggregation=mode)
        assert num(out.loss, 0.5 * pg.loss + (full.loss - pg.loss), 1e-12), (name, mode)
        assert torch.allclose(grad, 0.5 * gpg + (gfull - gpg), rtol=1e-12, atol=1e-15), (name, mode)


@pytest.mark.parametrize("name", ALL)
def test_a_masked_sequence_gets_no_gradient(name):
    batch = group_batch()
    weights = torch.ones_like(batch.logp)
    weights[[1, 6]] = 0.0  # sequence_mask dropped sequences 1 and 6
    batch.correction = weights
    # tbpo's default band (clip 3e-4 / 4e-4 on both sides for A < 0) clips every row of this batch: widen it
    # beta = 0: the KL to the reference is not weighted (adaptive_kl's default has one)
    _, grad = run_objective(name, batch, beta=0.0, **({"clip_low": 0.5, "clip_high": 0.5} if name == "tbpo" else {}))
    if name == "conspo":  # group-contrastive: a dropped positive's term is 0, but a dropped negative still
        positives = batch.advantages > 0  # shapes the kept positives' terms (it is no term of its own)
        assert (grad[[i for i in (1, 6) if positives[i]]] == 0).all()
    else:
        assert (grad[[1, 6]] == 0).all() and (grad[[0, 2]] != 0).any()


def correction_of(batch, seed, sequence):
    g = torch.Generator().manual_seed(seed)
    shape = (batch.logp.shape[0], 1) if sequence else batch.logp.shape
    w = torch.rand(shape, generator=g, dtype=DT) * 2
    w[w > 1.6] = 0.0  # masked
    return w.expand_as(batch.logp).clone()


@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("name", ALL)
def test_micro_batches_sum_to_the_minibatch_with_a_correction(name, sequence):
    if objectives.OBJECTIVES.get(name).needs_whole_minibatch:
        return  # the loop never micro-batches it (clip_cov, kl_cov, m2po: a sort / draw over the whole minibatch)
    for mode in objectives.OBJECTIVES.get(name).aggregations:
        whole = group_batch()
        whole.correction = correction_of(whole, 3, sequence)
        out, grad = run_objective(name, whole, beta=0.04, aggregation=mode)
        objective = get_objective(name, beta=0.04, aggregation=mode)
        splits = (slice(0, 4), slice(4, 8)) if objective.needs_whole_groups else (slice(0, 3), slice(3, 8))
        parts = [PolicyBatch(
            logp=whole.logp[r], old_logp=whole.old_logp[r], mask=whole.mask[r], ref_logp=whole.ref_logp[r],
            advantages=whole.advantages[r], rewards=whole.rewards[r], group_ids=whole.group_ids[r],
            step=whole.step, total_steps=whole.total_steps, max_completion_len=whole.max_completion_len,
            **minibatch_counts(whole, r), correction=whole.correction[r], entropy=whole.entropy[r]) for r in splits]
        stats = sum_statistics([objective.minibatch_statistics(p) for p in parts])
        total = 0.0
        for part in parts:
            part.minibatch_stats = stats
            total = total + objective(part).loss
        assert num(total, out.loss, 1e-12), (name, mode)
        (micro_grad,) = torch.autograd.grad(total, whole.logp)
        assert torch.allclose(micro_grad, grad, rtol=1e-10, atol=1e-13), (name, mode)


def test_the_loop_says_when_its_correction_weighs_the_sampler():
    """The loop passes the sampler's log-probs whenever the old log-probs are recomputed (M2PO's mask and OPSM read
    them), and ``behaviour_corrected`` with a correction, so that TBPO's own mismatch weight is off: the sampler
    difference is corrected once."""
    policy, tokenizer = load_model("tiny", tiny=TINY_SPEC, seed=0)
    seen = []

    class Spy(objectives.Objective):  # a test double subclasses Objective
        def __call__(self, batch):
            seen.append((batch.sampler_logp is not None, batch.correction is not None, batch.behaviour_corrected))
            return objectives.ObjectiveOutput((batch.logp * 0).sum(), {})

    task = get_task("arith", eval_size=8)
    ro = generate(policy, tokenizer, [build_prompt(tokenizer, p.question) for p in task.train_problems()[:2]],
                  group_size=2, max_new_tokens=4, temperature=1.0)
    n = len(ro.texts)
    for mode in ("none", "token_truncate"):
        (run,) = run_configs(load_experiment("base", [
            *(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items()), "train.prompts_per_step=2", "train.group_size=2",
            "train.num_minibatches=1", "train.old_logp=recompute", f"train.rollout_correction.mode={mode}"]))
        weights, _ = rollout_correction(run.train, ro.sampler_logp, ro.sampler_logp - 0.01, ro.completion_mask)
        batch = TrainBatch(ro, torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.long), ro.sampler_logp,
                           None, weights)
        opt = torch.optim.SGD(policy.parameters(), lr=0.0)
        update(Learner(policy, Spy(), opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)),
               UpdatePlan.of(batch, run, 1), RunState(total_optimizer_steps=1))
    assert seen == [(True, False, False), (True, True, True)]


# ----------------------------------------------------------------------------------------------------
# Config, run ids
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("train.rollout_correction.mode=token", "train.rollout_correction.mode must be one of none, token_truncate"),
    ("train.rollout_correction.threshold=0.9", "threshold must be a finite number >= 1"),
    ("train.rollout_correction.threshold=inf", "train.rollout_correction.threshold is inf: give a finite number"),
    ("train.rollout_correction.threshold_lower=1.5", "threshold_lower must be in \\[0, 1\\]"),
    ("train.rollout_correction.threshold_lower=-1", "threshold_lower must be in \\[0, 1\\]"),
    ("train.rollout_correction.mode=token_mask train.rollout_correction.threshold=1", "empty or a single point"),
])
def test_bad_settings_are_one_line_config_errors(override, message):
    with pytest.raises(ConfigError, match=message) as error:
        run_configs(load_experiment("quickstart", [*override.split(), "seed=0", "objective.name=grpo"]))
    assert "\n" not in str(error.value)


def test_a_correction_without_a_sampler_difference_is_allowed_and_defaults_keep_run_ids():
    (run,) = run_configs(load_experiment("quickstart", ["seed=0", "objective.name=grpo",
                                                        "train.rollout_correction.mode=sequence_mask"]))
    assert run.model.sampler_dtype is None
    (default,) = run_configs(load_experiment("quickstart", ["seed=0", "objective.name=grpo"]))
    bare = OmegaConf.to_container(default)
    del bare["train"]["rollout_correction"]  # a config written before the setting existed
    assert run_id(default) == run_id(OmegaConf.create(bare)) != run_id(run)


@pytest.mark.slow  # a whole run (or several): make test
def test_mismatch_stability_runs_every_correction_mode_and_the_new_objectives():
    runs = run_configs(load_experiment("mismatch_stability"))
    modes = {r.train.rollout_correction.mode for r in runs}
    names = {r.objective.name for r in runs}
    assert {"none", "token_truncate", "sequence_mask"} <= modes and {"p3o", "tbpo"} <= names
    assert all(r.model.sampler_dtype == "bfloat16" for r in runs)
    tbpo = [r for r in runs if r.objective.name == "tbpo"]
    assert all(r.train.old_logp == "recompute" for r in tbpo)  # its own trust band in the `none` arm


# ----------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------

def final_policy(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["policy"]


@pytest.mark.slow  # an end-to-end run in this process: make test
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_fp32_sampler_run_is_bit_identical_to_no_correction(tmp_path, mode):
    corrected = tiny_run(tmp_path, f"train.rollout_correction.mode={mode}", "train.steps=1",
                         "task.overlong_buffer=6", "objective.name=gspo")
    plain = tiny_run(tmp_path, "train.old_logp=recompute", "train.steps=1", "task.overlong_buffer=6",
                     "objective.name=gspo")
    train(corrected, tmp_path / "c", progress=False)
    train(plain, tmp_path / "p", progress=False)
    a, b = final_policy(tmp_path / "c"), final_policy(tmp_path / "p")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_c, rows_p = (without_timing(read_jsonl(tmp_path / d / "metrics.jsonl")) for d in "cp")
    assert rows_c[1]["rollout_corr_weight_mean"] == 1.0 and rows_c[1]["rollout_corr_chi2_token"] == 0.0
    assert rows_p[1]["grad_norm"] > 0
    assert [{k: v for k, v in r.items() if not k.startswith("rollout_corr")} for r in rows_c] == rows_p


@pytest.mark.slow  # an end-to-end run in this process: make test
@pytest.mark.parametrize("objective", ["dapo", "gspo"])
def test_micro_batches_give_the_minibatch_update_with_a_correction(tmp_path, objective):
    finals = []
    for micro in (0, 2):
        run = tiny_run(tmp_path, f"train.micro_batch_size={micro}", "train.steps=1", f"objective.name={objective}",
                       "model.sampler_dtype=bfloat16", "train.rollout_correction.mode=token_truncate",
                       "train.rollout_correction.threshold=1.001", "task.overlong_buffer=6")
        train(run, tmp_path / f"m{micro}", progress=False)
        finals.append(final_policy(tmp_path / f"m{micro}"))
        row = read_jsonl(tmp_path / f"m{micro}" / "metrics.jsonl")[1]
        assert 0 < row["rollout_corr_truncated_frac"] < 1  # the tight threshold truncates some tokens
    # AdamW's first steps move a weight by ~lr * sign(g): where |g| is near its eps, summation-order round-off of
    # the micro-batch sums is amplified (up to ~1.5e-6 seen): the bound is 1e-5 (1% of lr = 1e-3), not float epsilon
    for key in finals[0]:
        assert torch.allclose(finals[0][key], finals[1][key], atol=1e-5), key


@pytest.mark.slow
def test_bf16_sampler_run_with_token_truncate_logs_the_metrics(tmp_path):
    run = tiny_run(tmp_path, "model.sampler_dtype=bfloat16", "train.rollout_correction.mode=token_truncate",
                   "task.overlong_buffer=6")
    summary = train(run, tmp_path / "run", progress=False)
    assert summary["status"] == "finished"
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    for row in rows[1:]:
        for key in ("rollout_corr_truncated_frac", "rollout_corr_chi2_token", "rollout_corr_chi2_seq",
                    "rollout_corr_k3_kl", "rollout_corr_ratio_mean", "rollout_corr_ratio_min",
                    "rollout_corr_ratio_max", "rollout_corr_weight_mean", "mismatch_logp_abs"):
            assert math.isfinite(row[key]), key
        assert row["rollout_corr_k3_kl"] > 0 and row["rollout_corr_chi2_token"] != 0  # the bf16 mismatch
        assert row["rollout_corr_ratio_min"] < 1 < row["rollout_corr_ratio_max"]
        assert row["mismatch_logp_abs"] > 1e-4  # recomputed behaviour log-probs vs the bf16 sampler's
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").train.rollout_correction.mode == "token_truncate"


# ----------------------------------------------------------------------------------------------------
# The TRL backend
# ----------------------------------------------------------------------------------------------------

def trl_reference_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions' vLLM importance-sampling ratio, re-derived step by
    step (``vllm_importance_sampling_correction=True``)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("threshold_lower", [None, 0.0, 0.8])
@pytest.mark.parametrize("mode", MODES)
def test_trl_options_compute_exactly_our_weights(tmp_path, bf16_logprobs, mode, threshold_lower):
    from harness.loop.trl_backend import grpo_config

    c = 1.0005 if mode.startswith("token") else 1.002  # bites into the tiny model's bf16 mismatch
    overrides = [*(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items()), "train.prompts_per_step=4",
                 "train.group_size=4", "backend=trl", "device=cpu", f"train.rollout_correction.mode={mode}",
                 f"train.rollout_correction.threshold={c}"]
    if threshold_lower is not None:
        overrides.append(f"train.rollout_correction.threshold_lower={threshold_lower}")
    (run,) = run_configs(load_experiment("base", overrides))
    args = grpo_config(run, tmp_path)
    assert args.vllm_importance_sampling_correction and args.vllm_importance_sampling_mode == mode
    assert args.vllm_importance_sampling_clip_max == c
    old, bf16, mask = bf16_logprobs
    sampling = bf16.clone()
    sampling[0, 0] = float("nan")  # a token vLLM could not score: no correction
    ours = correction_weights(old, torch.where(torch.isnan(sampling), old, sampling), mask, mode, c,
                              threshold_lower)
    theirs = trl_reference_ratio(old, sampling, mask.long(), mode, args.vllm_importance_sampling_clip_min,
                                 args.vllm_importance_sampling_clip_max)
    assert torch.equal(ours, theirs.expand_as(old).masked_fill(~mask, 0.0))
    assert ((ours[mask] == 0) | (ours[mask] == c)).any()  # the threshold bites


def test_trl_mode_none_keeps_trl_correction_off_and_own_options_are_refused(tmp_path, monkeypatch):
    from harness.loop.trl_backend import grpo_config

    base = [*(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items()), "train.prompts_per_step=4",
            "train.group_size=4", "backend=trl", "device=cpu"]
    (run,) = run_configs(load_experiment("base", base))
    assert not grpo_config(run, tmp_path).vllm_importance_sampling_correction
    monkeypatch.setenv("RLVR_TRL_ARGS", '{"vllm_importance_sampling_mode": "token_mask"}')
    with pytest.raises(ConfigError, match="train.rollout_correction .*not RLVR_TRL_ARGS"):
        run_configs(load_experiment("base", base))


@pytest.mark.parametrize("objective, mode", [("grpo", "token_truncate"), ("gspo", "sequence_mask"),
                                             ("p3o", "token_mask")])
def test_trl_backend_applies_the_correction_as_the_native_loop(fixed, tmp_path, objective, mode):  # noqa: F811
    model, _, _, _, ro, old_logp, ref_logp, rewards, group_ids, advantages = fixed
    run = run_config(tmp_path, f"objective.name={objective}", f"train.rollout_correction.mode={mode}",
                     "train.rollout_correction.threshold=1.3")
    sampling = old_logp - 0.15 * torch.randn(old_logp.shape, generator=torch.Generator().manual_seed(4))
    out = {**trl_inputs(fixed), "sampling_per_token_logps": sampling}
    out.pop("ref_per_token_logps")
    trainer = make_trainer(fixed, run, tmp_path)
    trainer.train_cfg, trainer.correction_on = run.train, True
    trainer.old_logp = behaviour_logp(run.train)
    trainer.add_rollout_correction(out)  # no TRL ratio in the batch: ours (the TRL formula is tested above)
    weights = out["rollout_correction"]
    assert torch.equal(weights, correction_weights(old_logp, sampling, ro.completion_mask, mode, 1.3))
    assert 0 < trainer.meter.result()["rollout_corr_" + ("truncated" if "trunc" in mode else "masked") + "_frac"] < 1
    out["importance_sampling_ratio"] = trl_reference_ratio(old_logp, sampling, ro.completion_mask.long(), mode,
                                                           None if "trunc" in mode else 1 / 1.3, 1.3)
    trainer.add_rollout_correction(out)  # TRL's ratio (vLLM with the mapped options): the same weights
    assert torch.equal(out["rollout_correction"].masked_fill(~ro.completion_mask, 0.0), weights)

    policy = copy.deepcopy(model)
    capture = GradCapture(policy)
    batch = TrainBatch(ro, rewards, advantages, group_ids, old_logp, None, weights)
    native = update(Learner(policy, get_objective(objective), capture, NoSchedule()), UpdatePlan.of(batch, run, 1),
                    RunState(total_optimizer_steps=1))
    loss, grads = loss_and_grad(trainer, out)
    assert_same(native["loss"], capture.grads, loss, grads)
    plain = copy.deepcopy(policy)
    capture_plain = GradCapture(plain)
    update(Learner(plain, get_objective(objective), capture_plain, NoSchedule()), UpdatePlan.of(TrainBatch(
        ro, rewards, advantages, group_ids, old_logp), run, 1), RunState(total_optimizer_steps=1))
    assert any(not torch.allclose(capture_plain.grads[k], capture.grads[k]) for k in grads)  # it changed something

