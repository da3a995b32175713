"""harness/policy/matmul.py: the oneDNN kernel of a run's linear layers gives F.linear's value and gradients (to float
round-off) on hand-made tensors, runs only inside its scope and from ONEDNN_MIN_ROWS rows, and the warm start does not
depend on the caller's kernel."""

from __future__ import annotations

import pytest
import torch

import harness.policy.matmul as matmul
from harness.policy.matmul import ONEDNN_MIN_ROWS, cpu_matmul, linear, linear_add
from harness.policy.models import load_model
from harness.policy.warm_start import WarmStartRecipe, warm_start
from harness.run.config import load_experiment, run_configs
from harness.run.errors import ConfigError
from harness.tasks import get_task
from tests.helpers.tiny import TINY_SPEC

pytestmark = pytest.mark.skipif(not matmul._AVAILABLE, reason="this torch has no oneDNN linear")


def _inputs(rows: int, generator: torch.Generator, shape: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    x = torch.randn(*shape, rows, 24, generator=generator, dtype=torch.float64)
    weight = torch.randn(40, 24, generator=generator, dtype=torch.float64) / 5
    bias = torch.randn(40, generator=generator, dtype=torch.float64)
    return tuple(t.float().requires_grad_() for t in (x, weight, bias))


@pytest.fixture
def onednn_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the inputs oneDNN's linear ran on (forward and backward)."""
    calls, onednn = [], matmul._onednn

    def counted(x, weight, bias):
        calls.append(tuple(x.shape))
        return onednn(x, weight, bias)

    monkeypatch.setattr(matmul, "_onednn", counted)
    return calls


@pytest.mark.parametrize("shape", [(), (3,)])
def test_onednn_linear_gives_f_linear_value_and_gradients(onednn_calls, shape):
    """Value and the gradients of x, W and b against F.linear in float64 (the exact reference), for a 2-D and a 3-D
    input; every matmul (forward, dL/dx, dL/dW) ran on oneDNN."""
    x, weight, bias = _inputs(ONEDNN_MIN_ROWS, torch.Generator().manual_seed(0), shape)
    upstream = torch.randn(*shape, ONEDNN_MIN_ROWS, 40, generator=torch.Generator().manual_seed(1))
    with cpu_matmul("onednn"):
        out = linear(x, weight, bias)
        out.backward(upstream)
    assert len(onednn_calls) == 3
    exact = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    reference = torch.nn.functional.linear(*exact)
    reference.backward(upstream.double())
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip((x, weight, bias), exact, strict=True):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-5, atol=1e-5)


def test_a_frozen_weight_gets_no_gradient_and_a_module_runs_onednn_only_inside_the_scope(onednn_calls):
    """An nn.Linear inside the scope: oneDNN forward and dL/dx only (its weight frozen, no bias); outside it, and under
    "torch", torch's kernel, bit for bit F.linear; the module's forward is restored on leaving."""
    layer = torch.nn.Linear(24, 40, bias=False).requires_grad_(False)
    x = torch.randn(ONEDNN_MIN_ROWS, 24, generator=torch.Generator().manual_seed(2), requires_grad=True)
    forward = torch.nn.Linear.forward
    with cpu_matmul("onednn"):
        layer(x).sum().backward()
    assert len(onednn_calls) == 2 and layer.weight.grad is None and x.grad is not None
    assert torch.nn.Linear.forward is forward
    for scope in (cpu_matmul("torch"), torch.no_grad()):
        with scope:
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    assert len(onednn_calls) == 2


def test_fewer_rows_keep_torch_kernel_bit_for_bit(onednn_calls):
    x, weight, bias = _inputs(ONEDNN_MIN_ROWS - 1, torch.Generator().manual_seed(3))
    with cpu_matmul("onednn"), torch.no_grad():
        assert torch.equal(linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
        residual = torch.randn(ONEDNN_MIN_ROWS - 1, 40)
        assert torch.equal(linear_add(residual, x, weight), torch.addmm(residual, x, weight.t()))
    assert onednn_calls == []


def test_linear_add_adds_the_residual_inside_the_matmul():
    x, weight, _ = (t.detach() for t in _inputs(ONEDNN_MIN_ROWS, torch.Generator().manual_seed(4)))
    residual = torch.randn(ONEDNN_MIN_ROWS, 40, generator=torch.Generator().manual_seed(5))
    with cpu_matmul("onednn"):
        out = linear_add(residual, x, weight)
    torch.testing.assert_close(out, residual + x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_a_bad_kernel_is_one_config_error():
    with pytest.raises(ConfigError, match="train.cpu_matmul must be one of auto, onednn, torch, got 'mkl'"):
        run_configs(load_experiment("quickstart", ["train.cpu_matmul=mkl"]))
    with pytest.raises(ValueError, match="cpu_matmul must be one of"), cpu_matmul("mkl"):
        pass


@pytest.mark.slow  # trains two warm starts: make test
def test_the_warm_start_builds_the_same_weights_under_either_kernel_of_the_caller(rlvr_cache):
    """The warm start pins its kernel (WARM_START_MATMUL, auto's): built inside a "torch" and a "onednn" scope it
    takes the same steps to the same bits (the two kernels' weights part ways within these steps), and says which
    kernel it ran."""
    task = get_task("arith", num_operands=2, digits=1, train_size=2000, eval_size=8)
    recipe = WarmStartRecipe(max_steps=20, lr=1e-2, batch_size=16, seed=0)
    built = []
    for kernel in ("torch", "onednn"):
        model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
        with cpu_matmul(kernel):
            model, sidecar = warm_start(model, tokenizer, task, recipe, cache_key_extra=kernel)  # not a cache hit
        assert sidecar["matmul"] == matmul.resolve("auto")
        built.append(model.state_dict())
    assert all(torch.equal(built[0][k], built[1][k]) for k in built[0])


@pytest.mark.parametrize("cpu_name, capability, available, onednn", [
    ("AuthenticAMD family 26 model 2", "AVX512", True, True),  # MKL's narrower path: oneDNN
    ("AuthenticAMD family 23 model 49", "AVX2", True, False),  # the same width: MKL's whole runs were faster
    ("GenuineIntel family 6 model 143", "AVX512", True, False),  # MKL's widest path
    ("AuthenticAMD family 26 model 2", "AVX512", False, False)])  # no oneDNN linear in this torch
def test_auto_takes_onednn_only_on_amd_processors_with_avx512(cpu_name, capability, available, onednn):
    assert matmul.auto_onednn(cpu_name, capability, available) is onednn


@pytest.mark.parametrize("here", [True, False])
def test_an_auto_scope_runs_the_kernel_auto_takes_on_this_cpu(onednn_calls, monkeypatch, here):
    monkeypatch.setattr(matmul, "AUTO_ONEDNN", here)
    x, weight, bias = (t.detach() for t in _inputs(ONEDNN_MIN_ROWS, torch.Generator().manual_seed(6)))
    with cpu_matmul("auto"):
        out = linear(x, weight, bias)
    assert len(onednn_calls) == here and matmul.resolve("auto") == ("onednn" if here else "torch")
    if not here:
        assert torch.equal(out, torch.nn.functional.linear(x, weight, bias))
