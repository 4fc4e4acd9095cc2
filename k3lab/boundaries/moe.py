"""Latent MoE boundary (docs/model.md): latent down-projection, the selected
experts' two stages (SiTU / SiLU MLPs, weighted fp32 sum), latent RMSNorm + up-projection and the
shared MLP, given the route plan (the route ops belong to the route boundary).

``make_inputs(..., route=True)`` makes every variant route too (``route_sort`` + the block): the
issue's whole-block figure. Variants:
- reference: the loop of section 4 in the model's numerics (bf16 GEMM operands, fp32
  activations, sum and norm): ``latent_moe_from_plan_reference(..., dtype=bfloat16)``;
- fused: ``k3lab.kernels.moe_block`` (front, stage 1, then stage 2 + tail in one ticket-ordered
  launch: 3 launches given the plan; route_sort's plus 3 with routing), reading the experts as
  ``k3lab.kernels.moe_kernel_weights`` lays them out (``Weights.fused``: MXFP4 in the tiled
  layout where the shapes allow); the other variants read the model's row layout. It passes
  ``inputs.get("config")`` (a ``k3lab.kernels.moe.MoEConfig`` or None: the defaults) to the
  launchers, which is how a benchmark sweep sets the kernels' tuning choices;
- persistent / persistent_a8w4 / persistent_fp8_tail: ``k3lab.kernels.moe.persistent.
  moe_persistent``, the whole block in one launch (route_sort's plus one with routing), W4A16
  (bf16 activations), A8W4 (e4m3 activations quantized in the kernel) or W4A16 with the latent
  tail's up-projection in e4m3 with per-row scales (the seed's #18); it passes
  ``inputs["config"]`` when that is a ``PersistentMoEConfig`` (else the defaults), with its
  activation format and tail set by the variant;
- grouped: strong eager torch: gather the selected experts' weights (MXFP4 dequantized in
  bf16 by a byte lookup), two batched matmuls (bmm), fp32 weighted sum, cuBLAS dense
  projections;
- torch.compile: of the grouped peer (CUDA only); with routing two graphs, the reference
  route's then the block's given the plan (the one the plan-given scope compiles).
The check compares every variant with the fp32 truth (``dtype=float32``), not with the bf16
reference, so tolerances are about each variant's own rounding.

Per-stage measurement (notebook): :data:`STAGES`, :func:`stage_inputs`, :func:`stage_fns`,
:func:`stage_bytes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from k3lab.boundaries import Boundary, Variant, assert_close, compiled
from k3lab.config import Preset
from k3lab.kernels import (
    latent_down,
    latent_moe_tail,
    moe_block,
    moe_kernel_weights,
    moe_stage1,
    moe_stage2,
    route_sort,
)
from k3lab.kernels.moe import MoEConfig, mma_prepare_x
from k3lab.kernels.moe.persistent import (
    PersistentMoEConfig,
    fp8_rows_quantize,
    moe_persistent,
)
from k3lab.kernels.mxfp4 import E2M1_VALUES, MXFP4, MXFP4_GROUP, mxfp4_tiled_codes
from k3lab.kernels.route import RouteConfig
from k3lab.kernels.runtime import INTERPRETED
from k3lab.reference.moe import (
    activate,
    latent_moe_from_plan_reference,
    moe_stage1_reference,
    moe_stage2_reference,
    rms_norm_reference,
)
from k3lab.reference.route import route_sort_reference
from k3lab.weights import hidden_states, make_generator, moe_weights, router_weights

__all__ = ["BOUNDARY", "Weights", "make_inputs", "check", "bytes_moved", "expert_bytes",
           "grouped_forward", "STAGES", "copies_sharing_experts", "stage_inputs", "stage_fns",
           "stage_bytes",
           "OUT_ATOL", "OUT_RTOL"]

# Output (bf16 [M, H]) vs the fp32 truth. Sources: bf16 rounding of z and a inside the kernels
# (2^-9 relative each, carried through D- and I-long dot products) and of the output (2^-9
# relative), carried through dot products whose sums grow with |out|: hence the relative term
# beside the absolute one (see docs/decisions.md for the observed errors).
OUT_ATOL = 0.03
OUT_RTOL = 0.02


class Weights(Mapping):
    """The MoE weights dict behind a read-only Mapping, which ``clone_inputs`` shares instead of
    cloning: a K3 tp 1 bf16 expert set (59 GB) must not be copied per variant call.

    The mapping holds the model's layout (MXFP4 experts in rows), which the reference and the
    peers read; ``fused`` is the same dict with the experts as the fused kernels want them
    (``k3lab.kernels.moe_kernel_weights``: MXFP4 in the tiled layout where the shapes allow),
    made once, as an inference engine lays out its checkpoint at load time. Both hold the same
    bytes; ``fused_experts`` passes an existing one on (copies sharing the experts)."""

    def __init__(self, weights: dict, fused_experts: dict | None = None):
        self._w = dict(weights)
        self._fused_experts = fused_experts
        self._fused = None
        self._front = None

    @property
    def fused_experts(self) -> dict:
        """{"w13": ..., "w2": ...} in the fused kernels' layout (made on first use)."""
        if self._fused_experts is None:
            k = moe_kernel_weights({n: self._w[n] for n in ("w13", "w2") if n in self._w})
            self._fused_experts = k
        return self._fused_experts

    @property
    def fused(self) -> dict:
        """The weights dict the fused variant passes to the kernels (made on first use)."""
        if self._fused is None:
            self._fused = {**self._w, **self.fused_experts}
        return self._fused

    @property
    def front(self) -> torch.Tensor | None:
        """latent_down and shared_w13 concatenated (bf16 [D + 2S, H], made once), the one-launch
        front of ``MoEConfig(dense_projections=True)``; None without both."""
        if self._front is None and "latent_down" in self._w and "shared_w13" in self._w:
            self._front = torch.cat([self._w["latent_down"], self._w["shared_w13"]])
        return self._front

    def for_kernels(self, config: MoEConfig | None) -> dict:
        """The weights dict the kernels read under ``config``: :attr:`fused` (the kernels'
        layout), or the model's layout where ``config.tiled_weights`` is off; with
        ``config.dense_projections`` also :attr:`front`."""
        w = self.fused if config is None or config.tiled_weights else dict(self._w)
        if config is not None and config.dense_projections and self.front is not None:
            w = {**w, "front": self.front}
        return w

    def experts_for_kernels(self, config: MoEConfig | None) -> dict:
        """{"w13": ..., "w2": ...} as :meth:`for_kernels` holds them."""
        if config is None or config.tiled_weights:
            return self.fused_experts
        return {n: self._w[n] for n in ("w13", "w2") if n in self._w}

    def __getitem__(self, key):
        return self._w[key]

    def __iter__(self):
        return iter(self._w)

    def __len__(self):
        return len(self._w)

    def __repr__(self):
        return f"Weights({sorted(self._w)})"


def make_inputs(cfg: Preset, device, seed: int, M: int = 1, expert_format: str = "bf16",
                block_m: int = 1, route: bool = False,
                deterministic_stage2: bool = False) -> dict:
    """x [M, H] bf16; weights (``k3lab.weights.moe_weights``, experts bf16 or MXFP4) wrapped in
    :class:`Weights`; plan: the reference RoutePlan of x (block_m, zeroed out [M, D]); cfg;
    route: whether the variants route themselves (then ``plan`` is only the reference's);
    deterministic_stage2: the fused variants' stage 2 sums each token's slots in order
    (``inputs["config"] = MoEConfig(deterministic_stage2=True)``) instead of fp32 atomics."""
    if not isinstance(deterministic_stage2, bool):
        raise ValueError(f"deterministic_stage2: expected a bool, got {deterministic_stage2!r}")
    dev = torch.device(device)
    gen = make_generator(seed, dev)
    weights = Weights(moe_weights(cfg, gen, expert_format=expert_format))
    x = hidden_states(cfg, M, gen)
    plan = route_sort_reference(
        x, weights["gate_weight"], weights["correction_bias"], top_k=cfg.top_k,
        n_group=cfg.n_group, topk_group=cfg.topk_group, renormalize=cfg.renormalize,
        routed_scaling_factor=cfg.routed_scaling, block_m=block_m, out_dim=cfg.moe_in)
    inputs = {"x": x, "plan": plan, "weights": weights, "cfg": cfg, "block_m": block_m,
              "route": bool(route), "expert_format": expert_format}
    if deterministic_stage2:
        inputs["config"] = MoEConfig(deterministic_stage2=True)
    return inputs


def _plan(inputs: dict, fused: bool, config: RouteConfig | None = None):
    if not inputs["route"]:
        return inputs["plan"]
    x, w, cfg = inputs["x"], inputs["weights"], inputs["cfg"]
    kw = dict(top_k=cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
              renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling,
              block_m=inputs["block_m"], out_dim=cfg.moe_in)
    if fused:
        return route_sort(x, w["gate_weight"], w["correction_bias"], **kw, config=config)
    return route_sort_reference(x, w["gate_weight"], w["correction_bias"], **kw)


# Under the interpreter a variant that routes itself runs route_sort first with the route's
# split-K tiles (few programs: each interpreted program costs its Python overhead) and hands
# the block the plan: the same launches. On a GPU the block routes with the kernels' defaults.
_INTERPRETER_ROUTE = RouteConfig(gemv_row_programs=0)


def _own_plan(inputs: dict):
    """The plan a fused variant passes its block: the inputs' (no routing), None (the block
    routes itself) or, under the interpreter, route_sort's with ``_INTERPRETER_ROUTE``."""
    if not inputs["route"]:
        return inputs["plan"]
    return _plan(inputs, True, _INTERPRETER_ROUTE) if INTERPRETED else None


def _reference(inputs: dict, dtype=torch.bfloat16) -> torch.Tensor:
    return latent_moe_from_plan_reference(inputs["x"], _plan(inputs, False), inputs["weights"],
                                          inputs["cfg"], dtype=dtype)


def _reference_route(inputs: dict):
    return _plan(inputs, False)


FUSE_TAIL = True  # the fused variant's moe_block(fuse_tail=)


def _fused(inputs: dict) -> torch.Tensor:
    config = inputs.get("config")  # a MoEConfig (a sweep's point) or None: the defaults
    plan = _own_plan(inputs)
    return moe_block(inputs["x"], inputs["weights"].for_kernels(config), cfg=inputs["cfg"],
                     plan=plan, block_m=inputs["block_m"], fuse_tail=FUSE_TAIL, config=config)


def _fused_dense(inputs: dict) -> torch.Tensor:
    config = dataclasses.replace(inputs.get("config") or MoEConfig(), dense_projections=True)
    return _fused({**inputs, "config": config})


# ---------------------------------------------------------------------------------------------
# the persistent single-owner block

# Launches of the fused variants: (given the plan, with routing).
LAUNCHES = {"fused": (3, 4), "fused+dense": (4, 4), "persistent": (1, 2),
            "persistent_a8w4": (1, 2), "persistent_fp8_tail": (1, 2)}
PERSISTENT_VARIANTS = ("persistent", "persistent_a8w4", "persistent_fp8_tail")
# Output vs the fp32 truth for quantized numerics, which the persistent variants mark their
# output with (``k3lab_numerics``): (relative norm error, elementwise error as a multiple of
# rms(truth)); derived in tests/kernels/test_moe_persistent.py, which checks these values.
QUANTIZED_TOLERANCES = {"a8w4": (0.09, 0.27), "a8w4+fp8 tail": (0.1, 0.31),
                        "w4a16+fp8 tail": (0.052, 0.16)}
_FP8_TAILS: dict = {}  # id of a latent_up -> (it, its FP8Rows): quantized once, as at load time


def fp8_tail_rows(up: torch.Tensor):
    """``up`` (a latent up-projection) as e4m3 rows with their scales (``fp8_rows_quantize``),
    made on the first call (an eager one, before any capture) and kept, as at load time."""
    key = (id(up), up.data_ptr())
    if key not in _FP8_TAILS:
        _FP8_TAILS[key] = (up, fp8_rows_quantize(up))
    return _FP8_TAILS[key][1]


def _persistent_weights(weights, config: PersistentMoEConfig):
    """The weights moe_persistent reads: the model's (MXFP4 rows), plus the fp8 tail's."""
    if not (config.tail_fp8 and "latent_up" in weights):
        return weights
    return {**weights, "latent_up_fp8": fp8_tail_rows(weights["latent_up"])}


def persistent_config(activations: str, config=None) -> PersistentMoEConfig:
    """The config a persistent variant runs: ``config`` (a sweep's point) when it is a
    PersistentMoEConfig, else the defaults with W4A16 multiplying in the stages' K-lane GEMVs
    (the fastest in the persistent_config sweep, docs/decisions.md) and A8W4 fma, with 16-row
    stage-2 items, so that its product budget keeps the experts' K step (its K-lane GEMVs,
    quantizing as they load, are points of the persistent_a8w4 sweep);
    with ``activations`` ("bf16" or "fp8") set. Under the interpreter the defaults take a few
    big work items instead (it runs programs and items one after another; the tests run the
    GPU's items too)."""
    if not isinstance(config, PersistentMoEConfig):
        mode = dict(multiply="klane") if activations == "bf16" else dict(multiply="fma",
                                                                          stage2_block_n=16)
        config = PersistentMoEConfig(**mode, **(_INTERPRETER_ITEMS if INTERPRETED else {}))
    return dataclasses.replace(config, activations=activations)


# the persistent block's work items under the interpreter (as tests/kernels/test_moe_persistent's
# BIG): whole-preset tiles at the tiny preset
_INTERPRETER_ITEMS = dict(front_block_n=128, expert_block_n=128, tail_block_n=256, block_k=256,
                          max_products=1 << 22)


def _persistent(activations: str, tail_fp8: bool = False):
    def run(inputs: dict) -> torch.Tensor:
        config = persistent_config(activations, inputs.get("config"))
        if tail_fp8:
            config = dataclasses.replace(config, tail_fp8=True)
        cfg = inputs["cfg"]
        out = moe_persistent(inputs["x"], _persistent_weights(inputs["weights"], config),
                             cfg=cfg, plan=_own_plan(inputs),
                             block_m=inputs["block_m"], config=config)
        numerics = ("a8w4" if config.fp8 else "w4a16") + (
            "+fp8 tail" if config.tail_fp8 and cfg.latent else "")
        if numerics in QUANTIZED_TOLERANCES:
            out.k3lab_numerics = numerics
        return out
    return run


# ---------------------------------------------------------------------------------------------
# the grouped eager peer


_PAIRS: dict[torch.device, torch.Tensor] = {}  # device -> the code bytes' value pairs


def _pair_table(device: torch.device) -> torch.Tensor:
    """bf16 [256, 2]: the two E2M1 values of every code byte (low nibble first), made once per
    device (a host-to-device copy, so before any CUDA-graph capture)."""
    if device not in _PAIRS:
        table = torch.tensor(E2M1_VALUES)
        codes = torch.arange(256)
        value = [table[c & 7] * (1 - 2 * (c >> 3)) for c in (codes & 0xF, codes >> 4)]
        _PAIRS[device] = torch.stack(value, dim=-1).to(device, torch.bfloat16)
    return _PAIRS[device]


def dequantize_mxfp4_bf16(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 values of MXFP4 codes (row layout: packed uint8 [..., N, K/2], scales E8M0 uint8
    [..., N, K/32]) as an engine dequantizes: one lookup of each byte's two values, one
    multiply by the group's power of two, all in bf16 (exact: an E2M1 value times a power of
    two). The same values as ``reference.moe.dequantize_mxfp4``, with a fraction of its
    full-size fp32 temporaries."""
    vals = _pair_table(packed.device)[packed.int()].flatten(-2)              # [..., N, K]
    scale = torch.exp2(scales.float() - 127.0).to(torch.bfloat16).unsqueeze(-1)
    return (vals.unflatten(-1, (-1, MXFP4_GROUP)) * scale).flatten(-2)


def _gather(w, ids: torch.Tensor) -> torch.Tensor:
    """The selected experts ids [N] of w [E, R, C] as a bf16 [N, R, C] copy."""
    if isinstance(w, MXFP4):
        packed = w.packed.index_select(0, ids)
        if w.layout == "tiled":  # (the peers are given the row layout: Weights)
            packed = mxfp4_tiled_codes(packed, inverse=True)
        return dequantize_mxfp4_bf16(packed, w.scales.index_select(0, ids))
    return w.index_select(0, ids)


def _act(gu: torch.Tensor, cfg: Preset) -> torch.Tensor:
    i = gu.shape[-1] // 2
    return activate(gu[..., :i], gu[..., i:], cfg.activation, cfg.situ_beta,
                    cfg.situ_linear_beta).to(torch.bfloat16)


def grouped_stage1(z: torch.Tensor, plan, w13, cfg: Preset) -> torch.Tensor:
    """a [M * top_k, I] bf16: one bmm over the gathered experts' w13."""
    top_k = plan.topk_ids.shape[1]
    ids = plan.topk_ids.reshape(-1).long()
    zz = z.to(torch.bfloat16).repeat_interleave(top_k, dim=0)                 # [N, D]
    gu = torch.bmm(_gather(w13, ids), zz.unsqueeze(-1)).squeeze(-1).float()   # [N, 2I]
    return _act(gu, cfg)


def grouped_stage2(a: torch.Tensor, plan, w2) -> torch.Tensor:
    """y [M, D] fp32: one bmm over the gathered experts' w2, then the weighted sum."""
    m, top_k = plan.topk_ids.shape
    ids = plan.topk_ids.reshape(-1).long()
    o = torch.bmm(_gather(w2, ids), a.to(torch.bfloat16).unsqueeze(-1)).squeeze(-1).float()
    return (o.view(m, top_k, -1) * plan.topk_weights.unsqueeze(-1)).sum(dim=1)


def grouped_front(x: torch.Tensor, weights: dict, cfg: Preset):
    z = F.linear(x, weights["latent_down"]) if cfg.latent else x
    sa = _act(F.linear(x, weights["shared_w13"]).float(), cfg) if cfg.shared_intermediate else None
    return z, sa


def grouped_tail(y: torch.Tensor, shared_a, weights: dict, cfg: Preset) -> torch.Tensor:
    if cfg.latent:
        n = rms_norm_reference(y, weights["latent_norm"], cfg.rms_eps).to(torch.bfloat16)
        out = F.linear(n, weights["latent_up"]).float()
    else:
        out = y
    if shared_a is not None:
        out = out + F.linear(shared_a, weights["shared_w2"]).float()
    return out.to(torch.bfloat16)


def grouped_forward(x: torch.Tensor, plan, weights: dict, cfg: Preset) -> torch.Tensor:
    """The block in eager torch with batched matmuls over the gathered selected experts."""
    z, sa = grouped_front(x, weights, cfg)
    a = grouped_stage1(z, plan, weights["w13"], cfg)
    y = grouped_stage2(a, plan, weights["w2"])
    return grouped_tail(y, sa, weights, cfg)


def _grouped(inputs: dict) -> torch.Tensor:
    return grouped_forward(inputs["x"], _plan(inputs, False), inputs["weights"], inputs["cfg"])


def _grouped_given_plan(inputs: dict) -> torch.Tensor:
    return grouped_forward(inputs["x"], inputs["plan"], inputs["weights"], inputs["cfg"])


_compiled_route = compiled(_reference_route)
_compiled_block = compiled(_grouped_given_plan)


def _compiled_grouped(inputs: dict) -> torch.Tensor:
    """torch.compile of the grouped peer as two graphs, the reference route's and the block's
    given a plan: with routing the block reuses the graph compiled given the plan. (Compiling
    the reference's loop instead unrolls it into M * top_k experts' worth of kernels for
    Inductor to generate: half a minute of compiling at K3 for a slower peer.) The code table
    is made outside the graphs: made inside, its cache's guard would recompile the block."""
    _pair_table(inputs["x"].device)
    if inputs["route"]:
        inputs = {**inputs, "plan": _compiled_route(inputs)}
    return _compiled_block(inputs)


# ---------------------------------------------------------------------------------------------
# check and bytes


def truth(inputs: dict) -> torch.Tensor:
    """The fp32 truth of ``inputs`` (the reference in fp32, its own routing with ``route``)."""
    return _reference(inputs, dtype=torch.float32)


def check(out: torch.Tensor, ref: torch.Tensor, inputs: dict) -> dict:
    """out [M, H] against the fp32 truth of the same plan, within OUT_ATOL + OUT_RTOL * |truth|
    (``ref``, the bf16 reference, is itself checked the same way when passed as ``out``)."""
    return check_truth(out, truth(inputs))


def check_truth(out: torch.Tensor, truth: torch.Tensor) -> dict:
    """:func:`check` against a truth already computed (several outputs of one input set)."""
    numerics = getattr(out, "k3lab_numerics", None)  # quantized: QUANTIZED_TOLERANCES
    if numerics in QUANTIZED_TOLERANCES:
        fro, elem = QUANTIZED_TOLERANCES[numerics]
        rel = float((out.float() - truth).norm() / truth.norm())
        if rel > fro:
            raise AssertionError(f"out: relative norm error {rel:.3g} exceeds {fro} ({numerics})")
        atol = elem * float(truth.pow(2).mean().sqrt())
        return {"out": assert_close("out", out.float(), truth, atol=atol)}
    return {"out": assert_close("out", out.float(), truth, atol=OUT_ATOL, rtol=OUT_RTOL)}


def expert_bytes(w, n_experts: int = 1) -> int:
    """Bytes of ``n_experts`` experts of w [E, R, C] (bf16, or MXFP4 values + scales)."""
    if isinstance(w, MXFP4):
        per = (w.packed.nbytes + w.scales.nbytes) // w.packed.shape[0]
    else:
        per = w.nbytes // w.shape[0]
    return int(per * n_experts)


def _unique_experts(plan) -> int:
    return int(torch.unique(plan.topk_ids).numel())


def bytes_moved(inputs: dict) -> int:
    """Selected (unique) experts' w13 and w2 bytes, dense weights (latent down, norm, up, shared
    w13 and w2), x read and out written, the plan's ids and weights read; with ``route`` also the
    router's gate weight and bias. Intermediates (z, a, y) are left out: they are the kernels'
    own business (a few KB at B1)."""
    w, plan, x = inputs["weights"], inputs["plan"], inputs["x"]
    n = _unique_experts(plan)
    total = expert_bytes(w["w13"], n) + expert_bytes(w["w2"], n)
    for name in ("latent_down", "latent_norm", "latent_up", "shared_w13", "shared_w2"):
        if name in w:
            total += w[name].nbytes
    total += 2 * x.nbytes + plan.topk_ids.nbytes + plan.topk_weights.nbytes
    if inputs["route"]:
        total += w["gate_weight"].nbytes + w["correction_bias"].nbytes
    return int(total)


# ---------------------------------------------------------------------------------------------
# per-stage measurement


def copies_sharing_experts(inputs: dict, n: int, seed: int = 0) -> list[dict]:
    """``n`` input sets for cold timing that share the (large) expert tensors: the first is
    ``inputs``; each other has a new x (so other experts are routed and read) and new dense
    weights (latent down / norm / up, shared MLP, router), so rotating through them reads cold
    experts and cold dense weights without ``n`` copies of every expert (59 GB at K3 tp 1)."""
    cfg, w0 = inputs["cfg"], inputs["weights"]
    dev = inputs["x"].device
    out = [inputs]
    for s in range(1, n):
        gen = make_generator(seed + 1000 + s, dev)
        dense = moe_weights(dataclasses.replace(cfg, n_experts=1), gen)  # one dummy expert
        w = {k: w0[k] if k in ("w13", "w2") else v for k, v in dense.items()}
        w["gate_weight"] = router_weights(cfg, gen)["gate_weight"]
        w["correction_bias"] = w0["correction_bias"]
        x = hidden_states(cfg, inputs["x"].shape[0], gen)
        plan = route_sort_reference(
            x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k, n_group=cfg.n_group,
            topk_group=cfg.topk_group, renormalize=cfg.renormalize,
            routed_scaling_factor=cfg.routed_scaling, block_m=inputs["block_m"],
            out_dim=cfg.moe_in)
        out.append({**inputs, "x": x, "plan": plan,
                    "weights": Weights(w, fused_experts=w0.fused_experts)})
    return out


STAGES = ("front", "stage1", "stage2", "tail")
STAGE_TITLES = {
    "front": "latent down + shared gate/up (GEMVs of x)",
    "stage1": "stage 1: selected experts' w13 GEMVs + activation",
    "stage2": "stage 2: selected experts' w2 GEMVs + weighted fp32 sum",
    "tail": "tail: RMSNorm + up-projection + shared down + add",
}


def stage_inputs(inputs: dict) -> dict:
    """inputs plus each stage's own inputs, computed once by the grouped eager path: z, shared_a
    (front), a (stage 1), y (stage 2); z_mma and a_mma, the copies of z and a that the fused
    front and stage 1 write for the MXFP4 tensor-core tiles (``mma_prepare_x``; None for bf16
    experts, which nothing would read them for, or where the size is not a multiple of 8)."""
    w, cfg, plan = inputs["weights"], inputs["cfg"], inputs["plan"]
    z, sa = grouped_front(inputs["x"], w, cfg)
    a = grouped_stage1(z, plan, w["w13"], cfg)
    y = grouped_stage2(a, plan, w["w2"])
    z, a = z.contiguous(), a.contiguous()

    def prepared(t, experts):
        return mma_prepare_x(t) if isinstance(experts, MXFP4) and t.shape[-1] % 8 == 0 else None

    return {**inputs, "z": z, "shared_a": sa, "a": a, "y": y,
            "z_mma": prepared(z, w["w13"]) if cfg.latent else None,
            "a_mma": prepared(a, w["w2"])}


def stage_fns(stage: str) -> dict:
    """{variant name: fn(stage inputs)} for one of STAGES: reference (bf16 model numerics, loop),
    grouped (eager bmm / cuBLAS) and fused (this boundary's kernel for that stage; as in
    moe_block, the fused front and stage 1 also write the prepared copies of z and a that the
    next stage's tensor-core tiles read). The fused stages 1 and 2 are launched with
    programmatic dependent launch (``pdl=True``, as moe_block launches stage 1 after the front,
    and stage 2 after stage 1 with fuse_tail=False): back to back, a call's programs start
    during the previous call's last wave; "fused (no PDL)" is the same kernel launched
    plainly. Every fused function passes the inputs' "config" (a MoEConfig or None) on."""

    def act(cfg):
        return dict(activation=cfg.activation, situ_beta=cfg.situ_beta,
                    situ_linear_beta=cfg.situ_linear_beta)

    def stage1(i, pdl):
        config = i.get("config")
        return moe_stage1(i["z"], i["plan"], i["weights"].experts_for_kernels(config)["w13"],
                          z_mma=i.get("z_mma"),
                          a_mma_out=None if i.get("a_mma") is None
                          else torch.empty_like(i["a_mma"]), pdl=pdl, config=config,
                          **act(i["cfg"]))

    def stage2(i, pdl):
        config = i.get("config")
        return moe_stage2(i["a"], i["plan"], i["weights"].experts_for_kernels(config)["w2"],
                          a_mma=i.get("a_mma"), pdl=pdl, config=config)

    if stage == "front":
        def fused(i):
            config, w = i.get("config"), i["weights"]
            zp = (torch.empty_like(i["z_mma"]) if i.get("z_mma") is not None
                  and w.get("latent_down") is not None else None)
            return latent_down(i["x"], w.get("latent_down"), w.get("shared_w13"),
                               z_mma_out=zp, config=config, **act(i["cfg"]))

        def eager(i):
            return grouped_front(i["x"], i["weights"], i["cfg"])
        return {"reference": eager, "grouped": eager, "fused": fused}
    if stage == "stage1":
        return {
            "reference": lambda i: moe_stage1_reference(i["z"], i["plan"], i["weights"]["w13"],
                                                        dtype=torch.bfloat16, **act(i["cfg"])),
            "grouped": lambda i: grouped_stage1(i["z"], i["plan"], i["weights"]["w13"], i["cfg"]),
            "fused": lambda i: stage1(i, True),
            "fused (no PDL)": lambda i: stage1(i, False),
        }
    if stage == "stage2":
        return {
            "reference": lambda i: moe_stage2_reference(i["a"], i["plan"], i["weights"]["w2"],
                                                        dtype=torch.bfloat16),
            "grouped": lambda i: grouped_stage2(i["a"], i["plan"], i["weights"]["w2"]),
            "fused": lambda i: stage2(i, True),
            "fused (no PDL)": lambda i: stage2(i, False),
        }
    if stage == "tail":
        def fused(i):
            config, w, cfg = i.get("config"), i["weights"], i["cfg"]
            shared = None if i["shared_a"] is None else {"a": i["shared_a"], "w2": w["shared_w2"]}
            if cfg.latent:
                return latent_moe_tail(i["y"], w["latent_norm"], w["latent_up"], shared,
                                       eps=cfg.rms_eps, config=config)
            return latent_moe_tail(i["y"], None, None, shared, eps=cfg.rms_eps, config=config)

        def eager(i):
            return grouped_tail(i["y"], i["shared_a"], i["weights"], i["cfg"])
        return {"reference": eager, "grouped": eager, "fused": fused}
    raise ValueError(f"stage: expected one of {STAGES}, got {stage!r}")


def stage_bytes(stage: str, inputs: dict) -> int:
    """Minimum bytes of one stage: its weights (selected experts for stages 1 and 2) plus its
    activations in and out."""
    w, plan, cfg, x = inputs["weights"], inputs["plan"], inputs["cfg"], inputs["x"]
    m, h = x.shape
    d, i, s = cfg.moe_in, cfg.moe_intermediate, cfg.shared_intermediate
    k = plan.topk_ids.shape[1]
    n = _unique_experts(plan)
    if stage == "front":
        dense = sum(w[k_].nbytes for k_ in ("latent_down", "shared_w13") if k_ in w)
        return int(dense + x.nbytes + 2 * m * (d * bool(cfg.latent) + s))
    if stage == "stage1":
        return int(expert_bytes(w["w13"], n) + 2 * m * d + 2 * m * k * i)
    if stage == "stage2":
        return int(expert_bytes(w["w2"], n) + 2 * m * k * i + 4 * m * d)
    if stage == "tail":
        dense = sum(w[k_].nbytes for k_ in ("latent_norm", "latent_up", "shared_w2") if k_ in w)
        return int(dense + 4 * m * d + 2 * m * s + 2 * m * h)
    raise ValueError(f"stage: expected one of {STAGES}, got {stage!r}")


BOUNDARY = Boundary(
    name="moe",
    title="Latent MoE: latent down, stage 1 direct tile, atomic stage 2, fused tail + shared",
    owns=("moe.latent_down", "moe.stage1", "moe.stage2", "moe.latent_norm", "moe.latent_up",
          "moe.shared", "moe.shared_add"),
    make_inputs=make_inputs,
    variants=(
        Variant("reference", "reference", _reference,
                "the loop of docs/model.md in the model's numerics: per selected "
                "expert index_select (+ MXFP4 dequant), two bf16 GEMVs, fp32 SiTU, fp32 "
                "weighted sum, fp32 RMSNorm, bf16 up-projection, shared MLP"),
        Variant("fused", "fused", _fused,
                "three Triton launches: front (latent down + shared gate/up GEMVs), stage 1 "
                "direct tile over the plan, then stage 2 (fp32 atomics) and the tail + shared "
                "down in one ticket-ordered grid (plus route_sort's launch(es) with routing)"),
        Variant("fused+dense", "fused", _fused_dense,
                "the fused block with MoEConfig(dense_projections=True): latent down + shared "
                "gate/up as one dense GEMV launch (weights concatenated once), stage 1, stage 2 "
                "alone, then RMSNorm + up-projection + shared down as one dense GEMV (4 launches "
                "given a plan; with routing route_sort's programs run in the front's launch, "
                "MoEConfig.front_routes: 4 too; presets without a latent run the plain fused "
                "block)"),
        Variant("persistent", "fused", _persistent("bf16"),
                "one persistent Triton launch (plus route_sort's with routing): latent down, "
                "shared gate/up, stage 1, stage 2 and the tail as ticket-ordered work items, "
                "bf16 activations (W4A16 with MXFP4 experts)"),
        Variant("persistent_a8w4", "fused", _persistent("fp8"),
                "the persistent launch with e4m3 expert activations quantized per row in the "
                "kernel (A8W4 with MXFP4 experts)"),
        Variant("persistent_fp8_tail", "fused", _persistent("bf16", tail_fp8=True),
                "the W4A16 persistent launch with the latent tail's up-projection in e4m3, "
                "one scale per output row (quantized once, as at load time; the seed's #18): "
                "half the tail's weight bytes"),
        Variant("grouped", "peer", _grouped,
                "eager torch: gather the selected experts' weights (MXFP4 dequantized), bmm for "
                "each stage, fp32 weighted sum, cuBLAS dense projections"),
        Variant("torch.compile", "peer", _compiled_grouped,
                "torch.compile of the grouped peer (with routing: the reference route's graph, "
                "then the block's given the plan)", devices=("cuda",)),
    ),
    check=check,
    bytes_moved=bytes_moved,
    params={"M": 1, "expert_format": "bf16", "block_m": 1, "route": False,
            "deterministic_stage2": False},
)
