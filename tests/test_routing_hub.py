"""Routing record and replay on transformers' hub MoE classes (Qwen3-MoE, Qwen2-MoE with its shared expert, OLMoE,
Mixtral): each with a tiny random config saved in the hub layout and loaded back through
harness.policy.models.load_model, as tests/test_hub_model.py does for Qwen2. For each: the record is the class's own
top-k, the sampler's record equals the teacher-forced one, replay is bit-exact with unchanged weights and forces the
record (with router gradients) after the routers move."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from harness.loop.native import train
from harness.policy.models import char_tokenizer, load_model
from harness.policy.routing import Routing, find_routers
from harness.run.config import load_experiment, run_configs
from harness.run.records import read_jsonl
from tests.helpers.tiny_moe import (
    TINY_MOE_RUN,
    full_forward,
    gradients,
    padded_batch,
    perturb_routers,
    record_forward,
    sample_recorded,
)

SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=128, num_experts_per_tok=2, tie_word_embeddings=False)
CLASSES = {  # norm_topk_prob as each family's hub checkpoints set it (Mixtral always renormalises)
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(num_experts=4, moe_intermediate_size=16,
                                                            intermediate_size=32, norm_topk_prob=True)),
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig, dict(num_experts=4, moe_intermediate_size=16,
                                                            intermediate_size=32, shared_expert_intermediate_size=24,
                                                            norm_topk_prob=False)),
    "olmoe": (OlmoeForCausalLM, OlmoeConfig, dict(num_experts=4, intermediate_size=16, norm_topk_prob=False)),
    "mixtral": (MixtralForCausalLM, MixtralConfig, dict(num_local_experts=4, intermediate_size=16)),
}


@pytest.fixture(scope="module", params=sorted(CLASSES))
def hub_model(request, tmp_path_factory):
    """The class's tiny random model saved with save_pretrained (and the char tokenizer), loaded back."""
    model_class, config_class, settings = CLASSES[request.param]
    tokenizer = char_tokenizer()
    config = config_class(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          **SHAPE, **settings)
    folder = tmp_path_factory.mktemp("hub") / request.param
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model_class(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model, tokenizer = load_model(str(folder))
    assert type(model) is model_class
    return model, tokenizer


def test_record_is_the_classes_own_top_k(hub_model):
    model, tokenizer = hub_model
    routing, batch = Routing(model), padded_batch(tokenizer)
    recorded = record_forward(model, routing, batch)
    ids, mask = torch.cat([batch[0], batch[2]], 1), torch.cat([batch[1], batch[3]], 1)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, output_router_logits=True).router_logits
    assert len(logits) == len(recorded.layers) == model.config.num_hidden_layers
    for layer, layer_logits in enumerate(logits):
        native = layer_logits.float().softmax(-1).topk(2).indices.view(*mask.shape, 2)
        assert torch.equal(recorded.indices[layer][mask.bool()].long(), native[mask.bool()])
    routing.close()


def test_sampler_record_equals_teacher_forced(hub_model):
    model, tokenizer = hub_model
    routing = Routing(model)
    torch.manual_seed(1)
    ro, sampled = sample_recorded(model, tokenizer, routing, ["12+30=\n", "7-4=\n"], group_size=2, max_new_tokens=6)
    forced = record_forward(model, routing, (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask))
    both = sampled.valid
    assert int(both.sum()) >= int(ro.prompt_mask.sum()) + int(ro.completion_mask.sum()) - len(ro.texts)
    assert torch.equal(sampled.indices[:, both], forced.indices[:, both])
    routing.close()


def replay_is_exact(model, tokenizer) -> None:
    """With unchanged weights, replaying the model's own record changes neither the logits nor any gradient."""
    routing, batch = Routing(model), padded_batch(tokenizer)
    behaviour = record_forward(model, routing, batch)
    model.train()
    plain = full_forward(model, routing, *batch)
    plain.float().logsumexp(-1).sum().backward()
    plain_grads = gradients(model)
    model.zero_grad()
    with routing.capture(replay=behaviour):
        replayed = full_forward(model, routing, *batch)
    replayed.float().logsumexp(-1).sum().backward()
    routing.close()
    assert torch.equal(plain, replayed)
    assert all(torch.equal(grad, gradients(model)[name]) for name, grad in plain_grads.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_with_unchanged_weights_is_exact(hub_model, dtype):
    """bfloat16 tells the classes' dtypes apart: Mixtral's gate weights stay float32, the others' are cast back."""
    model, tokenizer = hub_model
    replay_is_exact(copy.deepcopy(model).to(dtype), tokenizer)


def test_replay_forces_the_record_after_the_routers_move(hub_model):
    model = copy.deepcopy(hub_model[0])
    routing, batch = Routing(model), padded_batch(hub_model[1])
    behaviour = record_forward(model, routing, batch)
    perturb_routers(model)
    model.train()
    experts = []
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            module.register_forward_pre_hook(lambda module, args: experts.append(args[1]))
    with routing.capture(replay=behaviour) as cap:
        full_forward(model, routing, *batch).float().logsumexp(-1).sum().backward()
    mask = torch.cat([batch[1], batch[3]], 1).bool()
    assert bool((cap.record.indices != behaviour.indices)[:, mask].any())  # the live routing moved
    for layer, index in enumerate(experts):
        assert torch.equal(index.view(*mask.shape, 2)[mask], behaviour.indices[layer][mask].long())
    for router in find_routers(model).values():
        assert bool(router.weight.grad.abs().sum() > 0)
    if hasattr(model.model.layers[0].mlp, "shared_expert_gate"):  # Qwen2-MoE: the shared expert trains as is
        assert bool(model.model.layers[0].mlp.shared_expert_gate.weight.grad.abs().sum() > 0)


@pytest.mark.slow  # an end-to-end run in this process: make test
def test_an_r3_run_of_the_native_loop_records_and_replays_the_class(hub_model, tmp_path):
    """model.name = the saved folder, train.routing_replay=r3: the sampler records through the cache decoder, the
    recompute replays it (in fp32 the trainer routes as the sampler did), the update forwards measure volatility."""
    model, _ = hub_model
    settings = [o for o in TINY_MOE_RUN if not o.startswith("model.")]
    (run,) = run_configs(load_experiment("base", [
        *settings, f"results_dir={tmp_path}", f"model.name={model.name_or_path}", "train.routing_replay=r3",
        "task.overlong_buffer=4", "train.max_new_tokens=6", "train.steps=1"]))
    train(run, tmp_path / "run", progress=False)
    (row,) = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["step"] == 1]
    assert row["recompute_expert_changed_frac"] == 0.0 and row["routed_tokens"] > 0
    assert 0.0 <= row["expert_changed_frac"] <= 1.0 and row["router_aux_loss"] > 0
