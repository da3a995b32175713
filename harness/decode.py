"""One decode step of a causal LM for the native sampler: the model's next-token logits for one new token per row,
keys/values kept between steps, rows removable between steps (finished rows leave the batch).

Two implementations with one interface (``step(tokens, positions) -> logits``, ``keep(order)``):

* :class:`SharedPrefixDecoder`, for Llama-family models (``SHARED_PREFIX_MODELS``, full attention): the model's
  forward written out over its own modules (embedding, RMSNorms, q/k norms, rotary embedding, activation, final
  norm) and weights (q+k+v and gate+up each as one matmul, o, down, LM head: :class:`Matmul`, oneDNN on CPU).
  A group's rows share one prompt, so its keys/values are stored once per group, not once per row, and read
  once per group at every step. Row r of
  group g attends to the prompt part (keys K_g, left padding masked) and to its own t+1 generated tokens
  (keys K_r); the two softmax parts are merged exactly: with scores s over the prompt and u over the generated
  tokens and m = max(max s, max u),

      out_r = (sum_j e^(s_j - m) V_g,j + sum_j e^(u_j - m) V_r,j) / (sum_j e^(s_j - m) + sum_j e^(u_j - m))

  = softmax([s, u]) @ [V_g; V_r] (the "cascade" attention of shared-prefix inference engines). No per-step
  attention mask is built and no transformers forward plumbing runs per step. The logits equal the model's
  forward up to float summation order (tests/test_decode.py).
* :class:`CacheDecoder`, any model: the model's decoder forward over a preallocated KV cache (every row holds
  its own copy of the prompt's keys/values), optionally ``torch.compile``-d.

:func:`build_decoder` picks the first where it applies (``train.decoder``: ``auto`` | ``shared_prefix`` |
``cache``).
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from harness.config import DECODERS

SHARED_PREFIX_MODELS = ("llama", "mistral", "qwen2", "qwen3")
ONEDNN_MIN_WEIGHTS = 2**18  # SmolLM2's smallest stacked projection (o: 576 x 576) has 331,776; the tiny model's < 2**17


def positions(attention_mask: Tensor) -> Tensor:
    """Position ids that skip left padding (as ``generate`` computes them)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_decoder(model, prompt_ids: Tensor, prompt_mask: Tensor, *, group_size: int, max_new_tokens: int,
                  kind: str = "auto", compile: bool = False):
    """Prefill the distinct prompts [D, P] once and return (decoder, first logits [D x group_size, V]).

    ``kind``: ``"auto"`` (:class:`SharedPrefixDecoder` where it applies, else :class:`CacheDecoder`),
    ``"shared_prefix"`` (an error where it does not apply), ``"cache"``. ``compile``: ``torch.compile`` the
    :class:`CacheDecoder`'s forward (with ``"auto"``, compiling selects the cache decoder).
    """
    if kind not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {kind!r}")
    reason = shared_prefix_unsupported(model, prompt_ids.shape[1] + max_new_tokens)
    if kind == "shared_prefix" and reason:
        raise ValueError(f"the shared-prefix decoder cannot run this model: {reason}; use decoder 'auto' or 'cache'")
    if kind == "cache" or reason or compile:
        decoder = CacheDecoder(model, prompt_ids.shape[1] + max_new_tokens, compile)
    else:
        decoder = SharedPrefixDecoder(model, prompt_mask.shape[0] * group_size, max_new_tokens)
    return decoder, decoder.prefill(prompt_ids, prompt_mask, group_size)


def shared_prefix_unsupported(model, length: int) -> str | None:
    """Why :class:`SharedPrefixDecoder` cannot run ``model`` for sequences of ``length`` tokens (``None``: it can)."""
    config = model.config.get_text_config()
    if config.model_type not in SHARED_PREFIX_MODELS:
        return f"model_type {config.model_type!r} is not one of {', '.join(SHARED_PREFIX_MODELS)}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "the model has sliding-window layers"
    window = getattr(config, "sliding_window", None)
    if window is not None and length > window:
        return f"sequences of {length} tokens exceed the sliding window of {window}"
    return None


class Matmul:
    """x [n, in] -> (m_1(x), m_2(x), ...) for Linear modules that read the same input.

    On CPU in float32: one oneDNN matmul (``torch.ops.mkldnn._linear_pointwise``, the kernel torch.compile's CPU
    backend uses for linear layers; dense input and output) with the weights stacked and reordered into oneDNN's
    layout once, when it is made (once per rollout: the weights change between rollouts). At decode's few rows it
    runs these shapes faster than the default MKL GEMM on this project's CPU (SmolLM2, 64 rows: LM head 154 vs 84
    GFLOP/s, gate+up 186 vs 153; ``make bench MATMULS=1``, docs/benchmark.md). Below ``ONEDNN_MIN_WEIGHTS``
    stacked weights its per-call cost outweighs that (the tiny model decodes ~9% slower through it). Elsewhere,
    or for a module that is not a plain ``nn.Linear`` (a LoRA wrapper, a module with hooks), the modules
    themselves. Results agree to float round-off (tests/test_decode.py). The packed copy holds the layer's
    weights a second time while the rollout runs (SmolLM2 fp32: ~0.5 GB).
    """

    def __init__(self, *modules):
        self.modules = modules
        self.packed = hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available() and all(
            type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
            and not (m._forward_hooks or m._forward_pre_hooks) for m in modules) and sum(
            m.weight.numel() for m in modules) >= ONEDNN_MIN_WEIGHTS
        if self.packed:
            self.sizes = [m.out_features for m in modules]
            self.weight = torch.cat([m.weight.detach() for m in modules]).to_mkldnn()
            self.bias = None
            if any(m.bias is not None for m in modules):
                self.bias = torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach()
                                       for m in modules])

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        if not self.packed:
            return tuple(m(x) for m in self.modules)
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return y.split(self.sizes, dim=-1)


class SharedPrefixDecoder:
    """Decode steps of a Llama-family model with each group's prompt keys/values stored once (module docstring).

    ``rows`` x ``max_new_tokens`` sizes the generated keys/values [rows, H_kv, max_new_tokens, d] per layer,
    allocated at the prefill; the prompts' keys/values ([D, H_kv, P, d] per layer, after the rotary embedding)
    are the prefill's.
    """

    def __init__(self, model, rows: int, max_new_tokens: int):
        body = model.get_decoder()
        self.model, self.rows, self.max_new_tokens = model, rows, max_new_tokens
        self.output = model.get_output_embeddings()
        self.embed, self.layers, self.norm, self.rotary = body.embed_tokens, body.layers, body.norm, body.rotary_emb
        self.apply_rotary = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.length = 0  # generated tokens stored per row

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int) -> Tensor:
        """Run the distinct prompts [D, P] (rows: ``group_size`` per prompt, in order); first logits [rows, V]."""
        cache = DynamicCache(config=self.model.config)
        hidden = self.model.get_decoder()(input_ids=prompt_ids, attention_mask=prompt_mask,
                                          position_ids=positions(prompt_mask), past_key_values=cache,
                                          use_cache=True).last_hidden_state[:, -1]
        self.prefix = [(layer.keys, layer.values) for layer in cache.layers]
        self.generated = [(k.new_empty(self.rows, k.shape[1], self.max_new_tokens, k.shape[3]),
                           v.new_empty(self.rows, v.shape[1], self.max_new_tokens, v.shape[3])) for k, v in self.prefix]
        self.prompt_bias = torch.zeros(prompt_mask.shape, device=prompt_mask.device).masked_fill(
            prompt_mask == 0, torch.finfo(torch.float32).min)[:, None, None, :]  # [D, 1, 1, P]
        self.group = torch.arange(prompt_mask.shape[0], device=prompt_mask.device).repeat_interleave(group_size)
        self._index_groups()
        self.head = Matmul(self.output)
        self.projections = [(Matmul(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                             Matmul(layer.self_attn.o_proj), Matmul(layer.mlp.gate_proj, layer.mlp.up_proj),
                             Matmul(layer.mlp.down_proj)) for layer in self.layers]
        return self.head(hidden)[0].repeat_interleave(group_size, dim=0)

    def _index_groups(self) -> None:
        """Slots [groups x R] for the rows of each group (R = most rows left in a group; spare slots compute row 0
        and are not read back); groups with no row left leave the prompt keys/values."""
        alive, group = torch.unique(self.group, return_inverse=True)
        if len(alive) < self.prompt_bias.shape[0]:
            self.prefix = [(k[alive], v[alive]) for k, v in self.prefix]
            self.prompt_bias = self.prompt_bias[alive]
        counts = torch.bincount(group, minlength=len(alive))
        order = torch.argsort(group, stable=True)
        rank = torch.empty_like(group)
        rank[order] = torch.arange(len(group), device=group.device) - (counts.cumsum(0) - counts)[group[order]]
        self.group, self.slots_per_group = group, int(counts.max())
        self.slot_of_row = group * self.slots_per_group + rank
        self.row_of_slot = torch.zeros(len(alive) * self.slots_per_group, dtype=torch.long, device=group.device)
        self.row_of_slot[self.slot_of_row] = torch.arange(len(group), device=group.device)

    def keep(self, order: Tensor) -> None:
        """Keep rows ``order`` (new row i = old row order[i]); only rows whose index changes are copied."""
        moved = (order != torch.arange(len(order), device=order.device)).nonzero()[:, 0]
        for keys, values in self.generated:
            keys[moved, :, : self.length] = keys[order[moved], :, : self.length]
            values[moved, :, : self.length] = values[order[moved], :, : self.length]
        self.group = self.group[order]
        self._index_groups()

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Logits [n, V] of the next token after ``tokens`` [n] at ``positions`` [n] (rows as left by ``keep``)."""
        hidden = self.embed(tokens)  # [n, hidden]
        cos_sin = self.rotary(hidden[:, None], positions[:, None])
        for layer, (qkv, o, gate_up, down), prefix, generated in zip(self.layers, self.projections, self.prefix,
                                                                     self.generated, strict=True):
            attention = self._attention(layer.self_attn, qkv(layer.input_layernorm(hidden)), cos_sin, prefix,
                                        generated)
            hidden = hidden + o(attention)[0]
            gate, up = gate_up(layer.post_attention_layernorm(hidden))
            hidden = hidden + down(layer.mlp.act_fn(gate) * up)[0]
        self.length += 1
        return self.head(self.norm(hidden))[0]

    def _attention(self, attn, qkv: tuple[Tensor, Tensor, Tensor], cos_sin, prefix, generated) -> Tensor:
        """softmax over [the group's prompt, the row's generated tokens] (module docstring) -> [n, H x d]."""
        (n, _), d, t = qkv[0].shape, attn.head_dim, self.length
        q, k = qkv[0].reshape(n, 1, -1, d), qkv[1].reshape(n, 1, -1, d)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), *cos_sin)
        keys, values = generated
        keys[:n, :, t], values[:n, :, t] = k[:, :, 0], qkv[2].reshape(n, -1, d)
        kv_heads = keys.shape[1]
        q = q.reshape(n, kv_heads, -1, d) * attn.scaling  # [n, H_kv, G, d]: query head h uses key head h // G
        heads = q.shape[2]

        # the prompt part, all rows of a group at once: [groups, H_kv, R x G, P]
        groups, slots = self.prompt_bias.shape[0], self.slots_per_group
        q_grouped = q[self.row_of_slot].view(groups, slots, kv_heads, heads, d).transpose(1, 2)
        scores = (q_grouped.reshape(groups, kv_heads, slots * heads, d) @ prefix[0].transpose(-1, -2)).float()
        out_p, max_p, sum_p = _softmax_parts(scores + self.prompt_bias, prefix[1])

        def by_row(x: Tensor) -> Tensor:  # [groups, H_kv, R x G, e] -> [n, H_kv, G, e]
            x = x.view(groups, kv_heads, slots, heads, -1).transpose(1, 2)
            return x.reshape(groups * slots, kv_heads, heads, -1)[self.slot_of_row]

        out_p, max_p, sum_p = by_row(out_p), by_row(max_p), by_row(sum_p)
        # the generated part, row by row: [n, H_kv, G, t + 1]
        out_g, max_g, sum_g = _softmax_parts((q @ keys[:n, :, : t + 1].transpose(-1, -2)).float(),
                                             values[:n, :, : t + 1])
        top = torch.maximum(max_p, max_g)
        w_p, w_g = (max_p - top).exp(), (max_g - top).exp()
        out = (out_p * w_p + out_g * w_g) / (sum_p * w_p + sum_g * w_g)
        return out.to(qkv[0].dtype).reshape(n, -1)


def _softmax_parts(scores: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Unnormalised softmax attention: (sum_j e^(s_j - m) v_j, m, sum_j e^(s_j - m)) with m = max_j s_j."""
    top = scores.amax(-1, keepdim=True)
    weights = (scores - top).exp()
    return (weights.to(values.dtype) @ values).float(), top, weights.sum(-1, keepdim=True)


class _SlabLayer(DynamicLayer):
    """One layer's keys/values in a buffer preallocated for ``capacity`` positions: ``update`` writes in place and
    returns views of the filled prefix (no per-step concatenation)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = key_states.new_zeros(*key_states.shape[:2], self.capacity, key_states.shape[-1])
        self.value_buffer = value_states.new_zeros(*value_states.shape[:2], self.capacity, value_states.shape[-1])

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def _views(self) -> None:
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times (new buffers)."""
        for name in ("key_buffer", "value_buffer"):
            buffer = getattr(self, name)
            grown = buffer.new_zeros(buffer.shape[0] * repeats, *buffer.shape[1:])
            grown[:, :, : self.length] = buffer[:, :, : self.length].repeat_interleave(repeats, dim=0)
            setattr(self, name, grown)
        self._views()

    def keep(self, order: Tensor, moved: Tensor) -> None:
        """Keep rows ``order`` (new row i = old row order[i]), copying only the rows ``moved`` whose index changes."""
        for name in ("key_buffer", "value_buffer"):
            buffer = getattr(self, name)
            buffer[moved, :, : self.length] = buffer[order[moved], :, : self.length]
            setattr(self, name, buffer[: len(order)])
        self._views()


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class CacheDecoder:
    """Decode steps through the model's decoder forward over a preallocated KV cache of ``capacity`` positions per
    row (each row holds its own copy of its prompt's keys/values); ``compile``: a cached ``torch.compile`` of the
    decoder (dynamic shapes; shares the live weights)."""

    def __init__(self, model, capacity: int, compile: bool):
        self.model, self.capacity, self.length = model, capacity, 0
        self.forward, self.output = model.get_decoder(), model.get_output_embeddings()
        if compile:
            if self.forward not in _COMPILED:
                _COMPILED[self.forward] = torch.compile(self.forward, dynamic=True)
            self.forward = _COMPILED[self.forward]

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int) -> Tensor:
        """Run the distinct prompts [D, P], then repeat their keys/values per row; first logits [rows, V]."""
        layers = self.model.config.get_text_config().num_hidden_layers
        self.cache = Cache(layers=[_SlabLayer(self.capacity) for _ in range(layers)])
        hidden = self.model.get_decoder()(input_ids=prompt_ids, attention_mask=prompt_mask,
                                          position_ids=positions(prompt_mask), past_key_values=self.cache,
                                          use_cache=True).last_hidden_state[:, -1]
        if group_size > 1:
            for layer in self.cache.layers:
                layer.batch_repeat_interleave(group_size)
        self.width = prompt_ids.shape[1]
        self.mask = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], self.capacity - self.width)], 1)
        self.mask = self.mask.repeat_interleave(group_size, dim=0)
        self.head = Matmul(self.output)
        return self.head(hidden)[0].repeat_interleave(group_size, dim=0)

    def keep(self, order: Tensor) -> None:
        """Keep rows ``order`` (new row i = old row order[i]); only rows whose index changes are copied."""
        moved = (order != torch.arange(len(order), device=order.device)).nonzero()[:, 0]
        for layer in self.cache.layers:
            layer.keep(order, moved)
        self.mask = self.mask[order]

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Logits [n, V] of the next token after ``tokens`` [n] at ``positions`` [n]."""
        hidden = self.forward(input_ids=tokens[:, None], attention_mask=self.mask[:, : self.width + self.length + 1],
                              position_ids=positions[:, None], past_key_values=self.cache, use_cache=True)
        self.length += 1
        return self.head(hidden.last_hidden_state[:, -1])[0]
