"""Next H200 session, MLA decode (issue 6): the split kernel's opt-in variants against the
default, K3 tp 8, M = 1, heuristic splits (132 on an H200), graph replay with cold copies, each
row checked against the fp32 reference (pass/fail recorded, never raised).

What each variant tests (benchmarks/next/MLA_ANALYSIS.md has the SASS behind it):
- default: 32 / 4 / 4 below 64k, 64 / 8 / 3 from 64k (module defaults).
- chunks4: SCORE_CHUNKS = 4: the score product as 4 column-chunk products (+ rope), longest
  HMMA chain 8 instead of 36 (SASS); if the chain bounds a tile, this is faster at every length.
- defer: DEFER_ROW_SUM: one cross-warp reduction less per tile (9 -> 6 barriers a tile).
- chunks4+defer: both (418 instead of 542 loop instructions a 32-row tile).
- chunks4+defer at 64 / 4 / 3: 64-row tiles on 4 warps read the query fragments from shared
  memory once per 64 rows a warp instead of once per 32 (LDSM 432 instead of 576 a 64-row step
  for the CTA); 64 / 4 / 3 alone (control) was 19.99 us at 32k in session 3 (default 19.05).
- chunks4+defer at 64 / 8 / 3 (the long-context tile at every length).
- combine-s{128,64,32}-c{32,64,128} (32k only): the combine kernel with 128 / 64 / 32 splits a
  step and 32 / 64 / 128 columns a program (192 / 96 / 48 programs instead of 384 programs of
  256 padded splits x 16 columns): how much of the 2.8 us combine is its shape.
Run from the repo root: python3 benchmarks/next/mla_sweep.py. Writes $OUT/mla_next.json.
"""

import contextlib
import math
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
KNOBS = ("SCORE_CHUNKS", "DEFER_ROW_SUM", "COMBINE_MAX_BLOCK_S", "BLOCK_N", "SPLIT_NUM_WARPS",
         "SPLIT_NUM_STAGES", "LONG_BLOCK_N", "LONG_NUM_WARPS", "LONG_NUM_STAGES")
DEFAULTS = {k: getattr(mla, k) for k in KNOBS}

# (name, knobs, tile (BLOCK_N, warps, stages) for every length or None = the defaults)
VARIANTS = [
    ("default", {}, None),
    ("chunks4", dict(SCORE_CHUNKS=4), None),
    ("defer", dict(DEFER_ROW_SUM=True), None),
    ("chunks4+defer", dict(SCORE_CHUNKS=4, DEFER_ROW_SUM=True), None),
    ("64/4/3", {}, (64, 4, 3)),
    ("chunks4+defer", dict(SCORE_CHUNKS=4, DEFER_ROW_SUM=True), (64, 4, 3)),
    ("chunks4+defer", dict(SCORE_CHUNKS=4, DEFER_ROW_SUM=True), (64, 8, 3)),
]
# The combine's fixed cost (2.8 us of the 19.2 at 32k, where the bar leaves ~3 us for all fixed
# costs): fewer, wider programs than the default one step of 256 padded splits x 16 columns
# (384 programs); existing module constants, 32k only.
COMBINE_VARIANTS = [
    ("combine-s128-c32", dict(COMBINE_MAX_BLOCK_S=128), None),
    ("combine-s64-c64", dict(COMBINE_MAX_BLOCK_S=64), None),
    ("combine-s32-c128", dict(COMBINE_MAX_BLOCK_S=32), None),
]


@contextlib.contextmanager
def knobs(values, tile):
    try:
        for k, v in values.items():
            setattr(mla, k, v)
        if tile is not None:
            bn, nw, ns = tile
            for k, v in dict(BLOCK_N=bn, SPLIT_NUM_WARPS=nw, SPLIT_NUM_STAGES=ns,
                             LONG_BLOCK_N=bn, LONG_NUM_WARPS=nw, LONG_NUM_STAGES=ns).items():
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


def run(ctx, copies, ref, name, values, tile):
    nbytes = ctx * (CFG.kv_lora + CFG.qk_rope) * 2
    with knobs(values, tile):
        used = mla._split_config(ctx, True)
        ok = correct(copies[0], ref)
        us = gt(call, copies) if ok else float("nan")
        ok = ok and math.isfinite(us) and correct(copies[0], ref)
        # per-kernel durations of one call on a copy the last correctness call did not touch
        # (32k is 37.7 MB: copies[0] may still sit in the 50 MB L2)
        dur = kdur(call, copies[-1]) if ok else None
    rec(k="mla_next", ctx=ctx, name=name, tile=list(used), **{k: v for k, v in values.items()},
        splits=mla.default_num_splits(1, CFG.mla_heads, ctx, "cuda"), us=us,
        frac=nbytes / bw * 1e6 / us, floor_us=nbytes / bw * 1e6, ok=ok, dur=dur,
        t=round(time.time() - T0, 1))


for ctx in (32768, 65536, 131072):
    nbytes = ctx * (CFG.kv_lora + CFG.qk_rope) * 2
    copies = profile.cold_copies(lambda s, c=ctx: MB.make_inputs(CFG, "cuda", s, M=1, context=c),
                                 bytes_per_copy=nbytes)
    i = copies[0]
    ref = mla_decode_reference(i["q_lat"], i["q_rope"], i["kv_cache"], i["seq_lens"],
                               sm_scale=i["sm_scale"])
    for name, values, tile in VARIANTS + (COMBINE_VARIANTS if ctx == 32768 else []):
        try:
            run(ctx, copies, ref, name, values, tile)
        except Exception as e:  # record and go on
            rec(k="mla_next", ctx=ctx, name=name, err=repr(e)[:300])
    del copies, i, ref
    torch.cuda.empty_cache()
dump("mla_next.json")
