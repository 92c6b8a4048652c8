"""Decode GEMVs: a block's projections at a few rows (M = B * L <= 16), one launch each, with the norm that
precedes them fused in.

At decode the projections are matrix-vector products bound by reading the weight once; cuBLAS splits K at
these shapes and adds a reduce launch, and the norm before them is one more launch. Here each is one Triton
kernel that reads W exactly once (K split in slices only where the column blocks do not fill the GPU, summed
in the same launch), optionally with the residual add + RMSNorm or Mamba-2's gated group RMSNorm recomputed in
every program's prologue from the few KB of activations (``triton.py``). Every op
dispatches Triton on CUDA and its twin (the norm ops followed by ``F.linear``) elsewhere (``ops.dispatch``).
Shapes: x / y / z (..., K) with M = prod of the leading dims at most 16, weight (N, K), bias (N,) or None.
"""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.gemv.naive import add_rms_norm_linear_ref, gated_norm_linear_ref, linear_small_ref

MAX_M = 16  # most rows a call may have (ops/gemv/triton.py keeps an accumulator for each)


def _check_rows(x: Tensor) -> None:
    if x.dim() == 0:
        raise ValueError("x must have a channel dimension (..., K), got a 0-d tensor")
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if m > MAX_M:
        raise ValueError(f"linear_small takes at most {MAX_M} rows (M = prod of the leading dims), got M = {m}; "
                         f"use F.linear for larger batches")


def linear_small(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, backend: str = "auto") -> Tensor:
    """F.linear for a few rows: x (..., K) with M <= 16 rows, weight (N, K), bias (N,) or None -> (..., N) in
    x's dtype (which must be weight's)."""
    _check_rows(x)
    if use_triton(x, weight, bias, backend=backend):
        from ssmspec.ops.gemv.triton import linear_small_triton
        return linear_small_triton(x, weight, bias)
    return linear_small_ref(x, weight, bias)


def add_rms_norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, weight: Tensor,
                        bias: Tensor | None = None, *, eps: float, residual_in_fp32: bool = False,
                        backend: str = "auto") -> tuple[Tensor, Tensor]:
    """``add_rms_norm`` (ops/norm) then ``F.linear`` in one launch: x (..., K) with M <= 16 rows, residual
    (..., K) or None, norm_weight (K,), weight (N, K) in norm_weight's dtype, bias (N,) or None. Returns
    (out (..., N) in weight's dtype, new residual (..., K): fp32 when ``residual_in_fp32``, x itself when
    there is nothing to add or cast) -- the same dtypes as the unfused path."""
    _check_rows(x)
    if use_triton(x, residual, norm_weight, weight, bias, backend=backend):
        from ssmspec.ops.gemv.triton import add_rms_norm_linear_triton
        return add_rms_norm_linear_triton(x, residual, norm_weight, weight, bias, eps=eps,
                                          residual_in_fp32=residual_in_fp32)
    return add_rms_norm_linear_ref(x, residual, norm_weight, weight, bias, eps=eps, residual_in_fp32=residual_in_fp32)


def gated_norm_linear(y: Tensor, z: Tensor, norm_weight: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                      group_size: int, eps: float, backend: str = "auto") -> Tensor:
    """``gated_rms_norm`` (ops/norm) then ``F.linear`` in one launch: y, z (..., K) with M <= 16 rows,
    norm_weight (K,), groups of ``group_size`` channels (K itself: one group), weight (N, K), bias (N,) or
    None -> (..., N) in weight's dtype."""
    _check_rows(y)
    if use_triton(y, z, norm_weight, weight, bias, backend=backend):
        from ssmspec.ops.gemv.triton import gated_norm_linear_triton
        return gated_norm_linear_triton(y, z, norm_weight, weight, bias, group_size=group_size, eps=eps)
    return gated_norm_linear_ref(y, z, norm_weight, weight, bias, group_size=group_size, eps=eps)


__all__ = ["MAX_M", "add_rms_norm_linear", "add_rms_norm_linear_ref", "gated_norm_linear", "gated_norm_linear_ref",
           "linear_small", "linear_small_ref"]
