"""The Makefile's settings: each target declares the NAME=value settings its recipe reads (``settings.TARGET``), and a
name given on the command line that no target of the command reads is one line before anything runs."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.processes import MAKE_ALONE

ROOT = Path(__file__).resolve().parent.parent
MAKEFILE = (ROOT / "Makefile").read_text()
EVERY_TARGET = {"PY", "GSM8K_DIR"}  # read by every target's command (the interpreter; the local GSM8K, exported)

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")



def make(*args, env=MAKE_ALONE) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env)


def recipes() -> dict[str, str]:
    """Each target's recipe lines (the tab-indented lines after ``target:  ## help``)."""
    blocks = re.findall(r"^([a-z-]+):  ## .*\n((?:\t.*\n)*)", MAKEFILE, re.M)
    return {target: recipe for target, recipe in blocks}


def names_read(text: str) -> set[str]:
    """The upper-case variables a piece of the Makefile reads, through the variables it derives (SWEEP_JOBS)."""
    derived = dict(re.findall(r"^([A-Z_]+)\s*=\s*(.*)$", MAKEFILE, re.M))
    found = set(re.findall(r"\$\((?:origin )?([A-Z][A-Z0-9_]*)\)", text))
    for name in found & derived.keys():
        found = (found - {name}) | names_read(derived[name])
    return {name for name in found if not name.startswith("MAKE")}


def test_each_target_declares_exactly_the_settings_its_recipe_reads():
    declared = {target: set(names.split()) for target, names in
                re.findall(r"^settings\.([a-z-]+) := (.*)$", MAKEFILE, re.M)}
    for target, recipe in recipes().items():
        assert names_read(recipe) - EVERY_TARGET == declared.get(target, set()), target


def test_a_setting_no_target_of_the_command_reads_is_one_line_before_anything_runs():
    done = make("claims", "CLAIM=gspo_clips_more")  # CLAIMS= misspelt: make alone would run every claim (hours)
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done
    assert "CLAIM is not read by this target" in done.stderr and "CLAIMS EXISTING JOBS WITH_LONG" in done.stderr
    done = make("setup", "test", "exp=quickstart", "SEED=1")
    assert done.returncode == 2 and "SEED exp are not read by these targets" in done.stderr
    assert "TESTED TORCH TORCH_INDEX PY GSM8K_DIR" in done.stderr
    for given in (["sweep", "EXP=quickstart", "JOBS=1"], ["setup", "test", "TORCH=torch"], ["test", "PY=python3"]):
        assert make(*given).returncode == 0, given
    for given in (["bogus", "X=1"], ["list", "bogus"]):  # `make list bogus` ran list, then said "No rule"
        done = make(*given)
        assert done.returncode == 2 and done.stdout == "" and "no target bogus here" in done.stderr, done
    assert make("list", "CI=true", env={**MAKE_ALONE, "MAKELEVEL": "1"}).returncode == 0  # a make that runs this one


@pytest.mark.parametrize("target, given, named", [
    ("sweep", "OVERRIDES=train.lr=${oc.env:LR}", "OVERRIDES holds a $"), ("sweep", "EXP=", "EXP= is empty"),
    ("sweep", "EXP=,", "EXP= is empty"), ("sweep", "JOBS=", "JOBS= is empty"),
    ("claims", "CLAIMS=", "CLAIMS= is empty"),  # ran every claim (hours)
    ("zoo", "STAGE=", "STAGE= is empty"), ("zoo", "START_POLICIES=", "START_POLICIES= is empty"),  # the defaults
    ("plots", "OUT=", "OUT= is empty"),  # the default folder, where `--out ""` is refused
    ("plots", "EXP=quickstart epochs", "EXP='quickstart epochs' holds a space"),  # a report over both, unasked
    ("sweep", "JOBS=2 3", "JOBS='2 3' holds a space"),
])
def test_a_dollar_or_an_empty_value_is_one_line_before_anything_runs(target, given, named):
    """make expanded '${oc.env:LR}' to nothing and ran train.lr= ; JOBS= reached argparse as '--jobs' alone; an
    empty CLAIMS, STAGE or OUT ran the default (every claim, both stages), unlike its command's own option; EXP="a b"
    made make plots read two experiments (make splits a value at its spaces)."""
    done = make(target, given)
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done
    assert named in done.stderr
    assert make("train", "OVERRIDES=name=my$$run").stdout.split()[-1] == "name=my$run"  # $$: a $ for the shell
    assert make("plots", "OUT=/tmp/my report").stdout.split('--out ')[-1].strip() == '"/tmp/my report"'  # quoted


@pytest.mark.parametrize("off", ["0", "false", "no", "off", ""])
def test_a_switch_given_as_0_or_false_is_off(off):
    """WITH_LONG=0 ran the hours of SmolLM2 claims: any value but an empty one turned a switch on."""
    done = make("claims", f"WITH_LONG={off}", f"EXISTING={off}")
    assert done.returncode == 0 and "--with-long" not in done.stdout and "--existing" not in done.stdout
    done = make("docs", f"WITH_ZOO={off}", f"SKIP_MAIN={off}", f"WITH_SMOLLM2={off}")
    assert "--with-zoo" not in done.stdout and "--skip-main" not in done.stdout and "--with-smollm2" not in done.stdout
    assert "--with-long" in make("claims", "WITH_LONG=1").stdout
    assert "--with-zoo screen" in make("docs", "WITH_ZOO=screen").stdout


def test_make_claims_runs_the_named_claims_or_none():
    done = make("claims", "CLAIMS=gspo_clips_more,p3o_matches_tuned_baseline", "EXISTING=1")
    assert done.stdout.split()[1:] == ["-m", "harness", "claims", "gspo_clips_more", "p3o_matches_tuned_baseline",
                                       "--jobs", "2", "--existing"], done.stdout
