"""A run writes config.yaml, env.json and results.jsonl (atomically); multirun, --save-reference, plot,
figures and list work end to end on a tiny throughput_ar grid."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml
from pipeline_helpers import TINY

from ssmspec import paths
from ssmspec.runner import RESULT_FILES, staged_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def _no_partials(folder: Path) -> None:
    assert not [p for p in folder.rglob("*") if ".partial-" in p.name]


def test_run_writes_config_env_and_rows(cli, tmp_path):
    out = tmp_path / "run"
    status, _, err = cli("run", *TINY, f"results_dir={out}")
    assert status == 0, err
    assert sorted(p.name for p in out.iterdir()) == sorted(RESULT_FILES)
    _no_partials(tmp_path)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert (cfg["profile"], cfg["device"], cfg["dtype"]) == ("cpu", "cpu", "float32")
    assert cfg["experiment"]["id"] == "throughput_ar" and cfg["bench"]["batch"] == [1, 2]
    env = json.loads((out / "env.json").read_text())
    for key in ("device", "device_name", "driver", "torch", "triton", "git_sha", "weights"):
        assert key in env
    assert env["weights"] == "random" and env["device"] == "cpu"
    rows = _rows(out)
    assert [(r["phase"], r["batch"]) for r in rows] == [("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)]
    for r in rows:
        assert r["experiment"] == "throughput_ar" and r["weights"] == "random" and r["status"] == "ok"
        assert r["model"] == "tiny-mamba2" and r["context"] == 8 and r["strategy"] == "autoregressive"
        assert len(r["samples_ms"]) == 2 == r["n"]
        assert r["ms_p50"] == pytest.approx(statistics.median(r["samples_ms"]))
        assert r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"] <= r["ms_p99"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["ms_p50"] / 1e3))
    assert len({r["run_id"] for r in rows}) == 1
    # plot straight from this run's rows
    png = tmp_path / "fig.png"
    status, _, err = cli("plot", "throughput_ar", "--from", str(out), "--out", str(png))
    assert status == 0, err
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_default_run_dir_is_named_by_time_and_overrides(cli, tmp_path):
    status, _, err = cli("run", *TINY, "bench.phases=[decode]")
    assert status == 0, err
    runs = list((tmp_path / "runs" / "throughput_ar").glob("*/*/results.jsonl"))
    assert len(runs) == 1
    name = runs[0].parent.name
    assert "bench.phases=[decode]" in name and "experiment=" not in name
    _no_partials(tmp_path)


def test_multirun_sweeps_into_one_directory_per_job(cli, tmp_path):
    out = tmp_path / "sweep"
    status, _, err = cli("run", "-m", *TINY, "bench.batch=[1]", "bench.phases=[decode]", "data.seed=0,1",
                         f"results_dir={out}")
    assert status == 0, err
    jobs = sorted(p for p in out.iterdir() if p.is_dir())
    assert [j.name[:2] for j in jobs] == ["0_", "1_"]
    seeds = []
    for job in jobs:
        assert sorted(p.name for p in job.iterdir()) == sorted(RESULT_FILES)
        seeds.append(yaml.safe_load((job / "config.yaml").read_text())["data"]["seed"])
        assert len(_rows(job)) == 1
    assert seeds == [0, 1]


def test_long_overrides_name_short_distinct_directories(cli, tmp_path):
    """A run directory is named by its overrides; an inline dict override passes the 255 bytes a file name may have,
    so a long name is cut with a hash of the whole: a sweep whose jobs differ only at the end keeps two folders."""
    from ssmspec.hydra_callbacks import DIRNAME_MAX, dirname

    long = "bench.note=" + "x" * 300
    assert dirname("a=1") == "a=1" and len(dirname(long).encode()) <= DIRNAME_MAX
    assert dirname(long + "1") != dirname(long + "2") and dirname(long).startswith("bench.note=xxx")
    out = tmp_path / "sweep"
    pad = "bench.profile_batches=[" + ",".join(str(1000 + i) for i in range(60)) + "]"  # unread on the CPU
    status, _, err = cli("run", "-m", *TINY, "bench.batch=[1]", "bench.phases=[decode]", pad, "data.seed=0,1",
                         f"results_dir={out}")
    assert status == 0, err
    jobs = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(jobs) == 2 and all(len(j.name.encode()) <= DIRNAME_MAX + 2 for j in jobs)
    assert [yaml.safe_load((j / "config.yaml").read_text())["data"]["seed"] for j in jobs] == [0, 1]
    status, _, err = cli("run", *TINY, "bench.phases=[decode]", pad)  # Hydra names the folder
    assert status == 0, err
    runs = list((tmp_path / "runs" / "throughput_ar").glob("*/*/results.jsonl"))
    assert len(runs) == 1 and "~" in runs[0].parent.name


def test_save_reference_figures_and_list(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS_DIR", tmp_path / "results")
    ref = tmp_path / "results" / "throughput_ar" / "cpu"
    status, _, err = cli("run", *TINY, "bench.phases=[decode]", "--save-reference")
    assert status == 0, err
    first = _rows(ref)[0]["run_id"]
    status, _, err = cli("run", *TINY, "bench.phases=[decode]", "bench.batch=[2]", "--save-reference")
    assert status == 0, err
    rows = _rows(ref)
    assert rows[0]["run_id"] != first and [r["batch"] for r in rows] == [2]  # replaced, not appended
    _no_partials(tmp_path)
    status, out, err = cli("figures")
    assert status == 0, err
    assert (tmp_path / "results" / "figures" / "throughput_ar-cpu.png").read_bytes()[:8] == PNG_MAGIC
    status, out, _ = cli("list")
    line = next(ln for ln in out.splitlines() if ln.startswith("throughput_ar"))
    assert "cpu,gpu" in line and " cpu " in line


def test_staged_dir_is_all_or_nothing(tmp_path):
    new = tmp_path / "new"
    with pytest.raises(RuntimeError), staged_dir(new) as tmp:
        (tmp / "results.jsonl").write_text("{}\n")
        raise RuntimeError("bench failed")
    assert not new.exists() and list(tmp_path.iterdir()) == []
    old = tmp_path / "old"
    old.mkdir()
    (old / "results.jsonl").write_text("old\n")
    (old / "env.json").write_text("old\n")
    (old / "notes.txt").write_text("mine\n")
    with pytest.raises(RuntimeError), staged_dir(old) as tmp:
        (tmp / "results.jsonl").write_text("new\n")
        raise RuntimeError("bench failed")
    assert (old / "results.jsonl").read_text() == "old\n" and len(list(old.iterdir())) == 3
    with staged_dir(old) as tmp:
        (tmp / "results.jsonl").write_text("new\n")
    assert (old / "results.jsonl").read_text() == "new\n"
    assert not (old / "env.json").exists()  # stale file of the older run
    assert (old / "notes.txt").exists()  # not a result file: left alone
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt", "results.jsonl"]


def test_a_gpu_index_this_machine_lacks_is_refused(cli, tmp_path, monkeypatch):
    """device=cuda:N names a visible GPU: one past the last is refused before anything is written (faked: two
    GPUs visible), as is a malformed name; cuda:1 then passes the check (the run itself needs the GPU)."""
    import torch

    from ssmspec import config as C
    from ssmspec.runner import UserError, _gpu_that_exists

    monkeypatch.setattr(C, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    out = tmp_path / "out"
    status, stdout, err = cli("run", *TINY, "device=cuda:2", f"results_dir={out}")
    assert status == 2 and "Traceback" not in err + stdout and not out.exists()
    assert "device=cuda:2 does not exist: this machine has 2 visible CUDA devices (cuda:0 .. cuda:1)" in err
    assert _gpu_that_exists("cuda:1") == "cuda:1" and _gpu_that_exists("cuda") == "cuda"
    with pytest.raises(UserError, match="must be cpu, cuda\\[:index\\] or auto, got 'cuda:x'"):
        _gpu_that_exists("cuda:x")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"has 1 visible CUDA device \(cuda:0\); name one of them, or device=cuda"):
        _gpu_that_exists("cuda:1")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.device_count() >= 2, reason="needs two GPUs")
def test_a_run_on_the_second_gpu_runs_there(cli, tmp_path):
    """device=cuda:1 with cuda:0 current: the run makes cuda:1 current while it runs (Triton launches on the
    current device's stream), so its Triton kernels run there: greedy output of every strategy equals
    autoregressive (fp32 weights, the Triton kernels; lossless's greedy runs are eager, its margins are read on
    the host), env.json names that GPU, and cuda:0 is current again afterwards. Captured steps on a second GPU:
    tests/test_engine.py."""
    import torch

    from ssmspec.runner import on_device

    with on_device("cuda:1"):
        assert torch.cuda.current_device() == 1
    assert torch.cuda.current_device() == 0
    out = tmp_path / "run"
    status, _, err = cli("run", "experiment=lossless", "profile=cpu", "device=cuda:1", "bench.presets=[tiny-mamba2]",
                         "bench.dtype=float32", "bench.sampling.enabled=false", f"results_dir={out}")
    assert status == 0, err
    rows = _rows(out)
    assert rows and all(r["status"] in ("ok", "n/a") for r in rows), {r["status"] for r in rows}
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(r["exact"] for r in ok), [(r["strategy"], r["drafter"]) for r in ok if not r["exact"]]
    env = json.loads((out / "env.json").read_text())
    assert env["device_name"] == torch.cuda.get_device_name(1)
    assert torch.cuda.current_device() == 0
