"""Tuning and format choices of the persistent MoE launch, as one immutable value.

``PersistentMoEConfig()`` is what ``moe_persistent`` runs by default; a sweep or a test passes
another one as ``config=``. Nothing here is read from module globals at launch time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..route.config import RouteConfig
from ..runtime import check_max_registers

__all__ = ["PersistentMoEConfig", "ACTIVATION_FORMATS", "MULTIPLY_MODES"]

ACTIVATION_FORMATS = ("bf16", "fp8")
# fma: operands upcast to fp32, broadcast multiply and tl.sum (every format; the interpreter's
# path). dot: tl.dot on the tensor cores, bf16 operands for bf16 activations and e4m3 x e4m3
# (FP4 codes converted to e4m3 in registers, the E8M0 factor applied per 32-wide K step) for
# fp8 activations; under the interpreter the same tiles run on fp32 operands of equal value.
# (Tiles of at most 16 rows compile on sm_90 to mma.sync, Triton feeding e4m3 as f16, which
# holds every e4m3 value exactly; wgmma's native e4m3 needs 64-row tiles.)
# klane: the MoE stages' tuned K-lane GEMVs (kernels/moe/gemv.py: int32 code words, FFMA
# chains per group; MXFP4 in either layout, or bf16 experts with bf16 activations; fp8
# activations are quantized as they load and need MXFP4 experts).
# The front and the tail broadcast-multiply bf16 weights in every mode.
MULTIPLY_MODES = ("fma", "dot", "klane")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


def _check_int(name: str, value, low: int, high: int, pow2: bool = False) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    if not ok or (pow2 and value & (value - 1)):
        extra = " and a power of two" if pow2 else ""
        raise ValueError(f"{name}: expected an int in [{low}, {high}]{extra}, got {value!r}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


@dataclass(frozen=True)
class PersistentMoEConfig:
    """Choices of the single-launch MoE (kernels/moe/persistent.py).

    Attributes:
        programs_per_sm: resident programs the grid asks for per SM (the grid is
            ``num_sms * programs_per_sm``, at most the number of work items).
        deterministic: stage 2 writes each routed row's partial output and a reduce phase sums
            every token's top_k slots in slot order (bit-identical across runs); False: fp32
            atomics into the accumulator (order-dependent rounding).
        activations: "bf16" (W4A16 with MXFP4 experts) or "fp8" (A8W4: each activation row
            quantized in the kernel to e4m3 with a power-of-two per-row scale).
        multiply: "fma" or "dot" (MULTIPLY_MODES above).
        tail_fp8: the latent up-projection reads e4m3 weights with one fp32 scale per output
            channel (``fp8_rows_quantize``) instead of bf16.
        front_block_n, expert_block_n, tail_block_n: output rows a work item of the front
            (latent down, shared gate/up), of the experts (stage 1: gate rows, with their up
            rows) and of the tail own.
        stage2_block_n: output rows (of D) a stage-2 item owns, None: expert_block_n (the
            stages' items need not be the same size: stage 2's K is I, stage 1's D).
        block_k: K elements a GEMV step of the front and the tail (bf16 weights).
        expert_block_k: K elements a GEMV step of the experts (MXFP4 or bf16), None: block_k
            (the dot mode takes 32 for fp8 activations: one MXFP4 group a dot). A step is one
            round trip to memory per item, but a longer step's registers can leave fewer
            programs resident (docs/decisions.md has the sweep).
        num_warps: warps a program.
        max_products: a broadcast-multiply GEMV step's products (rows of x x weight rows x K)
            at most: the K step is halved (down to 32) until a step fits (tokens x rows x K
            products live in registers).
        overlap_route: when the launch routes itself (no plan given; compiled), route_sort
            lets this launch start at once and only the items that read the plan (stage 1 on)
            wait for it: the front's items stream their weights while the route runs.
        route_items: when the launch routes itself, route_sort's programs are its first work
            items instead of a launch before it: one launch for the block with routing. The
            last route item selects and sorts; stage 1's items wait for every route item.
            Where the selection would be a launch of its own (``RouteConfig.
            select_programs_min_tokens``), the route runs apart as without this.
        route_config: the router GEMV's shape for route items (None: the fused front's,
            ``front_route.FRONT_ROUTE_CONFIG``); its ``pdl`` and ``early_dependents`` are
            ignored there.
        max_registers: (compiled only) registers a thread at most (Triton's ``maxnreg``; 0:
            the compiler's choice). With route items the launch takes the route's count
            (docs/decisions.md), which leaves fewer programs an SM resident.
    """

    programs_per_sm: int = 4
    deterministic: bool = False
    activations: str = "bf16"
    multiply: str = "fma"
    tail_fp8: bool = False
    front_block_n: int = 8
    expert_block_n: int = 16
    tail_block_n: int = 16
    stage2_block_n: int | None = 64
    block_k: int = 512
    expert_block_k: int | None = None
    num_warps: int = 4
    max_products: int = 8192
    overlap_route: bool = True
    route_items: bool = False
    route_config: RouteConfig | None = None
    max_registers: int = 0

    def __post_init__(self):
        _check_int("programs_per_sm", self.programs_per_sm, 1, 64)
        for name in ("deterministic", "tail_fp8", "overlap_route", "route_items"):
            _check_bool(name, getattr(self, name))
        _check_choice("activations", self.activations, ACTIVATION_FORMATS)
        _check_choice("multiply", self.multiply, MULTIPLY_MODES)
        # the front and the tail always broadcast-multiply; dot tiles need 16 rows
        for name in ("front_block_n", "tail_block_n"):
            _check_int(name, getattr(self, name), 1, 512, pow2=True)
        _check_int("expert_block_n", self.expert_block_n, 16 if self.multiply == "dot" else 1,
                   512, pow2=True)
        if self.stage2_block_n is not None:
            _check_int("stage2_block_n", self.stage2_block_n, 16 if self.multiply == "dot" else 1,
                       512, pow2=True)
        _check_int("block_k", self.block_k, 32, 4096, pow2=True)
        if self.expert_block_k is not None:
            _check_int("expert_block_k", self.expert_block_k, 32, 8192, pow2=True)
        _check_int("num_warps", self.num_warps, 1, 16, pow2=True)
        _check_int("max_products", self.max_products, 1, 1 << 24)
        check_max_registers("max_registers", self.max_registers)
        if self.route_config is not None and not isinstance(self.route_config, RouteConfig):
            raise ValueError(f"route_config: expected a RouteConfig or None, got "
                             f"{type(self.route_config).__name__}")

    @property
    def fp8(self) -> bool:
        return self.activations == "fp8"
