"""Fused KDA (Kimi Delta Attention) decode: one launch per layer (docs/model.md).

Per token m and head h, with S = state[m, h] [d (k), d (v)] fp32:

    f    = f_b[h*d:(h+1)*d] @ f_low[m]                        # the f_b projection (rank R -> d)
    g    = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h]))
    beta = sigmoid(b_logits[m, h])
    q    = q / sqrt(sum(q^2) + 1e-6) * scale ;  k = k / sqrt(sum(k^2) + 1e-6)
    S    = S * exp(g)[:, None] ;  u = beta * (v - S^T k) ;  S = S + k u^T ;  o = S^T q

One program owns the (token, head, v-tile) slice S[:, v-tile] of the state: the decay acts on the
k rows and the delta update and output are column-wise, so v-tiles are independent; each program
recomputes the cheap k-side quantities (f GEMV over R, gate, norms) for its head.

Variants (constexpr flags of the same kernel):
  FUSE_CONV      q, k, v arrive before the short convolution: one conv step + SiLU per channel in
                 front, conv caches shifted in place. Every v-tile of a head steps the head's q
                 and k channels and shifts its own v channels' caches.
  FUSE_OUT_GATE  o = RMSNorm_head(o) * w * sigmoid(gate logits) behind. The RMS needs the whole
                 head's o: the v-tiles leave o and its sum of squares in a workspace.
  DEFER_RMS      with FUSE_OUT_GATE: each v-tile stores o * w * sigmoid(gate) and its sum of
                 o^2, and the consumer (the output projection's prologue, ``dense_gemv(
                 head_sums=...)``) applies the head's rsqrt: no program waits for the others.
With either and several v-tiles a head, the head's last program to finish (a ticket per token
and head) shifts the q, k caches (every program has read them by then) and normalizes the head;
with DEFER_RMS (or the conv alone) and ``KDAConfig.early_ticket`` the ticket is taken as soon as
a program has read the caches, its round trip beside the rest of the program, and nothing but
the last program's cache shift follows the output.

The tiling is a :class:`KDAConfig` (each default's evidence: docs/decisions.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .runtime import INTERPRETED, check_device, check_number, zeroed_words

__all__ = ["KDAConfig", "KDAConv", "KDAOutGate", "kda_decode"]

L2_EPS = 1e-6          # the model's l2norm epsilon (q / sqrt(sum(q^2) + eps))
MAX_TOKENS = 64        # decode batches; longer runs belong to a chunked prefill kernel


@dataclass(frozen=True)
class KDAConfig:
    """How ``kda_decode`` tiles the state. Every choice changes speed only.

    block_v: v-tile width (a power of two dividing d), or None: halve from max_block_v (at most
        d) until M * Hl * (d / block_v) reaches min_programs, but not below min_block_v (narrow
        tiles re-read f_b once more per head each).
    block_r: rank chunk of the f_b GEMV.
    tile_per_warp, max_warps: warps = state-tile elements / tile_per_warp (16 fp32 registers a
        thread at 512), within [1, max_warps]: more threads share the f_b GEMV, which is most of
        a program's latency.
    pdl: (compiled only) launched with programmatic dependent launch: a program lets the next
        such launch start and waits for the previous grid before it reads anything, so its
        launch overlaps the end of the previous grid.
    early_ticket: with the conv fused and no out gate to finish (none, or its RMS deferred to
        the consumer), take the head's ticket right after the conv caches are read instead of
        after the output: one thread's atomic whose result no thread waits for until the end
        (compiled: inline PTX, not Triton's scalar atomic, which hands its result to every
        thread at once), and only the last program's cache shift follows the output.
    """

    block_v: int | None = None
    min_programs: int = 256
    max_block_v: int = 64
    min_block_v: int = 32
    block_r: int = 64
    tile_per_warp: int = 512
    max_warps: int = 8
    pdl: bool = False
    early_ticket: bool = False

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name == "block_v":
                continue
            if f.name in ("pdl", "early_ticket"):
                if not isinstance(v, bool):
                    raise ValueError(f"{f.name}: expected a bool, got {v!r}")
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name}: expected a positive int, got {v!r}")
            if f.name != "min_programs" and v & (v - 1):
                raise ValueError(f"{f.name}: expected a power of two, got {v}")


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _conv_load(p_x, p_cache, p_w, o_c, C: tl.constexpr, BC: tl.constexpr):
    """The conv window [len(o_c), BC] fp32 (the C-1 cached inputs, oldest first, then the
    current one) and taps [len(o_c), BC] of channels ``o_c``.

    p_x: current input of channel 0 of the head; p_cache: its cache [channels, C-1]; p_w: its
    taps [channels, C] (last tap = current input).
    """
    o_j = tl.arange(0, BC)
    b_old = tl.load(p_cache + o_c[:, None] * (C - 1) + o_j[None, :], mask=o_j[None, :] < C - 1,
                    other=0.0).to(tl.float32)
    b_x = tl.load(p_x + o_c).to(tl.float32)
    b_win = tl.where(o_j[None, :] == C - 1, b_x[:, None], b_old)
    b_w = tl.load(p_w + o_c[:, None] * C + o_j[None, :], mask=o_j[None, :] < C, other=0.0)
    return b_win, b_w.to(tl.float32)


@triton.jit
def _conv_silu(b_win, b_w):
    b_y = tl.sum(b_win * b_w, 1)
    return b_y * _sigmoid(b_y)


@triton.jit
def _ticket_unbroadcast(p_cnt, NT: tl.constexpr):
    """A release atomic add of 1 at p_cnt by one thread of the program, its old value in that
    thread's element of the [NT] result (NT the program's threads; the others hold -1). The
    result is not handed to the other threads, so no thread waits for the round trip until a
    reduction of the result uses it (inline PTX: compiled only)."""
    o_t = tl.arange(0, NT)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.u32 p, $2, 0; mov.u32 $0, 0xffffffff; "
        "@p atom.global.gpu.release.add.u32 $0, [$1], 1; }",
        "=r,l,r", [p_cnt + o_t * 0, o_t], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _conv_shift(p_cache, o_c, b_win, C: tl.constexpr, BC: tl.constexpr):
    """New cache = window[1:] in the cache's dtype (window column j to cache column j - 1)."""
    o_j = tl.arange(0, BC)
    tl.store(p_cache + o_c[:, None] * (C - 1) + o_j[None, :] - 1,
             b_win.to(p_cache.dtype.element_ty), mask=(o_j[None, :] >= 1) & (o_j[None, :] < C))


@triton.jit
def _kda_decode_kernel(
    q, k, v, f_low, f_b, A_log, dt_bias, b_logits, state, o,
    q_cache, k_cache, v_cache, q_conv, k_conv, v_conv,   # FUSE_CONV only
    gate_logits, o_norm,                                 # FUSE_OUT_GATE only
    p_cnt, o_ws, ss_ws,                                  # either, with NV > 1
    lower_bound, scale, eps,
    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr, L2EPS: tl.constexpr,
    FUSE_CONV: tl.constexpr, FUSE_OUT_GATE: tl.constexpr,
    PDL: tl.constexpr, DEFER_RMS: tl.constexpr = False, EARLY_TICKET: tl.constexpr = False,
    ASM: tl.constexpr = False, NT: tl.constexpr = 32,
):
    NV: tl.constexpr = D // BV  # v-tiles (programs) of a head
    # a ticket per (token, head) when the head's programs must meet: to shift the q, k caches
    # all have read, or (out gate done here) to normalize the head's o
    TICKET: tl.constexpr = NV > 1 and (FUSE_CONV or (FUSE_OUT_GATE and not DEFER_RMS))
    EARLY: tl.constexpr = TICKET and EARLY_TICKET and not (FUSE_OUT_GATE and not DEFER_RMS)
    i_v, i_h, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_mh = (i_m * H + i_h).to(tl.int64)
    o_k = tl.arange(0, D)
    o_v = i_v * BV + tl.arange(0, BV)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()

    # the state slice first: its load is the one that matters, let it fly during the GEMV
    p_s = state + i_mh * D * D + o_k[:, None] * D + o_v[None, :]
    b_s = tl.load(p_s)
    if FUSE_CONV:  # every program steps the head's q, k channels and its own v channels
        o_cache = i_mh * D * (C - 1)
        w_q, t_q = _conv_load(q + i_mh * D, q_cache + o_cache, q_conv + i_h * D * C, o_k, C, BC)
        w_k, t_k = _conv_load(k + i_mh * D, k_cache + o_cache, k_conv + i_h * D * C, o_k, C, BC)
        w_v, t_v = _conv_load(v + i_mh * D, v_cache + o_cache, v_conv + i_h * D * C, o_v, C, BC)
        if EARLY:  # the caches read (their values used), then the ticket; only the shift waits
            b_q, b_k, b_v = _conv_silu(w_q, t_q), _conv_silu(w_k, t_k), _conv_silu(w_v, t_v)
            tl.debug_barrier()
            if ASM:  # the ticket stays with the thread that took it until the end
                ticket = _ticket_unbroadcast(p_cnt + i_mh, NT)
            else:  # a scalar atomic: Triton hands its result to every thread at once
                ticket = tl.atomic_add(p_cnt + i_mh, 1, sem="release")

    # f_b projection of this head's d channels: f = f_b[h rows] @ f_low[m], fp32 accumulation
    b_f = tl.zeros([D], dtype=tl.float32)
    for r0 in tl.static_range(0, R, BR):
        o_r = r0 + tl.arange(0, BR)
        m_r = o_r < R
        b_fl = tl.load(f_low + i_m * R + o_r, mask=m_r, other=0.0).to(tl.float32)
        p_fb = f_b + (i_h * D + o_k)[:, None].to(tl.int64) * R + o_r[None, :]
        b_fb = tl.load(p_fb, mask=m_r[None, :], other=0.0).to(tl.float32)
        b_f += tl.sum(b_fb * b_fl[None, :], 1)
    b_A = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_bias = tl.load(dt_bias + i_h * D + o_k).to(tl.float32)
    b_g = lower_bound * _sigmoid(b_A * (b_f + b_bias))
    b_beta = _sigmoid(tl.load(b_logits + i_mh).to(tl.float32))

    if FUSE_CONV:
        if not EARLY:
            b_q, b_k, b_v = _conv_silu(w_q, t_q), _conv_silu(w_k, t_k), _conv_silu(w_v, t_v)
        _conv_shift(v_cache + o_cache, o_v, w_v, C, BC)
        if NV == 1:
            _conv_shift(q_cache + o_cache, o_k, w_q, C, BC)
            _conv_shift(k_cache + o_cache, o_k, w_k, C, BC)
    else:
        b_q = tl.load(q + i_mh * D + o_k).to(tl.float32)
        b_k = tl.load(k + i_mh * D + o_k).to(tl.float32)
        b_v = tl.load(v + i_mh * D + o_v).to(tl.float32)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 0) + L2EPS) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + L2EPS)

    # decay, delta update and output on this program's [D, BV] slice of the state
    b_s = b_s * tl.exp(b_g)[:, None]
    b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], 0))
    b_s += b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_s * b_q[:, None], 0)
    tl.store(p_s, b_s)

    if FUSE_OUT_GATE and DEFER_RMS:  # gated here, the head's rsqrt by the consumer
        b_w = tl.load(o_norm + o_v).to(tl.float32)
        b_gate = tl.load(gate_logits + i_mh * D + o_v).to(tl.float32)
        tl.store(ss_ws + i_mh * NV + i_v, tl.sum(b_o * b_o, 0))
        b_o = b_o * b_w * _sigmoid(b_gate)
    if FUSE_OUT_GATE and NV == 1 and not DEFER_RMS:  # per-head RMSNorm times sigmoid(gate)
        b_rms = tl.sqrt(tl.sum(b_o * b_o, 0) / D + eps)
        b_w = tl.load(o_norm + o_v).to(tl.float32)
        b_gate = tl.load(gate_logits + i_mh * D + o_v).to(tl.float32)
        b_o = b_o / b_rms * b_w * _sigmoid(b_gate)
    if FUSE_OUT_GATE and NV > 1 and not DEFER_RMS:
        tl.store(o_ws + i_mh * D + o_v, b_o)
        tl.store(ss_ws + i_mh * NV + i_v, tl.sum(b_o * b_o, 0))
    else:
        tl.store(o + i_mh * D + o_v, b_o.to(o.dtype.element_ty))
    if EARLY:
        if ASM:
            ticket = tl.max(ticket, 0)
        if ticket == NV - 1:  # every program of the head has read the q, k caches
            _conv_shift(q_cache + o_cache, o_k, w_q, C, BC)
            _conv_shift(k_cache + o_cache, o_k, w_k, C, BC)
            tl.atomic_xchg(p_cnt + i_mh, 0, sem="relaxed")
    elif TICKET:
        # the head's last program to finish (one ticket per token and head) shifts the q, k
        # caches every program has read and normalizes and gates the head's o
        tl.debug_barrier()  # every thread's cache reads and stores performed before the ticket
        if tl.atomic_add(p_cnt + i_mh, 1, sem="acq_rel") == NV - 1:
            tl.debug_barrier()
            if FUSE_CONV:
                _conv_shift(q_cache + o_cache, o_k, w_q, C, BC)
                _conv_shift(k_cache + o_cache, o_k, w_k, C, BC)
            if FUSE_OUT_GATE and not DEFER_RMS:
                b_ss = tl.sum(tl.load(ss_ws + i_mh * NV + tl.arange(0, NV),
                                      cache_modifier=".cg"), 0)
                b_oh = tl.load(o_ws + i_mh * D + o_k, cache_modifier=".cg")
                b_w = tl.load(o_norm + o_k).to(tl.float32)
                b_gate = tl.load(gate_logits + i_mh * D + o_k).to(tl.float32)
                b_oh = b_oh / tl.sqrt(b_ss / D + eps) * b_w * _sigmoid(b_gate)
                tl.store(o + i_mh * D + o_k, b_oh.to(o.dtype.element_ty))
            tl.atomic_xchg(p_cnt + i_mh, 0, sem="relaxed")


@dataclass
class KDAConv:
    """The short-convolution step fused in front (``kda_decode(..., conv=KDAConv(...))``).

    q_state, k_state, v_state: conv caches [M, Hl*d, C-1] (the C-1 past inputs, oldest first),
        all one float dtype, updated in place (shifted by one, the current input appended).
    q_weight, k_weight, v_weight: depthwise taps [Hl*d, C] (last tap = current token).
    """

    q_state: torch.Tensor
    k_state: torch.Tensor
    v_state: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    v_weight: torch.Tensor


@dataclass
class KDAOutGate:
    """The output RMSNorm times sigmoid gate fused behind (``kda_decode(..., out_gate=...)``).

    logits: gate logits [M, Hl, d] (x @ W_g^T); weight: RMSNorm weight [d]; eps > 0.
    rms_by_consumer: the kernel returns (o * weight * sigmoid(logits), fp32 [M, Hl, P] partial
        sums of o^2, P the v-tiles of a head), and the consumer divides each head by
        sqrt(sum / d + eps): the output projection's prologue (``dense_gemv(head_sums=...,
        head_dim=d, eps=eps)``), so no program of a head waits for the others.
    """

    logits: torch.Tensor
    weight: torch.Tensor
    eps: float = 1e-5
    rms_by_consumer: bool = False


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _check(name: str, t, shape: tuple, dtypes=_FLOATS, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _block_v(m: int, hl: int, d: int, cfg: KDAConfig) -> int:
    """v-tile width: halve from cfg.max_block_v until M * Hl * (d / BV) reaches
    cfg.min_programs, not below cfg.min_block_v."""
    bv = min(d, cfg.max_block_v)
    while m * hl * (d // bv) < cfg.min_programs and bv > cfg.min_block_v:
        bv //= 2
    return bv


def kda_decode(q, k, v, f_low, f_b, A_log, dt_bias, b_logits, state, *,
               lower_bound: float = -5.0, scale: float | None = None,
               conv: KDAConv | None = None, out_gate: KDAOutGate | None = None,
               config: KDAConfig | None = None) -> torch.Tensor:
    """One KDA decode step for M tokens (one per sequence) in one launch; ``state`` in place.

    q, k, v: [M, Hl, d] bf16/fp16/fp32 after the short conv and SiLU (before it with ``conv``);
        d a power of two (8..256), Hl any, 1 <= M <= 64.
    f_low: [M, R] float, ``x @ f_a^T``.       f_b: [Hl*d, R] float.
    A_log: [Hl] fp32.    dt_bias: [Hl*d] fp32.    b_logits: [M, Hl] float (beta before sigmoid).
    state: [M, Hl, d (k), d (v)] fp32 contiguous, updated in place.
    lower_bound: the gate's lower bound (log space); scale: q scale, default d ** -0.5.
    conv: :class:`KDAConv` to fuse the short-conv step + SiLU in front (q, k, v then are the
        projections ``x @ W^T`` viewed [M, Hl, d]).
    out_gate: :class:`KDAOutGate` to fuse ``RMSNorm_head(o) * sigmoid(logits)`` behind.
    config: the :class:`KDAConfig` (None: the defaults); it changes speed, not the result.

    Returns o [M, Hl, d] in v's dtype (the gated output with ``out_gate``); with
    ``out_gate.rms_by_consumer`` (o gated but not normalized, the partial sums of o^2 [M, Hl, P]).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected a [M, Hl, d] tensor, got {getattr(q, 'shape', q)!r}")
    m, hl, d = q.shape
    _check("q", q, (m, hl, d))
    dev = q.device
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"q: expected 1 <= M <= {MAX_TOKENS} decode tokens, got M={m}")
    if hl < 1:
        raise ValueError("q: expected at least one head")
    if not _is_pow2(d) or not 8 <= d <= 256:
        raise ValueError(f"q: head dim must be a power of two in [8, 256], got {d}")
    _check("k", k, (m, hl, d), device=dev)
    _check("v", v, (m, hl, d), device=dev)
    if f_low is None or not isinstance(f_low, torch.Tensor) or f_low.dim() != 2:
        raise ValueError("f_low: expected a [M, R] tensor")
    r = f_low.shape[1]
    if r < 1:
        raise ValueError("f_low: expected rank R >= 1")
    _check("f_low", f_low, (m, r), device=dev)
    _check("f_b", f_b, (hl * d, r), device=dev)
    _check("A_log", A_log, (hl,), (torch.float32,), dev)
    _check("dt_bias", dt_bias, (hl * d,), (torch.float32,), dev)
    _check("b_logits", b_logits, (m, hl), device=dev)
    _check("state", state, (m, hl, d, d), (torch.float32,), dev)
    check_device("q", q)
    lower_bound = check_number("lower_bound", lower_bound)
    scale = d ** -0.5 if scale is None else check_number("scale", scale, positive=True)

    c = 2
    q_cache = k_cache = v_cache = q_conv = k_conv = v_conv = q  # placeholders, never read
    if conv is not None:
        if not isinstance(conv, KDAConv):
            raise ValueError(f"conv: expected a KDAConv, got {type(conv).__name__}")
        w = conv.q_weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not 2 <= w.shape[1] <= 16:
            raise ValueError("conv: q_weight must be [Hl*d, C] with 2 <= C <= 16")
        c = w.shape[1]
        for n in "qkv":
            _check(f"conv.{n}_weight", getattr(conv, f"{n}_weight"), (hl * d, c), device=dev)
            _check(f"conv.{n}_state", getattr(conv, f"{n}_state"), (m, hl * d, c - 1),
                   (conv.q_state.dtype,) if n != "q" else _FLOATS, dev)
        q_cache, k_cache, v_cache = conv.q_state, conv.k_state, conv.v_state
        q_conv, k_conv, v_conv = conv.q_weight, conv.k_weight, conv.v_weight
    gate_logits = o_norm = q  # placeholders, never read
    eps = 1e-5
    if out_gate is not None:
        if not isinstance(out_gate, KDAOutGate):
            raise ValueError(f"out_gate: expected a KDAOutGate, got {type(out_gate).__name__}")
        _check("out_gate.logits", out_gate.logits, (m, hl, d), device=dev)
        _check("out_gate.weight", out_gate.weight, (d,), device=dev)
        eps = check_number("out_gate.eps", out_gate.eps, positive=True)
        if not isinstance(out_gate.rms_by_consumer, bool):
            raise ValueError(f"out_gate.rms_by_consumer: expected a bool, got "
                             f"{out_gate.rms_by_consumer!r}")
        gate_logits, o_norm = out_gate.logits, out_gate.weight
    defer = out_gate is not None and out_gate.rms_by_consumer

    if config is not None and not isinstance(config, KDAConfig):
        raise ValueError(f"config: expected a KDAConfig or None, got {type(config).__name__}")
    cfg = config or KDAConfig()
    block_v = cfg.block_v
    if block_v is None:
        block_v = _block_v(m, hl, d, cfg)
    if d % block_v:
        raise ValueError(f"config.block_v: expected a power of two dividing d={d}, got {block_v}")
    n_v = d // block_v
    cnt = o_ws = ss_ws = state  # placeholders, never read
    if n_v > 1 and (conv is not None or out_gate is not None):
        cnt = _counters(dev, m * hl)
    if n_v > 1 and out_gate is not None and not defer:
        o_ws = torch.empty(m * hl * d, dtype=torch.float32, device=dev)
    if out_gate is not None and (n_v > 1 or defer):
        ss_ws = torch.empty(m * hl * n_v, dtype=torch.float32, device=dev)

    o = torch.empty((m, hl, d), dtype=v.dtype, device=dev)
    pdl = cfg.pdl and not INTERPRETED
    grid = (d // block_v, hl, m)
    num_warps = max(1, min(cfg.max_warps, d * block_v // cfg.tile_per_warp))
    _kda_decode_kernel[grid](
        q, k, v, f_low, f_b, A_log, dt_bias, b_logits, state, o,
        q_cache, k_cache, v_cache, q_conv, k_conv, v_conv, gate_logits, o_norm, cnt, o_ws, ss_ws,
        float(lower_bound), float(scale), float(eps),
        H=hl, D=d, R=r, BR=min(cfg.block_r, triton.next_power_of_2(r)), BV=block_v,
        C=c, BC=triton.next_power_of_2(c), L2EPS=L2_EPS,
        FUSE_CONV=conv is not None, FUSE_OUT_GATE=out_gate is not None,
        PDL=pdl, num_warps=num_warps, **({"launch_pdl": True} if pdl else {}),
        **({"DEFER_RMS": True} if defer else {}),
        **({"EARLY_TICKET": True, "ASM": not INTERPRETED, "NT": 32 * num_warps}
           if cfg.early_ticket else {}),
    )
    return (o, ss_ws.view(m, hl, n_v)) if defer else o


# int32 tickets per (token, head), per device, of the v-tiled conv / out gate; zero between
# launches (each launch's last program of a head resets its own)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    return zeroed_words(_COUNTERS, device, n, minimum=256, error=(
        f"q: kda_decode's tickets on {device} for {n} (token, head) pairs do not exist yet and "
        "cannot be created inside a CUDA-graph capture; call it once with this M and Hl (or "
        "more) before capturing"))
