"""Command line: ``python -m ssmspec <command>`` (or the ``ssmspec`` console script).

    run [-m] [--save-reference] [overrides]   run an experiment (Hydra: experiment=<id> key=value ...)
    plot <id> [--profile P] [--from DIR] [--out PNG]   draw an experiment's figure from results only
    figures                                   draw every figure that has reference results
    policy --fit <cost_model.json> --batch B [B ...] --alpha A   the cost model's pick of strategy, S and D
    reproduce [--profile cpu|gpu] [--only ID,...] [--allow-missing-baselines] [--jobs N|auto]  run every
                                              experiment of the profile (one per GPU at once), draw all figures,
                                              end with a summary (ssmspec/summary.py)
    list                                      the registered experiments with titles and profiles

A user error (unknown experiment or preset, a setting out of range, a GPU-only request on a CPU machine)
prints one line starting with ``error:`` and exits with status 2; no run directory is left behind. A closed
stdout (``ssmspec list | head -1``) ends any command quietly with status 141 (ssmspec/pipes.py).
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from ssmspec import paths
from ssmspec.pipes import GuardedStdout, StdoutClosed, silence

EXIT_USER = 2
GROUPS = ("model", "strategy", "drafter", "verify", "data", "bench", "experiment")


class _State:
    """What the Hydra job and the command around it share (same process)."""

    def __init__(self, results_dir: Path | None = None) -> None:
        self.job_started = False
        self.results_dir = results_dir  # the user's results_dir, absolute (None: Hydra names the run dir)
        self.preexisting = results_dir is not None and results_dir.exists()  # never removed on failure
        self.created: list[Path] = []  # directories this invocation made (removed again on failure)
        self.sweep_dir: Path | None = None  # a sweep's directory, as it starts (hydra_callbacks.SweepStart)


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


def _prune_empty(path: Path, stop: Path) -> None:
    """Remove ``path`` and its parents while they are empty, up to (not including) ``stop``."""
    path, stop = path.absolute(), stop.absolute()
    while path != stop and stop in path.parents and path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        path = path.parent


def _job(cfg) -> None:
    """The Hydra task: run the experiment into the job's output directory."""
    from hydra.core.hydra_config import HydraConfig

    from ssmspec.runner import UserError, run_experiment

    _STATE.job_started = True
    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir).absolute()
    multirun = hc.mode.name == "MULTIRUN"
    if multirun or not _STATE.preexisting:
        _STATE.created.append(out)  # a sweep's job dir is always new
    sweep = Path(hc.sweep.dir).absolute()
    if multirun and not _STATE.preexisting and sweep not in _STATE.created:
        _STATE.created.insert(0, sweep)
    try:
        run_experiment(cfg, out, cli_overrides=list(hc.overrides.task))
    except UserError as e:
        _cleanup()
        raise SystemExit(_error(str(e)))
    except BaseException:
        _cleanup()
        raise


def _cleanup() -> None:
    """After a failed job: remove the empty directories Hydra made for it (and a sweep record with no
    completed run beside it), never a folder that existed before."""
    for d in reversed(_STATE.created):
        if not d.is_dir():
            continue
        if not [p for p in d.iterdir() if p.name != "multirun.yaml"]:
            (d / "multirun.yaml").unlink(missing_ok=True)
        stop = Path.cwd().absolute()
        _prune_empty(d, stop if stop in d.parents else d.parent)


def cmd_run(argv: list[str]) -> int:
    multirun = any(a in ("-m", "--multirun") for a in argv)
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
    except ValueError as e:
        return _error(str(e))

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
    _STATE.__init__(results_path)
    main = hydra.main(version_base="1.3", config_path=str(paths.CONF_DIR), config_name="config")(_job)
    saved = sys.argv
    sys.argv = ["ssmspec", *args]
    try:
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
    from ssmspec.registry import read_results

    df = read_results(run_dir)
    if df.empty:
        raise ValueError(f"{run_dir}/results.jsonl has no rows")
    out.parent.mkdir(parents=True, exist_ok=True)
    exp.plot_fn()(df, out)
    if not out.is_file():
        raise RuntimeError(f"plot function {exp.plot} wrote no file at {out}")
    return out


def cmd_plot(exp_id: str, *, profile: str | None = None, run_dir: str | None = None, out: str | None = None) -> int:
    from ssmspec.registry import figure_path, get_experiment, reference_dir, reference_profiles

    try:
        exp = get_experiment(exp_id)
        if run_dir:
            target = Path(out) if out else Path(run_dir) / f"{exp_id}.png"
            print(_draw(exp, Path(run_dir), target))
            return 0
        profiles = [profile] if profile else reference_profiles(exp_id)
        if not profiles:
            raise ValueError(f"no reference results for {exp_id!r} under {paths.RESULTS_DIR}/{exp_id}/; run "
                             f"`python -m ssmspec run experiment={exp_id} --save-reference`, or plot a run "
                             f"with --from runs/...")
        if out and len(profiles) > 1:
            raise ValueError("--out names one file: add --profile cpu|gpu")
        for p in profiles:
            print(_draw(exp, reference_dir(exp_id, p), Path(out) if out else figure_path(exp_id, p)))
    except ValueError as e:
        return _error(str(e))
    return 0


def cmd_figures() -> int:
    from ssmspec.registry import experiments, reference_profiles

    try:
        exps = experiments()
    except ValueError as e:
        return _error(str(e))
    status = 0
    for exp in exps:
        if not reference_profiles(exp.id):
            print(f"{exp.id}: no reference results yet (skipped)")
            continue
        status = max(status, cmd_plot(exp.id))
    return status


# reproduce / list ----------------------------------------------------------------------------------
def _reproduce_slots(profile: str, jobs: str | None) -> list[tuple[str, ...]]:
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
    slots = make_slots(resolve_devices(None)) or [()]
    if jobs != "auto" and int(jobs) > len(slots):
        raise ValueError(f"--jobs {jobs} but this machine shows {len(slots)} GPU(s); use --jobs auto or fewer")
    return slots if jobs == "auto" else slots[:int(jobs)]


def _run_reference_runs(exps, profile: str, slots: list[tuple[str, ...]]) -> list[str]:
    """``run experiment=<id> --save-reference`` for each experiment, as a queue over ``slots`` (one child
    process each, pinned to its GPU); returns the ids that failed. One slot: the children write to this
    terminal, one after the other; several: each to runs/reproduce/<time>/<id>.log."""
    import datetime
    import time

    from hydra_plugins.ssmspec_launcher.gpu_queue import Job, run_queue, summary, visible_devices

    env = {"SSMSPEC_CONF": str(paths.CONF_DIR), "SSMSPEC_RESULTS": str(paths.RESULTS_DIR)}
    logs = Path("runs", "reproduce", datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")).absolute()
    jobs = [Job(name=e.id, argv=(sys.executable, "-m", "ssmspec", "run", f"experiment={e.id}", f"profile={profile}",
                                 "--save-reference"), log=logs / f"{e.id}.log" if len(slots) > 1 else None, env=env)
            for e in exps]
    titles = {e.id: e.title for e in exps}
    where = lambda devices: f"GPU {visible_devices(devices)}" if devices else "this machine"  # noqa: E731

    def on_start(job, devices) -> None:
        print(f"\n=== {job.name}: {titles[job.name]}" + (f" (on {where(devices)}, log {job.log})" if job.log else ""),
              flush=True)

    def on_end(out) -> None:
        if out.job.log is not None:
            state = "ok" if out.ok else f"FAILED (exit {out.returncode}): {out.last_error()}"
            print(f"=== {out.job.name}: {state} in {out.wall_s:.1f} s on {where(out.devices)}", flush=True)

    t0 = time.perf_counter()
    outcomes = run_queue(jobs, slots, on_start=on_start, on_end=on_end)
    wall = time.perf_counter() - t0
    print("\n=== experiments (wall time per experiment and where it ran)")
    for out in outcomes:
        print(f"  {'ok' if out.ok else 'FAILED':<6} {out.wall_s:8.1f} s  {where(out.devices):<14} {out.job.name}")
    print(f"  {summary(outcomes, wall, len(slots))}", flush=True)
    return [out.job.name for out in outcomes if not out.ok]


def cmd_reproduce(profile: str | None, only: str | None, allow_missing_baselines: bool = False,
                  jobs: str | None = None) -> int:
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
        slots = _reproduce_slots(profile, jobs)
    except ValueError as e:
        return _error(str(e))
    from ssmspec.summary import preflight, reproduce_report

    missing = preflight(profile, allow_missing=allow_missing_baselines)  # before an hour of GPU runs, not after
    if missing:
        return _error(missing)
    print(f"reproduce: profile {profile}, {len(exps)} experiment(s): {', '.join(e.id for e in exps) or '-'}")
    failed = _run_reference_runs(exps, profile, slots)
    print("\n=== figures", flush=True)
    status = cmd_figures()
    summary, baseline_error = reproduce_report([e.id for e in exps], profile, failed,
                                               allow_missing=allow_missing_baselines)
    print("\n" + summary, flush=True)
    if failed:
        return _error(f"{len(failed)} experiment(s) failed: {', '.join(failed)} (their older results, if any, are kept)")
    return _error(baseline_error) if baseline_error else status


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


# entry -----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (141, quietly, when stdout is closed: ssmspec/pipes.py)."""
    saved = sys.stdout
    sys.stdout = guarded = GuardedStdout(saved)
    try:
        status = _main(argv)
        sys.stdout.flush()  # what is still buffered, while a closed pipe can still be caught here
        return status
    except (BrokenPipeError, StdoutClosed):
        return silence(saved)
    finally:
        if sys.stdout is guarded:
            sys.stdout = saved


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    p.add_argument("--out", help="PNG path (default: results/figures/<id>-<profile>.png, or next to --from)")
    sub.add_parser("figures", help="draw every figure that has reference results")
    r = sub.add_parser("reproduce", help="run every experiment of the profile, then draw every figure")
    r.add_argument("--profile", choices=["cpu", "gpu", "auto"])
    r.add_argument("--only", help="comma-separated experiment ids")
    r.add_argument("--jobs", default="auto", help="experiments at once: auto (one per GPU on the gpu profile, "
                   "one on cpu) or a number; each runs pinned to its GPU(s) (CUDA_VISIBLE_DEVICES)")
    r.add_argument("--allow-missing-baselines", action="store_true",
                   help="on the GPU, run and exit 0 even where mamba_ssm / fla do not import (rows say skipped)")
    sub.add_parser("list", help="registered experiments")
    args = parser.parse_args(argv)
    if args.cmd == "plot":
        return cmd_plot(args.id, profile=args.profile, run_dir=args.run_dir, out=args.out)
    if args.cmd == "figures":
        return cmd_figures()
    if args.cmd == "reproduce":
        return cmd_reproduce(args.profile, args.only, args.allow_missing_baselines, jobs=args.jobs)
    return cmd_list()
