"""A run's files, crash-safe and the same for both backends:

    <run_dir>/config.yaml          the resolved config
    <run_dir>/metrics.jsonl        one line per step (step 0: the starting policy's evaluation), flushed and fsynced
    <run_dir>/eval_samples.jsonl   one line per eval problem and evaluation (greedy completion, answer, score)
    <run_dir>/summary.json         status (running | finished | diverged | failed | interrupted), progress, eval
                                   accuracies, the starting policy's record, the run's ``collapse`` record so far
                                   (harness/run/collapse.py's rule on its metric rows, null: none), the error of a
                                   failed run, the code it runs (``code``) and each start's code and threads
                                   (``segments``: harness/run/provenance.py); written atomically.
                                   "running" is only true while a process holds <run_dir>/.run.lock: read the
                                   status with run_status(), which says "stopped" for a killed run (and
                                   "running" for one whose lock records a fresh heartbeat of another host:
                                   harness/run/locks.py)
    <run_dir>/checkpoints/         the native loop's last two checkpoints (last.pt, previous.pt); once the run has
                                   ended, last.pt alone, without the optimizer's state (RunRecords.end, learner_parts)
    <run_dir>/final/               the trained policy in transformers' format (save_pretrained), at the end
    <run_dir>/exports/step_<N>/    the same every ``train.export_every`` steps (both backends)
    <run_dir>/tensorboard/, wandb/ the trackers of ``logging.backends`` beyond jsonl (harness/run/tracking.py)

On resume both JSON-lines files keep exactly the steps up to the checkpoint's, so no step is ever written twice, and
only with the settings of the run's config.yaml, its memory settings aside (check_resume). Every file that is
replaced goes through atomic_write (temporary + fsync + rename); a full disk is one DiskFullError naming the file,
and leaves no temporary.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import pickle
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from transformers.utils import logging as hf_logging

from harness.run.atomic import (
    atomic_write,
    check_writable,
    disk_full_error,
    remove_stale_temporaries,
    special_file,
    to_file,
    write_temporary,
)
from harness.run.collapse import CollapseRule, detect_collapse
from harness.run.config import (
    NOT_IN_RUN_ID,
    NOT_RUN_SECTIONS,
    canonical_values,
    edited_after_written,
    flattened,
    memory_settings,
    objective_defaults,
    own_values_written,
    scale_written_once,
    schema_defaults,
    settings_digest,
    settings_left_out,
    unused_setting,
)
from harness.run.errors import ConfigError
from harness.run.locks import (
    RUN_LOCK,
    TAKE_OVER,
    FolderBusyError,
    check_lock_file,
    is_held,
    lock_folder,
    taken_over,
    writer_elsewhere,
)
from harness.run.provenance import code_record, next_segments, run_version
from harness.run.tracking import Trackers

# per-step metrics that measure time or memory: they differ between otherwise identical runs (resume checks skip them)
PEAK_MEMORY = ("peak_mem_rollout_mb", "peak_mem_update_mb", "peak_mem_eval_mb", "peak_mem_mb")  # per phase, step
TIMING_METRICS = frozenset({"rollout_s", "update_s", "rollout_tok_s", "update_tok_s", "step_s", *PEAK_MEMORY,
                            "eval_s", "update_logp_forward_s", "update_stats_forward_s", "update_backward_s",
                            "update_optimizer_s"})


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; analysis reads null as missing
    return value


def write_json_atomic(path: Path, data: dict) -> None:
    atomic_write(path, json.dumps({k: _clean(v) for k, v in data.items()}, indent=2))


def read_jsonl(path: Path, warn: bool = False, complete: bool = False) -> list[dict]:
    """The complete JSON lines of a file. An unreadable line inside the file is dropped, with a warning on stderr
    naming the file and line when ``warn``. An unreadable *last* line is what a kill (or a full disk) in the middle
    of writing it leaves: dropped silently, since the run redoes that step on resume, unless ``complete`` (the
    writer is done, e.g. a finished run: the step is lost), which warns as for any other line, naming its step."""
    if not path.exists():
        return []
    rows, lines = [], path.read_text(errors="replace").splitlines()  # a damaged byte: that line does not parse
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if warn and (number < len(lines) or complete):
                step = re.match(r'\{"step": (\d+)', line)
                what = f"step {step.group(1)}" if step else "the step it held"
                print(f"warning: {path}, line {number}{' (the last)' if number == len(lines) else ''} is not valid "
                      f"JSON: dropped ({what} is listed in summary.json's missing_steps)", file=sys.stderr)
    return rows


class MetricsLog:
    """A JSON-lines file of per-step records: on (re)open, keeps only complete lines with step <= ``resume_step``
    (None: keep nothing), so a resumed run never writes a step twice; then appends, flushed and fsynced. A cut-short
    last line of a step the checkpoint already covers (the step is lost, not redone) is warned about."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        keep = -1 if resume_step is None else resume_step
        rows = read_jsonl(path, warn=True, complete=keep >= 0 and _torn_step(path, keep))
        steps = [isinstance(r, dict) and type(r.get("step")) is int and r["step"] >= 0 for r in rows]
        if not all(steps):
            print(f"warning: {path}: {len(steps) - sum(steps)} line(s) without a step (a whole number >= 0) dropped",
                  file=sys.stderr)
        self.rows = [r for r, is_step in zip(rows, steps, strict=True) if is_step and r["step"] <= keep]
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in self.rows))
        self.file = open(path, "a")

    def append(self, row: dict) -> None:
        self.extend([row])

    def extend(self, rows: list[dict]) -> None:
        rows = [{k: _clean(v) for k, v in row.items()} for row in rows]
        try:
            self.file.write("".join(json.dumps(row) + "\n" for row in rows))
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as e:
            full = disk_full_error(e, self.path)
            if full is None:
                raise
            raise full from None
        self.rows.extend(rows)

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:  # what a full disk kept in the buffer: the torn line is dropped on resume
            pass


def _torn_step(path: Path, keep: int) -> bool:
    """Whether ``path``'s last line is cut short and held a step <= ``keep`` (one that will not be redone)."""
    if not path.exists():
        return False
    lines = path.read_text(errors="replace").splitlines()
    if not lines:
        return False
    try:
        json.loads(lines[-1])
        return False
    except json.JSONDecodeError:
        step = re.match(r'\{"step": (\d+)', lines[-1])
        return step is not None and int(step.group(1)) <= keep


# ------------------------------------------------------------------------------------ resume: the same run only

IGNORED_ON_RESUME = NOT_IN_RUN_ID  # settings that do not change a run
NOT_RUN_SETTINGS = (*NOT_RUN_SECTIONS, "profile")  # not part of a run's config.yaml


def _shown(value) -> str:
    return "(unset)" if value is _UNSET else "null" if value is None else str(value)


_UNSET = object()


def listed(items: list[str], most: int = 6) -> str:
    """The first ``most`` of ``items`` joined for a one-line message, with how many more there are."""
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def plain_differences(old: dict, new: dict) -> list[str]:
    """``key old -> new`` for every dotted key whose value differs between the nested ``old`` and ``new`` (a key on one
    side only shows as ``(unset)`` on the other); no default or resume rule applies (:func:`settings_differences`)."""
    before, after = flattened(old), flattened(new)
    return [f"{key} {_shown(before.get(key, _UNSET))} -> {_shown(after.get(key, _UNSET))}"
            for key in dict.fromkeys([*before, *after]) if before.get(key, _UNSET) != after.get(key, _UNSET)]


def settings_differences(saved: dict, cfg: DictConfig) -> dict[str, str]:
    """{key: ``key old -> new``} for every setting of ``cfg`` that differs from the ``saved`` config's, ignoring what
    does not change a run (results_dir, logging) and settings added to the schema since at their default. An
    objective hyperparameter left out on one side counts as its default, ``objective.advantage: null`` as the
    objective's own estimator (given explicitly, either is the same run: :func:`harness.run.config.objective_defaults`);
    values are compared as numbers where one side holds a number and the other its text (a config.yaml that kept an
    interpolation such as ``${oc.env:LR}`` resolves to text)."""
    defaults = flattened(schema_defaults())
    # the objective's settings as the values they stand for (null: its own estimator; "" aggregation: its own)
    old, new = (own_values_written(flattened(scale_written_once(canonical_values(copy.deepcopy(c)))))
                for c in (saved, OmegaConf.to_container(cfg, resolve=True)))  # sets in one order: the same run
    old_params, new_params = (objective_defaults(flat.get("objective.name")) for flat in (old, new))
    differences = {}
    for key in dict.fromkeys([*new, *old]):
        if key.split(".")[0] in IGNORED_ON_RESUME + NOT_RUN_SETTINGS:
            continue
        before, after = old.get(key, old_params.get(key, _UNSET)), new.get(key, new_params.get(key, _UNSET))
        if before is _UNSET and after == defaults.get(key, _UNSET):
            continue  # a setting added to the schema since the run started, at its default
        if not _same(before, after):
            differences[key] = f"{key} {_shown(before)} -> {_shown(after)}"
    return differences


def memory_changes(saved: dict, cfg: DictConfig) -> list[str]:
    """``key old -> new`` for each memory setting (harness/run/config.py :func:`memory_settings`) of ``cfg`` that
    differs from the ``saved`` config's: a resume may change them."""
    differences = settings_differences(saved, cfg)
    return [differences[key] for key in memory_settings(cfg) if key in differences]


def say_memory_changes(run_dir: Path, changes: list[str]) -> None:
    print(f"continuing {run_dir.name} with other memory settings: {', '.join(changes)} (they change no number "
          "beyond float round-off; config.yaml records the new ones)", file=sys.stderr)


def _same(before, after) -> bool:
    """Equal, or the same number where one side is a number and the other its text (``'1e-4'`` and ``0.0001``)."""
    if before == after:
        return True
    numbers = [v for v in (before, after) if isinstance(v, int | float) and not isinstance(v, bool)]
    texts = [v for v in (before, after) if isinstance(v, str)]
    if len(numbers) != 1 or len(texts) != 1:
        return False
    try:
        return float(texts[0]) == numbers[0]
    except ValueError:
        return False


def other_settings(saved: dict, cfg: DictConfig) -> tuple[dict, list[str]]:
    """(the settings of ``cfg`` that a run's saved config.yaml holds otherwise: key -> what differs, the memory
    settings among them, which change no number beyond round-off, left apart); settings that change nothing in
    ``cfg``'s run are left out."""
    differences = settings_differences(saved, cfg)
    memory = [differences.pop(key) for key in memory_settings(cfg) if key in differences]
    for key in [key for key in differences if unused_setting(cfg, key)]:  # they change nothing
        differences.pop(key)
    return differences, memory


def edited_run(run_dir: Path, saved: dict) -> bool:
    """Whether ``saved`` (the settings of run_dir's config.yaml, as read) are not those the run wrote, by the digest
    its summary.json records (config.py edited_after_written; no summary, or one that cannot be read: False)."""
    summary = {}
    with contextlib.suppress(OSError, ValueError):  # nothing recorded to check against
        summary = json.loads((run_dir / "summary.json").read_text())
    return edited_after_written(flattened(saved), summary)


def check_resume(cfg: DictConfig, run_dir: Path, warn: bool = True, main: bool = True, probe_lock: bool = True
                 ) -> list[str]:
    """Refuse (ConfigError, one line, before anything is touched) a folder that cannot be written, and to continue
    the run in ``run_dir`` with settings other than those in its config.yaml: its steps would mix two runs (but for
    the memory settings, which change no number: returned); and a folder another process is
    writing (FolderBusyError, the message :class:`RunRecords`' lock gives, so a second writer is refused before it
    prints anything; the lock itself is still taken when the run starts; ``probe_lock`` False: not probed, for the
    run's own records, which take it next). ``main`` False (the other processes of
    `accelerate launch`, which write nothing of the run and may find the main one holding the lock): the settings
    are compared, the folder is neither probed for writing nor for its lock. ``warn``: a damaged config.yaml is said.
    Returns the memory settings' changes (``key old -> new``), for the caller to say (:func:`say_memory_changes`) once
    its own checks have passed."""
    if main:
        check_run_folder(run_dir)
        check_writable(run_dir)
        check_lock_file(run_dir / RUN_LOCK)
    if main and probe_lock and is_held(run_dir / RUN_LOCK):
        raise FolderBusyError(f"{RUN_FOLDER_BUSY.format(run_dir=run_dir)}; wait for it or stop it")
    if main and probe_lock and (elsewhere := writer_elsewhere(run_dir / RUN_LOCK)) is not None:
        raise FolderBusyError(f"{RUN_FOLDER_BUSY.format(run_dir=run_dir)} {elsewhere.said()}; "
                              f"{TAKE_OVER.format(lock=run_dir / RUN_LOCK)}")
    saved_path = run_dir / "config.yaml"
    try:
        saved = read_run_config(saved_path)
    except DamagedConfigError as e:
        if main and config_code(saved_path) is None and not any((run_dir / name).exists() for name in RUN_RECORDS):
            raise ConfigError(f"{e}; nothing in {run_dir} is a run's (a run's config.yaml names its code on its first "
                              "line, and a run that began writes metrics.jsonl): a run there would write over that "
                              "file; give a new or empty --run-dir") from None
        if warn:
            print(f"warning: {e}: these settings cannot be checked against the run's; the run continues with them and "
                  "config.yaml is written anew", file=sys.stderr)
        return []
    if saved is None:
        return []
    if edited_run(run_dir, saved):
        raise ConfigError(f"{saved_path} was edited after the run wrote it (its settings are not those summary.json's "
                          "settings_digest records): continuing would mix two runs; restore the settings the run "
                          f"trained with, or move {run_dir} away to run these anew")
    differences, memory = other_settings(saved, cfg)
    if differences:
        raise ConfigError(f"{run_dir} holds a run with other settings ({listed(list(differences.values()))}); "
                          "continuing it would mix two runs: "
                          f"give a fresh --run-dir (or none) for these settings, or resume that run with its own: "
                          f"python -m harness train {saved_path} --run-dir {run_dir}")
    return memory


# the files a run writes in its folder (each a regular file of its own: check_run_folder)
RUN_FILES = ("config.yaml", "train.log", "metrics.jsonl", "summary.json", "eval_samples.jsonl", "traceback.txt")
# the folders a run writes, reads back and removes files in (checkpoints, exports, TRL's output, trackers): none of
# them, nor anything in the first four, may be a link (check_run_folder); wandb keeps a link of its own inside its own
RUN_FOLDERS = ("checkpoints", "exports", "final", "trl", "tensorboard", "wandb")
# what only a run that began writes there
RUN_RECORDS = ("metrics.jsonl", "summary.json", "eval_samples.jsonl", "checkpoints")
# what a run's folder may hold before its config.yaml: the lock, the launcher's log, config.yaml's temporary, and
# the traceback of a run that failed before writing it (harness/apps/cli.py writes it beside the run)
BEFORE_CONFIG = re.compile(rf"{re.escape(RUN_LOCK)}|train\.log|traceback\.txt"
                           r"|\.?(config\.yaml|traceback\.txt)(\.\d+)?\.tmp")


def check_run_folder(run_dir: Path) -> None:
    """Refuse (ConfigError) a run folder that is a link (a run is not written through one), one that holds a named
    pipe, socket or device (a read or write of it would block, or take what no run wrote), and a folder that holds
    files but no run. config.yaml is the first file a run writes (a sweep writes it before the run starts); before
    it, a run's folder holds at most its lock, the log its launcher appends to, config.yaml's own temporary and the
    traceback of an attempt that failed first. Anything else is not the run's: the run would write over it
    (metrics.jsonl, summary.json) or remove it as a killed write's leftover (a ``*.tmp``)."""
    if run_dir.is_symlink():
        raise ConfigError(f"{run_dir} is a symbolic link: a run is not written through one; give the folder it "
                          f"points to ({run_dir.resolve()}) or another --run-dir")
    if not run_dir.is_dir():
        return
    special = sorted(p.name for p in run_dir.iterdir() if special_file(p))
    if special:
        raise ConfigError(f"{run_dir / special[0]} is not a regular file (a named pipe, a socket or a device): the run "
                          "reads and writes its files there; remove it, or give another --run-dir")
    linked = sorted(name for name in RUN_FILES if (run_dir / name).is_symlink() or (run_dir / name).is_dir())
    if linked:
        raise ConfigError(f"{run_dir / linked[0]} is a symbolic link or a folder: a run's files are not followed "
                          "through a link, nor written where a folder is; remove it (or move the run folder away), "
                          "or give another --run-dir")
    linked = links_in_run_folders(run_dir)
    if linked:
        raise ConfigError(f"{linked[0]} is a symbolic link (to {os.readlink(linked[0])}): a run does not write, read "
                          "back or remove its checkpoints, exports or logs through a link; remove it (or move the run "
                          "folder away), or give another --run-dir")
    if (run_dir / "config.yaml").exists():
        return
    foreign = sorted(p.name for p in run_dir.iterdir() if not BEFORE_CONFIG.fullmatch(p.name))
    if foreign:
        raise ConfigError(f"{run_dir} holds {listed(foreign, 4)} but no run (no config.yaml): a run there would write "
                          "over or remove what it holds; give a new or empty --run-dir")


def links_in_run_folders(run_dir: Path) -> list[Path]:
    """The folders of :data:`RUN_FOLDERS` in ``run_dir`` that are symbolic links, then every link inside those the
    harness alone writes in (all but wandb's), found without following any."""
    found = [run_dir / name for name in RUN_FOLDERS if (run_dir / name).is_symlink()]
    for name in RUN_FOLDERS:
        if name != "wandb" and (run_dir / name).is_dir() and not (run_dir / name).is_symlink():
            for root, folders, files in os.walk(run_dir / name):  # a linked folder is listed, never entered
                found += sorted(Path(root, entry) for entry in (*folders, *files) if Path(root, entry).is_symlink())
    return found


class DamagedConfigError(ValueError):
    """A run's config.yaml that cannot be read as its settings; the message names the file and why, in one line."""


def read_run_config(path: Path, resolve: bool = True) -> dict | None:
    """A run's config.yaml as plain values (with ``resolve``, the interpolations a config.yaml of an older version
    may hold resolved now), None when there is none. Raises DamagedConfigError when it is not YAML, holds a tag
    (``!!python/object``: OmegaConf's safe loader refuses it, nothing is constructed), or is not a mapping of
    settings."""
    if not path.is_file():
        return None
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=resolve)
    except Exception as e:  # noqa: BLE001 - yaml's and omegaconf's errors, each its own class
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DamagedConfigError(f"{path} is damaged ({reason})") from None
    if not isinstance(saved, dict) or not saved:
        raise DamagedConfigError(f"{path} is damaged (not a mapping of settings)")
    return saved


RUN_FOLDER_BUSY = "run folder {run_dir} is being written by another process"
CODE_LINE = "# code: "  # config.yaml's first line: the code version that wrote it, then a note in parentheses


def config_code(path: Path) -> str | None:
    """The code version config.yaml's first line names (a run's, written as it starts), None without one."""
    try:
        with path.open(errors="replace") as f:
            first = f.readline()
    except OSError:
        return None
    return first.removeprefix(CODE_LINE).split(" (", 1)[0].strip() or None if first.startswith(CODE_LINE) else None
# the statuses of a run that has ended by itself: it ran every step, or the native loop stopped it for non-finite
# updates (train.max_nonfinite_in_row in a row). A sweep does not start either again; any other status is resumed.
ENDED = ("finished", "diverged")
COLLAPSE_RULE = CollapseRule()  # the rule of summary.json's `collapse` record (and of the report, for older runs)


def run_status(run_dir: Path, now: float | None = None) -> str:
    """A run's status as summary.json says (pending without one), except that a run whose summary says running
    while no process holds its lock is ``stopped`` (killed, even by SIGKILL, or refused: resumable), unless its lock
    records a writer on another host whose heartbeat is fresh at ``now`` (harness/run/locks.py writer_elsewhere: a
    folder copied from a cluster mid-run), which is still ``running`` there."""
    try:
        status = json.loads((run_dir / "summary.json").read_text())["status"]
    except (OSError, ValueError, KeyError, TypeError):  # ValueError: not JSON, or not UTF-8
        status = None  # pending, unless begun elsewhere (its summary not written yet)
    if status is not None and (status != "running" or is_held(run_dir / RUN_LOCK)):
        return status
    if writer_elsewhere(run_dir / RUN_LOCK, now) is not None:
        return "running"
    return "pending" if status is None else "stopped"


class RunRecords:
    """The files of one run. ``resume_step``: the step of the checkpoint the run continues from (None: a fresh
    start, whatever an earlier attempt logged is dropped; ``checkpoint`` names it for the terminal). Only the
    ``main`` process of a distributed run writes. Counters that go into summary.json are set by the backend in
    ``progress``. Refuses (ConfigError) to continue a run folder whose config.yaml has other settings; whether other
    code may continue it is the command's check (harness/run/provenance.py check_code, ``--allow-code-change``), made
    before the run starts; the segments in summary.json record the code of every start either way."""

    def __init__(self, cfg: DictConfig, run_dir: Path, resume_step: int | None, start_policy: dict | None,
                 backend: str, main: bool = True, checkpoint: str | None = None):
        self.cfg, self.run_dir, self.main, self.backend = cfg, run_dir, main, backend
        self.start_policy = start_policy
        self.progress = {"steps_done": resume_step or 0, "rollout_tokens": 0, "update_tokens": 0,
                         "nonfinite_skips": None}
        self.started, self.elapsed_before = time.time(), 0.0
        self.cpu_started, self.cpu_before = time.process_time(), 0.0
        self.previous: dict = {}  # the summary.json of the attempt this one resumes
        # digests of what the run is made of, checked on resume (check_begun_on): the task's problems, the weights
        # it starts from
        self.task_data: str | None = None
        self.start_weights: str | None = None
        self.segments = next_segments({}, None, code_record())  # the code of each start (harness/run/provenance.py)
        # what the report's cell leaves out of the run's settings by this code's objectives' own values (recorded
        # with those values, objective_own: later code may set others)
        self.settings_left_out = settings_left_out(cfg)
        self.metrics = self.eval_samples = self.lock = self.trackers = None
        self.settings_digest: str | None = None  # of the settings its config.yaml holds (config.py settings_digest)
        check_resume(cfg, run_dir, warn=False, main=main, probe_lock=False)  # the command checked and warned first
        if resume_step is not None:  # every process, so that all refuse other problems alike (check_begun_on)
            with contextlib.suppress(OSError, ValueError, AttributeError):
                begun = json.loads((run_dir / "summary.json").read_text())
                self.task_data, self.start_weights = begun.get("task_data"), begun.get("start_weights")
        if not main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.lock = lock_folder(run_dir / RUN_LOCK, RUN_FOLDER_BUSY.format(run_dir=run_dir), heartbeat=True)
        try:
            if self.lock.took_over is not None:
                print(taken_over(run_dir.name, self.lock.took_over), file=sys.stderr)
            # a killed write's leftovers: in the run's folder, of its own files only (a *.tmp of the user's stays)
            remove_stale_temporaries(run_dir, own=(*RUN_FILES, "final"))
            remove_stale_temporaries(run_dir / "checkpoints", run_dir / "exports")
            if resume_step is not None:
                print(f"resuming {run_dir.name} from step {resume_step} (checkpoint {checkpoint})", file=sys.stderr)
            elif (run_dir / "metrics.jsonl").exists():
                print(f"restarting {run_dir.name} from step 0 (no checkpoint yet)", file=sys.stderr)
            previous = run_dir / "summary.json"
            if resume_step is not None and previous.exists():
                with contextlib.suppress(ValueError):  # not JSON or not UTF-8: resumed without the earlier times
                    found = json.loads(previous.read_text())
                    self.previous = found if isinstance(found, dict) else {}
                self.elapsed_before = self.previous.get("wall_time_s") or 0.0
                self.cpu_before = self.previous.get("cpu_time_s") or 0.0
            self.segments = next_segments(self.previous, resume_step, code_record())
            settings = OmegaConf.to_yaml(cfg)
            atomic_write(run_dir / "config.yaml", f"{CODE_LINE}{run_version({'segments': self.segments})} "
                         f"(summary.json's segments: each start's commit, changes and packages)\n{settings}")
            # read back as the report reads the file: its digest names an edit made after this
            self.settings_digest = settings_digest(flattened(OmegaConf.to_container(OmegaConf.create(settings))))
            self.metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step)
            self.eval_samples = MetricsLog(run_dir / "eval_samples.jsonl", resume_step)
            self.trackers = Trackers(cfg, run_dir, resume_step)  # logging.backends besides jsonl (tracking.py)
        except BaseException:
            self.close(failed=True)
            raise

    def check_begun_on(self, task_data: str, start_weights: str) -> None:
        """Record the digests of the problems this attempt trains and evaluates on
        (:func:`harness.tasks.problems_digest`) and of the weights it starts from; a ConfigError when the attempt it
        resumes recorded others: another GSM8K_DIR or task.data_dir (not settings of the run: the same data from
        another folder is the same run) would mix two data sets in one run, a model folder whose weights were
        replaced (the same model.name) two starting policies (the KL's reference among them)."""
        if self.task_data is not None and self.task_data != task_data:
            raise ConfigError(f"{self.run_dir} was begun on other task data (problems of digest {self.task_data}, "
                              f"these {task_data}): GSM8K_DIR or task.data_dir gives other problems; point it back to "
                              "continue this run, or give a fresh --run-dir (or results_dir) for these problems")
        if self.start_weights is not None and self.start_weights != start_weights:
            raise ConfigError(f"{self.run_dir} was begun from other starting weights (digest {self.start_weights}, "
                              f"these {start_weights}): model {self.cfg.model.name!r} has changed since; put its "
                              "weights back to continue this run, or give a fresh --run-dir (or results_dir)")
        self.task_data, self.start_weights = task_data, start_weights

    @property
    def rows(self) -> list[dict]:
        return self.metrics.rows if self.metrics else []

    def log(self, row: dict, eval_records: list[dict] | None = None) -> None:
        """Append one step's metrics (and its evaluation's records) and refresh summary.json."""
        if self.main:
            if eval_records:
                self.eval_samples.extend(eval_records)
            self.metrics.append(row)
            self.trackers.log(self.metrics.rows[-1])
        self.progress["steps_done"] = row["step"]
        self.summary("running")

    def wall_time_s(self) -> float:
        return self.elapsed_before + time.time() - self.started

    def cpu_time_s(self) -> float:
        """CPU seconds (user + system, every thread) of this process since the records opened, plus those of the
        attempts it resumes: the run's cost, much less sensitive than its wall time to other work on the machine."""
        return self.cpu_before + time.process_time() - self.cpu_started

    def summary(self, status: str, error: str | None = None) -> dict:
        self.segments[-1]["threads"] = self.progress.get("threads")  # set by the backend once the run has started
        evals = [r["eval_accuracy"] for r in self.rows if r.get("eval_accuracy") is not None]
        logged = {r["step"] for r in self.rows}
        start_eval = self.rows[0].get("eval_accuracy") if self.rows and self.rows[0]["step"] == 0 else None
        data = {"run_id": self.run_dir.name, "objective": self.cfg.objective.name, "seed": self.cfg.seed,
                "backend": self.backend, "status": status, **self.progress, "total_steps": self.cfg.train.steps,
                "start_eval_accuracy": start_eval, "final_eval_accuracy": evals[-1] if evals else None,
                "best_eval_accuracy": max(evals) if evals else None, "start_policy": self.start_policy,
                "task_data": self.task_data, "start_weights": self.start_weights,
                # none before step 0's row; all if every row is lost
                "missing_steps": sorted(set(range(self.progress["steps_done"] + 1)) - logged)
                if self.rows or self.progress["steps_done"] else [],
                "wall_time_s": self.wall_time_s(), "cpu_time_s": self.cpu_time_s(), "error": error,
                "collapse": self.collapse(),
                "code": self.segments[-1]["code"], "segments": self.segments,
                "settings_left_out": self.settings_left_out, "settings_digest": self.settings_digest,
                "objective_own": dict(objective_defaults(self.cfg.objective.name)),
                **{key: max(r[key] for r in self.rows if r.get(key) is not None)  # the run's peaks (metrics.py)
                   for key in PEAK_MEMORY if any(r.get(key) is not None for r in self.rows)}}
        if self.main:
            write_json_atomic(self.run_dir / "summary.json", data)
        return data

    def end(self, status: str) -> dict:
        """The ended run's summary.json (``status``: finished or diverged: ENDED); then, unless
        ``train.keep_checkpoints``, the checkpoints it no longer needs: checkpoints/previous.pt, and every
        trl/checkpoint-<N>/ but the newest whole one (torn ones too). What stays is what a run started again after
        its end resumes from (it trains nothing, and writes its summary and final/ again); each removed checkpoint
        holds AdamW's moments, two more copies of the weights. A link is neither followed nor removed; a kill
        mid-way leaves files no run reads."""
        data = self.summary(status)
        if not self.main or self.cfg.train.keep_checkpoints:
            return data
        numbered = sorted((int(p.name.rsplit("-", 1)[1]), p) for p in (self.run_dir / "trl").glob("checkpoint-*")
                          if p.name.rsplit("-", 1)[1].isdigit())
        whole = [p for _, p in numbered if (p / "trainer_state.json").is_file()]  # Trainer writes it last
        for path in (self.run_dir / "checkpoints" / "previous.pt", *(p for _, p in numbered if p not in whole[-1:])):
            if path.is_symlink() or not path.exists():
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        return data

    def collapse(self) -> dict | None:
        """The collapse record of the rows logged so far (harness/run/collapse.py's format, with the rule), or None.
        Rows come in step order, so an onset found once stays the one found later."""
        found = detect_collapse(self.rows, COLLAPSE_RULE)
        return found and {**found, "rule": COLLAPSE_RULE.as_dict()}

    @contextmanager
    def recording(self):
        """Marks the run running; on an exception, failed (interrupted for Ctrl-C / SIGTERM) with the error in
        summary.json; closes the files. If summary.json cannot be written then (a full disk), it keeps saying
        running, which :func:`run_status` reads as stopped (the lock is released): the original error is raised."""
        failed = True
        try:
            self.summary("running")
            yield self
            failed = False
        except BaseException as e:
            status = "failed" if isinstance(e, Exception) else "interrupted"
            with contextlib.suppress(OSError):
                self.summary(status, f"{type(e).__name__}: {e}")
            raise
        finally:
            self.close(failed)

    def close(self, failed: bool) -> None:
        """Close the files and trackers and release the lock; never raises (a full disk's leftovers are dropped)."""
        if not self.main:
            return
        for item in (self.metrics, self.eval_samples):
            if item is not None:
                item.close()
        if self.trackers is not None:
            with contextlib.suppress(Exception):
                self.trackers.close(failed)
        if self.lock is not None:
            self.lock.close()


@contextmanager
def no_save_progress_bar():
    """transformers' "Writing model shards" bar off while saving (a bar per export is noise in a run's log)."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def export_policy(policy, tokenizer, folder: Path) -> None:
    """The policy as transformers saves it (weights, config, tokenizer, chat template), so that transformers, vLLM
    or lm-evaluation-harness load it directly; written to a temporary folder, then renamed into place."""

    def write(tmp: Path) -> None:
        policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    with no_save_progress_bar():
        atomic_write(folder, write=write)


# ------------------------------------------------------------------------- the native loop's checkpoints


def save_checkpoint(run_dir: Path, payload: dict) -> None:
    """Writes checkpoints/last.pt atomically; the one it replaces is kept as previous.pt until then."""
    folder = run_dir / "checkpoints"
    folder.mkdir(exist_ok=True)
    last = folder / "last.pt"
    tmp = write_temporary(last, write=to_file(lambda f: torch.save(payload, f)))  # a full disk: ENOSPC
    if last.exists():
        os.replace(last, folder / "previous.pt")
    os.replace(tmp, last)


def learner_parts(train: DictConfig, step: int) -> tuple[str, ...]:
    """What of the learner a checkpoint at ``step`` holds besides the policy and the loop's state: the optimizer and
    its schedule, except at the run's last step unless ``train.keep_checkpoints`` (no update follows it: a run
    started again there only exports and summarises; AdamW's moments are two copies of the weights)."""
    return ("optimizer", "scheduler") if step < train.steps or train.keep_checkpoints else ()


def load_tensors(path: Path, device: torch.device | str = "cpu"):
    """What the harness saved with torch.save (tensors in plain containers: dicts, lists, numbers, strings), loaded
    with ``weights_only=True``: a file someone else put there (a results folder may be shared) cannot run code while
    it is read. Raises what torch raises (an unpickling error for anything else)."""
    return torch.load(path, map_location=device, weights_only=True)


def unreadable_reason(error: Exception) -> str:
    """Why :func:`load_tensors` failed, in a few words: a file holding more than tensors in plain containers was not
    written by the harness (torch's own message would invite loading it with code execution allowed)."""
    if isinstance(error, pickle.UnpicklingError):
        return "it holds Python objects besides tensors, numbers and strings: not a file the harness wrote, and not " \
               "loaded, since that would run code from it"
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def load_checkpoint(run_dir: Path, device: torch.device) -> tuple[dict | None, Path | None]:
    """The newest readable checkpoint (last.pt, else previous.pt with a warning) and its path, or (None, None) when
    there is none. Raises RuntimeError naming the file and the fix when none of them can be read."""
    folder = run_dir / "checkpoints"
    if folder.is_symlink():
        raise RuntimeError(f"{folder} is a symbolic link: a run does not resume from checkpoints through one; remove "
                           "it to restart this run from step 0")
    errors = []
    for name in ("last.pt", "previous.pt"):
        path = folder / name
        if path.is_symlink():  # another run's checkpoint, or anything else: never resumed from
            errors.append(f"{path} (a symbolic link: not followed)")
            continue
        if not path.exists():
            continue
        try:
            payload = load_tensors(path, device)
        except Exception as e:  # a torn or corrupted file: zip errors, EOFError, unpickling errors
            errors.append(f"{path} ({unreadable_reason(e)})")
            continue
        if errors:
            print(f"warning: unreadable checkpoint {errors[0]}; resuming from {path}", file=sys.stderr)
        return payload, path
    if errors:
        raise RuntimeError(f"unreadable checkpoint {'; '.join(errors)}: delete {folder} to restart this run "
                           "from step 0")
    return None, None
