"""TRL ``GRPOConfig`` names on the command line: ``num_generations=8`` is rewritten to ``train.group_size=8`` with a
one-line note on stderr, or refused with a one-line error naming our key where the two do not mean exactly the same
(:data:`ALIASES`; ``load_experiment`` calls :func:`translate_overrides` before parsing). ``python -m harness explain``
(harness/run/names.py) lists them with our keys' meanings.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import yaml
from omegaconf import DictConfig, OmegaConf

from harness.run.errors import ConfigError
from objectives import OBJECTIVES


class AliasError(ValueError):
    pass


@dataclass(frozen=True)
class Alias:
    trl: str  # TRL GRPOConfig field
    key: str  # ours
    rule: str  # one line: how the value maps, or why it is refused
    convert: Callable[[str, list[str], set[str]], list[str]] | None = None  # (value, objectives, keys given) -> ours
    refused: bool = False  # no exact equivalent: an error naming `key`
    sets_objective: bool = False  # may set objective.name (translated before the aliases that depend on it)


def _hyperparameters(objective: str) -> dict:
    return OBJECTIVES.get(objective).hyperparameters() if objective in OBJECTIVES else {}


def _needs(param: str, trl: str, objectives: list[str]) -> None:
    lacking = [o for o in objectives if param not in _hyperparameters(o)]
    if lacking:
        raise AliasError(f"{trl} maps to objective.params.{param}, which objective {', '.join(lacking)} does not "
                         f"have (see python -m harness list)")


def _epsilon(value: str, objectives: list[str], given: set[str]) -> list[str]:
    if "cispo" in objectives:
        raise AliasError("epsilon: TRL's cispo has no lower bound (epsilon is unused there); set "
                         "objective.params.clip_low (cispo's 1.0 = no lower bound) and epsilon_high")
    _needs("clip_low", "epsilon", objectives)
    high = [] if "epsilon_high" in given else [f"objective.params.clip_high={value}"]  # TRL: epsilon_high = epsilon
    return [f"objective.params.clip_low={value}", *high]


def _epsilon_high(value: str, objectives: list[str], given: set[str]) -> list[str]:
    if "cispo" in objectives:
        if set(objectives) != {"cispo"}:
            raise AliasError("epsilon_high means 1 + clip_high for TRL's cispo and clip_high for the others: set "
                             "objective.params.clip_high per objective (sweep.per_objective)")
        return [f"objective.params.clip_high={float(value) - 1:g}"]
    _needs("clip_high", "epsilon_high", objectives)
    return [f"objective.params.clip_high={value}"]


LOSS_TYPES = {"grpo": "objective.params.aggregation=seq_mean_token_mean",
              "dapo": "objective.params.aggregation=token_mean",
              "dr_grpo": "objective.params.aggregation=seq_mean_token_sum_norm",
              "cispo": "objective.name=cispo", "sapo": "objective.name=sapo", "vespo": "objective.name=vespo"}


def _loss_type(value: str, objectives: list[str], given: set[str]) -> list[str]:
    if value == "bnpo":
        raise AliasError("loss_type=bnpo normalises by the local micro-batch's tokens, which has no equivalent here; "
                         "the nearest is objective.name=bnpo (GRPO with aggregation=token_mean: equal with "
                         "train.micro_batch_size=0 on one GPU)")
    if value == "luspo":
        raise AliasError("loss_type=luspo is a sequence-level loss only with importance_sampling_level=sequence: that "
                         "is objective.name=luspo (GSPO with aggregation=seq_mean_token_sum)")
    if value not in LOSS_TYPES:
        raise AliasError(f"loss_type={value} has no objective here; set objective.name (python -m harness list)")
    return [LOSS_TYPES[value]]


def _scale_rewards(value: str, objectives: list[str], given: set[str]) -> list[str]:
    estimator = {"group": "grpo", "true": "grpo", "batch": "batch_std", "none": "mean_only",
                 "false": "mean_only"}.get(value.lower())
    if estimator is None:
        raise AliasError(f"scale_rewards={value}: TRL takes group, batch or none; ours: objective.advantage")
    return [f"objective.advantage={estimator}"]


def _own_param(param: str, trl: str) -> Callable[[str, list[str], set[str]], list[str]]:
    """TRL's ``trl`` is objective.params.``param`` of the objectives that have it (sapo's, vespo's)."""
    def convert(value: str, objectives: list[str], given: set[str]) -> list[str]:
        _needs(param, trl, objectives)
        return [f"objective.params.{param}={value}"]

    return convert


def _off_policy_mask(value: str, objectives: list[str], given: set[str]) -> list[str]:
    if yaml.safe_load(value) is None:  # TRL's default None: no masking
        return ["objective.params.off_policy_mask=false"]
    return ["objective.params.off_policy_mask=true", f"objective.params.off_policy_mask_threshold={value}"]


def _report_to(value: str, objectives: list[str], given: set[str]) -> list[str]:
    parsed = yaml.safe_load(value)
    names = [parsed] if isinstance(parsed, str) else list(parsed or [])
    if "all" in names:
        raise AliasError("report_to=all: name the trackers, logging.backends=[jsonl,tensorboard,wandb,trackio]")
    return [f"logging.backends=[{','.join(['jsonl', *(n for n in names if n not in ('none', 'jsonl'))])}]"]


def _flag(true: str, false: str) -> Callable[[str, list[str], set[str]], list[str]]:
    def convert(value: str, objectives: list[str], given: set[str]) -> list[str]:
        flag = yaml.safe_load(value)
        if not isinstance(flag, bool):
            raise AliasError(f"expected true or false, got {value!r}")
        return [true if flag else false]

    return convert


def _importance_sampling_level(value: str, objectives: list[str], given: set[str]) -> list[str]:
    if value != "sequence":
        raise AliasError(f"importance_sampling_level={value}: token-level ratios are every per-token objective's "
                         "(grpo, dapo, ...); choose objective.name")
    return ["objective.name=gspo"]


def _rename(key: str) -> Callable[[str, list[str], set[str]], list[str]]:
    return lambda value, objectives, given: [f"{key}={value}"]


ALIASES: dict[str, Alias] = {a.trl: a for a in (
    Alias("num_generations", "train.group_size", "same"),
    Alias("max_completion_length", "train.max_new_tokens", "same"),
    Alias("temperature", "train.temperature", "same"),
    Alias("top_p", "train.top_p", "same"),
    Alias("num_iterations", "train.epochs", "same"),
    Alias("per_device_train_batch_size", "train.micro_batch_size", "same (per GPU)"),
    Alias("learning_rate", "train.lr", "same"),
    Alias("warmup_steps", "train.warmup_steps", "same (optimizer steps)"),
    Alias("weight_decay", "train.weight_decay", "same"),
    Alias("max_grad_norm", "train.max_grad_norm", "same"),
    Alias("beta", "objective.params.beta", "same coefficient; the k3 KL to the reference, not times the ratio (TRL's "
          "use_bias_correction_kl=false; its default true multiplies it by the ratio)"),
    Alias("epsilon", "objective.params.clip_low", "clip_low and clip_high (TRL's epsilon_high defaults to epsilon; "
          "an epsilon_high given as well wins); refused for cispo and objectives without clip_low", _epsilon),
    Alias("epsilon_high", "objective.params.clip_high", "same; cispo: clip_high = epsilon_high - 1 (TRL's cispo caps "
          "the ratio at epsilon_high)", _epsilon_high),
    Alias("loss_type", "objective.params.aggregation", "grpo / dapo / dr_grpo: the aggregation (seq_mean_token_mean"
          " / token_mean / seq_mean_token_sum_norm: TRL's loss_type only aggregates its clipped loss; "
          "objective.name=dapo would also raise clip_high to 0.28); cispo, sapo, vespo: objective.name; bnpo, luspo "
          "(objective.name=bnpo / luspo, exact only on one micro-batch / at sequence level) and others refused",
          _loss_type, sets_objective=True),
    Alias("importance_sampling_level", "objective.name", "sequence: objective.name=gspo; token refused (choose "
          "objective.name)", _importance_sampling_level, sets_objective=True),
    Alias("scale_rewards", "objective.advantage", "group: grpo, batch: batch_std, none: mean_only (grpo adds 1e-6 "
          "to the std as verl, TRL 1e-4; batch_std 1e-4 as TRL)", _scale_rewards),
    Alias("entropy_coef", "objective.params.entropy_coef", "same (a static coefficient; TRL's "
          "use_adaptive_entropy has no equivalent)"),
    Alias("top_entropy_quantile", "objective.params.top_entropy_quantile", "same"),
    Alias("off_policy_mask_threshold", "objective.params.off_policy_mask_threshold", "a number: "
          "objective.params.off_policy_mask=true with this threshold; null: off_policy_mask=false", _off_policy_mask),
    *(Alias(trl, f"objective.params.{param}", f"same ({objective})", _own_param(param, trl))
      for trl, param, objective in (
        ("sapo_temperature_pos", "tau_pos", "sapo"), ("sapo_temperature_neg", "tau_neg", "sapo"),
        ("vespo_k_pos", "k_pos", "vespo"), ("vespo_lambda_pos", "lambda_pos", "vespo"),
        ("vespo_k_neg", "k_neg", "vespo"), ("vespo_lambda_neg", "lambda_neg", "vespo"))),
    Alias("report_to", "logging.backends", "[jsonl, the named trackers]; none: [jsonl]", _report_to),
    Alias("bf16", "model.dtype", "true: bfloat16, false: float32", _flag("model.dtype=bfloat16",
                                                                          "model.dtype=float32")),
    Alias("fp16", "model.dtype", "true: float16, false: float32", _flag("model.dtype=float16", "model.dtype=float32")),
    Alias("use_cpu", "device", "true: cpu, false: auto", _flag("device=cpu", "device=auto")),
    Alias("max_steps", "train.steps", "TRL counts optimizer steps, = train.steps x train.num_minibatches x "
          "train.epochs", refused=True),
    Alias("gradient_accumulation_steps", "train.micro_batch_size", "derived, = minibatch / "
          "(train.micro_batch_size x GPUs)", refused=True),
    Alias("steps_per_generation", "train.num_minibatches", "= train.num_minibatches x "
          "gradient_accumulation_steps", refused=True),
    Alias("generation_batch_size", "train.prompts_per_step", "counts sequences, = train.prompts_per_step x "
          "train.group_size", refused=True),
    Alias("save_steps", "train.save_every", "TRL counts optimizer steps, ours rollout steps", refused=True),
    Alias("eval_steps", "train.eval_every", "TRL counts optimizer steps, ours rollout steps", refused=True),
    Alias("output_dir", "results_dir", "a run goes to <results_dir>/<name>/<run_id> (or --run-dir)",
          refused=True),
)}


def _objectives(overrides: list[str], layer: DictConfig) -> list[str]:
    """The objective(s) the runs will use: the command line's objective.name or its grid, else the experiment's."""
    keys = {o.partition("=")[0]: o.partition("=")[2] for o in overrides}
    if "objective.name" in keys:
        return [keys["objective.name"]]
    if "sweep.grid.objective.name" in keys:
        try:
            return [str(v) for v in yaml.safe_load(keys["sweep.grid.objective.name"]) or []]
        except yaml.YAMLError:
            return []  # not YAML: load_experiment names the override in one line
    grid = OmegaConf.select(layer, "sweep.grid", default=None) if isinstance(layer, DictConfig) else None
    if grid is not None and "objective.name" in grid:
        return [str(v) for v in grid["objective.name"]]
    return [str(OmegaConf.select(layer, "objective.name", default=None) or "grpo")] \
        if isinstance(layer, DictConfig) else ["grpo"]


def translate_overrides(overrides: list[str], layer: DictConfig | None = None) -> list[str]:
    """``overrides`` with TRL-named ones (``num_generations=8``) rewritten to ours, each with a note on stderr;
    a TRL name without an exact equivalent raises ConfigError naming our key. ``layer``: the experiment file's
    settings (its objective decides what ``epsilon`` and the like map to)."""
    out: list[str | list[str]] = list(overrides)
    given = {o.partition("=")[0] for o in overrides}
    for objective_pass in (True, False):  # first what sets objective.name, then what depends on it
        objectives = None if objective_pass else _objectives([o for x in out for o in
                                                              (x if isinstance(x, list) else [x])], layer)
        for i, override in enumerate(out):
            if isinstance(override, list):
                continue
            key, eq, value = override.partition("=")
            alias = ALIASES.get(key)
            if not eq or alias is None or alias.sets_objective != objective_pass:
                continue
            if alias.refused:
                raise ConfigError(f"{key} (TRL) has no exact equivalent here: set {alias.key} ({alias.rule})")
            try:
                new = (alias.convert or _rename(alias.key))(value, objectives or [], given)
            except (AliasError, ValueError, yaml.YAMLError) as e:
                raise ConfigError(f"{key}={value} (TRL): {e}") from None
            print(f"note: {key}={value} (TRL) -> {' '.join(new)}", file=sys.stderr)
            out[i] = new
    return [o for x in out for o in (x if isinstance(x, list) else [x])]
