"""cost_model (bench/cost_model.py) on CPU: the grid is measured twice (fit / eval), the fit rows feed the
policy, its pick per batch is scored on the evaluation run, and `ssmspec policy` reads the run's rows."""
from __future__ import annotations

import json

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["experiment=cost_model", "profile=cpu", "bench.warmup=0", "bench.iters=2", "bench.prompt_len=4",
         "bench.strategies=[replay]", "bench.S=[2]", "bench.batch=[1,2]", "bench.eval_batch=[3]",
         "bench.min_sequence_steps=4"]


def test_fit_policy_and_scores(cli, tmp_path):
    out = tmp_path / "run"
    status, _, err = cli("run", *SMALL, f"results_dir={out}")
    assert status == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    meas = [r for r in rows if r["kind"] == "measure"]
    spec = [r for r in meas if r["S"]]
    settings = ("autoregressive", "replay S=2 D=1")
    assert {(r["phase"], r["batch"], r["setting"]) for r in meas} == {
        *((p, b, s) for p in ("fit", "eval") for b in (1, 2) for s in settings), *(("eval", 3, s) for s in settings)}
    assert all(r["status"] == "ok" for r in meas)
    # at least min_sequence_steps sequence-steps a point: 4 steps at batch 1, 2 (bench.iters) at batch 2 and 3
    assert {(r["batch"], r["n"]) for r in meas} == {(1, 4), (2, 2), (3, 2)}
    for r in spec:
        assert r["tokens_per_s_at_alpha"] == pytest.approx(1000 * r["batch"] * (1 + r["expected_accepted"]) / r["ms_p50"])
    assert all(r["acceptance"] == "oracle" and r["oracle"] == "forced" and r["alpha"] == 0.7 for r in spec)
    assert {r["seed"] for r in meas if r["phase"] == "fit"} == {0} and {r["seed"] for r in meas if r["phase"] == "eval"} == {1}
    fits = {r["strategy"]: r for r in rows if r["kind"] == "fit"}
    assert set(fits) == {"autoregressive", "replay"}
    assert all(min(r[t] for t in ("a", "a_L", "b", "c", "d", "e")) >= 0 for r in fits.values())
    pol = {r["batch"]: r for r in rows if r["kind"] == "policy"}
    assert set(pol) == {1, 2, 3} and [pol[b]["fitted_batch"] for b in (1, 2, 3)] == [True, True, False]
    for B, r in pol.items():
        ev = {m["setting"]: m["tokens_per_s"] for m in meas if m["phase"] == "eval" and m["batch"] == B}
        assert r["tokens_per_s"] == ev[r["setting"]] and r["best_tokens_per_s"] == max(ev.values())
        assert r["ratio_to_best"] == pytest.approx(r["tokens_per_s"] / max(ev.values()))
        assert r["model_only_setting"] in ev and 0 < r["ratio_to_best_at_alpha"] <= 1
    rng = {r["setting"]: r for r in rows if r["kind"] == "range"}
    assert set(rng) == {"autoregressive", "replay S=2 D=1", "policy"}
    assert sum(r["best_single_fixed"] for r in rng.values()) == 1
    status, text, _ = cli("policy", "--fit", str(out / "results.jsonl"), "--batch", "1", "64", "--alpha", "0.7")
    assert status == 0 and "batch 1: " in text and "batch 64: " in text
    png = tmp_path / "fig.png"
    status, _, err = cli("plot", "cost_model", "--from", str(out), "--out", str(png))
    assert status == 0, err
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("override, message", [("bench.strategies=[autoregressive]", "holds speculative strategies"),
                                               ("bench.batch=[4]", "at least 2 sizes"),
                                               ("bench.alpha=1.5", "in [0, 1]"),
                                               ("bench.eval_batch=[0]", "bench.eval_batch holds batch sizes"),
                                               ("bench.min_sequence_steps=-1", "bench.min_sequence_steps must be a finite number >= 0")])
def test_bad_settings_are_refused_before_running(cli, tmp_path, override, message):
    out = tmp_path / "run"
    status, _, err = cli("run", *SMALL, override, f"results_dir={out}")
    assert status == 2 and message in err, err
    assert not out.exists()
