"""H200 sweep 1: launch cost, AttnRes, KDA, route, MLA and MoE tuning knobs (graph, cold)."""

import importlib
import itertools
import sys
import time

import torch
from common import bw, dump, gt, kdur, rec

from k3lab import profile
from k3lab.boundaries import get
from k3lab.config import preset

T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)
only = sys.argv[1:] or ["launch", "attn", "kda", "route", "mla", "moe"]


if "launch" in only:
    tiny = [torch.zeros(1, device="cuda") for _ in range(64)]
    rec(
        k="launch",
        us=gt(lambda x: x.add_(1), tiny),
        us_1call=gt(lambda x: x.add_(1), tiny[:1], min_calls=1),
    )

# ---------------- attn_res
if "attn" in only:
    ar = importlib.import_module("k3lab.kernels.attn_res")
    B = get("attn_res")
    cfg = preset("kimi-k3", 8)
    for n in (0, 1, 4, 8):
        copies = profile.cold_copies(lambda s: B.make_inputs(cfg, "cuda", s, M=1, n_sealed=n))
        ref = B.variant("reference").fn
        fus = B.variant("fused").fn
        r_us = gt(ref, copies)
        for nw, te in itertools.product((4, 8, 16), (8192, 16384, 32768)):
            ar.NUM_WARPS, ar.TILE_ELEMS = nw, te
            f_us = gt(fus, copies)
            rec(k="attn", n=n, nw=nw, te=te, us=f_us, ref=r_us, x=r_us / f_us)
        ar.NUM_WARPS, ar.TILE_ELEMS = 8, 16384
        del copies
    dump("sweep1.json")

# ---------------- KDA
if "kda" in only:
    kda = importlib.import_module("k3lab.kernels.kda")
    K = get("kda")
    for tp in (8, 1):
        cfg = preset("kimi-k3", tp)
        hl = cfg.kda_heads
        sbytes = 2 * hl * 128 * 128 * 4
        copies = profile.cold_copies(
            lambda s: K.make_inputs(cfg, "cuda", s, M=1), bytes_per_copy=sbytes
        )
        fla_us = gt(K.variant("fla-core").fn, copies)
        rec(k="kda-fla", tp=tp, us=fla_us, dur=kdur(K.variant("fla-core").fn, copies[0]))
        for bv, br, mw in itertools.product((16, 32, 64, 128), (32, 64, 128), (4, 8, 16)):
            kda.BLOCK_R, kda.MAX_WARPS = br, mw
            fn = lambda i, b=bv: kda.kda_decode(
                i["q"],
                i["k"],
                i["v"],
                i["f_low"],
                i["f_b"],
                i["A_log"],
                i["dt_bias"],
                i["b_logits"],
                i["state"],
                lower_bound=-5.0,
                block_v=b,
            )
            us = gt(fn, copies)
            rec(
                k="kda",
                tp=tp,
                bv=bv,
                br=br,
                mw=mw,
                us=us,
                frac=sbytes / bw * 1e6 / us,
                vs_fla=fla_us / us,
                dur=kdur(fn, copies[0]) if (br == 128 and mw == 8) else None,
            )
        kda.BLOCK_R, kda.MAX_WARPS = 32, 8
        del copies
        torch.cuda.empty_cache()
    dump("sweep1.json")

# ---------------- route (current two-launch kernel): breakdown + GEMV tiles
if "route" in only:
    rs = importlib.import_module("k3lab.kernels.route_sort")
    R = get("route")
    cfg = preset("kimi-k3", 8)
    copies = profile.cold_copies(lambda s: R.make_inputs(cfg, "cuda", s, M=1))
    gbytes = copies[0]["gate_weight"].nbytes
    rec(k="route-ref", us=gt(R.variant("reference").fn, copies))
    for be, bk, nw in itertools.product((8, 16, 32, 64), (128, 256, 512, 1024), (4, 8)):
        rs.NUM_WARPS = nw
        fn = lambda i, be=be, bk=bk: rs.route_sort(
            i["hidden"],
            i["gate_weight"],
            i["correction_bias"],
            top_k=16,
            out_dim=3584,
            gemv_block_e=be,
            gemv_block_k=bk,
        )
        us = gt(fn, copies)
        rec(k="route", be=be, bk=bk, nw=nw, us=us, floor=gbytes / bw * 1e6, dur=kdur(fn, copies[0]))
    rs.NUM_WARPS = 4
    del copies
    dump("sweep1.json")

# ---------------- MLA
if "mla" in only:
    mla = importlib.import_module("k3lab.kernels.mla")
    M_ = get("mla")
    cfg = preset("kimi-k3", 8)
    for ctx in (32768, 65536, 131072):
        nbytes = ctx * 576 * 2
        copies = profile.cold_copies(
            lambda s: M_.make_inputs(cfg, "cuda", s, M=1, context=ctx), bytes_per_copy=nbytes
        )
        for bn, nw, ns, splits in itertools.product((32, 64), (4, 8), (3, 4), (66, 132, 264)):
            if bn == 64 and ns == 4:
                continue
            mla.BLOCK_N, mla.SPLIT_NUM_WARPS, mla.SPLIT_NUM_STAGES = bn, nw, ns
            fn = lambda i, s=splits: mla.mla_decode(
                i["q_lat"],
                i["q_rope"],
                i["kv_cache"],
                i["seq_lens"],
                sm_scale=i["sm_scale"],
                num_splits=s,
            )
            us = gt(fn, copies)
            rec(
                k="mla",
                ctx=ctx,
                bn=bn,
                nw=nw,
                ns=ns,
                splits=splits,
                us=us,
                frac=nbytes / bw * 1e6 / us,
                dur=kdur(fn, copies[0]) if splits == 132 else None,
            )
        mla.BLOCK_N, mla.SPLIT_NUM_WARPS, mla.SPLIT_NUM_STAGES = 32, 4, 4
        del copies
        torch.cuda.empty_cache()
    dump("sweep1.json")

# ---------------- MoE stages at tp1 (fewer experts: same bytes per selected expert)
if "moe" in only:
    import dataclasses

    moe = importlib.import_module("k3lab.kernels.moe")
    from k3lab.boundaries import moe as MB

    for fmt in ("bf16", "mxfp4"):
        cfg = dataclasses.replace(preset("kimi-k3", 1), n_experts=48)
        base = MB.make_inputs(cfg, "cuda", 0, M=1, expert_format=fmt)
        copies = MB.copies_sharing_experts(base, 3)
        copies = [MB.stage_inputs(c) for c in copies]
        for stage in ("stage1", "stage2"):
            fns = MB.stage_fns(stage)
            nbytes = MB.stage_bytes(stage, copies[0])
            for tgt, mr, pb, nw in itertools.product(
                (528, 1056), (16, 32, 64), (4096, 8192), (4, 8)
            ):
                moe.TARGET_PROGRAMS, moe.MAX_ROWS, moe.PRODUCT_BUDGET, moe.NUM_WARPS = (
                    tgt,
                    mr,
                    pb,
                    nw,
                )
                us = gt(fns["fused"], copies, repeats=10)
                rec(
                    k="moe",
                    fmt=fmt,
                    stage=stage,
                    tgt=tgt,
                    mr=mr,
                    pb=pb,
                    nw=nw,
                    us=us,
                    frac=nbytes / bw * 1e6 / us,
                )
            moe.TARGET_PROGRAMS, moe.MAX_ROWS, moe.PRODUCT_BUDGET, moe.NUM_WARPS = 528, 32, 4096, 4
        del copies, base
        torch.cuda.empty_cache()
        dump("sweep1.json")
        print("elapsed", time.time() - T0, flush=True)
dump("sweep1.json")
print("done", time.time() - T0)
