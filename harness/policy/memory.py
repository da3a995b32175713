"""Whether a run's sampling can fit in this machine's memory, checked before anything starts.

A floor, not an estimate of the peak: the policy's weights (with the frozen copies a run holds beside it: the
reference policy's, the sampler's in another precision), and for every completion sampled at once what its first
token takes for certain, the logits of one step over the vocabulary and that token's keys and values in every layer.
Every later token adds its keys and values (the native sampler reserves them up to ``train.max_new_tokens``, made
resident as they are written, harness/policy/decode.py), and gradients, optimizer state, activations and the
allocator's slack come on top: a run can fail above this floor, never below it. A run under it would end in an
allocation error at its first rollout, after its folder, its warm start and a traceback; it is refused in one line.
Where the model's shape is not known before it loads (a hub id), nothing is checked.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from harness.policy.device import DTYPES, resolve_device, sampler_dtype
from harness.run.checks import register_check
from harness.run.errors import ConfigError
from harness.run.shapes import TINY_MODEL_SPECS
from objectives import ADVANTAGES, estimator_name, get_objective, reads_reference_policy
from objectives.advantages import reference_samples

SAFETENSORS_HEADER_CAP = 100 * 2**20  # bytes: the safetensors format's own bound on a header


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory ``device`` has in all: a CUDA device's, or (cpu) the machine's physical memory or the
    cgroup's limit when lower (a container's); None where unknown (mps). On CUDA this initializes torch's CUDA state
    in the calling process (a sweep's parent: it starts its runs as new processes, never by fork)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    if device.type != "cpu":
        return None
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


@functools.lru_cache(maxsize=16)
def model_bytes(name: str, tiny: str, dtype: str, stamp: tuple = ()) -> tuple[int, int, int] | None:
    """(weights, one token, hidden size) of model ``name`` (``tiny``: its model.tiny as JSON), the first two in bytes
    in ``dtype``: a token's logits over the vocabulary and its keys and values in every layer, read from its config (a
    local folder's config.json, never a model built from it: a huge or odd one would take minutes or fail here); the
    weights are counted for the tiny models (their skeleton) and for a folder from its safetensors headers
    (:func:`folder_parameters`). None when the shape is not known
    before the model loads (a hub id) or its config cannot be read (loading it says why). ``stamp``: a folder's
    :func:`harness.policy.models.folder_stamp`, a cache key only."""
    from harness.policy.models import TINY_MODELS, folder_config, model_folder

    try:
        if name in TINY_MODELS:
            config, weights, layers = tiny_shape(name, json.loads(tiny))
        else:
            config, weights = folder_config(str(model_folder(name)), stamp)[0], folder_parameters(model_folder(name))
            if config is None:  # a hub id, or a folder the local_model check refuses
                return None
            layers = config.get_text_config().num_hidden_layers
        config = config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        per_token = int(config.vocab_size) + int(layers) * 2 * int(kv_heads) * int(head_dim)
    except Exception:  # noqa: BLE001 - any config transformers cannot read or we cannot size: not checked here
        return None
    size = DTYPES[dtype].itemsize
    return weights * size, max(per_token, 0) * size, int(config.hidden_size)


def folder_parameters(folder: Path) -> int:
    """The parameters a model folder's weights hold, from the headers of the safetensors files transformers loads
    (the files ``model.safetensors.index.json`` names, else ``model.safetensors``): each tensor's shape, nothing
    loaded. 0 (a floor still) for another weights format or a file that is not safetensors."""
    index = folder / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
            ["model.safetensors"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
    total = 0
    for name in files:
        try:
            with open(folder / name, "rb") as weights:
                length = int.from_bytes(weights.read(8), "little")
                header = json.loads(weights.read(length)) if 0 < length <= SAFETENSORS_HEADER_CAP else {}
            total += sum(math.prod(int(d) for d in t["shape"]) for k, t in header.items() if k != "__metadata__")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return total


def held_weights(run: DictConfig, weights: int, hidden_size: int = 0) -> tuple[int, str]:
    """The bytes of weights a native run holds while it samples (``weights``: the policy's, in ``model.dtype``) and
    what they are: the policy, its frozen reference copy when the run reads the reference policy (without LoRA: with
    it the reference is the base with the adapters off, no copy), its sampler copy in ``model.sampler_dtype``, the
    copies its objective keeps (``Objective.policy_copies``: POPO's moving target) and the parameters it trains
    beside the policy (``Objective.trained_parameter_count`` at the policy's ``hidden_size``: POPO's predictor), in
    float32 with their gradients and AdamW's two moments."""
    params = OmegaConf.to_container(run.objective.params)
    objective = get_objective(run.objective.name, **params)
    estimator = ADVANTAGES.get(estimator_name(run.objective.name, run.objective.advantage))
    total, parts = weights, ["the policy's"]
    if reads_reference_policy(objective, estimator) and not run.model.lora.rank:
        total, parts = total + weights, [*parts, "its reference copy's"]
    copy = sampler_dtype(run)
    if copy is not None:
        total += weights // DTYPES[run.model.dtype].itemsize * copy.itemsize
        parts.append(f"its {run.model.sampler_dtype} sampler copy's")
    if objective.policy_copies:  # declared by the objective (POPO's moving target)
        total += objective.policy_copies * weights
        parts.append(f"objective {run.objective.name}'s " + ("copy's" if objective.policy_copies == 1
                                                               else f"{objective.policy_copies} copies'"))
    trained = objective.trained_parameter_count(hidden_size)
    if trained:
        total += trained * 4 * 4  # float32: the parameters, their gradients, AdamW's two moments
        parts.append(f"objective {run.objective.name}'s trained parameters with their gradients and AdamW moments")
    return total, ", ".join(parts)


def tiny_shape(name: str, tiny: dict) -> tuple[object, int, int]:
    """(config, weights, layers) of tiny model ``name`` of shape ``tiny``, from the skeletons of one and two of its
    layers (every layer of both tiny models is the same, so the weights are the one-layer model's plus a layer's
    for each further one): a skeleton of ``num_layers`` layers would take minutes for a deep one."""
    from harness.policy.models import skeleton

    layers = tiny.get("num_layers", TINY_MODEL_SPECS[name].num_layers)
    one, two = (skeleton(name, {**tiny, "num_layers": n}) for n in (1, 2))
    sizes = [sum(p.numel() for p in model.parameters()) for model in (one, two)]
    return one.config, sizes[0] + (layers - 1) * (sizes[1] - sizes[0]), layers


def sampling_memory_problem(run: DictConfig, rows: int, what: str, held: bool = False,
                            by_sampler: bool = False) -> str | None:
    """Why ``rows`` completions sampled at once (``what``: the settings that make them, for the message) cannot fit on
    the run's device: the weights and each completion's first token (module docstring) above its memory; or None.
    ``held``: the weights are those a native run holds (:func:`held_weights`), not the policy's alone;
    ``by_sampler``: the completions' logits, keys and values are the sampler's, in ``model.sampler_dtype``."""
    from harness.policy.models import TINY_MODELS, folder_stamp, model_folder

    stamp = () if run.model.name in TINY_MODELS else folder_stamp(model_folder(run.model.name))
    known = model_bytes(run.model.name, json.dumps(OmegaConf.to_container(run.model.tiny), sort_keys=True),
                        run.model.dtype, stamp)
    device = resolve_device(run.device)
    total = device_memory(device)
    if known is None or total is None:
        return None
    weights, per_token, parts = known[0], known[1], "the policy's"
    if held:
        weights, parts = held_weights(run, weights, known[2])
    if by_sampler and sampler_dtype(run) is not None:  # known[1] is in model.dtype
        per_token = per_token // DTYPES[run.model.dtype].itemsize * sampler_dtype(run).itemsize
    first_tokens = rows * per_token
    if weights + first_tokens <= total:
        return None
    beside = f" beside {size(weights)} of weights ({parts})" if weights else ""
    if weights + per_token > total:  # not even one completion: the model itself, not the batch
        return (f"model {run.model.name!r} takes at least {size(weights + per_token)} for one completion's first "
                f"token (weights: {parts}; logits, keys and values), and this machine's {device.type} has "
                f"{size(total)} in all: choose a smaller model (or model.tiny's sizes)"
                + ("" if parts == "the policy's" else ", or settings that hold less beside it"))
    return (f"{what} = {rows} completions sampled at once need at least {size(first_tokens)} for their first token "
            f"(its logits, keys and values){beside}, and this machine's {device.type} has {size(total)} in all: "
            "lower them")


def size(nbytes: int) -> str:
    """Bytes for a message: GB from 0.1 GB, MB from 0.1 MB, else kB."""
    return (f"{nbytes / 1e9:,.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:,.1f} MB" if nbytes >= 1e5
            else f"{nbytes / 1e3:,.1f} kB")


@register_check("memory", when="node")
def check_memory(run: DictConfig) -> None:
    """When runs start here: a rollout's completions (or, if more, the reference's completions an estimator samples
    per step) fit in the device's memory (:func:`sampling_memory_problem`).
    The native loop samples a step's completions at once; TRL's backend shares them among its processes (each
    samples its part), so its runs are not checked here."""
    if run.backend != "native":
        return
    t = run.train
    estimator = estimator_name(run.objective.name, run.objective.advantage)
    references = reference_samples(ADVANTAGES.get(estimator))  # A*-PO's V*: that many of each prompt at once
    if references > t.group_size:
        problem = sampling_memory_problem(run, t.prompts_per_step * references,  # the reference's, in model.dtype
                                          f"train.prompts_per_step x the {references} reference completions of "
                                          f"estimator {estimator!r}", held=True)
    else:
        problem = sampling_memory_problem(run, t.prompts_per_step * t.group_size,
                                          "train.prompts_per_step x train.group_size", held=True, by_sampler=True)
    if problem:
        raise ConfigError(problem)
