"""H200, issue 4 (session 11, call 7): stage 2's evict_first weights (FP4_MMA_EVICT_FIRST) in
the benchmark's conditions (48 experts, 3 cold copies of 16 selected) and in the 20_moe
report's (all 896 experts, 2 copies: make_copies' ceil(2 x L2 / stage bytes)), on and off, PDL
off and PDL_STEPS 0, interleaved, REPS times. K3 B1 tp 1, prepared activations, graph replay
back to back, median of 10 (and of 50 at the report's 32-call graphs), fraction of the copy
bandwidth on the stage's bytes, checked against the fp32 reference.

    python3 benchmarks/session11/moe_evict.py        # writes $OUT/moe_evict.json
"""

import os
import sys

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
sys.path.insert(0, "benchmarks/session11")
from common import dump  # noqa: E402
from moe_stages import named_setup, reps_pdl  # noqa: E402
from moe_tiles import row  # noqa: E402

from k3lab.kernels import moe  # noqa: E402

REPS = int(os.environ.get("REPS", "3"))
for setup_name in ("bench", "report"):
    copies, wants = named_setup(setup_name)
    for rep, steps in reps_pdl(REPS):
        for evict in ((False, True), (False, False), (True, True)):
            moe.FP4_MMA_EVICT_FIRST = evict
            for stage in ("stage1", "stage2"):
                if stage == "stage1" and evict == (False, False):
                    continue  # stage 1 is the same kernel in the first two
                row(copies, wants, stage, setup=setup_name, evict=str(evict), pdl=steps,
                    rep=rep)
    moe.FP4_MMA_EVICT_FIRST = (False, True)
    del copies, wants
    torch.cuda.empty_cache()
dump("moe_evict.json")
