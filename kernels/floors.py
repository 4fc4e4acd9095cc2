"""Bytes-only skeleton kernels: they move a boundary's bytes (plus the one dependency its math
forces) and do no other work, so their time is what any kernel needs for those bytes.

- stream: one launch reading a 1-D tensor (every program a contiguous chunk with its loads
  issued up front, one fp32 partial each), then, by ``then``: ``"none"``; ``"last"``: the last
  program to finish (a completion counter) sums the partials, the one-launch shape of the route
  kernel; ``"kernel"``: a second, one-program launch sums them (split then combine); ``"pdl"``:
  the same with programmatic dependent launch (CUDA only). ``after``: the launch depends on the
  previous one, as a projection on its input: launched with programmatic dependent launch, a
  program lets the next launch start and waits for the previous grid before its loads (CUDA
  only).
- update: an fp32 state read and written in place plus a bf16 weight read (KDA's bytes: the
  state and the f_b projection).

``Stream`` and ``Update`` hold the scratch of one configuration, so a timed call launches the
kernels only; ``stream`` and ``update`` run one call. The timing lives in ``k3lab.floors``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .runtime import INTERPRETED, check_device

__all__ = ["Stream", "Update", "stream", "update", "check_args", "THEN"]

THEN = ("none", "last", "kernel", "pdl")


@triton.jit
def _chunk_sum(p, base, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """fp32 sum of p[base : base + CHUNK] (below n), CHUNK / BLOCK loads unrolled."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(0, CHUNK, BLOCK):
        o = base + j + tl.arange(0, BLOCK)
        acc += tl.load(p + o, mask=o < n, other=0.0).to(tl.float32)
    return tl.sum(acc, 0)


@triton.jit
def _stream_kernel(p, partial, counter, result, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                   LAST: tl.constexpr, TRIGGER: tl.constexpr, NP2: tl.constexpr,
                   AFTER: tl.constexpr):
    """Program i sums elements [i * CHUNK, (i + 1) * CHUNK) of p (CHUNK / BLOCK unrolled loads)
    into partial[i] fp32. LAST: the last program to finish sums the partials into result[0] and
    resets the counter. TRIGGER: let the dependent launch start (PDL). AFTER: first wait for the
    previous grid (PDL)."""
    pid = tl.program_id(0)
    if AFTER:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    tl.store(partial + pid, _chunk_sum(p, pid.to(tl.int64) * CHUNK, n, CHUNK, BLOCK))
    if LAST:
        tl.debug_barrier()
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            o_p = tl.arange(0, NP2)
            b_p = tl.load(partial + o_p, mask=o_p < tl.num_programs(0), other=0.0,
                          cache_modifier=".cg")
            tl.store(result, tl.sum(b_p, 0))
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_kernel(partial, result, n, NP2: tl.constexpr, WAIT: tl.constexpr):
    """result[0] = sum of partial[:n] (one program); WAIT: first wait for the primary grid (PDL)."""
    if WAIT:
        gdc_wait()
    o_p = tl.arange(0, NP2)
    tl.store(result, tl.sum(tl.load(partial + o_p, mask=o_p < n, other=0.0,
                                    cache_modifier=".cg"), 0))


@triton.jit
def _update_kernel(state, w, partial, n_state, n_w, STATE_PROGRAMS, CHUNK: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Programs below STATE_PROGRAMS: state[chunk] = state[chunk] * 0.5 + 1 in place (fp32);
    the others sum a chunk of w into partial[program]."""
    pid = tl.program_id(0)
    if pid < STATE_PROGRAMS:
        base = pid.to(tl.int64) * CHUNK
        for j in tl.static_range(0, CHUNK, BLOCK):
            o = base + j + tl.arange(0, BLOCK)
            m = o < n_state
            tl.store(state + o, tl.load(state + o, mask=m) * 0.5 + 1.0, mask=m)
    else:
        tl.store(partial + pid, _chunk_sum(w, (pid - STATE_PROGRAMS).to(tl.int64) * CHUNK, n_w,
                                           CHUNK, BLOCK))


class Stream:
    """A stream skeleton over a 1-D tensor of ``numel`` elements of ``elem`` bytes: scratch for
    one configuration (``chunk_kb`` KB a program, ``warps``); call it on the tensor."""

    def __init__(self, numel: int, elem: int, device, then: str, chunk_kb: int, warps: int,
                 after: bool = False):
        self.chunk = chunk_kb * 1024 // elem
        self.block = min(self.chunk, 4096 if elem == 2 else 2048)  # 8 KB loads
        self.grid = triton.cdiv(numel, self.chunk)
        self.np2 = triton.next_power_of_2(self.grid)
        self.numel, self.then, self.warps = numel, then, warps
        self.partial = torch.empty(self.grid, dtype=torch.float32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.result = torch.zeros(1, dtype=torch.float32, device=device)
        self.pdl = then == "pdl" and not INTERPRETED
        self.after = after and not INTERPRETED

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _stream_kernel[(self.grid,)](x, self.partial, self.counter, self.result, self.numel,
                                     CHUNK=self.chunk, BLOCK=self.block, LAST=self.then == "last",
                                     TRIGGER=self.pdl or self.after, NP2=self.np2,
                                     AFTER=self.after, num_warps=self.warps,
                                     **({"launch_pdl": True} if self.after else {}))
        if self.then in ("kernel", "pdl"):
            _sum_kernel[(1,)](self.partial, self.result, self.grid, NP2=self.np2, WAIT=self.pdl,
                              num_warps=4, **({"launch_pdl": True} if self.pdl else {}))
        return self.result if self.then != "none" else self.partial


class Update:
    """The update skeleton over ``n_state`` fp32 and ``n_w`` bf16 elements: scratch for one
    configuration; call it on ``(state, w)``."""

    def __init__(self, n_state: int, n_w: int, device, chunk_kb: int, warps: int):
        self.chunk = chunk_kb * 1024 // 4
        self.sp, wp = triton.cdiv(n_state, self.chunk), triton.cdiv(n_w, self.chunk)
        self.n_state, self.n_w, self.warps = n_state, n_w, warps
        self.partial = torch.zeros(self.sp + wp, dtype=torch.float32, device=device)

    def __call__(self, io) -> torch.Tensor:
        state, w = io
        _update_kernel[(self.partial.numel(),)](
            state, w, self.partial, self.n_state, self.n_w, self.sp, CHUNK=self.chunk,
            BLOCK=min(self.chunk, 2048), num_warps=self.warps)
        return self.partial[self.sp:]


def check_args(then: str, **sizes: int) -> None:
    """``then`` one of THEN; every named size a positive int."""
    if then not in THEN:
        raise ValueError(f"then: expected one of {THEN}, got {then!r}")
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")


def stream(x: torch.Tensor, then: str = "last", chunk_kb: int = 16, warps: int = 8,
           after: bool = False):
    """Run one stream skeleton on the 1-D tensor ``x`` (bf16 / fp16 / fp32): returns the fp32 sum
    of x ([1]; the partials [programs] when ``then`` is "none"). ``after``: wait for the
    previous launch first (PDL)."""
    check_args(then, chunk_kb=chunk_kb, warps=warps)
    if not isinstance(after, bool):
        raise ValueError(f"after: expected a bool, got {after!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x: expected a 1-D bf16 / fp16 / fp32 tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
    check_device("x", x)
    return Stream(x.numel(), x.element_size(), x.device, then, chunk_kb, warps, after)(x)


def update(state: torch.Tensor, w: torch.Tensor, chunk_kb: int = 16, warps: int = 4):
    """Run the update skeleton once: ``state`` (1-D fp32) = state * 0.5 + 1 in place, and the
    fp32 partial sums of ``w`` (1-D bf16) returned (their total is w's sum)."""
    check_args("none", chunk_kb=chunk_kb, warps=warps)
    if not isinstance(state, torch.Tensor) or state.dim() != 1 or state.dtype != torch.float32:
        raise ValueError(f"state: expected a 1-D fp32 tensor, got "
                         f"{getattr(state, 'dtype', type(state).__name__)}")
    if (not isinstance(w, torch.Tensor) or w.dim() != 1 or w.dtype != torch.bfloat16
            or w.device != state.device):
        raise ValueError(f"w: expected a 1-D bf16 tensor on {state.device}, got "
                         f"{getattr(w, 'dtype', type(w).__name__)} on {getattr(w, 'device', '-')}")
    check_device("state", state)
    return Update(state.numel(), w.numel(), state.device, chunk_kb, warps)((state, w))
