"""One whole decode layer and one whole decode token, composed from the boundary references.

    h, x  = AttnRes read + RMSNorm (bank, live)       # before attention
    live += KDA(x) or MLA(x)
    h, x  = AttnRes read + RMSNorm (bank, live)       # before the FFN
    live += LatentMoE(x)                              # layer 0: the dense MLP

``make_layer`` builds the weights and caches of one layer (the input projections of a layer that
read the same x concatenated once into one ``in_proj`` weight, as an engine lays out its
checkpoint, and the MoE's latent down and shared gate/up into one ``front``; the per-projection
weights are row views of them); ``run_layer`` runs it in fp32 and
returns the new live partial sum [M, H] bf16. The KDA state and the MLA cache are updated in
place, as in the model.

``make_token`` builds a token: the embedding and LM head shards, layer 0 and a window of the
layers after it (distinct weights each), the AttnRes rows buffer and the schedule of sealed
rows; ``run_token`` is its fp32 truth, returning the logits.
"""

from __future__ import annotations

import torch

from k3lab.config import Preset
from k3lab.reference.attn_res import attn_res_norm_reference
from k3lab.reference.dense import dense_reference
from k3lab.reference.kda import kda_layer_reference
from k3lab.reference.mla import mla_layer_reference
from k3lab.reference.moe import latent_moe_from_plan_reference, latent_moe_reference
from k3lab.weights import (
    attn_res_inputs,
    attn_res_weights,
    kda_cache,
    kda_weights,
    make_generator,
    mla_cache,
    mla_weights,
    moe_weights,
    randn,
)

__all__ = ["make_layer", "run_layer", "forced_route", "make_token", "run_token", "token_schedule",
           "window_layers", "KDA_IN", "MLA_IN"]

# Input projections merged into one weight, in the dense boundary's order.
KDA_IN = ("q_proj", "k_proj", "v_proj", "f_a", "b_proj", "g_proj")
MLA_IN = ("q_a", "kv_a", "g_proj")


def _merge(w: dict, names: tuple[str, ...], into: str = "in_proj") -> None:
    """w[into] = the named weights concatenated by rows, their row counts in w[into + "_splits"]
    (``in_splits`` for ``in_proj``); each name becomes a row view."""
    merged = torch.cat([w[n] for n in names])
    splits = "in_splits" if into == "in_proj" else f"{into}_splits"
    w[into], w[splits], off = merged, tuple(w[n].shape[0] for n in names), 0
    for n in names:
        rows = w[n].shape[0]
        w[n] = merged[off:off + rows]
        off += rows


def make_layer(cfg: Preset, kind: str, device, *, seed: int = 0, m: int = 1, context: int = 256,
               expert_format: str = "bf16", n_sealed: int | None = None,
               ffn: str = "moe") -> dict:
    """Weights and caches of one decode layer of ``kind`` ("kda" or "mla") at ``cfg``.

    context: MLA cache length (the token being decoded takes position context - 1).
    n_sealed: sealed AttnRes block sums (default: the most the preset has, at least 1).
    ffn: "moe" (the latent MoE) or "mlp" (layer 0's dense MLP).
    """
    if kind not in ("kda", "mla"):
        raise ValueError(f"kind: expected 'kda' or 'mla', got {kind!r}")
    if kind == "kda" and not cfg.kda_heads:
        raise ValueError(f"kind: preset {cfg.name} has no KDA layers")
    if ffn not in ("moe", "mlp"):
        raise ValueError(f"ffn: expected 'moe' or 'mlp', got {ffn!r}")
    if context < 1:
        raise ValueError(f"context: expected a positive length, got {context}")
    gen = make_generator(seed, device)
    if n_sealed is None:
        n_sealed = max(1, cfg.max_attn_res_candidates - 1)
    state = {"cfg": cfg, "kind": kind, **attn_res_inputs(cfg, n_sealed, m, gen),
             "res_attn": attn_res_weights(cfg, gen), "res_ffn": attn_res_weights(cfg, gen)}
    if ffn == "moe":
        state["moe"] = moe_weights(cfg, gen, expert_format=expert_format)
        if cfg.latent and cfg.shared_intermediate:  # the MoE front's GEMVs of x, one weight
            _merge(state["moe"], ("latent_down", "shared_w13"), into="front")
    else:
        i, h = cfg.dense_intermediate, cfg.hidden
        state["mlp"] = {"gate_up": randn((2 * i, h), gen, std=h ** -0.5),
                        "down": randn((h, i), gen, std=i ** -0.5)}
    if kind == "kda":
        state["attn"], state["cache"] = kda_weights(cfg, gen), kda_cache(cfg, m, gen)
        _merge(state["attn"], KDA_IN)
    else:
        state["attn"] = mla_weights(cfg, gen)
        _merge(state["attn"], MLA_IN)
        state["cache"] = mla_cache(cfg, m, context, max(context - 1, 1), gen)
        # a device tensor: a CUDA graph of the layer cannot copy a host int at replay
        state["position"] = torch.full((m,), context - 1, dtype=torch.int64, device=device)
    return state


def _read(state: dict, bank, live, site: str):
    w = state[f"res_{site}"]
    return attn_res_norm_reference(bank, live, w["res_norm_weight"], w["res_proj_weight"],
                                   w["norm_weight"], eps=state["cfg"].rms_eps)


def _add(live: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return (live.float() + out.float()).to(live.dtype)


def forced_route(x: torch.Tensor, weights: dict, cfg: Preset, topk_ids: torch.Tensor):
    """The route of ``x`` with the experts ``topk_ids`` [M, top_k] imposed: their fp32 sigmoid
    scores, renormalized and scaled as the router does (an object with topk_ids and
    topk_weights, all ``latent_moe_from_plan_reference`` reads)."""
    from types import SimpleNamespace

    s = torch.sigmoid(x.float() @ weights["gate_weight"].float().T)
    w = s.gather(1, topk_ids.long())
    if cfg.renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return SimpleNamespace(topk_ids=topk_ids, topk_weights=w * cfg.routed_scaling)


def run_layer(state: dict, *, bank=None, live=None, start: bool = False,
              ffn_bank=None, topk_ids: torch.Tensor | None = None,
              moe_view=None) -> torch.Tensor:
    """Run one decode layer on ``state`` (from make_layer); returns the new live sum [M, H].

    bank, live, start, ffn_bank: as ``k3lab.stack.run_layer`` (default: the state's own
    candidates, the layer inside a block). topk_ids: the experts the MoE must use (another
    run's choice, so that a near-tie of the router does not make two runs incomparable); None:
    the reference's own routing. moe_view: a function of the MoE's weight dict giving the
    weights the truth uses (e.g. the latent up-projection as a stack's FP8 rows dequantized);
    None: the layer's own."""
    cfg = state["cfg"]
    bank = state["bank"] if bank is None else bank
    live = state["live"] if live is None else live
    _, x = _read(state, bank, live, "attn")
    if state["kind"] == "kda":
        a = kda_layer_reference(x, state["attn"], state["cache"], cfg)
    else:
        a = mla_layer_reference(x, state["attn"], state["cache"], cfg, state["position"])
    if start:
        bank = torch.cat([bank, live.unsqueeze(0)]) if ffn_bank is None else ffn_bank
        live = a.to(torch.bfloat16)
    else:
        live = _add(live, a)
    _, x = _read(state, bank, live, "ffn")
    if "mlp" in state:
        act = dict(activation=cfg.activation, situ_beta=cfg.situ_beta,
                   situ_linear_beta=cfg.situ_linear_beta)
        a = dense_reference(x, state["mlp"]["gate_up"], **act).to(torch.bfloat16)
        return _add(live, dense_reference(a, state["mlp"]["down"]))
    moe = state["moe"] if moe_view is None else moe_view(state["moe"])
    if topk_ids is not None:
        plan = forced_route(x, moe, cfg, topk_ids)
        return _add(live, latent_moe_from_plan_reference(x, plan, moe, cfg))
    return _add(live, latent_moe_reference(x, moe, cfg))


# ---------------------------------------------------------------------------------------------
# the whole token


def token_schedule(cfg: Preset) -> dict[int, tuple[int, bool]]:
    """{layer: (sealed rows its reads see, whether it opens a block)}: the embedding is sealed
    row 0; a block sum is sealed at the start of every layer l > 0 with l % attn_res_block == 0
    (the workbench's reading of what a block's first read sees, as ``token_schedule`` of
    ``k3lab.reference.attn_res``)."""
    if not cfg.attn_res_block:
        raise ValueError(f"preset: {cfg.name!r} has no AttnRes blocks; the token model needs them")
    b = cfg.attn_res_block
    return {layer: (1 + layer // b, layer % b == 0) for layer in range(cfg.n_layers)}


def window_layers(cfg: Preset, window: int, first_layer: int = 1) -> list[int]:
    """Layer 0 and the ``window`` layers from ``first_layer`` on (at most to the last layer);
    first_layer 0: the window centred in the model, so its AttnRes reads see about the sealed
    rows a read of the whole token sees on average."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window: expected a positive number of layers, got {window!r}")
    last = cfg.n_layers - 1
    if isinstance(first_layer, bool) or not isinstance(first_layer, int) or \
            not 0 <= first_layer <= last:
        raise ValueError(f"first_layer: expected 0 (centred) or a layer in 1..{last}, got "
                         f"{first_layer!r}")
    window = min(window, last)
    first = first_layer or max(1, (cfg.n_layers - window) // 2)
    return [0, *range(first, min(first + window, last + 1))]


def make_token(cfg: Preset, device, *, window: int, seed: int = 0, m: int = 1,
               context: int = 256, expert_format: str = "bf16", first_layer: int = 1) -> dict:
    """A decode token over layer 0 and ``window`` layers from ``first_layer`` on
    (``window_layers``), distinct weights per layer.

    embed, lm_head [vocab / tp, H] bf16 (the rank's vocabulary shard); ids [M] int64 (rows of
    the shard); rows [candidates, M, H] bf16, the AttnRes rows buffer (sealed rows, row 0 the
    embedding; the block sums of layers before the window, which the token does not run, are
    random rows); layers (make_layer states, layer 0 with the dense MLP); final (the last
    read's weights); schedule (``token_schedule``); context: MLA cache length.
    """
    schedule = token_schedule(cfg)
    layer_ids = window_layers(cfg, window, first_layer)
    gen = make_generator(seed + 7919, device)
    shard, h = cfg.vocab // cfg.tp, cfg.hidden
    mla = set(cfg.mla_layers)
    layers = [make_layer(cfg, "mla" if layer in mla else "kda", device, seed=seed + layer, m=m,
                         context=context, expert_format=expert_format, n_sealed=0,
                         ffn="mlp" if layer < cfg.first_dense else "moe")
              for layer in layer_ids]
    token = {
        "cfg": cfg, "layer_ids": layer_ids, "layers": layers, "schedule": schedule,
        "embed": randn((shard, h), gen), "lm_head": randn((shard, h), gen, std=h ** -0.5),
        "ids": torch.randint(0, shard, (m,), generator=gen, device=gen.device),
        "rows": torch.zeros((cfg.max_attn_res_candidates, m, h), dtype=torch.bfloat16,
                            device=device),
        "final": attn_res_weights(cfg, gen), "context": context,
        "expert_format": expert_format, "m": m, "window": len(layer_ids) - 1,
    }
    skipped = (layer_ids[1] - 1) // cfg.attn_res_block if len(layer_ids) > 1 else 0
    if skipped:  # sealed at layers b, 2b, ... before the window (drawn last: the rest of the
        # token is the same wherever its window starts)
        token["rows"][1:1 + skipped] = randn((skipped, m, h), gen)
    return token


def run_token(token: dict, topk_ids: list | None = None, moe_view=None) -> torch.Tensor:
    """The fp32 truth of ``k3lab.stack.run_token``: logits [M, vocab / tp] fp32.

    topk_ids: per layer of the token, the experts its MoE must use (None entries, or None:
    the reference's own routing). moe_view: as for :func:`run_layer`."""
    cfg, rows = token["cfg"], token["rows"]
    forced = topk_ids or [None] * len(token["layers"])
    rows[0] = token["embed"].index_select(0, token["ids"])
    live = rows[0]
    for layer, state, ids in zip(token["layer_ids"], token["layers"], forced, strict=True):
        n_sealed, start = token["schedule"][layer]
        if start and layer:
            rows[n_sealed - 1] = live
        bank, cand = (rows[:n_sealed - 1], rows[n_sealed - 1]) if start else (
            rows[:n_sealed], live)
        live = run_layer(state, bank=bank, live=cand, start=start, ffn_bank=rows[:n_sealed],
                         topk_ids=ids, moe_view=moe_view)
    last = token["schedule"][token["layer_ids"][-1]][0]
    w = token["final"]
    _, h = attn_res_norm_reference(rows[:last], live, w["res_norm_weight"],
                                   w["res_proj_weight"], w["norm_weight"], eps=cfg.rms_eps)
    return h.float() @ token["lm_head"].float().T
