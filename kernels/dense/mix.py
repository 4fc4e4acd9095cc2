"""The AttnRes read as the dense GEMV's prologue (``dense_gemv(read_input=...)``).

The projection's input is h_normed = RMSNorm(sum_j p_j V_j) of the candidates V = (sealed
rows, live), whose sums (Gram entries and score dots over column slots) the producer of live
left (``kernels/attn_res_sums.py``). Every program takes the softmax weights and rstd from those
sums once, after its wait for the producer, and mixes its K steps of the candidates as it loads
them: the read has no launch of its own. Rounding as the split read's: h rounded to bf16, its
sum of squares p^T G p.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..attn_res import _gram_weights, _round_bf16

BLOCK_P = tl.constexpr(16)  # slots a program loads at once


@triton.jit
def token_mix_weights(p_sums, s_n, s_p, M, H, eps, m, S_NB: tl.constexpr,
                      S_BLOCK_C: tl.constexpr):
    """(bank rows' weights [S_BLOCK_C] (rows from s_n 0), live's, rstd of h) of token m (< M)
    from its s_p slots of sums (Gram blocks of S_NB x S_NB, then dots blocks of S_NB; live is
    candidate s_n), summed in slot order."""
    o_c = tl.arange(0, S_BLOCK_C)
    o_q = o_c[:, None] * S_NB + o_c[None, :]
    p_dots = p_sums + M * s_p * S_NB * S_NB
    b_g = tl.zeros([S_BLOCK_C, S_BLOCK_C], tl.float32)
    b_d = tl.zeros([S_BLOCK_C], tl.float32)
    for s0 in range(0, s_p, BLOCK_P):
        o_s = s0 + tl.arange(0, BLOCK_P)
        m_s = o_s < s_p
        slot = m * s_p + o_s
        b_g += tl.sum(tl.load(p_sums + slot[:, None, None] * S_NB * S_NB + o_q[None, :, :],
                              mask=m_s[:, None, None], other=0.0, cache_modifier=".cg"), axis=0)
        b_d += tl.sum(tl.load(p_dots + slot[:, None] * S_NB + o_c[None, :], mask=m_s[:, None],
                              other=0.0, cache_modifier=".cg"), axis=0)
    b_p, b_rstd = _gram_weights(b_g, b_d, s_n, H, eps, S_BLOCK_C)
    return (tl.where(o_c < s_n, b_p, 0.0), tl.sum(tl.where(o_c == s_n, b_p, 0.0), axis=0),
            b_rstd)


@triton.jit
def mix_weights(p_sums, s_n, s_p, M, H, eps, m0, BLOCK_M: tl.constexpr, S_NB: tl.constexpr,
                S_BLOCK_C: tl.constexpr):
    """:func:`token_mix_weights` of tokens m0 .. m0 + BLOCK_M - 1 (those from M: zeros), as
    [BLOCK_M, S_BLOCK_C], [BLOCK_M], [BLOCK_M]. A loop over the tokens, not unrolled (one
    round trip for the sums a token; the unrolled code's compile time: docs/decisions.md)."""
    o_j = tl.arange(0, BLOCK_M)
    b_pb = tl.zeros([BLOCK_M, S_BLOCK_C], tl.float32)
    b_pl = tl.zeros([BLOCK_M], tl.float32)
    b_rstd = tl.zeros([BLOCK_M], tl.float32)
    for j in range(0, tl.minimum(BLOCK_M, M - m0)):
        t_pb, t_pl, t_rstd = token_mix_weights(p_sums, s_n, s_p, M, H, eps, m0 + j, S_NB,
                                               S_BLOCK_C)
        b_pb = tl.where((o_j == j)[:, None], t_pb[None, :], b_pb)
        b_pl = tl.where(o_j == j, t_pl, b_pl)
        b_rstd = tl.where(o_j == j, t_rstd, b_rstd)
    return b_pb, b_pl, b_rstd


@triton.jit
def mixed_row(p_x, p_nw, p_sb, s_n, s_sbn, s_sbm, b_pb, b_pl, b_rstd, m, o_k, m_k, K,
              S_BLOCK_C: tl.constexpr):
    """Token m's h_normed [BLOCK_K] fp32 (bf16 values) on columns o_k, from its weights
    (:func:`token_mix_weights`): as :func:`mixed_x` for one token, on 2-D tiles (why not
    through mixed_x's 3-D ones: docs/decisions.md)."""
    o_c = tl.arange(0, S_BLOCK_C)
    b_v = tl.load(p_sb + o_c[:, None].to(tl.int64) * s_sbn + m * s_sbm + o_k[None, :],
                  mask=(o_c < s_n)[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    b_l = tl.load(p_x + m * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_h = _round_bf16(tl.sum(b_v * b_pb[:, None], axis=0) + b_pl * b_l)
    b_nw = tl.load(p_nw + o_k, mask=m_k, other=0.0).to(tl.float32)
    return _round_bf16(b_h * b_rstd * b_nw)


@triton.jit
def mixed_x(p_x, p_nw, p_sb, s_n, s_sbn, s_sbm, b_pb, b_pl, b_rstd, o_m, m_m, o_k, m_k, K,
            S_BLOCK_C: tl.constexpr):
    """h_normed [BLOCK_M, BLOCK_K] fp32 (bf16 values) on columns o_k: the bank rows at p_sb
    (strides s_sbn, s_sbm) and live at p_x [M, K] mixed by their weights, rounded, scaled by
    rstd and the norm weight p_nw, rounded."""
    o_c = tl.arange(0, S_BLOCK_C)
    b_v = tl.load(p_sb + o_c[None, :, None].to(tl.int64) * s_sbn + o_m[:, None, None] * s_sbm
                  + o_k[None, None, :],
                  mask=m_m[:, None, None] & (o_c < s_n)[None, :, None] & m_k[None, None, :],
                  other=0.0).to(tl.float32)
    b_l = tl.load(p_x + o_m[:, None] * K + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                  other=0.0).to(tl.float32)
    b_h = _round_bf16(tl.sum(b_v * b_pb[:, :, None], axis=1) + b_pl[:, None] * b_l)
    b_nw = tl.load(p_nw + o_k, mask=m_k, other=0.0).to(tl.float32)
    return _round_bf16(b_h * b_rstd[:, None] * b_nw[None, :])


@triton.jit
def clear(p, n, BLOCK: tl.constexpr = 1024):
    """Zero n fp32 words at p (the next read's sums)."""
    for i in range(0, n, BLOCK):
        o = i + tl.arange(0, BLOCK)
        tl.store(p + o, tl.zeros([BLOCK], tl.float32), mask=o < n)
