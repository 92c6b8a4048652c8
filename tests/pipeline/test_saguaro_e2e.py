"""``saguaro_e2e`` and ``saguaro_fig6_backoff`` on CPU through the CLI, on the tiny pair the suite trains
(conf/train/tiny.yaml, once per session into a temporary cache): rows carry the columns the figures read and say
measured, every greedy speculative line (synchronous and asynchronous, both backups) emits exactly the
autoregressive output (float32), the backoff picks one of the two measured lines, figures are drawn, and bad input
is one error line."""
from __future__ import annotations

import pytest
from pipeline_helpers import run_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = ["profile=cpu", "bench.num_prompts=4", "bench.warmup=1", "bench.iters=4", "bench.fit_new_tokens=24",
         "bench.batch=[1,2]", "bench.temperature=[0.0,1.0]"]
E2E = ["experiment=saguaro_e2e", *SMALL, "bench.sets=[validation]"]
FIG6 = ["experiment=saguaro_fig6_backoff", *SMALL, "bench.fanout=[2,1,1,1,1]"]
ASYNC = {"async backup=draft", "async backup=ngram"}


def _check_greedy_exact(rows):
    greedy = [r for r in rows if r["temperature"] == 0.0 and r["S"] > 0]
    assert greedy and all(r["ref_match"] == 1.0 and r["exact"] is True for r in greedy), \
        [(r["line"], r["batch"], r["ref_match"]) for r in greedy]


def test_e2e_rows_are_measured_exact_and_compared_in_the_same_run(cli, tmp_path, train_cache):
    rows = run_rows(cli, tmp_path, E2E, f"bench.cache_dir={train_cache}", "bench.draft_devices=[same,cuda:1]")
    skipped = [r for r in rows if r["status"] == "skipped"]  # no second GPU here: the own-GPU lines say why
    assert {r["line"] for r in skipped} == {f"{a}, draft on cuda:1" for a in ASYNC}
    assert all("draft_device cuda:1 does not exist" in r["reason"] and r["draft_device"] == "cuda:1" for r in skipped)
    rows = [r for r in rows if r["status"] != "skipped"]
    assert len(rows) == 2 * 2 * 4  # temperatures x batches x lines
    lines = {"autoregressive", "sync draft_model", *ASYNC}
    for T in (0.0, 1.0):
        for B in (1, 2):
            got = {r["line"]: r for r in rows if r["temperature"] == T and r["batch"] == B}
            assert set(got) == lines and all(r["status"] == "ok" for r in got.values())
            for r in got.values():
                assert r["pair"] == "trained" and r["train_key"] and r["family"] == "mamba2"
                assert r["tokens_per_s"] > 0 and r["ms_p90"] >= r["ms_p50"] > 0 and "mean_accepted" in r
                assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"] / got["autoregressive"]["tokens_per_s"])
            for label in ASYNC:
                r = got[label]
                assert r["acceptance"] == "measured" and r["S"] == 4 and len(r["fanout"]) == 5
                assert sum(r["fanout"]) <= 8 and r["fanout_from"].startswith("optimal_fanout")
                assert 0.0 <= r["hit_rate"] <= 1.0 and r["cache_rounds"] > 0 and r["draft_ms"] > 0
                assert 0.0 <= r["backup_share"] <= 1.0 and r["draft_device"] == "same"
                assert r["speedup_vs_sync"] == pytest.approx(r["tokens_per_s"] / got["sync draft_model"]["tokens_per_s"])
            assert got["sync draft_model"]["draft_ms"] > 0 and got["autoregressive"]["draft_ms"] == 0.0
    _check_greedy_exact(rows)
    assert all(r["ref_match"] is None for r in rows if r["temperature"] == 1.0)


def test_a_hybrid_pair_with_an_attention_draft_runs_exact(cli, tmp_path, train_cache):
    """A Nemotron-H-style pair whose draft has an attention layer (hybrid_tiny's draft made ``M*``): the async lines
    run through drafting/async_kv.py and every greedy line still emits the autoregressive output."""
    argv = ["experiment=saguaro_e2e", *SMALL[:5], "bench.batch=[1]", "bench.temperature=[0.0]",
            "bench.sets=[validation]", "bench.train=hybrid_tiny", "bench.family=nemotron_h",
            'bench.train_overrides=["train.steps=12","models.nemotron_h.draft.pattern=M*"]']
    rows = run_rows(cli, tmp_path, argv, f"bench.cache_dir={train_cache}")
    assert {r["line"] for r in rows} == {"autoregressive", "sync draft_model", *ASYNC}
    assert all(r["status"] == "ok" and r["family"] == "nemotron_h" for r in rows)
    assert all(r["cache_rounds"] > 0 for r in rows if r["line"] in ASYNC)
    _check_greedy_exact(rows)


def test_a_draft_length_sweep_is_a_group_of_rows_per_length(cli, tmp_path, train_cache):
    """``bench.S=[2,4]``: every line runs at each draft length (autoregressive timed again), each group has its own
    fitted fan-out of S + 1 counts, and the speedups compare rows of one group only; the figure has a row pair per
    length."""
    from ssmspec.plots.saguaro_e2e import e2e_panels, plot_e2e

    argv = ["experiment=saguaro_e2e", *SMALL[:5], "bench.batch=[1]", "bench.temperature=[0.0]",
            "bench.sets=[validation]", "bench.S=[2,4]"]
    rows = run_rows(cli, tmp_path, argv, f"bench.cache_dir={train_cache}")
    assert all(r["status"] == "ok" for r in rows) and len(rows) == 2 * 4
    for S in (2, 4):
        got = {r["line"]: r for r in rows if r["sweep_S"] == S}
        assert set(got) == {"autoregressive", "sync draft_model", *ASYNC}
        assert got["autoregressive"]["S"] == 0 and got["sync draft_model"]["S"] == S
        for label in ASYNC:
            r = got[label]
            assert r["S"] == S and len(r["fanout"]) == S + 1 and sum(r["fanout"]) <= 8
            assert r["speedup_vs_sync"] == pytest.approx(r["tokens_per_s"] / got["sync draft_model"]["tokens_per_s"])
            assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"] / got["autoregressive"]["tokens_per_s"])
    _check_greedy_exact(rows)
    import pandas as pd

    d = pd.DataFrame(rows)
    assert e2e_panels(d) == [("mamba2", 2, "validation", 0.0), ("mamba2", 4, "validation", 0.0)]
    plot_e2e(d, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").stat().st_size > 0


def test_backoff_picks_a_measured_line_and_marks_the_flip(cli, tmp_path, train_cache):
    rows = run_rows(cli, tmp_path, FIG6, f"bench.cache_dir={train_cache}")
    lines = [r for r in rows if r["kind"] == "line"]
    choices = [r for r in rows if r["kind"] == "backoff"]
    summary = [r for r in rows if r["kind"] == "backoff_summary"]
    assert len(lines) == 2 * 2 * 4 and len(choices) == 4 and len(summary) == 2
    assert all(r["fanout"] == [2, 1, 1, 1, 1] and r["fanout_from"].startswith("stated") for r in choices)
    tps = {(r["temperature"], r["batch"], r["line"]): r["tokens_per_s"] for r in lines}
    for r in choices:
        assert r["status"] == "ok" and r["choice"] in ("slow", "fast")
        assert r["picked"] == {"slow": "async backup=draft", "fast": "async backup=ngram"}[r["choice"]]
        assert r["tokens_per_s"] == tps[r["temperature"], r["batch"], r["picked"]]
        assert 0 <= r["hit_rate"] <= 1 and r["verify_s"] > 0 and r["slow_s"] > 0 and r["fast_s"] > 0
        assert r["predicted_s_per_token_slow"] > 0 and r["predicted_s_per_token_fast"] > 0
    for s in summary:
        assert s["agree"] == (s["flip_batch"] == s["crossing_batch"]) and s["batches"] == [1, 2]
    _check_greedy_exact(lines)


@pytest.mark.parametrize("argv,extra,message", [
    (E2E, "bench.batch=[]", "bench.batch needs a non-empty list"),
    (E2E, "bench.fanout=[0,0,0,0,0]", "cannot hold one cache branch"),
    (E2E, "bench.budget=0", "cannot hold one cache branch"),
    (E2E, "bench.draft_devices=[gpu1]", "neither 'same' nor a GPU such as cuda:1"),
    (E2E, "bench.S=[2,2]", "a list of distinct ones"),
    (E2E, "bench.S=[0]", "a draft length >= 1 or a list of distinct ones, got [0]; e.g. bench.S=[4] or"),
    (FIG6, "bench.S=0", "got [0]; e.g. bench.S=4"),
    (FIG6, "bench.batch=[]", "bench.batch needs a non-empty list"),
    (FIG6, "bench.S=[2,4]", "bench.S must be an int like 4"),
    (FIG6, "bench.fanout=[0,0,0,0,0]", "cannot hold one cache branch"),
    (FIG6, "bench.fanout=[1,1]", "one count per accepted length"),
], ids=["e2e-batch", "e2e-fanout", "e2e-budget", "e2e-draft-device", "e2e-S-twice", "e2e-S-zero", "fig6-S-zero",
         "fig6-batch", "fig6-S-list", "fig6-fanout", "fig6-fanout-length"])
def test_bad_input_is_one_error_line(cli, tmp_path, argv, extra, message):
    status, _, err = cli("run", *argv, extra, f"results_dir={tmp_path / 'run'}")
    assert status == 2 and message in err, err
    assert len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1
    assert not (tmp_path / "run").exists()


def test_backoff_refuses_a_list_of_draft_lengths_before_training():
    """fig6 declares one draft length (the CLI refuses a list by type); a bench config that holds a list anyway
    (a yaml edited to sweep) gets one error naming saguaro_e2e, before any pair trains."""
    from omegaconf import OmegaConf

    from ssmspec import paths
    from ssmspec.bench.saguaro_backoff import run_backoff

    bench = OmegaConf.load(paths.CONF_DIR / "experiment" / "saguaro_fig6_backoff.yaml").bench
    bench.S = [2, 4]
    with pytest.raises(ValueError, match=r"bench.S takes one draft length here, got \[2, 4\]; e.g. bench.S=2 "
                                         r"\(saguaro_e2e sweeps a list\)"):
        next(run_backoff(OmegaConf.create({"bench": bench, "device": "cpu"})))


def test_the_e2e_figure_has_a_column_per_pair(tmp_path):
    """Two trained pairs (the gpu profile runs the Mamba-2 and the Nemotron-H pair): one column per pair, set and
    temperature, each titled with its pair; the committed cpu reference stands in for the rows."""
    import pandas as pd

    from ssmspec import paths
    from ssmspec.plots.saguaro_e2e import _pair_line, e2e_panels, plot_e2e

    one = pd.read_json(paths.ROOT / "results" / "saguaro_e2e" / "cpu" / "results.jsonl", lines=True)
    two = pd.concat([one, one.assign(family="nemotron_h", target="nemotron_h-target", draft="nemotron_h-draft")])
    sets = list(dict.fromkeys(zip(one["set"], one["temperature"])))
    S = int(one["sweep_S"].iloc[0])  # the cpu reference's one draft length
    assert e2e_panels(one[one["status"] == "ok"]) == [("mamba2", S, *p) for p in sets]
    assert e2e_panels(two[two["status"] == "ok"]) == [(f, S, *p) for f in ("mamba2", "nemotron_h") for p in sets]
    old = one.drop(columns="sweep_S")  # rows from before the draft-length sweep: one group, no S in the panels
    assert e2e_panels(old[old["status"] == "ok"]) == [("mamba2", None, *p) for p in sets]
    assert "trained pairs" in _pair_line(two) and "nemotron_h-target / nemotron_h-draft" in _pair_line(two)
    plot_e2e(two, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").stat().st_size > 0
