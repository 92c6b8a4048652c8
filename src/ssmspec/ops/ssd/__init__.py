"""Mamba-2 sequence scan (prefill): the chunked SSD form. On CUDA one Triton kernel (``triton.py``, seed 004),
elsewhere the pure-PyTorch chunk scan (``naive.py``, fp32 ground truth); decode-time kernels live in their
own op folders."""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.ssd.naive import check_scan_options, check_ssd_shapes, ssd_chunk_scan_ref, ssm_recurrence_ref


def ssd_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                   chunk_size: int = 64, initial_state: Tensor | None = None, z: Tensor | None = None,
                   dt_bias: Tensor | None = None, dt_softplus: bool = False,
                   dt_limit: tuple[float, float] = (0.0, float("inf")), seq_idx: Tensor | None = None,
                   cu_seqlens: Tensor | None = None, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """The SSM over a whole sequence from ``initial_state`` (None: zeros); the options of mamba_ssm's
    ``mamba_chunk_scan_combined``, in one launch on CUDA.

    x (B, L, H, P); dt (B, L, H): already discretized (softplus, clamp; 0 on pad tokens, which leaves the
    state untouched) unless ``dt_bias`` (H,) / ``dt_softplus`` / ``dt_limit`` (lo, hi) are given, which make
    dt = clamp(softplus(dt + dt_bias), lo, hi) (each step only when asked; no limit: (0, inf)); A (H,) negative;
    B, C (B, L, G, N), head h reads group h // (H / G); D (H,) or (H, P) or None; z (B, L, H, P) or None: y =
    (scan + D·x)·silu(z). initial_state (B, H, P, N).

    Several sequences in one launch, unpadded: ``seq_idx`` (B, L) int gives every token's sequence; a sequence
    starts where the id changes along a row, from zeros (the row's ``initial_state`` feeds its first one), and
    the final state is each row's. ``cu_seqlens`` (num_seqs + 1,) int, [0, ..., L] strictly increasing, packs
    the sequences into one row (B = 1; ``seq_idx`` follows from it and may be omitted): ``initial_state`` is
    then (num_seqs, H, P, N), one per sequence, and the final states come back one per sequence. The law: the
    same outputs and final states as each sequence scanned alone.

    Returns y (B, L, H, P) -- in x's dtype from the kernel, fp32 from the reference -- and the final states
    (B, H, P, N), or (num_seqs, H, P, N) with ``cu_seqlens``, fp32, a new tensor. ``chunk_size`` is the
    reference's chunk length; the kernel tiles by its own ``block_t`` (the result is the same up to rounding).
    Inference only on the kernel (no autograd; training uses ``ops.ssd_grad``).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    opts = dict(z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, seq_idx=seq_idx,
                cu_seqlens=cu_seqlens)
    if use_triton(x, dt, A, B, C, D, initial_state, z, dt_bias, backend=backend):
        from ssmspec.ops.ssd.triton import ssd_chunk_scan_triton  # validates the inputs as below
        return ssd_chunk_scan_triton(x, dt, A, B, C, D, initial_state=initial_state, **opts)
    check_scan_options(x, dt, A, B, C, D, initial_state, z=z, dt_bias=dt_bias, dt_limit=dt_limit, seq_idx=seq_idx,
                       cu_seqlens=cu_seqlens)
    return ssd_chunk_scan_ref(x, dt, A, B, C, D, chunk_size=chunk_size, initial_state=initial_state, **opts)


__all__ = ["check_scan_options", "check_ssd_shapes", "ssd_chunk_scan", "ssd_chunk_scan_ref", "ssm_recurrence_ref"]
