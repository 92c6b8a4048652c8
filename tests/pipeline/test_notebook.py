"""notebooks/analysis.ipynb runs headless (as CI runs it) and shows a tidy table per experiment, with
integer column headers, and every figure."""
from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install -e '.[dev]' (nbclient, nbformat, ipykernel)")
nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[dev]' (nbclient, nbformat, ipykernel)")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "analysis.ipynb"


def _outputs(nb, mime: str) -> list[str]:
    return [o["data"][mime] for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if mime in o.get("data", {})]


def test_notebook_executes_headless(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")  # as CI has it: the figures must not depend on a display backend
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # a failing cell raises CellExecutionError; a hung one times out
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    experiments = sorted({p.parent.parent.name for p in (ROOT / "results").glob("*/*/results.jsonl")})
    headings = [m for m in _outputs(nb, "text/markdown") if m.startswith("### ")]  # figure titles are **bold**
    assert headings == [f"### `{e}`" for e in experiments]
    html = _outputs(nb, "text/html")
    # provenance table + one table per experiment + the acceptance labels and the measured acceptance
    assert len(html) == 1 + len(experiments) + 2
    throughput = html[1 + experiments.index("throughput_ar")]
    assert "<th>16</th>" in throughput and "<th>16.0</th>" not in throughput  # integer headers
    _check_acceptance_tables(nb)
    figures = sorted((ROOT / "results" / "figures").glob("*.png"))
    assert len(_outputs(nb, "image/png")) == len(figures) > 0


def _check_acceptance_tables(nb) -> None:
    """The two acceptance tables are the law of the files: the label counts per experiment and profile, and the
    median mean accepted length of trained_acceptance's measured rows (recomputed here from its cpu reference)."""
    import json
    import statistics
    from collections import Counter

    labels = Counter(json.loads(line).get("acceptance") for path in (ROOT / "results").glob("*/*/results.jsonl")
                     for line in path.read_text().splitlines())
    text = [o["text"] for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "text" in o]
    measured, oracle = labels["measured"], labels["oracle"]
    assert any(f"{measured} measured and {oracle} oracle rows" in t for t in text), text[-3:]
    assert measured > 0 and oracle > 0  # both kinds are committed: the table is not vacuous
    rows = [json.loads(x) for x in (ROOT / "results" / "trained_acceptance" / "cpu" / "results.jsonl").read_text()
            .splitlines()]
    dm = [r["mean_accepted"] for r in rows if r.get("acceptance") == "measured" and r.get("drafter") == "draft_model"
          and r.get("strategy") == "replay" and r.get("set") == "validation" and r.get("S") == 4
          and r.get("status", "ok") == "ok"]  # one cell of the table: (trained_acceptance, mamba2, validation, ...)
    assert dm
    html = _outputs(nb, "text/html")[-1]
    assert f"{statistics.median(dm):.2f}" in html and "trained_acceptance" in html
