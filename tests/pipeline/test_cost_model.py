"""cost_model (bench/cost_model.py, bench/cost_model_scoring.py) on CPU: the grid is measured at the fit's batches
and, once per evaluation seed, at held-out batches only; the policy and two baselines pick from the fit alone and
are scored against the fastest setting of each evaluation measurement; `ssmspec policy` reads the run's rows and
prints the policy's picks. The baselines and the miss rule are checked on hand-made tables whose answers are
known."""
from __future__ import annotations

import json
import math

import pytest

from ssmspec.bench.cost_model_scoring import (CHOOSERS, GOAL_AT_BATCH, best_fixed, compare, heldout_rows,
                                              nearest_fitted, nearest_pick, verdict)
from ssmspec.drafting.oracle import expected_accepted
from ssmspec.policy import TERMS, CostModel

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["experiment=cost_model", "profile=cpu", "bench.warmup=0", "bench.iters=2", "bench.prompt_len=4",
         "bench.strategies=[replay]", "bench.S=[2]", "bench.D=[2]",
         "bench.single_draft=[]", "bench.fit_batch=[1,2]", "bench.heldout_batch=[3]",
         "bench.eval_seeds=[1,2]", "bench.min_sequence_steps=4",
         "bench.trained=null"]  # the trained pair's rows: test_acc_e2e_rows.py


def _small(*overrides: str) -> list[str]:
    """SMALL with ``overrides`` in place of its own values of the same keys."""
    keys = {o.partition("=")[0] for o in overrides}
    return [o for o in SMALL if o.partition("=")[0] not in keys] + list(overrides)


def _geomean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v))


def test_fit_then_three_choosers_scored_on_held_out_batches(cli, tmp_path):
    out = tmp_path / "run"
    status, _, err = cli("run", *SMALL, f"results_dir={out}")
    assert status == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    meas = [r for r in rows if r["kind"] == "measure"]
    settings = ("autoregressive", "replay S=2 D=2")
    # the fit's batches at the fit seed; the held-out batch only, once per evaluation seed
    assert {(r["phase"], r["seed"], r["batch"], r["setting"]) for r in meas} == {
        *(("fit", 0, b, s) for b in (1, 2) for s in settings), *(("eval", k, 3, s) for k in (1, 2) for s in settings)}
    assert all(r["status"] == "ok" and r["point_wall_s"] > 0 for r in meas)
    # at least min_sequence_steps sequence-steps a point: 4 steps at batch 1, 2 (bench.iters) at batch 2 and 3
    assert {(r["batch"], r["n"]) for r in meas} == {(1, 4), (2, 2), (3, 2)}
    for r in (r for r in meas if r["S"]):
        expect = 1000 * r["batch"] * (1 + r["expected_accepted"]) / r["ms_p50"]
        assert r["tokens_per_s_at_alpha"] == pytest.approx(expect)
        assert r["acceptance"] == "oracle" and r["oracle"] == "forced" and r["alpha"] == 0.7
        # the designed columns take the best of D chains' law, as expected_accepted does (not one chain's)
        assert r["expected_accepted"] == pytest.approx(expected_accepted(0.7, draft_len=2, num_drafts=2))
        assert r["tokens_per_s_designed"] == pytest.approx(
            r["sequence_steps"] * (1 + r["expected_accepted"]) / (sum(r["samples_ms"]) * 1e-3))
        assert r["accepted_gap"] == pytest.approx(r["mean_accepted"] / r["expected_accepted"] - 1)
    fits = {r["strategy"]: r for r in rows if r["kind"] == "fit"}
    assert set(fits) == {"autoregressive", "replay"}
    assert all(min(r[t] for t in ("a", "a_L", "b", "c", "d", "e")) >= 0 for r in fits.values())
    # `ssmspec policy --fit <results.jsonl>` refits the run's measured steps: the same model as its fit rows
    refit = CostModel.load(out / "results.jsonl")
    for st, r in fits.items():
        assert {k: refit.coef[st][k] for k in (*TERMS, "N0")} == {k: r[k] for k in (*TERMS, "N0")}, st
        assert refit.residual[st] == r["residual"]

    (split,) = [r for r in rows if r["kind"] == "split"]
    assert (split["fit_batches"], split["heldout_batches"], split["fit_seed"], split["eval_seeds"]) == ([1, 2], [3], 0,
                                                                                                       [1, 2])
    assert split["settings"] == list(settings) and split["measure_wall_s"] > 0
    fit_t = {b: {r["setting"]: r["tokens_per_s"] for r in meas if r["phase"] == "fit" and r["batch"] == b}
             for b in (1, 2)}
    fixed = max(settings, key=lambda s: _geomean([t[s] / max(t.values()) for t in fit_t.values()]))
    assert split["best_fixed_setting"] == fixed
    scored = [r for r in rows if r["kind"] in ("policy", "baseline")]
    assert sorted((r["seed"], r["chooser"]) for r in scored) == sorted((k, c) for k in (1, 2) for c in CHOOSERS)
    for r in scored:
        assert r["batch"] == 3 and r["fit_batches"] == [1, 2] and r["heldout_batches"] == [3]
        assert r["kind"] == ("policy" if r["chooser"] == "policy" else "baseline")
        ev = {m["setting"]: m["tokens_per_s"] for m in meas if m["phase"] == "eval" and m["seed"] == r["seed"]}
        assert r["tokens_per_s"] == ev[r["setting"]] and r["best_tokens_per_s"] == max(ev.values())
        assert r["score"] == pytest.approx(ev[r["setting"]] / max(ev.values()))
        if r["chooser"] == "best_fixed":
            assert r["setting"] == fixed
        if r["chooser"] == "nearest_fitted":  # 3 is nearer 2 than 1 in log batch
            assert r["nearest_fitted_batch"] == 2 and r["setting"] == max(fit_t[2], key=fit_t[2].get)
        if r["chooser"] == "policy":
            assert r["model_only_setting"] in ev and 0 < r["score_at_alpha"] <= 1
    summ = {r["chooser"]: r for r in rows if r["kind"] == "batch_summary"}
    rng = {r["chooser"]: r for r in rows if r["kind"] == "range"}
    assert set(summ) == set(rng) == set(CHOOSERS)
    for name in CHOOSERS:
        s = [r["score"] for r in sorted(scored, key=lambda r: r["seed"]) if r["chooser"] == name]
        assert summ[name]["score_mean"] == pytest.approx(sum(s) / 2) and summ[name]["verdict"] == verdict(s)
        assert rng[name]["geomean_score"] == pytest.approx(_geomean(s)) and rng[name]["worst_batch"] == 3
    assert rng["policy"]["vs_nearest_fitted"] in ("better", "worse", "same within noise")
    assert isinstance(rng["policy"]["beats_best_fixed"], bool)

    # the command line refits from the same rows and prints the policy rows' pick
    status, text, _ = cli("policy", "--fit", str(out / "results.jsonl"), "--batch", "3", "--alpha", "0.7")
    (pol,) = {r["setting"] for r in scored if r["chooser"] == "policy"}
    assert status == 0 and text.startswith(f"batch 3: {pol} (")
    png = tmp_path / "fig.png"
    status, _, err = cli("plot", "cost_model", "--from", str(out), "--out", str(png))
    assert status == 0, err
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_rows_of_the_old_format_are_refused_by_the_plot_with_the_rerun_command(cli, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    row = dict(experiment="cost_model", profile="gpu", model="m", kind="policy", batch=32, fitted_batch=False,
               setting="replay S=4 D=1", ratio_to_best=1.0, status="ok")
    (old / "results.jsonl").write_text(json.dumps(row) + "\n")
    status, _, err = cli("plot", "cost_model", "--from", str(old), "--out", str(tmp_path / "fig.png"))
    assert status == 2 and "predate held-out scoring" in err
    assert "python -m ssmspec run experiment=cost_model profile=gpu --save-reference" in err


def test_a_held_out_batch_that_was_fitted_is_refused(cli, tmp_path):
    out = tmp_path / "run"
    status, _, err = cli("run", *_small("bench.heldout_batch=[2,3]"), f"results_dir={out}")
    assert status == 2, err
    assert "bench.heldout_batch [2, 3] holds fitted batches [2] (bench.fit_batch [1, 2])" in err
    assert "drop [2] from one of the two lists" in err
    assert not out.exists()


@pytest.mark.parametrize("override, message", [
    ("bench.strategies=[autoregressive]", "bench.strategies holds speculative strategies"),
    ("bench.single_draft=[snapshot]", "bench.single_draft names strategies of bench.strategies (['replay'])"),
    ("bench.S=[]", "bench.S and bench.D need values >= 1"),
    ("bench.fit_batch=[4]", "bench.fit_batch needs at least 2 distinct batch sizes"),
    ("bench.heldout_batch=[]", "bench.heldout_batch needs at least 1 distinct batch sizes"),
    ("bench.eval_seeds=[1]", "bench.eval_seeds needs at least 2 distinct seeds"),
    ("bench.eval_seeds=[0,1]", "other than bench.fit_seed (0)"),
    ("bench.alpha=1.5", "in [0, 1]"),
    ("bench.min_sequence_steps=-1", "bench.min_sequence_steps must be a finite number >= 0")])
def test_bad_settings_are_refused_before_running(cli, tmp_path, override, message):
    out = tmp_path / "run"
    status, _, err = cli("run", *_small(override), f"results_dir={out}")
    assert status == 2 and message in err, err
    assert not out.exists()


# hand-made tables ------------------------------------------------------------------------------------------
FIT = {1: {"A": 100.0, "B": 90.0, "C": 50.0},  # ratios to best: A 1, B 0.9, C 0.5
       4: {"A": 300.0, "B": 330.0, "C": 200.0},  # A 0.909, B 1, C 0.606
       16: {"A": 800.0, "B": 1000.0, "C": 900.0}}  # A 0.8, B 1, C 0.9 -> geomeans A 0.899, B 0.965, C 0.648


def test_nearest_fitted_batch_is_nearest_in_log_batch_and_ties_go_to_the_smaller():
    fitted = [1, 4, 16, 64]
    assert [nearest_fitted(b, fitted) for b in (2, 8, 32)] == [1, 4, 16]  # geometric midpoints: the smaller
    assert [nearest_fitted(b, fitted) for b in (3, 12, 24, 48, 96, 1000)] == [4, 16, 16, 64, 64, 64]
    assert nearest_pick(2, FIT, {"A", "B", "C"}) == ("A", 1)
    assert nearest_pick(8, FIT, {"A", "B", "C"}) == ("B", 4)
    assert nearest_pick(12, FIT, {"A", "B", "C"}) == ("B", 16)
    assert nearest_pick(12, FIT, {"A", "C"}) == ("C", 16)  # B does not run at 12: the best of what does
    assert nearest_pick(2, {1: {"A": 1.0}, 4: {"B": 1.0}}, {"B"}) == ("B", 4)  # none measured at 1: next nearest


def test_best_fixed_has_the_best_geometric_mean_over_the_fitted_batches():
    label, gm = best_fixed(FIT)
    assert label == "B" and gm == pytest.approx((0.9 * 1 * 1) ** (1 / 3))
    assert best_fixed(FIT, allowed={"A", "C"}) == ("A", pytest.approx((1 * 300 / 330 * 0.8) ** (1 / 3)))
    gappy = {**FIT, 64: {"A": 2000.0, "C": 2100.0}}  # B not measured at 64: it cannot be one setting for all
    assert best_fixed(gappy)[0] == "A"
    with pytest.raises(ValueError, match="no setting ran at every fitted batch"):
        best_fixed(FIT, allowed={"D"})


def test_held_out_rows_score_each_chooser_against_the_fastest_setting_of_each_seed():
    evals = {(2, 1): {"A": 200.0, "B": 190.0, "C": 100.0}, (2, 2): {"A": 180.0, "B": 200.0, "C": 90.0},
             (8, 1): {"A": 500.0, "B": 600.0, "C": 450.0}, (8, 2): {"A": 520.0, "B": 580.0, "C": 440.0}}
    rows = heldout_rows(fit=FIT, evals=evals, policy=lambda B, ok: ("C" if B == 2 else "B", {}),
                        common=dict(model="m"))
    split = rows[0]
    assert split["kind"] == "split" and split["fit_batches"] == [1, 4, 16] and split["heldout_batches"] == [2, 8]
    assert split["eval_seeds"] == [1, 2] and split["best_fixed_setting"] == "B"
    got = {(r["chooser"], r["batch"], r["seed"]): (r["setting"], r["score"]) for r in rows
           if r["kind"] in ("policy", "baseline")}
    assert got == {
        ("policy", 2, 1): ("C", 0.5), ("policy", 2, 2): ("C", 0.45), ("policy", 8, 1): ("B", 1.0),
        ("policy", 8, 2): ("B", 1.0),
        ("best_fixed", 2, 1): ("B", 0.95), ("best_fixed", 2, 2): ("B", 1.0), ("best_fixed", 8, 1): ("B", 1.0),
        ("best_fixed", 8, 2): ("B", 1.0),
        # 2: tie between 1 and 4 -> 1, where A was fastest; 8: tie between 4 and 16 -> 4, where B was
        ("nearest_fitted", 2, 1): ("A", 1.0), ("nearest_fitted", 2, 2): ("A", 0.9),
        ("nearest_fitted", 8, 1): ("B", 1.0), ("nearest_fitted", 8, 2): ("B", 1.0)}
    assert all(r["model"] == "m" and r["fit_batches"] == [1, 4, 16] for r in rows)
    summ = {(r["chooser"], r["batch"]): r for r in rows if r["kind"] == "batch_summary"}
    assert summ[("policy", 2)]["score_mean"] == pytest.approx(0.475) and summ[("policy", 2)]["verdict"] == "miss"
    assert summ[("best_fixed", 2)]["score_sd"] == pytest.approx(math.sqrt(2) * 0.025)
    assert summ[("best_fixed", 2)]["verdict"] == "met"  # mean 0.975
    assert summ[("nearest_fitted", 2)]["verdict"] == "within noise"  # mean 0.95, one seed's 1.0 within 2 se
    rng = {r["chooser"]: r for r in rows if r["kind"] == "range"}
    assert rng["policy"]["geomean_score"] == pytest.approx(_geomean([0.5, 0.45, 1.0, 1.0]))
    assert rng["policy"]["geomean_by_seed"] == pytest.approx([math.sqrt(0.5), math.sqrt(0.45)])
    assert (rng["policy"]["worst_batch"], rng["policy"]["misses"]) == (2, [2])
    assert rng["nearest_fitted"]["within_noise"] == [2] and rng["best_fixed"]["setting"] == "B"
    assert rng["policy"]["vs_best_fixed"] == "worse" and rng["policy"]["beats_best_fixed"] is False
    assert rng["policy"]["meets_goal"] is False and "meets_goal" not in rng["best_fixed"]
    assert rng["policy"]["ratio_to_best_fixed"] == pytest.approx(
        math.sqrt(math.sqrt(0.5 / 0.95) * math.sqrt(0.45 / 1.0)))
    with pytest.raises(ValueError, match=r"held-out batches \[4\] are fitted batches"):
        heldout_rows(fit=FIT, evals={(4, 1): FIT[4], (4, 2): FIT[4]}, policy=lambda B, ok: ("A", {}))


def test_miss_and_comparison_rules_weigh_the_spread_over_seeds():
    assert verdict([1.0, 0.99, 0.97]) == "met"
    assert verdict([0.96, 0.96, 0.96]) == "miss"  # below the goal in every seed, no spread
    assert verdict([0.99, 0.93]) == "within noise"  # mean 0.96, se 0.03: the goal is within 2 se
    assert verdict([0.90, 0.92, 0.91]) == "miss"
    assert GOAL_AT_BATCH == 0.97
    assert compare([0.99, 0.98, 0.99], [0.99, 0.98, 0.99]) == ("same within noise", 1.0)
    assert compare([1.0, 1.0, 1.0], [0.95, 0.96, 0.95])[0] == "better"
    assert compare([0.95, 0.96, 0.95], [1.0, 1.0, 1.0])[0] == "worse"
    assert compare([1.0, 0.9], [0.9, 1.0])[0] == "same within noise"


def test_the_readme_policy_command_prints_the_committed_picks(cli):
    """README: `ssmspec policy --fit results/cost_model/cpu/results.jsonl --batch <held-out> --alpha 0.7` prints
    the picks the committed reference scored for the policy."""
    from ssmspec.paths import RESULTS_DIR, ROOT

    path = RESULTS_DIR / "cost_model" / "cpu" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [r for r in rows if r.get("pair") != "trained"]  # the (acc) rows: test_acc_e2e_rows.py
    (split,) = [r for r in rows if r["kind"] == "split"]
    picks = {r["batch"]: r["setting"] for r in rows if r["kind"] == "policy"}
    status, text, _ = cli("policy", "--fit", str(path), "--batch", *map(str, split["heldout_batches"]),
                          "--alpha", str(split["alpha"]))
    assert status == 0
    for b in split["heldout_batches"]:
        assert f"batch {b}: {picks[b]} (" in text
    readme = (ROOT / "README.md").read_text()
    assert "--batch " + " ".join(map(str, split["heldout_batches"])) + " --alpha 0.7" in readme
