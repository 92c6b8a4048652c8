"""The naive twin of the SSD scan's backward: autograd through the fp32 chunked reference ``ssd_chunk_scan_ref``.

The Triton backward (``triton.py``) is checked against the gradients PyTorch's autograd takes through the
reference scan of ``ops/ssd/naive.py`` (the ground truth of the forward, itself checked against the per-token
recurrence), for every input: x, dt, A, B, C, D and the initial state. The reference computes in fp32 whatever
its inputs' dtype (it casts them), so its gradients are fp32 maths on the inputs' values, cast back by autograd
to each input's dtype.
"""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.ssd.naive import ssd_chunk_scan_ref


def ssd_chunk_scan_grad_ref(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                            initial_state: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The reference scan with its autograd graph: x (B, L, H, P), dt (B, L, H), A (H,), B, C (B, L, G, N), D (H,)
    or None, initial_state (B, H, P, N) or None. Returns y (B, L, H, P) and the final state (B, H, P, N), both
    fp32, differentiable in every tensor argument that requires grad."""
    return ssd_chunk_scan_ref(x, dt, A, B, C, D, chunk_size=chunk_size, initial_state=initial_state)
