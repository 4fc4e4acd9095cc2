"""Tile choice on the host: how many output rows and K elements a program of each GEMV takes.

A program owns ``BLOCK_N`` output rows and walks K in steps of ``BLOCK_KP`` bf16 pairs. The rule
is the same everywhere: the most rows (a power of two) that still launch the config's target
programs, so that HBM sees enough loads in flight, then the most pairs a step that keep the
product tile in registers. Under the Triton interpreter programs run one by one in Python, so
by default a few big tiles are used instead (``MoEConfig.interpret_gpu_tiles`` turns that off).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from ..mxfp4 import MXFP4
from ..runtime import INTERPRETED
from .config import MoEConfig
from .mma import MMA_WARPS

__all__ = ["MMA_CANDIDATES", "MIN_PAIRS", "MIN_ROWS", "ExpertTiles", "big_tiles", "token_loop",
           "gemv_tiles", "expert_tiles", "mma_tile", "mma_block_n"]

# Rows of weights a program: at least 4 (so its loads are not all latency), at most 64.
MIN_ROWS, MAX_ROWS = 4, 64
# Broadcast products a K step (M x rows x pairs): 4096 = 32 fp32 registers a thread at 4 warps.
PRODUCT_BUDGET = 4096
MIN_PAIRS, MAX_PAIRS = 16, 512
# An MXFP4 K step holds words and per-group sums (a quarter of the bf16 path's fp32 planes):
# 4x the pairs fit in the same registers.
FP4_BUDGET_FACTOR = 4
# The interpreter vectorizes whole tiles: few programs, large tiles.
INTERPRETER_TARGET_PROGRAMS = 4
INTERPRETER_MAX_ROWS = 128
INTERPRETER_PRODUCT_BUDGET = 1 << 17
# Tensor-core tiles (R, WARPS_K, L2 prefetch distance) a stage picks from when its config tile
# is None: the one with the most rows that still launches the target programs.
MMA_CANDIDATES = {1: ((2, 2, 1), (2, 4, 1)), 2: ((2, 1, 1), (2, 2, 1), (2, 4, 1))}


@dataclass(frozen=True)
class ExpertTiles:
    """How an expert stage launches: rows a program (``block_n``), K pairs a step
    (``block_kp``; K-lane: 4 pairs a word), the tensor-core tile (R, WARPS_K, L2 prefetch) or
    None (K-lane MXFP4 or bf16), and the K-lane loop's pipeline stages."""

    block_n: int
    block_kp: int
    mma: tuple[int, int, int] | None = None
    klane_stages: int = 0


def big_tiles(config: MoEConfig) -> bool:
    """Whether launches take the interpreter's few big tiles (not the GPU's tiling)."""
    return INTERPRETED and not config.interpret_gpu_tiles


def token_loop(config: MoEConfig) -> bool:
    """GPU tiling: a GEMV serves a tile's tokens one at a time from the same weight registers;
    the interpreter's big tiles broadcast over all of them at once."""
    return not big_tiles(config)


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def gemv_tiles(config: MoEConfig, programs_per_tile: int, rows: int, k_pairs: int,
               block_m: int = 1, fp4: bool = False, target: int | None = None,
               max_rows: int = MAX_ROWS) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_KP) of a GEMV over ``rows`` output rows launched for
    ``programs_per_tile`` independent row sets (``target``: programs to aim at, default the
    config's; ``max_rows``: the GPU tiling's cap on rows)."""
    big = big_tiles(config)
    target = INTERPRETER_TARGET_PROGRAMS if big else (target or config.target_programs)
    fp4_factor = FP4_BUDGET_FACTOR if fp4 else 1
    # interpreter: an MXFP4 tile's arrays are a quarter of a bf16 tile's, so 4x the rows too
    max_rows = INTERPRETER_MAX_ROWS * fp4_factor if big else max_rows
    budget = (INTERPRETER_PRODUCT_BUDGET if big else PRODUCT_BUDGET) * fp4_factor
    block_n = MIN_ROWS
    while (block_n * 2 <= min(max_rows, triton.next_power_of_2(rows))
           and programs_per_tile * triton.cdiv(rows, block_n * 2) >= target):
        block_n *= 2
    # a token loop (and MXFP4 always) holds one token's products at a time, else block_m's
    per_step = 1 if token_loop(config) or fp4 else block_m
    block_kp = _pow2_floor(budget // (per_step * block_n))
    block_kp = min(block_kp, budget if big else MAX_PAIRS * fp4_factor,
                   triton.next_power_of_2(k_pairs))
    return block_n, max(MIN_PAIRS, block_kp)


def mma_block_n(tile: tuple[int, int, int], stage: int) -> int:
    """Rows a tensor-core program owns: stage 1 16 * WN gate rows (and as many up rows),
    stage 2 R * 16 * WN rows (WN = 4 // WARPS_K warps along the rows)."""
    r, warps_k, _ = tile
    return 16 * (MMA_WARPS // warps_k) * (1 if stage == 1 else r)


def mma_tile(config: MoEConfig, w, stage: int, block_m: int, programs_per_tile: int,
             rows: int) -> tuple[int, int, int] | None:
    """The tensor-core tile of stage 1 (``stage`` 1) or the atomic stage 2 (2) for MXFP4
    experts ``w`` in plan tiles of one token, else None (``stage`` 0: the deterministic
    stage 2; ``rows``: the GEMV's output rows, gate rows for stage 1)."""
    if not (config.mma and isinstance(w, MXFP4) and stage in (1, 2) and block_m == 1):
        return None
    if big_tiles(config):  # the lane-by-lane mma emulation is slow on big tiles
        return None
    if config.mma_tile(stage) is not None:
        return config.mma_tile(stage)
    tiles = sorted(MMA_CANDIDATES[stage], key=lambda t: -mma_block_n(t, stage))
    for tile in tiles:
        if programs_per_tile * triton.cdiv(rows, mma_block_n(tile, stage)) >= \
                config.target_programs:
            return tile
    return tiles[-1]


def expert_tiles(config: MoEConfig, w, stage: int, block_m: int, programs_per_tile: int,
                 rows: int, k_pairs: int) -> ExpertTiles:
    """Tiles of an expert stage (``stage`` 1, 2 atomic or 0 deterministic stage 2) over
    ``rows`` output rows (stage 1: gate rows) and ``k_pairs`` input pairs, launched for
    ``programs_per_tile`` plan tiles (or tokens) of ``block_m`` entries."""
    tile = mma_tile(config, w, stage, block_m, programs_per_tile, rows)
    if tile is not None:
        return ExpertTiles(mma_block_n(tile, stage), MIN_PAIRS, mma=tile)
    block_mp = 1 if stage == 0 else triton.next_power_of_2(block_m)
    if not isinstance(w, MXFP4):
        return ExpertTiles(*gemv_tiles(config, programs_per_tile, rows, k_pairs, block_mp))
    # K-lane: stage 1's tiles interleave gate and up rows, so half the rows of each
    max_rows = max(MIN_ROWS, config.klane_rows >> (stage == 1))
    block_n, _ = gemv_tiles(config, programs_per_tile, rows, k_pairs, block_mp, True,
                            max_rows=max_rows)
    words = triton.next_power_of_2(k_pairs // 4)
    block_w = max(4, words if big_tiles(config) else min(config.klane_words, words))
    # no pipelining of a loop of one step
    stages = config.klane_stages(stage) if triton.cdiv(k_pairs // 4, block_w) >= 2 else 0
    return ExpertTiles(block_n, 4 * block_w, klane_stages=stages)
