"""``python -m ssmspec reproduce``: every experiment of a profile, every figure, then a summary.

Where it writes:

- by default a fresh folder, ``runs/reproduce/<time>/``: each experiment's run in ``results/<id>/<profile>/``
  inside it (``python -m ssmspec run experiment=<id> results_dir=...``), its figures in ``figures/``, and
  with several slots each experiment's log as ``<id>.log``. The committed references in results/ are
  read by nothing and left as they are, so a clone stays clean.
- with ``--save-reference`` (``make reproduce SAVE_REFERENCE=1``) the committed references:
  ``results/<id>/<profile>/`` (``run experiment=<id> --save-reference``) and ``results/figures/``.

The experiments run as a queue over slots (ssmspec/../hydra_plugins/ssmspec_launcher/gpu_queue.py), one
child process each: one slot per GPU on the gpu profile, one on cpu (``--jobs N`` for more); an experiment
with ``gpus: k`` takes k GPU slots at once (``Job.slots``). With several slots the queue starts the experiments
of several GPUs first, then the longest first by the time their committed references took (``queue_order``).
``[k/n] <id>`` lines show the progress, with each experiment's wall time as it ends.

Before it starts, staging folders that killed runs left under results/ and runs/ are removed
(ssmspec/rundir.py), and the output folder is locked: a second reproduction into results/ is refused.
A signal (Ctrl-C, SIGTERM, SIGHUP) stops the running children, removes what they had begun to write and
ends with one line naming the experiments that finished (kept), the ones stopped and the ones not started.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

from ssmspec import interrupt, paths, rundir
from ssmspec.cli import _error, cmd_figures


@dataclasses.dataclass(frozen=True)
class Plan:
    profile: str
    save_reference: bool  # write into the committed results/ (else into base)
    base: Path  # runs/reproduce/<time>: logs, and in the default mode results/ and figures/
    results_root: Path  # <root>/<id>/<profile>/ per experiment
    figures_dir: Path

    def run_dir(self, exp_id: str) -> Path:
        from ssmspec.registry import reference_dir

        return reference_dir(exp_id, self.profile, root=self.results_root)


def make_plan(profile: str, *, save_reference: bool) -> Plan:
    """Where a reproduction writes; the default mode's runs/reproduce/<time>/ is created here, and a
    reproduction started in the same second gets <time>+2."""
    base = Path("runs", "reproduce", datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")).absolute()
    if save_reference:  # base holds the logs of a multi-slot run only: made when the first one is written
        return Plan(profile, True, base, paths.RESULTS_DIR, paths.RESULTS_DIR / "figures")
    name = base.name
    for n in range(2, 1000):
        try:
            base.mkdir(parents=True)
            break
        except FileExistsError:
            base = base.with_name(f"{name}+{n}")
    return Plan(profile, False, base, base / "results", base / "figures")


def slots(profile: str, jobs: str | None) -> list[tuple[str, ...]]:
    """Where ``reproduce`` runs its experiments: one slot per GPU on the gpu profile (``--jobs auto``,
    the default; ``--jobs N``: the first N GPUs), ``N`` CPU slots on the cpu profile (auto: one, since
    CPU timings of parallel runs disturb each other)."""
    from hydra_plugins.ssmspec_launcher.gpu_queue import make_slots
    from hydra_plugins.ssmspec_launcher.launcher import resolve_devices

    jobs = jobs or "auto"
    if jobs != "auto" and not (jobs.isdigit() and int(jobs) >= 1):
        raise ValueError(f"--jobs takes a positive number or auto, got {jobs!r}")
    if profile == "cpu":
        return make_slots([], cpu_jobs=1 if jobs == "auto" else int(jobs))
    found = make_slots(resolve_devices(None)) or [()]
    if jobs != "auto" and int(jobs) > len(found):
        raise ValueError(f"--jobs {jobs} but this machine shows {len(found)} GPU(s); use --jobs auto or fewer")
    return found if jobs == "auto" else found[:int(jobs)]


def gpu_shortfall(exps, profile: str, jobs: str | None, queue_slots: list[tuple[str, ...]], *,
                  save_reference: bool) -> list[str]:
    """Notes for the experiments that take more GPUs (``experiment.gpus``) than this reproduction's slots: the
    queue runs them on the slots there are, and their rows that need the rest are ``skipped``. Raises
    ValueError where ``--jobs`` alone is the cause (the machine shows enough GPUs) and the run would save a
    reference: a reference with rows skipped for a setting the user can fix is a wrong record."""
    if profile != "gpu" or not queue_slots or not queue_slots[0]:
        return []
    shown = len(slots(profile, "auto"))  # every GPU this machine shows (queue_slots may be --jobs' first few)
    notes = []
    for e in exps:
        if e.gpus <= len(queue_slots):
            continue
        if shown >= e.gpus:
            line = (f"--jobs {jobs} gives {e.id} {len(queue_slots)} GPU(s), but it runs on {e.gpus} and this "
                    f"machine shows {shown}: its rows that need the others would be skipped; use --jobs auto "
                    f"(or --jobs {e.gpus} or more)")
            if save_reference:
                raise ValueError(line)
            notes.append(f"reproduce: note: {line}")
        else:
            notes.append(f"reproduce: note: {e.id} runs on {e.gpus} GPUs and this machine shows {shown}: its rows "
                         f"that need more are skipped (each says why)")
    return notes


def _finished_meanwhile(plan: Plan, exp_id: str, since: float) -> bool:
    """A child stopped by the signal may have moved its files into place just before it: its results.jsonl
    is then newer than its start."""
    f = plan.run_dir(exp_id) / "results.jsonl"
    return f.is_file() and f.stat().st_mtime >= since


def _stopped_line(plan: Plan, finished: list[str], failed: list[str], stopped: list[str],
                  waiting: list[str]) -> str:
    """The ``interrupted (...)`` line's account of the experiments."""
    parts, root = [], paths.shown(plan.results_root)
    if finished:
        where = f"their {root}/<id>/{plan.profile} replaced" if plan.save_reference else f"kept in {root}"
        parts.append(f"finished ({where}): {', '.join(finished)}")
    if failed:
        parts.append(f"failed before it: {', '.join(failed)}")
    if stopped:
        what = f"{root}/<id>/{plan.profile} keeps its previous files" if plan.save_reference else "nothing written"
        parts.append(f"stopped ({what}): {', '.join(stopped)}")
    if waiting:
        parts.append(f"not started: {', '.join(waiting)}")
    return "; ".join(parts + ["no figures or summary were made"])


def recorded_wall_s(exp_id: str, profile: str, results_root: Path | None = None) -> float | None:
    """The seconds the committed reference of ``exp_id`` on ``profile`` took to write its rows (its env.json's
    ``wall_s``), or None where there is none (no reference, or one written before runs recorded it)."""
    path = (results_root or paths.RESULTS_DIR) / exp_id / profile / "env.json"
    try:
        wall = json.loads(path.read_text()).get("wall_s")
    except (OSError, ValueError, AttributeError):
        return None
    return float(wall) if isinstance(wall, (int, float)) and wall >= 0 else None


def queue_order(exps, profile: str, n_slots: int, results_root: Path | None = None) -> list:
    """The order the queue starts ``exps`` in. One slot: as given (the registry's order). Several: the experiments
    that take several GPUs first (the queue starts jobs in order and one waits for all its slots, holding the rest
    behind it; at the start every slot is free), then the longest first by their references' ``wall_s`` (the
    longest-processing-time rule: a long experiment started last would run on alone), those with no recorded time
    before the rest (they may be long); ties keep the given order."""
    if n_slots <= 1:
        return list(exps)
    walls = {e.id: recorded_wall_s(e.id, profile, results_root) for e in exps}
    slots_of = lambda e: e.gpus if profile == "gpu" else 1  # noqa: E731
    return sorted(exps, key=lambda e: (-min(slots_of(e), n_slots), walls[e.id] is not None, -(walls[e.id] or 0.0)))


def run_experiments(exps, plan: Plan, queue_slots: list[tuple[str, ...]]) -> list[str]:
    """Each experiment as a child ``python -m ssmspec run``, queued over ``queue_slots`` (pinned to its GPUs);
    returns the ids that failed. One slot: the children write to this terminal, one after the other;
    several: each to <base>/<id>.log."""
    from hydra_plugins.ssmspec_launcher.gpu_queue import Job, run_queue, summary, visible_devices

    env = {"SSMSPEC_CONF": str(paths.CONF_DIR), "SSMSPEC_RESULTS": str(paths.RESULTS_DIR)}
    target = ("--save-reference",)
    jobs = [Job(name=e.id, argv=(sys.executable, "-m", "ssmspec", "run", f"experiment={e.id}",
                                 f"profile={plan.profile}",
                                 *(target if plan.save_reference else (f"results_dir={plan.run_dir(e.id)}",))),
                log=plan.base / f"{e.id}.log" if len(queue_slots) > 1 else None, env=env,
                slots=e.gpus if plan.profile == "gpu" else 1)
            for e in exps]
    titles = {e.id: e.title for e in exps}
    order = {e.id: k for k, e in enumerate(exps, 1)}
    started: dict[str, float] = {}
    ended: dict[str, bool] = {}  # id -> ok
    where = lambda devices: f"GPU {visible_devices(devices)}" if devices else "this machine"  # noqa: E731

    def tag(name: str) -> str:
        return f"[{order[name]}/{len(exps)}] {name}"

    def on_start(job, devices) -> None:
        started[job.name] = time.time()
        extra = f" (on {where(devices)}, log {paths.shown(job.log)})" if job.log else ""
        print(f"\n{tag(job.name)}: {titles[job.name]}{extra}", flush=True)

    def on_end(out) -> None:
        ended[out.job.name] = out.ok
        state = "ok" if out.ok else f"FAILED (exit {out.returncode})"
        error = f": {out.last_error()}" if not out.ok and out.last_error() else ""
        on = f" on {where(out.devices)}" if len(queue_slots) > 1 else ""
        print(f"{tag(out.job.name)}: {state} in {out.wall_s:.1f} s{on}{error}", flush=True)

    t0 = time.perf_counter()
    try:
        outcomes = run_queue(jobs, queue_slots, on_start=on_start, on_end=on_end)
    except interrupt.Interrupted as e:
        ids = [x.id for x in exps]
        finished = [i for i in ids if ended.get(i) or (i in started and i not in ended
                                                       and _finished_meanwhile(plan, i, started[i]))]
        failed = [i for i in ids if ended.get(i) is False]
        stopped = [i for i in ids if i in started and i not in ended and i not in finished]
        for i in stopped:  # a child killed after STOP_WAIT_S left its staging folder
            rundir.sweep(plan.run_dir(i))
            if not plan.save_reference:
                rundir.prune_empty(plan.run_dir(i), plan.base, inclusive=True)
            (plan.base / f"{i}.log").unlink(missing_ok=True)
        e.detail = _stopped_line(plan, finished, failed, stopped, [i for i in ids if i not in started])
        raise
    wall = time.perf_counter() - t0
    print("\n=== experiments (wall time per experiment and where it ran)")
    for out in outcomes:
        print(f"  {'ok' if out.ok else 'FAILED':<6} {out.wall_s:8.1f} s  {where(out.devices):<14} {out.job.name}")
    print(f"  {summary(outcomes, wall, len(queue_slots))}", flush=True)
    return [out.job.name for out in outcomes if not out.ok]


def _sweep_dead() -> None:
    removed = rundir.sweep(paths.RESULTS_DIR, recursive=True, prune=True)
    removed += rundir.sweep(Path("runs"), recursive=True, prune=True)
    if removed:
        print(f"reproduce: removed {len(removed)} staging folder(s) that killed runs had left: "
              f"{', '.join(paths.shown(p) for p in removed)}")


def reproduce(profile: str | None, only: str | None, *, allow_missing_baselines: bool = False,
              jobs: str | None = None, save_reference: bool = False) -> int:
    from ssmspec.config import resolve_profile
    from ssmspec.registry import experiments

    try:
        profile = resolve_profile(profile or os.environ.get("PROFILE") or "auto")
        exps = [e for e in experiments() if profile in e.profiles]
        if only:
            wanted = [s.strip() for s in only.split(",") if s.strip()]
            unknown = sorted(set(wanted) - {e.id for e in experiments()})
            if unknown:
                raise ValueError(f"unknown experiment(s) {unknown} in --only")
            exps = [e for e in exps if e.id in wanted]
        queue_slots = slots(profile, jobs)
        notes = gpu_shortfall(exps, profile, jobs, queue_slots, save_reference=save_reference)
    except ValueError as e:
        return _error(str(e))
    for line in notes:
        print(line, flush=True)
    exps = queue_order(exps, profile, len(queue_slots))
    from ssmspec.summary import preflight

    missing = preflight(profile, allow_missing=allow_missing_baselines)  # before an hour of GPU runs, not after
    if missing:
        return _error(missing)
    out = paths.RESULTS_DIR if save_reference else Path("runs", "reproduce").absolute()
    why = rundir.unwritable(out)
    if why:
        return _error(f"reproduce cannot write into {paths.shown(out)} ({why}); run it from a clone you can "
                      f"write to")
    existing = Path("runs", "reproduce").absolute()
    while not existing.exists():
        existing = existing.parent
    plan = make_plan(profile, save_reference=save_reference)
    # the outermost folder this reproduction makes for runs/reproduce/<time>/: removed again (with the folders
    # below it) if it ends empty, e.g. when nothing finished, or --save-reference wrote no log
    first_new = plan.base
    while first_new.parent != existing:
        first_new = first_new.parent
    out = plan.results_root if save_reference else plan.base
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(rundir.lock(out))
        except rundir.Busy as e:
            return _error(f"{paths.shown(out)} is being written by another reproduction ({e}); wait for it to "
                          f"finish, or run without --save-reference (into runs/reproduce/)")
        stack.callback(lambda: rundir.prune_empty(plan.base, first_new, inclusive=True))
        _sweep_dead()
        return _reproduce(exps, plan, queue_slots, allow_missing_baselines=allow_missing_baselines)


def _reproduce(exps, plan: Plan, queue_slots, *, allow_missing_baselines: bool) -> int:
    from ssmspec.summary import reproduce_report

    print(f"reproduce: profile {plan.profile}, {len(exps)} experiment(s) into {paths.shown(plan.results_root)}: "
          f"{', '.join(e.id for e in exps) or '-'}")
    failed = run_experiments(exps, plan, queue_slots)
    try:
        print("\n=== figures", flush=True)
        ids = None if plan.save_reference else [e.id for e in exps]
        status = cmd_figures(plan.results_root, plan.figures_dir, ids=ids)
        summary, baseline_error = reproduce_report([e.id for e in exps], plan.profile, failed,
                                                   allow_missing=allow_missing_baselines,
                                                   results_root=plan.results_root, figures_dir=plan.figures_dir,
                                                   save_reference=plan.save_reference)
    except interrupt.Interrupted as e:
        done = [x.id for x in exps if x.id not in failed]
        kept = f"kept in {paths.shown(plan.results_root)}: {', '.join(done) or '-'}"
        e.detail = f"the experiments had finished ({kept}); " + (e.detail or "stopped before the summary")
        raise
    print("\n" + summary, flush=True)
    if failed:
        kept = "their older results, if any, are kept" if plan.save_reference else "nothing of them was written"
        return _error(f"{len(failed)} experiment(s) failed: {', '.join(failed)} ({kept})")
    return _error(baseline_error) if baseline_error else status
