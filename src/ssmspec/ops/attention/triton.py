"""Decode attention over a preallocated KV cache (flash-decoding, split over the committed slots).

Launch 1, ``_split_kernel``, grid (B' * Hkv * M-blocks, splits + 1): a program takes one model row, one KV
head and a block of its BLOCK_M query rows (token t, query head g of the GQA group, m = t * G + g, so the
G heads sharing a KV head read each key once). Programs 0 .. splits-1 cut the row's committed range
[start, min(length - kv_hide, ctx_len)) into equal chunks (sized from the row's own length, so every split
works at any fill level and slots past the length are never read); program ``splits`` takes the call's
own L keys under the causal / tree mask and the valid mask. Each writes an unnormalised partial output
with its running max and sum (fp32, base-2 logits, Milakov & Gimelshein's online softmax).
Program ``splits`` of M-block 0 also writes the call's keys/values into the cache's pending scratch
(``store_k/v``) when given, which saves ``KVCache.attend`` two copy launches.
Launch 2, ``_combine_kernel``, one program per (row, query head, token), merges the partials.

Fixed grid and allocation sizes from host ints only (B', L, heads, ctx_len): graph-capturable. Not
autotuned (it writes the pending scratch in place); BLOCK_N is set by hand so the pipelined K/V tiles fit
shared memory (compiled for sm_90, sizes from the kernel metadata: bf16 at 64 slots 22-65 KB; fp32 at 32
slots up to D = 128 and 16 above, at most 135 KB of the H100's 227 KB).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.dispatch import interpret_mode
from ssmspec.ops.triton_common import check_float, dummy

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs (and every dtype on the CPU interpreter, whose bf16 dot is wrong): exact products
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _committed_range(row, seq_ptr, start_ptr, length_ptr, hide_ptr, ctx_len, HAS_SEQ: tl.constexpr,
                     HAS_HIDE: tl.constexpr):
    """Sequence of ``row`` and its visible committed slots [lo, hi) (hi < lo when none)."""
    seq = row
    if HAS_SEQ:
        seq = tl.load(seq_ptr + row).to(tl.int32)
    lo = tl.load(start_ptr + seq).to(tl.int32)
    hi = tl.load(length_ptr + seq).to(tl.int32)
    if HAS_HIDE:
        hi -= tl.load(hide_ptr + row).to(tl.int32)
    return seq, lo, tl.minimum(hi, ctx_len)


@triton.jit
def _split_kernel(q_ptr, kc_ptr, vc_ptr, kn_ptr, vn_ptr, start_ptr, length_ptr, seq_ptr, hide_ptr, tree_ptr,
                  valid_ptr, o_ptr, ml_ptr, pk_ptr, pv_ptr, L, G, Hkv, D, ctx_len, n_splits, n_mblocks, qk_scale,
                  q_b, q_l, q_h, kc_b, kc_h, kc_s, vc_b, vc_h, vc_s, kn_b, kn_l, kn_h, vn_b, vn_l, vn_h,
                  tr_b, tr_i, tr_j, va_b, va_l, o_b, o_h, o_l, o_s, ml_b, ml_h, ml_l, ml_s,
                  pk_b, pk_h, pk_l, pv_b, pv_h, pv_l, STORE_NEW: tl.constexpr, HAS_SEQ: tl.constexpr,
                  HAS_HIDE: tl.constexpr, HAS_TREE: tl.constexpr, HAS_VALID: tl.constexpr,
                  IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mb = pid % n_mblocks
    hkv = (pid // n_mblocks) % Hkv
    row = pid // (n_mblocks * Hkv)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < L * G
    t = offs_m // G  # query token
    h = hkv * G + offs_m % G  # query head
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(q_ptr + row * q_b + t[:, None] * q_l + h[:, None] * q_h + offs_d[None], mask=mask_m[:, None] & mask_d[None],
                other=0.0)  # (BLOCK_M, BLOCK_D)
    seq, lo, hi = _committed_range(row, seq_ptr, start_ptr, length_ptr, hide_ptr, ctx_len, HAS_SEQ, HAS_HIDE)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if split < n_splits:  # a chunk of the committed slots, the same for every query of the row
        n = tl.maximum(hi - lo, 0)
        chunk = tl.cdiv(tl.cdiv(n, n_splits), BLOCK_N) * BLOCK_N
        s_lo = lo + split * chunk
        s_hi = tl.minimum(s_lo + chunk, hi)
        kc = kc_ptr + seq.to(tl.int64) * kc_b + hkv * kc_h
        vc = vc_ptr + seq.to(tl.int64) * vc_b + hkv * vc_h
        for n0 in range(s_lo, s_hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < s_hi
            kv_mask = mask_n[:, None] & mask_d[None]
            k = tl.load(kc + offs_n[:, None] * kc_s + offs_d[None], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
            s = _dot(q, tl.trans(k), IEEE) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
            s = tl.where(mask_n[None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every block holds a visible slot
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            v = tl.load(vc + offs_n[:, None] * vc_s + offs_d[None], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
    else:  # the call's own keys: causal or tree mask, valid columns
        offs_j = tl.arange(0, BLOCK_L)
        mask_j = offs_j < L
        nv_mask = mask_j[:, None] & mask_d[None]
        k = tl.load(kn_ptr + row * kn_b + offs_j[:, None] * kn_l + hkv * kn_h + offs_d[None], mask=nv_mask, other=0.0)
        v = tl.load(vn_ptr + row * vn_b + offs_j[:, None] * vn_l + hkv * vn_h + offs_d[None], mask=nv_mask, other=0.0)
        if STORE_NEW:  # the KV cache's pending scratch, (rows, Hkv, max_new, D): saves two copy launches
            if mb == 0:
                tl.store(pk_ptr + row * pk_b + hkv * pk_h + offs_j[:, None] * pk_l + offs_d[None], k, mask=nv_mask)
                tl.store(pv_ptr + row * pv_b + hkv * pv_h + offs_j[:, None] * pv_l + offs_d[None], v, mask=nv_mask)
        s = _dot(q, tl.trans(k), IEEE) * qk_scale  # (BLOCK_M, BLOCK_L)
        if HAS_TREE:
            ok = tl.load(tree_ptr + row * tr_b + t[:, None] * tr_i + offs_j[None] * tr_j, mask=mask_m[:, None] & mask_j[None],
                         other=0) != 0
        else:
            ok = offs_j[None] <= t[:, None]
        ok = ok & mask_j[None]
        if HAS_VALID:
            ok = ok & (tl.load(valid_ptr + row * va_b + offs_j * va_l, mask=mask_j, other=0) != 0)[None]
        # a query that sees nothing (a pad token with no context) attends to itself, as the SDPA twin does
        empty = (tl.sum(ok.to(tl.int32), axis=1) == 0) & (hi <= lo)
        ok = ok | (empty[:, None] & (offs_j[None] == t[:, None]))
        s = tl.where(ok, s, float("-inf"))
        m_i = tl.max(s, axis=1)  # -inf where a query sees no new key
        p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        acc = _dot(p.to(v.dtype), v, IEEE)
        l_i = tl.sum(p, axis=1)
    o = o_ptr + row * o_b + h[:, None] * o_h + t[:, None] * o_l + split * o_s + offs_d[None]
    tl.store(o, acc, mask=mask_m[:, None] & mask_d[None])
    ml = ml_ptr + row * ml_b + h * ml_h + t * ml_l + split * ml_s
    tl.store(ml, m_i, mask=mask_m)
    tl.store(ml + 1, l_i, mask=mask_m)


@triton.jit
def _combine_kernel(o_ptr, ml_ptr, out_ptr, Hq, L, D, n_parts, o_b, o_h, o_l, o_s, ml_b, ml_h, ml_l, ml_s,
                    out_b, out_l, out_h, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    t = pid % L
    h = (pid // L) % Hq
    row = pid // (L * Hq)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < n_parts
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    ml = ml_ptr + row * ml_b + h * ml_h + t * ml_l + offs_s * ml_s
    m = tl.load(ml, mask=mask_s, other=float("-inf"))  # (BLOCK_S,)
    lsum = tl.load(ml + 1, mask=mask_s, other=0.0)
    m_max = tl.max(m, axis=0)  # finite: every query sees at least one key
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    acc = tl.load(o_ptr + row * o_b + h * o_h + t * o_l + offs_s[:, None] * o_s + offs_d[None],
                  mask=mask_s[:, None] & mask_d[None], other=0.0)  # (BLOCK_S, BLOCK_D)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
    tl.store(out_ptr + row * out_b + t * out_l + h * out_h + offs_d, out, mask=mask_d)


@functools.lru_cache(maxsize=None)
def _programs_wanted(device: torch.device) -> int:
    """About two waves of programs on a GPU (132 SMs on an H100); a few on the CPU interpreter."""
    if device.type != "cuda":
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _check(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, start: Tensor, length: Tensor,
           seq_index, kv_hide, tree_mask, valid) -> None:
    Bp, L, Hq, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (Bp, L) or k.shape[3] != D or Hq % k.shape[2]:
        raise ValueError(f"need q (B', L, Hq, D) and k, v (B', L, Hkv, D) with Hq a multiple of Hkv; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    Hkv = k.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[1] != Hkv or k_cache.shape[3] != D:
        raise ValueError(f"k_cache, v_cache must be (B, Hkv={Hkv}, max_len, D={D}); got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    B = k_cache.shape[0]
    if start.shape != (B,) or length.shape != (B,):
        raise ValueError(f"start and length must be ({B},), got {tuple(start.shape)}, {tuple(length.shape)}")
    for name, t, shape in (("seq_index", seq_index, (Bp,)), ("kv_hide", kv_hide, (Bp,)),
                           ("tree_mask", tree_mask, (Bp, L, L)), ("valid", valid, (Bp, L))):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")
    if L > 64:
        raise ValueError(f"the decode kernel takes calls of at most 64 new tokens, got L={L}; use the SDPA path "
                         f"(backend='reference') for prompts")
    if D > 256:
        raise ValueError(f"head dim {D} exceeds the kernel's 256; use backend='reference'")
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(name, t)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last (head) dim, got strides {t.stride()}")


def _check_store(k: Tensor, store_k: Tensor | None, store_v: Tensor | None) -> None:
    if (store_k is None) != (store_v is None):
        raise ValueError("store_k and store_v go together: pass both or neither")
    if store_k is None:
        return
    Bp, L, Hkv, D = k.shape
    for name, t in (("store_k", store_k), ("store_v", store_v)):
        if (t.dim() != 4 or t.shape[0] < Bp or t.shape[1] != Hkv or t.shape[2] < L or t.shape[3] != D
                or t.stride(-1) != 1 or t.dtype != k.dtype):
            raise ValueError(f"{name} must be ({Bp}+, {Hkv}, {L}+, {D}) in {k.dtype} with unit head-dim stride, got "
                             f"{tuple(t.shape)} {t.dtype}")


def decode_attention_triton(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, start: Tensor,
                            length: Tensor, *, ctx_len: int, scale: float, seq_index: Tensor | None = None,
                            kv_hide: Tensor | None = None, tree_mask: Tensor | None = None,
                            valid: Tensor | None = None, splits: int | None = None, store_k: Tensor | None = None,
                            store_v: Tensor | None = None) -> Tensor:
    """Triton form of ``decode_attention`` (see ``ssmspec.ops.attention``)."""
    _check(q, k, v, k_cache, v_cache, start, length, seq_index, kv_hide, tree_mask, valid)
    _check_store(k, store_k, store_v)
    Bp, L, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    ctx_len = max(0, min(int(ctx_len), k_cache.shape[2]))
    block_m = max(16, min(64, triton.next_power_of_2(L * G)))
    block_d = max(16, triton.next_power_of_2(D))
    block_n = 64 if q.element_size() <= 2 else (32 if block_d <= 128 else 16)
    n_mblocks = triton.cdiv(L * G, block_m)
    if splits is None:  # enough programs to fill the GPU at batch 1; no chunk shorter than one block
        splits = min(max(1, _programs_wanted(q.device) // (Bp * Hkv * n_mblocks)),
                     max(1, triton.cdiv(ctx_len, block_n)))
    splits = splits if ctx_len else 0
    parts = splits + 1
    o_part = torch.empty(Bp, Hq, L, parts, D, device=q.device, dtype=torch.float32)
    ml_part = torch.empty(Bp, Hq, L, parts, 2, device=q.device, dtype=torch.float32)  # running max, sum
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if Bp == 0 or L == 0:
        return out
    d_ = dummy(start)
    store = store_k is not None
    _split_kernel[(Bp * Hkv * n_mblocks, parts)](
        q, k_cache, v_cache, k, v, start, length, seq_index if seq_index is not None else d_,
        kv_hide if kv_hide is not None else d_, tree_mask if tree_mask is not None else d_,
        valid if valid is not None else d_, o_part, ml_part, store_k if store else d_, store_v if store else d_,
        L, G, Hkv, D, ctx_len, splits, n_mblocks, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *(tree_mask.stride() if tree_mask is not None else (0, 0, 0)), *(valid.stride() if valid is not None else (0, 0)),
        *o_part.stride()[:4], *ml_part.stride()[:4], *(store_k.stride()[:3] if store else (0, 0, 0)),
        *(store_v.stride()[:3] if store else (0, 0, 0)), STORE_NEW=store, HAS_SEQ=seq_index is not None,
        HAS_HIDE=kv_hide is not None, HAS_TREE=tree_mask is not None, HAS_VALID=valid is not None,
        IEEE=q.dtype == torch.float32 or interpret_mode(), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_L=max(16, triton.next_power_of_2(L)), BLOCK_D=block_d, num_warps=4)
    _combine_kernel[(Bp * Hq * L,)](o_part, ml_part, out, Hq, L, D, parts, *o_part.stride()[:4], *ml_part.stride()[:4],
                                    out.stride(0), out.stride(1), out.stride(2), BLOCK_S=triton.next_power_of_2(parts),
                                    BLOCK_D=block_d, num_warps=1 if block_d <= 64 else 2)
    return out
