"""The tiny Mixture-of-Experts policy (``model.name: tiny_moe``): transformers' own ``Qwen3MoeForCausalLM`` at a
character-level size, randomly initialised, with the tiny Llama's tokenizer.

    tokenizer = char_tokenizer()                                   # harness.policy.models
    spec = TinyMoeSpec(num_layers=4, num_experts=8, top_k=2)       # checked: ValueError in one line
    model = build_tiny_moe(tokenizer, spec, seed=0)

Every decoder layer is an MoE layer (``decoder_sparse_step=1``, no ``mlp_only_layers``): a
``Qwen3MoeTopKRouter`` (softmax over the experts' logits, top-k, renormalised over the k when ``norm_topk_prob``)
and ``num_experts`` SwiGLU experts of width ``expert_intermediate_size``; no shared expert (Qwen3-MoE has none).
Attention is Qwen3's (q/k RMSNorm, full attention, as many key/value heads as query heads). The router's auxiliary
load-balancing loss is the class's own (Switch Transformer, Eq. 4-6, times ``num_experts``): with
``output_router_logits`` the model's forward returns ``aux_loss`` and adds ``router_aux_loss_coef * aux_loss`` to
a ``labels`` loss, exactly as for a hub Qwen3-MoE. Defaults follow Qwen3-30B-A3B's choices where they are choices
(``norm_topk_prob`` true, ``router_aux_loss_coef`` 0.001, ``output_router_logits`` false) at the tiny Llama's
width; Qwen3-30B-A3B's 128 experts / top-8 become 8 / top-2 so that each expert sees enough tokens of a small batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase, Qwen3MoeConfig, Qwen3MoeForCausalLM


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


def tiny_moe_config(tokenizer: PreTrainedTokenizerBase, spec: TinyMoeSpec) -> Qwen3MoeConfig:
    """The ``Qwen3MoeConfig`` of ``spec`` for ``tokenizer``'s vocabulary and special tokens (``spec`` checked)."""
    spec.check()
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
        intermediate_size=spec.expert_intermediate_size,  # dense MLP width: unused (every layer is MoE)
        moe_intermediate_size=spec.expert_intermediate_size, num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k, norm_topk_prob=spec.norm_topk_prob, decoder_sparse_step=1,
        mlp_only_layers=[], output_router_logits=spec.output_router_logits,
        router_aux_loss_coef=float(spec.router_aux_loss_coef), max_position_embeddings=spec.max_position,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)


def build_tiny_moe(tokenizer: PreTrainedTokenizerBase, spec: TinyMoeSpec, seed: int) -> Qwen3MoeForCausalLM:
    """A freshly initialised tiny MoE of shape ``spec`` (the class's own init: normal(0, 0.02) for the router and
    the experts), in eval mode; the global torch RNG is left untouched."""
    config = tiny_moe_config(tokenizer, spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(config).eval()
