"""`make docs`: re-run the experiments the README quotes on the current code and rewrite what it shows.

    python -m harness docs [--with-gsm8k] [--with-zoo [screen|both]] [--with-moe] [--with-smollm2 [rl|both]]
                           [--skip-main] [--jobs N]
    # RLVR_CACHE=$(mktemp -d): include the warm start; --skip-main: only the --with-* pages

Each experiment is swept into ``results/docs/<code version>/`` (harness/run/provenance.py: other code, a new commit or
other uncommitted changes, re-runs everything; the same code resumes), its report is written, its figures are copied
into ``docs/`` and its tables into ``docs/results.md`` (``docs/results_gsm8k.md`` for gsm8k_ablation; ``docs/zoo.md``:
the zoo's leaderboard; ``docs/results_moe.md``: moe_stability and the Mixture-of-Experts claims checked on its runs
and on lab_moe; ``docs/results_smollm2.md``: smollm2_rl and smollm2_transfer (``rl``: smollm2_rl alone), each one's
gain over its start, the tiny model's matching cells and the transfer table, and the SmolLM2 claims; always the
generated tables of docs/trl.md and README.md, harness/run/names.py), stamped with the code, the date, the machine
(CPU, cores, load before and after), the wall time of each sweep, and each experiment's runs' own code versions and
torch threads (their summary.json's records).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import paired
from analysis.accuracy import DIFFERENCE_RANGE, FINAL, START, interval_of, paired_units, runs_scores
from analysis.load import load_experiment as load_results
from analysis.report import build_report, ci_text, md_table
from analysis.stats import num
from harness.apps.claims import ledger_rows, load_claims, run_source, start_seeds
from harness.apps.stamp import ROOT, machine, timed_sweep
from harness.apps.sweep import run_sweep
from harness.apps.zoo import main as zoo
from harness.policy.warm_start import builds_since
from harness.run import names
from harness.run.atomic import atomic_write
from harness.run.config import load_experiment, run_configs, run_id
from harness.run.provenance import code_record, runs_stamp

DOCS = ROOT / "docs"
# experiment -> (report figure -> docs/ file name)
FIGURES = {"quickstart": {"curves_step": "quickstart_curves.png", "stability": "quickstart_stability.png"},
           "gspo_clip_repro": {"clip_fraction": "gspo_clip_repro.png", "stability": "gspo_clip_repro_stability.png"},
           "gsm8k_ablation": {"stability": "gsm8k_ablation_stability.png", "curves_step": "gsm8k_ablation_curves.png"},
           "moe_stability": {"axis_1": "moe_stability_axis.png", "stability_c1": "moe_stability_stability.png"},
           "smollm2_rl": {"curves_step": "smollm2_rl_curves.png", "clip_fraction": "smollm2_rl_clip_fraction.png"},
           "smollm2_transfer": {"curves_step": "smollm2_transfer_curves.png",
                                "clip_fraction": "smollm2_transfer_clip_fraction.png"}}
# experiments/claims/: checked on the moe page's own runs (and the moe_update probe)
MOE_CLAIMS = ("moe_expert_volatility", "moe_routing_replay", "moe_ratio_spread")
# per-run means over training steps
MECHANICS = ("clip_frac", "ratio_std", "kl_behavior", "entropy", "grad_norm", "completion_len_mean")
# each SmolLM2 experiment and the tiny model's cell it transfers: (experiment, overrides); the tiny runs go into a
# folder of their own (name=...), apart from the main page's quickstart and any other offpolicy cells
SMOLLM2 = {"smollm2_rl": ("quickstart", ["name=transfer_tiny_base"]),
           "smollm2_transfer": ("offpolicy", ["name=transfer_tiny_stress", "sweep.grid.train.num_minibatches=[8]"])}
# each SmolLM2 experiment's claims (experiments/claims/), checked on its runs
SMOLLM2_CLAIMS = {"smollm2_rl": ("ctpo_outperforms_smollm2",),
                  "smollm2_transfer": ("gspo_clips_more_smollm2", "gspo_stable_offpolicy_smollm2")}
SMOLLM2_STAGES = {"rl": ("smollm2_rl",), "both": tuple(SMOLLM2)}  # --with-smollm2's choices: the experiments each runs


def mechanics_table(exp_dir: Path) -> str:
    """Per cell and objective (never pooled over cells): the mean over steps of each mechanics metric, averaged over
    seeds (min–max over seeds)."""
    exp = load_results(exp_dir)
    metrics = exp.metrics[exp.metrics["run_id"].isin(exp.runs.loc[exp.runs["counted"], "run_id"])]
    train = metrics[metrics["step"] >= 1]
    rows = []
    for (cell, objective), runs in train.groupby(["cell", "objective"], sort=True):
        row = {"cell": cell, "objective": objective, "seeds": runs["run_id"].nunique()}
        for key in MECHANICS:
            if key in runs and runs[key].notna().any():
                per_run = runs.groupby("run_id")[key].mean()
                row[key] = f"{per_run.mean():.3g} ({per_run.min():.3g}–{per_run.max():.3g})"
        rows.append(row)
    return md_table(pd.DataFrame(rows).fillna("not reported"))


def time_table(exp_dir: Path) -> str:
    """Where a run's wall time goes, per cell and objective (mean over runs): sampling, update, the rest
    (evaluations, start-up, model loading, records); and its CPU seconds (summary.json's cpu_time_s: with other work
    on the machine, the cost that its wall time is not)."""
    exp = load_results(exp_dir)
    counted = exp.runs[exp.runs["counted"]]
    train = exp.metrics[(exp.metrics["step"] >= 1) & exp.metrics["run_id"].isin(counted["run_id"])]
    rows = []
    for (cell, objective), runs in train.groupby(["cell", "objective"], sort=True):
        these = counted[(counted["objective"] == objective) & (counted["cell"] == cell)]
        wall = these["wall_time_s"].mean()
        rollout = runs.groupby("run_id")["rollout_s"].sum().mean()
        update = runs.groupby("run_id")["update_s"].sum().mean()
        rows.append({"cell": cell, "objective": objective, "wall time per run (s)": f"{wall:.1f}",
                     "CPU time per run (s)": num(these["cpu_time_s"].mean()),
                     "sampling": f"{rollout:.1f} s ({rollout / wall:.0%})", "update": f"{update:.1f} s "
                     f"({update / wall:.0%})", "evaluation, start-up, records": f"{wall - rollout - update:.1f} s "
                     f"({(wall - rollout - update) / wall:.0%})"})
    return md_table(pd.DataFrame(rows))


GAIN_NOTE = ("Final eval accuracy minus the start's, paired by seed and eval problem: each interval covers the seeds' "
             "and the eval problems' spread, from the experiment's one starting policy (another warm start of the same "
             "recipe is not sampled); below 5 seeds it is indicative.")


def gain_table(exp_dir: Path) -> str:
    """Per cell and objective: the final eval accuracy minus the start's, paired by seed and eval problem (every run
    of a cell starts from one policy and scores the same problems at step 0 and at its last evaluation), with the
    interval analysis/accuracy.py gives any paired accuracy difference (seeds' and eval problems' spreads)."""
    exp = load_results(exp_dir)
    rows = []
    for (cell, objective), group in exp.runs.groupby(["cell", "objective"], sort=True):
        end, start = (runs_scores(group, exp.samples, column) for column in (FINAL, START))
        gain = interval_of(paired_units(end, start), DIFFERENCE_RANGE)
        if not gain.n:
            continue
        rows.append({"cell": cell, "objective": objective, "seeds": gain.n,
                     "start": num(np.mean([value for _, value, _ in start.values()])),
                     "end": num(np.mean([value for _, value, _ in end.values()])),
                     "end − start [95% CI]": f"{num(gain.mean)} {ci_text(gain.low, gain.high)}"
                     + ("" if gain.problems else " (over seeds only: per-problem scores missing)"),
                     "above the start": "yes" if gain.low > 0 else "no" if gain.high < 0 else "cannot tell"})
    return md_table(pd.DataFrame(rows))


def pair_differences(exp_dir: Path, objectives) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(A, B) with A before B by name -> final eval accuracy of A minus B paired by seed and eval problem with its
    interval (analysis.paired.per_cell), for the pairs of ``objectives`` in an experiment of one cell."""
    exp = load_results(exp_dir)
    out = {}
    for row in paired.per_cell(exp.runs, samples=exp.samples).itertuples():
        if {row.a, row.b} <= set(objectives):
            sign = 1 if row.a < row.b else -1
            low, high = sorted((sign * row.difference_low, sign * row.difference_high))
            out[tuple(sorted((row.a, row.b)))] = (sign * row.difference, low, high)
    return out


def transfer_verdict(tiny: tuple[float, float, float], smol: tuple[float, float, float]) -> str:
    """Whether a tiny-model difference between two objectives holds on SmolLM2 (each: difference, low, high)."""
    side = lambda d: 0 if not d[1] > 0 and not d[2] < 0 else np.sign(d[0])  # noqa: E731 (0: the interval meets 0)
    if side(tiny) == 0:
        return "no tiny-model difference; SmolLM2 separates them" if side(smol) else "neither separates them"
    if side(smol) == 0:
        return "cannot be told apart on SmolLM2 at this budget"
    return "holds" if side(smol) == side(tiny) else "does not hold: SmolLM2 reverses it"


def transfer_section(results_dir: Path, jobs: int, experiments: tuple[str, ...] = tuple(SMOLLM2)) -> str:
    """Per SmolLM2 experiment of ``experiments``, the tiny model's runs of the matching cell (same objectives; run
    here), and per pair of objectives both models' paired difference of final accuracy and whether the tiny model's
    finding holds."""
    rows = []
    for name in experiments:
        tiny_name, overrides = SMOLLM2[name]
        objectives = list(load_experiment(name, []).sweep.grid["objective.name"])
        cfg = load_experiment(tiny_name, [f"results_dir={results_dir}",
                                          f"sweep.grid.objective.name=[{','.join(objectives)}]", *overrides])
        run_sweep(cfg, jobs=jobs, progress=False)
        tiny, smol = (pair_differences(folder, objectives) for folder in (results_dir / cfg.name, results_dir / name))
        for pair in sorted(set(tiny) & set(smol)):
            rows.append({"SmolLM2 experiment": name, "tiny model's cell": f"{tiny_name} {' '.join(overrides[1:])}",
                         "A − B": " − ".join(pair), "tiny model [95% CI]": f"{num(tiny[pair][0])} "
                         f"{ci_text(*tiny[pair][1:])}", "SmolLM2 [95% CI]": f"{num(smol[pair][0])} "
                         f"{ci_text(*smol[pair][1:])}", "on SmolLM2": transfer_verdict(tiny[pair], smol[pair])})
    return ("## Transfer: the tiny model's differences on SmolLM2\n\nFinal eval accuracy of A minus B, paired by seed "
            "(analysis/paired.py), on the tiny char-level model (its experiment and cell, run here) and on SmolLM2 "
            "at the same objectives and the same stress. A finding *holds* when both intervals exclude 0 on the same "
            f"side.\n\n{md_table(pd.DataFrame(rows))}\n")


def document(name: str, results_dir: Path, jobs: int) -> str:
    """Sweep ``name``, write its report, copy its figures; returns its section of the results page."""
    cfg = load_experiment(name, [f"results_dir={results_dir}"])
    exp_dir = results_dir / name
    entries, timing = timed_sweep(exp_dir, [run_id(run) for run in run_configs(cfg)], jobs,
                                  lambda: run_sweep(cfg, jobs=jobs))
    report = build_report(exp_dir).parent
    for figure, target in FIGURES.get(name, {}).items():
        if (report / f"{figure}.png").exists():
            shutil.copyfile(report / f"{figure}.png", DOCS / target)
    finished = sum(e["status"] == "finished" for e in entries)
    figures = "".join(f"\n![{name} {figure}]({target})\n" for figure, target in FIGURES.get(name, {}).items())
    runs = runs_stamp(load_results(exp_dir).runs.to_dict("records"))
    return (f"## {name}\n\n`make sweep EXP={name}` — {finished}/{len(entries)} runs finished in "
            f"{timing.wall_s / 60:.1f} min (wall time of the sweep, including a warm start when the cache lacked it; "
            f"1-minute load average {timing.load_before:.2f} before, {timing.load_after:.2f} after).{timing.note()} "
            f"{runs}\n\n"
            f"### Verdict\n\n{verdict_list(report)}\n"
            f"### Start and end accuracy\n\n{(report / 'headline.md').read_text()}\n"
            f"### Eval accuracy\n\n{(report / 'eval_accuracy.md').read_text()}\n"
            f"### Mechanics (mean over training steps; seeds' mean, min–max)\n\n{mechanics_table(exp_dir)}\n\n"
            f"### Where a run's time goes ({jobs} runs at a time; machine-dependent)\n\nWall-clock times of this "
            "machine under the load stamped above: a difference between objectives here can be the load's.\n\n"
            f"{time_table(exp_dir)}\n"
            f"{figures}")


def verdict_list(report: Path) -> str:
    """The report's verdict (verdict.txt: one line per cell) as a Markdown list."""
    return "".join(f"- {line}\n" for line in (report / "verdict.txt").read_text().splitlines()) or "- none\n"


def claims_section(names: tuple[str, ...], results_dir: Path, jobs: int) -> str:
    """The claims ``names`` checked on their experiments' runs under ``results_dir`` (run or resumed there)."""
    claims = load_claims(list(names))
    tables_of = {}
    for claim in claims:
        kind, name, overrides, wanted, seeds = claim.key
        key = (kind, name, (*overrides, f"results_dir={results_dir}"), wanted, seeds)
        tables_of[claim.key] = run_source(*key[:3], start_seeds(key, jobs, False, run=True), seeds, jobs=jobs,
                                          progress=False)
    rows = pd.DataFrame(ledger_rows(claims, tables_of))
    return (f"## The claims on these runs (experiments/claims/: {', '.join(names)})\n\n"
            f"{md_table(rows[['claim', 'experiment', 'measured', 'holds?', 'replication']])}\n")


def zoo_page(results_dir: Path, jobs: int, stage: str = "both") -> None:
    """docs/zoo.md: the zoo run (or resumed) into ``results_dir``; both stages: its confirmed leaderboard, the plan
    and the screen's leaderboard; ``stage="screen"``: the screen's leaderboard alone, said to be no verdict."""
    zoo(jobs=jobs, overrides=[f"results_dir={results_dir}"], progress=False, stage=stage)
    if stage == "screen":
        atomic_write(DOCS / "zoo.md", "Do not edit by hand: `make docs WITH_ZOO=screen` writes this page (the zoo's "
                     "first stage, docs/replicates.md). The confirmation has not run: this screen (one starting "
                     "policy, 3 seeds) says where to look, not which objective is better; `make docs WITH_ZOO=1` runs "
                     "both stages and writes the confirmed leaderboard here.\n\n"
                     + (results_dir / "zoo" / "screen" / "leaderboard.md").read_text())
        return
    parts = [(results_dir / "zoo" / name).read_text()
             for name in ("leaderboard.md", "confirm/plan.md", "screen/leaderboard.md")]
    written = (f"Written by code {code_record()['version']} on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from the runs "
               f"in {results_dir / 'zoo'} (their own code is named under each leaderboard; runs that had ended were "
               "read, not run again).")
    atomic_write(DOCS / "zoo.md", "Do not edit by hand: `make docs WITH_ZOO=1` writes this page (the zoo in two "
                 "stages, docs/replicates.md: the confirmed leaderboard, the plan written before the confirmation ran, "
                 f"the screen's leaderboard). {written}\n\n" + parts[0] + "\n"
                 + "\n".join(re.sub(r"^#", "##", part, flags=re.M) for part in parts[1:]))


def smollm2_page(header: Callable[[datetime], str], results_dir: Path, jobs: int, stage: str = "both") -> None:
    """docs/results_smollm2.md: the experiments of SMOLLM2_STAGES[stage] (each with its gain over the start and the
    paired differences between objectives), then their transfer table and the SmolLM2 claims checked on their runs;
    an experiment the stage leaves out is said not to have run."""
    experiments, since = SMOLLM2_STAGES[stage], datetime.now(UTC)
    left_out = [name for name in SMOLLM2 if name not in experiments]
    note = ""
    if left_out:
        note = (f"Not run at this code version: {', '.join(left_out)} (its sections, transfer rows and claims; "
                   "`make docs WITH_SMOLLM2=1 SKIP_MAIN=1` runs every SmolLM2 experiment).\n\n")
    sections = []
    for name in experiments:
        section = document(name, results_dir, jobs)  # sweeps it and writes its report
        pairs = (results_dir / name / "report" / "paired.md").read_text()
        sections.append(f"{section}\n### Gain over the start\n\n{GAIN_NOTE}\n\n{gain_table(results_dir / name)}\n\n"
                        f"### Paired differences between objectives\n\n{pairs}")
    atomic_write(DOCS / "results_smollm2.md", "# SmolLM2-135M-Instruct under RL, measured\n\n" + header(since) + note
                 + "\n".join(sections) + "\n" + transfer_section(results_dir, jobs, experiments) + "\n"
                 + claims_section(tuple(c for name in experiments for c in SMOLLM2_CLAIMS[name]), results_dir, jobs))


def main(with_gsm8k: bool = False, jobs: int = 2, with_zoo: str | None = None, with_moe: bool = False,
         skip_main: bool = False, with_smollm2: str | None = None) -> int:
    version = code_record()["version"]
    results_dir = ROOT / "results" / "docs" / version
    began = datetime.now(UTC)

    def header(since: datetime) -> str:  # when a page is written: the policies built since its runs began
        return (f"Generated by `make docs` with code {version} on {began:%Y-%m-%d %H:%M} UTC.\n"
                f"Machine: {machine(jobs)}. {cache_sentence(since)}\n"
                "Do not edit by hand: run `make docs` (add `WITH_GSM8K=1` for gsm8k_ablation; `WITH_MOE=1` for "
                "moe_stability; `WITH_SMOLLM2=1` for smollm2_rl and smollm2_transfer (`WITH_SMOLLM2=rl`: smollm2_rl "
                "alone), the longest; `SKIP_MAIN=1`: only those pages).\n\n")
    tables = names.write_docs()  # the generated tables of docs/trl.md and README.md (harness/run/names.py)
    if not skip_main:
        main_page(header, results_dir, jobs)
    if with_gsm8k:
        since = datetime.now(UTC)
        section = document("gsm8k_ablation", results_dir, jobs)
        atomic_write(DOCS / "results_gsm8k.md", "# gsm8k_ablation, measured\n\n" + header(since) + section)
    if with_zoo:  # the leaderboard carries its own stamp (machine, wall time, load; its runs' code and threads)
        zoo_page(results_dir, jobs, with_zoo)
    if with_moe:
        since = datetime.now(UTC)
        section = document("moe_stability", results_dir, jobs) + "\n" + claims_section(MOE_CLAIMS, results_dir, jobs)
        atomic_write(DOCS / "results_moe.md", "# moe_stability, measured\n\n" + header(since) + section)
    if with_smollm2:
        smollm2_page(header, results_dir, jobs, with_smollm2)
    pages = [("results.md", not skip_main), ("results_gsm8k.md", with_gsm8k), ("zoo.md", bool(with_zoo)),
             ("results_moe.md", with_moe), ("results_smollm2.md", bool(with_smollm2))]
    print("wrote " + ", ".join([str(DOCS / page) for page, written in pages if written] + [str(p) for p in tables]))
    return 0


def cache_sentence(since: datetime) -> str:
    """What the cache held for a page's runs: the starting policies built into it since they began (``since``), read
    from their sidecars (harness/policy/warm_start.py builds_since); the others were loaded."""
    where = os.environ.get("RLVR_CACHE") or "~/.cache/rlvr-harness"
    built, missed = builds_since(since)
    if not built:
        return f"Cache: {where}; this page's runs built no starting policy into it."
    return (f"Cache: {where}; this page's runs built {built} starting {'policy' if built == 1 else 'policies'} into "
            f"it ({missed} of them missed their band); any other a run used was loaded from it.")


def main_page(header: Callable[[datetime], str], results_dir: Path, jobs: int) -> None:
    """docs/results.md: quickstart, gspo_clip_repro and a soak."""
    since = datetime.now(UTC)
    sections = [document(name, results_dir, jobs) for name in ("quickstart", "gspo_clip_repro")]
    soak = subprocess.run([sys.executable, "-m", "harness", "soak", "--kills", "10"], cwd=ROOT, capture_output=True,
                          text=True)
    sections.append(f"## make soak\n\n`make soak KILLS=10`: {soak.stdout.strip() or soak.stderr.strip()}\n")
    atomic_write(DOCS / "results.md", "# Measured results\n\n" + header(since) + "\n".join(sections))
