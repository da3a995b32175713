"""Policy-gradient objectives for RLVR, one file each, registered by name.

    from objectives import PolicyBatch, get_objective
    out = get_objective("gspo", clip_low=3e-4, clip_high=4e-4)(batch)   # out.loss, out.metrics

Every module in this package is imported here, so a new file with a ``@register_objective("name")``
class is all it takes to add an objective.
"""

from objectives.advantages import ADVANTAGES, available_advantages, get_advantage
from objectives.base import (
    OBJECTIVES,
    Objective,
    ObjectiveOutput,
    PolicyBatch,
    aggregate,
    available_objectives,
    estimator_name,
    get_objective,
    reads_reference_policy,
    register_objective,
)
from objectives.registry import UnknownNameError, import_every_module

import_every_module(__name__, __path__)

__all__ = [
    "ADVANTAGES",
    "OBJECTIVES",
    "Objective",
    "ObjectiveOutput",
    "PolicyBatch",
    "UnknownNameError",
    "aggregate",
    "available_advantages",
    "available_objectives",
    "estimator_name",
    "get_advantage",
    "get_objective",
    "reads_reference_policy",
    "register_objective",
]
