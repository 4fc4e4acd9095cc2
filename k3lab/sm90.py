"""The kernels compiled for sm_90 on a machine without a GPU: what a build costs a kernel on an
H100 or H200 (registers a thread, stack bytes, static shared memory), with nothing run.

:func:`compile_here` imports ``k3lab.kernels`` compiled (``TRITON_INTERPRET=0``) under a stub
driver that reports an sm_90 target; call it in a fresh process, before anything imports the
kernels. Inside :func:`builds` every Triton launch is then a compile (a warm-up): the launchers
run as usual on CPU tensors, validate them and choose their tiles, and their outputs are left
unwritten, so host code that reads a kernel's output sees garbage. :func:`usage` reads a compiled
kernel's resources from its cubin with the ``cuobjdump`` of Triton's NVIDIA backend.

Stack bytes are the thread's local frame: spilled registers, and arrays ptxas keeps in local
memory. These are build facts, not timings: a kernel that fits more programs an SM may still be
slower, and only the GPU says by how much (``python -m benchmarks.run ... --device sm90`` puts
them in the results CSV beside the timings of the same points).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["compile_here", "allow_cpu_tensors", "builds", "usage", "count_front_ends",
           "cuobjdump", "Built", "Launch", "TARGET"]

TARGET = "sm_90"


def _stub_driver():
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class H200Stub(DriverBase):
        """The active driver: an sm_90 target, device 0, stream 0; nothing else is called."""

        @classmethod
        def is_active(cls):
            return True

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return None

        def get_benchmarker(self):
            return None

        def map_python_to_cpp_type(self, ty):
            return ty

    return H200Stub()


def allow_cpu_tensors() -> None:
    """The launchers take CPU tensors (nothing launches: every launch is a compile)."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("k3lab.kernels") and hasattr(mod, "check_device"):
            mod.check_device = lambda name, t: None


def compile_here() -> None:
    """Import the kernels compiled for sm_90 under the stub driver, taking CPU tensors. Raises
    ValueError where this process already imported them under the interpreter."""
    kernels = sys.modules.get("k3lab.kernels")
    if kernels is not None and kernels.INTERPRETED:
        raise ValueError("device: 'sm90' after k3lab.kernels was imported under the "
                         "interpreter; build in a fresh process")
    os.environ["TRITON_INTERPRET"] = "0"
    import triton

    triton.runtime.driver.set_active(_stub_driver())
    import k3lab.kernels  # noqa: F401

    allow_cpu_tensors()


def count_front_ends() -> list[str]:
    """The names of the kernels whose front end (``ASTSource.make_ir``) runs in this process
    from now on: none where every kernel comes compiled from Triton's cache."""
    from triton.compiler import ASTSource

    built_here: list[str] = []
    make_ir = ASTSource.make_ir

    def counting_ir(self, *args, **kwargs):
        built_here.append(self.name)
        return make_ir(self, *args, **kwargs)

    ASTSource.make_ir = counting_ir
    return built_here


@dataclass(frozen=True)
class Launch:
    """One launch compiled inside :func:`builds`: the kernel's name, the compiled kernel, the
    grid, the label :func:`builds` was given for it (None without one) and the shapes of its
    tensor arguments, in order."""

    name: str
    kernel: object
    grid: object
    label: str | None
    shapes: tuple[tuple[int, ...], ...]


class Built(list):
    """The launches compiled inside :func:`builds` (:class:`Launch`), in order."""


@contextlib.contextmanager
def builds(label: Callable[[], str] | None = None) -> Iterator[Built]:
    """Every Triton launch inside compiles and does not run; yields the launches in order.
    label: called at each launch, its answer kept with it (where in a larger run it was)."""
    import torch
    import triton.runtime.jit as jit

    built = Built()
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kw):
        kernel = run(self, *args, grid=grid, warmup=True, **kw)
        shapes = tuple(tuple(a.shape) for a in (*args, *kw.values())
                       if isinstance(a, torch.Tensor))
        built.append(Launch(self.fn.__name__, kernel, grid, label() if label else None, shapes))
        return kernel

    jit.JITFunction.run = compile_only
    try:
        yield built
    finally:
        jit.JITFunction.run = run


def cuobjdump() -> Path:
    """The cuobjdump of Triton's NVIDIA backend (RuntimeError where it has none)."""
    try:
        import triton.backends.nvidia as nvidia
    except ImportError as exc:
        raise RuntimeError("sm90: Triton has no NVIDIA backend here") from exc
    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists():
        raise RuntimeError(f"sm90: no cuobjdump at {tool}")
    return tool


_FIELDS = {"REG": "registers", "STACK": "stack_bytes", "SHARED": "shared_bytes",
           "LOCAL": "local_bytes"}


def usage(kernel) -> dict[str, int]:
    """A compiled kernel's resources from its cubin: registers (a thread), stack_bytes,
    shared_bytes (static), local_bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(cuobjdump()), "-res-usage", str(cubin)], capture_output=True,
                             text=True, check=True).stdout
    found = {_FIELDS[k]: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    if "registers" not in found:
        raise RuntimeError(f"sm90: cuobjdump printed no register count: {out[:300]!r}")
    return found
