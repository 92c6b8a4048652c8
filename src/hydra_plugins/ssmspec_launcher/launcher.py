"""``hydra/launcher=gpu_queue``: a multirun's jobs as a queue, one ``ssmspec run`` subprocess per GPU.

    python -m ssmspec run -m hydra/launcher=gpu_queue experiment=kernel_parity bench.batch=[1],[16],[64],[256]

Each job is the command a user would type for that one point of the sweep,
``python -m ssmspec run <the job's overrides> results_dir=<sweep dir>/<job subdir>``, started with
``CUDA_VISIBLE_DEVICES`` set to its GPU(s) in the child's environment, so CUDA in the child never sees
another job's GPU. As many jobs run at once as there are slots (``len(devices) // gpus_per_job``; with no
GPU, ``cpu_jobs``). Every job writes its output to ``<sweep dir>/logs/<job subdir>.log`` and one row to
``<sweep dir>/jobs.jsonl`` (overrides, directory, devices, exit status, start time, wall time). A failed
job leaves no run directory (the runner stages its files and removes them on failure) and the queue
goes on; at the end the launcher logs a table of the jobs and the sweep's wall time against the sum of
its jobs' times, and exits non-zero naming the failed jobs (``SweepExit``). A signal stops the running
jobs (ssmspec/interrupt.py): the finished ones keep their directories, logs and jobs.jsonl rows; the
stopped ones leave nothing (their staging folders and logs are removed), and ``ssmspec run`` ends with
one line naming both.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from hydra_plugins.ssmspec_launcher import config as _config  # noqa: F401  (registers hydra/launcher=gpu_queue)
from hydra_plugins.ssmspec_launcher.gpu_queue import (Job, Outcome, detect_devices, make_slots, run_queue, summary,
                                                      visible_devices)
from ssmspec import interrupt

log = logging.getLogger(__name__)
DEVICES_ENV = "SSMSPEC_DEVICES"  # comma-separated GPU ids (of this machine) instead of all of them
OWN_KEYS = ("results_dir",)  # overrides the launcher sets itself for each job


class SweepExit(SystemExit):
    """The sweep ended with failed jobs (code 1) or the launcher's settings cannot work (code 2).

    A SystemExit so that Hydra passes it through unchanged; ``ssmspec run`` prints ``message`` as one
    ``error:`` line."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code)
        self.message = message


def resolve_devices(devices: Sequence[str] | None) -> list[str]:
    """The launcher's ``devices`` option, else ``$SSMSPEC_DEVICES``, else the GPUs of this machine. An explicit
    list naming a GPU this machine does not show raises ValueError before any job starts (a job pinned to
    it would run on the CPU while the log says "on GPU 2")."""
    if devices is not None:
        devices = [str(d) for d in devices]
        return _shown(devices, f"devices=[{','.join(devices)}]", "hydra.launcher.devices")
    env = os.environ.get(DEVICES_ENV)
    if env is not None:
        return _shown([d.strip() for d in env.split(",") if d.strip()], f"${DEVICES_ENV}={env}", DEVICES_ENV)
    return detect_devices()


def _shown(devices: list[str], what: str, setting: str) -> list[str]:
    shown = detect_devices()
    unknown = [d for d in devices if d not in shown]
    if not unknown:
        return devices
    drop = f"unset {setting}" if setting == DEVICES_ENV else f"drop {setting}"
    if not shown:
        raise ValueError(f"{what} names GPU {', '.join(unknown)}, but this machine shows no GPU; {drop} to run the "
                         f"jobs on the CPU")
    raise ValueError(f"{what} names GPU {', '.join(unknown)}, which this machine does not show (it shows GPU "
                     f"{', '.join(shown)}); list only those, or {drop} to use them all")


def _log_name(subdir: str) -> str:
    return subdir.replace(os.sep, "_") + ".log"  # an override value may hold a path


def _drop_partial(job_dir: Path) -> None:
    """A child killed hard (out of memory, SIGKILL) cannot clean up: remove its staging folder (its owner is
    dead), and the job directory when nothing else is in it."""
    from ssmspec import rundir

    if not job_dir.is_dir():
        return
    rundir.sweep(job_dir)
    if not any(job_dir.iterdir()):
        job_dir.rmdir()


class GpuQueueLauncher(Launcher):
    def __init__(self, devices: Sequence[str] | None = None, gpus_per_job: int = 1, cpu_jobs: int = 1,
                 logs_subdir: str = "logs") -> None:
        self.devices = None if devices is None else list(devices)
        self.gpus_per_job = int(gpus_per_job)
        self.cpu_jobs = int(cpu_jobs)
        self.logs_subdir = str(logs_subdir)
        self.slots: list[tuple[str, ...]] = []
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # runs before the sweeper makes the sweep directory: bad settings leave nothing behind
        self.config, self.hydra_context = config, hydra_context
        try:
            self.slots = make_slots(resolve_devices(self.devices), gpus_per_job=self.gpus_per_job,
                                    cpu_jobs=self.cpu_jobs)
        except ValueError as e:
            raise SweepExit(2, f"hydra.launcher: {e}") from None

    def _job(self, overrides: Sequence[str], num: int, sweep_dir: Path) -> tuple[Job, DictConfig, Path]:
        assert self.config is not None and self.hydra_context is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.id = num
            cfg.hydra.job.num = num
        HydraConfig.instance().set_config(cfg)  # resolves ${hydra:...} in the subdir pattern
        subdir = str(cfg.hydra.sweep.subdir)
        job_dir = (sweep_dir / subdir).absolute()
        kept = [o for o in overrides if o.lstrip("+~").partition("=")[0] not in OWN_KEYS]
        argv = (sys.executable, "-m", "ssmspec", "run", *kept, f"results_dir={job_dir}")
        name = f"#{num} {' '.join(filter_overrides(kept))}".strip()
        job = Job(name=name, argv=argv, log=sweep_dir / self.logs_subdir / _log_name(subdir),
                  env={"SSMSPEC_CONF": _conf_dir(), **({} if self.slots[0] else {"CUDA_VISIBLE_DEVICES": ""})})
        return job, cfg, job_dir

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.config is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        planned = [self._job(ov, initial_job_idx + i, sweep_dir) for i, ov in enumerate(job_overrides)]
        where = ", ".join(f"GPU {visible_devices(s)}" if s else "CPU" for s in self.slots)
        log.info("gpu_queue: %d job(s), %d at once (%s); logs in %s", len(planned), len(self.slots), where,
                 sweep_dir / self.logs_subdir)
        record = sweep_dir / "jobs.jsonl"
        dirs = {job.name: job_dir for job, _, job_dir in planned}

        def on_start(job: Job, devices: tuple[str, ...]) -> None:
            log.info("start  %s on %s", job.name, f"GPU {visible_devices(devices)}" if devices else "CPU")

        def on_end(out: Outcome) -> None:
            job_dir = dirs[out.job.name]
            if not out.ok:
                _drop_partial(job_dir)
            status = "ok" if out.ok else f"FAILED (exit {out.returncode}): {out.last_error()}"
            log.info("end    %s: %s in %.1f s", out.job.name, status, out.wall_s)
            row = {"job": out.job.name, "argv": list(out.job.argv[3:]), "dir": str(job_dir),
                   "log": str(out.job.log), "devices": visible_devices(out.devices), "returncode": out.returncode,
                   "status": "ok" if out.ok else "failed", "wall_s": round(out.wall_s, 3),
                   "started": datetime.datetime.fromtimestamp(out.started, datetime.timezone.utc)
                   .isoformat(timespec="seconds")}
            with record.open("a") as f:
                f.write(json.dumps(row) + "\n")

        t0 = time.perf_counter()
        started: list[str] = []
        ended: list[Outcome] = []
        try:
            with interrupt.allowed():  # `ssmspec run` held signals while Hydra made the sweep directory
                outcomes = run_queue([job for job, _, _ in planned], self.slots,
                                     on_start=lambda job, dev: (started.append(job.name), on_start(job, dev)),
                                     on_end=lambda out: (ended.append(out), on_end(out)))
        except interrupt.Interrupted as e:
            e.detail = self._stopped(planned, started, ended, sweep_dir)
            e.emptied.append(sweep_dir)
            raise
        wall = time.perf_counter() - t0
        for out in outcomes:
            log.info("  %-6s %6.1f s  %-10s %s", "ok" if out.ok else "FAILED", out.wall_s,
                     visible_devices(out.devices) or "cpu", out.job.name)
        log.info("gpu_queue: %s", summary(outcomes, wall, len(self.slots)))
        failed = [o for o in outcomes if not o.ok]
        if failed:
            names = ", ".join(o.job.name.split()[0] for o in failed)
            raise SweepExit(1, f"{len(failed)} of {len(outcomes)} job(s) failed ({names}); the other jobs' "
                               f"results are in {sweep_dir}; see {sweep_dir / self.logs_subdir} and jobs.jsonl")
        return [self._return(cfg, job_dir) for _, cfg, job_dir in planned]

    def _stopped(self, planned, started: list[str], ended: list[Outcome], sweep_dir: Path) -> str:
        """Remove what the stopped jobs began (staging folders, logs); say what was kept and what not."""
        done = {o.job.name for o in ended if o.ok}
        failed = [o.job.name.split()[0] for o in ended if not o.ok]
        over = {o.job.name for o in ended}
        stopped = []
        for job, _, job_dir in planned:
            if job.name not in started or job.name in over:
                continue
            if (job_dir / "results.jsonl").is_file():  # its files moved into place just before the signal
                done.add(job.name)
                continue
            stopped.append(job)
            _drop_partial(job_dir)
            if job.log is not None:
                job.log.unlink(missing_ok=True)
        logs = sweep_dir / self.logs_subdir
        if logs.is_dir() and not any(logs.iterdir()):
            logs.rmdir()
        parts = [f"job(s) {', '.join(n.split()[0] for n in sorted(done, key=_num))} finished and are kept in "
                 f"{sweep_dir}" if done else "no job had finished"]
        if failed:
            parts.append(f"failed before it: {', '.join(failed)}")
        if stopped:
            parts.append(f"stopped (nothing written): {', '.join(j.name.split()[0] for j in stopped)}")
        waiting = [job.name.split()[0] for job, _, _ in planned if job.name not in started]
        if waiting:
            parts.append(f"not started: {', '.join(waiting)}")
        return "; ".join(parts)

    @staticmethod
    def _return(cfg: DictConfig, job_dir: Path) -> JobReturn:
        ret = JobReturn(overrides=list(cfg.hydra.overrides.task), cfg=cfg, hydra_cfg=None,
                        working_dir=str(job_dir), task_name=str(cfg.hydra.job.name), status=JobStatus.COMPLETED)
        ret.return_value = None
        return ret


def _num(name: str) -> int:
    return int(name.split()[0].lstrip("#"))


def _conf_dir() -> str:
    """The config folder the parent composed from, so the children read the same experiments."""
    from ssmspec import paths

    return str(paths.CONF_DIR)
