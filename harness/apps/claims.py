"""The paper-claims ledger: one YAML per claim in experiments/claims/, run and checked by `make claims`.

    python -m harness claims [NAME ...] [--existing]   # -> results/claims/ledger.md, ledger.html, ledger.csv

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
collapse record names a cause, else 0), the swept keys as columns, e.g. ```train.num_minibatches` == 16``). ``where``
is a pandas query on the table. A check's *units* are the lab's batches or the sweep's seeds: the metric is averaged
over the selected rows of each unit first (a table without units, such as ``sqrt_growth``, has one unit per row), so
a sweep's comparison is paired by seed, as analysis/paired.py's (runs of one seed share their first rollouts).

- ``compare``: per unit, x = metric of ``objective``, y = metric of ``than`` (paired by unit; the compare's own
  ``where`` / ``than_where`` narrow x's / y's rows further, e.g. two cells of one objective; ``baseline``, a query
  of its own, makes x and y each one's change from its value on those rows, per unit: "degrades less with lag" is
  the change from lag 0 compared). ``greater`` holds if
  mean(x) > factor * mean(y) and the percentile bootstrap interval of mean(x - factor * y) lies above 0; ``less``
  mirrors it; ``equal`` holds if max |x - y| <= tolerance * max(|y|, tiny) over units; ``equivalent`` holds if the
  bootstrap interval of mean(x - y) lies inside [-margin, margin] (an equivalence test: "matches" needs an interval
  that excludes every difference larger than the margin, not an interval that happens to include 0).
- ``within: [low, high]``: the ``statistic`` (mean by default, or min, max) over units of the metric, for
  ``objective`` when given, lies in [low, high].
The ledger says "holds", "does not hold" (with the numbers) or "no data" (a check found nothing to measure).
Experiments are resumable (labs per batch, sweeps per run), so `make claims` continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from analysis.lab import build_lab_report
from analysis.load import AnalysisError
from analysis.load import load_experiment as load_results
from analysis.report import md_table
from analysis.stats import bootstrap_ci, num
from harness.apps.lab import lab_dir, run_lab
from harness.apps.moe_probe import UpdateProbe, probe_task, volatility_by_depth
from harness.apps.sweep import check_runs_code, run_sweep
from harness.run.atomic import atomic_write
from harness.run.config import EXPERIMENTS_DIR, load_experiment, run_configs
from harness.run.errors import ConfigError
from harness.run.provenance import runs_stamp

CLAIMS_DIR = EXPERIMENTS_DIR / "claims"
UNITS = {"lab": "batch", "pairwise": "batch", "runs": "seed", "final": "seed", "probe": "seed"}
TABLES = {"lab": ("lab", "pairwise", "snr", "sqrt_growth"), "sweep": ("runs", "final"),  # each experiment kind's
          "probe": ("probe",)}
KINDS = ("lab", "sweep", "probe")
PROBES = ("moe_update",)  # {probe: moe_update}: harness/apps/moe_probe.py's one-update routing change by depth
DIRECTIONS = ("greater", "less", "equal", "equivalent")
STATISTICS = {"mean": np.mean, "min": np.min, "max": np.max}


@dataclass
class Claim:
    name: str
    claim: str
    paper: str
    experiment: dict[str, Any]
    checks: list[dict[str, Any]]
    reported: str = ""
    notes: list[str] = field(default_factory=list)
    long: bool = False  # hours of SmolLM2 sweeps: run when named or with --with-long, not by a bare `make claims`

    @property
    def source(self) -> tuple[str, str, tuple[str, ...]]:
        kind = next(k for k in KINDS if k in self.experiment)
        return kind, self.experiment[kind], tuple(self.experiment.get("overrides", []))


def load_claim(path: Path) -> Claim:
    """A claim file, checked: one line naming the file and the problem."""
    try:
        data = yaml.safe_load(path.read_text())
        claim = Claim(name=path.stem, **data)
    except (yaml.YAMLError, TypeError) as e:
        raise ConfigError(f"{path}: not a claim ({e}); see harness/apps/claims.py for the fields") from None
    if sum(k in claim.experiment for k in KINDS) != 1:
        raise ConfigError(f"{path}: experiment must name one lab, one sweep or one probe, e.g. {{lab: lab}}")
    if "probe" in claim.experiment and claim.experiment["probe"] not in PROBES:
        raise ConfigError(f"{path}: no probe {claim.experiment['probe']!r}; probes: {', '.join(PROBES)}")
    for check in claim.checks:
        if ("compare" in check) == ("within" in check) or "table" not in check or "metric" not in check:
            raise ConfigError(f"{path}: each check needs table, metric and one of compare / within, got {check}")
        if "compare" in check and check["compare"].get("direction", "greater") not in DIRECTIONS:
            raise ConfigError(f"{path}: compare.direction must be one of {', '.join(DIRECTIONS)}")
        if "compare" in check and (check["compare"].get("direction") == "equivalent") != ("margin" in check["compare"]):
            raise ConfigError(f"{path}: compare.margin is the equivalence margin: give it with direction equivalent "
                              "(only)")
        if check["table"] not in TABLES[claim.source[0]]:
            raise ConfigError(f"{path}: a {claim.source[0]} has no table {check['table']!r}; tables: "
                              f"{', '.join(TABLES[claim.source[0]])}")
        if check.get("statistic", "mean") not in STATISTICS:
            raise ConfigError(f"{path}: statistic must be one of {', '.join(STATISTICS)}")
    return claim


def load_claims(names: list[str] | None = None, with_long: bool = False) -> list[Claim]:
    """The claims ``names`` (default: every claim, the ``long`` ones only ``with_long``)."""
    paths = sorted(CLAIMS_DIR.glob("*.yaml"))
    if names:
        known = {p.stem: p for p in paths}
        missing = [n for n in names if n not in known]
        if missing:
            raise ConfigError(f"no claim {', '.join(missing)} in {CLAIMS_DIR}; claims: {', '.join(known)}")
        return [load_claim(known[n]) for n in names]
    return [c for c in map(load_claim, paths) if with_long or not c.long]


def claim_model(claim: Claim) -> str:
    """The model the claim is measured on: its experiment's ``model.name`` (a probe's: tiny_moe)."""
    kind, name, overrides = claim.source
    return "tiny_moe" if kind == "probe" else load_experiment(name, list(overrides)).model.name


def run_source(kind: str, name: str, overrides: tuple[str, ...], jobs: int, progress: bool,
               run: bool = True, allow_code_change: bool = False) -> dict[str, pd.DataFrame]:
    """Run (or resume; with ``run`` False: only read) the claim's experiment (``allow_code_change``: its runs that
    other code began too); its tables by name (none when there is nothing to read: its checks say "no data")."""
    if kind == "probe":
        return run_probe(overrides, run)
    cfg = load_experiment(name, list(overrides))
    if kind == "lab":
        folder = run_lab(cfg, progress) if run else lab_dir(cfg)
        if not (folder / "batches").is_dir():
            return {}
        build_lab_report(folder)
        return {t: pd.read_csv(folder / f"{t}.csv") for t in ("lab", "pairwise", "snr", "sqrt_growth")}
    if run:
        run_sweep(cfg, jobs=jobs, progress=progress, allow_code_change=allow_code_change, command="claims")
    try:
        exp = load_results(Path(cfg.results_dir) / cfg.name)
    except AnalysisError:
        return {}
    final = exp.runs[exp.runs["counted"] & exp.runs["ended"]]
    return {"runs": exp.metrics, "final": final.assign(collapsed=final["collapse_cause"].notna().astype(float))}


def probe_settings(overrides: tuple[str, ...]) -> tuple[dict, Path]:
    """A probe's ``key=value`` overrides (YAML values; ``results_dir`` where its table is kept): the UpdateProbe
    fields, checked, and the results folder."""
    settings = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in overrides)}
    results_dir = Path(settings.pop("results_dir", "results"))
    fields = {f.name for f in dataclasses.fields(UpdateProbe)}
    if set(settings) - fields:
        raise ConfigError(f"probe moe_update has no setting {', '.join(sorted(set(settings) - fields))}; settings: "
                          f"{', '.join(sorted(fields))}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}, results_dir


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
    """The check's metric averaged per unit (batch / seed) over the selected rows (of ``objective`` if given)."""
    rows = table.query(check["where"]) if check.get("where") else table
    if objective is not None:
        rows = rows[rows["objective"] == objective]
    unit = UNITS.get(check["table"])
    values = rows[[unit, check["metric"]]].dropna() if unit else rows[[check["metric"]]].dropna()
    return values.groupby(unit)[check["metric"]].mean() if unit else values[check["metric"]].reset_index(drop=True)


def narrowed(check: dict, where: str | None) -> dict:
    """``check`` with ``where`` and-ed to its own selection."""
    both = [w for w in (check.get("where"), where) if w]
    return {**check, "where": " and ".join(f"({w})" for w in both)} if both else check


def evaluate_check(check: dict, tables: dict[str, pd.DataFrame]) -> tuple[str, str]:
    """(verdict, what was measured) of one check."""
    table = tables[check["table"]]
    metric = check["metric"]
    if "within" in check:
        low, high = check["within"]
        values = unit_values(table, check, check.get("objective"))
        if values.empty:
            return "no data", f"{metric}: nothing selected"
        statistic = check.get("statistic", "mean")
        value = float(STATISTICS[statistic](values.to_numpy()))
        lo, hi = bootstrap_ci(values.to_numpy()) if statistic == "mean" else (np.nan, np.nan)
        who = f"{check['objective']} " if check.get("objective") else ""
        interval = f" [{num(lo)}, {num(hi)}]" if np.isfinite(lo) else ""
        measured = f"{who}{metric} {statistic} {num(value)}{interval} (n={len(values)}; expected in [{low}, {high}])"
        return ("holds" if low <= value <= high else "does not hold"), measured
    spec = check["compare"]
    a, b = spec["objective"], spec["than"]
    x, y = unit_values(table, narrowed(check, spec.get("where")), a), \
        unit_values(table, narrowed(check, spec.get("than_where")), b)
    if spec.get("baseline"):  # each side's change from its own baseline rows, per unit
        x = (x - unit_values(table, {**check, "where": spec["baseline"]}, a)).dropna()
        y = (y - unit_values(table, {**check, "where": spec["baseline"]}, b)).dropna()
    a, b = (f"{name} [{spec[key]}]" if spec.get(key) else name for name, key in ((a, "where"), (b, "than_where")))
    if spec.get("baseline"):
        a, b = (f"{name} minus [{spec['baseline']}]" for name in (a, b))
    common = x.index.intersection(y.index)
    if not len(common):
        return "no data", f"{metric}: nothing selected for {a} and {b}"
    x, y = x[common].to_numpy(), y[common].to_numpy()
    direction, factor = spec.get("direction", "greater"), spec.get("factor", 1.0)
    numbers = f"{a} {num(x.mean())}, {b} {num(y.mean())} ({metric}, mean over {len(x)} {UNITS[check['table']]}es)"
    numbers = numbers.replace("seedes", "seeds")
    if direction == "equal":
        gap = float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-12))
        tolerance = spec.get("tolerance", 1e-6)
        return ("holds" if gap <= tolerance else "does not hold"), f"{numbers}; max relative gap {gap:.1e}"
    if direction == "equivalent":
        lo, hi = bootstrap_ci(x - y)
        margin = spec["margin"]
        holds = np.isfinite(lo) and -margin <= lo and hi <= margin
        return ("holds" if holds else "does not hold"), (f"{numbers}; {a} - {b}: {num((x - y).mean())} "
                                                         f"[{num(lo)}, {num(hi)}], equivalence margin +-{margin:g}")
    sign = 1 if direction == "greater" else -1
    difference = sign * (x - factor * y)
    lo, hi = bootstrap_ci(difference)
    holds = difference.mean() > 0 and (np.isfinite(lo) and lo > 0)
    relation = f"{'>' if sign > 0 else '<'} {factor:g} x" if factor != 1 else (">" if sign > 0 else "<")
    return ("holds" if holds else "does not hold"), (f"{numbers}; {a} {relation} {b}: margin {num(difference.mean())}"
                                                     f" [{num(lo)}, {num(hi)}]")


def checked(check: dict, tables: dict[str, pd.DataFrame]) -> tuple[str, str]:
    """evaluate_check, with a check that cannot be evaluated (a bad ``where``, an unknown metric) reported in the
    ledger as such instead of stopping it after the experiments have run."""
    if check["table"] not in tables:
        return "no data", f"{check['metric']}: the experiment has no results (`make claims` runs it)"
    try:
        return evaluate_check(check, tables)
    except (KeyError, ValueError, SyntaxError, pd.errors.UndefinedVariableError) as e:
        return "no data", f"check {check} could not be evaluated: {type(e).__name__}: {e}"


def ledger_rows(claims: list[Claim], tables_of: dict) -> list[dict]:
    rows = []
    for claim in claims:
        results = [checked(c, tables_of[claim.source]) for c in claim.checks]
        verdicts = [v for v, _ in results]
        verdict = ("no data" if "no data" in verdicts else "holds" if all(v == "holds" for v in verdicts)
                   else "does not hold")
        rows.append({"claim": claim.claim, "paper": claim.paper, "model": claim_model(claim),
                     "reported": claim.reported, "measured": "; ".join(m for _, m in results), "holds?": verdict,
                     "experiment": f"{claim.source[0]} {claim.source[1]}", "name": claim.name,
                     "notes": " ".join(claim.notes)})
    return rows


def write_ledger(rows: list[dict], out: Path, stamp: str) -> Path:
    """ledger.csv, ledger.md and ledger.html, each written whole then renamed into place."""
    out.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    shown = frame[["claim", "paper", "model", "reported", "measured", "holds?"]]
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


def main(names: list[str] | None = None, jobs: int = 2, progress: bool = True, results_dir: str = "results",
         run: bool = True, allow_code_change: bool = False, with_long: bool = False) -> int:
    """Run every claim's experiment (each once, resumable; ``run`` False: read what exists, start nothing;
    ``allow_code_change``: resume runs that other code began), check the claims, write results/claims/ (stamped with
    the code and threads of the runs the claims were checked on)."""
    claims = load_claims(names, with_long)
    for claim in claims:  # every experiment is checked before the first one runs
        if claim.source[0] == "probe":
            probe_settings(claim.source[2])
        else:
            cfg = load_experiment(claim.source[1], list(claim.source[2]))
            if run and claim.source[0] == "sweep":  # a run other code began: refused before any experiment runs
                check_runs_code(cfg, run_configs(cfg), allow_code_change, "claims")
    start = time.time()
    tables_of = {}
    for source in dict.fromkeys(c.source for c in claims):
        print(f"claims: {source[0]} {source[1]} {' '.join(source[2])}", file=sys.stderr)
        tables_of[source] = run_source(*source, jobs=jobs, progress=progress, run=run,
                                       allow_code_change=allow_code_change)
    rows = ledger_rows(claims, tables_of)
    checked_on = [r for tables in tables_of.values() if "final" in tables for r in tables["final"].to_dict("records")]
    stamp = (f"{len(rows)} claims, {sum(r['holds?'] == 'holds' for r in rows)} hold; experiments run or resumed in "
             f"{time.time() - start:.0f} s by `make claims` (wall time of this call)." if run else
             f"{len(rows)} claims, {sum(r['holds?'] == 'holds' for r in rows)} hold, on the runs that existed "
             "(`python -m harness claims --existing`: no run was started; runs not done are not counted).")
    stamp += f" {runs_stamp(checked_on)}"
    path = write_ledger(rows, Path(results_dir) / "claims", stamp)
    print(f"{stamp}\nledger: {path}", file=sys.stderr)
    return 0
