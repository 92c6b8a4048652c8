"""The split form of the GDN ReplaySSM decode call (seed 000, Alg. 6; maths in ``ops/gdn/naive.py``): the
window work of a one-token call in one launch per (sequence, value head), and a state kernel that does
nothing but stream its checkpoint tile (fold and store it on flush steps), read it out, and combine.

Why it splits: only S0ᵀk_s and S0ᵀq_s touch the state, and the call's output and correction are affine in
them (``_decode_window_kernel``). The fused form reads the window after the tile in the same program, so
its latency sits on every program's path; here the state kernel's programs are a streaming read of 128
columns x N at 4 warps, within 1.4x of a bare kernel that reads the same checkpoint with two reductions.

Races: launch 1 reads only the window after the flush and launch 2 only the window before it (the fold)
plus its own columns of ring_u, which it writes after its reads. Launch 1 appends the token's key and gate,
which nothing later in the call reads -- except the fold of a full ring (count = R on a flush), whose
oldest entry's slot the new one takes: launch 1 stashes that entry first and the fold reads the stash.

Multi-token calls keep the fused form (``ops/gdn/replay.py``). The same split for them -- Cu, Dy (L, P) and
the L x L maps M1, M2 in a window launch (U = Cu + M1·HK, Y = Dy + E∘HQ + M2·HK), the state kernel two
tensor-core readouts and two small GEMMs -- measured slower on an H100 at the Qwen3.5-4B mixer, batch 256,
L = 7, R = 32: 666-785 us a step against 657 us fused (window launch 280-390 us, state kernel 380 us with
tf32 readouts, 911 us with 14 fp32 column reductions), so it was not kept.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.gdn.naive import default_scale
from ssmspec.ops.replay.triton import _ring_slots, _window


@triton.jit
def _decode_window_kernel(rk_ptr, ru_ptr, rg_ptr, head_ptr, count_ptr, flush_ptr, q_ptr, k_ptr, v_ptr, g_ptr,
                          beta_ptr, cd_ptr, coef_ptr, win_ptr, kold_ptr, scale, R, N, P, heads_per_group,
                          rk_b, rk_r, rk_g, rk_n, ru_b, ru_r, ru_h, ru_p, rg_b, rg_r, rg_h,
                          q_b, q_g, q_n, k_b, k_g, k_n, v_b, v_h, v_p, g_b, g_h, be_b, be_h,
                          HAS_FLUSH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_P: tl.constexpr):
    """The split decode (L = 1), launch 1, one program per (sequence, value head): everything of the call
    that does not touch the state. With Γ = Σ_window g + g_s, w_j = exp(Γ − cum_j) and the ring sums
    A_k = Σ_j w_j (k_j·k_s) u_j, A_q = Σ_j w_j (k_j·q_s) u_j, the call is affine in the two readouts of the
    checkpoint, h_k = S0ᵀk_s and h_q = S0ᵀq_s:
        u_s = c + m1·h_k,   c = β(v_s − A_k),   m1 = −β e^Γ
        y_s = d + e·h_q + m2·h_k,   d = scale·(A_q + (k_s·q_s) c),   e = scale·e^Γ,   m2 = scale·(k_s·q_s) m1
    so c and d (P each, fp32) and (e, m1, m2) go to a scratch, and the state kernel's programs only stream
    their tile. Program (b, 0) records (flush, old head, old count, head, count) for launch 2.
    This launch also appends the token's gate (per head) and key (per group) at ring slot (head + count) % R
    of the window after the flush: it reads no slot outside that window, and launch 2 reads ring keys and
    gates only in the fold of the old window, which holds the new slot only when it is full (count = R on a
    flush). Then the oldest entry's gate and key are stashed first (coef[3], kold) and the fold reads them
    from there."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // heads_per_group
    f, h0, c0, hd, c = _window(head_ptr, count_ptr, flush_ptr, b, 1, R, HAS_FLUSH)
    if h == 0:
        tl.store(win_ptr + 5 * b, f)
        tl.store(win_ptr + 5 * b + 1, h0)
        tl.store(win_ptr + 5 * b + 2, c0)
        tl.store(win_ptr + 5 * b + 3, hd)
        tl.store(win_ptr + 5 * b + 4, c)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, BLOCK_P)
    mask_n = offs_n < N
    mask_p = offs_p < P
    live = offs_r < c
    slots = _ring_slots(hd, offs_r, R)
    Kr = tl.load(rk_ptr + b * rk_b + slots[:, None] * rk_r + grp * rk_g + offs_n[None, :] * rk_n,
                 mask=live[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_N)
    ks_raw = tl.load(k_ptr + b * k_b + grp * k_g + offs_n * k_n, mask=mask_n, other=0.0)
    ks = ks_raw.to(tl.float32)
    qs = tl.load(q_ptr + b * q_b + grp * q_g + offs_n * q_n, mask=mask_n, other=0.0).to(tl.float32)
    gr = tl.load(rg_ptr + b * rg_b + slots * rg_r + h * rg_h, mask=live, other=0.0)  # (BLOCK_R,)
    Ur = tl.load(ru_ptr + b * ru_b + slots[:, None] * ru_r + h * ru_h + offs_p[None, :] * ru_p,
                 mask=live[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_P)
    vs = tl.load(v_ptr + b * v_b + h * v_h + offs_p * v_p, mask=mask_p, other=0.0).to(tl.float32)
    gs_raw = tl.load(g_ptr + b * g_b + h * g_h)
    gs = gs_raw.to(tl.float32)
    bs = tl.load(beta_ptr + b * be_b + h * be_h).to(tl.float32)
    gam = tl.sum(gr, axis=0) + gs
    wr = tl.where(live, tl.exp(gam - tl.cumsum(gr, axis=0)), 0.0)
    kkr = tl.sum(Kr * ks[None, :], axis=1)
    kqr = tl.sum(Kr * qs[None, :], axis=1)
    kqn = tl.sum(ks * qs, axis=0)
    Ak = tl.sum((wr * kkr)[:, None] * Ur, axis=0)
    Aq = tl.sum((wr * kqr)[:, None] * Ur, axis=0)
    es = tl.exp(gam)
    cv = bs * (vs - Ak)
    m1 = -bs * es
    base = (b * tl.num_programs(1) + h) * 2 * P
    tl.store(cd_ptr + base + offs_p, cv, mask=mask_p)
    tl.store(cd_ptr + base + P + offs_p, scale * (Aq + kqn * cv), mask=mask_p)
    cb = (b * tl.num_programs(1) + h) * 4
    tl.store(coef_ptr + cb, scale * es)
    tl.store(coef_ptr + cb + 1, m1)
    tl.store(coef_ptr + cb + 2, scale * kqn * m1)
    slot = (hd + c) % R
    full = (f != 0) & (c0 == R)  # the new slot is the oldest entry of the window the fold reads: stash it
    if full:
        tl.store(coef_ptr + cb + 3, tl.load(rg_ptr + b * rg_b + slot * rg_r + h * rg_h))
    tl.store(rg_ptr + b * rg_b + slot * rg_r + h * rg_h, gs_raw)
    if h % heads_per_group == 0:
        if full:
            kold = tl.load(rk_ptr + b * rk_b + slot * rk_r + grp * rk_g + offs_n * rk_n, mask=mask_n)
            tl.store(kold_ptr + (b * (tl.num_programs(1) // heads_per_group) + grp) * N + offs_n, kold, mask=mask_n)
        tl.store(rk_ptr + b * rk_b + slot * rk_r + grp * rk_g + offs_n * rk_n, ks_raw, mask=mask_n)


@triton.jit
def _decode_state_kernel(S_ptr, rk_ptr, ru_ptr, rg_ptr, head_ptr, count_ptr, win_ptr, kold_ptr, q_ptr, k_ptr,
                         cd_ptr, coef_ptr, y_ptr, R, N, P, heads_per_group,
                         S_b, S_h, S_n, S_p, rk_b, rk_r, rk_g, rk_n, ru_b, ru_r, ru_h, ru_p, rg_b, rg_r, rg_h,
                         q_b, q_g, q_n, k_b, k_g, k_n, y_b, y_h, y_p,
                         BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """The split decode, launch 2, one program per (BLOCK_P columns, sequence, value head): the tile of S0,
    on flush steps the fold of the committed entries and the one state store, the two column reductions,
    y = d + e·h_q + m2·h_k and u = c + m1·h_k from launch 1's scratch, then u into this program's columns of
    ring_u (only this program reads or writes them) and, from program (0, b, 0), the moved head / count
    (nothing here reads them: the window comes from launch 1's record)."""
    pid_p = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    H = tl.num_programs(2)
    grp = h // heads_per_group
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_n = offs_n < N
    mask_p = offs_p < P
    mask = mask_n[:, None] & mask_p[None, :]
    s_ptrs = S_ptr + b * S_b + h * S_h + offs_n[:, None] * S_n + offs_p[None, :] * S_p
    # (BLOCK_N, BLOCK_P) the one state load; evict-first: no other program reads it
    S = tl.load(s_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    f = tl.load(win_ptr + 5 * b)
    ks = tl.load(k_ptr + b * k_b + grp * k_g + offs_n * k_n, mask=mask_n, other=0.0).to(tl.float32)
    qs = tl.load(q_ptr + b * q_b + grp * q_g + offs_n * q_n, mask=mask_n, other=0.0).to(tl.float32)
    base = (b * H + h) * 2 * P
    cv = tl.load(cd_ptr + base + offs_p, mask=mask_p, other=0.0)
    dv = tl.load(cd_ptr + base + P + offs_p, mask=mask_p, other=0.0)
    cb = (b * H + h) * 4
    e = tl.load(coef_ptr + cb)
    m1 = tl.load(coef_ptr + cb + 1)
    m2 = tl.load(coef_ptr + cb + 2)
    if f != 0:
        h0 = tl.load(win_ptr + 5 * b + 1)
        c0 = tl.load(win_ptr + 5 * b + 2)
        if c0 > 0:  # S0 <- exp(g_j)·S0 + k_j u_jᵀ over the committed entries, in order
            for j in range(0, c0):
                slot = (h0 + j) % R
                gj = tl.load(rg_ptr + b * rg_b + slot * rg_r + h * rg_h)
                kj = tl.load(rk_ptr + b * rk_b + slot * rk_r + grp * rk_g + offs_n * rk_n, mask=mask_n,
                             other=0.0).to(tl.float32)
                if j == 0 and c0 == R:  # overwritten by launch 1's append: its stash
                    gj = tl.load(coef_ptr + cb + 3)
                    kj = tl.load(kold_ptr + (b * (H // heads_per_group) + grp) * N + offs_n, mask=mask_n,
                                 other=0.0).to(tl.float32)
                uj = tl.load(ru_ptr + b * ru_b + slot * ru_r + h * ru_h + offs_p * ru_p, mask=mask_p,
                             other=0.0).to(tl.float32)
                S = S * tl.exp(gj) + kj[:, None] * uj[None, :]
            tl.store(s_ptrs, S, mask=mask)
    hk = tl.sum(S * ks[:, None], axis=0)  # (BLOCK_P,) S0ᵀk_s
    hq = tl.sum(S * qs[:, None], axis=0)  # (BLOCK_P,) S0ᵀq_s
    tl.store(y_ptr + b * y_b + h * y_h + offs_p * y_p, dv + e * hq + m2 * hk, mask=mask_p)
    hd = tl.load(win_ptr + 5 * b + 3)
    c = tl.load(win_ptr + 5 * b + 4)
    slot = (hd + c) % R
    tl.store(ru_ptr + b * ru_b + slot * ru_r + h * ru_h + offs_p * ru_p, cv + m1 * hk, mask=mask_p)
    if pid_p == 0 and h == 0:
        tl.store(head_ptr + b, hd.to(head_ptr.dtype.element_ty))
        tl.store(count_ptr + b, c.to(count_ptr.dtype.element_ty))


# warps of the split decode's window kernel (latency-bound: more programs resident win); the setting of
# _split_blocks' measurement with a 64 x 2 state launch: 1 warp 254 us a step, 2 warps 266, 4 warps 408
_WINDOW_WARPS = 1


def _split_blocks(N: int, P: int) -> tuple[int, int]:
    """(BLOCK_P, num_warps) of the split decode's state kernel (writes S0 on flush steps: tuned by hand): whole
    rows of up to 128 columns, 128 fp32 of the tile per thread. Measured on an H100, Qwen3.5-4B mixer
    (N = P = 128), batch 256, the replay steady state at R = 16 (us a step, both launches): 128 x 4 warps 246,
    64 x 2 254, 32 x 1 267, 32 x 4 272, 64 x 4 284, 16 x 2 286, 16 x 4 304, 128 x 2 551, 64 x 1 662; a bare
    kernel streaming the same 512 MB checkpoint with two column reductions took 179 us (3.0 TB/s). The fold
    as one tf32 GEMM over the committed window instead of rank-1 updates: 339 us at 64 x 2 (its registers)."""
    bp = min(128, max(16, triton.next_power_of_2(P)))
    return bp, max(1, min(8, bp * max(16, triton.next_power_of_2(N)) // 4096))


def decode_split(S0: Tensor, ring_k: Tensor, ring_u: Tensor, ring_g: Tensor, head: Tensor, count: Tensor,
                 q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
                 flush: Tensor | None, block_p: int | None, num_warps: int | None,
                 window_warps: int | None) -> Tensor:
    """The one-token call in two launches (see ``_decode_window_kernel``): a (B, H, 2, P) fp32 scratch of the
    affine terms, (B, H, 4) coefficients and the stashed oldest key (B, G, N), 2% of the state's bytes at
    P = 128, written and read once."""
    bsz, _, H, P = v.shape
    G, N, R = k.shape[2], k.shape[3], ring_k.shape[1]
    dev = v.device
    cd = torch.empty(bsz, H, 2, P, device=dev, dtype=torch.float32)
    coef = torch.empty(bsz, H, 4, device=dev, dtype=torch.float32)
    win = torch.empty(bsz, 5, device=dev, dtype=torch.int32)  # flush, old head, old count, head, count
    kold = torch.empty(bsz, G, N, device=dev, dtype=ring_k.dtype)  # the oldest key of a full ring on a flush
    y = torch.empty_like(v)
    flag = flush if flush is not None else count
    BN = max(16, triton.next_power_of_2(N))
    q1, k1, v1, g1, b1, y1 = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], y[:, 0]
    _decode_window_kernel[(bsz, H)](
        ring_k, ring_u, ring_g, head, count, flag, q1, k1, v1, g1, b1, cd, coef, win, kold, default_scale(scale, N),
        R, N, P, H // G, *ring_k.stride(), *ring_u.stride(), *ring_g.stride(), *q1.stride(), *k1.stride(),
        *v1.stride(), *g1.stride(), *b1.stride(),
        HAS_FLUSH=flush is not None, BLOCK_R=max(2, triton.next_power_of_2(R)), BLOCK_N=BN,
        BLOCK_P=max(16, triton.next_power_of_2(P)), num_warps=window_warps or _WINDOW_WARPS)
    bp, nw = _split_blocks(N, P)
    bp, nw = block_p or bp, num_warps or nw
    _decode_state_kernel[(triton.cdiv(P, bp), bsz, H)](
        S0, ring_k, ring_u, ring_g, head, count, win, kold, q1, k1, cd, coef, y1, R, N, P, H // G,
        *S0.stride(), *ring_k.stride(), *ring_u.stride(), *ring_g.stride(), *q1.stride(), *k1.stride(),
        *y1.stride(), BLOCK_N=BN, BLOCK_P=bp, num_warps=nw)
    return y

