"""The rest of the family: P3O, the CTPO and HölderPO variants, verl's dual clip, the GSPO log-ratio
cap, and aggregation as a hyperparameter. Hand-computed values with ``math`` on scalars, and the authors'
formulas re-derived here step by step (FeynRL's P3O, the CTPO authors' verl losses, HölderPO's oat branches,
verl's ``vanilla`` / ``gspo``), compared in value and gradient. Tensors are float64.
"""

import math

import pytest
import torch

import objectives
from objectives import PolicyBatch, get_objective
from objectives.base import AGGREGATIONS
from tests.helpers.objectives import (
    ADV,
    DT,
    MASK,
    OLD,
    D,
    assert_close,
    group_batch,
    make_batch,
    minibatch_counts,
    num,
    random_batch,
    run,
)

E = math.exp


def grad_of(loss, batch):
    (grad,) = torch.autograd.grad(loss, batch.logp)
    return grad


def agg(loss_mat, mask, mode, max_len=8):
    """verl's agg_loss, written out (float mask)."""
    m = mask.to(loss_mat.dtype)
    if mode == "token_mean":
        return (loss_mat * m).sum() / m.sum()
    if mode == "seq_mean_token_mean":
        return ((loss_mat * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    return (loss_mat * m).sum() / (m.shape[0] * max_len)


# ----------------------------------------------------------------------------------------------------
# P3O (FeynRL algs/P3O/p3o.py)
# ----------------------------------------------------------------------------------------------------

def test_p3o_hand():
    out, grad = run("p3o", make_batch(OLD, D, MASK, ADV))
    d = [0.1, 0.3, -0.1, -0.4, 0.2]
    logp = [-0.9, -1.7, -0.6, -1.9, -0.5]
    adv = [1.0, 1.0, 1.0, -0.5, -0.5]
    r = [E(x) for x in d]
    ess = sum(r) ** 2 / (sum(x * x for x in r) + 1e-8) / 5
    w = [min(x, ess) for x in r]
    kl = [x + E(-x) - 1 for x in d]
    loss = sum(-w[k] * adv[k] * logp[k] + (1 - ess) * kl[k] for k in range(5)) / 5
    assert num(out.loss, loss)
    g = [(-w[k] * adv[k] + (1 - ess) * (1 - E(-d[k]))) / 5 for k in range(5)]
    assert_close(grad, [g[:3], g[3:] + [0.0]])
    m = out.metrics
    assert num(m["ess_batch"], ess) and 0 < ess < 1
    assert num(m["clip_frac_high"], sum(x > ess for x in r) / 5) and m["clip_frac_low"] == 0.0
    assert num(m["p3o_kl_behavior"], sum(kl) / 5)
    assert get_objective("p3o").uses_minibatch_statistics() and not get_objective("grpo").uses_minibatch_statistics()
    assert not get_objective("p3o").needs_whole_minibatch  # micro-batched exactly (two passes)


def feynrl_p3o(logp, old, adv, mask):
    """FeynRL's compute_policy_loss (P3O) + normalize_loss with the global token count, step by step."""
    mask_bool = mask > 0.5
    m = mask_bool.to(logp.dtype)
    logratio = torch.where(mask_bool, logp - old, torch.zeros_like(logp))
    ratio = torch.exp(logratio)
    valid = ratio[mask_bool]
    sum_w, sum_w2, total = valid.sum().double().item(), valid.pow(2).sum().double().item(), float(valid.numel())
    finite = math.isfinite(sum_w) and math.isfinite(sum_w2)
    ess = (sum_w**2) / (sum_w2 + 1e-8) / total if total >= 0.5 and finite else 1.0  # calculate_ess's guard
    kl = (logp - old) + torch.exp(torch.clamp(old - logp, min=-10.0, max=10.0)) - 1
    kl = torch.where(mask_bool, kl, torch.zeros_like(kl))
    rho = torch.clamp(ratio, min=0, max=ess)
    pi_sum = -(rho.detach() * logp * adv * m).sum()
    loss_total_sum = pi_sum + (1 - ess) * (kl * m).sum()
    return loss_total_sum / m.sum(), ess


@pytest.mark.parametrize("scale", [0.0, 0.05, 0.5, 6.0])
def test_p3o_matches_feynrl_on_a_whole_minibatch(scale):
    batch = random_batch(seed=11, scale=scale, b=8, t=6)
    batch.num_tokens, batch.num_sequences = batch.mask.sum(), 8  # what the loop passes for a whole minibatch
    out = get_objective("p3o")(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref, ess = feynrl_p3o(batch.logp, batch.old_logp, adv, batch.mask)
    assert num(out.loss, ref, 1e-12) and num(out.metrics["ess_batch"], ess, 1e-12)
    grad = grad_of(out.loss, batch)
    assert_close(grad, grad_of(ref, batch), tol=1e-12)
    if scale == 0.0:  # on-policy: e_B = n / (n + 1e-8) ~ 1, KL 0: the vanilla policy gradient -e_B A / N_tokens
        n = batch.mask.sum().item()
        assert num(ess, n / (n + 1e-8), 1e-14)
        assert_close(grad, -ess * adv * batch.mask / n, tol=1e-12)


def test_p3o_an_infinite_ratio_falls_back_to_an_ess_of_one_as_feynrl():
    """A ratio that overflows (d = 800 in float64) makes sum r infinite: FeynRL's calculate_ess returns 1.0 (weights
    min(r, 1), no behaviour KL) instead of a NaN loss."""
    batch = random_batch(seed=11, scale=0.5, b=8, t=6)
    with torch.no_grad():
        batch.logp[0, 0] = batch.old_logp[0, 0] + 800.0
    out = get_objective("p3o")(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref, ess = feynrl_p3o(batch.logp, batch.old_logp, adv, batch.mask)
    assert batch.mask[0, 0] and ess == out.metrics["ess_batch"] == 1.0
    assert num(out.loss, ref, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-12)


def test_p3o_micro_batches_with_the_minibatch_statistics_match_feynrl_on_the_whole():
    """The loop's two passes: the micro-batches' sums (n, sum r, sum r^2) added up give the minibatch's e_B, so the
    summed micro-batch losses are FeynRL's minibatch loss; each micro-batch's own e_B would not be."""
    whole = random_batch(seed=11, scale=0.5, b=8, t=6)
    adv = whole.advantages[:, None].expand_as(whole.logp)
    ref, ess = feynrl_p3o(whole.logp, whole.old_logp, adv, whole.mask)
    p3o = get_objective("p3o")
    parts = [PolicyBatch(logp=whole.logp[r], old_logp=whole.old_logp[r], mask=whole.mask[r],
                         advantages=whole.advantages[r], num_tokens=whole.mask.sum(), num_sequences=8)
             for r in (slice(0, 2), slice(2, 3), slice(3, 8))]
    stats = {k: sum(p3o.minibatch_statistics(p)[k] for p in parts) for k in ("n", "sum_r", "sum_r2")}
    assert stats["n"].item() == whole.mask.sum().item()
    own = sum(p3o(p).loss for p in parts)  # each micro-batch with its own e_B: not the minibatch loss
    assert not num(own, ref, 1e-6)
    for part in parts:
        part.minibatch_stats = stats
    outs = [p3o(p) for p in parts]
    assert all(num(o.metrics["ess_batch"], ess, 1e-12) for o in outs)
    total = sum(o.loss for o in outs)
    assert num(total, ref, 1e-12)
    assert_close(grad_of(total, whole), grad_of(ref, whole), tol=1e-12)


def test_p3o_with_equal_rewards_only_the_behaviour_kl_pulls():
    batch = group_batch(advantages=torch.zeros(8, dtype=DT))
    out, grad = run("p3o", batch)
    ess = out.metrics["ess_batch"]
    d = torch.where(batch.mask, batch.logp - batch.old_logp, torch.zeros_like(batch.logp)).detach()
    assert_close(grad, (1 - ess) * (1 - torch.exp(-d)) * batch.mask / batch.mask.sum(), tol=1e-12)


# ----------------------------------------------------------------------------------------------------
# Dual clip (verl's clip_ratio_c) for the PPO-clip family
# ----------------------------------------------------------------------------------------------------

def test_dual_clip_hand():
    d = [[0.1, 0.3, -0.1], [0.5, 0.2, 7.0]]
    out, grad = run("grpo", make_batch(OLD, d, MASK, ADV), dual_clip=True, clip_ratio_c=1.5)
    # seq 1 (A = -0.5): r = e^.5 = 1.65 > c = 1.5 -> loss 0.5 * 1.5, no gradient; r = e^.2 < 1.5 unchanged
    seq0 = (-E(0.1) - 1.2 - E(-0.1)) / 3
    seq1 = (0.5 * 1.5 + 0.5 * E(0.2)) / 2
    assert num(out.loss, (seq0 + seq1) / 2)
    assert_close(grad, [[-E(0.1) / 6, 0.0, -E(-0.1) / 6], [0.0, 0.5 * E(0.2) / 4, 0.0]])
    m = out.metrics
    assert num(m["clip_frac_dual"], 1 / 5) and num(m["clip_frac_high"], 1 / 5) and num(m["clip_frac"], 2 / 5)
    off, _ = run("grpo", make_batch(OLD, d, MASK, ADV))
    assert off.metrics["clip_frac_dual"] == 0.0 and not num(off.loss, out.loss)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        get_objective("dapo", dual_clip=True, clip_ratio_c=1.0)


def verl_vanilla(logp, old, adv, mask, low, high, c, mode, max_len=8):
    """verl's compute_policy_loss_vanilla (dual clip always on), written out."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    clip2 = torch.min(-adv * c, clip1)
    return agg(torch.where(adv < 0, clip2, clip1), mask, mode, max_len)


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo"])
def test_dual_clip_matches_verl_vanilla(name):
    batch = random_batch(seed=12, scale=0.6, b=16, t=7)
    batch.logp.data[:, 1] += 1.2  # some ratios above c = 3
    obj = get_objective(name, dual_clip=True)
    out = obj(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref = verl_vanilla(batch.logp, batch.old_logp, adv, batch.mask, obj.clip_low, obj.clip_high, 3.0,
                       obj.aggregation)
    assert out.metrics["clip_frac_dual"] > 0
    assert num(out.loss, ref, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-12)


# ----------------------------------------------------------------------------------------------------
# GSPO log-ratio cap (verl's gspo)
# ----------------------------------------------------------------------------------------------------

def test_gspo_cap_hand():
    d = [[0.1, 0.3, -0.1], [0.5, 0.3, 7.0]]  # mean d: 0.1 and 0.4
    batch = make_batch(OLD, d, MASK, ADV)
    out, grad = run("gspo", batch, clip_low=0.2, clip_high=0.2, cap_log_ratio=True, log_ratio_cap=0.3)
    # seq 0: log s = 0.1 < cap, s = e^.1 in the window; seq 1 (A < 0): log s = 0.4 capped at 0.3, no gradient
    assert num(out.loss, (-E(0.1) + 0.5 * E(0.3)) / 2)
    assert_close(grad, [[-E(0.1) / 6] * 3, [0.0, 0.0, 0.0]])
    assert num(out.metrics["clip_frac_cap"], 2 / 5) and num(out.metrics["clip_frac"], 2 / 5)
    plain, plain_grad = run("gspo", batch, clip_low=0.2, clip_high=0.2)
    assert num(plain.loss, (-E(0.1) + 0.5 * E(0.4)) / 2) and "clip_frac_cap" not in plain.metrics
    token, token_grad = run("gspo_token", batch, clip_low=0.2, clip_high=0.2, cap_log_ratio=True, log_ratio_cap=0.3)
    assert num(token.loss, out.loss, 1e-12) and token.metrics["clip_frac"] == out.metrics["clip_frac"]
    assert_close(token_grad, grad, tol=1e-12)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_cap_counts_only_negative_advantages_as_capped(name):
    d = [[0.5, 0.3, 0.4], [0.5, 0.3, 7.0]]  # mean d: 0.4 and 0.4, both capped at 0.3
    out, grad = run(name, make_batch(OLD, d, MASK, ADV), clip_low=0.2, clip_high=0.2, cap_log_ratio=True,
                    log_ratio_cap=0.3)
    # seq 0 (A > 0): s = e^.3 > 1.2, clipped high (loss -1.2); seq 1 (A < 0): capped, loss 0.5 e^.3; no gradient
    assert num(out.loss, (-1.2 + 0.5 * E(0.3)) / 2)
    assert_close(grad, [[0.0] * 3, [0.0] * 3])
    m = out.metrics  # the capped A > 0 sequence counts as clipped high only, not again as capped
    assert num(m["clip_frac_high"], 3 / 5) and num(m["clip_frac_cap"], 2 / 5) and num(m["clip_frac"], 1.0)


def verl_gspo(logp, old, adv, mask, low, high, cap=10.0):
    m = mask.to(logp.dtype)
    seq = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = torch.clamp(logp - logp.detach() + seq.detach()[:, None], max=cap)
    s = torch.exp(log_s)
    loss = torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - low, 1 + high))
    return agg(loss, mask, "seq_mean_token_mean")


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_cap_matches_verl(name):
    batch = random_batch(seed=13, scale=0.5, b=16, t=6)
    batch.logp.data[:3] += 12.0  # three sequences past the cap
    out = get_objective(name, clip_low=0.2, clip_high=0.2, cap_log_ratio=True)(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref = verl_gspo(batch.logp, batch.old_logp, adv, batch.mask, 0.2, 0.2)
    assert num(out.loss, ref, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-12)


def verl_geo_mean(logp, old, adv, mask, low, high):
    """verl's compute_policy_loss_geo_mean (GMPO; verl/trainer/ppo/core_algos.py), written out: the token log-ratio
    clipped on the side the sign of A selects, the masked geometric mean, with verl's 1e-8 guards; mean over rows."""
    d = logp - old
    sgn = torch.sign(adv)
    d_min = sgn * torch.min(sgn * d, sgn * torch.clamp(d, -low, high))
    m = mask.to(d.dtype)
    n = m.sum(-1)
    ratio = torch.exp((d_min * m).sum(-1) / (n + 1e-8))
    return (-(adv * m).sum(-1) / (n + 1e-8) * ratio).mean()


@pytest.mark.parametrize("low,high", [(0.4, 0.4), (0.1, 0.5), (0.5, 0.1)])
def test_gmpo_matches_verls_geo_mean(low, high):
    batch = random_batch(seed=16, scale=0.4, b=16, t=7)
    batch.advantages[2] = 0.0
    out = get_objective("gmpo", clip_low=low, clip_high=high)(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref = verl_geo_mean(batch.logp, batch.old_logp, adv, batch.mask, low, high)
    assert 0 < out.metrics["clip_frac_low"] and 0 < out.metrics["clip_frac_high"]
    assert num(out.loss, ref, 1e-7)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-7)


# ----------------------------------------------------------------------------------------------------
# Aggregation as a hyperparameter
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_with_token_mean_is_dapo(beta):
    batch = group_batch()
    a, ga = run("grpo", batch, aggregation="token_mean", clip_high=0.28, beta=beta)
    b, gb = run("dapo", batch, beta=beta)
    assert num(a.loss, b.loss, 1e-13)
    assert_close(ga, gb, tol=1e-13)
    c, gc = run("dr_grpo", batch, aggregation="token_mean", clip_high=0.28, beta=beta)
    assert num(c.loss, b.loss, 1e-13)
    assert_close(gc, gb, tol=1e-13)
    d, _ = run("dapo", batch, aggregation="seq_mean_token_mean", beta=beta)  # and back
    e, _ = run("grpo", batch, clip_high=0.28, beta=beta)
    assert num(d.loss, e.loss, 1e-13)


def test_sequence_level_aggregation_weights_by_length():
    batch = make_batch(OLD, D, MASK, ADV)
    s0, s1 = E(0.1), E(-0.1)  # unclipped at 0.2 / 0.2
    for mode, expected in [("seq_mean_token_mean", (-s0 + 0.5 * s1) / 2),
                           ("token_mean", (-3 * s0 + 2 * 0.5 * s1) / 5),
                           ("seq_mean_token_sum_norm", (-3 * s0 + 2 * 0.5 * s1) / (2 * 8))]:
        out, grad = run("gspo", batch, clip_low=0.2, clip_high=0.2, aggregation=mode)
        assert num(out.loss, expected), mode
        token, token_grad = run("gspo_token", batch, clip_low=0.2, clip_high=0.2, aggregation=mode)
        assert num(token.loss, out.loss, 1e-12) and torch.allclose(token_grad, grad, atol=1e-12), mode


def test_every_mode_is_accepted_or_refused_clearly():
    for name in objectives.available_objectives():
        cls = objectives.OBJECTIVES.get(name)
        assert get_objective(name).hyperparameters()["aggregation"] == cls.default_aggregation
        for mode in AGGREGATIONS:
            if mode in cls.aggregations:
                assert get_objective(name, aggregation=mode).aggregation == mode
            else:
                with pytest.raises(ValueError, match=r"aggregation 'token_mean' is not meaningful|aggregation"):
                    get_objective(name, aggregation=mode)
    with pytest.raises(ValueError, match="not meaningful for this objective"):
        get_objective("conspo", aggregation="token_mean")
    with pytest.raises(ValueError, match="unknown mode 'token_sum'"):
        get_objective("grpo", aggregation="token_sum")
    with pytest.raises(TypeError, match="must be a string"):
        get_objective("grpo", aggregation=1)
    assert objectives.OBJECTIVES.get("conspo").aggregations == ("seq_mean_token_mean",)


def test_legacy_aggregation_class_attribute_is_the_default():
    from objectives.base import OBJECTIVES, Objective, aggregate, register_objective

    @register_objective("legacy_test_objective")
    class Legacy(Objective):
        aggregation = "seq_mean_token_sum_norm"

        def policy_loss(self, batch):
            return aggregate(batch.logp, batch, self.aggregation), {}

    try:
        assert Legacy.default_aggregation == "seq_mean_token_sum_norm"
        assert get_objective("legacy_test_objective").aggregation == "seq_mean_token_sum_norm"
        assert get_objective("legacy_test_objective", aggregation="token_mean").aggregation == "token_mean"
    finally:
        OBJECTIVES._items.pop("legacy_test_objective")


# ----------------------------------------------------------------------------------------------------
# CTPO variants (horizon-llm/CTPO verl/trainer/ppo/core_algos.py)
# ----------------------------------------------------------------------------------------------------

def ctpo_reference(logp, old, adv, mask, ratio_mode, la, low=None, high=None, c=None, power=0.5):
    """The authors' cum-token losses, step by step: ``la`` = True: _compute_policy_loss_cum_token_la_impl
    (log-space window scaled by t^power, dual threshold exp(c t^power)); False: _compute_policy_loss_cum_token_impl
    (ratio-space clip, dual clip c). Token-mean."""
    nkl = torch.clamp(logp - old, min=-20.0, max=20.0)
    m = mask.to(nkl.dtype)
    cum = torch.cumsum(nkl * m, dim=-1)
    if ratio_mode == "geomean":
        values = torch.where(m > 0, cum / torch.cumsum(m, dim=-1).clamp(min=1.0), torch.zeros_like(cum))
    else:
        values = torch.where(m > 0, cum, torch.zeros_like(cum))
    log_r = torch.clamp(values.detach() + logp - logp.detach(), max=10.0)
    ratio = torch.where(m > 0, torch.exp(log_r), torch.zeros_like(log_r))
    if la:
        scale = torch.cumsum(m, dim=-1).clamp(min=1.0).pow(power)
        clipped = torch.where(m > 0, torch.exp(torch.clamp(log_r, -low * scale, high * scale)), torch.zeros_like(log_r))
        threshold = torch.where(m > 0, torch.exp(c * scale), torch.ones_like(scale))
    else:
        clipped = torch.clamp(ratio, 1 - low, 1 + high)
        threshold = c
    l1 = torch.maximum(-adv * ratio, -adv * clipped)
    l2 = torch.min(-adv * threshold, l1)
    return agg(torch.where(adv < 0, l2, l1), mask, "token_mean")


CTPO_CASES = [
    ("ctpo", {}, dict(la=True, ratio_mode="cumprod", low=0.025, high=0.05, c=0.05, power=0.5)),
    ("ctpo", {"ratio_mode": "geomean", "la_power": -0.5},
     dict(la=True, ratio_mode="geomean", low=0.025, high=0.05, c=0.05, power=-0.5)),
    ("ctpo", {"la_power": 0.0}, dict(la=True, ratio_mode="cumprod", low=0.025, high=0.05, c=0.05, power=0.0)),
    ("ctpo_clip", {}, dict(la=False, ratio_mode="cumprod", low=0.2, high=0.2, c=3.0)),
    ("ctpo_clip", {"ratio_mode": "geomean"}, dict(la=False, ratio_mode="geomean", low=0.2, high=0.2, c=3.0)),
    ("ctpo_clip", {"clip_low": 0.1, "clip_high": 0.3, "clip_ratio_c": 1.5},
     dict(la=False, ratio_mode="cumprod", low=0.1, high=0.3, c=1.5)),  # asymmetric: each bound on its side
]


@pytest.mark.parametrize("name,hp,ref", CTPO_CASES, ids=[f"{n}-{hp}" for n, hp, _ in CTPO_CASES])
@pytest.mark.parametrize("scale", [0.02, 0.3])
def test_ctpo_variants_match_the_authors(name, hp, ref, scale):
    batch = random_batch(seed=14, scale=scale, b=16, t=9)
    batch.logp.data[0, 4:] += 15.0  # past the cap at 10
    batch.logp.data[0, :2] += torch.tensor([-25.0, 22.0], dtype=DT)  # |d| past the +-20 clamp before the prefix sum
    out = get_objective(name, **hp)(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    expected = ctpo_reference(batch.logp, batch.old_logp, adv, batch.mask, **ref)
    assert num(out.loss, expected, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(expected, batch), tol=1e-12)


def test_ctpo_geomean_hand():
    old = [[-1.0, -2.0, -0.5]]
    d = [[0.1, -0.3, 0.2]]
    out, grad = run("ctpo_clip", make_batch(old, d, [[1, 1, 1]], [-1.0]), ratio_mode="geomean")
    # prefix means: 0.1, -0.1, 0.0 -> rho = e^.1, e^-.1, 1; all inside [0.8, 1.2]; A = -1: l = rho
    assert num(out.loss, (E(0.1) + E(-0.1) + 1.0) / 3)
    assert_close(grad, [[E(0.1) / 3, E(-0.1) / 3, 1.0 / 3]])  # d rho_t / d logp_t = rho_t (current token only)
    out, grad = run("ctpo", make_batch(old, d, [[1, 1, 1]], [-1.0]), ratio_mode="geomean", la_power=-0.5)
    # windows: t=1 [-.025, .05]: 0.1 above -> dual bound e^.05 (A < 0): l = e^.05, no gradient
    #          t=2 [-.025/sqrt2, .05/sqrt2] = [-.0177, .0354]: -0.1 below -> l = e^-.0177, no gradient
    #          t=3: 0.0 inside -> l = 1, gradient 1/3
    r2 = math.sqrt(2)
    assert num(out.loss, (E(0.05) + E(-0.025 / r2) + 1.0) / 3)
    assert_close(grad, [[0.0, 0.0, 1.0 / 3]])


# ----------------------------------------------------------------------------------------------------
# HölderPO variants and the rollout-step schedule (YihangChen9/HolderPO train_zero_math_holder.py)
# ----------------------------------------------------------------------------------------------------

def holder_reference(new, old, adv, mask, p, variant, clip=0.2):
    """The authors' three branches (critic_type_modify), step by step, with their 1e-8 guards; mean over rows."""
    m = mask.to(new.dtype)
    lengths = m.sum(-1)
    if variant == "holder_token":
        r = torch.exp(new - old)
        rc = torch.clamp(r, 1 - clip, 1 + clip)
        tmin, tmax = torch.min(r, rc), torch.max(r, rc)
        if abs(p) < 1e-6:
            C = torch.exp((torch.log(tmin + 1e-8) * m).sum(-1) / (lengths + 1e-8))
            D = torch.exp((torch.log(tmax + 1e-8) * m).sum(-1) / (lengths + 1e-8))
        else:
            C = ((torch.exp(p * torch.log(tmin + 1e-8)) * m).sum(-1) / (lengths + 1e-8)).pow(1 / p)
            D = ((torch.exp(p * torch.log(tmax + 1e-8)) * m).sum(-1) / (lengths + 1e-8)).pow(1 / p)
        return (-(C * (adv > 0) + D * (adv < 0)) * adv).mean()
    diff = new - old
    if variant == "sequence_w_clip":
        delta = math.log(1 + clip)
        diff = torch.clamp(diff, -delta, delta)
    if abs(p) < 1e-6:
        ratio = torch.exp((diff * m).sum(-1) / (lengths + 1e-8))
    else:
        ratio = ((torch.exp(p * diff) * m).sum(-1) / (lengths + 1e-8)).pow(1 / p)
    return torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)).mean()


@pytest.mark.parametrize("variant", ["holder", "sequence_w_clip", "holder_token"])
@pytest.mark.parametrize("step,p", [(0, 2.0), (2, 0.0), (3, -1.0)])
def test_holder_variants_match_the_authors(variant, step, p):
    batch = random_batch(seed=15, scale=0.25, b=16, t=7, step=step, total_steps=4)
    batch.advantages[3] = 0.0
    batch.old_logp = torch.where(batch.mask, batch.old_logp, torch.zeros_like(batch.old_logp))
    batch.logp.data = torch.where(batch.mask, batch.logp.data, torch.zeros_like(batch.logp.data))
    out = get_objective("holder", variant=variant)(batch)
    assert out.metrics["holder_p"] == p
    expected = holder_reference(batch.logp, batch.old_logp, batch.advantages, batch.mask, p, variant)
    assert num(out.loss, expected, 1e-7)  # the authors' 1e-8 guards
    assert_close(grad_of(out.loss, batch), grad_of(expected, batch), tol=1e-7)


def test_holder_token_hand():
    d = [[0.1, 0.3, -0.1], [-0.4, 0.2, 7.0]]
    out, grad = run("holder", make_batch(OLD, d, MASK, ADV, step=1, total_steps=2), variant="holder_token")
    # p = 0 (halfway from 2 to -2): geometric means. A > 0: u = min(d, log 1.2); A < 0: u = max(d, log 0.8)
    up, down = math.log(1.2), math.log(0.8)
    c0 = E((0.1 + up - 0.1) / 3)
    d1 = E((down + 0.2) / 2)
    assert num(out.loss, (-c0 + 0.5 * d1) / 2)
    assert_close(grad, [[-c0 / 6, 0.0, -c0 / 6], [0.0, 0.5 * d1 / 4, 0.0]])
    assert num(out.metrics["clip_frac_high"], 1 / 5) and num(out.metrics["clip_frac_low"], 1 / 5)


def test_holder_sequence_w_clip_hand():
    d = [[0.1, 0.3, -0.1], [-0.4, 0.15, 7.0]]
    out, grad = run("holder", make_batch(OLD, d, MASK, ADV, step=1, total_steps=2), variant="sequence_w_clip")
    delta = math.log(1.2)  # tokens clamped to [-log 1.2, log 1.2]: 0.3 -> .182, -0.4 -> -.182
    rho0, rho1 = E((0.1 + delta - 0.1) / 3), E((-delta + 0.15) / 2)  # both inside [0.8, 1.2]
    assert num(out.loss, (-rho0 + 0.5 * rho1) / 2)
    assert_close(grad, [[-rho0 / 6, 0.0, -rho0 / 6], [0.0, 0.5 * rho1 / 4, 0.0]])
    assert num(out.metrics["holder_token_clip_frac"], 2 / 5)


def test_holder_asymmetric_clip_hand():
    """clip_low 0.1, clip_high 0.3 at p = 0 (halfway from 2 to -2): each bound on its own side, in every variant (the
    authors' code has one cliprange; the module docstring says which bound goes where)."""
    run_at = {"clip_low": 0.1, "clip_high": 0.3, "p_start": 0.0, "p_end": 0.0}
    up, down, lower = math.log(1.3), math.log(0.9), -math.log(1.1)
    # holder: rho in [0.9, 1.3]; seq 0 (A > 0) rho = 1.24 unclipped, seq 1 (A < 0) rho = e^-.15 = 0.86 clipped low
    d = [[0.2, 0.25, 0.2], [-0.15, -0.15, 7.0]]
    out, grad = run("holder", make_batch(OLD, d, MASK, ADV), **run_at)
    rho0 = E(0.65 / 3)
    assert num(out.loss, (-rho0 + 0.5 * 0.9) / 2)
    assert_close(grad, [[-rho0 / 6] * 3, [0.0, 0.0, 0.0]])
    assert num(out.metrics["clip_frac_low"], 2 / 5) and num(out.metrics["clip_frac_high"], 0.0)
    # sequence_w_clip: tokens clamped to [-log 1.1, log 1.3], then the same sequence clip (both unclipped here)
    d = [[0.1, 0.3, -0.1], [-0.05, 0.05, 7.0]]
    out, grad = run("holder", make_batch(OLD, d, MASK, ADV), variant="sequence_w_clip", **run_at)
    rho0 = E((0.1 + up + lower) / 3)
    assert num(out.loss, (-rho0 + 0.5 * 1.0) / 2)
    assert_close(grad, [[-rho0 / 6, 0.0, 0.0], [0.5 / 4, 0.5 / 4, 0.0]])
    assert num(out.metrics["holder_token_clip_frac"], 2 / 5)
    # holder_token: A > 0: u = min(d, log 1.3); A < 0: u = max(d, log 0.9)
    d = [[0.1, 0.2, 0.3], [-0.15, 0.05, 7.0]]
    out, grad = run("holder", make_batch(OLD, d, MASK, ADV), variant="holder_token", **run_at)
    c0, d1 = E((0.1 + 0.2 + up) / 3), E((down + 0.05) / 2)
    assert num(out.loss, (-c0 + 0.5 * d1) / 2)
    assert_close(grad, [[-c0 / 6, -c0 / 6, 0.0], [0.0, 0.5 * d1 / 4, 0.0]])
    assert num(out.metrics["clip_frac_high"], 1 / 5) and num(out.metrics["clip_frac_low"], 1 / 5)


@pytest.mark.parametrize("variant", ["holder", "sequence_w_clip", "holder_token"])
@pytest.mark.parametrize("p", [0.3, -0.05])
def test_holder_small_exponents_are_power_means_as_the_authors(variant, p):
    """Only |p| < 1e-6 is the geometric mean (the authors' threshold); a small p is still the power mean."""
    batch = random_batch(seed=15, scale=0.25, b=16, t=7)
    batch.old_logp = torch.where(batch.mask, batch.old_logp, torch.zeros_like(batch.old_logp))
    batch.logp.data = torch.where(batch.mask, batch.logp.data, torch.zeros_like(batch.logp.data))
    out = get_objective("holder", variant=variant, p_start=p, p_end=p)(batch)
    expected = holder_reference(batch.logp, batch.old_logp, batch.advantages, batch.mask, p, variant)
    assert num(out.loss, expected, 1e-7)
    assert_close(grad_of(out.loss, batch), grad_of(expected, batch), tol=1e-7)


def test_holder_rollout_step_schedule():
    """The authors' p(k / 500) at rollout k counted from 1 (oat's learner ``steps`` is 1 during the first rollout's
    update); ``rollout_step`` is the number of rollouts done before this update, so rollout k has rollout_step k - 1
    (audit item 1: the first rollout used p(0) = p_start, one rollout late)."""
    obj = get_objective("holder", p_schedule="rollout_steps")
    assert obj.holder_p_schedule_steps == 500
    for rollout_step, p in [(0, 2.0 - 4 / 500), (124, 1.0), (249, 0.0), (498, -2.0 + 4 / 500), (499, -2.0),
                            (500, -2.0), (10_000, -2.0)]:
        batch = make_batch(OLD, D, MASK, ADV, step=3, total_steps=4, rollout_step=rollout_step)
        assert num(obj.exponent(batch), p, 1e-14), rollout_step
        assert num(obj(batch).metrics["holder_p"], p, 1e-14)
    assert get_objective("holder", p_schedule="rollout_steps", holder_p_schedule_steps=10).exponent(
        make_batch(OLD, D, MASK, ADV, rollout_step=4)) == 0.0  # rollout 5 of 10
    assert get_objective("holder").exponent(make_batch(OLD, D, MASK, ADV, step=3, total_steps=4)) == -1.0
    with pytest.raises(ValueError, match="rollout_step"):
        obj(make_batch(OLD, D, MASK, ADV))
    for bad in ({"p_schedule": "steps"}, {"variant": "token"}, {"holder_p_schedule_steps": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            get_objective("holder", **bad)


def test_policy_batch_optional_fields_are_checked():
    logp = torch.zeros(2, 3, dtype=DT, requires_grad=True)
    with pytest.raises(ValueError, match="sampler_logp"):
        PolicyBatch(logp=logp, old_logp=torch.zeros(2, 3, dtype=DT), mask=torch.ones(2, 3),
                    advantages=torch.zeros(2, dtype=DT), sampler_logp=torch.zeros(2, 2, dtype=DT))
    batch = PolicyBatch(logp=logp, old_logp=torch.zeros(2, 3, dtype=DT), mask=torch.ones(2, 3),
                        advantages=torch.zeros(2, dtype=DT), sampler_logp=logp * 2)
    assert not batch.sampler_logp.requires_grad and batch.rollout_step is None


# ----------------------------------------------------------------------------------------------------
# TBPO (QaRL, arXiv 2604.07853; no public code, the paper's equations unread: the formula of
# objectives/tbpo.py, hand-checked region by region)
# ----------------------------------------------------------------------------------------------------

def test_tbpo_hand():
    old = [[-1.0, -2.0, -0.5], [-1.5, -0.7, 9.0], [-1.0, -1.0, -1.0]]
    d = [[0.1, 0.3, -0.1], [0.5, 0.7, 7.0], [0.0, 0.0, 0.0]]
    mask = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    # sampler log-probs: seq 0 mean(old - sampler) = 0.05 (kept, w = e^.05), seq 1 = 0.0 (w = 1),
    # seq 2 = 0.2 (w = e^.2 = 1.22 > 1.1: dropped)
    sampler = torch.tensor(old, dtype=DT) - torch.tensor([[0.05, 0.05, 0.05], [0.0, 0.0, 5.0], [0.2, 0.2, 0.2]],
                                                          dtype=DT)
    batch = make_batch(old, d, mask, [1.0, -0.5, 2.0], sampler_logp=sampler)
    out, grad = run("tbpo", batch, clip_low=0.2, clip_high=0.2, clip_ratio_c=1.5)
    s0, s1 = E(0.1), E(0.6)  # s0 inside [0.8, 1.2]; s1 = 1.82 > c = 1.5 with A < 0: dual clip, loss 0.5 * 1.5
    w0 = E(0.05)
    assert num(out.loss, (-w0 * s0 + 0.5 * 1.5) / 3)
    assert_close(grad, [[-w0 * s0 / 9] * 3, [0.0] * 3, [0.0] * 3])
    m = out.metrics
    assert num(m["tbpo_drop_frac"], 3 / 8) and num(m["clip_frac_dual"], 2 / 8) and num(m["clip_frac"], 5 / 8)
    assert approx_metric(m["mismatch_weight_max"], E(0.2))
    # without sampler log-probs: w = 1, nothing dropped: GSPO with a dual clip
    batch.sampler_logp = None
    out, _ = run("tbpo", batch, clip_low=0.2, clip_high=0.2, clip_ratio_c=1.5)
    assert num(out.loss, (-s0 + 0.5 * 1.5 - 2.0 * 1.0) / 3) and out.metrics["tbpo_drop_frac"] == 0.0
    gspo, _ = run("gspo", batch, clip_low=0.2, clip_high=0.2)
    assert num(gspo.loss, (-s0 + 0.5 * s1 - 2.0) / 3)
    with pytest.raises(ValueError, match="band"):
        get_objective("tbpo", band_low=1.2)


def test_tbpo_every_clip_region_value_and_gradient():
    """One sequence per region of the formula in objectives/tbpo.py (clip 0.2 / 0.2, c = 1.5, band [0.9, 1.1]),
    written out: loss_i = keep_i w_i l_i, d loss / d logp_t = -A_i w_i s_i / (N L_i) where the unclipped term is
    active, else 0. Rows of one valid token check the 1 / L_i factor."""
    c, eps = 1.5, 0.2
    rows = [  # (A, per-token d, valid tokens, mean(old - sampler))
        (1.0, 0.1, 2, 0.05),                    # A > 0, s inside: weighted by w = e^.05 (inside the band)
        (1.0, 0.3, 1, 0.0),                     # A > 0, s = 1.35 > 1.2: clipped, constant -1.2
        (1.0, -0.4, 2, 0.0),                    # A > 0, s = 0.67 < 0.8: unclipped (the clip only caps gains)
        (-1.0, -0.4, 2, 0.0),                   # A < 0, s < 0.8: clipped, constant 0.8
        (-1.0, 0.3, 2, 0.0),                    # A < 0, 1.2 < s < c: unclipped (PPO's clip does not bound it)
        (-1.0, math.log(c) - 1e-6, 1, 0.0),     # A < 0, s just below c: unclipped
        (-1.0, math.log(c) + 1e-6, 2, 0.0),     # A < 0, s just above c: dual clip, constant c
        (-2.0, 0.5, 2, 0.2),                    # w = e^.2 = 1.22 > 1.1: dropped
        (1.0, 0.0, 2, -0.2),                    # w = e^-.2 = 0.82 < 0.9: dropped
        (0.0, 0.3, 2, 0.0),                     # A = 0: nothing
    ]
    n = len(rows)
    old = [[-1.0, -2.0]] * n
    d = [[x, x] for _, x, _, _ in rows]
    mask = [[1, 1] if length == 2 else [1, 0] for _, _, length, _ in rows]
    sampler = torch.tensor(old, dtype=DT) - torch.tensor([[gap, gap] for *_, gap in rows], dtype=DT)
    batch = make_batch(old, d, mask, [a for a, *_ in rows], sampler_logp=sampler)
    out, grad = run("tbpo", batch, clip_low=eps, clip_high=eps, clip_ratio_c=c, band_low=0.9, band_high=1.1)
    s = [E(x) for _, x, _, _ in rows]
    w0 = E(0.05)
    losses = [-w0 * s[0], -(1 + eps), -s[2], 1 - eps, s[4], s[5], c, 0.0, 0.0, 0.0]
    assert num(out.loss, sum(losses) / n)
    flowing = {0: -w0 * s[0], 2: -s[2], 4: s[4], 5: s[5]}  # -A w s per unclipped row
    expected = [[flowing.get(i, 0.0) / (n * rows[i][2]) * m for m in mask[i]] for i in range(n)]
    assert_close(grad, expected)
    m = out.metrics
    tokens = sum(length for _, _, length, _ in rows)
    assert num(m["clip_frac_high"], 1 / tokens) and num(m["clip_frac_low"], 2 / tokens)
    assert num(m["clip_frac_dual"], 2 / tokens) and num(m["tbpo_drop_frac"], 4 / tokens)
    assert num(m["clip_frac"], 9 / tokens)
    assert approx_metric(m["mismatch_weight_min"], E(-0.2)) and approx_metric(m["mismatch_weight_max"], E(0.2))


def test_tbpo_band_edges_are_inclusive():
    """band [1, 1]: a sequence whose sampler log-probs equal old_logp has w = exp(0) = 1 exactly and is kept; a
    mean gap of +-2^-30 nats puts w just outside on either side: dropped (value and gradient 0)."""
    tiny = 2.0 ** -30
    old = [[-1.0, -1.0]] * 3
    sampler = torch.tensor([[-1.0, -1.0], [-1.0 - tiny, -1.0 - tiny], [-1.0 + tiny, -1.0 + tiny]], dtype=DT)
    batch = make_batch(old, [[0.1, 0.1]] * 3, [[1, 1]] * 3, [1.0, 1.0, 1.0], sampler_logp=sampler)
    out, grad = run("tbpo", batch, clip_low=0.2, clip_high=0.2, band_low=1.0, band_high=1.0)
    assert num(out.loss, -E(0.1) / 3)
    assert_close(grad, [[-E(0.1) / 6] * 2, [0.0] * 2, [0.0] * 2])
    assert num(out.metrics["tbpo_drop_frac"], 4 / 6)


def test_tbpo_infinite_mismatch_drops_without_nan():
    """A sampler log-prob of -inf makes w = inf: the sequence is dropped and the gradient stays finite."""
    sampler = torch.tensor([[-1.0, -1.0], [-float("inf"), -1.0]], dtype=DT)
    batch = make_batch([[-1.0, -1.0]] * 2, [[0.1, 0.1], [0.2, 0.2]], [[1, 1]] * 2, [1.0, -1.0],
                       sampler_logp=sampler)
    out, grad = run("tbpo", batch, clip_low=0.2, clip_high=0.2)
    assert num(out.loss, -E(0.1) / 2)
    assert_close(grad, [[-E(0.1) / 4] * 2, [0.0] * 2])
    assert num(out.metrics["tbpo_drop_frac"], 0.5)


def approx_metric(metric, expected):
    return num(metric, expected, 1e-6)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_tbpo_with_sampler_logp_micro_batches_and_padding(mode):
    whole = group_batch()
    g = torch.Generator().manual_seed(5)
    whole.sampler_logp = whole.old_logp - 0.15 * torch.randn(8, 5, generator=g, dtype=DT)
    whole.sampler_logp[~whole.mask] = 40.0  # garbage on padding
    out, grad = run("tbpo", whole, aggregation=mode, clip_low=0.05, clip_high=0.05)
    assert 0 < out.metrics["tbpo_drop_frac"] < 1
    total = 0.0
    for rows in (slice(0, 3), slice(3, 8)):
        part = PolicyBatch(logp=whole.logp[rows], old_logp=whole.old_logp[rows], mask=whole.mask[rows],
                           advantages=whole.advantages[rows], sampler_logp=whole.sampler_logp[rows],
                           max_completion_len=8, group_ids=whole.group_ids[rows], **minibatch_counts(whole, rows))
        total = total + get_objective("tbpo", aggregation=mode, clip_low=0.05, clip_high=0.05)(part).loss
    assert num(total, out.loss, 1e-12)
    assert_close(grad_of(total, whole), grad, tol=1e-12)


def test_tbpo_dual_clip_fires_at_default_settings_and_verls_constant_does_not():
    """Audit item 4. Default c = 1 + clip_high: a negative sample whose geometric-mean ratio leaves the band
    [1 - clip_low, 1 + clip_high] above is dual-clipped (constant loss -A c, no gradient); just inside, it keeps its
    gradient. With verl's constant c = 3 the dual clip needs a mean log-ratio above ln 3 per token: at GSPO's clip
    scale it never fires, even for ratios far outside the band."""
    up = math.log(1 + 4e-4)
    d = [[up + 1e-6] * 2, [up - 1e-6] * 2, [0.5] * 2]  # mean log-ratios: above the band, inside it, far above
    batch = make_batch([[-1.0, -2.0]] * 3, d, [[1, 1]] * 3, [-1.0, -1.0, -1.0])
    out, grad = run("tbpo", batch)
    assert get_objective("tbpo").clip_ratio_c == 0.0
    c = 1 + 4e-4
    assert num(out.loss, (c + E(up - 1e-6) + c) / 3, 1e-12)
    assert_close(grad, [[0.0, 0.0], [E(up - 1e-6) / 6] * 2, [0.0, 0.0]])
    assert num(out.metrics["clip_frac_dual"], 4 / 6)
    # verl's constant: nothing fires at GSPO scale (mean d = 0.5 < ln 3): the negative samples keep -A s with gradient
    verl, verl_grad = run("tbpo", batch, clip_ratio_c=3.0)
    s = [E(up + 1e-6), E(up - 1e-6), E(0.5)]
    assert num(verl.loss, sum(s) / 3, 1e-12) and verl.metrics["clip_frac_dual"] == 0.0
    assert (verl_grad != 0).all()
    # ... and fires only past ln 3 per token
    edge = make_batch([[-1.0, -2.0]] * 2, [[math.log(3) - 1e-9] * 2, [math.log(3) + 1e-9] * 2], [[1, 1]] * 2,
                      [-1.0, -1.0])
    out3, grad3 = run("tbpo", edge, clip_ratio_c=3.0)
    assert num(out3.metrics["clip_frac_dual"], 0.5) and (grad3[0] != 0).all() and (grad3[1] == 0).all()
    for bad in (0.5, 1.0):
        with pytest.raises(ValueError, match="clip_ratio_c must be 0"):
            get_objective("tbpo", clip_ratio_c=bad)
