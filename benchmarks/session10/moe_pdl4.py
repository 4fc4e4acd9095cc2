"""H200, issue 4 (session 10, call 8): why stage 1 with PDL is slower inside moe_block at tp 1
(call 3) though faster back to back. moe_block with routing at K3 tp 1 (48 experts, 3 cold
copies), captured as one CUDA graph of the 3 calls; one replay under torch.profiler (CUPTI
kernel records of the graph's nodes): each kernel's start (relative to the replay's first
kernel), duration and gap after the previous kernel, per variant (switches of kernels/moe.py).

    python3 benchmarks/session10/moe_pdl4.py        # writes $OUT/moe_pdl4.json
"""

import dataclasses
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks/h200_tuning")
from common import dump, rec  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.config import preset  # noqa: E402
from k3lab.kernels import moe  # noqa: E402
from k3lab.profile import short_kernel_name  # noqa: E402

VARIANTS = {  # fuse_tail, PDL_STEPS, PDL_BLOCK_STAGE1, PDL_FRONT_TRIGGER, PDL_STAGE1_TRIGGER
    "apart_s1trig_s2tail": (False, 2, False, False, True),
    "apart_all": (False, 2, True, False, False),
    "apart_all_steps0": (False, 0, True, False, False),
    "fused_off": (True, None, False, False, False),
    "fused_s1": (True, 2, True, False, False),
}
cfg = dataclasses.replace(preset("kimi-k3", 1), n_experts=48)
base = MB.make_inputs(cfg, "cuda", 0, M=1, expert_format="mxfp4", route=True)
copies = MB.copies_sharing_experts(base, 3)
for name, (fuse, steps, s1, front, s1trig) in VARIANTS.items():
    MB.FUSE_TAIL, moe.PDL_STEPS = fuse, steps
    moe.PDL_BLOCK_STAGE1, moe.PDL_FRONT_TRIGGER, moe.PDL_STAGE1_TRIGGER = s1, front, s1trig
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in copies:
            MB._fused(c)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in copies:
            MB._fused(c)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for rep in range(2):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                    key=lambda e: e.time_range.start)
        t0, prev_end = ev[0].time_range.start, None
        for k, e in enumerate(ev):
            s, t = e.time_range.start - t0, e.time_range.end - t0
            rec(k="timeline", variant=name, rep=rep, i=k, kernel=short_kernel_name(e.name, 40),
                start=round(s, 2), dur=round(t - s, 2),
                gap=None if prev_end is None else round(s - prev_end, 2))
            prev_end = t
    del graph
dump("moe_pdl4.json")
