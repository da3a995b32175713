"""Hand-made policy batches for the objectives' tests (tests/test_objectives*.py, test_rollout_correction*.py):
float64 tensors small enough to check by hand, and the comparison helpers."""

from __future__ import annotations

import math

import torch

from objectives import OBJECTIVES, PolicyBatch, available_objectives, get_advantage, get_objective
from objectives.base import group_totals

DT = torch.float64
# the objectives a hand-made PolicyBatch evaluates: all but those that read the policy's hidden states (POPO, tested in
# tests/test_popo.py and through the loop). A stateful one (adaptive_entropy, adaptive_kl) is evaluated with a fresh
# state per case: every case builds a new instance (``run``), whose state is made in its __post_init__.
ON_BATCHES = [name for name in available_objectives() if "hidden_states" not in OBJECTIVES.get(name).needs()]


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def make_batch(old, d, mask, adv, **kw):
    """logp = old + d as a leaf (with grad), old_logp = old. Values of old/d on padding are irrelevant."""
    old = torch.as_tensor(old, dtype=DT)
    logp = (old + torch.as_tensor(d, dtype=DT)).detach().requires_grad_(True)
    kw.setdefault("max_completion_len", 8)
    return PolicyBatch(logp=logp, old_logp=old, mask=torch.as_tensor(mask).bool(),
                       advantages=torch.as_tensor(adv, dtype=DT), **kw)


def minibatch_counts(whole: PolicyBatch, rows) -> dict:
    """The counts of the minibatch ``whole`` that the loop gives each of its micro-batches (here ``rows`` of it):
    valid tokens, sequences, and prompt_mean's tokens of each row's prompt and number of prompts."""
    group_tokens, groups = group_totals(whole.mask.sum(-1).to(whole.logp.dtype), whole.group_ids)
    return {"num_tokens": whole.mask.sum(), "num_sequences": whole.logp.shape[0], "group_tokens": group_tokens[rows],
            "num_groups": groups}


def run(name, batch, **hp):
    out = get_objective(name, **hp)(batch)
    (grad,) = torch.autograd.grad(out.loss, batch.logp, allow_unused=True)
    return out, torch.zeros_like(batch.logp) if grad is None else grad


def assert_close(actual, expected, tol=1e-10):
    expected = torch.as_tensor(expected, dtype=DT)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual.detach(), expected, rtol=tol, atol=tol), (actual, expected)


def num(x, y, tol=1e-10):
    x, y = (v.detach() if isinstance(v, torch.Tensor) else v for v in (x, y))
    return math.isclose(float(x), float(y), rel_tol=tol, abs_tol=tol)


def approx(metric, expected):
    """Metrics are float32 statistics (``ratio_metrics``) or fractions: compare at 1e-6."""
    return num(metric, expected, 1e-6)


# Shared hand-check batch: two sequences, lengths 3 and 2 (one padding slot holding garbage).
OLD = [[-1.0, -2.0, -0.5], [-1.5, -0.7, 9.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
D = [[0.1, 0.3, -0.1], [-0.4, 0.2, 7.0]]
ADV = [1.0, -0.5]


def random_batch(seed=0, scale=0.3, per_sequence=True, b=8, t=6, **kw):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=DT) * 3
    d = scale * torch.randn(b, t, generator=g, dtype=DT)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(b if per_sequence else (b, t), generator=g, dtype=DT)
    return make_batch(old, d, mask, adv, **kw)


GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0], dtype=DT)
LENGTHS = torch.tensor([5, 3, 4, 2, 5, 1, 4, 3])


def group_batch(t=5, pad_extra=0, garbage=False, seed=7, advantages=None, beta_ref=True):
    """8 sequences in 2 groups of 4; ``pad_extra`` garbage columns appended; garbage on padding slots. The current
    policy's entropies come with it (what the loop passes an objective whose entropy_need asks; most ignore them)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(8, t, generator=g, dtype=DT) * 2
    logp = old + 0.3 * torch.randn(8, t, generator=g, dtype=DT)
    ref = old + 0.2 * torch.randn(8, t, generator=g, dtype=DT)
    entropy = 0.05 + 0.3 * torch.rand(8, t, generator=torch.Generator().manual_seed(seed + 1), dtype=DT)
    mask = torch.arange(t)[None, :] < LENGTHS[:, None]
    if pad_extra:
        cols = t + pad_extra
        mask = torch.arange(cols)[None, :] < LENGTHS[:, None]
        junk = torch.Generator().manual_seed(99)
        extra = [10 * torch.randn(8, pad_extra, generator=junk, dtype=DT) for _ in range(4)]
        extra[0][0, 0], extra[1][1, 0], extra[2][2, -1] = 50.0, -50.0, 50.0
        old, logp, ref, entropy = (torch.cat([x, e], dim=1)
                                   for x, e in zip((old, logp, ref, entropy), extra, strict=True))
    if garbage:
        junk = torch.Generator().manual_seed(123)
        for x in (old, logp, ref, entropy):
            x[~mask] = 30 * torch.randn(int((~mask).sum()), generator=junk, dtype=DT)
        logp[~mask] = torch.where(torch.arange(int((~mask).sum())) % 3 == 0, 50.0, logp[~mask])
    adv = get_advantage("grpo")(REWARDS, GROUPS) if advantages is None else advantages
    return PolicyBatch(logp=logp.detach().requires_grad_(True), old_logp=old, mask=mask, advantages=adv,
                       rewards=REWARDS, group_ids=GROUPS, ref_logp=ref if beta_ref else None, step=1,
                       total_steps=3, max_completion_len=8, entropy=entropy)


def trl_sequence_level_loss(logp, old, adv, mask, eps_low, eps_high, loss_type, max_len=8):
    """TRL 1.16 _compute_loss with importance_sampling_level="sequence", one process, one micro-batch per optimizer
    step (num_items_in_batch = the batch's tokens), written out."""
    m = mask.to(logp.dtype)
    log_w = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_w)[:, None]
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    adv = adv[:, None]
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)  # (B, 1), broadcast over the mask below
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (per_token.size(0) * max_len)
    if loss_type == "luspo":
        return (per_token * m).sum(-1).mean()
    raise ValueError(loss_type)
