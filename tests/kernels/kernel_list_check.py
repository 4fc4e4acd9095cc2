"""k3lab.precompile's kernel lists (run as a script by test_precompile.py; prints one JSON line).

``record LIST``: a few GEMV launches and a heuristics-wrapped kernel's, compile-only for
sm_90 (the stub driver of sm90_build.py) with :func:`k3lab.precompile.record` on: the list gets
their kernels. ``replay LIST`` (another process, an empty Triton cache):
:func:`k3lab.precompile.warm` compiles the list in two worker
processes, then the same launches find every kernel in the cache (no front end runs here).
With ``--gpu`` both run on the GPU and the launches run: the replayed ones are checked
against torch."""

from __future__ import annotations

import json
import os
import sys

GPU = "--gpu" in sys.argv
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from sm90_build import compile_here_for_sm90, count_front_ends  # noqa: E402


def _calls():
    """(call, its fp32 truth or None) per GEMV: plain ones and a gate/up one; then a fill by a
    kernel behind a heuristics wrapper (wrapped_kernel.py)."""
    from wrapped_kernel import wrapped_fill

    from k3lab.kernels.dense import GemvConfig, dense_gemv

    bf, dev = torch.bfloat16, "cuda" if GPU else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for n, k, act in [(96, 256, None), (200, 512, None), (64, 1024, "situ")]:
        x = torch.randn(1, k, device=dev, generator=gen).to(bf)
        w = torch.randn(n if act is None else 2 * n, k, device=dev, generator=gen).to(bf)
        truth = x.float() @ w.float().T if act is None else None
        out.append((lambda x=x, w=w, act=act: dense_gemv(x, w, activation=act,
                                                         config=GemvConfig(block_n=16)), truth))
    filled = torch.empty(40, device=dev)
    out.append((lambda: wrapped_fill[(1,)](filled, 40, 2.5) and filled, None))
    return out


def _launch(calls) -> float | None:
    """Run the calls (compile-only without a GPU); the largest relative error of the plain ones
    against their truth on the GPU."""
    from k3lab import precompile

    if not GPU:
        with precompile._compile_only():
            for call, _ in calls:
                call()
        return None
    errs = []
    for call, truth in calls:
        got = call()
        if truth is not None:
            errs.append(float((got.float() - truth).abs().max() / truth.abs().max()))
    return max(errs)


def main(mode: str, path: str) -> dict:
    if not GPU:
        compile_here_for_sm90()
    from k3lab import precompile

    if mode == "record":
        recording = precompile.record(path)
        _launch(_calls())
        lines = precompile.read_list(path)
        return {"recording": recording, "lines": len(lines),
                "names": sorted({line["name"] for line in lines}),
                "noted": precompile.built_here(path)}
    warming = precompile.warm([path, path + ".missing"], n_workers=2)
    for f in warming.futures:
        f.exception(timeout=300)
    counts, ready = warming.counts(), warming.ready_after()
    warming.close()
    built_here = count_front_ends()  # none when the workers compiled
    precompile.record(path + ".again.tmp")  # and the record notes none either
    err = _launch(_calls())
    return {**counts, "ready": ready, "built_here": built_here,
            "noted": precompile.built_here(path + ".again.tmp"), "rel_err": err}


if __name__ == "__main__":  # the workers import this file as their main module
    args = [a for a in sys.argv[1:] if a != "--gpu"]
    print(json.dumps(main(args[0], args[1])))
