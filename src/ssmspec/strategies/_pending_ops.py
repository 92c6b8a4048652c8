"""TEMPORARY stand-ins for ops the kernel engineer is landing (ops contract); removed once they exist."""
from __future__ import annotations

import torch
from torch import Tensor

try:
    from ssmspec.ops.causal_conv1d import conv_state_advance  # noqa: F401
except ImportError:
    def conv_state_advance(conv_state: Tensor, x: Tensor, keep: Tensor) -> None:
        W1 = conv_state.shape[-1]
        full = torch.cat([conv_state, x.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # (B, C, W-1+L)
        idx = keep[:, None] + torch.arange(W1, device=x.device)[None]  # (B, W-1)
        conv_state.copy_(full.gather(2, idx[:, None, :].expand(-1, full.shape[1], -1)))

try:
    from ssmspec.ops.causal_conv1d import causal_conv1d_update  # noqa: F401
except ImportError:
    from ssmspec.ops.causal_conv1d import causal_conv1d as _cc

    def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation="silu", update_state=True):
        y, new = _cc(x, weight, bias, state=conv_state, activation=activation)
        if update_state:
            conv_state.copy_(new)
        return y

try:
    from ssmspec.ops.multistep import ssm_multistep  # noqa: F401
except ImportError:
    from ssmspec.ops.ssd.naive import ssd_chunk_scan_ref

    def ssm_multistep(state, x, dt, A, B, C, D=None, *, dt_bias=None, dt_softplus=True, dt_limit=(0, float("inf")),
                      z=None, state_batch_indices=None, update_count=None, store_state=True):
        assert not dt_softplus and dt_bias is None
        L = x.shape[1]
        if update_count is not None:
            dt = dt * (torch.arange(L, device=x.device)[None] < update_count[:, None])[..., None].to(dt.dtype)
        y, new = ssd_chunk_scan_ref(x, dt, A, B, C, D, chunk_size=max(L, 1), initial_state=state)
        if store_state:
            state.copy_(new)
        return y
