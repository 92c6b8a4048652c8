"""Draft trees: what every drafter proposes and every verifier judges.

A sequence's drafts form a tree hanging under its pending token (the last emitted token, not yet fed
to the model). Nodes are numbered in topological order: node 0 is the pending token, node i >= 1 is
``tokens[:, i-1]`` with parent ``parents[:, i-1]`` (a node number < i). Chains are trees too: D
independent chains of S tokens are laid out chain after chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ssmspec.ops.capture import kept


@dataclass
class DraftTree:
    tokens: Tensor  # (B, T) int64 draft tokens, topological order
    parents: Tensor  # (B, T) int64 parent node of each draft (0 = the pending token)
    q: Tensor | None = None  # (B, T, V) drafter's distribution each token was drawn from (None: deterministic)
    num_chains: int = 0  # D when the tree is D disjoint chains of equal length, else 0
    depth: int = 0  # static max depth when the drafter knows it (0: unknown, max_depth() syncs the host)
    # (B, T) bool or None: the drafter vouches that these nodes are the target's next token (the forced
    # oracle, for step-cost benchmarks on random bf16 weights); greedy verification then takes its word
    # instead of comparing tokens, so the accepted counts do not depend on near-tie argmax flips
    match: Tensor | None = None

    @property
    def size(self) -> int:  # T
        return self.tokens.shape[1]

    @property
    def is_single_chain(self) -> bool:
        return self.num_chains == 1

    @property
    def chain_len(self) -> int:  # S for chains
        return self.size // self.num_chains if self.num_chains else 0

    @classmethod
    def from_chains(cls, tokens: Tensor, q: Tensor | None = None) -> "DraftTree":
        """tokens (B, D, S) -> D disjoint chains; q (B, D, S, V)."""
        bsz, D, S = tokens.shape
        parents = chain_layout(D, S, tokens.device)[0].expand(bsz, -1)  # (B, D*S), a shared constant: read only
        return cls(tokens.reshape(bsz, D * S), parents, None if q is None else q.reshape(bsz, D * S, -1), D, S)

    @classmethod
    def merge_chains(cls, tokens: Tensor, *, size: int | None = None) -> "DraftTree":
        """tokens (B, D, S) -> one prefix tree per sequence, shared prefixes stored once (see
        ``drafting/merge.py``; deterministic drafts only)."""
        from ssmspec.drafting.merge import merge_chains

        return merge_chains(tokens, size=size)

    def chains(self) -> Tensor:
        """(B, D, S) view of chain drafts."""
        assert self.num_chains, "not a chain draft"
        return self.tokens.reshape(self.tokens.shape[0], self.num_chains, -1)

    def parents_with_root(self) -> Tensor:
        """(B, 1+T) parent of every node; the root is its own parent."""
        return torch.cat([torch.zeros_like(self.parents[:, :1]), self.parents], dim=1)

    def depths_with_root(self) -> Tensor:
        """(B, 1+T) depth of every node (root 0); for chains a shared constant (read only, no launch)."""
        if self.num_chains:
            return chain_layout(self.num_chains, self.chain_len, self.tokens.device)[1].expand(self.tokens.shape[0], -1)
        par = self.parents_with_root()
        depth = torch.zeros_like(par)
        for i in range(1, par.shape[1]):  # topological order: parents come first
            depth[:, i] = depth.gather(1, par[:, i:i + 1])[:, 0] + 1
        return depth

    def ancestor_mask(self) -> Tensor:
        """(B, 1+T, 1+T) bool, [i, j] = node j is node i or one of its ancestors."""
        par = self.parents_with_root()
        bsz, n = par.shape
        mask = torch.zeros(bsz, n, n, dtype=torch.bool, device=par.device)
        mask[:, 0, 0] = True
        for i in range(1, n):
            mask[:, i] = mask[torch.arange(bsz, device=par.device), par[:, i]]
            mask[:, i, i] = True
        return mask

    def max_depth(self) -> int:
        if self.depth:
            return self.depth
        return int(self.depths_with_root().max()) if self.size else 0


_CHAIN_LAYOUTS: dict[tuple, tuple[Tensor, Tensor]] = {}


def chain_layout(D: int, S: int, device) -> tuple[Tensor, Tensor]:
    """The fixed layout of D chains of S drafts: (parents (1, D*S), depths with the root (1, 1+D*S)), int64.

    A step of a chain drafter would otherwise rebuild these every step (a handful of launches each, inside every
    captured step). Kept per (D, S, device) once built outside a CUDA graph capture (``ops/capture.py``). Shared:
    read only."""
    def build() -> tuple[Tensor, Tensor]:
        idx = torch.arange(S, device=device)
        base = 1 + torch.arange(D, device=device)[:, None] * S  # first node of each chain
        parents = torch.where(idx[None] == 0, torch.zeros_like(base), base + idx[None] - 1).reshape(1, D * S)
        depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), (idx + 1).repeat(D)])[None]
        return parents, depths  # (1, D*S), (1, 1+D*S)

    return kept(_CHAIN_LAYOUTS, (D, S, str(torch.device(device))), device, build)


@dataclass
class TokenBuffer:
    """Every sequence's tokens on the device, as the engine keeps them (``engine/step.py``).

    Row b holds the prompt from column 0, then every emitted token; the pending token (emitted, not yet
    fed to the target) is the last valid one, at column ``length[b] - 1``. Columns at or past ``length`` are
    stale. Shapes never change during a run, so a drafter reading it can be captured in a CUDA graph.
    """

    tokens: Tensor  # (B, capacity) int64
    length: Tensor  # (B,) int64 valid tokens per row (prompt + emitted, pending included)
    prompt_len: Tensor  # (B,) int64 prompt tokens per row

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def pending(self) -> Tensor:
        """(B,) the pending token of every row."""
        return self.tokens.gather(1, (self.length - 1).clamp(min=0)[:, None])[:, 0]

    def to_lists(self) -> list[list[int]]:
        """Host copy of every row's valid tokens (synchronises with the device: host drafters only)."""
        toks, n = self.tokens.tolist(), self.length.tolist()
        return [row[:k] for row, k in zip(toks, n)]


class Drafter(Protocol):
    """Proposes drafts for every sequence of the batch each step.

    Two ways to propose, one per kind of drafter:
    - ``propose_device(buf)`` reads the engine's ``TokenBuffer`` and runs device ops only, with shapes fixed
      at ``reset`` (no host sync, no data-dependent shape): the engine captures it in a CUDA graph of its
      own, beside the target's step (``on_device`` True).
    - ``propose(history, pending)`` works on host lists; the engine copies the buffer to the host for it
      every step (``on_device`` False; result rows say so).
    """

    name: str
    is_tree: bool  # proposes trees that are not chains
    on_device: bool  # propose_device is capturable (no host sync)

    def reset(self, prompts: list[list[int]], *, batch: int, device, max_new_tokens: int | None = None) -> None:
        """Called once before generation with each sequence's prompt ids; ``max_new_tokens`` bounds what the
        run will append (drafters with caches size them from it; None: their own default)."""

    def propose(self, history: list[Tensor], pending: Tensor) -> DraftTree:
        """history: per sequence, every token so far (prompt + output, pending included)."""

    def propose_device(self, buf: TokenBuffer) -> DraftTree:
        """The same drafts as ``propose`` from the device token buffer."""

    def observe(self, verdict) -> None:
        """Told the verdict of each step before the next ``propose_device`` (the engine's step does it): a draft
        model's chains resume from its own state after the accepted drafts (``DraftEngine.resume``); device-side."""
