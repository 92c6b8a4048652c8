"""The cache lookup kernel (``ops.cache_lookup``): one program walks every row in blocks."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _cache_lookup_kernel(acc_ptr, vb_ptr, chain_ptr, cache_ptr, dep_ptr, have_ptr, bonus_ptr, src_ptr, hit_ptr,
                         branch_ptr, drafts_ptr, miss_ptr, rounds_ptr, hits_ptr, B, N, S,
                         R_BLOCK: tl.constexpr, N_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr):
    have = tl.load(have_ptr).to(tl.int32)
    n = tl.arange(0, N_BLOCK)
    dep = tl.load(dep_ptr + n, mask=n < N, other=-1)
    j = tl.arange(0, S_BLOCK)
    missing = tl.zeros([R_BLOCK], dtype=tl.int32)
    for r0 in range(0, B, R_BLOCK):
        r = (r0 + tl.arange(0, R_BLOCK)).to(tl.int64)
        inside = r < B
        acc = tl.load(acc_ptr + r, mask=inside, other=0)
        bon = tl.load(vb_ptr + r, mask=inside, other=0)
        tl.store(bonus_ptr + r, bon, mask=inside)
        tl.store(src_ptr + r, tl.load(chain_ptr + r * (S + 1) + acc, mask=inside, other=0), mask=inside)
        cell = inside[:, None] & (n < N)[None, :]
        keys = tl.load(cache_ptr + (r[:, None] * N + n[None, :]) * (S + 1), mask=cell, other=-1)
        match = cell & (keys == bon[:, None]) & (dep[None, :] == acc[:, None])
        first = tl.min(tl.where(match, n[None, :], N_BLOCK), axis=1)  # the first matching branch, N_BLOCK: none
        h = ((first < N_BLOCK).to(tl.int32) * have) > 0
        br = tl.where(first < N_BLOCK, first, 0).to(tl.int64)
        tl.store(hit_ptr + r, h.to(tl.int8), mask=inside)
        tl.store(branch_ptr + r, br, mask=inside)
        tl.store(hits_ptr + r, tl.load(hits_ptr + r, mask=inside, other=0) + h.to(tl.int64), mask=inside)
        col = inside[:, None] & (j < S)[None, :]
        cached = tl.load(cache_ptr + (r[:, None] * N + br[:, None]) * (S + 1) + 1 + j[None, :], mask=col & h[:, None],
                         other=0)
        old = tl.load(drafts_ptr + r[:, None] * S + j[None, :], mask=col, other=0)
        tl.store(drafts_ptr + r[:, None] * S + j[None, :], tl.where(h[:, None], cached, old), mask=col)
        missing = tl.maximum(missing, (inside & ~h).to(tl.int32))
    tl.store(miss_ptr, (tl.max(missing, axis=0) > 0).to(tl.int8))
    tl.store(rounds_ptr, tl.load(rounds_ptr) + have.to(tl.int64))


def cache_lookup_step_triton(v_acc: Tensor, v_bonus: Tensor, chain: Tensor, cache: Tensor, depths: Tensor,
                             have_cache: Tensor, *, bonus: Tensor, src: Tensor, hit: Tensor, branch: Tensor,
                             drafts: Tensor, miss_any: Tensor, rounds: Tensor, hits: Tensor) -> None:
    """Triton form of ``cache_lookup_step`` (the public function checks shapes and dtypes)."""
    B, N, S1 = cache.shape
    _cache_lookup_kernel[(1,)](v_acc, v_bonus, chain, cache, depths, have_cache.view(torch.int8), bonus, src,
                               hit.view(torch.int8), branch, drafts, miss_any.view(torch.int8), rounds, hits, B, N,
                               S1 - 1, R_BLOCK=min(16, triton.next_power_of_2(B)), N_BLOCK=triton.next_power_of_2(N),
                               S_BLOCK=triton.next_power_of_2(max(S1 - 1, 1)), num_warps=1 if B <= 16 else 4)
