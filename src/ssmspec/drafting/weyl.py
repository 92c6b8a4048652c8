"""Low-discrepancy draws for the oracle (``Oracle(draws="weyl")``): the kept nodes of every step follow the
oracle's independent-Bernoulli law (each node kept with probability ``keep[c]``, per branch) in the limit, and
the frequency of every accepted length converges like 1/n instead of 1/sqrt(n).

Why. The throughput experiments time 100-1000 steps. With pseudo-random draws the measured mean accepted length
is noise around the designed one: its standard error is sd(a) / sqrt(n), and the law's own variance says how
many steps a 2% band needs (``iid_steps``: e.g. ~2 x 10^4 for tree A at batch 1). Weyl sequences
(x + i theta mod 1, theta irrational) fill [0, 1) evenly: an interval's share of the first n points is within
D_n of its length, D_n = O(log n / n) for a quadratic irrational theta (Kuipers & Niederreiter, ch. 1, thm 3.4).

Construction (one step of one sequence b; i counts the steps b has taken while running):

1. u = frac(x_b + i theta_b) picks the accepted length a by inverse CDF of its exact law, deepest first:
   a = #{k >= 1 : u < P(a >= k)}. So {a >= k} is the interval [0, P(a >= k)) of one 1-D Weyl sequence and the
   count of every accepted length is within n D_n of its expectation (a worst case over the offset x_b).
2. w, the position of u inside the interval of a, rescaled to [0, 1), samples the reached part of the tree
   (the nodes on fully kept paths and their not-kept children) from its exact conditional law given a. Node by
   node (topological order, siblings in order), child c of a reached node v whose children must reach depth d
   exactly (EQ) or at most (LE) takes X_c in {0 (not kept), 1 + depth below c} by inverse CDF on w, w rescaled
   into the chosen cell ("nested splitting"). With G_c(m) = P(X_c <= m) = 1 - keep_c f_c(m) and H_c(d) the
   product of G over c's later siblings: LE(d): P(X_c = x) / G_c(d), x <= d; EQ(d): x = d with weight
   P(X_c = d) H_c(d), x < d with P(X_c = x) (H_c(d) - H_c(d-1)); after x = d the later siblings are LE(d).
   f_v(d) = P(a path of d kept nodes below v | v reached), the recursion of ``oracle.expected_accepted``.
3. Nodes whose parent is not reached do not change the accepted length; node c of them is kept when
   v_{b,c} = frac(y_{b,c} + i eta_{b,c}) < keep_c.

(u, v) -> kept nodes maps the uniform measure of [0, 1)^(1+T) onto the product law exactly (steps 1-2 are
inverse CDFs of exact conditional laws, step 3 uses coordinates independent of them), piecewise continuously.
The rates theta_b, eta_{b,c} are elements of distinct fields Q(sqrt m) (m square-free), so 1 and all rates are
linearly independent over Q (Besicovitch 1940): by Weyl's criterion the points are jointly equidistributed in
[0, 1)^(B (1 + T)), and the kept patterns of all sequences converge to the independent-Bernoulli law of all
nodes of all sequences. Consecutive steps of one sequence are not independent (u moves by theta_b), as in any
Weyl sequence; the law of each step, and of the batch within a step, is what converges.

Rates: sequence b's theta_b is the b-th field's element with the best badly-approximable constant
min_q q ||q theta|| (q <= 1000) among (a + sqrt m) / c, c <= 6, kept when >= 0.25 (partial quotients <= ~3;
b = 0 is the golden ratio's, the best there is); eta_{b,c} = frac(sqrt m) of further fields.

``steps_needed`` is the a-priori step count: the smallest n (a multiple of 25) at which the batch's mean
accepted length misses the designed one by more than ``tol`` for at most one offset draw in 1000 (offsets
uniform: the seed's; the counts a step sees depend only on u, so the distribution is computed exactly per
sequence on a grid of offsets), checked at every multiple of 25 up to 1.5 n. It reads the law and the rates,
never a run's outcome.
"""
from __future__ import annotations

import functools
import math
import random

import numpy as np

from ssmspec.drafting.static_tree import check_parents

_SCORE_Q = np.arange(1, 1001)
U_SCORE = 0.25  # badly-approximable constant a sequence's theta must reach
V_SCORE = 0.05  # the same for the rates of nodes off the reached tree (they do not set the accepted length)
STEP_GRID = 25  # step counts are multiples of this


def _squarefree(m: int) -> bool:
    k = 2
    while k * k <= m:
        if m % (k * k) == 0:
            return False
        k += 1
    return True


def _score(x: float) -> float:
    """min over q <= 1000 of q ||q x||: how badly x is approximated by rationals (golden ratio: 1 / sqrt 5)."""
    v = _SCORE_Q * x
    return float((_SCORE_Q * np.abs(v - np.round(v))).min())


def _best(m: int) -> tuple[float, float]:
    """(score, element) of the most badly approximable element (a + sqrt m) / c, c <= 6, a < c, of Q(sqrt m)."""
    s = math.sqrt(m)
    return max((_score(((a + s) / c) % 1.0), ((a + s) / c) % 1.0) for c in range(1, 7) for a in range(c))


@functools.cache
def _fields() -> dict:
    """Rates found so far and where each search stands. Fields split by a property of m alone (its best score
    reaches ``U_SCORE`` or not), so the rates never depend on the order of the calls."""
    return {"u": [(math.sqrt(5) - 1) / 2], "u_m": 1, "v": [], "v_m": 1}  # the golden ratio's field first


def _grow(n_u: int, n_v: int) -> None:
    st = _fields()
    while len(st["u"]) < n_u:
        st["u_m"] += 1
        m = st["u_m"]
        if m != 5 and _squarefree(m):
            score, x = _best(m)
            if score >= U_SCORE:
                st["u"].append(x)
    while len(st["v"]) < n_v:
        st["v_m"] += 1
        m = st["v_m"]
        if m != 5 and _squarefree(m) and _best(m)[0] < U_SCORE and _score(math.sqrt(m) % 1.0) >= V_SCORE:
            st["v"].append(math.sqrt(m) % 1.0)


def u_rates(n: int) -> list[float]:
    """theta_b of sequences 0..n-1 (module doc)."""
    _grow(n, 0)
    return _fields()["u"][:n]


def v_rates(n: int) -> list[float]:
    """eta of the first n (sequence, node) coordinates off the reached tree, sequence after sequence."""
    _grow(0, n)
    return _fields()["v"][:n]


def weyl(rate: float, offset: int, start: int, n: int) -> np.ndarray:
    """frac(offset / 2^64 + (start + i) rate), i < n, float64 in [0, 1): exact in 64-bit fixed point."""
    r = np.uint64(int(round((rate % 1.0) * 2.0 ** 64)) % 2 ** 64)
    i = np.arange(start, start + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = np.uint64(offset % 2 ** 64) + i * r  # wraps mod 2^64
    return (x >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def reach(parents: list[int], keep: list[float]) -> np.ndarray:
    """f (1+T, depth+2) float64: f[v, d] = P(some path of d kept nodes below node v | v reached); f[v, 0] = 1.
    ``keep``: probability of each node 1..T (node order); f[v, d] = 1 - prod_children (1 - keep_c f[c, d-1])."""
    depth = max(check_parents(parents))
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, par in enumerate(parents, start=1):
        kids[par].append(i)
    f = np.zeros((len(kids), depth + 2))
    f[:, 0] = 1.0
    for v in reversed(range(len(kids))):  # children have larger numbers: they are done first
        for d in range(1, depth + 1):
            miss = 1.0
            for c in kids[v]:
                miss *= 1.0 - keep[c - 1] * f[c, d - 1]
            f[v, d] = 1.0 - miss
    return f


def accepted_law(parents: list[int], keep: list[float]) -> np.ndarray:
    """(depth+1,) P(a = k), k = 0..depth: the exact law of the accepted length."""
    f = reach(parents, keep)[0]
    return f[:-1] - f[1:]


def sample(parents: list[int], keep: list[float], u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Kept nodes (N, T) bool from u (N,) and v (N, T) in [0, 1) (module doc, steps 1-3): uniform u and v give
    the independent-Bernoulli law of every node exactly."""
    T = len(parents)
    f = reach(parents, keep)  # (1+T, D+2)
    D = f.shape[1] - 2
    N = u.shape[0]
    q = np.asarray(keep, dtype=np.float64)
    # P(X_c = x), x = 0..D (X_c = 0: not kept; 1 + depth below c otherwise); G_c(m) = P(X_c <= m), m = -1..D
    px = np.zeros((T + 1, D + 1))
    px[1:, 0] = 1.0 - q
    px[1:, 1:] = q[:, None] * (f[1:, :D] - f[1:, 1:D + 1])
    G = np.concatenate([np.zeros((T + 1, 1)), np.cumsum(px, axis=1)], axis=1)  # column m + 1
    later: list[list[int]] = [[] for _ in range(T + 1)]
    for c in range(1, T + 1):
        later[c] = [s for s in range(c + 1, T + 1) if parents[s - 1] == parents[c - 1]]
    H = np.ones((T + 1, D + 2))  # H[c, m + 1] = prod over later siblings of G_s(m), m = -1..D
    for c in range(1, T + 1):
        for s in later[c]:
            H[c] *= G[s]
    # step 1: the accepted length, deepest first, and w inside its interval
    f0 = f[0]  # P(a >= k), k = 0..D+1
    a = (u[:, None] < f0[None, 1:D + 1]).sum(1)  # (N,)
    lo, hi = f0[a + 1], f0[a]
    w = np.clip((u - lo) / np.maximum(hi - lo, 1e-300), 0.0, np.nextafter(1.0, 0.0))
    need = np.zeros((N, T + 1), dtype=np.int64)  # exact depth required below a reached node
    need[:, 0] = a
    eq = np.zeros((N, T + 1), dtype=bool)  # its remaining children must still reach need exactly
    eq[:, 0] = True
    reached = np.zeros((N, T + 1), dtype=bool)
    reached[:, 0] = True
    kept = np.zeros((N, T), dtype=bool)
    xs = np.arange(D + 1)
    for c in range(1, T + 1):
        p = parents[c - 1]
        on = reached[:, p]
        d, e = need[:, p], eq[:, p]
        h_d, h_dm1 = H[c, d + 1], H[c, d]  # (N,)
        weight = px[c][None, :] * (xs[None, :] <= d[:, None])  # (N, D+1)
        factor = np.where(xs[None, :] == d[:, None], h_d[:, None], (h_d - h_dm1)[:, None])
        weight = np.where(e[:, None], weight * factor, weight)
        cdf = np.cumsum(weight[:, ::-1], axis=1)  # deepest first
        total = cdf[:, -1]
        t = w * total
        k = np.minimum((t[:, None] >= cdf).sum(1), D)  # index into the reversed order
        x = D - k
        start = np.where(k > 0, cdf[np.arange(N), np.maximum(k - 1, 0)], 0.0)
        cell = weight[np.arange(N), x]
        w = np.where(on, np.clip((t - start) / np.maximum(cell, 1e-300), 0.0, np.nextafter(1.0, 0.0)), w)
        eq[:, p] = np.where(on, e & (x < d), eq[:, p])
        took = on & (x >= 1)
        reached[:, c] = took
        need[:, c] = np.where(took, x - 1, 0)
        eq[:, c] = took
        kept[:, c - 1] = np.where(on, took, v[:, c - 1] < q[c - 1])
    return kept


class WeylDraws:
    """Kept nodes of ``batch`` sequences for a run of steps (module doc). ``parents`` (T,), ``keep`` (T,) per node;
    ``seed`` sets every offset: sequence b's come from random.Random(f"{seed}:{b}"), so they do not depend on the
    batch size."""

    def __init__(self, parents: list[int], keep: list[float], *, batch: int, seed: int) -> None:
        self.parents, self.keep, self.batch = list(parents), [float(k) for k in keep], int(batch)
        T = len(self.parents)
        self.theta = u_rates(batch)
        eta = v_rates(batch * T)
        self.eta = [eta[b * T:(b + 1) * T] for b in range(batch)]
        rng = [random.Random(f"{seed}:{b}") for b in range(batch)]
        self.u_off = [r.getrandbits(64) for r in rng]
        self.v_off = [[r.getrandbits(64) for _ in range(T)] for r in rng]

    def fill(self, starts: list[int], n: int) -> np.ndarray:
        """(B, n, T) bool: the kept nodes of steps starts[b] .. starts[b] + n - 1 of every sequence b."""
        T = len(self.parents)
        u = np.concatenate([weyl(self.theta[b], self.u_off[b], starts[b], n) for b in range(self.batch)])
        v = np.concatenate([np.stack([weyl(self.eta[b][c], self.v_off[b][c], starts[b], n) for c in range(T)], 1)
                            for b in range(self.batch)])
        return sample(self.parents, self.keep, u, v).reshape(self.batch, n, T)


# how many steps ----------------------------------------------------------------------------------------
def iid_steps(parents: list[int], keep: list[float], *, tol: float = 0.02, z: float = 3.29) -> int:
    """Sequence-steps independent draws need for the mean accepted length to be within ``tol`` (relative) of its
    expectation with probability 0.999 (z = 3.29): (z sd(a) / (tol E[a]))^2, from the law's variance."""
    law = accepted_law(parents, keep)
    k = np.arange(law.shape[0])
    mean = float((k * law).sum())
    sd = float(np.sqrt((k * k * law).sum() - mean ** 2))
    return math.ceil((z * sd / (tol * mean)) ** 2) if mean > 0 else 0


def _errors(theta: float, levels: np.ndarray, n: int, grid: int) -> np.ndarray:
    """(grid,) sum_k #{i < n: frac(x + i theta) < P_k} - n P_k at offsets x = (j + 1/2) / grid: the excess of a
    sequence's accepted drafts over n steps (step 1 of the module doc), exactly, as a function of its offset."""
    pts = np.sort(np.mod(np.arange(n) * theta, 1.0))
    x = (np.arange(grid) + 0.5) / grid
    levels = levels[levels < 1.0]  # P(a >= k) = 1: every step counts, no error
    out = -n * levels.sum() * np.ones(grid)
    for P in levels:  # count i with frac(i theta) in [-x, P - x) mod 1
        lo, hi = np.mod(-x, 1.0), np.mod(P - x, 1.0)
        cnt = np.searchsorted(pts, hi) - np.searchsorted(pts, lo)
        out += np.where(hi >= lo, cnt, cnt + n)
    return out


def steps_needed(parents: list[int], keep: list[float], *, batch: int, tol: float = 0.02, miss: float = 1e-3,
                 max_steps: int = 4000, grid: int = 4096, draws: int = 20000) -> int:
    """Steps per sequence (a multiple of ``STEP_GRID``) after which the batch's mean accepted length is within
    ``tol`` of the designed one for all but a share ``miss`` of uniformly drawn offsets, at that count and every
    multiple of the grid up to 1.5x it (module doc). ValueError past ``max_steps``."""
    levels = reach(parents, keep)[0][1:-1]  # P(a >= k), k = 1..D
    levels = levels[levels > 0]
    E = float(levels.sum())
    if E == 0 or (levels >= 1.0).all():  # nothing or everything accepted: no draw changes the mean
        return STEP_GRID
    theta = u_rates(batch)
    pick = np.random.default_rng(0).integers(0, grid, size=(draws, batch))
    ok = {}

    def holds(n: int) -> bool:
        if n not in ok:
            err = np.stack([_errors(t, levels, n, grid) for t in theta], 1)  # (grid, B)
            mean = err[pick, np.arange(batch)].mean(1) / (n * E)  # (draws,) relative error of the batch mean
            ok[n] = float(np.quantile(np.abs(mean), 1.0 - miss)) <= tol
        return ok[n]

    for n in range(STEP_GRID, max_steps + 1, STEP_GRID):
        if holds(n) and all(holds(m) for m in range(n + STEP_GRID, int(1.5 * n) + 1, STEP_GRID)):
            return n
    raise ValueError(f"more than {max_steps} steps a sequence would be needed for a {tol:.0%} band "
                     f"(E[a] = {E:.3f}); widen the band or raise max_steps")


def max_accepted(parents: list[int], keep: list[float], *, batch: int, steps: int, grid: int = 4096) -> int:
    """An upper bound on the accepted drafts of one sequence over ``steps`` consecutive Weyl draws, for any offset
    (steps x E[a] plus the largest excess over offsets; +2 for what the grid of offsets may miss): sizes a run's
    token budget without assuming every draft is accepted."""
    levels = reach(parents, keep)[0][1:-1]
    levels = levels[levels > 0]
    if not len(levels):
        return 0
    excess = max(float(_errors(t, levels, steps, grid).max()) for t in u_rates(batch))
    return math.ceil(steps * float(levels.sum()) + excess) + 2
