"""H200, issue 4 (session 11, call 2): the MXFP4 stages with their weight tiles staged through
shared memory by Triton's pipeliner (cp.async, STAGES - 1 K iterations ahead; x loaded by inline
PTX so that only the weights take the stages), against HEAD's register loads (STAGES 0), with
and without the tile's L2 prefetch.

Offline sm_90 (Triton 3.6): STAGES 2 / 3 / 4 take 16 / 32 / 48 KB of shared memory a program and
113-124 registers (4 programs an SM) against HEAD's 128 registers and no stages.

The parent runs one child process per (STAGES, prefetch) (kernels/moe.py read K3_ST at import at
the experiment commit fb8880a only; checked out anywhere else, every child runs HEAD's kernels);
each child times K3 B1 (tp 1: 48 experts, 3 cold copies of 16; tp 8: 4 copies), prepared
activations, graph replay back to back, median of 10, PDL off and PDL_STEPS 0, REPS times,
checked against the fp32 reference at the tests' tolerances.

    python3 benchmarks/session11/moe_smem.py        # writes $OUT/moe_smem_*.json
"""

import os
import subprocess
import sys
import time

CONFIGS = os.environ.get("CONFIGS", "0,1 3,0 3,1 2,0 4,0 4,1").split()

if os.environ.get("K3_ST") is None:
    t0 = time.time()
    for rep in range(int(os.environ.get("ROUNDS", "1"))):
        for cfg in CONFIGS:
            st, pf = cfg.split(",")
            env = dict(os.environ, K3_ST=st, PF=pf, ROUND=str(rep))
            subprocess.run([sys.executable, __file__], env=env, check=False)
    print("all done", round(time.time() - t0, 1), flush=True)
    sys.exit(0)

import torch  # noqa: E402

sys.path.insert(0, "benchmarks/h200_tuning")
sys.path.insert(0, "benchmarks/session11")
from common import dump  # noqa: E402
from moe_stages import stage_setup  # noqa: E402
from moe_tiles import row  # noqa: E402

from k3lab.kernels import moe  # noqa: E402

ST, PF = int(os.environ["K3_ST"]), int(os.environ["PF"])
REPS = int(os.environ.get("REPS", "2"))
for tp in [int(t) for t in os.environ.get("TPS", "1 8").split()]:
    moe.FP4_MMA_TILES = {1: (2, 2 if tp == 1 else 4, PF), 2: (2, 2, PF)}
    copies, wants = stage_setup(tp, 3 if tp == 1 else 4)
    for rep in range(REPS):
        for steps in (None, 0):
            moe.PDL_STEPS = steps
            for stage in ("stage1", "stage2"):
                row(copies, wants, stage, tp=tp, stages=ST, prefetch=PF, pdl=steps, rep=rep,
                    round=int(os.environ.get("ROUND", "0")))
    del copies, wants
    torch.cuda.empty_cache()
dump(f"moe_smem_{ST}_{PF}_{os.environ.get('ROUND', '0')}.json")
