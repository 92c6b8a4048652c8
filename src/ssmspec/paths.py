"""Where the repository's config, results and data folders are."""
from __future__ import annotations

import os
from pathlib import Path

#: repository root (src layout: src/ssmspec/paths.py -> ../../)
ROOT = Path(os.environ.get("SSMSPEC_ROOT", Path(__file__).resolve().parents[2]))
CONF_DIR = Path(os.environ.get("SSMSPEC_CONF", ROOT / "conf"))
RESULTS_DIR = Path(os.environ.get("SSMSPEC_RESULTS", ROOT / "results"))
DATA_DIR = Path(os.environ.get("SSMSPEC_DATA", ROOT / ".data"))
