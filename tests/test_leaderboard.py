"""analysis/leaderboard.py: the objective leaderboard of a folder with several cells, on synthetic run folders whose
numbers are known by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.leaderboard import leaderboard, tokens_to_target, write_leaderboard
from analysis.load import load_experiment
from tests.helpers.fake_runs import Shape, fake_experiment, fake_run

SEEDS = range(5)
# final eval accuracy per (cell's lr, objective), plus 0.01 x seed
FINAL = {1e-4: {"grpo": 0.40, "gspo": 0.45, "ctpo": 0.50}, 3e-4: {"grpo": 0.50, "gspo": 0.40, "ctpo": 0.45}}
CLIP = {"grpo": 0.01, "gspo": 0.2, "ctpo": 0.05}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    exp = tmp_path_factory.mktemp("results") / "zoo"
    entries = []
    for lr, finals in FINAL.items():
        for objective, final in finals.items():
            for seed in SEEDS:
                collapsed = objective == "gspo" and lr == 3e-4 and seed < 2  # 2 of gspo's 10 runs collapsed
                record = {"step": 3, "cause": "eval_drop", "detail": {}} if collapsed else None
                rows = {s: {"clip_frac": CLIP[objective] * (1 + (s % 2)), "ratio_std": 0.1 * seed} for s in (1, 2, 3,
                                                                                                          4, 5, 6)}
                entries.append(fake_run(exp, objective, seed, {"train.lr": lr}, final=final + 0.01 * seed,
                                        rows=rows, summary_extra={"collapse": record}))
    entries.append(fake_run(exp, "p3o", 0, {"train.lr": 1e-4}, status="failed"))  # no ended run: listed, unranked
    return fake_experiment(exp, entries)


@pytest.mark.slow
def test_rank_iqm_paired_collapse_tokens_and_mechanics_by_hand(zoo):
    board = leaderboard(load_experiment(zoo), target=0.47).set_index("objective")
    # ranks: lr 1e-4: ctpo 1, gspo 2, grpo 3; lr 3e-4: grpo 1, ctpo 2, gspo 3
    assert board.index.tolist() == ["ctpo", "grpo", "gspo", "p3o"]
    assert board["mean_rank"].tolist()[:3] == [1.5, 2.0, 2.5] and board.loc["p3o", "runs"] == 0
    assert (board["cells"] == 2).all() and (board["runs"][:3] == 10).all()
    # ctpo's 10 finals: 0.45 ... 0.54; trim_mean(0.25) drops 2 at each end: mean of 0.47 ... 0.52
    assert board.loc["ctpo", "iqm"] == pytest.approx(0.495)
    # ctpo - grpo per seed: +0.10 in one cell, -0.05 in the other (every seed): 0.025; the seeds agree and the runs
    # have no per-problem scores, so how the eval problems vary is unknown: no interval (never a zero-width one)
    assert board.loc["ctpo", "vs_baseline"] == pytest.approx(0.025)
    assert np.isnan(board.loc["ctpo", "vs_baseline_low"]) and np.isnan(board.loc["ctpo", "vs_baseline_high"])
    assert board.loc["ctpo", "p_baseline"] == pytest.approx(0.5)  # P = 1 in one cell, 0 in the other
    assert board.loc["gspo", "vs_baseline"] == pytest.approx(-0.025)  # gspo - grpo: +0.05, -0.10
    assert np.isnan(board.loc["grpo", "vs_baseline"])  # the baseline itself
    assert board.loc["gspo", ["collapse_k", "collapse_n"]].tolist() == [2, 10]
    assert board.loc["gspo", "collapse_rate"] == pytest.approx(0.2)
    assert board.loc["grpo", "collapse_k"] == 0 and board.loc["gspo", "collapse_low"] > 0
    # target 0.47 reached at the last eval (step 6: 600 tokens) by finals >= 0.47; the step-3 eval is halfway
    # from 0.2: never. ctpo: 0.47-0.54 (8 of 10); grpo: 0.47-0.54 (3 + 5 = 8); gspo: 0.47-0.49 (3): median inf
    assert board.loc["ctpo", ["tokens_to_target", "reached_target"]].tolist() == [600, 8]
    assert board.loc["gspo", "reached_target"] == 3 and board.loc["gspo", "tokens_to_target"] == np.inf
    # clip fraction: c on odd steps, 2c on even ones: 1.5 c; ratio_std 0.1 x seed: 0.2 on average
    assert board.loc["gspo", "clip_frac"] == pytest.approx(0.3)
    assert board.loc["grpo", "ratio_std"] == pytest.approx(0.2)
    assert (board["rollout_tokens"][:3] == 100).all() and (board["rollout_budget"][:3] == 1).all()  # 100 a step


def test_the_board_says_what_each_objective_sampled_against_the_baseline(tmp_path):
    """The ranking is at equal steps: an objective that samples more per step (A*-PO's reference completions) shows
    its rollout tokens per run and their ratio to the baseline's."""
    from analysis.leaderboard import display

    exp = tmp_path / "zoo"
    entries = [fake_run(exp, objective, seed, {"train.lr": 1e-4}, final=0.4 + 0.01 * seed,
                        summary_extra={"rollout_tokens": tokens + 10 * seed})
               for objective, tokens in (("grpo", 600), ("a2po", 1200)) for seed in range(3)]
    board = leaderboard(load_experiment(fake_experiment(exp, entries)), target=0.3).set_index("objective")
    assert board.loc["a2po", "rollout_tokens"] == pytest.approx(1210 / 6)  # 6 steps each
    assert board.loc["a2po", "rollout_budget"] == pytest.approx(1210 / 610)
    shown = display(board.reset_index(), "grpo").set_index("objective")["rollout tokens per step (x grpo)"]
    assert shown["a2po"] == "202 (1.98x)" and shown["grpo"] == "102 (1.00x)"


@pytest.mark.slow
def test_written_files_name_the_stamp_cells_and_every_objective(zoo, tmp_path):
    path = write_leaderboard(zoo, tmp_path / "out", "commit abc on a test machine", target=0.47)
    text = path.read_text()
    assert "commit abc on a test machine" in text and "`train.lr=0.0001`" in text and "`train.lr=0.0003`" in text
    assert "| ctpo | 1.50 | 0.495 [" in text and "not reached (3/10)" in text and "2/10 0.200 [" in text
    assert pd.read_csv(tmp_path / "out" / "leaderboard.csv")["objective"].tolist() == ["ctpo", "grpo", "gspo", "p3o"]
    assert "| p3o | n/a |" in text
    assert "<table" in (tmp_path / "out" / "leaderboard.html").read_text()


@pytest.mark.slow
def test_a_run_that_diverged_before_an_evaluation_after_step_0_never_ranks_above_one_that_trained(tmp_path):
    """A stress regime in which every trained objective ends below the starting policy (0.4): an objective whose runs
    all diverged at step 1 (their final accuracy is the step-0 evaluation's, 0.4) tied for the best mean rank; it now
    ranks last, and one seed of three diverged that way ranks an objective below those whose runs all trained."""
    exp = tmp_path / "zoo"
    entries = []
    from_04, diverged = Shape(start=0.4), Shape(start=0.4, steps_done=1)  # diverged: at step 1
    for lr in (1e-4, 3e-4):
        for seed in range(3):
            entries.append(fake_run(exp, "grpo", seed, {"train.lr": lr}, final=0.30 + 0.01 * seed, shape=from_04))
            entries.append(fake_run(exp, "gspo", seed, {"train.lr": lr}, final=0.20 + 0.01 * seed, shape=from_04))
            entries.append(fake_run(exp, "ctpo", seed, {"train.lr": lr}, final=0.35, status="diverged"
                                    if seed == 0 else "finished", shape=diverged if seed == 0 else from_04))
            entries.append(fake_run(exp, "cispo", seed, {"train.lr": lr}, status="diverged", shape=diverged))
    board = leaderboard(load_experiment(fake_experiment(exp, entries)), target=0.5).set_index("objective")
    assert board.loc["cispo", "iqm"] == pytest.approx(0.4)  # scored on the starting policy
    assert board["mean_rank"].to_dict() == {"grpo": 1.0, "gspo": 2.0, "ctpo": 3.0, "cispo": 4.0}


NOISE = (-0.01, 0.0, 0.01, -0.005, 0.005)  # per seed, added to each objective's paired difference to grpo
EFFECT = {"a_obj": 0.05, "b_obj": 0.012, "c_obj": 0.0}


@pytest.mark.slow
def test_the_differences_to_the_baseline_are_holm_adjusted_over_the_family(tmp_path):
    """Three comparisons with grpo: a (t = 14) survives Holm, b (p 0.027 unadjusted, its interval excluding 0) does
    not (Holm: 2 x 0.027), c is noise; the adjusted p is Holm's of the paired t-tests' p-values."""
    from scipy.stats import t as student_t

    from analysis.verdict import holm

    exp = tmp_path / "screen"
    entries = [fake_run(exp, "grpo", s, {"train.lr": 1e-4}, final=0.4 + 0.01 * s) for s in SEEDS]
    entries += [fake_run(exp, o, s, {"train.lr": 1e-4}, final=0.4 + 0.01 * s + e + NOISE[s]) for o, e in EFFECT.items()
                for s in SEEDS]
    fake_experiment(exp, entries)
    board = leaderboard(load_experiment(exp), target=0.47).set_index("objective")
    raw = {}
    for o, e in EFFECT.items():
        d = e + np.array(NOISE)
        raw[o] = 2 * student_t.sf(abs(d.mean()) / (d.std(ddof=1) / np.sqrt(len(d))), len(d) - 1)
    assert board.loc[list(EFFECT), "vs_baseline_p"].tolist() == pytest.approx(list(raw.values()))
    assert board.loc[list(EFFECT), "vs_baseline_holm"].tolist() == pytest.approx(list(holm(list(raw.values()))))
    assert raw["b_obj"] < 0.05 < board.loc["b_obj", "vs_baseline_holm"] and board.loc["b_obj", "vs_baseline_low"] > 0
    assert board.loc["a_obj", "vs_baseline_holm"] < 0.05 and np.isnan(board.loc["grpo", "vs_baseline_holm"])
    text = write_leaderboard(exp, tmp_path / "out", "stamp", target=0.47).read_text()
    assert "the family is 3 comparisons with grpo, so about 0.15 of them would exclude 0 by chance alone; 2 " \
        "exclude 0 unadjusted, 1 after Holm's step-down correction" in text
    assert "Holm p vs grpo" in text


@pytest.mark.slow
def test_objectives_run_by_different_code_are_said_to_be_on_the_board(tmp_path):
    """A zoo screen continued after a commit: an objective whose every run the new code made is compared with a
    baseline the old code ran, and the board says so (its differences include the change between the versions)."""
    from tests.helpers.fake_runs import code_segments

    exp = tmp_path / "screen"
    fake_experiment(exp, [fake_run(exp, o, s, {"train.lr": 1e-4}, final=0.4 + 0.01 * s + 0.05 * (o == "b_obj"),
                                   summary_extra=code_segments("bbb" if o == "b_obj" else "aaa"))
                          for o in ("grpo", "a_obj", "b_obj") for s in SEEDS])
    text = write_leaderboard(exp, tmp_path / "out", "stamp", target=0.47).read_text()
    assert "Objectives run by different code: grpo, a_obj by `aaa`; b_obj by `bbb`; each difference includes the " \
        "change between them" in text  # the baseline first, then the board's order
    one = tmp_path / "one"
    fake_experiment(one, [fake_run(one, o, s, {"train.lr": 1e-4}, final=0.4, summary_extra=code_segments("aaa"))
                          for o in ("grpo", "a_obj") for s in SEEDS])
    assert "different code" not in write_leaderboard(one, tmp_path / "out1", "stamp", target=0.47).read_text()


def test_an_objective_with_no_seed_ended_in_every_cell_is_listed_not_a_crash(tmp_path):
    """x_obj ended seeds 1 and 2 at one learning rate and seed 0 at the other: runs in every shared cell but no
    (starting policy, seed) unit common to them, so no pooled IQM; the board lists it without numbers (a KeyError
    before)."""
    exp = tmp_path / "zoo"
    entries = []
    for lr, ended in ((1e-4, {1, 2}), (3e-4, {0})):
        for seed in range(3):
            entries.append(fake_run(exp, "grpo", seed, {"train.lr": lr}, final=0.4 + 0.01 * seed))
            entries.append(fake_run(exp, "x_obj", seed, {"train.lr": lr}, final=0.45,
                                    status="finished" if seed in ended else "failed"))
    board = leaderboard(load_experiment(fake_experiment(exp, entries)), target=0.5).set_index("objective")
    assert board.loc["x_obj", "runs"] == 3 and np.isnan(board.loc["x_obj", "iqm"])
    assert np.isnan(board.loc["x_obj", "vs_baseline"]) and board.loc["grpo", "iqm"] == pytest.approx(0.41)
    text = write_leaderboard(exp, tmp_path / "out", "stamp", target=0.5).read_text()
    assert "x_obj" in text


def test_the_board_names_the_runs_that_did_not_end(tmp_path):
    """A zoo screen where every run of one objective failed showed it as a row of n/a with "runs 0", and one whose
    runs failed in part as fewer runs: the board (what the zoo prints) never said that runs had failed and were
    left out, a bias towards the runs that survived."""
    exp = tmp_path / "zoo"
    entries = []
    for seed in range(3):
        entries.append(fake_run(exp, "grpo", seed, final=0.4 + 0.01 * seed))
        entries.append(fake_run(exp, "gspo", seed, final=0.4, status="failed", shape=Shape(steps_done=2)))
        entries.append(fake_run(exp, "ctpo", seed, final=0.45, status="failed" if seed == 2 else "finished"))
    text = write_leaderboard(fake_experiment(exp, entries), tmp_path / "out", "stamp", target=0.5).read_text()
    assert "Not counted, as they did not end: ctpo 1 failed of 3 runs; gspo 3 failed of 3 runs." in text, text
    clean = [fake_run(tmp_path / "c", o, s, final=0.4) for o in ("grpo", "gspo") for s in range(3)]
    assert "did not end" not in write_leaderboard(fake_experiment(tmp_path / "c", clean), tmp_path / "o2", "stamp",
                                                  target=0.5).read_text()


def test_tokens_to_target_is_not_reached_when_half_the_runs_never_reach_it():
    """The median of 4 runs of which 2 never reach the target is the mean of a finite and an infinite value: "not
    reached" with half the runs short of it, where the explanation said "when more than half did not"."""
    from analysis.leaderboard import explanation

    runs = pd.DataFrame({"run_id": list("abcd")})
    metrics = pd.DataFrame({"run_id": list("abcd"), "step": 1, "eval_accuracy": [0.5, 0.5, 0.1, 0.1],
                            "rollout_tokens": [100, 200, 100, 100]})
    assert np.median(tokens_to_target(metrics, runs, 0.4).to_numpy()) == np.inf

    class Exp:
        cells = type("Cells", (), {"labels": ["all runs"]})()

    text = explanation(Exp(), [0], 0.4, "grpo", pd.DataFrame({"vs_baseline_holm": []}))[1]
    assert "not reached when half of them or more did not" in text and "more than half" not in text
