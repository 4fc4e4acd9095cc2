"""Needs branch kda4 (its kernels/kda.py switches measured slower in call 2; not on main):
`git checkout kda4` first.

H200, issue 5 (KDA decode), session 4: the opt-in switches of kernels/kda.py against today's
default, the session-3 loads-first kernel (benchmarks/next/kda_loadsfirst.py, its best "lf bv32")
and fla-core + its separate f_b projection; K3, M = 1, cold copies, graph replay; every row is
checked against the reference (ok = pass / FAIL ..., never stops the sweep).

Bars: tp 8 fused <= ~3.7 us (2x fla's 7.42); tp 1 >= 0.50 of copy bandwidth on the state bytes
(12.6 MB read + written, <= ~6.0 us). What each variant tests (offline sm_90 SASS, Triton 3.6,
benchmarks/h200_session4/aot_kda.py: registers / barriers / load order in brackets):
- main: today's default [78 regs, 13 barriers, 140 shuffles; state load after the GEMV].
- lf bv32: the session-3 loads-first kernel, again, in this process.
- cols: f_b GEMV with the rank in-thread ([16, D] chunks), nothing else [63 regs, 15 bar,
  37 shfl; loads still interleaved with the FMAs, state after f_b].
- cols 1r: + ONE_REDUCE, the five k-axis sums in one reduction [70 regs, 6 bar].
- flat lf3 1r rt64: the candidate: the head's f_b as one [64, 2*D] load issued right after the
  state (barrier between, volatile f_b: all f_b loads out before the first FMA), one reduction
  [95 regs, 6 bar]. tp 1: 2 programs / SM -> 384 programs in 2 waves, hence the bv64 / bv128
  rows (one wave) and a MAX_NREG=80 row (3 / SM, 16 B of spills, loads partly interleaved).
- flat lf3 rt64: the same without ONE_REDUCE (what the barrier count costs).
- flat lf1 1r rt64: only one barrier, f_b not volatile (what the load order costs).
- rows lf1 1r: today's GEMV layout with loads first and ONE_REDUCE [80 regs: 3 programs / SM,
  so tp 1's 384 programs fit one wave; state first, 5 bar].
- bv16 8w: twice the programs (more SMs pulling the state; f_b re-read 8x a head) [64 regs].
- 16w: 16 warps, half the registers a thread [60 regs, 6 bar, every load out before the first
  FMA]; tp 1: 2 programs / SM (2 waves), tp 8: more loads in flight per SM.
- cols 1r bv64 (tp 1): 192 programs, no load ordering [95 regs].
Run from the repo root: python3 benchmarks/h200_session4/kda_sweep.py (writes $OUT/kda_sweep.json).
"""

import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks/h200_tuning")
import torch  # noqa: E402
from common import bw, dump, gt, kdur, rec  # noqa: E402

import k3lab.kernels.kda as kda  # noqa: E402
from k3lab import profile  # noqa: E402
from k3lab.boundaries import clone_inputs, get  # noqa: E402
from k3lab.config import preset  # noqa: E402

T0 = time.time()
BUDGET_S = 68  # stop adding configs past this (the call has 75 s, compiles included)
K = get("kda")
FLA = next(v for v in K.variants if v.name == "fla-core")
REF = next(v for v in K.variants if v.name == "reference")
_spec = importlib.util.spec_from_file_location(
    "kda_loadsfirst", Path(__file__).parent.parent / "next" / "kda_loadsfirst.py")
LF = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = LF
_spec.loader.exec_module(LF)
LF_BEST = dict(PACK_FB=False, SYNC_LOADS=1, MAX_WARPS=8, TILE_PER_WARP=512, BLOCK_R=64)
SWITCHES = ("LOADS_FIRST", "GEMV_LAYOUT", "BLOCK_RT", "O_FROM_DECAYED", "ONE_REDUCE", "NUM_WARPS",
            "MAX_NREG")
DEFAULTS = {n: getattr(kda, n) for n in SWITCHES}


def fused(mod, block_v=None, **consts):
    """A kda_decode call with the given module switches (set at every call: graph capture too)."""
    def fn(i):
        if mod is LF:
            for name, val in {**LF_BEST, **consts}.items():
                setattr(LF, name, val)
        else:
            for name, val in {**DEFAULTS, **consts}.items():
                setattr(kda, name, val)
        try:
            o = mod.kda_decode(i["q"], i["k"], i["v"], i["f_low"], i["f_b"], i["A_log"],
                               i["dt_bias"], i["b_logits"], i["state"],
                               lower_bound=i["lower_bound"], scale=i["scale"], block_v=block_v)
        finally:
            for name, val in DEFAULTS.items():
                setattr(kda, name, val)
        return {"o": o, "state": i["state"]}
    return fn


def check(fn, inputs):
    try:
        ref = REF.fn(clone_inputs(inputs))
        out = fn(clone_inputs(inputs))
        torch.cuda.synchronize()
        K.check(out, ref, inputs)
        return "pass"
    except Exception as e:  # noqa: BLE001
        return f"FAIL {repr(e)[:200]}"


CAND = dict(LOADS_FIRST=3, GEMV_LAYOUT="flat", ONE_REDUCE=True, BLOCK_RT=64)
COMMON = [
    ("fla", lambda: FLA.fn),
    ("main", lambda: fused(kda)),
    ("lf bv32", lambda: fused(LF, 32)),
    ("cols", lambda: fused(kda, GEMV_LAYOUT="cols")),
    ("cols 1r", lambda: fused(kda, GEMV_LAYOUT="cols", ONE_REDUCE=True)),
    ("flat lf3 1r rt64", lambda: fused(kda, **CAND)),
]
CONFIGS = {
    8: COMMON + [
        ("flat lf3 rt64", lambda: fused(kda, **{**CAND, "ONE_REDUCE": False})),
        ("flat lf1 1r rt64", lambda: fused(kda, **{**CAND, "LOADS_FIRST": 1})),
        ("rows lf1 1r", lambda: fused(kda, LOADS_FIRST=1, ONE_REDUCE=True)),
        ("flat lf3 1r rt64 bv16 8w", lambda: fused(kda, 16, **CAND, NUM_WARPS=8)),
        ("flat lf3 1r rt32", lambda: fused(kda, **{**CAND, "BLOCK_RT": 32})),
        ("flat lf3 1r rt64 16w", lambda: fused(kda, **CAND, NUM_WARPS=16)),
    ],
    1: COMMON + [
        ("flat lf3 1r rt64 bv64", lambda: fused(kda, 64, **CAND)),
        ("flat lf3 1r rt64 bv128 16w", lambda: fused(kda, 128, **CAND, NUM_WARPS=16)),
        ("flat lf3 1r rt64 nreg80", lambda: fused(kda, **CAND, MAX_NREG=80)),
        ("cols 1r bv64", lambda: fused(kda, 64, GEMV_LAYOUT="cols", ONE_REDUCE=True)),
        ("flat lf3 1r rt64 16w", lambda: fused(kda, **CAND, NUM_WARPS=16)),
        ("rows lf1 1r", lambda: fused(kda, LOADS_FIRST=1, ONE_REDUCE=True)),
    ],
}

for tp, configs in CONFIGS.items():
    cfg = preset("kimi-k3", tp)
    first = K.make_inputs(cfg, "cuda", 0, M=1)
    sbytes = 2 * first["state"].nbytes  # read + written
    copies = profile.cold_copies(lambda s, cfg=cfg: K.make_inputs(cfg, "cuda", s, M=1),
                                 bytes_per_copy=K.bytes_moved(first))
    fla_us = float("nan")
    for name, make in configs:
        if time.time() - T0 > BUDGET_S:
            rec(k="kda_sweep", tp=tp, variant=name, err="skipped: time budget")
            continue
        try:
            fn = make()
            ok = check(fn, copies[0])
            us = gt(fn, copies)
            if name == "fla":
                fla_us = us
            rec(k="kda_sweep", tp=tp, variant=name, ok=ok, us=round(us, 2),
                speedup_vs_fla=round(fla_us / us, 2),
                state_frac=round(sbytes / (us * 1e-6) / bw, 3),
                dur=kdur(fn, copies[1 % len(copies)]), t=round(time.time() - T0, 1))
        except Exception as e:  # noqa: BLE001
            rec(k="kda_sweep", tp=tp, variant=name, err=repr(e)[:300])
print("copy bandwidth GB/s", round(bw / 1e9), flush=True)
dump("kda_sweep.json")
