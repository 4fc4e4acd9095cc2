"""H200, issue 4 (session 7): tile variants of the tensor-core MXFP4 stages
(kmoe.FP4_MMA_TILES and FP4_MMA_PERSISTENT) against the auto rule,
K3 B1, graph replay, cold copies, tp 1 and tp 8.

Each row: median graph us, fraction of the copy bandwidth on the stage's bytes (the report's
metric), and correctness against the fp32 reference at the tests' tolerances. Run from the repo
root: SWEEP=call5 python3 benchmarks/session7/moe_tiles_sweep.py

Calls 1-3 tried options that were reverted after them; their code is in the commits named:
- call 1 at c4ac329 (then moe_pipe_sweep.py): a fifth tile entry, the K loop's pipeline stages
  (tl.range num_stages), reverted by ef2e2f6;
- call 2 at cc1d28c: a fifth tile entry, the mma dependency chains a block (1 or 2);
- call 3 at 63cc6a8: FP4_MMA_PERSISTENT, persistent runs of tiles.
Call 5 timed HEAD's tiles (R, WARPS_K, prefetch[, split]) three times: SWEEP=call5.
"""

import importlib
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, gt, rec  # noqa: E402
from moe_stages import check_stage, stage_setup  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402

moe = importlib.import_module("k3lab.kernels.moe")
T0 = time.time()
BUDGET_S = float(os.environ.get("BUDGET_S", "200"))
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)

# variant: FP4_MMA_TILES ({stage: (R, WARPS_K, prefetch[, split])}; None: the auto rule) or a
# dict of kernels/moe.py knobs. Call 2 (at cc1d28c) had a fifth tile entry, the mma chains.
CALLS = {
    "call2": {
        "auto": None,
        "chains2": {1: (2, 1, 1, 1, 2), 2: (2, 2, 1, 1, 2)},
        "chains2-wk2/wk1": {1: (2, 2, 1, 1, 2), 2: (2, 1, 1, 1, 2)},
        "chains2-pf0": {1: (2, 1, 0, 1, 2), 2: (2, 2, 0, 1, 2)},
        "auto-again": None,
        "chains2-again": {1: (2, 1, 1, 1, 2), 2: (2, 2, 1, 1, 2)},
    },
    "call3": {  # persistent runs of tiles (FP4_MMA_PERSISTENT programs an SM)
        "auto": None,
        "P4-wk2/wk2": dict(FP4_MMA_PERSISTENT=4, FP4_MMA_TILES={1: (2, 2, 1), 2: (2, 2, 1)}),
        "P4-wk2/wk1": dict(FP4_MMA_PERSISTENT=4, FP4_MMA_TILES={1: (2, 2, 1), 2: (2, 1, 1)}),
        "P4-wk4/r1wk1": dict(FP4_MMA_PERSISTENT=4, FP4_MMA_TILES={1: (2, 4, 1), 2: (1, 1, 1)}),
        "P4-pf0": dict(FP4_MMA_PERSISTENT=4, FP4_MMA_TILES={1: (2, 2, 0), 2: (2, 2, 0)}),
        "P3-wk2/wk1": dict(FP4_MMA_PERSISTENT=3, FP4_MMA_TILES={1: (2, 2, 1), 2: (2, 1, 1)}),
        "P4-wk2/wk2-pf2": dict(FP4_MMA_PERSISTENT=4, FP4_MMA_TILES={1: (2, 2, 2), 2: (2, 2, 2)}),
        "auto-again": None,
        "P4-wk2/wk2-again": dict(FP4_MMA_PERSISTENT=4,
                                 FP4_MMA_TILES={1: (2, 2, 1), 2: (2, 2, 1)}),
    },
    "call5": {"auto": None, "auto-again": None, "auto-third": None},  # HEAD's tiles, thrice
}
TP8 = {"call2": ("auto", "chains2"), "call3": ("auto", "P4-wk2/wk2", "P4-wk2/wk1",
                                               "P4-wk4/r1wk1"), "call5": ("auto", "auto-again")}
KNOBS = {"FP4_MMA_TILES": None}  # call 3 also set FP4_MMA_PERSISTENT (63cc6a8 only)
SWEEP = os.environ.get("SWEEP", "call5")
VARIANTS = CALLS[SWEEP]


def set_knobs(knobs):
    """KNOBS overridden by a variant (FP4_MMA_TILES alone, or a dict of knobs)."""
    knobs = knobs if isinstance(knobs, dict) and "FP4_MMA_TILES" in knobs else {
        "FP4_MMA_TILES": knobs}
    for k, v in {**KNOBS, **knobs}.items():
        if not hasattr(moe, k):
            raise SystemExit(f"kernels/moe.py has no {k} in this checkout: see the docstring "
                             "for the commit its call ran at")
        setattr(moe, k, v)


def run(tp, names, n_copies):
    copies, wants = stage_setup(tp, n_copies)
    c0 = copies[0]
    for name in names:
        if time.time() - T0 > BUDGET_S:
            print("SKIP (time budget)", tp, name, flush=True)
            continue
        set_knobs(VARIANTS[name])
        for stage in ("stage1", "stage2"):
            fn = MB.stage_fns(stage)["fused"]
            nbytes = MB.stage_bytes(stage, c0)
            try:
                ok, err, _ = check_stage(stage, fn, c0, wants[stage])
                us = gt(fn, copies, repeats=10)
                rec(k="moe_tiles", tp=tp, stage=stage, variant=name, us=round(us, 2),
                    frac=round(nbytes / bw * 1e6 / us, 3), ok=ok, max_err=err,
                    t=round(time.time() - T0, 1))
            except Exception:
                traceback.print_exc()
                rec(k="moe_tiles", tp=tp, stage=stage, variant=name, us=float("nan"), ok=False)
        set_knobs(None)
    del copies, c0
    torch.cuda.empty_cache()


for args in ((1, list(VARIANTS), 3), (8, TP8[SWEEP], 8)):
    try:
        run(*args)
    except Exception:
        traceback.print_exc()
    dump(f"moe_tiles_{SWEEP}.json")
print("done", round(time.time() - T0, 1), flush=True)
