"""Saguaro's policies (seed 002): the speculation cache's topology under a budget, and the batch-size-aware backoff.

Topology. A round's verdict is (k, b): k accepted drafts (0 .. S) and the bonus token b (``drafting/saguaro.py``).
The cache prepares ``fanout[k]`` bonus candidates at accepted length k, the draft's best tokens there; it hits when
b is among the candidates of the verdict's k. Write

    a_k     = P(exactly k drafts accepted)                              (the depth law, S + 1 numbers)
    p_k(j)  = P(b is the draft's j-th best candidate at depth k | k)    (the rank law, j = 1, 2, ...)

Then the expected hit rate of a fan-out f = (f_0 .. f_S) is

    H(f) = sum_k a_k * P_k(f_k),        P_k(F) = sum_{j <= F} p_k(j),

and Saguaro's topology is   max_f H(f)   subject to   sum_k f_k <= N (the cache budget), f_k >= 0 integers.

The objective is separable, so the exact optimum is a resource allocation: each extra candidate at depth k gains
a_k p_k(f_k + 1). When every P_k is concave in F (p_k(j) non-increasing in j, which holds for a rank law where the
draft's better candidates are likelier bonus tokens), greedy on marginal gains is exact: the gains of each depth
come in non-increasing order, so the N largest gains overall are taken as prefixes of each depth, which is the
optimum (the classic argument for separable concave allocation). A measured rank law need not be concave (a few
hundred rounds give noisy tail counts), so ``optimal_fanout`` checks concavity and solves by dynamic programming
over depths (exact for any P_k) when it fails.

Seed 002's closed form (``geometric_fanout``): per-token acceptance alpha gives a_k = alpha^k (1 - alpha) for k < S
and a_S = alpha^S, and the paper observes the miss rate falls as a power law in the fan-out, 1 - P_k(F) =
(1 + F)^(-r). Setting the derivative of the Lagrangian to zero, a_k r (1 + f_k)^(-1-r) = mu, gives

    1 + f_k = c * a_k^(1 / (1 + r)),    truncated at f_k >= 0,

a geometric series in k (ratio alpha^(1 / (1 + r))) for k < S: larger fan-out at shallow depths, with c set so the
counts fill the budget; integers by largest remainder. ``uniform_fanout`` (the same count at every depth, the
authors' default) is the baseline.

Backoff. When any of a batch's B sequences misses the cache, the whole batch waits for that round's backup
drafts (``backoff_choice``): a slow backup (the draft model drafting S tokens, as accurate as the cache) or a fast
one (an n-gram or random predictor, nearly free but rarely accepted). Per round, with hit rate h independent per
sequence, the expected time is T_v + (1 - h^B) T_backup and the expected tokens per sequence h E_hit + (1 - h)
E_backup, E = 1 + sum_{j=1..S} alpha^j. The fast backup wins once the chance that some sequence misses, 1 - h^B,
passes a threshold; ``backoff_threshold`` gives the batch size where the choice flips.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def check_budget(budget: int) -> int:
    """The cache budget N (branches per sequence), checked: one clear error when it cannot hold one branch."""
    if int(budget) != budget or budget < 1:
        raise ValueError(f"cache budget {budget} cannot hold one cache branch: give an integer >= 1 (branches per "
                         f"sequence, e.g. budget=16)")
    return int(budget)


def depth_law_from_rate(alpha: float, S: int) -> list[float]:
    """a_k = P(exactly k of S drafts accepted) when each draft is accepted with probability alpha given its
    prefix: alpha^k (1 - alpha) for k < S, alpha^S for k = S."""
    if not 0.0 <= alpha <= 1.0 or S < 1:
        raise ValueError(f"need a per-token acceptance alpha in [0, 1] and S >= 1, got alpha={alpha}, S={S}")
    return [alpha ** k * (1 - alpha) for k in range(S)] + [alpha ** S]


def depth_law_from_hist(hist: Mapping[int, int] | Sequence[int], S: int) -> list[float]:
    """a_k from a measured histogram of accepted lengths ({k: count} or counts by k), normalised."""
    counts = [0.0] * (S + 1)
    items = hist.items() if isinstance(hist, Mapping) else enumerate(hist)
    for k, n in items:
        if not 0 <= int(k) <= S:
            raise ValueError(f"accepted length {k} outside 0 .. S = {S}")
        counts[int(k)] += float(n)
    total = sum(counts)
    if total <= 0:
        raise ValueError("the acceptance histogram is empty")
    return [c / total for c in counts]


def fit_rate(depth_law: Sequence[float]) -> float:
    """The per-token acceptance alpha of a depth law: pooled P(accept draft j | reached j) = E[k] / sum_j P(k >= j)
    (the maximum-likelihood rate of a truncated geometric)."""
    S = len(depth_law) - 1
    mean = sum(k * a for k, a in enumerate(depth_law))
    reached = sum(sum(depth_law[j:]) for j in range(S))  # sum_{j=0}^{S-1} P(k >= j): drafts judged
    return mean / reached if reached > 0 else 0.0


def power_rank_law(r: float, width: int) -> list[float]:
    """p(j), j = 1 .. width, of the power-law miss curve 1 - P(F) = (1 + F)^(-r): p(j) = j^-r - (1 + j)^-r
    (non-increasing, so P is concave)."""
    if r <= 0 or width < 1:
        raise ValueError(f"power_rank_law needs r > 0 and width >= 1, got r={r}, width={width}")
    return [j ** -r - (j + 1) ** -r for j in range(1, width + 1)]


def fit_power(miss: Sequence[float]) -> float:
    """r of the power law 1 - P(F) = (1 + F)^(-r) closest (least squares in log-log, through F = 0 where the miss
    is 1) to a measured miss curve miss[F], F = 0, 1, ...; points with no miss left are dropped."""
    num = den = 0.0
    for F, m in enumerate(miss):
        if F and 0 < m < 1:
            x = math.log(1 + F)
            num, den = num - x * math.log(m), den + x * x
    return num / den if den and num > 0 else 1.0


def hit_rate(fanout: Sequence[int], depth_law: Sequence[float], ranks: Sequence[Sequence[float]]) -> float:
    """H(f) = sum_k a_k sum_{j <= f_k} p_k(j) (module doc); ``ranks[k][j - 1]`` = p_k(j)."""
    if not len(fanout) == len(depth_law) == len(ranks):
        raise ValueError(f"fanout, depth law and rank law need one entry per accepted length; got "
                         f"{len(fanout)}, {len(depth_law)}, {len(ranks)}")
    return sum(a * sum(row[:f]) for a, f, row in zip(depth_law, fanout, ranks))


def is_concave(ranks: Sequence[Sequence[float]], tol: float = 1e-12) -> bool:
    """Every P_k concave in F: each row of the rank law non-increasing."""
    return all(row[j + 1] <= row[j] + tol for row in ranks for j in range(len(row) - 1))


def optimal_fanout(budget: int, depth_law: Sequence[float], ranks: Sequence[Sequence[float]]) -> tuple[int, ...]:
    """The exact maximiser of H(f) subject to sum f <= budget, f_k <= len(ranks[k]) (module doc): greedy on
    marginal gains a_k p_k(f_k + 1) when the rank law is concave, dynamic programming over depths otherwise. Ties
    go to shallower depths; zero gains still fill the budget (shallow first), so the sum is min(budget, capacity)."""
    N = check_budget(budget)
    gains = [[a * p for p in row] for a, row in zip(depth_law, ranks)]
    if is_concave(ranks):
        fan = [0] * len(gains)
        heap = [(-g[0], k) for k, g in enumerate(gains) if g]
        heapq.heapify(heap)
        for _ in range(N):
            if not heap:
                break
            _, k = heapq.heappop(heap)
            fan[k] += 1
            if fan[k] < len(gains[k]):
                heapq.heappush(heap, (-gains[k][fan[k]], k))
        return tuple(fan)
    return _dp_fanout(N, gains)


def _dp_fanout(N: int, gains: list[list[float]]) -> tuple[int, ...]:
    """best[k][n]: the largest hit mass of depths k .. S with n candidates; exact for any rank law."""
    prefix = [[0.0] + [sum(g[:j + 1]) for j in range(len(g))] for g in gains]  # prefix[k][F] = a_k P_k(F)
    S1 = len(gains)
    best = [[0.0] * (N + 1) for _ in range(S1 + 1)]
    pick = [[0] * (N + 1) for _ in range(S1)]
    for k in range(S1 - 1, -1, -1):
        for n in range(N + 1):
            cands = [(prefix[k][F] + best[k + 1][n - F], F) for F in range(min(n, len(gains[k])) + 1)]
            best[k][n], pick[k][n] = max(cands, key=lambda c: (c[0] + 1e-15 * c[1], c[1]))  # ties: more here
    fan, n = [], N
    for k in range(S1):
        fan.append(pick[k][n])
        n -= pick[k][n]
    return tuple(fan)


def uniform_fanout(budget: int, S: int) -> tuple[int, ...]:
    """The same count at every accepted length 0 .. S; the remainder of budget / (S + 1) goes to shallow depths."""
    N = check_budget(budget)
    base, extra = divmod(N, S + 1)
    return tuple(base + (k < extra) for k in range(S + 1))


def geometric_fanout(budget: int, S: int, *, alpha: float, r: float) -> tuple[int, ...]:
    """Seed 002's closed form (module doc): 1 + f_k = c a_k^(1/(1+r)) truncated at 0, c filling the budget
    (bisection), integers by largest remainder. alpha: per-token acceptance; r: the miss curve's power law."""
    N = check_budget(budget)
    if r <= 0:
        raise ValueError(f"geometric_fanout needs the power-law exponent r > 0, got {r}")
    w = [max(a, 1e-300) ** (1.0 / (1.0 + r)) for a in depth_law_from_rate(min(max(alpha, 1e-9), 1 - 1e-9), S)]

    def counts(c: float) -> list[float]:
        return [max(c * x - 1.0, 0.0) for x in w]

    lo, hi = 0.0, (N + S + 1) / min(w)
    for _ in range(200):  # sum(counts(c)) is continuous and non-decreasing in c
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if sum(counts(mid)) < N else (lo, mid)
    real = counts(hi)
    fan = [int(math.floor(x)) for x in real]
    order = sorted(range(S + 1), key=lambda k: (-(real[k] - fan[k]), k))
    for k in order[:N - sum(fan)]:
        fan[k] += 1
    return tuple(fan)


# backoff --------------------------------------------------------------------------------------------------
def expected_tokens(alpha: float, S: int) -> float:
    """Tokens a sequence emits per round from a chain of S drafts accepted per token with probability alpha:
    1 (the bonus) + sum_{j=1..S} alpha^j."""
    return 1.0 + sum(alpha ** j for j in range(1, S + 1))


@dataclass(frozen=True)
class BackoffChoice:
    backup: str  # "slow" (the draft model) or "fast" (n-gram / random predictor): the one with less time per token
    seconds_per_token: dict  # {"slow": s, "fast": s}: expected batch time per emitted token with each backup
    threshold_batch: int | None  # smallest batch where fast wins (1: at every batch; None: at none)


def seconds_per_token(*, hit_rate: float, batch: int, verify_s: float, backup_s: float, cache_tokens: float,
                      backup_tokens: float) -> float:
    """Expected time per emitted token of one round (module doc): (T_v + (1 - h^B) T_backup) / (B (h E_hit +
    (1 - h) E_backup)); a round where any sequence misses blocks the batch on the backup."""
    miss_any = 1.0 - hit_rate ** batch
    return (verify_s + miss_any * backup_s) / (batch * (hit_rate * cache_tokens + (1 - hit_rate) * backup_tokens))


def backoff_threshold(*, hit_rate: float, verify_s: float, slow_s: float, fast_s: float, draft_alpha: float,
                      fast_alpha: float, S: int) -> int | None:
    """Smallest batch size B at which the fast backup gives less time per token than the slow one.

    With m = 1 - h^B, E_s / E_f the per-sequence tokens of a round with each backup (hits earn the cache's drafts):
    slow wins iff (T_v + m T_s) E_f < (T_v + m T_f) E_s, i.e. m (T_s E_f - T_f E_s) < T_v (E_s - E_f). m grows with
    B, so the choice flips at most once: at m* = T_v (E_s - E_f) / (T_s E_f - T_f E_s) when that is positive, B* =
    the smallest B with 1 - h^B > m*. None: slow at every batch size; 1: fast at every one."""
    _check_backoff(hit_rate, verify_s, slow_s, fast_s, draft_alpha, fast_alpha, S)
    e_cache = expected_tokens(draft_alpha, S)
    e_s = e_cache  # a miss served by the draft model earns what a hit does
    e_f = hit_rate * e_cache + (1 - hit_rate) * expected_tokens(fast_alpha, S)
    denom = slow_s * e_f - fast_s * e_s
    if denom <= 0:
        return None  # the slow backup's tokens pay for its time whatever the batch
    m_star = verify_s * (e_s - e_f) / denom
    if m_star == 0 and hit_rate < 1:  # equally accurate backups: the cheaper one, as soon as anything misses
        return 1
    if m_star >= 1 or hit_rate >= 1:
        return None  # even a round that always misses (m = 1) favours slow, or no round ever misses
    if hit_rate <= 0:
        return 1
    # 1 - h^B > m*  <=>  B > log(1 - m*) / log(h); strictly, so the first integer above it
    return max(1, math.floor(math.log(1 - m_star) / math.log(hit_rate)) + 1)


def backoff_choice(*, hit_rate: float, batch: int, verify_s: float, slow_s: float, fast_s: float,
                   draft_alpha: float, fast_alpha: float, S: int) -> BackoffChoice:
    """Which backup minimises expected time per emitted token at ``batch`` (module doc), and the flip batch.

    hit_rate: observed per-sequence cache hit rate; verify_s: the target's verify latency; slow_s: the draft model
    drafting S tokens; fast_s: the fast predictor; draft_alpha / fast_alpha: per-token acceptance of the draft's
    chains (cache hits and the slow backup) and of the fast predictor's."""
    _check_backoff(hit_rate, verify_s, slow_s, fast_s, draft_alpha, fast_alpha, S)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    e_cache = expected_tokens(draft_alpha, S)
    kw = dict(hit_rate=hit_rate, batch=batch, verify_s=verify_s, cache_tokens=e_cache)
    t = {"slow": seconds_per_token(**kw, backup_s=slow_s, backup_tokens=e_cache),
         "fast": seconds_per_token(**kw, backup_s=fast_s, backup_tokens=expected_tokens(fast_alpha, S))}
    threshold = backoff_threshold(hit_rate=hit_rate, verify_s=verify_s, slow_s=slow_s, fast_s=fast_s,
                                  draft_alpha=draft_alpha, fast_alpha=fast_alpha, S=S)
    return BackoffChoice("fast" if t["fast"] < t["slow"] else "slow", t, threshold)


def _check_backoff(h, verify_s, slow_s, fast_s, draft_alpha, fast_alpha, S) -> None:
    if not 0.0 <= h <= 1.0:
        raise ValueError(f"hit_rate is a probability in [0, 1], got {h}")
    if min(verify_s, slow_s, fast_s) < 0:
        raise ValueError(f"latencies must be >= 0 seconds, got verify {verify_s}, slow {slow_s}, fast {fast_s}")
    if not (0.0 <= fast_alpha <= 1.0 and 0.0 <= draft_alpha <= 1.0) or S < 1:
        raise ValueError(f"acceptance rates lie in [0, 1] and S >= 1; got draft {draft_alpha}, fast {fast_alpha}, "
                         f"S={S}")
    if fast_s > slow_s or fast_alpha > draft_alpha:
        raise ValueError(f"the fast backup is the cheaper, less accurate one: need fast_s <= slow_s and fast_alpha <= "
                         f"draft_alpha, got fast {fast_s} s / {fast_alpha}, slow {slow_s} s / {draft_alpha}; swap them")
