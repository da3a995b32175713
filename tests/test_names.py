"""TRL-style names (harness/run/names.py): one table covering every config key, TRL names checked against the installed
TRL's GRPOConfig, TRL-named overrides rewritten or refused, `explain`, and the generated doc tables."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys

import pytest

from harness.apps.cli import main
from harness.run import names
from harness.run.config import RunConfig, load_experiment, run_configs
from harness.run.errors import ConfigError
from objectives import OBJECTIVES
from tests.helpers.processes import MAKE_ALONE
from tests.helpers.tiny import tiny_run


def test_every_schema_key_has_one_row_and_every_row_is_a_key():
    keys = names.schema_keys()
    rows = [n.key for n in names.NAMES]
    assert len(rows) == len(set(rows)), "a key twice in harness/run/names.py NAMES"
    missing = [k for k in keys if k not in rows]
    assert not missing, f"config keys without a row in harness/run/names.py NAMES: {missing}"
    hyperparameters = {p for o in OBJECTIVES.names() for p in OBJECTIVES.get(o).hyperparameters()}
    extra = [r for r in rows if r not in keys and not (r.startswith("objective.params.") and
                                                       r.rsplit(".", 1)[1] in hyperparameters)]
    assert not extra, f"rows for keys the schema does not have: {extra}"
    assert all(n.meaning and "\n" not in n.meaning for n in names.all_names())
    assert all(names.schema_meanings()[k] for k in keys), "a schema field without its comment (harness/run/config.py)"
    assert not [n.key for n in names.NAMES if n.key in keys and n.meaning], "a meaning written twice: keep the field's"


def test_trl_names_are_grpo_config_fields():
    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    trainer = {"model", "train_dataset", "reward_funcs", "ref_model", "peft_config"}  # GRPOTrainer's arguments /
    # attributes
    mentioned = {word for n in names.NAMES for word in re.findall(r"`([a-z_0-9]+)`", n.trl)} - trainer
    assert mentioned and mentioned <= fields, sorted(mentioned - fields)
    assert set(names.ALIASES) <= fields, sorted(set(names.ALIASES) - fields)
    top_level = {f.name for f in dataclasses.fields(RunConfig)}
    assert not set(names.ALIASES) & top_level  # an alias never shadows one of our own keys


@pytest.mark.slow
def test_trl_named_overrides_become_ours_with_a_note(tmp_path, capsys):
    run = tiny_run(tmp_path, "num_generations=2", "max_completion_length=12", "epsilon=0.3", "beta=0.04",
                   "learning_rate=3e-4", "per_device_train_batch_size=4", "num_iterations=2")
    assert (run.train.group_size, run.train.max_new_tokens, run.train.lr, run.train.micro_batch_size,
            run.train.epochs) == (2, 12, 3e-4, 4, 2)
    assert dict(run.objective.params) == {"clip_low": 0.3, "clip_high": 0.3, "beta": 0.04}  # TRL: high = epsilon
    notes = capsys.readouterr().err.splitlines()
    assert "note: num_generations=2 (TRL) -> train.group_size=2" in notes
    assert "note: epsilon=0.3 (TRL) -> objective.params.clip_low=0.3 objective.params.clip_high=0.3" in notes
    run = tiny_run(tmp_path, "epsilon_high=0.28", "epsilon=0.2", "loss_type=dapo")
    assert dict(run.objective.params) == {"clip_high": 0.28, "clip_low": 0.2, "aggregation": "token_mean"}
    assert tiny_run(tmp_path, "loss_type=cispo", "epsilon_high=5").objective.params.clip_high == 4  # 1 + clip_high
    assert tiny_run(tmp_path, "loss_type=dr_grpo").objective.params.aggregation == "seq_mean_token_sum_norm"
    assert tiny_run(tmp_path, "importance_sampling_level=sequence").objective.name == "gspo"
    run = tiny_run(tmp_path, "scale_rewards=none", "report_to=tensorboard", "use_cpu=true")
    assert (run.objective.advantage, list(run.logging.backends), run.device) == ("mean_only",
                                                                                ["jsonl", "tensorboard"], "cpu")
    assert tiny_run(tmp_path, "objective.name=sapo", "sapo_temperature_neg=2").objective.params.tau_neg == 2
    assert tiny_run(tmp_path, "loss_type=vespo").objective.name == "vespo"
    run = tiny_run(tmp_path, "entropy_coef=0.01", "top_entropy_quantile=0.2", "off_policy_mask_threshold=0.3")
    assert dict(run.objective.params) == {"entropy_coef": 0.01, "top_entropy_quantile": 0.2, "off_policy_mask": True,
                                          "off_policy_mask_threshold": 0.3}
    # the experiment's own objectives decide: quickstart sweeps four, all with clip_low
    runs = run_configs(load_experiment("quickstart", ["epsilon=0.1", f"results_dir={tmp_path}"]))
    assert {r.objective.params.clip_low for r in runs} == {0.1}


@pytest.mark.parametrize("override, message", [
    ("max_steps=100", "max_steps (TRL) has no exact equivalent here: set train.steps (TRL counts optimizer steps"),
    ("loss_type=bnpo", "loss_type=bnpo (TRL): loss_type=bnpo normalises by the local micro-batch"),
    ("loss_type=grpo_plus", "has no objective here; set objective.name"),
    ("loss_type=luspo", "that is objective.name=luspo"),
    ("gradient_accumulation_steps=2", "set train.micro_batch_size"),
    ("report_to=all", "logging.backends=[jsonl,tensorboard,wandb,trackio]"),
])
def test_trl_names_without_an_exact_equivalent_are_refused_naming_ours(tmp_path, override, message):
    with pytest.raises(ConfigError) as error:
        tiny_run(tmp_path, override)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_epsilon_maps_only_where_the_objective_has_it(tmp_path):
    with pytest.raises(ConfigError, match="objective.params.clip_low, which objective sapo does not have"):
        tiny_run(tmp_path, "objective.name=sapo", "epsilon=0.2")
    with pytest.raises(ConfigError, match="TRL's cispo has no lower bound"):
        tiny_run(tmp_path, "objective.name=cispo", "epsilon=0.2")
    with pytest.raises(ConfigError, match="1 \\+ clip_high for TRL's cispo"):
        tiny_run(tmp_path, "sweep.grid.objective.name=[cispo,grpo]", "epsilon_high=5")


def test_a_trl_name_given_as_a_hyperparameter_is_named_with_ours(tmp_path):
    """`objective.params.epsilon=0.2`: TRL's name where ours is wanted; the error says which of ours it is."""
    with pytest.raises(ConfigError) as error:
        tiny_run(tmp_path, "objective.params.epsilon=0.2")
    assert str(error.value).endswith("; `epsilon` is TRL's name: give epsilon=... on its own (translated) or "
                                     "objective.params.clip_low (`python -m harness explain epsilon`)")
    with pytest.raises(ConfigError) as error:
        tiny_run(tmp_path, "objective.params.bogus=0.2")
    assert "TRL's name" not in str(error.value)


def test_explain_prints_meaning_default_trl_and_verl(capsys):
    assert main(["explain", "train.group_size"]) == 0
    out = capsys.readouterr().out
    assert "completions per prompt" in out and "default: 8" in out and "num_generations" in out
    assert "actor_rollout_ref.rollout.n" in out
    assert main(["explain", "clip_ratio_low"]) == 0  # a verl name finds our key
    assert "objective.params.clip_low" in capsys.readouterr().out
    assert main(["explain", "epsilon"]) == 0  # a TRL name: the alias rule too
    out = capsys.readouterr().out
    assert "TRL epsilon on the command line" in out and "grpo 0.2" in out and "gspo 0.0003" in out
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert all(f"{key} = " in out for key in names.schema_keys())
    assert main(["explain", "group_sise"]) == 2
    assert "Did you mean train.group_size?" in capsys.readouterr().err


def test_explain_knows_trls_delta_as_the_dual_clip(capsys):
    """TRL's ``delta`` (two-sided GRPO) is our dual clip: `explain delta` finds clip_ratio_c and dual_clip (it found
    no key, and both rows said TRL had none)."""
    assert main(["explain", "delta"]) == 0
    out = capsys.readouterr().out
    assert "objective.params.clip_ratio_c" in out and "objective.params.dual_clip" in out
    rows = names.by_key()
    assert all("`delta`" in rows[f"objective.params.{key}"].trl for key in ("clip_ratio_c", "dual_clip"))


def test_trls_vespo_names_and_kl_correction_are_ours(capsys):
    """TRL's vespo_k_pos / _lambda_pos / _k_neg / _lambda_neg are vespo's k_pos, ...: `explain` finds them and a TRL
    override is rewritten (they were unknown names); TRL's use_bias_correction_kl (default true: the k3 times the
    ratio) is named on beta's row, whose KL is TRL's with it false."""
    from harness.run.aliases import translate_overrides

    for trl, ours in (("vespo_k_pos", "k_pos"), ("vespo_lambda_pos", "lambda_pos"), ("vespo_k_neg", "k_neg"),
                      ("vespo_lambda_neg", "lambda_neg")):
        assert main(["explain", trl]) == 0 and f"objective.params.{ours}: " in capsys.readouterr().out
        assert translate_overrides(["objective.name=vespo", f"{trl}=1.5"]) == \
            ["objective.name=vespo", f"objective.params.{ours}=1.5"]
        with pytest.raises(ConfigError, match=f"objective.params.{ours}, which objective grpo does not have"):
            translate_overrides(["objective.name=grpo", f"{trl}=1.5"])
    capsys.readouterr()
    assert main(["explain", "use_bias_correction_kl"]) == 0
    assert "objective.params.beta: " in capsys.readouterr().out
    assert "`use_bias_correction_kl` false" in names.by_key()["objective.params.beta"].trl


def test_explain_finds_a_name_the_table_writes_with_its_value(capsys):
    """A TRL or verl name written with a value in a row (`use_kl_loss=true` on beta's, TRL's
    `vllm_importance_sampling_correction=false`, `lr_scheduler_type=constant_with_warmup`) is found like one written
    alone: `explain use_kl_loss` said "no config key, TRL or verl name"."""
    for name, key in (("use_kl_loss", "objective.params.beta"), ("actor_rollout_ref.actor.use_kl_loss",
                                                                  "objective.params.beta"),
                      ("vllm_importance_sampling_correction", "train.rollout_correction.mode"),
                      ("lr_scheduler_type", "train.warmup_steps")):
        assert main(["explain", name]) == 0, name
        assert f"{key}: " in capsys.readouterr().out, name
    assert main(["explain", "use_kl"]) == 2  # a prefix of a name is no name


def test_explain_answers_odd_names_with_the_table_or_a_hint(capsys):
    assert main(["explain", ""]) == 0 and "train.steps = " in capsys.readouterr().out  # the whole table
    assert main(["explain", "TRAIN.STEPS"]) == 2 and "Did you mean train.steps?" in capsys.readouterr().err
    assert main(["explain", "grpo"]) == 2
    assert "grpo is an objective: objective.name=grpo (python -m harness list)." in capsys.readouterr().err
    assert main(["explain", "cispo"]) == 2  # close to clip_low: it suggested objective.params.clip_low
    assert "cispo is an objective: objective.name=cispo (python -m harness list)." in capsys.readouterr().err
    assert main(["explain", "model.lora"]) == 2  # a section: a did-you-mean of some of its keys (the seventh pass)
    assert ("model.lora is a section; its keys: model.lora.rank, model.lora.alpha, " in capsys.readouterr().err)
    assert main(["explain", "model.tiny"]) == 0  # a dict: the keys each tiny model takes (it listed none)
    out = capsys.readouterr().out
    assert "its keys for model.name=tiny (model.tiny.<key>=<value>):\n    hidden_size = 128: residual width" in out
    assert "    top_k = 2: experts each token activates" in out and "    norm_topk_prob = true: " in out
    assert main(["explain", "model.tiny.top_k"]) == 2
    assert "model.tiny is a dict: its keys for each model, their defaults and meanings: python -m harness explain " \
        "model.tiny." in capsys.readouterr().err
    assert main(["explain", "x" * 5000]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 300 and "x" * 77 + "..." in err
    assert main(["explain", "--markdown", "bogus"]) == 2  # a KeyError's traceback
    assert capsys.readouterr().err == ("error: no generated table 'bogus'; the tables: names, aliases, objectives "
                                       "(python -m harness explain --markdown KIND)\n")


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_explain_passes_the_key():
    done = subprocess.run(["make", "-n", "explain", "KEY=num_generations", f"PY={sys.executable}"], cwd=names.REPO,
                          capture_output=True, text=True, env=MAKE_ALONE)  # PY: a copy may have no .venv
    assert done.returncode == 0 and "-m harness explain num_generations" in done.stdout


def test_the_generator_writes_each_doc_table_between_its_markers(tmp_path, monkeypatch, capsys):
    """The generated tables are the generator's business (`make docs` writes them): it fills each file's marked blocks
    with the tables and leaves the rest of the file alone. A committed copy is not compared with the registry, so a
    new objective needs no edit of docs/trl.md or README.md (README's objectives table is one of them)."""
    assert names.DOCS[names.REPO / "README.md"] == ("objectives",)
    copies = {}
    for path, kinds in names.DOCS.items():
        text = path.read_text()
        for kind in kinds:
            assert names.section(text, kind) is not None, f"{path.name} lost its generated {kind} block's markers"
            start, end = names.markers(kind)
            text = text.split(start)[0] + start + "\nstale\n" + end + text.split(end)[1]
        copy = tmp_path / path.name
        copy.write_text(text)
        copies[copy] = kinds
    assert names.write_docs(copies) == list(copies)
    for copy, kinds in copies.items():
        written, original = copy.read_text(), next(p for p in names.DOCS if p.name == copy.name).read_text()
        for kind in kinds:
            assert names.section(written, kind) == names.generated(kind)
            start, end = names.markers(kind)
            assert written.split(start)[0].split("-->")[-1] == original.split(start)[0].split("-->")[-1]
            assert written.split(end)[1].split("<!--")[0] == original.split(end)[1].split("<!--")[0]
    assert names.write_docs(copies) == []  # written once, nothing to change
    monkeypatch.setattr(names, "DOCS", copies)
    for copy, kinds in copies.items():
        copy.write_text(copy.read_text().replace(names.generated(kinds[0]), "stale\n"))
    from harness.apps import docs

    assert docs.main(skip_main=True) == 0  # `make docs` writes them (SKIP_MAIN=1: nothing else)
    assert all(names.section(c.read_text(), k) == names.generated(k) for c, kinds in copies.items() for k in kinds)
    out = capsys.readouterr().out
    assert all(str(c) in out for c in copies)
    copy = next(iter(copies))
    gone = tmp_path / "gone" / copy.name
    monkeypatch.setattr(names, "DOCS", {copy: copies[copy], gone: copies[copy]})
    assert main(["explain", "--write"]) == 2  # a file it cannot write: one line, not a traceback
    assert capsys.readouterr().err == f"error: cannot write {gone} (No such file or directory)\n"


def test_the_readme_objectives_table_lists_every_objective_and_estimator():
    """README's generated table, from the registry: a row per objective with its paper, defaults and estimator."""
    from objectives import available_advantages

    table = names.objectives_markdown()
    for name in OBJECTIVES.names():
        assert f"\n| `{name}` |" in table, name
    assert "| `grpo` | GRPO, arXiv 2402.03300 | clip_low=0.2, clip_high=0.2," in table
    assert "| `bnpo` | alias of `grpo`, aggregation=token_mean |" in table
    assert "| `adaptive_kl` | Adaptive KL coefficient, arXiv 1707.06347, 1909.08593 | beta=0.001," in table
    assert "| `gpg` | GPG, arXiv 2504.02546 | — | token_mean | gpg |" in table
    assert all(f"`{name}`" in table.split("Advantage estimators")[1] for name in available_advantages())


def test_explain_knows_every_objective_hyperparameter(capsys):
    hyperparameters = {p for o in OBJECTIVES.names() for p in OBJECTIVES.get(o).hyperparameters()}
    for param in sorted(hyperparameters):
        assert main(["explain", param]) == 0, param  # `make explain KEY=la_power` said "no config key"
        out = capsys.readouterr().out
        taking = [o for o in OBJECTIVES.names() if param in OBJECTIVES.get(o).hyperparameters()]
        assert f"objective.params.{param}: " in out and f"  objectives: {', '.join(taking)}\n" in out, out
    assert main(["explain", "objective.params.la_power"]) == 0
    out = capsys.readouterr().out
    assert "n_t^la_power" in out and "default: ctpo 0.5" in out
    assert {n.key for n in names.all_names()} >= {f"objective.params.{p}" for p in hyperparameters}


def test_a_new_objectives_hyperparameters_are_explained_from_their_fields(monkeypatch, capsys):
    from objectives.base import Objective, aggregate, register_objective

    monkeypatch.setattr(OBJECTIVES, "_items", dict(OBJECTIVES._items))  # registered for this test only
    names.all_names.cache_clear()

    @register_objective("edge_knobs")
    class EdgeKnobs(Objective):
        knob_a: float = 0.5  # how hard the test turns its knob
        # a knob documented above its line
        knob_b: int = 3
        la_power: float = 2.0  # this objective's own la_power
        clip_ratio_c: float = 2.0  # this objective's own bound, a name with a hand-written row

        def policy_loss(self, batch):
            return aggregate(-batch.logp * batch.token_advantages, batch, self.aggregation), {}

    try:
        assert main(["explain", "objective.params.clip_ratio_c"]) == 0  # the row's meaning hid the field's comment
        out = capsys.readouterr().out
        assert "the dual clip's bound c" in out and "edge_knobs: this objective's own bound" in out, out
        assert main(["explain", "knob_a"]) == 0
        out = capsys.readouterr().out
        assert "objective.params.knob_a: how hard the test turns its knob" in out and "objectives: edge_knobs" in out
        assert main(["explain", "knob_b"]) == 0
        assert "knob_b: a knob documented above its line" in capsys.readouterr().out
        assert main(["explain", "la_power"]) == 0  # a name another objective has: each one's meaning
        out = capsys.readouterr().out
        assert "ctpo: length-adaptive window" in out and "edge_knobs: this objective's own la_power" in out
        assert "| `objective.params.knob_a` | how hard the test turns its knob | edge_knobs 0.5 |" in \
            names.names_markdown()
    finally:
        names.all_names.cache_clear()


def test_a_shared_hyperparameter_is_explained_per_objective_where_its_meaning_differs(monkeypatch, capsys):
    """A hand-written row's meaning was shown alone: clip_ratio_c "the dual clip's bound c" for tbpo too (whose 0 is
    1 + clip_high), clip_low "ε_low of the ratio clip" for ipo (a mask threshold). An objective's field comment that
    says otherwise is shown with its name; a comment every objective inherits (beta's, aggregation's) is not."""
    for key, own in [("objective.params.clip_ratio_c", "tbpo: 0: c = 1 + clip_high"),
                     ("clip_low", "ipo: mask tokens whose probability fell"),
                     ("beta", "adaptive_kl: the initial coefficient of the KL")]:
        assert main(["explain", key]) == 0
        out = capsys.readouterr().out
        assert own in out, out
    assert main(["explain", "aggregation"]) == 0
    assert "reduction of the per-token" not in capsys.readouterr().out
    # a hyperparameter one objective has, with a hand-written row: its field's comment, not the row's line
    monkeypatch.setattr(names, "NAMES", (*names.NAMES, names.Name(names.PARAMS + "band_low", meaning="hand-written")))
    names.all_names.cache_clear()
    try:
        assert main(["explain", "band_low"]) == 0
        out = capsys.readouterr().out
        assert "objective.params.band_low: lower edge of the trust band" in out and "hand-written" not in out, out
    finally:
        names.all_names.cache_clear()


def test_every_shipped_hyperparameter_has_a_meaning_of_its_own():
    """Each shipped objective's hyperparameter is explained by its field's comment (the README's template), a help
    or a hand-written row, not by the fallback to its docstring: that gave `see objectives/vespo.py` alone for
    lambda_pos, and three formula lines run together for clip_cov_lb, dppo's ratio_cap, m2po's m2_threshold, ..."""
    fallback = [(name, param) for name in OBJECTIVES.names() for param in names.own_hyperparameters(name)
                if names.objective_param_meaning(name, param).startswith("see ")]
    assert not fallback, fallback


def test_no_hyperparameter_meaning_breaks_off_mid_sentence():
    """A meaning taken from an objective's docstring was its first line naming the hyperparameter: a wrapped line
    broke off mid-sentence (selection_seed's '... reproducible and resumable and the', tbpo's clip_high '... c = 1 +
    clip_high,'). Now the sentence's following lines come with it; every objective's every hyperparameter is read."""
    cut = re.compile(r"(,|\b(the|and|or|a|an|of|to|by|with|is|as|at|in|on|for|its|their))$")
    for name in OBJECTIVES.names():
        for param in names.own_hyperparameters(name):
            for text in (names.hyperparameter_meaning(param), names.objective_param_meaning(name, param)):
                assert not any(cut.search(part.strip()) for part in text.split("; ")), (name, param, text)
