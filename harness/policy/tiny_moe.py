"""The tiny Mixture-of-Experts policy (``model.name: tiny_moe``): transformers' own ``Qwen3MoeForCausalLM`` at a
character-level size, randomly initialised, with the tiny Llama's tokenizer.

    tokenizer = char_tokenizer()                                   # harness.policy.models
    spec = TinyMoeSpec(num_layers=4, num_experts=8, top_k=2)       # harness.run.shapes; checked: ValueError
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

import torch
from transformers import PreTrainedTokenizerBase, Qwen3MoeConfig, Qwen3MoeForCausalLM

from harness.run.shapes import TinyMoeSpec


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
