"""The oracle's law, checked three ways: ``expected_accepted`` (the recursion) equals an enumeration of the kept
patterns for every shape the end-to-end experiments draft, and a Monte Carlo of the oracle itself; the Weyl
draws (``drafting/weyl.py``) map uniform points onto that law exactly, converge to it like 1/n (the accepted
lengths with n x error below 3; every node's kept share like log(n) / n, where independent draws' n x error grows
like sqrt(n)),
are consumed one per running step and go on across the groups an engine decodes; ``steps_needed`` holds for
every seed at the count it gives, and ``iid_steps`` is the variance's count."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from ssmspec.bench.e2e_snl import GroupOracle
from ssmspec.drafting import weyl
from ssmspec.drafting.oracle import Oracle, chain_parents, expected_accepted, sibling_ranks
from ssmspec.drafting.static_tree import check_parents, resolve_shape
from ssmspec.verify.greedy import GreedyVerifier

# every oracle shape of stree_tab3_e2e, stree_tab4_tree_shapes, tree_replay, snl_tab5_e2e and snl_fig4_multiseq,
# at the law its config states: (id, shape, alpha, rank_decay)
USED = [("chain4-T0", 4, 0.55, 1.0), ("chain4-T1", 4, 0.37, 1.0), ("A-T0", "A", 0.55, 0.35), ("A-T1", "A", 0.37, 0.7),
        ("B", "B", 0.37, 0.7), ("C", "C", 0.37, 0.7), ("D", "D", 0.37, 0.7), ("E-T1", "E", 0.37, 0.7),
        ("E-T0", "E", 0.55, 0.35), ("chain12", 12, 0.55, 1.0), ("chain15", 15, 0.55, 1.0),
        ("1x6", (6, 1), 0.51, 1.0), ("2x6", (6, 2), 0.51, 1.0), ("3x6", (6, 3), 0.51, 1.0), ("4x6", (6, 4), 0.51, 1.0)]


def _law(shape, alpha: float, decay: float) -> tuple[list[int], list[float], dict]:
    """(parents, keep per node, expected_accepted's keyword arguments) of a USED entry."""
    if isinstance(shape, str):
        parents = resolve_shape(shape)
        return parents, [alpha * decay ** r for r in sibling_ranks(parents)], dict(tree=shape, rank_decay=decay)
    S, D = (shape, 1) if isinstance(shape, int) else shape
    return chain_parents(S, D), [alpha] * S * D, dict(draft_len=S, num_drafts=D)


def _enumerated_mean(parents: list[int], keep: list[float]) -> float:
    """E[depth of the deepest fully kept path] by enumerating every kept pattern of the nodes that have children;
    leaf children are kept independently, so given that pattern P(a >= k) = 1 for k up to the deepest reached
    inner node and 1 - prod over reached nodes v at depth >= k - 1 of P(no leaf child of v kept) above it."""
    depth = check_parents(parents)
    T = len(parents)
    kids = [[c for c in range(1, T + 1) if parents[c - 1] == v] for v in range(T + 1)]
    inner = [v for v in range(1, T + 1) if kids[v]]
    bits = np.array(list(itertools.product((False, True), repeat=len(inner))), dtype=bool).reshape(-1, len(inner))
    prob = np.ones(len(bits))
    reached = {0: np.ones(len(bits), dtype=bool)}
    for i, v in enumerate(inner):  # node order: a parent comes first
        prob *= np.where(bits[:, i], keep[v - 1], 1 - keep[v - 1])
        reached[v] = bits[:, i] & reached.get(parents[v - 1], np.zeros(len(bits), dtype=bool))
    deepest = np.max([np.where(r, depth[v], 0) for v, r in reached.items()], axis=0)
    miss = {v: math.prod(1 - keep[c - 1] for c in kids[v] if not kids[c]) for v in reached}
    mean = deepest.astype(float)
    for k in range(1, max(depth) + 1):
        none = np.prod([np.where(r & (depth[v] >= k - 1), miss[v], 1.0) for v, r in reached.items()], axis=0)
        mean += np.where(deepest >= k, 0.0, 1.0 - none)
    return float((prob * mean).sum())


@pytest.mark.parametrize(("shape", "alpha", "decay"), [u[1:] for u in USED], ids=[u[0] for u in USED])
def test_expected_accepted_is_exact_for_every_shape_used(shape, alpha, decay):
    parents, keep, kw = _law(shape, alpha, decay)
    exact = expected_accepted(alpha, **kw)
    assert exact == pytest.approx(_enumerated_mean(parents, keep), rel=1e-12)
    law = weyl.accepted_law(parents, keep)
    assert law.sum() == pytest.approx(1.0) and (law >= 0).all()
    assert (np.arange(len(law)) * law).sum() == pytest.approx(exact)


REF = [[int(x) for x in torch.randint(0, 50, (2000,), generator=torch.Generator().manual_seed(b))] for b in range(4)]
PROMPTS = [[1, 2], [3], [4, 5, 6], [7]]


def _accepted(oracle: Oracle, steps: int, *, budget: int | None = None) -> torch.Tensor:
    """(steps, B) accepted counts of forced greedy verification, one token emitted per step."""
    oracle.reset(PROMPTS, batch=4, device="cpu", max_new_tokens=budget)
    out = []
    for i in range(steps):
        drafts = oracle.propose([p + r[:1 + i] for p, r in zip(PROMPTS, REF)], None)
        out.append(GreedyVerifier().verify(torch.zeros(4, 1 + drafts.size, 50), drafts).accepted)
    return torch.stack(out)


@pytest.mark.parametrize(("shape", "alpha", "decay"), [u[1:] for u in USED], ids=[u[0] for u in USED])
def test_expected_accepted_matches_a_monte_carlo_of_the_oracle(shape, alpha, decay):
    _, _, kw = _law(shape, alpha, decay)
    acc = _accepted(Oracle(p=alpha, reference=REF, vocab_size=50, seed=7, forced=True, **kw), 250).double()
    assert abs(acc.mean() - expected_accepted(alpha, **kw)) < 4 * acc.std() / acc.numel() ** 0.5


def _reached(kept: np.ndarray, parents: list[int]) -> np.ndarray:
    """(N, 1+T) nodes on fully kept paths (the root always)."""
    ok = np.zeros((kept.shape[0], len(parents) + 1), dtype=bool)
    ok[:, 0] = True
    for i, p in enumerate(parents, start=1):
        ok[:, i] = ok[:, p] & kept[:, i - 1]
    return ok


@pytest.mark.parametrize("parents", [[0, 0, 1, 1, 2], chain_parents(2, 2)], ids=["tree5", "2x2"])
def test_weyl_map_sends_uniform_points_to_the_product_law(parents):
    """u decides the nodes whose parent is reached, v the others: integrating over a grid of u (v's nodes in closed
    form) gives every kept pattern its product-law probability, to the grid's resolution."""
    keep = [0.6, 0.35, 0.5, 0.25, 0.7][:len(parents)]
    T, G = len(parents), 1 << 14
    u = (np.arange(G) + 0.5) / G
    on = weyl.sample(parents, keep, u, np.full((G, T), 0.999999))  # v never keeps: u's part alone
    free = ~_reached(on, parents)[:, [p for p in parents]]  # (G, T) node's parent not reached: v decides it
    q = np.array(keep)
    for bits in itertools.product((False, True), repeat=T):
        pat = np.array(bits)
        match = ((on == pat) | free).all(1)
        off = np.where(free, np.where(pat, q, 1 - q), 1.0).prod(1)
        assert (match * off).mean() == pytest.approx(np.where(pat, q, 1 - q).prod(), abs=40 / G)


def _depth(kept: np.ndarray, parents: list[int]) -> np.ndarray:
    return (_reached(kept, parents) * np.array(check_parents(parents))).max(1)


@pytest.mark.parametrize(("shape", "alpha", "decay"), [("A", 0.55, 0.35), ((6, 2), 0.51, 1.0), ("B", 0.37, 0.7)],
                         ids=["A", "2x6", "B"])
@pytest.mark.parametrize("seed", [0, 1])
def test_weyl_draws_converge_like_one_over_n(shape, alpha, decay, seed):
    """n x (error of every accepted length's share) stays below 3 from 250 to 16000 steps, and n x (error of every
    node's kept share) below 6 ln n (a node's kept set is many intervals of u, and a v coordinate: log(n) / n);
    independent draws' errors are sd / sqrt(n), so their n x error grows like sqrt(n) (~60-150 at 16000)."""
    parents, keep, _ = _law(shape, alpha, decay)
    law = weyl.accepted_law(parents, keep)
    kept = weyl.WeylDraws(parents, keep, batch=1, seed=seed).fill([0], 16000)[0]
    depth = _depth(kept, parents)
    for n in (250, 1000, 4000, 16000):
        freq = np.bincount(depth[:n], minlength=len(law)) / n
        assert n * np.abs(freq - law).max() < 3
        assert n * np.abs(kept[:n].mean(0) - np.array(keep)).max() < 6 * math.log(n)
    # the count of every accepted length is one interval of one 1-D Weyl sequence: the same bound at any start
    assert 4000 * np.abs(np.bincount(depth[4000:8000], minlength=len(law)) / 4000 - law).max() < 3


def test_weyl_oracle_consumes_a_draw_per_running_step_and_goes_on_across_groups():
    parents, keep = resolve_shape("A"), [0.55 * 0.35 ** r for r in sibling_ranks(resolve_shape("A"))]
    table = weyl.WeylDraws(parents, keep, batch=4, seed=3).fill([0] * 4, 40)  # (B, 40, T)
    o = GroupOracle(p=0.55, tree="A", rank_decay=0.35, reference=REF, vocab_size=50, seed=3, forced=True, draws="weyl")
    o.reset(PROMPTS, batch=4, device="cpu", max_new_tokens=30)
    # sequence 1 emitted its budget after 5 steps: it stops consuming draws, the others go on
    kept = []
    for i in range(12):
        emitted = [1 + i, 1 + i if i < 5 else 30, 1 + i, 1 + i]
        kept.append(o.propose([p + r[:e] for p, r, e in zip(PROMPTS, REF, emitted)], None).match)
    kept = torch.stack(kept, 1).numpy()  # (B, steps, T)
    assert (kept[0] == table[0, :12]).all() and (kept[1, :5] == table[1, :5]).all()
    assert o.draw_idx.tolist() == [12, 5, 12, 12]
    # the next group re-arms in place: every sequence goes on at its next unused draw
    first = o.table
    o.reset(PROMPTS, batch=4, device="cpu", max_new_tokens=30)
    assert o.table is first and o.weyl_start == [12, 5, 12, 12]
    nxt = o.propose([p + r[:1] for p, r in zip(PROMPTS, REF)], None).match.numpy()
    assert all((nxt[b] == table[b, s]).all() for b, s in enumerate([12, 5, 12, 12]))


def test_weyl_oracle_reaches_the_designed_mean_within_the_band():
    o = Oracle(p=0.37, draft_len=4, reference=REF, vocab_size=50, seed=0, forced=True, draws="weyl")
    n = weyl.steps_needed(chain_parents(4), [0.37] * 4, batch=4)
    acc = _accepted(o, n, budget=4000).double()
    assert abs(acc.mean() / expected_accepted(0.37, draft_len=4) - 1) <= 0.02


@pytest.mark.parametrize(("shape", "alpha", "decay", "batch"), [("A", 0.37, 0.7, 1), ((6, 2), 0.51, 1.0, 1),
                                                                  (12, 0.55, 1.0, 4)], ids=["A", "2x6", "chain12-B4"])
def test_steps_needed_holds_for_every_seed_and_beats_independent_draws(shape, alpha, decay, batch):
    """The count is fixed from the law and the rates before anything runs; at that count the batch's mean accepted
    length of the oracle's own draws is within 2% for each of 40 seeds, and independent draws would need more than
    25x the sequence-steps (the law's variance: (z sd / (0.02 E))^2, z = 3.29)."""
    parents, keep, kw = _law(shape, alpha, decay)
    n = weyl.steps_needed(parents, keep, batch=batch)
    assert n % weyl.STEP_GRID == 0
    E = expected_accepted(alpha, **kw)
    for seed in range(40):
        kept = weyl.WeylDraws(parents, keep, batch=batch, seed=seed).fill([0] * batch, n).reshape(batch * n, -1)
        assert abs(_depth(kept, parents).mean() / E - 1) <= 0.02
    law = weyl.accepted_law(parents, keep)
    k = np.arange(len(law))
    sd = math.sqrt((k * k * law).sum() - E ** 2)
    assert weyl.iid_steps(parents, keep) == math.ceil((3.29 * sd / (0.02 * E)) ** 2) > 25 * n * batch


def test_max_accepted_bounds_every_seed():
    parents, keep = chain_parents(15), [0.55] * 15
    bound = weyl.max_accepted(parents, keep, batch=2, steps=300)
    for seed in range(20):
        kept = weyl.WeylDraws(parents, keep, batch=2, seed=seed).fill([0, 0], 300)
        assert max(_depth(kept[b], parents).sum() for b in range(2)) <= bound


def test_rates_are_fixed_and_distinct():
    assert weyl.u_rates(1) == [(math.sqrt(5) - 1) / 2]
    u, v = weyl.u_rates(64), weyl.v_rates(500)
    assert len(set(u) | set(v)) == 564 and all(0 < x < 1 for x in u + v)
    assert weyl.u_rates(3) == u[:3]  # a prefix: sequence b's rate does not depend on the batch


def test_bad_draws_are_refused():
    with pytest.raises(ValueError, match="draws must be one of random, weyl"):
        Oracle(p=0.5, draft_len=3, draws="sobol")
