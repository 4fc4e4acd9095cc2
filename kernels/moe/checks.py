"""Input validation of the MoE launchers: every bad input is a ValueError naming the parameter."""

from __future__ import annotations

import torch

from ..mxfp4 import MXFP4, MXFP4_GROUP, mxfp4_tiled_ok
from ..plan import RoutePlan, plan_capacity
from ..runtime import check_number, check_tensor, check_validate
from .config import MoEConfig

__all__ = ["MAX_TOKENS", "ACT_CODES", "check_config", "check_tensor", "check_tokens",
           "check_experts", "check_plan", "check_plan_values", "check_betas",
           "check_deterministic", "check_prepared", "check_activation", "check_shared_weights",
           "pairs"]

# Decode-batch kernels: a GEMV tile serves its M tokens one after the other from registers, so
# the work per weight byte grows with M; beyond a few tokens a tensor-core grouped GEMM wins.
MAX_TOKENS = 16
ACT_CODES = {"situ": 0, "silu": 1}
_DEFAULT = MoEConfig()


def check_config(config) -> MoEConfig:
    """The launch's MoEConfig (None: the defaults)."""
    if config is None:
        return _DEFAULT
    if not isinstance(config, MoEConfig):
        raise ValueError(f"config: expected a MoEConfig or None, got {type(config).__name__}")
    return config


def check_deterministic(deterministic, config: MoEConfig) -> bool:
    """A launcher's ``deterministic``: a bool, or None for ``config.deterministic_stage2``."""
    if deterministic is None:
        return config.deterministic_stage2
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic: expected a bool or None, got {deterministic!r}")
    return deterministic


def check_tokens(name, m):
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"{name}: expected 1 <= M <= {MAX_TOKENS} tokens, got M={m}")


def check_activation(activation) -> int:
    if activation not in ACT_CODES:
        raise ValueError(f"activation: expected one of {sorted(ACT_CODES)}, got {activation!r}")
    return ACT_CODES[activation]


def check_betas(situ_beta, situ_linear_beta) -> tuple[float, float]:
    """SiTU's two betas: finite and positive (each divides a tanh argument)."""
    return (check_number("situ_beta", situ_beta, positive=True),
            check_number("situ_linear_beta", situ_linear_beta, positive=True))


def pairs(name, t):
    """bf16 [.., K] (K even) viewed as int32 [.., K/2]."""
    if t.shape[-1] % 2:
        raise ValueError(f"{name}: expected an even last dimension, got {tuple(t.shape)}")
    return t.view(torch.int32)


def check_experts(name, w, device):
    """(E, N, K, is_fp4) of an expert weight [E, N, K]: bf16 tensor or MXFP4."""
    if isinstance(w, MXFP4):
        check_tensor(f"{name}.packed", w.packed, dtypes=(torch.uint8,), dim=3, device=device)
        check_tensor(f"{name}.scales", w.scales, dtypes=(torch.uint8,), dim=3, device=device)
        e, n, k = w.shape
        if k % MXFP4_GROUP or tuple(w.scales.shape) != (e, n, k // MXFP4_GROUP):
            raise ValueError(f"{name}: MXFP4 scales must be [E, N, K/32] = {[e, n, k // 32]} with "
                             f"K a multiple of 32, got packed {tuple(w.packed.shape)}, scales "
                             f"{tuple(w.scales.shape)}")
        if w.layout == "tiled" and not mxfp4_tiled_ok(w.shape):
            raise ValueError(f"{name}: the tiled MXFP4 layout needs N a multiple of 16 and K of "
                             f"256, got [E, N, K] = {[e, n, k]}")
        return e, n, k, True
    check_tensor(name, w, dtypes=(torch.bfloat16,), dim=3, device=device)
    e, n, k = w.shape
    if k % 2:
        raise ValueError(f"{name}: expected an even input dimension K, got {k}")
    return e, n, k, False


def check_plan(plan, m, n_experts, device, out_dim=None, validate="cheap"):
    """Validate a RoutePlan for M tokens over n_experts; returns (top_k, block_m, n_tiles).

    Always (no host sync): types, dtypes, shapes, devices, and sizes consistent with M, top_k,
    block_m and at most n_experts. With ``validate="full"`` also the values of its tensors
    (:func:`check_plan_values`: about twenty small device ops and one device-to-host copy, so
    a host sync per call; not allowed in a CUDA-graph capture)."""
    check_validate(validate)
    if not isinstance(plan, RoutePlan):
        raise ValueError(f"plan: expected a k3lab.kernels.RoutePlan, got {type(plan).__name__}")
    check_tensor("plan.topk_ids", plan.topk_ids, dtypes=(torch.int32,), dim=2, device=device)
    check_tensor("plan.topk_weights", plan.topk_weights, dtypes=(torch.float32,), dim=2,
                 device=device)
    if plan.topk_ids.shape[0] != m or plan.topk_weights.shape != plan.topk_ids.shape:
        raise ValueError(f"plan: topk_ids {tuple(plan.topk_ids.shape)} and topk_weights "
                         f"{tuple(plan.topk_weights.shape)} must both be [M={m}, top_k]")
    top_k, block_m = plan.topk_ids.shape[1], plan.block_m
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"plan: top_k={top_k} must be in [1, E={n_experts}]")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"plan.block_m: expected a positive int, got {block_m!r}")
    for name in ("sorted_ids", "block_expert_ids", "num_valid"):
        check_tensor(f"plan.{name}", getattr(plan, name), dtypes=(torch.int32,), dim=1,
                     device=device)
    check_tensor("plan.sorted_weights", plan.sorted_weights, dtypes=(torch.float32,), dim=1,
                 device=device)
    cap = plan.sorted_ids.numel()
    if (cap < m * top_k or plan.sorted_weights.numel() != cap
            or plan.block_expert_ids.numel() != cap // block_m or plan.num_valid.numel() != 1):
        raise ValueError(
            f"plan: inconsistent sort metadata for M={m}, top_k={top_k}, block_m={block_m}: "
            f"sorted_ids {cap}, sorted_weights {plan.sorted_weights.numel()}, block_expert_ids "
            f"{plan.block_expert_ids.numel()} (expected sorted_ids >= M*top_k, sorted_weights "
            f"alike, block_expert_ids = sorted_ids // block_m)")
    if cap > plan_capacity(m, top_k, n_experts, block_m):
        raise ValueError(f"plan: sorted_ids has {cap} entries, more than a plan of M={m}, "
                         f"top_k={top_k}, block_m={block_m} over E={n_experts} experts can hold "
                         f"({plan_capacity(m, top_k, n_experts, block_m)}): built for more "
                         f"experts than the weights have?")
    if plan.out is not None and out_dim is not None:
        check_tensor("plan.out", plan.out, dtypes=(torch.float32,), dim=2, device=device)
        if tuple(plan.out.shape) != (m, out_dim):
            raise ValueError(f"plan.out: expected [M, D] = [{m}, {out_dim}], got "
                             f"{tuple(plan.out.shape)}")
    if validate == "full":
        check_plan_values(plan, n_experts)
    # every valid tile holds at least one of the M * top_k entries: no more tiles than that
    return top_k, block_m, min(cap // block_m, m * top_k)


def check_plan_values(plan: RoutePlan, n_experts: int) -> None:
    """The plan's values (one host sync): expert ids in [0, E) and distinct per token; sorted
    entries in [0, M * top_k] (the sentinel last); tile experts in [-1, E); num_valid a
    multiple of block_m within the capacity; every valid tile's expert >= 0 and that of each of
    its entries; every entry exactly once among the valid positions; finite weights."""
    ids, srt, blocks = plan.topk_ids.long(), plan.sorted_ids.long(), plan.block_expert_ids.long()
    n, bm, cap = ids.numel(), plan.block_m, srt.numel()
    n_valid = plan.num_valid.long()[0]
    pos = torch.arange(cap, device=srt.device)
    tile = (pos // bm).clamp(max=max(blocks.numel() - 1, 0))
    valid = pos < n_valid
    real = valid & (srt >= 0) & (srt < n)
    entry_expert = ids.flatten()[srt.clamp(0, n - 1)]
    tile_expert = blocks[tile] if blocks.numel() else torch.zeros_like(srt)
    seen = torch.zeros(n + 1, dtype=torch.long, device=srt.device).index_add_(
        0, torch.where(real, srt, n), torch.ones_like(srt))
    row = ids.sort(dim=1).values
    stats = torch.stack([
        ids.min(), ids.max(), (row[:, 1:] == row[:, :-1]).sum(), srt.min(), srt.max(),
        blocks.min() if blocks.numel() else n_valid * 0, blocks.max() if blocks.numel()
        else n_valid * 0, n_valid, (valid & (tile_expert < 0)).sum(),
        (real & (entry_expert != tile_expert)).sum(), (seen[:n] != 1).sum(),
        (~torch.isfinite(plan.topk_weights)).sum() + (~torch.isfinite(plan.sorted_weights)).sum(),
    ]).tolist()
    lo, hi, dup, s_lo, s_hi, b_lo, b_hi, nv, neg_tiles, mismatched, not_once, nonfinite = stats
    if lo < 0 or hi >= n_experts:
        raise ValueError(f"plan.topk_ids: expected expert ids in [0, E={n_experts}), got min "
                         f"{lo}, max {hi}")
    if dup:
        raise ValueError(f"plan.topk_ids: a token's experts must be distinct ({dup} repeats)")
    if s_lo < 0 or s_hi > n:
        raise ValueError(f"plan.sorted_ids: expected entries in [0, M * top_k = {n}] (the "
                         f"sentinel), got min {s_lo}, max {s_hi}")
    if b_lo < -1 or b_hi >= n_experts:
        raise ValueError(f"plan.block_expert_ids: expected experts in [-1, E={n_experts}), got "
                         f"min {b_lo}, max {b_hi}")
    if not 0 <= nv <= cap or nv % bm:
        raise ValueError(f"plan.num_valid: expected a multiple of block_m={bm} in [0, {cap}], "
                         f"got {nv}")
    if neg_tiles or mismatched:
        raise ValueError(f"plan.block_expert_ids: {neg_tiles + mismatched} valid positions "
                         f"whose tile has no expert or another expert than topk_ids gives")
    if not_once:
        raise ValueError(f"plan.sorted_ids: {not_once} of the {n} entries are not exactly once "
                         f"among the first num_valid={nv} positions")
    if nonfinite:
        raise ValueError(f"plan.topk_weights: {nonfinite} non-finite router weights (in "
                         f"topk_weights or sorted_weights)")


def check_prepared(name, t, shape, device):
    """A prepared activation copy (mma_prepare_x's layout) or an output buffer for one: bf16,
    contiguous, of ``shape``, on ``device``; None passes."""
    if t is None:
        return None
    check_tensor(name, t, dtypes=(torch.bfloat16,), dim=len(shape), device=device)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected a contiguous bf16 {list(shape)} (the layout of "
                         f"mma_prepare_x), got {list(t.shape)}")
    return t


def check_shared_weights(shared: dict, m: int, h: int, device):
    for key in ("x", "w13", "w2"):
        if key not in shared:
            raise ValueError(f"shared: a weights dict needs keys 'x', 'w13', 'w2'; missing {key!r}")
    check_tensor("shared['x']", shared["x"], dtypes=(torch.bfloat16,), dim=2, device=device)
    check_tensor("shared['w2']", shared["w2"], dtypes=(torch.bfloat16,), dim=2, device=device)
    if tuple(shared["x"].shape) != (m, h) or shared["w2"].shape[0] != h:
        raise ValueError(f"shared: expected x [M={m}, H={h}] and w2 [H={h}, S], got x "
                         f"{tuple(shared['x'].shape)}, w2 {tuple(shared['w2'].shape)}")
