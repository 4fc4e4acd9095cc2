"""H200, issue 4 (session 10, call 3): which launches of moe_block take programmatic dependent
launch. Call 2 found stage 1 with PDL after the front launch 5 us slower in the block (tp 1),
though faster back to back; stage 2 and the tail apart with PDL faster at tp 8.

moe_block with routing, tp 1 and tp 8, graph, cold copies, median of 10, checked against the fp32
truth; VARIANTS (fuse_tail, PDL on, PDL_BLOCK_STAGE1, PDL_FRONT_TRIGGER, PDL_STAGE1_TRIGGER),
interleaved, twice. Then the stages back to back (as moe_pdl.py) once more.

    python3 benchmarks/session10/moe_pdl3.py        # writes $OUT/moe_pdl3.json
"""

import sys
import time

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
sys.path.insert(0, "benchmarks/session10")
from common import bw, dump  # noqa: E402
from moe_pdl import block_copies, block_row, row, setup  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.kernels import moe  # noqa: E402

VARIANTS = {  # fuse_tail, pdl, block stage 1, front trigger, stage-1 trigger
    "fused_off": (True, False, False, False, False),
    "fused_s1": (True, True, True, False, False),
    "fused_front_s1": (True, True, True, True, False),
    "apart_s2tail": (False, True, False, False, False),
    "apart_s1trig_s2tail": (False, True, False, False, True),
    "apart_all": (False, True, True, False, False),
    "apart_front_all": (False, True, True, True, False),
}
T0 = time.time()
for tp in (1, 8):
    copies = block_copies(tp)
    for rep in range(2):
        for name, (fuse, pdl, s1, front, s1trig) in VARIANTS.items():
            MB.FUSE_TAIL = fuse
            moe.PDL_STEPS = 2 if pdl else None
            moe.PDL_BLOCK_STAGE1, moe.PDL_FRONT_TRIGGER, moe.PDL_STAGE1_TRIGGER = s1, front, s1trig
            block_row(copies, tp=tp, variant=name, rep=rep)
    del copies
    torch.cuda.empty_cache()
MB.FUSE_TAIL = True
moe.PDL_BLOCK_STAGE1, moe.PDL_FRONT_TRIGGER, moe.PDL_STAGE1_TRIGGER = True, False, False
copies, wants = setup()
for steps in (None, 2, None, 2):
    moe.PDL_STEPS = steps
    row(copies, wants, pdl="off" if steps is None else steps, latent=3584, rep=0)
print(f"copy bw {bw / 1e12:.3f} TB/s")
dump("moe_pdl3.json")
print("done", round(time.time() - T0, 1), flush=True)
