"""How fast can a Triton kernel stream MXFP4 expert bytes in the MoE kernel's access patterns?

A diagnostic for issue 4 (MXFP4 at tp 1 sits at ~0.5 of copy bandwidth whatever its instruction
count). Each kernel reads the K3 tp-1 stage-1 / stage-2 weight bytes of 16 experts as int32 words
in [ROWS, WORDS] tiles, one K step at a time, and only adds them up (about one integer op a word):
what it reaches is the memory side's ceiling for that pattern, with no decode arithmetic.

- strided: the K-lane tile of kernels/moe.py: a step reads WORDS words of each of ROWS rows (rows
  are N_WORDS words long), so a step touches ROWS short segments ROWS * 4 * N_WORDS bytes apart;
- tiled: the same words stored tile by tile (a step's ROWS x WORDS words contiguous in memory).

With SCALES the E8M0 bytes are read too (WORDS / 4 a row a step). Three copies of the weights
rotate (> 3x the 60 MB L2), timed as a replayed CUDA graph of 12 launches, median of 15 replays;
the copy bandwidth is measured in the same process. Writes $OUT/stream_patterns.json.
"""
import json
import os
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _stream_kernel(p_w, p_s, p_out, N_WORDS, N_GROUPS, ROWS: tl.constexpr, WORDS: tl.constexpr,
                   TILED: tl.constexpr, SCALES: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    o_r = tl.arange(0, ROWS)
    o_c = tl.arange(0, WORDS)
    o_g = tl.arange(0, WORDS // 4)
    base = pid.to(tl.int64) * ROWS * N_WORDS
    base_s = pid.to(tl.int64) * ROWS * N_GROUPS
    acc = tl.zeros([ROWS, WORDS], dtype=tl.int32)
    acc_s = tl.zeros([ROWS, WORDS // 4], dtype=tl.int32)
    for k in tl.range(0, N_WORDS // WORDS, num_stages=STAGES if STAGES > 0 else None):
        if TILED:
            p = p_w + base + k * ROWS * WORDS + o_r[:, None] * WORDS + o_c[None, :]
            q = p_s + base_s + k * ROWS * (WORDS // 4) + o_r[:, None] * (WORDS // 4) + o_g[None, :]
        else:
            p = p_w + base + o_r[:, None] * N_WORDS + k * WORDS + o_c[None, :]
            q = p_s + base_s + o_r[:, None] * N_GROUPS + k * (WORDS // 4) + o_g[None, :]
        acc += tl.load(p)
        if SCALES:
            acc_s += tl.load(q).to(tl.int32)
    tot = tl.sum(tl.sum(acc, axis=1), axis=0)
    if SCALES:
        tot += tl.sum(tl.sum(acc_s, axis=1), axis=0)
    tl.store(p_out + pid, tot)


def copy_bandwidth(n_bytes=1 << 30, reps=20):
    a = torch.empty(n_bytes // 4, dtype=torch.int32, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    return 2 * n_bytes / statistics.median(ts) / 1e12


def time_graph(launch, n_copies, per_graph=12, replays=15):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            launch(i % n_copies)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(per_graph):
            launch(i % n_copies)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3 / per_graph)
    return statistics.median(ts)


def main():
    out = os.environ.get("OUT", ".")
    bw = copy_bandwidth()
    rows = []
    # K3 tp 1, 16 experts: stage 1 w13 [16 * 6144, 3584] -> 448 words a row; stage 2 w2
    # [16 * 3584, 3072] -> 384 words a row
    for stage, n_rows, n_words in (("stage1", 16 * 6144, 448), ("stage2", 16 * 3584, 384)):
        n_groups = n_words // 4
        ws = [torch.randint(-2**31, 2**31 - 1, (n_rows, n_words), dtype=torch.int32,
                            device="cuda") for _ in range(3)]
        ss = [torch.randint(0, 255, (n_rows, n_groups), dtype=torch.uint8, device="cuda")
              for _ in range(3)]
        for r, w, nw, st in ((64, 64, 4, 0), (64, 64, 4, 3), (64, 32, 4, 0), (64, 32, 4, 3),
                             (32, 64, 4, 0), (32, 128, 4, 0), (16, 128, 4, 0), (16, 128, 4, 3),
                             (8, n_words // 2 if n_words % 128 else 128, 4, 0),
                             (32, 64, 8, 0), (64, 64, 8, 3)):
            if n_words % w:
                continue
            for tiled in (False, True):
                for scales in (False, True):
                    res = torch.empty(n_rows // r, dtype=torch.int32, device="cuda")

                    def launch(i, r=r, w=w, nw=nw, st=st, tiled=tiled, scales=scales, res=res,
                               ws=ws, ss=ss, n_words=n_words, n_groups=n_groups):
                        _stream_kernel[(n_rows // r,)](ws[i], ss[i], res, n_words, n_groups,
                                                        ROWS=r, WORDS=w, TILED=tiled,
                                                        SCALES=scales, STAGES=st, num_warps=nw)
                    try:
                        t = time_graph(launch, 3)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        print(stage, r, w, nw, st, tiled, scales, "error", e, flush=True)
                        continue
                    nbytes = n_rows * n_words * 4 + (n_rows * n_groups if scales else 0)
                    row = dict(stage=stage, rows=r, words=w, warps=nw, stages=st,
                               tiled=tiled, scales=scales, us=t * 1e6,
                               frac=nbytes / t / 1e12 / bw, copy_TBps=bw)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del ws, ss
        torch.cuda.empty_cache()
    with open(os.path.join(out, "stream_patterns.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
