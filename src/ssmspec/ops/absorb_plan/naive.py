"""PyTorch twin of the absorb plan kernel (``ops.absorb_plan``): the same arithmetic, one op at a time."""
from __future__ import annotations

import torch
from torch import Tensor


def absorb_plan_ref(tokens: Tensor, length: Tensor, consumed: Tensor, skip: Tensor, skip_row: Tensor, *,
                    ids: Tensor, pos: Tensor, valid: Tensor, src: Tensor, n: Tensor, skip_eff: Tensor,
                    last_idx: Tensor, row_pos: Tensor, pad: int, resumes: bool, width: int, per_row: int,
                    slots_base: int) -> None:
    """Writes the plan into the given tensors and advances ``consumed``, ``skip`` and ``row_pos`` in place
    (``ops.absorb_plan.absorb_plan``)."""
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
    skip_eff.copy_(s)
    last_idx.copy_((cnt - 1).clamp(min=0))
    consumed.add_(s + cnt)
    skip.zero_()
    depth = torch.arange(row_pos.shape[1], device=ids.device)[None]  # (1, S-1): depth 1 .. sits at consumed + d - 1
    row_pos.copy_(consumed.repeat_interleave(width)[:, None] + depth)
