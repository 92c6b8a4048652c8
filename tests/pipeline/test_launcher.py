"""Sweeps over GPUs: the gpu_queue Hydra launcher (fake device lists on CPU), its queue, the Slurm config
through hydra-submitit-launcher, and plugin discovery from the source tree."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from pipeline_helpers import TINY

from hydra_plugins.ssmspec_launcher.gpu_queue import Job, detect_devices, make_slots, run_queue
from ssmspec import config as C
from ssmspec import paths
from ssmspec.runner import RESULT_FILES

SRC = Path(__file__).resolve().parents[2] / "src"
ONE_JOB = [*TINY, "bench.batch=[1]", "bench.phases=[decode]"]
# a probe child: writes its CUDA_VISIBLE_DEVICES and start/end times, sleeps, exits with the given status
PROBE = ("import json, os, sys, time; t = time.time(); time.sleep(float(sys.argv[2])); "
         "open(sys.argv[1], 'w').write(json.dumps([os.environ['CUDA_VISIBLE_DEVICES'], t, time.time()])); "
         "print('error: probe says no' if sys.argv[3] != '0' else 'fine'); sys.exit(int(sys.argv[3]))")


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(*ids)``: this machine shows these GPUs (CUDA_VISIBLE_DEVICES names them, torch counts them;
    jobs pinned to them run on the CPU here). torch is patched, not the launcher: Hydra's plugin scan re-executes
    the launcher's modules and would undo a patch there."""
    import torch

    def fake(*ids: str) -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(ids))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(ids))

    return fake


@pytest.mark.parametrize(("devices", "per_job", "slots"), [
    pytest.param(["0", "1", "2", "3"], 1, [("0",), ("1",), ("2",), ("3",)], id="one-each"),
    pytest.param(["0", "1", "2"], 2, [("0", "1")], id="two-each-leftover-idle"),
    pytest.param([], 1, [(), ()], id="cpu"),
])
def test_slots(devices, per_job, slots):
    assert make_slots(devices, gpus_per_job=per_job, cpu_jobs=2) == slots


@pytest.mark.parametrize(("devices", "per_job", "message"), [
    (["0"], 2, "gpus_per_job=2 but only 1 device"),
    (["0", "0"], 1, "lists a GPU twice"),
    (["0"], 0, "gpus_per_job must be >= 1"),
])
def test_slots_refuse_impossible_settings(devices, per_job, message):
    with pytest.raises(ValueError, match=message):
        make_slots(devices, gpus_per_job=per_job)


def test_queue_runs_one_job_per_slot_at_once_and_keeps_going(tmp_path):
    jobs = [Job(name=f"j{i}", argv=(sys.executable, "-c", PROBE, str(tmp_path / f"{i}.json"), "0.6",
                                    "3" if i == 1 else "0"), log=tmp_path / "logs" / f"{i}.log")
            for i in range(4)]
    t0 = time.perf_counter()
    outcomes = run_queue(jobs, [("gpuA",), ("gpuB",)])
    wall = time.perf_counter() - t0
    assert [o.returncode for o in outcomes] == [0, 3, 0, 0]  # job 1 failed, 2 and 3 still ran
    assert outcomes[1].last_error() == "error: probe says no" and outcomes[0].ok and not outcomes[1].ok
    seen = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(4)]
    assert {s[0] for s in seen} == {"gpuA", "gpuB"}
    assert [s[0] for s in seen] == [o.devices[0] for o in outcomes]
    # two at once, never two on one device: jobs on the same device do not overlap in time
    for a in range(4):
        for b in range(a + 1, 4):
            if seen[a][0] == seen[b][0]:
                assert seen[a][2] <= seen[b][1] or seen[b][2] <= seen[a][1]
    assert seen[0][1] < seen[1][2] and seen[1][1] < seen[0][2]  # the first two overlapped
    assert wall < sum(o.wall_s for o in outcomes)


def test_a_job_of_several_slots_gets_them_together(tmp_path):
    """A job that needs two GPUs (an experiment's ``gpus: 2``: saguaro_e2e's draft on a GPU of its own) gets two
    slots at once and sees both; the next job of two waits until two are free; a job asking more slots than the
    queue has runs on all of them; a CPU queue gives every job one slot."""
    def job(i: int, slots: int, sleep: str = "0.4") -> Job:
        return Job(name=f"j{i}", argv=(sys.executable, "-c", PROBE, str(tmp_path / f"{i}.json"), sleep, "0"),
                   slots=slots)

    outcomes = run_queue([job(0, 2), job(1, 1), job(2, 2, "0.1"), job(3, 5, "0.1")], [("g0",), ("g1",), ("g2",)])
    assert all(o.ok for o in outcomes)
    seen = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(4)]
    assert seen[0][0] == "g0,g1" and seen[1][0] == "g2" and outcomes[0].devices == ("g0", "g1")
    assert len(seen[2][0].split(",")) == 2 and seen[2][1] >= max(seen[0][2], seen[1][2])  # waited for two
    assert len(seen[3][0].split(",")) == 3 and seen[3][1] >= max(s[2] for s in seen[:3])  # every slot, alone
    cpu = run_queue([Job(name="c", argv=(sys.executable, "-c", "print('fine')"), slots=2)], [(), ()])
    assert cpu[0].ok and cpu[0].devices == ()


def test_gpu_queue_sweep_spreads_jobs_over_fake_gpus(cli, tmp_path, fake_gpus):
    fake_gpus("fake0", "fake1", "fake2")
    out = tmp_path / "sweep"
    status, stdout, err = cli("run", "-m", "hydra/launcher=gpu_queue", "hydra.launcher.devices=[fake0,fake1]",
                              *ONE_JOB, "bench.batch=[1],[2],[0]", f"results_dir={out}")
    assert status == 1, err
    assert err.strip().splitlines()[-1].startswith("error: 1 of 3 job(s) failed (#2)") and "Traceback" not in err
    jobs = sorted(p for p in out.iterdir() if p.is_dir() and p.name[0].isdigit())
    assert [j.name[:2] for j in jobs] == ["0_", "1_"]  # the failed job #2 left no directory
    seen = []
    for job in jobs:
        assert sorted(p.name for p in job.iterdir()) == sorted(RESULT_FILES)
        seen.append(json.loads((job / "env.json").read_text())["cuda_visible_devices"])
    assert sorted(seen) == ["fake0", "fake1"]  # both ran at once, one per device
    rows = [json.loads(line) for line in (out / "jobs.jsonl").read_text().splitlines()]
    assert sorted(r["status"] for r in rows) == ["failed", "ok", "ok"]
    failed = next(r for r in rows if r["status"] == "failed")
    assert failed["returncode"] == 2 and not Path(failed["dir"]).exists()
    assert "positive sizes" in Path(failed["log"]).read_text()
    assert all(r["wall_s"] > 0 and r["devices"] in ("fake0", "fake1") for r in rows)
    assert "sum of job times" in stdout
    assert not [p for p in out.rglob("*") if ".partial-" in p.name]


def test_gpu_queue_devices_from_environment(cli, tmp_path, monkeypatch, fake_gpus):
    fake_gpus("gpuW", "gpuX")
    monkeypatch.setenv("SSMSPEC_DEVICES", "gpuX")
    out = tmp_path / "sweep"
    status, _, err = cli("run", "-m", "hydra/launcher=gpu_queue", *ONE_JOB, f"results_dir={out}")
    assert status == 0, err
    (job,) = [p for p in out.iterdir() if p.name.startswith("0_")]
    env = json.loads((job / "env.json").read_text())
    assert env["cuda_visible_devices"] == "gpuX" and env["device"] == "cpu"


def test_gpu_queue_refuses_bad_settings_before_any_directory(cli, tmp_path, fake_gpus):
    fake_gpus("a", "b")
    out = tmp_path / "sweep"
    status, _, err = cli("run", "-m", "hydra/launcher=gpu_queue", "hydra.launcher.devices=[a,b]",
                         "hydra.launcher.gpus_per_job=3", *ONE_JOB, f"results_dir={out}")
    assert status == 2
    assert err.strip() == "error: hydra.launcher: gpus_per_job=3 but only 2 device(s) ['a', 'b']; lower " \
                          "gpus_per_job or list more devices"
    assert not out.exists()


@pytest.mark.skipif(C.cuda_available(), reason="this machine's real GPU list: a CPU machine shows none")
@pytest.mark.parametrize("how", ["option", "environment"])
def test_gpu_queue_refuses_gpus_this_cpu_machine_lacks(cli, tmp_path, monkeypatch, how):
    out = tmp_path / "sweep"
    if how == "option":
        args, what, fix = ["hydra.launcher.devices=[2,3]"], "devices=[2,3]", "drop hydra.launcher.devices"
    else:
        monkeypatch.setenv("SSMSPEC_DEVICES", "2,3")
        args, what, fix = [], "$SSMSPEC_DEVICES=2,3", "unset SSMSPEC_DEVICES"
    status, stdout, err = cli("run", "-m", "hydra/launcher=gpu_queue", *args, *ONE_JOB, f"results_dir={out}")
    assert status == 2 and "on GPU" not in stdout
    assert err.strip() == f"error: hydra.launcher: {what} names GPU 2, 3, but this machine shows no GPU; {fix} to " \
                          f"run the jobs on the CPU"
    assert not out.exists()


@pytest.mark.skipif(C.cuda_available(), reason="a CPU machine: the default devices are none")
def test_gpu_queue_default_on_a_cpu_machine_runs_cpu_jobs(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # names a GPU that CUDA cannot see here: still none
    assert detect_devices() == []
    out = tmp_path / "sweep"
    status, stdout, err = cli("run", "-m", "hydra/launcher=gpu_queue", *ONE_JOB, f"results_dir={out}")
    assert status == 0, err
    assert "start  #0" in stdout and "on CPU" in stdout and "on GPU" not in stdout
    (job,) = [p for p in out.iterdir() if p.name.startswith("0_")]
    env = json.loads((job / "env.json").read_text())
    assert env["device"] == "cpu" and env["cuda_visible_devices"] == ""


def test_gpu_queue_refuses_gpus_the_machine_does_not_show(cli, tmp_path, fake_gpus):
    fake_gpus("0", "1")
    out = tmp_path / "sweep"
    status, _, err = cli("run", "-m", "hydra/launcher=gpu_queue", "hydra.launcher.devices=[1,2,3]", *ONE_JOB,
                         f"results_dir={out}")
    assert status == 2
    assert err.strip() == "error: hydra.launcher: devices=[1,2,3] names GPU 2, 3, which this machine does not show " \
                          "(it shows GPU 0, 1); list only those, or drop hydra.launcher.devices to use them all"
    assert not out.exists()


def test_plugin_is_found_from_the_source_tree(tmp_path):
    """The device machine puts src/ on PYTHONPATH without installing: hydra_plugins must stay a namespace
    package (no __init__.py) so Hydra finds this launcher beside the installed ones."""
    assert not (SRC / "hydra_plugins" / "__init__.py").exists()
    import hydra

    code = ("from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher; "
            "print(sorted(p.__name__ for p in Plugins.instance().discover(Launcher)))")
    # -S: no site processing, so no editable-install .pth either; only PYTHONPATH puts src/ on the path
    site = str(Path(hydra.__file__).resolve().parents[1])
    path = [str(SRC), site, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert "GpuQueueLauncher" in proc.stdout


def test_slurm_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]'")
    C.register_configs()
    with initialize_config_dir(config_dir=str(paths.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=throughput_ar", "hydra/launcher=slurm",
                                           "hydra.launcher.partition=gpu"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.partition) == (1, 1, "gpu")
    assert launcher.timeout_min == 120 and "array_parallelism" in launcher


HERE = "here, run the sweep with hydra/launcher=gpu_queue, or without hydra/launcher (one job after another)"


@pytest.mark.parametrize("launcher", ["slurm", "submitit_local"])
def test_submitit_launchers_without_submitit(cli, tmp_path, monkeypatch, launcher):
    """As on a machine without ``pip install -e ".[slurm]"``: one line naming what is missing and the fix,
    before Hydra makes a sweep directory."""
    for name in ("submitit", "hydra_plugins.hydra_submitit_launcher"):
        monkeypatch.setitem(sys.modules, name, None)  # import (and find_spec) now fail as if not installed
    status, stdout, err = cli("run", "-m", f"hydra/launcher={launcher}", *ONE_JOB)
    needs = "hydra-submitit-launcher (submitit and hydra_plugins.hydra_submitit_launcher do not import here)"
    fix = 'pip install -e ".[slurm]"'
    want = (f"error: hydra/launcher=slurm needs {needs} and a Slurm cluster: on the cluster, {fix}; {HERE}"
            if launcher == "slurm" else f"error: hydra/launcher=submitit_local needs {needs}: {fix}; {HERE}")
    assert status == 2 and err.strip() == want and "Traceback" not in stdout
    assert not (tmp_path / "runs").exists()


def test_slurm_launcher_without_slurm(cli, tmp_path, monkeypatch):
    """submitit imports but there is no Slurm here (no sbatch / srun): one line, not submitit's traceback."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]'")
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    status, stdout, err = cli("run", "-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", *ONE_JOB)
    assert status == 2 and "Traceback" not in stdout
    assert err.strip() == ("error: hydra/launcher=slurm submits the sweep to a Slurm cluster, and this machine has no "
                           f"Slurm (sbatch and srun not on PATH): run it on the cluster's login node; {HERE}")
    assert not (tmp_path / "runs").exists()


def test_sweep_through_submitit_local_executor(cli, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]'")
    out = tmp_path / "sweep"
    status, _, err = cli("run", "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10",
                         *ONE_JOB, f"results_dir={out}")
    assert status == 0, err
    (job,) = [p for p in out.iterdir() if p.name.startswith("0_")]
    assert sorted(p.name for p in job.iterdir()) == sorted(RESULT_FILES)
    assert yaml.safe_load((job / "config.yaml").read_text())["bench"]["batch"] == [1]
    assert (out / ".submitit").is_dir()  # submitit pickled the job and ran it in its own process


@pytest.mark.gpu
@pytest.mark.skipif(not C.cuda_available(), reason="needs CUDA")
def test_gpu_queue_two_jobs_on_one_gpu(cli, tmp_path):
    """Both jobs queue on one GPU: the first this machine shows (a suite spread over GPUs 1-3 shows no GPU 0)."""
    gpu = detect_devices()[0]
    out = tmp_path / "sweep"
    status, _, err = cli("run", "-m", "hydra/launcher=gpu_queue", f"hydra.launcher.devices=[{gpu}]",
                         "experiment=kernel_parity", "profile=gpu", "bench.presets=[mamba2-130m]",
                         "bench.batch=[1],[16]", "bench.sweep_batch=[]", "bench.sweep=[]", f"results_dir={out}")
    assert status == 0, err
    jobs = sorted(p for p in out.iterdir() if p.is_dir() and p.name[0].isdigit())
    assert len(jobs) == 2
    for job in jobs:
        env = json.loads((job / "env.json").read_text())
        assert env["device"] == "cuda" and env["cuda_visible_devices"] == gpu and env["device_count"] == 1
        assert (job / "results.jsonl").read_text().strip()
    rows = [json.loads(line) for line in (out / "jobs.jsonl").read_text().splitlines()]
    starts = sorted(r["started"] for r in rows)
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows) and starts[0] <= starts[1]


def test_reproduce_slots(monkeypatch, fake_gpus):
    from ssmspec.reproduce import slots as _reproduce_slots

    fake_gpus("g0", "g1", "g2", "g3")
    monkeypatch.setenv("SSMSPEC_DEVICES", "g0,g1,g2")
    assert _reproduce_slots("gpu", "auto") == [("g0",), ("g1",), ("g2",)]
    assert _reproduce_slots("gpu", "2") == [("g0",), ("g1",)]
    assert _reproduce_slots("cpu", "auto") == [()] and _reproduce_slots("cpu", "2") == [(), ()]
    with pytest.raises(ValueError, match="--jobs 4 but this machine shows 3 GPU"):
        _reproduce_slots("gpu", "4")
    with pytest.raises(ValueError, match="positive number or auto"):
        _reproduce_slots("gpu", "0")


def test_reproduce_queues_experiments_of_several_gpus_first_then_the_longest_references(tmp_path):
    """With several slots: experiments of several GPUs first (a job waits for all its slots and holds the queue
    behind it), then the longest first by their references' env.json wall_s, those with none before the rest;
    ties keep the given order. One slot: the given order. An unreadable record counts as none."""
    from types import SimpleNamespace as NS

    from ssmspec.reproduce import queue_order, recorded_wall_s

    def record(exp_id, profile, text):
        (tmp_path / exp_id / profile).mkdir(parents=True)
        (tmp_path / exp_id / profile / "env.json").write_text(text)

    record("short", "gpu", json.dumps({"wall_s": 20.0}))
    record("long", "gpu", json.dumps({"wall_s": 400.0}))
    record("mid", "gpu", json.dumps({"wall_s": 90}))
    record("mid", "cpu", json.dumps({"wall_s": 1.0}))
    record("old", "gpu", json.dumps({"time": "2026-01-01"}))  # before runs recorded wall_s
    record("broken", "gpu", "{not json")
    exps = [NS(id=i, gpus=g) for i, g in (("short", 1), ("old", 1), ("mid", 1), ("pair", 2), ("long", 1),
                                           ("broken", 1))]
    assert recorded_wall_s("mid", "gpu", tmp_path) == 90.0 and recorded_wall_s("mid", "cpu", tmp_path) == 1.0
    assert recorded_wall_s("old", "gpu", tmp_path) is None and recorded_wall_s("broken", "gpu", tmp_path) is None
    ids = lambda order: [e.id for e in order]  # noqa: E731
    assert ids(queue_order(exps, "gpu", 3, tmp_path)) == ["pair", "old", "broken", "long", "mid", "short"]
    assert ids(queue_order(exps, "gpu", 1, tmp_path)) == ids(exps)
    # on cpu every experiment takes one slot: only the times order them
    assert ids(queue_order(exps, "cpu", 2, tmp_path)) == ["short", "old", "pair", "long", "broken", "mid"]


def test_reproduce_runs_experiments_at_once_with_logs(cli, tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(paths.CONF_DIR, conf)
    for name in ("exp_a", "exp_b"):
        text = (conf / "experiment" / "throughput_ar.yaml").read_text().replace("id: throughput_ar", f"id: {name}")
        text = text.replace("profiles: [cpu, gpu]", "profiles: [cpu]").replace("cpu: {}", (
            "cpu: {presets: [tiny-mamba2], batch: [1], context: [8], phases: [decode], warmup: 0, iters: 2}"))
        (conf / "experiment" / f"{name}.yaml").write_text(text)
    monkeypatch.setattr(paths, "CONF_DIR", conf)
    monkeypatch.setattr(paths, "RESULTS_DIR", tmp_path / "results")
    status, out, err = cli("reproduce", "--profile", "cpu", "--only", "exp_a,exp_b", "--jobs", "2")
    assert status == 0, err
    (run,) = (tmp_path / "runs" / "reproduce").iterdir()
    for k, name in enumerate(("exp_a", "exp_b"), 1):
        assert (run / "results" / name / "cpu" / "results.jsonl").read_text().strip()
        assert (run / "figures" / f"{name}-cpu.png").is_file()
        assert f"experiment {name}" in (run / f"{name}.log").read_text()
        assert re.search(rf"^\[{k}/2\] {name}: .* \(on this machine, log runs/reproduce/.*\)$", out, re.M)
        assert re.search(rf"^\[{k}/2\] {name}: ok in \d+\.\d s on this machine$", out, re.M)
    assert not (tmp_path / "results").exists()  # the committed references are left alone
    assert "on 2 slot(s)" in out and "sum of job times" in out


def test_reproduce_notes_experiments_of_more_gpus_than_its_slots(monkeypatch, fake_gpus):
    """An experiment of ``gpus: 2`` on one slot runs with its second-GPU rows skipped: reproduce says so before it
    starts, and refuses to save such a reference where ``--jobs`` alone caused it (the machine shows two)."""
    from types import SimpleNamespace

    from ssmspec.reproduce import gpu_shortfall, slots

    two, one = SimpleNamespace(id="two_gpu", gpus=2), SimpleNamespace(id="one_gpu", gpus=1)
    fake_gpus("g0", "g1")
    assert gpu_shortfall([two, one], "gpu", "auto", slots("gpu", "auto"), save_reference=True) == []
    assert gpu_shortfall([two, one], "cpu", "auto", slots("cpu", "auto"), save_reference=True) == []
    assert gpu_shortfall([one], "gpu", "1", slots("gpu", "1"), save_reference=True) == []
    fix = "use --jobs auto (or --jobs 2 or more)"
    assert gpu_shortfall([two, one], "gpu", "1", slots("gpu", "1"), save_reference=False) == [
        "reproduce: note: --jobs 1 gives two_gpu 1 GPU(s), but it runs on 2 and this machine shows 2: its rows "
        f"that need the others would be skipped; {fix}"]
    with pytest.raises(ValueError, match=re.escape(fix)):
        gpu_shortfall([two], "gpu", "1", slots("gpu", "1"), save_reference=True)
    fake_gpus("g0")  # a machine of one GPU: the rows are skipped and say why; a note, also for a reference
    assert gpu_shortfall([two], "gpu", "auto", slots("gpu", "auto"), save_reference=True) == [
        "reproduce: note: two_gpu runs on 2 GPUs and this machine shows 1: its rows that need more are skipped "
        "(each says why)"]


def test_reproduce_refuses_a_reference_that_jobs_would_cut_short(cli, tmp_path, monkeypatch, fake_gpus):
    import torch

    fake_gpus("g0", "g1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the gpu profile resolves; nothing runs
    monkeypatch.setattr(paths, "RESULTS_DIR", tmp_path / "results")
    status, out, err = cli("reproduce", "--profile", "gpu", "--only", "saguaro_e2e", "--jobs", "1",
                           "--save-reference")
    assert status != 0
    assert err.strip() == ("error: --jobs 1 gives saguaro_e2e 1 GPU(s), but it runs on 2 and this machine shows 2: "
                           "its rows that need the others would be skipped; use --jobs auto (or --jobs 2 or more)")
    assert not (tmp_path / "results").exists() and not (tmp_path / "runs").exists()
