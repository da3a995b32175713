"""One registry of the settings checks that belong to the components, so that the config (a leaf) can run them
without importing anything above it.

    @register_check("sampler")                     # in the component's own module: registered when it is imported
    def check_sampler(run: DictConfig) -> None:    # raise ConfigError with one line naming the key and the fix
        ...

    run_checks(run)                                # harness.run.config.validate, after the schema's own checks
    run_checks(run, when="machine")                # harness.run.config.check_this_machine: when runs start here

:data:`EXPECTED` names every check and the module that registers it. ``python -m harness`` and every app import the
components (``harness/apps/__init__.py``); a script that validates a config through harness.run.config alone (docs/
lora.md's) has its checks' modules imported by those names when it first validates one. A check that its module does
not register is a programming error, raised as such, never skipped.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from omegaconf import DictConfig

Check = Callable[[DictConfig], None]

# when -> check name -> the module that registers it, in the order the checks run
EXPECTED: dict[str, dict[str, str]] = {
    "config": {"task": "harness.tasks", "model": "harness.policy.models", "warm_start": "harness.policy.warm_start",
               "lora": "harness.policy.lora",
               "device": "harness.policy.device", "sampler": "harness.policy.sampler",
               "cpu_matmul": "harness.policy.matmul",
               "routing_replay": "harness.policy.routing", "rollout_lag": "harness.loop.pipeline",
               "tracking": "harness.run.tracking", "backend": "harness.loop.backends"},
    "machine": {"hub_model": "harness.policy.models", "cache": "harness.policy.models"},
}
_CHECKS: dict[str, dict[str, Check]] = {when: {} for when in EXPECTED}


def register_check(name: str, when: str = "config") -> Callable[[Check], Check]:
    """Decorator: ``check(run)`` runs at every validation (``when="config"``: wherever a config is expanded) or when
    runs are about to start on this machine (``"machine"``: e.g. whether a hub model can be reached)."""
    if when not in EXPECTED or name not in EXPECTED[when]:
        raise ValueError(f"unknown config check {name!r} ({when}): add it to harness.run.checks.EXPECTED")

    def decorator(check: Check) -> Check:
        _CHECKS[when][name] = check
        return check

    return decorator


def run_checks(run: DictConfig, when: str = "config") -> None:
    """Run every check of ``when`` on ``run`` in :data:`EXPECTED`'s order, importing the module of one not yet
    registered; raise RuntimeError if that module does not register it."""
    for module in dict.fromkeys(m for name, m in EXPECTED[when].items() if name not in _CHECKS[when]):
        importlib.import_module(module)
    missing = [f"{name} ({module})" for name, module in EXPECTED[when].items() if name not in _CHECKS[when]]
    if missing:
        raise RuntimeError(f"config checks not registered: {', '.join(missing)}; each module named must register its "
                           "check with @register_check")
    for name in EXPECTED[when]:
        _CHECKS[when][name](run)
