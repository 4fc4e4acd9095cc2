"""The fused route kernel: gate GEMV in every program, selection and sort in the last one."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .gemv import _fill, _gemv_partials
from .select import _select_tokens


@triton.jit
def _store_entries(p_sorted_ids, p_sorted_w, p_block_ids, b_e, o_n, b_w, b_rank, b_before, m_n,
                   BM: tl.constexpr):
    """Scatter entries to position BM * (tiles of lower experts) + rank; an entry whose rank is
    a multiple of BM opens a tile and writes its expert id. Returns the tile-opening mask."""
    b_pos = b_before * BM + b_rank
    tl.store(p_sorted_ids + b_pos, o_n, mask=m_n)
    tl.store(p_sorted_w + b_pos, b_w, mask=m_n)
    m_open = m_n & (b_rank % BM == 0)
    tl.store(p_block_ids + b_pos // BM, b_e, mask=m_open)
    return m_open


@triton.jit
def _select_sort(
        p_part, p_bias, p_cand, p_ids, p_w, p_sorted_ids, p_sorted_w, p_block_ids, p_num_valid,
        p_rank, M, scaling,
        E: tl.constexpr, SPLIT_K: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, RENORMALIZE: tl.constexpr,
        BM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr, BUCKETS: tl.constexpr, CAP: tl.constexpr, IN_REGS: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CAND_CACHE: tl.constexpr,
        SCALAR_E: tl.constexpr, SORT_N: tl.constexpr):
    """One program: selection of all M tokens from the summed partials, then the whole sort
    metadata (the plan's padding is already in place)."""
    if IN_REGS:
        # all tokens fit one selection block: the sort works on the registers directly
        b_ids, b_w, o_ts, m_ts = _select_tokens(
            p_part, p_bias, p_cand, p_ids, p_w, 0, M, scaling, E, SPLIT_K, TOP_K, N_GROUP,
            TOPK_GROUP, GROUP_SIZE, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_G, BLOCK_S, BUCKETS, CAP,
            CAND_CACHE, SCALAR_E)
        b_e = tl.reshape(b_ids, [BLOCK_T * BLOCK_S])
        o_n = tl.reshape(o_ts, [BLOCK_T * BLOCK_S])
        m_n = tl.reshape(m_ts, [BLOCK_T * BLOCK_S])
        b_wn = tl.reshape(b_w, [BLOCK_T * BLOCK_S])
        if BLOCK_T == 1:  # M = 1: a token's experts are distinct, each opens its own tile
            b_rank = tl.zeros_like(b_e)
            b_lower = (b_e[None, :] < b_e[:, None]) & m_n[None, :]
            b_before = tl.sum(b_lower.to(tl.int32), axis=1)
            _store_entries(p_sorted_ids, p_sorted_w, p_block_ids, b_e, o_n, b_wn, b_rank,
                           b_before, m_n, BM)
            tl.store(p_num_valid, TOP_K * BM)
        else:
            b_same = ((b_e[None, :] == b_e[:, None]) & (o_n[None, :] < o_n[:, None])
                      & m_n[None, :])
            b_rank = tl.sum(b_same.to(tl.int32), axis=1)
            m_open = m_n & (b_rank % BM == 0)
            b_lower = (b_e[None, :] < b_e[:, None]) & m_open[None, :]
            b_before = tl.sum(b_lower.to(tl.int32), axis=1)
            m_open = _store_entries(p_sorted_ids, p_sorted_w, p_block_ids, b_e, o_n, b_wn,
                                    b_rank, b_before, m_n, BM)
            tl.store(p_num_valid, tl.sum(m_open.to(tl.int32), axis=0) * BM)
    else:
        for t0 in range(0, M, BLOCK_T):
            _select_tokens(p_part, p_bias, p_cand, p_ids, p_w, t0, M, scaling, E, SPLIT_K,
                           TOP_K, N_GROUP, TOPK_GROUP, GROUP_SIZE, RENORMALIZE, BLOCK_T, BLOCK_E,
                           BLOCK_G, BLOCK_S, BUCKETS, CAP, CAND_CACHE, SCALAR_E)
        tl.debug_barrier()  # the passes below read topk_ids written by other threads
        _sort_entries(p_ids, p_w, p_rank, p_sorted_ids, p_sorted_w, p_block_ids, p_num_valid,
                      M, E, TOP_K, BM, BLOCK_R, BLOCK_C, SORT_N, "")


@triton.jit
def _same_expert_count(a_e, a_n, b_e, b_n):
    """Segmented-count combine over entries sorted by expert: b's count, plus a's when both
    belong to one expert (associative because an expert's entries are contiguous)."""
    return b_e, b_n + tl.where(a_e == b_e, a_n, 0)


@triton.jit
def _sort_entries_regs(p_ids, p_w, p_sorted_ids, p_sorted_w, p_block_ids, p_num_valid, N,
                       E: tl.constexpr, BM: tl.constexpr, SORT_N: tl.constexpr,
                       CACHE: tl.constexpr):
    """One program: the sort metadata of N <= SORT_N entries held in registers. Keys
    expert * SORT_N + entry, bitonic-sorted, give each expert's entries in entry order; a
    segmented scan gives each entry's rank within its expert and a cumulative sum of the
    tile-opening entries its tile."""
    o_n = tl.arange(0, SORT_N)
    b_e = tl.load(p_ids + o_n, mask=o_n < N, other=E, cache_modifier=CACHE)
    b_key = tl.sort(b_e * SORT_N + o_n)
    b_e, o_s = b_key // SORT_N, b_key % SORT_N
    m_s = b_e < E
    _, b_count = tl.associative_scan((b_e, tl.full([SORT_N], 1, tl.int32)), 0,
                                     _same_expert_count)
    b_rank = b_count - 1
    m_open = m_s & (b_rank % BM == 0)
    b_tile = tl.cumsum(m_open.to(tl.int32), axis=0) - 1
    b_pos = b_tile * BM + b_rank % BM
    b_w = tl.load(p_w + o_s, mask=m_s, other=0.0, cache_modifier=CACHE)
    tl.store(p_sorted_ids + b_pos, o_s, mask=m_s)
    tl.store(p_sorted_w + b_pos, b_w, mask=m_s)
    tl.store(p_block_ids + b_tile, b_e, mask=m_open)
    tl.store(p_num_valid, tl.sum(m_open.to(tl.int32), axis=0) * BM)


@triton.jit
def _sort_entries(p_ids, p_w, p_rank, p_sorted_ids, p_sorted_w, p_block_ids, p_num_valid, M,
                  E: tl.constexpr, TOP_K: tl.constexpr, BM: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_C: tl.constexpr, SORT_N: tl.constexpr, CACHE: tl.constexpr):
    """One program: the sort metadata of the M * TOP_K selected entries (topk ids and weights
    in memory): in registers where SORT_N > 0 (_sort_entries_regs), else by pairwise
    comparisons in BLOCK_R x BLOCK_C tiles; CACHE: the loads' cache modifier (".cg" where other
    programs stored the entries)."""
    N = M * TOP_K
    if SORT_N > 0:
        _sort_entries_regs(p_ids, p_w, p_sorted_ids, p_sorted_w, p_block_ids, p_num_valid, N,
                           E, BM, SORT_N, CACHE)
    else:
        # pass 1: rank of each entry within its expert (earlier entries of the same expert)
        for r0 in range(0, N, BLOCK_R):
            o_r = r0 + tl.arange(0, BLOCK_R)
            m_r = o_r < N
            b_er = tl.load(p_ids + o_r, mask=m_r, other=-1, cache_modifier=CACHE)
            b_rank = tl.zeros([BLOCK_R], tl.int32)
            for c0 in range(0, r0 + BLOCK_R, BLOCK_C):
                o_c = c0 + tl.arange(0, BLOCK_C)
                b_ec = tl.load(p_ids + o_c, mask=o_c < N, other=-2, cache_modifier=CACHE)
                b_same = (b_ec[None, :] == b_er[:, None]) & (o_c[None, :] < o_r[:, None])
                b_rank += tl.sum(b_same.to(tl.int32), axis=1)
            tl.store(p_rank + o_r, b_rank, mask=m_r)
        tl.debug_barrier()

        # pass 2: tiles opened by lower experts, then scatter
        b_tiles = tl.zeros([BLOCK_R], tl.int32)
        for r0 in range(0, N, BLOCK_R):
            o_r = r0 + tl.arange(0, BLOCK_R)
            m_r = o_r < N
            b_er = tl.load(p_ids + o_r, mask=m_r, other=-1, cache_modifier=CACHE)
            b_rank = tl.load(p_rank + o_r, mask=m_r, other=1)
            b_before = tl.zeros([BLOCK_R], tl.int32)
            for c0 in range(0, N, BLOCK_C):
                o_c = c0 + tl.arange(0, BLOCK_C)
                m_c = o_c < N
                b_ec = tl.load(p_ids + o_c, mask=m_c, other=E, cache_modifier=CACHE)
                m_open_c = m_c & (tl.load(p_rank + o_c, mask=m_c, other=1) % BM == 0)
                b_lower = (b_ec[None, :] < b_er[:, None]) & m_open_c[None, :]
                b_before += tl.sum(b_lower.to(tl.int32), axis=1)
            b_wr = tl.load(p_w + o_r, mask=m_r, other=0.0, cache_modifier=CACHE)
            m_open = _store_entries(p_sorted_ids, p_sorted_w, p_block_ids, b_er, o_r, b_wr,
                                    b_rank, b_before, m_r, BM)
            b_tiles += m_open.to(tl.int32)
        tl.store(p_num_valid, tl.sum(b_tiles, axis=0) * BM)


@triton.jit
def _route_program(
        i_e, i_k, n_e, n_prog, p_x, p_w, p_bias, p_part, p_cand, p_rank, p_count, p_ids,
        p_topk_w, p_sorted_ids, p_sorted_w, p_block_ids, p_num_valid, p_out, M, H, n_sorted,
        n_blocks, n_out, scaling,
        E: tl.constexpr, SPLIT_K: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, RENORMALIZE: tl.constexpr,
        BM: tl.constexpr, GEMV_E: tl.constexpr, GEMV_K: tl.constexpr, FILL: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr, BUCKETS: tl.constexpr, CAP: tl.constexpr,
        IN_REGS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
        GEMV_ROWS: tl.constexpr, GEMV_CHUNKS: tl.constexpr, CAND_CACHE: tl.constexpr,
        SCALAR_E: tl.constexpr, SORT_N: tl.constexpr, EARLY_DEPENDENTS: tl.constexpr,
        PDL: tl.constexpr, SELECT: tl.constexpr, DOT_M: tl.constexpr, DOT_K: tl.constexpr,
        DOT_FP32: tl.constexpr, MIX: tl.constexpr = False, p_sb=0, p_nw=0, p_sums=0, s_n=0,
        s_sbn=0, s_sbm=0, s_p=0, eps=0.0, S_NB: tl.constexpr = 16,
        S_BLOCK_C: tl.constexpr = 1):
    """GEMV tile (i_e, i_k) of ``n_prog`` route programs (``n_e`` E tiles): the GEMV partials
    and its share of the plan's padding; with SELECT the last program to finish then selects
    and sorts (else _route_select_kernel, the next launch, does). MIX: x is an AttnRes
    read's live sum, the GEMV's input that read (kernels/route/gemv.py)."""
    if EARLY_DEPENDENTS or PDL:
        gdc_launch_dependents()
    if PDL:  # x, the plan and the counter all wait for the previous grid
        gdc_wait()
    _gemv_partials(p_x, p_w, p_part, i_e, i_k, M, E, H, GEMV_E, GEMV_K, GEMV_ROWS, GEMV_CHUNKS,
                   DOT_M, DOT_K, DOT_FP32, MIX, p_sb, p_nw, p_sums, s_n, s_sbn, s_sbm, s_p, eps,
                   S_NB, S_BLOCK_C)

    # side job: the plan's padding and the zeroed stage-2 buffer (before the counter below, so
    # the selection's scatter lands after every fill)
    pid = i_k * n_e + i_e
    _fill(p_sorted_ids, n_sorted, tl.zeros([FILL], tl.int32) + M * TOP_K, pid, n_prog, FILL)
    _fill(p_sorted_w, n_sorted, tl.zeros([FILL], tl.float32), pid, n_prog, FILL)
    _fill(p_block_ids, n_blocks, tl.zeros([FILL], tl.int32) - 1, pid, n_prog, FILL)
    _fill(p_out, n_out, tl.zeros([FILL], tl.float32), pid, n_prog, FILL)

    # the last program to get here does the selection: the barrier orders this program's
    # stores (all threads) before its one scalar atomic, whose release publishes them at gpu
    # scope; the last program's acquire sees every program's partials and fills
    if SELECT:  # else _route_select_kernel, the next launch, selects
        tl.debug_barrier()
        if tl.atomic_add(p_count, 1, sem="acq_rel", scope="gpu") == n_prog - 1:
            _select_sort(p_part, p_bias, p_cand, p_ids, p_topk_w, p_sorted_ids, p_sorted_w,
                         p_block_ids, p_num_valid, p_rank, M, scaling, E, SPLIT_K, TOP_K,
                         N_GROUP, TOPK_GROUP, GROUP_SIZE, RENORMALIZE, BM, BLOCK_T, BLOCK_E,
                         BLOCK_G, BLOCK_S, BUCKETS, CAP, IN_REGS, BLOCK_R, BLOCK_C, CAND_CACHE,
                         SCALAR_E, SORT_N)
            # ready for the next launch: every other program has already incremented (that is how
            # this one got here) and the next launch starts after this one ends, so the reset needs
            # no ordering: relaxed (no release fence waiting for the tail's stores)
            tl.atomic_xchg(p_count, 0, sem="relaxed", scope="gpu")


@triton.jit
def _route_sort_kernel(
        p_x, p_w, p_bias, p_part, p_cand, p_rank, p_count, p_ids, p_topk_w, p_sorted_ids,
        p_sorted_w, p_block_ids, p_num_valid, p_out, M, H, n_sorted, n_blocks, n_out, scaling,
        E: tl.constexpr, SPLIT_K: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, RENORMALIZE: tl.constexpr,
        BM: tl.constexpr, GEMV_E: tl.constexpr, GEMV_K: tl.constexpr, FILL: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr, BUCKETS: tl.constexpr, CAP: tl.constexpr,
        IN_REGS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
        GEMV_ROWS: tl.constexpr, GEMV_CHUNKS: tl.constexpr, CAND_CACHE: tl.constexpr,
        SCALAR_E: tl.constexpr, SORT_N: tl.constexpr, EARLY_DEPENDENTS: tl.constexpr,
        PDL: tl.constexpr, SELECT: tl.constexpr, DOT_M: tl.constexpr, DOT_K: tl.constexpr,
        DOT_FP32: tl.constexpr):
    """Grid (E tiles, K splits) of :func:`_route_program`."""
    i_e, i_k = tl.program_id(0), tl.program_id(1)
    _route_program(i_e, i_k, tl.num_programs(0), tl.num_programs(0) * tl.num_programs(1), p_x,
                   p_w, p_bias, p_part, p_cand, p_rank, p_count, p_ids, p_topk_w, p_sorted_ids,
                   p_sorted_w, p_block_ids, p_num_valid, p_out, M, H, n_sorted, n_blocks, n_out,
                   scaling, E, SPLIT_K, TOP_K, N_GROUP, TOPK_GROUP, GROUP_SIZE, RENORMALIZE, BM,
                   GEMV_E, GEMV_K, FILL, BLOCK_T, BLOCK_E, BLOCK_G, BLOCK_S, BUCKETS, CAP,
                   IN_REGS, BLOCK_R, BLOCK_C, GEMV_ROWS, GEMV_CHUNKS, CAND_CACHE, SCALAR_E,
                   SORT_N, EARLY_DEPENDENTS, PDL, SELECT, DOT_M, DOT_K, DOT_FP32)


@triton.jit
def _route_select_kernel(
        p_part, p_bias, p_cand, p_rank, p_count, p_ids, p_topk_w, p_sorted_ids, p_sorted_w,
        p_block_ids, p_num_valid, M, scaling,
        E: tl.constexpr, SPLIT_K: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, RENORMALIZE: tl.constexpr,
        BM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr, BUCKETS: tl.constexpr, CAP: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr, CAND_CACHE: tl.constexpr, SCALAR_E: tl.constexpr,
        SORT_N: tl.constexpr):
    """The selection spread over programs of BLOCK_T tokens each, after a _route_sort_kernel
    launch without SELECT wrote the partials and the plan's padding; the last program to
    finish builds the sort metadata (``.cg`` reads of the others' entries) and resets the
    counter."""
    _select_tokens(p_part, p_bias, p_cand, p_ids, p_topk_w, tl.program_id(0) * BLOCK_T, M,
                   scaling, E, SPLIT_K, TOP_K, N_GROUP, TOPK_GROUP, GROUP_SIZE, RENORMALIZE,
                   BLOCK_T, BLOCK_E, BLOCK_G, BLOCK_S, BUCKETS, CAP, CAND_CACHE, SCALAR_E)
    tl.debug_barrier()
    if tl.atomic_add(p_count, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        _sort_entries(p_ids, p_topk_w, p_rank, p_sorted_ids, p_sorted_w, p_block_ids,
                      p_num_valid, M, E, TOP_K, BM, BLOCK_R, BLOCK_C, SORT_N, ".cg")
        tl.atomic_xchg(p_count, 0, sem="relaxed", scope="gpu")
