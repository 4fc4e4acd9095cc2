"""Tuning choices of the dense B1 GEMV, as data."""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime import check_max_registers

__all__ = ["GemvConfig"]

_POW2 = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class GemvConfig:
    """How one GEMV launch is tiled.

    block_n: weight rows a program owns (gate/up epilogues: rows of each half).
    block_k: input columns a K step loads (block_n x block_k bf16 a step and program).
    split_k: programs sharing one row tile's K range; their fp32 partial sums meet in a
        workspace and the last program to finish a tile reduces them and runs the epilogue
        (an in-kernel reduction: no memset, no second launch).
    num_warps, num_stages: Triton launch options (num_stages pipelines the K loop's loads).
    pdl: launch with programmatic dependent launch (compiled only): a program asks L2 for its
        first ``prefetch_steps`` weight steps (weights never depend on the previous launch), then
        waits for the previous grid before it reads x.
    prefetch_steps: weight steps prefetched before that wait (pdl only; with a second product,
        its weight's first steps too).
    wait_last: (pdl only) the launch reads nothing the previous grid writes: a program lets
        the next launch start, runs, and waits for the previous grid only before it exits, so
        it overlaps a previous grid that lets its dependents start early, and its end still
        implies the previous grid's.
    trigger_last: (wait_last only) a program lets the next launch start only after its final
        wait, so that launch may read, before its own PDL wait, what the grid before this one
        wrote (the route's plan, for an expert stage after a front that overlaps the route).
    gate_up_together: with a gate/up activation, the gate and up rows stream in one K loop
        (two weight tiles a step) instead of one loop each.
    unroll_k: a K share's steps are unrolled, every step's loads independent and issued at
        once into registers (no shared-memory pipeline; num_stages unused), at most
        ``MAX_UNROLL`` steps (launcher checks); for the short-K shapes.
    max_registers: (compiled only) registers a thread at most (Triton's ``maxnreg``; 0: the
        compiler's choice), so that more programs fit an SM; a fused ``front_route`` launch
        takes its own cap instead.
    second_first: a program runs the second product (``x2 @ weight2^T``) and loads the
        residual before the first product, and, launched by PDL, before its wait for the
        previous grid: that launch's end then overlaps them. The caller guarantees that no
        launch that may still run when this one starts writes x2 or the residual (the MoE
        tail: the shared experts' activation and the layer's live sum, written before the
        expert stages, which launch plainly after the front that writes the activation).
        The sums are those of the default order. Needs a second product or a residual.
    block_n 4 and 8 serve one token only (the tensor-core path of 2..16 tokens needs 16).
    """

    block_n: int = 16
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    pdl: bool = False
    prefetch_steps: int = 2
    wait_last: bool = False
    trigger_last: bool = False
    gate_up_together: bool = False
    unroll_k: bool = False
    max_registers: int = 0
    second_first: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or v not in _POW2 or v < (4 if name == "block_n" else 16):
                raise ValueError(f"GemvConfig.{name}: expected a power of two >= "
                                 f"{4 if name == 'block_n' else 16}, got {v!r}")
        if isinstance(self.split_k, bool) or not isinstance(self.split_k, int) or not (
                1 <= self.split_k <= 64):
            raise ValueError(f"GemvConfig.split_k: expected an int in 1..64, got "
                             f"{self.split_k!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvConfig.num_warps: expected 1, 2, 4, 8 or 16, got "
                             f"{self.num_warps!r}")
        if isinstance(self.num_stages, bool) or self.num_stages not in range(1, 8):
            raise ValueError(f"GemvConfig.num_stages: expected 1..7, got {self.num_stages!r}")
        if isinstance(self.prefetch_steps, bool) or self.prefetch_steps not in range(0, 9):
            raise ValueError(f"GemvConfig.prefetch_steps: expected 0..8, got "
                             f"{self.prefetch_steps!r}")
        check_max_registers("GemvConfig.max_registers", self.max_registers)
        for name in ("pdl", "wait_last", "trigger_last", "gate_up_together", "unroll_k",
                     "second_first"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GemvConfig.{name}: expected a bool, got "
                                 f"{getattr(self, name)!r}")
        if self.trigger_last and not self.wait_last:
            raise ValueError("GemvConfig.trigger_last: expected only with wait_last=True (a "
                             "launch that waits first lets the next one start after its wait)")
