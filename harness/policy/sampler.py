"""The sampler: a native decode loop over harness/policy/decode.py's decoders, or transformers' ``generate`` as the
reference, recording each sampled token's log-prob; its config check; "sample these problems with the run's
settings" (:func:`sample_problems`).

The sampler and the trainer's forward (harness/policy/forward.py) use the same distribution: log_softmax(logits /
temperature) of the full vocabulary (top-p only truncates what is sampled, as vLLM's and TRL's log-probs do), so with
one model in one precision the sampler's log-probs equal the trainer's up to float round-off.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList

from harness.policy.architecture import positions, written_out_unsupported
from harness.policy.decode import DECODERS, build_decoder, held_bytes
from harness.policy.forward import evaluating
from harness.policy.models import build_prompt
from harness.policy.routing import Grid, RoutingRecord, routing_of, routing_unsupported, select_record_rows
from harness.run.checks import register_check
from harness.run.errors import ConfigError

SAMPLERS = ("native", "hf")  # train.sampler: our decode loop, or transformers' generate (the reference)


@register_check("sampler")
def check_sampler(run: DictConfig) -> None:
    """``train.sampler``, ``train.decoder``, ``train.compile_sampler`` and the sampling distribution's settings."""
    t = run.train
    if not 0 < t.top_p <= 1 or t.temperature <= 0:
        raise ConfigError(f"need 0 < train.top_p <= 1 and train.temperature > 0, got {t.top_p}, {t.temperature}")
    if t.sampler not in SAMPLERS:
        raise ConfigError(f"train.sampler must be one of {', '.join(SAMPLERS)}, got {t.sampler!r}")
    if t.decoder not in DECODERS:
        raise ConfigError(f"train.decoder must be one of {', '.join(DECODERS)}, got {t.decoder!r}")
    if t.compile_sampler and (t.sampler != "native" or t.decoder == "shared_prefix"):
        raise ConfigError("train.compile_sampler compiles the native sampler's per-row or cache decoder: use it "
                          "with train.sampler=native and train.decoder=auto, per_row or cache")


def check_decoder(model, run: DictConfig) -> None:
    """Once the model is loaded: a written-out decoder asked for by name (``train.decoder=shared_prefix`` or
    ``per_row``) can run it (``auto`` falls back to the cache decoder)."""
    t = run.train
    if t.sampler == "native" and t.decoder in ("shared_prefix", "per_row"):
        reason = written_out_unsupported(model, t.max_new_tokens)
        if reason:
            raise ConfigError(f"train.decoder={t.decoder} cannot run {run.model.name!r}: {reason}; use "
                              "train.decoder=auto (falls back to the cache decoder) or cache")


@dataclass
class Rollout:
    prompt_ids: Tensor  # [N, P] left-padded
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, T] right-padded
    completion_mask: Tensor  # [N, T] bool: tokens up to and including the first EOS
    sampler_logp: Tensor  # [N, T] log-probs of the sampled tokens under the sampler (0 on padding)
    texts: list[str]  # decoded completions
    truncated: Tensor  # [N] bool: no EOS within max_new_tokens
    routing: RoutingRecord | None = None  # an MoE sampler's own routing on [prompt | completion] (R3), -1 elsewhere


class _RecordAndWarp(LogitsProcessor):
    """Records log p(token) of each sampled token under log_softmax(logits / T), then applies T and top-p.

    At step t the processor sees the token sampled at step t-1 as the last input id, so it only keeps the
    previous step's log-probs (one [N, V] tensor), never the whole [N, T, V] history.
    """

    def __init__(self, temperature: float, top_p: float, greedy: bool):
        self.temperature, self.top_p, self.greedy = temperature, top_p, greedy
        self.previous: Tensor | None = None
        self.logp: list[Tensor] = []

    def take(self, tokens: Tensor) -> None:
        self.logp.append(self.previous.gather(-1, tokens[:, None])[:, 0])

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.previous is not None:
            self.take(input_ids[:, -1])
        scaled = scores.float() / self.temperature
        self.previous = torch.log_softmax(scaled, dim=-1)
        if self.greedy or self.top_p >= 1.0:
            return scaled
        return scaled.masked_fill(_top_p_drop(scaled, self.top_p), float("-inf"))


def _top_p_drop(scaled: Tensor, top_p: float) -> Tensor:
    """True for the tokens whose more probable tokens already hold more than ``top_p`` of the probability: outside
    the smallest most-probable set that reaches ``top_p``, except that a token after a set holding exactly ``top_p``
    is kept (transformers' TopPLogitsWarper drops it; only an exact float tie tells them apart)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = probs.cumsum(-1) - probs > top_p
    return drop_sorted.scatter(-1, order, drop_sorted)


def select_rows(rollouts: list[Rollout], rows: list[tuple[int, int]], pad_token_id: int) -> Rollout:
    """A rollout of the given (rollout index, row) pairs, in that order: prompts re-padded on the left,
    completions on the right, to the widest of the selected rows."""
    def stack(tensors: list[Tensor], left: bool, value) -> Tensor:
        width = max(x.shape[-1] for x in tensors)
        pad = [(width - x.shape[-1], 0) if left else (0, width - x.shape[-1]) for x in tensors]
        return torch.stack([torch.nn.functional.pad(x, p, value=value) for x, p in zip(tensors, pad, strict=True)])

    def pick(field: str) -> list[Tensor]:
        return [getattr(rollouts[r], field)[i] for r, i in rows]

    return Rollout(
        prompt_ids=stack(pick("prompt_ids"), True, pad_token_id), prompt_mask=stack(pick("prompt_mask"), True, 0),
        completion_ids=stack(pick("completion_ids"), False, pad_token_id),
        completion_mask=stack(pick("completion_mask"), False, False),
        sampler_logp=stack(pick("sampler_logp"), False, 0.0), texts=[rollouts[r].texts[i] for r, i in rows],
        truncated=torch.stack(pick("truncated")),
        routing=select_record_rows([r.routing for r in rollouts], rows) if rollouts[0].routing is not None else None)


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How :func:`generate` samples: its keywords, each with its default (``max_new_tokens`` has none)."""

    max_new_tokens: int
    group_size: int = 1  # completions per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False  # argmax instead of a draw
    sampler: str = "native"  # "native" (our decode loop) or "hf" (transformers' generate)
    compact_every: int = 4  # native: finished rows leave the batch every this many steps (0: never)
    decoder: str = "auto"  # native: harness/policy/decode.py's kind
    compile: bool = False  # native: torch.compile the decoder's step
    record_routing: bool = False  # native, MoE: record the sampler's routing (R3) on the rollout
    stop_at_eos: bool = True  # native; False: EOS is never drawn (its logit -inf), every row runs max_new_tokens
    # tokens (the worst-case shapes `bench --scale` measures; the recorded log-probs are then those of that
    # EOS-less distribution, so a run never sets it)


def _generate_hf(model, tokenizer, prompt_ids: Tensor, prompt_mask: Tensor, how: Sampling) -> tuple[Tensor, Tensor]:
    """The reference: transformers' ``generate`` with a logits processor recording the sampler's log-probs.
    Returns the completions [N, T] and their log-probs [N, T] (garbage after the first EOS)."""
    group_size, greedy = how.group_size, how.greedy
    cache = None
    if group_size > 1 and prompt_ids.shape[1] > 1:
        head, head_mask = prompt_ids[:, :-1], prompt_mask[:, :-1]
        cache = model.get_decoder()(input_ids=head, attention_mask=head_mask, position_ids=positions(head_mask),
                                    use_cache=True).cache
        cache.batch_repeat_interleave(group_size)
    prompt_ids = prompt_ids.repeat_interleave(how.group_size, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(how.group_size, dim=0)
    recorder = _RecordAndWarp(how.temperature, how.top_p, greedy)
    out = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=how.max_new_tokens,
        **({"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}),
        logits_processor=LogitsProcessorList([recorder]),
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, use_cache=True,
        cache=cache,
    )
    completion_ids = out[:, prompt_ids.shape[1]:]
    recorder.take(completion_ids[:, -1])
    sampler_logp = torch.stack(recorder.logp, dim=1)[:, : completion_ids.shape[1]]
    return completion_ids, sampler_logp


SAMPLE_BLOCK = 256  # vocabulary entries per block of the sampler's two-level inverse CDF


def _sample(logits: Tensor, uniform: Tensor | None, temperature: float, top_p: float) -> tuple[Tensor, Tensor]:
    """The next token [n] and its log-prob [n] under the full log_softmax(logits / T).

    ``uniform`` [n] in [0, 1): the inverse-CDF draw from softmax(logits / T) truncated to top-p (:func:`_inverse_cdf`),
    one number per row (so the draws do not depend on which other rows are in the batch); ``None``: argmax
    (greedy). The log-prob is computed as log_softmax does, (x - max) - log(sum e^(x - max)), for the drawn token
    only.
    """
    scaled = logits.float()
    if temperature != 1.0:  # x / 1.0 == x: a pass over [n, V] saved
        scaled = scaled / temperature
    top = scaled.amax(-1, keepdim=True)
    weights = (scaled - top).exp_()  # unnormalised probabilities, in place: one fresh [n, V] tensor per step, not two
    log_total = weights.sum(-1).log()
    if uniform is None:
        token = scaled.argmax(-1)
    else:
        if top_p < 1.0:
            weights = weights.masked_fill(_top_p_drop(scaled, top_p), 0.0)
        token = _inverse_cdf(weights, uniform)
    return token, (scaled.gather(-1, token[:, None]) - top)[:, 0] - log_total


def _inverse_cdf(weights: Tensor, uniform: Tensor) -> Tensor:
    """Per row of ``weights`` [n, V] (>= 0, some > 0): the first index whose cumulative weight exceeds
    u x (total weight), for u = ``uniform`` [n] in [0, 1); never an index of weight 0.

    Two levels, so that no cumulative sum over the whole vocabulary is formed (torch's CPU cumsum runs element by
    element: docs/results_benchmark.md): the block of ``SAMPLE_BLOCK`` entries (one block of
    V entries when V is smaller) whose cumulative block sum first exceeds the point, then the entry inside it;
    where float rounding of the block's own cumulative sum leaves the point past its end, the entry at which that
    cumulative sum reaches its final value (a positive weight: the sum grew there).
    """
    n, vocab = weights.shape
    size = min(SAMPLE_BLOCK, vocab)
    blocks = -(-vocab // size)
    if vocab % size:  # F.pad copies even when there is nothing to pad
        weights = torch.nn.functional.pad(weights, (0, blocks * size - vocab))
    padded = weights.view(n, blocks, size)
    block_cdf = padded.sum(-1).cumsum(-1)  # [n, blocks]
    total = block_cdf[:, -1:]
    point = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # < total
    block = torch.searchsorted(block_cdf, point, right=True)  # [n, 1]: first block whose cdf > point (its sum > 0)
    before = torch.nn.functional.pad(block_cdf, (1, 0))[:, :-1].gather(-1, block)  # cdf of the blocks before: <= point
    first = torch.arange(n, device=weights.device) * blocks  # row r's blocks start at r x blocks in [n x blocks, size]
    inside = padded.view(n * blocks, size).index_select(0, first + block[:, 0]).cumsum(-1)  # [n, size]
    entry = torch.searchsorted(inside, point - before, right=True)
    return (block * size + torch.minimum(entry, torch.searchsorted(inside, inside[:, -1:].contiguous())))[:, 0]


def _generate_native(model, prompt_ids: Tensor, prompt_mask: Tensor, how: Sampling,
                     eos_token_id: int) -> tuple[Tensor, Tensor]:
    """The native decode loop over a :mod:`harness.policy.decode` decoder (prompts [D, P] prefilled once per group).

    Every ``compact_every`` steps (0: never) rows that have emitted EOS leave the batch: the last unfinished rows
    are moved into their slots, so the cost is per finished row. Each step draws one uniform number per output
    row, so the tokens do not depend on ``compact_every``. Returns the completions [N, T] and log-probs [N, T]
    (garbage after the first EOS), T = steps run (the loop stops once every row has emitted EOS).
    """
    group_size, max_new_tokens, compact_every = how.group_size, how.max_new_tokens, how.compact_every
    step, logits = build_decoder(model, prompt_ids, prompt_mask, group_size=group_size, max_new_tokens=max_new_tokens,
                                 kind=how.decoder, compile=how.compile)
    device, rows = prompt_ids.device, prompt_ids.shape[0] * group_size
    position = prompt_mask.sum(-1).repeat_interleave(group_size)
    row = torch.arange(rows, device=device)  # the output row of each batch row
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    completion_ids = torch.full((rows, max_new_tokens), eos_token_id, dtype=torch.long, device=device)
    sampler_logp = torch.zeros(rows, max_new_tokens, device=device)
    steps = max_new_tokens
    for t in range(max_new_tokens):
        uniform = None if how.greedy else torch.rand(rows, device=device)[row]
        if not how.stop_at_eos:  # a copy: the decoder may hand out its own buffer
            logits = logits.index_fill(-1, torch.tensor([eos_token_id], device=device), float("-inf"))
        token, logp = _sample(logits, uniform, how.temperature, how.top_p)
        completion_ids[row, t], sampler_logp[row, t] = token, logp
        finished |= token == eos_token_id
        if t == max_new_tokens - 1 or bool(finished.all()):
            steps = t + 1
            break
        if compact_every and (t + 1) % compact_every == 0 and bool(finished.any()):
            keep = int((~finished).sum())
            order = torch.arange(keep, device=device)
            order[finished[:keep].nonzero()[:, 0]] = keep + (~finished[keep:]).nonzero()[:, 0]
            step.keep(order)
            row, finished, token, position = row[order], finished[order], token[order], position[order]
        logits = step.step(token, position + t)
    return completion_ids[:, :steps], sampler_logp[:, :steps]


def sampler_options(train) -> dict:
    """A run's sampler settings (``train.sampler``, ``train.decoder``, ``train.compile_sampler``) as
    :func:`generate` keywords."""
    return {"sampler": train.sampler, "decoder": train.decoder, "compile": train.compile_sampler}


def sample_problems(model, tokenizer, problems, train: DictConfig | None = None, **settings) -> Rollout:
    """Completions of each problem's prompt (:func:`harness.policy.models.build_prompt` of its question): with a
    run's ``train`` section, its sampling (``group_size``, ``max_new_tokens``, ``temperature``, ``top_p``, the
    sampler, decoder and compile settings), else :func:`generate`'s defaults; ``settings`` override either (e.g.
    ``greedy=True``, another ``group_size``). Greedy decoding ignores the run's temperature and top-p."""
    options = {}
    if train is not None:
        options = {"group_size": train.group_size, "max_new_tokens": train.max_new_tokens, **sampler_options(train)}
        if not settings.get("greedy"):
            options.update(temperature=train.temperature, top_p=train.top_p)
    prompts = [build_prompt(tokenizer, problem.question) for problem in problems]
    return generate(model, tokenizer, prompts, **{**options, **settings})


def encode_prompts(model, tokenizer, prompts: list[str]) -> tuple[Tensor, Tensor]:
    """The prompts' token ids and attention mask [N, P], left-padded, on the model's device."""
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    return enc.input_ids.to(device), enc.attention_mask.to(device)


@torch.inference_mode()
def decoder_memory(model, tokenizer, problems, train: DictConfig) -> dict[str, int]:
    """What the native sampler's decoder for ``problems`` under the run's ``train`` settings holds beyond the model's
    weights (:func:`harness.policy.decode.held_bytes`: weight copies; keys/values at capacity and tables): the
    decoder is built and prefilled as a rollout would, then dropped."""
    prompt_ids, prompt_mask = encode_prompts(model, tokenizer, [build_prompt(tokenizer, p.question) for p in problems])
    decoder, _ = build_decoder(model, prompt_ids, prompt_mask, group_size=train.group_size,
                               max_new_tokens=train.max_new_tokens, kind=train.decoder, compile=train.compile_sampler)
    return {"kind": type(decoder).__name__, **held_bytes(decoder, model)}


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], **settings) -> Rollout:
    """Sample ``group_size`` completions per prompt (rows ordered prompt by prompt), batched, left-padded;
    ``settings`` are :class:`Sampling`'s fields (an unknown one, or no ``max_new_tokens``, is a TypeError).
    :func:`generate_ids` with the prompts encoded.

    Each distinct prompt is prefilled once. ``sampler="native"``: the native decode loop (finished rows leave the
    batch every ``compact_every`` steps) over a :mod:`harness.policy.decode` ``decoder`` (``"auto"``: prompt keys/values
    shared by the group for Llama-family models; ``"cache"``: the model's forward over a per-row KV cache,
    optionally ``torch.compile``-d); ``"hf"``: transformers' ``generate`` (the reference). Both record
    log p(token) under log_softmax(logits / temperature) of the full vocabulary; draws use the global torch RNG.
    Completions are right-padded with the pad token after their first EOS (log-prob 0 there).
    ``record_routing`` (an MoE model with a :class:`harness.policy.routing.Routing` hooked on, the native sampler):
    the rollout carries the sampler's routing of its real tokens (``Rollout.routing``; R3).
    """
    prompt_ids, prompt_mask = encode_prompts(model, tokenizer, prompts)
    return generate_ids(model, tokenizer, prompt_ids, prompt_mask, **settings)


@torch.no_grad()
def generate_ids(model, tokenizer, prompt_ids: Tensor, prompt_mask: Tensor, **settings) -> Rollout:
    """:func:`generate` from prompts already encoded, left-padded [D, P] (e.g. a prompt and the first tokens of its
    completion, which an in-flight rollout continues with a newer policy: harness/loop/pipeline.py)."""
    how = Sampling(**settings)
    if how.sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {how.sampler!r}")
    with evaluating(model):
        if how.sampler == "hf":
            if not how.stop_at_eos:
                raise ValueError("stop_at_eos=False needs the native sampler")
            if how.record_routing:
                raise ValueError("record_routing needs the native sampler (transformers' generate is not laid out)")
            completion_ids, sampler_logp = _generate_hf(model, tokenizer, prompt_ids, prompt_mask, how)
        else:
            with torch.inference_mode(), _routing_capture(model, prompt_ids, how) as capture:
                # no autograd bookkeeping per op; what is returned is copied by the ops below
                completion_ids, sampler_logp = _generate_native(model, prompt_ids, prompt_mask, how,
                                                                tokenizer.eos_token_id)
    ro = rollout_of(tokenizer, prompt_ids.repeat_interleave(how.group_size, dim=0),
                    prompt_mask.repeat_interleave(how.group_size, dim=0), completion_ids, sampler_logp)
    if how.record_routing:  # the grid's [prompt | max_new_tokens] cut to the completions' width, -1 off the real tokens
        record = capture.record.select(torch.arange(len(ro.texts)), completion_ids.shape[1])
        ro.routing = dataclasses.replace(record, indices=record.indices.clone()).masked(
            torch.cat([ro.prompt_mask.bool(), ro.completion_mask], 1))
    return ro


def rollout_of(tokenizer, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
               sampler_logp: Tensor) -> Rollout:
    """The rollout of sampled completions [N, T] (anything after a row's first EOS is dropped): the completion mask
    (tokens up to and including the first EOS), the pad token and log-prob 0 after it, the texts, truncation (no
    EOS)."""
    is_eos = completion_ids == tokenizer.eos_token_id
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    completion_ids = completion_ids.masked_fill(after_eos, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, completion_ids, ~after_eos, sampler_logp.masked_fill(after_eos, 0.0), texts,
                   ~is_eos.any(-1))


@contextmanager
def _routing_capture(model, prompt_ids: Tensor, how: Sampling):
    """With ``how.record_routing``: a capture of ``model``'s routing on the rollout's grid (rows x [prompt |
    max_new_tokens]), which the decoder's forwards fill (harness/policy/routing.py's RecordingDecoder); else None."""
    if not how.record_routing:
        yield None
        return
    routing = routing_of(model)
    if routing is None:
        reason = routing_unsupported(model) or "none made"
        raise ValueError(f"record_routing: no routing hooks on the sampler ({reason})")
    width = prompt_ids.shape[1]
    with routing.capture(Grid(len(prompt_ids) * how.group_size, width + how.max_new_tokens, width)) as capture:
        yield capture
