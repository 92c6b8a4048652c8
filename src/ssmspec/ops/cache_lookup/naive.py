"""PyTorch twin of ``ops.cache_lookup`` (the ops the kernel replaces; the CPU path and the tests' reference)."""
from __future__ import annotations

import torch
from torch import Tensor


def cache_match(keys: Tensor, depths: Tensor, accepted: Tensor, bonus: Tensor) -> tuple[Tensor, Tensor]:
    """Which branch a verdict hits. keys (B, N) candidate bonus tokens, depths (N,) their accepted lengths,
    accepted (B,) and bonus (B,) the verdict -> (hit (B,) bool, branch (B,) int64: the first match, 0 where none)."""
    match = (keys == bonus[:, None]) & (depths[None] == accepted[:, None])  # (B, N): at most one per row
    return match.any(1), match.long().argmax(1)


def cache_lookup_step_ref(v_acc: Tensor, v_bonus: Tensor, chain: Tensor, cache: Tensor, depths: Tensor,
                          have_cache: Tensor, *, bonus: Tensor, src: Tensor, hit: Tensor, branch: Tensor,
                          drafts: Tensor, miss_any: Tensor, rounds: Tensor, hits: Tensor) -> None:
    bonus.copy_(v_bonus)
    src.copy_(chain.gather(1, v_acc[:, None])[:, 0])
    matched, first = cache_match(cache[:, :, 0], depths, v_acc, bonus)
    hit.copy_(matched & have_cache)
    branch.copy_(first)
    torch.logical_not(hit.all(), out=miss_any)
    rounds.add_(have_cache.long()[0])
    hits.add_(hit.long())
    rows = torch.arange(cache.shape[0], device=cache.device)
    drafts.copy_(torch.where(hit[:, None], cache[rows, branch, 1:], drafts))
