"""Offline sm_90 compile (triton 3.6 in /tmp/t36, no GPU) of the MLA launches the H200 would run
for each combine variant of mla_sweep.py here (default = COMBINE_PDL on), with registers /
spills / shared memory and a few SASS counts; PDL on where the module's switches ask for it (the
CPU launcher turns it off: set back as the CUDA launcher would).

    PYTHONPATH=/tmp/t36:. python3 benchmarks/h200_session4/aot_mla4.py [--ctx 32768] [--dump DIR]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "next"))
import aot_mla  # noqa: E402

mla = aot_mla.mla
VARIANTS = {
    "default": {},
    "no-pdl": dict(COMBINE_PDL=False),
    "pdl2": dict(COMBINE_PDL=True, SPLIT_PDL=True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--dump", default=None)
    a = ap.parse_args()
    for vname, settings in VARIANTS.items():
        saved = {k: getattr(mla, k) for k in settings}
        try:
            for k, v in settings.items():
                setattr(mla, k, v)
            launches = aot_mla.capture(a.ctx)
            cpdl, spdl = bool(mla.COMBINE_PDL), bool(mla.SPLIT_PDL)
        finally:
            for k, v in saved.items():
                setattr(mla, k, v)
        seen = set()
        for kernel, grid, args, kwargs in launches:
            kwargs = dict(kwargs)
            # the launcher turns PDL on for CUDA only: as it would there (several splits)
            if kernel.fn.__name__ == "_mla_decode_split_kernel":
                kwargs.update(PDL_WAIT=spdl, PDL_TRIGGER=spdl or cpdl)
            else:
                kwargs.update(PDL_WAIT=cpdl, PDL_TRIGGER=spdl)
            key = (kernel.fn.__name__, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
            if key in seen:
                continue
            seen.add(key)
            name = kernel.fn.__name__
            try:
                c, _ = aot_mla.compile_launch(kernel, args, kwargs)
            except Exception as e:
                msg = str(e)
                at = msg.find("error:")
                print(vname, name, "FAIL", type(e).__name__, msg[at:at + 600] if at >= 0
                      else msg[:600], flush=True)
                continue
            ce = {k: v for k, v in kwargs.items()
                  if k in ("PDL_WAIT", "PDL_TRIGGER", "BLOCK_C", "BLOCK_S",
                           "BLOCK_N", "num_stages")}
            tag = f"{vname.replace('/', '-')}_{name}"
            sass = aot_mla.sass_of(c, f"/tmp/aot_mla4_{tag}")
            h = aot_mla.histogram(sass)
            print(f"{vname:14s} {name} grid={grid} {ce} shared={c.metadata.shared} "
                  f"{aot_mla.resources(c)} BAR={h.get('BAR', 0)} "
                  f"griddep={sass.count('ACQBULK') + sass.count('PREEXIT')}", flush=True)
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                with open(os.path.join(a.dump, f"{tag}.sass"), "w") as fh:
                    fh.write(sass)
                with open(os.path.join(a.dump, f"{tag}.ptx"), "w") as fh:
                    fh.write(c.asm["ptx"])


if __name__ == "__main__":
    sys.exit(main())
