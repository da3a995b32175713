"""What generated pages say about where their numbers come from: the checkout's commit and the machine. The code and
the torch threads of the runs a page summarises are their own records' (harness/run/provenance.py runs_stamp), not
these: runs may have been made, or resumed, by other code and with other threads."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    def git(*args) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("-dirty" if git("status", "--porcelain") else "")


def machine(jobs: int) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    cores = os.cpu_count() or 1
    return (f"{cpu}, {cores} cores, {jobs} runs at a time; torch {torch.__version__}, transformers "
            f"{transformers.__version__}, Python {platform.python_version()} here")
