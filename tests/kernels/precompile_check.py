"""k3lab.precompile.ahead without a GPU (run as a script by test_precompile.py; prints one JSON
line): the kernels compile for sm_90 under the stub driver of sm90_build.py, in two worker
processes, and the same calls then find every kernel compiled."""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from sm90_build import _H200Stub  # noqa: E402


def main() -> dict:
    triton.runtime.driver.set_active(_H200Stub())
    import k3lab.kernels  # noqa: F401

    for name, mod in list(sys.modules.items()):  # CPU tensors are fine: nothing launches
        if name.startswith("k3lab.kernels") and hasattr(mod, "check_device"):
            mod.check_device = lambda name, t: None
    from k3lab import precompile
    from k3lab.kernels.dense import dense_gemv

    bf = torch.bfloat16
    shapes = [(96, 256), (200, 512), (64, 1024)]
    calls = [lambda n=n, k=k: dense_gemv(torch.zeros(1, k, dtype=bf), torch.zeros(n, k, dtype=bf))
             for n, k in shapes]
    broken = [lambda: dense_gemv(torch.zeros(1, 3, dtype=bf), torch.zeros(8, 5, dtype=bf))]
    from triton.compiler import ASTSource

    built_here = []  # front ends run in this process: none when the workers compiled
    make_ir = ASTSource.make_ir

    def counting_ir(self, *args, **kwargs):
        built_here.append(self.name)
        return make_ir(self, *args, **kwargs)

    ASTSource.make_ir = counting_ir
    run_before = jit.JITFunction.run
    stats = precompile.ahead(calls[:1] + broken + calls[1:], n_workers=2)
    restored = jit.JITFunction.run is run_before

    compiles = []
    do_compile = jit.JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiles.append(self.fn.__name__)
        return do_compile(self, *args, **kwargs)

    jit.JITFunction._do_compile = counting
    with precompile._compile_only():
        for call in calls:
            call()
    return {"kernels": stats.kernels, "in_workers": stats.in_workers, "calls": stats.calls,
            "failed_calls": stats.failed_calls, "failed_compiles": stats.failed_compiles,
            "restored": restored, "compiles_after": compiles, "built_here": built_here}


if __name__ == "__main__":  # the workers import this file as their main module
    print(json.dumps(main()))
