"""Expert volatility: how much a Mixture-of-Experts policy's routing differs between two records of the same tokens
(harness/policy/routing.py), e.g. the behaviour routing (the sampler's, or the old policy's) and the current policy's at
an update forward (what routing replay overrides), and how evenly the experts are loaded.

    v = expert_volatility(behaviour, current, mask)     # Volatility; v.metrics() -> {"expert_changed_frac": ...}
    expert_load_entropy(current, mask)                   # 1.0 = every expert equally loaded

Only tokens recorded in both records (every layer, every slot) and inside ``mask`` count: padding, and a
completion's last token that sampling never fed, are left out. Expert sets are compared per (token, layer), so the
order of the k slots (the router's probability order) does not matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from harness.policy.routing import Capture, RoutingRecord


@dataclass(frozen=True)
class Volatility:
    """Routing differences over ``tokens`` tokens of a pair of records (module docstring)."""

    changed_frac: float  # (token, layer, slot) assignments whose expert is not among the other record's k
    token_changed_frac: float  # tokens whose expert set differs in at least one layer
    layer_changed_frac: tuple[float, ...]  # changed_frac of each MoE layer, in forward order
    tokens: int

    @property
    def layer_changed_max(self) -> float:
        return max(self.layer_changed_frac, default=math.nan)

    def metrics(self) -> dict[str, float]:
        """The per-step metrics (NaN when no token was compared)."""
        return {"expert_changed_frac": self.changed_frac, "expert_token_changed_frac": self.token_changed_frac,
                "expert_layer_changed_max": self.layer_changed_max, "routed_tokens": float(self.tokens)}


def compared_tokens(first: RoutingRecord, second: RoutingRecord, mask: Tensor | None = None) -> Tensor:
    """[rows, width] bool: the tokens both records routed (and inside ``mask``, when given)."""
    if first.indices.shape != second.indices.shape or first.layers != second.layers:
        raise ValueError(f"routing records of different grids or layers: {tuple(first.indices.shape)} vs "
                         f"{tuple(second.indices.shape)}")
    keep = first.valid & second.valid.to(first.indices.device)
    return keep if mask is None else keep & mask.to(keep.device).bool()


def expert_volatility(behaviour: RoutingRecord, current: RoutingRecord, mask: Tensor | None = None) -> Volatility:
    """The fraction of (token, layer, slot) assignments of ``behaviour`` whose expert ``current`` does not choose
    for that token and layer (k minus the size of the two sets' intersection, over tokens x layers x k), the
    fraction of tokens with any such change, and each layer's fraction."""
    keep = compared_tokens(behaviour, current, mask)
    old = behaviour.indices[:, keep].long()  # [layers, n, k]
    new = current.indices.to(behaviour.indices.device)[:, keep].long()
    layers, n, k = old.shape
    if n == 0:
        return Volatility(math.nan, math.nan, (math.nan,) * layers, 0)
    changed = k - (old[..., :, None] == new[..., None, :]).any(-1).sum(-1)  # [layers, n]
    per_layer = (changed.sum(1).double() / (n * k)).tolist()
    return Volatility(changed_frac=changed.sum().item() / (layers * n * k),
                      token_changed_frac=(changed > 0).any(0).double().mean().item(),
                      layer_changed_frac=tuple(per_layer), tokens=n)


def merge_volatility(parts: list[Volatility]) -> Volatility:
    """The volatility of the union of the parts' tokens (e.g. a minibatch's micro-batches): their fractions
    weighted by their token counts (every part has the same layers and k)."""
    counted = [part for part in parts if part.tokens]
    total = sum(part.tokens for part in counted)
    if not total:
        return Volatility(math.nan, math.nan, parts[0].layer_changed_frac if parts else (), 0)

    def mean(values: list[float]) -> float:
        return sum(value * part.tokens for value, part in zip(values, counted, strict=True)) / total

    layers = tuple(mean([part.layer_changed_frac[i] for part in counted])
                   for i in range(len(counted[0].layer_changed_frac)))
    return Volatility(mean([part.changed_frac for part in counted]),
                      mean([part.token_changed_frac for part in counted]), layers, total)


def expert_load_entropy(record: RoutingRecord, mask: Tensor | None = None) -> float:
    """Mean over layers of the entropy of the expert load (each expert's share of the layer's token x k
    assignments) divided by log(num_experts): 1 when every expert gets the same share, 0 when one gets all."""
    keep = compared_tokens(record, record, mask)
    chosen = record.indices[:, keep].long()  # [layers, n, k]
    if chosen.shape[1] == 0 or record.num_experts < 2:
        return math.nan
    entropies = []
    for layer in chosen:
        share = torch.bincount(layer.flatten(), minlength=record.num_experts).double() / layer.numel()
        entropies.append(-(share * share.log()).nan_to_num().sum().item() / math.log(record.num_experts))
    return sum(entropies) / len(entropies)


def capture_metrics(behaviour: RoutingRecord, capture: Capture) -> tuple[Volatility, dict[str, float]]:
    """What one update forward (``capture``, with router logits) says about routing: its live routing against the
    ``behaviour`` record of the same tokens (the assignments replay overrides), and as metrics the live routing's
    expert-load entropy and the router's auxiliary load-balancing loss (the model class's own, measured, not
    trained on)."""
    with torch.no_grad():
        aux_loss = capture.aux_loss().item()
    return expert_volatility(behaviour, capture.record), {
        "expert_load_entropy": expert_load_entropy(capture.record), "router_aux_loss": aux_loss}
