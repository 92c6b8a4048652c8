"""Single-token Mamba-2 state update in Triton (seed 000, Alg. 1): the L = 1 case of the multi-token
kernel in ``ops/multistep/triton.py`` (Triton specializes L = 1 at compile time, so the token loop
disappears); block sizes for L = 1 are picked in ``_blocks`` there."""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.multistep.triton import _launch


def selective_state_update_triton(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                                  D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
                                  dt_softplus: bool = False, *, dt_limit=(0.0, float("inf")),
                                  state_batch_indices: Tensor | None = None, block_p: int | None = None,
                                  num_warps: int | None = None) -> Tensor:
    """state (Bs, H, P, N) fp32 in place; x (B, H, P); dt (B, H); A (H,); B, C (B, G, N); D (H,); z (B, H, P);
    dt_bias (H,); state_batch_indices (B,) (negative: pad, y = 0, state untouched). Returns y (B, H, P)."""
    if x.dim() != 3 or dt.dim() != 2 or B.dim() != 3 or C.dim() != 3:
        raise ValueError(f"selective_state_update takes one token: x (B, H, P), dt (B, H), B and C (B, G, N); got "
                         f"{tuple(x.shape)}, {tuple(dt.shape)}, {tuple(B.shape)}, {tuple(C.shape)}")
    rows = None
    if state_batch_indices is not None:
        if state_batch_indices.shape != (x.shape[0],):
            raise ValueError(f"state_batch_indices must be (B,) = ({x.shape[0]},), got {tuple(state_batch_indices.shape)}")
        rows = state_batch_indices.long().contiguous()
    y = _launch(state, x[:, None], dt[:, None], A, B[:, None], C[:, None], D, None if z is None else z[:, None],
                dt_bias, dt_softplus, dt_limit, rows=rows, count=None, dst=None, store_final=True, output=True,
                block_p=block_p, num_warps=num_warps)
    return y[:, 0]
