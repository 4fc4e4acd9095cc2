"""One whole decode layer, composed from the boundary references, op by op.

    h, x  = AttnRes read + RMSNorm (bank, live)       # before attention
    live += KDA(x) or MLA(x)
    h, x  = AttnRes read + RMSNorm (bank, live)       # before the FFN
    live += LatentMoE(x)

``make_layer`` builds the weights and caches of one layer; ``run_layer`` runs it and returns the
new live partial sum [M, H] bf16. The KDA state and the MLA cache are updated in place, as in
the model.
"""

from __future__ import annotations

import torch

from k3lab.config import Preset
from k3lab.reference.attn_res import attn_res_norm_reference
from k3lab.reference.kda import kda_layer_reference
from k3lab.reference.mla import mla_layer_reference
from k3lab.reference.moe import latent_moe_reference
from k3lab.weights import (
    attn_res_inputs,
    attn_res_weights,
    kda_cache,
    kda_weights,
    make_generator,
    mla_cache,
    mla_weights,
    moe_weights,
)

__all__ = ["make_layer", "run_layer"]


def make_layer(cfg: Preset, kind: str, device, *, seed: int = 0, m: int = 1, context: int = 256,
               expert_format: str = "bf16", n_sealed: int | None = None) -> dict:
    """Weights and caches of one decode layer of ``kind`` ("kda" or "mla") at ``cfg``.

    context: MLA cache length (the token being decoded takes position context - 1).
    n_sealed: sealed AttnRes block sums (default: the most the preset has, at least 1).
    """
    if kind not in ("kda", "mla"):
        raise ValueError(f"kind: expected 'kda' or 'mla', got {kind!r}")
    if kind == "kda" and not cfg.kda_heads:
        raise ValueError(f"kind: preset {cfg.name} has no KDA layers")
    if context < 1:
        raise ValueError(f"context: expected a positive length, got {context}")
    gen = make_generator(seed, device)
    if n_sealed is None:
        n_sealed = max(1, cfg.max_attn_res_candidates - 1)
    state = {"cfg": cfg, "kind": kind, **attn_res_inputs(cfg, n_sealed, m, gen),
             "res_attn": attn_res_weights(cfg, gen), "res_ffn": attn_res_weights(cfg, gen),
             "moe": moe_weights(cfg, gen, expert_format=expert_format)}
    if kind == "kda":
        state["attn"], state["cache"] = kda_weights(cfg, gen), kda_cache(cfg, m, gen)
    else:
        state["attn"] = mla_weights(cfg, gen)
        state["cache"] = mla_cache(cfg, m, context, max(context - 1, 1), gen)
        # a device tensor: a CUDA graph of the layer cannot copy a host int at replay
        state["position"] = torch.full((m,), context - 1, dtype=torch.int64, device=device)
    return state


def _read(state: dict, live: torch.Tensor, site: str):
    w = state[f"res_{site}"]
    return attn_res_norm_reference(state["bank"], live, w["res_norm_weight"],
                                   w["res_proj_weight"], w["norm_weight"],
                                   eps=state["cfg"].rms_eps)


def run_layer(state: dict) -> torch.Tensor:
    """Run one decode layer on ``state`` (from make_layer); returns the new live sum [M, H]."""
    cfg, live = state["cfg"], state["live"]
    _, x = _read(state, live, "attn")
    if state["kind"] == "kda":
        a = kda_layer_reference(x, state["attn"], state["cache"], cfg)
    else:
        a = mla_layer_reference(x, state["attn"], state["cache"], cfg, state["position"])
    live = (live.float() + a.float()).to(live.dtype)
    _, x = _read(state, live, "ffn")
    f = latent_moe_reference(x, state["moe"], cfg)
    return (live.float() + f.float()).to(live.dtype)
