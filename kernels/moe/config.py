"""The MoE kernels' tuning choices as one immutable value, passed to every launcher.

``MoEConfig()`` is what the kernels run by default; a sweep or a test builds another one and
passes it as ``config=``. Nothing here is read from module globals at launch time. The evidence
behind each default is in docs/decisions.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# MoEConfig.shared_down_launch: the launch that runs the shared experts' down-projection
SHARED_DOWN_LAUNCHES = ("tail", "stage1", "stage2")

__all__ = ["MoEConfig", "MMA_STAGE1_R"]

MMA_STAGE1_R = 2  # a stage-1 tensor-core program holds its gate tile and its up tile


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


def _check_int(name: str, value, low: int, high: int | None = None, pow2: bool = False) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    ok = ok and (high is None or value <= high) and (not pow2 or value & (value - 1) == 0)
    if not ok:
        span = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}: expected an int {span}{' and a power of two' if pow2 else ''}"
                         f", got {value!r}")


def _check_mma_tile(name: str, tile, stage: int) -> None:
    """A tensor-core tile (R, WARPS_K, L2 prefetch distance); stage 1's R is 2."""
    if tile is None:
        return
    ok = (isinstance(tile, tuple) and len(tile) == 3
          and all(isinstance(v, int) and not isinstance(v, bool) for v in tile))
    if ok:
        r, warps_k, prefetch = tile
        ok = r in ((MMA_STAGE1_R,) if stage == 1 else (1, 2)) and warps_k in (1, 2, 4) \
            and 0 <= prefetch <= 7
    if not ok:
        rs = f"R = {MMA_STAGE1_R} (gate and up tiles)" if stage == 1 else "R in (1, 2)"
        raise ValueError(f"{name}: expected None or a tuple ({rs}, WARPS_K in (1, 2, 4), "
                         f"L2 prefetch distance in 0..7), got {tile!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Tuning choices of the MoE kernels (defaults: what the kernels run).

    Attributes:
        mma: MXFP4 plan tiles of one token (block_m 1: B1 stage 1 and the atomic stage 2) run on
            the tensor cores (kernels/moe/mma.py) instead of the K-lane GEMV.
        stage1_mma_tile, stage2_mma_tile: the tensor-core tile (R 16-row tiles a warp, WARPS_K
            warps splitting K, L2 prefetch distance in K steps) of that stage, or None: the
            largest candidate (tiles.MMA_CANDIDATES) that still launches ``target_programs``
            programs (else the smallest).
        stage1_evict_first, stage2_evict_first: the tensor-core tiles load that stage's expert
            weights with eviction_policy "evict_first" (read once; L2 is left to what is read or
            added to again).
        x_prepared: the tensor-core tiles read the activations already permuted and scaled
            (mma_prepare_x) where the caller has such a copy; moe_block has the producers
            write them.
        pdl: programmatic dependent launch where it is safe (compiled tensor-core stage tiles,
            the tail launched alone, the front and stage 1 letting the next launch start);
            False: no PDL anywhere.
        stage1_klane_stages, stage2_klane_stages: software pipeline stages of the K-lane MXFP4
            K loop (tl.range num_stages; 0: none) of stage 1 / stage 2.
        klane_words: int32 words (8 codes each) a K-lane K step.
        klane_rows: most weight rows a K-lane program holds (stage 1: gate and up rows
            interleaved, half of each).
        target_programs: programs a GEMV launch aims at (about 4 resident programs per SM of a
            132-SM H200): the most rows a program whose launch still has this many.
        front_target_programs: the same for the front launch (latent down + shared gate/up).
        tiled_weights: moe_kernel_weights lays MXFP4 experts out in the tiled layout where the
            shapes allow.
        dense_projections: the block's dense projections run as ``k3lab.kernels.dense`` GEMV
            launches (latent presets): latent down and shared gate/up as one launch before stage
            1, stage 2 alone, then the tail's RMSNorm + up-projection + shared down as one
            launch (4 launches given a plan instead of 3: each GEMV at its own tiling).
        front_overlaps_route: with dense_projections, pdl, no plan given and the route apart
            from the front (front_routes off, or no merged front), route_sort lets
            the dense front launch start at once and the front waits for the route only before
            its programs exit: the two read x alone, so the front streams its weights while
            the route's GEMV and selection run (stage 1 still waits for both).
        front_triggers_last: with front_overlaps_route, the front lets the next launch start
            only after it has waited for the route (``GemvConfig.trigger_last``), so the expert
            pair after it launches by PDL (stage 1 reads the plan before its wait) instead of
            plainly: stage 1's launch and plan read overlap the front's end. False: the pair
            launches plainly after the front.
        shared_beside_stage1: with dense_projections, the front is the latent down alone and
            the shared experts' gate/up runs as its own launch between stage 1 and stage 2
            (``moe_experts(shared_x=...)``), overlapping stage 1 (compiled, pdl): one launch
            more, the shared rows' bytes off the front's critical path. Both launches take
            the merged front's tiles (``front_tiling``), so each output keeps its sums.
        deterministic_stage2: stage 2's default mode where the launcher is not told
            (``deterministic=None`` of moe_stage2 / moe_block): one program per (token, D tile)
            summing its top_k slots in slot order and storing (bitwise reproducible), instead of
            fp32 atomics per plan tile. Same one launch; its programs read a token's experts'
            weights each (no sharing of a weight tile between tokens of one expert), so it
            costs more the more tokens share experts (about the same at B1).
        front_routes: with dense_projections, a merged front (latent down and shared gate/up
            in one weight) and no plan given, route_sort's programs and the front's run as one
            launch (``front_route``): the router's rows stream first, the last route program
            selects and sorts while the front's tiles stream, and stage 1 launches plainly
            after it (front_overlaps_route and front_triggers_last then have no effect).
        front_route_registers: registers a thread the fused launch is capped at (Triton's
            ``maxnreg``; 0: the compiler's choice, 128 at K3 tp 8 with its default tiles). Its
            route and front programs share one register count, the larger of the two, which
            sets how many front programs an SM holds (96: 5).
        tail_second_first: with dense_projections and the front in the route's launch
            (front_routes), the tail's launch runs its shared down-projection and loads its
            residual before its PDL wait (``GemvConfig.second_first``), so they overlap stage
            2's end: the shared activation was written by the front, which stage 1 waits for
            whole (it launches plainly after it). With shared_down_launch "stage1" it loads
            that launch's sum, its residual, before the wait (stage 2's tiles let the tail
            start only after their own wait for stage 1); no effect with "stage2".
        shared_down_launch: where a caller runs the MoE tail as one dense GEMV (the decode
            stack, the dense block), the launch that runs the shared experts'
            down-projection (and the residual): "tail" (the tail's second product), "stage1" or
            "stage2" (dense GEMV programs in that stage's launch, ``moe_experts(shared_a=...)``,
            kernels/moe/shared_down.py; the tail adds their fp32 sum as its residual): the
            shared rows' bytes stream in the SM slots the stages leave free instead of after
            stage 2.
        interpret_gpu_tiles: under the Triton interpreter, run the GPU's tiling (small tiles, K
            steps, token loops, and the tensor-core tiles, their mma emulated) instead of a few
            big tiles (the interpreter runs programs one by one); no effect when compiled.
    """

    mma: bool = True
    stage1_mma_tile: tuple[int, int, int] | None = None
    stage2_mma_tile: tuple[int, int, int] | None = None
    stage1_evict_first: bool = False
    stage2_evict_first: bool = True
    x_prepared: bool = True
    pdl: bool = True
    stage1_klane_stages: int = 3
    stage2_klane_stages: int = 0
    klane_words: int = 64
    klane_rows: int = 64
    target_programs: int = 528
    front_target_programs: int = 1056
    tiled_weights: bool = True
    deterministic_stage2: bool = False
    interpret_gpu_tiles: bool = False
    dense_projections: bool = False
    front_overlaps_route: bool = True
    front_triggers_last: bool = True
    shared_beside_stage1: bool = False
    front_routes: bool = True
    front_route_registers: int = 96
    tail_second_first: bool = False
    shared_down_launch: str = "tail"

    def __post_init__(self):
        for name in ("mma", "stage1_evict_first", "stage2_evict_first", "x_prepared", "pdl",
                     "tiled_weights", "deterministic_stage2", "interpret_gpu_tiles",
                     "dense_projections", "front_overlaps_route", "front_triggers_last",
                     "shared_beside_stage1", "front_routes", "tail_second_first"):
            _check_bool(name, getattr(self, name))
        if self.shared_down_launch not in SHARED_DOWN_LAUNCHES:
            raise ValueError(f"shared_down_launch: expected one of {SHARED_DOWN_LAUNCHES}, got "
                             f"{self.shared_down_launch!r}")
        _check_mma_tile("stage1_mma_tile", self.stage1_mma_tile, 1)
        _check_mma_tile("stage2_mma_tile", self.stage2_mma_tile, 2)
        _check_int("stage1_klane_stages", self.stage1_klane_stages, 0, 7)
        _check_int("stage2_klane_stages", self.stage2_klane_stages, 0, 7)
        _check_int("klane_words", self.klane_words, 4, 1024, pow2=True)
        _check_int("klane_rows", self.klane_rows, 4, 512, pow2=True)
        _check_int("target_programs", self.target_programs, 1)
        _check_int("front_target_programs", self.front_target_programs, 1)
        if self.front_route_registers:
            _check_int("front_route_registers", self.front_route_registers, 24, 255)

    def mma_tile(self, stage: int) -> tuple[int, int, int] | None:
        """The fixed tensor-core tile of stage 1 or 2 (None: picked by the launch)."""
        return self.stage1_mma_tile if stage == 1 else self.stage2_mma_tile

    def evict_first(self, stage: int) -> bool:
        return self.stage1_evict_first if stage == 1 else self.stage2_evict_first

    def klane_stages(self, stage: int) -> int:
        return self.stage1_klane_stages if stage == 1 else self.stage2_klane_stages
