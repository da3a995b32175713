"""Rollout-correction modes against the references they claim to equal (objectives only, no harness):

- IcePop = ``token_mask`` with [C_low, C] = [0.5, 5]: verl 0.10 ``compute_rollout_correction_weights`` with
  ``rollout_is="token"``, ``rollout_is_threshold="0.5_5.0"`` (verl-project/verl 1dda039b, rollout_corr_helper.py)
  and OpenRLHF's ``icepop`` branch of ``PolicyLoss.forward`` (OpenRLHF/OpenRLHF 3c3be623, openrlhf/models/loss.py);
- the mask modes' default lower bound 1/C = verl 0.7.0's rejection-sampling mask (``compute_rollout_rejection_mask``
  with ``rollout_rs`` token / sequence and ``rollout_rs_threshold_lower=None``, tag v0.7.0);
- TRL 1.16's ``vllm_importance_sampling_clip_min`` defaults to None (the installed wheel).
Transcriptions are written out here; tensors float64.
"""

import dataclasses
import math

import pytest
import torch

from objectives import PolicyBatch, get_objective
from objectives.rollout_correction import correction_weights
from tests.helpers.objectives import DT, assert_close, num

SAFETY_BOUND = 20.0


def verl_icepop_weights(log_ratio, mask, lower, upper):
    """verl compute_rollout_correction_weights, rollout_is="token", threshold "lower_upper", no batch normalisation."""
    m = mask.to(log_ratio.dtype)
    raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * m
    kept = (raw >= lower) & (raw <= upper)
    return torch.where(kept, raw, torch.zeros_like(raw)).detach()


def openrlhf_icepop_loss(loss, old, rollout, low, high):
    """OpenRLHF PolicyLoss.forward, vllm_is_correction_type="icepop": the per-token loss times the filtered ratio."""
    vllm_is = torch.exp(old - rollout).detach()
    keep = (vllm_is >= low) & (vllm_is <= high)
    return vllm_is * keep * loss


def mismatch_batch():
    """Token ratios old / sampler at every region of [0.5, 5]: below, the edges exactly, inside, above; padding."""
    log_rho = torch.tensor([[math.log(0.4), math.log(0.5), 0.0, math.log(5.0)],
                            [math.log(5.5), math.log(1.3), math.log(0.7), 30.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    old = torch.tensor([[0.0, 0.0, -0.5, 0.0], [-1.5, -0.7, -0.2, -0.1]], dtype=DT)  # 0 where an edge is exact
    return old, old - log_rho, mask


def test_icepop_is_token_mask_with_half_and_five():
    old, sampler, mask = mismatch_batch()
    ours = correction_weights(old, sampler, mask, "token_mask", threshold=5.0, threshold_lower=0.5)
    verl = verl_icepop_weights(old - sampler, mask, 0.5, 5.0)
    assert_close(ours, verl, tol=1e-12)
    # by hand: 0.4 and 5.5 dropped, the edges 0.5 and 5 kept (inclusive), padding 0
    expected = [[0.0, 0.5, 1.0, 5.0], [0.0, 1.3, 0.7, 0.0]]
    assert_close(ours, expected, tol=1e-12)


@pytest.mark.parametrize("name,high", [("grpo", 0.2), ("dapo", 0.28)])
def test_icepop_weighted_loss_matches_openrlhf(name, high):
    """OpenRLHF multiplies its per-token PPO loss by the filtered ratio; through PolicyBatch.correction our shared
    aggregation does the same (token-mean: OpenRLHF's token_level_loss)."""
    old, sampler, mask = mismatch_batch()
    g = torch.Generator().manual_seed(3)
    logp = (old + 0.1 * torch.randn(old.shape, generator=g, dtype=DT)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.7], dtype=DT)
    weights = correction_weights(old, sampler, mask, "token_mask", threshold=5.0, threshold_lower=0.5)
    out = get_objective(name, aggregation="token_mean")(
        PolicyBatch(logp=logp, old_logp=old, mask=mask, advantages=adv, correction=weights))
    m = mask.to(DT)
    ratio = torch.exp(logp - old)
    per_token = torch.maximum(-ratio * adv[:, None], -ratio.clamp(0.8, 1 + high) * adv[:, None])
    ref = (openrlhf_icepop_loss(per_token, old, sampler, 0.5, 5.0) * m).sum() / m.sum()
    assert num(out.loss, ref, 1e-12)
    (g1,) = torch.autograd.grad(out.loss, logp, retain_graph=True)
    (g2,) = torch.autograd.grad(ref, logp)
    assert_close(g1, g2, tol=1e-12)
    assert (g1[0, 0] == 0) and (g1[1, 0] == 0) and (g1[0, 1] != 0)  # ratios 0.4 and 5.5 dropped, the edge kept


def verl_v070_rejection_mask(log_ratio, mask, level, upper, lower=None):
    """verl v0.7.0 compute_rollout_rejection_mask (token / sequence), the mask only."""
    m = mask.to(log_ratio.dtype)
    lower = 1.0 / upper if lower is None else lower
    if level == "token":
        w = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        total = (log_ratio * m).sum(-1, keepdim=True)
        w = torch.exp(torch.clamp(total, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    return ((w >= lower) & (w <= upper)) & mask


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mask_modes_default_lower_bound_is_verl_070_rejection_sampling(level):
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(12, 5, generator=g, dtype=DT)
    sampler = old - 0.5 * torch.randn(12, 5, generator=g, dtype=DT)
    mask = torch.arange(5)[None, :] < torch.randint(1, 6, (12, 1), generator=g)
    ours = correction_weights(old, sampler, mask, f"{level}_mask", threshold=2.0)
    verl = verl_v070_rejection_mask(torch.where(mask, old - sampler, 0.0), mask, level, 2.0)
    assert torch.equal(ours > 0, verl)
    assert 0 < verl.sum() < mask.sum()  # both sides of the band reached


def test_trl_clip_min_defaults_to_none():
    from trl import GRPOConfig

    field = {f.name: f for f in dataclasses.fields(GRPOConfig)}["vllm_importance_sampling_clip_min"]
    assert field.default is None
    assert {f.name: f for f in dataclasses.fields(GRPOConfig)}["vllm_importance_sampling_clip_max"].default == 3.0
