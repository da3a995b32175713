"""Several results folders as one experiment: ``python -m analysis results/a results/b``.

A run id stands for the run's settings and seed (harness/run/config.py ``run_id``: the experiment's name, where the
results go and the memory settings are not in it), so the same id in two folders names the same run. It is read
once, from the first folder given that holds it, and one warning names the runs read once. Two copies are the same
run when they hold the same records: status, steps done, code version, final eval accuracy, per-problem eval scores,
and every logged metric at every step besides the measurements of time and memory (``*_s``, ``*_mb``: two
executions of one run differ in them and in nothing else). Copies whose records differ (one stopped early, a
non-deterministic kernel, another code version) are kept apart, each as ``<folder>/<run id>``, and named in one
warning; they share settings and seed, so analysis/cells.py counts one of them as that seed of its cell (a copy run
by other code is in a cell of its own).

Everything else is as for one folder: the runs of all folders are told apart by their settings and code
(analysis/cells.py), never by the folder they were read from; the verdict's baseline is the one the folders'
sweeps name, none when they name different ones (then ``--baseline`` or the default rule,
analysis.paired.default_baseline); the grid's objectives are the folders' in order. The report goes to
``<first folder's parent>/<a>+<b>/report/`` unless ``--out`` says otherwise (folders of one name need ``--out``:
analysis/report.py ``check_default_folder``).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.load import AnalysisError, Experiment, Folder, assemble, load_experiment, read_folder, warn

MEASURED = ("_s", "_mb")  # metric suffixes of wall-clock and memory measurements
RECORDS = ("status", "steps_done", "code", "final_eval_accuracy")  # run columns two copies of one run share


def load_experiments(dirs: list[str | Path] | str | Path) -> Experiment:
    """The runs of every folder as one Experiment (see the module docstring); one folder (also given alone, not in a
    list): load_experiment's."""
    dirs = [Path(d) for d in ([dirs] if isinstance(dirs, str | Path) else dirs)]  # a str is no list of folders
    if not dirs:
        raise AnalysisError("no results folder given")
    if len(dirs) == 1:
        return load_experiment(dirs[0])
    given: dict[Path, Path] = {}
    for d in dirs:
        if d.resolve() in given:
            raise AnalysisError(f"{d} is given twice (also as {given[d.resolve()]}): name each results folder once")
        given[d.resolve()] = d
    folders = [read_folder(d, label) for d, label in zip(dirs, labels(dirs), strict=True)]
    loaded, overrides = merge(folders)
    exp = assemble("+".join(f.label for f in folders), combined_dir(dirs), loaded, overrides)
    exp.baseline = agreed_baseline(folders)
    exp.objectives = list(dict.fromkeys(str(o) for f in folders for o in grid_objectives(f)))
    exp.sources = dirs
    return exp


def named(folder: Path) -> Path:
    """The folder as given, or its absolute path where what was given has no name of its own (``.``, ``..``)."""
    return folder if folder.name not in ("", "..") else folder.resolve()


def labels(dirs: list[Path]) -> list[str]:
    """Each folder's name, or its path as given where two folders share a name."""
    names = [named(d).name for d in dirs]
    return [name if names.count(name) == 1 else str(d) for d, name in zip(dirs, names, strict=True)]


def combined_dir(dirs: list[Path]) -> Path:
    """Where the report of several folders goes by default (its report/ inside): ``<a>+<b>`` beside the first."""
    return named(dirs[0]).parent / "+".join(named(d).name for d in dirs)


def grid_objectives(folder: Folder) -> list:
    objectives = folder.manifest.get("objectives")
    return objectives if isinstance(objectives, list) else []


def agreed_baseline(folders: list[Folder]) -> str | None:
    """The baseline the folders' manifests name; None (with a warning) when they name different ones."""
    named = {f.label: f.manifest["baseline"] for f in folders if isinstance(f.manifest.get("baseline"), str)}
    if len(set(named.values())) > 1:
        warn("the folders' sweeps name different baselines (" + ", ".join(f"{k}: {v}" for k, v in named.items())
             + "): the verdict's baseline is the default rule's (grpo when it has runs, else the first grid "
             "objective); name one with --baseline")
        return None
    return next(iter(named.values()), None)


def shown(value, other) -> str:
    """A value told apart from ``other``: 6 significant digits, all of them where those agree."""
    if not isinstance(value, float) or not isinstance(other, float) or f"{value:.6g}" == f"{other:.6g}":
        return str(value)
    return f"{value:.6g}"


def difference(x: tuple, y: tuple) -> str | None:
    """How two copies of one run id (load_run's tuples) differ, in words; None when they hold the same records."""
    (rx, mx, _, sx), (ry, my, _, sy) = x, y
    for key in RECORDS:
        a, b = rx.get(key), ry.get(key)
        if not (a == b or pd.isna(a) and pd.isna(b)):
            return f"{key} {shown(a, b)} vs {shown(b, a)}"
    only = sorted(c for c in set(mx) ^ set(my) if not str(c).endswith(MEASURED))
    if only:
        return "metrics logged by one copy only: " + ", ".join(f"`{c}`" for c in only)
    if len(mx) != len(my):
        return f"{len(mx)} vs {len(my)} logged steps"
    columns = sorted(c for c in mx if not str(c).endswith(MEASURED))
    a, b = mx[columns].reset_index(drop=True), my[columns].reset_index(drop=True)
    equal = (a == b) | (a.isna() & b.isna())
    rows = ~equal.all(axis=1)
    if rows.any():
        i = rows.idxmax()
        return (f"metrics differ from step {a.loc[i, 'step']} ("
                + ", ".join(f"`{c}`" for c in columns if not equal.loc[i, c]) + ")")
    if (sx is None) != (sy is None) or sx is not None and not sx.equals(sy):
        return "per-problem eval scores (eval_samples.jsonl) differ"
    if rx.get("problem") != ry.get("problem"):  # e.g. one copy's config.yaml edited after its run wrote it
        return f"problems {rx.get('problem') or 'none'!r} vs {ry.get('problem') or 'none'!r}"
    return None


def merge(folders: list[Folder]) -> tuple[list[tuple], dict[str, dict]]:
    """The runs of every folder, each set of equal copies once, copies that differ kept apart under
    ``<folder>/<run id>``; their grid points (manifest.json's) by run id. Warns once for each kind."""
    copies: dict[str, list[tuple[tuple, list[str], dict | None]]] = {}  # run id -> (records, folders, grid point)
    for folder in folders:
        points = folder.overrides()
        for item in folder.loaded:
            run_id = item[0]["run_id"]
            kept = copies.setdefault(run_id, [])
            same = next((k for k in kept if difference(k[0], item) is None), None)
            if same:
                same[1].append(folder.label)
            else:
                kept.append((item, [folder.label], points.get(run_id)))
    loaded, overrides, once, apart = [], {}, [], []
    for run_id, kept in copies.items():
        if len(kept) == 1 and len(kept[0][1]) > 1:
            once.append(f"`{run_id}` ({', '.join(kept[0][1])})")
        elif len(kept) > 1:
            first = kept[0][1][0]
            apart.append(f"`{run_id}`: " + "; ".join(f"{first} vs {', '.join(w)}: {difference(kept[0][0], item)}"
                                                      for item, w, _ in kept[1:]))
        for item, where, point in kept:
            new_id = run_id if len(kept) == 1 else f"{where[0]}/{run_id}"
            item[0]["run_id"], item[0]["source"] = new_id, ", ".join(where)
            if len(item[1]):
                item[1]["run_id"] = new_id
            loaded.append(item)
            if point is not None:
                overrides[new_id] = point
    if once:
        warn(f"{len(once)} run{'s' * (len(once) > 1)} held by more than one folder with the same records (a run id "
             "stands for the run's settings and seed, not its experiment: the same run), each read once from the "
             "first folder and counted once: " + ", ".join(once))
    if apart:
        warn(f"{len(apart)} run id{'s' * (len(apart) > 1)} held by more than one folder with different records, "
             "kept apart as `<folder>/<run id>` (the same settings and seed: one copy per cell is counted, see "
             "the duplicate runs): " + " | ".join(apart))
    return loaded, overrides
