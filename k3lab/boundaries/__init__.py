"""The boundary registry.

A :class:`Boundary` is data, not a script: its name, the decode-step ops it owns
(``k3lab.ops``), an input builder from (preset, device, seed), its variants (the unfused
reference, the fused kernel, public peers) and a correctness check. The same object feeds the
tests, the notebooks, the profiler and the stack composer.

Each ``k3lab/boundaries/<name>.py`` defines one ``BOUNDARY``; :func:`get` and :func:`all_boundaries`
discover them, in :data:`ORDER`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from k3lab.config import Preset

__all__ = ["ORDER", "Variant", "Boundary", "get", "all_boundaries", "names", "clone_inputs",
           "compiled", "max_abs_err", "assert_close"]

ROLES = ("reference", "fused", "peer")
# The registry's order, the same as the boundaries' notebooks (10_route, 20_moe, 30_dense,
# 40_kda, 50_mla, 60_attn_res): tables and plots over all boundaries list them this way.
ORDER = ("route", "moe", "dense", "kda", "mla", "attn_res")


@dataclass(frozen=True)
class Variant:
    """One way to run a boundary.

    fn: ``fn(inputs) -> outputs``, inputs being the dict from ``Boundary.make_inputs``.
    role: "reference" (the unfused truth), "fused" (ours) or "peer" (what a user would pick
        instead: torch.compile, a library kernel).
    devices: device types it runs on ("cpu", "cuda").
    requires: importable modules it needs (a peer library); missing ones make it unavailable.
    """

    name: str
    role: str
    fn: Callable[[dict], Any]
    description: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")
    requires: tuple[str, ...] = ()

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {self.role!r}")

    def unavailable(self, device: torch.device | str) -> str | None:
        """Why this variant cannot run on ``device``, or None when it can."""
        dev = torch.device(device).type
        if dev not in self.devices:
            return f"{self.name} runs on {'/'.join(self.devices)} only"
        for mod in self.requires:
            try:
                importlib.import_module(mod)
            except Exception as exc:  # noqa: BLE001 - any import failure means unavailable
                return f"{self.name} needs {mod} ({type(exc).__name__}: {exc})"
        return None


@dataclass(frozen=True)
class Boundary:
    """A fused boundary of the decode step.

    make_inputs: ``(cfg, device, seed, **params) -> dict`` of everything the variants read.
    check: ``(out, ref, inputs) -> {field: max abs error}``; raises AssertionError naming the
        field and tolerance when the outputs disagree.
    bytes_moved: ``inputs -> int``, the bytes the boundary must read and write at least (the
        roofline numerator).
    params: the extra keyword parameters make_inputs accepts, with defaults (for notebooks).
    """

    name: str
    title: str
    owns: tuple[str, ...]
    make_inputs: Callable[..., dict]
    variants: tuple[Variant, ...]
    check: Callable[[Any, Any, dict], dict]
    bytes_moved: Callable[[dict], int]
    params: dict = field(default_factory=dict)
    applies: Callable[[Preset], bool] = lambda cfg: True

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"variant: {self.name} has no variant {name!r}; "
                       f"expected one of {[v.name for v in self.variants]}")

    @property
    def reference(self) -> Variant:
        return next(v for v in self.variants if v.role == "reference")

    def available_variants(self, device) -> list[Variant]:
        return [v for v in self.variants if v.unavailable(device) is None]


def clone_inputs(inputs: Any) -> Any:
    """Deep copy of an inputs dict: tensors cloned (same device), dataclasses and containers
    copied, everything else shared. Used so a variant that updates state in place (KDA) does not
    disturb the next one."""
    if isinstance(inputs, torch.Tensor):
        return inputs.clone()
    if isinstance(inputs, dict):
        return {k: clone_inputs(v) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(clone_inputs(v) for v in inputs)
    if dataclasses.is_dataclass(inputs) and not isinstance(inputs, type):
        return dataclasses.replace(inputs, **{f.name: clone_inputs(getattr(inputs, f.name))
                                              for f in dataclasses.fields(inputs) if f.init})
    return copy.copy(inputs) if isinstance(inputs, (Preset,)) else inputs


# A peer recompiles for every input signature it meets (a dense sweep's 54 shapes: 54 graphs of
# one function). Past Dynamo's own limit (8) it would run the function eagerly while its figures
# still say torch.compile; the peers raise the limit and make hitting it an error instead.
PEER_RECOMPILE_LIMIT = 128


def _peer_dynamo_limits() -> None:
    import torch._dynamo.config as dynamo

    dynamo.recompile_limit = max(dynamo.recompile_limit, PEER_RECOMPILE_LIMIT)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit,
                                             2 * PEER_RECOMPILE_LIMIT)
    dynamo.fail_on_recompile_limit_hit = True


def compiled(fn: Callable[[dict], Any], **compile_kwargs) -> Callable[[dict], Any]:
    """``torch.compile`` of a reference, compiled lazily on first call (so importing the
    registry stays cheap), with the peers' recompile limits (PEER_RECOMPILE_LIMIT)."""
    cache: dict[str, Callable] = {}

    def run(inputs: dict):
        if "fn" not in cache:
            _peer_dynamo_limits()
            cache["fn"] = torch.compile(fn, **compile_kwargs)
        return cache["fn"](inputs)

    return run


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def assert_close(name: str, actual, expected, *, atol: float, rtol: float = 0.0) -> float:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise; return the max
    abs error over the finite expected elements. A non-finite expected element passes only when
    the actual one is the same (NaN where NaN, inf of the same sign); a non-finite actual element
    where a finite one is expected fails. Numbers are taken as 0-d tensors. The message names the
    field, the tolerance and the worst element."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a, e = actual.float(), expected.float()
    e_finite = torch.isfinite(e)
    same = (torch.isnan(a) & torch.isnan(e)) | (a == e)  # the non-finite matches
    err = torch.where(e_finite, (a - e).abs(), torch.where(same, 0.0, float("inf")))
    err = torch.where(torch.isnan(err), float("inf"), err)  # finite expected, NaN actual
    bad = err > atol + rtol * torch.where(e_finite, e.abs(), 0.0)
    if bad.any():
        idx = int(err.flatten().argmax())
        raise AssertionError(
            f"{name}: max abs error {float(err.max()):.3g} exceeds atol={atol:g} rtol={rtol:g} "
            f"({int(bad.sum())} of {err.numel()} elements; worst at flat index {idx}: "
            f"{float(a.flatten()[idx]):.6g} vs {float(e.flatten()[idx]):.6g})")
    return float(err.max()) if err.numel() else 0.0


def names() -> list[str]:
    """Boundary module names found in this package, in :data:`ORDER` (the notebooks' order);
    a module not listed there comes after, by name."""
    found = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    return sorted(found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def get(name: str) -> Boundary:
    if name not in names():
        raise KeyError(f"boundary: unknown boundary {name!r}; expected one of {names()}")
    return importlib.import_module(f"{__name__}.{name}").BOUNDARY


def all_boundaries() -> list[Boundary]:
    return [get(n) for n in names()]
