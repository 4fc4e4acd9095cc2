"""H200, issue 4 (session 9): the MXFP4 tensor-core stages under each E2M1 decode of
kernels/mxfp4_mma._mma_ptx (DECODE=select: three masks a word and one bit-select LOP3 a code pair,
the right shifts as RS=mul.hi or RS=shr; DECODE=byte_shift: session 8's), set before the first
compile, so each decode is its own process; within one, the stage tiles named in ORDER (keys of
TILES; FP4_MMA_TILES (R, WARPS_K, prefetch) per stage; a ":twotrip" suffix: kernels/moe.py's
PLAN_ONE_TRIP off), interleaved. Call 3 ran this script at 97eb11c, whose ":novol" suffix turned
off that commit's volatile plan loads (PLAN_LOADS_VOLATILE, since replaced by PLAN_ONE_TRIP).
K3 B1, tp 1 (48 experts, 3 cold copies of 16), prepared activations (the stage APIs' z_mma /
a_mma, as moe_block runs them), graph replay, median of 10.

Each row: median graph us, fraction of the copy bandwidth on the stage's bytes (the report's
metric), correctness against the fp32 reference at the tests' tolerances. From the repo root:
    DECODE=select RS=shr RUN=a ORDER="auto s1wk2 auto s1wk2" \
        python3 benchmarks/session9/moe_decode.py            # writes $OUT/moe_decode_<tag>.json
Call 1 ran the default ORDER; call 2 the ORDER in benchmarks/session9/README.md.
"""

import os
import sys
import time
import traceback

import triton.language as tl

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, gt, rec  # noqa: E402
from moe_stages import check_stage, stage_setup  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.kernels import moe, mxfp4_mma  # noqa: E402

DECODE, RS = os.environ.get("DECODE", "select"), os.environ.get("RS", "mul.hi")
TAG = f"{DECODE}_{RS.replace('.', '')}" + os.environ.get("RUN", "")
mxfp4_mma.MMA_PTX = tl.constexpr(mxfp4_mma._mma_ptx(DECODE, RS))
TILES = {"auto": None, "s1wk1": {1: (2, 1, 1), 2: (2, 2, 1)}, "s1wk2": {1: (2, 2, 1), 2: (2, 2, 1)},
         "s2wk4": {1: (2, 1, 1), 2: (2, 4, 1)},
         "s2pf2": {1: (2, 1, 1), 2: (2, 2, 2)}, "s2pf0": {1: (2, 1, 1), 2: (2, 2, 0)},
         "s2r1": {1: (2, 1, 1), 2: (1, 1, 1)}, "s2r1wk2": {1: (2, 1, 1), 2: (1, 2, 1)},
         "s2wk1": {1: (2, 1, 1), 2: (2, 1, 1)}}
ORDER = tuple(os.environ.get("ORDER", "auto s1wk2 s2wk4 auto s1wk2 s2wk4").split())
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s, {TAG}", flush=True)

copies, wants = stage_setup(1, 3)
for name in ORDER:  # "tiles" or "tiles:twotrip" (kernels/moe.PLAN_ONE_TRIP off)
    tiles, _, trip = name.partition(":")
    moe.FP4_MMA_TILES = TILES[tiles]
    moe.PLAN_ONE_TRIP = trip != "twotrip"
    for stage in ("stage1", "stage2"):
        fn = MB.stage_fns(stage)["fused"]
        nbytes = MB.stage_bytes(stage, copies[0])
        try:
            ok, err, _ = check_stage(stage, fn, copies[0], wants[stage])
            us = gt(fn, copies, repeats=10)
            rec(k="moe_decode", tag=TAG, decode=DECODE, rs=RS, tiles=name, stage=stage,
                us=round(us, 2), frac=round(nbytes / bw * 1e6 / us, 3), ok=ok, max_err=err,
                t=round(time.time() - T0, 1))
        except Exception:
            traceback.print_exc()
            rec(k="moe_decode", tag=TAG, tiles=name, stage=stage, us=float("nan"), ok=False)
moe.FP4_MMA_TILES, moe.PLAN_ONE_TRIP = None, True
dump(f"moe_decode_{TAG}.json")
print("done", round(time.time() - T0, 1), flush=True)
