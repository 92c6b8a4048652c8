"""`png`: prompt n-gram lookup drafting, PNG(n, d) of seed 001 (section 5.2, after prompt-lookup decoding).

Each step, the last ``ngram`` tokens of a sequence (pending token included) are looked up in everything
before them (prompt and output so far); the ``draft_len`` tokens that followed an earlier occurrence are a
draft. Up to ``num_drafts`` distinct drafts are kept: longest n-gram first (n, n-1, ..., ``min_ngram``),
most recent occurrence first within one n. Seed 001's PNG(6, 2) drafts 2 chains of 6 tokens; here the
match length is its own option, so that setting reads ``num_drafts=2, draft_len=6`` with ``ngram`` n.

Fill rules (deterministic, every draft valid): a continuation that runs into the end of the history is
padded by repeating its last token; when fewer than ``num_drafts`` drafts are found the rest repeat the
pending token ``draft_len`` times (a guess like any other: verified, usually rejected).

``merge=True`` merges the drafts into one prefix tree (shared prefixes verified once; fixed size
``num_drafts * draft_len``, see ``drafting/merge.py``), which needs a strategy that verifies trees.
The lookup runs on the host over token lists; drafts are moved to the target's device.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.drafting.base import DraftTree
from ssmspec.drafting.merge import merge_chains
from ssmspec.drafting.registry import DrafterBase, register_drafter
from ssmspec.strategies.base import SpecConfig


def ngram_drafts(history: list[int], *, ngram: int, num_drafts: int, draft_len: int,
                 min_ngram: int = 1) -> list[list[int]]:
    """The PNG drafts of one sequence: ``num_drafts`` lists of ``draft_len`` tokens (fill rules above)."""
    hist = torch.tensor(history, dtype=torch.long)
    L = hist.numel()
    drafts: list[list[int]] = []
    for n in range(min(ngram, L - 1), min_ngram - 1, -1):
        if len(drafts) == num_drafts:
            break
        key = hist[L - n:]  # (n,) the suffix, pending token last
        windows = hist[:L - 1].unfold(0, n, 1)  # (L-n, n): every earlier n-gram with a token after it
        starts = (windows == key).all(dim=1).nonzero()[:, 0].flip(0).tolist()  # most recent first
        for i in starts:
            cont = history[i + n:i + n + draft_len]
            cont = cont + [cont[-1]] * (draft_len - len(cont))
            if cont not in drafts:
                drafts.append(cont)
                if len(drafts) == num_drafts:
                    break
    while len(drafts) < num_drafts:
        drafts.append([history[-1]] * draft_len)
    return drafts


@register_drafter("png")
class PromptNgram(DrafterBase):
    """PNG(n, d): ``num_drafts`` chains of ``draft_len`` tokens from n-gram matches in the history."""

    def __init__(self, *, ngram: int = 3, num_drafts: int = 1, draft_len: int = 4, min_ngram: int = 1,
                 merge: bool = False) -> None:
        super().__init__()
        if ngram < 1 or not (1 <= min_ngram <= ngram):
            raise ValueError(f"png needs 1 <= min_ngram <= ngram, got min_ngram={min_ngram}, ngram={ngram}")
        if num_drafts < 1 or draft_len < 1:
            raise ValueError(f"png needs num_drafts >= 1 and draft_len >= 1, got {num_drafts}, {draft_len} "
                             f"(no speculation: use drafter=none)")
        self.ngram, self.min_ngram, self.num_drafts, self.draft_len, self.merge = (
            ngram, min_ngram, num_drafts, draft_len, merge)
        self.is_tree = merge
        nodes = num_drafts * draft_len
        self.spec = (SpecConfig(draft_len=draft_len, tree_size=nodes) if merge
                     else SpecConfig(draft_len=draft_len, num_drafts=num_drafts))
        self.device = torch.device("cpu")
        self._record(ngram=ngram, num_drafts=num_drafts, draft_len=draft_len, min_ngram=min_ngram, merge=merge)

    def reset(self, prompts, *, batch: int, device) -> None:
        self.device = torch.device(device)

    def propose(self, history: list[list[int]], pending: Tensor) -> DraftTree:
        rows = [ngram_drafts(h, ngram=self.ngram, num_drafts=self.num_drafts, draft_len=self.draft_len,
                             min_ngram=self.min_ngram) for h in history]
        tokens = torch.tensor(rows, dtype=torch.long)  # (B, D, S)
        if self.merge:
            return merge_chains(tokens, size=self.spec.tree_size, device=self.device)
        return DraftTree.from_chains(tokens.to(self.device))
