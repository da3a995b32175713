"""The objectives added for issue 35, each pinned in value and gradient to a transcription of its reference code on
hand-made tensors that reach every branch (masks / clip regions, both advantage signs, padding with garbage), plus
hand-computed values with ``math``. References (repository, path, commit) are in each objective's docstring; the
transcriptions below are written out from them. Tensors float64.
"""

import math

import pytest
import torch

from objectives import PolicyBatch, get_objective
from tests.test_objectives import DT, assert_close, make_batch, num, run

E = math.exp
L = math.log


def grad_of(loss, batch):
    (grad,) = torch.autograd.grad(loss, batch.logp)
    return grad


def prob_batch(q, p, mask, adv, **kw):
    """A batch from old / new token probabilities (old_logp = log q, logp = log p); padding slots take garbage."""
    old = [[L(x) for x in row] for row in q]
    d = [[L(b) - L(a) for a, b in zip(rq, rp, strict=True)] for rq, rp in zip(q, p, strict=True)]
    return make_batch(old, d, mask, adv, **kw)


def token_mean(loss_mat, mask):
    m = mask.to(loss_mat.dtype)
    return (loss_mat * m).sum() / m.sum()


# ----------------------------------------------------------------------------------------------------
# DPPO (verl compute_policy_loss_dppo_tv / _kl; prime-rl default_loss_fn)
# ----------------------------------------------------------------------------------------------------

# q (old prob), p (new prob): row 0 A > 0, row 1 A < 0, row 2 A = 0; the last slot of rows 1, 2 is padding
DPPO_Q = [[0.5, 0.5, 0.9], [0.6, 0.01, 0.5], [0.5, 0.4, 0.5]]
DPPO_P = [[0.6, 0.7, 0.3], [0.4, 0.3, 0.999], [0.2, 0.45, 0.001]]
DPPO_MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 0]]
DPPO_ADV = [1.0, -0.5, 0.0]


def test_dppo_tv_hand():
    batch = prob_batch(DPPO_Q, DPPO_P, DPPO_MASK, DPPO_ADV)
    out, grad = run("dppo_tv", batch)  # delta 0.15 / 0.15, ratio cap 20
    # row 0 (A > 0): gap +0.1 kept; +0.2 > 0.15 masked; -0.6 kept (moving against A is never masked), r = 1/3
    # row 1 (A < 0): gap -0.2 < -0.15 masked; gap +0.29 kept, r = 30 truncated to 20
    # row 2 (A = 0): gap -0.3 masked (the A <= 0 side), +0.05 kept: no policy gradient either way
    terms = [-1.0 * 1.2 * L(0.6), -1.0 * (1 / 3) * L(0.3), 0.5 * 20 * L(0.3)]
    assert num(out.loss, sum(terms) / 7)
    assert_close(grad, [[-1.2 / 7, 0.0, -(1 / 3) / 7], [0.0, 0.5 * 20 / 7, 0.0], [0.0, 0.0, 0.0]])
    m = out.metrics
    assert num(m["clip_frac_high"], 1 / 7) and num(m["clip_frac_low"], 2 / 7) and num(m["clip_frac"], 3 / 7)
    assert num(m["dppo_truncated_frac"], 1 / 7)
    assert num(m["ratio_max"], 30.0, 1e-6)


def verl_dppo(logp, old, adv, mask, low, high, cap, kind):
    """verl compute_policy_loss_dppo_tv / _kl (token-mean, no rollout IS weights), written out."""
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    truncated = torch.clamp(ratio, max=cap).detach()
    prob, old_prob = torch.exp(logp), torch.exp(old)
    if kind == "tv":
        pos_ok, neg_ok = (prob - old_prob) <= high, (prob - old_prob) >= -low
    else:
        kl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        pos_ok, neg_ok = (kl <= high) | (prob <= old_prob), (kl <= low) | (prob >= old_prob)
    valid = torch.where(adv > 0, pos_ok, neg_ok).detach().float().to(logp.dtype)
    return token_mean(-adv * truncated * logp * valid, mask)


def random_prob_batch(seed, b=12, t=6):
    """Probabilities over the whole range, per-token moves large enough to hit every mask side, one ratio past the
    cap, padding with garbage (finite), advantages of both signs and 0."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(b, t, generator=g, dtype=DT) * 0.98 + 0.01
    p = (q + 0.4 * (torch.rand(b, t, generator=g, dtype=DT) - 0.5)).clamp(0.005, 0.995)
    q[0, 0], p[0, 0] = 0.01, 0.5  # ratio 50 > 20 (A < 0: kept, truncated)
    q[2, 0], p[2, 0] = 0.9, 0.3  # A < 0, probability fell far: masked (low side)
    q[3, 0], p[3, 0] = 0.3, 0.9  # A > 0, probability rose far: masked (high side)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g, dtype=DT)
    adv[0], adv[1], adv[2], adv[3] = -1.0, 0.0, -0.7, 0.8
    old, logp = q.log(), p.log()
    old[~mask], logp[~mask] = -3.0, -0.01  # garbage
    return PolicyBatch(logp=logp.requires_grad_(True), old_logp=old, mask=mask, advantages=adv)


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("seed,asymmetric", [(0, False), (1, False), (2, True)])
def test_dppo_matches_verl(kind, seed, asymmetric):
    batch = random_prob_batch(seed)
    name = f"dppo_{kind}"
    hp = ({"clip_low": 0.08, "clip_high": 0.25} if kind == "tv" else {"clip_low": 0.02, "clip_high": 0.2}) \
        if asymmetric else {}
    obj = get_objective(name, **hp)
    out = obj(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref = verl_dppo(batch.logp, batch.old_logp, adv, batch.mask, obj.clip_low, obj.clip_high, obj.ratio_cap, kind)
    m = out.metrics
    assert m["clip_frac_high"] > 0 and m["clip_frac_low"] > 0 and m["dppo_truncated_frac"] > 0
    assert num(out.loss, ref, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-12)


def test_dppo_defaults_are_verls_example():
    assert get_objective("dppo_tv").clip_low == get_objective("dppo_tv").clip_high == 0.15
    assert get_objective("dppo_kl").clip_low == get_objective("dppo_kl").clip_high == 0.05
    for name in ("dppo_tv", "dppo_kl"):
        obj = get_objective(name)
        assert obj.ratio_cap == 20.0 and obj.kl_coef == 0.0 and obj.surrogate == "logp"
        assert obj.aggregation == "token_mean"
    with pytest.raises(ValueError, match="surrogate must be one of"):
        get_objective("dppo_tv", surrogate="clip")
    with pytest.raises(ValueError, match="ratio_cap must be > 0"):
        get_objective("dppo_kl", ratio_cap=0.0)


def prime_rl_default_loss(trainer, inference, adv, mask, low, high, kl_tau, adv_tau=1.0):
    """prime-rl default_loss_fn per sample (summed), then divided by the global token count (compute_loss)."""
    log_r = trainer - inference
    ratio = torch.exp(log_r)
    diff = torch.exp(trainer) - torch.exp(inference)
    invalid = torch.where(adv > 0, diff > high, diff < -low)
    keep = mask & ~invalid
    per_token = -(keep * (adv_tau * adv) * ratio) + kl_tau * (mask * log_r**2)
    return per_token.sum() / mask.sum()


@pytest.mark.parametrize("seed", [0, 3])
def test_dppo_tv_prime_rl_setting_matches_prime_rl(seed):
    """prime-rl's default loss = dppo_tv clip 0.2 / 0.2, kl_coef 1e-3, surrogate ratio: value and gradient; verl's
    surrogate has the same gradient with the truncation off and the same KL term, not the same value."""
    batch = random_prob_batch(seed)
    setting = dict(clip_low=0.2, clip_high=0.2, kl_coef=1e-3, surrogate="ratio")
    out = get_objective("dppo_tv", **setting)(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref = prime_rl_default_loss(batch.logp, batch.old_logp, adv, batch.mask, 0.2, 0.2, 1e-3)
    assert num(out.loss, ref, 1e-12)
    grad = grad_of(out.loss, batch)
    assert_close(grad, grad_of(ref, batch), tol=1e-12)
    assert out.metrics["clip_frac"] > 0 and out.metrics["dppo_truncated_frac"] == 0.0
    verl_form = get_objective("dppo_tv", clip_low=0.2, clip_high=0.2, kl_coef=1e-3, ratio_cap=1e9)(batch)
    assert_close(grad_of(verl_form.loss, batch), grad, tol=1e-12)
    assert not num(verl_form.loss, out.loss, 1e-3)


# ----------------------------------------------------------------------------------------------------
# GPG (verl compute_policy_loss_gpg)
# ----------------------------------------------------------------------------------------------------

def test_gpg_hand_and_verl():
    old = [[-1.0, -2.0, -0.5], [-1.5, -0.7, 9.0]]
    d = [[0.1, 0.3, -0.1], [-0.4, 0.2, 7.0]]
    batch = make_batch(old, d, [[1, 1, 1], [1, 1, 0]], [1.0, -0.5])
    out, grad = run("gpg", batch)
    logp = [[-0.9, -1.7, -0.6], [-1.9, -0.5]]
    assert num(out.loss, (-sum(logp[0]) + 0.5 * sum(logp[1])) / 5)
    assert_close(grad, [[-1 / 5] * 3, [0.5 / 5, 0.5 / 5, 0.0]])  # no ratio: old_logp plays no part
    assert out.metrics["clip_frac"] == 0.0 and get_objective("gpg").default_advantage == "gpg"
    m = batch.mask.to(DT)
    for mode, verl in [("token_mean", token_mean(-batch.logp * batch.advantages[:, None], batch.mask)),
                       ("seq_mean_token_mean",  # the authors' trainer
                        ((-batch.logp * batch.advantages[:, None] * m).sum(-1) / m.sum(-1)).mean())]:
        out, grad = run("gpg", batch, aggregation=mode)
        assert num(out.loss, verl, 1e-12)
        assert_close(grad, grad_of(verl, batch), tol=1e-12)
