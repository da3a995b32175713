"""Held-out evaluation, the same for both backends: greedy accuracy on the task's fixed eval set (under the
training scoring, and under each of the task's named scorings), optionally pass@k from sampled completions."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from omegaconf import DictConfig

from harness.policy.memory import sampling_memory_problem
from harness.policy.sampler import sample_problems
from harness.run.checks import register_check
from harness.run.errors import ConfigError
from harness.run.seeding import step_seed


@torch.no_grad()
def evaluate(policy, tokenizer, task, cfg: DictConfig, step: int) -> tuple[dict, list[dict]]:
    """The eval metrics of ``policy`` at ``step`` and one record per eval problem (greedy completion, reference
    answer, score). ``eval_accuracy`` uses the task's training scoring; ``eval_accuracy_<name>`` each of
    ``task.eval_scores``'s scorings; ``eval_pass_at_<k>`` is logged when ``train.pass_k`` = k > 0."""
    problems = list(task.eval_problems())
    max_new = cfg.train.eval_max_new_tokens or cfg.train.max_new_tokens
    per_call = problems_per_call(cfg.train, sampled=False)
    correct, by_scoring, records = [], defaultdict(list), []
    for i in range(0, len(problems), per_call):
        chunk = problems[i : i + per_call]
        out = sample_problems(policy, tokenizer, chunk, cfg.train, group_size=1, max_new_tokens=max_new, greedy=True)
        for j, (text, problem, truncated) in enumerate(zip(out.texts, chunk, out.truncated.tolist(), strict=True)):
            score = task.score(text, problem)
            correct.append(score.correct)
            scorings = task.eval_scores(text, problem)
            for name, value in scorings.items():
                by_scoring[name].append(value)
            records.append({"step": step, "problem": i + j, "answer": problem.answer, "correct": score.correct,
                            **{f"correct_{name}": value for name, value in scorings.items()},
                            "format": score.format, "truncated": truncated, "completion": text})
    row = {"eval_accuracy": float(np.mean(correct)),
           **{f"eval_accuracy_{name}": float(np.mean(values)) for name, values in by_scoring.items()}}
    k = cfg.train.pass_k
    if k:
        row[f"eval_pass_at_{k}"] = pass_at_k(policy, tokenizer, task, problems, cfg, step, max_new)
    return row, records


def pass_at_k(policy, tokenizer, task, problems, cfg: DictConfig, step: int, max_new: int) -> float:
    """The share of ``problems`` solved by one of ``train.pass_k`` sampled completions, drawn from a stream of the
    run's seed and ``step`` inside a fork of torch's random state: the training's own draws (TRL samples from torch's
    global stream) are those of a run without pass@k."""
    k, device = cfg.train.pass_k, policy.device
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(step_seed(cfg.seed, step, stream=7))
        per_call = problems_per_call(cfg.train, sampled=True)
        solved = []
        for i in range(0, len(problems), per_call):
            chunk = problems[i : i + per_call]
            out = sample_problems(policy, tokenizer, chunk, cfg.train, group_size=k, max_new_tokens=max_new)
            hits = [task.score(t, chunk[j // k]).correct for j, t in enumerate(out.texts)]
            solved += [max(hits[j * k : (j + 1) * k]) for j in range(len(chunk))]
    return float(np.mean(solved))


def problems_per_call(train: DictConfig, sampled: bool) -> int:
    """Eval problems per sampling call: ``train.eval_batch_size`` greedy ones, or for pass@k (``sampled``)
    ``eval_batch_size // pass_k`` (at least 1) of ``pass_k`` completions each."""
    return max(1, train.eval_batch_size // train.pass_k) if sampled else train.eval_batch_size


@register_check("eval_memory", when="node")
def check_eval_memory(run: DictConfig) -> None:
    """When runs start here: the evaluation's completions sampled at once (its greedy calls', or pass@k's when more)
    fit in the device's memory (harness/policy/memory.py's floor). Both backends: TRL's every process evaluates the
    whole eval set."""
    t, problems = run.train, run.task.eval_size
    rows = min(problems_per_call(t, sampled=False), problems)
    what = f"greedy calls of train.eval_batch_size={t.eval_batch_size} problems (task.eval_size={problems})"
    if t.pass_k and min(problems_per_call(t, sampled=True), problems) * t.pass_k > rows:
        per_call = min(problems_per_call(t, sampled=True), problems)
        rows = per_call * t.pass_k
        what = (f"pass@k: train.pass_k={t.pass_k} completions for each of {per_call} problem{'s' * (per_call > 1)} "
                "per call (train.eval_batch_size // train.pass_k, at least 1)")
    problem = sampling_memory_problem(run, rows, what, held=run.backend == "native")  # the policy evaluates
    if problem:
        raise ConfigError(f"evaluation: {problem}")
