"""Synthetic run folders as the training loop writes them (config.yaml, metrics.jsonl, summary.json) and a sweep's
manifest.json, for the analysis tests: any settings, statuses, collapses and damaged files, without training."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness.run.config import nested, objective_defaults, settings_left_out


@dataclass(frozen=True)
class Shape:
    """How much of a fake run exists: ``steps`` planned, ``steps_done`` of them logged (default: all), eval accuracy
    from ``start`` at step 0 (every 3 steps and at the last), the run's ``name`` (default: the folder's), and which
    files are written (``started=False``: none, the manifest entry only)."""

    steps: int = 6
    steps_done: int | None = None
    start: float = 0.2
    name: str | None = None
    summary: bool = True
    write_config: bool = True
    started: bool = True


def fake_run(exp: Path, objective: str, seed: int, settings: dict | None = None, *, final: float = 0.5,
             status: str = "finished", summary_extra: dict | None = None, rows: dict[int, dict] | None = None,
             run_id: str | None = None, shape: Shape = Shape()) -> dict:
    """One run; returns its manifest entry. settings: dotted config keys (besides name, seed, objective.name,
    train.steps); eval accuracy rises linearly from ``shape.start`` (step 0) to `final` (step ``shape.steps``);
    rows: per step, keys to set in that step's metrics (None is written as JSON null, as the harness writes
    NaN/inf); summary_extra: fields added to summary.json."""
    settings = dict(settings or {})
    steps = shape.steps
    steps_done = steps if shape.steps_done is None else shape.steps_done
    start = shape.start
    config = {"name": shape.name or exp.name, "seed": seed, "objective.name": objective, "train.steps": steps,
              "model.name": "tiny", "task.name": "arith", "train.group_size": 4, "train.prompts_per_step": 2,
              **settings}
    digest = hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:8]
    run_id = run_id or f"{objective}-s{seed}-{digest}"
    entry = {"run_id": run_id, "objective": objective, "seed": seed, "overrides": settings, "status": status,
             "dir": run_id}
    if not shape.started:
        return entry
    run_dir = exp / run_id
    run_dir.mkdir(parents=True)
    if shape.write_config:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(nested(config), sort_keys=True))
    metrics = [{"step": 0, "eval_accuracy": start, "eval_s": 1.0}]
    for step in range(1, steps_done + 1):
        row = {"step": step, "rollout_tokens": 100 * step, "reward_mean": 0.1 * step, "accuracy": 0.05 * step,
               "clip_frac": 0.01, "ratio_std": 0.01, "kl_behavior": -0.001 * step, "entropy": 0.8, "loss": 0.1,
               "pg_loss": 0.1, "grad_norm": 0.5, "nonfinite_skips": 0, "rollout_s": 1.0, "update_s": 1.0}
        if step % 3 == 0 or step == steps:
            row["eval_accuracy"] = start + (final - start) * step / steps
            row["eval_s"] = 1.0
        row.update((rows or {}).get(step, {}))
        metrics.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    if shape.summary:
        evals = [r["eval_accuracy"] for r in metrics if r.get("eval_accuracy") is not None]
        data = {"run_id": run_id, "objective": objective, "seed": seed, "status": status, "steps_done": steps_done,
                "total_steps": steps, "start_eval_accuracy": start, "final_eval_accuracy": evals[-1],
                "best_eval_accuracy": max(evals), "wall_time_s": 10.0 + steps_done,
                "rollout_tokens": 100 * steps_done, "start_policy": None, "missing_steps": [], "error": None,
                **own_records(config), **(summary_extra or {})}
        (run_dir / "summary.json").write_text(json.dumps(data))
    return entry


def own_records(config: dict) -> dict:
    """summary.json's ``settings_left_out`` and ``objective_own`` as this code writes them (harness/run/records.py)
    for a run of these settings (dotted keys)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(nested(config))
    return {"settings_left_out": settings_left_out(cfg),
            "objective_own": dict(objective_defaults(config["objective.name"]))}


def fake_experiment(exp: Path, entries: list[dict], name: str | None = None) -> Path:
    exp.mkdir(parents=True, exist_ok=True)
    (exp / "manifest.json").write_text(json.dumps({"experiment": name or exp.name, "runs": entries}))
    return exp


def grid_experiment(exp: Path, axes: dict[str, list], objectives=("grpo", "gspo"), seeds=(0, 1, 2),
                    effect=None) -> Path:
    """Every combination of the axes' values x objectives x seeds, finished; effect(objective, point, seed) -> final
    accuracy (default: a small objective effect plus seed noise)."""
    import itertools

    effect = effect or (lambda o, point, s: 0.4 + (0.05 if o == "gspo" else 0.0) + 0.01 * s)
    entries = []
    for values in itertools.product(*axes.values()):
        point = dict(zip(axes, values, strict=True))
        for objective in objectives:
            for seed in seeds:
                entries.append(fake_run(exp, objective, seed, point, final=effect(objective, point, seed)))
    return fake_experiment(exp, entries)


def code_segments(*versions: str, threads: int = 1) -> dict:
    """summary.json's ``code`` and ``segments`` (harness/run/provenance.py) of a run started by code ``versions[0]``
    and continued once by each later version, every start with ``threads`` torch threads (for ``summary_extra``)."""
    segments = [{"from_step": i, "started": None, "threads": threads,
                 "code": {"version": v, "commit": v, "packages": {"python": "3.11", "torch": "2.13.0"}}}
                for i, v in enumerate(versions)]
    return {"code": segments[-1]["code"], "segments": segments}


def unrasterized(fig, out_dir: Path, stem: str, formats: list[str]) -> list[Path]:
    """analysis.plots.save without matplotlib's rendering (most of a report's time), for a test that reads a report's
    text and tables, not its images: the figure, built from the runs' data, is closed and its files are left empty."""
    import matplotlib.pyplot as plt

    plt.close(fig)
    paths = [out_dir / f"{stem}.{fmt}" for fmt in formats]
    for path in paths:
        path.write_bytes(b"")
    return paths
