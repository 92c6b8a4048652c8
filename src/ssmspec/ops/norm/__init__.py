"""The norms of a block: residual add + RMSNorm in one pass, and Mamba-2's gated group RMSNorm.

Both dispatch Triton on CUDA (one launch a call, no fp32 copies of the weights) and the naive twin
elsewhere (see ``ops.dispatch``).
"""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.norm.naive import add_rms_norm_ref, gated_rms_norm_ref, residual_dtype


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, *, eps: float, residual_in_fp32: bool = False,
                 backend: str = "auto") -> tuple[Tensor, Tensor]:
    """new_residual = residual + x (x alone when residual is None), y = RMSNorm(new_residual) * weight.

    x (..., d) a block's output or the embeddings, residual (..., d) or None, weight (d,). Returns y
    (..., d) in weight's dtype and the new residual (..., d), fp32 when ``residual_in_fp32`` (else the
    promoted dtype of x and residual; x itself when there is nothing to add or cast)."""
    if use_triton(x, residual, weight, backend=backend):
        from ssmspec.ops.norm.triton import add_rms_norm_triton
        return add_rms_norm_triton(x, residual, weight, eps=eps, residual_in_fp32=residual_in_fp32)
    return add_rms_norm_ref(x, residual, weight, eps=eps, residual_in_fp32=residual_in_fp32)


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, *, group_size: int, eps: float, backend: str = "auto") -> Tensor:
    """RMSNorm over groups of ``group_size`` channels of y * silu(z), times weight (norm_before_gate=False).
    y, z (..., d), weight (d,) -> (..., d) in the model dtype."""
    if use_triton(y, z, weight, backend=backend):
        from ssmspec.ops.norm.triton import gated_rms_norm_triton
        return gated_rms_norm_triton(y, z, weight, group_size=group_size, eps=eps)
    return gated_rms_norm_ref(y, z, weight, group_size=group_size, eps=eps)


__all__ = ["add_rms_norm", "add_rms_norm_ref", "gated_rms_norm", "gated_rms_norm_ref", "residual_dtype"]
