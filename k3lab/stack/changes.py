"""The campaign's changes as data, the two stacks, and single-owner composition."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from k3lab.config import Preset
from k3lab.ops import layer_ops

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
