"""H200 sweep 3: KDA ablation. Which part of the fused decode kernel costs the time?

Builds a variant of ``kernels/kda.py`` at run time (no copy of the kernel is kept) with three
constexpr switches: NO_GEMV skips the f_b projection (gate from dt_bias alone), NO_STATE uses a
constant state instead of loading it, NO_STORE skips the state store; then times every
combination at K3 tp 8 and tp 1, cold and hot. The recorded results
(``results/call3_kda_ablation.json``) ran on ba05db3's kernel (4 warps for 32-wide tiles; the
kernel now uses 8, see TILE_PER_WARP).
"""

import importlib.util
import itertools
import sys
import tempfile
from pathlib import Path

from common import dump, gt, rec

from k3lab import profile
from k3lab.boundaries import get
from k3lab.config import preset

PATCHES = (  # (original text of kernels/kda.py, ablation text)
    (
        "    FUSE_CONV: tl.constexpr, FUSE_OUT_GATE: tl.constexpr,\n):",
        "    FUSE_CONV: tl.constexpr, FUSE_OUT_GATE: tl.constexpr,\n"
        "    NO_GEMV: tl.constexpr = False, NO_STATE: tl.constexpr = False,\n"
        "    NO_STORE: tl.constexpr = False,\n):",
    ),
    (
        "    b_s = tl.load(p_s)\n",
        "    if NO_STATE:\n        b_s = tl.zeros([D, BV], tl.float32) + 0.5\n"
        "    else:\n        b_s = tl.load(p_s)\n",
    ),
    (
        "    for r0 in tl.static_range(0, R, BR):",
        "    for r0 in tl.static_range(0, 0 if NO_GEMV else R, BR):",
    ),
    ("    tl.store(p_s, b_s)\n", "    if not NO_STORE:\n        tl.store(p_s, b_s)\n"),
    (
        "               block_v: int | None = None) -> torch.Tensor:",
        "               block_v: int | None = None, **ablate) -> torch.Tensor:",
    ),
    (
        "        num_warps=num_warps,\n    )\n    return o",
        "        num_warps=num_warps, **ablate,\n    )\n    return o",
    ),
)


def ablated_kda():
    src = (Path(__file__).resolve().parents[2] / "kernels" / "kda.py").read_text()
    for old, new in PATCHES:
        if old not in src:
            sys.exit(f"kernels/kda.py changed: cannot apply the ablation patch for {old!r}")
        src = src.replace(old, new)
    # Triton's jit needs the kernel's source in a real file
    path = Path(tempfile.mkdtemp()) / "kda_ablated.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("kda_ablated", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.kda_decode


kda_decode = ablated_kda()
K = get("kda")
for tp in (8, 1):
    cfg = preset("kimi-k3", tp)
    sbytes = 2 * cfg.kda_heads * 128 * 128 * 4
    copies = profile.cold_copies(
        lambda s, cfg=cfg: K.make_inputs(cfg, "cuda", s, M=1), bytes_per_copy=sbytes
    )
    for bv, ng, ns, nst, cold in itertools.product((32, 64), (0, 1), (0, 1), (0, 1), (1, 0)):
        flags = dict(NO_GEMV=bool(ng), NO_STATE=bool(ns), NO_STORE=bool(nst))
        fn = lambda i, b=bv, flags=flags: kda_decode(
            i["q"],
            i["k"],
            i["v"],
            i["f_low"],
            i["f_b"],
            i["A_log"],
            i["dt_bias"],
            i["b_logits"],
            i["state"],
            lower_bound=-5.0,
            block_v=b,
            **flags,
        )
        us = gt(fn, copies if cold else copies[:1])
        rec(
            k="kdadiag",
            tp=tp,
            bv=bv,
            no_gemv=ng,
            no_state=ns,
            no_store=nst,
            cold=cold,
            us=round(us, 2),
        )
dump("kdadiag.json")
