"""The twins of the decode GEMVs: the existing norms (``ops/norm/naive.py``) followed by ``F.linear``, the
ground truth the fused kernels must equal up to accumulation order."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ssmspec.ops.norm.naive import add_rms_norm_ref, gated_rms_norm_ref


def linear_small_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., K), weight (N, K), bias (N,) or None -> (..., N)."""
    return F.linear(x, weight, bias)


def add_rms_norm_linear_ref(x: Tensor, residual: Tensor | None, norm_weight: Tensor, weight: Tensor,
                            bias: Tensor | None = None, *, eps: float,
                            residual_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    """(F.linear(RMSNorm(residual + x) * norm_weight, weight, bias), residual + x); see ``add_rms_norm_ref``."""
    h, new_residual = add_rms_norm_ref(x, residual, norm_weight, eps=eps, residual_in_fp32=residual_in_fp32)
    return F.linear(h, weight, bias), new_residual


def gated_norm_linear_ref(y: Tensor, z: Tensor, norm_weight: Tensor, weight: Tensor, bias: Tensor | None = None,
                          *, group_size: int, eps: float) -> Tensor:
    """F.linear(GroupRMSNorm(y * silu(z)) * norm_weight, weight, bias); see ``gated_rms_norm_ref``."""
    return F.linear(gated_rms_norm_ref(y, z, norm_weight, group_size=group_size, eps=eps), weight, bias)
