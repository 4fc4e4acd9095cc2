"""Dense projections of the decode step, the unfused truth (fp32) and the engine's call.

``dense_reference`` computes in fp32 from the bf16 operands: the correctness truth.
``dense_engine`` is what a serving engine runs: bf16 ``F.linear`` (cuBLAS on a GPU), the
optional RMSNorm, activation and residual as separate ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "situ", "dense_reference", "dense_engine"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def situ(g: torch.Tensor, u: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0):
    """SiTU(g, u) = beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)."""
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(
        u / linear_beta))


def _act(y, activation, beta, linear_beta):
    if activation is None:
        return y
    g, u = y.chunk(2, dim=-1)
    if activation == "situ":
        return situ(g, u, beta, linear_beta)
    if activation == "silu":
        return F.silu(g) * u
    raise ValueError(f"activation: expected None, 'situ' or 'silu', got {activation!r}")


def _split(y, splits):
    return y if splits is None else tuple(y.split(list(splits), dim=-1))


def dense_reference(x, weight, *, splits=None, activation=None, residual=None,
                    norm_weight=None, x2=None, weight2=None, weight_scale=None, eps=1e-5,
                    situ_beta=4.0, situ_linear_beta=25.0):
    """fp32 truth of ``k3lab.kernels.dense.dense_gemv`` (same arguments, fp32 outputs); an e4m3
    weight is taken as its values times ``weight_scale`` per row."""
    if weight_scale is not None:
        weight = weight.float() * weight_scale.float()[:, None]
    xf = rms_norm(x, norm_weight, eps) if norm_weight is not None else x.float()
    if splits is not None and activation is not None:  # plain rows, then gate/up rows
        p = splits[0]
        return (xf @ weight[:p].float().T,
                _act(xf @ weight[p:].float().T, activation, situ_beta, situ_linear_beta))
    y = _act(xf @ weight.float().T, activation, situ_beta, situ_linear_beta)
    if x2 is not None:
        y = y + x2.float() @ weight2.float().T
    if residual is not None:
        y = y + residual.float()
    return _split(y, splits)


def dense_engine(x, weight, *, splits=None, activation=None, residual=None, norm_weight=None,
                 eps=1e-5, situ_beta=4.0, situ_linear_beta=25.0):
    """The engine's bf16 ops: F.linear on the (normalized) bf16 x, then the epilogue ops."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps).to(x.dtype)
    y = F.linear(x, weight)
    if activation is not None:
        y = _act(y.float(), activation, situ_beta, situ_linear_beta).to(x.dtype)
    if residual is not None:
        y = y + residual
    return _split(y, splits)
