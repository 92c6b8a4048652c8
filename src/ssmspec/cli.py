"""Command line: ``python -m ssmspec <command>`` (or the ``ssmspec`` console script).

    run [-m] [--save-reference] [overrides]   run an experiment (Hydra: experiment=<id> key=value ...)
    plot <id> [--profile P] [--from DIR] [--out PNG] [--results ROOT] [--figures DIR]   draw an experiment's
                                              figure from results only
    figures [--results ROOT] [--figures DIR]  draw every figure that has reference results
    policy --fit <cost_model.json> --batch B [B ...] --alpha A   the cost model's pick of strategy, S and D
    reproduce [--profile cpu|gpu] [--only ID,...] [--allow-missing-baselines] [--jobs N|auto] [--save-reference]
                                              run every experiment of the profile (one per GPU at once) into
                                              runs/reproduce/<time>/ (--save-reference: into results/), draw
                                              their figures, end with a summary (ssmspec/reproduce.py)
    train [NAME] [--retrain] [key=value ...]  train model pairs offline (conf/train/NAME.yaml, default tiny) into
                                              the cache .cache/train/<key>/ and print where the checkpoints are
    list                                      the registered experiments with titles and profiles
    clean [--keep-runs]                       remove the staging folders of killed runs, then runs/

A user error (unknown experiment or preset, a setting out of range, a GPU-only request on a CPU machine,
a results_dir that cannot be written or that another run is writing) prints one line starting with
``error:`` and exits with status 2; no run directory is left behind. SIGINT, SIGTERM and SIGHUP stop any
command with one line, ``interrupted (SIGTERM): <what was kept, what was not>``, and exit status 128 + the
signal number, leaving no staging folder and no empty run directory (ssmspec/interrupt.py). A closed
stdout (``ssmspec list | head -1``) ends any command quietly with status 141 (ssmspec/pipes.py).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from pathlib import Path

from ssmspec import interrupt, paths, rundir
from ssmspec.cli_checks import (EXIT_USER, _cfg_job, _check_group_overrides, _check_launcher, _error, _precheck,
                                _quote, _value)
from ssmspec.cli_report import cmd_clean, cmd_figures, cmd_list, cmd_plot
from ssmspec.pipes import GuardedStdout, StdoutClosed, silence



class _State:
    """What the Hydra job and the command around it share (same process)."""

    def __init__(self, results_dir: Path | None = None, multirun: bool = False) -> None:
        self.job_started = False
        self.results_dir = results_dir  # the user's results_dir, absolute (None: Hydra names the run dir)
        self.preexisting = results_dir is not None and results_dir.exists()  # never removed on failure
        self.created: list[Path] = []  # directories this invocation made (removed again on failure)
        self.sweep_dir: Path | None = None  # a sweep's directory (hydra_callbacks.SweepStart, then each job)
        self.multirun = multirun
        self.done: list[tuple[Path, int]] = []  # (run directory, job number) of the jobs that finished
        self.current: tuple[Path, int] | None = None  # the job running now

    def interrupted(self) -> str:
        """What an interrupted ``run`` kept and what not, for its ``interrupted (...)`` line."""
        kept = ""
        if self.results_dir is not None and self.preexisting:
            kept = f"; {paths.shown(self.results_dir)} keeps its previous files"
        if not self.multirun:
            if self.done:
                return f"the run had finished before the signal: its files are in {paths.shown(self.done[0][0])}"
            return "nothing of this run was written" + kept
        stopped = f"; nothing of job #{self.current[1]} was written" if self.current else ""
        if self.done:
            jobs = ", ".join(f"#{n}" for _, n in self.done)
            sweep = paths.shown(self.sweep_dir or self.done[0][0].parent)
            return f"job(s) {jobs} finished and are kept in {sweep}{stopped}"
        return "nothing of this sweep was written" + kept


_STATE = _State()


# run -----------------------------------------------------------------------------------------------
def _job(cfg) -> None:
    """The Hydra task: run the experiment into the job's output directory.

    ``cmd_run`` holds signals while Hydra composes and makes this directory; they are let through once the
    directory is recorded, so an interrupted job always removes what it made."""
    from hydra.core.hydra_config import HydraConfig

    from ssmspec.runner import UserError, run_experiment

    _STATE.job_started = True
    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir).absolute()
    multirun = hc.mode.name == "MULTIRUN"
    if multirun or not _STATE.preexisting:
        _STATE.created.append(out)  # a sweep's job dir is always new
    sweep = Path(hc.sweep.dir).absolute()
    if multirun:
        _STATE.sweep_dir = sweep
    if multirun and not _STATE.preexisting and sweep not in _STATE.created:
        _STATE.created.insert(0, sweep)
    _STATE.current = (out, int(hc.job.num) if multirun else 0)
    try:
        with interrupt.allowed():
            run_experiment(cfg, out, cli_overrides=list(hc.overrides.task))
    except UserError as e:
        _cleanup()
        raise SystemExit(_error(str(e)))
    except interrupt.Interrupted as e:
        if e.written:  # finished before the signal: its files stay
            _STATE.done.append(_STATE.current)
            _STATE.current = None
        else:
            _cleanup()
        raise
    except BaseException:
        _cleanup()
        raise
    _STATE.done.append(_STATE.current)
    _STATE.current = None


def _cleanup() -> None:
    """After a failed job: remove the empty directories Hydra made for it (and a sweep record with no
    completed run beside it), never a folder that existed before."""
    for d in reversed(_STATE.created):
        if not d.is_dir():
            continue
        if not [p for p in d.iterdir() if p.name != "multirun.yaml"]:
            (d / "multirun.yaml").unlink(missing_ok=True)
        stop = Path.cwd().absolute()
        rundir.prune_empty(d, stop if stop in d.parents else d.parent)


def _unwritable_target(overrides: list[str], results_path: Path | None, multirun: bool) -> str | None:
    """The ``error:`` message when the run could not write its directory (a read-only mount, /sys, a folder
    without write permission), checked before anything runs; None when it can."""
    if results_path is not None:
        why = rundir.unwritable(results_path)
        return None if why is None else (
            f"results_dir={results_path} cannot be written ({why}); choose a folder you can write to")
    pattern = _value(overrides, f"hydra.{'sweep' if multirun else 'run'}.dir") or "runs"
    base = Path(pattern.strip("'\"").split("${")[0] or ".").absolute()
    why = rundir.unwritable(base)
    return None if why is None else (
        f"the run directory under {base} cannot be written ({why}); run from a folder you can write to, "
        f"or pass results_dir=<a folder you can write to>")


def cmd_run(argv: list[str]) -> int:
    multirun = any(a in ("-m", "--multirun") for a in argv)
    _STATE.__init__(None, multirun)
    try:
        return _cmd_run(argv, multirun)
    except interrupt.Interrupted as e:
        e.detail = e.detail or _STATE.interrupted()
        for d in e.emptied:  # a gpu_queue sweep directory with no job kept: only Hydra's multirun.yaml
            if not (_STATE.preexisting and d == _STATE.results_dir):
                _STATE.created.append(d)
        _cleanup()
        raise


def _cmd_run(argv: list[str], multirun: bool) -> int:
    save_ref = "--save-reference" in argv
    inspect_only = any(a in ("-h", "--help", "--hydra-help", "-i", "--info", "-c", "--cfg") for a in argv)
    args = [a for a in argv if a != "--save-reference"]  # Hydra's own flags keep their order and values
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    results_path = None
    try:
        _check_group_overrides(overrides)
        if multirun and not inspect_only:
            _check_launcher(overrides)
        exp_id = _value(overrides, "experiment")
        if (not exp_id or exp_id == "null") and not inspect_only:
            raise ValueError("no experiment chosen: add experiment=<id> (`python -m ssmspec list` shows the ids)")
        results_dir = _value(overrides, "results_dir")
        if save_ref:
            if multirun or results_dir:
                raise ValueError("--save-reference writes one run to results/<id>/<profile>; drop -m and results_dir=")
            if not exp_id or "," in exp_id:
                raise ValueError("--save-reference takes one experiment: experiment=<id>")
            from ssmspec.config import resolve_profile

            profile = resolve_profile(_value(overrides, "profile") or "auto")
            args = [a for a in args if a.partition("=")[0] != "profile"] + [f"profile={profile}"]
            results_dir = str(paths.RESULTS_DIR / exp_id / profile)
        if results_dir and results_dir != "null":
            results_path = Path(results_dir.strip("'\"")).absolute()
            quoted = _quote(str(results_path))
            args = [a for a in args if a.partition("=")[0] != "results_dir"]
            args += [f"results_dir={quoted}", f"hydra.{'sweep' if multirun else 'run'}.dir={quoted}"]
        if not inspect_only:
            unwritable = _unwritable_target(overrides, results_path, multirun)
            if unwritable:
                raise ValueError(unwritable)
    except ValueError as e:
        return _error(str(e))
    _STATE.__init__(results_path, multirun)
    with contextlib.ExitStack() as held:
        if results_path is not None and results_path.is_dir() and not inspect_only:
            try:  # refused at once, before torch loads, when another run writes there (the job locks it again)
                held.enter_context(rundir.lock(results_path))
            except rundir.Busy as e:
                return _error(rundir.busy_message(results_path, str(e)))
        return _run_hydra(args, multirun=multirun, inspect_only=inspect_only)


def _run_hydra(args: list[str], *, multirun: bool, inspect_only: bool) -> int:
    import hydra  # imported only now: a bad override above answers without loading torch

    from ssmspec.config import register_configs
    from ssmspec.hydra_callbacks import register_resolvers

    register_configs()
    register_resolvers()
    task = [a for a in args if "=" in a and not a.startswith("-") and not re.match(r"\+*hydra[./]", a)]
    if "--hydra-help" in args:  # Hydra's help composes no experiment: task overrides only confuse it
        args = [a for a in args if a not in task]
    elif not inspect_only or _cfg_job(args):
        try:
            cfgs = _precheck(task, multirun=multirun)
        except ValueError as e:
            return _error(str(e))
        if _cfg_job(args) and not multirun:  # what runs: profile_overrides merged, auto values resolved
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(cfgs[0]), end="")
            return 0
    if any(a in ("-i", "--info") for a in args):
        logging.getLogger().handlers.clear()  # Hydra's --info adds its own stdout handler: print once
    main = hydra.main(version_base="1.3", config_path=str(paths.CONF_DIR), config_name="config")(_job)
    # signals wait while Hydra composes and makes the run directory; _job (and the gpu_queue launcher) let
    # them through once it is recorded. Another launcher (submitit, ...) gets them at once.
    launcher = _value(args, "hydra/launcher")
    gate = interrupt.deferred() if launcher in (None, "basic", "gpu_queue") else contextlib.nullcontext()
    saved = sys.argv
    sys.argv = ["ssmspec", *args]
    try:
        with gate:
            main()
    except StdoutClosed:  # the reader of stdout went away (ssmspec/pipes.py): main() exits quietly
        sweep = _STATE.sweep_dir  # a sweep stopped before its first job: its multirun.yaml goes too
        if multirun and sweep is not None and not _STATE.preexisting and sweep not in _STATE.created:
            _STATE.created.insert(0, sweep)
        _cleanup()
        raise
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if hasattr(e, "message"):  # the gpu_queue launcher: failed jobs (1) or bad launcher settings (2)
            print(f"error: {e.message}", file=sys.stderr)
            return code
        if code and not _STATE.job_started:
            return EXIT_USER  # Hydra rejected the overrides and printed why
        return code
    finally:
        sys.argv = saved
    return 0


# entry -----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (141, quietly, when stdout is closed: ssmspec/pipes.py)."""
    saved = sys.stdout
    sys.stdout = guarded = GuardedStdout(saved)
    try:
        status = _with_signals(argv)
        sys.stdout.flush()  # what is still buffered, while a closed pipe can still be caught here
        return status
    except (BrokenPipeError, StdoutClosed):
        return silence(saved)
    finally:
        if sys.stdout is guarded:
            sys.stdout = saved


def _with_signals(argv: list[str] | None) -> int:
    """The command, with SIGINT, SIGTERM and SIGHUP turned into one ``interrupted (...)`` line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with interrupt.handle_signals():
        try:
            return _dispatch(argv)
        except interrupt.Interrupted as e:
            e.reached_top()  # not one a library dropped on the way (ssmspec/interrupt.py)
            # a child of a queue (reproduce, gpu_queue) says it on stdout: its parent's line is the one on stderr
            queued = os.environ.get("SSMSPEC_QUEUED") == "1"
            print(f"interrupted ({e.name}): {e.detail or 'stopped; nothing was written'}",
                  file=sys.stdout if queued else sys.stderr, flush=True)
            return e.exit_status


def _dispatch(argv: list[str]) -> int:
    os.environ.setdefault("MPLBACKEND", "Agg")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if argv and argv[0] == "run":  # everything after `run` belongs to Hydra
        return cmd_run(argv[1:])
    if argv and argv[0] == "train":  # offline training of model pairs (ssmspec/train/command.py)
        from ssmspec.train.command import main as train_main

        return train_main(argv[1:])
    if argv and argv[0] == "policy":  # the cost model's pick (ssmspec/policy.py)
        from ssmspec.policy import main as policy_main

        return policy_main(argv[1:])
    parser = argparse.ArgumentParser(prog="ssmspec", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run", help="run an experiment: run experiment=<id> [-m] [--save-reference] [key=value ...]")
    p = sub.add_parser("plot", help="draw an experiment's figure from its results")
    p.add_argument("id")
    p.add_argument("--profile", choices=["cpu", "gpu"])
    p.add_argument("--from", dest="run_dir", help="a run directory (default: the reference results)")
    p.add_argument("--out", help="PNG path (default: <figures>/<id>-<profile>.png, or next to --from)")
    f = sub.add_parser("figures", help="draw every figure that has reference results")
    for q in (p, f):
        q.add_argument("--results", type=Path, metavar="ROOT",
                       help="a results tree laid out as <id>/<profile>/ (default: results/; a reproduction's: "
                            "runs/reproduce/<time>/results)")
        q.add_argument("--figures", type=Path, metavar="DIR", help="where the PNGs go (default: results/figures)")
    r = sub.add_parser("reproduce", help="run every experiment of the profile, then draw every figure")
    r.add_argument("--profile", choices=["cpu", "gpu", "auto"])
    r.add_argument("--only", help="comma-separated experiment ids")
    r.add_argument("--jobs", default="auto", help="experiments at once: auto (one per GPU on the gpu profile, "
                   "one on cpu) or a number; each runs pinned to its GPU(s) (CUDA_VISIBLE_DEVICES)")
    r.add_argument("--allow-missing-baselines", action="store_true",
                   help="on the GPU, run and exit 0 even where mamba_ssm / fla do not import (rows say skipped)")
    r.add_argument("--save-reference", action="store_true",
                   help="write into the committed results/<id>/<profile>/ and results/figures/ (default: a fresh "
                        "runs/reproduce/<time>/, leaving results/ as it is)")
    sub.add_parser("train", help="train model pairs offline: train [NAME] [--retrain] [key=value ...]")
    sub.add_parser("list", help="registered experiments")
    c = sub.add_parser("clean", help="remove what killed runs left (staging folders), then runs/ (see --keep-runs)")
    c.add_argument("--keep-runs", action="store_true", help="only remove the staging folders of dead runs")
    args = parser.parse_args(argv)
    if args.cmd == "plot":
        return cmd_plot(args.id, profile=args.profile, run_dir=args.run_dir, out=args.out, results_root=args.results,
                        figures_dir=args.figures)
    if args.cmd == "figures":
        return cmd_figures(args.results, args.figures)
    if args.cmd == "reproduce":
        from ssmspec.reproduce import reproduce

        return reproduce(args.profile, args.only, allow_missing_baselines=args.allow_missing_baselines,
                         jobs=args.jobs, save_reference=args.save_reference)
    if args.cmd == "clean":
        return cmd_clean(keep_runs=args.keep_runs)
    return cmd_list()
