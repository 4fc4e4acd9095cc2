"""MLA decode's neighbours, each side in one launch (docs/model.md, MLA).

Before the attention, ``mla_absorb_q`` (ops mla.kv_a_norm, mla.cache_append, mla.q_absorb)::

    q_lat[m, h]  = q_nope[m, h] @ W_uk[h]                      [C]
    q_rope[m, h] = rope(q[m, h, nope:])                        [R]
    kv_cache[m, position[m]] = [rms_norm(kv[m, :C]) | rope(kv[m, C:])],  seq_lens[m] = position + 1

After it, ``mla_absorb_out`` (ops mla.v_absorb, mla.out_gate)::

    o[m, h*V:(h+1)*V] = (o_lat[m, h] @ W_uv[h]^T) * sigmoid(g[m, h*V:(h+1)*V])

W_uk and W_uv are read in place from kv_b [H*(nope+V), C] (per head: nope rows of W_uk, then V
rows of W_uv). rope is the reference's rotate-half at integer positions, applied only when the
preset rotates (K3 does not). Sums are fp32 over bf16 loads (a broadcast multiply and tl.sum:
one token's rows are too few for tensor cores, and the interpreter's bf16 tl.dot is wrong).

With ``MLAConfig.absorb_pdl`` both launch by programmatic dependent launch: a program loads its
kv_b tile (and the q side its norm gain), which no launch writes, then waits for the previous
grid and lets the next one launch, and only then reads the activations.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .mla import MLAConfig, _config
from .runtime import INTERPRETED, check_number, check_tensor, check_validate

__all__ = ["mla_absorb_q", "mla_absorb_out", "ABSORB_BLOCK_C", "ABSORB_BLOCK_V"]

# latent columns of one q-absorb program ([nope, ABSORB_BLOCK_C] of W_uk), value rows of one
# v-absorb program ([ABSORB_BLOCK_V, C] of W_uv): about 8K elements a tile at K3, and
# H * C / 64 (resp. H * V / 16) programs to stream the 1.5 MB of each half at tp 8
ABSORB_BLOCK_C = 64
ABSORB_BLOCK_V = 16


@triton.jit
def _rope_half(base, j, pos_f, log2_theta, HALF: tl.constexpr, R_DIV: tl.constexpr,
               ROPE: tl.constexpr):
    """The two halves of one rope vector at ``base`` (fp32), rotated when ROPE (R_DIV: the
    rope width, at least 1)."""
    mask = j < HALF
    x1 = tl.load(base + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + j, mask=mask, other=0.0).to(tl.float32)
    if ROPE:
        ang = pos_f * tl.exp2(-(2.0 * j.to(tl.float32) / R_DIV) * log2_theta)
        cos, sin = tl.cos(ang), tl.sin(ang)
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return x1, x2


@triton.jit
def _mla_absorb_q_kernel(q_ptr, kv_ptr, norm_ptr, kvb_ptr, pos_ptr, cache_ptr, lens_ptr,
                         qlat_ptr, qrope_ptr, l_max, eps, log2_theta,
                         H: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr,
                         V: tl.constexpr, C: tl.constexpr, NOPE_P: tl.constexpr,
                         C_P: tl.constexpr, HALF_P: tl.constexpr, R_DIV: tl.constexpr,
                         BLOCK_C: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr):
    m = tl.program_id(0)
    pid = tl.program_id(1)
    NCB: tl.constexpr = (C + BLOCK_C - 1) // BLOCK_C
    HALF: tl.constexpr = R // 2
    j = tl.arange(0, HALF_P)
    if pid < H * NCB:
        h = pid // NCB
        cb = pid % NCB
        q_row = q_ptr + (m * H + h) * (NOPE + R)
        n = tl.arange(0, NOPE_P)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        w = tl.load(kvb_ptr + (h * (NOPE + V) + n[:, None]).to(tl.int64) * C + c[None, :],
                    mask=(n[:, None] < NOPE) & (c[None, :] < C), other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        pos_f = tl.load(pos_ptr + m).to(tl.float32)
        q_nope = tl.load(q_row + n, mask=n < NOPE, other=0.0).to(tl.float32)
        q_lat = tl.sum(q_nope[:, None] * w, axis=0)
        tl.store(qlat_ptr + (m * H + h) * C + c, q_lat.to(qlat_ptr.dtype.element_ty),
                 mask=c < C)
        if cb == 0:
            x1, x2 = _rope_half(q_row + NOPE, j, pos_f, log2_theta, HALF, R_DIV, ROPE)
            out = qrope_ptr + (m * H + h) * R
            ty = qrope_ptr.dtype.element_ty
            tl.store(out + j, x1.to(ty), mask=j < HALF)
            tl.store(out + HALF + j, x2.to(ty), mask=j < HALF)
    else:  # the cache row: RMSNorm of the latent, the rope columns, the new length
        kv_row = kv_ptr + m * (C + R)
        cols = tl.arange(0, C_P)
        gain = tl.load(norm_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        pos = tl.load(pos_ptr + m).to(tl.int64)
        pos_f = pos.to(tl.float32)
        xc = tl.load(kv_row + cols, mask=cols < C, other=0.0).to(tl.float32)
        latent = xc * tl.rsqrt(tl.sum(xc * xc, axis=0) / C + eps) * gain
        k1, k2 = _rope_half(kv_row + C, j, pos_f, log2_theta, HALF, R_DIV, ROPE)
        inside = (pos >= 0) & (pos < l_max)  # else nothing is written; the length says so
        n_c = tl.where(inside, C, 0)
        n_half = tl.where(inside, HALF, 0)
        row = cache_ptr + (m * l_max + pos) * (C + R)
        cache_ty = cache_ptr.dtype.element_ty
        tl.store(row + cols, latent.to(cache_ty), mask=cols < n_c)
        tl.store(row + C + j, k1.to(cache_ty), mask=j < n_half)
        tl.store(row + C + HALF + j, k2.to(cache_ty), mask=j < n_half)
        tl.store(lens_ptr + m, tl.where(inside, pos + 1, -1).to(lens_ptr.dtype.element_ty))


@triton.jit
def _mla_absorb_out_kernel(olat_ptr, kvb_ptr, g_ptr, out_ptr,
                           H: tl.constexpr, NOPE: tl.constexpr, V: tl.constexpr,
                           C: tl.constexpr, C_P: tl.constexpr, BLOCK_V: tl.constexpr,
                           PDL: tl.constexpr):
    m = tl.program_id(0)
    pid = tl.program_id(1)
    NVB: tl.constexpr = (V + BLOCK_V - 1) // BLOCK_V
    h = pid // NVB
    v = (pid % NVB) * BLOCK_V + tl.arange(0, BLOCK_V)
    c = tl.arange(0, C_P)
    w = tl.load(kvb_ptr + (h * (NOPE + V) + NOPE + v[:, None]).to(tl.int64) * C + c[None, :],
                mask=(v[:, None] < V) & (c[None, :] < C), other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    o_lat = tl.load(olat_ptr + (m * H + h) * C + c, mask=c < C, other=0.0).to(tl.float32)
    o = tl.sum(w * o_lat[None, :], axis=1)
    col = m * (H * V) + h * V + v
    gate = tl.load(g_ptr + col, mask=v < V, other=0.0).to(tl.float32)
    o = o / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + col, o.to(out_ptr.dtype.element_ty), mask=v < V)


_HALF_TYPES = (torch.bfloat16, torch.float16)


def _pdl(cfg: MLAConfig) -> dict:
    """The PDL constexpr and launch option: ``absorb_pdl``, compiled only (the interpreter runs
    plain launches)."""
    pdl = cfg.absorb_pdl and not INTERPRETED
    return {"PDL": pdl, **({"launch_pdl": True} if pdl else {})}


def _kv_b(kv_b, heads, qk_nope, v_head, c, dev):
    check_tensor("kv_b", kv_b, dtypes=_HALF_TYPES, dim=2, device=dev)
    if tuple(kv_b.shape) != (heads * (qk_nope + v_head), c):
        raise ValueError(f"kv_b: expected [H*(qk_nope+v_head), C] = [{heads * (qk_nope + v_head)}"
                         f", {c}], got {list(kv_b.shape)}")


def _dim(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return v


def mla_absorb_q(q: torch.Tensor, kv: torch.Tensor, kv_a_norm: torch.Tensor,
                 kv_b: torch.Tensor, position: torch.Tensor, kv_cache: torch.Tensor,
                 seq_lens: torch.Tensor, *, qk_nope: int, v_head: int, eps: float,
                 rope: bool = False, rope_theta: float = 50000.0, validate: str = "cheap",
                 config: MLAConfig | None = None):
    """The attention's inputs from the projections, one launch.

    q: [M, H, qk_nope + R] (the q_b projection's output); kv: [M, C + R] (kv_a's); kv_a_norm:
    [C] fp32 or bf16; kv_b: [H*(qk_nope+v_head), C]; position: [M] int32/int64, the cache row
    each token takes; kv_cache: [M, L_max, C + R] (written at those rows); seq_lens: [M] int32
    (set to position + 1). A position outside [0, L_max) writes no row and sets the length to
    -1 (a ValueError on CPU tensors or with ``validate="full"``; on the GPU without a sync the
    attention of that token then gives NaN, as ``mla_decode`` does for a bad length). rope:
    rotate the rope columns (rotate-half at ``rope_theta``). config: an ``MLAConfig`` (its
    ``absorb_pdl``) or None.
    Returns (q_lat [M, H, C], q_rope [M, H, R]) in kv_cache's dtype.
    """
    validate = check_validate(validate)
    cfg = _config(config)
    check_tensor("q", q, dtypes=_HALF_TYPES, dim=3)
    dev = q.device
    m, heads, qk = q.shape
    qk_nope, v_head = _dim("qk_nope", qk_nope), _dim("v_head", v_head)
    r = qk - qk_nope
    if r < 0 or r % 2:
        raise ValueError(f"q: expected [M, H, qk_nope + R] with an even R >= 0, got "
                         f"{list(q.shape)} for qk_nope={qk_nope}")
    check_tensor("kv", kv, dtypes=_HALF_TYPES, dim=2, device=dev)
    c = kv.shape[1] - r
    if kv.shape[0] != m or c < 1:
        raise ValueError(f"kv: expected [M={m}, C + R={r}], got {list(kv.shape)}")
    check_tensor("kv_a_norm", kv_a_norm, dtypes=(torch.float32, *_HALF_TYPES), dim=1,
                 device=dev)
    if kv_a_norm.numel() != c:
        raise ValueError(f"kv_a_norm: expected [C={c}], got {list(kv_a_norm.shape)}")
    _kv_b(kv_b, heads, qk_nope, v_head, c, dev)
    check_tensor("position", position, dtypes=(torch.int32, torch.int64), dim=1, device=dev)
    check_tensor("kv_cache", kv_cache, dtypes=_HALF_TYPES, dim=3, device=dev)
    if kv_cache.shape[0] != m or kv_cache.shape[2] != c + r or position.numel() != m:
        raise ValueError(f"kv_cache: expected [M={m}, L_max, C + R={c + r}] and position [M], "
                         f"got {list(kv_cache.shape)} and {list(position.shape)}")
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), dim=1, device=dev)
    if seq_lens.numel() != m:
        raise ValueError(f"seq_lens: expected [M={m}], got {list(seq_lens.shape)}")
    eps = check_number("eps", eps, positive=True)
    theta = check_number("rope_theta", rope_theta, positive=True)
    l_max = kv_cache.shape[1]
    if validate == "full" or dev.type == "cpu":
        lo, hi = int(position.min()), int(position.max())
        if lo < 0 or hi >= l_max:
            raise ValueError(f"position: expected cache rows in [0, L_max={l_max}), got "
                             f"{lo}..{hi}")
    q_lat = torch.empty((m, heads, c), device=dev, dtype=kv_cache.dtype)
    q_rope = torch.empty((m, heads, r), device=dev, dtype=kv_cache.dtype)
    ncb = triton.cdiv(c, ABSORB_BLOCK_C)
    _mla_absorb_q_kernel[(m, heads * ncb + 1)](
        q, kv, kv_a_norm, kv_b, position, kv_cache, seq_lens, q_lat, q_rope, l_max, eps,
        math.log2(theta), H=heads, NOPE=qk_nope, R=r, V=v_head, C=c,
        NOPE_P=triton.next_power_of_2(qk_nope), C_P=triton.next_power_of_2(c),
        HALF_P=triton.next_power_of_2(max(r // 2, 1)), R_DIV=max(r, 1), BLOCK_C=ABSORB_BLOCK_C,
        ROPE=bool(rope), **_pdl(cfg),
        num_warps=4)
    return q_lat, q_rope


def mla_absorb_out(o_lat: torch.Tensor, kv_b: torch.Tensor, g: torch.Tensor, *, qk_nope: int,
                   v_head: int, out_dtype: torch.dtype = torch.bfloat16,
                   config: MLAConfig | None = None) -> torch.Tensor:
    """The attention's output into the o_proj input, one launch.

    o_lat: [M, H, C] (``mla_decode``'s output, any float dtype); kv_b: [H*(qk_nope+v_head), C];
    g: [M, H*v_head] (the output gate's logits); config: an ``MLAConfig`` (its
    ``absorb_pdl``) or None. Returns [M, H*v_head] in ``out_dtype`` (bf16 or fp32): per head
    o_lat @ W_uv^T times sigmoid(g).
    """
    cfg = _config(config)
    check_tensor("o_lat", o_lat, dtypes=(torch.float32, *_HALF_TYPES), dim=3)
    dev = o_lat.device
    m, heads, c = o_lat.shape
    qk_nope, v_head = _dim("qk_nope", qk_nope), _dim("v_head", v_head)
    _kv_b(kv_b, heads, qk_nope, v_head, c, dev)
    check_tensor("g", g, dtypes=(torch.float32, *_HALF_TYPES), dim=2, device=dev)
    if tuple(g.shape) != (m, heads * v_head):
        raise ValueError(f"g: expected [M, H*v_head] = [{m}, {heads * v_head}], got "
                         f"{list(g.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    out = torch.empty((m, heads * v_head), device=dev, dtype=out_dtype)
    nvb = triton.cdiv(v_head, ABSORB_BLOCK_V)
    _mla_absorb_out_kernel[(m, heads * nvb)](
        o_lat, kv_b, g, out, H=heads, NOPE=qk_nope, V=v_head, C=c,
        C_P=triton.next_power_of_2(c), BLOCK_V=ABSORB_BLOCK_V, **_pdl(cfg), num_warps=4)
    return out
