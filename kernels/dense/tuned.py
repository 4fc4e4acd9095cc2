"""Measured tilings of the one-token GEMV, per projection shape.

Keys are (rows, K, gated): rows are output rows (per gate/up half when gated), K the input
columns, gated whether the launch runs a gate/up epilogue. The shapes are Kimi-K3's dense
projections at tp 8 and 16; the entry is the fastest of the ``tune`` sweep's candidates
(``benchmarks.sweeps.GEMV_CANDIDATES``, ``python -m benchmarks.run dense --sweep tune``: cold
weights, CUDA graph, H200), kept where it beat the rule of ``launch.heuristic_config`` by at
least 2 %. Shapes not listed take the rule. docs/decisions.md has the figures (H200 unless an
entry's comment names the H100).
"""

from __future__ import annotations

from dataclasses import replace

from .config import GemvConfig

__all__ = ["TUNED_M1", "TUNED_M1_E4M3"]


def _c(block_n, block_k, split_k, num_stages, prefetch_steps, gate_up_together=False,
       unroll_k=False):
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4,
                      num_stages=num_stages, pdl=True, prefetch_steps=prefetch_steps,
                      gate_up_together=gate_up_together, unroll_k=unroll_k)


# thin rows over K 7168: 1024-column steps, split K below about 200 rows, the L2 prefetch
_THIN_SPLIT = _c(8, 1024, 4, 4, 2)
_THIN = _c(8, 1024, 1, 4, 2)
# 384-1536 rows over K 7168: 4-row tiles, twice the programs of 8 (dense --sweep rows4, H100)
_ROWS4 = _c(4, 1024, 1, 4, 0)
# 7168 rows over a short K: 16-row tiles, 256-column steps
_TALL = _c(16, 256, 1, 3, 0)
# large weights over K 7168: 1024-column steps, no prefetch
_WIDE = _c(8, 1024, 1, 3, 0)

TUNED_M1: dict[tuple[int, int, bool], GemvConfig] = {
    (6, 7168, False): _THIN_SPLIT,  # KDA beta, tp 16
    (12, 7168, False): _THIN_SPLIT,  # KDA beta, tp 8
    (128, 7168, False): _THIN_SPLIT,  # KDA f_a
    (576, 7168, False): _ROWS4,  # MLA kv_a
    (768, 7168, False): _ROWS4,  # KDA q/k/v/g, tp 16
    (896, 7168, False): _ROWS4,  # router
    (384, 7168, True): _ROWS4,  # shared gate/up, tp 16
    (768, 7168, True): _c(8, 512, 1, 4, 0, True),  # shared gate/up, tp 8 (dense --sweep gate_up)
    (1152, 1536, False): _c(16, 512, 1, 4, 2),  # MLA q_b, tp 16
    (1536, 7168, False): _ROWS4,  # KDA q/k/v/g, MLA q_a, tp 8
    (7168, 384, False): _c(8, 512, 1, 2, 2),  # shared down, tp 16
    (7168, 1536, False): _c(8, 512, 1, 3, 0, unroll_k=True),  # o_proj, tp 8 (dense --sweep unroll)
    (7168, 2112, False): _TALL,  # dense MLP down, tp 16
    (7168, 3584, False): _TALL,  # latent up
    (7168, 4224, False): _TALL,  # dense MLP down, tp 8
    (4224, 7168, True): _WIDE,  # dense MLP gate/up, tp 8
    (6284, 7168, False): _WIDE,  # KDA merged input projection, tp 8
    (10240, 7168, False): _WIDE,  # LM head, tp 16
}

# e4m3 weights with row scales (the seed's FP8 latent tail, #18; ``dense --sweep fp8_tiles``,
# H200): shapes not listed take the bf16 entry at twice its columns a step
TUNED_M1_E4M3: dict[tuple[int, int, bool], GemvConfig] = {
    # latent up (the MoE tail): 16 x 512 capped at 128 registers, four programs an SM
    # (dense --sweep fp8_warps, token --sweep tail_cap; H100)
    (7168, 3584, False): replace(_c(16, 512, 1, 3, 0), max_registers=128),
    (3584, 7168, False): _c(16, 512, 1, 4, 0),  # latent down
    (7168, 1536, False): _c(8, 512, 1, 3, 0),  # o_proj, tp 8
}
