"""k3lab.precompile's kernel lists (run as a script by test_precompile.py; prints one JSON line).

``record LIST``: a few GEMV launches compile-only for sm_90 (the stub driver of sm90_build.py)
with :func:`k3lab.precompile.record` on: the list gets their kernels. ``replay LIST`` (another
process, an empty Triton cache): :func:`k3lab.precompile.warm` compiles the list in two worker
processes, then the same launches find every kernel in the cache (no front end runs here)."""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from sm90_build import _H200Stub  # noqa: E402


def _calls():
    from k3lab.kernels.dense import GemvConfig, dense_gemv

    bf = torch.bfloat16
    shapes = [(96, 256, None), (200, 512, None), (64, 1024, "situ")]
    return [lambda n=n, k=k, a=a: dense_gemv(torch.zeros(1, k, dtype=bf),
                                             torch.zeros(n if a is None else 2 * n, k, dtype=bf),
                                             activation=a, config=GemvConfig(block_n=16))
            for n, k, a in shapes]


def main(mode: str, path: str) -> dict:
    triton.runtime.driver.set_active(_H200Stub())
    import k3lab.kernels  # noqa: F401

    for name, mod in list(sys.modules.items()):  # CPU tensors are fine: nothing launches
        if name.startswith("k3lab.kernels") and hasattr(mod, "check_device"):
            mod.check_device = lambda name, t: None
    from triton.compiler import ASTSource

    from k3lab import precompile

    if mode == "record":
        recording = precompile.record(path)
        with precompile._compile_only():
            for call in _calls():
                call()
        return {"recording": recording, "lines": len(precompile.read_list(path))}
    warming = precompile.warm([path, path + ".missing"], n_workers=2)
    for f in warming.futures:
        f.exception(timeout=300)
    counts = warming.counts()
    warming.close()
    built_here = []  # front ends run in this process: none when the workers compiled
    make_ir = ASTSource.make_ir

    def counting_ir(self, *args, **kwargs):
        built_here.append(self.name)
        return make_ir(self, *args, **kwargs)

    ASTSource.make_ir = counting_ir
    with precompile._compile_only():
        for call in _calls():
            call()
    return {**counts, "built_here": built_here}


if __name__ == "__main__":  # the workers import this file as their main module
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
