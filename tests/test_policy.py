"""The step-cost model recovers a known cost surface, and the policy picks the known best setting."""
from __future__ import annotations

import pytest

from ssmspec.drafting.oracle import expected_accepted
from ssmspec.policy import CostModel, Setting, candidates, fit, main, pick

TRUE = {"autoregressive": (2.0, 0.05, 0.0), "replay": (2.2, 0.04, 0.02), "snapshot": (2.1, 0.05, 0.09)}


def _points(noise: float = 0.0) -> list[dict]:
    import random

    rnd = random.Random(0)
    pts = []
    for st, (a, b, c) in TRUE.items():
        for B in (1, 4, 16, 64, 256):
            for L in ((1,) if st == "autoregressive" else (2, 4, 7, 9)):
                ms = (a + b * B + c * B * (L - 1)) * (1 + noise * rnd.uniform(-1, 1))
                pts.append(dict(strategy=st, batch=B, tokens=L, ms=ms))
    return pts


def test_fit_recovers_the_surface_and_reports_small_residuals():
    model = fit(_points())
    for st, coef in TRUE.items():
        assert model.coef[st] == pytest.approx(coef, abs=1e-9)
        assert model.residual[st] < 1e-9
    noisy = fit(_points(noise=0.05))
    assert all(0 < r < 0.05 for r in noisy.residual.values())
    assert noisy.coef["replay"] == pytest.approx(TRUE["replay"], rel=0.2)


def test_policy_prefers_long_drafts_at_small_batch_and_standard_decoding_when_drafts_do_not_pay():
    model = CostModel({k: v for k, v in TRUE.items()})
    cands = candidates(sorted(TRUE), [1, 2, 4, 8], [1, 2])
    small, _ = pick(model, 1, 0.8, cands)
    assert small.strategy == "replay" and small.S >= 4  # the step is the weight read: long drafts are free
    big, v = pick(model, 256, 0.8, cands)
    brute = max(cands, key=lambda s: model.tokens_per_s(s, 256, 0.8))
    assert big == brute and v == pytest.approx(model.tokens_per_s(brute, 256, 0.8))
    assert pick(model, 256, 0.0, cands)[0] == Setting("autoregressive")  # nothing accepted: speculation costs
    # the prediction uses the exact expected acceptance
    s = Setting("replay", 3, 2)
    t = model.step_ms("replay", 16, s.tokens)
    assert model.tokens_per_s(s, 16, 0.6) == pytest.approx(1000 * 16 * (1 + expected_accepted(0.6, draft_len=3,
                                                                                               num_drafts=2)) / t)


def test_settings_that_do_not_fit_are_never_picked():
    model = CostModel(dict(TRUE))
    cands = candidates(sorted(TRUE), [4], [1])
    s, _ = pick(model, 1, 0.9, cands, fits=lambda st, B: st.strategy != "replay")
    assert s.strategy != "replay"
    with pytest.raises(ValueError, match="no candidate setting fits"):
        pick(model, 1, 0.9, cands, fits=lambda st, B: False)


def test_policy_cli_reads_a_saved_fit(tmp_path, capsys):
    path = tmp_path / "cost_model.json"
    fit(_points()).save(path)
    assert main(["--fit", str(path), "--batch", "1", "256", "--alpha", "0.8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("batch 1: replay S=") and "batch 256:" in out and "tokens/s predicted" in out
    assert main(["--fit", str(tmp_path / "missing.json"), "--batch", "1", "--alpha", "0.8"]) == 2
    assert "python -m ssmspec run experiment=cost_model" in capsys.readouterr().out
