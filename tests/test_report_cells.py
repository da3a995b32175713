"""The report per (objective, cell), on synthetic results folders (tests/fake_runs.py): cells and duplicates, killed
runs, collapse counts, data warnings, every damaged or unfinished state, the figures over swept axes, the order."""

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import build_report, load_experiment
from analysis.load import AnalysisWarning
from analysis.report import config_summary, eval_table, headline_display, md_table, status_lines
from harness.run.locks import RUN_LOCK, lock_folder
from harness.run.provenance import code_record
from tests.helpers.fake_runs import Shape, code_segments, fake_experiment, fake_run, grid_experiment, unrasterized

ROOT = Path(__file__).resolve().parent.parent


def load(exp: Path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_experiment(exp)
    return loaded, [str(w.message) for w in caught]


def report(exp: Path) -> tuple[str, Path, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        md = build_report(exp, formats=("png",))
    return md.read_text(), md.parent, [str(w.message) for w in caught]


# ---------------------------------------------------------------------------------------------- cells and seeds


def test_a_grid_over_minibatches_with_one_seed_is_two_cells_not_two_seeds(tmp_path):
    exp, _ = load(grid_experiment(tmp_path / "mb", {"train.num_minibatches": [1, 2]}, objectives=("grpo",),
                                  seeds=(0,)))
    assert exp.cells.axes == ["train.num_minibatches"]
    assert exp.cells.labels == ["train.num_minibatches=1", "train.num_minibatches=2"]
    table = eval_table(exp.runs, exp.cells.axes)
    assert list(table["seeds"]) == [1, 1] and list(table["train.num_minibatches"]) == [1, 2]
    # the Python API given one axis as a string: it was read one character at a time (KeyError 't')
    assert eval_table(exp.runs, "train.num_minibatches").equals(table)
    shown = md_table(headline_display(table, exp.cells))
    assert "range" not in shown and "| 1 | grpo |" in shown and "| 2 | grpo |" in shown


@pytest.mark.slow
def test_shipped_mismatch_stability_has_one_cell_per_correction_mode(tmp_path):
    """The shipped sweep's grid and per-objective settings (read from its YAML): its three rollout-correction modes
    are cells; TBPO's train.old_logp (sweep.per_objective) is a setting of the objective, not a cell."""
    import itertools

    import yaml

    sweep = yaml.safe_load((ROOT / "experiments" / "mismatch_stability.yaml").read_text())["sweep"]
    grid = sweep["grid"]
    exp_dir = tmp_path / "mismatch_stability"
    entries = []
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values, strict=True))
        objective, seed = point.pop("objective.name"), point.pop("seed")
        settings = {"train.old_logp": "sampler", "model.sampler_dtype": "bfloat16", **point,
                    **sweep.get("per_objective", {}).get(objective, {})}
        entries.append(fake_run(exp_dir, objective, seed, settings))
    exp, _ = load(fake_experiment(exp_dir, entries))
    modes = sorted(grid["train.rollout_correction.mode"])
    assert exp.cells.axes == ["train.rollout_correction.mode"] and len(modes) == 3
    assert exp.cells.labels == [f"train.rollout_correction.mode={m}" for m in modes]
    assert exp.cells.objective_settings["train.old_logp"]["tbpo"] == "recompute"
    assert exp.cells.objective_settings["train.old_logp"]["grpo"] == "sampler"
    table = eval_table(exp.runs, exp.cells.axes)
    objectives = grid["objective.name"]
    assert len(table) == len(objectives) * 3 and set(table["seeds"]) == {len(grid["seed"])}


def test_seed_zero_runs_of_different_experiments_are_never_three_seeds(tmp_path):
    """Three seed-0 grpo runs copied from different experiments: two differ only in the experiment's name (the same
    condition: duplicates, one counted), the third in its learning rate (another cell)."""
    exp_dir = tmp_path / "mixed"
    entries = [fake_run(exp_dir, "grpo", 0, {"train.lr": 1e-4}, final=0.5, shape=Shape(name="quickstart")),
               fake_run(exp_dir, "grpo", 0, {"train.lr": 1e-4}, final=0.5, shape=Shape(name="quickstart-compare")),
               fake_run(exp_dir, "grpo", 0, {"train.lr": 1e-3}, final=0.5, shape=Shape(name="lr_sweep"))]
    exp, caught = load(fake_experiment(exp_dir, entries))
    table = eval_table(exp.runs, exp.cells.axes)
    assert list(table["seeds"]) == [1, 1] and exp.cells.axes == ["train.lr"]
    assert not table["final_ci_low"].notna().any()  # one seed per cell: no interval, never "95% CI [...] | 3"
    (line,) = [w for w in caught if w.startswith("duplicate runs")]
    kept, other = sorted(r["run_id"] for r in entries[:2])
    assert f"`{other}` has the same settings and seed as `{kept}`; only `{kept}` is counted" in line
    assert exp.runs.set_index("run_id").loc[other, "duplicate_of"] == kept


@pytest.mark.slow
def test_an_objective_setting_written_at_its_own_value_is_the_run_without_it(tmp_path):
    """grpo with objective.advantage=grpo written out, and dapo with its own clip_high=0.28 written out, beside
    runs that leave them out (null, absent): the same computations, the same run ids since the run-id rule, but three
    cells in the report, in which grpo seed 0 was never compared with gspo seed 0 (a hostile pass). Now one cell;
    another estimator or clip_high stays a cell of its own."""
    exp_dir = tmp_path / "spelled"
    entries = [fake_run(exp_dir, "grpo", 0, {"objective.advantage": "grpo"}),
               fake_run(exp_dir, "grpo", 1, {"objective.advantage": None}), fake_run(exp_dir, "gspo", 0),
               fake_run(exp_dir, "gspo", 1), fake_run(exp_dir, "dapo", 0, {"objective.params.clip_high": 0.28}),
               fake_run(exp_dir, "dapo", 1), fake_run(exp_dir, "dapo", 2, {"objective.params.aggregation": ""})]
    exp, _ = load(fake_experiment(exp_dir, entries))
    assert exp.cells.axes == [] and sorted(eval_table(exp.runs, exp.cells.axes)["seeds"]) == [2, 2, 3]
    assert exp.cells.objective_settings == {}
    entries.append(fake_run(exp_dir, "grpo", 2, {"objective.advantage": "opo"}))
    exp, _ = load(fake_experiment(exp_dir, entries))
    assert exp.cells.axes == ["objective.advantage"] and sorted(exp.runs["objective.advantage"].unique()) == [
        "opo", "unset"]


def test_a_hyperparameter_left_out_is_each_objectives_own_value_in_the_cells(tmp_path):
    """quickstart's grpo and gspo at their own clip ranges beside gspo_clip_repro's grpo at clip_high 0.27: grpo and
    gspo at their own values share a cell and are compared; grpo at 0.27 is a cell of its own. Filling each run's
    left-out hyperparameter with its objective's default made a cell of every objective (a raw clip_high means
    another thing for each), and no comparison was left (a hostile pass of the same session)."""
    exp_dir = tmp_path / "mixed"
    entries = [fake_run(exp_dir, objective, seed) for objective in ("grpo", "gspo") for seed in (0, 1)]
    entries += [fake_run(exp_dir, "grpo", seed, {"objective.params.clip_high": 0.27}) for seed in (0, 1)]
    entries += [fake_run(exp_dir, "gspo", 2, {"objective.params.clip_high": 4e-4})]  # gspo's own, written out
    entries += [fake_run(exp_dir, "grpo", 3, {"objective.params.kl_estimator": "k1"})]  # inert at beta 0: its run id
    exp, _ = load(fake_experiment(exp_dir, entries))
    assert exp.cells.axes == ["objective.params.clip_high"] and exp.cells.labels == [
        "objective.params.clip_high=0.27", "objective.params.clip_high=unset"]
    table = eval_table(exp.runs, exp.cells.axes).set_index(["objective", "objective.params.clip_high"])
    assert table.loc[("gspo", "unset"), "seeds"] == 3 and table.loc[("grpo", "unset"), "seeds"] == 3


@pytest.mark.slow
def test_runs_of_other_code_are_pooled_by_the_own_values_that_code_recorded_or_as_written(tmp_path):
    """Runs of older code whose objective had another default: the report read their settings with this checkout's
    own values, so within that version a run that wrote today's default out (gspo at beta 0.0, another value then)
    and one that left out the default of then shared a cell. A run now records what its code left out
    (summary.json's settings_left_out) and its objective's own values; runs of other code that recorded none are
    compared as written (with a warning); a record is read as written by its code."""
    old = code_segments("0ld0ld0")
    exp_dir = tmp_path / "older"
    entries = [fake_run(exp_dir, "gspo", 0, {"objective.params.beta": 0.0}, summary_extra=old),
               fake_run(exp_dir, "gspo", 1, summary_extra=old), fake_run(exp_dir, "gspo", 2, summary_extra=old)]
    for entry in entries:  # written before the records
        path = exp_dir / entry["dir"] / "summary.json"
        summary = json.loads(path.read_text())
        for key in ("settings_left_out", "objective_own"):
            summary.pop(key)
        path.write_text(json.dumps(summary))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exp = load_experiment(fake_experiment(exp_dir, entries))
    assert exp.cells.axes == ["objective.params.beta"]
    assert sorted(eval_table(exp.runs, exp.cells.axes)["seeds"]) == [1, 2]
    assert sorted(exp.runs["settings_read"]) == ["as written"] * 3
    assert any("3 runs of other code (0ld0ld0) did not record" in str(w.message) for w in caught)
    # objective.advantage null names the objective's own estimator in every version: no axis beside the code's
    entries.append(fake_run(exp_dir, "gspo", 3, {"objective.advantage": None}, summary_extra=old))
    path = exp_dir / entries[-1]["dir"] / "summary.json"
    summary = json.loads(path.read_text())
    for key in ("settings_left_out", "objective_own"):
        summary.pop(key)
    path.write_text(json.dumps(summary))
    with pytest.warns(AnalysisWarning, match="4 runs of other code"):
        exp = load_experiment(fake_experiment(exp_dir, entries))
    assert exp.cells.axes == ["objective.params.beta"]
    assert sorted(eval_table(exp.runs, exp.cells.axes)["seeds"]) == [1, 3]
    shutil.rmtree(exp_dir / entries.pop()["dir"])
    shutil.rmtree(exp_dir / entries[0]["dir"])  # read as written, but nothing kept apart: nothing to say
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exp = load_experiment(fake_experiment(exp_dir, entries[1:]))
    assert not any("did not record" in str(w.message) for w in caught) and len(exp.runs) == 2
    # recorded: by its code's reading, whatever this code's own values (beta 0.05 was gspo's own then)
    recorded = {"settings_left_out": ["objective.params.beta"], "objective_own": {"objective.params.beta": 0.05}}
    entries = [fake_run(tmp_path / "kept", "gspo", 0, {"objective.params.beta": 0.05},
                        summary_extra={**old, **recorded}),
               fake_run(tmp_path / "kept", "gspo", 1, summary_extra={**old, **recorded}),
               fake_run(tmp_path / "kept", "gspo", 2, {"objective.params.beta": 0.0},
                        summary_extra={**old, "settings_left_out": []})]
    exp = load_experiment(fake_experiment(tmp_path / "kept", entries))
    table = eval_table(exp.runs, exp.cells.axes)
    assert sorted(table["seeds"]) == [1, 2] and sorted(exp.runs["settings_read"]) == ["recorded"] * 3
    lines, diffs = config_summary(exp)
    assert "objective.params.beta: swept axis (one cell per value): 0.0, unset" in diffs
    # a record that leaves out no null estimator (an empty one) still reads null as the objective's own
    entries = [fake_run(tmp_path / "null", "grpo", seed, {"objective.advantage": None} if seed else {},
                        summary_extra={**old, "settings_left_out": []}) for seed in (0, 1)]
    exp = load_experiment(fake_experiment(tmp_path / "null", entries))
    assert exp.cells.axes == [] and sorted(exp.runs["settings_read"]) == ["recorded"] * 2
    # a record naming other than an objective's settings is damaged (a hostile pass left model.seed out, silently)
    damaged = {**old, "settings_left_out": ["objective.params.beta", "model.seed"]}
    entries = [fake_run(tmp_path / "damaged", "gspo", 0, {"objective.params.beta": 0.0, "model.seed": 2},
                        summary_extra=damaged), fake_run(tmp_path / "damaged", "gspo", 1, summary_extra=old)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exp = load_experiment(fake_experiment(tmp_path / "damaged", entries))
    assert any("`settings_left_out` is not a list of objective settings" in str(w.message) for w in caught)
    assert sorted(exp.runs["settings_read"]) == ["as written", "recorded"] and exp.runs["model.seed"].notna().any()
    # a run of this code is read by this code, whatever its record says (an edited summary.json)
    this = {**code_segments(code_record()["version"]), "settings_left_out": [], "objective_own": {}}
    entries = [fake_run(tmp_path / "this", "grpo", seed, {"objective.advantage": None} if seed else {},
                        summary_extra=this) for seed in (0, 1)]
    exp = load_experiment(fake_experiment(tmp_path / "this", entries))
    assert exp.cells.axes == [] and sorted(exp.runs["settings_read"]) == ["this code"] * 2


def test_the_report_shows_an_objectives_own_value_as_its_runs_code_set_it(tmp_path):
    """'(its own)' showed this checkout's default for runs of any code: a run of other code now shows the value its
    code recorded, or says it was not recorded."""
    exp_dir = tmp_path / "own"
    old = code_segments("0ld0ld0")
    entries = [fake_run(exp_dir, "grpo", 0, {"objective.params.beta": 0.01}, summary_extra=old),
               fake_run(exp_dir, "gspo", 0, summary_extra={**old, "objective_own": {"objective.params.beta": 0.05}})]
    lines, diffs = config_summary(load_experiment(fake_experiment(exp_dir, entries)))
    assert "objective.params.beta: per objective: grpo=0.01, gspo=0.05 (its own)" in diffs
    exp_dir = tmp_path / "unrecorded"
    entries = [fake_run(exp_dir, "grpo", 0, {"objective.params.beta": 0.01}, summary_extra=old),
               fake_run(exp_dir, "gspo", 0, summary_extra=old)]
    path = exp_dir / entries[1]["dir"] / "summary.json"
    summary = json.loads(path.read_text())
    summary.pop("objective_own")
    path.write_text(json.dumps(summary))
    with pytest.warns(AnalysisWarning, match="`settings_left_out` without its `objective_own`"):
        lines, diffs = config_summary(load_experiment(fake_experiment(exp_dir, entries)))
    assert "objective.params.beta: per objective: grpo=0.01, gspo=its own (not recorded by its runs' code)" in diffs
    # a null setting of runs read as written is shown as null, not as the NaN pandas holds it as
    exp_dir = tmp_path / "null"
    entries = [fake_run(exp_dir, "grpo", 0, {"train.max_grad_norm": None}, summary_extra=old),
               fake_run(exp_dir, "grpo", 1, summary_extra=old)]
    for entry in entries:
        path = exp_dir / entry["dir"] / "summary.json"
        summary = json.loads(path.read_text())
        summary.pop("settings_left_out")
        path.write_text(json.dumps(summary))
    lines, diffs = config_summary(load_experiment(fake_experiment(exp_dir, entries)))
    assert "train.max_grad_norm: swept axis (one cell per value): null, unset" in diffs


def test_a_lora_rank_sweep_is_one_axis_whatever_the_adapters_settings(tmp_path):
    """LoRA's settings change nothing at rank 0, but every config.yaml holds them: left out of the rank-0 runs, alpha,
    dropout and the targets became axes beside the rank (the same cells, labels of four settings). Only an
    objective's settings are left out where they change nothing."""
    exp_dir = tmp_path / "lora"
    lora = {"model.lora.alpha": 16, "model.lora.dropout": 0.0, "model.lora.target_modules": ["q_proj", "v_proj"]}
    entries = [fake_run(exp_dir, "grpo", seed, {"model.lora.rank": rank, **lora}) for seed in (0, 1) for rank in (0, 8)]
    exp, _ = load(fake_experiment(exp_dir, entries))
    assert exp.cells.axes == ["model.lora.rank"] and exp.cells.labels == ["model.lora.rank=0", "model.lora.rank=8"]


def test_a_seed_resumed_under_other_memory_settings_stays_a_seed_of_its_cell(tmp_path):
    """A run that ran out of memory and was resumed with the memory settings on (its config.yaml records them): the
    same condition as its other seeds, not a cell of its own."""
    exp_dir = tmp_path / "oom"
    entries = [fake_run(exp_dir, "grpo", 0), fake_run(exp_dir, "grpo", 1, {
        "train.activation_checkpointing": True, "train.lm_head_chunk": 1024, "train.eval_batch_size": 16})]
    exp, _ = load(fake_experiment(exp_dir, entries))
    assert exp.cells.axes == [] and list(eval_table(exp.runs, exp.cells.axes)["seeds"]) == [2]


def test_under_pass_at_k_the_eval_batch_size_is_a_setting_of_the_cell(tmp_path):
    """With train.pass_k the eval batch size decides which random numbers each problem's samples draw (the run id
    keeps it then): two runs that differ in it are two cells, not seeds of one."""
    exp_dir = tmp_path / "passk"
    entries = [fake_run(exp_dir, "grpo", s, {"train.pass_k": 4, "train.eval_batch_size": size})
               for s, size in ((0, 8), (1, 64))]
    exp, _ = load(fake_experiment(exp_dir, entries))
    assert exp.cells.axes == ["train.eval_batch_size"] and exp.runs["cell_id"].nunique() == 2


def test_a_set_written_in_another_order_is_one_setting_of_one_cell(tmp_path):
    """LoRA's target layers and the trust-region rules are sets (the run id orders them): two seeds that wrote one
    set in two orders are seeds of one cell, not two cells of one seed each."""
    exp_dir = tmp_path / "sets"
    lora = {"model.lora.rank": 8}
    entries = [fake_run(exp_dir, "grpo", 0, {**lora, "model.lora.target_modules": ["q_proj", "v_proj"],
                                             "train.rollout_correction.rejection": ["token_k2", "seq_max_k2"],
                                             "train.rollout_correction.rejection_threshold": [2.0, 3.0]}),
               fake_run(exp_dir, "grpo", 1, {**lora, "model.lora.target_modules": ["v_proj", "q_proj"],
                                             "train.rollout_correction.rejection": ["seq_max_k2", "token_k2"],
                                             "train.rollout_correction.rejection_threshold": [3.0, 2.0]})]
    exp, _ = load(fake_experiment(exp_dir, entries))
    assert exp.cells.axes == [] and list(eval_table(exp.runs, exp.cells.axes)["seeds"]) == [2]


def test_a_run_without_its_config_keeps_its_own_code_version(tmp_path):
    """Its settings come from the manifest's grid point and the values the other runs share, but its code version is
    its own (its summary's): runs of two versions are never seeds of one cell."""
    exp_dir = tmp_path / "noconf_code"
    here = code_record()["version"]
    entries = [fake_run(exp_dir, "grpo", s, {"train.lr": 1e-5}, summary_extra=code_segments(here)) for s in (0, 1)]
    entries.append(fake_run(exp_dir, "grpo", 2, {"train.lr": 1e-5}, summary_extra=code_segments("deadbee")))
    (exp_dir / entries[2]["run_id"] / "config.yaml").unlink()
    exp, _ = load(fake_experiment(exp_dir, entries))
    cells = exp.runs.set_index("run_id")["cell_id"]
    assert cells[entries[2]["run_id"]] != cells[entries[0]["run_id"]] == cells[entries[1]["run_id"]]


def test_duplicates_keep_the_ended_run(tmp_path):
    exp_dir = tmp_path / "dup"
    finished = fake_run(exp_dir, "grpo", 0, final=0.6, shape=Shape(name="b"))
    stopped = fake_run(exp_dir, "grpo", 0, status="running", shape=Shape(name="a", steps_done=2))  # first by id
    exp, _ = load(fake_experiment(exp_dir, [stopped, finished]))
    counted = exp.runs.set_index("run_id")["counted"]
    assert counted[finished["run_id"]] and not counted[stopped["run_id"]]


def test_a_run_without_any_settings_is_a_cell_of_its_own(tmp_path):
    exp_dir = tmp_path / "noconf"
    entries = [fake_run(exp_dir, "grpo", 0), fake_run(exp_dir, "grpo", 1, {"train.lr": 1e-3})]
    lost = fake_run(exp_dir, "grpo", 2, shape=Shape(write_config=False))
    lost.pop("overrides")
    exp, caught = load(fake_experiment(exp_dir, [*entries, lost]))
    assert exp.runs.set_index("run_id").loc[lost["run_id"], "cell"] == f"settings unknown ({lost['run_id']})"
    assert any("its settings are unknown, so it is a cell of its own" in w for w in caught)


# ---------------------------------------------------------------------------------------------- collapse


def test_collapse_is_read_from_summary_when_present_else_detected(tmp_path):
    exp_dir = tmp_path / "collapse"
    drop = {4: {"eval_accuracy": 0.05}, 6: {"eval_accuracy": 0.05}}  # 0.2 at the start: a drop of 0.15, twice
    record = {"step": 3, "cause": "clip_saturation", "detail": {"confirmed_at": 5}}
    entries = [fake_run(exp_dir, "grpo", 0, rows=drop, final=0.05),  # old run: the rule finds the drop
               fake_run(exp_dir, "grpo", 1, summary_extra={"collapse": record}),  # the loop's record wins
               fake_run(exp_dir, "grpo", 2, rows=drop, final=0.05, summary_extra={"collapse": None}),  # none
               fake_run(exp_dir, "grpo", 3, status="diverged", rows={4: {"loss": None}}, shape=Shape(steps_done=4)),
               fake_run(exp_dir, "gspo", 0)]
    exp, _ = load(fake_experiment(exp_dir, entries))
    runs = exp.runs.set_index("seed")
    grpo = runs[runs["objective"] == "grpo"]
    causes = [c if isinstance(c, str) else None for c in grpo["collapse_cause"]]
    assert causes == ["eval_drop", "clip_saturation", None, "non_finite_loss"]
    assert list(grpo["collapse_step"].fillna(-1)) == [4, 3, -1, 4]
    assert list(grpo["collapse_source"]) == ["metrics (the report's rule)", "summary.json", "summary.json",
                                             "metrics (the report's rule)"]
    table = eval_table(exp.runs).set_index("objective")
    assert (table.loc["grpo", "collapse_k"], table.loc["grpo", "collapse_n"]) == (3, 4)  # the diverged run counts
    assert table.loc["grpo", "collapse_causes"] == "clip_saturation 1, eval_drop 1, non_finite_loss 1"
    assert table.loc["grpo", "diverged"] == 1 and table.loc["grpo", "seeds"] == 4
    assert (table.loc["gspo", "collapse_k"], table.loc["gspo", "collapse_n"]) == (0, 1)
    assert "| grpo |" in md_table(headline_display(eval_table(exp.runs))) and \
        "3/4" in md_table(headline_display(eval_table(exp.runs)))


# ---------------------------------------------------------------------------------------------- run states


def test_a_killed_run_is_stopped_and_a_live_one_running(tmp_path):
    exp_dir = tmp_path / "live"
    entries = [fake_run(exp_dir, "grpo", 0, status="running", shape=Shape(steps_done=3)),
               fake_run(exp_dir, "grpo", 1, status="running", shape=Shape(steps_done=2))]
    fake_experiment(exp_dir, entries)
    holder = lock_folder(exp_dir / entries[1]["dir"] / RUN_LOCK, "busy")  # a live trainer holds its run's lock
    try:
        exp, _ = load(exp_dir)
    finally:
        holder.close()
    runs = exp.runs.set_index("seed")
    assert runs.loc[0, "status"] == "stopped" and runs.loc[1, "status"] == "running"
    assert runs.loc[0, "problem"] == "stopped at step 3/6 (killed; run the same command to resume)"
    assert runs.loc[1, "problem"] == "status running; 2/6 steps"
    lines = status_lines(exp, eval_table(exp.runs), [])
    assert lines[0] == "2 runs: 1 running now, 1 stopped (killed: run the same command to resume)."
    exp, _ = load(exp_dir)  # the trainer died: its lock is gone
    assert set(exp.runs["status"]) == {"stopped"}
    (exp_dir / entries[1]["dir"] / "summary.json").unlink()  # a run its sweep has launched, not yet started
    sweep = lock_folder(exp_dir / ".sweep.lock", "busy")
    try:
        exp, _ = load(exp_dir)
    finally:
        sweep.close()
    assert list(exp.runs["status"]) == ["stopped", "running"]


def test_a_run_copied_while_it_runs_on_another_host_is_reported_running_there(tmp_path, monkeypatch):
    """A results folder copied from a cluster mid-sweep: its running run's lock is held by nobody here, and the
    report called it stopped (killed: run the same command to resume). Its lock's record of a writer on another
    host with a fresh heartbeat (times injected) makes it running there; once the heartbeat is STALE_S old it is
    stopped, the report naming the host and that a copy that old looks the same."""
    from harness.run import locks
    monkeypatch.setattr(locks, "HOST", "this-test-host")  # never node17, even on a cluster node of that name

    exp_dir = tmp_path / "copied"
    entries = [fake_run(exp_dir, "grpo", 0, status="running", shape=Shape(steps_done=3))]
    fake_experiment(exp_dir, entries)
    (exp_dir / entries[0]["dir"] / RUN_LOCK).write_text(
        json.dumps({"host": "node17", "pid": 4242, "beat": 1_000_000.0}) + "\n")
    monkeypatch.setattr(locks, "clock", lambda: 1_000_000.0 + 60, raising=False)
    exp, _ = load(exp_dir)
    run = exp.runs.iloc[0]
    assert run["status"] == "running"
    assert run["problem"].startswith("running on host node17 (pid 4242; its last heartbeat at 1970-01-12 13:46:40 "
                                     "UTC, 60 s ago), at step 3/6 then (a copy of its folder")
    monkeypatch.setattr(locks, "clock", lambda: 1_000_000.0 + 3 * 3600, raising=False)
    exp, _ = load(exp_dir)
    run = exp.runs.iloc[0]
    assert run["status"] == "stopped" and run["problem"].startswith(
        "stopped at step 3/6 (its lock names a writer on host node17 (pid 4242; its last heartbeat at 1970-01-12 "
        "13:46:40 UTC, 3.0 h ago): stopped there, or this folder is a copy that old; run the same command to resume)")


def test_data_warnings_name_the_run_the_key_and_the_steps(tmp_path):
    exp_dir = tmp_path / "warn"
    entries = [fake_run(exp_dir, "grpo", 0, rows={2: {"loss": None, "grad_norm": None}, 4: {"loss": None}}),
               fake_run(exp_dir, "grpo", 1), fake_run(exp_dir, "grpo", 2),
               fake_run(exp_dir, "gspo", 0, rows={1: {"loss": float("nan")}, 2: {"loss": float("inf")}})]
    fake_experiment(exp_dir, entries)
    cut = exp_dir / entries[1]["dir"] / "metrics.jsonl"  # a finished run whose last line was cut mid-write
    lines = cut.read_text().splitlines()
    cut.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])
    gap = exp_dir / entries[2]["dir"] / "metrics.jsonl"
    gap.write_text("".join(line + "\n" for line in gap.read_text().splitlines() if '"step": 3,' not in line))
    _, caught = load(exp_dir)
    not_a_number = "is not a number (NaN, inf, or null: non-finite when written)"
    assert f"{exp_dir / entries[0]['dir'] / 'metrics.jsonl'}: `loss` {not_a_number} at steps 2, 4" in caught
    nan = exp_dir / entries[3]["dir"] / "metrics.jsonl"  # NaN / Infinity literals (hostile pass case 114): warned too
    assert f"{nan}: `loss` {not_a_number} at steps 1, 2" in caught
    assert any(w.endswith(f"`grad_norm` {not_a_number} at step 2") for w in caught)
    assert f"{cut}: the run is finished but its last line is truncated: step 6 lost (its metrics are not in the " \
           "figures; the summary's numbers still are)" in caught
    assert f"{gap}: step 3 missing (steps done: 6)" in caught


def test_a_finished_run_whose_last_evaluation_is_lost_is_a_data_warning(tmp_path):
    """A finished run whose last step's evaluation is gone from its metrics and its summary was reported with an
    earlier evaluation's accuracy (its step 0's, where it was the only one) as its final one, without a word."""
    exp_dir = tmp_path / "lost"
    entries = [fake_run(exp_dir, "grpo", seed) for seed in range(2)]
    fake_experiment(exp_dir, entries)
    run = exp_dir / entries[0]["dir"]
    summary = json.loads((run / "summary.json").read_text())
    del summary["final_eval_accuracy"]
    (run / "summary.json").write_text(json.dumps(summary))
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in row.items() if k != "eval_accuracy"} if
                                                          row["step"] == 6 else row) + "\n" for row in lines))
    _, caught = load(exp_dir)
    last = max(row["step"] for row in lines[:-1] if "eval_accuracy" in row)
    assert (f"{run / 'metrics.jsonl'}: the run finished at step 6, its last evaluation is step {last}'s (a run "
            "evaluates at its last step): its final eval accuracy is that earlier one") in caught
    assert not any("its last evaluation is" in w and entries[1]["dir"] in w for w in caught)


def test_an_objective_whose_runs_all_failed_is_named_not_a_crash(tmp_path):
    """As `sweep quickstart ... sweep.per_objective={gspo: {threads: -1}}` left it: gspo failed before its first
    step (KeyError 'rollout_tokens' in the compute-performance fit before)."""
    from analysis import scaling

    exp_dir = tmp_path / "failed"
    entries = [fake_run(exp_dir, "grpo", 0),
               fake_run(exp_dir, "gspo", 0, {"threads": -1}, status="failed",
                        summary_extra={"error": "RuntimeError: set_num_threads expects a positive integer"},
                        shape=Shape(steps_done=0))]
    (exp_dir / entries[1]["dir"] / "metrics.jsonl").write_text("")
    exp, _ = load(fake_experiment(exp_dir, entries))
    assert len(exp.cells.labels) == 1  # threads changes no result: grpo and gspo share the cell
    fits = {f.objective: f for f in scaling.fit_objectives(exp.metrics, exp.runs)}
    assert fits["gspo"].fit.reason == "no eval points shared by its finished runs"
    table = eval_table(exp.runs)
    assert "gspo: no run has ended (1 failed); error: RuntimeError: set_num_threads expects a positive integer: " \
           "its accuracy is n/a." in status_lines(exp, table, [])
    # a sweep's run that failed before writing summary.json: the error its train.log ends with
    run_dir = exp_dir / entries[1]["dir"]
    (run_dir / "summary.json").unlink()
    (run_dir / "train.log").write_text("native run on cpu ...\nerror: RuntimeError: no threads (traceback in x)\n")
    exp, _ = load(exp_dir)
    assert exp.runs.set_index("objective").loc["gspo", "problem"] == \
        "status failed; no summary.json; 0/6 steps; error: RuntimeError: no threads (traceback in x)"


STATES = {
    "sweep still running": "1 running now, 1 not started",
    "all runs of an objective failed": "gspo: no run has ended (2 failed); error: ValueError: boom",
    "summary.json deleted": "gspo: no ended run can be read (1 finished, a file it needs missing or damaged: see "
                            "Data warnings): its accuracy is n/a.",
    "metrics.jsonl deleted": "gspo: no ended run can be read (1 finished, a file it needs missing or damaged: see "
                             "Data warnings): its accuracy is n/a.",
    "summary.json unreadable": "unreadable JSON, ignored",
    "only step 0": "stopped at step 0/6 (killed; run the same command to resume)",
    "empty metrics file": "metrics.jsonl: no metrics (empty file)",
}


def write_state(exp_dir: Path, state: str) -> Path:
    entries = [fake_run(exp_dir, "grpo", s, final=0.4 + 0.1 * s) for s in range(2)]
    entries += [fake_run(exp_dir, "gspo", 0, final=0.5)]
    if state == "sweep still running":
        entries.append(fake_run(exp_dir, "gspo", 1, status="running", shape=Shape(steps_done=2)))
        entries.append(fake_run(exp_dir, "gspo", 2, status="pending", shape=Shape(started=False)))
    elif state == "all runs of an objective failed":
        shutil.rmtree(exp_dir / entries[2]["dir"])  # gspo's only runs are the failed ones (every folder is read)
        entries = entries[:2] + [fake_run(exp_dir, "gspo", s, {"threads": -1}, status="failed",
                                          summary_extra={"error": "ValueError: boom"}, shape=Shape(steps_done=0))
                                 for s in range(2)]
    elif state == "summary.json deleted":
        (exp_dir / entries[2]["dir"] / "summary.json").unlink()
    elif state == "metrics.jsonl deleted":  # its summary.json says finished and is readable
        (exp_dir / entries[2]["dir"] / "metrics.jsonl").unlink()
    elif state == "summary.json unreadable":
        (exp_dir / entries[2]["dir"] / "summary.json").write_text('{"status": "fini')
    elif state == "only step 0":
        entries.append(fake_run(exp_dir, "gspo", 1, status="running", shape=Shape(steps_done=0)))
    elif state == "empty metrics file":
        (exp_dir / entries[2]["dir"] / "metrics.jsonl").write_text("")
    return fake_experiment(exp_dir, entries)


@pytest.mark.slow
@pytest.mark.parametrize("state", STATES)
def test_the_report_is_written_whatever_the_folder_holds(tmp_path, monkeypatch, state):
    """Every figure is built from the damaged folder (its images are drawn by the tests of the swept axes)."""
    from analysis import plots

    monkeypatch.setattr(plots, "save", unrasterized)
    exp_dir = write_state(tmp_path / "exp", state)
    if state == "sweep still running":
        holder = lock_folder(next(exp_dir.glob("gspo-s1-*")) / RUN_LOCK, "busy")  # its trainer is alive
    try:
        text, out, caught = report(exp_dir)
    finally:
        if state == "sweep still running":
            holder.close()
    assert STATES[state] in text, state
    assert (out / "report.html").exists() and (out / "eval_accuracy.csv").exists()
    tables = {p.stem: {q.suffix for q in out.glob(f"{p.stem}.*")} for p in out.glob("*.csv")}
    assert len(tables) == 8 and all(kinds == {".csv", ".md"} for kinds in tables.values()), tables  # README's words
    headline = text[text.index("## Start and end accuracy"):text.index("## Figures")]
    assert "| grpo |" in headline


# ---------------------------------------------------------------------------------------------- swept axes


@pytest.mark.slow
def test_two_axis_sweep_report(tmp_path):
    def effect(objective, point, seed):
        return 0.3 + 0.05 * point["train.epochs"] * (1 if objective == "gspo" else -1) + 0.01 * seed

    exp_dir = grid_experiment(tmp_path / "grid", {"train.epochs": [1, 2], "train.rollout_correction.mode":
                                                  ["none", "token_truncate"]}, effect=effect)
    first = json.loads((exp_dir / "manifest.json").read_text())["runs"][0]  # grpo, seed 0, epochs 1, mode none
    collapsed = exp_dir / first["dir"]  # collapsed, by the loop's record
    summary = json.loads((collapsed / "summary.json").read_text())
    (collapsed / "summary.json").write_text(json.dumps({**summary, "collapse": {"step": 2, "cause": "entropy_floor"}}))
    text, out, _ = report(exp_dir)
    for stem in ("axis_1", "axis_2", "heatmap_1", "heatmap_collapse_1", "curves_step_c1", "curves_step_c4"):
        assert (out / f"{stem}.png").stat().st_size > 10_000, stem
    # order: headline, then the figures (axes first), then the tables
    first_figure, first_table = text.index("!["), text.index("## Eval accuracy per objective and cell")
    assert text.index("## Start and end accuracy") < text.index("## Figures") < first_figure < first_table
    assert "taken as given, so the best's mean and interval lean upward" in text  # a max over evaluations
    assert text.index("(axis_1.png)") < text.index("(curves_step_c1.png)")
    assert text.index("## Paired comparisons") > first_table and text.index("## Runs\n") > text.index("## Collapse")
    assert "- cell 1: `train.epochs=1, train.rollout_correction.mode=none` — grpo (3 seeds), gspo (3 seeds)" in text
    table = pd.read_csv(out / "eval_accuracy.csv")
    assert len(table) == 8 and {"train.epochs", "train.rollout_correction.mode"} <= set(table.columns)
    row = table[(table["objective"] == "grpo") & (table["train.epochs"] == 1)
                & (table["train.rollout_correction.mode"] == "none")].iloc[0]
    assert row["final_mean"] == pytest.approx(0.26) and (row["collapse_k"], row["collapse_n"]) == (1, 3)
    pairs = pd.read_csv(out / "paired.csv")
    assert len(pairs) == 4 and set(pairs["n"]) == {3}
    epochs2 = pairs[pairs["cell"].str.startswith("train.epochs=2")]
    assert (pairs["a"] == "gspo").all() and (pairs["b"] == "grpo").all()  # against the baseline, grpo
    assert np.allclose(epochs2["difference"], 0.2)  # gspo - grpo at 2 epochs: 0.1 - (-0.1), every seed
    assert "| epochs | mode | A | B | paired seeds |" in text
    aggregate = pd.read_csv(out / "paired_aggregate.csv").iloc[0]
    assert aggregate["cells"] == 4 and aggregate["difference"] == pytest.approx(0.15)
    assert "## Verdict (baseline: grpo)" in text and "- cell `train.epochs=2, train.rollout_correction.mode=none`: " \
        in text  # one sentence per cell
    assert "KL to behaviour: `kl_behavior` is the k1 estimate" in text


@pytest.mark.slow
def test_end_to_end_two_axis_sweep(tmp_path, monkeypatch, capsys):
    """A real (tiny) sweep over two axes, then its report: the cells, the axis figures and the heat map. The sweep
    is the CLI's, called here; its runs train in its worker process."""
    from harness.apps.cli import main
    from tests.helpers.tiny import TINY_RUN

    monkeypatch.chdir(ROOT)
    exp = tmp_path / "axes.yaml"
    exp.write_text("sweep:\n  grid:\n    train.num_minibatches: [1, 2]\n    train.lr: [1.0e-4, 1.0e-3]\n")  # 4 runs
    tiny = [o for o in TINY_RUN if not o.startswith(("train.num_minibatches=", "train.lr="))]  # would pin the axes
    code = main(["sweep", str(exp), *tiny, "train.steps=2", "model.warm_start_steps=0", "model.warm_start_target=null",
                 f"results_dir={tmp_path}/res", "--jobs", "1", "--no-progress"])
    assert code == 0, capsys.readouterr().err[-2000:]
    report_dir = tmp_path / "res" / "axes" / "report"
    text = (report_dir / "report.md").read_text()
    assert "Cells (4):" in text and "- cell 4: `train.lr=0.001, train.num_minibatches=2`" in text
    for stem in ("axis_1", "axis_2", "heatmap_1"):
        assert (report_dir / f"{stem}.png").exists(), stem
    assert len(pd.read_csv(report_dir / "eval_accuracy.csv")) == 4


def test_the_axis_figures_draw_the_start_beside_the_end_accuracy():
    """Accuracy axes show the start: the step-0 mean of each cell (over its objectives' runs that have one) as a grey
    dashed line, so that an end reads as a gain or a loss."""
    import matplotlib.pyplot as plt

    from analysis.axes import start_curve
    from analysis.cells import canon

    part = pd.DataFrame({"train.epochs": [1, 1, 2, 2, 4], "start_mean": [0.2, 0.4, 0.5, 0.5, 0.9],
                         "start_n": [3, 3, 3, 3, 0]})  # the last cell has no step-0 evaluation
    fig, ax = plt.subplots()
    start_curve(ax, part, "train.epochs", {canon(1): 0.0, canon(2): 1.0, canon(4): 2.0})
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0.0, 1.0] and np.allclose(line.get_ydata(), [0.3, 0.5])
    assert line.get_linestyle() == "--"
    plt.close(fig)


@pytest.mark.slow
def test_the_axis_figures_bars_stay_inside_0_and_1():
    """A final accuracy whose t-interval over 3 seeds reaches below 0 (and a best one above 1): its bar stops at 0
    (and at 1), as the curves' bands do; the tables keep the whole interval."""
    import matplotlib
    import matplotlib.pyplot as plt

    from analysis import plots
    from analysis.axes import axis_figure
    from analysis.cells import Cells

    table = pd.DataFrame({"objective": ["grpo", "grpo"], "train.epochs": [1, 2], "cell_id": [0, 1],
                          "final_mean": [0.04, 0.5], "final_ci_low": [-0.07, 0.4], "final_ci_high": [0.15, 0.6],
                          "best_mean": [0.95, 0.5], "best_ci_low": [0.85, 0.4], "best_ci_high": [1.05, 0.6],
                          "collapse_rate": [0.0, 0.0], "collapse_low": [0.0, 0.0], "collapse_high": [0.56, 0.56],
                          "start_mean": [0.3, 0.3], "start_n": [3, 3], "final_n": [3, 3]})
    cells = Cells(axes=["train.epochs"], labels=["train.epochs=1", "train.epochs=2"],
                  values=[{"train.epochs": 1}, {"train.epochs": 2}])
    made = axis_figure(table, cells, "train.epochs", plots.styles(["grpo"]), "t", False, "axis_1")
    ends = []
    for ax in made.fig.axes[:2]:
        (bars,) = [c for c in ax.collections if isinstance(c, matplotlib.collections.LineCollection)]
        ends.append(np.concatenate([seg[:, 1] for seg in bars.get_segments()]))
    assert ends[0].min() == 0.0 and ends[0].max() == pytest.approx(0.6)  # final: -0.07 drawn as 0
    assert ends[1].max() == 1.0 and ends[1].min() == pytest.approx(0.4)  # best: 1.05 drawn as 1
    assert "drawn inside [0, 1]" in made.caption
    plt.close(made.fig)


def test_the_configuration_says_the_adapters_backend_and_precision_the_runs_shared(tmp_path):
    """A folder of LoRA runs through TRL in bfloat16 was reported as "model: tiny" and nothing more: read as full
    fine-tuning on the native loop in float32."""
    exp_dir = tmp_path / "lora"
    shared = {"model.lora.rank": 16, "backend": "trl", "model.dtype": "bfloat16"}
    entries = [fake_run(exp_dir, "grpo", seed, shared) for seed in (0, 1)]
    lines, diffs = config_summary(load_experiment(fake_experiment(exp_dir, entries)))
    assert {"LoRA rank (0: full fine-tuning): 16", "backend: trl", "precision: bfloat16"} <= set(lines) and not diffs


def test_the_configuration_says_the_lag_correction_replay_and_old_logprobs_the_runs_ran(tmp_path):
    """A folder of runs at train.rollout_lag=4 under decoupled PPO was reported as the synchronous quickstart: nothing
    named the lag, the correction, or that the old log-probs were recomputed although config.yaml says
    old_logp: sampler (a correction recomputes them whatever it says)."""
    exp_dir = tmp_path / "async"
    shared = {"train.rollout_lag": 4, "train.lag_mode": "mixed", "train.in_flight_tokens": 0,
              "train.old_logp": "sampler", "train.rollout_correction.mode": "decoupled_ppo",
              "train.rollout_correction.threshold": 5.0, "train.rollout_correction.threshold_lower": None,
              "train.routing_replay": "none"}
    entries = [fake_run(exp_dir, "grpo", seed, shared) for seed in (0, 1)]
    lines, diffs = config_summary(load_experiment(fake_experiment(exp_dir, entries)))
    assert {"policy lag (train.rollout_lag): 4 (mixed ages)", "rollout correction: decoupled_ppo",
            "routing replay: none", "old log-probs: recompute (the proximal policy's, recomputed)"} <= set(lines)
    assert not diffs
    exp_dir = tmp_path / "in_flight"
    shared = {**shared, "train.lag_mode": "fixed", "train.in_flight_tokens": 3, "train.rollout_correction.mode": "none"}
    entries = [fake_run(exp_dir, "grpo", 0, shared), fake_run(exp_dir, "grpo", 1, {**shared, "train.rollout_lag": 0})]
    lines, diffs = config_summary(load_experiment(fake_experiment(exp_dir, entries)))
    assert "policy lag (train.rollout_lag): differs between runs: 0; 4 (fixed, in flight every 3 tokens)" in lines
    assert "old log-probs: sampler (the behaviour policy's)" in lines


def test_duplicates_whose_results_differ_say_so(tmp_path):
    """Two copies of one run (same settings, seed and code) whose final accuracies differ (a rerun on other
    hardware, a copy edited): one is counted, by its records and then by name, and the warning said only "has the
    same settings and seed", so the reader could not tell that the result left out was another one."""
    exp_dir = tmp_path / "dup"
    entries = [fake_run(exp_dir, "grpo", 0, final=0.5, shape=Shape(name="quickstart")),
               fake_run(exp_dir, "grpo", 0, final=0.9, shape=Shape(name="quickstart-again"))]
    exp, caught = load(fake_experiment(exp_dir, entries))
    (line,) = [w for w in caught if w.startswith("duplicate runs")]
    kept, other = sorted(r["run_id"] for r in entries)
    finals = {r["run_id"]: f for r, f in zip(entries, ("0.500", "0.900"), strict=True)}
    assert (f"their final eval accuracies differ (`{kept}` {finals[kept]}, `{other}` {finals[other]}): the one "
            "counted is chosen by its records (ended, complete, steps done), then by name, never by its result") in line
    same = [fake_run(tmp_path / "same", "grpo", 0, final=0.5, shape=Shape(name=n)) for n in ("a", "b")]
    exp, caught = load(fake_experiment(tmp_path / "same", same))
    (line,) = [w for w in caught if w.startswith("duplicate runs")]
    assert "differ" not in line
