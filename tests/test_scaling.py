"""analysis.scaling: the ScaleRL sigmoid, its fit, the bootstrap over seeds and the report's table and figure."""

import json
import warnings

import numpy as np
import pandas as pd
import pytest

from analysis import build_report, load_experiment
from analysis.scaling import bootstrap, fit_curve, fit_objectives, fit_table, jacobian, sigmoid
from analysis.stats import N_BOOT
from tests.helpers.toy_experiment import write_experiment

TRUTH = {"r0": 0.1, "a": 0.6, "b": 1.2, "c_mid": 3e4}
TOKENS = np.geomspace(1e3, 1e6, 12)


def test_sigmoid_by_hand():
    # C = C_mid: half the gain; C_mid / C = 1/2, B = 2: R0 + (A - R0) / (1 + 1/4)
    assert sigmoid(100.0, 0.1, 0.5, 1.0, 100.0) == pytest.approx(0.3)
    assert sigmoid(200.0, 0.1, 0.5, 2.0, 100.0) == pytest.approx(0.1 + 0.4 / 1.25)
    assert sigmoid(np.array([1e-30, 1e30]), 0.1, 0.5, 1.0, 100.0) == pytest.approx([0.1, 0.5])  # R0, A at the ends


def test_jacobian_is_the_derivative():
    a, b, log_c_mid, h = 0.6, 1.2, np.log(3e4), 1e-6
    exact = jacobian(TOKENS, 0.1, a, b, log_c_mid)
    for column, step in enumerate(np.eye(3) * h):
        plus = sigmoid(TOKENS, 0.1, a + step[0], b + step[1], np.exp(log_c_mid + step[2]))
        minus = sigmoid(TOKENS, 0.1, a - step[0], b - step[1], np.exp(log_c_mid - step[2]))
        assert exact[:, column] == pytest.approx((plus - minus) / (2 * h), abs=1e-8)


def test_recovers_known_parameters():
    exact = fit_curve(TOKENS, sigmoid(TOKENS, **TRUTH), TRUTH["r0"])
    assert exact.converged and (exact.a, exact.b, exact.c_mid) == pytest.approx((0.6, 1.2, 3e4), rel=1e-6)
    noisy = sigmoid(TOKENS, **TRUTH) + np.random.default_rng(0).normal(0, 0.01, len(TOKENS))
    fit = fit_curve(TOKENS, noisy, TRUTH["r0"])
    assert fit.converged and fit.points == 12
    assert fit.a == pytest.approx(0.6, abs=0.02) and fit.b == pytest.approx(1.2, rel=0.2)
    assert fit.c_mid == pytest.approx(3e4, rel=0.2)


def test_unfittable_curves_say_why():
    flat = fit_curve(TOKENS, np.full(len(TOKENS), 0.1), 0.1)
    assert not flat.converged and np.isnan(flat.a)
    assert flat.reason.startswith("A at its lower bound R0 = 0.100: a flat curve, B and C_mid not identifiable")
    noise = fit_curve(TOKENS, 0.1 + np.random.default_rng(0).normal(0, 0.01, len(TOKENS)), 0.1)
    assert not noise.converged and "not identifiable" in noise.reason
    three = fit_curve(TOKENS[:3], sigmoid(TOKENS[:3], **TRUTH), 0.1)
    assert three.reason == "3 eval points after step 0, 3 parameters: too few to fit (needs 6, two per parameter)"
    four = fit_curve(TOKENS[::3], sigmoid(TOKENS[::3], **TRUTH), 0.1)  # a quickstart run's 4 evaluations
    assert not four.converged and four.reason.startswith("4 eval points after step 0")
    early = fit_curve(TOKENS[:7], sigmoid(TOKENS[:7], **TRUTH), 0.1)  # exact, but the rise only begins
    assert early.reason == ("the points do not span the rise: the fit goes from 2% to 61% of its gain over them "
                            "(needs at most 25% to at least 75%)")
    late = fit_curve(TOKENS[5:], sigmoid(TOKENS[5:], **TRUTH), 0.1)  # the rise half over at the first point
    assert late.reason.startswith("the points do not span the rise: the fit goes from 42% to 99%")
    assert fit_curve(TOKENS[:8], sigmoid(TOKENS[:8], **TRUTH), 0.1).converged
    rising = fit_curve(TOKENS[:6], sigmoid(TOKENS[:6], 0.1, 1.0, 1.0, 1e9) * 1000, 0.1)  # linear in C, no saturation
    assert rising.reason.startswith("A at its upper bound 1")
    assert fit_curve(TOKENS, np.ones(len(TOKENS)), 1.0).reason == "R0 = 1.00: starts at the top, nothing to fit"


def seeds_of(n: int) -> np.ndarray:
    """n seeds' eval accuracy: the true curve plus independent noise (sd 0.02) per seed and point."""
    return sigmoid(TOKENS, **TRUTH) + np.random.default_rng(1).normal(0, 0.02, (n, len(TOKENS)))


def test_bootstrap_interval_contains_the_truth():
    accuracy, tokens, start = seeds_of(5), np.tile(TOKENS, (5, 1)), np.full(5, TRUTH["r0"])
    fit = fit_curve(TOKENS, accuracy.mean(axis=0), TRUTH["r0"])
    ci = bootstrap(tokens, accuracy, start, fit)
    assert ci["converged"] == N_BOOT and ci["note"] == f"95% CI, {N_BOOT} of {N_BOOT} refits converged"
    assert ci["A_ci"][0] < TRUTH["a"] < ci["A_ci"][1] and ci["B_ci"][0] < TRUTH["b"] < ci["B_ci"][1]
    assert ci["A_ci"][0] <= fit.a <= ci["A_ci"][1] and ci["A_ci"][1] - ci["A_ci"][0] < 0.05
    two = bootstrap(tokens[:2], accuracy[:2], start[:2], fit)
    assert np.isnan(two["A_ci"]).all() and two["note"] == "none: 2 seeds (the bootstrap needs 3+)"


def write_sigmoid_runs(exp):
    """The synthetic sweep of test_analysis (3 finished seeds of grpo and gspo, unfinished runs besides) with an
    evaluation at every step: grpo rises along R0 = 0.1, A = 0.7, B = 2, C_mid = 250 rollout tokens (seeds offset
    by -0.01, 0, +0.01), gspo stays at 0.1."""
    write_experiment(exp)
    for path in exp.glob("*/metrics.jsonl"):
        seed = int(path.parent.name.split("-s")[1][0])
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        for row in rows[1:]:
            rise = sigmoid(row["rollout_tokens"], 0.1, 0.7, 2.0, 250.0) + 0.01 * (seed - 1)
            row["eval_accuracy"] = rise if path.parent.name.startswith("grpo") else 0.1
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return exp


def test_fit_table_of_a_results_folder(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exp = load_experiment(write_sigmoid_runs(tmp_path / "toy"))
    fits = {f.objective: f for f in fit_objectives(exp.metrics, exp.runs)}
    grpo = fits["grpo"]
    assert grpo.seeds == 3 and grpo.fit.points == 6  # the unfinished seeds are left out
    assert grpo.fit.converged and grpo.fit.a == pytest.approx(0.7, abs=0.02) and grpo.fit.b == pytest.approx(2, rel=0.1)
    assert grpo.fit.c_mid == pytest.approx(250, rel=0.1)
    assert list(grpo.tokens) == pytest.approx([110 * s for s in range(1, 7)])  # mean of 100, 110, 120 per step
    table = fit_table(fits.values()).set_index("objective")
    assert table.loc["grpo", "converged?"] == "yes"
    assert table.loc["gspo", "converged?"].startswith("no: A at its lower bound R0 = 0.100: a flat curve")
    assert table.loc["gspo", "A [CI]"] == ""


@pytest.mark.slow
def test_report_has_the_fit(tmp_path):
    exp = write_sigmoid_runs(tmp_path / "toy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = build_report(exp, formats=("png",))
    text = md.read_text()
    section = text[text.index("## Compute-performance fit"):text.index("\n## Runs\n")]
    assert "| objective | seeds | points | R0 | A [CI] | B [CI] | C_mid | converged? | interval |" in section
    assert "| gspo | 3 | 6 | 0.100 |  |  |  | no: A at its lower bound R0 = 0.100: a flat curve" in section
    grpo = next(line for line in section.splitlines() if line.startswith("| grpo |"))
    assert grpo.startswith("| grpo | 3 | 6 | 0.100 | 0.7") and "| yes | 95% CI, " in grpo
    assert "![toy: compute-performance fit](scaling.png)" in text and (md.parent / "scaling.png").exists()
    numbers = pd.read_csv(md.parent / "scaling_fit.csv").set_index("objective")
    assert numbers.loc["grpo", "A_ci_low"] <= numbers.loc["grpo", "A"] <= numbers.loc["grpo", "A_ci_high"]
    assert not numbers.loc["gspo", "converged"] and np.isnan(numbers.loc["gspo", "A"])
    assert "- Not drawn: gspo: A at its lower bound R0 = 0.100" in text  # named under the figure, not dropped


def test_the_figure_draws_a_fit_over_its_points_only_and_names_every_objective_left_out():
    from matplotlib import pyplot as plt

    from analysis import plots
    from analysis.scaling import Fit, ObjectiveFit

    accuracy = seeds_of(3)
    grpo = ObjectiveFit("grpo", 3, fit_curve(TOKENS, accuracy.mean(axis=0), TRUTH["r0"]), TOKENS,
                        accuracy.mean(axis=0), accuracy)
    flat = Fit(0.1, 4, reason="4 eval points after step 0, 3 parameters: too few to fit (needs 6, two per parameter)")
    gspo = ObjectiveFit("gspo", 3, flat)
    look = plots.styles(["grpo", "gspo"])
    made = plots.scaling_figure([grpo, gspo], look, "toy", False)
    curves = [line.get_xdata() for line in made.fig.axes[0].get_lines() if len(line.get_xdata()) > 2]
    assert curves and all(TOKENS.min() <= min(x) and max(x) <= TOKENS.max() for x in curves)  # never beyond
    assert made.notes == [f"Not drawn: gspo: {flat.reason}."]
    plt.close(made.fig)
    none = plots.scaling_figure([gspo], look, "toy", False)
    assert none.fig is None and none.notes == [
        f"No objective's compute-performance fit meets its conditions, so no curve is drawn (gspo: {flat.reason})."]
