"""analysis/timing.py: a run's wall time split into its logged phases, by hand."""

import pandas as pd

from analysis.timing import MEMORY, MEMORY_LABEL, run_phases, time_table


def test_phases_add_up_to_the_wall_time():
    runs = pd.DataFrame({"run_id": ["a", "b", "c"], "objective": ["grpo", "grpo", "gspo"],
                         "wall_time_s": [100.0, 120.0, 50.0], "complete": [True, True, False]})
    metrics = pd.DataFrame({
        "run_id": ["a", "a", "a", "b", "b"], "step": [0, 1, 2, 0, 1],
        "rollout_s": [None, 10.0, 12.0, None, 30.0], "update_s": [None, 20.0, 20.0, None, 40.0],
        "update_logp_forward_s": [None, 5.0, 5.0, None, None], "update_backward_s": [None, 10.0, 9.0, None, None],
        "update_optimizer_s": [None, 1.0, 1.0, None, None], "eval_s": [8.0, None, 8.0, 10.0, 10.0]})
    phases = run_phases(runs, metrics).set_index("run_id")
    assert list(phases.index) == ["a", "b"]  # finished runs only
    a, b = phases.loc["a"], phases.loc["b"]
    assert (a.rollout_s, a.update_logp_forward_s, a.update_backward_s, a.update_optimizer_s) == (22, 10, 19, 2)
    assert a.update_other_s == 40 - 31 and a.eval_s == 16 and a.other_s == 100 - 22 - 40 - 16
    assert b.update_s == 40 and b.eval_s == 20 and b.other_s == 120 - 30 - 40 - 20  # logged before the split
    table = time_table(runs, metrics)
    assert table.loc[0, "runs"] == 2 and table.loc[0, "wall time (s)"] == 110.0
    assert table.loc[0, "rollout"] == "26.0 s (24%)" and table.loc[0, "evaluations"] == "18.0 s (16%)"


def test_the_table_shows_each_phase_peak_memory_of_the_runs():
    runs = pd.DataFrame({"run_id": ["a", "b"], "objective": ["grpo", "grpo"], "wall_time_s": [100.0, 120.0],
                         "complete": [True, True]})
    metrics = pd.DataFrame({
        "run_id": ["a", "a", "a", "b", "b"], "step": [0, 1, 2, 0, 1], "rollout_s": [None, 10.0, 12.0, None, 30.0],
        "update_s": [None, 20.0, 20.0, None, 40.0], "eval_s": [8.0, None, 8.0, 10.0, 10.0],
        "peak_mem_rollout_mb": [None, 500.0, 700.0, None, 900.0],
        "peak_mem_update_mb": [None, 800.0, 600.0, None, 1000.0],
        "peak_mem_eval_mb": [400.0, None, 450.0, None, None]})
    table = time_table(runs, metrics)  # per run the largest step, then the mean over runs; b logged no eval peak
    assert table.loc[0, MEMORY_LABEL] == "800 / 900 / 450"
    assert MEMORY_LABEL not in time_table(runs, metrics.drop(columns=list(MEMORY)))  # runs logged before it
