"""The latent tail launcher and the whole block (front, stage 1, stage 2 + tail)."""

from __future__ import annotations

import dataclasses

import torch

from ..dense import GemvConfig, call_config, dense_gemv
from ..plan import RoutePlan
from ..route import RouteConfig, route_sort
from ..runtime import INTERPRETED, check_number
from .checks import (
    check_activation,
    check_betas,
    check_config,
    check_deterministic,
    check_experts,
    check_plan,
    check_shared_weights,
    check_tensor,
    check_tokens,
    pairs,
)
from .config import MoEConfig
from .front_route import front_route, front_tiling
from .launch import (
    _launch_stage1,
    _launch_stage2_tail,
    _stage2_args,
    _tail_args,
    front_config,
    latent_down,
    moe_experts,
    prepared_a,
)
from .tiles import mma_tile

__all__ = ["latent_moe_tail", "moe_block"]

_EARLY_ROUTE = RouteConfig(early_dependents=True)  # the route before an overlapping front


def _tail_shared(shared, y, m, h, config):
    """(shared_out, shared_a, shared_w2) of latent_moe_tail's ``shared`` argument."""
    if shared is None:
        return None, None, None
    if isinstance(shared, torch.Tensor):
        check_tensor("shared", shared, dtypes=(torch.bfloat16, torch.float32), dim=2,
                     device=y.device)
        if tuple(shared.shape) != (m, h):
            raise ValueError(f"shared: expected [M, H] = [{m}, {h}], got {tuple(shared.shape)}")
        return shared, None, None
    if isinstance(shared, dict) and "a" in shared:
        for key in ("a", "w2"):
            check_tensor(f"shared['{key}']", shared.get(key), dtypes=(torch.bfloat16,), dim=2,
                         device=y.device)
        shared_a, shared_w2 = shared["a"], shared["w2"]
        if shared_a.shape[0] != m or tuple(shared_w2.shape) != (h, shared_a.shape[1]):
            raise ValueError(f"shared: expected a [M={m}, S] and w2 [H={h}, S], got a "
                             f"{tuple(shared_a.shape)}, w2 {tuple(shared_w2.shape)}")
        pairs("shared['a']", shared_a)
        return None, shared_a, shared_w2
    if isinstance(shared, dict):
        check_shared_weights(shared, m, h, y.device)
        shared_w2 = shared["w2"]
        if shared_w2.shape[1] * 2 != shared["w13"].shape[0]:
            raise ValueError(f"shared: w2 must be [H, S] with w13 [2S, H], got w2 "
                             f"{tuple(shared_w2.shape)}, w13 {tuple(shared['w13'].shape)}")
        _, shared_a = latent_down(shared["x"], None, shared["w13"],
                                  activation=shared.get("activation", "situ"),
                                  situ_beta=shared.get("situ_beta", 4.0),
                                  situ_linear_beta=shared.get("situ_linear_beta", 25.0),
                                  config=config)
        pairs("shared['w2']", shared_w2)
        return None, shared_a, shared_w2
    raise ValueError(f"shared: expected None, a tensor [M, H] or a weights dict, got "
                     f"{type(shared).__name__}")


def latent_moe_tail(y: torch.Tensor, norm_weight: torch.Tensor | None,
                    up_weight: torch.Tensor | None, shared=None, *, eps: float,
                    config: MoEConfig | None = None) -> torch.Tensor:
    """out = RMSNorm(y) @ W_up^T + shared, bf16 [M, H], RMSNorm and sums in fp32.

    y: fp32 [M, D] (stage 2's output). norm_weight: fp32 or bf16 [D]. up_weight: bf16 [H, D].
    norm_weight = up_weight = None: no latent (K2-style), out = y + shared with y [M, H].
    shared: None; a computed tensor [M, H] (bf16 or fp32), added (1 launch in all); or the shared
    MLP's weights ``{"x": bf16 [M, H], "w13": bf16 [2S, H], "w2": bf16 [H, S], "activation",
    "situ_beta", "situ_linear_beta"}``: gate/up run in a front launch (:func:`latent_down`), the
    down GEMV inside the tail's launch (2 launches in all); or ``{"a": bf16 [M, S], "w2": bf16
    [H, S]}``, the shared MLP's activation already computed (by :func:`latent_down`): its down
    GEMV runs inside the tail's launch (1 launch).
    """
    config = check_config(config)
    check_tensor("y", y, dtypes=(torch.float32,), dim=2)
    m, d = y.shape
    check_tokens("y", m)
    if (norm_weight is None) != (up_weight is None):
        raise ValueError("norm_weight: give both norm_weight and up_weight, or neither")
    h = d
    if up_weight is not None:
        check_tensor("norm_weight", norm_weight, dtypes=(torch.float32, torch.bfloat16), dim=1,
                     device=y.device)
        check_tensor("up_weight", up_weight, dtypes=(torch.bfloat16,), dim=2, device=y.device)
        if norm_weight.shape[0] != d or up_weight.shape[1] != d or d % 2:
            raise ValueError(f"up_weight: expected norm_weight [D={d}] and up_weight [H, D={d}] "
                             f"with D even, got {tuple(norm_weight.shape)}, "
                             f"{tuple(up_weight.shape)}")
        h = up_weight.shape[0]
    shared_out, shared_a, shared_w2 = _tail_shared(shared, y, m, h, config)
    if up_weight is None and shared is None:
        raise ValueError("shared: without a latent (up_weight None) the tail needs a shared term")
    eps = check_number("eps", eps, positive=True)
    tail = _tail_args(config, y, norm_weight, up_weight, shared_out, shared_a, shared_w2, eps)
    _launch_stage2_tail(config, None, tail)
    return tail[2]


def _check_block_weights(x, weights, cfg, plan):
    """Validate moe_block's weights; returns (w13, w2, (E, D, I))."""
    h = x.shape[1]
    if h != cfg.hidden:
        raise ValueError(f"x: expected [M, H={cfg.hidden}] for preset {cfg.name}, got "
                         f"{tuple(x.shape)}")
    need = ["w13", "w2"]
    need += ["latent_down", "latent_norm", "latent_up"] if cfg.latent else []
    need += ["shared_w13", "shared_w2"] if cfg.shared_intermediate else []
    need += ["gate_weight", "correction_bias"] if plan is None else []
    missing = [k for k in need if k not in weights]
    if missing:
        raise ValueError(f"weights: missing {missing} for preset {cfg.name}")
    w13, w2 = weights["w13"], weights["w2"]
    e, two_i, d, _ = check_experts("w13", w13, x.device)
    e2, d2, i2, _ = check_experts("w2", w2, x.device)
    if (d, two_i, e2, d2, i2) != (cfg.moe_in, 2 * cfg.moe_intermediate, e, cfg.moe_in,
                                  cfg.moe_intermediate) or i2 % 2:
        raise ValueError(f"w13: expected w13 [E, 2I, D] and w2 [E, D, I] with D={cfg.moe_in}, "
                         f"I={cfg.moe_intermediate} (even), got {list(w13.shape)}, "
                         f"{list(w2.shape)}")
    if cfg.shared_intermediate:
        check_tensor("shared_w2", weights["shared_w2"], dtypes=(torch.bfloat16,), dim=2,
                     device=x.device)
        if tuple(weights["shared_w2"].shape) != (h, cfg.shared_intermediate):
            raise ValueError(f"shared_w2: expected [H, S] = [{h}, {cfg.shared_intermediate}], "
                             f"got {tuple(weights['shared_w2'].shape)}")
    if cfg.latent:
        for name, shape in (("latent_norm", (d,)), ("latent_up", (h, d))):
            check_tensor(name, weights[name], dtypes=(torch.bfloat16, torch.float32),
                         dim=len(shape), device=x.device)
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"{name}: expected {list(shape)}, got "
                                 f"{list(weights[name].shape)}")
    return w13, w2, (e, d, i2)


def moe_block(x: torch.Tensor, weights: dict, *, cfg, plan: RoutePlan | None = None,
              block_m: int = 1, deterministic: bool | None = None, fuse_tail: bool = True,
              config: MoEConfig | None = None, validate: str = "cheap") -> torch.Tensor:
    """The latent MoE block of docs/model.md: route_sort (unless ``plan`` is given),
    front (latent down + shared gate/up), stage 1, then stage 2 and the tail (+ shared down) as
    one ticket-ordered launch: 3 launches given a plan, route_sort's plus 3 with routing.

    fuse_tail=False launches stage 2 and the tail separately (4 launches given a plan): no
    waiting across programs inside a kernel. The fused launch cannot deadlock (a tail program
    waits only for tickets taken by running programs) and restarts from counters stage 1 zeroes
    on every call and graph replay. With ``config.pdl`` (compiled), stage 1 is launched with
    programmatic dependent launch after the front launch, and stage 2 and the tail when apart.

    x: bf16 [M, H], M <= MAX_TOKENS. weights: the dict of ``k3lab.weights.moe_weights``
    (gate_weight, correction_bias; latent_down [D, H], latent_norm [D], latent_up [H, D] when
    cfg.latent; w13 [E, 2I, D], w2 [E, D, I] bf16 or MXFP4; shared_w13 [2S, H], shared_w2
    [H, S] when cfg.shared_intermediate; with ``config.dense_projections`` optionally front
    [D + 2S, H], latent_down and shared_w13 concatenated once, for a one-launch front).
    cfg: a k3lab Preset. plan: a RoutePlan for x (skips routing; block_m is then the plan's; its
    out is re-zeroed by stage 1). deterministic: the stage-2 mode (None:
    ``config.deterministic_stage2``). validate: "cheap" or "full" (the plan's values too: one
    host sync; see moe_stage1). Returns bf16 [M, H].
    """
    config = check_config(config)
    deterministic = check_deterministic(deterministic, config)
    check_tensor("x", x, dtypes=(torch.bfloat16,), dim=2)
    m, h = x.shape
    check_tokens("x", m)
    act = check_activation(cfg.activation)
    betas = check_betas(cfg.situ_beta, cfg.situ_linear_beta)
    check_number("cfg.rms_eps", cfg.rms_eps, positive=True)
    w13, w2, (e, d, i) = _check_block_weights(x, weights, cfg, plan)
    dense = config.dense_projections and cfg.latent
    # the dense front reads x alone: it may overlap the route it follows (compiled, PDL)
    overlap = (plan is None and dense and config.pdl and config.front_overlaps_route
               and not INTERPRETED)
    # route_sort's programs and the merged front's in one launch (MoEConfig.front_routes)
    fused_front = (plan is None and dense and config.front_routes and "front" in weights
                   and bool(cfg.shared_intermediate) and not config.shared_beside_stage1)
    front = None
    if fused_front:
        s = cfg.shared_intermediate
        _check_front(weights["front"], x, d, s)
        plan, front = front_route(
            x, weights["gate_weight"], weights["correction_bias"], weights["front"],
            splits=(d, 2 * s), activation=cfg.activation, situ_beta=betas[0],
            situ_linear_beta=betas[1], top_k=cfg.top_k, n_group=cfg.n_group,
            topk_group=cfg.topk_group, renormalize=cfg.renormalize,
            routed_scaling_factor=cfg.routed_scaling, block_m=block_m, out_dim=d,
            pdl=config.pdl, max_registers=config.front_route_registers)
    elif plan is None:
        plan = route_sort(x, weights["gate_weight"], weights["correction_bias"], top_k=cfg.top_k,
                          n_group=cfg.n_group, topk_group=cfg.topk_group,
                          renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling,
                          block_m=block_m, out_dim=d,
                          config=_EARLY_ROUTE if overlap else None)
    _, _, n_tiles = check_plan(plan, m, e, x.device, out_dim=d, validate=validate)
    if plan.out is None:
        raise ValueError("plan.out: moe_block needs the plan's zeroed fp32 [M, D] buffer "
                         "(route_sort(..., out_dim=D))")
    if dense:
        return _dense_block(x, weights, cfg, plan, w13, w2, act, betas, n_tiles, deterministic,
                            config, overlap, front)
    # prepared activations for the tensor-core tiles: the front kernel writes z's copy, stage 1
    # a's (latent presets; K2-style stage 1 reads x itself)
    prep1 = (config.x_prepared and cfg.latent and d % 8 == 0
             and mma_tile(config, w13, 1, plan.block_m, n_tiles, i) is not None)
    z_mma = torch.empty((m, d), device=x.device, dtype=torch.bfloat16) if prep1 else None
    a_mma = prepared_a(config, w2, plan, n_tiles, deterministic)
    z, shared_a = latent_down(x, weights["latent_down"] if cfg.latent else None,
                              weights["shared_w13"] if cfg.shared_intermediate else None,
                              activation=cfg.activation, situ_beta=betas[0],
                              situ_linear_beta=betas[1], z_mma_out=z_mma, config=config)
    sync = torch.empty(2, device=x.device, dtype=torch.int32)
    front = z is not None or shared_a is not None  # a launch between the plan and stage 1
    a = _launch_stage1(config, z if cfg.latent else x, plan, w13, act, *betas, n_tiles,
                       sync=sync, z_mma=z_mma, a_mma_out=a_mma, pdl=front)
    stage2 = _stage2_args(config, a, plan, w2, deterministic, n_tiles, a_mma)
    if not cfg.latent and shared_a is None:  # K2-style without shared experts: y is the output
        _launch_stage2_tail(config, stage2, None, pdl=True)
        return stage2[2].to(torch.bfloat16)
    shared_w2 = weights["shared_w2"] if shared_a is not None else None
    if cfg.latent:
        tail = _tail_args(config, stage2[2], weights["latent_norm"], weights["latent_up"], None,
                          shared_a, shared_w2, cfg.rms_eps)
    else:
        tail = _tail_args(config, stage2[2], None, None, None, shared_a, shared_w2, cfg.rms_eps)
    if fuse_tail:
        _launch_stage2_tail(config, stage2, tail, sync)
    else:
        _launch_stage2_tail(config, stage2, None, pdl=True)
        _launch_stage2_tail(config, None, tail, pdl=True)
    return tail[2]


def _front_config(m: int, rows: int, k: int, gated: bool, overlap: bool, config: MoEConfig,
                  tiling: GemvConfig | None = None) -> GemvConfig | None:
    """A front GEMV's tiling: ``tiling`` (None: the dense defaults); after an early-dependents
    route, :func:`front_config` of it."""
    return front_config(m, rows, k, gated, config, tiling) if overlap else tiling


def _check_front(front, x, d, s) -> None:
    check_tensor("front", front, dtypes=(torch.bfloat16,), dim=2, device=x.device)
    if tuple(front.shape) != (d + 2 * s, x.shape[1]):
        raise ValueError(f"front: expected [D + 2S, H] = [{d + 2 * s}, {x.shape[1]}] (latent "
                         f"down rows, then shared gate and up rows), got {list(front.shape)}")


def _dense_block(x, weights, cfg, plan, w13, w2, act, betas, n_tiles, deterministic, config,
                 overlap=False, front=None):
    """moe_block with ``config.dense_projections``: one dense GEMV launch for the GEMVs of x
    (latent down and, merged, the shared gate/up: ``weights["front"]``, else two launches),
    stage 1, stage 2 alone, then RMSNorm(y) @ W_up^T + a_s @ W_s2^T as one dense GEMV (the norm
    in its prologue, the shared down-projection its second product): 4 launches given a plan
    (5 with ``config.shared_beside_stage1``: the shared gate/up between the stages; with
    ``config.shared_down_launch`` "stage1" or "stage2" the shared down-projection runs in that
    stage's launch and the tail adds it).
    overlap: the front follows a route_sort launched with early dependents (MoEConfig.
    front_overlaps_route) and waits for it only at its end. front: (z, a_s), already computed
    in the route's launch (front_route, MoEConfig.front_routes): stage 1 then launches
    plainly (that launch lets its dependents start before its last program has sorted)."""
    m, d = x.shape[0], cfg.moe_in
    h, s = x.shape[1], cfg.shared_intermediate
    a_s = None
    beside = bool(s) and config.shared_beside_stage1
    if front is not None:
        z, a_s = front
    elif not s or beside:  # beside: the merged front's tiles, so z keeps its sums
        z = dense_gemv(x, weights["latent_down"],
                       config=_front_config(m, d, h, False, overlap, config,
                                            front_tiling(m, d, h, False) if beside else None))
    elif "front" in weights:
        _check_front(weights["front"], x, d, s)
        z, a_s = dense_gemv(x, weights["front"], splits=(d, 2 * s), activation=cfg.activation,
                            situ_beta=betas[0], situ_linear_beta=betas[1],
                            config=_front_config(m, d + s, h, True, overlap, config,
                                                 front_tiling(m, d + s, h, True)))
    else:
        z = dense_gemv(x, weights["latent_down"],
                       config=_front_config(m, d, h, False, overlap, config))
        a_s = dense_gemv(x, weights["shared_w13"], activation=cfg.activation,
                         situ_beta=betas[0], situ_linear_beta=betas[1],
                         config=_front_config(m, s, h, True, overlap, config))
    # the shared down-projection in a stage's launch (shared_down_launch): the tail adds its
    # fp32 result as a residual
    down_beside = a_s is not None and not beside and config.shared_down_launch != "tail"
    extra = {}
    if beside:
        extra = dict(shared_x=x, shared_w13=weights["shared_w13"])
    elif down_beside:
        extra = dict(shared_a=a_s, shared_w2=weights["shared_w2"])
    # Stage 1 reads the plan before its PDL wait, which is safe only if its predecessor waited
    # for the route before letting it start: an overlapping front (wait_last) does so only
    # with front_triggers_last.
    y = moe_experts(z, plan, w13, w2, activation=cfg.activation, situ_beta=betas[0],
                    situ_linear_beta=betas[1], deterministic=deterministic,
                    pdl=front is None and (not overlap or config.front_triggers_last),
                    config=config, **extra)
    if beside:
        y, a_s = y
    if down_beside:
        y, shared_out = y
        tail = None
        if config.tail_second_first and config.shared_down_launch == "stage1":
            # stage 2's tiles let the tail start only after their wait for stage 1
            tail = dataclasses.replace(call_config(None, m, h, d), second_first=True)
        return dense_gemv(y, weights["latent_up"], norm_weight=weights["latent_norm"],
                          eps=cfg.rms_eps, residual=shared_out, config=tail)
    shared = {} if a_s is None else {"x2": a_s, "weight2": weights["shared_w2"]}
    tail = None
    if front is not None and a_s is not None and config.tail_second_first:
        # a_s is the route's launch's, which stage 1 waited for whole (a plain launch)
        tail = dataclasses.replace(call_config(None, m, h, d), second_first=True)
    return dense_gemv(y, weights["latent_up"], norm_weight=weights["latent_norm"],
                      eps=cfg.rms_eps, config=tail, **shared)
