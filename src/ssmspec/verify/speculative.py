"""Speculative sampling: emitted tokens follow the target distribution exactly, whatever the drafts.

Chains (Leviathan et al. 2023, Alg. 1): draft x_i, drawn from q_i, is accepted with probability
min(1, p_i(x_i) / q_i(x_i)) where p_i is the target distribution at its parent; at the first rejection
the bonus is drawn from the residual norm(max(0, p_i - q_i)); after a full acceptance from p at the last
draft. ``verify_chain`` does this for all positions at once (no loop over S, no host sync).

Trees (multi-step speculative sampling, SpecInfer Alg. 2 / SpecExec; seed 003 "MSS sampling"): at the
current node, with residual r = p(node), the children are tried in node order; child x (drawn from q) is
accepted with probability min(1, r(x) / q(x)), which moves to it (r = p(child)); a rejection updates
r = norm(max(0, r - q)). When a node has no child left, the bonus is drawn from r. ``verify_tree`` walks
all nodes once in topological order (children always come after their parent, so one pass suffices).

Exactness needs, at every node, the children to be independent draws from the q recorded for them (any
number of them, e.g. D sampled chains share the root). Deterministic drafts (``q`` None: PNG, beams,
static top-k trees, greedy draft models) are one-hot q: a child is accepted with probability r(x) and a
rejection removes x from r, exact for any choice of distinct or repeated children.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssmspec.verify.base import Verdict, path_to_node
from ssmspec.verify.distributions import SamplingConfig, sample, target_probs


def residual(r: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, r - q)) over the last axis (..., V). Where r <= q everywhere (r == q: a rejection had
    probability 0) r is returned, so the result is always a distribution."""
    res = (r - q).clamp(min=0.0)
    mass = res.sum(-1, keepdim=True)
    return torch.where(mass > 0, res / mass.clamp(min=torch.finfo(res.dtype).tiny), r)


def _q_of(drafts, V: int) -> Tensor | None:
    """Draft distributions (B, T, V) as fp32, zero-padded to the target's vocabulary; None if deterministic."""
    if drafts.q is None:
        return None
    q = drafts.q.float()
    if q.shape[-1] > V:
        raise ValueError(f"draft distributions have {q.shape[-1]} tokens but the target has {V}: the draft and "
                         f"target vocabularies must agree (pad the target's or trim the draft's)")
    return F.pad(q, (0, V - q.shape[-1])) if q.shape[-1] < V else q


def verify_chain(p: Tensor, tokens: Tensor, q: Tensor | None, u: Tensor, generator=None) -> Verdict:
    """One chain per sequence. p (B, 1+S, V) target probs at nodes 0..S; tokens (B, S); q (B, S, V) or
    None (one-hot); u (B, S) uniforms in [0, 1)."""
    bsz, S = tokens.shape
    V = p.shape[-1]
    px = p[:, :S].gather(2, tokens[..., None])[..., 0]  # (B, S) target prob of draft i at its parent
    qx = torch.ones_like(px) if q is None else q.gather(2, tokens[..., None])[..., 0]
    acc = u * qx < px  # u < p/q, i.e. accepted with probability min(1, p/q)
    a = acc.long().cumprod(dim=1).sum(dim=1)  # (B,) accepted prefix length
    p_a = p.gather(1, a[:, None, None].expand(bsz, 1, V))[:, 0]  # (B, V) target at the last accepted node
    i = a.clamp(max=S - 1)  # the rejected draft (when a < S)
    if q is None:
        q_a = F.one_hot(tokens.gather(1, i[:, None])[:, 0], V).to(p.dtype)
    else:
        q_a = q.gather(1, i[:, None, None].expand(bsz, 1, V))[:, 0]
    dist = torch.where((a == S)[:, None], p_a, residual(p_a, q_a))  # bonus from p after full acceptance
    k = torch.arange(S + 1, device=p.device)[None]
    path = torch.where(k <= a[:, None], k, torch.zeros_like(k))  # (B, 1+S) nodes 0..a
    return Verdict(accepted=a, path=path, bonus=sample(dist, generator))


def verify_tree(p: Tensor, drafts, q: Tensor | None, u: Tensor, generator=None) -> Verdict:
    """Any draft tree. p (B, 1+T, V) target probs at every node; q (B, T, V) or None; u (B, T)."""
    bsz, n, V = p.shape
    tokens, parents = drafts.tokens, drafts.parents
    cur = torch.zeros(bsz, dtype=torch.long, device=p.device)  # current (last accepted) node
    r = p[:, 0]  # (B, V) residual at the current node
    for j in range(1, n):  # node j: tried when its parent is the current node
        x = tokens[:, j - 1]
        cand = parents[:, j - 1] == cur
        qj = F.one_hot(x, V).to(p.dtype) if q is None else q[:, j - 1]
        rx = r.gather(1, x[:, None])[:, 0]
        qx = qj.gather(1, x[:, None])[:, 0]
        acc = cand & (u[:, j - 1] * qx < rx)
        rej = cand & ~acc
        r = torch.where(acc[:, None], p[:, j], torch.where(rej[:, None], residual(r, qj), r))
        cur = torch.where(acc, torch.full_like(cur, j), cur)
    path, depth = path_to_node(drafts.parents_with_root(), cur, drafts.max_depth())
    return Verdict(accepted=depth, path=path, bonus=sample(r, generator))


class SpeculativeVerifier:
    """Speculative sampling for chains and multi-step speculative sampling for trees (module doc).
    At temperature 0 the target is one-hot and this reduces to greedy verification."""

    name = "speculative"
    fp32_logits = True  # softmax with temperature / top-k / top-p

    def __init__(self, sampling: SamplingConfig | None = None) -> None:
        self.sampling = sampling or SamplingConfig()

    def verify(self, node_logits: Tensor, drafts, generator: torch.Generator | None = None) -> Verdict:
        p = target_probs(node_logits, self.sampling)  # (B, 1+T, V)
        bsz = p.shape[0]
        if drafts is None or drafts.size == 0:
            zeros = torch.zeros(bsz, dtype=torch.long, device=p.device)
            return Verdict(accepted=zeros, path=zeros[:, None], bonus=sample(p[:, 0], generator))
        q = _q_of(drafts, p.shape[-1])
        u = torch.rand(drafts.tokens.shape, generator=generator, device=p.device)  # (B, T)
        if drafts.is_single_chain:
            return verify_chain(p, drafts.tokens, q, u, generator)
        return verify_tree(p, drafts, q, u, generator)
