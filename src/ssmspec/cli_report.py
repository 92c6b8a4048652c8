"""The commands that run no experiment (``cli.py`` dispatches them): ``plot`` and ``figures`` draw figures from
results only, ``list`` shows the registered experiments, ``clean`` removes what killed runs left."""
from __future__ import annotations

import os
from pathlib import Path

from ssmspec import interrupt, paths, rundir
from ssmspec.cli_checks import _error


def trained_figure(out: Path) -> Path:
    """Where the figure of an experiment's trained-pair rows goes, beside ``out``: ``<stem>-trained.png``."""
    return out.with_name(f"{out.stem}-trained{out.suffix}")


def _draw_one(exp, df, out: Path) -> Path:
    """Draw ``df`` with ``exp``'s plot function into ``out``, through a hidden file renamed into place (an
    interrupted drawing leaves the older figure, not half a PNG)."""
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


def _draw(exp, run_dir: Path, out: Path) -> list[Path]:
    """Draw ``exp``'s figure from ``run_dir``'s rows into ``out``. Rows measured on the trained pairs
    (``pair: trained``, ``bench/trained_rows.py``) of an experiment that also has oracle rows go into a figure of
    their own (``trained_figure(out)``): measured and designed acceptance are never drawn together."""
    from ssmspec.registry import read_results

    df = read_results(run_dir)
    if df.empty:
        raise ValueError(f"{run_dir}/results.jsonl has no rows")
    if "pair" not in df.columns or not (df["pair"] == "trained").any() or (df["pair"] == "trained").all():
        return [_draw_one(exp, df, out)]
    trained = df["pair"] == "trained"
    return [_draw_one(exp, df[~trained].reset_index(drop=True), out),
            _draw_one(exp, df[trained].reset_index(drop=True), trained_figure(out))]


def cmd_plot(exp_id: str, *, profile: str | None = None, run_dir: str | None = None, out: str | None = None,
             results_root: Path | None = None, figures_dir: Path | None = None) -> int:
    """Draw ``exp_id``'s figure: from one run directory (``run_dir``), else from the reference results of each
    profile under ``results_root`` (default results/) into ``figures_dir`` (default results/figures/)."""
    from ssmspec.registry import figure_path, get_experiment, reference_dir, reference_profiles

    try:
        exp = get_experiment(exp_id)
        if run_dir:
            target = Path(out) if out else Path(run_dir) / f"{exp_id}.png"
            print(*_draw(exp, Path(run_dir), target), sep="\n")
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
            for drawn in _draw(exp, reference_dir(exp_id, p, root=results_root), target):
                print(paths.shown(drawn))
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
