"""POPO — positive-only policy optimisation (arXiv 2605.06650), registered as ``popo``.
Reference: the authors' momo1443/colm2026-POPO (commit 7f22607bcf406fe05e2667a0da6d74d0f6f6b311):
``src/popo/weights.py`` (``compute_popo_weights``, ``compute_sequence_log_probs``), ``src/popo/loss.py``
(``POPOLoss``), ``src/popo/ema.py`` (``EMATargetPolicy``), ``src/popo/predictor.py`` (``PredictorMLP``),
``src/popo/trainer.py`` (``_masked_mean_pool``, ``_precompute_popo_weights``, ``_compute_loss``,
``create_optimizer``, checkpoints), ``configs/popo/default.yaml`` (the defaults below).

The first objective with state of its own, provided by the loop through the objective interface
(objectives/base.py: ``stateful``, ``setup``, ``trainable_parameters``, ``after_optimizer_step``, ``state_dict``,
``needs_hidden_states``): a predictor MLP h_phi (trained in its own optimizer group, at the run's lr and weight
decay as the authors' ``create_optimizer``), an EMA target copy of the policy (xi <- tau xi + (1 - tau) theta after
each applied optimizer step, the authors' ``EMAUpdateCallback.on_step_end``), both in the run's checkpoint; the
policy's hidden states with gradient (``PolicyBatch.hidden``) and the target's (``PolicyBatch.hidden_of``).

With positives S+(x) = {y : R(y) > tau_r} (tau_r = 0 for binary rewards) in each prompt's group:

    s(y)    = (1/|y|) sum_t logp_t(y)                                 (length-normalised, from the rollout policy)
    w(y)    = softmax_{y' in S+(x)} (s(y') / T)[y]  for y in S+(x), 0 otherwise       weight_mode "softmax" (Eq. 8)
    w(y)    = 1 / |S+(x)|                            for y in S+(x), 0 otherwise       weight_mode "uniform"
              (length_normalize: w / |y| renormalised over S+(x)); a group with no positive: all 0
    L_NLL   = sum_y w(y) sum_t (-logp_t(y)) / (number of tokens of the responses with w > 0)
    L_sim   = -sum_y w(y) cos(h_phi(z(y)), sg(z_target(y) + noise)) / max(sum_y w(y), 1e-8)
    L_ent   = -(mean entropy over valid tokens)
    L_POPO  = L_NLL + alpha L_sim + beta_entropy L_ent      (alpha 0.1, beta_entropy 0.01 in the authors' config)
    z(y)    = mean over y's valid tokens of the last-layer hidden states (``masked_mean_pool``)
    EMA     xi <- tau xi + (1 - tau) theta after each optimizer step (tau 0.995 in the config)

The weights are computed once per rollout batch without gradient (the authors' ``_precompute_popo_weights`` runs the
policy under ``torch.no_grad`` right after generation), so they are constants of the loss: here from
``PolicyBatch.old_logp``, the behaviour policy's log-probs (the same policy with ``train.epochs=1``, the authors'
``num_iterations: 1``). The authors group by contiguous blocks of ``num_generations``; here by ``group_ids`` (the
same when the groups are contiguous, tested). Positives: ``rewards > tau_r`` (the run's reward; the authors average
their reward functions). A batch with no positive has loss 0 and no gradient (the authors' zero loss, entropy term
included).

Our choices, where the loop differs from the authors' TRL trainer:
- pooled features: the mean of the hidden states that *predict* the completion tokens (the shared forward's: the
  last prompt token's through the second-to-last completion token's); the authors pool the states *at* the
  completion tokens (one position later: the first completion token's through the last's), which the shared
  forward does not compute. Same for the EMA target.
- the loss is over the whole minibatch (``needs_whole_minibatch``); the authors evaluate it per micro-batch of
  ``per_device_train_batch_size`` sequences and average (their L_NLL and L_sim normalisers are per micro-batch).
- the target-feature noise N(0, feature_noise_std^2) (training only in theirs; always here: the loss is only
  evaluated in training) is drawn from a generator seeded by (``noise_seed``, optimizer step), so a resumed run
  draws what the uninterrupted one drew; theirs is the global random stream.
- the predictor's Xavier initialisation draws from a generator seeded by ``noise_seed`` (theirs: the global stream).
- gradient clipping (``train.max_grad_norm``) covers the policy's parameters only, as the authors' Trainer clips
  ``model.parameters()`` (the predictor is outside the model).
- POPO is native-loop only: TRL's trainer and the gradient lab do not provide its state (one-line refusals).
- a rollout correction (or OPSM / top-entropy masking) weight multiplies each token's NLL term and, by its token mean,
  each sequence's similarity term, the normalisers unchanged (the authors have none); the KL to a reference (beta,
  the authors' 0) is the shared term. ``aggregation`` accepts only token_mean: the loss has its own normalisers.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from objectives.base import Objective, PolicyBatch, ratio_metrics, register_objective

WEIGHT_MODES = ("softmax", "uniform")
WEIGHT_SUM_EPS = 1e-8  # the authors' clamp of sum(w) in L_sim and of the renormalisation


def length_normalised_logp(logp: Tensor, mask: Tensor) -> Tensor:
    """s_i = sum_t mask * logp / max(L_i, 1) [B] (the authors' ``compute_sequence_log_probs``)."""
    m = mask.to(logp.dtype)
    return (logp * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def popo_weights(logp: Tensor, mask: Tensor, positive: Tensor, group_ids: Tensor, temperature: float = 1.0,
                 mode: str = "softmax", length_normalize: bool = False) -> Tensor:
    """w [B] (module docstring): self-normalised over each group's positives, 0 for negatives and for every
    response of a group with no positive; detached."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"POPO weight mode must be one of {WEIGHT_MODES}, got {mode!r}")
    positive = positive.bool()
    logp = logp.detach()
    _, index = torch.unique(group_ids, return_inverse=True)
    groups = int(index.max()) + 1 if index.numel() else 0
    if mode == "softmax":
        score = torch.where(positive, length_normalised_logp(logp, mask) / temperature,
                            torch.full_like(logp[:, 0], -torch.inf))
        top = torch.full((groups,), -torch.inf, dtype=score.dtype).scatter_reduce(0, index, score, "amax")
        shifted = torch.where(positive, torch.exp(score - top[index]), torch.zeros_like(score))
    else:
        shifted = positive.to(logp.dtype)
    total = torch.zeros(groups, dtype=shifted.dtype).index_add_(0, index, shifted)
    weights = torch.where(positive, shifted / total[index].clamp(min=torch.finfo(shifted.dtype).tiny),
                          torch.zeros_like(shifted))
    if length_normalize:
        weights = weights / mask.to(weights.dtype).sum(-1).clamp(min=1.0)
        total = torch.zeros(groups, dtype=weights.dtype).index_add_(0, index, weights)
        weights = weights / total[index].clamp(min=WEIGHT_SUM_EPS)
    return weights


def popo_nll(logp: Tensor, mask: Tensor, weights: Tensor) -> Tensor:
    """L_NLL: the weighted negative log-likelihood over the positives' tokens, normalised by their token count."""
    m = mask.to(logp.dtype)
    weighted = weights[:, None] * torch.where(mask.bool(), -logp, torch.zeros_like(logp)) * m
    count = ((weights > 0)[:, None].to(m.dtype) * m).sum().clamp(min=1.0)
    return weighted.sum() / count


def popo_similarity(predicted: Tensor, target: Tensor, weights: Tensor, noise: Tensor | None = None,
                    scale: Tensor | None = None) -> Tensor:
    """L_sim: minus the weighted cosine between the predictor's output h_phi(z) [B, D] and the stop-gradient EMA
    target features (+ ``noise``, the authors' Gaussian N(0, 0.02^2) in training), normalised by sum(w).
    ``scale`` [B] (ours: the rollout correction's per-sequence weight) multiplies each term, not the normaliser."""
    target = target.detach() if noise is None else target.detach() + noise
    cos = (F.normalize(predicted, dim=-1) * F.normalize(target, dim=-1)).sum(-1)
    terms = weights * cos if scale is None else weights * scale.to(cos.dtype) * cos
    return -terms.sum() / weights.sum().clamp(min=WEIGHT_SUM_EPS)


def popo_entropy(entropies: Tensor, mask: Tensor) -> Tensor:
    """L_ent = -mean entropy over the valid tokens (minimising it raises the entropy)."""
    m = mask.to(entropies.dtype)
    return -(entropies * m).sum() / m.sum().clamp(min=1.0)


def popo_loss(logp: Tensor, mask: Tensor, weights: Tensor, entropies: Tensor, predicted: Tensor, target: Tensor,
              alpha: float = 0.1, beta_entropy: float = 0.01, noise: Tensor | None = None) -> Tensor:
    """L_POPO = L_NLL + alpha L_sim + beta_entropy L_ent (the authors' ``POPOLoss.__call__``)."""
    return (popo_nll(logp, mask, weights) + alpha * popo_similarity(predicted, target, weights, noise)
            + beta_entropy * popo_entropy(entropies, mask))


def masked_mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """z [B, D]: the mean of the hidden states [B, T, D] over each response's valid tokens."""
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


@torch.no_grad()
def ema_update(target: list[Tensor], online: list[Tensor], tau: float) -> None:
    """xi <- tau xi + (1 - tau) theta, in place, parameter by parameter (the authors' ``EMATarget.update``)."""
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"EMA tau must be in [0, 1], got {tau}")
    for xi, theta in zip(target, online, strict=True):
        xi.mul_(tau).add_(theta.to(xi.device), alpha=1.0 - tau)


class PredictorMLP(torch.nn.Module):
    """h_phi (the authors' ``PredictorMLP``): [Linear -> LayerNorm -> ReLU] x (layers - 1) -> Linear, input and
    output the policy's hidden size, Xavier-uniform weights and zero biases."""

    def __init__(self, size: int, hidden: int, layers: int, generator: torch.Generator | None = None):
        super().__init__()
        if layers < 2:
            raise ValueError(f"POPO predictor_layers must be >= 2, got {layers}")
        dims = [size] + [hidden] * (layers - 1)
        parts: list[torch.nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:], strict=True):
            parts += [torch.nn.Linear(a, b), torch.nn.LayerNorm(b), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*parts, torch.nn.Linear(hidden, size))
        for module in self.net:
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight, generator=generator)
                torch.nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


@register_objective("popo")
class POPO(Objective):
    """Positive-only policy optimisation: L_NLL + alpha L_sim + beta_entropy L_ent (module docstring)."""
    ratio_level = "other"
    ratio_note = "none: a likelihood of the positives weighted by behaviour log-probs"

    needs_whole_minibatch: ClassVar[bool] = True
    needs_hidden_states: ClassVar[bool] = True
    stateful: ClassVar[bool] = True
    policy_copies: ClassVar[int] = 1  # the EMA target
    aggregations: ClassVar[tuple[str, ...]] = ("token_mean",)  # its own normalisers (module docstring)

    alpha: float = 0.1  # weight of the similarity loss L_sim (the authors' config: 0.1)
    beta_entropy: float = 0.01  # weight of L_ent = -mean entropy (0.01); 0 in a batch with no positive (theirs)
    tau: float = 0.995  # EMA momentum of the target policy
    tau_r: float = 0.0  # reward threshold of a positive (R > tau_r; 0 for binary rewards)
    weight_mode: str = "softmax"  # softmax (over the group's positives of s(y) / weight_temperature) or uniform
    weight_temperature: float = 1.0  # T of the softmax weights
    length_normalize: bool = False  # weights / |y|, renormalised within the group (the authors' option)
    predictor_hidden_dim: int = 1024  # width of the predictor MLP
    predictor_layers: int = 2  # linear layers of the predictor MLP (>= 2)
    feature_noise_std: float = 0.02  # std of the Gaussian noise on the target features
    noise_seed: int = 0  # seeds the predictor's initialisation and the target-feature noise (our choice)

    positive: ClassVar[frozenset[str]] = frozenset({"weight_temperature"})
    signed: ClassVar[frozenset[str]] = frozenset({"tau_r"})
    seeds: ClassVar[frozenset[str]] = frozenset({"noise_seed"})

    def validate(self) -> None:
        if self.weight_mode not in WEIGHT_MODES:
            raise ValueError(f"objective 'popo': weight_mode must be one of {WEIGHT_MODES}, got {self.weight_mode!r}")
        if self.tau > 1:
            raise ValueError(f"objective 'popo': tau (EMA momentum) must be in [0, 1], got {self.tau}")
        if self.predictor_layers < 2:
            raise ValueError(f"objective 'popo': predictor_layers must be >= 2, got {self.predictor_layers}")
        if self.predictor_hidden_dim < 1:  # width 0: the predictor's output is its last bias, whatever its input
            raise ValueError(f"objective 'popo': predictor_hidden_dim must be >= 1, got {self.predictor_hidden_dim}")

    def __post_init__(self):
        super().__post_init__()
        self.predictor: PredictorMLP | None = None  # built by setup(policy)
        self.target: torch.nn.Module | None = None  # the EMA copy of the policy, built by setup(policy)

    def entropy_need(self) -> str:
        return "gradient" if self.beta_entropy > 0 else super().entropy_need()

    def setup(self, policy: torch.nn.Module) -> None:
        """The predictor (on the policy's device, float32 as the authors') and the EMA target: a frozen copy."""
        size = policy.config.get_text_config().hidden_size
        device = next(policy.parameters()).device
        generator = torch.Generator().manual_seed(self.noise_seed)
        self.predictor = PredictorMLP(size, self.predictor_hidden_dim, self.predictor_layers, generator).to(device)
        self.target = copy.deepcopy(policy).requires_grad_(False).eval()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self._built().predictor.parameters())

    def trained_parameter_count(self, hidden_size: int) -> int:
        """PredictorMLP's: each Linear's weights and bias and each LayerNorm's two vectors (in closed form: no list
        of layers, however many)."""
        width, inner_layers = self.predictor_hidden_dim, self.predictor_layers - 2  # width -> width, after the first
        first = hidden_size * width + 3 * width
        return first + inner_layers * (width * width + 3 * width) + width * hidden_size + hidden_size

    def after_optimizer_step(self, policy: torch.nn.Module, metrics: dict[str, float]) -> None:
        ema_update(list(self._built().target.parameters()), list(policy.parameters()), self.tau)

    def state_dict(self) -> dict:
        built = self._built()
        return {"predictor": built.predictor.state_dict(), "target": built.target.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        built = self._built()
        built.predictor.load_state_dict(state["predictor"])
        built.target.load_state_dict(state["target"])

    def _built(self) -> POPO:
        if self.predictor is None:
            raise ValueError("objective 'popo' has no predictor and target yet: the loop calls setup(policy) first")
        return self

    def policy_loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, float]]:
        if batch.rewards is None or batch.group_ids is None or batch.hidden is None or batch.hidden_of is None:
            raise ValueError("objective 'popo' needs PolicyBatch.rewards, group_ids, hidden and hidden_of")
        self._built()
        positive = batch.rewards > self.tau_r
        weights = popo_weights(batch.old_logp, batch.mask, positive, batch.group_ids, self.weight_temperature,
                               self.weight_mode, self.length_normalize).to(batch.logp.dtype)
        dtype = next(self.predictor.parameters()).dtype
        predicted = self.predictor(masked_mean_pool(batch.hidden, batch.mask).to(dtype))
        with torch.no_grad():
            target = masked_mean_pool(batch.hidden_of(self.target), batch.mask).to(dtype)
        generator = torch.Generator().manual_seed(self.noise_seed * 1_000_003 + batch.step)
        noise = (torch.randn(target.shape, generator=generator, dtype=dtype) * self.feature_noise_std).to(
            target.device) if self.feature_noise_std > 0 else None
        metrics = {"popo_positive_frac": positive.float().mean().item(), "clip_frac": 0.0, "clip_frac_low": 0.0,
                   "clip_frac_high": 0.0, **ratio_metrics(torch.exp(batch.log_ratio()), batch.mask)}
        if not bool(positive.any()):  # the authors' graph-connected zero
            zero = 0.0 * batch.logp.sum() + 0.0 * predicted.sum()
            return zero, {**metrics, "popo_nll": 0.0, "popo_sim": 0.0, "popo_ent": 0.0}
        # a rollout-correction weight (and OPSM / top-entropy masks) multiplies each token's NLL and each sequence's
        # similarity term (its token mean), the normalisers unchanged, as the shared aggregation does elsewhere
        logp = batch.logp if batch.correction is None else batch.logp * batch.correction
        nll = popo_nll(logp, batch.mask, weights)
        sim = popo_similarity(predicted, target, weights.to(dtype), noise, batch.sequence_correction())
        ent = popo_entropy(batch.entropy, batch.mask) if self.beta_entropy > 0 else nll.new_zeros(())
        loss = nll + self.alpha * sim.to(nll.dtype) + self.beta_entropy * ent
        return loss, {**metrics, "popo_nll": nll.item(), "popo_sim": sim.item(), "popo_ent": ent.item()}
