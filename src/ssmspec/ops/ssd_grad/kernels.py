"""The Triton kernels of the trainable SSD scan (host code, layouts and the maths: ``triton.py``'s docstring).

``_fwd_save_kernel``: the forward of ``ops/ssd/triton.py``, one program per chain, that also saves the state
entering every ``ck_len`` tokens. ``_bwd_dstate_kernel``: the reverse carry of dS = dLoss/d(state) alone, one
program per (P block, sequence, head), saving dS leaving every ``dck_len`` tokens. ``_bwd_dx_kernel`` (one
program per tile and head) and ``_bwd_dbc_kernel`` (one per tile and group, over its heads): the input
gradients of one tile of BLOCK_T tokens from the saved state entering the tile and the saved dS leaving it
(``_tile_states``) -- independent programs, no carry between tiles.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmspec.ops.ssd.triton import _carry, _mm, _tile_xb


@triton.jit
def _fwd_save_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, s0_ptr, y_ptr, sf_ptr, st_ptr,
    L, P, N, heads_per_group, ck_len,
    x_b, x_l, x_h, x_p, dt_b, dt_l, dt_h, B_b, B_l, B_g, B_n, C_b, C_l, C_g, C_n,
    s0_b, s0_h, s0_p, s0_n, y_b, y_l, y_h, y_p, sf_b, sf_h, sf_p, sf_n, st_b, st_h, st_c, st_p,
    HAS_D: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The forward of ``ops/ssd/triton.py`` (one program per chain), plus the state entering every checkpoint."""
    pid_p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    offs_t = tl.arange(0, BLOCK_T)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :]
    A = tl.load(A_ptr + h).to(tl.float32)
    x_base = x_ptr + b * x_b + h * x_h
    dt_base = dt_ptr + b * dt_b + h * dt_h
    B_base = B_ptr + b * B_b + g * B_g
    C_base = C_ptr + b * C_b + g * C_g
    y_base = y_ptr + b * y_b + h * y_h
    st_base = st_ptr + b * st_b + h * st_h + offs_p[:, None] * st_p + offs_n[None, :]  # (BP, BN), N contiguous
    S = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    if HAS_INIT:
        S = tl.load(s0_ptr + b * s0_b + h * s0_h + offs_p[:, None] * s0_p + offs_n[None, :] * s0_n,
                    mask=mask_pn, other=0.0).to(tl.float32)
    causal = offs_t[:, None] >= offs_t[None, :]
    for t0 in range(0, L, BLOCK_T):
        if t0 % ck_len == 0:  # the state entering checkpoint t0 / ck_len
            tl.store(st_base + (t0 // ck_len).to(tl.int64) * st_c, S.to(st_ptr.dtype.element_ty), mask=mask_pn)
        tok, mask_t, dt, xt, Bt = _tile_xb(x_base, dt_base, B_base, t0, L, offs_t, offs_p, offs_n, mask_p, mask_n,
                                           x_l, x_p, dt_l, B_l, B_n)
        Ct = tl.load(C_base + tok[:, None] * C_l + offs_n[None, :] * C_n,
                     mask=mask_t[:, None] & mask_n[None, :], other=0.0).to(xt.dtype)  # (T, BN)
        cum = tl.cumsum(A * dt, axis=0)  # (T,)
        total = tl.sum(A * dt, axis=0)
        CB = _mm(Ct, tl.trans(Bt), PRECISION, UPCAST)  # (T, T)
        W = CB * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf"))) * dt[None, :]
        y = _mm(W.to(xt.dtype), xt, PRECISION, UPCAST)  # (T, BP)
        y += tl.exp(cum)[:, None] * _mm(Ct, tl.trans(S.to(Ct.dtype)), PRECISION, UPCAST)
        if HAS_D:
            y += tl.load(D_ptr + h).to(tl.float32) * xt.to(tl.float32)
        tl.store(y_base + tok[:, None] * y_l + offs_p[None, :] * y_p, y.to(y_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & mask_p[None, :])
        S = _carry(S, xt, Bt, dt, cum, total, PRECISION, UPCAST)
    tl.store(sf_ptr + b * sf_b + h * sf_h + offs_p[:, None] * sf_p + offs_n[None, :] * sf_n, S, mask=mask_pn)


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b (fp32 acc), as ``ops/ssd/triton.py:_mm`` (UPCAST: bf16 operands go in as fp32 on the CPU)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _rcarry(dS, dy_base, dt_base, C_base, r0, L, A, offs_t, offs_p, offs_n, mask_p, mask_n, dy_l, dy_p, dt_l, C_l,
            C_n, x_ptr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """dS <- exp(cum_T)·dS + Σ_t e_t dy_t C_tᵀ over the tile at r0 (dS leaving it -> dS entering it); dy·e
    rounded to the input dtype (x_ptr's) before the product. Tokens past L load dt = dy = C = 0 (no-ops)."""
    DTYPE = x_ptr.dtype.element_ty
    tok = r0 + offs_t
    mask_t = tok < L
    tok = tok.to(tl.int64)
    dt = tl.load(dt_base + tok * dt_l, mask=mask_t, other=0.0).to(tl.float32)
    dy = tl.load(dy_base + tok[:, None] * dy_l + offs_p[None, :] * dy_p, mask=mask_t[:, None] & mask_p[None, :],
                 other=0.0).to(DTYPE).to(tl.float32)
    Ct = tl.load(C_base + tok[:, None] * C_l + offs_n[None, :] * C_n, mask=mask_t[:, None] & mask_n[None, :],
                 other=0.0).to(DTYPE)
    cum = tl.cumsum(A * dt, axis=0)
    dye = (dy * tl.exp(cum)[:, None]).to(DTYPE)  # (T, BP)
    return dS * tl.exp(tl.sum(A * dt, axis=0)) + _mm(tl.trans(dye), Ct, PRECISION, UPCAST)


@triton.jit
def _bwd_dstate_kernel(
    x_ptr, dt_ptr, A_ptr, C_ptr, dy_ptr, dsf_ptr, dst_ptr, ds0_ptr,
    L, P, N, heads_per_group, dck_len,
    dt_b, dt_l, dt_h, C_b, C_l, C_g, C_n, dy_b, dy_l, dy_h, dy_p, dsf_b, dsf_h, dsf_p, dsf_n,
    dst_b, dst_h, dst_c, dst_p, ds0_b, ds0_h, ds0_p,
    HAS_DSF: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The reverse carry of one (P block, sequence b, head h) from the final state's gradient (zero when none):
    dstates[b, h, c] = dS leaving chunk c of ``dck_len`` tokens (the last chunk: leaving the sequence), and the
    initial state's gradient (dS entering token 0). x_ptr only names the input dtype."""
    pid_p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    offs_t = tl.arange(0, BLOCK_T)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :]
    A = tl.load(A_ptr + h).to(tl.float32)
    dt_base = dt_ptr + b * dt_b + h * dt_h
    dy_base = dy_ptr + b * dy_b + h * dy_h
    C_base = C_ptr + b * C_b + g * C_g
    dst_base = dst_ptr + b * dst_b + h * dst_h + offs_p[:, None] * dst_p + offs_n[None, :]
    dS = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    if HAS_DSF:
        dS = tl.load(dsf_ptr + b * dsf_b + h * dsf_h + offs_p[:, None] * dsf_p + offs_n[None, :] * dsf_n,
                     mask=mask_pn, other=0.0).to(tl.float32)
    n_tiles = tl.cdiv(L, BLOCK_T)
    for i in range(0, n_tiles):
        t0 = (n_tiles - 1 - i) * BLOCK_T
        if ((t0 + BLOCK_T) % dck_len == 0) | (i == 0):  # the last tile of its chunk: dS leaves the chunk here
            tl.store(dst_base + (t0 // dck_len).to(tl.int64) * dst_c, dS.to(dst_ptr.dtype.element_ty), mask=mask_pn)
        dS = _rcarry(dS, dy_base, dt_base, C_base, t0, L, A, offs_t, offs_p, offs_n, mask_p, mask_n, dy_l, dy_p,
                     dt_l, C_l, C_n, x_ptr, PRECISION, UPCAST)
    if HAS_INIT:
        tl.store(ds0_ptr + b * ds0_b + h * ds0_h + offs_p[:, None] * ds0_p + offs_n[None, :], dS, mask=mask_pn)


@triton.jit
def _state_in(x_base, dt_base, B_base, st_ptr, t0, L, A, ck_len, offs_t, offs_p, offs_n, mask_p, mask_n, x_l, x_p,
              dt_l, B_l, B_n, st_c, st_p, REPLAY: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr):
    """S entering the tile at t0, (BP, BN) fp32: the state checkpoint at or before the tile, replayed forward
    (``st_ptr``: the head's (P, N) block of checkpoint 0, rows ``st_p`` apart, N contiguous). REPLAY False:
    a checkpoint every tile, no replay loop compiled (a loop adds registers: its loads' addresses)."""
    S = tl.load(st_ptr + (t0 // ck_len).to(tl.int64) * st_c + offs_p[:, None] * st_p + offs_n[None, :],
                mask=mask_p[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    if REPLAY:
        for r0 in range((t0 // ck_len) * ck_len, t0, BLOCK_T):
            _, _, dtr, xr, Br = _tile_xb(x_base, dt_base, B_base, r0, L, offs_t, offs_p, offs_n, mask_p, mask_n,
                                         x_l, x_p, dt_l, B_l, B_n)
            S = _carry(S, xr, Br, dtr, tl.cumsum(A * dtr, axis=0), tl.sum(A * dtr, axis=0), PRECISION, UPCAST)
    return S


@triton.jit
def _dstate_out(dy_base, dt_base, C_base, dst_ptr, t0, L, A, dck_len, offs_t, offs_p, offs_n, mask_p, mask_n, dy_l,
                dy_p, dt_l, C_l, C_n, dst_c, st_p, x_ptr, REPLAY: tl.constexpr, BLOCK_T: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """dS leaving the tile at t0, (BP, BN) fp32: the dS checkpoint at or after the tile, replayed backward
    (the last checkpoint is the sequence's end, past which tiles load nothing)."""
    dc = t0 // dck_len
    dS = tl.load(dst_ptr + dc.to(tl.int64) * dst_c + offs_p[:, None] * st_p + offs_n[None, :],
                 mask=mask_p[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    if REPLAY:
        top = tl.minimum((dc + 1) * dck_len, tl.cdiv(L, BLOCK_T) * BLOCK_T)  # end of the dS chunk's last tile
        for k in range(0, (top - t0) // BLOCK_T - 1):
            dS = _rcarry(dS, dy_base, dt_base, C_base, top - (k + 1) * BLOCK_T, L, A, offs_t, offs_p, offs_n, mask_p,
                         mask_n, dy_l, dy_p, dt_l, C_l, C_n, x_ptr, PRECISION, UPCAST)
    return dS


@triton.jit
def _bwd_dx_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, st_ptr, dst_ptr, dy_ptr, dx_ptr, ddt_ptr, dA_ptr, dD_ptr,
    L, P, N, heads_per_group, ck_len, dck_len,
    x_b, x_l, x_h, x_p, dt_b, dt_l, dt_h, B_b, B_l, B_g, B_n, C_b, C_l, C_g, C_n, st_b, st_h, st_c, st_p,
    dst_b, dst_h, dst_c, dy_b, dy_l, dy_h, dy_p, dx_b, dx_l, dx_h, dx_p, ddt_b, ddt_l, ddt_h, part_b, part_t,
    HAS_D: tl.constexpr, REPLAY_S: tl.constexpr, REPLAY_DS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (tile, head h, sequence b): dx and d dt of the tile, its dA and dD partials (``triton.py``)."""
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    t0 = tile * BLOCK_T
    offs_t = tl.arange(0, BLOCK_T)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    DTYPE = x_ptr.dtype.element_ty
    A = tl.load(A_ptr + h).to(tl.float32)
    x_base = x_ptr + b * x_b + h * x_h
    dt_base = dt_ptr + b * dt_b + h * dt_h
    dy_base = dy_ptr + b * dy_b + h * dy_h
    B_base = B_ptr + b * B_b + g * B_g
    C_base = C_ptr + b * C_b + g * C_g
    S = _state_in(x_base, dt_base, B_base, st_ptr + b * st_b + h * st_h, t0, L, A, ck_len, offs_t, offs_p, offs_n,
                  mask_p, mask_n, x_l, x_p, dt_l, B_l, B_n, st_c, st_p, REPLAY_S, BLOCK_T, PRECISION, UPCAST)
    dS = _dstate_out(dy_base, dt_base, C_base, dst_ptr + b * dst_b + h * dst_h, t0, L, A, dck_len, offs_t, offs_p,
                     offs_n, mask_p, mask_n, dy_l, dy_p, dt_l, C_l, C_n, dst_c, st_p, x_ptr, REPLAY_DS, BLOCK_T,
                     PRECISION, UPCAST)
    sdS = tl.sum(tl.sum(dS * S, axis=1), axis=0)  # <dS, S>, then only the rounded states are used
    S_lo = S.to(DTYPE)
    dS_lo = dS.to(DTYPE)
    tok, mask_t, dt, xt, Bt = _tile_xb(x_base, dt_base, B_base, t0, L, offs_t, offs_p, offs_n, mask_p, mask_n,
                                       x_l, x_p, dt_l, B_l, B_n)
    mask_tp = mask_t[:, None] & mask_p[None, :]
    Ct = tl.load(C_base + tok[:, None] * C_l + offs_n[None, :] * C_n, mask=mask_t[:, None] & mask_n[None, :],
                 other=0.0).to(DTYPE)
    dyt = tl.load(dy_base + tok[:, None] * dy_l + offs_p[None, :] * dy_p, mask=mask_tp, other=0.0).to(DTYPE)
    cum = tl.cumsum(A * dt, axis=0)  # (T,)
    total = tl.sum(A * dt, axis=0)  # cum_T (tokens past L have dt = 0)
    e = tl.exp(cum)
    w0 = tl.exp(total - cum)  # decay from token j to the tile's end; w = w0·dt
    w = w0 * dt
    # the state's terms: w_j·(dS B_j) in dx, x_j·(dS B_j) and C_t·(dy_t S) in d cum
    BdS = _mm(Bt, tl.trans(dS_lo), PRECISION, UPCAST)  # (T, BP) dS B_j
    u = tl.sum(xt.to(tl.float32) * BdS, axis=1)
    dx = w[:, None] * BdS
    cs = tl.sum(dyt.to(tl.float32) * _mm(Ct, tl.trans(S_lo), PRECISION, UPCAST), axis=1)  # dy_t·(S C_t)
    if HAS_D:
        dx += tl.load(D_ptr + h).to(tl.float32) * dyt.to(tl.float32)
        tl.store(dD_ptr + b * part_b + tile * part_t + h,
                 tl.sum(tl.sum(dyt.to(tl.float32) * xt.to(tl.float32), axis=1), axis=0))
    # the (T, T) blocks
    M = tl.exp(tl.where(offs_t[:, None] >= offs_t[None, :], cum[:, None] - cum[None, :], float("-inf")))
    CBM = _mm(Ct, tl.trans(Bt), PRECISION, UPCAST) * M  # M_tj·(C_t·B_j), 0 above the diagonal
    Rp = CBM * _mm(dyt, tl.trans(xt), PRECISION, UPCAST)  # R_tj / dt_j
    r_col = tl.sum(Rp, axis=0)  # Σ_t R_tj / dt_j
    r_row = tl.sum(Rp * dt[None, :], axis=1)  # Σ_j R_tj
    dx = _mma(tl.trans((CBM * dt[None, :]).to(DTYPE)), dyt, dx, PRECISION, UPCAST)  # + Wᵀ dy
    tl.store(dx_ptr + b * dx_b + h * dx_h + tok[:, None] * dx_l + offs_p[None, :] * dx_p,
             dx.to(dx_ptr.dtype.element_ty), mask=mask_tp)
    U = w * u
    dcum = e * cs + r_row - r_col * dt - U
    da = tl.sum(dcum, axis=0) - tl.cumsum(dcum, axis=0) + dcum + tl.exp(total) * sdS + tl.sum(U, axis=0)
    tl.store(ddt_ptr + b * ddt_b + h * ddt_h + tok * ddt_l, r_col + w0 * u + A * da, mask=mask_t)
    tl.store(dA_ptr + b * part_b + tile * part_t + h, tl.sum(dt * da, axis=0))


@triton.jit
def _bwd_dbc_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, st_ptr, dst_ptr, dy_ptr, dB_ptr, dC_ptr, zero_ptr,
    L, P, N, heads_per_group, heads_per_prog, n_sub, ck_len, dck_len,
    x_b, x_l, x_h, x_p, dt_b, dt_l, dt_h, B_b, B_l, B_g, B_n, C_b, C_l, C_g, C_n, st_b, st_h, st_c, st_p,
    dst_b, dst_h, dst_c, dy_b, dy_l, dy_h, dy_p, bc_s, bc_b, bc_l, bc_g,
    ATOMIC_BC: tl.constexpr, REPLAY_S: tl.constexpr, REPLAY_DS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (tile x head subset, group g, sequence b): dB and dC of the tile summed over the subset's
    heads_per_prog heads, Σ_h [Z_h B | Z_hᵀ C + the state terms]. Three passes over the heads, so that the
    (T, T) sum, a replayed S and a replayed dS are never live together: Σ_h Z_h, then its two products with B
    and C (made once), then Σ_h e∘(dy_h S_h), then Σ_h w∘(x_h dS_h) (the second reads of x, dy, dt hit the
    caches). Stored to slot ``sub`` of dB / dC (``bc_s`` apart) in their dtype, or added with fp32 atomics
    (ATOMIC_BC). ``zero_ptr`` holds heads_per_prog int32 zeros: added to each head's token and P offsets, they
    keep the compiler from hoisting the loops' (T, P) and (P, N) address tensors out of them, where they stayed
    live in registers. ptxas (Triton 3.6, sm_90, 64-token tiles, 8 warps): no spill at N = 64 with replays,
    0.5 KB at N = 128 with replays, none without; one pass over the heads spilled 1.4 KB at N = 128."""
    pid = tl.program_id(0)
    tile = pid // n_sub
    sub = pid % n_sub
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    t0 = tile * BLOCK_T
    offs_t = tl.arange(0, BLOCK_T)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    DTYPE = x_ptr.dtype.element_ty
    B_base = B_ptr + b * B_b + g * B_g
    C_base = C_ptr + b * C_b + g * C_g
    tok = t0 + offs_t
    mask_tn = (tok < L)[:, None] & mask_n[None, :]
    tok = tok.to(tl.int64)
    # two passes over the heads, so that the (T, T) sum and the states are never live together: first Σ_h Z_h
    # and its products with B and C, then the state terms added onto them
    Zs = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    for i in range(0, heads_per_prog):
        h = g * heads_per_group + sub * heads_per_prog + i
        zero = tl.load(zero_ptr + i)
        A = tl.load(A_ptr + h).to(tl.float32)
        tokv = t0 + zero + offs_t
        mask_t = tokv < L
        tokv = tokv.to(tl.int64)
        mask_tp = mask_t[:, None] & mask_p[None, :]
        dt = tl.load(dt_ptr + b * dt_b + h * dt_h + tokv * dt_l, mask=mask_t, other=0.0).to(tl.float32)
        xt = tl.load(x_ptr + b * x_b + h * x_h + tokv[:, None] * x_l + offs_p[None, :] * x_p, mask=mask_tp,
                     other=0.0).to(DTYPE)
        dyt = tl.load(dy_ptr + b * dy_b + h * dy_h + tokv[:, None] * dy_l + offs_p[None, :] * dy_p, mask=mask_tp,
                      other=0.0).to(DTYPE)
        cum = tl.cumsum(A * dt, axis=0)
        M = tl.exp(tl.where((offs_t + zero)[:, None] >= offs_t[None, :], cum[:, None] - cum[None, :], float("-inf")))
        Zs += M * _mm(dyt, tl.trans(xt), PRECISION, UPCAST) * dt[None, :]  # Z_tj = M_tj dt_j (dy_t·x_j)
    Zlo = Zs.to(DTYPE)
    Bt = tl.load(B_base + tok[:, None] * B_l + offs_n[None, :] * B_n, mask=mask_tn, other=0.0).to(DTYPE)
    Ct = tl.load(C_base + tok[:, None] * C_l + offs_n[None, :] * C_n, mask=mask_tn, other=0.0).to(DTYPE)
    dC = _mm(Zlo, Bt, PRECISION, UPCAST)  # Σ_h Z_h B
    dB = _mm(tl.trans(Zlo), Ct, PRECISION, UPCAST)  # Σ_h Z_hᵀ C
    for i in range(0, heads_per_prog):  # + Σ_h e∘(dy_h S_h), S_h replayed
        h = g * heads_per_group + sub * heads_per_prog + i
        zero = tl.load(zero_ptr + i)
        A = tl.load(A_ptr + h).to(tl.float32)
        dt_base = dt_ptr + b * dt_b + h * dt_h
        S = _state_in(x_ptr + b * x_b + h * x_h, dt_base, B_base, st_ptr + b * st_b + h * st_h, t0, L, A, ck_len,
                      offs_t, offs_p + zero, offs_n, mask_p, mask_n, x_l, x_p, dt_l, B_l, B_n, st_c, st_p, REPLAY_S,
                      BLOCK_T, PRECISION, UPCAST).to(DTYPE)
        tokv = t0 + zero + offs_t
        mask_t = tokv < L
        tokv = tokv.to(tl.int64)
        dt = tl.load(dt_base + tokv * dt_l, mask=mask_t, other=0.0).to(tl.float32)
        dyt = tl.load(dy_ptr + b * dy_b + h * dy_h + tokv[:, None] * dy_l + offs_p[None, :] * dy_p,
                      mask=mask_t[:, None] & mask_p[None, :], other=0.0).to(DTYPE).to(tl.float32)
        dC = _mma((dyt * tl.exp(tl.cumsum(A * dt, axis=0))[:, None]).to(DTYPE), S, dC, PRECISION, UPCAST)
    for i in range(0, heads_per_prog):  # + Σ_h w∘(x_h dS_h), dS_h replayed
        h = g * heads_per_group + sub * heads_per_prog + i
        zero = tl.load(zero_ptr + i)
        A = tl.load(A_ptr + h).to(tl.float32)
        dt_base = dt_ptr + b * dt_b + h * dt_h
        dS = _dstate_out(dy_ptr + b * dy_b + h * dy_h, dt_base, C_base, dst_ptr + b * dst_b + h * dst_h, t0, L, A,
                         dck_len, offs_t, offs_p + zero, offs_n, mask_p, mask_n, dy_l, dy_p, dt_l, C_l, C_n, dst_c,
                         st_p, x_ptr, REPLAY_DS, BLOCK_T, PRECISION, UPCAST).to(DTYPE)
        tokv = t0 + zero + offs_t
        mask_t = tokv < L
        tokv = tokv.to(tl.int64)
        dt = tl.load(dt_base + tokv * dt_l, mask=mask_t, other=0.0).to(tl.float32)
        xt = tl.load(x_ptr + b * x_b + h * x_h + tokv[:, None] * x_l + offs_p[None, :] * x_p,
                     mask=mask_t[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
        cum = tl.cumsum(A * dt, axis=0)
        w = tl.exp(tl.sum(A * dt, axis=0) - cum) * dt
        dB = _mma((xt * w[:, None]).to(DTYPE), dS, dB, PRECISION, UPCAST)
    off = b * bc_b + g * bc_g + tok[:, None] * bc_l + offs_n[None, :]
    if ATOMIC_BC:
        tl.atomic_add(dB_ptr + off, dB, mask=mask_tn)
        tl.atomic_add(dC_ptr + off, dC, mask=mask_tn)
    else:
        tl.store(dB_ptr + sub.to(tl.int64) * bc_s + off, dB.to(dB_ptr.dtype.element_ty), mask=mask_tn)
        tl.store(dC_ptr + sub.to(tl.int64) * bc_s + off, dC.to(dC_ptr.dtype.element_ty), mask=mask_tn)
