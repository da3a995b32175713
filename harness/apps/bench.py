"""`make bench`: time one full step (rollout + update) of experiments/bench.yaml and compare the update's
FLOP/s with this machine's matmul peak, measured in the same run. Then run TRL's own GRPOTrainer on the same
model (a copy of the same initial weights), prompts, group size, lengths and minibatches, in the same process,
and print the per-step wall-time ratio, tokens/s of both and where the time goes in each (``phase_*``).
Each side is timed at its second step of the same sizes, as in a run of many steps: the first, untimed
(``warm_up_step_s``, ``trl_warm_up_step_s``), pays the one-time costs; the heap is given back to the kernel before
each side (harness/run/allocator.py), so neither inherits the other's pages. Each side's peak memory per phase
(``peak_mem_rollout_mb``, ``peak_mem_update_mb``; ``trl_peak_mem_*``: over TRL's two steps) is the process's peak
resident set size in that phase on the CPU (harness/loop/metrics.py; the process holds both sides' weights), the
peak allocated memory on a GPU; ``max_rss_gb`` is the whole process's.
Any model: ``python -m harness bench model.name=tiny task.name=arith train.max_new_tokens=64`` (about a minute).

Update FLOPs are the model FLOPs owed for the real tokens (padding is not work: as for the decode, and since the
trainer's forward skips the completions' padding, harness/policy/forward.py, a fraction of the peak that a padded
forward cannot inflate), fwd + bwd = 3 x fwd:
  6 * N_body * (prompt + completion tokens)           transformer body (N_body: parameters without embeddings;
                                                      each distinct prompt once, its rows share the pass)
+ 6 * d_model * vocab * completion tokens             LM head, completion positions only
+ 6 * n_layers * d_model * tokens * mean causal context   attention scores and values
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from harness.apps.stamp import commit, machine
from harness.loop.batch import TrainBatch
from harness.loop.build import RunSetup, build_learner, build_objective, build_task, check_task_positions, setup_run
from harness.loop.metrics import PhaseMemory, peak_memory_mb
from harness.loop.native import update
from harness.loop.update import Learner, RunState, Timings, UpdatePlan
from harness.policy.device import DTYPES, resolve_device
from harness.policy.matmul import cpu_matmul, linear, resolve
from harness.policy.models import (
    char_tokenizer,
    load_model,
    model_folder,
    skeleton,
)
from harness.policy.sampler import Rollout, decoder_memory, sample_problems
from harness.run.allocator import ENV as ALLOCATOR_ENV
from harness.run.allocator import release_freed_memory
from harness.run.atomic import atomic_write
from harness.run.commandline import SCALE_ROWS, SCALE_TOKENS
from harness.run.config import TINY_MODELS, check_this_machine, load_experiment, run_configs, updates_per_step
from harness.run.errors import ConfigError
from harness.run.threads import cores as threads_cores
from harness.run.threads import run_threads
from objectives import reads_reference_policy
from objectives.advantages import loop_inputs


def matmul_peak(dtype: torch.dtype, size: int = 2048, seconds: float = 2.0, kernel: str | None = None) -> float:
    """Sustained FLOP/s of a square matmul in ``dtype`` on the CPU, with torch's current thread count: ``a @ b``, or
    with ``kernel`` (a ``train.cpu_matmul`` value) a linear layer's ``a b^T`` on that kernel
    (harness/policy/matmul.py)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    with nullcontext() if kernel is None else cpu_matmul(kernel):
        multiply = (lambda: a @ b) if kernel is None else functools.partial(linear, a, b)
        multiply()
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            multiply()
            reps += 1
    return 2 * size**3 * reps / (time.perf_counter() - start)


MATMUL_OPERATORS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def machine_peak(cfg: DictConfig) -> float:
    """The square-matmul rate a step's FLOP/s are read against: the larger of torch's kernel's and, in float32, the
    run's (``train.cpu_matmul``: oneDNN's on AMD processors with AVX512, where it is the faster), so that a native
    step on the faster kernel is not read above 100%."""
    dtype = DTYPES[cfg.model.dtype]
    kernel = resolve(cfg.train.cpu_matmul)
    return max(matmul_peak(dtype), matmul_peak(dtype, kernel=kernel) if dtype == torch.float32 and kernel != "torch"
               else 0.0)


def matmul_flops(name: str, shapes: list[list[int]]) -> int | None:
    """2 x the multiply-adds of one call of a matmul operator (:data:`MATMUL_OPERATORS`) from its input shapes
    (``torch.profiler``'s ``record_shapes``); None for any other operator. oneDNN's linear is (X [..., K], W [N, K],
    bias, ...), or (X, other, W, ...) in its form that adds ``other`` (harness/policy/matmul.py ``linear_add``)."""
    if name == "mkldnn::_linear_pointwise":
        weight = shapes[2] if len(shapes) > 2 and len(shapes[2]) == 2 else shapes[1]
        return 2 * math.prod(shapes[0][:-1]) * weight[0] * weight[1]
    if name not in MATMUL_OPERATORS:
        return None
    a, b = shapes[1:3] if name in ("aten::addmm", "aten::baddbmm") else shapes[:2]  # those two: (C, A, B, beta, alpha)
    return 2 * math.prod(a) * b[-1]  # [M, K] x [K, N], or batched: [B, M, K] x [B, K, N]


def matmul_totals(prof) -> tuple[dict[str, tuple[float, float]], float]:
    """Of a profile taken with ``record_shapes``: each matmul operator's (FLOPs, self CPU seconds) by name, and every
    operator's self CPU seconds."""
    by_name, total = {}, 0.0
    for event in prof.events():
        total += event.self_cpu_time_total / 1e6
        work = matmul_flops(event.name, event.input_shapes)
        if work is not None:
            flops, seconds = by_name.get(event.name, (0, 0.0))
            by_name[event.name] = flops + work, seconds + event.self_cpu_time_total / 1e6
    return by_name, total


def matmul_share(prof) -> str:
    """:func:`matmul_totals` as one line: each matmul operator's FLOPs, self CPU time and rate, and their share of
    every operator's time: how far a phase is from the arithmetic its matmuls cannot skip (a linear layer's
    operator near a large matmul's rate is bound by its arithmetic; attention's batched matrix-vector products by
    memory)."""
    by_name, total = matmul_totals(prof)
    parts = [f"{name} {flops / 1e9:.2f} GFLOP in {seconds:.3f} s ({flops / 1e9 / max(seconds, 1e-9):.1f} GFLOP/s)"
             for name, (flops, seconds) in sorted(by_name.items(), key=lambda item: -item[1][1])]
    share = sum(seconds for _, seconds in by_name.values()) / max(total, 1e-9)
    return f"matmuls: {'; '.join(parts) or 'none'}; {share:.0%} of {total:.3f} s self CPU time"


def decode_matmuls(model, rows=(1024, 64, 32, 8), rounds: int = 10) -> list[dict]:
    """GFLOP/s of the decode step's matmul shapes (the LM head and, stacked as the shared-prefix decoder runs
    them, q+k+v, o, gate+up, down) through MKL (``F.linear``, as ``nn.Linear``) and through oneDNN
    (:class:`harness.policy.decode.Matmul`'s kernel), at each number of ``rows`` (1024: the tokens of an update's
    micro-batch, what ``train.cpu_matmul`` decides; 64 and fewer: a decode step's): medians over ``rounds`` interleaved
    rounds, random weights of the model's shapes, one copy per layer called in turn (as a decode step reads them:
    from memory, not from a cache a single weight would stay in), torch's current thread count."""
    config = model.config.get_text_config()
    d, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    shapes = {"lm_head": (config.vocab_size, d), "q+k+v": ((heads + 2 * kv) * head_dim, d),
              "o": (d, heads * head_dim), "gate+up": (2 * config.intermediate_size, d),
              "down": (d, config.intermediate_size)}
    weights = {name: [torch.randn(out_features, in_features)
                      for _ in range(1 if name == "lm_head" else config.num_hidden_layers)]
               for name, (out_features, in_features) in shapes.items()}
    packed = {name: [weight.to_mkldnn() for weight in copies] for name, copies in weights.items()}
    table = []
    for n in rows:
        row = {"rows": n}
        for name, (out_features, in_features) in shapes.items():
            x = torch.randn(n, in_features)
            kernels = {"mkl": [functools.partial(torch.nn.functional.linear, x, weight) for weight in weights[name]],
                       "onednn": [functools.partial(torch.ops.mkldnn._linear_pointwise, x, weight, None, "none", [],
                                                    "") for weight in packed[name]]}
            calls = max(5, len(weights[name]))  # per round: every copy at least once
            speeds = {kernel: [] for kernel in kernels}
            for _ in range(rounds):
                for kernel, copies in kernels.items():
                    copies[0]()
                    start = time.perf_counter()
                    for i in range(calls):
                        copies[i % len(copies)]()
                    speeds[kernel].append(2 * n * in_features * out_features * calls / (time.perf_counter() - start))
            for kernel, values in speeds.items():
                row[f"{name}_{kernel}_gflop_s"] = statistics.median(values) / 1e9
        table.append(row)
    return table


def matmuls_main(overrides: list[str]) -> int:
    """``bench --matmuls``: :func:`decode_matmuls` for the bench model's shapes, one line per number of rows."""
    (cfg,) = run_configs(load_experiment("bench", overrides))
    run_threads(cfg.threads)
    model, _ = load_model(cfg.model.name, tiny=OmegaConf.to_container(cfg.model.tiny) if cfg.model.name == "tiny"
                          else None)
    print(f"decode matmuls, {torch.get_num_threads()} threads, GFLOP/s MKL / oneDNN "
          f"(load average {os.getloadavg()[0]:.2f} before)")
    for row in decode_matmuls(model):
        cells = [f"{name.removesuffix('_mkl_gflop_s')} {row[name]:.0f} / {row[name.replace('_mkl', '_onednn')]:.0f}"
                 for name in row if name.endswith("_mkl_gflop_s")]
        print(f"rows {row['rows']:3d}: " + ", ".join(cells))
    return 0


def checked_bench(overrides: list[str]) -> DictConfig:
    """experiments/bench.yaml with ``overrides``, checked as a run is (its settings, then this machine: a hub model or
    dataset that cannot be had, an unusable cache) and as the bench's step needs (no reference policy): a ConfigError
    in one line before anything is built or any process of the bench starts."""
    (cfg,) = run_configs(load_experiment("bench", overrides))
    if reads_reference_policy(*build_objective(cfg)):
        raise ConfigError("the bench times a step without the reference policy (no KL term, no objective or estimator "
                          "that reads it): set objective.params.beta=0 and another objective (a2po reads it) or "
                          "objective.advantage (a2po samples it)")
    check_this_machine([cfg])
    return cfg


def bench_run(overrides: list[str]) -> tuple[DictConfig, RunSetup, list, int]:
    """experiments/bench.yaml with ``overrides``: its config, its torch threads set and seeded, what the run is made
    of (harness/loop/build.py), the first ``prompts_per_step`` train problems (the timed steps' prompts), the thread
    count."""
    cfg = checked_bench(overrides)
    objective, estimator = build_objective(cfg)
    threads = run_threads(cfg.threads)
    setup = setup_run(cfg, resolve_device(cfg.device))
    # seeded after the model is loaded: building the embedded model's cache in this process (a fresh RLVR_CACHE)
    # draws from torch's generator, and the bench sampled other completions than with the cache built
    torch.manual_seed(cfg.seed)
    if loop_inputs(setup.estimator):  # before any timed work
        raise ConfigError(f"the bench times a step with the plain advantage estimators; this run's estimator needs "
                          f"what only the training loop provides ({', '.join(loop_inputs(setup.estimator))}): "
                          "set another objective.advantage")
    return cfg, setup, list(setup.train_problems[: cfg.train.prompts_per_step]), threads


def profile_main(overrides: list[str], rows: int = 15) -> int:
    """``bench --profile``: after one untimed step (:func:`warm_up`), ``torch.profiler``'s operators of one native
    rollout and one native update of the bench configuration, by self CPU time (the ``rows`` largest): where the
    time of each goes, with the op counts that tell per-op cost from compute. On a CPU each phase's matmuls too
    (:func:`matmul_share`: their FLOPs, share of the time and rate), beside the rate of a large square matmul
    (:func:`matmul_peak`): a phase whose matmuls run near that rate and take most of its time is bound by its
    arithmetic, one whose other operators take most of it by their number."""
    from torch.profiler import profile

    cfg, setup, problems, _ = bench_run(overrides)
    learner = build_learner(setup.policy, setup.objective, cfg.train)
    warm_up(learner, setup, problems, cfg)
    print(f"{cfg.model.name}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f} before")
    with profile(record_shapes=True) as rollout_profile:  # shapes: the matmuls' FLOPs
        ro = native_rollout(setup.policy, setup.tokenizer, problems, cfg)
    with profile(record_shapes=True) as update_profile:
        bench_update(learner, setup, ro, problems, cfg, 1)
    for name, result in (("rollout", rollout_profile), ("update", update_profile)):
        print(f"one {name} ({int(ro.completion_mask.sum())} completion tokens)")
        print(result.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
        if setup.device.type == "cpu":  # on a GPU the self CPU time is the kernels' launch, not their work
            print(matmul_share(result))
    if setup.device.type == "cpu":  # the run's kernel beside torch's (train.cpu_matmul: where they differ)
        kernels = dict.fromkeys(("torch", resolve(cfg.train.cpu_matmul)))
        rates = [f"{kernel}'s kernel {matmul_peak(torch.float32, seconds=1.0, kernel=kernel) / 1e9:.1f} GFLOP/s"
                 for kernel in kernels]
        threads = torch.get_num_threads()
        print(f"a 2048 x 2048 float32 matmul here, {threads} thread{'s' * (threads > 1)}: {', '.join(rates)} (the "
              f"run's: {resolve(cfg.train.cpu_matmul)}'s)")
    return 0


def memory_main(overrides: list[str], rows: int = 12) -> int:
    """``bench --memory``: after one untimed step (:func:`warm_up`), the peak memory of one native rollout and one
    native update of the bench configuration (harness/loop/metrics.py), beside what the model's size implies
    (weights, gradients, AdamW's two moments), the largest minibatch's logits [real completion tokens, vocab] in
    fp32 and what the sampler's decoder holds beyond the weights (its weight copies; its keys/values at capacity);
    then ``torch.profiler``'s operators of the update by the memory they allocate (``Self CPU Mem``)."""
    from torch.profiler import profile

    cfg, setup, problems, _ = bench_run(overrides)
    learner = build_learner(setup.policy, setup.objective, cfg.train)
    warm_up(learner, setup, problems, cfg)
    print(f"{cfg.model.name}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f} before")
    memory, clocks = PhaseMemory(setup.device), [(time.perf_counter(), time.process_time())]
    memory.start("rollout")
    ro = native_rollout(setup.policy, setup.tokenizer, problems, cfg)
    memory.start("update")
    clocks.append((time.perf_counter(), time.process_time()))
    # the profiler's bookkeeping (shapes and stacks, which its memory timeline needs) slows the update and holds
    # memory of its own: the phase peaks above are the process's, the categories below torch's live tensors
    with profile(profile_memory=True, record_shapes=True, with_stack=True) as update_profile:
        bench_update(learner, setup, ro, problems, cfg, 1)
    clocks.append((time.perf_counter(), time.process_time()))
    for name, k in (("rollout", 0), ("update", 1)):
        print(f"{name}_s {clocks[k + 1][0] - clocks[k][0]:.1f} (CPU {clocks[k + 1][1] - clocks[k][1]:.1f} s)")
    mib = 2**20
    weights = sum(p.numel() * p.element_size() for p in setup.policy.parameters()) / mib
    per_minibatch = ro.completion_mask.sum(-1).view(cfg.train.num_minibatches, -1).sum(-1)  # bench: rows in order
    logits = int(per_minibatch.max()) * setup.policy.config.get_text_config().vocab_size * 4 / mib
    decoder = decoder_memory(setup.policy, setup.tokenizer, problems, cfg.train)
    for key, value in {**memory.metrics(), "weights_mb": weights, "gradients_mb": weights,
                       "adamw_moments_mb": 2 * weights, "largest_minibatch_logits_fp32_mb": logits,
                       "sampler_weight_copies_mb": decoder["weight_copies"] / mib,
                       "sampler_keys_values_and_tables_mb": decoder["state"] / mib}.items():
        print(f"{key:34s} {value:9.0f}")
    print(f"(the sampler's {decoder['kind']}: keys/values at their capacity, {len(problems)} prompts x "
          f"{cfg.train.group_size} rows x {cfg.train.max_new_tokens} new tokens)")
    peak, categories = live_tensors_at_peak(update_profile, str(setup.device))
    print(f"the update's live tensors at their peak: {peak / mib:.1f} MiB: " +
          ", ".join(f"{name} {size / mib:.1f}" for name, size in categories.items() if size))
    print(update_profile.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=rows))
    return 0


def live_tensors_at_peak(prof, device: str) -> tuple[int, dict[str, int]]:
    """From ``torch.profiler``'s memory timeline of a profile (``profile_memory``, ``record_shapes``, ``with_stack``):
    the bytes of live tensors on ``device`` at their peak, and those bytes by the profiler's categories (parameter,
    optimizer state, activation, gradient, autograd detail, input, temporary, unknown)."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX  # the index -> category of the raw export

    names = {index: (category.name.lower() if category is not None else "unknown")
             for category, index in _CATEGORY_TO_INDEX.items()}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "timeline.raw.json.gz"
        prof.export_memory_timeline(str(path), device=device)
        with gzip.open(path, "rt") as f:
            events = sorted(json.load(f), key=lambda event: event[0])  # (time, action, bytes, category)
    live, peak, at_peak = dict.fromkeys(names.values(), 0), 0, {}
    for _, _, size, category in events:
        live[names.get(category, "unknown")] += size
        if sum(live.values()) > peak:
            peak, at_peak = sum(live.values()), dict(live)
    return peak, at_peak


def step_main(overrides: list[str], full_length: bool = False) -> int:
    """``bench --step`` (the child of ``--busy``, ``--scale`` and ``--lora``): one native step (rollout + update) timed
    after an untimed one of the same sizes; prints one JSON line with the threads used, the parameters trained (all,
    or LoRA's adapters), the seconds, the completion tokens,
    the measured step's peak memory per phase and the process's peak over both steps (``peak_mem_process_mb``).
    ``full_length``: every row samples ``train.max_new_tokens`` tokens (EOS never drawn: the worst-case shapes)."""
    cfg, setup, problems, threads = bench_run(overrides)
    learner = build_learner(setup.policy, setup.objective, cfg.train)
    sampling = {"stop_at_eos": False} if full_length else {}
    memory = PhaseMemory(setup.device)
    memory.start("warm_up")
    warm_up(learner, setup, problems, cfg, **sampling)
    memory.start("rollout")
    start, cpu_start = time.perf_counter(), time.process_time()
    ro = native_rollout(setup.policy, setup.tokenizer, problems, cfg, **sampling)
    rollout_s = time.perf_counter() - start
    memory.start("update")
    bench_update(learner, setup, ro, problems, cfg, 1)
    step_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    peaks = memory.metrics(total=False)
    process = max(peaks.values())
    trained = sum(p.numel() for p in setup.policy.parameters() if p.requires_grad)
    print(json.dumps({"threads": threads, "trained_parameters": trained, "step_s": step_s, "rollout_s": rollout_s,
                      "update_s": step_s - rollout_s,
                      "step_cpu_s": cpu_s, "rows": int(ro.completion_ids.shape[0]),
                      "completion_tokens": int(ro.completion_mask.sum()),
                      "peak_mem_rollout_mb": peaks["peak_mem_rollout_mb"],
                      "peak_mem_update_mb": peaks["peak_mem_update_mb"], "peak_mem_process_mb": process}))
    return 0


LORA_RANK = 16  # `bench --lora`'s adapters' rank, unless the overrides set model.lora.rank


def lora_main(overrides: list[str], out: Path | None = None) -> int:
    """``bench --lora``: one native step of the bench configuration with full fine-tuning and one with LoRA
    adapters (``model.lora.rank`` of the overrides, else ``LORA_RANK``), each ``bench --step`` in a fresh process
    (neither inherits the other's heap) timed after an untimed step of the same sizes, from the same weights and
    random stream (the adapters start at B = 0: the same rollouts). Prints a Markdown table of the seconds and peak
    memory per phase, stamped with the commit, the machine and the load before and after each side, and writes it
    with the figures to ``<results_dir>/bench/lora.md`` and ``lora.json``."""
    (cfg,) = run_configs(load_experiment("bench", overrides))
    rank = cfg.model.lora.rank or LORA_RANK
    sides = [("full fine-tuning", [*overrides, "model.lora.rank=0", "model.lora.export_merged=false"]),
             (f"LoRA rank {rank}", [*overrides, f"model.lora.rank={rank}"])]
    for _, side in sides:  # both sides checked (one line) before either runs
        checked_bench(side)
    points = []
    for name, side in sides:
        load = os.getloadavg()[0]
        child = subprocess.run([sys.executable, "-m", "harness", "bench", "--step", *side], capture_output=True,
                               text=True)
        if child.returncode:
            lines = child.stderr.strip().splitlines()
            raise RuntimeError(f"bench --lora, {name}: {lines[-1] if lines else f'exit {child.returncode}'}")
        step = json.loads(child.stdout.strip().splitlines()[-1])
        points.append({"side": name, "load_before": load, "load_after": os.getloadavg()[0], **step})
        print(f"{name}: step {step['step_s']:.1f} s, peak {step['peak_mem_process_mb']:.0f} MiB", file=sys.stderr)
    t = cfg.train
    command = " ".join(["python -m harness bench --lora", *overrides])
    head = (f"`{command}` — {cfg.model.name}, {cfg.task.name}, {t.prompts_per_step} prompts x {t.group_size}, up to "
            f"{t.max_new_tokens} new tokens, {t.num_minibatches} minibatches; commit {commit()}; "
            f"{machine(1).split(',')[0]}, {os.cpu_count()} cores, {points[0]['threads']} torch thread(s). Each side "
            "a fresh process, its step timed after an untimed one; peaks in MiB (CPU: the process's peak resident "
            "set size in the phase; GPU: peak allocated).\n\n")
    rows = ["| | trained parameters | tokens | rollout s | update s | step s | step CPU s | rollout peak | update peak "
            "| process peak | load before / after |", "|" + "---|" * 11]
    rows += [f"| {p['side']} | {p['trained_parameters']:,} | {p['completion_tokens']:,} | {p['rollout_s']:.1f} | "
             f"{p['update_s']:.1f} | {p['step_s']:.1f} | {p['step_cpu_s']:.1f} | {p['peak_mem_rollout_mb']:,.0f} | "
             f"{p['peak_mem_update_mb']:,.0f} | {p['peak_mem_process_mb']:,.0f} | {p['load_before']:.2f} / "
             f"{p['load_after']:.2f} |" for p in points]
    table = head + "\n".join(rows)
    folder = out or Path(cfg.results_dir) / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "lora.json", json.dumps(points, indent=2))
    atomic_write(folder / "lora.md", table + "\n")
    print(table)
    return 0


def scale_main(overrides: list[str], rows: tuple[int, ...] = SCALE_ROWS, tokens: tuple[int, ...] = SCALE_TOKENS,
               out: Path | None = None) -> int:
    """``bench --scale``: peak memory and step time against the rollout's sequences and completion length. For each
    (rows, tokens) point a fresh process (``bench --step``, so no point inherits another's heap) runs the bench
    configuration with ``overrides``, ``train.prompts_per_step = rows / train.group_size`` and ``train.max_new_tokens
    = tokens``, every row sampling all ``tokens`` (EOS never drawn: what fits at the worst case), its step timed
    after an untimed one; ``train.num_minibatches`` stays the configuration's, so a minibatch holds rows /
    num_minibatches sequences. Prints a Markdown table, stamped with the commit, the machine and the load before and
    after each point, and writes it with the figures to ``<results_dir>/bench/scale.md`` and ``scale.json``. Every
    point's settings, and the room for the task's prompts beside the longest completions, are checked before any point
    runs (one line)."""
    (cfg,) = run_configs(load_experiment("bench", overrides))
    group = cfg.train.group_size
    if bad := [r for r in rows if r % group]:
        raise ConfigError(f"bench --scale: rows {bad} must be multiples of train.group_size={group}")
    grid = [(r, t, [*overrides, f"train.prompts_per_step={r // group}", f"train.max_new_tokens={t}"])
            for r in rows for t in tokens]
    for _, _, point in grid:  # every point's settings checked (one line) before any point runs
        run_configs(load_experiment("bench", point))
    check_prompt_room(checked_bench(max(grid, key=lambda g: g[1])[2]))  # the longest completions: the prompts too
    points, folder = [], out or Path(cfg.results_dir) / "bench"
    for r, t, point in grid:
        load = os.getloadavg()[0]
        child = scale_point(point)
        if child.returncode > 0:
            lines = child.stderr.strip().splitlines()
            said = f"bench --scale at {r} rows x {t} tokens: {lines[-1] if lines else 'failed'}"
            if child.returncode == 2:  # a setting its model refuses as it loads (a hub model's positions)
                raise ConfigError(said.replace(": config error: ", ": ", 1))
            raise RuntimeError(said)
        step = (json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 else  # else a signal:
                {"killed": f"signal {-child.returncode}"})  # SIGKILL is the kernel's out-of-memory killer's
        points.append({"rows": r, "max_new_tokens": t, "load_before": load, "load_after": os.getloadavg()[0], **step})
        print(f"{r} rows x {t} tokens: " + (step.get("killed") or f"step {step['step_s']:.1f} s, peak "
                                             f"{step['peak_mem_process_mb']:.0f} MiB"), file=sys.stderr)
        table = scale_table(cfg, overrides, points)  # written after every point: a kill keeps what was measured
        folder.mkdir(parents=True, exist_ok=True)  # not before a point has run: a refused one leaves no folder
        atomic_write(folder / "scale.json", json.dumps(points, indent=2))
        atomic_write(folder / "scale.md", table + "\n")
    print(table)
    return 0


def check_prompt_room(cfg: DictConfig) -> None:
    """ConfigError when the task's longest prompt and ``cfg``'s completions need more positions than its model takes
    (``check_task_positions``, which a run calls as its model loads), read from the model's config and tokenizer
    without its weights; nothing for a hub id, whose config is read when a point loads it."""
    tiny = OmegaConf.to_container(cfg.model.tiny) if cfg.model.name in TINY_MODELS else None
    model = skeleton(cfg.model.name, tiny)
    if model is None:
        return
    tokenizer = char_tokenizer() if tiny is not None else AutoTokenizer.from_pretrained(model_folder(cfg.model.name))
    check_task_positions(cfg, model, tokenizer, build_task(cfg))


def scale_point(overrides: list[str]) -> subprocess.CompletedProcess:
    """One point of ``bench --scale``: ``bench --step --full-length`` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "harness", "bench", "--step", "--full-length", *overrides],
                          capture_output=True, text=True)


def scale_table(cfg: DictConfig, overrides: list[str], points: list[dict]) -> str:
    """``bench --scale``'s Markdown table: one line per point."""
    t, threads = cfg.train, next((p["threads"] for p in points if "threads" in p), "?")
    command = ["python -m harness bench --scale", f"--rows {','.join(map(str, sorted({p['rows'] for p in points})))}",
               f"--tokens {','.join(map(str, sorted({p['max_new_tokens'] for p in points})))}", *overrides]
    head = (f"`{' '.join(command)}` — {cfg.model.name}, {cfg.task.name}, group size {t.group_size}, "
            f"{t.num_minibatches} minibatches, every row at full length (EOS never drawn); commit {commit()}; "
            f"{machine(1).split(',')[0]}, {os.cpu_count()} cores, {threads} torch thread(s), "
            f"{ALLOCATOR_ENV}={os.environ.get(ALLOCATOR_ENV, '1 (unset)')}. Peaks in MiB (CPU: the process's peak "
            "resident set size in the phase, which includes the heap harness/run/allocator.py keeps from earlier "
            "phases unless RLVR_KEEP_FREED_MEMORY is 0 or release; GPU: peak allocated); the process peak covers the "
            "untimed first step too.\n\n")
    rows = ["| sequences | new tokens | tokens | rollout peak | update peak | process peak | rollout s | update s | "
            "step s | step CPU s | load before / after |", "|" + "---|" * 11]
    for p in points:
        if "killed" in p:
            rows.append(f"| {p['rows']} | {p['max_new_tokens']} | — | the process was killed ({p['killed']}) | | | | | "
                        f"| | {p['load_before']:.2f} / {p['load_after']:.2f} |")
            continue
        rows.append(f"| {p['rows']} | {p['max_new_tokens']} | {p['completion_tokens']:,} | "
                    f"{p['peak_mem_rollout_mb']:,.0f} | {p['peak_mem_update_mb']:,.0f} | "
                    f"{p['peak_mem_process_mb']:,.0f} | {p['rollout_s']:.1f} | {p['update_s']:.1f} | "
                    f"{p['step_s']:.1f} | {p['step_cpu_s']:.1f} | {p['load_before']:.2f} / {p['load_after']:.2f} |")
    return head + "\n".join(rows)


BUSY_PROCESS = "while True: pass"  # the other busy process of ``bench --busy``: one core's worth of work


def busy_main(overrides: list[str]) -> int:
    """``bench --busy``: the cost of oversubscribed cores. One native step (``bench --step``, a fresh process each)
    per thread setting — all cores (torch's default), threads=0 (the free cores: harness/run/threads.py), one thread,
    all cores with a passive OpenMP wait — first on the machine as it is, then beside one busy process. Prints a
    table and writes results/bench/busy.json; the load before each half is printed: other load skews both."""
    checked_bench(overrides)  # one line before the first child, not the last line of a child after its start-up
    all_cores = threads_cores()
    settings = [("all cores (torch's default)", all_cores, {}), ("threads=0 (the free cores)", 0, {}),
                ("threads=1", 1, {}), ("all cores, OMP_WAIT_POLICY=PASSIVE", all_cores, {"OMP_WAIT_POLICY": "PASSIVE"})]
    results = []
    for background in ("as it is", "beside a busy process"):
        spinner = (subprocess.Popen([sys.executable, "-c", BUSY_PROCESS]) if background != "as it is" else None)
        try:
            if spinner:
                time.sleep(1.0)
            load = os.getloadavg()[0]
            print(f"{background}: load average {load:.2f} on {all_cores} cores", file=sys.stderr)
            for name, threads, env in settings:
                child_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env
                out = subprocess.run([sys.executable, "-m", "harness", "bench", "--step", *overrides,
                                      f"threads={threads}"], capture_output=True, text=True, env=child_env)
                if out.returncode:
                    print(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "bench --step failed",
                          file=sys.stderr)
                    return 1
                step = json.loads(out.stdout.strip().splitlines()[-1])
                results.append({"machine": background, "load_avg_1m": load, "setting": name, **step})
        finally:
            if spinner:
                spinner.kill()
                spinner.wait()
    width = max(len(r["setting"]) for r in results)
    print(f"{'setting':{width}s}  {'threads':>7s}  {'step s (as it is)':>17s}  {'step s (beside a busy process)':>30s}")
    for name, _, _ in settings:
        idle, busy = (next(r for r in results if r["setting"] == name and r["machine"] == m)
                      for m in ("as it is", "beside a busy process"))
        print(f"{name:{width}s}  {idle['threads']:>3d} {busy['threads']:>3d}  {idle['step_s']:17.2f}  "
              f"{busy['step_s']:30.2f}")
    out = Path("results") / "bench"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "busy.json", json.dumps(results, indent=2))
    return 0


def body_parameters(model) -> int:
    """Parameters of the transformer body: everything but the input embeddings and an untied LM head."""
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    if not model.config.tie_word_embeddings:
        n -= model.get_output_embeddings().weight.numel()
    return n


def update_flops(model, ro: Rollout, epochs: int) -> float:
    """Model FLOPs of the update's forward + backward over the real tokens (no work is owed for padding): each
    distinct prompt once (its rows share the pass) and every row's completion, body, LM head on completion
    positions, attention over the mean causal context."""
    cfg = model.config
    distinct, prompt_of_row = torch.unique(torch.cat([ro.prompt_ids, ro.prompt_mask], 1), dim=0, return_inverse=True)
    prompt_lengths = ro.prompt_mask.sum(-1).float()
    prompt_tokens = float(prompt_lengths.new_zeros(len(distinct)).scatter_(0, prompt_of_row, prompt_lengths).sum())
    completion_tokens = float(ro.completion_mask.sum())
    positions = prompt_tokens + completion_tokens
    context = ro.prompt_mask.sum(-1).float().mean().item() + ro.completion_mask.sum(-1).float().mean().item() / 2
    head = 6 * cfg.hidden_size * cfg.vocab_size * completion_tokens
    attention = 6 * cfg.num_hidden_layers * cfg.hidden_size * positions * context
    return epochs * (6 * body_parameters(model) * positions + head + attention)


def decode_flops(model, ro: Rollout) -> float:
    """Forward model FLOPs of the generated tokens (valid ones only: no work is owed for padding): body, LM head
    and attention over the mean context; the prompt prefill is not counted."""
    cfg = model.config
    tokens = float(ro.completion_mask.sum())
    context = ro.prompt_mask.sum(-1).float().mean().item() + ro.completion_mask.sum(-1).float().mean().item() / 2
    per_token = 2 * body_parameters(model) + 2 * cfg.hidden_size * cfg.vocab_size \
        + 4 * cfg.num_hidden_layers * cfg.hidden_size * context
    return tokens * per_token


def main(overrides: list[str], repeats: int = 1) -> int:
    load_before = os.getloadavg()[0]  # other processes sharing the cores slow both sides alike
    start = time.perf_counter()
    cfg, setup, problems, _ = bench_run(overrides)
    initial = copy.deepcopy(setup.policy)  # TRL starts from the same weights
    load_s = time.perf_counter() - start
    pristine = copy.deepcopy(setup.policy.state_dict())
    runs = []
    for _ in range(repeats):  # every repeat starts from the same weights and random stream: the same work
        setup.policy.load_state_dict(pristine)
        initial.load_state_dict(pristine)
        torch.manual_seed(cfg.seed)
        runs.append(with_ratios({**measure(cfg, setup, problems), "model_load_s": load_s,
                                 **trl_measure(cfg, setup, problems, initial)}))
    result = median_of(runs)
    result["load_avg_1m_before_after"] = f"{load_before:.2f} / {os.getloadavg()[0]:.2f}"
    # the phases' peaks reset the kernel's high-water mark (harness/loop/metrics.py): the largest of them and since
    result["max_rss_gb"] = max([peak_memory_mb(torch.device("cpu")), *(v for k, v in result.items()
                                if k.startswith(("peak_mem", "trl_peak_mem")))]) / 1024
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:{width}s}  {value:.3f}" if isinstance(value, float) else f"{key:{width}s}  {value}")
    out = Path(cfg.results_dir) / "bench"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "bench.json", json.dumps(result, indent=2))
    return 0


def measure(cfg: DictConfig, setup: RunSetup, problems: list) -> dict:
    """One native step, timed at its second full-size step (the first pays the one-time costs)."""
    t, device, policy = cfg.train, setup.device, setup.policy
    learner = build_learner(policy, setup.objective, t)
    release_freed_memory()
    warm_up_rollout_s, warm_up_step_s = warm_up(learner, setup, problems, cfg)
    sync(device)
    memory = PhaseMemory(device)
    memory.start("rollout")
    start, cpu_start = time.perf_counter(), time.process_time()
    ro = native_rollout(policy, setup.tokenizer, problems, cfg)
    sync(device)
    rollout_s = time.perf_counter() - start
    tokens = int(ro.completion_mask.sum())
    timings = Timings()
    memory.start("update")
    start = time.perf_counter()
    bench_update(learner, setup, ro, problems, cfg, 1, timings)
    sync(device)
    update_s = time.perf_counter() - start
    step_cpu_s = time.process_time() - cpu_start  # CPU time of this process: less sensitive to other load
    flops, decode = update_flops(policy, ro, t.epochs), decode_flops(policy, ro)
    peak = machine_peak(cfg) if device.type == "cpu" else float("nan")
    phases = timings.metrics()
    return {
        "model": cfg.model.name, "threads": torch.get_num_threads(), "device": str(device), "sampler": t.sampler,
        "decoder": t.decoder, "compile_sampler": t.compile_sampler, "warm_up_rollout_s": warm_up_rollout_s,
        "warm_up_step_s": warm_up_step_s,
        "prompts_x_samples": f"{t.prompts_per_step}x{t.group_size}", "max_new_tokens": t.max_new_tokens,
        "num_minibatches": t.num_minibatches, "repeats": 1,
        "completion_tokens": tokens, "rollout_s": rollout_s, "rollout_tok_s": tokens / rollout_s,
        "rollout_gflop_s": decode / rollout_s / 1e9, "rollout_fraction_of_peak": decode / rollout_s / peak,
        "update_s": update_s, "update_tok_s": tokens * t.epochs / update_s,
        "update_gflop_s": flops / update_s / 1e9, "matmul_peak_gflop_s": peak / 1e9,
        "update_fraction_of_peak": flops / update_s / peak,
        "step_s": rollout_s + update_s, "step_tok_s": tokens / (rollout_s + update_s),
        "step_cpu_s": step_cpu_s, "phase_generate_s": rollout_s, "phase_logp_forward_s": timings.logp_forward_s,
        "phase_backward_s": timings.backward_s, "phase_optimizer_s": timings.optimizer_s,
        "phase_update_other_s": update_s - sum(phases.values()), **memory.metrics(),
    }


def trl_measure(cfg: DictConfig, setup: RunSetup, problems: list, initial) -> dict:
    """TRL's step from ``initial`` (:func:`trl_step`) as ``trl_*`` figures."""
    release_freed_memory()  # TRL grows its own heap in its first, untimed step
    trl = trl_step(cfg, initial, setup.tokenizer, setup.task, problems)
    return {f"trl_{key}": value for key, value in trl.items()}


def with_ratios(result: dict) -> dict:
    """``result`` with the native / TRL ratios (:data:`RATIOS`)."""
    trl_generate_tok_s = result["trl_completion_tokens"] / result["trl_phase_generate_s"]
    return {**result, "native_over_trl_rollout_tok_s": result["rollout_tok_s"] / result["trl_rollout_tok_s"],
            "native_over_trl_generate_tok_s": result["rollout_tok_s"] / trl_generate_tok_s,
            "trl_over_native_step_time": result["trl_step_s"] / result["step_s"],
            "trl_over_native_tok_s": result["trl_step_tok_s"] / result["step_tok_s"]}


RATIOS = ("native_over_trl_rollout_tok_s", "native_over_trl_generate_tok_s", "trl_over_native_step_time",
          "trl_over_native_tok_s")


def median_of(runs: list[dict]) -> dict:
    """The median over repeats of every number (so that one noisy sub-second timing does not decide a ratio; the
    warm-up rollout: the first's, which holds the one-time costs) and the range of the ratios the goals read
    (``RATIOS``); a single run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    result = {k: statistics.median(r[k] for r in runs) if isinstance(v, float) else v for k, v in runs[0].items()}
    result["repeats"] = len(runs)
    for key in (key for key in runs[0] if "warm_up" in key):  # the first repeat's: it holds the one-time costs
        result[key] = runs[0][key]
    for key in RATIOS:
        result[f"{key}_min_max"] = f"{min(r[key] for r in runs):.3f} / {max(r[key] for r in runs):.3f}"
    return result


def bench_update(learner: Learner, setup: RunSetup, ro: Rollout, problems: list, cfg: DictConfig, step: int,
                 timings: Timings | None = None) -> dict:
    """The native update of ``ro`` (scored by :func:`train_batch`) as rollout step ``step``."""
    batch = train_batch(ro, setup.task, problems, setup.estimator, cfg)
    state = RunState(total_optimizer_steps=updates_per_step(cfg.train))
    with cpu_matmul(cfg.train.cpu_matmul):  # the run's kernel (harness/loop/native.py), as its rollouts
        return update(learner, UpdatePlan.of(batch, cfg, step, timings), state)


def native_rollout(policy, tokenizer, problems: list, cfg: DictConfig, **sampling) -> Rollout:
    """The sampler's rollout of ``problems`` on the kernel of ``train.cpu_matmul``, as a run samples
    (harness/loop/native.py); TRL's side keeps torch's."""
    with cpu_matmul(cfg.train.cpu_matmul):
        return sample_problems(policy, tokenizer, problems, cfg.train, **sampling)


def train_batch(ro: Rollout, task, problems, estimator, cfg) -> TrainBatch:
    """The rollout scored by the task, with the run's advantages and the sampler's log-probs."""
    t, device = cfg.train, ro.completion_ids.device
    rewards = torch.tensor([task.score(x, problems[i // t.group_size]).correct for i, x in enumerate(ro.texts)])
    group_ids = torch.arange(len(ro.texts) // t.group_size).repeat_interleave(t.group_size)
    advantages = estimator(rewards, group_ids, ro.completion_mask.sum(-1).cpu())
    return TrainBatch(ro, rewards.to(device), advantages.to(device), group_ids.to(device),
                      ro.sampler_logp)


def warm_up(learner: Learner, setup: RunSetup, problems: list, cfg: DictConfig, **sampling) -> tuple[float, float]:
    """One untimed step of the timed step's sizes, so that one-time costs — kernel loading, the heap's growth to
    the step's peak memory (harness/run/allocator.py), CUDA handles, ``train.compile_sampler``'s compile — are charged
    to neither side (TRL's first step is untimed too); the weights are restored afterwards (lr 0 would still move
    AdamW's moments, so the state is saved and put back). Returns the seconds of its rollout and of the step."""
    saved = copy.deepcopy(learner.policy.state_dict())
    start = time.perf_counter()
    ro = native_rollout(learner.policy, setup.tokenizer, problems, cfg, **sampling)
    rollout_s = time.perf_counter() - start
    bench_update(learner, setup, ro, problems, cfg, 0)
    step_s = time.perf_counter() - start
    learner.policy.load_state_dict(saved)
    learner.optimizer.state.clear()
    return rollout_s, step_s


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trl_step(cfg, policy, tokenizer, task, problems) -> dict:
    """Two generations, each followed by ``num_minibatches`` optimizer steps, of TRL's own GRPOTrainer (loss_type
    grpo, no gradient checkpointing, as the native loop); the second is timed (the first pays the one-time costs, as
    the native warm-up does; the second starts from weights its 4 optimizer steps at the bench's lr 1e-6 moved, where
    the native side restores them), phases from its timed methods (harness.loop.trl_backend)."""
    # imported when TRL runs: trl (and transformers' trainer, which imports peft) take seconds to import, which
    # `bench --step`, `--profile` and every run's process never need
    from transformers import TrainerCallback

    from harness.loop.trl_backend import TimedGRPOTrainer, grpo_config, problems_dataset, reward_functions

    class SecondStepMark(TrainerCallback):
        """The clocks and TRL's phase totals when its second rollout step begins (global step ``steps``)."""

        def __init__(self, trainer, steps: int):
            self.trainer, self.steps, self.mark = trainer, steps, None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == self.steps:
                self.mark = time.perf_counter(), time.process_time(), dict(self.trainer.phase_s)

    t = cfg.train
    steps = updates_per_step(t)
    with tempfile.TemporaryDirectory() as out:
        args = grpo_config(cfg, Path(out), max_steps=2 * steps, shuffle_dataset=False,
                           save_strategy="no", reward_weights=[1.0, cfg.task.format_weight])
        trainer = TimedGRPOTrainer(model=policy, reward_funcs=reward_functions(task), args=args,
                                   train_dataset=problems_dataset(problems, tokenizer), processing_class=tokenizer)
        marker = SecondStepMark(trainer, steps)
        trainer.add_callback(marker)
        start = time.perf_counter()
        trainer.train()
        end, cpu_end = time.perf_counter(), time.process_time()
    mark_s, mark_cpu_s, first = marker.mark
    step_s, step_cpu_s = end - mark_s, cpu_end - mark_cpu_s
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    tokens = logs[-1]["completions/mean_length"] * t.prompts_per_step * t.group_size
    p = {name: trainer.phase_s[name] - first.get(name, 0.0)  # phase_s: a defaultdict, 0 for a phase never run
         for name in ("rollout", "generate", "rewards", "logp_nograd", "logp_forward", "training_step")}
    update_s = step_s - p["rollout"]
    return {
        "completion_tokens": int(round(tokens)), "rollout_s": p["rollout"], "rollout_tok_s": tokens / p["rollout"],
        "update_s": update_s, "update_tok_s": tokens * t.epochs / update_s, "step_s": step_s,
        "step_tok_s": tokens / step_s, "step_cpu_s": step_cpu_s, "warm_up_step_s": mark_s - start,
        "old_logp_recomputed": args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) > 0,
        "phase_generate_s": p["generate"], "phase_rewards_s": p["rewards"],
        "phase_old_ref_logp_nograd_s": p["logp_nograd"],
        "phase_rollout_other_s": p["rollout"] - p["generate"] - p["rewards"] - p["logp_nograd"],
        "phase_logp_forward_s": p["logp_forward"],
        "phase_loss_backward_s": p["training_step"] - p["rollout"] - p["logp_forward"],
        "phase_optimizer_and_trainer_s": step_s - p["training_step"], **trainer.memory.metrics(),
    }
