"""The claims ledger (harness/apps/claims.py): every shipped claim file parses and names an existing experiment; the
checks' verdicts on small tables whose answer is known by hand."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

import harness.apps.claims
from analysis.cells import START_SEED
from analysis.stats import num
from harness.apps.claims import (
    CLAIMS_DIR,
    SCORES,
    Claim,
    check_claims,
    checked,
    evaluate_check,
    ledger_rows,
    load_claim,
    load_claims,
    model_of,
    probe_settings,
    recorded_starts,
    run_source,
    selection,
    write_ledger,
)
from harness.apps.sweep import START_POLICIES, check_prepare_folder, first_landing
from harness.apps.zoo import START_CANDIDATES
from harness.run.config import load_experiment, run_configs, run_id
from harness.run.errors import ConfigError
from tests.helpers.fake_runs import code_segments, fake_experiment, fake_run


@pytest.mark.slow
def test_shipped_claims_parse_and_their_experiments_exist():
    claims = load_claims()
    assert {c.name for c in claims} >= {"gspo_clips_more", "gspo_token_equals_gspo", "ctpo_prefix_ratio_variance",
                                        "cispo_keeps_clipped_gradient", "dr_grpo_length_bias", "sequence_ratio_bf16"}
    for claim in claims:
        if claim.source[0] == "probe":
            probe_settings(claim.source[2])
        else:
            load_experiment(claim.source[1], list(claim.source[2]))
        assert claim.paper and claim.checks


def test_long_claims_run_when_named_or_asked_for_and_the_smollm2_ones_run_their_experiments_own_seeds():
    """A bare `make claims` leaves out the SmolLM2 claims (hours of sweeps); named or with_long they are in; they run
    from the experiment's own starting policy and seeds (one policy: at most "indicative") and name SmolLM2."""
    default, every = load_claims(), load_claims(with_long=True)
    long = {c.name for c in every if c.long}
    assert long >= {"ctpo_outperforms_smollm2", "gspo_stable_offpolicy_smollm2"}
    assert not long & {c.name for c in default}
    assert {c.name for c in default} | long == {c.name for c in every}
    (named,) = load_claims(["gspo_stable_offpolicy_smollm2", "gspo_stable_offpolicy_smollm2"])  # one row
    assert named.long and named.design == (0, None)
    assert model_of(named).startswith("smollm2-135m-instruct")


def test_a_long_claim_named_without_with_long_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """Naming a SmolLM2 claim would start hours of sweeps: one line asks for --with-long, and nothing is built."""
    monkeypatch.setattr(harness.apps.claims, "start_seeds", lambda *a, **k: pytest.fail("a starting policy was built"))
    with pytest.raises(ConfigError, match="ctpo_outperforms_smollm2: long .* add --with-long"):
        harness.apps.claims.main(["gspo_clips_more", "ctpo_outperforms_smollm2"], results_dir=str(tmp_path))
    assert not any(tmp_path.iterdir())


def test_bad_claim_files_are_refused_with_the_file_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("claim: x\npaper: y\nexperiment: {lab: lab, sweep: quickstart}\nchecks: []\n")
    with pytest.raises(ConfigError, match="bad.yaml.*one lab, one sweep or one probe"):
        load_claim(path)
    path.write_text("claim: x\npaper: y\nexperiment: {lab: lab}\nchecks: [{table: lab, metric: m}]\n")
    with pytest.raises(ConfigError, match="compare / within"):
        load_claim(path)
    path.write_text("claim: x\npaper: y\nexperiment: {lab: lab}\nchecks: [{table: runs, metric: m, within: [0, 1]}]\n")
    with pytest.raises(ConfigError, match="a lab has no table 'runs'"):
        load_claim(path)
    path.write_text("claim: x\npaper: y\nexperiment: {sweep: quickstart}\nchecks: [{table: final, metric: m, "
                    "compare: {objective: a, than: b, direction: equivalent}}]\n")
    with pytest.raises(ConfigError, match="compare.margin is the equivalence margin"):
        load_claim(path)
    with pytest.raises(ConfigError, match=r"no claim 'nope', '' in .* \(name a claim by its file's name without "):
        load_claims(["nope", ""])  # an empty name quoted, not a blank
    for typed in ("GSPO_clips_more", "gspo_clip_more"):  # another case, a letter short
        with pytest.raises(ConfigError, match=rf"^no claim '{typed}' .*\. Did you mean gspo_clips_more\? Claims: "):
            load_claims([typed])
    assert CLAIMS_DIR.is_dir()
    for text in (b"- a list\n", b"claim: \xff\n"):  # not a mapping; not UTF-8
        path.write_bytes(text)
        with pytest.raises(ConfigError, match="bad.yaml: not a claim"):
            load_claim(path)
    path.write_text("claim: x\npaper: [y,\nexperiment: {lab: lab}\n")  # the parser's error quotes the file, in lines
    with pytest.raises(ConfigError, match=r"bad.yaml: not a claim: not valid YAML at line 4, column 1 \(expected ',' "
                                          r"or '\]', but got '<stream end>'\); see harness/apps/claims.py") as info:
        load_claim(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("experiment, checks, message", [
    ("{lab: lab}", "[]", r"checks must be a non-empty list of checks, got \[\]"),  # was "indicative", nothing measured
    ("{lab: lab}", "3", r"checks must be a non-empty list of checks, got 3"),  # a traceback
    ("lab", "[{table: lab, metric: m, within: [0, 1]}]", r"experiment must name one lab"),  # a traceback
    ("{lab: lab}", "[3]", r"each check is a mapping \(table, metric, ...\), got 3"),
    ("{lab: lab}", "[{table: lab, metric: m, within: 5}]", r"within must be \[low, high\], .* got 5"),  # a traceback
    ("{lab: lab}", "[{table: lab, metric: m, within: [1, 0]}]",
     r"within must be .* low <= high, got \[1, 0\]"),  # "does not hold"
    ("{lab: lab}", "[{table: lab, metric: m, within: [0, .inf]}]", r"within must be \[low, high\], two finite numbers"),
    ("{lab: lab}", "[{table: lab, metric: m, within: [0, 1], objetive: grpo}]", r"a check has no field 'objetive'"),
    ("{sweep: quickstart}", "[{table: final, metric: m, compare: {objective: a}}]",
     r"compare must be a mapping naming objective and than"),  # "no data" after the sweep
    ("{sweep: quickstart}", "[{table: final, metric: m, compare: grpo}]", r"compare must be a mapping"),
    ("{sweep: quickstart}", "[{table: final, metric: m, compare: {objective: a, than: b, factor: x}}]",
     r"compare.factor must be a number > 0 \(y's multiplier\), got 'x'"),  # a numpy traceback
    ("{sweep: quickstart}", "[{table: final, metric: m, compare: {objective: a, than: b, scale: ln}}]",
     r"compare.scale must be one of linear, log, got 'ln'"),
    ("{sweep: quickstart}", "[{table: final, metric: m, compare: {objective: a, than: b, direction: equal, "
     "tolerance: -1}}]", r"compare.tolerance must be a number >= 0 .*got -1"),  # "does not hold"
    ("{sweep: quickstart}", "[{table: final, metric: m, compare: {objective: a, than: b, derection: less}}]",
     r"compare has no field 'derection'"),  # "greater" checked, silently
    # fields the direction does not read: each changed no verdict, silently
    ("{sweep: quickstart}", "[{table: final, metric: m, compare: {objective: a, than: b, tolerance: 0.1}}]",
     r"compare.tolerance is read by direction equal only, not by greater: remove it"),
    ("{sweep: quickstart}", "[{table: final, metric: m, compare: {objective: a, than: b, direction: equivalent, "
     "margin: 0.1, factor: 2}}]", r"compare.factor is read by direction greater or less only, not by equivalent"),
    ("{sweep: quickstart}", "[{table: final, metric: m, compare: {objective: a, than: b, direction: equal, "
     "scale: log}}]", r"compare.scale log does not go with direction equal"),
    # the fourteenth hostile pass: a traceback on every claims call, or the experiment without its overrides
    ("{lab: lab}", "[{table: lab, metric: m, within: [0, 1], statistic: [mean]}]",
     r"a check's statistic is one text, got \['mean'\]"),
    ("{sweep: quickstart}", "[{table: final, metric: m, within: [0, 1], objective: [grpo]}]",
     r"a check's objective is one text"),
    ("{sweep: quickstart}", "[{table: final, metric: m, compare: {objective: [a], than: b}}]",
     r"compare.objective is one text"),
    ("{sweep: quickstart, overides: [train.steps=2]}", "[{table: final, metric: m, within: [0, 1]}]",
     r"experiment has no field 'overides'; its fields: one of lab, sweep, probe, and overrides"),
    ("{sweep: quickstart, overrides: train.steps=2}", "[{table: final, metric: m, within: [0, 1]}]",
     r"experiment.overrides must be a list of key=value texts, got 'train.steps=2'"),
    ("{sweep: 3}", "[{table: final, metric: m, within: [0, 1]}]", r"experiment.sweep must name one sweep \(text\)"),
    # the twenty-fourth hostile pass: a where ran code (pandas' @ read the module's names), or failed after the runs
    ("{sweep: quickstart}", "[{table: final, metric: m, within: [0, 1], where: \"@pd.io.common.os.system('true') "
     "== 0\"}]", r"where \"@pd.io.common.os.system\('true'\) == 0\" does not parse"),
    ("{sweep: quickstart}", "[{table: final, metric: m, within: [0, 1], where: \"objective.__class__ == 1\"}]",
     r"where 'objective.__class__ == 1': objective.__class__ is not allowed"),
    ("{sweep: quickstart}", "[{table: final, metric: m, compare: {objective: a, than: b, baseline: \"len(seed) > "
     "0\"}}]", r"compare.where 'len\(seed\) > 0': len\(seed\) is not allowed"),
    ("{sweep: quickstart}", "[{table: final, metric: m, within: [0, 1], where: \"seed >=\"}]",
     r"where 'seed >=' does not parse"),
    ("{probe: moe_update, overrides: [depths]}", "[{table: probe, metric: m, within: [0, 1]}]",
     r"probe moe_update's override 'depths' is not key=value"),
    ("{probe: moe_update, overrides: ['depths=[2,']}", "[{table: probe, metric: m, within: [0, 1]}]",
     r"probe moe_update's override 'depths=\[2,': not valid YAML"),
    ("{probe: moe_update, overrides: [prompts=0]}", "[{table: probe, metric: m, within: [0, 1]}]",
     r"probe moe_update: prompts must be a whole number >= 1, got 0"),
    ("{probe: moe_update, overrides: ['depths=[]']}", "[{table: probe, metric: m, within: [0, 1]}]",
     r"probe moe_update: depths must be a non-empty list of whole numbers >= 1"),
    ("{probe: moe_update, overrides: ['spec={top_k: 9}']}", "[{table: probe, metric: m, within: [0, 1]}]",
     r"probe moe_update: tiny_moe.top_k must be an integer in \[1, num_experts=8\]"),
])
def test_a_malformed_claim_check_is_refused_when_the_claim_is_read(tmp_path, experiment, checks, message):
    """Each ended in a traceback, a verdict or "no data" only after the claim's experiment had run, or (no checks)
    in a claim marked indicative with nothing measured (the thirteenth hostile pass)."""
    path = tmp_path / "bad.yaml"
    path.write_text(f"claim: x\npaper: y\nexperiment: {experiment}\nchecks: {checks}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {message}") as info:
        load_claim(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("extra, message", [
    ("name: other", r"not a claim \(no field 'name'\); its fields: claim, paper, .* \(its name is the file's\)"),
    ("seeds: true", r"seeds must be a whole number from 1 to 100 \(per starting policy\), got True"),
    ("seeds: 100000", r"seeds must be a whole number from 1 to 100"),  # 500,000 runs planned without a word
    ("seeds: 3", r"seeds is a sweep's \(seeds per starting policy\): a lab runs once per starting policy"),  # ignored
    ("notes: 5", r"notes must be a list of texts"),  # a TypeError after the experiments
    ("notes: hello world", r"notes must be a list of texts"),  # the ledger spelt it h e l l o
    ("reported: [1]", r"reported must be one text"),
    ("checks: []", r"not a claim: not valid YAML at line 5, column 1 \(the key 'checks' is given twice\)"),
    ("start_policies: true", r"start_policies must be a whole number"),
    ("long: 'false'", r"long must be true or false, got 'false'"),  # truthy: left out of make claims
])
def test_a_claim_field_of_the_wrong_kind_is_refused_when_read(tmp_path, extra, message):
    path = tmp_path / "bad.yaml"
    path.write_text(f"claim: x\npaper: y\nexperiment: {{lab: lab}}\nchecks: [{{table: lab, metric: m, within: [0, 1]}}]"
                    f"\n{extra}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {message}") as info:
        load_claim(path)
    assert "\n" not in str(info.value)


def test_a_folder_or_a_link_among_the_claims_is_refused_in_one_line_not_followed(tmp_path):
    """A folder named x.yaml or a broken link in the claims folder ended every claims call in a traceback
    (IsADirectoryError, FileNotFoundError); a link to a claim elsewhere is not followed either."""
    good = tmp_path / "good.yaml"
    good.write_text("claim: x\npaper: y\nexperiment: {lab: lab}\nchecks: [{table: lab, metric: m, within: [0, 1]}]\n")
    assert load_claim(good).name == "good"
    (tmp_path / "sub.yaml").mkdir()
    (tmp_path / "gone.yaml").symlink_to(tmp_path / "nowhere.yaml")
    (tmp_path / "link.yaml").symlink_to(good)
    for name in ("sub", "gone", "link"):
        with pytest.raises(ConfigError, match=rf"{name}.yaml: not a claim file \(a link or a folder, not followed\)"):
            load_claim(tmp_path / f"{name}.yaml")


def test_a_check_that_cannot_be_evaluated_is_no_data_in_the_ledger_not_a_stop():
    """A TypeError (a where that compares a number with text) stopped the ledger of every claim."""
    from harness.apps.claims import checked

    final = pd.DataFrame({"objective": ["a", "b"], "seed": [0, 0], "m": [1.0, 2.0], "cell": ["x", "x"]})
    verdict, text, _ = checked({"table": "final", "metric": "m", "within": [0, 1], "where": "cell > 1"},
                               {"final": final})
    assert verdict == "no data" and "could not be evaluated" in text



def test_a_where_on_a_swept_key_the_runs_there_do_not_vary_yet_says_so():
    """A swept key is a column only where the folder's runs take two values of it: `--existing` on a claim's sweep
    that has run only its num_minibatches=16 cell said "UndefinedVariableError: name
    'BACKTICK_QUOTED_STRING_train_DOT_num_minibatches' is not defined"."""
    final = pd.DataFrame({"objective": ["a", "b"], "seed": [0, 0], "m": [1.0, 2.0]})
    check = {"table": "final", "metric": "m", "where": "`train.num_minibatches` == 16",
             "compare": {"objective": "a", "than": "b"}}
    verdict, text, _ = checked(check, {"final": final})
    assert verdict == "no data" and "no column 'train.num_minibatches' in the final table" in text
    assert "a swept key is a column only where the runs there take two values of it" in text
    assert "BACKTICK" not in text
    # a typo in a where is no swept key: the table's columns, not that explanation
    verdict, text, _ = checked({**check, "where": "poin == 16"}, {"final": final})
    assert verdict == "no data" and "no column 'poin' in the final table" in text
    assert "its columns: objective, seed, m" in text and "swept key" not in text


def test_a_misspelt_metric_is_named_with_the_nearest_one_and_how_to_check_again_without_running():
    """A metric no row has (a typo found only after the experiment ran) was a pandas KeyError in the ledger."""
    from harness.apps.claims import checked

    final = pd.DataFrame({"objective": ["a", "b"], "seed": [0, 0], "clip_frac": [0.1, 0.2]})
    verdict, text, _ = checked({"table": "final", "metric": "clip_fracc", "within": [0, 1]}, {"final": final})
    assert verdict == "no data" and "clip_fracc: no final row of the experiment has this metric" in text
    assert "(nearest: clip_frac)" in text and "--existing" in text and "KeyError" not in text


LAB = pd.DataFrame({"batch": [0, 0, 1, 1, 2, 2, 3, 3], "objective": ["a", "b"] * 4,
                    "staleness": [1] * 8, "m": [2.0, 1.0, 2.1, 1.0, 1.9, 1.0, 2.0, 1.0]})


def test_compare_greater_and_less_with_a_factor():
    greater = {"table": "lab", "metric": "m", "compare": {"objective": "a", "than": "b"}}
    verdict, measured, _ = evaluate_check(greater, {"lab": LAB})
    assert verdict == "holds" and "a 2.00, b 1.00" in measured and "4 batches" in measured
    far = {**greater, "compare": {"objective": "a", "than": "b", "factor": 3}}  # 2 > 3 x 1 fails
    assert evaluate_check(far, {"lab": LAB})[0] == "does not hold"
    less = {**greater, "compare": {"objective": "a", "than": "b", "direction": "less"}}
    assert evaluate_check(less, {"lab": LAB})[0] == "does not hold"
    nothing = {**greater, "where": "staleness == 5"}
    assert evaluate_check(nothing, {"lab": LAB})[0] == "no data"


def test_compare_two_selections_of_one_objective():
    cells = LAB.assign(objective="a", cell=["x", "y"] * 4)
    check = {"table": "lab", "metric": "m", "where": "staleness == 1",
             "compare": {"objective": "a", "than": "a", "where": "cell == 'x'", "than_where": "cell == 'y'"}}
    verdict, measured, _ = evaluate_check(check, {"lab": cells})
    assert verdict == "holds" and "a [cell == 'x'] 2.00, a [cell == 'y'] 1.00" in measured
    swapped = {**check, "compare": {**check["compare"], "where": "cell == 'y'", "than_where": "cell == 'x'"}}
    assert evaluate_check(swapped, {"lab": cells})[0] == "does not hold"


def test_compare_equal_and_within():
    same = LAB.assign(m=[1.0, 1.0] * 4)
    equal = {"table": "lab", "metric": "m", "compare": {"objective": "a", "than": "b", "direction": "equal"}}
    assert evaluate_check(equal, {"lab": same})[0] == "holds"
    assert evaluate_check(equal, {"lab": LAB})[0] == "does not hold"
    within = {"table": "lab", "metric": "m", "objective": "a", "within": [1.8, 2.2]}
    verdict, measured, _ = evaluate_check(within, {"lab": LAB})  # a's mean 2.00, its interval [1.87, 2.13]
    assert verdict == "holds" and "mean 2.00 [1.87, 2.13]" in measured
    assert evaluate_check({**within, "statistic": "max"}, {"lab": LAB})[0] == "holds"  # max 2.1: no interval
    assert evaluate_check({**within, "statistic": "max", "within": [1.95, 2.05]}, {"lab": LAB})[0] == "does not hold"
    # the mean alone inside the band is no evidence: the interval decides, and one reaching out of it resolves nothing
    assert evaluate_check({**within, "within": [1.95, 2.05]}, {"lab": LAB})[0] == "not resolved"
    assert evaluate_check({**within, "within": [2.5, 3.0]}, {"lab": LAB})[0] == "does not hold"



def test_a_within_leaves_open_a_side_the_claim_does_not_bound():
    """A fraction every unit of which is at least 0.92 (four starting policies at 1.0): its t-interval reaches past
    1, so with the closed band [0.9, 1.0] the shipped CTPO claim was "not resolved"; with the side open each check
    holds. An accuracy that collapsed to ~0 is "at most 0.18" though its interval reaches below 0."""
    claim = load_claim(CLAIMS_DIR / "ctpo_prefix_ratio_variance.yaml")
    rows = [{START_SEED: p, "axis": axis, "point": point, "cumulative_sd_slope": 0.5 + 0.01 * (p - 4),
             "frac_positions_ordered": frac}
            for p, frac in zip(range(2, 7), (1.0, 1.0, 1.0, 1.0, 0.92), strict=True)
            for axis, point in (*(("staleness", k) for k in ("1", "2", "4", "8")), ("mismatch", "temperature=1.3"))]
    row = ledger_rows([claim], {claim.key: {"sqrt_growth": pd.DataFrame(rows)}})[0]
    # every check holds ("indicative": sqrt_growth has one row per axis point and starting policy)
    assert row["holds?"] == "indicative" and "frac_positions_ordered mean 0.984 [0.940, 1.03]" in row["measured"]
    assert "expected >= 0.9" in row["measured"]
    low = pd.DataFrame({"objective": "a", START_SEED: [p for p in range(2, 7) for _ in range(5)], "batch": 0,
                        "m": [0.05] + [0.0] * 24})
    verdict, measured, _ = evaluate_check({"table": "lab", "metric": "m", "within": [None, 0.18]}, {"lab": low})
    assert verdict == "holds" and "[-0.0" in measured and "expected <= 0.18" in measured
    assert evaluate_check({"table": "lab", "metric": "m", "within": [0.0, 0.18]}, {"lab": low})[0] == "not resolved"
    for bounds in ([None, None], [None, float("inf")]):  # an open side is null, and one side at least is a bound
        assert "null for a side the claim leaves open" in harness.apps.claims.check_problem(
            {"table": "lab", "metric": "m", "within": bounds}, "lab")



def test_a_difference_of_float_round_off_on_every_unit_is_no_difference():
    """Two quantities equal but for their last bits (R3 and R2 of the fp32 MoE lab) differ by ulps of one sign on
    every unit: the zero-width interval of those differences held "r3 > r2" under the confirmation design (margin
    3.55e-16 [3.55e-16, 3.55e-16]). Within round-off on every unit they are equal: not greater; a real difference
    of 0.1% still holds."""
    def table(relative: float) -> pd.DataFrame:
        rows = []
        for p in range(2, 7):
            for batch in range(5):
                v = 0.3 + 0.01 * ((p * 7 + batch) % 5)
                rows += [{START_SEED: p, "batch": batch, "objective": "a", "point": "r3", "m": v * (1 + relative)},
                         {START_SEED: p, "batch": batch, "objective": "a", "point": "r2", "m": v}]
        return pd.DataFrame(rows)

    check = {"table": "lab", "metric": "m",
             "compare": {"objective": "a", "than": "a", "where": "point == 'r3'", "than_where": "point == 'r2'"}}
    verdict, measured, _ = evaluate_check(check, {"lab": table(1e-15)})
    assert verdict == "does not hold" and "margin 0.00 [0.00, 0.00]" in measured
    assert evaluate_check(check, {"lab": table(1e-3)})[0] == "holds"
    equivalent = {**check, "compare": {**check["compare"], "direction": "equivalent", "margin": 1e-18}}
    assert evaluate_check(equivalent, {"lab": table(1e-15)})[0] == "holds"


def test_round_off_is_judged_unit_by_unit_not_against_the_largest_unit():
    """x exceeds y by 1.0 on every one of 25 units of about 1, and one unit is about 1e7 (a heavy-tailed spread): the
    round-off rule measured every unit's difference against the largest unit's size, so 1.0 read as round-off of 1e7
    and "x > y" did not hold (margin 0.00). Each unit's difference is round-off only against its own sides."""
    rows = []
    for p in range(2, 7):
        for batch in range(5):
            level = 1e7 if (p, batch) == (2, 0) else 1.0
            rows += [{START_SEED: p, "batch": batch, "objective": "a", "point": "x", "m": level + 1.0},
                     {START_SEED: p, "batch": batch, "objective": "a", "point": "y", "m": level}]
    check = {"table": "lab", "metric": "m",
             "compare": {"objective": "a", "than": "a", "where": "point == 'x'", "than_where": "point == 'y'"}}
    verdict, measured, _ = evaluate_check(check, {"lab": pd.DataFrame(rows)})
    assert verdict == "holds" and "margin 1.00 [1.00, 1.00]" in measured

def _paired(differences: dict[int, list[float]]) -> pd.DataFrame:
    """``final`` rows of objectives a and b, a - b = the given differences per starting policy (one per seed)."""
    return pd.DataFrame([{"objective": o, START_SEED: p, "seed": s, "m": 0.3 + d * (o == "a")}
                         for p, ds in differences.items() for s, d in enumerate(ds) for o in ("a", "b")])


def test_a_compare_is_not_resolved_when_its_interval_reaches_both_sides_or_there_is_none():
    """"does not hold" needs evidence against the claim (the interval wholly on the other side); an interval that
    straddles the bound, or none (two seeds of one starting policy: their range is no 95% interval), is "not
    resolved"."""
    greater = {"table": "final", "metric": "m", "compare": {"objective": "a", "than": "b", "direction": "greater"}}
    mixed = {p: [d, d] for p, d in zip(range(2, 7), (0.04, -0.03, 0.05, -0.02, 0.03), strict=True)}
    verdict, measured, _ = evaluate_check(greater, {"final": _paired(mixed)})
    assert verdict == "not resolved" and "margin 0.0140 [-0.0" in measured
    below = {p: [-0.03, -0.02] for p in range(2, 7)}
    assert evaluate_check(greater, {"final": _paired(below)})[0] == "does not hold"
    verdict, measured, _ = evaluate_check(greater, {"final": _paired({2: [0.001, 0.5]})})
    assert verdict == "not resolved" and "[n/a, n/a]" in measured
    assert evaluate_check(greater, {"final": _paired({2: [0.2, 0.3, 0.25]})})[0] == "holds"


def test_a_compare_states_the_estimate_its_interval_is_centred_on():
    """With starting policies of unequal seeds the estimate is the mean of the policies' means (the interval's
    centre), not the pooled mean of the units, which here lies outside the interval and has the other sign."""
    greater = {"table": "final", "metric": "m", "compare": {"objective": "a", "than": "b", "direction": "greater"}}
    unequal = {**{p: [1.0] for p in range(2, 6)}, 6: [-0.2 + 1e-3 * (s % 2) for s in range(100)]}
    verdict, measured, _ = evaluate_check(greater, {"final": _paired(unequal)})
    assert verdict == "holds" and "margin 0.760 [" in measured and "a 1.06, b 0.300" in measured


def test_compare_equivalent_on_final_accuracies_paired_by_seed():
    """``final`` rows (one per run): per seed, the selected cells' mean; equivalence when the t-interval of the
    paired mean difference (+-0.052 at 3 seeds here) is inside the margin."""
    final = pd.DataFrame({"seed": [0, 1, 2] * 4, "objective": ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3,
                          "train.lr": [1e-4] * 6 + [5e-4] * 6,
                          "final_eval_accuracy": [0.50, 0.52, 0.48, 0.49, 0.50, 0.50, 0.1, 0.1, 0.1, 0.4, 0.4, 0.4]})
    check = {"table": "final", "metric": "final_eval_accuracy", "where": "`train.lr` == 1e-4",
             "compare": {"objective": "a", "than": "b", "direction": "equivalent", "margin": 0.06}}
    verdict, measured, _ = evaluate_check(check, {"final": final})
    assert verdict == "holds" and "a - b: 0.00333 [" in measured and "3 seeds" in measured  # +0.01, +0.02, -0.02
    assert evaluate_check({**check, "compare": {**check["compare"], "margin": 0.01}}, {"final": final})[0] == \
        "not resolved"  # the interval reaches beyond +-0.01 and inside it
    assert evaluate_check({**check, "where": "`train.lr` == 5e-4"}, {"final": final})[0] == "does not hold"  # -0.3
    both = {**check, "where": None, "compare": {"objective": "a", "than": "b", "direction": "less"}}
    verdict, measured, _ = evaluate_check(both, {"final": final})  # per seed, the two cells' mean: a < b by 0.148
    assert verdict == "holds" and "a 0.300, b 0.448" in measured


def _scored(problems: dict[str, list[float]], lags=(0,)) -> dict:
    """A sweep's ``final`` table and SCORES: objectives x lags (one cell each) x starting policies 1, 2 x seeds 0-2,
    each run scoring 4 eval problems at its last evaluation (step 20) as ``problems`` gives (objective -> the scores,
    the lag added to each), plus, per seed, one shared problem's score that moves every run of the seed alike."""
    rows, scores = [], {}
    for o, base in problems.items():
        for lag in lags:
            for policy in (1, 2):
                for seed in range(3):
                    got = [v - 0.1 * lag for v in base] + [seed / 2]
                    rid = f"{o}-{lag}-{policy}-{seed}"
                    rows.append({"run_id": rid, "objective": o, "seed": seed, START_SEED: policy, "lag": lag,
                                 "cell_id": lag, "counted": True, "ended": True,
                                 "final_eval_accuracy": sum(got) / len(got)})
                    scores[rid] = pd.DataFrame({"step": 20, "problem": range(5), "answer": "7", "correct": got})
    return {"final": pd.DataFrame(rows), SCORES: scores}


def test_an_accuracy_check_counts_the_eval_problems():
    """A claim's eval accuracy is a sample of eval problems too: a beats b by 0.2 in every run, all on problem 0 of 5
    (1 against 0). Over the runs alone that is a zero-width interval, "holds"; over the problems as well (their
    mean differences 1, 0, 0, 0, 0: variance 0.2 / 5, 4 degrees of freedom) it is 0.2 +- 2.776 x 0.2, not resolved;
    runs without their per-problem scores are checked over the runs, and the ledger says which."""
    tables = _scored({"a": [1.0, 0.5, 0.5, 0.0], "b": [0.0, 0.5, 0.5, 0.0]})
    check = {"table": "final", "metric": "final_eval_accuracy", "compare": {"objective": "a", "than": "b"}}
    verdict, measured, units = evaluate_check(check, tables)
    half = 2.7764451 * 0.2
    assert verdict == "not resolved" and units == (2, 3, "seeds")
    assert f"margin 0.200 [{num(0.2 - half)}, {num(0.2 + half)}]" in measured
    assert "its interval counts the eval problems too" in measured
    verdict, measured, _ = evaluate_check(check, {"final": tables["final"]})  # no per-problem scores
    assert verdict == "holds" and "margin 0.200 [0.200, 0.200]" in measured
    equivalent = {**check, "compare": {**check["compare"], "direction": "equivalent", "margin": 0.9}}
    assert evaluate_check(equivalent, tables)[0] == "holds"  # [-0.355, 0.755] inside +-0.9
    del tables[SCORES]["b-0-2-1"]  # one run without its scores: over the runs, whose equal differences give no
    verdict, measured, _ = evaluate_check(check, tables)  # interval then (analysis/accuracy.py), not a zero width
    assert verdict == "not resolved" and "margin 0.200 [n/a, n/a]" in measured
    assert "does not count the eval problems (no per-problem scores for some run)" in measured
    two = _scored({"a": [1.0, 0.5, 0.5, 0.0], "b": [0.0, 0.5, 0.5, 0.0]})  # 2 policies x seed 0, b's on other problems
    two["final"] = two["final"][two["final"]["seed"] == 0].copy()
    two["final"].loc[two["final"]["run_id"] == "a-0-2-0", "final_eval_accuracy"] = 0.3  # a +0.2 and +0.1 over b
    two[SCORES] = {k: v.assign(problem=v["problem"] + 1) if k.startswith("b") else v for k, v in two[SCORES].items()}
    two[SCORES]["a-0-2-0"] = two[SCORES]["a-0-2-0"].assign(correct=[1.0, 0.0, 0.5, 0.0, 0.0])
    verdict, measured, _ = evaluate_check(check, two)  # over 2 runs only: their range [0.1, 0.2] is no 95% interval
    assert verdict == "not resolved" and "margin 0.150 [n/a, n/a]" in measured
    within = {"table": "final", "metric": "final_eval_accuracy", "objective": "b", "within": [0.0, 1.0]}
    verdict, measured, _ = evaluate_check(within, _scored({"b": [0.0, 0.5, 0.5, 0.0]}))
    assert verdict == "not resolved" and "(n=6; its interval counts the eval problems too;" in measured


def test_an_accuracy_checks_baseline_and_factor_go_problem_by_problem():
    """``baseline`` and ``factor`` on per-problem scores: a loses 0.1 per lag on four problems, b too, so the change
    of a minus the change of b is 0 on every problem and run; factor 0.5 takes half of b's scores."""
    tables = _scored({"a": [1.0, 0.5, 0.5, 0.0], "b": [0.9, 0.5, 0.5, 0.1]}, lags=(0, 1))
    check = {"table": "final", "metric": "final_eval_accuracy", "where": "lag == 1",
             "compare": {"objective": "a", "than": "b", "baseline": "lag == 0"}}
    verdict, measured, _ = evaluate_check(check, tables)  # 0 on 5 problems alike: no zero width (unvaried_bounds)
    q = 1 - 0.025 ** (1 / 5)  # each side a change in [-1, 1]: their difference in [-2, 2]
    assert verdict == "not resolved" and f"margin 0.00 [{num(-2 * q)}, {num(2 * q)}]" in measured
    assert "a minus [lag == 0] -0.0800, b minus [lag == 0] -0.0800" in measured
    double = {**check, "where": "lag == 0", "compare": {"objective": "a", "than": "b", "factor": 0.5}}
    verdict, measured, _ = evaluate_check(double, tables)  # a - 0.5 b per problem: 0.55, 0.25, 0.25, -0.05, seed/4
    assert "margin 0.250 [-0.0134, 0.513]" in measured and verdict == "not resolved"


def test_an_accuracy_check_on_the_runs_evaluations_counts_the_eval_problems():
    """``eval_accuracy`` of the ``runs`` table (one row per run and step): each run's mean over the selected
    evaluations, its per-problem scores averaged over them. a beats b by 0.2 at steps 15 and 20 (problem 0 of 5),
    ties at step 0 and logs no evaluation at step 16: over steps >= 15 the first test's interval; a run whose step-20
    scores are missing is over the runs."""
    rows, scores = [], {}
    for o, first in (("a", 1.0), ("b", 0.0)):
        for policy in (1, 2):
            for seed in range(3):
                rid, shared = f"{o}-{policy}-{seed}", seed / 2
                got = {0: [0.0, 0.5, 0.5, 0.0, shared], 15: [first, 0.5, 0.5, 0.0, shared],
                       20: [first, 0.5, 0.5, 0.0, shared]}
                rows += [{"run_id": rid, "objective": o, "seed": seed, START_SEED: policy, "cell_id": 0, "step": step,
                          "eval_accuracy": sum(got[step]) / 5 if step in got else float("nan")}
                         for step in (0, 15, 16, 20)]
                scores[rid] = pd.concat(pd.DataFrame({"step": step, "problem": range(5), "answer": "7",
                                                      "correct": values}) for step, values in got.items())
    tables = {"runs": pd.DataFrame(rows), SCORES: scores}
    check = {"table": "runs", "metric": "eval_accuracy", "where": "step >= 15",
             "compare": {"objective": "a", "than": "b"}}
    verdict, measured, units = evaluate_check(check, tables)
    half = 2.7764451 * 0.2
    assert verdict == "not resolved" and units == (2, 3, "seeds")
    assert f"margin 0.200 [{num(0.2 - half)}, {num(0.2 + half)}]" in measured
    assert "its interval counts the eval problems too" in measured
    scores["a-1-0"] = scores["a-1-0"][scores["a-1-0"]["step"] != 20]
    assert "does not count the eval problems" in evaluate_check(check, tables)[1]


def test_ledger_rows_and_files(tmp_path):
    claim = load_claim(CLAIMS_DIR / "dr_grpo_length_bias.yaml")
    table = pd.DataFrame({"batch": [0, 0, 1, 1, 2, 2], "objective": ["grpo", "dr_grpo"] * 3, "axis": ["staleness"] * 6,
                          "staleness": [0] * 6, "token_weight_long_over_short_wrong": [0.5, 1.0, 0.6, 1.0, 0.4, 1.0]})
    rows = ledger_rows([claim], {claim.key: {"lab": table}})
    assert rows[0]["holds?"] == "indicative"  # every check holds, from one starting policy x 3 batches
    assert (rows[0]["replication"], rows[0]["model"]) == ("1 starting policy x 3 batches", "tiny on arith")
    assert rows[0]["correction"].startswith("none across claims; within the claim every check must hold")
    table.loc[1, "token_weight_long_over_short_wrong"] = 2.0  # dr_grpo's interval reaches out of [0.95, 1.05]
    assert ledger_rows([claim], {claim.key: {"lab": table}})[0]["holds?"] == "not resolved"
    table.loc[[1, 3, 5], "token_weight_long_over_short_wrong"] = [2.0, 2.1, 1.9]  # ... lies wholly out of it
    rows = ledger_rows([claim], {claim.key: {"lab": table}})
    assert rows[0]["holds?"] == "does not hold (indicative)"  # from one starting policy x 3 batches, as "indicative"
    claim.checks[0]["where"] = "no_such_column == 1"  # reported in the ledger, not a crash after the runs
    assert ledger_rows([claim], {claim.key: {"lab": table}})[0]["holds?"] == "no data"
    path = write_ledger(rows, tmp_path, "stamp")
    text = path.read_text()
    assert "does not hold" in text and "Dr. GRPO" in text and (tmp_path / "ledger.html").exists()
    # the ledger a reader opens states each row's correction, as its replication and model (it was in ledger.csv
    # only): none across claims; "holds" needs both checks, "does not hold" follows from either (unadjusted)
    correction = ("none across claims; within the claim every check must hold, each at 95% (intersection-union "
                  "test); 2 checks; 'does not hold' rests on any one of them (each one-sided at 2.5%, unadjusted: "
                  "up to 5% for a true claim)")
    assert rows[0]["correction"] == correction
    assert "| holds? | replication | model | correction |" in text and f"| {correction} |" in text
    assert "<th>correction</th>" in (tmp_path / "ledger.html").read_text()


@pytest.mark.slow  # every shipped claim read (seconds): make test
def test_existing_results_only_start_nothing_and_missing_ones_are_no_data(tmp_path):
    """--existing: a sweep's tables from the runs that exist (the ended ones in ``final``, with ``collapsed``); an
    experiment never run gives no tables, and its checks say no data."""
    exp = tmp_path / "offpolicy"
    own = {(o, s): rid for (o, _, s), rid in ids_of(load_experiment("offpolicy", [f"results_dir={tmp_path}",
                                                                                   "sweep.grid.train.num_minibatches=[16]"])).items()}
    fake_experiment(exp, [fake_run(exp, "grpo", 0, {"train.num_minibatches": 16, START_SEED: 1}, final=0.4,
                                   run_id=own["grpo", 0]),
                          fake_run(exp, "gspo", 0, {"train.num_minibatches": 16, START_SEED: 1}, final=0.5,
                                   status="diverged", run_id=own["gspo", 0],
                                   summary_extra={"collapse": {"step": 2, "cause": "non_finite_loss"}}),
                          fake_run(exp, "ctpo", 0, {"train.num_minibatches": 16, START_SEED: 1}, final=0.02,
                                   status="stopped", run_id=own["ctpo", 0])])  # a run that did not end
    tables = run_source("sweep", "offpolicy", (f"results_dir={tmp_path}",), jobs=1, progress=False, run=False)
    final = tables["final"].set_index("objective")
    assert final.loc["gspo", "collapsed"] == 1.0 and final.loc["grpo", "collapsed"] == 0.0
    assert set(tables["runs"]["objective"]) == {"grpo", "gspo"}  # the runs ``final`` counts: the stopped one not
    assert list(exp.iterdir()) and not (exp / ".sweep.lock").exists()  # nothing was run
    missing = run_source("sweep", "step_size", (f"results_dir={tmp_path}",), jobs=1, progress=False, run=False)
    check = {"table": "final", "metric": "final_eval_accuracy", "compare": {"objective": "a", "than": "b"}}
    assert missing == {} and checked(check, missing)[0] == "no data"


def test_a_probe_runs_once_per_settings_and_its_claim_is_checked(tmp_path, monkeypatch):
    calls = []

    def probe(settings, task):  # moe_probe's rows, made up: deeper changes more
        calls.append(settings)
        return [{"layers": d, "seed": s, "lr": 5e-5, "expert_changed_frac": 0.01 * d + 0.001 * s}
                for d in settings.depths for s in settings.seeds]

    monkeypatch.setattr(harness.apps.claims, "volatility_by_depth", probe)
    monkeypatch.setattr(harness.apps.claims, "probe_task", lambda: None)
    claim = load_claim(CLAIMS_DIR / "moe_expert_volatility.yaml")
    overrides = (*claim.source[2], f"results_dir={tmp_path}")
    assert run_source("probe", "moe_update", overrides, jobs=1, progress=False, run=False) == {}  # --existing: none
    tables = run_source("probe", "moe_update", overrides, jobs=1, progress=False)
    assert calls[0].depths == (2, 4, 8) and calls[0].seeds == (0, 1, 2) and calls[0].sft_steps == 200
    assert run_source("probe", "moe_update", overrides, jobs=1, progress=False)["probe"].equals(tables["probe"])
    assert len(calls) == 1  # kept: the second call read it
    verdicts = [checked(c, tables)[0] for c in claim.checks]
    assert verdicts == ["holds", "holds"]  # 8 layers: 0.081 in [0.05, 0.2]; more than at 2 layers on every seed
    with pytest.raises(ConfigError, match="no setting depth; settings"):
        probe_settings(("depth=[2]",))


def policies_table(effect: dict[int, float], batches: int = 5) -> pd.DataFrame:
    """A lab table of starting policies (effect's keys) x ``batches`` batches: b's metric 1, a's 1 + effect[policy]
    (+-0.001)."""
    rows = []
    for policy, e in effect.items():
        for batch in range(batches):
            rows += [{START_SEED: policy, "batch": batch, "objective": "a", "m": 1 + e + 0.001 * (batch % 2)},
                     {START_SEED: policy, "batch": batch, "objective": "b", "m": 1.0}]
    return pd.DataFrame(rows)


def test_a_claim_holds_only_under_the_confirmation_design():
    check = {"table": "lab", "metric": "m", "compare": {"objective": "a", "than": "b"}}
    claim = Claim(name="x", claim="a beats b", paper="p", experiment={"lab": "lab"}, checks=[check])
    effects = {2: 0.5, 3: 0.52, 4: 0.48, 5: 0.49, 6: 0.51}
    steady = policies_table(effects)
    assert ledger_rows([claim], {claim.key: {"lab": steady}})[0]["holds?"] == "holds"
    row = ledger_rows([claim], {claim.key: {"lab": policies_table(effects, batches=4)}})[0]
    assert (row["holds?"], row["replication"]) == ("indicative", "5 starting policies x 4 batches")
    # 3 starting policies x 5 batches: an interval over 3 policies' means covers less than 95% (analysis/stats.py)
    three = steady[steady[START_SEED] <= 4]
    row = ledger_rows([claim], {claim.key: {"lab": three}})[0]
    assert (row["holds?"], row["replication"]) == ("indicative", "3 starting policies x 5 batches")
    one = steady[steady[START_SEED] == 2]
    assert ledger_rows([claim], {claim.key: {"lab": one}})[0]["holds?"] == "indicative"
    # every check must meet the design: one with 6 starting policies x 1 batch beside one with 5 x 5 is short of it
    # (the fewest policies of any check, and the fewest batches of any, are what the row states)
    thin = policies_table({**effects, 7: 0.5}, batches=1).rename(columns={"m": "m2"})
    both = Claim(name="y", claim="a beats b twice", paper="p", experiment={"lab": "lab"},
                 checks=[check, {**check, "metric": "m2"}])
    table = pd.concat([steady, thin])
    assert evaluate_check({**check, "metric": "m2"}, {"lab": table})[2] == (6, 1, "batches")
    row = ledger_rows([both], {both.key: {"lab": table}})[0]
    assert (row["holds?"], row["replication"]) == ("indicative", "5 starting policies x 1 batches")



def test_a_claim_does_not_hold_without_indicative_only_under_the_confirmation_design(tmp_path):
    """The coverage that makes a claim held from fewer than 5 starting policies "indicative" is that of the same
    interval lying wholly on the other side: a claim refuted from fewer (a probe's 1 x 3 seeds, 3 starting policies)
    is "does not hold (indicative)", from 5 x 5 "does not hold"; the ledger's count says how many are indicative."""
    check = {"table": "lab", "metric": "m", "compare": {"objective": "a", "than": "b"}}
    claim = Claim(name="x", claim="a beats b", paper="p", experiment={"lab": "lab"}, checks=[check])
    below = policies_table({2: -0.5, 3: -0.52, 4: -0.48, 5: -0.49, 6: -0.51})
    assert ledger_rows([claim], {claim.key: {"lab": below}})[0]["holds?"] == "does not hold"
    row = ledger_rows([claim], {claim.key: {"lab": below[below[START_SEED] <= 4]}})[0]
    assert (row["holds?"], row["replication"]) == ("does not hold (indicative)", "3 starting policies x 5 batches")
    # one check refuted under the design and one short of it: the claim does not hold
    thin = policies_table({2: -0.5, 3: -0.5}).rename(columns={"m": "m2"})
    both = Claim(name="y", claim="a beats b twice", paper="p", experiment={"lab": "lab"},
                 checks=[check, {**check, "metric": "m2"}])
    assert ledger_rows([both], {both.key: {"lab": pd.concat([below, thin])}})[0]["holds?"] == "does not hold"
    probe = load_claim(CLAIMS_DIR / "moe_expert_volatility.yaml")  # its seeds are its units: 1 "policy" x 3 seeds
    table = pd.DataFrame([{"layers": d, "seed": k, "objective": "grpo", "expert_changed_frac": 0.01 + 0.001 * k}
                          for d in (2, 8) for k in range(3)])
    rows = ledger_rows([probe, claim], {probe.key: {"probe": table}, claim.key: {"lab": below}})
    assert [r["holds?"] for r in rows] == ["does not hold (indicative)", "does not hold"]
    stamp = harness.apps.claims.ledger_stamp(rows, [], None, run=False, seconds=0.0)
    assert "2 do not hold (1 of them indicative), 0 not resolved" in stamp


def test_a_refutation_is_not_hidden_by_another_check_without_data():
    """A claim one check of which clearly does not hold while another found nothing to measure read "no data": the
    union rule ("does not hold" follows from any one check) gives "does not hold", marked indicative by the refuting
    check's own replication; without a refutation, "no data" still wins over "holds" and "not resolved"."""
    check = {"table": "lab", "metric": "m", "compare": {"objective": "a", "than": "b"}}
    missing = {**check, "metric": "no_such_metric"}  # "no data": the table has no such column
    claim = Claim(name="x", claim="a beats b", paper="p", experiment={"lab": "lab"}, checks=[missing, check])
    below = policies_table({2: -0.5, 3: -0.52, 4: -0.48, 5: -0.49, 6: -0.51})
    row = ledger_rows([claim], {claim.key: {"lab": below}})[0]
    assert row["holds?"] == "does not hold" and "no_such_metric: no lab row" in row["measured"]
    assert row["replication"] == "5 starting policies x 5 batches"
    row = ledger_rows([claim], {claim.key: {"lab": below[below[START_SEED] <= 4]}})[0]
    assert row["holds?"] == "does not hold (indicative)"  # refuted from 3 starting policies: as "indicative"
    for effects in ({2: 0.5, 3: 0.52, 4: 0.48, 5: 0.49, 6: 0.51}, {2: 0.5, 3: -0.5, 4: 0.0}):  # holds, not resolved
        assert ledger_rows([claim], {claim.key: {"lab": policies_table(effects)}})[0]["holds?"] == "no data"


def test_m2po_s_claim_needs_grpo_to_degrade_at_the_stress_lag():
    """"M2PO trains stably at a high staleness where GRPO does not": M2PO above GRPO at lag 16 and no M2PO collapse
    held the claim though GRPO ended higher at lag 16 than at lag 0; GRPO's own drop is a check of it too."""
    claim = load_claim(CLAIMS_DIR / "m2po_stable_at_high_staleness.yaml")
    level = {("grpo", 0): 0.30, ("grpo", 16): 0.35, ("m2po", 0): 0.45, ("m2po", 16): 0.45}
    final = pd.DataFrame([{"objective": o, "train.rollout_lag": lag, START_SEED: p, "seed": s, "collapsed": 0.0,
                           "final_eval_accuracy": level[o, lag] + 0.002 * ((p + s) % 3)}
                          for (o, lag) in level for p in range(2, 7) for s in range(5)])
    row = ledger_rows([claim], {claim.key: {"final": final}})[0]
    assert row["holds?"] == "does not hold" and "grpo [`train.rollout_lag` == 16] < grpo" in row["measured"]
    final.loc[(final["objective"] == "grpo") & (final["train.rollout_lag"] == 16), "final_eval_accuracy"] -= 0.1
    assert ledger_rows([claim], {claim.key: {"final": final}})[0]["holds?"] == "holds"


def test_the_moe_ratio_spread_claim_compares_what_the_routing_adds_to_each_ratio_s_spread():
    """GSPO's sequence ratio spreads less than GRPO's tokens whatever the routing: its level against GRPO's under R2
    held "the sequence ratio absorbs the routing changes" though the live routing inflated GSPO's spread by 1.6,
    more than GRPO's 1.5. The check compares each one's spread with the live routing relative to its own under R2
    (log scale): that does not hold; GSPO's 1.05 against GRPO's 1.5 holds."""
    claim = load_claim(CLAIMS_DIR / "moe_ratio_spread.yaml")

    def lab(gspo_inflation: float) -> pd.DataFrame:
        rows = []
        for p in range(2, 7):
            for batch in range(5):
                noise = 1 + 0.01 * ((p + batch) % 3)
                for o, r2, up in (("grpo", 0.3, 1.5), ("gspo", 0.06, gspo_inflation)):
                    rows += [{START_SEED: p, "batch": batch, "objective": o, "axis": axis, "point": point,
                              "staleness": 8, "ratio_std": r2 * noise * (up if axis == "staleness" else 1)}
                             for axis, point in (("staleness", "8"), ("routing", "r2"), ("routing", "r3"))]
        return pd.DataFrame(rows)

    row = ledger_rows([claim], {claim.key: {"lab": lab(1.6)}})[0]
    assert row["holds?"] == "does not hold" and "log ratio_std" in row["measured"]
    assert ledger_rows([claim], {claim.key: {"lab": lab(1.05)}})[0]["holds?"] == "holds"
    negative = {"table": "lab", "metric": "m", "compare": {"objective": "a", "than": "b", "scale": "log"}}
    assert "needs a positive metric" in checked(negative, {"lab": LAB.assign(m=LAB["m"] - 2)})[1]


def test_a_factor_on_a_log_scale_multiplies_y_not_its_log():
    """a is 1.5 x b on every unit: "a > 2 x b" does not hold, and does not on a log scale either, where the check
    read log a - 2 log b (b near 1: log b near 0) and held it; "a > 1.2 x b" holds on both scales."""
    rows = [{START_SEED: p, "batch": batch, "objective": o, "m": (1.5 if o == "a" else 1.0) * (1 + 0.01 * (p % 3))}
            for p in range(2, 7) for batch in range(5) for o in ("a", "b")]
    lab = pd.DataFrame(rows)
    for scale in ("linear", "log"):
        for factor, verdict in ((2, "does not hold"), (1.2, "holds")):
            check = {"table": "lab", "metric": "m",
                     "compare": {"objective": "a", "than": "b", "factor": factor, "scale": scale}}
            assert evaluate_check(check, {"lab": lab})[0] == verdict, (scale, factor)

def test_a_difference_that_depends_on_the_starting_policy_is_not_resolved():
    """+0.5, +0.02, +0.5 from three starting policies: every unit's difference is positive, and the 15 units pooled
    as batches of one policy would give a tight interval above 0; over the policies' means (2 degrees of freedom)
    the interval reaches below 0 (and above it: neither the claim nor its negation is supported)."""
    check = {"table": "lab", "metric": "m", "compare": {"objective": "a", "than": "b"}}
    table = policies_table({2: 0.5, 3: 0.02, 4: 0.5})
    verdict, measured, units = evaluate_check(check, {"lab": table})
    assert verdict == "not resolved" and units == (3, 5, "batches") and "3 starting policies x 5+ batches" in measured
    pooled = table.drop(columns=START_SEED).assign(batch=lambda t: t.index // 2)
    assert evaluate_check(check, {"lab": pooled})[0] == "holds"


def ids_of(cfg) -> dict[tuple[str, int, int], str]:
    """The run ids of a sweep's grid by (objective, starting policy, seed)."""
    return {(run.objective.name, int(run.model.seed), int(run.seed)): run_id(run) for run in run_configs(cfg)}


@pytest.mark.slow  # seconds of runs or reports: make test
def test_a_replicated_sweep_reads_only_its_own_design(tmp_path):
    """From starting policies of its own a claim's sweep has a folder of its own (results/claims/<experiment>/, not
    the experiment's, whose report covers every run there). That folder also holds runs of other designs: another
    starting policy, and another claim's setting at the same starting policies and seeds (num_minibatches 1, as a
    claim with other overrides of the same experiment runs): its tables hold the runs of its own design only, each
    with its starting policy."""
    overrides = (f"results_dir={tmp_path}", "sweep.grid.train.num_minibatches=[16]",
                 "sweep.grid.objective.name=[grpo,gspo]")
    cfg = harness.apps.claims.sweep_config("offpolicy", overrides, (2, 3), 2)
    exp = tmp_path / "claims" / "offpolicy"
    assert Path(cfg.results_dir) / cfg.name == exp and {Path(r.results_dir) for r in run_configs(cfg)} == {exp.parent}
    assert load_experiment("offpolicy", list(overrides)).results_dir == str(tmp_path)  # its own policy: its folder
    ids = ids_of(cfg)
    entries = [fake_run(exp, o, seed, {"train.num_minibatches": 16, START_SEED: policy}, final=0.4,
                       run_id=ids.get((o, policy, seed))) for o in ("grpo", "gspo") for policy in (1, 2, 3)
               for seed in (0, 1)]
    entries += [fake_run(exp, o, seed, {"train.num_minibatches": 1, START_SEED: policy}, final=0.9)
                for o in ("grpo", "gspo") for policy in (2, 3) for seed in (0, 1)]
    fake_experiment(exp, entries)
    for entry in entries:  # every run's per-problem scores at its last evaluation
        (exp / entry["run_id"] / "eval_samples.jsonl").write_text("".join(
            json.dumps({"step": 20, "problem": p, "answer": "1", "correct": int(p < 2)}) + "\n" for p in range(5)))
    tables = run_source("sweep", "offpolicy", overrides, (2, 3), 2, jobs=1, progress=False, run=False)
    assert len(tables["final"]) == 8 and set(tables["final"][START_SEED]) == {2, 3}
    assert set(tables["final"]["final_eval_accuracy"].round(6)) == {0.4}  # none of the other setting's runs
    assert set(tables["runs"]["run_id"]) == set(tables["final"]["run_id"]) == set(ids.values()) == set(tables[SCORES])
    check = {"table": "final", "metric": "final_eval_accuracy", "compare": {"objective": "gspo", "than": "grpo"}}
    assert "its interval counts the eval problems too" in evaluate_check(check, tables)[1]


@pytest.mark.slow  # seconds of runs or reports: make test
def test_a_claims_sweep_runs_of_two_code_versions_are_refused(tmp_path):
    """A sweep keeps a run another code version finished, so a claim's folder can hold runs of two versions (a
    claim's sweep resumed under new code): its checks would pool them, paired by seed, so reading them is refused in
    one line naming the versions; runs of one version (not this code's) are read, as the ledger stamps them."""
    overrides = (f"results_dir={tmp_path}", "sweep.grid.train.num_minibatches=[16]",
                 "sweep.grid.objective.name=[grpo,gspo]")
    exp = tmp_path / "claims" / "offpolicy"
    ids = ids_of(harness.apps.claims.sweep_config("offpolicy", overrides, (2, 3), 2))

    def runs(newer: set) -> list[dict]:
        return [fake_run(exp, o, seed, {"train.num_minibatches": 16, START_SEED: policy}, final=0.4,
                         run_id=ids[o, policy, seed],
                         summary_extra=code_segments("bbb" if (o, policy, seed) in newer else "aaa"))
                for o, policy, seed in ids]

    fake_experiment(exp, runs(set()))
    tables = run_source("sweep", "offpolicy", overrides, (2, 3), 2, jobs=1, progress=False, run=False)
    assert set(tables["final"]["code"]) == {"aaa"} and len(tables["final"]) == 8
    shutil.rmtree(exp)
    fake_experiment(exp, runs({("gspo", 3, 1)}))
    with pytest.raises(ConfigError, match=rf"runs a claim reads in {exp} are of different code versions \(7 by aaa, 1 "
                                          r"by bbb\) and would be paired with each other: move or delete"):
        run_source("sweep", "offpolicy", overrides, (2, 3), 2, jobs=1, progress=False, run=False)


@pytest.mark.slow
def test_a_claims_sweep_continued_under_other_code_is_refused_before_it_runs(tmp_path):
    """Before any run: a claim's design whose ended runs other code made, with runs left to do (under this code), is
    refused in one line (the read would refuse it after the runs); ended runs of one version with nothing left, or
    runs of this code, are not."""
    from harness.apps.sweep import check_runs_one_version
    from harness.run.provenance import code_record

    overrides = (f"results_dir={tmp_path}", "sweep.grid.train.num_minibatches=[16]",
                 "sweep.grid.objective.name=[grpo,gspo]")
    cfg = harness.apps.claims.sweep_config("offpolicy", overrides, (2, 3), 2)
    exp, runs, ids = tmp_path / "claims" / "offpolicy", run_configs(cfg), ids_of(cfg)

    def made(version: str, keys) -> None:
        shutil.rmtree(exp, ignore_errors=True)
        fake_experiment(exp, [fake_run(exp, o, seed, {"train.num_minibatches": 16, START_SEED: policy},
                                       run_id=ids[o, policy, seed], summary_extra=code_segments(version))
                              for o, policy, seed in keys])

    current = code_record()["version"]
    made("aaa", list(ids)[:5])
    with pytest.raises(ConfigError, match="are of different code versions") as refused:
        check_runs_one_version(cfg, runs, "the runs a claim reads")
    assert "5 by aaa" in str(refused.value) and f"3 by {current} (this code)" in str(refused.value)
    made("aaa", list(ids))
    check_runs_one_version(cfg, runs, "the runs a claim reads")  # nothing left to run: read as one version
    made(current, list(ids)[:5])
    check_runs_one_version(cfg, runs, "the runs a claim reads")


def test_compare_changes_from_a_baseline_paired_by_seed():
    """``baseline``: each objective's change from its own baseline rows, per seed (a degrades from 0.5 to 0.4, b from
    0.5 to 0.1: a degrades less, although at lag 0 a was not above b)."""
    final = pd.DataFrame({"seed": [0, 1, 2] * 4, "objective": ["a"] * 6 + ["b"] * 6,
                          "lag": [0, 0, 0, 8, 8, 8] * 2,
                          "final_eval_accuracy": [0.50, 0.52, 0.48, 0.40, 0.41, 0.39,
                                                  0.50, 0.55, 0.50, 0.10, 0.12, 0.11]})
    check = {"table": "final", "metric": "final_eval_accuracy", "where": "lag == 8",
             "compare": {"objective": "a", "than": "b", "baseline": "lag == 0"}}
    verdict, measured, _ = evaluate_check(check, {"final": final})
    assert verdict == "holds" and "a minus [lag == 0] -0.100, b minus [lag == 0] -0.407" in measured
    assert evaluate_check({**check, "compare": {**check["compare"], "direction": "less"}}, {"final": final})[0] == \
        "does not hold"
    without = {**check, "compare": {"objective": "a", "than": "b"}}  # the levels at lag 8: a above b too
    assert evaluate_check(without, {"final": final})[0] == "holds"


def test_a_probe_builds_its_own_models_and_takes_no_starting_policies():
    claim = load_claim(CLAIMS_DIR / "moe_expert_volatility.yaml")
    assert claim.start_policies == 5 and claim.design == (0, None)  # its seeds are its own inits and warm starts
    sweep = load_claim(CLAIMS_DIR / "gspo_stable_offpolicy.yaml")
    assert sweep.design == (5, 5)


@pytest.mark.slow  # expands the claims' sweeps round by round: make test
def test_a_claims_starting_policies_are_the_first_candidates_that_land(tmp_path, monkeypatch):
    """A claim's starting policies are sweep.first_landing's (a candidate whose warm start misses its band on this
    CPU is passed over), built before any experiment runs; `--existing` reads the ones a former call found and
    builds nothing; a lab on a saved policy is one starting policy: several are refused, not copied."""
    from harness.apps import claims

    asked = []

    def first_landing(runs_for, candidates, wanted, folder, at_once, progress):
        runs = runs_for([2, 3])
        asked.append((sorted({int(r.model.seed) for r in runs}), list(candidates), wanted, at_once))
        folder.mkdir(parents=True)
        (folder / claims.START_POLICIES).write_text(json.dumps({"landed": [2, 4, 5], "missed": {"3": "missed"}}))
        return {"landed": [2, 4, 5], "missed": {3: "missed"}}

    monkeypatch.setattr(claims, "first_landing", first_landing)
    key = ("sweep", "offpolicy", (f"results_dir={tmp_path}",), 3, 5)
    assert claims.start_seeds(key, 2, False, run=False) == (2, 3, 4)  # nothing found yet: the first candidates
    assert claims.start_seeds(key, 2, False, run=True) == (2, 4, 5)
    assert asked == [([2, 3], list(claims.START_CANDIDATES), 3, 2)]
    assert claims.start_seeds(key, 2, False, run=False) == (2, 4, 5) and len(asked) == 1  # read, not built
    assert claims.start_seeds(("sweep", "offpolicy", key[2], 0, None), 2, False, run=True) == ()  # its own policy
    own = ("lab", "lab", (f"results_dir={tmp_path}", "lab.policy=smollm2-135m-instruct"), 3, None)
    with pytest.raises(ConfigError, match=r"sets lab.policy: one saved starting policy.*set start_policies: 1"):
        claims.start_seeds(own, 2, False, run=False)
    assert claims.start_seeds((*own[:3], 0, None), 2, False, run=True) == () and len(asked) == 1


@pytest.mark.slow  # every run config of offpolicy's grid, twice (seconds): make test
def test_claims_check_their_runs_before_building_policies_and_again_for_a_replacement(tmp_path, monkeypatch):
    """`make claims` refuses a run other code began before it builds any starting policy (the design where none
    misses), and checks again the runs of a candidate that replaced one that missed its band."""
    from harness.apps import claims

    monkeypatch.chdir(tmp_path)  # the experiments' results_dir ("results") here, not the checkout's own runs
    order = []
    monkeypatch.setattr(claims, "check_runs_code", lambda cfg, runs, allow, command: order.append(
        ("check", sorted({int(r.model.seed) for r in runs}))))
    monkeypatch.setattr(claims, "start_seeds", lambda key, jobs, progress, run: run and order.append(
        ("build", key[1])) or ((2, 3, 5, 6, 7) if run else claims.START_CANDIDATES[: key[3]]))  # the others: unbuilt
    monkeypatch.setattr(claims, "run_source", lambda *args, **kwargs: {})
    assert claims.main(["gspo_stable_offpolicy"], jobs=1, progress=False, results_dir=str(tmp_path)) == 0
    assert order == [("check", [2, 3, 4, 5, 6]), ("build", "offpolicy"), ("check", [2, 3, 5, 6, 7])]
    assert "no data" in (tmp_path / "claims" / "ledger.md").read_text()


@pytest.mark.slow  # every run config of offpolicy's grid (seconds): make test
def test_claims_check_first_the_runs_of_the_starting_policies_a_former_call_found(tmp_path, monkeypatch):
    """Before anything is built, the runs checked are those of the starting policies a former call found (its
    start_policies.json: 2, 3, 6, 7 and 8 where 4 and 5 missed their band on this CPU), not the first candidates':
    a claims call after a commit, whose runs one code version had all ended, was refused as pairing that version's
    runs with runs of model.seed 4 that would never run (seen on the asynchronous claims)."""
    import hashlib

    from harness.apps import claims

    monkeypatch.chdir(tmp_path)  # the experiments' results folder, results/, is here
    (claim,) = load_claims(["gspo_stable_offpolicy"])
    _, name, overrides = claim.source
    hashed = hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:8]  # as start_seeds names its folder
    folder = tmp_path / "results" / "prepare" / f"{name}_{hashed}"
    folder.mkdir(parents=True)
    (folder / claims.START_POLICIES).write_text(json.dumps({"landed": [2, 3, 6, 7, 8],
                                                             "missed": {"4": "low", "5": "low"}}))
    checked = []
    monkeypatch.setattr(claims, "check_runs_code", lambda cfg, runs, allow, command: None)
    monkeypatch.setattr(claims, "check_runs_one_version", lambda cfg, runs, what: checked.append(
        sorted({int(r.model.seed) for r in runs})))
    monkeypatch.setattr(claims, "first_landing", lambda *args: {"landed": [2, 3, 6, 7, 8]})
    monkeypatch.setattr(claims, "run_source", lambda *args, **kwargs: {})
    assert claims.main(["gspo_stable_offpolicy"], jobs=1, progress=False) == 0
    assert checked == [[2, 3, 6, 7, 8]]


@pytest.mark.slow  # two shipped claims checked by main (seconds): make test
def test_the_ledger_counts_a_run_two_claims_read_once(tmp_path, monkeypatch):
    """Two claims whose experiments share runs (m2po's and gspo's: grpo at lags 0 and 16 from the same policies and
    seeds) read them both; the ledger's stamp counts each run once (it counted 180 runs where 120 ran), and runs of
    two experiments' folders that share a run id (an id names a run within its folder) as two (gspo_clip_repro's
    runs were counted as the async claims')."""
    from harness.apps import claims

    def run_source(kind, name, overrides, seeds_of_policies, seeds, jobs, progress, run, allow_code_change):
        other = "m2po" if "m2po" in " ".join(overrides) else "gspo"
        ids = [f"grpo_{i}" for i in range(4)] + [f"{other}_{i}" for i in range(4)]
        if name == "gspo_clip_repro":
            return {"final": pd.DataFrame({"run_id": ids, "code": "bbb", "threads": "1", "folder": name})}
        return {"final": pd.DataFrame({"run_id": ids, "code": "aaa", "threads": "1", "folder": name})}

    monkeypatch.setattr(claims, "run_source", run_source)
    monkeypatch.setattr(claims, "start_seeds", lambda key, jobs, progress, run: claims.START_CANDIDATES[: key[3]])
    monkeypatch.setattr(claims, "check_runs_code", lambda *args: None)
    monkeypatch.setattr(claims, "check_runs_one_version", lambda *args: None)
    monkeypatch.setattr(claims, "load_claims", lambda names, with_long: [
        load_claim(CLAIMS_DIR / f"{n}.yaml") for n in ("m2po_stable_at_high_staleness", "gspo_degrades_less_with_lag",
                                                         "gspo_clips_more")])
    assert claims.main(None, jobs=1, progress=False, results_dir=str(tmp_path)) == 0
    text = (tmp_path / "claims" / "ledger.md").read_text()
    assert "code `aaa`: 12 runs, torch threads per run 1 (12 runs)" in text
    assert "code `bbb`: 8 runs, torch threads per run 1 (8 runs)" in text


@pytest.mark.slow  # every shipped claim's experiment loaded, by three calls (seconds): make test
def test_naming_claims_runs_theirs_and_the_ledger_keeps_a_row_for_every_other_claim(tmp_path, monkeypatch, capsys):
    """`python -m harness claims NAME` runs the named claims' experiments only; the other claims of a bare call are
    checked on their runs as they are, so results/claims/ledger.md keeps their rows instead of becoming a ledger of
    the named claim alone; the stamp says what ran. An unnamed claim whose runs cannot be read (two code versions)
    is a row saying why, not a stop after the named runs; a named one stops the call."""
    from harness.apps import claims

    ran = {}

    def run_source(kind, name, overrides, seeds_of_policies, seeds, jobs, progress, run, allow_code_change):
        ran[kind, name, overrides] = run
        if name == "moe_stability":
            raise ConfigError("the runs a claim reads in there are of different code versions (1 by aaa, 1 by bbb)")
        return {}

    monkeypatch.setattr(claims, "run_source", run_source)
    monkeypatch.setattr(claims, "start_seeds", lambda key, jobs, progress, run: claims.START_CANDIDATES[: key[3]])
    monkeypatch.setattr(claims, "check_runs_code", lambda *args: None)
    monkeypatch.setattr(claims, "check_runs_one_version", lambda *args: None)
    assert claims.main(["gspo_clips_more"], jobs=1, progress=False, results_dir=str(tmp_path)) == 0
    assert [source for source, run in ran.items() if run] == [("sweep", "gspo_clip_repro", ())]
    ledger = pd.read_csv(tmp_path / "claims" / "ledger.csv")
    assert list(ledger["name"]) == [c.name for c in load_claims()]  # every claim, in file order
    replay = ledger.set_index("name").loc["moe_routing_replay"]
    assert replay["holds?"] == "no data" and "not read: the runs a claim reads in there are of different" in replay[
        "measured"]
    n = len(ledger)
    text = (tmp_path / "claims" / "ledger.md").read_text()
    assert (f"{n} claims, 0 hold" in text and "the named claims' experiments run or resumed in" in text
            and "by `python -m harness claims gspo_clips_more` (wall time of this call on " in text
            and " cores, 1 run at a time; torch " in text and "; 1-minute load average " in text
            and f" after); the other {n - 1} claims checked on the runs that existed" in text)
    # the code that checked them, beside the runs' own: a check changed by later code changes a verdict
    from harness.run.provenance import code_record

    assert f"Verdicts checked by code `{code_record()['version']}`." in text
    assert "\ngspo_clips_more: no data\n" in capsys.readouterr().err
    assert claims.main(None, jobs=1, progress=False, results_dir=str(tmp_path), run=False) == 0  # --existing: rows
    with pytest.raises(ConfigError, match="different code versions"):
        claims.main(["moe_routing_replay"], jobs=1, progress=False, results_dir=str(tmp_path))


@pytest.mark.slow
def test_a_claims_labs_run_apart_as_lab_commands_give_the_tables_of_labs_run_here(tmp_path, monkeypatch):
    """With several starting policies and jobs > 1 each lab is a `python -m harness lab` command of its own (a
    process through the local launcher; here a stand-in launcher runs the command in this process, one at a time):
    its model.seed, its name and the threads share on the command line, its log beside its folder, and its tables
    equal those of the same labs run one after another here."""
    from types import SimpleNamespace

    from harness.apps.cli import main as cli
    from harness.run import threads
    from tests.helpers.tiny import TINY_RUN, VARIED_REWARD

    class InProcess:
        name = "local"
        commands = []  # (args, log) of each command started

        def threads(self, jobs):
            return 1

        def adopt(self, name):
            return None

        def start(self, args, log, name):
            self.commands.append((args, log))
            code = cli(args)
            return SimpleNamespace(poll=lambda: code, stop=lambda: None, error=None)

    monkeypatch.setattr(threads, "_PREFERRED", 0)  # the lab command sets the process's preference
    monkeypatch.setattr(harness.apps.claims, "LocalLauncher", InProcess)
    settings = (*TINY_RUN, VARIED_REWARD, "lab.objectives=[grpo,gspo]", "lab.batches=2", "lab.staleness=[0,1]",
                "lab.mismatch=[]", "lab.reference_samples=2")
    here = harness.apps.claims.lab_tables("base", (*settings, f"results_dir={tmp_path / 'here'}"), (2, 3),
                                          progress=False, run=True, jobs=1)
    assert not InProcess.commands
    apart = harness.apps.claims.lab_tables("base", (*settings, f"results_dir={tmp_path / 'apart'}"), (2, 3),
                                           progress=False, run=True, jobs=2)
    assert set(here) == set(apart) == {"lab", "pairwise", "snr", "sqrt_growth"}
    for table in here:
        pd.testing.assert_frame_equal(here[table], apart[table])
    assert sorted(here["lab"][START_SEED].unique()) == [2, 3] and here["lab"]["grad_norm"].max() > 0
    tag = harness.apps.claims.overrides_tag(settings)  # the lab's settings: its folders' names say them
    for (args, log), seed in zip(InProcess.commands, (2, 3), strict=True):
        assert args[:2] == ["lab", "base"] and f"model.seed={seed}" in args and f"name=base_{tag}_start{seed}" in args
        assert args[-2:] == ["--threads", "1"] and log == tmp_path / "apart" / "lab" / f"base_{tag}_start{seed}.log"


def test_a_lab_that_fails_apart_stops_the_claims_with_its_error_in_one_line(tmp_path, monkeypatch):
    """A claim's lab run in a process of its own that fails: the claims call stops with one line that names the lab,
    its exit status and the last line of its log (its own error), not a traceback that only points at the log."""
    from types import SimpleNamespace

    from harness.apps import claims

    class Failing:
        name = "local"

        def threads(self, jobs):
            return 1

        def adopt(self, name):
            return None

        def start(self, args, log, name):
            log.write_text("lab: starting\nconfig error: results/lab/x holds a lab with other settings\n\n")
            return SimpleNamespace(poll=lambda: 2, stop=lambda: None, error=None)

    monkeypatch.setattr(claims, "LocalLauncher", Failing)
    cfgs = claims.lab_configs("lab", (f"results_dir={tmp_path}",), (2, 3))
    with pytest.raises(ConfigError, match=r"the lab lab_start2 failed \(exit 2: config error: results/lab/x holds a "
                                          r"lab with other settings\); log in .*lab_start2\.log"):
        claims.labs_apart("lab", (f"results_dir={tmp_path}",), cfgs, jobs=2)


def test_two_claims_labs_of_other_settings_have_folders_of_their_own():
    """A claim's labs are named by the lab, the overrides that change its settings and the starting policy: the
    claims on the default lab share `lab_start<model.seed>`, Dr. GRPO's (40 fresh batches at staleness 0) has folders
    of its own (they shared one, and `make claims` stopped at its lab: "holds a lab with other settings");
    results_dir only says where."""
    from harness.apps.claims import lab_configs

    default = {c.key for c in load_claims() if c.source[:2] == ("lab", "lab") and not c.source[2]}
    assert len(default) == 1  # cispo, ctpo_prefix, gspo_token, sequence_ratio_bf16: one experiment
    (dr_grpo,) = load_claims(["dr_grpo_length_bias"])
    names = [c.name for c in lab_configs("lab", (), (2, 3))]
    assert names == ["lab_start2", "lab_start3"]
    assert [c.name for c in lab_configs("lab", ("results_dir=elsewhere",), (2, 3))] == names
    theirs = [c.name for c in lab_configs("lab", dr_grpo.source[2], (2, 3))]
    assert theirs[0].startswith("lab_") and theirs[0].endswith("_start2") and not set(theirs) & set(names)
    assert [c.name for c in lab_configs("lab", dr_grpo.source[2], (2, 3))] == theirs


def test_the_ledger_names_each_labs_code_and_labs_of_two_codes_are_not_pooled(tmp_path):
    """Labs are stamped as runs are, with their code versions; a claim's labs (one per starting policy, pooled by its
    checks) measured by two codes, or one of them before labs recorded their code, are refused."""
    from analysis.lab import CODE_FILE
    from harness.apps.claims import check_one_code, labs_stamp

    def lab(codes):
        return {"lab": pd.DataFrame({START_SEED: [2, 2, 3, 4], "code": codes})}

    assert labs_stamp({("sweep", "offpolicy", (), 3, 5): {"final": pd.DataFrame()}}) == ""
    assert labs_stamp({("lab", "lab", (), 3, 5): lab(["aaaaaaa"] * 4)}) == " Labs measured: code `aaaaaaa`: 3 labs."
    two = labs_stamp({("lab", "lab", (), 3, 5): lab(["aaaaaaa"] * 4),
                      ("lab", "lab_moe", (), 3, 5): lab(["bbbbbbb"] * 4)})
    assert two == " Labs measured: code `aaaaaaa`: 3 labs; code `bbbbbbb`: 3 labs."
    folders = [tmp_path / f"lab_start{seed}" for seed in (2, 3, 4)]
    for folder, version in zip(folders, ("aaaaaaa", "aaaaaaa", "bbbbbbb"), strict=True):
        folder.mkdir()
        (folder / CODE_FILE).write_text(json.dumps({"version": version}))
    check_one_code(folders[:2])
    with pytest.raises(ConfigError, match="lab_start2 by aaaaaaa, lab_start3 by aaaaaaa, lab_start4 by bbbbbbb were "
                                          "measured by different code"):
        check_one_code(folders)
    (folders[2] / CODE_FILE).unlink()  # before labs recorded their code: unknown, not the others' code either
    with pytest.raises(ConfigError, match="lab_start4 by unknown"):
        check_one_code(folders)


@pytest.mark.slow
def test_a_check_on_an_objective_the_sweep_does_not_run_or_a_bad_margin_is_refused_before_the_sweep(tmp_path):
    """A check naming an objective outside its sweep's grid, or an equivalence margin <= 0, gave "no data" or a claim
    that can never hold, after the whole sweep (docs/claims_ledger.md says how long a2po_one_sample's takes)."""
    from harness.apps.claims import check_claims, check_compared_objectives

    path = tmp_path / "bad.yaml"
    for margin in ("-0.05", "0", ".inf", "yes", "'a'"):
        path.write_text("claim: x\npaper: y\nexperiment: {sweep: a2po_one_sample}\nchecks: [{table: final, metric: m, "
                        f"compare: {{objective: a2po, than: grpo, direction: equivalent, margin: {margin}}}}}]\n")
        with pytest.raises(ConfigError, match="bad.yaml: compare.margin must be a number > 0"):
            load_claim(path)
    claim = load_claim(CLAIMS_DIR / "a2po_one_sample.yaml")
    check_compared_objectives(claim, {"grpo", "a2po"})
    typo = dataclasses.replace(claim, checks=[{**claim.checks[0], "compare": {**claim.checks[0]["compare"],
                                                                             "objective": "a2poo"}}])
    with pytest.raises(ConfigError, match=r"^claim a2po_one_sample: a check's objective 'a2poo' is not an objective "
                                          r"its sweep runs \(a2po, grpo\)"):
        check_compared_objectives(typo, {"grpo", "a2po"})
    other = dataclasses.replace(claim, checks=[{**claim.checks[0], "compare": {**claim.checks[0]["compare"],
                                                                              "than": "gspo"}}])
    with pytest.raises(ConfigError, match="check's than 'gspo' is not an objective its sweep runs"):
        check_claims([other], {other.key: ()}, {other.key}, allow_code_change=False)  # as the command runs it


def test_an_accuracy_check_of_no_objective_averages_the_objectives_of_a_unit():
    """A ``within`` check that names no objective takes, per (starting policy, seed), the mean over the objectives
    (and cells) selected, as over the runs alone: a's runs and b's of one key are not one replacing the other. a's
    mean is 0.5 and b's 0.3 (the shared problem adds seed / 2 to both), so their mean is 0.4 either way."""
    tables = _scored({"a": [1.0, 0.5, 0.5, 0.0], "b": [0.0, 0.5, 0.5, 0.0]})
    within = {"table": "final", "metric": "final_eval_accuracy", "within": [0.0, 1.0]}
    with_scores, runs_only = (evaluate_check(within, t)[1] for t in (tables, {"final": tables["final"]}))
    assert "final_eval_accuracy mean 0.400 [" in with_scores and "counts the eval problems too" in with_scores
    assert "final_eval_accuracy mean 0.400 [" in runs_only


def test_an_accuracy_check_over_two_cells_takes_each_unit_s_mean_over_them():
    """a's runs in two cells, the second 0.1 lower on each of 4 of its 5 problems: 0.5 and 0.42, mean 0.46 per unit
    (the first cell alone would say 0.5)."""
    within = {"table": "final", "metric": "final_eval_accuracy", "objective": "a", "within": [0.0, 1.0]}
    verdict, measured, _ = evaluate_check(within, _scored({"a": [1.0, 0.5, 0.5, 0.0]}, lags=(0, 1)))
    assert "a final_eval_accuracy mean 0.460 [" in measured and "counts the eval problems too" in measured


def test_an_accuracy_check_that_b_is_less_than_a_has_the_margin_of_a_over_b():
    """"b < a" by 0.2 per run: the margin +0.2, with the interval of "a > b" (0.2 +- t(4) x 0.2), not its mirror."""
    tables = _scored({"a": [1.0, 0.5, 0.5, 0.0], "b": [0.0, 0.5, 0.5, 0.0]})
    less = {"table": "final", "metric": "final_eval_accuracy", "compare": {"objective": "b", "than": "a",
                                                                          "direction": "less"}}
    verdict, measured, _ = evaluate_check(less, tables)
    half = 2.7764451 * 0.2
    assert verdict == "not resolved" and f"b < a: margin 0.200 [{num(0.2 - half)}, {num(0.2 + half)}]" in measured


def test_an_accuracy_check_of_one_starting_policy_and_two_seeds_has_no_interval_even_with_scores():
    """Two seeds of one starting policy: no 95% interval over their spread, scores or not (the claims' rule)."""
    tables = _scored({"a": [1.0, 0.5, 0.5, 0.0], "b": [0.0, 0.5, 0.5, 0.0]})
    tables["final"] = tables["final"][(tables["final"][START_SEED] == 1) & (tables["final"]["seed"] < 2)]
    check = {"table": "final", "metric": "final_eval_accuracy", "compare": {"objective": "a", "than": "b"}}
    verdict, measured, _ = evaluate_check(check, tables)
    assert verdict == "not resolved" and "margin 0.200 [n/a, n/a]" in measured


def test_a_best_accuracy_s_row_says_its_interval_leans_upward_and_unnamed_problems_fall_back():
    """The best evaluation is chosen on the problems its interval then resamples: the row says it is optimistic.
    Samples that do not name their answers cannot be paired by problem: over the runs, said, not an error."""
    tables = _scored({"a": [1.0, 0.5, 0.5, 0.0], "b": [0.0, 0.5, 0.5, 0.0]})
    tables["final"]["best_eval_accuracy"] = tables["final"]["final_eval_accuracy"]
    best = {"table": "final", "metric": "best_eval_accuracy", "compare": {"objective": "a", "than": "b"}}
    verdict, measured, _ = evaluate_check(best, tables)
    assert "counts the eval problems too, each run's best evaluation, chosen on them, taken as given: optimistic" \
        in measured
    tables[SCORES] = {k: v.drop(columns="answer") for k, v in tables[SCORES].items()}
    verdict, measured, _ = evaluate_check(best, tables)
    assert "does not count the eval problems (no per-problem scores for some run)" in measured


def test_a_where_selects_rows_and_runs_no_code(tmp_path):
    """selection() refuses what where_problem refuses even when a check was not read from a file, and evaluates
    the string tests a shipped claim uses (point.str.startswith) with nothing of the module in reach."""
    table = pd.DataFrame({"point": ["temperature 1", "0"], "train.lr": [1e-4, 2e-4]})
    assert list(selection(table, "point.str.startswith('temperature')").index) == [0]
    assert list(selection(table, "`train.lr` == 2e-4").index) == [1]
    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match="does not parse"):
        selection(table, f"@pd.io.common.os.system('touch {marker}') == 0")
    with pytest.raises(ValueError, match="is not allowed"):
        selection(table, f"point.str.startswith('x').__class__.__init__.__globals__ == '{marker}'")
    assert not marker.exists()


def test_a_lab_claim_naming_an_objective_its_lab_does_not_run_is_refused_before_the_lab(monkeypatch):
    """A typo in a lab claim's objective was found only after the lab had run ("no data")."""
    claim = Claim(name="c", claim="x", paper="y", experiment={"lab": "lab_moe"},
                  checks=[{"table": "lab", "metric": "m", "compare": {"objective": "gspoo", "than": "grpo"}}])
    with pytest.raises(ConfigError, match=r"claim c: a check's objective 'gspoo' is not an objective its lab runs "
                                          r"\(ctpo, grpo, gspo, gspo_token\); did you mean gspo\?"):
        check_claims([claim], {claim.key: (2,)}, set(), False)


@pytest.mark.parametrize("record, message", [
    ('{"landed": [-1, 2], "missed": {}}', "is not a record of the starting policies found"),
    ('{"landed": [2, 2], "missed": {}}', "is not a record of the starting policies found"),
    ('{"landed": [2], "missed": {"2": "x"}}', "is not a record of the starting policies found"),
    ("not json", "is not a record of the starting policies found"),
    (None, "is a link or not a file"),  # a folder in its place: an IsADirectoryError when written
])
def test_a_start_policies_record_it_did_not_write_is_named_before_anything(tmp_path, record, message):
    """An edited start_policies.json was read as it stood: [] selected the experiment's own folder (other runs, a
    verdict changed without a word), -1 a config error that named neither the file nor the claim."""
    path = tmp_path / "prepare" / "quickstart_x" / START_POLICIES
    path.parent.mkdir(parents=True)
    path.mkdir() if record is None else path.write_text(record)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))} {message}"):
        check_prepare_folder(path.parent, START_CANDIDATES)
        recorded_starts(path, 2)


def test_a_start_policies_record_with_fewer_than_wanted_goes_on_past_its_misses(tmp_path):
    """A record of fewer policies than a claim now asks for: those, then the next candidates not recorded as missed
    (an emptied list read the experiment's own folder)."""
    path = tmp_path / START_POLICIES
    path.write_text('{"candidates": [2, 3, 4, 5], "landed": [2], "missed": {"3": "missed its band"}}')
    assert recorded_starts(path, 3) == (2, 4, 5)
    path.write_text('{"landed": [], "missed": {}}')
    assert recorded_starts(path, 2) == START_CANDIDATES[:2]
    assert recorded_starts(tmp_path / "none.json", 2) == START_CANDIDATES[:2]


def test_a_linked_starting_policy_folder_is_refused_before_any_build(tmp_path):
    """A model_seed_<N> build folder that is a link to a folder of the user's: its config.yaml was replaced through
    the link (and a build's log appended to the user's train.log)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("mine\n")
    folder = tmp_path / "prepare" / "quickstart_x"
    folder.mkdir(parents=True)
    (folder / "model_seed_2").symlink_to(mine)
    with pytest.raises(ConfigError, match=r"model_seed_2 is a symbolic link"):
        first_landing(lambda seeds: [], (2, 3), 1, folder, 1, False)
    (folder / "model_seed_2").unlink()
    folder.rmdir()
    folder.symlink_to(mine)
    with pytest.raises(ConfigError, match=r"quickstart_x is a symbolic link"):
        first_landing(lambda seeds: [], (2, 3), 1, folder, 1, False)
    assert (mine / "config.yaml").read_text() == "mine\n" and sorted(p.name for p in mine.iterdir()) == ["config.yaml"]


@pytest.mark.slow  # every shipped claim's experiment loaded (seconds): make test
def test_every_shipped_claim_s_starting_policies_can_be_built(tmp_path, monkeypatch):
    """start_seeds makes the run configs first_landing builds each claim's starting policies from: dr_grpo's lab
    claim pins seed=1 in its overrides, and the configs' seed grid of one seed made every `make claims` call stop
    with "seed is given twice" before anything ran."""
    from harness.apps import claims

    monkeypatch.chdir(tmp_path)
    built = {}

    def first_landing(runs_for, candidates, wanted, folder, jobs, progress):
        built[folder.name] = {int(run.model.seed) for run in runs_for(list(candidates[:wanted]))}
        return {"landed": list(candidates[:wanted])}

    monkeypatch.setattr(claims, "first_landing", first_landing)
    shipped = [c for c in load_claims(None, with_long=True) if c.design[0]]
    for claim in shipped:
        assert claims.start_seeds(claim.key, 1, False, run=True) == START_CANDIDATES[:claim.design[0]], claim.name
    assert len(built) >= 5 and all(seeds == set(START_CANDIDATES[:5]) for seeds in built.values())


def test_an_accuracy_check_of_scores_alike_on_every_problem_has_no_zero_width_interval():
    """Every run scores 0 on every eval problem (a collapse), or a and b answer every problem alike: the claims read
    `[0.00, 0.00]` (interval_of without the quantity's range), where the report and the zoo give Clopper-Pearson's
    bound for none of the n problems differing (analysis/accuracy.py unvaried_bounds). A zero width decided the
    verdicts: "accuracy >= 0.3", "a > b" did not hold and "a matches b within 0.05" held, on 5 problems that cannot
    tell."""
    from analysis.accuracy import ACCURACY_RANGE, DIFFERENCE_RANGE, unvaried_bounds

    tables = _scored({"a": [0.0] * 4, "b": [0.0] * 4})
    tables["final"]["final_eval_accuracy"] = 0.0
    tables[SCORES] = {k: v.assign(correct=0.0) for k, v in tables[SCORES].items()}
    within = {"table": "final", "metric": "final_eval_accuracy", "objective": "a", "within": [0.3, None]}
    verdict, measured, _ = evaluate_check(within, tables)
    low, high = unvaried_bounds(0.0, 5, ACCURACY_RANGE)
    assert verdict == "not resolved" and f"mean 0.00 [{num(low)}, {num(high)}]" in measured and high > 0.5
    greater = {"table": "final", "metric": "final_eval_accuracy", "compare": {"objective": "a", "than": "b"}}
    low, high = unvaried_bounds(0.0, 5, DIFFERENCE_RANGE)
    verdict, measured, _ = evaluate_check(greater, tables)
    assert verdict == "not resolved" and f"margin 0.00 [{num(low)}, {num(high)}]" in measured
    equivalent = {**greater, "compare": {**greater["compare"], "direction": "equivalent", "margin": 0.05}}
    assert evaluate_check(equivalent, tables)[0] == "not resolved"
    half = {**greater, "compare": {**greater["compare"], "factor": 0.5}}  # a - 0.5 b lies in [-0.5, 1]
    assert f"[{num(unvaried_bounds(0.0, 5, (-0.5, 1.0))[0])}, " in evaluate_check(half, tables)[1]


def test_replication_is_the_fewest_units_of_any_policy_and_a_touching_interval_is_not_resolved():
    """A claim holds only where every starting policy has DESIGN's units: replication reports the fewest (3 of policy
    b's, not policy a's 5), and a check of 5 policies one of which has 4 seeds does not meet the design. An interval
    whose end touches the claimed bound is not wholly outside it: not resolved, not refuted."""
    from harness.apps import claims

    def units(seeds: dict) -> pd.Series:
        return pd.Series(1.0, index=pd.MultiIndex.from_tuples([(p, s) for p, n in seeds.items() for s in range(n)]))

    assert claims.replication(units({"a": 5, "b": 3}), "final") == (2, 3, "seeds")
    five = claims.replication(units({"a": 5, "b": 5, "c": 5, "d": 5, "e": 4}), "runs")
    assert five == (5, 4, "seeds") and not claims.meets_design(five)
    assert claims.verdict_of(0.1, 0.5, 0.5, 1.0) == claims.verdict_of(1.0, 1.2, 0.5, 1.0) == claims.NOT_RESOLVED
    assert claims.verdict_of(0.1, 0.49, 0.5, 1.0) == "does not hold"
