"""The gate GEMV of the route boundary: FP32 partial logits, deterministic (no atomics on data)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..dense.mix import mix_weights, mixed_row, mixed_x, token_mix_weights


@triton.jit
def _fill(p_dst, n, b_value, pid, n_prog, BLOCK: tl.constexpr):
    """Grid-stride store of the block ``b_value`` over ``p_dst[0:n]``."""
    o = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, n_prog * BLOCK):
        tl.store(p_dst + start + o, b_value, mask=start + o < n)


@triton.jit
def _gemv_partials(p_x, p_w, p_part, i_e, i_k, M, E, H,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                   CHUNKS: tl.constexpr, DOT_M: tl.constexpr = 0, DOT_K: tl.constexpr = 128,
                   DOT_FP32: tl.constexpr = False, MIX: tl.constexpr = False, p_sb=0, p_nw=0,
                   p_sums=0, s_n=0, s_sbn=0, s_sbm=0, s_p=0, eps=0.0,
                   S_NB: tl.constexpr = 16, S_BLOCK_C: tl.constexpr = 1):
    """Tile (i_e, i_k) of W read once; for every token, store its partial logits
    ``p_part[i_k, m, tile]``.

    DOT_M > 0 (split-K tiles, bf16 x and W): tensor-core products of DOT_M tokens at once, the
    tile in DOT_K-wide steps (bf16 products are exact in fp32; DOT_FP32 casts the operands
    first, for the interpreter). ROWS = 0 (split-K tiles): the tile is BLOCK_E experts x
    BLOCK_K columns, loaded once for all tokens. ROWS > 0 (row programs): ROWS (<= BLOCK_E)
    experts from i_e * ROWS, CHUNKS consecutive BLOCK_K-wide column chunks from
    i_k * CHUNKS * BLOCK_K, accumulated
    elementwise (fp32 [BLOCK_E, BLOCK_K]) and reduced once; unrolled, so the chunks' loads are
    independent and can all be in flight; tokens outermost (W re-read from L2 for m >= 1: meant
    for decode batches).

    MIX: x is the live sum of an AttnRes read whose sums its producer left (p_sums, bank rows
    p_sb, norm weight p_nw; kernels/dense/mix.py): each token's x is that read's h_normed,
    mixed as it is loaded."""
    if DOT_M > 0:
        o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
        m_e = o_e < E
        for m0 in range(0, M, DOT_M):
            o_m = m0 + tl.arange(0, DOT_M)
            m_m = o_m < M
            b_acc = tl.zeros([BLOCK_E, DOT_M], tl.float32)
            if MIX:
                b_pb, b_pl, b_rstd = mix_weights(p_sums, s_n, s_p, M, H, eps, m0, DOT_M, S_NB,
                                                 S_BLOCK_C)
            for k0 in tl.static_range(0, BLOCK_K, DOT_K):
                o_k = i_k * BLOCK_K + k0 + tl.arange(0, DOT_K)
                m_k = o_k < H
                b_w = tl.load(p_w + o_e[:, None] * H + o_k[None, :],
                              mask=m_e[:, None] & m_k[None, :], other=0.0)
                if MIX:  # bf16 values: the tensor-core operand exactly
                    b_x = tl.trans(mixed_x(p_x, p_nw, p_sb, s_n, s_sbn, s_sbm, b_pb, b_pl,
                                           b_rstd, o_m, m_m, o_k, m_k, H, S_BLOCK_C)
                                   ).to(tl.bfloat16)
                else:
                    b_x = tl.load(p_x + o_m[None, :] * H + o_k[:, None],
                                  mask=m_k[:, None] & m_m[None, :], other=0.0)
                if DOT_FP32:
                    b_w, b_x = b_w.to(tl.float32), b_x.to(tl.float32)
                b_acc += tl.dot(b_w, b_x)
            tl.store(p_part + (i_k * M + o_m[None, :]) * E + o_e[:, None], b_acc,
                     mask=m_e[:, None] & m_m[None, :])
    elif ROWS == 0:
        o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
        o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
        m_e, m_k = o_e < E, o_k < H
        b_w = tl.load(p_w + o_e[:, None] * H + o_k[None, :], mask=m_e[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)
        for i_m in range(M):
            if MIX:
                b_pb, b_pl, b_rstd = token_mix_weights(p_sums, s_n, s_p, M, H, eps, i_m, S_NB,
                                                       S_BLOCK_C)
                b_x = mixed_row(p_x, p_nw, p_sb, s_n, s_sbn, s_sbm, b_pb, b_pl, b_rstd, i_m, o_k,
                                m_k, H, S_BLOCK_C)
            else:
                b_x = tl.load(p_x + i_m * H + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_acc = tl.sum(b_w * b_x[None, :], axis=1)
            tl.store(p_part + (i_k * M + i_m) * E + o_e, b_acc, mask=m_e)
    else:
        o_r = tl.arange(0, BLOCK_E)
        o_e = i_e * ROWS + o_r
        m_e = (o_r < ROWS) & (o_e < E)
        k0 = i_k * (CHUNKS * BLOCK_K)
        for i_m in range(M):
            b_acc = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
            if MIX:
                b_pb, b_pl, b_rstd = token_mix_weights(p_sums, s_n, s_p, M, H, eps, i_m, S_NB,
                                                       S_BLOCK_C)
            for i_c in tl.static_range(CHUNKS):
                o_k = k0 + i_c * BLOCK_K + tl.arange(0, BLOCK_K)
                m_k = o_k < H
                b_w = tl.load(p_w + o_e[:, None] * H + o_k[None, :],
                              mask=m_e[:, None] & m_k[None, :], other=0.0).to(tl.float32)
                if MIX:
                    b_x = mixed_row(p_x, p_nw, p_sb, s_n, s_sbn, s_sbm, b_pb, b_pl, b_rstd, i_m,
                                    o_k, m_k, H, S_BLOCK_C)
                else:
                    b_x = tl.load(p_x + i_m * H + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_acc += b_w * b_x[None, :]
            tl.store(p_part + (i_k * M + i_m) * E + o_e, tl.sum(b_acc, axis=1), mask=m_e)


@triton.jit
def _gate_gemv_kernel(p_x, p_w, p_part, M, E, H,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """gate_logits: the split-K GEMV alone, grid (E tiles, K splits)."""
    _gemv_partials(p_x, p_w, p_part, tl.program_id(0), tl.program_id(1), M, E, H,
                   BLOCK_E, BLOCK_K, 0, 1)
