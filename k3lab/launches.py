"""What a call launches: counted (torch.profiler's kernel, memset and memcpy events on CUDA;
on CPU the Triton launches plus the ATen ops dispatched, views and allocations excluded, the
*logical* launches) and laid out in time (:func:`timeline`, with its Perfetto trace).
``k3lab.profile`` re-exports these names."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3lab.config import Preset

__all__ = ["Launches", "count_launches", "short_kernel_name", "tensor_bytes", "timeline"]

# Ops that move no data and launch nothing: views, metadata and bare allocations.
_NOT_LAUNCHES = {
    "view", "_unsafe_view", "reshape", "alias", "as_strided", "t", "transpose", "permute",
    "expand", "unsqueeze", "squeeze", "slice", "select", "detach", "empty", "empty_like",
    "empty_strided", "unbind", "split", "split_with_sizes", "chunk", "narrow", "lift_fresh",
    "_to_copy_noop", "view_as", "unfold", "diagonal", "resolve_conj", "resolve_neg", "sym_size",
    "is_same_size", "_local_scalar_dense", "set_", "new_empty", "new_empty_strided",
}


@dataclass
class Launches:
    """What one call launched; ``kind``: CUDA kernels, or logical launches on CPU."""

    count: int
    kernels: list[str] = field(default_factory=list)
    kind: str = "cuda kernels"


def _device_of(inputs: Any) -> torch.device:
    for t in _tensors(inputs):
        return t.device
    return torch.device("cpu")


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif hasattr(obj, "__dataclass_fields__") and not isinstance(obj, Preset):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))


def tensor_bytes(obj: Any) -> int:
    """Total bytes of the distinct tensors reachable in ``obj`` (dicts, lists, dataclasses)."""
    seen, total = set(), 0
    for t in _tensors(obj):
        key = (t.data_ptr(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)




class _OpLog(TorchDispatchMode):
    """Records ATen ops dispatched (outside Triton launches) with wall-clock start and end."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, float, float]] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in _NOT_LAUNCHES:
            self.events.append((f"aten::{name}", t0, time.perf_counter()))
        return out


@contextlib.contextmanager
def _cpu_launch_log():
    """Log Triton interpreter launches and ATen ops; yields the event list."""
    from triton.runtime.interpreter import InterpretedFunction

    log = _OpLog()
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        t0 = time.perf_counter()
        log.paused += 1
        try:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            log.paused -= 1
            log.events.append((f"triton::{self.__name__}", t0, time.perf_counter()))

    InterpretedFunction.run = run
    try:
        with log:
            yield log.events
    finally:
        InterpretedFunction.run = original


@contextlib.contextmanager
def _no_nan_fill():
    """Deterministic mode's NaN fill of fresh allocations off (a debugging aid, as the tests
    switch on: its fill kernels behind torch.empty are not the call's launches)."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill


@dataclass(frozen=True)
class _DeviceEvent:
    name: str
    start_us: float
    end_us: float
    stream: int


def _cuda_profile(fn: Callable, inputs: Any):
    """([_DeviceEvent] of one call: kernels, memsets, memcpys, profiler): keeps only work whose
    launch call (CUDA runtime or driver API) was made inside the profiled window, matched by
    the CUPTI correlation id; work queued before it that merely runs during it is not the
    call's."""
    from torch.profiler import ProfilerActivity, profile

    with _no_nan_fill(), profile(activities=[ProfilerActivity.CPU,
                                             ProfilerActivity.CUDA]) as prof:
        fn(inputs)
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    try:
        raw = list(prof.profiler.kineto_results.events())
    except AttributeError:  # no kineto results in this torch: every device event
        return [_DeviceEvent(e.name, e.time_range.start, e.time_range.end,
                             getattr(e, "device_resource_id", 0))
                for e in prof.events() if e.device_type == cuda], prof
    launched = {e.correlation_id() for e in raw
                if e.device_type() != cuda and e.name().startswith(("cuda", "cu"))}
    return [_DeviceEvent(e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3,
                         e.device_resource_id())
            for e in raw if e.device_type() == cuda
            and (not launched or e.correlation_id() in launched)], prof


def _signature_split(name: str) -> tuple[str, str]:
    """(return type, function name with template arguments) of a demangled signature: the name
    ends at the first "(" outside template brackets; the return type is what precedes the
    name's last top-level space (``std::enable_if<!(x), void>::type f<...>(...)``)."""
    depth, space, end = 0, -1, len(name)
    for i, ch in enumerate(name):
        if ch in "<(" and not (ch == "(" and depth == 0):
            depth += 1
        elif ch in ">)" and depth > 0:
            depth -= 1
        elif ch == "(" and depth == 0:
            end = i
            break
        elif ch == " " and depth == 0:
            space = i
    return name[:space].strip() if space >= 0 else "", name[space + 1:end]


def short_kernel_name(name: str, width: int = 80) -> str:
    """A CUDA kernel's name without its return type, ``at::native::``-style namespaces and
    argument list, cut to width (Triton kernels keep their own names)."""
    name = name.strip().replace("(anonymous namespace)::", "")
    if not name.startswith("triton") and (
            "::" in name or "<" in name or name.startswith("void ")):  # a C++ signature
        name = _signature_split(name)[1] or name
    for noise in ("at::native::", "binary_internal::", "std::"):
        name = name.replace(noise, "")
    return name if len(name) <= width else name[: width - 1] + "…"


def count_launches(fn: Callable[[Any], Any], inputs: Any, *, warmup: bool = True) -> Launches:
    """Count what one call ``fn(inputs)`` launches (after a warm-up call that compiles and makes
    what a launcher keeps between calls, e.g. its counters).

    CUDA: kernel, memset and memcpy events from torch.profiler. CPU: Triton launches plus ATen
    ops dispatched, views and allocations excluded (``kind`` = "logical launches (CPU)").
    """
    device = _device_of(inputs)
    if warmup:
        fn(inputs)
        _sync(device)
    if device.type == "cuda":
        events, _ = _cuda_profile(fn, inputs)
        names = [short_kernel_name(e.name) for e in events]
        return Launches(len(names), names, "cuda kernels")
    with _cpu_launch_log() as events:
        fn(inputs)
    names = [name for name, _, _ in events]
    return Launches(len(names), names, "logical launches (CPU)")




def timeline(fn: Callable[[Any], Any], inputs: Any, trace_path: str | None = None, *,
             warmup: bool | None = None) -> pd.DataFrame:
    """One call's launches in time order: columns kernel, start_us, end_us, dur_us, stream.

    warmup: one unrecorded call first (None: on CUDA only, where the first call compiles; the
    interpreter compiles nothing).

    CUDA: kernel events from torch.profiler (times relative to the first kernel); the Chrome /
    Perfetto trace is written to ``trace_path`` when given. CPU: the logical launches with
    wall-clock times (stream "cpu"); with ``trace_path``, the rows as a Chrome trace marked as
    the interpreter's wall clock (:func:`k3lab.traces.write_cpu`).
    """
    device = _device_of(inputs)
    if (device.type == "cuda") if warmup is None else warmup:
        fn(inputs)
        _sync(device)
    if device.type == "cuda":
        events, prof = _cuda_profile(fn, inputs)
        if trace_path:
            prof.export_chrome_trace(str(trace_path))
        rows = [(short_kernel_name(e.name), e.start_us, e.end_us, f"stream {e.stream}")
                for e in events]
    else:
        with _cpu_launch_log() as events:
            fn(inputs)
        rows = [(n, s * 1e6, e * 1e6, "cpu") for n, s, e in events]
    df = pd.DataFrame(rows, columns=["kernel", "start_us", "end_us", "stream"])
    if len(df):
        t0 = df["start_us"].min()
        df["start_us"] -= t0
        df["end_us"] -= t0
    df["dur_us"] = df["end_us"] - df["start_us"]
    df = df.sort_values("start_us").reset_index(drop=True)
    if trace_path and device.type != "cuda":
        from k3lab import traces

        traces.write_cpu(df, trace_path)
    return df
