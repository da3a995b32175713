"""Where a run's time goes: its wall time split into the phases its metrics log (``PHASES``), in seconds per run
(mean over an objective's finished runs) and as a share of the wall time. "Other" is the wall time minus every
logged phase. Beside it the memory: each run's peak per phase (``MEMORY``), as a mean over the runs."""

from __future__ import annotations

import pandas as pd

UPDATE_PARTS = ("update_logp_forward_s", "update_stats_forward_s", "update_backward_s", "update_optimizer_s")
PHASES = ("rollout (sampling + rewards); the update split into the loss passes' forwards, P3O's statistics "
          "forward, backward, optimizer (clipping + AdamW) and the rest (recomputed behaviour / reference "
          "log-probs, the objective, metrics); evaluations; other (model build and warm-start cache, records, "
          "checkpoints, exports). Runs logged before the update's split show the whole update.")
LABELS = {"rollout_s": "rollout", "update_logp_forward_s": "update: forward", "update_stats_forward_s":
          "update: statistics forward", "update_backward_s": "update: backward", "update_optimizer_s":
          "update: optimizer", "update_other_s": "update: rest", "update_s": "update", "eval_s": "evaluations",
          "other_s": "other (setup, records, checkpoints)"}
MEMORY = ("peak_mem_rollout_mb", "peak_mem_update_mb", "peak_mem_eval_mb")  # harness/loop/metrics.py's PhaseMemory
MEMORY_LABEL = "peak memory (MiB): rollout / update / eval"
MEMORY_NOTE = ("Peak memory: the largest of each run's steps in each phase (CPU: the process's resident set size, "
               "which includes the weights, the optimizer state and the heap kept for reuse; GPU: allocated memory), "
               "the mean over the runs; - where a run logged none.")


def run_phases(runs: pd.DataFrame, metrics: pd.DataFrame) -> pd.DataFrame:
    """Seconds per phase of each finished run (one row per run: run_id, objective, wall_time_s, phases)."""
    finished = runs[runs["complete"]]
    rows = []
    for run in finished.itertuples():
        m = metrics[metrics["run_id"] == run.run_id]
        total = {c: float(m[c].sum()) for c in ("rollout_s", "update_s", "eval_s", *UPDATE_PARTS) if c in m}
        row = {"run_id": run.run_id, "objective": run.objective, "wall_time_s": float(run.wall_time_s)}
        row["rollout_s"] = total.get("rollout_s", 0.0)
        parts = [c for c in UPDATE_PARTS if total.get(c)]
        if parts:
            row.update({c: total[c] for c in parts})
            row["update_other_s"] = total.get("update_s", 0.0) - sum(total[c] for c in parts)
        else:
            row["update_s"] = total.get("update_s", 0.0)
        row["eval_s"] = total.get("eval_s", 0.0)
        row["other_s"] = row["wall_time_s"] - sum(v for k, v in row.items() if k not in ("run_id", "objective",
                                                                                         "wall_time_s"))
        row.update({c: float(m[c].max()) for c in MEMORY if c in m and m[c].notna().any()})
        rows.append(row)
    return pd.DataFrame(rows)


def time_table(runs: pd.DataFrame, metrics: pd.DataFrame) -> pd.DataFrame:
    """Per objective: mean seconds per finished run in each phase, with its share of the mean wall time."""
    phases = run_phases(runs, metrics)
    if phases.empty:
        return pd.DataFrame()
    columns = [c for c in LABELS if c in phases]
    mean = phases.groupby("objective")[["wall_time_s", *columns]].mean()
    table = pd.DataFrame({"objective": mean.index, "runs": phases.groupby("objective").size().values,
                          "wall time (s)": mean["wall_time_s"].round(1).values})
    for c in columns:
        table[LABELS[c]] = [f"{s:.1f} s ({s / w:.0%})" for s, w in zip(mean[c], mean["wall_time_s"], strict=True)]
    logged = [c for c in MEMORY if c in phases]
    if logged:
        memory = phases.groupby("objective")[logged].mean().reindex(columns=list(MEMORY))
        table[MEMORY_LABEL] = [" / ".join("-" if pd.isna(v) else f"{v:.0f}" for v in values)
                               for values in memory.itertuples(index=False)]
    return table
