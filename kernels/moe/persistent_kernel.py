"""The persistent MoE jit kernel: every work item of the block in one launch.

Work items, in ticket order (each waits only for items with lower tickets):

0. route (ROUTE only): route_sort's programs (kernels/route/sort.py: the gate GEMV partials and
   the plan's padding; the last of them selects and sorts), each counted when done;
1. front: latent-down tiles (z[:, tile] = x @ W_down[tile]^T, or x's columns without a latent;
   atomic stage 2: also zero y[:, tile]) then shared gate/up tiles (a_s = act(x @ Ws1^T,
   x @ Ws3^T));
2. stage 1 (plan tile b, I tile): waits for every latent-down tile (and route item);
   a[entries, tile] = act(z @ W1[e]^T, z @ W3[e]^T), then counts itself in plan tile b's
   counter;
3. stage 2 (plan tile b, D tile): waits for plan tile b's stage-1 tiles; atomic: y[tokens] +=
   w * (a[entries] @ W2[e]^T); deterministic: the routed rows' partials to a scratch;
4. reduce (deterministic only, D tile): waits for every stage-2 tile; y[t] = sum over slots k in
   order of topk_weights[t, k] * partial[t * top_k + k];
5. tail (H tile): the shared down GEMV (after the shared tiles) and the first up-projection
   weight step, then waits for y; out = rstd * ((y * g) @ W_up^T) [* per-channel fp8 scale] +
   a_s @ Ws2^T, the norm's sum of squares taken in the GEMV's pass over y.

Sync words (int32, ``p_sync``): WORK (ticket counter), EXIT (programs done), the phase counters
and one counter per plan tile. The last program to exit zeroes them all for the next launch
(or CUDA-graph replay).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ..route.sort import _route_program
from ..runtime import INTERPRETED  # noqa: F401  (sets the interpreter up before any jit)
from .gemv import act, expert_gemv, gate_up_act, to_bf16
from .persistent_gemv import gemv, pow2_scales, row_amax, signal_count, wait_count
from .stages import _plan_tile, _plan_tile_runs

SYNC_HEADER = 8  # sync words before the plan tiles' counters (python int, for the launcher)
WORK, EXIT, CNT_Z, CNT_SH, CNT_S2, CNT_RED, CNT_PLAN = (tl.constexpr(i) for i in range(7))
CNT_TILE = tl.constexpr(SYNC_HEADER)  # plan tile b's stage-1 counter is p_sync[CNT_TILE + b]
RESET_BLOCK = tl.constexpr(1024)


@triton.jit
def _globaltimer():
    """The GPU's global nanosecond clock (compiled only: the interpreter has no inline asm)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _front_item(j, p_x, p_wd, p_z, p_y, p_ws13, p_as, p_sync, M, H, D, S, n_z, beta,
                linear_beta, ACT: tl.constexpr, LATENT: tl.constexpr, ZERO_Y: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Front item j: a latent-down (or x copy) tile of z for j < n_z, else a shared tile."""
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    one = tl.full([BLOCK_M], 1.0, tl.float32)
    if j < n_z:
        o_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < D
        m_o = m_m[:, None] & m_n[None, :]
        if LATENT:
            b_z = gemv(p_x, o_m, m_m, one, p_wd, p_wd, o_n, m_n, H, p_wd, False, False, False,
                       False, False, False, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            b_z = tl.load(p_x + o_m[:, None] * H + o_n[None, :], mask=m_o, other=0.0).to(
                tl.float32)
        tl.store(p_z + o_m[:, None] * D + o_n[None, :], to_bf16(b_z), mask=m_o)
        if ZERO_Y:
            tl.store(p_y + o_m[:, None] * D + o_n[None, :],
                     tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), mask=m_o)
        signal_count(p_sync + CNT_Z)
    else:
        o_n = (j - n_z) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < S
        b_g = gemv(p_x, o_m, m_m, one, p_ws13, p_ws13, o_n, m_n, H, p_ws13, False, False,
                   False, False, False, False, BLOCK_M, BLOCK_N, BLOCK_K)
        b_u = gemv(p_x, o_m, m_m, one, p_ws13, p_ws13, o_n + S, m_n, H, p_ws13, False, False,
                   False, False, False, False, BLOCK_M, BLOCK_N, BLOCK_K)
        b_a = act(b_g, b_u, beta, linear_beta, ACT)
        tl.store(p_as + o_m[:, None] * S + o_n[None, :], to_bf16(b_a),
                 mask=m_m[:, None] & m_n[None, :])
        signal_count(p_sync + CNT_SH)


@triton.jit
def _stage1_item(j, p_z, p_z32, p_w, p_ws, p_sorted, p_block_expert, p_num_valid, p_a, p_sync,
                 n_entries, block_m, top_k, N_I, D, n_i, n_z, beta, linear_beta,
                 ACT: tl.constexpr, FP4: tl.constexpr, XQ: tl.constexpr, DOT: tl.constexpr,
                 EMULATE: tl.constexpr, KLANE: tl.constexpr, TILED: tl.constexpr,
                 TOKEN_LOOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_KQ: tl.constexpr):
    """Stage-1 item j = (plan tile, I tile): gate and up GEMVs of the tile's tokens' z rows
    (XQ: quantized to e4m3 per row) against expert e's w13, the activation, a bf16 store.
    MXFP4 codes come as int32 words. KLANE: the GEMVs of kernels/moe/gemv.py (z as int32 pairs
    at p_z32, quantized as it loads with XQ; bf16 weights as pairs; TILED: codes in the tiled
    layout)."""
    i_b, i_n = j // n_i, j % n_i
    wait_count(p_sync + CNT_Z, n_z)
    n_valid = tl.load(p_num_valid)
    b_ent, b_tok, m_ent = _plan_tile(p_sorted, i_b, block_m, n_entries, top_k, BLOCK_M)
    i_e = tl.load(p_block_expert + i_b).to(tl.int64)
    if _plan_tile_runs(i_b, block_m, n_valid, i_e, m_ent):
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < N_I
        # expert e's 2I rows: D / 8 int32 code words or D bf16 values (KLANE: D / 2 pairs)
        p_we = p_w + i_e * (2 * N_I * (D // 8 if FP4 else (D // 2 if KLANE else D)))
        p_se = p_ws + i_e * (2 * N_I * (D // 32)) if FP4 else p_ws
        b_inv = tl.full([BLOCK_M], 1.0, tl.float32)
        b_sc = b_inv
        if XQ:
            b_inv, b_sc = pow2_scales(row_amax(p_z, b_tok, m_ent, D, BLOCK_M, BLOCK_KQ))
        if KLANE:
            b_a = gate_up_act(p_z32, b_tok, m_ent, p_we, p_se, o_n, m_n, N_I, D // 2, beta,
                              linear_beta, ACT, BLOCK_M, BLOCK_N, BLOCK_K // 2, FP4, 0,
                              TOKEN_LOOP, TILED, b_inv, b_sc, XQ)
        else:
            b_g = gemv(p_z, b_tok, m_ent, b_inv, p_we, p_se, o_n, m_n, D, p_z, FP4, XQ, False,
                       True, DOT, EMULATE, BLOCK_M, BLOCK_N, BLOCK_K)
            b_u = gemv(p_z, b_tok, m_ent, b_inv, p_we, p_se, o_n + N_I, m_n, D, p_z, FP4, XQ,
                       False, True, DOT, EMULATE, BLOCK_M, BLOCK_N, BLOCK_K)
            b_a = act(b_g * b_sc[:, None], b_u * b_sc[:, None], beta, linear_beta, ACT)
        tl.store(p_a + b_ent[:, None] * N_I + o_n[None, :], to_bf16(b_a),
                 mask=m_ent[:, None] & m_n[None, :])
    signal_count(p_sync + CNT_TILE + i_b)


@triton.jit
def _stage2_item(j, p_a, p_a32, p_w, p_ws, p_sorted, p_sorted_w, p_block_expert, p_num_valid,
                 p_y, p_part, p_sync, n_entries, block_m, top_k, N_I, D, n_d, n_i,
                 FP4: tl.constexpr, XQ: tl.constexpr, DOT: tl.constexpr, EMULATE: tl.constexpr,
                 KLANE: tl.constexpr, TILED: tl.constexpr, TOKEN_LOOP: tl.constexpr,
                 DETERMINISTIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_KQ: tl.constexpr):
    """Stage-2 item j = (plan tile, D tile): the tile's a rows (XQ: quantized per row) against
    expert e's w2; atomically added into y with the router weights, or (DETERMINISTIC) stored
    per routed row."""
    i_b, i_n = j // n_d, j % n_d
    wait_count(p_sync + CNT_TILE + i_b, n_i)
    n_valid = tl.load(p_num_valid)
    b_ent, b_tok, m_ent = _plan_tile(p_sorted, i_b, block_m, n_entries, top_k, BLOCK_M)
    i_e = tl.load(p_block_expert + i_b).to(tl.int64)
    if _plan_tile_runs(i_b, block_m, n_valid, i_e, m_ent):
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < D
        m_o = m_ent[:, None] & m_n[None, :]
        p_we = p_w + i_e * (D * (N_I // 8 if FP4 else (N_I // 2 if KLANE else N_I)))
        p_se = p_ws + i_e * (D * (N_I // 32)) if FP4 else p_ws
        b_inv = tl.full([BLOCK_M], 1.0, tl.float32)
        b_sc = b_inv
        if XQ:
            b_inv, b_sc = pow2_scales(row_amax(p_a, b_ent, m_ent, N_I, BLOCK_M, BLOCK_KQ))
        if KLANE:
            b_p = expert_gemv(p_a32, b_ent, m_ent, p_we, p_se, o_n, m_n, N_I // 2, BLOCK_M,
                              BLOCK_N, BLOCK_K // 2, FP4, 0, TOKEN_LOOP, TILED, b_inv,
                              XQ) * b_sc[:, None]
        else:
            b_p = gemv(p_a, b_ent, m_ent, b_inv, p_we, p_se, o_n, m_n, N_I, p_a, FP4, XQ, False,
                       True, DOT, EMULATE, BLOCK_M, BLOCK_N, BLOCK_K) * b_sc[:, None]
        if DETERMINISTIC:
            tl.store(p_part + b_ent[:, None] * D + o_n[None, :], b_p, mask=m_o)
        else:
            o_m = tl.arange(0, BLOCK_M)
            b_w = tl.load(p_sorted_w + i_b * block_m + o_m, mask=o_m < block_m, other=0.0)
            tl.atomic_add(p_y + b_tok[:, None] * D + o_n[None, :], b_p * b_w[:, None],
                          mask=m_o, sem="relaxed")
    signal_count(p_sync + CNT_S2)


@triton.jit
def _reduce_item(j, p_part, p_topk_w, p_y, p_sync, M, D, top_k, n_s2, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Reduce item j (D tile, deterministic stage 2): y[t] = sum over k in slot order of
    topk_weights[t, k] * partial[t * top_k + k]."""
    wait_count(p_sync + CNT_S2, n_s2)
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    m_o = m_m[:, None] & (o_n < D)[None, :]
    b_y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, top_k):
        b_w = tl.load(p_topk_w + o_m * top_k + k, mask=m_m, other=0.0)
        b_p = tl.load(p_part + (o_m * top_k + k)[:, None] * D + o_n[None, :], mask=m_o,
                      other=0.0, cache_modifier=".cg")
        b_y += b_w[:, None] * b_p
    tl.store(p_y + o_m[:, None] * D + o_n[None, :], b_y, mask=m_o)
    signal_count(p_sync + CNT_RED)


@triton.jit
def _up_tile(p_up, o_n, m_n, k0, D, BLOCK_K: tl.constexpr):
    """Latent-up weight rows o_n, columns k0 .. k0 + BLOCK_K, as stored (bf16 or e4m3)."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(p_up + o_n[:, None] * D + o_k[None, :], mask=m_n[:, None] & (o_k < D)[None, :],
                   other=0.0)


@triton.jit
def _norm_up_step(acc, ss, b_w, p_y, p_nw, o_m, m_m, k0, D, BLOCK_K: tl.constexpr):
    """One K step of (y * g) @ W_up^T, with the rows' sum of squares of y in the same pass."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    m_k = o_k < D
    b_y = tl.load(p_y + o_m[:, None] * D + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                  other=0.0, cache_modifier=".cg")
    ss += tl.sum(b_y * b_y, axis=1)
    b_x = b_y * tl.load(p_nw + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
    acc += tl.sum(b_x[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)
    return acc, ss


@triton.jit
def _tail_item(j, p_as, p_ws2, p_y, p_nw, p_up, p_ups, p_o, p_sync, M, D, H, S, n_sh, i_y, n_y,
               eps, LATENT: tl.constexpr, SHARED: tl.constexpr, UP_FP8: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tail item j (H tile): shared down GEMV, then (y ready) the latent RMSNorm + up-projection
    (UP_FP8: e4m3 rows times their fp32 scale) or y itself, summed, stored bf16. The first
    up-projection weight step is loaded before the wait for y (weights do not depend on it);
    the norm's sum of squares is taken in the GEMV's pass over y (rstd scales whole rows)."""
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    m_o = m_m[:, None] & m_n[None, :]
    one = tl.full([BLOCK_M], 1.0, tl.float32)
    b_o = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SHARED:
        wait_count(p_sync + CNT_SH, n_sh)
        b_o += gemv(p_as, o_m, m_m, one, p_ws2, p_ws2, o_n, m_n, S, p_ws2, False, False, False,
                    True, False, False, BLOCK_M, BLOCK_N, BLOCK_K)
    if LATENT:
        b_w0 = _up_tile(p_up, o_n, m_n, 0, D, BLOCK_K)
    wait_count(p_sync + i_y, n_y)
    if LATENT:
        b_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        b_u, b_ss = _norm_up_step(b_u, b_ss, b_w0, p_y, p_nw, o_m, m_m, 0, D, BLOCK_K)
        for k0 in range(BLOCK_K, D, BLOCK_K):
            b_u, b_ss = _norm_up_step(b_u, b_ss, _up_tile(p_up, o_n, m_n, k0, D, BLOCK_K), p_y,
                                      p_nw, o_m, m_m, k0, D, BLOCK_K)
        if UP_FP8:
            b_u *= tl.load(p_ups + o_n, mask=m_n, other=0.0)[None, :]
        b_o += b_u * (1.0 / tl.sqrt(b_ss / D + eps))[:, None]
    else:
        b_o += tl.load(p_y + o_m[:, None] * D + o_n[None, :], mask=m_o, other=0.0,
                       cache_modifier=".cg")
    tl.store(p_o + o_m[:, None] * H + o_n[None, :], to_bf16(b_o), mask=m_o)


@triton.jit
def moe_persistent_kernel(
        p_x, p_wd, p_z, p_z32, p_ws13, p_as, p_sorted, p_sorted_w, p_block_expert, p_num_valid,
        p_topk_w, p_w13, p_w13s, p_a, p_a32, p_w2, p_w2s, p_y, p_part, p_nw, p_up, p_ups, p_ws2,
        p_o, p_sync, p_trace, M, H, D, N_I, S, n_entries, block_m, top_k, n_tiles, n_z, n_sh, n_i,
        n_d, n_dr, n_t, beta, linear_beta, eps,
        # route_sort's (kernels/route/sort.py), read when ROUTE
        r_x, r_w, r_bias, r_part, r_cand, r_rank, r_count, r_ids, r_topk_w, r_sorted_ids,
        r_sorted_w, r_block_ids, r_num_valid, r_out, r_M, r_H, r_n_sorted, r_n_blocks, r_n_out,
        r_scaling, r_e_tiles, n_route,
        ACT: tl.constexpr, LATENT: tl.constexpr, SHARED: tl.constexpr, FP4: tl.constexpr,
        XQ: tl.constexpr, DOT: tl.constexpr, EMULATE: tl.constexpr, KLANE: tl.constexpr,
        TILED13: tl.constexpr, TILED2: tl.constexpr, TOKEN_LOOP: tl.constexpr,
        DETERMINISTIC: tl.constexpr, UP_FP8: tl.constexpr, BLOCK_MT: tl.constexpr,
        BLOCK_ME: tl.constexpr, BLOCK_NF: tl.constexpr, BLOCK_NE: tl.constexpr,
        BLOCK_N2: tl.constexpr,
        BLOCK_NT: tl.constexpr, BLOCK_KF: tl.constexpr, BLOCK_KE: tl.constexpr,
        TRACE: tl.constexpr, ROUTE_WAIT: tl.constexpr, ROUTE: tl.constexpr = False,
        E: tl.constexpr = 1, SPLIT_K: tl.constexpr = 1, TOP_K: tl.constexpr = 1,
        N_GROUP: tl.constexpr = 1, TOPK_GROUP: tl.constexpr = 1, GROUP_SIZE: tl.constexpr = 1,
        RENORMALIZE: tl.constexpr = False, BM: tl.constexpr = 1, GEMV_E: tl.constexpr = 1,
        GEMV_K: tl.constexpr = 1, FILL: tl.constexpr = 1, BLOCK_T: tl.constexpr = 1,
        BLOCK_E: tl.constexpr = 1, BLOCK_G: tl.constexpr = 1, BLOCK_S: tl.constexpr = 1,
        BUCKETS: tl.constexpr = 0, CAP: tl.constexpr = 1, IN_REGS: tl.constexpr = False,
        BLOCK_R: tl.constexpr = 1, BLOCK_C: tl.constexpr = 1, GEMV_ROWS: tl.constexpr = 0,
        GEMV_CHUNKS: tl.constexpr = 1, CAND_CACHE: tl.constexpr = False,
        SCALAR_E: tl.constexpr = False, SORT_N: tl.constexpr = 1,
        EARLY_DEPENDENTS: tl.constexpr = False, PDL: tl.constexpr = False,
        SELECT: tl.constexpr = True, DOT_M: tl.constexpr = 1, DOT_K: tl.constexpr = 1,
        DOT_FP32: tl.constexpr = False):
    """Each program takes tickets from p_sync[WORK] until none is left and runs their items
    (see the module docstring); the last program out zeroes the sync words. TRACE: item t's
    (start ns, end ns, SM, program) into int64 p_trace[4 t .. 4 t + 3]. ROUTE_WAIT: launched
    while the route that wrote the plan may still run; an item past the front waits for it
    first (the front reads x and weights only). ROUTE: the first n_route tickets are route_sort's
    programs (r_e_tiles E tiles fastest; route_sort's constexprs from E on, its PDL and
    EARLY_DEPENDENTS off, SELECT on); stage 1 waits for all of them."""
    e_front = n_z + n_sh
    e_s1 = e_front + n_tiles * n_i
    e_s2 = e_s1 + n_tiles * n_d
    e_red = e_s2 + n_dr
    n_items = n_route + e_red + n_t
    i_y = CNT_RED if DETERMINISTIC else CNT_S2
    n_y = n_dr if DETERMINISTIC else n_tiles * n_d
    t = tl.atomic_add(p_sync + WORK, 1, sem="relaxed")
    while t < n_items:
        if TRACE:
            t_start = _globaltimer()
        u = t - n_route  # the item's ticket among the block's own (route items below 0)
        if ROUTE_WAIT:  # noqa: SIM102 - a constexpr branch, then a runtime one
            if u >= e_front:
                gdc_wait()
        if ROUTE:  # noqa: SIM102 - a constexpr branch, then a runtime one
            if u >= e_front and u < e_s1:
                wait_count(p_sync + CNT_PLAN, n_route)
        if u < 0:
            if ROUTE:
                _route_program(t % r_e_tiles, t // r_e_tiles, r_e_tiles, n_route, r_x, r_w,
                               r_bias, r_part, r_cand, r_rank, r_count, r_ids, r_topk_w,
                               r_sorted_ids, r_sorted_w, r_block_ids, r_num_valid, r_out, r_M,
                               r_H, r_n_sorted, r_n_blocks, r_n_out, r_scaling, E, SPLIT_K,
                               TOP_K, N_GROUP, TOPK_GROUP, GROUP_SIZE, RENORMALIZE, BM, GEMV_E,
                               GEMV_K, FILL, BLOCK_T, BLOCK_E, BLOCK_G, BLOCK_S, BUCKETS, CAP,
                               IN_REGS, BLOCK_R, BLOCK_C, GEMV_ROWS, GEMV_CHUNKS, CAND_CACHE,
                               SCALAR_E, SORT_N, EARLY_DEPENDENTS, PDL, SELECT, DOT_M, DOT_K,
                               DOT_FP32)
                signal_count(p_sync + CNT_PLAN)
        elif u < e_front:
            _front_item(u, p_x, p_wd, p_z, p_y, p_ws13, p_as, p_sync, M, H, D, S, n_z, beta,
                        linear_beta, ACT, LATENT, not DETERMINISTIC, BLOCK_MT, BLOCK_NF,
                        BLOCK_KF)
        elif u < e_s1:
            _stage1_item(u - e_front, p_z, p_z32, p_w13, p_w13s, p_sorted, p_block_expert,
                         p_num_valid, p_a, p_sync, n_entries, block_m, top_k, N_I, D, n_i, n_z,
                         beta, linear_beta, ACT, FP4, XQ, DOT, EMULATE, KLANE, TILED13,
                         TOKEN_LOOP, BLOCK_ME, BLOCK_NE, BLOCK_KE, BLOCK_KF)
        elif u < e_s2:
            _stage2_item(u - e_s1, p_a, p_a32, p_w2, p_w2s, p_sorted, p_sorted_w,
                         p_block_expert, p_num_valid, p_y, p_part, p_sync, n_entries, block_m,
                         top_k, N_I, D, n_d, n_i, FP4, XQ, DOT, EMULATE, KLANE, TILED2,
                         TOKEN_LOOP, DETERMINISTIC, BLOCK_ME, BLOCK_N2, BLOCK_KE, BLOCK_KF)
        elif u < e_red:
            _reduce_item(u - e_s2, p_part, p_topk_w, p_y, p_sync, M, D, top_k, n_tiles * n_d,
                         BLOCK_MT, BLOCK_N2)
        else:
            _tail_item(u - e_red, p_as, p_ws2, p_y, p_nw, p_up, p_ups, p_o, p_sync, M, D, H, S,
                       n_sh, i_y, n_y, eps, LATENT, SHARED, UP_FP8, BLOCK_MT, BLOCK_NT, BLOCK_KF)
        if TRACE:
            p_t = p_trace + t.to(tl.int64) * 4
            tl.store(p_t, t_start)
            tl.store(p_t + 1, _globaltimer())
            tl.store(p_t + 2, _smid().to(tl.int64))
            tl.store(p_t + 3, tl.program_id(0).to(tl.int64))
        t = tl.atomic_add(p_sync + WORK, 1, sem="relaxed")
    tl.debug_barrier()
    n_out = tl.atomic_add(p_sync + EXIT, 1, sem="acq_rel")
    if n_out == tl.num_programs(0) - 1:  # every other program is past its last ticket
        n_sync = CNT_TILE + n_tiles
        for s0 in range(0, n_sync, RESET_BLOCK):
            o_s = s0 + tl.arange(0, RESET_BLOCK)
            tl.store(p_sync + o_s, tl.zeros([RESET_BLOCK], dtype=tl.int32), mask=o_s < n_sync)
