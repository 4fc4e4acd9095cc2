"""H200 sweep 4: route_sort with the threshold top-k over GEMV tiles; KDA warps x f_b chunk."""

import importlib
import itertools

import torch
from common import bw, dump, gt, kdur, rec

from k3lab import profile
from k3lab.boundaries import get
from k3lab.config import preset

rs = importlib.import_module("k3lab.kernels.route_sort")
R = get("route")
cfg = preset("kimi-k3", 8)
copies = profile.cold_copies(lambda s: R.make_inputs(cfg, "cuda", s, M=1))
tiny = [torch.zeros(1, device="cuda") for _ in range(64)]
launch = gt(lambda x: x.add_(1), tiny)
floor = copies[0]["gate_weight"].nbytes / bw * 1e6 + launch
for be, bk, nw in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8)):
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
    rec(
        k="route2",
        be=be,
        bk=bk,
        nw=nw,
        us=us,
        floor=floor,
        ratio=us / floor,
        dur=kdur(fn, copies[0]),
    )
rs.NUM_WARPS = 4
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
    for tpw, br in itertools.product((256, 512, 1024), (32, 64, 128)):
        kda.BLOCK_R, kda.TILE_PER_WARP, kda.MAX_WARPS = br, tpw, 16
        fn = lambda i: kda.kda_decode(
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
            block_v=32,
        )
        us = gt(fn, copies)
        rec(
            k="kda3",
            tp=tp,
            tpw=tpw,
            br=br,
            us=us,
            frac=sbytes / bw * 1e6 / us,
            vs_fla=fla_us / us,
            fla=fla_us,
        )
    kda.BLOCK_R, kda.TILE_PER_WARP, kda.MAX_WARPS = 64, 1024, 8
    del copies
dump("sweep4.json")
