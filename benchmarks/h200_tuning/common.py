"""What the tuning sweeps share: the copy bandwidth, graph timing that records a failed config as
NaN instead of stopping the sweep, per-kernel durations of one call, and a printed row log."""

import json
import os

from k3lab import profile

OUT = os.environ.get("OUT", "/tmp")
ROWS: list[dict] = []
bw = profile.copy_bandwidth("cuda")


def gt(fn, copies, **kw):
    """Median graph-replay microseconds a call (cold copies rotated), NaN if the config fails."""
    try:
        return profile.time_variant(
            fn, copies, mode="graph", repeats=kw.pop("repeats", 20), **kw
        ).median_us
    except Exception as e:
        print("ERR", repr(e)[:300], flush=True)
        return float("nan")


def kdur(fn, inputs):
    """{kernel: microseconds} of one call (torch.profiler)."""
    try:
        t = profile.timeline(fn, inputs)
        return {k: round(float(v), 2) for k, v in t.groupby("kernel").dur_us.sum().items()}
    except Exception as e:
        return {"err": repr(e)[:200]}


def rec(**r):
    ROWS.append(r)
    print(json.dumps(r), flush=True)


def dump(name: str) -> None:
    with open(f"{OUT}/{name}", "w") as fh:
        json.dump(ROWS, fh)
