"""The CPU kernel of a native run's float32 linear layers (``train.cpu_matmul``): torch's default, MKL's GEMM, or
oneDNN's, the library torch.compile's CPU backend uses for linear layers; ``auto`` (the default) takes oneDNN's
where MKL's vendor dispatch leaves vector width unused (:data:`AUTO_ONEDNN`), else torch's.

    with cpu_matmul("onednn"):        # every nn.Linear forward and backward, and the decoders' stacked matmuls
        ...                           # (harness/policy/decode.py), on CPU float32 inputs of >= ONEDNN_MIN_ROWS rows
    y = linear(x, weight, bias)       # F.linear, through the kernel of the current scope
    resolve("auto")                   # "onednn" or "torch": the kernel auto takes on this CPU

Both compute y = x W^T + b in float32 with float32 accumulation; they differ in the order of their sums, so a run's
numbers agree to float round-off, not bit for bit, between the kernels, and are bit-equal from run to run under
one. MKL dispatches its GEMM by CPU vendor: on AMD processors it takes a narrower code path than the instruction set
allows, which oneDNN (dispatching by instruction set) does not (``make bench MATMULS=1`` compares them;
docs/benchmark.md). On CPUs other than x86, torch's kernel runs under either setting. A few rows pay oneDNN's larger
fixed cost per call, so inputs of fewer than :data:`ONEDNN_MIN_ROWS` rows keep torch's kernel (the shape decides,
never a timing: the same run takes the same kernels on every machine of one CPU kind). Outside a scope, and for
every other dtype or device, torch's kernel runs. A run's loop (harness/loop/native.py, the TRL backend's), the
gradient lab's measurements and the bench's native side run in a scope of ``train.cpu_matmul``; the warm start
(harness/policy/warm_start.py) in one of its own (``WARM_START_MATMUL``), so a starting policy does not depend on the
run's setting.

``auto``: oneDNN on AMD processors with AVX512 (where MKL takes its narrower path), torch's kernel elsewhere: on
AVX2-only AMD processors both take the same width and whole runs were faster on MKL's, and on Intel processors MKL
takes its widest path (docs/replicates.md, "Throughput", has the measurements). The
choice is a function of the CPU alone, which every run records (harness/run/provenance.py), so a run's kernel is
known from its config and its record.

The backward of a oneDNN linear runs oneDNN too: dL/dx = dL/dy W, dL/dW = (dL/dy)^T x, dL/db = the sum of dL/dy
over rows (:class:`_OneDnnLinear`; tests/test_matmul.py pins value and gradient to F.linear's).
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from omegaconf import DictConfig
from torch import Tensor

from harness.run.checks import register_check
from harness.run.errors import ConfigError
from harness.run.provenance import cpu

KERNELS = ("auto", "onednn", "torch")  # train.cpu_matmul
ONEDNN_MIN_ROWS = 16  # fewer rows (a decode step's last rows): MKL's smaller per-call cost wins
_scope = ["torch"]  # the kernel of the innermost cpu_matmul scope


@register_check("cpu_matmul")
def check_cpu_matmul(run: DictConfig) -> None:
    """``train.cpu_matmul``: one of :data:`KERNELS`."""
    if run.train.cpu_matmul not in KERNELS:
        raise ConfigError(f"train.cpu_matmul must be one of {', '.join(KERNELS)}, got {run.train.cpu_matmul!r}")


@contextmanager
def cpu_matmul(kernel: str) -> Iterator[None]:
    """Inside: ``nn.Linear`` modules and :func:`linear` run ``kernel`` (:data:`KERNELS`) where it applies (module
    docstring); restored on leaving."""
    forward = torch.nn.Linear.forward
    _scope.append(resolve(kernel))
    torch.nn.Linear.forward = _module_forward
    try:
        yield
    finally:
        _scope.pop()
        torch.nn.Linear.forward = forward


def resolve(kernel: str) -> str:
    """The kernel a scope of ``kernel`` (:data:`KERNELS`) runs on this CPU: "onednn" or "torch"."""
    if kernel not in KERNELS:
        raise ValueError(f"cpu_matmul must be one of {', '.join(KERNELS)}, got {kernel!r}")
    return "onednn" if kernel == "onednn" or (kernel == "auto" and AUTO_ONEDNN) else "torch"


def onednn_applies(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`linear` of ``x`` by ``weight`` runs oneDNN here: its scope, CPU float32, enough rows, not in a
    graph torch.compile traces (``train.compile_sampler``: inductor picks its own kernels there)."""
    return (_scope[-1] == "onednn" and not torch.compiler.is_compiling()  # inductor lowers only its own oneDNN
            and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not (x.is_mkldnn or weight.is_mkldnn) and x.dim() >= 2
            and x.numel() >= ONEDNN_MIN_ROWS * x.shape[-1] and _AVAILABLE)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` through the current scope's kernel."""
    if not onednn_applies(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _OneDnnLinear.apply(x, weight, bias)
    return _onednn(x, weight, bias)


def linear_add(residual: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    """``residual + x W^T`` (x [n, in]), the sum inside the matmul: ``torch.addmm`` or oneDNN's add post-op."""
    if onednn_applies(x, weight):
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual, weight, None, "add")
    return torch.addmm(residual, x, weight.t())


def _module_forward(module: torch.nn.Linear, x: Tensor) -> Tensor:
    return linear(x, module.weight, module.bias)


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    """y = x W^T + b through oneDNN, its gradients through oneDNN too (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.with_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = _onednn(grad, weight.t(), None) if ctx.needs_input_grad[0] else None
        inputs = x.reshape(-1, x.shape[-1])
        grad_weight = _onednn(rows.t(), inputs.t(), None) if ctx.needs_input_grad[1] else None
        grad_bias = rows.sum(0) if ctx.with_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


# x86 only: where MKL is torch's GEMM (measured there); other CPUs keep torch's kernel under either setting
_AVAILABLE = (platform.machine().lower() in ("x86_64", "amd64") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
              and torch.backends.mkldnn.is_available())


def auto_onednn(cpu_name: str, capability: str, available: bool = True) -> bool:
    """auto's choice (module docstring) on a CPU (harness.run.provenance.cpu) with torch's ``capability``
    (``torch.backends.cpu.get_cpu_capability()``): oneDNN on AMD with AVX512, where it was measured faster than MKL."""
    return available and cpu_name.startswith("AuthenticAMD") and capability == "AVX512"


AUTO_ONEDNN = auto_onednn(cpu(), torch.backends.cpu.get_cpu_capability(), _AVAILABLE)  # on this machine
