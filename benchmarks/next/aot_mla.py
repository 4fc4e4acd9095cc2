"""Compile ``mla_decode``'s two kernels for sm_90 without a GPU (the launch is captured on CPU
stand-in tensors, then compiled at the constexprs and num_warps / num_stages the CUDA launcher
would pick, DOT_FP32=False), and dump TTGIR / PTX / SASS for reading.

    PYTHONPATH=/tmp/t36 python3 benchmarks/next/aot_mla.py --ctx 32768 [--set NAME=VALUE ...] \
        [--dump DIR]

``--set`` sets a module constant of k3lab.kernels.mla first (e.g. --set BLOCK_N=64). Prints, per
kernel: registers, spills, shared memory bytes, and the SASS opcode histogram of the whole kernel.
"""

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions (the launch is captured, not run)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

mla = importlib.import_module("k3lab.kernels.mla")
os.environ["TRITON_INTERPRET"] = "1"  # after the decorators: the launcher's CPU check passes
TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
         torch.int64: "*i64", torch.float16: "*fp16", torch.uint8: "*u8"}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class _Capture:
    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.kernel, grid, args, kwargs))
        return launch


def capture(ctx, heads=12, C=512, R=64, M=1, num_splits=None):
    """[(kernel, grid, args, kwargs)] of one mla_decode call, as the CUDA launcher makes them."""
    launches = []
    names = [n for n in dir(mla) if n.startswith("_mla_decode_") and n.endswith("_kernel")]
    saved = {n: getattr(mla, n) for n in names}
    saved_sm = mla._sm_count
    try:
        for n in names:
            setattr(mla, n, _Capture(saved[n], launches))
        mla._sm_count = lambda dtype, index: 132
        q_lat = torch.randn(M, heads, C).bfloat16()
        q_rope = torch.randn(M, heads, R).bfloat16()
        kv = torch.empty(M, ctx, C + R, dtype=torch.bfloat16)
        lens = torch.full((M,), ctx, dtype=torch.int32)
        # the launcher chooses the GPU tiles for cuda only: pretend (validation reads .device)
        mla.mla_decode(q_lat, q_rope, kv, lens, sm_scale=0.07, num_splits=num_splits)
    finally:
        for n, k in saved.items():
            setattr(mla, n, k)
        mla._sm_count = saved_sm
    # the CPU launcher computes in fp32 and keeps the short-context tiles: make them the GPU's
    block_n, warps, stages = mla._split_config(ctx, True)
    for launch in launches:
        if "DOT_FP32" in launch[3]:
            launch[3].update(DOT_FP32=False, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return launches


def compile_launch(kernel, args, kwargs):
    kwargs = dict(kwargs)
    opts = {"num_warps": kwargs.pop("num_warps", 4)}
    if "num_stages" in kwargs:
        opts["num_stages"] = kwargs.pop("num_stages")
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in kwargs:
            signature[name], constexprs[name] = "constexpr", kwargs[name]
            continue
        arg = args[i]
        if isinstance(arg, torch.Tensor):
            signature[name] = TYPES[arg.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(arg, bool):
            signature[name], constexprs[name] = "constexpr", arg
        elif isinstance(arg, int):
            signature[name] = "i32"
            if arg and arg % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
            if arg == 1:  # Triton specializes 1 as a constant
                signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "fp32"
    src = ASTSource(kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts), opts


def sass_of(compiled, path):
    with open(path + ".cubin", "wb") as fh:
        fh.write(compiled.asm["cubin"])
    out = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", "-g", path + ".cubin"],
                         capture_output=True, text=True)
    if out.returncode:
        out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path + ".cubin"],
                             capture_output=True, text=True)
    return out.stdout


def resources(compiled):
    """cuobjdump's resource line of the cubin: registers, stack, local (spill) bytes."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(compiled.asm["cubin"])
        fh.flush()
        out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", fh.name],
                             capture_output=True, text=True).stdout
    m = re.search(r"REG:\d+.*", out)
    return m.group(0) if m else out.strip()[-200:]


def histogram(sass):
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--splits", type=int, default=None)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--dump", default=None)
    a = ap.parse_args()
    for kv in a.set:
        k, v = kv.split("=", 1)
        setattr(mla, k, eval(v))
    print("triton", triton.__version__, flush=True)
    for kernel, grid, args, kwargs in capture(a.ctx, num_splits=a.splits):
        name = kernel.fn.__name__
        try:
            c, opts = compile_launch(kernel, args, kwargs)
        except Exception as e:  # report and go on
            msg = str(e)
            at = msg.find("error:")
            print(name, "FAIL", type(e).__name__, msg[at:at + 400] if at >= 0 else msg[:400])
            continue
        md = c.metadata
        ce = {k: v for k, v in kwargs.items() if k.isupper() or k.startswith("num_")}
        print(f"{name} grid={grid} {ce} shared={md.shared} {resources(c)}", flush=True)
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            base = os.path.join(a.dump, name)
            for k in ("ttgir", "ptx"):
                with open(f"{base}.{k}", "w") as fh:
                    fh.write(c.asm[k])
            sass = sass_of(c, base)
            with open(base + ".sass", "w") as fh:
                fh.write(sass)
            print("  ", dict(sorted(histogram(sass).items(), key=lambda x: -x[1])))


if __name__ == "__main__":
    sys.exit(main())
