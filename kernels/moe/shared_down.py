"""The shared experts' down-projection beside an expert stage, in the stage's launch.

At one token the expert stages leave SM slots and DRAM time free (K3 tp 8: stage 1's 384 tiles
where 4 an SM fit, its MXFP4 decode keeping DRAM busy about a third of the time). The shared
down-projection (``a_s @ Ws2^T``) reads only the front's output, so its dense GEMV tiles
(``kernels/dense/gemv.py``) can stream there instead of inside the MoE tail after stage 2,
writing ``a_s @ Ws2^T + residual`` (fp32) for the tail to add (``MoEConfig.shared_down_launch``):

- "stage1": programs [0, S1) are stage 1's (``stages._stage1_program``), the GEMV's after them;
- "stage2": the GEMV's programs first, then stage 2's (``stages._stage2_tile``). Stage 2 goes by
  PDL while stage 1 runs, so its GEMV programs start at once in the slots stage 1 leaves free
  (they read nothing stage 1 writes: no wait), and its own tiles wait for stage 1 as before.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ..dense.config import GemvConfig
from ..dense.gemv import _gemv_program
from ..dense.launch import default_config, interpreter_config
from ..runtime import INTERPRETED  # noqa: F401  (sets the interpreter up before any jit)
from .stages import _stage1_program, _stage2_tile

__all__ = ["SHARED_DOWN_TILING_M1", "shared_down_tiling"]

# The shared down-projection's tiles beside a stage at one token: 16 rows over 256-column steps
# (K3 tp 8: 448 tiles; the launch stays at stage 1's 128 registers in an offline sm_90 build),
# the best beside stage 1 in the token (token --sweep shared_down, H100; docs/decisions.md)
SHARED_DOWN_TILING_M1 = GemvConfig(block_n=16, block_k=256, num_stages=3, prefetch_steps=0)


def shared_down_tiling(m: int, rows: int, k: int) -> GemvConfig:
    """The shared down-projection's tiling beside a stage when none is given: at one token
    :data:`SHARED_DOWN_TILING_M1`, else dense_gemv's default; under the interpreter its
    interpreter tiling."""
    if INTERPRETED:
        return interpreter_config(m, rows, k)
    return SHARED_DOWN_TILING_M1 if m == 1 else default_config(m, rows, k)


@triton.jit
def _stage1_shared_down_kernel(
        # _moe_stage1_kernel's
        p_z, p_w, p_ws, p_sorted, p_block_expert, p_num_valid, p_a, p_ap, p_out, p_sync,
        n_entries, block_m, top_k, N_I, D_PAIRS, n_zero, beta, linear_beta,
        # dense_gemv_kernel's
        f_x, f_w, f_y, f_res, f_g, f_ws, f_cnt, f_x2, f_w2, f_sc, b1, b2, b3, b4, b5, b6, b7,
        f_M, f_N, f_K, f_K_SPLIT, f_K2, f_K2_SPLIT, f_T0, f_NG, f_eps, f_beta, f_linear_beta,
        I_TILES, S1_PROGRAMS, F_TILES,
        ACT: tl.constexpr, FP4: tl.constexpr, USE_MMA: tl.constexpr, WARPS_K: tl.constexpr,
        L2_PREFETCH: tl.constexpr, X_PREPARED: tl.constexpr, EVICT_FIRST: tl.constexpr,
        ASM: tl.constexpr, KLANE_STAGES: tl.constexpr, ZERO_OUT: tl.constexpr,
        ZERO_SYNC: tl.constexpr, ZERO_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, TOKEN_LOOP: tl.constexpr,
        WRITE_PREPARED: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
        TILED: tl.constexpr,
        F_SCALED: tl.constexpr, F_BLOCK_M: tl.constexpr, F_BLOCK_N: tl.constexpr,
        F_BLOCK_K: tl.constexpr, F_SPLIT_K: tl.constexpr, F_ACT: tl.constexpr,
        F_NORM: tl.constexpr, F_RESIDUAL: tl.constexpr, F_N_SEG: tl.constexpr,
        F_DUAL: tl.constexpr, F_MIXED: tl.constexpr, F_DOT_FP32: tl.constexpr,
        F_PDL: tl.constexpr, F_PREFETCH: tl.constexpr, F_NUM_STAGES: tl.constexpr,
        F_WAIT_LAST: tl.constexpr, F_GATE_UP_TOGETHER: tl.constexpr, F_UNROLL: tl.constexpr,
        F_TRIGGER_LAST: tl.constexpr, F_SECOND_FIRST: tl.constexpr):
    """1-D grid: S1_PROGRAMS stage-1 programs (I tile fastest), then F_TILES x K shares GEMV
    programs (row tile fastest). TRIGGER (plain launch): every program lets the next launch
    start as it starts; under PDL the GEMV's own wait and trigger (F_PDL) do."""
    pid = tl.program_id(0)
    if pid < S1_PROGRAMS:
        _stage1_program(pid // I_TILES, pid % I_TILES, I_TILES, p_z, p_w, p_ws, p_sorted,
                        p_block_expert, p_num_valid, p_a, p_ap, p_out, p_sync, n_entries,
                        block_m, top_k, N_I, D_PAIRS, n_zero, beta, linear_beta, ACT, FP4,
                        USE_MMA, WARPS_K, L2_PREFETCH, X_PREPARED, EVICT_FIRST, ASM,
                        KLANE_STAGES, ZERO_OUT, ZERO_SYNC, ZERO_BLOCK, BLOCK_M, BLOCK_N,
                        BLOCK_KP, TOKEN_LOOP, WRITE_PREPARED, PDL, TRIGGER, TILED)
    else:
        if TRIGGER and not PDL:
            gdc_launch_dependents()
        j = pid - S1_PROGRAMS
        _gemv_program(j % F_TILES, j // F_TILES, f_x, f_w, f_y, f_res, f_g, f_ws, f_cnt, f_x2,
                      f_w2, f_sc, b1, b2, b3, b4, b5, b6, b7, f_M, f_N, f_K, f_K_SPLIT, f_K2,
                      f_K2_SPLIT, f_T0, f_NG, f_eps, f_beta, f_linear_beta, F_SCALED, F_BLOCK_M,
                      F_BLOCK_N, F_BLOCK_K, F_SPLIT_K, F_ACT, F_NORM, F_RESIDUAL, F_N_SEG,
                      F_DUAL, F_MIXED, F_DOT_FP32, F_PDL, F_PREFETCH, F_NUM_STAGES,
                      F_WAIT_LAST, F_GATE_UP_TOGETHER, F_UNROLL, F_TRIGGER_LAST,
                      F_SECOND_FIRST, f_x, f_x, f_x, f_x, 0, 0, 0, 0, 1, 0, 16, 16, False)


def launch_stage1_shared_down(args: tuple, kwargs: dict, grid: tuple[int, int], gemv,
                              check_layout) -> None:
    """Launch stage 1 (``_moe_stage1_kernel``'s ``args``, constexpr ``kwargs`` and 2-D
    ``grid``) with the prepared GEMV launch ``gemv`` (``dense.launch.prepare_gemv``) in one
    1-D grid; ``check_layout(kernel, grid, args, kwargs)`` vets the tensor-core tiles first.
    The GEMV's tiling must have stage 1's warps; its register cap, if any, caps the launch."""
    kwargs = dict(kwargs)
    pdl = bool(kwargs.get("launch_pdl"))
    f_tiles, f_shares = gemv.grid
    n_s1 = grid[0] * grid[1]
    full = (*args, *gemv.args, grid[1], n_s1, f_tiles)
    kwargs.update(gemv.inner_constexprs(pdl))
    if gemv.max_registers:
        kwargs["maxnreg"] = gemv.max_registers
    grid1 = (n_s1 + f_tiles * f_shares,)
    if kwargs.get("USE_MMA"):
        check_layout(_stage1_shared_down_kernel, grid1, full, kwargs)
    _stage1_shared_down_kernel[grid1](*full, **kwargs)



@triton.jit
def _stage2_shared_down_kernel(
        # _stage2_tile's
        p_a, p_w, p_ws, p_sorted, p_sorted_w, p_block_expert, p_num_valid, p_topk_ids, p_topk_w,
        p_y, n_entries, block_m, top_k, D, I_PAIRS, n_d_tiles, p_sync, n_zero,
        # dense_gemv_kernel's
        f_x, f_w, f_y, f_res, f_g, f_ws, f_cnt, f_x2, f_w2, f_sc, b1, b2, b3, b4, b5, b6, b7,
        f_M, f_N, f_K, f_K_SPLIT, f_K2, f_K2_SPLIT, f_T0, f_NG, f_eps, f_beta, f_linear_beta,
        F_PROGRAMS, F_TILES,
        ZERO_BLOCK: tl.constexpr, FP4: tl.constexpr, USE_MMA: tl.constexpr, R: tl.constexpr,
        WARPS_K: tl.constexpr, L2_PREFETCH: tl.constexpr, X_PREPARED: tl.constexpr,
        EVICT_FIRST: tl.constexpr, ASM: tl.constexpr, KLANE_STAGES: tl.constexpr,
        DETERMINISTIC: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
        BLOCK_KP2: tl.constexpr, TOKEN_LOOP: tl.constexpr, PDL: tl.constexpr,
        TILED: tl.constexpr,
        F_SCALED: tl.constexpr, F_BLOCK_M: tl.constexpr, F_BLOCK_N: tl.constexpr,
        F_BLOCK_K: tl.constexpr, F_SPLIT_K: tl.constexpr, F_ACT: tl.constexpr,
        F_NORM: tl.constexpr, F_RESIDUAL: tl.constexpr, F_N_SEG: tl.constexpr,
        F_DUAL: tl.constexpr, F_MIXED: tl.constexpr, F_DOT_FP32: tl.constexpr,
        F_PDL: tl.constexpr, F_PREFETCH: tl.constexpr, F_NUM_STAGES: tl.constexpr,
        F_WAIT_LAST: tl.constexpr, F_GATE_UP_TOGETHER: tl.constexpr, F_UNROLL: tl.constexpr,
        F_TRIGGER_LAST: tl.constexpr, F_SECOND_FIRST: tl.constexpr):
    """1-D grid: F_PROGRAMS = F_TILES x K shares GEMV programs (row tile fastest; no wait, and
    under PDL they let the next launch start as they start), then stage 2's programs (the
    stage alone, y zeroed by stage 1)."""
    pid = tl.program_id(0)
    if pid < F_PROGRAMS:
        if PDL:
            gdc_launch_dependents()
        _gemv_program(pid % F_TILES, pid // F_TILES, f_x, f_w, f_y, f_res, f_g, f_ws, f_cnt,
                      f_x2, f_w2, f_sc, b1, b2, b3, b4, b5, b6, b7, f_M, f_N, f_K, f_K_SPLIT,
                      f_K2, f_K2_SPLIT, f_T0, f_NG, f_eps, f_beta, f_linear_beta, F_SCALED,
                      F_BLOCK_M, F_BLOCK_N, F_BLOCK_K, F_SPLIT_K, F_ACT, F_NORM, F_RESIDUAL,
                      F_N_SEG, F_DUAL, F_MIXED, F_DOT_FP32, F_PDL, F_PREFETCH, F_NUM_STAGES,
                      F_WAIT_LAST, F_GATE_UP_TOGETHER, F_UNROLL, F_TRIGGER_LAST,
                      F_SECOND_FIRST, f_x, f_x, f_x, f_x, 0, 0, 0, 0, 1, 0, 16, 16, False)
    else:
        _stage2_tile(pid - F_PROGRAMS, p_a, p_w, p_ws, p_sorted, p_sorted_w, p_block_expert,
                     p_num_valid, p_topk_ids, p_topk_w, p_y, n_entries, block_m, top_k, D,
                     I_PAIRS, n_d_tiles, p_sync, n_zero, False, ZERO_BLOCK, FP4, USE_MMA, R,
                     WARPS_K, L2_PREFETCH, X_PREPARED, EVICT_FIRST, ASM, KLANE_STAGES,
                     DETERMINISTIC, BLOCK_M2, BLOCK_N2, BLOCK_KP2, TOKEN_LOOP, PDL, TILED)


def launch_stage2_shared_down(kw: dict, n_stage2: int, gemv, check_layout) -> None:
    """Launch stage 2 alone (the stage-2 + tail kernel's keyword arguments ``kw`` for
    ``n_stage2`` programs, ZERO_Y off; ``launch_pdl`` in it when by PDL) with the GEMV
    programs of ``gemv`` first in one 1-D grid (the GEMV never waits: its inputs are older
    than the launch before)."""
    if kw.get("ZERO_Y"):
        raise ValueError("stage 2 zeroing its own accumulator cannot share its launch")
    names = ("p_a", "p_w", "p_ws", "p_sorted", "p_sorted_w", "p_block_expert", "p_num_valid",
             "p_topk_ids", "p_topk_w", "p_y", "n_entries", "block_m", "top_k", "D", "I_PAIRS",
             "n_d_tiles", "p_sync", "n_zero")
    consts = ("ZERO_BLOCK", "FP4", "USE_MMA", "R", "WARPS_K", "L2_PREFETCH", "X_PREPARED",
              "EVICT_FIRST", "ASM", "KLANE_STAGES", "DETERMINISTIC", "BLOCK_M2", "BLOCK_N2",
              "BLOCK_KP2", "TOKEN_LOOP", "PDL", "TILED")
    f_tiles, f_shares = gemv.grid
    n_f = f_tiles * f_shares
    args = (*(kw[n] for n in names), *gemv.args, n_f, f_tiles)
    kwargs = {c: kw[c] for c in consts}
    kwargs.update(gemv.inner_constexprs(False))
    kwargs["num_warps"] = kw["num_warps"]
    if kw.get("launch_pdl"):
        kwargs["launch_pdl"] = True
    if gemv.max_registers:
        kwargs["maxnreg"] = gemv.max_registers
    grid = (n_f + n_stage2,)
    if kwargs["USE_MMA"]:
        check_layout(_stage2_shared_down_kernel, grid, args, kwargs)
    _stage2_shared_down_kernel[grid](*args, **kwargs)
