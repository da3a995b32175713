"""`make bench`: time one full step (rollout + update) of experiments/bench.yaml and compare the update's
FLOP/s with this machine's matmul peak, measured in the same run.

Update FLOPs are model FLOPs of the shapes actually computed (padding included), fwd + bwd = 3 x fwd:
  6 * N_body * (prompt + completion positions)           transformer body (N_body: parameters without embeddings)
+ 6 * d_model * vocab * completion positions             LM head, completion positions only
+ 6 * n_layers * d_model * positions * mean causal context   attention scores and values
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from harness.config import DTYPES, load_experiment, run_configs
from harness.rollout import Rollout
from harness.train import build_policy, build_task, resolve_device, sample_group, update
from objectives import get_advantage, get_objective


def matmul_peak(dtype: torch.dtype, size: int = 2048, seconds: float = 2.0) -> float:
    """Sustained FLOP/s of a square matmul in ``dtype`` on the CPU, with torch's current thread count."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
    return 2 * size**3 * reps / (time.perf_counter() - start)


def update_flops(model, ro: Rollout, epochs: int) -> float:
    cfg = model.config
    embed = model.get_input_embeddings().weight.numel()
    n_body = sum(p.numel() for p in model.parameters()) - embed
    if not cfg.tie_word_embeddings:
        n_body -= model.get_output_embeddings().weight.numel()
    prompt_len, completion_len = ro.prompt_ids.shape[1], ro.completion_ids.shape[1]
    rows = ro.prompt_ids.shape[0]
    positions = rows * (prompt_len + completion_len)
    head = 6 * cfg.hidden_size * cfg.vocab_size * rows * completion_len
    attention = 6 * cfg.num_hidden_layers * cfg.hidden_size * positions * (prompt_len + completion_len) / 2
    return epochs * (6 * n_body * positions + head + attention)


def main(overrides: list[str]) -> int:
    (cfg,) = run_configs(load_experiment("bench", overrides))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    t = cfg.train
    start = time.perf_counter()
    task = build_task(cfg)
    policy, tokenizer = build_policy(cfg, task, device)
    load_s = time.perf_counter() - start
    problems = list(task.train_problems()[: t.prompts_per_step])

    start = time.perf_counter()
    ro = sample_group(policy, tokenizer, problems, cfg)
    rollout_s = time.perf_counter() - start
    completion_tokens = int(ro.completion_mask.sum())

    objective = get_objective(cfg.objective.name, **OmegaConf.to_container(cfg.objective.params))
    rewards = torch.tensor([task.score(x, problems[i // t.group_size]).correct for i, x in enumerate(ro.texts)])
    group_ids = torch.arange(t.prompts_per_step).repeat_interleave(t.group_size)
    advantages = get_advantage(objective.default_advantage)(rewards, group_ids)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=t.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = {"optimizer_steps": 0, "total_optimizer_steps": t.num_minibatches * t.epochs, "nonfinite_skips": 0,
             "nonfinite_in_row": 0}
    start = time.perf_counter()
    update(policy, optimizer, scheduler, objective, ro, ro.sampler_logp, None, advantages.to(device),
           rewards.to(device), group_ids.to(device), cfg, 1, state)
    update_s = time.perf_counter() - start
    flops = update_flops(policy, ro, t.epochs)
    peak = matmul_peak(DTYPES[cfg.model.dtype]) if device.type == "cpu" else float("nan")

    result = {
        "model": cfg.model.name, "threads": torch.get_num_threads(), "device": str(device),
        "prompts_x_samples": f"{t.prompts_per_step}x{t.group_size}", "max_new_tokens": t.max_new_tokens,
        "num_minibatches": t.num_minibatches, "model_load_s": load_s,
        "completion_tokens": completion_tokens, "rollout_s": rollout_s, "rollout_tok_s": completion_tokens / rollout_s,
        "update_s": update_s, "update_tok_s": completion_tokens * t.epochs / update_s,
        "update_gflop_s": flops / update_s / 1e9, "matmul_peak_gflop_s": peak / 1e9,
        "update_fraction_of_peak": flops / update_s / peak,
        "step_s": rollout_s + update_s,
    }
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:{width}s}  {value:.3f}" if isinstance(value, float) else f"{key:{width}s}  {value}")
    out = Path(cfg.results_dir) / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    return 0
