"""H200, issue 4 (session 5): kernels/moe.py's FP4_F16_PAIRS (codes i and i + 4 of a word as one
f16x2, packed HFMA2 products, inline PTX) against main's MXFP4 defaults, K3 B1, cold weights.

Why (benchmarks/session5/README.md): the memory side streams these bytes at 0.9-1.0 of copy
bandwidth in the kernels' tile patterns (stream_patterns.py), Nsight Compute shows the K-lane
stage kernels issuing on ~70 % of cycles, so instructions an element are what bound them; the
f16x2 decode takes stage 1's K loop from 5.12 to 4.07 instructions an element and stage 2's from
4.81 to 3.77 (offline sm_90 compile, Triton 3.6).

Each row: median graph us, fraction of copy bandwidth on the stage's bytes (the report's
metric), kernel durations, and correctness against the fp32 reference with the tests'
tolerances (tests/test_moe.py; F16_SCALE_ATOL for the f16 variants). tp 1 uses 48 experts (cold
copies rotate), as the session-4 sweeps. Run from the repo root (< 90 s):
    python3 benchmarks/session5/moe_f16_sweep.py
"""

import dataclasses
import importlib
import sys
import time
import traceback

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, gt, kdur, rec  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.config import preset  # noqa: E402
from k3lab.reference import moe as ref  # noqa: E402

moe = importlib.import_module("k3lab.kernels.moe")
if not hasattr(moe, "FP4_F16_PAIRS"):  # removed in session 6 (superseded by FP4_MMA)
    sys.exit("FP4_F16_PAIRS is gone from kernels/moe.py since session 6: run this sweep at 61628ac")
T0 = time.time()
TP1_BUDGET_S, TP8_BUDGET_S = 60, 85
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)

KNOBS = ("FP4_KLANE_WORDS", "FP4_KLANE_ROWS", "FP4_KLANE_STAGES", "FP4_FUSE_GATE_UP",
         "FP4_MAXNREG", "FP4_F16_PAIRS")
DEFAULTS = dict(FP4_KLANE_WORDS=64, FP4_KLANE_ROWS=64, FP4_KLANE_STAGES=(3, 0),
                FP4_FUSE_GATE_UP=True, FP4_MAXNREG=None, FP4_F16_PAIRS=False)  # main at 72be627
VARIANTS = {
    "main": {},
    "f16": dict(FP4_F16_PAIRS=True),
    "f16-st3": dict(FP4_F16_PAIRS=True, FP4_KLANE_STAGES=3),
    "f16-w32-st3": dict(FP4_F16_PAIRS=True, FP4_KLANE_WORDS=32, FP4_KLANE_STAGES=3),
    "f16-st4": dict(FP4_F16_PAIRS=True, FP4_KLANE_STAGES=4),
    "f16-nofuse-st3": dict(FP4_F16_PAIRS=True, FP4_FUSE_GATE_UP=False, FP4_KLANE_STAGES=3),
    "f16-r32-st3": dict(FP4_F16_PAIRS=True, FP4_KLANE_ROWS=32, FP4_KLANE_STAGES=3),
    "f16-st0": dict(FP4_F16_PAIRS=True, FP4_KLANE_STAGES=0),
}
TP8_VARIANTS = ("main", "f16", "f16-st3", "f16-w32-st3", "f16-st4")
TOL = {"stage1": (1e-3, 2 ** -8), "stage2": (2e-5, 1e-5)}  # tests/test_moe.py A_ / Y_
F16_SCALE_ATOL = 2 ** -9


def setknobs(knobs):
    for k in KNOBS:
        setattr(moe, k, knobs.get(k, DEFAULTS[k]))


def check(stage, fn, inp, want, f16):
    try:
        if stage == "stage2":
            inp["plan"].out.zero_()
        got = fn(inp).float()
        atol, rtol = TOL[stage]
        if f16:
            atol = max(atol, F16_SCALE_ATOL * want.abs().max().item())
        err = (got - want).abs()
        ok = bool((err <= atol + rtol * want.abs()).all()) and bool(torch.isfinite(got).all())
        return ok, float(err.max()), float(want.abs().max())
    except Exception as e:  # noqa: BLE001 - report and go on
        print("CHECK ERR", repr(e)[:300], flush=True)
        return False, float("nan"), float("nan")


def run(tp, variants, n_copies):
    cfg = preset("kimi-k3", tp)
    if tp == 1:
        cfg = dataclasses.replace(cfg, n_experts=48)
    base = MB.make_inputs(cfg, "cuda", 0, M=1, expert_format="mxfp4")
    copies = [MB.stage_inputs(c) for c in MB.copies_sharing_experts(base, n_copies)]
    c0 = copies[0]
    wants = {"stage1": ref.moe_stage1_reference(
        c0["z"], c0["plan"], c0["weights"]["w13"], activation=cfg.activation,
        situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta),
        "stage2": ref.moe_stage2_reference(c0["a"], c0["plan"], c0["weights"]["w2"])}
    for name in variants:
        if time.time() - T0 > (TP1_BUDGET_S if tp == 1 else TP8_BUDGET_S):
            print("SKIP (time budget)", tp, name, flush=True)
            continue
        for stage in ("stage1", "stage2"):
            fns = MB.stage_fns(stage)
            nbytes = MB.stage_bytes(stage, c0)
            setknobs(VARIANTS[name])
            try:
                ok, err, scale = check(stage, fns["fused"], c0, wants[stage],
                                       VARIANTS[name].get("FP4_F16_PAIRS", False))
                us = gt(fns["fused"], copies, repeats=10)
                rec(k="moe_f16", tp=tp, M=1, fmt="mxfp4", stage=stage, variant=name, us=us,
                    frac=nbytes / bw * 1e6 / us, ok=ok, max_err=err, max_ref=scale,
                    mb=nbytes / 1e6, dur=kdur(fns["fused"], c0), t=round(time.time() - T0, 1))
            except Exception:
                traceback.print_exc()
                rec(k="moe_f16", tp=tp, M=1, fmt="mxfp4", stage=stage, variant=name,
                    us=float("nan"), ok=False)
            setknobs({})
    del copies, base, c0
    torch.cuda.empty_cache()
    dump("moe_f16.json")


for args in ((1, list(VARIANTS), 3), (8, TP8_VARIANTS, 8)):
    try:
        run(*args)
    except Exception:
        traceback.print_exc()
dump("moe_f16.json")
print("done", round(time.time() - T0, 1), flush=True)
