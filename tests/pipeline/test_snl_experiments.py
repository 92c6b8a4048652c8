"""The Snakes and Ladders step-time experiments (bench/steps_snl.py: Tables 2, 3, 4) run end to end on CPU
through the engine -- tiny presets, eager steps -- and draw their figures; bad grids are refused before a
model is built, leaving no run directory."""
from __future__ import annotations


import pytest

from pipeline_helpers import FAST, run_and_plot


def _check_timed(r: dict, ar: dict) -> None:
    """An engine row: raw samples, ordered percentiles, eager timing, the overhead a ratio of two medians of
    this run."""
    assert r["status"] == "ok" and r["timing"] == "eager" and len(r["samples_ms"]) == 2
    assert r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
    assert r["ar_ms_p50"] == ar["ms_p50"] and r["overhead"] == pytest.approx(r["ms_p50"] / ar["ms_p50"])
    assert r["cache_bytes"] > 0 and r["weights_bytes"] > 0 and r["peak_allocated_bytes"] is None  # CPU: no peak
    assert r["acceptance"] == ("none" if r["strategy"] == "autoregressive" else "random-drafts")
    assert sum(r["accepted_hist"].values()) == 2 * r["batch"]  # every timed step's accepted count is kept


def test_snl_tab2_ablation_runs_every_scan_and_copy(cli, tmp_path):
    rows = run_and_plot(cli, tmp_path, "snl_tab2_ablation", "bench.S=3")
    ar = next(r for r in rows if r["strategy"] == "autoregressive")
    ja = [r for r in rows if r["strategy"] == "joint_attainment"]
    assert len(rows) == 7 and {(r["scan"], r["jit_copy"]) for r in ja} == {
        (s, j) for s in ("chunk", "loop", "fused") for j in (False, True)}
    for r in ja:
        _check_timed(r, ar)
        assert (r["num_drafts"], r["draft_len"], r["tokens_per_call"]) == (2, 3, 3 * 2 * 4)  # D+1 rows x 2(1+S)
    paper = {r["paper_row"]: (r["scan"], r["jit_copy"]) for r in ja if r["paper_row"]}
    assert paper == {"Joint attainment": ("chunk", False), "+ Fused-SSU": ("fused", False),
                     "+ JIT-state-copy": ("chunk", True), "+ both": ("fused", True)}


def test_snl_tab3_verify_runs_the_drafts_by_S_grid(cli, tmp_path):
    rows = run_and_plot(cli, tmp_path, "snl_tab3_verify", "bench.drafts=[1,2]", "bench.S=[1,3]")
    ar = [r for r in rows if r["strategy"] == "autoregressive"]
    assert len(ar) == 1 and ar[0]["overhead"] == 1.0 and ar[0]["tokens_per_call"] == 1
    spec = [r for r in rows if r["strategy"] != "autoregressive"]
    assert sorted((r["strategy"], r["num_drafts"], r["draft_len"]) for r in spec) == sorted(
        (s, d, k) for s in ("activation_replay", "joint_attainment") for d in (1, 2) for k in (1, 3))
    for r in spec:
        _check_timed(r, ar[0])
        per_row = 1 + r["draft_len"] if r["strategy"] == "activation_replay" else 2 * (1 + r["draft_len"])
        rows_per_seq = r["num_drafts"] + (r["strategy"] == "joint_attainment")
        assert r["tokens_per_call"] == rows_per_seq * per_row


def test_snl_tab4_scaling_runs_per_model_with_memory(cli, tmp_path):
    rows = run_and_plot(cli, tmp_path, "snl_tab4_scaling", "bench.S=2")
    by_model: dict = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[r["strategy"]] = r
    assert set(by_model) == {"tiny-mamba2", "tiny-hybrid"}
    for strategies in by_model.values():
        assert set(strategies) == {"autoregressive", "activation_replay", "joint_attainment"}
        ar = strategies["autoregressive"]
        for name in ("activation_replay", "joint_attainment"):
            _check_timed(strategies[name], ar)
            assert strategies[name]["cache_bytes"] > ar["cache_bytes"]  # speculation keeps more than one state
        assert len({r["weights_bytes"] for r in strategies.values()}) == 1  # one model per preset
    assert by_model["tiny-hybrid"]["autoregressive"]["params"] > by_model["tiny-mamba2"]["autoregressive"]["params"]


@pytest.mark.parametrize("exp_id, extra, message", [
    pytest.param("snl_tab2_ablation", ["bench.scans=[fused,ssu]"], "bench.scans takes fused, chunk, loop, got",
                 id="tab2-unknown-scan"),
    pytest.param("snl_tab3_verify", ["bench.strategies=[snapshot]"],
                 "bench.strategies takes activation_replay, joint_attainment, got ['snapshot']", id="tab3-strategy"),
    pytest.param("snl_tab3_verify", ["bench.S=[]"], "bench.S needs integers >= 1, got []", id="tab3-empty-S"),
    pytest.param("snl_tab4_scaling", ["bench.batch=100000000"], "lower bench.batch", id="tab4-does-not-fit"),
])
def test_bad_grids_are_refused_before_measuring(cli, tmp_path, exp_id, extra, message):
    out = tmp_path / "run"
    status, _, err = cli("run", f"experiment={exp_id}", *FAST, *extra, f"results_dir={out}")
    assert status == 2 and message in err
    assert not out.exists()
