"""H200, issue 4 (session 6): kernels/moe.py's FP4_MMA tensor-core tiles (kernels/mxfp4_mma.py)
against the K-lane tiles of main before them, K3 B1, cold weights, tp 1 and tp 8.

Each row: median graph us, fraction of copy bandwidth on the stage's bytes (the report's
metric), kernel durations, and correctness against the fp32 reference with the tests'
tolerances (tests/test_moe.py). tp 1 uses 48 experts (cold copies rotate), as the session-4 and
session-5 sweeps. Run from the repo root (< 90 s):
    python3 benchmarks/session6/moe_mma_sweep.py
"""

import importlib
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, gt, kdur, rec  # noqa: E402
from moe_stages import check_stage, stage_setup  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402

moe = importlib.import_module("k3lab.kernels.moe")
T0 = time.time()
TP1_BUDGET_S, TP8_BUDGET_S = 60, 85
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)

KNOBS = ("FP4_MMA", "FP4_MMA_TILES", "FP4_MAXNREG")
DEFAULTS = dict(FP4_MMA=True, FP4_MMA_TILES=None, FP4_MAXNREG=None)
# call 3 (session 6) ran the first eight with FP4_MMA_TILES {1: (2, 2, 1), 2: (2, 2, 1)} as
# "mma"; call 6 the auto tiles (None) and register caps
VARIANTS = {
    "mma-auto": {},
    "mma-auto-reg96": dict(FP4_MAXNREG=96),
    "mma-auto-reg80": dict(FP4_MAXNREG=80),
    "mma-s2wk4-reg96": dict(FP4_MAXNREG=96, FP4_MMA_TILES={1: (2, 1, 1), 2: (2, 4, 1)}),
    "mma-s1wk2-reg96": dict(FP4_MAXNREG=96, FP4_MMA_TILES={1: (2, 2, 1), 2: (2, 2, 1)}),
    "mma-auto-reg64": dict(FP4_MAXNREG=64),
    "klane": dict(FP4_MMA=False),  # main at 58b7c2f
    "mma": {},
    "mma-pf0": dict(FP4_MMA_TILES={1: (2, 2, 0), 2: (2, 2, 0)}),
    "mma-pf2": dict(FP4_MMA_TILES={1: (2, 2, 2), 2: (2, 2, 2)}),
    "mma-wk1": dict(FP4_MMA_TILES={1: (2, 1, 1), 2: (2, 1, 1)}),
    "mma-wk4": dict(FP4_MMA_TILES={1: (2, 4, 1), 2: (2, 4, 1)}),
    "mma-s2r1wk4": dict(FP4_MMA_TILES={1: (2, 2, 1), 2: (1, 4, 1)}),
    "mma-s2r1wk2": dict(FP4_MMA_TILES={1: (2, 2, 1), 2: (1, 2, 1)}),
}
# call 8: stage 2's K split over programs (the shares add in the atomics), stage 1 prefetch
CALL8 = {
    "s2-split2": dict(FP4_MMA_TILES={1: (2, 1, 0), 2: (2, 2, 1, 2)}),
    "s2-split4": dict(FP4_MMA_TILES={1: (2, 1, 2), 2: (2, 2, 1, 4)}),
    "s2-r2wk1-split2": dict(FP4_MMA_TILES={1: (2, 1, 1), 2: (2, 1, 1, 2)}),
    "s2-r2wk1-split4": dict(FP4_MMA_TILES={1: (2, 1, 1), 2: (2, 1, 1, 4)}),
    "s2-r4wk2-split2": dict(FP4_MMA_TILES={1: (2, 1, 1), 2: (4, 2, 1, 2)}),
    "s2-split3-pf0": dict(FP4_MMA_TILES={1: (2, 1, 1), 2: (2, 2, 0, 3)}),
    "tp8-s2-r2wk1-split2": dict(FP4_MMA_TILES={1: (2, 4, 1), 2: (2, 1, 1, 2)}),
    "tp8-s2-r1wk2-split2": dict(FP4_MMA_TILES={1: (2, 4, 0), 2: (1, 2, 1, 2)}),
}
VARIANTS.update(CALL8)
TP8_VARIANTS = ("mma-auto", "mma-auto-reg96", "mma-auto-reg80")
RUN = os.environ.get("SWEEP", "call6")
if RUN == "call8":
    TP8_VARIANTS = ("mma-auto", "tp8-s2-r2wk1-split2", "tp8-s2-r1wk2-split2")
# call 10: the plan's count, entries and expert loaded in one round trip (auto tiles, twice)
VARIANTS["mma-auto-again"] = {}
if RUN == "call10":
    TP8_VARIANTS = ("mma-auto", "mma-auto-again")


def setknobs(knobs):
    for k in KNOBS:
        setattr(moe, k, knobs.get(k, DEFAULTS[k]))


def run(tp, variants, n_copies):
    copies, wants = stage_setup(tp, n_copies)
    c0 = copies[0]
    for name in variants:
        if time.time() - T0 > (TP1_BUDGET_S if tp == 1 else TP8_BUDGET_S):
            print("SKIP (time budget)", tp, name, flush=True)
            continue
        for stage in ("stage1", "stage2"):
            fns = MB.stage_fns(stage)
            nbytes = MB.stage_bytes(stage, c0)
            setknobs(VARIANTS[name])
            try:
                ok, err, scale = check_stage(stage, fns["fused"], c0, wants[stage])
                us = gt(fns["fused"], copies, repeats=10)
                rec(k="moe_mma", tp=tp, M=1, fmt="mxfp4", stage=stage, variant=name, us=us,
                    frac=nbytes / bw * 1e6 / us, ok=ok, max_err=err, max_ref=scale,
                    mb=nbytes / 1e6, dur=kdur(fns["fused"], c0), t=round(time.time() - T0, 1))
            except Exception:
                traceback.print_exc()
                rec(k="moe_mma", tp=tp, M=1, fmt="mxfp4", stage=stage, variant=name,
                    us=float("nan"), ok=False)
            setknobs({})
    del copies, c0
    torch.cuda.empty_cache()
    dump("moe_mma.json")


TP1 = list(VARIANTS)[:6] if RUN == "call6" else (
    ["mma-auto"] + [k for k in CALL8 if not k.startswith("tp8")] if RUN == "call8" else
    ["mma-auto", "klane", "mma-auto-again"])
for args in ((1, TP1, 3), (8, TP8_VARIANTS, 8)):
    try:
        run(*args)
    except Exception:
        traceback.print_exc()
dump("moe_mma.json")
print("done", round(time.time() - T0, 1), flush=True)
