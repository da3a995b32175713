"""harness/loop/build.py: what a run is made of, the same for every backend: the optimizer, the run setup."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from harness.loop.build import build_learner, build_optimizer, setup_run
from tests.helpers.tiny import tiny_run


def test_the_loop_optimizer_is_fused_adamw_with_the_per_tensor_update():
    """build_optimizer: the fused AdamW kernel on CPU, with the run's lr and weight decay; five steps of it move the
    weights as the per-tensor loop does (to fp32 round-off), and as AdamW by hand for the first step."""
    t = OmegaConf.create({"lr": 1e-2, "weight_decay": 0.1})
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]
    moved = {}
    for fused in (True, False):
        params = [p.clone().requires_grad_() for p in start]
        optimizer = build_optimizer(params, t) if fused else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        assert optimizer.param_groups[0]["fused"] is (True if fused else None)
        assert (optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]) == (1e-2, 0.1)
        for k, step in enumerate(grads):
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            optimizer.step()
            if k == 0 and fused:  # m = (1-b1) g, v = (1-b2) g^2, bias-corrected: the step is lr g / (|g| + eps')
                for p, p0, g in zip(params, start, step, strict=True):
                    by_hand = p0 * (1 - 1e-2 * 0.1) - 1e-2 * g / (g.abs() + 1e-8)
                    assert torch.allclose(p.detach(), by_hand, atol=1e-6)
        moved[fused] = [p.detach() for p in params]
    for a, b in zip(moved[True], moved[False], strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert (moved[True][0] - start[0]).abs().max() > 1e-2  # the steps moved the weights


@pytest.mark.parametrize("settings, copies", [((), False), (("model.sampler_dtype=bfloat16",
                                                              "objective.params.beta=0.04"), True)])
def test_the_run_setup_makes_the_frozen_copies_its_settings_ask_for(tmp_path, settings, copies):
    """One setup for the native loop, the TRL backend, the lab and the bench: a separate sampler only in another
    precision, a reference only for a KL term, both frozen copies of the starting policy."""
    run = tiny_run(tmp_path, *settings)
    setup = setup_run(run, torch.device("cpu"))
    assert setup.task.name == "arith" and len(setup.train_problems) > 0 and setup.start_policy is None
    assert all(p.requires_grad for p in setup.policy.parameters())
    assert (setup.sampler is not setup.policy) == copies and (setup.reference is not None) == copies
    if copies:
        assert next(setup.sampler.parameters()).dtype == torch.bfloat16
        for copy in (setup.sampler, setup.reference):
            assert not any(p.requires_grad for p in copy.parameters()) and not copy.training
        learner = build_learner(setup.policy, setup.objective, run.train)
        assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(run.train.lr)  # no warm-up: the run's lr
