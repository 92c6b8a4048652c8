"""Snakes and Ladders end to end (bench/e2e_snl.py) on CPU: the experiments read the prompt sets from disk (a
small MT-Bench file written here; HumanEval from its package; GSM8K absent -> skipped rows naming the fetch),
decode them through the engine with the oracle's stated acceptance or the measured PNG one, stay lossless, and
draw their figures; one engine decodes group after group with the same output as a fresh generate()."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from pipeline_helpers import run_rows

from ssmspec import paths
from ssmspec.bench import e2e_snl
from ssmspec.bench.e2e import expected_accepted
from ssmspec.bench.e2e_snl import GroupOracle, decode, expected_accepted_chains, pad_group
from ssmspec.engine import Engine
from ssmspec.engine.generate import generate
from ssmspec.models import build_model, load_preset
from ssmspec.plots.e2e_snl import fig4_best
from ssmspec.strategies import SpecConfig

QUESTION = "Compose a haiku about state space models."
TAB5 = ["experiment=snl_tab5_e2e", "profile=cpu", "bench.new_tokens=9", "data.max_prompt_len=64", "bench.groups=2",
        "bench.trained=null"]  # the trained pair's rows: test_acc_e2e_rows.py
FIG4 = ["experiment=snl_fig4_multiseq", "profile=cpu", "bench.new_tokens=8", "bench.batch=[1,2]",
        "bench.drafts=[0,1,2]", "data.max_prompt_len=16", "bench.groups=1", "bench.trained=null"]


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """A data folder holding one MT-Bench question and no GSM8K (the hub is off: nothing may be fetched)."""
    root = tmp_path / "data"
    (root / "mtbench").mkdir(parents=True)
    row = {"question_id": 81, "category": "writing", "turns": [QUESTION, "Now in French."]}
    (root / "mtbench" / "question.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setattr(paths, "DATA_DIR", root)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root




def test_expected_accepted_of_the_best_chain():
    for alpha in (0.0, 0.3, 0.8, 1.0):
        assert expected_accepted_chains(alpha, 5, 1) == pytest.approx(expected_accepted(alpha, 5))
    assert expected_accepted_chains(1.0, 6, 3) == 6 and expected_accepted_chains(0.5, 6, 0) == 0
    # two chains of one token: accepted unless both miss
    assert expected_accepted_chains(0.5, 1, 2) == pytest.approx(0.75)
    vals = [expected_accepted_chains(0.51, 6, d) for d in (1, 2, 3, 4)]
    assert vals == sorted(vals) and len(set(vals)) == 4
    # the stated default reproduces the paper's implied 1.7 accepted drafts per step at PNG(6, 2)
    b = yaml.safe_load((paths.CONF_DIR / "experiment" / "snl_tab5_e2e.yaml").read_text())["bench"]
    assert abs(expected_accepted_chains(b["alpha"], b["S"], b["drafts"]) - 1.70) < 0.03


@pytest.mark.parametrize(("preset", "strategy"), [("tiny-mamba2", "activation_replay"),
                                                  ("tiny-hybrid", "joint_attainment")])
def test_one_engine_decodes_group_after_group_like_a_fresh_generate(preset, strategy):
    model = build_model(load_preset(preset), seed=0, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    groups = [[torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9)] for _ in range(2)]
    new, S = 12, 3
    refs = [generate(model, grp, max_new_tokens=new).sequences for grp in groups]
    pad = lambda r: [x + [x[-1]] * (new + S + 1 - len(x)) for x in r]  # noqa: E731
    oracle = GroupOracle(p=1.0, draft_len=S, num_drafts=2, reference=pad(refs[0]), vocab_size=300)
    eng = Engine(model, batch=2, prefill_len=9, max_new_tokens=new, strategy=strategy, drafter=oracle,
                 spec=SpecConfig(draft_len=S, num_drafts=2), cuda_graph=False)
    first_ref = None
    for grp, ref in zip(groups, refs):
        oracle.reference = pad(ref)
        ids, valid = pad_group(grp, 9, model.cfg.pad_token_id, "cpu")
        out = decode(eng, ids, valid, grp)
        first_ref = oracle.ref if first_ref is None else first_ref
        assert oracle.ref is first_ref  # re-armed in place: a captured graph reads this very tensor
        assert out.sequences == ref  # lossless, and nothing of the previous group leaks into this one
        # every draft is right: (new - 1) decode tokens in steps of S + 1, the last one cut by the budget
        assert out.emitted == 2 * (new - 1) and set(out.accepted) == {S}
        assert len(out.step_ms) == math.ceil((new - 1) / (S + 1))


def test_tab5_reads_the_sets_on_disk_and_skips_the_missing_one(cli, tmp_path, data_dir):
    rows = run_rows(cli, tmp_path, TAB5, "bench.alpha=1.0")
    by = {(r["set"], r["line"]): r for r in rows}
    lines = ["autoregressive", "joint_attainment + oracle(6,2)", "activation_replay + oracle(6,2)"]  # who drafted
    assert list(by) == [(s, ln) for s in ("mtbench", "gsm8k", "humaneval") for ln in lines]
    for ln in lines:
        gsm = by[("gsm8k", ln)]
        assert gsm["status"] == "skipped" and "python -m ssmspec.data.fetch" in gsm["reason"]
    # the one question written above, as a chat turn of the byte tokenizer (no template): groups capped at 1
    mt = by[("mtbench", "autoregressive")]
    assert mt["groups"] == 1 and mt["prompts"] == 1
    assert mt["prompt_len_max"] == len(f"User: {QUESTION}\nAssistant:".encode())
    assert by[("humaneval", "autoregressive")]["groups"] == 2 and by[("humaneval", "autoregressive")]["prompt_len_max"] == 64
    for (s, ln), r in by.items():
        if r["status"] != "ok":
            continue
        n = r["groups"] * r["batch"]
        assert r["tokens_emitted"] == n * 8 and r["ref_match"] == 1.0 and r["timing"] == "eager"
        assert r["tokens_per_s"] == pytest.approx(r["tokens_emitted"] / r["decode_s"])
        assert r["decode_s"] == pytest.approx(sum(r["samples_ms"]) * 1e-3) and len(r["samples_ms"]) == r["groups"]
        ar = by[(s, "autoregressive")]
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / ar["tokens_per_s"])
        # the decode loop's wall clock beside its step events, as step rows (timing.wall_check)
        assert r["steps_sum_ms"] == pytest.approx(r["decode_s"] * 1e3) and r["loop_wall_ms"] > 0
        assert r["wall_excess"] == pytest.approx(r["loop_wall_ms"] / r["steps_sum_ms"] - 1)
        assert r["wall_flag"] == (abs(r["wall_excess"]) > 0.02)
        assert r["sequence_steps"] == r["steps"] * r["batch"]
        if r["drafts"]:  # every draft right: 6 accepted per step, 8 decode tokens in 2 steps of 7 (last cut)
            assert r["acceptance"] == "oracle" and r["alpha"] == 1.0 and r["expected_accepted"] == 6
            assert r["oracle"] == "forced" and r["draws"] == "weyl" and r["drafter"] == "oracle"
            assert r["accepted_hist"] == {"6": 2 * n} and r["mean_accepted"] == 6 and r["steps"] == 2 * r["groups"]
            assert r["paper_speedup"] > 1.4
            # designed: 7 tokens a step; measured: the last step of each sequence is cut at the budget (8 of 14)
            assert r["tokens_per_s_designed"] == pytest.approx(r["sequence_steps"] * 7 / r["decode_s"])
            assert r["tokens_per_s"] == pytest.approx(r["tokens_per_s_designed"] * 8 / 14)
            assert r["accepted_gap"] == 0.0 and r["accepted_within"] is True
            assert r["speedup_designed"] == pytest.approx(r["tokens_per_s_designed"] / ar["tokens_per_s"])
        else:
            assert r["acceptance"] == "none" and r["steps"] == 8 * r["groups"] and r["speedup"] == 1.0
            assert r["tokens_per_s_designed"] == r["tokens_per_s"] and r["accepted_gap"] is None


def test_tab5_png_drafter_records_its_measured_acceptance(cli, tmp_path, data_dir):
    rows = run_rows(cli, tmp_path, TAB5, "data=humaneval", "bench.drafter=png", "bench.batch=2", plot=False)
    assert {r["set"] for r in rows} == {"humaneval"} and len(rows) == 3
    for r in (r for r in rows if r["drafts"]):
        assert r["acceptance"] == "measured" and r["alpha"] is None and r["drafter"] == "png" and r["ngram"] == 3
        assert "PNG(6,2)" in r["line"] and r["tokens_per_s_designed"] is None and r["accepted_within"] is None
        assert r["ref_match"] == 1.0  # greedy verification of real n-gram drafts is lossless
        n = sum(r["accepted_hist"].values())
        assert n >= r["steps"] and r["mean_accepted"] == pytest.approx(
            sum(int(k) * v for k, v in r["accepted_hist"].items()) / n)


def test_fig4_throughput_vs_drafts_per_batch(cli, tmp_path):
    rows = run_rows(cli, tmp_path, FIG4, "bench.alpha=0.6", "bench.batch=[1,2,1000]")
    ok = [r for r in rows if r["status"] == "ok"]
    assert [(r["batch"], r["drafts"], r["strategy"]) for r in ok] == [
        (b, d, s) for b in (1, 2) for d, s in [(0, "autoregressive"), (1, "joint_attainment"), (1, "activation_replay"),
                                               (2, "joint_attainment"), (2, "activation_replay")]]
    for r in ok:
        assert r["set"] == "humaneval" and r["tokens_emitted"] == r["batch"] * 7 and r["ref_match"] == 1.0
        assert r["gain"] == pytest.approx(r["speedup"] - 1.0)
        if r["drafts"]:
            assert r["acceptance"] == "oracle" and r["alpha"] == 0.6 and r["S"] == 6
            assert r["line"] == f"{r['strategy']} + oracle(6,{r['drafts']})"
            assert r["expected_accepted"] == pytest.approx(expected_accepted_chains(0.6, 6, r["drafts"]))
            assert sum(r["accepted_hist"].values()) == r["sequence_steps"] >= r["steps"]
            assert r["steps_needed"] > 0 and r["speedup_designed"] > 0
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert len(skipped) == 1 and skipped[0]["batch"] == 1000 and "fewer than one batch" in skipped[0]["reason"]
    best = fig4_best(pd.DataFrame(ok))
    for b in best.itertuples():  # the best draft count at the designed acceptance
        pts = [r for r in ok if r["batch"] == b.batch and r["strategy"] in ("autoregressive", b.strategy)]
        assert b.tokens_per_s == max(r["tokens_per_s_designed"] for r in pts)


def _checkpoint_with_tokenizer(path: Path) -> Path:
    """A tiny mamba2 checkpoint with a byte-level BPE tokenizer of its own next to config.json: one token per
    byte, except that three merges make "User" one token (so its token counts differ from the byte tokenizer's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Mamba2Config, Mamba2ForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({ch: i + 3 for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    merges = [("U", "s"), ("Us", "e"), ("Use", "r")]
    vocab.update({"Us": len(vocab), "Use": len(vocab) + 1, "User": len(vocab) + 2})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    cfg = Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, chunk_size=8,
                       num_hidden_layers=2, vocab_size=len(vocab), tie_word_embeddings=True)
    Mamba2ForCausalLM(cfg).save_pretrained(path)
    return path


def test_tab5_on_a_checkpoint_runs_the_png_drafter_on_its_tokens(cli, tmp_path, data_dir):
    ckpt = _checkpoint_with_tokenizer(tmp_path / "ckpt")
    rows = run_rows(cli, tmp_path, TAB5, "data=mtbench", f"checkpoint={ckpt}", plot=False)
    assert [r["line"] for r in rows] == ["autoregressive", "joint_attainment + PNG(6,2)", "activation_replay + PNG(6,2)"]
    assert all(r["draws"] is None for r in rows)
    for r in rows:
        assert r["status"] == "ok" and r["model"] == "ckpt" and r["weights"] == str(ckpt) and r["ref_match"] == 1.0
        # the checkpoint's tokenizer read the prompt (the plain chat frame: it has no template): "User" is one token
        assert r["prompt_len_max"] == len(f"User: {QUESTION}\nAssistant:".encode()) - 3
        if r["drafts"]:
            assert r["drafter"] == "png" and r["acceptance"] == "measured" and r["alpha"] is None


def test_fig4_points_that_cannot_fit_or_run_out_of_memory_are_rows(cli, tmp_path, monkeypatch):
    real_plan, real_decode = e2e_snl.plan_point, e2e_snl.decode

    def plan(model, strategy, *, batch, **kw):  # batch 2 does not fit next to the weights
        return (False, 2 ** 40, 2 ** 30) if batch == 2 else real_plan(model, strategy, batch=batch, **kw)

    def decode(eng, *args):  # joint attainment's engine runs out of memory
        if eng.strategy.name == "joint_attainment":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real_decode(eng, *args)

    monkeypatch.setattr(e2e_snl, "plan_point", plan)
    monkeypatch.setattr(e2e_snl, "decode", decode)
    rows = run_rows(cli, tmp_path, FIG4, "bench.drafts=[0,1]")
    status = [(r["batch"], r["strategy"], r["status"]) for r in rows]
    # batch 2: its autoregressive line cannot fit, so no baseline and no oracle truth: the batch ends there
    assert status == [(1, "autoregressive", "ok"), (1, "joint_attainment", "oom"), (1, "activation_replay", "ok"),
                      (2, "autoregressive", "skipped")]
    assert "1.0 TiB beside the weights but 1.0 GiB are free" in rows[-1]["reason"]
    assert "out of memory" in rows[1]["reason"] and rows[1]["speedup"] is None


def test_fig4_forced_and_compared_oracle_agree_on_fp32(cli, tmp_path):
    """Forced verification accepts the kept tokens; on fp32 they are the target's own, so token comparison
    accepts the same counts and both runs emit the autoregressive output."""
    runs = {}
    for mode in ("forced", "compare"):
        rows = run_rows(cli, tmp_path / mode, FIG4, "bench.batch=[2]", "bench.drafts=[0,2]", f"bench.oracle={mode}",
                    plot=False)
        runs[mode] = [r for r in rows if r["drafts"]]
        assert all(r["oracle"] == mode and r["ref_match"] == 1.0 for r in runs[mode])
    assert [r["accepted_hist"] for r in runs["forced"]] == [r["accepted_hist"] for r in runs["compare"]]


@pytest.mark.parametrize(("argv", "message"), [
    (TAB5 + ["bench.alpha=1.5"], "bench.alpha is the oracle's per-token acceptance"),
    (TAB5 + ["bench.strategies=[snapshot]"], "bench.strategies takes joint_attainment, activation_replay"),
    (TAB5 + ["bench.oracle=exact"], "bench.oracle must be forced or compare"),
    (FIG4 + ["data=benchmarks"], "choose one with data=<set>"),
    (FIG4 + ["data=gsm8k"], "python -m ssmspec.data.fetch"),
], ids=["alpha", "strategy", "oracle-mode", "fig4-several-sets", "fig4-missing-set"])
def test_bad_settings_end_in_one_message(cli, tmp_path, data_dir, argv, message):
    status, _, err = cli("run", *argv, f"results_dir={tmp_path / 'run'}")
    assert status == 2 and message in err
    assert not (tmp_path / "run").exists()


FIG8 = ["experiment=replay_fig8_throughput", "profile=cpu", "bench.warmup=0", "bench.iters=3", "bench.batch=[3]",
        "bench.prompt_len=64", "bench.snapshot_S=[2]", "bench.replay_S=[2]", "bench.trained=null"]


def test_fig8_on_a_checkpoint_drafts_with_png_on_the_prompt_set(cli, tmp_path, data_dir):
    """replay_fig8_throughput with checkpoint=: the real PNG drafter on the checkpoint's tokens of data=, the
    acceptance measured; a batch larger than the set cycles through it; a set not on disk is skipped rows."""
    ckpt = _checkpoint_with_tokenizer(tmp_path / "ckpt")
    rows = run_rows(cli, tmp_path / "a", FIG8, "data=mtbench", f"checkpoint={ckpt}", plot=False)
    assert [r["line"] for r in rows] == ["autoregressive", "replay", "snapshot spec S=2", "replay spec S=2"]
    for r in rows:
        assert r["status"] == "ok" and r["model"] == "ckpt" and r["set"] == "mtbench"
        assert r["prompt_len_max"] == len(f"User: {QUESTION}\nAssistant:".encode()) - 3  # its tokenizer's count
        assert sum(r["accepted_hist"].values()) == 3 * r["batch"]  # every timed step of every sequence
        if r["S"]:
            assert r["drafter"] == "png" and r["acceptance"] == "measured" and r["alpha"] is None
            assert r["expected_accepted"] is None and r["ngram"] == 3 and r["oracle"] is None
    rows = run_rows(cli, tmp_path / "b", FIG8, "data=gsm8k", f"checkpoint={ckpt}", plot=False)
    assert {r["status"] for r in rows} == {"skipped"} and all("ssmspec.data.fetch" in r["reason"] for r in rows)
    status, _, err = cli("run", *FIG8, f"checkpoint={ckpt}", "bench.drafter=ngrams", f"results_dir={tmp_path / 'c'}")
    assert status != 0 and "bench.drafter is one of auto, oracle, png" in err
