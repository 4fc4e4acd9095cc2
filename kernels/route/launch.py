"""Launchers of the route boundary: validation, the launch shape from a RouteConfig, the
completion counter."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..plan import RoutePlan, plan_capacity
from ..runtime import INTERPRETED, check_device, check_number, zeroed_words
from .config import MAX_TOKENS, RouteConfig
from .gemv import _gate_gemv_kernel
from .sort import _route_select_kernel, _route_sort_kernel

__all__ = ["route_sort", "gate_logits", "prepare_route", "launch_select", "RouteLaunch"]

GEMV_BLOCK_E = 32  # GPU split-K tile experts (config None)
GEMV_BLOCK_K = (1024, 512, 256, 128)  # GPU K tiles tried, widest first (config None)
# Interpreter (CPU): few, big programs; each program costs a fixed Python overhead.
INTERP_BLOCK_E = 128
INTERP_BLOCK_K = 2048
FILL_BLOCK = 1024  # elements per store in the padding / zero fill side job
# Tokens x padded experts held by the selection program at once: the selection shares the
# GEMV's kernel, so its registers set every program's (fewer resident GEMV programs per SM).
SELECT_TILE = 4096
# Padded experts per bucket, at least: one-expert buckets ([BLOCK_T, BUCKETS, 1] tiles) gave wrong
# plans on the H200 (E = 20, top-10, grouped; correct under the interpreter, cause not found), so
# such sizes take the arg-max loop.
MIN_BUCKET_SIZE = 2
REG_ENTRIES = 64  # (padded) entries sorted in registers when all tokens fit one block (B1)
PAIR_TILE = 8192  # entries x entries compared at once by the sort passes
PAIR_COLS = 1024  # widest column block of the sort passes

# One int32 "programs done" counter per device (see the package docstring), zero between calls.
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}: expected {rng}, got {value}")
    return value


def _config(config) -> RouteConfig:
    if config is None:
        return RouteConfig()
    if not isinstance(config, RouteConfig):
        raise ValueError(f"config: expected a RouteConfig or None, got {type(config).__name__}")
    return config


def _gemv_blocks(E: int, H: int, on_gpu: bool, cfg: RouteConfig) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_K) of the split-K tiles."""
    if not on_gpu:
        be = cfg.gemv_block_e or min(triton.next_power_of_2(E), INTERP_BLOCK_E)
        return be, cfg.gemv_block_k or min(triton.next_power_of_2(H), INTERP_BLOCK_K)
    be = cfg.gemv_block_e or GEMV_BLOCK_E
    if cfg.gemv_block_k:
        return be, cfg.gemv_block_k
    for bk in GEMV_BLOCK_K:
        if triton.cdiv(E, be) * triton.cdiv(H, bk) >= cfg.gemv_min_programs:
            return be, bk
    return be, GEMV_BLOCK_K[-1]


def _gemv_rows(E: int, H: int, on_gpu: bool,
               cfg: RouteConfig) -> tuple[int, int, int, int, int] | None:
    """Row programs: (rows a program, BLOCK_E, BLOCK_K, chunks a program, K splits); None when
    off (the split-K tiles of _gemv_blocks)."""
    if cfg.gemv_row_programs <= 0:
        return None
    rows = triton.cdiv(E, cfg.gemv_row_programs)
    block_k = min(cfg.gemv_row_chunk if on_gpu else INTERP_BLOCK_K, triton.next_power_of_2(H))
    splits = max(1, min(cfg.gemv_row_splits, triton.cdiv(H, block_k)))
    chunks = triton.cdiv(triton.cdiv(H, block_k), splits)
    return rows, triton.next_power_of_2(rows), block_k, chunks, triton.cdiv(H, chunks * block_k)


DOT_M = 16  # tokens of one tensor-core product in the GEMV (tl.dot's smallest N)
# Shared memory the unrolled K steps of a tile take on sm_90: Triton keeps each step's operands
# (BLOCK_E x DOT_K and DOT_K x DOT_M bf16) apart and double-buffered, about
# 4 * BLOCK_K * (BLOCK_E + DOT_M) bytes (32 x 1024 tiles: 192 KB at DOT_M 16, about 400 KB at
# 64, where an SM has 227 KB).
DOT_SMEM_BYTES = 200 * 1024
NO_DOT = dict(DOT_M=0, DOT_K=16, DOT_FP32=INTERPRETED)  # the GEMV on the CUDA cores


def _gemv_dot(M: int, block_e: int, block_k: int, dtypes: tuple, cfg: RouteConfig,
              on_gpu: bool) -> dict[str, int | bool]:
    """The split-K GEMV's tensor-core constexprs (DOT_M = 0: CUDA-core products): see
    ``RouteConfig.gemv_dot_min_tokens``; on the GPU off where the tile's operands would not
    fit in DOT_SMEM_BYTES of shared memory."""
    if not (0 < cfg.gemv_dot_min_tokens <= M and block_e >= 16 and block_k >= 16
            and all(d == torch.bfloat16 for d in dtypes)
            and (not on_gpu or 4 * block_k * (block_e + DOT_M) <= DOT_SMEM_BYTES)):
        return NO_DOT
    return dict(DOT_M=DOT_M, DOT_K=min(cfg.gemv_dot_k, block_k), DOT_FP32=INTERPRETED)


def _select_tiles(E: int, M: int, top_k: int, cfg: RouteConfig) -> dict[str, int | bool]:
    """The selection program's tile constexprs (see _select_sort / _top_k_threshold):
    BLOCK_T tokens x BLOCK_E (padded) experts at once, BLOCK_S (padded) slots, BUCKETS and
    CAP of the threshold selection (BUCKETS = 0: the arg-max loop), IN_REGS (all entries sorted
    in registers with the selection's own tiles), the memory sort passes' BLOCK_R x BLOCK_C,
    and SORT_N (the register sort's padded entries; 0: the memory passes)."""
    n = M * top_k
    block_ex = triton.next_power_of_2(E)
    block_t = min(triton.next_power_of_2(M), max(1, SELECT_TILE // block_ex))
    block_s = triton.next_power_of_2(top_k)
    buckets = cfg.buckets_per_slot * block_s
    use_threshold = (top_k >= cfg.threshold_min_top_k and buckets * MIN_BUCKET_SIZE <= block_ex
                     and block_ex >= cfg.threshold_min_experts)
    block_c = min(triton.next_power_of_2(n), PAIR_COLS)
    sort_n = triton.next_power_of_2(n)
    in_regs = block_t >= M and block_t * block_s <= REG_ENTRIES
    return dict(BLOCK_T=block_t, BLOCK_E=block_ex, BLOCK_S=block_s,
                BUCKETS=buckets if use_threshold else 0,
                CAP=min(cfg.candidates_per_slot * block_s, block_ex) if use_threshold else 1,
                IN_REGS=in_regs,
                BLOCK_R=max(1, min(triton.next_power_of_2(n), PAIR_TILE // block_c)),
                BLOCK_C=block_c,
                SORT_N=sort_n if (not in_regs and sort_n <= cfg.register_sort_max_entries
                                  and (E + 1) * sort_n < 2 ** 31) else 0)


def _bucket_of(E: int, M: int, top_k: int, config: RouteConfig | None = None
               ) -> torch.Tensor | None:
    """int64 [E]: the threshold selection's bucket of every expert (see _top_k_threshold), or
    None when the arg-max loop selects (tests use it to aim at the fast path or the fallback)."""
    buckets = _select_tiles(E, M, top_k, _config(config))["BUCKETS"]
    return torch.arange(E) % buckets if buckets else None


def _spread_selection(M: int, tiles: dict, cfg: RouteConfig) -> bool:
    """Whether the selection is its own launch of one program per token block (see
    ``RouteConfig.select_programs_min_tokens``)."""
    return 0 < cfg.select_programs_min_tokens <= M and tiles["BLOCK_T"] < M  # >= 2 programs


def _check_gate_inputs(hidden, gate_weight, correction_bias=None):
    """Validate the router's inputs; returns (M, H, E)."""
    named = [("hidden", hidden), ("gate_weight", gate_weight)]
    if correction_bias is not None:
        named.append(("correction_bias", correction_bias))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
    if hidden.dim() != 2 or hidden.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"hidden: expected [M, H] bf16 or fp32, got {tuple(hidden.shape)} "
                         f"{hidden.dtype}")
    M, H = hidden.shape
    if not 1 <= M <= MAX_TOKENS:
        raise ValueError(f"hidden: expected 1 <= M <= {MAX_TOKENS} tokens, got M={M}")
    if gate_weight.dim() != 2 or gate_weight.shape[1] != H or gate_weight.dtype not in (
            torch.bfloat16, torch.float32):
        raise ValueError(f"gate_weight: expected [E, {H}] bf16 or fp32, got "
                         f"{tuple(gate_weight.shape)} {gate_weight.dtype}")
    E = gate_weight.shape[0]
    if correction_bias is not None and (correction_bias.shape != (E,)
                                        or correction_bias.dtype != torch.float32):
        raise ValueError(f"correction_bias: expected [{E}] fp32, got "
                         f"{tuple(correction_bias.shape)} {correction_bias.dtype}")
    dev = hidden.device
    for name, t in named[1:]:
        if t.device != dev:
            raise ValueError(f"{name}: expected device {dev} (that of hidden), got {t.device}")
    check_device("hidden", hidden)
    return M, H, E


def gate_logits(hidden: torch.Tensor, gate_weight: torch.Tensor, *,
                config: RouteConfig | None = None) -> torch.Tensor:
    """The router's gate projection alone (the "B1 gate projection" change): FP32 logits
    fp32 [M, E] = fp32(hidden [M, H]) @ fp32(gate_weight [E, H])^T, by the route boundary's
    split-K GEMV (step 1 of :func:`route_sort`, without its plan side job or the selection; the
    config's split-K tile and warps) and a fixed-order sum of the K-split partials (one more
    launch when H spans several K tiles)."""
    M, H, E = _check_gate_inputs(hidden, gate_weight)
    cfg = _config(config)
    dev = hidden.device
    block_e, block_k = _gemv_blocks(E, H, dev.type == "cuda", cfg)
    split_k = triton.cdiv(H, block_k)
    partial = torch.empty(split_k, M, E, dtype=torch.float32, device=dev)
    _gate_gemv_kernel[(triton.cdiv(E, block_e), split_k)](
        hidden, gate_weight, partial, M, E, H, BLOCK_E=block_e, BLOCK_K=block_k,
        num_warps=cfg.num_warps)
    return partial[0] if split_k == 1 else partial.sum(0)


def _counter(dev: torch.device, capturing: bool | None = None) -> torch.Tensor:
    """The device's zeroed completion counter, created by the first call outside a capture
    (``capturing``: whether a capture is under way; None asks the current stream)."""
    return zeroed_words(_COUNTERS, dev, 1, capturing=capturing, error=(
        f"hidden: route_sort's completion counter on {dev} does not exist yet and cannot be "
        "created inside a CUDA-graph capture; call route_sort once on this device before "
        "capturing"))


def _check_routing(E: int, top_k, n_group, topk_group, block_m, out_dim,
                   routed_scaling_factor) -> None:
    _check_int("n_group", n_group, 1)
    if E % n_group:
        raise ValueError(f"n_group: {n_group} does not divide the expert count E={E}")
    if n_group > 1 and E // n_group < 2:
        raise ValueError(f"n_group: groups need >= 2 experts (top-2 group score), got "
                         f"E / n_group = {E // n_group}")
    _check_int("topk_group", topk_group, 1, n_group)
    kept = E if n_group == 1 else topk_group * (E // n_group)
    _check_int("top_k", top_k, 1, kept)
    _check_int("block_m", block_m, 1)
    if out_dim is not None:
        _check_int("out_dim", out_dim, 1)
    check_number("routed_scaling_factor", routed_scaling_factor, positive=True)


def route_sort(hidden: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor,
               *, top_k: int, n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
               routed_scaling_factor: float = 1.0, block_m: int = 1, out_dim: int | None = None,
               config: RouteConfig | None = None) -> RoutePlan:
    """Route M tokens and build the MoE sort metadata in one launch (no host sync; two where
    ``config.select_programs_min_tokens`` is at or below M and the tokens span more than one
    selection block).

    The launch's last program to finish its GEMV tile does the selection and the sort; it
    finds out through a per-device int32 counter that every call on the device shares (see the
    package docstring). So: calls on one device must not run concurrently on different streams,
    and the first call on a device creates the counter and must not be inside a CUDA-graph
    capture (a ValueError says so; warm up first, as any capture does).

    Args:
        hidden: [M, H] bf16 or fp32, contiguous, 1 <= M <= MAX_TOKENS.
        gate_weight: [E, H] bf16 or fp32, contiguous, same device.
        correction_bias: [E] fp32.
        top_k: experts per token, 1 <= top_k <= E (and within the kept groups).
        n_group, topk_group: grouped routing; n_group divides E with >= 2 experts per group,
            1 <= topk_group <= n_group.
        renormalize, routed_scaling_factor: weight normalization and scale.
        block_m: tile height the sorted runs are padded to (>= 1).
        out_dim: when given, ``out`` is a zeroed fp32 [M, out_dim].
        config: the launch's :class:`RouteConfig` (None: the defaults).

    Returns:
        RoutePlan with topk_ids int32 [M, top_k], topk_weights fp32 [M, top_k], sorted_ids int32
        [cap], sorted_weights fp32 [cap], block_expert_ids int32 [cap // block_m], num_valid
        int32 [1], out fp32 [M, out_dim] or None; cap = M * top_k + E * (block_m - 1).
    """
    launch, plan = prepare_route(
        hidden, gate_weight, correction_bias, top_k=top_k, n_group=n_group,
        topk_group=topk_group, renormalize=renormalize,
        routed_scaling_factor=routed_scaling_factor, block_m=block_m, out_dim=out_dim,
        config=config)
    _route_sort_kernel[launch.grid](*launch.args, **launch.constexprs,
                                    num_warps=launch.num_warps,
                                    **({"launch_pdl": True} if launch.pdl else {}))
    launch_select(launch)
    return plan


@dataclass(frozen=True)
class RouteLaunch:
    """A validated route_sort launch: _route_sort_kernel's positional arguments and named
    constexprs, its grid (E tiles, K splits), warps, PDL, and the spread selection's launch
    (grid, arguments, constexprs) or None (a fused launch, kernels/moe/front_route.py, runs the
    same programs inside its own grid)."""

    args: tuple
    constexprs: dict
    grid: tuple[int, int]
    num_warps: int
    pdl: bool
    select: tuple | None


def prepare_route(hidden: torch.Tensor, gate_weight: torch.Tensor,
                  correction_bias: torch.Tensor, *, top_k: int, n_group: int = 1,
                  topk_group: int = 1, renormalize: bool = True,
                  routed_scaling_factor: float = 1.0, block_m: int = 1,
                  out_dim: int | None = None, config: RouteConfig | None = None
                  ) -> tuple[RouteLaunch, RoutePlan]:
    """Validate and lay out :func:`route_sort`'s launch (same arguments); returns the
    :class:`RouteLaunch` and the plan it fills once launched."""
    M, H, E = _check_gate_inputs(hidden, gate_weight, correction_bias)
    dev = hidden.device
    _check_routing(E, top_k, n_group, topk_group, block_m, out_dim, routed_scaling_factor)
    cfg = _config(config)

    counter = _counter(dev)

    on_gpu = dev.type == "cuda"
    row_mode = _gemv_rows(E, H, on_gpu, cfg) if cfg.gemv_row_max_tokens >= M else None
    if row_mode is None:
        block_e, block_k = _gemv_blocks(E, H, on_gpu, cfg)
        rows, chunks, split_k, e_tiles = 0, 1, triton.cdiv(H, block_k), triton.cdiv(E, block_e)
        dot = _gemv_dot(M, block_e, block_k, (hidden.dtype, gate_weight.dtype), cfg, on_gpu)
    else:
        rows, block_e, block_k, chunks, split_k = row_mode
        e_tiles, dot = triton.cdiv(E, rows), NO_DOT
    n = M * top_k
    cap = plan_capacity(M, top_k, E, block_m)
    tiles = _select_tiles(E, M, top_k, cfg)
    f32, i32 = torch.float32, torch.int32
    partial = torch.empty(split_k, M, E, dtype=f32, device=dev)
    rank = torch.empty(n, dtype=i32, device=dev)
    # the threshold selection's candidate rows (keys, payloads, count), see _top_k_threshold
    cand = (torch.empty(M, 2 * tiles["CAP"] + 1, dtype=torch.int64, device=dev)
            if tiles["BUCKETS"] else rank)
    topk_ids = torch.empty(M, top_k, dtype=i32, device=dev)
    topk_weights = torch.empty(M, top_k, dtype=f32, device=dev)
    sorted_ids = torch.empty(cap, dtype=i32, device=dev)
    sorted_weights = torch.empty(cap, dtype=f32, device=dev)
    block_expert_ids = torch.empty(cap // block_m, dtype=i32, device=dev)
    num_valid = torch.empty(1, dtype=i32, device=dev)
    out = None if out_dim is None else torch.empty(M, out_dim, dtype=f32, device=dev)

    pdl = cfg.pdl and not INTERPRETED
    spread = _spread_selection(M, tiles, cfg)
    routing = dict(E=E, SPLIT_K=split_k, TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group,
                   GROUP_SIZE=E // n_group, RENORMALIZE=bool(renormalize), BM=block_m,
                   BLOCK_G=triton.next_power_of_2(n_group), CAND_CACHE=cfg.cand_cache,
                   SCALAR_E=cfg.scalar_keys)
    select = None
    if spread:
        sel = {k: v for k, v in tiles.items() if k != "IN_REGS"}
        select = ((triton.cdiv(M, tiles["BLOCK_T"]),),
                  (partial, correction_bias, cand, rank, counter, topk_ids, topk_weights,
                   sorted_ids, sorted_weights, block_expert_ids, num_valid, M,
                   float(routed_scaling_factor)),
                  {**routing, **sel})
    launch = RouteLaunch(
        args=(hidden, gate_weight, correction_bias, partial, cand, rank, counter, topk_ids,
              topk_weights, sorted_ids, sorted_weights, block_expert_ids, num_valid,
              partial if out is None else out, M, H, cap, cap // block_m,
              0 if out is None else out.numel(), float(routed_scaling_factor)),
        constexprs=dict(**routing, GEMV_E=block_e, GEMV_K=block_k, FILL=FILL_BLOCK, **tiles,
                        GEMV_ROWS=rows, GEMV_CHUNKS=chunks,
                        EARLY_DEPENDENTS=cfg.early_dependents and not INTERPRETED, PDL=pdl,
                        SELECT=not spread, **dot),
        grid=(e_tiles, split_k), num_warps=cfg.num_warps, pdl=pdl, select=select)
    plan = RoutePlan(topk_ids=topk_ids, topk_weights=topk_weights, sorted_ids=sorted_ids,
                     sorted_weights=sorted_weights, block_expert_ids=block_expert_ids,
                     num_valid=num_valid, out=out, block_m=block_m)
    return launch, plan


def launch_select(launch: RouteLaunch) -> None:
    """The spread selection's own launch, where ``launch`` has one (after its GEMV launch)."""
    if launch.select is not None:
        grid, args, constexprs = launch.select
        _route_select_kernel[grid](*args, **constexprs, num_warps=launch.num_warps)
