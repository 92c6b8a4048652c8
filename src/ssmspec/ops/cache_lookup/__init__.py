"""The speculation cache's lookup of one round (``drafting/async_draft.py:AsyncDraft.lookup``), in one launch.

Asynchronous speculation puts the lookup on the critical path of every round, between the target's verdict and
its next verification: about twenty small PyTorch ops on (B,) and (B, N) tensors, each a kernel launch of the
captured draft graph. Given the verdict (``v_acc`` k, ``v_bonus`` b, (B,)), the chain's slot numbers ``chain``
(B, S + 1), the cache (``cache`` (B, N, 1 + S): per branch its key, then its S drafts), the branches' accepted
lengths ``depths`` (N,) and ``have_cache`` (1,) bool, for every sequence b

    bonus[b]  = v_bonus[b];   src[b] = chain[b, v_acc[b]]            the pending token, the draft slot after d_k
    match[n]  = cache[b, n, 0] == bonus[b] and depths[n] == v_acc[b]  (at most one n per row)
    hit[b]    = have_cache and any_n match[n];   branch[b] = first n with match[n], else 0
    drafts[b] = cache[b, branch[b], 1:] if hit[b] else drafts[b]     (miss rows keep theirs until the backup)
    hits[b]  += hit[b]

and once per call ``rounds += have_cache`` and ``miss_any = not all_b hit[b]`` (the flag the host reads to decide
whether the backup runs: ``AsyncDraft.missed``). One Triton program walks the rows in blocks (the flag is a
reduction over every row);
``naive.py`` holds the PyTorch ops it replaces (the CPU path and the tests' reference). Every output is written
in place and nothing is allocated, so the call is capturable.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.cache_lookup.naive import cache_lookup_step_ref
from ssmspec.ops.dispatch import use_triton


def cache_lookup_step(v_acc: Tensor, v_bonus: Tensor, chain: Tensor, cache: Tensor, depths: Tensor,
                      have_cache: Tensor, *, bonus: Tensor, src: Tensor, hit: Tensor, branch: Tensor, drafts: Tensor,
                      miss_any: Tensor, rounds: Tensor, hits: Tensor, backend: str = "auto") -> None:
    """One round's lookup (module doc), in place. int64 tensors but ``have_cache`` (1,), ``hit`` (B,) and
    ``miss_any`` () bool; ``cache`` (B, N, 1 + S), ``chain`` (B, S + 1), ``drafts`` (B, S) contiguous; one device."""
    B, N, S1 = cache.shape
    S = S1 - 1
    shapes = {"v_acc": (v_acc, (B,)), "v_bonus": (v_bonus, (B,)), "chain": (chain, (B, S + 1)),
              "depths": (depths, (N,)), "have_cache": (have_cache, (1,)), "bonus": (bonus, (B,)), "src": (src, (B,)),
              "hit": (hit, (B,)), "branch": (branch, (B,)), "drafts": (drafts, (B, S)), "miss_any": (miss_any, ()),
              "rounds": (rounds, ()), "hits": (hits, (B,))}
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"cache_lookup_step: {name} has shape {tuple(t.shape)}, expected {shape} (B={B}, N={N}, "
                             f"S={S} from cache {tuple(cache.shape)})")
    flags = ("have_cache", "hit", "miss_any")
    for name, (t, _) in {**shapes, "cache": (cache, None)}.items():
        want = torch.bool if name in flags else torch.long
        if t.dtype != want:
            raise ValueError(f"cache_lookup_step: {name} must be {want}, got {t.dtype}")
    every = [cache, *(t for t, _ in shapes.values())]
    if len({t.device for t in every}) != 1:
        raise ValueError("cache_lookup_step: every tensor must be on one device")
    if not all(t.is_contiguous() for t in every):
        raise ValueError("cache_lookup_step: every tensor must be contiguous")
    kw = dict(bonus=bonus, src=src, hit=hit, branch=branch, drafts=drafts, miss_any=miss_any, rounds=rounds, hits=hits)
    if use_triton(*every, backend=backend):
        from ssmspec.ops.cache_lookup.triton import cache_lookup_step_triton
        cache_lookup_step_triton(v_acc, v_bonus, chain, cache, depths, have_cache, **kw)
    else:
        cache_lookup_step_ref(v_acc, v_bonus, chain, cache, depths, have_cache, **kw)


__all__ = ["cache_lookup_step", "cache_lookup_step_ref"]
