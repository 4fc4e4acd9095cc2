"""H200, issue 4 (session 12): with the experts in the tiled layout (the fused variant's default,
k3lab.kernels.moe_kernel_weights), the stages' tensor-core tiles and L2 policy again: stage 2
over FP4_MMA_TILES[2] in TILES2, stage 1 over TILES1 and FP4_MMA_EVICT_FIRST[0]. The 20_moe
report's conditions (K3 B1 tp 1, all 896 experts, 2 cold copies), prepared activations, PDL_STEPS
0, graph replay back to back, median of 10, fraction of the copy bandwidth on the stage's bytes,
checked against the fp32 reference; interleaved, REPS times.

    python3 benchmarks/session12/moe_tiled_tiles.py   # writes $OUT/moe_tiled_tiles.json
"""

import os
import sys
import time

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump  # noqa: E402
from moe_stages import report_copies, reps_pdl, stage_row  # noqa: E402

from k3lab.kernels import moe  # noqa: E402


def tiles(name, default):
    return [tuple(int(v) for v in t.split(",")) for t in os.environ.get(name, default).split()]


TILES1 = tiles("TILES1", "2,2,1 2,2,0 2,2,2 2,4,1 2,1,1")
TILES2 = tiles("TILES2", "2,2,1 2,2,0 2,2,2 2,4,1 2,1,1 1,1,1 1,2,1")
REPS = int(os.environ.get("REPS", "2"))
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)


def main():
    copies, wants = report_copies()
    for rep, _ in reps_pdl(REPS, (0,)):
        for tile in TILES2:
            moe.FP4_MMA_TILES = {1: (2, 2, 1), 2: tile}
            stage_row(copies, wants, "stage2", "moe_tiled_tiles", T0, tile=tile, rep=rep)
        for tile in TILES1:
            for evict in (False, True):
                moe.FP4_MMA_TILES = {1: tile, 2: (2, 2, 1)}
                moe.FP4_MMA_EVICT_FIRST = (evict, True)
                stage_row(copies, wants, "stage1", "moe_tiled_tiles", T0, tile=tile,
                          evict=evict, rep=rep)
        moe.FP4_MMA_TILES, moe.FP4_MMA_EVICT_FIRST = None, (False, True)
    dump("moe_tiled_tiles.json")
    print("done", round(time.time() - T0, 1), flush=True)


if __name__ == "__main__":
    main()
