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
Acceptance is stated per branch: a node is accepted when it is kept and its parent was accepted, so the
accepted length is the depth of the deepest fully kept path; ``expected_accepted`` gives its exact mean for
any shape (chains: sum_k p^k; D chains: sum_k 1 - (1 - p^k)^D; trees: a recursion over the shape).
``rank_decay`` (beta, trees): the r-th child of a node (r = 0, 1, ... in node order) is kept with probability
p * beta^r instead of p, as a real drafter's second and third guesses are right less often than its first
(beta = 1: every branch alike).

``forced=True`` (the throughput experiments): the drafts also carry ``match`` = the kept nodes, and greedy
verification accepts exactly those. With fp32 weights this changes nothing (kept tokens are the target's
tokens); with random bf16 weights a near-tie argmax of a speculative step can differ from the
autoregressive reference, after which every kept token would be rejected and the acceptance would fall far
below p. Forced, the accepted counts are the designed truncated geometric whatever the numerics; the
emitted tokens are the drafts along the accepted path, then the target's own bonus token.

``draws`` (``"random"``, the default, or ``"weyl"``): how the kept nodes are drawn. ``random``: seeded
pseudo-random Bernoulli draws (``torch.rand``). ``weyl``: low-discrepancy draws (``drafting/weyl.py``): the same
independent-Bernoulli law of every node in the limit, but the frequency of every accepted length converges
like 1/n, so a few hundred steps hold the measured mean accepted length within 2% of ``expected_accepted``
where independent draws need ~10^4 (``weyl.steps_needed`` / ``weyl.iid_steps``). Sequence b's k-th draw is
used at its k-th proposal while it runs (tokens emitted < the run's budget), so a finished sequence consumes
none and the draws a run counts are consecutive terms; they are precomputed at ``reset`` for the run's budget
(``max_new_tokens``) into one (B, budget + 1, T) table that the device reads by index.

Runs on the device (``on_device``): the references live in one (B, horizon) tensor, the position in them
is read from the engine's ``TokenBuffer`` (tokens emitted so far), and the Bernoulli draws come from a
generator on the target's device, so ``propose_device`` is captured in the engine's drafter graph.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.drafting.base import DraftTree, TokenBuffer
from ssmspec.drafting.registry import DrafterBase, register_drafter
from ssmspec.drafting.static_tree import check_parents, resolve_shape
from ssmspec.drafting.weyl import WeylDraws, reach
from ssmspec.strategies.base import SpecConfig

DRAWS = ("random", "weyl")


def sibling_ranks(parents: list[int]) -> list[int]:
    """Rank of every node among its siblings (0 = first child of its parent, in node order)."""
    kids = [0] * (len(parents) + 1)
    out = []
    for par in parents:
        out.append(kids[par])
        kids[par] += 1
    return out


def expected_accepted(p: float, *, draft_len: int = 0, num_drafts: int = 1, tree=None,
                      rank_decay: float = 1.0) -> float:
    """Exact mean accepted length of oracle drafts under greedy (or forced) verification: the expected depth
    of the deepest path from the pending token whose every node is kept, each node independently with
    probability ``p`` (per branch; ``p * rank_decay^r`` for the r-th child of a tree node). ``tree``: a static
    shape name or parents list; else ``num_drafts`` chains of ``draft_len``.

    Recursion: f_v(d) = P(some path of d more kept nodes below node v); f_v(0) = 1 and
    f_v(d) = 1 - prod_{children c} (1 - p_c f_c(d - 1)); the mean is sum_{d >= 1} f_root(d)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if not 0.0 <= rank_decay <= 1.0:
        raise ValueError(f"rank_decay must be in [0, 1], got {rank_decay}")
    if tree is None:
        if draft_len < 0 or num_drafts < 1:
            raise ValueError(f"need draft_len >= 0 and num_drafts >= 1, got {draft_len}, {num_drafts}")
        parents = chain_parents(draft_len, num_drafts)
    else:
        parents = resolve_shape(tree)
    if not parents:
        return 0.0
    check_parents(parents)
    keep = [p * (rank_decay if tree is not None else 1.0) ** r for r in sibling_ranks(parents)]
    return float(reach(parents, keep)[0, 1:].sum())


def chain_parents(draft_len: int, num_drafts: int = 1) -> list[int]:
    """Parents list of ``num_drafts`` chains of ``draft_len`` drafts, laid out chain after chain."""
    return [0 if s == 0 else 1 + c * draft_len + s - 1 for c in range(num_drafts) for s in range(draft_len)]


@register_drafter("oracle")
class Oracle(DrafterBase):
    """Corrupted greedy continuation of the target (module doc)."""

    on_device = True

    def __init__(self, *, p: float = 0.8, draft_len: int | None = None, num_drafts: int | None = None,
                 tree=None, reference: list[list[int]] | None = None, target=None, horizon: int = 256,
                 vocab_size: int | None = None, seed: int = 0, forced: bool = False,
                 rank_decay: float = 1.0, draws: str = "random") -> None:
        super().__init__()
        if draws not in DRAWS:
            raise ValueError(f"oracle draws must be one of {', '.join(DRAWS)}, got {draws!r}")
        self.draws = draws
        p = float(p)
        if not (0.0 <= p <= 1.0):
            raise ValueError(f"oracle keeps each true token with probability p, which must be in [0, 1]; got p={p}")
        if not (0.0 <= rank_decay <= 1.0):
            raise ValueError(f"oracle rank_decay must be in [0, 1], got {rank_decay}")
        if rank_decay != 1.0 and tree is None:
            raise ValueError("oracle rank_decay ranks the children of a tree node; chains have one child per node "
                             "(drop rank_decay, or draft a tree)")
        self.rank_decay = float(rank_decay)
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
        self.forced = bool(forced)
        self.vocab_size = vocab_size if vocab_size is not None else (target.cfg.vocab_size if target is not None else None)
        self._record(p=p, draft_len=self.spec.draft_len if tree is None else None,
                     num_drafts=self.spec.num_drafts if tree is None else None,
                     tree=tree if tree is None or isinstance(tree, str) else list(self.parents), horizon=horizon,
                     seed=seed, forced=self.forced, rank_decay=self.rank_decay, draws=draws)

    def shape(self) -> tuple[list[int], list[float]]:
        """(parents, keep probability) of nodes 1..T in draft order (chains: chain after chain)."""
        if self.parents is not None:
            return list(self.parents), [self.p * self.rank_decay ** r for r in sibling_ranks(self.parents)]
        parents = chain_parents(self.spec.draft_len, self.spec.num_drafts)
        return parents, [self.p] * len(parents)

    def expected_accepted(self) -> float:
        """Exact mean accepted length of these drafts under greedy / forced verification (module function)."""
        parents, keep = self.shape()
        return float(reach(parents, keep)[0, 1:].sum())

    def reset(self, prompts, *, batch: int, device, max_new_tokens: int | None = None) -> None:
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
        dev = self.device
        width = max(len(r) for r in self.reference)
        # (B, width) references, each padded with its last token (past the end it stands in)
        self.ref = torch.tensor([list(r) + [r[-1]] * (width - len(r)) for r in self.reference], dtype=torch.long,
                                device=dev)
        self.plen = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)  # (B,)
        self.gen = torch.Generator(device=dev).manual_seed(self.seed)
        self.depth_idx = torch.tensor(self.node_depth, device=dev) - 1  # (T,) depth-1 of every node
        ranks = sibling_ranks(self.parents) if self.parents is not None else [0] * len(self.node_depth)
        self.keep_p = torch.tensor([self.p * self.rank_decay ** r for r in ranks], device=dev)  # (T,) per node
        if self.parents is not None:
            self.parents_t = torch.tensor(self.parents, device=dev).expand(batch, -1).contiguous()
        if self.draws == "weyl":
            # the run's budget bounds the draws a sequence consumes (one per running step, >= 1 token a step)
            self.budget = int(max_new_tokens) if max_new_tokens is not None else width
            parents, keep = self.shape()
            self.weyl = WeylDraws(parents, keep, batch=batch, seed=self.seed)
            self.weyl_start = [0] * batch  # index of each sequence's first draw in the table
            self.table = torch.from_numpy(self.weyl.fill(self.weyl_start, self.budget + 1)).to(dev)  # (B, N, T)
            self.draw_idx = torch.zeros(batch, dtype=torch.long, device=dev)  # (B,) draws consumed
            self.rows = torch.arange(batch, device=dev)

    def generators(self) -> list[torch.Generator]:
        """The generator propose_device draws from (a CUDA graph must advance it on replay)."""
        return [self.gen]

    def _truth(self, emitted: Tensor) -> Tensor:
        """(B, S) the target's next S greedy tokens after ``emitted`` (B,) tokens (pending included)."""
        S = self.spec.draft_len
        k = emitted[:, None] + torch.arange(S, device=emitted.device)[None]  # (B, S)
        return self.ref.gather(1, k.clamp(min=0, max=self.ref.shape[1] - 1))

    def truth(self, history: list[list[int]]) -> Tensor:
        """(B, S) the target's next S greedy tokens after each history (host lists)."""
        n = torch.tensor([len(h) for h in history], dtype=torch.long, device=self.device)
        return self._truth(n - self.plen).cpu()

    def _kept(self, emitted: Tensor, bsz: int, T: int) -> Tensor:
        """(B, T) bool: the nodes this step keeps. ``emitted`` (B,) tokens emitted so far (pending included)."""
        if self.draws == "random":
            return torch.rand(bsz, T, generator=self.gen, device=self.device) < self.keep_p
        keep = self.table[self.rows, self.draw_idx.clamp(max=self.table.shape[1] - 1)]  # (B, T)
        self.draw_idx.add_((emitted < self.budget).long())  # a running sequence consumed its draw
        return keep

    def _draw(self, true: Tensor, emitted: Tensor) -> DraftTree:
        """true (B, T) the true token of every node -> drafts with each token kept with probability p."""
        bsz, T = true.shape
        keep = self._kept(emitted, bsz, T)
        shift = 1 + torch.randint(self.vocab_size - 1, (bsz, T), generator=self.gen, device=true.device)  # never 0
        tokens = torch.where(keep, true, (true + shift) % self.vocab_size)
        if self.parents is None:
            drafts = DraftTree.from_chains(tokens.reshape(bsz, self.spec.num_drafts, self.spec.draft_len))
        else:
            drafts = DraftTree(tokens, self.parents_t, None, 0, self.spec.draft_len)
        drafts.match = keep if self.forced else None
        return drafts

    def propose_device(self, buf: TokenBuffer) -> DraftTree:
        emitted = buf.length - buf.prompt_len
        return self._draw(self._truth(emitted)[:, self.depth_idx], emitted)

    def propose(self, history: list[list[int]], pending: Tensor) -> DraftTree:
        emitted = torch.tensor([len(h) for h in history], dtype=torch.long, device=self.device) - self.plen
        return self._draw(self._truth(emitted)[:, self.depth_idx], emitted)
