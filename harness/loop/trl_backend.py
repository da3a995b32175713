"""``backend: trl``: an experiment run through TRL's ``GRPOTrainer``, with the registry's objective as its loss.

    python -m harness train quickstart backend=trl                  # this machine (CPU or one GPU)
    accelerate launch --config_file <ds or fsdp>.yaml -m harness train <exp> backend=trl   # many GPUs

Tasks, rewards, models and the results layout are the native loop's: ``results/<exp>/<run_id>/`` gets
``config.yaml``, ``metrics.jsonl`` (one row per rollout step, native keys where TRL has the equivalent) and
``summary.json``. TRL generates, scores and batches; :class:`RegistryGRPOTrainer` replaces only the loss, so
any registered objective runs here with no per-objective code. How the config maps onto TRL
(:func:`grpo_config`):

    prompts_per_step x group_size      -> generation batch, num_generations = group_size
    num_minibatches (optimizer steps)  -> steps_per_generation = num_minibatches x gradient_accumulation_steps
    micro_batch_size (0 = minibatch)   -> per_device_train_batch_size; accumulation = minibatch / (micro x GPUs)
    epochs                             -> num_iterations;   steps x num_minibatches x epochs -> max_steps
    objective.beta                     -> a frozen copy of the (warm-started) policy as TRL's ref_model

Conventions aligned with the native loop (each one differs from stock TRL):
- advantages: the objective's estimator from the registry (TRL's own divides by std + 1e-4, ours std + 1e-6);
- aggregation: the objective's, over the optimizer step's minibatch with its exact global token / sequence
  counts (``num_tokens`` / ``num_sequences``), so summing micro-batches and averaging over GPUs gives the
  native minibatch loss (TRL's ``dapo`` / ``cispo`` divide by the generation batch's *mean* tokens per step);
- the KL to the reference is the registry's k3, not multiplied by the ratio (TRL: ``use_bias_correction_kl``);
- the entropy bonus and top-entropy masking (``objective.params.entropy_coef`` / ``top_entropy_quantile``): the
  registry objective's, on TRL's (differentiable) entropies; equal to TRL's own options of the same names on one
  micro-batch (tests/test_trl_backend.py), exact over the minibatch where TRL's bonus is a per-micro-batch mean;
- behaviour log-probs: the trainer's (TRL recomputes them before the first update, or they equal the current
  ones), i.e. ``train.old_logp: recompute``; with vLLM (``use_vllm``) and ``train.old_logp: sampler``, vLLM's own
  log-probs, as the native sampler's, so the objective's ratio sees the train-inference mismatch (TRL's separate
  vLLM importance-sampling correction is then off: the objective owns the ratio);
- ``train.rollout_correction`` (a mode other than none): mapped onto TRL's own ``vllm_importance_sampling_*``
  options, which compute exactly our weights (same modes, product for sequences, clip_max = threshold,
  clip_min = the lower threshold): TRL recomputes the trainer's old log-probs and its ratio
  (``importance_sampling_ratio``) becomes ``PolicyBatch.correction`` in ``_compute_loss``, so every objective
  gets it as natively. Without vLLM TRL samples with the policy itself: no sampler difference, weights 1;
- a Mixture-of-Experts policy's expert volatility, load entropy and aux loss (the native keys, the native
  functions): the behaviour routing is recorded in TRL's old-policy pass and compared at every loss forward; where
  TRL skips that pass (one optimizer step per generation batch) it is the loss forward's own (volatility 0);
- objectives with minibatch statistics (P3O's ESS): summed over the optimizer step's micro-batches (all
  processes) in a no-grad forward at the first micro-batch of the step, as the native loop's two passes.
- LoRA (``model.lora``): TRL's own ``peft_config`` (the same adapters: A drawn from ``model.seed`` as natively),
  the reference log-probs the policy's with its adapters disabled, as the native loop's; ``final/`` the adapters.
Remaining differences: ``model.sampler_dtype`` is not supported; TRL draws the prompts (seeded sampler), shuffles
sequences, not groups, into minibatches and does not reshuffle between epochs; its linear warm-up starts at
lr 0; ``grad_norm`` is the last optimizer step's; a non-finite update is not skipped.
Extra ``GRPOConfig`` arguments (e.g. vLLM) come from the environment: ``RLVR_TRL_ARGS='{"use_vllm": true}'``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from omegaconf import DictConfig
from transformers import PrinterCallback, ProgressCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation
from trl.trainer.utils import add_fused_lm_head

from harness.loop.behaviour import rollout_correction
from harness.loop.build import hook_routing, setup_run
from harness.loop.evaluation import evaluate
from harness.loop.metrics import MetricMeter, PhaseMemory, progress_fields
from harness.loop.trl_limits import trl_extra_args, trl_unsupported, world_size
from harness.policy.device import resolve_device
from harness.policy.expert_volatility import capture_metrics, merge_volatility
from harness.policy.forward import CHECKPOINT_KWARGS, evaluating
from harness.policy.lora import PEFT_PATTERN_NOTE, adapted, export_merged, lora_settings
from harness.policy.matmul import cpu_matmul
from harness.policy.models import build_prompt
from harness.policy.routing import Grid, full_layout, routing_of
from harness.run.atomic import TMP, atomic_write
from harness.run.config import microbatch_size, minibatch_size, updates_per_step
from harness.run.errors import ConfigError
from harness.run.offpolicy import behaviour_logp, correction_settings
from harness.run.records import RunRecords, no_save_progress_bar, unreadable_reason
from harness.run.threads import run_threads
from harness.tasks import Problem
from objectives import PolicyBatch
from objectives.base import sum_statistics
from objectives.rollout_correction import lower_threshold

STATS_KEY = "minibatch_stats."  # inputs["minibatch_stats.<name>"]: 0-dim sums of the step's minibatch statistics
ROUTING_KEY = "behaviour_routing"  # inputs[...]: [rows, layers, width, k] an MoE's routing in TRL's old-policy pass

# TRL's logged metric -> the native metrics.jsonl key
TRL_KEYS = {"reward": "reward_mean", "reward_std": "reward_std", "rewards/correct/mean": "accuracy",
            "rewards/format/mean": "format_reward", "completions/mean_length": "completion_len_mean",
            "completions/max_length": "completion_len_max", "completions/clipped_ratio": "frac_truncated",
            "frac_reward_zero_std": "frac_zero_std_groups", "grad_norm": "grad_norm", "learning_rate": "lr",
            "loss": "loss"}
TRL_DROP = ("epoch", "num_tokens", "step_time")  # TRL's epoch / tokens seen / step time: step_s covers them


def grpo_config(cfg: DictConfig, output_dir: Path, progress: bool = False, **overrides) -> GRPOConfig:
    """The run config as TRL's GRPOConfig (see the module docstring); ``overrides`` and $RLVR_TRL_ARGS win."""
    t = cfg.train
    accumulation = minibatch_size(t) // (microbatch_size(t) * world_size())
    steps_per_rollout = updates_per_step(t)
    mode, threshold, lower = correction_settings(t)
    correction = {"vllm_importance_sampling_correction": False}  # with vLLM, train.old_logp decides (docstring)
    if mode != "none":  # TRL's own options compute exactly our weights (docs/trl.md)
        correction = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": mode,
                      "vllm_importance_sampling_clip_max": threshold,
                      "vllm_importance_sampling_clip_min": lower_threshold(mode, threshold, lower)}
    kwargs = dict(
        output_dir=str(output_dir), seed=cfg.seed, use_cpu=resolve_device(cfg.device).type == "cpu",
        bf16=cfg.model.dtype == "bfloat16", report_to="none", disable_tqdm=not progress,
        per_device_train_batch_size=microbatch_size(t), gradient_accumulation_steps=accumulation,
        steps_per_generation=t.num_minibatches * accumulation, num_generations=t.group_size,
        num_iterations=t.epochs, max_steps=t.steps * steps_per_rollout, max_completion_length=t.max_new_tokens,
        temperature=t.temperature, top_p=t.top_p, top_k=0, learning_rate=t.lr, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, lr_scheduler_type="constant_with_warmup", warmup_steps=t.warmup_steps,
        logging_steps=steps_per_rollout, beta=0.0, loss_type="grpo", scale_rewards="group",
        save_strategy="steps" if t.save_every else "no", save_steps=max(1, t.save_every) * steps_per_rollout,
        save_total_limit=1, dataloader_num_workers=0,
        activation_checkpointing=t.activation_checkpointing,  # TRL's gradient_checkpointing, on by default in TRL
        activation_checkpointing_kwargs=dict(CHECKPOINT_KWARGS),  # an MoE's recompute forces its forward's routing
        **correction,
    )
    kwargs.update(overrides)
    kwargs.update(trl_extra_args())
    return GRPOConfig(**kwargs)


def problems_dataset(problems, tokenizer) -> Dataset:
    """Prompts as TRL takes them: a chat message when the tokenizer has a template (TRL applies it), else the
    native prompt text; the problem's fields ride along for the reward functions."""
    prompts = [[{"role": "user", "content": p.question}] if tokenizer.chat_template else build_prompt(tokenizer,
               p.question) for p in problems]
    return Dataset.from_dict({"prompt": prompts, "question": [p.question for p in problems],
                              "answer": [p.answer for p in problems], "solution": [p.solution for p in problems]})


def reward_functions(task) -> list:
    """Two plain callables, ``correct`` and ``format`` (the task's Score fields); TRL weights them
    (1, task.format_weight) into the reward, as the native loop does."""

    def scorer(field):
        def reward(completions, question, answer, solution, **_):
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [getattr(task.score(text, Problem(q, a, s)), field)
                    for text, q, a, s in zip(texts, question, answer, solution, strict=True)]

        reward.__name__ = field
        return reward

    return [scorer("correct"), scorer("format")]


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that adds up the wall time of its phases in ``phase_s`` (seconds): ``rollout`` (generate, score,
    advantages, no-grad log-probs), ``generate``, ``rewards``, ``logp_nograd`` (old / reference log-probs),
    ``logp_forward`` (training forward), ``training_step`` (rollout when due + forward + loss + backward); and the
    peak memory of the rollouts and of the rest (``memory``: the update) until the records take it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase_s = defaultdict(float)
        self.memory = PhaseMemory(self.accelerator.device)

    def _timed(self, name, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.phase_s[name] += time.perf_counter() - start

    def _generate_and_score_completions(self, inputs):
        self.memory.start("rollout")
        try:
            return self._timed("rollout", super()._generate_and_score_completions, inputs)
        finally:
            self.memory.start("update")

    def _generate_single_turn(self, *args, **kwargs):
        return self._timed("generate", super()._generate_single_turn, *args, **kwargs)

    def _calculate_rewards(self, *args, **kwargs):
        return self._timed("rewards", super()._calculate_rewards, *args, **kwargs)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        name = "logp_forward" if torch.is_grad_enabled() else "logp_nograd"
        return self._timed(name, super()._get_per_token_logps_and_entropies, *args, **kwargs)

    def training_step(self, *args, **kwargs):
        return self._timed("training_step", super().training_step, *args, **kwargs)


class RegistryGRPOTrainer(TimedGRPOTrainer):
    """GRPOTrainer whose loss is ``objective`` (any registered one), advantages from ``estimator`` and, when
    ``reference`` is given (a frozen copy of the policy, made before TRL patches it), or the policy has LoRA
    adapters (``peft_config``: TRL disables them for the reference log-probs), a KL term with the objective's beta.
    ``args.beta`` must be 0: the reference is set up here, not loaded from a path. ``train``
    (the run's ``train`` config) brings the rollout correction; ``old_logp`` is then ``behaviour_logp(train)``."""

    def __init__(self, *args, objective, estimator, reference=None, old_logp: str = "recompute", train=None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.train_cfg = train
        old_logp = old_logp if train is None else behaviour_logp(train)
        self.objective, self.estimator, self.old_logp = objective, estimator, old_logp
        self.meter = MetricMeter(objective.minibatch_shares())
        self.correction_on = train is not None and correction_settings(train)[0] != "none"
        self.recording, self.behaviour_record, self.volatility = False, None, []  # an MoE's routing (expert volatility)
        if objective.beta > 0 and adapted(self.accelerator.unwrap_model(self.model)):
            self.beta = objective.beta  # TRL's reference log-probs: the policy with its adapters disabled
        if reference is not None:
            self.beta = objective.beta  # makes TRL compute ref_per_token_logps with self.ref_model
            add_fused_lm_head(reference.requires_grad_(False), temperature=self.temperature)
            if self.is_deepspeed_enabled:
                self.ref_model = prepare_deepspeed(reference, self.accelerator)
            elif self.is_fsdp_enabled:
                self.ref_model = prepare_fsdp(reference, self.accelerator)
            else:
                self.ref_model = self.accelerator.prepare_model(reference, evaluation_mode=True)

    def _generate_single_turn(self, *args, **kwargs):
        """TRL's generation, by the policy in eval mode (Trainer leaves it in train mode): the policy's samples, not
        those of one draw of its (LoRA) dropout, as the native sampler's (harness/policy/sampler.py)."""
        with evaluating(self.model):
            return super()._generate_single_turn(*args, **kwargs)

    def _calculate_rewards(self, *args, **kwargs):
        self._rewards_per_func = super()._calculate_rewards(*args, **kwargs)  # gathered over processes
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self.recording, self.behaviour_record = self.routing is not None, None  # TRL's old-policy pass records it
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self.recording = False
        if self.behaviour_record is not None:  # rows first: TRL shuffles and splits it with the batch
            out[ROUTING_KEY] = self.behaviour_record.indices.transpose(0, 1)
        rewards = (self._rewards_per_func * self.reward_weights.to(self._rewards_per_func.device)).nansum(dim=1)
        group_ids = torch.arange(len(rewards), device=rewards.device) // self.num_generations
        local = slice(self.accelerator.process_index * len(inputs), (self.accelerator.process_index + 1) * len(inputs))
        lengths = self.accelerator.gather(out["completion_mask"].sum(-1)).to(rewards.device)  # every process's rows
        out["advantages"] = self.estimator(rewards, group_ids, lengths)[local].to(out["advantages"].dtype)
        out["rewards"], out["group_ids"] = rewards[local], group_ids[local]
        if self.correction_on:
            self.add_rollout_correction(out)
        return out

    @property
    def routing(self):
        """The policy's routing hooks (an MoE: :func:`harness.loop.build.hook_routing`), or None: a dense policy, or
        vLLM's log-probs as the behaviour (``train.old_logp: sampler``), whose routing cannot be recorded (then no
        expert volatility, as natively with a sampler that cannot record it)."""
        vllm_behaviour = self.old_logp == "sampler" and self.use_vllm
        return None if vllm_behaviour else routing_of(self.accelerator.unwrap_model(self.model))  # DeepSpeed wraps it

    @contextmanager
    def routed(self, attention_mask, completion_width: int, router_logits: bool = False):
        """A capture of the policy's routing (:meth:`harness.policy.routing.Routing.capture`) around one forward
        call of [prompt | completion] with this ``attention_mask`` [rows, width] (the routing grid)."""
        rows, width = attention_mask.shape
        grid = Grid(rows, width, width - completion_width)
        with self.routing.capture(grid, router_logits=router_logits) as capture, \
                self.routing.tokens(full_layout(attention_mask)):
            yield capture

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           **kwargs):
        """TRL's, and in TRL's old-policy pass of an MoE policy (the first no-grad forward of the policy while
        generating; TRL skips it with one optimizer step per generation batch) also the routing of its tokens
        (``behaviour_record``), chunk by chunk (``batch_size``) as TRL runs it. A no-grad forward (the old policy's,
        the reference's, a statistics pass) runs the model in eval mode, as the native loop's: the policy's log-probs,
        not one draw of its (LoRA) dropout; only the loss forward trains."""
        if not torch.is_grad_enabled() and model.training:
            with evaluating(model):
                return self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                               batch_size, **kwargs)
        if not (self.recording and model is self.model and not torch.is_grad_enabled()):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, **kwargs)
        self.recording = False  # the old-policy pass only, not the reference's nor any later one
        size, parts, records = batch_size or len(input_ids), [], []
        for start in range(0, len(input_ids), size):
            rows = slice(start, start + size)
            with self.routed(attention_mask[rows], logits_to_keep) as capture:
                parts.append(super()._get_per_token_logps_and_entropies(
                    model, input_ids[rows], attention_mask[rows], logits_to_keep, **kwargs))
            records.append(capture.record)
        self.behaviour_record = dataclasses.replace(records[0], indices=torch.cat([r.indices for r in records], 1))
        logps, entropies, aux = zip(*parts, strict=True)
        return (torch.cat(logps), None if entropies[0] is None else torch.cat(entropies),
                None if aux[0] is None else torch.stack(aux).mean())

    @contextmanager
    def measured_routing(self, inputs):
        """Around the loss forward of an MoE policy: its live routing compared with the behaviour routing of the same
        rows (``inputs[ROUTING_KEY]``, TRL's old-policy pass; where TRL skipped that pass the behaviour log-probs are
        this forward's own, and so is the behaviour routing: volatility 0) by the native loop's
        :func:`capture_metrics`; the volatility joins ``self.volatility``, the yielded dict gets expert-load entropy
        and the router's auxiliary loss. Nothing for a dense policy."""
        metrics = {}
        if self.routing is None:
            yield metrics
            return
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with self.routed(mask, inputs["completion_ids"].size(1), router_logits=True) as capture:
            yield metrics
        behaviour = capture.record if ROUTING_KEY not in inputs else dataclasses.replace(
            capture.record, indices=inputs[ROUTING_KEY].transpose(0, 1))
        volatility, routing_metrics = capture_metrics(behaviour, capture)
        self.volatility.append(volatility)
        metrics.update(routing_metrics)

    def add_rollout_correction(self, out: dict) -> None:
        """``out["rollout_correction"]`` [B, T]: TRL's ``importance_sampling_ratio`` (vLLM, from the mapped options),
        else weights 1 (TRL sampled with the policy itself: no sampler difference); and the correction's metrics
        (harness.loop.behaviour.rollout_correction, as natively) from the trainer's and vLLM's log-probs."""
        mask = out["completion_mask"].bool()
        old, sampled = out.get("old_per_token_logps"), out.get("sampling_per_token_logps")
        if old is None or sampled is None:  # no vLLM: the sampler is the policy itself (weights 1)
            old, sampler = torch.zeros(mask.shape, device=mask.device), None
        else:  # tokens vLLM could not score (NaN) get no correction, as TRL's nan_to_num
            sampler = torch.where(torch.isnan(sampled), old, sampled)
        weights, metrics = rollout_correction(self.train_cfg, old, sampler, mask)
        ratio = out.get("importance_sampling_ratio")
        out["rollout_correction"] = weights if ratio is None else ratio.expand(mask.shape).contiguous()
        self.meter.add(metrics, mask.sum().item())

    def _prepare_inputs(self, generation_batch):
        """Adds ``num_tokens_step``: the valid tokens of this optimizer step's minibatch (all its micro-batches, all
        processes), the native loop's ``num_tokens``; and, at the step's first micro-batch, the objective's
        minibatch statistics of the step (``minibatch_stats.*``) when it has any and the step is split."""
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training:
            index = self._step % self.args.steps_per_generation
            first = index - index % self.args.gradient_accumulation_steps
            window = self._buffered_inputs[first : first + self.args.gradient_accumulation_steps]
            inputs["num_tokens_step"] = self.accelerator.gather(sum(b["completion_mask"].sum() for b in window)).sum()
            if index == first:
                self.add_minibatch_statistics(window)
        return inputs

    @torch.no_grad()
    def add_minibatch_statistics(self, window: list[dict]) -> None:
        """The objective's ``minibatch_statistics`` summed over the optimizer step's micro-batches ``window`` and all
        processes, from a no-grad forward of the current policy (the first of two passes, as the native loop's
        harness.loop.update.with_statistics), stored in every micro-batch of the window. Nothing when the objective
        has no such hook or the step is one micro-batch on one process."""
        for inputs in window:
            for key in [k for k in inputs if k.startswith(STATS_KEY)]:
                del inputs[key]
        if not self.objective.uses_minibatch_statistics() or len(window) * self.accelerator.num_processes < 2:
            return
        stats = sum_statistics([self.objective.minibatch_statistics(
            self.policy_batch(inputs, self.completion_logp(self.model, inputs)[0])) for inputs in window])
        keys = sorted(stats)
        totals = self.accelerator.reduce(torch.stack([stats[k].to(self.accelerator.device) for k in keys]), "sum")
        for inputs in window:
            inputs.update({STATS_KEY + k: totals[i] for i, k in enumerate(keys)})

    def completion_logp(self, model, inputs, compute_entropy: bool = False):
        """The completion tokens' log-probs (and entropies) under ``model``, [B, T]."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logp, entropy, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, inputs["completion_ids"].size(1), compute_entropy=compute_entropy)
        return logp, entropy

    def _compute_loss(self, model, inputs):
        with self.measured_routing(inputs) as routing_metrics:  # an MoE's; nothing for a dense policy
            logp, entropy = self.completion_logp(model, inputs, compute_entropy=True)  # TRL's fused head
        batch = self.policy_batch(inputs, logp, entropy)
        out = self.objective(batch)
        tokens = batch.mask.sum().item()
        self.meter.add({**out.metrics, "entropy": (entropy.detach() * batch.mask).sum().item() / max(tokens, 1),
                        **routing_metrics}, tokens, float(batch.num_tokens))  # shares sum to the step's value
        # Trainer sums micro-batch losses and DDP / DeepSpeed average gradients over processes: undo the average
        return out.loss * self.accelerator.num_processes

    def policy_batch(self, inputs, logp, entropy=None) -> PolicyBatch:
        """The objective's input for one micro-batch of TRL's ``inputs`` with current log-probs ``logp`` (and
        entropies, for the entropy bonus and top-entropy masking)."""
        mask = inputs["completion_mask"].bool()
        old_logp = inputs.get("old_per_token_logps")  # None when it equals the current log-probs (TRL)
        old_logp = logp.detach() if old_logp is None else old_logp
        sampled = inputs.get("sampling_per_token_logps")  # vLLM's log-probs of its samples (NaN: not scored)
        if self.old_logp == "sampler" and sampled is not None:
            old_logp = torch.where(torch.isnan(sampled), old_logp, sampled)
        training = self.model.training
        accumulation = getattr(self, "current_gradient_accumulation_steps", 1) if training else 1
        processes = self.accelerator.num_processes
        num_tokens = inputs.get("num_tokens_step")
        if num_tokens is None:  # a hand-made batch: TRL's own estimate of the optimizer step's tokens
            share = accumulation / self.args.steps_per_generation if training else 1.0
            num_tokens = inputs["num_items_in_batch"] * share
        minibatch_stats = {k[len(STATS_KEY):]: v for k, v in inputs.items() if k.startswith(STATS_KEY)} or None
        return PolicyBatch(
            logp=logp, old_logp=old_logp, mask=mask,
            advantages=inputs["advantages"], rewards=inputs.get("rewards"), group_ids=inputs.get("group_ids"),
            ref_logp=inputs.get("ref_per_token_logps"), step=self.state.global_step,
            total_steps=max(1, self.state.max_steps), max_completion_len=self.max_completion_length,
            num_tokens=num_tokens.clamp(min=1), num_sequences=logp.size(0) * accumulation * processes,
            rollout_step=self.state.global_step // (self.args.steps_per_generation * self.args.num_iterations),
            sampler_logp=None if sampled is None or self.old_logp == "sampler" else torch.where(
                torch.isnan(sampled), old_logp, sampled),
            correction=inputs.get("rollout_correction"), behaviour_corrected=self.correction_on,
            minibatch_stats=minibatch_stats,
            entropy=None if entropy is None else entropy.masked_fill(~mask, 0.0))

    def log(self, logs, start_time=None):
        if self.model.training:
            logs.update(self.gathered_meter().result())
            logs.update(self.gathered_volatility())
            self.meter, self.volatility = MetricMeter(self.objective.minibatch_shares()), []
        super().log(logs, start_time)

    def gathered_volatility(self) -> dict[str, float]:
        """An MoE's expert volatility over every process's loss forwards since the last log (merge_volatility, as the
        native loop's over a step's forwards); {} for a dense policy. Every process logs together (gather_object)."""
        if self.routing is None:
            return {}
        parts = self.volatility if self.accelerator.num_processes == 1 else [
            part for parts in gather_object([self.volatility]) for part in parts]
        return merge_volatility(parts).metrics() if parts else {}

    def gathered_meter(self) -> MetricMeter:
        """The objective's metrics over every process's micro-batches since the last log (token-weighted sums and
        weights added, extremes min / max), as one process holding the whole batch would log them. Trainer calls
        ``log`` on every process at the same steps, so the gather (a collective) is matched."""
        if self.accelerator.num_processes == 1:
            return self.meter
        total = MetricMeter()
        for sums, weights, extremes in gather_object([(dict(self.meter.sums), dict(self.meter.weights),
                                                       self.meter.extremes)]):
            for key, value in sums.items():
                total.sums[key] += value
                total.weights[key] += weights[key]
            total.add(extremes, 1.0)  # *_min / *_max keys only: min / max
        return total


class RecordsCallback(TrainerCallback):
    """Writes the native results files (harness/run/records.py): one metrics.jsonl row per rollout step (TRL logs once
    per rollout step), the held-out evaluation at step 0, every ``eval_every`` steps and the last."""

    def __init__(self, cfg: DictConfig, records: RunRecords, task, tokenizer):
        self.cfg, self.records, self.task, self.tokenizer = cfg, records, task, tokenizer
        self.trainer = None  # set once the trainer exists
        self.last_time = time.time()

    def evaluate(self, step: int) -> tuple[dict, list[dict]]:
        trainer, memory = self.trainer, PhaseMemory(self.trainer.accelerator.device)
        memory.start("eval")
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            row, samples = evaluate(model, self.tokenizer, self.task, self.cfg, step)  # every rank: ZeRO-3 needs them
        return {**row, **memory.metrics(total=False)}, samples

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            row, samples = self.evaluate(0)
            self.records.log({"step": 0, **row}, samples)
        self.last_time = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        t = self.cfg.train
        if not logs or "reward" not in logs:
            return
        step = state.global_step // updates_per_step(t)
        now, phase = time.time(), self.trainer.phase_s
        step_s, rollout_s = now - self.last_time, phase.pop("rollout", 0.0)
        phase.clear()
        tokens = logs["completions/mean_length"] * t.prompts_per_step * t.group_size
        progress = self.records.progress
        progress["rollout_tokens"] += int(round(tokens))
        progress["update_tokens"] = progress["rollout_tokens"] * t.epochs
        row = {"step": step, "rollout_tokens": progress["rollout_tokens"],
               **{new: logs[old] for old, new in TRL_KEYS.items() if old in logs},
               **{k: v for k, v in logs.items() if "/" not in k and k not in TRL_KEYS and k not in TRL_DROP},
               "rollout_s": rollout_s, "update_s": step_s - rollout_s, "rollout_tok_s": tokens / max(rollout_s, 1e-9),
               "update_tok_s": tokens * t.epochs / max(step_s - rollout_s, 1e-9), "step_s": step_s,
               **self.trainer.memory.metrics()}
        self.trainer.memory = PhaseMemory(self.trainer.accelerator.device)  # the next step's peaks
        samples = None
        if step == t.steps or (t.eval_every and step % t.eval_every == 0):
            evaluation, samples = self.evaluate(step)
            row.update(evaluation)
        self.records.log(row, samples)
        if t.export_every and step % t.export_every == 0:
            save_model(self.trainer, self.records.run_dir / "exports" / f"step_{step}", self.records.main)
        self.last_time = time.time()


class ProgressLine(ProgressCallback):
    """TRL's progress bar (optimizer steps) with the native one's fields (reward, clip fraction, last eval accuracy)
    instead of printing TRL's raw metrics dict at every log: metrics.jsonl has them. Runs after RecordsCallback."""

    def __init__(self, records: RunRecords):
        super().__init__()
        self.records = records

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.set_description(self.records.run_dir.name)
            self.training_bar.leave = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        rows = self.records.rows
        if self.training_bar is not None and rows:
            self.training_bar.set_postfix(progress_fields(rows[-1], rows))


def quiet_transformers() -> None:
    """Silence what transformers and TRL print at every step without telling the user anything: TRL's generation
    context reads the deprecated ``is_gradient_checkpointing`` and, with activation checkpointing, calls the
    deprecated ``gradient_checkpointing_disable`` / ``_enable`` around its no-grad passes (a FutureWarning each per
    generation), and checkpoint rotation notes that mtime is unreliable on fast file systems (it then orders
    checkpoints by number); and peft's note on its own patterns (harness/policy/lora.py)."""
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated",
                            category=FutureWarning)
    warnings.filterwarnings("ignore", message=PEFT_PATTERN_NOTE, category=RuntimeWarning)  # TRL's get_peft_model

    class NoMtimeNote(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "mtime may not be reliable" not in record.getMessage()

    logging.getLogger("transformers.trainer_utils").addFilter(NoMtimeNote())


def save_model(trainer, folder: Path, main: bool) -> None:
    """``trainer.save_model`` into ``folder`` atomically (harness.run.atomic.atomic_write). Every rank calls it: ZeRO-3
    / FSDP gather the weights there; the main process writes."""
    with no_save_progress_bar():
        if main:
            atomic_write(folder, write=lambda tmp: trainer.save_model(str(tmp)))
        else:
            trainer.save_model(str(folder.with_name(folder.name + TMP)))


def trl_checkpoints(folder: Path) -> tuple[str | None, list[Path]]:
    """The newest ``checkpoint-N`` of Trainer's output folder written to the end (its trainer_state.json, written
    last, exists; None when there is none), and the newer ones a kill or a full disk cut short."""
    numbered = sorted((int(p.name.rsplit("-", 1)[1]), p) for p in folder.glob("checkpoint-*")
                      if p.is_dir() and p.name.rsplit("-", 1)[1].isdigit()) if folder.is_dir() else []
    torn = []
    for _, path in reversed(numbered):
        if (path / "trainer_state.json").is_file():
            return str(path), torn
        torn.append(path)
    return None, torn


def launch_problem(device: torch.device) -> str | None:
    """What is wrong with how ``accelerate launch`` started this process on a CPU, which accelerate would run
    otherwise than asked without a word (docs/trl.md): ``--cpu --num_processes N`` starts one process (accelerate's
    simple launcher, without MPI), and an FSDP or DeepSpeed launch runs as plain DDP (accelerate 1.15 applies neither
    on CPU). None when the launch does what it says."""
    if device.type != "cpu":
        return None
    several = "WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true" and "MASTER_PORT" in os.environ and not several:
        return ("accelerate launch --cpu --num_processes N starts one process without MPI; for N CPU processes "
                "(DDP over gloo) use accelerate launch --multi_gpu --num_processes N (docs/trl.md)")
    for variable, engine in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        if world_size() > 1 and os.environ.get(variable, "").lower() == "true":
            return (f"accelerate runs {'an' if engine == 'FSDP' else 'a'} {engine} launch on CPU as plain DDP (it "
                    f"shards nothing): on CPU use "
                    f"accelerate launch --multi_gpu --num_processes N, {engine} on GPUs (docs/trl.md)")
    return None


def train_trl(cfg: DictConfig, run_dir: Path, progress: bool = True) -> dict:
    """Train one run with TRL into ``run_dir`` (resuming from its last TRL checkpoint); returns the summary."""
    # the launch environment (WORLD_SIZE) is known only now; the objective's needs were checked with the config
    reason = trl_unsupported(cfg) or launch_problem(resolve_device(cfg.device))
    if reason:
        raise ConfigError(reason)
    torch.manual_seed(cfg.seed)
    main = int(os.environ.get("RANK", "0")) == 0
    checkpoint, torn = trl_checkpoints(run_dir / "trl")
    rollout_steps = updates_per_step(cfg.train)
    resume_step = int(checkpoint.rsplit("-", 1)[1]) // rollout_steps if checkpoint else None
    records = RunRecords(cfg, run_dir, resume_step, start_policy=None, backend="trl", main=main,
                         checkpoint=checkpoint)
    for path in torn if main else []:  # under the run's lock now
        shutil.rmtree(path, ignore_errors=True)
    records.progress["rollout_tokens"] = max([r.get("rollout_tokens", 0) for r in records.rows] or [0])
    records.progress["update_tokens"] = records.progress["rollout_tokens"] * cfg.train.epochs
    records.progress["threads"] = run_threads(cfg.threads, records.previous.get("threads"))  # a resume keeps them
    with records.recording():
        device = resolve_device(cfg.device)
        if device.type == "cuda" and "LOCAL_RANK" in os.environ:  # accelerate launch: this process's GPU
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        setup = setup_run(cfg, device, progress, adapters=False)  # build.py, as the native loop (LoRA: TRL adds it)
        hook_routing(setup, cfg.train)  # an MoE's routing hooks: expert volatility (RegistryGRPOTrainer.routed)
        records.start_policy = setup.start_policy
        records.check_begun_on(setup.task_data, setup.start_weights)  # a resume on other problems or weights: refused
        callback = RecordsCallback(cfg, records, setup.task, setup.tokenizer)
        quiet_transformers()
        lora = cfg.model.lora
        if lora.rank:  # the adapters' initial A, drawn in TRL's get_peft_model, as the native loop draws it (then
            torch.manual_seed(cfg.model.seed)  # Trainer seeds torch with cfg.seed, as without adapters)
        trainer = RegistryGRPOTrainer(
            model=setup.policy, reward_funcs=reward_functions(setup.task), args=grpo_config(
                cfg, run_dir / "trl", progress, reward_weights=[1.0, cfg.task.format_weight]),
            train_dataset=problems_dataset(setup.train_problems, setup.tokenizer), processing_class=setup.tokenizer,
            callbacks=[callback], objective=setup.objective, estimator=setup.estimator, reference=setup.reference,
            train=cfg.train, peft_config=lora_settings(lora) if lora.rank else None)
        callback.trainer = trainer
        trainer.remove_callback(PrinterCallback)  # both print every log dict; metrics.jsonl has them
        trainer.remove_callback(ProgressCallback)
        if progress:
            trainer.add_callback(ProgressLine(records))
        # a "Writing model shards" bar per checkpoint; the linear layers on train.cpu_matmul's kernel
        with no_save_progress_bar(), cpu_matmul(cfg.train.cpu_matmul):
            try:
                trainer.train(resume_from_checkpoint=checkpoint)
            except pickle.UnpicklingError as e:  # torch's words would invite loading it with code execution allowed
                if checkpoint is None:  # not a checkpoint of the run's: nothing of it to name
                    raise
                raise RuntimeError(f"unreadable checkpoint {checkpoint} ({unreadable_reason(e)}): delete it to "
                                   "restart this run from an earlier checkpoint or step 0") from None
        save_model(trainer, run_dir / "final", records.main)  # a LoRA policy: its adapters
        if lora.export_merged and records.main:
            policy = trainer.accelerator.unwrap_model(trainer.model)
            export_merged(policy, setup.tokenizer, run_dir / "final" / "merged")
    return records.end("finished")  # summary.json; the checkpoints no run reads again removed (records.py)
