"""Expert volatility on hand-made records: set comparison per (token, layer), valid tokens only, per-layer maximum,
load entropy; and one optimizer step of the tiny MoE moves some of its routing."""

from __future__ import annotations

import math

import pytest
import torch

from harness.policy.expert_volatility import (
    capture_metrics,
    expert_load_entropy,
    expert_volatility,
    merge_volatility,
)
from harness.policy.routing import Capture, Layout, RoutingRecord


def record(indices) -> RoutingRecord:
    """[layers, rows, width, k] -> a record (prompt width 1, 4 experts)."""
    return RoutingRecord(torch.tensor(indices, dtype=torch.int16), ("a", "b")[: len(indices)], 1, 4)


def test_volatility_counts_changed_set_members():
    # one row, three tokens, two layers, top-2; token 2 is padding in the current record
    before = record([[[[0, 1], [2, 3], [0, 2]]], [[[1, 2], [0, 3], [1, 3]]]])
    after = record([[[[1, 0], [2, 0], [-1, -1]]], [[[1, 2], [1, 2], [3, 1]]]])
    v = expert_volatility(before, after)
    # compared tokens 0, 1 (token 2 unrecorded in `after`); layer a: token 0 same set (order differs), token 1 one of
    # two changed; layer b: token 0 same, token 1 both changed -> 3 of 2 tokens x 2 layers x 2 slots
    assert v.tokens == 2
    assert v.changed_frac == pytest.approx(3 / 8)
    assert v.layer_changed_frac == pytest.approx((1 / 4, 2 / 4)) and v.layer_changed_max == pytest.approx(0.5)
    assert v.token_changed_frac == pytest.approx(1 / 2)  # token 1 changed, token 0 did not
    masked = expert_volatility(before, after, mask=torch.tensor([[True, False, True]]))
    assert masked.tokens == 1 and masked.changed_frac == 0.0 and masked.token_changed_frac == 0.0
    assert set(v.metrics()) == {"expert_changed_frac", "expert_token_changed_frac", "expert_layer_changed_max",
                                "routed_tokens"}


def test_volatility_of_nothing_is_nan_and_grids_must_match():
    empty = record([[[[-1, -1]]]])
    assert math.isnan(expert_volatility(empty, empty).changed_frac)
    with pytest.raises(ValueError, match="different grids"):
        expert_volatility(record([[[[0, 1]]]]), record([[[[0, 1], [1, 2]]]]))


def test_load_entropy():
    uniform = record([[[[0, 1], [2, 3]]]])
    assert expert_load_entropy(uniform) == pytest.approx(1.0)
    skewed = record([[[[0, 1], [0, 1], [-1, -1]]]])  # half to expert 0, half to 1, of 4: log 2 / log 4
    assert expert_load_entropy(skewed) == pytest.approx(0.5)
    assert expert_load_entropy(skewed, mask=torch.tensor([[True, False, False]])) == pytest.approx(0.5)
    two = record([[[[0, 1], [2, 3]]], [[[0, 1], [0, 1]]]])  # layer a uniform (1), layer b on two experts (0.5)
    assert expert_load_entropy(two) == pytest.approx(0.75)  # the mean over layers


def test_merged_parts_equal_the_whole():
    before = record([[[[0, 1], [2, 3], [0, 2], [1, 3]]], [[[1, 2], [0, 3], [1, 3], [0, 1]]]])
    after = record([[[[1, 0], [2, 0], [0, 3], [1, 3]]], [[[1, 2], [1, 2], [3, 1], [-1, -1]]]])
    whole = expert_volatility(before, after)
    columns = (torch.tensor([[True, True, False, False]]), torch.tensor([[False, False, True, True]]))
    merged = merge_volatility([expert_volatility(before, after, mask) for mask in columns])
    assert merged.tokens == whole.tokens == 3
    for field in ("changed_frac", "token_changed_frac"):
        assert getattr(merged, field) == pytest.approx(getattr(whole, field))
    assert merged.layer_changed_frac == pytest.approx(whole.layer_changed_frac)
    nothing = expert_volatility(before, after, torch.zeros(1, 4, dtype=torch.bool))
    assert math.isnan(merge_volatility([nothing]).changed_frac)
    assert merge_volatility([nothing, whole]) == whole  # a part with no token compared weighs nothing


def test_a_token_changed_in_one_layer_only_counts_as_changed():
    before = record([[[[0, 1], [2, 3]]], [[[1, 2], [0, 3]]]])
    after = record([[[[0, 2], [2, 3]]], [[[1, 2], [0, 3]]]])  # token 0: layer a only; token 1: none
    v = expert_volatility(before, after)
    assert v.token_changed_frac == pytest.approx(1 / 2) and v.changed_frac == pytest.approx(1 / 8)
    assert v.layer_changed_frac == pytest.approx((1 / 4, 0.0))


def test_an_update_forwards_metrics_are_its_live_routings():
    """capture_metrics: the volatility of the behaviour record against the capture's live record, the load entropy
    of the live record (the routing the update forward's router chose), the aux loss of its logits."""
    behaviour, live = record([[[[0, 1], [0, 1]]]]), record([[[[0, 1], [2, 3]]]])
    logits = [[(torch.zeros(2, 4), Layout(torch.arange(2), torch.arange(2), 2))]]
    capture = Capture(live, None, logits, aux_loss_fn=lambda *args: torch.tensor(0.25), top_k=2)
    volatility, metrics = capture_metrics(behaviour, capture)
    assert volatility.changed_frac == pytest.approx(2 / 4)
    assert metrics == {"expert_load_entropy": pytest.approx(1.0), "router_aux_loss": 0.25}
