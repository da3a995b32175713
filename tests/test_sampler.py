"""The samplers (harness/policy/sampler.py): the native decode loop against transformers' ``generate`` and the
trainer."""

from __future__ import annotations

import pytest
import torch

from harness.policy.forward import completion_logprobs
from harness.policy.models import build_prompt, load_model
from harness.policy.sampler import SAMPLE_BLOCK, _inverse_cdf, _sample, generate
from harness.tasks import get_task


@pytest.fixture(scope="module")
def tiny_policy():
    model, tokenizer = load_model("tiny", tiny={"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                                "intermediate_size": 64}, seed=0)
    task = get_task("arith")
    prompts = [build_prompt(tokenizer, p.question) for p in task.train_problems()[:6]]
    prompts[1] = prompts[1][:20]  # prompts of different lengths: left padding
    return model, tokenizer, prompts


@pytest.fixture
def eos_bias(tiny_policy):
    """Adds ``bias[0]`` to the EOS logit while the test runs (rows then finish at different steps)."""
    model, tokenizer, _ = tiny_policy
    bias = [0.0]

    def hook(module, inputs, logits):
        return logits + torch.nn.functional.one_hot(torch.tensor(tokenizer.eos_token_id), logits.shape[-1]) * bias[0]

    handle = model.get_output_embeddings().register_forward_hook(hook)
    yield bias
    handle.remove()


def check_eos_contract(ro, tokenizer, max_new_tokens):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    lengths = ro.completion_mask.sum(-1)
    assert ro.completion_ids.shape[1] == int(lengths.max()) <= max_new_tokens
    for ids, mask, logp, length, truncated in zip(ro.completion_ids, ro.completion_mask, ro.sampler_logp, lengths,
                                                  ro.truncated, strict=True):
        n = int(length)
        assert mask[:n].all() and not mask[n:].any()
        assert (logp[:n] < 0).all() and (logp[n:] == 0).all() and (ids[n:] == pad).all()
        assert eos not in ids[: n - 1].tolist()
        assert bool(truncated) == (ids[n - 1] != eos)
        assert not truncated or n == max_new_tokens


@pytest.mark.parametrize("group_size", [1, 3])
def test_native_greedy_matches_transformers_generate(tiny_policy, group_size):
    model, tokenizer, prompts = tiny_policy
    ref = generate(model, tokenizer, prompts, group_size=group_size, max_new_tokens=10, greedy=True, sampler="hf")
    ro = generate(model, tokenizer, prompts, group_size=group_size, max_new_tokens=10, greedy=True)
    assert torch.equal(ro.completion_ids, ref.completion_ids) and torch.equal(ro.completion_mask, ref.completion_mask)
    assert torch.equal(ro.prompt_ids, ref.prompt_ids) and torch.equal(ro.prompt_mask, ref.prompt_mask)
    assert torch.allclose(ro.sampler_logp, ref.sampler_logp, atol=1e-6, rtol=0)
    assert ro.texts == ref.texts and torch.equal(ro.truncated, ref.truncated)


@pytest.mark.parametrize("sampler", ["native", "hf"])
@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.8), (1.3, 1.0)])
def test_sampled_logprobs_equal_teacher_forced_logprobs(tiny_policy, eos_bias, sampler, temperature, top_p):
    model, tokenizer, prompts = tiny_policy
    eos_bias[0] = 2.0
    torch.manual_seed(0)
    ro = generate(model, tokenizer, prompts, group_size=4, max_new_tokens=16, temperature=temperature, top_p=top_p,
                  sampler=sampler)
    assert ro.completion_ids.shape[0] == len(prompts) * 4
    logp, _ = completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                  temperature)
    assert torch.allclose(logp.masked_fill(~ro.completion_mask, 0), ro.sampler_logp, atol=1e-5)
    check_eos_contract(ro, tokenizer, 16)
    assert ro.truncated.any() and not ro.truncated.all()


def test_the_two_level_inverse_cdf_is_the_exact_one():
    """Against the float64 inverse CDF over the whole vocabulary (700 entries: blocks of 256 and padding), for
    draws away from the boundaries; zero-weight entries (a top-p cut, a whole zero block) are never drawn, even
    for u -> 1 and where rounding leaves the point past a block's own sum."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(64, 700, generator=generator) ** 4
    weights[:, 300:520] = 0.0  # block 1 partly and the start of block 2 empty
    weights[::2, 650:] = 0.0  # the last entries of even rows empty
    weights[2, 649] = weights[3, 699] = 1.0  # the last positive entries of the rows that draw u -> 1
    uniform = torch.rand(64, generator=generator)
    uniform[:4] = torch.tensor([0.0, 1e-9, 1 - 1e-7, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))])
    cdf = weights.double().cumsum(-1)
    point = uniform.double()[:, None] * cdf[:, -1:]
    expected = torch.searchsorted(cdf, point, right=True)[:, 0].clamp(max=699)
    got = _inverse_cdf(weights, uniform)
    assert SAMPLE_BLOCK < 700 and (weights.gather(-1, got[:, None]) > 0).all()
    away = ((cdf - point).abs() > 1e-4 * cdf[:, -1:]).all(-1)  # no boundary within float32 rounding
    assert away[4:].float().mean() > 0.9 and torch.equal(got[away], expected[away])
    assert got[2] == 649 and got[3] == 699
    # a vocabulary smaller than a block: one block of V entries, the same draws as the exact inverse CDF
    small = torch.rand(64, 100, generator=generator) ** 4
    small[:, 60:] = 0.0
    cdf = small.double().cumsum(-1)
    point = uniform.double()[:, None] * cdf[:, -1:]
    away = ((cdf - point).abs() > 1e-4 * cdf[:, -1:]).all(-1)
    got = _inverse_cdf(small, uniform)
    assert (got < 60).all() and away.float().mean() > 0.9
    assert torch.equal(got[away], torch.searchsorted(cdf, point, right=True)[away, 0])
    # one block: its sum (vectorised) exceeds its own cumulative sum by rounding in some rows, so u -> 1 points
    # past the cumulative sum's end; the draw is still the last entry of positive weight (199), not padding (255)
    weights = torch.zeros(2000, 256)
    weights[:, :199] = torch.rand(2000, 199, generator=generator) ** 8
    weights[:, 199] = 1.0
    u = torch.full((2000,), torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item())
    past_the_end = u * weights.sum(-1) > weights.cumsum(-1)[:, -1]
    assert past_the_end.any() and (_inverse_cdf(weights, u) == 199).all()


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_a_sampled_token_and_its_logprob(temperature, top_p):
    """The log-prob is log_softmax(logits / T) at the token for greedy and sampled draws; a sampled token lies in
    the top-p nucleus; every token is drawn about as often as its probability (10,000 rows of a 5-token vocabulary)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(10_000, 1)  # most probable first
    logp_all = torch.log_softmax(logits / temperature, -1)
    token, logp = _sample(logits, None, temperature, top_p)
    assert (token == 0).all() and torch.allclose(logp, logp_all[:, 0], atol=1e-6, rtol=0)
    token, logp = _sample(logits, torch.rand(10_000, generator=torch.Generator().manual_seed(0)), temperature, top_p)
    assert torch.allclose(logp, logp_all.gather(-1, token[:, None])[:, 0], atol=1e-6, rtol=0)
    probs = logp_all[0].exp()
    kept = probs.cumsum(-1) - probs <= top_p  # the nucleus (the tokens are in order of probability)
    frequency = torch.bincount(token, minlength=5).float() / 10_000
    torch.testing.assert_close(frequency, torch.where(kept, probs, 0) / probs[kept].sum(), atol=0.015, rtol=0)


def test_same_seed_same_tokens(tiny_policy):
    model, tokenizer, prompts = tiny_policy
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(generate(model, tokenizer, prompts, group_size=2, max_new_tokens=12, temperature=1.5, top_p=0.9))
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.equal(runs[0].sampler_logp, runs[1].sampler_logp)
    assert not torch.equal(runs[0].completion_ids, runs[2].completion_ids)


def test_top_p_samples_only_from_the_nucleus(tiny_policy):
    model, tokenizer, prompts = tiny_policy
    torch.manual_seed(0)
    ro = generate(model, tokenizer, prompts, group_size=4, max_new_tokens=8, temperature=2.0, top_p=0.3)
    # the nucleus of 0.3 holds few tokens: each sampled token is among the most probable ones, whose mass < 0.3
    # before it, i.e. its probability is at least that of every token outside the nucleus
    logp, _ = completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, 2.0)
    assert torch.allclose(logp.masked_fill(~ro.completion_mask, 0), ro.sampler_logp, atol=1e-5)
    full = generate(model, tokenizer, prompts, group_size=4, max_new_tokens=8, temperature=2.0)
    assert ro.sampler_logp[ro.completion_mask].mean() > full.sampler_logp[full.completion_mask].mean()


def test_eos_ends_rows_and_the_loop(tiny_policy, eos_bias):
    model, tokenizer, prompts = tiny_policy
    eos_bias[0] = 100.0  # every row emits EOS first
    ro = generate(model, tokenizer, prompts, group_size=2, max_new_tokens=20, temperature=1.0)
    assert ro.completion_ids.shape == (12, 1) and (ro.completion_ids == tokenizer.eos_token_id).all()
    assert ro.completion_mask.all() and not ro.truncated.any() and ro.texts == [""] * 12
    eos_bias[0] = 2.5
    torch.manual_seed(3)
    ro = generate(model, tokenizer, prompts, group_size=4, max_new_tokens=30, temperature=1.0)
    check_eos_contract(ro, tokenizer, 30)
    assert len(set(ro.completion_mask.sum(-1).tolist())) > 3


def test_max_length_truncates(tiny_policy, eos_bias):
    model, tokenizer, prompts = tiny_policy
    eos_bias[0] = -100.0  # never EOS
    torch.manual_seed(0)
    ro = generate(model, tokenizer, prompts, group_size=2, max_new_tokens=7, temperature=1.0)
    assert ro.completion_ids.shape == (12, 7) and ro.completion_mask.all() and ro.truncated.all()
    assert ro.texts == tokenizer.batch_decode(ro.completion_ids, skip_special_tokens=True)


@pytest.mark.parametrize("greedy", [False, True])
def test_stop_at_eos_false_runs_every_row_to_full_length(tiny_policy, eos_bias, greedy):
    """`bench --scale`'s worst-case shapes: EOS is never drawn, however likely, and the other tokens keep their
    relative probabilities (the draw and log-prob of the EOS-less distribution)."""
    model, tokenizer, prompts = tiny_policy
    eos_bias[0] = 5.0  # EOS is the most likely token at every step
    torch.manual_seed(0)
    ro = generate(model, tokenizer, prompts, group_size=2, max_new_tokens=9, temperature=1.0, greedy=greedy,
                  stop_at_eos=False)
    assert ro.completion_ids.shape == (12, 9) and ro.completion_mask.all() and ro.truncated.all()
    assert tokenizer.eos_token_id not in ro.completion_ids.tolist()[0] + ro.completion_ids.flatten().tolist()
    assert (ro.sampler_logp <= 0).all()
    with pytest.raises(ValueError, match="stop_at_eos=False needs the native sampler"):
        generate(model, tokenizer, prompts, max_new_tokens=3, sampler="hf", stop_at_eos=False)


@pytest.mark.parametrize("greedy, bias, lengths", [(False, 2.0, 8), (True, 0.6, 2)])
def test_compaction_does_not_change_the_rollout(tiny_policy, eos_bias, greedy, bias, lengths):
    model, tokenizer, prompts = tiny_policy
    eos_bias[0] = bias
    runs = []
    for compact_every in (0, 1, 3):
        torch.manual_seed(0)
        runs.append(generate(model, tokenizer, prompts, group_size=3, max_new_tokens=24, temperature=1.0,
                             greedy=greedy, compact_every=compact_every))
    assert len(set(runs[0].completion_mask.sum(-1).tolist())) >= lengths  # rows finish at different steps
    for ro in runs[1:]:
        assert torch.equal(ro.completion_ids, runs[0].completion_ids) and ro.texts == runs[0].texts
        assert torch.allclose(ro.sampler_logp, runs[0].sampler_logp, atol=1e-6, rtol=0)


def test_bf16_model_samples_with_its_own_logprobs(tiny_policy):
    model, tokenizer, prompts = tiny_policy
    bf16 = load_model("tiny", tiny={"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
                      dtype=torch.bfloat16)[0]
    torch.manual_seed(0)
    ro = generate(bf16, tokenizer, prompts, group_size=2, max_new_tokens=10, temperature=1.0)
    assert ro.sampler_logp.dtype == torch.float32
    logp, _ = completion_logprobs(bf16, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    assert torch.allclose(logp.masked_fill(~ro.completion_mask, 0), ro.sampler_logp, atol=0.05)


def test_unknown_sampler_is_an_error(tiny_policy):
    model, tokenizer, prompts = tiny_policy
    with pytest.raises(ValueError, match="sampler"):
        generate(model, tokenizer, prompts, max_new_tokens=2, sampler="vllm")
