"""Held-out evaluation, the same for both backends: greedy accuracy on the task's fixed eval set (under the
training scoring, and under each of the task's named scorings), optionally pass@k from sampled completions."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from omegaconf import DictConfig

from harness.policy.sampler import sample_problems
from harness.run.seeding import step_seed


@torch.no_grad()
def evaluate(policy, tokenizer, task, cfg: DictConfig, step: int) -> tuple[dict, list[dict]]:
    """The eval metrics of ``policy`` at ``step`` and one record per eval problem (greedy completion, reference
    answer, score). ``eval_accuracy`` uses the task's training scoring; ``eval_accuracy_<name>`` each of
    ``task.eval_scores``'s scorings; ``eval_pass_at_<k>`` is logged when ``train.pass_k`` = k > 0."""
    problems = list(task.eval_problems())
    max_new = cfg.train.eval_max_new_tokens or cfg.train.max_new_tokens
    per_call = cfg.train.eval_batch_size  # problems per greedy call
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
        torch.manual_seed(step_seed(cfg.seed, step, stream=7))
        per_call = max(1, cfg.train.eval_batch_size // k)  # problems per sampled call: k completions each
        solved = []
        for i in range(0, len(problems), per_call):
            chunk = problems[i : i + per_call]
            out = sample_problems(policy, tokenizer, chunk, cfg.train, group_size=k, max_new_tokens=max_new)
            hits = [task.score(t, chunk[j // k]).correct for j, t in enumerate(out.texts)]
            solved += [max(hits[j * k : (j + 1) * k]) for j in range(len(chunk))]
        row[f"eval_pass_at_{k}"] = float(np.mean(solved))
    return row, records
