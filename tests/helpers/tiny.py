"""The tiny test model and run settings, defined once for every test module."""

from __future__ import annotations

from harness.run.config import load_experiment, run_configs
from harness.run.records import TIMING_METRICS

TINY_SPEC = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
TINY_RUN = [
    *(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items()), "task.eval_size=8", "train.prompts_per_step=4",
    "train.group_size=4", "train.max_new_tokens=8", "train.num_minibatches=2", "train.steps=2", "train.eval_every=0",
    "threads=1", "train.lr=1e-3",
]

# The random tiny model answers no problem, so with TINY_RUN alone every reward, advantage and gradient is 0: a test
# that a resumed run equals the uninterrupted one could not see a weight or an optimizer state lost. The overlong
# penalty (completions past 8 - 6 = 2 tokens lose reward) varies with each completion's length: gradients that are
# not 0. The native loop's (TRL's backend refuses the penalty).
VARIED_REWARD = "task.overlong_buffer=6"
KEEP = "train.keep_checkpoints=true"  # a test that reads previous.pt or the optimizer of an ended run (else removed)


def tiny_run(tmp_path, *overrides):
    """One validated run of the default experiment with the tiny settings, writing under ``tmp_path``."""
    (run,) = run_configs(load_experiment("base", [*TINY_RUN, f"results_dir={tmp_path}", *overrides]))
    return run


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_METRICS} for r in rows]


def empty_policy_key(task) -> str:
    """The warm start's cache key (harness/policy/warm_start.py) of ``task`` for an empty policy (no config, weights or
    vocabulary): what a task's own settings put into a starting policy's key, and what they leave out."""
    from harness.policy.warm_start import _warm_start_key

    class Stub:
        config = type("C", (), {"to_dict": staticmethod(dict)})()
        dtype = "float32"

        @staticmethod
        def state_dict():
            return {}

    tokenizer = type("T", (), {"get_vocab": staticmethod(dict), "chat_template": None})()
    return _warm_start_key(Stub, tokenizer, task, [])
