"""The summary ``python -m ssmspec reproduce`` ends with, and its rule for missing baselines.

    python -m ssmspec.summary RUN_DIR [RUN_DIR ...] [--allow-missing-baselines]   the same for any run dirs

For each experiment of a reproduction (its runs in the fresh runs/reproduce/<time>/results/ of a default
``reproduce``, or in the committed results/ with ``--save-reference``): whether it ran, its row count, the
count per status (``ok``, ``skipped``, ``oom``, ``n/a`` as the benches write them), and every row that is
not ``ok`` grouped by status and reason, each group named by the fields that tell its rows apart
(``impl=mamba_ssm; model=...; batch=...``; constant fields, and fields the named ones determine such as
H, P, N of a model preset, are left out); then where the results and figures are.

A row skipped because a baseline does not import says so in its reason, in ``ssmspec.baselines``' words:
``"<name> not importable: <error>"`` (``bench.kernels.mamba_ssm_ops`` writes it). On the GPU profile that is
a failed reproduction -- the figure would show our kernel against nothing -- so ``reproduce`` stops before
running anything when a baseline does not import, and exits non-zero if a row was skipped for one anyway,
unless the user passed ``--allow-missing-baselines``. On the CPU profile the baselines are absent by design.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ssmspec import paths
from ssmspec.baselines import BASELINES

log = logging.getLogger("ssmspec.summary")

# fields of every row that say where and when it ran, not which point it measured
BOOKKEEPING = {"experiment", "run_id", "profile", "device", "device_name", "weights", "status", "reason"}
MAX_VALUES = 8  # values listed per field of a skipped group before "+N more"
FIX = ("install them with `python -m ssmspec.baselines install` (`make setup` does on a GPU machine; "
       "README \"GPU baselines\"), or accept the gap with --allow-missing-baselines "
       "(make reproduce ALLOW_MISSING_BASELINES=1)")


@dataclass(frozen=True)
class SkipGroup:
    status: str  # skipped | oom | n/a | ... (anything but ok)
    reason: str  # the rows' reason, or "(no reason recorded)"
    rows: int
    where: str  # "impl=mamba_ssm; model=a,b; batch=1,16"
    baseline: str | None  # the baseline whose absence skipped them, if that is the reason
    profile: str | None  # the rows' profile


@dataclass(frozen=True)
class ExperimentSummary:
    id: str
    outcome: str  # ok | failed (its older results, if any, are kept) | no results
    rows: int = 0
    statuses: tuple[tuple[str, int], ...] = ()  # (status, rows), ok first
    groups: tuple[SkipGroup, ...] = ()
    timed: int = 0  # rows that record their timed loop's wall clock (``wall_flag``, bench/timing.py wall_check)
    wall_flagged: int = 0  # ... whose wall clock is more than 2% off their summed step events
    wall_longer: int = 0  # ... of those, the ones whose wall clock is the longer (the device sat idle)
    designed: int = 0  # oracle rows with a designed acceptance band (``accepted_within``, bench/designed.py)
    off_design: int = 0  # ... whose measured mean accepted length is outside it


def missing_baseline(reason: str) -> str | None:
    """The baseline a skip reason names as not importable, else None."""
    return next((b.name for b in BASELINES if reason.startswith(f"{b.name} not importable")), None)


def _hashable(v) -> bool:
    return isinstance(v, (str, int, bool)) or v is None


def _distinguishing(rows: list[dict]) -> list[str]:
    """Fields (row order) whose values vary over the experiment and are not fixed by the fields before them
    (model -> H, P, N; (model, batch) -> rot): the fields that name a row."""
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields and k not in BOOKKEEPING and _hashable(row[k])]
    kept: list[str] = []
    for f in fields:
        values = [r.get(f) for r in rows]
        if any(not _hashable(v) for v in values) or len(set(values)) < 2:
            continue
        seen: dict[tuple, object] = {}
        derived = bool(kept) and all(seen.setdefault(tuple(r.get(k) for k in kept), r.get(f)) == r.get(f)
                                     for r in rows)
        if not derived:
            kept.append(f)
    return kept


def _values(rows: list[dict], field: str) -> str:
    vals = list(dict.fromkeys(r.get(field) for r in rows))
    more = f",+{len(vals) - MAX_VALUES} more" if len(vals) > MAX_VALUES else ""
    return ",".join(str(v) for v in vals[:MAX_VALUES]) + more


def summarize_rows(exp_id: str, rows: list[dict]) -> ExperimentSummary:
    counts = Counter(str(r.get("status", "ok")) for r in rows)
    statuses = sorted(counts.items(), key=lambda kv: (kv[0] != "ok", kv[0]))
    fields = _distinguishing(rows)
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        status = str(r.get("status", "ok"))
        if status != "ok":
            groups.setdefault((status, str(r.get("reason") or "(no reason recorded)")), []).append(r)
    out = []
    for (status, reason), members in groups.items():
        where = "; ".join(f"{f}={_values(members, f)}" for f in fields if any(f in r for r in members))
        out.append(SkipGroup(status, reason, len(members), where, missing_baseline(reason),
                             members[0].get("profile")))
    timed = [r for r in rows if r.get("wall_flag") is not None]
    designed = [r for r in rows if r.get("accepted_within") is not None]
    flagged = [r for r in timed if r["wall_flag"]]
    return ExperimentSummary(exp_id, "ok", len(rows), tuple(statuses), tuple(out), timed=len(timed),
                             wall_flagged=len(flagged), wall_longer=sum((r.get("wall_excess") or 0) > 0 for r in flagged),
                             designed=len(designed), off_design=sum(not r["accepted_within"] for r in designed))


def summarize_dir(exp_id: str, run_dir: Path) -> ExperimentSummary:
    from ssmspec.registry import read_rows

    try:
        rows = read_rows(run_dir)
    except ValueError:
        return ExperimentSummary(exp_id, "no results")
    return summarize_rows(exp_id, rows)


def missing_baselines(summaries: list[ExperimentSummary], profile: str | None = None) -> dict[str, list[str]]:
    """{baseline: ["<experiment> (<n> rows)", ...]} of rows skipped on the GPU profile for a missing baseline
    (rows without a profile field count as ``profile``)."""
    out: dict[str, list[str]] = {}
    for s in summaries:
        for g in s.groups:
            if g.baseline and (g.profile or profile) == "gpu":
                out.setdefault(g.baseline, []).append(f"{s.id} ({g.rows} rows)")
    return out


def baseline_error(summaries: list[ExperimentSummary], profile: str | None = None, *,
                   allow_missing: bool = False) -> str | None:
    """The message a GPU run ends with when rows were skipped for a missing baseline; None when there were
    none or the user allowed it (then it is logged as a warning)."""
    missing = missing_baselines(summaries, profile)
    if not missing:
        return None
    what = "; ".join(f"{b}: {', '.join(where)}" for b, where in missing.items())
    msg = f"rows were skipped on the GPU for missing baselines ({what})"
    if allow_missing:
        log.warning("warning: %s (allowed by --allow-missing-baselines)", msg)
        return None
    return f"{msg}; {FIX}"


def preflight(profile: str, *, allow_missing: bool = False) -> str | None:
    """Before a GPU reproduction runs anything: the error when a baseline does not import (None on the CPU
    profile, when all import, or when the user allowed it -- then logged as a warning)."""
    if profile != "gpu":
        return None
    from ssmspec.baselines import check

    missing = {name: why for name, why in check().items() if why}
    if not missing:
        return None
    what = "; ".join(missing.values())
    if allow_missing:
        log.warning("warning: %s; their rows will say skipped (allowed by --allow-missing-baselines)", what)
        return None
    return f"the GPU profile compares against baselines that do not import here ({what}); nothing was run; {FIX}"


def render(summaries: list[ExperimentSummary], title: str = "summary") -> str:
    width = max([len(s.id) for s in summaries] + [len("experiment")])
    lines = [f"=== {title}", f"{'experiment':<{width}}  {'result':<10}  {'rows':>5}  statuses"]
    for s in summaries:
        rows = str(s.rows) if s.outcome == "ok" else "-"
        result = {"failed": "FAILED", "no results": "no rows"}.get(s.outcome, "ok")
        statuses = ", ".join(f"{k} {n}" for k, n in s.statuses) or {
            "failed": "(its older results, if any, are kept)", "no results": "(no results.jsonl)"}.get(s.outcome, "-")
        lines.append(f"{s.id:<{width}}  {result:<10}  {rows:>5}  {statuses}")
        for g in s.groups:
            lines.append(f"{'':<{width}}    {g.status} {g.rows}: {g.where or '(all rows)'} -- {g.reason}")
        if s.wall_flagged:
            from ssmspec.bench.timing import WALL_TOLERANCE

            shorter = s.wall_flagged - s.wall_longer
            lines.append(f"{'':<{width}}    wall clock: {s.wall_flagged} of {s.timed} timed loops are more than "
                         f"{WALL_TOLERANCE:.0%} off their summed step events (wall_flag): {s.wall_longer} longer (the "
                         f"device sat idle between steps), {shorter} shorter (the step timers overlap)")
        if s.off_design:
            from ssmspec.bench.designed import ACCEPTED_TOLERANCE

            lines.append(f"{'':<{width}}    acceptance: {s.off_design} of {s.designed} oracle rows measured a mean "
                         f"accepted length more than {ACCEPTED_TOLERANCE:.0%} off the designed one (accepted_within)")
    return "\n".join(lines)


def reproduce_report(exp_ids: list[str], profile: str, failed: list[str], *, allow_missing: bool = False,
                     results_root: Path | None = None, figures_dir: Path | None = None,
                     save_reference: bool = True) -> tuple[str, str | None]:
    """(summary text, error message or None) of a reproduction: the runs of each experiment that it wrote
    under ``results_root`` (default: the committed results/; a failed one is listed as such, older results
    not read), and where they and the figures are."""
    from ssmspec.registry import reference_dir

    from ssmspec.baselines import available_version

    summaries = [ExperimentSummary(e, "failed") if e in failed
                 else summarize_dir(e, reference_dir(e, profile, root=results_root)) for e in exp_ids]
    text = render(summaries, f"summary (profile {profile})")
    root = paths.shown(reference_dir("<id>", profile, root=results_root))
    figures = paths.shown(Path(figures_dir or Path(results_root or paths.RESULTS_DIR) / "figures"))
    text += f"\nresults: {root}/, figures: {figures}/"
    if not save_reference:
        text += (" (the committed references in results/ are unchanged; --save-reference, "
                 "make reproduce SAVE_REFERENCE=1, replaces them)")
    if profile == "gpu":  # what the kernel rows were compared against
        text += "\nbaselines: " + ", ".join(f"{b.name} {available_version(b) or 'not installed'}" for b in BASELINES)
    return text, baseline_error(summaries, profile, allow_missing=allow_missing)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m ssmspec.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="directories holding results.jsonl")
    parser.add_argument("--allow-missing-baselines", action="store_true",
                        help="exit 0 even if GPU rows were skipped for a missing baseline")
    args = parser.parse_args(argv)
    from ssmspec.registry import read_rows

    summaries = []
    for d in args.run_dirs:
        try:
            rows = read_rows(d)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        summaries.append(summarize_rows(str(rows[0].get("experiment", d.name)) if rows else d.name, rows))
    print(render(summaries))
    err = baseline_error(summaries, allow_missing=args.allow_missing_baselines)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
