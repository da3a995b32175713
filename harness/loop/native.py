"""The native backend: the one shared rollout/update loop. Every objective runs through exactly this code.

    summary = train(cfg, run_dir)        # setup, step 0's evaluation, then per step:
      1. rollout: ``prompts_per_step`` problems, ``group_size`` completions each from the sampler, with its per-token
         log-probs; scored, rewards shaped (with dynamic sampling: until the batch holds informative groups); for
         ReMax also one greedy completion per prompt, its reward the baseline; for A*-PO the reference policy's
         completions of each prompt, their rewards its V*; the reward's components (GDPO). With
         ``train.rollout_lag`` = k the batch trained is the one sampled k steps earlier (harness/loop/pipeline.py:
         a queue of pending batches, each token's policy version kept), and this step samples the batches due now;
      2. old log-probs: the behaviour's (the sampler's) or the proximal policy's (the trainer's before this update,
         recomputed; always with a rollout correction, whose weights, proximal against behaviour, come here),
         reference log-probs when the objective's beta > 0 or it reads them (A*-PO), the old policy's sum pi^2 when
         the estimator reads it;
      3. advantages from the estimator (group = prompt);
      4. for each epoch, for each minibatch: the loss over its micro-batches, one optimizer step (:func:`update`);
      5. every ``eval_every`` steps and at the end: the held-out evaluation;
      6. one JSON line of metrics, summary.json, a checkpoint (the pending lagged batches in it) every ``save_every``
         steps; at the end the policy in transformers' format under <run_dir>/final/ (and every ``export_every``
         steps under exports/step_<N>/); a LoRA policy: its adapters in peft's format (harness/policy/lora.py), the
         merged model on request.

The random streams are re-seeded from (seed, step), so a resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from torch import Tensor
from tqdm import tqdm

from harness.loop.batch import Collected, TrainBatch
from harness.loop.behaviour import Behaviour, behaviour_logprobs
from harness.loop.build import RunSetup, build_learner, hook_routing, setup_run
from harness.loop.evaluation import evaluate
from harness.loop.metrics import MetricMeter, MismatchMeter, PhaseMemory, progress_fields
from harness.loop.pipeline import Pipeline, lag_metrics
from harness.loop.update import (
    Learner,
    RunState,
    Timings,
    UpdatePlan,
    microbatch_loss,
    minibatches,
    optimizer_step,
    timed,
    with_statistics,
)
from harness.policy.device import resolve_device
from harness.policy.expert_volatility import merge_volatility
from harness.policy.lora import export_merged, load_trained_state, trained_state
from harness.policy.matmul import cpu_matmul
from harness.run.offpolicy import lagged
from harness.run.records import RunRecords, export_policy, learner_parts, load_checkpoint, save_checkpoint
from harness.run.threads import run_threads
from objectives.advantages import (
    needs_greedy_baseline,
    needs_reward_components,
    needs_sum_pi_squared,
    reference_samples,
)


def train(cfg: DictConfig, run_dir: Path, progress: bool = True) -> dict:
    """Train one run into ``run_dir`` (resuming from its checkpoint if there is one); returns the summary."""
    t = cfg.train
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    checkpoint, checkpoint_path = load_checkpoint(run_dir, device)
    state = RunState.resumed(checkpoint, t)
    records = RunRecords(cfg, run_dir, resume_step=state.step if checkpoint else None, start_policy=None,
                         backend="native", checkpoint=str(checkpoint_path))
    count(records, state)
    records.progress["threads"] = run_threads(cfg.threads, records.previous.get("threads"))  # a resume keeps them
    with records.recording():
        # setup: task, starting policy, objective, frozen copies (harness/loop/build.py); AdamW and its schedule
        run = setup_run(cfg, device, progress)
        hook_routing(run, t)  # an MoE's routing hooks (record, replay, volatility)
        records.start_policy = run.start_policy
        records.check_begun_on(run.task_data, run.start_weights)  # a resume on other problems or weights: refused
        learner = build_learner(run.policy, run.objective, t)
        if checkpoint:
            load_trained_state(learner.policy, checkpoint["policy"])  # the weights, or a LoRA policy's adapters
            for part in learner_parts(t, state.step):  # none in a run's last checkpoint (harness/run/records.py)
                getattr(learner, part).load_state_dict(checkpoint[part])
            learner.objective.load_state_dict(checkpoint.get("objective", {}))  # its own state (POPO's), if any
        pipeline = Pipeline(cfg, checkpoint.get("pipeline") if checkpoint else None)  # the batches sampled ahead
        bar = tqdm(total=t.steps, initial=state.step, desc=run_dir.name, unit="step", disable=not progress,
                   leave=False)
        # the run's linear layers on the kernel of train.cpu_matmul (the warm start pins its own); the bar is closed
        # however the loop ends (Ctrl-C's line then starts a line of its own, not the bar's)
        with cpu_matmul(t.cpu_matmul), bar:
            if state.step == 0:  # the starting policy's evaluation is step 0
                evaluation, samples = evaluated(run, cfg, 0)
                records.log({"step": 0, **evaluation}, samples)
            status = "finished"
            for step in range(state.step + 1, t.steps + 1):
                # 1-4. rollout, behaviour log-probs, advantages, update
                row = train_step(run, learner, cfg, step, state, pipeline)
                # 5. evaluation
                samples = None
                if step == t.steps or (t.eval_every and step % t.eval_every == 0):
                    evaluation, samples = evaluated(run, cfg, step)
                    row.update(evaluation)
                # 6. records and checkpoint
                count(records, state)
                records.log(row, samples)
                bar.update(1)
                bar.set_postfix(progress_fields(row, records.rows))
                if state.nonfinite_in_row >= t.max_nonfinite_in_row:  # diverged: the records so far stay as they are
                    status = "diverged"
                    tqdm.write(diverged_message(state, step), file=sys.stderr)
                    break
                if t.export_every and step % t.export_every == 0:  # before the checkpoint: a kill between redoes both
                    export_policy(run.policy, run.tokenizer, run_dir / "exports" / f"step_{step}")
                if step == t.steps or (t.save_every and step % t.save_every == 0):
                    save_checkpoint(run_dir, {"policy": trained_state(learner.policy),
                                              **{part: getattr(learner, part).state_dict()
                                                 for part in learner_parts(t, step)},
                                              "objective": learner.objective.state_dict(),
                                              "pipeline": pipeline.state_dict(), "state": dataclasses.asdict(state)})
        if records.main and status == "finished":
            export_policy(run.policy, run.tokenizer, run_dir / "final")  # a LoRA policy: its adapters
            if cfg.model.lora.export_merged:
                export_merged(run.policy, run.tokenizer, run_dir / "final" / "merged")
    return records.end(status)  # summary.json; the checkpoints no run reads again removed (records.py)


def diverged_message(state: RunState, step: int) -> str:
    """The line a diverged run ends with: what diverged, and where to look (not the learning rate when no update
    was ever applied: the loss or gradient is then not finite at the starting policy)."""
    where = ("no update was applied yet, so the learning rate is not the cause: the objective's loss or gradient is "
             "not finite at the starting policy; check the objective and its inputs") \
        if state.optimizer_steps == state.nonfinite_skips \
        else "a lower train.lr, or check the objective's inputs"
    return (f"diverged: {state.nonfinite_in_row} updates in a row had a non-finite loss or gradient (step {step}); "
            f"the run stops here ({where})")


def train_step(run: RunSetup, learner: Learner, cfg: DictConfig, step: int, state: RunState,
               pipeline: Pipeline) -> dict:
    """Stages 1-4 of rollout step ``step`` (module docstring); returns its metrics row."""
    t = cfg.train
    # 1. rollout and rewards: the sampler (a copy in model.sampler_dtype refreshed from the policy, or itself) samples
    # what is due now; the batch trained is the one due now, sampled train.rollout_lag steps ago (0: just now)
    t0, memory = time.time(), PhaseMemory(run.device)
    memory.start("rollout")
    if run.sampler is not run.policy:
        run.sampler.load_state_dict(run.policy.state_dict())
    sampled_now = pipeline.advance(run, step)
    collected, versions = pipeline.take(step, run.tokenizer.pad_token_id)
    ro, rewards, sampled = collected.rollout, collected.rewards, collected.stats
    lag = lag_metrics(versions, ro.completion_mask, step) if lagged(t) else {}  # each token's version lag
    rollout_s = time.time() - t0
    # 2-3. old log-probs (the behaviour's, or the proximal's), reference log-probs, rollout-correction weights
    # (harness/loop/behaviour.py); advantages (group = prompt; the completion lengths for the estimators that weigh
    # by tokens; the old policy's sum pi^2 for those that read it)
    t1 = time.time()
    memory.start("update")
    rewards = rewards.to(run.device)
    group_ids = torch.arange(t.prompts_per_step, device=run.device).repeat_interleave(t.group_size)
    separate = run.sampler is not run.policy or lag.get("lag_max", 0) > 0  # another precision or an older version
    behaviour = behaviour_logprobs(run.policy, run.reference, ro, cfg, separate,
                                   with_sum_pi_squared=needs_sum_pi_squared(run.estimator))
    advantages = estimated(run.estimator, collected, group_ids, behaviour).to(run.device)
    batch = TrainBatch(ro, rewards, advantages, group_ids, behaviour.old_logp, behaviour.ref_logp,
                       behaviour.correction, behaviour.routing)
    # 4. for each epoch, for each minibatch: loss, optimizer step
    timings = Timings()
    stats = update(learner, UpdatePlan.of(batch, cfg, step, timings), state)
    learner.objective.after_update(stats, len(rewards))  # an adaptive coefficient moves once per rollout step
    update_s = time.time() - t1
    tokens, sampled_tokens = int(ro.completion_mask.sum()), sampled.pop("sampled_tokens")
    state.step = step
    state.rollout_tokens += sampled_tokens
    state.update_tokens += tokens * t.epochs
    return {"step": step, "rollout_tokens": state.rollout_tokens, **sampled, **lag,
            **advantage_metrics(advantages, ro.completion_mask),
            **stats, **behaviour.metrics, "lr": learner.scheduler.get_last_lr()[0],
            "nonfinite_skips": state.nonfinite_skips, "rollout_s": rollout_s, "update_s": update_s,
            **timings.metrics(), "rollout_tok_s": sampled_now / rollout_s,
            "update_tok_s": tokens * t.epochs / update_s, **memory.metrics()}


def estimated(estimator, collected: Collected, group_ids: Tensor, behaviour: Behaviour) -> Tensor:
    """The step's advantages, [N] or (an estimator that reads the old policy's sum pi^2) [N, T], given what the
    estimator reads (``objectives.advantages.loop_inputs``): the greedy completions' rewards (ReMax), the reference
    policy's completions' rewards (A*-PO), the reward's components (GDPO), the old policy's per-token distribution (the
    optimal token baseline)."""
    ro, device = collected.rollout, group_ids.device
    rewards, lengths = collected.rewards.to(device), ro.completion_mask.sum(-1).to(device)
    if needs_greedy_baseline(estimator):
        return estimator(rewards, group_ids, lengths, baselines=collected.baselines.to(device))
    if reference_samples(estimator):
        return estimator(rewards, group_ids, lengths, reference_rewards=collected.reference_rewards.to(device))
    if needs_reward_components(estimator):
        return estimator(rewards, group_ids, lengths, components=collected.components.to(device),
                         weights=collected.weights)
    if needs_sum_pi_squared(estimator):
        return estimator(rewards, group_ids, lengths, old_logp=behaviour.trainer_logp,
                         sum_pi_squared=behaviour.sum_pi_squared, mask=ro.completion_mask.to(device),
                         correction=behaviour.correction)
    return estimator(rewards, group_ids, lengths)


def advantage_metrics(advantages: Tensor, mask: Tensor) -> dict:
    """Mean and std of the advantages: per sequence, or (token-level [N, T]) over the valid tokens."""
    values = advantages[mask.bool().to(advantages.device)] if advantages.dim() == 2 else advantages
    return {"adv_mean": values.mean().item(), "adv_std": values.std().item()}


def update(learner: Learner, plan: UpdatePlan, state: RunState) -> dict:
    """``epochs`` passes x ``num_minibatches`` optimizer steps over one rollout batch; returns the step's metrics
    (the objective's, entropy, loss, grad norm; the sampler/trainer mismatch of the first minibatch when the
    behaviour log-probs are the sampler's; an MoE's expert volatility over all its forwards, expert-load entropy and
    router aux loss)."""
    generator = torch.Generator().manual_seed(plan.order_seed)
    shares = learner.objective.minibatch_shares()  # pg_loss and the like: summed over an optimizer step
    meter, mismatch, volatility = MetricMeter(shares), MismatchMeter(ess=plan.lagged), []
    learner.policy.train()
    for epoch in range(plan.epochs):
        for k, minibatch in enumerate(minibatches(plan, generator)):  # a new order each epoch, groups whole
            learner.optimizer.zero_grad(set_to_none=True)
            minibatch = with_statistics(learner, plan, minibatch, state)  # P3O's statistics, when micro-batched
            loss, window = 0.0, MetricMeter(shares)  # the optimizer step's own metrics, for the objective's hook
            step_tokens = minibatch.num_tokens.item()  # the micro-batches' shares (pg_loss) sum to the step's value
            for rows in plan.microbatches(minibatch):  # forward, objective, backward
                part = microbatch_loss(learner, plan, minibatch, rows, state, with_entropy=epoch == 0)
                if epoch == 0 and k == 0 and plan.behaviour == "sampler":
                    ro, forward = plan.batch.rollout, part.forward
                    mismatch.add(ro.sampler_logp[rows, :forward.width], forward.logp, forward.mask)
                loss += part.loss
                meter.add(part.metrics, part.tokens, step_tokens)
                window.add(part.metrics, part.tokens, step_tokens)
                volatility += [] if part.forward.volatility is None else [part.forward.volatility]
            with timed(plan.timings, "optimizer_s"):  # clip, skip if non-finite, step
                grad_norm = optimizer_step(learner, loss, plan.max_grad_norm, state, window.result())
            meter.add({"loss": loss, "grad_norm": grad_norm}, 1.0)
    # the last step's gradients (as large as the trained weights) are not held through the rollout and evaluation
    # that follow; every minibatch starts from none anyway
    learner.optimizer.zero_grad(set_to_none=True)
    routing = merge_volatility(volatility).metrics() if volatility else {}  # an MoE's, over every update forward
    return {**meter.result(), **mismatch.result(), **routing}


def evaluated(run: RunSetup, cfg: DictConfig, step: int) -> tuple[dict, list[dict]]:
    """The held-out evaluation's metrics at ``step`` (with its seconds, ``eval_s``, and peak memory,
    ``peak_mem_eval_mb``) and its samples."""
    start, memory = time.time(), PhaseMemory(run.device)
    memory.start("eval")
    row, samples = evaluate(run.policy, run.tokenizer, run.task, cfg, step)
    return {**row, "eval_s": time.time() - start, **memory.metrics(total=False)}, samples


def count(records: RunRecords, state: RunState) -> None:
    """The run's counters into summary.json's progress."""
    records.progress.update(rollout_tokens=state.rollout_tokens, update_tokens=state.update_tokens,
                            nonfinite_skips=state.nonfinite_skips)
