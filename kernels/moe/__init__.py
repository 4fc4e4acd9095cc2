"""Latent MoE at batch 1 (docs/model.md): three launches after routing.

```
front : z = x @ W_down^T            (and shared a_s = act(x @ Ws1^T, x @ Ws3^T), same launch)
stage1: a[t*K+k] = act(z[t] @ W1[e]^T, z[t] @ W3[e]^T)     e = topk_ids[t, k]   ("direct tile")
stage2: y[t] += w[t,k] * (a[t*K+k] @ W2[e]^T)               fp32 atomics into plan.out
tail  : out = rsqrt(mean(y^2) + eps) * ((y * g_norm) @ W_up^T) + a_s @ Ws2^T   (or + shared)
```
act = SiTU(g, u) = beta*tanh(g/beta)*sigmoid(g)*(lb*tanh(u/lb)) or SiLU(g)*u, in fp32, with
tanh(x) = 2*sigmoid(2x) - 1.

Modules: ``config`` (MoEConfig: every tuning choice, passed to the launchers), ``front_route``
(route_sort and the dense front in one launch), ``tiles`` (tile choice on the host), ``gemv``
(bf16 and MXFP4 K-lane GEMV helpers), ``mma`` (the tensor-core MXFP4 tile for plan tiles of one
token), ``stages`` (the jit kernels), ``shared_down`` (the shared down-projection's GEMV in an
expert stage's launch), ``checks`` (input validation), ``launch`` and ``block`` (the
launchers).

Stages 1 and 2 consume the route plan as is (no second top-k or sort). Stage 1 also zeroes
``plan.out`` (stage 2's accumulator) for moe_block's stage 2; ``moe_stage2`` launched alone
zeroes it inside its own launch (the first program to start zeroes, every tile's adds wait for
it), so calling it again on one plan never adds to old values; ``moe_experts`` launches the two
stages as ``moe_block`` does (stage 1 zeroing, stage 2 by PDL without its own zeroing).
``deterministic=True`` (or
``MoEConfig.deterministic_stage2``) makes stage 2 sum each token's top_k slots in slot order
inside one program instead (same single launch, no atomics). The launchers check a plan's
shapes and sizes always and, with ``validate="full"``, its values (one host sync).

``moe_block`` launches front, stage 1, then stage 2 and the tail in ONE grid (``fuse_tail=True``,
the default): each program takes a ticket from an atomic counter; tickets below the stage-2
tile count run stage-2 tiles and then count themselves done (release, after a CTA barrier), the
rest run tail tiles, which do the shared down GEMV, wait until every stage-2 tile is done
(acquire, then a CTA barrier) and finish the tail. A ticket is taken by a running program, so
every tile a tail tile waits for is already running: no deadlock under any scheduling. Stage 1
zeroes the two counters (program 0) and stage 2's accumulator, so every call and every
CUDA-graph replay starts from zero. ``fuse_tail=False`` launches stage 2 and the tail separately
(one launch more, no cross-program waiting).
"""

from .block import latent_moe_tail, moe_block
from .checks import MAX_TOKENS
from .config import MoEConfig
from .front_route import front_route, front_tiling
from .launch import latent_down, moe_experts, moe_kernel_weights, moe_stage1, moe_stage2
from .mma import mma_prepare_x

__all__ = ["MAX_TOKENS", "MoEConfig", "front_route", "front_tiling", "latent_down",
           "latent_moe_tail", "moe_block", "moe_experts", "moe_kernel_weights", "moe_stage1",
           "moe_stage2", "mma_prepare_x"]
