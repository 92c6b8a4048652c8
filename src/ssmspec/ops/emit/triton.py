"""The step's emit as one launch (``ops.emit``): one program per sequence."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _emit_kernel(pend_ptr, drafts_ptr, path_ptr, acc_ptr, bonus_ptr, tok_ptr, len_ptr, emitted_ptr, done_ptr,
                 seq_ptr, rep_ptr, s_drafts, s_path, s_tok, s_rep, max_new, eos, C, D,
                 C_BLOCK: tl.constexpr, HAS_DRAFTS: tl.constexpr, HAS_EOS: tl.constexpr, FOLD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    a = tl.load(acc_ptr + b)
    bonus = tl.load(bonus_ptr + b)
    pend = tl.load(pend_ptr + b)
    j = tl.arange(0, C_BLOCK)
    inside = j < C
    if HAS_DRAFTS:  # column j < a: the path's node j + 1 (node 0 is the pending token, node i draft i - 1)
        take = inside & (j < a)
        node = tl.load(path_ptr + b * s_path + j + 1, mask=take, other=0)
        tok = tl.load(drafts_ptr + b * s_drafts + node - 1, mask=take & (node > 0), other=0)
        tok = tl.where(node > 0, tok, pend)
        toks = tl.where(take, tok, bonus)
    else:
        toks = tl.zeros([C_BLOCK], dtype=tl.int64) + bonus
    count = a + 1
    emitted = tl.load(emitted_ptr + b)
    n = tl.minimum(count, max_new - emitted)
    was_done = tl.load(done_ptr + b) != 0
    now_done = was_done
    if HAS_EOS:  # EOS ends the row: the first EOS among the tokens the budget lets through
        first = tl.min(tl.where((toks == eos) & (j < n) & inside, j, C), axis=0)
        n = tl.minimum(n, first + 1)
        now_done = now_done | (first < n)
    n = tl.where(was_done, 0, n)
    keep = inside & (j < n)
    length = tl.load(len_ptr + b)
    tl.store(tok_ptr + b * s_tok + length + j, toks, mask=keep)
    tl.store(len_ptr + b, length + n)
    emitted = emitted + n
    tl.store(emitted_ptr + b, emitted)
    now_done = now_done | (emitted >= max_new)
    tl.store(done_ptr + b, now_done.to(tl.int8))
    cols = tl.arange(0, C_BLOCK)
    tl.store(rep_ptr + b * s_rep + cols, tl.where(keep, toks, -1), mask=cols < 1 + D)
    tl.store(rep_ptr + b * s_rep + 1 + D, n)
    tl.store(rep_ptr + b * s_rep + 2 + D, a)
    tl.store(rep_ptr + b * s_rep + 3 + D, now_done.to(tl.int64))
    if FOLD:
        tl.store(seq_ptr + b, tl.load(seq_ptr + b) + count)
    tl.store(pend_ptr + b, bonus)


def emit_triton(pending: Tensor, drafts: Tensor | None, path: Tensor | None, accepted: Tensor, bonus: Tensor, *,
                tokens: Tensor, length: Tensor, emitted: Tensor, done: Tensor, seq_len: Tensor, report: Tensor,
                max_new: int, eos: int | None, fold: bool) -> None:
    """Triton form of ``emit`` (the public function checks shapes and dtypes)."""
    B = pending.shape[0]
    D = report.shape[1] - 4
    C = 1 if drafts is None else path.shape[1]
    has = drafts is not None
    _emit_kernel[(B,)](pending, drafts if has else pending, path if has else pending, accepted, bonus, tokens, length,
                       emitted, done.view(torch.int8), seq_len, report, drafts.stride(0) if has else 0,
                       path.stride(0) if has else 0, tokens.stride(0), report.stride(0), max_new,
                       -1 if eos is None else eos, C, D, C_BLOCK=triton.next_power_of_2(max(C, 1 + D)),
                       HAS_DRAFTS=has, HAS_EOS=eos is not None, FOLD=fold, num_warps=1)
