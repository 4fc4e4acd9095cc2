"""H200, issue 4 (session 10, call 2): programmatic dependent launch (kernels/moe.PDL_STEPS), the
K steps asked of L2 before the wait, and the whole block fused or not.

1. STAGES: K3 B1 tp 1 (48 experts, 3 cold copies of 16), prepared activations, the stage APIs
   with pdl=True (as k3lab.boundaries.moe.stage_fns runs them), graph replay (a run of
   back-to-back calls over the copies), median of 10; PDL_STEPS in STEPS ("off" = None),
   interleaved, REPS times.
2. BLOCK: moe_block with routing (route_sort + front + stage 1 + stage 2 and tail), tp 1 and
   tp 8, fuse_tail True (stage 2 + tail one ticket-ordered launch: only stage 1 takes PDL) or
   False (stage 2 and the tail apart, both with PDL), PDL on (PDL_STEPS 2) or off; graph, cold
   copies, median of 10, checked against the fp32 truth (k3lab.boundaries.moe.check).

    python3 benchmarks/session10/moe_pdl2.py        # writes $OUT/moe_pdl2.json
"""

import os
import sys
import time

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
sys.path.insert(0, "benchmarks/session10")
from common import bw, dump  # noqa: E402
from moe_pdl import block_sweep, row, setup  # noqa: E402

from k3lab.kernels import moe  # noqa: E402

STEPS = [None if s == "off" else int(s) for s in os.environ.get("STEPS", "off 0 1 2 3").split()]
REPS = int(os.environ.get("REPS", "3"))
T0 = time.time()

copies, wants = setup()
for rep in range(REPS):
    for steps in STEPS:
        moe.PDL_STEPS = steps
        row(copies, wants, pdl="off" if steps is None else steps, latent=3584, rep=rep)
del copies, wants
torch.cuda.empty_cache()

block_sweep(2)
print(f"copy bw {bw / 1e12:.3f} TB/s")
dump("moe_pdl2.json")
print("done", round(time.time() - T0, 1), flush=True)
