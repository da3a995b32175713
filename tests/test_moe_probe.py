"""The one-update volatility probe (harness/apps/moe_probe.py): nothing moves at lr 0, routing moves at a large lr, and
the by-depth rows carry the settings with the metrics."""

from __future__ import annotations

import pytest

from harness.apps.moe_probe import UpdateProbe, one_update_volatility, volatility_by_depth
from harness.tasks import get_task
from tests.helpers.tiny_moe import TINY_MOE_SPEC, tiny_moe


@pytest.mark.parametrize(("lr", "moved"), [(0.0, False), (1e-2, True)])
def test_one_step_moves_routing_only_with_a_learning_rate(lr, moved):
    model, tokenizer = tiny_moe()
    metrics = one_update_volatility(model, tokenizer, ["12+30=\n", "7-4=\n"], lr=lr, group_size=2,
                                    max_new_tokens=6, seed=0)
    assert metrics["routed_tokens"] > 0
    assert (metrics["expert_changed_frac"] > 0) == moved
    assert metrics["expert_changed_frac"] <= metrics["expert_layer_changed_max"] <= 1
    assert metrics["expert_changed_frac"] <= metrics["expert_token_changed_frac"]


def test_rows_by_depth():
    spec = {k: v for k, v in TINY_MOE_SPEC.items() if k != "num_layers"}
    probe = UpdateProbe(depths=(1, 2), seeds=(0,), lrs=(1e-3, 1e-2), prompts=2, group_size=2, max_new_tokens=4,
                        spec=spec)
    rows = volatility_by_depth(probe, get_task("arith", eval_size=8, num_operands=2, digits=1, operators="+"))
    assert [(r["layers"], r["lr"]) for r in rows] == [(1, 1e-3), (1, 1e-2), (2, 1e-3), (2, 1e-2)]
    assert all(r["experts"] == 4 and r["top_k"] == 2 and r["sft_steps"] == 0 for r in rows)
