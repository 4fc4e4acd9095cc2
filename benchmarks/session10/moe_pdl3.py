"""H200, issue 4 (session 10, call 3): which launches of moe_block take programmatic dependent
launch. Call 2 found stage 1 with PDL after the front launch 5 us slower in the block (tp 1),
though faster back to back; stage 2 and the tail apart with PDL faster at tp 8.

moe_block with routing, tp 1 and tp 8, graph, cold copies, median of 10, checked against the fp32
truth; VARIANTS (fuse_tail, PDL on, PDL_BLOCK_STAGE1, PDL_FRONT_TRIGGER, PDL_STAGE1_TRIGGER),
interleaved, twice. Then the stages back to back (as moe_pdl.py) once more.

    python3 benchmarks/session10/moe_pdl3.py        # writes $OUT/moe_pdl3.json
"""

import dataclasses
import sys
import time
import traceback

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
sys.path.insert(0, "benchmarks/session10")
from common import bw, dump, gt, rec  # noqa: E402
from moe_pdl import row, setup  # noqa: E402

from k3lab import profile  # noqa: E402
from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.config import preset  # noqa: E402
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
    cfg = preset("kimi-k3", tp)
    if tp == 1:
        cfg = dataclasses.replace(cfg, n_experts=48)
    base = MB.make_inputs(cfg, "cuda", 0, M=1, expert_format="mxfp4", route=True)
    copies = MB.copies_sharing_experts(base, 3 if tp == 1 else 4)
    for rep in range(2):
        for name, (fuse, pdl, s1, front, s1trig) in VARIANTS.items():
            MB.FUSE_TAIL = fuse
            moe.PDL_STEPS = 2 if pdl else None
            moe.PDL_BLOCK_STAGE1, moe.PDL_FRONT_TRIGGER, moe.PDL_STAGE1_TRIGGER = s1, front, s1trig
            tags = dict(tp=tp, variant=name, rep=rep)
            try:
                err = MB.check(MB._fused(copies[0]), None, copies[0])["out"]
                launches = profile.count_launches(MB._fused, copies[0]).count
                us = gt(MB._fused, copies, repeats=10)
                rec(k="moe_pdl_block", us=round(us, 2), err=err, launches=launches,
                    t=round(time.time() - T0, 1), **tags)
            except Exception:
                traceback.print_exc()
                rec(k="moe_pdl_block", us=float("nan"), **tags)
    del base, copies
    torch.cuda.empty_cache()
MB.FUSE_TAIL = True
moe.PDL_STEPS, moe.PDL_BLOCK_STAGE1 = 2, True
moe.PDL_FRONT_TRIGGER = moe.PDL_STAGE1_TRIGGER = False
copies, wants = setup()
for steps in (None, 2, None, 2):
    moe.PDL_STEPS = steps
    row(copies, wants, pdl="off" if steps is None else steps, latent=3584, rep=0)
moe.PDL_STEPS = 2
print(f"copy bw {bw / 1e12:.3f} TB/s")
dump("moe_pdl3.json")
print("done", round(time.time() - T0, 1), flush=True)
