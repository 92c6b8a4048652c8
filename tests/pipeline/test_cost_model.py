"""cost_model (bench/cost_model.py) on CPU: the grid is measured twice (fit / eval), the fit rows feed the
policy, its pick per batch is scored on the evaluation run, and `ssmspec policy` reads the run's rows."""
from __future__ import annotations

import json

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["experiment=cost_model", "profile=cpu", "bench.warmup=0", "bench.iters=2", "bench.prompt_len=4",
         "bench.strategies=[replay]", "bench.S=[2]", "bench.batch=[1,2]"]


def test_fit_policy_and_scores(cli, tmp_path):
    out = tmp_path / "run"
    status, _, err = cli("run", *SMALL, f"results_dir={out}")
    assert status == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    meas = [r for r in rows if r["kind"] == "measure"]
    assert {(r["phase"], r["batch"], r["setting"]) for r in meas} == {
        (p, b, s) for p in ("fit", "eval") for b in (1, 2) for s in ("autoregressive", "replay S=2 D=1")}
    assert all(r["status"] == "ok" for r in meas)
    spec = [r for r in meas if r["S"]]
    assert all(r["acceptance"] == "oracle" and r["oracle"] == "forced" and r["alpha"] == 0.7 for r in spec)
    assert {r["seed"] for r in meas if r["phase"] == "fit"} == {0} and {r["seed"] for r in meas if r["phase"] == "eval"} == {1}
    fits = {r["strategy"]: r for r in rows if r["kind"] == "fit"}
    assert set(fits) == {"autoregressive", "replay"} and all(min(r["a"], r["b"], r["c"]) >= 0 for r in fits.values())
    pol = {r["batch"]: r for r in rows if r["kind"] == "policy"}
    assert set(pol) == {1, 2}
    for B, r in pol.items():
        ev = {m["setting"]: m["tokens_per_s"] for m in meas if m["phase"] == "eval" and m["batch"] == B}
        assert r["tokens_per_s"] == ev[r["setting"]] and r["best_tokens_per_s"] == max(ev.values())
        assert r["ratio_to_best"] == pytest.approx(r["tokens_per_s"] / max(ev.values()))
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
                                               ("bench.alpha=1.5", "in [0, 1]")])
def test_bad_settings_are_refused_before_running(cli, tmp_path, override, message):
    out = tmp_path / "run"
    status, _, err = cli("run", *SMALL, override, f"results_dir={out}")
    assert status == 2 and message in err, err
    assert not out.exists()
