"""H200, issue 4 (session 11, call 3): is the MXFP4 stages' ~0.70 of the copy bandwidth their
weight-load pattern or their arithmetic? Load-only kernels over stage 2's weight bytes at K3
tp 1 (16 experts x 3584 rows x 1536 bytes, 3 cold copies), graph replay, median of 10:

- "mma": the tensor-core tile's loads (mxfp4_mma._load_words' addresses, the (2, 2) tile's
  index math: per K step a warp reads one 128-byte line of each of its 2 x 16 rows; K warps take
  alternate steps), optional L2 prefetch of the lines PF steps ahead (every thread its own
  line: 8 prefetches a line), optional cache modifier or eviction policy (ptxas refuses the
  two together), words XOR-folded;
- "rows": the same program's 64 rows read as [16, 128]-word blocks, lanes along K (512
  contiguous bytes a row a load);
- "linear": the same program's 96 KB read front to back.

Fraction of the copy bandwidth measured in the same run. From the repo root:
    python3 benchmarks/session11/load_pattern.py     # writes $OUT/load_pattern.json
"""

import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, gt, rec  # noqa: E402

from k3lab.kernels.mxfp4_mma import prefetch_l2  # noqa: E402

ROWS, K_WORDS, EXPERTS = 3584, 384, 16  # stage 2 at K3 tp 1: D rows of I / 8 words


@triton.jit
def _mma_pattern(p_w, p_out, K_WORDS, TILES, PF: tl.constexpr, CM: tl.constexpr = "",
                 EV: tl.constexpr = ""):
    pid = tl.program_id(0)
    row0 = pid * 64  # a program's 64 rows: (2, 2) tile, rows wn * 16 + g and + 32 (ROW_R)
    o_i = tl.arange(0, 256)
    lane, warp, h = o_i % 32, o_i // 32 % 4, o_i // 128
    g, t = lane // 4, lane % 4
    wn, wk = warp // 2, warp % 2
    grp = t + 4 * h
    row0_i = row0 + wn * 16 + g
    acc = tl.zeros([256, 4], dtype=tl.int32)
    n_steps = K_WORDS // 32
    for it in range(0, n_steps // 2):
        step = it * 2 + wk
        if PF > 0:
            pf = (step + 2 * PF) * 32 + 4 * grp
            prefetch_l2(p_w + row0_i * K_WORDS + pf, pf < K_WORDS)
            prefetch_l2(p_w + (row0_i + 8) * K_WORDS + pf, pf < K_WORDS)
            prefetch_l2(p_w + (row0_i + 32) * K_WORDS + pf, pf < K_WORDS)
            prefetch_l2(p_w + (row0_i + 40) * K_WORDS + pf, pf < K_WORDS)
        o_w = step * 32 + 4 * grp
        o_u = tl.arange(0, 4)
        p0 = p_w + row0_i * K_WORDS + o_w
        b_lo = tl.load(p0[:, None] + o_u[None, :], cache_modifier=CM, eviction_policy=EV)
        b_hi = tl.load((p0 + 8 * K_WORDS)[:, None] + o_u[None, :], cache_modifier=CM,
                       eviction_policy=EV)
        c_lo = tl.load((p0 + 32 * K_WORDS)[:, None] + o_u[None, :], cache_modifier=CM,
                       eviction_policy=EV)
        c_hi = tl.load((p0 + 40 * K_WORDS)[:, None] + o_u[None, :], cache_modifier=CM,
                       eviction_policy=EV)
        acc ^= b_lo ^ b_hi ^ c_lo ^ c_hi
    tl.store(p_out + pid, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


@triton.jit
def _rows_pattern(p_w, p_out, K_WORDS, TILES, BW: tl.constexpr):
    pid = tl.program_id(0)
    o_r = tl.arange(0, 16)
    o_k = tl.arange(0, BW)
    acc = tl.zeros([16, BW], dtype=tl.int32)
    for rb in range(0, 4):
        for k0 in range(0, K_WORDS, BW):
            acc ^= tl.load(p_w + (pid * 64 + rb * 16 + o_r)[:, None] * K_WORDS + k0 + o_k[None, :])
    tl.store(p_out + pid, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


@triton.jit
def _linear_pattern(p_w, p_out, K_WORDS, TILES, BW: tl.constexpr):
    pid = tl.program_id(0)
    o = tl.arange(0, BW)
    acc = tl.zeros([BW], dtype=tl.int32)
    base = pid * 64 * K_WORDS
    for k0 in range(0, 64 * K_WORDS, BW):
        acc ^= tl.load(p_w + base + k0 + o)
    tl.store(p_out + pid, tl.xor_sum(acc, axis=0))


def main():
    t0 = time.time()
    tiles = EXPERTS * ROWS // 64
    copies = [dict(w=torch.randint(-2**31, 2**31 - 1, (EXPERTS * ROWS, K_WORDS), dtype=torch.int32,
                                   device="cuda"), out=torch.empty(tiles, dtype=torch.int32,
                                                                   device="cuda"))
              for _ in range(3)]
    nbytes = EXPERTS * ROWS * K_WORDS * 4
    variants = {
        "mma": lambda c: _mma_pattern[(tiles,)](c["w"], c["out"], K_WORDS, tiles, 0, num_warps=4),
        "mma pf1": lambda c: _mma_pattern[(tiles,)](c["w"], c["out"], K_WORDS, tiles, 1,
                                                    num_warps=4),
        "mma .cg": lambda c: _mma_pattern[(tiles,)](c["w"], c["out"], K_WORDS, tiles, 0, ".cg",
                                                    num_warps=4),
        "mma evict_first": lambda c: _mma_pattern[(tiles,)](c["w"], c["out"], K_WORDS, tiles, 0,
                                                            "", "evict_first", num_warps=4),
        "rows 128": lambda c: _rows_pattern[(tiles,)](c["w"], c["out"], K_WORDS, tiles, 128,
                                                      num_warps=4),
        "rows 64": lambda c: _rows_pattern[(tiles,)](c["w"], c["out"], K_WORDS, tiles, 64,
                                                     num_warps=4),
        "linear": lambda c: _linear_pattern[(tiles,)](c["w"], c["out"], K_WORDS, tiles, 2048,
                                                      num_warps=4),
    }
    want = None
    for rep in range(3):
        for name, fn in variants.items():
            fn(copies[0])
            got = int(copies[0]["out"].cpu().numpy().view("uint32").astype("uint64").sum())
            want = got if want is None else want
            us = gt(fn, copies, repeats=10)
            rec(k="load_pattern", variant=name, us=round(us, 2),
                frac=round(nbytes / bw * 1e6 / us, 3), same_fold=got == want, rep=rep,
                t=round(time.time() - t0, 1))
    print(f"copy bw {bw / 1e12:.3f} TB/s")
    dump("load_pattern.json")


if __name__ == "__main__":
    main()
