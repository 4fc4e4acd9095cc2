"""H200, session 8: what the bytes alone cost. Lower bounds for the bars of issues 3, 5 and 6.

Each bar compares a boundary with its bytes at the copy bandwidth. This script times the
bytes-only skeletons of k3lab/floors.py (kernels that only move those bytes, plus the one
dependency the math forces) in the notebooks' conditions (graph replay, cold copies rotated past
the L2, median, per-call share of one graph), over every chunk / warp configuration, and prints
them beside the bars: a correct boundary cannot beat the fastest skeleton. torch.sum of the same
bytes is a second opinion for the read. (Call 1 ran these kernels from this file at 95d23d7;
they moved to k3lab/floors.py unchanged, with the scratch of the update skeleton allocated
before the timed calls as it was here.)

Run from the repo root on the GPU: python3 benchmarks/session8/floors.py (writes
$OUT/floors.json).
"""

import json
import os

import torch
import triton

from k3lab import floors, profile

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
ROWS = []
CHUNKS = {"stream": (16, 32, 64, 128), "update": (8, 16, 32, 64)}


def rec(**r):
    ROWS.append(r)
    print(json.dumps(r), flush=True)


def read_floor(name, nbytes):
    """{then: best us} of the stream skeleton over the chunk and warp grid, and torch.sum's us."""
    best = {}
    for then in floors.THEN:
        for kb in CHUNKS["stream"]:
            for w in (4, 8):
                us = floors.stream_floor_us(nbytes, DEV, then, chunks_kb=(kb,), warps=(w,))
                rec(k=name, shape=then, chunk_kb=kb, warps=w, bytes=nbytes, us=round(us, 3))
                best[then] = min(best.get(then, us), us)
    copies = profile.cold_copies(lambda i: torch.randn(nbytes // 2, device=DEV).bfloat16(),
                                 bytes_per_copy=nbytes)
    ts = profile.time_variant(lambda x: x.sum(dtype=torch.float32), copies, mode="graph",
                              repeats=20).median_us
    rec(k=name, shape="torch.sum", bytes=nbytes, us=round(ts, 3))
    return best, ts


def update_floor(name, state_bytes, w_bytes):
    best = float("inf")
    for kb in CHUNKS["update"]:
        for w in (4, 8):
            us = floors.update_floor_us(state_bytes, w_bytes, DEV, chunks_kb=(kb,), warps=(w,))
            rec(k=name, shape="update", chunk_kb=kb, warps=w, bytes=2 * state_bytes + w_bytes,
                us=round(us, 3))
            best = min(best, us)
    return best


def main():
    bw = profile.copy_bandwidth(DEV)
    tiny = [torch.zeros(1, device=DEV) for _ in range(64)]
    launch = profile.time_variant(lambda x: x.add_(1), tiny, mode="graph", repeats=20).median_us
    rec(k="conditions", copy_TBps=round(bw / 1e12, 3), launch_us=round(launch, 3),
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    summary = {}
    # issue 3: K3 gate weight [896, 7168] bf16; bar: 1.5 x (bytes / copy bw + one launch)
    gate = 896 * 7168 * 2
    best, ts = read_floor("route gate", gate)
    summary["route"] = dict(bar_us=round(1.5 * (gate / bw * 1e6 + launch), 3),
                            torch_sum_us=round(ts, 3), **{k: round(v, 3) for k, v in best.items()})
    # issue 6: K3 tp 8 latent cache, 576 bf16 a position; bar: bytes / copy bw / 0.75
    for ctx in (32768, 65536, 131072):
        kv = ctx * 576 * 2
        best, ts = read_floor(f"mla {ctx}", kv)
        summary[f"mla {ctx}"] = dict(bar_us=round(kv / bw * 1e6 / 0.75, 3),
                                     torch_sum_us=round(ts, 3),
                                     **{k: round(v, 3) for k, v in best.items()})
    # issue 5: K3 state [Hl, 128, 128] fp32 read and written, f_b [Hl * 128, 128] bf16 read;
    # the tp 1 bar: state bytes / copy bw / 0.5 (tp 8's bar is against fla, not the bytes)
    for tp, hl in ((1, 96), (8, 12)):
        state = hl * 128 * 128 * 4
        summary[f"kda tp{tp}"] = dict(update_us=round(update_floor(f"kda tp{tp}", state,
                                                                   hl * 128 * 128 * 2), 3))
    summary["kda tp1"]["bar_us"] = round(2 * 96 * 128 * 128 * 4 / bw * 1e6 / 0.5, 3)
    rec(k="summary", **summary)
    with open(f"{OUT}/floors.json", "w") as fh:
        json.dump(ROWS, fh, indent=1)


if __name__ == "__main__":
    main()
