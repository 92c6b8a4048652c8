"""What code a result was measured on: a hash of the source tree that ran, and the commit it equals.

A result records ``git_sha``, but a sha alone says what the checkout's HEAD was, not what ran: a copy of the
tree on another machine (the GPU machines get one without usable git history), uncommitted edits, or a hint
(``SSMSPEC_GIT_SHA``) typed wrongly all break that link. So every env.json also records the hash of the
files that decide a result, computed where the run happens:

    source_hash = sha256 over "<git blob sha1> <path>\\n" of every file under SOURCE_PATHS, sorted by path

Per file the git blob id (sha1 of ``blob <size>\\0<content>``) is used, so the same hash follows from a commit's
tree listing (``git ls-tree -r``) without reading a single blob: ``commit_hash(sha)``. The record says which
commit has exactly that tree (``source_commit``; None when none could be checked where it ran), and whether
the hint was checked (``source_check``):

- ``git``: the commit (the hint, or HEAD) was in the run's git objects and its tree equals the one that ran;
- ``mismatch``: it was there and differs (uncommitted edits, or a wrong hint): ``source_commit`` is None;
- ``unchecked``: no git objects for it where it ran (a device copy); ``python -m ssmspec.provenance check``
  verifies the record later in a clone that has the commit.

``check_record(env)`` is that later check; ``tests/pipeline/test_provenance.py`` runs it over every committed
reference result, so a record edited by hand (or a wrong hint) fails CI. A wrong record is fixed by rerunning.

Whether a reference result still describes this checkout (the README quotes no number measured on code that
has changed since in the files that decide it): ``stale(exp_id, profile)`` lists the files of the experiment's
``decided_by`` (registry.py; conf/experiment/<id>.yaml) that differ between the result's commit
(``source_commit``, else ``git_sha``) and the working tree -- ``git diff --name-only <commit>`` plus untracked
files, matched against the entries. A file counts as changed when what of it can move a number changed: a .py
file's syntax tree without docstrings, a .yaml file's data without experiment.title / plot / decided_by
(comments, formatting and declarations move nothing). ``stale_report()`` does that for every reference result
(the data of the table below; the README check reads it).

    python -m ssmspec.provenance hash              # the hash of this checkout's source tree
    python -m ssmspec.provenance check [ENV.json ...]   # every results/*/*/env.json by default
    python -m ssmspec.provenance stale [--profile gpu] [--check] [ID ...]   # which reference results are stale
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from ssmspec import paths, registry
from ssmspec.paths import RESULTS_DIR, ROOT

# what decides a result: the package, its configs and the project file that pins the dependencies
SOURCE_PATHS = ("src", "conf", "pyproject.toml")
_SKIP_PARTS = {"__pycache__", ".pytest_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def _git(args: list[str], cwd: Path = ROOT) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def blob_id(data: bytes) -> str:
    """Git's object id of a file with this content (sha1 of the header and the bytes)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _digest(entries: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for path, blob in sorted(entries):
        h.update(f"{blob} {path}\n".encode())
    return "sha256:" + h.hexdigest()


def _kept(rel: str) -> bool:
    parts = rel.split("/")
    return not (_SKIP_PARTS & set(parts) or rel.endswith(_SKIP_SUFFIXES) or any(p.endswith(".egg-info")
                                                                                  for p in parts))


def tree_entries(root: Path = ROOT) -> list[tuple[str, str]]:
    """(path, blob id) of every source file under ``root`` (build outputs and caches left out)."""
    out = []
    for top in SOURCE_PATHS:
        base = root / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
        for p in files:
            rel = p.relative_to(root).as_posix()
            if _kept(rel) and not p.is_symlink():
                out.append((rel, blob_id(p.read_bytes())))
    return out


def tree_hash(root: Path = ROOT) -> str:
    """The source hash of the files as they are under ``root``."""
    return _digest(tree_entries(root))


def resolve_commit(rev: str, root: Path = ROOT) -> str | None:
    """The full sha of ``rev`` if that commit is HEAD or in HEAD's history, else None. A commit that only this
    checkout's object store holds (a branch rebased away, whose objects a local ``git clone`` hard-links along)
    does not count: a clone from anywhere else lacks it."""
    out = _git(["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], root)
    sha = out.strip() if out and out.strip() else None
    if sha is None or _git(["merge-base", "--is-ancestor", sha, "HEAD"], root) is None:
        return None
    return sha


def commit_hash(rev: str, root: Path = ROOT) -> str | None:
    """The source hash of commit ``rev`` (from its tree listing), or None without that commit here."""
    sha = resolve_commit(rev, root)
    if sha is None:
        return None
    out = _git(["ls-tree", "-r", "--full-tree", sha, "--", *SOURCE_PATHS], root)
    if out is None:
        return None
    entries = []
    for line in out.splitlines():
        meta, _, path = line.partition("\t")
        mode, kind, blob = meta.split()
        if kind == "blob" and mode != "120000" and _kept(path):
            entries.append((path, blob))
    return _digest(entries)


def record(root: Path = ROOT) -> dict:
    """The provenance fields of env.json for a run from the tree under ``root`` (module doc)."""
    source = tree_hash(root)
    hint = os.environ.get("SSMSPEC_GIT_SHA") or None
    head = None
    if hint is None:
        out = _git(["rev-parse", "HEAD"], root)
        head = out.strip() if out else None
    claimed = hint or head
    check, commit = "unchecked", None
    full = resolve_commit(claimed, root) if claimed is not None else None
    if full is not None:
        check, commit = ("git", full) if commit_hash(full, root) == source else ("mismatch", None)
    return {"git_sha": claimed or "unknown", "git_sha_from": "SSMSPEC_GIT_SHA" if hint else "git" if head else None,
            "source_hash": source, "source_paths": list(SOURCE_PATHS), "source_commit": commit, "source_check": check}


def find_commit(source: str, root: Path = ROOT, *, limit: int = 500) -> str | None:
    """The commit, among the last ``limit`` of HEAD (first parents), that introduced the source tree hashed
    ``source`` (the oldest of the newest run of commits with that tree: commits of results or docs after it
    keep the tree), or None."""
    out = _git(["rev-list", "--first-parent", "-n", str(limit), "HEAD"], root)
    found = None
    for sha in (out or "").split():
        if commit_hash(sha, root) == source:
            found = sha
        elif found is not None:
            break
    return found


def ran_commit(env: dict, root: Path = ROOT) -> tuple[str | None, str | None]:
    """(the commit whose source tree ran, a note) for an env.json dict with a ``source_hash``: the commit the
    record names when its tree is the one that ran; else the commit of this clone with that exact tree (a
    wrong ``SSMSPEC_GIT_SHA`` hint: the note says so); (None, why) when no commit has it."""
    source = env["source_hash"]
    sha = env.get("source_commit") or env.get("git_sha")
    named = resolve_commit(sha, root) if sha and sha != "unknown" else None
    if named is not None and commit_hash(named, root) == source:
        return named, None
    found = find_commit(source, root)
    if found is not None:
        return found, f"ran commit {found[:10]}, whose tree has this source hash (the record names {str(sha)[:10]})"
    if named is None and sha and sha != "unknown":
        return None, f"commit {sha[:10]} is not in this clone (a shallow clone?) and no recent commit has this tree"
    return None, (f"the source that ran ({source[:19]}...) is no recent commit's (the record names "
                  f"{str(sha)[:10]}): the run had uncommitted changes; rerun it from a commit")


def check_record(env: dict, root: Path = ROOT) -> str | None:
    """Why ``env`` (an env.json dict) does not describe a commit of this checkout, or None where it does.

    The commit is the one the record names when its tree matches, else any recent commit with exactly the tree
    that ran (``ran_commit``: the hash is computed where the run happened; the sha is only a hint). A record
    without ``source_hash`` predates this check and passes (None); so does one whose commit is missing from a
    shallow clone."""
    if not env.get("source_hash"):
        return None
    sha = env.get("source_commit") or env.get("git_sha")
    if not sha or sha == "unknown":
        return "the run recorded no commit; rerun it from a commit (set SSMSPEC_GIT_SHA on a copy without git)"
    commit, why = ran_commit(env, root)
    if commit is None and resolve_commit(sha, root) is None and _git(
            ["rev-parse", "--is-shallow-repository"], root) == "true\n":
        return None
    return None if commit is not None else why


# stale reference results ----------------------------------------------------------------------------
CURRENT, STALE, UNKNOWN = "current", "stale", "unknown commit"


@dataclass(frozen=True)
class Staleness:
    """One reference result against this checkout."""
    id: str  # experiment id
    profile: str  # cpu | gpu
    commit: str | None  # the commit the result names (source_commit, else git_sha); None: it names none
    device_name: str  # from env.json
    status: str  # CURRENT | STALE | UNKNOWN (the commit is not in this clone: a shallow clone, a wrong sha)
    files: tuple[str, ...] = ()  # STALE: the deciding files that differ from the commit

    @property
    def label(self) -> str:
        """The status column: current | stale: N files: a, b, ... | unknown commit."""
        if self.status != STALE:
            return self.status
        shown = ", ".join(self.files[:6]) + (", ..." if len(self.files) > 6 else "")
        return f"stale: {len(self.files)} file{'s' if len(self.files) != 1 else ''}: {shown}"


def changed_files(commit: str, root: Path = ROOT) -> list[str] | None:
    """Files that differ between ``commit`` and the working tree under ``root`` (tracked files changed,
    added or deleted since, and untracked files git does not ignore), relative to ``root``; None when this
    clone lacks the commit."""
    sha = resolve_commit(commit, root)
    if sha is None:
        return None
    diff = _git(["diff", "--name-only", "--no-renames", "--relative", "-z", sha, "--"], root)
    untracked = _git(["ls-files", "--others", "--exclude-standard", "-z"], root)
    if diff is None or untracked is None:
        return None
    return sorted({n for n in (diff + untracked).split("\0") if n and _kept(n)})


# experiment keys that describe or declare and never move a number (the yaml comparison leaves them out)
_DESCRIPTIVE_KEYS = ("title", "plot", "decided_by")


def _normal_form(path: str, text: str | None):
    """What of a file can move a number: a .py file's syntax tree without docstrings, a .yaml file's data
    without the descriptive experiment keys, else the text. Comments and formatting drop out."""
    if text is None:
        return None
    try:
        if path.endswith(".py"):
            tree = ast.parse(text)
            for node in ast.walk(tree):
                body = getattr(node, "body", None)
                if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                        and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
                    node.body = body[1:]
            return ast.dump(tree)
        if path.endswith((".yaml", ".yml")):
            data = yaml.safe_load(text)
            if isinstance(data, dict) and isinstance(data.get("experiment"), dict):
                data["experiment"] = {k: v for k, v in data["experiment"].items() if k not in _DESCRIPTIVE_KEYS}
            return json.dumps(data, sort_keys=True, default=str)
    except (SyntaxError, ValueError, yaml.YAMLError):
        pass
    return text


def moved(commit: str, path: str, root: Path = ROOT) -> bool:
    """Whether ``path`` (relative to ``root``) differs between ``commit`` and the working tree in more than
    comments, formatting, docstrings or the descriptive experiment keys (``_normal_form``)."""
    try:  # bytes: a binary file must not break the decoding
        shown = subprocess.run(["git", "show", f"{commit}:./{path}"], cwd=root, capture_output=True, timeout=30)
        old = shown.stdout.decode(errors="replace") if shown.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        old = None
    new_file = Path(root) / path
    new = new_file.read_text(errors="replace") if new_file.is_file() else None
    return _normal_form(path, old) != _normal_form(path, new)


def _result_commit(env: dict) -> str | None:
    sha = env.get("source_commit") or env.get("git_sha")
    return None if not sha or sha == "unknown" else str(sha)


def _staleness(exp: registry.Experiment, profile: str, env: dict, root: Path, cache: dict) -> Staleness:
    """``cache`` holds what git answered, per commit and per (commit, file), across the results of one report."""
    commit = _result_commit(env)
    device = str(env.get("device_name") or "?")
    if commit is not None and commit not in cache:
        cache[commit] = changed_files(commit, root)
    changed = cache.get(commit) if commit is not None else None
    if changed is None:
        return Staleness(exp.id, profile, commit, device, UNKNOWN)
    for f in changed:
        if (commit, f) not in cache and registry.decides(exp.decided_by, f):
            cache[commit, f] = moved(commit, f, root)
    files = tuple(f for f in changed if cache.get((commit, f)) and registry.decides(exp.decided_by, f))
    return Staleness(exp.id, profile, commit, device, STALE if files else CURRENT, files)


def _layout(root: Path | None) -> tuple[Path, Path, Path]:
    """(repository root, conf/experiment, results) of the checkout at ``root`` (None: this one, as configured)."""
    if root is None:
        return paths.ROOT, paths.CONF_DIR / "experiment", paths.RESULTS_DIR
    root = Path(root)
    return root, root / "conf" / "experiment", root / "results"


def stale(exp_id: str, profile: str, *, root: Path | None = None) -> Staleness:
    """Whether the reference result results/<exp_id>/<profile>/ still describes the checkout at ``root``
    (default: this one): the files of the experiment's decided_by that changed since the result's commit."""
    return _report([exp_id], [profile], root, missing_ok=False)[0]


def stale_report(ids: list[str] | None = None, profiles: list[str] | None = None, *,
                 root: Path | None = None) -> list[Staleness]:
    """``stale`` of every reference result (of ``ids`` and ``profiles``; None: all), sorted by id and profile."""
    return _report(ids, profiles, root, missing_ok=True)


def _report(ids, profiles, root, *, missing_ok: bool) -> list[Staleness]:
    root, exp_dir, results = _layout(root)
    profiles = list(profiles or ("cpu", "gpu"))
    ids = list(ids) if ids else sorted(p.stem for p in exp_dir.glob("*.yaml"))
    out, cache = [], {}
    for exp_id in ids:
        path = exp_dir / f"{exp_id}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown experiment {exp_id!r} (no {path}); `python -m ssmspec list` shows the ids")
        exp = registry.read_experiment(path, root=root)
        for profile in profiles:
            env_path = results / exp_id / profile / "env.json"
            if not env_path.is_file():
                if missing_ok:
                    continue
                raise ValueError(f"no reference result of {exp_id!r} for profile {profile!r} ({env_path} is missing)")
            out.append(_staleness(exp, profile, json.loads(env_path.read_text()), root, cache))
    return out


def format_report(rows: list[Staleness]) -> str:
    """The table of ``python -m ssmspec.provenance stale``."""
    table = [("id", "profile", "commit", "device_name", "status")]
    table += [(r.id, r.profile, (r.commit or "none")[:10], r.device_name, r.label) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row[:4], widths)), row[4]]) for row in table)


def format_markdown(rows: list[Staleness]) -> str:
    """The same as a Markdown table (the README's "Reference results" holds it; a test regenerates it)."""
    out = ["| experiment | profile | device | measured at | at this code |", "|---|---|---|---|---|"]
    for r in rows:
        state = "current" if r.status == CURRENT else r.status if r.status != STALE else \
            f"stale ({len(r.files)} deciding file{'s' if len(r.files) != 1 else ''} changed)"
        out.append(f"| {r.id} | {r.profile} | {r.device_name} | {(r.commit or 'none')[:7]} | {state} |")
    return "\n".join(out)


def rerun_commands(rows: list[Staleness]) -> list[str]:
    """One ``reproduce`` command per profile that reruns its stale references into results/ (then
    ``python -m ssmspec figures``); none where nothing is stale."""
    out = []
    for profile in sorted({r.profile for r in rows}):
        ids = [r.id for r in rows if r.profile == profile and r.status == STALE]
        if ids:
            out.append(f"rerun ({profile}): python -m ssmspec reproduce --profile {profile} --only {','.join(ids)} "
                       f"--save-reference")
    return out


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ssmspec.provenance", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("hash", help="the source hash of this checkout")
    c = sub.add_parser("check", help="check env.json records against this clone's commits")
    c.add_argument("env", nargs="*", help="env.json files (default: every results/*/*/env.json)")
    st = sub.add_parser("stale", help="which reference results were measured on code that has changed since in "
                                      "the files that decide them (experiment.decided_by)")
    st.add_argument("ids", nargs="*", metavar="ID", help="experiment ids (default: all)")
    st.add_argument("--profile", choices=("cpu", "gpu"), help="one profile (default: both)")
    st.add_argument("--markdown", action="store_true", help="a Markdown table (as README.md holds it)")
    st.add_argument("--check", action="store_true",
                    help="exit 1 when any result is stale (an unknown commit, as in a shallow clone, does not fail)")
    args = ap.parse_args(argv)
    if args.cmd == "hash":
        print(tree_hash())
        return 0
    if args.cmd == "stale":
        try:
            rows = stale_report(args.ids or None, [args.profile] if args.profile else None)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        n_stale = sum(r.status == STALE for r in rows)
        if args.markdown:
            print(format_markdown(rows))
        else:
            print(format_report(rows))
            print(f"\n{n_stale} of {len(rows)} reference results stale")
            if n_unknown := sum(r.status == UNKNOWN for r in rows):
                print(f"{n_unknown} name a commit outside this clone's history (a shallow clone, or a branch "
                      f"rebased away: run those again from a commit of this history)")
            for line in rerun_commands(rows):
                print(line)
        return 1 if args.check and n_stale else 0
    files = [Path(p) for p in args.env] or sorted(RESULTS_DIR.glob("*/*/env.json")) + sorted(
        RESULTS_DIR.glob("*/env.json"))
    bad = 0
    for f in files:
        env = json.loads(f.read_text())
        why = check_record(env)
        note = ran_commit(env)[1] if env.get("source_hash") and why is None else None
        if why:
            bad += 1
            print(f"{f}: {why}", file=sys.stderr)
        elif note:
            print(f"{f}: {note}")
    print(f"{len(files) - bad} of {len(files)} records name the commit whose tree ran (or predate the source hash)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(_main())
