"""The MoE front with the router in one launch: route_sort's programs, then the dense GEMV's.

Both read x alone. Programs [0, R) are route_sort's (``kernels/route/sort.py``: the gate GEMV
partials and the plan's padding; the last of them to finish selects and sorts), programs from R
are the front's merged GEMV tiles (``kernels/dense/gemv.py``: latent down and the shared
gate/up). Blocks start in index order, so the router's rows stream first and the selection runs
while the front's tiles still stream; no launch waits for another inside the block.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..attn_res_sums import ReadInput
from ..dense.config import GemvConfig
from ..dense.gemv import _gemv_program
from ..dense.launch import default_config, interpreter_config, mix_launch, prepare_gemv
from ..route.config import RouteConfig
from ..route.launch import launch_select, prepare_route
from ..route.sort import _route_program
from ..runtime import INTERPRETED, check_max_registers

__all__ = ["front_route", "front_tiling", "FRONT_ROUTE_CONFIG", "FRONT_TILING_M1"]

# The router GEMV's shape in the fused launch: row programs over 4 K splits. Its programs and
# the front's share one register count; at K3 (offline sm_90 build, Triton 3.6) route_sort's
# default 2 splits take 164 registers, which the whole launch would take, 4 splits 80 (the
# front's tiles alone 96; fused 117).
FRONT_ROUTE_CONFIG = RouteConfig(gemv_row_splits=4)
# The merged front's tiles at one token, in the fused launch and in a launch of its own: 4 rows
# over 1024-column steps, 4 stages (``token --sweep front_routes``; with
# MoEConfig.front_route_registers at 96 an offline sm_90 build at K3 has no spills, and 5
# programs an SM fit).
FRONT_TILING_M1 = GemvConfig(block_n=4, block_k=1024, num_stages=4, pdl=True, prefetch_steps=0)


def front_tiling(m: int, rows: int, k: int, gated: bool) -> GemvConfig:
    """The merged front's tiling when none is given (the fused launch's, and a front launched
    apart from the route), for ``rows`` output rows (per gate/up half when ``gated``) over K at
    M tokens: :data:`FRONT_TILING_M1` at one token, else dense_gemv's default; under the
    interpreter dense_gemv's interpreter tiling."""
    if INTERPRETED:
        return interpreter_config(m, rows, k)
    return FRONT_TILING_M1 if m == 1 else default_config(m, rows, k, gated)


@triton.jit
def _front_route_kernel(
        # route_sort's (kernels/route/sort.py)
        p_x, p_w, p_bias, p_part, p_cand, p_rank, p_count, p_ids, p_topk_w, p_sorted_ids,
        p_sorted_w, p_block_ids, p_num_valid, p_out, M, H, n_sorted, n_blocks, n_out, scaling,
        # dense_gemv_kernel's (kernels/dense/gemv.py)
        f_x, f_w, f_y, f_res, f_g, f_ws, f_cnt, f_x2, f_w2, f_sc, b1, b2, b3, b4, b5, b6, b7,
        f_M, f_N, f_K, f_K_SPLIT, f_K2, f_K2_SPLIT, f_T0, f_NG, f_eps, f_beta, f_linear_beta,
        E_TILES, ROUTE_PROGRAMS, F_TILES,
        # an AttnRes read as both GEMVs' input (dense_gemv's read_input; kernels/dense/mix.py)
        m_sb, m_clr, m_sums, m_n, m_sbn, m_sbm, m_p, m_ncl,
        E: tl.constexpr, SPLIT_K: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, RENORMALIZE: tl.constexpr,
        BM: tl.constexpr, GEMV_E: tl.constexpr, GEMV_K: tl.constexpr, FILL: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr, BUCKETS: tl.constexpr, CAP: tl.constexpr,
        IN_REGS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
        GEMV_ROWS: tl.constexpr, GEMV_CHUNKS: tl.constexpr, CAND_CACHE: tl.constexpr,
        SCALAR_E: tl.constexpr, SORT_N: tl.constexpr, EARLY_DEPENDENTS: tl.constexpr,
        PDL: tl.constexpr, SELECT: tl.constexpr, DOT_M: tl.constexpr, DOT_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
        F_SCALED: tl.constexpr, F_BLOCK_M: tl.constexpr, F_BLOCK_N: tl.constexpr,
        F_BLOCK_K: tl.constexpr, F_SPLIT_K: tl.constexpr, F_ACT: tl.constexpr,
        F_NORM: tl.constexpr, F_RESIDUAL: tl.constexpr, F_N_SEG: tl.constexpr,
        F_DUAL: tl.constexpr, F_MIXED: tl.constexpr, F_DOT_FP32: tl.constexpr,
        F_PDL: tl.constexpr, F_PREFETCH: tl.constexpr, F_NUM_STAGES: tl.constexpr,
        F_WAIT_LAST: tl.constexpr, F_GATE_UP_TOGETHER: tl.constexpr, F_UNROLL: tl.constexpr,
        F_TRIGGER_LAST: tl.constexpr, F_SECOND_FIRST: tl.constexpr,
        F_MIX: tl.constexpr = False, F_S_NB: tl.constexpr = 16, F_S_BLOCK_C: tl.constexpr = 1):
    """1-D grid: ROUTE_PROGRAMS route programs (E_TILES x K splits, E tile fastest), then
    F_TILES x front K shares GEMV programs (row tile fastest). F_MIX: x is an AttnRes read's
    live sum and both GEMVs take that read (sums m_sums, bank m_sb, norm weight f_g, eps
    f_eps); the first front program zeroes m_ncl words at m_clr."""
    pid = tl.program_id(0)
    if pid < ROUTE_PROGRAMS:
        _route_program(pid % E_TILES, pid // E_TILES, E_TILES, ROUTE_PROGRAMS, p_x, p_w, p_bias,
                       p_part, p_cand, p_rank, p_count, p_ids, p_topk_w, p_sorted_ids,
                       p_sorted_w, p_block_ids, p_num_valid, p_out, M, H, n_sorted, n_blocks,
                       n_out, scaling, E, SPLIT_K, TOP_K, N_GROUP, TOPK_GROUP, GROUP_SIZE,
                       RENORMALIZE, BM, GEMV_E, GEMV_K, FILL, BLOCK_T, BLOCK_E, BLOCK_G,
                       BLOCK_S, BUCKETS, CAP, IN_REGS, BLOCK_R, BLOCK_C, GEMV_ROWS, GEMV_CHUNKS,
                       CAND_CACHE, SCALAR_E, SORT_N, EARLY_DEPENDENTS, PDL, SELECT, DOT_M,
                       DOT_K, DOT_FP32, F_MIX, m_sb, f_g, m_sums, m_n, m_sbn, m_sbm, m_p, f_eps,
                       F_S_NB, F_S_BLOCK_C)
    else:
        j = pid - ROUTE_PROGRAMS
        _gemv_program(j % F_TILES, j // F_TILES, f_x, f_w, f_y, f_res, f_g, f_ws, f_cnt, f_x2,
                      f_w2, f_sc, b1, b2, b3, b4, b5, b6, b7, f_M, f_N, f_K, f_K_SPLIT, f_K2,
                      f_K2_SPLIT, f_T0, f_NG, f_eps, f_beta, f_linear_beta, F_SCALED, F_BLOCK_M,
                      F_BLOCK_N, F_BLOCK_K, F_SPLIT_K, F_ACT, F_NORM, F_RESIDUAL, F_N_SEG,
                      F_DUAL, F_MIXED, F_DOT_FP32, F_PDL, F_PREFETCH, F_NUM_STAGES,
                      F_WAIT_LAST, F_GATE_UP_TOGETHER, F_UNROLL, F_TRIGGER_LAST,
                      F_SECOND_FIRST, m_sb, m_clr, m_sums, m_sums, m_n, m_sbn, m_sbm, m_p,
                      m_ncl, 0, F_S_NB, F_S_BLOCK_C, False, 0, 1, 1e-5, F_MIX)


def front_route(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor,
                front_weight: torch.Tensor, *, splits=None, activation=None, situ_beta=4.0,
                situ_linear_beta=25.0, top_k: int, n_group: int = 1, topk_group: int = 1,
                renormalize: bool = True, routed_scaling_factor: float = 1.0, block_m: int = 1,
                out_dim: int | None = None, route_config: RouteConfig | None = None,
                gemv_config: GemvConfig | None = None, pdl: bool = False,
                max_registers: int = 0, read_input: ReadInput | None = None):
    """``route_sort(x, gate_weight, correction_bias, ...)`` and ``dense_gemv(x, front_weight,
    splits=..., activation=...)`` in one launch (two where the route's selection is spread
    over a launch of its own: ``RouteConfig.select_programs_min_tokens``). Returns (plan, the
    GEMV's result); both bitwise those of the two calls with the same configs.

    ``route_config``: the router GEMV's shape (None: :data:`FRONT_ROUTE_CONFIG`);
    ``gemv_config``: the front's tiling (None: :func:`front_tiling`);
    its ``wait_last`` and ``trigger_last`` are ignored, as are the route config's ``pdl`` and
    ``early_dependents``. ``pdl`` (compiled only): the launch goes by programmatic dependent
    launch, every program waiting for the previous grid before it reads x (where the tiling
    has ``pdl`` and ``prefetch_steps``, the front's tiles first ask L2 for their first weight
    steps). Its programs let a dependent launch start once they have waited: a launch after it
    must read the plan only after its own PDL wait, or be launched plainly.
    ``max_registers`` (compiled only): the launch's registers a thread at most (Triton's
    ``maxnreg``; 0: the compiler's choice).
    ``read_input`` (a :class:`~kernels.attn_res_sums.ReadInput`): x is the live sum of an
    AttnRes read whose sums x's producer left, and both GEMVs take that read's h_normed, mixed
    as they load it (``dense_gemv(read_input=...)``): the read has no launch of its own.
    """
    pdl = bool(pdl) and not INTERPRETED
    rc = route_config if route_config is not None else FRONT_ROUTE_CONFIG
    if not isinstance(rc, RouteConfig):
        raise ValueError(f"route_config: expected a RouteConfig or None, got "
                         f"{type(rc).__name__}")
    if gemv_config is not None and not isinstance(gemv_config, GemvConfig):
        raise ValueError(f"gemv_config: expected a GemvConfig or None, got "
                         f"{type(gemv_config).__name__}")
    check_max_registers("max_registers", max_registers)
    max_registers = 0 if INTERPRETED else max_registers
    route, plan = prepare_route(
        x, gate_weight, correction_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
        renormalize=renormalize, routed_scaling_factor=routed_scaling_factor, block_m=block_m,
        out_dim=out_dim, config=dataclasses.replace(rc, pdl=False, early_dependents=False))
    gemv, outputs = prepare_gemv(x, front_weight, splits=splits, activation=activation,
                                 situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                                 config=gemv_config, default_tiling=front_tiling)
    mix = {}
    if read_input is not None:
        gemv = mix_launch(gemv, x, read_input, None)  # the front never waits last
        mix = dict(F_MIX=True, F_S_NB=gemv.sums_constexprs["S_NB"],
                   F_S_BLOCK_C=gemv.sums_constexprs["S_BLOCK_C"])
    sa = gemv.sums_args
    e_tiles, splits_k = route.grid
    f_tiles, f_shares = gemv.grid
    n_route = e_tiles * splits_k
    # every program waits for the previous grid first, when launched by PDL
    _front_route_kernel[(n_route + f_tiles * f_shares,)](
        *route.args, *gemv.args, e_tiles, n_route, f_tiles, sa["p_sb"], sa["p_srn"],
        sa["p_sums"], sa["s_n"], sa["s_sbn"], sa["s_sbm"], sa["s_p"], sa["s_cols"],
        **{**route.constexprs, "PDL": pdl}, **gemv.inner_constexprs(pdl), **mix,
        num_warps=max(route.num_warps, gemv.num_warps), **({"launch_pdl": True} if pdl else {}),
        **({"maxnreg": max_registers} if max_registers else {}))
    launch_select(route)
    return plan, outputs()
