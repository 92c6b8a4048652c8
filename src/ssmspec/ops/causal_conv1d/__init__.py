"""Causal depthwise conv1d with a carried state (no dependency on the CUDA-only causal-conv1d package)."""
from ssmspec.ops.causal_conv1d.naive import causal_conv1d_ref

causal_conv1d = causal_conv1d_ref

__all__ = ["causal_conv1d", "causal_conv1d_ref"]
