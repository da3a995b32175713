"""Shared pieces of the MoE routing tests: a small tiny_moe, a padded batch, forwards laid out on the routing grid,
the sampler with its routing recorded, and a perturbation of the routers."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from harness.policy import decode
from harness.policy import sampler as rollout
from harness.policy.architecture import positions
from harness.policy.forward import distinct_prompts
from harness.policy.models import char_tokenizer
from harness.policy.routing import (
    Grid,
    RecordingDecoder,
    Routing,
    RoutingRecord,
    find_routers,
    full_layout,
    shared_prompt_layout,
    tail_layout,
)
from harness.policy.sampler import Rollout
from harness.policy.tiny_moe import build_tiny_moe
from harness.run.config import load_experiment, run_configs
from harness.run.shapes import TinyMoeSpec
from tests.helpers.tiny import TINY_RUN

TINY_MOE_SPEC = dict(hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2, expert_intermediate_size=16)
PROMPTS = ["12+30=\n", "7-4=\n", "7-4=\n", "100+1=\n"]  # rows 1 and 2 share a prompt
COMPLETIONS = ["42", "3", "3 and more", "101 ok"]
# the tiny run's settings (tests/helpers/tiny.py) with the small tiny_moe instead of the tiny Llama
TINY_MOE_RUN = ["model.name=tiny_moe", *(f"model.tiny.{k}={v}" for k, v in TINY_MOE_SPEC.items()),
                *(o for o in TINY_RUN if not o.startswith("model.tiny."))]


def tiny_moe_run(tmp_path, *overrides):
    """One validated run of the default experiment with the tiny settings on the small tiny_moe, under ``tmp_path``."""
    (run,) = run_configs(load_experiment("base", [*TINY_MOE_RUN, f"results_dir={tmp_path}", *overrides]))
    return run


def tiny_moe(seed: int = 0, **overrides):
    tokenizer = char_tokenizer()
    return build_tiny_moe(tokenizer, TinyMoeSpec(**{**TINY_MOE_SPEC, **overrides}), seed), tokenizer


def padded_batch(tokenizer, prompts=PROMPTS, completions=COMPLETIONS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Left-padded prompts and right-padded completions (EOS-terminated) [N, P], [N, P], [N, T], [N, T]."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    ids = [tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for text in completions]
    width = max(map(len, ids))
    completion = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    return enc.input_ids, enc.attention_mask, completion, mask


def full_forward(model, routing: Routing, prompt_ids, prompt_mask, completion_ids, completion_mask) -> Tensor:
    """The teacher-forced forward over [prompt | completion] (one call, laid out on the grid); logits [N, P + T, V]."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], 1)
    with routing.tokens(full_layout(mask)):
        return model(ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits


def shared_prompt_forward(model, routing: Routing, prompt_ids, prompt_mask, completion_ids, completion_mask) -> Tensor:
    """The trainer's shared-prompt forward (harness/policy/forward.py's ``_model_hidden``): each distinct prompt's head
    once, then every row's last prompt token and completion over its cache; final hidden states [N, T + 1, hidden]."""
    body = model.get_decoder()
    first_row, prompt_of_row = distinct_prompts(prompt_ids, prompt_mask)
    head_mask = prompt_mask[first_row, :-1]
    width = prompt_ids.shape[1] + completion_ids.shape[1]
    with routing.tokens(shared_prompt_layout(prompt_of_row, head_mask, width)):
        cache = body(input_ids=prompt_ids[first_row, :-1], attention_mask=head_mask,
                     position_ids=positions(head_mask), use_cache=True).cache
    cache.batch_select_indices(prompt_of_row)
    attention = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], 1)
    tail = torch.cat([prompt_ids[:, -1:], completion_ids], 1)
    with routing.tokens(tail_layout(attention[:, prompt_ids.shape[1] - 1 :], prompt_ids.shape[1] - 1, width)):
        tail_positions = positions(attention)[:, width - tail.shape[1] :]
        return body(input_ids=tail, attention_mask=attention, position_ids=tail_positions, cache=cache,
                    use_cache=True).last_hidden_state


def record_forward(model, routing: Routing, batch, forward=full_forward) -> RoutingRecord:
    """The routing of a no-grad ``forward`` of ``batch`` on its [prompt | completion] grid."""
    prompt_ids, _, completion_ids, _ = batch
    grid = Grid(len(prompt_ids), prompt_ids.shape[1] + completion_ids.shape[1], prompt_ids.shape[1])
    with torch.no_grad(), routing.capture(grid) as cap:
        forward(model, routing, *batch)
    return cap.record


def sample_recorded(model, tokenizer, routing: Routing, prompts: list[str], *, group_size: int,
                    max_new_tokens: int, eos_bonus: float = 3.0) -> tuple[Rollout, RoutingRecord]:
    """``generate`` through the cache decoder with the sampler's routing recorded (R3): harness.policy.decode's
    CacheDecoder wrapped in a RecordingDecoder, EOS made likelier (``eos_bonus`` added to its logit when drawing,
    so rows finish at different steps and leave the batch). Returns the rollout and its record on the rollout's
    grid, -1 outside its real tokens."""
    original_decoder, original_sample = decode.CacheDecoder, rollout._sample

    def recording(model, capacity, compile):
        return RecordingDecoder(original_decoder(model, capacity, compile), routing, capacity)

    def sample(logits, uniform, temperature, top_p):
        return original_sample(logits.index_add(-1, torch.tensor([tokenizer.eos_token_id]),
                                                torch.full((len(logits), 1), eos_bonus)), uniform, temperature, top_p)

    enc = tokenizer(prompts, padding=True, padding_side="left", add_special_tokens=False)
    width = len(enc.input_ids[0])
    with pytest.MonkeyPatch.context() as patch, routing.capture(
            Grid(len(prompts) * group_size, width + max_new_tokens, width)) as cap:
        patch.setattr(decode, "CacheDecoder", recording)
        patch.setattr(rollout, "_sample", sample)
        ro = rollout.generate(model, tokenizer, prompts, group_size=group_size, max_new_tokens=max_new_tokens,
                              decoder="cache", compact_every=1)
    grid = ro.prompt_ids.shape[1] + ro.completion_ids.shape[1]
    record = cap.record.select(torch.arange(len(ro.texts)), ro.completion_ids.shape[1])
    assert record.indices.shape[2] == grid
    return ro, record.masked(torch.cat([ro.prompt_mask.bool(), ro.completion_mask], 1))


def perturb_routers(model, scale: float = 0.2, seed: int = 1) -> None:
    """Add normal(0, scale) noise to every router's weight: the live top-k then differs from a record made before."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in find_routers(model).values():
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * scale)


def gradients(model) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
