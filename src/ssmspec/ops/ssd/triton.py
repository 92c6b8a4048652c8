"""The Mamba-2 SSD prefill scan as one Triton kernel (seed 004: one program per chunk chain, or per segment).

Each chain -- one (sequence b, head h, BLOCK_P rows of P) slice -- walks the sequence in tiles of BLOCK_T
tokens, carrying its fp32 state tile S (BLOCK_P, N) in registers from tile to tile. A chain is one program
while the chains fill the GPU; on a grid that would leave SMs idle (seed 004's 16 x 8 chains on 132 SMs)
the same launch cuts each chain into segments, one program each, that hand their states on by decoupled
look-back (``_ssd_scan_kernel``, ``_plan``): the cost is one more read of x and B. Inside a
tile the recurrence is unrolled (DESIGN.md section 1) into its parallel, masked-quadratic form, every
product a tensor-core ``tl.dot``; with cum_t = Σ_{i<=t} A·dt_i over the tile's tokens:

    y_t    = exp(cum_t)·(S C_t) + Σ_{j<=t} exp(cum_t − cum_j)·dt_j·(C_t·B_j)·x_j + D·x_t
    S_next = exp(cum_T)·S + Σ_j exp(cum_T − cum_j)·dt_j·x_j B_jᵀ

mamba_ssm's ``mamba_chunk_scan_combined`` computes the same thing in five launches (cumsum, chunk state,
state passing, C·Bᵀ, chunk scan) with HBM round trips of the per-chunk states between them; here the
chain over tiles is sequential inside one program (or segment), so the states leave registers only at
segment boundaries and the inputs are read once, twice for x and B when cut (the loads of tile c+1 do not
depend on the state and are software-pipelined, num_stages).

Precision: dot operands are in the input dtype with fp32 accumulation (bf16 / fp16 inputs: the weights
and the state operand are rounded to that dtype before the tensor-core products, as mamba_ssm does);
fp32 inputs use tf32x3 (fp32-accurate). Decays, cumulative sums and the carried state are fp32.

Pads: a token with dt = 0 has decay exp(0) = 1 and adds dt·x Bᵀ = 0, so left padding (dt zeroed by
``MambaParams.discretize``) leaves the initial state untouched; no mask is needed in the kernel.

The kernel writes only its own outputs and a fresh final-state tensor, but it is still not autotuned (an
autotuner would time inside the first prefill and hide the choice): block sizes are launch options
(``block_t``, ``block_p``, ``num_warps``, ``num_stages``, ``segment_len``) so the ``ssd_kernel_blockt``
experiment measures every choice; ``_plan`` holds the defaults, which step down (``_fallbacks``) on a GPU that
cannot hold them.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from ssmspec.ops.dispatch import interpret_mode
from ssmspec.ops.ssd.naive import check_scan_options, seq_ids
from ssmspec.ops.ssd.triton_options import _discretized, _epilogue, _mm, _run_states, _seq_marks
from ssmspec.ops.triton_common import check_float, dummy, has_limit, limit_args

log = logging.getLogger("ssmspec.ops.ssd")


@triton.jit
def _tile_xb(x_base, dt_base, B_base, t0, end, offs_t, offs_p, offs_n, mask_p, mask_n, x_l, x_p, dt_l, B_l, B_n):
    """One tile's inputs of the carry: token offsets (int64: token x stride passes 2^31 at long prompts of the
    big mixers) and mask, dt (T,) fp32, x (T, BP) in the input dtype, B (T, BN) in x's dtype. Tokens past
    ``end`` load dt = 0, x = B = 0: decay 1, no contribution, so the tile's log-decay sum is its total."""
    tok = t0 + offs_t
    mask_t = tok < end
    tok = tok.to(tl.int64)
    dt = tl.load(dt_base + tok * dt_l, mask=mask_t, other=0.0).to(tl.float32)
    xt = tl.load(x_base + tok[:, None] * x_l + offs_p[None, :] * x_p, mask=mask_t[:, None] & mask_p[None, :],
                 other=0.0)
    Bt = tl.load(B_base + tok[:, None] * B_l + offs_n[None, :] * B_n, mask=mask_t[:, None] & mask_n[None, :],
                 other=0.0).to(xt.dtype)
    return tok, mask_t, dt, xt, Bt


@triton.jit
def _carry(S, xt, Bt, dt, cum, total, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """S <- exp(cum_T)·S + (x ∘ w)ᵀ B with w_j = exp(cum_T - cum_j)·dt_j: (BP, T) @ (T, BN); x·w rounded to
    the input dtype before the product."""
    w = tl.exp(total - cum) * dt  # (T,)
    xw = (xt.to(tl.float32) * w[:, None]).to(xt.dtype)  # (T, BP)
    return S * tl.exp(total) + _mm(tl.trans(xw), Bt, PRECISION, UPCAST)


@triton.jit
def _ssd_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, s0_ptr, y_ptr, sf_ptr, carry_ptr, flag_ptr, z_ptr, dtb_ptr, seq_ptr,
    L, P, N, H, heads_per_group, n_pblk, n_seg, seg_len, lo, hi,
    x_b, x_l, x_h, x_p,
    dt_b, dt_l, dt_h,
    B_b, B_l, B_g, B_n,
    C_b, C_l, C_g, C_n,
    s0_b, s0_h, s0_p, s0_n,
    y_b, y_l, y_h, y_p,
    sf_b, sf_h, sf_p, sf_n,
    D_h, D_p, z_b, z_l, z_h, z_p, seq_b, seq_l,
    HAS_D: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SEGMENTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    D_HAS_P: tl.constexpr, HAS_Z: tl.constexpr, DT_RAW: tl.constexpr, HAS_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_SEQ: tl.constexpr, PACKED: tl.constexpr,
    SEQ_INIT: tl.constexpr,
):
    # options (``triton_options.py``): DT_RAW discretizes dt here (HAS_BIAS, DT_SOFTPLUS, HAS_LIMIT); D_HAS_P: D
    # is (H, P); HAS_Z gates the output; HAS_SEQ: several sequences a row (seq_ptr (B, L) ids), PACKED: one row
    # of cu_seqlens' sequences, initial / final states one per sequence (SEQ_INIT: the initial ones given)
    if SEGMENTED:
        # one program per (chain, segment). Programs take their segment in the order they start (a ticket),
        # so the segment a program waits on belongs to a program that started before it: no deadlock
        ticket = tl.atomic_add(flag_ptr, 1)  # flag_ptr[0]: the ticket counter, zero at launch
        chain = ticket // n_seg
        seg = ticket % n_seg
        pid_p = chain % n_pblk
        bh = chain // n_pblk
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
    else:
        pid_p = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        h = tl.program_id(2).to(tl.int64)
        chain = 0
        seg = 0
    g = h // heads_per_group
    offs_t = tl.arange(0, BLOCK_T)  # (T,) token offsets inside a tile
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # (BP,)
    offs_n = tl.arange(0, BLOCK_N)  # (BN,)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :]
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(dtb_ptr + h).to(tl.float32)
    Dv = 0.0
    if HAS_D:  # one scalar for the head, or its (BP,) row of D (H, P)
        if D_HAS_P:
            Dv = tl.load(D_ptr + h * D_h + offs_p * D_p, mask=mask_p, other=0.0).to(tl.float32)
        else:
            Dv = tl.load(D_ptr + h * D_h).to(tl.float32)
    seq_base = seq_ptr + b * seq_b
    z_base = z_ptr + b * z_b + h * z_h
    blk_s0 = 0
    blk_sf = 0
    if HAS_SEQ:  # (BP, BN) offsets of a state in a row of initial / final states, for the per-sequence ones
        blk_s0 = h * s0_h + offs_p[:, None] * s0_p + offs_n[None, :] * s0_n
        blk_sf = h * sf_h + offs_p[:, None] * sf_p + offs_n[None, :] * sf_n
    x_base = x_ptr + b * x_b + h * x_h
    dt_base = dt_ptr + b * dt_b + h * dt_h
    B_base = B_ptr + b * B_b + g * B_g
    C_base = C_ptr + b * C_b + g * C_g
    y_base = y_ptr + b * y_b + h * y_h
    S = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    if HAS_INIT:
        if seg == 0:
            S = tl.load(s0_ptr + b * s0_b + h * s0_h + offs_p[:, None] * s0_p + offs_n[None, :] * s0_n,
                        mask=mask_pn, other=0.0).to(tl.float32)  # (BP, BN) fp32 carried state
    start = seg * seg_len
    end = tl.minimum(start + seg_len, L)
    if SEGMENTED:
        # decoupled look-back over the chain's segments: phase 1 runs this segment's carry alone (from zero;
        # segment 0 from the initial state), then waits for the state entering the segment, publishes the
        # state entering the next one, and phase 2 below scans the segment from it. carry slot k - 1 holds
        # the state entering segment k, flag k - 1 says it is written (release / acquire at GPU scope).
        blk = tl.arange(0, BLOCK_P)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # (BP, BN) slot offsets
        slot = carry_ptr + chain.to(tl.int64) * (n_seg - 1) * BLOCK_P * BLOCK_N
        flags = flag_ptr + 1 + chain * (n_seg - 1)
        Sl = S
        decay = 0.0
        flow = 1.0  # HAS_SEQ: 0 once a sequence starts in the segment (the state entering it stops there)
        if seg < n_seg - 1:  # the last segment passes nothing on
            for t0 in range(start, end, BLOCK_T):
                tok, mask_t, dt, xt, Bt = _tile_xb(x_base, dt_base, B_base, t0, end, offs_t, offs_p, offs_n, mask_p,
                                                   mask_n, x_l, x_p, dt_l, B_l, B_n)
                if DT_RAW:
                    dt = _discretized(dt, mask_t, bias, lo, hi, DT_SOFTPLUS, HAS_LIMIT)
                cum = tl.cumsum(A * dt, axis=0)
                total = tl.sum(A * dt, axis=0)
                if HAS_SEQ:
                    r, n_runs, sid0 = _seq_marks(seq_base, tok, mask_t, t0, seq_l)
                    Sl, _ = _run_states(Sl, xt, Bt, xt, Bt, dt, cum, r, n_runs, sid0, A, s0_ptr, sf_ptr, blk_s0,
                                        blk_sf, mask_pn, s0_b, sf_b, False, False, SEQ_INIT, PRECISION, UPCAST)
                    flow = tl.where(n_runs == 0, flow, 0.0)
                else:
                    Sl = _carry(Sl, xt, Bt, dt, cum, total, PRECISION, UPCAST)
                decay += total
        if seg > 0:
            while tl.atomic_add(flags + seg - 1, 0, sem="acquire") == 0:
                pass
            S = tl.load(slot + (seg - 1) * BLOCK_P * BLOCK_N + blk, cache_modifier=".cg")
            if HAS_SEQ:
                Sl = S * (tl.exp(decay) * flow) + Sl
            else:
                Sl = S * tl.exp(decay) + Sl
        if seg < n_seg - 1:
            tl.store(slot + seg * BLOCK_P * BLOCK_N + blk, Sl)
            tl.debug_barrier()  # every thread's part of the slot is written before the flag goes up
            tl.atomic_xchg(flags + seg, 1, sem="release")
    causal = offs_t[:, None] >= offs_t[None, :]  # (T, T): token i reads token j <= i
    for t0 in range(start, end, BLOCK_T):
        tok, mask_t, dt, xt, Bt = _tile_xb(x_base, dt_base, B_base, t0, end, offs_t, offs_p, offs_n, mask_p, mask_n,
                                           x_l, x_p, dt_l, B_l, B_n)
        if DT_RAW:
            dt = _discretized(dt, mask_t, bias, lo, hi, DT_SOFTPLUS, HAS_LIMIT)
        Ct = tl.load(C_base + tok[:, None] * C_l + offs_n[None, :] * C_n,
                     mask=mask_t[:, None] & mask_n[None, :], other=0.0).to(xt.dtype)  # (T, BN)
        cum = tl.cumsum(A * dt, axis=0)  # (T,) log-decay from the tile start through token t
        total = tl.sum(A * dt, axis=0)  # cum_T
        # within-tile part: W[i, j] = exp(cum_i - cum_j)·dt_j·(C_i·B_j) for j <= i
        CB = _mm(Ct, tl.trans(Bt), PRECISION, UPCAST)  # (T, T) fp32
        if HAS_SEQ:  # token i reads token j only inside its own sequence
            r, n_runs, sid0 = _seq_marks(seq_base, tok, mask_t, t0, seq_l)
            same = causal & (r[:, None] == r[None, :])
        else:
            same = causal
        seg_w = tl.where(same, cum[:, None] - cum[None, :], float("-inf"))  # exp -> 0 above the diagonal
        W = CB * tl.exp(seg_w) * dt[None, :]  # (T, T)
        y = _mm(W.to(xt.dtype), xt, PRECISION, UPCAST)  # (T, BP)
        if HAS_SEQ:  # each run reads its entry state; the state carried on, and packed sequences' final states
            S, y = _run_states(S, y, Ct, xt, Bt, dt, cum, r, n_runs, sid0, A, s0_ptr, sf_ptr, blk_s0, blk_sf,
                               mask_pn, s0_b, sf_b, True, PACKED, SEQ_INIT, PRECISION, UPCAST)
        else:  # carried part: exp(cum_i)·(C_i Sᵀ), the state entering the tile read by every token
            y += tl.exp(cum)[:, None] * _mm(Ct, tl.trans(S.to(Ct.dtype)), PRECISION, UPCAST)
        y = _epilogue(y, xt, tok, mask_t, offs_p, mask_p, Dv, z_base, z_l, z_p, HAS_D, D_HAS_P, HAS_Z)
        tl.store(y_base + tok[:, None] * y_l + offs_p[None, :] * y_p, y.to(y_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & mask_p[None, :])
        if not HAS_SEQ:
            S = _carry(S, xt, Bt, dt, cum, total, PRECISION, UPCAST)
    if seg == n_seg - 1:
        if PACKED:  # the last sequence ends with the row
            last = tl.load(seq_base + (L - 1) * seq_l).to(tl.int64)
            tl.store(sf_ptr + last * sf_b + blk_sf, S, mask=mask_pn)
        else:
            tl.store(sf_ptr + b * sf_b + h * sf_h + offs_p[:, None] * sf_p + offs_n[None, :] * sf_n, S, mask=mask_pn)


def _blocks(L: int, P: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_P, num_warps) defaults. BLOCK_T = 128 is seed 004's measured optimum (64: setup per
    tile dominates; 256 and 512 spill: the (T, T) weights and the (T, N) tiles outgrow the register file);
    short prompts shrink it to the prompt (tl.dot needs at least 16). One program covers all of P up to 64
    rows (the C·Bᵀ product is per head and would be recomputed by every P block). 8 warps once a program
    holds a 128 x 128 fp32 weight tile, 4 below: ``ssd_kernel_blockt`` on one H200 (batch 16, 32K tokens,
    8 heads, P = N = 64, bf16) measured 1.80 ms at BLOCK_T = 128 with 8 warps against 2.52 ms with 4, and
    at BLOCK_T = 64 2.05 ms with 4 against 2.31 ms with 8. Every value is a launch option."""
    bt = min(128, max(16, triton.next_power_of_2(max(L, 1))))
    bp = min(64, max(16, triton.next_power_of_2(P)))
    nw = 8 if bt >= 128 else 4
    return bt, bp, nw


# Grids that leave program slots empty (see ``_plan``): the tile, warps and programs an SM holds, by state
# width. Measured with ``ssd_kernel_blockt`` and single launches on one H100 (bf16):
# - N = 64 (seed 004's 16 x 8 chains at 32K; results/ssd_kernel_blockt/gpu): 4 segments of 8192 tokens at
#   BLOCK_T = 32 / 2 warps 1.22 ms, 8 segments 1.25 ms, 16 segments 1.32 ms; at BLOCK_T = 64 / 4 warps 1.41 ms;
#   one program per chain 1.80 ms at 128 / 8 warps (seed 004's form), whose programs do not share an SM and
#   only get slower when cut (2.14 ms at 2 segments). 4 x 8 chains at 16K: 16 segments at 32 / 2 0.19 ms.
# - N = 128 (one nemotron-h-4b mixer at batch 1, 8K tokens: 112 chains): 2 segments at 64 / 4 warps 435 us,
#   32 / 2 warps 615-887 us, one program per chain 560 us at 128 / 8; at batch 2, 4K (224 chains) one program
#   per chain at 64 / 4 366 us against 544 us at 128 / 8 and 446 us cut in 2.
_SMALL_GRID = {64: (32, 2, 4), 128: (64, 4, 2)}  # BLOCK_N up to -> (BLOCK_T, num_warps, programs per SM)
_MIN_SEG_TILES = 8


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (0 elsewhere: the interpreter runs one segment)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def _segment_len(L: int, bt: int, chains: int, sms: int, slots: int = 4) -> int:
    """Tokens per segment of the default cut: the whole sequence (one program per chain, seed 004's form) while
    the chains fill the GPU's ``slots`` programs an SM; otherwise as many whole segments as fit the slots in
    one wave, each at least ``_MIN_SEG_TILES`` tiles, a whole number of tiles."""
    n_seg = min(slots * sms // max(chains, 1), L // (_MIN_SEG_TILES * bt))
    if n_seg <= 1:
        return max(L, 1)
    return -(-(-(-L // n_seg)) // bt) * bt


def _plan(L: int, P: int, N: int, chains_per_pblock: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_P, num_warps, segment_len) of a call without launch options: ``_blocks`` while the
    chains fill the GPU; a grid that leaves program slots empty takes the smaller tile of ``_SMALL_GRID`` (by
    N), and cuts its chains into segments where one wave holds more than one program a chain."""
    bt, bp, nw = _blocks(L, P, N)
    chains = chains_per_pblock * -(-P // bp)
    bn = max(16, triton.next_power_of_2(N))
    small_bt, small_nw, slots = _SMALL_GRID[64 if bn <= 64 else 128]
    if chains >= slots * sms:
        return bt, bp, nw, max(L, 1)
    small_bt = min(small_bt, bt)  # short prompts: the tile of the prompt
    return small_bt, bp, small_nw, _segment_len(L, small_bt, chains, sms, slots)


def _check_block(name: str, v: int) -> None:
    if v < 16 or v & (v - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot tiles), got {v}")


# (dtype, P, N, L > 64, segmented) -> the (block_t, num_warps, num_stages) that fit when the defaults did not
_FALLBACK: dict[tuple, tuple[int, int, int]] = {}


def _fallbacks(bt: int, nw: int, stages: int) -> list[tuple[int, int, int]]:
    """The defaults, then one pipeline stage fewer, then halved tiles: smaller shared-memory and register
    footprints for a GPU that cannot hold the defaults (Triton raises OutOfResources at the first launch)."""
    out = [(bt, nw, stages)]
    if stages > 1:
        out.append((bt, nw, 1))
    while bt > 32:
        bt //= 2
        nw = min(nw, 4) if bt < 128 else nw  # the warp rule of _blocks for the smaller tile
        out.append((bt, nw, 1))
    return out


def default_launch(dtype: torch.dtype, L: int, P: int, N: int, *, chains: int = 1,
                   device: torch.device | str = "cpu") -> dict:
    """The launch options a call without any runs with in this process (after any step-down), for result rows:
    ``chains`` is batch x heads, ``device`` the GPU whose SMs decide the segment length."""
    bt, bp, nw, seg = _plan(L, P, N, chains, _sm_count(torch.device(device)))
    bt, nw, stages = _FALLBACK.get((dtype, P, N, L > 64, seg < L, (False, False)), (bt, nw, 2))
    return dict(block_t=bt, block_p=bp, num_warps=nw, num_stages=stages, segment_len=seg)


def ssd_chunk_scan_triton(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                          initial_state: Tensor | None = None, z: Tensor | None = None,
                          dt_bias: Tensor | None = None, dt_softplus: bool = False,
                          dt_limit: tuple[float, float] = (0.0, float("inf")), seq_idx: Tensor | None = None,
                          cu_seqlens: Tensor | None = None, block_t: int | None = None,
                          block_p: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, segment_len: int | None = None) -> tuple[Tensor, Tensor]:
    """One-kernel SSD scan. x (B, L, H, P); dt (B, L, H) discretized (0 on pad tokens), or raw with ``dt_bias``
    (H,) / ``dt_softplus`` / ``dt_limit``; A (H,); B, C (B, L, G, N); D (H,) or (H, P) or None; z (B, L, H, P)
    or None; initial_state (B, H, P, N) or None (zeros); ``seq_idx`` (B, L) int / ``cu_seqlens`` (num_seqs + 1,)
    int: several sequences a row, as ``ssd_chunk_scan`` says. Any strides. Returns y (B, L, H, P) in x's dtype and
    the final states (B, H, P, N) -- (num_seqs, H, P, N) with ``cu_seqlens`` -- fp32 (a new tensor).
    ``block_t`` tokens per tile, ``block_p`` state rows per program (powers of two >= 16), ``num_warps``,
    ``num_stages`` (2), ``segment_len``: launch options, the result does not depend on them (up to rounding).
    ``segment_len`` is the tokens per segment of a chain (sequence, head, P block), a multiple of the tile or
    >= L (one segment). A chain cut into segments runs one program per segment in the same launch: each
    first carries its segment's state alone, then takes the state entering it from the program before it
    (decoupled look-back), passes its own on, and scans its segment. With no option given, ``_plan`` picks
    the blocks and the cut (one segment while batch x heads fill the GPU), stepping down (``_fallbacks``)
    where the GPU cannot hold them; a launch option that does not fit raises Triton's OutOfResources (the
    block-size sweep records it)."""
    n_states = check_scan_options(x, dt, A, B, C, D, initial_state, z=z, dt_bias=dt_bias, dt_limit=dt_limit,
                                  seq_idx=seq_idx, cu_seqlens=cu_seqlens)
    bsz, L, H, P = x.shape
    G, N = B.shape[2:]
    for name, t in (("x", x), ("B", B), ("C", C), ("dt", dt), ("z", z)):
        if t is not None:
            check_float(name, t)
    if cu_seqlens is not None:  # the sequence of every token, from the offsets (no host sync)
        seq_idx = seq_ids(cu_seqlens, L)[None]
    chosen = block_t is None and num_warps is None and num_stages is None
    if chosen and segment_len is None:  # the default plan: blocks and the segment cut
        bt, bp, nw, segment_len = _plan(L, P, N, bsz * H, _sm_count(x.device))
    else:
        bt, bp, nw = _blocks(L, P, N)
    bt, bp, nw, stages = block_t or bt, block_p or bp, num_warps or nw, num_stages or 2
    _check_block("block_t", bt)
    _check_block("block_p", bp)
    y = torch.empty(bsz, L, H, P, dtype=x.dtype, device=x.device)
    final = torch.empty(n_states, H, P, N, dtype=torch.float32, device=x.device)
    if bsz == 0 or H == 0:
        return y, final
    if segment_len is not None and (segment_len < 1 or (segment_len < L and segment_len % bt)):
        raise ValueError(f"segment_len must be a positive multiple of block_t ({bt}), or at least the sequence "
                         f"length ({L}: one segment), got {segment_len}")
    s0 = initial_state
    n_pblk = triton.cdiv(P, bp)
    bn = max(16, triton.next_power_of_2(N))
    d_strides = (0, 0) if D is None else (D.stride(0), D.stride(1) if D.dim() == 2 else 0)
    strides = (*x.stride(), *dt.stride(), *B.stride(), *C.stride(), *(s0.stride() if s0 is not None else (0,) * 4),
               *y.stride(), *final.stride(), *d_strides, *(z.stride() if z is not None else (0,) * 4),
               *(seq_idx.stride() if seq_idx is not None else (0, 0)))
    dt_raw = dt_bias is not None or dt_softplus or has_limit(dt_limit)
    consts = dict(HAS_D=D is not None, HAS_INIT=s0 is not None,
                  PRECISION="tf32x3" if x.dtype == torch.float32 else "tf32",
                  UPCAST=interpret_mode() and x.dtype == torch.bfloat16, BLOCK_P=bp, BLOCK_N=bn,
                  D_HAS_P=D is not None and D.dim() == 2, HAS_Z=z is not None, DT_RAW=dt_raw,
                  HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit(dt_limit),
                  HAS_SEQ=seq_idx is not None, PACKED=cu_seqlens is not None,
                  SEQ_INIT=cu_seqlens is not None and s0 is not None)
    options = (z is not None, seq_idx is not None)  # registers beyond the fixed-length kernel's
    key = (x.dtype, P, N, L > 64, segment_len is not None and segment_len < L, options)
    if not chosen:
        tries = [(bt, nw, stages)]
    elif key in _FALLBACK:
        tries = [_FALLBACK[key]]
    else:
        tries = _fallbacks(bt, nw, stages)
    chains = bsz * H * n_pblk
    seg = segment_len if segment_len is not None else max(L, 1)
    n_seg = triton.cdiv(max(L, 1), seg)  # a step-down halves the tile, which still divides the segment
    if n_seg > 1:  # one program per (chain, segment); look-back slots and flags (flags[0]: the ticket)
        carry = torch.empty(chains * (n_seg - 1) * bp * bn, dtype=torch.float32, device=x.device)
        flags = torch.zeros(1 + chains * (n_seg - 1), dtype=torch.int32, device=x.device)
        grid = (chains * n_seg,)
    else:
        carry, flags = dummy(final), dummy(final, torch.int32)
        grid = (n_pblk, bsz, H)
    opt = [t if t is not None else dummy(ref) for t, ref in ((z, x), (dt_bias, A), (seq_idx, flags))]
    args = (x, dt, A, B, C, D if D is not None else dummy(A), s0 if s0 is not None else dummy(final), y, final,
            carry, flags, *opt, L, P, N, H, H // G, n_pblk, n_seg, seg, *limit_args(dt_limit), *strides)
    for i, (t, w, st) in enumerate(tries):
        try:
            _ssd_scan_kernel[grid](*args, **consts, SEGMENTED=n_seg > 1, BLOCK_T=t, num_warps=w, num_stages=st)
            break
        except OutOfResources:
            if i == len(tries) - 1:
                raise
            log.warning("SSD scan: BLOCK_T=%d, %d warps, %d stages do not fit this GPU; trying %s", t, w, st,
                        tries[i + 1])
    if chosen and i:
        _FALLBACK[key] = tries[i]
    return y, final
