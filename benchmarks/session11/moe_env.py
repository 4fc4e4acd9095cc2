"""H200, issue 4 (session 11, calls 4-5): the MXFP4 stages under build switches, one child
process per configuration in CONFIGS (space-separated; a configuration is comma-separated
VAR=value, or "head"). The switches K3_CM (the weight loads' cache modifier), K3_EV (their
eviction policy) and K3_XEV (the x loads') were read at import by kernels/mxfp4_mma.py at the
experiment commits eb4bcea / 8f2e1b4 only; K3_EV=evict_first became FP4_MMA_EVICT_FIRST (stage
2) afterwards, so at later commits only "head" and K3_TILE2 (stage 2's tile as
R/WARPS_K/prefetch) mean anything. Each child: K3 B1 tp 1 (48 experts, 3 cold copies of 16),
prepared activations, graph replay back to back, median of 10, PDL off and PDL_STEPS 0, REPS
times, checked against the fp32 reference at the tests' tolerances.

    CONFIGS="head K3_TILE2=2/2/0" python3 benchmarks/session11/moe_env.py   # $OUT/moe_env.json
"""

import json
import os
import subprocess
import sys
import time

if os.environ.get("MOE_ENV_CHILD") is None:
    t0 = time.time()
    rows = []
    for rnd in range(int(os.environ.get("ROUNDS", "1"))):
        for cfg in os.environ.get("CONFIGS", "head").split():
            env = dict(os.environ, MOE_ENV_CHILD=cfg, OUT=os.environ.get("OUT", "/tmp"))
            if cfg != "head":
                env.update(kv.split("=", 1) for kv in cfg.split(","))
            subprocess.run([sys.executable, __file__], env=env, check=False)
            path = f"{env['OUT']}/moe_env_child.json"
            if os.path.exists(path):
                with open(path) as fh:
                    rows += [dict(r, round=rnd) for r in json.load(fh)]
                os.remove(path)
    with open(f"{os.environ.get('OUT', '/tmp')}/moe_env.json", "w") as fh:
        json.dump(rows, fh)
    print("all done", round(time.time() - t0, 1), flush=True)
    sys.exit(0)

sys.path.insert(0, "benchmarks/h200_tuning")
sys.path.insert(0, "benchmarks/session11")
from common import dump  # noqa: E402
from moe_stages import stage_setup  # noqa: E402
from moe_tiles import row  # noqa: E402

from k3lab.kernels import moe  # noqa: E402

if os.environ.get("K3_TILE2"):  # stage 2's tile (R,WARPS_K,prefetch), stage 1 the default's
    moe.FP4_MMA_TILES = {1: (2, 2, 1), 2: tuple(int(v) for v in os.environ["K3_TILE2"].split("/"))}
copies, wants = stage_setup(1, 3)
for rep in range(int(os.environ.get("REPS", "2"))):
    for steps in (None, 0):
        moe.PDL_STEPS = steps
        for stage in ("stage1", "stage2"):
            row(copies, wants, stage, tp=1, config=os.environ["MOE_ENV_CHILD"], pdl=steps, rep=rep)
dump("moe_env_child.json")
