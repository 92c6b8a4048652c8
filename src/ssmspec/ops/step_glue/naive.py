"""PyTorch twins of the step glue kernels (``ops.step_glue``): the same arithmetic, one op at a time."""
from __future__ import annotations

import torch
from torch import Tensor


def absorb_plan_ref(tokens: Tensor, length: Tensor, consumed: Tensor, skip: Tensor, skip_row: Tensor, *,
                    ids: Tensor, pos: Tensor, valid: Tensor, src: Tensor, n: Tensor, skip_eff: Tensor,
                    last_idx: Tensor, row_pos: Tensor, pad: int, resumes: bool, width: int, per_row: int,
                    slots_base: int, slot_dst: Tensor | None = None) -> None:
    """Writes the plan into the given tensors and advances ``consumed``, ``skip`` and ``row_pos`` in place
    (``ops.step_glue.absorb_plan``)."""
    B, A = ids.shape
    col = torch.arange(A, device=ids.device)[None]  # (1, A)
    behind = (length - consumed).clamp(min=0)  # (B,) buffer tokens not absorbed yet
    s = torch.minimum(skip, (behind - 1).clamp(min=0))  # (B,) of them already fed at depths 1 .. s
    cnt = (behind - s).clamp(max=A)  # (B,) tokens this call feeds
    start = consumed + s  # (B,) buffer column of the first one
    at = start[:, None] + col  # (B, A)
    ok = col < cnt[:, None]
    got = tokens.gather(1, at.clamp(max=tokens.shape[1] - 1))
    ids.copy_(torch.where(ok, got, pad))
    pos.copy_(at)
    valid.copy_(ok)
    home = torch.arange(B, device=ids.device)
    if resumes:  # the state after depth s of the resumed row (s = 0: the committed state, slot b)
        src.copy_(torch.where(s > 0, slots_base + (home * width + skip_row) * per_row + s - 1, home))
    else:
        src.copy_(home)
    n.copy_(cnt)
    if slot_dst is not None:  # the committed slot b at the last fed column, -1 (no store) elsewhere
        slot_dst.copy_(torch.where(col == (cnt - 1)[:, None], home[:, None], -1))
    skip_eff.copy_(s)
    last_idx.copy_((cnt - 1).clamp(min=0))
    consumed.add_(s + cnt)
    skip.zero_()
    depth = torch.arange(row_pos.shape[1], device=ids.device)[None]  # (1, S-1): depth 1 .. sits at consumed + d - 1
    row_pos.copy_(consumed.repeat_interleave(width)[:, None] + depth)


def emit_ref(pending: Tensor, drafts: Tensor | None, path: Tensor | None, accepted: Tensor, bonus: Tensor, *,
             tokens: Tensor, length: Tensor, emitted: Tensor, done: Tensor, seq_len: Tensor, report: Tensor,
             max_new: int, eos: int | None, fold: bool) -> None:
    """``ops.step_glue.emit`` one op at a time (module doc there)."""
    a = accepted
    if drafts is None:
        toks = bonus[:, None]  # (B, 1)
    else:
        nodes = torch.cat([pending[:, None], drafts], dim=1)  # (B, 1+T) node tokens
        path_toks = nodes.gather(1, path)  # (B, 1+S): pending, then the accepted drafts
        j = torch.arange(path.shape[1], device=pending.device)[None]
        # shifted one left, the bonus right after the path: column k < a holds draft k+1 of the path
        toks = torch.where(j < a[:, None], path_toks.roll(-1, dims=1), bonus[:, None])
    C = toks.shape[1]
    j = torch.arange(C, device=pending.device)[None]  # (1, C)
    count = a + 1
    n = torch.minimum(count, max_new - emitted)  # budget
    eos_end = None  # EOS ends the row (first EOS among the emitted tokens)
    if eos is not None:
        hit = (toks == eos) & (j < n[:, None])
        first = torch.where(hit, j, C).amin(1)  # (B,) first EOS column (C: none)
        n = torch.minimum(n, first + 1)
        eos_end = first < n
    n = torch.where(done, 0, n)  # finished rows emit nothing
    keep = j < n[:, None]  # (B, C)
    idx = length[:, None] + j  # (B, C) columns to write; in range (the buffer has a step's slack)
    tokens.scatter_(1, idx, torch.where(keep, toks, tokens.gather(1, idx)))
    length.add_(n)
    emitted.add_(n)
    done |= emitted >= max_new
    if eos_end is not None:
        done |= eos_end
    D = report.shape[1] - 4  # report (B, 4 + S): emitted tokens (-1 past the count), count, accepted, done
    report[:, :C] = torch.where(keep, toks, -1)
    if C < 1 + D:
        report[:, C:1 + D] = -1
    report[:, 1 + D] = n
    report[:, 2 + D] = a
    report[:, -1] = done
    if fold:
        seq_len.add_(count)
    pending.copy_(bonus)


def chain_verdict_ref(target: Tensor, tokens: Tensor, match: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``ops.step_glue.chain_verdict`` one op at a time."""
    same = match if match is not None else tokens == target[:, :-1]  # (B, S)
    acc = same.long().cumprod(dim=1).sum(dim=1)  # (B,) leading matches
    k = torch.arange(target.shape[1], device=target.device)[None]  # (1, 1+S)
    path = torch.where(k <= acc[:, None], k, 0)  # (B, 1+S) nodes 0 .. acc, then 0
    return acc, path, target.gather(1, acc[:, None])[:, 0]
