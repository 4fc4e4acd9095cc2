"""k3lab.precompile.ahead (run as a script by test_precompile.py; prints one JSON line): a few
GEMVs' kernels compile in two worker processes, and the same calls then find every kernel
compiled. Without a GPU they compile for sm_90 under the stub driver of sm90_build.py; with
``--gpu`` on the GPU, where the calls then also run and are checked against torch."""

from __future__ import annotations

import json
import os
import sys

GPU = "--gpu" in sys.argv
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from sm90_build import compile_here_for_sm90, count_front_ends  # noqa: E402


def main() -> dict:
    if not GPU:
        compile_here_for_sm90()
    from k3lab import precompile
    from k3lab.kernels.dense import dense_gemv

    bf, dev = torch.bfloat16, "cuda" if GPU else "cpu"
    shapes = [(96, 256), (200, 512), (64, 1024)]
    gen = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(1, k, device=dev, generator=gen).to(bf) for _, k in shapes]
    ws = [torch.randn(n, k, device=dev, generator=gen).to(bf) for n, k in shapes]
    calls = [lambda x=x, w=w: dense_gemv(x, w) for x, w in zip(xs, ws, strict=True)]
    broken = [lambda: dense_gemv(torch.zeros(1, 3, dtype=bf, device=dev),
                                 torch.zeros(8, 5, dtype=bf, device=dev))]
    built_here = count_front_ends()  # none when the workers compiled
    run_before = jit.JITFunction.run
    stats = precompile.ahead(calls[:1] + broken + calls[1:], n_workers=2)
    restored = jit.JITFunction.run is run_before

    compiles = []
    do_compile = jit.JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiles.append(self.fn.__name__)
        return do_compile(self, *args, **kwargs)

    jit.JITFunction._do_compile = counting
    err = None
    if GPU:  # launched for real: compiled nowhere here, and right
        outs = [call() for call in calls]
        refs = [x.float() @ w.float().T for x, w in zip(xs, ws, strict=True)]
        err = max(float((o.float() - r).abs().max() / r.abs().max())
                  for o, r in zip(outs, refs, strict=True))
    else:
        with precompile._compile_only():
            for call in calls:
                call()
    return {"rel_err": err, "kernels": stats.kernels, "in_workers": stats.in_workers,
            "calls": stats.calls, "failed_calls": stats.failed_calls,
            "failed_compiles": stats.failed_compiles,
            "restored": restored, "compiles_after": compiles, "built_here": built_here}


if __name__ == "__main__":  # the workers import this file as their main module
    print(json.dumps(main()))
