"""Which device and number type a process computes in: the ``device`` and ``precision`` settings resolved."""

from __future__ import annotations

import os

import torch

from loomrl.errors import ConfigError

__all__ = ["available_devices", "resolve_device", "resolve_dtype", "set_threads"]


def resolve_device(kind: str, field: str = "runtime.device") -> torch.device:
    """'auto' → the accelerator when one is present, else cpu; 'cuda' without one is a config error."""
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{field}: 'cuda' requested but no CUDA device is available (valid here: auto, cpu)")
    return torch.device(kind)


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The weights' dtype of ``runtime.precision`` on ``device``: 'auto' is bf16 on accelerators (what their
    matmul units and the planner's cost model assume), fp32 on CPU (where bf16 matmuls are emulated)."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]


def set_threads(threads: int) -> None:
    """Use ``threads`` CPU threads for torch's operators (0: leave torch's choice)."""
    if threads > 0:
        torch.set_num_threads(threads)


def available_devices() -> int:
    """GPUs if there are any, else CPU cores: the device count of ``runtime.devices=0`` on this machine."""
    return torch.cuda.device_count() or os.cpu_count() or 1
