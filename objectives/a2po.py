"""A*-PO (A2PO) — a least-squares regression of the policy's implicit reward onto the optimal advantage.
Paper: Brantley, Chen, Gao, Lee, Sun, Zhan, Zhang, "Accelerating RL for LLM Reasoning with Optimal Advantage
Regression", arXiv 2505.20686 (Algorithm 1, stage 2). Reference: TRL 1.16.0 (the PyPI release)
``trl/experimental/a2po/a2po_trainer.py`` ``A2POTrainer.compute_loss`` and ``_get_sequence_logps``, defaults in
``a2po_config.py`` (beta2 1e-3).

    S_i  = sum_t mask_t (logp_t - ref_logp_t)              the sequence log-ratio log pi(y_i|x) / pi_ref(y_i|x)
    l_i  = (beta2 S_i - A_i)^2                              A_i = R_i - V*(x_i), the advantage estimator's
    loss = sequence_aggregate(l)                            the mean over the minibatch's sequences (TRL's .mean())
    grad = 2 beta2 (beta2 S_i - A_i) sum_t grad logp_t

Stage 1 (V*(x) = beta1 log mean_j exp(r(x, y_j) / beta1) over completions y_j of the reference policy) is the
advantage estimator ``a2po`` (objectives/advantages.py), this objective's default; any other estimator's A_i can be
the target instead. The reference policy is the starting policy (a frozen copy; with LoRA the base with the
adapters off), whose log-probs the loop computes for this objective whatever ``beta`` (``needs_reference``).
No importance ratio and no clip: the loss does not read the behaviour log-probs, so a rollout lag or a second epoch
regresses the same targets again (TRL trains each batch once, on-policy; A*-PO samples one completion per prompt,
``train.group_size=1``). A rollout correction weighs l_i by the token mean of its weights, as for every
sequence-level loss. TRL sums the log-probs of the completion tokens up to and including the first EOS, as the
harness's completion mask does; TRL's log-probs are of the raw logits (its sampling temperature defaults to 1), the
harness's under the run's ``train.temperature``, as for every objective. Metrics: ``implicit_reward`` (mean of
beta2 S_i, TRL's), ``a2po_target`` (mean of A_i, TRL's ``advantage``), ``a2po_residual`` (mean of
|beta2 S_i - A_i|), and the ratio metrics of r = exp(logp - old_logp) (how far the policy moved from the behaviour;
no ratio enters the loss).
"""

from __future__ import annotations

import torch

from objectives.base import (
    Objective,
    PolicyBatch,
    clip_metrics,
    masked,
    ratio_metrics,
    register_objective,
    sequence_advantages,
    sequence_aggregate,
)


@register_objective("a2po")
class A2PO(Objective):
    beta2: float = 1e-3  # KL temperature of the regression's implicit reward beta2 log(pi / pi_ref) (TRL's beta2, > 0)

    default_advantage = "a2po"
    default_aggregation = "seq_mean_token_mean"  # the mean over sequences (sequence_aggregate)
    aggregations = ("seq_mean_token_mean",)
    positive = frozenset({"beta2"})
    needs_sequence_advantages = True  # one target A_i per sequence
    needs_reference = True  # ref_logp whatever beta
    share_metrics = frozenset({"implicit_reward", "a2po_target", "a2po_residual"})
    ratio_level = "other"
    ratio_note = "none: a regression of beta2 log(pi / pi_ref) onto the advantage"

    def policy_loss(self, batch: PolicyBatch):
        if batch.ref_logp is None:
            raise ValueError("objective 'a2po' needs PolicyBatch.ref_logp (the reference policy's log-probs)")
        implicit = self.beta2 * masked(batch.logp - batch.ref_logp, batch.mask).sum(-1)
        residual = implicit - sequence_advantages(batch, self.name)
        loss = sequence_aggregate(residual.square(), batch)
        nothing = torch.zeros_like(batch.mask)
        moved = ratio_metrics(torch.exp(batch.log_ratio()), batch.mask)
        per_sequence = {"implicit_reward": implicit, "a2po_target": sequence_advantages(batch, self.name),
                        "a2po_residual": residual.abs()}  # means over the minibatch's sequences: shares of them
        shares = {key: (value.detach().sum() / batch.sequence_count).item() for key, value in per_sequence.items()}
        return loss, {**clip_metrics(nothing, nothing, batch), **moved, **shares}
