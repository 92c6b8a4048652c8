"""Triton kernel of the gated delta rule at decode time: one kernel serves the single-token update (the
`autoregressive` baseline, seed 000 Alg. 5), the multi-token update from a stored state (with update_count:
the replay form of activation replay) and the `snapshot` baseline (Alg. 7: one state store per token).

Each program owns one (sequence, value head, BLOCK_P columns of P) tile of the k-major fp32 state S (N, P):
every column of the delta rule is independent (u = β(v − Sᵀk) is computed column by column), so the tile
is loaded once, the L tokens run in registers, and the tile is stored once (or once per token into a
snapshot slot). Nothing is shared between programs, so in-place updates are race-free; the kernel writes
state in place and is never autotuned: block sizes come from ``_blocks``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.gdn.naive import _check_state, check_gdn_shapes, default_scale
from ssmspec.ops.gdn.forms import check_forms
from ssmspec.ops.triton_common import check_float, dummy, softplus


@triton.jit
def _gdn_update_kernel(
    state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, y_ptr, row_ptr, count_ptr, dst_ptr, alog_ptr, dtb_ptr,
    scale, L, N, P, heads_per_group,
    s_row, s_h, s_n, s_p, q_b, q_l, q_g, q_n, k_b, k_l, k_g, k_n, v_b, v_l, v_h, v_p,
    g_b, g_l, g_h, be_b, be_l, be_h, y_b, y_l, y_h, y_p, dst_b, dst_l,
    HAS_ROW: tl.constexpr, HAS_COUNT: tl.constexpr, SNAPSHOT: tl.constexpr, STORE_FINAL: tl.constexpr,
    OUTPUT: tl.constexpr, QK_L2NORM: tl.constexpr, RAW_GATE: tl.constexpr, BETA_LOGITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_p = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    grp = h // heads_per_group
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_n = offs_n < N
    mask_p = offs_p < P
    mask = mask_n[:, None] & mask_p[None, :]
    y_base = y_ptr + b * y_b + h * y_h + offs_p * y_p  # (BLOCK_P,) token 0
    if HAS_ROW:
        row = tl.load(row_ptr + b).to(tl.int64)
        if row < 0:  # a pad sequence: zero output, state untouched
            if OUTPUT:
                for t in range(0, L):
                    tl.store(y_base + t * y_l, tl.zeros([BLOCK_P], dtype=tl.float32), mask=mask_p)
            return
    else:
        row = b.to(tl.int64)
    tile = offs_n[:, None] * s_n + offs_p[None, :] * s_p  # (BLOCK_N, BLOCK_P) offsets inside a head
    s_ptrs = state_ptr + row * s_row + h * s_h + tile
    S = tl.load(s_ptrs, mask=mask, other=0.0)  # (BLOCK_N, BLOCK_P) fp32: the only state load
    if HAS_COUNT:
        cnt = tl.load(count_ptr + b).to(tl.int32)
    else:
        cnt = L
    steps = L
    if HAS_COUNT:
        if not OUTPUT:
            steps = tl.minimum(cnt, L)  # replay form: only the kept tokens matter
    if RAW_GATE:  # g_ptr holds the raw a: g = −exp(A_log)·softplus(a + dt_bias) (ops/gdn/forms.py)
        neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        dtb = tl.load(dtb_ptr + h).to(tl.float32)
    keep = S
    for t in range(0, steps):
        kt = tl.load(k_ptr + b * k_b + t * k_l + grp * k_g + offs_n * k_n, mask=mask_n, other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + b * v_b + t * v_l + h * v_h + offs_p * v_p, mask=mask_p, other=0.0).to(tl.float32)
        gt = tl.load(g_ptr + b * g_b + t * g_l + h * g_h).to(tl.float32)
        bt = tl.load(beta_ptr + b * be_b + t * be_l + h * be_h).to(tl.float32)
        if QK_L2NORM:  # fla's l2norm, in fp32: k / sqrt(Σk² + 1e-6)
            kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=0) + 1e-6)
        if RAW_GATE:
            gt = neg_a * softplus(gt + dtb)
        if BETA_LOGITS:
            bt = tl.sigmoid(bt)
        S = S * tl.exp(gt)  # gated decay
        u = bt * (vt - tl.sum(S * kt[:, None], axis=0))  # (BLOCK_P,) correction: v minus the readout at k
        S = S + kt[:, None] * u[None, :]  # rank-1 write at k
        if SNAPSHOT:  # the `snapshot` baseline: one full state store per token
            dst = tl.load(dst_ptr + b * dst_b + t * dst_l).to(tl.int64)
            if dst >= 0:
                tl.store(state_ptr + dst * s_row + h * s_h + tile, S, mask=mask)
        if OUTPUT:
            qt = tl.load(q_ptr + b * q_b + t * q_l + grp * q_g + offs_n * q_n, mask=mask_n, other=0.0).to(tl.float32)
            if QK_L2NORM:
                qt = qt * tl.rsqrt(tl.sum(qt * qt, axis=0) + 1e-6)
            tl.store(y_base + t * y_l, scale * tl.sum(S * qt[:, None], axis=0), mask=mask_p)
            if HAS_COUNT:
                keep = tl.where(t < cnt, S, keep)
    if STORE_FINAL:
        if HAS_COUNT:
            if OUTPUT:
                S = keep
            if cnt > 0:  # count 0: unchanged, skip the store
                tl.store(s_ptrs, S, mask=mask)
        else:
            tl.store(s_ptrs, S, mask=mask)


def _blocks(N: int, P: int, L: int) -> tuple[int, int]:
    """(BLOCK_P, num_warps), by hand (the kernel writes state in place: never autotuned). A program holds
    N x BLOCK_P fp32 of state; at N = 128 a 32-column tile is 16 KB, enough bytes in flight per program for
    a single-token update while the grid (P/32 x B x H) still fills an H100 at small batch (fla's fused
    recurrent kernel takes 128 x 8 tiles at 1 warp; the ``sweep`` rows of bench/kernels_gdn.py time other
    choices). Several tokens add two column reductions over N per token (u and y); two warps keep the
    reductions short while the tile stays in registers."""
    n = triton.next_power_of_2(N)
    bp = max(8, min(64, 4096 // n))
    return min(bp, max(8, triton.next_power_of_2(P))), (4 if L <= 1 else 2)


def _index(t: Tensor | None, name: str, shape: tuple, device) -> Tensor | None:
    if t is None:
        return None
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64).contiguous()


def _launch(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, scale: float | None, *,
            rows: Tensor | None, count: Tensor | None, dst: Tensor | None, store_final: bool, output: bool,
            block_p: int | None = None, num_warps: int | None = None, use_qk_l2norm: bool = False,
            a: Tensor | None = None, A_log: Tensor | None = None, dt_bias: Tensor | None = None,
            beta_logits: bool = False) -> Tensor | None:
    check_forms(g, beta, a=a, A_log=A_log, dt_bias=dt_bias, H=beta.shape[-1])
    raw = g is None
    gate = a if raw else g  # (B, L, H): the raw a rides in g's slot, RAW_GATE says which it is
    bsz, L, H, P, G, N = check_gdn_shapes(q, k, v, gate, beta)
    _check_state(state, H, N, P)
    for name, t in (("q", q), ("k", k), ("v", v), ("a" if raw else "g", gate), ("beta", beta)):
        check_float(name, t)
    y = torch.empty_like(v) if output else None
    bp, nw = _blocks(N, P, L)
    bp, nw = block_p or bp, num_warps or nw
    yt = y if y is not None else v  # unwritten when not OUTPUT
    _gdn_update_kernel[(triton.cdiv(P, bp), bsz, H)](
        state, q, k, v, gate, beta, yt,
        rows if rows is not None else dummy(v, torch.int64), count if count is not None else dummy(v, torch.int64),
        dst if dst is not None else dummy(v, torch.int64),
        A_log.contiguous() if raw else state, dt_bias.contiguous() if raw else state,  # unread without RAW_GATE
        default_scale(scale, N), L, N, P, H // G,
        *state.stride(), *q.stride(), *k.stride(), *v.stride(), *gate.stride(), *beta.stride(), *yt.stride(),
        *(dst.stride() if dst is not None else (0, 0)),
        HAS_ROW=rows is not None, HAS_COUNT=count is not None, SNAPSHOT=dst is not None, STORE_FINAL=store_final,
        OUTPUT=output, QK_L2NORM=use_qk_l2norm, RAW_GATE=raw, BETA_LOGITS=beta_logits,
        BLOCK_N=max(16, triton.next_power_of_2(N)), BLOCK_P=bp, num_warps=nw)
    return y


def gdn_multistep_triton(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, *,
                         scale: float | None = None, state_batch_indices: Tensor | None = None,
                         update_count: Tensor | None = None, store_state: bool = True, output: bool = True,
                         block_p: int | None = None, num_warps: int | None = None, use_qk_l2norm: bool = False,
                         a: Tensor | None = None, A_log: Tensor | None = None, dt_bias: Tensor | None = None,
                         beta_logits: bool = False) -> Tensor | None:
    """Triton form of ``gdn_multistep`` (see ``ssmspec.ops.gdn``); ``block_p`` / ``num_warps`` override the
    hand-picked launch (benchmark sweeps). The forms of ``ops/gdn/forms.py`` run in-kernel behind constexpr
    flags (the l2norm of q and k, the gate from a, sigmoid of beta), so today's form compiles as before."""
    bsz = v.shape[0]
    rows = _index(state_batch_indices, "state_batch_indices", (bsz,), v.device)
    count = _index(update_count, "update_count", (bsz,), v.device)
    if not output and not store_state:
        return None
    return _launch(state, q, k, v, g, beta, scale, rows=rows, count=count, dst=None, store_final=store_state,
                   output=output, block_p=block_p, num_warps=num_warps, use_qk_l2norm=use_qk_l2norm, a=a,
                   A_log=A_log, dt_bias=dt_bias, beta_logits=beta_logits)


def gdn_multistep_snapshot_triton(state_pool: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                                  scale: float | None = None, src_slot: Tensor, dst_slots: Tensor,
                                  block_p: int | None = None, num_warps: int | None = None) -> Tensor:
    """Triton form of ``gdn_multistep_snapshot`` (see ``ssmspec.ops.gdn``)."""
    bsz, L = v.shape[:2]
    src = _index(src_slot, "src_slot", (bsz,), v.device)
    dst = _index(dst_slots, "dst_slots", (bsz, L), v.device)
    return _launch(state_pool, q, k, v, g, beta, scale, rows=src, count=None, dst=dst, store_final=False,
                   output=True, block_p=block_p, num_warps=num_warps)
