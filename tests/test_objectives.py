"""Objectives: hand-computed losses and gradients, equivalences, clipping, padding, micro-batching, errors.

Expected numbers are written out from the formulas with ``math`` on scalars, never by calling the code
under test. Tensors are float64; ``logp`` is a leaf and gradients are taken w.r.t. it.
"""

import ast
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import objectives
from objectives import (
    Objective,
    PolicyBatch,
    UnknownNameError,
    aggregate,
    available_objectives,
    get_advantage,
    get_objective,
    register_objective,
)
from objectives.base import AGGREGATIONS, sum_statistics
from objectives.grpo import GRPO
from tests.helpers.objectives import (
    ADV,
    DT,
    GROUPS,
    MASK,
    OLD,
    ON_BATCHES,
    D,
    approx,
    assert_close,
    group_batch,
    make_batch,
    minibatch_counts,
    num,
    random_batch,
    run,
    sig,
)

E = math.exp
ALL = ON_BATCHES
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------
# Hand-computed loss and gradient, one test per objective
# ----------------------------------------------------------------------------------------------------

def test_grpo_hand():
    out, grad = run("grpo", make_batch(OLD, D, MASK, ADV))
    # seq 0 (A=1): r = e^.1, e^.3 (> 1.2: clipped, loss -1.2, no gradient), e^-.1
    # seq 1 (A=-.5): r = e^-.4 (< .8: clipped, loss .5*.8), e^.2 (above 1.2 but A<0: unclipped)
    seq0 = (-E(0.1) - 1.2 - E(-0.1)) / 3
    seq1 = (0.5 * 0.8 + 0.5 * E(0.2)) / 2
    assert num(out.loss, (seq0 + seq1) / 2)
    assert_close(grad, [[-E(0.1) / 6, 0.0, -E(-0.1) / 6], [0.0, 0.5 * E(0.2) / 4, 0.0]])
    m = out.metrics
    assert num(m["clip_frac_high"], 1 / 5) and num(m["clip_frac_low"], 1 / 5) and num(m["clip_frac"], 2 / 5)
    assert approx(m["ratio_max"], E(0.3)) and approx(m["ratio_min"], E(-0.4))
    assert approx(m["ratio_mean"], (E(0.1) + E(0.3) + E(-0.1) + E(-0.4) + E(0.2)) / 5)
    assert num(m["kl_behavior"], -(0.1 + 0.3 - 0.1 - 0.4 + 0.2) / 5)
    assert approx(m["kl_behavior_k3"], sum(E(d) - 1 - d for d in (0.1, 0.3, -0.1, -0.4, 0.2)) / 5)
    assert "kl_ref" not in m


def test_dapo_hand():
    out, grad = run("dapo", make_batch(OLD, D, MASK, ADV))
    # clip 0.2 / 0.28: e^.3 = 1.35 > 1.28 clipped; e^-.4 < .8 clipped (A<0); token-mean over 5 tokens
    assert num(out.loss, (-E(0.1) - 1.28 - E(-0.1) + 0.5 * 0.8 + 0.5 * E(0.2)) / 5)
    assert_close(grad, [[-E(0.1) / 5, 0.0, -E(-0.1) / 5], [0.0, 0.5 * E(0.2) / 5, 0.0]])
    assert num(out.metrics["clip_frac"], 2 / 5)


def test_dr_grpo_hand():
    out, grad = run("dr_grpo", make_batch(OLD, D, MASK, ADV, max_completion_len=4))
    # token sum / (B * max_completion_len) = / 8, clip 0.2 / 0.2
    assert num(out.loss, (-E(0.1) - 1.2 - E(-0.1) + 0.5 * 0.8 + 0.5 * E(0.2)) / 8)
    assert_close(grad, [[-E(0.1) / 8, 0.0, -E(-0.1) / 8], [0.0, 0.5 * E(0.2) / 8, 0.0]])
    with pytest.raises(ValueError, match="max_completion_len"):
        run("dr_grpo", make_batch(OLD, D, MASK, ADV, max_completion_len=None))


def test_gspo_hand():
    out, grad = run("gspo", make_batch(OLD, D, MASK, ADV), clip_low=0.1, clip_high=0.1)
    s0, s1 = E(0.1), E(-0.1)  # sequence ratios exp(mean d): mean d = 0.1 and -0.1
    # s0 = 1.105 > 1.1 with A > 0: clipped (whole sequence, no gradient); s1 = 0.905 >= 0.9: unclipped
    assert num(out.loss, (-1.1 + 0.5 * s1) / 2)
    assert_close(grad, [[0.0, 0.0, 0.0], [0.5 * s1 / 4, 0.5 * s1 / 4, 0.0]])
    assert num(out.metrics["clip_frac_high"], 3 / 5) and num(out.metrics["clip_frac_low"], 0.0)
    assert approx(out.metrics["ratio_max"], s0) and approx(out.metrics["ratio_min"], s1)
    assert approx(out.metrics["ratio_mean"], (s0 + s1) / 2)


def test_gspo_token_hand_per_token_advantages():
    adv = [[1.0, -1.0, 2.0], [0.5, -0.5, 0.0]]
    out, grad = run("gspo_token", make_batch(OLD, D, MASK, adv), clip_low=0.1, clip_high=0.1)
    s0, s1 = E(0.1), E(-0.1)  # every token carries its sequence's ratio
    # seq 0: s0 > 1.1 -> tokens with A > 0 clipped (-1.1 A, no grad); the A = -1 token is not
    seq0 = (-1.1 * 1.0 + s0 * 1.0 - 1.1 * 2.0) / 3
    seq1 = (-0.5 * s1 + 0.5 * s1) / 2
    assert num(out.loss, (seq0 + seq1) / 2)
    assert_close(grad, [[0.0, s0 / 6, 0.0], [-0.5 * s1 / 4, 0.5 * s1 / 4, 0.0]])
    assert num(out.metrics["clip_frac_high"], 2 / 5) and num(out.metrics["clip_frac_low"], 0.0)


def test_cispo_hand():
    d = [[0.1, 2.0, -0.1], [-3.0, 0.2, 7.0]]
    batch = make_batch(OLD, d, MASK, ADV)
    out, grad = run("cispo", batch)
    # weights: r, capped at 1 + 4 = 5 (e^2 = 7.39 -> 5), no lower bound (e^-3 kept)
    w = [[E(0.1), 5.0, E(-0.1)], [E(-3.0), E(0.2)]]
    logp = [[-0.9, 0.0, -0.6], [-4.5, -0.5]]
    adv = [1.0, -0.5]
    total = sum(-w[i][t] * adv[i] * logp[i][t] for i in range(2) for t in range(len(w[i])))
    assert num(out.loss, total / 5)
    assert_close(grad, [[-w[0][0] / 5, -5.0 / 5, -w[0][2] / 5], [0.5 * w[1][0] / 5, 0.5 * w[1][1] / 5, 0.0]])
    assert num(out.metrics["clip_frac_high"], 1 / 5) and num(out.metrics["clip_frac_low"], 0.0)
    assert approx(out.metrics["ratio_max"], E(2.0))


def test_sapo_hand():
    out, grad = run("sapo", make_batch(OLD, D, MASK, ADV))
    r0, r1 = [E(0.1), E(0.3), E(-0.1)], [E(-0.4), E(0.2)]

    def gate(r, tau):
        return sig(tau * (r - 1)) * 4 / tau

    def weight(r, tau):
        s = sig(tau * (r - 1))
        return 4 * s * (1 - s) * r

    seq0 = sum(-gate(r, 1.0) * 1.0 for r in r0) / 3  # A > 0: tau_pos = 1
    seq1 = sum(-gate(r, 1.05) * -0.5 for r in r1) / 2  # A < 0: tau_neg = 1.05
    assert num(out.loss, (seq0 + seq1) / 2)
    expected = [[-weight(r, 1.0) / 6 for r in r0], [0.5 * weight(r, 1.05) / 4 for r in r1] + [0.0]]
    assert_close(grad, expected)
    m = out.metrics
    assert m["clip_frac"] == m["clip_frac_low"] == m["clip_frac_high"] == 0.0
    weights = [weight(r, 1.0) for r in r0] + [weight(r, 1.05) for r in r1]
    assert approx(m["gate_weight_mean"], sum(weights) / 5) and approx(m["gate_weight_min"], min(weights))


def test_gmpo_hand():
    d = [[0.1, 0.6, -0.7], [-0.5, 0.5, 7.0]]
    out, grad = run("gmpo", make_batch(OLD, d, MASK, ADV))
    # A > 0: d clipped from above at 0.4 only; A < 0: from below at -0.4 only
    rho0 = E((0.1 + 0.4 - 0.7) / 3)
    rho1 = E((-0.4 + 0.5) / 2)
    assert num(out.loss, (-rho0 + 0.5 * rho1) / 2)
    assert_close(grad, [[-rho0 / 6, 0.0, -rho0 / 6], [0.0, 0.5 * rho1 / 4, 0.0]])
    assert num(out.metrics["clip_frac_high"], 1 / 5) and num(out.metrics["clip_frac_low"], 1 / 5)
    assert approx(out.metrics["ratio_min"], rho0) and approx(out.metrics["ratio_max"], rho1)


@pytest.mark.parametrize("step,p", [(0, 2.0), (1, 1.0), (2, 0.0), (3, -1.0), (4, -2.0), (9, -2.0)])
def test_holder_hand(step, p):
    old = [[-1.0, -2.0, -0.5], [-1.5, -0.7, 9.0], [-1.0, -1.0, -1.0]]
    d = [[0.1, 0.3, -0.1], [-0.4, 0.2, 7.0], [0.5, 0.6, 0.7]]
    mask = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    adv = [1.0, -0.5, 2.0]
    out, grad = run("holder", make_batch(old, d, mask, adv, step=step, total_steps=4))
    assert num(out.metrics["holder_p"], p)
    loss, expected = 0.0, [[0.0] * 3 for _ in range(3)]
    for i, length in enumerate([3, 2, 3]):
        r = [E(x) for x in d[i][:length]]
        if p == 0:
            rho, share = E(sum(d[i][:length]) / length), [1 / length] * length
        else:
            powers = [x**p for x in r]
            rho, share = (sum(powers) / length) ** (1 / p), [x / sum(powers) for x in powers]
        clipped = (adv[i] > 0 and rho > 1.2) or (adv[i] < 0 and rho < 0.8)
        loss += max(-adv[i] * rho, -adv[i] * min(max(rho, 0.8), 1.2)) / 3
        for t in range(length):
            expected[i][t] = 0.0 if clipped else -adv[i] * rho * share[t] / 3
    # sequence 2 (all ratios >= e^.5 = 1.65) is clipped for every p; sequences 0 and 1 are not
    assert num(out.loss, loss)
    assert_close(grad, expected)
    assert num(out.metrics["clip_frac_high"], 3 / 8) and num(out.metrics["clip_frac_low"], 0.0)


def test_holder_large_ratios_stay_finite():
    d = [[60.0, -60.0, 0.0], [80.0, 1.0, 7.0]]
    for step in (0, 4):  # p = 2 and p = -2
        out, grad = run("holder", make_batch(OLD, d, MASK, [-1.0, -1.0], step=step, total_steps=4))
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all()


def test_ctpo_hand():
    old = [[-1.0, -2.0, -0.5, 3.0], [-1.5, -0.7, -0.2, 3.0]]
    d = [[0.02, 0.03, 0.05, 5.0], [-0.03, 0.01, 0.12, 5.0]]
    mask = [[1, 1, 1, 0], [1, 1, 1, 0]]
    out, grad = run("ctpo", make_batch(old, d, mask, [1.0, -1.0]))
    r3 = math.sqrt(3)
    # seq 0 (A=1): prefix sums .02, .05, .10; upper bounds .05 sqrt(n) = .05, .0707, .0866 -> token 3 clipped
    # seq 1 (A=-1): prefix sums -.03, -.02, .10; lower bound -.025 at n=1 -> token 1 clipped (low);
    #   token 3: rho = e^.1 > dual bound e^(.05 sqrt 3) -> dual clip, loss e^(.05 sqrt 3), no gradient
    per_token = [-E(0.02), -E(0.05), -E(0.05 * r3), E(-0.025), E(-0.02), E(0.05 * r3)]
    assert num(out.loss, sum(per_token) / 6)
    assert_close(grad, [[-E(0.02) / 6, -E(0.05) / 6, 0.0, 0.0], [0.0, E(-0.02) / 6, 0.0, 0.0]])
    m = out.metrics
    for key in ("clip_frac_low", "clip_frac_high", "clip_frac_dual"):
        assert num(m[key], 1 / 6), key
    assert num(m["clip_frac"], 3 / 6)
    prefix = [E(0.02), E(0.05), E(0.10), E(-0.03), E(-0.02), E(0.10)]
    assert approx(m["ratio_max"], max(prefix)) and approx(m["ratio_mean"], sum(prefix) / 6)


def test_conspo_hand():
    #   group 0: pos, neg, neg (A = 0 counts as negative) | group 1: pos, pos (no negative)
    #   group 2: neg, neg (no positive)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    adv = [1.0, -0.5, 0.0, 0.7, 0.7, -0.2, 0.0]
    g = torch.Generator().manual_seed(0)
    old = (-torch.rand(7, 3, generator=g, dtype=DT)).tolist()
    d = (0.1 * torch.randn(7, 3, generator=g, dtype=DT)).tolist()
    mask = [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
    batch = make_batch(old, d, mask, adv, group_ids=groups, step=1, total_steps=2)
    tau, m = 0.5, 0.1  # linear margin 0 -> 0.2, halfway
    out, grad = run("conspo", batch, temperature=tau, margin_start=0.0, margin_end=0.2)
    lengths = [3, 2, 1]
    s = [sum(old[i][t] + d[i][t] for t in range(lengths[i])) / lengths[i] for i in range(3)]
    e1, e2 = E((s[1] - s[0] + m) / tau), E((s[2] - s[0] + m) / tau)
    assert num(out.loss, math.log(1 + e1 + e2) / 7)
    q = 1 / (1 + e1 + e2)  # InfoNCE probability of the positive
    ds = [-(1 - q) / tau, e1 * q / tau, e2 * q / tau]  # d l / d s_i
    expected = torch.zeros(7, 3, dtype=DT)
    for i in range(3):
        expected[i, : lengths[i]] = ds[i] / lengths[i] / 7
    assert_close(grad, expected)  # groups 1 and 2 (all positive / all negative): exactly zero
    assert approx(out.metrics["conspo_margin"], m) and approx(out.metrics["conspo_pos_prob"], q)
    assert approx(out.metrics["conspo_contrast_frac"], 1 / 7) and out.metrics["clip_frac"] == 0.0


def test_conspo_two_positives_and_schedules():
    groups = torch.tensor([0, 0, 0])
    old = [[-1.0, -2.0], [-0.5, -0.5], [-3.0, -1.0]]
    batch = make_batch(old, [[0.0, 0.0]] * 3, [[1, 1]] * 3, [1.0, 1.0, -2.0], group_ids=groups)
    out, _ = run("conspo", batch, temperature=1.0, margin_start=0.3, margin_end=0.0, schedule="constant")
    s = [-1.5, -0.5, -2.0]
    expected = (math.log(1 + E(s[2] - s[0] + 0.3)) + math.log(1 + E(s[2] - s[1] + 0.3))) / 3
    assert num(out.loss, expected)
    obj = get_objective("conspo", margin_start=0.0, margin_end=1.0, schedule="cosine")
    margins = [obj.margin(make_batch(old, old, [[1, 1]] * 3, [0.0] * 3, step=k, total_steps=4))
               for k in range(6)]
    c = math.cos(math.pi / 4)
    assert_close(torch.tensor(margins, dtype=DT), [0.0, (1 - c) / 2, 0.5, (1 + c) / 2, 1.0, 1.0])


def test_conspo_needs_group_ids():
    with pytest.raises(ValueError, match="group_ids"):
        run("conspo", make_batch(OLD, D, MASK, ADV))
    assert get_objective("conspo").needs_whole_groups


# ----------------------------------------------------------------------------------------------------
# Equivalences and exact-gradient properties
# ----------------------------------------------------------------------------------------------------


def test_on_policy_grpo_gspo_gspo_token_same_gradient():
    batch = random_batch(seed=1, scale=0.0)  # old_logp == logp
    grads = [run(name, batch)[1] for name in ("grpo", "gspo", "gspo_token")]
    expected = -batch.advantages[:, None] / (batch.lengths[:, None] * 8) * batch.mask
    for grad in grads:
        assert_close(grad, expected, tol=1e-12)


@pytest.mark.parametrize("scale", [0.0, 1e-4, 1e-3, 0.3])
def test_gspo_token_equals_gspo_with_sequence_advantages(scale):
    batch = random_batch(seed=2, scale=scale)
    (a, ga), (b, gb) = run("gspo", batch), run("gspo_token", batch)
    assert num(a.loss, b.loss, 1e-12)
    assert_close(ga, gb, tol=1e-12)
    for key in ("clip_frac", "clip_frac_low", "clip_frac_high"):
        assert num(a.metrics[key], b.metrics[key])
    if scale == 1e-3:  # the clip is active on some sequences, not all
        assert 0 < a.metrics["clip_frac"] < 1


def test_ctpo_gradient_only_through_current_token_and_prefix_product_value():
    batch = random_batch(seed=3, scale=0.2, per_sequence=False)
    wide = {"clip_low": 50.0, "clip_high": 50.0, "dual_clip": 50.0}  # nothing clipped
    out, grad = run("ctpo", batch, **wide)
    d = (batch.logp - batch.old_logp).detach()
    n = batch.mask.sum().item()
    prefix = torch.zeros_like(d)
    for i in range(d.shape[0]):
        for t in range(int(batch.lengths[i])):
            prefix[i, t] = math.prod(math.exp(x) for x in d[i, : t + 1].tolist())
    adv = batch.advantages
    assert_close(grad, torch.where(batch.mask, -adv * prefix / n, 0.0), tol=1e-9)
    assert num(out.loss, (torch.where(batch.mask, -adv * prefix, 0.0).sum() / n).item(), 1e-9)
    valid = prefix[batch.mask]
    assert approx(out.metrics["ratio_max"], valid.max().item())
    assert approx(out.metrics["ratio_min"], valid.min().item())
    assert approx(out.metrics["ratio_mean"], valid.mean().item())
    assert out.metrics["clip_frac"] == 0.0


def test_ctpo_log_ratio_cap_removes_and_counts_the_gradient():
    # windows wider than the cap at 10: the cap alone stops the gradient, and it is counted
    d = [[6.0, 6.0, 0.0], [6.0, 6.0, 7.0]]  # prefix sums 6, 12 (capped at 10) | 6, 12
    wide = {"clip_low": 20.0, "clip_high": 20.0, "dual_clip": 20.0}
    out, grad = run("ctpo", make_batch(OLD, d, MASK, ADV), **wide)
    assert_close(grad, [[-E(6.0) / 5, 0.0, 0.0], [0.5 * E(6.0) / 5, 0.0, 0.0]])  # token 3 of seq 0: prefix 12
    m = out.metrics
    assert num(m["clip_frac_high"], 2 / 5) and num(m["clip_frac_dual"], 1 / 5) and num(m["clip_frac"], 3 / 5)
    assert approx(m["ratio_max"], E(10.0))
    # ctpo_clip caps at the same 10: past its ratio window the cap changes no loss, only the ratio it reports
    out, grad = run("ctpo_clip", make_batch(OLD, d, MASK, ADV))
    assert_close(grad, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert approx(out.metrics["ratio_max"], E(10.0))


def test_sapo_gradient_weight_is_one_on_policy():
    batch = random_batch(seed=4, scale=0.0)
    out, grad = run("sapo", batch, tau_pos=0.7, tau_neg=2.5)
    assert_close(grad, -batch.advantages[:, None] / (batch.lengths[:, None] * 8) * batch.mask, tol=1e-12)
    assert approx(out.metrics["gate_weight_mean"], 1.0) and out.metrics["gate_soft_clip_frac"] == 0.0


def test_sapo_clamps_the_log_ratio_at_20():
    d = [[25.0, 0.1, -25.0], [-0.4, 0.2, 7.0]]  # tokens 0 and 2 of seq 0 past verl's +-20 clamp
    out, grad = run("sapo", make_batch(OLD, d, MASK, ADV))
    r0 = [E(20.0), E(0.1), E(-20.0)]  # the clamped ratios

    def gate(r, tau):
        return sig(tau * (r - 1)) * 4 / tau

    seq1 = sum(-gate(r, 1.05) * -0.5 for r in (E(-0.4), E(0.2))) / 2
    assert num(out.loss, (sum(-gate(r, 1.0) for r in r0) / 3 + seq1) / 2)
    assert grad[0, 0] == 0.0 and grad[0, 2] == 0.0  # past the clamp: exactly no gradient
    assert grad[0, 1] != 0.0
    assert approx(out.metrics["ratio_max"], E(20.0)) and approx(out.metrics["ratio_min"], E(-20.0))


def test_cispo_weight_carries_no_gradient():
    batch = random_batch(seed=5, scale=0.5, per_sequence=False)
    out, grad = run("cispo", batch, clip_low=0.2, clip_high=0.3)
    r = torch.exp(batch.logp - batch.old_logp).detach()
    w = r.clamp(0.8, 1.3)
    n = batch.mask.sum()
    assert_close(grad, torch.where(batch.mask, -w * batch.advantages / n, 0.0), tol=1e-12)
    low, high = (r < 0.8) & batch.mask, (r > 1.3) & batch.mask
    assert low.any() and high.any()
    assert num(out.metrics["clip_frac_low"], low.sum().item() / n.item())
    assert num(out.metrics["clip_frac_high"], high.sum().item() / n.item())


def trl_two_sided_dapo_loss(logp, old_logp, advantages, mask, epsilon, epsilon_high, delta):
    """TRL 1.16's clipped loss with ``delta`` set (two-sided GRPO, INTELLECT-2; trl/trainer/grpo_trainer.py
    ``_compute_loss``, loss_type dapo: the token mean), written out from the installed wheel."""
    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
    coef_1 = torch.clamp(coef_1, max=delta)
    per_token = -torch.min(coef_1 * advantages[:, None], coef_2 * advantages[:, None])
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("delta", [1.2, 1.5, 2.0])
def test_trls_delta_is_the_dual_clip_with_clip_ratio_c_delta(delta):
    """TRL's ``delta`` (for delta >= 1 + epsilon_high, as TRL recommends) is grpo's dual clip with clip_ratio_c =
    delta: loss and gradient, with ratios on both sides of every bound (what `explain delta` says)."""
    batch = random_batch(seed=3, scale=0.6, b=24, t=8)
    out, grad = run("dapo", batch, clip_low=0.2, clip_high=0.2, dual_clip=True, clip_ratio_c=delta)
    ratio = torch.exp(batch.logp - batch.old_logp)
    assert ((ratio > delta) & (batch.token_advantages < 0) & batch.mask).any()
    logp = batch.logp.detach().clone().requires_grad_(True)
    expected = trl_two_sided_dapo_loss(logp, batch.old_logp, batch.advantages, batch.mask, 0.2, 0.2, delta)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    assert num(out.loss, expected, 1e-12)
    assert_close(grad, expected_grad, tol=1e-12)
    assert out.metrics["clip_frac_dual"] > 0


# ----------------------------------------------------------------------------------------------------
# Clipping removes exactly the gradients it counts
# ----------------------------------------------------------------------------------------------------

CLIPPED = [("grpo", 0.3, {}), ("dapo", 0.3, {}), ("dr_grpo", 0.3, {}), ("gspo", 1e-3, {}),
           ("gspo_token", 1e-3, {}), ("ctpo", 0.06, {}), ("gmpo", 0.6, {}), ("holder", 0.3, {}),
           ("grpo", 0.6, {"dual_clip": True, "clip_ratio_c": 1.5}), ("dapo", 0.6, {"dual_clip": True}),
           ("dr_grpo", 0.6, {"dual_clip": True, "clip_ratio_c": 1.3}),
           ("ctpo", 0.06, {"ratio_mode": "geomean", "la_power": -0.5}), ("ctpo_clip", 0.1, {}),
           ("ctpo_clip", 0.3, {"ratio_mode": "geomean"}), ("holder", 0.3, {"variant": "sequence_w_clip"}),
           ("holder", 0.3, {"variant": "holder_token"}), ("grpo", 0.3, {"aggregation": "token_mean"}),
           ("dppo_tv", 0.6, {"clip_low": 0.03, "clip_high": 0.03}),
           ("dppo_kl", 0.6, {"clip_low": 0.01, "clip_high": 0.01}),
           ("clip_cov", 0.3, {"clip_low": 0.2, "clip_high": 0.2, "clip_cov_ratio": 0.1, "clip_cov_lb": 0.05}),
           ("m2po", 0.6, {}), ("tbpo", 1e-3, {}), ("bnpo", 0.3, {})]


@pytest.mark.parametrize("name,scale,hp", CLIPPED, ids=[f"{n}-{hp}" for n, _, hp in CLIPPED])
def test_clipping_zeroes_exactly_the_counted_gradients(name, scale, hp):
    batch = random_batch(seed=6, scale=scale, b=24, t=8, step=2, total_steps=4)
    out, grad = run(name, batch, **hp)
    mask, n = batch.mask, batch.mask.sum().item()
    zero = (grad == 0) & mask
    adv = batch.token_advantages
    m = out.metrics
    assert m["clip_frac_low"] > 0 and m["clip_frac_high"] > 0 and m["clip_frac"] < 1  # both sides, not all
    assert num(zero.sum().item() / n, m["clip_frac"])
    assert num((zero & (adv > 0)).sum().item() / n, m["clip_frac_high"])
    assert num((zero & (adv < 0)).sum().item() / n, m["clip_frac_low"] + m.get("clip_frac_dual", 0.0))
    assert (grad[~mask] == 0).all()


# ----------------------------------------------------------------------------------------------------
# Properties of every registered objective
# ----------------------------------------------------------------------------------------------------


def same_metrics(a, b):
    assert a.keys() == b.keys()
    for key in a:
        both_nan = math.isnan(a[key]) and math.isnan(b[key])
        assert both_nan or num(a[key], b[key], 1e-9), (key, a[key], b[key])


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("name", ALL)
def test_padding_changes_nothing(name, beta):
    clean = group_batch()
    padded = group_batch(pad_extra=3, garbage=True)
    (a, ga), (b, gb) = run(name, clean, beta=beta), run(name, padded, beta=beta)
    assert torch.isfinite(a.loss) and num(a.loss, b.loss, 1e-12)
    assert_close(gb[:, :5], ga, tol=1e-12)
    assert (gb[~padded.mask] == 0).all()
    same_metrics(a.metrics, b.metrics)
    assert ("kl_ref" in a.metrics) == (beta > 0)


# objectives with a KL to the behaviour policy in the loss: with A = 0 it still acts off-policy, so they are
# checked on-policy here (tests/test_objectives_family.py checks the off-policy gradient is the KL's alone)
BEHAVIOUR_KL = {"p3o", "kl_cov", "dppo_tv", "dppo_kl", "dro", "ipo"}  # (dppo: only with kl_coef > 0, off by default)
# objectives whose default has a KL to the reference (beta > 0), or whose loss reads the reference (A*-PO's implicit
# reward): checked at the reference (the KL's gradient, the implicit reward, is 0 there)
REFERENCE_KL = {name for name in ALL if get_objective(name).beta > 0 or objectives.OBJECTIVES.get(name).needs_reference}


@pytest.mark.parametrize("name", ALL)
def test_equal_rewards_give_zero_gradient(name):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 1.0], dtype=DT)
    adv = get_advantage("grpo")(rewards, GROUPS)
    batch = group_batch(advantages=adv)
    if name in BEHAVIOUR_KL:
        batch.old_logp = batch.logp.detach().clone()
    if name in REFERENCE_KL:
        batch.ref_logp = batch.logp.detach().clone()
    out, grad = run(name, batch)
    assert (grad == 0).all() and out.loss.item() == 0.0


OBJECTIVE_MODES = [(name, mode) for name in ALL for mode in objectives.OBJECTIVES.get(name).aggregations]
# objectives whose loss selects tokens by a statistic of the whole minibatch (a sort / top-k / random draw): they set
# needs_whole_minibatch and the loop refuses to micro-batch them (harness/run/config.py)
WHOLE_MINIBATCH = {"clip_cov", "kl_cov", "m2po"}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("name,mode", OBJECTIVE_MODES)
def test_micro_batches_with_global_counts_sum_to_the_whole(name, mode, beta):
    """Every objective: micro-batches with the minibatch's counts (and, for objectives with minibatch statistics,
    e.g. P3O's ESS, the statistics summed over the micro-batches as the loop's first pass does) sum to the whole."""
    whole_only = objectives.OBJECTIVES.get(name).needs_whole_minibatch
    assert whole_only == (name in WHOLE_MINIBATCH), f"{name}: needs_whole_minibatch changed"
    if whole_only:
        return
    whole = group_batch()
    out, grad = run(name, whole, beta=beta, aggregation=mode)
    total_loss = 0.0
    objective = get_objective(name, beta=beta, aggregation=mode)
    splits = (slice(0, 4), slice(4, 8)) if objective.needs_whole_groups else (slice(0, 3), slice(3, 4), slice(4, 8))
    parts = []
    for rows in splits:
        width = int(whole.mask[rows].sum(-1).max())
        parts.append(PolicyBatch(
            logp=whole.logp[rows, :width], old_logp=whole.old_logp[rows, :width],
            mask=whole.mask[rows, :width], ref_logp=whole.ref_logp[rows, :width],
            advantages=whole.advantages[rows], rewards=whole.rewards[rows], group_ids=whole.group_ids[rows],
            step=whole.step, total_steps=whole.total_steps, max_completion_len=whole.max_completion_len,
            **minibatch_counts(whole, rows), entropy=whole.entropy[rows, :width]))
    stats = sum_statistics([objective.minibatch_statistics(part) for part in parts])
    assert (stats is not None) == objective.uses_minibatch_statistics() == (name == "p3o")
    for part in parts:
        part.minibatch_stats = stats
        total_loss = total_loss + objective(part).loss
    (micro_grad,) = torch.autograd.grad(total_loss, whole.logp)
    assert num(total_loss, out.loss, 1e-12)
    assert_close(micro_grad, grad, tol=1e-12)


@pytest.mark.parametrize("name", ALL)
def test_every_objective_reports_the_common_metrics_and_has_a_docstring(name):
    out, _ = run(name, group_batch())
    for key in ("clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max",
                "ratio_std", "pg_loss", "kl_behavior"):
        assert key in out.metrics, f"{name}: its metrics lack {key}: report clip_metrics(...) and ratio_metrics(...)"
        assert isinstance(out.metrics[key], float) and math.isfinite(out.metrics[key]), key
    cls = objectives.OBJECTIVES.get(name)
    module = sys.modules[cls.__module__]
    assert re.search(r"arXiv \d{4}\.\d{4,5}", module.__doc__ or ""), (
        f"{name}: its module's docstring must cite the paper (arXiv id), with the formula and the reference "
        "implementation (README.md, Adding an objective)")
    assert cls.default_advantage in objectives.available_advantages()
    assert get_objective(name).hyperparameters() == cls.hyperparameters()


# ----------------------------------------------------------------------------------------------------
# KL term, errors
# ----------------------------------------------------------------------------------------------------

def test_beta_adds_k3_kl_hand_checked():
    ref = [[-1.2, -1.5, -0.5], [-1.0, -0.7, 100.0]]
    logp = [[-0.9, -1.7, -0.6], [-1.9, -0.5]]
    batch = make_batch(OLD, D, MASK, ADV, ref_logp=torch.tensor(ref, dtype=DT))
    plain, plain_grad = run("grpo", batch)
    out, grad = run("grpo", batch, beta=0.1)
    diff = [[ref[i][t] - logp[i][t] for t in range(len(logp[i]))] for i in range(2)]
    k3 = [[E(x) - x - 1 for x in row] for row in diff]
    kl = (sum(k3[0]) / 3 + sum(k3[1]) / 2) / 2  # seq-mean-token-mean, like the policy term
    assert num(out.loss, plain.loss.item() + 0.1 * kl)
    assert num(out.metrics["kl_ref"], (sum(k3[0]) + sum(k3[1])) / 5)
    dk3 = [[-(E(x) - 1) for x in row] for row in diff]  # d k3 / d logp
    kl_grad = [[0.1 * x / 3 / 2 for x in dk3[0]], [0.1 * x / 2 / 2 for x in dk3[1]] + [0.0]]
    assert_close(grad - plain_grad, kl_grad)
    # token-mean objectives aggregate the KL per token
    out, _ = run("dapo", batch, beta=0.1)
    assert num(out.loss, run("dapo", batch)[0].loss.item() + 0.1 * (sum(k3[0]) + sum(k3[1])) / 5)


def test_beta_without_reference_raises():
    with pytest.raises(ValueError, match="ref_logp"):
        run("grpo", make_batch(OLD, D, MASK, ADV), beta=0.04)


def test_unknown_objective_lists_names_and_closest_match():
    with pytest.raises(UnknownNameError) as err:
        get_objective("gpso")
    message = str(err.value)
    assert "Did you mean 'gspo'" in message
    for name in ALL:
        assert name in message
    with pytest.raises(UnknownNameError, match="Did you mean 'conspo'"):
        get_objective("con_spo")


def test_unknown_and_invalid_hyperparameters():
    with pytest.raises(TypeError, match=r"no hyperparameter epsilon.*clip_low=0\.2"):
        get_objective("grpo", epsilon=0.2)
    with pytest.raises(TypeError, match="must be a number"):
        get_objective("dapo", clip_high="0.28")
    with pytest.raises(TypeError, match="must be a string"):
        get_objective("conspo", schedule=1)


@pytest.mark.parametrize("name,hp", [
    ("grpo", {"clip_low": 1.0}), ("dapo", {"clip_low": 1.5}), ("dr_grpo", {"clip_low": 1.0}),
    ("gspo", {"clip_low": 1.0}), ("gspo_token", {"clip_low": 1.0}), ("holder", {"clip_low": 1.0}),
    ("ctpo", {"clip_low": 0.0}), ("ctpo", {"dual_clip": 0.0}), ("sapo", {"tau_pos": 0.0}),
    ("sapo", {"tau_neg": 0.0}), ("conspo", {"temperature": 0.0}), ("conspo", {"schedule": "exp"}),
    ("cispo", {"clip_high": -1.0}), ("gmpo", {"clip_low": -0.1}), ("grpo", {"beta": -0.1}),
    ("holder", {"clip_high": math.inf}), ("conspo", {"margin_end": -0.1}),
])
def test_invalid_hyperparameters_raise_value_error(name, hp):
    with pytest.raises(ValueError, match=next(iter(hp))):
        get_objective(name, **hp)


def test_defaults_are_the_papers():
    expected = {
        "grpo": {"clip_low": 0.2, "clip_high": 0.2}, "dapo": {"clip_low": 0.2, "clip_high": 0.28},
        "dr_grpo": {"clip_low": 0.2, "clip_high": 0.2}, "gspo": {"clip_low": 3e-4, "clip_high": 4e-4},
        "gspo_token": {"clip_low": 3e-4, "clip_high": 4e-4}, "cispo": {"clip_low": 1.0, "clip_high": 4.0},
        "ctpo": {"clip_low": 0.025, "clip_high": 0.05, "dual_clip": 0.05},
        "sapo": {"tau_pos": 1.0, "tau_neg": 1.05}, "gmpo": {"clip_low": 0.4, "clip_high": 0.4},
        "holder": {"p_start": 2.0, "p_end": -2.0, "clip_low": 0.2, "clip_high": 0.2},
    }
    for name, values in expected.items():
        params = get_objective(name).hyperparameters()
        assert params["beta"] == 0.0
        for key, value in values.items():
            assert params[key] == value, (name, key)
    assert objectives.OBJECTIVES.get("dr_grpo").default_advantage == "mean_only"
    assert get_objective("holder", p_end=-3.0).p_end == -3.0  # negative allowed (signed)


def test_sequence_level_objectives_reject_token_advantages():
    batch = make_batch(OLD, D, MASK, [[1.0, 1.0, 1.0], [0.5, 0.5, 0.5]])
    for name in ("gspo", "gmpo", "holder"):
        with pytest.raises(ValueError, match="per-sequence advantages"):
            run(name, batch)
    run("gspo_token", batch)  # the token form accepts them


# ----------------------------------------------------------------------------------------------------
# The library: objective files import only objectives.base / objectives.registry (a variant, such as dapo, also the
# objective whose loss it takes with its own defaults); class conventions declared
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_objective_modules_import_only_the_library(name):
    cls = objectives.OBJECTIVES.get(name)
    path = Path(sys.modules[cls.__module__].__file__)
    tree = ast.parse(path.read_text())
    imported = {"objectives." * bool(node.level) + (node.module or "")
                for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}  # level > 0: relative import
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    parents = {base.__module__ for base in cls.__mro__[1:] if getattr(base, "name", None) in objectives.OBJECTIVES}
    assert {m for m in imported if m.startswith("objectives")} <= {"objectives.base", "objectives.registry", *parents}


def test_class_conventions_are_declared_and_checked():
    for name in ALL:
        cls = objectives.OBJECTIVES.get(name)
        assert cls.default_aggregation in cls.aggregations and set(cls.aggregations) <= set(AGGREGATIONS), name
        assert cls.kl_aggregation in (None, *AGGREGATIONS), name
        assert get_objective(name).aggregation == cls.default_aggregation == cls.hyperparameters()["aggregation"]
        assert cls.below_one | cls.positive | cls.signed | cls.shares <= set(cls.hyperparameters()), name
    with pytest.raises(ValueError, match=r"objective 'bad': unknown aggregation 'token_sum'"):
        @register_objective("bad")
        class Bad(Objective):
            aggregation = "token_sum"
    assert "bad" not in available_objectives()

    @dataclasses.dataclass
    class Floor(Objective):
        eps: float = 0.5
        below_one = frozenset({"eps"})
        positive = frozenset({"eps"})

    assert Floor(eps=0.999).eps == 0.999
    with pytest.raises(ValueError, match=r"hyperparameter eps must be < 1 \(ratio floor 1 - eps > 0\), got 1\.0"):
        Floor(eps=1.0)
    with pytest.raises(ValueError, match=r"hyperparameter eps must be > 0, got 0\.0"):
        Floor(eps=0.0)
    with pytest.raises(ValueError, match=r"hyperparameter eps must be > 0, got -0\.1"):  # not ">= 0": 0 is refused too
        Floor(eps=-0.1)


@pytest.mark.parametrize("name, key", [("kl_cov", "kl_cov_ratio"), ("clip_cov", "clip_cov_ratio")])
def test_a_share_of_the_tokens_above_one_is_refused_before_a_run(name, key):
    """kl_cov's top k of the valid tokens with a share above 1 asked torch.topk for more tokens than there are,
    at the first update, after the run folder was made; clip_cov clamped it to every candidate without a word."""
    assert getattr(get_objective(name, **{key: 1.0}), key) == 1.0  # all tokens: allowed
    with pytest.raises(ValueError, match=rf"objective '{name}': hyperparameter {key} must be <= 1 \(a share of the "
                                         r"valid tokens; 1 is all of them\), got 2\.0"):
        get_objective(name, **{key: 2.0})


@pytest.mark.parametrize(("name", "key"), [("clip_cov", "selection_seed"), ("popo", "noise_seed")])
def test_an_objectives_own_seed_beyond_torchs_is_refused_before_a_run(name, key):
    """A seed of 1e14 made the run folder, then overflowed torch's 64-bit seed at the first update (seed * 1000003 +
    step): an objective's own seeds are in [0, 2**32), as a run's are (Objective.seeds)."""
    assert getattr(get_objective(name, **{key: 2**32 - 1}), key) == 2**32 - 1
    torch.Generator().manual_seed((2**32 - 1) * 1_000_003 + 10**6)  # the largest seed, far into a run: torch's range
    with pytest.raises(ValueError, match=rf"objective '{name}': hyperparameter {key} must be a seed in \[0, 2\*\*32\)"):
        get_objective(name, **{key: 10**14})


# ----------------------------------------------------------------------------------------------------
# Adding an objective: a new module in objectives/ is all it takes
# ----------------------------------------------------------------------------------------------------


class Loss(Objective):
    """A loss for the declaration tests below (unregistered)."""

    def policy_loss(self, batch):
        return aggregate(-batch.logp * batch.token_advantages, batch, self.aggregation), {}


def declared_wrong(case: str):
    """One class a new objective file may declare wrongly, by case (registered as 'wrong' unless the name is the
    fault)."""
    if case == "name":
        register_objective("My Loss")(type("Named", (Loss,), {"__module__": __name__}))
    elif case == "not an Objective":
        register_objective("wrong")(type("Plain", (), {"policy_loss": Loss.policy_loss}))
    elif case == "no policy_loss":
        register_objective("wrong")(type("Empty", (Objective,), {"__module__": __name__}))
    elif case == "no default":
        register_objective("wrong")(type("NoDefault", (Loss,), {"__annotations__": {"scale": "float"},
                                                                "__module__": __name__}))
    elif case == "list":
        register_objective("wrong")(type("Listed", (Loss,), {"__annotations__": {"clips": "list"}, "clips": None,
                                                             "__module__": __name__}))
    elif case == "default of another kind":
        register_objective("wrong")(type("Halves", (Loss,), {"__annotations__": {"steps": "int"}, "steps": 0.5,
                                                             "__module__": __name__}))
    elif case == "no annotation":
        register_objective("wrong")(type("Bare", (Loss,), {"scale": 1.0, "__module__": __name__}))
    elif case == "no docstring":  # a module without one: no formula, no paper, no reference
        sys.modules["undocumented"] = types.ModuleType("undocumented")
        try:
            register_objective("wrong")(type("Silent", (Loss,), {"__module__": "undocumented"}))
        finally:
            del sys.modules["undocumented"]
    elif case == "inherited without annotation":
        register_objective("wrong")(type("Wider", (GRPO,), {"clip_high": 0.28, "__module__": __name__}))


@pytest.mark.parametrize("case, said", [
    ("name", r"objective name 'My Loss': use lower-case letters, digits and _, starting with a letter \(a config "
             r"names it, and so do its runs' folders\)"),
    ("not an Objective", r"objective 'wrong': <class '.*Plain'> is not a subclass of objectives.base.Objective"),
    ("no policy_loss", r"objective 'wrong': Empty defines no policy_loss\(self, batch\) -> \(loss, metrics\)"),
    ("no default", "objective 'wrong': non-default argument 'scale' follows default argument: give every "
                   "hyperparameter a default"),
    ("list", "objective 'wrong': hyperparameter clips is annotated list; a hyperparameter is a float, int, bool or "
             "str"),
    ("default of another kind", r"objective 'wrong': hyperparameter steps's default 0.5 is not an integer, as its "
                                r"annotation int says"),
    ("no annotation", r"objective 'wrong': scale = 1.0 has no annotation, so it is no hyperparameter: write "
                      r"scale: float = 1.0, or ClassVar\[...\] for a constant$"),
    ("inherited without annotation", r"objective 'wrong': clip_high = 0.28 has no annotation, so it is no "
                                     r"hyperparameter \(the inherited hyperparameter keeps its default\): write "
                                     r"clip_high: float = 0.28"),
    ("no docstring", r"objective 'wrong': neither undocumented nor Silent has a docstring; write its formula, its "
                     r"paper \(arXiv id\) and its reference implementation \(repo, path, commit\) in its module's"),
], ids=["name", "not_an_objective", "no_policy_loss", "no_default", "list", "default_kind", "no_annotation",
        "inherited_no_annotation", "no_docstring"])
def test_a_class_declared_wrong_is_refused_when_it_registers_in_one_line(case, said):
    """What a new objective file can get wrong is one line when it registers (so its import names the file and line:
    objectives/registry.py), not an AttributeError or a silent acceptance later; nothing is registered."""
    with pytest.raises((TypeError, ValueError), match=f"^{said}") as refused:
        declared_wrong(case)
    assert "\n" not in str(refused.value)
    assert {"wrong", "My Loss"}.isdisjoint(available_objectives())


def test_a_loss_that_is_not_one_number_is_named():
    """policy_loss must reduce to a scalar: a per-token loss is one line naming the objective and what to use."""
    class PerToken(Loss):
        def policy_loss(self, batch):
            return -batch.logp * batch.token_advantages, {}

    PerToken.name = "per_token"
    batch = PolicyBatch(logp=torch.zeros(2, 3, dtype=DT, requires_grad=True), old_logp=torch.zeros(2, 3, dtype=DT),
                        mask=torch.ones(2, 3, dtype=DT), advantages=torch.tensor([1.0, -1.0], dtype=DT))
    with pytest.raises(ValueError, match=r"^objective 'per_token': policy_loss returned a loss of shape \[2, 3\] "
                                         r"\(Tensor\); reduce it to one number with aggregate or sequence_aggregate"):
        dataclasses.dataclass(PerToken)()(batch)
    assert Loss()(batch).loss.dim() == 0

@pytest.mark.parametrize("output, said", [
    ("loss", r"^objective 'outputs': policy_loss must return \(loss, metrics\), a 0-dim tensor and a dict of floats; "
             r"it returned Tensor$"),
    ("tensor metric", r"^objective 'outputs': metric 'mine' is a Tensor, not a number: report a float \(a tensor's "
                      r"\.item\(\)\)$"),
])
def test_a_loss_without_its_metrics_or_with_a_tensor_metric_is_named(output, said):
    """policy_loss returns (loss, metrics of floats): a bare loss, or a metric left a tensor, is one line at the first
    loss, not "iteration over a 0-d tensor" there or "not JSON serializable" when the step's metrics are written."""
    class Outputs(Loss):
        def policy_loss(self, batch):
            loss = -(batch.logp * batch.token_advantages).sum() / batch.mask.sum()
            return loss if output == "loss" else (loss, {"mine": loss.detach()})

    Outputs.name = "outputs"
    batch = PolicyBatch(logp=torch.zeros(2, 3, dtype=DT, requires_grad=True), old_logp=torch.zeros(2, 3, dtype=DT),
                        mask=torch.ones(2, 3, dtype=DT), advantages=torch.tensor([1.0, -1.0], dtype=DT))
    with pytest.raises(TypeError, match=said):
        dataclasses.dataclass(Outputs)()(batch)


@pytest.mark.parametrize("reads, declared, error, said", [
    ("ref", {}, TypeError, r"if policy_loss reads batch.ref_logp, declare needs_reference = True; if it reads "
                           r"batch.hidden or batch.hidden_of, declare needs_hidden_states = True on its class"),
    ("hidden", {"needs_reference": True}, AttributeError,
     r"'sum'(.|\n)*if policy_loss reads batch.hidden or batch.hidden_of, declare needs_hidden_states = True on its"),
    # both declared, left None by a caller that did not pass them: Python's own error, no note
    ("ref", {"needs_reference": True, "needs_hidden_states": True}, TypeError, r"^unsupported operand[^\n]*$"),
    ("other", {}, TypeError, r"^mine$"),  # a TypeError that is not about None: as it was raised
])
def test_an_input_read_without_its_declaration_names_the_declaration(reads, declared, error, said):
    """The loop passes batch.ref_logp and batch.hidden only to an objective that declares it; one that reads either
    undeclared met Python's NoneType error at its first loss, which did not say what to declare. The error keeps its
    type (an objective's own TypeError subclass is still caught by its type) and gains a note."""
    class Reads(Loss):
        def policy_loss(self, batch):
            if reads == "other":
                raise TypeError("mine")
            extra = (batch.ref_logp - batch.logp).sum() if reads == "ref" else batch.hidden.sum()
            return -(batch.logp * batch.token_advantages).sum() + 0 * extra, {}

    Reads.name = "reads"
    for key, value in declared.items():
        setattr(Reads, key, value)
    batch = PolicyBatch(logp=torch.zeros(2, 3, dtype=DT, requires_grad=True), old_logp=torch.zeros(2, 3, dtype=DT),
                        mask=torch.ones(2, 3, dtype=DT), advantages=torch.tensor([1.0, -1.0], dtype=DT))
    with pytest.raises(error, match=said) as raised:
        dataclasses.dataclass(Reads)()(batch)
    assert type(raised.value) is error


def example_source() -> str:
    """The README's worked example (so the documented code is the tested one); its absence is a failure."""
    section = (REPO / "README.md").read_text().partition("## Adding an objective")[2]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block and "@register_objective" in block.group(1), "README.md lost its worked objective example"
    return block.group(1)


@pytest.mark.slow  # a fresh interpreter importing torch
def test_a_new_module_is_registered_automatically(tmp_path):
    real = sorted(p.name for p in (REPO / "objectives").glob("*.py"))  # a user may have written the README's example
    package = tmp_path / "objectives"
    shutil.copytree(REPO / "objectives", package, ignore=shutil.ignore_patterns("__pycache__"))
    source = example_source()
    name = re.search(r'@register_objective\("(\w+)"\)', source).group(1)
    (package / f"{name}.py").write_text(source)
    script = f"""
import json, torch, objectives
from objectives import PolicyBatch, available_objectives, get_objective
assert objectives.__file__.startswith({str(tmp_path)!r}), objectives.__file__
assert {name!r} in available_objectives(), available_objectives()
logp = torch.zeros(2, 3, requires_grad=True)
mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
batch = PolicyBatch(logp=logp, old_logp=torch.zeros(2, 3), mask=mask, advantages=torch.tensor([1.0, -1.0]))
out = get_objective({name!r})(batch)
out.loss.backward()
assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all() and "clip_frac" in out.metrics
print(json.dumps({{"loss": out.loss.item(), "grad": logp.grad.tolist(), "metrics": out.metrics}}))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    # the example's math, on-policy (ratio 1, default scale 1): loss -mean(A) over 5 tokens, gradient -A/5
    result = json.loads(done.stdout)
    assert num(result["loss"], -(3 - 2) / 5, 1e-6) and result["metrics"]["ratio_mean"] == 1.0
    assert_close(torch.tensor(result["grad"], dtype=DT), [[-0.2] * 3, [0.2, 0.2, 0.0]], tol=1e-6)
    assert sorted(p.name for p in (REPO / "objectives").glob("*.py")) == real  # the real package is untouched
    assert (name in available_objectives()) == (f"{name}.py" in real)  # the README's example, once a user wrote it



BROKEN = {  # a file of a package whose every module is imported, and the line its one line names
    "unclosed.py": ("x = (\n", 1, "SyntaxError: '(' was never closed. Every file in"),
    "twice.py": ("from {pkg}.first import NAMES\n\n\n@NAMES.register('a')\nclass Again:\n    pass\n", 4,
                 "ValueError: thing 'a' is registered twice: by {pkg}.first.First and by {pkg}.twice.Again; give "
                 "one of them another name"),
    "deep.py": ("def load():\n    import no_such_package_here\n\n\nload()\n", 2,
                "ModuleNotFoundError: No module named 'no_such_package_here'"),
}
FIRST = ("from objectives.registry import Registry\nNAMES = Registry('thing')\n\n\n@NAMES.register('a')\n"
         "class First:\n    pass\n")


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_module_that_does_not_import_is_named_with_its_line_in_one_line(tmp_path, monkeypatch, broken):
    """objectives/ imports every file in it: one that fails names itself, the line and the error (a registration
    twice names both classes), chained to the error; the files before it imported as they are."""
    from objectives.registry import ModuleImportError, import_every_module

    pkg = f"pkg_{broken[:-3]}"
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / pkg / "first.py").write_text(FIRST)
    source, line, said = BROKEN[broken]
    (tmp_path / pkg / broken).write_text(source.format(pkg=pkg))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ModuleImportError) as caught:
            import_every_module(pkg, [str(tmp_path / pkg)])
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == pkg]:
            del sys.modules[name]
    message = str(caught.value)
    assert message.startswith(f"{pkg}/{broken}, line {line}: ") and said.format(pkg=pkg) in message, message
    assert message.endswith(f"Every file in {pkg}/ is imported: fix this one, or move it out of the folder (its "
                            f"traceback: python -c 'import {pkg}')")
    assert "\n" not in message and caught.value.__cause__ is not None


def test_a_broken_module_ends_an_entry_point_in_its_one_line(capsys):
    """The CLI's imports under one_line_for_a_broken_module: that error is its line on stderr and status 2; any
    other import error is raised as it is."""
    from harness.run.errors import one_line_for_a_broken_module
    from objectives.registry import ModuleImportError

    with pytest.raises(SystemExit) as ended, one_line_for_a_broken_module():
        raise ModuleImportError("objectives/x.py, line 3: ValueError: no")
    assert ended.value.code == 2 and capsys.readouterr().err == "error: objectives/x.py, line 3: ValueError: no\n"
    with pytest.raises(ImportError, match="other"), one_line_for_a_broken_module():
        raise ImportError("other")


@pytest.mark.slow  # a fresh interpreter importing torch
@pytest.mark.parametrize("command", [["harness", "list"], ["analysis", "."]])
def test_the_cli_names_a_new_objective_file_that_does_not_import(tmp_path, command):
    """`python -m harness` and `python -m analysis` (whose package import the report's imports of the objectives
    once came before its entry point) with a copy of objectives/ holding a file that registers a name again: one
    line naming the file, its line and both classes, status 2, no traceback. (analysis is given a folder that
    exists: a missing one is said before the report's imports.)"""
    package = tmp_path / "objectives"
    shutil.copytree(REPO / "objectives", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "my_grpo.py").write_text("from objectives import register_objective\nfrom objectives.grpo import "
                                        "GRPO\n\n\n@register_objective('grpo')\nclass Mine(GRPO):\n"
                                        "    'GRPO under its own name.'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == ("error: objectives/my_grpo.py, line 5: ValueError: objective 'grpo' is registered twice: "
                           "by objectives.grpo.GRPO and by objectives.my_grpo.Mine; give one of them another name. "
                           "Every file in objectives/ is imported: fix this one, or move it out of the folder (its "
                           "traceback: python -c 'import objectives')\n")

# A pytest plugin for the copy's run: a case parametrized by an objective registered before the new one is left
# out (it ran in this checkout's own suite, and one module more does not change it); every other case runs.
ONLY_THE_NEW_OBJECTIVE = """
def pytest_collection_modifyitems(config, items):
    from objectives import available_objectives

    others = set(available_objectives()) - {{{name!r}}}
    def another_objectives(item):
        spec = getattr(item, "callspec", None)
        return spec is not None and any(isinstance(v, str) and v in others for v in spec.params.values())
    left_out = [item for item in items if another_objectives(item)]
    items[:] = [item for item in items if not another_objectives(item)]
    config.hook.pytest_deselected(items=left_out)
"""
REGISTRY_WIDE = ("OBJECTIVES.names()", "available_objectives()")  # a test file naming these runs over every objective
COPIED = ("analysis", "harness", "objectives", "tests", "experiments")  # besides README.md, pyproject.toml, docs/*.md


@pytest.mark.slow  # a pytest of its own over the registry-wide test files
def test_a_new_module_alone_passes_the_registry_wide_fast_tests(tmp_path):
    """One file, really: the README's example dropped into a copy of the checkout, and every fast test that runs over
    the whole registry (the test files naming OBJECTIVES.names() or available_objectives()) passes on it, with no
    other edit (no table to regenerate, no list to extend)."""
    copy = tmp_path / "checkout"
    for folder in COPIED:
        shutil.copytree(REPO / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("README.md", "pyproject.toml", "Makefile", "mkdocs.yml"):
        shutil.copy(REPO / name, copy / name)
    shutil.copytree(REPO / "docs", copy / "docs", ignore=shutil.ignore_patterns("__pycache__"))  # and hooks.py
    if (REPO / ".venv").is_dir():  # the Makefile's targets run .venv/bin/python (tests call `make -n`)
        (copy / ".venv").symlink_to(REPO / ".venv")
    source = example_source()
    name = re.search(r'@register_objective\("(\w+)"\)', source).group(1)
    (copy / "objectives" / f"{name}.py").write_text(source)
    files = sorted(str(p.relative_to(copy)) for p in (copy / "tests").glob("test_*.py")
                   if any(word in p.read_text() for word in REGISTRY_WIDE))
    assert "tests/test_objectives.py" in files and "tests/test_names.py" in files
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "only_the_new_objective.py").write_text(ONLY_THE_NEW_OBJECTIVE.format(name=name))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(tmp_path / "plugin")]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-x", "-p", "only_the_new_objective",
                           "-m", "not slow", "-p", "no:cacheprovider", *files], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=900)
    failed = [line for line in done.stdout.splitlines() if "FAILED" in line or "ERROR" in line]
    assert done.returncode == 0, "\n".join(failed) + done.stdout[-3000:] + done.stderr[-2000:]
    assert f"[{name}]" in done.stdout  # the registry-wide tests ran over the new objective too
    assert "[grpo]" not in done.stdout  # nor over the objectives registered before
