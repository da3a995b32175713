"""How much one optimizer step moves a Mixture-of-Experts policy's routing: GSPO's claim of "about 10%
of the experts a token activates change after one RL gradient update of the 48-layer Qwen3-30B-A3B, more in deeper
models" (arXiv 2507.18071, §5.3), measured on tiny_moe at several depths.

    rows = volatility_by_depth(UpdateProbe(depths=(2, 4, 8), lrs=(5e-5,)), task)   # one dict per (depth, seed, lr)
    python -m harness.apps.moe_probe --depths 2 4 8 --sft-steps 200                     # the same, printed as a table

Per (depth, seed): a tiny_moe of that depth (init seed = seed; the other shape knobs from ``UpdateProbe.spec``),
optionally ``sft_steps`` of the cached supervised warm start on the task's solutions (harness.policy.warm_start,
exactly that many steps: "briefly trained"; 0 = random weights, whose near-uniform routers flip on small
changes). Then per learning rate, on a copy: sample ``group_size`` completions of ``prompts`` train prompts (the
native sampler), record the routing of every real prompt and completion token in a teacher-forced forward, take ONE
step of a fresh AdamW (no weight decay) on a GRPO-form loss (token-mean of -A x log p, A = group-standardised
rewards), record again, compare (harness/policy/expert_volatility.py).

Our reading, with the alternatives:
* rewards are standard-normal draws per completion (seeded), not the task's correctness: a briefly trained tiny
  policy solves almost nothing, so correctness would give no gradient; a fresh AdamW's first step moves every
  weight by lr x sign(its gradient) whatever the rewards' meaning, so the reward changes the direction, not the
  size, of the step (the alternative, the task's reward after a full warm start, is phase 2's ledger run);
* a fresh optimizer's first step is the largest step the learning rate allows (|update| = lr per weight); a warm
  AdamW mid-run moves weights by less, so this is an upper end for the paper's setting at the same lr;
* every real token counts (prompt and completion): each one's routing shapes the completion's log-probs.
"""

from __future__ import annotations

import argparse
import copy
import random
from dataclasses import dataclass, field

import torch

from harness.policy.architecture import positions
from harness.policy.expert_volatility import expert_load_entropy, expert_volatility
from harness.policy.forward import completion_logprobs
from harness.policy.models import build_prompt, char_tokenizer
from harness.policy.routing import Grid, Routing, RoutingRecord, full_layout
from harness.policy.sampler import Rollout, generate
from harness.policy.tiny_moe import build_tiny_moe
from harness.policy.warm_start import WarmStartRecipe, warm_start
from harness.run.shapes import TinyMoeSpec
from harness.run.threads import run_threads
from harness.tasks import Task, get_task


@dataclass(frozen=True)
class UpdateProbe:
    """What :func:`volatility_by_depth` measures (module docstring)."""

    depths: tuple[int, ...] = (2, 4, 8)  # tiny_moe num_layers
    seeds: tuple[int, ...] = (0,)  # model init, warm start, prompts, samples and rewards
    lrs: tuple[float, ...] = (5e-5,)  # the one step's AdamW learning rate (quickstart's RL lr: 5e-5)
    sft_steps: int = 0  # warm-start steps before the probe (0: random weights)
    sft_lr: float = 1e-3
    prompts: int = 16
    group_size: int = 8
    max_new_tokens: int = 24
    spec: dict = field(default_factory=dict)  # other TinyMoeSpec fields (hidden_size, num_experts, top_k, ...)

    def __post_init__(self):
        """Each setting in its range (ValueError naming it), so that a probe that cannot run fails before its warm
        starts, not after."""
        for name, low in (("depths", 1), ("seeds", 0)):
            values = getattr(self, name)
            if not (isinstance(values, tuple) and values and all(_whole(v, low) for v in values)):
                raise ValueError(f"{name} must be a non-empty list of whole numbers >= {low}, got {values!r}")
        if not (isinstance(self.lrs, tuple) and self.lrs and all(map(_positive, self.lrs))):
            raise ValueError(f"lrs must be a non-empty list of positive numbers, got {self.lrs!r}")
        if not _positive(self.sft_lr):
            raise ValueError(f"sft_lr must be a positive number, got {self.sft_lr!r}")
        for name, low in (("sft_steps", 0), ("prompts", 1), ("group_size", 2), ("max_new_tokens", 1)):
            if not _whole(getattr(self, name), low):
                raise ValueError(f"{name} must be a whole number >= {low}, got {getattr(self, name)!r}")
        if not isinstance(self.spec, dict):
            raise ValueError(f"spec must be a mapping of TinyMoeSpec fields, got {self.spec!r}")
        TinyMoeSpec(**{**self.spec, "num_layers": self.depths[0]}).check()  # its own fields' checks


def _whole(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _positive(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < float("inf")


def teacher_forced_record(model, routing: Routing, ro: Rollout) -> RoutingRecord:
    """The routing of the rollout's real tokens in one no-grad forward over [prompt | completion]."""
    ids = torch.cat([ro.prompt_ids, ro.completion_ids], 1)
    mask = torch.cat([ro.prompt_mask, ro.completion_mask.to(ro.prompt_mask.dtype)], 1)
    with torch.no_grad(), routing.capture(Grid(*ids.shape, ro.prompt_ids.shape[1])) as cap:
        with routing.tokens(full_layout(mask)):
            model(ids, attention_mask=mask, position_ids=positions(mask), use_cache=False)
    return cap.record


def one_step(model, ro: Rollout, lr: float, group_size: int, seed: int) -> float:
    """One fresh-AdamW step of the GRPO-form token-mean loss with random group-standardised rewards; the loss."""
    rewards = torch.randn(len(ro.texts), generator=torch.Generator().manual_seed(seed)).view(-1, group_size)
    advantages = ((rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)).flatten()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    logp, _ = completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    mask = ro.completion_mask.float()
    loss = -(advantages[:, None] * logp * mask).sum() / mask.sum()
    loss.backward()
    optimizer.step()
    model.eval()
    return loss.item()


def one_update_volatility(model, tokenizer, prompts: list[str], *, lr: float, group_size: int, max_new_tokens: int,
                          seed: int) -> dict[str, float]:
    """Sample, record, one optimizer step (:func:`one_step`, on ``model`` itself), record again: the volatility
    metrics over every real token, the load entropy before and after, and the sampled tokens."""
    routing = Routing(model)
    try:
        torch.manual_seed(seed)
        ro = generate(model, tokenizer, prompts, group_size=group_size, max_new_tokens=max_new_tokens)
        before = teacher_forced_record(model, routing, ro)
        loss = one_step(model, ro, lr, group_size, seed)
        after = teacher_forced_record(model, routing, ro)
    finally:
        routing.close()
    return {**expert_volatility(before, after).metrics(), "load_entropy_before": expert_load_entropy(before),
            "load_entropy_after": expert_load_entropy(after), "loss": loss,
            "completion_tokens": float(ro.completion_mask.sum())}


def probe_model(depth: int, seed: int, probe: UpdateProbe, task: Task):
    """tiny_moe of ``depth`` layers (init ``seed``) after ``probe.sft_steps`` warm-start steps, and its tokenizer."""
    tokenizer = char_tokenizer()
    model = build_tiny_moe(tokenizer, TinyMoeSpec(**{**probe.spec, "num_layers": depth}), seed)
    if probe.sft_steps:
        model, _ = warm_start(model, tokenizer, task,
                              WarmStartRecipe(max_steps=probe.sft_steps, lr=probe.sft_lr, batch_size=32, seed=seed))
    return model, tokenizer


def volatility_by_depth(probe: UpdateProbe, task: Task) -> list[dict]:
    """One row per (depth, seed, lr): the probe's settings and :func:`one_update_volatility`'s metrics."""
    rows = []
    problems = list(task.train_problems())
    for depth in probe.depths:
        for seed in probe.seeds:
            model, tokenizer = probe_model(depth, seed, probe, task)
            chosen = random.Random(seed).sample(problems, probe.prompts)
            prompts = [build_prompt(tokenizer, problem.question) for problem in chosen]
            for lr in probe.lrs:
                metrics = one_update_volatility(copy.deepcopy(model), tokenizer, prompts, lr=lr,
                                                group_size=probe.group_size, max_new_tokens=probe.max_new_tokens,
                                                seed=seed)
                rows.append({"layers": depth, "seed": seed, "lr": lr, "sft_steps": probe.sft_steps,
                             "experts": model.config.num_experts, "top_k": model.config.num_experts_per_tok,
                             **metrics})
    return rows


def probe_task() -> Task:
    """The probe's task: quickstart's arith (2 operands, 2 digits, + and -)."""
    return get_task("arith", eval_size=128, num_operands=2, digits=2, operators="+-")


def main(argv: list[str] | None = None) -> None:
    """Print :func:`volatility_by_depth`'s rows on the arith task (quickstart's: 2 operands, 2 digits, + and -)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-5])
    parser.add_argument("--sft-steps", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    run_threads(args.threads)
    task = probe_task()
    probe = UpdateProbe(depths=tuple(args.depths), seeds=tuple(args.seeds), lrs=tuple(args.lrs),
                        sft_steps=args.sft_steps)
    keys = ("layers", "seed", "lr", "sft_steps", "expert_changed_frac", "expert_token_changed_frac",
            "expert_layer_changed_max", "load_entropy_before", "routed_tokens")
    print("\t".join(keys))
    for row in volatility_by_depth(probe, task):
        print("\t".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in keys), flush=True)


if __name__ == "__main__":
    main()
