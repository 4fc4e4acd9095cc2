"""Fused routing + MoE sort metadata (the route boundary) in one launch (two for batches past
one selection block).

Math (docs/model.md, ``noaux_tc``), per token m of M::

    logits = fp32(x[m]) @ fp32(W_gate)^T            # [E]
    s      = sigmoid(logits);  sb = s + bias        # sb chooses, s weighs
    (n_group > 1: group score = top-2 sum of sb in the group; keep topk_group groups)
    ids    = top_k of sb, descending, ties to the lower expert index
    w      = s[ids] / (sum + 1e-20) (if renormalize) * routed_scaling_factor

and the sort metadata of ``RoutePlan`` (``kernels/plan.py``): entries ``m * top_k + slot``
grouped by expert (ascending), each run padded to a multiple of ``block_m`` with the sentinel
``M * top_k``.

One launch, ``_route_sort_kernel`` (``sort.py``):

1. every program reads its share of W once (``gemv.py``: split-K tiles, or at B1 row programs,
   as the :class:`RouteConfig` says; FP32 accumulation) and writes, for every token, its
   partial logits into an fp32 scratch [SPLIT_K, M, E] (no memset, no atomics on the data:
   deterministic); as a side job it fills its share of the plan's padding (sorted_ids =
   sentinel, sorted_weights = 0, block_expert_ids = -1) and zeroes ``out``;
2. "the last program finishes": after a CTA barrier each program increments a per-device int32
   counter once (acq_rel, gpu scope); the program that sees ``num_programs - 1`` (every other
   program's stores are then visible to it) runs the selection and sort below and resets the
   counter to 0 for the next call (or CUDA-graph replay; relaxed: the next launch starts after
   this one ends); the others just end;
3. the selection (``select.py``): sums the partials in a fixed order (``.cg`` loads: from L2,
   never a stale L1 line), sigmoid, bias, grouped top-k on packed (score, expert) int64 keys
   (unique; the low word breaks ties toward the lower expert): by a threshold from top_k = 8 on
   (bucket maxima, the top_k-th largest of them, compaction of the few keys above it through a
   small scratch, their ranks: a fixed handful of reductions; more than CAP candidates falls
   back to the arg-max loop), below that by iterative arg-max (one reduction per slot); weights,
   then the sort metadata from pairwise comparisons of the M * top_k entries (rank within the
   expert, tiles of lower experts), so nothing scales with E beyond the selection itself.

The counter is shared by every call on a device: route_sort calls on one device must not run
concurrently on different streams (a decode step is one stream). It is created (zeroed) by the
first call on a device, which therefore must not happen inside a CUDA-graph capture.

``RouteConfig.select_programs_min_tokens`` (by default from 1 token, where the tokens span more
than one selection block) moves the selection to a second launch, ``_route_select_kernel``, of
one program per block of tokens (the last to finish builds the sort metadata), for batches too
large for one program to select in turn.
``RouteConfig.register_sort_max_entries`` builds the sort metadata of up to that many (padded)
entries in one program's registers instead of the pairwise passes: a bitonic sort of
``expert * SORT_N + entry`` keys, a segmented scan for the rank within the expert, a cumulative
sum of the tile-opening entries for each tile's index (n log^2 n, not n^2).

``gate_logits`` (the standalone gate projection) runs step 1's split-K GEMV alone.
"""

from .config import MAX_TOKENS, RouteConfig
from .launch import gate_logits, route_sort

__all__ = ["route_sort", "gate_logits", "RouteConfig", "MAX_TOKENS"]
