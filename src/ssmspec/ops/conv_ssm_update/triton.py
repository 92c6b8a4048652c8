"""One launch for a Mamba-2 mixer's decode step: the causal conv of the token (its conv state shifted in place)
and the single-token SSM update (seed 000, Alg. 1; its state in place), without the round trip of the conv
output through memory that ``causal_conv1d_update`` + ``selective_state_update`` make.

Grid (P blocks, B, H), as ``ops/multistep/triton.py``: a program owns the (sequence b, head h, BLOCK_P rows)
tile of the fp32 SSM state. It convolves its own BLOCK_P x channels and, again in every program of the group
(2N channels x W taps, a few KB from L2), the N B and N C channels of its group g; rounds the conv outputs to
xbc's dtype (``causal_conv1d_update`` returns them so, and the unfused SSM reads that), discretizes dt and
updates its tile: S = exp(A dt) S + dt x Bᵀ, y = S C + D x.

The conv state (B, conv_dim, W-1) is shifted in place, and every program must read the old window before
anyone overwrites it. Programs of one launch run in no fixed order and Triton has no grid-wide barrier, so:
- x channels: each belongs to exactly one program, which reads its window, then (after a CTA barrier) stores
  the shifted window. No other program reads them.
- B / C channels: read by all ``arrivals`` = heads_per_group x P-blocks programs of (b, g). Each reads the old
  window into registers, passes a CTA barrier (the loads are performed), then increments a counter
  ``workspace[b, g]`` with one acq_rel atomic. The program that sees the count reach ``arrivals - 1`` is the
  last reader: every other program of the group released its reads before its increment, so this program
  alone stores the shifted B / C windows (which it holds in registers like everyone else) and resets the
  counter to 0 for the next launch. A designated program (say head 0) could not know the others had read.
  Nothing spins, so the order in which the hardware schedules programs cannot deadlock it. The workspace is
  (B, G) int32 zeros that each launch leaves zero; the caller keeps one per state (ours: the strategy), since
  two launches in flight at once (CUDA graphs on two streams) must not share counters.

The kernel writes state in place and is never autotuned (STYLE.md 2); blocks are chosen by ``_blocks``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.conv_ssm_update.naive import check_conv_ssm_shapes
from ssmspec.ops.triton_common import check_float, discretize, dummy, has_limit, limit_args, silu


@triton.jit
def _conv_window(xbc_ptr, cs_ptr, w_ptr, cb_ptr, ch, mask, xbc_c, cs_c, cs_w, w_c, w_w, W: tl.constexpr,
                 BLOCK_W: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, SILU: tl.constexpr):
    """Channels ch (BLOCK_C,) of one sequence: the window [old state (W-1 columns) | the token] (BLOCK_C, BLOCK_W)
    in the state's dtype, and the conv output rounded to xbc's dtype, as fp32 (BLOCK_C,). The taps are summed
    in ``ops/causal_conv1d/triton.py``'s order (bias, then tap 0 .. W-1), so the conv output is the unfused
    kernel's bit for bit."""
    offs_w = tl.arange(0, BLOCK_W)
    old = tl.load(cs_ptr + ch[:, None] * cs_c + offs_w[None, :] * cs_w,
                  mask=mask[:, None] & (offs_w[None, :] < W - 1), other=0.0)
    new = tl.load(xbc_ptr + ch * xbc_c, mask=mask, other=0.0)
    win = tl.where(offs_w[None, :] == W - 1, new[:, None], old)  # column W-1: the token
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    if HAS_CONV_BIAS:
        acc += tl.load(cb_ptr + ch, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(W):  # column k of the window (exact: one term, the rest zeros)
        v = tl.sum(tl.where(offs_w[None, :] == k, win.to(tl.float32), 0.0), axis=1)
        acc += tl.load(w_ptr + ch * w_c + k * w_w, mask=mask, other=0.0).to(tl.float32) * v
    if SILU:
        acc = silu(acc)
    return win, acc.to(xbc_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _store_shifted(cs_ptr, ch, mask, win, cs_c, cs_w, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """The new state of channels ch: column i = window column i + 1 (the last W-1 inputs)."""
    offs_w = tl.arange(0, BLOCK_W)
    tl.store(cs_ptr + ch[:, None] * cs_c + (offs_w[None, :] - 1) * cs_w, win,
             mask=mask[:, None] & (offs_w[None, :] >= 1) & (offs_w[None, :] < W))


@triton.jit
def _conv_ssm_kernel(
    xbc_ptr, cs_ptr, w_ptr, cb_ptr, state_ptr, dt_ptr, A_ptr, D_ptr, dtb_ptr, y_ptr, cnt_ptr,
    P, N, G, heads_per_group, arrivals, lo, hi,
    xbc_b, xbc_c, cs_b, cs_c, cs_w, w_c, w_w, s_b, s_h, s_p, s_n, dt_b, dt_h, y_b, y_c,
    W: tl.constexpr, BLOCK_W: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    g = h // heads_per_group
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,) rows of the head
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask_p = offs_p < P
    mask_n = offs_n < N
    xb = xbc_ptr + b * xbc_b
    cb = cs_ptr + b * cs_b
    d_inner = heads_per_group * G * P  # H * P: the x channels come first, then B (G*N), then C (G*N)
    ch_x = h * P + offs_p
    ch_B = d_inner + g * N + offs_n
    ch_C = d_inner + (G + g) * N + offs_n
    win_x, xv = _conv_window(xb, cb, w_ptr, cb_ptr, ch_x, mask_p, xbc_c, cs_c, cs_w, w_c, w_w, W, BLOCK_W,
                             HAS_CONV_BIAS, SILU)  # (BLOCK_P, BLOCK_W), (BLOCK_P,)
    win_B, Bv = _conv_window(xb, cb, w_ptr, cb_ptr, ch_B, mask_n, xbc_c, cs_c, cs_w, w_c, w_w, W, BLOCK_W,
                             HAS_CONV_BIAS, SILU)  # (BLOCK_N, BLOCK_W), (BLOCK_N,)
    win_C, Cv = _conv_window(xb, cb, w_ptr, cb_ptr, ch_C, mask_n, xbc_c, cs_c, cs_w, w_c, w_w, W, BLOCK_W,
                             HAS_CONV_BIAS, SILU)
    tl.debug_barrier()  # every old window this program needs is read (in registers) before any store below
    _store_shifted(cb, ch_x, mask_p, win_x, cs_c, cs_w, W, BLOCK_W)  # x channels: this program's alone
    cnt = cnt_ptr + b * G + g
    if tl.atomic_add(cnt, 1, sem="acq_rel") == arrivals - 1:  # the group's last reader shifts B and C
        tl.debug_barrier()
        _store_shifted(cb, ch_B, mask_n, win_B, cs_c, cs_w, W, BLOCK_W)
        _store_shifted(cb, ch_C, mask_n, win_C, cs_c, cs_w, W, BLOCK_W)
        tl.store(cnt, 0)  # zero again for the next launch (no program of this one touches it any more)
    A = tl.load(A_ptr + h).to(tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dtb_ptr + h).to(tl.float32)
    else:
        bias = 0.0
    dtv = discretize(tl.load(dt_ptr + b * dt_b + h * dt_h).to(tl.float32), bias, lo, hi, True, HAS_LIMIT)
    s_ptrs = state_ptr + b * s_b + h * s_h + offs_p[:, None] * s_p + offs_n[None, :] * s_n
    mask_pn = mask_p[:, None] & mask_n[None, :]
    s = tl.load(s_ptrs, mask=mask_pn, other=0.0)  # (BLOCK_P, BLOCK_N) fp32
    s = s * tl.exp(A * dtv) + (dtv * xv)[:, None] * Bv[None, :]
    tl.store(s_ptrs, s, mask=mask_pn)
    yv = tl.sum(s * Cv[None, :], axis=1)  # (BLOCK_P,)
    if HAS_D:
        yv += tl.load(D_ptr + h).to(tl.float32) * xv
    tl.store(y_ptr + b * y_b + ch_x * y_c, yv, mask=mask_p)


def _blocks(P: int, N: int) -> tuple[int, int]:
    """(BLOCK_P, num_warps), by hand, not yet swept on a GPU: the single-token SSU's tile holds ~1k state
    elements (``ops/multistep/triton.py:_blocks``); here every program also reads 2N x W conv inputs and
    weights (from L2), so a tile twice as tall (~2k elements: 16 rows at N = 128) halves that per-row cost
    while mamba2-2.7b at batch 1 still launches 80 x 4 = 320 programs."""
    n = triton.next_power_of_2(N)
    return min(triton.next_power_of_2(P), max(4, 2048 // n)), 4


def conv_ssm_update_triton(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None,
                           ssm_state: Tensor, dt: Tensor, A: Tensor, D: Tensor | None, dt_bias: Tensor | None, *,
                           heads: int, head_dim: int, groups: int, state_size: int,
                           dt_limit: tuple[float, float] = (0.0, float("inf")), activation: str | None = "silu",
                           workspace: Tensor | None = None, block_p: int | None = None,
                           num_warps: int | None = None) -> Tensor:
    """Triton form of ``conv_ssm_update`` (see ``ssmspec.ops.conv_ssm_update``); ``block_p`` / ``num_warps``
    override ``_blocks`` for sweeps."""
    check_conv_ssm_shapes(xbc, conv_state, conv_weight, conv_bias, ssm_state, dt, A, D, dt_bias, heads=heads,
                          head_dim=head_dim, groups=groups, state_size=state_size)
    for name, t in (("xbc", xbc), ("dt", dt), ("conv_weight", conv_weight)):
        check_float(name, t)
    if conv_state.dtype != xbc.dtype:
        raise ValueError(f"conv_state must have xbc's dtype {xbc.dtype} (the window is [state | token]); got "
                         f"{conv_state.dtype}")
    if ssm_state.dtype != torch.float32:
        raise ValueError(f"ssm_state must be float32, got {ssm_state.dtype}")
    if activation not in ("silu", "swish", None, "identity"):
        raise ValueError(f"unsupported conv activation {activation!r}; use 'silu' or None")
    bsz, G = xbc.shape[0], groups
    if workspace is None:
        workspace = torch.zeros(bsz * G, dtype=torch.int32, device=xbc.device)
    elif workspace.dtype != torch.int32 or not workspace.is_contiguous() or workspace.numel() < bsz * G:
        raise ValueError(f"workspace must be a contiguous int32 tensor of zeros with >= B*G = {bsz * G} elements "
                         f"(the kernel leaves it zero); got {workspace.dtype}, {tuple(workspace.shape)}")
    H, P, N = heads, head_dim, state_size
    y = torch.empty(bsz, H * P, dtype=xbc.dtype, device=xbc.device)
    if bsz == 0:
        return y
    bp, nw = _blocks(P, N)
    bp, nw = block_p or bp, num_warps or nw
    W = conv_weight.shape[1]
    lo, hi = limit_args(dt_limit)
    grid = (triton.cdiv(P, bp), bsz, H)
    _conv_ssm_kernel[grid](
        xbc, conv_state, conv_weight, conv_bias if conv_bias is not None else dummy(xbc), ssm_state, dt, A,
        D if D is not None else dummy(xbc), dt_bias if dt_bias is not None else dummy(xbc), y, workspace,
        P, N, G, H // G, triton.cdiv(P, bp) * (H // G), lo, hi,
        *xbc.stride(), *conv_state.stride(), *conv_weight.stride(), *ssm_state.stride(), *dt.stride(), *y.stride(),
        W=W, BLOCK_W=triton.next_power_of_2(W), HAS_CONV_BIAS=conv_bias is not None,
        SILU=activation in ("silu", "swish"), HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        HAS_LIMIT=has_limit(dt_limit), BLOCK_P=bp, BLOCK_N=triton.next_power_of_2(N), num_warps=nw)
    return y
