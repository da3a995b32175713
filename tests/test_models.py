"""harness/policy/models.py: the char-level tokenizer, seeded tiny models, prompts, the embedded SmolLM2, hub models
that cannot be loaded (the warm start: tests/test_warm_start.py)."""

from __future__ import annotations

import pytest
import torch

from harness.policy.models import build_prompt, char_tokenizer, load_model
from harness.tasks import get_task
from tests.helpers.tiny import TINY_SPEC


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
    first, _ = load_model("tiny", tiny=TINY_SPEC, seed=3)
    same, _ = load_model("tiny", tiny=TINY_SPEC, seed=3)
    other, _ = load_model("tiny", tiny=TINY_SPEC, seed=4)
    state, same_state = first.state_dict(), same.state_dict()
    assert all(torch.equal(state[k], same_state[k]) for k in state)
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert first.lm_head.weight is first.model.embed_tokens.weight and not first.training
    with pytest.raises(TypeError, match="hidden"):
        load_model("tiny", tiny={"hidden": 8})


def test_build_prompt_without_chat_template():
    assert build_prompt(char_tokenizer(), "What is 1+2?") == "What is 1+2?\n"


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


def test_a_hub_model_that_cannot_be_loaded_is_one_line_saying_what_to_do(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    with pytest.raises(OSError, match=r"cannot load 'no-such-owner/no-such-model' from the Hugging Face hub .*local"
                                      r" model folder.*HF_HUB_OFFLINE") as error:
        load_model("no-such-owner/no-such-model")
    assert "\n" not in str(error.value)
