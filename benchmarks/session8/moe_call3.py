"""H200, issue 4 (session 8, calls 3, 4 and 7): the MXFP4 tensor-core stages with plain and with
prepared activations (z / a in mxfp4_mma.mma_prepare_x's layout, as the producers write them),
K3 B1, graph replay, cold copies; tp 1: 48 experts, 3 copies of 16; tp 8: 8 copies. Each variant
twice, interleaved. Calls 3 and 4 (07ac0ae, 2382648) passed the copies through a private probe
switch of kernels/moe.py; since then the stage APIs take them (moe_stage1's z_mma, moe_stage2's
a_mma), which this script calls: the same kernels.

Each row: median graph us, fraction of the copy bandwidth on the stage's bytes (the report's
metric), correctness against the fp32 reference at the tests' tolerances. From the repo root:
    TAG=head python3 benchmarks/session8/moe_call3.py        # writes $OUT/moe_call3_<TAG>.json
"""

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, gt, rec  # noqa: E402
from moe_stages import check_stage, stage_setup  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.kernels import moe_stage1, moe_stage2  # noqa: E402

TAG = os.environ.get("TAG", "head")
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s, {TAG}", flush=True)
ORDER = ("plain", "prepared", "plain", "prepared")


def plain_fns(stage):
    """The stage without its prepared input (stage_inputs' copies dropped)."""
    if stage == "stage1":
        return lambda i: moe_stage1(i["z"], i["plan"], i["weights"]["w13"],
                                    activation=i["cfg"].activation, situ_beta=i["cfg"].situ_beta,
                                    situ_linear_beta=i["cfg"].situ_linear_beta)
    return lambda i: moe_stage2(i["a"], i["plan"], i["weights"]["w2"])


def run(tp, n_copies, order):
    copies, wants = stage_setup(tp, n_copies)
    for variant in order:
        inputs = copies
        for stage in ("stage1", "stage2"):
            fn = MB.stage_fns(stage)["fused"] if variant == "prepared" else plain_fns(stage)
            nbytes = MB.stage_bytes(stage, copies[0])
            try:
                ok, err, _ = check_stage(stage, fn, inputs[0], wants[stage])
                us = gt(fn, inputs, repeats=10)
                rec(k="moe_call3", tag=TAG, tp=tp, stage=stage, variant=variant,
                    us=round(us, 2), frac=round(nbytes / bw * 1e6 / us, 3), ok=ok, max_err=err,
                    t=round(time.time() - T0, 1))
            except Exception:
                traceback.print_exc()
                rec(k="moe_call3", tag=TAG, tp=tp, stage=stage, variant=variant,
                    us=float("nan"), ok=False)
    del copies
    torch.cuda.empty_cache()


for args in ((1, 3, ORDER), (8, 8, ORDER[:2])):
    try:
        run(*args)
    except Exception:
        traceback.print_exc()
    dump(f"moe_call3_{TAG}.json")
print("done", round(time.time() - T0, 1), flush=True)
