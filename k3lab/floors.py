"""Bytes-only skeletons: what moving a boundary's bytes costs when no work is attached.

Several bars compare a boundary with its bytes at the copy bandwidth. Such a bar can ask for less
time than any kernel needs just to move those bytes on the machine, plus the one dependency the
math forces (every byte read before a selection or a combine can start). The kernels here do only
that, timed like the boundaries (``profile.time_variant``: graph replay, cold copies, median of
repeats, per-call share of one graph), so a report can put a bar beside the fastest skeleton: a
correct boundary cannot beat it, and a bar below it cannot be met.

- ``stream_floor_us``: one launch reading ``nbytes`` (every program a contiguous chunk with its
  loads issued up front, one fp32 partial each), then, by ``then``:
  ``"none"``; ``"last"``: the last program to finish (a completion counter) sums the partials, the
  one-launch shape of the route kernel; ``"kernel"``: a second, one-program launch sums them (split
  then combine); ``"pdl"``: the same with programmatic dependent launch (CUDA).
- ``update_floor_us``: an fp32 state read and written in place plus a bf16 weight read (KDA's
  bytes: the state and the f_b projection).

Each returns the best of a few chunk and warp configurations (session 8's sweep on the H200,
``benchmarks/session8/floors.py``, found the fastest among these). GPU only: on CPU they return
NaN, since interpreted timings say nothing about a GPU.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3lab import profile

__all__ = ["stream_floor_us", "update_floor_us", "stream", "update", "THEN"]

THEN = ("none", "last", "kernel", "pdl")
STREAM_CHUNKS_KB = (16, 32, 64)
UPDATE_CHUNKS_KB = (8, 16, 32)
WARPS = (4, 8)
REPEATS = 20


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
                   LAST: tl.constexpr, TRIGGER: tl.constexpr, NP2: tl.constexpr):
    """Program i sums elements [i * CHUNK, (i + 1) * CHUNK) of p (CHUNK / BLOCK unrolled loads)
    into partial[i] fp32. LAST: the last program to finish sums the partials into result[0] and
    resets the counter. TRIGGER: let the dependent launch start (PDL)."""
    pid = tl.program_id(0)
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


class _Stream:
    """A stream skeleton over a 1-D tensor of ``numel`` elements: scratch for one configuration."""

    def __init__(self, numel: int, elem: int, device, then: str, chunk_kb: int, warps: int):
        self.chunk = chunk_kb * 1024 // elem
        self.block = min(self.chunk, 4096 if elem == 2 else 2048)
        self.grid = triton.cdiv(numel, self.chunk)
        self.np2 = triton.next_power_of_2(self.grid)
        self.numel, self.then, self.warps = numel, then, warps
        self.partial = torch.empty(self.grid, dtype=torch.float32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.result = torch.zeros(1, dtype=torch.float32, device=device)
        self.pdl = then == "pdl" and torch.device(device).type == "cuda"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _stream_kernel[(self.grid,)](x, self.partial, self.counter, self.result, self.numel,
                                     CHUNK=self.chunk, BLOCK=self.block, LAST=self.then == "last",
                                     TRIGGER=self.pdl, NP2=self.np2, num_warps=self.warps)
        if self.then in ("kernel", "pdl"):
            _sum_kernel[(1,)](self.partial, self.result, self.grid, NP2=self.np2, WAIT=self.pdl,
                              num_warps=4, **({"launch_pdl": True} if self.pdl else {}))
        return self.result if self.then != "none" else self.partial


class _Update:
    """The update skeleton over ``n_state`` fp32 and ``n_w`` bf16 elements: scratch for one
    configuration (allocated here, so a timed call launches the one kernel only)."""

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


def _check(then: str, **sizes: int) -> None:
    if then not in THEN:
        raise ValueError(f"then: expected one of {THEN}, got {then!r}")
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")


def stream(x: torch.Tensor, then: str = "last", chunk_kb: int = 16, warps: int = 8):
    """Run one stream skeleton on the 1-D tensor ``x`` (bf16 / fp16 / fp32): returns the fp32 sum
    of x ([1]; the partials [programs] when ``then`` is "none"). For tests and reuse."""
    _check(then, chunk_kb=chunk_kb, warps=warps)
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x: expected a 1-D bf16 / fp16 / fp32 tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
    return _Stream(x.numel(), x.element_size(), x.device, then, chunk_kb, warps)(x)


def update(state: torch.Tensor, w: torch.Tensor, chunk_kb: int = 16, warps: int = 4):
    """Run the update skeleton once: ``state`` (1-D fp32) = state * 0.5 + 1 in place, and the
    fp32 partial sums of ``w`` (1-D bf16) returned (their total is w's sum)."""
    _check("none", chunk_kb=chunk_kb, warps=warps)
    if not isinstance(state, torch.Tensor) or state.dim() != 1 or state.dtype != torch.float32:
        raise ValueError(f"state: expected a 1-D fp32 tensor, got "
                         f"{getattr(state, 'dtype', type(state).__name__)}")
    if (not isinstance(w, torch.Tensor) or w.dim() != 1 or w.dtype != torch.bfloat16
            or w.device != state.device):
        raise ValueError(f"w: expected a 1-D bf16 tensor on {state.device}, got "
                         f"{getattr(w, 'dtype', type(w).__name__)} on {getattr(w, 'device', '-')}")
    return _Update(state.numel(), w.numel(), state.device, chunk_kb, warps)((state, w))


def _gpu(device) -> torch.device | None:
    dev = torch.device(device)
    if dev.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return dev


def stream_floor_us(nbytes: int, device, then: str = "none", *,
                    chunks_kb=STREAM_CHUNKS_KB, warps=WARPS) -> float:
    """Fastest per-call graph-replay microseconds of the stream skeleton over ``nbytes`` of bf16
    (cold copies), over the chunk sizes and warp counts given; NaN off CUDA."""
    _check(then, nbytes=nbytes)
    dev = _gpu(device)
    if dev is None:
        return math.nan
    numel = nbytes // 2
    copies = profile.cold_copies(lambda i: torch.randn(numel, device=dev).to(torch.bfloat16),
                                 bytes_per_copy=nbytes)
    best = math.inf
    for kb in chunks_kb:
        for w in warps:
            fn = _Stream(numel, 2, dev, then, kb, w)
            best = min(best, profile.time_variant(fn, copies, mode="graph",
                                                  repeats=REPEATS).median_us)
    return best


def update_floor_us(state_bytes: int, weight_bytes: int, device, *,
                    chunks_kb=UPDATE_CHUNKS_KB, warps=WARPS) -> float:
    """Fastest per-call graph-replay microseconds of the update skeleton (``state_bytes`` of fp32
    read and written in place, ``weight_bytes`` of bf16 read; cold copies); NaN off CUDA."""
    _check("none", state_bytes=state_bytes, weight_bytes=weight_bytes)
    dev = _gpu(device)
    if dev is None:
        return math.nan
    n_state, n_w = state_bytes // 4, weight_bytes // 2

    def make(i):
        return (torch.randn(n_state, device=dev), torch.randn(n_w, device=dev).to(torch.bfloat16))

    copies = profile.cold_copies(make, bytes_per_copy=2 * state_bytes + weight_bytes)
    best = math.inf
    for kb in chunks_kb:
        for w in warps:
            fn = _Update(n_state, n_w, dev, kb, w)
            best = min(best, profile.time_variant(fn, copies, mode="graph",
                                                  repeats=REPEATS).median_us)
    return best
