"""Triton kernels for the decode-time causal depthwise conv: a few tokens over [conv state, x]
(``causal_conv1d_update``, and its slot form ``causal_conv1d_update_slots`` that reads each row's window from
a pool slot and stores the window after its first ``keep`` tokens into another) and the rollback offset
(``conv_state_advance``), so no strategy needs the CUDA-only causal-conv1d package. One program per (sequence, BLOCK_C channels); the W taps are unrolled.
Both write the conv state in place (never autotuned): every program reads all the columns it will
write, then a barrier, then stores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.triton_common import dummy, gdc_enter, pdl_args, silu

_BLOCK_C = 256  # 256 channels x 2 B: each warp moves 128-byte rows; conv_dim ~ 10-20k gives 40-80 programs a row


@triton.jit
def _tap(x_ptr, st_ptr, i, offs_c, mask_c, x_l, x_c, s_c, s_w, W1: tl.constexpr):
    """Input number i of [state (W-1 columns), x (L tokens)] (i < 0 addresses the state), fp32."""
    if i < 0:
        v = tl.load(st_ptr + offs_c * s_c + (W1 + i) * s_w, mask=mask_c, other=0.0)
    else:
        v = tl.load(x_ptr + i * x_l + offs_c * x_c, mask=mask_c, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _conv_update_kernel(x_ptr, st_ptr, w_ptr, bias_ptr, y_ptr, src_ptr, dst_ptr, keep_ptr, save_ptr, L, Cdim,
                        x_b, x_l, x_c, s_b, s_c, s_w, w_c, w_w, y_b, y_l, y_c, v_b, v_l, v_c,
                        W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, UPDATE: tl.constexpr,
                        HAS_SLOTS: tl.constexpr, HAS_KEEP: tl.constexpr, SAVE: tl.constexpr, BLOCK_C: tl.constexpr,
                        USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)  # programmatic dependent launch (ops/triton_common.py)
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < Cdim
    xb = x_ptr + b * x_b
    if HAS_SLOTS:  # read the window of slot src[b], store the new one into slot dst[b]
        sb = st_ptr + tl.load(src_ptr + b).to(tl.int64) * s_b
        db = st_ptr + tl.load(dst_ptr + b).to(tl.int64) * s_b
    else:
        sb = st_ptr + b * s_b
        db = sb
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    for t in range(0, L):
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            acc += bias
        for k in tl.static_range(W):  # tap k multiplies input t - (W-1) + k
            wk = tl.load(w_ptr + offs_c * w_c + k * w_w, mask=mask_c, other=0.0).to(tl.float32)
            acc += wk * _tap(xb, sb, t - (W - 1) + k, offs_c, mask_c, x_l, x_c, s_c, s_w, W - 1)
        if SILU:
            acc = silu(acc)
        tl.store(y_ptr + b * y_b + t * y_l + offs_c * y_c, acc, mask=mask_c)
        if SAVE:  # the call's pre-conv input, kept for a later state advance (replaces a copy launch)
            xv = tl.load(xb + t * x_l + offs_c * x_c, mask=mask_c, other=0.0)
            tl.store(save_ptr + b * v_b + t * v_l + offs_c * v_c, xv, mask=mask_c)
    if UPDATE:  # new state column i = input n - (W-1) + i (n = L or keep[b]); read every column before writing
        n = L
        if HAS_KEEP:
            n = tl.load(keep_ptr + b).to(tl.int32)
        for i in tl.static_range(W - 1):
            v = _tap(xb, sb, n - (W - 1) + i, offs_c, mask_c, x_l, x_c, s_c, s_w, W - 1)
            if i == 0:
                c0 = v
            elif i == 1:
                c1 = v
            else:
                c2 = v
        tl.debug_barrier()
        for i in tl.static_range(W - 1):
            if i == 0:
                v = c0
            elif i == 1:
                v = c1
            else:
                v = c2
            tl.store(db + offs_c * s_c + i * s_w, v, mask=mask_c)


@triton.jit
def _conv_advance_kernel(x_ptr, st_ptr, keep_ptr, count_ptr, Cdim, KB, x_b, x_l, x_c, s_b, s_c, s_w,
                         W1: tl.constexpr, BLOCK_C: tl.constexpr, COMMIT: tl.constexpr):
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < Cdim
    if COMMIT:  # keep = accepted + 1 of row b's sequence (rows are layer-major: b = layer * KB + sequence); the
        #         first channel block's program also moves the row's count (nothing else reads it in this launch)
        keep = tl.load(keep_ptr + b % KB).to(tl.int32) + 1
        if tl.program_id(1) == 0:
            tl.store(count_ptr + b, tl.load(count_ptr + b) + keep)
    else:
        keep = tl.load(keep_ptr + b).to(tl.int32)
    if keep > 0:
        xb = x_ptr + b * x_b
        sb = st_ptr + b * s_b
        for i in tl.static_range(W1):  # new column i = input keep - (W-1) + i of [state, x]
            v = _tap(xb, sb, keep - W1 + i, offs_c, mask_c, x_l, x_c, s_c, s_w, W1)
            if i == 0:
                c0 = v
            elif i == 1:
                c1 = v
            else:
                c2 = v
        tl.debug_barrier()
        for i in tl.static_range(W1):
            if i == 0:
                v = c0
            elif i == 1:
                v = c1
            else:
                v = c2
            tl.store(sb + offs_c * s_c + i * s_w, v, mask=mask_c)


def _check(x: Tensor, conv_state: Tensor) -> tuple[int, int, int, int]:
    if x.dim() != 3 or conv_state.dim() != 3 or conv_state.shape[:2] != (x.shape[0], x.shape[2]):
        raise ValueError(f"need x (B, L, C) and conv_state (B, C, W-1); got {tuple(x.shape)}, {tuple(conv_state.shape)}")
    W1 = conv_state.shape[2]
    if not 1 <= W1 <= 3:
        raise ValueError(f"the Triton conv supports widths W = 2..4 (conv_state with 1..3 columns), got W-1 = {W1}; "
                         f"use backend='reference'")
    bsz, L, Cdim = x.shape
    return bsz, L, Cdim, W1


def causal_conv1d_update_triton(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                                activation: str | None = "silu", update_state: bool = True,
                                save_input: Tensor | None = None) -> Tensor:
    """Triton form of ``causal_conv1d_update`` (see ``ssmspec.ops.causal_conv1d``)."""
    bsz, L, Cdim, W1 = _check(x, conv_state)
    if weight.shape != (Cdim, W1 + 1):
        raise ValueError(f"weight must be (C, W) = {(Cdim, W1 + 1)}, got {tuple(weight.shape)}")
    if activation not in ("silu", "swish", None, "identity"):
        raise ValueError(f"unsupported conv activation {activation!r}; use 'silu' or None")
    return _launch(x, conv_state, weight, bias, activation=activation, update=update_state, save=save_input)


def _launch(x: Tensor, st: Tensor, weight: Tensor, bias: Tensor | None, *, activation, update: bool,
            src: Tensor | None = None, dst: Tensor | None = None, keep: Tensor | None = None,
            save: Tensor | None = None) -> Tensor:
    bsz, L, Cdim = x.shape
    y = torch.empty_like(x)
    d = dummy(weight)
    grid = (bsz, triton.cdiv(Cdim, _BLOCK_C))
    _conv_update_kernel[grid](x, st, weight, bias if bias is not None else d, y,
                              src if src is not None else d, dst if dst is not None else d,
                              keep if keep is not None else d, save if save is not None else d, L, Cdim,
                              *x.stride(), *st.stride(), *weight.stride(), *y.stride(),
                              *(save.stride() if save is not None else (0, 0, 0)),
                              W=weight.shape[1], HAS_BIAS=bias is not None, SILU=activation in ("silu", "swish"),
                              UPDATE=update, HAS_SLOTS=src is not None, HAS_KEEP=keep is not None,
                              SAVE=save is not None, BLOCK_C=_BLOCK_C, num_warps=4, **pdl_args(x))
    return y


def causal_conv1d_update_slots_triton(x: Tensor, pool: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                                      src_slot: Tensor, dst_slot: Tensor, keep: Tensor | None = None,
                                      activation: str | None = "silu") -> Tensor:
    """Triton form of ``causal_conv1d_update_slots`` (see ``ssmspec.ops.causal_conv1d``)."""
    bsz, L, Cdim = x.shape
    if x.dim() != 3 or pool.dim() != 3 or pool.shape[1] != Cdim or not 1 <= pool.shape[2] <= 3:
        raise ValueError(f"need x (B, L, C) and a pool (slots, C, W-1) with W = 2..4; got {tuple(x.shape)}, "
                         f"{tuple(pool.shape)}")
    if weight.shape != (Cdim, pool.shape[2] + 1):
        raise ValueError(f"weight must be (C, W) = {(Cdim, pool.shape[2] + 1)}, got {tuple(weight.shape)}")
    for name, t in (("src_slot", src_slot), ("dst_slot", dst_slot), ("keep", keep)):
        if t is not None and t.shape != (bsz,):
            raise ValueError(f"{name} must be (B,) = ({bsz},), got {tuple(t.shape)}")
    if activation not in ("silu", "swish", None, "identity"):
        raise ValueError(f"unsupported conv activation {activation!r}; use 'silu' or None")
    return _launch(x, pool, weight, bias, activation=activation, update=True, src=src_slot.contiguous(),
                   dst=dst_slot.contiguous(), keep=None if keep is None else keep.contiguous())


def conv_state_advance_triton(conv_state: Tensor, x: Tensor, keep: Tensor) -> None:
    """Triton form of ``conv_state_advance`` (see ``ssmspec.ops.causal_conv1d``)."""
    bsz, L, Cdim, W1 = _check(x, conv_state)
    if keep.shape != (bsz,):
        raise ValueError(f"keep must be (B,) = ({bsz},), got {tuple(keep.shape)}")
    keep = keep.to(device=x.device, dtype=torch.int64).contiguous()
    grid = (bsz, triton.cdiv(Cdim, _BLOCK_C))
    _conv_advance_kernel[grid](x, conv_state, keep, keep, Cdim, bsz, *x.stride(), *conv_state.stride(), W1=W1,
                               BLOCK_C=_BLOCK_C, COMMIT=False, num_warps=4)


def conv_state_commit_triton(conv_state: Tensor, x: Tensor, accepted: Tensor, count: Tensor) -> None:
    """Triton form of ``conv_state_commit`` (see ``ssmspec.ops.causal_conv1d``; it checks the arguments)."""
    rows, L, Cdim, W1 = _check(x, conv_state)
    grid = (rows, triton.cdiv(Cdim, _BLOCK_C))
    _conv_advance_kernel[grid](x, conv_state, accepted, count, Cdim, accepted.shape[0], *x.stride(),
                               *conv_state.stride(), W1=W1, BLOCK_C=_BLOCK_C, COMMIT=True, num_warps=4)
