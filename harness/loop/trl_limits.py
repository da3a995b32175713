"""What the TRL backend cannot run, and the launch environment it reads (``WORLD_SIZE``, ``$RLVR_TRL_ARGS``).

No trl import here: the config check of a TRL run (harness/loop/backends.py) stays light.
"""

from __future__ import annotations

import json
import os

from omegaconf import DictConfig, OmegaConf

from harness.policy.device import sampler_dtype
from harness.run.config import microbatch_size, minibatch_size
from harness.run.errors import ConfigError
from objectives import estimator_name, get_advantage, get_objective
from objectives.advantages import loop_inputs


def world_size() -> int:
    """Processes of a distributed launch (accelerate / torchrun set WORLD_SIZE), 1 otherwise; ConfigError (one line)
    for a WORLD_SIZE that is not an integer >= 1."""
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise ConfigError(f"the environment's WORLD_SIZE={text!r} is not a number of processes (an integer >= 1): "
                          "unset it, or launch with accelerate / torchrun, which set it")
    return size


def trl_extra_args() -> dict:
    """Extra GRPOConfig arguments from $RLVR_TRL_ARGS (JSON), e.g. '{"use_vllm": true}'; ConfigError (one line) for
    text that is not a JSON object."""
    text = os.environ.get("RLVR_TRL_ARGS") or "{}"
    try:
        args = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"the environment's RLVR_TRL_ARGS is not valid JSON ({e}): give a JSON object of GRPOConfig "
                          "arguments, e.g. RLVR_TRL_ARGS='{\"use_vllm\": true}'") from None
    if not isinstance(args, dict):
        raise ConfigError(f"the environment's RLVR_TRL_ARGS must be a JSON object of GRPOConfig arguments (e.g. "
                          f"'{{\"use_vllm\": true}}'), got {text[:60]!r}")
    return args


def trl_unsupported(run: DictConfig) -> str | None:
    """Why the TRL backend cannot run this config (one sentence saying what to change), or None."""
    t = run.train
    minibatch, micro = minibatch_size(t), microbatch_size(t)
    if minibatch % (micro * world_size()):
        return (f"backend trl: the minibatch ({minibatch} sequences) must split into micro-batches of "
                f"train.micro_batch_size={micro} on each of {world_size()} processes")
    if t.group_size < 2:
        return "backend trl: TRL needs train.group_size >= 2"
    if t.lm_head_chunk or t.max_tokens_per_micro_batch:
        return ("backend trl: train.lm_head_chunk and train.max_tokens_per_micro_batch are the native backend's "
                "(TRL computes its own log-probs, in train.micro_batch_size rows); set them to 0, or use "
                "backend=native")
    if not t.padding_free:
        return ("backend trl: train.padding_free is the native trainer's forward (TRL computes its own log-probs, on "
                "the padded batch); leave it true, or use backend=native")
    if t.keep_checkpoints:
        return ("backend trl: train.keep_checkpoints is the native backend's (TRL keeps one checkpoint, "
                "<run>/trl/checkpoint-N, with its optimizer's state, running or ended); leave it false, or use "
                "backend=native")
    if run.task.overlong_buffer:
        return ("backend trl: task.overlong_buffer is not supported (pass a length-penalty reward function to TRL "
                "yourself); use backend=native")
    if t.dynamic_sampling:
        return ("backend trl: train.dynamic_sampling is not supported (TRL's GRPOTrainer has no group refill); "
                "use backend=native")
    if t.rollout_lag:
        return ("backend trl: train.rollout_lag is not supported (TRL 1.16's GRPOTrainer samples with the policy it "
                "trains; its AsyncGRPOTrainer came later); use backend=native")
    if t.rollout_correction.mode == "decoupled_ppo":
        return ("backend trl: train.rollout_correction.mode=decoupled_ppo has no TRL counterpart (its "
                "vllm_importance_sampling_mode has the token_* and sequence_* modes); use backend=native")
    if trl_extra_args().get("use_vllm") and run.model.name == "tiny":
        return ("backend trl: vLLM cannot load the tiny model; use a hub id, a local model directory or "
                "smollm2-135m-instruct")
    own = sorted(k for k in trl_extra_args() if k.startswith("vllm_importance_sampling"))
    if own:
        return (f"backend trl: set the rollout correction with train.rollout_correction (mapped onto TRL's "
                f"vllm_importance_sampling_* options and recorded in the run id), not RLVR_TRL_ARGS ({', '.join(own)})")
    if OmegaConf.select(t, "rollout_correction.rejection", default=None):
        return ("backend trl: train.rollout_correction.rejection (trust-region masking) is not mapped onto TRL's "
                "importance sampling; use backend=native")
    if sampler_dtype(run) is not None:
        return ("backend trl: model.sampler_dtype is not supported (TRL samples with the policy, or with vLLM: "
                "RLVR_TRL_ARGS='{\"use_vllm\": true}'); use backend=native")
    if run.model.lora.export_merged and world_size() > 1:
        return ("backend trl: model.lora.export_merged merges the adapters on one process (a sharded model's weights "
                "are not gathered for it); merge final/ afterwards with peft's merge_and_unload, or run on one process")
    objective = get_objective(run.objective.name, **OmegaConf.to_container(run.objective.params))
    estimator = estimator_name(run.objective.name, run.objective.advantage)
    if loop_inputs(get_advantage(estimator)):
        return (f"backend trl: advantage estimator {estimator!r} reads what only the native loop provides (the old "
                "policy's sum of pi^2, a greedy baseline rollout, the reference's completions, the reward's "
                "components); use backend=native")
    if objective.needs_minibatch_at_once() and minibatch // micro > 1:
        return (f"backend trl: objective {run.objective.name!r} needs statistics of the whole minibatch, and TRL "
                "accumulates micro-batches; use train.micro_batch_size=0 on one process, or backend=native")
    whole = ("compares the samples of a group" if objective.needs_whole_groups else "normalises by each prompt's "
             "tokens in the minibatch (aggregation prompt_mean)" if objective.aggregation == "prompt_mean" else None)
    if whole and minibatch // micro * t.num_minibatches > 1:
        return (f"backend trl: objective {run.objective.name!r} {whole}, and TRL splits groups across "
                "micro-batches; use train.num_minibatches=1 with whole-batch micro-batches on one process, or "
                "backend=native")
    return None
