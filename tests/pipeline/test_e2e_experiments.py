"""The end-to-end experiments of bench/e2e.py and bench/e2e_concurrency.py run on CPU through the engine (tiny
presets, eager) and draw their figures: the oracle's stated acceptance is what the engine's reports see, tokens/s
comes from the accepted counts, points that cannot fit are skipped rows, and the concurrency search finds the
plan's limit exactly and reports a real out-of-memory error as a row."""
from __future__ import annotations

import pytest
import torch
from pipeline_helpers import run_rows

from ssmspec.bench import e2e_concurrency
from ssmspec.bench.e2e import expected_accepted
from ssmspec.bench.e2e_concurrency import Budget
from ssmspec.models import build_model, load_preset
from ssmspec.plots.e2e import fig8_ratios, fig11_ratios
from ssmspec.strategies import SpecConfig

FIG8 = ["experiment=replay_fig8_throughput", "profile=cpu", "bench.warmup=0", "bench.iters=2", "bench.batch=[2]",
        "bench.prompt_len=6", "bench.trained=null"]  # the trained pair's rows: test_acc_e2e_rows.py
FIG11 = ["experiment=replay_fig11_concurrency", "profile=cpu", "bench.presets=[tiny-mamba2]", "bench.budget_mib=2",
         "bench.probe_steps=1"]


def test_expected_accepted_is_the_truncated_geometric_mean():
    assert expected_accepted(1.0, 4) == 4.0 and expected_accepted(0.0, 3) == 0.0
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)


def test_fig8_oracle_at_alpha_one_accepts_every_draft_and_counts_the_tokens(cli, tmp_path):
    rows = run_rows(cli, tmp_path, FIG8, "bench.alpha=1.0", "bench.batch=[2,1000000000]", "bench.presets=[tiny-hybrid]")
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["line"] for r in ok} == {"autoregressive", "replay", "snapshot spec S=4", "replay spec S=3",
                                       "replay spec S=4", "draft autoregressive", "replay spec S=3 + draft",
                                       "replay spec S=4 + draft"}  # bench.drafts: tiny-hybrid -> tiny-mamba2
    for r in ok:
        drafting = r["line"].endswith("+ draft")
        assert (r.get("draft") == "tiny-mamba2") == (drafting or r["line"] == "draft autoregressive")
        if drafting:  # the draft model's cost at the oracle's acceptance (drafting/costed.py)
            assert r["draft_calls"] == r["S"] and len(r["draft_samples_ms"]) == 2 and 0 < r["draft_ms"] < r["ms_p50"]
            assert r["draft_call_ms"] == pytest.approx(r["draft_ms"] / r["S"]) and r["draft_vs_ar"] > 0
            assert r["drafter"] == "oracle + draft_model cost" and r["draft_cache_bytes"] > 0
        else:
            assert "draft_ms" not in r
        S = r["S"]
        assert r["batch"] == 2 and r["draft_len"] == S and r["timing"] == "eager" and len(r["samples_ms"]) == 2
        # every draft is the target's own next token: the engine accepts all S, the run stays on the reference
        assert r["mean_accepted"] == S and r["accepted_hist"] == {str(S): 4}
        assert r["tokens_per_step"] == S + 1 and r["tokens_emitted"] == 4 * (S + 1)
        assert r["tokens_per_s"] == pytest.approx(r["tokens_emitted"] / (sum(r["samples_ms"]) * 1e-3))
        # the decode line's ring and the spec lines' ring are set apart (bench.R, bench.spec_R)
        assert r["R"] == ((32 if S else 16) if r["strategy"] == "replay" else None)
        assert r["strategy"] != "replay" or r["buffer_size"] == r["R"]  # the engine ran with the row's ring
        if S:
            assert r["acceptance"] == "oracle" and r["alpha"] == 1.0 and r["ref_match"] == 1.0
            assert r["expected_accepted"] == S
            # designed = measured when every draft is accepted (bench/designed.py)
            assert r["tokens_per_s_designed"] == pytest.approx(r["tokens_per_s"]) and r["accepted_gap"] == 0.0
            assert r["accepted_within"] is True and r["sequence_steps"] == 4
        else:
            assert r["acceptance"] == "none" and r["alpha"] is None
            assert r["tokens_per_s_designed"] == r["tokens_per_s"] and r["accepted_within"] is None
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert len(skipped) == 8 and all(r["batch"] == 1000000000 and "free" in r["reason"] for r in skipped)
    ratios = fig8_ratios(__import__("pandas").DataFrame(ok), "tiny-hybrid")
    assert ratios[("autoregressive", 2)] == 1.0


def test_fig8_oracle_at_alpha_zero_is_never_accepted(cli, tmp_path):
    rows = run_rows(cli, tmp_path, FIG8, "bench.alpha=0.0", "bench.snapshot_S=[]", "bench.replay_S=[2]",
                "bench.presets=[tiny-mamba2]", plot=False)
    spec = [r for r in rows if r["S"]]
    assert [r["line"] for r in spec] == ["replay spec S=2"]
    assert spec[0]["mean_accepted"] == 0 and spec[0]["tokens_per_step"] == 1 and spec[0]["ref_match"] == 1.0


def test_fig8_refuses_a_buffer_smaller_than_a_call(cli, tmp_path):
    status, _, err = cli("run", *FIG8, "bench.spec_R=4", f"results_dir={tmp_path / 'run'}")
    assert status == 2 and "raise bench.spec_R" in err
    assert not (tmp_path / "run").exists()


def test_fig11_finds_the_plan_limit_exactly(cli, tmp_path):
    rows = run_rows(cli, tmp_path, FIG11)
    best = {r["strategy"]: r for r in rows if r["kind"] == "max_batch"}
    assert set(best) == {"autoregressive", "snapshot", "replay"}
    probes = [r for r in rows if r["kind"] == "probe"]
    assert len(probes) == 3 and all(p["status"] == "ok" for p in probes)  # the plan's limit ran for real
    model = build_model(load_preset("tiny-mamba2"), seed=0, device="cpu", dtype=torch.float32)
    for strategy, r in best.items():
        assert r["limit"] == "plan" and r["real_probes"] == 1 and r["max_batch"] > 1
        bud = Budget(model, budget=r["budget_bytes"], context=r["context"], new_tokens=r["new_tokens"], graph=False,
                     probe_steps=1, seed=0)
        spec = SpecConfig(draft_len=r["S"], buffer_size=16)
        assert r["weights_bytes"] == bud.weights
        assert r["planned_bytes"] == bud.planned(strategy, spec, r["max_batch"]) <= r["budget_bytes"]
        assert bud.planned(strategy, spec, r["max_batch"] + 1) > r["budget_bytes"]
    assert best["snapshot"]["max_batch"] < best["replay"]["max_batch"] < best["autoregressive"]["max_batch"]
    assert fig11_ratios(__import__("pandas").DataFrame(list(best.values())))["tiny-mamba2"] == pytest.approx(
        best["replay"]["max_batch"] / best["snapshot"]["max_batch"])


def test_fig11_reports_a_real_out_of_memory_error_and_searches_below_it(cli, tmp_path, monkeypatch):
    real = Budget.run_engine

    def tight(self, strategy, spec, batch):  # a device whose real limit (20 sequences) is below the plan's
        if batch > 20:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real(self, strategy, spec, batch)

    monkeypatch.setattr(e2e_concurrency.Budget, "run_engine", tight)
    rows = run_rows(cli, tmp_path, FIG11, "bench.strategies=[autoregressive]")
    best = [r for r in rows if r["kind"] == "max_batch"]
    assert len(best) == 1 and best[0]["max_batch"] == 20 and best[0]["limit"] == "oom"
    probes = [r for r in rows if r["kind"] == "probe"]
    ooms = [p for p in probes if p["status"] == "oom"]
    assert ooms and all(p["batch"] > 20 and "out of memory" in p["reason"] for p in ooms)
    assert min(p["batch"] for p in ooms) == 21 and max(p["batch"] for p in probes if p["status"] == "ok") == 20


def test_fig11_refuses_a_budget_below_the_weights(cli, tmp_path):
    status, _, err = cli("run", *FIG11, "bench.budget_mib=0.05",
                         f"results_dir={tmp_path / 'run'}")
    assert status == 2 and "raise bench.budget_mib" in err


def test_fig8_oracle_at_alpha_half_gives_the_stated_mean_acceptance(cli, tmp_path):
    rows = run_rows(cli, tmp_path, FIG8, "bench.alpha=0.5", "bench.snapshot_S=[]", "bench.replay_S=[2]",
                "bench.presets=[tiny-mamba2]", "bench.batch=[16]", "bench.iters=10", plot=False)
    r = next(r for r in rows if r["S"] == 2)
    n = sum(r["accepted_hist"].values())
    assert n == 160 and set(r["accepted_hist"]) == {"0", "1", "2"} and r["ref_match"] == 1.0
    # truncated geometric, P(a >= k) = 0.5^k: mean 0.75, sd 0.83 per step; 160 steps -> 4 standard errors 0.26
    assert abs(r["mean_accepted"] - expected_accepted(0.5, 2)) < 0.26
    assert abs(r["accepted_hist"]["0"] / n - 0.5) < 4 * (0.25 / n) ** 0.5


def test_fig8_forced_and_compared_oracles_agree_where_the_reference_holds(cli, tmp_path):
    """On fp32 CPU the target follows its reference, so the forced oracle (the default) and token comparison
    see the same accepted counts; an unknown mode is refused before anything runs."""
    hists = {}
    for mode in ("forced", "compare"):
        rows = run_rows(cli, tmp_path / mode, FIG8, f"bench.oracle={mode}", "bench.alpha=0.6", "bench.snapshot_S=[]",
                    "bench.replay_S=[3]", "bench.presets=[tiny-mamba2]", "bench.batch=[4]", plot=False)
        r = next(r for r in rows if r["S"] == 3)
        assert r["oracle"] == mode and r["ref_match"] == 1.0
        hists[mode] = r["accepted_hist"]
    assert hists["forced"] == hists["compare"]
    out = tmp_path / "bad"
    status, _, err = cli("run", *FIG8, "bench.oracle=always", f"results_dir={out}")
    assert status == 2 and "bench.oracle must be forced or compare" in err and not out.exists()
