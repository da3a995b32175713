"""What the sampler's decoders (harness/policy/decode.py) and the trainer's forward (harness/policy/forward.py) share
about a model: position ids that skip left padding, and whether its forward can be written out over its own modules
(the Llama family: the written-out decoders and the padding-free forward)."""

from __future__ import annotations

from torch import Tensor

WRITTEN_OUT_MODELS = ("llama", "mistral", "qwen2", "qwen3")
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # rotary frequencies recomputed from the longest position seen


def positions(attention_mask: Tensor) -> Tensor:
    """Position ids that skip left padding (as ``generate`` computes them)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def written_out_unsupported(model, length: int) -> str | None:
    """Why the written-out forward (harness/policy/decode.py's shared-prefix and per-row decoders, harness/policy/
    forward.py's padding-free forward) cannot run ``model`` for sequences of ``length`` tokens (``None``: they can)."""
    config = model.config.get_text_config()
    if config.model_type not in WRITTEN_OUT_MODELS:
        return f"model_type {config.model_type!r} is not one of {', '.join(WRITTEN_OUT_MODELS)}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "the model has sliding-window layers"
    window = getattr(config, "sliding_window", None)
    if window is not None and length > window:
        return f"sequences of {length} tokens exceed the sliding window of {window}"
    rope = getattr(config, "rope_parameters", None) or {}
    rope_types = {rope.get("rope_type")} if "rope_type" in rope else {
        value.get("rope_type") for value in rope.values() if isinstance(value, dict)}  # per layer type
    if rope_types & set(LENGTH_DEPENDENT_ROPE):
        return (f"its rotary embedding ({', '.join(sorted(rope_types & set(LENGTH_DEPENDENT_ROPE)))}) changes with "
                "the sequence's length, and the decoder tables it once per rollout")
    return None
