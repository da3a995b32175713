"""`make gpu-check`: the GPU path of today's code in a few minutes, with the figures a GPU run is judged by.

    python -m harness gpu-check                  # cuda: the checks below at their real shapes
    python -m harness gpu-check --device cpu     # the same checks at tiny shapes: a dry run of the command

Each check is one run of two rollout steps through ``python -m harness train`` in a fresh process (so that no check
inherits another's GPU memory), all of them within a budget (``GPU_BUDGET_S`` on a GPU): the tiny model (float32, native
loop); a model of Qwen2.5-0.5B's shape (Qwen2Config built here: 24 layers, hidden 896, 14 heads / 2 key-value heads,
intermediate 4864, vocabulary 151,936, tied embeddings) with random weights, so nothing comes from the hub, in
bfloat16 through the native loop with full fine-tuning, with LoRA adapters (rank 16), and through the TRL backend.
The random model almost never samples its end of sequence (one token of 151,936): completions run the whole
``train.max_new_tokens`` (the worst case's shapes). Each check reports its second step's rollout and update
tokens/s (the first pays the one-time costs: kernels, allocator growth) and the peak memory of each phase (peak
allocated on a GPU, the process's resident set on a CPU: harness/loop/metrics.py); a failed check (or one skipped
when the budget is spent) is reported with its error and the others still run (exit status 1).

One line per check is printed as it ends, and one JSON line per invocation (commit, device, library versions, dry
run or not, the shapes, every check) is appended to ``<out>/gpu_check.jsonl`` (default ``results/bench/``).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.apps.launchers import open_log
from harness.apps.stamp import commit
from harness.policy.models import char_tokenizer
from harness.run.records import no_save_progress_bar, read_jsonl

# Qwen2.5-0.5B's shape (its config.json), and the dry run's tiny one of the same family
QWEN_05B = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
            "rope_theta": 1e6, "rms_norm_eps": 1e-6}
QWEN_DRY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 1e6,
            "rms_norm_eps": 1e-6}
# (prompts, group, new tokens, minibatches) of each step; the seconds all checks may take together (a check that
# would start with less than MIN_CHECK_S left is skipped: the command ends within its budget even if one hangs)
RECORD = "gpu_check.jsonl"  # in results/bench/ (or ``out``): one JSON line per call, appended
GPU_SIZES, DRY_SIZES = (8, 8, 256, 2), (2, 4, 8, 2)
GPU_BUDGET_S, DRY_BUDGET_S, MIN_CHECK_S = 450, 1800, 20
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "omegaconf", "datasets")


@dataclass(frozen=True)
class Check:
    name: str
    model: str  # "tiny" or "qwen" (the Qwen2.5-0.5B-shaped folder)
    dtype: str
    backend: str = "native"
    lora_rank: int = 0


CHECKS = (Check("tiny fp32, native", "tiny", "float32"), Check("qwen2 bf16, native", "qwen", "bfloat16"),
          Check("qwen2 bf16, native, LoRA r16", "qwen", "bfloat16", lora_rank=16),
          Check("qwen2 bf16, TRL backend", "qwen", "bfloat16", backend="trl"))


def qwen_folder(folder: Path, shape: dict, device: str) -> Path:
    """A Qwen2 model of ``shape`` with random weights (seed 0, built on ``device``) saved in bfloat16 with a
    character tokenizer padded to its vocabulary, in the hub layout ``model.name`` takes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = dict(shape)
    tokenizer = char_tokenizer(size=settings["vocab_size"])
    config = Qwen2Config(**{k: v for k, v in settings.items() if k != "rope_theta"}, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": settings["rope_theta"]},
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    with no_save_progress_bar():
        model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def check_overrides(check: Check, model: str, device: str, sizes: tuple[int, int, int, int], results: Path
                    ) -> list[str]:
    """The run settings of ``check`` (experiments/base.yaml beneath)."""
    prompts, group, tokens, minibatches = sizes
    return [f"model.name={model}", f"model.dtype={check.dtype}", f"model.lora.rank={check.lora_rank}",
            f"backend={check.backend}", f"device={device}", "task.name=arith", "task.eval_size=8",
            "train.steps=2", f"train.prompts_per_step={prompts}", f"train.group_size={group}",
            f"train.max_new_tokens={tokens}", f"train.num_minibatches={minibatches}", "train.eval_every=0",
            "train.eval_max_new_tokens=8", f"results_dir={results}"]


def run_check(check: Check, overrides: list[str], run_dir: Path, limit_s: float) -> dict:
    """One check's run in a fresh process stopped after ``limit_s``; its second step's figures, or its error."""
    start = time.perf_counter()
    try:
        child = subprocess.run([sys.executable, "-m", "harness", "train", "base", *overrides, "--run-dir",
                                str(run_dir), "--no-progress"], capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"check": check.name, "error": f"stopped after {limit_s:.0f} s (the budget left)"}
    wall_s = time.perf_counter() - start
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) > 0]
    if child.returncode or len(rows) < 2:
        lines = (child.stderr or child.stdout).strip().splitlines()
        return {"check": check.name, "error": lines[-1] if lines else f"exit {child.returncode}", "wall_s": wall_s}
    first, second = rows[0], rows[1]
    keys = ("rollout_tok_s", "update_tok_s", "rollout_s", "update_s", "peak_mem_rollout_mb", "peak_mem_update_mb")
    return {"check": check.name, "backend": check.backend, "dtype": check.dtype, "lora_rank": check.lora_rank,
            **{k: second.get(k) for k in keys}, "rollout_tokens": second["rollout_tokens"] - first["rollout_tokens"],
            "first_step_rollout_tok_s": first.get("rollout_tok_s"), "loss": second.get("loss"),  # None: not finite
            "wall_s": wall_s}


def device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return device


def versions() -> dict[str, str | None]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def main(device: str = "cuda", out: Path | None = None) -> int:
    """Run every check on ``device`` (``cpu``: the dry run's tiny shapes), print the table, append the JSON line."""
    dry = device == "cpu"
    if not dry and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; `make gpu-check DEVICE=cpu` runs the same checks at tiny shapes",
              file=sys.stderr)
        return 2
    record_path = (out or Path("results") / "bench") / RECORD
    if record_path.is_symlink() or record_path.exists() and not record_path.is_file():
        print(f"gpu-check: {record_path} is a symbolic link or not a file: its line is never appended through a "
              "link; remove it, or run from another folder", file=sys.stderr)
        return 2
    sizes, budget_s, shape = (DRY_SIZES, DRY_BUDGET_S, QWEN_DRY) if dry else (GPU_SIZES, GPU_BUDGET_S, QWEN_05B)
    start, results = time.perf_counter(), []
    print(f"gpu-check on {device_name(device)}{' (dry run: tiny shapes)' if dry else ''}: qwen2 = {shape}",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        folder = Path(scratch)
        qwen = str(qwen_folder(folder / "qwen", shape, device))
        for k, check in enumerate(CHECKS):
            left_s = budget_s - (time.perf_counter() - start)
            if left_s < MIN_CHECK_S:
                results.append({"check": check.name, "error": f"skipped: the {budget_s} s budget is spent"})
            else:
                overrides = check_overrides(check, qwen if check.model == "qwen" else "tiny", device, sizes,
                                            folder / "results")
                results.append(run_check(check, overrides, folder / f"run{k}", left_s))
            print(line(results[-1]), file=sys.stderr)
    record = {"commit": commit(), "device": device_name(device), "dry_run": dry, "versions": versions(),
              "qwen2_shape": shape, "checks": results, "wall_s": time.perf_counter() - start,
              "sizes": dict(zip(("prompts", "group_size", "max_new_tokens", "num_minibatches"), sizes, strict=True))}
    record_path.parent.mkdir(parents=True, exist_ok=True)
    with open_log(record_path) as f:  # never through a link (one put there meanwhile: OSError ELOOP)
        f.write(json.dumps(record) + "\n")
    print(f"{record['device']}{' (dry run)' if dry else ''}, commit {record['commit']}, {record['wall_s']:.0f} s -> "
          f"{record_path}")
    return 1 if any("error" in r for r in results) else 0


def line(result: dict) -> str:
    """One check's figures in one line."""
    if "error" in result:
        return f"{result['check']}: FAILED: {result['error']}"
    return (f"{result['check']}: rollout {result['rollout_tok_s']:.0f} tok/s, update {result['update_tok_s']:.0f} "
            f"tok/s, peak {result['peak_mem_rollout_mb']:.0f} / {result['peak_mem_update_mb']:.0f} MiB "
            f"(rollout / update), {result['wall_s']:.0f} s")
