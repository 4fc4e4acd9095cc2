"""How much memory a notebook needs at a preset and tp, estimated before it runs, against what
the device has free.

The estimate is closed form, from the preset's sizes (:mod:`k3lab.config`) and the shapes
:mod:`k3lab.weights` builds; nothing is allocated. It is meant to be conservative (to err
towards too much), not exact:

- one *input set* of a boundary is the tensors its ``make_inputs`` builds (weights, caches,
  activations); MXFP4 experts count their codes twice (the fused kernels' tiled copy) and
  their scales; building MoE experts adds a transient of 64 experts drawn in fp32;
- ``profile.measure`` holds up to three input sets at once (the inputs, a cold copy, a
  variant's clone); two for the MoE, whose weights its clones share;
- each notebook's phases as it runs them (e.g. 20_moe's comparison at ``expert_format``, its
  per-stage copies beside its launch-list inputs, its tp x format sweep one point at a time),
  the largest phase counting;
- plus a margin of 10 % and a fixed overhead per notebook process (the interpreter, torch,
  plotting; on CUDA its context and the copy-bandwidth buffers).

Free memory: on the CPU the kernel's MemAvailable (and a cgroup's limit when lower); on CUDA
``torch.cuda.mem_get_info`` per GPU, asked in a short subprocess so that this process holds no
CUDA context while the notebooks run. Notebooks this module does not know are not estimated.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from k3lab.config import Preset, preset

__all__ = ["Estimate", "estimate", "available", "check", "moe_set", "GB"]

GB = 1e9
BF16, FP32 = 2, 4
MXFP4_BYTES = 0.5 + 0.5 + 1 / 32  # codes, the fused kernels' tiled copy of them, the scales
MARGIN = 1.10
OVERHEAD = {"cpu": 1.0 * 2**30, "cuda": 3.5 * 2**30}
MEASURE_SETS = 3  # inputs, a cold copy, a clone for one variant's call
MOE_MEASURE_SETS = 2  # the MoE's clones share its weights
L2_CUDA = 2 * 64 << 20  # cold copies: about twice the L2 beyond the first copy


@dataclass(frozen=True)
class Estimate:
    """A notebook's estimated need in bytes and its largest phase (what the bytes are)."""

    notebook: str
    bytes: float
    what: str
    where: str = ""  # "kimi-k3 tp 1"


# ---------------------------------------------------------------- input sets, in bytes

def moe_set(cfg: Preset, fmt: str = "bf16") -> float:
    """One MoE input set: routed experts in ``fmt``, router, latent and shared weights."""
    e, d, i, h = cfg.n_experts, cfg.moe_in, cfg.moe_intermediate, cfg.hidden
    elems = e * (2 * i * d + d * i)
    experts = elems * (BF16 if fmt == "bf16" else MXFP4_BYTES)
    dense = e * h * BF16 + e * FP32
    if cfg.latent:
        dense += 2 * cfg.latent * h * BF16 + cfg.latent * FP32
    dense += 3 * cfg.shared_intermediate * h * BF16
    return experts + dense


def _moe_transient(cfg: Preset) -> float:
    """The fp32 chunk (and its cast) ``moe_weights`` draws 64 experts at a time."""
    d, i = cfg.moe_in, cfg.moe_intermediate
    return min(64, cfg.n_experts) * max(2 * i * d, d * i) * (FP32 + FP32)


def _kda_set(cfg: Preset, m: int = 1) -> float:
    hl, dk, h, r, c = cfg.kda_heads, cfg.kda_head_dim, cfg.hidden, cfg.kda_f_rank, cfg.kda_conv
    if not hl:
        return 0.0
    n = hl * dk
    weights = (5 * n * h + 3 * n * c + r * h + n * r + hl * h) * BF16 + (hl + n + dk) * FP32
    cache = m * hl * dk * dk * FP32 + 3 * m * n * (c - 1) * BF16
    return weights + cache


def _mla_weights(cfg: Preset) -> float:
    hm, h = cfg.mla_heads, cfg.hidden
    return (cfg.q_lora * h + hm * cfg.qk_head * cfg.q_lora + (cfg.kv_lora + cfg.qk_rope) * h
            + hm * (cfg.qk_nope + cfg.v_head) * cfg.kv_lora + 2 * hm * cfg.v_head * h) * BF16


def _mla_cache(cfg: Preset, m: int, context: int) -> float:
    return m * context * (cfg.kv_lora + cfg.qk_rope) * BF16


def _dense_set(cfg: Preset) -> float:
    """The largest projection ``k3lab.boundaries.dense`` builds (its weight and x)."""
    h, n = cfg.hidden, cfg.kda_heads * cfg.kda_head_dim
    rows_k = [cfg.vocab // cfg.tp * h, 2 * cfg.dense_intermediate * h,
              cfg.dense_intermediate * h, 2 * cfg.shared_intermediate * h, cfg.n_experts * h,
              (4 * n + cfg.kda_heads + cfg.kda_f_rank) * h, n * h,
              (cfg.q_lora + cfg.kv_lora + cfg.qk_rope) * h, cfg.mla_heads * cfg.v_head * h * 2]
    if cfg.latent:
        rows_k.append(cfg.latent * h)
    return max(rows_k) * BF16


def _attn_res_set(cfg: Preset, m: int = 1, n_sealed: int | None = None) -> float:
    n = cfg.max_attn_res_candidates if n_sealed is None or n_sealed < 0 else n_sealed + 1
    return (max(n, 1) + 1) * m * cfg.hidden * BF16 * 2 + 3 * cfg.hidden * FP32


def _layer(cfg: Preset, kind: str, fmt: str, context: int, ffn: str = "moe") -> float:
    """One decode layer of ``k3lab.reference.layer.make_layer`` (attention merged: twice)."""
    attn = 2 * (_kda_set(cfg) if kind == "kda" else _mla_weights(cfg) + _mla_cache(cfg, 1,
                                                                                    context))
    ffn_bytes = (moe_set(cfg, fmt) if ffn == "moe"
                 else 3 * cfg.dense_intermediate * cfg.hidden * BF16)
    return attn + ffn_bytes + _attn_res_set(cfg)


# ---------------------------------------------------------------- per notebook

def _int(v, default: int) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _ints(v) -> list[int]:
    if isinstance(v, str):
        return [int(x) for x in re.findall(r"\d+", v)]
    try:
        return [int(x) for x in v or []]
    except (TypeError, ValueError):
        return []


def _valid(name: str, tp: int, fmt: str = "bf16") -> Preset | None:
    try:
        c = preset(name, tp)
    except ValueError:
        return None
    if fmt == "mxfp4" and (c.moe_in % 32 or c.moe_intermediate % 32):
        return None
    return c


def _phases(short: str, cfg: Preset, cuda: bool, p: dict) -> list[tuple[str, float]]:
    """(what, bytes) of each phase of notebook ``short`` (its name without the number)."""
    m = max(1, _int(p.get("M"), 1))
    if short == "overview":
        fmt, ctx = p.get("expert_format", "bf16"), _int(p.get("mla_context"), 256)
        kind = "kda" if cfg.kda_heads else "mla"
        out = [("the MoE reference's measure", MOE_MEASURE_SETS * moe_set(cfg, fmt)
                + _moe_transient(cfg)),
               ("the dense reference's measure", MEASURE_SETS * _dense_set(cfg)),
               (f"one reference {kind.upper()} layer", _layer(cfg, kind, fmt, ctx)
                + _moe_transient(cfg))]
        if cfg.kda_heads:
            out.append(("the KDA reference's measure", MEASURE_SETS * _kda_set(cfg)))
        return out
    if short == "route":
        sets = (cfg.n_experts * cfg.hidden * BF16 + 64 * cfg.hidden * BF16)
        return [("the route boundary's measure", MEASURE_SETS * sets)]
    if short == "moe":
        fmt = p.get("expert_format", "mxfp4")
        tps = _ints(p.get("sweep_tp")) or ([1, 8] if cfg.name == "kimi-k3" else [1, 3, 8])
        formats = [f for f in (p.get("sweep_formats") or ["bf16", "mxfp4"])
                   if f in ("bf16", "mxfp4")]
        out = [(f"the comparison ({fmt} experts, tp {cfg.tp})",
                MOE_MEASURE_SETS * moe_set(cfg, fmt) + _moe_transient(cfg)),
               (f"the correctness cases (bf16 experts, tp {cfg.tp})",
                moe_set(cfg, "bf16") + _moe_transient(cfg))]
        for tp in tps:
            for f in formats:
                c = _valid(cfg.name, tp, f)
                if c is not None:
                    out.append((f"the tp x format sweep at tp {tp}, {f}",
                                moe_set(c, f) + _moe_transient(c)))
        return out
    if short == "dense":
        tps = _ints(p.get("tps")) or [cfg.tp]
        out = []
        for tp in tps:
            c = _valid(cfg.name, tp)
            if c is not None:
                out.append((f"the largest projection at tp {tp}", MEASURE_SETS * _dense_set(c)))
        return out
    if short == "kda":
        tps = _ints(p.get("tps")) or [1, 2, 4, 8]
        c = min((x for tp in tps if (x := _valid(cfg.name, tp)) is not None),
                key=lambda x: x.tp, default=cfg)
        steps = _int(p.get("steps"), 64) or 64  # 0: the notebook's device default, at most 64
        tokens = steps * 10 * m * c.kda_heads * c.kda_head_dim * BF16
        return [(f"the KDA measure at tp {c.tp}", MEASURE_SETS * _kda_set(c, m) + tokens)]
    if short == "mla":
        contexts = _ints(p.get("contexts")) or ([1 << k for k in range(10, 18)] if cuda
                                                else [64, 256, 1024])
        top = max([*contexts, _int(p.get("context"), 0) or (32768 if cuda else 512),
                   *_ints(p.get("graph_lengths"))])
        return [(f"the MLA cache at context {top}", MEASURE_SETS * _mla_cache(cfg, m, top)
                 + _mla_weights(cfg))]
    if short == "attn_res":
        n = _int(p.get("n_sealed"), -1)
        return [("the AttnRes read", MEASURE_SETS * _attn_res_set(cfg, m, n))]
    if short == "decode_step":
        fmt = p.get("expert_format", "mxfp4")
        window = _int(p.get("window"), 3) or cfg.attn_res_block
        ctx = max([_int(p.get("context"), 64), *_ints(p.get("context_sweep"))])
        head = 2 * (cfg.vocab // cfg.tp) * cfg.hidden * BF16
        mla = set(cfg.mla_layers)
        layers = _layer(cfg, "mla" if 0 in mla or not cfg.kda_heads else "kda", fmt, ctx,
                        ffn="mlp")
        for i in range(1, window + 1):
            kind = "mla" if i in mla or not cfg.kda_heads else "kda"
            layers += _layer(cfg, kind, fmt, ctx)
        # the stacks measured lay the dense weights out their own way (merged, concatenated):
        # all but the routed experts (their tiled copy is in moe_set already) counted twice
        experts = window * (moe_set(cfg, fmt) - moe_set(dataclasses.replace(cfg, n_experts=0),
                                                        fmt))
        token = head + layers
        return [(f"the decode token (embedding, {window + 1} layers, head; {fmt} experts)",
                 2 * token - experts + _moe_transient(cfg))]
    return []


def estimate(notebook: str, cfg: Preset, device: str, params: dict | None = None
             ) -> Estimate | None:
    """The memory notebook ``notebook`` (e.g. "20_moe") needs at ``cfg`` on ``device`` with
    its ``params`` (defaults included), or None for a notebook this module does not know."""
    short = re.sub(r"^\d+_", "", notebook)
    cuda = str(device).startswith("cuda")
    phases = _phases(short, cfg, cuda, dict(params or {}))
    if not phases:
        return None
    what, peak = max(phases, key=lambda x: x[1])
    total = MARGIN * peak + (L2_CUDA if cuda else 0) + OVERHEAD["cuda" if cuda else "cpu"]
    return Estimate(notebook, total, what, f"{cfg.name} tp {cfg.tp}")


# ---------------------------------------------------------------- what the device has

def _meminfo_available() -> float | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    return float(m.group(1)) * 1024 if m else None


def _cgroup_room() -> float | None:
    """The room left under a cgroup v2 memory limit, None without one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return None
    if limit == "max":
        return None
    try:
        return float(int(limit) - int(used))
    except ValueError:
        return None


def _cpu_available() -> float | None:
    found = [x for x in (_meminfo_available(), _cgroup_room()) if x is not None]
    if not found:
        try:
            found = [float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))]
        except (ValueError, OSError, AttributeError):
            return None
    return min(found)


def _cuda_free() -> list[float]:
    """Free bytes of each visible GPU, asked in a subprocess ([] when it cannot tell)."""
    code = ("import torch\n"
            "for i in range(torch.cuda.device_count()):\n"
            "    print(torch.cuda.mem_get_info(i)[0])\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode:
        return []
    return [float(x) for x in out.stdout.split()]


def available(device: str) -> tuple[list[float], str]:
    """(free bytes per slot: the CPU once, else each GPU; where they were read)."""
    if str(device).startswith("cuda"):
        return _cuda_free(), "GPU memory free (torch.cuda.mem_get_info)"
    free = _cpu_available()
    return ([] if free is None else [free]), "RAM available"


def check(estimates: list[Estimate], device: str, jobs: int = 1,
          free: tuple[list[float], str] | None = None) -> str | None:
    """None when the notebooks fit, else one line saying which does not (needed vs available).

    CPU: notebooks running at once (``jobs``) share the RAM: the ``jobs`` largest needs add
    up. CUDA: each notebook has a GPU to itself: each need against the least free GPU of
    those the batch uses. ``free``: what :func:`available` would say (for tests).
    """
    estimates = [e for e in estimates if e is not None]
    if not estimates:
        return None
    slots, where = free if free is not None else available(device)
    if not slots:
        return None  # cannot tell: let it run
    cuda = str(device).startswith("cuda")
    worst = max(estimates, key=lambda e: e.bytes)
    more = ""
    if cuda:
        room = min(slots[:max(1, jobs)])
        bad = [e for e in estimates if e.bytes > room]
        if not bad:
            return None
        worst = max(bad, key=lambda e: e.bytes)
        need, who = worst.bytes, f"{worst.notebook} at {worst.where}"
        if len(bad) > 1:
            more = f" ({len(bad) - 1} more notebook(s) do not fit either)"
    else:
        room = slots[0]
        at_once = sorted(estimates, key=lambda e: e.bytes, reverse=True)[:max(1, jobs)]
        need = sum(e.bytes for e in at_once)
        if need <= room:
            return None
        who = (f"{worst.notebook} at {worst.where}" if len(at_once) == 1 else
               f"{', '.join(e.notebook for e in at_once)} at {worst.where}, run at once "
               f"(--jobs {jobs}),")
    return (f"memory: {who} needs about {_gb(need)} (estimated; largest: {worst.notebook}, "
            f"{worst.what}), {_gb(room)} {where}{more}; use a smaller preset or a larger --tp, "
            "or --force to run anyway")


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{math.ceil(n / 2**20)} MB"
