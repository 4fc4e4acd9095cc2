"""Probe, not a kernel of k3lab: what Triton 3.6 makes of an MXFP4 GEMV tile that decodes E2M1
pairs to bf16x2 in registers (codes j and j + 4 of a word share one shift / mask sequence) and
multiplies them on the tensor cores with tl.dot against x laid out block-diagonally over the
step's groups (B[k, c] = x[k] when k is in group c, so D[n, c] is row n's partial sum of group c
and the E8M0 factor multiplies D once per row and group). Compiles for sm_90 offline and prints
registers and the K loop's opcode mix per weight element (see MOE_MXFP4_ANALYSIS.md).

    PYTHONPATH=/tmp/t36 python3 benchmarks/next/aot_mma_probe.py 64 64 4   # rows words warps
"""

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

os.environ["TRITON_INTERPRET"] = "0"
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@triton.jit
def _pair(b_w, J: tl.constexpr):
    """bf16 halves of codes J (low) and J + 4 (high) of each word, 2^-126 * value."""
    b_s = b_w << (12 - 4 * J)
    b_m = (b_w << (6 - 4 * J)) if J <= 1 else (b_w >> (4 * J - 6))
    b_p = (b_s & (0x80008000 - (1 << 32))) | (b_m & 0x01C001C0)
    return tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [b_p],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def probe(p_w, p_s, p_x, p_y, N_WORDS, N_GROUPS, BLOCK_N: tl.constexpr,
          BLOCK_W: tl.constexpr):
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_c = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for kw0 in range(0, N_WORDS, BLOCK_W):
        o_w = kw0 + tl.arange(0, BLOCK_W)
        b_w = tl.load(p_w + o_n[:, None] * N_WORDS + o_w[None, :])
        l0, h0 = _pair(b_w, 0)
        l1, h1 = _pair(b_w, 1)
        l2, h2 = _pair(b_w, 2)
        l3, h3 = _pair(b_w, 3)
        # K order inside a word: elements 0, 4, 1, 5, 2, 6, 3, 7 (x permuted the same way)
        a = tl.join(tl.join(tl.join(l0, h0), tl.join(l1, h1)),
                    tl.join(tl.join(l2, h2), tl.join(l3, h3)))
        a = tl.reshape(a, [BLOCK_N, BLOCK_W * 8])
        o_k = tl.arange(0, BLOCK_W * 8)
        perm = 8 * (o_k // 8) + (o_k % 8) // 2 + 4 * (o_k % 2)
        b_x = tl.load(p_x + kw0 * 8 + perm[:, None] + 0 * o_c[None, :],
                      mask=(o_k // 32)[:, None] == o_c[None, :], other=0.0)
        d = tl.dot(a, b_x, out_dtype=tl.float32)
        o_g = kw0 // 4 + o_c
        b_s = tl.load(p_s + o_n[:, None] * N_GROUPS + o_g[None, :],
                      mask=(o_c < BLOCK_W // 4)[None, :], other=0).to(tl.int32)
        acc += d * ((b_s + 62) << 23).to(tl.float32, bitcast=True)
    tl.store(p_y + o_n, tl.sum(acc, axis=1))


def main():
    rows, words = int(sys.argv[1]), int(sys.argv[2])
    warps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    sig = {"p_w": "*i32", "p_s": "*u8", "p_x": "*bf16", "p_y": "*fp32", "N_WORDS": "i32",
           "N_GROUPS": "i32", "BLOCK_N": "constexpr", "BLOCK_W": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    ck = triton.compile(ASTSource(probe, signature=sig,
                                  constexprs={"BLOCK_N": rows, "BLOCK_W": words}, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(ck.asm["cubin"])
    sass = subprocess.run([f"{bindir}/cuobjdump", "-sass", fh.name], capture_output=True,
                          text=True).stdout
    res = subprocess.run([f"{bindir}/cuobjdump", "-res-usage", fh.name], capture_output=True,
                         text=True).stdout
    os.unlink(fh.name)
    print(" ".join(ln.strip() for ln in res.splitlines() if "REG" in ln))
    rows_ = []
    for line in sass.splitlines():
        mt = re.match(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if mt:
            rows_.append((int(mt.group(1), 16), mt.group(3), line))
    loops = set()
    for off, op, line in rows_:
        mt = re.search(r"BRA\S*\s+(?:`\()?0x([0-9a-f]+)", line)
        if op.startswith("BRA") and mt and int(mt.group(1), 16) <= off:
            loops.add((int(mt.group(1), 16), off))
    start, end = max(loops, key=lambda b: b[1] - b[0])
    keep = ("LDG", "LDS", "STS", "LDSM")
    c = Counter(op if op.split(".")[0] in keep else op.split(".")[0]
                for off, op, _ in rows_ if start <= off <= end)
    per_thread = rows * words * 8 / (warps * 32)
    print(f"loop {sum(c.values())} instr / {per_thread:.0f} elements = "
          f"{sum(c.values()) / per_thread:.2f} an element: "
          + ", ".join(f"{k} {v}" for k, v in c.most_common()))


if __name__ == "__main__":
    main()
