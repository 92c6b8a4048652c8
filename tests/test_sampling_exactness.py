"""Sampled speculation emits the target's distribution when drafts are accepted often, and the test can fail.

A tiny Markov "language model" (V = 6): the target's next-token distribution is P[x] (V, V) after token x,
the drafter's is Q[x], a perturbation of P that is accepted often (about 0.8 a draft). Every row of one
batch decodes from the same pending token with its own drafts drawn from Q (chains of S = 3, and a token
tree whose siblings are independent draws from Q at their parent: multi-step speculative sampling). A
few verifier steps per row give its first N emitted tokens, whose exact joint law is
P[x0, x1] P[x1, x2] ... P[x_{N-1}, x_N]; a Pearson chi-square test compares them for N = 1, 2, 3 (fixed
seeds, so the verdict is deterministic).

Mutants of the acceptance rule, realised on the real verifier, must fail the same test:
- accept every draft (uniforms u = 0),
- after a rejection draw the bonus from the target p instead of the residual norm(max(0, p - q)),
- accept with probability min(1, sqrt(p / q)) instead of min(1, p / q) (uniforms u^2: u^2 < p/q).
An unmutated run through the same direct-call harness passes, so a failure is the mutant's doing.
"""
import pytest
import torch

import ssmspec.verify.speculative as spec_mod
from ssmspec.drafting.base import DraftTree
from ssmspec.verify import SamplingConfig, SpeculativeVerifier

V = 6
ROWS = 20_000
N = 3  # emitted tokens compared (joint law over V**N outcomes)
PASS, FAIL = 1e-3, 1e-6  # an exact sampler's p-value stays above PASS; a mutant's falls below FAIL
START = 0  # pending token of every row


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _markov(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target P and draft Q transition matrices (V, V), every entry > 0; Q = P with noisy logits."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(1.5 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(logp + 0.5 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    return logp.exp().float(), q.float()


P, Q = _markov(seed=0)

CHAIN = [0, 1, 2]  # parent of each draft node: one chain of S = 3
TREE = [0, 0, 1, 1, 1, 2, 3]  # root: 2 children; node 1: 3 children; node 2: 1; node 3: 1 (depth 3)
SHAPES = {"chain": (CHAIN, 3), "tree": (TREE, 3)}


def _draft(pending: torch.Tensor, parents: list[int], depth: int, gen) -> tuple[DraftTree, torch.Tensor]:
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
        drafts = DraftTree(toks[:, 1:], par_t.expand(bsz, T), q, 0, depth)
    return drafts, P[toks]  # (B, 1+T, V)


def _verify_real(p, drafts, gen):
    """The shipped entry point: logits log p at temperature 1 are p again."""
    return SpeculativeVerifier(SamplingConfig(temperature=1.0)).verify(p.log(), drafts, gen)


def _verify_direct(u_map):
    """verify_chain / verify_tree called with uniforms u_map(u): identity is exact, 0 accepts every draft,
    u**2 accepts with probability min(1, sqrt(p / q))."""
    def verify(p, drafts, gen):
        u = u_map(torch.rand(drafts.tokens.shape, generator=gen))  # (B, T)
        if drafts.is_single_chain:
            return spec_mod.verify_chain(p, drafts.tokens, drafts.q, u, gen)
        return spec_mod.verify_tree(p, drafts, drafts.q, u, gen)
    return verify


def _decode(shape: str, verify, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First N emitted tokens (ROWS, N) of every row, and the accepted counts (ROWS,) of its first step."""
    parents, depth = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((ROWS, N), -1, dtype=torch.long)
    count = torch.zeros(ROWS, dtype=torch.long)
    pending = torch.full((ROWS,), START, dtype=torch.long)
    first = None
    for _ in range(N):  # every step emits at least one token
        drafts, p = _draft(pending, parents, depth, gen)
        v = verify(p, drafts, gen)
        first = v.accepted if first is None else first
        toks = torch.cat([pending[:, None], drafts.tokens], 1).gather(1, v.path)  # (B, 1+depth) path tokens
        emitted = torch.cat([toks[:, 1:], v.bonus[:, None]], 1)  # (B, 1+depth): drafts, then the bonus
        emitted.scatter_(1, v.accepted[:, None], v.bonus[:, None])
        for k in range(depth + 1):
            pos = count + k
            ok = (k <= v.accepted) & (pos < N)
            out[ok, pos[ok]] = emitted[ok, k]
        count += v.accepted + 1
        pending = v.bonus
    assert (out >= 0).all()
    return out, first


def _joint(n: int) -> torch.Tensor:
    """(V**n,) exact law of the first n tokens after START, index x1 * V**(n-1) + ... + xn."""
    law = P[START].double()  # (V,)
    for _ in range(n - 1):
        last = torch.arange(law.numel()) % V  # last token of each prefix
        law = (law[:, None] * P.double()[last]).reshape(-1)  # (V**k * V,)
    return law


def _chi2(seqs: torch.Tensor, n: int) -> tuple[float, float]:
    """Pearson chi-square p-value of the first n tokens against their exact joint (cells with expected
    count < 5 pooled), and the total-variation distance."""
    idx = (seqs[:, :n] * V ** torch.arange(n - 1, -1, -1)).sum(1)
    law = _joint(n)
    obs = torch.bincount(idx, minlength=V ** n).double()
    exp = law * seqs.shape[0]
    small = exp < 5
    o = torch.cat([obs[~small], obs[small].sum()[None]])
    e = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = e > 0
    stat = ((o[keep] - e[keep]) ** 2 / e[keep]).sum()
    df = int(keep.sum()) - 1
    pval = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
    tv = 0.5 * float((obs / seqs.shape[0] - law).abs().sum())
    return pval, tv


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("entry", ["verifier", "direct"])
def test_often_accepted_drafts_emit_target_law(shape, entry):
    verify = _verify_real if entry == "verifier" else _verify_direct(lambda u: u)
    seqs, accepted = _decode(shape, verify, seed=1)
    depth = SHAPES[shape][1]
    assert accepted.double().mean() > 0.5 * depth  # drafts are accepted often: the test exercises acceptance
    assert (accepted == depth).double().mean() > 0.2  # and full acceptance (bonus from p at the leaf)
    for n in range(1, N + 1):
        pval, tv = _chi2(seqs, n)
        assert pval > PASS, f"first {n} tokens: p-value {pval:.2e}, TV {tv:.4f}"


def _resample_target(r, q):  # after a rejection, the bonus from the target instead of the residual
    return r


MUTANTS = {
    "accept-all": (lambda u: torch.zeros_like(u), None),
    "sqrt-rule": (lambda u: u * u, None),
    "resample-p": (lambda u: u, _resample_target),
}


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_mutant_is_caught(monkeypatch, shape, mutant):
    u_map, residual = MUTANTS[mutant]
    if residual is not None:
        monkeypatch.setattr(spec_mod, "residual", residual)
    seqs, _ = _decode(shape, _verify_direct(u_map), seed=1)
    pvals = [_chi2(seqs, n)[0] for n in range(1, N + 1)]
    assert min(pvals) < FAIL, f"mutant {mutant} passed: p-values {pvals}"
