"""Provenance (ssmspec/provenance.py): env.json records the hash of the source tree that ran and the commit it
equals; every committed record describes its commit and its rows."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import pytest

from ssmspec import provenance
from ssmspec.paths import RESULTS_DIR, ROOT


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A small checkout with src/, conf/ and pyproject.toml, one commit."""
    monkeypatch.delenv("SSMSPEC_GIT_SHA", raising=False)
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "src" / "pkg" / "__pycache__").mkdir()
    (tmp_path / "src" / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0compiled")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "c.yaml").write_text("k: 2\n")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'pkg'\n")
    (tmp_path / "README.md").write_text("not part of the source\n")
    (tmp_path / ".gitignore").write_text("__pycache__/\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return tmp_path


def test_hash_of_files_equals_hash_of_commit(repo):
    assert provenance.tree_hash(repo) == provenance.commit_hash("HEAD", repo)
    (repo / "README.md").write_text("docs change nothing that runs\n")
    assert provenance.tree_hash(repo) == provenance.commit_hash("HEAD", repo)
    (repo / "conf" / "c.yaml").write_text("k: 3\n")
    assert provenance.tree_hash(repo) != provenance.commit_hash("HEAD", repo)


def test_record_checks_head_and_the_hint(repo, monkeypatch):
    head = _git(repo, "rev-parse", "HEAD")
    rec = provenance.record(repo)
    assert rec["source_check"] == "git" and rec["source_commit"] == head and rec["git_sha_from"] == "git"

    (repo / "src" / "pkg" / "a.py").write_text("x = 2\n")  # an uncommitted edit runs
    rec = provenance.record(repo)
    assert rec["source_check"] == "mismatch" and rec["source_commit"] is None and rec["git_sha"] == head
    (repo / "src" / "pkg" / "a.py").write_text("x = 1\n")

    (repo / "src" / "pkg" / "new.py").write_text("y = 1\n")  # an untracked module runs too
    assert provenance.record(repo)["source_check"] == "mismatch"
    (repo / "src" / "pkg" / "new.py").unlink()

    monkeypatch.setenv("SSMSPEC_GIT_SHA", head[:8])  # a hint that is right
    rec = provenance.record(repo)
    assert rec["source_check"] == "git" and rec["source_commit"] == head and rec["git_sha_from"] == "SSMSPEC_GIT_SHA"

    (repo / "conf" / "c.yaml").write_text("k: 5\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    rec = provenance.record(repo)  # the hint names the older commit: its tree is not the one that ran
    assert rec["source_check"] == "mismatch" and rec["source_commit"] is None and rec["git_sha"] == head[:8]


def test_copy_without_git_is_unchecked_then_checked_in_a_clone(repo, tmp_path_factory, monkeypatch):
    head = _git(repo, "rev-parse", "HEAD")
    copy = tmp_path_factory.mktemp("device") / "tree"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setenv("SSMSPEC_GIT_SHA", head)
    rec = provenance.record(copy)
    assert rec["source_check"] == "unchecked" and rec["source_commit"] is None
    assert provenance.check_record(rec, repo) is None  # later, in the clone that has the commit

    (copy / "src" / "pkg" / "a.py").write_text("x = 9\n")  # the copy ran an edit the hint does not hold
    rec = provenance.record(copy)
    why = provenance.check_record(rec, repo)
    assert why is not None and head[:10] in why and "rerun" in why


def test_run_records_source_and_rows(cli, tmp_path):
    from pipeline_helpers import TINY

    out = tmp_path / "run"
    status, _, err = cli("run", *TINY, f"results_dir={out}")
    assert status == 0, err
    env = json.loads((out / "env.json").read_text())
    assert env["source_hash"] == provenance.tree_hash(ROOT) and env["source_check"] in ("git", "mismatch", "unchecked")
    rows = (out / "results.jsonl").read_bytes()
    assert env["rows"] == len(rows.splitlines()) and env["results_sha256"] == hashlib.sha256(rows).hexdigest()


def _is_shallow() -> bool:
    try:
        return _git(ROOT, "rev-parse", "--is-shallow-repository") == "true"
    except (OSError, subprocess.CalledProcessError):
        return True


@pytest.mark.parametrize("env_path", sorted(RESULTS_DIR.glob("*/*/env.json")) + sorted(RESULTS_DIR.glob("*/env.json")),
                         ids=lambda p: str(p.parent.relative_to(RESULTS_DIR)))
def test_committed_records_describe_their_commit_and_rows(env_path):
    """A reference result's env.json: its source hash is that of the commit it names (checked in this clone),
    and its row count and results.jsonl hash are those of the rows beside it. Records from before the source
    hash have neither and are only required to name a commit."""
    env = json.loads(env_path.read_text())
    assert env.get("git_sha") not in (None, "", "unknown")
    if env.get("source_hash"):
        sha = env.get("source_commit") or env["git_sha"]
        if not _is_shallow():
            assert provenance.resolve_commit(sha, ROOT), f"{env_path}: commit {sha} is not in this repository"
        assert provenance.check_record(env, ROOT) is None, provenance.check_record(env, ROOT)
    if "results_sha256" in env:
        rows = (env_path.parent / "results.jsonl").read_bytes()
        assert env["rows"] == len(rows.splitlines())
        assert env["results_sha256"] == hashlib.sha256(rows).hexdigest(), f"{env_path.parent}: rows were edited"


def test_gpu_test_record_counts():
    from ssmspec.gputests import parse_counts

    log = "....s.F\nFAILED tests/x.py::t - boom\n===== 1 failed, 118 passed, 2 skipped, 1404 deselected, 3 warnings in 355.2s ====="
    c = parse_counts(log)
    assert (c["passed"], c["failed"], c["skipped"], c["deselected"], c["errors"], c["warnings"]) == (118, 1, 2, 1404, 0, 3)
    assert parse_counts("120 passed, 1 error in 3s")["errors"] == 1 and parse_counts("nothing ran")["passed"] == 0
