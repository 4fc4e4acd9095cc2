"""H200, issue 4: MXFP4 expert stages at K3 tp 1 (and tp 8), graph, cold weights: the default
MXFP4 tiles vs the opt-in K-lane tiles (kernels/moe.py FP4_LAYOUT = 1), side by side.

Hypotheses (benchmarks/next/MOE_MXFP4_ANALYSIS.md: the sm_90 SASS of Triton 3.6):
- default: [rows, groups, 4 words] tiles, lanes along rows: 5.95 instructions a weight element,
  20 barriers + 64 LDS.128 a K step (x re-broadcast through shared memory), a cross-warp
  reduction every K step, 155 registers (3 programs an SM). Measured 0.308 / 0.327 (session 3).
- klane-r32-w64: [32 rows, 64 words] tiles, lanes along K: 5.27 instructions an element, no
  barrier / shared memory / shuffle in the loop, 79 registers (6 programs an SM), coalesced
  16-byte loads. Tests: is the default bounded by barriers, occupancy and layout rather than
  by the decode's ALU work?
- klane-r64-w64: 64 rows (x amortized over 8 rows a thread): 4.80 instructions an element,
  128 registers (4 programs an SM): fewer instructions vs fewer programs in flight.
- klane-r32-w128: 128 words a step: 4.64 an element but x back through shared memory (16
  barriers a step, 158 registers): the barrier cost directly.
- klane-r64-w32: 64 rows x 32 words (5.27 an element, 91 registers): smaller loads in flight.
- klane-r64-w64-nw8: 8 warps a program.
- klane-r32-w64-pf / klane-r64-w64-pf: FP4_KLANE_PREFETCH, register double buffering (the next
  step's loads issued before this step's arithmetic; 96 / 168 registers, 5.47 / 5.03
  instructions an element): does exposed load latency per program still bound it?
- bf16 default as the control (~1.0 of copy bandwidth last session).
tp 1 uses 48 experts (K3's bytes per selected expert; 3 copies rotate through different
experts, so every call reads cold weights), as benchmarks/h200_tuning/sweep1_knobs.py.
Each row: median graph us, copy fraction on the stage's bytes, per-kernel durations of one
call, correctness vs the fp32 reference on the dequantized codes (the CPU tests' tolerances),
recorded as ok / max error, never raised. Run from the repo root (about 40 s on the H200):
    python3 benchmarks/next/moe_sweep.py
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

KNOBS = ("FP4_LAYOUT", "FP4_KLANE_WORDS", "FP4_KLANE_ROWS", "FP4_KLANE_PREFETCH", "NUM_WARPS",
         "TARGET_PROGRAMS")
DEFAULTS = {k: getattr(moe, k) for k in KNOBS}


def klane(rows, words, warps=4, prefetch=False):
    return dict(FP4_LAYOUT=1, FP4_KLANE_ROWS=rows, FP4_KLANE_WORDS=words, NUM_WARPS=warps,
                FP4_KLANE_PREFETCH=prefetch)


TP1_VARIANTS = {
    "default": {},
    "klane-r32-w64": klane(32, 64),
    "klane-r64-w64": klane(64, 64),
    "klane-r32-w128": klane(32, 128),
    "klane-r64-w32": klane(64, 32),
    "klane-r64-w64-nw8": klane(64, 64, 8),
    "klane-r32-w64-pf": klane(32, 64, prefetch=True),
    "klane-r64-w64-pf": klane(64, 64, prefetch=True),
}
TP8_VARIANTS = ("default", "klane-r32-w64", "klane-r64-w64", "klane-r32-w64-pf")
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


def run(tp, fmt, variants, n_copies, M=1):
    cfg = preset("kimi-k3", tp)
    if tp == 1:
        cfg = dataclasses.replace(cfg, n_experts=48)
    base = MB.make_inputs(cfg, "cuda", 0, M=M, expert_format=fmt)
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
                rec(k="moe", tp=tp, M=M, fmt=fmt, stage=stage, variant=name, us=us,
                    frac=nbytes / bw * 1e6 / us, ok=ok, max_err=err, mb=nbytes / 1e6,
                    dur=kdur(fns["fused"], c0), t=round(time.time() - T0, 1))
            except Exception:
                traceback.print_exc()
                rec(k="moe", tp=tp, M=M, fmt=fmt, stage=stage, variant=name, us=float("nan"),
                    ok=False)
            setknobs({})
    del copies, base, c0
    torch.cuda.empty_cache()
    dump("moe_next.json")


for args in ((1, "mxfp4", list(TP1_VARIANTS), 3), (1, "bf16", ["default"], 3),
             (8, "mxfp4", TP8_VARIANTS, 8)):
    try:
        run(*args)
    except Exception:
        traceback.print_exc()
try:  # M = 16 tokens at tp 1 (block_m 1: one plan entry a tile): default vs K-lane default
    run(1, "mxfp4", ["default", "klane-r32-w64"], 3, M=16)
except Exception:
    traceback.print_exc()
dump("moe_next.json")
print("done", round(time.time() - T0, 1), flush=True)
