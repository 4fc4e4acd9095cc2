"""The tuning configs a run of the stack passes to the launchers."""

from __future__ import annotations

from dataclasses import dataclass


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
    first read, of sealed rows only, keeps its launch. attn_read_registers: the register cap
    of every dense GEMV that mixes its input (GemvConfig.max_registers; 0: its tiling's own):
    that input projection, and layer 0's gate/up projection under ffn_read_in_front. The mix
    takes K3 tp 8's KDA input projection from 127 registers a thread to 145-176 (offline sm_90
    builds, docs/decisions.md): 3 programs an SM instead of 4; capped at 128 it does not
    spill.
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
