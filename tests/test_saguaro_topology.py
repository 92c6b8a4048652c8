"""Saguaro's topology and backoff policies (drafting/saguaro_topology.py): the optimum is exact (brute force), beats
uniform and geometric, the closed form is a truncated geometric series, the backoff flips once at its threshold."""
from __future__ import annotations

import itertools
import random

import pytest

from ssmspec.drafting import saguaro_topology as T


def _random_instance(rng: random.Random, S: int, width: int, concave: bool):
    depth = [rng.random() for _ in range(S + 1)]
    depth = [a / sum(depth) for a in depth]
    ranks = []
    for _ in range(S + 1):
        row = [rng.random() for _ in range(width)]
        if concave:
            row.sort(reverse=True)
        scale = rng.random() / sum(row)
        ranks.append([p * scale for p in row])
    return depth, ranks


def _brute(budget, depth, ranks):
    S1, width = len(depth), len(ranks[0])
    best = -1.0
    for fan in itertools.product(range(width + 1), repeat=S1):
        if sum(fan) <= budget:
            best = max(best, T.hit_rate(fan, depth, ranks))
    return best


@pytest.mark.parametrize("concave", [True, False], ids=["concave", "nonconcave"])
@pytest.mark.parametrize("seed", range(6))
def test_optimum_matches_brute_force(seed, concave):
    rng = random.Random(seed)
    S, width = rng.choice([1, 2, 3]), 4
    depth, ranks = _random_instance(rng, S, width, concave)
    for budget in (1, 3, 6):
        fan = T.optimal_fanout(budget, depth, ranks)
        assert sum(fan) <= budget
        assert T.hit_rate(fan, depth, ranks) == pytest.approx(_brute(budget, depth, ranks), abs=1e-12)


def test_greedy_is_not_exact_without_concavity():
    """The check that picks dynamic programming can fail: greedy alone misses a gain hidden behind a small one."""
    depth, ranks = [0.5, 0.5], [[0.1, 0.9], [0.3, 0.0]]
    assert not T.is_concave(ranks)
    assert T.optimal_fanout(2, depth, ranks) == (2, 0)  # greedy's first pick would be depth 1 (0.15 > 0.05)


@pytest.mark.parametrize("seed", range(20))
def test_optimum_beats_uniform_and_geometric(seed):
    rng = random.Random(100 + seed)
    S = rng.randint(1, 6)
    alpha, r = rng.uniform(0.05, 0.95), rng.uniform(0.2, 2.0)
    depth = T.depth_law_from_rate(alpha, S) if seed % 2 else _random_instance(rng, S, 1, True)[0]
    ranks = [T.power_rank_law(r, 40) for _ in range(S + 1)] if seed % 3 else _random_instance(rng, S, 40, False)[1]
    budget = rng.randint(1, 40)
    opt = T.hit_rate(T.optimal_fanout(budget, depth, ranks), depth, ranks)
    for fan in (T.uniform_fanout(budget, S), T.geometric_fanout(budget, S, alpha=alpha, r=r)):
        assert sum(fan) == budget and len(fan) == S + 1
        assert opt >= T.hit_rate(fan, depth, ranks) - 1e-12


def test_geometric_is_the_optimum_of_its_own_model():
    """Under a_k = alpha^k (1 - alpha) and miss (1 + F)^-r, the closed form lands within rounding of the optimum."""
    S, alpha, r = 5, 0.7, 0.8
    depth, ranks = T.depth_law_from_rate(alpha, S), [T.power_rank_law(r, 200) for _ in range(S + 1)]
    for budget in (8, 16, 32, 64):
        geo = T.geometric_fanout(budget, S, alpha=alpha, r=r)
        opt = T.optimal_fanout(budget, depth, ranks)
        assert T.hit_rate(geo, depth, ranks) >= T.hit_rate(opt, depth, ranks) - 0.01
        assert list(geo[:S]) == sorted(geo[:S], reverse=True)  # larger fan-out at shallow depths
    assert T.geometric_fanout(64, S, alpha=alpha, r=r)[0] > T.uniform_fanout(64, S)[0]


def test_uniform_spreads_the_remainder_shallow():
    assert T.uniform_fanout(12, 3) == (3, 3, 3, 3)
    assert T.uniform_fanout(14, 3) == (4, 4, 3, 3)
    assert T.uniform_fanout(2, 3) == (1, 1, 0, 0)


@pytest.mark.parametrize("budget", [0, -3, 2.5])
def test_budget_that_holds_no_branch_is_one_error(budget):
    depth, ranks = T.depth_law_from_rate(0.5, 2), [[0.5, 0.2]] * 3
    for call in (lambda: T.optimal_fanout(budget, depth, ranks), lambda: T.uniform_fanout(budget, 2),
                 lambda: T.geometric_fanout(budget, 2, alpha=0.5, r=1.0)):
        with pytest.raises(ValueError, match="cannot hold one cache branch"):
            call()


def test_fits_recover_their_model():
    S, alpha = 4, 0.6
    assert T.fit_rate(T.depth_law_from_rate(alpha, S)) == pytest.approx(alpha)
    r = 0.7
    miss = [(1 + F) ** -r for F in range(30)]
    assert T.fit_power(miss) == pytest.approx(r)
    assert T.depth_law_from_hist({0: 2, 2: 6}, 2) == [0.25, 0.0, 0.75]


# backoff --------------------------------------------------------------------------------------------------
BACKOFF = dict(verify_s=0.030, slow_s=0.012, fast_s=0.0005, draft_alpha=0.8, fast_alpha=0.2, S=4)


def test_backoff_hand_worked_case():
    """h = 0.9, S = 4: E_hit = E_slow = 1 + .8 + .64 + .512 + .4096 = 3.3616, E_fast = 1 + .2 + .04 + .008 + .0016 =
    1.2496. Per-sequence tokens with each backup: slow 3.3616, fast 0.9 * 3.3616 + 0.1 * 1.2496 = 3.15040.
    m* = T_v (E_s - E_f') / (T_s E_f' - T_f E_s) = 0.03 * 0.2112 / (0.012 * 3.1504 - 0.0005 * 3.3616) = 0.17589;
    1 - 0.9^B > 0.17589 first at B = 2 (1 - 0.81 = 0.19; B = 1 gives 0.1)."""
    assert T.expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert T.backoff_threshold(hit_rate=0.9, **BACKOFF) == 2
    one = T.backoff_choice(hit_rate=0.9, batch=1, **BACKOFF)
    assert one.backup == "slow" and one.threshold_batch == 2
    # batch 1: slow (0.03 + 0.1 * 0.012) / 3.3616 = 0.0092813; fast (0.03 + 0.1 * 0.0005) / 3.1504 = 0.0095385
    assert one.seconds_per_token["slow"] == pytest.approx(0.0312 / 3.3616)
    assert one.seconds_per_token["fast"] == pytest.approx(0.03005 / 3.1504)
    assert T.backoff_choice(hit_rate=0.9, batch=2, **BACKOFF).backup == "fast"


@pytest.mark.parametrize("h", [0.0, 0.3, 0.7, 0.9, 0.97, 0.999, 1.0])
def test_backoff_flips_once_at_the_threshold(h):
    B_star = T.backoff_threshold(hit_rate=h, **BACKOFF)
    choices = [T.backoff_choice(hit_rate=h, batch=B, **BACKOFF).backup for B in range(1, 300)]
    expect = ["slow" if B_star is None or B < B_star else "fast" for B in range(1, 300)]
    assert choices == expect


def test_backoff_threshold_moves_the_right_way():
    """A slower draft backup, or a better fast predictor, flips to the fast one at smaller batches (monotone); the
    hit rate alone is not monotone (a likelier hit both shrinks the fast backup's token loss and the chance that a
    round misses), so no test claims that."""
    for h in (0.5, 0.9, 0.99):
        by_slow = [T.backoff_threshold(hit_rate=h, **{**BACKOFF, "slow_s": s}) for s in (0.004, 0.008, 0.012, 0.03)]
        by_fast = [T.backoff_threshold(hit_rate=h, **{**BACKOFF, "fast_alpha": a}) for a in (0.0, 0.2, 0.4, 0.6)]
        for seq in (by_slow, by_fast):
            big = [10 ** 9 if t is None else t for t in seq]
            assert big == sorted(big, reverse=True), seq
            assert len(set(big)) > 1, seq


def test_backoff_slow_backup_that_pays_never_flips():
    assert T.backoff_threshold(hit_rate=0.5, verify_s=0.03, slow_s=0.001, fast_s=0.0009, draft_alpha=0.8,
                               fast_alpha=0.1, S=4) is None


def test_backoff_bad_input():
    with pytest.raises(ValueError, match="swap them"):
        T.backoff_choice(hit_rate=0.9, batch=4, **{**BACKOFF, "fast_s": 0.1})
    with pytest.raises(ValueError, match="hit_rate"):
        T.backoff_choice(hit_rate=1.5, batch=4, **BACKOFF)
