"""Which code made a run: its code record, its segments, and the refusal to continue a run under other code.

A *code record* is what this process runs: the git commit, whether the code differs from it (tracked changes or
untracked files under CODE_PATHS) and a hash of that difference, and the versions of the packages that matter. Its
``version`` is one short label: ``<commit>`` (clean), ``<commit>+diff-<hash>`` (with changes), ``source-<hash>`` (no
git: a tarball or an installed package; ``git`` says why, and the hash covers every source file under CODE_PATHS).
The record also names the CPU (:func:`cpu`): not code, but what else decides a run's floats.
Runs written before the records existed are of version ``unknown``.

Only the code paths count: ``make docs`` rewrites tracked pages under docs/ between its sweeps, and a new experiment
file is settings (a run's settings are compared on resume through its config.yaml), so neither changes the version.

A run's summary.json holds ``code`` (the record of the process writing it now) and ``segments``: one per start of a
process on the run (a fresh start, then each resume), each ``{from_step, started, threads, code}``. Neither is in
config.yaml's settings, so neither enters the run id nor the settings comparison of a resume. Continuing a run whose
last segment ran other code is refused (:func:`check_code`) unless the command is given ``--allow-code-change``; the
segments then record the mix, and the analysis keeps such a run apart as a version of its own (``A then B``).

    record = code_record()                 # this process's code (computed once per process)
    segments = next_segments(previous, resume_step, record)   # summary.json's segments of a (re)started run
    run_version(summary)                   # "92ecdec", "92ecdec then 1a2b3c4", "unknown"
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from harness.run.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CODE_PATHS = ("harness", "objectives", "analysis")  # what a run executes (and its report reads)
PACKAGES = ("torch", "transformers", "trl")
DISTRIBUTION = "rlvr-objectives-harness"  # pyproject.toml's name: this package
UNKNOWN = "unknown"  # the version of a run written before runs recorded their code
ALLOW_FLAG = "--allow-code-change"


@functools.cache
def code_record() -> dict:
    """This process's code record (module docstring); git is asked once per process."""
    git = _git_state()
    if isinstance(git, str):  # no git: the reason, and a hash of the source files instead
        source = _source_hash()
        record = {"version": f"source-{source[:8]}", "commit": None, "dirty": None, "diff_sha256": None,
                  "git": f"unavailable: {git}", "source_sha256": source}
    else:
        commit, diff = git
        record = {"version": commit[:7] + (f"+diff-{diff[:8]}" if diff else ""), "commit": commit,
                  "dirty": diff is not None, "diff_sha256": diff, "git": "available", "source_sha256": None}
    return {**record, "packages": packages(), "cpu": cpu()}  # the CPU: not the code, but what rounds its floats


def packages() -> dict[str, str | None]:
    """Python's, this package's and PACKAGES' versions (None: not installed)."""
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), DISTRIBUTION: version(DISTRIBUTION),
            **{name: version(name) for name in PACKAGES}}


def cpu() -> str:
    """The CPU's vendor, family and model (Linux's /proc/cpuinfo; elsewhere platform.processor()): two CPUs with the
    same vector instructions can round otherwise (their BLAS kernels differ), so the same code and settings can train
    other weights on another CPU."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
    except OSError:
        return platform.processor()
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return f"{fields.get('vendor_id', '')} family {fields.get('cpu family', '')} model {fields.get('model', '')}"


def tensors_digest(tensors: dict) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order (the same bits, the same digest)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout


def _git_state() -> tuple[str, str | None] | str:
    """(commit, hash of the code's difference from it or None when there is none), or why git cannot say."""
    try:
        top, commit = _git("rev-parse", "--show-toplevel", "HEAD").decode().split()
        if Path(top).resolve() != ROOT:
            return f"{ROOT} is not the top of a git checkout (it is inside {top})"
        diff = _git("diff", "HEAD", "--binary", "--", *CODE_PATHS)
        untracked = _git("ls-files", "--others", "--exclude-standard", "-z", "--", *CODE_PATHS).split(b"\0")
    except FileNotFoundError:
        return "git is not installed"
    except subprocess.CalledProcessError as e:  # not a checkout (an unpacked archive), a repository git refuses, ...
        said = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        return f"git cannot read {ROOT} ({said[0] if said else f'exit {e.returncode}'})"
    except (subprocess.TimeoutExpired, ValueError):
        return f"git did not say which commit {ROOT} is"
    untracked = sorted(name for name in untracked if name)
    if not diff and not untracked:
        return commit, None
    digest = hashlib.sha256(diff)
    for name in untracked:
        digest.update(b"\0" + name + b"\0" + hashlib.sha256((ROOT / name.decode()).read_bytes()).digest())
    return commit, digest.hexdigest()


def _source_hash() -> str:
    """A hash of every source file under CODE_PATHS (paths and contents; caches left out)."""
    digest = hashlib.sha256()
    for folder in CODE_PATHS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------- a run's segments


def next_segments(previous: dict, resume_step: int | None, record: dict) -> list[dict]:
    """summary.json's segments for a process starting on a run: the earlier segments that made the steps it keeps
    (up to ``resume_step``; none on a fresh start), then its own. Steps kept from a run written before segments
    existed are one segment of unknown code."""
    kept = []
    if resume_step:
        earlier = previous.get("segments")
        if isinstance(earlier, list) and earlier:
            kept = [s for s in earlier if isinstance(s, dict) and isinstance(s.get("from_step"), int)
                    and s["from_step"] < resume_step]
        else:
            kept = [{"from_step": 0, "started": None, "threads": previous.get("threads"), "code": None}]
    started = datetime.now(UTC).isoformat(timespec="seconds")
    return [*kept, {"from_step": resume_step or 0, "started": started, "threads": None, "code": record}]


def segment_version(segment: dict) -> str:
    code = segment.get("code")
    return str(code.get("version") or UNKNOWN) if isinstance(code, dict) else UNKNOWN


def run_versions(summary: dict) -> list[str]:
    """The distinct code versions of a run's segments, in order ([UNKNOWN] when it recorded none)."""
    segments = summary.get("segments")
    if not isinstance(segments, list) or not segments:
        return [UNKNOWN]
    return list(dict.fromkeys(segment_version(s) if isinstance(s, dict) else UNKNOWN for s in segments))


def run_version(summary: dict) -> str:
    """The run's code version: one version, ``A then B`` for a run continued under other code, or ``unknown``."""
    return " then ".join(run_versions(summary))


def run_threads(summary: dict) -> list[int]:
    """The torch threads the run's segments used (summary.json's ``threads`` for a run without segments)."""
    segments = summary.get("segments")
    values = [s.get("threads") for s in segments if isinstance(s, dict)] if isinstance(segments, list) else []
    values = values or [summary.get("threads")]
    return sorted({v for v in values if isinstance(v, int) and not isinstance(v, bool)})


def run_packages(summary: dict) -> str | None:
    """The packages of the run's segments as one text (``torch 2.13.0, transformers 4.57.1, ...``; distinct sets
    joined by `` then ``), None when no segment recorded them."""
    segments = summary.get("segments") if isinstance(summary.get("segments"), list) else []
    shown = [packages_text(s["code"].get("packages")) for s in segments
             if isinstance(s, dict) and isinstance(s.get("code"), dict)]
    shown = list(dict.fromkeys(s for s in shown if s))
    return " then ".join(shown) or None


def packages_text(versions) -> str | None:
    if not isinstance(versions, dict):
        return None
    names = {"python": "Python", DISTRIBUTION: "harness"}
    return ", ".join(f"{names.get(k, k)} {v}" for k, v in versions.items() if v) or None


# ---------------------------------------------------------------------------------------- continuing a run


def _last_version(run_dir: Path) -> str | None:
    """The code version of a run's last segment, UNKNOWN for a run without segments, None when the folder holds no
    step to continue (no readable summary.json, or no step done)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or not isinstance(summary.get("steps_done"), int) or summary["steps_done"] < 1:
        return None
    segments = summary.get("segments")
    return segment_version(segments[-1]) if isinstance(segments, list) and segments and \
        isinstance(segments[-1], dict) else UNKNOWN


def check_code(run_dirs: list[Path], allow: bool, command: str = "the command") -> None:
    """Refuse (ConfigError, one line) to continue runs whose last segment ran code other than this process's, unless
    ``allow`` (``--allow-code-change``: a note on stderr; the runs' segments will record both). A run that recorded
    no code (written before the records) continues with a warning. ``command``: what the flag is given to."""
    current = code_record()["version"]
    found = {d: _last_version(d) for d in run_dirs}
    changed = {d: v for d, v in found.items() if v not in (None, UNKNOWN, current)}
    unknown = [d for d, v in found.items() if v == UNKNOWN]
    if changed and not allow:
        versions = ", ".join(sorted(set(changed.values())))
        if len(changed) == 1:
            (run_dir, version), = changed.items()
            what = f"{run_dir} was run by code {version} and this is code {current}"
        else:
            shown = ", ".join(f"{d.name} by {v}" for d, v in list(changed.items())[:3])
            what = (f"{len(changed)} runs in {next(iter(changed)).parent} were run by other code than this "
                    f"({current}): {shown}{f' and {len(changed) - 3} more' if len(changed) > 3 else ''}")
        raise ConfigError(f"{what}: continuing would mix two code versions in one run; check out {versions} to "
                          f"continue as it began, start afresh in another folder, or give {command} {ALLOW_FLAG} to "
                          f"continue under {current} (summary.json's segments record both)")
    if changed:
        print(f"note: continuing {len(changed)} run(s) under code {current}, started by code "
              f"{', '.join(sorted(set(changed.values())))} ({ALLOW_FLAG}; summary.json's segments record both)",
              file=sys.stderr)
    if unknown:
        print(f"warning: {', '.join(map(str, unknown[:3]))}{' and more' if len(unknown) > 3 else ''}: written "
              f"before runs recorded their code (version {UNKNOWN}); continuing under code {current}, recorded in "
              "summary.json's segments", file=sys.stderr)


def ended_version(run_dir: Path) -> str | None:
    """The code version (run_version) of a run folder's summary.json; None without a readable one."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return run_version(summary) if isinstance(summary, dict) else None


def version_counts(versions: list[str | None]) -> dict[str, int]:
    """How many of ``versions`` (one per run; None, or a table's NaN: unknown) each code version made."""
    counts: dict[str, int] = {}
    for version in versions:
        known = version if isinstance(version, str) and version else UNKNOWN
        counts[known] = counts.get(known, 0) + 1
    return counts


def check_one_version(versions: list[str | None], folder: Path, what: str) -> None:
    """Refuse (ConfigError, one line) runs of ``folder`` made, or to be made, by more than one code version
    (``versions``: one per run, None for unknown), for a command whose verdicts pair runs with each other (the claims,
    the zoo's confirmation): a sweep keeps the runs that ended, so one continued after a commit would pair the old
    code's runs with the new code's. ``what``: the runs, as the line names them."""
    counts = version_counts(versions)
    if len(counts) > 1:
        current = code_record()["version"]
        shown = ", ".join(f"{n} by {v}{' (this code)' if v == current else ''}" for v, n in sorted(counts.items()))
        raise ConfigError(f"{what} in {folder} are of different code versions ({shown}) and would be paired with each "
                          f"other: move or delete those not of {current} (this code) and run again, or check out the "
                          "other version to finish under it")


# ---------------------------------------------------------------------------------------- what pages say


def versions_lines(runs: list[dict]) -> list[str]:
    """One line per code version among ``runs`` (dicts with ``code``, ``threads`` and ``packages`` as analysis/load.py
    reads them from summary.json; a run without a code, not started, is left out): the version, its runs, the torch
    threads they used and their packages."""
    def text(value) -> str | None:
        return value if isinstance(value, str) and value else None

    by_version: dict[str, list[dict]] = {}
    for run in runs:
        if text(run.get("code")):
            by_version.setdefault(run["code"], []).append(run)
    lines = []
    for version, group in sorted(by_version.items(), key=lambda item: (item[0] == UNKNOWN, item[0])):
        threads: dict[str, int] = {}
        for run in group:
            key = text(run.get("threads")) or "not recorded"
            threads[key] = threads.get(key, 0) + 1
        shown = ", ".join(f"{t} ({n} run{'s' * (n != 1)})" for t, n in sorted(threads.items()))
        packages = sorted({p for run in group if (p := text(run.get("packages")))})
        what = " (written before runs recorded their code)" if version == UNKNOWN else ""
        lines.append(f"code `{version}`{what}: {len(group)} run{'s' * (len(group) != 1)}, torch threads per run "
                     f"{shown}" + (f"; {' / '.join(packages)}" if packages else ""))
    return lines


def runs_stamp(runs: list[dict]) -> str:
    """What a generated page says about the runs it summarises: their code versions and threads (versions_lines)."""
    lines = versions_lines(runs)
    if not lines:
        return "No run has recorded its code yet."
    several = f" {len(lines)} code versions: code is a setting, so runs of two versions are never seeds of one cell."
    return "Runs summarised: " + "; ".join(lines) + "." + (several if len(lines) > 1 else "")
