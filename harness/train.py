"""The one shared rollout/update loop. Every objective runs through exactly this code.

Per step:
  1. draw ``prompts_per_step`` problems; sample ``group_size`` completions each (batched, KV cache) and keep
     the sampler's per-token log-probs;
  2. score them with the task's verifier; advantages from the estimator (group = prompt);
  3. behaviour log-probs: the sampler's, or recomputed by the trainer before the first update; reference
     log-probs when the objective's beta > 0 (the frozen reference is only loaded then);
  4. ``epochs`` passes over the batch, each split into ``num_minibatches`` optimizer steps (whole groups
     stay together), micro-batches summed with global token/sequence counts, gradient clipping, AdamW
     with linear warm-up; a non-finite loss or gradient skips the update;
  5. every ``eval_every`` steps: greedy held-out accuracy (and pass@k).
One JSON line of metrics per step, flushed; a checkpoint every ``save_every`` steps. The random streams
are re-seeded from (seed, step), so a resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import copy
import math
import random
import resource
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from harness.config import DTYPES
from harness.models import build_prompt, load_model, warm_start
from harness.records import MetricsLog, write_json_atomic
from harness.rollout import Rollout, completion_logprobs, generate, select_rows
from harness.tasks import get_task
from objectives import PolicyBatch, get_advantage, get_objective


class NonFiniteError(RuntimeError):
    pass


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    return (seed * 1_000_003 + step * 101 + stream) % (2**63)


def build_task(cfg: DictConfig):
    return get_task(cfg.task.name, eval_size=cfg.task.eval_size, **({"data_dir": cfg.task.data_dir}
                    if cfg.task.data_dir else {}), **OmegaConf.to_container(cfg.task.args))


def build_policy(cfg: DictConfig, task, device: torch.device):
    """The policy (after the optional, cached supervised warm start) and its tokenizer."""
    tiny = OmegaConf.to_container(cfg.model.tiny) if cfg.model.name == "tiny" else None
    model, tokenizer = load_model(cfg.model.name, tiny=tiny, device=device, dtype=DTYPES[cfg.model.dtype],
                                  seed=cfg.model.seed)
    if cfg.model.warm_start_steps:
        model = warm_start(model, tokenizer, task, steps=cfg.model.warm_start_steps, lr=cfg.model.warm_start_lr,
                           batch_size=cfg.model.warm_start_batch_size, seed=cfg.model.seed)
    return model, tokenizer


def sample_group(policy, tokenizer, problems, cfg: DictConfig) -> Rollout:
    prompts = [build_prompt(tokenizer, p.question) for p in problems]
    t = cfg.train
    return generate(policy, tokenizer, prompts, group_size=t.group_size, max_new_tokens=t.max_new_tokens,
                    temperature=t.temperature, top_p=t.top_p)


def rewards_of(scores, lengths: torch.Tensor, cfg: DictConfig) -> torch.Tensor:
    """correct + format_weight * format, plus DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13) when
    task.overlong_buffer = B > 0: with L = train.max_new_tokens, -overlong_penalty * clamp(length - (L - B), 0, B) / B
    (0 up to L - B tokens, falling linearly to -overlong_penalty at L; verl's overlong_buffer)."""
    task = cfg.task
    rewards = torch.tensor([s.correct + task.format_weight * s.format for s in scores], dtype=torch.float32)
    if task.overlong_buffer:
        excess = (lengths.float().cpu() - (cfg.train.max_new_tokens - task.overlong_buffer)).clamp(min=0)
        rewards = rewards - task.overlong_penalty * excess / task.overlong_buffer
    return rewards


def rollout_step(sampler, tokenizer, task, train_problems, cfg: DictConfig, step: int):
    """Steps 1-2: the training batch of one step (``prompts_per_step`` groups), its rewards [N], and statistics
    of everything sampled. Problems are drawn without replacement by a generator seeded with (seed, step).

    With ``train.dynamic_sampling`` (DAPO, arXiv 2503.14476, Sec. 3.2): groups whose rewards are all equal
    (every advantage 0, so no gradient) are dropped and ``prompts_per_step`` fresh prompts sampled, up to
    ``train.max_sampling_rounds`` rounds; the first ``prompts_per_step`` informative groups form the batch. The
    filter reads the reward (verl's ``filter_groups.metric: score``); the paper's accuracy filter is the same when
    the reward is correctness alone, and with format or overlong shaping the reward filter keeps the groups that
    still carry a gradient. If the rounds run out, dropped groups fill the batch (logged as
    ``frac_zero_std_groups_trained``) instead of stopping the run as verl does. The statistics (reward,
    accuracy, lengths, zero-variance groups, tokens) cover every sampled completion, so they describe the
    policy, not the filter, and ``rollout_tokens`` counts the whole sampling cost.
    """
    t = cfg.train
    rng = np.random.default_rng(step_seed(cfg.seed, step))
    torch.manual_seed(step_seed(cfg.seed, step, stream=2))
    rollouts, scores, rewards, informative, dropped = [], [], [], [], []
    for round_ in range(t.max_sampling_rounds if t.dynamic_sampling else 1):
        problems = [train_problems[i] for i in rng.choice(len(train_problems), t.prompts_per_step, replace=False)]
        ro = sample_group(sampler, tokenizer, problems, cfg)
        rollouts.append(ro)
        scores.append([task.score(text, problems[i // t.group_size]) for i, text in enumerate(ro.texts)])
        rewards.append(rewards_of(scores[-1], ro.completion_mask.sum(-1), cfg))
        grouped = rewards[-1].view(t.prompts_per_step, t.group_size)
        for g, varied in enumerate((grouped != grouped[:, :1]).any(-1).tolist()):
            (informative if varied else dropped).append([(round_, g * t.group_size + j) for j in range(t.group_size)])
        if len(informative) >= t.prompts_per_step:
            break
    every = [s for round_scores in scores for s in round_scores]
    lengths = torch.cat([ro.completion_mask.sum(-1) for ro in rollouts]).float()
    every_reward = torch.cat(rewards)
    stats = {"reward_mean": every_reward.mean().item(), "reward_std": every_reward.std().item(),
             "accuracy": float(np.mean([s.correct for s in every])),
             "format_reward": float(np.mean([s.format for s in every])),
             "completion_len_mean": lengths.mean().item(), "completion_len_max": lengths.max().item(),
             "frac_truncated": torch.cat([ro.truncated for ro in rollouts]).float().mean().item(),
             "frac_zero_std_groups": len(dropped) / (len(dropped) + len(informative)),
             "sampled_tokens": int(lengths.sum())}
    if not t.dynamic_sampling:
        return rollouts[0], rewards[0], stats
    groups = (informative + dropped)[: t.prompts_per_step]
    rows = [row for group in groups for row in group]
    stats.update(sampling_rounds=len(rollouts), frac_zero_std_groups_trained=sum(g in dropped for g in groups)
                 / t.prompts_per_step)
    return select_rows(rollouts, rows, tokenizer.pad_token_id), torch.stack([rewards[r][i] for r, i in rows]), stats


@torch.no_grad()
def evaluate(policy, tokenizer, task, cfg: DictConfig, step: int, samples: MetricsLog | None = None) -> dict:
    """Greedy accuracy on the fixed eval set; pass@k from k samples per problem when train.pass_k > 0.
    With ``samples``, one record per problem (greedy completion, answer, score) is appended to it."""
    problems = list(task.eval_problems())
    max_new = cfg.train.eval_max_new_tokens or cfg.train.max_new_tokens
    correct, records = [], []
    for i in range(0, len(problems), 64):
        chunk = problems[i : i + 64]
        out = generate(policy, tokenizer, [build_prompt(tokenizer, p.question) for p in chunk],
                       max_new_tokens=max_new, greedy=True)
        for j, (text, problem, truncated) in enumerate(zip(out.texts, chunk, out.truncated.tolist(), strict=True)):
            score = task.score(text, problem)
            correct.append(score.correct)
            records.append({"step": step, "problem": i + j, "answer": problem.answer, "correct": score.correct,
                            "format": score.format, "truncated": truncated, "completion": text})
    if samples is not None:
        samples.extend(records)
    row = {"eval_accuracy": float(np.mean(correct))}
    k = cfg.train.pass_k
    if k:
        torch.manual_seed(step_seed(cfg.seed, step, stream=7))
        solved = []
        for i in range(0, len(problems), max(1, 64 // k)):
            chunk = problems[i : i + max(1, 64 // k)]
            out = generate(policy, tokenizer, [build_prompt(tokenizer, p.question) for p in chunk], group_size=k,
                           max_new_tokens=max_new, temperature=cfg.train.temperature, top_p=cfg.train.top_p)
            hits = [task.score(t, chunk[j // k]).correct for j, t in enumerate(out.texts)]
            solved += [max(hits[j * k : (j + 1) * k]) for j in range(len(chunk))]
        row[f"eval_pass_at_{k}"] = float(np.mean(solved))
    return row


def batched_logprobs(model, ro: Rollout, temperature: float, chunk: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([completion_logprobs(model, ro.prompt_ids[i : i + chunk], ro.prompt_mask[i : i + chunk],
                                              ro.completion_ids[i : i + chunk], ro.completion_mask[i : i + chunk],
                                              temperature)[0] for i in range(0, len(ro.texts), chunk)])


class MetricMeter:
    """Combines metrics over micro-batches and minibatches: *_min by min, *_max by max, the rest by a
    token-weighted mean."""

    def __init__(self):
        self.sums, self.weights, self.extremes = defaultdict(float), defaultdict(float), {}

    def add(self, metrics: dict[str, float], weight: float) -> None:
        for key, value in metrics.items():
            if key.endswith("_min") or key.endswith("_max"):
                pick = min if key.endswith("_min") else max
                self.extremes[key] = pick(self.extremes.get(key, value), value)
            elif math.isfinite(value):
                self.sums[key] += value * weight
                self.weights[key] += weight

    def result(self) -> dict[str, float]:
        return {**{k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k]}, **self.extremes}


def update(policy, optimizer, scheduler, objective, ro: Rollout, old_logp, ref_logp, advantages, rewards,
           group_ids, cfg: DictConfig, step: int, state: dict) -> dict:
    """``epochs`` passes x ``num_minibatches`` optimizer steps over one rollout batch."""
    t = cfg.train
    n, group = len(ro.texts), t.group_size
    per_minibatch = n // t.num_minibatches
    micro = t.micro_batch_size or per_minibatch
    generator = torch.Generator().manual_seed(step_seed(cfg.seed, step, stream=1))
    meter, params = MetricMeter(), [p for p in policy.parameters() if p.requires_grad]
    mismatch = None
    policy.train()
    for epoch in range(t.epochs):
        if per_minibatch % group == 0:  # keep groups whole (needed by group-contrastive objectives)
            order = (torch.randperm(n // group, generator=generator)[:, None] * group + torch.arange(group)).flatten()
        else:
            order = torch.randperm(n, generator=generator)
        for k in range(t.num_minibatches):
            index = order[k * per_minibatch : (k + 1) * per_minibatch]
            num_tokens = ro.completion_mask[index].sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss_total = 0.0
            for j in range(0, per_minibatch, micro):
                sub = index[j : j + micro]
                width = int(ro.completion_mask[sub].sum(-1).max())  # drop all-padding columns
                mask = ro.completion_mask[sub, :width]
                logp, entropy = completion_logprobs(policy, ro.prompt_ids[sub], ro.prompt_mask[sub],
                                                    ro.completion_ids[sub, :width], mask, t.temperature,
                                                    with_entropy=epoch == 0)
                if epoch == 0 and k == 0 and t.old_logp == "sampler":
                    mismatch = mismatch_metrics(ro.sampler_logp[sub, :width], logp.detach(), mask, mismatch)
                batch = PolicyBatch(
                    logp=logp, old_logp=old_logp[sub, :width], mask=mask, advantages=advantages[sub],
                    rewards=rewards[sub], group_ids=group_ids[sub],
                    ref_logp=None if ref_logp is None else ref_logp[sub, :width],
                    step=state["optimizer_steps"], total_steps=state["total_optimizer_steps"],
                    max_completion_len=t.max_new_tokens, num_tokens=num_tokens, num_sequences=per_minibatch)
                out = objective(batch)
                out.loss.backward()
                loss_total += out.loss.item()
                tokens = mask.sum().item()
                metrics = dict(out.metrics)
                if entropy is not None:
                    metrics["entropy"] = (entropy * mask).sum().item() / max(tokens, 1)
                meter.add(metrics, tokens)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm).item()
            meter.add({"loss": loss_total, "grad_norm": grad_norm}, 1.0)
            state["optimizer_steps"] += 1
            if not (math.isfinite(loss_total) and math.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                state["nonfinite_skips"] += 1
                state["nonfinite_in_row"] += 1
                continue
            state["nonfinite_in_row"] = 0
            optimizer.step()
            scheduler.step()
    result = meter.result()
    if mismatch is not None:
        result.update({k: v / mismatch["tokens"] for k, v in mismatch.items() if k != "tokens"})
    return result


def mismatch_metrics(sampler_logp, trainer_logp, mask, acc: dict | None) -> dict:
    """Accumulates sum |sampler - trainer| and the k3 estimate of KL(sampler || trainer) over valid tokens."""
    acc = acc or {"mismatch_logp_abs": 0.0, "mismatch_kl": 0.0, "tokens": 0.0}
    diff = torch.where(mask, trainer_logp - sampler_logp, torch.zeros_like(trainer_logp))
    acc["mismatch_logp_abs"] += diff.abs().sum().item()
    acc["mismatch_kl"] += torch.where(mask, diff.exp() - 1 - diff, torch.zeros_like(diff)).sum().item()
    acc["tokens"] += mask.sum().item()
    return acc


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def save_checkpoint(run_dir: Path, policy, optimizer, scheduler, state: dict) -> None:
    path = run_dir / "checkpoints" / "last.pt"
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name("last.pt.tmp")
    torch.save({"policy": policy.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "state": state}, tmp)
    tmp.replace(path)


def load_checkpoint(run_dir: Path, policy, optimizer, scheduler, state: dict) -> None:
    path = run_dir / "checkpoints" / "last.pt"
    if path.exists():
        ckpt = torch.load(path, map_location=next(policy.parameters()).device, weights_only=False)
        policy.load_state_dict(ckpt["policy"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        state.update(ckpt["state"])


def train(cfg: DictConfig, run_dir: Path, progress: bool = True) -> dict:
    """Train one run into ``run_dir`` (resuming from its checkpoint if there is one); returns the summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    started = time.time()
    t = cfg.train
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)

    task = build_task(cfg)
    train_problems = task.train_problems()
    policy, tokenizer = build_policy(cfg, task, device)
    objective = get_objective(cfg.objective.name, **OmegaConf.to_container(cfg.objective.params))
    estimator = get_advantage(cfg.objective.advantage or objective.default_advantage)
    reference = copy.deepcopy(policy).requires_grad_(False).eval() if objective.beta > 0 else None
    sampler = policy
    if cfg.model.sampler_dtype and cfg.model.sampler_dtype != cfg.model.dtype:
        sampler = copy.deepcopy(policy).to(DTYPES[cfg.model.sampler_dtype]).requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (t.warmup_steps + 1)))

    state = {"step": 0, "optimizer_steps": 0, "nonfinite_skips": 0, "nonfinite_in_row": 0, "rollout_tokens": 0,
             "update_tokens": 0, "best_eval": None, "last_eval": None, "wall_time_s": 0.0}
    load_checkpoint(run_dir, policy, optimizer, scheduler, state)
    state["total_optimizer_steps"] = t.steps * t.epochs * t.num_minibatches  # for schedules (HölderPO, ConSPO)
    log = MetricsLog(run_dir / "metrics.jsonl", resume_step=state["step"])
    eval_samples = MetricsLog(run_dir / "eval_samples.jsonl", resume_step=state["step"])
    elapsed_before = state["wall_time_s"]

    def summary(status: str, error: str | None = None) -> dict:
        data = {"run_id": run_dir.name, "objective": cfg.objective.name, "seed": cfg.seed, "status": status,
                "steps_done": state["step"], "total_steps": t.steps, "final_eval_accuracy": state["last_eval"],
                "best_eval_accuracy": state["best_eval"], "wall_time_s": elapsed_before + time.time() - started,
                "rollout_tokens": state["rollout_tokens"], "update_tokens": state["update_tokens"],
                "nonfinite_skips": state["nonfinite_skips"], "error": error}
        write_json_atomic(run_dir / "summary.json", data)
        return data

    def record_eval(step: int, row: dict) -> dict:
        state["last_eval"] = row["eval_accuracy"]
        state["best_eval"] = max(state["best_eval"] or 0.0, row["eval_accuracy"])
        return row

    summary("running")
    bar = tqdm(total=t.steps, initial=state["step"], desc=run_dir.name, disable=not progress, leave=False)
    try:
        if state["step"] == 0:
            log.append({"step": 0, **record_eval(0, evaluate(policy, tokenizer, task, cfg, 0, eval_samples))})
        for step in range(state["step"] + 1, t.steps + 1):
            # 1-2. rollout, rewards (with dynamic sampling: until the batch has prompts_per_step informative groups)
            t0 = time.time()
            if sampler is not policy:
                sampler.load_state_dict(policy.state_dict())
            ro, rewards, sampled = rollout_step(sampler, tokenizer, task, train_problems, cfg, step)
            rollout_s = time.time() - t0
            rewards = rewards.to(device)
            group_ids = torch.arange(t.prompts_per_step, device=device).repeat_interleave(t.group_size)
            advantages = estimator(rewards, group_ids).to(device)
            # 3. behaviour and reference log-probs
            t1 = time.time()
            chunk = t.micro_batch_size or len(ro.texts) // t.num_minibatches
            old_logp = ro.sampler_logp
            extra = {}
            if t.old_logp == "recompute":
                old_logp = batched_logprobs(policy, ro, t.temperature, chunk)
                mm = mismatch_metrics(ro.sampler_logp, old_logp, ro.completion_mask, None)
                extra = {k: v / mm["tokens"] for k, v in mm.items() if k != "tokens"}
            ref_logp = batched_logprobs(reference, ro, t.temperature, chunk) if reference is not None else None
            # 4. update
            stats = update(policy, optimizer, scheduler, objective, ro, old_logp, ref_logp, advantages, rewards,
                           group_ids, cfg, step, state)
            update_s = time.time() - t1
            tokens, sampled_tokens = int(ro.completion_mask.sum()), sampled.pop("sampled_tokens")
            state["rollout_tokens"] += sampled_tokens
            state["update_tokens"] += tokens * t.epochs
            state["step"] = step
            row = {"step": step, "rollout_tokens": state["rollout_tokens"], **sampled,
                   "adv_mean": advantages.mean().item(), "adv_std": advantages.std().item(),
                   **stats, **extra, "lr": scheduler.get_last_lr()[0],
                   "nonfinite_skips": state["nonfinite_skips"], "rollout_s": rollout_s, "update_s": update_s,
                   "rollout_tok_s": sampled_tokens / rollout_s, "update_tok_s": tokens * t.epochs / update_s,
                   "peak_mem_mb": peak_memory_mb(device)}
            # 5. evaluation
            if step == t.steps or (t.eval_every and step % t.eval_every == 0):
                row.update(record_eval(step, evaluate(policy, tokenizer, task, cfg, step, eval_samples)))
            log.append(row)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}")
            if state["nonfinite_in_row"] >= t.max_nonfinite_in_row:
                raise NonFiniteError(f"{state['nonfinite_in_row']} updates in a row had a non-finite loss or "
                                     f"gradient (step {step}); lower train.lr or check the objective's inputs")
            state["wall_time_s"] = elapsed_before + time.time() - started
            if step == t.steps or (t.save_every and step % t.save_every == 0):
                save_checkpoint(run_dir, policy, optimizer, scheduler, state)
            summary("running")
    except BaseException as e:
        summary("failed" if isinstance(e, Exception) else "interrupted", f"{type(e).__name__}: {e}")
        raise
    finally:
        bar.close()
        log.close()
        eval_samples.close()
    return summary("finished")
