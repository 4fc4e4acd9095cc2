"""GEMV, quantization and synchronization helpers of the persistent MoE kernel (jit helpers).

Every product is ``x[rows] @ w[o_n]^T`` over K in ``BLOCK_K`` steps with fp32 accumulation:
either a broadcast multiply and ``tl.sum`` (``DOT`` False) or ``tl.dot`` (bf16 operands, or
e4m3 x e4m3 for quantized activations against MXFP4 codes). Weights are bf16 / e4m3 rows
(a typed load, then fp32) or MXFP4 in the row layout (uint8 codes [N, K / 2], E8M0 scales
[N, K / 32]) decoded in registers from whole int32 words.

FP8 activations: each row is scaled by a power of two 2^-s (s the smallest with amax 2^-s <=
448, so the scaling is exact) and rounded to the e4m3 grid, to nearest even, with integer ops
(identical compiled and interpreted); the GEMV's result is multiplied back by 2^s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..runtime import INTERPRETED  # noqa: F401  (sets the interpreter up before any jit)
from .gemv import round_e4m3
from .stages import MAX_SPIN

E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def wait_count(p_cnt, target):
    """Spin until the int32 counter at p_cnt reaches target (volatile polls, then one acquire RMW
    and a CTA barrier: the producers' writes are visible to every thread after it). Gives up
    after MAX_SPIN polls, so a scheduling bug shows as a wrong result instead of a hang."""
    n_spin = tl.program_id(0) * 0
    while (tl.load(p_cnt, volatile=True) < target) & (n_spin < MAX_SPIN):
        n_spin += 1
    # a max with 0 (the count is >= 0: unchanged) keeps the acquire (see stages._tail_tile)
    tl.atomic_max(p_cnt, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def signal_count(p_cnt):
    """Count one finished work item: a CTA barrier (every thread's stores issued), then a release
    increment at GPU scope."""
    tl.debug_barrier()
    tl.atomic_add(p_cnt, 1, sem="release")


@triton.jit
def pow2_scales(amax):
    """Per-row (2^-s, 2^s) for fp32 amax >= 0: s the smallest integer with amax 2^-s <= 448
    (E4M3's largest value, 1.75 x 2^8), clamped to [-126, 126]; amax 0 gives s = 0."""
    b = amax.to(tl.int32, bitcast=True)
    s = ((b >> 23) & 255) - 127 - 8 + ((b & 0x7FFFFF) > 0x600000).to(tl.int32)
    s = tl.minimum(tl.maximum(tl.where(amax > 0, s, 0), -126), 126)
    inv = ((127 - s) << 23).to(tl.float32, bitcast=True)
    return inv, ((127 + s) << 23).to(tl.float32, bitcast=True)


@triton.jit
def row_amax(p_x, o_r, m_r, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """max |x[o_r, :]| per row [BLOCK_M] fp32 (rows written in this launch: read through L2)."""
    b_m = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        b_x = tl.load(p_x + o_r[:, None] * K + o_k[None, :],
                      mask=m_r[:, None] & (o_k < K)[None, :], other=0.0,
                      cache_modifier=".cg").to(tl.float32)
        b_m = tl.maximum(b_m, tl.max(tl.abs(b_x), axis=1))
    return b_m


@triton.jit
def _fp4_tile(p_w, p_s, o_n, m_n, k0, K, SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """MXFP4 weight tile [BLOCK_N, BLOCK_K] fp32 (columns k0 ..) from codes viewed as int32
    words [N, K / 8] (row layout; element 8q + j in bits 4j..4j + 3 of word q) and E8M0 scales
    uint8 [N, K / 32]: the E2M1 values, times their group factor 2^(s - 127) when SCALED (s = 0,
    an all-zero group, gives 0). Words are loaded whole and split in registers."""
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    o_w = k0 // 8 + tl.arange(0, BLOCK_W)
    m_w = m_n[:, None] & (o_w < K // 8)[None, :]
    b_w = tl.load(p_w + o_n[:, None] * (K // 8) + o_w[None, :], mask=m_w, other=0)
    c = (b_w[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 15
    e = (c >> 1) & 3
    mant = (c & 1).to(tl.float32)
    # e == 0: m / 2; else 2^(e - 1) (1 + m / 2), the power of two built from its bits
    p2 = ((e + 126) << 23).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, 0.5 * mant, p2 * (1.0 + 0.5 * mant))
    b_v = tl.where((c & 8) != 0, -mag, mag)
    if SCALED:
        b_s = tl.load(p_s + o_n[:, None] * (K // 32) + (o_w // 4)[None, :], mask=m_w,
                      other=0).to(tl.int32)
        b_v = b_v * (b_s << 23).to(tl.float32, bitcast=True)[:, :, None]
    return tl.reshape(b_v, [BLOCK_N, BLOCK_K])


@triton.jit
def _dot(b_x, b_w, FP8: tl.constexpr, EMULATE: tl.constexpr):
    """[BM, BK] x [BN, BK]^T on the tensor cores (e4m3 or bf16 operands, exact casts of the
    values given); EMULATE (the interpreter): fp32 operands of the same values."""
    if EMULATE:
        return tl.dot(b_x, tl.trans(b_w), input_precision="ieee")
    if FP8:
        return tl.dot(b_x.to(tl.float8e4nv), tl.trans(b_w.to(tl.float8e4nv)))
    return tl.dot(b_x.to(tl.bfloat16), tl.trans(b_w.to(tl.bfloat16)))


@triton.jit
def gemv(p_x, o_r, m_r, x_inv, p_w, p_s, o_n, m_n, K, p_xs,
         FP4: tl.constexpr, XQ: tl.constexpr, HAS_XS: tl.constexpr, X_CG: tl.constexpr,
         DOT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 = x'[o_r] @ w[o_n]^T over K.

    x [rows, K] bf16 or fp32; x' = x * xs (HAS_XS: fp32 [K], the RMSNorm weight), then with XQ
    round_e4m3(x' * x_inv[:, None]) (the caller multiplies the result by the rows' 2^s). X_CG:
    x was written in this launch (read through L2). w [N, K] bf16 / e4m3, or MXFP4 (FP4: codes
    as int32 words p_w, scales p_s; BLOCK_K >= 32). DOT: tensor-core dots (BLOCK_M, BLOCK_N >=
    16); with FP4 and XQ the e4m3 codes meet the e4m3 activations a 32-wide group a step
    (BLOCK_K 32), the group's factor scaling the dot."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        m_x = m_r[:, None] & m_k[None, :]
        if X_CG:
            b_x = tl.load(p_x + o_r[:, None] * K + o_k[None, :], mask=m_x, other=0.0,
                          cache_modifier=".cg").to(tl.float32)
        else:
            b_x = tl.load(p_x + o_r[:, None] * K + o_k[None, :], mask=m_x, other=0.0).to(
                tl.float32)
        if HAS_XS:
            b_x *= tl.load(p_xs + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
        if XQ:
            b_x = round_e4m3(b_x * x_inv[:, None])
        if FP4:
            if DOT and XQ:  # e4m3 codes x e4m3 activations; BLOCK_K 32: one group a step
                b_w = _fp4_tile(p_w, p_s, o_n, m_n, k0, K, False, BLOCK_N, BLOCK_K)
                b_f = tl.load(p_s + o_n * (K // 32) + k0 // 32, mask=m_n, other=0).to(tl.int32)
                acc += _dot(b_x, b_w, True, EMULATE) * (b_f << 23).to(tl.float32,
                                                                     bitcast=True)[None, :]
            else:
                b_w = _fp4_tile(p_w, p_s, o_n, m_n, k0, K, True, BLOCK_N, BLOCK_K)
        else:
            b_w = tl.load(p_w + o_n[:, None] * K + o_k[None, :],
                          mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        if not (DOT and XQ and FP4):
            if DOT:
                acc += _dot(b_x, b_w, False, EMULATE)
            else:
                acc += tl.sum(b_x[:, None, :] * b_w[None, :, :], axis=2)
    return acc
