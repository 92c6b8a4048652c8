"""Causal depthwise conv1d with a carried state (no dependency on the CUDA-only causal-conv1d package).

``causal_conv1d`` (prompt pass, returns the new state) stays the reference; the decode-time ops
``causal_conv1d_update`` (a few tokens over [state, x]) and ``conv_state_advance`` (the rollback offset)
dispatch Triton on CUDA.
"""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.causal_conv1d.naive import (causal_conv1d_ref, causal_conv1d_update_ref, causal_conv1d_update_slots_ref,
                                             conv_state_advance_ref)
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


__all__ = ["causal_conv1d", "causal_conv1d_ref", "causal_conv1d_update", "causal_conv1d_update_ref",
           "causal_conv1d_update_slots", "causal_conv1d_update_slots_ref", "conv_state_advance",
           "conv_state_advance_ref"]
