"""Read results/<exp>/: manifest.json, and per run config.yaml, metrics.jsonl and summary.json.

Problems in the data (a truncated line, a missing file, a non-numeric value) become an AnalysisWarning that
names the file, and the run is reported with what exists. A folder with nothing to analyse raises AnalysisError.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

RUN_FILES = ("metrics.jsonl", "summary.json", "config.yaml")
SCORING_PREFIX = "eval_accuracy_"  # eval_accuracy_<scoring>: the same eval scored another way


class AnalysisError(Exception):
    """The results folder cannot be analysed at all (missing, empty); the message says why."""


class AnalysisWarning(UserWarning):
    """A problem in the data that the analysis works around; the report lists them."""


def warn(message: str) -> None:
    warnings.warn(message, AnalysisWarning, stacklevel=2)


@dataclass
class Experiment:
    name: str
    dir: Path
    runs: pd.DataFrame  # one row per run (manifest order): identity, status, summary numbers, start policy,
    # `complete`, `problem`
    metrics: pd.DataFrame  # one row per (run, step): run_id, objective, seed, step and the logged metrics
    configs: dict[str, dict]  # run_id -> config.yaml flattened to dotted keys


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        warn(f"{path}: unreadable JSON, ignored ({e})")
        return None
    if not isinstance(data, dict):
        warn(f"{path}: expected a JSON object, ignored")
        return None
    return data


def read_metrics(path: Path) -> pd.DataFrame:
    """metrics.jsonl as a frame sorted by step; bad lines are skipped with a warning naming the file."""
    lines = path.read_text(errors="replace").rstrip("\n").split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            what = "truncated last line" if i == len(lines) else "malformed line"
            warn(f"{path}: skipped {what} {i}")
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int | float):
            warn(f"{path}: skipped line {i} (not an object with a numeric 'step')")
            continue
        rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        warn(f"{path}: no metrics (empty file)")
        return df
    for col in df.columns:
        values = pd.to_numeric(df[col], errors="coerce")
        if values.isna().sum() > df[col].isna().sum():
            warn(f"{path}: non-numeric values of {col!r} treated as missing")
        df[col] = values
    if df["step"].duplicated().any():
        warn(f"{path}: repeated steps, kept the last line of each")
        df = df.drop_duplicates("step", keep="last")
    return df.sort_values("step", ignore_index=True)


def flatten(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return {k.rstrip("."): v for k, v in flat.items()}


def read_config(path: Path) -> dict:
    try:
        return flatten(OmegaConf.to_container(OmegaConf.load(path)))
    except Exception as e:  # any YAML or omegaconf error: report the file, keep going
        warn(f"{path}: unreadable config, ignored ({type(e).__name__}: {e})")
        return {}


def _first(*values):
    return next((v for v in values if v is not None), None)


def start_policy(summary: dict, path: Path) -> dict:
    """summary.json's `start_policy` as run columns. start_policy: its key, "none" (null: no warm start) or None
    (not recorded: runs older than the field)."""
    info = summary.get("start_policy")
    if info is None:
        return {"start_policy": "none" if "start_policy" in summary else None}
    if not isinstance(info, dict):
        warn(f"{path}: start_policy is not an object or null, ignored")
        return {"start_policy": None}
    return {"start_policy": str(info.get("key") or "?"), "start_policy_steps": info.get("steps"),
            "start_policy_check_accuracy": info.get("accuracy"),
            "start_policy_eval_accuracy": info.get("eval_accuracy")}


def load_run(exp_dir: Path, entry: dict) -> tuple[dict, pd.DataFrame, dict]:
    run_dir = exp_dir / str(entry.get("dir") or entry.get("run_id"))
    run_id = str(entry.get("run_id") or run_dir.name)
    found = {name: (run_dir / name).exists() for name in RUN_FILES}
    if run_dir.is_dir():
        for name, exists in found.items():
            if not exists:
                warn(f"{run_dir / name}: missing")
    summary = (read_json(run_dir / "summary.json") if found["summary.json"] else None) or {}
    config = read_config(run_dir / "config.yaml") if found["config.yaml"] else {}
    metrics = read_metrics(run_dir / "metrics.jsonl") if found["metrics.jsonl"] else pd.DataFrame()
    evals = metrics["eval_accuracy"].dropna() if "eval_accuracy" in metrics else pd.Series(dtype=float)
    at_start = evals[metrics.loc[evals.index, "step"] == 0] if len(evals) else evals
    run = {
        "run_id": run_id,
        "objective": str(_first(entry.get("objective"), summary.get("objective"), config.get("objective.name"),
                                "unknown")),
        "seed": _first(entry.get("seed"), summary.get("seed"), config.get("seed")),
        "status": _first(summary.get("status"), entry.get("status"), "unknown"),
        "steps_done": int(_first(summary.get("steps_done"), metrics["step"].max() if len(metrics) else None, 0)),
        "total_steps": _first(summary.get("total_steps"), config.get("train.steps")),
        "final_eval_accuracy": _first(summary.get("final_eval_accuracy"), evals.iloc[-1] if len(evals) else None),
        "best_eval_accuracy": _first(summary.get("best_eval_accuracy"), evals.max() if len(evals) else None),
        "start_eval_accuracy": _first(at_start.iloc[0] if len(at_start) else None, summary.get("start_eval_accuracy")),
        "wall_time_s": summary.get("wall_time_s"),
        "rollout_tokens": summary.get("rollout_tokens"),
        **start_policy(summary, run_dir / "summary.json"),
        # the last value of each scoring variant of the eval accuracy (eval_accuracy_strict, ..._flexible)
        **{f"final_{c}": metrics[c].dropna().iloc[-1] for c in sorted(metrics)
           if c.startswith(SCORING_PREFIX) and metrics[c].notna().any()},
    }
    problems = []
    if not run_dir.is_dir():
        problems.append(f"not started (no folder {run_dir.name}/)")
    else:
        problems += [f"no {name}" for name in ("summary.json", "metrics.jsonl") if not found[name]]
    if run["status"] != "finished":
        problems.insert(0, f"status {run['status']}")
    if run["total_steps"] is not None and run["steps_done"] < run["total_steps"]:
        problems.append(f"{run['steps_done']}/{run['total_steps']} steps")
    if summary.get("error"):
        problems.append(f"error: {summary['error']}")
    run["complete"] = not problems
    run["problem"] = "; ".join(problems)
    if len(metrics):
        metrics.insert(0, "run_id", run_id)
        metrics.insert(1, "objective", run["objective"])
        metrics.insert(2, "seed", run["seed"])
    return run, metrics, config


def load_experiment(exp_dir: str | Path) -> Experiment:
    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        raise AnalysisError(f"results folder {exp_dir} does not exist")
    manifest = read_json(exp_dir / "manifest.json") if (exp_dir / "manifest.json").exists() else None
    entries = [e for e in (manifest or {}).get("runs", []) if isinstance(e, dict) and (e.get("dir") or e.get("run_id"))]
    if not entries:
        entries = [{"run_id": d.name} for d in sorted(exp_dir.iterdir())
                   if d.is_dir() and any((d / name).exists() for name in RUN_FILES)]
        if entries:
            warn(f"{exp_dir / 'manifest.json'}: missing or lists no runs; analysing the {len(entries)} run "
                 "folders found")
    if not entries:
        raise AnalysisError(f"no runs in {exp_dir}: no manifest.json listing runs and no run folders with "
                            f"{', '.join(RUN_FILES)}")
    loaded = [load_run(exp_dir, e) for e in entries]
    runs = pd.DataFrame([run for run, _, _ in loaded])
    frames = [m for _, m, _ in loaded if len(m)]
    metrics = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run_id", "objective", "step"])
    if "rollout_tokens" in metrics:  # the step-0 evaluation precedes any sampling
        before = metrics["step"] == 0
        metrics.loc[before, "rollout_tokens"] = metrics.loc[before, "rollout_tokens"].fillna(0)
    numbers = ["final_eval_accuracy", "best_eval_accuracy", "start_eval_accuracy", "wall_time_s", "rollout_tokens",
               *[c for c in runs if c.startswith(("start_policy_", "final_" + SCORING_PREFIX))]]
    runs[numbers] = runs[numbers].astype(float)  # None -> NaN
    runs[["seed", "total_steps"]] = runs[["seed", "total_steps"]].astype("Int64")  # integers, <NA> when unknown
    name = str((manifest or {}).get("experiment") or exp_dir.name)
    return Experiment(name, exp_dir, runs, metrics, {run["run_id"]: config for run, _, config in loaded})
