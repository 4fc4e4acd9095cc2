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

The package: :mod:`.changes` (the catalogue, both stacks, :func:`compose`), :mod:`.configs`
(the launchers' tuning), :mod:`.layer` (one layer: its AttnRes reads and attention),
:mod:`.moe` (the latent MoE block's launches), :mod:`.token` (the whole token), over
:mod:`.base` (what every op of a run reads, and a projection by the dense GEMV or the
engine's call).
"""

from .changes import (
    CANDIDATES,
    CATALOGUE,
    CATEGORIES,
    CHANGES,
    DENSE_OPS,
    STACKS,
    TOKEN_OPS,
    Change,
    Stack,
    all_ops,
    compose,
    layer_counts,
    runnable,
    steps,
)
from .configs import Configs
from .layer import leaves_read_sums, run_layer, takes_read_input
from .token import run_token, sums_buffers

__all__ = ["Change", "CATALOGUE", "CHANGES", "STACKS", "CANDIDATES", "TOKEN_OPS", "DENSE_OPS",
           "Stack", "compose", "runnable", "steps", "all_ops", "Configs", "run_layer",
           "run_token", "layer_counts", "CATEGORIES", "sums_buffers", "leaves_read_sums",
           "takes_read_input"]
