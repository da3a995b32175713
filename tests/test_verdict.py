"""analysis/verdict.py: Holm's correction by hand, the sentences, the ranking; and the figures' fixed looks."""

import warnings

import numpy as np
import pandas as pd
import pytest
from matplotlib import pyplot as plt

from analysis import plots, stats, verdict


def test_holm_by_hand():
    # sorted 0.01, 0.02, 0.04 of 3 tests: 3 x 0.01, max(0.03, 2 x 0.02), max(0.04, 1 x 0.04)
    assert verdict.holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    assert verdict.holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped at 1
    adjusted = verdict.holm([0.01, np.nan])
    assert adjusted[0] == pytest.approx(0.01) and np.isnan(adjusted[1])  # one test left: no correction


def rows(*comparisons) -> pd.DataFrame:
    """Comparisons to the baseline: (objective, difference, low, high, wins, losses, n, p)."""
    frame = pd.DataFrame(comparisons, columns=["a", "difference", "difference_low", "difference_high", "wins",
                                               "losses", "n", "p_value"])
    return frame.assign(holm=verdict.holm(frame["p_value"]))


def test_sentences_say_which_objective_ends_where_and_correct_for_several():
    one = rows(("ctpo", 0.0156, -0.004, 0.035, 3, 0, 3, 0.12))
    assert verdict.sentence(one, "grpo") == ("no objective differs from grpo at this budget: every paired interval "
                                             "includes 0; 3 seeds: indicative (coverage short of 95% below 5)")
    above = rows(("ctpo", 0.016, 0.004, 0.028, 5, 0, 5, 0.01))
    assert verdict.sentence(above, "grpo") == "ctpo ends above grpo by 0.0160 [0.00400, 0.0280], 5 of 5 seeds"
    # two comparisons: p 0.03 alone would count, but Holm doubles the smaller one
    two = rows(("ctpo", 0.02, 0.001, 0.04, 4, 1, 5, 0.03), ("gspo", -0.01, -0.03, 0.01, 1, 4, 5, 0.4))
    assert verdict.sentence(two, "grpo") == ("no objective differs from grpo at this budget: ctpo's interval alone "
                                             "excludes 0, not after the correction (Holm-corrected over 2 comparisons)")
    neither = rows(("ctpo", 0.02, -0.01, 0.04, 4, 1, 5, 0.1), ("gspo", -0.01, -0.03, 0.01, 1, 4, 5, 0.4))
    assert verdict.sentence(neither, "grpo") == ("no objective differs from grpo at this budget: every paired interval "
                                                 "includes 0 (Holm-corrected over 2 comparisons)")
    # 2 seeds without per-problem scores: the interval shown is their range, which excludes 0 here, but the t-test
    # (df 1) does not: no objective is said to exclude 0, and the range is not called a 95% interval
    two_seeds = rows(("gspo", 0.055, 0.01, 0.10, 2, 0, 2, 0.437))
    assert verdict.sentence(two_seeds, "grpo").startswith(
        "no objective differs from grpo at this budget: no paired t-test excludes 0 at 95% (the range of 2 seeds is "
        "not a 95% interval)")
    # no interval (one paired seed), hence no p-value: said so, and not counted in Holm's family
    why = "(fewer than 2 seeds, or seeds that agree exactly and lack per-problem scores)"
    single = rows(("ctpo", 0.01, np.nan, np.nan, 1, 0, 1, np.nan), ("gspo", -0.02, np.nan, np.nan, 0, 1, 1, np.nan))
    said = verdict.sentence(single, "grpo")
    assert said == f"cannot tell whether any objective differs from grpo at this budget: no paired interval {why}"
    mixed = rows(("ctpo", 0.02, -0.01, 0.04, 4, 1, 5, 0.1), ("gspo", -0.01, np.nan, np.nan, 0, 1, 1, np.nan))
    assert verdict.sentence(mixed, "grpo") == ("no objective differs from grpo at this budget: every paired interval "
                                               f"includes 0; none for gspo {why}")
    # the mark is the intervals': 3 seeds beside a comparison of one seed (no interval) is indicative (it was not)
    thin = rows(("ctpo", 0.02, -0.01, 0.04, 2, 1, 3, 0.1), ("gspo", -0.01, np.nan, np.nan, 0, 1, 1, np.nan))
    assert verdict.sentence(thin, "grpo").endswith(f"none for gspo {why}; 3 seeds: indicative (coverage short of 95% "
                                                   "below 5)")
    below = rows(("ctpo", -0.05, -0.07, -0.03, 0, 6, 6, 0.001), ("gspo", 0.01, -0.01, 0.03, 4, 2, 6, 0.3))
    assert verdict.sentence(below, "grpo") == ("ctpo ends below grpo by 0.0500 [-0.0700, -0.0300], 6 of 6 seeds; the "
                                               "other does not (Holm-corrected over 2 comparisons)")


def test_a_verdict_from_one_starting_policy_says_it_is_about_that_policy():
    note = ("; from one starting policy: about that policy, another may rank them otherwise (replicate it with "
            "sweep.grid.model.seed: docs/replicates.md)")
    above = rows(("ctpo", 0.016, 0.004, 0.028, 5, 0, 5, 0.01))
    assert verdict.sentence(above.assign(top=0), "grpo") == verdict.sentence(above, "grpo") + note
    none = rows(("ctpo", 0.0156, -0.004, 0.035, 5, 1, 6, 0.12))
    assert verdict.sentence(none.assign(top=0), "grpo").endswith("every paired interval includes 0" + note)
    # 3 starting policies: the interval resamples them, no note; nothing tested: no finding to qualify
    assert "one starting policy" not in verdict.sentence(above.assign(top=3), "grpo")
    # a cell of 3 starting policies where one objective's runs paired on one of them only: that comparison is named
    mixed = rows(("ctpo", 0.016, 0.004, 0.028, 5, 0, 5, 0.01), ("gspo", 0.01, -0.01, 0.03, 3, 2, 5, 0.3))
    assert verdict.sentence(mixed.assign(top=[3, 0]), "grpo").endswith(
        "; gspo paired with the baseline on one starting policy only: about that policy")
    single = rows(("ctpo", 0.01, np.nan, np.nan, 1, 0, 1, np.nan)).assign(top=0)
    assert not verdict.sentence(single, "grpo").endswith(note)


def test_each_cell_ranks_its_objectives_and_says_when_the_baseline_is_missing():
    table = pd.DataFrame({"cell_id": [0, 0, 1], "objective": ["grpo", "ctpo", "ctpo"], "final_mean": [0.3, 0.4, 0.5],
                          "final_ci_low": [0.2, 0.3, np.nan], "final_ci_high": [0.4, 0.5, np.nan],
                          "final_n": [5, 5, 1]})
    pairs = pd.DataFrame({"cell_id": [0], "a": ["ctpo"], "b": ["grpo"], "n": [5], "difference": [0.1],
                          "difference_low": [0.05], "difference_high": [0.15], "wins": [5], "losses": [0],
                          "p_value": [0.001]})
    first, second = verdict.cell_verdicts(table, pairs, ["lr=1e-4", "lr=3e-4"], "grpo")
    assert list(first.table["objective"]) == ["ctpo", "grpo (baseline)"]  # best first
    assert first.table.iloc[0].tolist() == ["ctpo", "0.400 [0.300, 0.500]", "0.100 [0.0500, 0.150]", "5/5", "0.00100"]
    assert first.sentence == "ctpo ends above grpo by 0.100 [0.0500, 0.150], 5 of 5 seeds"
    assert second.sentence == "no verdict: the baseline grpo has no ended run here"
    assert verdict.lines([first, second])[1] == "cell `lr=3e-4`: no verdict: the baseline grpo has no ended run here."


def test_a_p_value_just_below_the_level_does_not_read_as_the_level():
    # 0.04996 < 0.05 counts; to 3 significant digits it would round to 0.0500 beside "ends above": rounded down
    table = pd.DataFrame({"cell_id": [0, 0], "objective": ["grpo", "ctpo"], "final_mean": [0.3, 0.4],
                          "final_ci_low": [0.2, 0.3], "final_ci_high": [0.4, 0.5], "final_n": [5, 5]})
    pairs = pd.DataFrame({"cell_id": [0], "a": ["ctpo"], "b": ["grpo"], "n": [5], "difference": [0.1],
                          "difference_low": [0.001], "difference_high": [0.2], "wins": [4], "losses": [1],
                          "p_value": [0.04996]})
    (cell,) = verdict.cell_verdicts(table, pairs, ["lr=1e-4"], "grpo")
    assert cell.sentence.startswith("ctpo ends above grpo")
    assert cell.table.iloc[0]["Holm p"] == "0.0499"
    assert [stats.p_text(p) for p in (0.05, 0.05004, 1.0, 0.00094, np.nan)] == ["0.0500", "0.0500", "1.00",
                                                                                "0.000940", "n/a"]


def test_an_objective_looks_the_same_in_every_report():
    alone, together = plots.styles(["grpo"]), plots.styles(["cispo", "grpo", "my_objective"])
    assert alone["grpo"] == together["grpo"]  # fixed by its place in the registry, not by who else is drawn
    assert list(together) == ["cispo", "grpo", "my_objective"]  # an unregistered name after the registry
    core = plots.styles(["grpo", "gspo", "gspo_token", "ctpo"]).values()
    assert len({(s.color, s.marker) for s in core}) == 4 and len({s.color for s in core}) == 4


def test_losses_get_axes_of_their_own_and_constant_metrics_are_named_not_drawn():
    steps = [1, 2, 3]
    metrics = pd.DataFrame({"run_id": ["a"] * 3 + ["b"] * 3, "objective": ["grpo"] * 3 + ["gspo"] * 3,
                            "step": steps * 2, "pg_loss": [0.1, 0.2, 0.1, 300.0, 100.0, 200.0],
                            "adv_mean": [1e-8, -2e-8, 0.0, 3e-9, 0.0, 1e-8], "entropy": [1.0, 0.9, 0.8] * 2})
    assert plots.round_off(metrics) == {"adv_mean": (-2e-8, 1e-8)}
    assert plots.own_scale("pg_loss") and plots.own_scale("loss") and not plots.own_scale("router_aux_loss")
    made = plots.own_scale_figure(metrics, ["pg_loss"], plots.styles(["grpo", "gspo"]), 1, "t", False)
    assert [ax.get_title() for ax in made.fig.axes] == ["pg_loss: grpo", "pg_loss: gspo"]  # registry order
    assert "own y axis" in made.caption
    plt.close(made.fig)


def test_the_final_accuracy_figure_shows_the_start():
    runs = pd.DataFrame({"objective": ["grpo", "grpo"], "final_eval_accuracy": [0.35, 0.36], "ended": [True, True],
                         "start_eval_accuracy": [0.28, 0.28]})
    made = plots.final_figure(runs, plots.styles(["grpo"]), "t", False)
    ax = made.fig.axes[0]
    assert any(list(line.get_ydata()) == [0.28, 0.28] for line in ax.lines)
    assert ax.get_ylim()[0] <= 0.28
    assert "start (step 0): 0.280" in [t.get_text() for t in made.fig.legends[0].get_texts()]
    plt.close(made.fig)


@pytest.mark.slow  # writes a whole report (seconds): make test
def test_objectives_run_by_different_code_are_said_to_be_in_the_verdict(tmp_path):
    """`make compare` keeps a baseline an earlier sweep ran: after a commit its runs and the new objective's differ in
    code version (constant within each objective: not a cell, analysis/cells.py), so the verdict compares them and
    says that each difference includes the change between the versions; runs of one version say nothing of it."""
    from analysis.report import build_report
    from tests.helpers.fake_runs import code_segments, fake_experiment, fake_run

    def report(folder, versions):
        exp = tmp_path / folder
        fake_experiment(exp, [fake_run(exp, o, s, {}, final=0.4 + 0.1 * (o == "gspo") + 0.01 * s,
                                       summary_extra=code_segments(versions[o]))
                              for o in ("grpo", "gspo", "ctpo") for s in range(3)])
        return (build_report(exp, formats=("png",)).parent / "verdict.txt").read_text()

    said = report("two", {"grpo": "aaa", "gspo": "bbb", "ctpo": "aaa"})
    assert said.rstrip().endswith("(run by different code: grpo, ctpo by `aaa`; gspo by `bbb`; each difference "
                                  "includes the change between them: to compare the objectives alone, run them under "
                                  "one code version, e.g. into another results_dir)."), said
    assert "different code" not in report("one", {"grpo": "aaa", "gspo": "aaa", "ctpo": "aaa"})
    codes = {"grpo": "aaa", "gspo": "bbb"}  # ctpo's version unknown here: only the versions known are compared
    assert verdict.code_note(["grpo", "ctpo"], codes) == "" and verdict.code_note(["gspo", "ctpo"], codes) == ""


def test_the_report_says_when_the_objectives_sampled_different_rollout_budgets():
    """An estimator's extra completions (A*-PO's reference samples, ReMax's greedy ones) or dynamic sampling's refills
    give an objective more rollout tokens in the same steps: said under the verdict, per cell, beyond 10%."""
    from analysis.report import Numbers, budget_blocks

    def numbers(tokens: dict, baseline="grpo", cells=("all runs",)) -> Numbers:
        table = pd.DataFrame([{"cell": c, "objective": o, "rollout_tokens_per_step": t}
                              for c in cells for o, t in tokens.items()])
        empty = pd.DataFrame()
        return Numbers(table, empty, empty, empty, empty, empty, baseline, [])

    assert budget_blocks(numbers({"grpo": 100.0, "gspo": 109.0, "cispo": 91.0}), False) == []  # within 10%
    (block,) = budget_blocks(numbers({"grpo": 100.0, "a2po": 200.0, "gspo": 105.0, "dapo": 80.0}), False)
    assert block[0] == "p" and "rollout tokens per step than grpo" in block[1]
    assert ": a2po 2.00x, dapo 0.80x." in block[1]
    (block,) = budget_blocks(numbers({"grpo": 100.0, "a2po": 200.0}, cells=("lr=0.1", "lr=1")), True)
    assert "cell `lr=0.1`: a2po 2.00x; cell `lr=1`: a2po 2.00x." in block[1]
    assert budget_blocks(numbers({"grpo": np.nan, "a2po": 200.0}), False) == []  # no baseline budget: nothing to say
    assert budget_blocks(numbers({"grpo": 100.0, "a2po": 200.0}, baseline=None), False) == []


@pytest.mark.slow
def test_a_run_that_stopped_early_is_not_read_as_a_smaller_budget(tmp_path):
    """Budgets are compared per step: an objective that samples twice the tokens a step but diverged after 1 of 6
    steps sampled less in all, and still 2.00x per step."""
    from analysis.load import load_experiment
    from analysis.report import Numbers, budget_blocks, eval_table, write_numbers
    from tests.helpers.fake_runs import Shape, fake_experiment, fake_run

    exp = tmp_path / "quickstart"
    entries = [fake_run(exp, "grpo", seed, final=0.4) for seed in range(3)]
    entries += [fake_run(exp, "a2po", seed, final=0.4, status="diverged",
                         summary_extra={"rollout_tokens": 200}, shape=Shape(steps_done=1)) for seed in range(3)]
    loaded = load_experiment(fake_experiment(exp, entries))
    table = eval_table(loaded.runs)
    assert table.set_index("objective")["rollout_tokens"].to_dict() == {"grpo": 600, "a2po": 200}  # in all
    empty = pd.DataFrame()
    (block,) = budget_blocks(Numbers(table, empty, empty, empty, empty, empty, "grpo", []), False)
    assert ": a2po 2.00x." in block[1]
    (tmp_path / "out").mkdir()
    write_numbers(loaded, tmp_path / "out")  # the terminal's verdict (verdict.txt) says it too
    assert (tmp_path / "out" / "verdict.txt").read_text().splitlines()[-1] == block[1]


def test_a_verdict_over_seeds_only_says_so():
    """One run without its eval_samples.jsonl turns its objective's comparison into an interval over seeds only,
    which leaves out the eval set's noise (narrower: here it excluded 0 where the full one did not); the tables said
    "(seeds only)", the verdict's sentence and ranking did not."""
    thin = rows(("gspo", 0.013, 0.0018, 0.024, 3, 0, 3, 0.038)).assign(problems=[False])
    said = verdict.sentence(thin, "grpo")
    assert said.startswith("gspo ends above grpo by 0.0130")
    assert "; over seeds only for gspo (a run's per-problem scores" in said
    full = rows(("gspo", 0.013, -0.02, 0.046, 3, 0, 3, 0.3)).assign(problems=[True])
    assert "seeds only" not in verdict.sentence(full, "grpo")
    group = pd.DataFrame({"objective": ["gspo", "grpo"], "final_mean": [0.38, 0.37], "final_ci_low": [0.35, 0.29],
                          "final_ci_high": [0.42, 0.45], "final_problems": [False, True]})
    table = verdict.ranking(group, thin.assign(b="grpo"), "grpo")
    assert table.iloc[0, 1].endswith("(seeds only)") and table.iloc[0, 2].endswith("(seeds only)")
    assert "seeds only" not in table.iloc[1, 1]


def test_the_one_start_line_says_one_starting_policy_only_where_there_is_one():
    """Rows that start alike from several starting policies (every policy at 0 on a hard task) were said to start
    'with one starting policy'."""
    from analysis.report import start_line
    table = pd.DataFrame({"objective": ["grpo", "gspo"], "start_n": [3, 3], "start_mean": [0.0, 0.0],
                          "start_ci_low": [np.nan] * 2, "start_ci_high": [np.nan] * 2, "start_problems": [True] * 2,
                          "start_top": [0, 0]})
    assert "with one starting policy" in start_line(table)
    several = start_line(table.assign(start_top=[3, 3]))
    assert "one starting policy" not in several and "from the same starting policies" in several
    # an interval over 2 starting policies (of 1 and 3 seeds) was marked "4 seeds: indicative", and said of
    # policies that score problems otherwise that they "score alike"
    two = start_line(table.assign(start_top=[2, 2], start_n=[4, 4], start_ci_low=[0.2] * 2, start_ci_high=[0.6] * 2))
    assert "2 starting policies: indicative" in two and "4 seeds" not in two and "score alike here" not in two


def test_a_run_whose_scores_do_not_give_its_accuracy_is_a_data_warning_naming_it(tmp_path):
    """The verdict said "over seeds only for gspo" and no data warning named the run that lacked its scores."""
    from analysis.load import AnalysisWarning, unscored

    samples = pd.DataFrame({"step": [0, 0, 5, 5], "problem": [0, 1, 0, 1], "answer": ["1", "2", "1", "2"],
                            "correct": [0.0, 0.0, 1.0, 0.0]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unscored(tmp_path / "run-a", samples, 0.5)  # the final evaluation's scores give 0.5
        unscored(tmp_path / "run-b", None, None)  # no evaluation: nothing to give
        unscored(tmp_path / "run-c", None, 0.5)
        unscored(tmp_path / "run-d", samples, 0.75)
    said = [str(w.message) for w in caught if issubclass(w.category, AnalysisWarning)]
    assert said == [f"{tmp_path / 'run-c'}: no eval_samples.jsonl: the intervals of its comparisons are over seeds "
                    "only (the eval set's noise left out)",
                    f"{tmp_path / 'run-d'}: its eval_samples.jsonl does not give its final eval accuracy 0.75: the "
                    "intervals of its comparisons are over seeds only (the eval set's noise left out)"]


def test_the_verdict_names_the_runs_it_leaves_out_because_they_did_not_end(tmp_path):
    """A run that failed midway is left out of every number: the comparison is over the seeds that survived, and an
    objective whose failures come from the objective looks better than it is. The report's headline listed it, but
    the verdict (verdict.txt, the terminal of `make compare`) said only "2 seeds", nothing of the third."""
    from analysis.load import load_experiment
    from analysis.report import write_numbers
    from tests.helpers.fake_runs import Shape, fake_experiment, fake_run

    exp = tmp_path / "quickstart"
    entries = [fake_run(exp, o, s, final=0.4 + 0.01 * s) for o in ("grpo", "gspo") for s in range(2)]
    entries += [fake_run(exp, "grpo", 2, final=0.42),
                fake_run(exp, "gspo", 2, status="failed", shape=Shape(steps_done=2)),
                fake_run(exp, "ctpo", 0, status="failed", shape=Shape(steps_done=1))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_experiment(fake_experiment(exp, entries))
    (tmp_path / "out").mkdir()
    write_numbers(loaded, tmp_path / "out")
    said = (tmp_path / "out" / "verdict.txt").read_text()
    assert "not counted, as they did not end: ctpo 1 failed of 1 run; gspo 1 failed of 3 runs" in said, said
    entries = [fake_run(tmp_path / "clean", o, s, final=0.4 + 0.01 * s) for o in ("grpo", "gspo") for s in range(3)]
    (tmp_path / "out2").mkdir()
    write_numbers(load_experiment(fake_experiment(tmp_path / "clean", entries)), tmp_path / "out2")
    assert "not counted" not in (tmp_path / "out2" / "verdict.txt").read_text()


def test_the_terminal_verdict_says_when_the_objectives_differ_in_more_than_the_objective(tmp_path):
    """`make compare OBJECTIVES=myobj OVERRIDES=train.steps=8` into a folder whose grpo ran 6 steps: one cell (the
    setting differs only between objectives), and the report said under its verdict that the objectives differ in
    train.steps, but verdict.txt (what the terminal prints) did not, and its budget line said the verdict compares
    "at equal steps"."""
    from analysis.load import load_experiment
    from analysis.report import write_numbers
    from tests.helpers.fake_runs import Shape, fake_experiment, fake_run

    exp = tmp_path / "quickstart"
    entries = [fake_run(exp, "grpo", s, final=0.4 + 0.01 * s) for s in range(3)]
    entries += [fake_run(exp, "gspo", s, final=0.5 + 0.01 * s, shape=Shape(steps=8),
                         summary_extra={"rollout_tokens": 1600 * 8}) for s in range(3)]
    (tmp_path / "out").mkdir()
    write_numbers(load_experiment(fake_experiment(exp, entries)), tmp_path / "out")
    said = (tmp_path / "out" / "verdict.txt").read_text()
    assert "The objectives compared differ in more than the objective: train.steps (grpo=6, gspo=8)" in said, said
    assert "at equal steps" not in said and "at each objective's own train.steps" in said, said


def test_over_seeds_only_gives_every_reason_an_interval_can_be_so():
    """gspo evaluated on 16 problems and grpo on 32 (task.eval_size set for gspo alone): both runs' scores exist and
    give their accuracies, but not on the same problems, so the pair's interval is over seeds only; the sentence
    gave as the reason that the scores "are missing or do not give its accuracy", neither of which was so."""
    thin = rows(("gspo", 0.013, 0.0018, 0.024, 3, 0, 3, 0.038)).assign(problems=[False])
    said = verdict.sentence(thin, "grpo")
    assert "are missing, do not give its accuracy, or are not on the same eval problems as the runs it is paired " \
           "with" in said, said


def test_holm_steps_down_caps_at_one_and_corrects_within_each_cell_by_hand():
    """Holm by hand (as statsmodels' multipletests(method="holm")): sorted 0.005, 0.01, 0.03, 0.04, 0.7 of m = 5
    times 5, 4, 3, 2, 1 = 0.025, 0.04, 0.09, 0.08, 0.7, made non-decreasing (0.08 -> 0.09); 0.6 and 0.7 of 2 are
    1.2 and 0.7, capped at 1 and kept non-decreasing (1, 1). The verdict's family is one cell's comparisons: two
    cells of one comparison each, p 0.03, are not corrected for each other."""
    adjusted = verdict.holm([0.01, 0.04, 0.03, 0.005, 0.7, np.nan])
    assert adjusted[:5] == pytest.approx([0.04, 0.09, 0.09, 0.025, 0.7]) and np.isnan(adjusted[5])
    assert verdict.holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])
    pairs = pd.DataFrame({"cell_id": [0, 0, 1, 1, 1], "a": ["x", "y", "x", "y", "x"], "b": ["g", "g", "g", "g", "y"],
                          "p_value": [0.03, 0.5, 0.03, np.nan, 0.001]})
    versus = verdict.versus_baseline(pairs, "g")
    assert versus["holm"].iloc[:3].tolist() == pytest.approx([0.06, 0.5, 0.03]) and np.isnan(versus["holm"].iloc[3])
    assert len(versus) == 4  # the pair of two other objectives is no comparison with the baseline
