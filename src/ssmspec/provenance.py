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

    python -m ssmspec.provenance hash              # the hash of this checkout's source tree
    python -m ssmspec.provenance check [ENV.json ...]   # every results/*/*/env.json by default
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

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
    """The full sha of ``rev`` if this checkout's git objects hold that commit, else None."""
    out = _git(["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], root)
    return out.strip() if out and out.strip() else None


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
    if claimed is not None and resolve_commit(claimed, root) is not None:
        if commit_hash(claimed, root) == source:
            check, commit = "git", resolve_commit(claimed, root)
        else:
            check = "mismatch"
    return {"git_sha": claimed or "unknown", "git_sha_from": "SSMSPEC_GIT_SHA" if hint else "git" if head else None,
            "source_hash": source, "source_paths": list(SOURCE_PATHS), "source_commit": commit, "source_check": check}


def check_record(env: dict, root: Path = ROOT) -> str | None:
    """Why ``env`` (an env.json dict) does not describe a commit of this checkout, or None where it does.

    A record without ``source_hash`` predates this check and passes (None). A record whose commit is not in
    this clone's history (a shallow clone) cannot be checked and passes too."""
    source = env.get("source_hash")
    if not source:
        return None
    sha = env.get("source_commit") or env.get("git_sha")
    if not sha or sha == "unknown":
        return "the run recorded no commit; rerun it from a commit (set SSMSPEC_GIT_SHA on a copy without git)"
    if resolve_commit(sha, root) is None:
        return None
    at_commit = commit_hash(sha, root)
    if at_commit != source:
        return (f"the source that ran ({source[:19]}...) is not commit {sha[:10]}'s ({str(at_commit)[:19]}...): "
                f"the run had uncommitted changes or a wrong SSMSPEC_GIT_SHA; rerun it from a commit")
    return None


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ssmspec.provenance", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("hash", help="the source hash of this checkout")
    c = sub.add_parser("check", help="check env.json records against this clone's commits")
    c.add_argument("env", nargs="*", help="env.json files (default: every results/*/*/env.json)")
    args = ap.parse_args(argv)
    if args.cmd == "hash":
        print(tree_hash())
        return 0
    files = [Path(p) for p in args.env] or sorted(RESULTS_DIR.glob("*/*/env.json"))
    bad = 0
    for f in files:
        why = check_record(json.loads(f.read_text()))
        if why:
            bad += 1
            print(f"{f}: {why}", file=sys.stderr)
    print(f"{len(files) - bad} of {len(files)} records describe their commit (or predate the source hash)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(_main())
