"""The bytes floor of one decode token: what every op must move at least, by category.

Counted from the preset's shard (bytes of one tp rank): every weight a token reads once (the
projections, the router, the selected experts, layer 0's dense MLP, the LM head shard and one
embedding row), the KDA recurrent state read and written and its conv windows, the MLA latent
cache read over the context (and the new row written), and the AttnRes candidates of every
read. Activations between ops (a few KB at batch 1) are left out. Over the copy bandwidth
measured in the same run this is the token's roofline.
"""

from __future__ import annotations

from k3lab.config import Preset
from k3lab.reference.layer import token_schedule

__all__ = ["token_bytes", "expert_bytes_per_token", "BF16", "LATENT_UP_FORMATS"]

BF16, FP32, E4M3 = 2, 4, 1
LATENT_UP_FORMATS = ("bf16", "e4m3")  # e4m3: the seed's FP8 latent tail (#18), fp32 row scales
MXFP4_BYTES = 0.5 + 1 / 32  # a code and its share of the group scale


def expert_bytes_per_token(cfg: Preset, expert_format: str, m: int = 1) -> float:
    """The selected experts' w13 and w2 bytes in one MoE layer (top_k distinct experts a token;
    at most every expert)."""
    if expert_format not in ("bf16", "mxfp4"):
        raise ValueError(f"expert_format: expected 'bf16' or 'mxfp4', got {expert_format!r}")
    per_weight = BF16 if expert_format == "bf16" else MXFP4_BYTES
    d, i = cfg.moe_in, cfg.moe_intermediate
    return min(m * cfg.top_k, cfg.n_experts) * 3 * i * d * per_weight


def _kda(cfg: Preset) -> tuple[float, float]:
    """(projection bytes, KDA-core bytes) of one KDA layer."""
    hd, h, r, hl = cfg.kda_heads * cfg.kda_head_dim, cfg.hidden, cfg.kda_f_rank, cfg.kda_heads
    proj = (4 * hd + r + hl) * h * BF16 + h * hd * BF16
    state = 2 * hl * cfg.kda_head_dim ** 2 * FP32
    conv = 3 * hd * cfg.kda_conv * BF16 + 3 * 2 * hd * (cfg.kda_conv - 1) * BF16
    return proj, state + conv + hd * r * BF16 + 2 * hd * FP32


def _mla(cfg: Preset, context: int) -> tuple[float, float]:
    """(projection bytes, MLA-core bytes) of one MLA layer at ``context``."""
    h, hm, row = cfg.hidden, cfg.mla_heads, cfg.kv_lora + cfg.qk_rope
    hv = hm * cfg.v_head
    proj = ((cfg.q_lora + row + hv) * h + hm * cfg.qk_head * cfg.q_lora + h * hv) * BF16
    core = (context + 1) * row * BF16 + hm * (cfg.qk_nope + cfg.v_head) * cfg.kv_lora * BF16
    return proj, core


def _moe(cfg: Preset, expert_format: str, latent_up_format: str) -> dict[str, float]:
    h, d, s = cfg.hidden, cfg.moe_in, cfg.shared_intermediate
    up = h * d * E4M3 + h * FP32 if latent_up_format == "e4m3" else h * d * BF16
    dense = (d * h * BF16 + up) * bool(cfg.latent) + 3 * s * h * BF16
    return {"dense projections": dense, "routing": cfg.n_experts * h * BF16,
            "MoE experts": expert_bytes_per_token(cfg, expert_format)}


def token_bytes(cfg: Preset, context: int, expert_format: str = "mxfp4",
                latent_up_format: str = "bf16") -> dict[str, float]:
    """Bytes one token moves at least on one tp rank, by category (``stack.CATEGORIES`` names;
    norms move no bytes of their own beyond their weights, counted with AttnRes).
    latent_up_format: the latent MoE tail's up-projection as the model stores it ("bf16") or
    as a stack with the FP8 latent tail runs it ("e4m3": a byte a weight and an fp32 scale a
    row)."""
    if context < 1:
        raise ValueError(f"context: expected a positive length, got {context}")
    if latent_up_format not in LATENT_UP_FORMATS:
        raise ValueError(f"latent_up_format: expected one of {LATENT_UP_FORMATS}, got "
                         f"{latent_up_format!r}")
    out = dict.fromkeys(("dense projections", "routing", "MoE experts", "KDA", "MLA",
                         "AttnRes"), 0.0)
    mla = set(cfg.mla_layers)
    kda_proj, kda_core = _kda(cfg) if cfg.kda_heads else (0.0, 0.0)
    mla_proj, mla_core = _mla(cfg, context)
    moe = _moe(cfg, expert_format, latent_up_format)
    h = cfg.hidden
    for layer, (n_sealed, _start) in token_schedule(cfg).items():
        if layer in mla:
            out["dense projections"] += mla_proj
            out["MLA"] += mla_core
        else:
            out["dense projections"] += kda_proj
            out["KDA"] += kda_core
        if layer < cfg.first_dense:
            out["dense projections"] += 3 * cfg.dense_intermediate * h * BF16
        else:
            for k, v in moe.items():
                out[k] += v
        out["AttnRes"] += 2 * ((n_sealed + 1) * h * BF16 + 3 * h * BF16)
    out["AttnRes"] += (cfg.max_attn_res_candidates * h + 3 * h) * BF16   # the final read
    out["dense projections"] += (cfg.vocab // cfg.tp + 1) * h * BF16     # LM head, embedding row
    return out
