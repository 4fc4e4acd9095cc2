"""The single-owner persistent MoE: the whole latent MoE block after routing in ONE launch.

``moe_persistent(x, weights, cfg=..., plan=...)`` consumes route_sort's plan as is and runs the
latent down-projection, the shared experts, stage 1 (gate/up + activation), stage 2 (down +
weighted combine, fp32 atomics or a deterministic slot-order reduce) and the tail (latent
RMSNorm + up-projection + shared down + add) as work items of one grid of about ``num_sms x
config.programs_per_sm`` programs (kernels/moe/persistent_kernel.py). Without a plan it routes
first: route_sort's launch plus this one, 2 launches for the block with routing; with
``config.route_items`` route_sort's programs are the launch's first work items: 1 launch.

Formats: experts bf16 or MXFP4 (row layout; also the tiled one with ``multiply="klane"``, the
MoE stages' K-lane GEMVs); activations bf16 (W4A16) or, with
``config.activations = "fp8"`` (A8W4), each stage's input rows (z per token, a per routed row)
quantized in the kernel to e4m3 with a power-of-two per-row scale from the row's amax
(``persistent_gemv.pow2_scales``; with ``multiply="klane"``, MXFP4 experts only, as the
K-lane GEMVs load them); ``config.tail_fp8``: the latent up-projection in e4m3 with
per-channel fp32 scales (:func:`persistent_kernel_weights` makes them once).

What is guaranteed on the GPU:
- no host sync and no host logic that depends on data: the grid, the item counts and every
  tile size follow from the shapes, so one CUDA graph serves every plan of the same shapes;
- no deadlock under any scheduling: a program takes a ticket (atomic counter) only when it
  runs, and an item waits only for items of lower tickets, which running programs hold; a wait
  gives up after stages.MAX_SPIN polls (a wrong result instead of a hang, should that break);
- visibility: producers count an item done with a release increment after a CTA barrier,
  consumers acquire the count (a GPU-scope RMW) then pass a CTA barrier before reading what
  the producers wrote; the fma / dot GEMVs read it through L2 (``.cg``) besides, the K-lane
  GEMVs of ``multiply="klane"`` with plain loads (ordered by the acquire);
- every call and graph replay starts from zeroed counters: the last program to exit zeroes
  them. The counters live in one int32 buffer per device, shared by every call: calls on one
  device must not run concurrently on different streams, and the first call on a device (or
  one needing more plan-tile counters than any before) must not be inside a graph capture;
- ``deterministic=True``: the output is bit-identical from run to run; atomic: stage 2's fp32
  sums follow the order of the atomics.
Under the interpreter programs run one after the other; the ticket order makes that a valid
schedule (program 0 takes every ticket, in order, and every wait is already satisfied).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from ..mxfp4 import MXFP4, mxfp4_layout, mxfp4_tiled_ok
from ..plan import RoutePlan
from ..route import route_sort
from ..route.launch import prepare_route
from ..runtime import INTERPRETED, zeroed_words
from .block import _EARLY_ROUTE, _check_block_weights
from .checks import check_activation, check_plan, check_tensor, check_tokens
from .front_route import FRONT_ROUTE_CONFIG
from .persistent_config import PersistentMoEConfig
from .persistent_kernel import SYNC_HEADER, moe_persistent_kernel

__all__ = ["moe_persistent", "persistent_kernel_weights", "fp8_rows_quantize", "FP8Rows",
           "PersistentMoEConfig", "PersistentTrace"]

E4M3_MAX = 448.0
DOT_MIN_ROWS = 16  # tl.dot tiles: at least 16 rows a side
FP8_DOT_BLOCK_K = 32  # e4m3 x e4m3 dots: one MXFP4 group a step
MIN_BLOCK_K = 32  # an MXFP4 group
MIN_SYNC_WORDS = 4096
_SYNC: dict[torch.device, torch.Tensor] = {}
_DEFAULT = PersistentMoEConfig()


@dataclass
class FP8Rows:
    """A weight [N, K] as e4m3 values (torch.float8_e4m3fn) times one fp32 scale per row:
    w ~ values * scales[:, None]."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales[:, None]


def fp8_rows_quantize(w: torch.Tensor) -> FP8Rows:
    """Per-row (output channel) e4m3 quantization of w [N, K]: scale = amax / 448 (1 for an
    all-zero row), values = e4m3(w / scale) to nearest even."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"w: expected a 2-D tensor, got {getattr(w, 'shape', type(w))}")
    amax = w.float().abs().amax(1)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    values = (w.float() / scales[:, None]).to(torch.float8_e4m3fn)
    return FP8Rows(values.contiguous(), scales.contiguous())


def _check_config(config) -> PersistentMoEConfig:
    if config is None:
        return _DEFAULT
    if not isinstance(config, PersistentMoEConfig):
        raise ValueError(f"config: expected a PersistentMoEConfig or None, got "
                         f"{type(config).__name__}")
    return config


def persistent_kernel_weights(weights: dict, config: PersistentMoEConfig | None = None) -> dict:
    """``weights`` (k3lab.weights.moe_weights' dict) as moe_persistent reads them: MXFP4
    experts in the row layout (the tiled one, where the shapes allow, for multiply='klane',
    whose GEMVs read it fastest) and, with ``config.tail_fp8`` and a latent, ``latent_up_fp8``
    (:func:`fp8_rows_quantize` of latent_up). Made once, as an engine lays out its checkpoint."""
    config = _check_config(config)
    out = dict(weights)
    for name in ("w13", "w2"):
        w = out.get(name)
        if isinstance(w, MXFP4):
            tiled = config.multiply == "klane" and mxfp4_tiled_ok(w.shape)
            out[name] = mxfp4_layout(w, "tiled" if tiled else "rows")
    if config.tail_fp8 and "latent_up" in out and "latent_up_fp8" not in out:
        out["latent_up_fp8"] = fp8_rows_quantize(out["latent_up"])
    return out


def _sync_words(dev: torch.device, n: int) -> torch.Tensor:
    """The device's zeroed int32 sync words (at least n), made outside a graph capture."""
    return zeroed_words(_SYNC, dev, n, minimum=MIN_SYNC_WORDS, error=(
        f"plan: moe_persistent needs {n} sync words on {dev}, which do not exist yet and cannot "
        "be made inside a CUDA-graph capture; call it once with these shapes before capturing"))


def _check_formats(weights: dict, cfg, config: PersistentMoEConfig, dev) -> tuple:
    """The experts' format and the tail's up weight (bf16 tensor or FP8Rows)."""
    fp4 = isinstance(weights["w13"], MXFP4)
    if fp4 != isinstance(weights["w2"], MXFP4):
        raise ValueError("w2: w13 and w2 must both be bf16 or both MXFP4")
    if config.multiply == "klane" and config.fp8 and not fp4:
        raise ValueError("w13: multiply='klane' quantizes activations to e4m3 only against "
                         "MXFP4 experts, got bf16 ones (use multiply='fma' or 'dot')")
    for name in ("w13", "w2"):
        w = weights[name]
        if isinstance(w, MXFP4) and w.layout != "rows" and config.multiply != "klane":
            raise ValueError(f"{name}: moe_persistent reads MXFP4 in the row layout (the "
                             f"tiled one with multiply='klane'), got {w.layout!r} "
                             "(persistent_kernel_weights converts)")
    up = weights.get("latent_up") if cfg.latent else None
    if cfg.latent and config.tail_fp8:
        up = weights.get("latent_up_fp8")
        if not isinstance(up, FP8Rows):
            raise ValueError("weights: config.tail_fp8 needs weights['latent_up_fp8'], an "
                             "FP8Rows (persistent_kernel_weights makes it)")
        check_tensor("latent_up_fp8.values", up.values, dtypes=(torch.float8_e4m3fn,), dim=2,
                     device=dev)
        check_tensor("latent_up_fp8.scales", up.scales, dtypes=(torch.float32,), dim=1,
                     device=dev)
        if up.shape != (cfg.hidden, cfg.latent) or up.scales.shape[0] != cfg.hidden:
            raise ValueError(f"latent_up_fp8: expected values [{cfg.hidden}, {cfg.latent}] and "
                             f"scales [{cfg.hidden}], got {list(up.values.shape)}, "
                             f"{list(up.scales.shape)}")
    return fp4, up


def _fit_k(block_k: int, rows: int, cols: int, budget: int) -> int:
    """The K step halved (down to MIN_BLOCK_K) until rows x cols x K products fit the budget."""
    while block_k > MIN_BLOCK_K and rows * cols * block_k > budget:
        block_k //= 2
    return block_k


def _tiles(config, m, block_m, sizes, fp4):
    """Block constexprs from the config and the shapes (fma GEMVs: config.max_products)."""
    h, d, i, s = sizes
    dot = config.multiply == "dot"
    p2 = triton.next_power_of_2
    t = dict(BLOCK_MT=p2(m), BLOCK_ME=max(DOT_MIN_ROWS if dot else 1, p2(block_m)),
             BLOCK_NF=min(config.front_block_n, p2(max(d, s, 1))),
             BLOCK_NE=min(config.expert_block_n, p2(max(d, i))) if not dot
             else max(DOT_MIN_ROWS, min(config.expert_block_n, p2(max(d, i)))),
             BLOCK_NT=min(config.tail_block_n, p2(h)))
    n2 = config.stage2_block_n or config.expert_block_n
    t["BLOCK_N2"] = (min(n2, p2(max(d, i))) if not dot
                     else max(DOT_MIN_ROWS, min(n2, p2(max(d, i)))))
    # the front and the tail broadcast-multiply; the experts too unless on the tensor cores
    t["BLOCK_KF"] = _fit_k(min(config.block_k, p2(max(h, d, s, 1))), t["BLOCK_MT"],
                           max(t["BLOCK_NF"], t["BLOCK_NT"]), config.max_products)
    block_ke = min(config.expert_block_k or config.block_k, p2(max(d, i)))
    if dot and config.fp8 and fp4:
        block_ke = FP8_DOT_BLOCK_K
    elif not dot:
        block_ke = _fit_k(block_ke, t["BLOCK_ME"], max(t["BLOCK_NE"], t["BLOCK_N2"]),
                          config.max_products)
    t["BLOCK_KE"] = block_ke
    return t


@dataclass(frozen=True)
class PersistentTrace:
    """Where each work item of one ``moe_persistent(..., trace=True)`` call ran: ``items``
    int64 [n_items, 4] (start ns, end ns on the GPU's global clock, SM, program), in ticket
    order; ``phases`` the first ticket of each phase ("route": route items, if any; "front",
    "stage1", "stage2", "reduce", "tail") and ``n_items``."""

    items: torch.Tensor
    phases: dict
    n_items: int


def moe_persistent(x: torch.Tensor, weights: dict, *, cfg, plan: RoutePlan | None = None,
                   block_m: int = 1, num_sms: int | None = None,
                   config: PersistentMoEConfig | None = None, trace: bool = False):
    """The latent MoE block (docs/model.md) in one launch given ``plan``
    (route_sort's; without one, route_sort runs first with ``block_m``: 2 launches, or with
    ``config.route_items`` as the launch's first items: 1 launch).

    x: bf16 [M, H], M <= 16. weights: k3lab.weights.moe_weights' dict (latent_down [D, H],
    latent_norm [D], latent_up [H, D] when cfg.latent; w13 [E, 2I, D], w2 [E, D, I] bf16 or
    MXFP4 in the row layout; shared_w13 [2S, H], shared_w2 [H, S] when cfg has shared experts;
    latent_up_fp8 with config.tail_fp8: see :func:`persistent_kernel_weights`). cfg: a k3lab
    Preset. num_sms: the machine's SM count (None: the device's; the interpreter: 1); the grid
    is num_sms x config.programs_per_sm programs, at most the number of work items. Returns
    bf16 [M, H]. The plan's ``out`` buffer is not used (the kernel has its own accumulator).
    trace: also return a :class:`PersistentTrace` (each item's start and end on the GPU clock;
    compiled only, a few stores an item).
    """
    config = _check_config(config)
    if not isinstance(trace, bool):
        raise ValueError(f"trace: expected a bool, got {trace!r}")
    if trace and INTERPRETED:
        raise ValueError("trace: needs the compiled kernel (the GPU clock); the Triton "
                         "interpreter has no inline asm")
    check_tensor("x", x, dtypes=(torch.bfloat16,), dim=2)
    m, h = x.shape
    check_tokens("x", m)
    act = check_activation(cfg.activation)
    w13, w2, (e, d, i) = _check_block_weights(x, weights, cfg, plan)
    fp4, up = _check_formats(weights, cfg, config, x.device)
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int)
                                or num_sms < 1):
        raise ValueError(f"num_sms: expected a positive int or None, got {num_sms!r}")
    route = None
    if plan is None and config.route_items:
        rc = config.route_config if config.route_config is not None else FRONT_ROUTE_CONFIG
        route, plan = prepare_route(
            x, weights["gate_weight"], weights["correction_bias"], top_k=cfg.top_k,
            n_group=cfg.n_group, topk_group=cfg.topk_group, renormalize=cfg.renormalize,
            routed_scaling_factor=cfg.routed_scaling, block_m=block_m,
            config=dataclasses.replace(rc, pdl=False, early_dependents=False))
        if route.select is not None:  # the selection is a launch of its own: route apart
            route = plan = None
    overlap = plan is None and config.overlap_route and not INTERPRETED
    if plan is None:
        plan = route_sort(x, weights["gate_weight"], weights["correction_bias"], top_k=cfg.top_k,
                          n_group=cfg.n_group, topk_group=cfg.topk_group,
                          renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling,
                          block_m=block_m, config=_EARLY_ROUTE if overlap else None)
    top_k, block_m, n_tiles = check_plan(plan, m, e, x.device)
    s = cfg.shared_intermediate
    dev = x.device
    t = _tiles(config, m, block_m, (h, d, i, s), fp4)
    cdiv = triton.cdiv
    n_z, n_sh = cdiv(d, t["BLOCK_NF"]), cdiv(s, t["BLOCK_NF"]) if s else 0
    n_i, n_d = cdiv(i, t["BLOCK_NE"]), cdiv(d, t["BLOCK_N2"])
    n_dr = n_d if config.deterministic else 0
    n_t = cdiv(h, t["BLOCK_NT"])
    n_route = route.grid[0] * route.grid[1] if route is not None else 0
    n_items = n_route + n_z + n_sh + n_tiles * (n_i + n_d) + n_dr + n_t
    if num_sms is None:
        num_sms = 1 if dev.type != "cuda" else \
            torch.cuda.get_device_properties(dev).multi_processor_count
    grid = (max(1, min(n_items, num_sms * config.programs_per_sm)),)
    sync = _sync_words(dev, SYNC_HEADER + n_tiles)
    # untraced, the kernel never touches p_trace: pass a buffer that exists (no allocation)
    items = torch.zeros((n_items, 4), device=dev, dtype=torch.int64) if trace else sync
    bf16, f32 = torch.bfloat16, torch.float32
    z = torch.empty((m, d), device=dev, dtype=bf16)
    a = torch.empty((m * top_k, i), device=dev, dtype=bf16)
    a_s = torch.empty((m, max(s, 1)), device=dev, dtype=bf16)
    y = torch.empty((m, d), device=dev, dtype=f32)
    part = torch.empty((m * top_k, d) if config.deterministic else (1, 1), device=dev, dtype=f32)
    out = torch.empty((m, h), device=dev, dtype=bf16)
    klane = config.multiply == "klane"

    def values(w):  # (values, scales): MXFP4 codes as int32 words; K-lane bf16 as pairs
        if fp4:
            return w.packed.view(torch.int32), w.scales
        return (w.view(torch.int32), w) if klane else (w, w)

    (w13v, w13s), (w2v, w2s) = values(w13), values(w2)
    if up is None:
        upv = ups = nw = wd = x
    elif isinstance(up, FP8Rows):
        upv, ups = up.values, up.scales
    else:
        upv = ups = up
    if cfg.latent:
        nw, wd = weights["latent_norm"], weights["latent_down"]
    ws13 = weights["shared_w13"] if s else x
    ws2 = weights["shared_w2"] if s else x
    moe_persistent_kernel[grid](
        x, wd, z, z.view(torch.int32) if klane else z, ws13, a_s, plan.sorted_ids,
        plan.sorted_weights, plan.block_expert_ids, plan.num_valid, plan.topk_weights, w13v,
        w13s, a, a.view(torch.int32) if klane else a, w2v, w2s, y, part, nw, upv, ups, ws2, out,
        sync, items, m, h, d, i, s, m * top_k, block_m, top_k, n_tiles, n_z, n_sh, n_i, n_d,
        n_dr, n_t,
        float(cfg.situ_beta), float(cfg.situ_linear_beta), float(cfg.rms_eps),
        # without route items, stand-ins for route_sort's 14 tensors, 5 ints and a float
        *(route.args if route is not None else (x,) * 14 + (0,) * 5 + (0.0,)),
        route.grid[0] if route is not None else 1, n_route,
        ACT=act, LATENT=bool(cfg.latent), SHARED=bool(s), FP4=fp4, XQ=config.fp8,
        DOT=config.multiply == "dot", EMULATE=INTERPRETED, KLANE=klane,
        TILED13=fp4 and w13.layout == "tiled", TILED2=fp4 and w2.layout == "tiled",
        TOKEN_LOOP=not INTERPRETED,
        DETERMINISTIC=config.deterministic, UP_FP8=isinstance(up, FP8Rows), **t, TRACE=trace,
        ROUTE_WAIT=overlap, **(dict(route.constexprs, ROUTE=True) if route is not None else {}),
        num_warps=config.num_warps, **({"launch_pdl": True} if overlap else {}),
        **({"maxnreg": config.max_registers} if config.max_registers and not INTERPRETED
           else {}))
    if not trace:
        return out
    e_front = n_route + n_z + n_sh
    e_s1 = e_front + n_tiles * n_i
    e_s2 = e_s1 + n_tiles * n_d
    phases = {"route": 0, "front": n_route, "stage1": e_front, "stage2": e_s1, "reduce": e_s2,
              "tail": e_s2 + n_dr}
    return out, PersistentTrace(items, phases, n_items)
