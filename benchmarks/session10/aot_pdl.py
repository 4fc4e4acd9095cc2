"""Offline (no GPU): the MXFP4 stage kernels at K3 tp 1 (prepared activations, inline PTX) as
sm_90 SASS from the installed Triton (the H200's is 3.6: PYTHONPATH=/tmp/t36), with
kernels/moe.PDL_STEPS off and at each value given: registers (128 or fewer: 4 programs an SM),
the K loop's length and where its 16 128-bit loads sit, and the griddepcontrol and L2 prefetch
instructions before the loop.

    PYTHONPATH=/tmp/t36 python3 benchmarks/session10/aot_pdl.py [steps ...]   # default: 0 2 12
"""

import sys

sys.path.insert(0, "benchmarks/next")
import aot_moe  # noqa: E402

from k3lab.kernels import moe  # noqa: E402

for steps in [None, *[int(a) for a in sys.argv[1:] or ("0", "2", "12")]]:
    moe.PDL_STEPS = steps
    for name, kernel, _grid, args, kwargs in aot_moe.capture(d=3584, i=3072):
        kw = dict(kwargs)
        kw["FP4"] |= 1 | moe._MMA_XP  # inline PTX, as on the GPU; prepared x, as moe_block runs
        if steps is not None:  # as moe._pdl gives a compiled launch (aot_moe sets the
            kw.update(PDL=True, PDL_STEPS=steps, launch_pdl=True)  # interpreter flag)
        sass, res = aot_moe.sass_of(aot_moe.compile_captured(kernel, args, kw))
        rows = aot_moe.parse_sass(sass)
        lo, hi = max(aot_moe.loop_bodies(sass), key=lambda b: b[1] - b[0])
        body = [r for r in rows if lo <= r[0] <= hi]
        loads = [i for i, r in enumerate(body) if r[1].startswith("LDG.E.128")]
        pre = [r[1] for r in rows if r[0] < lo]
        n_pf = sum("CCTL" in o for o in pre)
        n_gdc = sum(o.startswith(("ACQBULK", "PREEXIT")) for o in pre)
        print(f"PDL_STEPS={steps} {name}: {res.split()[0]}, loop {len(body)} instructions, "
              f"loads at {loads}; before the loop: {n_pf} L2 prefetches, {n_gdc} griddepcontrol",
              flush=True)
