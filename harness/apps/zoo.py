"""`make zoo`: every registered objective through the shipped stress regimes on the tiny model, in two stages, then
the leaderboard (docs/replicates.md explains the design).

    python -m harness zoo [--stage screen|confirm|both] [--seeds N] [--jobs N] [--target ACC] [--objectives a,b]
                          [--no-report] [key=value ...]
        results/zoo/screen/    stage 1, the screen: every objective x CELLS x seeds 0 .. N-1 from one starting policy
                               (the regimes' own, model.seed), its leaderboard (leaderboard.md) and report
        results/zoo/confirm/   stage 2, the confirmation: plan.json and plan.md, written before any of its runs, then
                               the runs the plan names
        results/zoo/leaderboard.md, .html, .csv: per objective confirmed above / confirmed below / not confirmed /
                               not tested, with the family, its correction and the replication
        results/zoo/prepare/   both stages: each starting policy's config and build log (``confirm_start_seeds``)

The objectives are the registry's (``objectives.available_objectives()``), so an objective registered there is in the
next zoo without a change here. The cells are CELLS: each shipped regime experiment (experiments/<name>.yaml, listed
in docs/running.md) at the axis values listed, crossed with every objective and seed; a cell two regimes share
is one set of runs (run ids are the settings' hash). Overrides apply to every run of both stages (e.g.
``train.steps=17 train.eval_every=17`` for a smoke test: the async_staleness regime's lag of 16 needs more steps).

The confirmation is decided from the screen alone and written down before it runs (``plan_confirmation``): the
objectives whose screen interval of the paired difference to BASELINE (mean over the cells) excluded 0, and the core
objectives (quickstart's: `make sweep`'s four), each with the baseline, on CONFIRM_START_POLICIES starting policies
(the first of START_CANDIDATES whose warm start lands in its band; none of them the screen's) x CONFIRM_SEEDS fresh
seeds (after the screen's) per cell, evaluated on fresh eval problems (task.eval_set: the screen's + 1, none of them
the screen's or a train problem, so the selection's luck on the screen's problems is not scored again). A plan once
written is kept: the confirmation resumes under it, and settings other than those it was made with are refused
(remove the confirm folder to plan again), as is a plan.json damaged or edited (``read_plan``: a key the
confirmation reads missing or of another type, or starting policies, seeds or eval problems of the screen's); a
plan.md removed is written again from plan.json, one edited is said to change nothing (plan.json is what runs).
The zoo's folder, or a stage's in it, that is a symbolic link is refused before anything starts
(``check_unlinked``). The verdicts: analysis/confirmation.py ``write_confirmation`` (Holm over the plan's family of
comparisons with the baseline).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from omegaconf import DictConfig

from analysis.confirmation import which_eval_problems, write_confirmation
from analysis.leaderboard import leaderboard, write_leaderboard
from analysis.load import load_experiment as load_results
from analysis.report import build_report
from analysis.stats import LEVEL, num
from analysis.verdict import ALPHA
from harness.apps.stamp import SweepTime, machine, timed_sweep
from harness.apps.sweep import check_runs_one_version, first_landing, run_sweep
from harness.policy.warm_start import builds_since
from harness.run.atomic import atomic_write
from harness.run.config import NOT_IN_RUN_ID, load_experiment, run_configs, run_id
from harness.run.errors import ConfigError
from harness.run.records import ENDED
from harness.tasks import has_eval_sets
from objectives import available_objectives

# regime experiment -> the values of its axis the zoo runs (the experiment's own values for keys not listed): the
# stress end of each regime (quickstart's own cell, where the core objectives tie, is `make sweep`'s). docs/zoo_guide.md
# says what was explored, what each regime showed and how the budget is computed.
CELLS: dict[str, dict[str, list]] = {
    "offpolicy": {"train.num_minibatches": [16]},  # 16 optimizer steps per rollout batch (quickstart: 4)
    "step_size": {"train.lr": [1.5e-4]},  # 3x quickstart's learning rate (docs/results_explorations.md: larger ones)
    # every batch sampled 16 policy versions back, each objective on the stale behaviour log-probs (no correction)
    "async_staleness": {"train.rollout_lag": [16], "train.rollout_correction": [{"mode": "none"}]},
}
SEEDS = 3  # the screen's seeds per objective and cell
TARGET = 0.40  # eval accuracy for "tokens to target": about 0.1 above quickstart's starting policy (0.30-0.45 band)
NAME = "zoo"
STAGES = ("screen", "confirm", "both")
BASELINE = "grpo"
# The confirmation's starting policies: the first CONFIRM_START_POLICIES values of START_CANDIDATES (model.seed; the
# screen's is the regimes' own, 1) whose warm start lands in its band, each built once into the cache before any run.
# The recipe's starting policy is one that lands in the band; a value that misses it (another CPU rounds the warm
# start otherwise) is recorded and passed over, in order, never stretched to fit (docs/replicates.md).
CONFIRM_START_POLICIES = 3
START_CANDIDATES = (2, 3, 4, 5, 6, 7, 8, 9)
CONFIRM_SEEDS = 5  # the confirmation's seeds per starting policy and cell, after the screen's
WHOLE = "whole_time.json"  # in results/zoo: the time of the one command that ran both stages (whole_stamp)


def core_objectives() -> list[str]:
    """The core objectives: quickstart's (`make sweep`'s) grid."""
    return list(load_experiment("quickstart").sweep.grid["objective.name"])


def stage_runs(stage: str, overrides: list[str], objectives: list[str], seeds: list[int],
               start_seeds: list[int] | None = None, eval_set: int | None = None
               ) -> tuple[DictConfig, list[DictConfig]]:
    """A stage's folder config (results/zoo/<stage>/; its grid names every swept key, for the manifest) and its runs:
    every cell of CELLS x ``objectives`` x ``start_seeds`` (model.seed; None: the regimes' own) x ``seeds``, each run
    once (by run id), on task.eval_set ``eval_set`` (None: the overrides')."""
    root = Path(load_experiment("quickstart", overrides).results_dir) / NAME
    where = [f"results_dir={root}", f"name={stage}"]
    common = [*overrides, *where, f"sweep.grid.objective.name=[{','.join(objectives)}]",
              f"sweep.grid.seed=[{','.join(map(str, seeds))}]",
              *([f"task.eval_set={eval_set}"] if eval_set is not None else [])]
    if start_seeds is not None:
        common.append(f"sweep.grid.model.seed=[{','.join(map(str, start_seeds))}]")
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
    folder = load_experiment("quickstart", [*overrides, *where])
    folder.sweep.grid = {key: [] for key in keys}
    return folder, list(runs.values())


def zoo_runs(seeds: int, overrides: list[str], objectives: list[str] | None = None
             ) -> tuple[DictConfig, list[DictConfig]]:
    """The screen's folder config and runs: ``objectives`` (None: every registered one) x seeds 0 .. seeds-1. An
    empty list or name (``--objectives ""``, ``grpo,,gspo``) is refused, not read as every objective."""
    if objectives is not None and not all(name.strip() for name in objectives or [""]):
        raise ConfigError(f"--objectives {','.join(objectives)!r} has an empty name: give registered names "
                          "separated by commas (e.g. grpo,gspo; python -m harness list), or leave --objectives out "
                          "for every one")
    return stage_runs("screen", overrides, objectives or available_objectives(), list(range(seeds)))


def plan_confirmation(board, screen_seeds: list[int], screen_start_seeds: list[int], core: list[str],
                      settings: dict, starts: dict, screen_eval_set: int | None = 0) -> dict:
    """The confirmation's plan from the screen's leaderboard (analysis.leaderboard.leaderboard's frame, its
    vs_baseline interval the screen's difference to BASELINE over the cells): which objectives and why, which
    starting policies (``starts``: confirm_start_seeds'), seeds (none of the screen's) and eval problems (the set
    after the screen's ``screen_eval_set``; None: a task with one held-out set, the screen's), the family of
    comparisons and its correction."""
    reasons = {}
    for row in board.itertuples():
        interval = f"{num(row.vs_baseline)} [{num(row.vs_baseline_low)}, {num(row.vs_baseline_high)}]"
        excludes = row.vs_baseline_low > 0 or row.vs_baseline_high < 0  # NaN (no interval) excludes nothing
        reasons[row.objective] = (excludes, f"screen: {interval} vs {BASELINE}, "
                                            f"{'excludes' if excludes else 'includes'} 0")
    chosen = {o: why for o, (excludes, why) in reasons.items() if excludes}
    for o in core:
        chosen[o] = "core objective" + (f"; {chosen[o]}" if o in chosen else "")
    chosen[BASELINE] = "the baseline"
    order = [o for o in available_objectives() if o in chosen] + sorted(set(chosen) - set(available_objectives()))
    seeds = list(range(max(screen_seeds) + 1, max(screen_seeds) + 1 + CONFIRM_SEEDS))
    family = [o for o in order if o != BASELINE]
    return {"written": datetime.now(UTC).isoformat(timespec="seconds"), "baseline": BASELINE,
            "rule": (f"the objectives whose screen interval ({LEVEL:.0%}, the paired difference to {BASELINE}, mean "
                     "over the cells) excluded 0, and the core objectives (quickstart's)"),
            "objectives": {o: chosen[o] for o in order},
            "not_tested": {o: why for o, (excludes, why) in reasons.items() if o not in chosen},
            "cells": CELLS, "start_seeds": starts["landed"], "start_seeds_missed": starts["missed"], "seeds": seeds,
            "eval_set": None if screen_eval_set is None else screen_eval_set + 1,
            "screen": {"start_seeds": screen_start_seeds, "seeds": screen_seeds, "eval_set": screen_eval_set},
            "correction": {"method": "holm", "alpha": round(ALPHA, 6), "family": [f"{o} - {BASELINE}" for o in family],
                           "size": len(family)},
            "settings": settings}


def plan_text(plan: dict, runs: int) -> str:
    """plan.md: the plan in sentences."""
    lines = [f"# The zoo's confirmation plan\n\nWritten {plan['written']}, before any of its runs, from the screen "
             f"(model.seed {plan['screen']['start_seeds']}, seeds {plan['screen']['seeds']}).\n",
             f"Rule: {plan['rule']}.\n",
             f"Design: each objective and {plan['baseline']} in each cell "
             f"({'; '.join(f'{e}: {a}' for e, a in plan['cells'].items())}) from {len(plan['start_seeds'])} starting "
             f"policies (model.seed {plan['start_seeds']}) x {len(plan['seeds'])} seeds ({plan['seeds']}): {runs} "
             "runs.\n",
             f"Eval problems: {which_eval_problems(plan)}.\n",
             *[f"Starting policy model.seed {seed} was passed over: {error}\n"
               for seed, error in plan.get("start_seeds_missed", {}).items()],
             f"Correction: Holm's step-down over the family of {plan['correction']['size']} comparison"
             f"{'s' * (plan['correction']['size'] != 1)} with "
             f"{plan['baseline']}, family-wise error rate {plan['correction']['alpha']:g}.\n", "## Tested\n",
             *[f"- {o}: {why}" for o, why in plan["objectives"].items()], "\n## Not tested\n",
             *[f"- {o}: {why}" for o, why in plan["not_tested"].items()]]
    return "\n".join(lines) + "\n"


def check_plan_md(folder: Path, text: str, written: str) -> None:
    """plan.md beside a kept plan.json: written again from it when removed; when its text is not the plan's, said
    (an edit there changes nothing the confirmation does, while the leaderboard names the file as its plan) and left
    as it is (the text of older code differs too, and its plan is run as it was). Each in one line."""
    md = folder / "plan.md"
    if not md.is_file():  # removed since: its text again, from the plan it was written from
        atomic_write(md, text)
        print(f"zoo confirmation: {md} was missing; written again from {folder / 'plan.json'} (the plan made "
              f"{written}, before the confirmation's runs)", file=sys.stderr)
    elif md.read_text(errors="replace") != text:
        print(f"zoo confirmation: {md} is not the text of the plan {folder / 'plan.json'} holds, which is what runs "
              "(edited, or written by other code): an edit there changes no run; remove it to have it written again "
              "from plan.json, or the confirm folder to plan again", file=sys.stderr)


def plan_settings(overrides: list[str], seeds: int, objectives: list[str] | None, start_policies: int) -> dict:
    """The settings a plan records and is read again under (the number of starting policies only where it is not
    the default, so that a plan made before it was a setting is read as it was)."""
    return {"overrides": overrides, "seeds": seeds, "objectives": objectives,
            **({"start_policies": start_policies} if start_policies != CONFIRM_START_POLICIES else {})}


def acting(settings: dict) -> dict:
    """Plan settings as they act on the runs: the overrides as the mapping they set (a key's later value wins), the
    objectives as a set (sorted). Given in another order they make the same runs, which a plan compared literally
    refused, with the advice to remove the confirmation's folder and its finished runs."""
    overrides, objectives = settings.get("overrides"), settings.get("objectives")
    return {**settings,
            **({"overrides": dict(str(o).partition("=")[::2] for o in overrides)} if isinstance(overrides, list)
               else {}),
            **({"objectives": sorted(map(str, objectives))} if isinstance(objectives, list) else {})}


def read_plan(folder: Path, settings: dict, screen: dict) -> dict | None:
    """The plan written in ``folder`` (None: none yet); ConfigError if it was made with other settings, or if it is
    not one the confirmation can run as the zoo's design (plan_problem; ``screen``: screen_design's of the screen
    these settings make). A damaged or edited plan is refused like an unreadable one, not obeyed: runs made under it
    would be in the folder's manifest, read with the confirmation's own."""
    path = folder / "plan.json"
    if not path.is_file():
        return None
    try:
        plan = json.loads(path.read_text())
        if not isinstance(plan, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:  # json's decoding errors are ValueErrors
        raise ConfigError(f"{path}: unreadable ({e}); remove {folder} to plan the confirmation again") from None
    made = acting(plan.get("settings") if isinstance(plan.get("settings"), dict) else {})
    settings = acting(settings)
    if made != settings:
        keys = [k for k in sorted({*made, *settings}) if made.get(k) != settings.get(k)]
        said = "; ".join(f"{k} {made.get(k)!r} there, {settings.get(k)!r} now" for k in keys)
        raise ConfigError(f"{path} was made with other settings ({said[:300]}): the confirmation keeps its plan; "
                          f"remove {folder} to plan it again from the screen")
    problem = plan_problem(plan, screen)
    if problem:
        raise ConfigError(f"{path}: {problem[:300]}; the confirmation runs only the plan written from its screen, not "
                          f"a damaged or edited one: remove {folder} to plan the confirmation again from the screen")
    return plan


def whole_numbers(value) -> bool:
    """Whether ``value`` is a non-empty list of distinct whole numbers from 0 (not true or false)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
            and len(set(value)) == len(value))


def given(plan: dict, key: str) -> str:
    """``plan``'s value of ``key`` as the file spells it (its first 100 characters), or "missing"."""
    return json.dumps(plan[key])[:100] if key in plan else "missing"


def reasons(value) -> bool:
    """Whether ``value`` is a JSON object of texts to texts (an objective's name to why)."""
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def plan_problem(plan: dict, screen: dict) -> str | None:
    """What makes ``plan`` (plan.json's object, its settings those of this command) one the confirmation cannot run
    as the zoo's design, in words naming the key; None when there is nothing. Every key the confirmation and its
    texts read, of the type plan_confirmation writes: registered objectives with BASELINE among them, Holm's
    correction over their comparisons, the zoo's CELLS, lists of distinct whole numbers, and starting policies, seeds
    and eval problems none of the screen's (screen_problem)."""
    objectives = plan.get("objectives")
    if not reasons(objectives) or not objectives:
        return f"'objectives' is {given(plan, 'objectives')}, not a JSON object of objective names to why each is " \
               "tested"
    unknown = [o for o in objectives if o not in available_objectives()]
    if unknown:
        return f"'objectives' names {unknown[0]!r}, not a registered objective (python -m harness list)"
    if plan.get("baseline") != BASELINE or BASELINE not in objectives:
        return f"'baseline' is {given(plan, 'baseline')}: the zoo's is {BASELINE!r}, among the objectives"
    if not reasons(plan.get("not_tested")) or set(plan["not_tested"]) & set(objectives):
        return "'not_tested' is not a JSON object of the objectives left out (none tested) to why each is not"
    for key in ("start_seeds", "seeds"):
        if not whole_numbers(plan.get(key)):
            return f"'{key}' is {given(plan, key)}, not a list of distinct whole numbers"
    if not reasons(plan.get("start_seeds_missed", {})):
        return "'start_seeds_missed' is not a JSON object of the starting policies passed over to why"
    if not all(isinstance(plan.get(key), str) for key in ("rule", "written")):
        return "'rule' or 'written' is not a text"
    if plan.get("cells") != CELLS:
        return f"'cells' is {given(plan, 'cells')}, not the zoo's regime cells (harness/apps/zoo.py CELLS)"
    family = [f"{o} - {BASELINE}" for o in objectives if o != BASELINE]
    correction = plan.get("correction")
    if not (isinstance(correction, dict) and correction.get("method") == "holm" and correction.get("family") == family
            and correction.get("size") == len(family) and isinstance(correction.get("alpha"), float | int)
            and round(correction["alpha"], 6) == round(ALPHA, 6)):
        return f"'correction' is not Holm's over the {len(family)} comparisons of its objectives with {BASELINE} " \
               f"at {round(ALPHA, 6):g}"
    return screen_problem(plan, screen)


def screen_problem(plan: dict, screen: dict) -> str | None:
    """What in ``plan`` contradicts the design's promise to the screen (``screen``: screen_design's): its record of
    the screen is another's, or its starting policies, seeds or eval problems (a plan with ``eval_set``: one made
    since the confirmation had its own) are the screen's; None when nothing does."""
    keys = ["start_seeds", "seeds", *(["eval_set"] if "eval_set" in plan else [])]
    recorded = plan.get("screen")
    if not isinstance(recorded, dict) or any(recorded.get(key) != screen[key] for key in keys):
        return (f"'screen' is {given(plan, 'screen')}, not the screen these settings make "
                f"({json.dumps({key: screen[key] for key in keys})})")
    for key, what in (("start_seeds", "starting policies (model.seed)"), ("seeds", "seeds")):
        shared = sorted(set(plan[key]) & set(screen[key]))
        if shared:
            return (f"'{key}' {plan[key]} holds the screen's {what} {shared}: the confirmation's are none of the "
                    "screen's")
    if "eval_set" not in plan or plan["eval_set"] is None and screen["eval_set"] is None:
        return None
    if screen["eval_set"] is None:  # a task with one held-out set: no other to evaluate on
        return f"'eval_set' is {given(plan, 'eval_set')}: the task has one held-out set, null"
    if not whole_numbers([plan["eval_set"]]) or plan["eval_set"] == screen["eval_set"]:
        return (f"'eval_set' is {given(plan, 'eval_set')}, not a whole number other than the screen's "
                f"({screen['eval_set']}): the confirmation's eval problems are none of the screen's")
    return None


def screen_design(screen_runs: list[DictConfig]) -> dict:
    """The screen's starting policies (model.seed), seeds and eval problems (task.eval_set; None: a task with one
    held-out set), as a plan records them (its ``screen``)."""
    task = screen_runs[0].task
    return {"start_seeds": sorted({int(run.model.seed) for run in screen_runs}),
            "seeds": sorted({int(run.seed) for run in screen_runs}),
            "eval_set": int(task.eval_set) if has_eval_sets(task.name) else None}


def screen_ended(folder: Path, objectives: list[str] | None = None) -> bool:
    """Whether every run of the screen's last sweep ended (its manifest.json), of ``objectives`` (None: every one)."""
    return screen_not_ended(folder, objectives) == []


def screen_not_ended(folder: Path, objectives: list[str] | None = None) -> list[dict] | None:
    """The manifest entries of the screen's runs of ``objectives`` (None: every one) that did not end; None when its
    manifest.json cannot be read or lists none of them. A run of an objective left out of --objectives (one whose
    runs all failed) is not one the plan is made from; an entry that names no objective is counted."""
    try:
        runs = json.loads((folder / "manifest.json").read_text())["runs"]
        mine = [r for r in runs if objectives is None or r.get("objective", objectives[0]) in objectives]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # ValueError: not JSON, or not UTF-8
        return None
    return [r for r in mine if r.get("status") not in ENDED] if mine else None


def not_ended_text(screen: Path, left: list[dict] | None) -> str:
    """Why the confirmation is not planned from ``screen``: no run of it can be read, or the runs that did not end."""
    if not left:
        return (f"the confirmation is planned from a finished screen, and {screen} has no run of these objectives "
                "that can be read: run `make zoo STAGE=screen` first")
    first = left[0]
    owners = ", ".join(dict.fromkeys(str(r["objective"]) for r in left if r.get("objective")))
    leave = (f", or leave out their objectives ({owners}) with --objectives, the zoo's others then planned without "
             f"them (each run's error: its summary.json and train.log under {screen})" if owners else "")
    return (f"the confirmation is planned from a finished screen, and {len(left)} of its runs did not end "
            f"({first.get('run_id', 'a run')}: {first.get('status', 'no status')}{', ...' if len(left) > 1 else ''})"
            f"; run `make zoo STAGE=screen` first to resume them{leave}")


def zoo_command(stage: str, seeds: int, objectives: list[str] | None, overrides: list[str],
                start_policies: int, target: float) -> str:
    """The command a stamp names: ``make zoo STAGE=<stage>`` (``make zoo`` for both) where every option is its
    default, else ``python -m harness zoo`` with the options given otherwise and the overrides that change the runs
    (results_dir, name and logging change none): a stamp named make zoo's defaults whatever ran."""
    options = [*([f"--seeds {seeds}"] if seeds != SEEDS else []),
               *([f"--objectives {','.join(objectives)}"] if objectives else []),
               *([f"--start-policies {start_policies}"] if start_policies != CONFIRM_START_POLICIES else []),
               *([f"--target {target:g}"] if target != TARGET else []),
               *(o for o in overrides if o.partition("=")[0].split(".")[0] not in NOT_IN_RUN_ID)]
    if not options:
        return "`make zoo`" if stage == "both" else f"`make zoo STAGE={stage}`"
    return f"`python -m harness zoo{'' if stage == 'both' else f' --stage {stage}'} {' '.join(options)}`"


def stamp(command: str, entries: list[dict], timing: SweepTime) -> str:
    """A stage's sentence on its leaderboard: ``command`` (zoo_command), its runs, its time, the machine."""
    ended = sum(e["status"] in ENDED for e in entries)
    return (f"{command}: {ended}/{len(entries)} runs ended "
            f"({sum(e['status'] == 'diverged' for e in entries)} diverged), run or resumed in {timing.wall_s / 60:.1f} "
            f"min (1-minute load average {timing.load_before:.2f} before, {timing.load_after:.2f} after). Machine: "
            f"{timing.machine}.{timing.note()}")


def swept(cfg: DictConfig, runs: list[DictConfig], jobs: int, progress: bool, allow: bool,
          command: str) -> tuple[list, str, SweepTime]:
    """The stage's sweep (run or resumed), its stamp (naming ``command``) and its timing, timed by timed_sweep: found
    ended, a stage is stamped with the time of the command that ran it, not the seconds of finding its runs ended."""
    entries, timing = timed_sweep(Path(cfg.results_dir) / cfg.name, [run_id(run) for run in runs], jobs, lambda:
                                  run_sweep(cfg, jobs=jobs, progress=progress, runs=runs, allow_code_change=allow,
                                            command="zoo"))
    if timing.before < len(runs):  # this command ran some of the stage: a kept whole time is no longer its runs'
        (Path(cfg.results_dir) / WHOLE).unlink(missing_ok=True)
    return entries, stamp(command, entries, timing), timing


def began_from_nothing(screen: Path) -> tuple[datetime, float, float] | None:
    """When (the time, perf_counter, the 1-minute load average) a zoo of both stages began from a results folder
    without its screen's and its confirmation's folders; None where either exists (a resumed zoo has no whole time)."""
    if screen.exists() or (screen.parent / "confirm").exists():
        return None
    return datetime.now(UTC), time.perf_counter(), os.getloadavg()[0]


def whole_stamp(zoo_dir: Path, ids: list[str], began: tuple[datetime, float, float] | None, timing: SweepTime,
                jobs: int, command: str = "`make zoo`") -> str:
    """The sentence on the whole zoo after its confirmation ended (``timing``: the confirmation sweep's): ``began``
    (began_from_nothing) and none of the confirmation's runs ended before it: this command ran both stages and built
    the starting policies the cache lacked, timed from its start, kept in ``zoo_dir``/WHOLE with the runs' ``ids``;
    else, where this command found every confirmation run ended (``timing.kept``), the figures kept there by the
    command that ran exactly these runs (removed by ``swept`` when a later command ran any run of a stage); else
    none. ``command``: the command that ran both stages (zoo_command), kept with the figures."""
    if began is None or timing.before:
        kept = read_whole(zoo_dir / WHOLE, ids) if timing.kept else None
        return "" if kept is None else whole_sentence(kept, kept=True)
    at, start, load = began
    built, missed = builds_since(at)
    record = {"runs": sorted(ids), **asdict(SweepTime(time.perf_counter() - start, load, os.getloadavg()[0],
                                                      machine(jobs))), "built": built, "missed": missed,
              "command": command}
    atomic_write(zoo_dir / WHOLE, json.dumps(record))
    return whole_sentence(record)


def read_whole(path: Path, ids: list[str]) -> dict | None:
    """The whole zoo's figures kept at ``path`` by the command that ran exactly the runs ``ids`` (None: none)."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):  # none kept, or not JSON
        return None
    numbers = ("wall_s", "load_before", "load_after", "built", "missed")
    whole = (isinstance(kept, dict) and kept.get("runs") == sorted(ids) and isinstance(kept.get("machine"), str)
             and isinstance(kept.get("command", ""), str)  # none: kept by code before it was recorded
             and all(isinstance(kept.get(key), int | float) for key in numbers))
    return kept if whole else None  # a damaged record: no whole time


def whole_sentence(record: dict, kept: bool = False) -> str:
    """The whole zoo's time, the starting policies it built and its load, as the leaderboard states them."""
    whose = (" These are the figures of the command that ran them all; this one found every run ended." if kept
             else "")
    return (f"{record.get('command', '`make zoo`')}, both stages from a results folder without them, in one command: "
            f"{record['wall_s'] / 60:.1f}"
            f" min, the {record['built']} starting-policy builds it made into the cache included ({record['missed']}"
            f" of them missed their band, passed over; the policies the cache held were loaded) (1-minute load "
            f"average {record['load_before']:.2f} before, {record['load_after']:.2f} after). Machine: "
            f"{record['machine']}.{whose}")


def main(seeds: int = SEEDS, jobs: int = 2, target: float = TARGET, overrides: list[str] | None = None,
         progress: bool = True, report: bool = True, objectives: list[str] | None = None,
         allow_code_change: bool = False, stage: str = "both", start_policies: int | None = None) -> int:
    """Run (or resume) the zoo's ``stage`` (screen, confirm or both), then write its leaderboards; 0 when every run
    ended. ``objectives``: a subset (a smoke test); ``allow_code_change``: resume runs that other code began;
    ``start_policies``: the confirmation's (None: CONFIRM_START_POLICIES; from 5 its verdicts are not indicative:
    docs/replicates.md)."""
    start_policies = CONFIRM_START_POLICIES if start_policies is None else start_policies
    if not 2 <= start_policies <= len(START_CANDIDATES):
        raise ConfigError(f"--start-policies must be 2 to {len(START_CANDIDATES)} (the candidates, model.seed "
                          f"{', '.join(map(str, START_CANDIDATES))}), got {start_policies}")
    overrides = list(overrides or [])
    fixed = [o for o in overrides if o.partition("=")[0] in ("seed", "model.seed", "objective.name")
             or o.startswith("sweep.")]
    if fixed:
        raise ConfigError(f"{fixed[0]}: the zoo sets the objectives (--objectives), the seeds (--seeds) and the "
                          "starting policies (the screen: the regimes' own model.seed; the confirmation: "
                          "harness/apps/zoo.py START_CANDIDATES) itself")
    axes = {key: experiment for experiment, cell in CELLS.items() for key in cell}
    its_own = [o for o in overrides if o.partition("=")[0] in axes or o.partition("=")[0] == "name"]
    if its_own:  # the regimes' own grids would refuse it as a key given twice, a name of the user's was dropped
        key = its_own[0].partition("=")[0]
        why = f"an axis of its {axes[key]} regime: harness/apps/zoo.py CELLS" if key in axes else "each stage's folder"
        raise ConfigError(f"{its_own[0]}: the zoo sets {key} itself ({why}); leave it out")
    if stage not in STAGES:
        raise ConfigError(f"--stage must be one of {', '.join(STAGES)}, got {stage!r}")
    root = Path(load_experiment("quickstart", overrides).results_dir) / NAME
    check_unlinked(root)
    cfg, runs = zoo_runs(seeds, overrides, objectives)
    if stage in ("confirm", "both"):  # a plan that cannot be run here: refused before the screen runs anything
        read_plan(root / "confirm", plan_settings(overrides, seeds, objectives, start_policies), screen_design(runs))
    status, began = 0, None
    if stage in ("screen", "both"):
        screen = Path(cfg.results_dir) / cfg.name
        began = began_from_nothing(screen) if stage == "both" else None
        if stage == "both" and not screen_ended(screen):
            confirm_start_seeds(overrides, jobs, progress, runs, start_policies)  # both stages' (their docstring)
        print(f"zoo screen: {len(runs)} runs ({len(objectives or available_objectives())} objectives x {seeds} seeds "
              f"x {len(CELLS)} regime cells) into {screen}, {jobs} at a time", file=sys.stderr)
        entries, text, _ = swept(cfg, runs, jobs, progress, allow_code_change,
                                 zoo_command("screen", seeds, objectives, overrides, start_policies, target))
        path = write_leaderboard(screen, screen, f"{text} Target accuracy for tokens-to-target: {target:g}.", target,
                                 BASELINE)
        if report:
            build_report(screen)
        print(f"{text}\nscreen leaderboard: {path}", file=sys.stderr)
        status = 0 if all(e["status"] in ENDED for e in entries) else 1
        if stage == "both" and status:  # said, not a silent exit 1
            left = [e for e in entries if e["status"] not in ENDED]
            print(f"zoo: the confirmation did not run: {not_ended_text(screen, left)}", file=sys.stderr)
    if stage in ("confirm", "both") and status == 0:
        status = confirm(seeds, jobs, target, overrides, progress, objectives, allow_code_change, start_policies,
                         began)
    return status


def check_unlinked(root: Path) -> None:
    """Refuse (ConfigError, one line, before anything starts) a zoo folder (``root``: results/zoo) or a folder of a
    stage in it that is a symbolic link. The zoo writes its leaderboards, plan and runs there by name, each replacing
    the file of that name: through a link, the files of the folder it points to (harness/run/atomic.py write_into
    refuses a linked report folder likewise; a sweep follows a linked experiment folder, which holds its runs and
    manifest, its report written by write_into)."""
    for folder in (root, *(root / stage for stage in ("screen", "confirm", "prepare"))):
        if folder.is_symlink():
            raise ConfigError(f"{folder} is a symbolic link (to {os.readlink(folder)}), which the harness did not "
                              "make: the zoo does not write its runs, plan and leaderboards through links; remove the "
                              "link, or give another results_dir=...")


def confirm_start_seeds(overrides: list[str], jobs: int, progress: bool, screen_runs: list[DictConfig],
                        wanted: int | None = None) -> dict:
    """The confirmation's starting policies (sweep.first_landing): the first ``wanted`` (None: CONFIRM_START_POLICIES)
    of START_CANDIDATES whose warm
    start lands in its band, the screen's offered first, ``jobs`` side by side; their configs and build
    logs in results/zoo/prepare/. Called before the screen's first run too, so that both stages' policies (the
    confirmation's do not depend on the screen's findings) are built together."""
    def runs_for(seeds: list[int]) -> list[DictConfig]:
        return stage_runs("confirm", overrides, [BASELINE], [0], seeds)[1]

    folder = Path(load_experiment("quickstart", overrides).results_dir) / NAME / "prepare"
    return first_landing(runs_for, START_CANDIDATES, wanted or CONFIRM_START_POLICIES, folder, jobs, progress,
                         screen_runs)


def check_screen(runs, expected: list[DictConfig], objectives: list[str] | None, screen: Path) -> None:
    """ConfigError unless the ended runs of ``screen`` (``runs``: its runs frame) of the objectives compared are
    exactly the screen these settings name (``expected``: --seeds, --objectives, the overrides): the plan is decided
    from that board and records that screen, so a screen of other seeds or settings is not planned from."""
    want = {run_id(run) for run in expected}
    compared = runs if objectives is None else runs[runs["objective"].isin(objectives)]
    have = set(compared.loc[compared["ended"].astype(bool), "run_id"])
    if have != want:
        missing, other = sorted(want - have), sorted(have - want)
        raise ConfigError(f"{screen} is not the screen these settings make: {len(missing)} of its {len(want)} runs "
                          f"have not ended there{f' (e.g. {missing[0]})' if missing else ''} and {len(other)} ended "
                          f"runs there are not among them{f' (e.g. {other[0]})' if other else ''}; give the screen's "
                          "--seeds, --objectives and overrides, or run `make zoo STAGE=screen` with these first")


def confirm(seeds: int, jobs: int, target: float, overrides: list[str], progress: bool,
            objectives: list[str] | None, allow_code_change: bool, start_policies: int,
            began: tuple[datetime, float, float] | None = None) -> int:
    """Stage 2: the plan (read, or made from the finished screen and written), its runs, the leaderboard (with the
    whole zoo's time where ``began``: whole_stamp)."""
    cfg, screen_runs = zoo_runs(seeds, overrides, objectives)
    screen = Path(cfg.results_dir) / cfg.name
    folder = screen.parent / "confirm"
    settings = plan_settings(overrides, seeds, objectives, start_policies)
    design = screen_design(screen_runs)
    plan = read_plan(folder, settings, design)
    if plan is None:
        if (left := screen_not_ended(screen, objectives)) != []:
            raise ConfigError(not_ended_text(screen, left))
        results = load_results(screen)
        check_screen(results.runs, screen_runs, objectives, screen)
        board = leaderboard(results, target, BASELINE)
        board = board[board["objective"].isin(objectives)] if objectives else board
        core = [o for o in core_objectives() if objectives is None or o in objectives]
        starts = confirm_start_seeds(overrides, jobs, progress, screen_runs, start_policies)
        plan = plan_confirmation(board, design["seeds"], design["start_seeds"], core, settings, starts,
                                 design["eval_set"])
    cfg, runs = stage_runs("confirm", overrides, list(plan["objectives"]), plan["seeds"], plan["start_seeds"],
                           plan.get("eval_set"))  # None (a plan from before eval sets, a task without them): the
    # screen's problems
    if not (folder / "plan.json").is_file():  # written whole before any run of the confirmation starts
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / "plan.md", plan_text(plan, len(runs)))
        atomic_write(folder / "plan.json", json.dumps(plan, indent=1) + "\n")
    else:
        check_plan_md(folder, plan_text(plan, len(runs)), plan["written"])
    if not plan["correction"]["size"]:  # Holm over no comparison: the baseline's runs alone confirm nothing
        why = "; ".join(f"{o}: {reason}" for o, reason in plan["not_tested"].items()) or "no other objective"
        print(f"zoo confirmation: the plan tests no objective against {plan['baseline']} ({why}), so there is nothing "
              f"to confirm: no run started (plan: {folder / 'plan.md'})", file=sys.stderr)
        return 0
    print(f"zoo confirmation: {len(runs)} runs ({len(plan['objectives'])} objectives x {len(plan['start_seeds'])} "
          f"starting policies x {len(plan['seeds'])} seeds x {len(CELLS)} regime cells; plan: {folder / 'plan.md'}) "
          f"into {folder}, {jobs} at a time", file=sys.stderr)
    check_runs_one_version(cfg, runs, "the confirmation's runs")  # its verdicts pair runs across objectives
    entries, text, timing = swept(cfg, runs, jobs, progress, allow_code_change,
                                  zoo_command("confirm", seeds, objectives, overrides, start_policies, target))
    if all(e["status"] in ENDED for e in entries):
        ids = [run_id(run) for run in [*screen_runs, *runs]]
        both = zoo_command("both", seeds, objectives, overrides, start_policies, target)
        text = f"{text} {whole_stamp(screen.parent, ids, began, timing, jobs, both)}".rstrip()
    path = write_confirmation(screen, folder, plan, screen.parent, text)
    print(f"{text}\nleaderboard: {path}", file=sys.stderr)
    return 0 if all(e["status"] in ENDED for e in entries) else 1

