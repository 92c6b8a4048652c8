"""Jit helpers of the SSD scan kernel (``triton.py``): its tensor-core product ``_mm``, and the helpers for the
options of ``ssd_chunk_scan`` beyond the fixed-length scan of discretized dt: dt discretized in the kernel, the
output's D·x and silu(z) gate, and several sequences in one row (``seq_idx`` / ``cu_seqlens``), each behind a
constexpr flag so the fixed-length kernel is unchanged.

Sequences in a row. A sequence starts at token t > 0 where seq_idx[t] != seq_idx[t - 1]. Inside a tile the
starts cut the tokens into local runs r = 0, 1, ..., R (``_seq_marks``: r_t counts the starts at or before t in
the tile); run 0 continues the state carried into the tile, run r >= 1 starts from zero -- or, packed
(``cu_seqlens``), from its sequence's initial state. The intra-tile weights W[i, j] are masked to r_i = r_j, and
each run reads and carries its own entry state E_r (``_run_states``), with a_t = A·dt_t and c_r the sum of a_t
over the runs before r:

    y_t  += exp(cum_t − c_r)·(E_r C_t)                                   for t in run r
    F_r   = exp(c_{r+1} − c_r)·E_r + Σ_{j in r} exp(c_{r+1} − cum_j)·dt_j·x_j B_jᵀ   (the state at r's end)

F_R is the state carried on; F_r for r < R is a sequence that ends inside the tile, stored where it ends (packed
rows: one final state per sequence). A tile without a start runs the loop once: the fixed-length tile's work.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmspec.ops.triton_common import discretize


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST: the operands (already rounded to bf16) go in as fp32 -- the
    same products, exactly -- because the CPU interpreter's bf16 tl.dot returns garbage (Triton 3.x)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _discretized(dt, mask_t, bias, lo, hi, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """Raw dt (T,) -> clamp(softplus(dt + bias)) on the tile's tokens, 0 past its end (no decay, no input)."""
    return tl.where(mask_t, discretize(dt, bias, lo, hi, DT_SOFTPLUS, HAS_LIMIT), 0.0)


@triton.jit
def _epilogue(y, xt, tok, mask_t, offs_p, mask_p, Dv, z_base, z_l, z_p,
              HAS_D: tl.constexpr, D_HAS_P: tl.constexpr, HAS_Z: tl.constexpr):
    """y (T, BP) fp32 -> (y + D·x)·silu(z); Dv the head's scalar D, or its (BP,) row of D (H, P) when D_HAS_P."""
    if HAS_D:
        if D_HAS_P:
            y += Dv[None, :] * xt.to(tl.float32)
        else:
            y += Dv * xt.to(tl.float32)
    if HAS_Z:
        zt = tl.load(z_base + tok[:, None] * z_l + offs_p[None, :] * z_p, mask=mask_t[:, None] & mask_p[None, :],
                     other=0.0).to(tl.float32)  # (T, BP)
        y = y * zt * tl.sigmoid(zt)
    return y


@triton.jit
def _seq_marks(seq_base, tok, mask_t, t0, seq_l):
    """The tile's local runs: r (T,) int32 (-1 past the tile's end), R = the starts inside the tile, and the
    sequence id of the token before the tile (of its first token at the row's start)."""
    sq = tl.load(seq_base + tok * seq_l, mask=mask_t, other=0)
    first = mask_t & (tok > 0)
    prev = tl.load(seq_base + (tok - 1) * seq_l, mask=first, other=0)
    starts = (first & (sq != prev)).to(tl.int32)  # (T,) 1 where a sequence starts
    r = tl.where(mask_t, tl.cumsum(starts, axis=0), -1)
    sid0 = tl.load(seq_base + tl.maximum(t0 - 1, 0).to(tl.int64) * seq_l).to(tl.int64)
    return r, tl.sum(starts, axis=0), sid0


@triton.jit
def _readout(y, Ct, E, cum, c0, in_k, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """y (T, BP) += exp(cum_t - c0)·(E C_t) on the run's tokens: the entry state E (BP, BN) read by the run."""
    rd = tl.exp(tl.where(in_k, cum - c0, float("-inf")))  # (T,) 0 outside the run
    return y + rd[:, None] * _mm(Ct, tl.trans(E.to(Ct.dtype)), PRECISION, UPCAST)


@triton.jit
def _run_states(S, y, Ct, xt, Bt, dt, cum, r, n_runs, sid0, A, s0_ptr, sf_ptr, blk_s0, blk_sf, mask_pn,
                s0_b, sf_b, READ: tl.constexpr, STORE: tl.constexpr, SEQ_INIT: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One tile's runs (module docstring): adds the entry states' readouts to y (READ), stores the state where a
    packed sequence ends (STORE; sequence ids are consecutive there, run k belongs to sequence sid0 + k) and
    returns the state carried on and y. SEQ_INIT: run k >= 1 starts from initial state sid0 + k, else zeros."""
    a = A * dt  # (T,) log-decay per token, 0 past the tile's end
    for k in range(0, n_runs + 1):
        in_k = r == k
        c0 = tl.sum(tl.where(r < k, a, 0.0), axis=0)  # log-decay from the tile start to the run's start
        c1 = c0 + tl.sum(tl.where(in_k, a, 0.0), axis=0)  # ... to the run's end
        if k == 0:
            E = S
        else:
            if SEQ_INIT:
                E = tl.load(s0_ptr + (sid0 + k) * s0_b + blk_s0, mask=mask_pn, other=0.0).to(tl.float32)
            else:
                E = tl.zeros_like(S)
        if READ:  # a run from zeros reads nothing
            if SEQ_INIT:
                y = _readout(y, Ct, E, cum, c0, in_k, PRECISION, UPCAST)
            elif k == 0:
                y = _readout(y, Ct, E, cum, c0, in_k, PRECISION, UPCAST)
        w = tl.exp(tl.where(in_k, c1 - cum, float("-inf"))) * dt  # (T,)
        xw = (xt.to(tl.float32) * w[:, None]).to(xt.dtype)  # (T, BP)
        F = E * tl.exp(c1 - c0) + _mm(tl.trans(xw), Bt, PRECISION, UPCAST)
        if k < n_runs:
            if STORE:
                tl.store(sf_ptr + (sid0 + k) * sf_b + blk_sf, F, mask=mask_pn)
        else:
            S = F
    return S, y
