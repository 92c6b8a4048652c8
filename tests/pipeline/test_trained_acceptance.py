"""``trained_acceptance`` on CPU through the CLI: the suite trains its tiny pair (conf/train/tiny.yaml, ~30 s, once per
test session into a temporary cache), the distilled draft is accepted on held-out validation text (measured, no
oracle), n-gram lookup drafts too, every speculative line decodes exactly the autoregressive greedy output, and the
figure is drawn. The tiny target's MTP head, trained with it, agrees with the target's next-next token far above
chance and drafts through the mtp drafter."""
from __future__ import annotations

import pytest
import torch
from pipeline_helpers import run_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the reference's prompts and budget (8 x 64 tokens), one S: the acceptance is the reference's S=4 number
SMALL = ["experiment=trained_acceptance", "profile=cpu", "bench.draft_len=[4]", "bench.agree_tokens=1024"]


def test_measured_acceptance_on_the_trained_pair(cli, tmp_path, train_cache):
    rows = run_rows(cli, tmp_path, SMALL, f"bench.cache_dir={train_cache}")
    decode = [r for r in rows if r["kind"] == "decode" and r["status"] == "ok"]
    assert decode and all(r["acceptance"] == "measured" and r["pair"] == "trained" for r in decode)
    assert all(r["exact"] is True for r in decode)  # greedy verification is lossless on real drafts too
    assert {r["train_key"] for r in rows} == {decode[0]["train_key"]} and decode[0]["draft_val_kl"] > 0
    lines = {(r["set"], r["drafter"], r["S"], r["strategy"]) for r in decode}
    assert ("validation", "none", 0, "autoregressive") in lines
    for strategy in ("replay", "snapshot"):
        assert ("validation", "draft_model", 4, strategy) in lines and ("validation", "png 3..2", 4, strategy) in lines
        assert ("validation", "mtp", 4, strategy) in lines  # the tiny target carries an MTP head
    for strategy in ("stree", "replay"):
        assert ("validation", "beam_tree 2x4", 4, strategy) in lines
        assert ("validation", "static_tree A", 4, strategy) in lines
    dm = [r for r in decode if r["set"] == "validation" and r["drafter"] == "draft_model"]
    assert all(r["mean_accepted"] > 0.5 for r in dm), [r["mean_accepted"] for r in dm]  # measured: 0.59
    assert len({r["mean_accepted"] for r in dm}) == 1  # the same drafts accepted under both strategies
    for r in decode:
        assert sum(r["accepted_hist"].values()) > 0 and r["model_calls"] > 0 and len(r["samples_ms"]) > 0
        # a batch steps until its slowest sequence is done: per call and sequence, between 1 and 1 + S tokens
        assert 1.0 <= r["tokens_per_call"] <= 1 + r["S"]
    agree = [r for r in rows if r["kind"] == "agreement"]
    assert {r["set"] for r in agree} >= {"validation"}
    assert all(0 < r["draft_target_top1"] <= 1 and r["tokens"] > 0 for r in agree)
    he = [r for r in rows if r["kind"] == "decode" and r["set"] == "humaneval"]
    assert he and all(r["status"] == "ok" or r["reason"] for r in he)
    assert (tmp_path / "fig.png").is_file()


def test_an_unknown_train_run_is_one_error_line(cli, tmp_path):
    status, _, err = cli("run", *SMALL, "bench.train=nope", f"results_dir={tmp_path / 'run'}")
    assert status == 2 and "unknown training run 'nope'" in err and "conf/train" in err
    assert not (tmp_path / "run").exists()


def test_throughput_rows_time_the_engine_with_the_measured_acceptance(cli, tmp_path, train_cache):
    """The gpu profile's throughput block, on CPU (eager engine): an autoregressive line and the speculative
    lines per batch, tokens/s and their ratio beside the acceptance the trained draft earns, greedy output equal
    to the autoregressive engine's."""
    tp = ("+bench.throughput={sets: [validation], batch: [1, 2], draft_len: [3], R: 8, prompt_len: 32, dtype: auto, "
          "cuda_graph: auto, warmup: 1, iters: 4, lines: [{drafter: draft_model, strategy: replay}, "
          "{drafter: png, strategy: snapshot}]}")
    rows = run_rows(cli, tmp_path, SMALL, "bench.sets=[validation]", f"bench.cache_dir={train_cache}", tp)
    thr = [r for r in rows if r["kind"] == "throughput"]
    assert [(r["batch"], r["line"], r["S"]) for r in thr] == [
        (b, line, S) for b in (1, 2) for line, S in
        (("autoregressive", 0), ("replay + draft_model", 3), ("snapshot + png", 3))]
    assert all(r["status"] == "ok" and r["timing"] == "eager" and r["tokens_per_s"] > 0 for r in thr)
    assert all(r["ref_match"] == 1.0 for r in thr)  # float32 on CPU: every line is the greedy output
    for r in thr:
        ar = next(a for a in thr if a["batch"] == r["batch"] and a["S"] == 0)
        assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"] / ar["tokens_per_s"])
        assert r["acceptance"] == ("measured" if r["S"] else "none")
    dm = [r for r in thr if r["drafter"] == "draft_model"]
    assert all(r["mean_accepted"] > 0 and r["draft_calls"] == 3 for r in dm)


def test_a_throughput_line_of_an_unknown_drafter_is_one_error_line(cli, tmp_path, train_cache):
    tp = ("+bench.throughput={sets: [validation], batch: [1], draft_len: [3], R: 8, prompt_len: 32, warmup: 1, "
          "iters: 2, lines: [{drafter: oracle, strategy: replay}]}")
    status, _, err = cli("run", *SMALL, f"bench.cache_dir={train_cache}", tp, f"results_dir={tmp_path / 'run'}")
    assert status == 2 and "bench.throughput.lines" in err and "draft_model | png" in err
    assert not (tmp_path / "run").exists()


def test_the_tiny_targets_mtp_head_agrees_far_above_chance(train_cache):
    """The head of conf/train/tiny.yaml (read from the session's cache when the test above trained it first)."""
    from ssmspec.data.tokenizers import load_tokenizer
    from ssmspec.drafting import make_drafter
    from ssmspec.engine.generate import generate
    from ssmspec.models.loading import load_model
    from ssmspec.train.command import compose_train
    from ssmspec.train.run import train_pairs

    res = train_pairs(compose_train("tiny", [f"cache_dir={train_cache}"]))
    h = res.manifest["models"]["mamba2-target"]["mtp"]
    # chance is 1 / 512; always guessing the target's most frequent next-next token agrees ~0.1 of the time
    assert h["agreement"] > max(0.35, 3 * h["majority_agreement"]), h
    model = load_model(res.entry / "mamba2-target")
    tok = load_tokenizer(model)
    prompts = [tok.encode(t) for t in ("import os\n\n\ndef main(argv):\n    ", "class Queue:\n    def __init__(self",
                                       "    for i in range(len(")]
    want = generate(model, prompts, max_new_tokens=32).sequences
    out = generate(model, prompts, max_new_tokens=32, strategy="replay",
                   drafter=make_drafter("mtp", target=model, draft_len=3))
    assert out.sequences == want and out.mean_accepted() > 0.4, out.mean_accepted()


def test_a_family_the_train_run_lacks_is_one_error_line(cli, tmp_path, train_cache):
    status, _, err = cli("run", *SMALL, "bench.family=[mamba2,qwen3_5]", f"bench.cache_dir={train_cache}",
                         f"results_dir={tmp_path / 'run'}")
    assert status == 2 and "trains no 'qwen3_5' pair" in err and "['mamba2']" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_throughput_rows_count_the_kernels_of_a_step(cli, tmp_path, train_cache):
    """On CUDA with graphs every throughput row carries the kernels one step launches (profiled after the timed
    steps, within the engine's budget): a speculative step (its drafting, the wider verify, the verdict and the
    commit) launches more than an autoregressive one, and a whole number of kernels a step; rows at
    ``profile_batches`` carry the per-kernel table of that step, the others do not."""
    tp = ("+bench.throughput={sets: [validation], batch: [1, 2], draft_len: [3], R: 8, prompt_len: 32, "
          "dtype: auto, cuda_graph: auto, warmup: 1, iters: 4, profile_batches: [1], "
          "lines: [{drafter: draft_model, strategy: replay}, "
          "{drafter: png, strategy: replay}]}")
    rows = run_rows(cli, tmp_path, SMALL, "device=cuda", "bench.sets=[validation]", f"bench.cache_dir={train_cache}",
                    tp)
    every = [r for r in rows if r["kind"] == "throughput"]
    assert all(r["status"] == "ok" and r["timing"] == "cuda_graph" for r in every)
    thr = {r["line"]: r for r in every if r["batch"] == 1}
    ar, dm, png = thr["autoregressive"], thr["replay + draft_model"], thr["replay + png"]
    assert 0 < ar["kernels_per_step"] < min(png["kernels_per_step"], dm["kernels_per_step"])
    assert all(float(r["kernels_per_step"]).is_integer() for r in (ar, dm, png))  # every profiled step the same
    # kernel_table at bench.throughput.profile_batches only: longest first, its launches within the step's count
    assert all(("kernel_table" in r) == (r["batch"] == 1) for r in every)
    for r in thr.values():
        table = r["kernel_table"]
        us = [k["us_per_step"] for k in table]
        assert table and us == sorted(us, reverse=True) and all(u > 0 for u in us)
        assert sum(k["per_step"] for k in table) <= r["kernels_per_step"] + 1e-9
        assert 0 < sum(k["share"] for k in table) <= 1 + 1e-9
