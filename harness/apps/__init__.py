"""What a user runs: the command line's commands, sweeps, the gradient lab, claims, bench, docs, soak.

Every app validates configs, so importing this package imports every component that registers a config check
(harness/run/checks.py's EXPECTED): the native loop's table of backends brings the policy, the tasks and the run's
trackers with it; the others are named so that the list is complete whatever those modules import.
"""

from harness import tasks  # noqa: F401
from harness.loop import backends, evaluation  # noqa: F401
from harness.policy import device, lora, memory, models, routing, sampler, warm_start  # noqa: F401
from harness.run import tracking  # noqa: F401
