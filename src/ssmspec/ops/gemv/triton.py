"""One Triton kernel for the decode GEMVs of a block, with the norm that precedes them in its prologue.

``_norm_gemv_kernel``: out (M, N) = h (M, K) @ W (N, K)^T (+ bias) for M <= 16 rows, one launch a call.
The grid is (column blocks of BLOCK_N output rows) x (SPLIT slices of K); every program walks its slice in
BLOCK_K chunks and keeps an fp32 accumulator (BLOCK_N, 16) for every row of h, so W is read exactly once. The
product is one ``tl.dot`` a chunk with W as the left operand ("swap AB": the weight rows fill the MMA's M side,
the few rows of h its 16-wide N side). With SPLIT > 1 (too few column blocks to fill the GPU) the slices meet in
the same launch, not in a second reduce launch as cuBLAS's split-K: each program stores its partial (fp32, to
L2), then, after a CTA barrier, one acq_rel atomic on its column block's counter (the conv + SSM kernel's
pattern, ``ops/conv_ssm_update``); the program that arrives last sums the SPLIT
partials in slice order (so the result does not depend on the arrival order), writes the output and sets the
counter back to zero. The counters are per weight and kept for the process (``_counters``).

h is made on the fly from what the block has, chunk by chunk (``NORM``):
- 0: h = x (``linear_small``);
- 1: h = RMSNorm(x + residual) * norm_weight (``add_rms_norm_linear``): a first pass over K sums the squares
  of the rows (x and the residual are a few KB and stay in L2, so every program recomputing them is cheap);
  program 0 alone writes the new residual in that pass;
- 2: h = GroupRMSNorm(y * silu(z)) * norm_weight (``gated_norm_linear``): K is walked group by group, each
  group's first pass gives its rms, its second pass multiplies.
Rounding follows the unfused path step for step (``ops/norm/naive.py``): the residual sum in the residual
dtype, then the weight dtype; the normed value rounded to the activation dtype; h rounded to W's dtype before
the product (bf16 x bf16 products are exact in the fp32 accumulator, fp32 inputs use IEEE fp32 dots).

Blocks by rule (``_config``), not autotuned (a tuner would compile every config for every shape a model
decodes with). The interpreter runs one small config. The models use these kernels when
``SSMSPEC_DECODE_FUSION`` names them (``ops.dispatch.decode_fusion``): ``gemv`` (the plain GEMV, on by default:
within 2% of cuBLAS or faster at M = 1 on one H100) and ``norm_gemv`` (opt-in: the fused norms take 1.8-3.2x
norm + cuBLAS; each program's serial pass over K for the norm's statistics comes before its weight stream).
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.capture import capturing
from ssmspec.ops.dispatch import interpret_mode
from ssmspec.ops.gemv import MAX_M
from ssmspec.ops.norm.naive import residual_dtype
from ssmspec.ops.triton_common import check_float, dummy, gdc_enter, pdl_args, silu

_BLOCK_M = MAX_M  # the accumulator holds every row of h: the MMA N side, 16 wide
_INTERPRET_BLOCKS = dict(BLOCK_N=16, BLOCK_K=32)
_INTERPRET_SPLIT = 2  # K slices under the interpreter (tests set 1 and 3 too)


@triton.jit
def _prologue(x_ptr, r_ptr, z_ptr, rm, rk, mask, x_row, r_row, z_row,
              NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RES_TY: tl.constexpr):
    """The pre-norm value of one (BLOCK_M, BLOCK_K) chunk in fp32: x + residual rounded as the residual
    stream (NORM 1), y * silu(z) (NORM 2), x (NORM 0)."""
    x = tl.load(x_ptr + rm[:, None] * x_row + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM == 1:
        if HAS_RESIDUAL:
            x += tl.load(r_ptr + rm[:, None] * r_row + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        x = x.to(RES_TY).to(tl.float32)
    if NORM == 2:
        z = tl.load(z_ptr + rm[:, None] * z_row + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        x = x * silu(z)
    return x


@triton.jit
def _prefetch_rows(w_ptr, rn, n_mask, w_row, k0, k_hi, LINES: tl.constexpr, LINE: tl.constexpr):
    """L2 prefetch of the first LINES 128-byte lines (LINE elements each) of this program's weight rows from
    column k0 on: one ``prefetch.global.L2`` a line, no registers held (lines past the slice or the rows name the
    weight's first element instead, a harmless repeat)."""
    cols = k0 + tl.arange(0, LINES) * LINE  # (LINES,)
    ok = n_mask[:, None] & (cols < k_hi)[None, :]
    ptrs = tl.where(ok, w_ptr + rn[:, None] * w_row + cols[None, :], w_ptr)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _norm_gemv_kernel(x_ptr, r_ptr, z_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, part_ptr, cnt_ptr,
                      M, N, K, k_split, group_size, eps, x_row, r_row, z_row, w_row, o_row, ro_row,
                      NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr,
                      HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      USE_GDC: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0, LINE: tl.constexpr = 64):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)  # which of the SPLIT slices of K, each k_split channels (a multiple of BLOCK_K)
    ks0 = pid_k * k_split
    ks1 = tl.minimum(ks0 + k_split, K)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output columns of this program
    rm = tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of x
    n_mask, m_mask = rn < N, rm < M
    if USE_GDC:
        if PREFETCH_LINES > 0:  # the weights never depend on the kernels before: start their stream before the wait
            _prefetch_rows(w_ptr, rn, n_mask, w_row, ks0, ks1, PREFETCH_LINES, LINE)
    gdc_enter(USE_GDC)  # programmatic dependent launch (ops/triton_common.py): nothing above reads memory but W
    W_TY: tl.constexpr = w_ptr.dtype.element_ty
    RES_TY: tl.constexpr = res_out_ptr.dtype.element_ty
    X_TY: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    g_first = (ks0 // group_size) * group_size
    for g0 in range(g_first, ks1, group_size):  # the groups this slice touches: one (all of K) unless NORM == 2
        g_end = tl.minimum(g0 + group_size, K)
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if NORM != 0:  # first pass: sum of squares of the pre-norm rows over the group, (BLOCK_M,)
            sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(g0, g_end, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                mask = m_mask[:, None] & (rk < g_end)[None, :]
                s = _prologue(x_ptr, r_ptr, z_ptr, rm, rk, mask, x_row, r_row, z_row, NORM, HAS_RESIDUAL, RES_TY)
                if STORE_RESIDUAL:
                    if (pid == 0) & (pid_k == 0):  # the new residual stream, written once
                        tl.store(res_out_ptr + rm[:, None] * ro_row + rk[None, :], s.to(RES_TY), mask=mask)
                if NORM == 1:  # the norm reads the residual sum in its weight's dtype
                    s = s.to(W_TY).to(tl.float32)
                sq += tl.sum(s * s, axis=1)
            rstd = 1.0 / tl.sqrt(sq / (g_end - g0) + eps)
        k_lo = tl.maximum(g0, ks0)
        k_hi = tl.minimum(g_end, ks1)
        for k0 in range(k_lo, k_hi, BLOCK_K):  # the GEMV over the group's channels in this slice
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < k_hi
            mask = m_mask[:, None] & k_mask[None, :]
            h = _prologue(x_ptr, r_ptr, z_ptr, rm, rk, mask, x_row, r_row, z_row, NORM, HAS_RESIDUAL, RES_TY)
            if NORM == 1:
                h = h.to(W_TY).to(tl.float32)
            if NORM != 0:
                nw = tl.load(nw_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
                h = h * rstd[:, None]
                if NORM == 2:  # the gated norm rounds to the activation dtype before its weight
                    h = h.to(X_TY).to(tl.float32)
                h = h * nw[None, :]
            w = tl.load(w_ptr + rn[:, None] * w_row + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            h = h.to(W_TY)  # F.linear's operand dtype
            if IEEE:  # fp32 weights, and the interpreter (its bf16 dot is wrong): the same products in fp32
                acc += tl.dot(w.to(tl.float32), tl.trans(h.to(tl.float32)), input_precision="ieee")  # (BLOCK_N, BLOCK_M)
            else:
                acc += tl.dot(w, tl.trans(h))
    if SPLIT > 1:  # the slices meet in one launch: partials to L2, the block's last program sums them
        part = part_ptr + rn[:, None] * BLOCK_M + rm[None, :]  # (BLOCK_N, BLOCK_M) of slice pid_k
        tl.store(part + pid_k * N * BLOCK_M, acc, mask=n_mask[:, None])
        # the scalar atomic is one thread's: a CTA barrier first, so its release covers every thread's stores
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel") == SPLIT - 1:  # every other slice has stored
            tl.debug_barrier()  # the acquire (one thread's) before any thread reads the partials (from L2: .cg)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT):  # in slice order: the sum does not depend on which slice came last
                acc += tl.load(part + s * N * BLOCK_M, mask=n_mask[:, None], other=0.0, cache_modifier=".cg")
            tl.store(cnt_ptr + pid, 0)  # left at zero for the next launch
            _epilogue(acc, b_ptr, out_ptr, rn, rm, n_mask, m_mask, o_row, W_TY, HAS_BIAS)
    else:
        _epilogue(acc, b_ptr, out_ptr, rn, rm, n_mask, m_mask, o_row, W_TY, HAS_BIAS)


@triton.jit
def _epilogue(acc, b_ptr, out_ptr, rn, rm, n_mask, m_mask, o_row, W_TY: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(+ bias), rounded as F.linear's output, stored transposed: acc is (BLOCK_N, BLOCK_M)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + rm[None, :] * o_row + rn[:, None], acc.to(W_TY).to(out_ty),
             mask=n_mask[:, None] & m_mask[None, :])


PREFETCH_ENV = "SSMSPEC_GEMV_PREFETCH"
PREFETCH_DEFAULT = 8  # 128-byte lines a weight row: two 256-column chunks of bf16 (a guess until a GPU sweep)


def prefetch_lines() -> int:
    """Lines of each weight row a PDL launch prefetches before its wait: ``SSMSPEC_GEMV_PREFETCH`` (a power of two
    up to 64, or 0), default ``PREFETCH_DEFAULT``."""
    raw = os.environ.get(PREFETCH_ENV, str(PREFETCH_DEFAULT))
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n != 0 and (n < 0 or n > 64 or n & (n - 1)):
        raise ValueError(f"{PREFETCH_ENV}={raw!r}: give a power of two up to 64 (128-byte lines of each weight row "
                         f"prefetched before a PDL launch waits) or 0 for none")
    return n


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _config(N: int, K: int, sms: int, elem: int = 2) -> dict:
    """Blocks, K slices and warps by rule, not autotuned (a tuner compiled every config for every (M, N, K) a model
    decodes with: minutes per run). From a sweep of 48 configs (BLOCK_N 16-64, BLOCK_K 256/512, SPLIT 1-8, 3/4
    stages) at M = 1 and 4 on one H100, commit 27285b5, over the six projections of mamba2-2.7b and nemotron-h-4b:
    BLOCK_N 64, BLOCK_K 256, 4 warps, 4 stages was the best or within 3% of it on every one; K in two slices was
    best where the column blocks alone fill less than half the SMs (out_proj and down_proj: 40-48 blocks on 132
    SMs), one slice elsewhere. So: as many slices as fit the SMs once (at most 8), one when the blocks fill them.
    ``elem``: bytes per weight element; fp32 weights (tests, CPU-trained checkpoints) take chunks half as wide, so
    the four stages fit the shared memory (bf16's blocks in fp32 ask 240 KB of the H100's 227)."""
    bn, bk = 64, min(512 // elem, max(triton.next_power_of_2(K), 64))
    blocks = triton.cdiv(N, bn)
    split = max(1, min(sms // blocks, triton.cdiv(K, bk), 8))
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split, "num_warps": 4, "num_stages": 4}


def _interpret_config(K: int) -> dict:
    """The interpreter's small blocks; K in up to ``_INTERPRET_SPLIT`` slices so the tests run the split-K sum."""
    return {**_INTERPRET_BLOCKS, "SPLIT": max(1, min(_INTERPRET_SPLIT, triton.cdiv(K, _INTERPRET_BLOCKS["BLOCK_K"])))}


def _rows(t: Tensor, k: int, name: str) -> Tensor:
    """(..., K) -> (M, K) with unit channel stride (a copy only when the rows cannot be flattened)."""
    if t.shape[-1] != k:
        raise ValueError(f"{name} must end in the weight's K={k} channels, got shape {tuple(t.shape)}")
    t2 = t.reshape(-1, k)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, h_dtype: torch.dtype) -> tuple[int, int, int]:
    """(M, N, K) after the checks every entry point shares; ``h_dtype``: the dtype h has before the product."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be (N, K), got shape {tuple(weight.shape)}")
    N, K = weight.shape
    M = math.prod(x.shape[:-1])
    if M > MAX_M:
        raise ValueError(f"the GEMV kernel takes at most {MAX_M} rows (got M = {M}); use F.linear for larger batches")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None:
            check_float(name, t)
    if h_dtype != weight.dtype:
        raise ValueError(f"the GEMV's input (x, or the norm's output: {h_dtype}) and weight ({weight.dtype}) must "
                         f"share a dtype, as F.linear needs; cast x, the norm weight or the weight")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be (N,) = ({N},), got {tuple(bias.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("weight must have unit stride along K (an nn.Linear weight); pass weight.contiguous()")
    return M, N, K


_COUNTERS: dict[tuple, Tensor] = {}  # (device, weight's address, column blocks) -> int32 zeros each launch leaves zero


def _counters(weight: Tensor, blocks: int) -> Tensor | None:
    """The split-K arrival counters of one weight: kept for the process (a captured graph holds their address,
    so they are never freed). Calls on one weight never overlap: a model runs its layers in order, one call at a
    time, and the draft and the target (two streams) have weights of their own. None while a CUDA graph is
    being captured and the weight has none yet: zeros made then would be a node of that graph, zero only once it
    replays (the engines run a step eagerly before they capture, which makes them)."""
    key = (weight.device, weight.data_ptr(), blocks)
    cnt = _COUNTERS.get(key)
    if cnt is None:
        if capturing(weight.device):
            return None
        cnt = _COUNTERS[key] = torch.zeros(blocks, dtype=torch.int32, device=weight.device)
    return cnt


def _launch(x2, r2, z2, nw, weight, bias, out, res_out, *, M, N, K, group_size, eps, norm, store):
    if M == 0:
        return
    interp = interpret_mode() or not x2.is_cuda
    cfg = (_interpret_config(K) if interp else _config(N, K, _sm_count(x2.device), weight.element_size())).copy()
    split = cfg.pop("SPLIT")
    k_split = triton.cdiv(triton.cdiv(K, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]  # whole chunks per slice
    split = triton.cdiv(K, k_split)  # no empty slice
    blocks = triton.cdiv(N, cfg["BLOCK_N"])
    cnt = _counters(weight, blocks) if split > 1 else dummy(x2)
    if cnt is None:  # no counters to be had inside this capture: the whole of K in every program
        split, k_split, cnt = 1, K, dummy(x2)
    part = torch.empty((split, N, _BLOCK_M), dtype=torch.float32, device=x2.device) if split > 1 else dummy(x2)
    args = (x2, r2 if r2 is not None else dummy(x2), z2 if z2 is not None else dummy(x2),
            nw if nw is not None else dummy(weight), weight, bias if bias is not None else dummy(weight), out,
            res_out if store else dummy(x2), part, cnt, M, N, K, k_split, group_size, float(eps), x2.stride(0),
            r2.stride(0) if r2 is not None else 0, z2.stride(0) if z2 is not None else 0, weight.stride(0),
            out.stride(0), res_out.stride(0) if store else 0)
    flags = dict(NORM=norm, HAS_RESIDUAL=r2 is not None, STORE_RESIDUAL=store, HAS_BIAS=bias is not None,
                 IEEE=weight.dtype == torch.float32 or not x2.is_cuda, BLOCK_M=_BLOCK_M, SPLIT=split)
    pdl = pdl_args(x2)
    if pdl["USE_GDC"]:  # lines of each weight row to prefetch before the wait (SSMSPEC_GEMV_PREFETCH; 0: none)
        pdl.update(PREFETCH_LINES=prefetch_lines(), LINE=128 // weight.element_size())
    _norm_gemv_kernel[(blocks, split)](*args, **flags, **cfg, **pdl)


def linear_small_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Triton form of ``linear_small`` (see ``ssmspec.ops.gemv``)."""
    M, N, K = _check(x, weight, bias, x.dtype)
    x2 = _rows(x, K, "x")
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    _launch(x2, None, None, None, weight, bias, out.view(-1, N), None, M=M, N=N, K=K, group_size=max(K, 1),
            eps=0.0, norm=0, store=False)
    return out


def add_rms_norm_linear_triton(x: Tensor, residual: Tensor | None, norm_weight: Tensor, weight: Tensor,
                               bias: Tensor | None = None, *, eps: float,
                               residual_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    """Triton form of ``add_rms_norm_linear`` (see ``ssmspec.ops.gemv``)."""
    M, N, K = _check(x, weight, bias, norm_weight.dtype)
    if norm_weight.shape != (K,):
        raise ValueError(f"norm_weight must be (K,) = ({K},), got {tuple(norm_weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    check_float("norm_weight", norm_weight)
    if residual is not None:
        check_float("residual", residual)
    x2 = _rows(x, K, "x")
    r2 = _rows(residual, K, "residual") if residual is not None else None
    rdtype = residual_dtype(x, residual, residual_in_fp32)
    store = residual is not None or rdtype != x.dtype  # nothing to add or cast: the new residual is x
    res_out = torch.empty(x.shape, dtype=rdtype, device=x.device) if store else x
    out = torch.empty(*x.shape[:-1], N, dtype=weight.dtype, device=x.device)
    _launch(x2, r2, None, norm_weight, weight, bias, out.view(-1, N), res_out.view(-1, K) if store else None,
            M=M, N=N, K=K, group_size=max(K, 1), eps=eps, norm=1, store=store)
    return out, res_out


def gated_norm_linear_triton(y: Tensor, z: Tensor, norm_weight: Tensor, weight: Tensor, bias: Tensor | None = None,
                             *, group_size: int, eps: float) -> Tensor:
    """Triton form of ``gated_norm_linear`` (see ``ssmspec.ops.gemv``)."""
    M, N, K = _check(y, weight, bias, torch.promote_types(y.dtype, norm_weight.dtype))
    if z.shape != y.shape or norm_weight.shape != (K,):
        raise ValueError(f"need y, z (..., K) and norm_weight (K,) with K={K}; got {tuple(y.shape)}, "
                         f"{tuple(z.shape)}, {tuple(norm_weight.shape)}")
    if group_size <= 0 or K % group_size:
        raise ValueError(f"group_size must divide K={K}, got {group_size}")
    check_float("z", z)
    check_float("norm_weight", norm_weight)
    y2, z2 = _rows(y, K, "y"), _rows(z, K, "z")
    out = torch.empty(*y.shape[:-1], N, dtype=weight.dtype, device=y.device)
    _launch(y2, None, z2, norm_weight, weight, bias, out.view(-1, N), None, M=M, N=N, K=K, group_size=group_size,
            eps=eps, norm=2, store=False)
    return out
