"""The native backend: the one shared rollout/update loop. Every objective runs through exactly this code.

Per step:
  1. draw ``prompts_per_step`` problems; sample ``group_size`` completions each, keeping the sampler's per-token
     log-probs; score them (with dynamic sampling: until the batch holds informative groups);
  2. advantages from the estimator (group = prompt);
  3. behaviour log-probs: the sampler's, or recomputed by the trainer before the first update (always with a
     rollout correction, whose weights between the trainer's and the sampler's log-probs are computed here);
     reference log-probs when the objective's beta > 0;
  4. ``epochs`` passes over the batch, ``num_minibatches`` optimizer steps each (harness/loop/update.py);
  5. every ``eval_every`` steps and at the end: the held-out evaluation (harness/loop/evaluation.py);
  6. one JSON line of metrics, summary.json, and a checkpoint every ``save_every`` steps (harness/run/records.py);
     at the end the policy in transformers' format under <run_dir>/final/ (and every ``export_every`` steps under
     <run_dir>/exports/step_<N>/).
The random streams are re-seeded from (seed, step), so a resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from harness.loop.batch import TrainBatch, collect_batch
from harness.loop.build import build_objective, build_optimizer, build_policy, build_scheduler, build_task, frozen_copy
from harness.loop.evaluation import evaluate
from harness.loop.metrics import MismatchMeter, peak_memory_mb, progress_fields
from harness.loop.update import RunState, behaviour_logp, rollout_correction, update
from harness.policy.device import DTYPES, resolve_device
from harness.policy.forward import completion_logprobs
from harness.run.records import RunRecords, export_policy, load_checkpoint, save_checkpoint
from harness.run.threads import run_threads


class NonFiniteError(RuntimeError):
    pass


def train(cfg: DictConfig, run_dir: Path, progress: bool = True) -> dict:
    """Train one run into ``run_dir`` (resuming from its checkpoint if there is one); returns the summary."""
    t = cfg.train
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    checkpoint, checkpoint_path = load_checkpoint(run_dir, device)
    fields = {f.name for f in dataclasses.fields(RunState)}
    state = RunState(**{k: v for k, v in checkpoint["state"].items() if k in fields}) if checkpoint else RunState()
    state.total_optimizer_steps = t.steps * t.epochs * t.num_minibatches
    records = RunRecords(cfg, run_dir, resume_step=state.step if checkpoint else None, start_policy=None,
                         backend="native", checkpoint=str(checkpoint_path))
    records.progress.update(rollout_tokens=state.rollout_tokens, update_tokens=state.update_tokens,
                            nonfinite_skips=state.nonfinite_skips)
    records.progress["threads"] = run_threads(cfg.threads, records.previous.get("threads"))  # a resume keeps them
    with records.recording():
        # setup: task, starting policy, objective, frozen copies, optimizer
        task = build_task(cfg)
        train_problems = task.train_problems()
        policy, tokenizer, records.start_policy = build_policy(cfg, task, device)
        objective, estimator = build_objective(cfg)
        reference = frozen_copy(policy) if objective.beta > 0 else None
        different_sampler = cfg.model.sampler_dtype not in (None, cfg.model.dtype)
        sampler = frozen_copy(policy, DTYPES[cfg.model.sampler_dtype]) if different_sampler else policy
        optimizer = build_optimizer(policy.parameters(), t)
        scheduler = build_scheduler(optimizer, t)
        if checkpoint:
            policy.load_state_dict(checkpoint["policy"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
        bar = tqdm(total=t.steps, initial=state.step, desc=run_dir.name, unit="step", disable=not progress,
                   leave=False)
        if state.step == 0:  # the starting policy's evaluation
            t0 = time.time()
            row, samples = evaluate(policy, tokenizer, task, cfg, 0)
            records.log({"step": 0, **row, "eval_s": time.time() - t0}, samples)
        for step in range(state.step + 1, t.steps + 1):
            # 1. rollout and rewards
            t0 = time.time()
            if sampler is not policy:
                sampler.load_state_dict(policy.state_dict())
            ro, rewards, sampled = collect_batch(sampler, tokenizer, task, train_problems, cfg, step)
            rollout_s = time.time() - t0
            # 2. advantages (group = prompt)
            rewards = rewards.to(device)
            group_ids = torch.arange(t.prompts_per_step, device=device).repeat_interleave(t.group_size)
            advantages = estimator(rewards, group_ids).to(device)
            # 3. behaviour and reference log-probs, rollout-correction weights
            t1 = time.time()
            chunk = t.micro_batch_size or len(ro.texts) // t.num_minibatches
            old_logp, recompute_mismatch = ro.sampler_logp, {}
            if behaviour_logp(t) == "recompute":
                old_logp = no_grad_logprobs(policy, ro, t.temperature, chunk, t.padding_free)
                meter = MismatchMeter()
                meter.add(ro.sampler_logp, old_logp, ro.completion_mask)
                recompute_mismatch = meter.result()
            correction, correction_stats = rollout_correction(
                t, old_logp, ro.sampler_logp if different_sampler else None, ro.completion_mask)
            ref_logp = (None if reference is None
                        else no_grad_logprobs(reference, ro, t.temperature, chunk, t.padding_free))
            batch = TrainBatch(ro, rewards, advantages, group_ids, old_logp, ref_logp, correction)
            # 4. update
            timings: dict[str, float] = {}
            stats = update(policy, optimizer, scheduler, objective, batch, cfg, step, state, timings)
            update_s = time.time() - t1
            tokens, sampled_tokens = int(ro.completion_mask.sum()), sampled.pop("sampled_tokens")
            state.step = step
            state.rollout_tokens += sampled_tokens
            state.update_tokens += tokens * t.epochs
            row = {"step": step, "rollout_tokens": state.rollout_tokens, **sampled,
                   "adv_mean": advantages.mean().item(), "adv_std": advantages.std().item(),
                   **stats, **recompute_mismatch, **correction_stats, "lr": scheduler.get_last_lr()[0],
                   "nonfinite_skips": state.nonfinite_skips, "rollout_s": rollout_s, "update_s": update_s,
                   **{f"update_{key}": value for key, value in timings.items()},
                   "rollout_tok_s": sampled_tokens / rollout_s, "update_tok_s": tokens * t.epochs / update_s,
                   "peak_mem_mb": peak_memory_mb(device)}
            # 5. evaluation
            samples = None
            if step == t.steps or (t.eval_every and step % t.eval_every == 0):
                t2 = time.time()
                evaluation, samples = evaluate(policy, tokenizer, task, cfg, step)
                row.update(evaluation, eval_s=time.time() - t2)
            # 6. records and checkpoint
            records.progress.update(rollout_tokens=state.rollout_tokens, update_tokens=state.update_tokens,
                                    nonfinite_skips=state.nonfinite_skips)
            records.log(row, samples)
            bar.update(1)
            bar.set_postfix(progress_fields(row, records.rows))
            if state.nonfinite_in_row >= t.max_nonfinite_in_row:
                raise NonFiniteError(f"{state.nonfinite_in_row} updates in a row had a non-finite loss or "
                                     f"gradient (step {step}); lower train.lr or check the objective's inputs")
            if t.export_every and step % t.export_every == 0:  # before the checkpoint: a kill between redoes both
                export_policy(policy, tokenizer, run_dir / "exports" / f"step_{step}")
            if step == t.steps or (t.save_every and step % t.save_every == 0):
                save_checkpoint(run_dir, {"policy": policy.state_dict(), "optimizer": optimizer.state_dict(),
                                          "scheduler": scheduler.state_dict(), "state": dataclasses.asdict(state)})
        bar.close()
        if records.main:
            export_policy(policy, tokenizer, run_dir / "final")
    return records.summary("finished")


@torch.no_grad()
def no_grad_logprobs(model, ro, temperature: float, chunk: int, padding_free: bool = True) -> torch.Tensor:
    """Completion log-probs of the whole rollout under ``model``, ``chunk`` rows at a time."""
    return torch.cat([completion_logprobs(model, ro.prompt_ids[i : i + chunk], ro.prompt_mask[i : i + chunk],
                                          ro.completion_ids[i : i + chunk], ro.completion_mask[i : i + chunk],
                                          temperature, padding_free=padding_free)[0]
                      for i in range(0, len(ro.texts), chunk)])
