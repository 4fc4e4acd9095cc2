"""Offline (no GPU): the MXFP4 stage kernels at K3 tp 1, prepared activations, as sm_90 SASS from
the installed Triton (the H200's is 3.6: PYTHONPATH=/tmp/t36), for each E2M1 decode of
kernels/mxfp4_mma._mma_ptx, with PLAN_ONE_TRIP on and off, at the (2, 2, 1) tiles (TILES
overrides) or the launchers' own (TILES=auto): registers (128 or fewer: 4 programs an SM), the K
loop's instruction count, where in the loop its 16 weight loads (LDG.E.128) sit, and whether the
plan's loads come before the validity branch (one round trip) or not.

    PYTHONPATH=/tmp/t36 python3 benchmarks/session9/aot_loads.py

Each (decode, ONE_TRIP) pair compiles in its own process: MMA_PTX is read at the first compile.
"""

import os
import subprocess
import sys

CHILD = r"""
import os, sys
sys.path.insert(0, "benchmarks/next")
import triton.language as tl
import aot_moe
from k3lab.kernels import moe, mxfp4_mma
decode, trip, tiles = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
mxfp4_mma.MMA_PTX = tl.constexpr(mxfp4_mma._mma_ptx(decode))
moe.FP4_MMA_TILES = None if tiles == "auto" else eval(tiles)
moe.PLAN_ONE_TRIP = trip
for name, kernel, _grid, args, kwargs in aot_moe.capture(d=3584, i=3072):
    kw = dict(kwargs)
    kw["FP4"] |= 1 | moe._MMA_XP  # inline PTX, as on the GPU; prepared x, as moe_block runs it
    sass, res = aot_moe.sass_of(aot_moe.compile_captured(kernel, args, kw))
    rows = aot_moe.parse_sass(sass)
    lo, hi = max(aot_moe.loop_bodies(sass), key=lambda b: b[1] - b[0])
    body = [r for r in rows if lo <= r[0] <= hi]
    loads = [i for i, r in enumerate(body) if r[1].startswith("LDG.E.128")]
    first_exit = next(r[0] for r in rows if "EXIT" in r[1])
    plan = sum(1 for r in rows if r[1].startswith("LDG") and r[0] < first_exit)
    print(f"{decode:10s} one_trip={int(trip)} {name}: {res.split()[0]}, loop {len(body)} "
          f"instructions, weight/x loads at {loads}, {plan} plan loads before the first exit")
"""

tiles = os.environ.get("TILES", "{1: (2, 2, 1), 2: (2, 2, 1)}")
for decode in ("byte_shift", "select"):
    for trip in ("1", "0"):
        subprocess.run([sys.executable, "-c", CHILD, decode, trip, tiles], check=True)
