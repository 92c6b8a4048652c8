"""The Mamba-2 sequence scan with a backward, for training: the one-kernel forward of ``ops/ssd`` that also saves
checkpoint states, and its tile-parallel backward (``triton.py``: a dS pass, then per-tile kernels) on CUDA;
autograd through the fp32 reference (``naive.py``) elsewhere. Inference keeps calling ``ops.ssd.ssd_chunk_scan`` (no states saved)."""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.ssd.naive import check_ssd_shapes
from ssmspec.ops.ssd_grad.naive import ssd_chunk_scan_grad_ref


def ssd_chunk_scan_trainable(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                             initial_state: Tensor | None = None, chunk_size: int = 64,
                             backend: str = "auto") -> tuple[Tensor, Tensor]:
    """The SSM over a whole sequence from ``initial_state`` (None: zeros), differentiable in x, dt, A, B, C, D and
    the initial state.

    x (B, L, H, P); dt (B, L, H) already discretized (0 on pad tokens); A (H,) negative; B, C (B, L, G, N), head
    h reads group h // (H / G); D (H,) or None; initial_state (B, H, P, N) or None. Returns y (B, L, H, P) -- in
    x's dtype from the kernel, fp32 from the reference -- and the final state (B, H, P, N) fp32. ``backend`` as
    every op takes it (``ops.dispatch``): the kernels on CUDA (``auto``), the reference with autograd elsewhere;
    ``chunk_size`` is the reference's chunk length (the kernels tile by ``triton.default_launch``).
    """
    check_ssd_shapes(x, dt, A, B, C, D, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if use_triton(x, dt, A, B, C, D, initial_state, backend=backend):
        from ssmspec.ops.ssd_grad.triton import ssd_chunk_scan_grad_triton
        return ssd_chunk_scan_grad_triton(x, dt, A, B, C, D, initial_state=initial_state)
    return ssd_chunk_scan_grad_ref(x, dt, A, B, C, D, initial_state=initial_state, chunk_size=chunk_size)


__all__ = ["ssd_chunk_scan_grad_ref", "ssd_chunk_scan_trainable"]
