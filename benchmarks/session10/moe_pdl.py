"""H200, issue 4 (session 10): the MXFP4 stages with programmatic dependent launch
(kernels/moe.PDL_STEPS), and the stages' speed against their grid's waves.

1. PDL: K3 B1 tp 1 (48 experts, 3 cold copies of 16), prepared activations (as moe_block runs
   the stages), graph replay (each replay a run of back-to-back calls over the copies: with PDL
   a call's programs may start during the previous call's last wave), median of 10, for
   PDL_STEPS in STEPS ("off" = None), interleaved, twice.
2. WAVES: stage 2 (and stage 1) with PDL off at other latent sizes D (stage 2's grid is
   16 * D / 64 programs of the (2, 2) tile, against 132 SMs x 4 programs = 528 slots: 3072 ->
   1.45 waves, 3584 -> 1.70, 4096 -> 1.94): whether a partial last wave costs what the
   stage-2 gap is.

Each row: median graph us, fraction of the copy bandwidth on the stage's bytes (the report's
metric), correctness against the fp32 reference at the tests' tolerances. From the repo root:
    python3 benchmarks/session10/moe_pdl.py        # writes $OUT/moe_pdl.json
"""

import dataclasses
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, gt, rec  # noqa: E402
from moe_stages import stage_row, stage_setup  # noqa: E402

from k3lab import profile  # noqa: E402
from k3lab.boundaries import moe as MB  # noqa: E402
from k3lab.config import preset  # noqa: E402
from k3lab.kernels import moe  # noqa: E402

STEPS = [None if s == "off" else int(s)
         for s in os.environ.get("STEPS", "off 0 2 4 14").split()]
WAVES = [int(d) for d in os.environ.get("WAVES", "3072 4096").split()]
T0 = time.time()
print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)


def setup(latent=None):
    """(copies, wants) of K3 tp 1 (48 experts, 3 cold copies), at another latent size D."""
    return stage_setup(1, 3, latent=latent)


def block_copies(tp):
    """moe_block inputs with routing, MXFP4, cold copies: K3 tp 1 (48 experts, 3 copies) or
    tp 8 (4 copies)."""
    cfg = preset("kimi-k3", tp)
    if tp == 1:
        cfg = dataclasses.replace(cfg, n_experts=48)
    base = MB.make_inputs(cfg, "cuda", 0, M=1, expert_format="mxfp4", route=True)
    return MB.copies_sharing_experts(base, 3 if tp == 1 else 4)


def block_row(copies, **tags):
    """One row of the fused block (k3lab.boundaries.moe's, with routing): checked against the
    fp32 truth, launches, median graph us."""
    try:
        err = MB.check(MB._fused(copies[0]), None, copies[0])["out"]
        launches = profile.count_launches(MB._fused, copies[0]).count
        us = gt(MB._fused, copies, repeats=10)
        rec(k="moe_pdl_block", us=round(us, 2), err=err, launches=launches,
            t=round(time.time() - T0, 1), **tags)
    except Exception:
        traceback.print_exc()
        rec(k="moe_pdl_block", us=float("nan"), **tags)


def block_sweep(steps):
    """The block at tp 1 and 8, fused tail or apart, PDL off or PDL_STEPS ``steps``, twice."""
    for tp in (1, 8):
        copies = block_copies(tp)
        for rep in range(2):
            for fuse in (True, False):
                for pdl in (None, steps):
                    MB.FUSE_TAIL, moe.PDL_STEPS = fuse, pdl
                    block_row(copies, tp=tp, fuse_tail=fuse, pdl="off" if pdl is None else pdl,
                              rep=rep)
        del copies
        torch.cuda.empty_cache()
    MB.FUSE_TAIL = True


def row(copies, wants, **tags):
    for stage in ("stage1", "stage2"):
        stage_row(copies, wants, stage, "moe_pdl", T0, **tags)


def main():
    copies, wants = setup()
    for rep in range(2):
        for steps in STEPS:
            moe.PDL_STEPS = steps
            row(copies, wants, pdl="off" if steps is None else steps, latent=3584, rep=rep)
    moe.PDL_STEPS = None
    del copies, wants
    for latent in WAVES:
        torch.cuda.empty_cache()
        copies, wants = setup(latent)
        row(copies, wants, pdl="off", latent=latent, rep=0)
        del copies, wants
    dump("moe_pdl.json")
    print("done", round(time.time() - T0, 1), flush=True)


if __name__ == "__main__":
    main()
