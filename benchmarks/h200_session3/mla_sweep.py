"""H200 session 3, MLA decode (issue 6): K3 tp 8, M = 1, graph replay, cold copies.

Hypotheses timed side by side, every row checked against the fp32 reference after its graph
replays (the fused launch's counter must have been reset by every replay):
  fused        the combine inside the split launch (FUSE_COMBINE; FUSED_COMBINERS programs)
               against the two-kernel path: removes the combine launch and its gap;
  partial      fp16 split partials (PARTIAL_DTYPE): half the bytes written and re-read;
  heads_on_n   the split kernel's dots transposed (HEADS_ON_N): cache rows on the dot's M side
               (wgmma-sized from 64 rows), the 16 (12) heads on N;
  occupancy    more splits than SMs (264, 396) with fewer stages / warps so 2-3 CTAs share an
               SM; BLOCK_N 32 / 64, warps 2 / 4 / 8, stages 1-3.
32k (the hard case) runs the grid; the three fastest split configurations then run at 64k and
128k with and without the fused combine, beside the defaults and 4 fixed splits at 128k.
Run from the repo root: python3 benchmarks/h200_session3/mla_sweep.py [32k | long]. Writes
$OUT/mla.json (mla_32k.json / mla_long.json when one part runs alone; "long" alone takes its
top three from MLA_TOP, e.g. MLA_TOP="264,32,4,2,0;132,64,4,2,1" for splits, BLOCK_N, warps,
stages, HEADS_ON_N; without it only the defaults, fused and 4 fixed splits).
"""

import contextlib
import math
import os
import sys
import time

sys.path.insert(0, "benchmarks/h200_tuning")

import torch  # noqa: E402
from common import ROWS, bw, dump, gt, kdur, rec  # noqa: E402

import k3lab.kernels.mla as mla  # noqa: E402
from k3lab import profile  # noqa: E402
from k3lab.boundaries import mla as MB  # noqa: E402
from k3lab.config import preset  # noqa: E402
from k3lab.reference.mla import mla_decode_reference  # noqa: E402

T0 = time.time()
CFG = preset("kimi-k3", 8)
STUCK_MS = 50  # an eager call (K3 at 128k: ~0.05 ms) slower than this is not graph-timed
SMS = torch.cuda.get_device_properties(0).multi_processor_count
print(f"copy bw {bw / 1e12:.3f} TB/s, {SMS} SMs", flush=True)

KNOBS = ("BLOCK_N", "SPLIT_NUM_WARPS", "SPLIT_NUM_STAGES", "LONG_BLOCK_N", "LONG_NUM_WARPS",
         "LONG_NUM_STAGES", "HON_BLOCK_N", "HON_NUM_WARPS", "HON_NUM_STAGES", "HEADS_ON_N",
         "PARTIAL_DTYPE", "FUSE_COMBINE", "FUSED_COMBINERS", "FUSED_COMBINE_TILE")
DEFAULTS = {k: getattr(mla, k) for k in KNOBS}


@contextlib.contextmanager
def knobs(tile=None, **kw):
    """Set module constants for one variant; tile = (BLOCK_N, warps, stages) for every L_max."""
    if tile is not None:
        bn, nw, ns = tile
        kw.update(BLOCK_N=bn, SPLIT_NUM_WARPS=nw, SPLIT_NUM_STAGES=ns, LONG_BLOCK_N=bn,
                  LONG_NUM_WARPS=nw, LONG_NUM_STAGES=ns, HON_BLOCK_N=bn, HON_NUM_WARPS=nw,
                  HON_NUM_STAGES=ns)
    try:
        for k, v in kw.items():
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


def run(ctx, copies, ref, name, splits=None, tile=None, durations=False, **kw):
    nbytes = ctx * (CFG.kv_lora + CFG.qk_rope) * 2
    with knobs(tile, **kw):
        fn = call(splits)
        # one checked call first (compiles), then a timed one: a wrong or stuck configuration
        # (a fused launch whose combiners spin to MAX_SPIN) is recorded, not graph-timed
        ok = correct(fn, copies[0], ref)
        t = time.perf_counter()
        fn(copies[0])
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - t) * 1e3
        us = gt(fn, copies) if ok and eager_ms < STUCK_MS else float("nan")
        ok = ok and math.isfinite(us) and correct(fn, copies[0], ref)  # after the replays
        dur = kdur(fn, copies[0]) if durations and math.isfinite(us) else None
        eff_tile = tile or mla._split_config(ctx, torch.device("cuda"))
    heur = mla.default_num_splits(1, CFG.mla_heads, ctx, "cuda")
    row = dict(k="mla", ctx=ctx, name=name, splits=splits or heur, heuristic=splits is None,
               tile=list(eff_tile), **{k: str(v) for k, v in kw.items()}, us=us,
               frac=nbytes / bw * 1e6 / us, floor_us=nbytes / bw * 1e6, ok=ok, dur=dur,
               t=round(time.time() - T0, 1))
    rec(**row)
    return row


def inputs_for(ctx):
    nbytes = ctx * (CFG.kv_lora + CFG.qk_rope) * 2
    copies = profile.cold_copies(lambda s: MB.make_inputs(CFG, "cuda", s, M=1, context=ctx),
                                 bytes_per_copy=nbytes)
    i = copies[0]
    ref = mla_decode_reference(i["q_lat"], i["q_rope"], i["kv_cache"], i["seq_lens"],
                               sm_scale=i["sm_scale"])
    return copies, ref


PARTS = sys.argv[1:] or ["32k", "long"]
DUMP = "mla.json" if len(PARTS) == 2 else f"mla_{PARTS[0]}.json"
top = []
for spec in filter(None, os.environ.get("MLA_TOP", "").split(";")):
    s_, bn_, nw_, ns_, hon_ = (int(x) for x in spec.split(","))
    top.append((s_, (bn_, nw_, ns_), bool(hon_)))

# ---------------- 32k: the grid (19 timed configurations)
if "32k" in PARTS:
    ctx = 32768
    copies, ref = inputs_for(ctx)
    S1, S2, S3 = SMS, 2 * SMS, 3 * SMS
    rows = [run(ctx, copies, ref, "default", durations=True)]
    rows.append(run(ctx, copies, ref, "fused", durations=True, FUSE_COMBINE=True))
    rows.append(run(ctx, copies, ref, "fused-c384", FUSE_COMBINE=True, FUSED_COMBINERS=384))
    rows.append(run(ctx, copies, ref, "fused-c132-tile8k", FUSE_COMBINE=True,
                    FUSED_COMBINERS=SMS, FUSED_COMBINE_TILE=8192))
    rows.append(run(ctx, copies, ref, "fp16-partials", durations=True,
                    PARTIAL_DTYPE=torch.float16))
    rows.append(run(ctx, copies, ref, "fused-fp16", durations=True, FUSE_COMBINE=True,
                    PARTIAL_DTYPE=torch.float16))
    # (splits, (BLOCK_N, warps, stages), HEADS_ON_N); shared memory and registers a thread from
    # a local Triton 3.9 sm_90 compile (the default 32 / 4 / 4: 130 KB, 185 registers)
    grid = [
        (S1, (32, 4, 2), False),  # 56 KB, 187
        (S1, (64, 8, 3), False),  # 168 KB, 111 (the long-context default)
        (S1, (64, 4, 2), False),  # 94 KB, 186: two score columns a warp, two mma chains
        (S1, (64, 4, 3), False),  # 168 KB, 177: the same, two tiles in flight
        (S2, (32, 4, 2), False),  # 2 CTAs an SM (registers)
        (S2, (32, 4, 3), False),  # 93 KB: 2 CTAs an SM, two tiles in flight each
        (S2, (32, 2, 2), False),  # 255 + spills, 4 CTAs an SM
        (S3, (32, 2, 2), False),
        (S1, (64, 4, 2), True),  # wgmma, 168 KB, 190 (3 stages would need 242 KB)
        (S1, (64, 8, 2), True),  # 168 KB, 203
        (S1 // 2, (64, 4, 2), True),
    ]
    for s, tile, hon in grid:
        rows.append(run(ctx, copies, ref, "grid", splits=s, tile=tile, durations=True,
                        HEADS_ON_N=hon))
    best = sorted((r for r in rows if r["name"] == "grid" and r["ok"] and math.isfinite(r["us"])),
                  key=lambda r: r["us"])[:3]
    top = [(r["splits"], tuple(r["tile"]), r["HEADS_ON_N"] == "True") for r in best]
    print("top at 32k:", top, flush=True)
    if top:
        s, tile, hon = top[0]
        run(ctx, copies, ref, "best-fused", splits=s, tile=tile, durations=True, HEADS_ON_N=hon,
            FUSE_COMBINE=True)
        run(ctx, copies, ref, "best-fused-fp16", splits=s, tile=tile, durations=True,
            HEADS_ON_N=hon, FUSE_COMBINE=True, PARTIAL_DTYPE=torch.float16)
    del copies, ref
    torch.cuda.empty_cache()
    dump(DUMP)

# ---------------- 64k, 128k: defaults, the 32k top three, fused (7 or 8 each; 34 in all)
for ctx in (65536, 131072) if "long" in PARTS else ():
    copies, ref = inputs_for(ctx)
    run(ctx, copies, ref, "default", durations=True)
    run(ctx, copies, ref, "fused", durations=True, FUSE_COMBINE=True)
    for s, tile, hon in top:
        run(ctx, copies, ref, "top32k", splits=s, tile=tile, durations=True, HEADS_ON_N=hon)
    if top:
        s, tile, hon = top[0]
        run(ctx, copies, ref, "best-fused", splits=s, tile=tile, durations=True,
            HEADS_ON_N=hon, FUSE_COMBINE=True)
        run(ctx, copies, ref, "best-fused-fp16", splits=s, tile=tile, HEADS_ON_N=hon,
            FUSE_COMBINE=True, PARTIAL_DTYPE=torch.float16)
    if ctx == 131072:
        run(ctx, copies, ref, "fixed-4-splits", splits=MB.PEER_FIXED_SPLITS, durations=True)
    del copies, ref
    torch.cuda.empty_cache()
    dump(DUMP)
# ---------------- summary: default and best (correct rows only) per context
for ctx in sorted({r["ctx"] for r in ROWS}):
    rs = [r for r in ROWS if r["ctx"] == ctx and r["ok"] and math.isfinite(r["us"])]
    if not rs:
        continue
    best = min(rs, key=lambda r: r["us"])
    dflt = next((r for r in rs if r["name"] == "default"), None)
    knobs_of = {k: best[k] for k in KNOBS if k in best}
    line = (f"{ctx:>6}: best {best['us']:.1f} us ({best['frac']:.2f} of copy bw; floor "
            f"{best['floor_us']:.1f} us) {best['name']} splits={best['splits']} "
            f"tile={best['tile']} {knobs_of} dur={best['dur']}")
    if dflt:
        line += f"\n        default {dflt['us']:.1f} us ({dflt['frac']:.2f}) dur={dflt['dur']}"
    four = next((r for r in rs if r["name"] == "fixed-4-splits"), None)
    if four:
        ratio = four["us"] / best["us"]
        line += f"\n        4 fixed splits {four['us']:.1f} us: best is {ratio:.2f}x faster"
    print(line, flush=True)
print(f"done in {time.time() - T0:.0f} s", flush=True)
