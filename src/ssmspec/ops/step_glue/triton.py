"""The step glue kernels (``ops.step_glue``): one program per sequence each."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _absorb_plan_kernel(tok_ptr, len_ptr, cons_ptr, skip_ptr, row_ptr, ids_ptr, pos_ptr, valid_ptr, src_ptr, n_ptr,
                        seff_ptr, last_ptr, rpos_ptr, sdst_ptr, cap, pad, width, per_row, slots_base, s_tok, S1,
                        A: tl.constexpr, A_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, RESUMES: tl.constexpr,
                        HAS_SLOT_DST: tl.constexpr):
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
    if HAS_SLOT_DST:  # the committed slot b at the last fed column, -1 (no store) elsewhere
        tl.store(sdst_ptr + b * A + col, tl.where(col == cnt - 1, b, -1), mask=inside)
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
                       slots_base: int, slot_dst: Tensor | None = None) -> None:
    """Triton form of ``absorb_plan`` (the public function checks shapes and dtypes)."""
    B, A = ids.shape
    S1 = row_pos.shape[1]
    _absorb_plan_kernel[(B,)](tokens, length, consumed, skip, skip_row, ids, pos, valid.view(torch.int8), src, n,
                              skip_eff, last_idx, row_pos, n if slot_dst is None else slot_dst, tokens.shape[1], pad,
                              width, per_row, slots_base, tokens.stride(0), S1, A=A, A_BLOCK=triton.next_power_of_2(A),
                              D_BLOCK=triton.next_power_of_2(S1), RESUMES=resumes, HAS_SLOT_DST=slot_dst is not None,
                              num_warps=1)


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


@triton.jit
def _chain_verdict_kernel(target_ptr, tok_ptr, match_ptr, acc_ptr, path_ptr, bonus_ptr, s_target, s_tok, s_match, S,
                          S_BLOCK: tl.constexpr, HAS_MATCH: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, S_BLOCK)
    inside = j < S
    if HAS_MATCH:
        same = tl.load(match_ptr + b * s_match + j, mask=inside, other=0) != 0
    else:
        same = tl.load(tok_ptr + b * s_tok + j, mask=inside, other=0) == tl.load(target_ptr + b * s_target + j,
                                                                              mask=inside, other=0)
    acc = tl.min(tl.where(inside & ~same, j, S), axis=0)  # the first mismatch ends the run of matches
    k = tl.arange(0, S_BLOCK * 2)
    tl.store(path_ptr + b * (S + 1) + k, tl.where(k <= acc, k, 0).to(tl.int64), mask=k < S + 1)
    tl.store(acc_ptr + b, acc.to(tl.int64))
    tl.store(bonus_ptr + b, tl.load(target_ptr + b * s_target + acc))


def chain_verdict_triton(target: Tensor, tokens: Tensor, match: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Triton form of ``chain_verdict`` (the public function checks shapes and dtypes)."""
    B, S = tokens.shape
    acc = torch.empty(B, dtype=torch.long, device=target.device)
    path = torch.empty(B, S + 1, dtype=torch.long, device=target.device)
    bonus = torch.empty(B, dtype=torch.long, device=target.device)
    m = match.view(torch.int8) if match is not None else tokens
    _chain_verdict_kernel[(B,)](target, tokens, m, acc, path, bonus, target.stride(0), tokens.stride(0), m.stride(0),
                                S, S_BLOCK=triton.next_power_of_2(S), HAS_MATCH=match is not None, num_warps=1)
    return acc, path, bonus
