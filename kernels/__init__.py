"""Fused Triton kernels, one file per boundary (imported as ``k3lab.kernels``)."""
from .mla import mla_decode  # noqa: F401
