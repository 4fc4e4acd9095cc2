"""H200, issue 4 (session 12): with the experts in the tiled layout, each program first asks L2
for its row tiles' codes in bulk (kernels/mxfp4_mma.BULK_PREFETCH: one
cp.async.bulk.prefetch.L2 a 16-row tile; 1 all K steps, 2 the first half, 0 off; set before the
first compile, so one process per value), with the registers capped at 128 (MAXNREG=128,
kernels/moe.FP4_MAXNREG: stage 2 took 130 with the prefetch, so 3 programs an SM) or not. The
20_moe report's conditions (K3 B1 tp 1, all 896 experts, 2 cold copies), prepared activations,
PDL_STEPS 0 and PDL off, graph replay back to back, median of 10, fraction of the copy
bandwidth on the stage's bytes, checked against the fp32 reference; REPS times.

    BULK=1 MAXNREG=128 python3 benchmarks/session12/moe_bulk.py   # $OUT/moe_bulk_1_128.json
"""

import os
import sys
import time

import triton.language as tl

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump  # noqa: E402
from moe_stages import stage_rows  # noqa: E402

from k3lab.kernels import moe, mxfp4_mma  # noqa: E402

BULK = int(os.environ.get("BULK", "0"))
MAXNREG = os.environ.get("MAXNREG", "")
mxfp4_mma.BULK_PREFETCH = tl.constexpr(BULK)
moe.FP4_MAXNREG = int(MAXNREG) if MAXNREG else None
REPS = int(os.environ.get("REPS", "3"))
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s, bulk {BULK}, maxnreg {MAXNREG or '-'}", flush=True)


def main():
    stage_rows("moe_bulk", T0, REPS, bulk=BULK, maxnreg=MAXNREG or None)
    dump(f"moe_bulk_{BULK}_{MAXNREG or 'none'}.json")
    print("done", round(time.time() - T0, 1), flush=True)


if __name__ == "__main__":
    main()
