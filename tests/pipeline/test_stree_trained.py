"""STree Tables 5 and 6 on the pairs the suite trains (bench/stree_trained.py) on CPU through the CLI: one train run
per variant (the target's attention share; the draft's distillation steps), each cached, the tab6 target trained
once for all its drafts; rows measured only on trained pairs, SD and STree at every temperature, on HumanEval prompts
(the rows' prompt digest recomputed here from HumanEval in each pair's own tokenizer), every greedy line emitting
exactly the target's greedy autoregressive continuation of the timed prompts; the figures drawn; a bad variant or a
config without trained pairs is one error line."""
from __future__ import annotations

import hashlib
import json

import pytest
from pipeline_helpers import run_rows

from ssmspec.data.prompts import load_prompts
from ssmspec.data.tokenizers import load_tokenizer
from ssmspec.train.command import compose_train
from ssmspec.train.run import train_pairs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# shorter target training than the cpu profile's (both experiments alike, so they share the 50% target when one
# worker runs both), few timed steps on one group of one 64-token prompt (the cpu profile decodes 2 groups)
FAST = ["profile=cpu", "bench.warmup=0", "bench.iters=3", "bench.groups=1",
        'bench.trained.train_overrides=["train.steps=12"]']
PROMPT_LEN, GROUPS = 64, 1
TAB5 = ["experiment=stree_tab5_hybrid_ratio", *FAST]
TAB6 = ["experiment=stree_tab6_draft_training", *FAST]
LINES = {"autoregressive", "chain S=4", "tree A"}


def _manifest(cache, key: str) -> dict:
    return json.loads((cache / key / "manifest.json").read_text())


def _digest(cache, row: dict) -> str:
    """tree_prompts.group_fields' digest of the first GROUPS HumanEval prompts (batch 1) with >= PROMPT_LEN tokens
    in the row's trained target's tokenizer, each its last PROMPT_LEN tokens."""
    entry = cache / row["train_key"]
    tok = load_tokenizer(entry / _manifest(cache, row["train_key"])["models"][row["target"]]["path"])
    ids = [p.tokens[-PROMPT_LEN:] for p in load_prompts("humaneval", None, tok) if len(p.tokens) >= PROMPT_LEN]
    return hashlib.sha256(json.dumps([ids[g:g + 1] for g in range(GROUPS)]).encode()).hexdigest()[:16]


def _check_rows(rows: list[dict], variants: int, cache) -> None:
    assert len(rows) == variants * 2 * 3  # variants x temperatures x lines
    assert {r["line"] for r in rows} == LINES and {r["temperature"] for r in rows} == {0.0, 1.0}
    for r in rows:
        assert r["status"] == "ok" and r["pair"] == "trained" and r["family"] == "nemotron_h"
        assert r["model"] == "nemotron_h-target" and r["tokens_per_s"] > 0
        assert r["acceptance"] == ("none" if r["line"] == "autoregressive" else "measured")
        assert r["tau"] == pytest.approx(r["mean_accepted"] + 1) and 1.0 <= r["tau"] <= 1 + r["depth"]
        assert r["speedup_per_tau"] == pytest.approx(r["speedup"] / r["tau"])
        # greedy verification of the trained draft is lossless: the timed prompts' emitted tokens are the target's
        # greedy continuation (the Runner's own check, every line); no reference to check against when sampling
        assert r["exact"] is (True if r["temperature"] == 0.0 else None), r
        assert r["set"] == "humaneval" and r["prompt_len"] == PROMPT_LEN and r["prompts"] == GROUPS == r["groups"]
    for key in {r["train_key"] for r in rows}:
        mine = [r for r in rows if r["train_key"] == key]
        assert {r["prompt_sha256"] for r in mine} == {_digest(cache, mine[0])}


def test_tab5_one_pair_per_attention_share(cli, tmp_path, train_cache):
    args = [*TAB5, f"bench.trained.cache_dir={train_cache}"]
    rows = run_rows(cli, tmp_path, args)
    _check_rows(rows, 4, train_cache)
    by_variant = {r["train_variant"]: r for r in rows}
    assert {v: r["attention_share"] for v, r in by_variant.items()} == {"0%": 0.0, "12.5%": 0.125, "25%": 0.25,
                                                                       "50%": 0.5}
    assert {v: r["target_pattern"] for v, r in by_variant.items()} == {
        "0%": "MMMMMMMM", "12.5%": "MMMMMMM*", "25%": "MMM*MMM*", "50%": "M*M*M*M*"}
    assert len({r["train_key"] for r in rows}) == 4  # one train run per variant
    # each variant's run is cached: composed again, it trains nothing and names the rows' entry
    for variant in ("0%", "12.5%", "25%", "50%"):
        share = by_variant[variant]["attention_share"]
        again = train_pairs(compose_train("hybrid_tiny", ["train.steps=12", f"cache_dir={train_cache}",
                                                          f"models.nemotron_h.target.attention_share={share}"]))
        assert again.hit and again.entry.name == by_variant[variant]["train_key"]


def test_tab6_drafts_of_one_target(cli, tmp_path, train_cache):
    rows = run_rows(cli, tmp_path, [*TAB6, f"bench.trained.cache_dir={train_cache}"])
    _check_rows(rows, 3, train_cache)
    kl = {r["draft_steps"]: r["draft_val_kl"] for r in rows}
    assert sorted(kl) == [5, 20, 80] and kl[5] > kl[20] > kl[80]  # distillation brings the draft to its target
    assert {r["attention_share"] for r in rows} == {0.5}
    targets = [_manifest(train_cache, key)["models"]["nemotron_h-target"] for key in {r["train_key"] for r in rows}]
    assert len(targets) == 3 and len({t["target_key"] for t in targets}) == 1
    assert sum(not t["target_cache_hit"] for t in targets) <= 1  # trained once (or by the tab5 test before)


@pytest.mark.parametrize(("override", "match"), [
    ('bench.trained.variants=[{name: bad, overrides: ["models.nemotron_h.target.attention_share=0.3"]}]',
     "attention_share=0.3 of the 8 mixer layers"),
    ('bench.trained.variants=[{name: bad, overrides: ["models.nemotron_h.target.bogus=1"]}]',
     "models.nemotron_h.target.bogus"),
    ("bench.trained.only=false", "measured on the pairs the suite trains only"),
    ("bench.trained=null", "measured on the pairs the suite trains only"),
], ids=["share", "unknown-key", "random-rows", "no-pairs"])
def test_bad_config_is_one_error_line(cli, tmp_path, override, match):
    out = tmp_path / "run"
    status, _, err = cli("run", *TAB5, f"bench.trained.cache_dir={tmp_path / 'cache'}", override, f"results_dir={out}")
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], err
    assert not out.exists() and not (tmp_path / "cache").exists()  # nothing trained, no results
