"""The 2026 family (MaxRL, FIPO, IPO, DRO, the adaptive entropy and KL coefficients), each pinned in value and gradient
to a transcription of its reference code (written out below from the repository and commit its docstring names) on
hand-made tensors that reach every branch, plus values computed by hand. Tensors are float64.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from harness.loop.metrics import MetricMeter
from harness.run.config import load_experiment, run_configs
from harness.run.errors import ConfigError
from objectives import PolicyBatch, get_advantage, get_objective
from objectives.adaptive_entropy import adaptive_entropy_step
from objectives.adaptive_kl import adaptive_kl_step
from objectives.base import aggregate, reference_kl
from tests.helpers.objectives import DT, assert_close, group_batch, make_batch, num, run
from tests.test_objectives_new import prob_batch, random_prob_batch

E, L = math.exp, math.log


def grad_of(loss, batch):
    (grad,) = torch.autograd.grad(loss, batch.logp)
    return grad


def verl_agg(loss_mat, mask, mode, horizon=None):
    """verl's agg_loss (one process, no global batch info), written out."""
    m = mask.to(loss_mat.dtype)
    if mode == "token_mean":
        return (loss_mat * m).sum() / m.sum()
    seqs = (m.sum(-1) > 0).sum()
    if mode == "seq_mean_token_mean":
        return ((loss_mat * m).sum(-1) / (m.sum(-1) + 1e-8)).sum() / seqs
    loss = (loss_mat * m).sum(-1).sum() / seqs
    return loss / (horizon or mask.shape[-1]) if mode == "seq_mean_token_sum_norm" else loss


# ----------------------------------------------------------------------------------------------------
# DRO (verl compute_policy_loss_dro, verl-project/verl 1dda039b)
# ----------------------------------------------------------------------------------------------------

def verl_dro(old_log_prob, log_prob, advantages, response_mask, beta, mode):
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    return verl_agg(pg_losses, response_mask, mode)


def test_dro_hand():
    batch = make_batch([[-1.0, -2.0], [-0.5, 9.0]], [[0.2, -0.4], [0.1, 3.0]], [[1, 1], [1, 0]], [1.0, -0.5])
    out, grad = run("dro", batch, dro_beta=0.1)  # token-mean over 3 tokens
    terms = [-(-0.8 * 1.0 - 0.05 * 0.04), -(-2.4 * 1.0 - 0.05 * 0.16), -(-0.4 * -0.5 - 0.05 * 0.01)]
    assert num(out.loss, sum(terms) / 3)
    assert_close(grad, [[(-1.0 + 0.1 * 0.2) / 3, (-1.0 + 0.1 * -0.4) / 3], [(0.5 + 0.1 * 0.1) / 3, 0.0]])
    assert num(out.metrics["dro_penalty"], 0.05 * (0.04 + 0.16 + 0.01) / 3) and out.metrics["clip_frac"] == 0.0


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum"])
@pytest.mark.parametrize("beta", [0.05, 2.0])
def test_dro_matches_verl(mode, beta):
    batch = group_batch(t=5, garbage=True)
    batch.max_completion_len = 5  # verl's horizon: the response width
    out = get_objective("dro", dro_beta=beta, aggregation=mode)(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref = verl_dro(batch.old_logp, batch.logp, adv, batch.mask, beta, mode)
    tol = 1e-8 if mode == "seq_mean_token_mean" else 1e-12  # verl divides by L_i + 1e-8
    assert num(out.loss, ref, tol)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=tol)


def test_dro_needs_a_positive_beta():
    with pytest.raises(ValueError, match="dro_beta must be > 0"):
        get_objective("dro", dro_beta=0.0)
    assert get_objective("dro").dro_beta == 0.05  # the value of verl's own test of this loss (the docstring's default)


# ----------------------------------------------------------------------------------------------------
# IPO (prime-rl ipo_loss_fn, PrimeIntellect-ai/prime-rl 559b447)
# ----------------------------------------------------------------------------------------------------

def prime_rl_ipo(trainer, inference, adv, mask, threshold=0.1, kl_tau=1e-3, adv_tau=1.0):
    """prime-rl ipo_loss_fn per sample (summed over the batch here), divided by the global loss-token count
    (compute_loss's rl_scale)."""
    log_r = trainer - inference
    ratio = torch.exp(log_r)
    is_masked = torch.abs(torch.exp(trainer) - torch.exp(inference)) > threshold
    keep = mask & ~is_masked
    per_token = -(keep * (adv_tau * adv) * ratio) + kl_tau * (mask * log_r**2)
    return per_token.sum() / mask.sum()


def test_ipo_hand():
    # q (old prob) -> p: row 0 A > 0: +0.05 kept, +0.2 masked, -0.2 masked (symmetric: dppo_tv would keep it);
    # row 1 A < 0: -0.05 kept, +0.3 masked; padding slot garbage
    batch = prob_batch([[0.5, 0.5, 0.6], [0.5, 0.2, 0.5]], [[0.55, 0.7, 0.4], [0.45, 0.5, 0.9]],
                       [[1, 1, 1], [1, 1, 0]], [1.0, -0.5])
    out, grad = run("ipo", batch)
    d = [[L(0.55 / 0.5), L(0.7 / 0.5), L(0.4 / 0.6)], [L(0.45 / 0.5), L(0.5 / 0.2)]]
    kl = 1e-3 * sum(x * x for row in d for x in row)
    assert num(out.loss, (-1.0 * 1.1 + 0.5 * 0.9 + kl) / 5)
    g = [[-1.0 * 1.1, 0.0, 0.0], [0.5 * 0.9, 0.0]]
    assert_close(grad, [[(g[0][k] + 2e-3 * d[0][k]) / 5 for k in range(3)],
                        [(g[1][k] + 2e-3 * d[1][k]) / 5 for k in range(2)] + [0.0]])
    assert num(out.metrics["clip_frac_high"], 2 / 5) and num(out.metrics["clip_frac_low"], 1 / 5)
    # DPPO-Binary-TV's one-sided region at the same threshold masks only row 0's rise: against its advantage, row 0's
    # fall and row 1's rise are kept there
    tv, _ = run("dppo_tv", batch, clip_low=0.1, clip_high=0.1, kl_coef=1e-3, surrogate="ratio",
                aggregation="token_mean")
    assert num(tv.metrics["clip_frac"], 1 / 5)


@pytest.mark.parametrize("seed,threshold", [(0, 0.1), (1, 0.1), (2, 0.05)])
def test_ipo_matches_prime_rl(seed, threshold):
    batch = random_prob_batch(seed)
    out = get_objective("ipo", clip_low=threshold, clip_high=threshold)(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref = prime_rl_ipo(batch.logp, batch.old_logp, adv, batch.mask, threshold)
    assert out.metrics["clip_frac_high"] > 0 and out.metrics["clip_frac_low"] > 0
    assert num(out.loss, ref, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-12)


# ----------------------------------------------------------------------------------------------------
# FIPO (the authors' compute_policy_loss_future_kl, loss_mode=future_kl)
# ----------------------------------------------------------------------------------------------------

def authors_fipo(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high, clip_ratio_c, decay_rate,
                 future_kl_clip_ratio, future_kl_clip_high_only, safety_thresh, chunk_size=2):
    """The authors' verl loss (FIPO-main verl/trainer/ppo/core_algos.py compute_policy_loss_future_kl), written out:
    the future KL by chunked matrix products, verl 0.5's token-mean agg_loss over the final mask."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    batch_size, response_len = log_prob.shape
    gamma = torch.tensor(2 ** (-1.0 / decay_rate), dtype=log_prob.dtype)
    pos_i = torch.arange(response_len).unsqueeze(1)
    participation = ~(negative_approx_kl > torch.log(torch.tensor(clip_ratio_c, dtype=log_prob.dtype)))
    kl_response = negative_approx_kl * response_mask.to(log_prob.dtype) * participation.to(log_prob.dtype)
    future_kl = torch.zeros((batch_size, response_len), dtype=log_prob.dtype)
    for j_start in range(0, response_len, chunk_size):
        j_end = min(response_len, j_start + chunk_size)
        distance = torch.arange(j_start, j_end).unsqueeze(0) - pos_i
        decay_block = torch.pow(gamma, distance.clamp(min=0)) * (distance >= 0).to(log_prob.dtype)
        future_kl += torch.matmul(kl_response[:, j_start:j_end], decay_block.t())
    if future_kl_clip_ratio != 0.0:
        low = 1.0 if future_kl_clip_high_only else 1.0 - future_kl_clip_ratio
        influence = torch.clamp(torch.exp(future_kl), min=low, max=1.0 + future_kl_clip_ratio).detach()
    else:
        influence = torch.clamp(torch.exp(future_kl), max=10.0).detach()
    high_is = (advantages < 0) & (ratio > safety_thresh)
    influence = torch.where(high_is, torch.clamp(influence, min=0.8, max=1.0), influence)
    weighted = advantages * influence
    pg_losses1 = -weighted * ratio
    pg_losses2 = -weighted * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -weighted * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    lower_clip_mask = (advantages < 0) & (clip_pg_losses1 > pg_losses3) & response_mask.bool()
    final = response_mask.bool() & (~(lower_clip_mask.sum(dim=1) > 1)).unsqueeze(1)
    pg_losses = torch.where(weighted < 0, clip_pg_losses2, clip_pg_losses1)
    f = final.to(log_prob.dtype)
    return (pg_losses * f).sum() / f.sum(), final


def fipo_batch(drop: bool, seed: int = 0):
    """6 responses x 7 tokens, lengths 7..3, garbage on padding. Row 2 (A < 0) has one ratio above 10 (two with
    ``drop``: the sequence is dropped), row 3 (A < 0) a ratio of 5 (above a safety threshold of 3 below c), row 0
    (A > 0) a ratio of 12 (out of the future KL, not dual-clipped); the other moves cross both PPO clips and drive
    exp(F) past both bounds of the influence clip."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 7, generator=g, dtype=DT) * 3 - 0.1
    d = 0.9 * torch.randn(6, 7, generator=g, dtype=DT)
    d[2, 1], d[3, 0], d[0, 2] = L(12.0), L(5.0), L(12.0)
    d[3, 1:5] = torch.tensor([0.3, -0.2, 0.1, 0.2], dtype=DT)
    if drop:
        d[2, 4] = L(15.0)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 6, 7, 5, 4, 3])[:, None]
    old[~mask], d[~mask] = -4.0, 2.5
    return make_batch(old, d, mask, [0.9, -0.4, -1.2, -0.7, 0.5, 1.1], max_completion_len=7)


FIPO_SETTINGS = [{}, {"influence_clip_high_only": False}, {"influence_clip": 0.0},
                 {"safety_threshold": 3.0, "clip_ratio_c": 8.0, "decay_rate": 2.0, "influence_clip_high_only": False}]


@pytest.mark.parametrize("hp", FIPO_SETTINGS)
@pytest.mark.parametrize("drop", [False, True])
def test_fipo_matches_the_authors(hp, drop):
    """Value and gradient equal the authors' where no sequence is dropped; where one is, the authors' token-mean
    divides by the kept tokens and ours by all valid tokens (the loop's convention): ours = theirs x N_kept / N."""
    batch = fipo_batch(drop)
    obj = get_objective("fipo", **hp)
    out = obj(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref, final = authors_fipo(batch.logp, batch.old_logp, adv, batch.mask, obj.clip_low, obj.clip_high,
                              obj.clip_ratio_c, obj.decay_rate, obj.influence_clip, obj.influence_clip_high_only,
                              obj.safety_threshold)
    scale = final.sum() / batch.mask.sum()
    assert (scale < 1) == drop and num(out.metrics["fipo_dropped_frac"], 1 - scale)
    assert num(out.loss, ref * scale, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(ref * scale, batch), tol=1e-12)
    m = out.metrics
    assert m["clip_frac_low"] > 0 and m["clip_frac_high"] > 0 and m["clip_frac_dual"] > 0


def test_fipo_drops_a_sequence_under_a_rollout_correction_too():
    """The drop multiplies the rollout-correction weight: with a constant weight of 0.5 the loss and gradient are half
    the uncorrected ones, the dropped sequence still out."""
    batch = fipo_batch(True)
    plain = get_objective("fipo")(batch)
    batch.correction = torch.full_like(batch.logp, 0.5)
    corrected = get_objective("fipo")(batch)
    assert corrected.metrics["fipo_dropped_frac"] > 0
    assert num(corrected.loss, 0.5 * plain.loss, 1e-12)
    assert_close(grad_of(corrected.loss, batch), 0.5 * grad_of(plain.loss, batch), tol=1e-12)


def test_fipo_branches_are_reached():
    """The batch above reaches each influence-weight branch: both clip bounds of exp(F), the safety clamp, the
    exclusion of r > c from the future KL (the weights differ without it)."""
    batch = fipo_batch(False)
    fipo = get_objective("fipo", influence_clip_high_only=False, safety_threshold=3.0)
    d = batch.log_ratio().clamp(-20, 20)
    w, raw = fipo.influence_weights(d, batch)
    valid = batch.mask
    assert (raw[valid] > 1.2).any() and (raw[valid] < 0.8).any()
    assert torch.isclose(w[valid], torch.tensor(1.2, dtype=DT)).any() and torch.isclose(
        w[valid], torch.tensor(0.8, dtype=DT)).any()
    assert raw[3, 0] > 1.0 and w[3, 0] == 1.0  # A < 0, r = 5 > 3: clamped to [0.8, 1]
    from objectives.fipo import future_kl

    gamma = 2 ** (-1 / 32)
    assert not torch.allclose(future_kl(d, valid, gamma, 10.0)[2, :2], future_kl(d, valid, gamma, 1e9)[2, :2])


def test_fipo_weight_cap_and_log_ratio_clamp_match_the_authors():
    """influence_clip = 0: the authors cap exp(F) at 10 and clamp d to [-20, 20] before the future KL. Row 0 (A < 0,
    d = 2 per token, r = e^2 below c and the safety threshold) drives exp(F) past 10 with the gradient flowing; row 1
    has a log-ratio of -25 that enters the future KL of the tokens before it as -20; row 2 a +25 (A > 0, out of the
    future KL, clamped to r = e^20)."""
    old = [[-3.0, -3.0, -3.0, -3.0], [-30.0, -2.0, -2.0, -30.0], [-1.0, -28.0, -1.0, -2.0]]
    d = [[2.0, 2.0, 2.0, 2.0], [0.5, 0.4, 0.3, -25.0], [0.2, 25.0, -0.3, 0.1]]
    batch = make_batch(old, d, [[1, 1, 1, 1]] * 3, [-1.0, 0.7, 0.9])
    obj = get_objective("fipo", influence_clip=0.0, decay_rate=2.0)
    out = obj(batch)
    weight, raw = obj.influence_weights(batch.log_ratio().clamp(-20, 20), batch)
    assert (raw[0, :3] > 10).all() and (weight[0, :3] == 10).all() and raw[1, 0] < 1  # both branches reached
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref, final = authors_fipo(batch.logp, batch.old_logp, adv, batch.mask, obj.clip_low, obj.clip_high,
                              obj.clip_ratio_c, obj.decay_rate, obj.influence_clip, obj.influence_clip_high_only,
                              obj.safety_threshold)
    assert final.all()
    assert num(out.loss, ref, 1e-12)
    grad = grad_of(out.loss, batch)
    assert_close(grad, grad_of(ref, batch), tol=1e-12)
    assert (grad[0] != 0).all()


def test_fipo_safety_clamp_acts_on_the_clipped_weight():
    """The authors clamp the already clipped weight to [0.8, 1] for A < 0 and r > safety_thresh: with high-only
    clipping (weight >= 1) such a token's weight is 1 even where exp(F) < 0.8 (row 0, token 0: r = 5, F < 0)."""
    batch = make_batch([[-3.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], [[L(5.0), -2.0, -2.0], [0.1, -0.1, 0.2]],
                       [[1, 1, 1]] * 2, [-1.0, 0.6])
    obj = get_objective("fipo", safety_threshold=3.0, decay_rate=2.0)
    weight, raw = obj.influence_weights(batch.log_ratio().clamp(-20, 20), batch)
    assert raw[0, 0] < 0.8 and weight[0, 0] == 1.0
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref, _ = authors_fipo(batch.logp, batch.old_logp, adv, batch.mask, obj.clip_low, obj.clip_high,
                          obj.clip_ratio_c, obj.decay_rate, obj.influence_clip, obj.influence_clip_high_only,
                          obj.safety_threshold)
    out = obj(batch)
    assert num(out.loss, ref, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-12)


def test_fipo_defaults_are_the_32b_scripts():
    """The defaults the docstring cites: the official 32B script's settings (listed beside the vendored function and
    in ms-swift's FIPO docs: delta / clip_ratio_c 10), not the function's own fallbacks (decay 128, safety 4, c 3)."""
    assert {k: v for k, v in get_objective("fipo").hyperparameters().items() if k not in
            {"beta", "kl_estimator", "off_policy_mask", "off_policy_mask_threshold", "entropy_coef",
             "top_entropy_quantile"}} == {
        "clip_low": 0.2, "clip_high": 0.28, "clip_ratio_c": 10.0, "decay_rate": 32.0, "influence_clip": 0.2,
        "influence_clip_high_only": True, "safety_threshold": 10.0, "aggregation": "token_mean"}


def test_fipo_future_kl_by_hand():
    """Three tokens, gamma = 2^(-1/1) = 0.5: F_0 = d_0 + 0.5 d_1 + 0.25 d_2, F_1 = d_1 + 0.5 d_2, F_2 = d_2; a token
    with r > c leaves the sum."""
    from objectives.fipo import future_kl

    d = torch.tensor([[0.2, -0.4, 0.1]], dtype=DT)
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert_close(future_kl(d, mask, 0.5, 10.0), [[0.2 - 0.2 + 0.025, -0.4 + 0.05, 0.1]])
    assert_close(future_kl(d, mask, 0.5, E(0.15)), [[0.2 * 0 + -0.2 + 0.025, -0.35, 0.1]])


# ----------------------------------------------------------------------------------------------------
# MaxRL (the authors' compute_maxrl_outcome_advantage; SkyRL compute_maxrl_advantage)
# ----------------------------------------------------------------------------------------------------

def authors_maxrl(scores, index, epsilon=1e-6):
    """tajwarfahim/maxrl c0698eb verl/trainer/ppo/core_algos.py compute_maxrl_outcome_advantage, written out (one
    reward per response)."""
    scores = scores.clone()
    id2score, id2mean = defaultdict(list), {}
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        id2mean[idx] = torch.tensor(0.0) if len(id2score[idx]) == 1 else torch.mean(torch.tensor(id2score[idx]))
    for i in range(len(scores)):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2mean[index[i]] + epsilon)
    return scores


def test_maxrl_matches_the_authors_and_skyrl():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 2.0], dtype=DT)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3, 3])  # pass rates 1/2, 1/2, 0 (all wrong), non-binary 1.25
    ours = get_advantage("maxrl")(rewards, groups)
    theirs = authors_maxrl(rewards, groups.numpy())
    assert_close(ours, theirs, tol=1e-12)
    a = 0.5 / (0.5 + 1e-6)  # (R - p) / p with p = 1/2: (1 - p) / p for a success, -p / p for a failure
    assert_close(ours[:4], [a, -a, -a, a], tol=1e-12)
    assert (ours[6:8] == 0).all()
    # SkyRL's test example: groups [6, 3] (mean 4.5) and [9, 12] (mean 10.5)
    sky = get_advantage("maxrl")(torch.tensor([6.0, 3.0, 9.0, 12.0], dtype=DT), torch.tensor([0, 0, 1, 1]))
    assert_close(sky, [1.5 / (4.5 + 1e-6), -1.5 / (4.5 + 1e-6), -1.5 / (10.5 + 1e-6), 1.5 / (10.5 + 1e-6)], tol=1e-12)


def test_maxrl_group_of_one_is_zero_and_negative_rewards_are_refused(tmp_path):
    ours = get_advantage("maxrl")(torch.tensor([1.0, 1.0, 0.0], dtype=DT), torch.tensor([0, 1, 1]))
    assert ours[0] == 0.0  # the authors' R / 1e-6 = 1e6, SkyRL's R: ours 0, as every group-centred estimator
    assert np.isclose(authors_maxrl(torch.tensor([1.0]), np.array([0]))[0].item(), 1e6)
    with pytest.raises(ConfigError, match="^advantage estimator 'maxrl' assumes rewards >= 0"):
        run_configs(load_experiment("base", ["objective.advantage=maxrl", "task.overlong_buffer=4",
                                             f"results_dir={tmp_path}"]))


# ----------------------------------------------------------------------------------------------------
# Adaptive entropy coefficient (TRL use_adaptive_entropy)
# ----------------------------------------------------------------------------------------------------

class TRLAdaptiveEntropy:
    """TRL GRPOTrainer's adaptive entropy controller (grpo_trainer.py _compute_loss, the installed 1.16.0 wheel),
    written out: the coefficient and gate from the previous optimizer step, the window's token-weighted entropy."""

    def __init__(self, coef, target=0.2, delta=0.005, low=0.0, high=1.0):
        self.coef, self.last, self.target = coef, float("inf"), target
        self.delta, self.low, self.high = delta, low, high
        self.window = None

    def micro_batch(self, entropies, mask):
        apply = self.coef if self.last <= self.target else 0.0
        stats = torch.stack([(entropies * mask).sum(), mask.sum()])
        self.window = stats if self.window is None else self.window + stats
        return apply

    def sync(self):
        world = (self.window[0] / self.window[1].clamp(min=1.0)).item()
        if world <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last, self.window = world, None


def test_adaptive_entropy_follows_trls_controller_step_by_step():
    """Ten optimizer steps of two micro-batches each, the entropy crossing the target both ways and the coefficient
    reaching both bounds: the coefficient in each step's loss, the loss (policy - alpha H with the minibatch's
    token count) and its gradient (through log-probs and entropies), and the state after each step equal TRL's."""
    hp = dict(entropy_coef=0.004, entropy_target=0.25, entropy_coef_delta=0.003, entropy_coef_min=0.001,
              entropy_coef_max=0.01)
    ours = get_objective("adaptive_entropy", **hp)
    trl = TRLAdaptiveEntropy(0.004, 0.25, 0.003, 0.001, 0.01)
    levels, history = [0.1, 0.1, 0.1, 0.1, 0.6, 0.6, 0.6, 0.6, 0.6, 0.1], []
    for step, level in enumerate(levels):
        whole = group_batch(seed=step)
        whole.entropy = (level * (0.5 + torch.rand(whole.logp.shape, generator=torch.Generator().manual_seed(step),
                                                   dtype=DT))).requires_grad_(True)
        window, total = MetricMeter(), 0.0
        for rows in (slice(0, 3), slice(3, 8)):
            part = PolicyBatch(logp=whole.logp[rows], old_logp=whole.old_logp[rows], mask=whole.mask[rows],
                               advantages=whole.advantages[rows], entropy=whole.entropy[rows],
                               num_tokens=whole.mask.sum(), num_sequences=8)
            out = ours(part)
            applied = trl.micro_batch(whole.entropy[rows].detach(), whole.mask[rows].to(DT))
            assert out.metrics["adaptive_entropy_applied"] == applied
            window.add(out.metrics, part.mask.sum().item())
            total = total + out.loss
        plain = get_objective("bnpo")(whole).loss
        h = (whole.entropy * whole.mask).sum() / whole.mask.sum()
        assert num(total, plain - applied * h, 1e-12)
        grads = torch.autograd.grad(total, [whole.logp, whole.entropy])
        assert_close(grads[0], grad_of(plain, whole), tol=1e-12)
        m = whole.mask.to(DT)
        assert_close(grads[1], -applied * m / m.sum(), tol=1e-14)
        ours.after_optimizer_step(torch.nn.Linear(1, 1), window.result())
        trl.sync()
        assert num(ours.coefficient, trl.coef, 1e-15) and num(ours.last_entropy, trl.last, 1e-12)
        history.append(ours.coefficient)
    assert num(max(history), 0.01) and num(min(history), 0.001)  # both bounds reached
    assert adaptive_entropy_step(0.009, 0.1, 0.25, 0.003, 0.001, 0.01) == 0.01  # capped at the maximum
    assert adaptive_entropy_step(0.002, 0.3, 0.25, 0.003, 0.001, 0.01) == 0.001  # floored at the minimum
    assert adaptive_entropy_step(0.002, 0.25, 0.25, 0.003, 0.0, 0.01) == 0.005  # at the target: up (TRL's <=)
    at_target = get_objective("adaptive_entropy", entropy_coef=0.1, entropy_target=0.25)
    at_target.after_optimizer_step(torch.nn.Linear(1, 1), {"entropy_kept_mean": 0.25})
    assert at_target.entropy_bonus_coef() == at_target.coefficient > 0.1  # and the bonus acts (<=)


def test_adaptive_entropy_defaults_are_trls():
    """The controller's defaults are the installed TRL GRPOConfig's (entropy_target, its bounds and step, the starting
    coefficient) and its policy loss TRL's default clip (epsilon 0.2, epsilon_high = epsilon) with token-mean
    aggregation (TRL's default loss_type dapo)."""
    import dataclasses

    from trl import GRPOConfig

    trl = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    ours = get_objective("adaptive_entropy").hyperparameters()
    for name in ("entropy_target", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_coef"):
        assert ours[name] == trl[name], name
    assert ours["clip_low"] == ours["clip_high"] == trl["epsilon"] and trl["epsilon_high"] is None
    assert ours["aggregation"] == "token_mean" and trl["loss_type"] == "dapo"


def test_adaptive_entropy_with_top_entropy_masking_measures_the_kept_tokens_as_trl():
    """With top_entropy_quantile < 1 TRL's controller measures the mean entropy over mask * entropy_mask
    (get_high_entropy_mask: entropy >= the (1 - q) quantile of the valid tokens' entropies), as its bonus acts on."""
    batch = group_batch(seed=3)
    batch.entropy = torch.rand(batch.logp.shape, generator=torch.Generator().manual_seed(3), dtype=DT)
    ours = get_objective("adaptive_entropy", entropy_coef=0.01, top_entropy_quantile=0.4)
    out = ours(batch)
    valid = batch.entropy[batch.mask]
    kept = (batch.entropy * batch.mask >= torch.quantile(valid, 0.6)) & batch.mask
    world = ((batch.entropy * kept).sum() / kept.sum()).item()
    assert 0 < kept.sum() < batch.mask.sum() and not num(world, valid.mean())
    assert num(out.metrics["entropy_kept_mean"], world, 1e-12)
    ours.after_optimizer_step(torch.nn.Linear(1, 1), out.metrics)
    assert num(ours.last_entropy, world, 1e-12)


def test_adaptive_entropy_starts_without_a_bonus_and_its_state_round_trips():
    fresh = get_objective("adaptive_entropy", entropy_coef=0.5)
    assert fresh.entropy_bonus_coef() == 0.0 and fresh.entropy_need() == "gradient"  # no measurement yet: inf
    fresh.after_optimizer_step(torch.nn.Linear(1, 1), {"entropy_kept_mean": 0.1})
    assert fresh.entropy_bonus_coef() == 0.505
    other = get_objective("adaptive_entropy", entropy_coef=0.5)
    other.load_state_dict(fresh.state_dict())
    assert other.state_dict() == fresh.state_dict() == {"coefficient": 0.505, "last_entropy": 0.1}
    with pytest.raises(ValueError, match="entropy_coef_min .* must be <= entropy_coef_max"):
        get_objective("adaptive_entropy", entropy_coef_min=0.5, entropy_coef_max=0.1)


# ----------------------------------------------------------------------------------------------------
# Adaptive KL coefficient (verl AdaptiveKLController)
# ----------------------------------------------------------------------------------------------------

class VerlAdaptiveKL:
    """verl-project/verl 1dda039b verl/trainer/ppo/core_algos.py AdaptiveKLController, written out."""

    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl, n_steps):
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def test_adaptive_kl_follows_verls_controller_and_weights_the_kl_term():
    ours = get_objective("adaptive_kl", beta=0.02, kl_target=0.05, kl_horizon=200)
    verl = VerlAdaptiveKL(0.02, 0.05, 200)
    batch = group_batch()
    for current_kl, sequences in [(0.3, 64), (0.06, 64), (0.04, 32), (0.0, 64), (0.05, 16), (1e-3, 128)]:
        out = ours(batch)
        plain = get_objective("grpo")(batch).loss
        kl = aggregate(reference_kl(batch, "k3"), batch, "seq_mean_token_mean", correct=False)
        assert num(out.loss, plain + verl.value * kl, 1e-12) and out.metrics["adaptive_kl_coef"] == verl.value
        assert_close(grad_of(out.loss, batch), grad_of(plain + verl.value * kl, batch), tol=1e-12)
        ours.after_update({"kl_ref": current_kl}, sequences)
        verl.update(current_kl, sequences)
        assert num(ours.coefficient, verl.value, 1e-15)
    assert adaptive_kl_step(1.0, 10.0, 10, 0.1, 100) == pytest.approx(1.02)  # error clipped at +0.2
    assert adaptive_kl_step(1.0, 0.0, 10, 0.1, 100) == pytest.approx(0.98)  # and at -0.2


def test_adaptive_kl_state_round_trips_and_beta_zero_stays_zero():
    moved = get_objective("adaptive_kl")
    moved.after_update({"kl_ref": 1.0}, 64)
    other = get_objective("adaptive_kl")
    other.load_state_dict(moved.state_dict())
    assert other.reference_kl_coef() == moved.reference_kl_coef() == 0.001 * (1 + 0.2 * 64 / 10000)
    off = get_objective("adaptive_kl", beta=0.0)
    off.after_update({}, 64)  # no KL term, no kl_ref: nothing to adapt
    assert off.reference_kl_coef() == 0.0
    with pytest.raises(ValueError, match="kl_horizon must be > 0"):
        get_objective("adaptive_kl", kl_horizon=0)


# ----------------------------------------------------------------------------------------------------
# Trust-region masking (verl compute_rollout_rejection_mask's k2 / k3 rules, verl-project/verl 1dda039b)
# ----------------------------------------------------------------------------------------------------

def verl_rejection_mask(log_ratio, response_mask, options, thresholds):
    """verl's compute_rollout_rejection_mask for its k2 / k3 options, written out: every option must pass."""
    safe = torch.clamp(log_ratio, min=-20.0, max=20.0)
    stats = {"k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    m = response_mask.to(log_ratio.dtype)
    combined = torch.ones_like(m)
    for option, upper in zip(options, thresholds, strict=True):
        level, kind = option.rsplit("_", 1)
        token = stats[kind]
        if level == "token":
            keep = token <= upper
        else:
            if level == "seq_sum":
                seq = (token * m).sum(-1)
            elif level == "seq_mean":
                seq = (token * m).sum(-1) / (m.sum(-1) + 1e-8)
            else:
                vals = token.masked_fill(~response_mask.bool(), float("-inf")).max(dim=-1).values
                seq = torch.where(vals == float("-inf"), torch.zeros_like(vals), vals)
            keep = (seq <= upper).unsqueeze(-1).expand_as(m)
        combined = combined * keep.to(m.dtype)
    return (m * combined).bool()


def rejection_inputs():
    """Log-ratios d = old - sampler (garbage on padding) that reach each rule: row 0 near 0 everywhere (kept by all),
    row 1 one spike d = -2.2 (k2 = 2.42 past the veto's 2, its k3 mean 0.33 within 0.35), row 2 a steady drift (the
    sum and mean rules at tight bounds), row 3 a ratio of 0.2, row 4 a ratio past exp(20) (clamped, dropped by all)."""
    d = torch.tensor([[0.01, -0.02, 0.015, 0.0, 0.0], [0.02, -2.2, -0.01, 0.0, 0.0], [0.3, 0.25, 0.35, 0.3, 0.28],
                      [-0.01, L(0.2), 0.02, 0.01, 0.0], [25.0, 0.0, 0.01, 0.0, 0.0]], dtype=DT)
    mask = torch.arange(5)[None, :] < torch.tensor([3, 4, 5, 4, 3])[:, None]
    d[~mask] = 7.0  # garbage
    sampler = -torch.rand(5, 5, generator=torch.Generator().manual_seed(0), dtype=DT) - 0.5
    return sampler + d, sampler, mask


@pytest.mark.parametrize("rules,bounds", [
    (["token_k3"], [0.5]), (["token_k2"], [0.5]), (["seq_sum_k3"], [0.15]), (["seq_sum_k2"], [0.15]),
    (["seq_mean_k3"], [0.02]), (["seq_mean_k2"], [0.02]), (["seq_max_k3"], [0.5]), (["seq_max_k2"], [0.5]),
    (["seq_mean_k3", "seq_max_k2"], [0.02, 2.0]),  # the paper's average + veto
    (["token_k2", "seq_sum_k3"], [1.0]),  # one bound for both
    (["token_k2"], [250.0]),  # row 4's d = 25 counts as 20 (verl's clamp): k2 200, kept
])
def test_trust_region_rules_match_verl(rules, bounds):
    from objectives.rollout_correction import rejection_keep

    old, sampler, mask = rejection_inputs()
    ours = rejection_keep(old, sampler, mask, rules, bounds)
    theirs = verl_rejection_mask(old - sampler, mask, rules, bounds * len(rules) if len(bounds) == 1 else bounds)
    assert torch.equal(ours, theirs)
    assert ours[0, :3].all() and not ours.all() and not (ours & ~mask).any()


def test_trust_region_masking_weights_the_loss_and_is_checked_before_a_run(tmp_path):
    from omegaconf import OmegaConf

    from harness.loop.behaviour import rollout_correction
    from harness.run.offpolicy import behaviour_logp

    old, sampler, mask = rejection_inputs()
    t = OmegaConf.create({"old_logp": "sampler", "routing_replay": "none", "rollout_correction": {
        "mode": "none", "threshold": 2.0, "threshold_lower": None, "rejection": ["seq_mean_k3", "seq_max_k2"],
        "rejection_threshold": [0.35, 2.0]}})  # the paper's average + veto: row 1 goes by the veto alone
    weights, metrics = rollout_correction(t, old, sampler, mask)
    kept = weights.bool().any(-1).tolist()
    assert kept == [True, False, True, True, False] and torch.equal(weights, (mask & weights.bool()).to(DT))
    assert num(metrics["rollout_corr_rejected_seq_frac"], 2 / 5) and behaviour_logp(t) == "recompute"
    assert num(metrics["rollout_corr_rejected_frac"], (4 + 3) / 19)
    t.rollout_correction.rejection, t.rollout_correction.rejection_threshold = ["seq_mean_k3"], [0.35]
    assert rollout_correction(t, old, sampler, mask)[0].bool().any(-1).tolist() == [True, True, True, True, False]
    t.rollout_correction.mode = "token_truncate"  # with importance weights: the rules' zeros on top of them
    truncated, _ = rollout_correction(t, old, sampler, mask)
    assert truncated[0, 0] == math.exp(old[0, 0] - sampler[0, 0]) and (truncated[4] == 0).all()
    for rules, bounds, problem in [(["seq_max_k1"], [1.0], "unknown rule 'seq_max_k1'"),
                                   (["token_k3", "seq_sum_k3"], [1.0, 2.0, 3.0], "one bound for all rules"),
                                   (["token_k3"], [0.0], "positive finite bounds"),
                                   # the tighter of the two alone, under a run id of its own (the thirteenth pass)
                                   (["token_k3", "token_k3"], [0.1, 0.5], "lists token_k3 more than once: a token "
                                    "must pass every rule, so a repeated rule is its tightest bound alone")]:
        with pytest.raises(ConfigError, match=problem):
            run_configs(load_experiment("base", [f"train.rollout_correction.rejection={rules}",
                                                 f"train.rollout_correction.rejection_threshold={bounds}",
                                                 f"results_dir={tmp_path}"]))
    with pytest.raises(ConfigError, match="^backend trl: train.rollout_correction.rejection"):
        run_configs(load_experiment("base", ["backend=trl", "train.rollout_correction.rejection=[token_k3]",
                                             "train.rollout_correction.rejection_threshold=[1.0]",
                                             f"results_dir={tmp_path}"]))
