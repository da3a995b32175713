"""The tiny models' shapes: the fields ``model.tiny`` takes for each tiny model (their defaults and meanings, which
``python -m harness explain model.tiny`` lists), and their checks. Plain dataclasses, so that the settings are read
and explained without the libraries that build the models (harness/policy/models.py, harness/policy/tiny_moe.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.run.config import TINY_MOE


@dataclass
class TinyModelSpec:
    """Shape of the tiny Llama (tied input/output embeddings); the init seed is ``load_model(seed=...)``."""

    hidden_size: int = 128  # residual width
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # attention heads (key/value heads: as many)
    intermediate_size: int = 512  # the SwiGLU MLP's width
    max_position: int = 512  # longest prompt + completion


@dataclass(frozen=True)
class TinyMoeSpec:
    """Shape of the tiny MoE (``model.tiny.*`` at ``model.name=tiny_moe``; tied input/output embeddings); the init
    seed is separate."""

    hidden_size: int = 128  # residual width (the tiny Llama's)
    num_layers: int = 4  # decoder layers, every one an MoE layer
    num_heads: int = 4  # attention heads (key/value heads: as many)
    num_experts: int = 8  # routed experts per layer
    top_k: int = 2  # experts each token activates (Qwen3MoeConfig.num_experts_per_tok)
    expert_intermediate_size: int = 128  # each expert's SwiGLU width (Qwen3MoeConfig.moe_intermediate_size)
    norm_topk_prob: bool = True  # renormalise the k selected probabilities to sum to 1 (Qwen3-30B-A3B: true)
    output_router_logits: bool = False  # the forward returns router logits and aux_loss (and adds it to a labels loss)
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in a labels loss (Qwen3-30B-A3B: 0.001)
    max_position: int = 512  # longest prompt + completion

    def check(self) -> None:
        """Raise ValueError in one line naming the first bad field and what to change."""
        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.type == "int" and f.name != "top_k"}
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tiny_moe.{name} must be an integer >= 1, got {value!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"tiny_moe.hidden_size ({self.hidden_size}) must be num_heads ({self.num_heads}) times "
                             "an even head size (the rotary embedding rotates pairs)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"tiny_moe.top_k must be an integer in [1, num_experts={self.num_experts}], "
                             f"got {self.top_k!r}")
        for name in ("norm_topk_prob", "output_router_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"tiny_moe.{name} must be true or false, got {getattr(self, name)!r}")
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, int | float) or not coef >= 0:
            raise ValueError(f"tiny_moe.router_aux_loss_coef must be a number >= 0, got {coef!r}")


TINY_MODEL_SPECS = {"tiny": TinyModelSpec, TINY_MOE: TinyMoeSpec}  # each tiny model's shape (model.tiny)
