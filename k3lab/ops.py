"""The ops of one decode step, layer by layer, in execution order.

Every op has a name ``<part>.<op>``. A boundary (``k3lab.boundaries``) owns a set of these ops; a
stack of changes (``k3lab.stack``) gives every op exactly one owner, and an op nobody claims runs
its reference. Dense projections (the ``*_proj`` ops left unowned here) run through cuBLAS in every
variant.
"""

from __future__ import annotations

__all__ = ["ATTN_RES_OPS", "KDA_OPS", "MLA_OPS", "MOE_OPS", "layer_ops"]

# AttnRes read + the RMSNorm that follows it; a layer has two reads (before attention, before FFN).
ATTN_RES_OPS = ("attn_res.read", "attn_res.norm")

KDA_OPS = (
    "kda.q_proj", "kda.k_proj", "kda.v_proj",   # cuBLAS projections x -> Hl*d
    "kda.short_conv",                           # depthwise causal conv step + SiLU (q, k, v)
    "kda.f_a_proj",                             # low-rank forget gate, first half (x -> R)
    "kda.f_b_proj",                             # second half (R -> Hl*d)
    "kda.gate",                                 # lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
    "kda.beta_proj", "kda.beta",                # x @ W_b^T, sigmoid
    "kda.l2norm",                               # q, k L2 normalization (and q scale)
    "kda.recurrence",                           # decay, delta update, output, state in place
    "kda.g_proj",                               # output gate projection
    "kda.out_norm_gate",                        # per-head RMSNorm * sigmoid(gate)
    "kda.o_proj",
)

MLA_OPS = (
    "mla.q_a_proj", "mla.q_a_norm", "mla.q_b_proj",
    "mla.kv_a_proj", "mla.kv_a_norm", "mla.cache_append",
    "mla.q_absorb",                             # q_nope @ W_uk (128 -> 512 per head)
    "mla.attention",                            # split-KV partials + log-sum-exp combine
    "mla.v_absorb",                             # o_lat @ W_uv (512 -> 128 per head)
    "mla.g_proj", "mla.out_gate", "mla.o_proj",
)

MOE_OPS = (
    "moe.gate_proj",                            # router GEMV, FP32 logits
    "moe.route_select",                         # sigmoid, bias, (grouped) top-k, renormalize
    "moe.sort",                                 # sort metadata for the expert GEMMs
    "moe.latent_down",                          # x -> latent
    "moe.expert_align",                         # expert kernels' own alignment of the routing
    "moe.stage1",                               # w13 GEMVs + activation
    "moe.stage2",                               # w2 GEMVs + weighted sum
    "moe.latent_norm", "moe.latent_up",
    "moe.shared",                               # shared experts' MLP
    "moe.shared_add",
)


def layer_ops(kind: str) -> tuple[str, ...]:
    """Ordered ops of one decode layer: ``kind`` is "kda" or "mla" (both with a latent MoE FFN).

    The two AttnRes reads are distinguished by a suffix: ``attn_res.read@attn`` and ``@ffn``.
    """
    if kind not in ("kda", "mla"):
        raise ValueError(f"kind: expected 'kda' or 'mla', got {kind!r}")
    attn = KDA_OPS if kind == "kda" else MLA_OPS
    pre_attn = tuple(f"{op}@attn" for op in ATTN_RES_OPS)
    pre_ffn = tuple(f"{op}@ffn" for op in ATTN_RES_OPS)
    return pre_attn + attn + pre_ffn + MOE_OPS
