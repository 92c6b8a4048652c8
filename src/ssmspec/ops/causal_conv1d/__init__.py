"""Causal depthwise conv1d with a carried state (no dependency on the CUDA-only causal-conv1d package).

``causal_conv1d`` (prompt pass, returns the new state) stays the reference; the decode-time ops
``causal_conv1d_update`` (a few tokens over [state, x]), ``conv_state_advance`` (the rollback offset) and
``conv_state_commit`` (a replay commit: the ring counts and the conv advance of every layer, one launch) dispatch
Triton on CUDA.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.causal_conv1d.naive import (causal_conv1d_ref, causal_conv1d_update_ref, causal_conv1d_update_slots_ref,
                                             conv_state_advance_ref, conv_state_commit_ref)
from ssmspec.ops.dispatch import use_triton

causal_conv1d = causal_conv1d_ref


def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                         activation: str | None = "silu", update_state: bool = True,
                         save_input: Tensor | None = None, backend: str = "auto") -> Tensor:
    """Conv over [conv_state, x]: x (B, L, C), conv_state (B, C, W-1) oldest first, weight (C, W), bias (C,);
    activation 'silu' or None. If ``update_state`` the state becomes the last W-1 inputs (in place).
    ``save_input`` (B, >= L, C): its first L positions receive x in the same launch (what a strategy keeps to
    advance the state later over the accepted tokens). Returns y (B, L, C) in x's dtype."""
    if save_input is not None and (save_input.dim() != 3 or save_input.shape[0] != x.shape[0]
                                   or save_input.shape[1] < x.shape[1] or save_input.shape[2] != x.shape[2]):
        raise ValueError(f"save_input must be (B, >= L, C) for x {tuple(x.shape)}, got {tuple(save_input.shape)}")
    if use_triton(x, conv_state, weight, save_input, backend=backend):
        from ssmspec.ops.causal_conv1d.triton import causal_conv1d_update_triton
        return causal_conv1d_update_triton(x, conv_state, weight, bias, activation=activation,
                                           update_state=update_state, save_input=save_input)
    if save_input is not None:
        save_input[:, :x.shape[1]] = x
    return causal_conv1d_update_ref(x, conv_state, weight, bias, activation=activation, update_state=update_state)


def causal_conv1d_update_slots(x: Tensor, pool: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                               src_slot: Tensor, dst_slot: Tensor, keep: Tensor | None = None,
                               activation: str | None = "silu", backend: str = "auto") -> Tensor:
    """Conv over [pool[src_slot[b]], x[b]] (x (B, L, C), pool (slots, C, W-1), src_slot / dst_slot (B,) int);
    slot dst_slot[b] becomes the last W-1 inputs after the first keep[b] tokens ((B,) int; None: all L). A row's
    dst may be its own src (read first); no row may store into a slot another row reads. Returns y (B, L, C)
    in x's dtype."""
    if use_triton(x, pool, weight, backend=backend):
        from ssmspec.ops.causal_conv1d.triton import causal_conv1d_update_slots_triton
        return causal_conv1d_update_slots_triton(x, pool, weight, bias, src_slot=src_slot, dst_slot=dst_slot,
                                                 keep=keep, activation=activation)
    return causal_conv1d_update_slots_ref(x, pool, weight, bias, src_slot=src_slot, dst_slot=dst_slot, keep=keep,
                                          activation=activation)


def conv_state_advance(conv_state: Tensor, x: Tensor, keep: Tensor, *, backend: str = "auto") -> None:
    """conv_state (B, C, W-1) becomes, in place, the last W-1 inputs of [conv_state, x[b, :keep[b]]]:
    x (B, L, C) the call's pre-conv inputs, keep (B,) int in [0, L]. Device-side, no host sync."""
    if use_triton(conv_state, x, keep, backend=backend):
        from ssmspec.ops.causal_conv1d.triton import conv_state_advance_triton
        conv_state_advance_triton(conv_state, x, keep)
        return
    conv_state_advance_ref(conv_state, x, keep)


def conv_state_commit(conv_state: Tensor, x: Tensor, accepted: Tensor, count: Tensor, *, backend: str = "auto") -> None:
    """A replay commit of n layers in one launch: ``count`` (n, B) int64 += accepted + 1 (the pending token and the
    accepted drafts join the ring), and ``conv_state`` (n B, C, W-1), rows layer-major, becomes in place the last
    W-1 inputs of [conv_state, x[r, :accepted[r % B] + 1]] (``conv_state_advance`` with keep = accepted + 1 for
    every layer). x (n B, L, C), accepted (B,) int64 in [0, L - 1]. In PyTorch (the reference) that is four launches
    besides the advance: the add, the in-place add and the (accepted + 1).repeat(n) it takes. Device-side."""
    if count.dim() != 2 or accepted.shape != (count.shape[1],) or conv_state.shape[0] != count.numel():
        raise ValueError(f"conv_state_commit needs count (n, B), accepted (B,) and conv_state (n B, C, W-1); got "
                         f"{tuple(count.shape)}, {tuple(accepted.shape)}, {tuple(conv_state.shape)}")
    if count.dtype != torch.long or accepted.dtype != torch.long or not count.is_contiguous():
        raise ValueError(f"conv_state_commit needs count and accepted int64 (count contiguous); got {count.dtype}, "
                         f"{accepted.dtype}")
    if use_triton(conv_state, x, accepted, count, backend=backend):
        from ssmspec.ops.causal_conv1d.triton import conv_state_commit_triton
        conv_state_commit_triton(conv_state, x, accepted.contiguous(), count)
        return
    conv_state_commit_ref(conv_state, x, accepted, count)


__all__ = ["causal_conv1d", "causal_conv1d_ref", "causal_conv1d_update", "causal_conv1d_update_ref",
           "causal_conv1d_update_slots", "causal_conv1d_update_slots_ref", "conv_state_advance",
           "conv_state_advance_ref", "conv_state_commit", "conv_state_commit_ref"]
