"""``trained_seeds`` on CPU through the CLI: the tiny pair trained for two seeds (shortened loops, no MTP head, into a
temporary cache), every seed's draft_model chain decodes exactly the autoregressive greedy output, the summary rows
are the law of the seed rows, bad seeds are one error line before anything trains, and the figure is drawn."""
from __future__ import annotations

import logging
import statistics

import pytest
from pipeline_helpers import PNG_MAGIC, rows_of, run_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# two seeds of the tiny run with short loops (~5 s of training each on one core), few prompts and tokens
SHORT = ["experiment=trained_seeds", "profile=cpu", "bench.seeds=[0,1]",
         "bench.train_overrides=['train.steps=20','distill.steps=20','mtp.layers=0']", "bench.num_prompts=4",
         "bench.new_tokens=32"]


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory, one_torch_thread):
    """(rows, run dir, cache dir) of one run of SHORT, shared by the tests of this module."""
    from ssmspec import cli

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out, cache = tmp_path_factory.mktemp("seeds-run"), tmp_path_factory.mktemp("seeds-cache")
    try:
        status = cli.main(["run", *SHORT, f"bench.cache_dir={cache}", f"results_dir={out}"])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert status == 0
    return rows_of(out), out, cache


def _law(rows: list[dict], goal: float) -> None:
    """Every summary row is the mean / sample std / min / max of its seed rows, and counts the seeds at goal."""
    seeds = [r for r in rows if r["kind"] == "seed" and r["status"] == "ok"]
    summary = [r for r in rows if r["kind"] == "summary" and r["status"] == "ok"]
    assert {(r["set"], r["S"]) for r in summary} == {(r["set"], r["S"]) for r in seeds}
    for s in summary:
        vals = [r["mean_accepted"] for r in seeds if (r["set"], r["S"], r["family"]) == (s["set"], s["S"], s["family"])]
        assert s["n_seeds"] == len(vals) == 2 and s["goal"] == goal
        assert s["mean"] == pytest.approx(statistics.fmean(vals))
        assert s["std"] == pytest.approx(statistics.stdev(vals))
        assert (s["min"], s["max"]) == (min(vals), max(vals))
        assert s["seeds_at_goal"] == sum(v >= goal for v in vals)
        assert s["goal_met_all"] is (s["seeds_at_goal"] == len(vals))
        assert s["all_exact"] is True and s["pair"] == "trained" and s["acceptance"] == "measured"


def test_every_seed_is_exact_and_the_summary_is_the_law_of_the_seed_rows(seed_run, cli, tmp_path):
    rows, out, _ = seed_run
    seeds = [r for r in rows if r["kind"] == "seed" and r["status"] == "ok"]
    sets = ("humaneval", "validation") if any(r["set"] == "humaneval" for r in seeds) else ("validation",)
    assert sorted((r["seed"], r["set"], r["S"]) for r in seeds) == [(s, name, 4) for s in (0, 1) for name in sets]
    he = [r for r in rows if r["set"] == "humaneval"]  # HumanEval may be absent here: skipped rows naming the fix
    assert he and (all(r["status"] == "ok" for r in he) or all(r["status"] == "skipped" and r["reason"] for r in he))
    assert all(r["exact"] is True for r in seeds)  # greedy verification is lossless, whatever the seed
    assert all(r["acceptance"] == "measured" and r["pair"] == "trained" and r["family"] == "mamba2" for r in seeds)
    assert all(r["drafter"] == "draft_model" and r["strategy"] == "replay" for r in seeds)
    for r in seeds:
        assert f"seed={r['seed']}" in r["train_overrides"] and r["draft_val_kl"] > 0 and r["target_val_loss"] > 0
        assert sum(r["accepted_hist"].values()) > 0 and r["val_files"] >= 1
        assert ("own" in r["prompts_from"]) == (r["set"] == "validation")
    keys = {r["seed"]: r["train_key"] for r in seeds}
    assert len(keys) == 2 and len(set(keys.values())) == 2  # a seed is a training of its own
    _law(rows, 2.0)
    assert all(r["status"] == "ok" or r["reason"] for r in rows)
    png = tmp_path / "fig.png"
    status, _, err = cli("plot", "trained_seeds", "--from", str(out), "--out", str(png))
    assert status == 0, err
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_a_goal_between_the_seeds_splits_them(seed_run, cli, tmp_path):
    """Rerun from the cache (nothing trains) with the goal at the best seed's validation acceptance: that seed
    reaches it (>=), and when the seeds differ the other does not."""
    rows, _, cache = seed_run
    vals = sorted(r["mean_accepted"] for r in rows if r["kind"] == "seed" and r["set"] == "validation")
    goal = vals[-1]
    again = run_rows(cli, tmp_path, SHORT, "bench.sets=[validation]", f"bench.cache_dir={cache}",
                     f"bench.goal_accepted={goal!r}", plot=False)
    assert all(r["train_cache_hit"] for r in again if r["kind"] == "seed")
    assert sorted(r["mean_accepted"] for r in again if r["kind"] == "seed") == vals  # the same pairs, measured again
    _law(again, goal)
    (s,) = [r for r in again if r["kind"] == "summary"]
    assert s["seeds_at_goal"] == (1 if vals[0] < vals[1] else 2) and s["goal_met_all"] is (vals[0] == vals[1])


@pytest.mark.parametrize("seeds, why", [("[]", "bench.seeds is empty"), ("[1,2,1]", "bench.seeds repeats [1]"),
                                        ("[-1]", "bench.seeds[0] must be a finite number >= 0")])
def test_bad_seeds_are_one_error_line_before_anything_trains(cli, tmp_path, seeds, why):
    _refused_before_training(cli, tmp_path, f"bench.seeds={seeds}", why)


def _refused_before_training(cli, tmp_path, override: str, why: str) -> None:
    """SHORT with ``override`` exits 2 with one error line holding ``why``; no run folder, nothing trained."""
    cache = tmp_path / "cache"
    status, _, err = cli("run", *SHORT, override, f"bench.cache_dir={cache}", f"results_dir={tmp_path / 'run'}")
    assert status == 2 and why in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists() and not cache.exists()


def test_check_seeds_names_the_fix():
    from ssmspec.bench.trained_seeds import check_seeds

    assert check_seeds([3, 0, 7]) == [3, 0, 7]
    for bad in ([], None, [-2], [1, 1], [0.5], [True]):
        with pytest.raises(ValueError, match=r"bench.seeds.*e\.g\. bench.seeds=\[0,1,2\]"):
            check_seeds(bad)


def test_a_seed_in_the_train_overrides_is_refused(cli, tmp_path):
    status, _, err = cli("run", *SHORT, "bench.train_overrides=['seed=3']", f"bench.cache_dir={tmp_path / 'c'}",
                         f"results_dir={tmp_path / 'run'}")
    assert status == 2 and "drop it and list the seeds in bench.seeds" in err
    assert not (tmp_path / "c").exists()


def test_only_the_measured_family_is_trained():
    """The gpu run trains three families; each seed's run keeps bench.family alone (~models.<name>), composed and
    checked without training anything."""
    from omegaconf import OmegaConf

    from ssmspec.bench.trained_seeds import seed_blocks
    from ssmspec.bench.trained import train_config

    b = OmegaConf.create({"train": "gpu", "train_overrides": [], "cache_dir": None, "family": "mamba2",
                          "num_prompts": 1, "prompt_len": 8, "new_tokens": 8, "batch": 1, "prompt_seed": 0})
    blocks = seed_blocks(b, [0, 3])
    for seed, block in zip((0, 3), blocks):
        config = train_config(block)
        assert config["seed"] == seed and sorted(config["models"]) == ["mamba2"]
        assert "~models.nemotron_h" in block.train_overrides and "~models.qwen3_5" in block.train_overrides
    with pytest.raises(ValueError, match="trains no 'llama' pair"):
        seed_blocks(OmegaConf.merge(b, {"family": "llama"}), [0])


def test_summary_counts_seeds_at_goal_on_synthetic_rows():
    from ssmspec.bench.trained_seeds import summarize_seeds

    def row(seed, name, v, status="ok"):
        return {"kind": "seed", "status": status, "family": "mamba2", "set": name, "S": 4, "seed": seed,
                "mean_accepted": v, "exact": True}

    rows = [row(0, "humaneval", 1.5), row(1, "humaneval", 2.0), row(2, "humaneval", 2.5),
            row(0, "validation", 3.0), row(1, "validation", 0.0, status="skipped")]
    he, val = summarize_seeds(rows, 2.0)
    assert (he["set"], he["n_seeds"], he["seeds_at_goal"], he["goal_met_all"]) == ("humaneval", 3, 2, False)
    assert he["mean"] == pytest.approx(2.0) and he["std"] == pytest.approx(0.5)
    assert (he["min"], he["max"], he["seeds"]) == (1.5, 2.5, [0, 1, 2])
    assert (val["n_seeds"], val["std"], val["seeds_at_goal"], val["goal_met_all"]) == (1, None, 1, True)
    assert summarize_seeds(rows, 1.4)[0]["goal_met_all"] is True


def test_variants_train_each_seed_once_per_variant_from_one_target(cli, tmp_path):
    """Two variants of the draft's distillation for one seed: rows carry train_variant, each variant is a training
    of its own (its own key and draft) from the seed's one target (the second reads it from the target cache), and
    the summary is per variant (the law of its seed rows); the figure draws a column per variant."""
    import json

    cache = tmp_path / "cache"
    variants = "bench.variants=[{name: short, overrides: ['distill.steps=10']}, {name: long, overrides: []}]"
    rows = run_rows(cli, tmp_path, SHORT, "bench.seeds=[0]", "bench.sets=[validation]", variants,
                    f"bench.cache_dir={cache}", plot=True)
    seeds = [r for r in rows if r["kind"] == "seed"]
    assert [(r["train_variant"], r["seed"]) for r in seeds] == [("short", 0), ("long", 0)]
    assert all(r["status"] == "ok" and r["exact"] is True for r in seeds)
    short, long_ = seeds
    assert "distill.steps=10" in short["train_overrides"] and "distill.steps=10" not in long_["train_overrides"]
    assert short["train_key"] != long_["train_key"] and short["draft_val_kl"] != long_["draft_val_kl"]
    assert short["target_val_loss"] == long_["target_val_loss"]  # one target
    targets = [json.loads((cache / r["train_key"] / "manifest.json").read_text())["models"]["mamba2-target"]
               for r in seeds]
    assert targets[0]["target_key"] == targets[1]["target_key"]
    assert (targets[0]["target_cache_hit"], targets[1]["target_cache_hit"]) == (False, True)
    summary = [r for r in rows if r["kind"] == "summary"]
    assert [(s["train_variant"], s["n_seeds"]) for s in summary] == [("short", 1), ("long", 1)]
    for s, r in zip(summary, seeds):
        assert s["mean"] == s["min"] == s["max"] == r["mean_accepted"] and s["std"] is None


@pytest.mark.parametrize("variants, why", [
    ("[{name: a, overrides: []}, {name: a, overrides: ['distill.steps=5']}]", "repeats the name(s) ['a']"),
    ("[{overrides: []}]", "bench.variants[0] must be {name: <label>"),
    ("[{name: a, overrides: ['seed=2']}]", "bench.variants[0] (a) sets seed="),
    ("[{name: a, overrides: 'distill.steps=5'}]", "bench.variants[0].overrides must be a list"),
    ("[{name: a, overrides: ['distill.nope=5']}]", "nope")])
def test_bad_variants_are_one_error_line_before_anything_trains(cli, tmp_path, variants, why):
    _refused_before_training(cli, tmp_path, f"bench.variants={variants}", why)


def test_summary_is_per_variant_on_synthetic_rows():
    from ssmspec.bench.trained_seeds import check_variants, summarize_seeds

    def row(variant, seed, v):
        return {"kind": "seed", "status": "ok", "train_variant": variant, "family": "mamba2", "set": "humaneval",
                "S": 4, "seed": seed, "mean_accepted": v, "exact": True}

    rows = [row("a", 0, 1.0), row("a", 1, 3.0), row("b", 0, 2.5), row("b", 1, 2.5)]
    a, b = summarize_seeds(rows, 2.0)
    assert (a["train_variant"], a["mean"], a["seeds_at_goal"]) == ("a", 2.0, 1)
    assert (b["train_variant"], b["mean"], b["seeds_at_goal"], b["std"]) == ("b", 2.5, 2, 0.0)
    assert check_variants(None) == check_variants([]) == [None]
    assert check_variants([{"name": "x", "overrides": ["distill.steps=9"]}]) == [
        {"name": "x", "overrides": ["distill.steps=9"]}]


def test_the_figure_finds_each_columns_summary_with_and_without_variants():
    """The mean bar of a column is its own summary row's: matched on the variant (None for a run without variants,
    which pandas' == would never match), family, set and S."""
    import pandas as pd

    from ssmspec.plots.trained_seeds import _summary_of

    def summ(variant, name, mean):
        return {"kind": "summary", "train_variant": variant, "family": "mamba2", "set": name, "S": 4, "mean": mean}

    plain = pd.DataFrame([summ(None, "humaneval", 1.0), summ(None, "validation", 2.0)])
    row = {"train_variant": None, "family": "mamba2", "set": "validation", "S": 4}
    assert _summary_of(plain, "mamba2", row)["mean"].tolist() == [2.0]
    legacy = plain.drop(columns=["train_variant"])  # records from before variants existed
    assert _summary_of(legacy.assign(train_variant=float("nan")), "mamba2", row)["mean"].tolist() == [2.0]
    both = pd.DataFrame([summ("a", "validation", 3.0), summ("b", "validation", 4.0)])
    assert _summary_of(both, "mamba2", {**row, "train_variant": "b"})["mean"].tolist() == [4.0]
    assert _summary_of(both.iloc[:0], "mamba2", row).empty
