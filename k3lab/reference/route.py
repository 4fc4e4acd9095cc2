"""Routing ("route boundary", ``noaux_tc``) and the MoE sort metadata, op by op.

docs/model.md::

    logits = fp32(x) @ fp32(W_gate)^T          # [M, E] FP32 logits
    s      = sigmoid(logits)
    sb     = s + e_score_correction_bias       # biased scores choose the experts only
    (n_group > 1: group score = sum of the top-2 biased scores of a group; keep topk_group
     groups; the other groups' experts cannot be chosen)
    ids    = topk(sb, top_k)                   # descending, ties to the lower expert index
    w      = s[ids]                            # unbiased scores
    w      = w / (sum(w) + 1e-20)              # when renormalize
    w      = w * routed_scaling_factor

then the sort metadata the expert GEMMs consume (``k3lab.kernels.plan.RoutePlan``). Everything
here is device ops only (no ``bincount``, no ``.item()``), so the reference can be graph-captured
and ``torch.compile``-d: its launch count is the honest "before".

:func:`route_sort_by_sorting` is an independent formulation (per-token Python sorts and loops)
used by the tests to validate :func:`route_sort_reference`; it is slow and host-bound on purpose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3lab.kernels.plan import RoutePlan, plan_capacity

__all__ = ["route_sort_reference", "route_from_logits_reference", "sort_metadata_reference",
           "route_sort_by_sorting", "RENORM_EPS"]

RENORM_EPS = 1e-20  # added to the weight sum before renormalizing (model code)


def _select_experts(biased: torch.Tensor, top_k: int, n_group: int,
                    topk_group: int) -> torch.Tensor:
    """int64 [M, top_k]: grouped top-k of the biased scores, ties to the lower index."""
    m, e = biased.shape
    if n_group > 1:
        grouped = biased.view(m, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)            # [M, n_group]
        # stable descending sort: equal group scores keep the lower group first
        group_idx = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, group_idx[:, :topk_group], True)
        expert_mask = group_mask.unsqueeze(-1).expand(m, n_group, e // n_group).reshape(m, e)
        biased = biased.masked_fill(~expert_mask, float("-inf"))
    # torch.topk does not promise an order among equal values; a stable descending sort does.
    return torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]


def route_sort_reference(hidden: torch.Tensor, gate_weight: torch.Tensor,
                         correction_bias: torch.Tensor, *, top_k: int, n_group: int = 1,
                         topk_group: int = 1, renormalize: bool = True,
                         routed_scaling_factor: float = 1.0, block_m: int = 1,
                         out_dim: int | None = None) -> RoutePlan:
    """Unfused routing of ``hidden`` [M, H] (any float dtype) with ``gate_weight`` [E, H] and
    ``correction_bias`` [E]; returns the :class:`RoutePlan` (see its docstring for the fields).
    """
    # --- gate projection (moe.gate_proj) ---
    logits = F.linear(hidden.float(), gate_weight.float())                    # [M, E] fp32
    return route_from_logits_reference(
        logits, correction_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
        renormalize=renormalize, routed_scaling_factor=routed_scaling_factor, block_m=block_m,
        out_dim=out_dim)


def route_from_logits_reference(logits: torch.Tensor, correction_bias: torch.Tensor, *,
                                top_k: int, n_group: int = 1, topk_group: int = 1,
                                renormalize: bool = True, routed_scaling_factor: float = 1.0,
                                block_m: int = 1, out_dim: int | None = None) -> RoutePlan:
    """The routing after the gate projection: fp32 ``logits`` [M, E] -> :class:`RoutePlan`."""
    # --- selection (moe.route_select) ---
    scores = logits.sigmoid()
    biased = scores + correction_bias.float()
    ids = _select_experts(biased, top_k, n_group, topk_group)                 # [M, top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    weights = weights * routed_scaling_factor
    return sort_metadata_reference(ids, weights, logits.shape[1], block_m=block_m,
                                   out_dim=out_dim)


def sort_metadata_reference(ids: torch.Tensor, weights: torch.Tensor, n_experts: int, *,
                            block_m: int = 1, out_dim: int | None = None) -> RoutePlan:
    """The MoE sort metadata (moe.sort) of top-k ``ids`` [M, top_k] (int) and their
    ``weights`` [M, top_k] fp32 over ``n_experts`` experts, as a :class:`RoutePlan`."""
    m, top_k = ids.shape
    e, dev = n_experts, ids.device
    ids = ids.long()
    n = m * top_k
    cap = plan_capacity(m, top_k, e, block_m)
    flat = ids.reshape(-1)                                                    # [N] entry -> expert
    onehot = (flat[:, None] == torch.arange(e, device=dev)[None, :]).to(torch.int32)  # [N, E]
    counts = onehot.sum(dim=0)                                                # [E]
    rank = (onehot.cumsum(dim=0) - 1).gather(1, flat[:, None]).squeeze(1)     # rank in expert
    padded = (counts + block_m - 1) // block_m * block_m
    starts = padded.cumsum(dim=0) - padded                                    # exclusive
    pos = starts[flat] + rank                                                 # [N]
    sorted_ids = torch.full((cap,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pos, torch.arange(n, dtype=torch.int32, device=dev))
    sorted_weights = torch.zeros(cap, dtype=torch.float32, device=dev)
    sorted_weights.scatter_(0, pos, weights.reshape(-1).float())
    num_valid = padded.sum().reshape(1).to(torch.int32)
    tile_end = (padded // block_m).cumsum(dim=0)                              # [E]
    tile = torch.arange(cap // block_m, device=dev)
    tile_expert = (tile_end[None, :] <= tile[:, None]).sum(dim=1)             # expert of tile
    block_expert_ids = torch.where(tile < tile_end[-1], tile_expert, -1).to(torch.int32)
    out = None if out_dim is None else torch.zeros(m, out_dim, dtype=torch.float32, device=dev)

    return RoutePlan(topk_ids=ids.to(torch.int32), topk_weights=weights, sorted_ids=sorted_ids,
                     sorted_weights=sorted_weights, block_expert_ids=block_expert_ids,
                     num_valid=num_valid, out=out, block_m=block_m)


def route_sort_by_sorting(hidden: torch.Tensor, gate_weight: torch.Tensor,
                          correction_bias: torch.Tensor, *, top_k: int, n_group: int = 1,
                          topk_group: int = 1, renormalize: bool = True,
                          routed_scaling_factor: float = 1.0, block_m: int = 1,
                          out_dim: int | None = None) -> RoutePlan:
    """The same plan built differently, for tests only: the fp32 logits and scores as in the
    model, then per token a full Python sort on (-score, expert), and the metadata by walking
    the experts in order. Host-bound and slow; never used outside tests."""
    m, e = hidden.shape[0], gate_weight.shape[0]
    dev = hidden.device
    scores = torch.sigmoid(hidden.float() @ gate_weight.float().t()).cpu()
    biased = (scores + correction_bias.float().cpu()).tolist()
    scores = scores.tolist()
    gs = e // n_group

    ids, weights = [], []
    for t in range(m):
        b = biased[t]
        allowed = range(e)
        if n_group > 1:
            gscore = [sum(sorted(b[g * gs:(g + 1) * gs], reverse=True)[:2])
                      for g in range(n_group)]
            keep = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
            allowed = [i for i in range(e) if i // gs in keep]
        chosen = sorted(allowed, key=lambda i: (-b[i], i))[:top_k]
        w = [scores[t][i] for i in chosen]
        if renormalize:
            total = sum(w) + RENORM_EPS
            w = [x / total for x in w]
        ids.append(chosen)
        weights.append([x * routed_scaling_factor for x in w])

    n = m * top_k
    cap = plan_capacity(m, top_k, e, block_m)
    flat_ids = [i for row in ids for i in row]
    flat_w = [x for row in weights for x in row]
    sorted_ids, sorted_w, blocks = [], [], []
    for x in range(e):
        entries = [j for j in range(n) if flat_ids[j] == x]
        if not entries:
            continue
        pad = -len(entries) % block_m
        sorted_ids += entries + [n] * pad
        sorted_w += [flat_w[j] for j in entries] + [0.0] * pad
        blocks += [x] * ((len(entries) + pad) // block_m)
    num_valid = len(sorted_ids)
    sorted_ids += [n] * (cap - num_valid)
    sorted_w += [0.0] * (cap - num_valid)
    blocks += [-1] * (cap // block_m - len(blocks))

    def i32(v):
        return torch.tensor(v, dtype=torch.int32, device=dev)

    return RoutePlan(
        topk_ids=i32(ids).reshape(m, top_k),
        topk_weights=torch.tensor(weights, dtype=torch.float32, device=dev).reshape(m, top_k),
        sorted_ids=i32(sorted_ids), sorted_weights=torch.tensor(sorted_w, device=dev),
        block_expert_ids=i32(blocks), num_valid=i32([num_valid]),
        out=None if out_dim is None else torch.zeros(m, out_dim, device=dev), block_m=block_m)
