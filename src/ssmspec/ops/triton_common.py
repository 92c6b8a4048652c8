"""Helpers shared by the Triton kernels (imported lazily by the public ops, see ``ops.dispatch``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def softplus(x):
    """log(1 + e^x), identity above 20 where fp32 cannot tell them apart (mamba_ssm does the same)."""
    return tl.where(x <= 20.0, tl.log(tl.exp(x) + 1.0), x)


@triton.jit
def discretize(dt, bias, lo, hi, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """dt + bias, softplus when DT_SOFTPLUS, clamped to [lo, hi] when HAS_LIMIT (fp32)."""
    d = dt + bias
    if DT_SOFTPLUS:
        d = softplus(d)
    if HAS_LIMIT:
        d = tl.minimum(tl.maximum(d, lo), hi)
    return d


@triton.jit
def silu(x):
    return x * tl.sigmoid(x)


def has_limit(dt_limit: tuple[float, float]) -> bool:
    lo, hi = dt_limit
    return lo > 0.0 or hi != float("inf")


def limit_args(dt_limit: tuple[float, float]) -> tuple[float, float]:
    """(lo, hi) as finite floats for a kernel argument (inf would be specialized badly)."""
    lo, hi = dt_limit
    return float(lo), float(min(hi, 3.0e38))


def check_float(name: str, t: torch.Tensor, allowed=(torch.float16, torch.bfloat16, torch.float32)) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} must be one of {[str(a) for a in allowed]} for the Triton kernel, got {t.dtype}; "
                         f"cast it, or use backend='reference' (float64 runs only there)")


def dummy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A 1-element placeholder for an absent optional tensor (its HAS_* flag keeps it unread). An allocation
    only: no kernel runs (a ``.long()`` of a placeholder would add a conversion launch to every call)."""
    return torch.empty(1, dtype=dtype or t.dtype, device=t.device)
