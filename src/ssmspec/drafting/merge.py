"""Merging several draft chains of a sequence into one prefix tree (seeds 001 and 003: several drafts per
sequence, verified as one token tree).

Chains that share a prefix (PNG matches with the same first tokens, say) would otherwise be verified as
separate branches of the root, computing the shared tokens twice. The merged tree stores every distinct
(parent, token) pair once; nodes are numbered by first appearance, chain after chain, so parents come
before children (the topological order ``DraftTree`` requires).

Every sequence of the batch gets the same node count T (fixed shapes for the strategies): trees with
fewer distinct nodes are padded with copies of their node 1 (child of the root, same token). A copy is
never preferred: the greedy verifier keeps the first of equally deep accepted nodes, and speculative
sampling tries it after node 1, whose rejection has already removed that token from the residual.
Padding changes nothing but the call's size, so the padded T is also what a drafter with a fixed
``SpecConfig.tree_size`` asks for (``size=D*S``, the unmerged worst case).

Only deterministic drafts are merged: multi-step speculative sampling is exact when the children of a
node are independent draws from the node's draft distribution, which merging sampled chains breaks.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.drafting.base import DraftTree


def merge_chains(tokens: Tensor, *, size: int | None = None, q: Tensor | None = None,
                 device=None) -> DraftTree:
    """tokens (B, D, S) int64 -> ``DraftTree`` (B, T) with shared prefixes stored once.

    ``size``: node count T of the result (>= the largest merged tree; None: exactly that, which syncs
    the host and varies from step to step). Runs on the host (token lists), like the drafters that chain
    drafts come from; the result lives on ``device`` (default ``tokens.device``).
    """
    if q is not None:
        raise ValueError("merge_chains merges deterministic drafts only (q=None): merging sampled chains breaks "
                         "the independent-siblings property multi-step speculative sampling relies on; verify "
                         "sampled chains unmerged with DraftTree.from_chains")
    if tokens.dim() != 3:
        raise ValueError(f"tokens must be (B, D, S), got shape {tuple(tokens.shape)}")
    bsz, D, S = tokens.shape
    if S == 0 or D == 0:
        raise ValueError("merge_chains needs at least one chain of at least one token")
    rows = tokens.tolist()
    trees: list[tuple[list[int], list[int]]] = []  # per sequence: (tokens, parents) of the merged nodes
    for chains in rows:
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node number
        toks: list[int] = []
        pars: list[int] = []
        for chain in chains:
            node = 0
            for t in chain:
                key = (node, t)
                if key not in index:
                    toks.append(t)
                    pars.append(node)
                    index[key] = len(toks)  # node numbers start at 1 (0 = the pending token)
                node = index[key]
        trees.append((toks, pars))
    need = max(len(t) for t, _ in trees)
    T = need if size is None else size
    if T < need:
        raise ValueError(f"merged tree has {need} nodes but size={size}; pass size >= {need} (D*S always fits)")
    out_tok = torch.empty(bsz, T, dtype=torch.long)
    out_par = torch.empty(bsz, T, dtype=torch.long)
    for b, (toks, pars) in enumerate(trees):
        pad = T - len(toks)
        out_tok[b] = torch.tensor(toks + [toks[0]] * pad, dtype=torch.long)  # copies of node 1
        out_par[b] = torch.tensor(pars + [0] * pad, dtype=torch.long)
    dev = tokens.device if device is None else device
    single = D == 1 and T == S  # one chain, unpadded: still a chain for chain-only strategies
    return DraftTree(out_tok.to(dev), out_par.to(dev), None, 1 if single else 0, S)
