"""One fixed rollout batch of the tiny model and the TRL trainer built around it, shared by the TRL backend's tests
and the rollout correction's (the ``fixed`` fixture in tests/conftest.py)."""

from __future__ import annotations

import copy
import dataclasses

import torch
from omegaconf import OmegaConf

from harness.loop.trl_backend import RegistryGRPOTrainer, grpo_config, problems_dataset, reward_functions
from harness.policy.models import build_prompt, load_model
from harness.policy.sampler import generate
from harness.run.config import load_experiment, run_configs
from harness.tasks import get_task
from objectives import get_advantage, get_objective
from tests.helpers.tiny import TINY_SPEC

PROMPTS, GROUP, MAX_NEW = 4, 4, 8
OVERRIDES = [*(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items()), "task.eval_size=8",
             f"train.prompts_per_step={PROMPTS}", f"train.group_size={GROUP}", f"train.max_new_tokens={MAX_NEW}",
             "train.num_minibatches=1", "train.max_grad_norm=1e9", "train.eval_every=0", "train.steps=1", "threads=1",
             "device=cpu", "backend=trl"]


def run_config(tmp_path, *overrides):
    (run,) = run_configs(load_experiment("base", [*OVERRIDES, f"results_dir={tmp_path}", *overrides]))
    return run


def fixed_batch():
    """A tiny policy (kept pristine), its tokenizer, the task, and one fixed rollout batch with perturbed
    behaviour / reference log-probs, random binary rewards and GRPO advantages."""
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC, seed=0)
    task = get_task("arith", eval_size=8)
    pool = task.train_problems()[:100]
    shortest, longest = (f(pool, key=lambda p: len(p.question)) for f in (min, max))
    problems = [shortest, longest, *pool[: PROMPTS - 2]]  # prompts of different lengths: left padding
    ro = generate(model, tokenizer, [build_prompt(tokenizer, p.question) for p in problems for _ in range(GROUP)],
                  max_new_tokens=MAX_NEW, temperature=1.0)
    # completions of different lengths, as if they had ended at random points (EOS is rare for a random model)
    width = ro.completion_ids.shape[1]
    mask = torch.arange(width) < torch.randint(1, width + 1, (PROMPTS * GROUP, 1))
    ro = dataclasses.replace(ro, completion_mask=mask, sampler_logp=ro.sampler_logp.masked_fill(~mask, 0.0))
    assert len(set(ro.prompt_mask.sum(-1).tolist())) > 1
    old_logp = (ro.sampler_logp + 0.3 * torch.randn(mask.shape)).masked_fill(~mask, 0.0)
    ref_logp = (ro.sampler_logp + 0.3 * torch.randn(mask.shape)).masked_fill(~mask, 0.0)
    rewards = torch.tensor([1.0, 0.0] * (PROMPTS * GROUP // 2))[torch.randperm(PROMPTS * GROUP)]
    group_ids = torch.arange(PROMPTS).repeat_interleave(GROUP)
    advantages = get_advantage("grpo")(rewards, group_ids)
    return model, tokenizer, task, problems, ro, old_logp, ref_logp, rewards, group_ids, advantages


def trl_inputs(fixed) -> dict:
    """The batch as TRL's _generate_and_score_completions hands it to _compute_loss."""
    _, _, _, _, ro, old_logp, ref_logp, rewards, group_ids, advantages = fixed
    return {"prompt_ids": ro.prompt_ids, "prompt_mask": ro.prompt_mask, "completion_ids": ro.completion_ids,
            "completion_mask": ro.completion_mask.long(), "advantages": advantages, "old_per_token_logps": old_logp,
            "ref_per_token_logps": ref_logp, "num_items_in_batch": ro.completion_mask.sum(), "rewards": rewards,
            "group_ids": group_ids}


def make_trainer(fixed, run, tmp_path, cls=RegistryGRPOTrainer, peft_config=None, train=None, **trl_options):
    """The trainer around ``fixed``'s policy; ``train``: the run's train config handed to RegistryGRPOTrainer (its
    rollout correction, as train_trl does)."""
    model, tokenizer, task, problems = fixed[:4]
    extra = {} if peft_config is None else {"peft_config": peft_config}
    if cls is RegistryGRPOTrainer:
        objective = get_objective(run.objective.name, **OmegaConf.to_container(run.objective.params))
        extra.update(objective=objective, estimator=get_advantage(objective.default_advantage), train=train)
    trainer = cls(model=copy.deepcopy(model), reward_funcs=reward_functions(task),
                  args=grpo_config(run, tmp_path / "trl", **trl_options), train_dataset=problems_dataset(
                      problems, tokenizer), processing_class=tokenizer, **extra)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; the built-in losses read it
    return trainer


def loss_and_grad(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


class GradCapture:
    """An 'optimizer' for harness.loop.native.update that keeps the gradient of its step instead of stepping."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}


class NoSchedule:
    """The learning-rate schedule for GradCapture, which takes no step: a torch scheduler needs a real optimizer, and
    one built on an optimizer the loop never steps warns "lr_scheduler.step() before optimizer.step()"."""

    def step(self):
        pass


def assert_same(loss_a, grads_a, loss_b, grads_b):
    assert torch.allclose(torch.as_tensor(loss_a, dtype=torch.float32), loss_b.float(), rtol=1e-4, atol=1e-6), \
        (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    scale = max(g.abs().max() for g in grads_a.values())
    assert scale > 0
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6 * scale), name
