"""Helpers shared by the Triton kernels (imported lazily by the public ops, see ``ops.dispatch``).

Programmatic dependent launch (PDL, Hopper and newer): a decode step at batch 1 is some 400 short kernels, and
between two of them the GPU drains one grid before it starts the next. The decode kernels (GEMV, norms, conv
update, state update) launch with PDL where ``pdl_args`` allows it: each calls ``gdc_enter`` first, which waits
for the kernels before it to finish and their writes to be visible (``griddepcontrol.wait``), then lets the
next kernel launch (``griddepcontrol.launch_dependents``); so the next grid is scheduled while this one runs and
only its body waits. Every kernel that launches with PDL waits before it reads or writes anything, so the order
of memory effects is the stream's. ``SSMSPEC_PDL``: ``auto`` (default; on for CUDA devices of compute
capability 9.0 and newer), ``1`` (on; refused on older GPUs), ``0`` (off). Under the interpreter and on the CPU
it is off.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENV = "SSMSPEC_PDL"
_PDL_MODES = {"auto": "auto", "1": "on", "on": "on", "0": "off", "off": "off"}


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_mode() -> str:
    """``SSMSPEC_PDL`` as auto / on / off; anything else fails with the choices."""
    raw = os.environ.get(PDL_ENV, "auto").strip().lower()
    if raw not in _PDL_MODES:
        raise ValueError(f"{PDL_ENV}={raw!r}: use auto (PDL on Hopper and newer GPUs), 1 (on) or 0 (off)")
    return _PDL_MODES[raw]


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether the decode kernels on ``t``'s device launch with programmatic dependent launch (module doc)."""
    mode = pdl_mode()
    if mode == "off" or not t.is_cuda:
        return False
    capable = _hopper_or_newer(t.device.index if t.device.index is not None else torch.cuda.current_device())
    if mode == "on" and not capable:
        raise ValueError(f"{PDL_ENV}=1 needs a GPU of compute capability 9.0 or newer ({t.device} is "
                         f"{torch.cuda.get_device_name(t.device)}); set {PDL_ENV}=auto or 0")
    return capable


def pdl_args(t: torch.Tensor) -> dict:
    """Launch arguments of a PDL-aware kernel for tensors on ``t``'s device: its ``USE_GDC`` flag and, when on,
    Triton's ``launch_pdl`` launch option."""
    return {"USE_GDC": True, "launch_pdl": True} if pdl_enabled(t) else {"USE_GDC": False}


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    """First statement of a PDL-aware kernel (module doc): wait for the kernels before it, then let the next
    one launch. Compiled out when ``USE_GDC`` is False."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


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
