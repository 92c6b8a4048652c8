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

``CoupledOracle`` + ``CoupledSampler`` (the honest oracle under sampling; lossless): the target samples the
token at output position k of sequence b by an exponential race, argmax(p / E), whose noise E(b, k, v) is a
fixed hash of (seed, b, k, v) instead of a stream of random numbers -- still an exact draw from p, since the
noise of a position is independent of everything before it. The oracle's truth is the target's own sampled
continuation under that noise (``coupled_reference``: a run whose drafts are never right), so the token the
target will sample at a node on the true path is known in advance, and each node holds it with probability
alpha per branch. Verification is a real test: at each node the target samples y with the node's noise and
the walk enters the child holding y (for deterministic drafts this *is* multi-step speculative sampling and
Leviathan's test: a child x is entered with probability r(x), and after rejected children the race's winner is
a draw from the residual). The oracle's kept siblings hold the same token (the truth of their depth): they are
one prefix, with the same logits and the same position noise, so the walk runs on the prefix-merged tree and
enters that prefix once, with every continuation drafted under any copy of it (a walk into the first copy
alone would lose the kept paths under the others and accept less than the oracle's law). A kept node holds y,
a corrupted one never does, so the accepted length is the depth of the deepest fully kept path, the designed
law, and the emitted tokens are the reference: an exact sample of the target, as with greedy verification at
temperature 0. Different numerics of the tree call can flip a near-tie of the race, after
which the drafts are off the path (``ref_match`` in the rows says how often).

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

from ssmspec.drafting.base import DraftTree, TokenBuffer
from ssmspec.drafting.oracle import Oracle
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


# odd 63-bit multipliers (splitmix64 / PCG constants, top bit cleared so they fit a signed int64)
_K_SEED, _K_ROW, _K_POS, _K_TOK = 0x5851F42D4C957F2D, 0x2545F4914F6CDD1D, 0x1B873593A5E2C3B7, 0x3C6EF372FE94F82B
_M1, _M2 = 0x7FB5D329728EA185, 0x14057B7EF767814F


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 ``x`` by ``k`` (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def race_noise(seed: int, rows: Tensor, pos: Tensor, V: int) -> Tensor:
    """Exp(1) noise E (B, L, V) fp32 of sequences ``rows`` (B,) at output positions ``pos`` (B, L): a hash of
    (seed, row, position, token), the same whatever the call it is drawn in. int64 products wrap around."""
    v = torch.arange(V, device=pos.device, dtype=torch.long)
    s = (seed * _K_SEED) % 2 ** 64
    s = s - 2 ** 64 if s >= 2 ** 63 else s  # the int64 wrap of seed * K on the host (no copy under a graph)
    x = s + rows[:, None, None] * _K_ROW + pos[:, :, None] * _K_POS + v * _K_TOK  # (B, L, V)
    x = (x ^ _shr(x, 30)) * _M1  # splitmix64 finaliser
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    u = (_shr(x, 33).float() + 0.5) * (1.0 / 2 ** 31)  # (0, 1), 31 random bits
    return -torch.log(u)


class CoupledOracle(Oracle):
    """The oracle whose drafts carry their output position (``position`` (B,): tokens emitted so far, pending
    included), so ``CoupledSampler`` draws each node's noise by position (module doc)."""

    def propose_device(self, buf: TokenBuffer) -> DraftTree:
        drafts = super().propose_device(buf)
        drafts.position = buf.length - buf.prompt_len  # (B,) the pending node samples output position this
        return drafts

    def propose(self, history: list[list[int]], pending: Tensor) -> DraftTree:
        drafts = super().propose(history, pending)
        drafts.position = torch.tensor([len(h) for h in history], device=self.device) - self.plen
        return drafts


class CoupledSampler:
    """Sample the target at every node with position-keyed race noise and follow the child holding the sample
    (naive tree sampling; for deterministic drafts the law and acceptance of MSS / Leviathan). Lossless."""

    name = "coupled"

    def __init__(self, sampling: SamplingConfig, seed: int) -> None:
        self.sampling, self.seed = sampling, int(seed)

    def verify(self, node_logits: Tensor, drafts, generator: torch.Generator | None = None) -> Verdict:
        p = target_probs(node_logits, self.sampling)  # (B, 1+T, V)
        bsz, n, V = p.shape
        rows = torch.arange(bsz, device=p.device)
        if drafts is None:  # the prefill's first token: output position 0
            if n != 1:
                raise ValueError("CoupledSampler without drafts samples one position (the prefill's first token)")
            pos = torch.zeros(bsz, 1, dtype=torch.long, device=p.device)
        else:
            if getattr(drafts, "position", None) is None:
                raise ValueError("CoupledSampler needs drafts that carry their output position (CoupledOracle)")
            pos = drafts.position[:, None] + drafts.depths_with_root()  # (B, 1+T) position each node samples
        y = (p / race_noise(self.seed, rows, pos, V)).argmax(-1)  # (B, 1+T) the target's draw at each node
        if drafts is None or drafts.size == 0:
            zeros = torch.zeros(bsz, dtype=torch.long, device=p.device)
            return Verdict(accepted=zeros, path=zeros[:, None], bonus=y[:, 0])
        # a node is entered when its parent is and it holds the parent's sample; the deepest entered node ends
        # the path. Sibling drafts with the same token are one prefix (same logits, same position noise, so the
        # same samples below them): this is the walk on the prefix-merged tree, which enters the one prefix
        # and sees every continuation drafted under any copy of it
        par = drafts.parents_with_root()  # (B, 1+T)
        ok = torch.zeros(bsz, par.shape[1], dtype=torch.bool, device=p.device)
        ok[:, 0] = True
        for j in range(1, par.shape[1]):  # topological order: a node's parent comes before it
            pj = par[:, j:j + 1]
            ok[:, j] = ok.gather(1, pj)[:, 0] & (drafts.tokens[:, j - 1] == y.gather(1, pj)[:, 0])
        depth = drafts.depths_with_root()
        best = torch.where(ok, depth, torch.full_like(depth, -1)).argmax(dim=1)  # deepest (first on ties)
        path, acc = path_to_node(par, best, drafts.max_depth())
        return Verdict(accepted=acc, path=path, bonus=y.gather(1, best[:, None])[:, 0])


def coupled_reference(model, prompts: list[list[int]], *, max_new_tokens: int, sampling: SamplingConfig, seed: int,
                      cuda_graph: bool | None = None) -> list[list[int]]:
    """The target's own sampled continuation under ``CoupledSampler``'s noise: a run with one draft a step that
    is never the truth (p = 0; a draft that happens to equal the sample is accepted, which changes nothing: the
    emitted tokens are the race's winners either way)."""
    from ssmspec.engine.generate import generate

    V = model.cfg.vocab_size
    dummy = [[0] for _ in prompts]
    drafter = CoupledOracle(p=0.0, draft_len=1, reference=dummy, vocab_size=V, seed=seed)
    out = generate(model, prompts, max_new_tokens=max_new_tokens, strategy="activation_replay", drafter=drafter,
                   verifier=CoupledSampler(sampling, seed), sampling=sampling, cuda_graph=cuda_graph)
    return out.sequences


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
        self.gen = torch.Generator(device=self.engine.model.device).manual_seed(self.sampling.seed)

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
        eng, W = self.engine, self.width
        bsz = root.shape[0]
        top, q = self._choose(root[:, None])  # (B, 1, kmax), (B, 1, V)
        layers, qs = [], []
        for d in range(1, self.S + 1):
            par_slot, rank = self.index[d - 1]  # (n_d,) each
            layers.append(top[:, par_slot, rank])  # (B, n_d)
            if q is not None:
                qs.append(q[:, par_slot])  # (B, n_d, V) each node's q is its parent's
            if d == self.S:
                break
            feed = torch.nn.functional.pad(layers[-1], (0, W - layers[-1].shape[1]))  # (B, W)
            logits = eng.step(feed.reshape(-1), depth=d, parents=self.rows[d - 1]).reshape(bsz, W, -1)  # (B, W, V)
            top, q = self._choose(logits)
        tokens = torch.cat(layers, dim=1)[:, self.perm].to(self.device)  # (B, T) node order
        qt = torch.cat(qs, dim=1)[:, self.perm].to(self.device) if qs else None  # (B, T, V)
        if self.chain:
            return DraftTree.from_chains(tokens[:, None], None if qt is None else qt[:, None])
        return DraftTree(tokens, self.parents_t, qt, 0, self.S)
