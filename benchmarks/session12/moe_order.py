"""H200, issue 4 (session 12): stage 2's program order. One program a (plan tile, D tile);
the default numbers them D tile fastest, so that programs running together read neighbouring
rows of a few experts; ORDER=1 (kernels/moe.STAGE2_EXPERT_FASTEST, set before the first
compile, so one process per value) numbers them plan tile fastest, so that they spread over
all 16 experts, as stage 1's grid does (its first axis is the plan tile). The 20_moe report's
conditions (K3 B1 tp 1, all 896 experts, 2 cold copies, experts in the tiled layout), prepared
activations, PDL_STEPS 0 and PDL off, graph replay back to back, median of 10, fraction of the
copy bandwidth on the stage's bytes, checked against the fp32 reference; REPS times.

    ORDER=1 python3 benchmarks/session12/moe_order.py     # writes $OUT/moe_order_1.json
"""

import os
import sys
import time

import triton.language as tl

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump  # noqa: E402
from moe_stages import stage_rows  # noqa: E402

from k3lab.kernels import moe  # noqa: E402

ORDER = int(os.environ.get("ORDER", "0"))
moe.STAGE2_EXPERT_FASTEST = tl.constexpr(bool(ORDER))
REPS = int(os.environ.get("REPS", "3"))
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s, order {ORDER}", flush=True)


def main():
    stage_rows("moe_order", T0, REPS, ("stage2", "stage1"), order=ORDER)
    dump(f"moe_order_{ORDER}.json")
    print("done", round(time.time() - T0, 1), flush=True)


if __name__ == "__main__":
    main()
