"""H200, issue 4 (session 8, call 1 at 95d23d7): the MXFP4 tensor-core stages with and without
the unmasked full tiles (kernels/moe.py FP4_MMA_EVEN, at 95d23d7 only: slower, reverted), under
the byte-shift decode (SHR8=1, HEAD's) or the previous one (SHR8=0:
kernels/mxfp4_mma._mma_ptx(False) at 95d23d7, _mma_ptx("shift") since session 9, set before the
first compile, so each decode is its own process). K3 B1, graph replay, cold copies; tp 1: 48
experts, 3 copies of 16.

Each row: median graph us, fraction of the copy bandwidth on the stage's bytes (the report's
metric), correctness against the fp32 reference at the tests' tolerances. From the repo root:
    SHR8=1 python3 benchmarks/session8/moe_even_sweep.py      # writes $OUT/moe_even_shr8<1|0>.json
"""

import os
import sys
import time
import traceback

import torch
import triton.language as tl

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, gt, rec  # noqa: E402
from moe_stages import check_stage, stage_setup  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.kernels import moe, mxfp4_mma  # noqa: E402

if not hasattr(moe, "FP4_MMA_EVEN"):
    raise SystemExit("kernels/moe.py has no FP4_MMA_EVEN in this checkout: check out 95d23d7")
SHR8 = os.environ.get("SHR8", "1") == "1"
if not SHR8:
    mxfp4_mma.MMA_PTX = tl.constexpr(mxfp4_mma._mma_ptx("shift"))
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s, SHR8 {SHR8}", flush=True)
# EVEN on and off, interleaved, twice at tp 1; once each at tp 8 (where no tile is even)
ORDER = {1: (True, False, True, False), 8: (True,)}


def run(tp, n_copies):
    copies, wants = stage_setup(tp, n_copies)
    c0 = copies[0]
    for even in ORDER[tp]:
        moe.FP4_MMA_EVEN = even
        for stage in ("stage1", "stage2"):
            fn = MB.stage_fns(stage)["fused"]
            nbytes = MB.stage_bytes(stage, c0)
            try:
                ok, err, _ = check_stage(stage, fn, c0, wants[stage])
                us = gt(fn, copies, repeats=10)
                rec(k="moe_even", tp=tp, stage=stage, shr8=SHR8, even=even, us=round(us, 2),
                    frac=round(nbytes / bw * 1e6 / us, 3), ok=ok, max_err=err,
                    t=round(time.time() - T0, 1))
            except Exception:
                traceback.print_exc()
                rec(k="moe_even", tp=tp, stage=stage, shr8=SHR8, even=even, us=float("nan"),
                    ok=False)
    moe.FP4_MMA_EVEN = True
    del copies, c0
    torch.cuda.empty_cache()


for args in ((1, 3), (8, 8)):
    try:
        run(*args)
    except Exception:
        traceback.print_exc()
    dump(f"moe_even_shr8{int(SHR8)}.json")
print("done", round(time.time() - T0, 1), flush=True)
