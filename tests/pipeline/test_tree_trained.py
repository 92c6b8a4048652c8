"""(acc) rows of the STree end-to-end experiments on the pair the suite trains (bench/trained_rows.py, the session's
tiny Mamba-2 pair): they exist beside the oracle rows, are measured by the trained draft on HumanEval prompts (the
rows' prompt digest is recomputed here from HumanEval in the pair's own tokenizer), and every greedy line emits
exactly the target's greedy autoregressive output; stree_tab8_beam (static vs beam-search tree) is measured only;
the figure pair is drawn; a trained config that asks for the oracle is one error line."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from pipeline_helpers import PNG_MAGIC, rows_of

from ssmspec.data.prompts import load_prompts
from ssmspec.data.tokenizers import load_tokenizer

QUICK = ["profile=cpu", "bench.warmup=0", "bench.iters=3"]  # the oracle rows: a few steps (their own tests elsewhere)


def _trained(train_cache: Path, **bench) -> list[str]:
    return [f"bench.trained.cache_dir={train_cache}"] + [f"bench.trained.bench.{k}={v}" for k, v in bench.items()]


def _run(cli, out: Path, exp: str, *args: str) -> list[dict]:
    status, _, err = cli("run", f"experiment={exp}", *args, f"results_dir={out}")
    assert status == 0, err
    return rows_of(out)


def _digest(train_cache: Path, row: dict, *, prompt_len: int, batch: int, groups: int) -> str:
    """tree_prompts.group_fields' digest of the first batch x groups HumanEval prompts with >= prompt_len tokens
    in the trained target's tokenizer, each its last prompt_len tokens."""
    entry = train_cache / row["train_key"]
    manifest = json.loads((entry / "manifest.json").read_text())
    tok = load_tokenizer(entry / manifest["models"][row["target"]]["path"])
    ids = [p.tokens[-prompt_len:] for p in load_prompts("humaneval", None, tok) if len(p.tokens) >= prompt_len]
    grouped = [ids[g * batch:(g + 1) * batch] for g in range(groups)]
    return hashlib.sha256(json.dumps(grouped).encode()).hexdigest()[:16]


def test_tab3_trained_rows_are_measured_exact_and_drawn_apart(cli, tmp_path, train_cache):
    out = tmp_path / "run"
    rows = _run(cli, out, "stree_tab3_e2e", *QUICK, *_trained(train_cache, iters=4, groups=2))
    oracle = [r for r in rows if r["pair"] == "random"]
    trained = [r for r in rows if r["pair"] == "trained"]
    assert {r["line"] for r in trained} == {r["line"] for r in oracle} == {"autoregressive", "chain S=4", "tree A"}
    assert all(r["set"] == "synthetic" for r in oracle) and any(r["acceptance"] == "oracle" for r in oracle)
    digest = _digest(train_cache, trained[0], prompt_len=64, batch=1, groups=2)
    for r in trained:
        assert r["status"] == "ok" and r["family"] == "mamba2" and r["weights"].startswith("trained tiny/")
        assert r["model"] == r["target"] and r["set"] == "humaneval" and r["prompts"] == 2 == r["groups"]
        assert r["prompt_sha256"] == digest != oracle[0]["prompt_sha256"]
        assert r["n"] == 2 * 4 == r["sequence_steps"] and sum(r["accepted_hist"].values()) == 8
        assert r["tau"] == pytest.approx(r["mean_accepted"] + 1) and r["tokens_per_s"] > 0
        # two groups pooled: tokens = accepted + 1 per step over the summed step times of both engines
        assert r["tokens_emitted"] == sum((int(a) + 1) * n for a, n in r["accepted_hist"].items())
        assert r["tokens_per_s"] == pytest.approx(r["tokens_emitted"] / (sum(r["samples_ms"]) * 1e-3))
        assert r["tokens_per_s_designed"] is None or r["line"] == "autoregressive"
        if r["draft_nodes"]:
            assert r["acceptance"] == "measured" and r["drafter"] == "draft" and r["draft"] == "mamba2-draft"
            assert r["alpha"] is None and r["expected_accepted"] is None and r["tau_designed"] is None
        if r["temperature"] == 0.0:  # greedy verification is lossless: token for token the greedy target
            assert r["exact"] is True and r["ref_match"] == 1.0
        else:
            assert r["exact"] is None
    status, printed, err = cli("plot", "stree_tab3_e2e", "--from", str(out), "--out", str(tmp_path / "fig.png"))
    assert status == 0, err
    for png in (tmp_path / "fig.png", tmp_path / "fig-trained.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC and str(png) in printed


def test_exact_while_drafts_are_accepted(cli, tmp_path, train_cache):
    """The trained target drafting for itself (draft_checkpoint = the target) on HumanEval prompts: greedy
    verification accepts every node of the chain and of tree A's first path (tau = depth + 1) and the beam tree's
    best path, and every line still emits the greedy target's tokens."""
    from ssmspec.bench.trained import pair_info, train_run

    block = OmegaConf.create({"train": "tiny", "train_overrides": [], "cache_dir": str(train_cache),
                              "family": ["mamba2"]})
    _, target, _ = pair_info(block, "mamba2", train_run(block))
    rows = _run(cli, tmp_path / "run", "stree_tab8_beam", "profile=cpu", "bench.trained=null", f"checkpoint={target}",
                f"bench.draft_checkpoint={target}", "bench.iters=4", "bench.groups=2", "bench.warmup=0")
    by = {r["line"]: r for r in rows}
    assert by["chain S=4"]["tau"] == pytest.approx(5.0) and by["tree A"]["tau"] == pytest.approx(5.0)
    assert by["beam 3x4"]["tau"] > 2.0
    assert all(r["exact"] is True and r["weights"] == str(target) for r in rows)


def test_tab8_beam_tree_is_measured_only(cli, tmp_path, train_cache):
    out = tmp_path / "run"
    rows = _run(cli, out, "stree_tab8_beam", "profile=cpu", "bench.iters=4", "bench.warmup=0",
                *_trained(train_cache))
    assert [r["line"] for r in rows] == ["autoregressive", "chain S=4", "tree A", "beam 3x4"]
    assert all(r["pair"] == "trained" and r["exact"] is True and r["set"] == "humaneval" for r in rows)
    static, beam = rows[2], rows[3]
    assert (static["tree"], beam["tree"]) == ("static", "beam")
    assert static["tree_tokens"] == beam["tree_tokens"] == 13 and beam["depth"] == 4  # seed 003: M = 3, N = 4
    assert all(r["acceptance"] == "measured" for r in rows[1:])
    status, printed, err = cli("plot", "stree_tab8_beam", "--from", str(out), "--out", str(tmp_path / "fig.png"))
    assert status == 0 and "trained" not in printed and (tmp_path / "fig.png").read_bytes()[:8] == PNG_MAGIC, err
    status, _, err = cli("run", "experiment=stree_tab8_beam", "profile=cpu", "bench.trained=null",
                         f"results_dir={tmp_path / 'bad'}")
    assert status == 2 and "the oracle cannot draft a beam tree" in err and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("groups,says", [(1, "set bench.trained.bench.drafter to a real drafter"),
                                         (2, "the oracle's reference and draws are one group's")])
def test_trained_rows_that_ask_for_the_oracle_are_one_error(cli, tmp_path, train_cache, groups, says):
    out = tmp_path / "bad"
    status, _, err = cli("run", "experiment=stree_tab3_e2e", *QUICK, "bench.trained.only=true",
                         *_trained(train_cache, drafter="oracle", groups=groups, iters=3), f"results_dir={out}")
    lines = [x for x in err.splitlines() if x.strip()]
    assert status == 2 and says in err and not out.exists()
    assert len([x for x in lines if x.startswith("error:")]) == 1
