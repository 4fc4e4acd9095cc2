"""k3lab: a workbook for the fused kernels of the Kimi-K3 batch-1 decode step."""

__version__ = "0.1.0"
