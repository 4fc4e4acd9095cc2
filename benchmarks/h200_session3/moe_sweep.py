"""H200 session 3, issue 4: MXFP4 expert stages at K3 tp 1 (and tp 8), graph, cold weights.

Hypotheses tested (each variant = module constants of k3lab.kernels.moe, set before the call):
- default: the in-register MXFP4 decode (3 integer ops an element), 32-row tiles, 4 warps.
- fma-kstep2: the same decode with half the K step (FP4_BUDGET_FACTOR 2): stage 1's 1792-byte
  rows then split into 7 whole steps instead of 3.5 (no masked half step of ALU work).
- fp16*: the fp16-pair register decode (FP4_DECODE_FP16: ~1.9 integer ops an element instead of
  2.9, plus an fp16 -> fp32 conversion), at the default tiles, half the K step, and 64 rows with
  8 warps.
- dot-*: MXFP4 through the tensor cores (FP4_DOT: tl.dot_scaled e2m1 x bf16, tokens padded to 16
  columns), the decode moved to Triton's upcast and the loads software-pipelined
  (FP4_DOT_STAGES); rows / bytes per K step / stages / warps / program target varied.
- bf16 default as the control (reached ~1.0 of the copy bandwidth last session).
tp 1 uses 48 experts (the same bytes per selected expert as K3's 896; 3 copies rotate through
different experts, so every call reads cold weights), as benchmarks/h200_tuning/sweep1_knobs.py.
Each row: median graph us, copy fraction on the stage's bytes (expert weights + activations),
per-kernel durations of one call, and correctness vs the fp32 reference on the dequantized
codes (the CPU tests' tolerances), recorded as ok / max error, never raised.
Run from the repo root: python3 benchmarks/h200_session3/moe_sweep.py
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
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)

KNOBS = ("FP4_DECODE_FP16", "FP4_DOT", "FP4_DOT_ROWS", "FP4_DOT_BYTES", "FP4_DOT_STAGES",
         "FP4_DOT_WARPS", "MAX_ROWS_FP4", "FP4_BUDGET_FACTOR", "NUM_WARPS", "TARGET_PROGRAMS")
DEFAULTS = {k: getattr(moe, k) for k in KNOBS}


def dot(rows, nbytes, stages, warps, target=528):
    return dict(FP4_DOT=True, FP4_DOT_ROWS=rows, FP4_DOT_BYTES=nbytes, FP4_DOT_STAGES=stages,
                FP4_DOT_WARPS=warps, TARGET_PROGRAMS=target)


TP1_VARIANTS = {
    "default": {},
    "fma-kstep2": dict(FP4_BUDGET_FACTOR=2),
    "fp16": dict(FP4_DECODE_FP16=True),
    "fp16-kstep2": dict(FP4_DECODE_FP16=True, FP4_BUDGET_FACTOR=2),
    "fp16-r64-w8": dict(FP4_DECODE_FP16=True, MAX_ROWS_FP4=64, NUM_WARPS=8),
    "dot-r64-b128-s4-w4": dot(64, 128, 4, 4),
    "dot-r32-b128-s4-w4": dot(32, 128, 4, 4),
    "dot-r64-b256-s3-w4": dot(64, 256, 3, 4),
    "dot-r128-b128-s3-w8-t264": dot(128, 128, 3, 8, 264),
}
TP8_VARIANTS = ("default", "fp16", "dot-r64-b128-s4-w4", "dot-r32-b128-s4-w4")
# |got - want| <= ATOL + RTOL * |want| (tests/test_moe.py)
TOL = {"stage1": (1e-3, 2 ** -8), "stage2": (2e-5, 1e-5)}


def setknobs(knobs):
    for k in KNOBS:
        setattr(moe, k, knobs.get(k, DEFAULTS[k]))


def check(stage, fn, inp, want):
    """(ok, max abs error) of one call on inp against want (fp32)."""
    try:
        if stage == "stage2":
            inp["plan"].out.zero_()
        got = fn(inp).float()
        atol, rtol = TOL[stage]
        err = (got - want).abs()
        ok = bool((err <= atol + rtol * want.abs()).all()) and bool(torch.isfinite(got).all())
        return ok, float(err.max())
    except Exception as e:
        print("CHECK ERR", repr(e)[:300], flush=True)
        return False, float("nan")


def run(tp, fmt, variants, n_copies):
    cfg = preset("kimi-k3", tp)
    if tp == 1:
        cfg = dataclasses.replace(cfg, n_experts=48)
    base = MB.make_inputs(cfg, "cuda", 0, M=1, expert_format=fmt)
    copies = [MB.stage_inputs(c) for c in MB.copies_sharing_experts(base, n_copies)]
    c0 = copies[0]
    for stage in ("stage1", "stage2"):
        fns = MB.stage_fns(stage)
        nbytes = MB.stage_bytes(stage, c0)
        if stage == "stage1":
            want = ref.moe_stage1_reference(c0["z"], c0["plan"], c0["weights"]["w13"],
                                            activation=cfg.activation, situ_beta=cfg.situ_beta,
                                            situ_linear_beta=cfg.situ_linear_beta)
        else:
            want = ref.moe_stage2_reference(c0["a"], c0["plan"], c0["weights"]["w2"])
        for name in variants:
            setknobs(TP1_VARIANTS[name])
            try:
                ok, err = check(stage, fns["fused"], c0, want)
                us = gt(fns["fused"], copies, repeats=10)
                rec(k="moe", tp=tp, fmt=fmt, stage=stage, variant=name, us=us,
                    frac=nbytes / bw * 1e6 / us, ok=ok, max_err=err, mb=nbytes / 1e6,
                    dur=kdur(fns["fused"], c0), t=round(time.time() - T0, 1))
            except Exception:
                traceback.print_exc()
                rec(k="moe", tp=tp, fmt=fmt, stage=stage, variant=name, us=float("nan"),
                    ok=False)
            setknobs({})
    del copies, base, c0
    torch.cuda.empty_cache()
    dump("moe_sweep.json")


run(1, "mxfp4", list(TP1_VARIANTS), 3)
run(1, "bf16", ["default"], 3)
run(8, "mxfp4", TP8_VARIANTS, 8)
dump("moe_sweep.json")
print("done", round(time.time() - T0, 1), flush=True)
