"""The SSD scan experiments (bench/ssd.py) run end to end on CPU and draw their figures: ``ssd_kernel_fwd`` with
the reference scan and with the Triton kernel under the interpreter, ``ssd_kernel_blockt`` under the
interpreter; mamba_ssm rows say skipped; a bad block size is refused before anything is measured."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before any Triton module is imported (see tests/ops/conftest.py)
    os.environ["TRITON_INTERPRET"] = "1"

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["profile=cpu", "bench.mixers=[tiny-mamba2]", "bench.batch=[2]", "bench.warmup=0", "bench.iters=2"]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def _check_measured(r: dict) -> None:
    assert r["status"] == "ok" and len(r["samples_ms"]) == 2, r
    assert r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"] and r["bytes"] > 0
    assert r["hbm_fraction"] is None  # a GPU-only number


def _plot(cli, tmp_path: Path, exp_id: str, out: Path) -> None:
    png = tmp_path / f"{exp_id}.png"
    status, _, err = cli("plot", exp_id, "--from", str(out), "--out", str(png))
    assert status == 0, err
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("backend, initial_state", [pytest.param("reference", "false", id="reference-zero-state"),
                                                    pytest.param("triton", "true", id="interpreter-initial-state")])
def test_ssd_fwd_runs_and_plots(cli, tmp_path, backend, initial_state):
    out = tmp_path / "run"
    status, _, err = cli("run", "experiment=ssd_kernel_fwd", *SMALL, "bench.seqlen=[1,21]",
                         f"bench.backend={backend}", f"bench.initial_state={initial_state}", f"results_dir={out}")
    assert status == 0, err
    rows = _rows(out)
    assert {(r["impl"], r["seqlen"]) for r in rows} == {(i, L) for i in ("ours", "mamba_ssm") for L in (1, 21)}
    for r in rows:
        assert (r["H"], r["P"], r["N"], r["G"], r["batch"]) == (4, 16, 8, 2, 2)  # tiny-mamba2's mixer
        assert r["initial_state"] is (initial_state == "true")
        if r["impl"] == "mamba_ssm":  # no mamba_ssm in the CPU environment: said, not faked
            assert r["status"] == "skipped" and "mamba_ssm" in r["reason"]
        else:
            _check_measured(r)
            assert r["backend"] == backend
            if backend == "triton":  # the defaults the kernel ran with: tiles shrink to short prompts
                assert (r["block_t"], r["block_p"], r["num_stages"]) == (16 if r["seqlen"] == 1 else 32, 16, 2)
    _plot(cli, tmp_path, "ssd_kernel_fwd", out)


def test_ssd_blockt_runs_and_plots(cli, tmp_path):
    out = tmp_path / "run"
    status, _, err = cli("run", "experiment=ssd_kernel_blockt", *SMALL, "bench.seqlen=[40]", "bench.block_t=[16,32]",
                         "bench.num_warps=[1,2]", "bench.block_p=[null,32]", f"results_dir={out}")
    assert status == 0, err
    rows = _rows(out)
    ours = [r for r in rows if r["impl"] == "ours"]
    # tiny-mamba2 has P = 16: the default block_p is 16, and 32 covers P with a masked half
    assert sorted((r["block_t"], r["num_warps"], r["block_p"]) for r in ours) == sorted(
        (t, w, p) for t in (16, 32) for w in (1, 2) for p in (16, 32))
    for r in ours:
        _check_measured(r)
        assert r["backend"] == "triton" and r["segment_len"] == 40 and r["segments"] == 1  # no SMs to fill here
    assert [r["status"] for r in rows if r["impl"] == "mamba_ssm"] == ["skipped"]
    _plot(cli, tmp_path, "ssd_kernel_blockt", out)


def test_ssd_blockt_sweeps_segment_lengths(cli, tmp_path):
    """The segment axis: each length cuts the 40-token chains into cdiv(40, length) programs, all correct."""
    out = tmp_path / "run"
    status, _, err = cli("run", "experiment=ssd_kernel_blockt", *SMALL, "bench.seqlen=[40]", "bench.block_t=[16]",
                         "bench.segment_len=[16,32,null]", f"results_dir={out}")
    assert status == 0, err
    ours = [r for r in _rows(out) if r["impl"] == "ours"]
    assert sorted((r["segment_len"], r["segments"]) for r in ours) == [(16, 3), (32, 2), (40, 1)]
    _plot(cli, tmp_path, "ssd_kernel_blockt", out)
    status, _, err = cli("run", "experiment=ssd_kernel_blockt", *SMALL, "bench.block_t=[16,32]",
                         "bench.segment_len=[48]", f"results_dir={tmp_path / 'bad'}")
    assert status == 2 and "bench.segment_len must hold multiples of every block_t" in err


def test_ssd_blockt_refuses_a_bad_block_size_before_measuring(cli, tmp_path):
    out = tmp_path / "run"
    status, _, err = cli("run", "experiment=ssd_kernel_blockt", *SMALL, "bench.block_t=[16,48]", f"results_dir={out}")
    assert status == 2
    assert "bench.block_t must hold powers of two >= 16 (null: the default block_p), got [48]" in err
    assert not out.exists()


def test_ssd_fwdbwd_runs_and_plots(cli, tmp_path):
    """Forward and forward + backward of ours (the reference with autograd on CPU); mamba_ssm said skipped."""
    out = tmp_path / "run"
    status, _, err = cli("run", "experiment=ssd_kernel_fwdbwd", *SMALL, "bench.seqlen=[1,21]", f"results_dir={out}")
    assert status == 0, err
    rows = _rows(out)
    assert {(r["impl"], r["phase"], r["seqlen"]) for r in rows} == {
        (i, p, L) for i in ("ours", "mamba_ssm") for p in ("fwd", "fwdbwd") for L in (1, 21)}
    for r in rows:
        if r["impl"] == "mamba_ssm":
            assert r["status"] == "skipped" and "mamba_ssm" in r["reason"]
        else:
            _check_measured(r)
            assert r["backend"] == "reference" and "speedup" not in r and "grad_rel_err" not in r
    fb = {(r["phase"], r["seqlen"]): r["bytes"] for r in rows if r["impl"] == "ours"}
    assert fb[("fwdbwd", 21)] > fb[("fwd", 21)]  # the backward moves its own bytes
    _plot(cli, tmp_path, "ssd_kernel_fwdbwd", out)


def test_ssd_fwdbwd_speedup_and_gradient_agreement(cli, tmp_path, monkeypatch):
    """With a baseline present (here the reference scan standing in for mamba_ssm's, same call signature), our
    rows carry the speedup over it and, on forward + backward, the gradient agreement per input: the Triton
    kernels under the interpreter against the reference, initial state included."""
    import ssmspec.bench.ssd_grad as bench
    from ssmspec.ops.ssd_grad import ssd_chunk_scan_grad_ref

    def stand_in(x, dt, A, B, C, chunk_size, D=None, initial_states=None, dt_softplus=False, return_final_states=True):
        assert not dt_softplus and return_final_states
        return ssd_chunk_scan_grad_ref(x, dt, A, B, C, D, initial_state=initial_states, chunk_size=chunk_size)

    monkeypatch.setattr(bench, "mamba_ssm_ops", lambda: (None, stand_in, ""))
    out = tmp_path / "run"
    status, _, err = cli("run", "experiment=ssd_kernel_fwdbwd", *SMALL, "bench.seqlen=[21]", "bench.backend=triton",
                         "bench.initial_state=true", "bench.chunk_size=8", f"results_dir={out}")
    assert status == 0, err
    rows = {(r["impl"], r["phase"]): r for r in _rows(out)}
    for p in ("fwd", "fwdbwd"):
        ours, theirs = rows[("ours", p)], rows[("mamba_ssm", p)]
        assert ours["backend"] == "triton" and theirs["status"] == "ok" and theirs["chunk_size"] == 8
        assert ours["speedup"] == pytest.approx(theirs["ms_p50"] / ours["ms_p50"])
    agree = rows[("ours", "fwdbwd")]
    assert set(agree["grad_rel"]) == {"x", "dt", "A", "B", "C", "D", "s0"}
    assert agree["grad_rel_err"] == max(agree["grad_rel"].values()) < 1e-4
    assert "grad_rel_err" not in rows[("ours", "fwd")]
    _plot(cli, tmp_path, "ssd_kernel_fwdbwd", out)
