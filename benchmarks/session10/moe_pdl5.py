"""H200, issue 4 (session 10, call 9): HEAD's PDL configuration (PDL_STEPS 0; moe_block: the
front lets stage 1 go as it starts, stage 1 with PDL; stage 2 and the tail with PDL when apart)
against no PDL at all, in the block (with routing, tp 1 and tp 8) and per stage back to back
(tp 1), interleaved; graph, cold copies, median of 10, checked against the fp32 truth.

    python3 benchmarks/session10/moe_pdl5.py        # writes $OUT/moe_pdl5.json
"""

import sys
import time

sys.path.insert(0, "benchmarks/h200_tuning")
sys.path.insert(0, "benchmarks/session10")
from common import bw, dump  # noqa: E402
from moe_pdl import block_sweep, row, setup  # noqa: E402

from k3lab.kernels import moe  # noqa: E402

T0 = time.time()
block_sweep(0)
copies, wants = setup()
for rep in range(3):
    for steps in (None, 0):
        moe.PDL_STEPS = steps
        row(copies, wants, pdl="off" if steps is None else steps, latent=3584, rep=rep)
print(f"copy bw {bw / 1e12:.3f} TB/s")
dump("moe_pdl5.json")
print("done", round(time.time() - T0, 1), flush=True)
