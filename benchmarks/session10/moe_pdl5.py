"""H200, issue 4 (session 10, call 9): HEAD's PDL configuration (PDL_STEPS 0; moe_block: the
front lets stage 1 go as it starts, stage 1 with PDL; stage 2 and the tail with PDL when apart)
against no PDL at all, in the block (with routing, tp 1 and tp 8) and per stage back to back
(tp 1), interleaved; graph, cold copies, median of 10, checked against the fp32 truth.

    python3 benchmarks/session10/moe_pdl5.py        # writes $OUT/moe_pdl5.json
"""

import dataclasses
import sys
import time

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
sys.path.insert(0, "benchmarks/session10")
from common import bw, dump, gt, rec  # noqa: E402
from moe_pdl import row, setup  # noqa: E402

from k3lab import profile  # noqa: E402
from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.config import preset  # noqa: E402
from k3lab.kernels import moe  # noqa: E402

T0 = time.time()
for tp in (1, 8):
    cfg = preset("kimi-k3", tp)
    if tp == 1:
        cfg = dataclasses.replace(cfg, n_experts=48)
    base = MB.make_inputs(cfg, "cuda", 0, M=1, expert_format="mxfp4", route=True)
    copies = MB.copies_sharing_experts(base, 3 if tp == 1 else 4)
    for rep in range(2):
        for fuse in (True, False):
            for steps in (None, 0):
                MB.FUSE_TAIL, moe.PDL_STEPS = fuse, steps
                err = MB.check(MB._fused(copies[0]), None, copies[0])["out"]
                launches = profile.count_launches(MB._fused, copies[0]).count
                us = gt(MB._fused, copies, repeats=10)
                rec(k="moe_pdl_block", us=round(us, 2), err=err, launches=launches, tp=tp,
                    fuse_tail=fuse, pdl="off" if steps is None else steps, rep=rep,
                    t=round(time.time() - T0, 1))
    del base, copies
    torch.cuda.empty_cache()
MB.FUSE_TAIL = True
copies, wants = setup()
for rep in range(3):
    for steps in (None, 0):
        moe.PDL_STEPS = steps
        row(copies, wants, pdl="off" if steps is None else steps, latent=3584, rep=rep)
moe.PDL_STEPS = 0
print(f"copy bw {bw / 1e12:.3f} TB/s")
dump("moe_pdl5.json")
print("done", round(time.time() - T0, 1), flush=True)
