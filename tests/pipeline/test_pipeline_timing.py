"""Timing helpers (ssmspec.bench.timing), env.json contents, synthetic prompts, the analysis notebook."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from ssmspec import paths
from ssmspec.bench.env import collect_env
from ssmspec.bench.inputs import synthetic_prompts
from ssmspec.bench.timing import hbm_fraction, measure_hbm_bandwidth, summarize, time_cuda_graph, time_eager


def test_summarize_matches_numpy_percentiles():
    samples = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0, 7.0]
    s = summarize(samples)
    for q in (50, 20, 80, 90, 99):
        assert s[f"ms_p{q}"] == pytest.approx(np.percentile(samples, q))
    assert s["n"] == 7 and summarize([2.5]) == {**{f"ms_p{q}": 2.5 for q in (50, 20, 80, 90, 99)}, "n": 1}
    with pytest.raises(ValueError, match="at least one"):
        summarize([])


def test_time_eager_runs_warmup_untimed_then_iters():
    calls = []
    samples = time_eager(lambda: calls.append(1), warmup=2, iters=5, device="cpu")
    assert len(calls) == 7 and len(samples) == 5 and all(s >= 0 for s in samples)
    with pytest.raises(ValueError, match="iters"):
        time_eager(lambda: None, warmup=0, iters=0, device="cpu")


def test_hbm_fraction():
    assert hbm_fraction(3e9, 1.0, 3000.0) == pytest.approx(1.0)  # 3 GB in 1 ms at 3 TB/s
    assert hbm_fraction(1.5e9, 1.0, 3000.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        hbm_fraction(1.0, 0.0, 3000.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_gpu_helpers_refuse_on_cpu():
    with pytest.raises(ValueError, match="CUDA"):
        time_cuda_graph(lambda: None, warmup=1, iters=1)
    with pytest.raises(ValueError, match="CUDA"):
        measure_hbm_bandwidth()


def test_env_json_contents(monkeypatch):
    monkeypatch.setenv("SSMSPEC_GIT_SHA", "abc123")
    env = collect_env(device="cpu", weights="random")
    assert env["git_sha"] == "abc123" and env["weights"] == "random" and env["device"] == "cpu"
    assert env["torch"] == torch.__version__ and "triton" in env and "driver" in env
    json.dumps(env)  # serialisable as is


def test_synthetic_prompts_seeded_and_in_range():
    a = synthetic_prompts(3, 17, 50, seed=1, min_token_id=3)
    assert a.shape == (3, 17) and a.dtype == torch.long and int(a.min()) >= 3 and int(a.max()) < 50
    assert torch.equal(a, synthetic_prompts(3, 17, 50, seed=1, min_token_id=3))
    assert not torch.equal(a, synthetic_prompts(3, 17, 50, seed=2, min_token_id=3))
    with pytest.raises(ValueError, match="min_token_id"):
        synthetic_prompts(1, 1, 3, min_token_id=3)


def test_analysis_notebook_runs_against_results(monkeypatch):
    """The notebook is valid nbformat-4 JSON and its code cells run in order against results/."""
    nb = json.loads((paths.ROOT / "notebooks" / "analysis.ipynb").read_text())
    assert nb["nbformat"] == 4 and any(c["cell_type"] == "markdown" for c in nb["cells"])
    monkeypatch.chdir(paths.ROOT / "notebooks")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    ns: dict = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), "analysis.ipynb", "exec"), ns)
    assert len(ns["results"]) > 0 and "throughput_ar" in set(ns["results"]["experiment"])
    assert ns["figures"] and all(p.suffix == ".png" for p in ns["figures"])
    assert os.path.isdir(ns["RESULTS"])


def test_wall_check_flags_idle_gaps():
    from ssmspec.bench.timing import WALL_TOLERANCE, wall_check

    ok = wall_check([1.0, 1.0, 1.0, 1.0], 4.05)
    assert ok["steps_sum_ms"] == 4.0 and abs(ok["wall_excess"] - 0.0125) < 1e-12 and not ok["wall_flag"]
    gap = wall_check([1.0, 1.0], 2.0 * (1 + WALL_TOLERANCE) + 0.01)
    assert gap["wall_flag"] and gap["loop_wall_ms"] > gap["steps_sum_ms"]
    assert wall_check([1.0], 0.9)["wall_flag"]  # a wall clock shorter than the events is as suspicious


def test_step_rows_record_the_loop_wall_clock():
    """An engine step row: the wall clock of its timed loop beside the sum of its samples (on the CPU each
    sample is a perf_counter interval inside the loop, so the wall clock bounds their sum)."""
    from ssmspec.bench.steps import step_engine, step_row
    from ssmspec.models.config import load_preset
    from ssmspec.models.model import build_model

    model = build_model(load_preset("tiny-mamba2"), seed=0)
    eng = step_engine(model, strategy="autoregressive", batch=2, context=8, graph=False, steps=6)
    row = step_row(eng, warmup=1, iters=4)
    assert row["loop_wall_ms"] >= row["steps_sum_ms"] > 0 and row["steps_sum_ms"] == sum(row["samples_ms"])
    assert row["wall_excess"] == row["loop_wall_ms"] / row["steps_sum_ms"] - 1
    assert isinstance(row["wall_flag"], bool)
