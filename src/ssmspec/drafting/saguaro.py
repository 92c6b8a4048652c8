"""Saguaro (seed 002): which verification outcomes the speculation cache of asynchronous speculation prepares.

While the target verifies a chain of S drafts d_1 .. d_S, its verdict is (k, b): k accepted drafts (0 .. S) and
the bonus token b the target emits after them. The draft cannot know the verdict, so it prepares the next drafts
for a set of likely verdicts, the cache keys: at each accepted length k, ``fanout[k]`` bonus candidates. The
bonus after k < S accepted drafts is the target's token where it rejected d_{k+1}, so d_{k+1} itself is never a
candidate there (greedy: the target's argmax differs from d_{k+1}; sampling: the residual's mass sits elsewhere
first); after all S, any token can be. Candidates are the draft's top tokens at each depth (the draft's logits
that drew d_{k+1}, and the logits after d_S for k = S).

``fanout`` is a list of S + 1 counts, one per accepted length; its sum N is the number of cache branches per
sequence (the budget). Which ``fanout`` fits a budget best (geometric against uniform) is ``saguaro_topology``'s
concern; this module turns one into keys.

Residual scaling (lambda): when drafts are sampled, Saguaro draws them from the draft distribution with its top
``F + 1`` tokens scaled by lambda <= 1 and renormalised. Speculative sampling verifies with that same scaled q,
so the output law stays the target's; what changes is the residual max(p - q, 0): mass moves back onto the
draft's top tokens, which are exactly the cached bonus candidates, so more bonus tokens hit the cache.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.cache_lookup.naive import cache_match


def check_fanout(fanout: list[int] | tuple[int, ...], depth: int) -> tuple[int, ...]:
    """``fanout`` (S + 1 non-negative counts, at least one branch) -> a tuple; one clear error otherwise."""
    fan = tuple(int(f) for f in fanout)
    if len(fan) != depth + 1:
        raise ValueError(f"fanout needs one count per accepted length 0 .. S = {depth} ({depth + 1} counts), got "
                         f"{list(fan)}; e.g. fanout={[2] * (depth + 1)}")
    if min(fan) < 0 or sum(fan) < 1:
        raise ValueError(f"fanout {list(fan)} cannot hold one cache branch: counts must be >= 0 with at least one "
                         f"> 0")
    return fan


def branch_depths(fanout: tuple[int, ...], device=None) -> Tensor:
    """(N,) accepted length k of every cache branch, branches grouped by k in increasing order."""
    return torch.repeat_interleave(torch.arange(len(fanout), device=device),
                                   torch.tensor(fanout, device=device))


def bonus_candidates(logits: Tensor, drafts: Tensor, fanout: tuple[int, ...]) -> Tensor:
    """Cache keys of one round (module doc).

    logits (B, S + 1, V): the draft's logits at depths 0 .. S (row k drew d_{k+1}; row S follows d_S);
    drafts (B, S): d_1 .. d_S. -> (B, N) candidate bonus tokens, branch order of ``branch_depths(fanout)``:
    the ``fanout[k]`` best tokens of row k, d_{k+1} excluded for k < S, best first.
    """
    B, S1, V = logits.shape
    S = S1 - 1
    if drafts.shape != (B, S):
        raise ValueError(f"drafts must be (B, S) = ({B}, {S}) for logits of shape {tuple(logits.shape)}, got "
                         f"{tuple(drafts.shape)}")
    fan = check_fanout(fanout, S)
    top = max(fan)
    if top + 1 > V:
        raise ValueError(f"fanout {list(fan)} asks for {top} candidates at one depth but the vocabulary has {V} tokens")
    scores = logits.float().clone()
    scores[:, :S].scatter_(2, drafts[..., None], float("-inf"))  # the rejected draft is never the bonus
    best = scores.topk(top, dim=-1).indices  # (B, S + 1, top), best first
    # (B, N) in branch order; static slices, no boolean index (a host sync), so CUDA graphs capture it
    return torch.cat([best[:, k, :f] for k, f in enumerate(fan) if f], dim=1)


def cache_lookup(keys: Tensor, depths: Tensor, accepted: Tensor, bonus: Tensor) -> tuple[Tensor, Tensor]:
    """Which branch a verdict hits. keys (B, N) candidate bonus tokens, depths (N,) their accepted lengths,
    accepted (B,) and bonus (B,) the verdict -> (hit (B,) bool, branch (B,) int64; 0 where it missed)."""
    return cache_match(keys, depths, accepted, bonus)  # the match law, shared with the lookup op's twin


def rescale_top(probs: Tensor, lam: float, count: int) -> Tensor:
    """Residual scaling (module doc): probs (..., V) with its ``count`` largest entries multiplied by ``lam``
    (0 < lam <= 1), renormalised. lam = 1 returns the distribution unchanged."""
    if not 0.0 < lam <= 1.0:
        raise ValueError(f"residual scaling lambda must lie in (0, 1] (1: no scaling), got {lam}")
    if lam == 1.0 or count <= 0:
        return probs
    idx = probs.topk(min(count, probs.shape[-1]), dim=-1).indices
    scale = torch.ones_like(probs).scatter_(-1, idx, lam)
    out = probs * scale
    return out / out.sum(-1, keepdim=True)
