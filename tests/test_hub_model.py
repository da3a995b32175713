"""Hub models on CPU: a tiny randomly initialised Qwen2 with a ChatML template and a Qwen-style generation_config,
saved in the hub layout, loads, trains (native in float32 and bfloat16, and through TRL) with chat-template prompts;
``train.export_every`` exports reload with transformers and give the trained policy's log-probs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from harness.loop.native import train
from harness.policy import sampler as sampler_module
from harness.policy.forward import completion_logprobs
from harness.policy.models import build_prompt, char_tokenizer, load_model
from harness.policy.sampler import generate
from harness.run.config import load_experiment, run_configs
from harness.run.records import read_jsonl
from tests.helpers.tiny import KEEP, TINY_RUN, TINY_SPEC, tiny_run

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory) -> Path:
    """A folder as `hf download Qwen/...-Instruct` leaves it: config, safetensors, tokenizer with a chat template
    whose end-of-turn token is EOS, and a generation_config with Qwen's sampling defaults."""
    folder = tmp_path_factory.mktemp("hub") / "tiny-qwen2-instruct"
    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token, tokenizer.chat_template = "<|im_end|>", CHATML
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    for key, value in QWEN_SAMPLING.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def hub_run(tmp_path, folder, *overrides):
    settings = [o for o in TINY_RUN if not o.startswith("model.tiny.")]
    (run,) = run_configs(load_experiment("base", [*settings, f"results_dir={tmp_path}", f"model.name={folder}",
                                                  *overrides]))
    return run


def assert_same_logprobs(folder: Path, trained, tokenizer) -> None:
    """The policy saved in ``folder`` reloads with transformers (model and tokenizer) and gives ``trained``'s
    completion log-probs on sampled completions."""
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=trained.dtype).eval()
    reloaded = AutoTokenizer.from_pretrained(folder)
    prompt = build_prompt(tokenizer, "What is 1+2?")
    assert build_prompt(reloaded, "What is 1+2?") == prompt  # the chat template travels with the policy
    assert reloaded(prompt).input_ids == tokenizer(prompt).input_ids
    torch.manual_seed(0)
    ro = generate(trained, tokenizer, [prompt], group_size=2, max_new_tokens=6)
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    with torch.no_grad():
        before, after = (completion_logprobs(model, *args)[0] for model in (trained, exported))
    assert torch.allclose(before, after, atol=1e-6)


def spy_prompts(monkeypatch) -> list[str]:
    """Every prompt the rollout and the evaluation build."""
    prompts = []

    def spy(tokenizer, question):
        prompts.append(build_prompt(tokenizer, question))
        return prompts[-1]

    monkeypatch.setattr(sampler_module, "build_prompt", spy)  # the rollout's and the evaluation's (sample_problems)
    return prompts


def test_a_hub_folder_loads_with_its_chat_template_and_samples_from_the_policy(hub_folder):
    model, tokenizer = load_model(str(hub_folder))
    assert type(model).__name__ == "Qwen2ForCausalLM" and tokenizer.padding_side == "left"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<pad>"
    prompt = build_prompt(tokenizer, "What is 1+2?")
    assert prompt == "<|im_start|>user\nWhat is 1+2?<|im_end|>\n<|im_start|>assistant\n"
    assert model.generation_config.repetition_penalty is None  # unset on load: it would bend the sampler
    assert model.generation_config.top_k == 20  # the rest is kept (the samplers pass their own top-k / top-p)
    for sampler in ("native", "hf"):  # the sampler's log-probs are the policy's own, whatever the hub defaults
        torch.manual_seed(0)
        ro = generate(model, tokenizer, [prompt, build_prompt(tokenizer, "Add 3 and 4")], group_size=3,
                      max_new_tokens=12, temperature=0.9, sampler=sampler)
        with torch.no_grad():
            logp, _ = completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                          ro.completion_mask, 0.9)
        assert torch.allclose(logp.masked_fill(~ro.completion_mask, 0), ro.sampler_logp, atol=1e-5), sampler


@pytest.mark.slow  # an end-to-end run in this process: make test
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_trains_a_hub_model_with_chat_template_prompts(tmp_path, hub_folder, monkeypatch, dtype):
    prompts = spy_prompts(monkeypatch)
    summary = train(hub_run(tmp_path, hub_folder, f"model.dtype={dtype}"), tmp_path / "run", progress=False)
    assert summary["status"] == "finished" and summary["steps_done"] == 2
    assert prompts and all(p.startswith("<|im_start|>user\n") and p.endswith("<|im_start|>assistant\n")
                           for p in prompts)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["grad_norm"] is not None for r in rows[1:])
    final = tmp_path / "run" / "final"
    assert json.loads((final / "config.json").read_text())["dtype"] == dtype
    assert json.loads((final / "generation_config.json").read_text()).get("repetition_penalty") is None
    assert AutoTokenizer.from_pretrained(final).chat_template == CHATML


@pytest.mark.slow
def test_the_trl_backend_trains_a_hub_model_with_its_chat_template(tmp_path, hub_folder):
    from harness.loop.trl_backend import train_trl

    summary = train_trl(hub_run(tmp_path, hub_folder, "backend=trl", "train.export_every=1"), tmp_path / "run",
                        progress=False)
    assert summary["status"] == "finished"
    samples = read_jsonl(tmp_path / "run" / "eval_samples.jsonl")
    assert samples and {s["step"] for s in samples} == {0, 2}
    # the last export is the final policy: the same log-probs (TRL exports through trainer.save_model)
    final, tokenizer = load_model(str(tmp_path / "run" / "final"))
    assert sorted(p.name for p in (tmp_path / "run" / "exports").iterdir()) == ["step_1", "step_2"]
    assert_same_logprobs(tmp_path / "run" / "exports" / "step_2", final, tokenizer)


@pytest.mark.slow  # a run exporting its policy each step: make test
def test_export_every_saves_policies_that_reload_with_the_same_logprobs(tmp_path):
    run = tiny_run(tmp_path, "train.export_every=1", "task.eval_size=4", KEEP)
    train(run, tmp_path / "run", progress=False)
    exports = tmp_path / "run" / "exports"
    assert sorted(p.name for p in exports.iterdir()) == ["step_1", "step_2"]  # no .tmp left behind
    checkpoints = tmp_path / "run" / "checkpoints"  # save_every=1: previous.pt is step 1, last.pt step 2
    for step, checkpoint in ((1, "previous.pt"), (2, "last.pt")):
        trained, tokenizer = load_model("tiny", tiny=TINY_SPEC, seed=0)
        trained.load_state_dict(torch.load(checkpoints / checkpoint, weights_only=False)["policy"])
        assert torch.load(checkpoints / checkpoint, weights_only=False)["state"]["step"] == step
        assert_same_logprobs(exports / f"step_{step}", trained, tokenizer)
    assert tiny_run(tmp_path).train.export_every == 0  # the default: final/ only


def test_export_every_is_checked(tmp_path):
    from harness.run.errors import ConfigError

    with pytest.raises(ConfigError, match="train.export_every must be >= 0"):
        tiny_run(tmp_path, "train.export_every=-1")
