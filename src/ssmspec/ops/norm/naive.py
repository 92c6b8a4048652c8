"""RMSNorm with a fused residual add, and the gated RMSNorm of Mamba-2: fp32 math, the ground truth.

Both reproduce, rounding step for rounding step, what transformers' Mamba2 / NemotronH blocks do in
PyTorch (and what ``models/layers.py`` did before the kernels): the norm reads the residual sum rounded
to the weight dtype (transformers norms ``hidden.to(norm.weight.dtype)``), and the gated norm rounds
the normalised value to the activation dtype before multiplying by the weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def residual_dtype(x: Tensor, residual: Tensor | None, residual_in_fp32: bool) -> torch.dtype:
    """dtype of the new residual stream: fp32 when ``residual_in_fp32``, else what ``residual + x`` gives."""
    if residual_in_fp32:
        return torch.float32
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor | None, weight: Tensor, *, eps: float,
                     residual_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    """Pre-norm residual step (mamba_ssm's ``layer_norm_fn(..., prenorm=True)`` for RMSNorm).

    x (..., d) the previous block's output (or the embeddings), residual (..., d) or None (first block),
    weight (d,). Returns y (..., d) in weight's dtype, the RMSNorm of the new residual, and the new
    residual ``residual + x`` (..., d) in fp32 when ``residual_in_fp32``."""
    s = x.float() if residual is None else x.float() + residual.float()  # (..., d) fp32 sum
    res = s.to(residual_dtype(x, residual, residual_in_fp32))
    h = res.to(weight.dtype).float()  # transformers norms hidden.to(norm.weight.dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(weight.dtype), res


def gated_rms_norm_ref(y: Tensor, z: Tensor, weight: Tensor, *, group_size: int, eps: float) -> Tensor:
    """y * silu(z), then RMSNorm over each group of ``group_size`` channels (norm_before_gate=False).

    y, z (..., d) with d a multiple of group_size, weight (d,). Returns (..., d) in the promoted dtype of
    y and weight (the model dtype)."""
    h = y.float() * F.silu(z.float())  # (..., d)
    g = h.view(*h.shape[:-1], -1, group_size)  # (..., d / group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view_as(h).to(y.dtype)
