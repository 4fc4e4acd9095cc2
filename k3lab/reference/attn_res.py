"""AttnRes (attention residuals) read + RMSNorm, and the per-token schedule of its reads.

docs/model.md. The residual stream is a bank of block sums: the sealed rows (the token
embedding first, then one sum per ``cfg.attn_res_block`` layers) and the live partial sum of the
current block. Before attention and before the FFN of every layer the layer input is a softmax
mixture of these candidates, followed by the layer's RMSNorm:

    V        = stack(bank..., live)                                  # fp32 [N + 1, M, H]
    K        = V * rsqrt(mean_h(V^2) + eps) * res_norm_weight        # RMSNorm of every candidate
    score    = sum_h K * res_proj_weight                             # [N + 1, M]
    p        = softmax over the candidates
    h        = bf16(sum_j p_j V_j)                                   # raw V, not normalized
    h_normed = bf16(RMSNorm(h) * norm_weight)                        # input of attention / FFN

:func:`attn_res_norm_reference` is written op by op as the model's code is, so its launch count
is the honest unfused "before". :func:`token_schedule` and :func:`replay_token` replay one token
through every layer of a preset (two reads a layer, synthetic sublayer outputs, sealing every
``attn_res_block`` layers) with any read function, reference or fused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from k3lab.config import Preset
from k3lab.weights import attn_res_weights, make_generator, randn

__all__ = ["attn_res_norm_reference", "Read", "token_schedule", "replay_weights",
           "TokenReplay", "replay_token", "SITES"]

SITES = ("attn", "ffn")  # the two reads of a layer: before attention, before the FFN


def attn_res_norm_reference(bank: torch.Tensor, live: torch.Tensor,
                            res_norm_weight: torch.Tensor, res_proj_weight: torch.Tensor,
                            norm_weight: torch.Tensor, *, eps: float = 1e-5
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfused AttnRes read + RMSNorm, computed in fp32.

    bank [N, M, H] (N >= 0 sealed rows), live [M, H], weights [H] (any float dtype).
    Returns ``(h, h_normed)``, both [M, H] in ``live.dtype``. The final RMSNorm multiplies by the
    weight in fp32 and rounds once (as fused RMSNorm kernels of serving engines do).
    """
    V = torch.stack([*bank, live]).float()                              # [N + 1, M, H]
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps) * res_norm_weight.float()
    score = (K * res_proj_weight.float()).sum(-1)                       # [N + 1, M]
    p = score.softmax(dim=0)
    h = (p.unsqueeze(-1) * V).sum(0).to(live.dtype)                     # [M, H]
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    h_normed = (hf * norm_weight.float()).to(live.dtype)
    return h, h_normed


class Read(NamedTuple):
    """One AttnRes read of a token's decode step.

    n_candidates: rows mixed (sealed rows, plus the live sum when the block has one yet);
    the fused launcher sees ``bank`` = the first ``n_candidates - 1`` rows and the last as live.
    """

    layer: int
    site: str  # "attn" or "ffn"
    n_candidates: int
    n_sealed: int


def token_schedule(cfg: Preset) -> list[Read]:
    """The ``2 * cfg.n_layers`` reads of one token, in order.

    Before layer 0 the bank holds the embedding alone (sealed row 0) and there is no live sum.
    Every sublayer output starts (first sublayer of a block) or extends the live sum. At the
    start of every layer ``l > 0`` with ``l % attn_res_block == 0`` the live sum (the outputs of
    the block's ``attn_res_block`` layers) is sealed, so that layer's first read mixes sealed rows
    only. Where docs/model.md is silent (what a block's first read sees) this is the
    workbench's assumption. K3: 93 layers, block 12 -> at most 8 sealed rows + live = 9 candidates.
    """
    if not cfg.attn_res_block:
        raise ValueError(f"cfg: preset {cfg.name!r} has no AttnRes (attn_res_block=0)")
    reads = []
    n_sealed, has_live = 1, False
    for layer in range(cfg.n_layers):
        if layer and layer % cfg.attn_res_block == 0:
            n_sealed, has_live = n_sealed + 1, False
        for site in SITES:
            reads.append(Read(layer, site, n_sealed + int(has_live), n_sealed))
            has_live = True
    return reads


def replay_weights(cfg: Preset, gen: torch.Generator, dtype=torch.bfloat16) -> list[dict]:
    """One AttnRes weight set per read (two per layer), in schedule order."""
    return [attn_res_weights(cfg, gen, dtype=dtype) for _ in range(2 * cfg.n_layers)]


@dataclass
class TokenReplay:
    """Result of :func:`replay_token`.

    reads: the schedule; h, h_normed: each read's outputs ([M, H] bf16), in schedule order.
    rows: [max_attn_res_candidates, M, H] bf16 residual buffer at the end; rows [0, n_sealed)
        are sealed, row n_sealed is the live sum.
    """

    reads: list[Read]
    h: list[torch.Tensor]
    h_normed: list[torch.Tensor]
    rows: torch.Tensor
    n_sealed: int

    @property
    def live(self) -> torch.Tensor:
        return self.rows[self.n_sealed]


ReadFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def replay_token(cfg: Preset, read_fn: ReadFn, *, m: int = 1, seed: int = 0,
                 device: torch.device | str = "cpu", out_gain: float = 0.5,
                 weights: list[dict] | None = None) -> TokenReplay:
    """Replay ``m`` tokens through every layer of ``cfg``, running each AttnRes read with
    ``read_fn(bank, live, res_norm_weight, res_proj_weight, norm_weight, eps=)``.

    The residual rows live in one buffer [max_candidates, m, H]: sealing is a counter increment,
    and every read passes contiguous views (``bank = rows[:n - 1]``, ``live = rows[n - 1]``).
    A sublayer's synthetic output is ``out_gain * h_normed + noise`` (noise unit-RMS, drawn from
    ``seed``), so each read depends on the ones before it, as in the model. Same seed -> same
    weights, embedding and noise for every ``read_fn``.
    """
    if m < 1:
        raise ValueError(f"m: expected at least one token, got {m}")
    reads = token_schedule(cfg)
    gen = make_generator(seed, device)
    if weights is None:
        weights = replay_weights(cfg, gen)
    if len(weights) != len(reads):
        raise ValueError(f"weights: expected {len(reads)} weight sets, got {len(weights)}")
    rows = torch.zeros((cfg.max_attn_res_candidates, m, cfg.hidden), dtype=torch.bfloat16,
                       device=device)
    rows[0] = randn((m, cfg.hidden), gen)                        # token embedding, sealed row 0
    n_sealed, hs, hns = 1, [], []
    for read, w in zip(reads, weights, strict=True):
        n_sealed = read.n_sealed
        n = read.n_candidates
        h, h_normed = read_fn(rows[:n - 1], rows[n - 1], w["res_norm_weight"],
                              w["res_proj_weight"], w["norm_weight"], eps=cfg.rms_eps)
        hs.append(h)
        hns.append(h_normed)
        out = (out_gain * h_normed.float() + randn((m, cfg.hidden), gen, dtype=torch.float32))
        out = out.to(torch.bfloat16)                             # the sublayer's bf16 output
        if n == n_sealed:                                        # first sublayer of a block
            rows[n_sealed] = out
        else:
            rows[n_sealed] = rows[n_sealed] + out
    return TokenReplay(reads, hs, hns, rows, n_sealed)
