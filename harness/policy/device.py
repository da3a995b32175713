"""Where the policy runs and in what precision: ``device`` (auto, cpu, cuda, cuda:N, mps) and ``model.dtype`` /
``model.sampler_dtype`` (float32, bfloat16, float16), with their config check."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from harness.run.checks import register_check
from harness.run.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto``: cuda when available, else cpu. On CUDA the cuDNN attention backend is switched off: it builds an
    execution plan for every new sequence length, and decoding (a new key length every step) and variable-length
    minibatches then spend most of their time building plans (docs/benchmark.md); PyTorch's flash /
    memory-efficient kernels take its place."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    return device


def sampler_dtype(cfg: DictConfig) -> torch.dtype | None:
    """The precision of a separate sampler copy (``model.sampler_dtype`` other than ``model.dtype``), or None: the
    policy samples itself."""
    m = cfg.model
    return DTYPES[m.sampler_dtype] if m.sampler_dtype not in (None, m.dtype) else None


@register_check("device")
def check_device(run: DictConfig) -> None:
    """The precisions are known; the device is auto, cpu, cuda, cuda:N or mps (whether this machine has it:
    :func:`check_device_here`, where the run executes)."""
    for key in ("dtype", "sampler_dtype"):
        if run.model[key] is not None and run.model[key] not in DTYPES:
            raise ConfigError(f"model.{key} must be one of {', '.join(DTYPES)}, got {run.model[key]!r}")
    device = run.device
    if device == "auto":
        return
    try:
        where = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from None
    if where.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device={device}: the harness runs on cpu, cuda or mps; use device=auto, cpu or cuda:N")


@register_check("device_here", when="node")
def check_device_here(run: DictConfig) -> None:
    """The run's device is one this torch can use on this machine (a sweep on a cluster leaves it to the run's
    node: the machine it is started from may have none)."""
    device = run.device
    if device == "auto":
        return
    where = torch.device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        hint = ("this torch is a CPU-only build: install a CUDA one with `make setup TORCH=torch`"
                if torch.version.cuda is None else "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)")
        raise ConfigError(f"device={device}, but {hint}; or use device=cpu / device=auto")
    if where.type == "cuda" and where.index is not None and where.index >= torch.cuda.device_count():
        raise ConfigError(f"device={device}, but this machine has {torch.cuda.device_count()} CUDA device(s) "
                          f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}); or use device=auto")
    if where.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={device}, but torch has no MPS (Apple GPU) device here; use device=cpu or "
                          "device=auto")
