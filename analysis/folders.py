"""Whether a folder given for a report is one, said without pandas or torch: ``python -m analysis`` says a mistyped
folder at once, and analysis/load.py the same words when a folder is read."""

from __future__ import annotations

from pathlib import Path


def folder_problem(exp_dir: Path) -> str | None:
    """What is wrong with ``exp_dir`` as an experiment's results folder before it is read (not there, not a folder);
    None when it is a folder."""
    if exp_dir.is_dir():
        return None
    what = "is not a folder" if exp_dir.exists() or exp_dir.is_symlink() else "does not exist"
    return f"results folder {exp_dir} {what}: give an experiment's results folder (results/<experiment>, the one " \
           "holding manifest.json)"
