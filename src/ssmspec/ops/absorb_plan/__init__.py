"""The draft engine's absorb plan in one launch (``engine/draft.py:DraftEngine.absorb``).

Before an absorb call the draft engine works out, per sequence b, from the target's token buffer (``tokens``
(B, cap), ``length`` (B,)), what it has absorbed (``consumed``) and the accepted depth a ``resume`` vouches for
(``skip``, in drafting row ``skip_row``):

    behind = max(length - consumed, 0)           buffer tokens not absorbed yet
    s      = min(skip, max(behind - 1, 0))       of them, already fed at depths 1 .. s (the bonus never is)
    n      = min(behind - s, A)                  tokens this call feeds, from buffer column consumed + s
    ids[j] = tokens[consumed + s + j] for j < n, else pad;  pos[j] = consumed + s + j;  valid[j] = j < n
    src    = slots_base + (b W + skip_row) P + s - 1 if resuming and s > 0 (the state after depth s), else b
    last_idx = max(n - 1, 0)                     the column whose hidden state gives the root's logits

and, since the call does not read them, it advances its counters in the same launch: ``consumed`` += s + n,
``skip`` = 0 (a resume holds for one absorb), and each of the sequence's W rows' depth positions
``row_pos[b W + w, d] = consumed + d`` (depth d + 1 sits at column consumed + d). In PyTorch that is about
25 small ops, each a kernel launch inside every captured speculative step of a small draft; here it is one.
``n`` and ``s`` are kept (``n``, ``skip_eff``) for the KV commit and the resumed row's keys.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.absorb_plan.naive import absorb_plan_ref
from ssmspec.ops.dispatch import use_triton


def absorb_plan(tokens: Tensor, length: Tensor, consumed: Tensor, skip: Tensor, skip_row: Tensor, *,
                ids: Tensor, pos: Tensor, valid: Tensor, src: Tensor, n: Tensor, skip_eff: Tensor, last_idx: Tensor,
                row_pos: Tensor, pad: int, resumes: bool, width: int, per_row: int, slots_base: int,
                backend: str = "auto") -> None:
    """Write the plan (module doc) into ``ids``, ``pos`` (B, A) int64, ``valid`` (B, A) bool, ``src``, ``n``,
    ``skip_eff``, ``last_idx`` (B,) int64, and advance ``consumed``, ``skip`` (B,) and ``row_pos`` (B W, S1)
    in place. Every tensor contiguous, int64 but ``valid``, on one device; nothing allocated on the Triton path
    (capturable)."""
    B, A = ids.shape
    if B < 1 or A < 1 or width < 1 or per_row < 1:
        raise ValueError(f"absorb_plan needs B, A, width and per_row >= 1, got {B}, {A}, {width}, {per_row}")
    per_seq = {"length": length, "consumed": consumed, "skip": skip, "skip_row": skip_row, "src": src, "n": n,
               "skip_eff": skip_eff, "last_idx": last_idx}
    shapes = {**{k: (t, (B,)) for k, t in per_seq.items()}, "pos": (pos, (B, A)), "valid": (valid, (B, A)),
              "row_pos": (row_pos, (B * width, row_pos.shape[1] if row_pos.dim() == 2 else -1))}
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"absorb_plan: {name} has shape {tuple(t.shape)}, expected {shape}")
    for name, t in {**per_seq, "tokens": tokens, "ids": ids, "pos": pos, "row_pos": row_pos}.items():
        if t.dtype != torch.long:
            raise ValueError(f"absorb_plan: {name} must be int64, got {t.dtype}")
    if valid.dtype != torch.bool:
        raise ValueError(f"absorb_plan: valid must be bool, got {valid.dtype}")
    every = [tokens, ids, pos, valid, row_pos, *per_seq.values()]
    if len({t.device for t in every}) != 1 or not all(t.is_contiguous() for t in every[1:]):
        raise ValueError("absorb_plan: every tensor must be on one device, and every output contiguous")
    if tokens.dim() != 2 or tokens.shape[0] != B or tokens.stride(1) != 1:
        raise ValueError(f"absorb_plan: tokens must be (B, capacity) with unit column stride, got "
                         f"{tuple(tokens.shape)} / {tokens.stride()}")
    kw = dict(ids=ids, pos=pos, valid=valid, src=src, n=n, skip_eff=skip_eff, last_idx=last_idx, row_pos=row_pos,
              pad=pad, resumes=resumes, width=width, per_row=per_row, slots_base=slots_base)
    if use_triton(*every, backend=backend):
        from ssmspec.ops.absorb_plan.triton import absorb_plan_triton
        absorb_plan_triton(tokens, length, consumed, skip, skip_row, **kw)
    else:
        absorb_plan_ref(tokens, length, consumed, skip, skip_row, **kw)


__all__ = ["absorb_plan", "absorb_plan_ref"]
