"""The trainer's forward: the completion tokens' log-probs (and entropies) under the policy, for the loss.

    logp, entropy = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                        temperature, with_entropy=True, padding_free=True)

The LM head runs on the positions that predict real completion tokens only. Two bodies: the model's own forward
(prompt + completion, prompts shared by the rows of a group: :func:`_model_hidden`), or, for Llama-family models,
the padding-free forward below (:func:`completion_hidden`). The sampler's decoders (harness/policy/decode.py) share
what they need with it in harness/policy/architecture.py.

The padding-free forward (``train.padding_free``):

A minibatch's completions are right-padded to its longest one; on a CPU every padded position costs its FLOPs in
every matmul. Here the token-wise parts of the model (the
embedding, RMSNorms, q/k/v/o projections, rotary embedding, MLP, final norm) run on the n real positions only,
packed [n, hidden]; only the attention sees the rows, as [rows, heads, T, d] with the padded positions zero:

    tail token j of row i = (the prompt's last token, c_0, ..., c_{T-2})_j, real for j < L_i (its completion length)
    h_(i,j) predicts c_(i,j); its keys: the row's prompt (left padding masked) and tail tokens j' <= j

(a padded query still sees its diagonal, so no softmax row is empty and no NaN reaches the gradient). Each distinct
prompt (a group's rows share one) runs once through the model's own forward, with gradients, for its keys/values,
as in :func:`_model_hidden`. Everything is the model's own modules, so adapters
and hooks on them run; the result equals the model's forward to float round-off (tests/test_forward.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from harness.policy.architecture import positions, written_out_unsupported
from harness.policy.routing import checkpoint_contexts, full_layout, laid_out, shared_prompt_layout, tail_layout

ENTROPY_BLOCK = 256  # positions per block of the entropy's exp * logp
SUM_PI_SQUARED = "sum_pi_squared"  # with_entropy's other statistic: sum_v pi_v^2 instead of the entropy, no gradient
LM_HEAD_CHUNK = "rlvr_lm_head_chunk"  # the model's attribute: positions per chunk of the LM head (set_memory_settings)
# torch.utils.checkpoint's arguments for the layers (set_memory_settings; the TRL backend's): non-reentrant, an MoE's
# routing recorded in the forward and forced again in the recompute (harness/policy/routing.py)
CHECKPOINT_KWARGS = {"use_reentrant": False, "context_fn": checkpoint_contexts}


def completion_logprobs(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                        completion_mask: Tensor, temperature: float = 1.0, with_entropy: bool | str = False,
                        padding_free: bool = True):
    """log p(completion token) [N, T] under log_softmax(logits / T), and optionally the entropy [N, T]; 0 where
    ``completion_mask`` is 0. The entropy carries the gradient only with ``with_entropy="gradient"`` (an entropy
    bonus); ``with_entropy=SUM_PI_SQUARED`` gives sum_v pi_v^2 over the vocabulary instead (no gradient; the optimal
    token baseline's input, verl's ``calculate_sum_pi_squared``). :func:`completion_forward` also gives the hidden
    states."""
    logp, entropy, _ = completion_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                          temperature, with_entropy, padding_free)
    return logp, entropy


def completion_forward(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                       completion_mask: Tensor, temperature: float = 1.0, with_entropy: bool | str = False,
                       padding_free: bool = True):
    """:func:`completion_logprobs`'s log-probs and entropy, and the final hidden states [n, hidden] that predict the n
    real completion tokens, in row-major order (as ``hidden[completion_mask]``), with gradient (for an objective that
    reads them: ``Objective.needs_hidden_states``).

    The LM head runs only on the positions that predict real completion tokens. ``padding_free`` (where
    :func:`padding_free_unsupported` allows): the whole body skips the completions' padding
    (:func:`completion_hidden`). Otherwise the model's forward on prompt + completion, position ids following the
    attention mask as in ``generate`` with left padding; consecutive rows with the same prompt (a group, or the
    part of a group in this micro-batch) share one forward pass of the prompt: its keys/values are computed once,
    with gradients, and indexed out to every row, so the gradient is the same as with one prompt pass per row (the
    sum over the rows that use it) at (rows - distinct prompts) x prompt length fewer positions.
    """
    valid = completion_mask.bool()
    if padding_free and padding_free_unsupported(model, prompt_mask, valid) is None:
        hidden = completion_hidden(model, prompt_ids, prompt_mask, completion_ids, valid)
    else:
        hidden = _model_hidden(model, prompt_ids, prompt_mask, completion_ids, valid)[valid]
    token_logp, entropy = head_logprobs(model, hidden, completion_ids[valid], temperature, with_entropy)
    token_logp = token_logp.new_zeros(valid.shape).masked_scatter(valid, token_logp)
    if entropy is not None:
        entropy = entropy.new_zeros(valid.shape).masked_scatter(valid, entropy)
    return token_logp, entropy, hidden


def set_memory_settings(model, lm_head_chunk: int = 0, activation_checkpointing: bool = False) -> None:
    """How the trainer's forward of ``model`` bounds its memory (``train.lm_head_chunk``,
    ``train.activation_checkpointing``), kept on the model so that its frozen copies inherit them: the LM head
    ``lm_head_chunk`` positions at a time (0: all at once; :func:`head_logprobs`), and transformers' activation
    checkpointing, which the padding-free forward follows layer by layer (:func:`completion_hidden`), with
    :data:`CHECKPOINT_KWARGS` (a Mixture-of-Experts layer's recompute forces the routing of its forward)."""
    setattr(model, LM_HEAD_CHUNK, lm_head_chunk)
    if activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
    elif getattr(model, "is_activation_checkpointing", False):
        model.activation_checkpointing_disable()


def head_logprobs(model, hidden: Tensor, targets: Tensor, temperature: float, with_entropy: bool | str):
    """log p(target) [n] under log_softmax(LM head(hidden) / temperature) and, with ``with_entropy``, the entropy [n]
    (with gradient only for ``"gradient"``), ``hidden`` [n, hidden_size]. With the model's LM-head chunk
    (:func:`set_memory_settings`) the positions go through the head a chunk at a time, so no [n, V] tensor exists:
    without gradients each chunk's logits are freed before the next; with gradients each chunk is checkpointed (its
    logits recomputed in the backward pass, one chunk at a time), the same values and gradient as all at once. An
    entropy with gradient (an entropy bonus) is not checkpointed: each chunk's graph is kept (the same values and
    gradient, the memory of the unchunked head)."""
    chunk = getattr(model, LM_HEAD_CHUNK, 0)
    head = model.get_output_embeddings()
    if not chunk or len(hidden) <= chunk:
        return _head_part(head, temperature, with_entropy, hidden, targets)
    checkpointed = torch.is_grad_enabled() and hidden.requires_grad and with_entropy != "gradient"
    parts = []
    for h, t in zip(hidden.split(chunk), targets.split(chunk), strict=True):
        if checkpointed:
            once = {"with_entropy": with_entropy}  # the entropy on the first pass, not on the backward's recompute
            logp = checkpoint(_checkpointed_part, head, temperature, once, h, t, use_reentrant=False)
            parts.append((logp, once.get("entropy")))
        else:
            parts.append(_head_part(head, temperature, with_entropy, h, t))
    logp = torch.cat([p[0] for p in parts])
    return logp, torch.cat([p[1] for p in parts]) if with_entropy else None


def _checkpointed_part(head, temperature: float, once: dict, hidden: Tensor, targets: Tensor) -> Tensor:
    """:func:`_head_part`'s log-probs; the entropy into ``once`` if it asks (the first call only)."""
    logp, entropy = _head_part(head, temperature, once.pop("with_entropy", False), hidden, targets)
    if entropy is not None:
        once["entropy"] = entropy
    return logp


def _head_part(head, temperature: float, with_entropy: bool | str, hidden: Tensor, targets: Tensor):
    """:func:`head_logprobs` of some positions, all at once."""
    logits = head(hidden).float()  # [n, V]: real positions only
    if temperature != 1.0:  # x / 1.0 == x: a pass over [n, V] saved
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, targets[:, None])[:, 0]
    entropy = None
    if with_entropy == SUM_PI_SQUARED:  # sum_v pi_v^2 = sum_v exp(2 log pi_v), in blocks, without gradient
        with torch.no_grad():
            entropy = torch.cat([(2 * block).exp().sum(-1) for block in logp.split(ENTROPY_BLOCK)])
    elif with_entropy:
        # in blocks: no temporary as large as logp (without gradient; with it, autograd keeps each block's product)
        with torch.set_grad_enabled(with_entropy == "gradient" and torch.is_grad_enabled()):
            entropy = torch.cat([-(block.exp() * block).sum(-1) for block in logp.split(ENTROPY_BLOCK)])
    return token_logp, entropy


def _model_hidden(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, valid: Tensor) -> Tensor:
    """The model's final hidden states [N, T, hidden] that predict the completion tokens (prompt passes shared by
    consecutive rows with the same prompt: :func:`completion_logprobs`)."""
    decoder = model.get_decoder()
    attention = torch.cat([prompt_mask, valid.to(prompt_mask.dtype)], dim=1)
    position_ids = positions(attention)
    prompt_len, length = prompt_ids.shape[1], completion_ids.shape[1]
    width = prompt_len + length  # an MoE's routing grid: [prompt | completion] (harness/policy/routing.py)
    first_row, prompt_of_row = distinct_prompts(prompt_ids, prompt_mask)
    if prompt_len > 1 and len(first_row) < len(prompt_of_row) and not checkpointing(model):  # (its layers drop caches)
        head_mask = prompt_mask[first_row, :-1]
        with laid_out(model, lambda: shared_prompt_layout(prompt_of_row, head_mask, width)):
            cache = decoder(input_ids=prompt_ids[first_row, :-1], attention_mask=head_mask,
                            position_ids=positions(head_mask), use_cache=True).cache
        cache.batch_select_indices(prompt_of_row)
        tail = torch.cat([prompt_ids[:, -1:], completion_ids], dim=1)
        with laid_out(model, lambda: tail_layout(attention[:, prompt_len - 1 :], prompt_len - 1, width)):
            return decoder(input_ids=tail, attention_mask=attention, position_ids=position_ids[:, prompt_len - 1 :],
                           cache=cache, use_cache=True).last_hidden_state[:, :length]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    with laid_out(model, lambda: full_layout(attention)):
        return decoder(input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                       use_cache=False).last_hidden_state[:, prompt_len - 1 : prompt_len - 1 + length]


def padding_free_unsupported(model, prompt_mask: Tensor, completion_mask: Tensor) -> str | None:
    """Why :func:`completion_hidden` cannot run this batch (``None``: it can)."""
    reason = written_out_unsupported(model, prompt_mask.shape[1] + completion_mask.shape[1])
    if reason:
        return reason
    if model.training and getattr(model.config.get_text_config(), "attention_dropout", 0.0):
        return "the model trains with attention dropout"
    if not bool(prompt_mask[:, -1].all()):
        return "a prompt is not left-padded (its last position is padding)"
    if bool((completion_mask[:, 1:] > completion_mask[:, :-1]).any()):
        return "a completion mask is not a prefix of its row"
    return None


def distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(the first row of each run of equal consecutive prompts [D], the run of every row [N])."""
    _, prompt_of_row = torch.unique_consecutive(torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1),
                                                dim=0, return_inverse=True)
    first_row = torch.cat([prompt_of_row.new_ones(1), prompt_of_row.diff()]).nonzero()[:, 0]
    return first_row, prompt_of_row


def completion_hidden(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                      completion_mask: Tensor) -> Tensor:
    """The final hidden states [n, hidden] that predict the n real completion tokens (``completion_mask`` [N, T], a
    prefix per row), in row-major order (as ``hidden[completion_mask]``). Prompts [N, P] left-padded, their last
    position real (:func:`padding_free_unsupported`)."""
    body = model.get_decoder()
    rows, width = completion_ids.shape
    allowed = torch.ones(width, width, dtype=torch.bool, device=completion_ids.device).tril().expand(
        rows, 1, width, width)  # tail query j sees tail keys j' <= j
    prefix = [(None, None)] * len(body.layers)
    if prompt_ids.shape[1] > 1:  # the prompts but their last token, once per distinct prompt
        first_row, prompt_of_row = distinct_prompts(prompt_ids, prompt_mask)
        head_mask = prompt_mask[first_row, :-1]
        with _uncheckpointed(body):  # checkpointed layers would drop the cache
            cache = body(input_ids=prompt_ids[first_row, :-1], attention_mask=head_mask,
                         position_ids=positions(head_mask), use_cache=True).cache
        prefix = [(layer.keys[prompt_of_row], layer.values[prompt_of_row]) for layer in cache.layers]
        prompt_allowed = prompt_mask[:, None, None, :-1].bool().expand(rows, 1, width, prompt_ids.shape[1] - 1)
        allowed = torch.cat([prompt_allowed, allowed], -1)
    index = completion_mask.flatten().nonzero()[:, 0]  # the real positions in the [N x T] grid
    tail = torch.cat([prompt_ids[:, -1:], completion_ids[:, :-1]], 1)
    tail_positions = prompt_mask.sum(-1, keepdim=True) - 1 + torch.arange(width, device=tail.device)
    hidden = body.embed_tokens(tail.flatten()[index])
    cos, sin = body.rotary_emb(hidden, tail_positions.flatten()[index][None])
    cos, sin = cos[0, :, None], sin[0, :, None]  # [n, 1, d]

    def padded(x: Tensor) -> Tensor:  # [n, H, d] -> [N, H, T, d], zero at padded positions
        grid = x.new_zeros(rows * width, *x.shape[1:]).index_copy(0, index, x)
        return grid.view(rows, width, *x.shape[1:]).transpose(1, 2)

    def run_layer(layer, hidden: Tensor, prefix_keys: Tensor | None, prefix_values: Tensor | None) -> Tensor:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q, k, v = (proj(x).view(len(index), -1, attn.head_dim) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head on q and k before the rotary embedding
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        keys, values = padded(k), padded(v)
        if prefix_keys is not None:
            keys, values = torch.cat([prefix_keys, keys], 2), torch.cat([prefix_values, values], 2)
        groups = q.shape[1] // k.shape[1]  # query heads per key/value head
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        out = torch.nn.functional.scaled_dot_product_attention(padded(q), keys, values, attn_mask=allowed,
                                                               scale=attn.scaling)
        out = out.transpose(1, 2).reshape(rows * width, -1).index_select(0, index)
        hidden = hidden + attn.o_proj(out)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    recompute = checkpointing(model)  # transformers' activation checkpointing, on the layers its forward would
    for layer, (prefix_keys, prefix_values) in zip(body.layers, prefix, strict=True):
        if recompute and getattr(layer, "gradient_checkpointing", True):
            hidden = checkpoint(run_layer, layer, hidden, prefix_keys, prefix_values, **CHECKPOINT_KWARGS)
        else:
            hidden = run_layer(layer, hidden, prefix_keys, prefix_values)
    return body.norm(hidden)


@contextmanager
def evaluating(model):
    """``model`` in eval mode inside (dropout off: LoRA's ``model.lora.dropout``), its mode restored afterwards. The
    no-grad forwards that stand for a policy (the sampler's, the recomputed old or proximal log-probs, a statistics
    pass) are of the policy itself, not of one dropout draw; only the update's forwards train."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def checkpointing(model) -> bool:
    """Whether this forward of ``model`` recomputes its layers' activations in the backward pass (transformers'
    activation checkpointing is on, the model trains, and gradients are recorded)."""
    return getattr(model, "is_activation_checkpointing", False) and model.training and torch.is_grad_enabled()


@contextmanager
def _uncheckpointed(body):
    """``body``'s modules with transformers' activation checkpointing off (a prompt pass's cache is dropped by it; the
    prompts, once per distinct prompt, keep their activations)."""
    modules = [m for m in body.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in modules:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in modules:
            m.gradient_checkpointing = True


def _rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves (the Llama family's rotary embedding)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], -1)
