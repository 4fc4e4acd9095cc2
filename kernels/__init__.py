"""Fused Triton kernels, one file per boundary (imported as ``k3lab.kernels``)."""
from .attn_res import attn_res_norm  # noqa: F401
from .kda import KDAConv, KDAOutGate, kda_decode  # noqa: F401
from .mla import mla_decode  # noqa: F401
from .moe import (  # noqa: F401
    latent_down,
    latent_moe_tail,
    moe_block,
    moe_kernel_weights,
    moe_stage1,
    moe_stage2,
)
from .route_sort import gate_logits, route_sort  # noqa: F401
