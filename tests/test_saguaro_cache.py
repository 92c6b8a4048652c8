"""The measurement behind saguaro_fig4_fanout / saguaro_fig5_residual (bench/saguaro_cache.py) and the law that
residual scaling keeps.

- lambda never changes the output law: drafts drawn from the lambda-scaled q and verified with that same q emit the
  target's next-token law (chi-square on a Markov chain of V = 6); the mutant that drafts from the scaled q but
  verifies with the unscaled one is caught.
- ``RecordingDraft`` drafts what ``draft_model`` drafts (greedy output equals autoregressive through generate()),
  its recorded rounds line up with the engine's verdicts, and a round's hit is saguaro.cache_lookup's.
"""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from ssmspec.bench import saguaro_cache as sc
from ssmspec.drafting import saguaro
from ssmspec.drafting.base import DraftTree
from ssmspec.engine.generate import generate
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.verify import SamplingConfig, SpeculativeVerifier

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, S, ROWS = 6, 2, 40_000
PASS, FAIL = 1e-3, 1e-6


def _markov():
    g = torch.Generator().manual_seed(3)
    logp = torch.log_softmax(1.5 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(logp + 0.7 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    return logp.exp().float(), q.float()


def _first_tokens(lam: float, *, verify_with_scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ROWS rows, pending token x uniform: a chain of S drafts from rescale_top(Q[.], lam, 2), verified. Returns
    (pending (ROWS,), first emitted token (ROWS,))."""
    P, Q = _markov()
    gen = torch.Generator().manual_seed(11)
    x = torch.randint(0, V, (ROWS,), generator=gen)
    toks, qs, prev = [], [], x
    for _ in range(S):
        q = saguaro.rescale_top(Q[prev], lam, 2)  # (ROWS, V)
        t = torch.multinomial(q, 1, generator=gen)[:, 0]
        toks.append(t)
        qs.append(q if verify_with_scaled else Q[prev])
        prev = t
    tokens = torch.stack(toks, 1)  # (ROWS, S)
    tree = DraftTree.from_chains(tokens[:, None], torch.stack(qs, 1)[:, None])
    p = P[torch.cat([x[:, None], tokens], 1)]  # (ROWS, 1 + S, V) target law at every node
    v = SpeculativeVerifier(SamplingConfig(temperature=1.0)).verify(p.log(), tree, gen)
    first = torch.where(v.accepted > 0, tokens[:, 0], v.bonus)
    return x, first


def _pvalue(x, first) -> float:
    P, _ = _markov()
    stat, df = 0.0, 0
    for s in range(V):
        obs = torch.bincount(first[x == s], minlength=V).double()
        exp = P[s].double() * obs.sum()
        stat += float(((obs - exp) ** 2 / exp).sum())
        df += V - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.parametrize("lam", [1.0, 0.5, 0.1])
def test_residual_scaling_keeps_the_target_law(lam):
    assert _pvalue(*_first_tokens(lam, verify_with_scaled=True)) > PASS


def test_verifying_with_the_unscaled_q_is_caught():
    assert _pvalue(*_first_tokens(0.1, verify_with_scaled=False)) < FAIL


# the recording drafter on tiny random models --------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    cfg = load_preset("tiny-mamba2")
    return build_model(cfg, seed=0, dtype=torch.float64), build_model(cfg, seed=1, dtype=torch.float64)


PROMPTS = [[5, 9, 17, 3, 40], [7, 7, 2], [100, 4, 8, 15, 16, 23]]


def test_recording_drafter_is_lossless_and_lines_up(models):
    target, draft = models
    ref = generate(target, PROMPTS, max_new_tokens=20).sequences
    rec = sc.RecordingDraft(draft=draft, draft_len=3, temperature=0.0, keep=6)
    out = generate(target, PROMPTS, max_new_tokens=20, strategy="replay", drafter=rec)
    assert out.sequences == ref  # the extra draft step at depth S changes nothing the target sees
    assert len(rec.rounds) == len(out.steps) - 1
    vals, idx, drafts = rec.rounds[0]
    assert vals.shape == idx.shape == (len(PROMPTS), 4, 7) and drafts.shape == (len(PROMPTS), 3)


def test_recorded_rounds_hit_by_cache_lookup(models):
    target, draft = models

    class _Pair:
        pass

    pair = _Pair()
    pair.target, pair.draft = target, draft
    b = OmegaConf.create({"S": 3, "batch": 2, "new_tokens": 16, "seed": 0, "strategy": "replay"})
    rounds = sc.record_rounds(pair, PROMPTS, b, temperature=0.0, keep=6)  # raises if rounds and verdicts disagree
    assert len(rounds.accepted) > 0 and int(rounds.accepted.max()) <= 3
    # greedy: the bonus after a rejection is the target's argmax, never the rejected draft
    rej = rounds.accepted < 3
    assert not (rounds.drafts[rej].gather(1, rounds.accepted[rej, None])[:, 0] == rounds.bonus[rej]).any()
    # hits grow with the fan-out; a key of one depth never hits a verdict of another
    wide, narrow, only0 = rounds.hits((6, 6, 6, 6)), rounds.hits((1, 1, 1, 1)), rounds.hits((6, 0, 0, 0))
    assert bool((narrow <= wide).all()) and not bool(only0[rounds.accepted != 0].any())
    # the in-sample hit rate of the laws equals the lookup's (two code paths, one number)
    depth, ranks = rounds.laws(6)
    for fan in ((1, 1, 1, 1), (3, 2, 1, 0), (6, 0, 0, 0)):
        expect = sum(a * sum(row[:f]) for a, row, f in zip(depth, ranks, fan))
        assert float(rounds.hits(fan).double().mean()) == pytest.approx(expect)


def test_bad_lambda_is_one_error(models):
    _, draft = models
    with pytest.raises(ValueError, match=r"lambda must lie in \(0, 1\]"):
        sc.RecordingDraft(draft=draft, draft_len=2, temperature=1.0, keep=2, lam=1.5)
    with pytest.raises(ValueError, match="temperature > 0"):
        sc.RecordingDraft(draft=draft, draft_len=2, temperature=0.0, keep=2, lam=0.5)
