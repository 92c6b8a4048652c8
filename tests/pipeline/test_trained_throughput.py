"""Throughput rows over several groups of prompts (``bench.throughput.sequences``, ``bench/trained_throughput.py``)
on the tiny trained pair, on CPU: one engine per line decodes the groups in turn and its one row pools them -- the
tokens, accepted counts and step samples of one row per group from a fresh engine, every rate made again from the
sums. Null is one group, the set's first prompts, as before the key existed."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from ssmspec.bench.timing import summarize
from ssmspec.bench.trained_throughput import check_throughput, pool_groups, throughput_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TP = dict(sets=["validation"], batch=[1], draft_len=[3], R=8, prompt_len=32, warmup=1, iters=4,
          lines=[{"drafter": "draft_model", "strategy": "replay"}, {"drafter": "png", "strategy": "snapshot"}])
# fields that are times, or made from times: the rest of a row is decided by the prompts and the models
TIMED = {"samples_ms", "ms_p50", "ms_p20", "ms_p80", "ms_p90", "ms_p99", "loop_wall_ms", "steps_sum_ms", "wall_excess",
         "wall_flag", "tokens_per_s", "tokens_per_s_wall", "tokens_per_s_designed", "speedup_vs_ar",
         "draft_samples_ms", "draft_ms", "draft_ms_p90", "draft_call_ms"}


@pytest.fixture(scope="module")
def pair(train_cache):
    """The tiny pair (trained into the session's cache by whichever test asks first) and three validation prompts."""
    from ssmspec.bench.trained import load_pair, train_run, validation_set

    b = OmegaConf.load(Path(__file__).parents[2] / "conf/experiment/trained_acceptance.yaml").bench
    b.cache_dir = str(train_cache)
    p = load_pair(b, "cpu", "mamba2", train_run(b))
    return SimpleNamespace(pair=p, png=b.png, prompts=validation_set(p, b).prompts[:3])


def rows(pair, prompts, device: str = "cpu", **over) -> dict:
    """(batch, line) -> throughput row of the set ``prompts`` with ``TP`` updated by ``over``."""
    b = OmegaConf.create({"throughput": {**TP, **over}, "png": pair.png})
    p = pair.pair
    out = throughput_rows(p.entry, p.manifest, p.names, {"validation": prompts}, b,
                          OmegaConf.create({"device": device}), {})
    return {(r["batch"], r["line"]): r for r in out}


def test_a_row_pools_the_groups_its_engine_decodes(pair):
    """sequences: 3 -- batch 1: prompts 0, 1, 2 in turn; batch 2: (0, 1), then (2, 0) (the set cycles). Each
    pooled row holds exactly what fresh single-group rows of those groups hold; a row that timed fewer groups, or
    took a group's counts twice, differs from their sums."""
    p0, p1, p2 = pair.prompts
    pooled = rows(pair, pair.prompts, batch=[1, 2], sequences=3)
    singles = {1: [rows(pair, [q]) for q in (p0, p1, p2)], 2: [rows(pair, g, batch=[2]) for g in ([p0, p1], [p2, p0])]}
    assert len(pooled) == 6
    for (bsz, line), r in pooled.items():
        parts = [s[(bsz, line)] for s in singles[bsz]]
        assert r["status"] == "ok" and r["groups"] == len(parts) and all(s["groups"] == 1 for s in parts)
        for key in ("tokens_emitted", "n", "sequence_steps"):
            assert r[key] == sum(s[key] for s in parts), key
        assert Counter(r["accepted_hist"]) == sum((Counter(s["accepted_hist"]) for s in parts), Counter())
        acc = sum(s["mean_accepted"] * s["sequence_steps"] for s in parts)
        assert r["mean_accepted"] == pytest.approx(acc / r["sequence_steps"])
        assert r["tokens_per_step"] == pytest.approx(r["tokens_emitted"] / r["sequence_steps"])
        assert r["ref_match"] == pytest.approx(sum(s["ref_match"] for s in parts) / len(parts)) == 1.0
        # rates and summaries from the row's own pooled samples
        assert len(r["samples_ms"]) == r["n"] == len(parts) * TP["iters"]
        assert r["steps_sum_ms"] == pytest.approx(sum(r["samples_ms"]))
        assert r["tokens_per_s"] == pytest.approx(r["tokens_emitted"] / (r["steps_sum_ms"] * 1e-3))
        assert r["tokens_per_s_wall"] == pytest.approx(r["tokens_emitted"] / (r["loop_wall_ms"] * 1e-3))
        assert r["wall_excess"] == pytest.approx(r["loop_wall_ms"] / r["steps_sum_ms"] - 1)
        assert r["ms_p50"] == summarize(r["samples_ms"])["ms_p50"]
        ar = pooled[(bsz, "autoregressive")]
        assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"] / ar["tokens_per_s"])
        if r["drafter"] == "draft_model":
            assert len(r["draft_samples_ms"]) == r["n"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_groups_pool_as_their_single_rows(pair):
    """On the GPU, captured: every line decodes three groups at batch 1 and two at batch 2 (a captured engine's
    graphs read its drafter's buffers, so each group gets a fresh engine: reusing one read freed memory), every
    group emits the autoregressive tokens (float32), and each pooled row's accepted counts are its groups'."""
    p0, p1, p2 = pair.prompts
    pooled = rows(pair, pair.prompts, "cuda", batch=[1, 2], sequences=3, dtype="float32", cuda_graph=True)
    singles = {1: [rows(pair, [q], "cuda", dtype="float32", cuda_graph=True) for q in (p0, p1, p2)],
               2: [rows(pair, g, "cuda", batch=[2], dtype="float32", cuda_graph=True) for g in ([p0, p1], [p2, p0])]}
    assert len(pooled) == 6
    for (bsz, line), r in pooled.items():
        parts = [s[(bsz, line)] for s in singles[bsz]]
        assert r["status"] == "ok" and r["timing"] == "cuda_graph" and r["groups"] == len(parts), (bsz, line)
        assert r["ref_match"] == 1.0 and r["kernels_per_step"] > 0, (bsz, line)
        assert Counter(r["accepted_hist"]) == sum((Counter(s["accepted_hist"]) for s in parts), Counter())


def test_null_sequences_is_one_group_of_the_first_prompts(pair):
    """The row of ``sequences`` absent is that of one engine prefilled once with the set's first prompt and timed
    through ``throughput_row``, as before the key existed (its times aside)."""
    from ssmspec.bench.e2e import throughput_row
    from ssmspec.bench.prompt_groups import pad_group
    from ssmspec.bench.real_drafters import measured_drafter
    from ssmspec.engine import Engine
    from ssmspec.engine.generate import generate
    from ssmspec.models.loading import load_model
    from ssmspec.strategies import SpecConfig

    got = rows(pair, pair.prompts)
    assert {r["groups"] for r in got.values()} == {1}
    p = pair.pair
    target, draft = (load_model(p.entry / p.manifest["models"][n]["path"], device="cpu") for n in p.names)
    H = (TP["warmup"] + TP["iters"] + 2) * (TP["draft_len"][0] + 1)
    sample = [pair.prompts[0][-TP["prompt_len"]:]]
    ids, valid = pad_group(sample, TP["prompt_len"], target.cfg.pad_token_id, "cpu")
    reference = generate(target, sample, max_new_tokens=H, strategy="autoregressive").sequences
    eng = Engine(target, batch=1, prefill_len=TP["prompt_len"], max_new_tokens=H, strategy="replay",
                 drafter=measured_drafter("draft_model", target=target, draft=draft, draft_len=3),
                 spec=SpecConfig(draft_len=3, buffer_size=TP["R"]))
    eng.prefill(ids, valid, sample)
    r = got[(1, "replay + draft_model")]
    want = throughput_row(eng, warmup=TP["warmup"], iters=TP["iters"], reference=reference, oracle_alpha=None,
                          **{k: r[k] for k in ("kind", "dtype", "prompt_len", "timing", "set", "batch", "line",
                                               "drafter", "S", "groups")})
    assert {k: v for k, v in r.items() if k not in TIMED} == {k: v for k, v in want.items() if k not in TIMED}


def test_pooled_wall_flag_and_ref_match_come_from_the_sums():
    """The first group's wall clock alone exceeds its steps by 5% (flagged); pooled with two that do not, the
    loop's excess is 0.1 / 12 (not flagged). ref_match is the share of all three groups' sequences."""
    def part(ms: float, wall: float, ref: float) -> tuple[dict, list[int]]:
        return ({"samples_ms": [ms, ms], "loop_wall_ms": wall, "tokens_emitted": 5, "ref_match": ref,
                 "expected_accepted": None, "wall_flag": wall > 2 * ms * 1.02}, [1, 2])

    r = pool_groups([part(1.0, 2.1, 1.0), part(3.0, 6.0, 0.0), part(2.0, 4.0, 1.0)])
    assert r["groups"] == 3 and r["n"] == 6 and r["tokens_emitted"] == 15 and r["accepted_hist"] == {"1": 3, "2": 3}
    assert r["steps_sum_ms"] == 12.0 and r["loop_wall_ms"] == pytest.approx(12.1)
    assert r["wall_excess"] == pytest.approx(0.1 / 12) and r["wall_flag"] is False
    assert r["tokens_per_s"] == pytest.approx(15 / 0.012) and r["ref_match"] == pytest.approx(2 / 3)
    assert r["mean_accepted"] == 1.5 and r["sequence_steps"] == 6 and r["tokens_per_step"] == 2.5


@pytest.mark.parametrize("value", [0, "many", True])
def test_sequences_must_be_null_or_a_positive_int(value):
    t = OmegaConf.create({**TP, "sequences": value})
    with pytest.raises(ValueError, match=r"bench.throughput.sequences must be null .* or an int >= 1") as e:
        check_throughput(t)
    assert len(str(e.value).splitlines()) == 1
    for ok in (None, 1, 16):
        check_throughput(OmegaConf.create({**TP, "sequences": ok}))


def test_bad_sequences_end_the_run_in_one_line(cli, tmp_path):
    tp = ("+bench.throughput={sets: [validation], batch: [1], draft_len: [3], R: 8, prompt_len: 32, warmup: 1, "
          "iters: 2, sequences: 0, lines: [{drafter: png, strategy: replay}]}")
    status, _, err = cli("run", "experiment=trained_acceptance", "profile=cpu", tp, f"results_dir={tmp_path / 'run'}")
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert status == 2 and len(errors) == 1 and "bench.throughput.sequences" in errors[0], err
    assert not (tmp_path / "run").exists()
