"""`static_tree`: a fixed tree shape filled by a draft model's top-k tokens (seed 003, Fig. 4a, Fig. 5,
Table 4).

A shape is a parents list (node i >= 1 has parent ``parents[i-1]``, a smaller node number; 0 is the pending
token). The children of a node, in order, get the draft model's most likely, second most likely, ...
token at that node. Drafting runs one draft-model call per layer that has children, one row per node of
the layer, each row continuing from its parent's row (``DraftEngine.step``). Deterministic, so ``q`` is None. The schedule (each layer's parent slots, ranks and
scratch rows, the node order) is laid out on the device at ``reset``, so ``propose_device`` runs with no
host sync and can be captured in a CUDA graph.

Seed 003's shapes are figures not reproduced in its text; ``SHAPES`` rebuilds them from Table 4's width,
depth and token count (tokens include the root): A (width 3, depth 4, 13) is Fig. 4a's "4 steps, 3 tokens
per layer"; B (16, 3, 29); C (6, 3, 16); D (4, 4, 13: A's size, different connectivity); E (3, 5, 16: A one
layer deeper). Within those numbers, more children go to more likely parents.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssmspec.drafting.base import DraftTree
from ssmspec.drafting.registry import DrafterBase, register_drafter
from ssmspec.drafting.model_drafter import ModelDrafterBase
from ssmspec.strategies.base import SpecConfig

SHAPES: dict[str, list[int]] = {
    # layer 1: root's top-3 | layer 2: top-2 of n1, top-1 of n2 | layers 3, 4: the same under n4 / n7
    "A": [0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 8],
    # layer 1: top-4 | layer 2: top-4 of each | layer 3: top-4 of n5, top-2 of n6 and of n9
    "B": [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 9, 9],
    # layer 1: top-3 | layer 2: 3, 2, 1 children | layer 3: 3, 2, 1 children under n4, n5, n7
    "C": [0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 4, 4, 5, 5, 7],
    # layer 1: top-4 | layer 2: 2, 1, 1 children | layers 3, 4: top-2 under the first node
    "D": [0, 0, 0, 0, 1, 1, 2, 3, 5, 5, 9, 9],
    # A with a fifth layer
    "E": [0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 8, 10, 10, 11],
}


def check_parents(parents: list[int]) -> list[int]:
    """Validate a parents list (topological: parent of node i is in 0 .. i-1); returns depths with root."""
    if not parents:
        raise ValueError("a tree shape needs at least one node")
    depth = [0]
    for i, p in enumerate(parents, start=1):
        if not (isinstance(p, int) and 0 <= p < i):
            raise ValueError(f"tree shape: node {i} has parent {p!r}; parents must be ints in 0..{i - 1} "
                             f"(topological order, 0 = the pending token)")
        depth.append(depth[p] + 1)
    return depth


def resolve_shape(shape) -> list[int]:
    """A shape name of ``SHAPES`` or an explicit parents list."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown static tree shape {shape!r}; choose one of {sorted(SHAPES)} or give a "
                             f"parents list")
        return list(SHAPES[shape])
    return list(shape)


@register_drafter("static_tree")
class StaticTree(ModelDrafterBase, DrafterBase):
    """A fixed ``shape`` whose nodes take the draft model's top-k tokens (module doc)."""

    is_tree = True
    tree_options = "shape (a SHAPES name A-E or a parents list)"

    def __init__(self, *, draft="mamba2-130m", shape="A", seed: int = 0, dtype: str | None = None,
                 draft_strategy: str = "snapshot") -> None:
        super().__init__()
        parents = resolve_shape(shape)
        depth = check_parents(parents)
        self.parents = parents
        self.S = max(depth)
        self.spec = SpecConfig(draft_len=self.S, tree_size=len(parents))
        # per node: layer, slot within its layer, rank among its siblings
        self.layers: list[list[int]] = [[0]] + [[] for _ in range(self.S)]
        slot, rank, kids = [0], [0], [0] * (len(parents) + 1)
        for i, p in enumerate(parents, start=1):
            slot.append(len(self.layers[depth[i]]))
            self.layers[depth[i]].append(i)
            rank.append(kids[p])
            kids[p] += 1
        self.slot, self.rank, self.depth = slot, rank, depth
        self.width = max(len(layer) for layer in self.layers)
        self.kmax = max(kids)
        opts = self._init_draft(draft, seed=seed, dtype=dtype, draft_strategy=draft_strategy)
        self._record(**opts, shape=shape if isinstance(shape, str) else parents)

    def _shape(self):
        """W rows (the widest layer), S deep; a layer's rows continue from their parents' rows."""
        return self.width, self.S, True

    def reset(self, prompts, *, batch: int, device, max_new_tokens: int | None = None) -> None:
        """Prefill the draft on ``prompts`` (``max_new_tokens`` sizes its KV cache) and lay the shape's static
        schedule out on the device: per layer its nodes, their parents' slots and ranks, the scratch row each
        slot continues from."""
        if self._draft_cfg.vocab_size < self.kmax:
            raise ValueError(f"shape has a node with {self.kmax} children but the draft vocabulary has "
                             f"{self._draft_cfg.vocab_size} tokens")
        eng = self._reset_engine(prompts, device, max_new_tokens=max_new_tokens)
        dev, bsz, W = eng.model.device, len(prompts), self.width
        base = torch.arange(bsz, device=dev)[:, None] * W  # (B, 1) first scratch row per sequence
        self.index = []  # per layer d >= 1: (parent's slot in layer d-1, rank among siblings) (n_d,) each
        self.rows = []  # per layer d >= 1: (B*W,) row each layer-d row continues from
        for layer in self.layers[1:]:
            par_slot = [self.slot[self.parents[i - 1]] for i in layer]
            self.index.append((torch.tensor(par_slot, device=dev), torch.tensor([self.rank[i] for i in layer],
                                                                                device=dev)))
            src = torch.tensor(par_slot + [0] * (W - len(layer)), device=dev)  # (W,) unused slots copy slot 0
            self.rows.append((base + src[None]).reshape(-1))
        order = [i for layer in self.layers[1:] for i in layer]  # node numbers, layer after layer
        self.perm = torch.tensor([order.index(i) for i in range(1, len(self.parents) + 1)], device=dev)  # (T,)
        self.parents_t = torch.tensor(self.parents, device=self.device).expand(bsz, -1).contiguous()  # (B, T)

    def _draft(self, root: Tensor) -> DraftTree:
        """root (B, V) draft logits after the pending token -> the shape filled with ranked tokens (B, T)."""
        eng, W = self.engine, self.width
        bsz = root.shape[0]
        top = root.topk(self.kmax, dim=-1).indices[:, None]  # (B, 1, kmax) ranked tokens per layer-0 slot
        layers = []
        for d in range(1, self.S + 1):
            par_slot, rank = self.index[d - 1]  # (n_d,) each
            tok = top[:, par_slot, rank]  # (B, n_d) each node's ranked token at its parent
            layers.append(tok)
            if d == self.S:
                break
            # rows of layer d: slot j continues from its parent's row, then feeds node j's token
            feed = F.pad(tok, (0, W - tok.shape[1]))  # (B, W)
            logits = eng.step(feed.reshape(-1), depth=d, parents=self.rows[d - 1]).reshape(bsz, W, -1)  # (B, W, V)
            top = logits.topk(self.kmax, dim=-1).indices  # (B, W, kmax)
        tokens = torch.cat(layers, dim=1)[:, self.perm]  # (B, T) back to node order
        return DraftTree(tokens.to(self.device), self.parents_t, None, 0, self.S)
