"""(acc) rows (``bench/trained_rows.py``): an experiment's own bench run again on the pair the suite trains, with real
prompts and a real drafter, beside (never mixed with) its oracle rows. Shown on snl_tab5_e2e: PNG(6,2) measured on
HumanEval prompts tokenized by the trained tokenizer; its figure splits in two; a trained row that would draft with
the oracle, or a prompt set that does not exist, is refused in one line."""
from __future__ import annotations

import pytest
from pipeline_helpers import PNG_MAGIC, rows_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TAB5 = ["experiment=snl_tab5_e2e", "profile=cpu", "data=humaneval", "bench.new_tokens=12", "data.max_prompt_len=48", "bench.groups=1",
        "bench.trained.data.num_prompts=2", "bench.trained.data.max_prompt_len=48"]


def test_trained_rows_are_measured_beside_the_oracle_rows(cli, tmp_path, train_cache):
    out = tmp_path / "run"
    status, _, err = cli("run", *TAB5, f"bench.trained.cache_dir={train_cache}", f"results_dir={out}")
    assert status == 0, err
    rows = [r for r in rows_of(out) if r["status"] == "ok"]
    random = [r for r in rows if r["pair"] == "random"]
    trained = [r for r in rows if r["pair"] == "trained"]
    assert random and trained and len(random) + len(trained) == len(rows)
    assert {r["acceptance"] for r in random} == {"none", "oracle"} and all(r["weights"] == "random" for r in random)
    key = trained[0]["train_key"]
    assert {r["weights"] for r in trained} == {f"trained tiny/{key}"} and {r["family"] for r in trained} == {"mamba2"}
    assert {r["acceptance"] for r in trained} == {"none", "measured"} and {r["set"] for r in trained} == {"humaneval"}
    assert {r["drafter"] for r in trained if r["acceptance"] == "measured"} == {"png"}
    assert all(r["ref_match"] == 1.0 for r in trained)  # greedy verification of real drafts is lossless
    assert all(r["target_val_loss"] > 0 and r["train_variant"] is None for r in trained)
    assert {r["model"] for r in trained} == {"mamba2-target"} and {r["model"] for r in random} == {"tiny-mamba2"}
    png = tmp_path / "fig.png"
    status, printed, err = cli("plot", "snl_tab5_e2e", "--from", str(out), "--out", str(png))
    assert status == 0, err
    both = [png, tmp_path / "fig-trained.png"]
    assert printed.split() == [str(p) for p in both] and all(p.read_bytes()[:8] == PNG_MAGIC for p in both)


def test_trained_only_skips_the_random_weight_rows(cli, tmp_path, train_cache):
    out = tmp_path / "run"
    status, _, err = cli("run", *TAB5, f"bench.trained.cache_dir={train_cache}", "bench.trained.only=true",
                         f"results_dir={out}")
    assert status == 0, err
    rows = rows_of(out)
    assert rows and {r["pair"] for r in rows} == {"trained"}


@pytest.mark.parametrize("extra, message", [
    (["bench.trained.bench.drafter=oracle"], "drafts with the oracle, whose acceptance is designed"),
    (["bench.trained.data.name=nope"], "bench.trained.data.name='nope' names no data config"),
])
def test_bad_trained_settings_end_in_one_line(cli, tmp_path, train_cache, extra, message):
    out = tmp_path / "run"
    status, _, err = cli("run", *TAB5, f"bench.trained.cache_dir={train_cache}", *extra, f"results_dir={out}")
    assert status == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert not (out / "results.jsonl").exists()  # no half-written result
