"""Triton kernels for the two norms of a Mamba-2 / hybrid block, each one launch a call.

``_add_rms_norm_kernel``: one program per row of d channels reads x and the residual once, writes the new
residual (fp32 when residual_in_fp32) and the normed row; d up to 16K fits one block in registers.
``_gated_rms_norm_kernel``: one program per (row, group) computes y * silu(z), normalises the group and
multiplies by the weight. Neither writes state that a rerun would corrupt, but the block sizes are set by
hand from d (one block a row; 8 warps past 4K channels keep the per-thread registers under 64 fp32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.norm.naive import residual_dtype
from ssmspec.ops.triton_common import check_float, dummy, gdc_enter, pdl_args, silu

_MAX_D = 16384


def _warps(block: int) -> int:
    return 4 if block <= 4096 else 8


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, d, eps, x_row, res_row, y_row, ro_row,
                         HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                         USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)  # programmatic dependent launch (ops/triton_common.py)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    s = tl.load(x_ptr + row * x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s += tl.load(res_ptr + row * res_row + offs, mask=mask, other=0.0).to(tl.float32)
    if STORE_RESIDUAL:  # the new residual in its own dtype (fp32 or the model dtype)
        res_ty = res_out_ptr.dtype.element_ty
        s = s.to(res_ty).to(tl.float32)
        tl.store(res_out_ptr + row * ro_row + offs, s.to(res_ty), mask=mask)
    h = s.to(y_ptr.dtype.element_ty).to(tl.float32)  # the norm reads the sum in the weight dtype
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / d + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_row + offs, w * (h * rstd), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, group_size, eps, y_row, z_row, o_row,
                           BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)  # programmatic dependent launch (ops/triton_common.py)
    row = tl.program_id(0)
    offs = tl.program_id(1) * group_size + tl.arange(0, BLOCK)  # channels of this group
    mask = tl.arange(0, BLOCK) < group_size
    y = tl.load(y_ptr + row * y_row + offs, mask=mask, other=0.0)
    z = tl.load(z_ptr + row * z_row + offs, mask=mask, other=0.0).to(tl.float32)
    h = y.to(tl.float32) * silu(z)
    g = h / tl.sqrt(tl.sum(h * h, axis=0) / group_size + eps)
    g = g.to(y.dtype).to(tl.float32)  # rounded to y's dtype before the weight, as the PyTorch form
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * o_row + offs, w * g, mask=mask)


def _rows(t: Tensor, d: int, name: str) -> Tensor:
    """(..., d) -> (T, d) view with unit channel stride (a copy only when the rows cannot be flattened)."""
    if t.shape[-1] != d:
        raise ValueError(f"{name} must end in the norm's {d} channels, got shape {tuple(t.shape)}")
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def add_rms_norm_triton(x: Tensor, residual: Tensor | None, weight: Tensor, *, eps: float,
                        residual_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    """Triton form of ``add_rms_norm`` (see ``ssmspec.ops.norm``)."""
    d = weight.shape[0]
    if weight.dim() != 1 or d > _MAX_D:
        raise ValueError(f"weight must be (d,) with d <= {_MAX_D}, got {tuple(weight.shape)}; use backend='reference'")
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if t is not None:
            check_float(name, t)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    x2 = _rows(x, d, "x")
    r2 = _rows(residual, d, "residual") if residual is not None else None
    rdtype = residual_dtype(x, residual, residual_in_fp32)
    store = residual is not None or rdtype != x.dtype  # no residual and no cast: the new residual is x
    y = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=rdtype, device=x.device) if store else x
    T = x2.shape[0]
    if T:
        block = triton.next_power_of_2(d)
        _add_rms_norm_kernel[(T,)](x2, r2 if r2 is not None else dummy(x), weight, y, res_out if store else dummy(x),
                                   d, float(eps), x2.stride(0), r2.stride(0) if r2 is not None else 0, d, d,
                                   HAS_RESIDUAL=r2 is not None, STORE_RESIDUAL=store, BLOCK=block,
                                   num_warps=_warps(block), **pdl_args(x2))
    return y, res_out


def gated_rms_norm_triton(y: Tensor, z: Tensor, weight: Tensor, *, group_size: int, eps: float) -> Tensor:
    """Triton form of ``gated_rms_norm`` (see ``ssmspec.ops.norm``)."""
    d = weight.shape[0]
    if weight.dim() != 1 or y.shape != z.shape or y.shape[-1] != d:
        raise ValueError(f"need y, z (..., d) and weight (d,); got {tuple(y.shape)}, {tuple(z.shape)}, {tuple(weight.shape)}")
    if group_size <= 0 or d % group_size or group_size > _MAX_D:
        raise ValueError(f"group_size must divide d={d} and be at most {_MAX_D}, got {group_size}")
    for name, t in (("y", y), ("z", z), ("weight", weight)):
        check_float(name, t)
    y2, z2 = _rows(y, d, "y"), _rows(z, d, "z")
    out = torch.empty(y.shape, dtype=torch.promote_types(y.dtype, weight.dtype), device=y.device)
    T = y2.shape[0]
    if T:
        block = triton.next_power_of_2(group_size)
        _gated_rms_norm_kernel[(T, d // group_size)](y2, z2, weight, out, group_size, float(eps), y2.stride(0),
                                                      z2.stride(0), d, BLOCK=block, num_warps=_warps(block),
                                                      **pdl_args(y2))
    return out
