"""Provenance (ssmspec/provenance.py): env.json records the hash of the source tree that ran and the commit it
equals; every committed record describes its commit and its rows; every experiment declares the files that
decide its numbers (experiment.decided_by), and ``stale`` finds the reference results whose deciding files
changed since their commit."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ssmspec import provenance, registry
from ssmspec.paths import CONF_DIR, RESULTS_DIR, ROOT
from ssmspec.registry import experiment_ids, get_experiment


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


def test_a_commit_off_heads_history_is_unknown(repo):
    """A commit the object store still holds after its branch was rebased away is not this history's: a clone
    made elsewhere lacks it, so a record naming it must fail here too, not only in that clone."""
    (repo / "src" / "pkg" / "a.py").write_text("x = 2\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    gone = _git(repo, "rev-parse", "HEAD")
    _git(repo, "reset", "-q", "--hard", "HEAD~1")
    assert _git(repo, "cat-file", "-t", gone) == "commit"  # still in the objects
    assert provenance.resolve_commit(gone, repo) is None and provenance.commit_hash(gone, repo) is None
    assert provenance.resolve_commit("HEAD", repo) == _git(repo, "rev-parse", "HEAD")


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
    assert isinstance(env["wall_s"], float) and env["wall_s"] >= 0  # reproduce queues the longest references first


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


def test_gpu_tests_spread_rotates_every_gpu_to_each_worker():
    from ssmspec.gputests import worker_gpus

    assert worker_gpus("gw0", "0,1,2,3") == "0,1,2,3"
    assert worker_gpus("gw1", "0,1,2,3") == "1,2,3,0"
    assert worker_gpus("gw5", " 2, 3 ") == "3,2"  # two GPUs visible: workers alternate, each still sees both
    assert worker_gpus(None, "0,1") is None and worker_gpus("gw0", "") is None  # the controller; nothing to spread
    with pytest.raises(ValueError, match="expected gw<N>"):
        worker_gpus("master", "0,1")


def test_gpu_tests_spread_needs_workers(monkeypatch, capsys):
    from ssmspec import gputests

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert gputests.main(["--spread"]) == 2
    assert "add them after --" in capsys.readouterr().err
    assert gputests.main(["--spread", "--", "-k", "nothing"]) == 2  # pytest options, but no workers
    assert "add them after --" in capsys.readouterr().err


def test_spread_probe():
    """Records what this xdist worker sees (run by the test below only)."""
    out = os.environ.get("SSMSPEC_SPREAD_PROBE")
    if not out:
        pytest.skip("a probe for test_conftest_puts_each_workers_gpu_first")
    worker = os.environ["PYTEST_XDIST_WORKER"]
    Path(out, worker).write_text(os.environ.get("CUDA_VISIBLE_DEVICES", ""))


def test_conftest_puts_each_workers_gpu_first(tmp_path):
    """tests/conftest.py sets each xdist worker's CUDA_VISIBLE_DEVICES from SSMSPEC_TEST_GPUS before CUDA starts."""
    from ssmspec.gputests import SPREAD_ENV

    env = {**os.environ, SPREAD_ENV: "4,7", "SSMSPEC_SPREAD_PROBE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "each", "-p", "no:cacheprovider",
                           "tests/pipeline/test_provenance.py::test_spread_probe"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    seen = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert seen == {"gw0": "4,7", "gw1": "7,4"}, seen  # every worker ran the probe (--dist each)


# decided_by and stale ------------------------------------------------------------------------------------
def _declared(exp_id: str):
    import yaml

    return (yaml.safe_load((CONF_DIR / "experiment" / f"{exp_id}.yaml").read_text())["experiment"]).get("decided_by")


@pytest.mark.parametrize("exp_id", experiment_ids())
def test_every_experiment_declares_what_decides_it(exp_id):
    """Each experiment names its deciding files (the conservative default is for new files only), every entry
    matches a file, and the list holds at least the experiment's own yaml and the module of its bench."""
    assert _declared(exp_id), f"conf/experiment/{exp_id}.yaml: add experiment.decided_by (experiments/README.md)"
    exp = get_experiment(exp_id)  # reading it checks that every entry matches a file
    module = importlib.util.find_spec(exp.bench.partition(":")[0]).origin
    for must in (f"conf/experiment/{exp_id}.yaml", Path(module).resolve().relative_to(ROOT).as_posix()):
        assert registry.decides(exp.decided_by, must), f"{exp_id}: decided_by leaves out {must}"
    assert not any(registry.decides(exp.decided_by, f) for f in ("src/ssmspec/cli.py", "src/ssmspec/summary.py",
                                                                 "src/ssmspec/plots/style.py", "README.md"))


def test_decided_by_entries_are_checked(tmp_path, monkeypatch):
    exp_dir = tmp_path / "conf" / "experiment"
    exp_dir.mkdir(parents=True)
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "src" / "pkg" / "b.py").write_text("y = 1\n")
    block = "experiment:\n  id: demo\n  title: t\n  bench: m:f\n  plot: m:g\n  profiles: [cpu]\n"
    path = exp_dir / "demo.yaml"
    path.write_text(block + "  decided_by: [src/pkg/, 'src/**/a.py', conf/experiment/demo.yaml, '!src/pkg/b.py']\n")
    assert registry.read_experiment(path, root=tmp_path).decided_by[0] == "src/pkg/"
    path.write_text(block)
    assert registry.read_experiment(path, root=tmp_path).decided_by == registry.DEFAULT_DECIDED_BY
    for bad, why in [("[src/pkg/nope.py]", "'src/pkg/nope.py' matches no file"), ("src/pkg/", "lists the files"),
                     ("[/etc/passwd]", "relative to the repository root"), ("[]", "lists the files")]:
        path.write_text(block + f"  decided_by: {bad}\n")
        with pytest.raises(ValueError, match=re.escape(why)) as e:
            registry.read_experiment(path, root=tmp_path)
        assert str(path) in str(e.value)


def test_decides_matches_folders_globs_and_exclusions():
    entries = ("src/ssmspec/ops/replay/", "src/ssmspec/bench/steps*.py", "conf/model/**/*.yaml", "!conf/model/x.yaml")
    assert registry.decides(entries, "src/ssmspec/ops/replay/triton.py")
    assert not registry.decides(entries, "src/ssmspec/ops/replay_split/triton.py")
    assert registry.decides(entries, "src/ssmspec/bench/steps_snl.py")
    assert not registry.decides(entries, "src/ssmspec/bench/sub/steps.py")  # * stays in one folder
    assert registry.decides(entries, "conf/model/a/b.yaml") and registry.decides(entries, "conf/model/y.yaml")
    assert not registry.decides(entries, "conf/model/x.yaml")


@pytest.fixture
def results_repo(repo):
    """``repo`` with an experiment (decided by src/pkg/a.py, src/pkg/ops/ and its yaml) and a reference result
    of each profile measured at its first commit."""
    exp_dir = repo / "conf" / "experiment"
    exp_dir.mkdir()
    (repo / "conf" / "bench").mkdir()
    (repo / "conf" / "bench" / "default.yaml").write_text("warmup: 1\n")
    (exp_dir / "demo.yaml").write_text(
        "experiment:\n  id: demo\n  title: t\n  bench: m:f\n  plot: m:g\n  profiles: [cpu, gpu]\n"
        "  decided_by: [src/pkg/a.py, src/pkg/ops/, conf/experiment/demo.yaml]\n")
    (repo / "src" / "pkg" / "ops").mkdir()
    (repo / "src" / "pkg" / "ops" / "k.py").write_text("k = 1\n")
    (repo / "src" / "pkg" / "other.py").write_text("o = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "experiment")
    head = _git(repo, "rev-parse", "HEAD")
    for profile, env in (("gpu", {"git_sha": head[:7], "device_name": "H100"}),
                         ("cpu", {"git_sha": head, "source_commit": head, "device_name": "x86_64"})):
        (repo / "results" / "demo" / profile).mkdir(parents=True)
        (repo / "results" / "demo" / profile / "env.json").write_text(json.dumps(env))
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "results")
    return repo


def test_stale_detects_changed_deciding_files_only(results_repo):
    repo = results_repo
    rec = provenance.stale("demo", "gpu", root=repo)
    assert (rec.status, rec.files, rec.device_name, rec.label) == ("current", (), "H100", "current")

    (repo / "src" / "pkg" / "other.py").write_text("o = 2\n")  # not deciding: edited, committed, untracked
    (repo / "README.md").write_text("docs\n")
    (repo / "src" / "pkg" / "new.py").write_text("n = 1\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "unrelated")
    assert provenance.stale("demo", "gpu", root=repo).status == "current"

    (repo / "src" / "pkg" / "a.py").write_text("x = 2\n")  # deciding, committed after the result
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "change a")
    (repo / "src" / "pkg" / "ops" / "fresh.py").write_text("f = 1\n")  # deciding, untracked
    rows = provenance.stale_report(root=repo)
    assert [(r.profile, r.status, r.files) for r in rows] == [
        ("cpu", "stale", ("src/pkg/a.py", "src/pkg/ops/fresh.py")), ("gpu", "stale", ("src/pkg/a.py", "src/pkg/ops/fresh.py"))]
    assert rows[0].label == "stale: 2 files: src/pkg/a.py, src/pkg/ops/fresh.py"
    (repo / "src" / "pkg" / "ops" / "k.py").unlink()  # a deleted deciding file is a change too
    assert "src/pkg/ops/k.py" in provenance.stale("demo", "cpu", root=repo).files


def test_stale_ignores_comments_docstrings_and_declarations(results_repo):
    """What cannot move a number does not make a result stale: comments and docstrings of a deciding .py file,
    comments of a yaml and the experiment's own decided_by / title; a changed value does."""
    repo = results_repo
    (repo / "src" / "pkg" / "a.py").write_text('"""Docs."""\nx = 1  # why one\n')
    yml = repo / "conf" / "experiment" / "demo.yaml"
    yml.write_text("# a comment\n" + yml.read_text().replace("title: t", "title: another title").replace(
        "conf/experiment/demo.yaml]", "conf/experiment/demo.yaml, src/pkg/other.py]"))
    assert provenance.stale("demo", "cpu", root=repo).status == "current"
    yml.write_text(yml.read_text().replace("bench: m:f", "bench: m:g"))
    (repo / "src" / "pkg" / "a.py").write_text("x = 1.0\n")
    assert provenance.stale("demo", "cpu", root=repo).files == ("conf/experiment/demo.yaml", "src/pkg/a.py")


def test_stale_unknown_commit_and_the_command(results_repo, monkeypatch, capsys):
    repo = results_repo
    env = repo / "results" / "demo" / "gpu" / "env.json"
    env.write_text(json.dumps({"git_sha": "0123456789abcdef0123456789abcdef01234567", "device_name": "H100"}))
    rec = provenance.stale("demo", "gpu", root=repo)
    assert rec.status == "unknown commit" and rec.commit.startswith("0123456")
    with pytest.raises(ValueError, match="no reference result"):
        provenance.stale("demo", "nope", root=repo)

    from ssmspec import paths

    monkeypatch.setattr(paths, "ROOT", repo)
    monkeypatch.setattr(paths, "CONF_DIR", repo / "conf")
    monkeypatch.setattr(paths, "RESULTS_DIR", repo / "results")
    assert provenance._main(["stale", "--check"]) == 0
    out = capsys.readouterr().out
    assert "unknown commit" in out and "current" in out and "0 of 2 reference results stale" in out
    assert "1 name a commit outside this clone's history" in out
    (repo / "conf" / "experiment" / "demo.yaml").write_text(
        (repo / "conf" / "experiment" / "demo.yaml").read_text() + "bench: {iters: 3}\n")
    assert provenance._main(["stale", "--profile", "cpu", "demo"]) == 0  # a report
    out = capsys.readouterr().out
    assert "stale: 1 file: conf/experiment/demo.yaml" in out
    assert out.rstrip().endswith("rerun (cpu): python -m ssmspec reproduce --profile cpu --only demo --save-reference")
    assert provenance._main(["stale", "--profile", "gpu"]) == 0  # the gpu record's commit is unknown: not stale
    assert "rerun (" not in capsys.readouterr().out
    assert provenance._main(["stale", "--profile", "cpu", "--check"]) == 1


def test_declared_bench_and_drafting_modules_declare_what_they_import():
    """A bench or drafting module a result depends on pulls in the bench / drafting modules it imports at
    module level (e2e.py -> designed.py, oracle.py -> weyl.py): a helper split out of a declared module, or
    a new one it calls, is declared too (over-declaring only marks results stale sooner)."""
    import ast
    import fnmatch

    from ssmspec.registry import experiments

    def imported(path):
        for node in ast.parse((ROOT / path).read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[:2] in (
                    ["ssmspec", "bench"], ["ssmspec", "drafting"]):
                target = "src/" + node.module.replace(".", "/") + ".py"
                if (ROOT / target).is_file():
                    yield target

    def covered(f, decl):
        return any(f == d or (d.endswith("/") and f.startswith(d)) or fnmatch.fnmatch(f, d) for d in decl)

    for exp in experiments():
        decl = list(exp.decided_by)
        todo = [d for d in decl if d.endswith(".py") and ("/bench/" in d or "/drafting/" in d)]
        missing = set()
        while todo:
            for target in imported(todo.pop()):
                if not covered(target, decl) and target not in missing:
                    missing.add(target)
                    todo.append(target)
        assert not missing, f"conf/experiment/{exp.id}.yaml decided_by lacks {sorted(missing)}"


def test_experiments_that_run_the_engine_declare_its_capture_module():
    """Every graph the engine captures goes through engine/graphs.py (capture stream per GPU and role), so an
    experiment whose numbers the engine decides is decided by it too: a change there marks the result stale."""
    from ssmspec.registry import experiments

    missing = [exp.id for exp in experiments() if registry.decides(exp.decided_by, "src/ssmspec/engine/engine.py")
               and not registry.decides(exp.decided_by, "src/ssmspec/engine/graphs.py")]
    assert not missing, f"decided_by lists src/ssmspec/engine/engine.py but not engine/graphs.py: {missing}"


def test_a_wrong_hint_is_named_and_the_tree_still_finds_its_commit(repo, monkeypatch):
    """A device run whose SSMSPEC_GIT_SHA named an older commit: the record says mismatch; the source hash
    still identifies the commit whose tree ran (the one that introduced it, not a later results commit)."""
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "src" / "pkg" / "a.py").write_text("x = 2\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "code")
    code = _git(repo, "rev-parse", "HEAD")
    (repo / "README.md").write_text("results of that code\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "results")
    monkeypatch.setenv("SSMSPEC_GIT_SHA", first)
    rec = provenance.record(repo)
    assert rec["source_check"] == "mismatch" and rec["git_sha"] == first
    assert provenance.check_record(rec, repo) is None
    commit, note = provenance.ran_commit(rec, repo)
    assert commit == code and code[:10] in note and first[:10] in note
    (repo / "src" / "pkg" / "a.py").write_text("x = 3\n")  # never committed: no commit has this tree
    why = provenance.check_record(provenance.record(repo), repo)
    assert why is not None and "uncommitted" in why


def _is_full_clone() -> bool:
    return not _is_shallow() and provenance.resolve_commit("HEAD", ROOT) is not None


@pytest.mark.skipif(not _is_full_clone(), reason="needs the repository's history (a full clone)")
def test_readme_states_which_gpu_references_describe_this_code():
    """README.md's "Reference results" table is what `python -m ssmspec.provenance stale --profile gpu
    --markdown` prints for this checkout: a GPU number it quotes is marked current only if the files that decide
    it are unchanged since it was measured (regenerate the table after a change, or rerun the experiment)."""
    text = (ROOT / "README.md").read_text()
    begin, end = "<!-- reference-status:begin -->\n", "<!-- reference-status:end -->"
    assert begin in text and end in text, "README.md lost its reference-status markers"
    table = text.split(begin)[1].split(end)[0].strip()
    expected = provenance.format_markdown(provenance.stale_report(None, ["gpu"]))
    assert table == expected, ("README.md's reference table is out of date; paste the output of "
                               "`python -m ssmspec.provenance stale --profile gpu --markdown`")


@pytest.mark.skipif(not _is_full_clone(), reason="needs the repository's history (a full clone)")
def test_cpu_references_describe_this_code():
    """The CPU references are cheap to rerun (`make reproduce PROFILE=cpu SAVE_REFERENCE=1`): every one of them
    was measured on the files that decide it as they are now."""
    stale = [r for r in provenance.stale_report(None, ["cpu"]) if r.status != provenance.CURRENT]
    assert not stale, ("stale CPU references (rerun `make reproduce PROFILE=cpu SAVE_REFERENCE=1`): "
                       + "; ".join(f"{r.id}: {r.label}" for r in stale))


def test_experiment_weights_is_random_or_trained(tmp_path):
    path = tmp_path / "demo.yaml"
    block = "experiment:\n  id: demo\n  title: t\n  bench: m:f\n  plot: m:g\n  profiles: [cpu]\n"
    path.write_text(block)
    assert registry.read_experiment(path, root=tmp_path).weights == "random"
    path.write_text(block + "  weights: trained\n")
    assert registry.read_experiment(path, root=tmp_path).weights == "trained"
    path.write_text(block + "  weights: pretrained\n")
    with pytest.raises(ValueError, match=r"experiment.weights is random \(seeded presets\) or trained .*got 'pretrained'"):
        registry.read_experiment(path, root=tmp_path)


def test_experiment_gpus_is_a_count_and_reproduce_pins_that_many(tmp_path, monkeypatch):
    """``experiment.gpus``: how many GPUs the gpu profile's run sees at once (default 1; saguaro_e2e 2, its draft
    on a GPU of its own); reproduce's queue job asks that many slots on the gpu profile and one on cpu."""
    from ssmspec import reproduce

    path = tmp_path / "demo.yaml"
    block = "experiment:\n  id: demo\n  title: t\n  bench: m:f\n  plot: m:g\n  profiles: [cpu, gpu]\n"
    path.write_text(block)
    assert registry.read_experiment(path, root=tmp_path).gpus == 1
    for bad in ("0", "two", "true"):
        path.write_text(block + f"  gpus: {bad}\n")
        with pytest.raises(ValueError, match=r"experiment.gpus is the number of GPUs .*\(>= 1\)"):
            registry.read_experiment(path, root=tmp_path)
    path.write_text(block + "  gpus: 2\n")
    demo = registry.read_experiment(path, root=tmp_path)
    assert demo.gpus == 2 and registry.get_experiment("saguaro_e2e").gpus == 2
    seen = {}

    def fake_queue(jobs, slots, **kw):
        seen.update({j.name: j.slots for j in jobs})
        return []

    # the module itself, not its dotted name: pytest resolves a name through attributes of the hydra_plugins
    # namespace package, which lack a subpackage no earlier test of the worker imported
    from hydra_plugins.ssmspec_launcher import gpu_queue
    monkeypatch.setattr(gpu_queue, "run_queue", fake_queue)
    for profile, want in (("gpu", 2), ("cpu", 1)):
        plan = reproduce.Plan(profile, False, tmp_path, tmp_path / "results", tmp_path / "figures")
        reproduce.run_experiments([demo], plan, [("0",), ("1",)] if profile == "gpu" else [()])
        assert seen == {"demo": want}
