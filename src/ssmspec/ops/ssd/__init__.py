"""Mamba-2 sequence scan (prefill): the chunked SSD form. On CUDA one Triton kernel (``triton.py``, seed 004),
elsewhere the pure-PyTorch chunk scan (``naive.py``, fp32 ground truth); decode-time kernels live in their
own op folders."""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.ssd.naive import check_ssd_shapes, ssd_chunk_scan_ref, ssm_recurrence_ref


def ssd_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                   chunk_size: int = 64, initial_state: Tensor | None = None,
                   backend: str = "auto") -> tuple[Tensor, Tensor]:
    """The SSM over a whole sequence from ``initial_state`` (None: zeros).

    x (B, L, H, P); dt (B, L, H) already discretized (softplus, clamp; 0 on pad tokens, which leaves the
    state untouched); A (H,) negative; B, C (B, L, G, N), head h reads group h // (H / G); D (H,) or None;
    initial_state (B, H, P, N). Returns y (B, L, H, P) -- in x's dtype from the kernel, fp32 from the
    reference -- and the final state (B, H, P, N) fp32, a new tensor. ``chunk_size`` is the reference's
    chunk length; the kernel tiles by its own ``block_t`` (the result is the same up to rounding).
    """
    check_ssd_shapes(x, dt, A, B, C, D, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if use_triton(x, dt, A, B, C, D, initial_state, backend=backend):
        from ssmspec.ops.ssd.triton import ssd_chunk_scan_triton
        return ssd_chunk_scan_triton(x, dt, A, B, C, D, initial_state=initial_state)
    return ssd_chunk_scan_ref(x, dt, A, B, C, D, chunk_size=chunk_size, initial_state=initial_state)


__all__ = ["check_ssd_shapes", "ssd_chunk_scan", "ssd_chunk_scan_ref", "ssm_recurrence_ref"]
