"""The route selection: sigmoid, bias, grouped top-k on packed (score, expert) keys, weights.

A key is ``(order-preserving int32 image of the biased score) << 32 | (IDX_BITS - expert)``:
unique per token, larger key = larger biased score, among equal scores the lower expert.
"""

from __future__ import annotations

import triton
import triton.language as tl

RENORM_EPS = tl.constexpr(1e-20)  # the model's epsilon on the weight sum
KEY_MIN = tl.constexpr(-(2**63))  # below every packed key: marks an expert already taken
IDX_BITS = tl.constexpr(0x7FFFFFFF)  # low word of a key: IDX_BITS - expert (larger = lower expert)


@triton.jit
def _token_keys(p_part, p_bias, o_t, m_t, M,
                E: tl.constexpr, SPLIT_K: tl.constexpr, N_GROUP: tl.constexpr,
                TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, SCALAR_E: tl.constexpr):
    """Tokens o_t [BLOCK_T] (valid where m_t): packed selection keys, int64 [BLOCK_T, BLOCK_E],
    and unbiased scores s = sigmoid(logit), fp32 [BLOCK_T, BLOCK_E].

    Experts outside the kept groups (n_group > 1), padding lanes (expert >= E) and padding
    tokens get sb = -inf. SCALAR_E: the expert axis is declared non-contiguous, so the loads are
    scalar and the keys get the one-element-a-thread layout of the compaction's scatter stores.
    """
    o_e = tl.arange(0, BLOCK_E)
    if SCALAR_E:
        o_e = tl.max_contiguous(o_e, 1)
    m_e = o_e < E
    m_te = m_t[:, None] & m_e[None, :]
    b_bias = tl.load(p_bias + o_e[None, :], mask=m_e[None, :], other=0.0)  # [1, BLOCK_E]
    b_logit = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    # the partials were written by other programs of this launch: .cg loads (L2, not L1)
    for i_k in tl.static_range(SPLIT_K):  # fixed order: _gather_scores repeats it
        b_logit += tl.load(p_part + (i_k * M + o_t[:, None]) * E + o_e[None, :], mask=m_te,
                           other=0.0, cache_modifier=".cg")
    b_s = 1.0 / (1.0 + tl.exp(-b_logit))
    b_sb = tl.where(m_te, b_s + b_bias, float("-inf"))

    if N_GROUP > 1:
        o_g = tl.arange(0, BLOCK_G)
        b_grp = o_e // GROUP_SIZE
        b_gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):  # group score = top-2 sum (values only)
            b_in = tl.where((b_grp == g)[None, :], b_sb, float("-inf"))
            b_top1 = tl.max(b_in, axis=1)
            b_i1 = tl.min(tl.where(b_in == b_top1[:, None], o_e[None, :], BLOCK_E), axis=1)
            b_top2 = tl.max(tl.where(o_e[None, :] == b_i1[:, None], float("-inf"), b_in), axis=1)
            b_gscore = tl.where(o_g[None, :] == g, (b_top1 + b_top2)[:, None], b_gscore)
        b_keep = tl.zeros([BLOCK_T, BLOCK_G], tl.int32)
        for _ in tl.static_range(TOPK_GROUP):  # arg-max, ties to the lower group
            b_gbest = tl.max(b_gscore, axis=1)
            b_ig = tl.min(tl.where(b_gscore == b_gbest[:, None], o_g[None, :], BLOCK_G), axis=1)
            b_hit = o_g[None, :] == b_ig[:, None]
            b_keep = tl.where(b_hit, 1, b_keep)
            b_gscore = tl.where(b_hit, float("-inf"), b_gscore)
        b_keep_e = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
        for g in tl.static_range(N_GROUP):
            b_kg = tl.sum(tl.where(o_g[None, :] == g, b_keep, 0), axis=1)
            b_keep_e = tl.where((b_grp == g)[None, :], b_kg[:, None], b_keep_e)
        b_sb = tl.where(b_keep_e != 0, b_sb, float("-inf"))

    b_bits = b_sb.to(tl.int32, bitcast=True)
    b_bits = b_bits ^ ((b_bits >> 31) & 0x7FFFFFFF)
    b_key = (b_bits.to(tl.int64) << 32) | (-o_e[None, :] + IDX_BITS).to(tl.int64)
    return b_key, b_s


@triton.jit
def _top_k_loop(b_key, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """Top-k of keys int64 [BLOCK_T, BLOCK_E] by TOP_K rounds of arg-max (one cross-warp
    reduction each): expert ids int32 and keys int64, each [BLOCK_T, BLOCK_S] (slots >= TOP_K:
    0 and KEY_MIN)."""
    o_s = tl.arange(0, BLOCK_S)
    b_ids = tl.zeros([BLOCK_T, BLOCK_S], tl.int32)
    b_top = tl.full([BLOCK_T, BLOCK_S], KEY_MIN, tl.int64)
    for i_s in range(TOP_K):
        b_best = tl.max(b_key, axis=1)
        b_idx = (-(b_best & IDX_BITS) + IDX_BITS).to(tl.int32)
        b_ids = tl.where(o_s[None, :] == i_s, b_idx[:, None], b_ids)
        b_top = tl.where(o_s[None, :] == i_s, b_best[:, None], b_top)
        b_key = tl.where(b_key == b_best[:, None], KEY_MIN, b_key)
    return b_ids, b_top


@triton.jit
def _gather_scores(p_part, b_ids, o_t, m_ts, M, E: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """Unbiased scores of the experts b_ids [BLOCK_T, BLOCK_S] of tokens o_t, fp32
    [BLOCK_T, BLOCK_S]: the partials re-loaded and summed in _token_keys' order (same bits)."""
    b_wl = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    for i_k in tl.static_range(SPLIT_K):
        b_wl += tl.load(p_part + (i_k * M + o_t[:, None]) * E + b_ids, mask=m_ts, other=0.0,
                        cache_modifier=".cg")
    return 1.0 / (1.0 + tl.exp(-b_wl))


@triton.jit
def _payload(b_s, b_ids):
    """(s fp32 bits << 32) | expert, int64 (s >= 0: the max of payloads is well defined)."""
    return (b_s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | b_ids.to(tl.int64)


@triton.jit
def _load_candidates(p_cand, o_t, m_t, CAP: tl.constexpr, CACHE: tl.constexpr):
    """The candidate rows of tokens o_t [BLOCK_T] (see _top_k_threshold): count int64
    [BLOCK_T], keys and payloads int64 [BLOCK_T, CAP] (empty slots: KEY_MIN and 0)."""
    o_c = tl.arange(0, CAP)
    p_row = p_cand + o_t * (2 * CAP + 1)
    b_n = tl.load(p_row + 2 * CAP, mask=m_t, other=0, cache_modifier=CACHE)
    m_c = o_c[None, :] < b_n[:, None]
    b_ck = tl.load(p_row[:, None] + o_c[None, :], mask=m_c, other=KEY_MIN, cache_modifier=CACHE)
    b_cp = tl.load(p_row[:, None] + CAP + o_c[None, :], mask=m_c, other=0, cache_modifier=CACHE)
    return b_n, b_ck, b_cp


@triton.jit
def _top_k_threshold(b_key, b_s, p_part, p_cand, o_t, m_t, M, E: tl.constexpr,
                     SPLIT_K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BUCKETS: tl.constexpr,
                     CAP: tl.constexpr, CAND_CACHE: tl.constexpr):
    """Top-k of keys int64 [BLOCK_T, BLOCK_E] in a fixed number of reductions, not TOP_K.

    1. bucket maxima: bucket b holds the experts e = b (mod BUCKETS), BUCKETS >= TOP_K;
       the threshold T is the TOP_K-th largest bucket maximum (rank by a pairwise count).
       Every top-k key is >= T (TOP_K buckets have a key >= T), and usually only a few more.
       Strided, not runs of consecutive experts (whose maxima would be warp-local, saving one
       cross-warp reduction): equal scores go to the lower experts, which then spread over the
       buckets (all-equal scores: exactly TOP_K candidates, not hundreds), and the routing
       groups (masked whole) are cut across, so the kept experts still fill every bucket;
    2. the candidates (key >= T) are compacted by an exclusive cumsum into CAP slots of the
       token's row of the scratch p_cand (int64 [M, 2 * CAP + 1]: keys, payloads
       (s bits << 32 | expert, s from b_s fp32 [BLOCK_T, BLOCK_E]: no re-load), count), read
       back after a CTA barrier. A token with more than CAP candidates (crowded buckets) makes
       the block fall back to the arg-max loop, which rewrites the rows with the exact top-k;
    3. rank among the candidates by a pairwise count of larger keys; slot i takes the candidate
       of rank i.

    Returns ids int32 and scores s fp32, each [BLOCK_T, BLOCK_S] (slots >= TOP_K: garbage).
    """
    o_e = tl.arange(0, BLOCK_E)
    # 1. threshold: [BLOCK_T, BLOCK_E // BUCKETS, BUCKETS] -> bucket maxima [BLOCK_T, BUCKETS]
    b_bmax = tl.max(tl.reshape(b_key, [BLOCK_T, BLOCK_E // BUCKETS, BUCKETS]), axis=1)
    b_brank = tl.sum((b_bmax[:, None, :] > b_bmax[:, :, None]).to(tl.int32), axis=2)
    b_thr = tl.max(tl.where(b_brank == TOP_K - 1, b_bmax, KEY_MIN), axis=1)  # [BLOCK_T]

    # 2. compaction; the count is the inclusive cumsum's last column (no extra reduction)
    m_cand = b_key >= b_thr[:, None]
    b_incl = tl.cumsum(m_cand.to(tl.int32), axis=1)
    b_pos = b_incl - m_cand.to(tl.int32)
    p_row = p_cand + o_t[:, None] * (2 * CAP + 1)
    m_st = m_cand & (b_pos < CAP) & m_t[:, None]
    tl.store(p_row + b_pos, b_key, mask=m_st)
    tl.store(p_row + CAP + b_pos, _payload(b_s, o_e[None, :]), mask=m_st)
    tl.store(p_row + 2 * CAP + o_e[None, :] * 0, b_incl.to(tl.int64),
             mask=m_t[:, None] & (o_e[None, :] == BLOCK_E - 1))
    tl.debug_barrier()  # the rows were written by other threads of this program
    b_n, b_ck, b_cp = _load_candidates(p_cand, o_t, m_t, CAP, CAND_CACHE)
    if tl.max(b_n, axis=0) > CAP:  # rare: exact but slow
        o_s = tl.arange(0, BLOCK_S)
        m_ts = m_t[:, None] & (o_s[None, :] < TOP_K)
        b_ids, b_top = _top_k_loop(b_key, TOP_K, BLOCK_T, BLOCK_S)
        b_pay = _payload(_gather_scores(p_part, b_ids, o_t, m_ts, M, E, SPLIT_K, BLOCK_T,
                                        BLOCK_S), b_ids)
        tl.debug_barrier()  # every thread has read its rows (above) before they are rewritten
        p_row = p_cand + o_t[:, None] * (2 * CAP + 1)
        tl.store(p_row + o_s[None, :], b_top, mask=m_ts)
        tl.store(p_row + CAP + o_s[None, :], b_pay, mask=m_ts)
        tl.store(p_row + 2 * CAP + o_s[None, :] * 0, tl.zeros_like(b_top) + TOP_K,
                 mask=m_t[:, None] & (o_s[None, :] == 0))
        tl.debug_barrier()
        b_n, b_ck, b_cp = _load_candidates(p_cand, o_t, m_t, CAP, CAND_CACHE)

    # 3. ranks [BLOCK_T, CAP] (empty slots hold KEY_MIN: never larger), then slot order
    b_crank = tl.sum((b_ck[:, None, :] > b_ck[:, :, None]).to(tl.int32), axis=2)
    o_s = tl.arange(0, BLOCK_S)
    b_pick = tl.max(tl.where(b_crank[:, :, None] == o_s[None, None, :], b_cp[:, :, None], 0),
                    axis=1)  # [BLOCK_T, BLOCK_S]
    b_ids = (b_pick & 0xFFFFFFFF).to(tl.int32)
    b_sel = (b_pick >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return b_ids, b_sel


@triton.jit
def _select_tokens(p_part, p_bias, p_cand, p_ids, p_w, t0, M, scaling,
                   E: tl.constexpr, SPLIT_K: tl.constexpr, TOP_K: tl.constexpr,
                   N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                   RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BUCKETS: tl.constexpr,
                   CAP: tl.constexpr, CAND_CACHE: tl.constexpr, SCALAR_E: tl.constexpr):
    """Route tokens [t0, t0 + BLOCK_T): store their ids and weights; return
    (ids, weights, entry index, mask), each [BLOCK_T, BLOCK_S]. BUCKETS > 0: by threshold
    (_top_k_threshold); BUCKETS = 0: by the arg-max loop."""
    o_s = tl.arange(0, BLOCK_S)
    o_t = t0 + tl.arange(0, BLOCK_T)
    m_t = o_t < M
    m_ts = m_t[:, None] & (o_s[None, :] < TOP_K)
    b_key, b_s = _token_keys(p_part, p_bias, o_t, m_t, M, E, SPLIT_K, N_GROUP, TOPK_GROUP,
                             GROUP_SIZE, BLOCK_T, BLOCK_E, BLOCK_G, SCALAR_E)
    if BUCKETS > 0:
        b_ids, b_sel = _top_k_threshold(b_key, b_s, p_part, p_cand, o_t, m_t, M, E, SPLIT_K,
                                        TOP_K, BLOCK_T, BLOCK_E, BLOCK_S, BUCKETS, CAP,
                                        CAND_CACHE)
    else:
        b_ids = _top_k_loop(b_key, TOP_K, BLOCK_T, BLOCK_S)[0]
        b_sel = _gather_scores(p_part, b_ids, o_t, m_ts, M, E, SPLIT_K, BLOCK_T, BLOCK_S)

    # weights: the unbiased scores of the chosen experts
    b_w = tl.where(m_ts, b_sel, 0.0)
    if RENORMALIZE:
        b_w = b_w / (tl.sum(b_w, axis=1)[:, None] + RENORM_EPS)
    b_w = b_w * scaling
    o_ts = o_t[:, None] * TOP_K + o_s[None, :]
    tl.store(p_ids + o_ts, b_ids, mask=m_ts)
    tl.store(p_w + o_ts, b_w, mask=m_ts)
    return b_ids, b_w, o_ts, m_ts
