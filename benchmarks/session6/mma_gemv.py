"""Session 6 probe: the tensor-core MXFP4 GEMV tile (kernels/mxfp4_mma.py) on its own.

    TRITON_INTERPRET=1 python3 benchmarks/session6/mma_gemv.py check        # CPU: vs reference
    PYTHONPATH=/tmp/t36 python3 benchmarks/session6/mma_gemv.py sass R WK S PF [XP]
    python3 benchmarks/session6/mma_gemv.py bench                            # H200: check + time

Session 7 added the tile option X_PREPARED (x permuted and scaled by its producer:
mma_prepare_x, done before the timed region as a producer kernel would): VARIANTS entries
(R, WK, STAGES, PF[, XP]). Its call 4 (BENCH=session7 at 15bd766) also timed SHR8, the decode
with one right shift a word, which became the only decode after it.
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl

from k3lab.kernels.mxfp4_mma import fp4_mma_gemv, mma_prepare_x


@triton.jit
def mma_gemv_kernel(p_x, p_w, p_s, p_y, N, N_GROUPS, R: tl.constexpr, WARPS_K: tl.constexpr,
                    STAGES: tl.constexpr, ASM: tl.constexpr, PF: tl.constexpr,
                    XP: tl.constexpr = False):
    WN: tl.constexpr = 4 // WARPS_K
    row0 = tl.program_id(0) * (R * WN * 16)
    y = fp4_mma_gemv(p_x, p_w, p_s, row0, WN * 16, N, 0, N_GROUPS, R, WARPS_K, STAGES, ASM, PF,
                     X_PREPARED=XP)
    o = row0 + tl.arange(0, R)[:, None] * (WN * 16) + tl.arange(0, WN * 16)[None, :]
    tl.store(p_y + o, y, mask=o < N)


def run(x, q, r=2, warps_k=1, stages=0, pf=0, xp=False):
    """y = dequant(q) @ x; with xp, ``x`` is already mma_prepare_x'd."""
    n, k = q.shape
    y = torch.empty(n, device=x.device, dtype=torch.float32)
    rows = r * (4 // warps_k) * 16
    asm = os.environ.get("TRITON_INTERPRET") != "1"
    mma_gemv_kernel[(triton.cdiv(n, rows),)](
        x.view(torch.int32), q.packed.view(torch.int32), q.scales, y, n, k // 32, r, warps_k,
        stages, asm, pf, xp, num_warps=4)
    return y


def check(device="cpu", shapes=((40, 512), (64, 384), (200, 256 + 128)), seed=0):
    from k3lab.weights import mxfp4_quantize
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.05
        x = (torch.randn(k, generator=g)).to(torch.bfloat16)
        q = mxfp4_quantize(w)
        ref = q.dequantize() @ x.float()
        q = type(q)(q.packed.to(device), q.scales.to(device))
        for r, wk in ((1, 1), (2, 1), (2, 2), (1, 4)):
            y = run(x.to(device), q, r, wk).cpu()
            err = (y - ref).abs().max().item()
            out.append(dict(n=n, k=k, r=r, wk=wk, err=err, scale=ref.abs().max().item()))
            print(out[-1], flush=True)
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["check"]:
    check()


def sass(r=2, warps_k=1, stages=0, pf=0, xp=0):
    """Offline sm_90 compile (Triton 3.6 on PYTHONPATH): registers, TTGIR / PTX / SASS under
    OUT_DIR and the K loop's opcode mix per weight element (SASS helpers of
    benchmarks/next/aot_moe.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "next"))
    from aot_moe import loop_bodies, mix, sass_of
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"p_x": "*i32", "p_w": "*i32", "p_s": "*u8", "p_y": "*fp32", "N": "i32",
           "N_GROUPS": "i32", "R": "constexpr", "WARPS_K": "constexpr", "STAGES": "constexpr",
           "ASM": "constexpr", "PF": "constexpr", "XP": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    ck = triton.compile(ASTSource(mma_gemv_kernel, signature=sig, constexprs={
        "R": r, "WARPS_K": warps_k, "STAGES": stages, "ASM": True, "PF": pf, "XP": bool(xp)},
        attrs=attrs),
        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    text, regs = sass_of(ck)
    out = os.environ.get("OUT_DIR", "/tmp/mma_sass")
    os.makedirs(out, exist_ok=True)
    for key, body in (("ttgir", ck.asm["ttgir"]), ("ptx", ck.asm["ptx"]), ("sass", text)):
        with open(f"{out}/r{r}_wk{warps_k}_s{stages}_pf{pf}_xp{xp}.{key}", "w") as fh:
            fh.write(body)
    c = mix(text, *loop_bodies(text)[-1])  # the longest loop: the K loop
    per_thread = r * (4 // warps_k) * 16 * 256 * warps_k / 128  # elements a thread an iteration
    print(f"R {r} WK {warps_k} S {stages} PF {pf} XP {xp}: {regs}")
    print(f"  loop {sum(c.values())} instr / {per_thread:.0f} el = "
          f"{sum(c.values()) / per_thread:.2f}: " + ", ".join(f"{k} {v}" for k, v in
                                                            c.most_common()))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "sass":
    sass(*[int(a) for a in sys.argv[2:]])


# (R, WARPS_K, STAGES, PREFETCH); session 6 call 1 ran stages 0/2/3 without prefetch (2 2 0
# best), call 2 these and (4, 2, 0, 2), which the tiles no longer offer (R is 1 or 2 since the
# operands became 2-D per row tile)
VARIANTS = [(2, 2, 0, 0), (2, 2, 0, 1), (2, 2, 0, 2), (2, 2, 0, 4), (1, 4, 0, 0), (1, 4, 0, 2),
            (1, 4, 0, 4), (2, 4, 0, 2), (2, 1, 0, 2), (1, 2, 0, 2)]
# session 7: (R, WARPS_K, STAGES, PREFETCH, X_PREPARED), each base tile both ways, twice (call 4
# at 15bd766 also had SHR8 0 / 1 as a sixth entry)
SESSION7 = [(*t, xp) for _ in range(2) for t in ((2, 2, 0, 1), (2, 1, 0, 1)) for xp in (0, 1)]
if os.environ.get("BENCH") == "session7":
    VARIANTS = SESSION7


def bench():
    """H200: correctness at small shapes and K3 tp 1 stage shapes, then graph-replay time of the
    GEMV over the stage bytes (2 rotated copies > L2) against the copy bandwidth."""
    from k3lab import profile
    from k3lab.weights import mxfp4_quantize
    out = os.environ.get("OUT", "/tmp")
    rows = {"check": check("cuda") if os.environ.get("CHECK", "1") == "1" else []}
    bw = profile.copy_bandwidth("cuda")
    rows["copy_bw"] = bw
    print(f"copy bw {bw / 1e12:.3f} TB/s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    timing = []
    for name, n, k in (("stage1", 16 * 6144, 3584), ("stage2", 16 * 3584, 3072)):
        copies = []
        for _ in range(2):
            w = torch.randn(n, k, device="cuda", generator=g) * 0.02
            q = mxfp4_quantize(w)
            del w
            x = torch.randn(k, device="cuda", generator=g).to(torch.bfloat16)
            copies.append((x, q))
        ref = copies[0][1].dequantize()[:4096] @ copies[0][0].float()
        prepared = [(mma_prepare_x(x), q) for x, q in copies]  # a producer's output
        nbytes = copies[0][1].nbytes + k * 2
        for r, wk, st, pf, *opt in VARIANTS:
            xp = (*opt, 0)[0]
            cs = prepared if xp else copies
            try:
                y = run(cs[0][0], cs[0][1], r, wk, st, pf, xp)
                err = (y[:4096] - ref).abs().max().item()
                t = profile.time_variant(
                    lambda c, r=r, wk=wk, st=st, pf=pf, xp=xp: run(
                        c[0], c[1], r, wk, st, pf, xp), cs, mode="graph",
                    repeats=20).median_us
                row = dict(stage=name, r=r, wk=wk, stages=st, pf=pf, xp=xp, us=round(t, 2),
                           frac=round(nbytes / (t * 1e-6) / bw, 3), err=err)
            except Exception as e:  # a failed variant is a row, not the end of the sweep
                row = dict(stage=name, r=r, wk=wk, stages=st, pf=pf, xp=xp, error=repr(e)[:300])
            timing.append(row)
            print(json.dumps(row), flush=True)
        del copies
        torch.cuda.empty_cache()
    rows["timing"] = timing
    with open(f"{out}/mma_gemv.json", "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__" and sys.argv[1:2] == ["bench"]:
    bench()
