"""Bad input ends in one clear message and exit status 2, with no traceback and no run directory left."""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys

import pytest
from pipeline_helpers import TINY

from ssmspec import config as C
from ssmspec import paths

cpu_only = pytest.mark.skipif(C.cuda_available(), reason="checks the refusal on a machine without CUDA")

CASES = [
    pytest.param(["experiment=nope"], "unknown experiment 'nope'", id="unknown-experiment"),
    pytest.param([*TINY, "model=nope"], "unknown model preset 'nope'", id="unknown-preset"),
    pytest.param([*TINY, "bench.presets=[nope]"], "unknown model preset 'nope'", id="unknown-preset-in-grid"),
    pytest.param(["profile=cpu"], "no experiment chosen", id="no-experiment"),
    pytest.param([*TINY, "strategy=nope"], "unknown strategy config 'nope'", id="unknown-strategy"),
    pytest.param([*TINY, "bench.batch=[0]"], "positive sizes", id="bench-grid"),
    pytest.param([*TINY, "bench.context=[-1]"], "bench.context[0] must be a finite number >= 0", id="bench-negative"),
    pytest.param([*TINY, "bench.iters=0"], "bench.iters must be >= 1", id="bench-iters"),
    pytest.param([*TINY, "bench.iters=abc"], "bench.iters must be an int like", id="bench-type"),
    pytest.param([*TINY, "bench.batch=[1.5]"], "bench.batch must be a list of ints", id="bench-list-type"),
    pytest.param([*TINY, "+bench.batchs=[1]"], "has no setting bench.batchs; keys of bench: batch,", id="bench-unknown"),
    pytest.param([*TINY, "bench.batchs=[1]"], "Could not override 'bench.batchs': no such key", id="bench-misspelt"),
    pytest.param([*TINY, "no_such_key=1"], "Could not override 'no_such_key'", id="hydra-unknown-key"),
    pytest.param([*TINY, "+no_such_key=1"], "'no_such_key' is not a setting of any config", id="added-unknown-key"),
    pytest.param([*TINY, "model.d_model=wide"], "d_model", id="hydra-bad-type"),
    pytest.param([*TINY, "bench.batch=[1"], "cannot parse an override", id="hydra-parse"),
    pytest.param([*TINY, "bench.batch=[1,x.y=2]"], "a list element holding '=' must be quoted; write "
                 "bench.batch=[1,\"x.y=2\"] (in a shell", id="hydra-parse-list-equals"),
    pytest.param([*TINY, "+sampling.temprature=0.5"], "sampling has no field 'temprature'; its fields: temperature",
                 id="sampling-added-field"),
    pytest.param([*TINY, "sampling.temperature=0.5"], "does not read sampling.temperature", id="not-read-sampling"),
    pytest.param([*TINY, "data=gsm8k"], "does not read data= ", id="not-read-data"),
    pytest.param([*TINY, "drafter=png"], "does not read drafter=", id="not-read-drafter"),
    pytest.param([*TINY, "model.d_model=32"], "model.d_model changes nothing", id="model-field-with-presets"),
    pytest.param([*TINY, "model=tiny-hybrid"], "both choose the models", id="model-and-presets"),
    pytest.param([*TINY, "seed=-1"], "seed must be >= 0", id="seed"),
    pytest.param([*TINY, "data.seed=1.5"], "data.seed must be an integer", id="data-seed"),
    pytest.param(["experiment=kernel_parity", "checkpoint=/x"], "does not read checkpoint", id="not-read-checkpoint"),
    pytest.param([*TINY[:1], "profile=gpu"], "profile=gpu needs a CUDA device", marks=cpu_only, id="gpu-profile"),
    pytest.param([*TINY, "device=cuda"], "device=cuda needs a CUDA device", marks=cpu_only, id="cuda-device"),
    pytest.param([*TINY, "bench.cuda_graph=true"], "bench.cuda_graph=true needs a CUDA device", marks=cpu_only,
                 id="cuda-graph-option"),
]


@pytest.mark.parametrize(("args", "message"), CASES)
def test_bad_run_is_one_message_and_no_directory(cli, tmp_path, args, message):
    out = tmp_path / "out"
    status, stdout, err = cli("run", *args, f"results_dir={out}")
    assert status == 2
    assert message in err and "Traceback" not in err + stdout
    assert not out.exists() and not (tmp_path / "runs").exists()
    assert not [p for p in tmp_path.rglob("*") if ".partial-" in p.name]


def test_results_dir_that_is_a_file_is_refused(cli, tmp_path):
    target = tmp_path / "a-file"
    target.write_text("mine\n")
    status, _, err = cli("run", *TINY, f"results_dir={target}")
    assert status == 2 and "is a file, not a directory" in err and target.read_text() == "mine\n"


def test_sweep_values_are_checked_before_any_job_runs(cli, tmp_path):
    out = tmp_path / "sweep"
    status, _, err = cli("run", "-m", *TINY, "bench.iters=2,0", f"results_dir={out}")
    assert status == 2 and err.strip() == "error: bench.iters must be >= 1, got 0" and not out.exists()


def test_failed_run_keeps_an_existing_results_dir_untouched(cli, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text('{"old": 1}\n')
    status, _, err = cli("run", *TINY, "bench.context=[0]", f"results_dir={out}")
    assert status == 2 and "positive sizes" in err
    assert [p.name for p in out.iterdir()] == ["results.jsonl"] and "old" in (out / "results.jsonl").read_text()


@cpu_only
def test_gpu_only_experiment_refused_on_cpu(cli, tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(paths.CONF_DIR, conf)
    text = (conf / "experiment" / "throughput_ar.yaml").read_text()
    text = text.replace("id: throughput_ar", "id: gpu_only").replace("needs_gpu: false", "needs_gpu: true")
    text = text.replace("profiles: [cpu, gpu]", "profiles: [gpu]")
    (conf / "experiment" / "gpu_only.yaml").write_text(text)
    monkeypatch.setattr(paths, "CONF_DIR", conf)
    status, _, err = cli("run", "experiment=gpu_only", f"results_dir={tmp_path / 'out'}")
    assert status == 2 and "needs a CUDA GPU" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    status, out, _ = cli("reproduce", "--profile", "cpu", "--only", "gpu_only")
    assert status == 0 and "0 experiment(s)" in out  # skipped on the cpu profile, nothing run


def test_other_commands_refuse_bad_input(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS_DIR", tmp_path / "results")
    status, _, err = cli("plot", "nope")
    assert status == 2 and "unknown experiment 'nope'" in err
    status, _, err = cli("plot", "throughput_ar")
    assert status == 2 and "no reference results" in err
    status, _, err = cli("plot", "throughput_ar", "--from", str(tmp_path))
    assert status == 2 and "no results.jsonl" in err
    status, _, err = cli("reproduce", "--only", "nope")
    assert status == 2 and "unknown experiment" in err
    status, _, err = cli("run", *TINY, "--save-reference", "-m")
    assert status == 2 and "--save-reference" in err
    if not C.cuda_available():
        status, _, err = cli("reproduce", "--profile", "gpu")
        assert status == 2 and "profile=gpu needs a CUDA device" in err


def test_module_entry_point_exits_2_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ssmspec", "run", "experiment=nope"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert proc.stderr.startswith("error: unknown experiment 'nope'") and "Traceback" not in proc.stderr


_RUN = " ".join(shlex.quote(a) for a in TINY)


@pytest.mark.parametrize("command,reader", [
    pytest.param("list", "head -1", id="list-head"),
    pytest.param("list", "true", id="list"),
    pytest.param("--help", "true", id="help"),
    pytest.param("policy --help", "true", id="policy-help"),
    pytest.param("run experiment=throughput_ar --cfg job", "true", id="run-cfg-job"),
    pytest.param(f"run {_RUN} results_dir=out", "true", id="run"),
    pytest.param(f"run -m {_RUN} 'bench.batch=[1],[2]'", "true", id="sweep-before-its-first-job"),
    pytest.param(f"run -m {_RUN} 'bench.batch=[1],[2]'", "head -1", id="sweep-head"),
])
def test_closed_stdout_ends_quietly(tmp_path, command, reader):
    """``ssmspec ... | head -1``: no BrokenPipeError traceback, no "Logging error", nothing half-written; status
    141 (128 + SIGPIPE) where a write met the closed pipe. ``true`` closes the pipe before the first write."""
    script = f'{shlex.quote(sys.executable)} -m ssmspec {command} | {reader}; exit "${{PIPESTATUS[0]}}"'
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.stderr == ""
    if reader == "true":
        assert proc.returncode == 141 and proc.stdout == ""
    else:  # head read its line; the command may have written everything before head left
        assert proc.returncode in (0, 141) and len(proc.stdout.splitlines()) == 1
    assert not (tmp_path / "out").exists() and not list(tmp_path.rglob(".partial-*"))
    if reader == "true" and "-m" in command.split():  # stopped at Hydra's "Launching" line: no sweep record left
        assert not (tmp_path / "runs").exists()
    assert not [p for p in tmp_path.rglob("multirun.yaml") if len(list(p.parent.iterdir())) == 1]


def test_throughput_memory_check_skips_the_prefill_points_it_never_runs(monkeypatch):
    """throughput_ar checks every grid point against free memory before building a model, except the prefill
    points above bench.max_prefill_tokens, which it skips (a row with status skipped) instead of running: on an
    80 GB GPU the gpu profile's batch-256 prefill points would otherwise refuse the whole run."""
    from omegaconf import OmegaConf

    from ssmspec.bench import throughput

    checked: list[str] = []
    monkeypatch.setattr(throughput, "check_fits", lambda parts, device, what, fix: checked.append(what))
    cfg = OmegaConf.create({"dtype": "float32", "strategy": {"name": "autoregressive"}})
    monkeypatch.setattr(throughput.C, "build_strategy", lambda cfg: None)
    monkeypatch.setattr(throughput, "plan_bytes", lambda *a, **k: {})
    grid = [("prefill", 1, 32), ("prefill", 256, 32), ("decode", 256, 32)]
    throughput.check_grid_fits(cfg, ["tiny-mamba2"], grid, "cpu", max_prefill_tokens=1024)
    assert checked == ["tiny-mamba2 prefill at batch 1, context 32", "tiny-mamba2 decode at batch 256, context 32"]
    checked.clear()
    throughput.check_grid_fits(cfg, ["tiny-mamba2"], grid, "cpu")  # no limit: every point is run, so checked
    assert len(checked) == 3


def test_free_bytes_counts_the_allocators_unused_cache(monkeypatch):
    """A freed tensor's memory stays reserved by PyTorch's caching allocator, and the driver does not count it
    free: the memory check adds it (else a run refuses a point right after a bigger one freed its caches)."""
    import torch

    from ssmspec.engine import memory

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (32 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 45 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 5 * gib)
    assert memory.free_bytes("cuda:0") == 72 * gib
