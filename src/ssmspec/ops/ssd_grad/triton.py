"""The backward of the one-kernel SSD scan (seed 004, "Forward + Backward"): one reverse scan over the sequence.

Forward (``_fwd_save_kernel``): the tile loop of ``ops/ssd/triton.py`` -- one program per chain (sequence b,
head h, BLOCK_P rows of P), the fp32 state S (BP, N) carried in registers from tile to tile -- that also
stores the state entering every ``checkpoint`` tokens into ``states`` (B, H, cdiv(L, checkpoint), P, N) fp32.
Seed 004's sequential variant saves one state per tile boundary and replays from it; we save one per
checkpoint (a whole number of forward tiles, by default so that the states take no more bytes than x) and the
backward replays the carry from it to the tile it needs. Saving in the forward rather than recomputing every
state in the backward: a training forward is always followed by its backward, and the states leave the
forward's registers anyway, so writing one every few tiles costs at most one more x-sized write; a
recomputing backward would read x, B and dt one more time and still have to materialize the states before its
reverse scan (they are needed in the reverse order they are made). mamba_ssm's combined scan recomputes its
chunk states in its backward (two more launches); with checkpoints of ``checkpoint`` tokens our replay is a
few carries per checkpoint inside the backward kernel, no extra launch.

Backward (``_bwd_kernel``): one program per chain walks the tiles from the last to the first, carrying
dS = dLoss/d(state leaving the tile), (BP, N) fp32, from the final state's gradient (zero when none). Per tile
of T tokens, with S the state entering it (the checkpoint, replayed forward through the tiles between),
cum_t = Σ_{i<=t} A·dt_i, e_t = exp(cum_t), M_tj = exp(cum_t - cum_j) for j <= t (0 above), w_j = exp(cum_T -
cum_j)·dt_j, and the forward maths of ``ops/ssd/triton.py`` (y_t = e_t·S C_t + Σ_j M_tj dt_j (C_t·B_j) x_j +
D x_t, S' = exp(cum_T) S + Σ_j w_j x_j B_jᵀ), the chain rule gives, every product a ``tl.dot``:

    dx_j  = Σ_t M_tj dt_j (C_t·B_j) dy_t + D dy_j + w_j·(dS B_j)                  Wᵀ dy + D dy + w ∘ (B dSᵀ)
    Z_tj  = M_tj dt_j (dy_t·x_j)                                                   (T, T)
    dC_t  = e_t·(dy_t S) + Σ_j Z_tj B_j,   dB_j = Σ_t Z_tj C_t + w_j·(x_j dS)
    dS_in = exp(cum_T)·dS + Σ_t e_t dy_t C_tᵀ                                      the carry of the reverse scan
    dD    = Σ_t dy_t·x_t
    d cum_t = e_t dy_t·(S C_t) + Σ_j R_tj - Σ_i R_it - U_t  (+ exp(cum_T)<dS, S> + Σ_j U_j at the last token)
              with R_tj = M_tj dt_j (C_t·B_j)(dy_t·x_j), U_j = w_j x_j·(dS B_j)
    d a_i = Σ_{t>=i} d cum_t (a_i = A·dt_i),   d dt_i = Σ_t R_ti / dt_i + U_i / dt_i + A·d a_i,   dA = Σ_i dt_i d a_i

(the two quotients are computed without the division). Every term is linear in the P rows, so a chain of one
P block adds its share: dB, dC (B, L, G, N) and d dt (B, L, H) accumulate in fp32 with atomics where heads of a
group or P blocks share them, dA and dD (H,) with one atomic per program. The gradient of the initial state is
dS_in after the first tile.

Precision as in the forward: dot operands in the input dtype with fp32 accumulation (bf16 / fp16: the weights,
the states and dy·e rounded to that dtype before the tensor-core products), tf32x3 for fp32 inputs; decays,
cumulative sums, the carried dS and every accumulator fp32.

Block sizes are launch options, not autotuned (the kernels write their outputs, and the atomics accumulate:
an autotuner's repeated launches would add twice). ``_bwd_plan`` holds defaults chosen from register counts,
not yet measured on a GPU (the ``ssd_kernel_fwdbwd`` experiment times them).
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from ssmspec.ops.dispatch import interpret_mode
from ssmspec.ops.ssd.naive import check_ssd_shapes
from ssmspec.ops.ssd.triton import _blocks, _carry, _check_block, _fallbacks, _mm, _tile_xb
from ssmspec.ops.triton_common import check_float, dummy

log = logging.getLogger("ssmspec.ops.ssd_grad")


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
            tl.store(st_base + (t0 // ck_len).to(tl.int64) * st_c, S, mask=mask_pn)
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
def _bwd_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, st_ptr, dy_ptr, dsf_ptr,
    dx_ptr, ddt_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, ds0_ptr,
    L, P, N, heads_per_group, ck_len,
    x_b, x_l, x_h, x_p, dt_b, dt_l, dt_h, B_b, B_l, B_g, B_n, C_b, C_l, C_g, C_n, st_b, st_h, st_c, st_p,
    dy_b, dy_l, dy_h, dy_p, dsf_b, dsf_h, dsf_p, dsf_n, dx_b, dx_l, dx_h, dx_p, ddt_b, ddt_l, ddt_h,
    dB_b, dB_l, dB_g, ds0_b, ds0_h, ds0_p,
    HAS_D: tl.constexpr, HAS_DSF: tl.constexpr, HAS_INIT: tl.constexpr, ATOMIC_BC: tl.constexpr,
    ATOMIC_DT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Reverse scan of one chain over its tiles (module docstring). dB / dC share one contiguous (B, L, G, N)
    layout (N contiguous), states are (B, H, checkpoints, P, N) contiguous, ds0 (B, H, P, N) contiguous."""
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
    Dh = 0.0
    if HAS_D:
        Dh = tl.load(D_ptr + h).to(tl.float32)
    x_base = x_ptr + b * x_b + h * x_h
    dt_base = dt_ptr + b * dt_b + h * dt_h
    B_base = B_ptr + b * B_b + g * B_g
    C_base = C_ptr + b * C_b + g * C_g
    st_base = st_ptr + b * st_b + h * st_h + offs_p[:, None] * st_p + offs_n[None, :]
    dS = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)  # dLoss / d(state leaving the current tile)
    if HAS_DSF:
        dS = tl.load(dsf_ptr + b * dsf_b + h * dsf_h + offs_p[:, None] * dsf_p + offs_n[None, :] * dsf_n,
                     mask=mask_pn, other=0.0).to(tl.float32)
    causal = offs_t[:, None] >= offs_t[None, :]
    dA_acc = 0.0
    dD_acc = 0.0
    n_tiles = tl.cdiv(L, BLOCK_T)
    for i in range(0, n_tiles):
        t0 = (n_tiles - 1 - i) * BLOCK_T
        ck0 = (t0 // ck_len) * ck_len  # the checkpoint at or before the tile; replay the carry from it
        S = tl.load(st_base + (t0 // ck_len).to(tl.int64) * st_c, mask=mask_pn, other=0.0)  # (BP, BN) fp32
        for r0 in range(ck0, t0, BLOCK_T):
            _, _, dtr, xr, Br = _tile_xb(x_base, dt_base, B_base, r0, L, offs_t, offs_p, offs_n, mask_p, mask_n,
                                         x_l, x_p, dt_l, B_l, B_n)
            S = _carry(S, xr, Br, dtr, tl.cumsum(A * dtr, axis=0), tl.sum(A * dtr, axis=0), PRECISION, UPCAST)
        tok, mask_t, dt, xt, Bt = _tile_xb(x_base, dt_base, B_base, t0, L, offs_t, offs_p, offs_n, mask_p, mask_n,
                                           x_l, x_p, dt_l, B_l, B_n)
        mask_tn = mask_t[:, None] & mask_n[None, :]
        mask_tp = mask_t[:, None] & mask_p[None, :]
        Ct = tl.load(C_base + tok[:, None] * C_l + offs_n[None, :] * C_n, mask=mask_tn, other=0.0).to(xt.dtype)
        dyt = tl.load(dy_ptr + b * dy_b + h * dy_h + tok[:, None] * dy_l + offs_p[None, :] * dy_p, mask=mask_tp,
                      other=0.0).to(xt.dtype)  # (T, BP)
        cum = tl.cumsum(A * dt, axis=0)  # (T,)
        total = tl.sum(A * dt, axis=0)  # cum_T (tokens past L have dt = 0)
        e = tl.exp(cum)  # (T,)
        w0 = tl.exp(total - cum)  # (T,) decay from token j to the tile's end; w = w0·dt
        S_lo = S.to(xt.dtype)
        dS_lo = dS.to(xt.dtype)
        # the (T, T) blocks first, reduced as soon as they are made (they dominate the registers)
        M = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))  # (T, T), 0 above the diagonal
        CB = _mm(Ct, tl.trans(Bt), PRECISION, UPCAST) * M  # (T, T) M_tj·(C_t·B_j)
        dyx = _mm(dyt, tl.trans(xt), PRECISION, UPCAST)  # (T, T) dy_t·x_j
        Rp = CB * dyx  # (T, T) R_tj / dt_j
        r_col = tl.sum(Rp, axis=0)  # (T,) Σ_t R_tj / dt_j: the direct part of d dt_j
        r_row = tl.sum(Rp * dt[None, :], axis=1)  # (T,) Σ_j R_tj
        dx = _mm(tl.trans((CB * dt[None, :]).to(xt.dtype)), dyt, PRECISION, UPCAST)  # (T, BP) Wᵀ dy
        Z = (M * dyx * dt[None, :]).to(xt.dtype)  # (T, T)
        dC = _mm(Z, Bt, PRECISION, UPCAST) + e[:, None] * _mm(dyt, S_lo, PRECISION, UPCAST)  # (T, BN)
        dB = _mm(tl.trans(Z), Ct, PRECISION, UPCAST)  # (T, BN), the state's term below
        # the state's terms: w_j·(dS B_j) in dx, w_j·(x_j dS) in dB; the skip D·dy
        BdS = _mm(Bt, tl.trans(dS_lo), PRECISION, UPCAST)  # (T, BP) dS B_j
        dx += (w0 * dt)[:, None] * BdS
        dB += (w0 * dt)[:, None] * _mm(xt, dS_lo, PRECISION, UPCAST)
        if HAS_D:
            dx += Dh * dyt.to(tl.float32)
            dD_acc += tl.sum(tl.sum(dyt.to(tl.float32) * xt.to(tl.float32), axis=1), axis=0)
        tl.store(dx_ptr + b * dx_b + h * dx_h + tok[:, None] * dx_l + offs_p[None, :] * dx_p,
                 dx.to(dx_ptr.dtype.element_ty), mask=mask_tp)
        bc_off = b * dB_b + g * dB_g + tok[:, None] * dB_l + offs_n[None, :]
        if ATOMIC_BC:
            tl.atomic_add(dB_ptr + bc_off, dB, mask=mask_tn)
            tl.atomic_add(dC_ptr + bc_off, dC, mask=mask_tn)
        else:
            tl.store(dB_ptr + bc_off, dB, mask=mask_tn)
            tl.store(dC_ptr + bc_off, dC, mask=mask_tn)
        # d cum, then d a by a reverse cumulative sum, d dt and dA
        CS = _mm(Ct, tl.trans(S_lo), PRECISION, UPCAST)  # (T, BP) S C_t
        u = tl.sum(xt.to(tl.float32) * BdS, axis=1)  # (T,) x_j·(dS B_j)
        U = w0 * dt * u  # (T,)
        dcum = e * tl.sum(dyt.to(tl.float32) * CS, axis=1) + r_row - r_col * dt - U
        dtotal = tl.exp(total) * tl.sum(tl.sum(dS * S, axis=1), axis=0) + tl.sum(U, axis=0)
        da = tl.sum(dcum, axis=0) - tl.cumsum(dcum, axis=0) + dcum + dtotal  # (T,) Σ_{t>=i} d cum_t
        ddt = r_col + w0 * u + A * da
        dA_acc += tl.sum(dt * da, axis=0)
        ddt_ptrs = ddt_ptr + b * ddt_b + h * ddt_h + tok * ddt_l
        if ATOMIC_DT:
            tl.atomic_add(ddt_ptrs, ddt, mask=mask_t)
        else:
            tl.store(ddt_ptrs, ddt, mask=mask_t)
        # the reverse carry: dS entering the tile
        dye = (dyt.to(tl.float32) * e[:, None]).to(xt.dtype)  # (T, BP)
        dS = dS * tl.exp(total) + _mm(tl.trans(dye), Ct, PRECISION, UPCAST)
    if HAS_INIT:
        tl.store(ds0_ptr + b * ds0_b + h * ds0_h + offs_p[:, None] * ds0_p + offs_n[None, :], dS, mask=mask_pn)
    tl.atomic_add(dA_ptr + h, dA_acc)
    if HAS_D:
        tl.atomic_add(dD_ptr + h, dD_acc)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def default_launch(L: int, P: int, N: int, *, itemsize: int, chains: int = 1, sms: int = 0) -> dict:
    """The launch options of a call that gives none (``chains``: batch x heads; ``sms``: the GPU's SMs, 0 on CPU).

    Forward: ``ops/ssd/triton.py:_blocks`` (seed 004's 128-token tiles at 8 warps; one program per chain).
    Backward: 64-token tiles (a tile holds about twice the forward's live (T, T) and (T, N) blocks, so half the
    forward's tile keeps them in registers), all of P up to 64 rows, halved (down to 16) while there are fewer
    programs than SMs (seed 004's 16 x 8 chains on 132 SMs: 32 rows, 256 programs); 8 warps once a
    program holds a 64 x 128 state block twice (S and dS), 4 below. Checkpoints: the fewest tokens, a whole
    number of both tiles, at which the fp32 states take no more bytes than x (4·N / itemsize tokens: N = 128
    in bf16 saves every 256 tokens). Register counts, not GPU measurements: ``ssd_kernel_fwdbwd`` times them."""
    bt_f, bp_f, nw_f = _blocks(L, P, N)
    bt = min(64, max(16, triton.next_power_of_2(max(L, 1))))
    bp = min(64, max(16, triton.next_power_of_2(P)))
    while sms and bp > 16 and chains * -(-P // bp) < sms:
        bp //= 2
    bn = max(16, triton.next_power_of_2(N))
    nw = 8 if bp * bn >= 64 * 128 else 4
    ck = max(bt_f, bt, triton.next_power_of_2(-(-4 * N // itemsize)))
    return dict(fwd_block_t=bt_f, fwd_block_p=bp_f, fwd_num_warps=nw_f, block_t=bt, block_p=bp, num_warps=nw,
                checkpoint=ck)


def _launch(kernel, grid, args: tuple, consts: dict, bt: int, nw: int, stages: int, step_down: bool) -> None:
    """Launch at (BLOCK_T, num_warps, num_stages); with ``step_down`` (no option given) a GPU that cannot hold
    them (Triton's OutOfResources at the first launch) gets ``ops/ssd/triton.py:_fallbacks``: one stage fewer,
    then halved tiles, which still divide the checkpoint. Options given are launched as given."""
    tries = _fallbacks(bt, nw, stages) if step_down else [(bt, nw, stages)]
    for i, (t, w, st) in enumerate(tries):
        try:
            kernel[grid](*args, **consts, BLOCK_T=t, num_warps=w, num_stages=st)
            return
        except OutOfResources:
            if i == len(tries) - 1:
                raise
            log.warning("%s: BLOCK_T=%d, %d warps, %d stages do not fit this GPU; trying %s", getattr(kernel, "fn", kernel).__name__,
                        t, w, st, tries[i + 1])


def _consts(x: Tensor) -> dict:
    return dict(PRECISION="tf32x3" if x.dtype == torch.float32 else "tf32",
                UPCAST=interpret_mode() and x.dtype == torch.bfloat16)


def ssd_forward_save(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
                     s0: Tensor | None, *, launch: dict) -> tuple[Tensor, Tensor, Tensor]:
    """The scan's y (B, L, H, P) in x's dtype and final state (B, H, P, N) fp32, plus ``states``
    (B, H, cdiv(L, checkpoint), P, N) fp32: the state entering every ``launch['checkpoint']`` tokens."""
    bsz, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    ck, bt, bp = launch["checkpoint"], launch["fwd_block_t"], launch["fwd_block_p"]
    y = torch.empty(bsz, L, H, P, dtype=x.dtype, device=x.device)
    final = torch.empty(bsz, H, P, N, dtype=torch.float32, device=x.device)
    states = torch.empty(bsz, H, triton.cdiv(L, ck), P, N, dtype=torch.float32, device=x.device)
    if bsz == 0 or H == 0:
        return y, final, states
    strides = (*x.stride(), *dt.stride(), *B.stride(), *C.stride(), *(s0.stride() if s0 is not None else (0,) * 4),
               *y.stride(), *final.stride(), *states.stride()[:4])
    args = (x, dt, A, B, C, D if D is not None else dummy(A), s0 if s0 is not None else dummy(final), y, final,
            states, L, P, N, H // G, ck, *strides)
    consts = dict(HAS_D=D is not None, HAS_INIT=s0 is not None, **_consts(x), BLOCK_P=bp,
                  BLOCK_N=max(16, triton.next_power_of_2(N)))
    _launch(_fwd_save_kernel, (triton.cdiv(P, bp), bsz, H), args, consts, bt, launch["fwd_num_warps"], 2,
            launch["step_down"])
    return y, final, states


def ssd_backward(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, s0: Tensor | None,
                 states: Tensor, dy: Tensor | None, dfinal: Tensor | None, *, launch: dict) -> tuple:
    """(dx, ddt, dA, dB, dC, dD, d initial_state) of the scan, each in its input's dtype (dD None without D,
    the last None without an initial state), from the checkpoints of ``ssd_forward_save`` and the gradients of
    y (B, L, H, P) and of the final state (B, H, P, N); either may be None (zero)."""
    bsz, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    bt, bp, ck = launch["block_t"], launch["block_p"], launch["checkpoint"]
    n_pblk = triton.cdiv(P, bp)
    atomic_bc, atomic_dt = H != G or n_pblk > 1, n_pblk > 1
    dev, f32 = x.device, torch.float32
    if dy is None:
        dy = x.new_zeros(()).expand(x.shape)  # only the final state was used: stride-0 zeros, nothing allocated
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    ddt = (torch.zeros if atomic_dt else torch.empty)(bsz, L, H, dtype=f32, device=dev)
    dB = (torch.zeros if atomic_bc else torch.empty)(bsz, L, G, N, dtype=f32, device=dev)
    dC = (torch.zeros if atomic_bc else torch.empty)(bsz, L, G, N, dtype=f32, device=dev)
    dA = torch.zeros(H, dtype=f32, device=dev)
    dD = torch.zeros(H, dtype=f32, device=dev)
    ds0 = torch.empty(bsz, H, P, N, dtype=f32, device=dev)
    if bsz and H:
        strides = (*x.stride(), *dt.stride(), *B.stride(), *C.stride(), *states.stride()[:4], *dy.stride(),
                   *(dfinal.stride() if dfinal is not None else (0,) * 4), *dx.stride(), *ddt.stride(),
                   *dB.stride()[:3], *ds0.stride()[:3])
        args = (x, dt, A, B, C, D if D is not None else dummy(A), states, dy,
                dfinal if dfinal is not None else dummy(dA), dx, ddt, dA, dB, dC, dD, ds0, L, P, N, H // G, ck,
                *strides)
        consts = dict(HAS_D=D is not None, HAS_DSF=dfinal is not None, HAS_INIT=s0 is not None,
                      ATOMIC_BC=atomic_bc, ATOMIC_DT=atomic_dt, **_consts(x), BLOCK_P=bp,
                      BLOCK_N=max(16, triton.next_power_of_2(N)))
        # a failed launch has written nothing: the atomics only run in a launch that fits
        _launch(_bwd_kernel, (n_pblk, bsz, H), args, consts, bt, launch["num_warps"], 1, launch["step_down"])
    elif dfinal is not None and s0 is not None:  # no chains: nothing to scan (kept for shape completeness)
        ds0.copy_(dfinal)
    return (dx, ddt.to(dt.dtype), dA.to(A.dtype), dB.to(B.dtype), dC.to(C.dtype),
            dD.to(D.dtype) if D is not None else None, ds0.to(s0.dtype) if s0 is not None else None)


class SSDScanFunction(torch.autograd.Function):
    """(y, final state) of the one-kernel scan with its reverse-scan backward; saves the inputs and the
    checkpoint states (module docstring)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, s0, launch):
        y, final, states = ssd_forward_save(x, dt, A, B, C, D, s0, launch=launch)
        ctx.save_for_backward(x, dt, A, B, C, D, s0, states)
        ctx.launch = launch
        ctx.set_materialize_grads(False)  # an unused final state sends None: no zero tensor is read
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, s0, states = ctx.saved_tensors
        grads = ssd_backward(x, dt, A, B, C, D, s0, states, dy, dfinal, launch=ctx.launch)
        return (*grads, None)


LAUNCH_KEYS = ("fwd_block_t", "fwd_block_p", "fwd_num_warps", "block_t", "block_p", "num_warps", "checkpoint")


def ssd_chunk_scan_grad_triton(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                               initial_state: Tensor | None = None, **launch) -> tuple[Tensor, Tensor]:
    """Differentiable one-kernel SSD scan. x (B, L, H, P); dt (B, L, H) discretized; A (H,); B, C (B, L, G, N),
    head h reads group h // (H / G); D (H,) or None; initial_state (B, H, P, N) or None (zeros). Any strides.
    Returns y (B, L, H, P) in x's dtype and the final state (B, H, P, N) fp32; their backward returns gradients
    for every tensor argument in its dtype. ``launch``: any of ``LAUNCH_KEYS`` (``default_launch`` fills the
    rest): the forward's tile, P block and warps, the backward's, and ``checkpoint``, the tokens between saved
    states (a multiple of both tiles). The result does not depend on them up to rounding."""
    bsz, L, H, P, G, N = check_ssd_shapes(x, dt, A, B, C, D, initial_state)
    for name, t in (("x", x), ("B", B), ("C", C), ("dt", dt)):
        check_float(name, t)
    unknown = sorted(set(launch) - set(LAUNCH_KEYS))
    if unknown:
        raise ValueError(f"unknown launch options {unknown}; choose from {', '.join(LAUNCH_KEYS)}")
    opts = default_launch(L, P, N, itemsize=x.element_size(), chains=bsz * H, sms=_sm_count(x.device))
    given = {k: int(v) for k, v in launch.items() if v is not None}
    opts.update(given, step_down=not given)
    for k in ("fwd_block_t", "fwd_block_p", "block_t", "block_p"):
        _check_block(k, opts[k])
    ck = opts["checkpoint"]
    if ck < 1 or ck % opts["fwd_block_t"] or ck % opts["block_t"]:
        raise ValueError(f"checkpoint must be a positive multiple of fwd_block_t ({opts['fwd_block_t']}) and "
                         f"block_t ({opts['block_t']}), got {ck}")
    return SSDScanFunction.apply(x, dt, A, B, C, D, initial_state, opts)
