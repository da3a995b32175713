"""A refactoring changes no result: the runs of tests/golden/make_golden.py (native loop: grpo with a KL term,
epochs and warm-up, gspo micro-batched with shuffled rows and a padded forward, ctpo recomputing old log-probs with
the cache decoder, p3o's minibatch statistics, cispo / gspo_token / tbpo under a bf16 sampler with and without a
rollout correction, dapo's dynamic sampling with the hf sampler, conspo's whole groups; the TRL backend: grpo with
a KL term, gspo with a rollout correction, p3o's statistics; the gradient lab) give bit-identical metrics, eval
samples and final weights to those recorded in tests/golden/golden.json.

The goldens hold for the build they were made with (torch / transformers / trl versions and the CPU's vector
instructions): golden.json holds one entry per build (e.g. AVX2 and AVX512); on a build it has none for, this test
skips and names the builds it has. Add one with
``OMP_NUM_THREADS=1 .venv/bin/python -m tests.golden.make_golden`` on a commit you trust (make_golden's docstring),
then run this test on the commit under test. An entry may mark a run's metric stale (its definition changed after the
entry was made; ``stale_why`` says how): that metric is left out of that run's comparison on that build, everything
else still compared bit for bit, until a session on the build makes the run again (make_golden with its name).
"""

from __future__ import annotations

import json

import pytest

from tests.golden.make_golden import RUNS, build, build_entry, compared, fresh_cache, load_goldens, run_one

GOLDENS = load_goldens()


@pytest.fixture(scope="module")
def warm_start_cache():
    """One empty RLVR_CACHE for these runs: the warm start is trained here once (its code is covered too)."""
    import os

    before = os.environ.get("RLVR_CACHE")
    folder = fresh_cache()
    yield folder.name
    folder.cleanup()
    if before is None:
        os.environ.pop("RLVR_CACHE", None)
    else:
        os.environ["RLVR_CACHE"] = before


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_run_equals_its_golden(name, warm_start_cache, tmp_path):
    here = build()
    entry = build_entry(GOLDENS, here)
    if name not in entry["runs"]:
        pytest.skip(f"no golden for this build ({here}); golden.json has {[g['build'] for g in GOLDENS]}: "
                    "add one (module docstring)")
    found = json.loads(json.dumps(run_one(name, tmp_path)))  # as golden.json holds it: floats exactly
    found, want = compared(entry, name, found), compared(entry, name, entry["runs"][name])  # less its stale metrics
    for key in want:
        if isinstance(want[key], list) and found[key] != want[key]:  # the first differing row, for the message
            first = next(i for i, (a, b) in enumerate(zip(found[key], want[key], strict=False)) if a != b) \
                if len(found[key]) == len(want[key]) else None
            row = None if first is None else want[key][first]
            diff = {k: (found[key][first].get(k), v) for k, v in row.items() if isinstance(v, int | float | str | None)
                    and found[key][first].get(k) != v} if isinstance(row, dict) else {}  # a lab's rows are lists
            pytest.fail(f"{name}: {key} differ (row {first}; found, golden: {diff})")
    assert found == want


def test_a_golden_holds_only_for_the_cpu_it_was_made_on():
    """Two CPUs with the same vector instructions can round otherwise (an AMD EPYC and a Xeon, both AVX512): an entry
    is used on its own CPU, or, for the first entries that name only a vendor, on that vendor's CPUs."""
    libs = {"torch": "t", "cpu_capability": "AVX512"}
    intel, amd = {**libs, "cpu": "GenuineIntel"}, {**libs, "cpu": "AuthenticAMD family 26 model 2"}
    goldens = [{"build": intel, "runs": {"a": 1}}, {"build": amd, "runs": {"b": 2}}]
    assert build_entry(goldens, {**libs, "cpu": "GenuineIntel family 6 model 143"})["runs"] == {"a": 1}
    assert build_entry(goldens, {**libs, "cpu": "AuthenticAMD family 26 model 2"})["runs"] == {"b": 2}
    assert build_entry(goldens, {**libs, "cpu": "AuthenticAMD family 25 model 17"})["runs"] == {}
    assert build_entry(goldens, {**libs, "cpu_capability": "AVX2", "cpu": "GenuineIntel family 6"})["runs"] == {}
    assert build_entry(goldens, {**libs, "cpu": "GenuineIntelX family 6 model 1"})["runs"] == {}


def test_a_stale_metric_is_left_out_of_its_own_run_only():
    entry = {"runs": {}, "stale": {"a": ["pg_loss"]}, "stale_why": "its definition changed"}
    run = {"metrics": [{"step": 1, "pg_loss": 0.5, "loss": 1.0}], "final_weights": "d"}
    assert compared(entry, "a", run) == {"metrics": [{"step": 1, "loss": 1.0}], "final_weights": "d"}
    assert compared(entry, "b", run) == run and compared({"runs": {}}, "a", run) == run
    for golden in GOLDENS:  # every mark names a run of RUNS and says why
        assert set(golden.get("stale", {})) <= set(RUNS) and bool(golden.get("stale")) == bool(golden.get("stale_why"))
