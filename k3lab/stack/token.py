"""The whole decode token under a stack: embedding, the layers with their block sums and
AttnRes reads (mixed by their consumers where the configs say), the final read, the LM head."""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3lab.reference import attn_res as ref_attn_res

from .base import _kernels, _linear, _noop, _Run
from .changes import Stack
from .configs import Configs
from .layer import leaves_read_sums, run_layer, takes_read_input


def sums_buffers(token: dict, m: int, device, key: str = "read_sums") -> list[torch.Tensor]:
    """One zeroed sums buffer per layer of ``token``, kept in it under ``key`` (so a CUDA graph
    captured after a first call reuses them): "read_sums" for the FFN reads
    (``Configs.read_sums`` / ``ffn_read_in_front``: layer i's FFN read clears layer i + 1's,
    the last one layer 0's), "attn_sums" for the attention reads (``attn_read_in_proj``: each
    mixed read's projection zeroes the next mixed read's, the last the first's), so every
    replay finds them zero."""
    from k3lab.kernels.attn_res_sums import SLOT_COLS, sums_numel
    cfg = token["cfg"]
    most = max(n for n, _ in token["schedule"].values())
    need = sums_numel(m, cfg.hidden, most, SLOT_COLS)
    bufs = token.get(key)
    if bufs is None or bufs[0].numel() < need or bufs[0].device != torch.device(device):
        bufs = [torch.zeros(need, dtype=torch.float32, device=device)
                for _ in token["layer_ids"]]
        token[key] = bufs
    return bufs


def _mixed_reads(stack: Stack, token: dict) -> list[int]:
    """Window positions of ``token`` whose attention read is the input projection's prologue
    under ``Configs.attn_read_in_proj``: past a block's first layer, after a layer that
    :func:`leaves_read_sums`, where the layer :func:`takes_read_input`."""
    layers, ids = token["layers"], token["layer_ids"]
    return [i for i in range(1, len(ids)) if not token["schedule"][ids[i]][1]
            and leaves_read_sums(stack, layers[i - 1]) and takes_read_input(stack, layers[i])]


def run_token(stack: Stack, token: dict, *, num_splits: int = 4, configs: Configs | None = None,
              tag: Callable[[str], None] | None = None, record: list | None = None
              ) -> torch.Tensor:
    """One decode token of ``token`` (``k3lab.reference.layer.make_token``) under ``stack``:
    embedding row, layer 0 (KDA + dense MLP), the window's layers with their AttnRes reads and
    a block sum sealed every ``attn_res_block`` layers, the final read + RMSNorm and the LM head
    at the tp shard. Returns the logits [M, vocab / tp] bf16. ``tag`` as in run_layer, plus
    "segment embed", "segment layer <i>" and "segment head" where those parts start; record
    as in run_layer, one entry per layer."""
    tag = tag or _noop
    configs = configs or Configs()
    cfg, rows = token["cfg"], token["rows"]
    tag("segment embed")
    tag("dense projections")
    torch.index_select(token["embed"], 0, token["ids"], out=rows[0])
    live = rows[0]
    bufs = (sums_buffers(token, live.shape[0], live.device)
            if configs.read_sums or configs.ffn_read_in_front else None)
    mixed = _mixed_reads(stack, token) if configs.attn_read_in_proj else []
    mix_bufs = sums_buffers(token, live.shape[0], live.device, "attn_sums") if mixed else None
    if mixed:
        from k3lab.kernels.attn_res_sums import read_input, read_sums
    prev = None  # the ReadSums the previous layer left for this layer's attention read
    for i, (layer, state) in enumerate(zip(token["layer_ids"], token["layers"], strict=True)):
        n_sealed, start = token["schedule"][layer]
        if start and layer:  # seal the block sum of the layers before
            tag("AttnRes")
            rows[n_sealed - 1].copy_(live)
        tag(f"segment layer {layer}")
        bank, cand = (rows[:n_sealed - 1], rows[n_sealed - 1]) if start else (
            rows[:n_sealed], live)
        pair = None
        if bufs is not None:  # a single layer's buffer is zeroed by a launch of its own
            pair = (bufs[i], bufs[(i + 1) % len(bufs)]) if len(bufs) > 1 else (
                bufs[0].zero_(), None)
        attn_read = next_sums = None
        if i in mixed:  # the previous layer left this read's sums; the next one's zeroed here
            j = mixed.index(i)
            nxt = mix_bufs[mixed[(j + 1) % len(mixed)]] if len(mixed) > 1 else None
            attn_read = read_input(prev, state["res_attn"]["norm_weight"], eps=cfg.rms_eps,
                                   clear=nxt)
        if i + 1 in mixed:
            n_next = token["schedule"][token["layer_ids"][i + 1]][0]
            w_next = token["layers"][i + 1]["res_attn"]
            if len(mixed) == 1:  # no other read zeroes it: a launch of its own
                mix_bufs[i + 1].zero_()
            next_sums = read_sums(rows[:n_next], w_next["res_norm_weight"],
                                  w_next["res_proj_weight"], buffer=mix_bufs[i + 1])
        live = run_layer(stack, state, num_splits=num_splits, bank=bank, live=cand,
                         start=start, ffn_bank=rows[:n_sealed], configs=configs,
                         tag=tag, record=record, sums_buffers=pair, attn_read=attn_read,
                         next_sums=next_sums)
        prev = next_sums
    tag("segment head")
    tag("AttnRes")
    last = token["schedule"][token["layer_ids"][-1]][0]
    w = token["final"]
    args = (rows[:last], live, w["res_norm_weight"], w["res_proj_weight"], w["norm_weight"])
    if stack.fused("token.final_read"):
        h = _kernels().attn_res_norm(*args, eps=cfg.rms_eps, return_h=False,
                                     config=configs.attn_res)[1]
    else:
        h = ref_attn_res.attn_res_norm_reference(*args, eps=cfg.rms_eps)[1]
    tag("dense projections")
    return _linear(_Run(stack, num_splits, configs, tag), "token.lm_head", h, token["lm_head"])
