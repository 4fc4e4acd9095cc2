"""H200 sweep 3: MoE stages at K3 tp 8 (warps x program target) against the grouped peer."""

import importlib
import itertools

import torch
from common import bw, dump, gt, rec

from k3lab.config import preset

moe = importlib.import_module("k3lab.kernels.moe")
from k3lab.boundaries import moe as MB  # noqa: E402

for fmt in ("bf16", "mxfp4"):
    cfg = preset("kimi-k3", 8)
    base = MB.make_inputs(cfg, "cuda", 0, M=1, expert_format=fmt)
    copies = [MB.stage_inputs(c) for c in MB.copies_sharing_experts(base, 8)]
    for stage in MB.STAGES:
        fns = MB.stage_fns(stage)
        nbytes = MB.stage_bytes(stage, copies[0])
        g = gt(fns["grouped"], copies)
        for nw, tgt in itertools.product((4, 8), (528, 1056)):
            moe.NUM_WARPS, moe.TARGET_PROGRAMS = nw, tgt
            us = gt(fns["fused"], copies)
            rec(
                k="moe8",
                fmt=fmt,
                stage=stage,
                nw=nw,
                tgt=tgt,
                us=us,
                grouped=g,
                x=g / us,
                frac=nbytes / bw * 1e6 / us,
            )
        moe.NUM_WARPS, moe.TARGET_PROGRAMS = 4, 528
    del copies, base
    torch.cuda.empty_cache()
dump("sweep3.json")
