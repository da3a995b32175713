"""What a run's settings say about its behaviour (old) log-probs, read from the config alone: the rollout correction
and its trust-region rules, routing replay, a policy lag, and from these where the behaviour log-probs come from.
The loop's behaviour stage (harness/loop/behaviour.py), the TRL backend and the config's checks of what a setting
changes (harness/run/config.py ``unused_settings``) read them here, so the rule lives once.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from objectives.rollout_correction import DEFAULT_THRESHOLD


def correction_settings(t: DictConfig) -> tuple[str, float, float | None]:
    """``train.rollout_correction``'s (mode, threshold, threshold_lower); mode 'none' when the config has none."""
    rc = OmegaConf.select(t, "rollout_correction", default=None)
    if rc is None:
        return "none", DEFAULT_THRESHOLD, None
    return rc.mode, rc.threshold, rc.threshold_lower


def rejection_settings(t: DictConfig) -> tuple[list[str], list[float]]:
    """``train.rollout_correction``'s trust-region rules and their bounds (empty when the config has none)."""
    rc = OmegaConf.select(t, "rollout_correction", default=None)
    rules = OmegaConf.select(rc, "rejection", default=None) if rc is not None else None
    if not rules:
        return [], []
    return list(rules), [float(b) for b in rc.rejection_threshold]


def correction_on(t: DictConfig) -> bool:
    """Whether the loop weights the loss by a rollout correction: a mode other than none, or trust-region rules."""
    return correction_settings(t)[0] != "none" or bool(rejection_settings(t)[0])


def behaviour_logp(t: DictConfig) -> str:
    """Where the behaviour (old) log-probs come from: 'recompute' (the trainer's, before the update) whenever a
    rollout correction is on — it weights by the trainer's old policy over the sampler, verl's decoupled mode and
    TRL's ``vllm_importance_sampling_correction`` recompute them too — or routing replay is (R2 records the routing
    in that forward, R3 replays the sampler's there, as verl and slime do), else ``train.old_logp``."""
    return "recompute" if recompute_forced(t) else t.old_logp


def recompute_forced(t: DictConfig) -> bool:
    """Whether the settings recompute the behaviour log-probs whatever ``train.old_logp`` says (a rollout correction,
    trust-region rules or routing replay: :func:`behaviour_logp`); ``train.old_logp`` then changes nothing."""
    return correction_on(t) or replay_mode(t) != "none"


def replay_mode(t: DictConfig) -> str:
    """``train.routing_replay`` ('none' when the config has none)."""
    return OmegaConf.select(t, "routing_replay", default="none")


def lagged(t: DictConfig) -> bool:
    """Whether ``train.rollout_lag`` > 0 (0 when the config has none): the batch may be older than the policy."""
    return OmegaConf.select(t, "rollout_lag", default=0) > 0
