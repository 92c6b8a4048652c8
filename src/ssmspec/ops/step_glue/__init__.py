"""The small index work around the models in a decode step, one launch each.

A captured step of a small model costs what it launches (a few microseconds a kernel, whatever it does), and
the work between the models -- which tokens to feed, what was accepted, what to emit -- is dozens of tiny
PyTorch ops on (B,) and (B, S) tensors. Each function here does one such piece in one Triton program per
sequence, with its twin in ``naive.py`` (the PyTorch ops it replaces, the CPU path and the tests' reference).
Nothing is allocated on the Triton path but ``chain_verdict``'s outputs, so all of it is capturable.

``absorb_plan``: the draft engine's absorb (``engine/draft.py:DraftEngine.absorb``).

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

``emit``: what a decode step emits (``engine/step.py:DecodeStep``).

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

``chain_verdict``: greedy verification of one chain (``verify/greedy.py``). ``target`` (B, 1 + S) the target's
argmax after every node, ``tokens`` (B, S) the drafts (or ``match`` (B, S), the oracle's word in place of the
comparison): ``accepted`` = the leading run of matches, ``path`` (B, 1 + S) = 0 .. accepted then 0,
``bonus`` = target[accepted].
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.step_glue.naive import absorb_plan_ref, chain_verdict_ref, emit_ref


def absorb_plan(tokens: Tensor, length: Tensor, consumed: Tensor, skip: Tensor, skip_row: Tensor, *,
                ids: Tensor, pos: Tensor, valid: Tensor, src: Tensor, n: Tensor, skip_eff: Tensor, last_idx: Tensor,
                row_pos: Tensor, pad: int, resumes: bool, width: int, per_row: int, slots_base: int,
                slot_dst: Tensor | None = None, backend: str = "auto") -> None:
    """Write the plan (module doc) into ``ids``, ``pos`` (B, A) int64, ``valid`` (B, A) bool, ``src``, ``n``,
    ``skip_eff``, ``last_idx`` (B,) int64, and advance ``consumed``, ``skip`` (B,) and ``row_pos`` (B W, S1)
    in place. ``slot_dst`` (B, A) int64, when given, gets the state slot of every column of the call for a
    slot-addressed strategy: the committed slot b at the last fed column (n - 1), -1 (no store) elsewhere --
    ``Snapshot._per_call``'s plan, made here instead of in six launches of every absorb. Every tensor contiguous,
    int64 but ``valid``, on one device; nothing allocated on the Triton path (capturable)."""
    B, A = ids.shape
    if B < 1 or A < 1 or width < 1 or per_row < 1:
        raise ValueError(f"absorb_plan needs B, A, width and per_row >= 1, got {B}, {A}, {width}, {per_row}")
    per_seq = {"length": length, "consumed": consumed, "skip": skip, "skip_row": skip_row, "src": src, "n": n,
               "skip_eff": skip_eff, "last_idx": last_idx}
    outs = {"slot_dst": slot_dst} if slot_dst is not None else {}
    shapes = {**{k: (t, (B,)) for k, t in per_seq.items()}, "pos": (pos, (B, A)), "valid": (valid, (B, A)),
              "row_pos": (row_pos, (B * width, row_pos.shape[1] if row_pos.dim() == 2 else -1)),
              **{k: (t, (B, A)) for k, t in outs.items()}}
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"absorb_plan: {name} has shape {tuple(t.shape)}, expected {shape}")
    for name, t in {**per_seq, "tokens": tokens, "ids": ids, "pos": pos, "row_pos": row_pos, **outs}.items():
        if t.dtype != torch.long:
            raise ValueError(f"absorb_plan: {name} must be int64, got {t.dtype}")
    if valid.dtype != torch.bool:
        raise ValueError(f"absorb_plan: valid must be bool, got {valid.dtype}")
    every = [tokens, ids, pos, valid, row_pos, *per_seq.values(), *outs.values()]
    if len({t.device for t in every}) != 1 or not all(t.is_contiguous() for t in every[1:]):
        raise ValueError("absorb_plan: every tensor must be on one device, and every output contiguous")
    if tokens.dim() != 2 or tokens.shape[0] != B or tokens.stride(1) != 1:
        raise ValueError(f"absorb_plan: tokens must be (B, capacity) with unit column stride, got "
                         f"{tuple(tokens.shape)} / {tokens.stride()}")
    kw = dict(ids=ids, pos=pos, valid=valid, src=src, n=n, skip_eff=skip_eff, last_idx=last_idx, row_pos=row_pos,
              pad=pad, resumes=resumes, width=width, per_row=per_row, slots_base=slots_base, slot_dst=slot_dst)
    if use_triton(*every, backend=backend):
        from ssmspec.ops.step_glue.triton import absorb_plan_triton
        absorb_plan_triton(tokens, length, consumed, skip, skip_row, **kw)
    else:
        absorb_plan_ref(tokens, length, consumed, skip, skip_row, **kw)


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
        from ssmspec.ops.step_glue.triton import emit_triton
        emit_triton(pending, drafts, path, accepted, bonus, **kw)
    else:
        emit_ref(pending, drafts, path, accepted, bonus, **kw)


def chain_verdict(target: Tensor, tokens: Tensor, match: Tensor | None = None, *,
                  backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """(accepted (B,), path (B, 1 + S), bonus (B,)), int64, of one chain (module doc)."""
    B, S = tokens.shape
    if tuple(target.shape) != (B, S + 1):
        raise ValueError(f"chain_verdict: target has shape {tuple(target.shape)}, expected ({B}, {S + 1})")
    if match is not None and (tuple(match.shape) != (B, S) or match.dtype != torch.bool):
        raise ValueError(f"chain_verdict: match must be bool ({B}, {S}), got {match.dtype} {tuple(match.shape)}")
    if S == 0:
        zeros = torch.zeros(B, dtype=torch.long, device=target.device)
        return zeros, zeros[:, None], target[:, 0]
    target, tokens = target.contiguous(), tokens.contiguous()
    match = None if match is None else match.contiguous()
    if use_triton(target, tokens, match, backend=backend):
        from ssmspec.ops.step_glue.triton import chain_verdict_triton
        return chain_verdict_triton(target, tokens, match)
    return chain_verdict_ref(target, tokens, match)


__all__ = ["absorb_plan", "absorb_plan_ref", "chain_verdict", "chain_verdict_ref", "emit", "emit_ref"]
