"""The decoders of harness/policy/decode.py: each step's logits against the model's own full forward (teacher forcing)
for every supported architecture, with left padding, grouped-query attention and rows leaving the batch; the
fallback rules; and the sampler giving the same rollout through every decoder."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from harness.policy import decode
from harness.policy.architecture import positions, written_out_unsupported
from harness.policy.decode import CacheDecoder, Matmul, PerRowDecoder, SharedPrefixDecoder, build_decoder
from harness.policy.matmul import ONEDNN_MIN_ROWS, cpu_matmul
from harness.policy.models import build_prompt, load_model
from harness.policy.sampler import encode_prompts, generate
from harness.tasks import get_task
from tests.helpers.architectures import ARCHITECTURES, SHAPE, build


def reference_logits(model, prompt_ids, prompt_mask, completions):
    """The model's forward on prompt + completion: logits [N, T, V] predicting completion tokens 1..T and the next."""
    ids = torch.cat([prompt_ids, completions], 1)
    mask = torch.cat([prompt_mask, torch.ones_like(completions)], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    return logits[:, prompt_ids.shape[1] - 1 :].float()


@pytest.fixture(params=["onednn", "modules"])
def matmuls(request, monkeypatch):
    """Both ways of running the projections: oneDNN for every size (the threshold lowered), or the modules."""
    monkeypatch.setattr(decode, "ONEDNN_MIN_WEIGHTS", 0 if request.param == "onednn" else 2**62)
    monkeypatch.setattr(decode, "ONEDNN_MIN_WIDENING", 0)  # every shape, narrow outputs too
    return request.param


DECODER_CLASSES = {"shared_prefix": SharedPrefixDecoder, "per_row": PerRowDecoder, "cache": CacheDecoder}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@pytest.mark.parametrize("kind", list(DECODER_CLASSES))
@torch.no_grad()
def test_every_step_equals_the_full_forward(name, kind, matmuls):
    """After 2 steps rows 1 and 4 leave, after 4 steps rows 5 and 2 (the third prompt has no row left), and the
    rest are reordered."""
    check_every_step(build(name), kind)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_every_compiled_step_equals_the_full_forward(name, monkeypatch):
    """The compiled per-row step gives the same logits, and one graph serves every step, row count and rollout
    (new decoder and stacked weights, another prompt width and length; the single row left runs eagerly, where
    torch would specialise a second graph to size 1): no step recompiles it."""
    monkeypatch.setattr(decode, "ONEDNN_MIN_WEIGHTS", 0)  # the size where eager steps take oneDNN (not traceable)
    monkeypatch.setattr(decode, "ONEDNN_MIN_WIDENING", 0)
    torch._dynamo.reset()
    counters.clear()
    model = build(name)
    with torch.no_grad():
        check_every_step(model, "per_row", compile=True)
        check_every_step(model, "per_row", compile=True, width=9, steps=8)
        check_every_step(model, "per_row", compile=True, width=5, steps=8, leave=([5, 0, 2, 3], [3, 1], [1]))
    assert counters["stats"]["unique_graphs"] == 1


def check_every_step(model, kind: str, compile: bool = False, width: int = 7, steps: int = 6,
                     leave: tuple[list[int], ...] = ([5, 0, 2, 3], [3, 1])) -> None:
    """3 prompts of ``width`` tokens (two left-padded) x 2 rows, ``steps`` steps; after steps 2, 4, ... the rows
    ``leave`` says are kept (new row i = old row order[i])."""
    group = 2
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(1, 50, (3, width), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :3] = prompt_mask[2, :1] = 0
    completions = torch.randint(1, 50, (6, steps), generator=generator)
    expected = reference_logits(model, prompt_ids.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0),
                                completions)
    decoder, logits = build_decoder(model, prompt_ids, prompt_mask, group_size=group, max_new_tokens=steps, kind=kind,
                                    compile=compile)
    assert type(decoder) is DECODER_CLASSES[kind]
    rows, position = torch.arange(6), prompt_mask.sum(-1).repeat_interleave(group)
    torch.testing.assert_close(logits, expected[:, 0], atol=1e-5, rtol=1e-5)
    for t in range(steps):
        if t and t % 2 == 0 and t // 2 <= len(leave):
            order = torch.tensor(leave[t // 2 - 1])
            decoder.keep(order)
            rows, position = rows[order], position[order]
        logits = decoder.step(completions[rows, t], position + t)
        torch.testing.assert_close(logits, expected[rows, t + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@torch.no_grad()
def test_prompts_one_by_one_equal_the_padded_batch(name):
    """The prefill's two ways (CPU: each prompt at its own length; elsewhere: one left-padded batch) give the same
    last hidden states and the same keys/values at every unpadded position; an empty prompt takes the batch."""
    model = build(name)
    prompt_ids = torch.randint(1, 50, (3, 7), generator=torch.Generator().manual_seed(2))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :3] = prompt_mask[2, :6] = 0
    decoder = SharedPrefixDecoder(model, rows=3, max_new_tokens=2)
    hidden, prefix = decoder._prompts(prompt_ids, prompt_mask, one_by_one=True)
    batch_hidden, batch_prefix = decoder._prompts(prompt_ids, prompt_mask, one_by_one=False)
    torch.testing.assert_close(hidden, batch_hidden, atol=1e-5, rtol=1e-5)
    real = prompt_mask.bool()
    for (keys, values), (batch_keys, batch_values) in zip(prefix, batch_prefix, strict=True):
        assert keys.shape == batch_keys.shape == (3, SHAPE["num_key_value_heads"], 7, keys.shape[-1])
        torch.testing.assert_close(keys.transpose(1, 2)[real], batch_keys.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values.transpose(1, 2)[real], batch_values.transpose(1, 2)[real], atol=1e-5,
                                   rtol=1e-5)
    for row, holes in ((1, slice(None)), (1, slice(2, 4))):  # an empty prompt; a mask that is not left padding
        mask = prompt_mask.clone()
        mask[row, holes] = 0
        (one, one_prefix), (batch, batch_prefix) = (decoder._prompts(prompt_ids, mask, one_by_one=way)
                                                    for way in (True, False))
        assert torch.equal(one, batch) and torch.equal(one_prefix[0][0], batch_prefix[0][0])  # both: the batch


@torch.no_grad()
def test_a_stacked_matmul_equals_its_modules():
    """One output [n, out_1 + out_2] equal to the modules' outputs side by side, whichever way it runs: oneDNN
    (large float32 CPU weights with out_features >= 2 x in_features), F.linear on the stacked weights (small,
    narrow or bf16), or the modules themselves (hooks)."""
    torch.manual_seed(0)
    q, k = torch.nn.Linear(576, 576, bias=False), torch.nn.Linear(576, 192, bias=True)
    gate, up = torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(576, 1536, bias=True)
    x = torch.randn(5, 576)
    small, hooked = torch.nn.Linear(576, 32), torch.nn.Linear(576, 576)
    hooked.register_forward_hook(lambda module, inputs, out: out + 1)
    cases = [("onednn" if torch.backends.mkldnn.is_available() else "stacked", (gate, up)),
             ("stacked", (q, k)),  # 2^18 weights or more, but 768 outputs < 2 x 576 inputs
             ("stacked", (small, k)), ("modules", (hooked, k))]
    for kind, modules in cases:
        matmul = Matmul(*modules)
        assert matmul.kind == kind
        torch.testing.assert_close(matmul(x), torch.cat([m(x) for m in modules], -1), atol=1e-5, rtol=1e-5)
        residual = torch.randn(5, sum(m.out_features for m in modules))
        torch.testing.assert_close(matmul(x, residual=residual), residual + torch.cat([m(x) for m in modules], -1),
                                   atol=1e-5, rtol=1e-5)
    bf16 = Matmul(q.to(torch.bfloat16))
    assert bf16.kind == "stacked" and bf16.weight.data_ptr() == q.weight.data_ptr()  # one module: no weight copy


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_the_fused_rms_norm_equals_the_modules(name, dtype):
    """decode.rms_norm equals each written-out architecture's RMSNorm modules (the layers', the final one, Qwen3's
    per-head q/k norms) with trained-looking weights, in float32 and bf16; a module with a hook runs itself."""
    model = build(name, dtype)
    generator = torch.Generator().manual_seed(0)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) >= 2 * model.config.num_hidden_layers + 1 and all(type(m).__name__ in decode.RMS_NORMS
                                                                       for m in norms)
    tolerance = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for norm in norms:
        norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=generator))
        x = (3 * torch.randn(4, 3, norm.weight.shape[0], generator=generator)).to(dtype)
        got = decode.rms_norm(norm, x)
        assert got.dtype == dtype
        torch.testing.assert_close(got, norm(x), **tolerance)
    hooked = norms[0]
    hooked.register_forward_hook(lambda module, inputs, out: out + 1)
    x = torch.randn(2, hooked.weight.shape[0]).to(dtype)
    torch.testing.assert_close(decode.rms_norm(hooked, x), hooked(x))  # the hook's + 1 included


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_and_explicit_attention_parts_agree(dtype):
    """_attend's two ways (the CPU flash kernel; the matmul/softmax path every other device takes) give the same
    output and log-sum-exp, with a padding bias, grouped queries and keys of another length: the explicit path
    is what a GPU runs for the prompt part, so it is pinned here on CPU against the kernel and against the
    definition softmax(q k^T s + b) v, logsumexp(q k^T s + b)."""
    generator = torch.Generator().manual_seed(0)
    q, keys, values = (torch.randn(3, 2, l, 8, generator=generator).to(dtype) for l in (6, 9, 9))
    bias = torch.zeros(3, 1, 1, 9)
    bias[0, ..., :4] = bias[2, ..., :1] = torch.finfo(torch.float32).min
    scores = (q.float() @ keys.float().transpose(-1, -2)) * 0.3 + bias
    expected = (scores.softmax(-1) @ values.float(), scores.logsumexp(-1, keepdim=True))
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for fused in (True, False):
        out, lse = decode._attend(q, keys, values, bias, 0.3, fused=fused)
        assert out.dtype == lse.dtype == torch.float32 and lse.shape == (3, 2, 6, 1)
        torch.testing.assert_close(out, expected[0], **tolerance)
        torch.testing.assert_close(lse, expected[1], **tolerance)


@pytest.mark.parametrize("kind", ["shared_prefix", "per_row"])
@torch.no_grad()
def test_bf16_steps_stay_within_bf16_rounding_of_the_forward(kind):
    model = build("llama", torch.bfloat16)
    prompt_ids, completions = torch.randint(1, 50, (2, 5)), torch.randint(1, 50, (4, 4))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0
    expected = reference_logits(model, prompt_ids.repeat_interleave(2, 0), prompt_mask.repeat_interleave(2, 0),
                                completions)
    decoder, logits = build_decoder(model, prompt_ids, prompt_mask, group_size=2, max_new_tokens=4, kind=kind)
    position = prompt_mask.sum(-1).repeat_interleave(2)
    for t in range(4):
        assert logits.dtype == torch.bfloat16
        torch.testing.assert_close(logits.float(), expected[:, t], atol=0.05, rtol=0.02)
        logits = decoder.step(completions[:, t], position + t)


def test_where_the_shared_prefix_decoder_does_not_apply():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=64))
    assert "gpt2" in written_out_unsupported(gpt2, 10)
    sliding = Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert "sliding" in written_out_unsupported(sliding, 10)
    mistral = MistralForCausalLM(MistralConfig(**SHAPE, head_dim=8, sliding_window=16))
    assert written_out_unsupported(mistral, 16) is None and "sliding window" in written_out_unsupported(mistral, 17)
    dynamic = LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                      "rope_theta": 10000.0}))
    assert "rotary embedding (dynamic) changes with the sequence's length" in written_out_unsupported(dynamic, 10)
    assert written_out_unsupported(build("llama"), 10) is None
    ids = torch.ones(1, 3, dtype=torch.long)
    assert isinstance(build_decoder(gpt2, ids, torch.ones_like(ids), group_size=2, max_new_tokens=2)[0], CacheDecoder)
    for kind in ("shared_prefix", "per_row"):
        with pytest.raises(ValueError, match=f"the {kind} decoder cannot run this model: model_type 'gpt2'"):
            build_decoder(gpt2, ids, torch.ones_like(ids), group_size=2, max_new_tokens=2, kind=kind)
    with pytest.raises(ValueError, match="decoder must be one of auto, shared_prefix, per_row, cache"):
        build_decoder(gpt2, ids, torch.ones_like(ids), group_size=2, max_new_tokens=2, kind="vllm")
    with pytest.raises(ValueError, match="the shared-prefix decoder is not compiled"):
        build_decoder(build("llama"), ids, torch.ones_like(ids), group_size=2, max_new_tokens=2,
                      kind="shared_prefix", compile=True)


@torch.no_grad()
def test_auto_picks_per_row_for_small_prompt_copies_and_prefills_one_by_one_only_with_padding(monkeypatch):
    model = build("llama")
    ids = torch.ones(2, 6, dtype=torch.long)
    mask = torch.ones_like(ids)
    # 2 tensors x 4 rows x 6 positions x 2 key/value heads x 8 dims x 2 layers x 4 bytes
    assert decode.prompt_copies_bytes(model, 4, 6) == 2 * 4 * 6 * 2 * 8 * 2 * 4
    assert type(build_decoder(model, ids, mask, group_size=2, max_new_tokens=2)[0]) is PerRowDecoder
    monkeypatch.setattr(decode, "PER_ROW_MAX_PROMPT_BYTES", decode.prompt_copies_bytes(model, 4, 6) - 1)
    assert type(build_decoder(model, ids, mask, group_size=2, max_new_tokens=2)[0]) is SharedPrefixDecoder
    ways = []
    real = SharedPrefixDecoder._prompts
    monkeypatch.setattr(SharedPrefixDecoder, "_prompts", lambda self, *a, one_by_one: ways.append(one_by_one)
                        or real(self, *a, one_by_one=one_by_one))
    for padded in (0, 1):  # 0 and 1 of 12 positions padded (1/12 < ONE_BY_ONE_MIN_PADDING), then 2 of 12
        mask[0, :padded] = 0
        build_decoder(model, ids, mask, group_size=2, max_new_tokens=2)
    mask[1, :1] = 0
    build_decoder(model, ids, mask, group_size=2, max_new_tokens=2)
    assert ways == [False, False, True]


def sampler_runs(greedy: bool, settings: list[dict], group_size: int = 3) -> list:
    """One tiny model's rollouts (4 prompts, one cut short, x ``group_size``; 20 tokens; T = 1.2) with each
    ``generate`` setting."""
    model, tokenizer = load_model("tiny", tiny={"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                                "intermediate_size": 64})
    prompts = [build_prompt(tokenizer, p.question) for p in get_task("arith").train_problems()[:4]]
    prompts[1] = prompts[1][:15]
    runs = []
    for setting in settings:
        torch.manual_seed(0)
        runs.append(generate(model, tokenizer, prompts, group_size=group_size, max_new_tokens=20, temperature=1.2,
                             greedy=greedy, **setting))
    return runs


@pytest.mark.parametrize("greedy", [True, False])
def test_the_sampler_gives_the_same_rollout_through_every_decoder(greedy):
    runs = sampler_runs(greedy, [{"decoder": decoder} for decoder in DECODER_CLASSES])
    for run in runs[1:]:
        assert torch.equal(runs[0].completion_ids, run.completion_ids)
        torch.testing.assert_close(runs[0].sampler_logp, run.sampler_logp, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_the_compiled_sampler_gives_the_same_rollout():
    """generate(compile=True) (under inference mode, rows finishing): the eager per-row decoder's tokens and
    log-probs, inside a run's oneDNN scope (train.cpu_matmul's default, from 16 rows: the graph keeps inductor's
    kernels)."""
    with cpu_matmul("onednn"):
        eager, compiled = sampler_runs(False, [{"decoder": "per_row"}, {"decoder": "per_row", "compile": True}],
                                       group_size=ONEDNN_MIN_ROWS // 4 + 1)
    assert eager.truncated.any() and not eager.truncated.all()  # rows finished early and left the batch
    assert torch.equal(eager.completion_ids, compiled.completion_ids)
    torch.testing.assert_close(eager.sampler_logp, compiled.sampler_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["shared_prefix", "per_row", "cache"])
def test_held_bytes_counts_the_keys_values_and_weight_copies_beyond_the_weights(kind):
    """`bench --memory`'s sampler figures: by hand, fp32 keys/values at capacity (2 layers x k and v), the
    stacked q+k+v and gate+up copies (o, down and the LM head are the model's own weights: not copies)."""
    model, tokenizer = load_model("tiny", tiny={"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                                "intermediate_size": 64}, seed=0)
    prompts = [build_prompt(tokenizer, p.question) for p in get_task("arith").train_problems()[:3]]
    prompt_ids, prompt_mask = encode_prompts(model, tokenizer, prompts)
    d, p, groups, new, layers, heads, width = 3, prompt_ids.shape[1], 4, 10, 2, 2, 16
    with torch.inference_mode():
        decoder, _ = build_decoder(model, prompt_ids, prompt_mask, group_size=groups, max_new_tokens=new, kind=kind)
        held = decode.held_bytes(decoder, model)
    per_position = layers * 2 * heads * width * 4  # bytes of one position's keys and values in every layer
    keys_values = {"shared_prefix": (d * p + d * groups * new) * per_position,  # prompts once + generated per row
                   "per_row": d * groups * (p + new) * per_position, "cache": d * groups * (p + new) * per_position}
    assert keys_values[kind] <= held["state"] <= keys_values[kind] * 1.1  # + the rotary tables, masks, indices
    copies = layers * (3 * 32 * 32 + 2 * 64 * 32) * 4 if kind != "cache" else 0
    assert held["weight_copies"] == copies
