"""The Python API of the README: importable from ``ssmspec``, and its example runs as written."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import ssmspec

README = Path(__file__).resolve().parents[2] / "README.md"


def _examples() -> list[str]:
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3, "the Python API section holds three examples: decoding, a draft model, an MTP head"
    return blocks


def _example() -> str:
    return _examples()[0]


def test_every_public_name_resolves():
    for name in ssmspec.__all__:
        assert getattr(ssmspec, name) is not None, name
    assert {"load_model", "build_model", "generate", "make_strategy", "make_drafter"} <= set(ssmspec.__all__)


def test_import_stays_light():
    """``import ssmspec`` (the command line's first import) does not load torch."""
    code = "import sys, ssmspec, ssmspec.paths; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_readme_example_runs(capsys):
    exec(compile(_example(), str(README), "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert "model calls instead of" in out[0] and len(out) == 2


def test_readme_draft_model_example_runs():
    """The draft-model example: a Gated DeltaNet draft's beam tree through the draft engine, lossless."""
    exec(compile(_examples()[1], str(README), "exec"), {})


def test_readme_mtp_example_runs():
    """The MTP example: a Qwen3.5 target drafting with its own (random) multi-token-prediction head, lossless."""
    exec(compile(_examples()[2], str(README), "exec"), {})
