"""H200, issue 4 (session 11, call 1): the MXFP4 stages' tensor-core tiles with one 16-row tile a
warp (R = 1), which compile to fewer registers and so fit more programs an SM.

Offline sm_90 (Triton 3.6, benchmarks/session11/aot_tiles.py), stage 2 at K3 tp 1: the (2, 2, 1)
tile takes 128 registers (4 programs an SM, 896 programs = 1.70 waves of 528); (1, 1, 1) 72
registers (7 an SM: 896 programs in 0.97 of a wave of 924); (1, 2, 1) 80 (6 an SM, 1792
programs = 2.26 waves). Stage 1's tiles are R = 2 (gate and up), so only stage 2 changes.

Rows: K3 B1 (tp 1: 48 experts, 3 cold copies of 16; tp 8: 4 copies), prepared activations,
graph replay back to back, median of 10, fraction of the copy bandwidth on the stage's bytes,
checked against the fp32 reference at the tests' tolerances; FP4_MMA_TILES[2] in TILES, PDL off
and with PDL_STEPS 0, interleaved, REPS times.

    python3 benchmarks/session11/moe_tiles.py        # writes $OUT/moe_tiles.json
"""

import os
import sys
import time

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump  # noqa: E402
from moe_stages import reps_pdl, stage_row, stage_setup  # noqa: E402

from k3lab.kernels import moe  # noqa: E402

TILES = [tuple(int(v) for v in t.split(",")) for t in
         os.environ.get("TILES", "2,2,1 1,1,1 1,2,1 1,1,2 1,1,0").split()]
REPS = int(os.environ.get("REPS", "2"))
TPS = [int(t) for t in os.environ.get("TPS", "1 8").split()]
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)


def row(copies, wants, stage, **tags):
    """One stage row (moe_stages.stage_row) under k="moe_tiles"."""
    stage_row(copies, wants, stage, "moe_tiles", T0, **tags)


def main():
    for tp in TPS:
        copies, wants = stage_setup(tp, 3 if tp == 1 else 4)
        for rep, steps in reps_pdl(REPS, (None, 0)):
            moe.FP4_MMA_TILES = None
            row(copies, wants, "stage1", tp=tp, tile="auto", pdl=steps, rep=rep)
            for tile in TILES:
                # stage 1 keeps the tile the launcher picks at this tp
                moe.FP4_MMA_TILES = {1: (2, 2, 1) if tp == 1 else (2, 4, 1), 2: tile}
                row(copies, wants, "stage2", tp=tp, tile=tile, pdl=steps, rep=rep)
        moe.FP4_MMA_TILES = None
        del copies, wants
        torch.cuda.empty_cache()
    dump("moe_tiles.json")
    print("done", round(time.time() - T0, 1), flush=True)


if __name__ == "__main__":
    main()
