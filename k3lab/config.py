"""Model presets and tensor-parallel sharding.

A :class:`Preset` holds every size the references and kernels need for one GPU's shard of the
model (docs/model.md). ``preset(name, tp)`` returns it sharded the way
serving engines shard it: attention heads and the expert / shared / dense intermediate sizes are
divided by ``tp``; the hidden size, the latent size and the expert count are not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["Preset", "PRESETS", "preset", "preset_names"]


@dataclass(frozen=True)
class Preset:
    """Sizes of one preset at one tensor-parallel degree (all sizes per GPU after sharding)."""

    name: str
    tp: int
    hidden: int
    n_layers: int
    mla_layers: tuple[int, ...]  # 0-based indices of MLA ("full attention") layers
    first_dense: int  # layers [0, first_dense) use the dense MLP instead of the MoE
    dense_intermediate: int
    vocab: int
    rms_eps: float
    # routing (section 3)
    n_experts: int
    top_k: int
    n_group: int
    topk_group: int
    routed_scaling: float
    renormalize: bool
    # MoE (section 4); latent == 0 means no latent projections (K2-style)
    latent: int
    moe_intermediate: int
    shared_intermediate: int  # all shared experts as one MLP; 0 = none
    activation: str  # "situ" or "silu"
    situ_beta: float
    situ_linear_beta: float
    # KDA (section 7); kda_heads == 0 means the preset has no KDA layers
    kda_heads: int
    kda_head_dim: int
    kda_conv: int
    kda_f_rank: int
    kda_lower_bound: float
    # MLA (section 8)
    mla_heads: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    mla_rope: bool  # K3 applies no rotation (mla_use_nope)
    # AttnRes (section 6); 0 means a plain residual stream
    attn_res_block: int

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """0-based indices of the KDA layers (every layer that is not MLA)."""
        if self.kda_heads == 0:
            return ()
        return tuple(i for i in range(self.n_layers) if i not in self.mla_layers)

    @property
    def moe_in(self) -> int:
        """Width of the routed experts' input: the latent size, or hidden without latent MoE."""
        return self.latent or self.hidden

    @property
    def qk_head(self) -> int:
        return self.qk_nope + self.qk_rope

    @property
    def max_attn_res_candidates(self) -> int:
        """Sealed block sums (embedding first) plus the live partial sum."""
        if not self.attn_res_block:
            return 0
        return -(-self.n_layers // self.attn_res_block) + 1

    def describe(self) -> str:
        return f"{self.name} tp={self.tp}"


def _every_fourth(n_layers: int) -> tuple[int, ...]:
    """0-based MLA layers at 1-based 4, 8, ... and the last layer."""
    layers = set(range(3, n_layers, 4)) | {n_layers - 1}
    return tuple(sorted(layers))


# Full-model (tp = 1) presets. Sizes from docs/model.md; "uncertain" entries are noted.
PRESETS: dict[str, Preset] = {
    "kimi-k3": Preset(
        name="kimi-k3", tp=1, hidden=7168, n_layers=93, mla_layers=_every_fourth(93),
        first_dense=1, dense_intermediate=33792, vocab=163840, rms_eps=1e-5,
        n_experts=896, top_k=16, n_group=1, topk_group=1, routed_scaling=1.0, renormalize=True,
        latent=3584, moe_intermediate=3072, shared_intermediate=6144, activation="situ",
        situ_beta=4.0, situ_linear_beta=25.0,
        kda_heads=96, kda_head_dim=128, kda_conv=4, kda_f_rank=128, kda_lower_bound=-5.0,
        mla_heads=96, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
        mla_rope=False, attn_res_block=12,
    ),
    "kimi-k2": Preset(
        name="kimi-k2", tp=1, hidden=7168, n_layers=61, mla_layers=tuple(range(61)),
        first_dense=1, dense_intermediate=18432, vocab=163840, rms_eps=1e-6,
        n_experts=384, top_k=8, n_group=1, topk_group=1, routed_scaling=2.827, renormalize=True,
        latent=0, moe_intermediate=2048, shared_intermediate=2048, activation="silu",
        situ_beta=4.0, situ_linear_beta=25.0,
        kda_heads=0, kda_head_dim=128, kda_conv=4, kda_f_rank=128, kda_lower_bound=-5.0,
        mla_heads=64, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
        mla_rope=True, attn_res_block=0,
    ),
    # Kimi-Linear 48B-A3B. Uncertain: MLA head count (taken equal to the KDA heads), q_lora
    # (1536 assumed), the dense layer's intermediate, and the KDA gate form (K3's is used).
    "kimi-linear": Preset(
        name="kimi-linear", tp=1, hidden=2304, n_layers=27,
        mla_layers=(3, 7, 11, 15, 19, 23, 26), first_dense=1, dense_intermediate=9216,
        vocab=163840, rms_eps=1e-5,
        n_experts=256, top_k=8, n_group=1, topk_group=1, routed_scaling=2.446, renormalize=True,
        latent=0, moe_intermediate=1024, shared_intermediate=1024, activation="silu",
        situ_beta=4.0, situ_linear_beta=25.0,
        kda_heads=32, kda_head_dim=128, kda_conv=4, kda_f_rank=128, kda_lower_bound=-5.0,
        mla_heads=32, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
        mla_rope=False, attn_res_block=0,
    ),
    # Small, deliberately awkward sizes (non-powers of two where the math allows) for CPU tests
    # under the Triton interpreter. Head dims stay powers of two, as in every real model.
    "tiny": Preset(
        name="tiny", tp=1, hidden=200, n_layers=14, mla_layers=_every_fourth(14),
        first_dense=1, dense_intermediate=240, vocab=1000, rms_eps=1e-5,
        n_experts=24, top_k=4, n_group=1, topk_group=1, routed_scaling=1.0, renormalize=True,
        latent=96, moe_intermediate=96, shared_intermediate=120, activation="situ",
        situ_beta=4.0, situ_linear_beta=25.0,
        kda_heads=6, kda_head_dim=32, kda_conv=4, kda_f_rank=16, kda_lower_bound=-5.0,
        mla_heads=6, q_lora=48, kv_lora=64, qk_nope=32, qk_rope=16, v_head=32,
        mla_rope=False, attn_res_block=4,
    ),
}

# Sizes divided by tp. Hidden, latent and the expert count are replicated on every GPU.
_SHARDED = ("kda_heads", "mla_heads", "moe_intermediate", "shared_intermediate",
            "dense_intermediate")


def preset_names() -> list[str]:
    return list(PRESETS)


def preset(name: str, tp: int = 1) -> Preset:
    """Return preset ``name`` sharded for tensor-parallel degree ``tp``.

    Raises ``ValueError`` naming the parameter on an unknown preset, a non-positive tp, or a tp
    that does not divide a sharded size.
    """
    if isinstance(name, Preset):
        name = name.name
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: expected a positive integer, got {tp!r}")
    base = PRESETS[name]
    changes = {"tp": tp}
    for field in _SHARDED:
        size = getattr(base, field)
        if size % tp:
            raise ValueError(
                f"tp: {tp} does not divide {field}={size} of preset {name!r}; "
                f"valid tp values divide every sharded size")
        changes[field] = size // tp
    return dataclasses.replace(base, **changes)
