"""Greedy verification of chains and trees (temperature 0): accept a draft node when its token is the
target's argmax at its parent; keep the deepest fully accepted path; the bonus is the argmax there.
Drafts that carry ``match`` (the forced oracle) are accepted where it says so instead (same work)."""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.step_glue import chain_verdict
from ssmspec.verify.base import Verdict, path_to_node


class GreedyVerifier:
    name = "greedy"
    fp32_logits = False  # argmax of the model dtype's logits = argmax of their exact fp32 upcast, ties included
    argmax_only = True  # the step hands verify_argmax the argmax, made in bounded chunks (verify/base.py)

    def verify(self, node_logits: Tensor, drafts, generator: torch.Generator | None = None) -> Verdict:
        return self.verify_argmax(node_logits.argmax(-1), drafts)

    def verify_argmax(self, target: Tensor, drafts) -> Verdict:
        """target (B, 1+T): the target's next token after each node (its argmax there)."""
        bsz = target.shape[0]
        if drafts is None or drafts.size == 0:
            zeros = torch.zeros(bsz, dtype=torch.long, device=target.device)
            return Verdict(accepted=zeros, path=zeros[:, None], bonus=target[:, 0])
        if drafts.is_single_chain:  # node k is depth k: the accepted count is the run of matches (a few launches)
            return _chain_verdict(target, drafts)
        par = drafts.parents_with_root()  # (B, 1+T)
        n = par.shape[1]
        ok = torch.zeros(bsz, n, dtype=torch.bool, device=target.device)
        ok[:, 0] = True
        for i in range(1, n):  # topological order: a node is accepted when its parent is and it matches
            p = par[:, i]
            same = drafts.tokens[:, i - 1] == target.gather(1, p[:, None])[:, 0]
            if drafts.match is not None:
                same = drafts.match[:, i - 1]
            ok[:, i] = ok.gather(1, p[:, None])[:, 0] & same
        depth = drafts.depths_with_root()
        score = torch.where(ok, depth, torch.full_like(depth, -1))
        best = score.argmax(dim=1)  # deepest accepted node (first in topological order on ties)
        path, acc = path_to_node(par, best, drafts.max_depth())  # static depth from the drafter: no host sync
        return Verdict(accepted=acc, path=path, bonus=target.gather(1, best[:, None])[:, 0])


def _chain_verdict(target: Tensor, drafts) -> Verdict:
    """One chain of S drafts: the verdict of the tree walk above in closed form, in one launch
    (``ops/step_glue.chain_verdict``). target (B, 1+S) the target's argmax after every node; draft k (node k) is
    accepted when it and every draft before it match."""
    acc, path, bonus = chain_verdict(target, drafts.tokens, drafts.match)
    return Verdict(accepted=acc, path=path, bonus=bonus)
