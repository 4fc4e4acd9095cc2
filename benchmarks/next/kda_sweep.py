"""H200, issue 5: the fused KDA decode (main's kernel) against the session-3 loads-first kernel
(``kda_loadsfirst.py``, 4dccc69, its best row "unpacked bv32": 4.43 us vs 4.82 at tp 8) and fla-core
+ projection, K3, M = 1, cold copies, graph replay; every row checked against the reference.

Variants of the loads-first kernel with bf16 f_b chunks (PACK_FB = False), what each tests:
- lf bv32: the session-3 best, again (same process as main's kernel and fla);
- lf bv32 4w: 4 warps (fewer threads per reduction, more programs an SM);
- lf bv16: twice the programs (f_b re-read from L2 8x a head);
- lf bv32 br128: the f_b GEMV as one [128, 128] chunk (one load round, one reduction);
- lf bv32 sync2: a barrier after f_b's loads too;
- lf bv64 (tp 1): fewer, wider programs.
Run from the repo root: python3 benchmarks/next/kda_sweep.py (writes $OUT/kda_next.json).
"""

import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks/h200_tuning")
import torch  # noqa: E402
from common import bw, dump, gt, kdur, rec  # noqa: E402

import k3lab.kernels.kda as kda  # noqa: E402
from k3lab import profile  # noqa: E402
from k3lab.boundaries import clone_inputs, get  # noqa: E402
from k3lab.config import preset  # noqa: E402

T0 = time.time()
K = get("kda")
FLA = next(v for v in K.variants if v.name == "fla-core")
REF = next(v for v in K.variants if v.name == "reference")
_spec = importlib.util.spec_from_file_location(
    "kda_loadsfirst", Path(__file__).with_name("kda_loadsfirst.py"))
LF = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = LF
_spec.loader.exec_module(LF)
LF_DEFAULTS = dict(PACK_FB=False, SYNC_LOADS=1, MAX_WARPS=8, TILE_PER_WARP=512, BLOCK_R=64)


def fused(mod, block_v=None, **consts):
    def fn(i):
        if mod is LF:
            for name, val in {**LF_DEFAULTS, **consts}.items():
                setattr(LF, name, val)
        o = mod.kda_decode(i["q"], i["k"], i["v"], i["f_low"], i["f_b"], i["A_log"],
                           i["dt_bias"], i["b_logits"], i["state"], lower_bound=i["lower_bound"],
                           scale=i["scale"], block_v=block_v)
        return {"o": o, "state": i["state"]}
    return fn


def check(fn, inputs):
    try:
        ref = REF.fn(clone_inputs(inputs))
        out = fn(clone_inputs(inputs))
        torch.cuda.synchronize()
        K.check(out, ref, inputs)
        return "pass"
    except Exception as e:  # noqa: BLE001
        return f"FAIL {repr(e)[:200]}"


CONFIGS = {
    8: [("fla", lambda: FLA.fn), ("main", lambda: fused(kda)),
        ("lf bv32", lambda: fused(LF, 32)), ("lf bv32 4w", lambda: fused(LF, 32, MAX_WARPS=4)),
        ("lf bv16", lambda: fused(LF, 16)), ("lf bv32 br128", lambda: fused(LF, 32, BLOCK_R=128)),
        ("lf bv32 sync2", lambda: fused(LF, 32, SYNC_LOADS=2)),
        ("main br128", lambda: fused(kda)), ],
    1: [("fla", lambda: FLA.fn), ("main", lambda: fused(kda)),
        ("lf bv32", lambda: fused(LF, 32)), ("lf bv64", lambda: fused(LF, 64)),
        ("lf bv16", lambda: fused(LF, 16)), ("lf bv32 4w", lambda: fused(LF, 32, MAX_WARPS=4))],
}

for tp, configs in CONFIGS.items():
    cfg = preset("kimi-k3", tp)
    first = K.make_inputs(cfg, "cuda", 0, M=1)
    sbytes = 2 * first["state"].nbytes  # read + written
    copies = profile.cold_copies(lambda s, cfg=cfg: K.make_inputs(cfg, "cuda", s, M=1),
                                 bytes_per_copy=K.bytes_moved(first))
    fla_us = float("nan")
    for name, make in configs:
        try:
            kda.BLOCK_R = 128 if name == "main br128" else 64
            fn = make()
            ok = check(fn, copies[0])
            us = gt(fn, copies)
            if name == "fla":
                fla_us = us
            rec(k="kda_next", tp=tp, variant=name, ok=ok, us=round(us, 2),
                speedup_vs_fla=round(fla_us / us, 2),
                state_frac=round(sbytes / (us * 1e-6) / bw, 3),
                dur=kdur(fn, copies[1 % len(copies)]), t=round(time.time() - T0, 1))
        except Exception as e:  # noqa: BLE001
            rec(k="kda_next", tp=tp, variant=name, err=repr(e)[:300])
kda.BLOCK_R = 64
print("copy bandwidth GB/s", round(bw / 1e9), flush=True)
dump("kda_next.json")
