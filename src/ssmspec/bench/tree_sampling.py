"""Pieces of the STree end-to-end experiments (``bench/e2e_tree.py``) that are not a registered drafter or
verifier: naive tree sampling, the forced oracle under sampling, and a drafter whose q is a stated
perturbation of the target's p.

``NaiveTreeSampler`` (seed 003, "Effect of sampling algorithm", after SpecInfer / SpecExec): at the current
node the target *samples* a token y from its distribution p (temperature, top-k, top-p); if a child of the
node holds y the walk moves there, else y is the bonus and the step ends. Every emitted token is a fresh draw
from p given the emitted prefix, so the law is the target's exactly, whatever the drafts (they must only not
depend on the verifier's draws). A node is accepted with probability p(children's tokens), the target's
mass on the drafted set: high at low temperature, vanishing as p spreads over the vocabulary -- the seed's
finding. Multi-step speculative sampling (``verify/speculative.py``) instead takes children drawn from q and
accepts with min(1, r(x)/q(x)), so a q close to p keeps its acceptance at high temperature.

``ForcedSampler``: the forced oracle (``drafting/oracle.py``) vouches for its kept nodes; greedy verification
takes its word (``GreedyVerifier``). Under sampling nothing random-weight is ever accepted by an exact test
(the oracle cannot know p before the target's call), so the forced rows *time* the sampling verifier -- the
real speculative test runs on every node, its verdict is discarded -- and the accepted path is the deepest
fully kept one (the designed acceptance, alpha per branch); the bonus is sampled from the target's p at the
last accepted node. The emitted tokens of these rows are therefore *not* a sample of the target law (the kept
drafts are the reference's tokens): they are a systems measurement at a stated acceptance, and every row says
so (``law``).

``PerturbedTree``: a static tree shape filled by a draft model whose logits z get fresh Gaussian noise at every
node, scaled to their spread: q = softmax((z + sigma std(z) eps) / T), eps ~ N(0, 1) per token, std over the
vocabulary (so one sigma means the same on every preset, whatever the scale of its random logits). With
``draft`` = the target itself (``self`` drafter of the experiments) q is a stated perturbation of p: sigma = 0
drafts the target's own distribution. ``sample``:
children are independent draws from q and q is recorded (exact MSS); else the children are the top-k of the
perturbed logits (deterministic, for naive sampling and greedy runs). A single-chain shape gives chain drafts
(``DraftTree.from_chains``), so chain strategies and the Leviathan chain test apply.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.drafting.base import DraftTree
from ssmspec.drafting.static_tree import StaticTree
from ssmspec.strategies.base import SpecConfig
from ssmspec.verify.base import Verdict, path_to_node
from ssmspec.verify.distributions import SamplingConfig, sample, target_probs
from ssmspec.verify.greedy import GreedyVerifier
from ssmspec.verify.speculative import SpeculativeVerifier, _q_of, verify_chain, verify_tree


class NaiveTreeSampler:
    """Sample the target at each node, follow the child that holds the sample (module doc). Lossless."""

    name = "naive"

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling

    def verify(self, node_logits: Tensor, drafts, generator: torch.Generator | None = None) -> Verdict:
        p = target_probs(node_logits, self.sampling)  # (B, 1+T, V)
        y = p.argmax(-1) if self.sampling.greedy else sample(p, generator)  # (B, 1+T) the target's draw per node
        bsz = y.shape[0]
        cur = torch.zeros(bsz, dtype=torch.long, device=y.device)  # current node of the walk
        if drafts is not None and drafts.size:
            for j in range(1, drafts.size + 1):  # topological order: a node's children come after it
                hit = (drafts.parents[:, j - 1] == cur) & (drafts.tokens[:, j - 1] == y.gather(1, cur[:, None])[:, 0])
                cur = torch.where(hit, torch.full_like(cur, j), cur)
            path, depth = path_to_node(drafts.parents_with_root(), cur, drafts.max_depth())
        else:
            path, depth = cur[:, None], cur
        return Verdict(accepted=depth, path=path, bonus=y.gather(1, cur[:, None])[:, 0])


class ForcedSampler(SpeculativeVerifier):
    """Sampling verifier for the forced oracle: the real test's cost, the oracle's acceptance (module doc)."""

    name = "speculative-forced"

    def verify(self, node_logits: Tensor, drafts, generator: torch.Generator | None = None) -> Verdict:
        if drafts is None or drafts.size == 0 or drafts.match is None:
            return super().verify(node_logits, drafts, generator)
        p = target_probs(node_logits, self.sampling)  # (B, 1+T, V)
        q = _q_of(drafts, p.shape[-1])
        u = torch.rand(drafts.tokens.shape, generator=generator, device=p.device)  # (B, T)
        if drafts.is_single_chain:  # the test every node would get; its verdict is replaced below
            verify_chain(p, drafts.tokens, q, u, generator)
        else:
            verify_tree(p, drafts, q, u, generator)
        # the deepest fully kept path: GreedyVerifier reads drafts.match and never the logits' values
        forced = GreedyVerifier().verify(node_logits[..., :1], drafts)
        last = forced.last_node  # (B,)
        bonus = sample(p.gather(1, last[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0], generator)
        return Verdict(accepted=forced.accepted, path=forced.path, bonus=bonus)


class PerturbedTree(StaticTree):
    """Static ``shape`` from ``draft``'s logits plus N(0, sigma^2) noise; sampled or top-k children (module doc)."""

    def __init__(self, *, draft, shape="A", sigma: float = 0.0, temperature: float = 0.0, sample: bool = False,
                 noise_seed: int = 0, seed: int = 0, dtype: str | None = None) -> None:
        if sigma < 0:
            raise ValueError(f"sigma scales the noise added to the draft logits (in units of their std), >= 0; "
                             f"got {sigma}")
        self.sampling = SamplingConfig(temperature=float(temperature), seed=noise_seed)
        if sample and self.sampling.greedy:
            raise ValueError("sampled children at temperature 0 are all the draft's argmax; use sample=False "
                             "(top-k children) for greedy runs")
        super().__init__(draft=draft, shape=shape, seed=seed, dtype=dtype)
        self.sigma, self.sample = float(sigma), bool(sample)
        self.chain = self.parents == list(range(len(self.parents)))
        if self.chain:  # one chain of S drafts: a chain spec, so chain strategies take it
            self.is_tree = False
            self.spec = SpecConfig(draft_len=self.S)
        self._record(**self._options, sigma=self.sigma, temperature=float(temperature), sample=self.sample,
                     noise_seed=noise_seed)

    def reset(self, prompts, *, batch: int, device, max_new_tokens: int | None = None) -> None:
        super().reset(prompts, batch=batch, device=device, max_new_tokens=max_new_tokens)
        self.gen = torch.Generator(device=self.runner.model.device).manual_seed(self.sampling.seed)

    def generators(self) -> list[torch.Generator]:
        return [self.gen]

    def _choose(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        """logits (B, W, V) -> children tokens (B, W, kmax) per slot, and q (B, W, V) when sampled."""
        z = logits.float()
        if self.sigma:
            noise = torch.randn(z.shape, generator=self.gen, device=z.device)  # (B, W, V)
            z = z + self.sigma * z.std(dim=-1, keepdim=True) * noise
        if not self.sample:
            return z.topk(self.kmax, dim=-1).indices, None
        q = target_probs(z, self.sampling)  # (B, W, V)
        return sample(q[:, :, None].expand(-1, -1, self.kmax, -1), self.gen), q  # iid draws per child

    def _draft(self, root: Tensor) -> DraftTree:
        """As ``StaticTree._draft``, with perturbed logits and optionally sampled children and their q."""
        run, W = self.runner, self.width
        bsz = root.shape[0]
        top, q = self._choose(root[:, None])  # (B, 1, kmax), (B, 1, V)
        run.begin(W)
        layers, qs = [], []
        for d in range(1, self.S + 1):
            par_slot, rank = self.index[d - 1]  # (n_d,) each
            layers.append(top[:, par_slot, rank])  # (B, n_d)
            if q is not None:
                qs.append(q[:, par_slot])  # (B, n_d, V) each node's q is its parent's
            if d == self.S:
                break
            run.reorder(self.rows[d - 1])
            feed = torch.nn.functional.pad(layers[-1], (0, W - layers[-1].shape[1]))  # (B, W)
            logits = run.step(feed.reshape(-1), depth=d).reshape(bsz, W, -1)  # (B, W, V)
            top, q = self._choose(logits)
        tokens = torch.cat(layers, dim=1)[:, self.perm].to(self.device)  # (B, T) node order
        qt = torch.cat(qs, dim=1)[:, self.perm].to(self.device) if qs else None  # (B, T, V)
        if self.chain:
            return DraftTree.from_chains(tokens[:, None], None if qt is None else qt[:, None])
        return DraftTree(tokens, self.parents_t, qt, 0, self.S)
