"""The gradient lab: its measurements pinned on hand-checkable tensors, and an end-to-end lab on the tiny
test model (files, determinism, resume)."""

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from analysis.lab import (
    CODE_FILE,
    MEASURES,
    POLICY_FILE,
    build_lab_report,
    gram_snr,
    lab_policy,
    lab_version,
    positions_figure,
    snr_interval,
    sqrt_growth,
    staleness_figure,
    summary,
)
from harness.apps.gradient_stats import (
    CountSketch,
    kish_ess,
    ratio_by_position,
    reinforce_loss,
    token_weights,
    weight_metrics,
)
from harness.apps.lab import LAB_PROVIDES, check_lab_code, check_lab_policy, lab_config, lab_dir, run_lab
from harness.run.config import load_experiment
from harness.run.errors import ConfigError
from harness.run.provenance import code_record
from objectives import OBJECTIVES, PolicyBatch, get_objective
from objectives.base import lifecycle_unsupported
from tests.helpers.objectives import ON_BATCHES
from tests.helpers.tiny import TINY_RUN, TINY_SPEC
from tests.helpers.tiny_moe import TINY_MOE_RUN

# what the lab evaluates: the objectives on hand-made batches that need nothing the lab does not provide (no state)
IN_LAB = [name for name in ON_BATCHES if not lifecycle_unsupported(OBJECTIVES.get(name), "lab", LAB_PROVIDES)]


def linear_policy(seed=0, rows=4, steps=3, vocab=5, features=3):
    """logp [rows, steps] of fixed tokens under softmax(W x): a differentiable policy with parameters W."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, features, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(rows, steps, features, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (rows, steps), generator=g)
    logp = torch.log_softmax(x @ weight.T, -1).gather(-1, tokens[..., None])[..., 0]
    return weight, logp


MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
ADV = torch.tensor([1.0, -0.5, -1.5, 1.0], dtype=torch.float64)


@pytest.mark.parametrize("name", IN_LAB)
def test_token_weights_give_the_objectives_parameter_gradient(name):
    """J^T (dL/dlogp) is the gradient of the loss itself (chain rule): the lab's gradients are the objectives'."""
    weight, logp = linear_policy()
    old = (logp + 0.1 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1),
                                    dtype=torch.float64)).detach()
    batch = PolicyBatch(logp=logp, old_logp=old, mask=MASK, advantages=ADV, rewards=ADV,
                        group_ids=torch.tensor([0, 0, 1, 1]), max_completion_len=3)
    objective = get_objective(name)
    (direct,) = torch.autograd.grad(objective(batch).loss, weight, retain_graph=True)
    weights, _ = token_weights(objective, batch)
    (via_weights,) = torch.autograd.grad(logp, weight, grad_outputs=weights)
    torch.testing.assert_close(via_weights, direct, rtol=1e-10, atol=1e-12)
    assert (weights[~MASK] == 0).all()


def test_on_policy_grpo_weights_are_reinforce_with_length_normalisation():
    """On-policy (r = 1), GRPO's weight of token t of sequence i is -A_i / (N L_i); with equal lengths its gradient is
    the REINFORCE gradient divided by L."""
    weight, logp = linear_policy()
    batch = PolicyBatch(logp=logp, old_logp=logp.detach(), mask=MASK, advantages=ADV)
    weights, _ = token_weights(get_objective("grpo"), batch)
    lengths = torch.tensor([3.0, 2.0, 1.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(weights, torch.where(MASK, -ADV[:, None] / (4 * lengths[:, None]), 0.0))
    full = torch.ones_like(MASK)
    batch = PolicyBatch(logp=logp, old_logp=logp.detach(), mask=full, advantages=ADV)
    weights, _ = token_weights(get_objective("grpo"), batch)
    (grpo,) = torch.autograd.grad(logp, weight, grad_outputs=weights, retain_graph=True)
    (reinforce,) = torch.autograd.grad(reinforce_loss(logp, full, ADV), weight)
    torch.testing.assert_close(grpo, reinforce / 3)


def test_kish_ess_by_hand():
    assert kish_ess(torch.ones(7)) == pytest.approx(7)
    assert kish_ess(torch.tensor([0.0, 0.0, 2.0])) == pytest.approx(1)
    assert kish_ess(torch.tensor([1.0, -2.0, 3.0])) == pytest.approx(36 / 14)
    assert kish_ess(torch.zeros(3)) == 0.0


def test_weight_metrics_by_hand():
    """Two sequences; token 2 of the first has r = e^0.5 > 1.2 with A > 0 (PPO-clip silences it)."""
    logp = torch.zeros(2, 2, dtype=torch.float64)
    old = torch.tensor([[0.0, -0.5], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    batch = PolicyBatch(logp=logp, old_logp=old, mask=mask, advantages=torch.tensor([1.0, -1.0]))
    weights = torch.tensor([[1.0, 0.0], [3.0, 0.0]], dtype=torch.float64)
    m = weight_metrics(weights, batch)
    assert m["frac_tokens_with_grad"] == pytest.approx(2 / 3)
    assert m["ess_token_frac"] == pytest.approx((4**2 / 10) / 3)
    assert m["ess_sequence_frac"] == pytest.approx((4**2 / 10) / 2)
    assert m["frac_ppo_clipped"] == pytest.approx(1 / 3)
    assert m["grad_share_ppo_clipped"] == 0.0  # the silenced token has weight 0 here
    weights[0, 1] = 4.0
    assert weight_metrics(weights, batch)["grad_share_ppo_clipped"] == pytest.approx(4 / 8)


def test_length_bias_grpo_against_dr_grpo():
    """Wrong answers of lengths 1, 1, 3, 3 on-policy: GRPO's per-token weight |A|/(N L) makes a long wrong answer's
    tokens weigh 1/3 of a short one's; Dr. GRPO's |A|/(N L_max) weighs them alike (ratio 1), and the long ones
    then carry 3/4 of the wrong answers' gradient."""
    logp = torch.zeros(5, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([-1.0, -1.0, -1.0, -1.0, 4.0], dtype=torch.float64)
    batch = PolicyBatch(logp=logp, old_logp=logp, mask=mask, advantages=adv, max_completion_len=3)
    grpo = weight_metrics(token_weights(get_objective("grpo"), batch)[0], batch)
    dr = weight_metrics(token_weights(get_objective("dr_grpo"), batch)[0], batch)
    assert grpo["token_weight_long_over_short_wrong"] == pytest.approx(1 / 3)
    assert grpo["grad_share_long_wrong"] == pytest.approx(1 / 2)
    assert dr["token_weight_long_over_short_wrong"] == pytest.approx(1.0)
    assert dr["grad_share_long_wrong"] == pytest.approx(3 / 4)


def test_ratio_by_position_by_hand():
    """d = [[1, 1, 0], [-1, 1, pad], [0, 0, 0]]: at t = 1 the token log ratios are (1, -1, 0), variance 1; the
    cumulative ones at t = 2 are (2, 0, 0), variance 4/3; t = 3 has two sequences."""
    old = torch.zeros(3, 3)
    logp = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 1.0, 9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    rows = ratio_by_position(logp, old, mask)
    assert [r["position"] for r in rows] == [1, 2, 3] and rows[2]["sequences"] == 2
    assert rows[0]["var_token"] == pytest.approx(1.0)
    assert rows[1]["var_cumulative"] == pytest.approx(4 / 3)
    assert rows[1]["var_prefix_mean"] == pytest.approx(1 / 3)
    # whole-sequence log ratios (2, 0, 0) and their means over length (2/3, 0, 0)
    assert rows[0]["var_sequence"] == pytest.approx(4 / 3)
    assert rows[0]["var_sequence_mean"] == pytest.approx(np.var([2 / 3, 0, 0], ddof=1))
    assert rows[2]["var_cumulative"] == pytest.approx(np.var([2.0, 0.0], ddof=1))


def test_count_sketch_is_exact_for_small_models_and_preserves_inner_products():
    shapes = [torch.Size([3, 4]), torch.Size([5])]
    grads = [torch.arange(12.0).reshape(3, 4), torch.ones(5)]
    exact = CountSketch(shapes, 64, seed=0)
    assert exact.exact and torch.equal(exact(grads), torch.cat([g.flatten() for g in grads]))
    g = torch.Generator().manual_seed(0)
    a = torch.randn(200_000, generator=g)
    b = 0.6 * a + 0.8 * torch.randn(200_000, generator=g)
    sketch = CountSketch([a.shape], 4096, seed=3)
    sa, sb = sketch([a]), sketch([b])
    assert not sketch.exact and sa.shape == (4096,)
    true = (a @ b / (a.norm() * b.norm())).item()
    assert abs((sa @ sb / (sa.norm() * sb.norm())).item() - true) < 0.05  # ~1/sqrt(4096) = 0.016 per inner product
    assert torch.equal(sketch([a]), sa)  # identical gradients, identical sketches: cosine exactly 1


def test_gradient_snr_from_the_gram_matrix_by_hand():
    """g1 = (1, 0), g2 = (-1, 0): |mu|^2 ~ <g1, g2> = -1, tr Sigma ~ 1 - (-1) = 2: SNR -1/2. g = (1, 1), (1, -1):
    signal 0. Copies of one gradient plus a little noise: a large SNR."""
    assert gram_snr(np.array([[1.0, -1.0], [-1.0, 1.0]])) == pytest.approx(-0.5)
    assert gram_snr(np.array([[2.0, 0.0], [0.0, 2.0]])) == pytest.approx(0.0)
    g = np.random.default_rng(0)
    vectors = np.ones((6, 50)) + 0.1 * g.standard_normal((6, 50))
    estimate, low, high = snr_interval(vectors @ vectors.T)
    assert estimate > 50 and low <= estimate <= high  # |mu|^2 = 50, tr Sigma = 0.5: SNR ~ 100


def test_no_position_with_two_sequences_leaves_the_growth_table_empty_and_the_figure_undrawn():
    """Every completion empty (EOS first): ratio_by_position gives no row, the batches' positions table has no column;
    the report's growth table is then empty and its figure not drawn (it was a KeyError after every batch ran)."""
    empty = torch.zeros(3, 4, dtype=torch.bool)
    assert ratio_by_position(torch.zeros(3, 4), torch.zeros(3, 4), empty) == []
    growth = sqrt_growth(pd.DataFrame([]))
    assert growth.empty and "cumulative_sd_slope" in growth
    assert positions_figure(pd.DataFrame([]), "lab") is None


@pytest.mark.slow
def test_lab_settings_are_checked_before_anything_runs(tmp_path):
    base = [*TINY_RUN, f"results_dir={tmp_path}"]
    for override, key in (("lab.staleness=[1,2]", "lab.staleness"), ("lab.mismatch=[fp8]", "lab.mismatch"),
                          ("lab.objectives=[grpoo]", "grpo"), ("lab.batches=1", "lab.batches"),
                          ("lab.policy=/nonexistent", "lab.policy"), ("lab.mover=nope", "lab"),
                          ("model.lora.rank=4", "model.lora.rank=0"),
                          ("train.prompts_per_step=2 train.group_size=2 train.num_minibatches=4",
                           "minibatch holds 1 sequence")):
        with pytest.raises(ConfigError, match=key):
            lab_config(load_experiment("base", [*base, *override.split()]))
    with pytest.raises(ConfigError, match="num_minibatches"):
        lab_config(load_experiment("base", [*base, "train.num_minibatches=1", "lab.staleness=[0,1]"]))
    with pytest.raises(ConfigError, match=r"lab.mismatch must be distinct samplers, got \['temperature', "
                       r"'temperature'\]"):  # its points counted each batch twice
        lab_config(load_experiment("base", [*base, "lab.mismatch=[temperature,temperature]"]))
    with pytest.raises(ConfigError, match=r"lab.objectives must be distinct objectives, got \['grpo', 'grpo'\]"):
        lab_config(load_experiment("base", [*base, "lab.objectives=[grpo,grpo]"]))  # was measured once, silently
    with pytest.raises(ConfigError, match=r"lab.params.dapo: the lab runs no dapo \(lab.objectives: .*; add it to "
                       r"lab.objectives or drop its params"):  # they were recorded and changed nothing
        lab_config(load_experiment("base", [*base, "lab.objectives=[grpo,gspo]",
                                            "lab.params={dapo: {clip_high: 0.9}}"]))


@pytest.mark.parametrize("overrides, message", [
    (["train.rollout_lag=1"], r"train.rollout_lag=1 .*\(the lab's policy lag is lab.staleness\)"),
    (["train.rollout_correction.mode=token_mask"], r"train.rollout_correction.mode=\"token_mask\" .*uncorrected"),
    (["train.rollout_correction.rejection=[token_k3]", "train.rollout_correction.rejection_threshold=[0.1]"],
     r"train.rollout_correction.rejection=\[\"token_k3\"\]"),
    (["objective.name=cispo"], r"objective.name=\"cispo\" .*\(the lab measures lab.objectives"),
    (["objective.params.clip_low=0.3"], r"objective.params.clip_low=0.3 .*lab.params.<name>.<key>"),
    (["train.epochs=2"], r"train.epochs=2"), (["train.dynamic_sampling=true"], r"train.dynamic_sampling=true"),
])
@pytest.mark.slow
def test_a_training_setting_the_lab_does_not_read_is_refused(tmp_path, overrides, message):
    """The lab took these, wrote them to its config.yaml and measured bit-equal numbers without them: a reader
    believed the lab measured under a lag or a correction (the thirteenth hostile pass)."""
    with pytest.raises(ConfigError, match=rf"^lab: {message}") as info:
        lab_config(load_experiment("lab", [*TINY_RUN, f"results_dir={tmp_path}", *overrides]))
    assert "is a setting of training runs that the lab does not read" in str(info.value)
    assert str(info.value).endswith("; leave it out") and "\n" not in str(info.value)
    for experiment in ("lab", "lab_moe", "lab_smollm2"):  # the shipped labs set none of them
        assert lab_config(load_experiment(experiment, [f"results_dir={tmp_path}"])).lab.staleness


@pytest.mark.parametrize("override", ["sweep.grid.train.lr=[1e-4,3e-4]", "+sweep.per_objective.gspo.train.lr=0.1",
                                      "sweep.baseline=gspo"])
def test_a_sweep_setting_given_to_the_lab_is_refused(tmp_path, override):
    """The lab leaves the experiment's sweep aside (lab.yaml inherits quickstart's grid): a grid given on its command
    line was dropped without a word, and the lab measured one learning rate."""
    from harness.apps.lab import main as lab

    key = override.split("=")[0].lstrip("+")
    with pytest.raises(ConfigError, match=rf"^lab: {re.escape(key)} is a sweep's setting, which the lab leaves aside "
                                          r"\(.*\); leave it out$"):
        lab("lab", [*TINY_RUN, f"results_dir={tmp_path}", override])
    assert not (tmp_path / "lab").exists()


def test_a_lab_alias_undone_by_its_params_is_refused(tmp_path):
    """lab.params={luspo: {aggregation: token_mean}} measured gspo under luspo's name (train and sweep refuse the
    same: the seventh hostile pass)."""
    base = [*TINY_RUN, f"results_dir={tmp_path}"]
    for extra in (["lab.objectives=[grpo,luspo]"], ["lab.mover=luspo"]):
        with pytest.raises(ConfigError, match=r"^lab: objective.name=luspo is gspo with aggregation="
                           r"seq_mean_token_sum, and lab.params.luspo.aggregation=token_mean undoes it"):
            lab_config(load_experiment("base", [*base, *extra, "lab.params={luspo: {aggregation: token_mean}}"]))


def test_a_lab_with_other_settings_names_them(tmp_path):
    """Adding to a lab folder with other settings is refused naming each (it said only 'other settings')."""
    base = [*TINY_RUN, f"results_dir={tmp_path}", "name=l"]
    cfg = lab_config(load_experiment("base", base))
    (lab_dir(cfg) / "batches").mkdir(parents=True)
    (lab_dir(cfg) / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (lab_dir(cfg) / "batches" / "batch_000.pt").write_bytes(b"")  # a batch measured under those settings
    with pytest.raises(ConfigError, match=r"holds a lab with other settings \(train.lr 0.001 -> 0.01, lab.mover "
                       r"grpo -> gspo; only lab.batches may change between calls\)"):
        run_lab(load_experiment("base", [*base, "train.lr=1e-2", "lab.mover=gspo", "lab.batches=9"]))


def test_a_labs_objective_settings_at_their_own_values_are_the_lab_without_them(tmp_path):
    """lab.params.grpo.advantage=grpo (or clip_low=0.2, dr_grpo's advantage=mean_only) refused to add to the lab
    made without them, as another lab, where a run with them is the run without them (a hostile pass)."""
    from harness.apps.lab import comparable

    base = [*TINY_RUN, f"results_dir={tmp_path}", "lab.objectives=[grpo,dr_grpo]"]
    plain = comparable(lab_config(load_experiment("base", base)))
    spelled = "lab.params={grpo: {advantage: grpo, clip_low: 0.2, kl_estimator: k1}, dr_grpo: {advantage: mean_only}}"
    assert comparable(lab_config(load_experiment("base", [*base, spelled]))) == plain
    other = comparable(lab_config(load_experiment("base", [*base, "lab.params={grpo: {clip_low: 0.3}}"])))
    assert other != plain and other["lab"]["params"] == {"grpo": {"clip_low": 0.3}}


def test_a_lab_policy_folder_without_weights_is_refused_before_anything_naming_lab_policy(tmp_path, capsys):
    """lab.policy a folder with config.json but no weights: a 40-line traceback after the lab's folder was made (the
    seventh hostile pass); now one line before anything, naming lab.policy as given."""
    from harness.apps.cli import main
    from harness.policy.models import load_model

    model, _ = load_model("tiny", tiny=TINY_SPEC)
    model.config.save_pretrained(tmp_path / "policy")  # config.json alone
    assert main(["lab", "base", *TINY_RUN, f"lab.policy={tmp_path / 'policy'}", f"results_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: lab.policy {str(tmp_path / 'policy')!r}: {tmp_path / 'policy'} holds no "
                          "weights (model.safetensors or ") and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()
    config = tmp_path / "policy" / "config.json"  # the folder's config.json given: "no config.json" before
    assert main(["lab", "base", *TINY_RUN, f"lab.policy={config}", f"results_dir={tmp_path / 'r'}"]) == 2
    assert capsys.readouterr().err == (f"config error: lab.policy {str(config)!r} is a file: give the saved policy "
                                       f"folder that holds it ({tmp_path / 'policy'})\n")


def test_a_lab_folder_that_measured_nothing_is_taken_over(tmp_path, monkeypatch):
    """A lab whose start failed (a policy folder without weights) left its config.yaml and no batch: the next lab of
    that name with other settings was refused for 'other settings' it never measured (the seventh hostile pass)."""
    base = [*TINY_RUN, f"results_dir={tmp_path}", "name=l"]
    cfg = lab_config(load_experiment("base", base))
    (lab_dir(cfg) / "batches").mkdir(parents=True)
    (lab_dir(cfg) / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    measured = []
    monkeypatch.setattr("harness.apps.lab.Lab.measure", lambda self, todo, out, progress: measured.append(todo))
    run_lab(load_experiment("base", [*base, "train.lr=1e-2", "lab.batches=3"]))
    assert measured == [[0, 1, 2]] and "lr: 0.01" in (lab_dir(cfg) / "config.yaml").read_text()


@pytest.mark.slow
def test_a_lab_asked_for_fewer_batches_than_it_holds_says_it_reports_them_all(tmp_path, monkeypatch, capsys):
    """lowering lab.batches on a lab folder said 'N batches' of the lower N while the report held every batch."""
    from harness.apps.cli import main

    monkeypatch.setattr("harness.apps.lab.Lab.rewards", parity_rewards)
    small = [*TINY_RUN, f"results_dir={tmp_path}", "name=l", "lab.objectives=[grpo]", "lab.staleness=[0]",
             "lab.mismatch=[]", "lab.reference_samples=2", "--no-progress"]
    assert main(["lab", "base", *small, "lab.batches=3"]) == 0
    assert "lab l: 3 batches in " in capsys.readouterr().err
    assert main(["lab", "base", *small, "lab.batches=2"]) == 0
    assert "lab l: 3 batches in " + str(tmp_path / "lab" / "l") + " (lab.batches=2; the folder holds 3 measured, " \
        "all reported" in capsys.readouterr().err
    assert len(pd.read_csv(tmp_path / "lab" / "l" / "lab.csv")) == 3


LAB_RUN = ["lab.objectives=[grpo,gspo,gspo_token,cispo]", "lab.batches=3", "lab.staleness=[0,2]",
           "lab.mismatch=[bfloat16,temperature]", "lab.reference_samples=4", "name=tinylab"]


def parity_rewards(self, ro, problems, group_size):
    """A reward the untrained test model earns about half the time (its first token's id is odd), so groups
    carry gradient."""
    return (ro.completion_ids[:, 0] % 2).float()


def test_a_labs_batches_are_one_code_versions(tmp_path, monkeypatch, capsys):
    """A fresh lab records the code that measures it; batches are not added to a lab another code measured (they
    would be pooled as one lab's); a lab from before the record is extended with a warning, its code unrecorded."""
    from harness.apps import lab

    out = tmp_path / "lab"
    (out / "batches").mkdir(parents=True)
    monkeypatch.setattr(lab, "code_record", lambda: {"version": "aaaaaaa", "commit": "a" * 40})
    check_lab_code(out)
    assert lab_version(out) == "aaaaaaa"
    (out / "batches" / "batch_000.pt").write_bytes(b"")
    check_lab_code(out)  # the same code adds batches
    monkeypatch.setattr(lab, "code_record", lambda: {"version": "bbbbbbb", "commit": "b" * 40})
    with pytest.raises(ConfigError, match=f"{out} holds a lab measured by code aaaaaaa, not bbbbbbb: .*check out "
                       "aaaaaaa"):
        check_lab_code(out)
    (out / CODE_FILE).unlink()  # a lab measured before labs recorded their code
    check_lab_code(out)
    assert "measured before labs recorded code.json" in capsys.readouterr().err and lab_version(out) is None


def test_a_labs_batches_are_one_policys(tmp_path, capsys, monkeypatch):
    """The lab records the digest of the policy it measures; batches are not added on a policy of other weights
    (lab.policy names a folder whose weights can be replaced; a starting policy built on another CPU differs)."""
    out = tmp_path / "lab"
    (out / "batches").mkdir(parents=True)
    check_lab_policy(out, "/runs/a/final", "1" * 16)
    assert lab_policy(out) == "1" * 16
    (out / "batches" / "batch_000.pt").write_bytes(b"")
    check_lab_policy(out, "/runs/a/final", "1" * 16)  # the same weights add batches
    with pytest.raises(ConfigError, match=f"{out} holds a lab measured on /runs/a/final with weights of digest "
                       f"{'1' * 16}, not {'2' * 16}: .*restore those weights"):
        check_lab_policy(out, "/runs/a/final", "2" * 16)
    (out / POLICY_FILE).unlink()  # a lab measured before labs recorded their policy
    check_lab_policy(out, "/runs/a/final", "2" * 16)
    assert "measured before labs recorded policy.json" in capsys.readouterr().err and lab_policy(out) is None
    # but this code records it: with this code's code.json, a missing or damaged one is damage, not an old lab
    from harness.apps import lab

    monkeypatch.setattr(lab, "code_record", lambda: {"version": "ccccccc", "commit": "c" * 40})
    (out / CODE_FILE).write_text(json.dumps({"version": "ccccccc"}))
    (out / POLICY_FILE).write_text("not json{")
    with pytest.raises(ConfigError, match=r"policy.json is missing or damaged, though this code measured the lab"):
        check_lab_policy(out, "/runs/a/final", "2" * 16)


@pytest.mark.slow
def test_lab_end_to_end_is_deterministic_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr("harness.apps.lab.Lab.rewards", parity_rewards)
    cfg = load_experiment("base", [*TINY_RUN, f"results_dir={tmp_path}", *LAB_RUN])
    folder = run_lab(cfg, progress=False)
    build_lab_report(folder)
    lab = pd.read_csv(folder / "lab.csv")
    assert set(lab["objective"]) == {"grpo", "gspo", "gspo_token", "cispo"}
    assert len(lab) == 4 * 3 * (2 + 2 + 1)  # objectives x batches x (staleness 0, 2; bf16, temperature; fp32 copy)
    fresh = lab[(lab["axis"] == "staleness") & (lab["staleness"] == 0)]
    assert np.allclose(fresh["cos_fresh"], 1.0)
    # on-policy with sequence advantages, GSPO-token's gradient is GSPO's (cosine 1 at every point and batch)
    pairs = pd.read_csv(folder / "pairwise.csv").query("objective == 'gspo' and other == 'gspo_token'")
    assert len(pairs) == 3 * 4 and pairs["cosine"].notna().sum() >= 10  # NaN: both gradients 0 (all clipped)
    assert np.allclose(pairs["cosine"].dropna(), 1.0, atol=1e-6)
    assert (folder / "report" / "report.md").exists() and (folder / "report" / "staleness.png").exists()
    version = code_record()["version"]  # the code that measured the batches: recorded, and named by the report
    assert lab_version(folder) == version and f"by code `{version}`" in (folder / "report" / "report.md").read_text()
    snr = pd.read_csv(folder / "snr.csv")
    assert snr["snr_low"].notna().all()  # 3 batches: a bootstrap interval
    # rerun after losing one batch: the same table
    (folder / "batches" / "batch_001.pt").unlink()
    run_lab(cfg, progress=False)
    build_lab_report(folder)
    again = pd.read_csv(folder / "lab.csv")
    pd.testing.assert_frame_equal(lab, again)
    with pytest.raises(ConfigError, match="other settings"):
        run_lab(load_experiment("base", [*TINY_RUN, f"results_dir={tmp_path}", *LAB_RUN, "train.lr=1e-2"]))
    assert math.isfinite(lab["grad_norm"].max())


@pytest.mark.slow
def test_lab_measures_a_policy_a_run_saved(tmp_path, monkeypatch):
    """lab.policy: the policy a run exported (its final/ folder) replaces the starting policy, warm start off."""
    from harness.loop.native import train
    from tests.helpers.tiny import tiny_run

    run = tiny_run(tmp_path)
    train(run, tmp_path / "run", progress=False)
    monkeypatch.setattr("harness.apps.lab.Lab.rewards", parity_rewards)
    final = str(tmp_path / "run" / "final")
    cfg_overrides = [*TINY_RUN, f"results_dir={tmp_path}", f"lab.policy={final}", "name=fromrun",
                     "lab.objectives=[grpo]", "lab.staleness=[0,1]", "lab.mismatch=[]", "lab.reference_samples=2"]
    cfg = load_experiment("base", [*cfg_overrides, "lab.batches=2"])
    assert lab_config(cfg).model.name == final
    folder = run_lab(cfg, progress=False)
    build_lab_report(folder)
    lab = pd.read_csv(folder / "lab.csv")
    assert len(lab) == 2 * 2 and set(lab["objective"]) == {"grpo"}
    assert f"weights digest `{lab_policy(folder)}`" in (folder / "report" / "report.md").read_text()
    # the folder's weights replaced by others: its batches are not pooled with the first policy's
    weights = load_file(tmp_path / "run" / "final" / "model.safetensors")
    save_file({name: value + 1e-3 for name, value in weights.items()}, tmp_path / "run" / "final" / "model.safetensors")
    with pytest.raises(ConfigError, match=f"measured on {final} with weights of digest {lab_policy(folder)}, not "):
        run_lab(load_experiment("base", [*cfg_overrides, "lab.batches=3"]), progress=False)


def test_lab_routing_settings_are_one_line_errors(tmp_path):
    moe = [*TINY_MOE_RUN, f"results_dir={tmp_path}"]
    for base, override, words in (
            ([*TINY_RUN, f"results_dir={tmp_path}"], "lab.routing=[r2]", "needs a Mixture-of-Experts policy"),
            (moe, "lab.routing=[r2,r2]", "distinct entries among r2, r3"),
            (moe, "lab.routing=[r4]", "distinct entries among r2, r3"),
            ([*moe, "lab.staleness=[0]"], "lab.routing=[r2]", "largest lab.staleness, which is 0"),
            ([*moe, "train.sampler=hf"], "lab.routing=[r3]", "train.sampler=native")):
        with pytest.raises(ConfigError, match=re.escape(words)) as info:
            lab_config(load_experiment("base", [*base, override]))
        assert "\n" not in str(info.value)


@pytest.mark.slow  # a lab: make test
def test_lab_routing_axis_replays_the_behaviour_routing_at_the_largest_staleness(tmp_path, monkeypatch):
    monkeypatch.setattr("harness.apps.lab.Lab.rewards", parity_rewards)
    cfg = load_experiment("base", [*TINY_MOE_RUN, f"results_dir={tmp_path}", "lab.objectives=[grpo,gspo]",
                                   "lab.batches=2", "lab.staleness=[0,2]", "lab.mismatch=[]", "lab.reference_samples=2",
                                   "lab.routing=[r2,r3]", "train.lr=3e-2", "name=moelab"])
    folder = run_lab(cfg, progress=False)
    build_lab_report(folder)
    lab = pd.read_csv(folder / "lab.csv")
    assert len(lab) == 2 * 2 * (2 + 2)  # objectives x batches x (staleness 0, 2; routing r2, r3)
    key = ["batch", "objective"]
    stale = lab.query("axis == 'staleness' and staleness == 2").set_index(key).sort_index()
    r2, r3 = (lab.query(f"axis == 'routing' and point == '{m}'").set_index(key).sort_index() for m in ("r2", "r3"))
    assert (r2["staleness"] == 2).all()
    # fp32: the sampler's routing is theta_0's teacher-forced one (a completion's last token, which no log-prob
    # depends on, aside), so R2 and R3 force the same experts
    assert np.allclose(r2["loss"], r3["loss"], rtol=0, atol=0) and np.allclose(r2["grad_norm"], r3["grad_norm"])
    assert not np.allclose(r2["grad_norm"], stale["grad_norm"], rtol=1e-6, atol=0)  # the moved routing, overridden
    assert "Routing axis" in (folder / "report" / "report.md").read_text()


def test_the_staleness_bands_stay_inside_each_measures_range():
    """A fraction near 1 over 3 batches (its t-interval passes 1) and a cosine near -1: their bands stop at 1 and -1,
    as the report's curves do; SNR, without a range, keeps its band."""
    import matplotlib.pyplot as plt

    from analysis import plots

    lab = pd.DataFrame({"objective": "grpo", "axis": "staleness", "point": "2", "staleness": 2,
                        "frac_tokens_with_grad": [1.0, 1.0, 0.7], "cos_reference": [-1.0, -1.0, -0.7],
                        "ess_token_frac": 0.5, "clip_frac": 0.1})
    snr = pd.DataFrame({"objective": ["grpo"], "axis": ["staleness"], "point": ["2"], "snr": [1.0],
                        "snr_low": [-0.5], "snr_high": [2.0]})
    fig = staleness_figure(summary(pd.concat([lab, lab.assign(point="4", staleness=4)])), snr,
                           plots.styles(["grpo"]), "t")
    drawn = {}
    panels = dict(zip(MEASURES, fig.axes, strict=False))  # a panel per measure, in MEASURES' order
    for measure in ("cos_reference", "snr", "frac_tokens_with_grad"):
        (band,) = panels[measure].collections
        ys = np.concatenate([path.vertices[:, 1] for path in band.get_paths()])
        drawn[measure] = ys.min(), ys.max()
    plt.close(fig)
    assert drawn["frac_tokens_with_grad"][1] == 1.0 and drawn["cos_reference"][0] == -1.0
    assert summary(lab)["frac_tokens_with_grad_high"].iloc[0] > 1  # the interval itself passes 1
    assert drawn["snr"][0] == -0.5


def test_the_lab_measures_on_the_kernel_of_train_cpu_matmul(tmp_path, monkeypatch):
    """A lab's forwards and backwards run the linear layers' kernel a run of its settings runs (harness/loop/native.py:
    ``train.cpu_matmul``), not torch's whatever the setting."""
    from harness.apps.lab import Lab
    from harness.policy import matmul

    scopes = []
    monkeypatch.setattr(Lab, "measure_batch", lambda self, b, bar: scopes.append(matmul._scope[-1]) or {})
    (tmp_path / "batches").mkdir()
    lab = Lab.__new__(Lab)
    lab.cfg, lab.points = OmegaConf.create({"name": "kernel"}), []
    for kernel in ("onednn", "torch"):
        lab.t = OmegaConf.create({"cpu_matmul": kernel})
        lab.measure([0], tmp_path, progress=False)
    assert scopes == ["onednn", "torch"] and matmul._scope[-1] == "torch"


def fake_lab(folder, gradients):
    """A lab folder of one objective (grpo) at staleness 0, one batch per gradient (a zero one: no cosine)."""
    (folder / "batches").mkdir(parents=True)
    for b, g in enumerate(gradients):
        g = torch.tensor(g, dtype=torch.float32)
        torch.save({"rows": [{"batch": b, "objective": "grpo", "axis": "staleness", "point": "0", "staleness": 0,
                              "sampler": "float32", "loss": 0.1 * b, "grad_norm": float(g.norm()),
                              "frac_tokens_with_grad": 0.5 + 0.1 * b}],
                    "positions": [], "sketches": {"staleness=0": {"grpo": g}},
                    "references": {"staleness=0": torch.tensor([1.0, 0.5])}, "eval_prompts": 2,
                    "sketch_exact": True, "sketch_dim": 2, "parameters": 2, "seconds": 1.0},
                   folder / "batches" / f"batch_{b:03d}.pt")


def test_the_lab_report_says_what_its_intervals_are_and_over_how_many_batches(tmp_path):
    """The tables' [low, high] were described nowhere on the page with more than 6 objectives (the default lab), and a
    cosine left undefined in some batches (a zero gradient) was averaged over fewer batches than the page said."""
    fake_lab(tmp_path / "l", [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    text = build_lab_report(tmp_path / "l").read_text()
    assert "Student-t interval over them from 3 batches, the range (min–max) with 2" in text
    assert "percentile bootstrap over batches" in text
    row = next(line for line in text.splitlines() if line.startswith("| grpo | 0 |"))
    assert "(2 of 3 batches)" in row.split("|")[3]  # cos_reference: batch 1's gradient is 0
    assert "of 3 batches" not in row.split("|")[6]  # frac_tokens_with_grad: every batch


def test_a_lab_of_single_sample_groups_is_checked_on_the_estimators_it_runs(tmp_path):
    """train.group_size=1 was checked against objective.name's estimator (grpo's), which the lab does not run: a lab
    whose every objective took a group-free estimator was refused, told to set objective.advantage, which the lab
    refuses; a measured objective's own group-centred estimator was not checked."""
    base = [*TINY_RUN, f"results_dir={tmp_path}", "train.group_size=1", "train.prompts_per_step=8",
            "train.num_minibatches=2", "lab.staleness=[0,1]"]
    free = "lab.params.grpo.advantage=reinforce_plus_plus"
    assert lab_config(load_experiment("base", [*base, "lab.objectives=[grpo]", free])).train.group_size == 1
    with pytest.raises(ConfigError, match=r"estimator 'grpo' makes every advantage 0 .*, or "
                                          r"lab.params.gspo.advantage one of reinforce_plus_plus, ") as info:
        lab_config(load_experiment("base", [*base, "lab.objectives=[gspo]", free]))
    assert "remax" not in str(info.value)  # the lab cannot run it (a greedy baseline): not suggested


def test_a_mover_step_skipped_as_non_finite_is_recorded_and_said_by_the_report(tmp_path, monkeypatch):
    """The mover's steps went through the loop's rule (a non-finite loss or gradient: no step) and the lab said
    nothing: staleness k then held fewer than k applied steps."""
    import harness.apps.lab as lab_app

    real, calls = lab_app.optimizer_step, []

    def second_is_nonfinite(learner, loss, max_grad_norm, state, metrics):
        calls.append(1)
        return real(learner, math.nan if len(calls) == 2 else loss, max_grad_norm, state, metrics)

    monkeypatch.setattr("harness.apps.lab.Lab.rewards", parity_rewards)
    monkeypatch.setattr(lab_app, "optimizer_step", second_is_nonfinite)
    cfg = load_experiment("base", [*TINY_RUN, f"results_dir={tmp_path}", "name=l", "lab.objectives=[grpo]",
                                   "lab.staleness=[0,2]", "lab.mismatch=[]", "lab.reference_samples=2",
                                   "lab.batches=2"])
    folder = run_lab(cfg, progress=False)
    assert torch.load(folder / "batches" / "batch_000.pt", weights_only=True)["mover_skipped"] == [2]
    text = build_lab_report(folder).read_text()
    assert "the mover skipped steps with a non-finite loss or gradient (batch 0: step 2)" in text


def test_a_lab_report_says_nothing_of_skipped_steps_when_there_were_none(tmp_path):
    fake_lab(tmp_path / "l", [[1.0, 0.0], [0.0, 1.0]])
    assert "skipped" not in build_lab_report(tmp_path / "l").read_text()
