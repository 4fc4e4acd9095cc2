"""Choosing the device a workbook runs on.

On CPU every Triton kernel runs under the Triton interpreter, which must be on when ``triton``
decorates the kernels. ``k3lab.kernels`` switches it on by itself at import on a machine without a
visible GPU; on a GPU machine call :func:`use_device` ("cpu") before the first import of
``k3lab.kernels`` to run on the CPU there.
"""

from __future__ import annotations

import os
import sys

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
    kernels = sys.modules.get("k3lab.kernels")
    if dev.type == "cpu":
        if kernels is not None and not kernels.INTERPRETED:
            raise ValueError("device: 'cpu' after k3lab.kernels was imported compiled; set "
                             "TRITON_INTERPRET=1 (or call use_device('cpu')) before the first "
                             "import of k3lab.kernels, or run in a fresh process")
        os.environ["TRITON_INTERPRET"] = "1"
    elif dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
        if os.environ.get("TRITON_INTERPRET") == "1" or (kernels and kernels.INTERPRETED):
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
