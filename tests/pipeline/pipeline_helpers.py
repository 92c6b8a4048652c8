"""Shared settings and helpers of the pipeline tests."""
from __future__ import annotations

import json
from pathlib import Path

# a throughput_ar run small enough for a test: one tiny preset, 2 batch sizes x 1 context, 2 samples
TINY = ["experiment=throughput_ar", "profile=cpu", "bench.presets=[tiny-mamba2]", "bench.batch=[1,2]",
        "bench.context=[8]", "bench.warmup=0", "bench.iters=2"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST = ["profile=cpu", "bench.warmup=0", "bench.iters=2"]  # step experiments: eager, two samples


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def run_and_plot(cli, tmp_path: Path, exp_id: str, *extra: str) -> list[dict]:
    """Run ``exp_id`` with FAST settings into tmp_path/run, draw its figure, return its rows."""
    out = tmp_path / "run"
    status, _, err = cli("run", f"experiment={exp_id}", *FAST, *extra, f"results_dir={out}")
    assert status == 0, err
    png = tmp_path / "fig.png"
    status, _, err = cli("plot", exp_id, "--from", str(out), "--out", str(png))
    assert status == 0, err
    assert png.read_bytes()[:8] == PNG_MAGIC
    return rows_of(out)


def run_rows(cli, tmp_path: Path, argv: list[str], *extra: str, plot: bool = True) -> list[dict]:
    """Run ``argv`` (experiment=<id> first) plus ``extra`` into tmp_path/run, draw its figure unless
    ``plot=False``, return its rows."""
    out = tmp_path / "run"
    status, _, err = cli("run", *argv, *extra, f"results_dir={out}")
    assert status == 0, err
    if plot:
        png = tmp_path / "fig.png"
        status, _, err = cli("plot", argv[0].split("=")[1], "--from", str(out), "--out", str(png))
        assert status == 0, err
        assert png.read_bytes()[:8] == PNG_MAGIC
    return rows_of(out)
