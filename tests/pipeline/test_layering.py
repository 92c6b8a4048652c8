"""Layering of the source tree (issue 23, item 4), read from the imports with ``ast`` (module-level and
function-level imports alike, so an import moved into a function to dodge a circle still counts):

* ``models/`` imports nothing from ``strategies``, ``engine``, ``drafting`` or ``bench`` (the types a mixer
  takes live where the model defines them);
* ``plots/`` imports nothing from ssmspec but ``ssmspec.plots`` and the formatting of ``ssmspec.units`` (plots
  read results files only);
* the imports inside ``bench/`` form no cycle (shared helpers live in one module both sides import);
* every ``.py`` file under ``src/`` stays at most ``MAX_LINES`` lines (STYLE.md 10; split by concept).
"""
from __future__ import annotations

import ast
from pathlib import Path

from ssmspec.paths import ROOT

SRC = ROOT / "src"
PKG = SRC / "ssmspec"
MAX_LINES = 420


def _module(path: Path) -> str:
    """src/ssmspec/bench/e2e.py -> ssmspec.bench.e2e; a package's __init__.py -> the package."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str | None = None) -> set[str]:
    """Every module a file imports (absolute names; relative imports resolved against ``module``, default
    the file's own), at any depth of the file. ``from a.b import c`` yields ``a.b`` and ``a.b.c`` (c may be
    a submodule)."""
    mod = module or _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names if a.name != "*")
    return out


def _files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _offenders(folder: Path, bad) -> list[str]:
    """'file: module' for every import ``bad(name)`` refuses (``from m import x`` reported once, as m)."""
    out = set()
    for f in _files(folder):
        names = _imports(f)
        out.update(f"{f.relative_to(SRC)}: {n}" for n in names
                   if bad(n) and not (n.rpartition(".")[0] in names and bad(n.rpartition(".")[0])))
    return sorted(out)


def test_import_reader_sees_function_level_and_relative_imports(tmp_path):
    """The reader the checks below rely on: an import inside a function and a relative import both count."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom . import config\n\ndef f():\n    from ssmspec.strategies.base import X\n")
    names = _imports(probe, "ssmspec.models.probe")
    assert {"os", "ssmspec.models.config", "ssmspec.strategies.base"} <= names


def test_models_import_no_strategy_engine_drafting_or_bench():
    banned = ("ssmspec.strategies", "ssmspec.engine", "ssmspec.drafting", "ssmspec.bench")
    bad = _offenders(PKG / "models", lambda n: any(_within(n, b) for b in banned))
    assert not bad, "models/ must not import these (move the types into models/):\n" + "\n".join(bad)


def test_plots_read_results_only():
    bad = _offenders(PKG / "plots", lambda n: _within(n, "ssmspec") and n != "ssmspec"
                     and not _within(n, "ssmspec.plots") and not _within(n, "ssmspec.units"))
    assert not bad, ("plots/ imports nothing from ssmspec but ssmspec.plots (they read results files; a "
                     "benchmark writes what a figure needs into its rows):\n" + "\n".join(sorted(bad)))


def _bench_graph() -> dict[str, set[str]]:
    files = _files(PKG / "bench")
    mods = {_module(f) for f in files}
    graph: dict[str, set[str]] = {}
    for f in files:
        me = _module(f)
        graph[me] = {n for n in _imports(f) if n in mods and n != me and n != "ssmspec.bench"}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph as [a, b, ..., a], or None (depth-first search, three colours)."""
    colour = dict.fromkeys(graph, 0)  # 0 unseen, 1 on the current path, 2 done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        colour[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, ())):
            if colour.get(v, 2) == 1:
                return path[path.index(v):] + [v]
            if colour.get(v) == 0 and (c := visit(v)):
                return c
        path.pop()
        colour[u] = 2
        return None

    for u in sorted(graph):
        if colour[u] == 0 and (c := visit(u)):
            return c
    return None


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_bench_has_no_import_cycle():
    cycle = _find_cycle(_bench_graph())
    assert cycle is None, ("bench/ imports form a cycle (put the shared helpers in one module both sides "
                           "import): " + " -> ".join(cycle))


def test_source_files_stay_short():
    long = {str(f.relative_to(ROOT)): n for f in _files(SRC) if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, (f"files over {MAX_LINES} lines (split them by concept):\n"
                      + "\n".join(f"{p}: {n}" for p, n in sorted(long.items())))
