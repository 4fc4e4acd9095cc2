"""Latent MoE, op by op (docs/model.md): the unfused truth of the moe boundary.

```
ids, w = route(x)                               # k3lab.reference.route (route boundary)
z  = x @ W_down^T                               # latent down-projection H -> D
a_e = SiTU(z @ W1[e]^T, z @ W3[e]^T)            # stage 1, per selected expert
y  = sum_e w_e * (a_e @ W2[e]^T)                # stage 2, weighted sum in fp32
out = RMSNorm_D(y) @ W_up^T + SharedMLP(x)      # tail
```
Presets without a latent (K2-style) skip the down / norm / up ops: ``out = y + SharedMLP(x)``.

Every function takes ``dtype``, the dtype the matmul operands are cast to:
- ``torch.float32`` (default): the truth the tests compare kernels against;
- ``torch.bfloat16``: the model's own numerics (bf16 GEMM operands with fp32 accumulation inside
  the GEMM, bf16 GEMM outputs; activations, the expert sum and the norm in fp32). The boundary
  times this mode as "the reference", so its speedups are not inflated by fp32 weight casts.

Selected experts are looked up with ``index_select`` on device tensors (no ``.item()``), so the
loop can be captured in a CUDA graph. MXFP4 experts are dequantized per selected expert with
arithmetic only (no host-to-device table copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3lab.kernels.mxfp4 import MXFP4, mxfp4_tiled_codes

__all__ = [
    "situ", "silu_mul", "activate", "dequantize_mxfp4", "expert_matrix", "expert_act",
    "expert_down", "expert_forward", "moe_stage1_reference", "moe_stage2_reference",
    "rms_norm_reference", "shared_mlp_reference", "latent_moe_tail_reference",
    "latent_moe_from_plan_reference", "latent_moe_reference", "fp8_row_scales",
    "fp8_quantize_rows", "latent_moe_a8_from_plan_reference",
]

ACTIVATIONS = ("situ", "silu")


# ---------------------------------------------------------------------------------------------
# activations (fp32)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float = 4.0,
         linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU(g, u) = beta * tanh(g / beta) * sigmoid(g) * (linear_beta * tanh(u / linear_beta)),
    in fp32."""
    g, u = g.float(), u.float()
    gate = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return gate * (linear_beta * torch.tanh(u / linear_beta))


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU(g) * u in fp32 (the K2-style expert activation)."""
    return F.silu(g.float()) * u.float()


def activate(g: torch.Tensor, u: torch.Tensor, activation: str = "situ", beta: float = 4.0,
             linear_beta: float = 25.0) -> torch.Tensor:
    if activation == "situ":
        return situ(g, u, beta, linear_beta)
    if activation == "silu":
        return silu_mul(g, u)
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


# ---------------------------------------------------------------------------------------------
# weights


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of MXFP4 codes: packed uint8 [..., N, K/2] (even element in the low nibble),
    scales uint8 E8M0 [..., N, K/32]. Same values as ``mxfp4_dequantize``, computed
    without a lookup table: E2M1 code ``s e e m`` is ``m / 2`` when ``e == 0``, else
    ``2^(e-1) * (1 + m/2)``."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).to(torch.int32)
    e = ((codes >> 1) & 3).float()
    m = (codes & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1.0) * (1.0 + 0.5 * m))
    vals = torch.where((codes & 8) != 0, -mag, mag)
    scale = torch.exp2(scales.float() - 127.0).repeat_interleave(32, dim=-1)
    return vals * scale


def expert_matrix(w: torch.Tensor | MXFP4, idx: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Expert ``idx`` (an int64 device tensor of one element) of ``w`` [E, N, K] (bf16 or MXFP4)
    as a [N, K] matrix in ``dtype``. MXFP4 values are exact in bf16 and fp32."""
    if isinstance(w, MXFP4):
        packed = torch.index_select(w.packed, 0, idx)[0]
        scales = torch.index_select(w.scales, 0, idx)[0]
        if w.layout == "tiled":  # the kernels' layout: back to rows
            packed = mxfp4_tiled_codes(packed, inverse=True)
        return dequantize_mxfp4(packed, scales).to(dtype)
    return torch.index_select(w, 0, idx)[0].to(dtype)


def _mm(x: torch.Tensor, w: torch.Tensor, dtype) -> torch.Tensor:
    """x @ w^T with both operands in ``dtype``, returned in fp32."""
    return F.linear(x.to(dtype), w.to(dtype)).float()


# ---------------------------------------------------------------------------------------------
# one expert


def expert_act(z: torch.Tensor, w13_e: torch.Tensor, *, activation: str = "situ",
               situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
               dtype=torch.float32) -> torch.Tensor:
    """Stage 1 of one expert: z [..., D], w13_e [2I, D] (gate rows then up rows) -> a [..., I]
    fp32."""
    gu = _mm(z, w13_e, dtype)
    i = w13_e.shape[0] // 2
    return activate(gu[..., :i], gu[..., i:], activation, situ_beta, situ_linear_beta)


def expert_down(a: torch.Tensor, w2_e: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Stage 2 of one expert: a [..., I], w2_e [D, I] -> [..., D] fp32."""
    return _mm(a, w2_e, dtype)


def expert_forward(z: torch.Tensor, w13_e: torch.Tensor, w2_e: torch.Tensor, *,
                   activation: str = "situ", situ_beta: float = 4.0,
                   situ_linear_beta: float = 25.0, dtype=torch.float32) -> torch.Tensor:
    """One expert's MLP: z [..., D] -> [..., D] fp32."""
    a = expert_act(z, w13_e, activation=activation, situ_beta=situ_beta,
                   situ_linear_beta=situ_linear_beta, dtype=dtype)
    return expert_down(a, w2_e, dtype)


# ---------------------------------------------------------------------------------------------
# the two expert stages over a route plan


def moe_stage1_reference(z: torch.Tensor, plan, w13, *, activation: str = "situ",
                         situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                         dtype=torch.float32) -> torch.Tensor:
    """a [M * top_k, I] fp32, row ``t * top_k + k`` = the activation of token t's k-th expert.

    z [M, D]; plan a RoutePlan (only topk_ids is read); w13 [E, 2I, D] bf16 or MXFP4.
    """
    m, top_k = plan.topk_ids.shape
    ids = plan.topk_ids.long()
    rows = []
    for t in range(m):
        for k in range(top_k):
            w13_e = expert_matrix(w13, ids[t, k:k + 1], dtype)
            rows.append(expert_act(z[t], w13_e, activation=activation, situ_beta=situ_beta,
                                   situ_linear_beta=situ_linear_beta, dtype=dtype))
    return torch.stack(rows)


def moe_stage2_reference(a: torch.Tensor, plan, w2, *, dtype=torch.float32) -> torch.Tensor:
    """y [M, D] fp32 = sum_k topk_weights[t, k] * (a[t * top_k + k] @ w2[topk_ids[t, k]]^T).

    a [M * top_k, I]; w2 [E, D, I] bf16 or MXFP4.
    """
    m, top_k = plan.topk_ids.shape
    ids = plan.topk_ids.long()
    out = []
    for t in range(m):
        y = None
        for k in range(top_k):
            w2_e = expert_matrix(w2, ids[t, k:k + 1], dtype)
            part = plan.topk_weights[t, k].float() * expert_down(a[t * top_k + k], w2_e, dtype)
            y = part if y is None else y + part
        out.append(y)
    return torch.stack(out)


# ---------------------------------------------------------------------------------------------
# dense parts: shared MLP, latent norm + up-projection


def rms_norm_reference(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMSNorm over the last dimension."""
    y = y.float()
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def shared_mlp_reference(x: torch.Tensor, shared_w13: torch.Tensor, shared_w2: torch.Tensor, *,
                         activation: str = "situ", situ_beta: float = 4.0,
                         situ_linear_beta: float = 25.0, dtype=torch.float32) -> torch.Tensor:
    """The shared experts as one MLP: x [M, H], shared_w13 [2S, H], shared_w2 [H, S] ->
    [M, H] fp32."""
    return expert_forward(x, shared_w13, shared_w2, activation=activation, situ_beta=situ_beta,
                          situ_linear_beta=situ_linear_beta, dtype=dtype)


def _shared_out(shared, dtype) -> torch.Tensor | None:
    if shared is None:
        return None
    if isinstance(shared, torch.Tensor):
        return shared.float()
    s = dict(shared)
    return shared_mlp_reference(s["x"], s["w13"], s["w2"], activation=s.get("activation", "situ"),
                                situ_beta=s.get("situ_beta", 4.0),
                                situ_linear_beta=s.get("situ_linear_beta", 25.0), dtype=dtype)


def latent_moe_tail_reference(y: torch.Tensor, norm_weight: torch.Tensor | None,
                              up_weight: torch.Tensor | None, shared=None, eps: float = 1e-5, *,
                              dtype=torch.float32) -> torch.Tensor:
    """RMSNorm(y) @ up_weight^T + shared, fp32 [M, H].

    y [M, D] fp32; norm_weight [D]; up_weight [H, D]; shared None, a tensor [M, H], or a dict
    ``{"x": [M, H], "w13": [2S, H], "w2": [H, S], "activation", "situ_beta",
    "situ_linear_beta"}`` (the shared MLP's weights). With ``up_weight=None`` (no latent) the
    result is ``y + shared``.
    """
    out = y.float() if up_weight is None else _mm(rms_norm_reference(y, norm_weight, eps),
                                                  up_weight, dtype)
    s = _shared_out(shared, dtype)
    return out if s is None else out + s


# ---------------------------------------------------------------------------------------------
# the whole block


def latent_moe_from_plan_reference(x: torch.Tensor, plan, weights: dict, cfg, *,
                                   dtype=torch.float32) -> torch.Tensor:
    """The moe boundary's ops given the route plan: latent down, per selected expert SiTU MLP,
    weighted fp32 sum, latent RMSNorm + up, plus the shared MLP. x [M, H] -> [M, H] fp32.

    weights: the dict of ``k3lab.weights.moe_weights`` (latent_down [D, H], latent_norm [D],
    latent_up [H, D] when cfg.latent; w13, w2; shared_w13, shared_w2 when cfg has shared
    experts). cfg: a k3lab Preset (activation, situ betas, rms_eps, latent).
    """
    act = dict(activation=cfg.activation, situ_beta=cfg.situ_beta,
               situ_linear_beta=cfg.situ_linear_beta)
    z = _mm(x, weights["latent_down"], dtype) if cfg.latent else x.float()
    m, top_k = plan.topk_ids.shape
    ids = plan.topk_ids.long()
    ys = []
    for t in range(m):
        y = None
        for k in range(top_k):                     # per selected expert
            e = ids[t, k:k + 1]
            part = expert_forward(z[t], expert_matrix(weights["w13"], e, dtype),
                                  expert_matrix(weights["w2"], e, dtype), dtype=dtype, **act)
            part = plan.topk_weights[t, k].float() * part
            y = part if y is None else y + part
        ys.append(y)
    y = torch.stack(ys)
    shared = None
    if cfg.shared_intermediate:
        shared = {"x": x, "w13": weights["shared_w13"], "w2": weights["shared_w2"], **act}
    if cfg.latent:
        return latent_moe_tail_reference(y, weights["latent_norm"], weights["latent_up"], shared,
                                         cfg.rms_eps, dtype=dtype)
    return latent_moe_tail_reference(y, None, None, shared, dtype=dtype)


def latent_moe_reference(x: torch.Tensor, weights: dict, cfg, *, dtype=torch.float32,
                         block_m: int = 1) -> torch.Tensor:
    """docs/model.md end to end: route (``route_sort_reference``) then
    :func:`latent_moe_from_plan_reference`. x [M, H] bf16 -> [M, H] fp32."""
    from k3lab.reference.route import route_sort_reference

    plan = route_sort_reference(
        x, weights["gate_weight"], weights["correction_bias"], top_k=cfg.top_k,
        n_group=cfg.n_group, topk_group=cfg.topk_group, renormalize=cfg.renormalize,
        routed_scaling_factor=cfg.routed_scaling, block_m=block_m, out_dim=None)
    return latent_moe_from_plan_reference(x, plan, weights, cfg, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# FP8 (e4m3) activations: the A8W4 numerics of the persistent kernel (kernels/moe/persistent.py)

E4M3_MAX = 448.0


def fp8_row_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-row power-of-two scales 2^s [..., 1] fp32 of x [..., K]: s the smallest integer with
    amax(|row|) / 2^s <= 448 (e4m3's largest value, 1.75 x 2^8), clamped to [-126, 126]; an
    all-zero row gets 1. A power of two makes the scaling exact both ways."""
    amax = x.float().abs().amax(-1, keepdim=True)
    bits = amax.view(torch.int32)
    s = ((bits >> 23) & 255) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    s = torch.where(amax > 0, s, torch.zeros_like(s)).clamp(-126, 126)
    return torch.exp2(s.float())


def fp8_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the kernel's e4m3 activations see it, dequantized: each row divided by its
    :func:`fp8_row_scales` scale, rounded to e4m3 (nearest even), multiplied back; fp32."""
    scale = fp8_row_scales(x)
    return (x.float() / scale).to(torch.float8_e4m3fn).float() * scale


def latent_moe_a8_from_plan_reference(x: torch.Tensor, plan, weights: dict, cfg, *,
                                      up_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The moe boundary's ops given the route plan with FP8 expert activations (A8W4 with MXFP4
    experts), in fp32 otherwise: z = x @ W_down^T rounded to bf16 then quantized per token
    (:func:`fp8_quantize_rows`); per selected expert a = act(zq @ W1^T, zq @ W3^T) rounded to
    bf16 then quantized per routed row, y = sum_k w_k (aq @ W2^T); the tail and the shared MLP
    as :func:`latent_moe_from_plan_reference` (fp32). up_weight: the latent up-projection to
    use instead of weights["latent_up"] (e.g. an FP8 weight dequantized). x [M, H] -> fp32."""
    act = dict(activation=cfg.activation, situ_beta=cfg.situ_beta,
               situ_linear_beta=cfg.situ_linear_beta)
    z = _mm(x, weights["latent_down"], torch.float32) if cfg.latent else x.float()
    zq = fp8_quantize_rows(z.to(torch.bfloat16))
    m, top_k = plan.topk_ids.shape
    ids = plan.topk_ids.long()
    ys = []
    for t in range(m):
        y = None
        for k in range(top_k):
            e = ids[t, k:k + 1]
            a = expert_act(zq[t], expert_matrix(weights["w13"], e), **act)
            aq = fp8_quantize_rows(a.to(torch.bfloat16))
            part = plan.topk_weights[t, k].float() * expert_down(aq, expert_matrix(weights["w2"],
                                                                                   e))
            y = part if y is None else y + part
        ys.append(y)
    y = torch.stack(ys)
    shared = None
    if cfg.shared_intermediate:
        shared = {"x": x, "w13": weights["shared_w13"], "w2": weights["shared_w2"], **act}
    if not cfg.latent:
        return latent_moe_tail_reference(y, None, None, shared)
    up = weights["latent_up"] if up_weight is None else up_weight
    return latent_moe_tail_reference(y, weights["latent_norm"], up, shared, cfg.rms_eps)
