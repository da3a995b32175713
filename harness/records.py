"""Crash-safe result files: JSON written atomically, metrics appended one flushed and fsynced line per step."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; analysis reads null as missing
    return value


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({k: _clean(v) for k, v in data.items()}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    """The complete JSON lines of a file; a truncated last line (a kill mid-write) is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class MetricsLog:
    """A JSON-lines file of per-step records (metrics.jsonl, eval_samples.jsonl): on (re)open, keeps only complete
    lines with step <= ``resume_step``, so a resumed run never writes a step twice; then appends, flushed and
    fsynced."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        self.rows = [r for r in read_jsonl(path) if r.get("step", math.inf) <= resume_step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        os.replace(tmp, path)
        self.file = open(path, "a")

    def append(self, row: dict) -> None:
        self.extend([row])

    def extend(self, rows: list[dict]) -> None:
        rows = [{k: _clean(v) for k, v in row.items()} for row in rows]
        self.file.write("".join(json.dumps(row) + "\n" for row in rows))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.rows.extend(rows)

    def close(self) -> None:
        self.file.close()
