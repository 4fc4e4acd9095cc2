"""Compile the MoE expert kernels (stage 1, stage 2) for sm_90 without a GPU, with whichever
Triton is importable (the H200 has 3.6.0), at the arguments the public launchers pass on CUDA,
and dump TTGIR / PTX / SASS plus the inner-loop instruction mix.

    python3 -m pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python3 benchmarks/next/aot_moe.py [--out DIR] [--knobs '{"FP4_DECODE": 1}']

How: the launchers run on CPU stand-in tensors of the K3 tp 1 shapes (16 experts, M = 1,
block_m = 1) with the GPU tile choices (INTERPRETER_BIG_TILES off); the jit kernel objects are
swapped for recorders, then each recorded call is replayed through the real JITFunction.warmup
under a stand-in driver whose current target is ("cuda", 90, 32): Triton's own binder computes
the specialization (ints equal to 1 as constexprs, 16-divisibility), exactly as on the GPU
(pointer alignment comes from the CPU stand-ins' addresses, which torch aligns like CUDA's).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions (launches are captured, not run)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

sys.path.insert(0, os.getcwd())
from k3lab.kernels import moe  # noqa: E402
from k3lab.plan import RoutePlan  # noqa: E402
from k3lab.weights import MXFP4  # noqa: E402

os.environ["TRITON_INTERPRET"] = "1"  # after the decorators: only for the launchers' CPU checks
moe.INTERPRETER_BIG_TILES = False  # GPU tiles and the token loop


class _FakeDriver:
    """Enough of a CUDA driver for JITFunction.warmup: a target, device 0, stream 0."""

    def __init__(self):
        from triton.backends.nvidia.driver import CudaUtils  # noqa: F401  (import check only)

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        return None


class _FakeDriverLite(_FakeDriver):
    def __init__(self):
        pass


class _Capture:
    def __init__(self, store):
        self.store = store

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.store.append((grid, args, kwargs))
        return launch


def _plan(m, top_k, n_experts, d, block_m=1):
    """A stand-in plan of the right shapes (contents do not matter for a compile)."""
    ids = torch.arange(m * top_k, dtype=torch.int32).reshape(m, top_k) % n_experts
    cap = m * top_k * block_m
    return RoutePlan(topk_ids=ids, topk_weights=torch.ones((m, top_k)),
                     sorted_ids=torch.arange(cap, dtype=torch.int32),
                     sorted_weights=torch.ones(cap),
                     block_expert_ids=torch.zeros(cap // block_m, dtype=torch.int32),
                     num_valid=torch.tensor([m * top_k], dtype=torch.int32),
                     out=torch.zeros((m, d)), block_m=block_m)


def capture(d=3584, i=3072, n_experts=16, m=1, top_k=16, block_m=1):
    """[(name, kernel, grid, args, kwargs)] of one moe_stage1 and one moe_stage2 call at
    D = d (latent), I = i, MXFP4 experts, M tokens, plan tiles of block_m."""
    w13 = MXFP4(torch.empty((n_experts, 2 * i, d // 2), dtype=torch.uint8),
                torch.empty((n_experts, 2 * i, d // 32), dtype=torch.uint8))
    w2 = MXFP4(torch.empty((n_experts, d, i // 2), dtype=torch.uint8),
               torch.empty((n_experts, d, i // 32), dtype=torch.uint8))
    out = []
    for name, attr, call in (
            ("stage1", "_moe_stage1_kernel",
             lambda: moe.moe_stage1(torch.zeros((m, d), dtype=torch.bfloat16),
                                    _plan(m, top_k, n_experts, d, block_m), w13)),
            ("stage2", "_moe_stage2_tail_kernel",
             lambda: moe.moe_stage2(torch.zeros((m * top_k, i), dtype=torch.bfloat16),
                                    _plan(m, top_k, n_experts, d, block_m), w2))):
        kernel, store = getattr(moe, attr), []
        setattr(moe, attr, _Capture(store))
        try:
            call()
        finally:
            setattr(moe, attr, kernel)
        grid, args, kwargs = store[0]
        out.append((name, kernel, grid, args, kwargs))
    return out


def compile_captured(kernel, args, kwargs):
    driver.set_active(_FakeDriverLite())
    try:
        return kernel.warmup(*args, grid=(1,), **kwargs)
    finally:
        driver._active = None


BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def sass_of(compiled):
    """(SASS listing, resource usage line) of a compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", fh.name], capture_output=True,
                              text=True, check=True).stdout
        res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", fh.name], capture_output=True,
                             text=True, check=True).stdout
        return sass, " ".join(ln.strip() for ln in res.splitlines() if "REG" in ln)
    finally:
        os.unlink(fh.name)


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def parse_sass(text):
    """[(offset, opcode with modifiers, line)] of the SASS listing."""
    rows = []
    for line in text.splitlines():
        mt = _INSTR.match(line)
        if mt:
            rows.append((int(mt.group(1), 16), mt.group(3), line.strip()))
    return rows


def loop_bodies(text):
    """[(start, end)] offsets of the backward-branch loops (BRA to a lower address), shortest
    first."""
    bodies = set()
    for off, op, line in parse_sass(text):
        mt = re.search(r"BRA\S*\s+(?:`\()?0x([0-9a-f]+)", line)
        if op.startswith("BRA") and mt and int(mt.group(1), 16) <= off:
            bodies.add((int(mt.group(1), 16), off))
    return sorted(bodies, key=lambda b: b[1] - b[0])


def mix(text, start, end):
    """Counter of base opcodes (first dotted component kept for LDG/STG widths) in [start, end]."""
    c = Counter()
    for off, op, _ in parse_sass(text):
        if start <= off <= end:
            base = op.split(".")[0]
            if base in ("LDG", "LDS", "STS", "STG", "SHFL", "F2F", "I2F", "F2I"):
                c[op] += 1
            else:
                c[base] += 1
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/aot_moe")
    ap.add_argument("--knobs", default="{}", help="module constants of kernels/moe.py to set")
    ap.add_argument("--tag", default="default")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--block-m", type=int, default=1)
    a = ap.parse_args()
    for k, v in json.loads(a.knobs).items():
        if not hasattr(moe, k):
            raise SystemExit(f"unknown knob {k}")
        setattr(moe, k, v)
    os.makedirs(a.out, exist_ok=True)
    print("triton", triton.__version__, "knobs", a.knobs, flush=True)
    for name, kernel, grid, args, kwargs in capture(m=a.m, block_m=a.block_m):
        consts = {k: v for k, v in kwargs.items() if k.isupper() or k.startswith("num_")}
        try:
            ck = compile_captured(kernel, args, kwargs)
        except Exception as e:
            msg = str(e)
            at = msg.find("error:")
            print(name, "FAIL", type(e).__name__, msg[at:at + 300] if at >= 0 else msg[:300])
            continue
        sass, res = sass_of(ck)
        base = f"{a.out}/{a.tag}_{name}"
        for ext, txt in (("ttgir", ck.asm["ttgir"]), ("ptx", ck.asm["ptx"]), ("sass", sass)):
            with open(f"{base}.{ext}", "w") as fh:
                fh.write(txt)
        md = ck.metadata
        print(f"{name}: grid {grid} {res} shared {md.shared} "
              f"consts {consts}", flush=True)
        for start, end in loop_bodies(sass)[:4]:
            c = mix(sass, start, end)
            print(f"  loop [{start:#x}, {end:#x}] {sum(c.values())} instr: "
                  + ", ".join(f"{k} {v}" for k, v in c.most_common()), flush=True)


if __name__ == "__main__":
    main()
