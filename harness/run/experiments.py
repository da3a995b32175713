"""Where an experiment is: its name in experiments/ or a YAML file's path. Nothing here imports torch, so the command
line refuses a mistyped experiment at once (harness/run/commandline.py), and the config loader (harness/run/config.py)
finds the file the same way."""

from __future__ import annotations

import difflib
from pathlib import Path

from harness.run.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS_DIR = REPO / "experiments"


def experiment_path(name: str) -> Path:
    """The YAML file of experiment ``name`` (a name in experiments/, or a path ending in .yaml); ConfigError naming
    the experiments there (and the closest name) if there is none."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):  # a file's path: there or not, never experiments/<path>.yaml
        if not path.is_file():
            named = "/" not in name and (EXPERIMENTS_DIR / name).is_file()  # `train quickstart.yaml`
            hint = f" Did you mean the experiment {path.stem!r} ({EXPERIMENTS_DIR / name})?" if named else ""
            raise ConfigError(f"no experiment file {name} ({'a folder' if path.is_dir() else 'not there'}).{hint} "
                              f"Give an existing YAML file or an experiment's name (`python -m harness list`)")
        return path
    known = [p.stem for p in experiment_paths()]
    if "/" in name:  # a path, not a name: never experiments/<path>.yaml
        raise ConfigError(f"no experiment {name!r}: give an experiment's name ({', '.join(known)}) or the path of a "
                          "file ending in .yaml")
    path = EXPERIMENTS_DIR / f"{name}.yaml"
    if not path.exists():
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"no experiment {name!r} (looked for {path}).{hint} Experiments: {', '.join(known)}.")
    return path


def experiment_paths() -> list[Path]:
    """experiments/<name>.yaml of every experiment (base.yaml, the shared layer, is none), by name."""
    return sorted(p for p in EXPERIMENTS_DIR.glob("*.yaml") if p.stem != "base")
