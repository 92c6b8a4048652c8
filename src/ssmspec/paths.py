"""Where the repository's config, results and data folders are."""
from __future__ import annotations

import os
from pathlib import Path

#: repository root (src layout: src/ssmspec/paths.py -> ../../)
ROOT = Path(os.environ.get("SSMSPEC_ROOT", Path(__file__).resolve().parents[2]))
CONF_DIR = Path(os.environ.get("SSMSPEC_CONF", ROOT / "conf"))
RESULTS_DIR = Path(os.environ.get("SSMSPEC_RESULTS", ROOT / "results"))
DATA_DIR = Path(os.environ.get("SSMSPEC_DATA", ROOT / ".data"))


def shown(path: Path) -> str:
    """``path`` as a user would type it: relative to the working directory when it is inside it."""
    path, cwd = Path(path).absolute(), Path.cwd().absolute()
    return str(path.relative_to(cwd)) if cwd in path.parents else str(path)
