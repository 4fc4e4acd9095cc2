"""What every op of one run under a stack reads, and a projection: the dense GEMV where
the dense-gemv change owns it, else the engine's call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from k3lab.config import Preset
from k3lab.reference.dense import dense_engine

from .changes import Stack
from .configs import Configs


def _kernels():
    from k3lab import kernels
    return kernels


def _noop(_category: str) -> None:
    return None


@dataclass(frozen=True)
class _Run:
    """What every op of one run reads: the stack, the MLA split count, the launchers' configs
    and the tag callback."""

    stack: Stack
    num_splits: int = 4
    configs: Configs = Configs()
    tag: Callable[[str], None] = _noop
    record: list | None = None

    def fused(self, op: str) -> bool:
        return self.stack.fused(op)


def _linear(run: _Run, op: str, x: torch.Tensor, w: torch.Tensor, **kw):
    """A projection: the dense GEMV when ``op`` is the dense-gemv change's, else the engine's call
    (bf16 F.linear, the norm, activation or residual as separate ops)."""
    sums = kw.pop("read_sums", None)  # only where the projection is the dense GEMV's
    read = kw.pop("read_input", None)
    if run.stack.owned_by(op, "dense-gemv"):
        from k3lab.kernels.dense import dense_gemv
        config = _gemv_config(run.configs, op, x.shape[0], w, run.configs.for_op(op),
                              e4m3=kw.get("weight_scale") is not None,
                              sums=sums is not None and op in ("kda.o_proj", "mla.o_proj"),
                              read=read is not None)
        return dense_gemv(x, w, config=config, read_sums=sums, read_input=read, **kw)
    if sums is not None or read is not None:
        raise ValueError(f"stack: {op} leaves or takes an AttnRes read's sums only as the "
                         f"dense GEMV")
    return dense_engine(x, w, **kw)


def _gemv_config(configs: Configs, op: str, m: int, w: torch.Tensor, config, *,
                 e4m3: bool = False, sums: bool = False, read: bool = False):
    """The GemvConfig projection ``op`` (an ungated [rows, K] weight; ``e4m3``: with row
    scales; ``sums``: leaving an AttnRes read's sums) runs at M = m: ``config`` (None: the
    launcher's own choice), or, where ``configs`` sets L2 prefetch steps for ``op`` (then
    launched by PDL) or a register cap for the sums' producer (``read_sums_registers``), the
    tiling the launcher would take with them."""
    changes = {}
    steps = configs.prefetch_steps(op)
    if steps is not None:
        changes.update(pdl=True, prefetch_steps=steps)
    if sums and configs.read_sums_registers:
        changes["max_registers"] = configs.read_sums_registers
    if read and configs.attn_read_registers:
        changes["max_registers"] = configs.attn_read_registers
    if not changes:
        return config
    from k3lab.kernels.dense import call_config
    return replace(call_config(config, m, w.shape[0], w.shape[1], e4m3=e4m3), **changes)


def _act(cfg: Preset) -> dict:
    return dict(activation=cfg.activation, situ_beta=cfg.situ_beta,
                situ_linear_beta=cfg.situ_linear_beta)
