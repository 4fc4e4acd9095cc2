"""Needs branch kda4 for the session-4 switches (not on main).

Compile ``kda_decode``'s kernel for sm_90 without a GPU (Triton 3.6, as on the H200) at the
K3 shapes and given module switches; print registers, spills, shared memory, the SASS opcode
histogram and where the state / f_b loads, barriers and state stores sit in the SASS.

    PYTHONPATH=/tmp/t36:. python3 benchmarks/h200_session4/aot_kda.py --tp 8 \
        [--block-v 32] [--set LOADS_FIRST=True ...] [--dump DIR]

Reuses the capture / compile helpers of benchmarks/next/aot_mla.py.
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "next"))
import aot_mla as aot  # noqa: E402  (imports the kernels with TRITON_INTERPRET=0)

import k3lab.kernels.kda as kda  # noqa: E402
from k3lab.boundaries import get  # noqa: E402
from k3lab.config import preset  # noqa: E402


def capture(tp, block_v, variant="fused"):
    """variant: 'fused', 'fused+conv' or 'fused+out_gate' (the boundary's variants)."""
    launches = []
    saved = kda._kda_decode_kernel
    kda._kda_decode_kernel = aot._Capture(saved, launches)
    try:
        b = get("kda")
        i = b.make_inputs(preset("kimi-k3", tp), "cpu", 0, M=1)
        if variant != "fused":
            b.variant(variant).fn(i)
        else:
            kda.kda_decode(i["q"], i["k"], i["v"], i["f_low"], i["f_b"], i["A_log"],
                           i["dt_bias"], i["b_logits"], i["state"],
                           lower_bound=i["lower_bound"], scale=i["scale"], block_v=block_v)
    finally:
        kda._kda_decode_kernel = saved
    return launches


def order(sass):
    """Memory ops / barriers in SASS order: G=LDG, S=STG, B=BAR, X=SHFL, f=FFMA, sts/lds=shared."""
    seq = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if not m:
            continue
        op = m.group(1)
        if op.startswith("LDG"):
            seq.append("G" + ("128" if ".128" in op else "64" if ".64" in op else ""))
        elif op.startswith("STG"):
            seq.append("S")
        elif op.startswith("BAR"):
            seq.append("B")
        elif op.startswith("SHFL"):
            seq.append("X")
        elif op.startswith("FFMA"):
            seq.append("f")
        elif op.startswith("LDS") or op.startswith("STS"):
            seq.append(op[:3].lower())
    out, prev, n = [], None, 0
    for t in seq + [None]:
        if t == prev:
            n += 1
            continue
        if prev is not None:
            out.append(prev + (f"x{n}" if n > 1 else ""))
        prev, n = t, 1
    return " ".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--block-v", type=int, default=None)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--dump", default=None)
    ap.add_argument("--variant", default="fused", choices=["fused", "fused+conv", "fused+out_gate"])
    a = ap.parse_args()
    for kv in a.set:
        k, v = kv.split("=", 1)
        setattr(kda, k, eval(v))
    for kernel, grid, args, kwargs in capture(a.tp, a.block_v, a.variant):
        try:
            if kda.MAX_NREG is not None:  # the CUDA launcher's extra option (not captured on CPU)
                compile0 = aot.triton.compile

                def compile_nreg(src, target=None, options=None, _c=compile0):
                    return _c(src, target=target, options={**options, "maxnreg": kda.MAX_NREG})
                aot.triton.compile = compile_nreg
            c, _ = aot.compile_launch(kernel, args, kwargs)
        except Exception as e:  # report and go on
            msg = str(e)
            at = msg.find("error:")
            print("FAIL", type(e).__name__, msg[at:at + 400] if at >= 0 else msg[:400])
            continue
        ce = {k: v for k, v in kwargs.items() if k in ("BV", "BR", "BRT", "num_warps")
              or (k.isupper() and isinstance(v, bool) and v)}
        print(f"tp{a.tp} {a.set} grid={grid} {ce} shared={c.metadata.shared} "
              f"{aot.resources(c)}", flush=True)
        base = os.path.join(a.dump or "/tmp/aot_kda", "kda")
        os.makedirs(os.path.dirname(base), exist_ok=True)
        sass = aot.sass_of(c, base)
        with open(base + ".sass", "w") as fh:
            fh.write(sass)
        for k in ("ttgir", "ptx"):
            with open(f"{base}.{k}", "w") as fh:
                fh.write(c.asm[k])
        hist = aot.histogram(sass)
        print("   ", {k: hist[k] for k in ("LDG", "STG", "BAR", "SHFL", "LDS", "STS", "FFMA",
                                          "MUFU") if k in hist}, "total", sum(hist.values()))
        print("   ", order(sass))


if __name__ == "__main__":
    sys.exit(main())
