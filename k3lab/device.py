"""Choosing the device a workbook runs on.

On CPU every Triton kernel runs under the Triton interpreter, which must be switched on before
``triton`` decorates the kernels: call :func:`use_device` before importing ``k3lab.kernels``.
"""

from __future__ import annotations

import os

import torch

__all__ = ["use_device", "interpreted", "device_name"]


def use_device(device: str | torch.device) -> torch.device:
    """Validate ``device`` ("cpu" or "cuda[:N]") and prepare it; returns the torch.device.

    "cpu" turns the Triton interpreter on (TRITON_INTERPRET=1). "cuda" without a visible GPU is a
    clear error rather than a crash inside the first kernel.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}") from exc
    if dev.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    elif dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise ValueError("device: 'cuda' with TRITON_INTERPRET=1 set; unset it to run "
                             "compiled kernels")
    else:
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    return dev


def interpreted() -> bool:
    """True when Triton kernels run under the interpreter (CPU timings are not GPU figures)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def device_name(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import platform
    return f"CPU ({platform.processor() or platform.machine()}, Triton interpreter)"
