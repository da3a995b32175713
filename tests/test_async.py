"""Asynchronous RL: the three log-probs wired as AReaL and verl wire them, decoupled PPO, the lag pipeline's schedule,
in-flight updates, the checkpointed queue, and lagged runs end to end (docs/async.md).

References transcribed here (tensors float64):
- AReaL (inclusionAI/AReaL 4aef98d8d818af55b43621aaadba047ae10f4e77): ``areal/trainer/ppo/actor.py``
  ``grpo_loss_fn`` -> ``_apply_m2po_masking`` / ``_get_m2po_loss_mask`` (the M2PO mask on ``delta = old_logp -
  prox_logp``, behaviour vs proximal) and ``areal/utils/functional/functional.py`` ``ppo_actor_loss_fn`` with
  ``apply_rejection_sampling`` (decoupled PPO: ratio and clip against the proximal policy, the loss times the
  behaviour weight pi_prox / pi_behave, masked by the rejection sampling's bounds; token or sequence level, the
  sequence level's weight the geometric mean; the denominator the valid tokens before rejection).
- verl (verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9) ``verl/trainer/ppo/rollout_corr_helper.py``
  ``compute_rollout_correction_weights`` (token-level truncated IS: min(pi_old / pi_rollout, C), where
  ``old_log_prob`` is the proximal policy recomputed in its decoupled mode) and ``core_algos.py``
  ``compute_policy_loss_vanilla`` (the weight multiplies the clipped per-token loss).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from harness.loop import pipeline as pipeline_module
from harness.loop.batch import Collected, TrainBatch
from harness.loop.metrics import MismatchMeter
from harness.loop.pipeline import Pipeline, lag_metrics
from harness.loop.trl_limits import trl_unsupported
from harness.loop.update import Minibatch, RowsForward, RunState, UpdatePlan, policy_batch
from harness.policy.routing import RoutingRecord
from harness.policy.sampler import Rollout, rollout_of
from harness.run.errors import ConfigError
from harness.tasks import Score
from objectives import ADVANTAGES, get_objective
from objectives.rollout_correction import correction_weights
from tests.helpers.objectives import DT, assert_close, num
from tests.helpers.tiny import KEEP, tiny_run

# ----------------------------------------------------------------------------------------------------
# AReaL 4aef98d, transcribed
# ----------------------------------------------------------------------------------------------------


def areal_m2po_keep(behaviour, proximal, mask, threshold):
    """_apply_m2po_masking: sort the valid tokens' (behaviour - proximal)^2 descending, drop the largest until the mean
    of the rest is below the threshold (all but one if never), scatter back."""
    m2 = (behaviour - proximal) ** 2
    values = m2[mask]
    ordered, index = torch.sort(values, descending=True)
    n = ordered.numel()
    suffix_mean = ordered.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=ordered.dtype)
    below = torch.where(suffix_mean < threshold)[0]
    drop = int(below[0]) if len(below) else n - 1
    kept_sorted = torch.ones(n, dtype=torch.bool)
    kept_sorted[:drop] = False
    keep = torch.zeros_like(mask)
    keep[mask] = kept_sorted[torch.argsort(index)]
    return keep


def areal_rejection(proximal, behaviour, mask, upper, level="token"):
    """apply_rejection_sampling, metric "ratio", action "mask", agg "mean", no lower bound: the updated loss mask and
    the behaviour weight (0 off the mask)."""
    log_ratio = proximal - behaviour
    weight = torch.exp(log_ratio)
    if level == "token":
        metric = weight
    else:  # the geometric mean over the sequence's valid tokens, as the weight and as the filtered metric
        mean = torch.where(mask, log_ratio, 0.0).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        weight = torch.exp(mean).expand_as(log_ratio)
        metric = weight
    kept = mask & (metric <= upper)
    return kept, torch.where(kept, weight, 0.0)


def areal_ppo_actor_loss(logp, proximal, behaviour, adv, mask, eps_low, eps_high, upper=None, level="token"):
    """ppo_actor_loss_fn: PPO's clipped loss on the ratio to the proximal policy (token, or the sequence's geometric
    mean with the sequence-averaged advantage), times the behaviour weight when rejection sampling is on; summed over
    the kept tokens and divided by the valid tokens counted before rejection."""
    count = mask.sum()
    weight = None
    if upper is not None:
        mask, weight = areal_rejection(proximal, behaviour, mask, upper, level)
    if level == "token":
        ratio = torch.where(mask, torch.exp(logp - proximal), 0.0)
    else:
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)
        mean = torch.where(mask, logp - proximal, 0.0).sum(-1, keepdim=True) / lengths
        ratio = torch.where(mask, torch.exp(mean).expand_as(logp), 0.0)
        adv = (torch.where(mask, adv, 0.0).sum(-1, keepdim=True) / lengths).expand_as(logp)
        adv = torch.where(mask, adv, 0.0)
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high))
    if weight is not None:
        loss = loss * weight
    return torch.where(mask, loss, 0.0).sum() / count


def issue_tensors(seed=0):
    """The tensors of the report that M2PO masked nothing under a rollout correction: 8 x 12 tokens (some padding),
    proximal = behaviour + N(0, 0.9^2)."""
    g = torch.Generator().manual_seed(seed)
    behaviour = -2.0 * torch.rand(8, 12, generator=g, dtype=DT)
    proximal = behaviour + 0.9 * torch.randn(8, 12, generator=g, dtype=DT)
    lengths = torch.tensor([12, 12, 10, 7, 12, 3, 9, 12])
    mask = torch.arange(12)[None, :] < lengths[:, None]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.7, -0.2], dtype=DT)
    return behaviour, proximal, mask, adv


def loop_batch(behaviour, proximal, mask, adv, correction):
    """What the native loop's policy_batch hands the objective at the first minibatch of a step whose old log-probs
    were recomputed (the proximal policy) and whose rollout's sampler log-probs are ``behaviour``; the current
    log-probs equal the proximal ones (no update yet), as a leaf with grad."""
    n, width = mask.shape
    ro = Rollout(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                 torch.zeros(n, width, dtype=torch.long), mask, behaviour, [""] * n, torch.zeros(n, dtype=torch.bool))
    batch = TrainBatch(ro, torch.zeros(n, dtype=DT), adv, torch.arange(n) // 4, proximal, correction=correction)
    plan = UpdatePlan(batch, epochs=1, minibatch_size=n, microbatch_size=n, group_size=4, temperature=1.0,
                      padding_free=True, max_completion_len=width, max_grad_norm=1.0, rollout_step=0,
                      behaviour="recompute", order_seed=0)
    logp = proximal.clone().requires_grad_(True)
    forward = RowsForward(torch.arange(n), logp, None, mask, width)
    return policy_batch(plan, Minibatch(torch.arange(n), mask.sum()), forward, RunState()), logp


# ----------------------------------------------------------------------------------------------------
# The three log-probs: M2PO, OPSM, TBPO read the behaviour's whenever the old log-probs are the proximal's
# ----------------------------------------------------------------------------------------------------


def test_m2po_under_a_correction_masks_behaviour_against_proximal_as_areal():
    """With a rollout correction on, the loop recomputes the proximal policy; the M2PO mask must still compare the
    behaviour with it (AReaL's delta = old_logp - prox_logp), not the current policy with itself (0% masked)."""
    behaviour, proximal, mask, adv = issue_tensors()
    weights = correction_weights(proximal, behaviour, mask, "token_mask", 5.0, 0.0)  # AReaL's rejection at 5
    batch, logp = loop_batch(behaviour, proximal, mask, adv, weights)
    assert torch.equal(batch.sampler_logp, behaviour) and batch.behaviour_corrected
    out = get_objective("m2po", m2_threshold=0.04)(batch)
    keep = areal_m2po_keep(behaviour, proximal, mask, 0.04)
    dropped = (mask & ~keep).sum().item() / mask.sum().item()
    assert dropped > 0.5  # the report's draw: 67%
    assert num(out.metrics["m2po_dropped_frac"], dropped, 1e-12)
    # AReaL's grpo_loss_fn: the M2PO mask, then ppo_actor_loss_fn with eps_clip 0 and rejection sampling above 5
    ref_logp = proximal.clone().requires_grad_(True)
    ref = areal_ppo_actor_loss(ref_logp, proximal, behaviour, adv[:, None].expand_as(proximal), keep, 0.0, 0.0,
                               upper=5.0)
    assert num(out.loss, ref, 1e-12)
    (grad,) = torch.autograd.grad(out.loss, logp)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert_close(grad, ref_grad, tol=1e-12)
    assert (grad[mask & keep] != 0).any() and (grad[mask & ~keep] == 0).all()


def test_opsm_reads_the_behaviour_and_tbpo_does_not_correct_twice():
    behaviour, proximal, mask, adv = issue_tensors(1)
    weights = correction_weights(proximal, behaviour, mask, "token_truncate", 2.0)
    batch, _ = loop_batch(behaviour, proximal, mask, adv, weights)
    # OPSM: A < 0 and mean_t(behaviour - current) > delta (DeepSeek-V3.2 Eq. 9, the sampler's log-probs)
    drift = torch.where(mask, behaviour - proximal, 0.0).sum(-1) / mask.sum(-1)
    expected = ((adv < 0) & (drift > 0.1))[:, None] & mask
    out = get_objective("grpo", off_policy_mask=True, off_policy_mask_threshold=0.1)(batch)
    assert 0 < expected.sum() < mask.sum()
    assert num(out.metrics["off_policy_masked_frac"], expected.sum().item() / mask.sum().item(), 1e-12)
    # TBPO: the loop's correction is on, so its own mismatch weight is 1 (its band drops nothing)
    tbpo = get_objective("tbpo", band_low=0.99, band_high=1.01)
    assert tbpo(batch).metrics["tbpo_drop_frac"] == 0.0
    assert tbpo(dataclasses.replace(batch, behaviour_corrected=False)).metrics["tbpo_drop_frac"] > 0


# ----------------------------------------------------------------------------------------------------
# Decoupled PPO
# ----------------------------------------------------------------------------------------------------


def decoupled_tensors():
    """Ratios to the proximal policy in every clip region of 0.2 / 0.2 for both signs of A, behaviour weights below,
    below and above the cap 5, padding."""
    proximal = torch.tensor([[-1.0, -2.0, -0.5, -1.2], [-0.3, -1.5, -0.9, -2.0], [-0.8, -0.4, -1.1, 0.0]], dtype=DT)
    d = torch.tensor([[0.5, 0.05, -0.4, 0.1], [-0.5, 0.3, 0.0, -0.1], [0.25, -0.3, 0.1, 0.0]], dtype=DT)
    log_w = torch.tensor([[0.2, 1.5, 2.0, -1.0], [1.7, -0.5, 0.1, 0.0], [-2.0, 0.3, 1.0, 0.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    adv = torch.tensor([1.0, -0.8, 0.6], dtype=DT)
    return proximal, proximal + d, proximal - log_w, mask, adv


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_decoupled_ppo_token_level_equals_areal(name):
    proximal, current, behaviour, mask, adv = decoupled_tensors()
    weights = correction_weights(proximal, behaviour, mask, "decoupled_ppo", 5.0)
    assert torch.equal(weights, correction_weights(proximal, behaviour, mask, "token_mask", 5.0, 0.0))
    assert weights[0, 1] > 0 and weights[0, 2] == 0  # e^1.5 below the cap 5 kept, e^2 masked
    logp = current.clone().requires_grad_(True)
    objective = get_objective(name, aggregation="token_mean")
    high = objective.clip_high
    out = objective(dataclasses.replace(loop_batch(behaviour, proximal, mask, adv, weights)[0], logp=logp))
    ref_logp = current.clone().requires_grad_(True)
    ref = areal_ppo_actor_loss(ref_logp, proximal, behaviour, adv[:, None].expand_as(proximal), mask, 0.2, high,
                               upper=5.0)
    assert num(out.loss, ref, 1e-12)
    (grad,) = torch.autograd.grad(out.loss, logp)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert_close(grad, ref_grad, tol=1e-12)
    assert grad[0, 0] == 0 and grad[0, 3] != 0 and grad[0, 2] == 0  # clipped high (A > 0), inside, masked


def test_decoupled_ppo_on_gspo_is_the_geometric_mean_weight_as_areal_sequence_level():
    proximal, current, behaviour, mask, adv = decoupled_tensors()
    weights = correction_weights(proximal, behaviour, mask, "decoupled_ppo", 1.5, ratio_level="sequence")
    geo = torch.exp(torch.where(mask, proximal - behaviour, 0.0).sum(-1) / mask.sum(-1))
    assert geo[0] > 1.5 > geo[1] and (weights[0] == 0).all()  # the first sequence's geometric mean over the cap
    assert_close(weights[1:][mask[1:]], geo[1:, None].expand(2, 4)[mask[1:]], tol=1e-12)
    logp = current.clone().requires_grad_(True)
    batch = dataclasses.replace(loop_batch(behaviour, proximal, mask, adv, weights)[0], logp=logp)
    out = get_objective("gspo", aggregation="token_mean", clip_low=0.05, clip_high=0.05)(batch)
    ref_logp = current.clone().requires_grad_(True)
    ref = areal_ppo_actor_loss(ref_logp, proximal, behaviour, adv[:, None].expand_as(proximal), mask, 0.05, 0.05,
                               upper=1.5, level="sequence")
    assert num(out.loss, ref, 1e-12)
    (grad,) = torch.autograd.grad(out.loss, logp)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert_close(grad, ref_grad, tol=1e-12)
    assert (grad[2][mask[2]] != 0).all()


def verl_tis_loss(logp, proximal, rollout, adv, mask, clip, cap):
    """verl decoupled mode: compute_rollout_correction_weights (rollout_is token, truncate at cap, on old_log_prob
    = the recomputed proximal) times compute_policy_loss_vanilla's clipped per-token loss, token-mean."""
    weight = torch.clamp(torch.exp(proximal - rollout), max=cap) * mask
    ratio = torch.exp(logp - proximal)
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)) * weight
    return (loss * mask).sum() / mask.sum()


def test_a_truncated_correction_under_lag_is_verl_decoupled_tis():
    proximal, current, behaviour, mask, adv = decoupled_tensors()
    weights = correction_weights(proximal, behaviour, mask, "token_truncate", 2.0)
    logp = current.clone().requires_grad_(True)
    out = get_objective("grpo", aggregation="token_mean")(
        dataclasses.replace(loop_batch(behaviour, proximal, mask, adv, weights)[0], logp=logp))
    ref_logp = current.clone().requires_grad_(True)
    ref = verl_tis_loss(ref_logp, proximal, behaviour, adv[:, None], mask.to(DT), 0.2, 2.0)
    assert num(out.loss, ref, 1e-12)
    assert_close(torch.autograd.grad(out.loss, logp)[0], torch.autograd.grad(ref, ref_logp)[0], tol=1e-12)


LAG2 = ["train.rollout_lag=2", "train.steps=3"]  # a lag below the steps (tiny_run has 2)


@pytest.mark.parametrize("override, message", [
    (["objective.name=ctpo", "train.rollout_correction.mode=decoupled_ppo"], "a prefix product"),
    (["objective.name=popo", "train.rollout_correction.mode=decoupled_ppo"], "none: a likelihood"),
    (["train.lag_mode=mixed"], "set train.rollout_lag >= 1"),
    (["train.lag_mode=mixed", "backend=trl"], "leave it out (TRL's GRPOTrainer runs no lag), or use backend=native"),
    ([*LAG2, "train.in_flight_tokens=8"], "tokens: it needs a value below train.max_new_tokens=8"),
    ([*LAG2, "train.in_flight_tokens=4", "train.lag_mode=mixed"], "it needs train.lag_mode=fixed (a mixed lag"),
    ([*LAG2, "train.lag_mode=mixed", "train.dynamic_sampling=true"], "train.dynamic_sampling"),
    ([*LAG2, "train.in_flight_tokens=3", "objective.advantage=remax"], "('remax': a greedy baseline"),
    (["train.lag_mode=stale"], "train.lag_mode must be one of fixed, mixed"),
    (["train.rollout_lag=-1"], "must be >= 0"),
    ([*LAG2, "train.in_flight_tokens=-1"], "must be >= 0"),
    (["train.rollout_lag=5", "train.steps=5"], "set train.rollout_lag <= 4 or more train.steps"),
])
def test_bad_async_settings_are_one_line(tmp_path, override, message):
    with pytest.raises(ConfigError) as error:
        tiny_run(tmp_path, *override)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_the_trl_backend_refuses_lag_and_decoupled_ppo_in_one_line(tmp_path):
    for override, message in ((LAG2, "train.rollout_lag is not supported"),
                              (["train.rollout_correction.mode=decoupled_ppo"], "no TRL counterpart")):
        reason = trl_unsupported(tiny_run(tmp_path, *override))
        assert message in reason and "\n" not in reason
    assert trl_unsupported(tiny_run(tmp_path)) is None


def test_the_mismatch_meter_reports_the_weights_effective_sample_size():
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, 0.0]])
    trainer = sampler + torch.tensor([[0.0, math.log(2.0), math.log(0.5)], [math.log(4.0), 0.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    meter = MismatchMeter(ess=True)
    meter.add(sampler[:1], trainer[:1], mask[:1])
    meter.add(sampler[1:], trainer[1:], mask[1:])
    w = torch.tensor([1.0, 2.0, 0.5, 4.0, 1.0], dtype=DT)
    assert num(meter.result()["mismatch_ess"], w.sum() ** 2 / (5 * w.square().sum()), 1e-6)
    assert "mismatch_ess" not in MismatchMeter().result()  # only lagged runs report it (a lag-0 row is unchanged)


# ----------------------------------------------------------------------------------------------------
# The pipeline's schedule, with a fake sampler (harness/loop/pipeline.py)
# ----------------------------------------------------------------------------------------------------

EOS, PAD, PROMPT = 1, 0, 2  # the fake tokenizer's ids and the fake prompts' width


class FakeTokenizer:
    eos_token_id, pad_token_id = EOS, PAD

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(str(i) for i in row.tolist() if i != PAD) for row in ids]


def fake_rollout(rows: list[int], start: int, count: int) -> Rollout:
    """Completions of the fake sampler: row r draws token 5 at every position, and EOS at position 2 + r % 5 (so
    rows finish at different segments); ``start`` tokens are already drawn; log-prob -position."""
    ids = torch.full((len(rows), count), 5)
    for k, r in enumerate(rows):
        end = 2 + r % 5 - start
        if 0 <= end < count:
            ids[k, end] = EOS
    logp = -torch.arange(start, start + count, dtype=torch.float32).expand(len(rows), count)
    prompt = torch.tensor(rows)[:, None].expand(len(rows), PROMPT + start)
    return rollout_of(FakeTokenizer(), prompt, torch.ones_like(prompt), ids, logp.clone())


def fake_collect(calls):
    def collect(sampler, tokenizer, task, problems, cfg, step, greedy_baseline=False, subset=None,
                sampling_seed=None):
        groups = list(range(cfg.train.prompts_per_step)) if subset is None else subset
        rows = [g * cfg.train.group_size + j for g in groups for j in range(cfg.train.group_size)]
        calls.append((step, tuple(groups), sampling_seed, sampler.version))
        ro = fake_rollout(rows, 0, 3 + step % 2)  # widths differ between steps: assembly re-pads
        ro.routing = RoutingRecord(torch.zeros(1, len(rows), PROMPT + ro.completion_ids.shape[1], 1,
                                               dtype=torch.int16), ("router",), PROMPT, 2)
        n = len(rows)
        spread = torch.tensor([0.0 if r // cfg.train.group_size % 3 == 0 else r for r in rows])  # groups 0, 3 flat
        return Collected(ro, spread + 100 * step,
                         {"sampled_tokens": int(ro.completion_mask.sum())},
                         None, torch.zeros(n, 3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))

    return collect


def fake_run(version: int) -> SimpleNamespace:
    task = SimpleNamespace(score=lambda text, problem: Score(correct=float(text.endswith("1")), format=1.0))
    return SimpleNamespace(sampler=SimpleNamespace(version=version), tokenizer=FakeTokenizer(), task=task,
                           train_problems=list(range(50)), estimator=ADVANTAGES.get("grpo"))


def drive(pipeline: Pipeline, steps: int, first: int = 1, restart_at: int | None = None):
    """Run the pipeline's stages 1 through ``steps``; with ``restart_at``, through a checkpoint round trip
    (torch.save / torch.load(weights_only=True)) before that step. Returns each step's (collected, versions)."""
    import io

    taken = {}
    for step in range(first, steps + 1):
        if step == restart_at:
            buffer = io.BytesIO()
            torch.save(pipeline.state_dict(), buffer)
            buffer.seek(0)
            pipeline = Pipeline(pipeline.cfg, torch.load(buffer, weights_only=True))
        pipeline.advance(fake_run(step - 1), step)
        taken[step] = pipeline.take(step, PAD)
    return taken


def test_a_fixed_lag_trains_at_step_t_what_version_t_minus_1_minus_k_sampled(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(pipeline_module, "collect_batch", fake_collect(calls))
    cfg = tiny_run(tmp_path, "train.rollout_lag=3", "train.steps=7")
    taken = drive(Pipeline(cfg), 7)
    # the sampling steps: batches 1-4 at step 1 (the starting policy), then batch t + 3 at step t, none past step 7
    assert [(c[0], c[3]) for c in calls] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 2), (7, 3)]
    assert all(c[1] == (0, 1, 2, 3) and c[2] is None for c in calls)  # whole batches with the synchronous draws
    for step, (collected, versions) in taken.items():
        assert (versions == max(0, step - 4)).all() and collected.rewards[0] == 100 * step
        assert lag_metrics(versions, collected.rollout.completion_mask, step) == {"lag_mean": min(step - 1, 3),
                                                                                    "lag_max": min(step - 1, 3)}


def test_lag_zero_samples_each_batch_at_its_own_step(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(pipeline_module, "collect_batch", fake_collect(calls))
    pipeline = Pipeline(tiny_run(tmp_path, "train.steps=3"))
    drive(pipeline, 3)
    assert [(c[0], c[3], c[2]) for c in calls] == [(1, 0, None), (2, 1, None), (3, 2, None)]
    assert pipeline.state_dict() == {"pending": []}


def test_mixed_ages_sample_each_group_once_by_the_version_of_its_own_lag(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(pipeline_module, "collect_batch", fake_collect(calls))
    cfg = tiny_run(tmp_path, "train.rollout_lag=2", "train.lag_mode=mixed", "train.steps=12",
                   "train.prompts_per_step=6", "train.group_size=2", "train.num_minibatches=1")
    pipeline = Pipeline(cfg)
    taken = drive(pipeline, 12, restart_at=6)
    seen_lags = set()
    for step, (collected, versions) in taken.items():
        lags = pipeline.lags(step)
        assert len(collected.rewards) == 12 and collected.rollout.routing.indices.shape[1] == 12
        for g, lag in enumerate(lags):
            rows = slice(2 * g, 2 * g + 2)
            valid = collected.rollout.completion_mask[rows]
            assert (versions[rows][valid] == max(0, step - 1 - lag)).all()
            assert (collected.rewards[rows] // 100 == step).all()  # the group's own step's problems
            seen_lags.add(lag)
        assert collected.stats["sampled_tokens"] == int(collected.rollout.completion_mask.sum())
        assert collected.stats.get("frac_zero_std_groups", 1 / 3) == pytest.approx(1 / 3)  # groups 0 and 3
    assert seen_lags == {0, 1, 2}
    groups = [g for c in calls for g in c[1]]  # every (step, group) sampled once
    assert len(groups) == 12 * 6 and all(c[2] is not None for c in calls if len(c[1]) < 6)
    seeds = [c[2] for c in calls if c[2] is not None]  # each piece its own draws (pieces of one step included)
    assert len(set(seeds)) == len(seeds)


def test_in_flight_batches_switch_version_every_m_tokens_and_survive_a_checkpoint(tmp_path, monkeypatch):
    seeds = []  # torch's seed at every segment's sampling

    def sample_problems(sampler, tokenizer, problems, t, max_new_tokens):
        seeds.append(torch.initial_seed())
        rows = list(range(len(problems) * t.group_size))
        return fake_rollout(rows, 0, max_new_tokens)

    def generate_ids(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, **settings):
        seeds.append(torch.initial_seed())
        return fake_rollout(prompt_ids[:, 0].tolist(), prompt_ids.shape[1] - PROMPT, max_new_tokens)

    def collect_batch(sampler, tokenizer, task, problems, cfg, step, greedy_baseline=False):  # a batch due at once
        ro = fake_rollout(list(range(cfg.train.prompts_per_step * cfg.train.group_size)), 0, cfg.train.max_new_tokens)
        n = len(ro.texts)
        return Collected(ro, torch.ones(n), {"sampled_tokens": n}, None, torch.zeros(n, 3, dtype=DT), torch.ones(3))

    monkeypatch.setattr(pipeline_module, "sample_problems", sample_problems)
    monkeypatch.setattr(pipeline_module, "generate_ids", generate_ids)
    monkeypatch.setattr(pipeline_module, "collect_batch", collect_batch)
    cfg = tiny_run(tmp_path, "train.rollout_lag=3", "train.in_flight_tokens=2", "train.max_new_tokens=12",
                   "train.steps=8")
    taken = drive(Pipeline(cfg), 8, restart_at=5)
    for step, (collected, versions) in taken.items():
        born = max(1, step - 3)
        ro = collected.rollout
        for r in range(len(ro.texts)):
            length = 3 + r % 5  # EOS at position 2 + r % 5
            assert ro.completion_mask[r].sum() == length and ro.texts[r].endswith(str(EOS))
            expected = [min(step - 1, born - 1 + j // 2) for j in range(length)]
            assert versions[r, :length].tolist() == expected, (step, r)
            assert ro.sampler_logp[r, :length].tolist() == [-float(j) for j in range(length)]
        assert collected.rewards.tolist() == [1.0] * len(ro.texts)  # scored when finished
    assert len(set(seeds)) == len(seeds) > 8  # every first segment and continuation seeded with its own draws


# ----------------------------------------------------------------------------------------------------
# Lagged runs end to end (tiny model; rewards vary through the overlong penalty, so the policy moves)
# ----------------------------------------------------------------------------------------------------

LAGGED = ["task.overlong_buffer=6", "train.steps=5"]


@pytest.mark.slow
def test_a_lagged_run_logs_its_lag_and_weights_against_the_behaviour(tmp_path):
    from harness.loop.native import train
    from harness.run.records import read_jsonl

    run = tiny_run(tmp_path, *LAGGED, "train.rollout_lag=2", "train.rollout_correction.mode=decoupled_ppo",
                   "train.rollout_correction.threshold=1.001")
    train(run, tmp_path / "run", progress=False)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")[1:]
    assert [r["lag_mean"] for r in rows] == [0, 1, 2, 2, 2] and [r["lag_max"] for r in rows] == [0, 1, 2, 2, 2]
    assert rows[0]["rollout_corr_weight_mean"] == 1.0 and rows[0].get("rollout_corr_masked_frac") == 0.0
    assert all(r["mismatch_kl"] > 0 and r["mismatch_ess"] < 1 for r in rows[2:])  # stale: weights differ from 1
    assert all(r["rollout_corr_masked_frac"] > 0 for r in rows[2:])


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["train.rollout_lag=2"], ["train.rollout_lag=2", "train.lag_mode=mixed"],
                                  ["train.rollout_lag=2", "train.in_flight_tokens=3",
                                   "train.rollout_correction.mode=token_truncate"]])
def test_a_killed_lagged_run_resumes_to_the_uninterrupted_metrics(tmp_path, mode):
    from harness.loop.native import train
    from tests.helpers.interrupt import full_and_resumed

    run = tiny_run(tmp_path, *LAGGED, *mode, KEEP)
    full, part = full_and_resumed(train, run, tmp_path, step=4)
    assert [r["step"] for r in part] == [0, 1, 2, 3, 4, 5] and part == full
    state = torch.load(tmp_path / "part" / "checkpoints" / "previous.pt", weights_only=True)  # the step-4 one
    assert state["state"]["step"] == 4 and state["pipeline"]["pending"]  # batch 5 was pending
    assert any(r["lag_max"] > 0 and r["mismatch_kl"] > 0 for r in full[1:])


@pytest.mark.slow
@pytest.mark.parametrize("sampler", [["train.sampler=native"], ["train.sampler=hf"], ["train.decoder=cache"]])
def test_in_flight_behaviour_logprobs_are_each_versions_own_given_the_prefix(tmp_path, sampler):
    """With a learning rate of 0 every version is the same policy, so the behaviour log-probs of completions continued
    in flight (the newer policy over the prompt and the tokens so far) must equal the trainer's recomputation of the
    whole completion: a continuation at the wrong positions or without its prefix would not."""
    from harness.loop.native import train
    from harness.run.records import read_jsonl

    run = tiny_run(tmp_path, "train.steps=3", "train.rollout_lag=2", "train.in_flight_tokens=3", "train.lr=0",
                   "train.old_logp=recompute", *sampler)
    train(run, tmp_path / "run", progress=False)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")[1:]
    assert [r["lag_max"] for r in rows] == [0, 1, 2]
    assert all(r["mismatch_logp_abs"] < 1e-5 for r in rows), [r["mismatch_logp_abs"] for r in rows]


def test_lag_metrics_count_valid_tokens_only_and_max_is_the_oldest():
    """A mixed-ages batch: lag = step - 1 - version over the completion tokens (padding, version -1, left out); the
    max is the stalest token's, not the mean."""
    versions = torch.tensor([[0, 0, 1, -1], [2, 2, -1, -1]], dtype=torch.int32)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert lag_metrics(versions, mask, step=4) == {"lag_mean": 2.0, "lag_max": 3.0}  # lags 3, 3, 2, 1, 1
    assert lag_metrics(versions, torch.zeros_like(mask), step=4) == {}


@pytest.mark.parametrize("estimator", ["remax", "a2po"])
def test_a_fixed_lag_keeps_the_estimators_greedy_baseline_and_reference_rewards(tmp_path, monkeypatch, estimator):
    """ReMax's greedy baseline and A*-PO's reference completions are sampled with the lagged batch, for its own step,
    and the batch taken at its step still carries them (a single piece is not re-assembled)."""
    calls, reference = [], []
    collect = fake_collect(calls)

    def with_baseline(*args, greedy_baseline=False, **kwargs):
        collected = collect(*args, **kwargs)
        n = len(collected.rewards)
        return collected._replace(baselines=torch.full((n,), 7.0)) if greedy_baseline else collected

    def with_reference(collected, ref, tokenizer, task, cfg, step, samples):
        reference.append((step, samples))
        return collected._replace(reference_rewards=torch.full((len(collected.rewards), samples), float(step)))

    monkeypatch.setattr(pipeline_module, "collect_batch", with_baseline)
    monkeypatch.setattr(pipeline_module, "with_reference_rewards", with_reference)
    cfg = tiny_run(tmp_path, "train.rollout_lag=1", "train.steps=4", f"objective.advantage={estimator}")
    pipeline = Pipeline(cfg)
    for step in range(1, 5):
        run = fake_run(step - 1)
        run.estimator, run.reference = ADVANTAGES.get(estimator), None
        pipeline.advance(run, step)
        collected, _ = pipeline.take(step, PAD)
        if estimator == "remax":
            assert collected.baselines is not None and (collected.baselines == 7.0).all()
        else:
            assert collected.reference_rewards is not None and (collected.reference_rewards == step).all()
    assert [r[0] for r in reference] == ([1, 2, 3, 4] if estimator == "a2po" else [])


def test_a_pending_piece_survives_a_checkpoint_field_for_field(tmp_path):
    """Everything a pending batch carries (its statistics, greedy baselines, reference rewards, MoE routing, the
    generation of an in-flight batch) comes back from ``torch.load(weights_only=True)`` as it was saved."""
    import io

    ro = fake_rollout([0, 1, 2, 3], 0, 4)
    ro.routing = RoutingRecord(torch.arange(4 * 6, dtype=torch.int16).view(1, 4, 6, 1), ("router",), PROMPT, 2)
    collected = Collected(ro, torch.arange(4.0), {"sampled_tokens": 9, "reward_mean": 1.5}, torch.full((4,), 0.25),
                          torch.ones(4, 3, dtype=DT), torch.ones(3, dtype=DT),
                          reference_rewards=torch.arange(8.0).view(4, 2))
    flight = pipeline_module.Flight([3, 1], ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.sampler_logp,
                                    torch.tensor([True, False, True, False]), segments=3)
    versions = torch.arange(16, dtype=torch.int32).view(4, 4)
    pieces = [pipeline_module.Piece(5, [0, 2], versions, collected=collected),
              pipeline_module.Piece(6, [0, 1], versions + 1, flight=flight)]
    buffer = io.BytesIO()
    torch.save({"pending": [pipeline_module.piece_state(p) for p in pieces]}, buffer)
    buffer.seek(0)
    back = Pipeline(tiny_run(tmp_path), torch.load(buffer, weights_only=True)).pending

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return a.dtype == b.dtype and torch.equal(a, b)
        if dataclasses.is_dataclass(a) or isinstance(a, tuple) and hasattr(a, "_fields"):
            names = a._fields if hasattr(a, "_fields") else [f.name for f in dataclasses.fields(a)]
            return all(same(getattr(a, n), getattr(b, n)) for n in names)
        return type(a) is type(b) and a == b

    assert len(back) == 2 and all(same(p, q) for p, q in zip(pieces, back, strict=True))
