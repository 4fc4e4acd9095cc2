"""H200, issue 4 (session 12): the atomic stage 2 as a stream grid (kernels/moe.FP4_MMA_STREAM:
SMs x STREAM_PER_SM programs share the (tile, K step) units evenly) against one program a tile
(896 tiles of 64 rows at K3 tp 1: 1.7 waves of 4 programs an SM), experts in the tiled layout.
The benchmark's conditions (48 experts, 3 cold copies of 16) and the 20_moe report's (all 896
experts, 2 copies), PDL_STEPS 0 and PDL off, interleaved, REPS times. K3 B1 tp 1, prepared
activations, graph replay back to back, median of 10, fraction of the copy bandwidth on the
stage's bytes, checked against the fp32 reference.

    python3 benchmarks/session12/moe_stream.py        # writes $OUT/moe_stream.json
"""

import os
import sys
import time

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump  # noqa: E402
from moe_stages import named_setup, reps_pdl, stage_row  # noqa: E402

from k3lab.kernels import moe  # noqa: E402

REPS = int(os.environ.get("REPS", "3"))
SETUPS = os.environ.get("SETUPS", "report bench").split()
PER_SM = [int(v) for v in os.environ.get("PER_SM", "0 4 3 8").split()]  # 0: no stream grid
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)


def main():
    for setup in SETUPS:
        copies, wants = named_setup(setup)
        for rep, steps in reps_pdl(REPS):
            for per_sm in PER_SM:
                moe.FP4_MMA_STREAM, moe.STREAM_PER_SM = per_sm > 0, max(per_sm, 1)
                stage_row(copies, wants, "stage2", "moe_stream", T0, setup=setup,
                          per_sm=per_sm, pdl=steps, rep=rep)
        moe.FP4_MMA_STREAM, moe.STREAM_PER_SM = False, 4
        del copies, wants
        torch.cuda.empty_cache()
    dump("moe_stream.json")
    print("done", round(time.time() - T0, 1), flush=True)


if __name__ == "__main__":
    main()
