"""Adaptive entropy coefficient — Skywork-OR1 (He et al., "Skywork Open Reasoner 1 Technical Report",
arXiv 2505.22312, adaptive entropy control): the entropy bonus's coefficient moves by a fixed step towards keeping the
policy's entropy at a target, and the bonus acts only while the entropy is at or below the target.
Reference: TRL ``use_adaptive_entropy`` (``trl/trainer/grpo_trainer.py`` ``_compute_loss`` and
``_save_checkpoint`` / ``_load_optimizer_and_scheduler``, ``trl/trainer/grpo_config.py``; the installed wheel, TRL
1.16.0), the implementation followed; its defaults.

State: the coefficient alpha (starts at ``entropy_coef``) and the last measured entropy H_prev (starts at +inf, so the
first optimizer step applies no bonus). In each optimizer step, with H the mean entropy of the current policy over
the tokens the bonus acts on (valid tokens; the kept ones with ``top_entropy_quantile``):

    loss  = L_policy - alpha_applied H,        alpha_applied = alpha if H_prev <= entropy_target else 0
    after the step (H over the step's whole minibatch, every micro-batch):
        alpha <- min(alpha + delta, alpha_max)  if H <= entropy_target
        alpha <- max(alpha - delta, alpha_min)  otherwise
        H_prev <- H

L_policy is GRPO's PPO-clip surrogate (objectives/grpo.py: clip 0.2 / 0.2, its options) with token_mean aggregation
(TRL's default ``loss_type`` dapo and Skywork-OR1's token-level loss); H is the shared entropy bonus
(objectives/base.py ``entropy_bonus``: TRL's token mean, the minibatch's count under micro-batching). The update is
the objective's ``after_optimizer_step`` hook with the step's metrics (``entropy_kept_mean``: each micro-batch's mean
over its kept tokens, token-weighted, = the minibatch's mean, TRL's window-global entropy), so the controller moves
once per optimizer step as TRL's, at ``sync_gradients``. Its state is saved in every checkpoint (TRL:
``entropy_ctrl_state.json``), so a resumed run continues identically (tested).
Differences from TRL: a non-finite update, which the loop skips, moves no coefficient (TRL updates in the loss, before
the step); with top-entropy masking (whole minibatches only) H is over the kept tokens of the minibatch, as TRL's
over its gathered window. Skywork-OR1's code (on verl) was not read here: its paper's rule is the one above, and TRL's
implementation and defaults are followed (one move per optimizer step: ``train.num_minibatches=1`` gives one per
rollout step).
Metrics: ``adaptive_entropy_coef`` (alpha in this step's loss, before gating), ``adaptive_entropy_applied``
(alpha_applied), ``entropy_bonus``, ``entropy_kept_mean``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from objectives.base import PolicyBatch, register_objective
from objectives.grpo import GRPO


def adaptive_entropy_step(coef: float, entropy: float, target: float, delta: float, low: float,
                          high: float) -> float:
    """TRL's update of the coefficient after an optimizer step whose entropy was ``entropy`` (module docstring)."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


@register_objective("adaptive_entropy")
class AdaptiveEntropy(GRPO):
    entropy_target: float = 0.2  # the target mean per-token entropy (nats); the bonus acts only at or below it (TRL's)
    entropy_coef_min: float = 0.0  # lower bound of the adaptive coefficient (TRL's entropy_coef_min)
    entropy_coef_max: float = 1.0  # upper bound of the adaptive coefficient (TRL's entropy_coef_max)
    entropy_coef_delta: float = 0.005  # the coefficient's step per optimizer step (TRL's entropy_coef_delta)

    default_aggregation = "token_mean"
    stateful: ClassVar[bool] = True

    def validate(self):
        super().validate()
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"objective 'adaptive_entropy': hyperparameter entropy_coef_min ({self.entropy_coef_min}) "
                             f"must be <= entropy_coef_max ({self.entropy_coef_max})")

    def __post_init__(self):
        super().__post_init__()
        self.coefficient = self.entropy_coef  # alpha: starts at entropy_coef, TRL's initial coefficient
        self.last_entropy = math.inf  # H_prev: no measurement yet, so the first step applies no bonus

    def entropy_bonus_coef(self) -> float:
        return self.coefficient if self.last_entropy <= self.entropy_target else 0.0

    def after_optimizer_step(self, policy: torch.nn.Module, metrics: dict[str, float]) -> None:
        entropy = metrics["entropy_kept_mean"]
        self.coefficient = adaptive_entropy_step(self.coefficient, entropy, self.entropy_target,
                                                 self.entropy_coef_delta, self.entropy_coef_min, self.entropy_coef_max)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"coefficient": self.coefficient, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coefficient, self.last_entropy = float(state["coefficient"]), float(state["last_entropy"])

    def policy_loss(self, batch: PolicyBatch):
        loss, metrics = super().policy_loss(batch)
        return loss, {**metrics, "adaptive_entropy_coef": self.coefficient,
                      "adaptive_entropy_applied": self.entropy_bonus_coef()}
