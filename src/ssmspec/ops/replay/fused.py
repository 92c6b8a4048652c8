"""ReplaySSM verify in one launch (seed 000, Alg. 2 / 4): the four kernels of ``ops/replay/triton.py`` as one
program per (sequence, head), for the calls where launches, not bytes, set the time.

A verify call of the split form is four launches per Mamba-2 layer (scores, window, state, append). At small
batches of small layers each launch moves a few KB and costs its launch latency, so a
speculative step of a 24-layer target spends 96 of its ~330 launches in ``replay_verify``. Here program (b, h):

1. reads the window after the flush (``_window``: flush flag, old and new head / count);
2. computes its group's inner products kq[s, j] = B_jᵀ C_s of the window entries and the call's tokens in
   registers (the split form computes them once per group into a scratch; here every head of the group does,
   which costs heads_per_group x L x (R + L) x N multiply-adds a head -- small next to its state tile);
3. the window readout part_s and dec_s = exp(cum_s) as in ``_window_kernel`` (two GEMMs for multi-token
   calls, a loop for one token);
4. loads the whole (P, N) checkpoint tile, folds the committed entries into it where the sequence flushes (the
   only state store) and reads y_s = dec_s·(S0 C_s) + part_s, as ``_main_kernel`` does with BLOCK_P = P;
5. appends the call's x and dt of its own head at ring slots (head + count + s) % R;
6. arrives at the sequence's counter; the last of its H programs appends B (shared by the heads of a group)
   and moves head / count, then zeroes the counter for the next launch.

Why this is race-free with no grid-wide barrier. ring_x[b, :, h] and ring_dt[b, :, h] are read and written by
program (b, h) alone, which passes a CTA barrier after its last load of them before its first store (a ring
smaller than two windows overwrites entries the fold reads). ring_B[b, :, g] and head / count are read by every
program of sequence b; each passes a CTA barrier after its reads, then increments ``workspace[b]`` with one
acq_rel atomic; the program that sees H - 1 is the last reader, so it alone stores them (the conv + SSM kernel's
pattern, ``ops/conv_ssm_update``). Nothing spins, so no scheduling order can deadlock it. The workspace is (B,)
int32 zeros that each launch leaves zero; the caller keeps one per state, since two launches in flight at once
(graphs on two streams) must not share counters.

Numerics follow the split form: fp32 inner products, the window's GEMMs at ``precision`` (tf32 for 16-bit
inputs), the state GEMMs for multi-token calls of 16-bit inputs and row reductions otherwise. The kernel writes
state in place and is never autotuned.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.replay.triton import _ring_slots, _window
from ssmspec.ops.triton_common import discretize, dummy, has_limit, limit_args

FUSED_MAX_TILE = 8192  # BLOCK_P x BLOCK_N of the whole-head state tile one program holds (64 x 128 fp32)


@triton.jit
def _fused_kernel(S_ptr, rx_ptr, rdt_ptr, rB_ptr, head_ptr, count_ptr, flush_ptr, cnt_ptr,
                  x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, tree_ptr, y_ptr,
                  L, R, P, N, G, heads_per_group, lo, hi,
                  S_b, S_h, S_p, S_n, rx_b, rx_r, rx_h, rx_p, rdt_b, rdt_r, rdt_h, rB_b, rB_r, rB_g, rB_n,
                  x_b, x_l, x_h, x_p, dt_b, dt_l, dt_h, B_b, B_l, B_g, B_n, C_b, C_l, C_g, C_n,
                  y_b, y_l, y_h, y_p, t_b, t_i, t_j,
                  HAS_FLUSH: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr,
                  TREE: tl.constexpr, MATRIX: tl.constexpr, DOT: tl.constexpr, WPREC: tl.constexpr,
                  PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_L: tl.constexpr, BLOCK_GN: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    g = h // heads_per_group
    f, h0, c0, hd, c = _window(head_ptr, count_ptr, flush_ptr, b, L, R, HAS_FLUSH)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_l = tl.arange(0, BLOCK_L)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_l = offs_l < L
    A = tl.load(A_ptr + h).to(tl.float32)
    slots = _ring_slots(hd, offs_r, R)  # window entry j after the flush
    live_r = offs_r < c

    # 2) the group's inner products, in registers: kr[s, j] = B_jᵀ C_s (window entries), kn[s, t] = B_tᵀ C_s
    Br = tl.load(rB_ptr + b * rB_b + slots[:, None] * rB_r + g * rB_g + offs_n[None, :] * rB_n,
                 mask=live_r[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_N)
    Bn = tl.load(B_ptr + b * B_b + offs_l[:, None] * B_l + g * B_g + offs_n[None, :] * B_n,
                 mask=mask_l[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # (BLOCK_L, BLOCK_N)
    kr = tl.zeros([BLOCK_L, BLOCK_R], dtype=tl.float32)
    kn = tl.zeros([BLOCK_L, BLOCK_L], dtype=tl.float32)
    for s in range(0, L):
        Cs = tl.load(C_ptr + b * C_b + s * C_l + g * C_g + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
        row = offs_l[:, None] == s
        kr = tl.where(row, tl.sum(Br * Cs[None, :], axis=1)[None, :], kr)
        kn = tl.where(row, tl.sum(Bn * Cs[None, :], axis=1)[None, :], kn)

    # 3) the readout terms that skip the state (``_window_kernel``)
    dtr = tl.load(rdt_ptr + b * rdt_b + slots * rdt_r + h * rdt_h, mask=live_r, other=0.0)
    cumr = tl.cumsum(A * dtr, axis=0)  # (BLOCK_R,) log-decay from the checkpoint to entry j
    Tc = tl.sum(A * dtr, axis=0)
    Xr = tl.load(rx_ptr + b * rx_b + slots[:, None] * rx_r + h * rx_h + offs_p[None, :] * rx_p,
                 mask=live_r[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_P)
    if HAS_DT_BIAS:
        bias = tl.load(bias_ptr + h).to(tl.float32)
    else:
        bias = 0.0
    dtn = tl.load(dt_ptr + b * dt_b + offs_l * dt_l + h * dt_h, mask=mask_l, other=0.0).to(tl.float32)
    dtn = tl.where(mask_l, discretize(dtn, bias, lo, hi, True, HAS_LIMIT), 0.0)  # (BLOCK_L,)
    an = A * dtn
    if TREE:  # accumulated decay along each token's ancestors-or-self (STree's A_tree)
        M = tl.load(tree_ptr + b * t_b + offs_l[:, None] * t_i + offs_l[None, :] * t_j,
                    mask=mask_l[:, None] & mask_l[None, :], other=0).to(tl.float32)
        cumn = Tc + tl.sum(M * an[None, :], axis=1)
        vis = M != 0
    else:
        cumn = Tc + tl.cumsum(an, axis=0)  # (BLOCK_L,)
        vis = offs_l[None, :] <= offs_l[:, None]
    Xn = tl.load(x_ptr + b * x_b + offs_l[:, None] * x_l + h * x_h + offs_p[None, :] * x_p,
                 mask=mask_l[:, None] & mask_p[None, :], other=0.0)  # (BLOCK_L, BLOCK_P) x's dtype
    if HAS_D:
        Dh = tl.load(D_ptr + h).to(tl.float32)
    m_r = mask_l[:, None] & live_r[None, :]  # (BLOCK_L, BLOCK_R)
    Wr = tl.where(m_r, tl.exp(tl.where(m_r, cumn[:, None] - cumr[None, :], 0.0)) * dtr[None, :] * kr, 0.0)
    m_n = vis & mask_l[:, None] & mask_l[None, :]  # (BLOCK_L, BLOCK_L) token s sees token t
    Wn = tl.where(m_n, tl.exp(tl.where(m_n, cumn[:, None] - cumn[None, :], 0.0)) * dtn[None, :] * kn, 0.0)
    if HAS_D:
        Wn += tl.where(offs_l[:, None] == offs_l[None, :], Dh, 0.0)  # the skip term D·x_s
    if MATRIX:  # (BLOCK_L, BLOCK_P) as two GEMMs
        part = tl.dot(Wr, Xr, input_precision=WPREC) + tl.dot(Wn, Xn.to(tl.float32), input_precision=WPREC)
    else:  # one token (BLOCK_L = 2): rank-one sums
        Xnf = Xn.to(tl.float32)
        part = tl.zeros([BLOCK_L, BLOCK_P], dtype=tl.float32)
        for s in range(0, L):
            row = offs_l[:, None] == s
            wr = tl.sum(tl.where(row, Wr, 0.0), axis=0)  # (BLOCK_R,)
            wn = tl.sum(tl.where(row, Wn, 0.0), axis=0)  # (BLOCK_L,)
            ps = tl.sum(wr[:, None] * Xr, axis=0) + tl.sum(wn[:, None] * Xnf, axis=0)  # (BLOCK_P,)
            part = tl.where(row, ps[None, :], part)
    dec = tl.exp(cumn)  # (BLOCK_L,) decay of the checkpoint to token s

    # 4) the state: one load of the whole head's tile; the fold and the only store where the sequence flushes
    s_ptrs = S_ptr + b * S_b + h * S_h + offs_p[:, None] * S_p + offs_n[None, :] * S_n
    mask_pn = mask_p[:, None] & mask_n[None, :]
    S = tl.load(s_ptrs, mask=mask_pn, other=0.0)  # (BLOCK_P, BLOCK_N) fp32
    if f * c0 > 0:
        old = _ring_slots(h0, offs_r, R)
        live_o = offs_r < c0
        dto = tl.load(rdt_ptr + b * rdt_b + old * rdt_r + h * rdt_h, mask=live_o, other=0.0)  # (BLOCK_R,)
        if DOT:  # S <- exp(Σa)·S + (X ∘ w)ᵀ B over the c0 entries, w_j = exp(Σa − cum_j)·dt_j
            cumo = tl.cumsum(A * dto, axis=0)
            tot = tl.sum(A * dto, axis=0)
            wo = tl.where(live_o, tl.exp(tot - cumo) * dto, 0.0)
            XoT = tl.load(rx_ptr + b * rx_b + old[None, :] * rx_r + h * rx_h + offs_p[:, None] * rx_p,
                          mask=live_o[None, :] & mask_p[:, None], other=0.0).to(tl.float32)  # (BLOCK_P, BLOCK_R)
            Bo = tl.load(rB_ptr + b * rB_b + old[:, None] * rB_r + g * rB_g + offs_n[None, :] * rB_n,
                         mask=live_o[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_N)
            S = tl.exp(tot) * S + tl.dot(XoT * wo[None, :], Bo, input_precision=PRECISION)
        else:
            for j in range(0, c0):  # the recurrence itself, one rank-1 update per entry
                slot = (h0 + j) % R
                dtj = tl.load(rdt_ptr + b * rdt_b + slot * rdt_r + h * rdt_h)
                xj = tl.load(rx_ptr + b * rx_b + slot * rx_r + h * rx_h + offs_p * rx_p, mask=mask_p,
                             other=0.0).to(tl.float32)
                Bj = tl.load(rB_ptr + b * rB_b + slot * rB_r + g * rB_g + offs_n * rB_n, mask=mask_n,
                             other=0.0).to(tl.float32)
                S = S * tl.exp(A * dtj) + (dtj * xj)[:, None] * Bj[None, :]
        tl.store(s_ptrs, S, mask=mask_pn)
    if DOT:  # Y = S0 · [C_0 .. C_{L-1}] in one GEMM, (BLOCK_P, BLOCK_L)
        Ct = tl.load(C_ptr + b * C_b + offs_l[None, :] * C_l + g * C_g + offs_n[:, None] * C_n,
                     mask=mask_l[None, :] & mask_n[:, None], other=0.0).to(tl.float32)  # (BLOCK_N, BLOCK_L)
        Y = tl.dot(S, Ct, input_precision=PRECISION) * dec[None, :] + tl.trans(part)
        tl.store(y_ptr + b * y_b + offs_l[None, :] * y_l + h * y_h + offs_p[:, None] * y_p, Y,
                 mask=mask_p[:, None] & mask_l[None, :])
    else:
        for s in range(0, L):
            Cs = tl.load(C_ptr + b * C_b + s * C_l + g * C_g + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
            row = offs_l == s
            dec_s = tl.sum(tl.where(row, dec, 0.0), axis=0)
            part_s = tl.sum(tl.where(row[:, None], part, 0.0), axis=0)  # (BLOCK_P,)
            tl.store(y_ptr + b * y_b + s * y_l + h * y_h + offs_p * y_p,
                     dec_s * tl.sum(S * Cs[None, :], axis=1) + part_s, mask=mask_p)

    # 5) this head's x and dt into the call's ring slots: only this program reads ring_x / ring_dt of head h
    tl.debug_barrier()  # every thread's loads of the old entries are performed before any store below
    new = hd + c + offs_l  # < 2R: hd < R and c + L <= R
    new = tl.where(new >= R, new - R, new)
    tl.store(rx_ptr + b * rx_b + new[:, None] * rx_r + h * rx_h + offs_p[None, :] * rx_p, Xn,
             mask=mask_l[:, None] & mask_p[None, :])
    tl.store(rdt_ptr + b * rdt_b + new * rdt_r + h * rdt_h, dtn, mask=mask_l)

    # 6) the last program of sequence b to arrive appends B and moves head / count
    cnt = cnt_ptr + b
    if tl.atomic_add(cnt, 1, sem="acq_rel") == H - 1:  # every program of b has read ring_B and the pointers
        tl.debug_barrier()
        offs_gn = tl.arange(0, BLOCK_GN)
        for s in range(0, L):
            sl = hd + c + s
            sl = tl.where(sl >= R, sl - R, sl)
            for start in range(0, G * N, BLOCK_GN):  # B (G, N) of token s
                j = start + offs_gn
                gg = j // N
                nn = j % N
                v = tl.load(B_ptr + b * B_b + s * B_l + gg * B_g + nn * B_n, mask=j < G * N)
                tl.store(rB_ptr + b * rB_b + sl * rB_r + gg * rB_g + nn * rB_n, v, mask=j < G * N)
        tl.store(head_ptr + b, hd.to(head_ptr.dtype.element_ty))
        tl.store(count_ptr + b, c.to(count_ptr.dtype.element_ty))
        tl.store(cnt, 0)  # zero again for the next launch (no program of this one touches it any more)


def fused_fits(P: int, N: int) -> bool:
    """Whether one program can hold a head's whole (P, N) fp32 state tile (``FUSED_MAX_TILE``)."""
    return max(16, triton.next_power_of_2(P)) * max(16, triton.next_power_of_2(N)) <= FUSED_MAX_TILE


def replay_verify_fused_triton(S0: Tensor, ring_x: Tensor, ring_dt: Tensor, ring_B: Tensor, head: Tensor,
                               count: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                               D: Tensor | None, *, dt_bias: Tensor | None, dt_limit, flush: Tensor | None,
                               tree_mask: Tensor | None, workspace: Tensor | None, gemm: bool | None,
                               precision: str, num_warps: int | None = None) -> Tensor:
    """The one-launch form (module doc); arguments checked by ``replay_verify_triton``, which calls it."""
    bsz, L, H, P = x.shape
    R = ring_x.shape[1]
    G, N = B.shape[2], B.shape[3]
    if not fused_fits(P, N):
        raise ValueError(f"the one-launch replay verify holds a head's whole state tile in one program: P x N = "
                         f"{P} x {N} exceeds {FUSED_MAX_TILE} elements; use fused=False (the split form)")
    if workspace is None:
        workspace = torch.zeros(bsz, dtype=torch.int32, device=x.device)
    elif workspace.dtype != torch.int32 or not workspace.is_contiguous() or workspace.numel() < bsz \
            or workspace.device != x.device:
        raise ValueError(f"workspace must be a contiguous int32 tensor of zeros with >= B = {bsz} elements on "
                         f"{x.device} (the kernel leaves it zero); got {workspace.dtype}, {tuple(workspace.shape)} "
                         f"on {workspace.device}")
    y = torch.empty_like(x)
    flag = flush if flush is not None else count  # unread without HAS_FLUSH
    tm = tree_mask if tree_mask is not None else count  # unread without TREE
    tstr = tree_mask.stride() if tree_mask is not None else (0, 0, 0)
    half = x.dtype in (torch.bfloat16, torch.float16)
    matrix = L >= 2
    use_dot = (L > 1 and half) if gemm is None else bool(gemm) and matrix
    BL = max(2, triton.next_power_of_2(L))
    lo, hi = limit_args(dt_limit)
    _fused_kernel[(bsz, H)](
        S0, ring_x, ring_dt, ring_B, head, count, flag, workspace, x, dt, A, B, C,
        D if D is not None else dummy(A), dt_bias if dt_bias is not None else dummy(A), tm, y,
        L, R, P, N, G, H // G, lo, hi,
        *S0.stride(), *ring_x.stride(), *ring_dt.stride(), *ring_B.stride(), *x.stride(), *dt.stride(),
        *B.stride(), *C.stride(), *y.stride(), *tstr,
        HAS_FLUSH=flush is not None, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        HAS_LIMIT=has_limit(dt_limit), TREE=tree_mask is not None, MATRIX=matrix, DOT=use_dot, WPREC=precision,
        PRECISION=precision, BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_N=max(16, triton.next_power_of_2(N)),
        BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK_L=max(16, BL) if matrix else BL,
        BLOCK_GN=min(1024, triton.next_power_of_2(G * N)), num_warps=num_warps or 4)
    return y
