"""kernels/moe/mma.py: the tensor-core MXFP4 GEMV tile on its own, against the dequantized
fp32 reference, for every tile shape the MoE stages can pick, rows that end inside a 16-row tile
and K that ends inside a step of 256. On CPU the mma is the interpreter's lane-by-lane emulation;
on CUDA it is the inline PTX (the same test, compiled)."""

import dataclasses
import os
import re

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from k3lab.kernels import INTERPRETED
from k3lab.kernels.moe.mma import fp4_mma_gemv, mma_layout_problem, mma_prepare_x, tiled_word_offset
from k3lab.kernels.mxfp4 import mxfp4_layout, mxfp4_quantize, mxfp4_tiled_codes
from k3lab.weights import make_generator, randn

# fp32 sums of exact products in another order than the reference's
ATOL, RTOL = 1e-5, 1e-5


@triton.jit
def _gemv_kernel(p_x, p_w, p_s, p_y, N, N_GROUPS, R: tl.constexpr, WARPS_K: tl.constexpr,
                 ASM: tl.constexpr, X_PREPARED: tl.constexpr, TILED: tl.constexpr):
    """y[rows of the program's tiles] = w @ x, rows in R tiles of 16 * (4 // WARPS_K); TILED:
    w's codes in the tiled layout."""
    WN: tl.constexpr = 4 // WARPS_K
    row0 = tl.program_id(0) * (R * WN * 16)
    y = fp4_mma_gemv(p_x, p_w, p_s, row0, WN * 16, N, 0, N_GROUPS, R, WARPS_K, ASM, 0,
                     X_PREPARED, 1.0, False, TILED)
    o = row0 + tl.arange(0, R)[:, None] * (WN * 16) + tl.arange(0, WN * 16)[None, :]
    tl.store(p_y + o, y, mask=o < N)


def _gemv(x, q, r, warps_k, prepared=False):
    n, k = q.shape
    y = torch.zeros(n, device=x.device, dtype=torch.float32)
    rows = r * (4 // warps_k) * 16
    _gemv_kernel[(triton.cdiv(n, rows),)](
        (mma_prepare_x(x) if prepared else x).view(torch.int32), q.packed.view(torch.int32),
        q.scales, y, n, k // 32, r, warps_k, not INTERPRETED, prepared, q.layout == "tiled",
        num_warps=4)
    return y


TILES = [(1, 1), (2, 1), (2, 2), (2, 4), (1, 4), (1, 2)]
SHAPES = [(40, 512), (200, 384), (16, 32)]


@pytest.mark.parametrize("r,warps_k", TILES, ids=[f"R{r}-WK{w}" for r, w in TILES])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
def test_tile_matches_reference(n, k, r, warps_k, device):
    gen = make_generator(n + k, device)
    q = mxfp4_quantize(randn((n, k), gen, std=0.05))
    x = randn((k,), gen)
    want = q.dequantize() @ x.float()
    torch.testing.assert_close(_gemv(x, q, r, warps_k), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("r,warps_k", TILES, ids=[f"R{r}-WK{w}" for r, w in TILES])
@pytest.mark.parametrize("n,k", [(48, 512), (32, 768)], ids=["N48-K512", "N32-K768"])
def test_tile_tiled_layout(n, k, r, warps_k, device):
    """W_TILED on codes in the tiled layout gives bitwise the row layout's sums (the same
    fragments, read from other addresses); the row layout read as tiled does not."""
    gen = make_generator(n * k, device)
    q = mxfp4_quantize(randn((n, k), gen, std=0.05))
    x = randn((k,), gen)
    rows = _gemv(x, q, r, warps_k)
    torch.testing.assert_close(rows, q.dequantize() @ x.float(), atol=ATOL, rtol=RTOL)
    assert torch.equal(_gemv(x, mxfp4_layout(q, "tiled"), r, warps_k), rows)
    wrong = _gemv(x, dataclasses.replace(q, layout="tiled"), r, warps_k)
    assert not torch.allclose(wrong, rows, atol=1e-2, rtol=1e-2)


@triton.jit
def _offset_kernel(p_o, N, K_WORDS, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (row, group) pairs
    row, word = o // (K_WORDS // 4), o % (K_WORDS // 4) * 4
    tl.store(p_o + o, tiled_word_offset(row, word, K_WORDS), mask=o < N * (K_WORDS // 4))


def test_tiled_word_offset_is_the_tiled_codes_permutation(device):
    """The kernels' address of each group (tiled_word_offset) is where
    kernels.mxfp4.mxfp4_tiled_codes puts it: one definition of the layout, twice."""
    n, k = 48, 768
    words = torch.arange(n * k // 8, dtype=torch.int32, device=device).reshape(n, k // 8)
    tiled = mxfp4_tiled_codes(words.view(torch.uint8)).view(torch.int32).reshape(-1)
    got = torch.empty(n * k // 32, dtype=torch.int32, device=device)
    _offset_kernel[(triton.cdiv(got.numel(), 256),)](got, n, k // 8, 256)
    want = torch.arange(0, n * k // 8, 4, device=device, dtype=torch.int32)  # rows * words
    assert torch.equal(tiled[got.long()], want)


@pytest.mark.parametrize("r,warps_k", [(2, 1), (1, 2)], ids=["R2-WK1", "R1-WK2"])
def test_tile_x_prepared(r, warps_k, device):
    """X_PREPARED (x permuted and scaled by mma_prepare_x) gives the same sums; 72 rows, K =
    640 (two full steps and a partial one)."""
    gen = make_generator(11, device)
    q = mxfp4_quantize(randn((72, 640), gen, std=0.05))
    x = randn((640,), gen)
    want = q.dequantize() @ x.float()
    torch.testing.assert_close(_gemv(x, q, r, warps_k, True), want, atol=ATOL, rtol=RTOL)


def test_prepare_x_layout_and_errors():
    """mma_prepare_x: each word of 8 in the order (0, 4, 1, 5, 2, 6, 3, 7), times 2^100; bad
    input named."""
    x = torch.arange(16, dtype=torch.bfloat16)
    want = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], dtype=torch.float32)
    got = mma_prepare_x(x).float() / 2.0 ** 100
    assert torch.equal(got, torch.cat([want, want + 8]))
    with pytest.raises(ValueError, match="x: expected bf16"):
        mma_prepare_x(torch.zeros(12, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x: expected bf16"):
        mma_prepare_x(torch.zeros(16))


def test_zero_weights_and_x_give_zero(device):
    """All-zero codes (and an all-zero x) give exact zeros: no stray B columns or scales."""
    q = mxfp4_quantize(torch.zeros((32, 256), device=device))
    x = torch.zeros(256, device=device, dtype=torch.bfloat16)
    assert torch.equal(_gemv(x, q, 2, 1), torch.zeros(32, device=device))


_COMPILE_LAYOUTS = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from test_moe_mma import TILES, _gemv_kernel
from k3lab.kernels.moe.mma import mma_layout_problem
sig = {"p_x": "*i32", "p_w": "*i32", "p_s": "*u8", "p_y": "*fp32", "N": "i32", "N_GROUPS": "i32",
       "R": "constexpr", "WARPS_K": "constexpr", "ASM": "constexpr",
       "X_PREPARED": "constexpr", "TILED": "constexpr"}
attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # N_GROUPS: any value
out = {}
for (r, wk), tiled in [(t, tiled) for t in TILES for tiled in (False, True)]:
    src = ASTSource(_gemv_kernel, signature=sig, attrs=attrs,
                    constexprs={"R": r, "WARPS_K": wk, "ASM": True, "X_PREPARED": False,
                                "TILED": tiled})
    try:
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except triton.compiler.errors.CompilationError as e:  # the kernel's fault: fail
        print(json.dumps({"error": str(e)[:400]}))
        sys.exit(0)
    except Exception as e:  # no sm_90 toolchain here (ptxas): skip
        print(json.dumps({"skip": f"{type(e).__name__}: {str(e)[:200]}"}))
        sys.exit(0)
    out[f"R{r}-WK{wk}-{'tiled' if tiled else 'rows'}"] = mma_layout_problem(ck.asm["ttgir"])
print(json.dumps(out))
"""


def test_compiled_layout_is_the_fragment_layout():
    """The installed Triton, compiling every tile for sm_90 (no GPU needed; a subprocess, since
    this session runs the interpreter), gives the mma operands the layout the fragments rely on
    (mma_layout_problem), reading either MXFP4 layout; the MoE launchers check the same on the
    kernels they launch. Triton 3.9 broke a 3-D tile's tie between dimensions differently from
    3.6: this catches such a change in CI."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_LAYOUTS, __file__], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert "error" not in got, got.get("error")
    if "skip" in got:
        pytest.skip(f"cannot compile for sm_90 here: {got['skip']}")
    assert got == {f"R{r}-WK{w}-{lay}": None for r, w in TILES for lay in ("rows", "tiled")}


def test_layout_check_flags_another_layout():
    """mma_layout_problem on a TTGIR whose mma operands have lanes along another dimension."""
    bad = ("#blocked2 = #ttg.blocked<{sizePerThread = [1, 1, 4], threadsPerWarp = [16, 2, 1], "
           "warpsPerCTA = [4, 1, 1], order = [2, 1, 0]}>\n"
           '%d = tt.elementwise_inline_asm "{ mma.sync.aligned ... }" {pure = true} %a : '
           "(tensor<256x2x4xi32, #blocked2>) -> tensor<256x2x4xf32, #blocked2>\n")
    assert "threadsPerWarp = [16, 2, 1]" in mma_layout_problem(bad)
    assert mma_layout_problem("no kernel here") == "no mma inline asm in the kernel"


# ---------------------------------------------------------------------------------------------
# the inline PTX's decode, executed on CPU: the interpreter runs the emulation instead of the PTX,
# so this runs the PTX text itself (its integer instructions, on numpy words) and checks every
# mma's A fragment against the E2M1 codes


def _run_decode_ptx(ptx, lo, hi):
    """[(A registers, B operand names)] of each mma in the MMA_PTX block ``ptx`` with the words
    $4..$7 = lo[:, u], $8..$11 = hi[:, u] (uint32 arrays [n, 4])."""
    regs = {f"${4 + u}": lo[:, u] for u in range(4)} | {f"${8 + u}": hi[:, u] for u in range(4)}
    mask = np.uint64(0xFFFFFFFF)

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else np.uint32(int(tok, 0))

    ops = {"and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b,
           "shl.b32": lambda a, b: (a << b) & mask, "shr.u32": lambda a, b: a >> b}
    mmas = []
    for stmt in re.split(r";\s*", ptx.replace("\n", " ")):
        stmt = stmt.strip(" {}")
        if not stmt or stmt.startswith(".reg") or stmt.startswith("mov.f32"):
            continue
        op, args = stmt.split(None, 1)
        if op.startswith("mma."):
            a_regs, b_regs = re.findall(r"\{([^}]*)\}", args)[1:3]
            mmas.append(([regs[r.strip()] for r in a_regs.split(",")],
                         [r.strip() for r in b_regs.split(",")]))
            continue
        if op not in ops:
            raise AssertionError(f"unsimulated PTX instruction {op!r}")
        dst, *src = [t.strip() for t in args.split(",")]
        a, b = (np.asarray(val(t), dtype=np.uint64) for t in src)
        regs[dst] = np.asarray(ops[op](a, b), dtype=np.uint64).astype(np.uint32)
    return mmas


def _pair_truth(words, n):
    """bf16x2 bits of 2^-126 x the E2M1 values of codes n (low half) and n + 4 (high half)."""
    out = np.zeros_like(words)
    for half, c in ((0, n), (1, n + 4)):
        code = (words >> np.uint32(4 * c)) & np.uint32(15)
        out |= (((code & np.uint32(8)) << np.uint32(12))
                | ((code & np.uint32(7)) << np.uint32(6))) << np.uint32(16 * half)
    return out


def test_ptx_decode_gives_the_codes():
    from k3lab.kernels.moe import mma

    rng = np.random.default_rng(7)
    words = rng.integers(0, 1 << 32, size=(2, 4096, 4), dtype=np.uint64).astype(np.uint32)
    words[:, :4] = np.array([0, 0xFFFFFFFF, 0x88888888, 0x77777777], dtype=np.uint32)[:, None]
    mmas = _run_decode_ptx(mma._mma_ptx(), words[0], words[1])
    assert len(mmas) == 8
    for i, (a, b) in enumerate(mmas):
        u, half = divmod(i, 2)
        for reg, (row, n) in zip(a, ((0, 2 * half), (1, 2 * half), (0, 2 * half + 1),
                                     (1, 2 * half + 1)), strict=True):
            np.testing.assert_array_equal(reg, _pair_truth(words[row][:, u], n))
        assert b == [f"${12 + 4 * (2 * half) + u}", f"${12 + 4 * (2 * half + 1) + u}"]
    assert mma.MMA_PTX.value == mma._mma_ptx()
