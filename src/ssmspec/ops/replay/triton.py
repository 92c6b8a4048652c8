"""ReplaySSM kernels in Triton (seed 000, Alg. 2 / 4 and its two kernel design choices).

One ``replay_verify`` call of L tokens is four launches here (``ops/replay/fused.py`` does it in one where the
call's state is small: ``use_fused``), all graph-safe (no host sync; the flush decision is
per-sequence data read at run time):
1. ``_scores_kernel``, one program per (sequence, group): the inner products kq[s, j] = B_jᵀ C_s of the
   window entries j (committed ring entries, then the call's tokens) with every query C_s, computed once
   per group ("precomputing shared inner products") into a small fp32 scratch; it also records the window
   after the flush (head, count) for kernel 4;
2. ``_window_kernel``, one program per (sequence, head): the part of the output-only readout that does not
   touch the state, part_s = Σ_j exp(cum_s − cum_j)·dt_j·kq[s, j]·x_j + D·x_s under the causal (or tree)
   mask, and dec_s = exp(cum_s);
3. ``_main_kernel``, one program per (sequence, head, BLOCK_P rows): loads its checkpoint tile S0 once;
   where the sequence flushes, folds the committed entries into it (state-and-output route, the only state
   store); then y_s = dec_s·(S0 C_s) + part_s;
4. ``_append_kernel``, one program per (sequence, token, chunk of H·P): appends the call's (x, dt, B) at ring
   slots (head + count + s) % R ("a ring buffer avoids data-dependent copies") and moves head / count. It
   runs last because kernel 3 reads the old entries it may overwrite (R < 2L) and kernels 1-3 the pointers.
Splitting 2 from 3 keeps the state kernel a plain streaming read (its tile loads are not held up by the
dependent loads of the ring window) and does the window work once per head instead of once per P block.
The state is written in place only by kernel 3, tile by tile, with no sharing: never autotuned.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.triton_common import check_float, discretize, dummy, has_limit, limit_args


@triton.jit
def _window(head_ptr, count_ptr, flush_ptr, b, L, R, HAS_FLUSH: tl.constexpr):
    """(flush flag, old head, old count, head, count) of sequence b's readout window (after its flush).
    Without a flush tensor the flag is seed 000's rule, count + 2L > R, decided here at run time."""
    h0 = tl.load(head_ptr + b).to(tl.int32)
    c0 = tl.load(count_ptr + b).to(tl.int32)
    if HAS_FLUSH:
        f = tl.load(flush_ptr + b).to(tl.int32)
    else:
        f = (c0 + 2 * L > R).to(tl.int32)
    hd = tl.where(f != 0, (h0 + c0) % R, h0)
    c = tl.where(f != 0, 0, c0)
    return f, h0, c0, hd, c


@triton.jit
def _ring_slots(hd, offs_r, R):
    """Ring slot of window entries hd + offs_r (both < R): one compare, no integer division."""
    sl = hd + offs_r
    return tl.where(sl >= R, sl - R, sl)


@triton.jit
def _scores_kernel(ringB_ptr, B_ptr, C_ptr, head_ptr, count_ptr, flush_ptr, kqr_ptr, kqn_ptr, win_ptr, L, R, N,
                   rB_b, rB_r, rB_g, rB_n, B_b, B_l, B_g, B_n, C_b, C_l, C_g, C_n,
                   HAS_FLUSH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    G = tl.num_programs(1)
    _, _, _, hd, c = _window(head_ptr, count_ptr, flush_ptr, b, L, R, HAS_FLUSH)
    if g == 0:  # the window after the flush, for the append kernel (which moves head / count)
        tl.store(win_ptr + 2 * b, hd)
        tl.store(win_ptr + 2 * b + 1, c)
    offs_r = tl.arange(0, BLOCK_R)
    offs_l = tl.arange(0, BLOCK_L)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    slots = _ring_slots(hd, offs_r, R)  # (BLOCK_R,) ring slot of window entry j
    live = offs_r < c
    Br = tl.load(ringB_ptr + b * rB_b + slots[:, None] * rB_r + g * rB_g + offs_n[None, :] * rB_n,
                 mask=live[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_N)
    Bn = tl.load(B_ptr + b * B_b + offs_l[:, None] * B_l + g * B_g + offs_n[None, :] * B_n,
                 mask=(offs_l < L)[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # (BLOCK_L, BLOCK_N)
    out_r = kqr_ptr + (b * G + g) * L * R
    out_n = kqn_ptr + (b * G + g) * L * L
    for s in range(0, L):
        Cs = tl.load(C_ptr + b * C_b + s * C_l + g * C_g + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(out_r + s * R + offs_r, tl.sum(Br * Cs[None, :], axis=1), mask=offs_r < R)
        tl.store(out_n + s * L + offs_l, tl.sum(Bn * Cs[None, :], axis=1), mask=offs_l < L)


@triton.jit
def _window_kernel(rx_ptr, rdt_ptr, head_ptr, count_ptr, flush_ptr, x_ptr, dt_ptr, A_ptr, D_ptr, bias_ptr, tree_ptr,
                   kqr_ptr, kqn_ptr, part_ptr, dec_ptr, L, R, P, heads_per_group, lo, hi,
                   rx_b, rx_r, rx_h, rx_p, rdt_b, rdt_r, rdt_h, x_b, x_l, x_h, x_p, dt_b, dt_l, dt_h, t_b, t_i, t_j,
                   HAS_FLUSH: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr,
                   TREE: tl.constexpr, MATRIX: tl.constexpr, WPREC: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr):
    """Everything of the readout that does not touch the state, once per (sequence, head):
    part[s] = Σ_j exp(cum_s − cum_j)·dt_j·kq[s, j]·x_j over the window entries j visible to token s (committed
    ring entries, then the call's tokens under the causal or tree mask) + D·x_s, and dec[s] = exp(cum_s).
    MATRIX (multi-token calls, BLOCK_L >= 16): the weights of all tokens as two small matrices and part as two
    GEMMs at ``WPREC``, part = W_ring X_ring + W_new X_new (tf32 for 16-bit inputs: X is exact in tf32, the
    weights keep a 10-bit mantissa, 8x finer than the bf16 output; tf32x3 for fp32 inputs); else one token at
    a time (single-token decode). On an H100 (Nemotron-H-4B mixer, batch 256, L = 7, R = 32, 0 / 6 accepted,
    the whole verify step) this launch at tf32 and 2 warps gave 521 / 655 us, at 1 / 4 / 8 warps 534 / 666,
    547 / 683, 608 / 744; fp32 GEMMs at 2 / 4 warps 571 / 708, 589 / 725; the token loop at 1 warp 533 /
    667 (2 warps 801 / 934)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    g = h // heads_per_group
    G = H // heads_per_group
    _, _, _, hd, c = _window(head_ptr, count_ptr, flush_ptr, b, L, R, HAS_FLUSH)
    offs_p = tl.arange(0, BLOCK_P)
    offs_r = tl.arange(0, BLOCK_R)
    offs_l = tl.arange(0, BLOCK_L)
    mask_p = offs_p < P
    mask_l = offs_l < L
    A = tl.load(A_ptr + h).to(tl.float32)
    slots = _ring_slots(hd, offs_r, R)
    live_r = offs_r < c
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
    else:
        cumn = Tc + tl.cumsum(an, axis=0)  # (BLOCK_L,)
    Xn = tl.load(x_ptr + b * x_b + offs_l[:, None] * x_l + h * x_h + offs_p[None, :] * x_p,
                 mask=mask_l[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # (BLOCK_L, BLOCK_P)
    if HAS_D:
        Dh = tl.load(D_ptr + h).to(tl.float32)
    kqr = kqr_ptr + (b * G + g) * L * R
    kqn = kqn_ptr + (b * G + g) * L * L
    if MATRIX:
        offs_j = tl.arange(0, BLOCK_L)  # the same token index, as a column of the weight matrices
        m_r = mask_l[:, None] & live_r[None, :]  # (BLOCK_L, BLOCK_R)
        kr = tl.load(kqr + offs_l[:, None] * R + offs_r[None, :], mask=m_r, other=0.0)
        Wr = tl.where(m_r, tl.exp(tl.where(m_r, cumn[:, None] - cumr[None, :], 0.0)) * dtr[None, :] * kr, 0.0)
        if TREE:
            vis = M != 0
        else:
            vis = offs_j[None, :] <= offs_l[:, None]
        m_n = vis & mask_l[:, None] & (offs_j < L)[None, :]  # (BLOCK_L, BLOCK_L) token s sees token j
        kn = tl.load(kqn + offs_l[:, None] * L + offs_j[None, :], mask=m_n, other=0.0)
        Wn = tl.where(m_n, tl.exp(tl.where(m_n, cumn[:, None] - cumn[None, :], 0.0)) * dtn[None, :] * kn, 0.0)
        if HAS_D:
            Wn += tl.where(offs_l[:, None] == offs_j[None, :], Dh, 0.0)  # the skip term D·x_s
        part = tl.dot(Wr, Xr, input_precision=WPREC) + tl.dot(Wn, Xn, input_precision=WPREC)  # (BLOCK_L, BLOCK_P)
        tl.store(part_ptr + ((b * L + offs_l[:, None]) * H + h) * P + offs_p[None, :], part,
                 mask=mask_l[:, None] & mask_p[None, :])
        tl.store(dec_ptr + (b * L + offs_l) * H + h, tl.exp(cumn), mask=mask_l)
    else:
        for s in range(0, L):
            cs = tl.sum(tl.where(offs_l == s, cumn, 0.0), axis=0)  # log-decay from the checkpoint to token s
            kr = tl.load(kqr + s * R + offs_r, mask=live_r, other=0.0)
            wr = tl.where(live_r, tl.exp(cs - cumr) * dtr * kr, 0.0)  # (BLOCK_R,)
            if TREE:
                vis = tl.load(tree_ptr + b * t_b + s * t_i + offs_l * t_j, mask=mask_l, other=0) != 0
            else:
                vis = offs_l <= s
            kn = tl.load(kqn + s * L + offs_l, mask=mask_l, other=0.0)
            wn = tl.where(vis & mask_l, tl.exp(cs - cumn) * dtn * kn, 0.0)  # (BLOCK_L,)
            if HAS_D:
                wn += tl.where(offs_l == s, Dh, 0.0)  # the skip term D·x_s
            part = tl.sum(wr[:, None] * Xr, axis=0) + tl.sum(wn[:, None] * Xn, axis=0)  # (BLOCK_P,)
            tl.store(part_ptr + ((b * L + s) * H + h) * P + offs_p, part, mask=mask_p)
            tl.store(dec_ptr + (b * L + s) * H + h, tl.exp(cs))


@triton.jit
def _main_kernel(S_ptr, rx_ptr, rdt_ptr, rB_ptr, head_ptr, count_ptr, flush_ptr, A_ptr, C_ptr, part_ptr, dec_ptr,
                 y_ptr, L, R, P, N, heads_per_group,
                 S_b, S_h, S_p, S_n, rx_b, rx_r, rx_h, rx_p, rdt_b, rdt_r, rdt_h, rB_b, rB_r, rB_g, rB_n,
                 C_b, C_l, C_g, C_n, y_b, y_l, y_h, y_p,
                 HAS_FLUSH: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_P: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_LD: tl.constexpr):
    """The state part, per (sequence, head, BLOCK_P rows): one load of the checkpoint tile; where the sequence
    flushes, the fold of its committed entries and the only state store; y_s = dec_s·(S0 C_s) + part_s.
    Default: one rank-1 update per folded entry and one row reduction per token. DOT (``gemm=True``): the
    fold and the readout as tensor-core GEMMs at ``PRECISION`` (tf32x3: fp32-accurate; tf32: one pass, the
    state rounded to a 10-bit mantissa, 8x finer than the bf16 output it feeds), so neither grows with the
    number of tokens folded or read."""
    pid_p = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    H = tl.num_programs(2)
    g = h // heads_per_group
    f, h0, c0, hd, c = _window(head_ptr, count_ptr, flush_ptr, b, L, R, HAS_FLUSH)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    s_ptrs = S_ptr + b * S_b + h * S_h + offs_p[:, None] * S_p + offs_n[None, :] * S_n
    S = tl.load(s_ptrs, mask=mask_p[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_P, BLOCK_N) checkpoint tile
    if f * c0 > 0:  # flush with a non-empty ring: fold the committed entries, the only state store
        A = tl.load(A_ptr + h).to(tl.float32)
        if DOT:  # S <- exp(Σa)·S + (X ∘ w)ᵀ B over the c0 entries, w_j = exp(Σa − cum_j)·dt_j
            offs_r = tl.arange(0, BLOCK_R)
            old = _ring_slots(h0, offs_r, R)
            live = offs_r < c0
            dto = tl.load(rdt_ptr + b * rdt_b + old * rdt_r + h * rdt_h, mask=live, other=0.0)  # (BLOCK_R,)
            cumo = tl.cumsum(A * dto, axis=0)
            tot = tl.sum(A * dto, axis=0)
            wo = tl.where(live, tl.exp(tot - cumo) * dto, 0.0)
            XoT = tl.load(rx_ptr + b * rx_b + old[None, :] * rx_r + h * rx_h + offs_p[:, None] * rx_p,
                          mask=live[None, :] & mask_p[:, None], other=0.0).to(tl.float32)  # (BLOCK_P, BLOCK_R)
            Bo = tl.load(rB_ptr + b * rB_b + old[:, None] * rB_r + g * rB_g + offs_n[None, :] * rB_n,
                         mask=live[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_N)
            S = tl.exp(tot) * S + tl.dot(XoT * wo[None, :], Bo, input_precision=PRECISION)
        else:
            for j in range(0, c0):  # the recurrence itself, one rank-1 update per entry (flush steps only)
                slot = (h0 + j) % R
                dtj = tl.load(rdt_ptr + b * rdt_b + slot * rdt_r + h * rdt_h)
                xj = tl.load(rx_ptr + b * rx_b + slot * rx_r + h * rx_h + offs_p * rx_p, mask=mask_p,
                             other=0.0).to(tl.float32)  # (BLOCK_P,)
                Bj = tl.load(rB_ptr + b * rB_b + slot * rB_r + g * rB_g + offs_n * rB_n, mask=mask_n,
                             other=0.0).to(tl.float32)  # (BLOCK_N,)
                S = S * tl.exp(A * dtj) + (dtj * xj)[:, None] * Bj[None, :]
        tl.store(s_ptrs, S, mask=mask_p[:, None] & mask_n[None, :])
    if DOT:  # Y = S0 · [C_0 .. C_{L-1}] in one GEMM, (BLOCK_P, BLOCK_LD)
        offs_s = tl.arange(0, BLOCK_LD)
        mask_s = offs_s < L
        Ct = tl.load(C_ptr + b * C_b + offs_s[None, :] * C_l + g * C_g + offs_n[:, None] * C_n,
                     mask=mask_s[None, :] & mask_n[:, None], other=0.0).to(tl.float32)  # (BLOCK_N, BLOCK_LD)
        Y = tl.dot(S, Ct, input_precision=PRECISION)
        dec = tl.load(dec_ptr + (b * L + offs_s) * H + h, mask=mask_s, other=0.0)  # (BLOCK_LD,)
        m2 = mask_p[:, None] & mask_s[None, :]
        part = tl.load(part_ptr + ((b * L + offs_s[None, :]) * H + h) * P + offs_p[:, None], mask=m2, other=0.0)
        tl.store(y_ptr + b * y_b + offs_s[None, :] * y_l + h * y_h + offs_p[:, None] * y_p,
                 Y * dec[None, :] + part, mask=m2)
    else:
        for s in range(0, L):
            Cs = tl.load(C_ptr + b * C_b + s * C_l + g * C_g + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
            dec = tl.load(dec_ptr + (b * L + s) * H + h)
            part = tl.load(part_ptr + ((b * L + s) * H + h) * P + offs_p, mask=mask_p, other=0.0)
            tl.store(y_ptr + b * y_b + s * y_l + h * y_h + offs_p * y_p, dec * tl.sum(S * Cs[None, :], axis=1) + part,
                     mask=mask_p)


@triton.jit
def _append_kernel(rx_ptr, rdt_ptr, rB_ptr, head_ptr, count_ptr, win_ptr, x_ptr, dt_ptr, B_ptr, bias_ptr,
                   L, R, H, P, G, N, lo, hi,
                   rx_b, rx_r, rx_h, rx_p, rdt_b, rdt_r, rdt_h, rB_b, rB_r, rB_g, rB_n,
                   x_b, x_l, x_h, x_p, dt_b, dt_l, dt_h, B_b, B_l, B_g, B_n,
                   HAS_DT_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (b, s, k): chunk k of token s's x into ring slot (head + count + s) % R of the window after the
    flush (read from ``win``, written by the scores kernel); chunk 0 also B and the discretized dt; program
    (b, 0, 0) moves head / count. Nothing in this launch reads head / count, so the move is race-free."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    k = tl.program_id(2)
    hd = tl.load(win_ptr + 2 * b)
    c = tl.load(win_ptr + 2 * b + 1)
    slot = (hd + c + s) % R
    offs = tl.arange(0, BLOCK)
    i = k * BLOCK + offs  # x (H, P) of token s, flattened
    hh = i // P
    pp = i % P
    v = tl.load(x_ptr + b * x_b + s * x_l + hh * x_h + pp * x_p, mask=i < H * P)
    tl.store(rx_ptr + b * rx_b + slot * rx_r + hh * rx_h + pp * rx_p, v, mask=i < H * P)
    if k == 0:
        for start in range(0, G * N, BLOCK):  # B (G, N)
            j = start + offs
            gg = j // N
            nn = j % N
            v = tl.load(B_ptr + b * B_b + s * B_l + gg * B_g + nn * B_n, mask=j < G * N)
            tl.store(rB_ptr + b * rB_b + slot * rB_r + gg * rB_g + nn * rB_n, v, mask=j < G * N)
        offs_h = tl.arange(0, BLOCK_H)
        if HAS_DT_BIAS:
            bias = tl.load(bias_ptr + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)
        else:
            bias = tl.zeros([BLOCK_H], dtype=tl.float32)
        d = tl.load(dt_ptr + b * dt_b + s * dt_l + offs_h * dt_h, mask=offs_h < H, other=0.0).to(tl.float32)
        d = discretize(d, bias, lo, hi, True, HAS_LIMIT)
        tl.store(rdt_ptr + b * rdt_b + slot * rdt_r + offs_h * rdt_h, d, mask=offs_h < H)
        if s == 0:
            tl.store(head_ptr + b, hd.to(head_ptr.dtype.element_ty))
            tl.store(count_ptr + b, c.to(count_ptr.dtype.element_ty))


def _main_blocks(P: int, N: int, L: int, dot: bool) -> tuple[int, int]:
    """(BLOCK_P, num_warps) of the state kernel, chosen by hand (it writes S0 in place on flush steps, so it is
    never autotuned; evidence: the ``sweep`` rows of replay_fig7_buffer and ``verify_sweep`` rows of
    replay_fig9_verify_cost). Single-token decode: 16 rows x N = 128 is 8 KB of fp32 state a program, at 4
    warps enough bytes in flight per program while the grid (P/16 x B x H) fills the GPU. Multi-token calls
    (the GEMM form): all of P (up to 64 rows) in one program at 4 warps, so each C tile and each folded ring
    entry is loaded once per head (L = 7, R = 32, batch 256, Nemotron-H-4B mixer on an H100, 0..6 accepted:
    0.88-1.08x of one mamba_ssm decode step at 64 rows, 0.93-1.13x at 32, 0.99-1.19x at 16). The row-
    reduction form (``gemm=False``) keeps one warp: one reduction per token stays inside the warp."""
    if dot and L > 1:
        return min(64, max(16, triton.next_power_of_2(P))), 4
    bp = 16 if N >= 64 else 32
    return min(bp, max(16, triton.next_power_of_2(P))), (4 if L <= 1 or dot else 1)


FUSED_MAX_STATE = 4 * 80 * 64 * 128  # state elements (batch x H x P x N) up to which the one-launch form is default


def use_fused(bsz: int, H: int, P: int, N: int) -> bool:
    """The default form of a verify call: one launch (``ops/replay/fused.py``) where the call's whole state is
    small enough that launches, not bytes, set the time (batch x H x P x N <= ``FUSED_MAX_STATE``, 10 MiB of
    fp32) and a head's tile fits one program; the four launches of this module otherwise. Measured on one H100
    (commit 3ca97e8, ``replay_fig9_verify_cost`` with ``bench.verify_sweep=[{fused: true}, {fused: false}]``
    at S = 4, R = 32, us a call, mean over 0..4 accepted, one form / four launches): mamba2-2.7b's mixer
    (H = 80, N = 128) 15.9 / 17.0 at batch 1, 23.4 / 24.6 at batch 4 (this bound), 53.7 / 42.4 at 16, 176 /
    113 at 64; nemotron-h-4b's (H = 112) 24.4 / 28.7 at batch 1, 46.0 / 44.6 at batch 4, 146 / 89 at 16.
    With many programs the four launches win: their state kernel splits P across programs and their scores
    are computed once per group, not once per head."""
    from ssmspec.ops.replay.fused import fused_fits
    return bsz * H * P * N <= FUSED_MAX_STATE and fused_fits(P, N)


def replay_verify_triton(S0: Tensor, ring_x: Tensor, ring_dt: Tensor, ring_B: Tensor, head: Tensor, count: Tensor,
                         x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                         dt_bias: Tensor | None, dt_limit=(0.0, float("inf")), flush: Tensor | None = None,
                         tree_mask: Tensor | None = None, block_p: int | None = None,
                         num_warps: int | None = None, gemm: bool | None = None, precision: str | None = None,
                         window_warps: int | None = None, fused: bool | None = None,
                         workspace: Tensor | None = None) -> Tensor:
    """Triton form of ``replay_verify`` (see ``ssmspec.ops.replay``). ``block_p`` / ``num_warps`` / ``gemm``
    override the hand-picked launch of the state kernel and ``window_warps`` that of the window kernel
    (benchmark sweeps; decode at batch 256, R = 16 on an H100: window kernel 21 / 32 / 55 us at 1 / 2 / 4 warps
    for the Nemotron-H-4B mixer, 15 / 24 / 40 us for Mamba2-2.7B's); ``gemm=True`` runs its fold and
    readout as tf32x3 tensor-core GEMMs instead of rank-1 updates and row reductions (slower on an H100 at
    every L measured, 1..7, with tf32x3); ``precision`` is the tl.dot input precision of that GEMM and of the
    window kernel's two GEMMs in multi-token calls (default tf32 for 16-bit inputs, whose outputs are rounded
    far coarser, and tf32x3 for fp32 inputs). ``gemm`` defaults to the GEMM form for multi-token calls of
    16-bit inputs (with the tf32 window: 0.78-0.98x of a decode step at S = 6, R = 32 on an H100, 0..6
    accepted; 0.88-1.08x with fp32 window GEMMs at 4 warps; the row reductions 1.11-1.56x) and to the row
    reductions otherwise. ``fused`` picks the one-launch form of ``ops/replay/fused.py`` (one program per
    sequence and head; ``workspace``: its (B,) int32 zeros) over these four launches; None: ``use_fused``, and
    the four launches whenever ``block_p`` or ``window_warps`` is given (a sweep of them times that form)."""
    bsz, L, H, P = x.shape
    R = ring_x.shape[1]
    G, N = B.shape[2], B.shape[3]
    if ring_x.shape != (bsz, R, H, P) or ring_dt.shape != (bsz, R, H) or ring_B.shape != (bsz, R, G, N):
        raise ValueError(f"ring buffers must be x (B, R, H, P), dt (B, R, H), B (B, R, G, N) with B={bsz}, H={H}, "
                         f"P={P}, G={G}, N={N}; got {tuple(ring_x.shape)}, {tuple(ring_dt.shape)}, {tuple(ring_B.shape)}")
    if L > R:
        raise ValueError(f"a call of L={L} tokens does not fit a ring of R={R}; raise the buffer size R or lower S")
    if S0.shape != (bsz, H, P, N) or S0.dtype != torch.float32 or ring_dt.dtype != torch.float32:
        raise ValueError(f"S0 must be fp32 (B, H, P, N) = {(bsz, H, P, N)} and ring_dt fp32; got {tuple(S0.shape)} "
                         f"{S0.dtype}, {ring_dt.dtype}")
    if dt.shape != (bsz, L, H) or C.shape != B.shape or B.shape[:2] != (bsz, L) or H % G or A.shape != (H,):
        raise ValueError(f"need dt (B, L, H), A (H,), B and C (B, L, G, N) with H % G == 0; got {tuple(dt.shape)}, "
                         f"{tuple(A.shape)}, {tuple(B.shape)}, {tuple(C.shape)}")
    if head.shape != (bsz,) or count.shape != (bsz,) or (flush is not None and flush.shape != (bsz,)):
        raise ValueError(f"head, count and flush must be (B,) = ({bsz},)")
    if tree_mask is not None and (tree_mask.shape != (bsz, L, L) or tree_mask.dtype != torch.bool):
        raise ValueError(f"tree_mask must be a bool (B, L, L) = {(bsz, L, L)} tensor, got {tuple(tree_mask.shape)}")
    for name, t in (("x", x), ("B", B), ("C", C), ("dt", dt)):
        check_float(name, t)
    half = x.dtype in (torch.bfloat16, torch.float16)
    if precision is None:
        precision = "tf32" if half else "tf32x3"
    if precision not in ("tf32", "tf32x3", "ieee"):
        raise ValueError(f"precision must be tf32, tf32x3 or ieee, got {precision!r}")
    split_opts = block_p is not None or window_warps is not None  # launch options of the four-launch form
    if fused and split_opts:
        raise ValueError("block_p and window_warps are launch options of the four-launch form; pass fused=False "
                         "(or leave fused=None) with them")
    if use_fused(bsz, H, P, N) and not split_opts if fused is None else fused:
        from ssmspec.ops.replay.fused import replay_verify_fused_triton
        return replay_verify_fused_triton(S0, ring_x, ring_dt, ring_B, head, count, x, dt, A, B, C, D,
                                          dt_bias=dt_bias, dt_limit=dt_limit, flush=flush, tree_mask=tree_mask,
                                          workspace=workspace, gemm=gemm, precision=precision, num_warps=num_warps)
    dev = x.device
    kq_ring = torch.empty(bsz, G, L, R, device=dev, dtype=torch.float32)  # B_jᵀ C_s of ring entries
    kq_new = torch.empty(bsz, G, L, L, device=dev, dtype=torch.float32)  # B_sᵀ C_s of the call's tokens
    part = torch.empty(bsz, L, H, P, device=dev, dtype=torch.float32)  # readout terms that skip the state
    dec = torch.empty(bsz, L, H, device=dev, dtype=torch.float32)  # exp(cum_s): decay of the checkpoint
    win = torch.empty(bsz, 2, device=dev, dtype=torch.int32)  # (head, count) after the flush, per sequence
    y = torch.empty_like(x)
    flag = flush if flush is not None else count  # bool is read as int1: no conversion launch; None: the rule
    has_flush = flush is not None
    BR = max(16, triton.next_power_of_2(R))  # >= 16: the fold GEMM's inner dimension
    BL = max(2, triton.next_power_of_2(L))
    BN = max(16, triton.next_power_of_2(N))
    _scores_kernel[(bsz, G)](ring_B, B, C, head, count, flag, kq_ring, kq_new, win, L, R, N,
                             *ring_B.stride(), *B.stride(), *C.stride(), HAS_FLUSH=has_flush, BLOCK_R=BR,
                             BLOCK_L=BL, BLOCK_N=BN,
                             num_warps=4 if BR * BN <= 4096 else 8)
    lo, hi = limit_args(dt_limit)
    tm = tree_mask if tree_mask is not None else count  # unread without TREE
    tstr = tree_mask.stride() if tree_mask is not None else (0, 0, 0)
    matrix = L >= 2
    BLw = max(16, BL) if matrix else BL  # tl.dot needs >= 16 rows
    BP = max(16, triton.next_power_of_2(P))
    _window_kernel[(bsz, H)](
        ring_x, ring_dt, head, count, flag, x, dt, A, D if D is not None else dummy(A),
        dt_bias if dt_bias is not None else dummy(A), tm, kq_ring, kq_new, part, dec, L, R, P, H // G, lo, hi,
        *ring_x.stride(), *ring_dt.stride(), *x.stride(), *dt.stride(), *tstr,
        HAS_FLUSH=has_flush, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, HAS_LIMIT=has_limit(dt_limit),
        TREE=tree_mask is not None, MATRIX=matrix, WPREC=precision, BLOCK_P=BP, BLOCK_R=BR, BLOCK_L=BLw,
        num_warps=window_warps or (2 if matrix else 1))  # latency-bound: more programs resident (see docstring)
    use_dot = (L > 1 and half) if gemm is None else bool(gemm)
    bp, nw = _main_blocks(P, N, L, use_dot)
    bp, nw = block_p or bp, num_warps or nw
    _main_kernel[(triton.cdiv(P, bp), bsz, H)](
        S0, ring_x, ring_dt, ring_B, head, count, flag, A, C, part, dec, y, L, R, P, N, H // G,
        *S0.stride(), *ring_x.stride(), *ring_dt.stride(), *ring_B.stride(), *C.stride(), *y.stride(),
        HAS_FLUSH=has_flush, DOT=use_dot, PRECISION=precision, BLOCK_P=bp, BLOCK_N=BN, BLOCK_R=BR, BLOCK_LD=max(16, BL), num_warps=nw)
    APPEND = 1024
    _append_kernel[(bsz, L, triton.cdiv(H * P, APPEND))](
        ring_x, ring_dt, ring_B, head, count, win, x, dt, B, dt_bias if dt_bias is not None else dummy(A),
        L, R, H, P, G, N, lo, hi, *ring_x.stride(), *ring_dt.stride(), *ring_B.stride(), *x.stride(), *dt.stride(),
        *B.stride(), HAS_DT_BIAS=dt_bias is not None, HAS_LIMIT=has_limit(dt_limit), BLOCK=APPEND,
        BLOCK_H=max(2, triton.next_power_of_2(H)), num_warps=4)
    return y
