"""``decode_kernels`` (bench/gemv.py) runs end to end on CPU -- the twins, and the Triton kernels under the
interpreter -- and draws its figure; a row count the kernel cannot take is refused before anything runs."""
from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # before any Triton module is imported (see tests/ops/conftest.py)
    os.environ["TRITON_INTERPRET"] = "1"

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["experiment=decode_kernels", "profile=cpu", "bench.warmup=0", "bench.iters=2"]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_decode_kernels_runs_and_plots(cli, tmp_path, backend):
    out = tmp_path / "run"
    status, _, err = cli("run", *SMALL, "bench.models=[tiny-hybrid]", "bench.rows=[1,3]", f"bench.backend={backend}",
                         f"results_dir={out}")
    assert status == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    conv = [r for r in rows if r["kind"] == "conv_ssm"]  # tiny-hybrid has Mamba-2 mixers: batches 1 and 4
    assert {(r["batch"], r["impl"]) for r in conv} == {(b, i) for b in (1, 4) for i in ("fused", "unfused", "mamba_ssm")}
    assert all(r["status"] == "ok" and r["ms_p50"] > 0 for r in conv if r["impl"] != "mamba_ssm")
    assert all(r["status"] == "skipped" for r in conv if r["impl"] == "mamba_ssm")  # CPU: no baseline
    assert all(r["speedup_vs_unfused"] > 0 for r in conv if r["impl"] == "fused")
    rows = [r for r in rows if r["kind"] == "gemv"]
    layers = {"in_proj": "add", "out_proj": "gated", "q_proj": "add", "kv_proj": "add", "o_proj": None,
              "up_proj": "add", "down_proj": None}
    want = {(layer, m, impl) for layer, norm in layers.items() for m in (1, 3)
            for impl in ("copy", "cublas", "ours") + (("unfused", "fused") if norm else ())}
    assert {(r["layer"], r["M"], r["impl"]) for r in rows} == want
    for r in rows:
        assert r["status"] == "ok" and len(r["samples_ms"]) == 2 and r["gbps"] > 0 and r["hbm_fraction"] is None
        if r["impl"] in ("ours", "fused"):
            assert r["backend"] == backend and r["speedup"] > 0 and r["config"] is None  # no autotuner off CUDA
    in_proj = next(r for r in rows if r["layer"] == "in_proj")
    assert (in_proj["N"], in_proj["K"]) == (164, 64)  # tiny-hybrid: 2 x 64 + 2 x 2 x 8 + 4 heads, d_model 64
    png = tmp_path / "decode_kernels.png"
    status, _, err = cli("plot", "decode_kernels", "--from", str(out), "--out", str(png))
    assert status == 0, err
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_decode_kernels_refuses_rows_past_the_kernel(cli, tmp_path):
    status, _, err = cli("run", *SMALL, "bench.rows=[1,32]", f"results_dir={tmp_path / 'run'}")
    assert status != 0 and "bench.rows" in err
    assert not (tmp_path / "run" / "results.jsonl").exists()
