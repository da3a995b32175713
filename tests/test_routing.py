"""Routing record and replay (harness/policy/routing.py) on the tiny MoE: replay forces the recorded experts while the
router keeps its gradient; with unchanged weights it changes nothing, bit for bit; the sampler's record (prefill +
KV-cache decode steps, rows leaving the batch) equals the teacher-forced forward's; micro-batches replay slices of
the minibatch record; activation checkpointing's recompute replays too; bad records and layouts stop in one line."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch

from harness.policy import forward
from harness.policy.models import load_model
from harness.policy.routing import (
    Grid,
    Routing,
    RoutingRecord,
    config_is_moe,
    find_routers,
    full_layout,
    routing_unsupported,
    select_record_rows,
)
from harness.run.errors import ConfigError
from tests.helpers.tiny import TINY_SPEC, tiny_run
from tests.helpers.tiny_moe import (
    full_forward,
    gradients,
    padded_batch,
    perturb_routers,
    record_forward,
    sample_recorded,
    shared_prompt_forward,
    tiny_moe,
    tiny_moe_run,
)


def experts_inputs(model) -> list[tuple]:
    """Every experts call's (top_k_index, top_k_weights), appended as the forward runs (a forward pre-hook)."""
    seen = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(lambda module, args: seen.append((args[1], args[2])))
    return seen


def router_logits(model) -> list:
    """Every router call's logits (a forward hook registered before Routing's, so it sees the live output)."""
    seen = []
    for router in find_routers(model).values():
        router.register_forward_hook(lambda module, args, output: seen.append(output[0]))
    return seen


def token_logp(logits, batch):
    """Masked token-mean log-prob of the completion tokens (a loss with gradients everywhere)."""
    prompt_ids, _, completion_ids, completion_mask = batch
    width = prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, width - 1 : -1].float(), -1).gather(-1, completion_ids[..., None])[..., 0]
    return logp * completion_mask


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replay_forces_recorded_experts_with_live_gate_weights(norm_topk_prob):
    model, tokenizer = tiny_moe(norm_topk_prob=norm_topk_prob)
    routing, batch = Routing(model), padded_batch(tokenizer)
    behaviour = record_forward(model, routing, batch)
    perturb_routers(model)
    native = record_forward(model, routing, batch)  # the moved routers' own routing, nothing replayed
    experts, logits_seen = experts_inputs(model), router_logits(model)
    model.train()
    with routing.capture(replay=behaviour) as cap:
        loss = -token_logp(full_forward(model, routing, *batch), batch).sum()
    loss.backward()
    mask = torch.cat([batch[1], batch[3]], 1).bool()
    live = cap.record
    assert bool((live.indices != behaviour.indices)[:, mask].any()), "the perturbation changed no routing"
    assert torch.equal(live.indices[0], native.indices[0])  # the live top-k: layer 0's input is not replayed yet
    for layer, ((index, weights), logits) in enumerate(zip(experts, logits_seen, strict=True)):
        forced = index.view(*mask.shape, -1)
        assert torch.equal(forced[mask], behaviour.indices[layer][mask].long())  # exactly the recorded experts
        native = logits.float().softmax(-1).topk(forced.shape[-1]).indices.view_as(forced)
        assert torch.equal(forced[~mask], native[~mask])  # padding has no record: routed natively
        # ROLL's g_i = e^{s_i} / sum_{j in ref} e^{s_j} when renormalised, else the full softmax's p_i
        scores = logits.float().gather(-1, index)
        expected = (scores.softmax(-1) if norm_topk_prob else logits.float().softmax(-1).gather(-1, index))
        torch.testing.assert_close(weights, expected, rtol=1e-6, atol=1e-7)
    for router in find_routers(model).values():
        assert router.weight.grad is not None and bool(router.weight.grad.abs().sum() > 0)


def test_replay_with_unchanged_weights_is_bit_exact():
    model, tokenizer = tiny_moe()
    routing, batch = Routing(model), padded_batch(tokenizer)
    behaviour = record_forward(model, routing, batch)
    model.train()
    plain = full_forward(model, routing, *batch)  # no capture: the hooks do nothing
    token_logp(plain, batch).sum().backward()
    plain_grads = gradients(model)
    model.zero_grad()
    with routing.capture(replay=behaviour) as cap:
        replayed = full_forward(model, routing, *batch)
    token_logp(replayed, batch).sum().backward()
    assert torch.equal(plain, replayed)
    replayed_grads = gradients(model)
    assert plain_grads.keys() == replayed_grads.keys()
    assert all(torch.equal(plain_grads[name], replayed_grads[name]) for name in plain_grads)
    assert torch.equal(cap.record.indices, behaviour.indices)  # the live routing agrees with the record


def test_sampler_record_equals_teacher_forced_record():
    """R3: prefill of the distinct prompts (shared by a group), then one token per row per KV-cache decode step
    with rows leaving the batch as they finish; the teacher-forced forward of the same tokens routes them alike."""
    model, tokenizer = tiny_moe()
    routing = Routing(model)
    torch.manual_seed(0)
    ro, sampled = sample_recorded(model, tokenizer, routing, ["12+30=\n", "7-4=\n", "9\n"], group_size=3,
                                  max_new_tokens=10)
    lengths = ro.completion_mask.sum(-1)
    assert lengths.min() < lengths.max() and len(set(lengths.tolist())) > 2  # rows left the batch at several steps
    batch = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    forced = record_forward(model, routing, batch)
    real = torch.cat([ro.prompt_mask.bool(), ro.completion_mask], 1)
    assert torch.equal(forced.valid, real)
    # every real token was routed while sampling, but possibly a completion's last one (never fed back)
    fed = real.clone()
    fed[torch.arange(len(real)), ro.prompt_ids.shape[1] + lengths - 1] = False
    assert bool(sampled.valid[fed].all()) and not bool(sampled.valid[~real].any())
    both = sampled.valid
    assert torch.equal(sampled.indices[:, both], forced.indices[:, both])


def test_shared_prompt_forward_records_as_the_full_forward():
    model, tokenizer = tiny_moe()
    routing, batch = Routing(model), padded_batch(tokenizer)
    full = record_forward(model, routing, batch)
    shared = record_forward(model, routing, batch, forward=shared_prompt_forward)
    assert torch.equal(shared.indices, full.indices)


def test_microbatch_replay_equals_whole_batch():
    model, tokenizer = tiny_moe()
    routing, batch = Routing(model), padded_batch(tokenizer)
    behaviour = record_forward(model, routing, batch)
    perturb_routers(model)
    model.train()
    tokens = batch[3].sum()
    with routing.capture(replay=behaviour):
        whole = token_logp(full_forward(model, routing, *batch), batch)
    (-whole.sum() / tokens).backward()
    whole_grads = gradients(model)
    model.zero_grad()
    parts = []
    for rows in (torch.tensor([0, 1]), torch.tensor([2, 3])):
        width = int(batch[3][rows].sum(-1).max())  # the micro-batch's completion columns, as forward_rows keeps
        chunk = (batch[0][rows], batch[1][rows], batch[2][rows, :width], batch[3][rows, :width])
        with routing.capture(replay=behaviour.select(rows, width)):
            part = token_logp(full_forward(model, routing, *chunk), chunk)
        (-part.sum() / tokens).backward()
        parts.append(torch.nn.functional.pad(part.detach(), (0, batch[3].shape[1] - width)))
    torch.testing.assert_close(torch.cat(parts), whole.detach(), rtol=0, atol=1e-5)
    micro_grads = gradients(model)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(micro_grads[name], grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("capture", ["none", "record", "replay"])
def test_checkpoint_recompute_forces_the_forward_routing_bit_for_bit(capture):
    """Activation checkpointing as the runs set it (set_memory_settings): the same loss and gradients bit for bit,
    outside a capture, recording the live routing with its router logits (the update without replay), and replaying
    a record the moved routers disagree with; the backward runs after the capture ended, as the trainer's does. A
    recompute without the routing's context_fn stops in one line instead of routing afresh."""
    model, tokenizer = tiny_moe()
    routing, batch = Routing(model), padded_batch(tokenizer)
    behaviour = record_forward(model, routing, batch)
    perturb_routers(model)
    model.train()
    grid = Grid(len(batch[0]), batch[0].shape[1] + batch[2].shape[1], batch[0].shape[1])

    def loss_and_gradients():
        model.zero_grad()
        context = {"none": nullcontext(), "record": routing.capture(grid, router_logits=True),
                   "replay": routing.capture(replay=behaviour, router_logits=True)}[capture]
        with context as cap:
            loss = -token_logp(full_forward(model, routing, *batch), batch).sum()
        if cap is not None:
            loss = loss + cap.aux_loss()
        loss.backward()
        return loss.detach(), gradients(model), None if cap is None else cap.record.indices

    plain = loss_and_gradients()
    forward.set_memory_settings(model, activation_checkpointing=True)
    checkpointed = loss_and_gradients()
    assert torch.equal(checkpointed[0], plain[0])
    assert all(torch.equal(checkpointed[1][name], grad) for name, grad in plain[1].items())
    assert capture == "none" or torch.equal(checkpointed[2], plain[2])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(RuntimeError, match="set_memory_settings") as info:
        loss_and_gradients()
    assert "\n" not in str(info.value)


def test_record_rows_repad_like_the_rollout_rows():
    model, tokenizer = tiny_moe()
    routing = Routing(model)
    first = record_forward(model, routing, padded_batch(tokenizer, ["1+1=\n", "10+10=\n"], ["2", "20"]))
    second = record_forward(model, routing, padded_batch(tokenizer, ["123+321=\n"], ["444 exactly"]))
    joined = select_record_rows([first, second], [(1, 0), (0, 0)])
    direct = record_forward(model, routing, padded_batch(tokenizer, ["123+321=\n", "1+1=\n"], ["444 exactly", "2"]))
    assert joined.prompt_width == direct.prompt_width and torch.equal(joined.valid, direct.valid)
    assert torch.equal(joined.indices, direct.indices)


def test_aux_loss_is_the_models_own():
    model, tokenizer = tiny_moe()
    routing, batch = Routing(model), padded_batch(tokenizer)
    ids, mask = torch.cat([batch[0], batch[2]], 1), torch.cat([batch[1], batch[3]], 1)
    grid = Grid(len(ids), ids.shape[1], batch[0].shape[1])
    with routing.capture(grid, router_logits=True) as cap, routing.tokens(full_layout(mask)):
        model(ids, attention_mask=mask)
    expected = model(ids, attention_mask=mask, output_router_logits=True).aux_loss
    torch.testing.assert_close(cap.aux_loss(), expected, rtol=1e-6, atol=0)
    assert cap.aux_loss().requires_grad


def test_errors_are_one_line():
    model, tokenizer = tiny_moe()
    routing, batch = Routing(model), padded_batch(tokenizer)
    record = record_forward(model, routing, batch)
    ids = torch.cat([batch[0], batch[2]], 1)
    cases = [
        (lambda: Routing(load_model("tiny", tiny=TINY_SPEC)[0]), ValueError, "not a Mixture-of-Experts"),
        (lambda: routing.capture(replay=RoutingRecord(record.indices, ("a", "b"), record.prompt_width, 4)).__enter__(),
         ValueError, "not this model's routers"),
        (lambda: routing.capture(replay=RoutingRecord(record.indices.clamp(max=2) * 2, record.layers,
                                                      record.prompt_width, 4)).__enter__(), ValueError, "expert 4"),
        (lambda: routing.capture(replay=RoutingRecord(record.indices[..., :1].expand_as(record.indices).clone(),
                                                      record.layers, record.prompt_width, 4)).__enter__(),
         ValueError, "repeats an expert"),
    ]
    for make, error, words in cases:
        with pytest.raises(error, match=words) as info:
            make()
        assert "\n" not in str(info.value)
    with routing.capture(record.grid), pytest.raises(RuntimeError, match="without Routing.tokens"):
        model(ids)
    with routing.capture(record.grid), routing.tokens(full_layout(torch.ones(1, 3))), pytest.raises(
            RuntimeError, match="describes 3 tokens"):
        model(ids)
    assert routing_unsupported(model) is None


@pytest.mark.parametrize("make, overrides, words", [
    (tiny_moe_run, ["train.routing_replay=r4"], "must be one of none, r2, r3"),
    (tiny_run, ["train.routing_replay=r2"], "needs a Mixture-of-Experts model ('tiny' is dense)"),
    (tiny_moe_run, ["train.routing_replay=r2", "backend=trl"], "backend trl: train.routing_replay=r2 is not supported"),
    (tiny_moe_run, ["train.routing_replay=r3", "train.sampler=hf"], "use train.sampler=native"),
    (tiny_moe_run, ["train.routing_replay=r3", "train.compile_sampler=true"], "train.compile_sampler=false"),
    (tiny_moe_run, ["train.routing_replay=r3", "train.rollout_lag=1", "train.in_flight_tokens=3"],
     "a completion sampled in flight by several versions does not record: use r2 or none"),
    (tiny_moe_run, ["model.tiny.top_k=9"], "model.tiny.top_k must be an integer in"),
    (tiny_moe_run, ["model.tiny.intermediate_size=9"], "model.tiny has no field intermediate_size for tiny_moe"),
])
def test_routing_replay_settings_are_one_line_config_errors(tmp_path, make, overrides, words):
    with pytest.raises(ConfigError) as info:
        make(tmp_path, *overrides)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_replay_on_a_folder_reads_its_config(tmp_path):
    dense, moe = tmp_path / "dense", tmp_path / "moe"
    load_model("tiny", tiny=TINY_SPEC)[0].save_pretrained(dense)
    tiny_moe()[0].save_pretrained(moe)
    assert (config_is_moe(str(dense)), config_is_moe(str(moe)), config_is_moe("tiny_moe")) == (False, True, True)
    for r in ("r2", "r3"):
        tiny_moe_run(tmp_path, f"train.routing_replay={r}")  # valid


def test_an_unknown_moe_router_and_a_nested_text_config_are_told_apart_from_dense(tmp_path):
    """A model whose config names experts under any one of MOE_CONFIG_KEYS but whose router class is unknown is
    refused as such, not as dense; a folder's config with the experts in its text_config is an MoE."""
    from transformers import PretrainedConfig

    class Stub(torch.nn.Module):
        def __init__(self, **config):
            super().__init__()
            self.config = PretrainedConfig(**config)

    assert "router class is not one of" in routing_unsupported(Stub(num_local_experts=8))
    assert "not a Mixture-of-Experts model" in routing_unsupported(Stub())
    for name, config, moe in (("vl", {"text_config": {"num_experts": 8}}, True), ("plain", {"text_config": {}}, False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert config_is_moe(str(tmp_path / name)) is moe


def test_a_lora_policys_routing_is_its_base_models_with_the_classes_aux_loss():
    """A LoRA policy (peft around tiny_moe): hooked as the native loop hooks it, its auxiliary loss is the model
    class's own; hooked before the adapters (the TRL backend), the adapted policy finds its base's hooks."""
    from omegaconf import OmegaConf

    from harness.policy.lora import with_adapters
    from harness.policy.routing import routing_of
    from harness.run.config import LoraSettings

    model, tokenizer = tiny_moe()
    early = Routing(model)
    policy = with_adapters(model, OmegaConf.structured(LoraSettings(rank=2, target_modules=["q_proj"])), seed=0)
    assert routing_of(policy) is early
    early.close()
    routing, batch = Routing(policy), padded_batch(tokenizer)
    ids, mask = torch.cat([batch[0], batch[2]], 1), torch.cat([batch[1], batch[3]], 1)
    with routing.capture(Grid(len(ids), ids.shape[1], batch[0].shape[1]), router_logits=True) as cap, \
            routing.tokens(full_layout(mask)):
        policy(input_ids=ids, attention_mask=mask)
    expected = model(ids, attention_mask=mask, output_router_logits=True).aux_loss
    torch.testing.assert_close(cap.aux_loss(), expected, rtol=1e-6, atol=0)


def test_a_forward_after_its_layout_ended_is_refused_inside_the_capture():
    model, tokenizer = tiny_moe()
    routing, batch = Routing(model), padded_batch(tokenizer)
    ids, mask = torch.cat([batch[0], batch[2]], 1), torch.cat([batch[1], batch[3]], 1)
    with routing.capture(Grid(len(ids), ids.shape[1], batch[0].shape[1])):
        with routing.tokens(full_layout(mask)):
            model(ids, attention_mask=mask)
        with pytest.raises(RuntimeError, match="without Routing.tokens"):
            model(ids, attention_mask=mask)
