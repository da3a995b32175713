"""dppo, gpg, clip_cov, kl_cov, vespo, m2po and the aliases luspo and bnpo, each pinned in value and gradient to a
transcription of its reference code on hand-made tensors that reach every branch (masks / clip regions, both
advantage signs, padding with garbage), plus hand-computed values with ``math``. References (repository, path,
commit) are in each objective's docstring; the transcriptions below are written out from them. Tensors float64.
"""

import math

import pytest
import torch

from objectives import PolicyBatch, get_objective
from tests.helpers.objectives import DT, assert_close, make_batch, num, run

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
    out, grad = run("dppo_tv", batch, ratio_cap=20.0, aggregation="token_mean")  # delta 0.15 / 0.15 (the example's)
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


def verl_dppo(logp, old, adv, mask, low, high, cap, kind, agg="token_mean"):
    """verl compute_policy_loss_dppo_tv / _kl (no rollout IS weights) and agg_loss (token-mean, or
    seq-mean-token-sum-norm with verl's horizon = the response width), written out."""
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    truncated = torch.clamp(ratio, max=cap).detach()
    prob, old_prob = torch.exp(logp), torch.exp(old)
    if kind == "tv":
        pos_ok, neg_ok = (prob - old_prob) <= high, (prob - old_prob) >= -low
    else:
        kl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        pos_ok, neg_ok = (kl <= high) | (prob <= old_prob), (kl <= low) | (prob >= old_prob)
    valid = torch.where(adv > 0, pos_ok, neg_ok).detach().float().to(logp.dtype)
    losses = -adv * truncated * logp * valid
    if agg == "token_mean":
        return token_mean(losses, mask)
    m = mask.to(logp.dtype)
    return (losses * m).sum(-1).sum() / (m.sum(-1) > 0).sum() / mask.shape[-1]


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
    return PolicyBatch(logp=logp.requires_grad_(True), old_logp=old, mask=mask, advantages=adv, max_completion_len=t)


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("seed,asymmetric", [(0, False), (1, False), (2, True)])
@pytest.mark.parametrize("defaults", [True, False])  # the example's; verl's function fallbacks (cap 20, token-mean)
def test_dppo_matches_verl(kind, seed, asymmetric, defaults):
    batch = random_prob_batch(seed)
    name = f"dppo_{kind}"
    hp = ({"clip_low": 0.08, "clip_high": 0.25} if kind == "tv" else {"clip_low": 0.02, "clip_high": 0.2}) \
        if asymmetric else {}
    obj = get_objective(name, **hp, **({} if defaults else {"ratio_cap": 20.0, "aggregation": "token_mean"}))
    out = obj(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref = verl_dppo(batch.logp, batch.old_logp, adv, batch.mask, obj.clip_low, obj.clip_high, obj.ratio_cap, kind,
                    obj.aggregation)
    m = out.metrics
    assert m["clip_frac_high"] > 0 and m["clip_frac_low"] > 0 and (m["dppo_truncated_frac"] > 0) != defaults
    assert num(out.loss, ref, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-12)


def test_dppo_defaults_are_verls_example():
    """One source: verl's examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh (thresholds by LOSS_MODE,
    loss_agg_mode=seq-mean-token-sum-norm, clip_ratio_c=10000.0, use_kl_loss=False)."""
    assert get_objective("dppo_tv").clip_low == get_objective("dppo_tv").clip_high == 0.15
    assert get_objective("dppo_kl").clip_low == get_objective("dppo_kl").clip_high == 0.05
    for name in ("dppo_tv", "dppo_kl"):
        obj = get_objective(name)
        assert obj.ratio_cap == 10000.0 and obj.kl_coef == 0.0 and obj.surrogate == "logp"
        assert obj.aggregation == "seq_mean_token_sum_norm"
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
    setting = dict(clip_low=0.2, clip_high=0.2, kl_coef=1e-3, surrogate="ratio", aggregation="token_mean")
    out = get_objective("dppo_tv", **setting)(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref = prime_rl_default_loss(batch.logp, batch.old_logp, adv, batch.mask, 0.2, 0.2, 1e-3)
    assert num(out.loss, ref, 1e-12)
    grad = grad_of(out.loss, batch)
    assert_close(grad, grad_of(ref, batch), tol=1e-12)
    assert out.metrics["clip_frac"] > 0 and out.metrics["dppo_truncated_frac"] == 0.0
    verl_form = get_objective("dppo_tv", clip_low=0.2, clip_high=0.2, kl_coef=1e-3, ratio_cap=1e9,
                              aggregation="token_mean")(batch)
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


# ----------------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov (verl compute_policy_loss_clip_cov / _kl_cov; PRIME-RL/Entropy-Mechanism-of-RL)
# ----------------------------------------------------------------------------------------------------

def cov_batch(logp, d, adv, step=0):
    """Two rows of two valid tokens and a garbage padding column; logp given directly (old = logp - d)."""
    logp = torch.tensor([row + [40.0] for row in logp], dtype=DT)
    old = logp - torch.tensor([row + [-30.0] for row in d], dtype=DT)
    return PolicyBatch(logp=logp.requires_grad_(True), old_logp=old, mask=torch.tensor([[1, 1, 0], [1, 1, 0]]),
                       advantages=torch.tensor(adv, dtype=DT), step=step)


def test_clip_cov_hand():
    # mean A = 0, mean logp = -1.75: cov = [[2.5, -2.5], [-2.5, 2.5]]; candidates in (1, 5): (0, 0) and (1, 1), but
    # (1, 1) is already PPO-clipped (A < 0, r = e^-.5 < 0.8) and excluded; one token chosen: (0, 0)
    batch = cov_batch([[-0.5, -3.0], [-0.5, -3.0]], [[0.0, 0.0], [0.0, -0.5]], [2.0, -2.0])
    out, grad = run("clip_cov", batch, clip_low=0.2, clip_high=0.2)
    assert num(out.loss, (0.0 - 2.0 + 2.0 + 2 * 0.8) / 4)
    assert_close(grad, [[0.0, -2 / 4, 0.0], [2 / 4, 0.0, 0.0]])
    m = out.metrics
    assert num(m["clip_frac_high"], 1 / 4) and num(m["clip_frac_low"], 1 / 4) and num(m["clip_cov_frac"], 1 / 4)
    assert num(m["clip_cov_candidates"], 1 / 4)
    # the defaults: the authors' recipe (PPO clip relaxed to [0, 2]): (1, 1) is no longer PPO-clipped, it becomes a
    # candidate, and one of the two candidates is drawn
    obj = get_objective("clip_cov")
    assert (obj.clip_low, obj.clip_high, obj.clip_cov_ratio, obj.clip_cov_lb, obj.clip_cov_ub) == (1, 1, 2e-4, 1, 5)
    out, _ = run("clip_cov", batch)
    assert num(out.metrics["clip_cov_candidates"], 2 / 4) and num(out.metrics["clip_cov_frac"], 1 / 4)


def verl_clip_cov(logp, old, adv, mask, low, high, ratio_k, lb, ub, generator):
    """verl compute_policy_loss_clip_cov (token-mean), written out; the permutation from ``generator``."""
    m = mask.to(logp.dtype)
    ratio = torch.exp(logp - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip_by_origin = (pg2 > pg1) & (mask > 0)
    mean_adv = (adv * m).sum() / (m.sum() + 1e-8)
    mean_logp = (logp.detach() * m).sum() / (m.sum() + 1e-8)
    cov = (adv - mean_adv) * (logp - mean_logp)
    cov = cov.detach().clone()
    cov[mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_k * m.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    corr = torch.ones_like(adv)
    if len(idx) > 0:
        idx = idx[torch.randperm(len(idx), generator=generator)[: min(clip_num, len(idx))]]
        corr[idx[:, 0], idx[:, 1]] = 0
    return token_mean(torch.maximum(pg1, pg2) * corr, mask)


def cov_random_batch(seed, step=0):
    g = torch.Generator().manual_seed(seed)
    b, t = 16, 8
    old = -torch.rand(b, t, generator=g, dtype=DT) * 4
    logp = old + 0.4 * torch.randn(b, t, generator=g, dtype=DT)
    mask = torch.arange(t)[None, :] < torch.randint(2, t + 1, (b, 1), generator=g)
    adv = 2.5 * torch.randn(b, generator=g, dtype=DT)
    logp[~mask] = 30.0
    return PolicyBatch(logp=logp.requires_grad_(True), old_logp=old, mask=mask, advantages=adv, step=step)


@pytest.mark.parametrize("seed,step,hp", [(0, 0, {}), (1, 7, {"clip_low": 0.2, "clip_high": 0.28}),
                                          (2, 3, {"clip_cov_ratio": 0.05, "clip_low": 0.2, "clip_high": 0.2}),
                                          (3, 0, {"clip_cov_ratio": 0.05, "selection_seed": 5})])
def test_clip_cov_matches_verl(seed, step, hp):
    batch = cov_random_batch(seed, step)
    obj = get_objective("clip_cov", **hp)
    out = obj(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    generator = torch.Generator().manual_seed(obj.selection_seed * 1_000_003 + step)
    ref = verl_clip_cov(batch.logp, batch.old_logp, adv, batch.mask, obj.clip_low, obj.clip_high, obj.clip_cov_ratio,
                        obj.clip_cov_lb, obj.clip_cov_ub, generator)
    m = out.metrics
    assert m["clip_cov_frac"] > 0 and m["clip_cov_candidates"] > m["clip_cov_frac"]  # a real draw among candidates
    if hp.get("clip_low") == 0.2:
        assert m["clip_frac"] > m["clip_cov_frac"]  # PPO-clipped tokens too
    assert num(out.loss, ref, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-12)


def test_clip_cov_draw_depends_on_seed_and_step_only():
    a = get_objective("clip_cov", clip_cov_ratio=0.05)
    grads = []
    for seed, step in [(0, 0), (0, 0), (0, 1), (1, 0)]:
        batch = cov_random_batch(3, step)
        grads.append(grad_of(get_objective("clip_cov", clip_cov_ratio=0.05, selection_seed=seed)(batch).loss, batch))
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])
    assert not torch.equal(grads[0], grads[3]) and a.needs_whole_minibatch


def test_kl_cov_hand():
    # mean A = 0.5, mean logp = -1.725: cov = [[1.8375, -1.9125], [-1.9875, 1.9125]]: the top-1 is (1, 1), d = -0.5
    batch = cov_batch([[-0.5, -3.0], [-0.4, -3.0]], [[0.0, 0.0], [0.0, -0.5]], [2.0, -1.0])
    out, grad = run("kl_cov", batch)
    assert num(out.loss, (-2.0 - 2.0 + 1.0 + E(-0.5) + 0.5) / 4)
    assert_close(grad, [[-2 / 4, -2 / 4, 0.0], [1 / 4, (E(-0.5) - 1.0) / 4, 0.0]])
    m = out.metrics
    assert num(m["kl_cov_frac"], 1 / 4) and m["clip_frac"] == 0.0 and num(m["kl_cov_abs_kl"], 0.5 / 4)
    obj = get_objective("kl_cov")
    assert (obj.kl_cov_ratio, obj.kl_coef) == (2e-4, 1.0) and obj.needs_whole_minibatch
    assert num(run("kl_cov", batch, kl_cov_ratio=0.45)[0].metrics["kl_cov_frac"], 1 / 4)  # floor(1.8) = 1 token
    assert num(run("kl_cov", batch, kl_cov_ratio=0.5)[0].metrics["kl_cov_frac"], 2 / 4)


def verl_kl_cov(logp, old, adv, mask, ratio_k, coef):
    """verl compute_policy_loss_kl_cov (token-mean), written out."""
    d = logp - old
    ratio = torch.exp(d)
    pg = -adv * ratio
    pg_kl = -adv * ratio + coef * d.abs()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv[valid].detach().reshape(-1), logp[valid].detach().reshape(-1)
    cov = (a - a.mean()) * (lp - lp.mean())
    k = max(1, int(len(cov) * ratio_k))
    top = valid_idx[torch.topk(cov, k, largest=True).indices]
    pg = pg.clone()
    rows, cols = top // adv.shape[1], top % adv.shape[1]
    pg[rows, cols] = pg_kl[rows, cols]
    return token_mean(pg, mask)


@pytest.mark.parametrize("seed,hp", [(0, {}), (1, {"kl_cov_ratio": 0.1, "kl_coef": 0.3}), (2, {"kl_cov_ratio": 0.3})])
def test_kl_cov_matches_verl(seed, hp):
    batch = cov_random_batch(seed)
    obj = get_objective("kl_cov", **hp)
    out = obj(batch)
    adv = batch.advantages[:, None].expand_as(batch.logp)
    ref = verl_kl_cov(batch.logp, batch.old_logp, adv, batch.mask, obj.kl_cov_ratio, obj.kl_coef)
    assert num(out.loss, ref, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-12)


# ----------------------------------------------------------------------------------------------------
# VESPO (TRL 1.16 get_gamma_weights / _compute_loss, loss_type="vespo")
# ----------------------------------------------------------------------------------------------------

def phi(w, k, lam):
    return E(lam) * w**k * E(-lam * w)


def test_vespo_hand():
    # row 0 (A > 0): sequence log-ratio 0.1 + 0.2 = 0.3; row 1 (A < 0): -0.4 + 0.2 = -0.2 (padding slot ignored)
    old = [[-1.0, -2.0, -0.5], [-1.5, -0.7, 9.0]]
    d = [[0.1, 0.2, 0.0], [-0.4, 0.2, 7.0]]
    batch = make_batch(old, d, [[1, 1, 1], [1, 1, 0]], [1.0, -0.5])
    out, grad = run("vespo", batch)
    p0, p1 = phi(E(0.3), 2.0, 3.0), phi(E(-0.2), 3.0, 2.0)
    logp = [[-0.9, -1.8, -0.5], [-1.9, -0.5]]
    assert num(out.loss, (-p0 * sum(logp[0]) + 0.5 * p1 * sum(logp[1])) / 5)
    assert_close(grad, [[-p0 / 5] * 3, [0.5 * p1 / 5, 0.5 * p1 / 5, 0.0]])
    assert num(out.metrics["vespo_phi_mean"], (p0 + p1) / 2, 1e-6) and out.metrics["clip_frac"] == 0.0
    zero = make_batch(old, d, [[1, 1, 1], [1, 1, 0]], [0.0, -0.5])  # A = 0 takes the A >= 0 shape (TRL's)
    assert num(run("vespo", zero)[0].metrics["vespo_phi_mean"], (p0 + p1) / 2, 1e-6)
    on_policy = make_batch(old, [[0.0] * 3] * 2, [[1, 1, 1], [1, 1, 0]], [1.0, -0.5])
    assert num(run("vespo", on_policy)[0].metrics["vespo_phi_mean"], 1.0, 1e-12)  # phi(1) = 1


def trl_vespo_loss(logp, old, adv, mask, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    """TRL 1.16 get_gamma_weights + the vespo branch of _compute_loss (no vLLM IS ratio, one micro-batch)."""
    m = mask.to(logp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv
    with torch.no_grad():
        lower = math.log(1e-8)
        seq_log = torch.sum(torch.clamp(logp - old, -20.0, 20.0) * m, dim=-1, keepdim=True)
        log_w = torch.clamp(seq_log, lower, 20.0)
        w = torch.exp(log_w)
        nonneg = adv >= 0
        k = torch.where(nonneg, k_pos, k_neg)
        lam = torch.where(nonneg, lam_pos, lam_neg).clamp(min=1e-4)
        weight = torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return ((-weight * adv * logp) * m).sum() / m.sum().clamp(min=1.0)


@pytest.mark.parametrize("hp", [{}, {"k_pos": 1.5, "lambda_pos": 0.5, "k_neg": 0.1, "lambda_neg": 2.0},
                                {"k_pos": 0.5, "lambda_pos": 0.0, "k_neg": 0.5, "lambda_neg": 0.0}])  # TRL's 1e-4 floor
def test_vespo_matches_trl(hp):
    g = torch.Generator().manual_seed(8)
    b, t = 10, 6
    old = -torch.rand(b, t, generator=g, dtype=DT) * 3
    logp = old + 0.3 * torch.randn(b, t, generator=g, dtype=DT)
    logp[0] = old[0] + 5.0  # log w = 30 -> clamped at 20: phi underflows to 0
    logp[1] = old[1] - 5.0  # log w = -30 -> clamped at log 1e-8
    logp[4, :2] = old[4, :2] + torch.tensor([25.0, -24.5], dtype=DT)  # each token clamped to +-20 before the sum
    mask = torch.arange(t)[None, :] < torch.randint(2, t + 1, (b, 1), generator=g)
    logp[~mask], old[~mask] = 40.0, -40.0
    adv = torch.randn(b, generator=g, dtype=DT)
    adv[1], adv[2] = -1.0, 0.0  # row 1 (log w at the 1e-8 floor) negative: with k_neg = 0.1 the floor shows
    batch = PolicyBatch(logp=logp.requires_grad_(True), old_logp=old, mask=mask, advantages=adv)
    out = get_objective("vespo", **hp)(batch)
    kw = {"k_pos": hp.get("k_pos", 2.0), "lam_pos": hp.get("lambda_pos", 3.0), "k_neg": hp.get("k_neg", 3.0),
          "lam_neg": hp.get("lambda_neg", 2.0)}
    ref = trl_vespo_loss(batch.logp, old, adv, mask, **kw)
    assert num(out.loss, ref, 1e-12)
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-12)
    adv_t = adv[:, None].expand(b, t).clone()
    adv_t[3, 0] = -abs(adv_t[3, 0]) - 0.1  # per-token advantages of both signs in one row
    adv_t[3, 1] = abs(adv_t[3, 1]) + 0.1
    batch_t = PolicyBatch(logp=batch.logp, old_logp=old, mask=mask, advantages=adv_t)
    ref_t = trl_vespo_loss(batch.logp, old, adv_t, mask, **kw)
    out_t = get_objective("vespo", **hp)(batch_t)
    assert num(out_t.loss, ref_t, 1e-12)
    assert_close(grad_of(out_t.loss, batch_t), grad_of(ref_t, batch_t), tol=1e-12)


# ----------------------------------------------------------------------------------------------------
# LUSPO and BNPO: aliases (gspo / grpo with another default aggregation), against TRL's loss types
# ----------------------------------------------------------------------------------------------------

def test_luspo_is_gspo_with_seq_mean_token_sum_and_trls_luspo():
    from tests.helpers.objectives import trl_sequence_level_loss

    g = torch.Generator().manual_seed(9)
    old = -torch.rand(8, 6, generator=g, dtype=DT)
    batch = PolicyBatch(logp=(old + 0.01 * torch.randn(8, 6, generator=g, dtype=DT)).requires_grad_(True),
                        old_logp=old, mask=torch.arange(6)[None, :] < torch.randint(1, 7, (8, 1), generator=g),
                        advantages=torch.randn(8, generator=g, dtype=DT))
    luspo, g1 = run("luspo", batch, clip_low=0.001, clip_high=0.002)
    gspo, g2 = run("gspo", batch, clip_low=0.001, clip_high=0.002, aggregation="seq_mean_token_sum")
    ref = trl_sequence_level_loss(batch.logp, old, batch.advantages, batch.mask, 0.001, 0.002, "luspo")
    assert 0 < luspo.metrics["clip_frac"] < 1
    assert luspo.loss.item() == gspo.loss.item() and torch.equal(g1, g2)
    assert num(luspo.loss, ref, 1e-12)
    assert_close(g1, grad_of(ref, batch), tol=1e-12)
    assert get_objective("luspo").hyperparameters() == {**get_objective("gspo").hyperparameters(),
                                                        "aggregation": "seq_mean_token_sum"}


def trl_token_level_loss(logp, old, adv, mask, eps_low, eps_high, loss_type):
    """TRL 1.16 _compute_loss, importance_sampling_level="token", one micro-batch."""
    m = mask.to(logp.dtype)
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()  # grpo


def test_bnpo_is_grpo_with_token_mean_and_trls_bnpo():
    batch = cov_random_batch(4)
    bnpo, g1 = run("bnpo", batch)
    grpo, g2 = run("grpo", batch, aggregation="token_mean")
    ref = trl_token_level_loss(batch.logp, batch.old_logp, batch.advantages, batch.mask, 0.2, 0.2, "bnpo")
    assert 0 < bnpo.metrics["clip_frac"] < 1
    assert bnpo.loss.item() == grpo.loss.item() and torch.equal(g1, g2)
    assert num(bnpo.loss, ref, 1e-12)
    assert_close(g1, grad_of(ref, batch), tol=1e-12)
    assert not num(run("grpo", batch)[0].loss, ref, 1e-6)  # grpo's own default is TRL's grpo, not bnpo


# ----------------------------------------------------------------------------------------------------
# M2PO (AReaL _apply_m2po_masking / _get_m2po_loss_mask, ppo_actor_loss_fn)
# ----------------------------------------------------------------------------------------------------

def test_m2po_hand():
    # d = logp - old: row 0 (A = 1): 0.5, 0.1, -0.05; row 1 (A = -1): -0.3, 0.02 (+ padding)
    # m = 0.25, 0.01, 0.0025, 0.09, 0.0004; sorted: .25 .09 .01 .0025 .0004; suffix means: .0706, .0257, ...
    # threshold 0.04: the first suffix mean below it starts at index 1 -> drop 1 token (d = 0.5)
    old = [[-1.0, -2.0, -0.5], [-1.5, -0.7, 9.0]]
    d = [[0.5, 0.1, -0.05], [-0.3, 0.02, 7.0]]
    batch = make_batch(old, d, [[1, 1, 1], [1, 1, 0]], [1.0, -1.0])
    out, grad = run("m2po", batch)
    assert num(out.loss, (-E(0.1) - E(-0.05) + E(-0.3) + E(0.02)) / 4)  # 4 kept tokens
    assert_close(grad, [[0.0, -E(0.1) / 4, -E(-0.05) / 4], [E(-0.3) / 4, E(0.02) / 4, 0.0]])
    m = out.metrics
    assert num(m["clip_frac_high"], 1 / 5) and m["clip_frac_low"] == 0.0 and num(m["m2po_dropped_frac"], 1 / 5)
    assert num(m["m2po_m2"], (0.25 + 0.01 + 0.0025 + 0.09 + 0.0004) / 5, 1e-12)
    # threshold 0.02: drop two (.25, .09: the rest's mean .0043 < .02); 0.001: every suffix mean is above -> all but one
    assert num(run("m2po", batch, m2_threshold=0.02)[0].metrics["m2po_dropped_frac"], 2 / 5)
    low, low_grad = run("m2po", batch, m2_threshold=0.0001)
    assert num(low.metrics["m2po_dropped_frac"], 4 / 5) and num(low.loss, -E(0.02) * -1.0)
    # the loop passes the minibatch's token count: the kept tokens stay the normaliser (AReaL's)
    counted, _ = run("m2po", make_batch(old, d, [[1, 1, 1], [1, 1, 0]], [1.0, -1.0], num_tokens=5))
    assert num(counted.loss, out.loss, 1e-14)
    # a suffix mean exactly at the threshold is not below it (binary-exact m: .25, .0625 x 3; means .109, .0625 ...)
    edge = make_batch([[-1.0] * 4], [[0.5, 0.25, 0.25, 0.25]], [[1] * 4], [1.0])
    assert num(run("m2po", edge, m2_threshold=0.0625)[0].metrics["m2po_dropped_frac"], 3 / 4)
    assert num(run("m2po", edge, m2_threshold=0.0626)[0].metrics["m2po_dropped_frac"], 1 / 4)
    on_policy, on_grad = run("m2po", make_batch(old, [[0.0] * 3] * 2, [[1, 1, 1], [1, 1, 0]], [1.0, -1.0]))
    assert on_policy.metrics["m2po_dropped_frac"] == 0.0
    assert_close(on_grad, [[-1 / 5] * 3, [1 / 5, 1 / 5, 0.0]])  # the vanilla policy gradient


def test_m2po_with_sampler_logp_masks_by_the_behaviour_drift_hand():
    """With the behaviour's log-probs (old_logp = the recomputed proximal policy) m_t = (b_t - old_logp_t)^2, AReaL's
    delta, not the current policy's drift d_t: here they pick different tokens."""
    old = [[-1.0, -2.0, -0.5], [-1.5, -0.7, 9.0]]
    d = [[0.0, 0.5, 0.0], [0.0, 0.0, 7.0]]  # the current policy moved on token (0, 1) only
    sampler = torch.tensor(old, dtype=DT) + torch.tensor([[-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=DT)
    out, grad = run("m2po", make_batch(old, d, [[1, 1, 1], [1, 1, 0]], [1.0, -1.0], sampler_logp=sampler))
    # m = .25, 0, 0, 0, 0: suffix means .05, 0 ... -> drop the token of the sampler drift (0, 0), keep (0, 1)
    assert num(out.loss, (-E(0.5) - 1.0 + 1.0 + 1.0) / 4)
    assert_close(grad, [[0.0, -E(0.5) / 4, -1 / 4], [1 / 4, 1 / 4, 0.0]])
    assert num(out.metrics["m2po_dropped_frac"], 1 / 5) and num(out.metrics["m2po_m2"], 0.25 / 5, 1e-12)


def areal_m2po_example_loss(logp, old, adv, mask, threshold, upper=5.0):
    """AReaL grpo_loss_fn + ppo_actor_loss_fn as in examples/math/gsm8k_m2po.yaml with one minibatch per rollout:
    proximal = the current policy (detached), eps_clip 0, decoupled loss with token rejection sampling (ratio above
    ``upper`` masked, behaviour weight pi_prox / pi_behave), written out."""
    prox = logp.detach()
    delta = old - prox
    m2 = delta * delta
    flat = mask.reshape(-1)
    selected = m2.reshape(-1)[flat]
    sorted_m2, indices = torch.sort(selected, descending=True)
    restored = torch.argsort(indices)
    n = sorted_m2.numel()
    suffix = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    below = torch.where(suffix < threshold)[0]
    num_to_mask = below[0].item() if len(below) > 0 else n - 1
    keep_sorted = torch.ones(n, dtype=torch.bool)
    keep_sorted[:num_to_mask] = False
    full = torch.zeros_like(flat)
    full[flat] = keep_sorted[restored]
    loss_mask = full.view_as(mask)
    # rejection sampling (token, ratio, upper, mask action) on the M2-masked loss mask
    behave_w = torch.exp(prox - old)
    loss_mask = loss_mask & (behave_w <= upper)
    count = loss_mask.count_nonzero()
    ratio = torch.where(loss_mask, torch.exp(logp - prox), 0)
    clipped = torch.clamp(ratio, 1.0 - 0.0, 1.0 + 0.0)
    pg = torch.max(-adv * ratio, -adv * clipped) * behave_w
    return torch.where(loss_mask, pg, 0).sum() / count


@pytest.mark.parametrize("seed,threshold", [(0, 0.04), (1, 0.01), (2, 0.07)])
def test_m2po_matches_areals_example(seed, threshold):
    g = torch.Generator().manual_seed(seed)
    b, t = 10, 7
    old = -torch.rand(b, t, generator=g, dtype=DT) * 3
    logp = old + 0.3 * torch.randn(b, t, generator=g, dtype=DT)  # every ratio below 5 (AReaL's rejection bound)
    mask = torch.arange(t)[None, :] < torch.randint(2, t + 1, (b, 1), generator=g)
    logp[~mask] = 30.0
    adv = torch.randn(b, generator=g, dtype=DT)
    batch = PolicyBatch(logp=logp.requires_grad_(True), old_logp=old, mask=mask, advantages=adv)
    out = get_objective("m2po", m2_threshold=threshold)(batch)
    ref = areal_m2po_example_loss(batch.logp, old, adv[:, None].expand(b, t), mask, threshold)
    assert 0 < out.metrics["m2po_dropped_frac"] < 1
    assert num(out.loss, ref, 1e-12)
    # AReaL's eps_clip = 0: max(-A r, -A clamp(r, 1, 1)) at r = 1 is a tie whose two sides carry the same gradient
    # (clamp passes it at its bounds), so the gradient is the unclipped one
    assert_close(grad_of(out.loss, batch), grad_of(ref, batch), tol=1e-12)
