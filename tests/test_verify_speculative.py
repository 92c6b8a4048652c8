"""Speculative sampling (chains) and multi-step speculative sampling (trees) emit the target distribution.

Tiny vocabulary, fixed per-node target distributions p and draft distributions q, one verifier call on
a batch of many independent rows (each with its own drafts drawn from q). Chi-square tests (fixed seeds)
check the emitted token at several positions: the first token, the token after an accepted draft, and
the bonus after a full acceptance. Negative controls swap in wrong residuals and must be caught.
"""
import pytest
import torch

import ssmspec.verify.speculative as spec_mod
from ssmspec.drafting.base import DraftTree
from ssmspec.verify import GreedyVerifier, SamplingConfig, SpeculativeVerifier, make_verifier, verifier_names
from ssmspec.verify.distributions import target_probs

V = 5
ROWS = 40_000
SAMPLING = SamplingConfig(temperature=1.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dists(n: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(scale * torch.randn(n, V, generator=g), dim=-1)  # (n, V), every entry > 0


def _chi2_pvalue(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of int samples to ``expected`` (V,) probabilities."""
    obs = torch.bincount(tokens, minlength=V).double()
    exp = expected.double() * tokens.numel()
    zero = exp == 0
    assert obs[zero].sum() == 0, "a token of zero target probability was emitted"
    stat = ((obs[~zero] - exp[~zero]) ** 2 / exp[~zero]).sum()
    df = int((~zero).sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _sample_children(q: torch.Tensor, rows: int, gen) -> torch.Tensor:
    """(rows,) independent draws from q (V,) (inverse CDF)."""
    cdf = q.double().cumsum(0)
    return torch.searchsorted(cdf, torch.rand(rows, generator=gen, dtype=torch.float64) * cdf[-1]).clamp(max=V - 1)


def _emitted(drafts: DraftTree, verdict) -> torch.Tensor:
    """(B, 1+Smax) emitted tokens per row (accepted drafts then the bonus), -1 past the end."""
    toks = torch.cat([torch.zeros_like(drafts.tokens[:, :1]), drafts.tokens], 1).gather(1, verdict.path)[:, 1:]
    S = toks.shape[1]
    k = torch.arange(S + 1)[None]
    a = verdict.accepted[:, None]
    out = torch.full((toks.shape[0], S + 1), -1, dtype=torch.long)
    out[:, :S] = torch.where(k[:, :S] < a, toks, out[:, :S])
    return torch.where(k == a, verdict.bonus[:, None], out)


# chains -------------------------------------------------------------------------------------------
S = 3
P_CHAIN = _dists(S + 1, seed=1)  # target at nodes 0..S
Q_CHAIN = _dists(S, seed=2)  # draft distribution of draft i (at node i-1)


def _chain_step(*, sampled: bool, as_tree: bool, seed: int, sampling=SAMPLING, p=P_CHAIN):
    gen = torch.Generator().manual_seed(seed)
    if sampled:
        tokens = torch.stack([_sample_children(Q_CHAIN[i], ROWS, gen) for i in range(S)], 1)  # (B, S)
        q = Q_CHAIN[None].expand(ROWS, S, V)
    else:  # deterministic drafts: the target's likeliest token per position (q None = one-hot)
        tokens, q = p[:S].argmax(-1)[None].expand(ROWS, S), None
    drafts = DraftTree.from_chains(tokens[:, None], None if q is None else q[:, None])
    if as_tree:  # the same chain through the tree walk
        drafts = DraftTree(drafts.tokens, drafts.parents, drafts.q, 0, S)
    logits = p.log()[None].expand(ROWS, S + 1, V)
    verdict = SpeculativeVerifier(sampling).verify(logits, drafts, gen)
    return drafts, verdict


@pytest.mark.parametrize("as_tree", [False, True], ids=["chain-path", "tree-path"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "onehot-q"])
def test_chain_emits_target_distribution(sampled, as_tree):
    drafts, verdict = _chain_step(sampled=sampled, as_tree=as_tree, seed=10)
    out, a = _emitted(drafts, verdict), verdict.accepted
    assert _chi2_pvalue(out[:, 0], P_CHAIN[0]) > 1e-3  # first token
    after1 = a >= 1
    assert after1.sum() > 4000
    assert _chi2_pvalue(out[after1, 1], P_CHAIN[1]) > 1e-3  # the token after an accepted draft
    after2 = a >= 2
    assert _chi2_pvalue(out[after2, 2], P_CHAIN[2]) > 1e-3
    full = a == S
    assert full.sum() > 500
    assert _chi2_pvalue(verdict.bonus[full], P_CHAIN[S]) > 1e-3  # bonus after full acceptance
    assert verdict.path.shape == (ROWS, S + 1)
    assert torch.equal(verdict.path, torch.where(torch.arange(S + 1)[None] <= a[:, None], torch.arange(S + 1), 0))


def test_chain_acceptance_probability_is_min_p_over_q():
    """Exact value: the first draft is accepted with probability sum_x min(p(x), q(x))."""
    _drafts, verdict = _chain_step(sampled=True, as_tree=False, seed=11)
    expect = torch.minimum(P_CHAIN[0], Q_CHAIN[0]).sum().item()
    rate = (verdict.accepted >= 1).double().mean().item()
    assert abs(rate - expect) < 4 * (expect * (1 - expect) / ROWS) ** 0.5


def test_chain_with_filtered_target():
    """top-k / temperature shape p (zeros included); emitted tokens follow target_probs, never a zero."""
    cfg = SamplingConfig(temperature=0.7, top_k=3)
    logits = _dists(S + 1, seed=5).log() * 2
    drafts, verdict = _chain_step(sampled=True, as_tree=False, seed=12, sampling=cfg, p=logits.exp())
    p = target_probs(logits, cfg)
    out = _emitted(drafts, verdict)
    assert _chi2_pvalue(out[:, 0], p[0]) > 1e-3
    assert _chi2_pvalue(out[verdict.accepted >= 1, 1], p[1]) > 1e-3


def _wrong_no_residual(r, q):  # resample from the target after a rejection (biased towards drafts)
    return r


def _wrong_swapped(r, q):  # norm(max(0, q - p)): the draft's excess instead of the target's
    res = (q - r).clamp(min=0)
    return res / res.sum(-1, keepdim=True).clamp(min=1e-30)


@pytest.mark.parametrize("wrong", [_wrong_no_residual, _wrong_swapped], ids=["resample-p", "swapped"])
def test_chain_negative_control_wrong_residual_is_caught(monkeypatch, wrong):
    monkeypatch.setattr(spec_mod, "residual", wrong)
    drafts, verdict = _chain_step(sampled=True, as_tree=False, seed=10)
    assert _chi2_pvalue(_emitted(drafts, verdict)[:, 0], P_CHAIN[0]) < 1e-8


# trees --------------------------------------------------------------------------------------------
PARENTS = [0, 0, 0, 1, 1, 4]  # root: 3 children; node 1: 2 children; node 4: 1 child (depth 3)
P_TREE = _dists(len(PARENTS) + 1, seed=3, scale=1.0)  # target at nodes 0..6
Q_NODE = _dists(len(PARENTS) + 1, seed=4, scale=1.0)  # draft distribution *at* each node (for its children)


def _tree_step(*, sampled: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    T = len(PARENTS)
    if sampled:  # siblings: independent draws from their parent's q
        tokens = torch.stack([_sample_children(Q_NODE[PARENTS[j]], ROWS, gen) for j in range(T)], 1)
        q = Q_NODE[torch.tensor(PARENTS)][None].expand(ROWS, T, V)
    else:  # deterministic: distinct tokens, the parent's likeliest first (a top-k tree)
        ranks = [sum(1 for i in range(j) if PARENTS[i] == PARENTS[j]) for j in range(T)]
        tokens = torch.tensor([[int(P_TREE[PARENTS[j]].argsort(descending=True)[ranks[j]]) for j in range(T)]])
        tokens, q = tokens.expand(ROWS, T), None
    drafts = DraftTree(tokens, torch.tensor(PARENTS).expand(ROWS, T), q, 0, 3)
    logits = P_TREE.log()[None].expand(ROWS, T + 1, V)
    return drafts, SpeculativeVerifier(SAMPLING).verify(logits, drafts, gen)


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "onehot-q"])
def test_tree_emits_target_distribution(sampled):
    drafts, verdict = _tree_step(sampled=sampled, seed=20)
    out, path, a = _emitted(drafts, verdict), verdict.path, verdict.accepted
    assert _chi2_pvalue(out[:, 0], P_TREE[0]) > 1e-3  # first token
    via1 = (a >= 1) & (path[:, 1] == 1)  # accepted node 1 (which has children): next ~ p(node 1)
    assert via1.sum() > 2000
    assert _chi2_pvalue(out[via1, 1], P_TREE[1]) > 1e-3
    at2 = (a == 1) & (path[:, 1] == 2)  # accepted leaf node 2: bonus ~ p(node 2)
    assert at2.sum() > 500
    assert _chi2_pvalue(verdict.bonus[at2], P_TREE[2]) > 1e-3
    via4 = (a >= 2) & (path[:, 2] == 4)  # node 4 (one child): next ~ p(node 4)
    assert _chi2_pvalue(out[via4, 2], P_TREE[4]) > 1e-3
    full = a == 3  # deepest leaf: bonus ~ p(node 6)
    assert full.sum() > 200
    assert (path[full] == torch.tensor([0, 1, 4, 6])).all()
    assert _chi2_pvalue(verdict.bonus[full], P_TREE[6]) > 1e-3
    # the path is a real root-first path of the tree
    par = drafts.parents_with_root()
    for k in range(1, 4):
        ok = a >= k
        assert torch.equal(par[ok].gather(1, path[ok, k:k + 1])[:, 0], path[ok, k - 1])


@pytest.mark.parametrize("wrong", [_wrong_no_residual, _wrong_swapped], ids=["resample-p", "swapped"])
def test_tree_negative_control_wrong_residual_is_caught(monkeypatch, wrong):
    monkeypatch.setattr(spec_mod, "residual", wrong)
    drafts, verdict = _tree_step(sampled=True, seed=20)
    assert _chi2_pvalue(_emitted(drafts, verdict)[:, 0], P_TREE[0]) < 1e-8


# greedy limit, registry, bad input ----------------------------------------------------------------
def test_temperature_zero_equals_greedy_verifier():
    g = torch.Generator().manual_seed(0)
    B, T, Vb = 64, 7, 6
    parents = torch.tensor([0, 0, 1, 1, 2, 0, 3]).expand(B, T)
    logits = torch.randn(B, T + 1, Vb, generator=g)
    tokens = torch.randint(0, Vb, (B, T), generator=g)
    tokens[:32, 0] = logits[:32, 0].argmax(-1)  # some accepted paths
    tokens[:16, 2] = logits[:16, 1].argmax(-1)
    drafts = DraftTree(tokens, parents)
    a = GreedyVerifier().verify(logits, drafts)
    b = make_verifier("speculative", sampling=SamplingConfig()).verify(logits, drafts, g)
    assert a.accepted.max() >= 2
    for x, y in [(a.accepted, b.accepted), (a.path, b.path), (a.bonus, b.bonus)]:
        assert torch.equal(x, y)


def test_no_drafts_samples_the_target():
    gen = torch.Generator().manual_seed(1)
    logits = P_TREE[:1].log()[None].expand(ROWS, 1, V)
    v = SpeculativeVerifier(SAMPLING).verify(logits, None, gen)
    assert (v.accepted == 0).all() and v.path.shape == (ROWS, 1)
    assert _chi2_pvalue(v.bonus, P_TREE[0]) > 1e-3


def test_registry_and_bad_input():
    assert {"greedy", "speculative"} <= set(verifier_names())
    with pytest.raises(ValueError, match="unknown verifier 'nope'"):
        make_verifier("nope")
    with pytest.raises(ValueError, match="vocabularies must agree"):
        tokens = torch.zeros(2, 1, 3, dtype=torch.long)
        SpeculativeVerifier(SAMPLING).verify(torch.zeros(2, 4, V), DraftTree.from_chains(tokens, torch.ones(2, 1, 3, V + 2)))
    # a draft q with fewer tokens than the target is zero-padded
    tokens = torch.zeros(2, 1, 3, dtype=torch.long)
    v = SpeculativeVerifier(SAMPLING).verify(torch.zeros(2, 4, V), DraftTree.from_chains(tokens, torch.ones(2, 1, 3, V - 1) / (V - 1)))
    assert v.path.shape == (2, 4)
