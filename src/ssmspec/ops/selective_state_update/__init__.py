"""Single-token Mamba-2 state update (the `autoregressive` baseline, seed 000 Alg. 1)."""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.selective_state_update.naive import selective_state_update_ref


def selective_state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
                           dt_softplus: bool = False, *, dt_limit: tuple[float, float] = (0.0, float("inf")),
                           state_batch_indices: Tensor | None = None, backend: str = "auto") -> Tensor:
    """One token, in place on ``state`` (mamba_ssm-compatible signature, A one scalar per head).

    state (Bs, H, P, N) fp32; x (B, H, P) bf16 / fp16 / fp32; dt (B, H) (raw when ``dt_softplus``, else
    discretized); A (H,); B, C (B, G, N); D (H,); z (B, H, P) gates the output with silu(z); dt_bias (H,);
    dt_limit clamps dt after softplus; state_batch_indices (B,) int: state row of each sequence.
    Returns y (B, H, P) in x's dtype. ``backend``: see ``ssmspec.ops.dispatch``.
    """
    if use_triton(state, x, dt, A, B, C, backend=backend):
        from ssmspec.ops.selective_state_update.triton import selective_state_update_triton
        return selective_state_update_triton(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit=dt_limit,
                                             state_batch_indices=state_batch_indices)
    return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit=dt_limit,
                                      state_batch_indices=state_batch_indices)


__all__ = ["selective_state_update", "selective_state_update_ref"]
