"""harness/run/checks.py: every component's config check is registered by the entry points, in one registry; a check
nobody registered is a loud programming error, never a silent skip."""

from __future__ import annotations

from pathlib import Path

import pytest


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
