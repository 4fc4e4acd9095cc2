"""Eager launches for Nsight Compute (issue 4 diagnostics; no timing here).

    ncu --section SpeedOfLight --section WarpStateStats ... python3 -m benchmarks.session5.ncu_moe

runs, three times each: the synthetic decode kernel of decode_ceiling.py (64 x 64 tiles, 4 warps,
3 stages, with and without the decode), then the fused MXFP4 stage 1 and stage 2 at K3 tp 1
(48 experts, B1) as kernels/moe.py's defaults launch them.
"""
import dataclasses
import sys

import torch

from benchmarks.session5.decode_ceiling import _decode_kernel
from k3lab.boundaries import moe as MB
from k3lab.config import preset

n_rows, n_words = 16 * 6144, 448
w = torch.randint(-2**31, 2**31 - 1, (n_rows, n_words), dtype=torch.int32, device="cuda")
x = torch.randn(n_words * 8, device="cuda")
res = torch.empty(n_rows, device="cuda")
for dec in (0, 1):
    for _ in range(3):
        _decode_kernel[(n_rows // 64,)](w, x, res, n_words, ROWS=64, WORDS=64, TILED=False,
                                        STAGES=3, DECODE=dec, num_warps=4)
torch.cuda.synchronize()
del w
cfg = dataclasses.replace(preset("kimi-k3", 1), n_experts=48)
c0 = MB.stage_inputs(MB.make_inputs(cfg, "cuda", 0, M=1, expert_format="mxfp4"))
for stage in ("stage1", "stage2"):
    fn = MB.stage_fns(stage)["fused"]
    for _ in range(3):
        if stage == "stage2":
            c0["plan"].out.zero_()
        fn(c0)
torch.cuda.synchronize()
print("ok", file=sys.stderr)
