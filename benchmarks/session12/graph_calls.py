"""H200, issue 4 (session 12): how many calls profile.time_variant's graph holds when it times
stage 2 (the 20_moe report's conditions), next to the median it gives: it captures one pass over
the copies when the eager warm-up pass ran slower than AMORTIZED_CALL_US a call, else passes up
to MIN_GRAPH_CALLS calls. REPS rows.

    python3 benchmarks/session12/graph_calls.py       # writes $OUT/graph_calls.json
"""

import os
import sys
import time

sys.path.insert(0, "benchmarks/h200_tuning")
from common import bw, dump, rec  # noqa: E402
from moe_stages import report_copies  # noqa: E402

from k3lab import profile  # noqa: E402
from k3lab.boundaries import moe as MB  # noqa: E402

REPS = int(os.environ.get("REPS", "12"))


def main():
    copies, _ = report_copies()
    fn = MB.stage_fns("stage2")["fused"]
    nbytes = MB.stage_bytes("stage2", copies[0])
    t0 = time.time()
    for rep in range(REPS):
        t = profile.time_variant(fn, copies, mode="graph", repeats=10)
        rec(k="graph_calls", rep=rep, us=round(t.median_us, 2),
            frac=round(nbytes / bw * 1e6 / t.median_us, 3), note=t.note,
            t=round(time.time() - t0, 2))
    dump("graph_calls.json")


if __name__ == "__main__":
    main()
