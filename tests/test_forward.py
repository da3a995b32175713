"""The padding-free trainer forward (harness/policy/forward.py) against the model's own forward on the padded batch: the
same completion log-probs, entropies and parameter gradients for every written-out architecture, with left-padded
prompts of different lengths, groups sharing a prompt, completions from 0 tokens to the full width; what its
padding costs (nothing); and the cases it leaves to the model's forward."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from harness.policy import forward
from harness.policy.forward import completion_logprobs, padding_free_unsupported
from tests.helpers.architectures import ARCHITECTURES, build

VOCAB = 50


def batch(prompt_lengths=(5, 3, 3, 6), group_size=2, width=7, lengths=(7, 1, 4, 0, 7, 2, 5, 3)):
    """Left-padded prompts [D x group_size, P] (a group's rows share theirs) and right-padded completions [N, width]
    of the given lengths (random tokens past them: they must not matter)."""
    generator = torch.Generator().manual_seed(0)
    width_p = max(prompt_lengths)
    prompt_ids = torch.randint(1, VOCAB, (len(prompt_lengths), width_p), generator=generator)
    prompt_mask = (torch.arange(width_p) >= width_p - torch.tensor(prompt_lengths)[:, None]).long()
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0).repeat_interleave(group_size, 0)
    prompt_mask = prompt_mask.repeat_interleave(group_size, 0)
    completion_ids = torch.randint(1, VOCAB, (len(lengths), width), generator=generator)
    completion_mask = torch.arange(width) < torch.tensor(lengths)[:, None]
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def logp_entropy_grads(model, args, padding_free: bool, temperature: float = 0.7):
    model.zero_grad(set_to_none=True)
    logp, entropy = completion_logprobs(model, *args, temperature, with_entropy=True, padding_free=padding_free)
    weights = torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp)
    (logp * weights).sum().backward()
    return logp.detach(), entropy, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_padding_free_equals_the_models_forward(name):
    model = build(name).train()
    args = batch()
    assert padding_free_unsupported(model, args[1], args[3]) is None
    packed, entropy_packed, grads_packed = logp_entropy_grads(model, args, padding_free=True)
    padded, entropy_padded, grads_padded = logp_entropy_grads(model, args, padding_free=False)
    mask = args[3]
    assert (packed[~mask] == 0).all() and (entropy_packed[~mask] == 0).all()
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy_packed, entropy_padded, atol=1e-5, rtol=1e-5)
    assert grads_packed.keys() == grads_padded.keys()
    for key, grad in grads_packed.items():
        torch.testing.assert_close(grad, grads_padded[key], atol=1e-5, rtol=1e-4, msg=key)


def test_padding_free_matches_one_row_at_a_time():
    """Rows computed together equal each row alone (no padding at all), prompt of one token included."""
    model = build("llama").train()
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(prompt_lengths=(4, 1), group_size=3,
                                                                     lengths=(7, 2, 5, 1, 6, 3))
    together, *_ = logp_entropy_grads(model, (prompt_ids, prompt_mask, completion_ids, completion_mask), True)
    for i in range(len(prompt_ids)):
        real = prompt_mask[i].bool()
        length = int(completion_mask[i].sum())
        alone, *_ = logp_entropy_grads(model, (prompt_ids[i : i + 1, real], prompt_mask[i : i + 1, real],
                                               completion_ids[i : i + 1, :length], completion_mask[i : i + 1, :length]),
                                       True)
        torch.testing.assert_close(together[i, :length], alone[0], atol=1e-5, rtol=1e-5)


def test_padding_tokens_change_nothing():
    model = build("qwen3").train()
    args = batch()
    repadded = args[2].masked_fill(~args[3], 7)
    first, _, grads_first = logp_entropy_grads(model, args, True)
    second, _, grads_second = logp_entropy_grads(model, (*args[:2], repadded, args[3]), True)
    assert torch.equal(first, second)
    assert all(torch.equal(grads_first[key], grads_second[key]) for key in grads_first)


@pytest.mark.parametrize("case, reason", [
    ("holes", "not a prefix"),
    ("right_padded_prompt", "not left-padded"),
    ("dropout", "attention dropout"),
    ("gpt2", "model_type 'gpt2'"),
])
def test_where_padding_free_does_not_apply_the_models_forward_runs(case, reason, monkeypatch):
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4)) if case == "gpt2" \
        else build("llama").train()
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch()
    if case == "holes":
        completion_mask[0, 3] = False
    if case == "right_padded_prompt":
        prompt_mask = prompt_mask.flip(1)
    if case == "dropout":
        model.config.attention_dropout = 0.1
    assert reason in padding_free_unsupported(model, prompt_mask, completion_mask)
    monkeypatch.setattr(forward, "completion_hidden", lambda *a: pytest.fail("the padding-free forward ran"))
    logp, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert torch.isfinite(logp).all() and (logp[~completion_mask] == 0).all()


@pytest.mark.slow  # an end-to-end run in this process: make test
@pytest.mark.parametrize("old_logp", ["sampler", "recompute"])  # recompute: the no-grad forward before the update
def test_a_run_with_and_without_padding_free_ends_at_the_same_weights(tmp_path, monkeypatch, old_logp):
    from harness.loop.native import train
    from tests.helpers.tiny import tiny_run

    packed_rows, real = [], forward.completion_hidden
    monkeypatch.setattr(forward, "completion_hidden",
                        lambda model, *args: packed_rows.append(len(args[0])) or real(model, *args))
    finals = []
    for setting in (True, False):
        run = tiny_run(tmp_path, f"train.padding_free={setting}", "train.steps=1", f"train.old_logp={old_logp}",
                       "objective.name=dapo", "task.overlong_buffer=6")
        train(run, tmp_path / str(setting), progress=False)
        finals.append(torch.load(tmp_path / str(setting) / "checkpoints" / "last.pt", weights_only=False)["policy"])
        if setting:
            ran, packed_rows[:] = len(packed_rows), []
    assert ran >= 2 and packed_rows == []  # every minibatch padding-free, then none
    for key in finals[0]:
        torch.testing.assert_close(finals[0][key], finals[1][key], atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.parametrize("padding_free", [True, False])
def test_the_lm_head_in_chunks_gives_the_same_logprobs_entropies_and_gradients(padding_free, monkeypatch):
    model, args = build("llama").train(), batch()  # 29 real positions; chunks of 4: 8 chunks, the last of 1
    whole, entropy_whole, grads_whole = logp_entropy_grads(model, args, padding_free)
    seen, real = [], forward._head_part
    monkeypatch.setattr(forward, "_head_part", lambda head, t, e, hidden, targets: seen.append(len(hidden)) or
                        real(head, t, e, hidden, targets))
    forward.set_memory_settings(model, lm_head_chunk=4)
    chunked, entropy_chunked, grads_chunked = logp_entropy_grads(model, args, padding_free)
    assert max(seen) == 4 and sum(seen) == 2 * int(args[3].sum())  # every chunk, then again in the backward
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy_chunked, entropy_whole, atol=1e-6, rtol=1e-6)
    for key, grad in grads_whole.items():
        torch.testing.assert_close(grads_chunked[key], grad, atol=1e-6, rtol=1e-5, msg=key)
    with torch.no_grad():  # without gradients: the chunks once, no recompute
        seen.clear()
        assert torch.equal(completion_logprobs(model, *args, 0.7, padding_free=padding_free)[0], chunked)
        assert sum(seen) == int(args[3].sum())


@pytest.mark.parametrize("padding_free", [True, False])
def test_activation_checkpointing_recomputes_the_layers_with_the_same_gradients(padding_free):
    model, args = build("qwen3").train(), batch()  # groups share prompts: the prompt pass keeps its cache
    plain, entropy_plain, grads_plain = logp_entropy_grads(model, args, padding_free)
    forward.set_memory_settings(model, activation_checkpointing=True)
    calls = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: calls.append(1))
    logp, entropy, grads = logp_entropy_grads(model, args, padding_free)
    assert len(calls) == (3 if padding_free else 2)  # recomputed in the backward (padding-free: + the prompt pass)
    torch.testing.assert_close(logp, plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, entropy_plain, atol=1e-6, rtol=1e-6)
    for key, grad in grads_plain.items():
        torch.testing.assert_close(grads[key], grad, atol=1e-6, rtol=1e-5, msg=key)
    forward.set_memory_settings(model)
    assert not model.is_activation_checkpointing


def test_the_lm_head_in_chunks_keeps_the_entropy_bonus_gradient():
    """An entropy with gradient (an entropy bonus, ``with_entropy="gradient"``) through the chunked head: the same
    values and gradient as the whole head (its chunks are not checkpointed: each keeps its graph)."""
    model, args = build("llama").train(), batch()

    def grads():
        model.zero_grad(set_to_none=True)
        logp, entropy = completion_logprobs(model, *args, 0.7, with_entropy="gradient")
        weights = torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp)
        ((logp + 0.3 * entropy) * weights).sum().backward()
        return entropy.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    entropy_whole, whole = grads()
    assert whole["lm_head.weight"].abs().sum() > 0
    forward.set_memory_settings(model, lm_head_chunk=4)
    entropy_chunked, chunked = grads()
    torch.testing.assert_close(entropy_chunked, entropy_whole, atol=1e-6, rtol=1e-6)
    for key, grad in whole.items():
        torch.testing.assert_close(chunked[key], grad, atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.parametrize("chunk", [0, 4])
def test_the_head_gives_the_tempered_distributions_logprob_entropy_and_sum_of_squares(chunk):
    """Against log_softmax(LM head(h) / T) by hand: the target's log-prob, the entropy -sum p log p and sum p^2, with
    the LM head whole or in chunks; the entropy carries a gradient only when asked (an entropy bonus): otherwise it is
    a statistic, and a loss that multiplies by it must not differentiate through it."""
    model = build("llama").train()
    forward.set_memory_settings(model, lm_head_chunk=chunk)
    hidden = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    targets = torch.arange(9) * 5
    logp_all = torch.log_softmax(model.get_output_embeddings()(hidden).float() / 0.7, -1)
    expected = (logp_all[torch.arange(9), targets], -(logp_all.exp() * logp_all).sum(-1), logp_all.exp().pow(2).sum(-1))
    logp, entropy = forward.head_logprobs(model, hidden, targets, 0.7, True)
    _, squares = forward.head_logprobs(model, hidden, targets, 0.7, forward.SUM_PI_SQUARED)
    for got, want in zip((logp, entropy, squares), expected, strict=True):
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-5)
    assert logp.requires_grad and not entropy.requires_grad and not squares.requires_grad
    _, with_gradient = forward.head_logprobs(model, hidden, targets, 0.7, "gradient")
    (grad,) = torch.autograd.grad(with_gradient.sum(), hidden)
    torch.testing.assert_close(grad, torch.autograd.grad(expected[1].sum(), hidden)[0], atol=1e-5, rtol=1e-4)
