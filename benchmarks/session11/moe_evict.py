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
from moe_stages import stage_setup  # noqa: E402
from moe_tiles import row  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.config import preset  # noqa: E402
from k3lab.kernels import moe  # noqa: E402
from k3lab.reference import moe as ref  # noqa: E402


def report_setup():
    """(copies, wants) as 20_moe's tp sweep builds them: all experts, 2 copies."""
    cfg = preset("kimi-k3", 1)
    base = MB.make_inputs(cfg, "cuda", 0, M=1, expert_format="mxfp4")
    copies = [MB.stage_inputs(c) for c in MB.copies_sharing_experts(base, 2, 0)]
    c0 = copies[0]
    wants = {"stage1": ref.moe_stage1_reference(
        c0["z"], c0["plan"], c0["weights"]["w13"], activation=cfg.activation,
        situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta),
        "stage2": ref.moe_stage2_reference(c0["a"], c0["plan"], c0["weights"]["w2"])}
    return copies, wants


REPS = int(os.environ.get("REPS", "3"))
for setup_name, setup in (("bench", lambda: stage_setup(1, 3)), ("report", report_setup)):
    copies, wants = setup()
    for rep in range(REPS):
        for steps in (0, None):
            moe.PDL_STEPS = steps
            for evict in ((False, True), (False, False), (True, True)):
                moe.FP4_MMA_EVICT_FIRST = evict
                for stage in ("stage1", "stage2"):
                    if stage == "stage1" and evict == (False, False):
                        continue  # stage 1 is the same kernel in the first two
                    row(copies, wants, stage, setup=setup_name, evict=str(evict), pdl=steps,
                        rep=rep)
    moe.FP4_MMA_EVICT_FIRST, moe.PDL_STEPS = (False, True), 0
    del copies, wants
    torch.cuda.empty_cache()
dump("moe_evict.json")
