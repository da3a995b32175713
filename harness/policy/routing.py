"""Routing record and replay for Mixture-of-Experts policies (R2 / R3), through a forward hook on every MoE router.

    routing = Routing(model)                                   # hooks on each router (ROUTER_WEIGHTS' classes)
    with routing.capture(Grid(rows, width, prompt_width)) as cap:        # record
        with routing.tokens(full_layout(attention_mask)):
            model(input_ids, attention_mask=attention_mask)
    behaviour = cap.record                                     # RoutingRecord: [layers, rows, width, k]
    with routing.capture(replay=behaviour.select(rows, width)) as cap:   # replay (+ the live router's own top-k)
        with routing.tokens(full_layout(mask)):
            loss = objective(model(...)); loss.backward()
    expert_volatility(behaviour.select(rows, width), cap.record)         # what replay overrode

**The grid.** A record is aligned to the caller's token layout, not to any one forward's: rows x columns, where
columns [0, prompt_width) are the row's left-padded prompt and the rest its right-padded completion (the
``[prompt_ids | completion_ids]`` of a :class:`harness.policy.sampler.Rollout`); entry (layer, row, column) holds the k
experts the router chose for that token when it was the forward's input, in the router's own (descending
probability) order; -1 where no token was routed (padding, a completion's last token that sampling never fed).
Each forward call states where its tokens sit on the grid (:meth:`Routing.tokens` with a :class:`Layout`), so
differently shaped forwards of the same tokens fill the same record:

* the sampler (:class:`RecordingDecoder` around a :mod:`harness.policy.decode` decoder): the prefill of each distinct
  left-padded prompt [D, P] (its tokens go to all ``group_size`` rows of its group), then one token per
  remaining row per decode step through the KV cache (rows leaving the batch tracked through ``keep``);
* the trainer's teacher-forced forward over [prompt + completion] (:func:`full_layout`), or the two calls of the
  shared-prompt forward (:func:`shared_prompt_layout` for the prompts' heads once per distinct prompt,
  :func:`tail_layout` for each row's last prompt token and completion).
With the same weights and tokens they give the same record, up to float round-off flipping a near-tie (the tests
compare them exactly in float32). The padding-free forward (harness/policy/forward.py) runs Llama-family models only,
so MoE models always take these paths.

**Replay.** While a record is replayed the router's forward runs unchanged (its logits keep their graph), then
the hook swaps its top-k indices for the recorded ones and recomputes the gate weights from the live logits with
the class's own arithmetic (verl's convention: the router keeps its gradient through the weights of the forced
experts; :data:`ROUTER_WEIGHTS`): p = softmax(logits) in float32 over all experts, g_i = p_i for each recorded
expert i, then for classes that renormalise (Mixtral always; Qwen3-MoE, Qwen2-MoE and OLMoE when
``norm_topk_prob``) g_i / sum_j g_j over the k recorded experts (= ROLL's g_i = e^{s_i} / sum_{j in ref} e^{s_j}),
and the class's cast back to the logits' dtype (not Mixtral's, which stays float32). So where the record equals
the live top-k, replay reproduces the forward and its gradients bit for bit. Other choices, each with its
alternative:

* a token whose record is missing in any of its k slots (-1) keeps the live routing (verl falls back the same
  way for rows without a valid record); the alternative, refusing, would forbid replaying on a record that never
  saw a completion's last token, which no log-prob depends on;
* a record that names an expert the model lacks, repeats an expert within a token's k, or comes from other
  routers (layer names, k, expert count) is refused before the forward (ValueError; verl falls back to native
  routing for rows with duplicate indices instead); records made here never have them;
* a token laid out on several grid rows (a prompt shared by a group) is forced to one of those rows' records;
  records made here agree across them (one forward routed it for all of them);
* micro-batches replay :meth:`RoutingRecord.select` of the minibatch record (rows, and the completion columns the
  micro-batch keeps); nothing is consumed, so every epoch, minibatch and the old-policy recompute can replay the
  same record (slime consumes each record once instead);
* Qwen2-MoE's shared expert and its sigmoid gate are not routed: they run as they are;
* Mixtral's training-time ``router_jitter_noise`` multiplies the router's input before it runs; replay keeps it;
* the auxiliary load-balancing loss (``Capture.aux_loss``, the class's own function on the router logits of
  the laid-out tokens) counts the live router's own top-k, as the class computes it from logits;
* a record names its layers by router module name, so a record made by a copy of the model (e.g. the sampler in
  another precision) replays on the policy;
* activation checkpointing (transformers' layers under non-reentrant ``torch.utils.checkpoint`` with
  :func:`checkpoint_contexts` as ``context_fn``, which :func:`harness.policy.forward.set_memory_settings` and the
  TRL backend set): the routing is recorded once, in the forward, and the recompute in backward forces it again,
  keyed by router module and call order within the checkpointed call (as verl's router replay keeps a record per
  router), whether or not a capture or a replay was active and whenever the backward runs. Inside a checkpointed
  forward even the live top-k goes through the replay's arithmetic, so that its recompute runs the same operations
  (torch matches saved tensors by order) and gets the same experts (no near-tie flipped between the two passes):
  the same loss and gradients as without checkpointing (tests/test_routing.py). A recompute without that
  ``context_fn`` stops with an error instead of silently routing afresh.
Every capture also records the live router's own top-k (``Capture.record``), so under replay the disagreement
between the behaviour routing and the current policy's is measured at the forward replay overrides: each layer's
router as the current weights choose given the replayed layers below it (what R2/R3 override at that layer).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import huggingface_hub
import torch
from omegaconf import DictConfig
from torch import Tensor

from harness.policy.lora import adapted
from harness.policy.models import EMBEDDED_MODELS
from harness.run.checks import register_check
from harness.run.config import TINY_MOE
from harness.run.errors import ConfigError

REPLAY_MODES = ("none", "r2", "r3")  # train.routing_replay


def _softmax_topk_weights(module, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen3MoeTopKRouter / Qwen2MoeTopKRouter / OlmoeTopKRouter (transformers 5.24): softmax in float32, the
    selected probabilities, renormalised when ``norm_topk_prob``, cast to the logits' dtype."""
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    if module.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def _mixtral_weights(module, logits: Tensor, indices: Tensor) -> Tensor:
    """MixtralTopKRouter (transformers 5.24): softmax of the float32 logits, the selected probabilities always
    renormalised, left in float32."""
    top = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    return top / top.sum(dim=-1, keepdim=True)


# router class name -> gate weights of given expert indices from its logits, as the class computes them for its top-k
ROUTER_WEIGHTS: dict[str, Callable[..., Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_topk_weights, "Qwen2MoeTopKRouter": _softmax_topk_weights,
    "OlmoeTopKRouter": _softmax_topk_weights, "MixtralTopKRouter": _mixtral_weights,
}
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def find_routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's MoE routers of a :data:`ROUTER_WEIGHTS` class, by module name, in forward order."""
    return {name: module for name, module in model.named_modules() if type(module).__name__ in ROUTER_WEIGHTS}


def routing_unsupported(model: torch.nn.Module) -> str | None:
    """Why routing cannot be recorded or replayed on ``model`` (``None``: it can): a dense model, or an MoE whose
    router class this module does not know."""
    if find_routers(model):
        return None
    config = model.config.get_text_config() if hasattr(model, "config") else None
    if any(getattr(config, key, 0) for key in MOE_CONFIG_KEYS):
        return (f"{type(model).__name__} is a Mixture-of-Experts model whose router class is not one of "
                f"{', '.join(ROUTER_WEIGHTS)}")
    return f"{type(model).__name__} is not a Mixture-of-Experts model (no router to record)"


def config_is_moe(name: str) -> bool | None:
    """Whether ``model.name`` is a Mixture-of-Experts model, read from its config without loading it: the embedded
    models by name, a folder's or a hub id's cached ``config.json`` by :data:`MOE_CONFIG_KEYS` (its text config's
    too); None when a hub id's config is not in the local cache (then building the run's routing hooks decides)."""
    if name == TINY_MOE or name in EMBEDDED_MODELS:
        return name == TINY_MOE
    path = os.path.join(name, "config.json") if os.path.isdir(name) else \
        huggingface_hub.try_to_load_from_cache(name, "config.json")
    if not isinstance(path, str) or not os.path.isfile(path):
        return None
    with open(path) as file:
        config = json.load(file)
    return any(config.get(key) or (config.get("text_config") or {}).get(key) for key in MOE_CONFIG_KEYS)


@register_check("routing_replay")
def check_routing_replay(run: DictConfig) -> None:
    """``train.routing_replay``: a known mode; r2/r3 only on a Mixture-of-Experts model, in the native backend; r3 only
    with a sampler whose forwards the routing hooks can lay out (the native sampler, uncompiled)."""
    t = run.train
    mode = t.routing_replay
    if mode not in REPLAY_MODES:
        raise ConfigError(f"train.routing_replay must be one of {', '.join(REPLAY_MODES)}, got {mode!r}")
    if mode == "none":
        return
    if config_is_moe(run.model.name) is False:
        raise ConfigError(f"train.routing_replay={mode} needs a Mixture-of-Experts model ({run.model.name!r} is "
                          f"dense): use model.name={TINY_MOE} or a hub MoE, or train.routing_replay=none")
    if run.backend != "native":
        raise ConfigError(f"backend {run.backend}: train.routing_replay={mode} is not supported (TRL has no routing "
                          "replay); use backend=native")
    if mode == "r3" and (t.sampler != "native" or t.compile_sampler):
        raise ConfigError("train.routing_replay=r3 records the sampler's routing in the native decode loop: use "
                          "train.sampler=native with train.compile_sampler=false, or train.routing_replay=r2")


@dataclass(frozen=True)
class Grid:
    """The caller's token layout: ``rows`` x ``width`` columns, the first ``prompt_width`` the left-padded prompts."""

    rows: int
    width: int
    prompt_width: int


@dataclass
class RoutingRecord:
    """Top-k expert indices per MoE layer and token on a :class:`Grid` (module docstring); -1 where none."""

    indices: Tensor  # [layers, rows, width, k] int16
    layers: tuple[str, ...]  # router module names, in forward order
    prompt_width: int
    num_experts: int

    @property
    def grid(self) -> Grid:
        return Grid(self.indices.shape[1], self.indices.shape[2], self.prompt_width)

    @property
    def valid(self) -> Tensor:
        """[rows, width] bool: recorded in every layer and slot."""
        return (self.indices >= 0).all(-1).all(0)

    def select(self, rows: Tensor, completion_width: int | None = None) -> RoutingRecord:
        """The ``rows`` (a micro-batch) and the prompt plus the first ``completion_width`` completion columns
        (all when None), as the trainer's ``forward_rows`` keeps them."""
        width = self.indices.shape[2] if completion_width is None else self.prompt_width + completion_width
        return dataclasses.replace(self, indices=self.indices[:, rows.to(self.indices.device), :width])

    def masked(self, keep: Tensor) -> RoutingRecord:
        """-1 outside ``keep`` [rows, width] (e.g. the sampler's tokens after a completion's EOS)."""
        drop = ~keep.to(self.indices.device).bool()
        return dataclasses.replace(self, indices=self.indices.masked_fill(drop[None, ..., None], -1))

    def to(self, device: torch.device | str) -> RoutingRecord:
        return dataclasses.replace(self, indices=self.indices.to(device))


def select_record_rows(records: list[RoutingRecord], rows: list[tuple[int, int]]) -> RoutingRecord:
    """The (record index, row) pairs in that order, prompts re-padded on the left and completions on the right to
    the widest of the records (as :func:`harness.policy.sampler.select_rows` re-pads the rollouts they belong to)."""
    first = records[0]
    prompt = max(r.prompt_width for r in records)
    completion = max(r.indices.shape[2] - r.prompt_width for r in records)
    layers, _, _, k = first.indices.shape
    out = first.indices.new_full((layers, len(rows), prompt + completion, k), -1)
    for i, (r, row) in enumerate(rows):
        source = records[r]
        start = prompt - source.prompt_width
        out[:, i, start : start + source.indices.shape[2]] = source.indices[:, row]
    return dataclasses.replace(first, indices=out, prompt_width=prompt)


@dataclass(frozen=True)
class Layout:
    """Where one forward call's tokens sit on the grid: token ``token[m]`` of the call's flattened [B x S] input is
    at ``slot[m]`` of the flattened [rows x width] grid (a token may fill several slots); tokens absent from it
    are padding (routed natively, not recorded)."""

    token: Tensor  # [M] long
    slot: Tensor  # [M] long
    tokens: int  # B x S


def grid_layout(call_shape: tuple[int, int], width: int, call_rows: Tensor, grid_rows: Tensor, columns: Tensor,
                valid: Tensor) -> Layout:
    """Entry r: row ``call_rows[r]`` of a call of shape ``call_shape`` = grid row ``grid_rows[r]``, its position s at
    grid column ``columns[s]`` (or ``columns[r, s]``), where ``valid[r, s]``."""
    batch, length = call_shape
    token = call_rows[:, None] * length + torch.arange(length, device=call_rows.device)
    slot = grid_rows[:, None] * width + columns.to(call_rows.device).expand(len(grid_rows), length)
    valid = valid.to(call_rows.device).bool()
    return Layout(token[valid], slot[valid], batch * length)


def full_layout(attention_mask: Tensor) -> Layout:
    """A forward of the whole grid [rows, width] (the teacher-forced [prompt | completion]; a sampler's prompt
    prefill without groups): call row = grid row, position = column, real where ``attention_mask``."""
    rows, width = attention_mask.shape
    index = torch.arange(rows, device=attention_mask.device)
    return grid_layout((rows, width), width, index, index, torch.arange(width), attention_mask)


def shared_prompt_layout(prompt_of_row: Tensor, head_mask: Tensor, width: int) -> Layout:
    """The heads of the distinct prompts [D, P - 1] (their last token left out), run once each: distinct prompt d's
    tokens at columns [0, P - 1) of every grid row i with ``prompt_of_row[i] == d``."""
    rows = torch.arange(len(prompt_of_row), device=prompt_of_row.device)
    return grid_layout(tuple(head_mask.shape), width, prompt_of_row, rows, torch.arange(head_mask.shape[1]),
                       head_mask[prompt_of_row])


def tail_layout(tail_mask: Tensor, first_column: int, width: int) -> Layout:
    """Each grid row's tokens from ``first_column`` on [rows, S] (the prompt's last token and the completion, after a
    shared prompt head), real where ``tail_mask``."""
    rows, length = tail_mask.shape
    index = torch.arange(rows, device=tail_mask.device)
    return grid_layout((rows, length), width, index, index, first_column + torch.arange(length), tail_mask)


@dataclass
class Capture:
    """What one :meth:`Routing.capture` collects: the live router's top-k on its grid, and (``router_logits``)
    each layer's router logits (with their graph) and the layout of their call, for the auxiliary loss."""

    record: RoutingRecord
    replay: RoutingRecord | None
    router_logits: list[list[tuple[Tensor, Layout]]] | None  # per layer: (the logits of a call, its layout)
    aux_loss_fn: Callable | None = None
    top_k: int = 0

    def aux_loss(self) -> Tensor:
        """The class's own load-balancing loss (``load_balancing_loss_func`` of its modeling module, as the model's
        ``aux_loss`` with ``output_router_logits``) over the grid's tokens in grid order, whatever the forwards that
        routed them: a prompt token a shared-prompt forward ran once counts for every row it fills, as in the full
        forward of the same rows (which an activation-checkpointed forward runs)."""
        if not self.router_logits or not self.router_logits[0]:
            raise ValueError("no router logits captured: use Routing.capture(..., router_logits=True) around a forward")
        logits = tuple(self._in_grid_order(parts) for parts in self.router_logits)
        return self.aux_loss_fn(logits, self.record.num_experts, self.top_k)

    @staticmethod
    def _in_grid_order(parts: list[tuple[Tensor, Layout]]) -> Tensor:
        """One layer's router logits of its calls, one row per grid slot laid out, in slot order."""
        logits = torch.cat([call[layout.token.to(call.device)] for call, layout in parts])
        return logits[torch.cat([layout.slot for _, layout in parts]).argsort(stable=True).to(logits.device)]


@dataclass(frozen=True)
class _State:
    capture: Capture
    layout: Layout | None = None


class _Tape:
    """One checkpointed call's routing: the experts each router forced in its forward (by router module, in call
    order), forced again in its recompute (:func:`checkpoint_contexts`)."""

    def __init__(self):
        self.calls: dict[torch.nn.Module, list[Tensor]] = {}
        self.replayed: dict[torch.nn.Module, int] | None = None  # calls replayed so far while recomputing, else None

    def add(self, router: torch.nn.Module, indices: Tensor) -> None:
        self.calls.setdefault(router, []).append(indices)

    def next(self, router: torch.nn.Module) -> Tensor:
        done = self.replayed.get(router, 0)
        calls = self.calls.get(router, [])
        if done >= len(calls):
            raise RuntimeError(f"routing: a checkpointed layer's recompute called a router {done + 1} times, its "
                               f"forward {len(calls)}")
        self.replayed[router] = done + 1
        return calls[done]


_TAPE: list[_Tape] = []  # the tapes of the checkpointed calls running now (innermost last), forward or recompute


class _Taping:
    """The context of a checkpointed call's forward (``replay=False``: routers add to ``tape``) or of its recompute
    (every entry starts from the tape's first call again)."""

    def __init__(self, tape: _Tape, replay: bool):
        self.tape, self.replay = tape, replay

    def __enter__(self):
        self.tape.replayed = {} if self.replay else None
        _TAPE.append(self.tape)

    def __exit__(self, *exc):
        _TAPE.remove(self.tape)
        self.tape.replayed = None
        return False


def checkpoint_contexts() -> tuple[_Taping, _Taping]:
    """``context_fn`` for non-reentrant ``torch.utils.checkpoint`` (one call per checkpointed call): the routers'
    experts recorded in its forward, forced in its recompute (module docstring)."""
    tape = _Tape()
    return _Taping(tape, replay=False), _Taping(tape, replay=True)


def _in_backward() -> bool:
    """True while autograd runs a backward (where a checkpointed layer's recompute runs)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class Routing:
    """Forward hooks on every MoE router of ``model`` (:data:`ROUTER_WEIGHTS` classes): inside :meth:`capture`
    each router's top-k is recorded on the caller's grid, and with ``replay`` the recorded experts are forced
    (module docstring). Outside a capture the hooks do nothing. ``close()`` removes them."""

    def __init__(self, model: torch.nn.Module):
        routers = find_routers(model)
        if not routers:
            raise ValueError(f"routing replay: {routing_unsupported(model)}")
        self.names = tuple(routers)
        first = next(iter(routers.values()))
        self.top_k, self.num_experts, self._weight = first.top_k, first.num_experts, first.weight
        base = model.get_base_model() if adapted(model) else model  # a LoRA policy: its base model's module's
        self.aux_loss_fn = getattr(sys.modules[type(base).__module__], "load_balancing_loss_func", None)
        self._state: _State | None = None
        self._handles = [module.register_forward_hook(self._hook_of(layer))
                         for layer, module in enumerate(routers.values())]
        self._model = weakref.ref(model)
        _ATTACHED[model] = self  # routing_of(model): what the trainer's forward and the sampler lay out their calls on

    @property
    def capturing(self) -> bool:
        return self._state is not None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        model = self._model()
        if model is not None and _ATTACHED.get(model) is self:
            del _ATTACHED[model]

    @contextmanager
    def capture(self, grid: Grid | None = None, *, replay: RoutingRecord | None = None,
                router_logits: bool = False) -> Iterator[Capture]:
        """Record the live routing of the forwards inside on ``grid`` (``replay``'s grid when replaying) and, with
        ``replay``, force its experts. ``router_logits``: keep each layer's logits for ``Capture.aux_loss``."""
        if self._state is not None:
            raise RuntimeError("routing: a capture is already active on this model; captures do not nest")
        if replay is not None:
            self._check_record(replay)
            grid = replay.grid
        if grid is None:
            raise ValueError("routing.capture needs a grid (or a record to replay)")
        indices = torch.full((len(self.names), grid.rows, grid.width, self.top_k), -1, dtype=torch.int16,
                             device=self._weight.device)
        live = RoutingRecord(indices, self.names, grid.prompt_width, self.num_experts)
        logits = [[] for _ in self.names] if router_logits else None
        self._state = _State(Capture(live, replay, logits, self.aux_loss_fn, self.top_k))
        try:
            yield self._state.capture
        finally:
            self._state = None

    @contextmanager
    def tokens(self, layout: Layout) -> Iterator[None]:
        """The grid positions of the next forward call's tokens (every router call until the context ends)."""
        if self._state is None:
            yield
            return
        outer = self._state
        self._state = dataclasses.replace(outer, layout=layout)
        try:
            yield
        finally:
            self._state = dataclasses.replace(self._state, layout=outer.layout)

    def _check_record(self, record: RoutingRecord) -> None:
        if record.layers != self.names:
            raise ValueError(f"routing replay: the record's layers ({len(record.layers)}: {record.layers[0]}, ...) are "
                             f"not this model's routers ({len(self.names)}: {self.names[0]}, ...)")
        if record.indices.shape[-1] != self.top_k or record.num_experts != self.num_experts:
            raise ValueError(f"routing replay: the record has top-{record.indices.shape[-1]} of {record.num_experts} "
                             f"experts, the model top-{self.top_k} of {self.num_experts}")
        found = record.indices[record.indices >= 0]
        if found.numel() and int(found.max()) >= self.num_experts:
            raise ValueError(f"routing replay: the record names expert {int(found.max())}, the model has "
                             f"{self.num_experts}")
        ordered = record.indices.sort(-1).values
        if bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()):
            raise ValueError("routing replay: the record repeats an expert within a token's top-k")

    def _hook_of(self, layer: int):
        def hook(module, args, output):
            return self._route(layer, module, output)
        return hook

    def _route(self, layer: int, module, output):
        """Inside a capture, record the live top-k of the laid-out tokens and, when replaying, force the recorded
        experts; inside a checkpointed call, record what the forward routed (forced even when live) and force it
        again in the recompute."""
        logits, _, indices = output
        tape = _TAPE[-1] if _TAPE else None
        if tape is not None and tape.replayed is not None:  # the recompute of a checkpointed call
            return self._forced(module, logits, tape.next(module))
        if _in_backward():
            raise RuntimeError("routing: a checkpointed layer was recomputed without the routing's context_fn; enable "
                               "activation checkpointing with harness.policy.forward.set_memory_settings")
        forced = self._captured(layer, logits, indices)
        if tape is not None:
            forced = indices if forced is None else forced
            tape.add(module, forced)
        return None if forced is None else self._forced(module, logits, forced)

    @staticmethod
    def _forced(module, logits: Tensor, indices: Tensor):
        """The router's output with these experts, gate weights from the live logits by the class's arithmetic."""
        return logits, ROUTER_WEIGHTS[type(module).__name__](module, logits, indices), indices

    def _captured(self, layer: int, logits: Tensor, indices: Tensor) -> Tensor | None:
        """Inside a capture: the live top-k of the laid-out tokens recorded (and their logits, when asked), and the
        experts a replay forces (None without a replay; outside a capture)."""
        state = self._state
        if state is None:
            return None
        layout = state.layout
        if layout is None:
            raise RuntimeError("routing: a router ran inside a capture without Routing.tokens(layout) around its "
                               "forward call")
        if layout.tokens != indices.shape[0]:
            raise RuntimeError(f"routing: the layout describes {layout.tokens} tokens, the router got "
                               f"{indices.shape[0]}")
        capture = state.capture
        live = capture.record.indices[layer].view(-1, indices.shape[-1])
        live[layout.slot.to(live.device)] = indices[layout.token].to(live)
        if capture.router_logits is not None:  # indexed in aux_loss, outside any checkpointed call
            capture.router_logits[layer].append((logits, layout))
        if capture.replay is None:
            return None
        recorded = capture.replay.indices[layer].view(-1, indices.shape[-1])[layout.slot.to(
            capture.replay.indices.device)].to(indices)
        use = (recorded >= 0).all(-1)
        return indices.index_put((layout.token[use],), recorded[use])


_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Routing (the latest made)


def routing_of(model) -> Routing | None:
    """The :class:`Routing` hooked onto ``model`` (the latest made, until closed) or, for a LoRA policy, onto its base
    model (the TRL backend hooks the policy before TRL adds the adapters); None without one."""
    routing = _ATTACHED.get(model)
    return _ATTACHED.get(model.get_base_model()) if routing is None and adapted(model) else routing


def laid_out(model, layout: Callable[[], Layout]):
    """Context for one forward call of ``model``: its tokens' grid positions (``layout()``, built only then) while
    ``model``'s routing is capturing; nothing otherwise (dense models, no capture)."""
    routing = _ATTACHED.get(model)
    return routing.tokens(layout()) if routing is not None and routing.capturing else nullcontext()


def recording(model, decoder, width: int):
    """``decoder`` wrapped in a :class:`RecordingDecoder` while ``model``'s routing is capturing (the sampler's
    routing, R3), else ``decoder`` itself. ``width``: the grid's prompt width + max_new_tokens."""
    routing = _ATTACHED.get(model)
    return RecordingDecoder(decoder, routing, width) if routing is not None and routing.capturing else decoder


class RecordingDecoder:
    """A :mod:`harness.policy.decode` decoder (``prefill`` / ``step`` / ``keep``) whose forwards are laid out on the
    rollout's grid, for recording the sampler's own routing (R3) inside a :meth:`Routing.capture` of
    ``Grid(distinct prompts x group_size, prompt width + max_new_tokens, prompt width)``: the prefill's distinct
    prompt d fills the prompt columns of its group's rows; decode step t's input token of batch row b (the token
    sampled at step t) fills column prompt width + t of the output row that batch row holds (followed through
    ``keep``). Only decoders that run the model's own modules apply (the ``cache`` decoder; the written-out ones
    run Llama-family models only)."""

    def __init__(self, decoder, routing: Routing, width: int):
        self.decoder, self.routing, self.width = decoder, routing, width

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int) -> Tensor:
        distinct, self.prompt_width = prompt_ids.shape
        self.rows = torch.arange(distinct * group_size, device=prompt_ids.device)  # output row of each batch row
        self.steps = 0
        call_rows = torch.arange(distinct, device=prompt_ids.device).repeat_interleave(group_size)
        layout = grid_layout(tuple(prompt_ids.shape), self.width, call_rows, self.rows,
                             torch.arange(self.prompt_width), prompt_mask[call_rows])
        with self.routing.tokens(layout):
            return self.decoder.prefill(prompt_ids, prompt_mask, group_size)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        column = torch.tensor([self.prompt_width + self.steps])
        layout = grid_layout((len(tokens), 1), self.width, torch.arange(len(tokens), device=tokens.device),
                             self.rows, column, torch.ones(len(tokens), 1, dtype=torch.bool))
        self.steps += 1
        with self.routing.tokens(layout):
            return self.decoder.step(tokens, positions)

    def keep(self, order: Tensor) -> None:
        self.rows = self.rows[order]
        self.decoder.keep(order)
