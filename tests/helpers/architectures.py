"""Tiny random models of every architecture the written-out forward covers (and GPT-2, which it does not), for the
decoder and trainer-forward tests."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SHAPE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)

ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "llama_bias_mha": lambda: LlamaForCausalLM(LlamaConfig(**{**SHAPE, "num_key_value_heads": 4},
                                                           attention_bias=True, mlp_bias=True)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE, head_dim=8, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),  # biases on q/k/v
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=8)),  # RMSNorm on q and k per head
}


def build(name: str, dtype=torch.float32):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ARCHITECTURES[name]().to(dtype).eval()
