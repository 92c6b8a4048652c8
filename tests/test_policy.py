"""The step-cost model recovers a known cost surface (knee included), its calibration reproduces measured steps
and interpolates between them, and the policy picks the known best setting."""
from __future__ import annotations

import json
import math
import random

import pytest

from ssmspec.drafting.oracle import expected_accepted
from ssmspec.policy import TERMS, CostModel, Setting, candidates, fit, fit_alpha, main, pick, run_rows

# t = a + a_L (L-1) + B (b + c (L-1) + d (D-1)) + e max(0, B L - N0)
TRUE = {"autoregressive": dict(a=2.0, a_L=0.0, b=0.05, c=0.0, d=0.0, e=0.0, N0=None),
        "replay": dict(a=2.2, a_L=0.05, b=0.04, c=0.01, d=0.02, e=0.004, N0=256.0),
        "snapshot": dict(a=2.1, a_L=0.02, b=0.05, c=0.09, d=0.03, e=0.0, N0=None)}
SD = [(2, 1), (4, 1), (2, 2), (4, 2), (6, 1)]


def _true_ms(strategy: str, B: int, S: int, D: int) -> float:
    k, L = TRUE[strategy], 1 + S * D
    knee = math.inf if k["N0"] is None else k["N0"]
    return (k["a"] + k["a_L"] * (L - 1) + B * (k["b"] + k["c"] * (L - 1) + k["d"] * (D - 1))
            + k["e"] * max(0.0, B * L - knee))


def _points(noise: float = 0.0, batches=(1, 4, 16, 64, 128, 256)) -> list[dict]:
    rnd = random.Random(0)
    pts = []
    for st in TRUE:
        for B in batches:
            for S, D in ([(0, 1)] if st == "autoregressive" else SD):
                ms = _true_ms(st, B, S, D) * (1 + noise * rnd.uniform(-1, 1))
                pts.append(dict(strategy=st, batch=B, S=S, D=D, ms=ms))
    return pts


def test_fit_recovers_the_surface_and_its_knee_and_reports_small_residuals():
    model = fit(_points())
    for st, k in TRUE.items():
        got = model.coef[st]
        assert [got[t] for t in TERMS] == pytest.approx([k[t] for t in TERMS], abs=1e-7), st
        assert (got["N0"] is None) == (k["N0"] is None)  # a knee with no slope after it is no knee
        assert got["N0"] is None or got["N0"] == pytest.approx(k["N0"], rel=1e-6)
        assert model.residual[st] < 1e-9
    noisy = fit(_points(noise=0.04))
    assert all(0 < r < 0.04 for r in noisy.residual.values())
    for S, D in SD:  # the noisy surface still predicts the true step within the noise
        for B in (2, 32, 200):
            assert noisy.step_ms(Setting("replay", S, D), B, calibrated=False) == pytest.approx(
                _true_ms("replay", B, S, D), rel=0.06)


def test_the_fit_does_not_depend_on_the_order_of_its_points():
    """The same points in any order give the same model, bit for bit: a run's fit rows and a refit of its rows
    (``CostModel.load``, the command line) read them in different orders."""
    pts = _points(noise=0.04)
    want = fit(pts)
    for seed in range(5):
        shuffled = list(pts)
        random.Random(seed).shuffle(shuffled)
        got = fit(shuffled)
        assert got.coef == want.coef and got.residual == want.residual and got.calibration == want.calibration


def test_a_knee_the_points_cannot_place_is_the_last_measured_call_below_the_gap():
    """One measured B L above the knee: every knee in the gap below it fits the points exactly, each with its own
    e. The fit takes the lowest (64, the last call below the gap), so the cost grows linearly across the gap."""
    a, b, e, knee = 2.0, 0.01, 0.004, 150.0
    true = lambda B: a + b * B + e * max(0.0, B - knee)  # noqa: E731
    pts = [dict(strategy="autoregressive", batch=B, S=0, D=1, ms=true(B)) for B in (1, 4, 16, 64, 256)]
    model = fit(pts)
    got = model.coef["autoregressive"]
    assert got["N0"] == 64.0 and model.residual["autoregressive"] < 1e-9
    assert got["e"] == pytest.approx(e * (256 - knee) / (256 - 64), rel=1e-6)
    ar = Setting("autoregressive")
    for B in (1, 4, 16, 64, 256):
        assert model.step_ms(ar, B, calibrated=False) == pytest.approx(true(B), rel=1e-9)
    mid = true(64) + (true(256) - true(64)) * (128 - 64) / (256 - 64)  # linear across the gap
    assert model.step_ms(ar, 128, calibrated=False) == pytest.approx(mid, rel=1e-9)


def test_tokens_per_call_points_mean_one_chain():
    """Points given as tokens per call (no S, D) are one chain of tokens - 1 drafts."""
    pts = [dict(strategy=p["strategy"], batch=p["batch"], tokens=1 + p["S"], ms=p["ms"]) for p in _points()
           if p["D"] == 1]
    model = fit(pts)
    assert model.step_ms(Setting("replay", 4, 1), 64) == pytest.approx(_true_ms("replay", 64, 4, 1))


def test_calibration_reproduces_measured_steps_and_interpolates_in_log_batch():
    # a surface the model cannot express (a bump at batch 16 for one setting) is met exactly where measured
    pts = _points()
    bump = Setting("replay", 4, 1)
    for p in pts:
        if (p["strategy"], p["S"], p["D"], p["batch"]) == ("replay", 4, 1, 16):
            p["ms"] *= 1.3
    model = fit(pts)
    for p in pts:
        s = Setting(p["strategy"], p["S"], p["D"])
        assert model.step_ms(s, p["batch"]) == pytest.approx(p["ms"], rel=1e-9)
    # between 4 and 16, the log-batch midpoint 8 takes the geometric mean of the two ratios
    r4 = model.step_ms(bump, 4) / model.step_ms(bump, 4, calibrated=False)
    r16 = model.step_ms(bump, 16) / model.step_ms(bump, 16, calibrated=False)
    assert model.step_ms(bump, 8) / model.step_ms(bump, 8, calibrated=False) == pytest.approx(math.sqrt(r4 * r16))
    # outside the measured batches the end ratio holds; an unmeasured setting is the surface alone
    assert model.step_ms(bump, 1024) / model.step_ms(bump, 1024, calibrated=False) == pytest.approx(
        model.step_ms(bump, 256) / model.step_ms(bump, 256, calibrated=False))
    other = Setting("replay", 3, 1)
    assert model.step_ms(other, 64) == model.step_ms(other, 64, calibrated=False)


def test_policy_prefers_long_drafts_at_small_batch_and_standard_decoding_when_drafts_do_not_pay():
    model = fit(_points())
    cands = candidates(sorted(TRUE), [1, 2, 4, 8], [1, 2])
    small, _ = pick(model, 1, 0.8, cands)
    assert small.strategy == "replay" and small.S >= 4  # the step is the weight read: long drafts are nearly free
    big, v = pick(model, 256, 0.8, cands)
    brute = max(cands, key=lambda s: model.tokens_per_s(s, 256, 0.8))
    assert big == brute and v == pytest.approx(model.tokens_per_s(brute, 256, 0.8))
    assert pick(model, 256, 0.0, cands)[0] == Setting("autoregressive")  # nothing accepted: speculation costs
    # the prediction uses the exact expected acceptance
    s = Setting("replay", 3, 2)
    t = model.step_ms(s, 16)
    assert model.tokens_per_s(s, 16, 0.6) == pytest.approx(1000 * 16 * (1 + expected_accepted(0.6, draft_len=3,
                                                                                               num_drafts=2)) / t)


def test_settings_that_do_not_fit_are_never_picked():
    model = fit(_points())
    cands = candidates(sorted(TRUE), [4], [1])
    s, _ = pick(model, 1, 0.9, cands, fits=lambda st, B: st.strategy != "replay")
    assert s.strategy != "replay"
    with pytest.raises(ValueError, match="no candidate setting fits"):
        pick(model, 1, 0.9, cands, fits=lambda st, B: False)


def test_policy_cli_reads_a_saved_fit_and_a_runs_measurements(tmp_path, capsys):
    path = tmp_path / "cost_model.json"
    model = fit(_points())
    model.save(path)
    again = CostModel.load(path)
    assert again.coef == model.coef and again.calibration == model.calibration
    assert main(["--fit", str(path), "--batch", "1", "256", "--alpha", "0.8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("batch 1: replay S=") and "batch 256:" in out and "tokens/s predicted" in out
    assert "replay: a 2.2" in out and "knee N0 256 tokens a call" in out and "autoregressive: " in out
    assert "model only" not in out  # by default the picks are the settings the fit measured
    for B in (1, 256):  # ... the same as pick() over them
        assert f"batch {B}: {pick(model, B, 0.8, model.measured())[0].label} (" in out
    assert main(["--fit", str(path), "--batch", "1", "--alpha", "0.95", "--S", "12"]) == 0
    assert "model only: the fit never ran it" in capsys.readouterr().out  # a widened grid says so
    rows = [dict(kind="measure", phase=ph, status="ok", strategy=p["strategy"], batch=p["batch"], S=p["S"],
                 D=p["D"], ms_p50=p["ms"] * (1.5 if ph == "eval" else 1.0)) for p in _points() for ph in ("fit", "eval")]
    runs = tmp_path / "results.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    refit = CostModel.load(runs)  # only the fit phase's measurements
    assert refit.coef["replay"]["a"] == pytest.approx(TRUE["replay"]["a"])
    assert main(["--fit", str(tmp_path / "missing.json"), "--batch", "1", "--alpha", "0.8"]) == 2
    assert "python -m ssmspec run experiment=cost_model" in capsys.readouterr().out
    runs.write_text(json.dumps(dict(kind="range", setting="policy")) + "\n")
    assert main(["--fit", str(runs), "--batch", "1", "--alpha", "0.8"]) == 2
    assert "no measured steps" in capsys.readouterr().out


def test_labels_parse_back_and_the_command_line_offers_a_setting_only_below_where_it_did_not_fit(tmp_path):
    for s in (Setting("autoregressive"), Setting("replay", 4, 2), Setting("activation_replay", 2, 1)):
        assert Setting.parse(s.label) == s
    rows = [dict(kind="measure", phase="fit", status="ok", strategy=p["strategy"], batch=p["batch"], S=p["S"],
                 D=p["D"], setting=Setting(p["strategy"], p["S"], p["D"]).label, ms_p50=p["ms"]) for p in _points()]
    for r in rows:  # snapshot did not fit in memory from batch 64 on: skipped rows there
        if r["strategy"] == "snapshot" and r["batch"] >= 64:
            r.update(status="skipped", ms_p50=None)
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = CostModel.load(path)
    snap, rep = Setting("snapshot", 2, 1), Setting("replay", 2, 1)
    assert model.limits == {s.label: 64.0 for s in model.measured() if s.strategy == "snapshot"}
    assert model.runs_at(snap, 16) and model.runs_at(snap, 48) and not model.runs_at(snap, 64)
    assert model.runs_at(rep, 1000) and not model.runs_at(Setting("replay", 3, 1), 1)  # never measured
    assert {s.label for s in model.measured()} == set(model.calibration)
    model.save(tmp_path / "m.json")
    assert CostModel.load(tmp_path / "m.json").limits == model.limits


def test_fit_alpha_is_the_maximum_likelihood_alpha_of_single_chains():
    # S = 2: three chains stopped at 0, one at 1, four ran through: 9 accepted drafts, 4 stops -> 9 / 13
    assert fit_alpha([(2, {"0": 3, "1": 1, "2": 4})]) == (pytest.approx(9 / 13), 8)
    rnd = random.Random(0)
    for alpha in (0.3, 0.6, 0.9):  # draws of the truncated geometric law at two S, pooled
        chains = []
        for S in (2, 4):
            hist: dict[int, int] = {}
            for _ in range(20000):
                a = 0
                while a < S and rnd.random() < alpha:
                    a += 1
                hist[a] = hist.get(a, 0) + 1
            chains.append((S, hist))
        assert fit_alpha(chains)[0] == pytest.approx(alpha, abs=0.01)
        est = fit_alpha(chains)[0]  # its law predicts the measured mean of each S
        for S, hist in chains:
            mean = sum(a * n for a, n in hist.items()) / sum(hist.values())
            assert expected_accepted(est, draft_len=S) == pytest.approx(mean, rel=0.03)
    assert fit_alpha([(3, {"3": 5})])[0] == 1.0 and fit_alpha([(3, {"0": 5})])[0] == 0.0
    with pytest.raises(ValueError, match="no measured single-chain steps"):
        fit_alpha([])
    with pytest.raises(ValueError, match="an accepted count of 3 drafts from chains of S = 2"):
        fit_alpha([(2, {"3": 1})])


def test_a_runs_rows_are_read_per_model_and_the_oracle_pair_first(tmp_path):
    rows = [dict(kind="measure", model="tiny", pair="random"), dict(kind="measure", model="target", pair="trained"),
            dict(kind="acceptance", model="target", pair="trained", alpha=0.42)]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["model"] for r in run_rows(path)] == ["tiny"]  # the trained pair's rows only when asked for
    assert [r["kind"] for r in run_rows(path, "target")] == ["measure", "acceptance"]
    with pytest.raises(ValueError, match="no rows of model 'nope'; the run measured target, tiny"):
        run_rows(path, "nope")
    path.write_text("".join(json.dumps({**r, "pair": "random"}) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"several models \(target, tiny\); name one with --model"):
        run_rows(path)
