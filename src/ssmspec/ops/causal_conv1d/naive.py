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


def causal_conv1d_update_ref(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                             activation: str | None = "silu", update_state: bool = True) -> Tensor:
    """Conv of a few decode tokens over [conv_state, x]. x (B, L, C), conv_state (B, C, W-1) oldest first,
    weight (C, W), bias (C,). If ``update_state`` the state becomes the last W-1 inputs (in place).
    Returns y (B, L, C) in x's dtype."""
    W = weight.shape[-1]
    if x.dim() != 3 or conv_state.shape != (x.shape[0], x.shape[2], W - 1) or weight.shape[0] != x.shape[2]:
        raise ValueError(f"need x (B, L, C), conv_state (B, C, W-1), weight (C, W); got {tuple(x.shape)}, "
                         f"{tuple(conv_state.shape)}, {tuple(weight.shape)}")
    y, new = causal_conv1d_ref(x, weight, bias, state=conv_state, activation=activation)
    if update_state:
        conv_state.copy_(new)
    return y


def conv_state_advance_ref(conv_state: Tensor, x: Tensor, keep: Tensor) -> None:
    """Rollback offset: conv_state (B, C, W-1) becomes, in place, the last W-1 inputs of
    [conv_state, x[b, :keep[b]]]; x (B, L, C), keep (B,) int in [0, L] (0: unchanged). Device-side."""
    bsz, L, Cdim = x.shape
    W1 = conv_state.shape[-1]
    if conv_state.shape[:2] != (bsz, Cdim) or keep.shape != (bsz,):
        raise ValueError(f"need conv_state (B, C, W-1) with B={bsz}, C={Cdim} and keep (B,); got "
                         f"{tuple(conv_state.shape)}, {tuple(keep.shape)}")
    full = torch.cat([conv_state, x.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # (B, C, W-1+L)
    idx = keep.long()[:, None] + torch.arange(W1, device=x.device)[None]  # (B, W-1) columns to keep
    conv_state.copy_(full.gather(2, idx[:, None, :].expand(-1, Cdim, -1)))


def causal_conv1d_update_slots_ref(x: Tensor, pool: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                                   src_slot: Tensor, dst_slot: Tensor, keep: Tensor | None = None,
                                   activation: str | None = "silu") -> Tensor:
    """Conv of a few tokens over [pool[src_slot[b]], x[b]]: x (B, L, C), pool (slots, C, W-1) oldest first,
    src_slot, dst_slot (B,) int, keep (B,) int in [0, L] or None (L). Slot dst_slot[b] becomes the last W-1
    inputs of [pool[src_slot[b]], x[b, :keep[b]]] (a row's dst may be its own src; no row stores into a slot
    another row reads). Returns y (B, L, C) in x's dtype."""
    W1 = pool.shape[-1]
    state = pool[src_slot.long()]  # (B, C, W-1)
    y = causal_conv1d_update_ref(x, state, weight, bias, activation=activation, update_state=False)
    full = torch.cat([state, x.transpose(1, 2).to(state.dtype)], dim=-1)  # (B, C, W-1+L)
    n = torch.full_like(src_slot, x.shape[1]) if keep is None else keep
    idx = n.long()[:, None] + torch.arange(W1, device=x.device)[None]  # (B, W-1)
    pool[dst_slot.long()] = full.gather(2, idx[:, None, :].expand(-1, full.shape[1], -1))
    return y


def conv_state_commit_ref(conv_state: Tensor, x: Tensor, accepted: Tensor, count: Tensor) -> None:
    """A replay commit's pointer move and conv advance (``ops.causal_conv1d.conv_state_commit``), one op at a time:
    count (n, B) += accepted + 1, then ``conv_state_advance_ref`` of conv_state (n B, C, W-1) by accepted + 1
    inputs of x (n B, L, C), the same for each of the n layers."""
    count += accepted + 1
    conv_state_advance_ref(conv_state, x, (accepted + 1).repeat(count.shape[0]))
