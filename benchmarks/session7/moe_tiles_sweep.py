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

import dataclasses
import importlib
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, gt, rec  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.config import preset  # noqa: E402
from k3lab.reference import moe as ref  # noqa: E402

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
KNOBS = {"FP4_MMA_TILES": None, "FP4_MMA_PERSISTENT": 0}
SWEEP = os.environ.get("SWEEP", "call5")
VARIANTS = CALLS[SWEEP]
TOL = {"stage1": (1e-3, 2 ** -8), "stage2": (2e-5, 1e-5)}  # tests/test_moe.py A_ / Y_


def check(stage, fn, inp, want):
    if stage == "stage2":
        inp["plan"].out.zero_()
    got = fn(inp).float()
    atol, rtol = TOL[stage]
    err = (got - want).abs()
    ok = bool((err <= atol + rtol * want.abs()).all()) and bool(torch.isfinite(got).all())
    return ok, float(err.max())


def run(tp, names, n_copies):
    cfg = preset("kimi-k3", tp)
    if tp == 1:
        cfg = dataclasses.replace(cfg, n_experts=48)  # 3 rotated copies of 16 experts
    base = MB.make_inputs(cfg, "cuda", 0, M=1, expert_format="mxfp4")
    copies = [MB.stage_inputs(c) for c in MB.copies_sharing_experts(base, n_copies)]
    c0 = copies[0]
    wants = {"stage1": ref.moe_stage1_reference(
        c0["z"], c0["plan"], c0["weights"]["w13"], activation=cfg.activation,
        situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta),
        "stage2": ref.moe_stage2_reference(c0["a"], c0["plan"], c0["weights"]["w2"])}
    for name in names:
        if time.time() - T0 > BUDGET_S:
            print("SKIP (time budget)", tp, name, flush=True)
            continue
        knobs = VARIANTS[name]
        knobs = knobs if isinstance(knobs, dict) and "FP4_MMA_TILES" in knobs else {
            "FP4_MMA_TILES": knobs}
        for k, v in {**{k: v for k, v in KNOBS.items() if hasattr(moe, k)}, **knobs}.items():
            if not hasattr(moe, k):
                raise SystemExit(f"kernels/moe.py has no {k} in this checkout: call 3 ran at "
                                 "63cc6a8 (see the docstring)")
            setattr(moe, k, v)
        for stage in ("stage1", "stage2"):
            fn = MB.stage_fns(stage)["fused"]
            nbytes = MB.stage_bytes(stage, c0)
            try:
                ok, err = check(stage, fn, c0, wants[stage])
                us = gt(fn, copies, repeats=10)
                rec(k="moe_tiles", tp=tp, stage=stage, variant=name, us=round(us, 2),
                    frac=round(nbytes / bw * 1e6 / us, 3), ok=ok, max_err=err,
                    t=round(time.time() - T0, 1))
            except Exception:
                traceback.print_exc()
                rec(k="moe_tiles", tp=tp, stage=stage, variant=name, us=float("nan"), ok=False)
        for k, v in KNOBS.items():
            if hasattr(moe, k):
                setattr(moe, k, v)
    del copies, base, c0
    torch.cuda.empty_cache()


for args in ((1, list(VARIANTS), 3), (8, TP8[SWEEP], 8)):
    try:
        run(*args)
    except Exception:
        traceback.print_exc()
    dump(f"moe_tiles_{SWEEP}.json")
print("done", round(time.time() - T0, 1), flush=True)
