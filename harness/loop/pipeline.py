"""Policy lag (``train.rollout_lag`` = k): the batch trained at step t was sampled by the policy after step t-1-k,
as an asynchronous pipeline of depth k delivers it (AReaL, prime-rl, slime, TRL's AsyncGRPOTrainer). The pipeline is
a queue of pending batches, each keeping its sampler log-probs and the policy version that sampled every token:

    pipeline = Pipeline(cfg, checkpoint.get("pipeline"))   # the pending batches a checkpoint saved, or none
    sampled = pipeline.advance(run, step)                   # the current sampler samples what is due now
    collected, versions = pipeline.take(step)               # this step's batch; each token's policy version

Versions: the policy after step v is version v (0: the starting policy); at step t the sampler is version t - 1,
and a token's lag is t - 1 minus its version. Problems are drawn from (seed, s) for the batch of step s whatever the
lag, so every lag trains on the same prompts at a step.

- fixed (``train.lag_mode``): step s's whole batch is sampled at step max(1, s - k) by version max(0, s - 1 - k),
  with the draws of the synchronous loop for step s (harness/loop/batch.py's ``collect_batch``). The first k + 1
  batches are all the starting policy's (rollout workers that start with it). k = 0 is the synchronous loop: the
  batch of step t sampled at step t, draw for draw.
- mixed: each group g of step s has its own lag l ~ U{0, ..., k} (drawn from (seed, s)) and is sampled at step
  max(1, s - l) by version max(0, s - 1 - l): the mixed ages a bounded-staleness buffer (AReaL's
  ``max_head_offpolicyness``) delivers. A step's groups due at one step are sampled together (a piece).
- in flight (``train.in_flight_tokens`` = m > 0, fixed mode): step s's batch is begun at step b = max(1, s - k) and
  continued by the sampler of every following step, m more tokens of each unfinished completion per step, the rest
  at step s: token j is sampled by version min(s - 1, b - 1 + floor(j / m)) (PipelineRL's in-flight weight updates,
  arXiv 2509.19128). Each continuation runs the newer policy on the whole prefix, so a token's behaviour log-prob is
  its own version's given the prefix; PipelineRL keeps the keys and values the older weights computed (its Fig. 7:
  a negligible difference), which no single version would give. A completion that ends early waits for its batch.

Everything pending is in the checkpoint as tensors and plain containers (``state_dict``), so a killed run resumes
with the same queue and continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from omegaconf import DictConfig
from torch import Tensor

from harness.loop.batch import (
    Collected,
    collect_batch,
    collected_round,
    drawn_problems,
    sampling_stats,
    scored_round,
    varied_groups,
    with_reference_rewards,
)
from harness.policy.routing import RoutingRecord
from harness.policy.sampler import Rollout, generate_ids, rollout_of, sample_problems, sampler_options, select_rows
from harness.run.checks import register_check
from harness.run.errors import ConfigError
from harness.run.seeding import step_seed
from objectives import ADVANTAGES, estimator_name
from objectives.advantages import needs_greedy_baseline, reference_samples

LAG_MODES = ("fixed", "mixed")
LAG_STREAM, PIECE_STREAM = 3, 4  # step_seed streams: the groups' lags (mixed); the pieces' and segments' draws


@register_check("rollout_lag")
def check_rollout_lag(run: DictConfig) -> None:
    """``train.rollout_lag``, ``train.lag_mode`` and ``train.in_flight_tokens``: in range, and what they cannot run
    with (a batch sampled in parts by several versions is neither refilled nor given a greedy baseline)."""
    t = run.train
    if t.rollout_lag < 0 or t.in_flight_tokens < 0:
        raise ConfigError(f"train.rollout_lag and train.in_flight_tokens must be >= 0, got {t.rollout_lag} and "
                          f"{t.in_flight_tokens}")
    if t.rollout_lag >= t.steps:
        raise ConfigError(f"train.rollout_lag={t.rollout_lag} is not below train.steps={t.steps}: from a lag of "
                          f"{t.steps - 1} on, every batch of a {t.steps}-step run is the starting policy's; set "
                          f"train.rollout_lag <= {t.steps - 1} or more train.steps")
    if t.lag_mode not in LAG_MODES:
        raise ConfigError(f"train.lag_mode must be one of {', '.join(LAG_MODES)}, got {t.lag_mode!r}")
    parts = "train.lag_mode=mixed" if t.lag_mode == "mixed" else "train.in_flight_tokens" if t.in_flight_tokens \
        else None
    if parts and t.rollout_lag < 1:
        fix = ("leave it out (TRL's GRPOTrainer runs no lag), or use backend=native with train.rollout_lag >= 1"
               if run.backend == "trl" else "set train.rollout_lag >= 1")
        raise ConfigError(f"{parts} spreads a batch over the versions of a lag: {fix}")
    if t.in_flight_tokens and (t.lag_mode == "mixed" or t.in_flight_tokens >= t.max_new_tokens):
        need = ("train.lag_mode=fixed (a mixed lag already spreads a batch over versions)" if t.lag_mode == "mixed"
                else f"a value below train.max_new_tokens={t.max_new_tokens}")
        raise ConfigError(f"train.in_flight_tokens={t.in_flight_tokens} switches a completion to the newer policy "
                          f"every that many tokens: it needs {need}")
    estimator = estimator_name(run.objective.name, run.objective.advantage)
    whole = needs_greedy_baseline(ADVANTAGES.get(estimator)) or reference_samples(ADVANTAGES.get(estimator))
    if parts and (t.dynamic_sampling or whole):
        raise ConfigError(f"{parts} samples a batch in parts by several policy versions, which train.dynamic_sampling "
                          f"(refill) and an estimator that samples its prompts again ({estimator!r}: a greedy "
                          "baseline, the reference's completions) cannot follow: use train.lag_mode=fixed without "
                          "in-flight updates")
    if t.in_flight_tokens and t.routing_replay == "r3":
        raise ConfigError("train.routing_replay=r3 replays the sampler's routing, which a completion sampled in "
                          "flight by several versions does not record: use r2 or none")


@dataclass
class Flight:
    """A batch begun and not finished (in-flight updates): the generation so far."""

    problems: list[int]  # the step's problems, as indices into the task's training problems
    prompt_ids: Tensor  # [N, P] left-padded, one row per completion
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, j] the tokens so far (the pad token after a row's EOS)
    sampler_logp: Tensor  # [N, j] their log-probs under the version that sampled each (0 after EOS)
    finished: Tensor  # [N] bool: the row drew its EOS
    segments: int = 1  # continuations drawn so far, counting the first


@dataclass
class Piece:
    """Groups of one step's batch, sampled (or, in flight, begun) at one step."""

    step: int  # the step that trains on it
    groups: list[int]  # its groups among the step's prompts_per_step, in order
    versions: Tensor  # [rows, T] int: the policy version that sampled each completion token
    collected: Collected | None = None  # complete: the rollout, rewards, statistics
    flight: Flight | None = None  # in flight: the generation so far


class Pipeline:
    """The pending batches of a run with ``train.rollout_lag`` (module docstring); empty at k = 0 between steps."""

    def __init__(self, cfg: DictConfig, state: dict | None = None):
        self.cfg, self.t = cfg, cfg.train
        self.pending: list[Piece] = [piece_from(p) for p in (state or {}).get("pending", [])]

    def lags(self, step: int) -> list[int]:
        """The lag of each group of step ``step``'s batch: ``rollout_lag`` (fixed), or drawn from (seed, step)."""
        t = self.t
        if t.lag_mode == "fixed":
            return [t.rollout_lag] * t.prompts_per_step
        rng = np.random.default_rng(step_seed(self.cfg.seed, step, stream=LAG_STREAM))
        return rng.integers(0, t.rollout_lag + 1, size=t.prompts_per_step).tolist()

    def advance(self, run, step: int) -> int:
        """Sample what is due at ``step`` with ``run.sampler`` (version step - 1): the groups of steps step ..
        step + k whose sampling step this is, and one segment of every batch in flight. Returns the completion
        tokens sampled."""
        sampled = 0
        for piece in [p for p in self.pending if p.flight is not None]:
            sampled += self.continued(run, piece, step)
        for target in range(step, min(step + self.t.rollout_lag, self.t.steps) + 1):
            groups = [g for g, lag in enumerate(self.lags(target)) if max(1, target - lag) == step]
            if groups:
                piece, tokens = self.begun(run, target, groups, step)
                self.pending.append(piece)
                sampled += tokens
        return sampled

    def begun(self, run, target: int, groups: list[int], step: int) -> tuple[Piece, int]:
        """The piece of ``target``'s ``groups`` sampled at ``step`` and the tokens drawn: whole (with the synchronous
        loop's draws when it is the whole batch), or the first segment of an in-flight batch."""
        cfg, t, version = self.cfg, self.t, step - 1
        seed = piece_seed(cfg.seed, target, target - step)
        if t.in_flight_tokens and target > step:
            return self.first_segment(run, target, seed, version)
        if len(groups) == t.prompts_per_step:
            collected = collect_batch(run.sampler, run.tokenizer, run.task, run.train_problems, cfg, target,
                                      greedy_baseline=needs_greedy_baseline(run.estimator))
            if reference_samples(run.estimator):  # A*-PO's V*: the reference's completions of the same prompts
                collected = with_reference_rewards(collected, run.reference, run.tokenizer, run.task, cfg, target,
                                                   reference_samples(run.estimator))
        else:
            collected = collect_batch(run.sampler, run.tokenizer, run.task, run.train_problems, cfg, target,
                                      subset=groups, sampling_seed=seed)
        piece = Piece(target, groups, versions_like(collected.rollout, version), collected=collected)
        return piece, collected.stats["sampled_tokens"]

    def first_segment(self, run, target: int, seed: int, version: int) -> tuple[Piece, int]:
        """An in-flight batch begun: its problems, the first ``in_flight_tokens`` tokens of every completion."""
        t = self.t
        problems = drawn_problems(np.random.default_rng(step_seed(self.cfg.seed, target)), len(run.train_problems),
                                  t).tolist()
        torch.manual_seed(seed)
        ro = sample_problems(run.sampler, run.tokenizer, [run.train_problems[i] for i in problems], t,
                             max_new_tokens=t.in_flight_tokens)
        flight = Flight(problems, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.sampler_logp, ~ro.truncated)
        piece = Piece(target, list(range(t.prompts_per_step)), versions_like(ro, version), flight=flight)
        return piece, int(ro.completion_mask.sum())

    def continued(self, run, piece: Piece, step: int) -> int:
        """One more segment of an in-flight batch by the sampler of ``step``: ``in_flight_tokens`` more tokens of each
        unfinished completion (all the rest at its own step, where it is finished and scored). Returns the tokens
        drawn."""
        t, flight, final = self.t, piece.flight, piece.step == step
        width = flight.completion_ids.shape[1]
        rows = (~flight.finished).nonzero()[:, 0]
        count = min(t.max_new_tokens - width, t.max_new_tokens if final else t.in_flight_tokens)
        drawn = 0
        if len(rows) and count > 0:
            torch.manual_seed(piece_seed(self.cfg.seed, piece.step, -flight.segments))
            prefix = torch.cat([flight.prompt_ids[rows], flight.completion_ids[rows]], 1)  # no EOS yet: no padding
            prefix_mask = torch.cat([flight.prompt_mask[rows], torch.ones_like(flight.completion_ids[rows])], 1)
            part = generate_ids(run.sampler, run.tokenizer, prefix, prefix_mask.to(flight.prompt_mask.dtype),
                                max_new_tokens=count, temperature=t.temperature, top_p=t.top_p, **sampler_options(t))
            extend(piece, rows, part, run.tokenizer.pad_token_id, step - 1)
            drawn = int(part.completion_mask.sum())
        flight.segments += 1
        if final:
            self.finish(run, piece)
        return drawn

    def finish(self, run, piece: Piece) -> None:
        """An in-flight batch complete: its rollout, scored, as a step's batch."""
        flight = piece.flight
        ro = rollout_of(run.tokenizer, flight.prompt_ids, flight.prompt_mask, flight.completion_ids,
                        flight.sampler_logp)
        round_ = scored_round(ro, [run.train_problems[i] for i in flight.problems], run.task, self.cfg)
        piece.collected, piece.flight = collected_round(round_, self.cfg), None

    def take(self, step: int, pad_token_id: int) -> tuple[Collected, Tensor]:
        """Step ``step``'s batch, its pieces assembled in group order, and the version of every token [N, T]."""
        pieces = [p for p in self.pending if p.step == step]
        self.pending = [p for p in self.pending if p.step != step]
        if len(pieces) == 1:
            return pieces[0].collected, pieces[0].versions
        return assembled(pieces, self.cfg, pad_token_id)

    def state_dict(self) -> dict:
        """The pending pieces as tensors and plain containers (a checkpoint loadable with ``weights_only=True``)."""
        return {"pending": [piece_state(p) for p in self.pending]}


def piece_seed(seed: int, step: int, part: int) -> int:
    """The draws of a part of step ``step``'s batch: part >= 0, the piece sampled ``part`` steps before the batch is
    due; part < 0, the in-flight continuation number -part."""
    return step_seed(step_seed(seed, step, stream=PIECE_STREAM), part)


def versions_like(ro: Rollout, version: int) -> Tensor:
    """[N, T] ``version`` on every completion position of ``ro`` (int32)."""
    return torch.full(ro.completion_ids.shape, version, dtype=torch.int32, device=ro.completion_ids.device)


def extend(piece: Piece, rows: Tensor, part: Rollout, pad_token_id: int, version: int) -> None:
    """Append ``part``'s completions (of the in-flight batch's unfinished ``rows``) to ``piece``'s generation."""
    flight, n, width = piece.flight, len(piece.versions), part.completion_ids.shape[1]

    def grown(old: Tensor, new: Tensor, fill) -> Tensor:
        wider = torch.cat([old, old.new_full((n, width), fill)], 1)
        wider[rows, old.shape[1]:] = new.to(old.dtype)
        return wider

    flight.completion_ids = grown(flight.completion_ids, part.completion_ids, pad_token_id)
    flight.sampler_logp = grown(flight.sampler_logp, part.sampler_logp, 0.0)
    piece.versions = grown(piece.versions, torch.full_like(part.completion_ids, version), -1)
    flight.finished[rows] = ~part.truncated


def assembled(pieces: list[Piece], cfg: DictConfig, pad_token_id: int) -> tuple[Collected, Tensor]:
    """A mixed-ages batch: its pieces' groups in order (rows re-padded), its statistics over the whole batch."""
    size = cfg.train.group_size
    where = {g: (k, i) for k, p in enumerate(pieces) for i, g in enumerate(p.groups)}
    rows = [(where[g][0], where[g][1] * size + j) for g in sorted(where) for j in range(size)]
    parts = [p.collected for p in pieces]
    rollout = select_rows([c.rollout for c in parts], rows, pad_token_id)
    rewards = torch.stack([parts[k].rewards[i] for k, i in rows])
    components = torch.stack([parts[k].components[i] for k, i in rows])
    width = rollout.completion_ids.shape[1]
    versions = torch.stack([torch.nn.functional.pad(pieces[k].versions[i], (0, width - pieces[k].versions.shape[1]),
                                                    value=-1) for k, i in rows])
    zero_std = sum(not varied for varied in varied_groups(rewards, size))
    stats = sampling_stats([rollout], rewards, components, zero_std_groups=zero_std, groups=len(where))
    return Collected(rollout, rewards, stats, None, components, parts[0].weights), versions


def lag_metrics(versions: Tensor, mask: Tensor, step: int) -> dict[str, float]:
    """The version lag of the step's valid completion tokens: step - 1 minus the version that sampled each (mean,
    max)."""
    lag = (step - 1 - versions.to(mask.device))[mask.bool()].float()
    return {"lag_mean": lag.mean().item(), "lag_max": lag.max().item()} if lag.numel() else {}


ROLLOUT_TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampler_logp", "truncated")


def piece_state(piece: Piece) -> dict:
    """A piece as tensors and plain containers."""
    state = {"step": piece.step, "groups": list(piece.groups), "versions": piece.versions}
    if piece.collected is not None:
        c = piece.collected
        state["collected"] = {"rollout": rollout_state(c.rollout), "rewards": c.rewards, "stats": dict(c.stats),
                              "baselines": c.baselines, "components": c.components, "weights": c.weights,
                              "reference_rewards": c.reference_rewards}
    if piece.flight is not None:
        state["flight"] = dataclasses.asdict(piece.flight)
    return state


def piece_from(state: dict) -> Piece:
    """:func:`piece_state`'s inverse."""
    collected = state.get("collected")
    if collected is not None:
        collected = Collected(rollout_from(collected["rollout"]), collected["rewards"], dict(collected["stats"]),
                              collected["baselines"], collected["components"], collected["weights"],
                              reference_rewards=collected.get("reference_rewards"))
    flight = Flight(**state["flight"]) if state.get("flight") is not None else None
    return Piece(state["step"], list(state["groups"]), state["versions"], collected, flight)


def rollout_state(ro: Rollout) -> dict:
    """A rollout as tensors and plain containers (its MoE routing record, if any, too)."""
    routing = None if ro.routing is None else {"indices": ro.routing.indices, "layers": list(ro.routing.layers),
                                               "prompt_width": ro.routing.prompt_width,
                                               "num_experts": ro.routing.num_experts}
    return {**{name: getattr(ro, name) for name in ROLLOUT_TENSORS}, "texts": list(ro.texts), "routing": routing}


def rollout_from(state: dict) -> Rollout:
    """:func:`rollout_state`'s inverse."""
    routing = state["routing"]
    if routing is not None:
        routing = RoutingRecord(routing["indices"], tuple(routing["layers"]), routing["prompt_width"],
                                routing["num_experts"])
    return Rollout(**{name: state[name] for name in ROLLOUT_TENSORS}, texts=list(state["texts"]), routing=routing)
