"""H200, issue 4 (session 12): is stage 2's bimodal speed the SM clock? One CUDA graph holds a
probe kernel, 32 stage-2 calls (the 20_moe report's conditions: K3 B1 tp 1, all 896 experts, 2
cold copies, tiled experts, PDL_STEPS 0) and the probe again. Each probe program writes its SM
(%smid), the SM's cycle counter (%clock64) and the global nanosecond timer (%globaltimer); an SM
seen by both probes gives the mean SM clock over the replay (cycles / ns), and the timer gives
the replay's length (us a call: the probes' own time included, a few us in 32 calls). Replays
REPS times under each of SCHEDULES (see main); the rows carry the check of the first copy's
output against the fp32 reference.

    python3 benchmarks/session12/clock_probe.py        # writes $OUT/clock_probe.json
"""

import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, rec  # noqa: E402
from moe_stages import check_stage, report_copies, stage_row  # noqa: E402

from k3lab.boundaries import moe as MB  # noqa: E402

REPS = int(os.environ.get("REPS", "24"))
IDLE = float(os.environ.get("IDLE", "0.3"))
CALLS = 32


@triton.jit
def _probe(p_out):
    """Program i: out[i] = (SM id, SM cycle counter, global ns timer)."""
    z = tl.zeros([1], tl.int32)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [z], dtype=tl.int32,
                                   is_pure=False, pack=1)
    clk = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [z], dtype=tl.int64,
                                    is_pure=False, pack=1)
    ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [z], dtype=tl.int64,
                                   is_pure=False, pack=1)
    o = tl.program_id(0) * 3 + tl.arange(0, 1)
    tl.store(p_out + o, sm.to(tl.int64))
    tl.store(p_out + o + 1, clk)
    tl.store(p_out + o + 2, ns)


def _graph(fn, copies, starts, ends, n_sm, lead=True, trail=True):
    """A CUDA graph: probe (lead), CALLS calls of fn over the copies, probe (trail)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if lead:
            _probe[(2 * n_sm,)](starts)
        for i in range(CALLS):
            fn(copies[i % len(copies)])
        if trail:
            _probe[(2 * n_sm,)](ends)
    return graph


def _clock(starts, ends):
    """(median SM MHz, lowest SM MHz, SMs seen by both probes, us a call) of the last replay."""
    s, e = starts.cpu().tolist(), ends.cpu().tolist()
    first = {r[0]: r for r in s}
    mhz = [(b[1] - first[b[0]][1]) / (b[2] - first[b[0]][2]) * 1e3 for b in e
           if b[0] in first and b[2] > first[b[0]][2]]
    span_ns = max(r[2] for r in e) - min(r[2] for r in s)
    return statistics.median(mhz), min(mhz), len(mhz), span_ns / 1e3 / CALLS


def main():
    """SCHEDULES: "same" (one capture replayed; every fourth replay after IDLE s of sleep),
    "recapture" (a new capture each replay), "stage1" (one capture, a stage-1 graph replayed
    before each replay), "recapture+stage1", "queued" (5 replays back to back timed by events,
    as profile.time_variant does; the clock of the last), "queued-bare", "queued-lead",
    "queued-trail" (the same graph without the probes, or with the leading or the trailing one
    only), "harness" (moe_stages.stage_row itself: profile.time_variant's graph of the stage)."""
    copies, wants = report_copies()
    fns = {st: MB.stage_fns(st)["fused"] for st in ("stage1", "stage2")}
    ok, err, _ = check_stage("stage2", fns["stage2"], copies[0], wants["stage2"])
    nbytes = MB.stage_bytes("stage2", copies[0])
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    starts = torch.zeros((2 * n_sm, 3), dtype=torch.int64, device="cuda")
    ends = torch.zeros_like(starts)
    s1_starts, s1_ends = torch.zeros_like(starts), torch.zeros_like(starts)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(4):
            fns["stage1"](copies[i % 2])
            fns["stage2"](copies[i % 2])
        _probe[(2 * n_sm,)](starts)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    stage1 = _graph(fns["stage1"], copies, s1_starts, s1_ends, n_sm)
    t0 = time.time()
    for schedule in os.environ.get("SCHEDULES", "same recapture stage1 recapture+stage1").split():
        if schedule == "harness":  # the benchmark rows' own timing: profile.time_variant
            for rep in range(REPS):
                stage_row(copies, wants, "stage2", "clock_probe", t0, schedule=schedule, rep=rep)
            continue
        probes = {"bare": (False, False), "lead": (True, False), "trail": (False, True)}
        graph = _graph(fns["stage2"], copies, starts, ends, n_sm,
                       *probes.get(schedule.split("-")[-1], (True, True)))
        t_end = time.time() + 0.2  # warm up: as profile.WARMUP_SECONDS
        while time.time() < t_end:
            graph.replay()
            torch.cuda.synchronize()
        if schedule.startswith("queued"):  # as profile.time_variant: 5 replays back to back,
            # timed by events; queued-bare / -lead / -trail: without the probes or with one
            for rep in range(REPS):
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
                ev[0].record()
                for i in range(5):
                    graph.replay()
                    ev[i + 1].record()
                torch.cuda.synchronize()
                us = statistics.median(ev[i].elapsed_time(ev[i + 1]) * 1e3 / CALLS
                                       for i in range(5))
                mhz, mhz_min, sms, _ = (_clock(starts, ends) if schedule == "queued"
                                        else (float("nan"),) * 3 + (0,))  # the last replay's
                rec(k="clock_probe", schedule=schedule, rep=rep, sm_mhz=round(mhz, 1),
                    sm_mhz_min=round(mhz_min, 1), sms=sms, us=round(us, 2),
                    frac=round(nbytes / bw * 1e6 / us, 3), ok=ok, max_err=err,
                    t=round(time.time() - t0, 2))
            continue
        for rep in range(REPS):
            gap = IDLE if schedule == "same" and rep % 4 == 0 else 0.0
            if gap:
                time.sleep(gap)
            if "recapture" in schedule:
                del graph
                graph = _graph(fns["stage2"], copies, starts, ends, n_sm)
            if "stage1" in schedule:
                stage1.replay()
            graph.replay()
            torch.cuda.synchronize()
            mhz, mhz_min, sms, us = _clock(starts, ends)
            rec(k="clock_probe", schedule=schedule, rep=rep, idle_before_s=gap,
                sm_mhz=round(mhz, 1), sm_mhz_min=round(mhz_min, 1), sms=sms, us=round(us, 2),
                frac=round(nbytes / bw * 1e6 / us, 3), ok=ok, max_err=err,
                t=round(time.time() - t0, 2))
    dump("clock_probe.json")


if __name__ == "__main__":
    main()
