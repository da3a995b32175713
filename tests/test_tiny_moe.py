"""The tiny MoE (harness/policy/tiny_moe.py): transformers' Qwen3MoeForCausalLM of the spec's shape with the char
tokenizer; bad shapes stop in one line; the router's auxiliary loss enters a labels loss as the class defines it."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from harness.policy.routing import find_routers
from harness.policy.tiny_moe import build_tiny_moe
from harness.run.shapes import TinyMoeSpec
from tests.helpers.tiny_moe import TINY_MOE_SPEC, padded_batch, tiny_moe


def test_tiny_moe_has_the_specs_shape():
    model, tokenizer = tiny_moe(num_layers=3, num_experts=6, top_k=3, norm_topk_prob=False)
    assert isinstance(model, Qwen3MoeForCausalLM) and not model.training
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (3, 32, 2)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (6, 3, 16)
    assert config.vocab_size == len(tokenizer) and config.eos_token_id == tokenizer.eos_token_id
    routers = find_routers(model)
    assert len(routers) == 3 and all(r.top_k == 3 and not r.norm_topk_prob for r in routers.values())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the tiny Llama


def test_tiny_moe_seed_fixes_the_weights_and_spares_the_global_rng():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, _ = tiny_moe(seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    second, _ = tiny_moe(seed=4)
    third, _ = tiny_moe(seed=5)
    weights = [dict(m.named_parameters())["model.layers.0.mlp.gate.weight"] for m in (first, second, third)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    assert weights[0].std() > 0  # the class's init (normal 0.02), not the router's zeros


def test_aux_loss_enters_a_labels_loss_with_its_coefficient():
    model, tokenizer = tiny_moe(output_router_logits=True, router_aux_loss_coef=0.25)
    prompt_ids, prompt_mask, completion_ids, completion_mask = padded_batch(tokenizer)
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    plain = model(ids, attention_mask=mask, labels=labels, output_router_logits=False).loss
    assert out.aux_loss is not None and out.aux_loss.item() > 0
    torch.testing.assert_close(out.loss, plain + 0.25 * out.aux_loss)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("num_layers", 0, "num_layers must be an integer >= 1"),
    ("hidden_size", 33, "hidden_size (33) must be num_heads"),
    ("hidden_size", 6, "even head size"),  # 3 per head
    ("num_experts", -1, "num_experts must be an integer >= 1"),
    ("top_k", 5, "top_k must be an integer in [1, num_experts=4]"),
    ("top_k", 0, "top_k must be an integer in [1"),
    ("expert_intermediate_size", 2.5, "expert_intermediate_size must be an integer"),
    ("norm_topk_prob", "yes", "norm_topk_prob must be true or false"),
    ("output_router_logits", 1, "output_router_logits must be true or false"),
    ("router_aux_loss_coef", -0.1, "router_aux_loss_coef must be a number >= 0"),
    ("router_aux_loss_coef", float("nan"), "router_aux_loss_coef must be a number >= 0"),
])
def test_bad_shapes_raise_one_line(field, value, words):
    spec = TinyMoeSpec(**{**TINY_MOE_SPEC, field: value, **({"num_heads": 2} if field == "hidden_size" else {})})
    with pytest.raises(ValueError) as info:
        spec.check()
    assert words in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match=field):
        build_tiny_moe(tiny_moe()[1], spec, 0)
