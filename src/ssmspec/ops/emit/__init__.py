"""What a decode step emits, in one launch (``engine/step.py:DecodeStep``).

After the verdict of a step (``accepted`` a (B,), ``bonus`` (B,), the accepted ``path`` (B, 1 + S) of node
numbers over ``[pending, drafts]``), each sequence b emits its accepted drafts and then the bonus,

    toks[j] = node path[j + 1] for j < a, else bonus            (B, C): C = 1 + S, or 1 without drafts
    n       = min(a + 1, max_new - emitted), cut after the first EOS among them, 0 for a finished row

appends ``toks[:n]`` to its row of the token buffer (``tokens`` from column ``length``; the buffer keeps a
step's slack, so the columns are in range), advances ``length`` and ``emitted`` by n, marks it ``done`` at the
budget or after an EOS, writes the step's host ``report`` (B, 4 + S): the emitted tokens (-1 past n), n, a,
done; with ``fold`` adds a + 1 to ``seq_len`` (the pending token and the accepted drafts are now in the model's
state), and makes the bonus the next ``pending`` token. In PyTorch that is about 20 small ops of every step,
each a kernel launch of the captured step (``naive.py``); here it is one.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.emit.naive import emit_ref


def emit(pending: Tensor, drafts: Tensor | None, path: Tensor | None, accepted: Tensor, bonus: Tensor, *,
         tokens: Tensor, length: Tensor, emitted: Tensor, done: Tensor, seq_len: Tensor, report: Tensor,
         max_new: int, eos: int | None, fold: bool = True, backend: str = "auto") -> None:
    """Emit one step's tokens (module doc), in place. ``drafts`` (B, T) and ``path`` (B, 1 + S) int64 together,
    or both None (no drafts: the bonus alone); ``done`` bool; every other tensor int64 and (B,) but ``tokens``
    (B, capacity) and ``report`` (B, 4 + S'), S' >= S; nothing allocated on the Triton path (capturable)."""
    B = pending.shape[0]
    if (drafts is None) != (path is None):
        raise ValueError("emit takes drafts and path together (a speculative step) or neither (no drafts)")
    accepted, bonus = accepted.contiguous(), bonus.contiguous()  # read only: views of a verdict are fine
    if drafts is not None:
        drafts, path = drafts.contiguous(), path.contiguous()
    per_seq = {"pending": pending, "accepted": accepted, "bonus": bonus, "length": length, "emitted": emitted,
               "seq_len": seq_len, "done": done}
    for name, t in per_seq.items():
        if tuple(t.shape) != (B,):
            raise ValueError(f"emit: {name} has shape {tuple(t.shape)}, expected ({B},)")
    C = 1 if path is None else path.shape[1]
    two_d = {"tokens": tokens, "report": report, **({} if drafts is None else {"drafts": drafts, "path": path})}
    for name, t in two_d.items():
        if t.dim() != 2 or t.shape[0] != B or t.stride(1) != 1:
            raise ValueError(f"emit: {name} must be ({B}, n) with unit column stride, got {tuple(t.shape)} / "
                             f"{t.stride()}")
    if report.shape[1] < 3 + C:
        raise ValueError(f"emit: report has {report.shape[1]} columns; a step of {C} tokens needs {3 + C}")
    for name, t in {**per_seq, **two_d}.items():
        if t.dtype != (torch.bool if name == "done" else torch.long):
            raise ValueError(f"emit: {name} must be {'bool' if name == 'done' else 'int64'}, got {t.dtype}")
    every = [*per_seq.values(), *two_d.values()]
    if len({t.device for t in every}) != 1:
        raise ValueError("emit: every tensor must be on one device")
    if not all(t.is_contiguous() for t in per_seq.values()):
        raise ValueError("emit: the per-sequence tensors must be contiguous")
    kw = dict(tokens=tokens, length=length, emitted=emitted, done=done, seq_len=seq_len, report=report,
              max_new=max_new, eos=eos, fold=fold)
    if use_triton(*every, backend=backend):
        from ssmspec.ops.emit.triton import emit_triton
        emit_triton(pending, drafts, path, accepted, bonus, **kw)
    else:
        emit_ref(pending, drafts, path, accepted, bonus, **kw)


__all__ = ["emit", "emit_ref"]
