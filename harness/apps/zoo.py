"""`make zoo`: every registered objective through the shipped stress regimes on the tiny model, then the leaderboard.

    python -m harness zoo [--seeds N] [--jobs N] [--target ACC] [--objectives a,b] [--no-report] [key=value ...]
        -> results/zoo/<run_id>/ (resumable, as any sweep), results/zoo/leaderboard.md, .html, .csv
           and results/zoo/report/ (the per-cell report: axis figures, heat map, paired tables)

The objectives are the registry's (``objectives.available_objectives()``), so an objective registered there is in the
next zoo without a change here. The cells are CELLS: each shipped regime experiment (experiments/<name>.yaml, listed in
docs/running.md) at the axis values listed, crossed with every objective and ``--seeds`` seeds; all runs go
into one folder under the experiment name ``zoo``, so a cell two regimes share (e.g. quickstart's settings, were both
to list it) is one set of runs (run ids are the settings' hash). Overrides apply to every run (e.g. ``train.steps=2``
for a smoke test).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from analysis.leaderboard import write_leaderboard
from analysis.report import build_report
from harness.apps.stamp import machine
from harness.apps.sweep import run_sweep
from harness.run.config import load_experiment, run_configs, run_id
from harness.run.errors import ConfigError
from harness.run.records import ENDED
from objectives import available_objectives

# regime experiment -> the values of its axis the zoo runs (the experiment's own values for keys not listed): the
# stress end of each regime (quickstart's own cell, where the core objectives tie, is `make sweep`'s). docs/zoo_guide.md
# says what was explored, what each regime showed and how the budget is computed.
CELLS: dict[str, dict[str, list]] = {
    "offpolicy": {"train.num_minibatches": [16]},  # 16 optimizer steps per rollout batch (quickstart: 4)
    "step_size": {"train.lr": [1.5e-4]},  # 3x quickstart's learning rate (at 10x every core objective collapses)
    # every batch sampled 16 policy versions back, each objective on the stale behaviour log-probs (no correction)
    "async_staleness": {"train.rollout_lag": [16], "train.rollout_correction": [{"mode": "none"}]},
}
SEEDS = 3
TARGET = 0.40  # eval accuracy for "tokens to target": about 0.1 above quickstart's starting policy (0.30-0.45 band)
NAME = "zoo"


def zoo_runs(seeds: int, overrides: list[str], objectives: list[str] | None = None
             ) -> tuple[DictConfig, list[DictConfig]]:
    """The zoo's folder config (``name=zoo``; its grid names every swept key, for the manifest) and its runs: every
    cell of CELLS x ``objectives`` (None: every registered one) x seeds 0 .. seeds-1, each run once (by run id). An
    empty list or name (``--objectives ""``, ``grpo,,gspo``) is refused, not read as every objective."""
    if objectives is not None and not all(name.strip() for name in objectives or [""]):
        raise ConfigError(f"--objectives {','.join(objectives)!r} has an empty name: give registered names "
                          "separated by commas (e.g. grpo,gspo; python -m harness list), or leave --objectives out "
                          "for every one")
    objectives = objectives or available_objectives()
    common = [*overrides, f"name={NAME}", f"sweep.grid.objective.name=[{','.join(objectives)}]",
              f"sweep.grid.seed=[{','.join(map(str, range(seeds)))}]"]
    runs: dict[str, DictConfig] = {}
    keys: dict[str, None] = {}
    for experiment, axes in CELLS.items():
        cell = [f"sweep.grid.{k}={json.dumps(v)}" for k, v in axes.items()]
        try:  # a setting the regime cannot take is named with the regime that sets the rest
            cfg = load_experiment(experiment, [*common, *cell])
            cells = run_configs(cfg)
        except ConfigError as e:
            raise ConfigError(f"the zoo's regime '{experiment}' ({', '.join(f'{k}={v}' for k, v in axes.items())}, "
                              f"experiments/{experiment}.yaml) with your settings: {e}") from None
        keys.update(dict.fromkeys(cfg.sweep.grid))
        for run in cells:
            runs.setdefault(run_id(run), run)
    folder = load_experiment("quickstart", [*overrides, f"name={NAME}"])
    folder.sweep.grid = {key: [] for key in keys}
    return folder, list(runs.values())


def main(seeds: int = SEEDS, jobs: int = 2, target: float = TARGET, overrides: list[str] | None = None,
         progress: bool = True, report: bool = True, objectives: list[str] | None = None,
         allow_code_change: bool = False) -> int:
    """Run (or resume) the zoo, then write its leaderboard (and report); 0 when every run ended. ``objectives``: a
    subset (a smoke test, a quick look); the default and the leaderboard `make zoo` writes are every registered one.
    ``allow_code_change``: resume runs that other code began (harness/run/provenance.py)."""
    cfg, runs = zoo_runs(seeds, list(overrides or []), objectives)
    exp_dir = Path(cfg.results_dir) / cfg.name
    count = len(available_objectives() if objectives is None else objectives)
    print(f"zoo: {len(runs)} runs ({count} objectives x {seeds} seeds x "
          f"{len(CELLS)} regime cells, shared cells once) into {exp_dir}, {jobs} at a time", file=sys.stderr)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    entries = run_sweep(cfg, jobs=jobs, progress=progress, runs=runs, allow_code_change=allow_code_change,
                        command="zoo")
    wall = time.perf_counter() - start
    ended = sum(e["status"] in ENDED for e in entries)
    stamp = (f"`make zoo`: {ended}/{len(entries)} runs ended "
             f"({sum(e['status'] == 'diverged' for e in entries)} diverged), run or resumed in {wall / 60:.1f} min "
             f"(1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after). Machine: "
             f"{machine(jobs)}. Target accuracy for tokens-to-target: {target:g}.")
    path = write_leaderboard(exp_dir, exp_dir, stamp, target)
    if report:
        build_report(exp_dir)
    print(f"{stamp}\nleaderboard: {path}", file=sys.stderr)
    return 0 if ended == len(entries) else 1
