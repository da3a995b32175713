"""harness/run/checks.py: every component's config check is registered by the entry points, in one registry; a check
nobody registered is a loud programming error, never a silent skip."""

from __future__ import annotations

import re
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
def test_docs_lora_scripts_imports_validate_a_config_with_every_check():
    """docs/lora.md's script, its imports as written, in a fresh interpreter: a config validates (its imports
    stopped at 'config checks not registered: rollout_lag, backend' when they did not import harness.apps), and a
    bad setting is refused by its component's check."""
    block = re.search(r"```python\n(.*?)```", (REPO / "docs" / "lora.md").read_text(), flags=re.S).group(1)
    imports = "\n".join(line for line in block.splitlines() if line.startswith(("from ", "import ")))
    script = (f"{imports}\n"
              "from harness.run.errors import ConfigError\n"
              "assert run_configs(load_experiment('quickstart'))\n"
              "try:\n    run_configs(load_experiment('quickstart', ['train.rollout_lag=-1']))\n"
              "except ConfigError as e:\n    print('refused:', e)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused:") and "rollout_lag" in done.stdout, done.stdout
