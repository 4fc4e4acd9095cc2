"""The notebooks' studies: what a notebook computes beyond ``profile.measure``, one module per
notebook that needs one (``overview``, ``route``, ``kda``, ``mla``, ``attn_res``,
``decode_step``), so that a notebook reads as parameters, calls, tables and plots.

:func:`setup` is every boundary notebook's first call: it prepares the device (the Triton
interpreter on the CPU, before anything imports ``k3lab.kernels``), shards the preset, finds the
boundary, shows the CPU banner and returns a :class:`Setup` the study functions take first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from k3lab import boundaries, config, precompile, profile, report
from k3lab import device as k3device
from k3lab.boundaries import Boundary
from k3lab.config import Preset

__all__ = ["Setup", "setup", "CPU_NOTE"]

CPU_NOTE = " (CPU interpreter: not GPU figures)"


@dataclass
class Setup:
    """What every study of one boundary notebook shares: the boundary, the sharded preset, the
    device, the seed, the timing repeats (None: the profiler's default) and the batch M."""

    boundary: Boundary
    cfg: Preset
    device: torch.device
    seed: int = 0
    repeats: int | None = None
    M: int = 1
    _copy_bw: float | None = field(default=None, repr=False)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def modes(self) -> tuple[str, ...]:
        """Timing modes of this device: eager, and graph on a GPU."""
        return ("eager", "graph") if self.on_gpu else ("eager",)

    @property
    def mode(self) -> str:
        """The mode a headline compares: graph on a GPU, eager on the CPU."""
        return self.modes[-1]

    @property
    def note(self) -> str:
        """A plot title's suffix: empty on a GPU, a warning on the CPU."""
        return "" if self.on_gpu else CPU_NOTE

    @property
    def copy_bw(self) -> float:
        """The device-to-device copy bandwidth (bytes/s), measured once per process."""
        if self._copy_bw is None:
            self._copy_bw = profile.copy_bandwidth(self.device)
        return self._copy_bw

    @property
    def base(self) -> dict:
        """The identifying columns of a tidy record of this study."""
        return dict(boundary=self.boundary.name, preset=self.cfg.name, tp=self.cfg.tp,
                    device=self.device.type, M=self.M)

    def copies(self, cfg: Preset | None = None, **params) -> list[dict]:
        """Cold input copies of the boundary at ``params`` (``cfg``: another preset than the
        study's), from seeds seed, seed + 1, ...: enough that one pass over them touches twice
        the L2 (one copy on the CPU), as ``profile.measure`` times."""
        cfg = cfg or self.cfg
        b = self.boundary
        make = lambda i: b.make_inputs(cfg, self.device, self.seed + i, **params)  # noqa: E731
        return profile.cold_copies(make, bytes_per_copy=b.bytes_moved(make(0)),
                                   device=self.device)

    def compile_ahead(self, calls) -> precompile.Stats:
        """Compile the Triton kernels that ``calls`` (each ``() -> Any``) launch, all at once, in
        worker processes, before a sweep makes and times them one after another
        (:func:`k3lab.precompile.ahead`, which does nothing under the interpreter)."""
        return precompile.ahead(calls)

    def fused_calls(self, points) -> list:
        """For :meth:`compile_ahead`: per ``(cfg, params)`` point, the boundary's inputs at it
        run through every fused variant."""
        b = self.boundary
        fused = [v for v in b.available_variants(self.device) if v.role == "fused"]

        def call(cfg, params):
            inputs = b.make_inputs(cfg, self.device, self.seed, **params)
            for v in fused:
                v.fn(inputs)

        return [functools.partial(call, cfg, dict(params)) for cfg, params in points]

    def describe(self) -> str:
        return (f"{self.cfg.describe()} on {k3device.device_name(self.device)}; copy bandwidth "
                f"{self.copy_bw / 1e9:.1f} GB/s")


def setup(boundary: str, preset: str, tp: int, device: str, *, seed: int = 0,
          repeats: int | None = 0, M: int = 1) -> Setup:
    """The :class:`Setup` of a boundary notebook; raises ValueError naming the presets that have
    the boundary when ``preset`` has none (``Boundary.applies``). ``repeats`` 0 or None: the
    profiler's default for the device."""
    dev = k3device.use_device(device)  # before anything imports k3lab.kernels
    cfg = config.preset(preset, tp)
    b = boundaries.get(boundary)
    if not b.applies(cfg):
        having = [n for n in config.preset_names() if b.applies(config.preset(n))]
        raise ValueError(f"preset: {cfg.name} has no {boundary} boundary; use one of {having}")
    report.cpu_banner(dev)
    return Setup(b, cfg, dev, seed=seed, repeats=repeats or None, M=M)
