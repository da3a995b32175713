"""LoRA adapters on the policy (``model.lora``, the ``peft`` library): the base model frozen, low-rank adapters
trained, on both backends.

    policy = with_adapters(policy, cfg.model.lora, seed=cfg.model.seed)   # native: the adapted policy
    with adapters_disabled(policy): ...                 # the base model, the starting policy (the KL reference)
    state = trained_state(policy); load_trained_state(policy, state)      # a checkpoint's policy part
    export_merged(policy, tokenizer, folder)            # the base with the adapters merged in, transformers' format

LoRA (Hu et al. 2021, arXiv 2106.09685), as ``peft.tuners.lora.layer.Linear`` computes it for each targeted linear
layer W (huggingface/peft, ``src/peft/tuners/lora/layer.py``):

    y = W x + (alpha / r) B A dropout(x),   A [r, in] Kaiming-uniform, B [out, r] = 0 at the start

so the adapted policy starts as the base model exactly (the added term is 0), and the base model with its adapters
disabled *is* the starting policy: the KL reference needs no second copy of the weights. The adapters' initial A is
drawn from ``model.seed`` (part of the starting policy, shared by every run of a sweep, the same on both backends).
Only the adapters get gradients; a checkpoint holds them (and the optimizer's state of them, whose parameters they
are), the base being rebuilt exactly from its cached warm start; ``final/`` holds them in peft's layout
(``adapter_config.json``, ``adapter_model.safetensors``: ``PeftModel.from_pretrained(starting policy, final/)``) and,
with ``model.lora.export_merged``, the merged model under ``final/merged/`` (transformers' format).

peft is imported when adapters are made or loaded: a run without them never pays its import.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import sys
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from harness.run.atomic import atomic_write
from harness.run.checks import register_check
from harness.run.errors import ConfigError
from harness.run.records import no_save_progress_bar


@register_check("lora")
def check_lora(run: DictConfig) -> None:
    """``model.lora``: off (rank 0), or a rank >= 1 with alpha > 0 (or null), dropout in [0, 1) and target modules
    named; ``export_merged`` only with adapters."""
    lora = run.model.lora
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank must be >= 0 (0: no adapters), got {lora.rank}")
    if not lora.rank:
        if lora.export_merged:
            raise ConfigError("model.lora.export_merged merges adapters into final/merged/: it needs "
                              "model.lora.rank >= 1")
        return
    if lora.alpha is not None and not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha must be > 0 (or null: 2 x rank), got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    targets = list(lora.target_modules)
    if not targets or not all(isinstance(name, str) and name for name in targets):
        raise ConfigError(f"model.lora.target_modules must name the linear layers to adapt (e.g. [q_proj, v_proj]), "
                          f"got {targets}")
    twice = sorted({name for name in targets if targets.count(name) > 1})
    if twice:  # the same adapters as listing it once, under another run id
        raise ConfigError(f"model.lora.target_modules lists {', '.join(twice)} more than once: list each layer once")
    tiny = run.model.get("tiny")
    shape = json.dumps(OmegaConf.to_container(tiny) if tiny else {}, sort_keys=True)  # the tiny models' (cache key)
    reason = targets_refused(run.model.name, shape, tuple(targets))
    if reason:
        raise targets_error(targets, reason)
    bound = rank_bound(run.model.name, shape, tuple(targets))
    if bound and lora.rank > bound[0]:
        raise ConfigError(f"model.lora.rank={lora.rank} is above {bound[0]}, the smaller side of {bound[1]}, a layer "
                          f"it adapts: the update B A has rank at most {bound[0]} whatever the rank, so a larger one "
                          f"only adds parameters and memory; give at most {bound[0]}")


def names(module: str, target: str) -> bool:
    """Whether peft's ``target_modules`` entry ``target`` names the module ``module`` (its full name or last parts)."""
    return module == target or module.endswith(f".{target}")


@functools.cache
def rank_bound(name: str, tiny: str, targets: tuple[str, ...]) -> tuple[int, str] | None:
    """The smallest min(in_features, out_features) of the layers of model ``name`` that ``targets`` name (its linear
    layers, and an MoE's stacked experts, each expert's matrix adapted at the rank: peft's ``target_parameters``), and
    that layer's name and shape (on its skeleton, :func:`targets_refused`), or None where the modules are not known
    before the model loads."""
    from harness.policy.models import skeleton

    model = skeleton(name, json.loads(tiny))
    if model is None:
        return None
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    named = [(min(m.in_features, m.out_features), f"{n} ({m.out_features} x {m.in_features})")
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and any(names(n, t) for t in targets)]
    adapted = meta_adapters(model, targets)
    named += [(min(shapes[n][-2:]), f"{n} ({shapes[n][0]} experts of {shapes[n][1]} x {shapes[n][2]})")
              for n in getattr(adapted, "targeted_parameter_names", None) or () if len(shapes.get(n, ())) == 3]
    return min(named) if named else None


def meta_adapters(model, targets):
    """peft's rank-1 adapters on ``model`` (a skeleton on the meta device) for ``targets``; raises peft's ValueError
    where no name matches or a fused pair is named in part."""
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, LoraConfig(r=1, target_modules=list(targets), task_type="CAUSAL_LM"))


@functools.cache
def targets_refused(name: str, tiny: str, targets: tuple[str, ...]) -> str | None:
    """Why ``targets`` do not all name linear layers of model ``name``'s blocks (peft's adapters on its skeleton on
    the meta device, before any run folder is made; not its embeddings or LM head), or None; None too for a model
    whose modules are not known before it loads (a hub id: the run checks them then, :func:`with_adapters`)."""
    from harness.policy.models import skeleton

    model = skeleton(name, json.loads(tiny))
    if model is None:
        return None
    ends = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    frozen = [n for n, module in model.named_modules() if id(module) in ends]
    named = sorted({t for t in targets if any(names(n, t) for n in frozen)})
    if named:  # peft would adapt them (tied ones with a warning); the harness keeps them frozen
        return (f"{', '.join(named)} {'is' if len(named) == 1 else 'are'} the model's embeddings or LM head, which "
                "stay frozen (docs/lora.md, Limits)")
    try:
        adapted = meta_adapters(model, targets)
    except ValueError as error:  # no name matched, or a fused pair named in part
        return peft_reason(error)
    # peft ignores a name that matches nothing when another one matches; on a Mixture of Experts it moves the
    # experts' projections to target_parameters (their stacked weights)
    settings = adapted.peft_config["default"]
    unmatched = sorted(
        target for wanted, found in ((settings.target_modules, adapted.targeted_module_names),
                                     (getattr(settings, "target_parameters", None) or (),
                                      getattr(adapted, "targeted_parameter_names", None) or ()))
        for target in wanted if not any(names(n, target) for n in found))
    return f"{', '.join(unmatched)} {'matches' if len(unmatched) == 1 else 'match'} no module of {name}" \
        if unmatched else None


def peft_reason(error: ValueError) -> str:
    """peft's refusal in one line ("Target modules {...} not found in the base model"); one that names a module by its
    printed form (a block such as LlamaMLP, whose repr spans lines) said as that block's class."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    block = re.match(r"Target module (\w+)\(", text)
    if block:
        return f"it names a {block[1]} block, not a linear layer peft can adapt"
    return text.splitlines()[0].rstrip(".")


def targets_error(targets: list, reason: str) -> ConfigError:
    return ConfigError(f"model.lora.target_modules={list(targets)}: {reason}; name the model's linear layers (the "
                       "Llama family's: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)")


def lora_settings(lora: DictConfig):
    """``model.lora`` as peft's ``LoraConfig`` (``alpha`` null: 2 x rank; no bias adapted)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha if lora.alpha is not None else 2 * lora.rank,
                      lora_dropout=lora.dropout, target_modules=list(lora.target_modules), bias="none",
                      task_type="CAUSAL_LM")


# peft's expansion of MLP names onto a Mixture-of-Experts' stacked expert weights makes a pattern per name and says
# which of them found nothing (tiny_moe's gate_up_proj): a note about peft's own patterns, not the user's settings
PEFT_PATTERN_NOTE = r"The following (alpha|rank)_pattern keys did not match"


@contextmanager
def seeded(seed: int):
    """Torch's CPU random stream seeded with ``seed`` inside, restored afterwards (the adapters' initial A)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def with_adapters(model, lora: DictConfig, seed: int):
    """``model`` (modified in place) wrapped as a ``peft.PeftModel`` with fresh adapters (``model.lora``; A drawn
    from ``seed``, B = 0): only the adapters require gradients. Target modules the model lacks: a ConfigError."""
    from peft import get_peft_model

    with seeded(seed), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message=PEFT_PATTERN_NOTE, category=RuntimeWarning)
        try:
            return get_peft_model(model, lora_settings(lora))
        except ValueError as error:  # peft: "Target modules {...} not found in the base model"
            raise targets_error(list(lora.target_modules), peft_reason(error)) from None


def adapted(model) -> bool:
    """Whether ``model`` is a peft model (adapters on a base)."""
    peft = sys.modules.get("peft")  # not imported: nothing can be a peft model
    return peft is not None and isinstance(model, peft.PeftModel)


def adapters_disabled(model):
    """A context in which ``model`` computes as its base (an adapted model's adapters off), else nothing."""
    return model.disable_adapter() if adapted(model) else nullcontext()


def trained_state(model) -> dict[str, Tensor]:
    """The weights a checkpoint holds: an adapted model's adapters (peft's names), else the whole state dict."""
    if not adapted(model):
        return model.state_dict()
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_trained_state(model, state: dict[str, Tensor]) -> None:
    """Load :func:`trained_state`'s weights into ``model`` (an adapted model: its adapters; every one must be
    there, and nothing else)."""
    if not adapted(model):
        model.load_state_dict(state)
        return
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state)
    adapters = {name for name, p in model.named_parameters() if p.requires_grad}
    missing = adapters & set(result.missing_keys)
    if result.unexpected_keys or missing:
        raise RuntimeError(f"the checkpoint's adapters do not fit this model: missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(result.unexpected_keys)[:3]}")


def merged_linear(module) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) of the linear map a peft LoRA ``Linear`` applies in eval mode, its active adapters merged into
    its base weight, W + sum_a (alpha_a / r_a) B_a A_a (peft's ``get_delta_weight``), detached, in the base's
    dtype; None for anything else (a plain or a non-linear base, merged or disabled adapters, DoRA, adapted biases,
    hooks)."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(module, peft.tuners.lora.LoraLayer) or not hasattr(module, "get_delta_weight"):
        return None
    base = module.get_base_layer()
    if (type(base) is not torch.nn.Linear or module.merged or module.disable_adapters or base._forward_hooks
            or base._forward_pre_hooks or module._forward_hooks or module._forward_pre_hooks):
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if any(module.use_dora.get(a) or module.lora_bias.get(a) for a in active):
        return None
    with torch.no_grad():
        weight = base.weight.detach()
        for adapter in active:
            weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
    return weight, None if base.bias is None else base.bias.detach()


def merged_state(model) -> dict[str, Tensor] | None:
    """The state dict of ``model``'s base model with every adapter merged into the weight it adapts (new tensors,
    the model untouched), as a model without adapters names them; None when some adapter is not a plain LoRA on a
    linear layer (:func:`merged_linear`: e.g. peft's LoRA over a Mixture-of-Experts' stacked expert weights)."""
    base = model.get_base_model()
    state = base.state_dict()
    for name, module in base.named_modules():
        merged = merged_linear(module)
        if merged is None:
            continue
        prefix = f"{name}."
        for key in [k for k in state if k.startswith(prefix) and (".lora_" in k or ".base_layer." in k)]:
            del state[key]
        state[f"{prefix}weight"] = merged[0]
        if merged[1] is not None:
            state[f"{prefix}bias"] = merged[1]
    return None if any(".lora_" in key for key in state) else state


def export_merged(model, tokenizer, folder: Path) -> None:
    """The adapted ``model`` with its adapters merged into the base weights, in transformers' format with the
    tokenizer (``AutoModelForCausalLM.from_pretrained`` loads it), written atomically into ``folder``; the model
    itself is left as it is: :func:`merged_state`'s tensors, or where that cannot merge every adapter, peft's
    ``merge_and_unload`` of a copy of the model."""
    state = merged_state(model)
    base = model.get_base_model() if state is not None else copy.deepcopy(model).merge_and_unload()

    def write(tmp: Path) -> None:
        base.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)

    with no_save_progress_bar():
        atomic_write(folder, write=write)
