"""H200 session 3, issue 3 (route boundary): where the fused route_sort's time goes, and tiles.

Run from the repo root: ``python3 benchmarks/h200_session3/route_sweep.py`` (rows to
$OUT/route_sweep.json). K3 (896 experts x 7168, top-16), B1 unless noted, cold gate weights
(copies rotated past twice the L2), CUDA-graph replay (``gt``: median us per call of a graph of
several calls, so one launch's share is amortized as in the floor's launch term).

Rows (k=...):
- ``floor``: gate bytes / copy bandwidth + the amortized graph launch of a tiny kernel (64 of
  them in one graph, the notebook's measurement), tp 8 and tp 1.
- ``full``: the whole plan, per GEMV tile / warp count / counter kind: ``us`` (graph, per call),
  ``ratio`` = us / floor (issue bar: <= 1.5), ``cold`` = mean kernel duration over the cold copies
  (torch.profiler, eager), ``warm`` = one warm call's kernel duration (common.kdur), ``ok`` = every
  plan field matches the reference on 3 copies. Variants:
    old-default 16x512 nw4 (784 programs, 14 partials; the default before this branch),
    default 32x1024 nw4 (196 programs, 7 partials; this branch's default),
    16x1024 nw4 (392 programs, 7 partials): programs vs partials,
    nw2 / nw1 tiles: is the tail (cross-warp reductions, barriers) cheaper with fewer warps?
    cap64 (CANDIDATES_PER_SLOT = 4: 64 candidate slots, the default before call 2; the default
    is now 2, 32 slots: a quarter of the pairwise rank, sm_90 SASS ~250 fewer tail
    instructions; call 2's cap32 row timed 10.23 us vs 10.87 us at 64); more tokens take the
    arg-max fallback at 32 (K3 synthetic router, 8192 tokens: 0.2% have > 32 candidates,
    none > 64).
- ``stage``: TAIL_STAGE ablations (measurement only, plan incomplete, ok = n/a) at the new
  default (stages -1, 0, 1, 2) and the old one (-1, 0): -1 = GEMV + side job (no counter),
  0 = + the completion counter, 1 = + partial sum, sigmoid, bias, keys, 2 = + top-k and
  weights; the full row is stage 3. Differences = the parts (counter, loads, selection, sort).
- ``gemv``: the standalone split-K GEMV (gate_logits' _gate_gemv_kernel: no counter, no tail)
  cold and warm kernel durations at the same tiles: the GEMV's own cost.
- ``tokens``: M = 8 and M = 64 at the old and new default: sanity.

Call 2 (tree 8867e4d) also timed a two-level completion counter (``hier`` rows) and ``tl.topk``
for the selection (``bitonic`` rows); both were slower and are no longer in the kernel (see
results/route_sweep.json and the README).
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
rs = importlib.import_module("k3lab.kernels.route_sort")
R = get("route")
DEFAULTS = {"NUM_WARPS": rs.NUM_WARPS, "TAIL_STAGE": rs.TAIL_STAGE,
            "CANDIDATES_PER_SLOT": rs.CANDIDATES_PER_SLOT}


def setk(**kw):
    """Module constants for one variant (the rest at their defaults)."""
    for k, v in {**DEFAULTS, **kw}.items():
        setattr(rs, k, v)


def call(be=None, bk=None):
    def fn(i):
        return rs.route_sort(i["hidden"], i["gate_weight"], i["correction_bias"],
                             **route_kwargs(i), gemv_block_e=be, gemv_block_k=bk)
    return fn


def kcold(fn, copies, match):
    """Mean kernel duration (us) of the kernels whose name contains ``match`` over eager calls on
    every copy (cold: one pass exceeds twice the L2), from torch.profiler."""
    try:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprof
        for c in copies:
            fn(c)
        torch.cuda.synchronize()
        with tprof(activities=[ProfilerActivity.CUDA]) as prof:
            for c in copies:
                fn(c)
            torch.cuda.synchronize()
        durs = [e.time_range.end - e.time_range.start for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and match in e.name]
        return round(sum(durs) / len(durs), 2) if durs else float("nan")
    except Exception as e:  # noqa: BLE001
        print("ERR kcold", repr(e)[:200], flush=True)
        return float("nan")


def check(fn, copies):
    """Every plan field vs the reference on the first 3 copies: 'pass' or the first failure."""
    try:
        for c in copies[:3]:
            R.check(fn(c), R.variant("reference").fn(c), c)
        return "pass"
    except Exception as e:  # noqa: BLE001
        return f"FAIL {repr(e)[:200]}"


def make_copies(tp, M):
    return profile.cold_copies(lambda s: R.make_inputs(preset("kimi-k3", tp), "cuda", s, M=M))


tiny = [torch.zeros(1, device="cuda") for _ in range(64)]
launch = gt(lambda x: x.add_(1), tiny)
FULL = [  # (name, block_e, block_k, warps, candidates per slot)
    ("old-default", 16, 512, 4, None),
    ("default", None, None, None, None),
    ("16x1024", 16, 1024, 4, None),
    ("32x1024-nw2", 32, 1024, 2, None),
    ("8x1024-nw1", 8, 1024, 1, None),
    ("cap64", None, None, None, 4),
]
floors = {}
for tp in (8, 1):
    copies = make_copies(tp, 1)
    gate_us = copies[0]["gate_weight"].nbytes / bw * 1e6
    floors[tp] = floor = gate_us + launch
    rec(k="floor", tp=tp, gate_us=round(gate_us, 3), launch_us=round(launch, 3),
        floor=round(floor, 3), copies=len(copies), bw_TBs=round(bw / 1e12, 3),
        triton=triton.__version__)
    variants = FULL if tp == 8 else [v for v in FULL if v[0] in ("old-default", "default")]
    for name, be, bk, nw, per_slot in variants:
        try:
            setk(**({} if nw is None else {"NUM_WARPS": nw}),
                 **({} if per_slot is None else {"CANDIDATES_PER_SLOT": per_slot}))
            fn = call(be, bk)
            ok = check(fn, copies)
            us = gt(fn, copies)
            rec(k="full", tp=tp, M=1, v=name, be=be, bk=bk, nw=rs.NUM_WARPS,
                cap=rs._select_tiles(896, 1, 16)["CAP"], us=round(us, 3),
                ratio=round(us / floor, 3),
                cold=kcold(fn, copies, "route_sort"), warm=kdur(fn, copies[0]), ok=ok)
        except Exception as e:  # noqa: BLE001
            rec(k="full", tp=tp, v=name, err=repr(e)[:300])
    if tp != 8:
        continue
    for name, be, bk, stages in (("old-default", 16, 512, (-1, 0)),
                                 ("default", None, None, (-1, 0, 1, 2))):
        for stage in stages:
            try:
                setk(TAIL_STAGE=stage)
                fn = call(be, bk)
                us = gt(fn, copies)
                rec(k="stage", tp=tp, v=name, stage=stage, us=round(us, 3),
                    cold=kcold(fn, copies, "route_sort"), warm=kdur(fn, copies[0]))
            except Exception as e:  # noqa: BLE001
                rec(k="stage", tp=tp, v=name, stage=stage, err=repr(e)[:300])
    setk()
    for be, bk in ((16, 512), (32, 1024), (16, 1024)):
        def gfn(i, be=be, bk=bk):
            return rs.gate_logits(i["hidden"], i["gate_weight"], gemv_block_e=be,
                                  gemv_block_k=bk)
        rec(k="gemv", be=be, bk=bk, cold=kcold(gfn, copies, "gate_gemv"),
            warm=kdur(gfn, copies[0]))
    del copies

for M in (8, 64):
    copies = make_copies(8, M)
    for name, be, bk in (("old-default", 16, 512), ("default", None, None)):
        try:
            setk()
            fn = call(be, bk)
            us = gt(fn, copies)
            rec(k="tokens", tp=8, M=M, v=name, us=round(us, 3),
                cold=kcold(fn, copies, "route_sort"), ok=check(fn, copies))
        except Exception as e:  # noqa: BLE001
            rec(k="tokens", tp=8, M=M, v=name, err=repr(e)[:300])
    del copies
rec(k="done", wall_s=round(time.time() - T0, 1), out=os.environ.get("OUT", "/tmp"))
dump("route_sweep.json")
