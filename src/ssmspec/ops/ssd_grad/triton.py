"""The trainable one-kernel SSD scan (seed 004, "Forward + Backward"): a sequential forward that saves states,
and a backward whose tile work is parallel across the sequence. Kernels in ``kernels.py``.

Forward (``_fwd_save_kernel``): the tile loop of ``ops/ssd/triton.py`` -- one program per chain (sequence b,
head h, BLOCK_P rows of P), the fp32 state S (BP, N) carried in registers from tile to tile -- that also
stores the state entering every ``checkpoint`` tokens into ``states`` (B, H, cdiv(L, checkpoint), P, N) (by
default no more bytes than x). A training forward is always followed by its backward, and the states
leave the forward's registers anyway, so writing one every few tiles costs at most one more x-sized write.

Backward, three launches (plus torch sums of small partials):

1. ``_bwd_dstate_kernel``, one program per (P block, b, h): the reverse carry alone, dS = dLoss/d(state), from
   the final state's gradient (zero when none) down the sequence in tiles of ``pass_block_t`` tokens,
   dS <- exp(cum_T)·dS + Σ_t e_t dy_t C_tᵀ (one (BP, T) x (T, N) product a tile), storing dS leaving every
   chunk of ``dcheckpoint`` tokens into ``dstates`` (B, H, cdiv(L, dcheckpoint), P, N); dS entering token 0 is
   the initial state's gradient (fp32). This is the only sequential part: a fraction of a tile's products,
   and linear in P, so it splits P (``block_p``) into more programs at no extra work.
2. ``_bwd_dx_kernel``, one program per (tile of ``block_t`` tokens, head, b), and 3. ``_bwd_dbc_kernel``, one
   program per (tile of ``bc_block_t`` tokens x head subset, group, b) -- thousands at training sizes, no
   carry between them. Each takes S entering its tile (the forward checkpoint at or before it, replayed forward
   over at most checkpoint / tile - 1 tiles) and dS leaving it (the dS checkpoint at or after it, replayed
   backward likewise; no replay is compiled where a checkpoint is a tile). Per tile of T tokens, with
   cum_t = Σ_{i<=t} A·dt_i, e_t = exp(cum_t), M_tj = exp(cum_t - cum_j) for j <= t (0 above),
   w_j = exp(cum_T - cum_j)·dt_j, and the forward y_t = e_t·S C_t + Σ_j M_tj dt_j (C_t·B_j) x_j + D x_t,
   S' = exp(cum_T) S + Σ_j w_j x_j B_jᵀ:

    dx_j  = Σ_t M_tj dt_j (C_t·B_j) dy_t + D dy_j + w_j·(dS B_j)                  Wᵀ dy + D dy + w ∘ (B dSᵀ)
    Z_tj  = M_tj dt_j (dy_t·x_j)                                                   (T, T)
    dC_t  = e_t·(dy_t S) + Σ_j Z_tj B_j,   dB_j = Σ_t Z_tj C_t + w_j·(x_j dS)
    dD    = Σ_t dy_t·x_t
    d cum_t = e_t dy_t·(S C_t) + Σ_j R_tj - Σ_i R_it - U_t  (+ exp(cum_T)<dS, S> + Σ_j U_j at the last token)
              with R_tj = M_tj dt_j (C_t·B_j)(dy_t·x_j), U_j = w_j x_j·(dS B_j)
    d a_i = Σ_{t>=i} d cum_t (a_i = A·dt_i),   d dt_i = Σ_t R_ti / dt_i + U_i / dt_i + A·d a_i,   dA = Σ_i dt_i d a_i

   (the quotients are computed without the division). The dx kernel takes dx, d dt, and one dA / dD partial a
   (b, tile, head), summed by torch: per head, plain stores. The dB / dC kernel loops over the heads of its
   group (they share B and C): it sums their Z blocks and their state terms e∘(dy S), w∘(x dS), then makes
   the Z products with B and C once. A program that owns the whole group stores dB, dC in their dtype; with
   n_sub = (H / G) / heads_per_program > 1 subsets (small grids), each stores its slot of (n_sub, B, L, G, N)
   fp32 that torch sums, or (``bc_atomic``) adds into one fp32 (B, L, G, N) with atomics.

Why two tile kernels and not one: ptxas (sm_90, Triton 3.9 on a CPU) counted about 1.7 KB of register spills a
thread for one kernel doing all of it in a loop over a group's heads (the loop keeps its loop-invariant address
tensors and accumulators live across the whole body), against tens of bytes for each of the two. The split
costs a second read of x, dy and the states and a second dy·xᵀ product a head. With Triton 3.6 (the GPU
image's): these kernels 0-0.5 KB at the defaults, the previous backward (one program a chain walking every
tile backwards: 2 x 128 programs at seed 004's size, a replay of up to three tiles before each tile, atomics
into dB / dC / d dt from every head and P block) 1.8-2.7 KB, the forward 1-2.2 KB.

States: bf16 for bf16 inputs (``state_bf16``; the forward's final state stays fp32): every use but <dS, S> and
the replays' start rounds them to bf16 before a product anyway, and the tile kernels read a state and a dS a
tile, the largest part of their traffic at N = 128.

Precision as in the forward: dot operands in the input dtype with fp32 accumulation (bf16 / fp16: the weights,
the states, dy·e, x·w and the summed Z rounded to that dtype before the tensor-core products), tf32x3 for fp32
inputs; decays, cumulative sums, the carried dS and every accumulator fp32.

Launch options (``LAUNCH_KEYS``, ``default_launch``) are not autotuned (an autotuner's repeated launches
would add the atomics twice); ``python -m ssmspec.bench.ssd_grad_sweep`` times a grid of them.
"""
from __future__ import annotations

import logging

import torch
import triton
from torch import Tensor
from triton.runtime.errors import OutOfResources

from ssmspec.ops.dispatch import interpret_mode
from ssmspec.ops.ssd.naive import check_ssd_shapes
from ssmspec.ops.ssd.triton import _check_block, _fallbacks
from ssmspec.ops.ssd_grad.kernels import _bwd_dbc_kernel, _bwd_dstate_kernel, _bwd_dx_kernel, _fwd_save_kernel
from ssmspec.ops.triton_common import check_float, dummy

log = logging.getLogger("ssmspec.ops.ssd_grad")

LAUNCH_KEYS = ("fwd_block_t", "fwd_block_p", "fwd_num_warps", "checkpoint", "block_t", "num_warps", "num_stages",
               "bc_block_t", "bc_num_warps", "heads_per_program", "bc_atomic", "dcheckpoint", "block_p",
               "pass_block_t", "pass_num_warps", "pass_num_stages", "state_bf16")


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def _pow2(v: int) -> int:
    return triton.next_power_of_2(max(int(v), 1))


def default_launch(L: int, P: int, N: int, *, itemsize: int, chains: int = 1, sms: int = 0, heads: int = 1,
                   groups: int = 1, bf16: bool = False, **given) -> dict:
    """Every launch option of a call (``LAUNCH_KEYS``): those ``given``, the rest from them and the shape
    (``chains``: batch x heads, ``heads`` / ``groups``: H and G, ``sms``: the GPU's SMs, 0 on CPU). Chosen from
    ``python -m ssmspec.bench.ssd_grad_sweep`` on one H200 (Triton 3.6, bf16, batch 16, 8K and 32K tokens; a
    coordinate descent from the ptxas-chosen defaults of 8eeb0e9, which it made 1.77-1.84x faster), one rule per
    state width where the best configurations differed:

    - forward: 64-token tiles at 4 warps; P blocks of 32 rows at N <= 64 (seed 004's P = N = 64: 6.50 ms at
      32K against 6.68 ms with 64 rows), all of P (up to 64) above;
    - states in bf16 for bf16 inputs (``state_bf16``; fp32 states were slower at every shape), fp32 otherwise;
    - dx kernel: 64-token tiles at 4 warps, 2 stages (at N = 128: 108 ms with 4 warps against 139 ms with 8);
    - dB / dC kernel: 128-token tiles at 8 warps at N >= 128 (93 ms against 98 ms at 64 tokens), 64-token tiles
      at 4 warps below (a given ``block_t`` sets both tiles); the whole group of heads a program (dB / dC stored once, in their dtype) unless tiles x
      groups x batch leave fewer than 8 programs an SM, then the fewest head subsets (a divisor of H / G) that
      reach it, summed from fp32 slots;
    - checkpoint: the fewest tokens, a whole number of every tile, at which the states take no more bytes than
      x (bf16 states: N tokens), so 64 at N = 64 (6.64 ms against 7.32 ms at 128) and 128 at N = 128;
      dcheckpoint: the same;
    - dS pass: all of P, halved (down to 16) while the chains x P blocks are fewer than 16 an SM (the mixers'
      1,280 chains: 32 rows, 79.5 ms against 81.5 ms at 64); tiles of up to 128 tokens (a divisor of
      dcheckpoint), 8 warps once a P block x N reaches 32 x 128, 4 below; 2 stages."""
    o = {k: int(v) for k, v in given.items() if v is not None}
    tile = max(16, _pow2(L))
    wide = N > 64
    o.setdefault("fwd_block_t", min(64, tile))
    o.setdefault("fwd_block_p", min(64 if wide else 32, max(16, _pow2(P))))
    o.setdefault("fwd_num_warps", 4)
    o.setdefault("block_t", min(64, tile))
    o.setdefault("bc_block_t", o["block_t"] if "block_t" in given else min(128 if wide else 64, tile))
    o.setdefault("state_bf16", int(bf16))
    o["state_bf16"] = int(bool(o["state_bf16"]) and bf16)
    state_bytes = 2 if o["state_bf16"] else 4
    o.setdefault("checkpoint", max(o["fwd_block_t"], o["block_t"], o["bc_block_t"],
                                   _pow2(-(-state_bytes * N // itemsize))))
    o.setdefault("dcheckpoint", max(o["checkpoint"], o["block_t"], o["bc_block_t"]))
    o.setdefault("num_warps", 4)
    o.setdefault("bc_num_warps", 8 if wide else 4)
    o.setdefault("num_stages", 2)
    hpg = max(heads // max(groups, 1), 1)
    if "heads_per_program" not in o:
        progs = max(chains // max(heads, 1), 1) * groups * triton.cdiv(max(L, 1), o["bc_block_t"])
        n_sub = next((d for d in range(1, hpg + 1) if hpg % d == 0 and progs * d >= 8 * sms), hpg) if sms else 1
        o["heads_per_program"] = hpg // n_sub
    o.setdefault("bc_atomic", 0)
    bp = max(16, _pow2(P))
    while sms and bp > 16 and chains * -(-P // bp) < 16 * sms:
        bp //= 2
    o.setdefault("block_p", bp)
    dck = o["dcheckpoint"]
    o.setdefault("pass_block_t", max(16, min(128, dck & -dck, _pow2(L))))
    o.setdefault("pass_num_warps", 8 if o["block_p"] * max(16, _pow2(N)) >= 32 * 128 else 4)
    o.setdefault("pass_num_stages", 2)
    return o


def _check_launch(o: dict, H: int, G: int) -> None:
    for k in ("fwd_block_t", "fwd_block_p", "block_t", "bc_block_t", "block_p", "pass_block_t"):
        _check_block(k, o[k])
    tiles = {k: o[k] for k in ("fwd_block_t", "block_t", "bc_block_t")}
    if o["checkpoint"] < 1 or any(o["checkpoint"] % t for t in tiles.values()):
        raise ValueError(f"checkpoint must be a positive multiple of {tiles}, got {o['checkpoint']}")
    tiles = {k: o[k] for k in ("block_t", "bc_block_t", "pass_block_t")}
    if o["dcheckpoint"] < 1 or any(o["dcheckpoint"] % t for t in tiles.values()):
        raise ValueError(f"dcheckpoint must be a positive multiple of {tiles}, got {o['dcheckpoint']}")
    hpp = o["heads_per_program"]
    if H and (hpp < 1 or (H // G) % hpp):
        raise ValueError(f"heads_per_program must divide the heads of a group ({H // G}), got {hpp}")


def _launch(kernel, make, bt: int, nw: int, stages: int, step_down: bool) -> None:
    """Launch at (BLOCK_T, num_warps, num_stages); ``make(BLOCK_T)`` gives (grid, args, consts). With
    ``step_down`` (no option given) a GPU that cannot hold them (Triton's OutOfResources at the first launch)
    gets ``ops/ssd/triton.py:_fallbacks``: one stage fewer, then halved tiles, which still divide the
    checkpoints. Options given are launched as given; a failed launch has written nothing."""
    tries = _fallbacks(bt, nw, stages) if step_down else [(bt, nw, stages)]
    for i, (t, w, st) in enumerate(tries):
        grid, args, consts = make(t)
        try:
            kernel[grid](*args, **consts, BLOCK_T=t, num_warps=w, num_stages=st)
            return
        except OutOfResources:
            if i == len(tries) - 1:
                raise
            log.warning("%s: BLOCK_T=%d, %d warps, %d stages do not fit this GPU; trying %s",
                        getattr(kernel, "fn", kernel).__name__, t, w, st, tries[i + 1])


def _state_dtype(launch: dict) -> torch.dtype:
    """The saved states' and dS checkpoints' dtype: bf16 with ``state_bf16`` (bf16 inputs only), else fp32."""
    return torch.bfloat16 if launch["state_bf16"] else torch.float32


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
    states = torch.empty(bsz, H, triton.cdiv(L, ck), P, N, dtype=_state_dtype(launch), device=x.device)
    if bsz == 0 or H == 0:
        return y, final, states
    strides = (*x.stride(), *dt.stride(), *B.stride(), *C.stride(), *(s0.stride() if s0 is not None else (0,) * 4),
               *y.stride(), *final.stride(), *states.stride()[:4])
    args = (x, dt, A, B, C, D if D is not None else dummy(A), s0 if s0 is not None else dummy(final), y, final,
            states, L, P, N, H // G, ck, *strides)
    consts = dict(HAS_D=D is not None, HAS_INIT=s0 is not None, **_consts(x), BLOCK_P=bp,
                  BLOCK_N=max(16, triton.next_power_of_2(N)))
    _launch(_fwd_save_kernel, lambda t: ((triton.cdiv(P, bp), bsz, H), args, consts), bt, launch["fwd_num_warps"],
            2, launch["step_down"])
    return y, final, states


def ssd_backward(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, s0: Tensor | None,
                 states: Tensor, dy: Tensor | None, dfinal: Tensor | None, *, launch: dict) -> tuple:
    """(dx, ddt, dA, dB, dC, dD, d initial_state) of the scan, each in its input's dtype (dD None without D,
    the last None without an initial state), from the checkpoints of ``ssd_forward_save`` and the gradients of
    y (B, L, H, P) and of the final state (B, H, P, N); either may be None (zero)."""
    bsz, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    ck, dck, hpp = launch["checkpoint"], launch["dcheckpoint"], launch["heads_per_program"]
    n_sub = (H // G) // hpp if H else 1
    atomic = bool(launch["bc_atomic"]) and n_sub > 1
    dev, f32 = x.device, torch.float32
    bn = max(16, triton.next_power_of_2(N))
    if dy is None:
        dy = x.new_zeros(()).expand(x.shape)  # only the final state was used: stride-0 zeros, nothing allocated
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    ddt = torch.empty(bsz, L, H, dtype=f32, device=dev)
    ds0 = torch.empty(bsz, H, P, N, dtype=f32, device=dev)
    dstates = torch.empty(bsz, H, triton.cdiv(L, dck), P, N, dtype=_state_dtype(launch), device=dev)
    # dB, dC: stored in B's / C's dtype by one program a group; fp32 slots a head subset, summed; or fp32 atomics
    shape_bc = (bsz, L, G, N) if atomic else (n_sub, bsz, L, G, N)
    bc_dtype = B.dtype if n_sub == 1 and B.dtype == C.dtype else f32
    dB = (torch.zeros if atomic else torch.empty)(shape_bc, dtype=bc_dtype, device=dev)
    dC = (torch.zeros if atomic else torch.empty)(shape_bc, dtype=bc_dtype, device=dev)
    parts = {}  # BLOCK_T -> the dA / dD partials (2, B, tiles, H) of that tile
    if bsz and H:
        cst = _consts(x)
        bp, bpp = launch["block_p"], max(16, triton.next_power_of_2(P))
        args = (x, dt, A, C, dy, dfinal if dfinal is not None else dummy(ds0), dstates, ds0, L, P, N, H // G, dck,
                *dt.stride(), *C.stride(), *dy.stride(), *(dfinal.stride() if dfinal is not None else (0,) * 4),
                *dstates.stride()[:4], *ds0.stride()[:3])
        consts = dict(HAS_DSF=dfinal is not None, HAS_INIT=s0 is not None, **cst, BLOCK_P=bp, BLOCK_N=bn)
        _launch(_bwd_dstate_kernel, lambda t: ((triton.cdiv(P, bp), bsz, H), args, consts), launch["pass_block_t"],
                launch["pass_num_warps"], launch["pass_num_stages"], launch["step_down"])
        common = (*x.stride(), *dt.stride(), *B.stride(), *C.stride(), *states.stride()[:4], *dstates.stride()[:3],
                  *dy.stride())

        def make_dx(t: int):
            parts[t] = torch.zeros(2, bsz, triton.cdiv(L, t), H, dtype=f32, device=dev)
            a = (x, dt, A, B, C, D if D is not None else dummy(A), states, dstates, dy, dx, ddt, parts[t][0],
                 parts[t][1], L, P, N, H // G, ck, dck, *common, *dx.stride(), *ddt.stride(), *parts[t].stride()[1:3])
            c = dict(HAS_D=D is not None, REPLAY_S=ck > t, REPLAY_DS=dck > t, **cst, BLOCK_P=bpp, BLOCK_N=bn)
            return (triton.cdiv(L, t), H, bsz), a, c

        def make_bc(t: int):
            a = (x, dt, A, B, C, states, dstates, dy, dB, dC, torch.zeros(hpp, dtype=torch.int32, device=dev), L, P,
                 N, H // G, hpp, n_sub, ck, dck, *common, *((0, *dB.stride()[:3]) if atomic else dB.stride()[:4]))
            c = dict(ATOMIC_BC=atomic, REPLAY_S=ck > t, REPLAY_DS=dck > t, **cst, BLOCK_P=bpp, BLOCK_N=bn)
            return (triton.cdiv(L, t) * n_sub, G, bsz), a, c

        if L:
            _launch(_bwd_dx_kernel, make_dx, launch["block_t"], launch["num_warps"], launch["num_stages"],
                    launch["step_down"])
            _launch(_bwd_dbc_kernel, make_bc, launch["bc_block_t"], launch["bc_num_warps"], launch["num_stages"],
                    launch["step_down"])
    elif dfinal is not None and s0 is not None:  # no chains: nothing to scan (kept for shape completeness)
        ds0.copy_(dfinal)
    if not atomic:
        dB, dC = (t.sum(0) if n_sub > 1 else t[0] for t in (dB, dC))
    if parts:
        dA, dD = parts.popitem()[1].sum((1, 2))
    else:
        dA = dD = torch.zeros(H, dtype=f32, device=dev)
    return (dx, ddt.to(dt.dtype), dA.to(A.dtype), dB.to(B.dtype), dC.to(C.dtype),
            dD.to(D.dtype) if D is not None else None, ds0.to(s0.dtype) if s0 is not None else None)


class SSDScanFunction(torch.autograd.Function):
    """(y, final state) of the one-kernel scan with its chunk-parallel backward; saves the inputs and the
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


def ssd_chunk_scan_grad_triton(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                               initial_state: Tensor | None = None, **launch) -> tuple[Tensor, Tensor]:
    """Differentiable one-kernel SSD scan. x (B, L, H, P); dt (B, L, H) discretized; A (H,); B, C (B, L, G, N),
    head h reads group h // (H / G); D (H,) or None; initial_state (B, H, P, N) or None (zeros). Any strides.
    Returns y (B, L, H, P) in x's dtype and the final state (B, H, P, N) fp32; their backward returns gradients
    for every tensor argument in its dtype. ``launch``: any of ``LAUNCH_KEYS`` (``default_launch`` fills the
    rest): the forward's tile, P block and warps; ``checkpoint``, the tokens between saved states (a multiple
    of fwd_block_t and block_t); the chunk kernel's tile ``block_t``, warps, stages, ``heads_per_program`` (a
    divisor of H / G) and ``bc_atomic``; the dS pass's ``dcheckpoint`` (a multiple of block_t and
    pass_block_t), P block ``block_p``, tile, warps and stages. The result does not depend on them up to
    rounding."""
    bsz, L, H, P, G, N = check_ssd_shapes(x, dt, A, B, C, D, initial_state)
    for name, t in (("x", x), ("B", B), ("C", C), ("dt", dt)):
        check_float(name, t)
    unknown = sorted(set(launch) - set(LAUNCH_KEYS))
    if unknown:
        raise ValueError(f"unknown launch options {unknown}; choose from {', '.join(LAUNCH_KEYS)}")
    given = {k: v for k, v in launch.items() if v is not None}
    opts = default_launch(L, P, N, itemsize=x.element_size(), chains=bsz * H, sms=_sm_count(x.device), heads=H,
                          groups=G, bf16=x.dtype == torch.bfloat16, **given)
    _check_launch(opts, H, G)
    opts["step_down"] = not given
    return SSDScanFunction.apply(x, dt, A, B, C, D, initial_state, opts)
