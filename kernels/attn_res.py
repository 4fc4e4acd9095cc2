"""Fused AttnRes read + the RMSNorm that follows it (docs/model.md), in one or two launches.

For every token m, with the candidates V = stack(bank[0..N-1, m], live[m]) in fp32:

    score_j  = sum_h V_jh * rsqrt(mean_h(V_j^2) + eps) * res_norm_w_h * res_proj_w_h
             = rsqrt(mean_h(V_j^2) + eps) * sum_h V_jh * (res_norm_w_h * res_proj_w_h)
    p        = softmax_j(score)
    h        = bf16(sum_j p_j * V_j)
    h_normed = bf16(h * rsqrt(mean_h(h^2) + eps) * norm_w)

The second form of the score needs one pass over the candidates for both sums (sum of squares and
dot with the fused weight w = res_norm_w * res_proj_w). Two schedules (:class:`AttnResConfig`;
each default's evidence: docs/decisions.md):

- one program per token streams the N + 1 rows once to score them, once more to mix them (that
  read hits L2), and re-reads its own h (H bf16) for the norm. The bank rows are a
  [BLOCK_NB, BLOCK_H] register tile (padded rows masked: no memory traffic, score -inf), the
  live row a [BLOCK_H] vector beside it;
- split (deep reads of few tokens): programs of a column chunk each store the chunk's Gram
  matrix G = V V^T and score dots; a second launch mixes and normalizes every chunk from all of
  the token's sums (sum(h^2) = p^T G p), so one token's rows are read by many SMs at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .runtime import INTERPRETED, check_device, check_number

__all__ = ["attn_res_norm", "AttnResConfig", "MAX_SEALED"]

# Bank rows one program holds as a padded register block. K3 needs 8 (9 candidates with live);
# 16 leaves room for deeper presets while padded rows cost registers, never bandwidth.
MAX_SEALED = 16
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AttnResConfig:
    """How ``attn_res_norm`` tiles a token's rows. Every choice changes speed only.

    tile_elems: elements of the [BLOCK_NB, BLOCK_H] fp32 bank tile a step loads (32768 at 8
        warps: 128 values a thread; at K3's 8 sealed rows a 4096-wide chunk, two steps over
        H = 7168 with ~72 KB of loads in flight each).
    max_block_h: widest H chunk (the norm pass, and the read with <= 2 bank rows): 8192 covers
        K3's 7168 in one chunk.
    num_warps: warps of the one program per token.
    split_h: 0: always one program per token (the fields above); else, for reads of at least
        split_min_candidates candidates, programs of split_h columns each, cdiv(H, split_h) a
        token, over two launches: the candidates' partial sums (their Gram matrix and dots with
        the score weight), then the mix and the norm from all of the token's partial sums, so a
        token's rows are read by many SMs at once.
    split_min_candidates: the shallowest read that takes the split schedule (below it one
        program streams the few rows faster than two launches meet).
    split_pdl: the split launches use programmatic dependent launch (compiled only): the mix
        launch loads its norm weight while the sums launch finishes.
    split_warps: warps of a split program.
    max_split_programs: the split grid's largest size per SM (more tokens: one program each;
        at K3, 14 programs a token: up to 9 tokens).
    one_chunk_elems: the one program keeps a token's rows in registers from the scores to the
        norm (one read of them, no re-read of h) when its [BLOCK_NB, BLOCK_H] tile covers all
        of H within this many elements; 0: never.
    one_chunk_min_candidates: the shallowest read that does so (below it the passes that
        re-read from L1 measured faster).
    pdl: the one-program read is launched with programmatic dependent launch (compiled only):
        it loads its weights while the previous launch finishes and lets the next launch
        start once it has waited for the previous one (off: a plain launch).
    bank_before_wait: (with pdl, or split_pdl for the split's first launch) the sealed bank
        rows, and the score weights, are loaded before the wait for the previous grid, live
        after it. Only where no launch the read may overlap writes the bank: the previous one,
        and any earlier one still running (one that lets its dependents start before it waits
        itself). The decode token seals a row by a plain copy launched at least two launches
        before any read whose bank holds it, so its configs turn this on; off by default, since
        a caller that writes the bank just before the read would read stale rows.
    """

    tile_elems: int = 32768
    max_block_h: int = 8192
    num_warps: int = 8
    split_h: int = 512
    split_min_candidates: int = 6
    split_pdl: bool = True
    split_warps: int = 4
    max_split_programs: int = 1
    one_chunk_elems: int = 32768
    one_chunk_min_candidates: int = 1
    pdl: bool = True
    bank_before_wait: bool = False

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("split_h", "one_chunk_elems") and v == 0 and not isinstance(v, bool):
                continue
            if f.name in ("split_pdl", "pdl", "bank_before_wait"):
                if not isinstance(v, bool):
                    raise ValueError(f"{f.name}: expected a bool, got {v!r}")
                continue
            if f.name in ("split_min_candidates", "one_chunk_min_candidates"):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{f.name}: expected a positive int, got {v!r}")
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                what = ("0 or a power of two" if f.name in ("split_h", "one_chunk_elems")
                        else "a power of two")
                raise ValueError(f"{f.name}: expected {what}, got {v!r}")


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still fp32; NaN passes through.

    The following ``.to(tl.bfloat16)`` is then exact. On the GPU this equals the hardware
    cvt.rn; it is spelled out because the Triton interpreter's fp32 -> bf16 cast truncates
    (1-ulp bias, 0.4% norm error against torch's rounding).
    """
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return tl.where(x == x, u.to(tl.float32, bitcast=True), x)


@triton.jit
def _load_bank16(p_bank_rows, o_h, m_h, m_bank):
    """One H chunk of the bank rows as stored [BLOCK_NB, BLOCK_H] (masked rows 0)."""
    return tl.load(p_bank_rows + o_h[None, :], mask=m_bank[:, None] & m_h[None, :], other=0.0)


@triton.jit
def _load_live(p_live_row, o_h, m_h):
    return tl.load(p_live_row + o_h, mask=m_h, other=0.0).to(tl.float32)


@triton.jit
def _load_chunk(p_bank_rows, p_live_row, o_h, m_h, m_bank):
    """One H chunk of the candidates in fp32: bank [BLOCK_NB, BLOCK_H] (masked rows 0), live."""
    return (_load_bank16(p_bank_rows, o_h, m_h, m_bank).to(tl.float32),
            _load_live(p_live_row, o_h, m_h))


@triton.jit
def _softmax(b_sq_b, b_dot_b, b_sq_l, b_dot_l, m_bank, H, eps):
    """Softmax weights of the N bank rows (padded rows -inf) and live from their sums."""
    b_s_b = tl.where(m_bank, b_dot_b * tl.rsqrt(b_sq_b / H + eps), float("-inf"))
    b_s_l = b_dot_l * tl.rsqrt(b_sq_l / H + eps)
    b_max = tl.maximum(tl.max(b_s_b, axis=0), b_s_l)
    b_e_b = tl.exp(b_s_b - b_max)
    b_e_l = tl.exp(b_s_l - b_max)
    b_den = tl.sum(b_e_b, axis=0) + b_e_l
    return b_e_b / b_den, b_e_l / b_den


@triton.jit
def _attn_res_norm_kernel(
    p_bank, p_live, p_res_norm_w, p_res_proj_w, p_norm_w, p_h, p_hn,
    stride_bank_n, stride_bank_m, stride_live_m, stride_out_m,
    N, H, eps,
    BLOCK_NB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HN: tl.constexpr,
    ONE_CHUNK: tl.constexpr, STORE_H: tl.constexpr, PDL: tl.constexpr,
    BANK_EARLY: tl.constexpr,
):
    """One program per token. ONE_CHUNK (H <= BLOCK_H): one load of the rows serves the scores,
    the mix and the norm. STORE_H: h is stored too (else only h_normed). PDL: launched with
    programmatic dependent launch; the weights (never written by a previous launch) are read
    before the wait for the previous grid, every candidate after it (BANK_EARLY, one chunk: the
    bank rows before it too)."""
    i_m = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BLOCK_NB)
    m_bank = o_n < N
    p_bank_rows = p_bank + i_m * stride_bank_m + o_n[:, None].to(tl.int64) * stride_bank_n
    p_live_row = p_live + i_m * stride_live_m
    p_h_row = p_h + i_m * stride_out_m
    p_hn_row = p_hn + i_m * stride_out_m

    if ONE_CHUNK:  # one load of the rows: the scores, the mix and the norm from registers
        o_h = tl.arange(0, BLOCK_H)
        m_h = o_h < H
        b_w = (tl.load(p_res_norm_w + o_h, mask=m_h, other=0.0).to(tl.float32)
               * tl.load(p_res_proj_w + o_h, mask=m_h, other=0.0).to(tl.float32))
        b_nw = tl.load(p_norm_w + o_h, mask=m_h, other=0.0)  # in flight with the rows
        if BANK_EARLY:
            b_v16 = _load_bank16(p_bank_rows, o_h, m_h, m_bank)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        if not BANK_EARLY:
            b_v16 = _load_bank16(p_bank_rows, o_h, m_h, m_bank)
        b_vl = _load_live(p_live_row, o_h, m_h)
        b_vb = b_v16.to(tl.float32)
        b_p_b, b_p_l = _softmax(tl.sum(b_vb * b_vb, axis=1), tl.sum(b_vb * b_w[None, :], axis=1),
                                tl.sum(b_vl * b_vl, axis=0), tl.sum(b_vl * b_w, axis=0), m_bank,
                                H, eps)
        b_h = _round_bf16(tl.sum(b_p_b[:, None] * b_vb, axis=0) + b_p_l * b_vl)
        if STORE_H:
            tl.store(p_h_row + o_h, b_h.to(tl.bfloat16), mask=m_h)
        b_rstd = tl.rsqrt(tl.sum(b_h * b_h, axis=0) / H + eps)
        tl.store(p_hn_row + o_h, _round_bf16(b_h * b_rstd * b_nw.to(tl.float32))
                 .to(tl.bfloat16), mask=m_h)
        return

    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    # pass 1: per candidate, sum of squares and dot with w = res_norm_w * res_proj_w
    b_sq_b = tl.zeros([BLOCK_NB], dtype=tl.float32)
    b_dot_b = tl.zeros([BLOCK_NB], dtype=tl.float32)
    b_sq_l = 0.0
    b_dot_l = 0.0
    for i_h in range(0, H, BLOCK_H):
        o_h = i_h + tl.arange(0, BLOCK_H)
        m_h = o_h < H
        b_vb, b_vl = _load_chunk(p_bank_rows, p_live_row, o_h, m_h, m_bank)
        b_w = (tl.load(p_res_norm_w + o_h, mask=m_h, other=0.0).to(tl.float32)
               * tl.load(p_res_proj_w + o_h, mask=m_h, other=0.0).to(tl.float32))
        b_sq_b += tl.sum(b_vb * b_vb, axis=1)
        b_dot_b += tl.sum(b_vb * b_w[None, :], axis=1)
        b_sq_l += tl.sum(b_vl * b_vl, axis=0)
        b_dot_l += tl.sum(b_vl * b_w, axis=0)

    b_p_b, b_p_l = _softmax(b_sq_b, b_dot_b, b_sq_l, b_dot_l, m_bank, H, eps)

    # pass 2: h = sum_j p_j V_j, stored in bf16; sum of squares of the *rounded* h
    b_h2 = 0.0
    for i_h in range(0, H, BLOCK_H):
        o_h = i_h + tl.arange(0, BLOCK_H)
        m_h = o_h < H
        b_vb, b_vl = _load_chunk(p_bank_rows, p_live_row, o_h, m_h, m_bank)
        b_h = _round_bf16(tl.sum(b_p_b[:, None] * b_vb, axis=0) + b_p_l * b_vl)
        tl.store(p_h_row + o_h, b_h.to(tl.bfloat16), mask=m_h)
        b_h2 += tl.sum(b_h * b_h, axis=0)
    b_rstd = tl.rsqrt(b_h2 / H + eps)

    # pass 3: RMSNorm of h (re-read: this program's own stores, made visible by the barrier)
    tl.debug_barrier()
    for i_h in range(0, H, BLOCK_HN):
        o_h = i_h + tl.arange(0, BLOCK_HN)
        m_h = o_h < H
        b_h = tl.load(p_h_row + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_w = tl.load(p_norm_w + o_h, mask=m_h, other=0.0).to(tl.float32)
        tl.store(p_hn_row + o_h, _round_bf16(b_h * b_rstd * b_w).to(tl.bfloat16), mask=m_h)


# ---------------------------------------------------------------------------------------------
# split H: programs of BLOCK_H columns, a token's P programs combining their partial sums (the
# candidates' Gram matrix G = V V^T and dots with w = res_norm_w * res_proj_w) across two
# launches. With the softmax weights p, sum(h^2) = p^T G p: the norm needs no second reduction
# over the token's columns.

@triton.jit
def _split_bank(p_bank, i_m, o_h, m_h, N, stride_bank_n, stride_bank_m, BLOCK_NB: tl.constexpr):
    """One H chunk of a token's N bank rows as a [BLOCK_NB, BLOCK_H] bf16 tile (rows from N
    masked: no memory traffic, zeros)."""
    o_n = tl.arange(0, BLOCK_NB)
    return tl.load(p_bank + i_m * stride_bank_m + o_n[:, None].to(tl.int64) * stride_bank_n
                   + o_h[None, :], mask=(o_n < N)[:, None] & m_h[None, :], other=0.0)


@triton.jit
def _with_live(b_vb, p_live, i_m, o_h, m_h, N, stride_live_m, BLOCK_NB: tl.constexpr):
    """The bank tile with live as row N."""
    o_n = tl.arange(0, BLOCK_NB)
    b_vl = tl.load(p_live + i_m * stride_live_m + o_h, mask=m_h, other=0.0)
    return tl.where((o_n == N)[:, None], b_vl[None, :], b_vb)


@triton.jit
def _split_rows(p_bank, p_live, i_m, o_h, m_h, N, stride_bank_n, stride_bank_m, stride_live_m,
                BLOCK_NB: tl.constexpr):
    """One H chunk of a token's N + 1 candidates as a [BLOCK_NB, BLOCK_H] bf16 tile: bank rows
    0..N-1, live as row N, padded rows masked (no memory traffic, zeros)."""
    b_vb = _split_bank(p_bank, i_m, o_h, m_h, N, stride_bank_n, stride_bank_m, BLOCK_NB)
    return _with_live(b_vb, p_live, i_m, o_h, m_h, N, stride_live_m, BLOCK_NB)


@triton.jit
def _score_weight(p_res_norm_w, p_res_proj_w, o_h, m_h):
    """w = res_norm_w * res_proj_w on one H chunk, fp32."""
    return (tl.load(p_res_norm_w + o_h, mask=m_h, other=0.0).to(tl.float32)
            * tl.load(p_res_proj_w + o_h, mask=m_h, other=0.0).to(tl.float32))


@triton.jit
def _chunk_sums(b_v, b_w, p_g, p_d, slot, DOT_FP32: tl.constexpr, BLOCK_NB: tl.constexpr):
    """Store one chunk's G [BLOCK_NB, BLOCK_NB] and dots [BLOCK_NB] with the score weight b_w
    in slot ``slot``."""
    b_vd = b_v.to(tl.float32) if DOT_FP32 else b_v  # the interpreter's bf16 dot is wrong
    b_g = tl.dot(b_vd, tl.trans(b_vd), out_dtype=tl.float32)  # bf16 products: exact in fp32
    b_d = tl.sum(b_v.to(tl.float32) * b_w[None, :], axis=1)
    o_n = tl.arange(0, BLOCK_NB)
    tl.store(p_g + slot * BLOCK_NB * BLOCK_NB + o_n[:, None] * BLOCK_NB + o_n[None, :], b_g)
    tl.store(p_d + slot * BLOCK_NB + o_n, b_d)


@triton.jit
def _token_weights(p_g, p_d, slot0, P, N, H, eps, BLOCK_NB: tl.constexpr,
                   BLOCK_P: tl.constexpr):
    """Softmax weights [BLOCK_NB] (padded rows 0) and rstd of h from slots slot0..slot0+P-1,
    loaded BLOCK_P at a time (from L2) and added in a fixed order: every program gets the
    same."""
    o_n = tl.arange(0, BLOCK_NB)
    o_q = tl.arange(0, BLOCK_NB * BLOCK_NB)
    b_g = tl.zeros([BLOCK_NB * BLOCK_NB], tl.float32)
    b_d = tl.zeros([BLOCK_NB], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        o_p = p0 + tl.arange(0, BLOCK_P)
        m_p = o_p < P
        b_g += tl.sum(tl.load(p_g + (slot0 + o_p)[:, None] * BLOCK_NB * BLOCK_NB + o_q[None, :],
                              mask=m_p[:, None], other=0.0, cache_modifier=".cg"), axis=0)
        b_d += tl.sum(tl.load(p_d + (slot0 + o_p)[:, None] * BLOCK_NB + o_n[None, :],
                              mask=m_p[:, None], other=0.0, cache_modifier=".cg"), axis=0)
    return _gram_weights(tl.reshape(b_g, [BLOCK_NB, BLOCK_NB]), b_d, N, H, eps, BLOCK_NB)


@triton.jit
def _gram_weights(b_g, b_d, N, H, eps, BLOCK_NB: tl.constexpr):
    """Softmax weights [BLOCK_NB] (rows past N 0) and rstd of h from a token's summed Gram
    matrix b_g [BLOCK_NB, BLOCK_NB] and score dots b_d [BLOCK_NB] (live is candidate N):
    sum(h^2) = p^T G p."""
    o_n = tl.arange(0, BLOCK_NB)
    b_sq = tl.sum(tl.where(o_n[:, None] == o_n[None, :], b_g, 0.0), axis=1)
    b_s = tl.where(o_n <= N, b_d * tl.rsqrt(b_sq / H + eps), float("-inf"))
    b_e = tl.exp(b_s - tl.max(b_s, axis=0))
    b_p = b_e / tl.sum(b_e, axis=0)
    b_h2 = tl.sum(tl.sum(b_g * b_p[:, None], axis=0) * b_p, axis=0)
    return b_p, tl.rsqrt(b_h2 / H + eps)


@triton.jit
def _mix_store(b_v, b_p, b_rstd, b_nw, p_h_row, p_hn_row, o_h, m_h, STORE_H: tl.constexpr):
    b_h = _round_bf16(tl.sum(b_p[:, None] * b_v.to(tl.float32), axis=0))
    if STORE_H:
        tl.store(p_h_row + o_h, b_h.to(tl.bfloat16), mask=m_h)
    tl.store(p_hn_row + o_h, _round_bf16(b_h * b_rstd * b_nw).to(tl.bfloat16), mask=m_h)


@triton.jit
def _attn_res_sums_kernel(
    p_bank, p_live, p_res_norm_w, p_res_proj_w, p_g, p_d,
    stride_bank_n, stride_bank_m, stride_live_m, N, H, P,
    PDL: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_H: tl.constexpr,
    BANK_EARLY: tl.constexpr,
):
    """Two launches, the first: program (i_p, token i_m) stores its chunk's sums. BANK_EARLY:
    the bank rows and the score weight are loaded before the wait for the previous grid."""
    i_p = tl.program_id(0)
    i_m = tl.program_id(1).to(tl.int64)
    o_h = i_p * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    if BANK_EARLY:
        b_vb = _split_bank(p_bank, i_m, o_h, m_h, N, stride_bank_n, stride_bank_m, BLOCK_NB)
        b_w = _score_weight(p_res_norm_w, p_res_proj_w, o_h, m_h)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if BANK_EARLY:
        b_v = _with_live(b_vb, p_live, i_m, o_h, m_h, N, stride_live_m, BLOCK_NB)
    else:
        b_v = _split_rows(p_bank, p_live, i_m, o_h, m_h, N, stride_bank_n, stride_bank_m,
                          stride_live_m, BLOCK_NB)
        b_w = _score_weight(p_res_norm_w, p_res_proj_w, o_h, m_h)
    _chunk_sums(b_v, b_w, p_g, p_d, i_m * P + i_p, DOT_FP32, BLOCK_NB)


@triton.jit
def _attn_res_mix_kernel(
    p_bank, p_live, p_norm_w, p_h, p_hn, p_g, p_d, p_clear,
    stride_bank_n, stride_bank_m, stride_live_m, stride_out_m, N, H, eps, P, n_clear,
    PDL: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    STORE_H: tl.constexpr, CLEAR: tl.constexpr,
):
    """Two launches, the second (or the read after a producer that left the sums): program
    (i_p, token i_m) mixes and normalizes its chunk from the token's P slots of sums. Its norm
    weight is loaded before the wait for the launch that stored the sums. CLEAR: the grid
    zeroes p_clear's n_clear words as well (the next read's sums, before its producer adds)."""
    i_p = tl.program_id(0)
    i_m = tl.program_id(1).to(tl.int64)
    o_h = i_p * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    b_nw = tl.load(p_norm_w + o_h, mask=m_h, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    b_p, b_rstd = _token_weights(p_g, p_d, i_m * P, P, N, H, eps, BLOCK_NB, BLOCK_P)
    # the candidates after the weights (an L2 hit: the first launch read them): held across
    # the weights' reductions they cost twice the registers and spill
    b_v = _split_rows(p_bank, p_live, i_m, o_h, m_h, N, stride_bank_n, stride_bank_m,
                      stride_live_m, BLOCK_NB)
    _mix_store(b_v, b_p, b_rstd, b_nw, p_h + i_m * stride_out_m, p_hn + i_m * stride_out_m,
               o_h, m_h, STORE_H)
    if CLEAR:  # program q of the grid's Q zeroes words [q * share, (q + 1) * share)
        q = i_m * tl.num_programs(0) + i_p
        share = tl.cdiv(n_clear, tl.num_programs(0) * tl.num_programs(1))
        for c0 in range(q * share, tl.minimum((q + 1) * share, n_clear), BLOCK_H):
            o_c = c0 + tl.arange(0, BLOCK_H)
            tl.store(p_clear + o_c, tl.zeros([BLOCK_H], tl.float32),
                     mask=o_c < tl.minimum((q + 1) * share, n_clear))


def _check_weight(name: str, w, hidden: int, device: torch.device) -> None:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 1 or w.shape[0] != hidden:
        raise ValueError(f"{name}: expected shape [H={hidden}], got {tuple(w.shape)}")
    if w.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{name}: expected dtype bfloat16 or float32, got {w.dtype}")
    if w.device != device:
        raise ValueError(f"{name}: expected device {device} (that of live), got {w.device}")
    if w.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous vector, got stride {w.stride(0)}")


def attn_res_norm(bank: torch.Tensor, live: torch.Tensor, res_norm_weight: torch.Tensor,
                  res_proj_weight: torch.Tensor, norm_weight: torch.Tensor, *,
                  eps: float = 1e-5, config: AttnResConfig | None = None,
                  return_h: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """AttnRes read of the N sealed rows and the live partial sum, then RMSNorm; one launch.

    bank:            [N, M, H] bf16, 0 <= N <= MAX_SEALED sealed block sums;
                     inner dimension contiguous.
    live:            [M, H] bf16, the live partial sum (the last candidate); M >= 1.
    res_norm_weight: [H] bf16 or fp32, the RMSNorm weight applied to every candidate's key.
    res_proj_weight: [H] bf16 or fp32, the pseudo-query the keys are scored against.
    norm_weight:     [H] bf16 or fp32, the weight of the RMSNorm that follows the read.
    eps:             RMSNorm epsilon of both norms (positive).
    config:          the :class:`AttnResConfig` (None: the defaults); speed only.
    return_h:        False: only ``h_normed`` is computed for return (``h`` is None), as when
                     a projection consumes the read.

    Returns ``(h, h_normed)``, both [M, H] bf16 and contiguous: ``h`` the softmax mixture of the
    raw candidates, ``h_normed = RMSNorm(h) * norm_weight`` of the bf16 ``h`` (the split
    schedule takes h's sum of squares before the rounding, p^T G p). No host synchronization
    (CUDA-graph capturable).
    """
    for name, t in (("bank", bank), ("live", live)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name}: expected dtype bfloat16, got {t.dtype}")
    if live.dim() != 2:
        raise ValueError(f"live: expected shape [M, H], got {tuple(live.shape)}")
    M, H = live.shape
    if M < 1 or H < 1:
        raise ValueError(f"live: expected M >= 1 tokens and H >= 1, got {tuple(live.shape)}")
    if bank.dim() != 3 or tuple(bank.shape[1:]) != (M, H):
        raise ValueError(f"bank: expected shape [N, M={M}, H={H}], got {tuple(bank.shape)}")
    N = bank.shape[0]
    if N > MAX_SEALED:
        raise ValueError(f"bank: expected at most MAX_SEALED={MAX_SEALED} sealed rows, got N={N}")
    device = live.device
    if bank.device != device:
        raise ValueError(f"bank: expected device {device} (that of live), got {bank.device}")
    check_device("live", live)
    if live.stride(1) != 1:
        raise ValueError(f"live: expected the hidden (last) dimension contiguous, got strides "
                         f"{live.stride()}")
    if N and bank.stride(2) != 1:
        raise ValueError(f"bank: expected the hidden (last) dimension contiguous, got strides "
                         f"{bank.stride()}")
    _check_weight("res_norm_weight", res_norm_weight, H, device)
    _check_weight("res_proj_weight", res_proj_weight, H, device)
    _check_weight("norm_weight", norm_weight, H, device)
    eps = check_number("eps", eps, positive=True)
    if config is not None and not isinstance(config, AttnResConfig):
        raise ValueError(f"config: expected an AttnResConfig or None, got "
                         f"{type(config).__name__}")
    cfg = config or AttnResConfig()
    if not isinstance(return_h, bool):
        raise ValueError(f"return_h: expected a bool, got {return_h!r}")

    h = torch.empty((M, H), dtype=torch.bfloat16, device=device)
    h_normed = torch.empty((M, H), dtype=torch.bfloat16, device=device)
    BLOCK_NB = triton.next_power_of_2(max(N, 1))
    # With no sealed rows the bank is never read (all rows masked); pass live so an empty
    # tensor's pointer never reaches the launcher.
    bank_arg = bank if N else live
    strides = (bank.stride(0) if N else 0, bank.stride(1) if N else 0, live.stride(0),
               h.stride(0))
    n_split = triton.cdiv(H, cfg.split_h) if cfg.split_h else 0
    if n_split > 1 and cfg.split_min_candidates <= N + 1 and \
            n_split * M <= _split_capacity(device, cfg):
        nb = max(16, triton.next_power_of_2(N + 1))  # tl.dot's smallest tile
        slots = M * n_split
        part = torch.empty(slots * (nb * nb + nb), dtype=torch.float32, device=device)
        part_g, part_d = part[:slots * nb * nb], part[slots * nb * nb:]  # Gram, dots
        blocks = dict(BLOCK_NB=nb, BLOCK_H=cfg.split_h, num_warps=cfg.split_warps)
        pdl = cfg.split_pdl and not INTERPRETED
        launch = {"launch_pdl": True} if pdl else {}
        _attn_res_sums_kernel[(n_split, M)](
            bank_arg, live, res_norm_weight, res_proj_weight, part_g, part_d, *strides[:3], N,
            H, n_split, PDL=pdl, DOT_FP32=INTERPRETED, BANK_EARLY=pdl and cfg.bank_before_wait,
            **blocks, **launch)
        _attn_res_mix_kernel[(n_split, M)](
            bank_arg, live, norm_weight, h, h_normed, part_g, part_d, part_d, *strides, N, H,
            float(eps), n_split, 0, PDL=pdl, BLOCK_P=triton.next_power_of_2(n_split),
            STORE_H=return_h, CLEAR=False, **blocks, **launch)
        return (h if return_h else None), h_normed
    BLOCK_HN = min(triton.next_power_of_2(H), cfg.max_block_h)
    BLOCK_H = min(BLOCK_HN, cfg.tile_elems // BLOCK_NB)
    pdl = cfg.pdl and not INTERPRETED
    one_chunk = (BLOCK_H >= H and cfg.one_chunk_elems >= BLOCK_NB * BLOCK_H
                 and cfg.one_chunk_min_candidates <= N + 1)
    _attn_res_norm_kernel[(M,)](
        bank_arg, live, res_norm_weight, res_proj_weight, norm_weight, h, h_normed, *strides,
        N, H, float(eps),
        BLOCK_NB=BLOCK_NB, BLOCK_H=BLOCK_H, BLOCK_HN=BLOCK_HN, ONE_CHUNK=one_chunk,
        STORE_H=return_h or not one_chunk, PDL=pdl,
        BANK_EARLY=pdl and one_chunk and cfg.bank_before_wait, num_warps=cfg.num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return (h if return_h else None), h_normed


def _split_capacity(device: torch.device, cfg: AttnResConfig) -> int:
    """The largest split grid (the interpreter: any)."""
    if device.type != "cuda":
        return 1 << 30
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return cfg.max_split_programs * sms
