"""Triton kernel for Mamba-2 decode-time state updates: one kernel serves the single-token update
(``selective_state_update``, L = 1), the fused multi-step update (seed 001, App. A), its replay form
(advance by update_count[b] cached tokens, no output) and the fused `snapshot` baseline (seed 000, Alg. 3).

Each program owns one (sequence, head, BLOCK_P rows of P) tile of the fp32 state: it loads the tile once,
loops over the L tokens with the tile in registers (S = exp(A·dt)·S + dt·x Bᵀ, y = S C + D x, y *= silu(z)),
writes every output, and stores the tile once at the end (or once per token into a snapshot slot).
Nothing is shared between programs, so in-place updates are race-free; the kernel is never autotuned
(an autotuner would replay it on the live state): block sizes come from ``_blocks`` (chosen by hand).

Two launch options try to hide the per-token load latency (issue P3: at L = 10 the kernel is neither bandwidth-
nor FLOP-bound, each token waits for its own x, dt, B, C loads): ``PREFETCH`` issues token t + 1's loads before
token t is computed and carries them in loop variables (software double buffering), ``NUM_STAGES`` > 1 hands
the token loop to Triton's pipeliner instead. The arithmetic per token is the same, so both give the default's
outputs and states bit for bit. ``PREFETCH`` is on by default where a GPU sweep timed it faster -- several tokens
and a small grid (``_default_prefetch``); ``NUM_STAGES`` stays 1 (never faster in that sweep).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.multistep.naive import check_multistep_shapes
from ssmspec.ops.triton_common import check_float, discretize, dummy, gdc_enter, has_limit, limit_args, pdl_args, silu


@triton.jit
def _operands(t, steps, x_base, x_l, dt_base, dt_l, B_base, B_l, C_base, C_l, z_base, z_l, dst_base, dst_l, mask_p,
              mask_n, OUTPUT: tl.constexpr, HAS_Z: tl.constexpr, SNAPSHOT: tl.constexpr):
    """Token t's x (BLOCK_P,), dt, B (BLOCK_N,), C, z (BLOCK_P,) and snapshot slot as stored, for ``PREFETCH``.
    Nothing is read for t >= steps (the prefetch past the last token is masked off), nor C, z, the slot where the
    kernel does not use them (constant placeholders there, which the compiler folds away). Not converted: a
    conversion is a use, and a use would wait for the load the prefetch means to leave in flight. The masks are
    ``where``s, not ``mask_p & live``: Triton 3.9's interpreter broadcasts a scalar comparison as int32, which
    ``tl.load`` then refuses as a mask (on the GPU either is one predicate)."""
    live = t < steps
    mask_p = tl.where(live, mask_p, False)
    mask_n = tl.where(live, mask_n, False)
    xv = tl.load(x_base + t * x_l, mask=mask_p, other=0.0)
    dtv = tl.load(dt_base + t * dt_l, mask=live, other=0.0)
    Bv = tl.load(B_base + t * B_l, mask=mask_n, other=0.0)
    Cv = tl.zeros_like(Bv)
    zv = tl.zeros_like(xv)
    dst = tl.full([], -1, tl.int64)
    if OUTPUT:
        Cv = tl.load(C_base + t * C_l, mask=mask_n, other=0.0)
        if HAS_Z:
            zv = tl.load(z_base + t * z_l, mask=mask_p, other=0.0)
    if SNAPSHOT:
        dst = tl.load(dst_base + t * dst_l, mask=live, other=-1)
    return xv, dtv, Bv, Cv, zv, dst


@triton.jit
def _ssm_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, row_ptr, count_ptr, dst_ptr,
    L, P, N, heads_per_group, lo, hi,
    s_row, s_h, s_p, s_n,
    x_b, x_l, x_h, x_p,
    dt_b, dt_l, dt_h,
    B_b, B_l, B_g, B_n,
    C_b, C_l, C_g, C_n,
    z_b, z_l, z_h, z_p,
    y_b, y_l, y_h, y_p,
    dst_b, dst_l,
    HAS_ROW: tl.constexpr, HAS_COUNT: tl.constexpr, SNAPSHOT: tl.constexpr, STORE_FINAL: tl.constexpr,
    OUTPUT: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr = False, NUM_STAGES: tl.constexpr = 1, USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)  # programmatic dependent launch (ops/triton_common.py)
    pid_p = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    g = h // heads_per_group
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :]
    y_base = y_ptr + b * y_b + h * y_h + offs_p * y_p  # (BLOCK_P,) pointers, token 0
    if HAS_ROW:
        row = tl.load(row_ptr + b).to(tl.int64)
        if row < 0:  # a pad sequence (mamba_ssm's convention): zero output, state untouched
            if OUTPUT:
                for t in range(0, L):
                    tl.store(y_base + t * y_l, tl.zeros([BLOCK_P], dtype=tl.float32), mask=mask_p)
            return
    else:
        row = b.to(tl.int64)
    tile = offs_p[:, None] * s_p + offs_n[None, :] * s_n  # (BLOCK_P, BLOCK_N) offsets inside a head
    s_ptrs = state_ptr + row * s_row + h * s_h + tile
    s = tl.load(s_ptrs, mask=mask_pn, other=0.0)  # (BLOCK_P, BLOCK_N) fp32: the only state load
    A = tl.load(A_ptr + h).to(tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    else:
        bias = 0.0
    if HAS_D:
        Dh = tl.load(D_ptr + h).to(tl.float32)
    if HAS_COUNT:
        cnt = tl.load(count_ptr + b).to(tl.int32)
    else:
        cnt = L
    steps = L
    if HAS_COUNT:
        if not OUTPUT:
            steps = tl.minimum(cnt, L)  # replay form: only the kept tokens matter
    keep = s  # state after `cnt` tokens when y must follow all L tokens
    x_base = x_ptr + b * x_b + h * x_h + offs_p * x_p
    B_base = B_ptr + b * B_b + g * B_g + offs_n * B_n
    C_base = C_ptr + b * C_b + g * C_g + offs_n * C_n
    if PREFETCH:  # token 0's operands; iteration t then issues token t + 1's before it computes token t
        dt_base = dt_ptr + b * dt_b + h * dt_h
        z_base = z_ptr + b * z_b + h * z_h + offs_p * z_p
        dst_base = dst_ptr + b * dst_b
        xn, dtn, Bn, Cn, zn, dstn = _operands(0, steps, x_base, x_l, dt_base, dt_l, B_base, B_l, C_base, C_l, z_base,
                                              z_l, dst_base, dst_l, mask_p, mask_n, OUTPUT, HAS_Z, SNAPSHOT)
    for t in tl.range(0, steps, num_stages=NUM_STAGES):
        if PREFETCH:
            xc, dtc, Bc, Cc, zc, dstc = xn, dtn, Bn, Cn, zn, dstn  # token t's, loaded one iteration ago
            xn, dtn, Bn, Cn, zn, dstn = _operands(t + 1, steps, x_base, x_l, dt_base, dt_l, B_base, B_l, C_base, C_l,
                                                  z_base, z_l, dst_base, dst_l, mask_p, mask_n, OUTPUT, HAS_Z,
                                                  SNAPSHOT)
            xv = xc.to(tl.float32)
            dtv = discretize(dtc.to(tl.float32), bias, lo, hi, DT_SOFTPLUS, HAS_LIMIT)
            Bv = Bc.to(tl.float32)
        else:
            xv = tl.load(x_base + t * x_l, mask=mask_p, other=0.0).to(tl.float32)  # (BLOCK_P,)
            dtv = tl.load(dt_ptr + b * dt_b + t * dt_l + h * dt_h).to(tl.float32)
            dtv = discretize(dtv, bias, lo, hi, DT_SOFTPLUS, HAS_LIMIT)
            Bv = tl.load(B_base + t * B_l, mask=mask_n, other=0.0).to(tl.float32)  # (BLOCK_N,)
        s = s * tl.exp(A * dtv) + (dtv * xv)[:, None] * Bv[None, :]
        if SNAPSHOT:  # the `snapshot` baseline: one full state store per token
            if PREFETCH:
                dst = dstc
            else:
                dst = tl.load(dst_ptr + b * dst_b + t * dst_l).to(tl.int64)
            if dst >= 0:
                tl.store(state_ptr + dst * s_row + h * s_h + tile, s, mask=mask_pn)
        if OUTPUT:
            if PREFETCH:
                Cv = Cc.to(tl.float32)
            else:
                Cv = tl.load(C_base + t * C_l, mask=mask_n, other=0.0).to(tl.float32)
            yv = tl.sum(s * Cv[None, :], axis=1)  # (BLOCK_P,)
            if HAS_D:
                yv += Dh * xv
            if HAS_Z:
                if PREFETCH:
                    zv = zc
                else:
                    zv = tl.load(z_ptr + b * z_b + t * z_l + h * z_h + offs_p * z_p, mask=mask_p, other=0.0)
                yv *= silu(zv.to(tl.float32))
            tl.store(y_base + t * y_l, yv, mask=mask_p)
            if HAS_COUNT:
                keep = tl.where(t < cnt, s, keep)
    if STORE_FINAL:
        if HAS_COUNT:
            if OUTPUT:
                s = keep
            if cnt > 0:  # count 0: unchanged, skip the store
                tl.store(s_ptrs, s, mask=mask_pn)
        else:
            tl.store(s_ptrs, s, mask=mask_pn)


def _blocks(P: int, N: int, L: int) -> tuple[int, int]:
    """(BLOCK_P, num_warps) per shape class, picked by hand from sweeps on an H100 (kernel_parity's ``sweep``
    rows for L = 1; for L = 10 at batch 16 / 256 on the Nemotron-H-4B mixer: 16 rows at 1 warp 86 / 1123 us,
    at 2 warps 91 / 1170 us, at 4 warps 96 / 1324 us; 8 rows at 1 warp 91 / 1140 us, 32 rows at 4 warps
    97 / 1272 us, 8 rows at 4 warps 121 / 1795 us). A kernel that writes state in place is never autotuned.
    One program holds BLOCK_P x N fp32 of state; for L = 1 a tile of 8 rows keeps every thread on 16-byte
    vectors while the grid still fills the GPU at batch 1; with several tokens the per-token row reduction of
    y = S C dominates, and one warp keeps it inside the warp (shuffles, no shared-memory round trip).
    (The P3 sweep of 2026-11-27 on two H200s found block_p 8 at 1 warp with prefetch 68.3 us against 74.3 us at
    16 rows for nemotron-h-4b at batch 16, L = 10: one shape on one model, not enough to move these.)
    Whether the next token's operands are prefetched depends on the grid too: ``_default_prefetch``."""
    n = triton.next_power_of_2(N)
    if L <= 1:
        bp = 4 if n >= 256 else max(4, 1024 // n)  # ~1k state elements per program
        return min(bp, triton.next_power_of_2(P)), 4
    bp = max(8, 2048 // n)
    return min(bp, triton.next_power_of_2(P)), 1


PREFETCH_MAX_PROGRAMS_PER_SM = 64  # the default prefetches while the grid has at most this many programs an SM
REFERENCE_SMS = 132  # H100 SXM and H200, where the rule was measured: the SM count off a GPU (the interpreter)


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; ``REFERENCE_SMS`` elsewhere, so that the interpreter takes the launch a GPU of the
    measured kind would take."""
    device = torch.device(device)
    if device.type != "cuda":
        return REFERENCE_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def _default_prefetch(L: int, programs: int, sms: int) -> bool:
    """Whether a launch that does not say prefetches token t + 1's operands (``PREFETCH``): with several tokens
    (L > 1; one token has nothing to prefetch) and a grid of at most ``PREFETCH_MAX_PROGRAMS_PER_SM`` programs an
    SM (``programs``: P blocks x batch x heads, ``sms``: the GPU's SMs).

    Measured on two H200s (132 SMs), 2026-11-27, L = 10, at ``_blocks``' block_p 16 and 1 warp:
    ``python -m ssmspec.bench.multistep_sweep --batch 16``: nemotron-h-4b 77.6 -> 74.3 us with prefetch
    (7,168 programs, 54 an SM), mamba2-2.7b 60.1 -> 56.1 us (5,120 programs, 39 an SM); snl_tab1_kernels: 4-6%
    faster with prefetch at batch 16 on both models, 4-5% slower at batch 256 (mamba2-2.7b 719 -> 748 us with
    81,920 programs, 621 an SM; nemotron-h-4b 999 -> 1048 us with 114,688, 869 an SM). A small grid leaves
    each SM few programs to switch between while one waits for its loads, so issuing the next token's loads
    early hides that wait; a large grid hides it by switching, and the prefetch's extra live registers (one
    more token's x, B, C, z) only cost occupancy. Nothing between 54 and 621 programs an SM was timed: 64 keeps
    the default to the measured wins (batch up to 18 of nemotron-h-4b, 26 of mamba2-2.7b); a sweep at batch
    32-128 would place the threshold. num_stages 2 was never faster (equal or slower in the sweep, 10-19%
    slower in snl_tab1_kernels), so it stays off."""
    return L > 1 and programs <= PREFETCH_MAX_PROGRAMS_PER_SM * sms


def default_launch(bsz: int, L: int, H: int, P: int, N: int, sms: int, *, block_p: int | None = None,
                   num_warps: int | None = None, prefetch: bool | None = None) -> dict:
    """The launch of a call with those sizes on a GPU of ``sms`` SMs: the options given, the rest ``_blocks``'
    and ``_default_prefetch``'s (which looks at the grid of the block_p taken); ``grid`` is the kernel's."""
    bp, nw = _blocks(P, N, L)
    bp, nw = block_p or bp, num_warps or nw
    grid = (triton.cdiv(P, bp), bsz, H)
    pf = _default_prefetch(L, grid[0] * bsz * H, sms) if prefetch is None else bool(prefetch)
    return dict(block_p=bp, num_warps=nw, prefetch=pf, grid=grid)


def _launch(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
            z: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool, dt_limit, *, rows: Tensor | None,
            count: Tensor | None, dst: Tensor | None, store_final: bool, output: bool,
            block_p: int | None = None, num_warps: int | None = None, prefetch: bool | None = None,
            num_stages: int | None = None) -> Tensor | None:
    bsz, L, H, P, G, N = check_multistep_shapes(x, dt, A, B, C, D, z, dt_bias)
    if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages must be an int >= 1 (1: the plain token loop), got {num_stages!r}")
    if state.dim() != 4 or state.shape[1:] != (H, P, N) or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 (Bs, H, P, N) with H={H}, P={P}, N={N}; got "
                         f"{tuple(state.shape)} {state.dtype}")
    for name, t in (("x", x), ("B", B), ("C", C)):
        check_float(name, t)
    check_float("dt", dt)
    y = torch.empty_like(x) if output else None
    plan = default_launch(bsz, L, H, P, N, sm_count(x.device), block_p=block_p, num_warps=num_warps,
                          prefetch=prefetch)
    bp, nw, pf, grid = plan["block_p"], plan["num_warps"], plan["prefetch"], plan["grid"]
    lo, hi = limit_args(dt_limit)
    yt = y if y is not None else x  # unread / unwritten when not OUTPUT
    zs = z.stride() if z is not None else (0, 0, 0, 0)
    _ssm_update_kernel[grid](
        state, x, dt, A, B, C, D if D is not None else dummy(x), z if z is not None else dummy(x),
        dt_bias if dt_bias is not None else dummy(x), yt,
        rows if rows is not None else dummy(dt, torch.int64), count if count is not None else dummy(dt, torch.int64),
        dst if dst is not None else dummy(dt, torch.int64),
        L, P, N, H // G, lo, hi,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zs, *yt.stride(),
        *(dst.stride() if dst is not None else (0, 0)),
        HAS_ROW=rows is not None, HAS_COUNT=count is not None, SNAPSHOT=dst is not None, STORE_FINAL=store_final,
        OUTPUT=output, HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit(dt_limit), BLOCK_P=bp, BLOCK_N=triton.next_power_of_2(N),
        PREFETCH=pf, NUM_STAGES=num_stages or 1, num_warps=nw, **pdl_args(x),
    )
    return y


def _index(t: Tensor | None, name: str, shape: tuple, device) -> Tensor | None:
    if t is None:
        return None
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64).contiguous()


def ssm_multistep_triton(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                         D: Tensor | None = None, *, dt_bias: Tensor | None = None, dt_softplus: bool = True,
                         dt_limit=(0.0, float("inf")), z: Tensor | None = None,
                         state_batch_indices: Tensor | None = None, update_count: Tensor | None = None,
                         store_state: bool = True, output: bool = True, block_p: int | None = None,
                         num_warps: int | None = None, prefetch: bool | None = None,
                         num_stages: int | None = None) -> Tensor | None:
    """Triton form of ``ssm_multistep`` (same arguments; see ``ssmspec.ops.multistep``) with launch options
    (None: ``default_launch``'s choice): ``block_p`` (state rows a program) and ``num_warps``; ``prefetch`` loads
    token t + 1's operands while token t is computed (default: on for L > 1 and a small grid,
    ``_default_prefetch``; True / False force it); ``num_stages``
    > 1 pipelines the token loop with Triton's own pipeliner (``tl.range(..., num_stages)``; 1: the plain
    loop). ``prefetch`` and ``num_stages`` only move loads: y and the state stay the same bit for bit."""
    bsz = x.shape[0]
    rows = _index(state_batch_indices, "state_batch_indices", (bsz,), x.device)
    count = _index(update_count, "update_count", (bsz,), x.device)
    if not output and not store_state:
        return None
    return _launch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, rows=rows, count=count, dst=None,
                   store_final=store_state, output=output, block_p=block_p, num_warps=num_warps, prefetch=prefetch,
                   num_stages=num_stages)


def ssm_multistep_snapshot_triton(state_pool: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                                  D: Tensor | None = None, *, dt_bias: Tensor | None = None, dt_softplus: bool = True,
                                  dt_limit=(0.0, float("inf")), src_slot: Tensor, dst_slots: Tensor,
                                  z: Tensor | None = None, block_p: int | None = None, num_warps: int | None = None,
                                  prefetch: bool | None = None, num_stages: int | None = None) -> Tensor:
    """Triton form of ``ssm_multistep_snapshot`` (see ``ssmspec.ops.multistep``); the launch options are
    ``ssm_multistep_triton``'s (``prefetch`` also fetches the next token's snapshot slot)."""
    bsz, L = x.shape[:2]
    src = _index(src_slot, "src_slot", (bsz,), x.device)
    dst = _index(dst_slots, "dst_slots", (bsz, L), x.device)
    return _launch(state_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, rows=src, count=None, dst=dst,
                   store_final=False, output=True, block_p=block_p, num_warps=num_warps, prefetch=prefetch,
                   num_stages=num_stages)
