"""GEMV building blocks of the MoE kernels (jit helpers): bf16 operands as int32 pairs, MXFP4
weights in K-lane tiles, and the fp32 activations.

Every product is a GEMV: a broadcast multiply and ``tl.sum`` with fp32 accumulation, each
program owning one output tile and reading its weight rows once.

bf16 operands are read as int32 (even, odd) element pairs (the even element in the low
half-word: a shift and a mask give both fp32 values). MXFP4 weights are read as int32 words of
8 E2M1 codes, decoded in registers with 3 integer ops an element (shift the nibble to the top,
arithmetic shift right, mask: the signed fp32 bits of 2^-126 * value) and one FMA each; the
E8M0 factor 2^(s - 127) is applied once per group of 32. The activations stay bf16 pairs;
against MXFP4 they may be quantized as they load (``XQ``: e4m3 with a per-row power-of-two
scale, the persistent kernel's A8W4).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..runtime import INTERPRETED  # noqa: F401  (sets the interpreter up before any jit)
from .mma import tiled_word_offset

# An E2M1 nibble shifted to bits 28..31 then arithmetic-shifted right by 6 leaves its sign in bit
# 31 and its 3 magnitude bits in fp32 bits 22..24: masked, that is the fp32 2^-126 * value (e = 0
# gives the denormal m * 2^-127). x is pre-scaled by 2^64 so no product is denormal; the group
# factor 2^(s-127) * 2^126 * 2^-64 = 2^(s-65) has fp32 exponent s + 62.
FP4_SIGN_MAG = tl.constexpr(0x81C00000 - (1 << 32))  # bits 31 and 22..24 as an int32
FP4_X_SCALE = tl.constexpr(2.0 ** 64)
FP4_SCALE_BIAS = tl.constexpr(62)
E4M3_MIN_NORMAL = tl.constexpr(2.0 ** -6)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    return 2.0 * sigmoid(2.0 * x) - 1.0


@triton.jit
def act(b_g, b_u, beta, linear_beta, ACT: tl.constexpr):
    """fp32 activation of gate and up tiles: SiTU (ACT 0) or SiLU(g) * u (ACT 1)."""
    b_sg = sigmoid(b_g)
    if ACT == 0:
        b_a = beta * tanh(b_g / beta) * b_sg * (linear_beta * tanh(b_u / linear_beta))
    else:
        b_a = b_g * b_sg * b_u
    return b_a


@triton.jit
def to_bf16(x):
    """fp32 -> bf16 rounded to nearest even, written out (the Triton interpreter truncates)."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def round_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even: the fp32 bits
    rounded to 3 mantissa bits; below 2^-6 (e4m3 subnormals, spacing 2^-9) the same on
    |v| + 2^-6, which has that spacing (exact for inputs whose lowest set bit is >= 2^-29, so
    for every bf16 value the kernel quantizes)."""
    a = tl.abs(v)
    small = a < E4M3_MIN_NORMAL
    w = tl.where(small, a + E4M3_MIN_NORMAL, a)
    b = w.to(tl.int32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576
    r = b.to(tl.float32, bitcast=True)
    r = tl.where(small, r - E4M3_MIN_NORMAL, r)
    return tl.where(v < 0, -r, r)


@triton.jit
def token(o_xrow, m_xrow, o_m, i_m):
    """Row index and validity of token i_m of a tile, as [1] tensors."""
    m_sel = o_m == i_m
    o_row = tl.zeros([1], dtype=tl.int32) + tl.sum(tl.where(m_sel, o_xrow, 0), axis=0)
    m_row = (tl.zeros([1], dtype=tl.int32) + tl.sum(tl.where(m_sel & m_xrow, 1, 0), axis=0)) > 0
    return o_row, m_row


# ---------------------------------------------------------------------------------------------
# bf16 weights


@triton.jit
def _load_w_pairs(p_w, o_row, m_row, o_kp, m_kp, K_PAIRS):
    """bf16 weight tile [rows, pairs] as (even, odd) fp32 elements; p_w: the weight viewed as
    int32 [N, K_PAIRS]."""
    m = m_row[:, None] & m_kp[None, :]
    b_v = tl.load(p_w + o_row[:, None] * K_PAIRS + o_kp[None, :], mask=m, other=0)
    b_even = (b_v << 16).to(tl.float32, bitcast=True)
    b_odd = (b_v & -65536).to(tl.float32, bitcast=True)
    return b_even, b_odd


@triton.jit
def _load_x_pairs(p_x, o_row, m_row, o_kp, m_kp, K_PAIRS, X_FP32: tl.constexpr):
    """Input rows [rows, pairs] as (even, odd) fp32: bf16 x viewed as int32 [rows, K_PAIRS], or
    fp32 x [rows, 2 * K_PAIRS] (stage 2's atomically written sum: read through L2 only)."""
    m = m_row[:, None] & m_kp[None, :]
    if X_FP32:
        p = p_x + o_row[:, None] * (2 * K_PAIRS) + 2 * o_kp[None, :]
        b_even = tl.load(p, mask=m, other=0.0, cache_modifier=".cg")
        b_odd = tl.load(p + 1, mask=m, other=0.0, cache_modifier=".cg")
    else:
        b_v = tl.load(p_x + o_row[:, None] * K_PAIRS + o_kp[None, :], mask=m, other=0)
        b_even = (b_v << 16).to(tl.float32, bitcast=True)
        b_odd = (b_v & -65536).to(tl.float32, bitcast=True)
    return b_even, b_odd


@triton.jit
def bf16_gemv(p_x, o_xrow, m_xrow, p_xs, p_w, o_wrow, m_wrow, K_PAIRS,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
              X_FP32: tl.constexpr, HAS_XS: tl.constexpr, TOKEN_LOOP: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 = x[o_xrow] (* xs) @ w[o_wrow]^T over K = 2 * K_PAIRS, for bf16
    w viewed as int32 pairs [N, K_PAIRS].

    xs (HAS_XS): an fp32 [2 * K_PAIRS] per-column factor on x (the RMSNorm weight). X_FP32: x is
    fp32 (see _load_x_pairs). BLOCK_M > 1: TOKEN_LOOP reuses each [BLOCK_N, BLOCK_KP] weight
    tile for the tokens one at a time (registers stay at one tile), a runtime loop up to the
    last valid row of x, so a plan tile's padding rows cost nothing; otherwise one [BLOCK_M,
    BLOCK_N, BLOCK_KP] broadcast product (interpreter: one vectorized op)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    o_m = tl.arange(0, BLOCK_M)
    n_rows = tl.max(tl.where(m_xrow, o_m + 1, 0), axis=0)  # rows >= n_rows are all masked
    for kp0 in range(0, K_PAIRS, BLOCK_KP):
        o_kp = kp0 + tl.arange(0, BLOCK_KP)
        m_kp = o_kp < K_PAIRS
        b_we, b_wo = _load_w_pairs(p_w, o_wrow, m_wrow, o_kp, m_kp, K_PAIRS)
        if HAS_XS:
            b_se = tl.load(p_xs + 2 * o_kp, mask=m_kp, other=0.0).to(tl.float32)[None, :]
            b_so = tl.load(p_xs + 2 * o_kp + 1, mask=m_kp, other=0.0).to(tl.float32)[None, :]
        if BLOCK_M == 1 or not TOKEN_LOOP:
            b_xe, b_xo = _load_x_pairs(p_x, o_xrow, m_xrow, o_kp, m_kp, K_PAIRS, X_FP32)
            if HAS_XS:
                b_xe *= b_se
                b_xo *= b_so
            if BLOCK_M == 1:
                acc += tl.sum(b_we * b_xe + b_wo * b_xo, axis=1)[None, :]
            else:
                acc += tl.sum(b_we[None, :, :] * b_xe[:, None, :]
                              + b_wo[None, :, :] * b_xo[:, None, :], axis=2)
        else:
            for i_m in range(0, n_rows):
                o_row, m_row = token(o_xrow, m_xrow, o_m, i_m)
                b_xe, b_xo = _load_x_pairs(p_x, o_row, m_row, o_kp, m_kp, K_PAIRS, X_FP32)
                if HAS_XS:
                    b_xe *= b_se
                    b_xo *= b_so
                b_p = tl.sum(b_we * b_xe + b_wo * b_xo, axis=1)
                acc += tl.where((o_m == i_m)[:, None], b_p[None, :], 0.0)
    return acc


# ---------------------------------------------------------------------------------------------
# MXFP4 weights, K-lane tiles: [rows, BLOCK_W words] a step, a row's words contiguous across the
# lanes (16-byte loads, a warp reading 256-512 contiguous bytes of a row)


@triton.jit
def _fp4_code(b_w, J: tl.constexpr):
    """E2M1 code J (0..7, element 8q + J of word q) of int32 words as fp32 2^-126 * value: shift
    the nibble to bits 28..31, arithmetic shift right by 6, mask sign and magnitude (3 integer
    ops; 2 for J = 7, whose shift is 0)."""
    return (((b_w << (28 - 4 * J)) >> 6) & FP4_SIGN_MAG).to(tl.float32, bitcast=True)


@triton.jit
def _klane_part(b_w, p_x, o_row, m_row, o_w, m_w, K_PAIRS, BLOCK_N: tl.constexpr,
                BLOCK_W: tl.constexpr, x_inv=1.0, XQ: tl.constexpr = False):
    """[BLOCK_N, BLOCK_W // 4] fp32: per row and group of the K step, 2^-62 * sum over the
    group's 32 elements of w * x (the E8M0 factor not applied). b_w: int32 words [BLOCK_N,
    BLOCK_W] (word q holds elements 8q..8q+7); x bf16 viewed as int32 pairs [rows, K_PAIRS],
    o_row / m_row one token, shape [1]; o_w / m_w the step's word indices [BLOCK_W]. XQ: x
    enters as round_e4m3(x * x_inv) (x_inv the token's 2^-s, shape [1])."""
    b_part = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for r in tl.static_range(4):  # pair r of each word: codes 2r (even element) and 2r + 1
        b_v = tl.load(p_x + o_row * K_PAIRS + o_w * 4 + r, mask=m_w & m_row, other=0)
        b_xe = (b_v << 16).to(tl.float32, bitcast=True)
        b_xo = (b_v & -65536).to(tl.float32, bitcast=True)
        if XQ:
            b_xe = round_e4m3(b_xe * x_inv)
            b_xo = round_e4m3(b_xo * x_inv)
        b_xe *= FP4_X_SCALE
        b_xo *= FP4_X_SCALE
        b_part += _fp4_code(b_w, 2 * r) * b_xe[None, :]  # two FFMA chains, no FMUL + FADD
        b_part += _fp4_code(b_w, 2 * r + 1) * b_xo[None, :]
    return tl.sum(tl.reshape(b_part, [BLOCK_N, BLOCK_W // 4, 4]), axis=2)


@triton.jit
def _klane_load(p_w, p_s, o_wrow, m_wrow, kw0, N_WORDS, N_GROUPS, BLOCK_W: tl.constexpr,
                TILED: tl.constexpr):
    """K-lane tile at word kw0 (a multiple of 4): words int32 [rows, BLOCK_W] and E8M0 bytes as
    int32 [rows, BLOCK_W // 4] (0 past the row's end). The scale bytes come out in the partial
    sums' layout (no shared-memory conversion). TILED: the codes are in the tiled layout, where
    a group's 4 words stay together."""
    o_w = kw0 + tl.arange(0, BLOCK_W)
    o_g = kw0 // 4 + tl.arange(0, BLOCK_W // 4)
    if TILED:
        o_c = tiled_word_offset(o_wrow[:, None], o_w[None, :] // 4 * 4, N_WORDS) \
            + (o_w % 4)[None, :]
    else:
        o_c = o_wrow[:, None] * N_WORDS + o_w[None, :]
    b_w = tl.load(p_w + o_c,
                  mask=m_wrow[:, None] & (o_w < N_WORDS)[None, :], other=0)
    b_s = tl.load(p_s + o_wrow[:, None] * N_GROUPS + o_g[None, :],
                  mask=m_wrow[:, None] & (o_g < N_GROUPS)[None, :], other=0).to(tl.int32)
    return b_w, b_s


@triton.jit
def fp4_gemv_klane(p_x, o_xrow, m_xrow, p_w, p_s, o_wrow, m_wrow, K_PAIRS,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                   STAGES: tl.constexpr, TILED: tl.constexpr, x_inv=1.0,
                   XQ: tl.constexpr = False):
    """acc [BLOCK_M, BLOCK_N] fp32 = x[o_xrow] @ w[o_wrow]^T for MXFP4 w: p_w packed codes viewed
    as int32 words [N, K_PAIRS // 4], p_s E8M0 scales uint8 [N, K_PAIRS // 16], x bf16 viewed as
    int32 pairs [rows, K_PAIRS]; BLOCK_W words (4 per group) a K step.

    M = 1: per (row, group) fp32 FFMA chains over all steps, the E8M0 factor per group and step,
    one cross-lane reduction at the end. M > 1: the weight tile is reused for the tokens one at
    a time (a runtime loop up to the last valid row). STAGES > 0: the K loop is
    tl.range(num_stages=STAGES), which stages the weight and scale loads through shared memory
    (more bytes in flight at the same occupancy; M = 1 in practice: the token loop keeps the
    pipeliner out). TILED: the codes are in the tiled layout. XQ: each row of x is quantized
    to e4m3 after scaling by its x_inv [BLOCK_M] (2^-s; the caller multiplies the result by
    2^s)."""
    N_WORDS = K_PAIRS // 4
    N_GROUPS = K_PAIRS // 16
    o_m = tl.arange(0, BLOCK_M)
    n_rows = tl.max(tl.where(m_xrow, o_m + 1, 0), axis=0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_N, BLOCK_W // 4], dtype=tl.float32)
    for kw0 in tl.range(0, N_WORDS, BLOCK_W, num_stages=STAGES if STAGES > 0 else None):
        o_w = kw0 + tl.arange(0, BLOCK_W)
        m_w = o_w < N_WORDS
        b_w, b_s = _klane_load(p_w, p_s, o_wrow, m_wrow, kw0, N_WORDS, N_GROUPS, BLOCK_W, TILED)
        b_f = ((b_s + FP4_SCALE_BIAS) << 23).to(tl.float32, bitcast=True)
        if BLOCK_M == 1:
            acc_g += _klane_part(b_w, p_x, o_xrow, m_xrow, o_w, m_w, K_PAIRS, BLOCK_N,
                                 BLOCK_W, x_inv, XQ) * b_f
        else:
            for i_m in range(0, n_rows):
                o_row, m_row = token(o_xrow, m_xrow, o_m, i_m)
                if XQ:
                    inv = tl.zeros([1], dtype=tl.float32) + tl.sum(
                        tl.where(o_m == i_m, x_inv, 0.0), axis=0)
                else:
                    inv = 1.0
                b_p = tl.sum(_klane_part(b_w, p_x, o_row, m_row, o_w, m_w, K_PAIRS, BLOCK_N,
                                         BLOCK_W, inv, XQ) * b_f, axis=1)
                acc += tl.where((o_m == i_m)[:, None], b_p[None, :], 0.0)
    if BLOCK_M == 1:
        acc += tl.sum(acc_g, axis=1)[None, :]
    return acc


# ---------------------------------------------------------------------------------------------
# either format


@triton.jit
def expert_gemv(p_x, o_xrow, m_xrow, p_w, p_s, o_wrow, m_wrow, K_PAIRS,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
                FP4: tl.constexpr, KLANE_STAGES: tl.constexpr, TOKEN_LOOP: tl.constexpr,
                TILED: tl.constexpr, x_inv=1.0, XQ: tl.constexpr = False):
    """x[o_xrow] @ w[o_wrow]^T for an expert's weight: MXFP4 (FP4; K-lane tiles of BLOCK_KP // 4
    words; XQ: x quantized as it loads, see fp4_gemv_klane) or bf16 (BLOCK_KP pairs a step)."""
    tl.static_assert(FP4 or not XQ, "quantized activations meet MXFP4 weights only")
    if FP4:
        acc = fp4_gemv_klane(p_x, o_xrow, m_xrow, p_w, p_s, o_wrow, m_wrow, K_PAIRS, BLOCK_M,
                             BLOCK_N, BLOCK_KP // 4, KLANE_STAGES, TILED, x_inv, XQ)
    else:
        acc = bf16_gemv(p_x, o_xrow, m_xrow, p_x, p_w, o_wrow, m_wrow, K_PAIRS, BLOCK_M, BLOCK_N,
                        BLOCK_KP, False, False, TOKEN_LOOP)
    return acc


@triton.jit
def gate_up_act(p_x, o_xrow, m_xrow, p_w, p_s, o_n, m_n, N_HALF, K_PAIRS, beta, linear_beta,
                ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_KP: tl.constexpr, FP4: tl.constexpr, KLANE_STAGES: tl.constexpr,
                TOKEN_LOOP: tl.constexpr, TILED: tl.constexpr, x_inv=1.0, x_sc=1.0,
                XQ: tl.constexpr = False):
    """act(x @ w[o_n]^T, x @ w[N_HALF + o_n]^T): gate rows then up rows of one [2 * N_HALF, K]
    weight. MXFP4: one K-lane GEMV over a tile of 2 * BLOCK_N interleaved rows (gate n, up n,
    ...): the same rows a thread at twice the programs of two loops (XQ: x quantized as it
    loads with the rows' x_inv, both products scaled back by their x_sc before the
    activation). bf16: two GEMVs."""
    tl.static_assert(FP4 or not XQ, "quantized activations meet MXFP4 weights only")
    if FP4:
        o_r = tl.reshape(tl.join(o_n, o_n + N_HALF), [2 * BLOCK_N])
        m_r = tl.reshape(tl.join(m_n, m_n), [2 * BLOCK_N])
        b_gu = fp4_gemv_klane(p_x, o_xrow, m_xrow, p_w, p_s, o_r, m_r, K_PAIRS, BLOCK_M,
                              2 * BLOCK_N, BLOCK_KP // 4, KLANE_STAGES, TILED, x_inv, XQ)
        b_g, b_u = tl.split(tl.reshape(b_gu, [BLOCK_M, BLOCK_N, 2]))
        if XQ:
            b_g *= x_sc[:, None]
            b_u *= x_sc[:, None]
    else:
        b_g = bf16_gemv(p_x, o_xrow, m_xrow, p_x, p_w, o_n, m_n, K_PAIRS, BLOCK_M, BLOCK_N,
                        BLOCK_KP, False, False, TOKEN_LOOP)
        b_u = bf16_gemv(p_x, o_xrow, m_xrow, p_x, p_w, o_n + N_HALF, m_n, K_PAIRS, BLOCK_M,
                        BLOCK_N, BLOCK_KP, False, False, TOKEN_LOOP)
    return act(b_g, b_u, beta, linear_beta, ACT)
