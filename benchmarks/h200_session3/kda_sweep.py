"""H200 session-3 sweep: fused KDA decode (issue 5) against fla-core + the f_b projection.

Run from the repo root: ``python3 benchmarks/h200_session3/kda_sweep.py`` (writes kda.json to
$OUT). Kimi-K3, M=1, cold copies, graph replay. Every timed config is checked against the
reference first (``ok`` in its row) and a failing one is recorded, never fatal.

What the variants test (module constants of kernels/kda.py, set before each call):
- ``old``: the kernel as of ad2f031 (the session's start), loaded from git: the baseline.
- ``new``: the rewrite's default: all loads issued before any use (SYNC_LOADS=1: a barrier after
  the state and small loads, then f_b's; offline SASS of the old kernel shows ptxas sinking the
  state load behind the f_b GEMV, the ablation's additive 2 us + 1.2 us), f_b and f_low read as
  int32 pairs in one tile (the state's layout when BV = R/2 = 64), exp2 with folded constants,
  S^T k and S^T q side by side (o = S^T q + u k.q).
- ``nosync``: SYNC_LOADS=0 (what the barrier buys); ``sync2``: a second barrier after f_b's
  loads; ``ordered``: volatile state and f_b loads (ptxas keeps their order; .STRONG.SYS loads).
- ``unpacked``: bf16 f_b through [D, 64] chunks as before (PACK_FB=False).
- ``fusered``: FUSE_REDUCE: the L2 norms deferred (reduce with raw q, k, scale after) and the
  five k-axis sums as one 5-operand tl.reduce in the state's layout (offline sm_90 SASS with
  triton 3.9: 14 barriers instead of 16, more shuffles).
- block_v 16 / 32 / 64 / 128 and warps (MAX_WARPS): v-tiles vs a head per program, per tp.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks/h200_tuning")
import torch  # noqa: E402
from common import bw, dump, gt, kdur, rec  # noqa: E402

import k3lab.kernels.kda as kda  # noqa: E402
from k3lab import profile  # noqa: E402
from k3lab.boundaries import clone_inputs, get  # noqa: E402
from k3lab.config import preset  # noqa: E402

BASE = "ad2f031"
K = get("kda")
FLA = next(v for v in K.variants if v.name == "fla-core")
REF = next(v for v in K.variants if v.name == "reference")


def old_kda():
    """kernels/kda.py at BASE, imported from a temp file (Triton's jit needs a real file)."""
    try:
        src = subprocess.run(["git", "show", f"{BASE}:kernels/kda.py"], capture_output=True,
                             text=True, check=True).stdout
    except Exception as e:  # no git metadata on the device: skip the baseline
        print("no baseline:", repr(e)[:200], flush=True)
        return None
    path = Path(tempfile.mkdtemp()) / "kda_base.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("kda_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.kda_decode


OLD = old_kda()
DEFAULTS = dict(PACK_FB=kda.PACK_FB, SYNC_LOADS=kda.SYNC_LOADS, ORDERED_LOADS=kda.ORDERED_LOADS,
                FUSE_REDUCE=kda.FUSE_REDUCE,
                MAX_WARPS=kda.MAX_WARPS, TILE_PER_WARP=kda.TILE_PER_WARP)


def fused_fn(block_v=None, impl=None, **consts):
    def fn(i):
        for name, val in {**DEFAULTS, **consts}.items():
            setattr(kda, name, val)
        f = impl or kda.kda_decode
        o = f(i["q"], i["k"], i["v"], i["f_low"], i["f_b"], i["A_log"], i["dt_bias"],
              i["b_logits"], i["state"], lower_bound=i["lower_bound"], scale=i["scale"],
              block_v=block_v)
        return {"o": o, "state": i["state"]}
    return fn


def check(fn, inputs):
    try:
        ref = REF.fn(clone_inputs(inputs))
        out = fn(clone_inputs(inputs))
        torch.cuda.synchronize()
        K.check(out, ref, inputs)
        return True
    except Exception as e:
        print("CHECK FAIL", repr(e)[:300], flush=True)
        return False


# (tp, name, fn-maker): under 30 timed configs
CONFIGS = {
    8: [("fla", lambda: FLA.fn), ("old bv32", lambda: fused_fn(32, OLD)),
        ("new bv32", lambda: fused_fn(32)), ("new bv64", lambda: fused_fn(64)),
        ("new bv64 16w", lambda: fused_fn(64, MAX_WARPS=16)), ("new bv16", lambda: fused_fn(16)),
        ("nosync bv32", lambda: fused_fn(32, SYNC_LOADS=0)),
        ("nosync bv64", lambda: fused_fn(64, SYNC_LOADS=0)),
        ("sync2 bv32", lambda: fused_fn(32, SYNC_LOADS=2)),
        ("ordered bv64", lambda: fused_fn(64, ORDERED_LOADS=True)),
        ("unpacked bv32", lambda: fused_fn(32, PACK_FB=False)),
        ("fusered bv64", lambda: fused_fn(64, FUSE_REDUCE=True))],
    1: [("fla", lambda: FLA.fn), ("old bv32", lambda: fused_fn(32, OLD)),
        ("new bv32", lambda: fused_fn(32)), ("new bv64", lambda: fused_fn(64)),
        ("new bv64 16w", lambda: fused_fn(64, MAX_WARPS=16)),
        ("new bv128 8w", lambda: fused_fn(128)),
        ("new bv128 16w", lambda: fused_fn(128, MAX_WARPS=16)),
        ("nosync bv64", lambda: fused_fn(64, SYNC_LOADS=0)),
        ("fusered bv64", lambda: fused_fn(64, FUSE_REDUCE=True))],
    2: [("fla", lambda: FLA.fn), ("new bv32", lambda: fused_fn(32)),
        ("new bv64", lambda: fused_fn(64))],
    4: [("fla", lambda: FLA.fn), ("new bv32", lambda: fused_fn(32)),
        ("new bv64", lambda: fused_fn(64))],
}

for tp, configs in CONFIGS.items():
    cfg = preset("kimi-k3", tp)
    try:
        first = K.make_inputs(cfg, "cuda", 0, M=1)
        sbytes = 2 * first["state"].nbytes  # read + written
        copies = profile.cold_copies(lambda s, cfg=cfg: K.make_inputs(cfg, "cuda", s, M=1),
                                     bytes_per_copy=K.bytes_moved(first))
    except Exception as e:
        print("INPUTS FAIL tp", tp, repr(e)[:300], flush=True)
        continue
    fla_us = float("nan")
    for name, make in configs:
        try:
            fn = make()
        except Exception as e:
            print("SKIP", tp, name, repr(e)[:200], flush=True)
            continue
        if fn is None or (name.startswith("old") and OLD is None):
            continue
        ok = check(fn, copies[0])
        us = gt(fn, copies)
        if name == "fla":
            fla_us = us
        rec(k="kda3", tp=tp, heads=cfg.kda_heads, variant=name, ok=ok, us=round(us, 2),
            speedup_vs_fla=round(fla_us / us, 2), state_frac=round(sbytes / (us * 1e-6) / bw, 3),
            dur=kdur(fn, copies[1 % len(copies)]))
for name, val in DEFAULTS.items():
    setattr(kda, name, val)
print("copy bandwidth GB/s", round(bw / 1e9), "OUT", os.environ.get("OUT", "/tmp"))
dump("kda.json")
