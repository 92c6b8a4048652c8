"""Causal depthwise conv1d over the token axis with a carried state (the last W-1 inputs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv1d_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, state: Tensor | None = None,
                      activation: str | None = "silu") -> tuple[Tensor, Tensor]:
    """x (B, L, C), weight (C, W), bias (C,), state (B, C, W-1) holding the W-1 inputs before x
    (oldest first; zeros at the start of a sequence). Returns y (B, L, C) in x's dtype and the new
    state (B, C, W-1), the last W-1 inputs of [state, x]."""
    bsz, L, Cdim = x.shape
    W = weight.shape[-1]
    if state is None:
        state = x.new_zeros(bsz, Cdim, W - 1)
    full = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, C, W-1+L)
    y = F.conv1d(full.float(), weight.float()[:, None, :], None if bias is None else bias.float(), groups=Cdim)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation not in (None, "identity"):
        raise ValueError(f"unsupported conv activation {activation!r}; use 'silu' or None")
    return y.transpose(1, 2).to(x.dtype), full[..., full.shape[-1] - (W - 1):].clone()
