"""Models: the char-level tokenizer, seeded tiny models, prompts, the cached warm start, the embedded SmolLM2."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from harness.models import build_prompt, char_tokenizer, load_model, warm_start
from harness.tasks import get_task

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}


def test_char_tokenizer_round_trips_exactly():
    tokenizer = char_tokenizer()
    text = 'What is 37+45? Answer after "####".\n  37+45=82 #### 82 ~{}\\|`'
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id, tokenizer.pad_token_id], skip_special_tokens=True) == text
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    assert tokenizer.padding_side == "left" and not tokenizer.chat_template
    assert tokenizer(["a", "abc"], padding=True).attention_mask == [[0, 0, 1], [1, 1, 1]]


def test_tiny_model_is_seeded():
    first, _ = load_model("tiny", tiny=TINY, seed=3)
    same, _ = load_model("tiny", tiny=TINY, seed=3)
    other, _ = load_model("tiny", tiny=TINY, seed=4)
    state, same_state = first.state_dict(), same.state_dict()
    assert all(torch.equal(state[k], same_state[k]) for k in state)
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert first.lm_head.weight is first.model.embed_tokens.weight and not first.training
    with pytest.raises(TypeError, match="hidden"):
        load_model("tiny", tiny={"hidden": 8})


def test_build_prompt_without_chat_template():
    assert build_prompt(char_tokenizer(), "What is 1+2?") == "What is 1+2?\n"


def test_warm_start_learns_and_is_cached(tiny_model, rlvr_cache):
    model, tokenizer = tiny_model
    task = get_task("arith", train_size=64, eval_size=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    warm_start(model, tokenizer, task, steps=5, lr=1e-2, batch_size=4, seed=0)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(before[k], trained[k]) for k in before)
    assert len(list((rlvr_cache / "warm_start").glob("*.safetensors"))) == 1
    assert not list((rlvr_cache / "warm_start").glob(".*"))  # no temp files left behind

    fresh, _ = load_model("tiny", tiny=TINY)
    with mock.patch("harness.models._supervised_batch", side_effect=AssertionError("trained on a cache hit")):
        warm_start(fresh, tokenizer, task, steps=5, lr=1e-2, batch_size=4, seed=0)  # loads, never trains
    assert all(torch.equal(trained[k], v) for k, v in fresh.state_dict().items())

    other, _ = load_model("tiny", tiny=TINY, seed=1)  # different initial weights: a different cache entry
    warm_start(other, tokenizer, task, steps=5, lr=1e-2, batch_size=4, seed=0)
    assert len(list((rlvr_cache / "warm_start").glob("*.safetensors"))) == 2


@pytest.mark.slow
def test_embedded_smollm2_loads_and_generates():
    model, tokenizer = load_model("smollm2-135m-instruct")
    assert abs(sum(p.numel() for p in model.parameters()) - 134.5e6) < 0.1e6
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    prompt = build_prompt(tokenizer, get_task("arith", eval_size=1, train_size=1).eval_problems()[0].question)
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")
    inputs = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > inputs.input_ids.shape[1]
    assert tokenizer.decode(out[0, inputs.input_ids.shape[1] :]).strip()
