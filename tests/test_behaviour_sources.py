"""The behaviour stage's sources, pinned by values: the reference log-probs are the reference model's, a separate
sampler's log-probs enter the rollout-correction weight, and trust-region rules zero the weights they reject."""

from __future__ import annotations

import copy

import torch
from omegaconf import OmegaConf

from harness.loop.behaviour import behaviour_logprobs, no_grad_logprobs, rollout_correction
from harness.policy.forward import completion_logprobs
from objectives.rollout_correction import correction_weights, rejection_keep
from tests.test_update import toy_batch

TRAIN = {"old_logp": "sampler", "micro_batch_size": 4, "temperature": 0.7, "padding_free": True, "rollout_lag": 1,
         "rollout_correction": {"mode": "token_truncate", "threshold": 2.0, "threshold_lower": None}}


def test_reference_and_separate_sampler_reach_the_behaviour(tiny_model):
    policy, _ = tiny_model
    policy.eval()
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ro = toy_batch().rollout
    cfg = OmegaConf.create({"objective": {"name": "grpo"}, "train": TRAIN})
    behaviour = behaviour_logprobs(policy, reference, ro, cfg, separate_sampler=True)
    old = no_grad_logprobs(policy, ro, cfg.train)[0]
    torch.testing.assert_close(behaviour.old_logp, old)  # a correction recomputes the proximal policy's
    at_temperature = completion_logprobs(policy, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                         0.7)[0]
    torch.testing.assert_close(old, at_temperature, rtol=1e-5, atol=1e-6)  # at train.temperature
    torch.testing.assert_close(behaviour.ref_logp, no_grad_logprobs(reference, ro, cfg.train)[0])
    assert not torch.allclose(behaviour.ref_logp, old)
    want = correction_weights(old, ro.sampler_logp, ro.completion_mask, "token_truncate", 2.0)
    torch.testing.assert_close(behaviour.correction, want)
    assert not torch.equal(want, ro.completion_mask.float())  # the sampler differs: weights other than 1


def test_trust_region_rules_zero_the_weights_they_reject():
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2, 3:] = False
    old = -torch.rand(6, 5, generator=g)
    sampler = old + torch.randn(6, 5, generator=g)
    t = OmegaConf.create({**TRAIN, "rollout_correction": {**TRAIN["rollout_correction"], "rejection": ["token_k2"],
                                                          "rejection_threshold": [0.2]}})
    weights, metrics = rollout_correction(t, old, sampler, mask)
    keep = rejection_keep(old, sampler, mask, ["token_k2"], [0.2])
    assert 0 < (~keep & mask).sum() < mask.sum()
    torch.testing.assert_close(weights, correction_weights(old, sampler, mask, "token_truncate", 2.0) * keep)
    assert metrics["rollout_corr_rejected_frac"] == (~keep & mask).sum().item() / mask.sum().item()


def test_decoupled_ppo_at_the_sequence_level_weighs_by_the_geometric_mean():
    """AReaL's sequence-level behaviour weight: exp(mean_t d_t) over each sequence's valid tokens, masked above C."""
    g = torch.Generator().manual_seed(2)
    mask = torch.arange(5)[None] < torch.tensor([5, 3, 1, 4])[:, None]
    old = -torch.rand(4, 5, generator=g)
    sampler = old - 0.3 * torch.rand(4, 5, generator=g)
    sampler[3] = old[3] - 1.0  # geometric mean e > C = 2: masked
    weights = correction_weights(old, sampler, mask, "decoupled_ppo", 2.0, ratio_level="sequence")
    d = torch.where(mask, old - sampler, torch.zeros_like(old))
    mean = (d.sum(-1) / mask.sum(-1)).exp()
    want = torch.where(mean <= 2.0, mean, torch.zeros_like(mean))[:, None] * mask
    torch.testing.assert_close(weights, want)
    assert 0 < weights[0, 0] < 2 and weights[3].abs().sum() == 0


def test_sequence_mean_rules_average_over_each_sequences_valid_tokens():
    """seq_mean_k2 / seq_mean_k3 (trust-region masking's average): the mean over the sequence's own tokens, not over
    the batch's padded width."""
    mask = torch.arange(6)[None] < torch.tensor([2, 6])[:, None]
    old = torch.zeros(2, 6)
    sampler = torch.where(mask, torch.full((2, 6), -0.6), torch.zeros(2, 6))  # d = 0.6 on every valid token
    k2 = 0.5 * 0.6**2  # the mean of k2 on each row, 0.18
    keep = rejection_keep(old, sampler, mask, ["seq_mean_k2"], [k2 - 0.01])
    assert not keep.any()  # both rows' mean is 0.18, over the bound; over the width row 0's would be 0.06
    assert not rejection_keep(old, sampler, mask, ["seq_mean_k3"], [0.21]).any()  # mean k3 = e^0.6 - 1.6 = 0.222
    assert torch.equal(rejection_keep(old, sampler, mask, ["seq_mean_k3"], [0.23]), mask)
