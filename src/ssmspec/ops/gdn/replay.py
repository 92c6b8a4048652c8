"""ReplaySSM kernels for Gated DeltaNet in Triton (seed 000, Alg. 6 and 8; the maths in ``ops/gdn/naive.py``).

One-token calls (standard decode) take the split form of ``ops/gdn/replay_split.py`` by default. The fused
form here serves multi-token calls (and one-token calls with ``split=False``): one ``gdn_replay_verify`` call
of L tokens is three launches, all graph-safe (the flush decision is per-sequence data read at run time, no
host sync):
1. ``_scores_kernel``, one program per (sequence, key group): the inner products of every query and key of
   the call with the committed ring keys and with the call's keys -- kk_r[s, j] = k_j·k_s, kq_r[s, j] =
   k_j·q_s, kk_n[s, t] = k_t·k_s, kq_n[s, t] = k_t·q_s -- computed once per group (seed 000: "precomputing
   shared inner products") into a small fp32 scratch; it also records the window after the flush. A loop of
   row reductions over the call's tokens: the same products as four tf32x3 tensor-core GEMMs per program
   measured 6x (R = 16) to 90x (R = 32) slower on an H100 (44 -> 281 us, 59 -> 5157 us at batch 256), and
   computed inside the state kernel (on tensor cores, per value head and column block) 1.0-2.7x slower;
2. the state kernel, one program per (sequence, value head, BLOCK_P columns), in one of two forms:
   - ``_verify_kernel`` (the GEMM form; default for multi-token calls of 16-bit inputs): streams its checkpoint
     tile S0 (N, BLOCK_P) in chunks of N rows through a software pipeline into [K; Q]·S0 on tensor cores
     (on flush steps each chunk is folded and stored first, the only state store), then the WY form on
     (L, ·) tiles: (I + A)⁻¹ by doubling, U = T·R and y as small GEMMs. Streaming made a step of L = 7
     1.3-1.5x faster than one whole-tile load (H100, batch 256), the doubling inverse and tf32 GEMMs on the
     small tiles another 1.2-1.3x over forward substitution and fp32 FMA products;
   - ``_main_kernel`` (the row form): loads the tile once; per token s the two readouts S0ᵀk_s and S0ᵀq_s,
     the ring terms, and one step of forward substitution for U = (I + A)⁻¹R; the fold one rank-1 update per
     committed entry.
   Every column of U is independent, so the WY solve needs nothing from other programs; both forms write
   y and append U to the ring;
3. ``_append_kernel``, one program per (sequence, token): appends k_s and g_s at ring slot
   (head + count + s) % R and moves head / count. It runs last because kernels 1-2 read the old keys and
   gates it may overwrite (a flush with count + L > R) and the pointers.
Kernel 2 reads and writes only its own columns of ring_u (the fold's reads come before U is known), so
appending U there is race-free. Kernel 2 writes S0 in place: never autotuned.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.gdn.naive import check_replay_args, default_scale
from ssmspec.ops.replay.triton import _ring_slots, _window
from ssmspec.ops.triton_common import check_float


@triton.jit
def _scores_kernel(rk_ptr, q_ptr, k_ptr, head_ptr, count_ptr, flush_ptr, kkr_ptr, kqr_ptr, kkn_ptr, kqn_ptr,
                   win_ptr, L, R, N, rk_b, rk_r, rk_g, rk_n, q_b, q_l, q_g, q_n, k_b, k_l, k_g, k_n,
                   HAS_FLUSH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    grp = tl.program_id(1)
    G = tl.num_programs(1)
    _, _, _, hd, c = _window(head_ptr, count_ptr, flush_ptr, b, L, R, HAS_FLUSH)
    if grp == 0:  # the window after the flush, for the append kernel (which moves head / count)
        tl.store(win_ptr + 2 * b, hd)
        tl.store(win_ptr + 2 * b + 1, c)
    offs_r = tl.arange(0, BLOCK_R)
    offs_l = tl.arange(0, BLOCK_L)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    live = offs_r < c
    slots = _ring_slots(hd, offs_r, R)
    Kr = tl.load(rk_ptr + b * rk_b + slots[:, None] * rk_r + grp * rk_g + offs_n[None, :] * rk_n,
                 mask=live[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_N) ring keys
    Kn = tl.load(k_ptr + b * k_b + offs_l[:, None] * k_l + grp * k_g + offs_n[None, :] * k_n,
                 mask=(offs_l < L)[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # (BLOCK_L, BLOCK_N)
    base_r = (b * G + grp) * L * R
    base_n = (b * G + grp) * L * L
    for s in range(0, L):
        ks = tl.load(k_ptr + b * k_b + s * k_l + grp * k_g + offs_n * k_n, mask=mask_n, other=0.0).to(tl.float32)
        qs = tl.load(q_ptr + b * q_b + s * q_l + grp * q_g + offs_n * q_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(kkr_ptr + base_r + s * R + offs_r, tl.sum(Kr * ks[None, :], axis=1), mask=offs_r < R)
        tl.store(kqr_ptr + base_r + s * R + offs_r, tl.sum(Kr * qs[None, :], axis=1), mask=offs_r < R)
        tl.store(kkn_ptr + base_n + s * L + offs_l, tl.sum(Kn * ks[None, :], axis=1), mask=offs_l < L)
        tl.store(kqn_ptr + base_n + s * L + offs_l, tl.sum(Kn * qs[None, :], axis=1), mask=offs_l < L)


@triton.jit
def _main_kernel(S_ptr, rk_ptr, ru_ptr, rg_ptr, head_ptr, count_ptr, flush_ptr, q_ptr, k_ptr, v_ptr, g_ptr,
                 beta_ptr, kkr_ptr, kqr_ptr, kkn_ptr, kqn_ptr, y_ptr, scale, L, R, N, P, heads_per_group,
                 S_b, S_h, S_n, S_p, rk_b, rk_r, rk_g, rk_n, ru_b, ru_r, ru_h, ru_p, rg_b, rg_r, rg_h,
                 q_b, q_l, q_g, q_n, k_b, k_l, k_g, k_n, v_b, v_l, v_h, v_p, g_b, g_l, g_h, be_b, be_l, be_h,
                 y_b, y_l, y_h, y_p,
                 HAS_FLUSH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_L: tl.constexpr):
    """The row form: token by token, two column reductions of the tile per token (S0ᵀk_s, S0ᵀq_s) and one step
    of forward substitution, the scores read from ``_scores_kernel``'s scratch; the fold one rank-1 update per
    committed entry."""
    pid_p = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    H = tl.num_programs(2)
    grp = h // heads_per_group
    G = H // heads_per_group
    f, h0, c0, hd, c = _window(head_ptr, count_ptr, flush_ptr, b, L, R, HAS_FLUSH)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_n = offs_n < N
    mask_p = offs_p < P
    mask = mask_n[:, None] & mask_p[None, :]
    s_ptrs = S_ptr + b * S_b + h * S_h + offs_n[:, None] * S_n + offs_p[None, :] * S_p
    S = tl.load(s_ptrs, mask=mask, other=0.0)  # (BLOCK_N, BLOCK_P) checkpoint tile, the one state load
    if f * c0 > 0:  # flush with a non-empty ring: S0 <- exp(g_j)·S0 + k_j u_jᵀ over the committed entries
        for j in range(0, c0):
            slot = (h0 + j) % R
            gj = tl.load(rg_ptr + b * rg_b + slot * rg_r + h * rg_h)
            kj = tl.load(rk_ptr + b * rk_b + slot * rk_r + grp * rk_g + offs_n * rk_n, mask=mask_n,
                         other=0.0).to(tl.float32)  # (BLOCK_N,)
            uj = tl.load(ru_ptr + b * ru_b + slot * ru_r + h * ru_h + offs_p * ru_p, mask=mask_p,
                         other=0.0).to(tl.float32)  # (BLOCK_P,)
            S = S * tl.exp(gj) + kj[:, None] * uj[None, :]
        tl.store(s_ptrs, S, mask=mask)
    # the committed window after the flush: gates, their prefix sums, this program's columns of u (loaded after
    # the state tile: issued before it, to overlap the latencies, they measured 1.2-1.3x slower on an H100 --
    # decode 286 -> 366 us, verify 504 -> 595 us at batch 256 -- their registers held across the tile's load)
    offs_r = tl.arange(0, BLOCK_R)
    live = offs_r < c
    slots = _ring_slots(hd, offs_r, R)
    gr = tl.load(rg_ptr + b * rg_b + slots * rg_r + h * rg_h, mask=live, other=0.0)  # (BLOCK_R,)
    cumr = tl.cumsum(gr, axis=0)
    Ur = tl.load(ru_ptr + b * ru_b + slots[:, None] * ru_r + h * ru_h + offs_p[None, :] * ru_p,
                 mask=live[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_P)
    offs_l = tl.arange(0, BLOCK_L)
    gn = tl.load(g_ptr + b * g_b + offs_l * g_l + h * g_h, mask=offs_l < L, other=0.0).to(tl.float32)
    gam = tl.sum(gr, axis=0) + tl.cumsum(gn, axis=0)  # (BLOCK_L,) Γ_s: log-decay checkpoint -> token s
    base_r = (b * G + grp) * L * R
    base_n = (b * G + grp) * L * L
    # token by token
    U = tl.zeros([BLOCK_L, BLOCK_P], dtype=tl.float32)  # rows t < s: the corrections solved so far
    for s in range(0, L):
        gs = tl.sum(tl.where(offs_l == s, gam, 0.0), axis=0)
        bs = tl.load(beta_ptr + b * be_b + s * be_l + h * be_h).to(tl.float32)
        ks = tl.load(k_ptr + b * k_b + s * k_l + grp * k_g + offs_n * k_n, mask=mask_n, other=0.0).to(tl.float32)
        qs = tl.load(q_ptr + b * q_b + s * q_l + grp * q_g + offs_n * q_n, mask=mask_n, other=0.0).to(tl.float32)
        vs = tl.load(v_ptr + b * v_b + s * v_l + h * v_h + offs_p * v_p, mask=mask_p, other=0.0).to(tl.float32)
        hk = tl.sum(S * ks[:, None], axis=0)  # (BLOCK_P,) S0ᵀk_s
        hq = tl.sum(S * qs[:, None], axis=0)  # (BLOCK_P,) S0ᵀq_s
        wr = tl.where(live, tl.exp(gs - cumr), 0.0)  # (BLOCK_R,) decay from ring entry j to token s
        kkr = tl.load(kkr_ptr + base_r + s * R + offs_r, mask=live, other=0.0)
        kqr = tl.load(kqr_ptr + base_r + s * R + offs_r, mask=live, other=0.0)
        earlier = offs_l < s
        wn = tl.where(offs_l <= s, tl.exp(gs - gam), 0.0)  # (BLOCK_L,) decay from token t to token s
        kkn = tl.load(kkn_ptr + base_n + s * L + offs_l, mask=earlier, other=0.0)
        kqn = tl.load(kqn_ptr + base_n + s * L + offs_l, mask=offs_l <= s, other=0.0)
        es = tl.exp(gs)
        # U_s = R_s − Σ_{t<s} A[s, t] U_t, R_s = β_s(v_s − e^{Γ_s} S0ᵀk_s − ring part),
        # A[s, t] = β_s e^{Γ_s−Γ_t} k_t·k_s
        rk_part = tl.sum((wr * kkr)[:, None] * Ur, axis=0)
        us = bs * (vs - es * hk - rk_part - tl.sum(tl.where(earlier, wn * kkn, 0.0)[:, None] * U, axis=0))
        U = tl.where(offs_l[:, None] == s, us[None, :], U)
        ys = es * hq + tl.sum((wr * kqr)[:, None] * Ur, axis=0) + tl.sum((wn * kqn)[:, None] * U, axis=0)
        tl.store(y_ptr + b * y_b + s * y_l + h * y_h + offs_p * y_p, scale * ys, mask=mask_p)
        slot = (hd + c + s) % R  # append U_s: only this program reads or writes these columns
        tl.store(ru_ptr + b * ru_b + slot * ru_r + h * ru_h + offs_p * ru_p, us, mask=mask_p)


@triton.jit
def _call_keys(k_ptr, q_ptr, b, grp, offs_l, mask_l, offs_n, mask_n, k_b, k_l, k_g, k_n, q_b, q_l, q_g, q_n):
    """(BLOCK_L, BLOCK_K) chunks of the call's keys and queries in fp32 (16-bit values are exact in tf32)."""
    m = mask_l[:, None] & mask_n[None, :]
    Kn = tl.load(k_ptr + b * k_b + offs_l[:, None] * k_l + grp * k_g + offs_n[None, :] * k_n, mask=m, other=0.0)
    Qn = tl.load(q_ptr + b * q_b + offs_l[:, None] * q_l + grp * q_g + offs_n[None, :] * q_n, mask=m, other=0.0)
    return Kn.to(tl.float32), Qn.to(tl.float32)


@triton.jit
def _inverse_unit_lower(A, offs_l, STEPS: tl.constexpr, PRECISION: tl.constexpr):
    """T = (I + A)⁻¹ of a strictly lower triangular A (rows and columns >= L zero). A is nilpotent (A^L = 0),
    so T = Σ_{k<L} (−A)^k = (I − A)(I + A²)(I + A⁴)...: STEPS = ceil(log2 L) − 1 squarings and products on
    tensor cores, no serial chain (forward substitution row by row -- L dependent cross-warp reductions -- with
    the small products in fp32 FMAs measured 1.2-1.3x slower for the whole verify on an H100)."""
    eye = tl.where(offs_l[:, None] == offs_l[None, :], 1.0, 0.0)
    T = eye - A
    Ap = A
    for _ in tl.static_range(STEPS):  # the factors (I + A^(2^i)), 2^i < L
        Ap = tl.dot(Ap, Ap, input_precision=PRECISION)
        T = tl.dot(T, eye + Ap, input_precision=PRECISION)
    return T


@triton.jit
def _verify_kernel(S_ptr, rk_ptr, ru_ptr, rg_ptr, head_ptr, count_ptr, flush_ptr, q_ptr, k_ptr, v_ptr, g_ptr,
                   beta_ptr, kkr_ptr, kqr_ptr, kkn_ptr, kqn_ptr, y_ptr, scale, L, R, N, P, heads_per_group,
                   S_b, S_h, S_n, S_p, rk_b, rk_r, rk_g, rk_n, ru_b, ru_r, ru_h, ru_p, rg_b, rg_r, rg_h,
                   q_b, q_l, q_g, q_n, k_b, k_l, k_g, k_n, v_b, v_l, v_h, v_p, g_b, g_l, g_h, be_b, be_l, be_h,
                   y_b, y_l, y_h, y_p,
                   HAS_FLUSH: tl.constexpr, PRECISION: tl.constexpr, INV_STEPS: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
                   STAGES: tl.constexpr):
    """The GEMM form of a multi-token call (seed 000, Alg. 8), one program per (column block, sequence, value
    head). The state tile streams through in BLOCK_K-row chunks (``STAGES`` deep), each feeding [K; Q]·S0 on
    tensor cores at ``PRECISION``; on flush steps each chunk is folded first (S0 <- exp(Σg)·S0 + (Kᵀ ∘ w) U over
    the committed entries, one GEMM) and stored, the only state store. Then, on (L, ·) tiles: T = (I + A)⁻¹,
    U = T·R and y from small GEMMs at ``PRECISION``; y written, U appended to this program's columns of the ring."""
    pid_p = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    H = tl.num_programs(2)
    grp = h // heads_per_group
    G = H // heads_per_group
    f, h0, c0, hd, c = _window(head_ptr, count_ptr, flush_ptr, b, L, R, HAS_FLUSH)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    mask_p = offs_p < P
    mask_l = offs_l < L
    live = offs_r < c
    slots = _ring_slots(hd, offs_r, R)
    s_base = S_ptr + b * S_b + h * S_h
    HK = tl.zeros([BLOCK_L, BLOCK_P], dtype=tl.float32)  # S0ᵀk_s per row
    HQ = tl.zeros([BLOCK_L, BLOCK_P], dtype=tl.float32)  # S0ᵀq_s
    if f * c0 > 0:  # flush: fold each chunk, store it, read it out (the window after the flush is empty)
        old = _ring_slots(h0, offs_r, R)
        alive = offs_r < c0
        go = tl.load(rg_ptr + b * rg_b + old * rg_r + h * rg_h, mask=alive, other=0.0)  # (BLOCK_R,)
        tot = tl.sum(go, axis=0)
        wo = tl.where(alive, tl.exp(tot - tl.cumsum(go, axis=0)), 0.0)  # w_j = exp(Σg − cum_j)
        Uo = tl.load(ru_ptr + b * ru_b + old[:, None] * ru_r + h * ru_h + offs_p[None, :] * ru_p,
                     mask=alive[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_P)
        et = tl.exp(tot)
        for n0 in tl.range(0, N, BLOCK_K, num_stages=STAGES):
            offs_n = n0 + tl.arange(0, BLOCK_K)
            mask_n = offs_n < N
            m = mask_n[:, None] & mask_p[None, :]
            ptrs = s_base + offs_n[:, None] * S_n + offs_p[None, :] * S_p
            S = tl.load(ptrs, mask=m, other=0.0)  # (BLOCK_K, BLOCK_P)
            KoT = tl.load(rk_ptr + b * rk_b + old[None, :] * rk_r + grp * rk_g + offs_n[:, None] * rk_n,
                          mask=alive[None, :] & mask_n[:, None], other=0.0).to(tl.float32)  # (BLOCK_K, BLOCK_R)
            S = et * S + tl.dot(KoT * wo[None, :], Uo, input_precision=PRECISION)
            tl.store(ptrs, S, mask=m)
            Kn, Qn = _call_keys(k_ptr, q_ptr, b, grp, offs_l, mask_l, offs_n, mask_n, k_b, k_l, k_g, k_n,
                                q_b, q_l, q_g, q_n)
            HK = tl.dot(Kn, S, HK, input_precision=PRECISION)
            HQ = tl.dot(Qn, S, HQ, input_precision=PRECISION)
    else:
        for n0 in tl.range(0, N, BLOCK_K, num_stages=STAGES):
            offs_n = n0 + tl.arange(0, BLOCK_K)
            mask_n = offs_n < N
            S = tl.load(s_base + offs_n[:, None] * S_n + offs_p[None, :] * S_p,
                        mask=mask_n[:, None] & mask_p[None, :], other=0.0)  # (BLOCK_K, BLOCK_P)
            Kn, Qn = _call_keys(k_ptr, q_ptr, b, grp, offs_l, mask_l, offs_n, mask_n, k_b, k_l, k_g, k_n,
                                q_b, q_l, q_g, q_n)
            HK = tl.dot(Kn, S, HK, input_precision=PRECISION)
            HQ = tl.dot(Qn, S, HQ, input_precision=PRECISION)
    m_lr = mask_l[:, None] & live[None, :]
    m_ll = mask_l[:, None] & mask_l[None, :]
    lower = m_ll & (offs_l[:, None] >= offs_l[None, :])  # t <= s
    base_r = (b * G + grp) * L * R  # the scores, from _scores_kernel's scratch
    base_n = (b * G + grp) * L * L
    KKr = tl.load(kkr_ptr + base_r + offs_l[:, None] * R + offs_r[None, :], mask=m_lr, other=0.0)  # k_j·k_s
    KQr = tl.load(kqr_ptr + base_r + offs_l[:, None] * R + offs_r[None, :], mask=m_lr, other=0.0)  # k_j·q_s
    KKn = tl.load(kkn_ptr + base_n + offs_l[:, None] * L + offs_l[None, :], mask=m_ll, other=0.0)  # k_t·k_s
    KQn = tl.load(kqn_ptr + base_n + offs_l[:, None] * L + offs_l[None, :], mask=m_ll, other=0.0)  # k_t·q_s
    # the window after the flush: gates, their prefix sums, this program's columns of u
    gr = tl.load(rg_ptr + b * rg_b + slots * rg_r + h * rg_h, mask=live, other=0.0)  # (BLOCK_R,)
    cumr = tl.cumsum(gr, axis=0)
    Ur = tl.load(ru_ptr + b * ru_b + slots[:, None] * ru_r + h * ru_h + offs_p[None, :] * ru_p,
                 mask=live[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_P)
    gn = tl.load(g_ptr + b * g_b + offs_l * g_l + h * g_h, mask=mask_l, other=0.0).to(tl.float32)
    gam = tl.sum(gr, axis=0) + tl.cumsum(gn, axis=0)  # (BLOCK_L,) Γ_s: log-decay checkpoint -> token s
    m_lp = mask_l[:, None] & mask_p[None, :]
    V = tl.load(v_ptr + b * v_b + offs_l[:, None] * v_l + h * v_h + offs_p[None, :] * v_p, mask=m_lp,
                other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + b * be_b + offs_l * be_l + h * be_h, mask=mask_l, other=0.0).to(tl.float32)
    eg = tl.exp(gam)
    Wr = tl.where(m_lr, tl.exp(gam[:, None] - cumr[None, :]), 0.0)  # (BLOCK_L, BLOCK_R) entry j -> token s
    Rm = beta[:, None] * (V - eg[:, None] * HK - tl.dot(Wr * KKr, Ur, input_precision=PRECISION))  # (L, BLOCK_P)
    Dn = tl.where(lower, tl.exp(gam[:, None] - gam[None, :]), 0.0)  # (BLOCK_L, BLOCK_L) token t -> token s
    A = tl.where(offs_l[:, None] > offs_l[None, :], beta[:, None] * Dn * KKn, 0.0)  # strictly lower triangular
    T = _inverse_unit_lower(A, offs_l, INV_STEPS, PRECISION)
    U = tl.dot(T, Rm, input_precision=PRECISION)  # (BLOCK_L, BLOCK_P) the corrections of the call's tokens
    Y = (eg[:, None] * HQ + tl.dot(Wr * KQr, Ur, input_precision=PRECISION)
         + tl.dot(tl.where(lower, Dn * KQn, 0.0), U, input_precision=PRECISION))
    tl.store(y_ptr + b * y_b + offs_l[:, None] * y_l + h * y_h + offs_p[None, :] * y_p, scale * Y, mask=m_lp)
    slots_new = (hd + c + offs_l) % R  # append U: only this program reads or writes these columns
    tl.store(ru_ptr + b * ru_b + slots_new[:, None] * ru_r + h * ru_h + offs_p[None, :] * ru_p, U, mask=m_lp)


@triton.jit
def _append_kernel(rk_ptr, rg_ptr, head_ptr, count_ptr, win_ptr, k_ptr, g_ptr, L, R, H, G, N,
                   rk_b, rk_r, rk_g, rk_n, rg_b, rg_r, rg_h, k_b, k_l, k_g, k_n, g_b, g_l, g_h,
                   BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (b, s): token s's key (G, N) and gates (H,) into ring slot (head + count + s) % R of the window
    after the flush (read from ``win``); program (b, 0) moves head / count. Nothing in this launch reads
    head / count, so the move is race-free."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    hd = tl.load(win_ptr + 2 * b)
    c = tl.load(win_ptr + 2 * b + 1)
    slot = (hd + c + s) % R
    offs = tl.arange(0, BLOCK)
    for start in range(0, G * N, BLOCK):
        i = start + offs
        gg = i // N
        nn = i % N
        kv = tl.load(k_ptr + b * k_b + s * k_l + gg * k_g + nn * k_n, mask=i < G * N)
        tl.store(rk_ptr + b * rk_b + slot * rk_r + gg * rk_g + nn * rk_n, kv, mask=i < G * N)
    offs_h = tl.arange(0, BLOCK_H)
    gv = tl.load(g_ptr + b * g_b + s * g_l + offs_h * g_h, mask=offs_h < H, other=0.0).to(tl.float32)
    tl.store(rg_ptr + b * rg_b + slot * rg_r + offs_h * rg_h, gv, mask=offs_h < H)
    if s == 0:
        tl.store(head_ptr + b, hd.to(head_ptr.dtype.element_ty))
        tl.store(count_ptr + b, c.to(count_ptr.dtype.element_ty))


def _row_blocks(N: int, P: int, L: int) -> tuple[int, int]:
    """(BLOCK_P, num_warps) of the row-form state kernel, by hand (it writes S0 in place on flush steps: never
    autotuned). Measured on an H100, Qwen3.5-4B mixer (N = P = 128), batch 256, the replay steady state of
    bench/kernels_gdn.py (the ``sweep`` rows of replay_fig7_buffer re-time the decode launches and the
    ``replay-rows`` rows of replay_fig9_verify_cost the row form):
    - decode (L = 1): 16 columns x N = 128 (8 KB of fp32 state) at 4 warps, 317 / 342 us at R = 16 / 32,
      against 323 / 367 at 32 columns and 455 / 500 at 64 columns x 8 warps;
    - verify of L = 7: 32 columns x 2 warps 898-1251 us (at 16 x 2 about 1.45x slower still)."""
    if L > 1:
        return min(max(8, 4096 // triton.next_power_of_2(N)), 64, max(8, triton.next_power_of_2(P))), 2
    return min(16 if N >= 64 else 32, max(8, triton.next_power_of_2(P))), 4


def _verify_blocks(P: int) -> tuple[int, int, int, int]:
    """(BLOCK_P, num_warps, BLOCK_K, stages) of the GEMM-form kernel, by hand (it writes S0 in place on flush
    steps: never autotuned). Measured on an H100, Qwen3.5-4B mixer (N = P = 128), batch 256, L = 7, R = 32 /
    16, 0 and 6 accepted, in units of fla's fused recurrent decode step (439 us): 128 columns x 4 warps,
    16-row chunks 4 deep 0.77-0.91x / 0.82-1.16x; 32-row chunks 3 deep 0.84-0.99x / 0.88-1.23x; 64 columns x
    4 warps, 32 x 3 0.83-0.97x / 0.86-1.20x; 32 columns x 2 warps 0.86-1.00x / 0.87-1.23x; 32 x 4 warps
    1.03-1.20x; the whole tile in one load (the previous kernel's way) 1.18-1.36x / 1.22-1.63x."""
    return min(128, max(16, triton.next_power_of_2(P))), 4, 16, 4


def gdn_replay_verify_triton(S0: Tensor, ring_k: Tensor, ring_u: Tensor, ring_g: Tensor, head: Tensor, count: Tensor,
                             q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                             flush: Tensor | None = None, block_p: int | None = None,
                             num_warps: int | None = None, gemm: bool | None = None,
                             precision: str | None = None, split: bool | None = None,
                             window_warps: int | None = None, block_k: int | None = None,
                             num_stages: int | None = None) -> Tensor:
    """Triton form of ``gdn_replay_verify`` (see ``ssmspec.ops.gdn``); ``block_p`` / ``num_warps`` override
    the hand-picked launch of the state kernel, and ``block_k`` / ``num_stages`` the chunks of N and the
    pipeline depth of the GEMM form.

    ``split`` (default: for one-token calls) runs the decode as two launches, the window work of every head
    first and a state kernel that only streams its tile (``ops/gdn/replay_split.py``; ``window_warps`` is
    the first launch's; at R = 16 on an H100, batch 256, Qwen3.5-4B mixer: 246 us a step against 318 us
    fused); False runs a one-token call through the three launches of multi-token calls.
    ``gemm`` picks the form of multi-token calls: True streams the state through one kernel that runs the fold,
    the readout and the scores as GEMMs; False runs a scores launch, then a state kernel of rank-1 updates and
    column reductions; None (default) takes the GEMM form for 16-bit
    inputs of 2 or more tokens. One-token calls take the row form.
    ``precision`` is the tl.dot input precision of the GEMM form: default tf32 for 16-bit inputs (a 10-bit
    mantissa, 8x finer than the bf16 activations and the bf16 ring entries u; fla's chunk kernels multiply the
    state in bf16; the keys and queries, 16-bit values, multiply exactly) and tf32x3 (fp32-accurate) for fp32
    inputs."""
    bsz, L, H, P, G, N, R = check_replay_args(S0, ring_k, ring_u, ring_g, head, count, q, k, v, g, beta, flush)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("ring_k", ring_k), ("ring_u", ring_u)):
        check_float(name, t)
    half = v.dtype in (torch.bfloat16, torch.float16)
    if precision is None:
        precision = "tf32" if half else "tf32x3"
    if precision not in ("tf32", "tf32x3", "ieee"):
        raise ValueError(f"precision must be tf32, tf32x3 or ieee, got {precision!r}")
    if split is None:
        split = L == 1
    if split:
        if L != 1:
            raise ValueError(f"split=True is the one-token decode form; this call has L = {L} tokens "
                             f"(leave split=None, or pass split=False)")
        from ssmspec.ops.gdn.replay_split import decode_split
        return decode_split(S0, ring_k, ring_u, ring_g, head, count, q, k, v, g, beta, scale, flush, block_p,
                            num_warps, window_warps)
    dev = v.device
    win = torch.empty(bsz, 2, device=dev, dtype=torch.int32)  # (head, count) after the flush
    y = torch.empty_like(v)
    flag = flush if flush is not None else count  # bool is read as int1; None: the rule, decided in-kernel
    has_flush = flush is not None
    # default: the GEMM form for 16-bit inputs (H100, Qwen3.5-4B mixer, batch 256, R = 32, in units of one fla
    # decode step, rows / GEMM: L = 2 1.06-1.09x / 0.62-0.64x, L = 3 1.21-1.39x / 0.66-0.69x)
    gemm = (half if gemm is None else bool(gemm)) and L >= 2
    BR = max(16 if gemm else 2, triton.next_power_of_2(R))  # tl.dot needs >= 16 on every dimension
    BL = max(16 if gemm else 2, triton.next_power_of_2(L))
    BN = max(16, triton.next_power_of_2(N))
    strides = (*S0.stride(), *ring_k.stride(), *ring_u.stride(), *ring_g.stride(), *q.stride(), *k.stride(),
               *v.stride(), *g.stride(), *beta.stride(), *y.stride())
    kk_r = torch.empty(bsz, G, L, R, device=dev, dtype=torch.float32)  # k_j·k_s, ring entries j
    kq_r = torch.empty(bsz, G, L, R, device=dev, dtype=torch.float32)  # k_j·q_s
    kk_n = torch.empty(bsz, G, L, L, device=dev, dtype=torch.float32)  # k_t·k_s, the call's tokens t
    kq_n = torch.empty(bsz, G, L, L, device=dev, dtype=torch.float32)  # k_t·q_s
    _scores_kernel[(bsz, G)](ring_k, q, k, head, count, flag, kk_r, kq_r, kk_n, kq_n, win, L, R, N,
                             *ring_k.stride(), *q.stride(), *k.stride(), HAS_FLUSH=has_flush, BLOCK_R=BR,
                             BLOCK_L=BL, BLOCK_N=BN, num_warps=4 if BR * BN <= 4096 else 8)
    if gemm:
        bp, nw, bk, stages = _verify_blocks(P)
        bp, nw, bk, stages = block_p or bp, num_warps or nw, block_k or bk, num_stages or stages
        _verify_kernel[(triton.cdiv(P, bp), bsz, H)](
            S0, ring_k, ring_u, ring_g, head, count, flag, q, k, v, g, beta, kk_r, kq_r, kk_n, kq_n, y,
            default_scale(scale, N), L, R, N, P, H // G, *strides, HAS_FLUSH=has_flush, PRECISION=precision,
            INV_STEPS=max(0, (L - 1).bit_length() - 1), BLOCK_K=min(bk, BN), BLOCK_P=bp, BLOCK_R=BR, BLOCK_L=BL,
            STAGES=stages, num_warps=nw)
    else:
        bp, nw = _row_blocks(N, P, L)
        bp, nw = block_p or bp, num_warps or nw
        _main_kernel[(triton.cdiv(P, bp), bsz, H)](
            S0, ring_k, ring_u, ring_g, head, count, flag, q, k, v, g, beta, kk_r, kq_r, kk_n, kq_n, y,
            default_scale(scale, N), L, R, N, P, H // G, *strides,
            HAS_FLUSH=has_flush, BLOCK_N=BN, BLOCK_P=bp, BLOCK_R=BR, BLOCK_L=BL, num_warps=nw)
    _append_kernel[(bsz, L)](ring_k, ring_g, head, count, win, k, g, L, R, H, G, N,
                             *ring_k.stride(), *ring_g.stride(), *k.stride(), *g.stride(),
                             BLOCK=1024, BLOCK_H=max(2, triton.next_power_of_2(H)), num_warps=4)
    return y
