"""H200 session 3, second MLA round (issue 6): the score product split into SCORE_CHUNKS
independent tensor-core chains (a batched 3-D dot over column chunks of the latent) against one
chain, at the split tiles of the first round, K3 tp 8, M = 1, heuristic splits (132), graph
replay, cold copies; each row checked against the fp32 reference.

Hypothesis (first round, mla.json): the split kernel is bounded by each warp's dependent chain of
C / 16 = 32 tensor-core steps per tile, not by memory: 32k reached 0.47 of copy bandwidth with 1-4
programs an SM, and fewer rows per program changed little.
Run from the repo root: python3 benchmarks/h200_session3/mla2_sweep.py. Writes $OUT/mla2.json.
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
KNOBS = ("SCORE_CHUNKS", "BLOCK_N", "SPLIT_NUM_WARPS", "SPLIT_NUM_STAGES", "LONG_BLOCK_N",
         "LONG_NUM_WARPS", "LONG_NUM_STAGES")
DEFAULTS = {k: getattr(mla, k) for k in KNOBS}


@contextlib.contextmanager
def knobs(chunks, tile):
    bn, nw, ns = tile
    try:
        for k, v in dict(SCORE_CHUNKS=chunks, BLOCK_N=bn, SPLIT_NUM_WARPS=nw, SPLIT_NUM_STAGES=ns,
                         LONG_BLOCK_N=bn, LONG_NUM_WARPS=nw, LONG_NUM_STAGES=ns).items():
            setattr(mla, k, v)
        yield
    finally:
        for k, v in DEFAULTS.items():
            setattr(mla, k, v)


def call(splits):
    return lambda i: mla.mla_decode(i["q_lat"], i["q_rope"], i["kv_cache"], i["seq_lens"],
                                    sm_scale=i["sm_scale"], num_splits=splits)


def correct(fn, inputs, ref):
    try:
        out = fn(inputs)
        torch.cuda.synchronize()
        MB.check(out, ref, inputs)
        return True
    except Exception as e:
        print("WRONG", repr(e)[:300], flush=True)
        return False


def run(ctx, copies, ref, chunks, tile, splits=None):
    nbytes = ctx * (CFG.kv_lora + CFG.qk_rope) * 2
    with knobs(chunks, tile):
        fn = call(splits)
        ok = correct(fn, copies[0], ref)
        us = gt(fn, copies) if ok else float("nan")
        ok = ok and math.isfinite(us) and correct(fn, copies[0], ref)
        dur = kdur(fn, copies[0]) if ok else None
    rec(k="mla2", ctx=ctx, chunks=chunks, tile=list(tile),
        splits=splits or mla.default_num_splits(1, CFG.mla_heads, ctx, "cuda"), us=us,
        frac=nbytes / bw * 1e6 / us, floor_us=nbytes / bw * 1e6, ok=ok, dur=dur,
        t=round(time.time() - T0, 1))


for ctx in (32768, 65536, 131072):
    nbytes = ctx * (CFG.kv_lora + CFG.qk_rope) * 2
    copies = profile.cold_copies(lambda s, c=ctx: MB.make_inputs(CFG, "cuda", s, M=1, context=c),
                                 bytes_per_copy=nbytes)
    i = copies[0]
    ref = mla_decode_reference(i["q_lat"], i["q_rope"], i["kv_cache"], i["seq_lens"],
                               sm_scale=i["sm_scale"])
    for tile in ((32, 4, 4), (64, 8, 3), (64, 4, 3)):
        for chunks in (1, 2, 4, 8):
            run(ctx, copies, ref, chunks, tile)
    if ctx == 32768:
        for splits in (264, 66):
            run(ctx, copies, ref, 4, (32, 4, 3), splits)
    del copies, i, ref
    torch.cuda.empty_cache()
dump("mla2.json")
