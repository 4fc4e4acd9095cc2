"""Latent MoE at batch 1 (ARCHITECTURE.md sections 4-5): three launches after routing.

```
front : z = x @ W_down^T            (and shared a_s = act(x @ Ws1^T, x @ Ws3^T), same launch)
stage1: a[t*K+k] = act(z[t] @ W1[e]^T, z[t] @ W3[e]^T)     e = topk_ids[t, k]   ("direct tile")
stage2: y[t] += w[t,k] * (a[t*K+k] @ W2[e]^T)               fp32 atomics into plan.out
tail  : out = rsqrt(mean(y^2) + eps) * ((y * g_norm) @ W_up^T) + a_s @ Ws2^T   (or + shared)
```
act = SiTU(g, u) = beta*tanh(g/beta)*sigmoid(g)*(lb*tanh(u/lb)) or SiLU(g)*u, in fp32, with
tanh(x) = 2*sigmoid(2x) - 1. Every product is a GEMV (broadcast multiply + tl.sum, fp32
accumulation); each program owns one output tile and reads its weight rows exactly once.

bf16 operands are read as int32 (even, odd) element pairs (even element in the low half-word:
a shift and a mask give both fp32 values). MXFP4 weights are read as int32 words of 8 E2M1 codes
and decoded in registers with 3 integer ops per element (shift the nibble to the top, arithmetic
shift right, mask: the signed fp32 bits of 2^-126 * value), one FMA each, and the E8M0 factor
2^(s-127) applied once per group of 32; the activations stay bf16 pairs.
Plan tiles of one token (B1: stage 1 and the atomic stage 2) take the tensor-core tiles of
kernels/mxfp4_mma.py instead (FP4_MMA): codes decoded to bf16x2 and multiplied by
``mma.sync.m16n8k16``, x spread over the K step's groups so each group's factor applies once.

Stages 1 and 2 consume the route plan as is (no second top-k or sort): programs walk the
expert-sorted ``sorted_ids`` in tiles of ``block_m`` entries of one expert, so tokens sharing an
expert read its weights once per tile. Stage 1 also zeroes ``plan.out`` (stage 2's accumulator)
so stage 1 + stage 2 can be replayed on one plan. ``deterministic=True`` makes stage 2 sum each
token's top_k slots in slot order inside one program instead (same single launch, no atomics).

``moe_block`` launches front, stage 1, then stage 2 and the tail in ONE grid (``fuse_tail=True``,
the default; route_sort's launch(es) come before): each program takes a ticket from an atomic
counter; tickets below the stage-2 tile count run stage-2 tiles and then count themselves done
(release, after a CTA barrier), the rest run tail tiles, which do the shared down GEMV, wait
until every stage-2 tile is done (acquire, then a CTA barrier) and finish the tail. A ticket is
taken by a running program, so every tile a tail tile waits for is already running: no deadlock
under any scheduling. Stage 1 zeroes the two counters (program 0) and stage 2's accumulator, so
every call and every CUDA-graph replay starts from zero. ``fuse_tail=False`` launches stage 2 and
the tail separately (one launch more, no cross-program waiting).

Programmatic dependent launch (PDL_STEPS): stage 1 (after the front), and stage 2 and the tail
when apart, may start while the previous launch's last wave runs; they read only the plan (and
the tail its shared-expert input), written two or more launches earlier, before
``griddepcontrol.wait``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .mxfp4 import MXFP4, mxfp4_layout, mxfp4_tiled_ok
from .mxfp4_mma import (
    MMA_WARPS,
    fp4_mma_gemv,
    mma_layout_problem,
    prefetch_l2,
    store_prepared_x,
    tiled_word_offset,
)
from .plan import RoutePlan

__all__ = ["MAX_TOKENS", "latent_down", "moe_stage1", "moe_stage2", "latent_moe_tail",
           "moe_block", "moe_kernel_weights"]

# Decode-batch kernels: a GEMV tile serves its M tokens one after the other from registers, so the
# work per weight byte grows with M; beyond a few tokens a tensor-core grouped GEMM wins.
MAX_TOKENS = 16
ACT_CODES = {"situ": 0, "silu": 1}
MXFP4_GROUP = 32
# Enough programs for HBM to see many loads in flight: about 4 resident programs per SM of a
# 132-SM H200. Under the interpreter programs run one by
# one in Python, so fewer, bigger tiles are faster (INTERPRETER_BIG_TILES; tests may turn it off
# to run the GPU tiling on CPU).
TARGET_PROGRAMS = 528
INTERPRETER_TARGET_PROGRAMS = 4
INTERPRETER_BIG_TILES = True
# Rows of weights per program: at least 4 (so a program's loads are not all latency), at most 64
# for bf16 and 32 for MXFP4. H200, K3 tp 1, stages 1 and 2 (graph, cold): bf16 64-row x 64-pair
# tiles at 4 warps read the experts at 1.04 / 1.01 of the copy bandwidth, 32-row x 128-pair tiles
# at 0.47; MXFP4 was best at 32 rows (0.31 / 0.33; 64 rows 0.28 / 0.24). At tp 8 the program
# target keeps the tiles smaller anyway.
MIN_ROWS, MAX_ROWS, MAX_ROWS_FP4, INTERPRETER_MAX_ROWS = 4, 64, 32, 128
# The front (latent down + shared gate/up of x) aims at twice the programs: on the H200 at K3 tp 8
# it was 1.36x faster than at 528 (and then 1.36x faster than the grouped cuBLAS peer).
FRONT_TARGET_PROGRAMS = 1056
# Broadcast products per K step (M x rows x pairs): 4096 = 32 fp32 registers per thread at
# 4 warps, i.e. the product tile stays in registers; the interpreter vectorizes far larger ones.
PRODUCT_BUDGET, INTERPRETER_PRODUCT_BUDGET = 4096, 1 << 17
MIN_PAIRS, MAX_PAIRS = 16, 512
# An MXFP4 K step holds words and per-group partial sums (N x pairs / 2 registers) instead of the
# bf16 path's even and odd fp32 planes (2 N x pairs): 4x the pairs fit, so as many bytes per step.
FP4_BUDGET_FACTOR = 4
NUM_WARPS = 4
ZERO_MIN_BLOCK = 16
# MXFP4 decode (see _fp4_dot): an E2M1 nibble shifted to bits 28..31 then arithmetic-shifted right
# by 6 leaves its sign in bit 31 and its 3 magnitude bits in fp32 bits 22..24: masked, that is the
# fp32 2^-126 * value (e = 0 gives the denormal m * 2^-127). x is pre-scaled by 2^64 so no product
# is denormal; the group factor 2^(s-127) * 2^126 * 2^-64 = 2^(s-65) has fp32 exponent s + 62.
FP4_SIGN_MAG = tl.constexpr(0x81C00000 - (1 << 32))  # bits 31 and 22..24 as an int32
# MXFP4 tile layouts (module switches, read at launch; benchmarks/next/MOE_MXFP4_ANALYSIS.md):
# FP4_LAYOUT 0: [rows, groups, 4 words] tiles; Triton gives them lanes along the rows
#   (a warp's 16-byte loads hit 32 rows), x is re-broadcast through shared memory for every pair
#   index (20 barriers a K step) and every K step ends in a cross-warp reduction.
# FP4_LAYOUT 1 (default): [rows, FP4_KLANE_WORDS words] tiles, a row's words contiguous across
#   the lanes (16-byte loads, a warp reads 256-512 contiguous bytes of a row), x [words] per pair
#   index (fewer elements than threads: Triton loads it in the tile's layout, no shared memory),
#   products accumulated by FFMA chains per (row, group) over all K steps, the E8M0 factor per
#   group and step, and one cross-lane reduction per tile at the end (M = 1).
#   H200 (session 4, benchmarks/next/moe_sweep.py; K3 tp 1, B1, graph, cold; fraction of copy
#   bandwidth on the expert bytes, stage 1 / stage 2): layout 0 0.309 / 0.331; layout 1 at
#   64 rows x 64 words 0.515 / 0.531 (the best of eight K-lane shapes); tp 8 stage 2 14.6 ->
#   10.4 us, stage 1 unchanged (26.8 / 26.9 us).
FP4_LAYOUT = 1
FP4_KLANE_WORDS = 64
FP4_KLANE_ROWS = 64
# FP4_KLANE_PREFETCH (layout 1): register double buffering, each K step's loads issued before
# the previous step's arithmetic (Triton does not pipeline loads that feed no dot).
FP4_KLANE_PREFETCH = False
# Session-4 switches (issue 4, benchmarks/h200_session4/moe_sweep.py, H200 call 3, K3 B1, graph,
# cold, stage 1 / stage 2 us): the default is FP4_FUSE_GATE_UP with a 3-stage stage-1 K loop:
# tp 8 stage 1 27.07 -> 16.19 us (stage 2 unchanged, 10.4 us); tp 1 stage 1 87.4 -> 87.9 us
# (0.505 of copy bandwidth). The fastest stage 1 at tp 1 was FP4_FUSE_GATE_UP with FP4_MAXNREG
# 128 and no pipelining (80.6 us, 0.551; 20.5 us at tp 8); pipelining stage 2 or splitting its
# K was slower at tp 1 (43.1-56.1 vs 42.5 us).
# FP4_KLANE_STAGES n > 0 (layout 1): the K loop as tl.range(num_stages=n), which makes Triton's
#   pipeliner stage the weight / scale loads through shared memory (cp.async, n - 1 steps ahead)
#   without holding them in registers: more bytes in flight per SM at the same occupancy.
# FP4_FUSE_GATE_UP (layout 1, stage 1): one K loop over a tile of FP4_KLANE_ROWS interleaved
#   gate / up rows (half as many of each) instead of two loops of FP4_KLANE_ROWS rows: the same
#   rows per thread (x reuse, registers) at twice the programs (K3 tp 1: 768 -> 1536, 1.45 ->
#   2.9 waves of 4 programs an SM, so a smaller last partial wave).
# FP4_STAGE2_KSPLIT s (layout 1, stage 2 atomic path): each tile's K steps split over s programs
#   whose partial sums meet in the fp32 atomic adds already there (s x the programs).
# FP4_MAXNREG r (layout 1, compiled only): the expert launches' register cap (Triton's maxnreg),
#   e.g. 128 = 4 programs of 4 warps an SM where the pipelined / split loops take more.
# FP4_KLANE_STAGES and FP4_MAXNREG may also be (stage 1, stage 2) pairs.
FP4_KLANE_STAGES = (3, 0)
FP4_FUSE_GATE_UP = True
FP4_STAGE2_KSPLIT = 1
FP4_MAXNREG = None
FP4_X_SCALE = tl.constexpr(2.0 ** 64)
FP4_SCALE_BIAS = tl.constexpr(62)
# FP4_MMA (one token a tile: B1 stage 1 and the atomic stage 2): the tensor-core tiles of
#   kernels/mxfp4_mma.py instead of K-lane tiles: codes decoded to bf16x2 A fragments of
#   mma.sync.m16n8k16, x spread over the step's 8 groups as B, each group's E8M0 factor on D.
#   K loop about 3.0 instructions an element (K-lane: 4.8; session 5's f16x2 K-lane variant,
#   FP4_F16_PAIRS, reached 4.1 and was removed: these tiles are faster on the same one-token
#   tiles and sum in fp32). Tried on the H200 and dropped (benchmarks/session7/README.md):
#   Triton pipelining of the K loop, two mma accumulator chains, persistent runs of tiles.
#   A tile is (R 16-row tiles a warp, WARPS_K warps splitting K, L2
#   prefetch distance); stage 1's R is 2 (its gate and up tiles). FP4_MMA_TILES: None picks
#   per stage the largest tile of FP4_MMA_CANDIDATES that still launches TARGET_PROGRAMS
#   programs (else the smallest), or {stage: tile} fixes them. H200 (K3 B1, graph, cold): at
#   tp 1 stage 1 (2, 2) and stage 2 (2, 2), at tp 8 stage 1 (2, 4) and stage 2 (2, 2). Stage 1
#   was (2, 1) at tp 1 until session 9 (benchmarks/session9/README.md): with PLAN_ONE_TRIP its
#   (2, 2) tile compiles to 128 registers (4 programs an SM; 130 without) and measured 0.72 of
#   the copy bandwidth against 0.68-0.70.
#   Interpreter: the same tiles with the mma emulated.
#   The tiles' load pattern (a warp's 16-byte loads cover 64 bytes of each of 8 rows, as the
#   mma fragments ask) is itself a ceiling: load-only kernels over stage 2's weights (H200,
#   session 11 call 3) reach 0.83 of the copy bandwidth with it, 0.97 reading 256-512
#   contiguous bytes a row a load.
FP4_MMA = True
# Under the interpreter's big tiles (INTERPRETER_BIG_TILES) the lane-by-lane mma emulation runs
# one 64-128-row program at a time (a K3 tp 8 block: about a minute on CPU), so the one-token
# MXFP4 tiles take the K-lane path there unless INTERPRETER_MMA is set; with the GPU tiling
# (INTERPRETER_BIG_TILES off) the interpreter runs the tensor-core tiles as the GPU does.
INTERPRETER_MMA = False
FP4_MMA_TILES = None
FP4_MMA_CANDIDATES = {1: ((2, 2, 1), (2, 4, 1)), 2: ((2, 1, 1), (2, 2, 1), (2, 4, 1))}
_MMA_BASE = 4096  # FP4 constexpr codes at or above: tensor-core tiles (see _mma_mode)
FP4_MMA_BASE = tl.constexpr(_MMA_BASE)
# Prepared activations: the tensor-core tiles read x already permuted and scaled as
#   mxfp4_mma.mma_prepare_x writes it (X_PREPARED: no permute and scale a K step) when the
#   caller passes such a copy (moe_stage1's z_mma, moe_stage2's a_mma); the producers write it
#   beside their plain output (latent_down's z_mma_out, moe_stage1's a_mma_out), and moe_block
#   chains them. H200, session 8 (benchmarks/session8/README.md, K3 tp 1, graph, cold):
#   stage 1 +1.5 %, stage 2 +3 %. FP4_MMA_X_PREPARED False ignores the copies.
FP4_MMA_X_PREPARED = True
_MMA_XP = 8192  # the X_PREPARED bit of an FP4 code
MMA_XP_BIT = tl.constexpr(_MMA_XP)
# FP4_MMA_EVICT_FIRST (stage 1, stage 2): the tensor-core tiles load that stage's expert weights
#   with eviction_policy="evict_first" (PTX L1::evict_first and an L2 evict_first cache hint):
#   read once, they then leave L2 to what is read or added to again (x, and stage 2's fp32
#   accumulator, whose atomics L2 performs). H200, session 11 calls 4-5
#   (benchmarks/session11/README.md; K3 tp 1 B1, graph, cold, back to back, fraction of the copy
#   bandwidth): stage 2 with PDL 0.673-0.680 -> 0.696-0.726 (4 runs), without PDL 0.646-0.652
#   -> 0.668-0.694; stage 1 with PDL 0.719-0.723 -> 0.695-0.709 (so stage 1 keeps the default).
#   Call 7, in the 20_moe report's conditions (all 896 experts, 2 copies): stage 2 without PDL
#   0.642-0.667 -> 0.655-0.680, with PDL 0.659-0.703 -> 0.664-0.709 (bimodal either way).
FP4_MMA_EVICT_FIRST = (False, True)
_MMA_EVICT = 256  # the bit of an FP4 code (tensor-core tiles) for FP4_MMA_EVICT_FIRST
MMA_EVICT_BIT = tl.constexpr(_MMA_EVICT)
# MXFP4_TILED: moe_kernel_weights lays MXFP4 experts out in the tiled layout
#   (k3lab.kernels.mxfp4.mxfp4_tiled_codes) where the shapes allow (N a multiple of 16, K of 256).
#   Every kernel path reads either layout; the tensor-core tiles' loads then read 512
#   contiguous bytes a warp instead of 64 bytes of each of 8 rows (session 11 call 3: that
#   pattern alone reached 0.83 of the copy bandwidth in load-only kernels, contiguous reads
#   0.97). H200, session 12 calls 1-2 (benchmarks/session12/README.md; K3 tp 1 B1, graph,
#   cold, fraction of the copy bandwidth, the 20_moe report's conditions, PDL_STEPS 0, rows ->
#   tiled, 3 runs each a call): stage 1 0.665-0.720 -> 0.711-0.755 (every run faster), stage 2
#   0.649-0.683 -> 0.662-0.702. Stage 2's rows were bimodal, 0.662-0.676 or 0.700-0.710: the
#   timing graph held 2 calls or 32 (fixed in profile.time_variant at c2b3e41); 32-call graphs
#   of the tiled kernel gave 0.698-0.715 (138 replays, calls 10-13).
MXFP4_TILED = True
# PLAN_ONE_TRIP: the stage kernels' validity test also asks whether the tile's expert and an
#   entry are real (always so within the plan's count), so that the compiler loads them before
#   the branch, with the count: one round trip before the first weight load. Otherwise it sinks
#   them into the branch, behind the count's load (two). Stage 2's tensor-core tiles also fold
#   the router weight into the group factors, so that its load joins them instead of following
#   the K loop (a third round trip, before the atomics). Offline sm_90 SASS, Triton 3.6; H200
#   timing: benchmarks/session9 (volatile loads, tried first, kept the order too but were slower).
PLAN_ONE_TRIP = True
# Programmatic dependent launch (``pdl=True`` of the stage launchers; moe_block uses it where
#   it is safe): the compiled MXFP4 tensor-core stage kernels (stage 1, and stage 2 launched
#   without the tail) are launched so that their programs may start while the previous launch's
#   last wave runs. Each program reads the plan, asks L2 for the first PDL_STEPS K steps of its
#   tile's weight lines (and the rows' scales), and only then waits for the previous launch
#   (griddepcontrol.wait) and lets the next one start (launch_dependents). The plan is read
#   before the wait, so it must have been written at least two launches earlier. The tail
#   launched alone with pdl runs the shared experts' down GEMV (its input from the front
#   launch, three launches earlier) before its wait. None: no PDL anywhere.
#   H200, session 10 (benchmarks/session10/README.md; K3 tp 1 B1, graph, cold, fraction of the
#   copy bandwidth back to back, medians over calls 1, 2, 3, 9): stage 2 0.661 without PDL
#   (0.626-0.666, 10 runs), 0.674 with PDL_STEPS 0 (0.659-0.704, 8), 0.676 with 2; stage 1
#   0.699, 0.711, 0.727; PDL_STEPS 14 (the whole tile) 0.53-0.58. The prefetch lengthens the K
#   loop (offline sm_90: 725 -> 729 instructions, the loads later) and costs where programs do
#   not wait: stage 1 inside moe_block, after the front launch, 61-64 us with PDL_STEPS 0 and
#   without PDL, 67-69 us with 2 (call 8's graph timelines).
PDL_STEPS = 0
# Which of moe_block's launches take it: PDL_BLOCK_STAGE1 launches stage 1 with PDL after the
#   front launch, and PDL_FRONT_TRIGGER lets the front's programs let stage 1 go as they start
#   (so stage 1's programs start during the front's last wave); PDL_STAGE1_TRIGGER lets stage
#   1's programs, when stage 1 is launched without PDL, let the next launch go as they start.
#   Stage 2 and the tail take PDL when launched apart (fuse_tail=False): their programs start
#   about 17 us before the previous launch ends (call 8).
PDL_BLOCK_STAGE1 = True
PDL_FRONT_TRIGGER = True
PDL_STAGE1_TRIGGER = True
# A tail program waiting for stage 2 gives up after this many polls (seconds of spinning): a
# scheduling bug then shows as a wrong result in the tests instead of a hung GPU.
MAX_SPIN = tl.constexpr(1 << 24)


# ---------------------------------------------------------------------------------------------
# jit helpers


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    return 2.0 * _sigmoid(2.0 * x) - 1.0


@triton.jit
def _act(b_g, b_u, beta, linear_beta, ACT: tl.constexpr):
    """fp32 activation of gate and up tiles: SiTU (ACT 0) or SiLU(g) * u (ACT 1)."""
    b_sg = _sigmoid(b_g)
    if ACT == 0:
        b_a = beta * _tanh(b_g / beta) * b_sg * (linear_beta * _tanh(b_u / linear_beta))
    else:
        b_a = b_g * b_sg * b_u
    return b_a


@triton.jit
def _to_bf16(x):
    """fp32 -> bf16 rounded to nearest even, written out (the Triton interpreter truncates)."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _code_words(row, word, N_WORDS, TILED: tl.constexpr):
    """Offset of int32 word ``word`` (a multiple of 4: the first of a group's 4) of row ``row``
    of MXFP4 codes [N, N_WORDS] in the row layout, or the tiled one (TILED: see
    k3lab.kernels.mxfp4.mxfp4_tiled_codes), where a group's 4 words stay together."""
    if TILED:
        return tiled_word_offset(row, word, N_WORDS)
    return row * N_WORDS + word


@triton.jit
def _fp4_load(p_w, p_s, o_row, m_row, o_g, m_g, N_GROUPS, TILED: tl.constexpr = False):
    """MXFP4 tile of whole groups: words int32 [rows, groups, 4] (8 E2M1 codes each, element
    8q + j in nibble j of word q) and the groups' fp32 factors 2^(s-65) [rows, groups].
    p_w: packed codes viewed as int32 [N, N_GROUPS * 4] (TILED: in the tiled layout); p_s: E8M0
    scales uint8 [N, N_GROUPS]."""
    o_q = tl.arange(0, 4)
    m = m_row[:, None] & m_g[None, :]
    b_w = tl.load(p_w + _code_words(o_row[:, None, None], o_g[None, :, None] * 4, N_GROUPS * 4,
                                    TILED) + o_q[None, None, :], mask=m[:, :, None], other=0)
    b_s = tl.load(p_s + o_row[:, None] * N_GROUPS + o_g[None, :], mask=m, other=0)
    b_f = ((b_s.to(tl.int32) + FP4_SCALE_BIAS) << 23).to(tl.float32, bitcast=True)
    return b_w, b_f


@triton.jit
def _fp4_dot(b_w, b_f, p_x, o_row, m_row, o_g, m_g, K_PAIRS, BLOCK_N: tl.constexpr,
             BLOCK_G: tl.constexpr):
    """[BLOCK_N] fp32 = w @ x[o_row] over the groups o_g; b_w, b_f from _fp4_load; x bf16 viewed
    as int32 pairs [rows, K_PAIRS]; o_row, m_row: one token, shape [1]. Per element: shift,
    arithmetic shift, and (the signed fp32 bits of 2^-126 * value) and one FMA; the E8M0 factor
    multiplies each group's sum once."""
    o_q = tl.arange(0, 4)
    m = m_g[:, None] & m_row
    b_part = tl.zeros([BLOCK_N, BLOCK_G, 4], dtype=tl.float32)
    for r in tl.static_range(4):  # pair r of each word: codes 2r (even element) and 2r + 1
        b_v = tl.load(p_x + o_row * K_PAIRS + o_g[:, None] * 16 + o_q[None, :] * 4 + r, mask=m,
                      other=0)
        b_xe = (b_v << 16).to(tl.float32, bitcast=True) * FP4_X_SCALE
        b_xo = (b_v & -65536).to(tl.float32, bitcast=True) * FP4_X_SCALE
        b_we = (((b_w << (28 - 8 * r)) >> 6) & FP4_SIGN_MAG).to(tl.float32, bitcast=True)
        b_wo = (((b_w << (24 - 8 * r)) >> 6) & FP4_SIGN_MAG).to(tl.float32, bitcast=True)
        b_part += b_we * b_xe[None, :, :] + b_wo * b_xo[None, :, :]
    return tl.sum(tl.sum(b_part, axis=2) * b_f, axis=1)


@triton.jit
def _fp4_code(b_w, J: tl.constexpr):
    """E2M1 code J (0..7, element 8q + J of word q) of int32 words as fp32 2^-126 * value: shift
    the nibble to bits 28..31, arithmetic shift right by 6, mask sign and magnitude (3 integer
    ops; 2 for J = 7, whose shift is 0)."""
    return (((b_w << (28 - 4 * J)) >> 6) & FP4_SIGN_MAG).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_klane_part(b_w, p_x, o_row, m_row, o_w, m_w, K_PAIRS, BLOCK_N: tl.constexpr,
                    BLOCK_W: tl.constexpr):
    """[BLOCK_N, BLOCK_W // 4] fp32: per row and group of the K step, 2^-62 * sum over the
    group's 32 elements of w * x (the E8M0 factor not applied). b_w: int32 words [BLOCK_N,
    BLOCK_W] (word q holds elements 8q..8q+7); x bf16 viewed as int32 pairs [rows, K_PAIRS],
    o_row / m_row one token, shape [1]; o_w / m_w the step's word indices [BLOCK_W]."""
    b_part = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for r in tl.static_range(4):  # pair r of each word: codes 2r (even element) and 2r + 1
        b_v = tl.load(p_x + o_row * K_PAIRS + o_w * 4 + r, mask=m_w & m_row, other=0)
        b_xe = (b_v << 16).to(tl.float32, bitcast=True) * FP4_X_SCALE
        b_xo = (b_v & -65536).to(tl.float32, bitcast=True) * FP4_X_SCALE
        b_part += _fp4_code(b_w, 2 * r) * b_xe[None, :]  # two FFMA chains, no FMUL + FADD
        b_part += _fp4_code(b_w, 2 * r + 1) * b_xo[None, :]
    return tl.sum(tl.reshape(b_part, [BLOCK_N, BLOCK_W // 4, 4]), axis=2)


@triton.jit
def _fp4_klane_load(p_w, p_s, o_wrow, m_wrow, kw0, N_WORDS, N_GROUPS, BLOCK_W: tl.constexpr,
                    TILED: tl.constexpr = False):
    """K-lane tile at word kw0 (a multiple of 4): words int32 [rows, BLOCK_W] and E8M0 bytes as
    int32 [rows, BLOCK_W // 4] (0 past the row's end). The scale bytes come out in the partial
    sums' layout (no shared-memory conversion in Triton 3.6's sm_90 TTGIR). TILED: the codes
    are in the tiled layout."""
    o_w = kw0 + tl.arange(0, BLOCK_W)
    o_g = kw0 // 4 + tl.arange(0, BLOCK_W // 4)
    if TILED:
        o_c = _code_words(o_wrow[:, None], o_w[None, :] // 4 * 4, N_WORDS, True) \
            + (o_w % 4)[None, :]
    else:
        o_c = o_wrow[:, None] * N_WORDS + o_w[None, :]
    b_w = tl.load(p_w + o_c,
                  mask=m_wrow[:, None] & (o_w < N_WORDS)[None, :], other=0)
    b_s = tl.load(p_s + o_wrow[:, None] * N_GROUPS + o_g[None, :],
                  mask=m_wrow[:, None] & (o_g < N_GROUPS)[None, :], other=0).to(tl.int32)
    return b_w, b_s


@triton.jit
def _fp4_gemv_klane(p_x, o_xrow, m_xrow, p_w, p_s, o_wrow, m_wrow, K_PAIRS, i_k,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                    PREFETCH: tl.constexpr, STAGES: tl.constexpr, KSPLIT: tl.constexpr,
                    TILED: tl.constexpr = False):
    """acc [BLOCK_M, BLOCK_N] fp32 = x[o_xrow] @ w[o_wrow]^T for MXFP4 w in K-lane tiles (see
    FP4_LAYOUT): p_w packed codes viewed as int32 words [N, K_PAIRS // 4], p_s E8M0 scales uint8
    [N, K_PAIRS // 16], x bf16 viewed as int32 pairs [rows, K_PAIRS]; BLOCK_W words (4 per group)
    a K step. M = 1: per (row, group) fp32 sums over all steps, reduced once at the end;
    M > 1: the weight tile is reused for the tokens one at a time (runtime loop). PREFETCH:
    register double buffering, step k + 1's loads issued before step k's arithmetic. STAGES > 0:
    the K loop is tl.range(num_stages=STAGES) (Triton pipelines its loads through shared
    memory; M = 1 only in practice: the token loop keeps the pipeliner out). KSPLIT > 1: only
    the i_k-th of KSPLIT consecutive shares of the K steps (cdiv(steps, KSPLIT) each; with
    PREFETCH the share's last step also prefetches the next share's first, unused). TILED: the
    codes are in the tiled layout."""
    N_WORDS = K_PAIRS // 4
    N_GROUPS = K_PAIRS // 16
    if KSPLIT > 1:  # this program's share of the K steps: split i_k of KSPLIT
        n_steps = tl.cdiv(tl.cdiv(N_WORDS, BLOCK_W), KSPLIT)
        KW_LO = i_k * n_steps * BLOCK_W
        KW_HI = tl.minimum(KW_LO + n_steps * BLOCK_W, N_WORDS)
    else:
        KW_LO = 0
        KW_HI = N_WORDS
    o_m = tl.arange(0, BLOCK_M)
    n_rows = tl.max(tl.where(m_xrow, o_m + 1, 0), axis=0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_N, BLOCK_W // 4], dtype=tl.float32)
    if PREFETCH:  # step 0's tile; each step then loads the next one before its arithmetic
        b_w_nx, b_s_nx = _fp4_klane_load(p_w, p_s, o_wrow, m_wrow, KW_LO, N_WORDS, N_GROUPS,
                                         BLOCK_W, TILED)
    for kw0 in tl.range(KW_LO, KW_HI, BLOCK_W, num_stages=STAGES if STAGES > 0 else None):
        o_w = kw0 + tl.arange(0, BLOCK_W)
        m_w = o_w < N_WORDS
        if PREFETCH:
            b_w, b_s = b_w_nx, b_s_nx
            # past the last step every lane is masked: no memory traffic
            b_w_nx, b_s_nx = _fp4_klane_load(p_w, p_s, o_wrow, m_wrow, kw0 + BLOCK_W, N_WORDS,
                                             N_GROUPS, BLOCK_W, TILED)
        else:
            b_w, b_s = _fp4_klane_load(p_w, p_s, o_wrow, m_wrow, kw0, N_WORDS, N_GROUPS,
                                       BLOCK_W, TILED)
        b_f = ((b_s + FP4_SCALE_BIAS) << 23).to(tl.float32, bitcast=True)
        if BLOCK_M == 1:
            acc_g += _fp4_klane_part(b_w, p_x, o_xrow, m_xrow, o_w, m_w, K_PAIRS, BLOCK_N,
                                     BLOCK_W) * b_f
        else:
            for i_m in range(0, n_rows):
                o_row, m_row = _token(o_xrow, m_xrow, o_m, i_m)
                b_p = tl.sum(_fp4_klane_part(b_w, p_x, o_row, m_row, o_w, m_w, K_PAIRS, BLOCK_N,
                                             BLOCK_W) * b_f, axis=1)
                acc += tl.where((o_m == i_m)[:, None], b_p[None, :], 0.0)
    if BLOCK_M == 1:
        acc += tl.sum(acc_g, axis=1)[None, :]
    return acc


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
def _token(o_xrow, m_xrow, o_m, i_m):
    """Row index and validity of token i_m of a tile, as [1] tensors."""
    m_sel = o_m == i_m
    o_row = tl.zeros([1], dtype=tl.int32) + tl.sum(tl.where(m_sel, o_xrow, 0), axis=0)
    m_row = (tl.zeros([1], dtype=tl.int32) + tl.sum(tl.where(m_sel & m_xrow, 1, 0), axis=0)) > 0
    return o_row, m_row


@triton.jit
def _gemv(p_x, o_xrow, m_xrow, p_xs, p_w, p_s, o_wrow, m_wrow, K_PAIRS, i_k,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
          FP4: tl.constexpr, X_FP32: tl.constexpr, HAS_XS: tl.constexpr,
          TOKEN_LOOP: tl.constexpr, TILED: tl.constexpr = False):
    """acc [BLOCK_M, BLOCK_N] fp32 = x[o_xrow] (* xs) @ w[o_wrow]^T over K = 2 * K_PAIRS.

    xs (HAS_XS): an fp32 [2 * K_PAIRS] per-column factor on x (the RMSNorm weight).
    FP4 (an int, see _fp4_mode): w is MXFP4 (p_w int32 words, in the tiled layout where TILED;
    p_s scales; see _fp4_load), x bf16, no xs; FP4 >= 2: K-lane tiles (_fp4_gemv_klane,
    BLOCK_KP // 4 words a step; 3 with the next step's loads issued first).
    bf16 w with BLOCK_M > 1: TOKEN_LOOP reuses each [BLOCK_N, BLOCK_KP] weight tile for the tokens
    one at a time (compiled: registers stay at one tile); otherwise one [BLOCK_M, BLOCK_N,
    BLOCK_KP] broadcast product (interpreter: one vectorized op).
    The token loops (FP4 with BLOCK_M > 1, TOKEN_LOOP) are runtime loops up to the last valid row
    of x: a plan tile's padding rows (masked) cost nothing, and the loop body is emitted once."""
    if FP4 >= 2:  # K-lane MXFP4 tiles (FP4_LAYOUT 1; the variant switches: see _fp4_mode)
        return _fp4_gemv_klane(p_x, o_xrow, m_xrow, p_w, p_s, o_wrow, m_wrow, K_PAIRS, i_k,
                               BLOCK_M, BLOCK_N, BLOCK_KP // 4, (FP4 - 2) % 2 == 1,
                               (FP4 - 2) // 2 % 8, (FP4 - 2) // 32 % 16 + 1, TILED)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    o_m = tl.arange(0, BLOCK_M)
    n_rows = tl.max(tl.where(m_xrow, o_m + 1, 0), axis=0)  # rows >= n_rows are all masked
    for kp0 in range(0, K_PAIRS, BLOCK_KP):
        if FP4:  # whole groups of 32 (16 pairs); always one token at a time
            o_g = kp0 // 16 + tl.arange(0, BLOCK_KP // 16)
            m_g = o_g < K_PAIRS // 16
            b_w, b_f = _fp4_load(p_w, p_s, o_wrow, m_wrow, o_g, m_g, K_PAIRS // 16, TILED)
            if BLOCK_M == 1:
                acc += _fp4_dot(b_w, b_f, p_x, o_xrow, m_xrow, o_g, m_g, K_PAIRS, BLOCK_N,
                                BLOCK_KP // 16)[None, :]
            else:
                for i_m in range(0, n_rows):
                    o_row, m_row = _token(o_xrow, m_xrow, o_m, i_m)
                    b_p = _fp4_dot(b_w, b_f, p_x, o_row, m_row, o_g, m_g, K_PAIRS, BLOCK_N,
                                   BLOCK_KP // 16)
                    acc += tl.where((o_m == i_m)[:, None], b_p[None, :], 0.0)
        else:
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
                    o_row, m_row = _token(o_xrow, m_xrow, o_m, i_m)
                    b_xe, b_xo = _load_x_pairs(p_x, o_row, m_row, o_kp, m_kp, K_PAIRS, X_FP32)
                    if HAS_XS:
                        b_xe *= b_se
                        b_xo *= b_so
                    b_p = tl.sum(b_we * b_xe + b_wo * b_xo, axis=1)
                    acc += tl.where((o_m == i_m)[:, None], b_p[None, :], 0.0)
    return acc


@triton.jit
def _mma_gemv(p_x, p_w, p_s, row0, ROW_R, row_lim, LIM_R, N_GROUPS, MODE: tl.constexpr, i_k=0,
              factor=1.0, TILED: tl.constexpr = False):
    """kernels/mxfp4_mma.fp4_mma_gemv with the tile of FP4 code MODE (see _mma_mode): [R,
    16 * 4 // WARPS_K] fp32, y[r, j] = factor * (w[row0 + r * ROW_R + j] . x) (K share i_k of
    KSPLIT)."""
    return fp4_mma_gemv(p_x, p_w, p_s, row0, ROW_R, row_lim, LIM_R, N_GROUPS, MODE // 64 % 4 + 1,
                        1 << (MODE // 16 % 4), 0, MODE % 2 == 1, MODE // 2 % 8, i_k,
                        MODE // 512 % 8 + 1, MODE // MMA_XP_BIT % 2 == 1, factor,
                        MODE // MMA_EVICT_BIT % 2 == 1, TILED)


@triton.jit
def _gate_up_act(p_x, o_xrow, m_xrow, p_w, p_s, o_n, m_n, N_HALF, K_PAIRS, beta, linear_beta,
                 ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_KP: tl.constexpr, FP4: tl.constexpr, TOKEN_LOOP: tl.constexpr,
                 TILED: tl.constexpr = False):
    """act(x @ w[o_n]^T, x @ w[N_HALF + o_n]^T): gate rows then up rows of one [2 * N_HALF, K]
    weight (MXFP4 codes in the tiled layout where TILED). K-lane MXFP4 with the gate/up bit of
    FP4 (FP4_FUSE_GATE_UP): one GEMV over a tile of 2 * BLOCK_N interleaved rows (gate n, up n,
    ...) instead of two after each other."""
    if FP4 >= 18 and (FP4 - 2) // 16 % 2 == 1:
        o_r = tl.reshape(tl.join(o_n, o_n + N_HALF), [2 * BLOCK_N])
        m_r = tl.reshape(tl.join(m_n, m_n), [2 * BLOCK_N])
        b_gu = _gemv(p_x, o_xrow, m_xrow, p_x, p_w, p_s, o_r, m_r, K_PAIRS, 0,
                     BLOCK_M, 2 * BLOCK_N, BLOCK_KP, FP4, False, False, TOKEN_LOOP, TILED)
        b_g, b_u = tl.split(tl.reshape(b_gu, [BLOCK_M, BLOCK_N, 2]))
        return _act(b_g, b_u, beta, linear_beta, ACT)
    b_g = _gemv(p_x, o_xrow, m_xrow, p_x, p_w, p_s, o_n, m_n, K_PAIRS, 0,
                BLOCK_M, BLOCK_N, BLOCK_KP, FP4, False, False, TOKEN_LOOP, TILED)
    b_u = _gemv(p_x, o_xrow, m_xrow, p_x, p_w, p_s, o_n + N_HALF, m_n, K_PAIRS, 0,
                BLOCK_M, BLOCK_N, BLOCK_KP, FP4, False, False, TOKEN_LOOP, TILED)
    return _act(b_g, b_u, beta, linear_beta, ACT)


@triton.jit
def _plan_tile_runs(i_b, block_m, n_valid, i_e, m_ent, ONE_TRIP: tl.constexpr):
    """Whether plan tile i_b has work: within the plan's count (ONE_TRIP: and its expert and an
    entry are real, which holds for every tile within the count; asking makes the compiler load
    them before the branch, with the count, in one round trip: see PLAN_ONE_TRIP)."""
    if ONE_TRIP:
        return (i_b * block_m < n_valid) & (i_e >= 0) & (tl.max(m_ent.to(tl.int32)) > 0)
    return i_b * block_m < n_valid


@triton.jit
def _plan_tile(p_sorted, i_b, block_m, n_entries, top_k, BLOCK_M: tl.constexpr):
    """Entries (token * top_k + slot), their tokens and validity for plan tile i_b."""
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < block_m
    b_ent = tl.load(p_sorted + i_b * block_m + o_m, mask=m_m, other=n_entries)
    m_ent = b_ent < n_entries
    return b_ent, b_ent // top_k, m_ent


@triton.jit
def _mma_prefetch(p_w, p_s, row0, ROW_R, row_lim, LIM_R, N_GROUPS, MODE: tl.constexpr,
                  STEPS: tl.constexpr, TILED: tl.constexpr = False):
    """Ask L2 for the first STEPS K steps of the rows of tensor-core tile MODE at row0 (as
    _mma_gemv reads them: R runs of 16 * WN rows, ROW_R apart; a step of a row is one 128-byte
    line of p_w, int32 words; TILED: the 16 lines of the step's 2 KB block of each 16-row tile)
    and for the rows' scales (p_s, N_GROUPS bytes a row). STEPS 0: nothing."""
    if STEPS > 0:
        R: tl.constexpr = MODE // 64 % 4 + 1
        ROWS: tl.constexpr = 16 * (4 >> (MODE // 16 % 4))  # 16 * WN (4 warps)
        K_WORDS = N_GROUPS * 4
        o_j = tl.arange(0, R * ROWS)
        r = o_j // ROWS
        row = row0 + r * ROW_R + o_j % ROWS
        m_row = row < row_lim + r * LIM_R
        o_2 = tl.arange(0, 2)
        for s0 in tl.static_range(0, STEPS, 2):
            step = s0 + o_2
            if TILED:  # line row % 16 of the tile's block of the step
                o_l = ((row // 16) * (K_WORDS // 32))[:, None] * 512 + step[None, :] * 512 \
                    + (row % 16 * 32)[:, None]
            else:
                o_l = row[:, None] * K_WORDS + step[None, :] * 32
            prefetch_l2(p_w + o_l,
                         m_row[:, None] & ((step < STEPS) & (step * 32 < K_WORDS))[None, :])
        prefetch_l2(p_s + row[:, None] * N_GROUPS + o_2[None, :] * (N_GROUPS - 1),
                     m_row[:, None])


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _moe_front_kernel(p_x, p_down, p_z, p_zp, p_sw13, p_sa, M, H_PAIRS, D, S, n_shared_tiles,
                      beta, linear_beta, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, TOKEN_LOOP: tl.constexpr,
                      PREPARED: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """Programs [0, n_shared_tiles): shared gate/up + act -> a_s [M, S] bf16; the rest:
    latent down-projection -> z [M, D] bf16 (and, PREPARED, its mma_prepare_x copy at p_zp).
    Both read x [M, H] bf16. TRIGGER: let the next launch start (PDL) as programs start."""
    if TRIGGER:
        gdc_launch_dependents()
    i_p = tl.program_id(0)
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    if i_p < n_shared_tiles:
        o_n = i_p * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < S
        b_a = _gate_up_act(p_x, o_m, m_m, p_sw13, p_sw13, o_n, m_n, S, H_PAIRS, beta, linear_beta,
                           ACT, BLOCK_M, BLOCK_N, BLOCK_KP, False, TOKEN_LOOP)
        tl.store(p_sa + o_m[:, None] * S + o_n[None, :], _to_bf16(b_a),
                 mask=m_m[:, None] & m_n[None, :])
    else:
        o_n = (i_p - n_shared_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < D
        b_z = _gemv(p_x, o_m, m_m, p_x, p_down, p_down, o_n, m_n, H_PAIRS, 0,
                    BLOCK_M, BLOCK_N, BLOCK_KP, False, False, False, TOKEN_LOOP)
        b_zb = _to_bf16(b_z)
        tl.store(p_z + o_m[:, None] * D + o_n[None, :], b_zb, mask=m_m[:, None] & m_n[None, :])
        if PREPARED:
            store_prepared_x(p_zp, o_m, o_n, D, b_zb, m_m[:, None] & m_n[None, :])


@triton.jit
def _stage1_side_jobs(p_out, p_sync, i_b, i_n, n_zero, ZERO_OUT: tl.constexpr,
                      ZERO_SYNC: tl.constexpr, ZERO_BLOCK: tl.constexpr):
    """Stage 1's side jobs: zero a slice of stage 2's accumulator, and (program 0) the stage-2 +
    tail launch's two counters."""
    if ZERO_OUT:
        o_o = (i_b * tl.num_programs(1) + i_n) * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
        tl.store(p_out + o_o, tl.zeros([ZERO_BLOCK], dtype=tl.float32), mask=o_o < n_zero)
    if ZERO_SYNC:
        o_s = tl.arange(0, 2)
        tl.store(p_sync + o_s, tl.zeros([2], dtype=tl.int32), mask=(i_b + i_n + o_s * 0) == 0)


@triton.jit
def _moe_stage1_kernel(p_z, p_w, p_ws, p_sorted, p_block_expert, p_num_valid, p_a, p_ap, p_out,
                       p_sync, n_entries, block_m, top_k, N_I, D_PAIRS, n_zero, beta,
                       linear_beta, ACT: tl.constexpr, FP4: tl.constexpr,
                       ZERO_OUT: tl.constexpr, ZERO_SYNC: tl.constexpr,
                       ZERO_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_KP: tl.constexpr, TOKEN_LOOP: tl.constexpr,
                       PREPARED: tl.constexpr = False, ONE_TRIP: tl.constexpr = True,
                       PDL: tl.constexpr = False, PDL_STEPS: tl.constexpr = 0,
                       TRIGGER: tl.constexpr = False, TILED: tl.constexpr = False):
    """Program (plan tile i_b, I tile i_n): a[entries, tile] = act(z[tokens] @ w13[e]^T) (z as
    mma_prepare_x wrote it where the FP4 code has the X_PREPARED bit); PREPARED: also a's
    mma_prepare_x copy at p_ap. Side jobs: zero stage 2's accumulator (a slice per program) and
    the stage-2 + tail launch's two counters (program 0). PDL: see PDL_STEPS (the side jobs
    come after the wait). TILED: MXFP4 codes in the tiled layout."""
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    if TRIGGER and not PDL:  # let the next launch start (PDL) as programs start
        gdc_launch_dependents()
    if not PDL:
        _stage1_side_jobs(p_out, p_sync, i_b, i_n, n_zero, ZERO_OUT, ZERO_SYNC, ZERO_BLOCK)
    # the plan's count, entries and expert in one round trip (all in bounds for every tile):
    # the weight addresses wait for them
    n_valid = tl.load(p_num_valid)
    b_ent, b_tok, m_ent = _plan_tile(p_sorted, i_b, block_m, n_entries, top_k, BLOCK_M)
    i_e = tl.load(p_block_expert + i_b).to(tl.int64)
    runs = _plan_tile_runs(i_b, block_m, n_valid, i_e, m_ent, ONE_TRIP)
    p_we = p_w + i_e * (2 * N_I * (D_PAIRS // 4 if FP4 else D_PAIRS))
    p_se = p_ws + i_e * (2 * N_I * (D_PAIRS // 16)) if FP4 else p_ws
    if PDL:
        if runs:
            _mma_prefetch(p_we, p_se, i_n * BLOCK_N, N_I, N_I, N_I, D_PAIRS // 16, FP4, PDL_STEPS,
                          TILED)
        gdc_wait()
        gdc_launch_dependents()
        _stage1_side_jobs(p_out, p_sync, i_b, i_n, n_zero, ZERO_OUT, ZERO_SYNC, ZERO_BLOCK)
    if runs:
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < N_I
        if FP4 >= FP4_MMA_BASE:  # tensor-core tiles: BLOCK_N gate rows and their up rows
            p_x = p_z + tl.sum(tl.where(m_ent, b_tok, 0)) * D_PAIRS
            b_gu = _mma_gemv(p_x, p_we, p_se, i_n * BLOCK_N, N_I, N_I, N_I, D_PAIRS // 16, FP4,
                             0, 1.0, TILED)
            b_g, b_u = tl.split(tl.permute(b_gu, [1, 0]))
            b_a = _act(b_g, b_u, beta, linear_beta, ACT)[None, :]
        else:
            b_a = _gate_up_act(p_z, b_tok, m_ent, p_we, p_se, o_n, m_n, N_I, D_PAIRS, beta,
                               linear_beta, ACT, BLOCK_M, BLOCK_N, BLOCK_KP, FP4, TOKEN_LOOP,
                               TILED)
        b_ab = _to_bf16(b_a)
        tl.store(p_a + b_ent[:, None] * N_I + o_n[None, :], b_ab,
                 mask=m_ent[:, None] & m_n[None, :])
        if PREPARED:
            store_prepared_x(p_ap, b_ent, o_n, N_I, b_ab, m_ent[:, None] & m_n[None, :])


@triton.jit
def _stage2_tile(pid, p_a, p_w, p_ws, p_sorted, p_sorted_w, p_block_expert, p_num_valid,
                 p_topk_ids, p_topk_w, p_y, n_entries, block_m, top_k, D, I_PAIRS, n_d_tiles,
                 FP4: tl.constexpr, DETERMINISTIC: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, TOKEN_LOOP: tl.constexpr,
                 ONE_TRIP: tl.constexpr = True, PDL: tl.constexpr = False,
                 PDL_STEPS: tl.constexpr = 0, TILED: tl.constexpr = False):
    """Stage-2 program pid = (row i_b, D tile i_n). Atomic: i_b is a plan tile; adds
    w * (a[entries] @ w2[e]^T) into y. Deterministic: i_b is a token; sums its top_k slots in
    slot order and stores. PDL (atomic tensor-core tiles): see PDL_STEPS. TILED: MXFP4 codes
    in the tiled layout."""
    i_k = 0
    # K-lane split K (atomic path): pid = (tile, split)
    if FP4 >= 34 and FP4 < FP4_MMA_BASE and (FP4 - 2) // 32 % 16 > 0:
        i_k = pid % ((FP4 - 2) // 32 % 16 + 1)
        pid = pid // ((FP4 - 2) // 32 % 16 + 1)
    if FP4 >= FP4_MMA_BASE and FP4 // 512 % 8 > 0:  # tensor-core split K: the same
        i_k = pid % (FP4 // 512 % 8 + 1)
        pid = pid // (FP4 // 512 % 8 + 1)
    i_b, i_n = pid // n_d_tiles, pid % n_d_tiles
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < D
    if DETERMINISTIC:
        b_y = tl.zeros([1, BLOCK_N], dtype=tl.float32)
        for k in range(0, top_k):
            i_e = tl.load(p_topk_ids + i_b * top_k + k).to(tl.int64)
            o_row = tl.zeros([1], dtype=tl.int32) + i_b * top_k + k
            p_se = p_ws + i_e * (D * (I_PAIRS // 16)) if FP4 else p_ws
            p_we = p_w + i_e * (D * (I_PAIRS // 4 if FP4 else I_PAIRS))
            b_p = _gemv(p_a, o_row, o_row < n_entries, p_a, p_we, p_se,
                        o_n, m_n, I_PAIRS, 0, 1, BLOCK_N, BLOCK_KP, FP4, False, False, False,
                        TILED)
            b_y += tl.load(p_topk_w + i_b * top_k + k) * b_p
        tl.store(p_y + i_b * D + o_n[None, :], b_y, mask=m_n[None, :])
    else:
        n_valid = tl.load(p_num_valid)  # with the entries and expert: one round trip
        b_ent, b_tok, m_ent = _plan_tile(p_sorted, i_b, block_m, n_entries, top_k, BLOCK_M)
        i_e = tl.load(p_block_expert + i_b).to(tl.int64)
        o_m = tl.arange(0, BLOCK_M)
        b_w = tl.load(p_sorted_w + i_b * block_m + o_m, mask=o_m < block_m, other=0.0)
        runs = _plan_tile_runs(i_b, block_m, n_valid, i_e, m_ent, ONE_TRIP)
        p_se = p_ws + i_e * (D * (I_PAIRS // 16)) if FP4 else p_ws
        p_we = p_w + i_e * (D * (I_PAIRS // 4 if FP4 else I_PAIRS))
        if PDL:
            if runs:
                _mma_prefetch(p_we, p_se, i_n * BLOCK_N, BLOCK_N // (FP4 // 64 % 4 + 1), D, 0,
                              I_PAIRS // 16, FP4, PDL_STEPS, TILED)
            gdc_wait()
            gdc_launch_dependents()
        if runs:
            if FP4 >= FP4_MMA_BASE:  # tensor-core tiles: BLOCK_N consecutive rows
                p_x = p_a + tl.sum(tl.where(m_ent, b_ent, 0)) * I_PAIRS
                # ONE_TRIP: the router weight rides on the group factors, so that its load is
                # issued with the plan's (the compiler puts a load used after the K loop there)
                if ONE_TRIP:
                    w_in = tl.sum(tl.where(m_ent, b_w, 0.0))
                    b_w = tl.full([BLOCK_M], 1.0, tl.float32)  # applied in the factors
                else:
                    w_in = 1.0
                b_p = tl.reshape(_mma_gemv(p_x, p_we, p_se, i_n * BLOCK_N,
                                           BLOCK_N // (FP4 // 64 % 4 + 1), D, 0, I_PAIRS // 16,
                                           FP4, i_k, w_in, TILED), [1, BLOCK_N])
            else:
                b_p = _gemv(p_a, b_ent, m_ent, p_a, p_we, p_se, o_n, m_n, I_PAIRS, i_k, BLOCK_M,
                            BLOCK_N, BLOCK_KP, FP4, False, False, TOKEN_LOOP, TILED)
            tl.atomic_add(p_y + b_tok[:, None] * D + o_n[None, :], b_p * b_w[:, None],
                          mask=m_ent[:, None] & m_n[None, :], sem="relaxed")


@triton.jit
def _tail_tile(pid, p_y, p_nw, p_up, p_sa, p_sw2, p_shared, p_o, p_done, n_wait, M, D, H,
               S_PAIRS, eps, LATENT: tl.constexpr, SHARED: tl.constexpr, WAIT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
               BLOCK_SS: tl.constexpr, TOKEN_LOOP: tl.constexpr, PDL: tl.constexpr = False):
    """Tail program pid (H tile): out = rstd * ((y * g) @ W_up^T) (LATENT) or y, plus the shared
    output (SHARED 1: add a computed [M, H] tensor; 2: a_s @ Ws2^T computed here). WAIT: the
    shared GEMV first, then wait until n_wait stage-2 programs have signalled p_done. PDL: the
    shared GEMV (SHARED 2) first, then wait for the previous launch. y is read through L2 only
    (.cg): it was written by other programs' atomics."""
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    m_o = m_m[:, None] & m_n[None, :]
    b_o = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SHARED == 2:
        b_o += _gemv(p_sa, o_m, m_m, p_sa, p_sw2, p_sw2, o_n, m_n, S_PAIRS, 0,
                     BLOCK_M, BLOCK_N, BLOCK_KP, False, False, False, TOKEN_LOOP)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if SHARED == 1:
        b_o += tl.load(p_shared + o_m[:, None] * H + o_n[None, :], mask=m_o, other=0.0).to(
            tl.float32)
    if WAIT:
        # poll with plain (volatile) loads, which L2 serves side by side, then one acquire RMW:
        # every stage-2 tile's adds happen before the reads of y below. The RMW is a max with 0
        # (the count is >= 0: unchanged), not an add of 0: Triton 3.6 turns an acquire add of 0
        # into an acquire load and drops it when its value is unused, leaving no acquire at all.
        n_spin = tl.program_id(0) * 0  # an int32 tensor: a loop-carried counter
        while (tl.load(p_done, volatile=True) < n_wait) & (n_spin < MAX_SPIN):
            n_spin += 1
        tl.atomic_max(p_done, 0, sem="acquire")
        tl.debug_barrier()  # the acquiring thread's view, then every thread's reads
    if LATENT:
        b_u = _gemv(p_y, o_m, m_m, p_nw, p_up, p_up, o_n, m_n, D // 2, 0,
                    BLOCK_M, BLOCK_N, BLOCK_KP, False, True, True, TOKEN_LOOP)
        b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # every program recomputes sum(y^2): M*D*4 B
        for d0 in range(0, D, BLOCK_SS):
            o_d = d0 + tl.arange(0, BLOCK_SS)
            b_v = tl.load(p_y + o_m[:, None] * D + o_d[None, :],
                          mask=m_m[:, None] & (o_d < D)[None, :], other=0.0, cache_modifier=".cg")
            b_ss += tl.sum(b_v * b_v, axis=1)
        b_o += b_u * (1.0 / tl.sqrt(b_ss / D + eps))[:, None]
    else:
        b_o += tl.load(p_y + o_m[:, None] * H + o_n[None, :], mask=m_o, other=0.0,
                       cache_modifier=".cg")
    tl.store(p_o + o_m[:, None] * H + o_n[None, :], _to_bf16(b_o), mask=m_o)


@triton.jit
def _moe_stage2_tail_kernel(
        p_a, p_w, p_ws, p_sorted, p_sorted_w, p_block_expert, p_num_valid, p_topk_ids, p_topk_w,
        p_y, n_entries, block_m, top_k, D, I_PAIRS, n_d_tiles, n_stage2,
        p_nw, p_up, p_sa, p_sw2, p_shared, p_o, p_sync, M, H, S_PAIRS, eps,
        STAGE2: tl.constexpr, TAIL: tl.constexpr, FP4: tl.constexpr,
        DETERMINISTIC: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
        BLOCK_KP2: tl.constexpr, LATENT: tl.constexpr, SHARED: tl.constexpr,
        BLOCK_MT: tl.constexpr, BLOCK_NT: tl.constexpr, BLOCK_KPT: tl.constexpr,
        BLOCK_SS: tl.constexpr, TOKEN_LOOP: tl.constexpr, ONE_TRIP: tl.constexpr = True,
        PDL: tl.constexpr = False, PDL_STEPS: tl.constexpr = 0, TILED: tl.constexpr = False):
    """Stage 2, the tail, or both in one launch (TILED: stage 2's MXFP4 codes in the tiled
    layout). Both: each program takes a ticket (atomic
    counter p_sync[0]); tickets [0, n_stage2) run stage-2 tiles and then count themselves done in
    p_sync[1] (release); later tickets run tail tiles, which wait for all stage-2 tiles
    (acquire). Tickets follow the order programs actually start, so every stage-2 tile a tail
    tile waits for is already running: no deadlock whatever the scheduling. PDL: stage 2
    alone or the tail alone (see PDL_STEPS)."""
    if STAGE2 and TAIL:
        i_t = tl.atomic_add(p_sync, 1, sem="relaxed")
        if i_t < n_stage2:
            _stage2_tile(i_t, p_a, p_w, p_ws, p_sorted, p_sorted_w, p_block_expert, p_num_valid,
                         p_topk_ids, p_topk_w, p_y, n_entries, block_m, top_k, D, I_PAIRS,
                         n_d_tiles, FP4, DETERMINISTIC, BLOCK_M2, BLOCK_N2, BLOCK_KP2, TOKEN_LOOP,
                         ONE_TRIP, False, 0, TILED)
            tl.debug_barrier()  # every thread's adds issued before the release below
            tl.atomic_add(p_sync + 1, 1, sem="release")
        else:
            _tail_tile(i_t - n_stage2, p_y, p_nw, p_up, p_sa, p_sw2, p_shared, p_o, p_sync + 1,
                       n_stage2, M, D, H, S_PAIRS, eps, LATENT, SHARED, True, BLOCK_MT, BLOCK_NT,
                       BLOCK_KPT, BLOCK_SS, TOKEN_LOOP)
    elif STAGE2:
        _stage2_tile(tl.program_id(0), p_a, p_w, p_ws, p_sorted, p_sorted_w, p_block_expert,
                     p_num_valid, p_topk_ids, p_topk_w, p_y, n_entries, block_m, top_k, D,
                     I_PAIRS, n_d_tiles, FP4, DETERMINISTIC, BLOCK_M2, BLOCK_N2, BLOCK_KP2,
                     TOKEN_LOOP, ONE_TRIP, PDL, PDL_STEPS, TILED)
    else:
        _tail_tile(tl.program_id(0), p_y, p_nw, p_up, p_sa, p_sw2, p_shared, p_o, p_sync,
                   n_stage2, M, D, H, S_PAIRS, eps, LATENT, SHARED, False, BLOCK_MT, BLOCK_NT,
                   BLOCK_KPT, BLOCK_SS, TOKEN_LOOP, PDL)


# ---------------------------------------------------------------------------------------------
# host side: validation and tiling


def _fast_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and INTERPRETER_BIG_TILES


def _tiles(programs_per_tile: int, rows: int, k_pairs: int, block_m: int = 1,
           fp4: bool = False, target: int | None = None,
           max_rows_fp4: int | None = None) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_KP) for a GEMV over ``rows`` output rows, launched for
    ``programs_per_tile`` independent row sets: the most rows per program (a power of two in
    [MIN_ROWS, MAX_ROWS or MAX_ROWS_FP4]) that keeps at least ``target`` (default
    TARGET_PROGRAMS) programs, then the most pairs per K step within the product budget
    (FP4_BUDGET_FACTOR times larger for MXFP4 weights)."""
    fast = _fast_interpreter()
    target = INTERPRETER_TARGET_PROGRAMS if fast else (target or TARGET_PROGRAMS)
    fp4_factor = FP4_BUDGET_FACTOR if fp4 else 1
    # interpreter: an MXFP4 tile's arrays are a quarter of a bf16 tile's, so 4x the rows too
    max_rows = INTERPRETER_MAX_ROWS * fp4_factor if fast else (
        (max_rows_fp4 or MAX_ROWS_FP4) if fp4 else MAX_ROWS)
    budget = (INTERPRETER_PRODUCT_BUDGET if fast else PRODUCT_BUDGET) * fp4_factor
    block_n = MIN_ROWS
    while (block_n * 2 <= min(max_rows, triton.next_power_of_2(rows))
           and programs_per_tile * triton.cdiv(rows, block_n * 2) >= target):
        block_n *= 2
    # the product tile holds one token at a time when the GEMV loops over tokens (compiled, and
    # MXFP4 always: see _gemv), else all block_m of them
    per_step = 1 if _token_loop() or fp4 else block_m
    block_kp = _pow2_floor(budget // (per_step * block_n))
    block_kp = min(block_kp, budget if fast else MAX_PAIRS * fp4_factor,
                   triton.next_power_of_2(k_pairs))
    return block_n, max(MIN_PAIRS, block_kp)


def _fp4_mode(w, stage: int = 0) -> int:
    """The FP4 constexpr of the expert kernels: 0 bf16 weights; MXFP4 1 the group tiles
    (FP4_LAYOUT 0); K-lane tiles (FP4_LAYOUT 1) 2 + prefetch (FP4_KLANE_PREFETCH) + 2 * stages
    (FP4_KLANE_STAGES) + 16 * fused gate/up (FP4_FUSE_GATE_UP, stage 1) + 32 * (split - 1)
    (FP4_STAGE2_KSPLIT, stage 2 atomic). stage: 1 or 2 (the stage's own switches), else 0."""
    if not isinstance(w, MXFP4):
        return 0
    if FP4_LAYOUT != 1:
        return 1
    stages = _per_stage(FP4_KLANE_STAGES, stage)
    if not 0 <= stages <= 7:
        raise ValueError(f"FP4_KLANE_STAGES: expected 0..7, got {FP4_KLANE_STAGES}")
    if not 1 <= FP4_STAGE2_KSPLIT <= 16:
        raise ValueError(f"FP4_STAGE2_KSPLIT: expected 1..16, got {FP4_STAGE2_KSPLIT}")
    mode = 2 + int(bool(FP4_KLANE_PREFETCH)) + 2 * stages
    if stage == 1 and FP4_FUSE_GATE_UP:
        mode += 16
    if stage == 2:
        mode += 32 * (FP4_STAGE2_KSPLIT - 1)
    return mode


def _mma_code(tile, stage: int, k_steps: int = 1) -> int:
    """FP4 constexpr code of tensor-core tile (R, WARPS_K, prefetch[, K split]) for ``stage``
    over ``k_steps`` K steps of 256: FP4_MMA_BASE + inline PTX (compiled) + 2 * prefetch + 16 *
    log2(WARPS_K) + 64 * (R - 1) + 512 * (split - 1); the split (stage 2 only) is clamped so
    that no share is empty."""
    r, warps_k, prefetch, split = (*tile, 1)[:4]
    if stage == 1 and (r != 2 or split != 1):
        raise ValueError(f"FP4_MMA_TILES[1]: stage 1's R is 2 (gate and up tiles), no split, "
                         f"got {tile}")
    if (r not in (1, 2) or warps_k not in (1, 2, 4) or not 0 <= prefetch <= 7
            or not 1 <= split <= 8):
        raise ValueError(f"FP4_MMA_TILES[{stage}]: expected (R in (1, 2), WARPS_K in (1, 2, 4), "
                         f"prefetch in 0..7[, split in 1..8]), got {tile}")
    split = triton.cdiv(k_steps, triton.cdiv(k_steps, min(split, k_steps)))
    asm = os.environ.get("TRITON_INTERPRET") != "1"
    return (_MMA_BASE + int(asm) + 2 * prefetch + 16 * (warps_k.bit_length() - 1)
            + 64 * (r - 1) + 512 * (split - 1))


def _mma_mode(w, stage: int, block_m: int, programs_per_tile: int = 1, rows: int = 1,
              prepared: bool = False) -> int:
    """FP4 code of the tensor-core tiles (FP4_MMA) for stage 1 or the atomic stage 2 (stage 2)
    with one token a plan tile, else 0 (see FP4_MMA_TILES; ``rows`` a GEMV's output rows, gate
    rows for stage 1, launched for ``programs_per_tile`` plan tiles; ``prepared``: the caller
    passes x as mma_prepare_x wrote it, so the code gets the X_PREPARED bit; FP4_MMA_EVICT_FIRST
    of the stage sets the eviction bit)."""
    if not (FP4_MMA and isinstance(w, MXFP4) and stage in (1, 2) and block_m == 1):
        return 0
    if _fast_interpreter() and not INTERPRETER_MMA:
        return 0
    k_steps = triton.cdiv(w.shape[-1], 256)
    flags = ((_MMA_XP if prepared and FP4_MMA_X_PREPARED else 0)
             + (_MMA_EVICT if _per_stage(FP4_MMA_EVICT_FIRST, stage) else 0))
    if FP4_MMA_TILES is not None:
        return _mma_code(FP4_MMA_TILES[stage], stage, k_steps) + flags
    codes = [_mma_code(t, stage, k_steps) for t in FP4_MMA_CANDIDATES[stage]]
    codes.sort(key=lambda c: -_mma_block_n(c, stage))
    target = INTERPRETER_TARGET_PROGRAMS if _fast_interpreter() else TARGET_PROGRAMS
    for code in codes:
        if programs_per_tile * triton.cdiv(rows, _mma_block_n(code, stage)) >= target:
            return code + flags
    return codes[-1] + flags


def _mma_block_n(mode: int, stage: int) -> int:
    """Rows a program of tensor-core mode ``mode`` owns: stage 1 16 * WN gate rows (and as many
    up rows), stage 2 R * 16 * WN rows (WN = 4 // WARPS_K)."""
    wn = MMA_WARPS >> (mode // 16 % 4)
    return 16 * wn * (1 if stage == 1 else mode // 64 % 4 + 1)


def _per_stage(value, stage: int):
    """A switch that is one value or a (stage 1, stage 2) pair; stage 0 reads stage 2's."""
    if isinstance(value, (tuple, list)):
        return value[0] if stage == 1 else value[1]
    return value


def _fit_steps(mode: int, words: int, block_w: int) -> int:
    """K-lane mode ``mode`` fitted to a GEMV of ``words`` words a row in steps of ``block_w``:
    the split K at most one share a step and none empty (the kernel gives each share
    cdiv(steps, split) steps), and no pipelining of a share of one step."""
    if mode < 2:
        return mode
    steps = triton.cdiv(words, block_w)
    split = (mode - 2) // 32 % 16 + 1
    split = triton.cdiv(steps, triton.cdiv(steps, min(split, steps)))
    low = (mode - 2) % 32  # prefetch, stages, fused gate/up bits
    if triton.cdiv(steps, split) < 2:
        low -= low // 2 % 8 * 2  # stages off
    return 2 + low + 32 * (split - 1)


def _reg_cap(mode: int, stage: int) -> dict:
    """Launch options of stage ``stage``'s kernel in FP4 mode ``mode``: FP4_MAXNREG for K-lane
    tiles (the interpreter drops the option)."""
    cap = _per_stage(FP4_MAXNREG, stage)
    if mode < 2 or cap is None:
        return {}
    return {"maxnreg": int(cap)}


def _pdl(pdl: bool, mode: int | None = None) -> dict:
    """Kernel and launch options of programmatic dependent launch (see PDL_STEPS) for a stage
    launch in FP4 mode ``mode`` (only compiled tensor-core tiles take it) or a tail launch
    (mode None; compiled only)."""
    if not pdl or PDL_STEPS is None or os.environ.get("TRITON_INTERPRET") == "1":
        return {}
    if mode is None:
        return dict(PDL=True, launch_pdl=True)
    if mode < _MMA_BASE or not mode & 1:
        return {}
    return dict(PDL=True, PDL_STEPS=int(PDL_STEPS), launch_pdl=True)


def _expert_tiles(programs_per_tile: int, rows: int, k_pairs: int, block_m: int, mode: int
                  ) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_KP) of an expert GEMV in FP4 mode ``mode`` (see _fp4_mode). K-lane tiles:
    rows as _tiles picks them (at most FP4_KLANE_ROWS), FP4_KLANE_WORDS words (4 pairs each) a K
    step, at most the row; the interpreter takes whole rows."""
    if mode < 2:
        return _tiles(programs_per_tile, rows, k_pairs, block_m, mode != 0)
    fused = (mode - 2) // 16 % 2  # a tile of 2 * BLOCK_N rows (gate and up)
    block_n, _ = _tiles(programs_per_tile, rows, k_pairs, block_m, True,
                        max_rows_fp4=max(MIN_ROWS, FP4_KLANE_ROWS >> fused))
    words = triton.next_power_of_2(k_pairs // 4)
    block_w = words if _fast_interpreter() else min(FP4_KLANE_WORDS, words)
    return block_n, 4 * max(4, block_w)


def _token_loop() -> bool:
    """Compiled kernels loop over the tokens of a tile (see _gemv); the interpreter broadcasts."""
    return not _fast_interpreter()


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _check_tensor(name, t, *, dtypes, dim, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name}: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 "
                         f"before importing triton; see k3lab.device.use_device)")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a cuda (or interpreted cpu) tensor, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def _check_tokens(name, m):
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"{name}: expected 1 <= M <= {MAX_TOKENS} tokens, got M={m}")


def _check_experts(name, w, device):
    """(E, N, K, is_fp4) of an expert weight [E, N, K]: bf16 tensor or MXFP4."""
    if isinstance(w, MXFP4):
        _check_tensor(f"{name}.packed", w.packed, dtypes=(torch.uint8,), dim=3, device=device)
        _check_tensor(f"{name}.scales", w.scales, dtypes=(torch.uint8,), dim=3, device=device)
        e, n, k = w.shape
        if k % MXFP4_GROUP or tuple(w.scales.shape) != (e, n, k // MXFP4_GROUP):
            raise ValueError(f"{name}: MXFP4 scales must be [E, N, K/32] = {[e, n, k // 32]} with "
                             f"K a multiple of 32, got packed {tuple(w.packed.shape)}, scales "
                             f"{tuple(w.scales.shape)}")
        if w.layout == "tiled" and not mxfp4_tiled_ok(w.shape):
            raise ValueError(f"{name}: the tiled MXFP4 layout needs N a multiple of 16 and K of "
                             f"256, got [E, N, K] = {[e, n, k]}")
        return e, n, k, True
    _check_tensor(name, w, dtypes=(torch.bfloat16,), dim=3, device=device)
    e, n, k = w.shape
    if k % 2:
        raise ValueError(f"{name}: expected an even input dimension K, got {k}")
    return e, n, k, False


def _tiled(w) -> bool:
    """Whether expert weight ``w`` is MXFP4 in the tiled layout."""
    return isinstance(w, MXFP4) and w.layout == "tiled"


def _expert_ptrs(w):
    """(values, scales) kernel arguments: bf16 viewed as int32 pairs, or MXFP4 packed codes viewed
    as int32 words (8 codes each) and the uint8 scales."""
    if isinstance(w, MXFP4):
        return w.packed.view(torch.int32), w.scales
    return w.view(torch.int32), w.view(torch.int32)


def _pairs(name, t):
    """bf16 [.., K] (K even) viewed as int32 [.., K/2]."""
    if t.shape[-1] % 2:
        raise ValueError(f"{name}: expected an even last dimension, got {tuple(t.shape)}")
    return t.view(torch.int32)


def _check_plan(plan, m, n_experts, device, out_dim=None):
    """Validate a RoutePlan for M tokens over n_experts; returns (top_k, block_m, n_tiles)."""
    if not isinstance(plan, RoutePlan):
        raise ValueError(f"plan: expected a k3lab.plan.RoutePlan, got {type(plan).__name__}")
    _check_tensor("plan.topk_ids", plan.topk_ids, dtypes=(torch.int32,), dim=2, device=device)
    _check_tensor("plan.topk_weights", plan.topk_weights, dtypes=(torch.float32,), dim=2,
                  device=device)
    if plan.topk_ids.shape[0] != m or plan.topk_weights.shape != plan.topk_ids.shape:
        raise ValueError(f"plan: topk_ids {tuple(plan.topk_ids.shape)} and topk_weights "
                         f"{tuple(plan.topk_weights.shape)} must both be [M={m}, top_k]")
    top_k, block_m = plan.topk_ids.shape[1], plan.block_m
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"plan: top_k={top_k} must be in [1, E={n_experts}]")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"plan.block_m: expected a positive int, got {block_m!r}")
    for name in ("sorted_ids", "block_expert_ids", "num_valid"):
        _check_tensor(f"plan.{name}", getattr(plan, name), dtypes=(torch.int32,), dim=1,
                      device=device)
    _check_tensor("plan.sorted_weights", plan.sorted_weights, dtypes=(torch.float32,), dim=1,
                  device=device)
    cap = plan.sorted_ids.numel()
    if (cap < m * top_k or plan.sorted_weights.numel() != cap
            or plan.block_expert_ids.numel() != cap // block_m or plan.num_valid.numel() != 1):
        raise ValueError(
            f"plan: inconsistent sort metadata for M={m}, top_k={top_k}, block_m={block_m}: "
            f"sorted_ids {cap}, sorted_weights {plan.sorted_weights.numel()}, block_expert_ids "
            f"{plan.block_expert_ids.numel()} (expected sorted_ids >= M*top_k, sorted_weights "
            f"alike, block_expert_ids = sorted_ids // block_m)")
    if plan.out is not None and out_dim is not None:
        _check_tensor("plan.out", plan.out, dtypes=(torch.float32,), dim=2, device=device)
        if tuple(plan.out.shape) != (m, out_dim):
            raise ValueError(f"plan.out: expected [M, D] = [{m}, {out_dim}], got "
                             f"{tuple(plan.out.shape)}")
    # every valid tile holds at least one of the M * top_k entries: no more tiles than that
    return top_k, block_m, min(cap // block_m, m * top_k)


def _check_prepared(name, t, shape, device):
    """A prepared activation copy (mxfp4_mma.mma_prepare_x layout) or an output buffer for one:
    bf16, contiguous, of ``shape``, on ``device``; None passes."""
    if t is None:
        return None
    _check_tensor(name, t, dtypes=(torch.bfloat16,), dim=len(shape), device=device)
    if tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous bf16 {list(shape)} (the layout of "
                         f"mma_prepare_x), got {list(t.shape)} strides {t.stride()}")
    return t


def _check_activation(activation):
    if activation not in ACT_CODES:
        raise ValueError(f"activation: expected one of {sorted(ACT_CODES)}, got {activation!r}")
    return ACT_CODES[activation]


# ---------------------------------------------------------------------------------------------
# launchers


def moe_kernel_weights(weights: dict) -> dict:
    """``weights`` (a dict of MoE weights, as k3lab.weights.moe_weights makes them) with the
    expert weights w13 / w2 laid out as these kernels read them fastest: MXFP4 experts in the
    tiled layout where the shapes allow and MXFP4_TILED is set (a copy of the codes, made once,
    as an engine lays out its checkpoint at load time; the scales are shared), the rest as
    given. Every launcher also takes either layout."""
    out = dict(weights)
    for name in ("w13", "w2"):
        w = out.get(name)
        if isinstance(w, MXFP4) and MXFP4_TILED and mxfp4_tiled_ok(w.shape):
            out[name] = mxfp4_layout(w, "tiled")
    return out


def latent_down(x: torch.Tensor, down_weight: torch.Tensor | None,
                shared_w13: torch.Tensor | None = None, *, activation: str = "situ",
                situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                z_mma_out: torch.Tensor | None = None):
    """The MoE's front launch: latent down-projection and the shared MLP's gate/up, both GEMVs of
    x, in one kernel.

    x: bf16 [M, H]; down_weight: bf16 [D, H] or None (no latent); shared_w13: bf16 [2S, H] (gate
    rows then up rows) or None. Returns (z bf16 [M, D] or None, a_s bf16 [M, S] or None) with
    a_s = act(x @ Ws1^T, x @ Ws3^T). z_mma_out: bf16 [M, D] (D a multiple of 8) that also gets
    ``mma_prepare_x(z)``, for moe_stage1's z_mma (needs down_weight).
    """
    _check_tensor("x", x, dtypes=(torch.bfloat16,), dim=2)
    m, h = x.shape
    _check_tokens("x", m)
    act = _check_activation(activation)
    x_p = _pairs("x", x)
    d = s = 0
    if down_weight is not None:
        _check_tensor("down_weight", down_weight, dtypes=(torch.bfloat16,), dim=2, device=x.device)
        if down_weight.shape[1] != h:
            raise ValueError(f"down_weight: expected [D, H={h}], got {tuple(down_weight.shape)}")
        d = down_weight.shape[0]
    if shared_w13 is not None:
        _check_tensor("shared_w13", shared_w13, dtypes=(torch.bfloat16,), dim=2, device=x.device)
        if shared_w13.shape[1] != h or shared_w13.shape[0] % 2:
            raise ValueError(f"shared_w13: expected [2S, H={h}], got {tuple(shared_w13.shape)}")
        s = shared_w13.shape[0] // 2
    if not d and not s:
        return None, None
    if z_mma_out is not None and (not d or d % 8):
        raise ValueError(f"z_mma_out: needs down_weight with D a multiple of 8, got D={d}")
    _check_prepared("z_mma_out", z_mma_out, (m, d), x.device)
    z = torch.empty((m, d), device=x.device, dtype=torch.bfloat16) if d else None
    a_s = torch.empty((m, s), device=x.device, dtype=torch.bfloat16) if s else None
    block_m = triton.next_power_of_2(m)
    block_n, block_kp = _tiles(1, d + 2 * s, h // 2, block_m, target=FRONT_TARGET_PROGRAMS)
    n_shared = triton.cdiv(s, block_n)
    grid = (n_shared + triton.cdiv(d, block_n),)
    dummy = x_p
    _moe_front_kernel[grid](
        x_p, _pairs("down_weight", down_weight) if d else dummy, z if d else dummy,
        z_mma_out if z_mma_out is not None else dummy,
        _pairs("shared_w13", shared_w13) if s else dummy, a_s if s else dummy,
        m, h // 2, d, s, n_shared, float(situ_beta), float(situ_linear_beta),
        ACT=act, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KP=block_kp, TOKEN_LOOP=_token_loop(),
        PREPARED=z_mma_out is not None, num_warps=NUM_WARPS,
        TRIGGER=PDL_FRONT_TRIGGER and bool(_pdl(True)))
    return z, a_s


_MMA_LAYOUT_VERDICTS: dict = {}


def _check_mma_layout(kernel, grid, args: tuple, kwargs: dict) -> None:
    """Before a compiled launch with tensor-core tiles (FP4 code >= FP4_MMA_BASE): compile it
    (warmup, once per specialization) and check that Triton gave the mma operands the layout
    kernels/mxfp4_mma.py relies on; otherwise raise instead of computing a wrong answer."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    def spec(a):  # what Triton specializes on: int divisibility / 1, tensor dtype / alignment
        if isinstance(a, torch.Tensor):
            return ("tensor", a.dtype, a.data_ptr() % 16 == 0)
        if isinstance(a, int) and not isinstance(a, bool):
            return ("int", a % 16 == 0, a == 1)
        return (type(a).__name__, a)

    key = (kernel.fn.__name__, tuple(kwargs), tuple(spec(a) for a in (*args, *kwargs.values())))
    if key not in _MMA_LAYOUT_VERDICTS:
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        _MMA_LAYOUT_VERDICTS[key] = mma_layout_problem(compiled.asm["ttgir"])
    problem = _MMA_LAYOUT_VERDICTS[key]
    if problem is not None:
        raise RuntimeError(
            f"{kernel.fn.__name__}: this Triton ({triton.__version__}) laid out the MXFP4 "
            f"tensor-core tiles differently from what kernels/mxfp4_mma.py needs ({problem}); "
            "set k3lab.kernels.moe.FP4_MMA = False to use the K-lane tiles")


def _launch_stage1(z, plan, w13, act, situ_beta, situ_linear_beta, n_tiles, sync=None,
                   z_mma=None, a_mma_out=None, pdl=False):
    m, d = z.shape
    top_k, block_m, i = plan.topk_ids.shape[1], plan.block_m, w13.shape[1] // 2
    a = torch.empty((m * top_k, i), device=z.device, dtype=torch.bfloat16)
    block_mp = triton.next_power_of_2(block_m)
    mode = _mma_mode(w13, 1, block_m, n_tiles, i, prepared=z_mma is not None)
    if mode & _MMA_XP:
        z = z_mma  # the tiles read the prepared copy
    if mode:
        block_n, block_kp = _mma_block_n(mode, 1), MIN_PAIRS
    else:
        mode = _fp4_mode(w13, 1)
        block_n, block_kp = _expert_tiles(n_tiles, i, d // 2, block_mp, mode)
        mode = _fit_steps(mode, d // 8, block_kp // 4)
    grid = (n_tiles, triton.cdiv(i, block_n))
    out = plan.out
    zero_block = triton.next_power_of_2(max(ZERO_MIN_BLOCK,
                                            triton.cdiv(m * d, grid[0] * grid[1])))
    w_v, w_s = _expert_ptrs(w13)
    args = (z.view(torch.int32), w_v, w_s, plan.sorted_ids, plan.block_expert_ids,
            plan.num_valid, a, a_mma_out if a_mma_out is not None else a,
            out if out is not None else a,
            sync if sync is not None else plan.num_valid, m * top_k, block_m, top_k, i, d // 2,
            m * d, float(situ_beta), float(situ_linear_beta))
    kwargs = dict(ACT=act, FP4=mode, ZERO_OUT=out is not None, ZERO_SYNC=sync is not None,
                  ZERO_BLOCK=zero_block, BLOCK_M=block_mp, BLOCK_N=block_n, BLOCK_KP=block_kp,
                  TOKEN_LOOP=_token_loop(), PREPARED=a_mma_out is not None,
                  ONE_TRIP=PLAN_ONE_TRIP, TILED=_tiled(w13), num_warps=NUM_WARPS,
                  **_reg_cap(mode, 1),
                  **(_pdl(pdl, mode)
                     or dict(TRIGGER=PDL_STAGE1_TRIGGER and bool(_pdl(True, mode)))))
    if mode >= _MMA_BASE:
        _check_mma_layout(_moe_stage1_kernel, grid, args, kwargs)
    _moe_stage1_kernel[grid](*args, **kwargs)
    return a


def moe_stage1(z: torch.Tensor, plan: RoutePlan, w13, *, activation: str = "situ",
               situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
               z_mma: torch.Tensor | None = None,
               a_mma_out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Stage 1 "direct tile": a[t * top_k + k] = act(z[t] @ W1[e]^T, z[t] @ W3[e]^T),
    e = plan.topk_ids[t, k], computed along the plan's expert-sorted tiles.

    z: bf16 [M, D], M <= MAX_TOKENS. plan: RoutePlan over E experts (topk_ids int32 [M, top_k],
    sorted_ids / sorted_weights [cap], block_expert_ids [cap / block_m], num_valid [1]; out fp32
    [M, D] or None). w13: bf16 [E, 2I, D] (rows [0, I) gate, [I, 2I) up) or MXFP4 (packed uint8
    [E, 2I, D/2], scales uint8 [E, 2I, D/32]). Returns a: bf16 [M * top_k, I]. Side effect:
    zeroes plan.out (stage 2's accumulator) when present.
    z_mma: optional ``mma_prepare_x(z)`` (as latent_down's z_mma_out writes it), read instead of
    z by the MXFP4 tensor-core tiles (ignored by the other paths; the caller vouches that it is
    z's copy). a_mma_out: optional bf16 [M * top_k, I] that also gets ``mma_prepare_x(a)``,
    for moe_stage2's a_mma.
    pdl: launch with programmatic dependent launch (compiled MXFP4 tensor-core tiles; ignored
    otherwise): the kernel may start during the previous launch and reads the plan before
    waiting for it, so the plan must have been written at least two launches before this one
    (see PDL_STEPS).
    """
    _check_tensor("z", z, dtypes=(torch.bfloat16,), dim=2)
    m, d = z.shape
    _check_tokens("z", m)
    act = _check_activation(activation)
    e, two_i, k, _ = _check_experts("w13", w13, z.device)
    if k != d or two_i % 4:
        raise ValueError(f"w13: expected [E, 2I, D={d}] with I even, got {list(w13.shape)}")
    _pairs("z", z)
    _, _, n_tiles = _check_plan(plan, m, e, z.device, out_dim=d)
    _check_prepared("z_mma", z_mma, (m, d), z.device)
    if a_mma_out is not None and (two_i // 2) % 8:
        raise ValueError(f"a_mma_out: needs I a multiple of 8, got I={two_i // 2}")
    _check_prepared("a_mma_out", a_mma_out, (m * plan.topk_ids.shape[1], two_i // 2), z.device)
    return _launch_stage1(z, plan, w13, act, situ_beta, situ_linear_beta, n_tiles,
                          z_mma=z_mma, a_mma_out=a_mma_out, pdl=pdl)


def _stage2_args(a, plan, w2, deterministic, n_tiles, a_mma=None):
    """Stage-2 kernel arguments (validated inputs; a_mma: a's mma_prepare_x copy or None);
    returns (kwargs, programs, y)."""
    top_k, block_m = plan.topk_ids.shape[1], plan.block_m
    m, i = a.shape[0] // top_k, a.shape[1]
    d = w2.shape[1]
    y = plan.out
    if y is None:  # without route_sort's zeroed buffer: a memset (one more launch)
        y = (torch.empty if deterministic else torch.zeros)((m, d), device=a.device,
                                                            dtype=torch.float32)
    block_mp = 1 if deterministic else triton.next_power_of_2(block_m)
    rows = m if deterministic else n_tiles
    mode = _mma_mode(w2, 0 if deterministic else 2, block_m, rows, d, prepared=a_mma is not None)
    if mode & _MMA_XP:
        a = a_mma  # the tiles read the prepared copy
    if mode:
        block_n, block_kp, split = _mma_block_n(mode, 2), MIN_PAIRS, mode // 512 % 8 + 1
    else:
        mode = _fp4_mode(w2, 0 if deterministic else 2)
        block_n, block_kp = _expert_tiles(rows, d, i // 2, block_mp, mode)
        mode = _fit_steps(mode, i // 8, block_kp // 4)
        split = (mode - 2) // 32 % 16 + 1 if mode >= 2 else 1
    n_d = triton.cdiv(d, block_n)
    w_v, w_s = _expert_ptrs(w2)
    kw = dict(p_a=a.view(torch.int32), p_w=w_v, p_ws=w_s, p_sorted=plan.sorted_ids,
              p_sorted_w=plan.sorted_weights, p_block_expert=plan.block_expert_ids,
              p_num_valid=plan.num_valid, p_topk_ids=plan.topk_ids, p_topk_w=plan.topk_weights,
              p_y=y, n_entries=m * top_k, block_m=block_m, top_k=top_k, D=d, I_PAIRS=i // 2,
              n_d_tiles=n_d, n_stage2=rows * n_d * split, FP4=mode,
              DETERMINISTIC=bool(deterministic), BLOCK_M2=block_mp, BLOCK_N2=block_n,
              BLOCK_KP2=block_kp, TILED=_tiled(w2))
    return kw, rows * n_d * split, y


def _tail_args(y, norm_weight, up_weight, shared_out, shared_a, shared_w2, eps):
    """Tail kernel arguments (validated inputs); returns (kwargs, programs, out)."""
    m, d = y.shape
    latent = up_weight is not None
    h = up_weight.shape[0] if latent else d
    out = torch.empty((m, h), device=y.device, dtype=torch.bfloat16)
    shared = 2 if shared_a is not None else (1 if shared_out is not None else 0)
    s = shared_a.shape[1] if shared_a is not None else 0
    block_m = triton.next_power_of_2(m)
    block_n, block_kp = _tiles(1, h, max(d, s) // 2, block_m)
    block_ss = min(triton.next_power_of_2(d), max(MIN_PAIRS, PRODUCT_BUDGET // block_m))
    kw = dict(p_y=y, p_nw=norm_weight if latent else y, p_up=up_weight.view(torch.int32)
              if latent else y, p_sa=shared_a.view(torch.int32) if shared == 2 else y,
              p_sw2=shared_w2.view(torch.int32) if shared == 2 else y,
              p_shared=shared_out if shared == 1 else y, p_o=out, M=m, D=d, H=h, S_PAIRS=s // 2,
              eps=float(eps), LATENT=latent, SHARED=shared, BLOCK_MT=block_m, BLOCK_NT=block_n,
              BLOCK_KPT=block_kp, BLOCK_SS=block_ss)
    return kw, triton.cdiv(h, block_n), out


def _stage2_tail_kwargs(stage2, tail, sync=None):
    """(kwargs, programs) of one stage-2 + tail launch: stage2 / tail are (kwargs, programs,
    result) of _stage2_args / _tail_args or None; both given needs ``sync`` (int32 [2],
    zeroed)."""
    kw = {}
    if stage2 is None:  # dummies for the stage-2 parameters
        y = tail[0]["p_y"]
        kw.update(p_a=y, p_w=y, p_ws=y, p_sorted=y, p_sorted_w=y, p_block_expert=y,
                  p_num_valid=y, p_topk_ids=y, p_topk_w=y, n_entries=1, block_m=1, top_k=1,
                  D=tail[0]["D"], I_PAIRS=1, n_d_tiles=1, n_stage2=0, FP4=0,
                  DETERMINISTIC=False, BLOCK_M2=1, BLOCK_N2=MIN_ROWS, BLOCK_KP2=MIN_PAIRS,
                  TILED=False)
    else:
        kw.update(stage2[0])
    if tail is None:
        y = stage2[2]
        kw.update(p_nw=y, p_up=y, p_sa=y, p_sw2=y, p_shared=y, p_o=y, M=1, H=1, S_PAIRS=0,
                  eps=0.0, LATENT=False, SHARED=0, BLOCK_MT=1, BLOCK_NT=MIN_ROWS,
                  BLOCK_KPT=MIN_PAIRS, BLOCK_SS=MIN_PAIRS)
    else:
        kw.update(tail[0])
        kw.pop("p_y")
        kw["p_y"] = tail[0]["p_y"] if stage2 is None else stage2[2]
    n = (stage2[1] if stage2 else 0) + (tail[1] if tail else 0)
    kw["p_sync"] = sync if sync is not None else kw["p_y"]
    kw.update(STAGE2=stage2 is not None, TAIL=tail is not None, TOKEN_LOOP=_token_loop(),
              ONE_TRIP=PLAN_ONE_TRIP, PDL=False, PDL_STEPS=0)
    return kw, n


def _launch_stage2_tail(stage2, tail, sync=None, pdl=False):
    """One launch of the stage-2 + tail kernel (see _stage2_tail_kwargs); pdl: stage 2 alone
    or the tail alone with programmatic dependent launch (see PDL_STEPS)."""
    kw, n = _stage2_tail_kwargs(stage2, tail, sync)
    kw.update(num_warps=NUM_WARPS, **_reg_cap(kw["FP4"], 2))
    if tail is None and not kw["DETERMINISTIC"]:
        kw.update(_pdl(pdl, kw["FP4"]))
    elif stage2 is None:
        kw.update(_pdl(pdl))
    if kw["FP4"] >= _MMA_BASE:
        _check_mma_layout(_moe_stage2_tail_kernel, (n,), (), kw)
    _moe_stage2_tail_kernel[(n,)](**kw)


def moe_stage2(a: torch.Tensor, plan: RoutePlan, w2, *, deterministic: bool = False,
               a_mma: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Stage 2: out[t] = sum_k topk_weights[t, k] * (a[t * top_k + k] @ W2[e]^T) in fp32.

    a: bf16 [M * top_k, I] (stage 1's output). plan: as for moe_stage1; its ``out`` fp32 [M, D]
    must be zeroed (route_sort and moe_stage1 zero it) and is returned; when it is None a zeroed
    buffer is allocated. w2: bf16 [E, D, I] or MXFP4 (packed [E, D, I/2], scales [E, D, I/32]).
    Atomic (default): one program per (expert tile of the plan, D tile), fp32 atomic adds; the
    order of the adds varies between runs. deterministic=True: one program per (token, D tile)
    adding its top_k slots in slot order (bitwise reproducible; out is overwritten, not added to).
    a_mma: optional ``mma_prepare_x(a)`` (as moe_stage1's a_mma_out writes it), read instead of a
    by the MXFP4 tensor-core tiles (ignored by the other paths). pdl: as for moe_stage1 (the
    atomic tensor-core tiles only). Returns fp32 [M, D].
    """
    _check_tensor("a", a, dtypes=(torch.bfloat16,), dim=2)
    e, d, i, _ = _check_experts("w2", w2, a.device)
    if a.shape[1] != i or i % 2:
        raise ValueError(f"a: expected [M * top_k, I={i}] (I from w2 [E, D, I], even), got "
                         f"{tuple(a.shape)}")
    if not isinstance(plan, RoutePlan):
        raise ValueError(f"plan: expected a k3lab.plan.RoutePlan, got {type(plan).__name__}")
    top_k = plan.topk_ids.shape[-1]
    m = a.shape[0] // max(top_k, 1)
    if a.shape[0] != m * top_k:
        raise ValueError(f"a: expected M * top_k rows (top_k={top_k}), got {a.shape[0]}")
    _check_tokens("a", m)
    _, _, n_tiles = _check_plan(plan, m, e, a.device, out_dim=d)
    _check_prepared("a_mma", a_mma, tuple(a.shape), a.device)
    stage2 = _stage2_args(a, plan, w2, deterministic, n_tiles, a_mma)
    _launch_stage2_tail(stage2, None, pdl=pdl)
    return stage2[2]


def _check_shared_weights(shared: dict, m: int, h: int, device):
    for key in ("x", "w13", "w2"):
        if key not in shared:
            raise ValueError(f"shared: a weights dict needs keys 'x', 'w13', 'w2'; missing {key!r}")
    _check_tensor("shared['x']", shared["x"], dtypes=(torch.bfloat16,), dim=2, device=device)
    _check_tensor("shared['w2']", shared["w2"], dtypes=(torch.bfloat16,), dim=2, device=device)
    if tuple(shared["x"].shape) != (m, h) or shared["w2"].shape[0] != h:
        raise ValueError(f"shared: expected x [M={m}, H={h}] and w2 [H={h}, S], got x "
                         f"{tuple(shared['x'].shape)}, w2 {tuple(shared['w2'].shape)}")


def latent_moe_tail(y: torch.Tensor, norm_weight: torch.Tensor | None,
                    up_weight: torch.Tensor | None, shared=None, *, eps: float) -> torch.Tensor:
    """out = RMSNorm(y) @ W_up^T + shared, bf16 [M, H], RMSNorm and sums in fp32.

    y: fp32 [M, D] (stage 2's output). norm_weight: fp32 or bf16 [D]. up_weight: bf16 [H, D].
    norm_weight = up_weight = None: no latent (K2-style), out = y + shared with y [M, H].
    shared: None; a computed tensor [M, H] (bf16 or fp32), added (1 launch in all); or the shared
    MLP's weights ``{"x": bf16 [M, H], "w13": bf16 [2S, H], "w2": bf16 [H, S], "activation",
    "situ_beta", "situ_linear_beta"}``: gate/up run in a front launch (:func:`latent_down`), the
    down GEMV inside the tail's launch (2 launches in all); or ``{"a": bf16 [M, S], "w2": bf16
    [H, S]}``, the shared MLP's activation already computed (by :func:`latent_down`): its down
    GEMV runs inside the tail's launch (1 launch).
    """
    _check_tensor("y", y, dtypes=(torch.float32,), dim=2)
    m, d = y.shape
    _check_tokens("y", m)
    if (norm_weight is None) != (up_weight is None):
        raise ValueError("norm_weight: give both norm_weight and up_weight, or neither")
    h = d
    if up_weight is not None:
        _check_tensor("norm_weight", norm_weight, dtypes=(torch.float32, torch.bfloat16), dim=1,
                      device=y.device)
        _check_tensor("up_weight", up_weight, dtypes=(torch.bfloat16,), dim=2, device=y.device)
        if norm_weight.shape[0] != d or up_weight.shape[1] != d or d % 2:
            raise ValueError(f"up_weight: expected norm_weight [D={d}] and up_weight [H, D={d}] "
                             f"with D even, got {tuple(norm_weight.shape)}, "
                             f"{tuple(up_weight.shape)}")
        h = up_weight.shape[0]
    shared_out = shared_a = shared_w2 = None
    if isinstance(shared, torch.Tensor):
        _check_tensor("shared", shared, dtypes=(torch.bfloat16, torch.float32), dim=2,
                      device=y.device)
        if tuple(shared.shape) != (m, h):
            raise ValueError(f"shared: expected [M, H] = [{m}, {h}], got {tuple(shared.shape)}")
        shared_out = shared
    elif isinstance(shared, dict) and "a" in shared:
        for key in ("a", "w2"):
            _check_tensor(f"shared['{key}']", shared.get(key), dtypes=(torch.bfloat16,), dim=2,
                          device=y.device)
        shared_a, shared_w2 = shared["a"], shared["w2"]
        if shared_a.shape[0] != m or tuple(shared_w2.shape) != (h, shared_a.shape[1]):
            raise ValueError(f"shared: expected a [M={m}, S] and w2 [H={h}, S], got a "
                             f"{tuple(shared_a.shape)}, w2 {tuple(shared_w2.shape)}")
        _pairs("shared['a']", shared_a)
    elif isinstance(shared, dict):
        _check_shared_weights(shared, m, h, y.device)
        shared_w2 = shared["w2"]
        if shared_w2.shape[1] * 2 != shared["w13"].shape[0]:
            raise ValueError(f"shared: w2 must be [H, S] with w13 [2S, H], got w2 "
                             f"{tuple(shared_w2.shape)}, w13 {tuple(shared['w13'].shape)}")
        _, shared_a = latent_down(shared["x"], None, shared["w13"],
                                  activation=shared.get("activation", "situ"),
                                  situ_beta=shared.get("situ_beta", 4.0),
                                  situ_linear_beta=shared.get("situ_linear_beta", 25.0))
        _pairs("shared['w2']", shared_w2)
    elif shared is not None:
        raise ValueError(f"shared: expected None, a tensor [M, H] or a weights dict, got "
                         f"{type(shared).__name__}")
    if up_weight is None and shared is None:
        raise ValueError("shared: without a latent (up_weight None) the tail needs a shared term")
    tail = _tail_args(y, norm_weight, up_weight, shared_out, shared_a, shared_w2, eps)
    _launch_stage2_tail(None, tail)
    return tail[2]


def moe_block(x: torch.Tensor, weights: dict, *, cfg, plan: RoutePlan | None = None,
              block_m: int = 1, deterministic: bool = False,
              fuse_tail: bool = True, pdl: bool = True) -> torch.Tensor:
    """The latent MoE block of ARCHITECTURE.md section 4: route_sort (unless ``plan`` is given),
    front (latent down + shared gate/up), stage 1, then stage 2 and the tail (+ shared down) as
    one ticket-ordered launch: 3 launches given a plan, route_sort's plus 3 with routing.

    fuse_tail=False launches stage 2 and the tail separately (4 launches given a plan): no
    waiting across programs inside a kernel (see the module docstring for why the fused launch
    cannot deadlock and restarts from zeroed counters on every call and graph replay).
    pdl: programmatic dependent launch where it is safe (see PDL_STEPS and PDL_BLOCK_STAGE1):
    stage 1 after the front launch, and stage 2 and the tail when launched apart.

    x: bf16 [M, H], M <= MAX_TOKENS. weights: the dict of ``k3lab.weights.moe_weights``
    (gate_weight, correction_bias; latent_down [D, H], latent_norm [D], latent_up [H, D] when
    cfg.latent; w13 [E, 2I, D], w2 [E, D, I] bf16 or MXFP4; shared_w13 [2S, H], shared_w2
    [H, S] when cfg.shared_intermediate). cfg: a k3lab Preset. plan: a RoutePlan for x (skips
    routing; block_m is then the plan's; its out is re-zeroed by stage 1). Returns bf16 [M, H].
    """
    _check_tensor("x", x, dtypes=(torch.bfloat16,), dim=2)
    m, h = x.shape
    _check_tokens("x", m)
    if h != cfg.hidden:
        raise ValueError(f"x: expected [M, H={cfg.hidden}] for preset {cfg.name}, got "
                         f"{tuple(x.shape)}")
    need = ["w13", "w2"]
    need += ["latent_down", "latent_norm", "latent_up"] if cfg.latent else []
    need += ["shared_w13", "shared_w2"] if cfg.shared_intermediate else []
    need += ["gate_weight", "correction_bias"] if plan is None else []
    missing = [k for k in need if k not in weights]
    if missing:
        raise ValueError(f"weights: missing {missing} for preset {cfg.name}")
    act = _check_activation(cfg.activation)
    betas = (cfg.situ_beta, cfg.situ_linear_beta)
    w13, w2 = weights["w13"], weights["w2"]
    e, two_i, d, _ = _check_experts("w13", w13, x.device)
    e2, d2, i2, _ = _check_experts("w2", w2, x.device)
    if (d, two_i, e2, d2, i2) != (cfg.moe_in, 2 * cfg.moe_intermediate, e, cfg.moe_in,
                                  cfg.moe_intermediate) or i2 % 2:
        raise ValueError(f"w13: expected w13 [E, 2I, D] and w2 [E, D, I] with D={cfg.moe_in}, "
                         f"I={cfg.moe_intermediate} (even), got {list(w13.shape)}, "
                         f"{list(w2.shape)}")
    if plan is None:
        from .route_sort import route_sort

        plan = route_sort(x, weights["gate_weight"], weights["correction_bias"], top_k=cfg.top_k,
                          n_group=cfg.n_group, topk_group=cfg.topk_group,
                          renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling,
                          block_m=block_m, out_dim=d)
    _, _, n_tiles = _check_plan(plan, m, e, x.device, out_dim=d)
    if plan.out is None:
        raise ValueError("plan.out: moe_block needs the plan's zeroed fp32 [M, D] buffer "
                         "(route_sort(..., out_dim=D))")
    shared_w13 = weights["shared_w13"] if cfg.shared_intermediate else None
    # prepared activations for the tensor-core tiles: the front kernel writes z's copy, stage 1
    # a's (latent presets; K2-style stage 1 reads x itself)
    i = two_i // 2
    prep1 = (FP4_MMA_X_PREPARED and cfg.latent and d % 8 == 0
             and _mma_mode(w13, 1, plan.block_m, n_tiles, i) > 0)
    prep2 = (FP4_MMA_X_PREPARED and i % 8 == 0
             and _mma_mode(w2, 0 if deterministic else 2, plan.block_m, n_tiles, d) > 0)
    z_mma = torch.empty((m, d), device=x.device, dtype=torch.bfloat16) if prep1 else None
    a_mma = (torch.empty((m * plan.topk_ids.shape[1], i), device=x.device, dtype=torch.bfloat16)
             if prep2 else None)
    z, shared_a = latent_down(x, weights["latent_down"] if cfg.latent else None, shared_w13,
                              activation=cfg.activation, situ_beta=betas[0],
                              situ_linear_beta=betas[1], z_mma_out=z_mma)
    sync = torch.empty(2, device=x.device, dtype=torch.int32)
    front = z is not None or shared_a is not None  # a launch between the plan and stage 1
    a = _launch_stage1(z if cfg.latent else x, plan, w13, act, *betas, n_tiles, sync=sync,
                       z_mma=z_mma, a_mma_out=a_mma, pdl=pdl and front and PDL_BLOCK_STAGE1)
    stage2 = _stage2_args(a, plan, w2, deterministic, n_tiles, a_mma)
    if not cfg.latent and shared_a is None:  # K2-style without shared experts: y is the output
        _launch_stage2_tail(stage2, None, pdl=pdl)
        return stage2[2].to(torch.bfloat16)
    shared_w2 = weights["shared_w2"] if shared_a is not None else None
    if shared_w2 is not None:
        _check_tensor("shared_w2", shared_w2, dtypes=(torch.bfloat16,), dim=2, device=x.device)
        if tuple(shared_w2.shape) != (h, cfg.shared_intermediate):
            raise ValueError(f"shared_w2: expected [H, S] = [{h}, {cfg.shared_intermediate}], "
                             f"got {tuple(shared_w2.shape)}")
    if cfg.latent:
        for name, shape in (("latent_norm", (d,)), ("latent_up", (h, d))):
            _check_tensor(name, weights[name], dtypes=(torch.bfloat16, torch.float32),
                          dim=len(shape), device=x.device)
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"{name}: expected {list(shape)}, got "
                                 f"{list(weights[name].shape)}")
        tail = _tail_args(stage2[2], weights["latent_norm"], weights["latent_up"], None,
                          shared_a, shared_w2, cfg.rms_eps)
    else:
        tail = _tail_args(stage2[2], None, None, None, shared_a, shared_w2, cfg.rms_eps)
    if fuse_tail:
        _launch_stage2_tail(stage2, tail, sync)
    else:
        _launch_stage2_tail(stage2, None, pdl=pdl)
        _launch_stage2_tail(None, tail, pdl=pdl)
    return tail[2]
