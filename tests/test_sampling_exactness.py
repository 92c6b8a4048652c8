"""Sampled speculation emits the exact law of every step's whole block, bonus included, and the test can fail.

A tiny Markov "language model" (V = 6): the target's next-token distribution after token x is P[x], the
drafter's is Q[x], a perturbation of P that is accepted often (about 0.8 a draft). Every row of a batch
decodes STEPS steps from the pending token START; each step drafts from Q (a chain of S = 3, or a token
tree whose siblings are independent draws from Q at their parent: multi-step speculative sampling) and the
verifier emits a block: the accepted drafts, then one more token (the correction after a rejection, or the
bonus after a path accepted down to a leaf, where no draft is left to try).

The statistic. Both models are Markov, so a step's block depends on the past only through its pending
token x: every step of every row is a draw from the block law L[x], the law of (length, tokens) of the
whole block. L[x] is enumerated exactly (``_block_law``). For a chain of S drafts, with y_0 = x,
p_i = P[y_{i-1}], q_i = Q[y_{i-1}] (Leviathan et al. 2023, Alg. 1: draft y_i is accepted with probability
min(1, p_i / q_i), so drawn-and-accepted with probability min(p_i, q_i)(y_i)):

    L[x](y_1..y_k, t) = prod_{i<=k} min(p_i, q_i)(y_i) * max(0, p_{k+1} - q_{k+1})(t)    for k < S
    L[x](y_1..y_S, t) = prod_{i<=S} min(p_i, q_i)(y_i) * p_{S+1}(t)                      full acceptance

(a rejection at i, then a draw from norm(max(0, p_i - q_i)), has probability sum(max(0, p_i - q_i)) times
that draw's law: the product is max(0, p_i - q_i)(t)). Trees follow the same walk child by child (seed
003, MSS): the residual after each rejected sibling is norm(max(0, r - q)), the same whatever token was
rejected, and the bonus at a leaf comes from p there. The counts n[x, block] over all steps are compared
with n[x] L[x] by Pearson's chi-square, one multinomial per pending token (cells expected below 5 pooled
per token); for a Markov chain of known transition law this is chi-square with sum_x (cells_x - 1) degrees
of freedom (Anderson & Goodman 1957), so the dependence of a step's pending token on the previous block
is allowed for. A block the law forbids (a correction where p <= q) is a hard failure.

Why this is enough. ``test_block_law_is_the_target_continuation`` checks, exactly and with no sampling,
that blocks drawn from L and concatenated step after step give the target's autoregressive law
P[x0, x1] ... P[x_{n-1}, x_n] for every n <= S + 2 (two steps' worth): a verifier whose blocks follow L is
lossless. The sampled test then checks every block, its last token too, so a wrong bonus after full
acceptance cannot hide (a run's first S tokens never hold a chain's bonus after full acceptance). Each run
has tens of thousands of blocks that end at a leaf (asserted), so the bonus law there is measured often.

Mutants, realised on the real verifier, must fail the same test (fixed seeds: the verdicts are
deterministic; the p-values are far below FAIL):
- accept every draft (uniforms u = 0),
- after a rejection draw the correction from the target p instead of the residual norm(max(0, p - q)),
- accept with probability min(1, sqrt(p / q)) instead of min(1, p / q) (uniforms u^2: u^2 < p/q),
- after a path accepted to a leaf, draw the bonus from the residual norm(max(0, p - q)) with the leaf's own
  q (for a chain: the last draft's q, what ``verify_chain`` computes if its full-acceptance branch is lost),
- after a path accepted to a leaf, draw the bonus uniformly.
The correct verifier passes through both entry points (``SpeculativeVerifier`` and the direct
``verify_chain`` / ``verify_tree`` harness the mutants use), so a failure is the mutant's doing.
"""
import pytest
import torch

import ssmspec.verify.speculative as spec_mod
from ssmspec.drafting.base import DraftTree
from ssmspec.verify import SamplingConfig, SpeculativeVerifier
from ssmspec.verify.base import Verdict
from ssmspec.verify.distributions import sample
from ssmspec.verify.speculative import residual

V = 6
ROWS, STEPS = 10_000, 10  # blocks per run = ROWS * STEPS, every one counted
PASS, FAIL = 1e-3, 1e-6  # an exact sampler's p-value stays above PASS; a mutant's falls below FAIL
START = 0  # pending token of every row at the first step
MIN_LEAF = 20_000  # blocks that end at a leaf in a run: the bonus from p there is measured often


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _markov(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target P and draft Q transition matrices (V, V), every entry > 0; Q = P with noisy logits."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(1.5 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(logp + 0.5 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    return logp.exp().float(), q.float()


P, Q = _markov(seed=0)
# the same rows in float64, renormalised (a float32 row sums to 1 only within ~1e-7), for the exact laws
P64, Q64 = (m.double() / m.double().sum(-1, keepdim=True) for m in (P, Q))

CHAIN = [0, 1, 2]  # parent of each draft node: one chain of S = 3
TREE = [0, 0, 1, 1, 1, 2, 3]  # root: 2 children; node 1: 3 children; node 2: 1; node 3: 1 (depth 3)
SHAPES = {"chain": CHAIN, "tree": TREE}
DEPTH = 3  # of both shapes: blocks are 1 .. DEPTH + 1 tokens long
# a block of n tokens b_1..b_n is cell OFF[n] + sum_i b_i V**(n-i); C cells in all
OFF = {n: sum(V ** m for m in range(1, n)) for n in range(1, DEPTH + 2)}
C = OFF[DEPTH + 1] + V ** (DEPTH + 1)


def _draft(pending: torch.Tensor, parents: list[int], gen) -> tuple[DraftTree, torch.Tensor]:
    """Drafts from Q for every row: node j ~ Q[token of its parent], siblings independent.
    Returns the DraftTree (q recorded per node) and the target probs (B, 1+T, V) at every node."""
    bsz, T = pending.shape[0], len(parents)
    toks = torch.empty(bsz, 1 + T, dtype=torch.long)  # node 0 = the pending token
    toks[:, 0] = pending
    for j, par in enumerate(parents, start=1):
        toks[:, j] = torch.multinomial(Q[toks[:, par]], 1, generator=gen)[:, 0]
    par_t = torch.tensor(parents)
    q = Q[toks[:, par_t]]  # (B, T, V): the distribution each draft was drawn from
    if parents == list(range(T)):
        drafts = DraftTree.from_chains(toks[:, None, 1:], q[:, None])
    else:
        drafts = DraftTree(toks[:, 1:], par_t.expand(bsz, T), q, 0, DEPTH)
    return drafts, P[toks]  # (B, 1+T, V)


def _ends_at_leaf(drafts: DraftTree, v: Verdict) -> torch.Tensor:
    """(B,) bool: the accepted path ends at a node with no child (no draft left to try: bonus from p)."""
    bsz = drafts.tokens.shape[0]
    has_child = torch.zeros(bsz, 1 + drafts.size, dtype=torch.bool).scatter_(1, drafts.parents, True)
    return ~has_child.gather(1, v.last_node[:, None])[:, 0]


def _verify_real(p, drafts, gen):
    """The shipped entry point: logits log p at temperature 1 are p again."""
    return SpeculativeVerifier(SamplingConfig(temperature=1.0)).verify(p.log(), drafts, gen)


def _verify_direct(u_map=lambda u: u):
    """verify_chain / verify_tree called with uniforms u_map(u): identity is exact, 0 accepts every draft,
    u**2 accepts with probability min(1, sqrt(p / q))."""
    def verify(p, drafts, gen):
        u = u_map(torch.rand(drafts.tokens.shape, generator=gen))  # (B, T)
        if drafts.is_single_chain:
            return spec_mod.verify_chain(p, drafts.tokens, drafts.q, u, gen)
        return spec_mod.verify_tree(p, drafts, drafts.q, u, gen)
    return verify


def _leaf_bonus_from(dist):
    """The exact verdict with the bonus redrawn from dist(p, q) (B, V) where the path ends at a leaf; p is the
    target at the leaf, q the distribution the leaf's own token was drawn from."""
    exact = _verify_direct()

    def verify(p, drafts, gen):
        v = exact(p, drafts, gen)
        node = v.last_node  # (B,) never the root: the root always has children here
        rows = torch.arange(node.shape[0])
        wrong = sample(dist(p[rows, node], drafts.q[rows, node - 1]), gen)
        return Verdict(v.accepted, v.path, torch.where(_ends_at_leaf(drafts, v), wrong, v.bonus))
    return verify


def _decode(shape: str, verify, *, seed: int) -> tuple[torch.Tensor, int]:
    """Run ROWS rows for STEPS steps. Returns the counts (V, C) of (pending token, emitted block) over every
    step, and how many of those blocks ended at a leaf."""
    parents = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    pending = torch.full((ROWS,), START, dtype=torch.long)
    counts = torch.zeros(V * C, dtype=torch.float64)
    leaves = 0
    j = torch.arange(DEPTH + 1)[None]  # (1, 1+DEPTH) block columns
    first_cell = torch.tensor([OFF[n] for n in range(1, DEPTH + 2)])  # (1+DEPTH,) by accepted count a
    for _ in range(STEPS):
        drafts, p = _draft(pending, parents, gen)
        v = verify(p, drafts, gen)
        a = v.accepted  # (B,) the block is a + 1 tokens long
        # the block as the engine appends it (engine/step.py): path tokens, the bonus right after them
        path = torch.cat([pending[:, None], drafts.tokens], 1).gather(1, v.path)[:, 1:]  # (B, DEPTH)
        block = torch.where(j == a[:, None], v.bonus[:, None], torch.cat([path, v.bonus[:, None]], 1))
        digit = (V ** (a[:, None] - j).clamp(min=0)) * (j <= a[:, None])  # (B, 1+DEPTH), 0 past column a
        cell = first_cell[a] + (block * digit).sum(1)  # (B,)
        counts += torch.bincount(pending * C + cell, minlength=V * C).double()
        leaves += int(_ends_at_leaf(drafts, v).sum())
        pending = v.bonus
    return counts.reshape(V, C), leaves


def _block_law(parents: list[int]) -> torch.Tensor:
    """(V, C) float64 exact law of one step's block given its pending token (module doc): walk the tree as
    verify_tree does, children in node order, the residual updated after each rejected sibling."""
    kids = {n: [c for c, par in enumerate(parents, start=1) if par == n] for n in range(len(parents) + 1)}
    law = torch.zeros(V, C, dtype=torch.float64)

    def walk(x0: int, node: int, x: int, block: int, n: int, mass: torch.Tensor) -> None:
        """At accepted `node` (token x) with the block's first n tokens (as a base-V number `block`) emitted,
        reached with probability `mass`."""
        r, q = P64[x], Q64[x]  # residual at the node, and its children's draft distribution (V,)
        for c in kids[node]:
            take = torch.minimum(r, q)  # (V,) child c drawn as y and accepted: q(y) min(1, r(y) / q(y))
            for y in range(V):
                walk(x0, c, y, block * V + y, n + 1, mass * take[y])
            rest = (r - q).clamp(min=0.0)  # rejected with probability sum(rest), then r = norm(rest)
            mass = mass * rest.sum()
            if mass == 0:
                return
            r = rest / rest.sum()
        lo = OFF[n + 1] + block * V  # the bonus / correction t ~ r closes the block: cells lo + t
        law[x0, lo:lo + V] += mass * r

    for x0 in range(V):
        walk(x0, 0, x0, 0, 0, torch.tensor(1.0, dtype=torch.float64))
    return law


LAWS = {shape: _block_law(parents) for shape, parents in SHAPES.items()}


def _chi2(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, float, int]:
    """Pearson chi-square of the block counts (V, C) against n[x] law[x] (one multinomial per pending token,
    cells expected below 5 pooled per token). Returns (p-value, statistic, degrees of freedom); a block of
    probability 0 that was emitted gives p-value 0."""
    # the law's zeros are corrections t with r(t) <= q(t); for this P, Q every |r - q| met in the walk is
    # >= 1e-3, so the verifier's float32 arithmetic puts its zeros in the same cells
    if counts[law == 0].sum() > 0:
        return 0.0, float("inf"), 0
    stat, df = torch.zeros((), dtype=torch.float64), 0
    for x in range(V):
        n = counts[x].sum()
        if n == 0:
            continue
        exp = law[x] * n
        small = exp < 5
        o = torch.cat([counts[x][~small], counts[x][small].sum()[None]])
        e = torch.cat([exp[~small], exp[small].sum()[None]])
        keep = e > 0
        stat += ((o[keep] - e[keep]) ** 2 / e[keep]).sum()
        df += int(keep.sum()) - 1
    pval = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
    return pval, float(stat), df


def _target_law(n: int) -> torch.Tensor:
    """(V, V**n) float64: the target's law of its next n tokens after token x, at x1 V**(n-1) + ... + xn."""
    law = P64  # (V, V)
    for _ in range(n - 1):
        last = torch.arange(law.shape[1]) % V  # last token of each prefix
        law = (law[:, :, None] * P64[last][None]).reshape(V, -1)
    return law


@pytest.mark.parametrize("shape", list(SHAPES))
def test_block_law_is_the_target_continuation(shape):
    """Blocks drawn from the enumerated law, concatenated step after step, are the target's continuation:
    the reference the sampled test compares against is lossless (exact, float64)."""
    law = LAWS[shape]
    assert torch.allclose(law.sum(1), torch.ones(V, dtype=torch.float64), atol=1e-12)
    runs = {}  # n -> (V, V**n): law of the first n emitted tokens from each pending token
    for n in range(1, DEPTH + 3):
        total = torch.zeros(V, V ** n, dtype=torch.float64)
        for m in range(1, DEPTH + 2):  # blocks of m tokens
            lm = law[:, OFF[m]:OFF[m] + V ** m]  # (V, V**m)
            if m >= n:  # the run's first n tokens lie in this block
                total += lm.reshape(V, V ** n, V ** (m - n)).sum(-1)
            else:  # the next step continues from the block's last token
                last = torch.arange(V ** m) % V
                total += (lm[:, :, None] * runs[n - m][last][None]).reshape(V, V ** n)
        runs[n] = total
        torch.testing.assert_close(total, _target_law(n), rtol=0, atol=1e-12, msg=f"first {n} tokens")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("entry", ["verifier", "direct"])
def test_every_block_follows_exact_law(shape, entry):
    verify = _verify_real if entry == "verifier" else _verify_direct()
    counts, leaves = _decode(shape, verify, seed=1)
    assert leaves >= MIN_LEAF, f"only {leaves} blocks ended at a leaf: bonuses after full acceptance are rare"
    pval, stat, df = _chi2(counts, LAWS[shape])
    assert pval > PASS, f"blocks: p-value {pval:.2e} (chi2 {stat:.0f}, df {df})"


MUTANTS = {  # name -> (verify, patch of spec_mod.residual or None)
    "accept-all": (_verify_direct(lambda u: torch.zeros_like(u)), None),
    "sqrt-rule": (_verify_direct(lambda u: u * u), None),
    "resample-p": (_verify_direct(), lambda r, q: r),  # after a rejection, the correction from the target
    "leaf-bonus-residual": (_leaf_bonus_from(residual), None),
    "leaf-bonus-uniform": (_leaf_bonus_from(lambda p, q: torch.full_like(p, 1.0 / V)), None),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_mutant_is_caught(monkeypatch, shape, mutant):
    verify, patch = MUTANTS[mutant]
    if patch is not None:
        monkeypatch.setattr(spec_mod, "residual", patch)
    counts, _ = _decode(shape, verify, seed=1)
    pval, stat, df = _chi2(counts, LAWS[shape])
    assert pval < FAIL, f"mutant {mutant} passed: p-value {pval:.2e} (chi2 {stat:.0f}, df {df})"
