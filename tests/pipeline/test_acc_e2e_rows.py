"""(acc) rows of the end-to-end experiments on CPU (bench/trained_rows.py): replay_fig8_throughput, snl_fig4_multiseq
and cost_model run their own bench once more on the tiny pair the suite trains (conf/train/tiny.yaml, trained once per
test session into ``train_cache``), with real drafters on HumanEval prompts. Every trained row says ``pair: trained``
and ``acceptance: measured``, greedy output equals the autoregressive output in float32, and the trained rows are
drawn in a figure of their own beside the oracle's."""
from __future__ import annotations

import pytest
from pipeline_helpers import PNG_MAGIC, rows_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIG8 = ["experiment=replay_fig8_throughput", "profile=cpu", "bench.presets=[tiny-mamba2]", "bench.batch=[2]",
        "bench.warmup=0", "bench.iters=3", "bench.snapshot_S=[2]", "bench.replay_S=[3]"]


def _run_and_draw(cli, tmp_path, argv, *extra) -> list[dict]:
    """Run, then draw: the oracle rows' figure and the trained rows' figure beside it."""
    out = tmp_path / "run"
    status, _, err = cli("run", *argv, *extra, f"results_dir={out}")
    assert status == 0, err
    png = tmp_path / "fig.png"
    status, printed, err = cli("plot", argv[0].split("=")[1], "--from", str(out), "--out", str(png))
    assert status == 0, err
    trained = tmp_path / "fig-trained.png"
    assert printed.split() == [str(png), str(trained)]
    assert png.read_bytes()[:8] == PNG_MAGIC and trained.read_bytes()[:8] == PNG_MAGIC
    return rows_of(out)


def test_fig8_trained_rows_measure_mtp_draft_model_and_png(cli, tmp_path, train_cache):
    rows = _run_and_draw(cli, tmp_path, FIG8, f"bench.trained.cache_dir={train_cache}")
    oracle = [r for r in rows if r["pair"] == "random"]
    trained = [r for r in rows if r["pair"] == "trained"]
    assert oracle and all(r["acceptance"] in ("oracle", "none") for r in oracle)
    assert [r["line"] for r in trained] == [
        "autoregressive", "replay", "snapshot spec S=2 + mtp", "snapshot spec S=2 + draft_model",
        "snapshot spec S=2 + png", "replay spec S=3 + mtp", "replay spec S=3 + draft_model", "replay spec S=3 + png"]
    for r in trained:
        assert r["status"] == "ok" and r["family"] == "mamba2" and r["weights"].startswith("trained tiny/")
        assert r["set"] == "humaneval" and r["dtype"] == "float32" and r["model"] == "mamba2-target"
        assert sum(r["accepted_hist"].values()) == 3 * r["batch"]  # every timed step of every sequence
        if r["S"]:
            assert r["acceptance"] == "measured" and r["alpha"] is None and r["oracle"] is None
            assert r["drafter"] == r["line"].rsplit(" + ", 1)[1]
            assert r["ref_match"] == 1.0  # greedy verification is lossless: float32 output = autoregressive
            assert r["expected_accepted"] is None
    assert {r["draft"] for r in trained if r["drafter"] == "draft_model"} == {"mamba2-draft"}
    assert {r["ngram"] for r in trained if r["drafter"] == "png"} == {3}


@pytest.mark.parametrize("extra, message", [
    (["bench.trained.bench.measured_drafters=[mtp,oracle]"], "bench.measured_drafters lists distinct real drafters"),
    (["bench.trained=null", "bench.measured_drafters=[png]"], "give checkpoint=<dir>"),
])
def test_fig8_bad_measured_drafters_are_one_error_line(cli, tmp_path, extra, message):
    status, _, err = cli("run", *FIG8, *extra, f"results_dir={tmp_path / 'run'}")
    assert status == 2 and message in err and err.count("error:") == 1, err  # (training bars aside)
    assert not (tmp_path / "run").exists()


FIG4 = ["experiment=snl_fig4_multiseq", "profile=cpu", "bench.new_tokens=8", "bench.batch=[1,2]", "bench.drafts=[0,1,2]",
        "data.max_prompt_len=16", "bench.groups=1", "bench.trained.data.max_prompt_len=32"]


def test_fig4_trained_rows_measure_png_per_draft_count(cli, tmp_path, train_cache):
    rows = _run_and_draw(cli, tmp_path, FIG4, f"bench.trained.cache_dir={train_cache}")
    assert {r["acceptance"] for r in rows if r["pair"] == "random" and r["drafts"]} == {"oracle"}
    trained = [r for r in rows if r["pair"] == "trained"]
    assert [(r["batch"], r["drafts"], r["strategy"]) for r in trained] == [
        (b, d, s) for b in (1, 2) for d, s in ((0, "autoregressive"), (1, "joint_attainment"),
                                               (1, "activation_replay"), (2, "joint_attainment"),
                                               (2, "activation_replay"))]
    for r in trained:
        assert r["status"] == "ok" and r["set"] == "humaneval" and r["family"] == "mamba2"
        assert r["groups"] == 1 and r["prompts"] == r["batch"]  # trained.bench.groups: 1 batch a point on cpu
        assert r["ref_match"] == 1.0  # float32: every line decodes the autoregressive output
        if r["drafts"]:
            assert r["acceptance"] == "measured" and r["drafter"] == "png" and r["alpha"] is None
            assert r["line"] == f"{r['strategy']} + PNG(6,{r['drafts']})"
            assert sum(r["accepted_hist"].values()) > 0 and r["speedup"] is not None


def test_tab5_trained_rows_still_measure_png_on_humaneval(cli, tmp_path, train_cache):
    """snl_tab5_e2e's (acc) rows (wired by bench/trained_rows.py), next to the experiments above."""
    rows = _run_and_draw(cli, tmp_path, ["experiment=snl_tab5_e2e", "profile=cpu", "bench.new_tokens=9",
                                         "data=humaneval", "data.max_prompt_len=64", "bench.groups=1",
                                         "bench.trained.data.num_prompts=3"],
                         f"bench.trained.cache_dir={train_cache}")
    trained = [r for r in rows if r["pair"] == "trained"]
    assert [r["line"] for r in trained] == ["autoregressive", "joint_attainment + PNG(6,2)",
                                            "activation_replay + PNG(6,2)"]
    assert all(r["status"] == "ok" and r["ref_match"] == 1.0 and r["prompts"] == 3 for r in trained)
    assert {r["acceptance"] for r in trained if r["drafts"]} == {"measured"}


COST = ["experiment=cost_model", "profile=cpu", "bench.warmup=0", "bench.iters=2", "bench.prompt_len=4",
        "bench.strategies=[replay]", "bench.S=[2]", "bench.D=[1,2]", "bench.single_draft=[]", "bench.fit_batch=[1,2]",
        "bench.heldout_batch=[3]", "bench.eval_seeds=[1,2]", "bench.min_sequence_steps=4",
        "bench.trained.data.num_prompts=8", "bench.trained.bench={drafter: png, prompt_len: 32}"]


def test_cost_model_trained_rows_fit_the_policy_on_measured_acceptance(cli, tmp_path, train_cache):
    """The policy's alpha is measured on the fit prompts at the fit batches; the choosers are scored on the
    held-out prompts at the held-out batches only, against real drafting."""
    from ssmspec.policy import fit_alpha

    rows = _run_and_draw(cli, tmp_path, COST, f"bench.trained.cache_dir={train_cache}")
    assert {r["acceptance"] for r in rows if r["pair"] == "random" and r["kind"] == "policy"} == {"oracle"}
    tr = [r for r in rows if r["pair"] == "trained"]
    meas = [r for r in tr if r["kind"] == "measure"]
    (acc,) = [r for r in tr if r["kind"] == "acceptance"]
    (split,) = [r for r in tr if r["kind"] == "split"]
    # held out: the prompts of the set's second half at the held-out batch; the fit: its first half at the fit batches
    assert split["fit_prompts"] == acc["fit_prompts"] == [0, 1, 2, 3] and split["eval_prompts"] == [4, 5, 6, 7]
    for r in meas:
        assert r["status"] == "ok" and r["model"] == "mamba2-target" and r["set"] == "humaneval"
        assert set(r["prompt_ids"]) <= set(split["fit_prompts" if r["phase"] == "fit" else "eval_prompts"])
        assert r["batch"] in ((1, 2) if r["phase"] == "fit" else (3,)) and len(r["prompt_ids"]) == r["batch"]
        if r["S"]:
            assert r["acceptance"] == "measured" and r["drafter"] == "png" and r["alpha"] is None
            assert r["ref_match"] == 1.0  # float32: real drafting decodes the autoregressive output
    # the alpha: the maximum-likelihood law of the fit phase's single chains, nothing of the held-out rows
    single = [(r["S"], r["accepted_hist"]) for r in meas if r["phase"] == "fit" and r["S"] and r["D"] == 1]
    assert acc["alpha"] == pytest.approx(fit_alpha(single)[0]) and 0.0 <= acc["alpha"] <= 1.0
    assert set(acc["per_setting"]) == {"replay S=2 D=1", "replay S=2 D=2"}
    scored = [r for r in tr if r["kind"] in ("policy", "baseline")]
    assert scored and all(r["alpha"] == acc["alpha"] and r["acceptance"] == "measured" for r in scored)
    assert {r["batch"] for r in scored} == {3}
    # the command line refits the trained model's rows with the measured alpha and prints the policy rows' pick
    (pick,) = {r["setting"] for r in scored if r["chooser"] == "policy"}
    status, text, _ = cli("policy", "--fit", str(tmp_path / "run" / "results.jsonl"), "--model", "mamba2-target",
                          "--batch", "3", "--alpha", "measured")
    assert status == 0 and text.startswith(f"batch 3: {pick} (")


@pytest.mark.parametrize("extra, message", [
    (["bench.trained.bench={drafter: ngrams}"], "bench.drafter is one of oracle, png, draft_model, mtp"),
    (["bench.trained=null", "bench.drafter=png"], "give checkpoint=<dir>"),
    (["bench.trained.only=true", "bench.D=[2]"], "estimated from single chains (D = 1)"),
])
def test_cost_model_bad_measured_settings_are_one_error_line(cli, tmp_path, train_cache, extra, message):
    status, _, err = cli("run", *COST, f"bench.trained.cache_dir={train_cache}", *extra,
                         f"results_dir={tmp_path / 'run'}")
    assert status == 2 and message in err and err.count("error:") == 1, err  # (training bars aside)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, message", [
    (["bench.trained.family=[qwen3_5]"], "trains no 'qwen3_5' pair"),
    (['bench.trained.train_overrides=["tokenizer.vocab_sise=300"]'], "overrides are key=value with keys of"),
    (["bench.trained.data={name: gsm9k}"], "names no data config"),
])
def test_bad_trained_settings_fail_before_anything_runs(cli, tmp_path, extra, message):
    """A trained block that cannot run is one error line before any row is measured and before any pair trains:
    the (fresh) train cache stays empty."""
    cache = tmp_path / "cache"
    status, _, err = cli("run", *FIG8, f"bench.trained.cache_dir={cache}", *extra, f"results_dir={tmp_path / 'run'}")
    assert status == 2 and message in err and err.count("error:") == 1, err
    assert not (tmp_path / "run").exists()
    assert not cache.exists() or not any(cache.iterdir())
