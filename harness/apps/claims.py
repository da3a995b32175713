"""The paper-claims ledger: one YAML per claim in experiments/claims/, run and checked by `make claims`.

    python -m harness claims [NAME ...] [--existing]   # -> results/claims/ledger.md, ledger.html, ledger.csv
    # NAME ...: run those claims' experiments; the ledger still has a row for every claim (the others checked on
    # their runs as they are)

A claim file::

    claim: GSPO clips far more tokens than GRPO at the papers' clip ranges.
    paper: GSPO, arXiv 2507.18071, Fig. 2
    reported: "~0.15 vs ~0.0013 of tokens"        # the paper's value, as text (optional)
    experiment: {lab: lab}                         # or {sweep: gspo_clip_repro}; optional `overrides: [k=v, ...]`
    checks:                                        # every check must hold
      - {table: lab, metric: clip_frac, where: "axis == 'staleness' and staleness >= 1",
         compare: {objective: gspo, than: grpo, direction: greater, factor: 10}}

Tables: a probe's ``probe`` (``experiment: {probe: moe_update, overrides: [depths=[2, 4, 8], ...]}``:
harness/apps/moe_probe.py's rows, one per depth (``layers``), seed and lr; units: seeds); a lab's ``lab``,
``pairwise``, ``snr``, ``sqrt_growth`` (analysis/lab.py); a sweep's ``runs`` (one row per
run and logged step: every per-step metric, from analysis/load.py) and ``final`` (one row per run that ended and is
counted, analysis/load.py's run table: ``final_eval_accuracy``, ``best_eval_accuracy``, ``collapsed`` (1 when its
collapse record names a cause, else 0), ``folder`` (its experiment's results folder), the swept keys as columns,
e.g. ```train.num_minibatches` == 16``). ``where`` is a pandas query on the table. A check's *units* are the lab's
batches or the sweep's seeds: the metric is averaged
over the selected rows of each unit first (a table without units, such as ``sqrt_growth``, has one unit per row), so
a sweep's comparison is paired by seed, as analysis/paired.py's (runs of one seed share their first rollouts).

- ``compare``: per unit, x = metric of ``objective``, y = metric of ``than`` (paired by unit; the compare's own
  ``where`` / ``than_where`` narrow x's / y's rows further, e.g. two cells of one objective; ``baseline``, a query
  of its own, makes x and y each one's change from its value on those rows, per unit: "degrades less with lag" is
  the change from lag 0 compared). ``greater`` holds if
  the 95% interval of mean(x - factor * y) (see Replication) lies above 0 and does not hold if it lies at or below
  0; ``less`` mirrors it; ``equal`` holds if max |x - y| <= tolerance * max(|y|, tiny) over units; ``equivalent``
  holds if the interval of mean(x - y) lies inside [-margin, margin] (an equivalence test: "matches" needs an
  interval that excludes every difference larger than the margin, not an interval that happens to include 0) and
  does not hold if it lies wholly outside. ``scale: log`` compares the logs of the per-unit means (with a
  ``baseline``, each side's log ratio to its baseline: a relative change, for two quantities of different sizes; a
  positive metric, over the units only, not the eval problems; a ``factor`` f then compares log x - log y with
  log f).
- ``within: [low, high]``: the ``statistic`` (mean by default, or min, max) over units of the metric, for
  ``objective`` when given, lies in [low, high]: the mean's 95% interval inside [low, high] (holds) or wholly
  outside (does not hold); the min or max observed, which has no interval, inside or not. ``null`` for a side the
  claim leaves open (``[0.9, null]``: at least 0.9), where the quantity's own limit is no bound of the claim (a
  fraction's 1, an accuracy's 0): a t-interval reaches past such a limit, and a closed bound there would leave a
  claim that every unit meets "not resolved".
A check whose interval reaches both sides of its bound, or that has none (one starting policy and fewer than 3
units), is "not resolved": neither the claim nor its negation is supported.
A claim file is checked when it is read, before any experiment runs (``check_problem``): a field neither list above
names, no checks, bounds that are not two finite numbers in order, a non-positive factor or margin, a negative
tolerance are refused in one line naming the file.
Replication. A claim runs its experiment from ``start_policies`` starting policies (optional, default 5: the first n
values of START_CANDIDATES, harness/apps/zoo.py's, whose warm start lands in its band: ``start_seeds``; 1: the
experiment's own model.seed) and, for a sweep, ``seeds`` seeds
0 .. n-1 from each (optional; default CONFIRM_SEEDS with several starting policies, the experiment's own grid with
one); a lab runs once per starting policy (its folder named ``<lab>_start<model.seed>``, with its overrides' tag
when the claim sets any: lab_configs; with ``--jobs`` > 1 each
in a process of its own, that many at a time). A probe builds a model of
its own per seed (init and warm start: harness/apps/moe_probe.py) and ignores both fields: its seeds are its units
under one "starting policy", so a probe's claim is at most "indicative". A check's unit is then a
(starting policy, batch / seed) pair, paired across objectives, and every interval is the t-interval of
analysis/stats.py describe over the starting policies' means (over the units with one starting policy), except an
eval accuracy's (``final_eval_accuracy``, ``best_eval_accuracy``, ``start_eval_accuracy`` of a sweep's ``final``;
``eval_accuracy`` of its ``runs``, each run's mean over the selected evaluations): the runs of a cell score the same
eval problems, a sample of the task's, so its interval is analysis/accuracy.py's
over starting policies, seeds and eval problems, paired run by run and problem by problem (a comparison's
``baseline`` and ``factor`` too), and the ledger says "its interval counts the eval problems too"; where a run lacks
its per-problem scores it is over the runs only, and says so. A ``best_eval_accuracy``'s scores are each run's best
evaluation's, chosen on the same problems and taken as given, so its interval leans upward (said in its row).

Verdicts: "holds" only under the confirmation design (DESIGN: at least 5 starting policies x 5 seeds or batches per
starting policy, in every check's selection: the intervals are over the starting policies' means, and from fewer
than 5 their coverage falls short of 95% in some simulated case, analysis/stats.py, as the zoo marks them) when
every check holds; "indicative" when every check holds with less replication; "does not hold" (with the numbers)
when a check does not, under DESIGN, whatever the others found ("no data" of another does not hide it; "does not
hold (indicative)" when every check that does not hold has less replication: its interval falls short of 95% as
that of a claim that holds would, and a probe's claim is at most indicative either way); "no data" when none fails
and a check found nothing to measure; "not resolved" when none fails, each has data and one is not resolved. Every
row states its replication, its model and its correction: none across claims (each claim is its own question, from
its own paper; each verdict is at 95%, so a ledger of many claims can hold a wrong verdict by chance), and within
a claim every check must hold, each at 95% (an intersection-union test, which needs no adjustment for the number of
checks), while "does not hold" follows from any one check (a union: up to k x 2.5% for a true claim of k checks,
unadjusted, said in its row). An ``equivalent`` check's 95% interval inside the margin is
two one-sided tests at 2.5% each. Experiments are resumable (labs per batch, sweeps per run), so `make claims`
continues where it stopped.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import html
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from omegaconf import DictConfig, OmegaConf

from analysis.accuracy import (
    ACCURACY_RANGE,
    BEST,
    FINAL,
    START,
    across_cells,
    interval_of,
    paired_units,
    runs_scores,
    steps_scores,
)
from analysis.cells import START_SEED
from analysis.lab import build_lab_report, lab_version
from analysis.load import AnalysisError
from analysis.load import load_experiment as load_results
from analysis.report import md_table
from analysis.stats import CI_MIN_SEEDS, INDICATIVE_BELOW, describe, num
from harness.apps.lab import lab_dir, lab_objectives, run_lab, validate_lab
from harness.apps.launchers import Job, LocalLauncher, run_each
from harness.apps.moe_probe import UpdateProbe, probe_task, volatility_by_depth
from harness.apps.stamp import machine
from harness.apps.sweep import (
    START_POLICIES,
    check_prepare_folder,
    check_runs_code,
    check_runs_one_version,
    first_landing,
    last_line,
    run_sweep,
)
from harness.apps.zoo import CONFIRM_SEEDS, START_CANDIDATES
from harness.run.atomic import atomic_write
from harness.run.config import load_experiment, run_configs, run_id, yaml_problem
from harness.run.errors import ConfigError
from harness.run.experiments import EXPERIMENTS_DIR
from harness.run.provenance import UNKNOWN, check_one_version, code_record, runs_stamp

CLAIMS_DIR = EXPERIMENTS_DIR / "claims"
CLAIMS_RUNS = "claims"  # <results_dir>/claims/: the ledger, and the sweeps run from the claims' own starting policies
EVALUATIONS = "eval_accuracy"  # the runs table's accuracy of each evaluation (a step's row; NaN between them)
SCORES = "eval_scores"  # beside a sweep's tables: run_id -> its per-problem eval scores (analysis/load.py's samples)
UNITS = {"lab": "batch", "pairwise": "batch", "runs": "seed", "final": "seed", "probe": "seed"}
TABLES = {"lab": ("lab", "pairwise", "snr", "sqrt_growth"), "sweep": ("runs", "final"),  # each experiment kind's
          "probe": ("probe",)}
KINDS = ("lab", "sweep", "probe")
PROBES = ("moe_update",)  # {probe: moe_update}: harness/apps/moe_probe.py's one-update routing change by depth
DIRECTIONS = ("greater", "less", "equal", "equivalent")
STATISTICS = {"mean": np.mean, "min": np.min, "max": np.max}
DESIGN = (INDICATIVE_BELOW, 5)  # what "holds" needs: starting policies (the intervals' top level: below
# INDICATIVE_BELOW their coverage falls short of 95%, analysis/stats.py), and seeds (or batches) per starting policy
CORRECTION = ("none across claims; within the claim every check must hold, each at 95% (intersection-union test)")
NOT_RESOLVED = "not resolved"  # a check's 95% interval reaches both sides of its claimed bound, or there is none
REFUTED_INDICATIVE = "does not hold (indicative)"  # no check that does not hold meets DESIGN (module docstring)
# what a selection (``where``, pandas' query syntax) may hold: columns, values, comparisons and arithmetic, no more
WHERE_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd, ast.Compare,
               ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn, ast.BinOp, ast.BitAnd,
               ast.BitOr, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Mod, ast.Name, ast.Load, ast.Constant, ast.List,
               ast.Tuple)
ROUNDOFF = 1e-6  # relative: differences of a compare's every unit within it are float32 round-off, not an effect
SEEDS_MAX = 100  # a claim's seeds per starting policy, at most (x its policies x cells: already hours of runs)
STRING_TESTS = ("startswith", "endswith", "contains")  # column.str.<test>(values): the string tests a where may use


@dataclass
class Claim:
    name: str
    claim: str
    paper: str
    experiment: dict[str, Any]
    checks: list[dict[str, Any]]
    reported: str = ""
    notes: list[str] = field(default_factory=list)
    start_policies: int = DESIGN[0]  # starting policies (model.seed) its experiment runs from (module docstring)
    seeds: int | None = None  # a sweep's seeds per starting policy (None: CONFIRM_SEEDS, or the experiment's with one)
    long: bool = False  # hours of SmolLM2 sweeps: run only with --with-long (named or not), not by a bare `make claims`

    @property
    def source(self) -> tuple[str, str, tuple[str, ...]]:
        kind = next(k for k in KINDS if k in self.experiment)
        return kind, self.experiment[kind], tuple(self.experiment.get("overrides", []))

    @property
    def design(self) -> tuple[int, int | None]:
        """(starting policies, 0: the experiment's own; a sweep's seeds per policy, None: the experiment's); a probe
        builds its own model per seed: (0, None). Which model.seed values: start_seeds."""
        if self.start_policies == 1 or self.source[0] == "probe":
            return 0, self.seeds
        return self.start_policies, self.seeds or CONFIRM_SEEDS

    @property
    def key(self) -> tuple:
        """What its tables depend on: claims with the same key share one experiment."""
        return (*self.source, *self.design)


def load_claim(path: Path) -> Claim:
    """A claim file, checked: one line naming the file and the problem (a link or a folder is no claim file: not
    followed)."""
    if path.is_symlink() or not path.is_file():
        raise ConfigError(f"{path}: not a claim file (a link or a folder, not followed); a claim is a YAML file of its "
                          f"own in {CLAIMS_DIR}: move it away or replace it with the file")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not a claim: {yaml_problem(e)}; see harness/apps/claims.py for the fields") \
            from None
    except (OSError, ValueError) as e:  # ValueError: not UTF-8
        raise ConfigError(f"{path}: not a claim ({e}); see harness/apps/claims.py for the fields") from None
    fields = {f.name: f for f in dataclasses.fields(Claim) if f.name != "name"}  # its name is the file's
    unknown = [k for k in data if k not in fields] if isinstance(data, dict) else []
    missing = [k for k, f in fields.items() if isinstance(data, dict) and k not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if not isinstance(data, dict) or unknown or missing:
        what = f"no field {unknown[0]!r}" if unknown else f"{missing[0]} missing" if missing else "not a mapping"
        raise ConfigError(f"{path}: not a claim ({what}); its fields: {', '.join(fields)} (its name is the file's)")
    claim = Claim(name=path.stem, **data)
    problem = claim_problem(claim)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    return claim


class _UniqueKeys(yaml.SafeLoader):
    """yaml.safe_load's loader, but a key given twice in one mapping is an error (safe_load keeps the last and
    drops the first without a word; experiment files, read by OmegaConf, refuse it too)."""


def _unique_mapping(loader: _UniqueKeys, node: yaml.MappingNode) -> dict:
    keys = [loader.construct_object(key, deep=True) for key, _ in node.value]
    twice = next((i for i, key in enumerate(keys) if key in keys[:i]), None)
    if twice is not None:
        raise yaml.constructor.ConstructorError(None, None, f"the key {keys[twice]!r} is given twice",
                                                node.value[twice][0].start_mark)
    return loader.construct_mapping(node, deep=True)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def claim_problem(claim: Claim) -> str | None:
    """What is wrong with a claim's fields beyond its checks' (:func:`check_problem`), or None."""
    if not (_whole(claim.start_policies) and 1 <= claim.start_policies <= len(START_CANDIDATES)):
        return (f"start_policies must be a whole number from 1 to {len(START_CANDIDATES)} (the first that land of "
                f"model.seed {list(START_CANDIDATES)}), got {claim.start_policies!r}")
    if claim.seeds is not None and not (_whole(claim.seeds) and 1 <= claim.seeds <= SEEDS_MAX):
        return f"seeds must be a whole number from 1 to {SEEDS_MAX} (per starting policy), got {claim.seeds!r}"
    if not isinstance(claim.long, bool):
        return f"long must be true or false, got {claim.long!r}"
    wrong = [k for k in ("claim", "paper", "reported") if not isinstance(getattr(claim, k), str)]
    if wrong:
        return f"{wrong[0]} must be one text, got {getattr(claim, wrong[0])!r}"
    if not (isinstance(claim.notes, list) and all(isinstance(note, str) for note in claim.notes)):
        return f"notes must be a list of texts (- one note a line), got {claim.notes!r}"
    problem = experiment_problem(claim.experiment)
    if problem:
        return problem
    if claim.seeds is not None and claim.source[0] != "sweep":  # it would be ignored without a word
        return (f"seeds is a sweep's (seeds per starting policy): a lab runs once per starting policy and a probe "
                f"takes its seeds in its overrides; remove seeds: {claim.seeds}")
    if not isinstance(claim.checks, list) or not claim.checks:  # none: every check held, vacuously
        return f"checks must be a non-empty list of checks, got {claim.checks!r}"
    return next(filter(None, (check_problem(check, claim.source[0]) for check in claim.checks)), None)


def experiment_problem(experiment) -> str | None:
    """What is wrong with a claim's ``experiment`` (one of KINDS naming it, and ``overrides``: a list of
    key=value), or None."""
    if not isinstance(experiment, dict) or sum(k in experiment for k in KINDS) != 1:
        return "experiment must name one lab, one sweep or one probe, e.g. {lab: lab}"
    unknown = [k for k in experiment if k not in (*KINDS, "overrides")]
    if unknown:  # a misspelt overrides: the experiment would run without them
        return f"experiment has no field {unknown[0]!r}; its fields: one of {', '.join(KINDS)}, and overrides"
    kind = next(k for k in KINDS if k in experiment)
    if not isinstance(experiment[kind], str):
        return f"experiment.{kind} must name one {kind} (text), got {experiment[kind]!r}"
    if kind == "probe" and experiment[kind] not in PROBES:
        return f"no probe {experiment[kind]!r}; probes: {', '.join(PROBES)}"
    overrides = experiment.get("overrides", [])
    if not (isinstance(overrides, list) and all(isinstance(o, str) for o in overrides)):
        return f"experiment.overrides must be a list of key=value texts, got {overrides!r}"
    if kind == "probe":
        try:
            probe_settings(tuple(overrides))
        except ConfigError as e:
            return str(e)
    return None


CHECK_KEYS = ("table", "metric", "where", "objective", "statistic", "within", "compare")
COMPARE_KEYS = ("objective", "than", "where", "than_where", "baseline", "direction", "factor", "tolerance", "margin",
                "scale")
SCALES = ("linear", "log")  # compare.scale: log compares the logs of per-unit means (a baseline: their log ratio)
READ_BY = (("factor", ("greater", "less")), ("tolerance", ("equal",)))  # the fields only some directions read


def check_problem(check, kind: str) -> str | None:
    """What is wrong with one check of a claim of experiment kind ``kind`` (its fields: the module docstring), or
    None: found when the claim is read, before any experiment runs, not as a traceback or a verdict after it."""
    if not isinstance(check, dict):
        return f"each check is a mapping (table, metric, ...), got {check!r}"
    if ("compare" in check) == ("within" in check) or "table" not in check or "metric" not in check:
        return f"each check needs table, metric and one of compare / within, got {check}"
    unknown = [k for k in check if k not in CHECK_KEYS]
    if unknown:
        return f"a check has no field {unknown[0]!r}; its fields: {', '.join(CHECK_KEYS)}"
    wrong = [k for k in ("table", "metric", "where", "objective", "statistic") if k in check
             and not isinstance(check[k], str)]
    if wrong:
        return f"a check's {wrong[0]} is one text, got {check[wrong[0]]!r}"
    if check["table"] not in TABLES[kind]:
        return f"a {kind} has no table {check['table']!r}; tables: {', '.join(TABLES[kind])}"
    if check.get("where") and (problem := where_problem(check["where"])):
        return problem
    if check.get("statistic", "mean") not in STATISTICS:
        return f"statistic must be one of {', '.join(STATISTICS)}"
    if "within" in check:
        bounds = check["within"]
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(b is None or _finite(b) for b in bounds)
                and bounds != [None, None] and (None in bounds or bounds[0] <= bounds[1])):
            return (f"within must be [low, high], two finite numbers with low <= high, got {bounds!r} (null for a "
                    "side the claim leaves open, e.g. [0.9, null])")
        return None
    return compare_problem(check["compare"])


def compare_problem(spec) -> str | None:
    """What is wrong with a check's ``compare``, or None."""
    if not isinstance(spec, dict) or "objective" not in spec or "than" not in spec:
        return f"compare must be a mapping naming objective and than, got {spec!r}"
    unknown = [k for k in spec if k not in COMPARE_KEYS]
    if unknown:
        return f"compare has no field {unknown[0]!r}; its fields: {', '.join(COMPARE_KEYS)}"
    wrong = [k for k in ("objective", "than", "where", "than_where", "baseline", "direction") if k in spec
             and not isinstance(spec[k], str)]
    if wrong:
        return f"compare.{wrong[0]} is one text, got {spec[wrong[0]]!r}"
    if spec.get("direction", "greater") not in DIRECTIONS:
        return f"compare.direction must be one of {', '.join(DIRECTIONS)}"
    if spec.get("scale", "linear") not in SCALES:
        return f"compare.scale must be one of {', '.join(SCALES)}, got {spec['scale']!r}"
    problem = next(filter(None, (where_problem(spec[k]) for k in ("where", "than_where", "baseline") if spec.get(k))),
                   None)
    if problem:
        return f"compare.{problem}"
    if (spec.get("direction") == "equivalent") != ("margin" in spec):
        return "compare.margin is the equivalence margin: give it with direction equivalent (only)"
    direction = spec.get("direction", "greater")
    for key, directions in READ_BY:  # a field the direction does not read would change no verdict, silently
        if key in spec and direction not in directions:
            return f"compare.{key} is read by direction {' or '.join(directions)} only, not by {direction}: remove it"
    if direction == "equal" and spec.get("scale", "linear") != "linear":
        return ("compare.scale log does not go with direction equal, which compares the units' own values: "
                "remove it")
    for key, zero, what in (("margin", False, "the equivalence margin"), ("factor", False, "y's multiplier"),
                            ("tolerance", True, "the largest relative gap of equal")):
        value = spec.get(key, 1.0)
        if not (_finite(value) and (value >= 0 if zero else value > 0)):
            return f"compare.{key} must be a number {'>= 0' if zero else '> 0'} ({what}), got {value!r}"
    return None


def where_problem(where: str) -> str | None:
    """What is wrong with a selection (pandas' query syntax, run on the claim's tables: :func:`selection`), or None.
    It may compare columns (a name, or a name with dots in backticks) with values, test a text column
    (``column.str.startswith('x')``: STRING_TESTS) and combine them (and, or, not, & |, arithmetic), and nothing
    else: no ``@`` (which reads a variable of the harness's own code), no other call or attribute, so that a claim
    file selects rows and runs no code."""
    try:
        tree = ast.parse(re.sub(r"`[^`]*`", "column", where), mode="eval")
    except SyntaxError as e:
        return f"where {where!r} does not parse ({e.msg}): write a selection such as \"`train.lr` == 1e-4\""
    bad = _disallowed(tree)
    if bad is None:
        return None
    what = ast.unparse(bad) if isinstance(bad, ast.expr) else f"the operator {type(bad).__name__}"
    return (f"where {where!r}: {what} is not allowed; a where compares columns with values (==, !=, <, in, and, or, "
            "not, arithmetic, column.str.startswith('x')), e.g. \"step >= 15 and objective == 'grpo'\": no @, no other "
            "call or attribute")


def _disallowed(node: ast.AST) -> ast.AST | None:
    """The first node of a parsed selection that where_problem does not allow (None: every one is allowed)."""
    if _string_test(node):
        return None
    if not isinstance(node, WHERE_NODES):
        return node
    return next(filter(None, map(_disallowed, ast.iter_child_nodes(node))), None)


def _string_test(node: ast.AST) -> bool:
    """Whether ``node`` is ``column.str.<one of STRING_TESTS>(values)``, e.g. point.str.startswith('temperature')."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STRING_TESTS
            and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "str"
            and isinstance(node.func.value.value, ast.Name)
            and all(isinstance(v, ast.Constant) for v in [*node.args, *(k.value for k in node.keywords)]))


def selection(table: pd.DataFrame, where: str | None) -> pd.DataFrame:
    """``table``'s rows that ``where`` selects (all without one), checked by where_problem first (ValueError) and
    evaluated with no variable of this module in reach."""
    if not where:
        return table
    problem = where_problem(where)
    if problem:
        raise ValueError(problem)
    return table.query(where, local_dict={}, global_dict={})


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and np.isfinite(value)


def load_claims(names: list[str] | None = None, with_long: bool = False) -> list[Claim]:
    """The claims ``names`` (default: every claim, the ``long`` ones only ``with_long``)."""
    paths = sorted(CLAIMS_DIR.glob("*.yaml"))
    if names:
        known = {p.stem: p for p in paths}
        missing = [n for n in names if n not in known]
        if missing:
            near = {n.lower(): n for n in known}.get(missing[0].lower()) or next(
                iter(difflib.get_close_matches(missing[0], known, n=1)), None)
            raise ConfigError(f"no claim {', '.join(map(repr, missing))} in {CLAIMS_DIR} (name a claim by its file's "
                              f"name without .yaml).{f' Did you mean {near}?' if near else ''} Claims: "
                              f"{', '.join(known)}")
        return [load_claim(known[n]) for n in dict.fromkeys(names)]  # a name given twice: one row
    return [c for c in map(load_claim, paths) if with_long or not c.long]


def run_source(kind: str, name: str, overrides: tuple[str, ...], start_seeds: tuple[int, ...] = (),
               seeds: int | None = None, jobs: int = 2, progress: bool = True, run: bool = True,
               allow_code_change: bool = False) -> dict[str, pd.DataFrame]:
    """Run (or resume; with ``run`` False: only read) the claim's experiment from ``start_seeds``' starting policies
    (none: the experiment's own) with ``seeds`` seeds each (a sweep's; None: the experiment's) (``allow_code_change``:
    its runs that other code began too); its tables by name, with a START_SEED column (none when there is nothing to
    read: its checks say "no data")."""
    if kind == "probe":
        return run_probe(overrides, run)
    if kind == "lab":
        return lab_tables(name, overrides, start_seeds, progress, run, jobs)
    cfg = sweep_config(name, overrides, start_seeds, seeds)
    if run:
        run_sweep(cfg, jobs=jobs, progress=progress, allow_code_change=allow_code_change, command="claims")
    try:
        exp = load_results(Path(cfg.results_dir) / cfg.name)
    except AnalysisError:
        return {}
    # the folder may hold other designs' runs (other starting policies; another claim's settings at the same seeds)
    runs = exp.runs[exp.runs["run_id"].isin({run_id(run) for run in run_configs(cfg)})]
    final = runs[runs["counted"] & runs["ended"]]
    check_one_version(final["code"].tolist(), exp.dir, "the runs a claim reads")
    return {"runs": exp.metrics[exp.metrics["run_id"].isin(final["run_id"])],  # the runs ``final`` counts, only
            "final": final.assign(collapsed=final["collapse_cause"].notna().astype(float), folder=str(exp.dir)),
            SCORES: {rid: exp.samples[rid] for rid in final["run_id"] if rid in exp.samples}}


def start_seeds(key: tuple, jobs: int, progress: bool, run: bool) -> tuple[int, ...]:
    """model.seed of a claim's starting policies (``key``: Claim.key): none for the experiment's own; else the first
    ``n`` of START_CANDIDATES whose warm start lands in its band (sweep.first_landing: built or loaded before any
    experiment runs, ``jobs`` side by side, their build logs in <results_dir>/prepare/<experiment>_<overrides' hash>/).
    Without ``run`` (start nothing): those a former call found (its start_policies.json there), else the first ``n``
    candidates. A lab on a saved policy (lab.policy) is one starting policy whatever model.seed (no init, warm start
    or adapters to vary): several are refused (ConfigError), as copies of one would make a zero-width interval."""
    kind, name, overrides, wanted, _ = key
    if not wanted:
        return ()
    cfg = sweep_config(name, overrides, (), None)
    folder = Path(cfg.results_dir) / "prepare" / f"{name}_{overrides_tag(overrides)}"
    if kind == "lab" and OmegaConf.select(cfg, "lab.policy") is not None:
        raise ConfigError(f"a claim's lab {name} (overrides {list(overrides)}) sets lab.policy: one saved starting "
                          f"policy, which model.seed does not change, so {wanted} starting policies would be {wanted} "
                          "copies of it; set start_policies: 1 in the claims that run it")
    check_prepare_folder(folder, START_CANDIDATES)
    if not run:
        return recorded_starts(folder / START_POLICIES, wanted)

    def runs_for(seeds: list[int]) -> list[DictConfig]:  # a sweep's first seed names each policy; a lab has one
        return run_configs(sweep_config(name, overrides, tuple(seeds), 1 if kind == "sweep" else None))

    return tuple(first_landing(runs_for, START_CANDIDATES, wanted, folder, jobs, progress)["landed"])


def recorded_starts(path: Path, wanted: int) -> tuple[int, ...]:
    """The first ``wanted`` starting policies a former first_landing found (``path``: its START_POLICIES), then, if it
    found fewer (a claim that asks for more since), the next candidates it did not record as missed; without the
    file, the first ``wanted`` candidates. A file first_landing did not write (not JSON, or landed not distinct
    candidates apart from those missed) is a ConfigError naming it: read as it stands it would select other runs,
    or none, without a word."""
    if not path.exists():
        return START_CANDIDATES[:wanted]
    try:
        found = json.loads(path.read_text())
        landed, missed = found["landed"], found["missed"]
        ok = (isinstance(landed, list) and isinstance(missed, dict) and len(set(landed)) == len(landed)
              and all(_whole(s) and s in START_CANDIDATES and str(s) not in missed for s in landed))
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ConfigError(f"{path} is not a record of the starting policies found (a list 'landed' of distinct "
                          f"model.seed values of {list(START_CANDIDATES)}, and 'missed'): remove it and they are "
                          "decided again (the cached ones loaded in seconds)")
    more = [s for s in START_CANDIDATES if s not in landed and str(s) not in missed]
    return tuple([*landed, *more][:wanted])


def sweep_config(name: str, overrides: tuple[str, ...], start_seeds: tuple[int, ...], seeds: int | None
                 ) -> DictConfig:
    """The claim's sweep: the experiment with its overrides, its grid over ``start_seeds`` (model.seed) and ``seeds``
    seeds 0 .. seeds-1 when given. From starting policies of its own (``start_seeds``) its runs go to
    <results_dir>/claims/<experiment>/, apart from the experiment's folder, whose report (`make sweep`, `make docs`)
    covers every run there; from the experiment's own starting policy it runs (or reads) in the experiment's folder."""
    design = [*([f"sweep.grid.model.seed=[{','.join(map(str, start_seeds))}]"] if start_seeds else []),
              *([f"sweep.grid.seed=[{','.join(map(str, range(seeds)))}]"] if seeds else [])]
    cfg = load_experiment(name, [*overrides, *design])
    if not start_seeds:
        return cfg
    return load_experiment(name, [*overrides, *design, f"results_dir={Path(cfg.results_dir) / CLAIMS_RUNS}"])


def labs_stamp(tables_of: dict) -> str:
    """What the ledger says of the labs its checks read: each lab's code version (its code.json), as runs_stamp says
    the runs'; "" without labs."""
    versions: dict[str, int] = {}
    for tables in tables_of.values():
        if "lab" in tables and "code" in tables["lab"]:
            for version in tables["lab"].drop_duplicates(START_SEED)["code"]:
                versions[version] = versions.get(version, 0) + 1
    if not versions:
        return ""
    shown = "; ".join(f"code `{v}`{' (before labs recorded their code)' if v == UNKNOWN else ''}: {n} "
                      f"lab{'s' * (n != 1)}" for v, n in sorted(versions.items()))
    return f" Labs measured: {shown}."


def overrides_tag(overrides: tuple[str, ...]) -> str:
    """8 hex digits that name a claim's experiment overrides in the names of its folders."""
    return hashlib.sha256(json.dumps(list(overrides)).encode()).hexdigest()[:8]


def lab_configs(name: str, overrides: tuple[str, ...], start_seeds: tuple[int, ...]) -> list[DictConfig]:
    """A claim's labs: the lab ``name`` with ``overrides``, one per starting policy, each named
    ``<name>_start<model.seed>``, or ``<name>_<overrides_tag>_start<model.seed>`` when the overrides change the lab's
    settings (``results_dir`` only says where), so that two claims' labs of other settings never share a folder
    (the second was refused as "a lab with other settings"); the experiment's own policy without ``start_seeds``."""
    settings = tuple(o for o in overrides if not o.startswith("results_dir="))
    tag = f"_{overrides_tag(settings)}" if settings else ""
    cfgs = []
    for seed in start_seeds or (None,):
        cfg = load_experiment(name, list(overrides) + ([] if seed is None else [f"model.seed={seed}"]))
        if seed is not None:
            cfg.name = f"{cfg.name}{tag}_start{seed}"
        cfgs.append(cfg)
    return cfgs


def lab_tables(name: str, overrides: tuple[str, ...], start_seeds: tuple[int, ...], progress: bool,
               run: bool, jobs: int = 1) -> dict[str, pd.DataFrame]:
    """A lab's tables, one lab per starting policy (:func:`lab_configs`) stacked with a START_SEED column. Run
    (``run``) with several starting policies and ``jobs`` > 1: each lab in a process of its own, ``jobs`` at a time
    (:func:`labs_apart`); else here, one after another."""
    cfgs = lab_configs(name, overrides, start_seeds)
    apart = run and len(cfgs) > 1 and jobs > 1
    if apart:
        labs_apart(name, overrides, cfgs, jobs)
    parts: dict[str, list] = {}
    folders = [run_lab(cfg, progress) if run and not apart else lab_dir(cfg) for cfg in cfgs]
    if not all((folder / "batches").is_dir() for folder in folders):
        return {}
    check_one_code(folders)
    for cfg, folder in zip(cfgs, folders, strict=True):
        if not apart:  # a lab apart wrote its report as it ended
            build_lab_report(folder)
        code = {"code": lab_version(folder) or UNKNOWN}  # the lab's code version, on its rows (labs_stamp)
        for t in ("lab", "pairwise", "snr", "sqrt_growth"):
            parts.setdefault(t, []).append(pd.read_csv(folder / f"{t}.csv").assign(**{START_SEED: cfg.model.seed},
                                                                                 **code))
    return {t: pd.concat(frames, ignore_index=True) for t, frames in parts.items()}


def check_one_code(folders: list[Path]) -> None:
    """A claim's labs (one per starting policy) are pooled by its checks: refuse (ConfigError, one line) labs that
    different code measured, a lab from before labs recorded their code among them too."""
    versions = {folder: lab_version(folder) or UNKNOWN for folder in folders}
    if len(set(versions.values())) > 1:
        shown = ", ".join(f"{folder.name} by {version}" for folder, version in versions.items())
        raise ConfigError(f"the labs {shown} were measured by different code and a claim pools them: delete those not "
                          f"measured by {code_record()['version']} (this code) and run the claims again")


def labs_apart(name: str, overrides: tuple[str, ...], cfgs: list[DictConfig], jobs: int) -> None:
    """Measure each lab of ``cfgs`` (one per starting policy: ``name`` with ``overrides``, its model.seed and its
    name) in a ``python -m harness lab`` process of its own, ``jobs`` at a time, each on its share of the free
    cores, logged beside its folder (<results_dir>/lab/<its name>.log): in this process they would run one after
    another on one core. A lab's batches are its own, so where it runs changes none of them; a lab whose batches
    are all there only writes its report. One that fails stops the others and raises, naming its log."""
    runner = LocalLauncher()
    threads = runner.threads(min(jobs, len(cfgs)))

    def ended(job: Job, code: int, handle) -> bool:
        if code:
            raise ConfigError(f"the lab {job.key} failed (exit {code}: {last_line(job.log) or 'its log is empty'}); "
                              f"log in {job.log}")
        return False

    for cfg in cfgs:
        lab_dir(cfg).parent.mkdir(parents=True, exist_ok=True)
    print(f"claims: {len(cfgs)} labs, {jobs} at a time (logs: {lab_dir(cfgs[0]).parent}/<lab>.log)", file=sys.stderr)
    run_each([Job(cfg.name, ["lab", name, *overrides, f"model.seed={cfg.model.seed}", f"name={cfg.name}",
                             "--no-progress", "--threads", str(threads)],
                  lab_dir(cfg).parent / f"{cfg.name}.log", f"lab-{cfg.name}") for cfg in cfgs], runner, jobs, ended)


def probe_settings(overrides: tuple[str, ...]) -> tuple[dict, Path]:
    """A probe's ``key=value`` overrides (YAML values; ``results_dir`` where its table is kept): the UpdateProbe
    fields, checked, and the results folder."""
    settings = {}
    for override in overrides:
        key, is_set, value = override.partition("=")
        try:
            settings[key.strip()] = yaml.safe_load(value) if is_set else None
        except yaml.YAMLError as e:
            raise ConfigError(f"probe moe_update's override {override!r}: {yaml_problem(e)}") from None
        if not is_set or not key.strip():
            raise ConfigError(f"probe moe_update's override {override!r} is not key=value, e.g. depths=[2, 4]")
    results_dir = Path(settings.pop("results_dir", "results"))
    fields = {f.name for f in dataclasses.fields(UpdateProbe)}
    if set(settings) - fields:
        raise ConfigError(f"probe moe_update has no setting {', '.join(sorted(set(settings) - fields))}; settings: "
                          f"{', '.join(sorted(fields))}")
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    try:
        UpdateProbe(**settings)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"probe moe_update: {e}") from None
    return settings, results_dir


def run_probe(overrides: tuple[str, ...], run: bool) -> dict[str, pd.DataFrame]:
    """The moe_update probe's table (harness/apps/moe_probe.py: one row per depth, seed and learning rate; the
    GRPO-form step, so objective ``grpo``), computed once per settings and kept in
    ``<results_dir>/claims/probes/moe_update-<digest of the settings>.csv``."""
    settings, results_dir = probe_settings(overrides)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=list).encode()).hexdigest()[:12]
    path = results_dir / "claims" / "probes" / f"moe_update-{digest}.csv"
    if not path.exists():
        if not run:
            return {}
        rows = volatility_by_depth(UpdateProbe(**settings), probe_task())
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, pd.DataFrame(rows).assign(objective="grpo").to_csv(index=False))
    return {"probe": pd.read_csv(path)}


def unit_values(table: pd.DataFrame, check: dict, objective: str | None) -> pd.Series:
    """The check's metric averaged per unit over the selected rows (of ``objective`` if given): indexed by (starting
    policy, batch / seed), the policy "" in a table without START_SEED; a table without units (such as
    ``sqrt_growth``) has one unit per selected row."""
    rows = selection(table, check.get("where"))
    if objective is not None:
        rows = rows[rows["objective"] == objective]
    unit = UNITS.get(check["table"])
    rows = rows.assign(_policy=rows[START_SEED].astype("string").fillna("") if START_SEED in rows else "",
                       _unit=rows[unit] if unit else range(len(rows)))
    values = rows[["_policy", "_unit", check["metric"]]].dropna(subset=[check["metric"]])
    return values.groupby(["_policy", "_unit"])[check["metric"]].mean()


def accuracy_units(table: pd.DataFrame, check: dict, objective: str | None, scores: dict | None) -> dict | None:
    """An eval accuracy of a sweep's ``final`` table (or ``eval_accuracy`` of its ``runs``: evaluations_units), per
    (starting policy, seed) with each run's per-problem scores (analysis.accuracy's units: the mean over the selected
    cells, and objectives where ``objective`` is None, of the units every one of them has), so that its interval
    counts the eval problems as a sample (module docstring); None for another metric or table, or without the
    sweep's ``scores`` (unit_values then)."""
    metric, kind = check["metric"], check["table"]
    final = kind == "final" and (metric in (START, FINAL, BEST) or metric.startswith(FINAL + "_"))
    if scores is None or not (final or kind == "runs" and metric == EVALUATIONS):
        return None
    rows = selection(table, check.get("where"))
    if objective is not None:
        rows = rows[rows["objective"] == objective]
    groups = rows.groupby(["cell_id", "objective"])  # a check of no objective: the mean over them, as unit_values'
    if final:
        return across_cells([runs_scores(group, scores, metric) for _, group in groups])
    return across_cells([evaluations_units(group, scores) for _, group in groups])


def evaluations_units(rows: pd.DataFrame, scores: dict) -> dict:
    """A cell's runs of the ``runs`` table, each its mean eval accuracy over the selected evaluations with its
    per-problem scores averaged over them (analysis.accuracy.steps_scores), as (starting policy, seed) units."""
    units = {}
    for rid, run in rows.dropna(subset=[EVALUATIONS]).groupby("run_id"):
        policy = "" if START_SEED not in run or pd.isna(run[START_SEED].iloc[0]) else str(run[START_SEED].iloc[0])
        value = float(run[EVALUATIONS].mean())
        units[policy, run["seed"].iloc[0]] = (policy, value, steps_scores(scores.get(rid), run["step"], value))
    return units


def selected(table: pd.DataFrame, check: dict, objective: str | None, scores: dict | None) -> pd.Series | dict:
    """The check's units: accuracy_units' where it applies, else unit_values'."""
    units = accuracy_units(table, check, objective, scores)
    return unit_values(table, check, objective) if units is None else units


def as_series(values: pd.Series | dict) -> pd.Series:
    """Units as unit_values' Series (index: starting policy, unit), from accuracy units their runs' values."""
    if isinstance(values, pd.Series):
        return values
    index = pd.MultiIndex.from_tuples(list(values), names=["_policy", "_unit"]) if values else None
    return pd.Series([value for _, value, _ in values.values()], index=index, dtype=float)


def scaled(values: pd.Series | dict, log: bool) -> pd.Series | dict:
    """Units on a compare's scale: as they are, or (``log``) the logs of their values, which must be positive (a
    ValueError: the check cannot be evaluated)."""
    if not log:
        return values
    values = as_series(values)
    if (values <= 0).any():
        raise ValueError("compare.scale log needs a positive metric: some unit's value is <= 0")
    return np.log(values)


def minus(x: pd.Series | dict, y: pd.Series | dict, factor: float = 1.0, sign: int = 1) -> pd.Series | dict:
    """sign x (x - factor x y) per unit, over the units both have (accuracy units: per run and eval problem)."""
    if isinstance(x, dict):
        return {key: (policy, sign * value, None if scores is None else sign * scores)
                for key, (policy, value, scores) in paired_units(x, y, factor).items()}
    common = x.index.intersection(y.index)
    return sign * (x[common] - factor * y[common])


def beyond_roundoff(difference: pd.Series | dict, x: pd.Series | dict, y: pd.Series | dict, factor: float = 1.0
                    ) -> pd.Series | dict:
    """A compare's per-unit differences, all set to 0 where every one of them is float32 round-off (within ROUNDOFF
    of the larger side of its own unit): two quantities equal but for their last bits (R3 and R2 in fp32) differ by a
    few ulps of one sign on every unit, whose zero-width interval would hold a strict inequality. Each unit against
    its own sides, not the largest of all units: one unit far larger than the rest would make every other unit's
    real difference look like round-off. Accuracy units (analysis/accuracy.py already gives seeds alike no interval)
    are returned as they are."""
    if isinstance(difference, dict) or not len(difference):
        return difference
    index = difference.index
    scale = np.maximum(np.abs(x[index]), np.abs(factor * y[index]))
    return difference * 0.0 if bool((difference.abs() <= ROUNDOFF * scale).all()) else difference


def replication(values: pd.Series, table: str) -> tuple[int, int, str]:
    """(starting policies, the fewest units of one of them, the units' name) of unit_values' result."""
    per = values.groupby(level=0).size()
    name = {"batch": "batches", "seed": "seeds"}.get(UNITS.get(table), "rows")
    return (len(per), int(per.min()) if len(per) else 0, name)


def interval(values: pd.Series | dict, bounds: tuple[float, float] = ACCURACY_RANGE) -> tuple[float, float, float]:
    """(estimate, 95% interval) of the mean of unit values: analysis.stats.describe's, over the starting policies'
    means with several (the estimate their mean, the interval's centre); with one, its t-interval over the units,
    none (NaN) from fewer than CI_MIN_SEEDS units (describe's range of 2 is no 95% interval). Accuracy units take
    analysis.accuracy.interval_of's, by starting policy, seed and eval problem (over the first two where a run lacks
    its per-problem scores; then none from fewer than CI_MIN_SEEDS units, where interval_of gives the range), with
    ``bounds`` the quantity's range (:func:`accuracy_range`), which bounds values alike on every problem, as in the
    report."""
    if isinstance(values, dict):
        e = interval_of(values, bounds)
        policies = len({policy for policy, _, _ in values.values()})
        few = e.n < CI_MIN_SEEDS and (policies < 2 or not e.problems)  # interval_of's range of 2 runs: no 95%
        return e.mean, np.nan if few else e.low, np.nan if few else e.high
    d = describe(values.to_numpy(), values.index.get_level_values(0))
    if d["policies"] < 2 and d["n"] < CI_MIN_SEEDS:
        return d["mean"], np.nan, np.nan
    return d["mean"], d["ci_low"], d["ci_high"]


def accuracy_range(factor: float = 1.0, baseline: bool = False, sign: int = 1) -> tuple[float, float]:
    """The range of sign x (x - factor x y) for two eval accuracies x and y (each in [0, 1], or with a ``baseline``
    each a change from its baseline rows, in [-1, 1])."""
    low, high = (-1.0, 1.0) if baseline else ACCURACY_RANGE
    low, high = low - factor * high, high - factor * low
    return (low, high) if sign > 0 else (-high, -low)


def resolution(values: pd.Series | dict, metric: str) -> str:
    """Whether the interval of accuracy units counts the eval problems as a sample (they are resolved by problem),
    and if not why, said as a clause of the measured text; "" for unit_values'. A best eval accuracy's scores are
    those of each run's best evaluation, chosen on the same problems: its interval takes that choice as given, so it
    leans upward, and says so."""
    if not isinstance(values, dict) or not values:
        return ""
    if interval_of(values).problems:
        return "; its interval counts the eval problems too" + (
            ", each run's best evaluation, chosen on them, taken as given: optimistic" if metric == BEST else "")
    why = ("no per-problem scores for some run" if any(s is None for _, _, s in values.values())
           else "the runs' per-problem scores are not on the same eval problems")
    return f"; its interval does not count the eval problems ({why})"


def verdict_of(lo: float, hi: float, low: float, high: float) -> str:
    """A check's verdict from the 95% interval [lo, hi] of its quantity, claimed to lie in [low, high]: "holds" if
    the interval lies inside, "does not hold" if it lies wholly outside, else (or with no interval) "not resolved"."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return NOT_RESOLVED
    if low <= lo and hi <= high:
        return "holds"
    return "does not hold" if hi < low or lo > high else NOT_RESOLVED


def narrowed(check: dict, where: str | None) -> dict:
    """``check`` with ``where`` and-ed to its own selection."""
    both = [w for w in (check.get("where"), where) if w]
    return {**check, "where": " and ".join(f"({w})" for w in both)} if both else check


def evaluate_within(check: dict, tables: dict) -> tuple[str, str, tuple | None]:
    """evaluate_check's ``within`` check."""
    table, metric, (low, high) = tables[check["table"]], check["metric"], check["within"]
    expected = f"in [{low}, {high}]" if None not in (low, high) else f">= {low}" if high is None else f"<= {high}"
    low, high = -np.inf if low is None else low, np.inf if high is None else high  # an open side
    statistic = check.get("statistic", "mean")
    values = selected(table, check, check.get("objective"), tables.get(SCORES)) if statistic == "mean" else \
        unit_values(table, check, check.get("objective"))
    if not len(values):
        return "no data", f"{metric}: nothing selected", None
    if statistic == "mean":  # an estimate: its interval decides
        value, lo, hi = interval(values)
        verdict = verdict_of(lo, hi, low, high)
    else:  # min or max: a statement about the units observed, no interval
        value, lo, hi = float(STATISTICS[statistic](values.to_numpy())), np.nan, np.nan
        verdict = "holds" if low <= value <= high else "does not hold"
    who = f"{check['objective']} " if check.get("objective") else ""
    shown = f" [{num(lo)}, {num(hi)}]" if np.isfinite(lo) else " (no interval)" if statistic == "mean" else ""
    measured = (f"{who}{metric} {statistic} {num(value)}{shown} (n={len(values)}{resolution(values, metric)}; "
                f"expected {expected})")
    return verdict, measured, replication(as_series(values), check["table"])


def evaluate_check(check: dict, tables: dict) -> tuple[str, str, tuple | None]:
    """(verdict, what was measured, replication: starting policies, the fewest units per policy, their name) of one
    check (``tables``: the experiment's, by name, and a sweep's SCORES)."""
    if "within" in check:
        return evaluate_within(check, tables)
    table, metric, scores, spec = tables[check["table"]], check["metric"], tables.get(SCORES), check["compare"]
    if spec.get("direction") == "equal":  # the units' own values, compared unit by unit
        scores = None
    a, b = spec["objective"], spec["than"]
    log = spec.get("scale") == "log"

    def side(where: str | None, objective: str) -> pd.Series | dict:  # the units of one side, on the check's scale
        return scaled(selected(table, {**check, "where": where}, objective, None if log else scores), log)

    x, y = (side(narrowed(check, spec.get(key)).get("where"), name) for key, name in (("where", a), ("than_where", b)))
    if spec.get("baseline"):  # each side's change from its own baseline rows, per unit (on a log scale, their ratio)
        x, y = minus(x, side(spec["baseline"], a)), minus(y, side(spec["baseline"], b))
    metric = f"log {metric}" if log else metric
    a, b = (f"{name} [{spec[key]}]" if spec.get(key) else name for name, key in ((a, "where"), (b, "than_where")))
    if spec.get("baseline"):
        a, b = (f"{name} minus [{spec['baseline']}]" for name in (a, b))
    common = as_series(x).index.intersection(as_series(y).index)
    if not len(common):
        return "no data", f"{metric}: nothing selected for {a} and {b}", None
    x, y = ({k: v[k] for k in common} if isinstance(v, dict) else v[common] for v in (x, y))
    units = replication(as_series(x), check["table"])
    over = f"{units[0]} starting policies x {units[1]}+ {units[2]}" if units[0] > 1 else f"{len(x)} {units[2]}"
    numbers = f"{a} {num(interval(x)[0])}, {b} {num(interval(y)[0])} ({metric}, mean over {over}"
    direction, factor = spec.get("direction", "greater"), spec.get("factor", 1.0)
    if direction == "equal":
        gap = float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-12))
        tolerance = spec.get("tolerance", 1e-6)
        return ("holds" if gap <= tolerance else "does not hold"), f"{numbers}); max relative gap {gap:.1e}", units
    if direction == "equivalent":
        difference = beyond_roundoff(minus(x, y), x, y)
        value, lo, hi = interval(difference, accuracy_range(baseline=bool(spec.get("baseline"))))
        margin = spec["margin"]
        measured = (f"{numbers}{resolution(difference, metric)}); {a} - {b}: {num(value)} [{num(lo)}, {num(hi)}], "
                    f"equivalence margin +-{margin:g}")
        return verdict_of(lo, hi, -margin, margin), measured, units
    sign = 1 if direction == "greater" else -1
    # on a log scale "x > factor y" is log x - log y > log factor, not log x > factor log y
    shifted, multiplier = (x - np.log(factor), 1.0) if log else (x, factor)
    difference = beyond_roundoff(minus(shifted, y, multiplier, sign), shifted, y, multiplier)
    value, lo, hi = interval(difference, accuracy_range(multiplier, bool(spec.get("baseline")), sign))
    relation = f"{'>' if sign > 0 else '<'} {factor:g} x" if factor != 1 else (">" if sign > 0 else "<")
    # "holds": the interval above 0 (the margin a strict inequality needs); "does not hold": wholly at or below it
    verdict = NOT_RESOLVED if not np.isfinite(lo) else "holds" if lo > 0 else "does not hold" if hi <= 0 \
        else NOT_RESOLVED
    return verdict, (f"{numbers}{resolution(difference, metric)}); {a} {relation} {b}: margin {num(value)} "
                     f"[{num(lo)}, {num(hi)}]"), units


def checked(check: dict, tables: dict[str, pd.DataFrame]) -> tuple[str, str, tuple | None]:
    """evaluate_check, with a check that cannot be evaluated (a bad ``where``, an unknown metric) reported in the
    ledger as such instead of stopping it after the experiments have run."""
    if check["table"] not in tables:
        return "no data", f"{check['metric']}: the experiment has no results (`make claims` runs it)", None
    metric, columns = check["metric"], tables[check["table"]].columns
    if metric not in columns:  # a misspelt name: said as such, not as a pandas KeyError, after the runs it waited for
        close = difflib.get_close_matches(metric, [c for c in columns if not str(c).startswith("_")], n=1)
        return "no data", (f"{metric}: no {check['table']} row of the experiment has this metric"
                           f"{f' (nearest: {close[0]})' if close else ''}; its runs are kept: correct the claim file "
                           "and check it on them (`python -m harness claims NAME --existing` starts no run)"), None
    try:
        return evaluate_check(check, tables)
    except pd.errors.UndefinedVariableError as e:  # pandas names a backticked column BACKTICK_QUOTED_STRING_a_DOT_b
        name = re.sub(r"^BACKTICK_QUOTED_STRING_(.*)$", r"\1", str(e).split("'")[1] if "'" in str(e) else str(e))
        name = name.replace("_DOT_", ".")
        why = ("a swept key is a column only where the runs there take two values of it (those that exist may all "
               "have one so far)") if "." in name else \
            f"its columns: {', '.join(map(str, tables[check['table']].columns))}"
        return "no data", f"{metric}: no column {name!r} in the {check['table']} table for a where of {check}: {why}", \
            None
    except (KeyError, TypeError, ValueError, SyntaxError) as e:
        return "no data", f"check {check} could not be evaluated: {type(e).__name__}: {e}", None


def model_of(claim: Claim) -> str:
    """The model and task the claim's experiment trains ("tiny on arith")."""
    kind, name, overrides = claim.source
    if kind == "probe":
        return "tiny_moe (the moe_update probe, harness/apps/moe_probe.py)"
    cfg = load_experiment(name, list(overrides))
    model = cfg.lab.policy if kind == "lab" and cfg.lab.policy is not None else cfg.model.name
    return f"{model} on {cfg.task.name}"


def design_text(units: list[tuple]) -> tuple[str, bool]:
    """The replication of a claim's checks (the fewest starting policies of any check, and the fewest units per
    policy of any check) and whether every check meets DESIGN."""
    if not units:
        return "none", False
    policies = min(p for p, _, _ in units)
    _, per, name = min(units, key=lambda u: u[1])
    return (f"{policies} starting polic{'y' if policies == 1 else 'ies'} x {per} {name}", all(map(meets_design, units)))


def meets_design(units: tuple | None) -> bool:
    """Whether a check's replication (starting policies, the fewest units per policy, their name) meets DESIGN."""
    return units is not None and units[0] >= DESIGN[0] and units[1] >= DESIGN[1]


def correction_text(checks: int) -> str:
    """A row's correction: none across claims; within the claim, "holds" needs every check (no adjustment), while
    "does not hold" follows from any one check whose interval lies wholly on the other side of its bound, each such
    test one-sided at 2.5%, so that a claim of ``checks`` true checks is said not to hold up to ``checks`` x 2.5% of
    the time (a union of tests, not adjusted: said so)."""
    text = f"{CORRECTION}; {checks} check{'s' * (checks > 1)}"
    if checks > 1:
        text += (f"; 'does not hold' rests on any one of them (each one-sided at 2.5%, unadjusted: up to "
                 f"{2.5 * checks:g}% for a true claim)")
    return text


def ledger_rows(claims: list[Claim], tables_of: dict, unread: dict | None = None) -> list[dict]:
    """One row per claim from its experiment's tables (``tables_of`` by Claim.key); a key in ``unread`` (why its runs
    could not be read) gives "no data" with that reason."""
    rows = []
    for claim in claims:
        reason = (unread or {}).get(claim.key)
        results = ([("no data", f"not read: {reason}", None)] if reason else
                   [checked(c, tables_of[claim.key]) for c in claim.checks])
        verdicts = [v for v, _, _ in results]
        text, confirmed = design_text([u for _, _, u in results if u is not None])
        # a refutation by any one check suffices (the union rule), whatever another found nothing to measure
        verdict = next((v for v in ("does not hold", "no data", NOT_RESOLVED) if v in verdicts),
                       "holds" if confirmed else "indicative")
        if verdict == "does not hold" and not any(meets_design(u) for v, _, u in results if v == verdict):
            verdict = REFUTED_INDICATIVE  # the intervals that refute it fall short of 95% as those of a claim held
        rows.append({"claim": claim.claim, "paper": claim.paper, "reported": claim.reported,
                     "measured": "; ".join(m for _, m, _ in results), "holds?": verdict, "replication": text,
                     "model": model_of(claim), "correction": correction_text(len(claim.checks)),
                     "experiment": f"{claim.source[0]} {claim.source[1]}", "name": claim.name,
                     "notes": " ".join(claim.notes)})
    return rows


def write_ledger(rows: list[dict], out: Path, stamp: str) -> Path:
    """ledger.csv, ledger.md and ledger.html, each written whole then renamed into place."""
    out.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    shown = frame[["claim", "paper", "reported", "measured", "holds?", "replication", "model", "correction"]]
    notes = [f"- {r['name']}: {r['notes']}" for r in rows if r["notes"]]
    stamp = stamp + ("\n\nNotes:\n" + "\n".join(notes) if notes else "")
    files = {"ledger.csv": frame.to_csv(index=False),
             "ledger.md": f"# Paper-claims ledger\n\n{stamp}\n\n{md_table(shown)}\n",
             "ledger.html": ("<!doctype html><html><head><meta charset='utf-8'><title>Paper-claims ledger</title>"
                             "<style>body{font-family:sans-serif;max-width:1200px;margin:auto}td,th{border:1px solid"
                             " #ccc;padding:3px 6px}table{border-collapse:collapse;font-size:0.85em}</style></head>"
                             f"<body><h1>Paper-claims ledger</h1><p>{html.escape(stamp)}</p>"
                             f"{shown.to_html(index=False, border=0)}</body></html>\n")}
    for name, text in files.items():
        atomic_write(out / name, text)
    return out / "ledger.md"


def check_claims(claims: list[Claim], starts: dict, running: set, allow_code_change: bool) -> None:
    """Every claim's experiment settings (``starts``: its starting policies by Claim.key), and for the keys in
    ``running`` (the experiments this call runs) none of its sweep's runs to resume begun by other code (ConfigError,
    one line); each experiment once (claims with one key share it)."""
    for claim in {c.key: c for c in claims}.values():
        if claim.source[0] == "probe":
            probe_settings(claim.source[2])
            continue
        seeds = claim.design[1] if claim.source[0] == "sweep" else None  # a lab's seeds are no grid (its own seed=)
        cfg = sweep_config(claim.source[1], claim.source[2], starts[claim.key], seeds)
        if claim.source[0] == "lab":  # before the lab: a check it could never read
            validate_lab(cfg)
            for same in (c for c in claims if c.key == claim.key):
                check_compared_objectives(same, set(lab_objectives(cfg)))
        if claim.key in running and claim.source[0] == "sweep":
            runs = run_configs(cfg)
            check_runs_code(cfg, runs, allow_code_change, "claims")
            check_runs_one_version(cfg, runs, "the runs a claim reads")
            for same in (c for c in claims if c.key == claim.key):  # before the sweep: a check it could never read
                check_compared_objectives(same, {run.objective.name for run in runs})


def check_compared_objectives(claim: Claim, ran: set[str]) -> None:
    """A claim's checks compare objectives its sweep or lab runs (ConfigError naming the claim, the check's key and
    the experiment's objectives): a name it does not run would give "no data" only after the experiment."""
    for check in claim.checks:
        names = {key: check.get("compare", {}).get(key) for key in ("objective", "than")}
        for key, name in [*names.items(), ("objective", check.get("objective"))]:
            if name is not None and name not in ran:
                near = next(iter(difflib.get_close_matches(name, ran, n=1)), None)
                raise ConfigError(f"claim {claim.name}: a check's {key} {name!r} is not an objective its "
                                  f"{claim.source[0]} runs ({', '.join(sorted(ran))})"
                                  f"{f'; did you mean {near}?' if near else ''}: fix the claim file")


def ledger_claims(asked: list[Claim], names: list[str] | None, with_long: bool) -> list[Claim]:
    """The claims of the ledger: those ``asked``, and with ``names`` the rest of the claims a call without names
    takes (checked on the runs that exist), in file order, so that checking some claims again keeps the others' rows
    in results/claims/ledger.md instead of a ledger of those few."""
    if not names:
        return asked
    named = {c.name for c in asked}
    return sorted(asked + [c for c in load_claims(None, with_long) if c.name not in named], key=lambda c: c.name)


def read_tables(claims: list[Claim], starts: dict, running: set, jobs: int, progress: bool,
                allow_code_change: bool) -> tuple[dict, dict]:
    """Each experiment's tables by Claim.key (run or resumed first for the keys in ``running``), and why the runs of
    a key not run by this call could not be read (a ConfigError's line: its row says so, the ledger is still
    written)."""
    tables_of, unread = {}, {}
    for key, seeds_of_policies in starts.items():
        kind, name, overrides, _, seeds = key
        print(f"claims: {kind} {name} {' '.join(overrides)}"
              + (f" from model.seed {list(seeds_of_policies)}" if seeds_of_policies else "")
              + ("" if key in running else " (its runs as they are)"), file=sys.stderr)
        try:
            tables_of[key] = run_source(kind, name, overrides, seeds_of_policies, seeds, jobs=jobs, progress=progress,
                                        run=key in running, allow_code_change=allow_code_change)
        except ConfigError as e:
            if key in running:
                raise
            tables_of[key], unread[key] = {}, str(e)
    return tables_of, unread


def ledger_stamp(rows: list[dict], asked: list[Claim], names: list[str] | None, run: bool, seconds: float,
                 where: str = "") -> str:
    """The ledger's first sentence: how many claims hold, which ones this call ran, how long it took and ``where``
    (the machine, harness/apps/stamp.py's, and the load around the call)."""
    count = (f"{len(rows)} claims, {sum(r['holds?'] == 'holds' for r in rows)} hold under the confirmation design "
             f"(>= {DESIGN[0]} starting policies x >= {DESIGN[1]} seeds or batches each; 'indicative': every check "
             f"holds with less), {sum(r['holds?'] in ('does not hold', REFUTED_INDICATIVE) for r in rows)} do not "
             f"hold ({sum(r['holds?'] == REFUTED_INDICATIVE for r in rows)} of them indicative), "
             f"{sum(r['holds?'] == NOT_RESOLVED for r in rows)} not resolved, "
             f"{sum(r['holds?'] == 'no data' for r in rows)} no data")
    if not run:
        return (f"{count}, on the runs that existed (`python -m harness claims --existing`: no run was started; runs "
                "not done are not counted).")
    if not names:
        return (f"{count}; experiments run or resumed in {seconds:.0f} s by `make claims` (wall time of this call"
                f"{where}).")
    others = len(rows) - len(asked)
    return (f"{count}; the named claims' experiments run or resumed in {seconds:.0f} s by `python -m harness claims "
            f"{' '.join(c.name for c in asked)}` (wall time of this call{where})"
            + (f"; the other {others} claims checked on the runs that existed (runs not done are not counted)."
               if others else "."))


def main(names: list[str] | None = None, jobs: int = 2, progress: bool = True, results_dir: str = "results",
         run: bool = True, allow_code_change: bool = False, with_long: bool = False) -> int:
    """Run the experiments of the claims ``names`` (default: every claim; each experiment once, resumable; ``run``
    False: read what exists, start nothing; ``allow_code_change``: resume runs that other code began), check them
    and the other claims on their runs as they are (ledger_claims), write results/claims/ (stamped with the code and
    threads of the runs the claims were checked on)."""
    asked = load_claims(names, with_long)
    long = [c.name for c in asked if c.long]
    if long and run and not with_long:  # named, not asked for: hours of sweeps would start without a word
        raise ConfigError(f"claims {', '.join(long)}: long (SmolLM2 sweeps, hours on 2 cores); add --with-long to run "
                          "them, or --existing to check the runs that exist")
    claims = ledger_claims(asked, names, with_long)
    running = {c.key for c in asked} if run else set()
    # the starting policies a former call found (its start_policies.json), else the first candidates (none missed)
    likely = {c.key: start_seeds(c.key, jobs, progress, run=False) for c in claims}
    check_claims(claims, likely, running, allow_code_change)  # before anything is built or run
    start, load_before = time.time(), os.getloadavg()[0]
    starts = {key: start_seeds(key, jobs, progress, key in running) for key in likely}
    if starts != likely:  # a candidate missed its band: the runs of its replacement too
        check_claims(claims, starts, running, allow_code_change)
    tables_of, unread = read_tables(claims, starts, running, jobs, progress, allow_code_change)
    rows = ledger_rows(claims, tables_of, unread)
    checked_on = list({(r["folder"], r["run_id"]): r for tables in tables_of.values() if "final" in tables
                       for r in tables["final"].to_dict("records")}.values())  # a run two claims read: counted once
    # (a run id names a run within its folder: two experiments' runs can share one)
    where = f" on {machine(jobs)}; 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    stamp = (f"{ledger_stamp(rows, asked, names, run, time.time() - start, where)} Verdicts checked by code "
             f"`{code_record()['version']}`. {runs_stamp(checked_on)}")
    stamp += labs_stamp(tables_of)
    path = write_ledger(rows, Path(results_dir) / CLAIMS_RUNS, stamp)
    verdicts = {r["name"]: r["holds?"] for r in rows}
    print("\n".join([stamp, *(f"{c.name}: {verdicts[c.name]}" for c in asked if names)]) + f"\nledger: {path}",
          file=sys.stderr)
    return 0
