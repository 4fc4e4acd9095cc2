"""The latent MoE block under a stack: routing, the front, the expert stages and the tail
as the stack's owners launch them."""

from __future__ import annotations

from dataclasses import replace

import torch

from k3lab.config import Preset
from k3lab.reference import moe as ref_moe
from k3lab.reference import route as ref_route
from k3lab.reference.dense import rms_norm

from .base import _act, _kernels, _linear, _Run


def _route(run: _Run, x, w: dict, cfg: Preset, early: bool = False):
    """The plan; ``early``: route_sort lets the next launch (an overlapping MoE front) start
    at once."""
    route = dict(top_k=cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                 renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling)
    k = _kernels()
    if run.stack.owned_by("moe.route_select", "route-sort"):
        rc = run.configs.route
        if early:
            rc = replace(rc or k.RouteConfig(), early_dependents=True)
        return k.route_sort(x, w["gate_weight"], w["correction_bias"], out_dim=cfg.moe_in,
                            config=rc, **route)
    if run.fused("moe.gate_proj"):
        logits = k.gate_logits(x, w["gate_weight"], config=run.configs.route)
        return ref_route.route_from_logits_reference(logits, w["correction_bias"],
                                                     out_dim=cfg.moe_in, **route)
    return ref_route.route_sort_reference(x, w["gate_weight"], w["correction_bias"],
                                          out_dim=cfg.moe_in, **route)


def _persistent(x, w: dict, cfg: Preset, variant: str = "persistent") -> torch.Tensor:
    """A persistent variant of the moe boundary on the whole block (routing included)."""
    from k3lab.boundaries import get
    from k3lab.boundaries.moe import Weights

    inputs = {"x": x, "weights": Weights(w), "cfg": cfg, "plan": None, "route": True,
              "block_m": 1}
    return get("moe").variant(variant).fn(inputs)


def _kernel_experts(w: dict) -> dict:
    """The experts in the fused kernels' layout (``moe_kernel_weights``: MXFP4 tiled), made on
    the first fused call (an eager one, before any capture) and kept in ``w``, as an engine lays
    out its checkpoint at load time."""
    if "kernel_experts" not in w:
        w["kernel_experts"] = _kernels().moe_kernel_weights({n: w[n] for n in ("w13", "w2")})
    return w["kernel_experts"]


def _front_flags(run: _Run, w: dict):
    """(merged, overlap, pair, beside, fused_front) of the MoE block's launches under ``run``
    (see :func:`_moe`)."""
    k = _kernels()
    merged = "front" in w and all(run.stack.owned_by(op, "dense-gemv")
                                  for op in ("moe.latent_down", "moe.shared"))
    moe_cfg = run.configs.moe or k.MoEConfig()
    # as moe_block: the merged front reads x alone, so it may overlap route_sort (compiled, PDL)
    # (a config that is not a MoEConfig is left for moe_experts to refuse)
    overlap = (merged and run.stack.owned_by("moe.route_select", "route-sort")
               and not k.INTERPRETED and isinstance(moe_cfg, k.MoEConfig)
               and moe_cfg.pdl and moe_cfg.front_overlaps_route)
    pair = run.fused("moe.stage1") and run.fused("moe.stage2")
    # the shared gate/up between the expert stages (moe_experts(shared_x=...); MoEConfig.
    # shared_beside_stage1), counted with the MoE experts' launches
    beside = (merged and pair and isinstance(moe_cfg, k.MoEConfig)
              and moe_cfg.shared_beside_stage1)
    # route_sort's programs and the merged front's in one launch (MoEConfig.front_routes),
    # counted with the dense projections
    fused_front = (merged and not beside and isinstance(moe_cfg, k.MoEConfig)
                   and moe_cfg.front_routes
                   and run.stack.owned_by("moe.route_select", "route-sort"))
    return merged, overlap, pair, beside, fused_front


def _ffn_mixes(run: _Run, state: dict) -> bool:
    """Whether the layer's FFN consumer can take the read from its producer's sums: layer 0's
    gate/up projection as the dense GEMV, or the MoE front's fused launch."""
    if "mlp" in state:
        return run.stack.owned_by("mlp.gate_up", "dense-gemv")
    return (not run.stack.owned_by("moe.stage1", "persistent-moe")
            and _front_flags(run, state["moe"])[4])


def _moe(run: _Run, x, w: dict, cfg: Preset, residual: torch.Tensor, next_sums=None,
         read=None) -> tuple[torch.Tensor, bool]:
    """(the latent MoE's output [M, H] bf16 or fp32, whether ``residual`` is already added).
    next_sums: the next read's ReadSums, left by the tail's dense GEMV (where
    :func:`leaves_read_sums`). read: a ReadInput (x is then its live sum) the fused front
    mixes its input from (where :func:`_ffn_mixes`)."""
    tag = run.tag
    fp8_tail = "fp8-latent-tail" in run.stack.names and cfg.latent
    if run.stack.owned_by("moe.stage1", "persistent-moe"):
        if read is not None:
            raise ValueError("read: the persistent MoE takes x itself, not an AttnRes read")
        tag("MoE experts")
        if run.record is not None:
            run.record.append(None)
        return _persistent(x, w, cfg, "persistent_fp8_tail" if fp8_tail else "persistent"), False
    k, act = _kernels(), _act(cfg)
    moe_cfg = run.configs.moe or k.MoEConfig()
    merged, overlap, pair, beside, fused_front = _front_flags(run, w)
    if read is not None and not fused_front:
        raise ValueError("read: only the MoE front's fused launch mixes an AttnRes read")
    if fused_front:
        tag("dense projections")
        plan, (z, shared_a) = k.front_route(
            x, w["gate_weight"], w["correction_bias"], w["front"], splits=w["front_splits"],
            **act, top_k=cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
            renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling,
            out_dim=cfg.moe_in, route_config=run.configs.route,
            gemv_config=run.configs.front or run.configs.gemv, pdl=moe_cfg.pdl,
            max_registers=moe_cfg.front_route_registers, read_input=read)
    else:
        tag("routing")
        plan = _route(run, x, w, cfg, early=overlap)
    if run.record is not None:
        run.record.append(plan.topk_ids.clone())
    tag("dense projections")
    if merged and not fused_front:
        # latent down and the shared gate/up read the same x: one launch over the merged rows
        # (the latent rows alone when the shared gate/up goes beside stage 1)
        from k3lab.kernels.dense import dense_gemv
        from k3lab.kernels.moe import front_tiling
        gc = run.configs.front or run.configs.gemv
        d, s2 = w["front_splits"]
        if gc is None:  # the merged front's tiles, as in front_route's launch (beside: z's)
            gc = (front_tiling(x.shape[0], d, x.shape[1], False) if beside else
                  front_tiling(x.shape[0], d + s2 // 2, x.shape[1], True))
        if overlap:  # it waits for the route only before its programs exit
            gc = replace(gc, pdl=True, wait_last=True, trigger_last=moe_cfg.front_triggers_last)
        if beside:
            z, shared_a = dense_gemv(x, w["latent_down"], config=gc), None
        else:
            z, shared_a = dense_gemv(x, w["front"], splits=w["front_splits"], config=gc, **act)
    elif not merged:
        z = _linear(run, "moe.latent_down", x, w["latent_down"]) if cfg.latent else x
        shared_a = (_linear(run, "moe.shared", x, w["shared_w13"], **act)
                    if cfg.shared_intermediate else None)
    fused_stage = run.fused("moe.stage1") or run.fused("moe.stage2")
    handoff = run.fused("moe.expert_align")
    if fused_stage and not handoff:
        # without the handoff, the expert kernels align the routing themselves (a second sort)
        tag("routing")
        plan = ref_route.sort_metadata_reference(plan.topk_ids, plan.topk_weights,
                                                 cfg.n_experts, block_m=1, out_dim=cfg.moe_in)
    tag("MoE experts")
    experts = _kernel_experts(w) if fused_stage else w
    # the shared down-projection and the residual in an expert stage's launch, the tail's
    # residual their sum (MoEConfig.shared_down_launch; the dense tail below only)
    down_beside = (pair and not beside and shared_a is not None and cfg.latent
                   and run.fused("moe.latent_up") and isinstance(moe_cfg, k.MoEConfig)
                   and moe_cfg.shared_down_launch != "tail")
    if pair:
        # moe_block's pair: stage 1 zeroes stage 2's accumulator, stage 2 follows by PDL; stage
        # 1 by PDL too where the plan was written two launches earlier (the handoff's route)
        # (after an overlapping front only if it lets stage 1 start after its wait for the
        # route: stage 1 reads the plan before its PDL wait)
        extra = {}
        if beside:
            extra = dict(shared_x=x, shared_w13=w["shared_w13"])
        elif down_beside:
            extra = dict(shared_a=shared_a, shared_w2=w["shared_w2"], shared_residual=residual,
                         shared_config=run.configs.shared_down)
        y = k.moe_experts(z, plan, experts["w13"], experts["w2"], **act,
                          pdl=(handoff and not fused_front
                               and (not overlap or moe_cfg.front_triggers_last)),
                          config=run.configs.moe, **extra)
        if beside:
            y, shared_a = y
        elif down_beside:
            y, shared_res = y
    else:
        if run.fused("moe.stage1"):
            a = k.moe_stage1(z, plan, experts["w13"], **act, config=run.configs.moe)
        else:
            a = ref_moe.moe_stage1_reference(z, plan, w["w13"], **act).to(torch.bfloat16)
        if run.fused("moe.stage2"):
            y = k.moe_stage2(a, plan, experts["w2"], config=run.configs.moe)
        else:
            y = ref_moe.moe_stage2_reference(a, plan, w["w2"])
    shared = {"a": shared_a, "w2": w["shared_w2"]} if shared_a is not None else None
    norm, up = (w["latent_norm"], w["latent_up"]) if cfg.latent else (None, None)
    if run.fused("moe.latent_up"):
        tag("dense projections")
        if cfg.latent and shared is not None:
            # the MoE block's dense_projections tail: one dense GEMV launch, the RMSNorm in its
            # prologue, the shared down-projection its second product, the residual its epilogue
            # (fp8-latent-tail: the up-projection's e4m3 rows, scaled per row)
            from k3lab.boundaries.moe import fp8_tail_rows
            from k3lab.kernels.dense import dense_gemv
            q = fp8_tail_rows(up) if fp8_tail else None
            tc = run.configs.tail or run.configs.gemv
            if down_beside:
                # the shared down-projection and the residual are a stage's launch's: the
                # tail's residual. Stage 1's the tail may load before its wait (it starts once
                # stage 2's tiles have waited for stage 1); stage 2's GEMV programs let the
                # tail start as they start, so their result is read after the wait
                early = moe_cfg.shared_down_launch == "stage1"
                second = dict(residual=shared_res)
            else:
                # the shared activation is the route's launch's, which stage 1 waited for
                # whole (a plain launch), and the residual older: both before the tail's wait
                early = fused_front and moe_cfg.shared_down_launch == "tail"
                second = dict(x2=shared_a, weight2=shared["w2"], residual=residual)
            if early and moe_cfg.tail_second_first:
                from k3lab.kernels.dense import call_config
                tc = replace(call_config(tc, x.shape[0], up.shape[0], up.shape[1],
                                         e4m3=fp8_tail), second_first=True)
            return dense_gemv(y, q.values if fp8_tail else up, norm_weight=norm,
                              eps=cfg.rms_eps, weight_scale=q.scales if fp8_tail else None,
                              config=tc, read_sums=next_sums, **second), True
        if fp8_tail:
            raise ValueError("stack: fp8-latent-tail runs in the persistent MoE launch or the "
                             "fused tail's dense GEMV, which needs shared experts; this preset "
                             "has none")
        return k.latent_moe_tail(y, norm, up, shared, eps=cfg.rms_eps), False
    out = y
    if cfg.latent:
        tag("norms")
        n = rms_norm(y, norm, cfg.rms_eps).to(torch.bfloat16)
        tag("dense projections")
        out = _linear(run, "moe.latent_up", n, up)
    if shared is not None:
        tag("dense projections")
        out = _linear(run, "moe.shared", shared_a, shared["w2"], residual=out.to(x.dtype))
    return out, False
