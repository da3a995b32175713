"""Adaptive KL coefficient — the coefficient beta of the KL to the reference policy moves towards a target KL after
every rollout step (Schulman et al., "Proximal Policy Optimization Algorithms", arXiv 1707.06347, Sec. 4, the
adaptive KL penalty; the proportional controller of Ziegler et al., arXiv 1909.08593).
Reference: verl ``verl/trainer/ppo/core_algos.py`` ``AdaptiveKLController`` / ``get_kl_controller`` and
``verl/trainer/config/algorithm.py`` ``KLControlConfig`` (verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9),
the update rule and defaults followed.

State: the coefficient beta_k (starts at ``beta``). The loss is GRPO's (objectives/grpo.py: PPO clip 0.2 / 0.2,
seq_mean_token_mean, its options) plus beta_k times the KL to the reference (the shared term: ``kl_estimator``, k3 by
default, aggregated like the policy loss). After rollout step k, with KL_k the step's measured KL and n_k its
sequences:

    e_k        = clip(KL_k / kl_target - 1, -0.2, 0.2)
    beta_{k+1} = beta_k (1 + e_k n_k / kl_horizon)

(verl's ``update(current_kl, n_steps)``, called once per training step with n_steps = the batch's sequences). The
update is the objective's ``after_update`` hook; its state is saved in every checkpoint, so a resumed run continues
identically (tested). Defaults are ``KLControlConfig``'s: ``kl_coef`` 0.001 (here ``beta``), ``target_kl`` 0.1,
``horizon`` 10000. ``beta = 0`` keeps the coefficient at 0 (the product stays 0; no KL term, no reference model).

Our reading, where verl's setting differs: verl adapts the coefficient of the KL *in the reward*
(``use_kl_in_reward``: token rewards minus beta times the ``kl_penalty`` estimate, default k1, measured between the
old policy and the reference before the update, averaged per sequence then over the batch); its KL *loss*
(``use_kl_loss``) has a fixed coefficient. Here the controller drives the KL term of the loss (the harness's only KL
to the reference), measured as what that term penalised: the step's ``kl_ref`` metric (the estimator's mean over the
valid tokens of all the step's updates, current policy). PPO's own Sec. 4 rule (beta halved below kl_target / 1.5,
doubled above kl_target x 1.5, on KL to the old policy) is not implemented.
Metrics: ``adaptive_kl_coef`` (beta_k in this step's loss), ``kl_ref``.
"""

from __future__ import annotations

from typing import ClassVar

from objectives.base import PolicyBatch, register_objective
from objectives.grpo import GRPO

PROPORTIONAL_ERROR_CLIP = 0.2  # verl's / Ziegler et al.'s clip of KL / target - 1


def adaptive_kl_step(coef: float, current_kl: float, n_steps: int, target: float, horizon: int) -> float:
    """verl's ``AdaptiveKLController.update``: the coefficient after a step with KL ``current_kl`` over ``n_steps``."""
    error = min(max(current_kl / target - 1.0, -PROPORTIONAL_ERROR_CLIP), PROPORTIONAL_ERROR_CLIP)
    return coef * (1.0 + error * n_steps / horizon)


@register_objective("adaptive_kl")
class AdaptiveKL(GRPO):
    beta: float = 0.001  # the initial coefficient of the KL to the reference (verl's kl_ctrl.kl_coef)
    kl_target: float = 0.1  # the KL the coefficient steers to (verl's kl_ctrl.target_kl)
    kl_horizon: int = 10000  # sequences over which a 20% error moves the coefficient by 20% (verl's kl_ctrl.horizon)

    stateful: ClassVar[bool] = True
    positive = frozenset({"kl_target"})

    def validate(self):
        super().validate()
        if self.kl_horizon <= 0:
            raise ValueError(f"objective 'adaptive_kl': hyperparameter kl_horizon must be > 0 (verl asserts it), got "
                             f"{self.kl_horizon}")

    def __post_init__(self):
        super().__post_init__()
        self.coefficient = self.beta  # beta_k: starts at beta, verl's kl_coef

    def reference_kl_coef(self) -> float:
        return self.coefficient

    def after_update(self, metrics: dict[str, float], sequences: int) -> None:
        if self.beta > 0:  # beta = 0: no KL term, nothing measured, the coefficient stays 0
            self.coefficient = adaptive_kl_step(self.coefficient, metrics["kl_ref"], sequences, self.kl_target,
                                                self.kl_horizon)

    def state_dict(self) -> dict:
        return {"coefficient": self.coefficient}

    def load_state_dict(self, state: dict) -> None:
        self.coefficient = float(state["coefficient"])

    def policy_loss(self, batch: PolicyBatch):
        loss, metrics = super().policy_loss(batch)
        return loss, {**metrics, "adaptive_kl_coef": self.coefficient}
