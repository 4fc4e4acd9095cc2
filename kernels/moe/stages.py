"""The MoE jit kernels: front, stage 1, and stage 2 + tail (one kernel, either or both).

Stages 1 and 2 consume the route plan as is: programs walk the expert-sorted ``sorted_ids`` in
tiles of ``block_m`` entries of one expert, so tokens sharing an expert read its weights once a
tile. Expert weights are bf16 (``FP4`` False) or MXFP4, then either K-lane tiles or, for plan
tiles of one token, the tensor-core tiles of mma.py (``USE_MMA``, with the tile's ``R``,
``WARPS_K``, ``L2_PREFETCH``). ``PDL``: the kernel was launched with programmatic dependent
launch; it reads only the plan (written two or more launches earlier) before
``griddepcontrol.wait``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..runtime import INTERPRETED  # noqa: F401  (sets the interpreter up before any jit)
from .gemv import act, bf16_gemv, expert_gemv, gate_up_act, to_bf16
from .mma import fp4_mma_gemv, store_prepared_x

# A tail program waiting for stage 2 gives up after this many polls: a scheduling bug then shows
# as a wrong result in the tests instead of a hung GPU.
MAX_SPIN = tl.constexpr(1 << 24)


@triton.jit
def _moe_front_kernel(p_x, p_down, p_z, p_zp, p_sw13, p_sa, M, H_PAIRS, D, S, n_shared_tiles,
                      beta, linear_beta, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, TOKEN_LOOP: tl.constexpr,
                      WRITE_PREPARED: tl.constexpr, TRIGGER: tl.constexpr):
    """Programs [0, n_shared_tiles): shared gate/up + act -> a_s [M, S] bf16; the rest:
    latent down-projection -> z [M, D] bf16 (and, WRITE_PREPARED, its mma_prepare_x copy at
    p_zp). Both read x [M, H] bf16. TRIGGER: let the next launch start (PDL) as programs
    start."""
    if TRIGGER:
        gdc_launch_dependents()
    i_p = tl.program_id(0)
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    if i_p < n_shared_tiles:
        o_n = i_p * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < S
        b_a = gate_up_act(p_x, o_m, m_m, p_sw13, p_sw13, o_n, m_n, S, H_PAIRS, beta, linear_beta,
                          ACT, BLOCK_M, BLOCK_N, BLOCK_KP, False, 0, TOKEN_LOOP, False)
        tl.store(p_sa + o_m[:, None] * S + o_n[None, :], to_bf16(b_a),
                 mask=m_m[:, None] & m_n[None, :])
    else:
        o_n = (i_p - n_shared_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < D
        b_z = bf16_gemv(p_x, o_m, m_m, p_x, p_down, o_n, m_n, H_PAIRS, BLOCK_M, BLOCK_N, BLOCK_KP,
                        False, False, TOKEN_LOOP)
        b_zb = to_bf16(b_z)
        tl.store(p_z + o_m[:, None] * D + o_n[None, :], b_zb, mask=m_m[:, None] & m_n[None, :])
        if WRITE_PREPARED:
            store_prepared_x(p_zp, o_m, o_n, D, b_zb, m_m[:, None] & m_n[None, :])


@triton.jit
def _plan_tile(p_sorted, i_b, block_m, n_entries, top_k, BLOCK_M: tl.constexpr):
    """Entries (token * top_k + slot), their tokens and validity for plan tile i_b."""
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < block_m
    b_ent = tl.load(p_sorted + i_b * block_m + o_m, mask=m_m, other=n_entries)
    m_ent = b_ent < n_entries
    return b_ent, b_ent // top_k, m_ent


@triton.jit
def _plan_tile_runs(i_b, block_m, n_valid, i_e, m_ent):
    """Whether plan tile i_b has work: within the plan's count. Also asking whether its expert
    and an entry are real (always so within the count) makes the compiler load them before the
    branch, with the count: one round trip before the first weight load instead of two."""
    return (i_b * block_m < n_valid) & (i_e >= 0) & (tl.max(m_ent.to(tl.int32)) > 0)


@triton.jit
def _stage1_side_jobs(p_out, p_sync, i_b, i_n, n_n, n_zero, ZERO_OUT: tl.constexpr,
                      ZERO_SYNC: tl.constexpr, ZERO_BLOCK: tl.constexpr):
    """Stage 1's side jobs: zero a slice of stage 2's accumulator, and (program 0) the stage-2 +
    tail launch's two counters (n_n: I tiles a plan tile)."""
    if ZERO_OUT:
        o_o = (i_b * n_n + i_n) * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
        tl.store(p_out + o_o, tl.zeros([ZERO_BLOCK], dtype=tl.float32), mask=o_o < n_zero)
    if ZERO_SYNC:
        o_s = tl.arange(0, 2)
        tl.store(p_sync + o_s, tl.zeros([2], dtype=tl.int32), mask=(i_b + i_n + o_s * 0) == 0)


@triton.jit
def _moe_stage1_kernel(p_z, p_w, p_ws, p_sorted, p_block_expert, p_num_valid, p_a, p_ap, p_out,
                       p_sync, n_entries, block_m, top_k, N_I, D_PAIRS, n_zero, beta,
                       linear_beta, ACT: tl.constexpr, FP4: tl.constexpr, USE_MMA: tl.constexpr,
                       WARPS_K: tl.constexpr, L2_PREFETCH: tl.constexpr,
                       X_PREPARED: tl.constexpr, EVICT_FIRST: tl.constexpr, ASM: tl.constexpr,
                       KLANE_STAGES: tl.constexpr, ZERO_OUT: tl.constexpr,
                       ZERO_SYNC: tl.constexpr, ZERO_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, TOKEN_LOOP: tl.constexpr,
                       WRITE_PREPARED: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
                       TILED: tl.constexpr):
    """Grid (plan tiles, I tiles): :func:`_stage1_program`."""
    _stage1_program(tl.program_id(0), tl.program_id(1), tl.num_programs(1), p_z, p_w, p_ws,
                    p_sorted, p_block_expert, p_num_valid, p_a, p_ap, p_out, p_sync, n_entries,
                    block_m, top_k, N_I, D_PAIRS, n_zero, beta, linear_beta, ACT, FP4, USE_MMA,
                    WARPS_K, L2_PREFETCH, X_PREPARED, EVICT_FIRST, ASM, KLANE_STAGES, ZERO_OUT,
                    ZERO_SYNC, ZERO_BLOCK, BLOCK_M, BLOCK_N, BLOCK_KP, TOKEN_LOOP,
                    WRITE_PREPARED, PDL, TRIGGER, TILED)


@triton.jit
def _stage1_program(i_b, i_n, n_n, p_z, p_w, p_ws, p_sorted, p_block_expert, p_num_valid, p_a,
                    p_ap, p_out, p_sync, n_entries, block_m, top_k, N_I, D_PAIRS, n_zero, beta,
                    linear_beta, ACT: tl.constexpr, FP4: tl.constexpr, USE_MMA: tl.constexpr,
                    WARPS_K: tl.constexpr, L2_PREFETCH: tl.constexpr, X_PREPARED: tl.constexpr,
                    EVICT_FIRST: tl.constexpr, ASM: tl.constexpr, KLANE_STAGES: tl.constexpr,
                    ZERO_OUT: tl.constexpr, ZERO_SYNC: tl.constexpr, ZERO_BLOCK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
                    TOKEN_LOOP: tl.constexpr, WRITE_PREPARED: tl.constexpr, PDL: tl.constexpr,
                    TRIGGER: tl.constexpr, TILED: tl.constexpr):
    """Program (plan tile i_b, I tile i_n of n_n): a[entries, tile] = act(z[tokens] @
    w13[e]^T), gate rows [0, N_I) and up rows [N_I, 2 N_I) of w13 (z as mma_prepare_x wrote it
    where X_PREPARED); WRITE_PREPARED: also a's mma_prepare_x copy at p_ap. Side jobs: zero
    stage 2's accumulator (a slice a program) and the stage-2 + tail launch's two counters
    (program 0), after the wait under PDL. TRIGGER (without PDL): let the next launch start as
    programs start. TILED: MXFP4 codes in the tiled layout."""
    if TRIGGER and not PDL:
        gdc_launch_dependents()
    if not PDL:
        _stage1_side_jobs(p_out, p_sync, i_b, i_n, n_n, n_zero, ZERO_OUT, ZERO_SYNC, ZERO_BLOCK)
    # the plan's count, entries and expert in one round trip; the weight addresses wait for them
    n_valid = tl.load(p_num_valid)
    b_ent, b_tok, m_ent = _plan_tile(p_sorted, i_b, block_m, n_entries, top_k, BLOCK_M)
    i_e = tl.load(p_block_expert + i_b).to(tl.int64)
    runs = _plan_tile_runs(i_b, block_m, n_valid, i_e, m_ent)
    p_we = p_w + i_e * (2 * N_I * (D_PAIRS // 4 if FP4 else D_PAIRS))
    p_se = p_ws + i_e * (2 * N_I * (D_PAIRS // 16)) if FP4 else p_ws
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
        _stage1_side_jobs(p_out, p_sync, i_b, i_n, n_n, n_zero, ZERO_OUT, ZERO_SYNC, ZERO_BLOCK)
    if runs:
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < N_I
        if USE_MMA:  # tensor-core tiles: BLOCK_N gate rows and their up rows (R = 2)
            p_x = p_z + tl.sum(tl.where(m_ent, b_tok, 0)) * D_PAIRS
            b_gu = fp4_mma_gemv(p_x, p_we, p_se, i_n * BLOCK_N, N_I, N_I, N_I, D_PAIRS // 16, 2,
                                WARPS_K, ASM, L2_PREFETCH, X_PREPARED, 1.0, EVICT_FIRST, TILED)
            b_g, b_u = tl.split(tl.permute(b_gu, [1, 0]))
            b_a = act(b_g, b_u, beta, linear_beta, ACT)[None, :]
        else:
            b_a = gate_up_act(p_z, b_tok, m_ent, p_we, p_se, o_n, m_n, N_I, D_PAIRS, beta,
                              linear_beta, ACT, BLOCK_M, BLOCK_N, BLOCK_KP, FP4, KLANE_STAGES,
                              TOKEN_LOOP, TILED)
        b_ab = to_bf16(b_a)
        tl.store(p_a + b_ent[:, None] * N_I + o_n[None, :], b_ab,
                 mask=m_ent[:, None] & m_n[None, :])
        if WRITE_PREPARED:
            store_prepared_x(p_ap, b_ent, o_n, N_I, b_ab, m_ent[:, None] & m_n[None, :])


@triton.jit
def _zero_y_ticket(p_y, p_c, o_n, m_n, n_rows, D, ZERO_BLOCK: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Atomic stage 2 owning its zeroing, per D tile: take a ticket (p_c[0], this tile's
    counters); ticket 0 zeroes y[0:n_rows, o_n] and raises the flag p_c[1] (release). Called
    after the PDL wait: the previous launch (which may still read y) has ended. One counter
    triple per D tile keeps the atomics on one address to the plan's tile count."""
    i_t = tl.atomic_add(p_c, 1, sem="relaxed")
    if i_t == 0:
        o_r = tl.arange(0, ZERO_BLOCK)
        tl.store(p_y + o_r[:, None] * D + o_n[None, :],
                 tl.zeros([ZERO_BLOCK, BLOCK_N], dtype=tl.float32),
                 mask=(o_r < n_rows)[:, None] & m_n[None, :])
        tl.debug_barrier()  # every thread's zeros before the release
        tl.atomic_xchg(p_c + 1, 1, sem="release")


@triton.jit
def _wait_zeroed(p_c):
    """Wait (plain polls, then one acquire RMW, as _tail_tile) until this D tile of y is
    zeroed."""
    n_spin = tl.program_id(0) * 0
    while (tl.load(p_c + 1, volatile=True) == 0) & (n_spin < MAX_SPIN):
        n_spin += 1
    tl.atomic_max(p_c + 1, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _zero_y_done(p_c, n_users):
    """Count this program done (p_c[2]); the last of the n_users programs of this D tile resets
    its three counters for the next launch (every one has passed its wait by then)."""
    tl.debug_barrier()  # every thread's adds issued
    if tl.atomic_add(p_c + 2, 1, sem="acq_rel") == n_users - 1:
        tl.atomic_xchg(p_c, 0, sem="relaxed")
        tl.atomic_xchg(p_c + 1, 0, sem="relaxed")
        tl.atomic_xchg(p_c + 2, 0, sem="relaxed")


@triton.jit
def _stage2_tile(pid, p_a, p_w, p_ws, p_sorted, p_sorted_w, p_block_expert, p_num_valid,
                 p_topk_ids, p_topk_w, p_y, n_entries, block_m, top_k, D, I_PAIRS, n_d_tiles,
                 p_sync, n_zero, ZERO_Y: tl.constexpr, ZERO_BLOCK: tl.constexpr,
                 FP4: tl.constexpr, USE_MMA: tl.constexpr, R: tl.constexpr,
                 WARPS_K: tl.constexpr, L2_PREFETCH: tl.constexpr, X_PREPARED: tl.constexpr,
                 EVICT_FIRST: tl.constexpr, ASM: tl.constexpr, KLANE_STAGES: tl.constexpr,
                 DETERMINISTIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_KP: tl.constexpr, TOKEN_LOOP: tl.constexpr, PDL: tl.constexpr,
                 TILED: tl.constexpr):
    """Stage-2 program pid = (row i_b, D tile i_n). Atomic: i_b is a plan tile; adds
    w * (a[entries] @ w2[e]^T) into y. Deterministic: i_b is a token; sums its top_k slots in
    slot order and stores. TILED: MXFP4 codes in the tiled layout. ZERO_Y (atomic, launched
    alone): the launch zeroes y itself, one D tile at a time: the first program of a D tile to
    start zeroes it (_zero_y_ticket) and the others' adds wait for that (after their GEMV)."""
    i_b, i_n = pid // n_d_tiles, pid % n_d_tiles
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < D
    if DETERMINISTIC:
        b_y = tl.zeros([1, BLOCK_N], dtype=tl.float32)
        for k in range(0, top_k):
            i_e = tl.load(p_topk_ids + i_b * top_k + k).to(tl.int64)
            o_row = tl.zeros([1], dtype=tl.int32) + i_b * top_k + k
            p_se = p_ws + i_e * (D * (I_PAIRS // 16)) if FP4 else p_ws
            p_we = p_w + i_e * (D * (I_PAIRS // 4 if FP4 else I_PAIRS))
            b_p = expert_gemv(p_a, o_row, o_row < n_entries, p_we, p_se, o_n, m_n, I_PAIRS, 1,
                              BLOCK_N, BLOCK_KP, FP4, KLANE_STAGES, False, TILED)
            b_y += tl.load(p_topk_w + i_b * top_k + k) * b_p
        tl.store(p_y + i_b * D + o_n[None, :], b_y, mask=m_n[None, :])
    else:
        n_valid = tl.load(p_num_valid)  # with the entries and expert: one round trip
        b_ent, b_tok, m_ent = _plan_tile(p_sorted, i_b, block_m, n_entries, top_k, BLOCK_M)
        i_e = tl.load(p_block_expert + i_b).to(tl.int64)
        o_m = tl.arange(0, BLOCK_M)
        b_w = tl.load(p_sorted_w + i_b * block_m + o_m, mask=o_m < block_m, other=0.0)
        runs = _plan_tile_runs(i_b, block_m, n_valid, i_e, m_ent)
        p_se = p_ws + i_e * (D * (I_PAIRS // 16)) if FP4 else p_ws
        p_we = p_w + i_e * (D * (I_PAIRS // 4 if FP4 else I_PAIRS))
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        if ZERO_Y:  # the first program of this D range to start zeroes it
            _zero_y_ticket(p_y, p_sync + 3 * i_n, o_n, m_n, n_zero, D, ZERO_BLOCK, BLOCK_N)
        if runs:
            if USE_MMA:  # tensor-core tiles: BLOCK_N consecutive rows
                p_x = p_a + tl.sum(tl.where(m_ent, b_ent, 0)) * I_PAIRS
                # the router weight rides on the group factors, so that its load is issued with
                # the plan's (the compiler puts a load used after the K loop there)
                w_in = tl.sum(tl.where(m_ent, b_w, 0.0))
                b_w = tl.full([BLOCK_M], 1.0, tl.float32)  # applied in the factors
                b_p = tl.reshape(fp4_mma_gemv(p_x, p_we, p_se, i_n * BLOCK_N, BLOCK_N // R, D, 0,
                                              I_PAIRS // 16, R, WARPS_K, ASM, L2_PREFETCH,
                                              X_PREPARED, w_in, EVICT_FIRST, TILED),
                                 [1, BLOCK_N])
            else:
                b_p = expert_gemv(p_a, b_ent, m_ent, p_we, p_se, o_n, m_n, I_PAIRS, BLOCK_M,
                                  BLOCK_N, BLOCK_KP, FP4, KLANE_STAGES, TOKEN_LOOP, TILED)
            if ZERO_Y:
                _wait_zeroed(p_sync + 3 * i_n)
            tl.atomic_add(p_y + b_tok[:, None] * D + o_n[None, :], b_p * b_w[:, None],
                          mask=m_ent[:, None] & m_n[None, :], sem="relaxed")
        if ZERO_Y:
            _zero_y_done(p_sync + 3 * i_n, tl.num_programs(0) // n_d_tiles)


@triton.jit
def _tail_tile(pid, p_y, p_nw, p_up, p_sa, p_sw2, p_shared, p_o, p_done, n_wait, M, D, H,
               S_PAIRS, eps, LATENT: tl.constexpr, SHARED: tl.constexpr, WAIT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
               BLOCK_SS: tl.constexpr, TOKEN_LOOP: tl.constexpr, PDL: tl.constexpr):
    """Tail program pid (H tile): out = rstd * ((y * g) @ W_up^T) (LATENT) or y, plus the shared
    output (SHARED 1: add a computed [M, H] tensor; 2: a_s @ Ws2^T computed here). WAIT: the
    shared GEMV first, then wait until n_wait stage-2 programs have signalled p_done. PDL: the
    shared GEMV (SHARED 2) first, then wait for the previous launch. y is read through L2 only
    (.cg): it was written by other programs' atomics."""
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    m_o = m_m[:, None] & m_n[None, :]
    b_o = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SHARED == 2:
        b_o += bf16_gemv(p_sa, o_m, m_m, p_sa, p_sw2, o_n, m_n, S_PAIRS, BLOCK_M, BLOCK_N,
                         BLOCK_KP, False, False, TOKEN_LOOP)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if SHARED == 1:
        b_o += tl.load(p_shared + o_m[:, None] * H + o_n[None, :], mask=m_o, other=0.0).to(
            tl.float32)
    if WAIT:
        # poll with plain (volatile) loads, which L2 serves side by side, then one acquire RMW:
        # every stage-2 tile's adds happen before the reads of y below. The RMW is a max with 0
        # (the count is >= 0: unchanged), not an add of 0: Triton 3.6 turns an acquire add of 0
        # into an acquire load and drops it when its value is unused, leaving no acquire at all.
        n_spin = tl.program_id(0) * 0  # an int32 tensor: a loop-carried counter
        while (tl.load(p_done, volatile=True) < n_wait) & (n_spin < MAX_SPIN):
            n_spin += 1
        tl.atomic_max(p_done, 0, sem="acquire")
        tl.debug_barrier()  # the acquiring thread's view, then every thread's reads
    if LATENT:
        b_u = bf16_gemv(p_y, o_m, m_m, p_nw, p_up, o_n, m_n, D // 2, BLOCK_M, BLOCK_N, BLOCK_KP,
                        True, True, TOKEN_LOOP)
        b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # every program recomputes sum(y^2): M*D*4 B
        for d0 in range(0, D, BLOCK_SS):
            o_d = d0 + tl.arange(0, BLOCK_SS)
            b_v = tl.load(p_y + o_m[:, None] * D + o_d[None, :],
                          mask=m_m[:, None] & (o_d < D)[None, :], other=0.0, cache_modifier=".cg")
            b_ss += tl.sum(b_v * b_v, axis=1)
        b_o += b_u * (1.0 / tl.sqrt(b_ss / D + eps))[:, None]
    else:
        b_o += tl.load(p_y + o_m[:, None] * H + o_n[None, :], mask=m_o, other=0.0,
                       cache_modifier=".cg")
    tl.store(p_o + o_m[:, None] * H + o_n[None, :], to_bf16(b_o), mask=m_o)


@triton.jit
def _moe_stage2_tail_kernel(
        p_a, p_w, p_ws, p_sorted, p_sorted_w, p_block_expert, p_num_valid, p_topk_ids, p_topk_w,
        p_y, n_entries, block_m, top_k, D, I_PAIRS, n_d_tiles, n_stage2,
        p_nw, p_up, p_sa, p_sw2, p_shared, p_o, p_sync, M, H, S_PAIRS, eps, n_zero,
        STAGE2: tl.constexpr, TAIL: tl.constexpr, ZERO_Y: tl.constexpr,
        ZERO_BLOCK: tl.constexpr, FP4: tl.constexpr, USE_MMA: tl.constexpr,
        R: tl.constexpr, WARPS_K: tl.constexpr, L2_PREFETCH: tl.constexpr,
        X_PREPARED: tl.constexpr, EVICT_FIRST: tl.constexpr, ASM: tl.constexpr,
        KLANE_STAGES: tl.constexpr, DETERMINISTIC: tl.constexpr, BLOCK_M2: tl.constexpr,
        BLOCK_N2: tl.constexpr, BLOCK_KP2: tl.constexpr, LATENT: tl.constexpr,
        SHARED: tl.constexpr, BLOCK_MT: tl.constexpr, BLOCK_NT: tl.constexpr,
        BLOCK_KPT: tl.constexpr, BLOCK_SS: tl.constexpr, TOKEN_LOOP: tl.constexpr,
        PDL: tl.constexpr, TILED: tl.constexpr):
    """Stage 2, the tail, or both in one launch (TILED: stage 2's MXFP4 codes in the tiled
    layout). Both: each program takes a ticket (atomic counter p_sync[0]); tickets
    [0, n_stage2) run stage-2 tiles and then count themselves done in p_sync[1] (release);
    later tickets run tail tiles, which wait for all stage-2 tiles (acquire). Tickets follow
    the order programs actually start, so every stage-2 tile a tail tile waits for is already
    running: no deadlock whatever the scheduling. PDL: stage 2 alone or the tail alone.
    ZERO_Y: the atomic stage 2 alone zeroes y[0:n_zero rows] itself, ordered by the counters
    p_sync [3 per D tile] (zero between launches); the same ticket argument rules out a
    deadlock."""
    if STAGE2 and TAIL:
        i_t = tl.atomic_add(p_sync, 1, sem="relaxed")
        if i_t < n_stage2:
            _stage2_tile(i_t, p_a, p_w, p_ws, p_sorted, p_sorted_w, p_block_expert, p_num_valid,
                         p_topk_ids, p_topk_w, p_y, n_entries, block_m, top_k, D, I_PAIRS,
                         n_d_tiles, p_sync, n_zero, False, ZERO_BLOCK, FP4, USE_MMA, R, WARPS_K,
                         L2_PREFETCH, X_PREPARED,
                         EVICT_FIRST, ASM, KLANE_STAGES, DETERMINISTIC, BLOCK_M2, BLOCK_N2,
                         BLOCK_KP2, TOKEN_LOOP, False, TILED)
            tl.debug_barrier()  # every thread's adds issued before the release below
            tl.atomic_add(p_sync + 1, 1, sem="release")
        else:
            _tail_tile(i_t - n_stage2, p_y, p_nw, p_up, p_sa, p_sw2, p_shared, p_o, p_sync + 1,
                       n_stage2, M, D, H, S_PAIRS, eps, LATENT, SHARED, True, BLOCK_MT, BLOCK_NT,
                       BLOCK_KPT, BLOCK_SS, TOKEN_LOOP, False)
    elif STAGE2:
        _stage2_tile(tl.program_id(0), p_a, p_w, p_ws, p_sorted, p_sorted_w, p_block_expert,
                     p_num_valid, p_topk_ids, p_topk_w, p_y, n_entries, block_m, top_k, D,
                     I_PAIRS, n_d_tiles, p_sync, n_zero, ZERO_Y, ZERO_BLOCK, FP4, USE_MMA, R,
                     WARPS_K, L2_PREFETCH, X_PREPARED,
                     EVICT_FIRST, ASM, KLANE_STAGES, DETERMINISTIC, BLOCK_M2, BLOCK_N2,
                     BLOCK_KP2, TOKEN_LOOP, PDL, TILED)
    else:
        _tail_tile(tl.program_id(0), p_y, p_nw, p_up, p_sa, p_sw2, p_shared, p_o, p_sync,
                   n_stage2, M, D, H, S_PAIRS, eps, LATENT, SHARED, False, BLOCK_MT, BLOCK_NT,
                   BLOCK_KPT, BLOCK_SS, TOKEN_LOOP, PDL)
