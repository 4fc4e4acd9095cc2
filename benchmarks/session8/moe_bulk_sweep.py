"""H200, issue 4 (session 8, call 2 at 6fce6a6): the MXFP4 tensor-core stages with the
whole-row bulk L2 prefetch (kernels/moe.py FP4_MMA_BULK_PREFETCH, at 6fce6a6 only: slower,
reverted) against the tiles of the auto rule, K3 B1, graph replay, cold
copies; tp 1: 48 experts, 3 copies of 16; tp 8: 8 copies.

Each row: median graph us, fraction of the copy bandwidth on the stage's bytes (the report's
metric), correctness against the fp32 reference at the tests' tolerances. From the repo root:
    python3 benchmarks/session8/moe_bulk_sweep.py          # writes $OUT/moe_bulk.json
"""

import sys
import time
import traceback

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, gt, rec  # noqa: E402
from moe_stages import check_stage, stage_setup  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.kernels import moe  # noqa: E402

if not hasattr(moe, "FP4_MMA_BULK_PREFETCH"):
    raise SystemExit("kernels/moe.py has no FP4_MMA_BULK_PREFETCH in this checkout: check out "
                     "6fce6a6")
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)
AUTO = {"FP4_MMA_TILES": None, "FP4_MMA_BULK_PREFETCH": {1: False, 2: False}}
BULK = {1: True, 2: True}
# tp 1 tiles of the auto rule: stage 1 (2, 1, 1), stage 2 (2, 2, 1)
VARIANTS = {
    "auto": {},
    "bulk": {"FP4_MMA_BULK_PREFETCH": BULK},
    "bulk-pf0": {"FP4_MMA_BULK_PREFETCH": BULK, "FP4_MMA_TILES": {1: (2, 1, 0), 2: (2, 2, 0)}},
    "auto-again": {},
    "bulk-again": {"FP4_MMA_BULK_PREFETCH": BULK},
    "bulk-pf0-again": {"FP4_MMA_BULK_PREFETCH": BULK,
                       "FP4_MMA_TILES": {1: (2, 1, 0), 2: (2, 2, 0)}},
}
TP8 = ("auto", "bulk", "bulk-pf0")


def run(tp, names, n_copies):
    copies, wants = stage_setup(tp, n_copies)
    c0 = copies[0]
    for name in names:
        for k, v in {**AUTO, **VARIANTS[name]}.items():
            setattr(moe, k, v)
        for stage in ("stage1", "stage2"):
            fn = MB.stage_fns(stage)["fused"]
            nbytes = MB.stage_bytes(stage, c0)
            try:
                ok, err, _ = check_stage(stage, fn, c0, wants[stage])
                us = gt(fn, copies, repeats=10)
                rec(k="moe_bulk", tp=tp, stage=stage, variant=name, us=round(us, 2),
                    frac=round(nbytes / bw * 1e6 / us, 3), ok=ok, max_err=err,
                    t=round(time.time() - T0, 1))
            except Exception:
                traceback.print_exc()
                rec(k="moe_bulk", tp=tp, stage=stage, variant=name, us=float("nan"), ok=False)
    for k, v in AUTO.items():
        setattr(moe, k, v)
    del copies, c0
    torch.cuda.empty_cache()


for args in ((1, list(VARIANTS), 3), (8, TP8, 8)):
    try:
        run(*args)
    except Exception:
        traceback.print_exc()
    dump("moe_bulk.json")
print("done", round(time.time() - T0, 1), flush=True)
