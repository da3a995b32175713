"""Every config key with its meaning and its TRL ``GRPOConfig`` / verl equivalents, in one table (:data:`NAMES`), and
the TRL names accepted on the command line (:data:`ALIASES`).

    python -m harness explain train.group_size     # meaning, default, TRL and verl names (a TRL or verl name works too)
    python -m harness explain                      # the whole table
    python -m harness explain --markdown --write   # rewrite the generated tables in docs/trl.md and README.md

TRL names are TRL 1.16's ``GRPOConfig`` fields (``trl/trainer/grpo_config.py``), verl names its ``ppo_trainer.yaml``
keys (and the DAPO recipe's ``reward_model.overlong_buffer``). ``—``: no equivalent. A TRL-named override
(``num_generations=8``) is rewritten to ours with a one-line note on stderr (:func:`translate_overrides`, called by
``load_experiment``), or refused with a one-line error naming our key where the two do not mean exactly the same.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

REPO = Path(__file__).resolve().parents[2]
DOCS = {REPO / "docs" / "trl.md": "names", REPO / "README.md": "aliases"}  # file -> the generated table it holds


@dataclass(frozen=True)
class Name:
    key: str  # ours, dotted
    meaning: str  # one line
    trl: str = "—"  # TRL GRPOConfig field(s), in backticks, with a short note where the match is not one to one
    verl: str = "—"  # verl ppo_trainer.yaml key(s)


A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
NAMES: tuple[Name, ...] = (
    Name("name", "experiment name: results/<name>/, the trackers' group", "—", "`trainer.experiment_name`"),
    Name("seed", "the run's seed (sampling, minibatch order, prompts)", "`seed`", "`data.seed` (data shuffling only)"),
    Name("device", "auto (cuda if available), cpu, cuda, cuda:N", "`use_cpu` (device=cpu)", "`trainer.device`"),
    Name("threads", "torch CPU threads; 0 = the cores free when the run starts (its resumes keep that count)"),
    Name("backend", "native (harness/loop/native.py) or trl (TRL's GRPOTrainer with our loss)"),
    Name("results_dir", "root of results/<name>/<run_id>/", "`output_dir` (ours is the root: a run goes to "
         "<results_dir>/<name>/<run_id>)", "`trainer.default_local_dir`"),
    Name("profile", "apply profiles[profile] of the experiment (e.g. gpu)"),
    Name("profiles", "named sets of overrides (an experiment's gpu scale, ...)"),
    Name("model.name", "tiny, smollm2-135m-instruct (embedded), a hub id or a local folder",
         "the trainer's `model` argument", "`actor_rollout_ref.model.path`"),
    Name("model.tiny", "the tiny char-level Llama's shape (hidden_size, num_layers, ...)"),
    Name("model.dtype", "trainer precision: float32, bfloat16, float16 (weights and compute)", "`bf16` / `fp16` "
         "(mixed precision)", f"— (FSDP mixed precision: `{A}fsdp_config.mixed_precision`)"),
    Name("model.sampler_dtype", "sample with a copy in this precision (train-inference mismatch); null = the policy",
         "— (vLLM: `vllm_*`)", f"`{R}dtype`"),
    Name("model.seed", "the tiny model's init and warm-start seed: the starting policy"),
    Name("model.warm_start_steps", "supervised steps on the task's solutions before RL (cached); with a target: cap"),
    Name("model.warm_start_target", "[low, high]: stop at the first held-out greedy accuracy in the band"),
    Name("model.warm_start_check_every", "warm-start steps between accuracy checks"),
    Name("model.warm_start_lr", "warm-start learning rate (AdamW, constant)"),
    Name("model.warm_start_batch_size", "warm-start problems per step"),
    Name("task.name", "arith, gsm8k, reasoning_gym (`make list`)", "the trainer's `train_dataset` + `reward_funcs`",
         "`data.train_files` + `custom_reward_function.path`"),
    Name("task.data_dir", "local GSM8K folder (train.jsonl, test.jsonl); else $GSM8K_DIR, else the hub", "—",
         "`data.train_files`, `data.val_files`"),
    Name("task.eval_size", "held-out problems of each evaluation (greedy)", "—", "`data.val_max_samples`"),
    Name("task.format_weight", "reward = correct + format_weight x format", "`reward_weights` = [1, format_weight]"),
    Name("task.overlong_buffer", "DAPO's soft overlong penalty over the last N tokens; 0 = off", "—",
         "`reward_model.overlong_buffer.len` (DAPO recipe)"),
    Name("task.overlong_penalty", "the penalty reached at max_new_tokens", "—",
         "`reward_model.overlong_buffer.penalty_factor`"),
    Name("task.args", "the task's own arguments (arith: digits, operators; reasoning_gym: dataset, params)"),
    Name("objective.name", "the loss (`make list`)", "`loss_type` (cispo, sapo) / `importance_sampling_level="
         "sequence` (gspo)", f"`{A}policy_loss.loss_mode`"),
    Name("objective.params", "the objective's hyperparameters (below; all of them: `make list`)"),
    Name("objective.params.clip_low", "ε_low of the ratio clip (its meaning per objective: docs/objectives.md)",
         "`epsilon`", f"`{A}clip_ratio_low`"),
    Name("objective.params.clip_high", "ε_high of the ratio clip", "`epsilon_high` (cispo: `epsilon_high` = 1 + "
         "clip_high)", f"`{A}clip_ratio_high`"),
    Name("objective.params.beta", "weight of the k3 KL to the reference policy; 0 = no reference", "`beta` (backend "
         "trl: a frozen copy of the starting policy as `ref_model`)",
         f"`{A}kl_loss_coef` (`use_kl_loss=true`, `kl_loss_type=low_var_kl`)"),
    Name("objective.params.aggregation", "token_mean, seq_mean_token_mean or seq_mean_token_sum_norm",
         "`loss_type` dapo / grpo / dr_grpo", f"`{A}loss_agg_mode` (token-mean, ...)"),
    Name("objective.params.dual_clip", "grpo, dapo, dr_grpo: true = the dual clip for A < 0 (bound clip_ratio_c); "
         "ctpo: its width in log space (threshold exp(dual_clip n_t^la_power))", "—",
         "— (verl's vanilla loss always applies it)"),
    Name("objective.params.clip_ratio_c", "the dual clip's bound c", "—", f"`{A}clip_ratio_c`"),
    Name("objective.params.tau_pos", "SAPO's gate temperature for A > 0", "`sapo_temperature_pos`", f"`{A}tau_pos`"),
    Name("objective.params.tau_neg", "SAPO's gate temperature for A <= 0", "`sapo_temperature_neg`", f"`{A}tau_neg`"),
    Name("objective.advantage", "advantage estimator; null = the objective's default", "`scale_rewards` (group: grpo,"
         " batch: batch_std, none: mean_only; TRL's std + 1e-4, ours + 1e-6)",
         "`algorithm.adv_estimator` (+ `norm_adv_by_std_in_grpo`)"),
    Name("train.steps", "rollout steps", "`max_steps` = steps x num_minibatches x epochs",
         "`trainer.total_training_steps`"),
    Name("train.prompts_per_step", "prompts per rollout step", "`generation_batch_size` = prompts_per_step x "
         "group_size", "`data.train_batch_size`"),
    Name("train.group_size", "completions per prompt (the group)", "`num_generations`", f"`{R}n`"),
    Name("train.max_new_tokens", "longest completion (tokens)", "`max_completion_length`",
         "`data.max_response_length`"),
    Name("train.temperature", "sampling temperature (also divides the trainer's logits)", "`temperature`",
         f"`{R}temperature`"),
    Name("train.top_p", "nucleus sampling", "`top_p` (`top_k` = 0)", f"`{R}top_p`"),
    Name("train.epochs", "passes (μ) over each rollout batch", "`num_iterations`", f"`{A}ppo_epochs`"),
    Name("train.num_minibatches", "optimizer steps per pass", "`steps_per_generation` = num_minibatches x "
         "`gradient_accumulation_steps`", f"`{A}ppo_mini_batch_size` = prompts_per_step / num_minibatches"),
    Name("train.micro_batch_size", "sequences per forward/backward (per GPU); 0 = the whole minibatch",
         "`per_device_train_batch_size`; `gradient_accumulation_steps` = minibatch / (micro x GPUs)",
         f"`{A}ppo_micro_batch_size_per_gpu`"),
    Name("train.lr", "AdamW learning rate", "`learning_rate`", f"`{A}optim.lr`"),
    Name("train.warmup_steps", "linear warm-up (optimizer steps)", "`warmup_steps` "
         "(`lr_scheduler_type=constant_with_warmup`; TRL's starts at 0)", f"`{A}optim.lr_warmup_steps`"),
    Name("train.weight_decay", "AdamW weight decay", "`weight_decay`", f"`{A}optim.weight_decay`"),
    Name("train.max_grad_norm", "gradient clipping (global norm)", "`max_grad_norm`", f"`{A}grad_clip`"),
    Name("train.old_logp", "behaviour log-probs: sampler (the sampler's) or recompute (the trainer's)",
         "— (the trainer's; with vLLM: see docs/trl.md)", "`algorithm.rollout_correction.bypass_mode` (sampler = "
         "true)"),
    Name("train.rollout_correction.mode", "importance weights between the trainer's old policy and the sampler: "
         "none, token_truncate, token_mask, sequence_truncate, sequence_mask", "`vllm_importance_sampling_mode` "
         "(none: `vllm_importance_sampling_correction=false`)", "`algorithm.rollout_correction.rollout_is` (token / "
         "sequence) + `rollout_rs`"),
    Name("train.rollout_correction.threshold", "the weights' upper bound C (truncate at C / mask above C)",
         "`vllm_importance_sampling_clip_max`", "`algorithm.rollout_correction.rollout_is_threshold`"),
    Name("train.rollout_correction.threshold_lower", "mask weights below it (null: 1/C); truncate modes: a lower "
         "clamp", "`vllm_importance_sampling_clip_min`", "`algorithm.rollout_correction.rollout_rs_threshold_lower`"),
    Name("train.max_nonfinite_in_row", "stop after this many non-finite updates in a row"),
    Name("train.dynamic_sampling", "DAPO: drop groups with equal rewards, sample more prompts to refill", "—",
         "`algorithm.filter_groups.enable`"),
    Name("train.max_sampling_rounds", "dynamic sampling's rounds of prompts per step", "—",
         "`algorithm.filter_groups.max_num_gen_batches`"),
    Name("train.sampler", "native (our decode loop) or hf (transformers' generate)", "— (`use_vllm`)",
         f"`{R}name`"),
    Name("train.decoder", "the native sampler's decode step: auto, shared_prefix (Llama-family: a group's prompt "
         "keys/values stored once), per_row (Llama-family: one key/value slab per row, the step that compiles) or "
         "cache (the model's forward, per-row KV cache)"),
    Name("train.compile_sampler", "torch.compile the native sampler's decode step (the per-row decoder's; other "
         "models: the cache decoder's forward)"),
    Name("train.padding_free", "the trainer's forward runs its token-wise layers on real completion tokens only "
         "(Llama-family models; others: the model's forward on the padded batch)", "—",
         "`actor_rollout_ref.model.use_remove_padding`"),
    Name("train.eval_every", "held-out evaluation every N steps; 0 = start and end only", "`eval_steps` (optimizer "
         "steps)", "`trainer.test_freq`"),
    Name("train.eval_max_new_tokens", "evaluation's longest completion; 0 = max_new_tokens"),
    Name("train.pass_k", "also pass@k at evaluation (k samples per problem); 0 = off", "—", f"`{R}val_kwargs.n`"),
    Name("train.save_every", "a checkpoint every N steps (resume)", "`save_steps` (optimizer steps)",
         "`trainer.save_freq`"),
    Name("train.export_every", "save_pretrained the policy to exports/step_N/ every N steps; 0 = final/ only"),
    Name("sweep.grid", "dotted key -> list of values: every combination is a run"),
    Name("sweep.per_objective", "objective -> settings for that objective's runs"),
    Name("lab.objectives", "gradient lab: the objectives compared; empty = all"),
    Name("lab.params", "gradient lab: per objective, hyperparameters to set"),
    Name("lab.batches", "gradient lab: independent rollout batches"),
    Name("lab.staleness", "gradient lab: optimizer steps away from the behaviour policy"),
    Name("lab.mover", "gradient lab: the objective whose steps move the policy"),
    Name("lab.mismatch", "gradient lab: behaviour samplers besides fp32"),
    Name("lab.mismatch_temperature", "gradient lab: the temperature sampler's temperature"),
    Name("lab.reference_samples", "gradient lab: completions per prompt of the reference gradient"),
    Name("lab.sketch_dim", "gradient lab: size of the gradients' count sketch"),
    Name("lab.policy", "gradient lab: a saved policy folder (final/, exports/step_N/); null = the starting policy"),
    Name("logging.backends", "where metrics rows go: jsonl (always), tensorboard, wandb, trackio", "`report_to`",
         "`trainer.logger`"),
    Name("logging.project", "wandb / trackio project", "— (`WANDB_PROJECT`, `TRACKIO_PROJECT`)",
         "`trainer.project_name`"),
)


# ------------------------------------------------------------------ objective hyperparameters, from the registry

PARAMS = "objective.params."


@functools.cache
def _field_comments(cls) -> dict[str, str]:
    """``{field: comment}`` of the classes in ``cls``'s MRO: the comment after a field's line (``x: float = 1.0
    # meaning``, the README's template) or, failing that, the comment lines right above it."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        above: list[str] = []
        for line in lines:
            stripped = line.strip()
            field = re.match(r"(\w+)\s*:\s*[^=#]+=[^#]*(?:#\s*(.*))?$", stripped)
            if stripped.startswith("#"):
                above.append(stripped.lstrip("#").strip())
                continue
            if field and not stripped.startswith(("def ", "class ", "return ")):
                text = field.group(2) or " ".join(above)
                if text:
                    comments[field.group(1)] = text
            above = []
    return comments


def _docstring_line(cls, param: str) -> str | None:
    """The first line of the objective's module docstring that names ``param`` (````param```` preferred)."""
    doc = inspect.getdoc(sys.modules[cls.__module__]) or ""
    lines = [" ".join(line.split()) for line in doc.splitlines()]
    quoted = [line for line in lines if f"``{param}``" in line]
    named = quoted or [line for line in lines if re.search(rf"\b{re.escape(param)}\b", line)]
    return named[0].lstrip("-* ") if named else None


# one line per hyperparameter without a NAMES row, for the objectives named (others with the same name get their
# own field comment or docstring line); a new objective needs no entry here: comment its fields (the README's way)
MEANINGS: dict[str, tuple[tuple[str, ...], str]] = {
    "cap_log_ratio": (("gspo", "gspo_token"), "cap the log sequence ratio at log_ratio_cap (verl's numerical-safety "
                      "cap); off = the paper's formula"),
    "log_ratio_cap": (("gspo", "gspo_token"), "the cap on the log sequence ratio with cap_log_ratio (a capped "
                      "sequence keeps its loss value and loses its gradient)"),
    "ratio_mode": (("ctpo", "ctpo_clip"), "token t's cumulative ratio: cumprod (the product of its prefix's ratios) "
                   "or geomean (their geometric mean)"),
    "la_power": (("ctpo",), "length-adaptive window: the log-ratio clip bounds scale with n_t^la_power (n_t = valid "
                 "tokens so far; the authors' clip_ratio_la_power: +0.5 for cumprod, -0.5 for geomean)"),
    "temperature": (("conspo",), "the InfoNCE temperature T over length-normalised sequence log-probs (gradient "
                    "scale ~1/T)"),
    "margin_start": (("conspo",), "the contrastive margin m (nats per token) at the start of its schedule"),
    "margin_end": (("conspo",), "the contrastive margin m (nats per token) at the end of its schedule"),
    "schedule": (("conspo",), "how the margin moves from margin_start to margin_end over the run's optimizer steps: "
                 "linear, cosine or constant"),
    "p_start": (("holder",), "the power-mean exponent p at the start of its linear schedule (p > 1 leans on the "
                "largest token ratios, p < 0 on the smallest, 0 = geometric mean)"),
    "p_end": (("holder",), "the power-mean exponent p at the end of its linear schedule"),
    "variant": (("holder",), "holder (the paper's), sequence_w_clip or holder_token (the authors' code's variants)"),
    "p_schedule": (("holder",), "what p's schedule counts: run_length (the run's optimizer steps) or rollout_steps "
                   "(the authors': rollout steps, up to holder_p_schedule_steps)"),
    "holder_p_schedule_steps": (("holder",), "rollout steps over which p moves from p_start to p_end with "
                                "p_schedule=rollout_steps (the authors' script: 500)"),
    "band_low": (("tbpo",), "lower edge of the trust band on the sequence mismatch weight w_i (proximal vs sampler): "
                 "a sequence outside it is dropped (our reading of the paper)"),
    "band_high": (("tbpo",), "upper edge of the trust band on the sequence mismatch weight w_i"),
}


def hyperparameter_meaning(param: str) -> str:
    """One line: what ``objective.params.<param>`` does, from the objectives that take it: the ``help`` metadata or
    the comment of the field (the README's way to document a hyperparameter), else :data:`MEANINGS`, else the line
    of the objective's docstring that names it, with the file. Where objectives differ, each one's is given."""
    from objectives import OBJECTIVES

    meanings: dict[str, list[str]] = {}
    for name in OBJECTIVES.names():
        cls = OBJECTIVES.get(name)
        if param not in cls.hyperparameters():
            continue
        field = next(f for f in dataclasses.fields(cls) if f.name == param)
        text = field.metadata.get("help") or _field_comments(cls).get(param)
        if text is None and name in MEANINGS.get(param, ((), ""))[0]:
            text = MEANINGS[param][1]
        if text is None:
            line = _docstring_line(cls, param)
            text = f"see {cls.__module__.replace('.', '/')}.py" + (f": {line}" if line else "")
        meanings.setdefault(text, []).append(name)
    if len(meanings) == 1:
        return next(iter(meanings))
    return "; ".join(f"{', '.join(objectives)}: {text}" for text, objectives in meanings.items())


def objectives_taking(param: str) -> list[str]:
    from objectives import OBJECTIVES

    return [name for name in OBJECTIVES.names() if param in OBJECTIVES.get(name).hyperparameters()]


@functools.lru_cache(maxsize=1)
def all_names() -> tuple[Name, ...]:
    """:data:`NAMES` plus a row for every objective hyperparameter the registry knows (generated: a new objective's
    hyperparameters appear here, in ``explain`` and in docs/trl.md without an edit of this file); a hand-written
    row (with TRL / verl names) wins over the generated one."""
    from objectives import OBJECTIVES

    params = dict.fromkeys(p for name in OBJECTIVES.names() for p in OBJECTIVES.get(name).hyperparameters())
    written = {n.key for n in NAMES}
    generated = [Name(PARAMS + p, hyperparameter_meaning(p)) for p in params if PARAMS + p not in written]
    last = max(i for i, n in enumerate(NAMES) if n.key.startswith(PARAMS))
    return (*NAMES[: last + 1], *generated, *NAMES[last + 1 :])


def by_key() -> dict[str, Name]:
    return {n.key: n for n in all_names()}


# ------------------------------------------------------------------------------------ TRL names on the command line


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
    from objectives import OBJECTIVES

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
              "cispo": "objective.name=cispo", "sapo": "objective.name=sapo"}


def _loss_type(value: str, objectives: list[str], given: set[str]) -> list[str]:
    if value == "bnpo":
        raise AliasError("loss_type=bnpo normalises by the local micro-batch's tokens, which has no equivalent here; "
                         "the nearest is objective.params.aggregation=token_mean (equal with train.micro_batch_size=0 "
                         "on one GPU)")
    if value not in LOSS_TYPES:
        raise AliasError(f"loss_type={value} has no objective here; set objective.name (python -m harness list)")
    return [LOSS_TYPES[value]]


def _scale_rewards(value: str, objectives: list[str], given: set[str]) -> list[str]:
    estimator = {"group": "grpo", "true": "grpo", "batch": "batch_std", "none": "mean_only",
                 "false": "mean_only"}.get(value.lower())
    if estimator is None:
        raise AliasError(f"scale_rewards={value}: TRL takes group, batch or none; ours: objective.advantage")
    return [f"objective.advantage={estimator}"]


def _sapo_temperature(param: str) -> Callable[[str, list[str], set[str]], list[str]]:
    def convert(value: str, objectives: list[str], given: set[str]) -> list[str]:
        _needs(param, f"sapo_temperature_{param[4:]}", objectives)
        return [f"objective.params.{param}={value}"]

    return convert


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
    Alias("beta", "objective.params.beta", "same (the k3 KL to the reference)"),
    Alias("epsilon", "objective.params.clip_low", "clip_low and clip_high (TRL's epsilon_high defaults to epsilon; "
          "an epsilon_high given as well wins); refused for cispo and objectives without clip_low", _epsilon),
    Alias("epsilon_high", "objective.params.clip_high", "same; cispo: clip_high = epsilon_high - 1 (TRL's cispo caps "
          "the ratio at epsilon_high)", _epsilon_high),
    Alias("loss_type", "objective.params.aggregation", "grpo / dapo / dr_grpo: the aggregation (seq_mean_token_mean"
          " / token_mean / seq_mean_token_sum_norm: TRL's loss_type only aggregates its clipped loss; "
          "objective.name=dapo would also raise clip_high to 0.28); cispo, sapo: objective.name; bnpo and others "
          "refused", _loss_type, sets_objective=True),
    Alias("importance_sampling_level", "objective.name", "sequence: objective.name=gspo; token refused (choose "
          "objective.name)", _importance_sampling_level, sets_objective=True),
    Alias("scale_rewards", "objective.advantage", "group: grpo, batch: batch_std, none: mean_only (ours add 1e-6 "
          "to the std, TRL 1e-4)", _scale_rewards),
    Alias("sapo_temperature_pos", "objective.params.tau_pos", "same (sapo)", _sapo_temperature("tau_pos")),
    Alias("sapo_temperature_neg", "objective.params.tau_neg", "same (sapo)", _sapo_temperature("tau_neg")),
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
        return [str(v) for v in yaml.safe_load(keys["sweep.grid.objective.name"]) or []]
    grid = OmegaConf.select(layer, "sweep.grid", default=None) if isinstance(layer, DictConfig) else None
    if grid is not None and "objective.name" in grid:
        return [str(v) for v in grid["objective.name"]]
    return [str(OmegaConf.select(layer, "objective.name", default=None) or "grpo")] \
        if isinstance(layer, DictConfig) else ["grpo"]


def translate_overrides(overrides: list[str], layer: DictConfig | None = None) -> list[str]:
    """``overrides`` with TRL-named ones (``num_generations=8``) rewritten to ours, each with a note on stderr;
    a TRL name without an exact equivalent raises ConfigError naming our key. ``layer``: the experiment file's
    settings (its objective decides what ``epsilon`` and the like map to)."""
    from harness.run.config import ConfigError

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


# ---------------------------------------------------------------------------------------------- explain and docs


def schema_keys() -> list[str]:
    """Every leaf key of the schema (dict-valued settings are leaves), dotted, in schema order."""
    from harness.run.config import RunConfig

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                yield from walk(type(default), f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    return list(walk(RunConfig, ""))


def default(key: str) -> str:
    """The schema default of ``key``; for an objective hyperparameter, each objective's default."""
    if key.startswith("objective.params."):
        from objectives import OBJECTIVES

        param = key.rsplit(".", 1)[1]
        values = {name: _shown(OBJECTIVES.get(name).hyperparameters()[param]) for name in OBJECTIVES.names()
                  if param in OBJECTIVES.get(name).hyperparameters()}
        if len(values) > 1 and len(set(values.values())) == 1:
            return f"{next(iter(values.values()))} ({', '.join(values)})"
        return ", ".join(f"{name} {value}" for name, value in values.items())
    value = OmegaConf.select(_schema(), key)
    return _shown(OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value)


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    from harness.run.config import RunConfig

    return OmegaConf.structured(RunConfig)


def _shown(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def plain(text: str) -> str:
    return text.replace("`", "")


def find(query: str) -> list[Name]:
    """Rows for ``query``: our key, a TRL alias, the last part of our keys (``la_power``, ``group_size``), or a TRL
    / verl name mentioned in a row."""
    keys = by_key()
    if query in keys:
        return [keys[query]]
    rows = [keys[ALIASES[query].key]] if query in ALIASES else []  # TRL's beta: ours; our own beta too
    rows += [n for n in all_names() if n.key.rsplit(".", 1)[-1] == query and n not in rows]
    if rows:
        return rows
    pattern = re.compile(rf"`([\w.]*\.)?{re.escape(query)}`")
    return [n for n in all_names() if pattern.search(n.trl) or pattern.search(n.verl)]


def explain(query: str | None = None) -> str:
    """Console text: one key in full (``query``), or the whole table. Raises KeyError (with a hint) if unknown."""
    if query is None:
        lines = []
        for n in all_names():
            lines += [f"{n.key} = {default(n.key) if not n.key.startswith('objective.params.') else '(per objective)'}",
                      f"    {n.meaning}", f"    TRL: {plain(n.trl)} | verl: {plain(n.verl)}"]
        return "\n".join(lines + ["", "python -m harness explain KEY: one key in full (KEY may be a TRL or verl name)"])
    rows = find(query)
    if not rows:
        keys = by_key()
        leaves = {key.rsplit(".", 1)[-1]: key for key in keys}
        close = difflib.get_close_matches(query, [*keys, *ALIASES], n=3, cutoff=0.6)
        close = close or [leaves[c] for c in difflib.get_close_matches(query, leaves, n=3, cutoff=0.6)]
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"no config key, TRL or verl name {query!r}.{hint} The whole table: python -m harness explain")
    out = []
    if query in ALIASES:
        a = ALIASES[query]
        out.append(f"TRL {query} on the command line: refused, set {a.key} ({a.rule})" if a.refused else
                   f"TRL {query} on the command line: -> {a.key}: {a.rule}")
    for n in rows:
        out.append(f"{n.key}: {n.meaning}")
        if n.key.startswith(PARAMS):
            out.append(f"  objectives: {', '.join(objectives_taking(n.key[len(PARAMS):])) or 'none'}")
        out += [f"  default: {default(n.key)}", f"  TRL GRPOConfig: {plain(n.trl)}", f"  verl: {plain(n.verl)}"]
    return "\n".join(out)


def _cell(text: str) -> str:
    """A Markdown table cell: pipes escaped, and <...> outside code spans as entities (not HTML tags)."""
    parts = re.split(r"(`[^`]*`)", text.replace("|", "\\|"))
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;") for p in parts)


def names_markdown() -> str:
    """docs/trl.md's table: every key, its meaning, default, TRL and verl names."""
    lines = ["| key | meaning | default | TRL `GRPOConfig` | verl |", "|---|---|---|---|---|"]
    for n in all_names():
        value = default(n.key) if n.key.startswith(PARAMS) else f"`{default(n.key)}`"
        lines.append(f"| `{n.key}` | {_cell(n.meaning)} | {_cell(value)} | {_cell(n.trl)} | {_cell(n.verl)} |")
    return "\n".join(lines) + "\n"


def aliases_markdown() -> str:
    """The README's table: the TRL names accepted (or refused) on the command line."""
    lines = ["| TRL name | ours | how |", "|---|---|---|"]
    for a in ALIASES.values():
        lines.append(f"| `{a.trl}` | `{a.key}` | {'refused: ' if a.refused else ''}{_cell(a.rule)} |")
    return "\n".join(lines) + "\n"


def generated(kind: str) -> str:
    return {"names": names_markdown, "aliases": aliases_markdown}[kind]()


def markers(kind: str) -> tuple[str, str]:
    return (f"<!-- generated: {kind} (python -m harness explain --markdown --write) -->",
            f"<!-- end generated: {kind} -->")


def section(text: str, kind: str) -> str | None:
    """The generated block of ``kind`` in ``text`` (between its markers), or None."""
    start, end = markers(kind)
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def write_docs() -> list[Path]:
    """Rewrite the generated tables in :data:`DOCS`; returns the files changed."""
    changed = []
    for path, kind in DOCS.items():
        text = path.read_text()
        old = section(text, kind)
        if old is None:
            raise RuntimeError(f"{path}: no {' ... '.join(markers(kind))} block to write the {kind} table into")
        start, end = markers(kind)
        new = text.split(start, 1)[0] + start + "\n" + generated(kind) + end + text.split(end, 1)[1]
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed
