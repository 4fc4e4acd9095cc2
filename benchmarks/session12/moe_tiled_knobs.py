"""H200, issue 4 (session 12): with the experts in the tiled layout, stage 2's L2 policy
(FP4_MMA_EVICT_FIRST[1], chosen in session 11 on the row layout) and the mma decode (DECODE:
kernels/mxfp4_mma._mma_ptx's 'byte_shift', the default, or 'select', 8 % fewer instructions;
set before the first compile, so one process per decode). The 20_moe report's conditions (K3
B1 tp 1, all 896 experts, 2 cold copies), prepared activations, PDL_STEPS 0 and PDL off, graph
replay back to back, median of 10, fraction of the copy bandwidth on the stage's bytes,
checked against the fp32 reference; interleaved, REPS times.

    DECODE=select python3 benchmarks/session12/moe_tiled_knobs.py   # $OUT/moe_knobs_select.json
"""

import os
import sys
import time

import triton.language as tl

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump  # noqa: E402
from moe_stages import report_copies, reps_pdl, stage_row  # noqa: E402

from k3lab.kernels import moe, mxfp4_mma  # noqa: E402

DECODE = os.environ.get("DECODE", "byte_shift")
mxfp4_mma.MMA_PTX = tl.constexpr(mxfp4_mma._mma_ptx(DECODE))
REPS = int(os.environ.get("REPS", "3"))
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s, decode {DECODE}", flush=True)


def main():
    copies, wants = report_copies()
    for rep, steps in reps_pdl(REPS):
        for evict in (True, False):
            moe.FP4_MMA_EVICT_FIRST = (False, evict)
            stage_row(copies, wants, "stage2", "moe_knobs", T0, decode=DECODE, evict=evict,
                      pdl=steps, rep=rep)
        moe.FP4_MMA_EVICT_FIRST = (False, True)
        stage_row(copies, wants, "stage1", "moe_knobs", T0, decode=DECODE, evict=False,
                  pdl=steps, rep=rep)
    dump(f"moe_knobs_{DECODE}.json")
    print("done", round(time.time() - T0, 1), flush=True)


if __name__ == "__main__":
    main()
