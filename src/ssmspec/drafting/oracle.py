"""`oracle`: drafts that know the target's greedy continuation and corrupt each token with probability
1 - p (DESIGN.md section 5): a controlled acceptance rate on random weights, for the systems figures.

The truth is a reference continuation per sequence (prompt excluded), either given (``reference=``, the
``sequences`` of an autoregressive greedy ``generate()`` of the target) or computed at ``reset()`` from
``target=`` (the target HybridLM) for ``horizon`` tokens. After k emitted tokens (pending included) the
next tokens are ``reference[b][k:]``; past the reference's end its last token stands in.

Chains (``draft_len`` S, ``num_drafts`` D): every token of every chain is, independently, the true token
with probability p, else a uniformly chosen *different* token, so under greedy verification a chain's
accepted length is a truncated geometric: P(a >= k) = p^k. Trees (``tree``: a static shape name or a
parents list): every node independently carries the true token of its depth with probability p.
Seeded (``seed``); meant for greedy runs (with sampling the history leaves the greedy reference).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.drafting.base import DraftTree
from ssmspec.drafting.registry import DrafterBase, register_drafter
from ssmspec.drafting.static_tree import check_parents, resolve_shape
from ssmspec.strategies.base import SpecConfig


@register_drafter("oracle")
class Oracle(DrafterBase):
    """Corrupted greedy continuation of the target (module doc)."""

    def __init__(self, *, p: float = 0.8, draft_len: int | None = None, num_drafts: int | None = None,
                 tree=None, reference: list[list[int]] | None = None, target=None, horizon: int = 256,
                 vocab_size: int | None = None, seed: int = 0) -> None:
        super().__init__()
        p = float(p)
        if not (0.0 <= p <= 1.0):
            raise ValueError(f"oracle keeps each true token with probability p, which must be in [0, 1]; got p={p}")
        if tree is not None:
            if draft_len is not None or num_drafts is not None:
                raise ValueError("oracle with a tree shape: draft_len / num_drafts are chain settings; the tree "
                                 "shape sets depth and size (drop them, or drop tree= for chains)")
            self.parents = resolve_shape(tree)
            self.node_depth = check_parents(self.parents)[1:]  # depth of nodes 1..T
            self.is_tree = True
            self.spec = SpecConfig(draft_len=max(self.node_depth), tree_size=len(self.parents))
        else:
            draft_len = 4 if draft_len is None else draft_len
            num_drafts = 1 if num_drafts is None else num_drafts
            if draft_len < 1 or num_drafts < 1:
                raise ValueError(f"oracle needs draft_len >= 1 and num_drafts >= 1, got {draft_len}, {num_drafts}")
            self.parents = None
            self.node_depth = [s + 1 for _ in range(num_drafts) for s in range(draft_len)]  # chain after chain
            self.spec = SpecConfig(draft_len=draft_len, num_drafts=num_drafts)
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.p, self.reference, self.target, self.horizon, self.seed = p, reference, target, horizon, seed
        self.vocab_size = vocab_size if vocab_size is not None else (target.cfg.vocab_size if target is not None else None)
        self._record(p=p, draft_len=self.spec.draft_len if tree is None else None,
                     num_drafts=self.spec.num_drafts if tree is None else None,
                     tree=tree if tree is None or isinstance(tree, str) else list(self.parents), horizon=horizon,
                     seed=seed)

    def reset(self, prompts, *, batch: int, device) -> None:
        self.device = torch.device(device)
        if self.reference is None:
            if self.target is None:
                raise ValueError("oracle needs the target's greedy continuation: pass reference= (per-sequence token "
                                 "lists from an autoregressive greedy generate()) or target= (the target model)")
            from ssmspec.engine.generate import generate

            self.reference = generate(self.target, prompts, max_new_tokens=self.horizon, strategy="autoregressive",
                                      timing=False).sequences
        if len(self.reference) != batch:
            raise ValueError(f"oracle reference has {len(self.reference)} sequences but the batch has {batch}")
        if any(len(r) == 0 for r in self.reference):
            raise ValueError("oracle reference sequences must not be empty")
        if self.vocab_size is None or self.vocab_size < 2:
            raise ValueError("oracle needs vocab_size >= 2 (or target=) to draw corrupted tokens")
        self.plen = [len(p) for p in prompts]
        self.gen = torch.Generator().manual_seed(self.seed)
        self.depth_idx = torch.tensor(self.node_depth) - 1  # (T,) depth-1 of every node

    def truth(self, history: list[list[int]]) -> Tensor:
        """(B, S) the target's next S greedy tokens after each history (S = max depth)."""
        S = self.spec.draft_len
        rows = []
        for b, h in enumerate(history):
            ref = self.reference[b]
            k = len(h) - self.plen[b]  # tokens emitted so far, pending included
            seq = list(ref[k:k + S])
            rows.append(seq + [ref[-1]] * (S - len(seq)))
        return torch.tensor(rows, dtype=torch.long)

    def propose(self, history: list[list[int]], pending: Tensor) -> DraftTree:
        true = self.truth(history)[:, self.depth_idx]  # (B, T) the true token of each node's depth
        bsz, T = true.shape
        keep = torch.rand(bsz, T, generator=self.gen) < self.p
        shift = 1 + torch.randint(self.vocab_size - 1, (bsz, T), generator=self.gen)  # 1 .. V-1: never the truth
        tokens = torch.where(keep, true, (true + shift) % self.vocab_size).to(self.device)
        if self.parents is None:
            return DraftTree.from_chains(tokens.reshape(bsz, self.spec.num_drafts, self.spec.draft_len))
        parents = torch.tensor(self.parents, device=self.device).expand(bsz, -1).contiguous()
        return DraftTree(tokens, parents, None, 0, self.spec.draft_len)
