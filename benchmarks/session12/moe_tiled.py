"""H200, issue 4 (session 12): the MXFP4 stages reading their expert weights in the tiled layout
(k3lab.weights.mxfp4_tiled_codes, as k3lab.kernels.moe_kernel_weights lays them out: each
warp's 16-byte loads read 512 contiguous bytes, not 64 bytes of each of 8 rows) against the row
layout, in the benchmark's conditions (48 experts, 3 cold copies of 16) and the 20_moe report's
(all 896 experts, 2 copies), PDL off and PDL_STEPS 0, interleaved, REPS times. K3 B1 tp 1,
prepared activations, graph replay back to back, median of 10, fraction of the copy bandwidth
on the stage's bytes, checked against the fp32 reference of the row-layout weights.

    python3 benchmarks/session12/moe_tiled.py        # writes $OUT/moe_tiled.json
"""

import os
import sys
import time

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump  # noqa: E402
from moe_stages import named_setup, reps_pdl, stage_row  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.kernels import moe_kernel_weights  # noqa: E402

REPS = int(os.environ.get("REPS", "3"))
SETUPS = os.environ.get("SETUPS", "bench report").split()
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)


def with_fused_experts(copies, experts: dict):
    """The copies with the fused variant reading ``experts`` (w13, w2; shared by all)."""
    return [{**c, "weights": MB.Weights(dict(c["weights"]), fused_experts=experts)}
            for c in copies]


def main():
    for setup in SETUPS:
        copies, wants = named_setup(setup)
        w = {k: copies[0]["weights"][k] for k in ("w13", "w2")}
        layouts = {"rows": with_fused_experts(copies, w),
                   "tiled": with_fused_experts(copies, moe_kernel_weights(w))}
        assert layouts["tiled"][0]["weights"].fused_experts["w2"].layout == "tiled"
        for rep, steps in reps_pdl(REPS):
            for name, cs in layouts.items():
                for stage in ("stage1", "stage2"):
                    stage_row(cs, wants, stage, "moe_tiled", T0, setup=setup, layout=name,
                              pdl=steps, rep=rep)
        del copies, wants, layouts, w
        torch.cuda.empty_cache()
    dump("moe_tiled.json")
    print("done", round(time.time() - T0, 1), flush=True)


if __name__ == "__main__":
    main()
