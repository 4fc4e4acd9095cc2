"""Tuning choices of the route kernel, as data (each default's evidence: docs/decisions.md)."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["RouteConfig", "MAX_TOKENS"]

MAX_TOKENS = 64  # one selection program walks the tokens; beyond a decode batch, use a sort
CACHE_MODIFIERS = ("", ".ca", ".cg")


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True)
class RouteConfig:
    """How one ``route_sort`` (or ``gate_logits``) launch is shaped. Every choice changes speed
    only; any valid config gives the same plan.

    The gate GEMV, one of two shapes:

    - row programs (``M <= gemv_row_max_tokens`` and ``gemv_row_programs > 0``): about
      ``gemv_row_programs`` programs, each ``cdiv(E, gemv_row_programs)`` whole experts over
      ``1 / gemv_row_splits`` of H in unrolled ``gemv_row_chunk``-wide chunks (all loads
      independent). Meant for B1: more tokens would re-read each program's rows from L2;
    - split-K tiles otherwise (and always in ``gate_logits``): ``gemv_block_e`` experts x
      ``gemv_block_k`` columns a program. None picks: on the GPU 32 experts and the widest K tile
      of 1024 / 512 / 256 / 128 that still gives ``gemv_min_programs`` programs; under the
      interpreter few, big tiles (every program costs a fixed Python overhead).

    gemv_dot_min_tokens: from this many tokens on (0: never), where x and W are bf16 and the
        split-K tiles have at least 16 experts, each tile's products are tensor-core dots of
        16 tokens at a time in ``gemv_dot_k``-wide steps (bf16 products are exact in fp32),
        instead of every token in turn multiplying the tile on the CUDA cores.
    num_warps: every program's (the GEMV's and the selection's, which share the kernel).
    early_dependents: (compiled only) each program first lets a next launch made with
        programmatic dependent launch start, for a next launch that reads nothing the route
        writes (the MoE block's dense front); off, such a launch starts as the route ends.
    pdl: (compiled only) launched with programmatic dependent launch: each program lets the next
        such launch start, then waits for the previous grid before it reads anything, so its
        launch overlaps the end of the previous grid.

    The selection (the last program to finish):

    - scalar_keys: load the partials one element a thread (the expert axis declared
      non-contiguous), so the keys live in the layout of the compaction's scatter stores;
    - cand_cache: cache modifier of the read-back of its own candidate rows ("" lets it hit L1:
      the rows were stored by the same program and made visible by its barrier);
    - threshold selection (bucket maxima, threshold, compaction, ranks: a fixed handful of
      reductions instead of top_k arg-max rounds) from ``top_k >= threshold_min_top_k`` and
      ``threshold_min_experts`` padded experts on (Triton 3.6 fails to compile it on sm_90 for
      one token over 64 or fewer padded experts); ``buckets_per_slot`` buckets and
      ``candidates_per_slot`` candidate slots per (padded) top-k slot. A token with more
      candidates than slots makes its block fall back to the exact arg-max loop.

    select_programs_min_tokens: from this many tokens on (0: never; by default always), when
        they span more than one selection block of ``BLOCK_T`` tokens, the selection is a
        second launch of one program per block (the last to finish builds the sort metadata)
        instead of the GEMV launch's last program selecting every block in turn.

    The sort metadata (where the tokens span more than one selection block): from the M * top_k
    selected entries, by pairwise comparisons in memory (quadratic in the entries), or, with
    ``register_sort_max_entries`` at or above the entries padded to a power of two, in one
    program's registers: a bitonic sort of (expert, entry) keys and two scans (0: never).
    """

    gemv_block_e: int | None = None
    gemv_block_k: int | None = None
    gemv_min_programs: int = 132
    gemv_row_programs: int = 132
    gemv_row_chunk: int = 512
    gemv_row_splits: int = 2
    gemv_row_max_tokens: int = 1
    gemv_dot_min_tokens: int = 4
    gemv_dot_k: int = 128
    num_warps: int = 4
    early_dependents: bool = False
    pdl: bool = False
    scalar_keys: bool = True
    cand_cache: str = ""
    threshold_min_top_k: int = 8
    threshold_min_experts: int = 128
    buckets_per_slot: int = 2
    candidates_per_slot: int = 2
    select_programs_min_tokens: int = 1
    register_sort_max_entries: int = 1024

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("scalar_keys", "early_dependents", "pdl"):
                if not isinstance(v, bool):
                    raise ValueError(f"{f.name}: expected a bool, got {v!r}")
            elif f.name == "cand_cache":
                if v not in CACHE_MODIFIERS:
                    raise ValueError(f"{f.name}: expected one of {CACHE_MODIFIERS}, got {v!r}")
            elif v is None and f.name in ("gemv_block_e", "gemv_block_k"):
                continue
            elif isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{f.name}: expected an int, got {v!r}")
        lows = {"gemv_min_programs": 1, "gemv_row_programs": 0, "gemv_row_splits": 1,
                "gemv_row_max_tokens": 0, "threshold_min_top_k": 1, "threshold_min_experts": 1,
                "select_programs_min_tokens": 0, "register_sort_max_entries": 0,
                "gemv_dot_min_tokens": 0, "gemv_dot_k": 16}
        for name, lo in lows.items():
            if getattr(self, name) < lo:
                raise ValueError(f"{name}: expected >= {lo}, got {getattr(self, name)}")
        for name in ("gemv_block_e", "gemv_block_k", "gemv_row_chunk", "gemv_dot_k", "num_warps",
                     "buckets_per_slot", "candidates_per_slot"):
            v = getattr(self, name)
            if v is not None and not _pow2(v):
                raise ValueError(f"{name}: expected a power of two, got {v}")
