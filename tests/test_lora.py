"""LoRA adapters (model.lora, harness/policy/lora.py) on both backends: only the adapters train, the adapted policy
starts as its base (B = 0) and that base is the KL reference, the objective's math is a full run's on the same
log-probs (the adapters' gradient is the full weight gradient projected through A), the sampler decodes with the
adapters merged, checkpoints hold the adapters and resume exactly, final/ loads with peft."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from harness.loop.batch import TrainBatch, collect_batch
from harness.loop.behaviour import behaviour_logprobs
from harness.loop.build import build_learner, setup_run
from harness.loop.native import train, update
from harness.loop.update import Learner, RunState, UpdatePlan, microbatch_loss, minibatches
from harness.policy.decode import Matmul
from harness.policy.forward import completion_logprobs
from harness.policy.lora import (
    adapted,
    export_merged,
    load_trained_state,
    lora_settings,
    merged_linear,
    trained_state,
    with_adapters,
)
from harness.policy.models import load_model
from harness.run.config import LoraSettings, load_experiment, run_configs
from harness.run.errors import ConfigError
from harness.run.records import read_jsonl
from tests.helpers.interrupt import stopped_before
from tests.helpers.tiny import TINY_SPEC, tiny_run, without_timing

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]
LORA = ("model.lora.rank=4",)
SHAPED = ("task.overlong_buffer=6", "train.steps=1")  # unequal rewards in the random model's groups: a gradient


def lora_layers(model) -> dict[str, torch.nn.Module]:
    """The adapted model's LoRA layers by their name in the base model."""
    import peft

    return {name: m for name, m in model.get_base_model().named_modules() if isinstance(m, peft.tuners.lora.Linear)}


def first_batch(run, cfg) -> TrainBatch:
    """Step 1's batch of a run as the native loop builds it (rollout, rewards, behaviour and reference log-probs,
    advantages)."""
    t = cfg.train
    collected = collect_batch(run.sampler, run.tokenizer, run.task, run.train_problems, cfg, 1)
    ro = collected.rollout
    group_ids = torch.arange(t.prompts_per_step).repeat_interleave(t.group_size)
    behaviour = behaviour_logprobs(run.policy, run.reference, ro, cfg, False)
    advantages = run.estimator(collected.rewards, group_ids, ro.completion_mask.sum(-1))
    return TrainBatch(ro, collected.rewards, advantages, group_ids, behaviour.old_logp, behaviour.ref_logp)


def first_loss(cfg, batch: TrainBatch | None = None):
    """The run's setup, learner, batch and the first micro-batch's loss (backward done)."""
    torch.manual_seed(cfg.seed)
    run = setup_run(cfg, CPU)
    learner = build_learner(run.policy, run.objective, cfg.train)
    batch = batch or first_batch(run, cfg)
    plan = UpdatePlan.of(batch, cfg, 1)
    minibatch = next(minibatches(plan, torch.Generator().manual_seed(0)))
    learner.policy.train()
    part = microbatch_loss(learner, plan, minibatch, minibatch.rows, RunState(), with_entropy=True)
    return run, learner, batch, part


def test_only_the_adapters_get_gradients_and_the_optimizer(tmp_path):
    cfg = tiny_run(tmp_path, *LORA, *SHAPED)
    run, learner, _, _ = first_loss(cfg)
    assert adapted(run.policy)
    named = dict(run.policy.named_parameters())
    adapters = {n for n in named if ".lora_A." in n or ".lora_B." in n}
    assert adapters and {n for n, p in named.items() if p.requires_grad} == adapters
    assert {n for n, p in named.items() if p.grad is not None} == adapters
    assert any(named[n].grad.abs().sum() > 0 for n in adapters if ".lora_B." in n)
    trained = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert trained == {id(named[n]) for n in adapters}


def test_the_no_grad_forwards_that_stand_for_the_policy_draw_no_dropout(tmp_path):
    """With LoRA dropout the update trains the policy in train mode; the recomputed old (proximal) log-probs, the
    rollout corrections' and R2's input, are the policy's own: the same forward twice gives the same log-probs, those
    of the policy in eval mode, and the policy's mode is left as it was (they were one dropout draw each, from the
    second step on)."""
    from harness.loop.behaviour import no_grad_logprobs

    cfg = tiny_run(tmp_path, *LORA, *SHAPED, "model.lora.dropout=0.5", "train.old_logp=recompute")
    torch.manual_seed(cfg.seed)
    run = setup_run(cfg, CPU)
    for layer in lora_layers(run.policy).values():  # adapters that act (B = 0 would hide the dropout)
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    ro = first_batch(run, cfg).rollout
    run.policy.train()  # as the update leaves it
    first, second = (no_grad_logprobs(run.policy, ro, cfg.train)[0] for _ in range(2))
    assert run.policy.training and torch.equal(first, second)
    run.policy.eval()
    assert torch.equal(first, no_grad_logprobs(run.policy, ro, cfg.train)[0])
    run.policy.train()
    with torch.no_grad():  # the same rows in train mode: dropout draws, so the test can see it
        args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, cfg.train.temperature)
        assert not torch.equal(completion_logprobs(run.policy, *args)[0], completion_logprobs(run.policy, *args)[0])


def test_p3os_statistics_pass_is_the_policys_own_under_dropout(tmp_path):
    """P3O's ESS over a micro-batched minibatch comes from a no-grad pass of the current policy: with LoRA dropout in
    train mode (as the update runs) it is the policy's own, the same twice and equal to the eval-mode pass, and the
    policy is left in train mode (it was one dropout draw per minibatch)."""
    from harness.loop.update import with_statistics

    cfg = tiny_run(tmp_path, *LORA, *SHAPED, "model.lora.dropout=0.5", "objective.name=p3o",
                   "train.micro_batch_size=4")
    torch.manual_seed(cfg.seed)
    run = setup_run(cfg, CPU)
    for layer in lora_layers(run.policy).values():  # adapters that act (B = 0 would hide the dropout)
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    learner = build_learner(run.policy, run.objective, cfg.train)
    plan = UpdatePlan.of(first_batch(run, cfg), cfg, 1)
    minibatch = next(minibatches(plan, torch.Generator().manual_seed(0)))
    assert len(plan.microbatches(minibatch)) > 1  # the pass runs only on a split minibatch
    learner.policy.train()
    first, second = (with_statistics(learner, plan, minibatch, RunState()).stats for _ in range(2))
    assert learner.policy.training
    learner.policy.eval()
    own = with_statistics(learner, plan, minibatch, RunState()).stats
    assert first.keys() == own.keys() and first
    for key in own:
        assert torch.equal(first[key], second[key]) and torch.equal(first[key], own[key]), key


def test_with_b_zero_the_first_steps_logprobs_are_the_base_models(tmp_path):
    """The adapted policy starts as its base, bit for bit: the trainer's log-probs, the sampler's (merged weights,
    W + 0), and the reference's (the same policy, adapters disabled; no second copy of the weights)."""
    cfg = tiny_run(tmp_path, *LORA, *SHAPED, "objective.params.beta=0.04")
    torch.manual_seed(cfg.seed)
    run = setup_run(cfg, CPU)
    assert run.reference is run.policy and run.sampler is run.policy
    base, _ = load_model("tiny", tiny=TINY_SPEC, seed=0)
    batch = first_batch(run, cfg)
    ro = batch.rollout
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    with torch.no_grad():
        adapted_logp, base_logp = (completion_logprobs(m, *args)[0] for m in (run.policy, base))
    assert torch.equal(adapted_logp, base_logp)
    assert torch.equal(batch.ref_logp, base_logp)
    torch.manual_seed(cfg.seed)
    base_ro = collect_batch(base, run.tokenizer, run.task, run.train_problems, cfg, 1).rollout
    assert torch.equal(base_ro.completion_ids, ro.completion_ids) and torch.equal(base_ro.sampler_logp,
                                                                                  ro.sampler_logp)


def test_the_reference_is_the_base_with_the_adapters_disabled(tmp_path):
    cfg = tiny_run(tmp_path, *LORA, *SHAPED, "objective.params.beta=0.04", "train.old_logp=recompute")
    run, _, batch, _ = first_loss(cfg)
    for name, p in run.policy.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p, std=0.5)  # trained adapters: the policy moves, its reference does not
    base, _ = load_model("tiny", tiny=TINY_SPEC, seed=0)
    ro = batch.rollout
    behaviour = behaviour_logprobs(run.policy, run.reference, ro, cfg, False)
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    with torch.no_grad():
        base_logp = completion_logprobs(base, *args)[0]
    assert torch.equal(behaviour.ref_logp, base_logp)
    assert not torch.allclose(behaviour.old_logp, base_logp)  # the recomputed policy is the adapted one


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["grpo", "gspo"])
def test_a_lora_runs_objective_math_equals_a_full_runs_on_the_same_logprobs(tmp_path, objective):
    """On the same batch the LoRA run's loss and metrics are the full run's exactly (its log-probs are the base's at
    B = 0, its reference the base with adapters disabled, the full run's a frozen copy), and each adapter's
    gradient is the full weight gradient G through the adapter: dL/dB = s G A^T, dL/dA = s B^T G = 0."""
    settings = (*SHAPED, f"objective.name={objective}", "objective.params.beta=0.04")
    full_run, _, batch, full = first_loss(tiny_run(tmp_path, *settings))
    lora_run, _, _, lora = first_loss(tiny_run(tmp_path, *settings, *LORA), batch)
    assert lora.loss == full.loss and lora.metrics == full.metrics and full.metrics["kl_ref"] >= 0
    weights = dict(full_run.policy.named_parameters())
    layers = lora_layers(lora_run.policy)
    assert len(layers) == 7 * TINY_SPEC["num_layers"]
    for name, layer in layers.items():
        gradient, a = weights[f"{name}.weight"].grad, layer.lora_A["default"].weight
        scale = layer.scaling["default"]
        torch.testing.assert_close(layer.lora_B["default"].weight.grad, scale * gradient @ a.T, rtol=1e-4,
                                   atol=1e-7)
        assert torch.equal(layer.lora_A["default"].weight.grad, torch.zeros_like(a))


def test_the_decoders_matmul_merges_the_adapters_and_follows_disabling():
    model, _ = load_model("tiny", tiny=TINY_SPEC, seed=0)
    base = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    policy = with_adapters(model, OmegaConf.structured(LoraSettings(rank=4)), seed=0)
    layer = policy.get_base_model().model.layers[0].self_attn
    torch.nn.init.normal_(layer.q_proj.lora_B["default"].weight, std=0.5)
    x = torch.randn(3, TINY_SPEC["hidden_size"])
    merged = Matmul(layer.q_proj, layer.k_proj)
    assert merged.kind == "stacked"
    with torch.no_grad():
        torch.testing.assert_close(merged(x), torch.cat([layer.q_proj(x), layer.k_proj(x)], -1))
        assert not torch.allclose(merged(x)[:, : len(base)], x @ base.T)
        with policy.disable_adapter():
            plain = Matmul(layer.q_proj)
            assert plain.kind == "modules" and torch.equal(plain(x), x @ base.T)


def test_the_adapters_scale_defaults_to_2_and_model_seed_draws_them_leaving_the_random_stream_as_it_was():
    assert lora_settings(OmegaConf.structured(LoraSettings(rank=4))).lora_alpha == 8  # null: 2 x rank
    assert lora_settings(OmegaConf.structured(LoraSettings(rank=4, alpha=3))).lora_alpha == 3
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    drawn = [next(iter(lora_layers(with_adapters(load_model("tiny", tiny=TINY_SPEC, seed=0)[0],
                                                 OmegaConf.structured(LoraSettings(rank=4)), seed=seed)).values()))
             .lora_A["default"].weight for seed in (7, 7, 8)]  # model.seed draws A
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], drawn[2])


def test_a_merged_linear_with_a_bias_computes_as_the_adapted_layer():
    """Biased projections (the Qwen2 family's q/k/v) keep their bias in the merged map the decoder and the export
    use."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    adapted = get_peft_model(torch.nn.Sequential(torch.nn.Linear(6, 5, bias=True)),
                             LoraConfig(r=2, lora_alpha=4, target_modules=["0"])).eval()
    layer = adapted.get_base_model()[0]
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    weight, bias = merged_linear(layer)
    x = torch.randn(3, 6)
    with torch.no_grad():
        torch.testing.assert_close(torch.nn.functional.linear(x, weight, bias), layer(x))


def test_a_checkpoint_missing_an_adapter_is_refused():
    policy = with_adapters(load_model("tiny", tiny=TINY_SPEC, seed=0)[0], OmegaConf.structured(LoraSettings(rank=4)),
                           seed=0)
    state = trained_state(policy)
    load_trained_state(policy, state)
    with pytest.raises(RuntimeError, match="missing"):
        load_trained_state(policy, dict(list(state.items())[1:]))
    with pytest.raises(RuntimeError, match="unexpected"):
        load_trained_state(policy, {**state, "base_model.model.extra.lora_A.weight": torch.zeros(1)})


def test_lora_settings_are_checked_in_one_line(tmp_path):
    for overrides, message in ((["model.lora.rank=-1"], "model.lora.rank must be >= 0"),
                               (["model.lora.export_merged=true"], "model.lora.export_merged .* needs model.lora.rank"),
                               ([*LORA, "model.lora.dropout=1.0"], r"model.lora.dropout must be in \[0, 1\)"),
                               ([*LORA, "model.lora.alpha=0"], "model.lora.alpha must be > 0"),
                               ([*LORA, "model.lora.target_modules=[]"], "model.lora.target_modules must name")):
        with pytest.raises(ConfigError, match=message):
            tiny_run(tmp_path, *overrides)
    with pytest.raises(ConfigError, match=r"model.lora.target_modules=\['qkv'\]: .*not found"):
        setup_run(tiny_run(tmp_path, *LORA, "model.lora.target_modules=[qkv]"), CPU)


def test_target_modules_are_a_set_of_layers(tmp_path):
    """[q_proj,v_proj] and [v_proj,q_proj] (or [q_proj,q_proj] and [q_proj]) gave the same adapters, the same metrics,
    under two run ids: in one folder two cells neither could compare, in a grid the same run twice (the seventh
    hostile pass). The order makes one run id; a layer listed twice is refused."""
    from harness.run.config import run_id

    ids = {run_id(tiny_run(tmp_path, *LORA, f"model.lora.target_modules={targets}"))
           for targets in ("[q_proj,v_proj]", "[v_proj,q_proj]")}
    assert len(ids) == 1
    assert run_id(tiny_run(tmp_path, *LORA, "model.lora.target_modules=[q_proj]")) not in ids
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules lists q_proj more than once: list each layer "
                       "once$"):
        tiny_run(tmp_path, *LORA, "model.lora.target_modules=[q_proj,q_proj]")


@pytest.mark.parametrize("model, targets, said", [
    ("tiny", "[nonexistent]", "Target modules {'nonexistent'} not found in the base model"),
    ("tiny", "[q_proj,nonexistent]", "nonexistent matches no module of tiny"),  # peft alone ignores it
    ("tiny", "[q_proj,proj]", "proj matches no module of tiny"),  # a name's tail, not a module's last part
    ("tiny_moe", "[q_proj,qkv,gate_proj,up_proj]", "qkv matches no module of tiny_moe"),
    ("tiny_moe", "[q_proj,gate_proj]", "without also targeting up_proj"),  # fused in the experts' stacked weights
    ("tiny", "[q_proj,lm_head]", "lm_head is the model's embeddings or LM head, which stay frozen"),  # (tied here)
    ("tiny", "[embed_tokens]", "embed_tokens is the model's embeddings or LM head"),
    ("tiny", "[mlp]", "it names a LlamaMLP block, not a linear layer peft can adapt;"),  # was cut mid-repr
])
def test_target_modules_the_model_lacks_are_refused_before_the_run_folder(tmp_path, capsys, model, targets, said):
    from harness.apps.cli import main
    from tests.helpers.tiny import TINY_RUN
    from tests.helpers.tiny_moe import TINY_MOE_RUN

    assert main(["train", "base", *(TINY_RUN if model == "tiny" else TINY_MOE_RUN), *LORA,
                 f"model.lora.target_modules={targets}", f"results_dir={tmp_path / 'results'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: model.lora.target_modules=") and said in err and err.count("\n") == 1, err
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("targets, rank, said", [
    ("[q_proj,gate_proj]", 33, "model.lora.rank=33 is above 32, the smaller side of model.layers.0.mlp.gate_proj "
     "(64 x 32)"),
    ("[gate_proj]", 100000, "above 32, the smaller side of model.layers.0.mlp.gate_proj (64 x 32)")])
def test_a_rank_above_a_layers_smaller_side_is_refused_before_the_run_folder(tmp_path, capsys, targets, rank, said):
    """B A on a layer of m x n has rank at most min(m, n): a larger rank only adds parameters and memory (100000 on
    SmolLM2's 210 adapted layers would allocate tens of GB before the first step)."""
    from harness.apps.cli import main
    from harness.run.config import load_experiment, run_configs, validate
    from tests.helpers.tiny import TINY_RUN

    args = ["train", "base", *TINY_RUN, f"model.lora.target_modules={targets}", f"results_dir={tmp_path / 'r'}"]
    assert main([*args, f"model.lora.rank={rank}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and said in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()
    validate(run_configs(load_experiment("base", [*TINY_RUN, f"model.lora.target_modules={targets}",
                                                  "model.lora.rank=32"]))[0])  # full rank: taken


@pytest.mark.parametrize("targets, bound, said", [
    ("[down_proj]", 16, "down_proj (4 experts of 32 x 16)"), ("[gate_proj,up_proj]", 32, "gate_up_proj (4 experts of "
                                                                                         "32 x 32)")])
def test_a_rank_above_an_experts_smaller_side_is_refused(targets, bound, said):
    """peft adapts a Mixture of Experts' stacked experts each at the rank (B_e A_e per expert): the rank bound skipped
    them, so a rank above an expert's smaller side was taken (the fourteenth hostile pass)."""
    from harness.run.config import load_experiment, run_configs

    shape = ["model.name=tiny_moe", "model.tiny={hidden_size: 32, num_heads: 2, num_layers: 1, num_experts: 4, "
             "expert_intermediate_size: 16}", f"model.lora.target_modules={targets}"]
    with pytest.raises(ConfigError, match=rf"^model.lora.rank={bound + 1} is above {bound}, the smaller side of "
                                          rf"model.layers.0.mlp.experts.{re.escape(said)}, a layer it adapts"):
        run_configs(load_experiment("base", [*shape, f"model.lora.rank={bound + 1}"]))
    run_configs(load_experiment("base", [*shape, f"model.lora.rank={bound}"]))  # full rank: taken


@pytest.mark.slow
def test_a_mixture_of_experts_merged_export_is_the_adapted_policy(tmp_path):
    """peft's LoRA over tiny_moe's stacked expert weights is no linear layer: the merged export falls back to peft's
    merge of a copy, the policy untouched."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = load_model("tiny_moe", seed=0)
    policy = with_adapters(model, OmegaConf.structured(LoraSettings(rank=4)), seed=0)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(5, 90, (2, 10))
    with torch.no_grad():
        before = policy(ids).logits
        export_merged(policy, tokenizer, tmp_path / "merged")
        assert torch.equal(policy(ids).logits, before)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        torch.testing.assert_close(merged(ids).logits, before, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # whole runs: make test
def test_a_killed_lora_run_resumes_exactly_from_its_adapters(tmp_path):
    run = tiny_run(tmp_path, *LORA, "train.steps=3", "task.overlong_buffer=6", "objective.params.beta=0.04")
    train(run, tmp_path / "full", progress=False)
    with stopped_before(3):
        train(run, tmp_path / "part", progress=False)
    checkpoint = torch.load(tmp_path / "part" / "checkpoints" / "last.pt", weights_only=True)  # plain tensors
    assert checkpoint["policy"] and all(".lora_A." in k or ".lora_B." in k for k in checkpoint["policy"])
    assert len(checkpoint["optimizer"]["state"]) == len(checkpoint["policy"])  # AdamW's moments of the adapters
    train(run, tmp_path / "part", progress=False)
    full = without_timing(read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    part = without_timing(read_jsonl(tmp_path / "part" / "metrics.jsonl"))
    assert [r["step"] for r in part] == [0, 1, 2, 3] and part == full
    assert full[3]["kl_ref"] > 0 and full[3]["grad_norm"] > 0


@pytest.mark.slow  # a whole run: make test
def test_final_holds_adapters_peft_loads_and_the_merged_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from harness.policy.sampler import generate

    run = tiny_run(tmp_path, *LORA, *SHAPED, "model.lora.export_merged=true", "train.lr=0.05")
    train(run, tmp_path / "run", progress=False)
    final = tmp_path / "run" / "final"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    base, tokenizer = load_model("tiny", tiny=TINY_SPEC, seed=0)
    loaded = PeftModel.from_pretrained(base, final).eval()
    trained, _ = load_model("tiny", tiny=TINY_SPEC, seed=0)
    trained = with_adapters(trained, run.model.lora, seed=0)
    load_trained_state(trained, torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["policy"])
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    ro = generate(trained, tokenizer, ["12+34=\n"], group_size=2, max_new_tokens=6)
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    with torch.no_grad():
        expected, peft_logp, merged_logp, base_logp = (completion_logprobs(m, *args)[0] for m in (
            trained, loaded, merged, load_model("tiny", tiny=TINY_SPEC, seed=0)[0]))
    assert torch.equal(peft_logp, expected)
    torch.testing.assert_close(merged_logp, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base_logp, expected, atol=1e-4)  # the adapters moved the policy
    # docs/lora.md's script, as written, on this run's folder: the policy it loads is the trained one
    block = re.search(r"```python\n(.*?)```", (REPO / "docs" / "lora.md").read_text(), flags=re.S).group(1)
    namespace = {}
    exec(compile(block.replace("results/<exp>/<run_id>", str(tmp_path / "run")), "docs/lora.md", "exec"), namespace)
    with torch.no_grad():
        assert torch.equal(completion_logprobs(namespace["policy"].eval(), *args)[0], expected)


@pytest.mark.slow  # a TRL trainer built and stepped: make test
def test_the_trl_backends_adapters_loss_and_gradient_are_the_native_loops(fixed, tmp_path):
    """TRL's peft_config makes the native loop's adapters (A from model.seed); with them perturbed, the loss and
    the adapters' gradient on a fixed batch equal the native update's; a KL term is computed (TRL disables the
    adapters for it), with no reference model."""
    from objectives import get_objective
    from tests.helpers.trl import (
        GradCapture,
        NoSchedule,
        assert_same,
        loss_and_grad,
        make_trainer,
        run_config,
        trl_inputs,
    )

    model, _, _, _, ro, old_logp, ref_logp, rewards, group_ids, advantages = fixed
    run = run_config(tmp_path, *LORA, "objective.params.beta=0.04")
    torch.manual_seed(run.model.seed)
    trainer = make_trainer(fixed, run, tmp_path, peft_config=lora_settings(run.model.lora))
    native = with_adapters(copy.deepcopy(model), run.model.lora, seed=run.model.seed)
    assert trainer.beta == 0.04 and trainer.ref_model is None
    trl_state, native_state = (dict(m.named_parameters()) for m in (trainer.model, native))
    assert {n for n, p in trl_state.items() if p.requires_grad} == {n for n, p in native_state.items()
                                                                     if p.requires_grad}
    generator = torch.Generator().manual_seed(1)
    for name, p in native_state.items():
        if ".lora_" in name:
            assert torch.equal(trl_state[name], p), name
            if ".lora_B." in name:
                p.data.normal_(0, 0.1, generator=generator)
                trl_state[name].data.copy_(p.data)
    capture = GradCapture(native)
    batch = TrainBatch(ro, rewards, advantages, group_ids, old_logp, ref_logp)
    result = update(Learner(native, get_objective("grpo", beta=0.04), capture, NoSchedule()),
                    UpdatePlan.of(batch, run, 1), RunState(total_optimizer_steps=1))
    loss, grads = loss_and_grad(trainer, trl_inputs(fixed))
    assert_same(result["loss"], capture.grads, loss, grads)
    assert set(grads) == {n for n, p in native_state.items() if p.requires_grad}


@pytest.mark.slow  # TRL runs: make test
def test_a_killed_trl_lora_run_resumes_exactly_and_exports_its_adapters(tmp_path):
    from harness.loop.trl_backend import train_trl
    from tests.helpers.trl import run_config

    # the entropy bonus moves the adapters whatever the rewards (the random model's are all 0)
    run = run_config(tmp_path, *LORA, "train.steps=3", "train.lr=0.05", "objective.params.beta=0.04",
                     "objective.params.entropy_coef=0.5", "model.lora.export_merged=true")
    train_trl(run, tmp_path / "full", progress=False)
    with stopped_before(3):
        train_trl(run, tmp_path / "part", progress=False)
    train_trl(run, tmp_path / "part", progress=False)
    full = without_timing(read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    assert without_timing(read_jsonl(tmp_path / "part" / "metrics.jsonl")) == full
    assert [r["step"] for r in full] == [0, 1, 2, 3] and full[3]["kl_ref"] > 0
    final = tmp_path / "full" / "final"
    assert (final / "adapter_model.safetensors").is_file() and (final / "merged" / "model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()


@pytest.mark.slow  # a TRL run: make test
def test_trls_sampler_and_no_grad_forwards_draw_no_dropout(tmp_path, monkeypatch):
    """Trainer leaves the policy in train mode: under LoRA dropout TRL generated with a dropout draw of the policy
    and its old-policy log-probs were another (natively the sampler and the recomputed log-probs are the policy's
    own). Now only the loss forwards train."""
    from trl import GRPOTrainer

    from harness.loop.trl_backend import train_trl
    from tests.helpers.trl import run_config

    modes = []

    def spy(name, real):
        def call(self, *args, **kwargs):  # the policy's mode as TRL's own method sees it
            generate = name == "generate"  # TRL's generation turns gradients off inside
            model = self.model if generate else args[0]
            modes.append((name, None if generate else torch.is_grad_enabled(), model.training))
            return real(self, *args, **kwargs)
        return call

    for name, method in (("generate", "_generate_single_turn"), ("logp", "_get_per_token_logps_and_entropies")):
        monkeypatch.setattr(GRPOTrainer, method, spy(name, getattr(GRPOTrainer, method)))
    run = run_config(tmp_path, *LORA, "model.lora.dropout=0.5", "train.steps=1", "train.num_minibatches=2")
    train_trl(run, tmp_path / "run", progress=False)
    assert {("generate", None, False), ("logp", False, False), ("logp", True, True)} == set(modes)


@pytest.mark.slow  # the embedded SmolLM2, three short runs: make test
def test_a_smollm2_lora_run_resumes_exactly_and_exports_its_adapters(tmp_path):
    from peft import PeftConfig

    (run,) = run_configs(load_experiment("base", [
        "model.name=smollm2-135m-instruct", "model.lora.rank=8", "task.eval_size=2", "train.prompts_per_step=2",
        "train.group_size=2", "train.max_new_tokens=8", "train.num_minibatches=1", "train.steps=2", "threads=1",
        "train.eval_every=0", "objective.params.entropy_coef=0.1", "train.lr=1e-3", f"results_dir={tmp_path}"]))
    train(run, tmp_path / "full", progress=False)
    with stopped_before(2):
        train(run, tmp_path / "part", progress=False)
    train(run, tmp_path / "part", progress=False)
    full = without_timing(read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    assert without_timing(read_jsonl(tmp_path / "part" / "metrics.jsonl")) == full and full[2]["grad_norm"] > 0
    # the resumed step 2's update (its optimizer state restored, not restarted) gives the same adapters
    adapters = [load_file(tmp_path / name / "final" / "adapter_model.safetensors") for name in ("full", "part")]
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    adapters = PeftConfig.from_pretrained(tmp_path / "full" / "final")
    assert adapters.r == 8 and set(adapters.target_modules) == set(LoraSettings().target_modules)
