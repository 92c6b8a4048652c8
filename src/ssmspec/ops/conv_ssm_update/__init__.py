"""Fused Mamba-2 decode step: conv of one token + single-token SSM update in one launch (issue 26 item 1).

Replaces ``causal_conv1d_update`` (conv state shifted in place, silu) followed by ``selective_state_update``
(dt_bias + softplus + dt_limit, D skip, state in place) for L = 1; equal to that pair up to accumulation order
(the conv output is rounded to xbc's dtype before the SSM reads it, as the pair does).
"""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.conv_ssm_update.naive import check_conv_ssm_shapes, conv_ssm_update_ref
from ssmspec.ops.dispatch import use_triton


def conv_ssm_update(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None,
                    ssm_state: Tensor, dt: Tensor, A: Tensor, D: Tensor | None, dt_bias: Tensor | None, *,
                    heads: int, head_dim: int, groups: int, state_size: int,
                    dt_limit: tuple[float, float] = (0.0, float("inf")), activation: str | None = "silu",
                    workspace: Tensor | None = None, backend: str = "auto") -> Tensor:
    """One token per sequence through a Mamba-2 mixer's conv and SSM, both states in place.

    xbc (B, conv_dim) pre-conv x | B | C, conv_dim = H*P + 2*G*N; conv_state (B, conv_dim, W-1) oldest column
    first, xbc's dtype; conv_weight (conv_dim, W); conv_bias (conv_dim,); ssm_state (B, H, P, N) fp32; dt (B, H)
    raw (dt_bias added, softplus, then clamped to dt_limit); A (H,); D (H,); dt_bias (H,); activation 'silu' or
    None (the conv's). workspace: (>= B*G,) int32 zeros the Triton kernel counts in and leaves zero (None: a
    fresh one per call, one extra memset; keep one per state for CUDA graphs). Returns y (B, H*P) in xbc's
    dtype. ``backend``: see ``ssmspec.ops.dispatch``.
    """
    if use_triton(xbc, conv_state, conv_weight, ssm_state, dt, backend=backend):
        from ssmspec.ops.conv_ssm_update.triton import conv_ssm_update_triton
        return conv_ssm_update_triton(xbc, conv_state, conv_weight, conv_bias, ssm_state, dt, A, D, dt_bias,
                                      heads=heads, head_dim=head_dim, groups=groups, state_size=state_size,
                                      dt_limit=dt_limit, activation=activation, workspace=workspace)
    return conv_ssm_update_ref(xbc, conv_state, conv_weight, conv_bias, ssm_state, dt, A, D, dt_bias, heads=heads,
                               head_dim=head_dim, groups=groups, state_size=state_size, dt_limit=dt_limit,
                               activation=activation)


__all__ = ["check_conv_ssm_shapes", "conv_ssm_update", "conv_ssm_update_ref"]
