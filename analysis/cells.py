"""Cells: which runs may be pooled as seeds of one condition.

A run's *settings* are its resolved config.yaml (flattened to dotted keys) without the keys that do not change what
is computed: ``seed`` (what varies between the seeds of a cell), ``model.seed`` (START_SEED: the starting policy's
replicate, what varies between the starting policies of a cell, the level above the seeds), ``name`` (the
experiment's label), ``results_dir``,
``threads`` (CPU threads: speed only), ``logging.*`` (where metrics are also sent; harness/run/config.py run_id leaves
``results_dir`` and ``logging`` out of the run id for the same reason), the memory settings (``train.lm_head_chunk``,
``train.activation_checkpointing``, ``train.eval_batch_size``: config.py's MEMORY_SETTINGS, which bound memory,
not what is computed; a run resumed under less memory records them) and ``profile``/``profiles`` (applied already).
``objective.name`` names the objective. ``code`` is a setting too: the run's code version (summary.json's segments,
harness/run/provenance.py: ``unknown`` for a run written before they were recorded, ``?`` for one not started), so that
runs of two code versions are kept apart exactly as runs of two learning rates.

A key whose value differs between runs is either
- an *objective setting*: constant within each objective and different between objectives (a sweep's
  ``per_objective``, e.g. GRPO's clip_high in gspo_clip_repro, TBPO's train.old_logp in mismatch_stability): part of
  what the objective is, listed in the report, not a cell; or
- an *axis*: it takes two or more values within some objective (a swept key, or runs of different experiments put in
  one folder). A *cell* is one combination of axis values, i.e. the grid point without the objective and the seed.

Every table, interval and figure is per (objective, cell), and n counts distinct (starting policy, seed) units: runs
of the same objective and cell with the same starting policy and seed are duplicates, one of which is counted (an
ended run before one that is not, then the one with more steps, then the first run id) and the others named in a
warning. So are runs of one ``model.seed`` whose starting policy has one cache key but other weights (built apart on
another CPU: :func:`mark_mixed_policies`). A run without config.yaml takes its grid point from manifest.json
(``overrides``) and the keys all other runs share; without either its settings are unknown and it forms a cell of
its own. Pure pandas: no report, no harness imports.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pandas as pd

from harness.run.config import memory_keys

START_SEED = "model.seed"  # the starting policy's replicate: a run column (analysis/load.py), not a cell's setting
NOT_SETTINGS = frozenset({"seed", START_SEED, "name", "results_dir", "threads", "profile", "objective.name"})
# and the memory settings that change no number of the run (harness/run/config.py memory_keys, as its run id)
NOT_SETTING_PREFIXES = ("logging.", "profiles.", "sweep.", "lab.")
UNKNOWN = "?"  # an axis value that no file states
CODE = "code"  # the setting that holds a run's code version
ALL = "all runs"  # the label of the one cell when nothing is swept


@dataclass
class Cells:
    axes: list[str] = field(default_factory=list)  # keys that vary within an objective (order: sorted)
    objective_settings: dict[str, dict[str, str]] = field(default_factory=dict)  # key -> objective -> value
    labels: list[str] = field(default_factory=lambda: [ALL])  # index = cell id: "key=value, key=value"
    values: list[dict[str, object]] = field(default_factory=lambda: [{}])  # per cell: axis -> value (as written)
    duplicates: list[str] = field(default_factory=list)  # one line per set of duplicate runs
    mixed_policies: list[str] = field(default_factory=list)  # one line per key built apart (mark_mixed_policies)

    def columns(self, cell_ids: pd.Series) -> dict[str, pd.Series]:
        """A table's cell columns from its rows' cell ids: one per axis (named by its short name, the value as
        shown) when there is more than one cell; ``cell`` (the label) when the cells differ only in runs of unknown
        settings; none with one cell."""
        if len(self.labels) < 2:
            return {}
        if not self.axes:
            return {"cell": cell_ids.map(lambda i: self.labels[i])}
        names = short_names(self.axes)
        return {names[a]: cell_ids.map(lambda i, a=a: show(self.values[i][a])) for a in self.axes}

    def short(self, cell: int) -> str:
        """The cell's label with each axis named by its last component (when that is unambiguous)."""
        if not self.axes:
            return ALL
        names = short_names(self.axes)
        return ", ".join(f"{names[a]}={show(v)}" for a, v in self.values[cell].items())


def short_names(axes: list[str]) -> dict[str, str]:
    last = [a.rsplit(".", 1)[-1] for a in axes]
    return {a: (s if last.count(s) == 1 else a) for a, s in zip(axes, last, strict=True)}


def settings(config: dict) -> dict:
    memory = memory_keys(config.get("train.pass_k"))  # eval_batch_size counts under pass@k
    return {k: v for k, v in config.items()
            if k not in NOT_SETTINGS and k not in memory and not k.startswith(NOT_SETTING_PREFIXES)}


def canon(value) -> str:
    """A value's identity: JSON with sorted keys (1e-4 and 0.0001 are the same float; [1, 2] a list)."""
    return json.dumps(value, sort_keys=True, default=str)


def show(value) -> str:
    """A setting's value as the report writes it; null for None, and for the NaN pandas holds a None as (a setting is
    never NaN: the config check refuses it)."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, float) and math.isnan(value):
        return "null"
    return json.dumps(value, default=str) if isinstance(value, list | dict) else str(value)


def order(value) -> tuple:
    """Sort numbers by value, then strings, then unknown."""
    if value == UNKNOWN:
        return (2, "")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, show(value))


def run_settings(runs: pd.DataFrame, configs: dict[str, dict], overrides: dict[str, dict]
                 ) -> tuple[dict[str, dict | None], list[str]]:
    """Each run's settings (None: unknown) and warnings for the runs whose settings come from the manifest."""
    known = {r: settings(c) for r, c in configs.items() if c and r in set(runs["run_id"])}
    keys = set().union(*known.values()) if known else set()
    shared = {}
    for key in keys:
        values = {canon(s.get(key, "unset")) for s in known.values()}
        if len(values) == 1:
            shared[key] = next(iter(known.values())).get(key, "unset")
    own_code = runs.set_index("run_id")[CODE].to_dict() if CODE in runs else {}
    out, notes = {}, []
    for run_id in runs["run_id"]:
        if run_id in known:
            out[run_id] = known[run_id]
        elif isinstance(overrides.get(run_id), dict):
            grid = settings(overrides[run_id])
            out[run_id] = {k: grid.get(k, shared.get(k, UNKNOWN)) for k in keys | set(grid)}
            if CODE in keys:  # its own code version (its summary's), never the one the others share
                out[run_id][CODE] = own if isinstance(own := own_code.get(run_id), str) and own else UNKNOWN
            if known:
                notes.append(f"{run_id}: no readable config.yaml; its settings are manifest.json's grid point and the "
                             "values all other runs share")
        else:
            out[run_id] = None
            notes.append(f"{run_id}: no readable config.yaml and no grid point in manifest.json: its settings are "
                         "unknown, so it is a cell of its own")
    return out, notes


def assign_cells(runs: pd.DataFrame, configs: dict[str, dict], overrides: dict[str, dict] | None = None
                 ) -> tuple[pd.DataFrame, Cells, list[str]]:
    """The runs with columns ``cell`` (label), ``cell_id``, one column per axis (its value), ``counted`` (False for a
    duplicate or a run of unknown seed) and ``duplicate_of``; the Cells; warnings to raise (see the module docstring).
    """
    runs = runs.copy()
    per_run, notes = run_settings(runs, configs, overrides or {})
    known = {r: s for r, s in per_run.items() if s is not None}
    keys = sorted(set().union(*known.values())) if known else []
    objective_of = dict(zip(runs["run_id"], runs["objective"], strict=True))
    axes, objective_settings = [], {}
    for key in keys:
        values = {r: s.get(key, "unset") for r, s in known.items()}
        stated = {r: v for r, v in values.items() if v != UNKNOWN}
        if len({canon(v) for v in stated.values()}) < 2:
            continue
        per_objective: dict[str, set] = {}
        for r, v in stated.items():
            per_objective.setdefault(objective_of[r], set()).add(canon(v))
        if all(len(v) == 1 for v in per_objective.values()):
            objective_settings[key] = {o: show(next(v for r, v in stated.items() if objective_of[r] == o))
                                       for o in sorted(per_objective)}
        else:
            axes.append(key)
    points = {}
    for run_id in runs["run_id"]:
        s = per_run[run_id]
        points[run_id] = None if s is None else {a: s.get(a, "unset") for a in axes}
    distinct = {}
    for point in points.values():
        if point is not None:
            distinct.setdefault(canon(point), point)
    ordered = sorted(distinct.values(), key=lambda p: [order(p[a]) for a in axes])
    labels = [", ".join(f"{a}={show(v)}" for a, v in p.items()) or ALL for p in ordered]
    values = list(ordered)
    index = {canon(p): i for i, p in enumerate(ordered)}
    cell_ids = []
    for run_id in runs["run_id"]:
        point = points[run_id]
        if point is None:
            labels.append(f"settings unknown ({run_id})")
            values.append(dict.fromkeys(axes, UNKNOWN))
            cell_ids.append(len(labels) - 1)
        else:
            cell_ids.append(index[canon(point)])
    if not labels:
        labels, values = [ALL], [{}]
    runs["cell_id"] = cell_ids
    runs["cell"] = [labels[i] for i in cell_ids]
    for a in axes:
        runs[a] = [values[i][a] for i in cell_ids]
    cells = Cells(axes, objective_settings, labels, values)
    runs, cells.duplicates, unseeded = mark_duplicates(runs)
    runs, cells.mixed_policies = mark_mixed_policies(runs)
    notes += cells.duplicates + cells.mixed_policies + unseeded
    return runs, cells, notes


def mark_mixed_policies(runs: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Runs whose starting policy has one cache key and one ``model.seed`` but other weights (analysis/load.py
    ``start_policy``: built apart, e.g. on two CPUs, it is another policy): the intervals take ``model.seed`` as the
    starting policy, so only the runs of one of them are counted (the one with the most counted runs, then the first
    by name) and the others are named in a line; they would otherwise be pooled as seeds of one policy."""
    if "start_policy_key" not in runs:
        return runs, []
    runs, lines = runs.copy(), []
    known = runs[runs["counted"] & runs["start_policy_key"].notna()]
    # without a warm start (key none) what the weights are built from is the cell's model: compared within a cell
    scope = known["cell"].where(known["start_policy_key"] == "none", "") if "cell" in known else ""
    for (start, key, _), group in known.assign(_scope=scope).groupby([START_SEED, "start_policy_key", "_scope"],
                                                                      sort=True, dropna=False):
        sizes = group["start_policy"].value_counts()
        if len(sizes) < 2:
            continue
        keep = sorted(sizes.index, key=lambda p: (-sizes[p], p))[0]
        others = group.loc[group["start_policy"] != keep, "run_id"]
        runs.loc[runs["run_id"].isin(others), "counted"] = False
        policy = "" if pd.isna(start) else f"{START_SEED}={start}, "
        counts = ", ".join(f"{sizes[p]} run{'' if sizes[p] == 1 else 's'} from `{p}`"
                           for p in sorted(sizes.index, key=lambda p: (-sizes[p], p)))
        left_out = ", ".join(f"`{r}`" for r in sorted(others))
        if key == "none":  # no warm start: the model's own weights differ (a folder whose weights were replaced)
            lines.append(f"starting weights differ: {policy}the runs without a warm start of cell "
                         f"`{group['cell'].iloc[0]}` start from {len(sizes)} sets of weights ({counts}: the model's "
                         f"files changed between runs); only the runs from `{keep}` are counted, not {left_out}: keep "
                         "one model's runs in one results folder")
            continue
        lines.append(f"starting policies built apart: {policy}key `{key}` has {len(sizes)} sets of weights in these "
                     f"runs ({counts}; another CPU builds other weights); only the runs from `{keep}` are counted, not "
                     f"{', '.join(f'`{r}`' for r in sorted(others))}: put runs from one machine's starting policies "
                     "in one results folder")
    return runs, lines


def results_differ(group: pd.DataFrame) -> str:
    """What a duplicates line adds when the copies' final eval accuracies differ (the first row is the one counted):
    the choice is by records, so the reader sees the result left out."""
    if "final_eval_accuracy" not in group:
        return ""
    finals = group["final_eval_accuracy"].astype(float)
    if finals.fillna(-1).max() - finals.fillna(-1).min() <= 1e-12:
        return ""
    shown = ", ".join(f"`{r}` {'n/a' if math.isnan(f) else f'{f:#.3g}'}"
                      for r, f in zip(group["run_id"], finals, strict=True))
    return (f"; their final eval accuracies differ ({shown}): the one counted is chosen by its records (ended, "
            "complete, steps done), then by name, never by its result")


def mark_duplicates(runs: pd.DataFrame) -> tuple[pd.DataFrame, list[str], list[str]]:
    """``counted`` and ``duplicate_of`` (see the module docstring); lines naming the duplicates and the runs whose
    seed is unknown."""
    runs = runs.copy()
    runs["counted"] = runs["seed"].notna()
    runs["duplicate_of"] = ""
    lines = []
    if START_SEED not in runs:
        runs[START_SEED] = pd.Series(pd.NA, index=runs.index, dtype="Int64")
    keys = ["objective", "cell", START_SEED, "seed"]
    for (objective, cell, start, seed), group in runs[runs["counted"]].groupby(keys, sort=True, dropna=False):
        if len(group) < 2:
            continue
        ranked = group.assign(_ended=~group["ended"], _complete=~group["complete"], _steps=-group["steps_done"]
                              ).sort_values(["_ended", "_complete", "_steps", "run_id"])
        keep, others = ranked["run_id"].iloc[0], list(ranked["run_id"].iloc[1:])
        runs.loc[runs["run_id"].isin(others), "counted"] = False
        runs.loc[runs["run_id"].isin(others), "duplicate_of"] = keep
        policy = "" if pd.isna(start) else f"starting policy {START_SEED}={start}, "
        lines.append(f"duplicate runs: {objective}, {policy}seed {seed}, cell `{cell}`: "
                     f"{', '.join(f'`{r}`' for r in others)} {'has' if len(others) == 1 else 'have'} the same settings "
                     f"and seed as `{keep}`; only `{keep}` is counted (a seed counts once){results_differ(ranked)}")
    unseeded = [f"{r}: seed unknown (no manifest entry, summary.json or config.yaml states it): not counted"
                for r in runs.loc[runs["seed"].isna(), "run_id"]]
    return runs, lines, unseeded
