"""Reference fused decode step of a Mamba-2 mixer: the composition of the two ops it replaces (the conv update,
then the single-token state update), so the twin is the unfused path by construction."""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.causal_conv1d.naive import causal_conv1d_update_ref
from ssmspec.ops.selective_state_update.naive import selective_state_update_ref


def check_conv_ssm_shapes(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None,
                          ssm_state: Tensor, dt: Tensor, A: Tensor, D: Tensor | None, dt_bias: Tensor | None, *,
                          heads: int, head_dim: int, groups: int, state_size: int) -> None:
    """One clear ValueError for any shape that does not fit one token of an (H, P, G, N) mixer."""
    H, P, G, N = heads, head_dim, groups, state_size
    if min(H, P, G, N) < 1 or H % G:
        raise ValueError(f"need heads, head_dim, groups, state_size >= 1 with heads % groups == 0; got H={H}, "
                         f"P={P}, G={G}, N={N}")
    conv_dim = H * P + 2 * G * N
    if xbc.dim() != 2 or xbc.shape[1] != conv_dim:
        raise ValueError(f"xbc must be one token per sequence, (B, conv_dim) = (B, {conv_dim}) (H*P + 2*G*N); got "
                         f"{tuple(xbc.shape)} -- for L tokens use causal_conv1d_update + selective_state_update")
    bsz = xbc.shape[0]
    if conv_weight.dim() != 2 or conv_weight.shape[0] != conv_dim or conv_weight.shape[1] < 2:
        raise ValueError(f"conv_weight must be (conv_dim, W) = ({conv_dim}, W >= 2); got {tuple(conv_weight.shape)}")
    W = conv_weight.shape[1]
    if conv_state.shape != (bsz, conv_dim, W - 1):
        raise ValueError(f"conv_state must be (B, conv_dim, W-1) = {(bsz, conv_dim, W - 1)} (oldest column first); "
                         f"got {tuple(conv_state.shape)}")
    if conv_bias is not None and conv_bias.shape != (conv_dim,):
        raise ValueError(f"conv_bias must be (conv_dim,) = ({conv_dim},); got {tuple(conv_bias.shape)}")
    if ssm_state.shape != (bsz, H, P, N):
        raise ValueError(f"ssm_state must be (B, H, P, N) = {(bsz, H, P, N)}; got {tuple(ssm_state.shape)}")
    if dt.shape != (bsz, H):
        raise ValueError(f"dt must be (B, H) = {(bsz, H)} (raw, before dt_bias and softplus); got {tuple(dt.shape)}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is not None and t.shape != (H,):
            raise ValueError(f"{name} must be (H,) = ({H},); got {tuple(t.shape)}")


def conv_ssm_update_ref(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None,
                        ssm_state: Tensor, dt: Tensor, A: Tensor, D: Tensor | None, dt_bias: Tensor | None, *,
                        heads: int, head_dim: int, groups: int, state_size: int,
                        dt_limit: tuple[float, float] = (0.0, float("inf")), activation: str | None = "silu") -> Tensor:
    """``causal_conv1d_update_ref`` on the token (conv_state in place; output in xbc's dtype) then
    ``selective_state_update_ref`` on its x | B | C split (ssm_state in place, dt_softplus). Returns y (B, H*P)."""
    check_conv_ssm_shapes(xbc, conv_state, conv_weight, conv_bias, ssm_state, dt, A, D, dt_bias, heads=heads,
                          head_dim=head_dim, groups=groups, state_size=state_size)
    bsz = xbc.shape[0]
    H, P, G, N = heads, head_dim, groups, state_size
    post = causal_conv1d_update_ref(xbc[:, None], conv_state, conv_weight, conv_bias, activation=activation)[:, 0]
    x, B, C = post.split([H * P, G * N, G * N], dim=-1)  # (B, H*P), (B, G*N) x2, xbc's dtype
    y = selective_state_update_ref(ssm_state, x.reshape(bsz, H, P), dt, A, B.reshape(bsz, G, N),
                                   C.reshape(bsz, G, N), D, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit)
    return y.reshape(bsz, H * P)
