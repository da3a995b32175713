"""Every config key with its meaning and its TRL ``GRPOConfig`` / verl equivalents, in one table (:data:`NAMES`), and
the TRL names accepted on the command line (harness/run/aliases.py's :data:`ALIASES`).

    python -m harness explain train.group_size     # meaning, default, TRL and verl names (a TRL or verl name works too)
    python -m harness explain                      # the whole table
    python -m harness explain --markdown --write   # rewrite the generated tables in docs/trl.md and README.md
                                                   # (README's: every registered objective, from the registry)

TRL names are TRL 1.16's ``GRPOConfig`` fields (``trl/trainer/grpo_config.py``), verl names its ``ppo_trainer.yaml``
keys (and the DAPO recipe's ``reward_model.overlong_buffer``). ``—``: no equivalent. A TRL-named override
(``num_generations=8``) is rewritten to ours with a one-line note on stderr (harness/run/aliases.py, called by
``load_experiment``), or refused with a one-line error naming our key where the two do not mean exactly the same.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from harness.run.aliases import ALIASES
from harness.run.config import RunConfig, schema
from harness.run.errors import reader_gone
from harness.run.experiments import REPO
from harness.run.shapes import TINY_MODEL_SPECS
from objectives import OBJECTIVES, available_advantages
from objectives.base import SHARED_HYPERPARAMETERS, Objective, alias_of

# file -> the generated tables it holds (each between its markers)
DOCS = {REPO / "docs" / "trl.md": ("names", "aliases"), REPO / "README.md": ("objectives",)}


@dataclass(frozen=True)
class Name:
    key: str  # ours, dotted
    trl: str = "—"  # TRL GRPOConfig field(s), in backticks, with a short note where the match is not one to one
    verl: str = "—"  # verl ppo_trainer.yaml key(s)
    meaning: str = ""  # one line; a schema key's is its field's comment in harness/run/config.py (:func:`all_names`)


A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
NAMES: tuple[Name, ...] = (
    Name("name", "—", "`trainer.experiment_name`"),
    Name("seed", "`seed`", "`data.seed` (data shuffling only)"),
    Name("device", "`use_cpu` (device=cpu)", "`trainer.device`"),
    Name("threads"),
    Name("backend"),
    Name("results_dir", "`output_dir` (ours is the root: a run goes to <results_dir>/<name>/<run_id>)",
         "`trainer.default_local_dir`"),
    Name("profile"),
    Name("profiles"),
    Name("model.name", "the trainer's `model` argument", "`actor_rollout_ref.model.path`"),
    Name("model.tiny"),
    Name("model.dtype", "`bf16` / `fp16` (mixed precision)",
         f"— (FSDP mixed precision: `{A}fsdp_config.mixed_precision`)"),
    Name("model.sampler_dtype", "— (vLLM: `vllm_*`)", f"`{R}dtype`"),
    Name("model.seed"),
    Name("model.warm_start_steps"),
    Name("model.warm_start_target"),
    Name("model.warm_start_check_every"),
    Name("model.warm_start_lr"),
    Name("model.warm_start_batch_size"),
    Name("model.lora.rank", "the trainer's `peft_config` (peft's LoraConfig): r",
         "`actor_rollout_ref.model.lora_rank`"),
    Name("model.lora.alpha", "`peft_config`: lora_alpha", "`actor_rollout_ref.model.lora_alpha`"),
    Name("model.lora.dropout", "`peft_config`: lora_dropout"),
    Name("model.lora.target_modules", "`peft_config`: target_modules",
         "`actor_rollout_ref.model.target_modules`"),
    Name("model.lora.export_merged", "— (peft's merge_and_unload afterwards)"),
    Name("task.name", "the trainer's `train_dataset` + `reward_funcs`",
         "`data.train_files` + `custom_reward_function.path`"),
    Name("task.data_dir", "—", "`data.train_files`, `data.val_files`"),
    Name("task.eval_size", "—", "`data.val_max_samples`"),
    Name("task.eval_set"),
    Name("task.format_weight", "`reward_weights` = [1, format_weight]"),
    Name("task.overlong_buffer", "—", "`reward_model.overlong_buffer.len` (DAPO recipe)"),
    Name("task.overlong_penalty", "—", "`reward_model.overlong_buffer.penalty_factor`"),
    Name("task.args"),
    Name("objective.name", "`loss_type` (cispo, sapo) / `importance_sampling_level=sequence` (gspo)",
         f"`{A}policy_loss.loss_mode`"),
    Name("objective.params"),
    Name("objective.params.clip_low", "`epsilon`", f"`{A}clip_ratio_low`",
         meaning="ε_low of the ratio clip (its meaning per objective: docs/objectives.md)"),
    Name("objective.params.clip_high", "`epsilon_high` (cispo: `epsilon_high` = 1 + clip_high)",
         f"`{A}clip_ratio_high`", meaning="ε_high of the ratio clip"),
    Name("objective.params.beta", "`beta` with `use_bias_correction_kl` false (TRL's default true multiplies the k3 by "
         "the ratio); backend trl: a frozen copy of the starting policy as `ref_model`",
         f"`{A}kl_loss_coef` (`{A}use_kl_loss=true`, `{A}kl_loss_type=low_var_kl`)",
         meaning="weight of the k3 KL to the reference policy; 0 = no reference"),
    Name("objective.params.aggregation", "`loss_type` dapo / grpo / dr_grpo", f"`{A}loss_agg_mode` (token-mean, ...)",
         meaning="token_mean, seq_mean_token_mean, seq_mean_token_sum_norm, seq_mean_token_sum or prompt_mean "
                 "(SkyRL's: the token mean per prompt, then the mean over prompts)"),
    Name("objective.params.dual_clip", "`delta` set (not None; grpo, dapo, dr_grpo)",
         "— (verl's vanilla loss always applies it)", meaning="grpo, dapo, "
         "dr_grpo: true = the dual clip for A < 0 (bound clip_ratio_c); ctpo: its width in log space (threshold "
         "exp(dual_clip n_t^la_power))"),
    Name("objective.params.clip_ratio_c", "`delta` (two-sided GRPO; the same loss where delta >= 1 + epsilon_high)",
         f"`{A}clip_ratio_c`", meaning="the dual clip's bound c"),
    Name("objective.params.kl_estimator", "— (TRL's KL is k3)", f"`{A}kl_loss_type`"),
    Name("objective.params.off_policy_mask", "`off_policy_mask_threshold` set (not None)", "—"),
    Name("objective.params.off_policy_mask_threshold", "`off_policy_mask_threshold`", "—"),
    Name("objective.params.entropy_coef", "`entropy_coef` (`use_adaptive_entropy`: objective adaptive_entropy, whose "
         "initial coefficient it is)", f"`{A}entropy_coeff` (verl aggregates it with `loss_agg_mode`)"),
    Name("objective.params.top_entropy_quantile", "`top_entropy_quantile`", "—"),
    Name("objective.params.entropy_target", "`entropy_target` (with `use_adaptive_entropy`)", "—"),
    Name("objective.params.entropy_coef_min", "`entropy_coef_min`", "—"),
    Name("objective.params.entropy_coef_max", "`entropy_coef_max`", "—"),
    Name("objective.params.entropy_coef_delta", "`entropy_coef_delta`", "—"),
    Name("objective.params.kl_target", "—", "`algorithm.kl_ctrl.target_kl` (verl: the KL in the reward)"),
    Name("objective.params.kl_horizon", "—", "`algorithm.kl_ctrl.horizon`"),
    Name("objective.params.dro_beta", "—", f"`{A}policy_loss.dro_beta`"),
    Name("objective.params.beta2", "— (beta2 of TRL's experimental A2POConfig, not a GRPOConfig field)", "—"),
    Name("objective.params.tau_pos", "`sapo_temperature_pos`", f"`{A}tau_pos`",
         meaning="SAPO's gate temperature for A > 0"),
    Name("objective.params.tau_neg", "`sapo_temperature_neg`", f"`{A}tau_neg`",
         meaning="SAPO's gate temperature for A <= 0"),
    Name("objective.params.k_pos", "`vespo_k_pos`"),
    Name("objective.params.lambda_pos", "`vespo_lambda_pos`"),
    Name("objective.params.k_neg", "`vespo_k_neg`"),
    Name("objective.params.lambda_neg", "`vespo_lambda_neg`"),
    Name("objective.advantage",
         "`scale_rewards` (group: grpo, batch: batch_std, none: mean_only; TRL's std + 1e-4, ours + 1e-6 but "
         "batch_std's + 1e-4)",
         "`algorithm.adv_estimator` (+ `norm_adv_by_std_in_grpo`)"),
    Name("train.steps", "`max_steps` = steps x num_minibatches x epochs", "`trainer.total_training_steps`"),
    Name("train.prompts_per_step", "`generation_batch_size` = prompts_per_step x group_size",
         "`data.train_batch_size`"),
    Name("train.group_size", "`num_generations`", f"`{R}n`"),
    Name("train.max_new_tokens", "`max_completion_length`", "`data.max_response_length`"),
    Name("train.temperature", "`temperature`", f"`{R}temperature`"),
    Name("train.top_p", "`top_p` (`top_k` = 0)", f"`{R}top_p`"),
    Name("train.epochs", "`num_iterations`", f"`{A}ppo_epochs`"),
    Name("train.num_minibatches", "`steps_per_generation` = num_minibatches x `gradient_accumulation_steps`",
         f"`{A}ppo_mini_batch_size` = prompts_per_step / num_minibatches"),
    Name("train.micro_batch_size",
         "`per_device_train_batch_size`; `gradient_accumulation_steps` = minibatch / (micro x GPUs)",
         f"`{A}ppo_micro_batch_size_per_gpu`"),
    Name("train.lr", "`learning_rate`", f"`{A}optim.lr`"),
    Name("train.warmup_steps", "`warmup_steps` (`lr_scheduler_type=constant_with_warmup`; TRL's starts at 0)",
         f"`{A}optim.lr_warmup_steps`"),
    Name("train.weight_decay", "`weight_decay`", f"`{A}optim.weight_decay`"),
    Name("train.max_grad_norm", "`max_grad_norm`", f"`{A}grad_clip`"),
    Name("train.old_logp", "— (the trainer's; with vLLM: see docs/trl.md)",
         "`algorithm.rollout_correction.bypass_mode` (sampler = true)"),
    Name("train.rollout_correction.mode",
         "`vllm_importance_sampling_mode` (none: `vllm_importance_sampling_correction=false`)",
         "`algorithm.rollout_correction.rollout_is` (token / sequence) + `rollout_rs`"),
    Name("train.rollout_correction.threshold", "`vllm_importance_sampling_clip_max`",
         "`algorithm.rollout_correction.rollout_is_threshold`"),
    Name("train.rollout_correction.threshold_lower", "`vllm_importance_sampling_clip_min`",
         "`algorithm.rollout_correction.rollout_rs_threshold_lower`"),
    Name("train.rollout_lag", "— (TRL 1.16 has none; its later AsyncGRPOTrainer's max_staleness bounds it)"),
    Name("train.lag_mode"),
    Name("train.in_flight_tokens"),
    Name("train.rollout_correction.rejection", "— (backend trl refuses it)",
         "`algorithm.rollout_correction.rollout_rs` (its k2 / k3 rules)"),
    Name("train.rollout_correction.rejection_threshold", "—",
         "`algorithm.rollout_correction.rollout_rs_threshold`"),
    Name("train.max_nonfinite_in_row"),
    Name("train.dynamic_sampling", "—", "`algorithm.filter_groups.enable`"),
    Name("train.max_sampling_rounds", "—", "`algorithm.filter_groups.max_num_gen_batches`"),
    Name("train.sampler", "— (`use_vllm`)", f"`{R}name`"),
    Name("train.decoder"),
    Name("train.compile_sampler"),
    Name("train.padding_free", "—", "`actor_rollout_ref.model.use_remove_padding`"),
    Name("train.cpu_matmul"),
    Name("train.routing_replay", "—", f"`{A}router_replay.mode` (disabled / R2 / R3)"),
    Name("train.lm_head_chunk", "— (nearest: `use_liger_kernel`'s fused linear cross-entropy)",
         f"— (nearest: `actor_rollout_ref.model.use_fused_kernels`; `{A}entropy_from_logits_with_chunking`)"),
    Name("train.activation_checkpointing", "`gradient_checkpointing` (transformers 5: `activation_checkpointing`)",
         "`actor_rollout_ref.model.enable_gradient_checkpointing`"),
    Name("train.max_tokens_per_micro_batch", "—", f"`{A}use_dynamic_bsz` + `{A}ppo_max_token_len_per_gpu`"),
    Name("train.eval_every", "`eval_steps` (optimizer steps)", "`trainer.test_freq`"),
    Name("train.eval_max_new_tokens"),
    Name("train.eval_batch_size", "— (nearest: `per_device_eval_batch_size`)"),
    Name("train.pass_k", "—", f"`{R}val_kwargs.n`"),
    Name("train.save_every", "`save_steps` (optimizer steps)", "`trainer.save_freq`"),
    Name("train.keep_checkpoints", "— (nearest: `save_total_limit`)", "— (nearest: `trainer.max_actor_ckpt_to_keep`)"),
    Name("train.export_every"),
    Name("sweep.grid"),
    Name("sweep.per_objective"),
    Name("sweep.baseline"),
    Name("lab.objectives"),
    Name("lab.params"),
    Name("lab.batches"),
    Name("lab.staleness"),
    Name("lab.mover"),
    Name("lab.mismatch"),
    Name("lab.mismatch_temperature"),
    Name("lab.routing"),
    Name("lab.reference_samples"),
    Name("lab.sketch_dim"),
    Name("lab.policy"),
    Name("logging.backends", "`report_to`", "`trainer.logger`"),
    Name("logging.project", "— (`WANDB_PROJECT`, `TRACKIO_PROJECT`)", "`trainer.project_name`"),
    Name("launcher.runs_per_process"),
    Name("launcher.cpus_per_run"),
    Name("launcher.gpus_per_run", "—", "`trainer.n_gpus_per_node`"),
    Name("launcher.address"),
    Name("launcher.cluster"),
    Name("launcher.partition"),
    Name("launcher.time_min"),
    Name("launcher.mem_gb"),
    Name("launcher.slurm_args"),
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
    """The first line of the objective's module docstring that names ``param`` (````param```` preferred), with the
    lines that continue its sentence (up to one ending in '.', ';' or ':', or the paragraph's end; at most 3 more): a
    wrapped line alone broke off mid-sentence."""
    doc = inspect.getdoc(sys.modules[cls.__module__]) or ""
    lines = [" ".join(line.split()) for line in doc.splitlines()]
    quoted = [i for i, line in enumerate(lines) if f"``{param}``" in line]
    named = quoted or [i for i, line in enumerate(lines) if re.search(rf"\b{re.escape(param)}\b", line)]
    if not named:
        return None
    end = named[0]
    while end < min(named[0] + 3, len(lines) - 1) and not lines[end].endswith((".", ";", ":")) and lines[end + 1] \
            and not lines[end + 1].startswith(("-", "*")):
        end += 1
    return " ".join(lines[named[0]: end + 1]).lstrip("-* ")


# one line per hyperparameter without a NAMES row, for the objectives named (others with the same name get their
# own field comment or docstring line); a new objective needs no entry here: comment its fields (the README's way)
MEANINGS: dict[str, tuple[tuple[str, ...], str]] = {
    "cap_log_ratio": (("gspo", "gspo_token", "luspo"), "cap the log sequence ratio at log_ratio_cap (verl's "
                      "numerical-safety cap); off = the paper's formula"),
    "log_ratio_cap": (("gspo", "gspo_token", "luspo"), "the cap on the log sequence ratio with cap_log_ratio (a "
                      "capped sequence keeps its loss value and loses its gradient)"),
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
    meanings: dict[str, list[str]] = {}
    for name in objectives_taking(param):
        text = _own_meaning(name, param) or _docstring_meaning(name, param)
        meanings.setdefault(text, []).append(name)
    if len(meanings) == 1:
        return next(iter(meanings))
    return "; ".join(f"{', '.join(objectives)}: {text}" for text, objectives in meanings.items())


def objective_param_meaning(name: str, param: str) -> str:
    """One line: what objective ``name``'s hyperparameter ``param`` does there (its reference page): the field's own
    meaning (``help`` metadata, comment, :data:`MEANINGS`), else the hand-written row's, else its docstring line."""
    row = next((n for n in NAMES if n.key == PARAMS + param and n.meaning), None)
    return _own_meaning(name, param) or (row.meaning if row else _docstring_meaning(name, param))


def _own_meaning(name: str, param: str) -> str | None:
    text = _field_help(OBJECTIVES.get(name), param)
    if text is None and name in MEANINGS.get(param, ((), ""))[0]:
        text = MEANINGS[param][1]
    return text


def _field_help(cls, param: str) -> str | None:
    """The ``help`` metadata or the comment of ``cls``'s field ``param`` (None if it has neither, or no such field)."""
    field = next((f for f in dataclasses.fields(cls) if f.name == param), None)
    return field and (field.metadata.get("help") or _field_comments(cls).get(param))


def written_meaning(param: str, common: str) -> str:
    """A hand-written row's meaning ``common`` of ``objective.params.<param>``, followed by the meaning of each
    objective whose field says otherwise (its ``help`` or comment, not the one every objective inherits): tbpo's
    ``clip_ratio_c`` 0 is not the dual clip's bound, a new objective's comment is its field's help. Where every
    objective taking it says its own, those alone (the hand-written line then describes none of them)."""
    inherited = _field_help(Objective, param)
    taking = objectives_taking(param)
    meanings: dict[str, list[str]] = {}
    for name in taking:
        text = _own_meaning(name, param)
        if text and text != inherited:
            meanings.setdefault(text, []).append(name)
    every = bool(taking) and sum(map(len, meanings.values())) == len(taking)
    if every and len(meanings) == 1:
        return next(iter(meanings))
    own = [f"{', '.join(objectives)}: {text}" for text, objectives in meanings.items()]
    return "; ".join(own if every else [common, *own])


def _docstring_meaning(name: str, param: str) -> str:
    cls = OBJECTIVES.get(name)
    line = _docstring_line(cls, param)
    return f"see {cls.__module__.replace('.', '/')}.py" + (f": {line}" if line else "")


def own_hyperparameters(name: str) -> dict[str, object]:
    """Objective ``name``'s own hyperparameters with its defaults, and the shared ones whose default it changes
    (adaptive_kl's beta); ``aggregation`` apart (its default is shown on its own)."""
    own, common = OBJECTIVES.get(name).hyperparameters(), Objective.hyperparameters()
    return {k: v for k, v in own.items() if k != "aggregation" and (k not in SHARED_HYPERPARAMETERS or v != common[k])}


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence, one followed by a space or the end (not the dots of
    "2507.18071" or of the abbreviations "e.g.", "i.e.", "vs.", "cf.", "Fig.", "Sec.", "Eq.", "eq.", "et al.",
    "Dr.")."""
    match = re.search(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)(?<!\bcf)(?<!\bFig)(?<!\bSec)(?<!\bEq)(?<!\beq)(?<!\bal)"
                      r"(?<!\bDr)[.!?](?=\s|$)", text)
    return text[: match.end()] if match else text


def objective_paper(name: str) -> str:
    """Objective ``name``'s source in a few words, from the first paragraph of its module's docstring: the name
    before its " — " (else its first sentence) and the arXiv ids the paragraph cites that it does not show."""
    doc = inspect.getdoc(sys.modules[OBJECTIVES.get(name).__module__]) or ""
    head = " ".join(doc.split("\n\n")[0].split())
    shown = head.split(" — ")[0] if " — " in head else first_sentence(head)
    ids = [i for i in dict.fromkeys(re.findall(r"arXiv (\d{4}\.\d{4,5})", head)) if i not in shown]
    return f"{shown}, arXiv {', '.join(ids)}" if ids else shown


def objectives_taking(param: str) -> list[str]:
    return [name for name in OBJECTIVES.names() if param in OBJECTIVES.get(name).hyperparameters()]


@functools.lru_cache(maxsize=1)
def all_names() -> tuple[Name, ...]:
    """:data:`NAMES` plus a row for every objective hyperparameter the registry knows (generated: a new objective's
    hyperparameters appear here, in ``explain`` and in docs/trl.md without an edit of this file); a hand-written
    row (with TRL / verl names) wins over the generated one; without a meaning of its own it takes the field's, and
    an objective whose field's comment says otherwise is shown with its own (:func:`_with_meaning`)."""
    params = dict.fromkeys(p for name in OBJECTIVES.names() for p in OBJECTIVES.get(name).hyperparameters())
    written = {n.key for n in NAMES}
    generated = [Name(PARAMS + p, meaning=hyperparameter_meaning(p)) for p in params if PARAMS + p not in written]
    meanings = schema_meanings()
    rows = [_with_meaning(n, meanings) for n in NAMES]
    last = max(i for i, n in enumerate(rows) if n.key.startswith(PARAMS))
    return (*rows[: last + 1], *generated, *rows[last + 1 :])


def _with_meaning(row: Name, meanings: dict[str, str]) -> Name:
    """A hand-written row with its meaning: an objective hyperparameter's with each objective's own where it differs
    (:func:`written_meaning`); a row without one takes its schema field's comment or the objectives' fields'."""
    param = row.key.removeprefix(PARAMS)
    if row.meaning:
        return dataclasses.replace(row, meaning=written_meaning(param, row.meaning)) if row.key.startswith(PARAMS) \
            else row
    return dataclasses.replace(row, meaning=meanings[row.key] if row.key in meanings else hyperparameter_meaning(param))


def by_key() -> dict[str, Name]:
    return {n.key: n for n in all_names()}


# ---------------------------------------------------------------------------------------------- explain and docs


def schema_keys() -> list[str]:
    """Every leaf key of the schema (dict-valued settings are leaves), dotted, in schema order."""
    return list(schema_meanings())


@functools.lru_cache(maxsize=1)
def schema_meanings() -> dict[str, str]:
    """Every leaf key of the schema -> its meaning: the field's comment in harness/run/config.py (the one place it is
    written), ``lab.*`` prefixed with "gradient lab: "."""
    def walk(cls, prefix):
        comments = _field_comments(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                yield from walk(type(default), f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", ("gradient lab: " if prefix == "lab." else "") + comments.get(f.name, "")

    return dict(walk(RunConfig, ""))


def default(key: str) -> str:
    """The schema default of ``key``; for an objective hyperparameter, each objective's default."""
    if key.startswith("objective.params."):
        param = key.rsplit(".", 1)[1]
        values = {name: shown(OBJECTIVES.get(name).hyperparameters()[param]) for name in OBJECTIVES.names()
                  if param in OBJECTIVES.get(name).hyperparameters()}
        if len(values) > 1 and len(set(values.values())) == 1:
            return f"{next(iter(values.values()))} ({', '.join(values)})"
        return ", ".join(f"{name} {value}" for name, value in values.items())
    value = OmegaConf.select(schema(), key)
    return shown(OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value)


def shown(value) -> str:
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
    pattern = re.compile(rf"`([\w.]*\.)?{re.escape(query)}(`|=[^`]*`)")  # alone or with a value: `use_kl_loss=true`
    return [n for n in all_names() if pattern.search(n.trl) or pattern.search(n.verl)]


SHAPES = {"model.tiny": TINY_MODEL_SPECS}  # a dict-valued key -> for each model, the dataclass its keys fill


def explain(query: str | None = None) -> str:
    """Console text: one key in full (``query``), or the whole table. Raises KeyError (with a hint) if unknown. A
    dict-valued key (:data:`SHAPES`) lists the fields, defaults and comments of the dataclass its keys fill for each
    model."""
    if query is None or not query.strip():
        lines = []
        for n in all_names():
            lines += [f"{n.key} = {default(n.key) if not n.key.startswith('objective.params.') else '(per objective)'}",
                      f"    {n.meaning}", f"    TRL: {plain(n.trl)} | verl: {plain(n.verl)}"]
        return "\n".join(lines + ["", "python -m harness explain KEY: one key in full (KEY may be a TRL or verl name)"])
    rows = find(query)
    if not rows:
        keys = by_key()
        leaves = {key.rsplit(".", 1)[-1]: key for key in keys}
        close = [k for k in [*keys, *ALIASES] if k.lower() == query.lower()]
        close = close or difflib.get_close_matches(query, [*keys, *ALIASES], n=3, cutoff=0.6)
        close = close or [leaves[c] for c in difflib.get_close_matches(query, leaves, n=3, cutoff=0.6)]
        inside = [key for key in keys if key.startswith(f"{query}.")]  # a section: its keys, not a did-you-mean
        owner = next((key for key in SHAPES if query.startswith(f"{key}.")), None)
        hint = (f" {query} is an objective: objective.name={query} (python -m harness list)."
                if query in OBJECTIVES.names() else
                f" {query} is a section; its keys: {', '.join(inside)}." if inside else
                f" {owner} is a dict: its keys for each model, their defaults and meanings: python -m harness explain "
                f"{owner}." if owner else
                f" Did you mean {', '.join(close)}?" if close else "")
        shown = repr(query if len(query) <= 80 else query[:77] + "...")
        raise KeyError(f"no config key, TRL or verl name {shown}.{hint} The whole table: python -m harness explain")
    out = []
    if query in ALIASES:
        a = ALIASES[query]
        out.append(f"TRL {query} on the command line: refused, set {a.key} ({a.rule})" if a.refused else
                   f"TRL {query} on the command line: -> {a.key}: {a.rule}")
    for n in rows:
        out.append(f"{n.key}: {n.meaning}")
        if n.key.startswith(PARAMS):
            out.append(f"  objectives: {', '.join(objectives_taking(n.key[len(PARAMS):])) or 'none'}")
        out += shape_lines(SHAPES.get(n.key, {}), n.key)
        out += [f"  default: {default(n.key)}", f"  TRL GRPOConfig: {plain(n.trl)}", f"  verl: {plain(n.verl)}"]
    return "\n".join(out)


def shape_lines(classes: Mapping[str, type], key: str) -> list[str]:
    """For each model name, the keys ``key`` (a dict) takes: field = default, and its comment."""
    out = []
    for model, cls in classes.items():
        comments = _field_comments(cls)
        out.append(f"  its keys for model.name={model} ({key}.<key>=<value>):")
        out += [f"    {f.name} = {shown(f.default)}" + (f": {comments[f.name]}" if f.name in comments else "")
                for f in dataclasses.fields(cls)]
    return out


def explain_command(args) -> int:
    """``python -m harness explain [KEY] [--markdown] [--write]``: the key's text (or the whole table, or a generated
    table's Markdown) on stdout, status 0; ``--write``: the generated tables rewritten; an unknown key: one line on
    stderr, status 2. It needs the schema and the objectives only, so the entry point answers it before the models'
    libraries are imported (harness/__main__.py)."""
    if args.write:
        try:
            changed = write_docs()
        except OSError as e:  # e.g. a read-only checkout
            print(f"error: cannot write {e.filename} ({e.strerror})", file=sys.stderr)
            return 2
        print(f"rewrote the generated tables in {', '.join(map(str, changed))}" if changed else
              "the generated tables are up to date", file=sys.stderr)
        return 0
    try:
        if args.markdown:
            print(names_markdown() if args.key is None else generated(args.key), end="")
        else:
            print(explain(args.key))
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `python -m harness explain | head`
        return reader_gone()
    return 0


def cell(text: str) -> str:
    """A Markdown table cell: pipes escaped, and <...> outside code spans as entities (not HTML tags)."""
    parts = re.split(r"(`[^`]*`)", text.replace("|", "\\|"))
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;") for p in parts)


def names_markdown() -> str:
    """docs/trl.md's table: every key, its meaning, default, TRL and verl names."""
    lines = ["| key | meaning | default | TRL `GRPOConfig` | verl |", "|---|---|---|---|---|"]
    for n in all_names():
        value = default(n.key) if n.key.startswith(PARAMS) else f"`{default(n.key)}`"
        lines.append(f"| `{n.key}` | {cell(n.meaning)} | {cell(value)} | {cell(n.trl)} | {cell(n.verl)} |")
    return "\n".join(lines) + "\n"


def aliases_markdown() -> str:
    """docs/trl.md's second table: the TRL names accepted (or refused) on the command line."""
    lines = ["| TRL name | ours | how |", "|---|---|---|"]
    for a in ALIASES.values():
        lines.append(f"| `{a.trl}` | `{a.key}` | {'refused: ' if a.refused else ''}{cell(a.rule)} |")
    return "\n".join(lines) + "\n"


def objectives_markdown() -> str:
    """The README's table: every registered objective, its source, its own hyperparameters' defaults, its default
    aggregation and advantage estimator, then every advantage estimator (a new file is in it at the next make docs)."""
    lines = ["| objective | paper | hyperparameters (defaults) | aggregation | advantage |", "|---|---|---|---|---|"]
    for name in OBJECTIVES.names():
        cls, alias = OBJECTIVES.get(name), alias_of(name)
        paper = (f"alias of `{alias[0]}`" + "".join(f", {k}={shown(v)}" for k, v in alias[1].items()) if alias else
                 objective_paper(name))
        params = ", ".join(f"{k}={shown(v)}" for k, v in own_hyperparameters(name).items())
        lines.append(f"| `{name}` | {cell(paper)} | {cell(params) or '—'} | {cls.hyperparameters()['aggregation']} "
                     f"| {cls.default_advantage} |")
    estimators = ", ".join(f"`{name}`" for name in available_advantages())
    return "\n".join(lines) + f"\n\nAdvantage estimators (`objective.advantage`): {estimators}.\n"


GENERATED = ("names", "aliases", "objectives")  # the generated tables (explain --markdown KEY)


def generated(kind: str) -> str:
    """The Markdown of generated table ``kind``; KeyError (naming the tables) for another."""
    if kind not in GENERATED:
        raise KeyError(f"no generated table {kind!r}; the tables: {', '.join(GENERATED)} (python -m harness explain "
                       "--markdown KIND)")
    return {"names": names_markdown, "aliases": aliases_markdown, "objectives": objectives_markdown}[kind]()


def markers(kind: str) -> tuple[str, str]:
    return (f"<!-- generated: {kind} (python -m harness explain --markdown --write) -->",
            f"<!-- end generated: {kind} -->")


def section(text: str, kind: str) -> str | None:
    """The generated block of ``kind`` in ``text`` (between its markers), or None."""
    start, end = markers(kind)
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def fill(text: str, kinds: tuple[str, ...], path: Path | str) -> str:
    """``text`` with each generated block of ``kinds`` (between its markers) holding the table the code makes now;
    RuntimeError naming ``path`` if a block's markers are gone."""
    for kind in kinds:
        if section(text, kind) is None:
            raise RuntimeError(f"{path}: no {' ... '.join(markers(kind))} block to write the {kind} table into")
        start, end = markers(kind)
        text = text.split(start, 1)[0] + start + "\n" + generated(kind) + end + text.split(end, 1)[1]
    return text


def write_docs(files: dict[Path, tuple[str, ...]] | None = None) -> list[Path]:
    """Rewrite the generated tables in ``files`` (file -> kinds; default :data:`DOCS`), each between its markers;
    returns the files changed. `make docs` and `python -m harness explain --markdown --write` call it: the committed
    tables are as fresh as the last of those (a new objective changes them; no test compares them). The site
    (`make docs-site`, docs/hooks.py) fills them from the code whatever the committed copy holds."""
    changed = []
    for path, kinds in (DOCS if files is None else files).items():
        text = original = path.read_text()
        text = fill(text, kinds, path)
        if text != original:
            path.write_text(text)
            changed.append(path)
    return changed
