"""H200 session 4, MLA decode (issue 6): the combine's fixed cost. K3 tp 8 (12 heads), M = 1,
32k / 64k / 128k, heuristic splits (132 on an H200), graph replay with cold copies (per-call
marginal cost in a graph of >= 32 calls), per-kernel durations of one call, every row checked
against the fp32 reference (pass/fail recorded, never raised). Writes $OUT/mla4.json after every
row (a cut run keeps what it measured).

Session 4 call 1 (benchmarks/h200_session4/results/mla_next.json), PDL off: 32k 17.49 us =
split 12.38 + combine 2.72 + ~2.4 us between and around the two graph nodes; the 0.75 bar is
11.87 us at 32k. Session 4's combine sweep (this script, 132 splits): no PDL 17.43 / 27.60 /
47.50 us at 32k / 64k / 128k, COMBINE_PDL 16.86 / 26.99 / 46.53 (now the default), + SPLIT_PDL
16.24 / 27.94 / 46.66; merging only the used splits (COMBINE_USED_ONLY, row pdl-used), the
one-launch grid-barrier combine (branch mla4) and two programs an SM slower or no faster
(removed from the kernel). Variants (kernels/mla.py switches):
- default: the module's defaults (two kernels, COMBINE_PDL on: the combine grid launches while
  the split grid runs and waits with griddepcontrol.wait for its completion). NB: with PDL the
  combine's kernel duration includes its wait for the split grid; read `us`.
- no-pdl: COMBINE_PDL off (the previous default): the control.
- pdl2: + SPLIT_PDL: the call's first kernel is launched with launch_pdl and waits
  (griddepcontrol.wait) at its start; the call's last kernel triggers its dependents at its
  start. In this graph the kernel before a call is the previous call's last kernel, so the gain
  shown is an upper bound for a decode step, where it depends on the preceding kernel.
Run from the repo root: python3 benchmarks/h200_session4/mla_sweep.py  (~20-30 s expected).
"""

import contextlib
import math
import os
import sys
import time

sys.path.insert(0, "benchmarks/h200_tuning")

import torch  # noqa: E402
from common import bw, dump, gt, kdur, rec  # noqa: E402

import k3lab.kernels.mla as mla  # noqa: E402
from k3lab import profile  # noqa: E402
from k3lab.boundaries import mla as MB  # noqa: E402
from k3lab.config import preset  # noqa: E402
from k3lab.reference.mla import mla_decode_reference  # noqa: E402

T0 = time.time()
CFG = preset("kimi-k3", 8)
# (name, knobs, contexts or None = all)
VARIANTS = [
    ("default", {}, None),
    ("no-pdl", dict(COMBINE_PDL=False), None),
    ("pdl2", dict(COMBINE_PDL=True, SPLIT_PDL=True), None),
]
# MLA_SWEEP_ONLY="a,b": only those variants (call 3)
if os.environ.get("MLA_SWEEP_ONLY"):
    VARIANTS = [v for v in VARIANTS if v[0] in os.environ["MLA_SWEEP_ONLY"].split(",")]
KNOBS = sorted({k for _, v, _ in VARIANTS for k in v})
DEFAULTS = {k: getattr(mla, k) for k in KNOBS}


@contextlib.contextmanager
def knobs(values):
    try:
        for k, v in values.items():
            setattr(mla, k, v)
        yield
    finally:
        for k, v in DEFAULTS.items():
            setattr(mla, k, v)


def call(i):
    return mla.mla_decode(i["q_lat"], i["q_rope"], i["kv_cache"], i["seq_lens"],
                          sm_scale=i["sm_scale"])


def correct(inputs, ref):
    try:
        out = call(inputs)
        torch.cuda.synchronize()
        MB.check(out, ref, inputs)
        return True
    except Exception as e:
        print("WRONG", repr(e)[:300], flush=True)
        return False


def run(ctx, copies, refs, name, values):
    """refs: the reference outputs of copies[0] and copies[-1] (call 2 checked copies[-1] against
    copies[0]'s reference, so every row with more than one copy read ok = false)."""
    ref, ref_last = refs
    nbytes = ctx * (CFG.kv_lora + CFG.qk_rope) * 2
    with knobs(values):
        splits = mla.default_num_splits(1, CFG.mla_heads, ctx, "cuda")
        ok = correct(copies[0], ref)
        us = gt(call, copies) if ok else float("nan")
        ok = ok and math.isfinite(us) and correct(copies[-1], ref_last)
        # one call (on a copy the first check did not touch where there are several: 32k = 37.7
        # MB fits in L2)
        dur = kdur(call, copies[-1]) if ok else None
    rec(k="mla4", ctx=ctx, name=name, **{**DEFAULTS, **values}, splits=splits, us=us,
        frac=nbytes / bw * 1e6 / us, floor_us=nbytes / bw * 1e6, bar_us=nbytes / bw * 1e6 / 0.75,
        ok=ok, dur=dur, t=round(time.time() - T0, 1))


for ctx in (32768, 65536, 131072):
    nbytes = ctx * (CFG.kv_lora + CFG.qk_rope) * 2
    copies = profile.cold_copies(lambda s, c=ctx: MB.make_inputs(CFG, "cuda", s, M=1, context=c),
                                 bytes_per_copy=nbytes)
    i = copies[0]
    ref = mla_decode_reference(i["q_lat"], i["q_rope"], i["kv_cache"], i["seq_lens"],
                               sm_scale=i["sm_scale"])
    j = copies[-1]
    refs = (ref, mla_decode_reference(j["q_lat"], j["q_rope"], j["kv_cache"], j["seq_lens"],
                                      sm_scale=j["sm_scale"]))
    for name, values, only in VARIANTS:
        if only is not None and ctx not in only:
            continue
        if time.time() - T0 > 65:
            rec(k="mla4", ctx=ctx, name=name, err="skipped: 65 s budget")
            continue
        try:
            run(ctx, copies, refs, name, values)
        except Exception as e:  # record and go on
            rec(k="mla4", ctx=ctx, name=name, err=repr(e)[:300])
        dump("mla4.json")
    del copies, i, j, ref, refs
    torch.cuda.empty_cache()
dump("mla4.json")
