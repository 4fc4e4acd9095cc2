"""Fused routing + MoE sort metadata (the route boundary) in one launch.

Math (ARCHITECTURE.md section 3, ``noaux_tc``), per token m of M::

    logits = fp32(x[m]) @ fp32(W_gate)^T            # [E]
    s      = sigmoid(logits);  sb = s + bias        # sb chooses, s weighs
    (n_group > 1: group score = top-2 sum of sb in the group; keep topk_group groups)
    ids    = top_k of sb, descending, ties to the lower expert index
    w      = s[ids] / (sum + 1e-20) (if renormalize) * routed_scaling_factor

and the sort metadata of ``k3lab.plan.RoutePlan``: entries ``m * top_k + slot`` grouped by
expert (ascending), each run padded to a multiple of ``block_m`` with the sentinel ``M * top_k``.

One launch, ``_route_sort_kernel``, grid (E tiles, K splits):

1. every program loads one [GEMV_E, GEMV_K] tile of W once (FP32 accumulation) and writes, for
   every token, its partial logits into an fp32 scratch [SPLIT_K, M, E] (no memset, no atomics on
   the data: deterministic); as a side job it fills its share of the plan's padding
   (sorted_ids = sentinel, sorted_weights = 0, block_expert_ids = -1) and zeroes ``out``;
2. "the last program finishes": after a CTA barrier each program increments a per-device int32
   counter once (acq_rel, gpu scope); the program that sees ``num_programs - 1`` (every other
   program's stores are then visible to it) runs the selection and sort below and resets the
   counter to 0 for the next call (or CUDA-graph replay; relaxed: the next launch starts after
   this one ends); the others just end;
3. the selection (``_select_sort``): sums the partials in a fixed order (``.cg`` loads: from L2,
   never a stale L1 line), sigmoid, bias, grouped top-k on packed (score, expert) int64 keys
   (unique; the low word breaks ties toward the lower expert): from top_k = 8 on by a threshold
   (``_top_k_threshold``: bucket maxima, the top_k-th largest of them, compaction of the few
   keys above it through a small scratch, their ranks: a fixed handful of reductions; more
   than CAP candidates falls back to the arg-max loop), below that by iterative arg-max
   (``_top_k_loop``, one reduction per slot); weights, then the sort metadata from pairwise
   comparisons of the M * top_k entries (rank within the expert, tiles of lower experts), so
   nothing scales with E beyond the selection itself.

The counter is shared by every call on a device: route_sort calls on one device must not run
concurrently on different streams (a decode step is one stream). It is created (zeroed) by the
first call on a device, which therefore must not happen inside a CUDA-graph capture.

``gate_logits`` (the standalone gate projection) runs step 1's GEMV alone (``_gate_gemv_kernel``).

At B1 on the GPU, step 1 runs as "row programs" instead of split-K tiles (GEMV_ROW_PROGRAMS:
whole experts a program over unrolled K chunks, GEMV_ROW_SPLITS partials); the selection keeps
its keys in the layout of its scatter stores (SELECT_SCALAR_KEYS) and reads its candidate rows
back through L1 (CAND_CACHE). Module constants, timed by benchmarks/h200_session4/route_sweep.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .plan import RoutePlan, plan_capacity

__all__ = ["route_sort", "gate_logits", "MAX_TOKENS"]

MAX_TOKENS = 64  # one selection program walks the tokens; beyond a decode batch, use a sort
RENORM_EPS = tl.constexpr(1e-20)  # the model's epsilon on the weight sum
# GPU gate GEMV tiles: 32 x 1024 bf16 = 64 KB of W per program; for K3's 896 x 7168 that is
# 28 x 7 = 196 programs. H200 sweep 4 (K3 tp 8, B1, cold, graph; 4 warps): the call got faster
# with fewer, bigger programs (784 programs of 16 x 512: 12.49 us; 392: ~11.5-11.7 us; 196 of
# 32 x 1024: 11.09 us): every program costs a completion atomic on one address and the tail
# reads fewer partials. At least GEMV_MIN_PROGRAMS (about one per SM) so small gates still
# spread over the GPU.
GEMV_BLOCK_E = 32
GEMV_BLOCK_K = (1024, 512, 256, 128)  # the widest K tile that still gives GEMV_MIN_PROGRAMS
GEMV_MIN_PROGRAMS = 132
# Interpreter (CPU): few, big programs; each program costs a fixed Python overhead.
INTERP_BLOCK_E = 128
INTERP_BLOCK_K = 2048
FILL_BLOCK = 1024  # elements per store in the padding / zero fill side job
SELECT_TILE = 4096  # tokens x padded experts held by the selection program at once
# (the selection shares the GEMV's kernel, so its registers set every program's; Triton 3.9
# for sm_90, K3, 4 warps, threshold selection: 128 at M = 1 (the GEMV alone: 96; ptxas keeps
# the 14 partial loads in flight), 180 at M = 2, 255 from M = 4 with small spills: fewer
# resident GEMV programs per SM)
# Threshold selection (_top_k_threshold): a fixed number of reductions instead of top_k
# arg-max rounds, from top_k = 8 on (K3 M = 1: 5 cross-warp reductions / scans instead of
# 16 + 3, plus one scratch round trip instead of the re-load of the chosen partials). Buckets:
# 2 per slot (K3: 32 buckets of 28 experts), so the threshold is tight: random routers give
# about top_k + 5 candidates (K3: mean 21, max 39 in 50k random tokens). CAP = 2 per slot (K3:
# 32 candidate slots): the pairwise rank is [CAP, CAP] per token, so a smaller CAP shortens the
# tail; H200 session 3, call 2 (benchmarks/h200_session3/route_sweep.py, row "cap32", K3 tp 8
# B1, graph replay, cold): 10.23 us vs 10.87 us at 4 per slot, every plan field matching the
# reference. The price is the exact arg-max fallback for a selection block holding a token with
# more than CAP candidates (make_inputs routers, 2048 tokens each: K3 0.2%, K2 0.6%, Kimi-Linear
# 0.9% of tokens; none at 4 per slot), so larger batches (M = 64) meet it more often.
THRESHOLD_MIN_TOP_K = 8
BUCKETS_PER_SLOT = 2
CANDIDATES_PER_SLOT = 2
# Padded experts per bucket, at least: one-expert buckets ([BLOCK_T, BUCKETS, 1] tiles) gave wrong
# plans on the H200 (E = 20, top-10, grouped; correct under the interpreter, cause not found), so
# such sizes take the arg-max loop.
MIN_BUCKET_SIZE = 2
# Padded expert count below which the arg-max loop selects: Triton 3.6 fails to compile the
# threshold selection for one token over 64 or fewer (padded) experts (sm_90, pass
# RemoveLayoutConversions: "operand does not dominate this use"; reproduced offline with triton
# 3.6.0's compiler for E = 32, 64 at M = 1; 128 and up, and M >= 2, compile).
THRESHOLD_MIN_EXPERTS = 128
REG_ENTRIES = 64  # (padded) entries sorted in registers when all tokens fit one block (B1)
PAIR_TILE = 8192  # entries x entries compared at once by the sort passes
PAIR_COLS = 1024  # widest column block of the sort passes
NUM_WARPS = 4  # every program's: the GEMV tiles and the selection
# Session 4 (issue 3; benchmarks/h200_session4/route_sweep.py, H200 calls 2 and 3, K3 B1, graph,
# cold; every plan field equal to the reference): the defaults below (row programs with two K
# splits, scalar keys, candidate read-back through L1) take the call from 10.43 to 9.07 us at tp 8
# (floor 4.15 us: 2.51x -> 2.19x) and 10.23 -> 9.07 us at tp 1. Separately: scalar keys + L1
# read-back 9.79 us; one K split (whole rows) 9.70 us; 264 row programs 11.67 us; evict_first
# on W 10.06 us and the candidate count from registers 10.04 us (both since removed: no gain);
# 2 warps 19.6 us.
# GEMV shapes:
# GEMV_ROW_PROGRAMS > 0: "row programs": about that many programs, each ROWS = cdiv(E, it)
# whole experts (K3: 7 rows -> 128 programs, one per SM, 100 KB of W each) over
# 1 / GEMV_ROW_SPLITS of H in unrolled GEMV_ROW_CHUNK-wide chunks (all loads independent).
# With GEMV_ROW_SPLITS = 1 the selection reads finished logits (SPLIT_K = 1: no partial sum).
# Row programs serve B1 only (more tokens would re-read each program's rows from L2 per token):
# from GEMV_ROW_MAX_TOKENS + 1 tokens on, the split-K tiles.
GEMV_ROW_PROGRAMS = 132
GEMV_ROW_CHUNK = 512
GEMV_ROW_SPLITS = 2
GEMV_ROW_MAX_TOKENS = 1
# Cache modifier of the selection's read-back of its own candidate rows (_load_candidates):
# "" (default caching: the rows were stored by this program, and its bar.sync makes them visible
# to its threads, so an L1 hit is allowed; only the lanes stored in this launch are read) or
# ".cg" (from L2).
CAND_CACHE = ""
# SELECT_SCALAR_KEYS: the selection loads its partials / bias one element at a time (the expert
# axis declared non-contiguous), so the keys live in the layout the compaction's scatter stores
# use (their pointers are data-dependent: one element a thread). sm_90, Triton 3.6, K3 M = 1:
# the top-k fast path then has 9 instead of 29 barriers and ~660 instead of ~1020 instructions
# (no layout conversions of the [1, 1024] keys / payloads / masks through shared memory, one
# scan instead of two); the partial loads become 56 independent 4-byte loads a thread.
SELECT_SCALAR_KEYS = True
# Measurement only (the H200 sweep sets it to split the last program's tail; anything below 3
# leaves the plan incomplete): -1 = GEMV and side job alone (no counter), 0 = + the counter (no
# selection), 1 = + the partial sum,
# sigmoid, bias and keys, 2 = + top-k and weights (topk_ids / topk_weights), 3 = + the sort
# metadata (the whole plan, the default).
TAIL_STAGE = 3
KEY_MIN = tl.constexpr(-(2**63))  # below every packed key: marks an expert already taken
IDX_BITS = tl.constexpr(0x7FFFFFFF)  # low word of a key: IDX_BITS - expert (larger = lower expert)

# One int32 "programs done" counter per device (see the module docstring), zero between calls.
# (Session 3's H200 sweep also timed a two-level counter and tl.topk for the selection: both
# slower, removed; benchmarks/h200_session3/README.md.)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _fill(p_dst, n, b_value, pid, n_prog, BLOCK: tl.constexpr):
    """Grid-stride store of the block ``b_value`` over ``p_dst[0:n]``."""
    o = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, n_prog * BLOCK):
        tl.store(p_dst + start + o, b_value, mask=start + o < n)


@triton.jit
def _gemv_partials(p_x, p_w, p_part, i_e, i_k, M, E, H,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr = 0,
                   CHUNKS: tl.constexpr = 1):
    """Tile (i_e, i_k) of W read once; for every token, store its partial logits
    ``p_part[i_k, m, tile]``.

    ROWS = 0: the tile is BLOCK_E experts x BLOCK_K columns, loaded once for all tokens.
    ROWS > 0 (GEMV_ROW_PROGRAMS): ROWS (<= BLOCK_E) experts from i_e * ROWS, CHUNKS
    consecutive BLOCK_K-wide column chunks from i_k * CHUNKS * BLOCK_K, accumulated
    elementwise (fp32 [BLOCK_E, BLOCK_K]) and reduced once; unrolled, so the chunks' loads are
    independent and can all be in flight; tokens outermost (W re-read from L2 for m >= 1: meant
    for decode batches)."""
    if ROWS == 0:
        o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
        o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
        m_e, m_k = o_e < E, o_k < H
        b_w = tl.load(p_w + o_e[:, None] * H + o_k[None, :], mask=m_e[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)
        for i_m in range(M):
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
            for i_c in tl.static_range(CHUNKS):
                o_k = k0 + i_c * BLOCK_K + tl.arange(0, BLOCK_K)
                m_k = o_k < H
                b_w = tl.load(p_w + o_e[:, None] * H + o_k[None, :],
                              mask=m_e[:, None] & m_k[None, :], other=0.0).to(tl.float32)
                b_x = tl.load(p_x + i_m * H + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_acc += b_w * b_x[None, :]
            tl.store(p_part + (i_k * M + i_m) * E + o_e, tl.sum(b_acc, axis=1), mask=m_e)


@triton.jit
def _gate_gemv_kernel(p_x, p_w, p_part, M, E, H,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """gate_logits: the split-K GEMV alone, grid (E tiles, K splits)."""
    _gemv_partials(p_x, p_w, p_part, tl.program_id(0), tl.program_id(1), M, E, H,
                   BLOCK_E, BLOCK_K)


@triton.jit
def _token_keys(p_part, p_bias, o_t, m_t, M,
                E: tl.constexpr, SPLIT_K: tl.constexpr, N_GROUP: tl.constexpr,
                TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, SCALAR_E: tl.constexpr = False):
    """Tokens o_t [BLOCK_T] (valid where m_t): packed selection keys, int64 [BLOCK_T, BLOCK_E],
    and unbiased scores s = sigmoid(logit), fp32 [BLOCK_T, BLOCK_E].

    key = (order-preserving int32 image of the biased score sb) << 32 | (IDX_BITS - expert):
    unique per token, larger key = larger sb, among equal sb the lower expert. Experts outside
    the kept groups (n_group > 1), padding lanes (expert >= E) and padding tokens get sb = -inf.
    SCALAR_E (SELECT_SCALAR_KEYS): the expert axis is declared non-contiguous, so the loads are
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
def _load_candidates(p_cand, o_t, m_t, CAP: tl.constexpr, CACHE: tl.constexpr = ".cg"):
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
                     CAP: tl.constexpr, CAND_CACHE: tl.constexpr = ".cg"):
    """Top-k of keys int64 [BLOCK_T, BLOCK_E] in a fixed number of reductions, not TOP_K.

    1. bucket maxima: bucket b holds the experts e = b (mod BUCKETS), BUCKETS >= TOP_K;
       the threshold T is the TOP_K-th largest bucket maximum (rank by a pairwise count).
       Every top-k key is >= T (TOP_K buckets have a key >= T), and usually only a few more.
       Strided, not runs of consecutive experts (whose maxima would be warp-local, saving one
       cross-warp reduction): equal scores go to the lower experts, which then spread over
       the buckets (all-equal scores: exactly TOP_K candidates, not hundreds), and the routing
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
                   CAP: tl.constexpr, CAND_CACHE: tl.constexpr = ".cg",
                   SCALAR_E: tl.constexpr = False):
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


@triton.jit
def _store_entries(p_sorted_ids, p_sorted_w, p_block_ids, b_e, o_n, b_w, b_rank, b_before, m_n,
                   BM: tl.constexpr):
    """Scatter entries to position BM * (tiles of lower experts) + rank; an entry whose rank is
    a multiple of BM opens a tile and writes its expert id. Returns the tile-opening mask."""
    b_pos = b_before * BM + b_rank
    tl.store(p_sorted_ids + b_pos, o_n, mask=m_n)
    tl.store(p_sorted_w + b_pos, b_w, mask=m_n)
    m_open = m_n & (b_rank % BM == 0)
    tl.store(p_block_ids + b_pos // BM, b_e, mask=m_open)
    return m_open


@triton.jit
def _select_sort(
        p_part, p_bias, p_cand, p_ids, p_w, p_sorted_ids, p_sorted_w, p_block_ids, p_num_valid,
        p_rank, M, scaling,
        E: tl.constexpr, SPLIT_K: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, RENORMALIZE: tl.constexpr,
        BM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr, BUCKETS: tl.constexpr, CAP: tl.constexpr, IN_REGS: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TAIL_STAGE: tl.constexpr,
        CAND_CACHE: tl.constexpr = ".cg", SCALAR_E: tl.constexpr = False):
    """One program: selection of all M tokens from the summed partials, then the whole sort
    metadata (the plan's padding is already in place). TAIL_STAGE < 3: see the module constant."""
    if TAIL_STAGE == 1:  # keys only; their max keeps them live
        o_t = tl.arange(0, BLOCK_T)
        b_key = _token_keys(p_part, p_bias, o_t, o_t < M, M, E, SPLIT_K, N_GROUP, TOPK_GROUP,
                            GROUP_SIZE, BLOCK_T, BLOCK_E, BLOCK_G, SCALAR_E)[0]
        tl.store(p_num_valid, (tl.max(tl.max(b_key, axis=1), axis=0) & 0xFFFF).to(tl.int32))
    elif TAIL_STAGE == 2:
        for t0 in range(0, M, BLOCK_T):
            _select_tokens(p_part, p_bias, p_cand, p_ids, p_w, t0, M, scaling, E, SPLIT_K,
                           TOP_K, N_GROUP, TOPK_GROUP, GROUP_SIZE, RENORMALIZE, BLOCK_T, BLOCK_E,
                           BLOCK_G, BLOCK_S, BUCKETS, CAP, CAND_CACHE, SCALAR_E)
    elif IN_REGS:
        # all tokens fit one selection block: the sort works on the registers directly
        b_ids, b_w, o_ts, m_ts = _select_tokens(
            p_part, p_bias, p_cand, p_ids, p_w, 0, M, scaling, E, SPLIT_K, TOP_K, N_GROUP,
            TOPK_GROUP, GROUP_SIZE, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_G, BLOCK_S, BUCKETS, CAP,
            CAND_CACHE, SCALAR_E)
        b_e = tl.reshape(b_ids, [BLOCK_T * BLOCK_S])
        o_n = tl.reshape(o_ts, [BLOCK_T * BLOCK_S])
        m_n = tl.reshape(m_ts, [BLOCK_T * BLOCK_S])
        b_wn = tl.reshape(b_w, [BLOCK_T * BLOCK_S])
        if BLOCK_T == 1:  # M = 1: a token's experts are distinct, each opens its own tile
            b_rank = tl.zeros_like(b_e)
            b_lower = (b_e[None, :] < b_e[:, None]) & m_n[None, :]
            b_before = tl.sum(b_lower.to(tl.int32), axis=1)
            _store_entries(p_sorted_ids, p_sorted_w, p_block_ids, b_e, o_n, b_wn, b_rank,
                           b_before, m_n, BM)
            tl.store(p_num_valid, TOP_K * BM)
        else:
            b_same = ((b_e[None, :] == b_e[:, None]) & (o_n[None, :] < o_n[:, None])
                      & m_n[None, :])
            b_rank = tl.sum(b_same.to(tl.int32), axis=1)
            m_open = m_n & (b_rank % BM == 0)
            b_lower = (b_e[None, :] < b_e[:, None]) & m_open[None, :]
            b_before = tl.sum(b_lower.to(tl.int32), axis=1)
            m_open = _store_entries(p_sorted_ids, p_sorted_w, p_block_ids, b_e, o_n, b_wn,
                                    b_rank, b_before, m_n, BM)
            tl.store(p_num_valid, tl.sum(m_open.to(tl.int32), axis=0) * BM)
    else:
        for t0 in range(0, M, BLOCK_T):
            _select_tokens(p_part, p_bias, p_cand, p_ids, p_w, t0, M, scaling, E, SPLIT_K,
                           TOP_K, N_GROUP, TOPK_GROUP, GROUP_SIZE, RENORMALIZE, BLOCK_T, BLOCK_E,
                           BLOCK_G, BLOCK_S, BUCKETS, CAP, CAND_CACHE, SCALAR_E)
        tl.debug_barrier()  # the passes below read topk_ids written by other threads

        # pass 1: rank of each entry within its expert (earlier entries of the same expert)
        N = M * TOP_K
        for r0 in range(0, N, BLOCK_R):
            o_r = r0 + tl.arange(0, BLOCK_R)
            m_r = o_r < N
            b_er = tl.load(p_ids + o_r, mask=m_r, other=-1)
            b_rank = tl.zeros([BLOCK_R], tl.int32)
            for c0 in range(0, r0 + BLOCK_R, BLOCK_C):
                o_c = c0 + tl.arange(0, BLOCK_C)
                b_ec = tl.load(p_ids + o_c, mask=o_c < N, other=-2)
                b_same = (b_ec[None, :] == b_er[:, None]) & (o_c[None, :] < o_r[:, None])
                b_rank += tl.sum(b_same.to(tl.int32), axis=1)
            tl.store(p_rank + o_r, b_rank, mask=m_r)
        tl.debug_barrier()

        # pass 2: tiles opened by lower experts, then scatter
        b_tiles = tl.zeros([BLOCK_R], tl.int32)
        for r0 in range(0, N, BLOCK_R):
            o_r = r0 + tl.arange(0, BLOCK_R)
            m_r = o_r < N
            b_er = tl.load(p_ids + o_r, mask=m_r, other=-1)
            b_rank = tl.load(p_rank + o_r, mask=m_r, other=1)
            b_before = tl.zeros([BLOCK_R], tl.int32)
            for c0 in range(0, N, BLOCK_C):
                o_c = c0 + tl.arange(0, BLOCK_C)
                m_c = o_c < N
                b_ec = tl.load(p_ids + o_c, mask=m_c, other=E)
                m_open_c = m_c & (tl.load(p_rank + o_c, mask=m_c, other=1) % BM == 0)
                b_lower = (b_ec[None, :] < b_er[:, None]) & m_open_c[None, :]
                b_before += tl.sum(b_lower.to(tl.int32), axis=1)
            b_wr = tl.load(p_w + o_r, mask=m_r, other=0.0)
            m_open = _store_entries(p_sorted_ids, p_sorted_w, p_block_ids, b_er, o_r, b_wr,
                                    b_rank, b_before, m_r, BM)
            b_tiles += m_open.to(tl.int32)
        tl.store(p_num_valid, tl.sum(b_tiles, axis=0) * BM)


@triton.jit
def _route_sort_kernel(
        p_x, p_w, p_bias, p_part, p_cand, p_rank, p_count, p_ids, p_topk_w, p_sorted_ids,
        p_sorted_w, p_block_ids, p_num_valid, p_out, M, H, n_sorted, n_blocks, n_out, scaling,
        E: tl.constexpr, SPLIT_K: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, RENORMALIZE: tl.constexpr,
        BM: tl.constexpr, GEMV_E: tl.constexpr, GEMV_K: tl.constexpr, FILL: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr, BUCKETS: tl.constexpr, CAP: tl.constexpr,
        IN_REGS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
        TAIL_STAGE: tl.constexpr, GEMV_ROWS: tl.constexpr = 0, GEMV_CHUNKS: tl.constexpr = 1,
        CAND_CACHE: tl.constexpr = ".cg",
        SCALAR_E: tl.constexpr = False):
    i_e, i_k = tl.program_id(0), tl.program_id(1)
    _gemv_partials(p_x, p_w, p_part, i_e, i_k, M, E, H, GEMV_E, GEMV_K, GEMV_ROWS, GEMV_CHUNKS)

    # side job: the plan's padding and the zeroed stage-2 buffer (before the counter below, so
    # the selection's scatter lands after every fill)
    pid = i_k * tl.num_programs(0) + i_e
    n_prog = tl.num_programs(0) * tl.num_programs(1)
    _fill(p_sorted_ids, n_sorted, tl.zeros([FILL], tl.int32) + M * TOP_K, pid, n_prog, FILL)
    _fill(p_sorted_w, n_sorted, tl.zeros([FILL], tl.float32), pid, n_prog, FILL)
    _fill(p_block_ids, n_blocks, tl.zeros([FILL], tl.int32) - 1, pid, n_prog, FILL)
    _fill(p_out, n_out, tl.zeros([FILL], tl.float32), pid, n_prog, FILL)

    # the last program to get here does the selection: the barrier orders this program's
    # stores (all threads) before its one scalar atomic, whose release publishes them at gpu
    # scope; the last program's acquire sees every program's partials and fills
    if TAIL_STAGE >= 0:  # (-1: measurement only, no counter, no selection)
        tl.debug_barrier()
        if tl.atomic_add(p_count, 1, sem="acq_rel", scope="gpu") == n_prog - 1:
            if TAIL_STAGE > 0:
                _select_sort(p_part, p_bias, p_cand, p_ids, p_topk_w, p_sorted_ids, p_sorted_w,
                             p_block_ids, p_num_valid, p_rank, M, scaling, E, SPLIT_K, TOP_K,
                             N_GROUP, TOPK_GROUP, GROUP_SIZE, RENORMALIZE, BM, BLOCK_T, BLOCK_E,
                             BLOCK_G, BLOCK_S, BUCKETS, CAP, IN_REGS, BLOCK_R, BLOCK_C, TAIL_STAGE,
                             CAND_CACHE, SCALAR_E)
            # ready for the next launch: every other program has already incremented (that is how
            # this one got here) and the next launch starts after this one ends, so the reset needs
            # no ordering: relaxed (no release fence waiting for the tail's stores)
            tl.atomic_xchg(p_count, 0, sem="relaxed", scope="gpu")


def _check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}: expected {rng}, got {value}")
    return value


def _gemv_blocks(E: int, H: int, on_gpu: bool, block_e: int | None,
                 block_k: int | None) -> tuple[int, int]:
    if not on_gpu:
        be = block_e or min(triton.next_power_of_2(E), INTERP_BLOCK_E)
        return be, block_k or min(triton.next_power_of_2(H), INTERP_BLOCK_K)
    be = block_e or GEMV_BLOCK_E
    if block_k:
        return be, block_k
    for bk in GEMV_BLOCK_K:
        if triton.cdiv(E, be) * triton.cdiv(H, bk) >= GEMV_MIN_PROGRAMS:
            return be, bk
    return be, GEMV_BLOCK_K[-1]


def _gemv_rows(E: int, H: int, on_gpu: bool) -> tuple[int, int, int, int, int] | None:
    """Row programs (GEMV_ROW_PROGRAMS > 0): (rows a program, BLOCK_E, BLOCK_K, chunks a
    program, K splits); None when off (the split-K tiles of _gemv_blocks)."""
    if GEMV_ROW_PROGRAMS <= 0:
        return None
    rows = triton.cdiv(E, GEMV_ROW_PROGRAMS)
    block_k = min(GEMV_ROW_CHUNK if on_gpu else INTERP_BLOCK_K, triton.next_power_of_2(H))
    splits = max(1, min(GEMV_ROW_SPLITS, triton.cdiv(H, block_k)))
    chunks = triton.cdiv(triton.cdiv(H, block_k), splits)
    return rows, triton.next_power_of_2(rows), block_k, chunks, triton.cdiv(H, chunks * block_k)


def _select_tiles(E: int, M: int, top_k: int) -> dict[str, int | bool]:
    """The selection program's tile constexprs (see _select_sort / _top_k_threshold):
    BLOCK_T tokens x BLOCK_E (padded) experts at once, BLOCK_S (padded) slots, BUCKETS and
    CAP of the threshold selection (BUCKETS = 0: the arg-max loop), IN_REGS (all entries sorted
    in registers) and the memory sort passes' BLOCK_R x BLOCK_C."""
    n = M * top_k
    block_ex = triton.next_power_of_2(E)
    block_t = min(triton.next_power_of_2(M), max(1, SELECT_TILE // block_ex))
    block_s = triton.next_power_of_2(top_k)
    buckets = BUCKETS_PER_SLOT * block_s
    use_threshold = (top_k >= THRESHOLD_MIN_TOP_K and buckets * MIN_BUCKET_SIZE <= block_ex
                     and block_ex >= THRESHOLD_MIN_EXPERTS)
    block_c = min(triton.next_power_of_2(n), PAIR_COLS)
    return dict(BLOCK_T=block_t, BLOCK_E=block_ex, BLOCK_S=block_s,
                BUCKETS=buckets if use_threshold else 0,
                CAP=min(CANDIDATES_PER_SLOT * block_s, block_ex) if use_threshold else 1,
                IN_REGS=block_t >= M and block_t * block_s <= REG_ENTRIES,
                BLOCK_R=max(1, min(triton.next_power_of_2(n), PAIR_TILE // block_c)),
                BLOCK_C=block_c)


def _bucket_of(E: int, M: int, top_k: int) -> torch.Tensor | None:
    """int64 [E]: the threshold selection's bucket of every expert (see _top_k_threshold), or
    None when the arg-max loop selects (tests use it to aim at the fast path or the fallback)."""
    buckets = _select_tiles(E, M, top_k)["BUCKETS"]
    return torch.arange(E) % buckets if buckets else None


def _check_gate_inputs(hidden, gate_weight, correction_bias=None):
    """Validate the router's inputs; returns (M, H, E)."""
    named = [("hidden", hidden), ("gate_weight", gate_weight)]
    if correction_bias is not None:
        named.append(("correction_bias", correction_bias))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
    if hidden.dim() != 2 or hidden.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"hidden: expected [M, H] bf16 or fp32, got {tuple(hidden.shape)} "
                         f"{hidden.dtype}")
    M, H = hidden.shape
    if not 1 <= M <= MAX_TOKENS:
        raise ValueError(f"hidden: expected 1 <= M <= {MAX_TOKENS} tokens, got M={M}")
    if gate_weight.dim() != 2 or gate_weight.shape[1] != H or gate_weight.dtype not in (
            torch.bfloat16, torch.float32):
        raise ValueError(f"gate_weight: expected [E, {H}] bf16 or fp32, got "
                         f"{tuple(gate_weight.shape)} {gate_weight.dtype}")
    E = gate_weight.shape[0]
    if correction_bias is not None and (correction_bias.shape != (E,)
                                        or correction_bias.dtype != torch.float32):
        raise ValueError(f"correction_bias: expected [{E}] fp32, got "
                         f"{tuple(correction_bias.shape)} {correction_bias.dtype}")
    dev = hidden.device
    for name, t in named[1:]:
        if t.device != dev:
            raise ValueError(f"{name}: expected device {dev} (that of hidden), got {t.device}")
    if dev.type == "cpu":
        import os
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("hidden: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1"
                             " before importing triton; see k3lab.device.use_device)")
    elif dev.type != "cuda":
        raise ValueError(f"hidden: expected a cuda (or interpreted cpu) tensor, got {dev}")
    return M, H, E


def _check_blocks(gemv_block_e, gemv_block_k) -> None:
    for name, b in (("gemv_block_e", gemv_block_e), ("gemv_block_k", gemv_block_k)):
        if b is not None and (_check_int(name, b, 1) & (b - 1)):
            raise ValueError(f"{name}: expected a power of two, got {b}")


def gate_logits(hidden: torch.Tensor, gate_weight: torch.Tensor, *,
                gemv_block_e: int | None = None, gemv_block_k: int | None = None
                ) -> torch.Tensor:
    """The router's gate projection alone (the "B1 gate projection" change): FP32 logits
    fp32 [M, E] = fp32(hidden [M, H]) @ fp32(gate_weight [E, H])^T, by the route boundary's
    split-K GEMV (step 1 of :func:`route_sort`, without its plan side job or the selection) and a
    fixed-order sum of the K-split partials (one more launch when H spans several K tiles)."""
    M, H, E = _check_gate_inputs(hidden, gate_weight)
    _check_blocks(gemv_block_e, gemv_block_k)
    dev = hidden.device
    block_e, block_k = _gemv_blocks(E, H, dev.type == "cuda", gemv_block_e, gemv_block_k)
    split_k = triton.cdiv(H, block_k)
    partial = torch.empty(split_k, M, E, dtype=torch.float32, device=dev)
    _gate_gemv_kernel[(triton.cdiv(E, block_e), split_k)](
        hidden, gate_weight, partial, M, E, H, BLOCK_E=block_e, BLOCK_K=block_k,
        num_warps=NUM_WARPS)
    return partial[0] if split_k == 1 else partial.sum(0)


def _capturing(dev: torch.device) -> bool:
    """Whether the current stream of ``dev`` is capturing a CUDA graph."""
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _counter(dev: torch.device) -> torch.Tensor:
    """The device's zeroed completion counter, created by the first call outside a capture."""
    counter = _COUNTERS.get(dev)
    if counter is None:
        if _capturing(dev):
            raise ValueError(
                f"hidden: route_sort's completion counter on {dev} does not exist yet and "
                "cannot be created inside a CUDA-graph capture; call route_sort once on this "
                "device before capturing")
        counter = _COUNTERS[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
    return counter


def route_sort(hidden: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor,
               *, top_k: int, n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
               routed_scaling_factor: float = 1.0, block_m: int = 1, out_dim: int | None = None,
               gemv_block_e: int | None = None, gemv_block_k: int | None = None) -> RoutePlan:
    """Route M tokens and build the MoE sort metadata in one launch (no host sync).

    The launch's last program to finish its GEMV tile does the selection and the sort; it
    finds out through a per-device int32 counter that every call on the device shares (see the
    module docstring). So: calls on one device must not run concurrently on different streams,
    and the first call on a device creates the counter and must not be inside a CUDA-graph
    capture (a ValueError says so; warm up first, as any capture does).

    Args:
        hidden: [M, H] bf16 or fp32, contiguous, 1 <= M <= MAX_TOKENS.
        gate_weight: [E, H] bf16 or fp32, contiguous, same device.
        correction_bias: [E] fp32.
        top_k: experts per token, 1 <= top_k <= E (and within the kept groups).
        n_group, topk_group: grouped routing; n_group divides E with >= 2 experts per group,
            1 <= topk_group <= n_group.
        renormalize, routed_scaling_factor: weight normalization and scale.
        block_m: tile height the sorted runs are padded to (>= 1).
        out_dim: when given, ``out`` is a zeroed fp32 [M, out_dim].
        gemv_block_e, gemv_block_k: tuning overrides of the gate GEMV tile (powers of two;
            either one selects the split-K tiles even with GEMV_ROW_PROGRAMS on).

    Returns:
        RoutePlan with topk_ids int32 [M, top_k], topk_weights fp32 [M, top_k], sorted_ids int32
        [cap], sorted_weights fp32 [cap], block_expert_ids int32 [cap // block_m], num_valid
        int32 [1], out fp32 [M, out_dim] or None; cap = M * top_k + E * (block_m - 1).
    """
    M, H, E = _check_gate_inputs(hidden, gate_weight, correction_bias)
    dev = hidden.device
    _check_int("n_group", n_group, 1)
    if E % n_group:
        raise ValueError(f"n_group: {n_group} does not divide the expert count E={E}")
    if n_group > 1 and E // n_group < 2:
        raise ValueError(f"n_group: groups need >= 2 experts (top-2 group score), got "
                         f"E / n_group = {E // n_group}")
    _check_int("topk_group", topk_group, 1, n_group)
    kept = E if n_group == 1 else topk_group * (E // n_group)
    _check_int("top_k", top_k, 1, kept)
    _check_int("block_m", block_m, 1)
    if out_dim is not None:
        _check_int("out_dim", out_dim, 1)
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor,
                                                                 (int, float)):
        raise ValueError(f"routed_scaling_factor: expected a float, got "
                         f"{type(routed_scaling_factor).__name__}")
    _check_blocks(gemv_block_e, gemv_block_k)

    counter = _counter(dev)

    row_mode = _gemv_rows(E, H, dev.type == "cuda") if M <= GEMV_ROW_MAX_TOKENS else None
    if row_mode is None or gemv_block_e or gemv_block_k:
        block_e, block_k = _gemv_blocks(E, H, dev.type == "cuda", gemv_block_e, gemv_block_k)
        rows, chunks, split_k, e_tiles = 0, 1, triton.cdiv(H, block_k), triton.cdiv(E, block_e)
    else:
        rows, block_e, block_k, chunks, split_k = row_mode
        e_tiles = triton.cdiv(E, rows)
    n = M * top_k
    cap = plan_capacity(M, top_k, E, block_m)
    tiles = _select_tiles(E, M, top_k)
    f32, i32 = torch.float32, torch.int32
    partial = torch.empty(split_k, M, E, dtype=f32, device=dev)
    rank = torch.empty(n, dtype=i32, device=dev)
    # the threshold selection's candidate rows (keys, payloads, count), see _top_k_threshold
    cand = (torch.empty(M, 2 * tiles["CAP"] + 1, dtype=torch.int64, device=dev)
            if tiles["BUCKETS"] else rank)
    topk_ids = torch.empty(M, top_k, dtype=i32, device=dev)
    topk_weights = torch.empty(M, top_k, dtype=f32, device=dev)
    sorted_ids = torch.empty(cap, dtype=i32, device=dev)
    sorted_weights = torch.empty(cap, dtype=f32, device=dev)
    block_expert_ids = torch.empty(cap // block_m, dtype=i32, device=dev)
    num_valid = torch.empty(1, dtype=i32, device=dev)
    out = None if out_dim is None else torch.empty(M, out_dim, dtype=f32, device=dev)

    _route_sort_kernel[(e_tiles, split_k)](
        hidden, gate_weight, correction_bias, partial, cand, rank, counter, topk_ids,
        topk_weights, sorted_ids, sorted_weights, block_expert_ids, num_valid,
        partial if out is None else out, M, H, cap, cap // block_m,
        0 if out is None else out.numel(), float(routed_scaling_factor),
        E=E, SPLIT_K=split_k, TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group,
        GROUP_SIZE=E // n_group, RENORMALIZE=bool(renormalize), BM=block_m,
        GEMV_E=block_e, GEMV_K=block_k, FILL=FILL_BLOCK,
        BLOCK_G=triton.next_power_of_2(n_group), **tiles, TAIL_STAGE=TAIL_STAGE,
        GEMV_ROWS=rows, GEMV_CHUNKS=chunks, CAND_CACHE=CAND_CACHE,
        SCALAR_E=SELECT_SCALAR_KEYS, num_warps=NUM_WARPS)

    return RoutePlan(topk_ids=topk_ids, topk_weights=topk_weights, sorted_ids=sorted_ids,
                     sorted_weights=sorted_weights, block_expert_ids=block_expert_ids,
                     num_valid=num_valid, out=out, block_m=block_m)
