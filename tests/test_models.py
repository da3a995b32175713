"""harness/policy/models.py: the char-level tokenizer, seeded tiny models, prompts, the embedded SmolLM2, hub models
that cannot be loaded (the warm start: tests/test_warm_start.py)."""

from __future__ import annotations

import pytest
import torch

from harness.policy.models import build_prompt, char_tokenizer, gguf_parsed_once, load_model, prepare_embedded_model
from harness.run.errors import ConfigError
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


# tensors_digest of the embedded SmolLM2's float32 weights as transformers' own GGUF loading dequantizes them, without
# gguf_parsed_once (transformers 5.24.0, gguf-py 0.19.0). The file's tensors are Q4_1, Q8_0 and F32; gguf-py
# dequantizes them with separate numpy multiplies and adds, each rounded alone, so no CPU should give other bits
# (recorded on one AMD EPYC; other CPUs not checked)
EMBEDDED_WEIGHTS_SHA256 = "3ac0c172da6bdd046b558c2f12d0adaa20eba5c9bd3bd656ecf4f7a2e6d30912"


def test_a_gguf_file_is_parsed_once_inside_the_block_and_the_library_is_restored_after_it(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(4, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    plain = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first and gguf.GGUFReader(str(path), "r") is first  # one parse per file
        assert gguf.GGUFReader(str(path), "c") is not first  # another mode is another reader
        assert first.tensors[0].data.tolist() == np.arange(12).reshape(4, 3).tolist()
        table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is table  # built once
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not table
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == plain
    assert gguf.GGUFReader(str(path)) is not gguf.GGUFReader(str(path))  # outside: the library's own, a parse each
    with pytest.raises(RuntimeError), gguf_parsed_once():
        raise RuntimeError
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == plain  # restored after an error too


@pytest.mark.slow  # builds the embedded model's cache where it is missing (make setup builds it)
def test_the_embedded_weights_are_transformers_own_dequantization():
    """The cache prepare_embedded_model builds (reading the GGUF once) holds the weights transformers' plain GGUF
    loading gives, bit for bit."""
    from safetensors.torch import load_file

    from harness.policy.models import prepare_embedded_model
    from harness.run.provenance import tensors_digest

    weights = load_file(prepare_embedded_model() / "model.safetensors")
    assert len(weights) == 272 and tensors_digest(weights) == EMBEDDED_WEIGHTS_SHA256


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


def test_the_embedded_cache_under_a_file_is_one_line_before_the_build(tmp_path, monkeypatch):
    """`make setup`'s prepare with RLVR_CACHE a file: the config error, not FileExistsError after the build."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "file"))
    monkeypatch.setattr("harness.policy.models.AutoModelForCausalLM", None)  # a build would fail on it at once
    with pytest.raises(ConfigError, match=f"^cannot use the cache folder {tmp_path / 'file'} "):
        prepare_embedded_model()

