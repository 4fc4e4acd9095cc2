"""Dense GEMV for decode batches: y[m, n] = sum_k x[m, k] * W[n, k], W bf16 [N, K] row-major.

At batch 1 a projection only has to stream its weight once, so a program owns ``BLOCK_N`` rows
and a K range, keeps its products in registers and touches each weight byte once:
- one token (``BLOCK_M == 1``): a broadcast multiply into a [BLOCK_N, BLOCK_K] fp32 accumulator,
  reduced over K once at the end;
- 2..16 tokens: ``tl.dot`` of the [16, BLOCK_K] x tile (padded) with the weight tile.
Split K: ``SPLIT_K`` programs share a row tile; each stores its fp32 partial in a workspace,
takes a ticket, and the last one sums the partials, resets the ticket and runs the epilogue.

Prologue and epilogues remove launches around the projection: an RMSNorm of x (``NORM``: x * g,
then rstd per token applied to the sums; without split K the K loop sums x^2 as it goes, with it
the finishing program reads x once more), gate/up activation (``ACT``: the weight holds gate rows
then up rows, the output is act(gate, up)), a second product added to the first (``DUAL``: the
MoE tail's shared down-projection beside its normalized up-projection), a residual add, outputs
split by row segments (merged projections: segment s, rows [b_s, b_s+1), is written as its own
contiguous [M, n_s] block of the output buffer), and plain rows followed by gate/up rows in one
grid (``MIXED``: the MoE front's latent down beside the shared experts' gate/up).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .mix import clear, mix_weights, mixed_x

ACT_NONE, ACT_SITU, ACT_SILU = 0, 1, 2


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    return 2.0 * _sigmoid(2.0 * x) - 1.0


@triton.jit
def _act(g, u, beta, linear_beta, ACT: tl.constexpr):
    if ACT == 1:  # SiTU
        return beta * _tanh(g / beta) * _sigmoid(g) * (linear_beta * _tanh(u / linear_beta))
    else:  # SiLU(g) * u
        return g * _sigmoid(g) * u


@triton.jit
def _prefetch_line(ptrs, mask):
    """prefetch.global.L2 of each masked-in pointer's line (inline PTX: compiled only)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2(p_w, o_n, m_n, K, k_lo, k_hi, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 STEPS: tl.constexpr):
    """prefetch.global.L2 of the first STEPS weight steps of the tile, one 128-byte line at a
    time (inline PTX: compiled only)."""
    LINE: tl.constexpr = 1024 // p_w.dtype.element_ty.primitive_bitwidth  # elements a line
    STRIDE: tl.constexpr = LINE if BLOCK_K >= LINE else BLOCK_K
    for i in tl.static_range(STEPS):
        o_k = k_lo + i * BLOCK_K + tl.arange(0, BLOCK_K // STRIDE) * STRIDE
        mask = m_n[:, None] & (o_k < k_hi)[None, :]
        _prefetch_line(p_w + o_n[:, None].to(tl.int64) * K + o_k[None, :], mask)


@triton.jit
def _rstd(p_x, o_m, m_m, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """rsqrt(mean(x^2) + eps) per token: fp32 [BLOCK_M]."""
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        b_x = tl.load(p_x + o_m[:, None] * K + o_k[None, :],
                      mask=m_m[:, None] & (o_k < K)[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(b_x * b_x, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _k_step(k0, k_hi, p_x, p_w, p_g, o_m, m_m, o_n, m_n, K, u_off, acc, acc_u, ss,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
            DOT_FP32: tl.constexpr, TWO: tl.constexpr,
            HEAD_NV: tl.constexpr = 0, HEAD_D: tl.constexpr = 1,
            HEAD_EPS: tl.constexpr = 1e-5, MIX: tl.constexpr = False, p_sb=0, s_n=0,
            s_sbn=0, s_sbm=0, b_pb=0.0, b_pl=0.0, b_rstd=0.0, S_BLOCK_C: tl.constexpr = 1):
    """One K step of :func:`_k_loop` at columns [k0, k0 + BLOCK_K) below k_hi. MIX: x is
    the AttnRes read of live at p_x (bank rows p_sb, weights b_pb / b_pl, rstd b_rstd; p_g
    the read's norm weight; kernels/dense/mix.py)."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    m_k = o_k < k_hi
    o_w = o_n[:, None].to(tl.int64) * K + o_k[None, :]
    m_w = m_n[:, None] & m_k[None, :]
    b_w = tl.load(p_w + o_w, mask=m_w, other=0.0)
    if TWO:  # noqa: SIM108 - a constexpr branch: the load exists only when TWO
        b_u = tl.load(p_w + u_off + o_w, mask=m_w, other=0.0)
    else:
        b_u = b_w
    if MIX:
        b_xf = mixed_x(p_x, p_g, p_sb, s_n, s_sbn, s_sbm, b_pb, b_pl, b_rstd, o_m, m_m, o_k,
                       m_k, K, S_BLOCK_C)
    else:
        b_x = tl.load(p_x + o_m[:, None] * K + o_k[None, :],
                      mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_xf = b_x.to(tl.float32)
    if NORM:  # x is in registers anyway: its sum of squares costs no second pass
        ss += tl.sum(b_xf * b_xf, axis=1)
        b_xf = b_xf * tl.load(p_g + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
    if HEAD_NV > 0:  # each head's RMS from its producer's sums of squares (p_g: [M, heads, NV])
        if BLOCK_K % HEAD_D == 0:  # whole heads a step: one rsqrt a head, broadcast
            G: tl.constexpr = BLOCK_K // HEAD_D
            o_g = k0 // HEAD_D + tl.arange(0, G)
            o_s = ((o_m[:, None, None] * (K // HEAD_D) + o_g[None, :, None]) * HEAD_NV
                   + tl.arange(0, HEAD_NV)[None, None, :])
            m_s = m_m[:, None, None] & (o_g < K // HEAD_D)[None, :, None]
            b_rs = tl.rsqrt(tl.sum(tl.load(p_g + o_s, mask=m_s, other=0.0), 2) / HEAD_D
                            + HEAD_EPS)
            b_xf = tl.reshape(tl.reshape(b_xf, [BLOCK_M, G, HEAD_D]) * b_rs[:, :, None],
                              [BLOCK_M, BLOCK_K])
        else:  # a head over several steps: each column gathers its head's sums
            o_s = (o_m[:, None] * (K // HEAD_D) + (o_k // HEAD_D)[None, :]) * HEAD_NV
            m_s = m_m[:, None] & m_k[None, :]
            b_ss = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
            for j in tl.static_range(HEAD_NV):
                b_ss += tl.load(p_g + o_s + j, mask=m_s, other=0.0)
            b_xf = b_xf * tl.rsqrt(b_ss / HEAD_D + HEAD_EPS)
    if BLOCK_M == 1:
        acc += b_w.to(tl.float32) * b_xf
        if TWO:
            acc_u += b_u.to(tl.float32) * b_xf
    elif DOT_FP32:  # the interpreter's dot is only exact in fp32
        acc += tl.dot(b_xf, tl.trans(b_w.to(tl.float32)))
        if TWO:
            acc_u += tl.dot(b_xf, tl.trans(b_u.to(tl.float32)))
    else:  # e4m3 weights widen to bf16 (exact) for the bf16 tensor-core product
        acc += tl.dot(b_xf.to(tl.bfloat16), tl.trans(b_w.to(tl.bfloat16)))
        if TWO:
            acc_u += tl.dot(b_xf.to(tl.bfloat16), tl.trans(b_u.to(tl.bfloat16)))
    return acc, acc_u, ss


@triton.jit
def _k_loop(p_x, p_w, p_g, o_m, m_m, o_n, m_n, K, k_lo, k_hi, u_off,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            NORM: tl.constexpr, DOT_FP32: tl.constexpr, NUM_STAGES: tl.constexpr,
            TWO: tl.constexpr, UNROLL: tl.constexpr,
            HEAD_NV: tl.constexpr = 0, HEAD_D: tl.constexpr = 1,
            HEAD_EPS: tl.constexpr = 1e-5, MIX: tl.constexpr = False, p_sb=0, s_n=0,
            s_sbn=0, s_sbm=0, b_pb=0.0, b_pl=0.0, b_rstd=0.0, S_BLOCK_C: tl.constexpr = 1):
    """(fp32 [BLOCK_M, BLOCK_N] sums of x[o_m, k] (* g[k]) * W[o_n, k] over k in [k_lo, k_hi),
    the same sums against the rows u_off elements further when TWO (else the first again), fp32
    [BLOCK_M] sums of x^2 over the range: the RMSNorm's, when NORM). UNROLL > 0: the range is
    at most UNROLL steps, unrolled (every step's loads independent, no shared-memory pipeline);
    0: a loop pipelined over NUM_STAGES."""
    ss = tl.zeros([BLOCK_M], tl.float32)
    if BLOCK_M == 1:  # one token: elementwise products, one reduction after the loop
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if UNROLL > 0:
        for j in tl.static_range(UNROLL):
            acc, acc_u, ss = _k_step(k_lo + j * BLOCK_K, k_hi, p_x, p_w, p_g, o_m, m_m, o_n,
                                     m_n, K, u_off, acc, acc_u, ss, BLOCK_M, BLOCK_K, NORM,
                                     DOT_FP32, TWO, HEAD_NV, HEAD_D, HEAD_EPS, MIX, p_sb, s_n,
                                     s_sbn, s_sbm, b_pb, b_pl, b_rstd, S_BLOCK_C)
    else:
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            acc, acc_u, ss = _k_step(k0, k_hi, p_x, p_w, p_g, o_m, m_m, o_n, m_n, K, u_off,
                                     acc, acc_u, ss, BLOCK_M, BLOCK_K, NORM, DOT_FP32, TWO,
                                     HEAD_NV, HEAD_D, HEAD_EPS, MIX, p_sb, s_n, s_sbn, s_sbm,
                                     b_pb, b_pl, b_rstd, S_BLOCK_C)
    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)[None, :]
        acc_u = tl.sum(acc_u, axis=1)[None, :]
    if not TWO:
        acc_u = acc
    return acc, acc_u, ss


@triton.jit
def _segment(o_n, N, b1, b2, b3, b4, b5, b6, b7):
    """(start, length) of the output segment holding each row of o_n: segments start at 0, b1,
    .., b7 (ascending; unused ones equal N)."""
    start = tl.zeros_like(o_n)
    start = tl.where(o_n >= b1, b1, start)
    start = tl.where(o_n >= b2, b2, start)
    start = tl.where(o_n >= b3, b3, start)
    start = tl.where(o_n >= b4, b4, start)
    start = tl.where(o_n >= b5, b5, start)
    start = tl.where(o_n >= b6, b6, start)
    start = tl.where(o_n >= b7, b7, start)
    end = tl.zeros_like(o_n) + N
    end = tl.where(o_n < b7, b7, end)
    end = tl.where(o_n < b6, b6, end)
    end = tl.where(o_n < b5, b5, end)
    end = tl.where(o_n < b4, b4, end)
    end = tl.where(o_n < b3, b3, end)
    end = tl.where(o_n < b2, b2, end)
    end = tl.where(o_n < b1, b1, end)
    return start, end - start


@triton.jit
def _sums_add(p, v, mask, SUMS: tl.constexpr):
    if SUMS == 1:
        tl.atomic_add(p, v, mask=mask, sem="relaxed")
    else:
        tl.store(p, v, mask=mask)


@triton.jit
def _sums_prefetch(p_sb, p_srn, p_srp, s_n, s_sbn, s_sbm, o_0, M, S_BLOCK_C: tl.constexpr):
    """prefetch.global.L2 of the lines the epilogue's sums read: the score weights' and every
    token's sealed rows' on the tile's columns from o_0 (a tile's few bf16 columns, aligned to
    their count, lie in one line; inline PTX: compiled only)."""
    o_c = tl.arange(0, S_BLOCK_C)
    for m in range(0, M):
        _prefetch_line(p_sb + o_c.to(tl.int64) * s_sbn + m * s_sbm + o_0, o_c < s_n)
    _prefetch_line(p_srn + o_0 + o_c, o_c == 0)
    _prefetch_line(p_srp + o_0 + o_c, o_c == 0)


@triton.jit
def _sums(y, p_sb, p_srn, p_srp, p_sums, s_n, s_sbn, s_sbm, s_p, s_cols, i_n, o_m, o_n, m_n,
          M, BLOCK_N: tl.constexpr, SUMS: tl.constexpr, S_NB: tl.constexpr,
          S_BLOCK_C: tl.constexpr):
    """The AttnRes read's sums over the tile's columns (kernels/attn_res_sums.py), per token:
    the Gram entries of V = (sealed rows, y as live: candidate s_n) and their dots with the
    score weight, added into (SUMS 1) or stored as (2) the tile's slot. y: the stored output,
    fp32. Its loads come after the K loop, not before it: held across the loop, they cost the
    loop registers."""
    o_c = tl.arange(0, S_BLOCK_C)
    m_c = o_c <= s_n
    slot = (i_n * BLOCK_N) // s_cols
    p_dots = p_sums + M * s_p * S_NB * S_NB
    b_sw = (tl.load(p_srn + o_n, mask=m_n, other=0.0).to(tl.float32)
            * tl.load(p_srp + o_n, mask=m_n, other=0.0).to(tl.float32))
    for m in range(0, M):
        b_l = tl.sum(tl.where((o_m == m)[:, None] & m_n[None, :], y, 0.0), axis=0)
        b_v = tl.load(p_sb + o_c[:, None].to(tl.int64) * s_sbn + m * s_sbm + o_n[None, :],
                      mask=(o_c < s_n)[:, None] & m_n[None, :], other=0.0).to(tl.float32)
        b_v = tl.where((o_c == s_n)[:, None], b_l[None, :], b_v)
        s = m * s_p + slot
        _sums_add(p_sums + s * S_NB * S_NB + o_c[:, None] * S_NB + o_c[None, :],
                  tl.sum(b_v[:, None, :] * b_v[None, :, :], axis=2),
                  m_c[:, None] & m_c[None, :], SUMS)
        _sums_add(p_dots + s * S_NB + o_c, tl.sum(b_v * b_sw[None, :], axis=1), m_c, SUMS)


@triton.jit
def _epilogue(acc, acc_u, rstd, p_y, o_y, p_res, b_res, o_m, m_m, o_n, m_n, N, beta,
              linear_beta, ACT: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
              DUAL: tl.constexpr, RES_LOADED: tl.constexpr):
    """The output tile: norm, second product, activation, residual (RES_LOADED: already in
    b_res), cast and store. Returns the stored values in fp32."""
    y = acc
    if NORM:
        y = y * rstd[:, None]
    if DUAL:  # the second product, not normalized
        y += acc_u
    if ACT != 0:
        u = acc_u
        if NORM:
            u = u * rstd[:, None]
        y = _act(y, u, beta, linear_beta, ACT)
    mask = m_m[:, None] & m_n[None, :]
    if RESIDUAL:
        if RES_LOADED:
            y += b_res
        else:
            y += _residual(p_res, o_m, m_m, o_n, m_n, N)
    y = y.to(p_y.dtype.element_ty)
    tl.store(p_y + o_y, y, mask=mask)
    return y.to(tl.float32)


@triton.jit
def _residual(p_res, o_m, m_m, o_n, m_n, N):
    return tl.load(p_res + o_m[:, None] * N + o_n[None, :], mask=m_m[:, None] & m_n[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _split_reduce(acc, acc_u, p_ws, p_cnt, i_n, i_k, o_m, m_m, o_n, m_n, M, N,
                  SPLIT_K: tl.constexpr, TWO: tl.constexpr):
    """Store this program's partial sums (TWO: acc_u too); the last program of the row tile gets
    the totals (and resets the tile's ticket for the next call). Returns (is_last, acc, acc_u)."""
    cols = N * (2 if TWO else 1)
    mask = m_m[:, None] & m_n[None, :]
    o_ws = (i_k * M + o_m[:, None]) * cols + o_n[None, :]
    tl.store(p_ws + o_ws, acc, mask=mask)
    if TWO:
        tl.store(p_ws + o_ws + N, acc_u, mask=mask)
    tl.debug_barrier()  # every thread's partial stored before the release below
    ticket = tl.atomic_add(p_cnt + i_n, 1, sem="acq_rel")
    last = ticket == SPLIT_K - 1
    if last:
        tl.debug_barrier()
        acc = tl.zeros_like(acc)
        acc_u = tl.zeros_like(acc)
        for s in tl.static_range(SPLIT_K):
            o_s = (s * M + o_m[:, None]) * cols + o_n[None, :]
            acc += tl.load(p_ws + o_s, mask=mask, other=0.0, cache_modifier=".cg")
            if TWO:
                acc_u += tl.load(p_ws + o_s + N, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(p_cnt + i_n, 0, sem="relaxed")
    return last, acc, acc_u


@triton.jit
def _tile(i_n, i_t, i_k, p_x, p_w, p_y, p_res, p_g, p_ws, p_cnt, p_x2, p_w2, p_sc, b1, b2, b3,
          b4, b5, b6, b7, M, N, K, K_SPLIT, K2, K2_SPLIT, eps, beta, linear_beta,
          SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ACT: tl.constexpr,
          NORM: tl.constexpr, RESIDUAL: tl.constexpr, N_SEG: tl.constexpr, DUAL: tl.constexpr,
          DOT_FP32: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
          NUM_STAGES: tl.constexpr, WAIT_LAST: tl.constexpr, GATE_UP_TOGETHER: tl.constexpr,
          UNROLL: tl.constexpr, TRIGGER_LAST: tl.constexpr, SECOND_FIRST: tl.constexpr,
          p_sb, p_srn, p_srp, p_sums, s_n, s_sbn, s_sbm, s_p, s_cols, SUMS: tl.constexpr,
          S_NB: tl.constexpr, S_BLOCK_C: tl.constexpr, S_PREFETCH: tl.constexpr,
          HEAD_NV: tl.constexpr = 0, HEAD_D: tl.constexpr = 1,
          HEAD_EPS: tl.constexpr = 1e-5, MIX: tl.constexpr = False):
    """Row tile i_n (split-K ticket i_t) and K share i_k of one GEMV over N output columns.
    GATE_UP_TOGETHER: with ACT, the gate and up rows stream in one K loop (else one loop
    each). SCALED: the first product's row n is multiplied by p_sc[n] (e4m3 weights' scales).
    SECOND_FIRST: the second product and the residual's load come first, before the PDL wait.
    SUMS (1 atomic, 2 stored; 0 off): the epilogue leaves the AttnRes read's sums (p_sb...).
    MIX: x is the AttnRes read of live p_x from its producer's sums p_sums (bank p_sb, norm
    weight p_g, eps; the first program zeroes s_cols words at p_srn, the next read's sums)."""
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    k_lo = i_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    k2_lo = i_k * K2_SPLIT
    k2_hi = tl.minimum(k2_lo + K2_SPLIT, K2)
    if PDL and PREFETCH > 0:
        _prefetch_l2(p_w, o_n, m_n, K, k_lo, k_hi, BLOCK_N, BLOCK_K, PREFETCH)
        if ACT != 0:
            _prefetch_l2(p_w + N * K, o_n, m_n, K, k_lo, k_hi, BLOCK_N, BLOCK_K, PREFETCH)
        if DUAL and not SECOND_FIRST:  # the second product's weight (bf16) too
            _prefetch_l2(p_w2, o_n, m_n, K2, k2_lo, k2_hi, BLOCK_N, BLOCK_K, PREFETCH)
    if SUMS != 0 and S_PREFETCH:  # what the read's sums take: in L2 by the epilogue (a
        # hint: nothing the previous grid writes)
        _sums_prefetch(p_sb, p_srn, p_srp, s_n, s_sbn, s_sbm, i_n * BLOCK_N, M, S_BLOCK_C)
    b_res = 0.0  # the residual, loaded before the K loop so its latency hides behind it
    if SECOND_FIRST:  # neither input is the previous grid's: both before the wait
        if RESIDUAL and SPLIT_K == 1:
            b_res = _residual(p_res, o_m, m_m, o_n, m_n, N)
        if DUAL:
            acc_2, _, _ = _k_loop(p_x2, p_w2, p_g, o_m, m_m, o_n, m_n, K2, k2_lo, k2_hi, 0,
                                  BLOCK_M, BLOCK_N, BLOCK_K, False, DOT_FP32, NUM_STAGES, False,
                                  0)
    if PDL:
        if not WAIT_LAST:
            gdc_wait()
        if not TRIGGER_LAST:
            gdc_launch_dependents()
    b_pb, b_pl, b_rstd = 0.0, 0.0, 0.0
    if MIX:  # the read's weights from the sums the previous grid left
        b_pb, b_pl, b_rstd = mix_weights(p_sums, s_n, s_p, M, K, eps, 0, BLOCK_M, S_NB,
                                         S_BLOCK_C)
        if i_n == 0 and i_k == 0:
            clear(p_srn, s_cols)
    if RESIDUAL and SPLIT_K == 1 and not SECOND_FIRST:
        b_res = _residual(p_res, o_m, m_m, o_n, m_n, N)
    b_sc = 1.0
    if SCALED:  # loaded before the K loop, as the residual
        b_sc = tl.load(p_sc + o_n, mask=m_n, other=0.0)[None, :]
    together = ACT != 0 and GATE_UP_TOGETHER
    acc, acc_u, ss = _k_loop(p_x, p_w, p_g, o_m, m_m, o_n, m_n, K, k_lo, k_hi, N * K, BLOCK_M,
                             BLOCK_N, BLOCK_K, NORM, DOT_FP32, NUM_STAGES, together, UNROLL,
                             HEAD_NV, HEAD_D, HEAD_EPS, MIX, p_sb, s_n, s_sbn, s_sbm, b_pb,
                             b_pl, b_rstd, S_BLOCK_C)
    if SCALED:
        acc = acc * b_sc
    if ACT != 0 and not together:
        acc_u, _, _ = _k_loop(p_x, p_w + N * K, p_g, o_m, m_m, o_n, m_n, K, k_lo, k_hi, 0,
                              BLOCK_M, BLOCK_N, BLOCK_K, NORM, DOT_FP32, NUM_STAGES, False,
                              UNROLL, HEAD_NV, HEAD_D, HEAD_EPS, MIX, p_sb, s_n, s_sbn, s_sbm,
                              b_pb, b_pl, b_rstd, S_BLOCK_C)
    if DUAL:
        if SECOND_FIRST:
            acc_u = acc_2
        else:
            acc_u, _, _ = _k_loop(p_x2, p_w2, p_g, o_m, m_m, o_n, m_n, K2, k2_lo, k2_hi, 0,
                                  BLOCK_M, BLOCK_N, BLOCK_K, False, DOT_FP32, NUM_STAGES, False,
                                  0)
    if N_SEG > 1:  # segment s is its own contiguous [M, n_s] block of the output
        start, length = _segment(o_n, N, b1, b2, b3, b4, b5, b6, b7)
        o_y = M * start[None, :] + o_m[:, None] * length[None, :] + (o_n - start)[None, :]
    else:
        o_y = o_m[:, None] * N + o_n[None, :]
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if SPLIT_K > 1:
        last, acc, acc_u = _split_reduce(acc, acc_u, p_ws, p_cnt, i_t, i_k, o_m, m_m, o_n, m_n,
                                         M, N, SPLIT_K, ACT != 0 or DUAL)
        if last:
            if NORM:
                rstd = _rstd(p_x, o_m, m_m, K, eps, BLOCK_M, BLOCK_K)
            y = _epilogue(acc, acc_u, rstd, p_y, o_y, p_res, b_res, o_m, m_m, o_n, m_n, N,
                          beta, linear_beta, ACT, NORM, RESIDUAL, DUAL, False)
            if SUMS != 0:
                _sums(y, p_sb, p_srn, p_srp, p_sums, s_n, s_sbn, s_sbm, s_p, s_cols, i_n, o_m,
                      o_n, m_n, M, BLOCK_N, SUMS, S_NB, S_BLOCK_C)
    else:
        if NORM:  # the program saw all of x's K columns
            rstd = tl.rsqrt(ss / K + eps)
        y = _epilogue(acc, acc_u, rstd, p_y, o_y, p_res, b_res, o_m, m_m, o_n, m_n, N, beta,
                      linear_beta, ACT, NORM, RESIDUAL, DUAL, True)
        if SUMS != 0:
            _sums(y, p_sb, p_srn, p_srp, p_sums, s_n, s_sbn, s_sbm, s_p, s_cols, i_n, o_m, o_n,
                  m_n, M, BLOCK_N, SUMS, S_NB, S_BLOCK_C)
    if PDL and WAIT_LAST:
        gdc_wait()
        if TRIGGER_LAST:  # the next launch starts once every program has seen the previous end
            gdc_launch_dependents()


@triton.jit
def _gemv_program(i_n, i_k, p_x, p_w, p_y, p_res, p_g, p_ws, p_cnt, p_x2, p_w2, p_sc, b1, b2, b3,
                  b4, b5, b6, b7, M, N, K, K_SPLIT, K2, K2_SPLIT, T0, NG, eps, beta, linear_beta,
                  SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ACT: tl.constexpr,
                  NORM: tl.constexpr, RESIDUAL: tl.constexpr, N_SEG: tl.constexpr,
                  DUAL: tl.constexpr, MIXED: tl.constexpr, DOT_FP32: tl.constexpr,
                  PDL: tl.constexpr, PREFETCH: tl.constexpr, NUM_STAGES: tl.constexpr,
                  WAIT_LAST: tl.constexpr, GATE_UP_TOGETHER: tl.constexpr,
                  UNROLL: tl.constexpr, TRIGGER_LAST: tl.constexpr,
                  SECOND_FIRST: tl.constexpr, p_sb, p_srn, p_srp, p_sums, s_n, s_sbn, s_sbm,
                  s_p, s_cols, SUMS: tl.constexpr, S_NB: tl.constexpr,
                  S_BLOCK_C: tl.constexpr, S_PREFETCH: tl.constexpr,
                  HEAD_NV: tl.constexpr = 0, HEAD_D: tl.constexpr = 1,
                  HEAD_EPS: tl.constexpr = 1e-5, MIX: tl.constexpr = False):
    """Program (i_n, i_k) of :func:`dense_gemv_kernel`'s grid."""
    if MIXED:
        if i_n >= T0:
            _tile(i_n - T0, i_n, i_k, p_x, p_w + N * K, p_y + M * N, p_res, p_g,
                  p_ws + SPLIT_K * M * N, p_cnt, p_x2, p_w2, p_sc, b1, b2, b3, b4, b5, b6, b7,
                  M, NG, K, K_SPLIT, K2, K2_SPLIT, eps, beta, linear_beta, False, BLOCK_M,
                  BLOCK_N, BLOCK_K, SPLIT_K, ACT, NORM, False, 1, False, DOT_FP32, PDL,
                  PREFETCH, NUM_STAGES, WAIT_LAST, GATE_UP_TOGETHER, UNROLL,
                  TRIGGER_LAST, False, p_sb, p_srn, p_srp, p_sums, s_n, s_sbn, s_sbm, s_p,
                  0, 0, S_NB, S_BLOCK_C, False, 0, 1, 1e-5, MIX)  # the plain rows clear
        else:
            _tile(i_n, i_n, i_k, p_x, p_w, p_y, p_res, p_g, p_ws, p_cnt, p_x2, p_w2, p_sc, b1,
                  b2, b3, b4, b5, b6, b7, M, N, K, K_SPLIT, K2, K2_SPLIT, eps, beta,
                  linear_beta, False, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, 0, NORM, False, 1,
                  False, DOT_FP32, PDL, PREFETCH, NUM_STAGES, WAIT_LAST, GATE_UP_TOGETHER,
                  UNROLL, TRIGGER_LAST, False, p_sb, p_srn, p_srp, p_sums, s_n, s_sbn, s_sbm,
                  s_p, s_cols, 0, S_NB, S_BLOCK_C, False, 0, 1, 1e-5, MIX)
    else:
        _tile(i_n, i_n, i_k, p_x, p_w, p_y, p_res, p_g, p_ws, p_cnt, p_x2, p_w2, p_sc, b1, b2, b3,
              b4, b5, b6, b7, M, N, K, K_SPLIT, K2, K2_SPLIT, eps, beta, linear_beta, SCALED,
              BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, ACT, NORM, RESIDUAL, N_SEG, DUAL, DOT_FP32,
              PDL, PREFETCH, NUM_STAGES, WAIT_LAST, GATE_UP_TOGETHER, UNROLL, TRIGGER_LAST,
              SECOND_FIRST, p_sb, p_srn, p_srp, p_sums, s_n, s_sbn, s_sbm, s_p, s_cols, SUMS,
              S_NB, S_BLOCK_C, S_PREFETCH, HEAD_NV, HEAD_D, HEAD_EPS, MIX)


@triton.jit
def dense_gemv_kernel(p_x, p_w, p_y, p_res, p_g, p_ws, p_cnt, p_x2, p_w2, p_sc, b1, b2, b3, b4,
                      b5, b6, b7, M, N, K, K_SPLIT, K2, K2_SPLIT, T0, NG, eps,
                      beta, linear_beta, SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ACT: tl.constexpr,
                      NORM: tl.constexpr, RESIDUAL: tl.constexpr, N_SEG: tl.constexpr,
                      DUAL: tl.constexpr, MIXED: tl.constexpr, DOT_FP32: tl.constexpr,
                      PDL: tl.constexpr, PREFETCH: tl.constexpr, NUM_STAGES: tl.constexpr,
                      WAIT_LAST: tl.constexpr, GATE_UP_TOGETHER: tl.constexpr,
                      UNROLL: tl.constexpr, TRIGGER_LAST: tl.constexpr,
                      SECOND_FIRST: tl.constexpr, p_sb, p_srn, p_srp, p_sums, s_n, s_sbn,
                      s_sbm, s_p, s_cols, SUMS: tl.constexpr, S_NB: tl.constexpr,
                      S_BLOCK_C: tl.constexpr, S_PREFETCH: tl.constexpr,
                      HEAD_NV: tl.constexpr = 0, HEAD_D: tl.constexpr = 1,
                      HEAD_EPS: tl.constexpr = 1e-5, MIX: tl.constexpr = False):
    """Grid (row tiles, SPLIT_K). N: output columns (with ACT, the weight has 2N rows: gate rows
    [0, N), up rows [N, 2N)). K_SPLIT: columns of a K share, a multiple of BLOCK_K.
    DUAL: a second product x2 [M, K2] @ w2 [N, K2]^T (K2_SPLIT columns a share) is added to the
    first (after its RMSNorm) before the epilogue.
    MIXED: tiles [0, T0) are N plain rows (output [M, N]); tiles from T0 are the activation's NG
    outputs (weight rows N.. gate, N + NG.. up; output [M, NG] after the first).
    UNROLL: K steps of a share, unrolled (0: a pipelined loop).
    TRIGGER_LAST (with WAIT_LAST): programs let the next launch start after their final wait.
    SCALED (plain rows only): the weight is e4m3 with one fp32 scale per row at p_sc.
    SECOND_FIRST: the second product and the residual before the first (and the PDL wait).
    SUMS: the AttnRes read's sums from the output (1: added into a slot of s_cols columns, 2:
    stored; kernels/attn_res_sums.py): sealed rows p_sb [s_n, M, N] (strides s_sbn, s_sbm),
    score weights p_srn * p_srp, s_p slots a token; S_NB their blocks' side, S_BLOCK_C
    candidates padded.
    HEAD_NV > 0: x is a per-head output (HEAD_D columns a head) whose RMS its producer left as
    HEAD_NV partial sums of squares a (token, head) at p_g [M, K / HEAD_D, HEAD_NV] fp32; each
    column is scaled by rsqrt(sum / HEAD_D + HEAD_EPS) as it is loaded (NORM off).
    MIX: x is the live sum of an AttnRes read whose sums its producer left at p_sums (the
    SUMS layout; bank p_sb, s_n rows): the projection's input is that read's h_normed, with
    p_g its norm weight and eps its eps (NORM off), mixed as each K step loads it
    (kernels/dense/mix.py); the first program zeroes s_cols fp32 words at p_srn."""
    _gemv_program(tl.program_id(0), tl.program_id(1), p_x, p_w, p_y, p_res, p_g, p_ws, p_cnt,
                  p_x2, p_w2, p_sc, b1, b2, b3, b4, b5, b6, b7, M, N, K, K_SPLIT, K2, K2_SPLIT,
                  T0, NG, eps, beta, linear_beta, SCALED, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
                  ACT, NORM, RESIDUAL, N_SEG, DUAL, MIXED, DOT_FP32, PDL, PREFETCH, NUM_STAGES,
                  WAIT_LAST, GATE_UP_TOGETHER, UNROLL, TRIGGER_LAST, SECOND_FIRST, p_sb, p_srn,
                  p_srp, p_sums, s_n, s_sbn, s_sbm, s_p, s_cols, SUMS, S_NB, S_BLOCK_C,
                  S_PREFETCH, HEAD_NV, HEAD_D, HEAD_EPS, MIX)
