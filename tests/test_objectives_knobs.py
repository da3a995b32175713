"""Knobs every objective has: the reference-KL estimator (verl's ``kl_loss_type``), off-policy sequence
masking (OPSM: TRL 1.16 ``off_policy_mask_threshold``, DeepSeek-V3.2 Eq. 9) and the aggregation modes, each pinned to
a transcription of the reference code on hand-made tensors (float64, value and gradient).

References read: verl ``verl/trainer/ppo/core_algos.py`` (``kl_penalty``, ``kl_penalty_forward``, ``agg_loss``) at
verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9 (0.10.0.dev); TRL 1.16.0 ``trl/trainer/grpo_trainer.py``
(``get_off_policy_mask``, ``_compute_loss``), the installed wheel.
"""

import dataclasses
import math

import pytest
import torch

from objectives import PolicyBatch, get_objective
from objectives.base import AGGREGATIONS, KL_ESTIMATORS, reference_kl
from tests.helpers.objectives import (
    ADV,
    DT,
    MASK,
    OLD,
    ON_BATCHES,
    D,
    assert_close,
    group_batch,
    make_batch,
    num,
    random_batch,
    run,
    trl_sequence_level_loss,
)

E = math.exp


def grad_of(loss, batch):
    (grad,) = torch.autograd.grad(loss, batch.logp)
    return grad


# ----------------------------------------------------------------------------------------------------
# The reference-KL estimator (verl kl_penalty)
# ----------------------------------------------------------------------------------------------------

def verl_kl_penalty(logprob, ref_logprob, kind):
    """verl's kl_penalty(logprob, ref_logprob, kl_penalty), written out: the forward estimate of the named kind and,
    for a '+' suffix (except k2 / mse), a straight-through k2 gradient."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base in ("kl", "k1"):
        forward = logprob - ref_logprob
    elif base == "abs":
        forward = (logprob - ref_logprob).abs()
    elif base in ("mse", "k2"):
        forward = 0.5 * (logprob - ref_logprob).square()
    elif base in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        forward = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    else:
        raise NotImplementedError(kind)
    if not kind.endswith("+") or kind in ("mse+", "k2+"):
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


def kl_batch():
    """Two sequences (lengths 4 and 2, garbage on padding) whose log-ratio to the reference reaches every branch:
    both signs, |ref - logp| > 20 (verl's log clamp) and exp(ref - logp) - ... > 10 (verl's value clamp)."""
    old = [[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.7, 9.0, 40.0]]
    d = [[0.1, 0.3, -0.1, 0.0], [-0.4, 0.2, 7.0, -3.0]]
    logp = [[o + x for o, x in zip(ro, rd, strict=True)] for ro, rd in zip(old, d, strict=True)]
    offsets = [[0.3, -0.2, 3.0, -25.0], [22.0, -1.5, 0.0, 0.0]]  # ref - logp on valid tokens
    ref = torch.tensor([[lp + o for lp, o in zip(rl, ro, strict=True)] for rl, ro in zip(logp, offsets, strict=True)],
                       dtype=DT)
    ref[1, 2:] = 1e3  # garbage on padding
    return make_batch(old, d, [[1, 1, 1, 1], [1, 1, 0, 0]], [1.0, -0.5], ref_logp=ref)


ALL_KL = [*KL_ESTIMATORS, *(k + "+" for k in KL_ESTIMATORS)]


@pytest.mark.parametrize("estimator", ALL_KL)
def test_kl_estimator_matches_verl_value_and_gradient(estimator):
    batch = kl_batch()
    beta = 0.3
    plain, plain_grad = run("grpo", batch)
    out, grad = run("grpo", batch, beta=beta, kl_estimator=estimator)
    # verl's "k3" is its clamped low_var_kl; ours is the unclamped form (the default, TRL's), pinned by hand below
    verl_name = "low_var_kl" + estimator[2:] if estimator.startswith("k3") else estimator
    ref = verl_kl_penalty(batch.logp, batch.ref_logp, verl_name)
    m = batch.mask.to(DT)
    expected_kl = (((ref * m).sum(-1) / m.sum(-1)).mean())  # seq-mean-token-mean, grpo's aggregation
    if not estimator.startswith("k3"):
        assert num(out.loss - plain.loss, beta * expected_kl, 1e-12)
        assert_close(grad - plain_grad, beta * grad_of(expected_kl, batch), tol=1e-12)
        assert num(out.metrics["kl_ref"], (ref * m).sum().item() / m.sum().item(), 1e-12)
    if estimator.endswith("+"):  # straight-through: the gradient is k2's, (logp - ref) per token
        k2 = verl_kl_penalty(batch.logp, batch.ref_logp, "k2")
        assert_close(grad - plain_grad, beta * grad_of(((k2 * m).sum(-1) / m.sum(-1)).mean(), batch), tol=1e-12)


def test_k3_default_is_unclamped_and_low_var_kl_is_verls_clamped_k3():
    batch = kl_batch()
    assert get_objective("grpo").kl_estimator == "k3"
    x = [[-0.3, 0.2, -3.0, 25.0], [-22.0, 1.5]]  # logp - ref on valid tokens
    k3 = reference_kl(batch, "k3")
    for i, row in enumerate(x):
        for t, v in enumerate(row):
            assert num(k3[i, t], E(-v) + v - 1, 1e-12)  # the formula the objectives always had
    low = reference_kl(batch, "low_var_kl")
    assert num(low[0, 2], 10.0) and num(low[1, 0], 10.0)  # e^3 - 4 = 16.1 and e^20 - 21: value clamp at 10
    assert num(low[0, 3], 10.0)  # ref - logp = -25: 24 (19 after the log clamp at -20), clamped to 10
    assert num(k3[0, 3], E(-25) + 25 - 1, 1e-12) and k3[1, 0] > 1e9  # k3: no clamp
    (g_low,) = torch.autograd.grad(low[0, 2] + low[1, 0] + low[0, 0], batch.logp)
    assert g_low[0, 2] == 0 and g_low[1, 0] == 0 and g_low[0, 0] != 0  # the clamps stop the gradient
    assert (reference_kl(batch, "k1")[1, 2:] == 0).all() and (k3[1, 2:] == 0).all()  # 0 on padding


def test_kl_estimator_hand_values_and_plus_gradient():
    batch = make_batch([[-1.0]], [[0.0]], [[1]], [0.0], ref_logp=torch.tensor([[-1.5]], dtype=DT))
    x = 0.5  # logp - ref
    for name, value in [("k1", x), ("kl", x), ("k2", x * x / 2), ("mse", x * x / 2), ("abs", x),
                        ("k3", E(-x) + x - 1), ("low_var_kl", E(-x) + x - 1)]:
        for suffix in ("", "+"):
            kl = reference_kl(batch, name + suffix)
            assert num(kl[0, 0], value, 1e-14), name + suffix
            (g,) = torch.autograd.grad(kl.sum(), batch.logp)
            exact = {"k1": 1.0, "kl": 1.0, "k2": x, "mse": x, "abs": 1.0, "k3": 1 - E(-x), "low_var_kl": 1 - E(-x)}
            assert num(g[0, 0], x if suffix else exact[name], 1e-14), name + suffix


def test_kl_estimator_is_refused_clearly():
    for bad in ("k4", "k3++", "KL", ""):
        with pytest.raises(ValueError, match="kl_estimator.*choose one of k3, k1, kl, k2, mse, low_var_kl, abs"):
            get_objective("gspo", kl_estimator=bad)
    with pytest.raises(TypeError, match="kl_estimator must be a string"):
        get_objective("grpo", kl_estimator=3)


@pytest.mark.parametrize("estimator", ["k1+", "low_var_kl", "abs"])
def test_kl_estimator_reaches_every_objective(estimator):
    """One place: the base class applies the estimator for every registered objective (the KL term differs from
    k3's by exactly beta * aggregate(estimator - k3))."""

    for name in ON_BATCHES:
        batch = group_batch()
        k3, _ = run(name, batch, beta=0.1)
        other, _ = run(name, batch, beta=0.1, kl_estimator=estimator)
        obj = get_objective(name, beta=0.1)
        from objectives.base import aggregate

        diff = aggregate(reference_kl(batch, estimator) - reference_kl(batch, "k3"), batch,
                         obj.kl_aggregation or obj.aggregation, correct=False)
        assert num(other.loss - k3.loss, 0.1 * diff, 1e-12), name


# ----------------------------------------------------------------------------------------------------
# Off-policy sequence masking (TRL get_off_policy_mask)
# ----------------------------------------------------------------------------------------------------

def trl_opsm_grpo_loss(logp, old, sampler, adv, mask, eps, delta, beta=0.0, ref=None):
    """TRL 1.16 _compute_loss with loss_type="grpo", importance_sampling_level="token", off_policy_mask_threshold=delta,
    use_bias_correction_kl=False, written out (advantages (B, 1) or (B, T))."""
    m = mask.to(logp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv
    kl_div = torch.nan_to_num(sampler - logp.detach(), nan=0.0)
    avg = (kl_div * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
    keep = ((adv >= 0) | (avg <= delta)).to(m.dtype)
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv) * keep
    if beta:
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean(), keep


def opsm_batch(advantages=None, with_sampler=True):
    """Five sequences: A < 0 with high drift (masked), A < 0 with low drift (kept), A > 0 with high drift (kept),
    A = 0 with high drift (kept: A >= 0), A < 0 with drift exactly at delta (kept: <=); garbage on padding."""
    old = torch.tensor([[-1.0, -2.0, -0.5]] * 5, dtype=DT)
    d = torch.tensor([[0.1, -0.2, 0.05], [0.0, 0.1, -0.1], [-0.3, 0.2, 0.1], [0.2, 0.2, 0.2], [0.125, 0.25, 9.0]],
                     dtype=DT)
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]]).bool()
    # drift = mean_t(sampler - logp): rows 0, 2, 3 at 1.0 (> 0.5), row 1 at 0.1, row 4 exactly 0.5 (binary-exact)
    drift = torch.tensor([1.0, 0.1, 1.0, 1.0, 0.5], dtype=DT)
    logp = old + d
    sampler = logp + drift[:, None]
    sampler[~mask] = 77.0
    adv = torch.tensor([-1.0, -0.5, 1.0, 0.0, -2.0], dtype=DT) if advantages is None else advantages
    batch = PolicyBatch(logp=logp.clone().requires_grad_(True), old_logp=old if not with_sampler else old.clone(),
                        mask=mask, advantages=adv, sampler_logp=sampler if with_sampler else None,
                        ref_logp=old - 0.1)
    return batch, sampler


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_opsm_matches_trl(beta):
    batch, sampler = opsm_batch()
    out, grad = run("grpo", batch, beta=beta, off_policy_mask=True, off_policy_mask_threshold=0.5)
    ref, keep = trl_opsm_grpo_loss(batch.logp, batch.old_logp, sampler, batch.advantages, batch.mask, 0.2, 0.5,
                                   beta=beta, ref=batch.ref_logp)
    assert keep[:, 0].tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert num(out.loss, ref, 1e-12)
    assert_close(grad, grad_of(ref, batch), tol=1e-12)
    assert num(out.metrics["off_policy_masked_frac"], 3 / 13)
    assert (grad[0] == 0).all() if beta == 0 else (grad[0] != 0).all()  # the KL term is not masked


def test_opsm_falls_back_to_old_logp_and_takes_token_advantages():
    batch, _ = opsm_batch(with_sampler=False)
    batch.old_logp = batch.logp.detach() + torch.tensor([1.0, 0.1, 1.0, 1.0, 0.5], dtype=DT)[:, None]
    # (cispo: every token keeps a gradient, whatever its ratio, so the mask alone removes row 0's)
    out, grad = run("cispo", batch, off_policy_mask=True)
    plain, plain_grad = run("cispo", batch)
    assert (grad[0] == 0).all() and (plain_grad[0] != 0).all() and (grad[1:] == plain_grad[1:]).all()
    batch.correction = batch.mask.to(DT) * torch.tensor([0.0, 1, 1, 1, 1], dtype=DT)[:, None]
    assert num(out.loss, run("cispo", batch)[0].loss, 1e-14)
    # per-token advantages: only the A < 0 tokens of a drifting sequence are dropped (TRL's broadcast)
    adv = torch.tensor([[-1.0, 1.0, -1.0]] + [[0.5, 0.5, 0.5]] * 4, dtype=DT)
    batch, sampler = opsm_batch(advantages=adv)
    out, grad = run("grpo", batch, off_policy_mask=True)
    ref, keep = trl_opsm_grpo_loss(batch.logp, batch.old_logp, sampler, adv, batch.mask, 0.2, 0.5)
    assert keep[0].tolist() == [0.0, 1.0, 0.0] and num(out.loss, ref, 1e-12)
    assert_close(grad, grad_of(ref, batch), tol=1e-12)


def test_opsm_off_changes_nothing_and_composes_with_rollout_correction():
    batch, _ = opsm_batch()
    a, ga = run("gspo", batch, clip_low=0.2, clip_high=0.2)
    b, gb = run("gspo", batch, clip_low=0.2, clip_high=0.2, off_policy_mask_threshold=0.0)  # threshold alone: off
    assert a.loss.item() == b.loss.item() and torch.equal(ga, gb) and "off_policy_masked_frac" not in b.metrics
    batch.correction = torch.full_like(batch.logp, 0.5).masked_fill(~batch.mask, 0.0)
    c, gc = run("gspo", batch, clip_low=0.2, clip_high=0.2, off_policy_mask=True)
    batch.correction = batch.correction * torch.tensor([0.0, 1, 1, 1, 1], dtype=DT)[:, None]
    d, gd = run("gspo", batch, clip_low=0.2, clip_high=0.2)
    assert num(c.loss, d.loss, 1e-14) and torch.equal(gc, gd)


# ----------------------------------------------------------------------------------------------------
# Aggregation: our modes against verl's agg_loss and TRL's sequence-level loss types
# ----------------------------------------------------------------------------------------------------

def verl_agg_loss(loss_mat, loss_mask, mode, scale=None):
    """verl agg_loss (dp_size 1, no global batch info), written out."""
    m = loss_mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq = (loss_mat * m).sum(-1)
        seq_mask = (m.sum(-1) > 0).to(m.dtype)
        out = (seq * seq_mask).sum() / seq_mask.sum()
        return out / (scale or m.shape[-1]) if mode.endswith("norm") else out
    seq = (loss_mat * m).sum(-1) / (m.sum(-1) + 1e-8)
    seq_mask = (m.sum(-1) > 0).to(m.dtype)
    return (seq * seq_mask).sum() / seq_mask.sum()


@pytest.mark.parametrize("mode", [m for m in AGGREGATIONS if m != "prompt_mean"])  # verl has none: SkyRL's below
def test_aggregation_modes_match_verl_agg_loss(mode):
    batch = random_batch(seed=21, scale=0.3, b=6, t=5, max_completion_len=7)
    out, grad = run("grpo", batch, aggregation=mode)
    ratio = torch.exp(batch.logp - batch.old_logp)
    adv = batch.advantages[:, None]
    loss_mat = torch.maximum(-ratio * adv, -ratio.clamp(0.8, 1.2) * adv)
    verl_mode = mode.replace("_", "-")
    ref = verl_agg_loss(loss_mat, batch.mask, verl_mode, scale=7)
    tol = 1e-8 if mode == "seq_mean_token_mean" else 1e-13  # verl adds 1e-8 to L_i there
    assert num(out.loss, ref, tol)
    assert_close(grad, grad_of(ref, batch), tol=tol)


def skyrl_prompt_mean(advantages, loss_mask, prompt_boundaries):
    """SkyRL's ``apply_loss_reduction_to_advantages_minibatch`` with ``loss_reduction="prompt_mean"`` (NovaSky-AI/SkyRL
    a9564572e, skyrl/backends/skyrl_train/utils/ppo_utils.py), written out: each prompt's advantages [rows, T] divided
    by (prompts x the prompt's valid tokens); its policy loss then sums the per-token loss (``reduce_loss``)."""
    scaled = torch.zeros_like(advantages)
    for start, end in prompt_boundaries:
        scaled[start:end] = advantages[start:end] / (len(prompt_boundaries) * loss_mask[start:end].sum().clamp(min=1))
    return scaled


@pytest.mark.parametrize("dual_clip", [False, True])
def test_prompt_mean_is_skyrls(dual_clip):
    """Three prompts of 3, 2 and 3 completions of unequal lengths (one prompt's completions all short), ratios on
    both sides of the clip, negative advantages under the dual clip: GRPO's loss and gradient with
    aggregation=prompt_mean equal SkyRL's ppo_policy_loss on its prompt_mean-scaled advantages."""
    batch = random_batch(seed=4, scale=0.4, b=8, t=6)
    batch.mask = torch.arange(6)[None, :] < torch.tensor([6, 2, 5, 1, 1, 3, 6, 4])[:, None]
    batch.group_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    out, grad = run("grpo", batch, aggregation="prompt_mean", dual_clip=dual_clip, clip_ratio_c=1.5)
    m = batch.mask.to(DT)
    adv = skyrl_prompt_mean(batch.advantages[:, None].expand_as(m), m, [(0, 3), (3, 5), (5, 8)])
    ratio = torch.exp(batch.logp - batch.old_logp)
    loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    if dual_clip:
        loss = torch.where(adv < 0, torch.min(-adv * 1.5, loss), loss)
    ref = (loss * m).sum()
    assert 0 < out.metrics["clip_frac"] and (not dual_clip or out.metrics["clip_frac_dual"] > 0)
    assert num(out.loss, ref, 1e-13)
    assert_close(grad, grad_of(ref, batch), tol=1e-13)
    with pytest.raises(ValueError, match="prompt_mean needs PolicyBatch.group_ids"):
        get_objective("grpo", aggregation="prompt_mean")(dataclasses.replace(batch, group_ids=None))


@pytest.mark.parametrize("loss_type,mode", [("grpo", "seq_mean_token_mean"), ("dapo", "token_mean"),
                                            ("bnpo", "token_mean"), ("dr_grpo", "seq_mean_token_sum_norm"),
                                            ("luspo", "seq_mean_token_sum")])
def test_gspo_aggregations_are_trls_sequence_level_loss_types(loss_type, mode):
    """Audit item 2: gspo with aggregation=token_mean is TRL's sequence-level loss with loss_type dapo / bnpo (not
    verl's gspo with loss_agg_mode=token-mean: verl's gspo hard-codes seq-mean-token-mean)."""
    batch = random_batch(seed=22, scale=0.02, b=8, t=6)
    out, grad = run("gspo", batch, aggregation=mode, clip_low=0.002, clip_high=0.003)
    ref = trl_sequence_level_loss(batch.logp, batch.old_logp, batch.advantages, batch.mask, 0.002, 0.003, loss_type)
    assert 0 < out.metrics["clip_frac"] < 1  # some sequences clipped, some not
    assert num(out.loss, ref, 1e-12)
    assert_close(grad, grad_of(ref, batch), tol=1e-12)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
@pytest.mark.parametrize("loss_type,mode", [("grpo", "seq_mean_token_mean"), ("dapo", "token_mean"),
                                            ("dr_grpo", "seq_mean_token_sum_norm"), ("luspo", "seq_mean_token_sum")])
def test_a_row_without_valid_tokens_counts_in_n_seqs_and_adds_nothing_as_in_trl(name, loss_type, mode):
    """A row whose mask is all zero (its advantage nonzero) adds 0 to TRL's sequence-level loss, whose (B, 1) loss is
    broadcast over the row's empty mask, and still counts in N_seqs: the same in every mode, and gspo equals
    gspo_token there as elsewhere."""
    old = OLD + [[-1.0, -1.0, -1.0]]
    batch = make_batch(old, D + [[0.5, 0.5, 0.5]], MASK + [[0, 0, 0]], ADV + [2.0])
    out, grad = run(name, batch, aggregation=mode, clip_low=0.2, clip_high=0.2)
    ref = trl_sequence_level_loss(batch.logp, batch.old_logp, batch.advantages, batch.mask, 0.2, 0.2, loss_type)
    assert num(out.loss, ref, 1e-12)
    assert_close(grad, grad_of(ref, batch), tol=1e-12)
    if mode == "seq_mean_token_mean":  # by hand: s = e^.1 and e^-.1 (unclipped at 0.2), over N_seqs = 3
        assert num(out.loss, (-E(0.1) + 0.5 * E(-0.1)) / 3)


def test_grpo_counts_a_row_without_valid_tokens_in_n_seqs():
    """The grpo hand case of tests/test_objectives.py with a third row of padding only: seq-mean-token-mean divides by
    the 3 rows (TRL's ``.mean()`` over rows; verl's sequence means would leave the empty row out)."""
    batch = make_batch(OLD + [[-1.0, -1.0, -1.0]], D + [[0.5, 0.5, 0.5]], MASK + [[0, 0, 0]], ADV + [2.0])
    out, grad = run("grpo", batch)
    seq0 = (-E(0.1) - 1.2 - E(-0.1)) / 3
    seq1 = (0.5 * 0.8 + 0.5 * E(0.2)) / 2
    assert num(out.loss, (seq0 + seq1) / 3)
    assert_close(grad, [[-E(0.1) / 9, 0.0, -E(-0.1) / 9], [0.0, 0.5 * E(0.2) / 6, 0.0], [0.0, 0.0, 0.0]])


def test_verl_gspo_ignores_loss_agg_mode():
    """verl's compute_policy_loss_gspo passes loss_agg_mode="seq-mean-token-mean" to agg_loss whatever it is given:
    its value equals our default gspo, and differs from our token_mean for sequences of different lengths."""
    batch = make_batch(OLD, D, MASK, ADV)
    m = batch.mask.to(DT)
    seq = ((batch.logp - batch.old_logp) * m).sum(-1) / m.sum(-1)
    s = torch.exp(batch.logp - batch.logp.detach() + seq.detach()[:, None])
    adv = batch.advantages[:, None]
    loss_mat = torch.maximum(-adv * s, -adv * s.clamp(0.8, 1.2))
    verl = verl_agg_loss(loss_mat, batch.mask, "seq-mean-token-mean")  # what verl runs for "token-mean" too
    default, _ = run("gspo", batch, clip_low=0.2, clip_high=0.2)
    token_mean, _ = run("gspo", batch, clip_low=0.2, clip_high=0.2, aggregation="token_mean")
    assert num(default.loss, verl, 1e-8) and not num(token_mean.loss, verl, 1e-3)  # verl: L_i + 1e-8


def test_seq_mean_token_sum_hand_and_micro_batches():
    out, grad = run("grpo", make_batch(OLD, D, MASK, ADV), aggregation="seq_mean_token_sum")
    # the grpo hand case of tests/test_objectives.py, token sums over N_seqs = 2
    assert num(out.loss, (-E(0.1) - 1.2 - E(-0.1) + 0.5 * 0.8 + 0.5 * E(0.2)) / 2)
    assert_close(grad, [[-E(0.1) / 2, 0.0, -E(-0.1) / 2], [0.0, 0.5 * E(0.2) / 2, 0.0]])


# ----------------------------------------------------------------------------------------------------
# Entropy bonus and top-entropy token masking (TRL 1.16 entropy_coef, top_entropy_quantile)
# ----------------------------------------------------------------------------------------------------

def trl_entropy_grpo_loss(logp, old, adv, mask, entropy, eps, quantile, coef, beta=0.0, ref=None):
    """TRL 1.16 _compute_loss, loss_type="grpo", token level, use_bias_correction_kl=False, with top_entropy_quantile
    (get_high_entropy_mask(entropies, mask, 1 - quantile), one process) and entropy_coef (static), written out."""
    m = mask.to(logp.dtype)
    entropy_mask = None
    if quantile < 1.0:
        local = entropy[mask.bool()].float()
        threshold = torch.quantile(local, 1 - quantile)
        entropy_mask = ((entropy * m) >= threshold) & mask.bool()
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if beta:
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if coef:
        effective = m if entropy_mask is None else m * entropy_mask
        loss = loss - coef * (entropy * effective).sum() / effective.sum().clamp(min=1.0)
    return loss, entropy_mask


def entropy_batch():
    """Three sequences (lengths 4, 3, 2; garbage on padding), ratios in and out of the clip range, both advantage
    signs, entropies a differentiable function of a leaf (so the bonus has a gradient of its own); two tokens share
    the entropy 1.5; binary-exact entropies (TRL's quantile is taken in float32)."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.2], [-0.3, -1.1, -2.2, 5.0], [-0.8, -0.4, 9.0, 9.0]], dtype=DT)
    d = torch.tensor([[0.3, -0.1, 0.05, -0.4], [0.0, 0.25, -0.3, 3.0], [0.1, -0.5, 2.0, 2.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]).bool()
    h = torch.tensor([[0.25, 1.5, 0.875, 2.375], [1.5, 0.125, 3.0, 7.0], [0.625, 1.125, 8.0, 8.0]], dtype=DT)
    h.requires_grad_(True)
    logp = (old + d).requires_grad_(True)
    entropy = (h * 1.0).masked_fill(~mask, 0.0)
    batch = PolicyBatch(logp=logp, old_logp=old, mask=mask, advantages=torch.tensor([1.0, -0.7, 0.4], dtype=DT),
                        entropy=entropy, ref_logp=old - 0.2)
    return batch, h


@pytest.mark.parametrize("quantile, coef, beta", [(1.0, 0.1, 0.0), (0.5, 0.0, 0.0), (0.5, 0.1, 0.05),
                                                  (0.0, 0.1, 0.0), (0.2, 0.3, 0.0)])
def test_entropy_bonus_and_top_entropy_mask_match_trl(quantile, coef, beta):
    batch, h = entropy_batch()
    out = get_objective("grpo", top_entropy_quantile=quantile, entropy_coef=coef, beta=beta)(batch)
    ref, keep = trl_entropy_grpo_loss(batch.logp, batch.old_logp, batch.advantages, batch.mask, batch.entropy, 0.2,
                                      quantile, coef, beta=beta, ref=batch.ref_logp)
    assert num(out.loss, ref, 1e-12)
    ours = torch.autograd.grad(out.loss, [batch.logp, h], retain_graph=True, allow_unused=True)
    theirs = torch.autograd.grad(ref, [batch.logp, h], allow_unused=True)
    ours, theirs = ([torch.zeros_like(h) if g is None else g for g in grads] for grads in (ours, theirs))
    for a, b in zip(ours, theirs, strict=True):
        assert_close(a, b, tol=1e-12)
    assert (ours[1].abs().sum() > 0) == (coef > 0)  # the bonus, and only it, differentiates the entropy
    if keep is not None:
        assert num(out.metrics["entropy_masked_frac"], 1 - keep.sum().item() / 9)
        assert (ours[0][~keep] == 0).all() if beta == 0 else (ours[0][~keep & batch.mask] != 0).all()  # KL unmasked
    # by hand: the median of the 9 entropies (1/8 1/4 5/8 7/8 9/8 3/2 3/2 19/8 3) is 9/8, both 3/2 kept;
    # quantile 0 keeps only the highest (3.0)
    expected = {0.5: [[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 0]], 0.0: [[0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]}
    if quantile in expected:
        assert keep.tolist() == [[bool(x) for x in row] for row in expected[quantile]]


def test_entropy_knobs_off_change_nothing_and_errors_are_clear():
    batch, _ = entropy_batch()
    plain = get_objective("gspo")(batch)
    batch.entropy = None
    off = get_objective("gspo", top_entropy_quantile=1.0, entropy_coef=0.0)(batch)
    assert plain.loss.item() == off.loss.item() and "entropy_bonus" not in off.metrics
    assert get_objective("grpo").entropy_need() == "" and not get_objective("grpo").needs_minibatch_at_once()
    assert get_objective("grpo", top_entropy_quantile=0.2).entropy_need() == "value"
    assert get_objective("grpo", top_entropy_quantile=0.2).needs_minibatch_at_once()
    assert get_objective("grpo", entropy_coef=0.01, top_entropy_quantile=0.2).entropy_need() == "gradient"
    with pytest.raises(ValueError, match=r"entropy bonus \(entropy_coef=0.1, or an adaptive coefficient\) but the "
                       "batch has no entropy"):
        get_objective("grpo", entropy_coef=0.1)(batch)
    with pytest.raises(ValueError, match="top_entropy_quantile must be in"):
        get_objective("grpo", top_entropy_quantile=1.5)


def test_entropy_bonus_sums_over_micro_batches_to_the_minibatch_mean():
    batch, h = entropy_batch()
    whole = get_objective("dapo", entropy_coef=0.2)(batch)
    parts = [get_objective("dapo", entropy_coef=0.2)(PolicyBatch(
        logp=batch.logp[rows], old_logp=batch.old_logp[rows], mask=batch.mask[rows], advantages=batch.advantages[rows],
        entropy=batch.entropy[rows], num_tokens=batch.mask.sum(), num_sequences=3)) for rows in ([0], [1, 2])]
    assert num(whole.loss, sum(p.loss for p in parts), 1e-12)
