"""One decode step of a causal LM for the native sampler: the model's next-token logits for one new token per row,
keys/values kept between steps, rows removable between steps (finished rows leave the batch).

Three implementations with one interface (``step(tokens, positions) -> logits``, ``keep(order)``):

* :class:`SharedPrefixDecoder`, for Llama-family models (``WRITTEN_OUT_MODELS`` of harness/policy/architecture.py,
  full attention): the model's forward written out over its own modules (embedding, RMSNorms, q/k norms, rotary
  embedding, activation, final norm) and weights (q+k+v and gate+up each as one matmul, o, down, LM head:
  :class:`Matmul`, oneDNN on CPU). A group's rows share one prompt, so its keys/values are stored once per group, not
  once per row, and read once per group at every step. Row r of group g attends to the prompt part (keys K_g, left
  padding masked) and to its own t+1 generated tokens (keys K_r); each part is a softmax attention that also gives the
  log-sum-exp of its scores (out_p, l_p over the prompt's scores s; out_g, l_g over the generated tokens' scores u),
  and the two are merged exactly:

      out_r = w out_p + (1 - w) out_g,   w = e^l_p / (e^l_p + e^l_g) = sigmoid(l_p - l_g)

  = softmax([s, u]) @ [V_g; V_r] (the "cascade" attention of shared-prefix inference engines). No per-step
  attention mask is built and no transformers forward plumbing runs per step. The logits equal the model's
  forward up to float summation order (tests/test_decode.py).
* :class:`PerRowDecoder`, the same models: the same written-out forward (:class:`_WrittenOutDecoder`), every row
  holding its own copy of its prompt's keys/values, one attention per layer; its step is the one that
  ``torch.compile`` compiles once for every step and rollout (``train.compile_sampler``).
* :class:`CacheDecoder`, any model: the model's decoder forward over a preallocated KV cache (every row holds
  its own copy of the prompt's keys/values), optionally ``torch.compile``-d.

The written-out forward runs the models' RMSNorms as torch's ``F.rms_norm`` (:func:`rms_norm`) and adds the
residual inside the o and down matmuls (:class:`Matmul`): fewer operations per step, which is most of a small
model's eager decode step on a CPU.

:func:`build_decoder` picks one (``train.decoder``: ``auto`` | ``shared_prefix`` | ``per_row`` | ``cache``).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from harness.policy.architecture import positions, written_out_unsupported
from harness.policy.lora import merged_linear
from harness.policy.matmul import linear, linear_add
from harness.policy.routing import recording

DECODERS = ("auto", "shared_prefix", "per_row", "cache")  # train.decoder: build_decoder's kinds
ONEDNN_MIN_WEIGHTS = 2**18  # SmolLM2's smallest stacked projection (o: 576 x 576) has 331,776; the tiny model's < 2**17
ONEDNN_MIN_WIDENING = 2  # oneDNN for projections with out_features >= 2 x in_features (gate+up, LM head)
PER_ROW_MAX_PROMPT_BYTES = 2**25  # auto: per-row copies of the prompts' keys/values up to this size (all layers)
ONE_BY_ONE_MIN_PADDING = 1 / 8  # CPU prefill: each prompt at its own length from this fraction of padded positions


def build_decoder(model, prompt_ids: Tensor, prompt_mask: Tensor, *, group_size: int, max_new_tokens: int,
                  kind: str = "auto", compile: bool = False):
    """Prefill the distinct prompts [D, P] once and return (decoder, first logits [D x group_size, V]).

    ``kind``: ``"auto"`` (where the written-out decoders apply, :class:`PerRowDecoder` with ``compile`` or when the
    rows' copies of their prompts' keys/values would take at most ``PER_ROW_MAX_PROMPT_BYTES`` (small models, short
    prompts: one attention per layer instead of two plus their merge), else
    :class:`SharedPrefixDecoder`; elsewhere :class:`CacheDecoder`), ``"shared_prefix"`` / ``"per_row"`` (an error
    where they do not apply), ``"cache"``. ``compile``: ``torch.compile`` the per-row decoder's step, or the cache
    decoder's forward (not the shared-prefix decoder: its shapes change at every step).
    """
    if kind not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {kind!r}")
    if kind == "shared_prefix" and compile:
        raise ValueError("the shared-prefix decoder is not compiled; use decoder 'auto', 'per_row' or 'cache'")
    reason = written_out_unsupported(model, prompt_ids.shape[1] + max_new_tokens)
    if kind in ("shared_prefix", "per_row") and reason:
        raise ValueError(f"the {kind} decoder cannot run this model: {reason}; use decoder 'auto' or 'cache'")
    rows = prompt_mask.shape[0] * group_size
    if kind == "cache" or reason:
        decoder = CacheDecoder(model, prompt_ids.shape[1] + max_new_tokens, compile)
    elif kind == "per_row" or compile or (
            kind == "auto" and prompt_copies_bytes(model, rows, prompt_ids.shape[1]) <= PER_ROW_MAX_PROMPT_BYTES):
        decoder = PerRowDecoder(model, rows, max_new_tokens, compile)
    else:
        decoder = SharedPrefixDecoder(model, rows, max_new_tokens)
    decoder = recording(model, decoder, prompt_ids.shape[1] + max_new_tokens)  # R3: laid out while capturing
    return decoder, decoder.prefill(prompt_ids, prompt_mask, group_size)


def prompt_copies_bytes(model, rows: int, prompt_len: int) -> int:
    """Bytes of the prompts' keys/values held once per row (every layer), as :class:`PerRowDecoder` holds them."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * rows * prompt_len * config.num_key_value_heads * head_dim * config.num_hidden_layers * element


class Matmul:
    """x [n, in] -> [n, out_1 + out_2 + ...]: Linear modules that read the same input, as one matmul.

    On CPU, for plain ``nn.Linear`` modules without hooks and LoRA layers on them (their adapters merged into the
    weights: W + (alpha / r) B A, :func:`linear_map`), the weights (and biases) are stacked once, when it is made
    (once per rollout: the weights change between rollouts), into one matmul: in float32 from
    ``ONEDNN_MIN_WEIGHTS`` stacked weights with at least ``ONEDNN_MIN_WIDENING`` times as many outputs as inputs
    (gate+up, the LM head) through oneDNN (``torch.ops.mkldnn._linear_pointwise``, the kernel torch.compile's CPU
    backend uses for linear layers) with the weights reordered into its layout, which runs decode's few rows of
    those wide shapes faster than the default MKL GEMM on this project's CPU; the narrower ones (q+k+v, o, down:
    MKL faster, with 1 and 2 threads) and the small ones (where oneDNN's per-call cost loses) through
    :func:`harness.policy.matmul.linear`: ``F.linear``, or under ``train.cpu_matmul=onednn`` oneDNN on the weights as
    they are (``make bench MATMULS=1``, docs/benchmark.md). The stacked copy holds those weights a second time while
    the rollout runs (the size of those weights); ``onednn=False`` (a step to compile: oneDNN's weight layout cannot
    be traced) keeps ``F.linear``. Elsewhere (a GPU, where a second copy of a large model's weights is not worth a few
    kernel launches; a module with hooks) the modules themselves, outputs concatenated (a LoRA layer then adds its
    adapters' two small matmuls). Results agree to float round-off (tests/test_decode.py).
    """

    def __init__(self, *modules, onednn: bool = True):
        self.modules, self.kind = modules, "modules"
        linear = [linear_map(m) for m in modules]
        if all(x is not None and x[0].device.type == "cpu" for x in linear):
            weights = [weight for weight, _ in linear]
            self.weight = weights[0] if len(weights) == 1 else torch.cat(weights)
            self.bias = None
            if any(bias is not None for _, bias in linear):
                self.bias = torch.cat([weight.new_zeros(len(weight)) if bias is None else bias
                                       for weight, bias in linear])
            self.kind = "stacked"
            if (onednn and self.weight.dtype == torch.float32 and self.weight.numel() >= ONEDNN_MIN_WEIGHTS
                    and self.weight.shape[0] >= ONEDNN_MIN_WIDENING * self.weight.shape[1]
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()):
                self.kind, self.weight = "onednn", self.weight.to_mkldnn()

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """The outputs [n, out], plus ``residual`` [n, out] if given (added inside the matmul where it can be)."""
        if self.kind == "stacked" and residual is not None and self.bias is None:
            return linear_add(residual, x, self.weight)
        if self.kind == "onednn":
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        elif self.kind == "stacked":
            out = linear(x, self.weight, self.bias)
        else:
            out = torch.cat([m(x) for m in self.modules], -1) if len(self.modules) > 1 else self.modules[0](x)
        return out if residual is None else residual + out


def linear_map(module) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) of the linear map ``module`` applies, detached: a plain ``nn.Linear``'s without hooks, or a LoRA
    layer's with its adapters merged in (harness/policy/lora.py); None for anything else."""
    if type(module) is torch.nn.Linear and not (module._forward_hooks or module._forward_pre_hooks):
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    return merged_linear(module)


RMS_NORMS = tuple(f"{family}RMSNorm" for family in ("Llama", "Mistral", "Qwen2", "Qwen3"))


def held_bytes(decoder, model) -> dict[str, int]:
    """What a decoder holds beyond ``model``'s parameters, in bytes, each storage counted once: ``weight_copies``
    (its :class:`Matmul` s' stacked or oneDNN-reordered weights and biases) and ``state`` (keys/values at their
    allocated capacity — pages of the generated part become resident as they are written —, rotary tables, masks,
    indices). Modules are not entered: their parameters are the model's."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, visited, held = set(), {}, {"weight_copies": 0, "state": 0}  # visited: id -> object, kept alive

    def add(t: Tensor, bucket: str) -> None:
        if t.is_mkldnn:  # an opaque layout (no storage to share): its own copy
            key, size = id(t), t.numel() * t.element_size()
        else:
            key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if key not in seen and key not in params:
            seen.add(key)
            held[bucket] += size

    def walk(x, bucket: str) -> None:
        if id(x) in visited:
            return
        visited[id(x)] = x
        if isinstance(x, Tensor):
            add(x, bucket)
        elif isinstance(x, (list, tuple)):
            for item in x:
                walk(item, bucket)
        elif isinstance(x, dict):
            for item in x.values():
                walk(item, bucket)
        elif isinstance(x, Matmul):
            walk([x.weight, x.bias] if x.kind != "modules" else [], "weight_copies")
        elif hasattr(x, "__dict__") and not isinstance(x, torch.nn.Module):
            walk(list(vars(x).values()), bucket)

    walk(list(vars(decoder).values()), "state")
    return held


def rms_norm(norm, x: Tensor) -> Tensor:
    """``norm(x)`` for a Llama-family RMSNorm module, w * (x / sqrt(mean(x^2) + eps)) computed in float32, as
    torch's one-kernel ``F.rms_norm`` (instead of the module's six operations) where it has no hooks."""
    if type(norm).__name__ not in RMS_NORMS or norm._forward_hooks or norm._forward_pre_hooks:
        return norm(x)
    if x.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm.weight * torch.nn.functional.rms_norm(x.float(), norm.weight.shape, None,
                                                      norm.variance_epsilon).to(x.dtype)


class _WrittenOutDecoder:
    """The forward of a Llama-family model written out over its own modules (embedding, RMSNorms, q/k norms, rotary
    embedding, activation, final norm) and weights (:class:`Matmul`) for one new token per row; subclasses keep the
    keys/values (``_prefill_storage``, ``keep``) and attend (the ``attend`` their ``step`` hands to ``_layers``).

    ``rows`` x ``max_new_tokens`` sizes the generated keys/values. The rotary embedding's cos/sin come from the
    model's rotary module, computed once per rollout for every position the rollout can reach (so rotary types
    whose frequencies depend on the length, ``LENGTH_DEPENDENT_ROPE``, go to the cache decoder), and are applied to
    q and k together as x cos + rotate_half(x) sin (the Llama family's form), where rotate_half(x) sin =
    roll(x, d/2) sin' with sin' = sin with its first half negated.
    """

    def __init__(self, model, rows: int, max_new_tokens: int):
        body = model.get_decoder()
        self.model, self.rows, self.max_new_tokens = model, rows, max_new_tokens
        self.output = model.get_output_embeddings()
        self.embed, self.layers, self.norm, self.rotary = body.embed_tokens, body.layers, body.norm, body.rotary_emb
        self.length = 0  # generated tokens stored per row
        self.onednn = True  # Matmul through oneDNN where it is faster

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int) -> Tensor:
        """Run the distinct prompts [D, P] (rows: ``group_size`` per prompt, in order); first logits [rows, V]."""
        padding = 1 - prompt_mask.float().mean().item()
        hidden, prefix = self._prompts(prompt_ids, prompt_mask, one_by_one=prompt_ids.device.type == "cpu"
                                       and padding >= ONE_BY_ONE_MIN_PADDING)
        prompt_bias = torch.zeros(prompt_mask.shape, device=prompt_mask.device).masked_fill(
            prompt_mask == 0, torch.finfo(torch.float32).min)[:, None, None, :]  # [D, 1, 1, P]
        self._prefill_storage(prefix, prompt_bias, group_size)
        reach = torch.arange(prompt_ids.shape[1] + self.max_new_tokens, device=prompt_ids.device)
        cos, sin = self.rotary(hidden, reach[None])  # [1, positions, d]
        half = sin.shape[-1] // 2
        self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)
        onednn = {"onednn": self.onednn}
        self.head = Matmul(self.output, **onednn)
        self.projections = [(Matmul(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, **onednn),
                             Matmul(layer.self_attn.o_proj, **onednn),
                             Matmul(layer.mlp.gate_proj, layer.mlp.up_proj, **onednn),
                             Matmul(layer.mlp.down_proj, **onednn)) for layer in self.layers]
        return self.head(hidden).repeat_interleave(group_size, dim=0)

    def _prompts(self, prompt_ids: Tensor, prompt_mask: Tensor,
                 one_by_one: bool) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The model's body on the left-padded prompts [D, P]: the last position's hidden state [D, hidden] and each
        layer's keys/values [D, H_kv, P, d] (anything at padded positions). ``one_by_one`` (on CPU, where padding
        costs its FLOPs, when it is at least ``ONE_BY_ONE_MIN_PADDING`` of the positions, as GSM8K's prompts of
        different lengths): each prompt at its own length; else one batch (a GPU runs the padding in parallel; a
        few padded positions cost less than a forward call per prompt)."""
        body = self.model.get_decoder()
        left_padded = bool((prompt_mask[:, 1:] >= prompt_mask[:, :-1]).all()) and bool(prompt_mask[:, -1].all())
        if not one_by_one or not left_padded:  # (an empty prompt, a mask with holes: the batch takes any mask)
            cache = DynamicCache(config=self.model.config)
            hidden = body(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions(prompt_mask),
                          cache=cache, use_cache=True).last_hidden_state[:, -1]
            return hidden, [(layer.keys, layer.values) for layer in cache.layers]
        width, hidden, prefix = prompt_ids.shape[1], [], None
        for i, (ids, mask) in enumerate(zip(prompt_ids, prompt_mask, strict=True)):
            real = ids[mask.bool()][None]  # [1, L]
            cache = DynamicCache(config=self.model.config)
            hidden.append(body(input_ids=real, position_ids=torch.arange(real.shape[1], device=real.device)[None],
                               cache=cache, use_cache=True).last_hidden_state[:, -1])
            if prefix is None:
                prefix = [(layer.keys.new_zeros(len(prompt_ids), *layer.keys.shape[1:2], width, layer.keys.shape[3]),
                           layer.values.new_zeros(len(prompt_ids), *layer.values.shape[1:2], width,
                                                  layer.values.shape[3])) for layer in cache.layers]
            start = width - real.shape[1]  # left padding before
            for (keys, values), layer in zip(prefix, cache.layers, strict=True):
                keys[i, :, start:], values[i, :, start:] = layer.keys[0], layer.values[0]
        return torch.cat(hidden), prefix

    def _layers(self, tokens: Tensor, positions: Tensor, attend) -> Tensor:
        """Logits [n, V] after ``tokens`` [n] at ``positions`` [n]; ``attend(i, attn, q, k, v)`` -> [n, H x d] is layer
        i's attention of q [n, H_kv, G, d] (query head h uses key head h // G) given the new k, v [n, H_kv, d]."""
        hidden = self.embed(tokens)  # [n, hidden]
        cos, sin = self.cos[positions, None], self.sin[positions, None]  # [n, 1, d]
        for i, (layer, (qkv, o, gate_up, down)) in enumerate(zip(self.layers, self.projections, strict=True)):
            q, k, v = self._rotated(layer.self_attn, qkv(rms_norm(layer.input_layernorm, hidden)), cos, sin)
            hidden = o(attend(i, layer.self_attn, q, k, v), residual=hidden)
            gate, up = gate_up(rms_norm(layer.post_attention_layernorm, hidden)).chunk(2, dim=-1)
            hidden = down(layer.mlp.act_fn(gate) * up, residual=hidden)
        return self.head(rms_norm(self.norm, hidden))

    @staticmethod
    def _rotated(attn, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [n, H_kv, G, d], k and v [n, H_kv, d] from the stacked projection [n, (H + 2 H_kv) d], q and k rotated."""
        heads, kv_heads, d = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
        n = qkv.shape[0]
        qk = qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head on q and k before the rotary embedding
            qk = torch.cat([attn.q_norm(qk[:, :heads]), attn.k_norm(qk[:, heads:])], 1)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
        return (qk[:, :heads].view(n, kv_heads, heads // kv_heads, d), qk[:, heads:],
                qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d))


class SharedPrefixDecoder(_WrittenOutDecoder):
    """Decode steps with each group's prompt keys/values stored once (module docstring): the prompts' keys/values
    [D, H_kv, P, d] per layer are the prefill's (after the rotary embedding), the generated ones
    [rows, H_kv, max_new_tokens, d] per layer are allocated at the prefill."""

    def _prefill_storage(self, prefix: list[tuple[Tensor, Tensor]], prompt_bias: Tensor, group_size: int) -> None:
        self.prefix, self.prompt_bias = prefix, prompt_bias
        self.generated = [(k.new_empty(self.rows, k.shape[1], self.max_new_tokens, k.shape[3]),
                           v.new_empty(self.rows, v.shape[1], self.max_new_tokens, v.shape[3])) for k, v in prefix]
        self.group = torch.arange(prompt_bias.shape[0], device=prompt_bias.device).repeat_interleave(group_size)
        self._index_groups()

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
        # rows in slot order (every group full, rows in group order: the batch before any row leaves): no gathers
        self.rows_are_slots = len(self.row_of_slot) == len(group) and bool(
            (self.row_of_slot == torch.arange(len(group), device=group.device)).all())

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
        logits = self._layers(tokens, positions, self._attention)
        self.length += 1
        return logits

    def _attention(self, i: int, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """softmax over [the group's prompt, the row's generated tokens] (module docstring) -> [n, H x d]."""
        (keys, values), prefix = self.generated[i], self.prefix[i]
        n, kv_heads, _, d = q.shape
        t = self.length
        keys[:n, :, t], values[:n, :, t] = k, v
        # the prompt part, all rows of a group at once: [groups, H_kv, R x G, P]
        groups, slots = self.prompt_bias.shape[0], self.slots_per_group
        q_grouped = (q if self.rows_are_slots else q.index_select(0, self.row_of_slot)).view(
            groups, slots, kv_heads, -1, d).transpose(1, 2)
        out_p, lse_p = _attend(q_grouped.reshape(groups, kv_heads, -1, d), *prefix, self.prompt_bias, attn.scaling,
                              fused=True)
        # by row: [groups, H_kv, R x G, d + 1] -> [n, H_kv, G, d + 1]
        prompt_part = torch.cat([out_p, lse_p], -1).view(groups, kv_heads, slots, -1, d + 1).transpose(1, 2)
        prompt_part = prompt_part.reshape(groups * slots, kv_heads, -1, d + 1)
        if not self.rows_are_slots:
            prompt_part = prompt_part.index_select(0, self.slot_of_row)
        # the generated part, row by row: [n, H_kv, G, t + 1]
        out_g, lse_g = _attend(q, keys[:n, :, : t + 1], values[:n, :, : t + 1], None, attn.scaling,
                              fused=False)
        # softmax weights of the prompt part: sigmoid(lse_p - lse_g) = e^lse_p / (e^lse_p + e^lse_g)
        out = torch.lerp(out_g, prompt_part[..., :d], torch.sigmoid(prompt_part[..., d:] - lse_g))
        return out.to(q.dtype).reshape(n, -1)


class PerRowDecoder(_WrittenOutDecoder):
    """Decode steps with every row holding its own copy of its prompt's keys/values, in one slab
    [rows, H_kv, P + max_new_tokens, d] per layer (prompt, then generated): one softmax attention per layer and
    step over the written positions and the new token, the prompt's padding masked by a bias
    [rows, 1, 1, P + max_new_tokens]. Eagerly the new keys/values are written into the slab first and the
    attention is three operations (:meth:`_attend_in_slab`).

    ``compile``: the step (:func:`_row_step`) is ``torch.compile``-d once per process with the sizes that change
    between steps and rollouts (rows left, positions written, positions reachable) marked dynamic, so no step or
    rollout recompiles it; there the new keys/values leave the graph as outputs and are written into the slab
    outside it (a graph that wrote into its input would copy the slab whole at every step), so the attention
    takes the new token's score apart from the slab's.
    """

    def __init__(self, model, rows: int, max_new_tokens: int, compile: bool):
        super().__init__(model, rows, max_new_tokens)
        self.compile, self.onednn = compile, not compile

    def _prefill_storage(self, prefix: list[tuple[Tensor, Tensor]], prompt_bias: Tensor, group_size: int) -> None:
        self.width = prefix[0][0].shape[2]  # P
        self.slabs = []
        for k, v in prefix:
            keys = k.new_empty(self.rows, k.shape[1], self.width + self.max_new_tokens, k.shape[3])
            values = torch.empty_like(keys)
            keys[:, :, : self.width], values[:, :, : self.width] = (k.repeat_interleave(group_size, dim=0),
                                                                  v.repeat_interleave(group_size, dim=0))
            self.slabs.append((keys, values))
        self.bias = torch.nn.functional.pad(prompt_bias, (0, self.max_new_tokens)).repeat_interleave(group_size, dim=0)

    def keep(self, order: Tensor) -> None:
        """Keep rows ``order`` (new row i = old row order[i]); only rows whose index changes are copied."""
        moved = (order != torch.arange(len(order), device=order.device)).nonzero()[:, 0]
        end = self.width + self.length
        for keys, values in self.slabs:
            keys[moved, :, :end] = keys[order[moved], :, :end]
            values[moved, :, :end] = values[order[moved], :, :end]
        self.bias = self.bias[order]

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Logits [n, V] of the next token after ``tokens`` [n] at ``positions`` [n] (rows as left by ``keep``)."""
        n, written = tokens.shape[0], self.width + self.length  # slab positions filled so far
        if not self.compile or n == 1:  # one row left: eager too (torch would compile a second graph for size 1)
            logits = self._layers(tokens, positions, functools.partial(self._attend_in_slab, n, written))
        else:
            slabs = [(keys[:n, :, :written], values[:n, :, :written]) for keys, values in self.slabs]
            bias = self.bias[:n, :, :, :written]
            for tensor, dims in ((tokens, 0), (positions, 0), (bias, (0, 3)), (self.cos, 0), (self.sin, 0),
                                 *((t, (0, 2)) for slab in slabs for t in slab)):
                torch._dynamo.maybe_mark_dynamic(tensor, dims)
            logits, new = _compiled_row_step()(self, tokens, positions, slabs, bias)
            for (keys, values), (k, v) in zip(self.slabs, new, strict=True):
                keys[:n, :, written], values[:n, :, written] = k, v
        self.length += 1
        return logits

    def _attend_in_slab(self, n: int, written: int, i: int, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The eager step's attention of layer i: the new k, v written into the slab at position ``written`` first,
        then softmax(q K^T x scaling + bias) V over the slab's first ``written`` + 1 positions -> [n, H x d]."""
        keys, values = (slab[:n, :, : written + 1] for slab in self.slabs[i])
        keys[:, :, written], values[:, :, written] = k, v
        scores = torch.add(self.bias[:n, :, :, : written + 1], q @ keys.transpose(-1, -2), alpha=attn.scaling)
        out = scores.softmax(-1).to(values.dtype) @ values  # [n, H_kv, G, d]
        return out.reshape(n, -1)


def _row_step(decoder: PerRowDecoder, tokens: Tensor, positions: Tensor, slabs: list[tuple[Tensor, Tensor]],
              bias: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """One compiled :class:`PerRowDecoder` step: the logits [n, V] and each layer's new keys and values
    [n, H_kv, d] (for the caller to write into the slab, outside the graph). Row r attends to its written
    keys/values ``slabs`` [n, H_kv, S, d] (score bias ``bias`` [n, 1, 1, S]) and to its new token, whose score
    is s_own = (q . k_new) x scaling:

        out = softmax([s_slab, s_own]) @ [V_slab; v_new]

    written as exp(s - m) with m the maximum over both, so the slab is only read."""
    new = []

    def attend(i: int, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys, values = slabs[i]
        slab = (q @ keys.transpose(-1, -2)).float() * attn.scaling + bias  # [n, H_kv, G, S]
        own = (q.float() * k[:, :, None].float()).sum(-1, keepdim=True) * attn.scaling  # [n, H_kv, G, 1]
        top = torch.maximum(slab.amax(-1, keepdim=True), own)
        slab, own = (slab - top).exp(), (own - top).exp()
        out = (slab.to(values.dtype) @ values + own.to(v.dtype) * v[:, :, None]).float()
        new.append((k, v))
        return (out / (slab.sum(-1, keepdim=True) + own)).to(q.dtype).reshape(q.shape[0], -1)

    return decoder._layers(tokens, positions, attend), new


@functools.cache
def _compiled_row_step():
    """``torch.compile`` of :func:`_row_step`, made once per process (one graph for every rollout and step)."""
    return torch.compile(_row_step)


def _attend(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor | None, scale: float,
            fused: bool) -> tuple[Tensor, Tensor]:
    """Softmax attention [B, H, L, d] of q [B, H, L, d] over keys/values [B, H, S, d] (plus an additive score
    ``bias``) and the log-sum-exp of its scores [B, H, L, 1], in float32. ``fused`` on CPU: one kernel, the flash
    attention that ``F.scaled_dot_product_attention`` runs there (which also returns the log-sum-exp); faster for
    the prompt part (many queries per group), slower than two batched matmuls for the generated part's few
    queries per row (docs/results_benchmark.md, "Tried and not used")."""
    if fused and q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, attn_mask=bias,
                                                                               scale=scale)
        return out.float(), lse[..., None]
    scores = (q @ keys.transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias
    top = scores.amax(-1, keepdim=True)
    weights = (scores - top).exp()
    total = weights.sum(-1, keepdim=True)
    return (weights.to(values.dtype) @ values).float() / total, top + total.log()


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
                                          position_ids=positions(prompt_mask), cache=self.cache,
                                          use_cache=True).last_hidden_state[:, -1]
        if group_size > 1:
            for layer in self.cache.layers:
                layer.batch_repeat_interleave(group_size)
        self.width = prompt_ids.shape[1]
        self.mask = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], self.capacity - self.width)], 1)
        self.mask = self.mask.repeat_interleave(group_size, dim=0)
        self.head = Matmul(self.output)
        return self.head(hidden).repeat_interleave(group_size, dim=0)

    def keep(self, order: Tensor) -> None:
        """Keep rows ``order`` (new row i = old row order[i]); only rows whose index changes are copied."""
        moved = (order != torch.arange(len(order), device=order.device)).nonzero()[:, 0]
        for layer in self.cache.layers:
            layer.keep(order, moved)
        self.mask = self.mask[order]

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Logits [n, V] of the next token after ``tokens`` [n] at ``positions`` [n]."""
        hidden = self.forward(input_ids=tokens[:, None], attention_mask=self.mask[:, : self.width + self.length + 1],
                              position_ids=positions[:, None], cache=self.cache, use_cache=True)
        self.length += 1
        return self.head(hidden.last_hidden_state[:, -1])
