"""harness/run/checks.py: every component's config check is registered by the entry points, in one registry (or by
its module imported when a config is first validated); a check nobody registered is a loud programming error, never a
silent skip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_every_expected_config_check_is_registered_by_the_apps():
    import harness.apps  # noqa: F401
    from harness.run import checks

    for when, expected in checks.EXPECTED.items():
        assert set(checks._CHECKS[when]) == set(expected), when


def test_a_check_nobody_registered_is_a_loud_programming_error(monkeypatch):
    from harness.run import checks
    from tests.helpers.tiny import tiny_run

    run = tiny_run(Path("/nonexistent"))
    monkeypatch.setitem(checks._CHECKS, "config", {k: v for k, v in checks._CHECKS["config"].items() if k != "sampler"})
    with pytest.raises(RuntimeError, match=r"not registered: sampler \(harness.policy.sampler\)"):
        checks.run_checks(run)
    with pytest.raises(ValueError, match="unknown config check"):
        checks.register_check("nobody_expects_it")


@pytest.mark.slow  # a fresh interpreter importing torch (seconds)
def test_a_script_that_imports_only_the_config_validates_with_every_check():
    """docs/lora.md's script imports harness.loop.build and harness.run.config, not harness.apps: its first validation
    imports the checks' modules (it stopped with 'config checks not registered: rollout_lag, backend'), and runs them:
    a bad setting is refused by its component's check."""
    script = ("from harness.loop.build import build_task\n"
              "from harness.run.checks import EXPECTED, _CHECKS\n"
              "from harness.run.config import load_experiment, run_configs\n"
              "from harness.run.errors import ConfigError\n"
              "assert run_configs(load_experiment('quickstart'))\n"
              "assert all(set(_CHECKS[w]) == set(EXPECTED[w]) for w in ('config',))\n"
              "try:\n    run_configs(load_experiment('quickstart', ['train.rollout_lag=-1']))\n"
              "except ConfigError as e:\n    print('refused:', e)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused:") and "rollout_lag" in done.stdout, done.stdout
