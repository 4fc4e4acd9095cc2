"""The MXFP4 decode's own ceiling: kernels/moe.py's K-lane inner loop stripped to the bone.

A diagnostic for issue 4 (see stream_patterns.py, which shows the memory side streams these bytes
at 0.9-1.0 of copy bandwidth). Each program reads K3 tp-1 stage-1 weight words ([16 * 6144 rows,
448 words]) in [ROWS, WORDS] tiles, decodes every E2M1 code with the kernel's 3-op decode
(moe._fp4_code) and FFMAs it with an fp32 x value (one per word and code, loaded per step): no
scales, no group sums, no x conversion. If this reaches well above the kernel's ~0.5 of copy
bandwidth the kernel's overheads are what costs; if not, the decode stream itself (as Triton
compiles it) is the limit. Writes $OUT/decode_ceiling.json.
"""
import json
import os

import torch
import triton
import triton.language as tl

from benchmarks.session5.stream_patterns import copy_bandwidth, time_graph

SIGN_MAG = tl.constexpr(0x81C00000 - (1 << 32))
# DECODE 2: codes i and i + 4 of a word (16 bits apart) to one f16x2 (2^-14 x value: magnitude
# to bits 9..11 / 25..27, sign to 15 / 31), times an f16x2 x pair, accumulated by HFMA2
F16_PAIRS_FMA = tl.constexpr("""{
.reg .b32 t, u, v;
shl.b32 t, $1, 9;  and.b32 v, t, 0x0E000E00; shl.b32 u, $1, 12; and.b32 u, u, 0x80008000;
or.b32 v, v, u; fma.rn.f16x2 $0, v, $2, $6;
shl.b32 t, $1, 5;  and.b32 v, t, 0x0E000E00; shl.b32 u, $1, 8;  and.b32 u, u, 0x80008000;
or.b32 v, v, u; fma.rn.f16x2 $0, v, $3, $0;
shl.b32 t, $1, 1;  and.b32 v, t, 0x0E000E00; shl.b32 u, $1, 4;  and.b32 u, u, 0x80008000;
or.b32 v, v, u; fma.rn.f16x2 $0, v, $4, $0;
shr.b32 t, $1, 3;  and.b32 v, t, 0x0E000E00; and.b32 u, $1, 0x80008000;
or.b32 v, v, u; fma.rn.f16x2 $0, v, $5, $0;
}""")
F16X2_SUM = tl.constexpr("""{
.reg .f16 l, h; .reg .f32 a, b;
mov.b32 {l, h}, $1; cvt.f32.f16 a, l; cvt.f32.f16 b, h; add.f32 a, a, b; add.f32 $0, $2, a;
}""")


@triton.jit
def _decode_kernel(p_w, p_x, p_out, N_WORDS, ROWS: tl.constexpr, WORDS: tl.constexpr,
                   TILED: tl.constexpr, STAGES: tl.constexpr, DECODE: tl.constexpr):
    pid = tl.program_id(0)
    o_r = tl.arange(0, ROWS)
    o_c = tl.arange(0, WORDS)
    base = pid.to(tl.int64) * ROWS * N_WORDS
    acc = tl.zeros([ROWS, WORDS], dtype=tl.float32)
    for k in tl.range(0, N_WORDS // WORDS, num_stages=STAGES if STAGES > 0 else None):
        if TILED:
            p = p_w + base + k * ROWS * WORDS + o_r[:, None] * WORDS + o_c[None, :]
        else:
            p = p_w + base + o_r[:, None] * N_WORDS + k * WORDS + o_c[None, :]
        b_w = tl.load(p)
        if DECODE == 2:
            b_h = tl.zeros([ROWS, WORDS], dtype=tl.int32)
            o_x = (k * WORDS + o_c) * 8
            b_h = tl.inline_asm_elementwise(
                F16_PAIRS_FMA, "=r,r,r,r,r,r,r",
                [b_w, tl.broadcast_to(tl.load(p_x + o_x).to(tl.int32, bitcast=True)[None, :],
                                      (ROWS, WORDS)),
                 tl.broadcast_to(tl.load(p_x + o_x + 1).to(tl.int32, bitcast=True)[None, :],
                                 (ROWS, WORDS)),
                 tl.broadcast_to(tl.load(p_x + o_x + 2).to(tl.int32, bitcast=True)[None, :],
                                 (ROWS, WORDS)),
                 tl.broadcast_to(tl.load(p_x + o_x + 3).to(tl.int32, bitcast=True)[None, :],
                                 (ROWS, WORDS)), b_h],
                dtype=tl.int32, is_pure=True, pack=1)
            acc = tl.inline_asm_elementwise(F16X2_SUM, "=f,r,f", [b_h, acc],
                                            dtype=tl.float32, is_pure=True, pack=1)
        if DECODE < 2:
            for j in tl.static_range(8):
                b_x = tl.load(p_x + (k * WORDS + o_c) * 8 + j)
                if DECODE == 0:
                    b_c = (((b_w << (28 - 4 * j)) >> 6) & SIGN_MAG).to(tl.float32, bitcast=True)
                else:  # one op: the word as a float (the decode's cost removed, not its loads)
                    b_c = (b_w ^ j).to(tl.float32, bitcast=True)
                acc += b_c * b_x[None, :]
    tl.store(p_out + pid * ROWS + o_r, tl.sum(acc, axis=1))


def check_f16_pairs():
    """DECODE 2 against a float64 emulation on valid f16 x pairs (max relative error)."""
    from k3lab.weights import E2M1_VALUES
    n_rows, n_words = 64, 128
    w = torch.randint(-2**31, 2**31 - 1, (n_rows, n_words), dtype=torch.int32, device="cuda")
    xh = (torch.randn(n_words, 4, 2, device="cuda") * 64).half()  # pair i: (x[8q+i], x[8q+i+4])
    x = torch.zeros(n_words * 8, device="cuda")
    x.view(n_words, 8)[:, :4] = xh.contiguous().view(torch.float32).view(n_words, 4)
    res = torch.empty(n_rows, device="cuda")
    _decode_kernel[(1,)](w, x, res, n_words, ROWS=64, WORDS=64, TILED=False, STAGES=0, DECODE=2)
    vals = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64,
                        device="cuda")
    codes = torch.stack([(w >> (4 * c)) & 15 for c in range(8)], -1).long()  # [rows, words, 8]
    xv = torch.zeros(n_words, 8, dtype=torch.float64, device="cuda")
    xv[:, :4] = xh[:, :, 0].double()
    xv[:, 4:] = xh[:, :, 1].double()
    want = (vals[codes] * xv[None]).sum((1, 2)) * 2.0 ** -14
    err = ((res.double() - want).abs() / want.abs().clamp_min(1e-3)).max().item()
    print("f16 pairs check: max rel err", err, flush=True)
    return err


def main():
    out = os.environ.get("OUT", ".")
    check_f16_pairs()
    bw = copy_bandwidth()
    n_rows, n_words = 16 * 6144, 448
    ws = [torch.randint(-2**31, 2**31 - 1, (n_rows, n_words), dtype=torch.int32, device="cuda")
          for _ in range(3)]
    x = torch.randn(n_words * 8, device="cuda")
    rows = []
    for r, w, nw, st in ((64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 8, 3), (128, 64, 8, 3),
                         (64, 64, 4, 0), (64, 32, 4, 3)):
        for tiled in (False, True):
            for dec in (0, 1, 2):
                res = torch.empty(n_rows, device="cuda")
                info = {}

                def launch(i, r=r, w=w, nw=nw, st=st, tiled=tiled, dec=dec, res=res, info=info):
                    info["kernel"] = _decode_kernel[(n_rows // r,)](
                        ws[i], x, res, n_words, ROWS=r, WORDS=w, TILED=tiled, STAGES=st,
                        DECODE=dec, num_warps=nw)
                try:
                    t = time_graph(launch, 3)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(r, w, nw, st, tiled, dec, "error", str(e)[:300], flush=True)
                    continue
                regs = getattr(info.get("kernel"), "n_regs", None)
                nbytes = n_rows * n_words * 4
                row = dict(rows=r, words=w, warps=nw, stages=st, tiled=tiled, decode=dec,
                           us=t * 1e6, frac=nbytes / t / 1e12 / bw, copy_TBps=bw, regs=regs)
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(os.path.join(out, "decode_ceiling.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
