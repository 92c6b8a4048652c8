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
from ssmspec.pipes import GuardedStdout, StdoutClosed, silence

EXIT_USER = 2
GROUPS = ("model", "strategy", "drafter", "verify", "data", "bench", "experiment")


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


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return EXIT_USER


# run -----------------------------------------------------------------------------------------------
def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (paths.CONF_DIR / group).glob("*.yaml"))


def _check_group_overrides(overrides: list[str]) -> None:
    """Unknown config-group options (experiment=foo, model=nope) fail here with the list of choices."""
    for ov in overrides:
        key, eq, value = ov.partition("=")
        key = key.lstrip("+")
        if not eq or key not in GROUPS or re.search(r"[()\[\]{}*]", value):
            continue
        for option in value.split(","):
            option = option.strip()
            if option in ("", "null") and key == "experiment":
                continue
            if not (paths.CONF_DIR / key / f"{option}.yaml").is_file():
                what = {"model": "model preset", "experiment": "experiment"}.get(key, f"{key} config")
                hint = " (`python -m ssmspec list` shows them)" if key == "experiment" else ""
                raise ValueError(f"unknown {what} {option!r}; choose one of: {', '.join(_options(key))}{hint}")


def _value(overrides: list[str], key: str) -> str | None:
    for ov in overrides:
        k, eq, v = ov.partition("=")
        if eq and k.lstrip("+") == key:
            return v
    return None


def _quote(path: str) -> str:
    return path if re.fullmatch(r"[\w./\-+:@]+", path) else "'" + path.replace("'", "\\'") + "'"


def _cfg_job(args: list[str]) -> bool:
    """``--cfg job`` (or ``-c job``) without ``--package``: ssmspec prints the config that runs."""
    return any(a in ("-c", "--cfg") and args[i + 1:i + 2] == ["job"] for i, a in enumerate(args)) and not any(
        a in ("-p", "--package") for a in args)


def _one_line(e: Exception) -> str:
    """A Hydra composition or parse error as one line naming the key and the fix."""
    first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
    cause = str(e.__cause__ or "").strip().splitlines()
    if cause and "is not in struct" in cause[0]:
        return f"{first}: no such key; check its spelling (`python -m ssmspec run experiment=<id> --cfg job` " \
               f"lists every key)"
    if "no viable alternative" in first or "mismatched input" in first or "extraneous input" in first:
        return f"cannot parse an override ({first}); see https://hydra.cc/docs/advanced/override_grammar/basic"
    return f"{first}: {cause[0]}" if cause else first


def _variants(overrides: list[str]) -> list[list[str]]:
    """The runs a sweep's overrides ask for, enough to try every value once: the first value of every
    sweep, then each other value of one sweep at a time (not the whole product)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = [[f"{ov.get_key_element()}={v}" for v in ov.sweep_string_iterator()] if ov.is_sweep_override()
               else [ov.input_line] for ov in parsed]
    base = [c[0] for c in choices]
    out = [base]
    for i, c in enumerate(choices):
        out += [base[:i] + [v] + base[i + 1:] for v in c[1:]]
    return out


def _precheck(overrides: list[str], *, multirun: bool) -> list:
    """Compose and validate every run the overrides ask for before Hydra starts any (one ``error:`` line
    for a bad key, type or value, never a half-started sweep); returns the prepared configs."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ssmspec.runner import prepare

    cfgs = []
    quiet = logging.getLogger("ssmspec")  # the job logs what prepare decides; once is enough
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        variants = _variants(overrides) if multirun else [overrides]
        with initialize_config_dir(config_dir=str(paths.CONF_DIR), version_base="1.3", job_name="precheck"):
            for ov in variants:
                cfgs.append(prepare(compose("config", overrides=ov), cli_overrides=ov)[0])
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(_one_line(e)) from e
    finally:
        quiet.setLevel(level)
    return cfgs


# hydra/launcher choices of hydra-submitit-launcher -> (Python modules they import, commands they run)
_SUBMITIT = ("submitit", "hydra_plugins.hydra_submitit_launcher")
_LAUNCHER_NEEDS = {"slurm": (_SUBMITIT, ("sbatch", "srun")), "submitit_slurm": (_SUBMITIT, ("sbatch", "srun")),
                   "submitit_local": (_SUBMITIT, ())}
_LAUNCH_HERE = "here, run the sweep with hydra/launcher=gpu_queue, or without hydra/launcher (one job after another)"


def _check_launcher(overrides: list[str]) -> None:
    """A sweep through submitit on a machine without it (or, for Slurm, without Slurm) fails before Hydra
    starts, naming what is missing and the fix, instead of a traceback from inside the launcher."""
    import importlib.util
    import shutil

    choice = _value(overrides, "hydra/launcher")
    modules, commands = _LAUNCHER_NEEDS.get(choice, ((), ()))
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        needs = (f"hydra-submitit-launcher ({' and '.join(missing)} {'does' if len(missing) == 1 else 'do'} not "
                 f"import here)" +
                 (" and a Slurm cluster" if commands else ""))
        install = "on the cluster, pip install -e \".[slurm]\"" if commands else "pip install -e \".[slurm]\""
        raise ValueError(f"hydra/launcher={choice} needs {needs}: {install}; {_LAUNCH_HERE}")
    absent = [c for c in commands if shutil.which(c) is None]
    if absent:
        raise ValueError(f"hydra/launcher={choice} submits the sweep to a Slurm cluster, and this machine has no "
                         f"Slurm ({' and '.join(absent)} not on PATH): run it on the cluster's login node; {_LAUNCH_HERE}")


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

    register_configs()
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


# plot / figures -------------------------------------------------------------------------------------
def _draw(exp, run_dir: Path, out: Path) -> Path:
    """Draw ``exp``'s figure from ``run_dir``'s rows into ``out``, through a hidden file renamed into place
    (an interrupted drawing leaves the older figure, not half a PNG)."""
    from ssmspec.registry import read_results

    df = read_results(run_dir)
    if df.empty:
        raise ValueError(f"{run_dir}/results.jsonl has no rows")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp{out.suffix}")
    try:
        exp.plot_fn()(df, tmp)
        if not tmp.is_file():
            raise RuntimeError(f"plot function {exp.plot} wrote no file at {out}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def cmd_plot(exp_id: str, *, profile: str | None = None, run_dir: str | None = None, out: str | None = None,
             results_root: Path | None = None, figures_dir: Path | None = None) -> int:
    """Draw ``exp_id``'s figure: from one run directory (``run_dir``), else from the reference results of each
    profile under ``results_root`` (default results/) into ``figures_dir`` (default results/figures/)."""
    from ssmspec.registry import figure_path, get_experiment, reference_dir, reference_profiles

    try:
        exp = get_experiment(exp_id)
        if run_dir:
            target = Path(out) if out else Path(run_dir) / f"{exp_id}.png"
            print(_draw(exp, Path(run_dir), target))
            return 0
        profiles = [profile] if profile else reference_profiles(exp_id, root=results_root)
        if not profiles:
            root = results_root or paths.RESULTS_DIR
            raise ValueError(f"no reference results for {exp_id!r} under {root}/{exp_id}/; run `python -m ssmspec "
                             f"run experiment={exp_id} --save-reference`, or plot a run with --from runs/...")
        if out and len(profiles) > 1:
            raise ValueError("--out names one file: add --profile cpu|gpu")
        for p in profiles:
            target = Path(out) if out else figure_path(exp_id, p, figures=figures_dir)
            print(paths.shown(_draw(exp, reference_dir(exp_id, p, root=results_root), target)))
    except ValueError as e:
        return _error(str(e))
    return 0


def cmd_figures(results_root: Path | None = None, figures_dir: Path | None = None,
                ids: list[str] | None = None) -> int:
    """Draw every figure (of ``ids`` only, if given) that has results under ``results_root``."""
    from ssmspec.registry import experiments, reference_profiles

    try:
        exps = [e for e in experiments() if ids is None or e.id in ids]
    except ValueError as e:
        return _error(str(e))
    status, seen, drawn = 0, 0, 0
    try:
        for exp in exps:
            if reference_profiles(exp.id, root=results_root):
                status = max(status, cmd_plot(exp.id, results_root=results_root, figures_dir=figures_dir))
                drawn += 1
            else:
                print(f"{exp.id}: no reference results yet (skipped)")
            seen += 1
    except interrupt.Interrupted as e:
        e.detail = e.detail or (f"the figures of {drawn} experiment(s) were drawn and are kept; not drawn: "
                                f"{', '.join(x.id for x in exps[seen:])}")
        raise
    return status


# list / clean ---------------------------------------------------------------------------------------
def cmd_list() -> int:
    from ssmspec.registry import experiments, reference_profiles

    try:
        exps = experiments()
    except ValueError as e:
        return _error(str(e))
    width = max([len(e.id) for e in exps] + [2])
    print(f"{'id':<{width}}  {'profiles':<8}  {'gpu?':<4}  {'results':<7}  title")
    for e in exps:
        print(f"{e.id:<{width}}  {','.join(e.profiles):<8}  {e.gpu_label:<4}  "
              f"{','.join(reference_profiles(e.id)) or '-':<7}  {e.title}")
    if any(e.interpreter_ok for e in exps):
        print("yes*: a CUDA GPU, or Triton's CPU interpreter (TRITON_INTERPRET=1; slow, for small grids)")
    return 0


def cmd_clean(*, keep_runs: bool) -> int:
    """Remove the staging folders killed runs left under results/ and runs/, then (unless ``keep_runs``)
    runs/, outputs/ and multirun/, keeping whatever a live run uses."""
    runs = [Path(n).absolute() for n in ("runs", "outputs", "multirun")]
    for line in rundir.clean(paths.RESULTS_DIR, runs, remove_runs=not keep_runs):
        print(f"clean: {line}")
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
