"""Compile ``_route_sort_kernel`` for sm_90 without a GPU (as benchmarks/h200_session3/aot_route.py)
for the session-4 route variants (module switches), and report registers, spills, shared bytes and
SASS counts (global loads / barriers / instructions) of each: every variant of route_sweep.py must
compile with the H200's Triton 3.6.

    PYTHONPATH=/tmp/t36:. python3 benchmarks/h200_session4/aot_route4.py [M ...]
"""

import importlib
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, "benchmarks/h200_session3")
import aot_route  # noqa: E402  (sets TRITON_INTERPRET around the import of the kernel module)
import triton  # noqa: E402

rs = importlib.import_module("k3lab.kernels.route_sort")
_gemv_rows = rs._gemv_rows
rs._gemv_rows = lambda E, H, on_gpu: _gemv_rows(E, H, True)  # the GPU's row programs
# (name, module switches): route_sweep.py's variants
ROWS = {"GEMV_ROW_PROGRAMS": 132}
C1024 = {**ROWS, "GEMV_ROW_CHUNK": 1024}
VARIANTS = [
    ("default", {}),
    ("rows132", ROWS),
    ("rows132-c1024", C1024),
    ("candl1", {"CAND_CACHE": ""}),
    ("rows132-c1024-candl1", {**C1024, "CAND_CACHE": ""}),
    ("scalar", {"SELECT_SCALAR_KEYS": True}),
    ("rows132-c1024-scalar", {**C1024, "SELECT_SCALAR_KEYS": True}),
    ("rows132-c1024-scalar-candl1", {**C1024, "SELECT_SCALAR_KEYS": True, "CAND_CACHE": ""}),
    ("rows264", {"GEMV_ROW_PROGRAMS": 264}),
    ("rows132-s2", {**ROWS, "GEMV_ROW_SPLITS": 2}),
    ("rows132-nw2", {**ROWS, "NUM_WARPS": 2}),
]
DEFAULTS = {k: getattr(rs, k) for _, kw in VARIANTS for k in kw} | {"TAIL_STAGE": rs.TAIL_STAGE}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
SASS_KEYS = ("LDG.E.128", "LDG", "BAR.SYNC", "ATOM", "RED", "MEMBAR")


def sass_counts(cubin: bytes) -> str:
    """Resource usage (registers, spills) and SASS instruction counts of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True,
                              text=True).stdout
        res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True,
                             text=True).stdout
    if os.environ.get("SASS_DUMP"):
        with open(os.environ["SASS_DUMP"], "a") as fh:
            fh.write(sass)
    ins = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", ln)]
    n = {k: sum(k in ln for ln in ins) for k in SASS_KEYS}
    use = " ".join(m.group(0) for m in re.finditer(r"(REG|STACK|SHARED|LOCAL):\d+", res))
    return f"{use} instr {len(ins)} " + " ".join(f"{k} {v}" for k, v in n.items())


def compile_variant(kw, stage, M=1, E=896, H=7168):
    for k, v in {**DEFAULTS, **kw, "TAIL_STAGE": stage}.items():
        setattr(rs, k, v)
    captured = {}
    orig = triton.compile

    def grab(*a, **k):
        captured["c"] = c = orig(*a, **k)
        return c
    aot_route.triton.compile = grab
    try:
        shared = aot_route.compile_case(E, H, M, 16)
    finally:
        aot_route.triton.compile = orig
    return f"shared {shared} " + sass_counts(captured["c"].asm["cubin"])


if __name__ == "__main__":
    print("triton", triton.__version__, flush=True)
    for M in [int(a) for a in sys.argv[1:]] or [1]:
        for name, kw in VARIANTS:
            for stage in (-1, 3):
                try:
                    print(M, name, "stage", stage, compile_variant(kw, stage, M), flush=True)
                except Exception as e:  # report and go on
                    msg = str(e)
                    at = msg.find("error:")
                    print(M, name, "stage", stage, "FAIL", type(e).__name__,
                          msg[at:at + 300] if at >= 0 else msg[:300], flush=True)
