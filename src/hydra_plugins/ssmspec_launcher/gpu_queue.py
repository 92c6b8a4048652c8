"""A queue of shell-free commands spread over devices: one subprocess per slot, as many at once as slots.

A slot is a tuple of device ids (``gpus_per_job`` of them); a job's child gets
``CUDA_VISIBLE_DEVICES=<its slot>`` in its environment, so the variable is set before the child imports
torch and CUDA only ever sees its own GPUs. An empty slot ``()`` is a CPU slot: the child's
``CUDA_VISIBLE_DEVICES`` is whatever the job's ``env`` (else the parent) says. A failing job frees its slot and the queue goes on; the caller reads the
outcomes at the end. Used by the ``gpu_queue`` Hydra launcher and by ``ssmspec reproduce --jobs``.

Stopping: a signal (``ssmspec.interrupt.Interrupted``) or any other exception in the parent sends SIGTERM
to the running children (each removes its staging folder and exits 143), waits for them (SIGKILL after
STOP_WAIT_S) and re-raises; the caller knows from ``on_start`` / ``on_end`` which jobs had finished. Each
child is told by ``SSMSPEC_QUEUED=1`` that the parent reports an interruption (it writes its own line to
stdout, not stderr).

Kept free of torch and Hydra imports: Hydra imports every module of ``hydra_plugins`` when it scans for
plugins, on every command.
"""

import dataclasses
import logging
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ssmspec import interrupt

log = logging.getLogger(__name__)
POLL_S = 0.2  # how often finished children are looked for; jobs last seconds to hours
STOP_WAIT_S = 30.0  # how long a stopped child may take to clean up before it is killed
QUEUED_ENV = "SSMSPEC_QUEUED"  # set in each child: its parent reports interruptions


@dataclasses.dataclass(frozen=True)
class Job:
    name: str  # shown in progress lines and the summary (e.g. "#3 bench.batch=[1]")
    argv: tuple[str, ...]  # the child's command line
    log: Path | None = None  # stdout + stderr go here; None: the parent's terminal
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # added to the parent's environment
    slots: int = 1  # slots the job takes at once (an experiment that runs on several GPUs: experiment.gpus);
    #                 capped at the queue's slot count, so a machine with fewer GPUs runs it on all it has


@dataclasses.dataclass(frozen=True)
class Outcome:
    job: Job
    devices: tuple[str, ...]  # the child's CUDA_VISIBLE_DEVICES ((): CPU)
    returncode: int
    started: float  # time.time() at start
    wall_s: float  # the child's wall time

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def last_error(self) -> str:
        """The last ``error:`` line of the job's log (or its last line), for the failure summary."""
        if self.job.log is None or not self.job.log.is_file():
            return ""
        lines = [ln.strip() for ln in self.job.log.read_text(errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("error:")]
        return (errors or lines or [""])[-1]


def visible_devices(devices: Sequence[str]) -> str:
    return ",".join(str(d) for d in devices)


def detect_devices() -> list[str]:
    """GPU ids of this machine: one per GPU torch counts, named as ``$CUDA_VISIBLE_DEVICES`` names them
    when it is set (a Slurm allocation or a parent queue narrowed it), else 0..n-1. A variable naming GPUs
    that CUDA cannot see (a CPU machine with ``CUDA_VISIBLE_DEVICES=0``) counts only those it sees."""
    import torch  # imported only here: Hydra's plugin scan imports this module on every command

    n = torch.cuda.device_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:  # CUDA reads the list up to its first invalid entry: the first n are the visible ones
        return [d.strip() for d in env.split(",") if d.strip()][:n]
    return [str(i) for i in range(n)]


def make_slots(devices: Sequence[str], *, gpus_per_job: int = 1, cpu_jobs: int = 1) -> list[tuple[str, ...]]:
    """Split ``devices`` into slots of ``gpus_per_job`` ids (leftover ids stay idle); no devices:
    ``cpu_jobs`` CPU slots. Raises ValueError naming the fix on impossible settings."""
    if gpus_per_job < 1:
        raise ValueError(f"gpus_per_job must be >= 1, got {gpus_per_job}")
    if cpu_jobs < 1:
        raise ValueError(f"cpu_jobs must be >= 1, got {cpu_jobs}")
    devices = [str(d) for d in devices]
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices lists a GPU twice: {devices}")
    if not devices:
        return [()] * cpu_jobs
    if gpus_per_job > len(devices):
        raise ValueError(f"gpus_per_job={gpus_per_job} but only {len(devices)} device(s) {devices}; lower "
                         f"gpus_per_job or list more devices")
    n = len(devices) // gpus_per_job
    return [tuple(devices[i * gpus_per_job:(i + 1) * gpus_per_job]) for i in range(n)]


def _start(job: Job, devices: tuple[str, ...]) -> subprocess.Popen:
    env = {**os.environ, **job.env, QUEUED_ENV: "1"}
    if devices:  # a CPU slot leaves the variable as the job's env has it (the launcher sets "": no GPU)
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(devices)
    if job.log is None:
        return subprocess.Popen(list(job.argv), env=env)
    job.log.parent.mkdir(parents=True, exist_ok=True)
    with job.log.open("w") as f:  # the child keeps its own descriptor; ours closes at once
        return subprocess.Popen(list(job.argv), env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def run_queue(jobs: Sequence[Job], slots: Sequence[tuple[str, ...]], *,
              on_start: Callable[[Job, tuple[str, ...]], None] | None = None,
              on_end: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Run ``jobs`` in order over ``slots``, at most one job per slot at a time; returns one outcome per
    job, in the order of ``jobs``. An exception (a signal: ``Interrupted``) stops the running children, waits
    for them and re-raises."""
    if not slots:
        raise ValueError("no slot to run jobs on")
    pending = list(enumerate(jobs))
    free = list(slots)
    taken: dict[int, list[tuple[str, ...]]] = {}  # running job -> the slots it holds
    running: dict[int, tuple[subprocess.Popen, tuple[str, ...], float, float]] = {}
    outcomes: dict[int, Outcome] = {}

    def need(job: Job) -> int:  # a CPU queue gives every job one slot; jobs start in order (the first waits)
        return 1 if not slots[0] else max(1, min(job.slots, len(slots)))

    try:
        while pending or running:
            while pending and len(free) >= need(pending[0][1]):
                i, job = pending.pop(0)
                taken[i], free = free[:need(job)], free[need(job):]
                devices = tuple(d for slot in taken[i] for d in slot)
                if on_start:
                    on_start(job, devices)
                with interrupt.deferred():  # a child started is a child recorded, so a signal can stop it
                    running[i] = (_start(job, devices), devices, time.time(), time.perf_counter())
            for i, (proc, devices, started, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                with interrupt.deferred():  # a finished child is reported as finished, never as stopped
                    del running[i]
                    free.extend(taken.pop(i))
                    out = Outcome(jobs[i], devices, proc.returncode, started, time.perf_counter() - t0)
                    outcomes[i] = out
                    if on_end:
                        on_end(out)
            if running:
                time.sleep(POLL_S)
    except BaseException:
        for proc, *_ in running.values():
            proc.terminate()
        deadline = time.monotonic() + STOP_WAIT_S
        for proc, *_ in running.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # its staging folder stays until the caller sweeps it (ssmspec.rundir)
                proc.wait()
        raise
    return [outcomes[i] for i in range(len(jobs))]


def summary(outcomes: Sequence[Outcome], wall_s: float, slots: int) -> str:
    """One line comparing the sweep's wall time with the sum of its jobs' times (the gain of running
    ``slots`` jobs at once)."""
    total = sum(o.wall_s for o in outcomes)
    failed = sum(not o.ok for o in outcomes)
    gain = f"{total / wall_s:.2f}x" if wall_s > 0 else "n/a"
    return (f"{len(outcomes)} job(s), {len(outcomes) - failed} ok, {failed} failed, on {slots} slot(s): "
            f"wall time {wall_s:.1f} s, sum of job times {total:.1f} s ({gain} from running jobs at once)")
