"""Whether the kernels run compiled or under the Triton interpreter, decided once at import.

Triton reads ``TRITON_INTERPRET`` when it decorates a kernel, so the choice is made when
``k3lab.kernels`` is first imported: on a machine without a visible CUDA device the interpreter is
switched on (CPU tensors then run every kernel in Python), otherwise the kernels compile. A
launcher refuses tensors on a device the import did not prepare for, with a message saying how
to fix it, instead of failing deep inside Triton.
"""

from __future__ import annotations

import os

import torch

__all__ = ["INTERPRETED", "prepare", "check_device"]


def prepare() -> bool:
    """Switch the interpreter on when no GPU is visible and nobody chose; True when it is on."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET") == "1"


INTERPRETED = prepare()


def check_device(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor the kernels as imported cannot run on, naming the parameter."""
    kind = t.device.type
    if kind == "cpu" and not INTERPRETED:
        raise ValueError(
            f"{name}: CPU tensors need the Triton interpreter, but k3lab.kernels was imported "
            f"compiled; set TRITON_INTERPRET=1 (or call k3lab.device.use_device('cpu')) before "
            f"the first import of k3lab.kernels")
    if kind == "cuda" and INTERPRETED:
        raise ValueError(
            f"{name}: CUDA tensors with k3lab.kernels imported under the Triton interpreter; "
            f"unset TRITON_INTERPRET before the first import of k3lab.kernels")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a cuda (or interpreted cpu) tensor, got {t.device}")
