"""Named sweeps: a boundary of the registry and the points to measure it at.

A point is a dict. Its keys are either parameters of the boundary's ``make_inputs`` (``M``,
``block_m``, ``expert_format``, ``context``, ...) or fields of the boundary's kernel config, the
frozen dataclass its fused variant reads from ``inputs["config"]`` (a dotted key such as
``"front.block_k"`` reaches a field of a nested config). Config fields are applied with
``dataclasses.replace`` to the config class's defaults (``Config()``); a point without config
fields passes no config, so the kernels choose as they do by default. Where a kernel picks its
config per shape when given none (the dense GEMV), ``Config()`` is not that choice: name every
field that matters. A key that is neither is an error, raised by
:func:`resolve` for the whole sweep before anything is measured: a sweep never silently times
the defaults under another name.

``Sweep.params`` holds make_inputs parameters shared by every point (a point's own win).
``Sweep.variants``: the variants measured (None: every variant of the boundary).
``Sweep.tp``: the tensor-parallel degree the sweep is meant for on the GPU (the runner's
``--tp`` wins; on CPU the runner uses the tiny preset at tp 1).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Sweep", "Point", "SweepError", "SWEEPS", "get", "names", "resolve", "config_class",
           "default_config", "CONFIG_CLASSES", "point_json", "grid", "prepare"]


class SweepError(KeyError):
    """A sweep names a field, parameter, variant or point that does not exist."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Sweep:
    name: str
    boundary: str
    points: tuple[dict, ...]
    description: str = ""
    variants: tuple[str, ...] | None = ("fused",)
    params: dict = field(default_factory=dict)
    tp: int | None = None
    # the config class its points set fields of, when not the boundary's (CONFIG_CLASSES):
    # (kernel package, class name), e.g. the persistent MoE's own config
    config: tuple[str, str] | None = None


@dataclass(frozen=True)
class Point:
    """One resolved point: the make_inputs parameters, the config overrides (dotted keys), the
    config the fused variant gets (:func:`default_config` with the overrides applied; None when
    the point sets no config field, so the kernels choose as they do by default), and the point
    as written (``spec``)."""

    spec: dict
    params: dict
    overrides: dict
    config: Any


# The kernel config of each boundary's fused variant: (kernel package, class name); the class is
# looked up in k3lab.kernels, then the package, then its config module (the first found wins).
CONFIG_CLASSES: dict[str, tuple[str, str]] = {
    "route": ("route", "RouteConfig"),
    "moe": ("moe", "MoEConfig"),
    "kda": ("kda", "KDAConfig"),
    "mla": ("mla", "MLAConfig"),
    "attn_res": ("attn_res", "AttnResConfig"),
    "dense": ("dense", "GemvConfig"),
}


def config_class(boundary: str, which: tuple[str, str] | None = None) -> type | None:
    """The frozen config dataclass of ``boundary``'s fused variant (or ``which``: (kernel
    package, class name)), or None when the checkout has none."""
    if which is None and boundary not in CONFIG_CLASSES:
        return None
    package, name = which or CONFIG_CLASSES[boundary]
    for module in ("k3lab.kernels", f"k3lab.kernels.{package}",
                   f"k3lab.kernels.{package}.config"):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if cls is not None and dataclasses.is_dataclass(cls):
            return cls
    return None


def default_config(cls: type) -> Any:
    """The defaults of config class ``cls``: a module-level ``DEFAULT_CONFIG`` / ``DEFAULT``
    instance where the class's module has one, else ``cls()``."""
    module = importlib.import_module(cls.__module__)
    for attr in ("DEFAULT_CONFIG", "DEFAULT"):
        obj = getattr(module, attr, None)
        if isinstance(obj, cls):
            return obj
    return cls()


def _replace(cfg: Any, dotted: str, value: Any, where: str) -> Any:
    head, _, rest = dotted.partition(".")
    names = [f.name for f in dataclasses.fields(cfg)]
    if head not in names:
        raise SweepError(f"{where}: {type(cfg).__name__} has no field {head!r}; "
                       f"its fields: {names}")
    if rest:
        inner = getattr(cfg, head)
        if not (dataclasses.is_dataclass(inner) and not isinstance(inner, type)):
            raise SweepError(f"{where}: {type(cfg).__name__}.{head} is not a config, so "
                           f"{dotted!r} names nothing")
        value = _replace(inner, rest, value, where)
    return dataclasses.replace(cfg, **{head: value})


def _input_params(boundary) -> set[str]:
    sig = inspect.signature(boundary.make_inputs)
    skip = {"cfg", "device", "seed"}
    return {n for n, p in sig.parameters.items()
            if n not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} | set(
        boundary.params)


def resolve(sweep: Sweep, points: list[int] | None = None) -> list[Point]:
    """Every point of ``sweep`` (or the chosen indices) split into make_inputs parameters and
    config overrides, the config built; raises SweepError (an unknown field, parameter,
    variant or point) or ValueError (a value the config refuses), naming the point and the
    field, before anything runs."""
    from k3lab import boundaries

    if sweep.boundary == "token":  # the whole decode token: benchmarks/token.py
        from benchmarks.token import resolve as resolve_token
        return resolve_token(sweep, points)
    b = boundaries.get(sweep.boundary)
    known = _input_params(b)
    cls = config_class(sweep.boundary, sweep.config) if sweep.config else \
        config_class(sweep.boundary)
    chosen = range(len(sweep.points)) if points is None else points
    out = []
    for i in chosen:
        if not 0 <= i < len(sweep.points):
            raise SweepError(f"sweep {sweep.boundary}/{sweep.name}: no point {i} "
                             f"(it has {len(sweep.points)})")
        spec = {**sweep.params, **sweep.points[i]}
        where = f"sweep {sweep.boundary}/{sweep.name}, point {i} {point_json(sweep.points[i])}"
        params = {k: v for k, v in spec.items() if k in known}
        overrides = {k: v for k, v in spec.items() if k not in known}
        if overrides and cls is None:
            raise SweepError(f"{where}: {sorted(overrides)} are not make_inputs parameters "
                             f"of {sweep.boundary} ({sorted(known)}), and this checkout has "
                             f"no config class for it")
        config = default_config(cls) if overrides else None
        for key, value in overrides.items():
            try:
                config = _replace(config, key, value, where)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{where}: {key}={value!r}: {exc}") from exc
        out.append(Point(spec, params, overrides, config))
    if sweep.variants is not None:
        have = [v.name for v in b.variants]
        for v in sweep.variants:
            if v not in have:
                raise SweepError(f"sweep {sweep.boundary}/{sweep.name}: {sweep.boundary} has no "
                               f"variant {v!r}; expected one of {have}")
    return out


def prepare(sweep: Sweep, preset: str, tp: int, points: list[int] | None = None,
            variants: list[str] | None = None) -> tuple[Sweep, list[Point], Any, Any]:
    """(the sweep with ``variants`` if given, its resolved points, its boundary, the preset
    sharded at ``tp``); raises before anything runs, as :func:`resolve` does, and ValueError
    where the boundary does not apply to the preset."""
    from k3lab import boundaries
    from k3lab.config import preset as make_preset

    if variants:
        sweep = dataclasses.replace(sweep, variants=tuple(variants))
    resolved = resolve(sweep, points)
    b = boundaries.get(sweep.boundary)
    cfg = make_preset(preset, tp)
    if not b.applies(cfg):
        raise ValueError(f"boundary: {sweep.boundary} does not apply to preset {preset} tp {tp}")
    return sweep, resolved, b, cfg


def point_json(point: dict) -> str:
    """A point (or a config) as compact, key-sorted JSON."""
    return json.dumps(point, sort_keys=True, separators=(",", ":"), default=_json_default)


def _json_default(obj: Any):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return repr(obj)


# ---------------------------------------------------------------------------------------------
# the sweeps


def grid(*axes: tuple[dict, ...] | list[dict]) -> tuple[dict, ...]:
    """Every combination of one dict from each axis, merged (later axes win on a shared key):
    ``grid(({"M": 1}, {"M": 4}), ({}, {"pdl": False}))`` is four points."""
    return tuple({k: v for d in combo for k, v in d.items()}
                 for combo in itertools.product(*axes))


_M = ({"M": 1}, {"M": 4}, {"M": 16})
_MLA_CONTEXTS = ({"context": 32768}, {"context": 131072})
_MXFP4_TP1 = {"expert_format": "mxfp4"}

# the dense boundary's shape names at K3 (the same names at every tp)
_DENSE_SHAPES = ("kda.q_proj", "kda.f_a_proj", "kda.beta_proj", "kda.in_proj", "kda.o_proj",
                 "mla.q_a_proj", "mla.kv_a_proj", "mla.in_proj", "mla.q_b_proj", "mla.o_proj",
                 "moe.latent_down", "moe.latent_up", "moe.shared_gate_up", "moe.shared_down",
                 "moe.router", "mlp.gate_up", "mlp.down", "lm_head")


def _gemv(block_n, block_k, split_k, num_stages, prefetch_steps) -> dict:
    return dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4,
                num_stages=num_stages, pdl=True, prefetch_steps=prefetch_steps)


def _tail(block_n, block_k, prefetch_steps=0, num_stages=3, split_k=1, num_warps=4,
          max_registers=0) -> dict:
    """A token sweep's point: the MoE tail GEMV's tiling (stack.Configs.tail); fields at
    GemvConfig's defaults (split_k, num_warps, max_registers) are left out of the point."""
    return {"tail.block_n": block_n, "tail.block_k": block_k, "tail.num_stages": num_stages,
            "tail.pdl": True, "tail.prefetch_steps": prefetch_steps,
            **({"tail.split_k": split_k} if split_k != 1 else {}),
            **({"tail.num_warps": num_warps} if num_warps != 4 else {}),
            **({"tail.max_registers": max_registers} if max_registers else {})}


def _front(block_n, block_k, num_stages) -> dict:
    """A token sweep's point: the MoE front GEMV's tiling (stack.Configs.front; the stack
    launches it by PDL, waiting for the route last)."""
    return {"front.block_n": block_n, "front.block_k": block_k, "front.num_stages": num_stages,
            "front.prefetch_steps": 0}


def _oproj(block_n, block_k, num_warps) -> dict:
    """A token sweep's point: the attention output projections' tiling (stack.Configs.o_proj;
    unrolled K steps and by PDL, as their table entry at K3 tp 8)."""
    return {"o_proj.block_n": block_n, "o_proj.block_k": block_k,
            "o_proj.num_warps": num_warps, "o_proj.num_stages": 3, "o_proj.unroll_k": True,
            "o_proj.pdl": True, "o_proj.prefetch_steps": 0}


def _down(where, block_n, block_k, num_stages=3, max_registers=0) -> dict:
    """A token sweep's point: the shared down-projection beside an expert stage
    (MoEConfig.shared_down_launch) at a tiling (stack.Configs.shared_down)."""
    return {"moe.shared_down_launch": where, "shared_down.block_n": block_n,
            "shared_down.block_k": block_k, "shared_down.num_stages": num_stages,
            "shared_down.prefetch_steps": 0,
            **({"shared_down.max_registers": max_registers} if max_registers else {})}


# the one-token tilings the tune sweep tries on every shape; kernels/dense/tuned.py picks from
# these (GemvConfig fields; literal, so the sweep also runs against a base commit's tree)
GEMV_CANDIDATES = (
    _gemv(8, 1024, 4, 4, 2), _gemv(8, 1024, 1, 4, 2), _gemv(16, 256, 1, 3, 0),
    _gemv(8, 1024, 1, 3, 0), _gemv(8, 1024, 2, 4, 2), _gemv(8, 512, 2, 5, 2),
    _gemv(16, 512, 1, 4, 2), _gemv(8, 512, 1, 5, 0), _gemv(8, 512, 1, 2, 2),
    _gemv(8, 512, 1, 3, 0), _gemv(8, 512, 1, 4, 0), _gemv(8, 512, 4, 4, 2),
    {**_gemv(8, 512, 1, 4, 0), "gate_up_together": True},
    {**_gemv(8, 512, 1, 3, 0), "unroll_k": True}, _gemv(4, 1024, 1, 4, 0))


_SWEEPS = [
    # every variant (reference, fused, peers) of each boundary at a few decode batch sizes
    *(Sweep("variants", b, _M, "every variant at M = 1, 4, 16", variants=None)
      for b in ("route", "moe", "dense", "kda", "mla", "attn_res")),

    # make_inputs parameters
    Sweep("formats", "moe", ({"expert_format": "bf16"}, {"expert_format": "mxfp4"}),
          "bf16 against MXFP4 experts, the fused block given the plan, M = 1", tp=1),
    Sweep("routed", "moe", ({"route": False}, {"route": True}),
          "the block given the plan, and routing itself (route_sort + the block)"),
    Sweep("persistent", "moe", grid(_M, ({"expert_format": "mxfp4"},)),
          "the single-launch persistent block, W4A16 and A8W4, against the 4-launch block, "
          "all with routing", variants=("fused", "persistent", "persistent_a8w4"),
          params={"route": True}, tp=8),
    Sweep("persistent_config", "moe",
          grid(({"multiply": "fma"}, {"multiply": "dot"}, {"multiply": "klane"}),
               ({}, {"programs_per_sm": 2}, {"num_warps": 8},
                {"expert_block_n": 16, "front_block_n": 16, "tail_block_n": 16},
                {"expert_block_n": 64, "front_block_n": 64, "tail_block_n": 64})),
          "the persistent block's multiply modes, grid and tile rows (W4A16, with routing)",
          variants=("persistent",), params={"route": True, "expert_format": "mxfp4"}, tp=8,
          config=("moe.persistent_config", "PersistentMoEConfig")),
    Sweep("persistent_tiles", "moe",
          grid(({"multiply": "klane"}, {"multiply": "fma"}),
               ({"expert_block_n": 8, "front_block_n": 8, "tail_block_n": 8},
                {"expert_block_n": 16, "front_block_n": 16, "tail_block_n": 16}),
               tuple({"block_k": k, "max_products": 32768} for k in (256, 512, 1024, 2048))),
          "the persistent block's K step (bytes a program has in flight) at narrow tiles "
          "(W4A16, with routing)",
          variants=("persistent",), params={"route": True, "expert_format": "mxfp4"}, tp=8,
          config=("moe.persistent_config", "PersistentMoEConfig")),
    Sweep("persistent_split", "moe",
          grid(({"multiply": "klane", "block_k": 512, "expert_block_n": 16},),
               tuple({"front_block_n": f, "tail_block_n": t}
                     for f, t in ((4, 8), (8, 8), (8, 16), (16, 16))),
               ({"stage2_block_n": 16}, {"stage2_block_n": 64})),
          "the persistent block's front and tail items against stage 2's rows apart from "
          "stage 1's (W4A16, with routing)",
          variants=("persistent",), params={"route": True, "expert_format": "mxfp4"}, tp=8,
          config=("moe.persistent_config", "PersistentMoEConfig")),
    Sweep("persistent_expert_k", "moe",
          grid(({"multiply": "klane", "block_k": 512, "front_block_n": 8, "tail_block_n": 16,
                 "stage2_block_n": 64, "max_products": 32768},),
               ({"expert_block_n": 8}, {"expert_block_n": 16}),
               tuple({"expert_block_k": k} for k in (512, 1024, 2048, 4096)))
          + ({"multiply": "klane", "block_k": 1024, "front_block_n": 8, "tail_block_n": 16,
              "stage2_block_n": 64, "max_products": 32768, "expert_block_k": 2048},),
          "the experts' K step apart from the front's and the tail's, at 8 and 16 rows "
          "(W4A16, with routing)",
          variants=("persistent",), params={"route": True, "expert_format": "mxfp4"}, tp=8,
          config=("moe.persistent_config", "PersistentMoEConfig")),
    Sweep("persistent_steps", "moe",
          grid(({"multiply": "klane", "front_block_n": 8, "tail_block_n": 16,
                 "stage2_block_n": 64, "max_products": 32768},),
               tuple({"block_k": k} for k in (512, 1024, 2048)),
               tuple({"expert_block_k": k} for k in (64, 128, 256))),
          "the front's and tail's K step against the experts' at the kept item sizes (W4A16, "
          "with routing)",
          variants=("persistent",), params={"route": True, "expert_format": "mxfp4"}, tp=8,
          config=("moe.persistent_config", "PersistentMoEConfig")),
    Sweep("persistent_a8w4", "moe",
          grid(({"multiply": "fma"},),
               ({"front_block_n": 8}, {"front_block_n": 16}),
               ({"stage2_block_n": 16}, {"stage2_block_n": 64, "max_products": 32768}))
          + ({"multiply": "klane"}, {"multiply": "klane", "stage2_block_n": 16}),
          "A8W4's item sizes (fma), and the K-lane GEMVs quantizing as they load at W4A16's "
          "item sizes and at 16-row stage-2 items (with routing)",
          variants=("persistent_a8w4",), params={"route": True, "expert_format": "mxfp4"},
          tp=8, config=("moe.persistent_config", "PersistentMoEConfig")),
    Sweep("persistent_overlap", "moe",
          grid(({"multiply": "klane"},), ({"overlap_route": False}, {"overlap_route": True})),
          "the persistent launch started after route_sort against while it runs (W4A16, with "
          "routing)",
          variants=("persistent",), params={"route": True, "expert_format": "mxfp4"}, tp=8,
          config=("moe.persistent_config", "PersistentMoEConfig")),
    Sweep("persistent_route_items", "moe",
          grid(({"multiply": "klane"},), ({}, {"route_items": True},
                                           {"route_items": True, "programs_per_sm": 3},
                                           {"route_items": True, "max_registers": 128})),
          "route_sort's programs as the persistent launch's first work items (one launch for "
          "the block with routing) against route_sort's own launch overlapping it (W4A16); "
          "the route's registers leave 3 programs an SM (offline), so also a grid of 3 an SM "
          "and a cap of 128 registers",
          variants=("persistent",), params={"route": True, "expert_format": "mxfp4"}, tp=8,
          config=("moe.persistent_config", "PersistentMoEConfig")),
    Sweep("front_overlap", "moe",
          ({"front_routes": False, "front_overlaps_route": False},
           {"front_routes": False, "front_overlaps_route": True, "front_triggers_last": False},
           {"front_routes": False, "front_overlaps_route": True, "front_triggers_last": True}),
          "with route_sort and the dense front as two launches: the front launched after "
          "route_sort against while it runs, and then letting the expert pair start (by PDL) "
          "only after its wait for the route (fused+dense, with routing)",
          variants=("fused+dense",), params={"route": True, "expert_format": "mxfp4"}, tp=8),
    Sweep("shared_beside", "moe",
          grid(({"M": 1}, {"M": 4}), ({}, {"shared_beside_stage1": True})),
          "the shared experts' gate/up in the front launch (with the router's, by default) "
          "against a launch of its own between the expert stages, overlapping stage 1 (the "
          "front then the latent down alone, overlapping route_sort; fused+dense, with "
          "routing)",
          variants=("fused+dense",), params={"route": True, "expert_format": "mxfp4"}, tp=8),
    Sweep("front_routes", "moe",
          grid(({"M": 1}, {"M": 4}),
               ({"front_routes": False}, {"front_route_registers": 0}, {})),
          "route_sort's programs and the dense front's in one launch (front_route: 4 launches "
          "with routing; the default, its registers capped at 96) against the front "
          "overlapping route_sort in a launch of its own, and the one launch uncapped "
          "(fused+dense, with routing)",
          variants=("fused+dense",), params={"route": True, "expert_format": "mxfp4"}, tp=8),
    Sweep("shared_down", "moe",
          grid(({"M": 1}, {"M": 4}), ({}, {"shared_down_launch": "stage1"},
                                       {"shared_down_launch": "stage2"})),
          "the shared down-projection's GEMV programs in stage 1's or stage 2's launch, the "
          "tail adding their fp32 result (MoEConfig.shared_down_launch), against the tail's "
          "second product (fused+dense, with routing: the front in the route's launch)",
          variants=("fused+dense",), params={"route": True, "expert_format": "mxfp4"}, tp=8),
    Sweep("tail_first", "moe",
          grid(({"M": 1}, {"M": 4}), ({}, {"tail_second_first": True})),
          "the tail's shared down-projection before its PDL wait, overlapping stage 2's end "
          "(MoEConfig.tail_second_first) against after its latent up (fused+dense, with "
          "routing: the front in the route's launch)",
          variants=("fused+dense",), params={"route": True, "expert_format": "mxfp4"}, tp=8),
    Sweep("pdl", "route", grid(({"M": 1}, {"M": 4}), ({}, {"pdl": True})),
          "the route launched by PDL (its launch overlapping the previous grid's end; it waits "
          "for it before any read) against a plain launch"),
    Sweep("block_m", "route", ({"M": 16, "block_m": 1}, {"M": 16, "block_m": 4},
                               {"M": 16, "block_m": 16}),
          "plan tile height (entries of one expert a tile) at 16 tokens"),
    Sweep("context", "mla", ({"context": 32768}, {"context": 65536}, {"context": 131072}),
          "the split heuristic's choice at the contexts the MLA bar is set at"),
    Sweep("splits", "mla", grid(({"context": 32768},),
                                ({"num_splits": None}, {"num_splits": 66},
                                 {"num_splits": 132}, {"num_splits": 264})),
          "fixed split counts against the heuristic (None) at 32k"),
    Sweep("sealed", "attn_res", ({"n_sealed": 0}, {"n_sealed": 4}, {"n_sealed": 8}),
          "bank rows read (depth of the AttnRes read)"),

    # config fields (docs/decisions.md has what each default rests on); {} is the defaults
    Sweep("gemv", "route", ({}, {"gemv_row_splits": 1}, {"gemv_row_chunk": 1024},
                            {"gemv_row_programs": 264}, {"gemv_row_programs": 0},
                            {"gemv_row_splits": 4},
                            {"gemv_row_programs": 66, "gemv_row_splits": 4}),
          "B1 gate GEMV: row programs (splits, chunk, count) against split-K tiles (0)"),
    Sweep("select", "route", ({}, {"scalar_keys": False}, {"cand_cache": ".cg"},
                              {"candidates_per_slot": 4}),
          "the selection: scalar keys, candidate read-back from L2, 4 candidate slots"),
    Sweep("warps", "route", ({"num_warps": 2}, {"num_warps": 4}, {"num_warps": 8}),
          "warps of every route program"),
    Sweep("spread", "route", grid(({"M": 8}, {"M": 16}, {"M": 32}, {"M": 64}),
                                  ({"select_programs_min_tokens": 0,
                                    "register_sort_max_entries": 0},
                                   {"register_sort_max_entries": 0},
                                   {"select_programs_min_tokens": 0}, {})),
          "the selection in the GEMV launch's last program against its own launch of one "
          "program per token block (the default); the sort metadata by pairwise passes in "
          "memory against the register sort (the default)", variants=("fused", "reference")),
    Sweep("gemv_dot", "route", grid(({"M": 2}, {"M": 4}, {"M": 16}, {"M": 64}),
                                    ({"gemv_dot_min_tokens": 0}, {"gemv_dot_min_tokens": 2},
                                     {"gemv_dot_min_tokens": 2, "gemv_dot_k": 64},
                                     {"gemv_dot_min_tokens": 2, "gemv_dot_k": 256})),
          "the split-K gate GEMV of several tokens: each token in turn on the CUDA cores "
          "(gemv_dot_min_tokens 0) against tensor-core products of 16 tokens at a time (on by "
          "default from 4 tokens), in 64- to 256-wide K steps",
          variants=("fused", "reference")),
    Sweep("tiles", "moe", ({}, {"stage1_mma_tile": (2, 1, 1)}, {"stage1_mma_tile": (2, 2, 1)},
                           {"stage1_mma_tile": (2, 4, 1)}, {"stage2_mma_tile": (2, 1, 1)},
                           {"stage2_mma_tile": (2, 2, 1)}, {"stage2_mma_tile": (2, 2, 2)},
                           {"stage2_mma_tile": (1, 1, 1)}),
          "tensor-core tiles (R, WARPS_K, L2 prefetch distance) of MXFP4 stages 1 and 2 "
          "against the rule's pick ({})", params=_MXFP4_TP1, tp=1),
    Sweep("mma_tiles", "moe",
          ({},) + tuple({"stage1_mma_tile": t} for t in (
              (2, 4, 0), (2, 4, 1), (2, 4, 2), (2, 4, 3), (2, 2, 1), (2, 2, 2), (2, 1, 2)))
          + tuple({"stage2_mma_tile": t} for t in (
              (2, 1, 0), (2, 1, 2), (1, 1, 1), (1, 2, 1), (2, 2, 0), (2, 2, 2), (2, 2, 3),
              (2, 4, 1), (1, 4, 1))),
          "tensor-core tiles (R, WARPS_K, L2 prefetch distance) of MXFP4 stages 1 and 2 at a "
          "tp 8 shard, where an expert's rows are few: the block given the plan",
          params={"expert_format": "mxfp4"}, tp=8),
    Sweep("pdl", "moe", ({"pdl": True}, {"pdl": False}),
          "programmatic dependent launch on and off, MXFP4", params=_MXFP4_TP1, tp=1),
    Sweep("evict", "moe", ({}, {"stage2_evict_first": False}, {"stage1_evict_first": True}),
          "evict_first loads of each stage's MXFP4 expert weights", params=_MXFP4_TP1, tp=1),
    Sweep("mxfp4", "moe", ({}, {"x_prepared": False}, {"tiled_weights": False},
                           {"mma": False}),
          "MXFP4 paths: prepared activations, tiled layout, tensor-core against K-lane tiles",
          params=_MXFP4_TP1, tp=1),
    Sweep("projections", "moe", grid(({"M": 1}, {"M": 4}, {"M": 16}),
                                     ({"dense_projections": False},
                                      {"dense_projections": True})),
          "the block's dense projections in the MoE front/tail kernels against dense GEMV "
          "launches, MXFP4 with routing", params={"expert_format": "mxfp4", "route": True},
          tp=8),
    Sweep("score", "mla", grid(_MLA_CONTEXTS, ({}, {"score_chunks": 1}, {"score_chunks": 2},
                                               {"defer_row_sum": False},
                                               {"score_chunks": 1, "defer_row_sum": False})),
          "the split kernel's score chunks and deferred row sum at 32k and 128k"),
    Sweep("tiles", "mla", grid(_MLA_CONTEXTS, ({}, {"block_n": 32, "num_stages": 4},
                                               {"num_warps": 8}, {"programs_per_sm": 2})),
          "split-kernel tiles (64 / 4 / 3 default, 32 / 4 / 4, 8 warps), two splits an SM"),
    Sweep("pdl", "mla", grid(_MLA_CONTEXTS, ({}, {"combine_pdl": False}, {"split_pdl": True})),
          "programmatic dependent launch of the combine, and of the split kernel"),
    Sweep("split_k", "dense", grid(({"shape": "kda.in_proj"}, {"shape": "moe.latent_up"},
                                    {"shape": "lm_head"}),
                                   ({}, *({"block_n": 16, "block_k": 512, "split_k": k}
                                          for k in (1, 2, 4, 8)))),
          "K split of the B1 GEMV at 16 x 512 tiles against the per-shape default ({})"),
    Sweep("gate_up", "dense", tuple(
        {"shape": shape, **_gemv(*tiling), "gate_up_together": together}
        for shape, tilings in (
            ("moe.shared_gate_up", ((8, 512, 2, 5, 2), (8, 512, 1, 4, 0), (8, 1024, 2, 4, 2),
                                    (8, 256, 2, 5, 2), (8, 512, 4, 4, 2))),
            ("mlp.gate_up", ((8, 1024, 1, 3, 0), (8, 512, 1, 3, 0), (8, 512, 1, 4, 0))))
        for tiling in tilings for together in (False, True)),
          "gate/up shapes: the gate and up rows in one K loop against one loop each, at the "
          "table's tilings and a few others"),
    Sweep("tall", "dense", tuple(
        {"shape": shape, **_gemv(*tiling), **extra}
        for shape in ("kda.o_proj", "moe.latent_up", "mlp.down")
        for tiling, extra in (((16, 256, 1, 3, 0), {}), ((16, 256, 1, 4, 0), {}),
                              ((16, 256, 1, 2, 0), {}), ((16, 512, 1, 3, 0), {}),
                              ((16, 128, 1, 4, 0), {}), ((32, 256, 1, 3, 0), {}),
                              ((32, 256, 1, 3, 0), {"num_warps": 8}),
                              ((16, 512, 1, 3, 0), {"num_warps": 8}),
                              ((8, 512, 1, 3, 0), {}), ((16, 256, 1, 3, 2), {}))),
          "7168-row shapes over a short K (o_proj, latent up, dense MLP down): tile rows, "
          "K step, stages and warps around the table's 16 x 256"),
    Sweep("unroll", "dense", tuple(
        {"shape": shape, **(_gemv(*tiling) if tiling else {}), **extra}
        for shape in ("kda.o_proj", "moe.shared_down", "mlp.down")
        for tiling, extra in ((None, {}), *(
            ((n, k, 1, 3, 0), {"unroll_k": unroll})
            for n, k in ((8, 256), (8, 512), (16, 256)) for unroll in (False, True)))),
          "a K share's steps unrolled (every step's loads independent, no shared-memory "
          "pipeline) against the same tiling pipelined over 3 stages and the per-shape table "
          "({}), on the 7168-row short-K shapes (run at --tp 8 and --tp 16)"),
    Sweep("rows4", "dense", grid(
        tuple({"shape": n} for n in ("kda.q_proj", "moe.shared_gate_up", "mla.kv_a_proj",
                                     "moe.router", "mla.in_proj", "kda.in_proj",
                                     "moe.latent_down")),
        ({}, _gemv(4, 512, 1, 5, 0), _gemv(4, 1024, 1, 4, 0), _gemv(4, 2048, 1, 3, 0))),
          "4-row tiles on the K = 7168 shapes (twice the programs of the table's 8 rows, no "
          "split-K reduction: a finer grain for the last wave) against the per-shape table"),
    Sweep("tune", "dense", grid(tuple({"shape": n} for n in _DENSE_SHAPES),
                                ({}, *GEMV_CANDIDATES)),
          "every K3 projection shape, M = 1: the per-shape default ({}: the measured table, "
          "else the rule) against each candidate tiling the table picks from; run at --tp 8 "
          "and --tp 16 to re-tune kernels/dense/tuned.py"),
    Sweep("fp8", "dense", grid(({"shape": "moe.latent_up"}, {"shape": "moe.latent_down"},
                                {"shape": "kda.o_proj"}),
                               ({}, {"weight_format": "e4m3"})),
          "e4m3 weights with fp32 row scales (the seed's FP8 latent tail, #18) against bf16, "
          "each at its default tiling (e4m3: its own table's, else the bf16 tiling at twice its "
          "columns): half the weight bytes, a wider conversion per byte",
          variants=("fused", "reference")),
    Sweep("fp8_tiles", "dense", grid(
        tuple({"shape": n, "weight_format": "e4m3"}
              for n in ("moe.latent_up", "kda.o_proj", "moe.latent_down")),
        ({}, _gemv(16, 256, 1, 3, 0), {**_gemv(8, 512, 1, 3, 0), "unroll_k": True},
         _gemv(8, 512, 1, 3, 0), _gemv(16, 512, 1, 4, 0), _gemv(16, 1024, 1, 3, 0),
         _gemv(8, 1024, 1, 3, 0), _gemv(8, 2048, 1, 3, 0), _gemv(32, 512, 1, 3, 0),
         {**_gemv(8, 1024, 1, 3, 0), "unroll_k": True})),
          "e4m3 weights: the default ({}: TUNED_M1_E4M3's tiling, else the bf16 tiling at twice "
          "its columns) against the bf16 tilings of the three shapes (16 x 256, 8 x 512 "
          "unrolled, 8 x 512: half the bytes a step) and other wide steps; picks the e4m3 "
          "table of kernels/dense/tuned.py"),
    Sweep("fp8_split", "dense", grid(
        ({"shape": "moe.latent_up", "weight_format": "e4m3"},),
        ({}, _gemv(32, 512, 1, 3, 0), _gemv(32, 512, 2, 3, 0), _gemv(16, 512, 2, 4, 0),
         _gemv(32, 256, 2, 4, 0), _gemv(32, 512, 4, 3, 0), _gemv(64, 256, 1, 3, 0),
         _gemv(64, 256, 2, 3, 0))),
          "the e4m3 latent up (the FP8 tail's [7168, 3584]): 32 x 512 tiles (its table's "
          "tiling then) make 224 programs, 2 on 92 of the H200's 132 SMs and 1 on the rest; "
          "split K (448 to 896 programs) and 64-row tiles (112) against them, and the table's "
          "tiling now ({})"),
    Sweep("fp8_warps", "dense", grid(
        ({"shape": "moe.latent_up", "weight_format": "e4m3"},),
        ({}, _gemv(32, 512, 1, 3, 0), {**_gemv(32, 512, 1, 3, 0), "num_warps": 8},
         {**_gemv(32, 512, 1, 3, 0), "num_warps": 8, "max_registers": 128},
         {**_gemv(16, 512, 1, 3, 0), "max_registers": 128}, _gemv(16, 512, 1, 3, 0),
         {**_gemv(32, 256, 1, 3, 0), "max_registers": 128})),
          "the e4m3 latent up with more warps an SM: 32 x 512 tiles take 255 registers (two "
          "programs an SM, 8 warps); at 8 warps 160 (one an SM) or capped at 128 (two, 16 "
          "warps; 8 bytes of spills); 16 x 512 capped at 128 (four an SM: 448 programs in one "
          "wave; 135 uncapped; the table's tiling since this sweep, {}); 32 x 256 capped at "
          "128 (offline sm_90 registers)"),
    Sweep("fusions", "kda", ({}, {"block_v": 16}, {"block_v": 64}, {"block_v": 128}),
          "the whole decode (conv, core, out gate) in one launch: v-tiles meeting through "
          "tickets (the default and 16 / 64 wide) against a whole head a program (128)",
          variants=("fused+conv+out_gate",)),
    Sweep("pdl", "kda", ({}, {"pdl": True}),
          "the decode launched by PDL (its launch overlapping the previous grid's end; it waits "
          "for it before any read) against a plain launch: the core, and the whole decode",
          variants=("fused", "fused+conv+out_gate")),
    Sweep("tiles", "kda", ({}, {"min_block_v": 16}, {"block_v": 64}, {"block_r": 32},
                           {"block_r": 128}, {"max_warps": 4}),
          "v-tile width, f_b rank chunk, warps"),
    Sweep("tiles", "attn_res", grid(({"n_sealed": 0}, {"n_sealed": 8}),
                                    ({}, {"tile_elems": 16384}, {"num_warps": 4},
                                     {"num_warps": 16})),
          "bank tile elements and warps at 0 and 8 sealed rows"),
    Sweep("split", "attn_res", grid(({"n_sealed": 0}, {"n_sealed": 2}, {"n_sealed": 4},
                                     {"n_sealed": 8}),
                                    ({}, {"split_h": 0}, {"split_min_candidates": 1},
                                     {"split_h": 256, "split_min_candidates": 1},
                                     {"split_h": 1024, "split_min_candidates": 1},
                                     {"split_warps": 8, "split_min_candidates": 1},
                                     {"split_pdl": False, "split_min_candidates": 1})),
          "split schedule (programs of split_h columns over two launches) against one program "
          "a token (split_h 0) and the default depth rule ({}), at 0, 2, 4 and 8 sealed rows"),
    Sweep("one_chunk", "attn_res", grid(tuple({"n_sealed": n} for n in range(5)),
                                        ({}, {"split_h": 0},
                                         {"split_h": 0, "one_chunk_elems": 0},
                                         {"split_h": 0, "one_chunk_elems": 32768},
                                         {"split_min_candidates": 1})),
          "shallow reads (1 to 5 candidates): one program holding the rows in registers from "
          "the scores to the norm (one_chunk_elems, 16384 default, 32768 wider, 0 off) against "
          "the split and the default depth rule ({})"),
    Sweep("pdl", "attn_res", grid(({"n_sealed": 0}, {"n_sealed": 1}, {"n_sealed": 2}),
                                  ({"pdl": False}, {"pdl": True})),
          "the one-program read by programmatic dependent launch (weights loaded before the "
          "wait; the default) against a plain launch, at 1 to 3 candidates"),
    Sweep("bank_early", "attn_res", (
        *({"n_sealed": n, **c} for n in (0, 1, 2)
          for c in ({}, {"one_chunk_min_candidates": 1},
                    {"one_chunk_min_candidates": 1, "bank_before_wait": True})),
        *({"n_sealed": n, **c} for n in (3, 8) for c in ({}, {"bank_before_wait": True}))),
          "the sealed bank rows (and the split's score weight) loaded before the PDL wait, "
          "live after it, against the defaults (every candidate after the wait), at 1 to 4 and "
          "9 candidates; below 3 candidates the one-pass read alone and with it"),
    Sweep("one_pass_deep", "attn_res", grid(
        ({"n_sealed": 3}, {"n_sealed": 4}),
        tuple({**early, **one} for early in ({}, {"bank_before_wait": True})
              for one in ({}, {"one_chunk_elems": 32768, "split_min_candidates": 6}))),
          "4 and 5 candidates in one pass (a 32768-element tile, rows held in registers: 242 "
          "registers at 8 warps, no spills in an offline sm_90 build) against the split, with "
          "and without the sealed rows before the PDL wait"),
    Sweep("tokens", "attn_res", grid(({"M": 4}, {"M": 16}, {"M": 64}),
                                     ({}, {"split_h": 0}, {"max_split_programs": 8})),
          "the split schedule (by default while its grid is at most one program an SM) and one "
          "program a token at 4, 16 and 64 tokens"),

    # the whole decode token (benchmarks/token.py): "<stack.Configs field>.<config field>"
    # keys, the first point {} (the decode step's own configs)
    Sweep("tail", "token", ({}, _tail(16, 256), _tail(16, 512), _tail(8, 512), _tail(32, 512),
                            _tail(32, 512, 2), _tail(32, 512, 4), _tail(32, 512, 7)),
          "the MoE tail's GEMV tiling in the full stack's token (the e4m3 tail: its own "
          "table's by default, {}; 16 x 256 is the bf16 tail's), and its weights' first "
          "steps asked of L2 before its PDL wait", variants=("full stack",), tp=8),
    Sweep("tail_split", "token", ({}, _tail(32, 512), _tail(32, 512, split_k=2),
                                  _tail(16, 512, 0, 4, 2), _tail(64, 256)),
          "the e4m3 MoE tail's GEMV in the full stack's token: 32 x 512 tiles (224 programs) "
          "against split K (448, 896) and 64-row tiles (112), and its table's tiling ({})",
          variants=("full stack",), tp=8),
    Sweep("tail_warps", "token", ({}, _tail(32, 512),
                                  _tail(32, 512, num_warps=8, max_registers=128),
                                  _tail(16, 512, max_registers=128)),
          "the e4m3 MoE tail's GEMV in the full stack's token with more warps an SM: 32 x 512 "
          "at 8 warps capped at 128 registers, 16 x 512 capped at 128 (dense --sweep "
          "fp8_warps; its table's tiling, {}, since), against 32 x 512 at 4 warps",
          variants=("full stack",), tp=8),
    Sweep("tail_cap", "token", ({}, {"moe.tail_second_first": True}, _tail(32, 512),
                                {**_tail(32, 512), "moe.tail_second_first": True}),
          "the e4m3 MoE tail at its table's 16 x 512 capped at 128 registers (four programs an "
          "SM; {}) and at 32 x 512 (two an SM), each with and without its shared down before "
          "its PDL wait (which spills 24 bytes at 128 registers)",
          variants=("full stack",), tp=8),
    Sweep("mla", "token", ({}, {"num_splits": 32}, {"num_splits": 64},
                           {"mla.absorb_pdl": False}, {"mla.split_pdl": True}),
          "the MLA layer's launches in the full stack's token at 8k context: the graph's fixed "
          "split count (the kernel's own at the longest context served, "
          "decode_step.split_override: one split an SM; {}) against 32 and 64 (the kernel's "
          "own at 8k); the two absorb kernels plain (MLAConfig.absorb_pdl, on by default) and "
          "the split kernel by PDL too", variants=("full stack",), tp=8),
    Sweep("reads", "token", ({}, {"attn_res.split_min_candidates": 5},
                             {"read_sums": True},
                             {"read_sums": True, "read_sums_registers": 0},
                             {"read_sums": True, "attn_res.split_h": 1024},
                             {"read_sums": True, "attn_res.split_h": 256}),
          "the AttnRes reads of the full stack's token (the centred window's read 4 to 6 "
          "candidates): the one program a token up to 5 candidates ({}) against the split "
          "schedule from 5, and the FFN reads from the sums the output projection left "
          "(stack.Configs.read_sums; the projection capped at 72 registers or not), their "
          "mix in programs of 512, 1024 or 256 columns",
          variants=("full stack",), tp=8),
    Sweep("kda_rms", "token",
          ({}, {"kda_rms_in_o_proj": True}, {"kda.early_ticket": True},
           {"kda_rms_in_o_proj": True, "kda.early_ticket": True},
           {"kda_rms_in_o_proj": True, "kda.early_ticket": True, "kda.pdl": True},
           _oproj(16, 256, 4), _oproj(8, 512, 8),
           {"kda_rms_in_o_proj": True, "kda.early_ticket": True, **_oproj(16, 256, 4)},
           {"kda_rms_in_o_proj": True, "kda.early_ticket": True, **_oproj(8, 512, 8)}),
          "the KDA decode's v-tiles without their meeting at the end: the output gate's "
          "per-head RMS in the output projection's prologue (stack.Configs.kda_rms_in_o_proj) "
          "and the conv caches' ticket taken as soon as they are read (KDAConfig.early_ticket), "
          "apart and together (and the decode by PDL); with the output projections at 16 x 256 "
          "or 8 x 512 at 8 warps (stack.Configs.o_proj), whose registers keep one wave with the "
          "prologue where the table's 8 x 512 at 4 warps loses it, with and without it",
          variants=("full stack",), tp=8),
    Sweep("read_in_consumer", "token",
          ({}, {"ffn_read_in_front": True},
           {"ffn_read_in_front": True, "moe.front_route_registers": 112},
           {"attn_read_in_proj": True},
           {"ffn_read_in_front": True, "attn_read_in_proj": True},
           {"ffn_read_in_front": True, "attn_read_in_proj": True, "attn_read_registers": 0},
           {"ffn_read_in_front": True, "attn_read_in_proj": True, "in_proj_prefetch": 2},
           {"ffn_read_in_front": True, "attn_read_in_proj": True, "kda_rms_in_o_proj": True,
            "kda.early_ticket": True}),
          "the AttnRes reads without a launch: the dense GEMV before each leaves its sums and "
          "its consumer mixes its input from them, the FFN read in the MoE front's fused "
          "launch (stack.Configs.ffn_read_in_front), the attention read past a block's first "
          "layer in the merged input projection (attn_read_in_proj), apart and together, "
          "against each read's own launch ({}); the fused front at 112 registers (96 by "
          "default: the mix adds spills, offline), the input projection uncapped (145-156 "
          "registers, 3 programs an SM; capped at 128 by default) or asking L2 for its first "
          "2 weight steps before its wait (1 by default), and beside the KDA decode's deferred "
          "RMS", variants=("full stack",), tp=8),
    Sweep("read_in_front_tiles", "token",
          ({}, {"ffn_read_in_front": True},
           {"ffn_read_in_front": True, "moe.front_route_registers": 128},
           {"ffn_read_in_front": True, **_front(4, 512, 4)},
           {"ffn_read_in_front": True, **_front(4, 512, 4), "moe.front_route_registers": 112},
           {"ffn_read_in_front": True, **_front(8, 512, 3)},
           {"ffn_read_in_front": True, **_front(4, 256, 4)}),
          "the FFN read mixed by the MoE front's fused launch at other front tiles and "
          "register caps: each K step mixes its columns of every candidate row, so shorter "
          "steps hold fewer of them (offline, the default 4 x 1024 tiles at 96 registers spill "
          "424 bytes mixing 4 sealed rows)", variants=("full stack",), tp=8),
    Sweep("prefetch", "token",
          ({}, {"kda.pdl": True}, {"kda.pdl": True, "o_proj_prefetch": 3},
           {"kda.pdl": True, "o_proj_prefetch": 1}, {"o_proj_prefetch": 3},
           {"in_proj_prefetch": 1}, {"in_proj_prefetch": 2},
           {**_front(4, 1024, 4), "front.prefetch_steps": 1},
           {**_front(4, 1024, 4), "front.prefetch_steps": 2},
           {"kda.pdl": True, "o_proj_prefetch": 3, "in_proj_prefetch": 1}),
          "weights asked of L2 before a projection's PDL wait in the full stack's token, while "
          "the launch before it runs: the attention's output projections (all 3 of o_proj's "
          "K steps at tp 8, or 1; the KDA decode by PDL lets its projection start early, the "
          "MLA v absorb always does), the merged input projections' first 1 or 2 steps during "
          "the AttnRes read, the MoE front's during the FFN read; against their tilings' none "
          "({})", variants=("full stack",), tp=8),
    Sweep("prefetch_mix", "token",
          ({}, {"in_proj_prefetch": 1},
           {"in_proj_prefetch": 1, "kda.pdl": True, "o_proj_prefetch": 1},
           {"in_proj_prefetch": 1, "o_proj_prefetch": 1},
           {"in_proj_prefetch": 1, "kda.pdl": True, "o_proj_prefetch": 2},
           {"kda.pdl": True, "o_proj_prefetch": 1},
           _tail(16, 512, 1, max_registers=128), _tail(16, 512, 2, max_registers=128),
           {"in_proj_prefetch": 1, "kda.pdl": True, "o_proj_prefetch": 1,
            **_tail(16, 512, 1, max_registers=128)}),
          "the prefetch sweep's gains together: the merged input projections' first step, "
          "the output projections' first 1 or 2 (the KDA decode by PDL or not), the e4m3 MoE "
          "tail's first 1 or 2 on its table's tiling (16 x 512 at 128 registers)",
          variants=("full stack",), tp=8),
    Sweep("shared_down", "token",
          ({}, {"moe.shared_down_launch": "tail", "moe.tail_second_first": False},
           {"moe.tail_second_first": False},
           {**_down("stage1", 32, 128), "moe.tail_second_first": True},
           {**_down("stage1", 8, 512), "moe.tail_second_first": True},
           {**_down("stage1", 16, 128), "moe.tail_second_first": True},
           {"moe.shared_down_launch": "stage2"}, _down("stage2", 8, 512)),
          "the shared down-projection and the residual in stage 1's launch (after its tiles; "
          "the token's choice, decode_step.TOKEN_MOE, the tail loading their sum before its "
          "wait: tail_second_first) at other tilings (16 x 256 over 3 stages unless "
          "Configs.shared_down sets them), after the tail's wait, in stage 2's launch (its "
          "programs first, running while stage 1 does), or as the tail's second product",
          variants=("full stack",), tp=8),
    Sweep("front_routes", "token",
          ({}, {"moe.front_routes": False}, {"moe.front_routes": False, **_front(8, 512, 3)},
           {"moe.front_route_registers": 0}, {"moe.front_route_registers": 80},
           _front(4, 512, 4), {**_front(4, 512, 4), "moe.front_route_registers": 80},
           _front(8, 512, 3), _front(4, 1024, 3)),
          "route_sort's programs and the MoE front's in one launch (MoEConfig.front_routes, "
          "the default: 4-row front tiles over 1024-column steps, 4 stages, 96 registers) in "
          "the full stack's token, against the two launches (the front at the fused launch's "
          "tiles, its default, and at the dense rule's 8 x 512), other register caps (none: "
          "128 at K3 in an offline sm_90 build; 80: 68 bytes of spills) and other front "
          "tiles (4 x 512: 88 registers uncapped)", variants=("full stack",), tp=8),
]


SWEEPS: dict[tuple[str, str], Sweep] = {(s.boundary, s.name): s for s in _SWEEPS}


def names(boundary: str | None = None) -> list[tuple[str, str]]:
    return sorted(k for k in SWEEPS if boundary is None or k[0] == boundary)


def get(boundary: str, name: str) -> Sweep:
    try:
        return SWEEPS[(boundary, name)]
    except KeyError:
        have = [n for b, n in names(boundary)]
        raise SweepError(f"sweep: {boundary} has no sweep {name!r}; expected one of {have}"
                       ) from None
