"""harness/run/config.py: experiment files, overrides, the sweep's expansion, run ids, and the one-line errors of every
check a config goes through before anything starts (the schema's own and the components' registered ones)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from harness.run.config import (
    _digest,
    _ordered_sets,
    check_this_machine,
    counted_settings,
    edited_after_written,
    flattened,
    load_experiment,
    nested,
    run_configs,
    run_id,
    settings_digest,
)
from harness.run.errors import ConfigError
from harness.run.records import settings_differences


@pytest.mark.parametrize("override, message", [
    (["train.stepz=3"], "unknown config key 'train.stepz'. Did you mean 'train.steps'? Valid keys here: steps,"),
    (["train.steps=abc"], "train.steps"),
    (["objective.name=gspoo"], "Did you mean 'gspo'?"),
    (["objective.name=GRPO"], "Did you mean 'grpo'?"),  # names are lower-case: a capital made no match
    (["objective.params.clip_low=-1"], "clip_low must be >= 0"),
    (["objective.params.eps=0.1"], "has no hyperparameter eps"),
    (["task.name=gsm9k"], "Did you mean 'gsm8k'?"),
    (["train.num_minibatches=3"], "must divide prompts_per_step x group_size"),
    (["model.dtype=fp8"], "model.dtype must be one of"),
    (["sweep.grid.seed=[]"], "zero runs"),
    # a grid's (or a per-objective setting's) keys are checked as the command line's are, at the top level too
    (["sweep.grid.sead=[0,1]"], "unknown config key 'sead'"),
    (["sweep.grid.seed=[0,x]"], "seed"),
    (["sweep.per_objective.gspo={sead: 1}"], "unknown config key 'sead'"),
    (["train.lm_head_chunk=-1"], "train.lm_head_chunk and train.max_tokens_per_micro_batch must be >= 0"),
    (["train.eval_batch_size=0"], "train.eval_batch_size must be >= 1, got 0"),
    (["train.max_tokens_per_micro_batch=512", "train.micro_batch_size=4"], "not both"),
    (["objective.name=clip_cov", "train.max_tokens_per_micro_batch=512"], "needs statistics of the whole minibatch"),
    (["backend=trl", "train.lm_head_chunk=256"], "are the native backend's"),
    (["backend=trl", "train.keep_checkpoints=true"], "train.keep_checkpoints is the native backend's"),
    (["backend=trl", "train.padding_free=false"], "train.padding_free is the native trainer's forward"),
])
@pytest.mark.slow
def test_bad_configs_stop_with_a_clear_error(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        run_configs(load_experiment("quickstart", override))


def test_unknown_experiment_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="Did you mean 'quickstart'\\? Experiments: .*quickstart"):
        load_experiment("quickstrat")


@pytest.mark.parametrize("override, message", [
    ("objective.clip_low=-1", "did you mean objective.params.clip_low?"),
    ("train.stepz=3", "Did you mean 'train.steps'?"),
])
def test_misplaced_keys_get_a_hint(override, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        load_experiment("quickstart", [override])


@pytest.mark.slow
def test_grid_overrides_take_the_dotted_form_a_researcher_types():
    cfg = load_experiment("quickstart", ["sweep.grid.objective.name=[grpo,cispo]", "sweep.grid.seed=[0, 1, 2]"])
    assert [(r.objective.name, r.seed) for r in run_configs(cfg)] == [
        (o, s) for o in ("grpo", "cispo") for s in (0, 1, 2)]


@pytest.mark.slow
def test_sweep_expands_grid_with_per_objective_overrides():
    cfg = load_experiment("quickstart", ["sweep.per_objective.gspo={objective.params.clip_high: 0.001}"])
    runs = run_configs(cfg)
    assert [(r.objective.name, r.seed) for r in runs] == [
        (o, s) for o in ("grpo", "gspo", "gspo_token", "ctpo") for s in (0, 1, 2)]
    assert all((r.objective.params.get("clip_high") == 0.001) == (r.objective.name == "gspo") for r in runs)
    ids = [run_id(r) for r in runs]
    assert len(set(ids)) == len(ids) and ids[0].startswith("grpo-s0-")
    assert ids == [run_id(r) for r in run_configs(cfg)]  # stable


@pytest.mark.slow
def test_a_per_objective_value_of_a_swept_key_pins_that_axis_for_the_objective():
    cfg = load_experiment("quickstart", ["sweep.grid.objective.name=[grpo,gspo]", "sweep.grid.seed=[0]",
                                         "sweep.grid.train.epochs=[1,2]",
                                         "sweep.per_objective.gspo={train.epochs: 2, objective.advantage: null}"])
    assert [(r.objective.name, r.train.epochs) for r in run_configs(cfg)] == [("grpo", 1), ("grpo", 2), ("gspo", 2)]
    assert run_configs(cfg)[-1].objective.advantage is None  # null, not the string 'None'
    arms = {(r.objective.name, r.train.routing_replay) for r in run_configs(load_experiment("moe_stability"))}
    assert arms == {("grpo", "none"), ("grpo", "r2"), ("grpo", "r3"), ("gspo", "none"), ("gspo_token", "none"),
                    ("ctpo", "none")}


def test_run_id_hashes_only_what_differs_from_the_defaults():
    (run,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0"]))
    (spelled_out,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0",
                                                                "train.dynamic_sampling=false", "task.data_dir=null"]))
    (other,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0", "train.lr=1e-6"]))
    assert run_id(run) == run_id(spelled_out) != run_id(other)
    assert run_id(OmegaConf.merge(run, {"results_dir": "elsewhere"})) == run_id(run)


def test_the_experiments_name_is_no_setting_of_a_run(tmp_path):
    """Two experiments asking for the same run give it the same id (`make compare` reuses a sweep's runs); a resume
    does not compare the name either, and still refuses any other setting."""
    from harness.run.records import check_resume

    (run,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0"]))
    (renamed,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0", "name=mine"]))
    assert renamed.name == "mine" and run_id(renamed) == run_id(run)
    folder = tmp_path / run_id(run)
    folder.mkdir()
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(run))
    check_resume(renamed, folder)  # the same run under another experiment's name: resumable
    with pytest.raises(ConfigError, match=r"other settings \(train.lr 5e-05 -> 1e-06\)"):
        check_resume(OmegaConf.merge(renamed, {"train": {"lr": 1e-6}}), folder)


def test_the_sweeps_baseline_is_a_registered_objective():
    assert load_experiment("quickstart", ["sweep.baseline=ctpo"]).sweep.baseline == "ctpo"
    with pytest.raises(ConfigError, match="sweep.baseline: unknown objective 'grpoo'. Did you mean 'grpo'"):
        run_configs(load_experiment("quickstart", ["sweep.baseline=grpoo"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a CUDA device on a machine without one")
def test_cuda_without_a_cuda_torch_is_a_config_error_saying_how_to_install_one():
    """Where the run would execute (check_this_machine's node checks); the config itself expands on any machine (a
    cluster sweep's login node)."""
    runs = run_configs(load_experiment("quickstart", ["device=cuda"]))
    with pytest.raises(ConfigError, match="device=cuda, but .*(make setup TORCH=torch|CUDA_VISIBLE_DEVICES)"):
        check_this_machine(runs[:1])


def test_profile_selects_gpu_scale_settings_and_command_line_still_wins():
    runs = run_configs(load_experiment("gsm8k_ablation", ["profile=gpu", "train.steps=7", "device=cpu"]))
    assert {r.model.name for r in runs} == {"Qwen/Qwen2.5-1.5B-Instruct"} and runs[0].device == "cpu"
    assert runs[0].train.prompts_per_step == 32 and runs[0].train.steps == 7 and runs[0].profile is None
    with pytest.raises(ConfigError, match="profile 'tpu' is not defined"):
        load_experiment("gsm8k_ablation", ["profile=tpu"])


@pytest.mark.slow
def test_the_low_memory_profile_changes_only_the_memory_settings_and_so_keeps_the_run_ids():
    """A run that ran out of memory, swept again with profile=low_memory, is the same run (the memory settings change
    no number beyond round-off: tests/test_edges.py): the same id, so the sweep resumes it."""
    plain = run_configs(load_experiment("gsm8k_ablation"))
    low = run_configs(load_experiment("gsm8k_ablation", ["profile=low_memory"]))
    memory = {"lm_head_chunk": 1024, "activation_checkpointing": True, "eval_batch_size": 16}
    for a, b in zip(plain, low, strict=True):
        assert {k: b.train[k] for k in memory} == memory
        assert OmegaConf.merge(a, {"train": memory}) == b and run_id(a) == run_id(b)


def test_the_run_id_leaves_out_the_memory_settings_but_eval_batch_size_with_pass_at_k():
    """train.eval_batch_size with train.pass_k decides which random numbers each problem's samples draw
    (tests/test_evaluation.py): another run then. train.micro_batch_size changes the logged metrics (the
    objective's metrics are averaged over micro-batches): not a memory setting."""
    (run,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0"]))
    same = ["train.lm_head_chunk=7", "train.activation_checkpointing=true", "train.eval_batch_size=3"]
    assert all(run_id(OmegaConf.merge(run, OmegaConf.from_dotlist([o]))) == run_id(run) for o in same)
    sampled = OmegaConf.merge(run, {"train": {"pass_k": 4}})
    assert run_id(OmegaConf.merge(sampled, {"train": {"eval_batch_size": 3}})) != run_id(sampled) != run_id(run)
    assert run_id(OmegaConf.merge(run, {"train": {"micro_batch_size": 16}})) != run_id(run)


@pytest.mark.slow
def test_the_run_id_leaves_out_the_settings_of_adapters_a_run_does_not_have():
    """At model.lora.rank=0 (no adapters) alpha, dropout and the target modules change nothing: the same run, the
    same id (they made another run folder of the same run); with adapters each is part of the run."""
    (run,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0"]))
    inert = ["model.lora.alpha=6", "model.lora.dropout=0.1", "model.lora.target_modules=[q_proj]"]
    assert all(run_id(OmegaConf.merge(run, OmegaConf.from_dotlist([o]))) == run_id(run) for o in inert)
    adapted = OmegaConf.merge(run, {"model": {"lora": {"rank": 4}}})
    assert run_id(adapted) != run_id(run)
    assert all(run_id(OmegaConf.merge(adapted, OmegaConf.from_dotlist([o]))) != run_id(adapted) for o in inert)
    with pytest.raises(ConfigError, match=r"sweep.grid.model.lora.alpha: 8 and 16 make the same run \(LoRA's "
                       r"settings change nothing at model.lora.rank=0 \(no adapters\)\)"):
        run_configs(load_experiment("base", ["sweep.grid.model.lora.alpha=[8,16]"]))
    assert len(run_configs(load_experiment("base", ["model.lora.rank=2", "sweep.grid.model.lora.alpha=[8,16]"]))) == 2


def test_a_run_without_adapters_resumes_with_other_lora_settings_but_not_another_rank(tmp_path):
    """The same run id, so the same run on resume: alpha at rank 0 is no difference; the rank still is."""
    from harness.run.records import check_resume

    (run,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0"]))
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(run))
    check_resume(OmegaConf.merge(run, {"model": {"lora": {"alpha": 6.0}}}), tmp_path)
    with pytest.raises(ConfigError, match=r"other settings \(model.lora.rank 0 -> 4, model.lora.alpha null -> 6"):
        check_resume(OmegaConf.merge(run, {"model": {"lora": {"rank": 4, "alpha": 6.0}}}), tmp_path)


@pytest.mark.parametrize(("inert", "live", "why"), [
    ("train.rollout_correction.threshold=5", "train.rollout_correction.mode=token_mask",
     r"the correction's thresholds change nothing at train.rollout_correction.mode=none"),
    ("train.rollout_correction.threshold_lower=0.5", "train.rollout_correction.mode=token_truncate",
     r"the correction's thresholds change nothing at train.rollout_correction.mode=none"),
    ("objective.params.kl_estimator=k1", "objective.params.beta=0.01",
     r"objective grpo declares kl_estimator inert at these values"),
    ("objective.params.off_policy_mask_threshold=0.7", "objective.params.off_policy_mask=true",
     r"objective grpo declares off_policy_mask_threshold inert at these values"),
])
@pytest.mark.slow
def test_settings_that_change_nothing_are_left_out_of_the_run_id(inert, live, why, tmp_path):
    """A correction's thresholds at mode none and kl_estimator at beta 0 (grpo's own
    declaration) made another run id for the same run, as LoRA's settings at rank 0 did: now the same id, a resume
    that may change them, and a sweep over them refused as the same run; where they act, each is part of the run."""
    from harness.run.records import check_resume

    (run,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0"]))
    assert run_id(OmegaConf.merge(run, OmegaConf.from_dotlist([inert]))) == run_id(run)
    acting = OmegaConf.merge(run, OmegaConf.from_dotlist([live]))
    assert run_id(OmegaConf.merge(acting, OmegaConf.from_dotlist([inert]))) != run_id(acting) != run_id(run)
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(run))
    check_resume(OmegaConf.merge(run, OmegaConf.from_dotlist([inert])), tmp_path)
    key, value = inert.split("=")
    values = {"5": "[5,6]", "0.5": "[0.5,0.25]", "k1": "[k1,k2]", "0.7": "[0.7,0.8]"}[value]
    with pytest.raises(ConfigError, match=rf"sweep.grid.{re.escape(key)}: .* make the same run \({why}\)"):
        run_configs(load_experiment("quickstart", ["sweep.grid.objective.name=[grpo]", f"sweep.grid.{key}={values}"]))


@pytest.mark.parametrize(("grid", "runs"), [
    (["sweep.grid.objective.name=[grpo]", "sweep.grid.train.rollout_correction.mode=[none,token_mask]",
      "sweep.grid.train.rollout_correction.threshold=[2,3]"], 3),
    (["sweep.grid.objective.name=[grpo]", "sweep.grid.objective.params.beta=[0,0.1]",
      "sweep.grid.objective.params.kl_estimator=[k1,k3]"], 3),
    (["sweep.grid.objective.name=[grpo,adaptive_kl]", "sweep.grid.objective.params.kl_estimator=[k1,k3]"], 3),
    # grpo's own estimator spelled out is grpo's run; for a2po (its own: a2po) it is another estimator
    (["sweep.grid.objective.name=[grpo,a2po]", "sweep.grid.objective.advantage=[null,grpo]"], 3),
    (["sweep.grid.objective.name=[grpo,gspo]", "sweep.grid.objective.params.clip_low=[0.2,0.0003]"], 4),
    # '' is each objective's own aggregation: dapo's token_mean, grpo's seq_mean_token_mean (it was written out as
    # `key=`, null, and refused as "must be a string")
    (["sweep.grid.objective.name=[grpo,dapo]", "sweep.grid.objective.params.aggregation=['',token_mean]"], 3),
])
def test_a_setting_that_acts_in_some_of_the_grids_runs_makes_one_run_where_it_does_not(grid, runs):
    """A threshold crossed with mode=[none, token_mask] (or kl_estimator with beta=[0, 0.1]) was refused as 'the same
    run twice; list each value once', which no grid of the two axes could satisfy (the sixth hostile pass): the
    inert corner is one run. adaptive_kl starts at beta 0.001, so its kl_estimator acts (two runs), grpo's not (one)."""
    made = run_configs(load_experiment("quickstart", ["seed=0", *grid]))
    assert len(made) == runs and len({run_id(run) for run in made}) == runs


@pytest.mark.slow
def test_a_grid_over_an_objectives_own_value_and_its_default_is_refused_as_the_same_run():
    with pytest.raises(ConfigError, match=r"^sweep.grid.objective.advantage: null and grpo make the same run "
                       r"\(objective grpo's own is grpo\); list each value once$"):
        run_configs(load_experiment("quickstart", ["seed=0", "sweep.grid.objective.name=[grpo]",
                                                   "sweep.grid.objective.advantage=[null,grpo]"]))
    with pytest.raises(ConfigError, match=r"null and grpo make the same run"):  # another estimator acting beside them
        run_configs(load_experiment("quickstart", ["seed=0", "sweep.grid.objective.name=[grpo,gspo]",
                                                   "sweep.grid.objective.advantage=[null,grpo,opo]"]))


@pytest.mark.slow
def test_an_alias_whose_defining_setting_is_undone_is_refused_naming_its_parent():
    """luspo is gspo with aggregation=seq_mean_token_sum; luspo with aggregation=token_mean was accepted and ran gspo
    under luspo's name (the sixth hostile pass): a sweep would compare gspo with itself under two names."""
    with pytest.raises(ConfigError, match=r"^objective.name=luspo is gspo with aggregation=seq_mean_token_sum, and "
                       r"objective.params.aggregation=token_mean undoes it: that is objective.name=gspo with "
                       r"objective.params.aggregation=token_mean \(a sweep grid over aggregation: leave luspo out, "
                       r"gspo's runs cover its values\)$"):
        run_configs(load_experiment("quickstart", ["objective.name=luspo", "objective.params.aggregation=token_mean"]))
    with pytest.raises(ConfigError, match=r"^objective.name=bnpo is grpo with aggregation=token_mean, and "):
        run_configs(load_experiment("quickstart", ["objective.name=bnpo",
                                                   "objective.params.aggregation=seq_mean_token_mean"]))
    # its mirror in a sweep: gspo given luspo's setting beside luspo ran one computation twice under two names, then
    # compared the two (the seventh hostile pass)
    with pytest.raises(ConfigError, match=r"^the sweep runs luspo-s0-\w+ and gspo-s0-\w+, one computation under two "
                       r"names \(luspo is gspo with aggregation=seq_mean_token_sum\): leave luspo out, or gspo's "
                       r"aggregation=seq_mean_token_sum$"):
        run_configs(load_experiment("quickstart", [
            "sweep.grid.objective.name=[luspo,gspo]", "seed=0",
            "sweep.per_objective={gspo: {objective.params.aggregation: seq_mean_token_sum}}"]))
    assert len(run_configs(load_experiment("quickstart", ["sweep.grid.objective.name=[luspo,gspo]", "seed=0"]))) == 2
    # the alias's own value, given again, or another setting changed: still the alias
    for params in (["objective.params.aggregation=seq_mean_token_sum"], ["objective.params.clip_high=0.01"], []):
        runs = run_configs(load_experiment("quickstart", ["objective.name=luspo", *params]))
        assert {run.objective.name for run in runs} == {"luspo"}


def test_where_results_go_is_not_an_objectives_own_setting():
    """sweep.per_objective={gspo: {results_dir: ...}} was accepted: the run was written in the sweep's folder, its
    config.yaml recorded the other folder (the sixth hostile pass)."""
    for key in ("results_dir", "name", "logging.project"):
        with pytest.raises(ConfigError, match=rf"^sweep.per_objective.gspo.{re.escape(key)}: where results go and "
                           rf"where metrics are sent are the sweep's, not one objective's; set {re.escape(key)} for"):
            run_configs(load_experiment("quickstart", [f"sweep.per_objective={{gspo: {{{key}: x}}}}"]))


@pytest.mark.slow
def test_inherit_puts_an_experiment_underneath_and_refuses_cycles(tmp_path):
    quick, trl = (run_configs(load_experiment(name))[0] for name in ("quickstart", "trl_quickstart"))
    assert trl.backend == "trl" and trl.train.save_every == 5
    assert (trl.model, trl.task, trl.train.steps, trl.train.lr) == (quick.model, quick.task, 20, quick.train.lr)
    (tmp_path / "a.yaml").write_text(f"inherit: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"inherit: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(ConfigError, match="makes a cycle"):
        load_experiment(str(tmp_path / "a.yaml"))
    (tmp_path / "c.yaml").write_text("inherit: [quickstart, base]\n")  # was looked for as "['quickstart', 'base']"
    with pytest.raises(ConfigError, match=r"c.yaml: inherit takes one experiment \(a name or a .yaml path\), got "
                       r"\['quickstart', 'base'\]$"):
        load_experiment(str(tmp_path / "c.yaml"))




@pytest.mark.parametrize("override, message", [
    ("train.lr=-1", "train.lr must be >= 0"),
    ("task.eval_size=0", "eval_size must be an integer >= 1"),
    ("task.eval_set=-1", "eval_set must be an integer >= 0"),
    ("task.args.eval_set=1", r"^task.args.eval_set: give it as task.eval_set, not among the task's own arguments"),
    ("task.args.eval_size=8", r"^task.args.eval_size: give it as task.eval_size, not among"),
    ("task.name=reasoning_gym task.args={} task.eval_set=1",
     r"^task.eval_set=1: task 'reasoning_gym' has one held-out set \(no eval_set argument\); leave "
     r"task.eval_set at 0$"),
    ("task.args.digit=3", "has no argument digit"),
    ("model.tiny.hidden=8", "model.tiny has no field hidden"),
    ("model.tiny.num_heads=3", "a multiple of num_heads"),
    ("train.group_size=1", "makes every advantage 0"),
    ("objective.params.top_entropy_quantile=0.2 train.micro_batch_size=4", "needs statistics of the whole minibatch"),
    ("model.warm_start_target=[0.5,0.2]", "warm_start_target must be"),
    ("train.rollout_correction.mode=token_clip", "train.rollout_correction.mode must be one of none, "),
    ("train.rollout_correction.threshold=0.5", "train.rollout_correction.threshold must be a finite number >= 1"),
    ("train.decoder=flash", "train.decoder must be one of auto, shared_prefix, per_row, cache"),
    ("train.compile_sampler=true train.decoder=shared_prefix", "compiles the native sampler's per-row or cache"),
])
@pytest.mark.slow
def test_settings_that_would_fail_or_train_nothing_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        run_configs(load_experiment("quickstart", override.split()))


@pytest.mark.slow
def test_replacing_the_task_replaces_its_arguments():
    (run,) = run_configs(load_experiment("quickstart", ["task.name=gsm8k", "seed=0", "objective.name=grpo"]))
    assert run.task.args == {}
    (run,) = run_configs(load_experiment("quickstart", ["task.args={}", "seed=0", "objective.name=grpo"]))
    assert run.task.args == {}
    # another task with arguments of its own: those, not the experiment's (arith's digits, ...) as well
    (run,) = run_configs(load_experiment("quickstart", ["task.name=reasoning_gym", "task.args.dataset=chain_sum",
                                                        "seed=0", "objective.name=grpo"]))
    assert run.task.args == {"dataset": "chain_sum"}
    (run,) = run_configs(load_experiment("quickstart", ["task.name=arith", "task.args.digits=3", "seed=0",
                                                        "objective.name=grpo"]))  # the same task: merged
    assert run.task.args == {"num_operands": 2, "digits": 3, "operators": "+-"}


@pytest.mark.slow
def test_a_misspelt_generator_of_another_task_is_named_not_the_experiments_arguments():
    with pytest.raises(ConfigError) as error:
        run_configs(load_experiment("quickstart", ["task.name=reasoning_gym", "task.args.dataset=chain_summ"]))
    assert "Did you mean 'chain_sum'" in str(error.value) and "digits" not in str(error.value)
    with pytest.raises(ConfigError) as error:  # the task's arguments with their defaults, a factory's too
        run_configs(load_experiment("quickstart", ["task.name=reasoning_gym", "task.args.digit=3"]))
    assert "params={}" in str(error.value) and "MISSING" not in str(error.value)
    assert not str(error.value).startswith("task 'reasoning_gym': task")  # the task named once


def test_a_warm_start_band_without_steps_names_both_settings_of_no_warm_start():
    with pytest.raises(ConfigError, match=r"model.warm_start_steps=0 model.warm_start_target=null$"):
        run_configs(load_experiment("quickstart", ["model.warm_start_steps=0"]))




@pytest.mark.parametrize("text, kind", [("- train.steps: 3\n- seed: 1\n", "not a list"), ("42\n", "not the int '42'"),
                                        ("grpo\n", "not the str 'grpo'")])
def test_an_experiment_file_whose_top_level_is_not_a_mapping_is_one_config_error_naming_it(tmp_path, text, kind):
    from harness.run.config import load_experiment

    path = tmp_path / "exp.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{path}: the top level must be a mapping of settings .*{kind}$"):
        load_experiment(str(path))


def test_an_empty_experiment_file_is_the_defaults_as_base_yaml_is(tmp_path):
    from harness.run.config import load_experiment

    (tmp_path / "empty.yaml").write_text("# nothing but a comment\n")
    cfg = load_experiment(str(tmp_path / "empty.yaml"))
    assert cfg.train.steps == load_experiment("base").train.steps and cfg.name == "empty"


@pytest.mark.slow
def test_a_command_line_value_that_leaves_an_objective_without_runs_is_refused_naming_it():
    """moe_stability pins train.routing_replay=none for gspo, gspo_token and ctpo; train.routing_replay=r2 on the
    command line pins the grid's axis to r2: 3 of 18 runs would remain, the three objectives dropped silently."""
    with pytest.raises(ConfigError, match=r"^sweep.per_objective pins train.routing_replay=none for gspo, gspo_token, "
                       r"ctpo, .*: gspo, gspo_token, ctpo would have no run; run the others alone with "
                       r"sweep.grid.objective.name=\[grpo\], or include the pinned value$"):
        run_configs(load_experiment("moe_stability", ["train.routing_replay=r2"]))
    alone = run_configs(load_experiment("moe_stability", ["train.routing_replay=r2",
                                                          "sweep.grid.objective.name=[grpo]"]))
    assert [(r.objective.name, r.train.routing_replay, r.seed) for r in alone] == [("grpo", "r2", s) for s in range(3)]


@pytest.mark.parametrize("grid, message", [
    ("sweep.grid.seed=[0,0]", r"sweep.grid.seed lists 0 more than once: the same run twice; list each value once"),
    ("sweep.grid.train.lr=[1e-4,0.0001]", r"sweep.grid.train.lr: 1e-4 and 0.0001 make the same run \(equal once "
     r"parsed\)"),
    ("sweep.grid.train.lr=[1.0e-4,0.0001]", r"sweep.grid.train.lr lists 0.0001 more than once"),
    ("sweep.grid.objective.name=[grpo,gspo,grpo]", r"sweep.grid.objective.name lists grpo more than once"),
    ("sweep.grid.train.activation_checkpointing=[false,true]", r"false and true make the same run \(a memory "
     r"setting changes no number, so it is not part of the run id\)"),
    ("sweep.grid.results_dir=[/tmp/a,/tmp/b]", r"^sweep.grid.results_dir: where results go and where metrics are "
     r"sent are not part of a run, so its values make the same runs; run one sweep per value \(results_dir=...\)$"),
    ("sweep.grid.name=[qa,qb]", r"^sweep.grid.name: where results go .*run one sweep per value \(name=...\)$"),
])
def test_two_grid_points_that_make_the_same_run_are_refused_in_one_line(grid, message):
    """Each would be one run folder counted as two runs ("2/2 runs finished" for one run)."""
    with pytest.raises(ConfigError, match=message) as info:
        run_configs(load_experiment("base", [grid]))
    assert "\n" not in str(info.value)


def test_a_float_hyperparameter_written_as_an_integer_is_that_float_in_the_run_id_the_cells_and_a_resume():
    """``objective.params.beta=1`` computes what ``=1.0`` computes (the objective converts it): one run id, one cell,
    a resume of the one by the other, one grid point; an integer hyperparameter and another value stay apart."""
    def run(*overrides):
        (only,) = run_configs(load_experiment("base", list(overrides)))
        return only

    one, other = (run(f"objective.params.beta={v}", "objective.params.clip_high=1") for v in ("1", "1.0"))
    assert run_id(one) == run_id(other) != run_id(run("objective.params.beta=2", "objective.params.clip_high=1"))
    flat_one, flat_other = (flattened(OmegaConf.to_container(c)) for c in (one, other))
    assert flat_one["objective.params.beta"] == 1 and isinstance(flat_one["objective.params.beta"], int)
    assert counted_settings(flat_one) == counted_settings(flat_other)
    assert settings_digest(flat_one) == settings_digest(flat_other)
    assert settings_differences(OmegaConf.to_container(one), other) == {}
    with pytest.raises(ConfigError, match=r"^sweep.grid.objective.params.beta lists 1.0 more than once"):
        run_configs(load_experiment("base", ["sweep.grid.objective.params.beta=[1,1.0]"]))
    horizon = {"objective.name": "adaptive_kl", "objective.params.kl_horizon": 5}
    assert counted_settings(horizon) == horizon  # an integer hyperparameter stays an integer


def test_the_runs_of_a_sweep_share_no_node_and_keep_the_schemas_types():
    """run_configs copies the merged base once per run and moves the run's sections out of it: a change to one run
    reaches no other run, nor a later expansion of the same config; each section keeps its schema type (a misspelt
    key is refused, a value of the wrong type too)."""
    cfg = load_experiment("base", ["sweep.grid.seed=[0,1]"])
    first, second = run_configs(cfg)
    first.train.lr, first.objective.params.beta = 0.5, 0.25
    first.model.lora.target_modules.append("lm_head")
    again = run_configs(cfg)[1]
    for run in (second, again):
        assert run.train.lr != 0.5 and "beta" not in run.objective.params
        assert "lm_head" not in run.model.lora.target_modules
    assert OmegaConf.get_type(second.train).__name__ == "TrainConfig" and "sweep" not in second
    with pytest.raises(Exception, match="lrr"):
        second.train.lrr = 1.0
    with pytest.raises(Exception, match="steps"):
        second.train.steps = "many"


def test_a_run_that_recorded_the_digest_of_its_integer_spelling_is_not_called_edited():
    """Older code digested ``beta: 1`` as written (sets ordered): that digest still matches its config.yaml."""
    flat = {"objective.name": "grpo", "objective.params.beta": 1, "train.lr": 1e-4,
            "model.lora.target_modules": ["v_proj", "q_proj"]}
    older = _digest(flattened(_ordered_sets(nested(dict(flat)))))
    assert older != settings_digest(flat)
    assert not edited_after_written(flat, {"settings_digest": older})
    assert edited_after_written({**flat, "train.lr": 2e-4}, {"settings_digest": older})


@pytest.mark.slow
def test_train_old_logp_is_no_part_of_a_run_where_the_loop_recomputes_the_behaviour_log_probs():
    """Under a rollout correction, trust-region rules or routing replay the loop recomputes the behaviour log-probs
    whatever train.old_logp says: a grid over it made two runs of one computation, bit-equal, compared as two cells,
    and replay with or without old_logp=recompute had two run ids (the thirteenth hostile pass)."""
    with pytest.raises(ConfigError, match=r"^sweep.grid.train.old_logp: .*train.old_logp changes nothing where the "
                       r"loop recomputes the behaviour log-probs \(a rollout correction, trust-region rules or "
                       r"routing replay\)") as info:
        run_configs(load_experiment("base", ["train.rollout_correction.mode=token_mask",
                                             "sweep.grid.train.old_logp=[sampler,recompute]"]))
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"train.old_logp changes nothing"):
        run_configs(load_experiment("base", ["train.rollout_correction.rejection=[token_k3]",
                                             "train.rollout_correction.rejection_threshold=[0.1]",
                                             "sweep.grid.train.old_logp=[sampler,recompute]"]))
    pinned = ["sweep.grid.objective.name=[grpo]", "train.routing_replay=r2", "sweep.grid.seed=[0]"]
    ids = {run_id(run) for old in ("sampler", "recompute")
           for run in run_configs(load_experiment("moe_stability", [*pinned, f"train.old_logp={old}"]))}
    assert len(ids) == 1
    plain = [run_id(run) for old in ("sampler", "recompute")  # without any of them it decides: two runs
             for run in run_configs(load_experiment("base", [f"train.old_logp={old}"]))]
    assert len(set(plain)) == 2


@pytest.mark.slow
def test_trust_region_rules_in_any_order_or_with_one_bound_each_are_one_run(tmp_path):
    """A token must pass every rule, so [token_k2, token_k3] and [token_k3, token_k2], and one bound for all rules
    against the same bound per rule, are one computation: they had two run ids, two cells of one run (the fourteenth
    hostile pass). A run begun with one spelling continues with the other."""
    from harness.run.records import check_resume

    base = ["train.rollout_correction.rejection_threshold=[2.0]"]
    spellings = [[*base, "train.rollout_correction.rejection=[token_k2,token_k3]"],
                 [*base, "train.rollout_correction.rejection=[token_k3,token_k2]"],
                 ["train.rollout_correction.rejection=[token_k3,token_k2]",
                  "train.rollout_correction.rejection_threshold=[2,2.0]"]]
    runs = [run_configs(load_experiment("base", spelling))[0] for spelling in spellings]
    assert len({run_id(run) for run in runs}) == 1
    other = run_configs(load_experiment("base", ["train.rollout_correction.rejection=[token_k3,token_k2]",
                                                 "train.rollout_correction.rejection_threshold=[2.0,3.0]"]))[0]
    swapped = run_configs(load_experiment("base", ["train.rollout_correction.rejection=[token_k2,token_k3]",
                                                   "train.rollout_correction.rejection_threshold=[3.0,2.0]"]))[0]
    assert run_id(other) == run_id(swapped) != run_id(runs[0])  # each bound stays with its rule
    with pytest.raises(ConfigError, match=r"same run"):
        run_configs(load_experiment("base", [*base, "sweep.grid.train.rollout_correction.rejection="
                                                    "[[token_k2,token_k3],[token_k3,token_k2]]"]))
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(runs[0]))
    check_resume(runs[2], tmp_path)  # the same settings: no refusal


def test_a_grid_the_per_objective_pins_leave_empty_says_so():
    with pytest.raises(ConfigError, match=r"sweep.per_objective pins train.routing_replay=none for gspo") as info:
        run_configs(load_experiment("moe_stability", ["objective.name=gspo", "train.routing_replay=r2"]))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("override, message", [
    ("train.lr=.nan", r"train.lr is NaN: give a number"),
    ("train.lr=.inf", r"train.lr is inf: give a finite number"),
    ("objective.params.clip_low=.nan", r"objective.params.clip_low is NaN: give a number"),
    ("model.warm_start_lr=.nan", r"model.warm_start_lr is NaN"),
    # infinity passed `> 0` and `>= 0`: a run that sampled uniformly and trained nothing, rewards of NaN read as the
    # objective's collapse, LoRA weights scaled to inf (the thirteenth hostile pass)
    ("train.temperature=.inf", r"^train.temperature is inf: give a finite number$"),
    ("task.format_weight=.inf", r"^task.format_weight is inf: give a finite number$"),
    ("task.overlong_penalty=.inf", r"^task.overlong_penalty is inf: give a finite number$"),
    ("model.lora.alpha=.inf", r"^model.lora.alpha is inf: give a finite number$"),
    # a grid's point was written back as `inf`, which YAML reads as text: "must be a number, got 'inf' (str)"
    ("sweep.grid.objective.params.clip_low=[.inf,0.2]", r"grid points at objective.params.clip_low=.inf: "
                                                        r"objective.params.clip_low is inf: give a finite number$"),
    ("sweep.grid.objective.params.clip_low=[-.inf,0.2]", r"grid points at objective.params.clip_low=-.inf: "
                                                         r"objective.params.clip_low is -inf: give a finite number$"),
    ("sweep.grid.objective.params.clip_low=[.nan,0.2]", r"objective.params.clip_low is NaN: give a number$"),
])
@pytest.mark.slow
def test_a_nan_or_infinite_setting_is_refused_before_the_run_starts(override, message):
    """`train.lr=.nan` fails the range check before anything starts, not in torch's optimizer with a run folder and a
    traceback file (docs/hostile_pass.md, case 42)."""
    with pytest.raises(ConfigError, match=message):
        run_configs(load_experiment("quickstart", [override]))


def test_an_infinite_gradient_norm_bound_means_no_clipping_and_is_taken():
    assert run_configs(load_experiment("quickstart", ["train.max_grad_norm=.inf"]))[0].train.max_grad_norm == math.inf


def test_a_missing_experiment_file_is_named_as_given(tmp_path):
    """`train /nonexistent.yaml` names the file it looked for as given, not /nonexistent.yaml.yaml
    (docs/hostile_pass.md, case 58)."""
    with pytest.raises(ConfigError, match=rf"^no experiment file {tmp_path / 'x.yaml'} \(not there\)\. Give") as e:
        load_experiment(str(tmp_path / "x.yaml"))
    assert ".yaml.yaml" not in str(e.value) and "Did you mean" not in str(e.value)
    # an experiment's file name given as its name (run from another folder than the checkout): the name is offered
    with pytest.raises(ConfigError, match=r"^no experiment file quickstart.yaml \(not there\)\. Did you mean the "
                       r"experiment 'quickstart' \(.*experiments/quickstart.yaml\)\?"):
        load_experiment("quickstart.yaml")
    # a path without .yaml is not a name either: it was looked for as /dev/null.yaml
    with pytest.raises(ConfigError, match=r"^no experiment '/dev/null': give an experiment's name \(.*quickstart.*\) "
                       "or the path of a file ending in .yaml$"):
        load_experiment("/dev/null")


@pytest.mark.parametrize("override", ["train.steps=[1,", "sweep.grid.seed=[1,",
                                      "sweep.grid.objective.name=[grpo,,cispo]",  # make compare OBJECTIVES=grpo,,cispo
                                      "train.steps=" + "9" * 5000, "sweep.grid.seed=[" + "9" * 5000 + "]"])  # > 4300
# digits: Python's int() limit, a ValueError from the YAML parser
def test_an_override_that_does_not_parse_is_named_alone_in_one_line(override):
    """The error names the one override that does not parse, not every override and the YAML parser's three lines
    (docs/hostile_pass.md, case 65)."""
    with pytest.raises(ConfigError) as e:
        load_experiment("quickstart", ["train.steps=3", override, "seed=0"])
    shown = override if len(override) <= 200 else f"{override[:100]}...{override[-20:]}"
    assert str(e.value).startswith(f"bad override {shown!r}: ") and "\n" not in str(e.value), str(e.value)


def test_two_overrides_that_parse_alone_but_clash_are_named_as_a_pair():
    """`train=[] train.steps=6 ...` quoted the whole list of overrides as one (the twelfth hostile pass)."""
    with pytest.raises(ConfigError, match=r"^bad override 'train=\[\] with train.steps=6': "):
        load_experiment("quickstart", ["seed=0", "train=[]", "task.eval_size=8", "train.steps=6"])


@pytest.mark.parametrize("override, message", [
    ("model.lora.target_modules=q_proj",
     "model.lora.target_modules takes a list: give model.lora.target_modules=[a,b]"),
    ("logging.backends=jsonl", "logging.backends takes a list: give logging.backends=[a,b]"),
    ("logging.project=", "logging.project takes a value: give logging.project=<value> (nothing after = means null"),
])
def test_a_scalar_for_a_list_or_nothing_for_a_value_says_what_to_give(override, message):
    """Not OmegaConf's "AnyNode is not a ListConfig, TupleConfig, list, or tuple" / "Incompatible value 'None'"."""
    with pytest.raises(ConfigError) as e:
        load_experiment("quickstart", [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_a_value_given_to_a_whole_section_names_the_section(tmp_path):
    """`train: 3` says what the section must be, not 'Merge error: int is not a subclass of TrainConfig'
    (docs/hostile_pass.md, case 62)."""
    (tmp_path / "x.yaml").write_text("train: 3\n")
    for args in [(str(tmp_path / "x.yaml"),), ("quickstart", ["model=tiny"])]:
        with pytest.raises(ConfigError, match=r"^(train|model) is a section of settings, not a value: got "):
            load_experiment(*args)
    with pytest.raises(ConfigError, match=r"^train.rollout_correction is a section of settings, not a value: got "
                       r"train.rollout_correction=none; give its keys \(e.g. train.rollout_correction.<key>=..."):
        load_experiment("quickstart", ["train.rollout_correction=none"])  # named its class RolloutCorrectionConfig


@pytest.mark.parametrize("text, section", [("train: []\n", "train"), ("train:\n  - steps: 3\n", "train"),
                                           ("sweep:\n  grid: [1]\n", "sweep.grid")])
def test_a_list_for_a_section_an_inherited_experiment_has_is_named_in_one_line(tmp_path, text, section):
    """Over `inherit:` it was omegaconf's traceback (TypeError: Cannot merge incompatible container types)."""
    (tmp_path / "x.yaml").write_text("inherit: quickstart\n" + text)
    with pytest.raises(ConfigError, match=rf"x.yaml: {section} is a section of settings in quickstart, not a value or "
                       r"a list: give its keys as a mapping") as info:
        load_experiment(str(tmp_path / "x.yaml"))
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_a_sweep_refusing_some_of_its_runs_names_their_grid_values():
    """A grid value refused for some runs (a negative learning rate; a model too large for this machine's memory)
    named no grid point: with several values of several keys the user could not tell which run was refused. A
    setting every run shares is refused as before, in its own words."""
    with pytest.raises(ConfigError, match=r"^12 of the sweep's 24 grid points at train\.lr=-1: train\.lr must be >= 0"):
        run_configs(load_experiment("quickstart", ["sweep.grid.train.lr=[1e-4,-1]"]))
    with pytest.raises(ConfigError, match=r"^train\.lr must be >= 0"):
        run_configs(load_experiment("quickstart", ["sweep.grid.train.lr=[-1,-2]"]))
    runs = run_configs(load_experiment("quickstart", ["sweep.grid.model.tiny.hidden_size=[128,262144]",
                                                      "sweep.grid.seed=[0]", "sweep.grid.objective.name=[grpo,gspo]"]))
    with pytest.raises(ConfigError, match=r"^2 of the sweep's 4 runs at model\.tiny\.hidden_size=262144: model 'tiny' "
                                          r"takes at least"):
        check_this_machine(runs)
    check_this_machine([runs[0]])
    with pytest.raises(ConfigError, match=r"^model 'tiny' takes at least"):
        check_this_machine([runs[1]])
    # refused for two reasons: the first refused run's whole grid point, and the count
    runs = run_configs(load_experiment("quickstart", ["sweep.grid.model.tiny.hidden_size=[128,262144]",
                                                      "sweep.grid.train.group_size=[8,400000000]",
                                                      "sweep.grid.seed=[0]", "sweep.grid.objective.name=[grpo]"]))
    with pytest.raises(ConfigError, match=r"^the sweep's run at model\.tiny\.hidden_size=128, "
                                          r"train\.group_size=400000000 \(3 of the sweep's 4 runs refused\): "):
        check_this_machine(runs)


def test_a_refusal_names_only_the_grid_values_that_tell_its_runs_apart():
    """A hostile pass: a NaN grid value was left out of the named values (NaN != NaN), a key of one objective's
    per_objective settings was named for another objective's runs that lack it (as null), and a grid key of one
    value (seed=0) was named though every run shares it."""
    with pytest.raises(ConfigError, match=r"^4 of the sweep's 8 grid points at train\.lr=\.nan: train\.lr is NaN"):
        run_configs(load_experiment("quickstart", ["sweep.grid.train.lr=[.nan,5e-5]", "sweep.grid.seed=[0]"]))
    runs = run_configs(load_experiment("quickstart", [
        "sweep.grid.objective.name=[grpo,gspo]", "sweep.grid.seed=[0,1]",
        "sweep.per_objective={grpo: {objective.params.clip_high: 0.28}, gspo: {model.tiny.hidden_size: 10000000}}"]))
    with pytest.raises(ConfigError, match=r"^2 of the sweep's 4 runs at model\.tiny\.hidden_size=10000000, "
                                          r"objective\.name=gspo: model 'tiny' takes at least"):
        check_this_machine(runs)


@pytest.mark.slow
def test_a_per_objective_setting_on_the_command_line_pins_the_grid_as_one_in_the_experiment_file():
    """sweep.per_objective.gspo.train.lr=1e-4 on the command line became nested keys ({train: {lr: ...}}) that no
    grid key matched: gspo ran at both of the grid's learning rates, silently (a hostile pass). And a pin written
    as a mapping (sweep.per_objective.gspo={train.lr: 1e-4}) was read by another parser than the grid's 1e-4, so the
    two did not match and the sweep was refused."""
    grid = ["sweep.grid.train.lr=[1e-3,1e-4]", "sweep.grid.objective.name=[grpo,gspo]"]
    for pin in ("sweep.per_objective.gspo.train.lr=1e-4", "sweep.per_objective.gspo={train.lr: 1e-4}"):
        runs = run_configs(load_experiment("quickstart", [*grid, pin]))
        assert sorted({(r.objective.name, r.train.lr) for r in runs}) == [("grpo", 1e-4), ("grpo", 1e-3),
                                                                          ("gspo", 1e-4)]
    runs = run_configs(load_experiment("quickstart", ["sweep.per_objective.gspo.objective.params.clip_high=0.001"]))
    assert {r.objective.name: r.objective.params.get("clip_high") for r in runs}["gspo"] == 0.001


def test_a_large_grid_is_said_before_its_points_are_checked(monkeypatch, capsys):
    """A grid of thousands of seeds was checked in silence before anything printed (the twelfth hostile pass)."""
    from harness.run import config

    monkeypatch.setattr(config, "MANY_POINTS", 3)
    run_configs(load_experiment("quickstart", ["sweep.grid.seed=[0,1]"]))  # 4 objectives x 2 seeds
    assert capsys.readouterr().err == "checking the 8 points of the grid before any run starts (a few ms each)\n"
    run_configs(load_experiment("quickstart", ["sweep.grid.seed=[0]", "sweep.grid.objective.name=[grpo]"]))
    assert capsys.readouterr().err == ""


def test_an_empty_mapping_for_a_section_is_refused_not_merged_into_nothing():
    """`sweep.grid={}` merged into quickstart's grid and ran all 12 runs (the twelfth hostile pass)."""
    with pytest.raises(ConfigError, match=r"sweep.grid=\{\}: an empty mapping merges into sweep.grid and changes "
                                          "nothing; .*one run of a sweep: give each grid key one value"):
        load_experiment("quickstart", ["sweep.grid={}"])
    with pytest.raises(ConfigError, match=r"sweep.per_objective=\{\}: an empty mapping merges into"):
        load_experiment("quickstart", ["sweep.per_objective={}"])
    assert load_experiment("quickstart", ["task.args={}"]).task.args == {}  # there {} replaces the task's arguments


@pytest.mark.parametrize("swept, pinned", [("sweep.grid.objective.name=[grpo,gspo]", "objective.name=cispo"),
                                           ("sweep.grid.seed=[0,1]", "seed=7")])
def test_a_key_one_command_line_both_sweeps_and_pins_is_refused(swept, pinned):
    """make compare OBJECTIVES=grpo,gspo OVERRIDES=objective.name=cispo ran cispo alone: the pin took the grid the
    same command line gave (a hostile pass). A pin of an experiment file's axis still pins it."""
    key = pinned.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key} is given twice on the command line: .* sweeps it and {pinned} "
                                          "pins it; give one"):
        load_experiment("quickstart", [swept, pinned])
    assert list(load_experiment("quickstart", [pinned]).sweep.grid[key]) == [yaml.safe_load(pinned.partition("=")[2])]


def test_lora_alpha_at_twice_the_rank_is_the_run_of_alpha_null(tmp_path):
    """alpha null stands for 2 x rank (harness/policy/lora.py): written out, it is the same run (one id, one folder, a
    resume of either with the other), and a grid over both is refused as one run; another alpha is another run."""
    from harness.run.records import check_resume

    (run,) = run_configs(load_experiment("quickstart", ["objective.name=grpo", "seed=0", "model.lora.rank=8"]))
    written = OmegaConf.merge(run, {"model": {"lora": {"alpha": 16}}})
    assert run_id(written) == run_id(run) == run_id(OmegaConf.merge(run, {"model": {"lora": {"alpha": 16.0}}}))
    assert run_id(OmegaConf.merge(run, {"model": {"lora": {"alpha": 8}}})) != run_id(run)
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(run))
    check_resume(written, tmp_path)
    with pytest.raises(ConfigError, match=r"model.lora.alpha null -> 32"):
        check_resume(OmegaConf.merge(run, {"model": {"lora": {"alpha": 32}}}), tmp_path)
    with pytest.raises(ConfigError, match=r"sweep.grid.model.lora.alpha: null and 16 make the same run \(null stands "
                       r"for 2 x model.lora.rank\)"):
        run_configs(load_experiment("base", ["model.lora.rank=8", "sweep.grid.model.lora.alpha=[null,16]"]))
