"""Whether the kernels run compiled or under the Triton interpreter, decided once at import.

Triton reads ``TRITON_INTERPRET`` when it decorates a kernel, so the choice is made when
``k3lab.kernels`` is first imported: on a machine without a visible CUDA device the interpreter is
switched on (CPU tensors then run every kernel in Python), otherwise the kernels compile. A
launcher refuses tensors on a device the import did not prepare for, with a message saying how
to fix it, instead of failing deep inside Triton.
"""

from __future__ import annotations

import math
import os

import torch

__all__ = ["INTERPRETED", "prepare", "prime_cache_keys", "check_device", "check_tensor",
           "check_number", "VALIDATE_MODES", "check_validate", "zeroed_words"]


def prepare() -> bool:
    """Switch the interpreter on when no GPU is visible and nobody chose; True when it is on."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET") == "1"


INTERPRETED = prepare()


def _index(self) -> int:
    """An interpreted scalar as an index (``range(0, n, BLOCK)`` with ``n`` a kernel argument).
    Its value is a one-element array, which Triton up to 3.6 turned into an int the way NumPy
    2.4 refuses; take the element instead."""
    return int(self.handle.data.reshape(-1)[0])


def _patch_once_per_launch() -> bool:
    """Under the interpreter, patch triton.language once a launch, not once a device call.

    Triton's interpreter swaps the language's builtins for interpreted ones when a kernel starts
    and restores them when it ends; it also re-runs the swap (an ``inspect.getmembers`` walk of
    ``tl``, ``tl.core`` and ``tl.tensor``) on every call of a ``@triton.jit`` helper, where the
    swap is already in place, and that walk is about a third of an interpreted kernel's time.
    Here a helper's call swaps only the language modules the launch has not swapped yet (their
    changes join the launch's, undone when it ends). Anything unexpected in Triton's internals
    leaves them as they are (False).
    """
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as ip

    patch, scope_type = getattr(ip, "_patch_lang", None), getattr(ip, "_LangPatchScope", None)
    if patch is None or scope_type is None or getattr(patch, "k3lab", False) or \
            not isinstance(getattr(scope_type(), "_changes", None), list):
        return False
    active: list = []  # per running launch: (ids of the language modules swapped, its scope)

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values()
                if inspect.ismodule(v) and (v is tl or v is tl.core)}

    class LaunchScope(scope_type):
        def restore(self):
            super().restore()
            active.pop()

    def swap(fn) -> list:
        changes = patch(fn)._changes
        if "__index__" in vars(tl.core.tensor):  # undone with the rest when the launch ends
            tl.core.tensor.__index__ = _index
        return changes

    def patch_lang(fn):
        need = langs(fn)
        if active:  # a helper inside a launch: swap only modules the launch has not
            done, launch = active[-1]
            if not need <= done:
                launch._changes.extend(swap(fn))  # restored with the launch's
                done |= need
            return scope_type()
        launch = LaunchScope()
        launch._changes = swap(fn)
        active.append((need, launch))
        return launch

    patch_lang.k3lab = True
    ip._patch_lang = patch_lang
    return True


if INTERPRETED:
    _patch_once_per_launch()


def _callees(fn, jit_type) -> list:
    """The @triton.jit functions ``fn``'s source names (``f`` or ``module.f``), in its globals."""
    import ast

    scope, out = fn.__globals__, []
    for node in ast.walk(fn.parse()):
        if isinstance(node, ast.Name):
            v = scope.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            v = getattr(scope.get(node.value.id), node.attr, None)
        else:
            continue
        if isinstance(v, jit_type) and v is not fn:
            out.append(v)
    return out


def prime_cache_keys(package: str) -> int:
    """Import every module of ``package`` and compute the cache key of each @triton.jit
    function in them, callees before callers; returns how many. Up to Triton 3.6 a caller's
    key takes in its callees' global constexprs only where the callee's key already exists,
    so a kernel's key depended on what the process had compiled before, and the compile
    workers of k3lab.precompile and a notebook disagreed (the notebook compiled again). In
    this order every process computes the same keys. Nothing under the interpreter."""
    import importlib
    import pkgutil
    import sys

    from triton.runtime import jit

    jit_type = getattr(jit, "JITCallable", jit.JITFunction)
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        importlib.import_module(info.name)
    fns = {id(v): v for name, mod in list(sys.modules.items())
           if mod is not None and (name == package or name.startswith(package + "."))
           for v in vars(mod).values() if isinstance(v, jit_type)}
    done: set[int] = set()

    def prime(fn) -> None:
        if id(fn) in done:
            return
        done.add(id(fn))
        for callee in _callees(fn, jit_type):
            prime(callee)
        fn.cache_key  # noqa: B018 - computed and kept by Triton

    for fn in fns.values():
        prime(fn)
    return len(fns)


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


def check_tensor(name: str, t, *, dtypes, dim: int, device=None) -> None:
    """Refuse anything but a contiguous tensor of one of ``dtypes`` with ``dim`` dimensions (on
    ``device`` when given) that the kernels can run on, naming the parameter."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    check_device(name, t)
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_number(name: str, value, *, positive: bool = False) -> float:
    """A finite real number (a Python int or float, not a bool, string or tensor), > 0 when
    ``positive``, as a float; anything else is a ValueError naming the parameter."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name}: expected a positive number, got {value!r}")
    return float(value)


def check_max_registers(name: str, value) -> int:
    """A register cap a thread (Triton's ``maxnreg``): 0 (none) or an int in [24, 255]."""
    if isinstance(value, bool) or not isinstance(value, int) or not (
            value == 0 or 24 <= value <= 255):
        raise ValueError(f"{name}: expected 0 or an int in [24, 255], got {value!r}")
    return value


# How much a launcher checks on entry: "cheap" (shapes, dtypes, devices, scalars: no host sync,
# so CUDA-graph capture works) or "full" (also values in device tensors: a host sync per call).
VALIDATE_MODES = ("cheap", "full")


def check_validate(validate) -> str:
    if validate not in VALIDATE_MODES:
        raise ValueError(f"validate: expected one of {VALIDATE_MODES}, got {validate!r}")
    return validate


def zeroed_words(store: dict, device: torch.device, n: int, *, error: str, minimum: int = 1,
                 capturing: bool | None = None) -> torch.Tensor:
    """At least ``n`` zeroed int32 words for ``device``, kept in ``store``: the kernels that
    count on them (tickets, completion counters, sync words) leave them zero, so one allocation
    serves every call and every CUDA-graph replay. They are made, or grown (to at least
    ``minimum``), only outside a capture; inside one (``capturing``; None asks the current
    stream) that is a ValueError with the launcher's ``error``."""
    buf = store.get(device)
    if buf is None or buf.numel() < n:
        if capturing is None:
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing:
            raise ValueError(error)
        buf = store[device] = torch.zeros(max(n, minimum), dtype=torch.int32, device=device)
    return buf
