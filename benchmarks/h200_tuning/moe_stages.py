"""What the MoE stage sweeps share (benchmarks/session6/moe_mma_sweep.py,
benchmarks/session7/moe_tiles_sweep.py): K3 B1 MXFP4 stage inputs in cold copies with the fp32
reference outputs, and the correctness check at the tests' tolerances."""

import dataclasses

import torch

from k3lab.boundaries import moe as MB
from k3lab.config import preset
from k3lab.reference import moe as ref

# tests/test_moe.py's A_ATOL / A_RTOL (stage 1's bf16 activations) and Y_ATOL / Y_RTOL (stage 2)
STAGE_TOL = {"stage1": (1e-3, 2 ** -8), "stage2": (2e-5, 1e-5)}


def stage_setup(tp: int, n_copies: int, name: str = "kimi-k3", device: str = "cuda",
                latent: int | None = None, all_experts: bool = False):
    """(copies, wants): ``n_copies`` stage inputs (k3lab.boundaries.moe.stage_inputs) sharing
    nothing but their experts' layout, M = 1, MXFP4 experts; tp 1 keeps 48 experts so that 3
    copies of 16 rotate cold (all_experts: the preset's, as the 20_moe report builds them);
    latent: another latent size D. wants: {stage: fp32 reference output of copy 0}."""
    cfg = preset(name, tp)
    if tp == 1 and not all_experts:
        cfg = dataclasses.replace(cfg, n_experts=48)
    if latent:
        cfg = dataclasses.replace(cfg, latent=latent)
    base = MB.make_inputs(cfg, device, 0, M=1, expert_format="mxfp4")
    copies = [MB.stage_inputs(c) for c in MB.copies_sharing_experts(base, n_copies)]
    c0 = copies[0]
    wants = {"stage1": ref.moe_stage1_reference(
        c0["z"], c0["plan"], c0["weights"]["w13"], activation=cfg.activation,
        situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta),
        "stage2": ref.moe_stage2_reference(c0["a"], c0["plan"], c0["weights"]["w2"])}
    return copies, wants


def check_stage(stage: str, fn, inp, want):
    """(ok, max abs error, max abs reference) of stage function ``fn`` on ``inp`` against
    ``want`` at STAGE_TOL (stage 2 first zeroes the plan's accumulator)."""
    if stage == "stage2":
        inp["plan"].out.zero_()
    got = fn(inp).float()
    atol, rtol = STAGE_TOL[stage]
    err = (got - want).abs()
    ok = bool((err <= atol + rtol * want.abs()).all()) and bool(torch.isfinite(got).all())
    return ok, float(err.max()), float(want.abs().max())


def stage_row(copies, wants, stage: str, key: str, t0: float, **tags) -> None:
    """One row of the fused ``stage`` (k3lab.boundaries.moe.stage_fns' "fused") over cold
    ``copies``: checked against ``wants`` (check_stage), median graph us of 10, fraction of the
    copy bandwidth on the stage's bytes; recorded under k=``key`` (a failed config as NaN)."""
    import time
    import traceback

    from common import bw, gt, rec

    fn = MB.stage_fns(stage)["fused"]
    nbytes = MB.stage_bytes(stage, copies[0])
    try:
        ok, err, _ = check_stage(stage, fn, copies[0], wants[stage])
        us = gt(fn, copies, repeats=10)
        rec(k=key, stage=stage, us=round(us, 2), frac=round(nbytes / bw * 1e6 / us, 3), ok=ok,
            max_err=err, t=round(time.time() - t0, 1), **tags)
    except Exception:
        traceback.print_exc()
        rec(k=key, stage=stage, us=float("nan"), ok=False, **tags)


SETUPS = {"bench": dict(tp=1, n_copies=3), "report": dict(tp=1, n_copies=2, all_experts=True)}


def named_setup(name: str):
    """stage_setup in the named K3 tp 1 conditions: "bench" (48 experts, 3 cold copies of 16) or
    "report" (all 896 experts, 2 copies, as the 20_moe report builds them)."""
    return stage_setup(**SETUPS[name])


def report_copies():
    """(copies, wants) as stage_setup gives them in the 20_moe report's conditions (K3 tp 1, all
    896 experts, 2 copies), the fused variant reading the experts in the tiled layout."""
    copies, wants = named_setup("report")
    assert copies[0]["weights"].fused_experts["w2"].layout == "tiled"
    return copies, wants


def reps_pdl(reps: int, values=(0, None)):
    """(rep, PDL_STEPS) for each of ``reps`` repetitions and each value, with
    kernels/moe.PDL_STEPS set to it (None: no PDL); 0, the default, afterwards."""
    from k3lab.kernels import moe

    for rep in range(reps):
        for steps in values:
            moe.PDL_STEPS = steps
            yield rep, steps
    moe.PDL_STEPS = 0


def stage_rows(key: str, t0: float, reps: int, stages=("stage1", "stage2"), **tags) -> None:
    """stage_row of each of ``stages`` in the report's conditions (report_copies), for each
    (rep, PDL_STEPS) of reps_pdl(reps), under k=``key`` with ``tags``."""
    copies, wants = report_copies()
    for rep, steps in reps_pdl(reps):
        for stage in stages:
            stage_row(copies, wants, stage, key, t0, pdl=steps, rep=rep, **tags)
