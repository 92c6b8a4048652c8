"""The experiment registry and the results layout.

An experiment is ``conf/experiment/<id>.yaml`` (experiments/README.md has the contract); this module
reads their ``experiment:`` blocks without composing Hydra configs, so listing and plotting stay fast.

Results layout (README "Results"):
    results/<id>/<profile>/{config.yaml, env.json, results.jsonl}   committed reference run per profile
    results/figures/<id>-<profile>.png                               its figure, drawn from those rows only
    runs/<id>/<time>/<overrides>/                                     a user's runs (git-ignored)
    runs/reproduce/<time>/{results/<id>/<profile>/, figures/}         a `reproduce` run, laid out as results/

What decides a result (``experiment.decided_by``, experiments/README.md): the files whose change can move the
experiment's numbers, as paths or globs relative to the repository root. An entry matches a file when it names
the file or a folder above it (``src/ssmspec/ops/replay/`` covers naive.py and triton.py); ``*`` and ``?``
stay inside one path component, ``**`` crosses folders; an entry starting with ``!`` removes what it matches.
Every entry must match a file of the checkout. A file without the key gets ``DEFAULT_DECIDED_BY``: every file
under src/ssmspec except plots/, cli.py and summary.py, plus conf/ (conservative: any change there marks its
results stale). ``python -m ssmspec.provenance stale`` compares them with each reference result's commit.
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ssmspec import paths

REQUIRED = ("id", "title", "bench", "plot", "profiles")
# what an experiment may list under `reads:` (the settings its bench function reads besides `bench`)
READABLE = ("model", "strategy", "drafter", "verify", "data", "sampling", "seed", "checkpoint")
# decided_by of a file that declares none: everything that runs or configures a run; what only reports is out
DEFAULT_DECIDED_BY = ("src/ssmspec/", "conf/", "!src/ssmspec/plots/", "!src/ssmspec/cli.py", "!src/ssmspec/cli_checks.py",
                      "!src/ssmspec/cli_report.py", "!src/ssmspec/summary.py")


@dataclass(frozen=True)
class Experiment:
    id: str  # file stem of conf/experiment/<id>.yaml (names from shared/FIGURES.md)
    title: str  # one line for README and plots
    bench: str  # "module:function" yielding result rows
    plot: str  # "module:function" drawing one PNG from rows
    profiles: tuple[str, ...]  # profiles in which `make reproduce` runs it
    needs_gpu: bool = False  # refuse to run without CUDA
    # needs_gpu: triton in the file: CUDA, or Triton's CPU interpreter (TRITON_INTERPRET=1, small grids in tests)
    interpreter_ok: bool = False
    # settings outside `bench` the bench function reads (READABLE roots or dotted keys such as data.seed);
    # an override of anything else is refused. None (no `reads:` in the file): every override passes.
    reads: tuple[str, ...] | None = None
    # files whose change can move the numbers (module doc): paths or globs relative to the repository root
    decided_by: tuple[str, ...] = DEFAULT_DECIDED_BY
    # the keys `bench.*` may hold: the shared conf/bench/default.yaml, the experiment's `bench:` block, its
    # profile_overrides and `bench_keys:` (optional keys the file leaves unset), as a nested mapping
    # {key: declared value}; a value's type is what an override must have (None: any)
    bench_schema: dict = field(default_factory=dict, compare=False)
    path: Path = field(default=Path(), compare=False)
    # what the models' weights are when no checkpoint= is given (env.json, rows, logs): "random" (seeded random
    # weights of the presets) or what the bench builds itself, e.g. "trained" (python -m ssmspec train)
    weights: str = "random"
    # GPUs the gpu profile runs on at once (``reproduce`` gives it that many slots of its queue, or every GPU of a
    # machine with fewer): saguaro_e2e's draft on a GPU of its own needs 2
    gpus: int = 1

    @property
    def gpu_label(self) -> str:
        """The ``gpu?`` column of ``ssmspec list``: yes, no, or yes* (or the Triton interpreter)."""
        return "no" if not self.needs_gpu else "yes*" if self.interpreter_ok else "yes"

    def gpu_refusal(self, *, cuda: bool, interpreting: bool) -> str | None:
        """Why this machine cannot run the experiment (with the fix), or None."""
        if not self.needs_gpu or cuda or (self.interpreter_ok and interpreting):
            return None
        alt = ", or set TRITON_INTERPRET=1 to run its kernels in Triton's CPU interpreter (slow; small grids)" \
            if self.interpreter_ok else ""
        return (f"experiment {self.id!r} needs a CUDA GPU and this machine has none; run it on a GPU machine "
                f"(`make reproduce` skips it on the cpu profile){alt}")

    def bench_fn(self) -> Callable:
        return load_callable(self.bench, what=f"experiment {self.id!r} bench")

    def plot_fn(self) -> Callable:
        return load_callable(self.plot, what=f"experiment {self.id!r} plot")


def load_callable(spec: str, *, what: str = "callable") -> Callable:
    """``"package.module:function"`` -> the function; a clear ValueError when it does not exist."""
    mod_name, sep, fn_name = str(spec).partition(":")
    if not sep or not mod_name or not fn_name:
        raise ValueError(f"{what}: {spec!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"{what}: cannot import module {mod_name!r} ({e})") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{what}: module {mod_name!r} has no function {fn_name!r}")
    return fn


def read_experiment(path: Path, *, root: Path | None = None) -> Experiment:
    """The experiment of the file ``path``; its decided_by entries are checked against the checkout at
    ``root`` (default: this repository)."""
    return _read(Path(path), root)


def _read(path: Path, root: Path | None = None) -> Experiment:
    data = yaml.safe_load(path.read_text()) or {}
    block = data.get("experiment")
    if not isinstance(block, dict):
        raise ValueError(f"{path}: an experiment file needs an `experiment:` block with {', '.join(REQUIRED)}")
    missing = [k for k in REQUIRED if k not in block]
    if missing:
        raise ValueError(f"{path}: experiment block lacks {missing}")
    if block["id"] != path.stem:
        raise ValueError(f"{path}: experiment.id {block['id']!r} must equal the file name {path.stem!r}")
    profiles = tuple(block["profiles"] or ())
    bad = [p for p in profiles if p not in ("cpu", "gpu")]
    if bad:
        raise ValueError(f"{path}: profiles may be cpu and gpu, got {bad}")
    reads = block.get("reads")
    if reads is not None:
        bad = [r for r in reads if str(r).split(".")[0] not in READABLE]
        if not isinstance(reads, list) or bad:
            raise ValueError(f"{path}: experiment.reads lists settings the bench reads, from {', '.join(READABLE)} "
                             f"(or dotted keys such as data.seed); got {bad or reads!r}")
        reads = tuple(str(r) for r in reads)
    gpu = block.get("needs_gpu", False)
    if gpu not in (True, False, "triton"):
        raise ValueError(f"{path}: experiment.needs_gpu is true, false or triton (CUDA or TRITON_INTERPRET=1), "
                         f"got {gpu!r}")
    weights = block.get("weights", "random")
    if weights not in ("random", "trained"):
        raise ValueError(f"{path}: experiment.weights is random (seeded presets) or trained (the bench trains its "
                         f"models: python -m ssmspec train), got {weights!r}")
    gpus = block.get("gpus", 1)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"{path}: experiment.gpus is the number of GPUs the gpu profile runs on at once (>= 1), "
                         f"got {gpus!r}")
    return Experiment(id=block["id"], title=str(block["title"]), bench=block["bench"], plot=block["plot"],
                      profiles=profiles, needs_gpu=bool(gpu), interpreter_ok=gpu == "triton", reads=reads,
                      decided_by=_decided_by(path, block, root), bench_schema=_bench_schema(path, data, block), path=path,
                      weights=weights, gpus=gpus)


# decided_by ----------------------------------------------------------------------------------------
_GLOB = re.compile(r"[*?]")
_SKIP_PARTS = {".git", "__pycache__", ".pytest_cache"}


def _decided_by(path: Path, block: dict, root: Path | None) -> tuple[str, ...]:
    entries = block.get("decided_by")
    if entries is None:
        return DEFAULT_DECIDED_BY
    if not isinstance(entries, list) or not entries or not all(isinstance(e, str) and e.strip() for e in entries):
        raise ValueError(f"{path}: experiment.decided_by lists the files whose change can move the numbers, as "
                         f"paths or globs relative to the repository root (experiments/README.md); got {entries!r}")
    for entry in entries:
        bare = entry.removeprefix("!")
        if bare.startswith("/") or ".." in bare.split("/"):
            raise ValueError(f"{path}: experiment.decided_by entry {entry!r} must be relative to the repository root "
                             f"(no leading / and no ..)")
        if not any(True for _ in _files_matching(bare, root)):
            raise ValueError(f"{path}: experiment.decided_by entry {entry!r} matches no file under {root or paths.ROOT}; "
                             f"fix the path (relative to the repository root; a folder ends with /) or remove the entry")
    return tuple(entries)


@functools.lru_cache(maxsize=4096)
def _entry_regex(entry: str) -> re.Pattern:
    """A decided_by entry (no leading !) as a regex over repository paths: the entry or a file below it."""
    out, i, body = [], 0, entry.rstrip("/")
    while i < len(body):
        if body.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif body.startswith("**", i):
            out.append(".*")
            i += 2
        elif body[i] == "*":
            out.append("[^/]*")
            i += 1
        elif body[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(body[i]))
            i += 1
    return re.compile("".join(out) + "(?:/.*)?")


def _files_matching(entry: str, root: Path | None = None):
    """Files of the checkout under ``root`` (caches and git's own files left out) that ``entry`` matches; only
    the folder before the entry's first wildcard is walked."""
    root = Path(root or paths.ROOT)
    parts = entry.rstrip("/").split("/")
    fixed = []
    for part in parts:
        if _GLOB.search(part):
            break
        fixed.append(part)
    base = root.joinpath(*fixed) if fixed else root
    rx = _entry_regex(entry)
    for p in [base] if base.is_file() else _walk(base) if base.is_dir() else []:
        rel = p.relative_to(root).as_posix()
        if not rel.endswith((".pyc", ".pyo")) and rx.fullmatch(rel):
            yield rel


def _walk(base: Path):
    for folder, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d not in _SKIP_PARTS]
        for name in files:
            yield Path(folder) / name


def decides(entries: tuple[str, ...] | list[str], rel_path: str) -> bool:
    """Whether the file ``rel_path`` (relative to the repository root) is one that ``entries`` name: matched
    by an entry and by no ``!`` entry."""
    hit = False
    for entry in entries:
        if entry.startswith("!"):
            if _entry_regex(entry[1:]).fullmatch(rel_path):
                return False
        elif not hit and _entry_regex(entry).fullmatch(rel_path):
            hit = True
    return hit


def _merge_schema(into: dict, extra: dict) -> None:
    """Add the keys of ``extra`` to ``into``. A null declaration takes the type of another one; a key
    declared with two different types is left untyped (None)."""
    for key, value in extra.items():
        if key not in into or into[key] is None:
            into[key] = value
        elif isinstance(into[key], dict) and isinstance(value, dict):
            _merge_schema(into[key], value)
        elif value is not None and _kind(into[key]) != _kind(value):
            into[key] = None


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def _bench_schema(path: Path, data: dict, block: dict) -> dict:
    schema = yaml.safe_load((paths.CONF_DIR / "bench" / "default.yaml").read_text()) or {}
    _merge_schema(schema, data.get("bench") or {})
    for profile, extra in (data.get("profile_overrides") or {}).items():
        if not isinstance(extra, dict):
            raise ValueError(f"{path}: profile_overrides.{profile} must be a mapping of bench keys")
        _merge_schema(schema, extra)
    keys = block.get("bench_keys") or []
    if not isinstance(keys, list):
        raise ValueError(f"{path}: experiment.bench_keys lists optional bench keys, got {keys!r}")
    _merge_schema(schema, {str(k): None for k in keys if str(k) not in schema})
    return schema


def experiment_ids() -> list[str]:
    return sorted(p.stem for p in (paths.CONF_DIR / "experiment").glob("*.yaml"))


def get_experiment(exp_id: str) -> Experiment:
    path = paths.CONF_DIR / "experiment" / f"{exp_id}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown experiment {exp_id!r}; choose one of: {', '.join(experiment_ids()) or '(none)'} "
                         f"(`python -m ssmspec list` shows them with titles)")
    return _read(path)


def experiments() -> list[Experiment]:
    return [get_experiment(i) for i in experiment_ids()]


# results layout -----------------------------------------------------------------------------------
def reference_dir(exp_id: str, profile: str, *, root: Path | None = None) -> Path:
    """Where the reference run of ``exp_id`` on ``profile`` is: ``<root>/<id>/<profile>/`` (root: results/,
    or another tree laid out the same way, such as a ``reproduce`` run's runs/reproduce/<time>/results/)."""
    return Path(root or paths.RESULTS_DIR) / exp_id / profile


def figure_path(exp_id: str, profile: str, *, figures: Path | None = None) -> Path:
    """``<figures>/<id>-<profile>.png`` (figures: results/figures/)."""
    return Path(figures or paths.RESULTS_DIR / "figures") / f"{exp_id}-{profile}.png"


def reference_profiles(exp_id: str, *, root: Path | None = None) -> list[str]:
    """Profiles with reference results of ``exp_id`` under ``root`` (default: the committed results/)."""
    return [p for p in ("cpu", "gpu") if (reference_dir(exp_id, p, root=root) / "results.jsonl").is_file()]


def read_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "results.jsonl"
    if not path.is_file():
        raise ValueError(f"no results.jsonl in {run_dir}; run the experiment first (python -m ssmspec run ...)")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def read_results(run_dir: Path):
    """results.jsonl of a run directory as a pandas DataFrame (one row per measurement)."""
    import pandas as pd

    return pd.DataFrame(read_rows(run_dir))
