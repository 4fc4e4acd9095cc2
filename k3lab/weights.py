"""Synthetic weights and decode caches, deterministic from a seed.

Weights are drawn on the target device (so a full-size Kimi-K3 shard is generated in seconds on a
GPU) from a generator seeded with ``seed``; the same seed on the same device gives the same
tensors. Scales keep the math realistic: projections have std ``fan_in ** -0.5`` so activations stay
near unit RMS, router logits spread enough for a non-degenerate top-k, the KDA decay keeps the
recurrent state bounded, and the MLA scores are not one-hot.
Routed experts can be MXFP4 (``k3lab.kernels.mxfp4``, the type the kernels take).
"""

from __future__ import annotations

import math

import torch

from k3lab.config import Preset
from k3lab.kernels.mxfp4 import MXFP4, MXFP4_GROUP, mxfp4_quantize

__all__ = [
    "make_generator", "randn", "hidden_states",
    "router_weights", "moe_weights", "kda_weights", "kda_cache", "mla_weights", "mla_cache",
    "attn_res_weights", "attn_res_inputs",
]

# ---------------------------------------------------------------------------------------------
# random tensors


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed))
    return gen


def randn(shape, gen: torch.Generator, *, std: float = 1.0, mean: float = 0.0,
          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Normal samples drawn in fp32 on the generator's device, then cast to ``dtype``."""
    t = torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32)
    return (t.mul_(std).add_(mean)).to(dtype)


def _uniform(shape, gen, lo, hi, dtype=torch.float32):
    t = torch.rand(shape, generator=gen, device=gen.device, dtype=torch.float32)
    return (t * (hi - lo) + lo).to(dtype)


def _linear(out_f: int, in_f: int, gen, dtype, gain: float = 1.0) -> torch.Tensor:
    """A projection weight [out_f, in_f] with std gain / sqrt(in_f)."""
    return randn((out_f, in_f), gen, std=gain / math.sqrt(in_f), dtype=dtype)


def hidden_states(cfg: Preset, m: int, gen, dtype=torch.bfloat16, width: int | None = None):
    """Token activations [m, width or hidden] with unit RMS."""
    return randn((m, width or cfg.hidden), gen, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# weight sets (dicts of tensors; names follow the model's parameter names)


def router_weights(cfg: Preset, gen, dtype=torch.bfloat16) -> dict:
    """gate_weight [E, H] (dtype); correction_bias [E] fp32.

    The gate gain makes the sigmoid scores spread over (0, 1); the bias is small and positive like
    a trained ``e_score_correction_bias`` so it reorders near-ties without dominating.
    """
    return {
        "gate_weight": _linear(cfg.n_experts, cfg.hidden, gen, dtype, gain=2.0),
        "correction_bias": _uniform((cfg.n_experts,), gen, 0.0, 0.1),
    }


def moe_weights(cfg: Preset, gen, *, dtype=torch.bfloat16, expert_format: str = "bf16",
                chunk: int = 64) -> dict:
    """One MoE FFN's weights at ``cfg``'s shard (D = cfg.moe_in, I = cfg.moe_intermediate).

    router (see router_weights); latent_down [D, H], latent_norm [D] fp32, latent_up [H, D] when
    the preset has a latent; w13 [E, 2I, D] (rows [0, I) gate w1, [I, 2I) up w3) and w2 [E, D, I],
    bf16 or MXFP4 (``expert_format="mxfp4"``, quantized ``chunk`` experts at a time);
    shared_w13 [2S, H] and shared_w2 [H, S] when the preset has shared experts.
    """
    if expert_format not in ("bf16", "mxfp4"):
        raise ValueError(f"expert_format: expected 'bf16' or 'mxfp4', got {expert_format!r}")
    e, d, i, h = cfg.n_experts, cfg.moe_in, cfg.moe_intermediate, cfg.hidden
    w = dict(router_weights(cfg, gen, dtype))
    if cfg.latent:
        w["latent_down"] = _linear(d, h, gen, dtype)
        w["latent_norm"] = _uniform((d,), gen, 0.8, 1.2)
        w["latent_up"] = _linear(h, d, gen, dtype)

    def experts(rows, cols):
        # filled ``chunk`` experts at a time into preallocated storage: a K3 tp 1 expert set is
        # 59 GB in bf16, and one fp32 draw of it would not fit beside it on a 141 GB GPU
        if expert_format == "bf16":
            out = torch.empty((e, rows, cols), dtype=dtype, device=gen.device)
        else:
            if cols % MXFP4_GROUP:
                raise ValueError(f"expert_format: MXFP4 needs input sizes that are multiples of "
                                 f"32, got {cols} (preset {cfg.name}, tp {cfg.tp})")
            out = MXFP4(torch.empty((e, rows, cols // 2), dtype=torch.uint8, device=gen.device),
                        torch.empty((e, rows, cols // MXFP4_GROUP), dtype=torch.uint8,
                                    device=gen.device))
        for s in range(0, e, chunk):
            n = min(chunk, e - s)
            w = randn((n, rows, cols), gen, std=cols ** -0.5, dtype=torch.float32)
            if expert_format == "bf16":
                out[s:s + n] = w.to(dtype)
            else:
                q = mxfp4_quantize(w)
                out.packed[s:s + n], out.scales[s:s + n] = q.packed, q.scales
            del w
        return out

    w["w13"] = experts(2 * i, d)
    w["w2"] = experts(d, i)
    if cfg.shared_intermediate:
        w["shared_w13"] = _linear(2 * cfg.shared_intermediate, h, gen, dtype)
        w["shared_w2"] = _linear(h, cfg.shared_intermediate, gen, dtype)
    return w


def kda_weights(cfg: Preset, gen, dtype=torch.bfloat16) -> dict:
    """One KDA layer at ``cfg``'s shard (Hl = cfg.kda_heads, d = cfg.kda_head_dim, H = hidden).

    q_proj, k_proj, v_proj [Hl*d, H]; q_conv, k_conv, v_conv [Hl*d, conv] (depthwise causal
    conv taps, last tap = current token); f_a [R, H] (replicated), f_b [Hl*d, R]; A_log [Hl]
    fp32; dt_bias [Hl*d] fp32; b_proj [Hl, H]; g_proj [Hl*d, H] (output gate); o_norm [d] fp32;
    o_proj [H, Hl*d].
    """
    hl, dk, h, r, c = cfg.kda_heads, cfg.kda_head_dim, cfg.hidden, cfg.kda_f_rank, cfg.kda_conv
    if hl == 0:
        raise ValueError(f"preset: {cfg.name} has no KDA layers")
    w = {name: _linear(hl * dk, h, gen, dtype) for name in ("q_proj", "k_proj", "v_proj")}
    for name in ("q_conv", "k_conv", "v_conv"):
        w[name] = randn((hl * dk, c), gen, std=c ** -0.5, dtype=dtype)
    w["f_a"] = _linear(r, h, gen, dtype)
    w["f_b"] = _linear(hl * dk, r, gen, dtype)
    # exp(A_log) in [1, 4]: with lower_bound -5 the per-channel decay exp(g) spans about
    # e^-5 .. e^-0.1, so the state forgets fast on some channels and remembers on others.
    w["A_log"] = _uniform((hl,), gen, 0.0, math.log(4.0))
    w["dt_bias"] = randn((hl * dk,), gen, std=0.5, mean=-1.0, dtype=torch.float32)
    w["b_proj"] = _linear(hl, h, gen, dtype)
    w["g_proj"] = _linear(hl * dk, h, gen, dtype)
    w["o_norm"] = _uniform((dk,), gen, 0.8, 1.2)
    w["o_proj"] = _linear(h, hl * dk, gen, dtype)
    return w


def kda_cache(cfg: Preset, m: int, gen, dtype=torch.bfloat16) -> dict:
    """Decode cache of one KDA layer: conv windows q/k/v [m, Hl*d, conv-1] (dtype, oldest first)
    and the recurrent state [m, Hl, d (k), d (v)] fp32 of a warmed-up sequence (bounded values)."""
    hl, dk, c = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv
    cache = {f"{n}_conv_state": randn((m, hl * dk, c - 1), gen, dtype=dtype) for n in "qkv"}
    cache["state"] = randn((m, hl, dk, dk), gen, std=dk ** -0.5, dtype=torch.float32)
    return cache


def mla_weights(cfg: Preset, gen, dtype=torch.bfloat16) -> dict:
    """One MLA layer at ``cfg``'s shard (Hm = cfg.mla_heads).

    q_a [q_lora, H], q_a_norm [q_lora] fp32, q_b [Hm*(nope+rope), q_lora]; kv_a
    [kv_lora+rope, H], kv_a_norm [kv_lora] fp32; kv_b [Hm*(nope+v), kv_lora] (per head: nope rows
    of W_uk then v rows of W_uv); g_proj [Hm*v, H] (output gate); o_proj [H, Hm*v].
    """
    hm, h = cfg.mla_heads, cfg.hidden
    return {
        "q_a": _linear(cfg.q_lora, h, gen, dtype),
        "q_a_norm": _uniform((cfg.q_lora,), gen, 0.8, 1.2),
        "q_b": _linear(hm * cfg.qk_head, cfg.q_lora, gen, dtype),
        "kv_a": _linear(cfg.kv_lora + cfg.qk_rope, h, gen, dtype),
        "kv_a_norm": _uniform((cfg.kv_lora,), gen, 0.8, 1.2),
        # gain 2 on kv_b makes the absorbed scores spread (softmax neither flat nor one-hot)
        "kv_b": _linear(hm * (cfg.qk_nope + cfg.v_head), cfg.kv_lora, gen, dtype, gain=2.0),
        "g_proj": _linear(hm * cfg.v_head, h, gen, dtype),
        "o_proj": _linear(h, hm * cfg.v_head, gen, dtype),
    }


def mla_cache(cfg: Preset, m: int, max_len: int, seq_lens, gen, dtype=torch.bfloat16) -> dict:
    """Latent KV cache [m, max_len, kv_lora + rope] (dtype): the normalized latent c (unit RMS)
    then the rope columns, filled for every position (positions past seq_lens hold data too, so a
    kernel that reads past the length is caught); seq_lens int32 [m] on the cache's device."""
    lens = torch.as_tensor(seq_lens, dtype=torch.int32).reshape(-1)
    if lens.numel() == 1 and m > 1:
        lens = lens.expand(m).clone()
    if lens.numel() != m or int(lens.min()) < 1 or int(lens.max()) > max_len:
        raise ValueError(f"seq_lens: expected {m} lengths in [1, {max_len}], got {lens.tolist()}")
    kv = randn((m, max_len, cfg.kv_lora + cfg.qk_rope), gen, dtype=dtype)
    return {"kv_cache": kv, "seq_lens": lens.to(gen.device)}


def attn_res_weights(cfg: Preset, gen, dtype=torch.bfloat16) -> dict:
    """AttnRes read weights [H]: res_norm_weight, res_proj_weight (query of the candidate softmax,
    scaled so scores differ by O(1)), and norm_weight of the following RMSNorm."""
    h = cfg.hidden
    return {
        "res_norm_weight": _uniform((h,), gen, 0.8, 1.2, dtype),
        "res_proj_weight": randn((h,), gen, std=h ** -0.5 * 2.0, dtype=dtype),
        "norm_weight": _uniform((h,), gen, 0.8, 1.2, dtype),
    }


def attn_res_inputs(cfg: Preset, n_sealed: int, m: int, gen, dtype=torch.bfloat16) -> dict:
    """Residual bank [n_sealed, m, H] (block sums grow in magnitude with depth) and live [m, H]."""
    h = cfg.hidden
    bank = randn((n_sealed, m, h), gen, dtype=torch.float32)
    if n_sealed:
        bank *= torch.linspace(1.0, 4.0, n_sealed, device=gen.device).view(-1, 1, 1)
    return {"bank": bank.to(dtype), "live": randn((m, h), gen, std=2.0, dtype=dtype)}
