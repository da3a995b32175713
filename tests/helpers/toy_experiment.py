"""A toy sweep's results folder (grpo and gspo, three finished seeds each, an unfinished, a killed and a pending run),
written as the training loop writes it, for the analysis tests."""

from __future__ import annotations

import json
from pathlib import Path

from harness.run.provenance import code_record
from harness.run.records import CODE_LINE
from tests.helpers.fake_runs import code_segments, own_records

STEPS = 6
PROBLEMS = 100  # eval problems of eval_samples.jsonl: problem p is solved when p < accuracy x PROBLEMS (every seed)

OFFSET = {"grpo": 0.0, "gspo": 0.1}


# final eval accuracy of the finished runs, by objective and seed
FINAL = {"grpo": {0: 0.40, 1: 0.50, 2: 0.75}, "gspo": {0: 0.55, 1: 0.60, 2: 0.80}}


def write_run(exp: Path, objective: str, seed: int, final: float, steps_done: int = STEPS,
              status: str = "finished", killed: bool = False, like: str | None = None, start_policy="absent",
              scorings: bool = False) -> dict:
    """One run folder as the training loop writes it. eval every 3 steps; gspo reports no kl_ref (beta = 0);
    grpo reports holder_p, gspo its gate_* metrics, both clip_frac_low/high and bookkeeping keys (timings, lr...).
    killed: no summary.json and a truncated last line of metrics.jsonl, as a kill -9 can leave a run;
    like: log the metrics of that objective (two objectives whose curves coincide); start_policy: summary.json's
    field ("absent": none, as older runs); scorings: eval_accuracy_strict / _flexible beside eval_accuracy."""
    run_id = f"{objective}-s{seed}-abcd1234"
    kind = like or objective
    run_dir = exp / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        f"{CODE_LINE}{code_record()['version']} (as a run writes it)\n"
        f"name: {exp.name}\nseed: {seed}\nmodel:\n  name: tiny\ntask:\n  name: arith\nobjective:\n  name: {objective}\n"
        f"  params:\n    beta: {0.01 if kind == 'grpo' else 0.0}\ntrain:\n  steps: {STEPS}\n  group_size: 4\n"
        f"  prompts_per_step: 2\n  lr: 1.0e-05\n")
    rows = [{"step": 0, "eval_accuracy": 0.1, **({"eval_accuracy_strict": 0.05} if scorings else {})}]
    for step in range(1, steps_done + 1):
        clip = 0.002 * (seed + 1) * (10 if kind == "gspo" else 1)
        row = {"step": step, "rollout_tokens": step * (100 + 10 * seed),
               "reward_mean": 0.1 * step + OFFSET.get(kind, 0.0), "accuracy": 0.05 * step + 0.01 * seed,
               "clip_frac": clip, "clip_frac_low": clip / 4, "clip_frac_high": 3 * clip / 4, "ratio_std": 0.01 * step,
               "ratio_max": 1 + 0.01 * step, "kl_behavior": 1e-3 * step, "entropy": 1.0 - 0.05 * step,
               "grad_norm": 0.5, "completion_len_mean": 20.0 + step, "frac_zero_std_groups": 0.5,
               "eval_accuracy": None, "lr": 1e-5, "rollout_s": 1.5, "update_s": 2.0 + seed, "rollout_tok_s": 80.0,
               "peak_mem_mb": 900.0, "nonfinite_skips": 0}
        if kind == "grpo":
            row.update(kl_ref=1e-3 * step, holder_p=1.0 + 0.1 * step)
        else:
            row.update(gate_weight_mean=0.9 - 0.01 * step, gate_weight_min=0.5 - 0.02 * step)
        if step % 3 == 0:
            row["eval_accuracy"] = final if step == STEPS else 0.1 + 0.01 * step
            if scorings:
                row.update(eval_accuracy_strict=row["eval_accuracy"] - 0.05,
                           eval_accuracy_flexible=row["eval_accuracy"] + 0.05)
        rows.append(row)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / "metrics.jsonl").write_text(text + ('{"step": 99, "reward_me' if killed else ""))
    (run_dir / "eval_samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_samples(rows)))
    if not killed:
        (run_dir / "summary.json").write_text(json.dumps({
            "run_id": run_id, "objective": objective, "seed": seed, "status": status, "steps_done": steps_done,
            "total_steps": STEPS, "final_eval_accuracy": final if steps_done == STEPS else 0.13,
            "best_eval_accuracy": max(final, 0.13) if steps_done == STEPS else 0.13, "wall_time_s": 100.0 + seed,
            "rollout_tokens": steps_done * 100, "update_tokens": steps_done * 100, "error": None,
            **own_records({"objective.name": objective, "objective.params.beta": 0.01 if kind == "grpo" else 0.0}),
            **code_segments(code_record()["version"]),
            **({} if start_policy == "absent" else {"start_policy": start_policy})}))
    return {"run_id": run_id, "objective": objective, "seed": seed, "overrides": {}, "status": status, "dir": run_id}


def eval_samples(rows: list[dict]) -> list[dict]:
    """eval_samples.jsonl's records of the evaluations in ``rows``: problem p correct when p < accuracy x PROBLEMS
    (an accuracy that is no multiple of 1 / PROBLEMS is then not matched: the report falls back on the seeds)."""
    out = []
    for row in rows:
        if row.get("eval_accuracy") is None:
            continue
        scorings = {k.removeprefix("eval_accuracy"): v for k, v in row.items() if k.startswith("eval_accuracy")}
        out += [{"step": row["step"], "problem": p, "answer": str(p),
                 **{f"correct{name}": float(p < round(value * PROBLEMS)) for name, value in scorings.items()},
                 "completion": "#### 0"} for p in range(PROBLEMS)]
    return out


def write_experiment(exp: Path, finals: dict = FINAL, extra: bool = True) -> Path:
    """finals -> finished runs; extra: an unfinished run (4/6 steps), a killed run with no summary and a truncated
    last line, and a pending run that never started."""
    exp.mkdir(parents=True)
    entries = [write_run(exp, o, s, f) for o, seeds in finals.items() for s, f in seeds.items()]
    if extra:
        entries.append(write_run(exp, "grpo", 3, 0.0, steps_done=4, status="running"))
        entries.append(write_run(exp, "gspo", 3, 0.0, steps_done=2, status="running", killed=True))
        entries.append({"run_id": "grpo-s4-abcd1234", "objective": "grpo", "seed": 4, "overrides": {},
                        "status": "pending", "dir": "grpo-s4-abcd1234"})
    (exp / "manifest.json").write_text(json.dumps({"experiment": exp.name, "runs": entries}))
    return exp
