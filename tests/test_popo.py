"""POPO's tensor math (objectives/popo.py) against a transcription of the authors' code, momo1443/colm2026-POPO
7f22607b (``src/popo/weights.py``, ``loss.py``, ``ema.py``, ``trainer.py``): weights in both modes, with and without
length normalisation, groups with no / one / several positives; each loss term in value and gradient. float64.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from objectives.popo import (
    ema_update,
    masked_mean_pool,
    popo_entropy,
    popo_loss,
    popo_nll,
    popo_similarity,
    popo_weights,
)

DT = torch.float64
G = 4  # generations per prompt


def authors_weights(per_token_logps, completion_mask, positive_mask, num_generations, temperature=1.0,
                    weight_mode="softmax", length_normalize=False):
    """compute_popo_weights, written out (contiguous groups of num_generations)."""
    b = per_token_logps.size(0)
    p = b // num_generations
    pos = positive_mask.view(p, num_generations)
    if weight_mode == "softmax":
        seq = (per_token_logps * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)
        masked_logps = seq.view(p, num_generations).clone()
        masked_logps[~pos] = float("-inf")
        w = torch.nan_to_num(F.softmax(masked_logps / temperature, dim=-1), nan=0.0)
    else:
        w = pos.to(per_token_logps.dtype) / pos.to(per_token_logps.dtype).sum(-1, keepdim=True).clamp(min=1.0)
    if length_normalize:
        w = w / completion_mask.sum(-1).clamp(min=1.0).view(p, num_generations)
        w = w * pos.to(w.dtype)
        w = w / w.sum(-1, keepdim=True).clamp(min=1e-8)
    return w.view(b)


def authors_loss(per_token_logps, mask, weights, entropies, online, target, alpha, beta_entropy, noise):
    """POPOLoss.__call__ (nll_loss, similarity_loss with the given noise, entropy_loss), written out."""
    nll = (weights.unsqueeze(1) * -per_token_logps * mask).sum() / ((weights > 0).unsqueeze(1).to(mask.dtype)
                                                                      * mask).sum().clamp(min=1.0)
    t = target + noise
    cos = (F.normalize(online, dim=-1) * F.normalize(t, dim=-1)).sum(-1)
    sim = -(weights * cos).sum() / weights.sum().clamp(min=1e-8)
    ent = -(entropies * mask).sum() / mask.sum().clamp(min=1.0)
    return nll + alpha * sim + beta_entropy * ent


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = 3 * G, 5
    logp = -torch.rand(b, t, generator=g, dtype=DT) * 3
    mask = (torch.arange(t)[None, :] < torch.randint(1, t + 1, (b, 1), generator=g)).to(DT)
    logp = logp * mask + (1 - mask) * -1e4  # garbage on padding (finite)
    # group 0: two positives; group 1: none; group 2: all four
    rewards = torch.tensor([1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1], dtype=DT)
    return logp, mask, rewards > 0, torch.arange(3).repeat_interleave(G)


@pytest.mark.parametrize("mode", ["softmax", "uniform"])
@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_weights_match_the_authors(mode, length_normalize, temperature):
    logp, mask, positive, groups = batch()
    ours = popo_weights(logp, mask, positive, groups, temperature, mode, length_normalize)
    ref = authors_weights(logp, mask, positive, G, temperature, mode, length_normalize)
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-14)
    assert (ours[~positive] == 0).all() and (ours[4:8] == 0).all()
    for g in (0, 2):
        assert math.isclose(ours[g * G:(g + 1) * G].sum().item(), 1.0, rel_tol=1e-12)


def test_weights_by_hand_and_by_group_ids():
    logp = torch.tensor([[-1.0, -3.0], [-2.0, 0.0], [-0.5, -0.5], [-9.0, -9.0]], dtype=DT)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=DT)
    positive = torch.tensor([True, True, False, True])
    # one group; s = -2, -2, (negative), -9: softmax over positives
    w = popo_weights(logp, mask, positive, torch.zeros(4))
    z = 2 * math.exp(-2) + math.exp(-9)
    expected = [math.exp(-2) / z, math.exp(-2) / z, 0.0, math.exp(-9) / z]
    assert torch.allclose(w, torch.tensor(expected, dtype=DT), atol=1e-15)
    # non-contiguous group ids give the same weights as the authors' contiguous blocks, permuted
    logp2, mask2, positive2, groups = batch(1)
    perm = torch.randperm(len(groups), generator=torch.Generator().manual_seed(2))
    shuffled = popo_weights(logp2[perm], mask2[perm], positive2[perm], groups[perm] * 7 + 3)
    assert torch.allclose(shuffled, authors_weights(logp2, mask2, positive2, G)[perm], atol=1e-14)
    with pytest.raises(ValueError, match="weight mode"):
        popo_weights(logp, mask, positive, torch.zeros(4), mode="rank")


def test_loss_terms_match_the_authors_in_value_and_gradient():
    logp, mask, positive, groups = batch(3)
    logp = logp.clone().requires_grad_(True)
    weights = popo_weights(logp, mask, positive, groups)
    g = torch.Generator().manual_seed(4)
    entropies = (torch.rand(logp.shape, generator=g, dtype=DT) * 2).requires_grad_(True)
    online = torch.randn(len(groups), 6, generator=g, dtype=DT, requires_grad=True)
    target = torch.randn(len(groups), 6, generator=g, dtype=DT)
    noise = 0.02 * torch.randn(target.shape, generator=g, dtype=DT)
    ours = popo_loss(logp, mask, weights, entropies, online, target, alpha=0.1, beta_entropy=0.01, noise=noise)
    ref = authors_loss(logp, mask, weights.detach(), entropies, online, target, 0.1, 0.01, noise)
    assert math.isclose(ours.item(), ref.item(), rel_tol=1e-12)
    for x in (logp, entropies, online):
        (a,) = torch.autograd.grad(ours, x, retain_graph=True)
        (b,) = torch.autograd.grad(ref, x, retain_graph=True)
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)
    # by hand: the NLL counts only the positives' tokens; negatives and a group without positives add nothing
    (grad,) = torch.autograd.grad(popo_nll(logp, mask, weights), logp)
    count = (mask * positive[:, None]).sum()
    assert torch.allclose(grad, -weights[:, None] * mask / count, atol=1e-15) and (grad[~positive] == 0).all()
    assert math.isclose(popo_entropy(entropies, mask).item(), -(entropies * mask).sum().item() / mask.sum().item())
    target_grad = target.clone().requires_grad_(True)
    popo_similarity(online, target_grad, weights).backward()
    assert target_grad.grad is None  # stop-gradient on the EMA target


def test_pool_and_ema_update():
    hidden = torch.arange(24, dtype=DT).view(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=DT)
    pooled = masked_mean_pool(hidden, mask)
    assert torch.equal(pooled[0], (hidden[0, 0] + hidden[0, 1]) / 2) and torch.equal(pooled[1], hidden[1, 0])
    target, online = [torch.ones(3, dtype=DT)], [torch.full((3,), 3.0, dtype=DT)]
    ema_update(target, online, tau=0.995)
    assert torch.allclose(target[0], torch.full((3,), 0.995 + 0.005 * 3.0, dtype=DT))
    with pytest.raises(ValueError, match="tau"):
        ema_update(target, online, tau=1.5)
