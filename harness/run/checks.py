"""One registry of the settings checks that belong to the components, so that the config (a leaf) can run them
without importing anything above it.

    @register_check("sampler")                     # in the component's own module: registered when it is imported
    def check_sampler(run: DictConfig) -> None:    # raise ConfigError with one line naming the key and the fix
        ...

    run_checks(run)                                # harness.run.config.validate, after the schema's own checks
    run_checks(run, when="machine")                # harness.run.config.check_this_machine: when runs start here
    run_checks(run, when="node")                   # and on the machine that executes them (its devices, memory)

:data:`EXPECTED` names every check and the module that registers it. A check that is not registered when a config is
validated is a programming error, raised as such (the process never imported the component), never skipped:
``python -m harness`` and every app import the components (``harness/apps/__init__.py``); tests do the same
(tests/conftest.py).
"""

from __future__ import annotations

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
    "machine": {"hub_model": "harness.policy.models", "local_model": "harness.policy.models",
                "task_data": "harness.tasks", "cache": "harness.policy.models"},
    # the hardware of the machine a run executes on: a sweep on a cluster leaves these to the run's node, where its
    # `train` checks them (the machine it is started from, a login node, may have no GPU, or other memory)
    "node": {"device_here": "harness.policy.device", "memory": "harness.policy.memory",
             "eval_memory": "harness.loop.evaluation"},
}
_CHECKS: dict[str, dict[str, Check]] = {when: {} for when in EXPECTED}


def register_check(name: str, when: str = "config") -> Callable[[Check], Check]:
    """Decorator: ``check(run)`` runs at every validation (``when="config"``: wherever a config is expanded) or when
    runs are about to start on this machine (``"machine"``: e.g. whether a hub model can be reached) or on the machine
    that executes them (``"node"``: its devices and their memory)."""
    if when not in EXPECTED or name not in EXPECTED[when]:
        raise ValueError(f"unknown config check {name!r} ({when}): add it to harness.run.checks.EXPECTED")

    def decorator(check: Check) -> Check:
        _CHECKS[when][name] = check
        return check

    return decorator


def run_checks(run: DictConfig, when: str = "config") -> None:
    """Run every registered check of ``when`` on ``run`` in :data:`EXPECTED`'s order; raise RuntimeError if one is not
    registered (its module was never imported)."""
    missing = [f"{name} ({module})" for name, module in EXPECTED[when].items() if name not in _CHECKS[when]]
    if missing:
        raise RuntimeError(f"config checks not registered: {', '.join(missing)}; import harness.apps (it imports "
                           "every component) before validating a config")
    for name in EXPECTED[when]:
        _CHECKS[when][name](run)
