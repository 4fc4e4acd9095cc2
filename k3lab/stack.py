"""The campaign as stacks of changes over the decode token, with one owner per op.

A :class:`Change` names the ops of the decode step (``k3lab.ops`` plus :data:`TOKEN_OPS`) that
it takes over. :func:`compose` checks a stack: every op has at most one owning change (two
claimants of one op is an error naming both and the op), required changes are present, and a
change never sits beside one it supersedes. Ops nobody claims run as an engine's eager model code
runs them: the projections as bf16 ``F.linear`` (cuBLAS), merged where engines merge them (a
KDA layer's q, k, v, f_a, beta and g; an MLA layer's q_a, kv_a and g), every other op as its
boundary's unfused reference. That empty stack is the **engine baseline**, the speed reference;
the op-by-op fp32 reference (``k3lab.reference.layer``) is the correctness truth only.

:data:`STACKS` holds the two stacks as data: the seed PR's 9-change ``integration`` stack (plus
the AttnRes + RMSNorm fusion and the dense GEMV), and the ``reviewed`` decomposition the seed
closed it for, where the persistent MoE boundary owns routing, the route-to-expert handoff and
both stages. A change whose kernel is absent here (:meth:`Change.missing`) composes but is
skipped when run (:func:`runnable`).

:func:`run_layer` runs one layer, :func:`run_token` the whole token (embedding, layer 0's dense
MLP, the layers with their AttnRes reads and block sums, the final read and norm, the LM head).
``tag(category)`` callbacks mark where each category's launches start (for profiling).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from k3lab.config import Preset
from k3lab.ops import layer_ops
from k3lab.reference import attn_res as ref_attn_res
from k3lab.reference import kda as ref_kda
from k3lab.reference import mla as ref_mla
from k3lab.reference import moe as ref_moe
from k3lab.reference import route as ref_route
from k3lab.reference.dense import dense_engine, rms_norm

__all__ = ["Change", "CATALOGUE", "CHANGES", "STACKS", "CANDIDATES", "TOKEN_OPS", "Stack",
           "compose", "runnable", "steps", "Configs", "run_layer", "run_token", "layer_counts",
           "CATEGORIES"]

# Ops once a token, outside the layers (layer 0's dense MLP replaces its MoE).
TOKEN_OPS = ("token.embed", "mlp.gate_up", "mlp.down", "token.final_read", "token.lm_head")
# Where a token's time goes; every launch of run_token is tagged with one of these.
CATEGORIES = ("dense projections", "routing", "MoE experts", "KDA", "MLA", "AttnRes", "norms")


@dataclass(frozen=True)
class Change:
    """One change: the ops it owns, what it needs and what it replaces.

    needs: ``"boundary:variant"`` kernels it runs through the registry; when one is absent the
    change still composes (its ownership is data) but :func:`runnable` skips it, saying why.
    """

    name: str
    title: str
    owns: tuple[str, ...]
    requires: tuple[str, ...] = ()
    supersedes: tuple[str, ...] = ()
    seed_commit: str = ""
    needs: tuple[str, ...] = ()

    def missing(self) -> str | None:
        """Why this change cannot run here (a needed boundary variant is absent), or None."""
        from k3lab import boundaries

        for need in self.needs:
            boundary, variant = need.split(":")
            try:
                boundaries.get(boundary).variant(variant)
            except KeyError:
                return (f"{self.name} skipped: the {boundary} boundary has no variant "
                        f"{variant!r} yet")
        return None


def _both_reads(*ops: str) -> tuple[str, ...]:
    return tuple(f"{op}@{site}" for site in ("attn", "ffn") for op in ops)


DENSE_OPS = ("kda.q_proj", "kda.k_proj", "kda.v_proj", "kda.f_a_proj", "kda.beta_proj",
             "kda.g_proj", "kda.o_proj", "mla.q_a_proj", "mla.q_a_norm", "mla.q_b_proj",
             "mla.kv_a_proj", "mla.g_proj", "mla.o_proj", "moe.latent_down", "moe.shared",
             "mlp.gate_up", "mlp.down", "token.lm_head")

# The seed PR's nine changes in its order, the paired AttnRes + RMSNorm fusion, the dense GEMV,
# KDA decode's neighbours (kda_decode's conv= and out_gate=), then the reviewed decomposition's
# own changes.
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
           _both_reads("attn_res.read", "attn_res.norm") + ("token.final_read",)),
    Change("dense-gemv", "dense B1 GEMV for every projection (merged per layer; norm, "
           "activation and residual in its prologue / epilogue)", DENSE_OPS),
    Change("kda-conv-fusion", "short-conv step + SiLU fused in front of KDA decode",
           ("kda.short_conv",), requires=("fused-kda-decode",)),
    Change("kda-out-gate-fusion", "output RMSNorm * sigmoid gate fused behind KDA decode",
           ("kda.out_norm_gate",), requires=("fused-kda-decode",)),
    Change("mla-absorb-fusion", "MLA decode's neighbours: latent norm, cache append and q "
           "absorb in one launch; v absorb and output gate in one",
           ("mla.kv_a_norm", "mla.cache_append", "mla.q_absorb", "mla.v_absorb",
            "mla.out_gate")),
    Change("persistent-moe", "single-owner persistent MoE boundary (aiter#2, A8W4 there; run "
           "here as W4A16, the faster format of the moe boundary's persistent variants): "
           "routing, the route-to-expert handoff and both stages in one launch",
           ("moe.route_select", "moe.sort", "moe.expert_align", "moe.stage1", "moe.stage2"),
           needs=("moe:persistent",)),
    Change("fp8-latent-tail", "FP8 latent tail up-projection (per-channel scales; #18): in "
           "the persistent MoE launch, or in the fused tail's dense GEMV", (),
           requires=("fused-latent-tail",), needs=("moe:persistent_fp8_tail",)),
)
CHANGES = {c.name: c for c in CATALOGUE}

# Both stacks in the order their waterfalls add the changes. integration: the seed PR's stack as
# it banked it (the gate projection is skipped: route-sort supersedes it), then the workbench's
# own: the dense GEMV, KDA decode's two neighbours and MLA's, then the seed's FP8 latent tail
# (#18) in the dense tail. reviewed: #20, #2, #6, #16 (KDA decode + f_b), #17, #18, the
# vLLM-side AttnRes boundary (#10), then the same four.
STACKS: dict[str, tuple[str, ...]] = {
    "integration": ("mla-split-override", "route-sort", "b1-gate-projection",
                    "stage1-direct-tile", "atomic-stage2", "fused-kda-decode", "kda-fb-fusion",
                    "fused-latent-tail", "prepared-routing-handoff", "attn-res-rmsnorm",
                    "dense-gemv", "kda-conv-fusion", "kda-out-gate-fusion",
                    "mla-absorb-fusion", "fp8-latent-tail"),
    "reviewed": ("mla-split-override", "persistent-moe", "b1-gate-projection",
                 "fused-kda-decode", "kda-fb-fusion", "fused-latent-tail", "fp8-latent-tail",
                 "attn-res-rmsnorm", "dense-gemv", "kda-conv-fusion", "kda-out-gate-fusion",
                 "mla-absorb-fusion"),
}
# Catalogued, checked on the CPU, not yet in either stack: a change joins a stack once the H200
# has run its kernels and the decode-step report has measured it.
CANDIDATES: tuple[str, ...] = ()


def all_ops() -> tuple[str, ...]:
    return tuple(sorted(set(layer_ops("kda")) | set(layer_ops("mla")) | set(TOKEN_OPS)))


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

    def owned_by(self, op: str, name: str) -> bool:
        return self.owner.get(op) == name


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
    ops = set(all_ops())
    owner: dict[str, str | None] = dict.fromkeys(sorted(ops))
    for c in chosen:
        for req in c.requires:
            if req not in names:
                raise ValueError(f"changes: {c.name!r} requires {req!r}, which is not in the stack")
        for old in c.supersedes:
            if old in names:
                raise ValueError(f"changes: {c.name!r} supersedes {old!r}; keep {c.name!r} alone")
        for op in c.owns:
            if op not in ops:
                raise ValueError(f"changes: {c.name!r} owns {op!r}, which is no op of the "
                                 f"decode step")
            if owner[op] is not None:
                raise ValueError(f"changes: op {op!r} has two owners: {owner[op]!r} and "
                                 f"{c.name!r}")
            owner[op] = c.name
    return Stack(tuple(chosen), owner)


def runnable(stack: Stack) -> tuple[Stack, list[str]]:
    """``stack`` without the changes whose kernels are absent (and those requiring them), and a
    note for each change left out."""
    notes, kept = [], []
    for c in stack.changes:
        why = c.missing()
        if why is None and any(r not in {k.name for k in kept} for r in c.requires):
            why = f"{c.name} skipped: it requires a change that was skipped"
        if why:
            notes.append(why)
        else:
            kept.append(c)
    return compose(kept), notes


def steps(order: Iterable[str]) -> list[tuple[str, list[str]]]:
    """The waterfall's steps over ``order``: ("engine baseline", []) then each change added in
    turn; a change that cannot join at its turn (superseded by one already there, or missing a
    requirement) is skipped. Returns (change added, the stack's change names) per step."""
    out: list[tuple[str, list[str]]] = [("engine baseline", [])]
    current: list[str] = []
    for name in order:
        try:
            compose(current + [name])
        except ValueError:
            continue
        current = current + [name]
        out.append((name, list(current)))
    return out


def layer_counts(cfg: Preset) -> dict[str, int]:
    """How many layers of each kind one token runs (layer 0 counted as a KDA layer)."""
    return {"kda": len(cfg.kda_layers), "mla": len(cfg.mla_layers)}


# ---------------------------------------------------------------------------------------------
# one layer under a stack


def _kernels():
    from k3lab import kernels
    return kernels


def _noop(_category: str) -> None:
    return None


@dataclass(frozen=True)
class Configs:
    """The tuning configs a run passes to the launchers (None: each launcher's default):
    gemv a ``GemvConfig`` (dense_gemv), route a ``RouteConfig`` (route_sort, gate_logits),
    attn_res an ``AttnResConfig`` (attn_res_norm), kda a ``KDAConfig`` (kda_decode), mla an
    ``MLAConfig`` (mla_decode), moe a ``MoEConfig`` (moe_experts, moe_stage1, moe_stage2), tail
    a ``GemvConfig`` for the latent MoE tail's dense GEMV alone (None: gemv's), front one for the
    MoE front's merged GEMV alone (latent down and shared gate/up, in the router's launch or
    its own; None: gemv's, else the front's own tiling; the launch sets PDL and its waits),
    shared_down one for the shared down-projection's programs in an expert stage's launch
    (``MoEConfig.shared_down_launch``; None: those programs' own tiling), o_proj one for the
    attention's output projections alone (KDA and MLA; None: gemv's).
    read_sums: the attention's output projection (the dense GEMV) leaves the FFN read's sums
    in its epilogue, and that read only mixes (``kernels/attn_res_sums.py``; where the read,
    and the projection by the dense GEMV, are fused); read_sums_registers: that projection's
    register cap (GemvConfig.max_registers; 0: its tiling's own). The sums cost K3's output
    projection 9-20 registers a thread above its 70 (offline sm_90 build): 5-6 programs an
    SM where 7 fit its one-wave grid; capped at 72 it spills 24-40 bytes. Off: slower in
    the token than the one-pass read (docs/decisions.md, AttnRes).
    o_proj_prefetch, in_proj_prefetch: weight steps the attention's output projections (KDA,
    MLA), or its merged input projections, ask of L2 before their PDL wait
    (GemvConfig.prefetch_steps, on their tiling; None: the tiling's own). The prefetch runs
    only while the launch before lets them start early: the MLA v absorb does, the KDA
    decode with ``KDAConfig.pdl`` and the AttnRes read do. By default the input projections
    ask for their first step, which streams while the AttnRes read before them runs
    (docs/decisions.md, decode token).
    kda_rms_in_o_proj: with the KDA output gate fused, its per-head RMS is left to the output
    projection (``KDAOutGate.rms_by_consumer``): the decode's v-tiles never wait for each
    other, and the dense GEMV scales each head of x in its prologue (``head_sums``); where
    o_proj is the engine's call, the scaling is a torch op before it.
    attn_read_in_proj: the attention read of a layer whose previous layer ends in a dense GEMV
    (the MoE tail, layer 0's down projection) has no launch: that GEMV leaves the read's sums
    in its epilogue and the merged input projection (the dense GEMV) mixes its input from
    them as it loads it (``dense_gemv(read_input=...)``, ``kernels/dense/mix.py``); a block's
    first read, of sealed rows only, keeps its launch. attn_read_registers: that input
    projection's register cap (GemvConfig.max_registers; 0: its tiling's own). The mix takes
    K3 tp 8's KDA input projection from 127 registers a thread to 145-156 (offline sm_90
    build): 3 programs an SM instead of 4; capped at 128 it does not spill.
    ffn_read_in_front: the FFN read has no launch where its consumer can mix it: the output
    projection leaves its sums (as with read_sums) and the MoE front's fused launch
    (``front_route(read_input=...)``, its router and merged GEMV) or layer 0's gate/up
    projection mixes its input from them; elsewhere the read is the mix launch."""

    gemv: object = None
    route: object = None
    attn_res: object = None
    kda: object = None
    mla: object = None
    moe: object = None
    tail: object = None
    front: object = None
    shared_down: object = None
    o_proj: object = None
    read_sums: bool = False
    read_sums_registers: int = 72
    o_proj_prefetch: int | None = None
    in_proj_prefetch: int | None = 1
    kda_rms_in_o_proj: bool = False
    attn_read_in_proj: bool = False
    attn_read_registers: int = 128
    ffn_read_in_front: bool = False

    def __post_init__(self):
        for name in ("kda_rms_in_o_proj", "attn_read_in_proj", "ffn_read_in_front"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Configs.{name}: expected a bool, got "
                                 f"{getattr(self, name)!r}")
        for name in ("read_sums_registers", "attn_read_registers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 255:
                raise ValueError(f"Configs.{name}: expected an int in 0..255 (0: no cap), got "
                                 f"{v!r}")
        for name in ("o_proj_prefetch", "in_proj_prefetch"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                  or not 0 <= v <= 8):
                raise ValueError(f"Configs.{name}: expected None or an int in 0..8, got {v!r}")

    def for_op(self, op: str):
        """The GemvConfig a projection ``op`` takes (None: the launcher's own choice)."""
        if op in ("kda.o_proj", "mla.o_proj") and self.o_proj is not None:
            return self.o_proj
        return self.gemv

    def prefetch_steps(self, op: str) -> int | None:
        """The L2 prefetch steps set for projection ``op`` (None: its tiling's own)."""
        if op in ("kda.o_proj", "mla.o_proj"):
            return self.o_proj_prefetch
        if op in ("kda.q_proj", "mla.q_a_proj"):  # the merged input projections' ops
            return self.in_proj_prefetch
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


def _read(run: _Run, state: dict, bank, live, site: str, sums=None, clear=None
          ) -> torch.Tensor:
    w, cfg = state[f"res_{site}"], state["cfg"]
    if sums is not None:  # the projection that wrote live left the sums
        return _kernels().attn_res_norm_from_sums(sums, live, w["norm_weight"],
                                                  eps=cfg.rms_eps, clear=clear,
                                                  config=run.configs.attn_res)[1]
    args = (bank, live, w["res_norm_weight"], w["res_proj_weight"], w["norm_weight"])
    if run.fused(f"attn_res.read@{site}"):
        return _kernels().attn_res_norm(*args, eps=cfg.rms_eps, return_h=False,
                                        config=run.configs.attn_res)[1]
    return ref_attn_res.attn_res_norm_reference(*args, eps=cfg.rms_eps)[1]


def _ffn_sums(run: _Run, state: dict, bank, buffers):
    """The FFN read's ReadSums for the attention's output projection to fill (None where
    ``Configs.read_sums`` is off or the read or the projection is not fused), and the buffer
    its read clears. buffers: (this read's zeroed sums, the next read's or None); None: a
    zeroed one is allocated."""
    o_proj = f"{state['kind']}.o_proj"
    if not ((run.configs.read_sums or run.configs.ffn_read_in_front)
            and run.fused("attn_res.read@ffn")
            and run.stack.owned_by(o_proj, "dense-gemv")):
        return None, None
    from k3lab.kernels.attn_res_sums import read_sums
    w = state["res_ffn"]
    buf, clear = buffers if buffers is not None else (None, None)
    return read_sums(bank, w["res_norm_weight"], w["res_proj_weight"], buffer=buf), clear


def sums_buffers(token: dict, m: int, device, key: str = "read_sums") -> list[torch.Tensor]:
    """One zeroed sums buffer per layer of ``token``, kept in it under ``key`` (so a CUDA graph
    captured after a first call reuses them): "read_sums" for the FFN reads
    (``Configs.read_sums`` / ``ffn_read_in_front``: layer i's FFN read clears layer i + 1's,
    the last one layer 0's), "attn_sums" for the attention reads (``attn_read_in_proj``: each
    mixed read's projection zeroes the next mixed read's, the last the first's), so every
    replay finds them zero."""
    from k3lab.kernels.attn_res_sums import SLOT_COLS, sums_numel
    cfg = token["cfg"]
    most = max(n for n, _ in token["schedule"].values())
    need = sums_numel(m, cfg.hidden, most, SLOT_COLS)
    bufs = token.get(key)
    if bufs is None or bufs[0].numel() < need or bufs[0].device != torch.device(device):
        bufs = [torch.zeros(need, dtype=torch.float32, device=device)
                for _ in token["layer_ids"]]
        token[key] = bufs
    return bufs


def _mixed_reads(stack: Stack, token: dict) -> list[int]:
    """Window positions of ``token`` whose attention read is the input projection's prologue
    under ``Configs.attn_read_in_proj``: past a block's first layer, after a layer that
    :func:`leaves_read_sums`, where the layer :func:`takes_read_input`."""
    layers, ids = token["layers"], token["layer_ids"]
    return [i for i in range(1, len(ids)) if not token["schedule"][ids[i]][1]
            and leaves_read_sums(stack, layers[i - 1]) and takes_read_input(stack, layers[i])]


def _kda(run: _Run, x, w: dict, cache: dict, cfg: Preset, residual, sums=None, read=None
         ) -> torch.Tensor:
    tag = run.tag
    m, hl, d = x.shape[0], cfg.kda_heads, cfg.kda_head_dim
    tag("dense projections")
    q, k, v, f_low, b_logits, g = _linear(run, "kda.q_proj", x, w["in_proj"],
                                          splits=w["in_splits"], read_input=read)
    tag("KDA")
    conv = gate = None
    if run.fused("kda.short_conv"):  # the kernel takes the projections before the conv
        conv = _kernels().KDAConv(*(cache[f"{n}_conv_state"] for n in "qkv"),
                                  *(w[f"{n}_conv"] for n in "qkv"))
        q, k, v = (t.contiguous().view(m, hl, d) for t in (q, k, v))
    else:
        q, k, v = (ref_kda.short_conv_step(t, cache[f"{n}_conv_state"], w[f"{n}_conv"])
                   .view(m, hl, d).to(x.dtype) for n, t in zip("qkv", (q, k, v), strict=True))
    if run.fused("kda.out_norm_gate"):
        gate = _kernels().KDAOutGate(g.contiguous().view(m, hl, d), w["o_norm"], cfg.rms_eps,
                                     rms_by_consumer=run.configs.kda_rms_in_o_proj)
    if run.fused("kda.recurrence"):
        f_b = w["f_b"]
        if not run.fused("kda.f_b_proj"):
            if m != 1:
                raise ValueError("x: the stack runs KDA without the f_b fusion at batch 1 only")
            # f_b projection as the reference does it; the kernel then gets f through a rank-1
            # identity: f_b' = f^T [Hl*d, 1], f_low' = [[1]]
            f_b = (f_low.float() @ w["f_b"].float().T).to(x.dtype).view(hl * d, 1)
            f_low = torch.ones(1, 1, dtype=x.dtype, device=x.device)
        o = _kernels().kda_decode(q, k, v, f_low.contiguous(), f_b, w["A_log"], w["dt_bias"],
                                  b_logits.contiguous(), cache["state"],
                                  lower_bound=cfg.kda_lower_bound, conv=conv, out_gate=gate,
                                  config=run.configs.kda)
    else:
        o = ref_kda.kda_decode_reference(q, k, v, f_low, w["f_b"], w["A_log"], w["dt_bias"],
                                         b_logits, cache["state"],
                                         lower_bound=cfg.kda_lower_bound)
    head = {}
    if gate is None:
        o = ref_kda.out_norm_gate(o, g.reshape(m, hl, d), w["o_norm"], cfg.rms_eps)
    elif gate.rms_by_consumer:
        o, head_sums = o  # the gated o; each head's rsqrt is the output projection's
        if run.stack.owned_by("kda.o_proj", "dense-gemv"):  # in its prologue
            head = dict(head_sums=head_sums, head_dim=d, eps=cfg.rms_eps)
        else:
            o = o.float() * torch.rsqrt(head_sums.sum(-1, keepdim=True) / d + cfg.rms_eps)
    tag("dense projections")
    return _linear(run, "kda.o_proj", o.reshape(m, hl * d).to(x.dtype), w["o_proj"],
                   residual=residual, read_sums=sums, **head)


def _mla(run: _Run, x, state: dict, residual, sums=None, read=None) -> torch.Tensor:
    tag, num_splits = run.tag, run.num_splits
    cfg, w, cache = state["cfg"], state["attn"], state["cache"]
    m = x.shape[0]
    hm, nope, r, v = cfg.mla_heads, cfg.qk_nope, cfg.qk_rope, cfg.v_head
    tag("dense projections")
    q_a, kv, g = _linear(run, "mla.q_a_proj", x, w["in_proj"], splits=w["in_splits"],
                         read_input=read)
    q = _linear(run, "mla.q_b_proj", q_a.contiguous(), w["q_b"], norm_weight=w["q_a_norm"],
                eps=cfg.rms_eps).view(m, hm, nope + r)
    tag("MLA")
    kv_cache, seq_lens = cache["kv_cache"], cache["seq_lens"]
    prep = dict(qk_nope=nope, v_head=v, eps=cfg.rms_eps, rope=cfg.mla_rope)
    if run.fused("mla.q_absorb"):  # mla-absorb-fusion: the neighbours on both sides
        q_lat, q_rope = _kernels().mla_absorb_q(q, kv.contiguous(), w["kv_a_norm"], w["kv_b"],
                                                state["position"], kv_cache, seq_lens, **prep,
                                                config=run.configs.mla)
    else:
        q_lat, q_rope = ref_mla.mla_absorb_q_reference(q, kv, w["kv_a_norm"], w["kv_b"],
                                                       state["position"], kv_cache, seq_lens,
                                                       **prep)
    sm_scale = (nope + r) ** -0.5
    if run.fused("mla.attention"):
        o_lat = _kernels().mla_decode(q_lat.to(kv_cache.dtype), q_rope.to(kv_cache.dtype),
                                      kv_cache, seq_lens, sm_scale=sm_scale,
                                      num_splits=num_splits, config=run.configs.mla)
    else:
        o_lat = ref_mla.mla_decode_reference(q_lat, q_rope, kv_cache, seq_lens,
                                             sm_scale=sm_scale)
    if run.fused("mla.v_absorb"):
        o = _kernels().mla_absorb_out(o_lat, w["kv_b"], g.contiguous(), qk_nope=nope, v_head=v,
                                      out_dtype=x.dtype, config=run.configs.mla)
    else:
        o = ref_mla.mla_absorb_out_reference(o_lat.float(), w["kv_b"], g, qk_nope=nope,
                                             v_head=v).to(x.dtype)
    tag("dense projections")
    return _linear(run, "mla.o_proj", o, w["o_proj"], residual=residual, read_sums=sums)


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


def leaves_read_sums(stack: Stack, state: dict) -> bool:
    """Whether the layer's last launch under ``stack`` is a dense GEMV writing the live sum,
    which can leave the next read's sums (``run_layer(next_sums=...)``)."""
    if "mlp" in state:
        return stack.owned_by("mlp.down", "dense-gemv")
    cfg = state["cfg"]
    return (not stack.owned_by("moe.stage1", "persistent-moe") and stack.fused("moe.latent_up")
            and bool(cfg.latent) and bool(cfg.shared_intermediate))


def takes_read_input(stack: Stack, state: dict) -> bool:
    """Whether the layer's attention read can be its merged input projection's prologue
    (``run_layer(attn_read=...)``): the read and that projection fused, the latter the dense
    GEMV's."""
    op = "kda.q_proj" if state["kind"] == "kda" else "mla.q_a_proj"
    return stack.fused("attn_res.read@attn") and stack.owned_by(op, "dense-gemv")


def run_layer(stack: Stack, state: dict, *, num_splits: int = 4, bank=None, live=None,
              start: bool = False, ffn_bank=None, configs: Configs | None = None,
              tag: Callable[[str], None] | None = None, record: list | None = None,
              sums_buffers: tuple | None = None, attn_read=None, next_sums=None
              ) -> torch.Tensor:
    """One decode layer of ``state`` (``k3lab.reference.layer.make_layer``) under ``stack``;
    returns the new live sum [M, H] bf16.

    bank, live: the AttnRes candidates (default: the state's own); start: the layer opens a
    block, so its attention read sees ``bank`` and ``live`` as the sealed rows only, the
    attention output starts the live sum and the FFN read mixes ``ffn_bank`` (the sealed rows
    in one tensor) with it. num_splits: the fixed MLA split count of the split
    override (graph-safe). configs: the launchers' :class:`Configs` (None: their defaults).
    tag: called with a category before each group of launches. record: a list the layer
    appends its MoE's chosen experts to (None for layer 0's dense MLP), for checks.
    sums_buffers: with ``Configs.read_sums``, (this layer's zeroed sums buffer, the one its
    FFN read clears or None) as :func:`sums_buffers` lays them out (None: a zeroed one).
    attn_read: a ReadInput whose sums the previous layer left: the attention read is the
    merged input projection's prologue (live is its live sum; :func:`takes_read_input`).
    next_sums: a ReadSums the layer's last dense GEMV fills for the next layer's attention
    read (:func:`leaves_read_sums`).
    """
    tag = tag or _noop
    run = _Run(stack, num_splits, configs or Configs(), tag, record)
    cfg = state["cfg"]
    bank = state["bank"] if bank is None else bank
    live = state["live"] if live is None else live
    if attn_read is not None:
        if start or not takes_read_input(stack, state):
            raise ValueError("attn_read: the layer's attention read is its input projection's "
                             "prologue only past a block's first layer, with both fused")
        x = live
    else:
        tag("AttnRes")
        x = _read(run, state, bank, live, "attn")
    if next_sums is not None and not leaves_read_sums(stack, state):
        raise ValueError("next_sums: the layer's last launch is not a dense GEMV writing the "
                         "live sum")
    if start:
        bank = torch.cat([bank, live.unsqueeze(0)]) if ffn_bank is None else ffn_bank
    residual = None if start else live
    sums, clear = _ffn_sums(run, state, bank, sums_buffers)
    if state["kind"] == "kda":
        live = _kda(run, x, state["attn"], state["cache"], cfg, residual, sums, attn_read)
    else:
        live = _mla(run, x, state, residual, sums, attn_read)
    live = live.to(torch.bfloat16)
    read = None
    if sums is not None and run.configs.ffn_read_in_front and _ffn_mixes(run, state):
        from k3lab.kernels.attn_res_sums import read_input
        read = read_input(sums, state["res_ffn"]["norm_weight"], eps=cfg.rms_eps, clear=clear)
        x = live  # the consumer mixes its input from the sums
    else:
        tag("AttnRes")
        x = _read(run, state, bank, live, "ffn", sums, clear)
    if "mlp" in state:  # layer 0's dense MLP, its residual add in the down projection
        tag("dense projections")
        mlp = state["mlp"]
        if record is not None:
            record.append(None)
        a = _linear(run, "mlp.gate_up", x, mlp["gate_up"], **_act(cfg), read_input=read)
        return _linear(run, "mlp.down", a, mlp["down"], residual=live, read_sums=next_sums)
    f, added = _moe(run, x, state["moe"], cfg, live, next_sums, read)
    if added:
        return f
    tag("dense projections")
    return (live + f.to(live.dtype)) if f.dtype == live.dtype else (
        live.float() + f.float()).to(live.dtype)


# ---------------------------------------------------------------------------------------------
# the whole token


def run_token(stack: Stack, token: dict, *, num_splits: int = 4, configs: Configs | None = None,
              tag: Callable[[str], None] | None = None, record: list | None = None
              ) -> torch.Tensor:
    """One decode token of ``token`` (``k3lab.reference.layer.make_token``) under ``stack``:
    embedding row, layer 0 (KDA + dense MLP), the window's layers with their AttnRes reads and
    a block sum sealed every ``attn_res_block`` layers, the final read + RMSNorm and the LM head
    at the tp shard. Returns the logits [M, vocab / tp] bf16. ``tag`` as in run_layer, plus
    "segment embed", "segment layer <i>" and "segment head" where those parts start; record
    as in run_layer, one entry per layer."""
    tag = tag or _noop
    configs = configs or Configs()
    cfg, rows = token["cfg"], token["rows"]
    tag("segment embed")
    tag("dense projections")
    torch.index_select(token["embed"], 0, token["ids"], out=rows[0])
    live = rows[0]
    bufs = (sums_buffers(token, live.shape[0], live.device)
            if configs.read_sums or configs.ffn_read_in_front else None)
    mixed = _mixed_reads(stack, token) if configs.attn_read_in_proj else []
    mix_bufs = sums_buffers(token, live.shape[0], live.device, "attn_sums") if mixed else None
    if mixed:
        from k3lab.kernels.attn_res_sums import read_input, read_sums
    prev = None  # the ReadSums the previous layer left for this layer's attention read
    for i, (layer, state) in enumerate(zip(token["layer_ids"], token["layers"], strict=True)):
        n_sealed, start = token["schedule"][layer]
        if start and layer:  # seal the block sum of the layers before
            tag("AttnRes")
            rows[n_sealed - 1].copy_(live)
        tag(f"segment layer {layer}")
        bank, cand = (rows[:n_sealed - 1], rows[n_sealed - 1]) if start else (
            rows[:n_sealed], live)
        pair = None
        if bufs is not None:  # a single layer's buffer is zeroed by a launch of its own
            pair = (bufs[i], bufs[(i + 1) % len(bufs)]) if len(bufs) > 1 else (
                bufs[0].zero_(), None)
        attn_read = next_sums = None
        if i in mixed:  # the previous layer left this read's sums; the next one's zeroed here
            j = mixed.index(i)
            nxt = mix_bufs[mixed[(j + 1) % len(mixed)]] if len(mixed) > 1 else None
            attn_read = read_input(prev, state["res_attn"]["norm_weight"], eps=cfg.rms_eps,
                                   clear=nxt)
        if i + 1 in mixed:
            n_next = token["schedule"][token["layer_ids"][i + 1]][0]
            w_next = token["layers"][i + 1]["res_attn"]
            if len(mixed) == 1:  # no other read zeroes it: a launch of its own
                mix_bufs[i + 1].zero_()
            next_sums = read_sums(rows[:n_next], w_next["res_norm_weight"],
                                  w_next["res_proj_weight"], buffer=mix_bufs[i + 1])
        live = run_layer(stack, state, num_splits=num_splits, bank=bank, live=cand,
                         start=start, ffn_bank=rows[:n_sealed], configs=configs,
                         tag=tag, record=record, sums_buffers=pair, attn_read=attn_read,
                         next_sums=next_sums)
        prev = next_sums
    tag("segment head")
    tag("AttnRes")
    last = token["schedule"][token["layer_ids"][-1]][0]
    w = token["final"]
    args = (rows[:last], live, w["res_norm_weight"], w["res_proj_weight"], w["norm_weight"])
    if stack.fused("token.final_read"):
        h = _kernels().attn_res_norm(*args, eps=cfg.rms_eps, return_h=False,
                                     config=configs.attn_res)[1]
    else:
        h = ref_attn_res.attn_res_norm_reference(*args, eps=cfg.rms_eps)[1]
    tag("dense projections")
    return _linear(_Run(stack, num_splits, configs, tag), "token.lm_head", h, token["lm_head"])
