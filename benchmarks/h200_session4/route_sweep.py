"""H200 session 4, issue 3 (fused route-sort): the default vs the opt-in GEMV shapes and tail
switches of kernels/route_sort.py, side by side, at Kimi-K3 (896 experts x 7168 bf16 gate,
top-16) B1, tp 8 and tp 1, cold gate weights (copies rotated past twice the L2), CUDA-graph
replay (``gt``: median us a call of a graph of several calls).

Run from the repo root (budget < 75 s with compiles):
``python3 benchmarks/h200_session4/route_sweep.py`` (rows to $OUT/route_sweep.json).
Variants are timed in priority order and skipped (row ``skipped``) once the wall clock passes
TIME_BUDGET_S, so the script always ends and dumps.

Rows (k=...):
- ``floor``: gate bytes / copy bandwidth + the amortized graph launch of a tiny kernel (64 in one
  graph), as session 3 (bar: full-row ratio <= 1.5).
- ``full``: the whole plan: ``us`` (graph), ``ratio`` = us / floor, ``warm`` = one warm call's
  kernel durations (common.kdur), ``ok`` = every RoutePlan field matches the reference on 3 cold
  copies ("pass" or the first failure; never raises), ``grid`` = programs launched.
- ``gemv``: the same variant at TAIL_STAGE = -1 (GEMV + side job alone: no counter, no tail;
  plan incomplete, so no check): separates the GEMV gap from the tail gap.

Variants and the hypothesis each tests (sm_90 / Triton 3.6 facts from aot_route4.py, offline):
- ``default``: 196 split-K programs of 32 x 1024 (7 partials); 255 registers + 248 B of stack
  (the 32 x 1024 tile's 32 loads a thread are spilled), 2 programs an SM.
- ``rows132``: GEMV_ROW_PROGRAMS = 132: 128 programs of 7 whole experts (one per SM, 100 KB of W
  each), 14 unrolled 512-wide K chunks, 56 independent 16-byte loads a thread all issued before
  the first FMA, no spills (250 registers); the tail reads 1 partial (finished logits) instead of
  7, and 128 instead of 196 programs hit the counter. Both gaps at once.
- ``rows132-c1024``: 1024-wide chunks: 206 registers, 5 instead of 33 barriers in the GEMV part
  (the x chunk needs no layout conversion at this width).
- ``rows264``: 224 programs of 4 experts (up to 2 an SM; 200 registers).
- ``rows132-s2``: GEMV_ROW_SPLITS = 2: 256 programs (7 experts x half of H; 2 partials).
- ``rows132-nw2``: 2 warps a program: the tail's cross-warp reductions over 2 warps instead of 4
  (the GEMV then relies on 2x the loads in flight a thread).
- ``candl1``: CAND_CACHE = "": the tail's read-back of its own candidate rows may hit L1 instead
  of going to L2 (.cg); tail only.
- ``rows132-c1024-candl1``: the two combined.
- ``scalar``: SELECT_SCALAR_KEYS: the selection loads partials / bias one element at a time so
  its keys already have the layout of the compaction's scatter stores: sm_90 SASS of the top-k
  fast path 9 instead of 29 barriers, ~660 instead of ~1020 instructions (the conversions of
  the [1, 1024] keys / payloads / masks through shared memory and the second scan are gone).
  Tests: is the tail bound by those barriers? ``rows132-c1024-scalar``: with the row programs
  (both gaps); ``rows132-c1024-scalar-candl1``: + the L1 read-back.
- Call 2 also timed GEMV_EVICT = "evict_first" on the W loads (10.06 us) and CAND_CACHE = "regs"
  (the candidate count from a register reduction, 10.04 us): no gain, both removed from the
  kernel since (results/call2_route_sweep.json).
tp 1: default, rows132-c1024, scalar, rows132-c1024-scalar (the router's shapes are the same as
at tp 8: a repeat on other copies), timed right after tp 8's first four variants.
"""

import importlib
import os
import sys
import time

import torch
import triton

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, gt, kdur, rec  # noqa: E402

from k3lab import profile  # noqa: E402
from k3lab.boundaries import get  # noqa: E402
from k3lab.boundaries.route import route_kwargs  # noqa: E402
from k3lab.config import preset  # noqa: E402

T0 = time.time()
TIME_BUDGET_S = 62.0  # stop starting variants after this (compiles dominate)
rs = importlib.import_module("k3lab.kernels.route_sort")
R = get("route")
KNOBS = ("NUM_WARPS", "TAIL_STAGE", "GEMV_ROW_PROGRAMS", "GEMV_ROW_CHUNK", "GEMV_ROW_SPLITS",
         "CAND_CACHE", "SELECT_SCALAR_KEYS")
# "default" = the module's settings when calls 2 and 3 ran (pinned, so the rows keep their
# meaning now that main's defaults are the row programs with two splits, scalar keys, L1)
DEFAULTS = dict(NUM_WARPS=4, TAIL_STAGE=3, GEMV_ROW_PROGRAMS=0, GEMV_ROW_CHUNK=512,
                GEMV_ROW_SPLITS=1, CAND_CACHE=".cg", SELECT_SCALAR_KEYS=False)
assert set(DEFAULTS) == set(KNOBS)
ROWS = dict(GEMV_ROW_PROGRAMS=132)
C1024 = dict(ROWS, GEMV_ROW_CHUNK=1024)
# (name, switches, also time the GEMV alone) in priority order
TP8 = [
    ("default", {}, True),
    ("rows132-c1024", C1024, True),
    ("scalar", dict(SELECT_SCALAR_KEYS=True), False),
    ("rows132-c1024-scalar", dict(C1024, SELECT_SCALAR_KEYS=True), False),
    ("rows132", ROWS, True),
    ("rows132-c1024-scalar-candl1", dict(C1024, SELECT_SCALAR_KEYS=True, CAND_CACHE=""), False),
    ("candl1", dict(CAND_CACHE=""), False),
    ("rows132-c1024-candl1", dict(C1024, CAND_CACHE=""), False),
    ("rows264", dict(GEMV_ROW_PROGRAMS=264), True),
    ("rows132-s2", dict(ROWS, GEMV_ROW_SPLITS=2), True),
    ("rows132-nw2", dict(ROWS, NUM_WARPS=2), True),
    # call 3: the call-2 winners combined
    ("scalar-candl1", dict(SELECT_SCALAR_KEYS=True, CAND_CACHE=""), False),
    ("rows132-s2-scalar-candl1", dict(ROWS, GEMV_ROW_SPLITS=2, SELECT_SCALAR_KEYS=True,
                                      CAND_CACHE=""), False),
    ("rows132-c1024-s2-scalar-candl1", dict(C1024, GEMV_ROW_SPLITS=2, SELECT_SCALAR_KEYS=True,
                                            CAND_CACHE=""), False),
]
TP1 = ("default", "rows132-c1024", "scalar", "rows132-c1024-scalar")
# tp 1 right after tp 8's first four (its kernels are then compiled already): the later tp 8
# variants are the ones the time budget may cut
PHASES = [(8, TP8[:4]), (1, [v for v in TP8 if v[0] in TP1]), (8, TP8[4:])]
# ROUTE_SWEEP_ONLY="a,b,...": only those variants, at tp 8 then tp 1 (call 3)
if os.environ.get("ROUTE_SWEEP_ONLY"):
    _only = os.environ["ROUTE_SWEEP_ONLY"].split(",")
    _pick = [v for name in _only for v in TP8 if v[0] == name]
    PHASES = [(8, _pick), (1, _pick)]


def setk(**kw):
    """Module switches for one variant (the rest at their defaults)."""
    for k, v in {**DEFAULTS, **kw}.items():
        setattr(rs, k, v)


def fn(i):
    return rs.route_sort(i["hidden"], i["gate_weight"], i["correction_bias"], **route_kwargs(i))


def grid(E=896, H=7168):
    rows = rs._gemv_rows(E, H, True)
    if rows is None:
        be, bk = rs._gemv_blocks(E, H, True, None, None)
        return triton.cdiv(E, be) * triton.cdiv(H, bk)
    return triton.cdiv(E, rows[0]) * rows[4]


def check(copies):
    """Every plan field vs the reference on the first 3 copies: 'pass' or the first failure."""
    try:
        for c in copies[:3]:
            R.check(fn(c), R.variant("reference").fn(c), c)
        return "pass"
    except Exception as e:  # noqa: BLE001
        return f"FAIL {repr(e)[:200]}"


def over_budget(**row):
    if time.time() - T0 > TIME_BUDGET_S:
        rec(k="skipped", **row)
        return True
    return False


tiny = [torch.zeros(1, device="cuda") for _ in range(64)]
launch = gt(lambda x: x.add_(1), tiny)
COPIES, FLOORS = {}, {}
for tp in (8, 1):
    COPIES[tp] = profile.cold_copies(
        lambda s, tp=tp: R.make_inputs(preset("kimi-k3", tp), "cuda", s, M=1))
    gate_us = COPIES[tp][0]["gate_weight"].nbytes / bw * 1e6
    FLOORS[tp] = gate_us + launch
    rec(k="floor", tp=tp, gate_us=round(gate_us, 3), launch_us=round(launch, 3),
        floor=round(FLOORS[tp], 3), copies=len(COPIES[tp]), bw_TBs=round(bw / 1e12, 3),
        triton=triton.__version__)
for tp, variants in PHASES:
    copies, floor = COPIES[tp], FLOORS[tp]
    for name, kw, gemv_row in variants:
        if over_budget(tp=tp, v=name):
            continue
        try:
            setk(**kw)
            ok = check(copies)
            us = gt(fn, copies)
            rec(k="full", tp=tp, M=1, v=name, sw=kw, grid=grid(), nw=rs.NUM_WARPS,
                us=round(us, 3), ratio=round(us / floor, 3), warm=kdur(fn, copies[0]), ok=ok,
                t=round(time.time() - T0, 1))
        except Exception as e:  # noqa: BLE001
            rec(k="full", tp=tp, v=name, err=repr(e)[:300])
        if tp != 8 or not gemv_row or over_budget(tp=tp, v=name, stage=-1):
            continue
        try:
            setk(**kw, TAIL_STAGE=-1)
            us = gt(fn, copies)
            rec(k="gemv", tp=tp, v=name, stage=-1, us=round(us, 3), ratio=round(us / floor, 3),
                warm=kdur(fn, copies[0]), t=round(time.time() - T0, 1))
        except Exception as e:  # noqa: BLE001
            rec(k="gemv", tp=tp, v=name, stage=-1, err=repr(e)[:300])
    setk()
rec(k="done", wall_s=round(time.time() - T0, 1), out=os.environ.get("OUT", "/tmp"))
dump("route_sweep.json")
