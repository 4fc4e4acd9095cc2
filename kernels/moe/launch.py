"""The MoE launchers: validate, pick tiles (tiles.py) from the MoEConfig, launch (stages.py).

Every launcher takes ``config: MoEConfig | None`` (None: the defaults) and turns its fields into
named constexprs of the kernels.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from ..dense import GemvConfig, default_config, dense_gemv
from ..dense.launch import prepare_gemv
from ..mxfp4 import MXFP4, mxfp4_layout, mxfp4_tiled_ok
from ..plan import RoutePlan
from ..runtime import INTERPRETED, zeroed_words
from .checks import (
    check_activation,
    check_betas,
    check_config,
    check_deterministic,
    check_experts,
    check_plan,
    check_prepared,
    check_tensor,
    check_tokens,
    pairs,
)
from .config import MoEConfig
from .front_route import front_tiling
from .mma import MMA_WARPS, mma_layout_problem
from .shared_down import (
    launch_stage1_shared_down,
    launch_stage2_shared_down,
    shared_down_tiling,
)
from .stages import _moe_front_kernel, _moe_stage1_kernel, _moe_stage2_tail_kernel
from .tiles import (
    MIN_PAIRS,
    MIN_ROWS,
    PRODUCT_BUDGET,
    ExpertTiles,
    expert_tiles,
    gemv_tiles,
    mma_tile,
    token_loop,
)

__all__ = ["latent_down", "moe_experts", "moe_stage1", "moe_stage2", "moe_kernel_weights"]

NUM_WARPS = MMA_WARPS  # every launch: 4 warps (the tensor-core tiles' index math needs 4)
ZERO_MIN_BLOCK = 16  # stage 1 zeroes stage 2's accumulator in slices of at least this
# int32 counters (ticket, zeroed flag, done) per D tile, per device, of the self-zeroing atomic
# stage 2
_ZERO_COUNTERS: dict[torch.device, torch.Tensor] = {}


def front_config(m: int, rows: int, k: int, gated: bool, config: MoEConfig,
                 tiling: GemvConfig | None = None) -> GemvConfig:
    """The tiling of an MoE front that overlaps route_sort (``config.front_overlaps_route``):
    ``tiling`` (None: dense_gemv's default) launched by PDL, waiting for the route only before
    its programs exit and letting the next launch start only after that wait where
    ``config.front_triggers_last``."""
    base = tiling if tiling is not None else default_config(m, rows, k, gated=gated)
    return dataclasses.replace(base, pdl=True, wait_last=True,
                               trigger_last=config.front_triggers_last)


def _pdl_on(config: MoEConfig) -> bool:
    """PDL is a compiled-only launch option."""
    return config.pdl and not INTERPRETED


def _tiled(w) -> bool:
    """Whether expert weight ``w`` is MXFP4 in the tiled layout."""
    return isinstance(w, MXFP4) and w.layout == "tiled"


def _expert_ptrs(w):
    """(values, scales) kernel arguments: bf16 viewed as int32 pairs, or MXFP4 packed codes viewed
    as int32 words (8 codes each) and the uint8 scales."""
    if isinstance(w, MXFP4):
        return w.packed.view(torch.int32), w.scales
    return w.view(torch.int32), w.view(torch.int32)


def _expert_constexprs(config: MoEConfig, w, t: ExpertTiles, stage: int,
                       x_prepared: bool) -> dict:
    """The expert GEMV's constexprs: format, tensor-core tile (or K-lane stages), flags."""
    r, warps_k, prefetch = t.mma or (1, 1, 0)
    return dict(FP4=isinstance(w, MXFP4), USE_MMA=t.mma is not None, R=r, WARPS_K=warps_k,
                L2_PREFETCH=prefetch, X_PREPARED=x_prepared,
                EVICT_FIRST=t.mma is not None and config.evict_first(stage),
                ASM=not INTERPRETED, KLANE_STAGES=t.klane_stages)


_MMA_LAYOUT_VERDICTS: dict = {}


def _check_mma_layout(kernel, grid, args: tuple, kwargs: dict) -> None:
    """Before a compiled launch with tensor-core tiles: compile it (warmup, once per
    specialization) and check that Triton gave the mma operands the layout mma.py relies on;
    otherwise raise instead of computing a wrong answer."""
    if INTERPRETED:
        return

    def spec(a):  # what Triton specializes on: int divisibility / 1, tensor dtype / alignment
        if isinstance(a, torch.Tensor):
            return ("tensor", a.dtype, a.data_ptr() % 16 == 0)
        if isinstance(a, int) and not isinstance(a, bool):
            return ("int", a % 16 == 0, a == 1)
        return (type(a).__name__, a)

    key = (kernel.fn.__name__, tuple(kwargs), tuple(spec(a) for a in (*args, *kwargs.values())))
    if key not in _MMA_LAYOUT_VERDICTS:
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        _MMA_LAYOUT_VERDICTS[key] = mma_layout_problem(compiled.asm["ttgir"])
    problem = _MMA_LAYOUT_VERDICTS[key]
    if problem is not None:
        raise RuntimeError(
            f"{kernel.fn.__name__}: this Triton ({triton.__version__}) laid out the MXFP4 "
            f"tensor-core tiles differently from what kernels/moe/mma.py needs ({problem}); "
            "pass config=MoEConfig(mma=False) to use the K-lane tiles")


def moe_kernel_weights(weights: dict, config: MoEConfig | None = None) -> dict:
    """``weights`` (a dict of MoE weights, as k3lab.weights.moe_weights makes them) with the
    expert weights w13 / w2 laid out as these kernels read them fastest: MXFP4 experts in the
    tiled layout where the shapes allow and ``config.tiled_weights`` is set (a copy of the
    codes, made once, as an engine lays out its checkpoint at load time; the scales are
    shared), the rest as given. Every launcher also takes either layout."""
    config = check_config(config)
    out = dict(weights)
    for name in ("w13", "w2"):
        w = out.get(name)
        if isinstance(w, MXFP4) and config.tiled_weights and mxfp4_tiled_ok(w.shape):
            out[name] = mxfp4_layout(w, "tiled")
    return out


def latent_down(x: torch.Tensor, down_weight: torch.Tensor | None,
                shared_w13: torch.Tensor | None = None, *, activation: str = "situ",
                situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                z_mma_out: torch.Tensor | None = None, config: MoEConfig | None = None):
    """The MoE's front launch: latent down-projection and the shared MLP's gate/up, both GEMVs of
    x, in one kernel.

    x: bf16 [M, H]; down_weight: bf16 [D, H] or None (no latent); shared_w13: bf16 [2S, H] (gate
    rows then up rows) or None. Returns (z bf16 [M, D] or None, a_s bf16 [M, S] or None) with
    a_s = act(x @ Ws1^T, x @ Ws3^T). z_mma_out: bf16 [M, D] (D a multiple of 8) that also gets
    ``mma_prepare_x(z)``, for moe_stage1's z_mma (needs down_weight).
    """
    config = check_config(config)
    check_tensor("x", x, dtypes=(torch.bfloat16,), dim=2)
    m, h = x.shape
    check_tokens("x", m)
    act = check_activation(activation)
    situ_beta, situ_linear_beta = check_betas(situ_beta, situ_linear_beta)
    x_p = pairs("x", x)
    d = s = 0
    if down_weight is not None:
        check_tensor("down_weight", down_weight, dtypes=(torch.bfloat16,), dim=2, device=x.device)
        if down_weight.shape[1] != h:
            raise ValueError(f"down_weight: expected [D, H={h}], got {tuple(down_weight.shape)}")
        d = down_weight.shape[0]
    if shared_w13 is not None:
        check_tensor("shared_w13", shared_w13, dtypes=(torch.bfloat16,), dim=2, device=x.device)
        if shared_w13.shape[1] != h or shared_w13.shape[0] % 2:
            raise ValueError(f"shared_w13: expected [2S, H={h}], got {tuple(shared_w13.shape)}")
        s = shared_w13.shape[0] // 2
    if not d and not s:
        return None, None
    if z_mma_out is not None and (not d or d % 8):
        raise ValueError(f"z_mma_out: needs down_weight with D a multiple of 8, got D={d}")
    check_prepared("z_mma_out", z_mma_out, (m, d), x.device)
    z = torch.empty((m, d), device=x.device, dtype=torch.bfloat16) if d else None
    a_s = torch.empty((m, s), device=x.device, dtype=torch.bfloat16) if s else None
    block_m = triton.next_power_of_2(m)
    block_n, block_kp = gemv_tiles(config, 1, d + 2 * s, h // 2, block_m,
                                   target=config.front_target_programs)
    n_shared = triton.cdiv(s, block_n)
    grid = (n_shared + triton.cdiv(d, block_n),)
    dummy = x_p
    _moe_front_kernel[grid](
        x_p, pairs("down_weight", down_weight) if d else dummy, z if d else dummy,
        z_mma_out if z_mma_out is not None else dummy,
        pairs("shared_w13", shared_w13) if s else dummy, a_s if s else dummy,
        m, h // 2, d, s, n_shared, float(situ_beta), float(situ_linear_beta),
        ACT=act, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KP=block_kp,
        TOKEN_LOOP=token_loop(config), WRITE_PREPARED=z_mma_out is not None,
        TRIGGER=_pdl_on(config), num_warps=NUM_WARPS)
    return z, a_s


def _launch_stage1(config, z, plan, w13, act, situ_beta, situ_linear_beta, n_tiles, sync=None,
                   z_mma=None, a_mma_out=None, pdl=False, beside=None):
    """Stage 1's launch; ``beside``: a prepared dense GEMV launch whose programs join stage 1's
    grid (shared_down.py)."""
    m, d = z.shape
    top_k, block_m, i = plan.topk_ids.shape[1], plan.block_m, w13.shape[1] // 2
    a = torch.empty((m * top_k, i), device=z.device, dtype=torch.bfloat16)
    t = expert_tiles(config, w13, 1, block_m, n_tiles, i, d // 2)
    x_prepared = t.mma is not None and z_mma is not None and config.x_prepared
    if x_prepared:
        z = z_mma  # the tiles read the prepared copy
    grid = (n_tiles, triton.cdiv(i, t.block_n))
    out = plan.out
    zero_block = triton.next_power_of_2(max(ZERO_MIN_BLOCK,
                                            triton.cdiv(m * d, grid[0] * grid[1])))
    w_v, w_s = _expert_ptrs(w13)
    args = (z.view(torch.int32), w_v, w_s, plan.sorted_ids, plan.block_expert_ids,
            plan.num_valid, a, a_mma_out if a_mma_out is not None else a,
            out if out is not None else a,
            sync if sync is not None else plan.num_valid, m * top_k, block_m, top_k, i, d // 2,
            m * d, float(situ_beta), float(situ_linear_beta))
    consts = _expert_constexprs(config, w13, t, 1, x_prepared)
    del consts["R"]  # stage 1's tensor-core R is 2: its gate and up tiles
    # compiled tensor-core tiles only: launched with PDL, or letting the next launch start
    pdl = pdl and _pdl_on(config) and t.mma is not None
    kwargs = dict(ACT=act, **consts, ZERO_OUT=out is not None, ZERO_SYNC=sync is not None,
                  ZERO_BLOCK=zero_block, BLOCK_M=triton.next_power_of_2(block_m),
                  BLOCK_N=t.block_n, BLOCK_KP=t.block_kp, TOKEN_LOOP=token_loop(config),
                  WRITE_PREPARED=a_mma_out is not None, PDL=pdl,
                  TRIGGER=not pdl and _pdl_on(config) and t.mma is not None, TILED=_tiled(w13),
                  num_warps=NUM_WARPS)
    if pdl:
        kwargs["launch_pdl"] = True
    if beside is not None:
        launch_stage1_shared_down(args, kwargs, grid, beside, _check_mma_layout)
        return a
    if t.mma is not None:
        _check_mma_layout(_moe_stage1_kernel, grid, args, kwargs)
    _moe_stage1_kernel[grid](*args, **kwargs)
    return a


def _check_stage1(z, plan, w13, activation, situ_beta, situ_linear_beta, validate):
    """Stage 1's inputs checked: (activation code, betas, (M, D, E, 2I), plan tiles)."""
    check_tensor("z", z, dtypes=(torch.bfloat16,), dim=2)
    m, d = z.shape
    check_tokens("z", m)
    act = check_activation(activation)
    betas = check_betas(situ_beta, situ_linear_beta)
    e, two_i, k, _ = check_experts("w13", w13, z.device)
    if k != d or two_i % 4:
        raise ValueError(f"w13: expected [E, 2I, D={d}] with I even, got {list(w13.shape)}")
    pairs("z", z)
    _, _, n_tiles = check_plan(plan, m, e, z.device, out_dim=d, validate=validate)
    return act, betas, (m, d, e, two_i), n_tiles


def prepared_a(config: MoEConfig, w2, plan: RoutePlan, n_tiles: int, deterministic: bool):
    """The buffer for a's tensor-core copy (``mma_prepare_x``) that stage 1 writes and stage 2
    reads, where stage 2's tiles read one (``config.x_prepared``, tensor-core tiles); else
    None."""
    _, d, i = w2.shape
    if not (config.x_prepared and i % 8 == 0 and mma_tile(
            config, w2, 0 if deterministic else 2, plan.block_m, n_tiles, d) is not None):
        return None
    m, top_k = plan.topk_ids.shape
    return torch.empty((m * top_k, i), device=plan.topk_ids.device, dtype=torch.bfloat16)


def moe_stage1(z: torch.Tensor, plan: RoutePlan, w13, *, activation: str = "situ",
               situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
               z_mma: torch.Tensor | None = None, a_mma_out: torch.Tensor | None = None,
               pdl: bool = False, config: MoEConfig | None = None,
               validate: str = "cheap") -> torch.Tensor:
    """Stage 1 "direct tile": a[t * top_k + k] = act(z[t] @ W1[e]^T, z[t] @ W3[e]^T),
    e = plan.topk_ids[t, k], computed along the plan's expert-sorted tiles.

    z: bf16 [M, D], M <= MAX_TOKENS. plan: RoutePlan over E experts (topk_ids int32 [M, top_k],
    sorted_ids / sorted_weights [cap], block_expert_ids [cap / block_m], num_valid [1]; out fp32
    [M, D] or None). w13: bf16 [E, 2I, D] (rows [0, I) gate, [I, 2I) up) or MXFP4 (packed uint8
    [E, 2I, D/2], scales uint8 [E, 2I, D/32]). Returns a: bf16 [M * top_k, I]. Side effect:
    zeroes plan.out (stage 2's accumulator) when present.
    z_mma: optional ``mma_prepare_x(z)`` (as latent_down's z_mma_out writes it), read instead of
    z by the MXFP4 tensor-core tiles (ignored by the other paths; the caller vouches that it is
    z's copy). a_mma_out: optional bf16 [M * top_k, I] that also gets ``mma_prepare_x(a)``,
    for moe_stage2's a_mma.
    pdl: launch with programmatic dependent launch (compiled MXFP4 tensor-core tiles with
    ``config.pdl``; ignored otherwise): the kernel may start during the previous launch and
    reads the plan before waiting for it, so the plan must have been written at least two
    launches before this one.
    validate: "cheap" (shapes, dtypes, sizes: no host sync) or "full" (also the plan's values,
    see checks.check_plan_values: out-of-range ids, misplaced entries; one host sync).
    """
    config = check_config(config)
    act, (situ_beta, situ_linear_beta), (m, d, e, two_i), n_tiles = _check_stage1(
        z, plan, w13, activation, situ_beta, situ_linear_beta, validate)
    check_prepared("z_mma", z_mma, (m, d), z.device)
    if a_mma_out is not None and (two_i // 2) % 8:
        raise ValueError(f"a_mma_out: needs I a multiple of 8, got I={two_i // 2}")
    check_prepared("a_mma_out", a_mma_out, (m * plan.topk_ids.shape[1], two_i // 2), z.device)
    return _launch_stage1(config, z, plan, w13, act, situ_beta, situ_linear_beta, n_tiles,
                          z_mma=z_mma, a_mma_out=a_mma_out, pdl=pdl)


def _zero_counters(dev: torch.device, n_d_tiles: int) -> torch.Tensor:
    """The device's int32 counters (three per D tile) of the self-zeroing atomic stage 2 (zero
    between launches: each D tile's last program resets its three), created, or grown, by a
    call outside a CUDA-graph capture."""
    return zeroed_words(_ZERO_COUNTERS, dev, 3 * n_d_tiles, minimum=3 * 1024, error=(
        f"a: moe_stage2's counters on {dev} for {n_d_tiles} D tiles do not exist yet and cannot "
        "be created inside a CUDA-graph capture; call moe_stage2 once on this device with these "
        "shapes before capturing"))


def _stage2_args(config, a, plan, w2, deterministic, n_tiles, a_mma=None, zero=False):
    """Stage-2 kernel arguments (validated inputs; a_mma: a's mma_prepare_x copy or None; zero:
    the atomic launch zeroes y itself, else y is plan.out as zeroed by stage 1); returns
    (kwargs, programs, y)."""
    top_k, block_m = plan.topk_ids.shape[1], plan.block_m
    m, i = a.shape[0] // top_k, a.shape[1]
    d = w2.shape[1]
    y = plan.out
    zero = zero and not deterministic
    if y is None:  # the deterministic stage 2 overwrites; the atomic one zeroes it (zero)
        if not (zero or deterministic):
            raise ValueError("plan.out: the atomic stage 2 needs a buffer zeroed by stage 1")
        y = torch.empty((m, d), device=a.device, dtype=torch.float32)
    stage = 0 if deterministic else 2
    rows = m if deterministic else n_tiles
    t = expert_tiles(config, w2, stage, block_m, rows, d, i // 2)
    x_prepared = t.mma is not None and a_mma is not None and config.x_prepared
    if x_prepared:
        a = a_mma  # the tiles read the prepared copy
    n_d = triton.cdiv(d, t.block_n)
    w_v, w_s = _expert_ptrs(w2)
    kw = dict(p_a=a.view(torch.int32), p_w=w_v, p_ws=w_s, p_sorted=plan.sorted_ids,
              p_sorted_w=plan.sorted_weights, p_block_expert=plan.block_expert_ids,
              p_num_valid=plan.num_valid, p_topk_ids=plan.topk_ids, p_topk_w=plan.topk_weights,
              p_y=y, n_entries=m * top_k, block_m=block_m, top_k=top_k, D=d, I_PAIRS=i // 2,
              n_d_tiles=n_d, n_stage2=rows * n_d,
              **_expert_constexprs(config, w2, t, stage, x_prepared),
              DETERMINISTIC=bool(deterministic),
              BLOCK_M2=1 if deterministic else triton.next_power_of_2(block_m),
              BLOCK_N2=t.block_n, BLOCK_KP2=t.block_kp, TILED=_tiled(w2),
              ZERO_Y=zero, n_zero=m, ZERO_BLOCK=triton.next_power_of_2(m))
    if zero:
        kw["p_sync"] = _zero_counters(a.device, n_d)
    return kw, rows * n_d, y


def _tail_args(config, y, norm_weight, up_weight, shared_out, shared_a, shared_w2, eps):
    """Tail kernel arguments (validated inputs); returns (kwargs, programs, out)."""
    m, d = y.shape
    latent = up_weight is not None
    h = up_weight.shape[0] if latent else d
    out = torch.empty((m, h), device=y.device, dtype=torch.bfloat16)
    shared = 2 if shared_a is not None else (1 if shared_out is not None else 0)
    s = shared_a.shape[1] if shared_a is not None else 0
    block_m = triton.next_power_of_2(m)
    block_n, block_kp = gemv_tiles(config, 1, h, max(d, s) // 2, block_m)
    block_ss = min(triton.next_power_of_2(d), max(MIN_PAIRS, PRODUCT_BUDGET // block_m))
    kw = dict(p_y=y, p_nw=norm_weight if latent else y, p_up=up_weight.view(torch.int32)
              if latent else y, p_sa=shared_a.view(torch.int32) if shared == 2 else y,
              p_sw2=shared_w2.view(torch.int32) if shared == 2 else y,
              p_shared=shared_out if shared == 1 else y, p_o=out, M=m, D=d, H=h, S_PAIRS=s // 2,
              eps=float(eps), LATENT=latent, SHARED=shared, BLOCK_MT=block_m, BLOCK_NT=block_n,
              BLOCK_KPT=block_kp, BLOCK_SS=block_ss)
    return kw, triton.cdiv(h, block_n), out


def _stage2_tail_kwargs(config, stage2, tail, sync=None):
    """(kwargs, programs) of one stage-2 + tail launch: stage2 / tail are (kwargs, programs,
    result) of _stage2_args / _tail_args or None; both given needs ``sync`` (int32 [2],
    zeroed)."""
    kw = {}
    if stage2 is None:  # dummies for the stage-2 parameters
        y = tail[0]["p_y"]
        kw.update(p_a=y, p_w=y, p_ws=y, p_sorted=y, p_sorted_w=y, p_block_expert=y,
                  p_num_valid=y, p_topk_ids=y, p_topk_w=y, n_entries=1, block_m=1, top_k=1,
                  D=tail[0]["D"], I_PAIRS=1, n_d_tiles=1, n_stage2=0,
                  **_expert_constexprs(config, None, ExpertTiles(MIN_ROWS, MIN_PAIRS), 2, False),
                  DETERMINISTIC=False, BLOCK_M2=1, BLOCK_N2=MIN_ROWS, BLOCK_KP2=MIN_PAIRS,
                  TILED=False, ZERO_Y=False, n_zero=0, ZERO_BLOCK=1)
    else:
        kw.update(stage2[0])
    if tail is None:
        y = stage2[2]
        kw.update(p_nw=y, p_up=y, p_sa=y, p_sw2=y, p_shared=y, p_o=y, M=1, H=1, S_PAIRS=0,
                  eps=0.0, LATENT=False, SHARED=0, BLOCK_MT=1, BLOCK_NT=MIN_ROWS,
                  BLOCK_KPT=MIN_PAIRS, BLOCK_SS=MIN_PAIRS)
    else:
        kw.update(tail[0])
        kw.pop("p_y")
        kw["p_y"] = tail[0]["p_y"] if stage2 is None else stage2[2]
    n = (stage2[1] if stage2 else 0) + (tail[1] if tail else 0)
    if sync is not None:
        kw["p_sync"] = sync
    kw.setdefault("p_sync", kw["p_y"])
    kw.update(STAGE2=stage2 is not None, TAIL=tail is not None, TOKEN_LOOP=token_loop(config),
              PDL=False)
    return kw, n


def _launch_stage2_tail(config, stage2, tail, sync=None, pdl=False, beside=None):
    """One launch of the stage-2 + tail kernel (see _stage2_tail_kwargs); pdl: stage 2 alone
    (compiled atomic tensor-core tiles) or the tail alone with programmatic dependent launch;
    beside: a prepared dense GEMV launch whose programs go first in stage 2's grid (stage 2
    alone; shared_down.py)."""
    kw, n = _stage2_tail_kwargs(config, stage2, tail, sync)
    kw["num_warps"] = NUM_WARPS
    if pdl and _pdl_on(config) and (stage2 is None or (
            tail is None and not kw["DETERMINISTIC"] and kw["USE_MMA"])):
        kw.update(PDL=True, launch_pdl=True)
    if beside is not None:
        launch_stage2_shared_down(kw, n, beside, _check_mma_layout)
        return
    if kw["USE_MMA"]:
        _check_mma_layout(_moe_stage2_tail_kernel, (n,), (), kw)
    _moe_stage2_tail_kernel[(n,)](**kw)


def moe_experts(z: torch.Tensor, plan: RoutePlan, w13, w2, *, activation: str = "situ",
                situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                deterministic: bool | None = None, pdl: bool = True,
                config: MoEConfig | None = None, validate: str = "cheap",
                shared_x: torch.Tensor | None = None, shared_w13: torch.Tensor | None = None,
                shared_a: torch.Tensor | None = None, shared_w2: torch.Tensor | None = None,
                shared_residual: torch.Tensor | None = None,
                shared_config: GemvConfig | None = None):
    """Stage 1 then stage 2 as ``moe_block`` runs them: 2 launches, returns plan.out (fp32
    [M, D], the routed experts' weighted sum).

    shared_a, shared_w2 (bf16 [M, S] and [H, S]), shared_residual (None, or bf16 / fp32
    [M, H]): the shared experts' down-projection ``a_s @ Ws2^T (+ residual)`` as dense GEMV
    programs in the launch of stage 1 or stage 2 (``config.shared_down_launch``; shared_down.py;
    ``shared_config`` their tiling, None: ``shared_down_tiling``, 4 warps as the stages'): it
    reads nothing the stages write, and its tiles fill the SM slots stage 1 leaves free. Its
    inputs must be written by the launch before stage 1's at the latest. Returns (plan.out,
    the fp32 [M, H] result): still 2 launches. Not with shared_x.

    shared_x, shared_w13: the shared experts' gate/up (bf16 [M, H] and [2S, H]) as one dense
    GEMV launch between the stages, act(x @ gate^T, x @ up^T), at the merged front's tiles
    (``front_tiling``: the sums the front would have made): it reads nothing stage 1 writes,
    so (compiled, ``config.pdl``) it starts while stage 1 runs and waits for it only
    before its programs exit (``GemvConfig.wait_last``), and stage 2's wait still covers stage
    1. Returns (plan.out, a_s [M, S]) when given: 3 launches.

    Stage 1 zeroes plan.out for stage 2 (which then skips its own zeroing and its counters),
    writes a's tensor-core copy for stage 2 where the tiles read one (``MoEConfig.x_prepared``),
    and stage 2 follows it by programmatic dependent launch (``config.pdl``, compiled). pdl:
    stage 1 is launched with PDL too, so it may start during the previous launch and read the
    plan before waiting for it: pass False unless the plan was written two or more launches
    earlier by launches that each waited for their predecessor before letting the next start.
    Arguments otherwise as for :func:`moe_stage1` and :func:`moe_stage2`; plan.out must exist.
    """
    config = check_config(config)
    deterministic = check_deterministic(deterministic, config)
    act, (situ_beta, situ_linear_beta), (m, d, e, two_i), n_tiles = _check_stage1(
        z, plan, w13, activation, situ_beta, situ_linear_beta, validate)
    e2, d2, i, _ = check_experts("w2", w2, z.device)
    if (e2, d2, i) != (e, d, two_i // 2):
        raise ValueError(f"w2: expected [E={e}, D={d}, I={two_i // 2}] (from w13 and z), got "
                         f"{list(w2.shape)}")
    if plan.out is None:
        raise ValueError("plan.out: moe_experts needs the plan's fp32 [M, D] buffer "
                         "(route_sort(..., out_dim=D)); stage 1 zeroes it")
    if (shared_x is None) != (shared_w13 is None):
        raise ValueError("shared_x: give both shared_x and shared_w13, or neither")
    if shared_x is not None:
        check_tensor("shared_x", shared_x, dtypes=(torch.bfloat16,), dim=2, device=z.device)
        check_tensor("shared_w13", shared_w13, dtypes=(torch.bfloat16,), dim=2,
                     device=z.device)
        if (shared_x.shape[0] != m or shared_w13.shape[1] != shared_x.shape[1]
                or shared_w13.shape[0] % 2):
            raise ValueError(f"shared_w13: expected shared_x [M={m}, H] and shared_w13 [2S, H], "
                             f"got {list(shared_x.shape)} and {list(shared_w13.shape)}")
    beside, shared_out = _shared_down(m, z.device, config, shared_x, shared_a, shared_w2,
                                      shared_residual, shared_config)
    first = beside if config.shared_down_launch == "stage1" else None
    a_mma = prepared_a(config, w2, plan, n_tiles, deterministic)
    a = _launch_stage1(config, z, plan, w13, act, situ_beta, situ_linear_beta, n_tiles,
                       a_mma_out=a_mma, pdl=pdl, beside=first)
    if beside is not None:
        stage2 = _stage2_args(config, a, plan, w2, deterministic, n_tiles, a_mma)
        _launch_stage2_tail(config, stage2, None, pdl=True,
                            beside=None if first is not None else beside)
        return stage2[2], shared_out()
    a_s = None
    if shared_x is not None:
        # the merged front's tiles: beside stage 1 the shared rows keep the front's sums
        tiling = front_tiling(m, shared_w13.shape[0] // 2, shared_x.shape[1], True)
        if _pdl_on(config):
            tiling = dataclasses.replace(tiling, pdl=True, wait_last=True)
        a_s = dense_gemv(shared_x, shared_w13, activation=activation, situ_beta=situ_beta,
                         situ_linear_beta=situ_linear_beta, config=tiling)
    stage2 = _stage2_args(config, a, plan, w2, deterministic, n_tiles, a_mma)
    _launch_stage2_tail(config, stage2, None, pdl=True)
    return stage2[2] if a_s is None else (stage2[2], a_s)


def _shared_down(m, dev, config, shared_x, shared_a, shared_w2, shared_residual,
                 shared_config):
    """(the prepared GEMV launch, its result) of moe_experts' shared down-projection beside
    a stage, or (None, None) without one; its arguments checked."""
    if shared_a is None and shared_w2 is None:
        if shared_residual is not None or shared_config is not None:
            raise ValueError("shared_residual: shared_residual and shared_config go with "
                             "shared_a and shared_w2")
        return None, None
    if shared_a is None or shared_w2 is None:
        raise ValueError("shared_a: give both shared_a and shared_w2, or neither")
    if shared_x is not None:
        raise ValueError("shared_a: the shared down-projection beside a stage (shared_a, "
                         "shared_w2) and the shared gate/up between the stages (shared_x, "
                         "shared_w13) are exclusive")
    if config.shared_down_launch == "tail":
        raise ValueError("shared_a: config.shared_down_launch is 'tail' (the MoE tail's second "
                         "product); 'stage1' or 'stage2' runs it beside a stage")
    check_tensor("shared_a", shared_a, dtypes=(torch.bfloat16,), dim=2, device=dev)
    check_tensor("shared_w2", shared_w2, dtypes=(torch.bfloat16,), dim=2, device=dev)
    if shared_a.shape[0] != m or shared_w2.shape[1] != shared_a.shape[1]:
        raise ValueError(f"shared_w2: expected shared_a [M={m}, S] and shared_w2 [H, S], got "
                         f"{list(shared_a.shape)} and {list(shared_w2.shape)}")
    h = shared_w2.shape[0]
    if shared_residual is not None:
        check_tensor("shared_residual", shared_residual,
                     dtypes=(torch.bfloat16, torch.float32), dim=2, device=dev)
        if tuple(shared_residual.shape) != (m, h):
            raise ValueError(f"shared_residual: expected [M, H] = [{m}, {h}], got "
                             f"{list(shared_residual.shape)}")
    if shared_config is not None and not isinstance(shared_config, GemvConfig):
        raise ValueError(f"shared_config: expected a GemvConfig or None, got "
                         f"{type(shared_config).__name__}")
    if shared_config is not None and shared_config.num_warps != NUM_WARPS:
        raise ValueError(f"shared_config: its programs share an expert stage's launch, which "
                         f"runs {NUM_WARPS} warps; got num_warps={shared_config.num_warps}")
    return prepare_gemv(shared_a, shared_w2, residual=shared_residual, out_dtype=torch.float32,
                        config=shared_config,
                        default_tiling=lambda mm, rows, k, _: shared_down_tiling(mm, rows, k))


def moe_stage2(a: torch.Tensor, plan: RoutePlan, w2, *, deterministic: bool | None = None,
               a_mma: torch.Tensor | None = None, pdl: bool = False,
               config: MoEConfig | None = None, validate: str = "cheap") -> torch.Tensor:
    """Stage 2: out[t] = sum_k topk_weights[t, k] * (a[t * top_k + k] @ W2[e]^T) in fp32.

    a: bf16 [M * top_k, I] (stage 1's output). plan: as for moe_stage1; its ``out`` fp32 [M, D]
    is overwritten with the result and returned (whatever it held: calling stage 2 twice on one
    plan gives the same result twice); when it is None a buffer is allocated.
    w2: bf16 [E, D, I] or MXFP4 (packed [E, D, I/2], scales [E, D, I/32]).
    Atomic (default): one program per (expert tile of the plan, D tile), fp32 atomic adds; the
    order of the adds varies between runs. The launch zeroes ``out`` itself (no memset launch):
    per D tile, the first program to start zeroes it, the tile's adds wait for that (after the
    GEMV) through per-device int32 counters (three per D tile) that the tile's last program
    resets; so calls on one device must not run concurrently on different streams, and the
    first call on a device (and shape) must not be inside a CUDA-graph capture.
    deterministic=True: one program per (token, D tile) adding its top_k slots in slot order
    (bitwise reproducible; stores); None: ``config.deterministic_stage2``.
    a_mma: optional ``mma_prepare_x(a)`` (as moe_stage1's a_mma_out writes it), read instead of a
    by the MXFP4 tensor-core tiles (ignored by the other paths). pdl: as for moe_stage1 (the
    atomic tensor-core tiles only). validate: as for moe_stage1. Returns fp32 [M, D].
    """
    config = check_config(config)
    deterministic = check_deterministic(deterministic, config)
    check_tensor("a", a, dtypes=(torch.bfloat16,), dim=2)
    e, d, i, _ = check_experts("w2", w2, a.device)
    if a.shape[1] != i or i % 2:
        raise ValueError(f"a: expected [M * top_k, I={i}] (I from w2 [E, D, I], even), got "
                         f"{tuple(a.shape)}")
    if not isinstance(plan, RoutePlan):
        raise ValueError(f"plan: expected a k3lab.kernels.RoutePlan, got {type(plan).__name__}")
    top_k = plan.topk_ids.shape[-1]
    m = a.shape[0] // max(top_k, 1)
    if a.shape[0] != m * top_k:
        raise ValueError(f"a: expected M * top_k rows (top_k={top_k}), got {a.shape[0]}")
    check_tokens("a", m)
    _, _, n_tiles = check_plan(plan, m, e, a.device, out_dim=d, validate=validate)
    check_prepared("a_mma", a_mma, tuple(a.shape), a.device)
    stage2 = _stage2_args(config, a, plan, w2, deterministic, n_tiles, a_mma, zero=True)
    _launch_stage2_tail(config, stage2, None, pdl=pdl)
    return stage2[2]
