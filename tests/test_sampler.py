"""The samplers (harness/policy/sampler.py): the native decode loop against transformers' ``generate`` and the
trainer."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from harness.policy.forward import completion_logprobs
from harness.policy.models import build_prompt, load_model
from harness.policy.sampler import SAMPLE_BLOCK, Rollout, _inverse_cdf, _sample, check_sampler, generate, select_rows
from harness.run.errors import ConfigError
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
    # u = 0 (torch.rand can draw it) with the whole first block of zero weight (a top-p cut over the first ids):
    # the first entry of positive weight, never one of the empty block
    weights = torch.rand(2, 700, generator=generator) + 0.1
    weights[:, :SAMPLE_BLOCK] = 0.0
    assert (_inverse_cdf(weights, torch.zeros(2)) == SAMPLE_BLOCK).all()


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


@pytest.mark.parametrize("sampler", ["native", "hf"])
def test_the_draws_follow_the_temperature(tiny_policy, sampler):
    """Both samplers draw from softmax(logits / T), not only record log-probs under it: at T = 1e-3 every draw is
    the argmax (the greedy rollout), at T = 1 they are not; with top-p = 1 too (the reference's plain branch)."""
    model, tokenizer, prompts = tiny_policy
    greedy = generate(model, tokenizer, prompts, group_size=2, max_new_tokens=8, greedy=True, sampler=sampler)
    for temperature, equal in ((1e-3, True), (1.0, False)):
        torch.manual_seed(0)
        ro = generate(model, tokenizer, prompts, group_size=2, max_new_tokens=8, temperature=temperature,
                      sampler=sampler)
        assert torch.equal(ro.completion_ids, greedy.completion_ids) == equal


def _rollout(prompt_width: int, completion_width: int, rows: int = 2) -> Rollout:
    return Rollout(prompt_ids=torch.full((rows, prompt_width), 7), prompt_mask=torch.ones(rows, prompt_width),
                   completion_ids=torch.full((rows, completion_width), 5),
                   completion_mask=torch.ones(rows, completion_width, dtype=torch.bool),
                   sampler_logp=torch.full((rows, completion_width), -0.5), texts=["x"] * rows,
                   truncated=torch.tensor([True, False][:rows]))


def test_selected_rows_of_different_widths_are_padded_as_the_trainer_reads_them():
    """Rows of rounds of different widths (dynamic sampling, an in-flight rollout's parts): prompts re-padded on the
    left (the padding-free forward needs each prompt's last position real), completions on the right with mask
    False, log-prob 0 and the pad token; each row keeps its own truncation flag."""
    ro = select_rows([_rollout(2, 3), _rollout(4, 1)], [(1, 1), (0, 0)], pad_token_id=0)
    assert ro.prompt_ids.tolist() == [[7, 7, 7, 7], [0, 0, 7, 7]]
    assert ro.prompt_mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert ro.completion_ids.tolist() == [[5, 0, 0], [5, 5, 5]]
    assert ro.completion_mask.tolist() == [[True, False, False], [True, True, True]]
    assert ro.sampler_logp.tolist() == [[-0.5, 0.0, 0.0], [-0.5, -0.5, -0.5]]
    assert ro.truncated.tolist() == [False, True] and ro.texts == ["x", "x"]


def _train(**settings) -> OmegaConf:
    return OmegaConf.create({"train": {"top_p": 1.0, "temperature": 1.0, "sampler": "native", "decoder": "auto",
                                       "compile_sampler": False, **settings}})


@pytest.mark.parametrize("settings, message", [
    ({"temperature": 0.0}, "train.temperature > 0"), ({"temperature": -1.0}, "train.temperature > 0"),
    ({"top_p": 0.0}, "0 < train.top_p <= 1"), ({"top_p": 1.5}, "0 < train.top_p <= 1"),
    ({"sampler": "vllm"}, "train.sampler must be one of"), ({"decoder": "flash"}, "train.decoder must be one of"),
    ({"compile_sampler": True, "decoder": "shared_prefix"}, "compiles the native sampler"),
    ({"compile_sampler": True, "sampler": "hf"}, "compiles the native sampler"),
])
def test_the_sampler_check_refuses_what_cannot_sample(settings, message):
    """Temperature 0 would divide the logits by zero (greedy is ``greedy=True``, not T = 0)."""
    with pytest.raises(ConfigError, match=message):
        check_sampler(_train(**settings))


@pytest.mark.parametrize("settings", [{"top_p": 1.0}, {"top_p": 0.5, "temperature": 0.1},
                                      {"compile_sampler": True, "decoder": "per_row"},
                                      {"compile_sampler": True, "decoder": "cache"}, {"sampler": "hf"}])
def test_the_sampler_check_takes_what_can_sample(settings):
    check_sampler(_train(**settings))


@pytest.mark.parametrize("sampler, decoder", [("native", "auto"), ("native", "cache"), ("hf", "auto")])
def test_a_policy_in_train_mode_samples_as_itself_and_stays_in_train_mode(tiny_policy, sampler, decoder):
    """The update leaves the policy in train mode (LoRA dropout on): the sampler draws from the policy itself, not one
    dropout draw of it (here a hook that perturbs the logits in train mode only), and hands it back in the mode it
    was in."""
    model, tokenizer, prompts = tiny_policy

    def train_mode_noise(module, inputs, logits):
        return logits + 10 * torch.randn_like(logits) if module.training else logits

    settings = {"group_size": 2, "max_new_tokens": 6, "greedy": True, "sampler": sampler, "decoder": decoder}
    model.eval()
    expected = generate(model, tokenizer, prompts, **settings)
    assert not model.training  # each mode is handed back as it was
    handle = model.get_output_embeddings().register_forward_hook(train_mode_noise)
    try:
        model.train()
        ro = generate(model, tokenizer, prompts, **settings)
        assert model.training and model.get_output_embeddings().training
    finally:
        handle.remove()
        model.eval()
    assert torch.equal(ro.completion_ids, expected.completion_ids)
    assert torch.allclose(ro.sampler_logp, expected.sampler_logp, atol=1e-6, rtol=0)


def test_a_runs_sampler_settings_reach_the_decoder(tiny_policy, monkeypatch):
    """``sample_problems`` with a run's ``train`` section builds the decoder the run names, compiled as it asks
    (``train.compile_sampler``), with its group size and length."""
    from harness.policy import sampler as sampler_module

    model, tokenizer, _ = tiny_policy
    built, real = [], sampler_module.build_decoder

    def build(*args, **kwargs):  # records what the sampler asks for; runs it eagerly (a compile takes seconds)
        built.append(kwargs)
        return real(*args, **{**kwargs, "compile": False})

    monkeypatch.setattr(sampler_module, "build_decoder", build)
    train = OmegaConf.create({"group_size": 3, "max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9,
                              "sampler": "native", "decoder": "per_row", "compile_sampler": True})
    ro = sampler_module.sample_problems(model, tokenizer, get_task("arith").train_problems()[:2], train)
    assert ro.completion_ids.shape[0] == 6 and ro.completion_ids.shape[1] <= 4
    assert built == [{"group_size": 3, "max_new_tokens": 4, "kind": "per_row", "compile": True}]
