"""MXFP4 GEMV tiles for one token on the tensor cores (``mma.sync.m16n8k16``, bf16 in, fp32 out).

The expert GEMVs of the MoE stages at B1 read MXFP4 weights (two E2M1 codes a byte, an E8M0
factor per group of 32 along K: ``kernels.mxfp4.MXFP4``). On the K-lane path every weight
element costs a decode and an FMA; here the multiply-adds go to the tensor cores and the decode
is what is left (about 2 integer ops an element):

- A operand (16 rows x 16 K): a warp's 16 weight rows. A thread's fragment (rows g and g + 8,
  columns 2t, 2t + 1, 2t + 8, 2t + 9; lane = 4g + t) is one int32 word of 8 codes from row g and
  the same word of row g + 8: codes n and n + 4 (16 bits apart) become one bf16x2 register
  holding 2^-126 x value with one shift/mask sequence per sign and magnitude (the 0.5 code is a
  bf16 subnormal), so columns (2t, 2t + 1, 2t + 8, 2t + 9) are elements (0, 4, 1, 5) of the
  word in the first mma and (2, 6, 3, 7) in the second.
- B operand (16 K x 8 columns): x spread over the K step's 8 groups, B[k, c] = x[k] if the
  element of k is in group c, else 0. The word of lane t holds group t (first half of the step)
  or t + 4 (second half), so only lanes with g == that group carry x. x (bf16) is scaled by 2^100
  (exact) so the products 2^-26 w x stay in fp32's normal range.
- D[row, c] is then the row's partial sum over group c: its factor 2^(s - 127) (times 2^26) is
  one FFMA per (row, group) and K step, and the rows' totals come from one reduction at the end.

The mma is warp-wide, so the tile is built so that each thread's elements are its fragment:
``[256, 4]`` int32 tiles (index i = 128 h + 32 warp + lane: h the half of the step; 4 words of a
16-byte load) whose only contiguous dimension is the last; Triton gives such a load the layout
sizePerThread [1, 4], threadsPerWarp [32, 1], warpsPerCTA [4, 1], order [1, 0] (lane = i % 32,
warp = i // 32 % 4), and ``inline_asm_elementwise`` with pack=4 hands each thread its own 4
consecutive words. (A third, row-tile dimension would tie with the first for the lanes, and
Triton 3.6 and 3.9 break that tie differently.) ``mma_layout_problem`` checks a compiled
kernel's TTGIR for exactly this layout; the MoE launchers refuse tiles that do not have it.
Under the interpreter (no inline PTX) ``_mma_emulate`` computes the same fragments' products in
plain ops, lane by lane, so the CPU tests cover the indexing.
"""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from ..runtime import INTERPRETED  # noqa: F401  (sets the interpreter up before any jit)

__all__ = ["fp4_mma_gemv", "mma_prepare_x", "store_prepared_x", "prefetch_l2",
           "mma_layout_problem", "tiled_word_offset", "MMA_WARPS", "MMA_OPERAND_LAYOUT"]

MMA_WARPS = 4  # the tile's index math assumes 4 warps (launch the kernel with num_warps=4)
X_SCALE_EXP = 100  # x * 2^100 in bf16: products 2^-126 w * 2^100 x = 2^-26 w x
SCALE_BIAS = tl.constexpr(127 - X_SCALE_EXP - 1)  # 2^(s - 127) * 2^26 has fp32 exponent s + 26
X_MUL = tl.constexpr(2.0 ** X_SCALE_EXP)


def _pair_ptx(dst: str, src: str, n: int, src8: str) -> str:
    """PTX: codes n (low half) and n + 4 (high half) of word ``src`` as bf16x2 2^-126 * value:
    signs (bits 4n + 3, 4n + 19) to 15 / 31, magnitudes (4n..4n + 2) to 6..8 / 22..24. Codes 2
    and 3 take their magnitudes from ``src8`` (src >> 8, one right shift a word) shifted left:
    ptxas runs left shifts on the FMA pipe and right shifts on the ALU pipe, which the LOP3s keep
    busiest."""
    s_sh, m_sh = 12 - 4 * n, 6 - 4 * n
    sign = (f"shl.b32 s, {src}, {s_sh}; and.b32 s, s, 0x80008000;" if s_sh
            else f"and.b32 s, {src}, 0x80008000;")
    mag = f"shl.b32 m, {src}, {m_sh};" if m_sh >= 0 else f"shl.b32 m, {src8}, {m_sh + 8};"
    return f"{sign} {mag} and.b32 m, m, 0x01C001C0; or.b32 {dst}, m, s;\n"


def _mma_ptx() -> str:
    """pack=4 block: D (4 fp32) of 8 chained mmas over a thread's 4 words of row g ($4..$7) and
    row g + 8 ($8..$11) with B registers ($12.. four per word: x pairs (0, 4), (1, 5), (2, 6),
    (3, 7) of the word's 8 elements)."""
    body = ["{", ".reg .b32 s, m, a0, a1, a2, a3;", ".reg .b32 r8lo, r8hi;",
            "mov.f32 $0, 0f00000000; mov.f32 $1, 0f00000000;",
            "mov.f32 $2, 0f00000000; mov.f32 $3, 0f00000000;"]
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    for u in range(4):
        lo, hi = f"${4 + u}", f"${8 + u}"
        body.append(f"shr.u32 r8lo, {lo}, 8; shr.u32 r8hi, {hi}, 8;")
        b = [f"${12 + 4 * j + u}" for j in range(4)]  # B tensors A, B, C, D: arg-major
        for half in range(2):  # codes (0, 4, 1, 5) then (2, 6, 3, 7)
            n0, n1 = 2 * half, 2 * half + 1
            body += [_pair_ptx("a0", lo, n0, "r8lo"), _pair_ptx("a1", hi, n0, "r8hi"),
                     _pair_ptx("a2", lo, n1, "r8lo"), _pair_ptx("a3", hi, n1, "r8hi")]
            body.append(f"{mma} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, "
                        f"{{{b[2 * half]}, {b[2 * half + 1]}}}, {{$0, $1, $2, $3}};")
    body.append("}")
    return "\n".join(body)


MMA_PTX = tl.constexpr(_mma_ptx())
# x words 0..3 of a K word (bf16 pairs (0,1), (2,3), (4,5), (6,7)) -> B pairs (0,4), (1,5), (2,6),
# (3,7), each times 2^100 (bf16 0x7180; fma with -0 keeps the sign of zero products harmless)
X_PAIRS_PTX = tl.constexpr("""{
.reg .b32 c, z; mov.b32 c, 0x71807180; mov.b32 z, 0x80008000;
prmt.b32 $0, $4, $6, 0x5410; fma.rn.bf16x2 $0, $0, c, z;
prmt.b32 $1, $4, $6, 0x7632; fma.rn.bf16x2 $1, $1, c, z;
prmt.b32 $2, $5, $7, 0x5410; fma.rn.bf16x2 $2, $2, c, z;
prmt.b32 $3, $5, $7, 0x7632; fma.rn.bf16x2 $3, $3, c, z;
}""")


@triton.jit
def _bf16_lo(b):
    """fp32 value of the low bf16 half of int32 ``b``."""
    return (b << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_hi(b):
    return (b & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _x_elements(x0, x1, x2, x3):
    """x words 0..3 of each K word [256, 4] (bf16 pairs) -> fp32 elements [256, 4, 8], element
    n = 2 v + half of word v."""
    a0 = tl.join(_bf16_lo(x0), _bf16_hi(x0))  # [256, 4, 2]: (half)
    a1 = tl.join(_bf16_lo(x1), _bf16_hi(x1))
    a2 = tl.join(_bf16_lo(x2), _bf16_hi(x2))
    a3 = tl.join(_bf16_lo(x3), _bf16_hi(x3))
    b01 = tl.permute(tl.join(a0, a1), [0, 1, 3, 2])  # (v % 2, half)
    b23 = tl.permute(tl.join(a2, a3), [0, 1, 3, 2])
    c = tl.permute(tl.join(b01, b23), [0, 1, 4, 2, 3])  # (v // 2, v % 2, half)
    return tl.reshape(c, [256, 4, 8])


@triton.jit
def _emulate_rows(b_w, b_x, R: tl.constexpr):
    """[2, 4, 8 (row g), 8 (column), R] fp32: one row half's D (see _mma_emulate)."""
    o_n = tl.arange(0, 8)
    shift = (28 - 4 * o_n)[None, None, None, None, None, None, :]
    b_w = tl.reshape(b_w, [2, 4, 8, 4, R, 4])[:, :, :, :, :, :, None]  # (h, warp, g, t, r, u)
    # code n as fp32 2^-126 * value: nibble to the top, arithmetic shift, sign and magnitude
    code = (((b_w << shift) >> 6) & (0x81C00000 - (1 << 32))).to(tl.float32, bitcast=True)
    prod = code[:, :, :, None, :, :, :, :] * b_x  # (h, warp, g, column, t, r, u, n)
    return tl.sum(tl.sum(tl.sum(prod, axis=7), axis=6), axis=4)


@triton.jit
def _mma_emulate(b_lo, b_hi, x0, x1, x2, x3, R: tl.constexpr, X_SCALED: tl.constexpr = False):
    """Interpreter stand-in for the MMA_PTX blocks: D [256, R, 4] fp32 of every thread, computed
    from the fragments' lanes. b_lo / b_hi [256, R, 4] words of rows g / g + 8; x0..x3 [256, 4]
    the x words 0..3 of each K word (0 on lanes without x).

    Code n of a thread's word meets x element n of the same word (the A column of code n is the
    B row of x element n: (0, 4, 1, 5) in the first mma, (2, 6, 3, 7) in the second), held by
    the lane of column g, so D[row g, column c] = sum over t, u, n of code n of lane (g, t)'s
    word u times x element n of lane (c, t)'s word u."""
    xv = _x_elements(x0, x1, x2, x3)
    if not X_SCALED:
        xv = xv * X_MUL
    xv = tl.reshape(xv, [2, 4, 8, 4, 1, 4, 8])
    b_x = xv[:, :, None, :, :, :, :]  # (h, warp, 1, column g, t, 1, u, n)
    d_lo = _emulate_rows(b_lo, b_x, R)
    d_hi = _emulate_rows(b_hi, b_x, R)
    # thread (g, t) holds D[g + 8 chi, 2t + clo] as element 2 chi + clo
    d_lo = tl.permute(tl.reshape(d_lo, [2, 4, 8, 4, 2, R]), [0, 1, 2, 3, 5, 4])
    d_hi = tl.permute(tl.reshape(d_hi, [2, 4, 8, 4, 2, R]), [0, 1, 2, 3, 5, 4])
    d = tl.permute(tl.join(d_lo, d_hi), [0, 1, 2, 3, 4, 6, 5])
    return tl.reshape(d, [256, R, 4])


@triton.jit
def prefetch_l2(ptrs, mask):
    """prefetch.global.L2 of the line of each pointer where mask (no registers held; compiled
    only: inline PTX)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def tiled_word_offset(row, word, K_WORDS):
    """Offset (int32 words) of word ``word`` (a multiple of 4) of row ``row`` in MXFP4's tiled
    layout (kernels.mxfp4.mxfp4_tiled_codes): 16-row x 32-word blocks (one K step of a 16-row
    tile, 2 KB) in (row tile, step) order, each holding the tile's four 512-byte loads (row
    half hi, step half h) one after another, the lanes (4 g + t) 16 bytes apart."""
    rr = row % 16
    grp = word % 32 // 4
    return (((row // 16) * (K_WORDS // 32) + word // 32) * 512
            + (rr // 8 * 2 + grp // 4) * 128 + (rr % 8 * 4 + grp % 4) * 4)


@triton.jit
def _load_words(p_lo, p_hi, m_lo, m_hi, m_w, EVICT_FIRST: tl.constexpr = False):
    """Words of rows g / g + 8 of one row tile [256, 4] int32: thread i's 4 consecutive words
    from p_lo[i] / p_hi[i] (2-D, so that the only contiguous dimension is the last: the layout
    then puts lanes along the first dimension in every Triton version). EVICT_FIRST: the loads'
    eviction policy is "evict_first" (L1::evict_first with an L2 evict_first cache hint)."""
    o_u = tl.arange(0, 4)
    b_lo = tl.load(p_lo[:, None] + o_u[None, :], mask=(m_lo & m_w)[:, None], other=0,
                   eviction_policy="evict_first" if EVICT_FIRST else "")
    b_hi = tl.load(p_hi[:, None] + o_u[None, :], mask=(m_hi & m_w)[:, None], other=0,
                   eviction_policy="evict_first" if EVICT_FIRST else "")
    return b_lo, b_hi


@triton.jit
def _word_ptrs(p_w, row, o_w, step, K_WORDS, t_lo, t_hi, TILED: tl.constexpr):
    """Pointers of the words of rows g / g + 8 (``row``: row g of the thread's tile) at K word
    o_w (step ``step``). Row layout: the row offsets are summed in 1-D before the column
    offsets are added (fewer address instructions than adding them in 2-D). TILED: t_lo / t_hi
    are the thread's offsets at step 0 (tiled_word_offset), a step is 512 words further."""
    if TILED:
        p_lo = p_w + t_lo + step * 512
        p_hi = p_w + t_hi + step * 512
    else:
        p_lo = p_w + row * K_WORDS + o_w
        p_hi = p_lo + 8 * K_WORDS
    return p_lo, p_hi


@triton.jit
def _mma(b_lo, b_hi, b_a, b_b, b_c, b_d, x0, x1, x2, x3, ASM: tl.constexpr,
         X_SCALED: tl.constexpr = False):
    """D [256, 4] fp32 of one row tile: MMA_PTX on the thread's words (ASM) or the emulation
    (x0..x3 the raw x words, times 2^100 where X_SCALED)."""
    if ASM:
        d = tl.inline_asm_elementwise(MMA_PTX, "=f,=f,=f,=f" + ",r" * 24,
                                      [b_lo, b_hi, b_a, b_b, b_c, b_d],
                                      dtype=tl.float32, is_pure=True, pack=4)
    else:
        d = tl.reshape(_mma_emulate(b_lo[:, None, :], b_hi[:, None, :], x0, x1, x2, x3, 1,
                                    X_SCALED), [256, 4])
    return d


@triton.jit
def _x_operand(p_x, o_w, o_u, m_x, ASM: tl.constexpr, X_PREPARED: tl.constexpr):
    """The B registers (b_a..b_d) of a K step and the raw x words x0..x3 the emulation reads:
    x pairs 4 (4 grp + u) + v of the thread's words (``o_w``), on the lanes ``m_x``."""
    b_x = tl.load(p_x + (o_w * 4)[:, None, None] + 4 * o_u[None, :, None]
                  + o_u[None, None, :], mask=m_x[:, None, None], other=0)
    x_even, x_odd = tl.split(tl.reshape(b_x, [256, 4, 2, 2]))  # x word v = 2 v1 + v0
    x0, x2 = tl.split(x_even)
    x1, x3 = tl.split(x_odd)
    b_a, b_b, b_c, b_d = x0, x1, x2, x3  # the emulation reads x0..x3 itself
    if X_PREPARED:  # words (x0, x4), (x1, x5), (x2, x6), (x3, x7) * 2^100: already B
        if not ASM:  # the emulation takes the raw pairs back
            x0, x1, x2, x3 = (b_a & 65535) | (b_b << 16), (b_c & 65535) | (b_d << 16), \
                ((b_a >> 16) & 65535) | (b_b & -65536), ((b_c >> 16) & 65535) | (b_d & -65536)
    elif ASM:
        b_a, b_b, b_c, b_d = tl.inline_asm_elementwise(
            X_PAIRS_PTX, "=r,=r,=r,=r,r,r,r,r", [x0, x1, x2, x3],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    return b_a, b_b, b_c, b_d, x0, x1, x2, x3


@triton.jit
def fp4_mma_gemv(p_x, p_w, p_s, row0, ROW_R, row_lim, LIM_R, N_GROUPS,
                 R: tl.constexpr, WARPS_K: tl.constexpr, ASM: tl.constexpr,
                 PREFETCH: tl.constexpr = 0, X_PREPARED: tl.constexpr = False, factor=1.0,
                 W_EVICT_FIRST: tl.constexpr = False, W_TILED: tl.constexpr = False):
    """y [R, 16 * (4 // WARPS_K)] fp32: y[r, j] = factor * (w[row0 + r * ROW_R + j] . x), 0 for
    rows at or past row_lim + r * LIM_R (factor, fp32: multiplies every group's E8M0 factor).

    p_x: one token's x, bf16 viewed as int32 pairs [N_GROUPS * 16]; p_w: MXFP4 codes viewed as
    int32 words [rows, 4 * N_GROUPS] (8 codes a word); p_s: E8M0 scales uint8 [rows, N_GROUPS].
    p_w, p_x: 16-byte aligned. The row length comes in groups so that Triton can prove every
    thread's 4 words 16-byte aligned: the tiles' layout depends on it.
    R: 16-row tiles a warp (1 or 2); WARPS_K: warps that split each K iteration's steps (the
    others split the rows); ASM: inline PTX (compiled) or the interpreter's emulation;
    PREFETCH > 0 (compiled): each K iteration first asks L2 for the weight lines PREFETCH
    iterations ahead (no registers held, so more bytes in flight than the loads alone).
    X_PREPARED: p_x holds mma_prepare_x(x) (the B pairs, already times 2^100): no permute and
    scale a step. W_EVICT_FIRST: the weight loads are "evict_first". W_TILED: p_w holds the
    codes in MXFP4's tiled layout (rows a multiple of 16, K of 256), where each of a warp's
    16-byte loads reads 512 contiguous bytes. Launch with 4 warps."""
    WN: tl.constexpr = 4 // WARPS_K
    K_WORDS = N_GROUPS * 4
    n_steps = tl.cdiv(K_WORDS, 32)  # 32 words = 256 elements = 8 groups a step
    o_i = tl.arange(0, 256)
    lane, warp, h = o_i % 32, o_i // 32 % 4, o_i // 128
    g, t = lane // 4, lane % 4
    wn, wk = warp // WARPS_K, warp % WARPS_K
    grp = t + 4 * h  # the group of this thread's words in the step
    tl.static_assert(R == 1 or R == 2, "fp4_mma_gemv: R is 1 or 2 row tiles a warp")
    o_r = tl.arange(0, R)
    o_u = tl.arange(0, 4)
    row0_i = row0 + wn * 16 + g  # [256]: row g of the thread's tile 0
    m_lo0, m_hi0 = row0_i < row_lim, row0_i + 8 < row_lim
    m_lo1, m_hi1 = row0_i + ROW_R < row_lim + LIM_R, row0_i + ROW_R + 8 < row_lim + LIM_R
    # scale tiles [128, R, 2]: (warp, lane) x r x chi for D's elements 2 chi + clo (row g + 8 chi,
    # group 2t + clo of the step), one tile per clo: byte loads in D's layout (a pair of bytes
    # would be vectorized into another layout and cost a shared-memory conversion a step)
    o_q = tl.arange(0, 128)
    o_c = tl.arange(0, 2)
    q_row = row0 + o_r[None, :, None] * ROW_R + (o_q // 32 // WARPS_K * 16 + o_q % 32 // 4)[
        :, None, None] + 8 * o_c[None, None, :]
    q_wk = o_q // 32 % WARPS_K
    m_q = q_row < row_lim + o_r[None, :, None] * LIM_R
    if PREFETCH > 0 and ASM:  # lane l of a warp: row l % 16 of row tiles 2 j + l // 16
        RP: tl.constexpr = (R + 1) // 2
        o_j = tl.arange(0, RP)
        pf_r = 2 * o_j[None, :] + (o_q % 32 // 16)[:, None]  # [128, RP]
        pf_row = row0 + pf_r * ROW_R + (o_q // 32 // WARPS_K * 16 + o_q % 16)[:, None]
        m_pf = (pf_r < R) & (pf_row < row_lim + pf_r * LIM_R)
    t_lo0, t_hi0, t_lo1, t_hi1 = 0, 0, 0, 0
    if W_TILED:  # the thread's word offsets at step 0
        t_lo0 = tiled_word_offset(row0_i, 4 * grp, K_WORDS)
        t_hi0 = tiled_word_offset(row0_i + 8, 4 * grp, K_WORDS)
        t_lo1 = tiled_word_offset(row0_i + ROW_R, 4 * grp, K_WORDS)
        t_hi1 = tiled_word_offset(row0_i + ROW_R + 8, 4 * grp, K_WORDS)
    acc = tl.zeros([128, R, 4], dtype=tl.float32)
    for it in tl.range(0, tl.cdiv(n_steps, WARPS_K)):
        if PREFETCH > 0 and ASM:
            pf_step = (it + PREFETCH) * WARPS_K + q_wk  # [128]
            if W_TILED:  # lane l: line l % 16 of the tile's 2 KB block
                p_pf = p_w + ((pf_row // 16) * (K_WORDS // 32) + pf_step[:, None]) * 512 \
                    + pf_row % 16 * 32
            else:
                p_pf = p_w + pf_row * K_WORDS + (pf_step * 32)[:, None]
            prefetch_l2(p_pf, m_pf & (pf_step < n_steps)[:, None])
        step = it * WARPS_K + wk
        o_w = step * 32 + 4 * grp  # [256]: the first of the thread's 4 words
        m_w = (step < n_steps) & (o_w < K_WORDS)
        b_a, b_b, b_c, b_d, x0, x1, x2, x3 = _x_operand(p_x, o_w, o_u, m_w & (g == grp), ASM,
                                                        X_PREPARED)
        # row tile 0 (and 1): the B registers serve both
        p_lo, p_hi = _word_ptrs(p_w, row0_i, o_w, step, K_WORDS, t_lo0, t_hi0, W_TILED)
        b_lo, b_hi = _load_words(p_lo, p_hi, m_lo0, m_hi0, m_w, W_EVICT_FIRST)
        d = _mma(b_lo, b_hi, b_a, b_b, b_c, b_d, x0, x1, x2, x3, ASM, X_PREPARED)
        if R == 2:
            p_lo, p_hi = _word_ptrs(p_w, row0_i + ROW_R, o_w, step, K_WORDS, t_lo1, t_hi1,
                                    W_TILED)
            b_lo, b_hi = _load_words(p_lo, p_hi, m_lo1, m_hi1, m_w, W_EVICT_FIRST)
            d1 = _mma(b_lo, b_hi, b_a, b_b, b_c, b_d, x0, x1, x2, x3, ASM, X_PREPARED)
            d = tl.permute(tl.join(d, d1), [0, 2, 1])  # [256, R, 4]
        else:
            d = d[:, None, :]
        d = tl.sum(tl.reshape(d, [2, 128, R, 4]), axis=0)  # the two halves' groups
        q_step = it * WARPS_K + q_wk
        q_grp = q_step * 8 + 2 * (o_q % 4)  # [128]: group of clo = 0
        p_q = p_s + q_row * N_GROUPS + q_grp[:, None, None]
        m_g = (q_step < n_steps)[:, None, None] & (q_grp[:, None, None] < N_GROUPS)
        b_s0 = tl.load(p_q, mask=m_q & m_g, other=0).to(tl.int32)
        b_s1 = tl.load(p_q + 1, mask=m_q & m_g, other=0).to(tl.int32)
        b_s = tl.reshape(tl.join(b_s0, b_s1), [128, R, 4])
        acc += d * (((b_s + SCALE_BIAS) << 23).to(tl.float32, bitcast=True) * factor)
    # rows: sum over the K warps, the lanes' groups t and the element's column half clo
    y = tl.sum(tl.reshape(acc, [WN, WARPS_K, 8, 4, R, 2, 2]), axis=6)
    y = tl.sum(tl.sum(y, axis=3), axis=1)  # [WN, 8 (g), R, 2 (chi)]
    return tl.reshape(tl.permute(y, [2, 0, 3, 1]), [R, WN * 16])


@triton.jit
def store_prepared_x(p, o_row, o_col, N, b_bf16, mask):
    """In-kernel counterpart of mma_prepare_x, for a producer writing the copy beside its output:
    bf16 values [rows, cols] of columns o_col of rows o_row of a [.., N] tensor, stored with
    column c of each word of 8 at 2 (c % 4) + c // 4 (the order (0, 4, 1, 5, 2, 6, 3, 7)) and
    times 2^100 (exact)."""
    o_p = o_col - o_col % 8 + 2 * (o_col % 4) + o_col % 8 // 4
    tl.store(p + o_row[:, None] * N + o_p[None, :],
             (b_bf16.to(tl.float32) * X_MUL).to(tl.bfloat16), mask=mask)


def mma_prepare_x(x):
    """x (bf16 [..., K], K a multiple of 8) as fp4_mma_gemv's X_PREPARED operand: in each word of
    8 elements the order (0, 4, 1, 5, 2, 6, 3, 7), times 2^100 (exact for |x| < 2^28), bf16."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.shape[-1] % 8:
        raise ValueError(f"x: expected bf16 [..., K] with K a multiple of 8, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
    w = x.reshape(*x.shape[:-1], -1, 2, 4).transpose(-1, -2)
    return (w.float() * 2.0 ** X_SCALE_EXP).to(torch.bfloat16).reshape(x.shape).contiguous()


# the layout the tiles rely on, checked on compiled kernels
MMA_OPERAND_LAYOUT = ("sizePerThread = [1, 4], threadsPerWarp = [32, 1], warpsPerCTA = [4, 1], "
                      "order = [1, 0]")


def mma_layout_problem(ttgir: str) -> str | None:
    """None when every MMA_PTX block of a compiled kernel (its TTGIR) takes and returns tensors
    of MMA_OPERAND_LAYOUT (each thread its own 4 consecutive words, lane = index % 32 along the
    first dimension), else what differs. Another Triton version could pick another layout for
    the tiles; the mma would then pair the wrong fragments, so callers refuse to go on."""
    layouts = dict(re.findall(r"^(#\w+) = #ttg\.blocked<\{(.*?)\}>", ttgir, re.M))
    lines = [ln for ln in ttgir.splitlines()
             if "tt.elementwise_inline_asm" in ln and "mma.sync" in ln]
    if not lines:
        return "no mma inline asm in the kernel"
    for ln in lines:
        used = set(re.findall(r"tensor<[^>]*?, (#\w+)>", ln))
        for alias in used:
            if layouts.get(alias) != MMA_OPERAND_LAYOUT:
                return f"mma operand layout {alias} = {layouts.get(alias, 'not a blocked layout')}"
    return None
