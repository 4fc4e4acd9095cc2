"""Fused Triton kernels, one file per boundary (imported as ``k3lab.kernels``)."""
