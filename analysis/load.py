"""Read results/<exp>/: every run folder in it, and per run config.yaml, metrics.jsonl, summary.json and the
per-problem scores of eval_samples.jsonl.

manifest.json is what the last sweep into the folder planned (its runs first, in its order, with their grid points);
a run folder it does not list (another sweep's or a `train` into the same folder) is read too and named in one
warning, so that no run on disk is left out of a report unsaid. The runs are told apart by their settings and code
(analysis/cells.py), never by which manifest listed them.

Problems in the data (a truncated line, a missing file, a non-numeric value) become an AnalysisWarning that
names the file, and the run is reported with what exists. A folder with nothing to analyse raises AnalysisError.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from analysis.accuracy import FINAL, run_scores
from analysis.cells import CODE, START_SEED, UNKNOWN, Cells, assign_cells
from analysis.folders import folder_problem
from harness.run.atomic import special_file
from harness.run.collapse import detect_collapse
from harness.run.config import counted_settings, draws_from_model_seed, edited_after_written, flattened
from harness.run.locks import RUN_LOCK, SWEEP_LOCK, Writer, is_held, stale_elsewhere, writer_elsewhere
from harness.run.provenance import code_record, run_packages, run_threads, run_version
from harness.run.records import COLLAPSE_RULE, ENDED, DamagedConfigError, config_code, listed, read_run_config

RUN_FILES = ("metrics.jsonl", "summary.json", "config.yaml")
ADVANTAGE = "objective.advantage"
OBJECTIVE_SETTINGS = (ADVANTAGE, "objective.params.")  # what a run's code may leave out of its cell
SCORING_PREFIX = "eval_accuracy_"  # eval_accuracy_<scoring>: the same eval scored another way
SAMPLES = "eval_samples.jsonl"  # per evaluation and eval problem: its score (harness/loop/evaluation.py)
NULL_OK = ("eval_",)  # keys whose null can mean "not evaluated at this step" (no data warning)


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
    # collapse_step/_cause/_source, `complete` (finished, every step), `ended` (complete or diverged), `problem`
    metrics: pd.DataFrame  # one row per (run, step): run_id, objective, seed, step and the logged metrics
    configs: dict[str, dict]  # run_id -> config.yaml flattened to dotted keys
    overrides: dict[str, dict] = field(default_factory=dict)  # run_id -> manifest.json's grid point of the run
    cells: Cells = field(default_factory=Cells)  # the axes, objective settings and cells (analysis/cells.py); runs
    # carry cell, cell_id, one column per axis, counted and duplicate_of; metrics rows cell, cell_id and counted
    samples: dict[str, pd.DataFrame] = field(default_factory=dict)  # run_id -> read_samples (runs that wrote some)
    baseline: str | None = None  # manifest.json's `baseline` (the sweep's sweep.baseline)
    objectives: list[str] = field(default_factory=list)  # manifest.json's `objectives`: the sweep grid's, in order
    sources: list[Path] = field(default_factory=list)  # the results folders read (analysis/combine.py: several);
    # runs carry `source`, the label of the folder(s) holding them


def regular(path: Path) -> bool:
    """False, with a warning, for a link, named pipe, socket or device where a run writes a file: reading it would
    take what no run wrote there (another run's numbers), or block the report."""
    if path.is_symlink():  # another run's file, or anything else: its numbers would be reported as this run's
        warn(f"{path}: a symbolic link: not followed (a run's records are read from its own files only)")
        return False
    if special_file(path):
        warn(f"{path}: not a regular file (a named pipe, a socket or a device): not read")
        return False
    return True


def read_json(path: Path) -> dict | None:
    if not regular(path):
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # not JSON, or not UTF-8 (both ValueErrors)
        warn(f"{path}: unreadable JSON, ignored ({e})")
        return None
    if not isinstance(data, dict):
        warn(f"{path}: expected a JSON object, ignored")
        return None
    return data


STEP_IN_LINE = re.compile(r'"step"\s*:\s*(\d+)')


@dataclass
class MetricsFile:
    """metrics.jsonl as read: the frame (sorted by step, numeric), the rows as written (JSON null kept as None, absent
    keys absent: the collapse rule tells them apart), the step of a truncated last line (None when the file ends
    whole; -1 when the step cannot be read from it) and, per key, the steps where the value is null."""
    frame: pd.DataFrame
    rows: list[dict]
    truncated_step: int | None = None
    nulls: dict[str, list[int]] = field(default_factory=dict)


RUN_KEYS = ("run_id", "objective", "seed", "cell", "cell_id", "counted")  # the run's, not a step's: never metrics


def parse_metrics(path: Path, total: int | None = None) -> MetricsFile:
    """metrics.jsonl read line by line; bad lines are skipped with a warning naming the file (the truncated last line
    with the step it held), non-numeric values become missing with a warning, repeated steps keep their last line.
    Lines whose step is no step of the run (not a whole number, negative, beyond ``total`` steps) and keys that name
    the run rather than a step (``seed``, ...) are left out, each kind named in one warning."""
    if not regular(path):
        return MetricsFile(pd.DataFrame(), [])
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        warn(f"{path}: unreadable, ignored ({e})")
        return MetricsFile(pd.DataFrame(), [])
    lines = text.rstrip("\n").split("\n")
    rows, truncated, absurd, foreign = [], None, [], set()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):
                found = STEP_IN_LINE.search(line)
                truncated = int(found.group(1)) if found else -1
                lost = f"step {truncated}" if found else "a step whose number is cut off"
                warn(f"{path}: skipped truncated last line {i} ({lost} lost: the write was cut short, e.g. by a kill "
                     "or a full disk)")
            else:
                warn(f"{path}: skipped malformed line {i}")
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int | float) or isinstance(row["step"], bool):
            warn(f"{path}: skipped line {i} (not an object with a numeric 'step')")
            continue
        step = row["step"]
        if not (math.isfinite(step) and step == int(step) and 0 <= step <= (math.inf if total is None else total)):
            absurd.append(f"line {i}: {step!r}")
            continue
        foreign.update(key for key in RUN_KEYS if key in row)
        rows.append({**{k: v for k, v in row.items() if k not in RUN_KEYS}, "step": int(step)})
    if absurd:
        warn(f"{path}: left out {len(absurd)} line{'s' * (len(absurd) > 1)} whose step is no step of this run "
             f"({', '.join(absurd[:3])}{', ...' if len(absurd) > 3 else ''}; a step is a whole number from 0 to "
             f"{'its steps' if total is None else total})")
    if foreign:
        warn(f"{path}: {', '.join(f'`{k}`' for k in sorted(foreign))} in its lines left out: the run's own, not "
             "metrics of a step")
    df = pd.DataFrame(rows)
    if df.empty:
        warn(f"{path}: no metrics (empty file)")
        return MetricsFile(df, rows, truncated)
    nulls = {}
    for row in rows:
        for key, value in row.items():
            if (value is None and not key.startswith(NULL_OK)
                    or isinstance(value, float) and not math.isfinite(value)):  # a NaN / Infinity another writer left
                nulls.setdefault(key, []).append(int(row["step"]))
    for col in df.columns:
        if pd.api.types.is_numeric_dtype(df[col]):  # already numbers (to_numeric would return them as they are)
            continue
        values = pd.to_numeric(df[col], errors="coerce")
        if values.isna().sum() > df[col].isna().sum():
            warn(f"{path}: non-numeric values of {col!r} treated as missing")
        df[col] = values
    for col in [c for c in df.columns if FRACTION.fullmatch(str(c))]:  # a share or an accuracy: in [0, 1]
        outside = df[col].notna() & ~df[col].between(0.0, 1.0)
        if outside.any():
            steps = sorted(int(v) for v in df.loc[outside, "step"])
            warn(f"{path}: `{col}` outside [0, 1] (a fraction) at step{'s' * (len(steps) > 1)} {steps_text(steps)}: "
                 "treated as missing")
            df.loc[outside, col] = float("nan")
    if df["step"].duplicated().any():
        warn(f"{path}: repeated steps, kept the last line of each")
        df = df.drop_duplicates("step", keep="last")
    return MetricsFile(df.sort_values("step", ignore_index=True), rows, truncated, nulls)


def read_metrics(path: Path) -> pd.DataFrame:
    """metrics.jsonl as a frame sorted by step (parse_metrics)."""
    return parse_metrics(path).frame


def read_samples(path: Path) -> pd.DataFrame:
    """eval_samples.jsonl's scores: one row per (step, problem) with the problem's reference answer and its scores
    (``correct``, ``correct_<scoring>``); the completions are not kept. A line cut short by a kill is dropped (that
    evaluation then lacks problems, and the report falls back on the run's own accuracy); a repeated (step, problem)
    keeps its last line. Any other line that is not an evaluated problem (not JSON, or a step or problem that is not
    an integer >= 0) is a data warning naming the first, and is left out."""
    rows, odd, last = [], [], 0
    try:
        with path.open(errors="replace") as lines:
            for last, line in enumerate(lines, 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    odd += [last] if line.strip() else []
                    continue
                if isinstance(row, dict) and all(_index(row.get(key)) for key in ("step", "problem")):
                    rows.append({k: v for k, v in row.items() if k in ("step", "problem", "answer")
                                 or k.startswith("correct") and isinstance(v, int | float)})
                elif line.strip():
                    odd.append(last)
    except OSError as e:
        warn(f"{path}: unreadable, ignored ({e})")
    odd = [n for n in odd if n != last]  # the last line: cut short by a kill, or the writer's next
    if odd:
        warn(f"{path}: {len(odd)} line{'s' * (len(odd) > 1)} not an evaluated problem (not JSON, or a step or problem "
             f"that is not an integer >= 0; the first: line {odd[0]}): left out")
    frame = pd.DataFrame(rows, columns=None if rows else ["step", "problem", "answer", "correct"])
    if "answer" in frame:
        frame["answer"] = frame["answer"].astype(str)
    for col in [c for c in frame.columns if str(c).startswith("correct")]:  # a problem's score: in [0, 1]
        outside = pd.Series([col in row and not 0 <= row[col] <= 1 for row in rows], index=frame.index, dtype=bool)
        if outside.any():  # NaN (not between 0 and 1) included: another writer's, not a score left unwritten
            steps = sorted({int(v) for v in frame.loc[outside, "step"]})
            warn(f"{path}: `{col}` outside [0, 1] (a problem's score) at step{'s' * (len(steps) > 1)} "
                 f"{steps_text(steps)}: treated as missing")
            frame.loc[outside, col] = float("nan")
    return frame.drop_duplicates(["step", "problem"], keep="last").reset_index(drop=True)


def _index(value) -> bool:
    """Whether ``value`` is a step or problem index: an integer >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def steps_text(steps: list[int], most: int = 8, count: int | None = None) -> str:
    """The first ``most`` of ``steps`` and, beyond, how many there are (``count``, else ``len(steps)``)."""
    count = len(steps) if count is None else count
    shown = ", ".join(str(s) for s in steps[:most])
    return shown + (f", ... ({count} in all)" if count > most else "")


def missing_steps(steps_done: int, logged: set[int], listed: set[int], most: int = 8) -> tuple[list[int], int]:
    """The first ``most`` steps of 0 .. steps_done and of ``listed`` that are not ``logged``, and how many there are,
    without building the range (a damaged summary or file can claim billions of steps)."""
    inside = sum(0 <= s <= steps_done for s in logged)
    gaps = list(itertools.islice((s for s in range(steps_done + 1) if s not in logged), most))
    beyond = sorted(s for s in listed - logged if not 0 <= s <= steps_done)
    return sorted(gaps + beyond)[:most], max(steps_done + 1 - inside, 0) + len(beyond)


# metrics that are fractions (accuracies, shares of tokens or groups): a value outside [0, 1] is no measurement
FRACTION = re.compile(r"(eval_)?accuracy(_\w+)?|clip_frac\w*|frac_\w+")


def data_warnings(path: Path, read: MetricsFile, status: str, steps_done: int, summary: dict) -> None:
    """Warnings about what a run's metrics lost: a truncated last line of a finished run, null (non-finite when
    written) values where a number belongs, steps missing from the file, a finished run's last evaluation (read as
    its final one where its summary has none) before its last step."""
    if read.truncated_step is not None and status in ENDED:
        step = read.truncated_step if read.truncated_step >= 0 else "?"
        warn(f"{path}: the run is {status} but its last line is truncated: step {step} lost (its metrics are not in "
             "the figures; the summary's numbers still are)")
    for key, steps in sorted(read.nulls.items()):
        warn(f"{path}: `{key}` is not a number (NaN, inf, or null: non-finite when written) at "
             f"step{'s' * (len(steps) > 1)} {steps_text(steps)}")
    logged = set(read.frame["step"].astype(int)) if len(read.frame) else set()
    listed = summary.get("missing_steps")  # what the loop knew was missing; the file may have lost more since
    listed = {s for s in listed if isinstance(s, int)} if isinstance(listed, list) else set()
    known = logged | ({read.truncated_step} if read.truncated_step is not None else set())
    missing, count = missing_steps(steps_done if logged else -1, known, listed)
    if count:
        warn(f"{path}: step{'s' * (count > 1)} {steps_text(missing, count=count)} missing (steps done: {steps_done})")
    evals = read.frame["step"][read.frame["eval_accuracy"].notna()] if "eval_accuracy" in read.frame else []
    if status == "finished" and summary.get("final_eval_accuracy") is None and len(evals) and max(evals) < steps_done:
        warn(f"{path}: the run finished at step {steps_done}, its last evaluation is step {int(max(evals))}'s (a run "
             "evaluates at its last step): its final eval accuracy is that earlier one")


def read_config(path: Path) -> dict:
    """config.yaml flattened to dotted keys; {} with one warning line naming the file when it is not a mapping of
    settings (not YAML, a tag such as ``!!python/object``, which OmegaConf's safe loader refuses, a list, ...)."""
    if not regular(path):
        return {}
    try:
        return flattened(read_run_config(path, resolve=False) or {})
    except DamagedConfigError as e:
        warn(f"{e}: ignored")
        return {}


def cell_settings(config: dict, summary: dict, code: str | None, path: Path) -> tuple[dict, str]:
    """The run's settings as its cell compares them (harness.run.config.counted_settings: less its objective's
    settings at their own values and those that change nothing), and by whose reading: ``this code`` (a run of this
    checkout's code, ``code``), ``recorded`` (a run of other code: the keys its code left out, summary.json's
    ``settings_left_out``, at ``path``), ``as written`` (a run of other code that recorded none: an objective's own
    values may have been others then, so only ``objective.advantage: null`` is left out, which names the objective's
    own estimator in every version). A record that names other than an objective's settings is damaged: ignored,
    with a warning."""
    if config and code == code_record()["version"]:
        return counted_settings(config), "this code"
    recorded = summary.get("settings_left_out")
    # objective.advantage null names the objective's own estimator in every version (every config.yaml holds it)
    own_estimator = [ADVANTAGE] if config.get(ADVANTAGE, "") is None else []
    if recorded is None:
        return counted_settings(config, own_estimator), "as written"
    if not (isinstance(recorded, list) and all(isinstance(key, str) and key.startswith(OBJECTIVE_SETTINGS)
                                               for key in recorded)):
        warn(f"{path}: `settings_left_out` is not a list of objective settings ({OBJECTIVE_SETTINGS[0]}, "
             f"{OBJECTIVE_SETTINGS[1]}...): ignored, the run's settings are compared as written")
    elif not isinstance(summary.get("objective_own"), dict):
        warn(f"{path}: `settings_left_out` without its `objective_own` (an object): ignored, the run's settings are "
             "compared as written")
    else:
        return counted_settings(config, [*recorded, *own_estimator]), "recorded"
    return counted_settings(config, own_estimator), "as written"


def _first(*values):
    return next((v for v in values if v is not None), None)


START_POLICY_NUMBERS = ("start_policy_steps", "start_policy_check_accuracy", "start_policy_eval_accuracy")


def start_policy(summary: dict, path: Path) -> dict:
    """summary.json's `start_policy` as run columns. start_policy: which starting policy, "none" (null: no warm
    start) or None (not recorded: runs older than the field). A starting policy is its cache key and the digest of
    its weights, ``<key>/<first 8 digits>``: the key names what it was built from, and the same key built apart on
    two CPUs can give two policies (harness/policy/warm_start.py), which are never pooled as one (the intervals take
    ``model.seed`` as the starting policy: analysis/cells.py mark_mixed_policies counts one's runs and names the
    others). Runs that recorded no digest (older ones) are their key alone. Without a warm start the policy is
    ``none/<first 8 digits of start_weights>`` (key ``none``): a model folder whose weights changed between runs is
    two policies too."""
    info = summary.get("start_policy")
    if info is None:  # no warm start: the base model's weights, their digest where recorded (start_weights)
        weights = summary.get("start_weights")
        if "start_policy" not in summary:
            return {"start_policy": None}
        return {"start_policy": f"none/{str(weights)[:8]}" if weights else "none",
                **({"start_policy_key": "none"} if weights else {})}
    if not isinstance(info, dict):
        warn(f"{path}: start_policy is not an object or null, ignored")
        return {"start_policy": None}
    key, weights = str(info.get("key") or "?"), info.get("weights_sha256")
    return {"start_policy": key if weights is None else f"{key}/{str(weights)[:8]}", "start_policy_key": key,
            "start_policy_cpu": info.get("cpu"), "start_policy_steps": info.get("steps"),
            "start_policy_check_accuracy": info.get("accuracy"),
            "start_policy_eval_accuracy": info.get("eval_accuracy")}


COUNTS = ("seed", "steps_done", "total_steps")  # whole numbers >= 0 (below 2^63: a table's integers)
ACCURACIES = ("start_eval_accuracy", "final_eval_accuracy", "best_eval_accuracy")  # in [0, 1]
AMOUNTS = ("wall_time_s", "cpu_time_s", "rollout_tokens")  # finite, >= 0
SUMMARY_NUMBERS = ("seed", "steps_done", "total_steps", "start_eval_accuracy", "final_eval_accuracy",
                   "best_eval_accuracy", "wall_time_s", "cpu_time_s", "rollout_tokens")


def checked_summary(summary: dict, path: Path) -> dict:
    """summary.json with each number the report reads checked: a value that is not a number is dropped with a
    warning (the report then falls back on the metrics or says n/a)."""
    out = dict(summary)
    for key in SUMMARY_NUMBERS:
        value = out.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            warn(f"{path}: `{key}` is {value!r}, not a number: ignored")
            out.pop(key)
    for key in COUNTS:
        value = out.get(key)
        if value is not None and not (math.isfinite(value) and value == int(value) and 0 <= value < 2**63):
            warn(f"{path}: `{key}` is {value!r}, not a whole number >= 0 (below 2^63): ignored")
            out.pop(key)
        elif value is not None:
            out[key] = int(value)
    for keys, low, high, what in ((ACCURACIES, 0.0, 1.0, "an accuracy in [0, 1]"),
                                  (AMOUNTS, 0.0, math.inf, "a finite number >= 0")):
        for key in keys:
            value = out.get(key)
            if value is not None and not (math.isfinite(value) and low <= value <= high):
                warn(f"{path}: `{key}` is {value!r}, not {what}: ignored")
                out.pop(key)
    if out.get("steps_done") is not None and out.get("total_steps") is not None \
            and out["steps_done"] > out["total_steps"]:
        warn(f"{path}: `steps_done` {out['steps_done']} is beyond the run's {out['total_steps']} steps: ignored")
        out.pop("steps_done")
    for key in ("status", "objective"):
        if key in out and not isinstance(out[key], str):
            warn(f"{path}: `{key}` is {out[key]!r}, not a string: ignored")
            out.pop(key)
    if summary and "status" not in summary:
        warn(f"{path}: no `status`: the run's status is unknown")
    return out


def collapse_of(summary: dict, read: MetricsFile, path: Path) -> dict:
    """The run's collapse columns: summary.json's `collapse` when the key is there (null: none), else the rule of
    harness/run/collapse.py applied to its metrics (runs written before the loop recorded it)."""
    if "collapse" in summary:
        record = summary["collapse"]
        if record is None:
            return {"collapse_step": None, "collapse_cause": None, "collapse_source": "summary.json"}
        if isinstance(record, dict) and isinstance(record.get("step"), int) and isinstance(record.get("cause"), str):
            return {"collapse_step": record["step"], "collapse_cause": record["cause"],
                    "collapse_source": "summary.json"}
        warn(f"{path}: `collapse` is not null or an object with an integer step and a cause; the report applies the "
             "rule to the metrics instead")
    if not read.rows:
        return {"collapse_step": None, "collapse_cause": None, "collapse_source": None}
    found = detect_collapse(read.rows, COLLAPSE_RULE)
    return {"collapse_step": found and found["step"], "collapse_cause": found and found["cause"],
            "collapse_source": "metrics (the report's rule)"}


def code_of(summary: dict) -> dict:
    """The run's code columns from summary.json's segments (harness/run/provenance.py): ``code`` (its version, ``A
    then B`` for a run continued under other code, ``unknown`` for a run written before the records; None without a
    summary.json), ``packages`` and ``threads`` (the torch threads its segments used, e.g. "1")."""
    if not summary:
        return {"code": None, "packages": None, "threads": None}
    threads = run_threads(summary)
    return {"code": run_version(summary), "packages": run_packages(summary),
            "threads": "/".join(map(str, threads)) if threads else None}


def log_error(path: Path, last_line: bool = False) -> str | None:
    """The error a run printed last in its train.log (a sweep's run whose failure came before its summary.json);
    ``last_line``: only when it is the log's last line (the last attempt ended with it, not with a kill)."""
    if not regular(path):
        return None
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    last = next((line for line in reversed(lines[-1:] if last_line else lines) if line.startswith("error: ")), None)
    return last.removeprefix("error: ")[:300] if last else None


def load_run(exp_dir: Path, entry: dict) -> tuple[dict, pd.DataFrame, dict, pd.DataFrame | None]:
    run_dir = exp_dir / str(entry.get("dir") or entry.get("run_id"))
    run_id = str(entry.get("run_id") or run_dir.name)
    found = {name: (run_dir / name).exists() for name in RUN_FILES}
    if run_dir.is_dir() and entry.get("status") != "pending":  # a run not started yet has not written them
        for name, exists in found.items():
            if not exists:
                warn(f"{run_dir / name}: missing")
    summary = checked_summary((read_json(run_dir / "summary.json") if found["summary.json"] else None) or {},
                              run_dir / "summary.json")
    raw = read_config(run_dir / "config.yaml") if found["config.yaml"] else {}
    codes = code_of(summary)
    if codes["code"] is None:  # no summary.json: the code config.yaml's first line names (a run killed early)
        codes["code"] = config_code(run_dir / "config.yaml")
    config, settings_read = cell_settings(raw, summary, codes["code"], run_dir / "summary.json")
    total = _first(summary.get("total_steps"), config.get("train.steps"))
    total = total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else None
    read = (parse_metrics(run_dir / "metrics.jsonl", total) if found["metrics.jsonl"]
            else MetricsFile(pd.DataFrame(), []))
    metrics = read.frame
    evals = metrics["eval_accuracy"].dropna() if "eval_accuracy" in metrics else pd.Series(dtype=float)
    at_start = evals[metrics.loc[evals.index, "step"] == 0] if len(evals) else evals
    status = _first(summary.get("status"), entry.get("status"), "unknown")
    # a run that says "running" but whose folder lock nobody holds was killed (the kernel drops a dead holder's lock),
    # unless it has not written its summary yet while its sweep, alive, is starting it
    # (or whose lock records a writer on another host with a fresh heartbeat: running there, harness/run/locks.py)
    elsewhere = writer_elsewhere(run_dir / RUN_LOCK) if status in ("running", "pending") else None
    status = "running" if elsewhere is not None else status
    stopped = (status == "running" and elsewhere is None and run_dir.is_dir() and not is_held(run_dir / RUN_LOCK)
               and (found["summary.json"] or not is_held(exp_dir / SWEEP_LOCK)))
    run = {
        "run_id": run_id,
        "objective": str(_first(entry.get("objective"), summary.get("objective"), config.get("objective.name"),
                                "unknown")),
        "seed": _first(entry.get("seed"), summary.get("seed"), config.get("seed")),
        # the starting policy's replicate (harness/run/config.py model.seed): the level above the seeds; none where
        # nothing is drawn from it (a pretrained model without a warm start or adapters: one starting policy)
        START_SEED: _first(config.get(START_SEED), (entry.get("overrides") or {}).get(START_SEED))
        if draws_from_model_seed(config) else None,
        "status": "stopped" if stopped else status,
        "steps_done": int(_first(summary.get("steps_done"), metrics["step"].max() if len(metrics) else None, 0)),
        "total_steps": _first(summary.get("total_steps"), config.get("train.steps")),
        "final_eval_accuracy": _first(summary.get("final_eval_accuracy"), evals.iloc[-1] if len(evals) else None),
        "best_eval_accuracy": _first(summary.get("best_eval_accuracy"), evals.max() if len(evals) else None),
        "start_eval_accuracy": _first(at_start.iloc[0] if len(at_start) else None, summary.get("start_eval_accuracy")),
        "wall_time_s": summary.get("wall_time_s"),
        "cpu_time_s": summary.get("cpu_time_s"),
        "rollout_tokens": summary.get("rollout_tokens"),
        "has_summary": bool(summary),
        "settings_read": settings_read,
        # the objective's own values as its code set them (JSON; None: not recorded)
        "objective_own": json.dumps(summary["objective_own"], sort_keys=True)
        if isinstance(summary.get("objective_own"), dict) else None,
        **codes,
        **start_policy(summary, run_dir / "summary.json"),
        **collapse_of(summary, read, run_dir / "summary.json"),
        # the last value of each scoring variant of the eval accuracy (eval_accuracy_strict, ..._flexible)
        **{f"final_{c}": metrics[c].dropna().iloc[-1] for c in sorted(metrics)
           if c.startswith(SCORING_PREFIX) and metrics[c].notna().any()},
    }
    if found["metrics.jsonl"]:
        data_warnings(run_dir / "metrics.jsonl", read, run["status"], run["steps_done"], summary)
    problems = _problems(run_dir, found, run, stopped, summary, raw, elsewhere)
    if run["status"] == "diverged" and run["collapse_cause"] is None:  # the loop stopped it: non-finite updates
        run.update(collapse_step=run["steps_done"], collapse_cause="non_finite_loss", collapse_source="status diverged")
    run["complete"] = not problems
    # ended: a result to count: finished, or diverged (stopped by the loop for non-finite updates, records intact)
    run["ended"] = run["complete"] or (run["status"] == "diverged" and bool(len(metrics))
                                       and not edited_after_written(raw, summary))
    run["problem"] = "; ".join(problems)
    if len(metrics):
        metrics.insert(0, "run_id", run_id)
        metrics.insert(1, "objective", run["objective"])
        metrics.insert(2, "seed", run["seed"])
    samples = read_samples(run_dir / SAMPLES) if (run_dir / SAMPLES).is_file() and regular(run_dir / SAMPLES) else None
    if run["ended"]:
        unscored(run_dir, samples, run["final_eval_accuracy"])
    return run, metrics, config, samples


def unscored(run_dir: Path, samples: pd.DataFrame | None, final) -> None:
    """A data warning naming an ended run whose per-problem scores do not give its final eval accuracy (missing, cut
    short, or not its own: analysis/accuracy.py run_scores): its comparisons' intervals are then over seeds only."""
    if final is None or not math.isfinite(float(final)) or run_scores(samples, FINAL, float(final)) is not None:
        return
    why = f"no {SAMPLES}" if samples is None else f"its {SAMPLES} does not give its final eval accuracy {final:.4g}"
    warn(f"{run_dir}: {why}: the intervals of its comparisons are over seeds only (the eval set's noise left out)")


def _problems(run_dir: Path, found: dict[str, bool], run: dict, stopped: bool, summary: dict,
              config: dict, elsewhere: Writer | None = None) -> list[str]:
    """What keeps a run from being complete, first its status (killed, failed, ...), in the report's words;
    ``config``: its config.yaml's settings as read (dotted keys); ``elsewhere``: the writer on another host its lock
    records with a fresh heartbeat (a folder copied mid-run)."""
    problems = []
    if not run_dir.is_dir():
        problems.append(f"not started (no folder {run_dir.name}/)")
    else:
        problems += [f"no {name}" for name in ("summary.json", "metrics.jsonl") if not found[name]]
    total = run["total_steps"]
    resumed = log_error(run_dir / "train.log", last_line=True) if stopped else None  # a resume that failed
    if resumed:
        problems.insert(0, f"stopped at step {run['steps_done']}/{'?' if total is None else total}; its last attempt "
                           f"to continue failed: {resumed}")
    elif stopped and (stale := stale_elsewhere(run_dir / RUN_LOCK)) is not None:
        problems.insert(0, f"stopped at step {run['steps_done']}/{'?' if total is None else total} (its lock names "
                           f"a writer {stale.said()}: stopped there, or this folder is a copy that old; run the same "
                           "command to resume)")
    elif stopped:
        problems.insert(0, f"stopped at step {run['steps_done']}/{'?' if total is None else total} (killed; run the "
                           "same command to resume)")
    elif elsewhere is not None:
        problems.insert(0, f"running {elsewhere.said()}, at step {run['steps_done']}/{'?' if total is None else total}"
                           " then (a copy of its folder: copy it again for more)")
    elif run["status"] != "finished":
        problems.insert(0, f"status {run['status']}")
    if not stopped and elsewhere is None and total is not None and run["steps_done"] < total:
        problems.append(f"{run['steps_done']}/{total} steps")
    error = summary.get("error") or (log_error(run_dir / "train.log") if run["status"] == "failed" else None)
    if error:
        problems.append(f"error: {error}")
    if edited_after_written(config, summary):
        problems.append("config.yaml edited after the run wrote it (its settings are not those summary.json's "
                        "settings_digest records): not counted; restore the settings the run trained with")
    return problems


def is_run_folder(folder: Path) -> bool:
    """A folder a run has written to (its summary.json or metrics.jsonl; one without config.yaml is reported with its
    settings unknown). A folder with only a config.yaml is a sweep's plan, not a run."""
    return folder.is_dir() and any((folder / name).is_file() for name in ("summary.json", "metrics.jsonl"))


@dataclass
class Folder:
    """One results folder as read: its label (the name its runs' ``source`` shows), manifest.json (empty when
    missing) and per run load_run's (run, metrics, config, samples)."""
    dir: Path
    label: str
    manifest: dict
    loaded: list[tuple]

    def overrides(self) -> dict[str, dict]:
        """manifest.json's grid point of each run it lists, by run id."""
        return {str(e.get("run_id") or e.get("dir")): e["overrides"] for e in self.manifest.get("runs", [])
                if isinstance(e, dict) and isinstance(e.get("overrides"), dict)}


def manifest_entries(exp_dir: Path, manifest: dict | None) -> list[dict]:
    """manifest.json's runs, each folder once and only the experiment folder's own: an entry listed twice (a hand
    edit, a merge of two manifests) would be two rows of one run, each the other's duplicate, and so counted zero
    times; a ``dir`` outside the folder (``../..``, an absolute path) would be read as a run of this experiment. Both
    said in one warning each."""
    entries, seen, twice, outside = [], set(), [], []
    for entry in (manifest or {}).get("runs", []) if isinstance(manifest, dict) else []:
        if not isinstance(entry, dict) or not (entry.get("dir") or entry.get("run_id")):
            continue
        name = str(entry.get("dir") or entry.get("run_id"))
        if Path(name).name != name or name in (".", "..") or (exp_dir / name).is_symlink():
            outside.append(name)
        elif name in seen:
            twice.append(name)
        else:
            seen.add(name)
            entries.append(entry)
    if twice:
        warn(f"{exp_dir / 'manifest.json'} lists {listed(sorted(set(twice)), 10)} more than once: each run is read "
             "once")
    if outside:
        warn(f"{exp_dir / 'manifest.json'} lists {listed(outside, 10)}, not a folder of this experiment's: ignored "
             "(a run's folder is one of the experiment folder's own, not a symbolic link)")
    return entries


def linked_run_folders(exp_dir: Path) -> set[str]:
    """The names of the experiment folder's symbolic links to run folders, said in one warning: never followed (a
    link to another experiment's run would be reported as this one's)."""
    links = sorted(d.name for d in exp_dir.iterdir() if d.is_symlink() and is_run_folder(d))
    if links:
        warn(f"{exp_dir}: {listed(links, 10)} {'is a symbolic link' if len(links) == 1 else 'are symbolic links'} to "
             "a run folder elsewhere: not read (copy the run's folder here to report it with this experiment)")
    return set(links)


def read_folder(exp_dir: Path, label: str) -> Folder:
    """Every run of the folder: manifest.json's, then the run folders it does not list (named in one warning)."""
    if problem := folder_problem(exp_dir):
        raise AnalysisError(problem)
    manifest = read_json(exp_dir / "manifest.json") if (exp_dir / "manifest.json").exists() else None
    if isinstance(manifest, dict) and not isinstance(manifest.get("runs", []), list):
        warn(f"{exp_dir / 'manifest.json'}: `runs` is {manifest['runs']!r}, not a list of runs: ignored")
        manifest = {k: v for k, v in manifest.items() if k != "runs"}
    entries = manifest_entries(exp_dir, manifest)
    planned = {str(e.get("dir") or e.get("run_id")) for e in entries}
    linked = linked_run_folders(exp_dir)
    found = [{"run_id": d.name} for d in sorted(exp_dir.iterdir())
             if d.name not in planned | linked and is_run_folder(d)]
    if found and entries:
        names = listed([e["run_id"] for e in found], 10)
        warn(f"{exp_dir}: {len(found)} run{'s' * (len(found) > 1)} on disk that manifest.json does not list (another "
             f"sweep's or `train`'s, into the same folder) {'is' if len(found) == 1 else 'are'} reported too: {names}")
    elif found:
        warn(f"{exp_dir / 'manifest.json'}: missing or lists no runs; analysing the {len(found)} run folders found")
    entries += found
    if not entries:
        lab = (exp_dir / "batches").is_dir() and (exp_dir / "config.yaml").is_file()  # harness/apps/lab.py's folder
        inside = sorted(d.name for d in exp_dir.iterdir() if d.is_dir() and not d.is_symlink()
                        and (d / "manifest.json").is_file())  # a results_dir: its experiments' folders
        raise AnalysisError(f"no runs in {exp_dir}: " + (
            "it holds a gradient lab's batches, whose report the lab writes itself (its report/ folder; `python -m "
            "harness lab` with the same settings, or `make lab`, writes it again)" if lab else
            f"it holds the experiment folder{'s' if len(inside) > 1 else ''} {listed(inside, 10)}: give "
            f"{exp_dir / inside[0]}" if inside else
            f"it is a run's own folder: give its experiment's folder, {exp_dir.parent}" if is_run_folder(exp_dir) else
            "no manifest.json listing runs and no run folders (a folder with a summary.json or metrics.jsonl)"))
    loaded = [load_run(exp_dir, e) for e in entries]
    for run, *_ in loaded:
        run["source"] = label
    return Folder(exp_dir, label, manifest or {}, loaded)


def kept_apart_by_spelling(runs: list[tuple[dict, dict]]) -> list[dict]:
    """Of runs read as written (``(run, settings)``), those that this code's reading would pool with another of
    them in one cell: the runs the data warning counts (nothing to say where reading as written splits nothing)."""
    def cell(run: dict, settings: dict) -> str:
        return json.dumps([run["objective"], run["code"], {k: v for k, v in settings.items() if k != "seed"}],
                          sort_keys=True, default=str)

    spellings: dict[str, set[str]] = {}
    for run, settings in runs:
        spellings.setdefault(cell(run, counted_settings(settings)), set()).add(cell(run, settings))
    return [run for run, settings in runs if len(spellings[cell(run, counted_settings(settings))]) > 1]


def assemble(name: str, exp_dir: Path, loaded: list[tuple], overrides: dict[str, dict]) -> Experiment:
    """The Experiment of the loaded runs (run ids distinct): the frames, the cells (analysis/cells.py)."""
    runs = pd.DataFrame([run for run, *_ in loaded])
    frames = [m for _, m, *_ in loaded if len(m)]
    metrics = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run_id", "objective", "step"])
    if "rollout_tokens" in metrics:  # the step-0 evaluation precedes any sampling
        before = metrics["step"] == 0
        metrics.loc[before, "rollout_tokens"] = metrics.loc[before, "rollout_tokens"].fillna(0)
    numbers = ["final_eval_accuracy", "best_eval_accuracy", "start_eval_accuracy", "wall_time_s", "cpu_time_s",
               "rollout_tokens", "collapse_step",
               *[c for c in runs if c in START_POLICY_NUMBERS or c.startswith("final_" + SCORING_PREFIX)]]
    runs[numbers] = runs[numbers].astype(float)  # None -> NaN
    integers = ["seed", START_SEED, "total_steps"]
    runs[integers] = runs[integers].astype("Int64")  # <NA> when unknown
    # each run's settings less those that make no other run, as in its id: its objective's at their own values (a
    # setting left out is each objective's own), those that change nothing here (load_run's cell_settings)
    configs = {run["run_id"]: config for run, _, config, _ in loaded}
    apart = kept_apart_by_spelling([(run, config) for run, _, config, _ in loaded
                                    if run["settings_read"] == "as written" and config])
    if apart:
        versions = sorted({str(run["code"] or "unknown") for run in apart})
        warn(f"{len(apart)} run{'s' * (len(apart) > 1)} of other code ({listed(versions, 5)}) did not record which "
             "of their settings were their objective's own values, which that code may have set otherwise: they are "
             "compared as written, so a setting written out at this code's default is another cell than one left "
             "out (re-run them with this code to pool them)")
    samples = {run["run_id"]: scores for run, _, _, scores in loaded if scores is not None and len(scores)}
    # the code a run ran is one of its settings: runs of two code versions are never pooled (analysis/cells.py)
    with_code = {run["run_id"]: {**configs[run["run_id"]], CODE: run["code"] or UNKNOWN} if config else config
                 for run, _, config, _ in loaded}
    runs, cells, notes = assign_cells(runs, with_code, overrides)
    for note in notes:
        warn(note)
    extra = runs.set_index("run_id")[["cell", "cell_id", "counted", START_SEED]]
    metrics = metrics.join(extra, on="run_id")  # each metrics row knows its run's cell and whether it is counted
    return Experiment(name, exp_dir, runs, metrics, configs, overrides, cells, samples)


def load_experiment(exp_dir: str | Path) -> Experiment:
    """Every run of one results folder (see the module docstring)."""
    if not isinstance(exp_dir, str | Path):  # a list went six frames deep into pathlib
        raise TypeError(f"load_experiment takes one results folder (a str or Path), got {type(exp_dir).__name__}; "
                        "several: load_experiments([...])")
    if not str(exp_dir).strip():  # Path("") is the current folder, read without a word
        raise AnalysisError(f"results folder {str(exp_dir)!r} is empty: give an experiment's results folder "
                            "(results/<experiment>, the one holding manifest.json)")
    exp_dir = Path(exp_dir)
    folder = read_folder(exp_dir, exp_dir.name)
    exp = assemble(str(folder.manifest.get("experiment") or exp_dir.name), exp_dir, folder.loaded,
                   folder.overrides())
    baseline, objectives = folder.manifest.get("baseline"), folder.manifest.get("objectives")
    exp.baseline = baseline if isinstance(baseline, str) else None
    exp.objectives = [str(o) for o in objectives] if isinstance(objectives, list) else []
    exp.sources = [exp_dir]
    return exp
