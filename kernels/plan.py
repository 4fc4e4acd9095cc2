"""The prepared routing ("route plan") that the expert stages consume.

Produced both by the unfused reference (``k3lab.reference``) and by the fused kernel
(``k3lab.kernels``) so the two compare field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["RoutePlan", "plan_capacity"]


def plan_capacity(m: int, top_k: int, n_experts: int, block_m: int) -> int:
    """Worst-case length of ``sorted_ids``: every expert's run padded to a multiple of block_m."""
    return m * top_k + n_experts * (block_m - 1)


@dataclass
class RoutePlan:
    """Routing of M tokens to top_k of E experts, sorted by expert for the MoE GEMMs.

    Attributes:
        topk_ids: int32 [M, top_k], per token the experts in descending biased score (ties to the
            lower expert index).
        topk_weights: fp32 [M, top_k], unbiased sigmoid scores of those experts, renormalized when
            asked, times the routed scaling factor.
        sorted_ids: int32 [plan_capacity(...)], entries ``token * top_k + slot`` grouped by expert
            in ascending expert order (ascending entry within an expert), each expert's run
            padded to a multiple of block_m with the sentinel ``M * top_k``; the tail past
            ``num_valid`` holds the sentinel too.
        sorted_weights: fp32, aligned with sorted_ids (0 on padding).
        block_expert_ids: int32 [capacity // block_m], the expert of each block_m tile, -1 past
            the valid tiles.
        num_valid: int32 [1], padded entries in use.
        out: fp32 [M, out_dim] zeroed stage-2 accumulation buffer, or None.
        block_m: tile height the plan was padded for.
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    sorted_ids: torch.Tensor
    sorted_weights: torch.Tensor
    block_expert_ids: torch.Tensor
    num_valid: torch.Tensor
    out: torch.Tensor | None
    block_m: int

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name (``out`` omitted when absent)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}
