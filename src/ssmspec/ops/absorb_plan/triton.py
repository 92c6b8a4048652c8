"""The absorb plan as one launch (``ops.absorb_plan``): one program per sequence."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _absorb_plan_kernel(tok_ptr, len_ptr, cons_ptr, skip_ptr, row_ptr, ids_ptr, pos_ptr, valid_ptr, src_ptr, n_ptr,
                        seff_ptr, last_ptr, rpos_ptr, cap, pad, width, per_row, slots_base, s_tok, S1,
                        A: tl.constexpr, A_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, RESUMES: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    length = tl.load(len_ptr + b)
    cons = tl.load(cons_ptr + b)
    behind = tl.maximum(length - cons, 0)
    s = tl.minimum(tl.load(skip_ptr + b), tl.maximum(behind - 1, 0))
    cnt = tl.minimum(behind - s, A)
    start = cons + s
    col = tl.arange(0, A_BLOCK)
    inside = col < A
    at = start + col
    ok = col < cnt
    got = tl.load(tok_ptr + b * s_tok + tl.minimum(at, cap - 1), mask=inside & ok, other=0)
    tl.store(ids_ptr + b * A + col, tl.where(ok, got, pad), mask=inside)
    tl.store(pos_ptr + b * A + col, at, mask=inside)
    tl.store(valid_ptr + b * A + col, ok.to(tl.int8), mask=inside)
    if RESUMES:
        src = tl.where(s > 0, slots_base + (b * width + tl.load(row_ptr + b)) * per_row + s - 1, b)
    else:
        src = b
    tl.store(src_ptr + b, src)
    tl.store(n_ptr + b, cnt)
    tl.store(seff_ptr + b, s)
    tl.store(last_ptr + b, tl.maximum(cnt - 1, 0))
    new = cons + s + cnt
    tl.store(cons_ptr + b, new)
    tl.store(skip_ptr + b, s * 0)
    d = tl.arange(0, D_BLOCK)
    for w in range(width):
        tl.store(rpos_ptr + (b * width + w) * S1 + d, new + d, mask=d < S1)


def absorb_plan_triton(tokens: Tensor, length: Tensor, consumed: Tensor, skip: Tensor, skip_row: Tensor, *,
                       ids: Tensor, pos: Tensor, valid: Tensor, src: Tensor, n: Tensor, skip_eff: Tensor,
                       last_idx: Tensor, row_pos: Tensor, pad: int, resumes: bool, width: int, per_row: int,
                       slots_base: int) -> None:
    """Triton form of ``absorb_plan`` (the public function checks shapes and dtypes)."""
    B, A = ids.shape
    S1 = row_pos.shape[1]
    _absorb_plan_kernel[(B,)](tokens, length, consumed, skip, skip_row, ids, pos, valid.view(torch.int8), src, n,
                              skip_eff, last_idx, row_pos, tokens.shape[1], pad, width, per_row, slots_base,
                              tokens.stride(0), S1, A=A, A_BLOCK=triton.next_power_of_2(A),
                              D_BLOCK=triton.next_power_of_2(S1), RESUMES=resumes, num_warps=1)

