"""stree_tab1_sizes (bench/stree_sizes.py) on CPU: one model call per line and size through the engine,
overhead against autoregressive, skipped rows for a size that does not fit, settings refused before running."""
from __future__ import annotations

import json

import pytest
import torch

from ssmspec.bench import steps_replay
from ssmspec.models.config import load_preset

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["experiment=stree_tab1_sizes", "profile=cpu", "bench.warmup=0", "bench.iters=2", "bench.tree_tokens=8",
         "bench.chain_tokens=3", "bench.context=4"]


def test_lines_overheads_and_a_size_that_does_not_fit(cli, tmp_path, monkeypatch):
    tiny, big = load_preset("tiny-mamba2"), load_preset("mamba2-130m")
    budget = 4 * (tiny.num_parameters() + big.num_parameters()) // 2  # fp32: room for tiny-mamba2 only
    monkeypatch.setattr(steps_replay, "free_bytes", lambda device: budget)
    out = tmp_path / "run"
    status, _, err = cli("run", *SMALL, "bench.presets=[tiny-mamba2,mamba2-130m]", f"results_dir={out}")
    assert status == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    ok = {r["line"]: r for r in rows if r["model"] == "tiny-mamba2"}
    assert [r["status"] for r in ok.values()] == ["ok"] * 3
    assert {k: r["tokens"] for k, r in ok.items()} == {"autoregressive": 1, "stree": 8, "vanilla_sd": 3}
    assert ok["stree"]["strategy"] == "stree" and ok["vanilla_sd"]["strategy"] == "activation_replay"
    for r in ok.values():
        assert r["overhead"] == pytest.approx(r["ms_p50"] / ok["autoregressive"]["ms_p50"])
        assert len(r["samples_ms"]) == 2 and r["acceptance"] == "not measured"
    skipped = [r for r in rows if r["model"] == "mamba2-130m"]
    assert len(skipped) == 3 and all(r["status"] == "skipped" and "are free" in r["reason"] for r in skipped)
    png = tmp_path / "fig.png"
    status, _, err = cli("plot", "stree_tab1_sizes", "--from", str(out), "--out", str(png))
    assert status == 0, err
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("override, message", [
    ("bench.tree_tokens=1", "bench.tree_tokens and bench.chain_tokens count the pending token"),
    ("bench.chain_strategy=stree", "bench.chain_strategy is one of"),
    ("bench.presets=[]", "bench.presets is empty"),
])
def test_bad_settings_are_refused_before_running(cli, tmp_path, override, message):
    out = tmp_path / "run"
    status, _, err = cli("run", *SMALL, "bench.presets=[tiny-mamba2]", override, f"results_dir={out}")
    assert status == 2 and message in err, err
    assert not out.exists()


def test_a_size_whose_weights_run_out_of_memory_is_reported_not_a_crash(cli, tmp_path, monkeypatch):
    """The plan can pass and the build still fail (other processes on the GPU): oom rows, and the run goes on."""
    from ssmspec.bench import stree_sizes

    real = stree_sizes.model_for

    def model_for(cfg, preset, max_context):
        if preset == "mamba2-130m":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 588.00 MiB.")
        return real(cfg, preset, max_context)

    monkeypatch.setattr(stree_sizes, "model_for", model_for)
    out = tmp_path / "run"
    status, _, err = cli("run", *SMALL, "bench.presets=[mamba2-130m,tiny-mamba2]", f"results_dir={out}")
    assert status == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    big = [r for r in rows if r["model"] == "mamba2-130m"]
    assert len(big) == 3 and all(r["status"] == "oom" and "out of memory" in r["reason"] for r in big)
    assert [r["status"] for r in rows if r["model"] == "tiny-mamba2"] == ["ok"] * 3
