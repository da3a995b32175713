"""POPO's tensor math (objectives/popo.py) against a transcription of the authors' code, momo1443/colm2026-POPO
7f22607b (``src/popo/weights.py``, ``loss.py``, ``ema.py``, ``trainer.py``): weights in both modes, with and without
length normalisation, groups with no / one / several positives; each loss term in value and gradient. float64.
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from harness.apps.lab import lab_objectives, validate_lab
from harness.loop.native import train
from harness.policy.models import load_model
from harness.run.config import load_experiment, run_configs
from harness.run.errors import ConfigError
from objectives import PolicyBatch, get_objective
from objectives.popo import (
    ema_update,
    masked_mean_pool,
    popo_entropy,
    popo_loss,
    popo_nll,
    popo_similarity,
    popo_weights,
)
from tests.helpers.interrupt import full_and_resumed
from tests.helpers.tiny import KEEP, TINY_SPEC, tiny_run

DT = torch.float64
G = 4  # generations per prompt


def authors_weights(per_token_logps, completion_mask, positive_mask, num_generations, temperature=1.0,
                    weight_mode="softmax", length_normalize=False):
    """compute_popo_weights, written out (contiguous groups of num_generations)."""
    b = per_token_logps.size(0)
    p = b // num_generations
    pos = positive_mask.view(p, num_generations)
    if weight_mode == "softmax":
        seq = (per_token_logps * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)
        masked_logps = seq.view(p, num_generations).clone()
        masked_logps[~pos] = float("-inf")
        w = torch.nan_to_num(F.softmax(masked_logps / temperature, dim=-1), nan=0.0)
    else:
        w = pos.to(per_token_logps.dtype) / pos.to(per_token_logps.dtype).sum(-1, keepdim=True).clamp(min=1.0)
    if length_normalize:
        w = w / completion_mask.sum(-1).clamp(min=1.0).view(p, num_generations)
        w = w * pos.to(w.dtype)
        w = w / w.sum(-1, keepdim=True).clamp(min=1e-8)
    return w.view(b)


def authors_loss(per_token_logps, mask, weights, entropies, online, target, alpha, beta_entropy, noise):
    """POPOLoss.__call__ (nll_loss, similarity_loss with the given noise, entropy_loss), written out."""
    nll = (weights.unsqueeze(1) * -per_token_logps * mask).sum() / ((weights > 0).unsqueeze(1).to(mask.dtype)
                                                                      * mask).sum().clamp(min=1.0)
    t = target + noise
    cos = (F.normalize(online, dim=-1) * F.normalize(t, dim=-1)).sum(-1)
    sim = -(weights * cos).sum() / weights.sum().clamp(min=1e-8)
    ent = -(entropies * mask).sum() / mask.sum().clamp(min=1.0)
    return nll + alpha * sim + beta_entropy * ent


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = 3 * G, 5
    logp = -torch.rand(b, t, generator=g, dtype=DT) * 3
    mask = (torch.arange(t)[None, :] < torch.randint(1, t + 1, (b, 1), generator=g)).to(DT)
    logp = logp * mask + (1 - mask) * -1e4  # garbage on padding (finite)
    # group 0: two positives; group 1: none; group 2: all four
    rewards = torch.tensor([1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1], dtype=DT)
    return logp, mask, rewards > 0, torch.arange(3).repeat_interleave(G)


@pytest.mark.parametrize("mode", ["softmax", "uniform"])
@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_weights_match_the_authors(mode, length_normalize, temperature):
    logp, mask, positive, groups = batch()
    ours = popo_weights(logp, mask, positive, groups, temperature, mode, length_normalize)
    ref = authors_weights(logp, mask, positive, G, temperature, mode, length_normalize)
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-14)
    assert (ours[~positive] == 0).all() and (ours[4:8] == 0).all()
    for g in (0, 2):
        assert math.isclose(ours[g * G:(g + 1) * G].sum().item(), 1.0, rel_tol=1e-12)


def test_weights_by_hand_and_by_group_ids():
    logp = torch.tensor([[-1.0, -3.0], [-2.0, 0.0], [-0.5, -0.5], [-9.0, -9.0]], dtype=DT)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=DT)
    positive = torch.tensor([True, True, False, True])
    # one group; s = -2, -2, (negative), -9: softmax over positives
    w = popo_weights(logp, mask, positive, torch.zeros(4))
    z = 2 * math.exp(-2) + math.exp(-9)
    expected = [math.exp(-2) / z, math.exp(-2) / z, 0.0, math.exp(-9) / z]
    assert torch.allclose(w, torch.tensor(expected, dtype=DT), atol=1e-15)
    # non-contiguous group ids give the same weights as the authors' contiguous blocks, permuted
    logp2, mask2, positive2, groups = batch(1)
    perm = torch.randperm(len(groups), generator=torch.Generator().manual_seed(2))
    shuffled = popo_weights(logp2[perm], mask2[perm], positive2[perm], groups[perm] * 7 + 3)
    assert torch.allclose(shuffled, authors_weights(logp2, mask2, positive2, G)[perm], atol=1e-14)
    with pytest.raises(ValueError, match="weight mode"):
        popo_weights(logp, mask, positive, torch.zeros(4), mode="rank")


def test_loss_terms_match_the_authors_in_value_and_gradient():
    logp, mask, positive, groups = batch(3)
    logp = logp.clone().requires_grad_(True)
    weights = popo_weights(logp, mask, positive, groups)
    g = torch.Generator().manual_seed(4)
    entropies = (torch.rand(logp.shape, generator=g, dtype=DT) * 2).requires_grad_(True)
    online = torch.randn(len(groups), 6, generator=g, dtype=DT, requires_grad=True)
    target = torch.randn(len(groups), 6, generator=g, dtype=DT)
    noise = 0.02 * torch.randn(target.shape, generator=g, dtype=DT)
    ours = popo_loss(logp, mask, weights, entropies, online, target, alpha=0.1, beta_entropy=0.01, noise=noise)
    ref = authors_loss(logp, mask, weights.detach(), entropies, online, target, 0.1, 0.01, noise)
    assert math.isclose(ours.item(), ref.item(), rel_tol=1e-12)
    for x in (logp, entropies, online):
        (a,) = torch.autograd.grad(ours, x, retain_graph=True)
        (b,) = torch.autograd.grad(ref, x, retain_graph=True)
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)
    # by hand: the NLL counts only the positives' tokens; negatives and a group without positives add nothing
    (grad,) = torch.autograd.grad(popo_nll(logp, mask, weights), logp)
    count = (mask * positive[:, None]).sum()
    assert torch.allclose(grad, -weights[:, None] * mask / count, atol=1e-15) and (grad[~positive] == 0).all()
    assert math.isclose(popo_entropy(entropies, mask).item(), -(entropies * mask).sum().item() / mask.sum().item())
    target_grad = target.clone().requires_grad_(True)
    popo_similarity(online, target_grad, weights).backward()
    assert target_grad.grad is None  # stop-gradient on the EMA target


def test_pool_and_ema_update():
    hidden = torch.arange(24, dtype=DT).view(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=DT)
    pooled = masked_mean_pool(hidden, mask)
    assert torch.equal(pooled[0], (hidden[0, 0] + hidden[0, 1]) / 2) and torch.equal(pooled[1], hidden[1, 0])
    target, online = [torch.ones(3, dtype=DT)], [torch.full((3,), 3.0, dtype=DT)]
    ema_update(target, online, tau=0.995)
    assert torch.allclose(target[0], torch.full((3,), 0.995 + 0.005 * 3.0, dtype=DT))
    with pytest.raises(ValueError, match="tau"):
        ema_update(target, online, tau=1.5)


# ----------------------------------------------------------------------------------------------------
# The registered objective: its state through the objective interface, the loss on a hand-made batch, the loop
# ----------------------------------------------------------------------------------------------------

class TinyPolicy(torch.nn.Module):
    """What POPO.setup reads of a policy: config.get_text_config().hidden_size and parameters to copy."""

    def __init__(self, size=6):
        super().__init__()
        self.layer = torch.nn.Linear(size, size).to(DT)
        self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(hidden_size=size))


def authors_predictor(state, size, hidden, layers):
    """PredictorMLP (src/popo/predictor.py), written out, loaded with ``state``: [Linear, LayerNorm, ReLU] x
    (layers - 1), Linear."""
    parts = []
    dims = [size] + [hidden] * (layers - 1)
    for a, b in zip(dims[:-1], dims[1:], strict=True):
        parts += [torch.nn.Linear(a, b), torch.nn.LayerNorm(b), torch.nn.ReLU(inplace=True)]
    net = torch.nn.Sequential(*parts, torch.nn.Linear(hidden, size))
    net.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})
    return net


def objective_batch(seed=5, size=6):
    logp, mask, positive, groups = batch(seed)
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(*logp.shape, size, generator=g, dtype=DT).requires_grad_(True)
    target_hidden = torch.randn(*logp.shape, size, generator=g, dtype=DT)
    entropy = (torch.rand(logp.shape, generator=g, dtype=DT) * 2).requires_grad_(True)
    old = (logp + 0.1 * torch.randn(logp.shape, generator=g, dtype=DT)) * mask
    logp = logp.clone().requires_grad_(True)
    seen = []
    pb = PolicyBatch(logp=logp, old_logp=old, mask=mask, advantages=torch.zeros(len(groups), dtype=DT),
                     rewards=positive.to(DT), group_ids=groups, entropy=entropy, hidden=hidden,
                     hidden_of=lambda model: seen.append(model) or target_hidden, step=7)
    return pb, target_hidden, seen


@pytest.mark.parametrize("layers", [2, 3])
def test_objective_equals_the_authors_loss_with_their_predictor(layers):
    popo = get_objective("popo", predictor_hidden_dim=5, predictor_layers=layers, alpha=0.3, beta_entropy=0.02)
    policy = TinyPolicy()
    popo.setup(policy)
    popo.predictor.to(DT)
    assert len(popo.trainable_parameters()) == 2 * (2 * layers - 1)  # Linear and LayerNorm weights and biases
    pb, target_hidden, seen = objective_batch()
    out = popo(pb)
    assert seen == [popo.target]  # the target's hidden states come from the EMA copy
    # the authors': weights from the rollout policy's log-probs, their PredictorMLP on the pooled features, the
    # noise of the seeded stream (noise_seed 0, optimizer step 7)
    weights = authors_weights(pb.old_logp, pb.mask, pb.rewards > 0, G)
    net = authors_predictor(popo.predictor.state_dict(), 6, 5, layers).to(DT)
    online = net(masked_mean_pool(pb.hidden, pb.mask))
    target = masked_mean_pool(target_hidden, pb.mask)
    noise = torch.randn(target.shape, generator=torch.Generator().manual_seed(7), dtype=DT) * 0.02
    ref = authors_loss(pb.logp, pb.mask, weights, pb.entropy, online, target, 0.3, 0.02, noise)
    assert math.isclose(out.loss.item(), ref.item(), rel_tol=1e-12)
    ours = torch.autograd.grad(out.loss, [pb.logp, pb.hidden, pb.entropy, *popo.predictor.parameters()],
                               retain_graph=True)
    theirs = torch.autograd.grad(ref, [pb.logp, pb.hidden, pb.entropy, *net.parameters()])
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)
    assert out.metrics["popo_positive_frac"] == 0.5 and out.metrics["popo_sim"] != 0


def test_objective_state_ema_zero_positives_and_errors():
    popo = get_objective("popo", tau=0.9, predictor_hidden_dim=4)
    with pytest.raises(ValueError, match="setup"):
        popo.trainable_parameters()
    policy = TinyPolicy()
    popo.setup(policy)
    start = policy.layer.weight.detach().clone()
    with torch.no_grad():
        policy.layer.weight.add_(1.0)
    popo.after_optimizer_step(policy, {})
    assert torch.allclose(popo.target.layer.weight, 0.9 * start + 0.1 * (start + 1.0), atol=1e-15)
    assert not any(p.requires_grad for p in popo.target.parameters())
    # the state round-trips into a fresh objective (what a resumed run does after setup)
    other = get_objective("popo", tau=0.9, predictor_hidden_dim=4)
    other.setup(TinyPolicy())
    other.load_state_dict(popo.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict()["target"].values(),
                                                  popo.state_dict()["target"].values(), strict=True))
    # no positive in the batch: loss 0 and no gradient, the entropy term included (the authors')
    popo.predictor.to(DT)
    pb, _, _ = objective_batch()
    pb.rewards = torch.zeros_like(pb.rewards)
    out = popo(pb)
    grads = torch.autograd.grad(out.loss, [pb.logp, pb.entropy], allow_unused=True)
    assert out.loss.item() == 0.0 and all(g is None or (g == 0).all() for g in grads)
    # ... connected to the policy and the predictor (the authors' 0 * logp.sum() + 0 * predicted.sum()): both get zero
    # gradients, not none, so the optimizer still steps them (AdamW's momentum and weight decay) as the authors'
    grads = torch.autograd.grad(popo(pb).loss, [pb.logp, *popo.predictor.parameters()], allow_unused=True)
    assert all(g is not None and (g == 0).all() for g in grads)
    with pytest.raises(ValueError, match="popo.*weight_mode"):
        get_objective("popo", weight_mode="rank")
    with pytest.raises(ValueError, match="is not meaningful"):
        get_objective("popo", aggregation="seq_mean_token_mean")
    assert get_objective("popo").entropy_need() == "gradient"
    assert get_objective("popo").needs() == {"state", "hidden_states"}
    assert get_objective("popo", beta_entropy=0.0).entropy_need() == ""


def test_defaults_are_the_authors_config():
    """configs/popo/default.yaml at the docstring's commit (weight temperature and length normalisation: the
    defaults of compute_popo_weights, which the trainer does not override)."""
    ours = get_objective("popo").hyperparameters()
    authors = {"alpha": 0.1, "beta_entropy": 0.01, "tau": 0.995, "tau_r": 0.0, "predictor_hidden_dim": 1024,
               "predictor_layers": 2, "feature_noise_std": 0.02, "weight_mode": "softmax", "weight_temperature": 1.0,
               "length_normalize": False, "beta": 0.0}
    assert {k: ours[k] for k in authors} == authors


def test_correction_weights_of_one_change_nothing_and_zero_removes_a_sequence():
    popo = get_objective("popo", predictor_hidden_dim=4)
    popo.setup(TinyPolicy())
    popo.predictor.to(DT)
    pb, _, _ = objective_batch()
    plain = popo(pb)
    (plain_grad,) = torch.autograd.grad(plain.loss, pb.logp)
    pb.correction = pb.mask.clone()
    ones = popo(pb)
    (ones_grad,) = torch.autograd.grad(ones.loss, pb.logp)
    assert ones.loss.item() == plain.loss.item() and torch.equal(ones_grad, plain_grad)
    pb.correction[0] = 0.0  # a positive sequence masked by the rollout correction
    (grad, hidden_grad) = torch.autograd.grad(popo(pb).loss, [pb.logp, pb.hidden])
    assert (grad[0] == 0).all() and (plain_grad[0] != 0).any()
    (plain_hidden_grad,) = torch.autograd.grad(plain.loss, pb.hidden)
    assert (hidden_grad[0] == 0).all() and (plain_hidden_grad[0] != 0).any()  # its similarity term goes too


@pytest.mark.slow
def test_popo_trains_in_the_loop_and_a_killed_run_resumes_exactly(tmp_path):
    """POPO through the native loop (the predictor in its own optimizer group, the EMA target after every optimizer
    step, the hidden states of both), killed after step 2 of 3 and resumed: the same metrics and the same final
    policy, predictor and target as the uninterrupted run. A random tiny policy solves nothing: tau_r = -1.5 under the
    overlong penalty (rewards in [-1, 0]) makes every completion a positive, weighted by its log-probability."""
    run = tiny_run(tmp_path, "objective.name=popo", "objective.params.tau_r=-1.5", "objective.params.tau=0.5",
                   "objective.params.predictor_hidden_dim=16", "task.overlong_buffer=6", "train.steps=3", KEEP)
    full, part = full_and_resumed(train, run, tmp_path, step=3)
    assert [r["step"] for r in part] == [0, 1, 2, 3] and part == full
    assert all(r["popo_sim"] != 0 and r["popo_positive_frac"] == 1 and r["grad_norm"] > 0 for r in full[1:])
    a, b = (torch.load(tmp_path / d / "checkpoints" / "last.pt", weights_only=False) for d in ("full", "part"))
    for key in ("policy", "objective"):
        flat_a, flat_b = (dict(_flat(x[key])) for x in (a, b))
        assert flat_a.keys() == flat_b.keys() and all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), key
    assert len(a["optimizer"]["param_groups"]) == 2  # the predictor's own group
    target, policy = a["objective"]["target"], a["policy"]
    start = load_model("tiny", tiny=TINY_SPEC, seed=0)[0].state_dict()
    assert any(not torch.equal(target[k], policy[k]) for k in policy)  # the EMA lags the policy ...
    assert any(not torch.equal(target[k], start[k]) for k in policy)  # ... and has left the starting policy


def _flat(state, prefix=""):
    for k, v in state.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_trl_backend_and_gradient_lab_refuse_popo_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="^backend trl: objective 'popo' reads the policy's hidden states and keeps "
                       "state of its own across updates .*, which backend trl does not provide; use backend=native$"):
        run_configs(load_experiment("base", ["objective.name=popo", "backend=trl", f"results_dir={tmp_path}"]))
    for override in ("lab.objectives=[grpo,popo]", "lab.mover=popo"):
        with pytest.raises(ConfigError, match="^lab: objective 'popo' reads the policy's hidden states and keeps .*; "
                           "leave it out of lab.objectives and lab.mover$"):
            validate_lab(load_experiment("lab", [override]))
    assert "popo" not in lab_objectives(load_experiment("lab", []))  # "every objective" means those it can evaluate


@pytest.mark.parametrize("setting, said", [("predictor_hidden_dim=0", "predictor_hidden_dim must be >= 1, got 0"),
                                           ("predictor_layers=1", "predictor_layers must be >= 2, got 1")])
def test_a_predictor_without_width_or_depth_is_refused_before_the_run(setting, said):
    """A predictor of width 0 outputs its last bias whatever its input: the run trained on a constant prediction."""
    with pytest.raises(ConfigError, match=said):
        run_configs(load_experiment("quickstart", ["objective.name=popo", f"objective.params.{setting}"]))
