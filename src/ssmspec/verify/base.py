"""Verdicts: what a verifier decides for every sequence of a step, as device tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class Verdict:
    accepted: Tensor  # (B,) int64 number of accepted draft tokens a (0 .. max depth)
    path: Tensor  # (B, 1+Smax) node numbers of the accepted path: path[:, 0] = 0 (pending), path[:, 1..a]
    bonus: Tensor  # (B,) int64 token emitted after the accepted drafts (correction or bonus)

    @property
    def last_node(self) -> Tensor:
        """(B,) node number of the last accepted node (0 when nothing was accepted)."""
        return self.path.gather(1, self.accepted[:, None])[:, 0]

    def emitted(self, drafts) -> list[list[int]]:
        """Host-side: the tokens each sequence emits this step (accepted drafts, then the bonus)."""
        acc = self.accepted.tolist()
        bonus = self.bonus.tolist()
        if drafts is None:
            return [[b] for b in bonus]
        toks = torch.cat([torch.zeros_like(drafts.tokens[:, :1]), drafts.tokens], 1).gather(1, self.path).tolist()
        return [row[1:1 + a] + [b] for row, a, b in zip(toks, acc, bonus)]


class Verifier(Protocol):
    name: str
    # False: the verdict reads only the order of each node's logits (argmax), which the model dtype's logits
    # already fix (their fp32 upcast is exact), so the step skips the fp32 copy of the (rows, L, V) logits
    fp32_logits: bool
    # True: the verdict reads only each node's argmax, so the step hands ``verify_argmax`` the target's argmax
    # (``HybridLM.argmax``: the LM head over bounded chunks of positions) and never holds the (rows, L, V) logits;
    # a subclass that asks for fp32 logits (to record them) is handed logits again (``reads_argmax``)
    argmax_only: bool

    def verify(self, node_logits: Tensor, drafts, generator: torch.Generator | None = None) -> Verdict:
        """node_logits (B, 1+T, V): target logits at every tree node (node 0 = pending token)."""

    def verify_argmax(self, target: Tensor, drafts) -> Verdict:
        """target (B, 1+T) int64: the target's argmax at every tree node; only where ``argmax_only``."""


def reads_argmax(verifier) -> bool:
    """Whether the step hands ``verifier`` the argmax (``verify_argmax``) rather than logits (``verify``)."""
    return bool(getattr(verifier, "argmax_only", False)) and not getattr(verifier, "fp32_logits", True)


def path_to_node(parents_with_root: Tensor, node: Tensor, max_depth: int) -> tuple[Tensor, Tensor]:
    """Walk up from ``node`` (B,) to the root. Returns (path (B, 1+max_depth) root-first, padded with 0
    past the node's depth; depth (B,)). No host sync."""
    bsz = node.shape[0]
    chain = [node]
    for _ in range(max_depth):
        chain.append(parents_with_root.gather(1, chain[-1][:, None])[:, 0])
    up = torch.stack(chain, dim=1)  # (B, 1+max_depth): node, parent, ..., root, root, ...
    depth = (up != 0).sum(dim=1)  # number of non-root entries = depth of node
    # root-first: entry k is up[depth - k] for k <= depth, else 0
    k = torch.arange(max_depth + 1, device=node.device)[None].expand(bsz, -1)
    src = (depth[:, None] - k).clamp(min=0)
    path = up.gather(1, src).masked_fill(k > depth[:, None], 0)
    return path, depth
