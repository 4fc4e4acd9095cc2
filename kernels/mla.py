"""Split-KV absorbed MLA decode (docs/model.md).

For every token m and head h, over the first ``seq_lens[m]`` rows ``[c_t | kr_t]`` of its cache::

    s[h, t]  = (q_lat[h] . c_t + q_rope[h] . kr_t) * sm_scale
    o_lat[h] = sum_t softmax_t(s)[h, t] c_t,        lse[h] = log sum_t exp(s[h, t])

Two kernels. ``_mla_decode_split_kernel``: one program per (token, group of BLOCK_H heads, split);
all heads of a token share the cache rows, so the program reads each cache tile once for its
BLOCK_H heads ([BLOCK_H, C] x [C, BLOCK_N] scores, online softmax in base 2) and writes a partial
o [C] fp32 and its log-sum-exp per head. ``_mla_decode_combine_kernel`` merges the splits. With a
single split the first kernel writes the final output itself (one launch). On CUDA the combine
is launched with programmatic dependent launch (``MLAConfig.combine_pdl``): it starts while the
split grid runs and waits for it on the device.

The split of the context is computed on the device from ``seq_lens``: a token of length L gets
``cdiv(cdiv(L, BLOCK_N), num_splits)`` blocks per split and splits past the end do nothing (their
lse is -inf). The grid depends only on (M, Hl, num_splits), so an explicit ``num_splits`` lets one
captured CUDA graph serve every length up to L_max.

How the kernels are tiled and launched is an :class:`MLAConfig` (each default's evidence:
docs/decisions.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .runtime import check_device, check_number, check_validate

__all__ = ["mla_decode", "default_num_splits", "MLAConfig", "BLOCK_H", "MAX_SPLITS",
           "COMBINE_MAX_BLOCK_S"]

# Heads per program: every head of a token reads the same cache rows, so a program takes a group
# of them; 16 is tl.dot's smallest M (K3 at tp 8 has 12 heads: one group, 4 padded rows).
BLOCK_H = 16
# Combine: a program merges a [BLOCK_S splits, BLOCK_C latent columns] fp32 tile per step, at
# most COMBINE_TILE elements (32 registers a thread at 4 warps). Up to COMBINE_MAX_BLOCK_S splits
# are merged in one step (the heuristic's counts on an H200 take a single step); the columns
# shrink to fit, but not below COMBINE_MIN_BLOCK_C (64-byte row segments).
COMBINE_TILE = 4096
COMBINE_MAX_BLOCK_S = 256
COMBINE_MIN_BLOCK_C = 16
MAX_SPLITS = 1024
# SM count assumed on CPU (Triton interpreter), so the heuristic still varies with the length.
CPU_SM_STANDIN = 8


@dataclass(frozen=True)
class MLAConfig:
    """How ``mla_decode`` tiles and launches its kernels. Every choice changes speed only.

    block_n, num_warps, num_stages: cache rows per inner step (a [block_n, C + R] tile), warps
        and pipeline stages of the split kernel.
    score_chunks: 1, 2 or 4 column chunks of the latent, each with its own tensor-core product
        for the scores (independent accumulator chains) and its own P @ C accumulator; lowered
        until a chunk has at least 16 columns.
    defer_row_sum: accumulate the softmax denominator per element ([BLOCK_H, block_n], rescaled
        like the output) and reduce it over the rows once after the loop: one cross-warp
        reduction (two barriers) out of every tile.
    programs_per_sm, min_rows_per_split: the split-count heuristic (``num_splits=None``): enough
        (token, head group, split) programs for programs_per_sm per SM, but at least
        min_rows_per_split cache rows a split, so its fixed cost (loading q, writing a
        [BLOCK_H, C] fp32 partial) stays small next to its reads.
    combine_pdl: launch the combine with programmatic dependent launch: the split kernel lets
        it launch once every split program has started and it waits on the device for the split
        grid, so its launch and start overlap the split kernel (CUDA only).
    split_pdl: launch the split kernel with programmatic dependent launch too (it waits for the
        preceding grid at its start; the call's last kernel lets the next grid launch at its
        start): saves the call's first launch behind whatever ran before (CUDA only).
    absorb_pdl: launch ``mla_absorb_q`` and ``mla_absorb_out`` (kernels/mla_absorb.py) with
        programmatic dependent launch: each loads its kv_b tile before its wait for the
        previous grid; the combine (or a single split) then lets the v absorb launch at its
        start (CUDA only).
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    score_chunks: int = 4
    defer_row_sum: bool = True
    programs_per_sm: int = 1
    min_rows_per_split: int = 128
    combine_pdl: bool = True
    split_pdl: bool = False
    absorb_pdl: bool = True

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in (bool, "bool"):
                if not isinstance(v, bool):
                    raise ValueError(f"{f.name}: expected a bool, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name}: expected a positive int, got {v!r}")
        if self.score_chunks not in (1, 2, 4):
            raise ValueError(f"score_chunks: expected 1, 2 or 4, got {self.score_chunks!r}")
        for name in ("block_n", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1) or (name == "block_n" and v < 16):
                raise ValueError(f"{name}: expected a power of two"
                                 f"{' >= 16' if name == 'block_n' else ''}, got {v}")


_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _load_rows(p_rows, m_n, o_col, DOT_FP32: tl.constexpr):
    """[BLOCK_N, COLS] tile: rows p_rows [BLOCK_N, 1] (masked by m_n [BLOCK_N]) at columns o_col."""
    b = tl.load(p_rows + o_col[None, :], mask=m_n[:, None], other=0.0)
    if DOT_FP32:  # the interpreter's tl.dot is wrong on bf16: compute in fp32 there
        b = b.to(tl.float32)
    return b


@triton.jit
def _load_q(p_q, m_h, o_col, DOT_FP32: tl.constexpr):
    """[BLOCK_H, COLS] query tile: head rows p_q [BLOCK_H, 1] (masked by m_h) at columns o_col."""
    b = tl.load(p_q + o_col[None, :], mask=m_h[:, None], other=0.0)
    if DOT_FP32:
        b = b.to(tl.float32)
    return b


@triton.jit
def _tile_scores(p_n, m_n, o_w, o_r, b_q0, b_q1, b_q2, b_q3, b_qr, sm_scale_log2,
                 C: tl.constexpr, CW: tl.constexpr, CHUNKS: tl.constexpr,
                 DOT_FP32: tl.constexpr):
    """Base-2 scores [BLOCK_H, BLOCK_N] of the cache rows p_n [BLOCK_N, 1] (masked rows -inf)
    and the latent chunks [BLOCK_N, CW] read for them (c1..c3 repeat c0 where CHUNKS is less)."""
    b_c0 = _load_rows(p_n, m_n, o_w, DOT_FP32)
    b_kr = _load_rows(p_n, m_n, C + o_r, DOT_FP32)
    b_c1 = b_c0
    b_c2 = b_c0
    b_c3 = b_c0
    if CHUNKS == 1:
        # one chain: Triton folds the sum into the second product's accumulator
        b_s = (tl.dot(b_q0, tl.trans(b_c0)) + tl.dot(b_qr, tl.trans(b_kr))) * sm_scale_log2
    else:
        b_c1 = _load_rows(p_n, m_n, CW + o_w, DOT_FP32)
        # each product scaled before the sum: no product becomes another's accumulator
        b_s = (tl.dot(b_qr, tl.trans(b_kr)) * sm_scale_log2
               + tl.dot(b_q0, tl.trans(b_c0)) * sm_scale_log2)
        b_s += tl.dot(b_q1, tl.trans(b_c1)) * sm_scale_log2
        if CHUNKS > 2:
            b_c2 = _load_rows(p_n, m_n, 2 * CW + o_w, DOT_FP32)
            b_c3 = _load_rows(p_n, m_n, 3 * CW + o_w, DOT_FP32)
            b_s += (tl.dot(b_q2, tl.trans(b_c2)) * sm_scale_log2
                    + tl.dot(b_q3, tl.trans(b_c3)) * sm_scale_log2)
    b_s = tl.where(m_n[None, :], b_s, float("-inf"))
    return b_s, b_c0, b_c1, b_c2, b_c3


@triton.jit
def _mla_decode_split_kernel(
    q_lat, q_rope, kv, seq_lens, o, lse,
    sm_scale_log2, num_splits, H, L_max,
    stride_ql_m, stride_ql_h, stride_qr_m, stride_qr_h, stride_kv_m, stride_kv_n,
    stride_o_m, stride_o_h, stride_o_s, stride_lse_m, stride_lse_h,
    C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr, DEFER_SUM: tl.constexpr, DOT_FP32: tl.constexpr,
    FINAL: tl.constexpr, PDL_WAIT: tl.constexpr, PDL_TRIGGER: tl.constexpr,
):
    """Grid (M, head groups, num_splits): split i_s of head group i_hb of token i_m.

    q_lat [M, Hl, C], q_rope [M, Hl, R], kv [M, L_max, C + R] (bf16 / fp16), seq_lens [M] int32.
    FINAL: single split; o is the output [M, Hl, C] (q_lat's dtype) and lse the natural-log lse
    [M, Hl] fp32. Otherwise o is the fp32 partial [M, Hl, S, C] and lse the base-2 partial lse
    [M, Hl, S] fp32 (an empty split writes o = 0, lse = -inf).
    CHUNKS in {1, 2, 4}: the latent columns in that many chunks of CW = C / CHUNKS, each with its
    own score product and its own [BLOCK_H, CW] output accumulator. DEFER_SUM: the denominator
    kept per element ([BLOCK_H, BLOCK_N]), reduced over the rows once after the loop.
    PDL_WAIT: first wait for the preceding grid (griddepcontrol.wait; launched with launch_pdl).
    PDL_TRIGGER: then let the dependent grid launch (griddepcontrol.launch_dependents)."""
    CW: tl.constexpr = C // CHUNKS
    i_m, i_hb, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL_WAIT:
        gdc_wait()
    if PDL_TRIGGER:
        gdc_launch_dependents()
    i_m64 = i_m.to(tl.int64)
    L = tl.load(seq_lens + i_m)
    # a length outside [0, L_max] reads nothing and poisons the token's output (NaN) instead of
    # reading past the cache; the host refuses it where it can check without a sync
    bad = (L < 0) | (L_max < L)
    L = tl.where(bad, 0, L)
    blocks_per_split = tl.cdiv(tl.cdiv(L, BLOCK_N), num_splits)
    start = i_s * blocks_per_split * BLOCK_N
    end = tl.minimum(start + blocks_per_split * BLOCK_N, L)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_w = tl.arange(0, CW)
    o_r = tl.arange(0, R)
    p_ql = q_lat + i_m64 * stride_ql_m + o_h[:, None] * stride_ql_h
    b_qr = _load_q(q_rope + i_m64 * stride_qr_m + o_h[:, None] * stride_qr_h, m_h, o_r, DOT_FP32)
    b_q0 = _load_q(p_ql, m_h, o_w, DOT_FP32)
    b_q1 = b_q0
    b_q2 = b_q0
    b_q3 = b_q0
    if CHUNKS > 1:
        b_q1 = _load_q(p_ql, m_h, CW + o_w, DOT_FP32)
    if CHUNKS > 2:
        b_q2 = _load_q(p_ql, m_h, 2 * CW + o_w, DOT_FP32)
        b_q3 = _load_q(p_ql, m_h, 3 * CW + o_w, DOT_FP32)

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_l2 = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    b_acc0 = tl.zeros([BLOCK_H, CW], dtype=tl.float32)
    b_acc1 = tl.zeros([BLOCK_H, CW], dtype=tl.float32)
    b_acc2 = tl.zeros([BLOCK_H, CW], dtype=tl.float32)
    b_acc3 = tl.zeros([BLOCK_H, CW], dtype=tl.float32)
    p_kv = kv + i_m64 * stride_kv_m
    for n0 in range(start, end, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < end
        b_s, b_c0, b_c1, b_c2, b_c3 = _tile_scores(
            p_kv + o_n[:, None] * stride_kv_n, m_n, o_w, o_r, b_q0, b_q1, b_q2, b_q3, b_qr,
            sm_scale_log2, C, CW, CHUNKS, DOT_FP32)
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp2(b_m - b_m_new)
        b_p = tl.exp2(b_s - b_m_new[:, None])
        if DEFER_SUM:
            b_l2 = b_l2 * b_alpha[:, None] + b_p
        else:
            b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_pc = b_p.to(b_c0.dtype)
        b_acc0 = b_acc0 * b_alpha[:, None] + tl.dot(b_pc, b_c0)
        if CHUNKS > 1:
            b_acc1 = b_acc1 * b_alpha[:, None] + tl.dot(b_pc, b_c1)
        if CHUNKS > 2:
            b_acc2 = b_acc2 * b_alpha[:, None] + tl.dot(b_pc, b_c2)
            b_acc3 = b_acc3 * b_alpha[:, None] + tl.dot(b_pc, b_c3)
        b_m = b_m_new

    if DEFER_SUM:
        b_l = tl.sum(b_l2, axis=1)
    # an empty split (or a zero length) leaves l = 0, acc = 0: o = 0 and lse = -inf
    b_den = tl.where(b_l > 0, b_l, 1.0)[:, None]
    b_lse = tl.where(b_l > 0, b_m + tl.log2(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))
    if FINAL:
        b_lse = b_lse * 0.6931471805599453  # base 2 -> natural log
    b_den = tl.where(bad, float("nan"), b_den)
    b_lse = tl.where(bad, float("nan"), b_lse)
    p_o = o + i_m64 * stride_o_m + i_s * stride_o_s + o_h[:, None] * stride_o_h + o_w[None, :]
    tl.store(p_o, (b_acc0 / b_den).to(o.dtype.element_ty), mask=m_h[:, None])
    if CHUNKS > 1:
        tl.store(p_o + CW, (b_acc1 / b_den).to(o.dtype.element_ty), mask=m_h[:, None])
    if CHUNKS > 2:
        tl.store(p_o + 2 * CW, (b_acc2 / b_den).to(o.dtype.element_ty), mask=m_h[:, None])
        tl.store(p_o + 3 * CW, (b_acc3 / b_den).to(o.dtype.element_ty), mask=m_h[:, None])
    tl.store(lse + i_m64 * stride_lse_m + o_h * stride_lse_h + i_s, b_lse, mask=m_h)


@triton.jit
def _mla_decode_combine_kernel(
    o_part, lse_part, o, lse, num_splits,
    stride_op_m, stride_op_h, stride_op_s, stride_lp_m, stride_lp_h,
    stride_o_m, stride_o_h, stride_lse_m,
    C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL_WAIT: tl.constexpr, PDL_TRIGGER: tl.constexpr,
):
    """Grid (M, Hl, cdiv(C, BLOCK_C)): columns [i_c * BLOCK_C, +BLOCK_C) of head i_h of token i_m.

    o_part [M, Hl, S, C] fp32 and lse_part [M, Hl, S] fp32 (base 2): the split kernel's partials;
    o [M, Hl, C] (q_lat's dtype) gets their softmax-weighted sum by lse, lse [M, Hl] fp32 the
    natural-log lse (from column block 0); empty splits (lse -inf, o 0) weigh 0.
    PDL_WAIT: wait for the split grid before reading its partials (griddepcontrol.wait; launched
    with launch_pdl), which are then read from L2 (.cg). PDL_TRIGGER: let the next grid launch
    (launch_dependents)."""
    i_m, i_h, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL_TRIGGER:
        gdc_launch_dependents()
    if PDL_WAIT:
        gdc_wait()
    # started before the split grid ended (PDL): the partials from L2, never from this SM's L1
    CACHE: tl.constexpr = ".cg" if PDL_WAIT else ""
    i_m64 = i_m.to(tl.int64)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < C
    p_lp = lse_part + i_m64 * stride_lp_m + i_h * stride_lp_h
    p_op = o_part + i_m64 * stride_op_m + i_h * stride_op_h

    b_m = tl.full([1], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([1], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    b_nan = tl.zeros([1], dtype=tl.int32)  # NaN partials (a refused length): NaN out
    for s0 in range(0, num_splits, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < num_splits
        b_lse = tl.load(p_lp + o_s, mask=m_s, other=float("-inf"), cache_modifier=CACHE)
        b_nan += tl.sum((b_lse != b_lse).to(tl.int32), axis=0)
        b_m_new = tl.maximum(b_m, tl.max(b_lse, axis=0))
        b_ref = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no -inf - -inf
        b_alpha = tl.exp2(b_m - b_ref)
        b_w = tl.exp2(b_lse - b_ref)
        # not masked by the lse: the two loads then fly together (an empty split wrote o = 0
        # and gets weight 0)
        b_op = tl.load(p_op + o_s[:, None] * stride_op_s + o_c[None, :],
                       mask=m_s[:, None] & m_c[None, :], other=0.0, cache_modifier=CACHE)
        b_acc = b_acc * b_alpha + tl.sum(b_w[:, None] * b_op, axis=0)
        b_l = b_l * b_alpha + tl.sum(b_w, axis=0)
        b_m = b_m_new

    b_o = b_acc / tl.where(b_nan > 0, float("nan"), tl.where(b_l > 0, b_l, 1.0))
    tl.store(o + i_m64 * stride_o_m + i_h * stride_o_h + o_c, b_o.to(o.dtype.element_ty),
             mask=m_c)
    if i_c == 0:
        b_lse_out = tl.where(b_l > 0, b_m + tl.log2(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))
        b_lse_out = tl.where(b_nan > 0, float("nan"), b_lse_out)
        tl.store(lse + i_m64 * stride_lse_m + i_h + tl.arange(0, 1), b_lse_out * 0.6931471805599453)


@functools.cache
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index or 0).multi_processor_count
    return CPU_SM_STANDIN


def _config(config) -> MLAConfig:
    if config is None:
        return MLAConfig()
    if not isinstance(config, MLAConfig):
        raise ValueError(f"config: expected an MLAConfig or None, got {type(config).__name__}")
    return config


def default_num_splits(batch: int, heads: int, max_len: int,
                       device: torch.device | str = "cuda",
                       config: MLAConfig | None = None) -> int:
    """The split count ``mla_decode`` picks when ``num_splits=None``.

    From host-known sizes only (never the lengths' values): enough (token, head group, split)
    programs for ``config.programs_per_sm`` per SM, but at most one split per
    ``config.min_rows_per_split`` rows of L_max, within [1, MAX_SPLITS].
    """
    cfg = _config(config)
    dev = torch.device(device)
    sms = _sm_count(dev.type, dev.index if dev.type == "cuda" else None)
    programs = batch * triton.cdiv(heads, BLOCK_H)
    by_occupancy = triton.cdiv(cfg.programs_per_sm * sms, programs)
    by_length = max_len // cfg.min_rows_per_split
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _score_chunks(c: int, cfg: MLAConfig) -> int:
    """cfg.score_chunks, lowered until a chunk has at least 16 latent columns."""
    chunks = cfg.score_chunks
    while chunks > 1 and c // chunks < 16:
        chunks //= 2
    return chunks


def _pdl(cfg: MLAConfig, on_gpu: bool, final: bool) -> tuple[bool, bool]:
    """(combine launched with PDL, split kernel launched with PDL): CUDA only, the interpreter
    runs the plain launches; no combine with a single split."""
    return cfg.combine_pdl and on_gpu and not final, cfg.split_pdl and on_gpu


def _is_pow2_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def check_seq_lens(seq_lens: torch.Tensor, max_len: int, validate: str) -> None:
    """Refuse lengths outside [0, max_len] (the cache's rows): always when ``seq_lens`` is on
    the host (no sync), and on a GPU with ``validate="full"`` (one device-to-host copy and
    sync per call; not allowed inside a CUDA-graph capture). Otherwise a bad length is left to
    the kernel, which reads nothing for that token and writes NaN."""
    check_validate(validate)
    if seq_lens.device.type != "cpu" and validate != "full":
        return
    lens = seq_lens.cpu().numpy()  # no ATen op on host tensors (CPU launch counts unchanged)
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 0 or hi > max_len:
        raise ValueError(f"seq_lens: expected lengths in [0, L_max={max_len}] (the cache's "
                         f"rows), got min {lo}, max {hi}")


def _validate(q_lat, q_rope, kv_cache, seq_lens, sm_scale, num_splits):
    for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("kv_cache", kv_cache),
                    ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q_lat.dim() != 3:
        raise ValueError(f"q_lat: expected [M, Hl, C] (3-D), got shape {tuple(q_lat.shape)}")
    m, h, c = q_lat.shape
    if q_rope.dim() != 3 or q_rope.shape[:2] != (m, h):
        raise ValueError(f"q_rope: expected [M, Hl, R] = [{m}, {h}, R], "
                         f"got shape {tuple(q_rope.shape)}")
    r = q_rope.shape[2]
    if kv_cache.dim() != 3 or kv_cache.shape[0] != m or kv_cache.shape[2] != c + r:
        raise ValueError(f"kv_cache: expected [M, L_max, C + R] = [{m}, L_max, {c + r}], "
                         f"got shape {tuple(kv_cache.shape)}")
    if m < 1 or h < 1 or kv_cache.shape[1] < 1:
        raise ValueError(f"q_lat/kv_cache: M, Hl and L_max must be >= 1, got M={m}, Hl={h}, "
                         f"L_max={kv_cache.shape[1]}")
    if not _is_pow2_at_least_16(c):
        raise ValueError(f"q_lat: latent size C must be a power of two >= 16, got {c}")
    if not _is_pow2_at_least_16(r):
        raise ValueError(f"q_rope: rope size R must be a power of two >= 16, got {r}")
    if seq_lens.shape != (m,):
        raise ValueError(f"seq_lens: expected shape [{m}], got {tuple(seq_lens.shape)}")
    if seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens: expected torch.int32, got {seq_lens.dtype}")
    if q_lat.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q_lat: expected torch.bfloat16 or torch.float16, got {q_lat.dtype}")
    for name, t in (("q_rope", q_rope), ("kv_cache", kv_cache)):
        if t.dtype != q_lat.dtype:
            raise ValueError(f"{name}: expected {q_lat.dtype} like q_lat, got {t.dtype}")
    for name, t in (("q_rope", q_rope), ("kv_cache", kv_cache), ("seq_lens", seq_lens)):
        if t.device != q_lat.device:
            raise ValueError(f"{name}: expected device {q_lat.device} like q_lat, got {t.device}")
    check_device("q_lat", q_lat)
    for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("kv_cache", kv_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides "
                             f"{t.stride()}")
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens: expected a contiguous tensor")
    check_number("sm_scale", sm_scale, positive=True)
    if num_splits is not None and (isinstance(num_splits, bool)
                                   or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits: expected None or an int in [1, {MAX_SPLITS}], "
                         f"got {num_splits!r}")


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
               seq_lens: torch.Tensor, *, sm_scale: float, num_splits: int | None = None,
               return_lse: bool = False, config: MLAConfig | None = None,
               validate: str = "cheap"):
    """Absorbed MLA decode attention over the latent cache (split-KV, two kernels).

    q_lat: [M, Hl, C] bf16/fp16 (q_nope absorbed through W_uk; C = kv_lora, 512 for K3).
    q_rope: [M, Hl, R] same dtype (R = qk_rope, 64 for K3).
    kv_cache: [M, L_max, C + R] same dtype; per position the latent c then the rope values kr.
    seq_lens: [M] int32 on the same device; lengths in [1, L_max] (a zero length gives o = 0,
        lse = -inf). Rows at or past a length are never read. A length beyond L_max (or
        negative) is a ValueError where it can be checked without a host sync (CPU tensors, or
        ``validate="full"``); otherwise that token's output and lse are NaN and nothing past
        the cache is read.
    sm_scale: the score scale (K3: (qk_nope + qk_rope) ** -0.5).
    num_splits: pieces the context is cut into. None picks :func:`default_num_splits` from the
        host shapes (M, Hl, L_max) and the SM count; an int in [1, MAX_SPLITS] fixes the grid,
        so one captured CUDA graph serves every length up to L_max.
    config: the :class:`MLAConfig` (None: the defaults); it changes speed, not the result.
    validate: "cheap" (shapes, dtypes, devices, scalars; no sync) or "full" (also the lengths
        of CUDA ``seq_lens``: one host sync).
    Returns o_lat [M, Hl, C] in q_lat's dtype; with ``return_lse`` also lse [M, Hl] fp32 (natural
    log of sum_t exp(score), scores scaled). No host synchronization.
    """
    _validate(q_lat, q_rope, kv_cache, seq_lens, sm_scale, num_splits)
    check_seq_lens(seq_lens, kv_cache.shape[1], validate)
    cfg = _config(config)
    m, h, c = q_lat.shape
    r = q_rope.shape[2]
    dev = q_lat.device
    if num_splits is None:
        num_splits = default_num_splits(m, h, kv_cache.shape[1], dev, cfg)
    num_splits = int(num_splits)
    dot_fp32 = dev.type == "cpu"
    on_gpu = dev.type == "cuda"
    out = torch.empty((m, h, c), device=dev, dtype=q_lat.dtype)
    lse = torch.empty((m, h), device=dev, dtype=torch.float32)
    final = num_splits == 1
    pdl, split_pdl = _pdl(cfg, on_gpu, final)
    absorb = cfg.absorb_pdl and on_gpu  # the v absorb after this call waits by PDL
    if final:
        o_dst, lse_dst = out, lse
        so = (out.stride(0), out.stride(1), 0)
        sl = (lse.stride(0), lse.stride(1))
    else:
        o_dst = torch.empty((m, h, num_splits, c), device=dev, dtype=torch.float32)
        lse_dst = torch.empty((m, h, num_splits), device=dev, dtype=torch.float32)
        so = (o_dst.stride(0), o_dst.stride(1), o_dst.stride(2))
        sl = (lse_dst.stride(0), lse_dst.stride(1))
    _mla_decode_split_kernel[(m, triton.cdiv(h, BLOCK_H), num_splits)](
        q_lat, q_rope, kv_cache, seq_lens, o_dst, lse_dst,
        sm_scale * _LOG2E, num_splits, h, kv_cache.shape[1],
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), *so, *sl,
        C=c, R=r, BLOCK_H=BLOCK_H, BLOCK_N=cfg.block_n, CHUNKS=_score_chunks(c, cfg),
        DEFER_SUM=cfg.defer_row_sum, DOT_FP32=dot_fp32, FINAL=final,
        PDL_WAIT=split_pdl, PDL_TRIGGER=pdl or split_pdl or (final and absorb),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if split_pdl else {}),
    )
    if not final:
        block_s = min(triton.next_power_of_2(num_splits), COMBINE_MAX_BLOCK_S)
        block_c = min(c, max(COMBINE_MIN_BLOCK_C, COMBINE_TILE // block_s))
        _mla_decode_combine_kernel[(m, h, triton.cdiv(c, block_c))](
            o_dst, lse_dst, out, lse, num_splits,
            o_dst.stride(0), o_dst.stride(1), o_dst.stride(2),
            lse_dst.stride(0), lse_dst.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            C=c, BLOCK_C=block_c, BLOCK_S=block_s, PDL_WAIT=pdl, PDL_TRIGGER=split_pdl or absorb,
            **({"launch_pdl": True} if pdl else {}),
        )
    return (out, lse) if return_lse else out
