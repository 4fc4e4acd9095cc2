"""Fused Triton kernels and their launchers, imported as ``k3lab.kernels``.

They import only torch and triton. ``runtime`` decides once, at the first import, whether the
kernels compile or run under the Triton interpreter (no visible GPU).
"""
# isort: off
from .runtime import INTERPRETED  # noqa: F401  (before any import of triton)
# isort: on

from .attn_res import AttnResConfig, attn_res_norm  # noqa: F401, E402
from .attn_res_sums import ReadInput, ReadSums, attn_res_norm_from_sums, read_input, read_sums  # noqa: F401, E402
from .dense import GemvConfig, dense_gemv  # noqa: F401, E402
from .kda import KDAConfig, KDAConv, KDAOutGate, kda_decode  # noqa: F401, E402
from .mla import MLAConfig, mla_decode  # noqa: F401, E402
from .mla_absorb import mla_absorb_out, mla_absorb_q  # noqa: F401, E402
from .moe import (  # noqa: F401, E402
    MoEConfig,
    front_route,
    latent_down,
    latent_moe_tail,
    moe_block,
    moe_experts,
    moe_kernel_weights,
    moe_stage1,
    moe_stage2,
)
from .mxfp4 import MXFP4  # noqa: F401, E402
from .plan import RoutePlan  # noqa: F401, E402
from .route import RouteConfig, gate_logits, route_sort  # noqa: F401, E402

if not INTERPRETED:  # the same kernel keys in every process (see runtime.prime_cache_keys)
    import contextlib  # noqa: E402

    from .runtime import prime_cache_keys  # noqa: E402

    with contextlib.suppress(Exception):  # Triton's internals moved: keys as Triton computes
        prime_cache_keys(__name__)
