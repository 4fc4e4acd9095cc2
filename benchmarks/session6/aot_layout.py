"""Offline check (no GPU) that the MoE stage kernels, as the launchers call them on CUDA, give
the tensor-core tiles' mma operands the fragment layout (kernels/mxfp4_mma.mma_layout_problem),
with whichever Triton is importable; plus registers and the K loop's instruction count.

    PYTHONPATH=/tmp/t36 python3 benchmarks/session6/aot_layout.py    # Triton 3.6 (the H200's)
    python3 benchmarks/session6/aot_layout.py                        # the installed Triton
    TILES="{1: (2, 2, 1), 2: (2, 2, 1)}" python3 ...                 # fixed FP4_MMA_TILES

Reuses benchmarks/next/aot_moe.py (capture the launch on CPU stand-ins, replay it through
JITFunction.warmup under a stand-in sm_90 driver). The capture runs the launchers under the
interpreter flag, so the FP4 code's inline-PTX bit is set here before compiling.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "next"))
import aot_moe  # noqa: E402  (sets up the stand-ins)
import triton  # noqa: E402

from k3lab.kernels.mxfp4_mma import mma_layout_problem  # noqa: E402

print("triton", triton.__version__)
if os.environ.get("TILES"):
    aot_moe.moe.FP4_MMA_TILES = eval(os.environ["TILES"])  # noqa: S307 - a literal from the user
    print("FP4_MMA_TILES", aot_moe.moe.FP4_MMA_TILES)
for label, d, i in (("tp1", 3584, 3072), ("tp8", 3584, 384), ("tiny", 96, 96)):
    for name, kernel, _grid, args, kwargs in aot_moe.capture(d=d, i=i):
        kw = dict(kwargs)
        if kw.get("FP4", 0) >= aot_moe.moe._MMA_BASE:
            kw["FP4"] |= 1  # inline PTX, as on the GPU
        compiled = aot_moe.compile_captured(kernel, args, kw)
        sass, res = aot_moe.sass_of(compiled)
        print(label, name, "FP4", kw.get("FP4"), "async copies:",
              compiled.asm["ttgir"].count("async_copy_global_to_local"), "layout:",
              mma_layout_problem(compiled.asm["ttgir"]) or "ok", "|", res)

# the launchers' guard itself (kernels/moe._check_mma_layout) on the same calls: compiles through
# JITFunction.warmup under the stand-in driver, passes; with a layout problem injected, raises
calls = aot_moe.capture(d=3584, i=384)  # (the capture runs under the interpreter flag)
os.environ["TRITON_INTERPRET"] = "0"
aot_moe.driver.set_active(aot_moe._FakeDriverLite())
try:
    for name, kernel, grid, args, kwargs in calls:
        kw = dict(kwargs)
        kw["FP4"] |= 1
        aot_moe.moe._check_mma_layout(kernel, grid, args, kw)
        print("guard passes:", name)
        real = aot_moe.moe.mma_layout_problem
        aot_moe.moe.mma_layout_problem = lambda ttgir: "injected"
        aot_moe.moe._MMA_LAYOUT_VERDICTS.clear()
        try:
            aot_moe.moe._check_mma_layout(kernel, grid, args, kw)
            print("guard did NOT raise:", name)
        except RuntimeError as e:
            print("guard raises:", name, str(e)[:120])
        finally:
            aot_moe.moe.mma_layout_problem = real
            aot_moe.moe._MMA_LAYOUT_VERDICTS.clear()
finally:
    aot_moe.driver._active = None
