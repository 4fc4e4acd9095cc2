"""Bytes-only skeletons: what moving a boundary's bytes costs when no work is attached.

Several bars compare a boundary with its bytes at the copy bandwidth. Such a bar can ask for less
time than any kernel needs just to move those bytes on the machine, plus the one dependency the
math forces (every byte read before a selection or a combine can start). The skeleton kernels
(``k3lab.kernels.floors``) do only that; here they are timed like the boundaries
(``profile.time_variant``: graph replay, cold copies, median of repeats, per-call share of one
graph), so a report can put a bar beside the fastest skeleton: a correct boundary cannot beat
it, and a bar below it cannot be met.

- ``stream_floor_us``: the stream skeleton over ``nbytes`` of bf16, then (``then``) nothing, the
  last program's sum, a second kernel, or a second kernel with PDL; ``after``: each launch
  waits for the previous one before its loads (PDL), as a projection waits for its input;
- ``update_floor_us``: an fp32 state read and written in place plus a bf16 weight read (KDA's
  bytes: the state and the f_b projection).

Each returns the best of a few chunk and warp configurations (the fastest among these on the
H200: docs/decisions.md). GPU only: on CPU they return NaN, since interpreted timings say
nothing about a GPU.
"""

from __future__ import annotations

import math

import torch

from k3lab import profile
from k3lab.kernels import INTERPRETED
from k3lab.kernels.floors import THEN, Stream, Update, check_args

__all__ = ["stream_floor_us", "update_floor_us", "THEN"]

STREAM_CHUNKS_KB = (16, 32, 64)
UPDATE_CHUNKS_KB = (8, 16, 32)
WARPS = (4, 8)
REPEATS = 20


def _gpu(device) -> torch.device | None:
    dev = torch.device(device)
    if dev.type != "cuda" or INTERPRETED:
        return None
    return dev


def stream_floor_us(nbytes: int, device, then: str = "none", *, after: bool = False,
                    chunks_kb=STREAM_CHUNKS_KB, warps=WARPS) -> float:
    """Fastest per-call graph-replay microseconds of the stream skeleton over ``nbytes`` of bf16
    (cold copies), over the chunk sizes and warp counts given; NaN off CUDA. ``after``: every
    launch waits for the previous one (in the graph: the previous call) before its loads."""
    check_args(then, nbytes=nbytes)
    if not isinstance(after, bool):
        raise ValueError(f"after: expected a bool, got {after!r}")
    dev = _gpu(device)
    if dev is None:
        return math.nan
    numel = nbytes // 2
    copies = profile.cold_copies(lambda i: torch.randn(numel, device=dev).to(torch.bfloat16),
                                 bytes_per_copy=nbytes)
    best = math.inf
    for kb in chunks_kb:
        for w in warps:
            fn = Stream(numel, 2, dev, then, kb, w, after)
            best = min(best, profile.time_variant(fn, copies, mode="graph",
                                                  repeats=REPEATS).median_us)
    return best


def update_floor_us(state_bytes: int, weight_bytes: int, device, *,
                    chunks_kb=UPDATE_CHUNKS_KB, warps=WARPS) -> float:
    """Fastest per-call graph-replay microseconds of the update skeleton (``state_bytes`` of fp32
    read and written in place, ``weight_bytes`` of bf16 read; cold copies); NaN off CUDA."""
    check_args("none", state_bytes=state_bytes, weight_bytes=weight_bytes)
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
            fn = Update(n_state, n_w, dev, kb, w)
            best = min(best, profile.time_variant(fn, copies, mode="graph",
                                                  repeats=REPEATS).median_us)
    return best
