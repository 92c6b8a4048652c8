"""PyTorch twin of the emit kernel (``ops.emit``): the same arithmetic, one op at a time."""
from __future__ import annotations

import torch
from torch import Tensor


def emit_ref(pending: Tensor, drafts: Tensor | None, path: Tensor | None, accepted: Tensor, bonus: Tensor, *,
             tokens: Tensor, length: Tensor, emitted: Tensor, done: Tensor, seq_len: Tensor, report: Tensor,
             max_new: int, eos: int | None, fold: bool) -> None:
    """``ops.emit.emit`` one op at a time (module doc there)."""
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
