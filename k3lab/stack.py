"""The campaign as a stack of changes over the decode step, with one owner per op.

A :class:`Change` names the ops of the decode step (``k3lab.ops``) that it takes over from the
reference. :func:`compose` checks a stack: every op has at most one owning change (two claimants
of one op is an error naming both and the op), required changes are present, and a change never
sits beside one it supersedes. Ops nobody claims run their reference.

:func:`run_layer` runs one decode layer (``k3lab.reference.layer.make_layer`` state) with each op
taken by its owner's fused kernel or else its reference; :func:`measure_stack` times a stack's
KDA and MLA layers each as one replayed CUDA graph and projects the time per token over the
model's layers; :func:`waterfall` adds the catalogue's changes one at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd
import torch

from k3lab import profile
from k3lab.config import Preset
from k3lab.ops import layer_ops
from k3lab.reference import attn_res as ref_attn_res
from k3lab.reference import kda as ref_kda
from k3lab.reference import mla as ref_mla
from k3lab.reference import moe as ref_moe
from k3lab.reference import route as ref_route
from k3lab.reference.layer import make_layer

__all__ = ["Change", "CATALOGUE", "Stack", "compose", "run_layer", "measure_stack",
           "waterfall", "PROJECTION_LEAVES_OUT"]


@dataclass(frozen=True)
class Change:
    """One banked change: the ops it owns, what it needs and what it replaces."""

    name: str
    title: str
    owns: tuple[str, ...]
    requires: tuple[str, ...] = ()
    supersedes: tuple[str, ...] = ()
    seed_commit: str = ""


def _both_reads(*ops: str) -> tuple[str, ...]:
    return tuple(f"{op}@{site}" for site in ("attn", "ffn") for op in ops)


# The seed PR's nine changes in its order, then the paired AttnRes + RMSNorm fusion.
CATALOGUE: tuple[Change, ...] = (
    Change("mla-split-override", "MLA split override for graph decode", ("mla.attention",),
           seed_commit="ac4ba2dfe3"),
    Change("route-sort", "fused routing + sort metadata (FP32 logits, bias, top-k, sort)",
           ("moe.gate_proj", "moe.route_select", "moe.sort"),
           supersedes=("b1-gate-projection",), seed_commit="2790dbfe9a"),
    Change("b1-gate-projection", "specialized B1 gate projection (split-K GEMV)",
           ("moe.gate_proj",), seed_commit="d1a3ef562d"),
    Change("stage1-direct-tile", "B1 stage-1 direct tile (w13 GEMVs + SiTU)", ("moe.stage1",),
           seed_commit="c257ea6509"),
    Change("atomic-stage2", "atomic stage-2 reduction (w2 GEMVs + weighted sum)",
           ("moe.stage2",), seed_commit="8687dca545"),
    Change("fused-kda-decode", "fused KDA decode (gate, beta, L2 norm, recurrence)",
           ("kda.gate", "kda.beta", "kda.l2norm", "kda.recurrence"), seed_commit="15d1d1744f"),
    Change("kda-fb-fusion", "f_b projection fused into KDA decode", ("kda.f_b_proj",),
           requires=("fused-kda-decode",), seed_commit="95dfd13ee8"),
    Change("fused-latent-tail", "fused latent MoE tail (norm, up-projection, shared add)",
           ("moe.latent_norm", "moe.latent_up", "moe.shared_add"), seed_commit="d4fb7ab2b4"),
    Change("prepared-routing-handoff", "stages consume the prepared routing (no second sort)",
           ("moe.expert_align",), seed_commit="459601b680"),
    Change("attn-res-rmsnorm", "AttnRes read + RMSNorm in one launch (vLLM side, RES-1)",
           _both_reads("attn_res.read", "attn_res.norm")),
)
CHANGES = {c.name: c for c in CATALOGUE}

PROJECTION_LEAVES_OUT = (
    "the embedding, the final norm and the LM head (one per token)",
    "layer 0's dense MLP (counted as a KDA layer with the latent MoE)",
    "communication between the tp GPUs (two all-reduces per layer at tp > 1)",
    "sampling and the host's scheduling between steps",
    "dense projections run as the reference writes them (fp32 math over bf16 weights) in every "
    "stack, so they weigh more than cuBLAS bf16 GEMVs would",
)


@dataclass(frozen=True)
class Stack:
    """A checked set of changes: ``owner[op]`` is the owning change's name or None."""

    changes: tuple[Change, ...]
    owner: dict

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.changes)

    def fused(self, op: str) -> bool:
        return self.owner.get(op) is not None


def compose(changes: Iterable[str | Change]) -> Stack:
    """Check and build a stack. Raises ValueError on an unknown change, a missing requirement, a
    change beside one it supersedes, or two changes owning one op (naming both and the op)."""
    chosen: list[Change] = []
    for c in changes:
        if isinstance(c, str):
            if c not in CHANGES:
                raise ValueError(f"changes: unknown change {c!r}; expected one of "
                                 f"{list(CHANGES)}")
            c = CHANGES[c]
        if c.name in {x.name for x in chosen}:
            raise ValueError(f"changes: {c.name!r} is listed twice")
        chosen.append(c)
    names = {c.name for c in chosen}
    all_ops = set(layer_ops("kda")) | set(layer_ops("mla"))
    owner: dict[str, str | None] = dict.fromkeys(sorted(all_ops))
    for c in chosen:
        for req in c.requires:
            if req not in names:
                raise ValueError(f"changes: {c.name!r} requires {req!r}, which is not in the stack")
        for old in c.supersedes:
            if old in names:
                raise ValueError(f"changes: {c.name!r} supersedes {old!r}; keep {c.name!r} alone")
        for op in c.owns:
            if op not in all_ops:
                raise ValueError(f"changes: {c.name!r} owns {op!r}, which is no op of the "
                                 f"decode step")
            if owner[op] is not None:
                raise ValueError(f"changes: op {op!r} has two owners: {owner[op]!r} and "
                                 f"{c.name!r}")
            owner[op] = c.name
    return Stack(tuple(chosen), owner)


# ---------------------------------------------------------------------------------------------
# one layer under a stack


def _kernels():
    from k3lab import kernels
    return kernels


def _read(stack: Stack, state: dict, live: torch.Tensor, site: str) -> torch.Tensor:
    w, cfg = state[f"res_{site}"], state["cfg"]
    args = (state["bank"], live, w["res_norm_weight"], w["res_proj_weight"], w["norm_weight"])
    if stack.fused(f"attn_res.read@{site}"):
        return _kernels().attn_res_norm(*args, eps=cfg.rms_eps)[1]
    return ref_attn_res.attn_res_norm_reference(*args, eps=cfg.rms_eps)[1]


def _kda(stack: Stack, x: torch.Tensor, w: dict, cache: dict, cfg: Preset) -> torch.Tensor:
    if not stack.fused("kda.recurrence"):
        return ref_kda.kda_layer_reference(x, w, cache, cfg)
    m, hl, d = x.shape[0], cfg.kda_heads, cfg.kda_head_dim
    xf = x.float()

    def proj(name):  # as the reference writes the dense projections
        return (xf @ w[name].float().T).to(x.dtype)

    q, k, v = (ref_kda.short_conv_step(proj(f"{n}_proj"), cache[f"{n}_conv_state"],
                                       w[f"{n}_conv"]).view(m, hl, d).to(x.dtype) for n in "qkv")
    f_low, f_b = proj("f_a"), w["f_b"]
    if not stack.fused("kda.f_b_proj"):
        if m != 1:
            raise ValueError("x: the stack runs KDA without the f_b fusion at batch 1 only")
        # f_b projection as the reference does it; the kernel then gets f through a rank-1
        # identity: f_b' = f^T [Hl*d, 1], f_low' = [[1]] (a view, no extra launch)
        f_b = (f_low.float() @ w["f_b"].float().T).to(x.dtype).view(hl * d, 1)
        f_low = torch.ones(1, 1, dtype=x.dtype, device=x.device)
    o = _kernels().kda_decode(q, k, v, f_low, f_b, w["A_log"], w["dt_bias"], proj("b_proj"),
                              cache["state"], lower_bound=cfg.kda_lower_bound)
    o = ref_kda.out_norm_gate(o, proj("g_proj").view(m, hl, d), w["o_norm"], cfg.rms_eps)
    return o.reshape(m, hl * d) @ w["o_proj"].float().T


def _mla(stack: Stack, x: torch.Tensor, state: dict, num_splits: int) -> torch.Tensor:
    attention = None
    if stack.fused("mla.attention"):
        def attention(q_lat, q_rope, kv_cache, seq_lens, *, sm_scale):
            return _kernels().mla_decode(q_lat, q_rope, kv_cache, seq_lens, sm_scale=sm_scale,
                                         num_splits=num_splits)
    return ref_mla.mla_layer_reference(x, state["attn"], state["cache"], state["cfg"],
                                       state["position"], attention=attention)


def _moe(stack: Stack, x: torch.Tensor, w: dict, cfg: Preset) -> torch.Tensor:
    k = _kernels()
    route = dict(top_k=cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                 renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling)
    act = dict(activation=cfg.activation, situ_beta=cfg.situ_beta,
               situ_linear_beta=cfg.situ_linear_beta)
    if stack.fused("moe.route_select"):
        plan = k.route_sort(x, w["gate_weight"], w["correction_bias"], out_dim=cfg.moe_in,
                            **route)
    elif stack.fused("moe.gate_proj"):
        logits = k.gate_logits(x, w["gate_weight"])
        plan = ref_route.route_from_logits_reference(logits, w["correction_bias"],
                                                     out_dim=cfg.moe_in, **route)
    else:
        plan = ref_route.route_sort_reference(x, w["gate_weight"], w["correction_bias"],
                                              out_dim=cfg.moe_in, **route)
    z = (x.float() @ w["latent_down"].float().T).to(x.dtype) if cfg.latent else x
    fused_stage = stack.fused("moe.stage1") or stack.fused("moe.stage2")
    if fused_stage and not stack.fused("moe.expert_align"):
        # without the handoff, the expert kernels align the routing themselves (a second sort)
        plan = ref_route.sort_metadata_reference(plan.topk_ids, plan.topk_weights,
                                                 cfg.n_experts, block_m=1, out_dim=cfg.moe_in)
    if stack.fused("moe.stage1"):
        a = k.moe_stage1(z, plan, w["w13"], **act)
    else:
        a = ref_moe.moe_stage1_reference(z, plan, w["w13"], **act).to(torch.bfloat16)
    if stack.fused("moe.stage2"):
        y = k.moe_stage2(a, plan, w["w2"])
    else:
        y = ref_moe.moe_stage2_reference(a, plan, w["w2"])
    shared = None
    if cfg.shared_intermediate:
        shared = ref_moe.shared_mlp_reference(x, w["shared_w13"], w["shared_w2"], **act)
    norm, up = (w["latent_norm"], w["latent_up"]) if cfg.latent else (None, None)
    if stack.fused("moe.latent_up"):
        return k.latent_moe_tail(y, norm, up, shared, eps=cfg.rms_eps)
    return ref_moe.latent_moe_tail_reference(y, norm, up, shared, cfg.rms_eps)


def run_layer(stack: Stack, state: dict, *, num_splits: int = 4) -> torch.Tensor:
    """One decode layer of ``state`` (``make_layer``) under ``stack``; returns the new live sum.

    num_splits: the fixed MLA split count when the split override is on (graph-safe).
    """
    cfg, live = state["cfg"], state["live"]
    x = _read(stack, state, live, "attn")
    if state["kind"] == "kda":
        a = _kda(stack, x, state["attn"], state["cache"], cfg)
    else:
        a = _mla(stack, x, state, num_splits)
    live = (live.float() + a.float()).to(live.dtype)
    x = _read(stack, state, live, "ffn")
    f = _moe(stack, x, state["moe"], cfg)
    return (live.float() + f.float()).to(live.dtype)


# ---------------------------------------------------------------------------------------------
# measuring stacks


def layer_counts(cfg: Preset) -> dict[str, int]:
    """How many layers of each kind one token runs (layer 0 counted as a KDA layer)."""
    return {"kda": len(cfg.kda_layers), "mla": len(cfg.mla_layers)}


def measure_stack(stack: Stack, cfg: Preset, device, *, seed: int = 0, context: int = 4096,
                  num_splits: int = 4, expert_format: str = "bf16", repeats: int | None = None,
                  states: dict | None = None) -> pd.DataFrame:
    """Launches and latency of one KDA and one MLA layer under ``stack`` (eager, and on a GPU one
    CUDA graph per layer, replayed), and the projected time per token and tok/s.

    states: reuse layer states across stacks ({kind: make_layer(...)}); built when None.
    Rows: stack, kind, metric, value, unit, mode, note.
    """
    dev = torch.device(device)
    counts = layer_counts(cfg)
    states = states or {}
    rows = []
    per_token: dict[str, float] = {}
    modes = ["eager"] + (["graph"] if dev.type == "cuda" else [])
    label = "+".join(stack.names) or "reference"
    for kind, n_layers in counts.items():
        if not n_layers:
            continue
        if kind not in states:
            states[kind] = make_layer(cfg, kind, dev, seed=seed, context=context,
                                      expert_format=expert_format)
        state = states[kind]

        def fn(s, _stack=stack):
            return run_layer(_stack, s, num_splits=num_splits)

        lc = profile.count_launches(fn, state)
        rows.append(dict(stack=label, kind=kind, metric="launches", value=lc.count,
                         unit="launches", mode="", note=lc.kind))
        for mode in modes:
            # a layer graph holds hundreds of kernels: its replay cost is already amortized
            t = profile.time_variant(fn, [state], mode=mode, repeats=repeats, cold=False,
                                     min_calls=1)
            rows.append(dict(stack=label, kind=kind, metric="latency_us", value=t.median_us,
                             unit="us", mode=mode,
                             note=f"{t.repeats} repeats of one layer state (its weights and "
                                  f"caches exceed the L2 at real presets)"))
            per_token[mode] = per_token.get(mode, 0.0) + n_layers * t.median_us
        rows.append(dict(stack=label, kind=kind, metric="launches_per_token",
                         value=n_layers * lc.count, unit="launches", mode="",
                         note=f"{n_layers} layers"))
    for mode, us in per_token.items():
        rows.append(dict(stack=label, kind="token", metric="token_us", value=us, unit="us",
                         mode=mode, note="projected over the layers; see PROJECTION_LEAVES_OUT"))
        rows.append(dict(stack=label, kind="token", metric="tok_per_s", value=1e6 / us,
                         unit="tok/s", mode=mode, note="projected"))
    return pd.DataFrame(rows)


def waterfall(cfg: Preset, device, *, order: Iterable[str] | None = None, **kw) -> pd.DataFrame:
    """Measure the all-reference baseline, then each change of ``order`` (default: the
    catalogue) added in turn. A change that cannot join the stack at its turn (superseded by one
    already there, or missing a requirement) is skipped. Rows as measure_stack plus ``step``
    and ``added``."""
    order = list(order or [c.name for c in CATALOGUE])
    states: dict = {}
    frames = []
    current: list[str] = []
    steps = [("reference", [])]
    for name in order:
        try:
            compose(current + [name])
        except ValueError:
            continue
        current = current + [name]
        steps.append((name, list(current)))
    for i, (added, names) in enumerate(steps):
        df = measure_stack(compose(names), cfg, device, states=states, **kw)
        frames.append(df.assign(step=i, added=added))
    return pd.concat(frames, ignore_index=True)
