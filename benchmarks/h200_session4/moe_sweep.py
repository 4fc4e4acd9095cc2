"""H200, issue 4 (session 4, helper moe4): why the K-lane MXFP4 stages sit at ~0.52 of the copy
bandwidth at K3 tp 1 (B1, cold weights) while their issue bound is 0.76-0.91, and three opt-in
switches of kernels/moe.py that attack it, timed against today's default side by side.

Offline sm_90 SASS (Triton 3.6, benchmarks/next/aot_moe.py --knobs ...; registers, loop
instructions a thread per K step for 256 elements at 64 rows / 128 at 32 rows):
- default: K-lane 64 rows x 64 words, 128 registers (4 programs an SM), 1230 instructions
  (4.80 an element), loads issued only after the previous step's arithmetic (no pipelining);
  stage 1 launches 16 x 48 = 768 programs (1.45 waves of 528 slots), stage 2 896 (1.70 waves).
  Session 4 call 1: 0.515 / 0.531; other shapes (occupancy 3-6 programs an SM), register
  prefetch and 8 warps all landed at 0.47-0.53: the kernel runs at ~60 % of its issue bound
  whatever the occupancy, so the hypotheses are (a) each program's load latency is exposed
  (nothing in flight for a program during its arithmetic; register prefetch was half undone by
  ptxas), (b) the last, partial wave of long programs (768 programs of ~40 us at 528 slots).
- fuse-split3 (FP4_FUSE_GATE_UP, FP4_STAGE2_KSPLIT 3, FP4_MAXNREG 128): tests (b) at the same
  instruction stream: stage 1 one K loop over 32 gate + 32 up interleaved rows (same 8 rows a
  thread, 128 registers, 1247-1269 instructions) -> 1536 programs (2.9 waves); stage 2 the 6 K
  steps split over 3 programs meeting in the existing fp32 atomics -> 2688 programs of 2 steps
  (the split alone takes 165 registers, the cap holds 128 with an 8-byte spill outside the loop).
- fuse-split6: the same with 1-step stage-2 programs (5376).
- st3 (FP4_KLANE_STAGES 3): tests (a): tl.range(num_stages=3) makes Triton's pipeliner stage
  the words / scales / x through shared memory with cp.async (LDGSTS), 2 steps ahead, without
  holding them in registers (1302 instructions; but 242 / 168 registers: 2 / 3 programs an SM).
- st2-r128: 2 stages capped at 128 registers (4 programs an SM; 56 / 40-byte spills, 7-8 LDL
  a step).
- fuse-st3-split3: (a) + (b): 166 / 165 registers (3 programs an SM), 35 KB shared a program.
- fuse-st2-split3-r128: pipelined at 4 programs an SM: 128 registers, stage 2 without a spill,
  stage 1 with an 80-byte one (20 LDL a step).
- fuse-st4-split3: 3 steps ahead (52 KB shared a program, 3 programs an SM: 156 KB).
- r32-st4-split3: 32-row tiles (5.7 instructions an element) pipelined 4 deep: 96 / 80
  registers (5 / 6 programs an SM), 1536 / 5376 programs.
- fuse-r32-st4-split3: 16 gate + 16 up rows, 3072 stage-1 programs.
tp 8: default vs the candidates (stage 1 / stage 2 us).
Each row: median graph us, fraction of copy bandwidth on the stage's bytes, per-kernel durations
of one call, correctness vs the fp32 reference (the CPU tests' tolerances), ok / max error,
never raised. tp 1 uses 48 experts (cold copies rotate), as benchmarks/next/moe_sweep.py.
Run from the repo root (aim < 75 s on the H200; tp 1 variants past 52 s and tp 8 ones past
70 s are skipped, in VARIANTS order):
    python3 benchmarks/h200_session4/moe_sweep.py
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
# tp 1 variants start only before TP1_BUDGET_S (leaving time for tp 8), tp 8 ones before 70 s
TP1_BUDGET_S, TP8_BUDGET_S = 52, 70
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)

KNOBS = ("FP4_LAYOUT", "FP4_KLANE_WORDS", "FP4_KLANE_ROWS", "FP4_KLANE_PREFETCH",
         "FP4_KLANE_STAGES", "FP4_FUSE_GATE_UP", "FP4_STAGE2_KSPLIT", "FP4_MAXNREG")
# "default" = the module's settings when call 3 ran (pinned, so the rows keep their meaning now
# that main's defaults are fused gate/up rows with a 3-stage stage-1 loop)
DEFAULTS = dict(FP4_LAYOUT=1, FP4_KLANE_WORDS=64, FP4_KLANE_ROWS=64, FP4_KLANE_PREFETCH=False,
                FP4_KLANE_STAGES=0, FP4_FUSE_GATE_UP=False, FP4_STAGE2_KSPLIT=1, FP4_MAXNREG=None)
assert set(DEFAULTS) == set(KNOBS)

VARIANTS = {  # in priority order: past the time budget the last ones are skipped
    "default": {},
    "fuse-split3": dict(FP4_FUSE_GATE_UP=True, FP4_STAGE2_KSPLIT=3, FP4_MAXNREG=128),
    "st3": dict(FP4_KLANE_STAGES=3),
    "fuse-st3-split3": dict(FP4_FUSE_GATE_UP=True, FP4_KLANE_STAGES=3, FP4_STAGE2_KSPLIT=3),
    "fuse-st2-split3-r128": dict(FP4_FUSE_GATE_UP=True, FP4_KLANE_STAGES=2, FP4_STAGE2_KSPLIT=3,
                                 FP4_MAXNREG=128),
    "r32-st4-split3": dict(FP4_KLANE_ROWS=32, FP4_KLANE_STAGES=4, FP4_STAGE2_KSPLIT=3),
    "fuse-st4-split3": dict(FP4_FUSE_GATE_UP=True, FP4_KLANE_STAGES=4, FP4_STAGE2_KSPLIT=3),
    "fuse-r32-st4-split3": dict(FP4_KLANE_ROWS=32, FP4_FUSE_GATE_UP=True, FP4_KLANE_STAGES=4,
                                FP4_STAGE2_KSPLIT=3),
    "st2-r128": dict(FP4_KLANE_STAGES=2, FP4_MAXNREG=128),
    "fuse-split6": dict(FP4_FUSE_GATE_UP=True, FP4_STAGE2_KSPLIT=6, FP4_MAXNREG=128),
}
TP8_VARIANTS = ("default", "fuse-split3", "fuse-st3-split3", "r32-st4-split3")
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


def run(tp, variants, n_copies, M=1):
    cfg = preset("kimi-k3", tp)
    if tp == 1:
        cfg = dataclasses.replace(cfg, n_experts=48)
    base = MB.make_inputs(cfg, "cuda", 0, M=M, expert_format="mxfp4")
    copies = [MB.stage_inputs(c) for c in MB.copies_sharing_experts(base, n_copies)]
    c0 = copies[0]
    wants = {"stage1": ref.moe_stage1_reference(
        c0["z"], c0["plan"], c0["weights"]["w13"], activation=cfg.activation,
        situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta),
        "stage2": ref.moe_stage2_reference(c0["a"], c0["plan"], c0["weights"]["w2"])}
    for name in variants:  # variant-major: a variant that starts gets both stages
        if time.time() - T0 > (TP1_BUDGET_S if tp == 1 else TP8_BUDGET_S):
            print("SKIP (time budget)", tp, name, flush=True)
            continue
        for stage in ("stage1", "stage2"):
            fns = MB.stage_fns(stage)
            nbytes = MB.stage_bytes(stage, c0)
            setknobs(VARIANTS[name])
            try:
                ok, err = check(stage, fns["fused"], c0, wants[stage])
                us = gt(fns["fused"], copies, repeats=10)
                rec(k="moe4", tp=tp, M=M, fmt="mxfp4", stage=stage, variant=name, us=us,
                    frac=nbytes / bw * 1e6 / us, ok=ok, max_err=err, mb=nbytes / 1e6,
                    dur=kdur(fns["fused"], c0), t=round(time.time() - T0, 1))
            except Exception:
                traceback.print_exc()
                rec(k="moe4", tp=tp, M=M, fmt="mxfp4", stage=stage, variant=name,
                    us=float("nan"), ok=False)
            setknobs({})
    del copies, base, c0
    torch.cuda.empty_cache()
    dump("moe4.json")


for args in ((1, list(VARIANTS), 3), (8, TP8_VARIANTS, 8)):
    try:
        run(*args)
    except Exception:
        traceback.print_exc()
dump("moe4.json")
print("done", round(time.time() - T0, 1), flush=True)
