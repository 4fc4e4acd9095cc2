"""MLA decode (docs/model.md): the unfused PyTorch truth.

Absorbed attention over the latent cache, for one decode token per sequence::

    score[h, t] = (q_lat[h] . c_t + q_rope[h] . kr_t) * sm_scale      t < seq_len
    p           = softmax_t(score)
    o_lat[h]    = sum_t p[h, t] c_t                                     (512 wide)

where each cache row is ``[c_t (kv_lora) | kr_t (rope)]``. Three forms:

- :func:`mla_decode_reference`: the absorbed attention, fp32 math, masked per sequence (no host
  synchronization, so it also serves as the torch.compile peer).
- :func:`mla_decode_unabsorbed`: the same attention the way an unabsorbed model computes it:
  per-head keys ``[c @ W_uk[h]^T | kr]`` and values ``c @ W_uv[h]^T`` through
  ``torch.nn.functional.scaled_dot_product_attention``. Independent of the absorbed algebra, so
  tests use it to check that the absorbed form is MLA.
- :func:`mla_layer_reference`: a whole MLA decode step of one layer with the weights of
  ``k3lab.weights.mla_weights``.

Nothing here imports from ``k3lab.kernels``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3lab.config import Preset

__all__ = ["mla_decode_reference", "mla_decode_unabsorbed", "mla_layer_reference",
           "mla_absorb_q_reference", "mla_absorb_out_reference", "split_kv_b", "rope_rotate",
           "ROPE_THETA"]

# RoPE base used for presets with ``mla_rope`` (K2). Simplified: plain rotate-half RoPE, no YaRN
# scaling and no mscale (the workbench's kernels take q_rope / kr as given, so only the layer
# reference is affected). K3 applies no rotation at all.
ROPE_THETA = 50000.0


def check_seq_lens(seq_lens: torch.Tensor, max_len: int, validate: str = "cheap") -> None:
    """Refuse lengths outside [0, max_len] (the cache's rows): always for host ``seq_lens``, on
    a GPU with ``validate="full"`` (a host sync); otherwise the callers poison those tokens
    (NaN) on the device, so the reference stays free of syncs (graph capture, torch.compile)."""
    if validate not in ("cheap", "full"):
        raise ValueError(f"validate: expected 'cheap' or 'full', got {validate!r}")
    if seq_lens.device.type != "cpu" and validate != "full":
        return
    lens = seq_lens.cpu().numpy()  # no ATen op on host tensors (CPU launch counts unchanged)
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 0 or hi > max_len:
        raise ValueError(f"seq_lens: expected lengths in [0, L_max={max_len}] (the cache's "
                         f"rows), got min {lo}, max {hi}")


def _length_mask(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """[M, max_len] bool: True where position t < seq_lens[m]."""
    pos = torch.arange(max_len, device=seq_lens.device)
    return pos[None, :] < seq_lens.to(torch.int64)[:, None]


def _bad_length(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """[M] bool: a length outside [0, max_len] (its token's outputs become NaN)."""
    return (seq_lens < 0) | (seq_lens > max_len)


def mla_decode_reference(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                         seq_lens: torch.Tensor, *, sm_scale: float, return_lse: bool = False,
                         validate: str = "cheap"):
    """Absorbed MLA decode attention in fp32.

    q_lat: [M, Hl, C] (q_nope absorbed through W_uk); q_rope: [M, Hl, R];
    kv_cache: [M, L_max, C + R] (latent c then rope kr per position); seq_lens: [M] int, every
    length in [1, L_max]; positions at or past a sequence's length are ignored (never reach the
    output, whatever they hold); a zero length gives o = 0, lse = -inf. A length beyond L_max or
    negative: a ValueError (see :func:`check_seq_lens`), else NaN for that token.
    Returns o_lat [M, Hl, C] fp32, and with ``return_lse`` also lse [M, Hl] fp32, the natural log
    of ``sum_t exp(score[h, t])`` (scores already multiplied by sm_scale).
    """
    max_len = kv_cache.shape[1]
    check_seq_lens(seq_lens, max_len, validate)
    c_dim = q_lat.shape[-1]
    mask = _length_mask(seq_lens, max_len)
    kv = kv_cache.float().masked_fill(~mask[:, :, None], 0.0)  # rows past a length: unread
    c, kr = kv[..., :c_dim], kv[..., c_dim:]
    scores = torch.einsum("mhc,mlc->mhl", q_lat.float(), c)
    scores = scores + torch.einsum("mhr,mlr->mhl", q_rope.float(), kr)
    scores = scores * sm_scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a zero length: all -inf, o = 0
    o_lat = torch.einsum("mhl,mlc->mhc", p, c)
    bad = _bad_length(seq_lens, max_len)
    o_lat = o_lat.masked_fill(bad[:, None, None], float("nan"))
    lse = lse.masked_fill(bad[:, None], float("nan"))
    return (o_lat, lse) if return_lse else o_lat


def split_kv_b(kv_b: torch.Tensor, heads: int, qk_nope: int, v_head: int):
    """kv_b [Hm*(nope+v), kv_lora] -> (W_uk [Hm, nope, kv_lora], W_uv [Hm, v, kv_lora])."""
    w = kv_b.view(heads, qk_nope + v_head, kv_b.shape[-1])
    return w[:, :qk_nope], w[:, qk_nope:]


def mla_decode_unabsorbed(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                          seq_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, *,
                          sm_scale: float) -> torch.Tensor:
    """MLA decode with the latent expanded to per-head keys and values, through SDPA (fp32).

    q_nope: [M, Hl, nope]; q_rope: [M, Hl, R]; kv_cache: [M, L_max, C + R]; seq_lens: [M];
    w_uk: [Hl, nope, C]; w_uv: [Hl, v, C]. Keys are ``[c @ W_uk[h]^T | kr]`` ([M, Hl, L, nope+R]),
    values ``c @ W_uv[h]^T`` ([M, Hl, L, v]). Returns o [M, Hl, v] fp32, equal to
    ``mla_decode_reference(q_nope @ W_uk, ...) @ W_uv^T`` per head.
    """
    check_seq_lens(seq_lens, kv_cache.shape[1])
    c_dim = w_uk.shape[-1]
    keep = _length_mask(seq_lens, kv_cache.shape[1])
    kv = kv_cache.float().masked_fill(~keep[:, :, None], 0.0)  # rows past a length: unread
    c, kr = kv[..., :c_dim], kv[..., c_dim:]
    k_nope = torch.einsum("mlc,hnc->mhln", c, w_uk.float())
    k_rope = kr[:, None].expand(-1, k_nope.shape[1], -1, -1)
    k = torch.cat([k_nope, k_rope], dim=-1)
    v = torch.einsum("mlc,hvc->mhlv", c, w_uv.float())
    q = torch.cat([q_nope.float(), q_rope.float()], dim=-1)[:, :, None, :]  # [M, Hl, 1, D]
    mask = _length_mask(seq_lens, kv_cache.shape[1])[:, None, None, :]     # [M, 1, 1, L]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)
    return o[:, :, 0, :]


def mla_absorb_q_reference(q: torch.Tensor, kv: torch.Tensor, kv_a_norm: torch.Tensor,
                           kv_b: torch.Tensor, position: torch.Tensor, kv_cache: torch.Tensor,
                           seq_lens: torch.Tensor, *, qk_nope: int, v_head: int, eps: float,
                           rope: bool = False, rope_theta: float = ROPE_THETA):
    """The attention's inputs from the projections (ops mla.kv_a_norm, mla.cache_append,
    mla.q_absorb), fp32 math: q [M, H, nope + R], kv [M, C + R]. Writes the cache row
    ``[rms_norm(kv[:, :C]) | rope(kv[:, C:])]`` at ``position`` and sets seq_lens to
    position + 1 in place; returns (q_lat [M, H, C], q_rope [M, H, R]) fp32."""
    m, heads, _ = q.shape
    c_dim = kv_b.shape[1]
    q_nope, q_rope = q[..., :qk_nope].float(), q[..., qk_nope:].float()
    c = _rms_norm(kv[:, :c_dim], kv_a_norm, eps)
    kr = kv[:, c_dim:].float()
    pos = position.to(torch.int64)
    if rope:
        q_rope, kr = rope_rotate(q_rope, pos, rope_theta), rope_rotate(kr, pos, rope_theta)
    kv_cache[torch.arange(m, device=q.device), pos] = torch.cat([c, kr], -1).to(kv_cache.dtype)
    seq_lens.copy_((pos + 1).to(seq_lens.dtype))
    w_uk, _ = split_kv_b(kv_b, heads, qk_nope, v_head)
    return torch.einsum("mhn,hnc->mhc", q_nope, w_uk.float()), q_rope


def mla_absorb_out_reference(o_lat: torch.Tensor, kv_b: torch.Tensor, g: torch.Tensor, *,
                             qk_nope: int, v_head: int) -> torch.Tensor:
    """The attention's output into o_proj's input (ops mla.v_absorb, mla.out_gate), fp32:
    per head o_lat [M, H, C] @ W_uv^T, times sigmoid(g [M, H*v_head]); [M, H*v_head] fp32."""
    m, heads, _ = o_lat.shape
    _, w_uv = split_kv_b(kv_b, heads, qk_nope, v_head)
    o = torch.einsum("mhc,hvc->mhv", o_lat.float(), w_uv.float()).reshape(m, heads * v_head)
    return o * torch.sigmoid(g.float())


def rope_rotate(x: torch.Tensor, position: torch.Tensor, theta: float = ROPE_THETA):
    """Rotate-half RoPE of x [M, ..., R] (fp32) at integer positions [M]."""
    r = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, r, 2, device=x.device, dtype=torch.float32) / r)
    ang = position.to(torch.float32)[:, None] * inv_freq[None, :]            # [M, R/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x[..., : r // 2], x[..., r // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def mla_layer_reference(x: torch.Tensor, weights: dict, cache: dict, cfg: Preset, position,
                        *, attention=None) -> torch.Tensor:
    """One MLA decode step of one layer (fp32 math), appending this token to ``cache``.

    x: [M, H] hidden states (after the input norm); weights: ``k3lab.weights.mla_weights``;
    cache: {"kv_cache": [M, L_max, C + R], "seq_lens": [M] int32}; position: int or [M] ints,
    the index this token takes in each sequence (its cache row). The cache row at ``position``
    is overwritten and ``seq_lens`` is set to ``position + 1`` in place; attention then covers
    positions [0, position].
    attention: optional ``fn(q_lat, q_rope, kv_cache, seq_lens, *, sm_scale) -> o_lat`` replacing
    :func:`mla_decode_reference` (to run a kernel inside the layer). Returns [M, H] fp32.

    The ops, in the model's order: q_a, q_a_norm, q_b; kv_a, kv_a_norm; cache append; q absorb
    (q_nope @ W_uk); attention; v absorb (o_lat @ W_uv^T); output gate sigmoid(x @ g_proj^T);
    o_proj. RoPE on the rope part only when ``cfg.mla_rope`` (simplified, see ``ROPE_THETA``).
    """
    m = x.shape[0]
    hm, nope, r, v, c_dim = cfg.mla_heads, cfg.qk_nope, cfg.qk_rope, cfg.v_head, cfg.kv_lora
    kv_cache, seq_lens = cache["kv_cache"], cache["seq_lens"]
    pos = torch.as_tensor(position, device=x.device).to(torch.int64).reshape(-1).expand(m)
    xf = x.float()

    q = _rms_norm(xf @ weights["q_a"].float().T, weights["q_a_norm"], cfg.rms_eps)
    q = (q @ weights["q_b"].float().T).view(m, hm, nope + r)
    q_nope, q_rope = q[..., :nope], q[..., nope:]

    kv = xf @ weights["kv_a"].float().T
    c = _rms_norm(kv[:, :c_dim], weights["kv_a_norm"], cfg.rms_eps)
    kr = kv[:, c_dim:]
    if cfg.mla_rope:
        q_rope = rope_rotate(q_rope, pos)
        kr = rope_rotate(kr, pos)

    rows = torch.arange(m, device=x.device)
    kv_cache[rows, pos] = torch.cat([c, kr], dim=-1).to(kv_cache.dtype)
    seq_lens.copy_((pos + 1).to(seq_lens.dtype))

    w_uk, w_uv = split_kv_b(weights["kv_b"].float(), hm, nope, v)
    q_lat = torch.einsum("mhn,hnc->mhc", q_nope, w_uk)
    sm_scale = (nope + r) ** -0.5  # K3: no mscale
    if attention is None:
        o_lat = mla_decode_reference(q_lat, q_rope, kv_cache, seq_lens, sm_scale=sm_scale)
    else:
        o_lat = attention(q_lat.to(kv_cache.dtype), q_rope.to(kv_cache.dtype), kv_cache,
                          seq_lens, sm_scale=sm_scale).float()
    o = torch.einsum("mhc,hvc->mhv", o_lat, w_uv).reshape(m, hm * v)
    o = o * torch.sigmoid(xf @ weights["g_proj"].float().T)
    return o @ weights["o_proj"].float().T
