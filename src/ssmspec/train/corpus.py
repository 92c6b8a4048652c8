"""The training corpus: the Python source files of the running interpreter's standard library (issue 24).

Files are the ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (or a directory the config names), minus
test folders (``test``, ``tests``, ``idle_test``), ``site-packages`` and ``__pycache__``. Every file gets a
seeded order rank, sha256("order", seed, relative path), and a split rank with the salt "split": files are taken in
order rank until the size cap, and a file goes to validation when its split rank falls in the lowest
``val_fraction`` of the hash range (at least one file each way: the lowest split rank goes to validation). The rule looks at one file
only, so adding a file never moves another across the split. The corpus hash is sha256 over (relative path,
sha256 of the bytes) of the chosen files in sorted order: the cache key of everything trained on it.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_RANK_SPACE = 2 ** 64


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[str]:
    """Relative POSIX paths of the ``*.py`` files under ``root``, sorted, test and package folders left out."""
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if p.is_file() and not EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            out.append(rel.as_posix())
    return sorted(out)


def _rank(seed: int, rel: str, use: str) -> int:
    """A file's seeded position in [0, 2^64) for ``use`` (order: the size cap's order, split: the split); two
    salts, so that the files the cap keeps are not all of one split."""
    return int.from_bytes(hashlib.sha256(f"{use}\0{seed}\0{rel}".encode()).digest()[:8], "big")


@dataclass(frozen=True)
class Corpus:
    root: Path  # the directory the files are read from
    train_files: tuple[str, ...]  # sorted relative paths
    val_files: tuple[str, ...]  # sorted relative paths
    digest: str  # sha256 hex of (path, content hash) of every chosen file, sorted by path
    n_bytes: int  # bytes of the chosen files

    def texts(self, split: str) -> list[str]:
        """The files of ``split`` (train | val) as text, in path order (invalid UTF-8 replaced: deterministic)."""
        files = {"train": self.train_files, "val": self.val_files}[split]
        return [(self.root / f).read_bytes().decode("utf-8", errors="replace") for f in files]

    def summary(self) -> dict:
        return {"root": str(self.root), "hash": self.digest, "bytes": self.n_bytes,
                "train_files": len(self.train_files), "val_files": len(self.val_files)}


def load_corpus(*, root: str | Path | None = None, max_bytes: int = 0, val_fraction: float = 0.1,
                min_bytes: int = 10_000, seed: int = 0) -> Corpus:
    """The corpus of the module docstring. ``max_bytes`` 0: no cap. Raises ``ValueError`` naming the fix when the
    directory is missing, holds no source files, or yields less than ``min_bytes`` or an empty split."""
    base = Path(root) if root else stdlib_root()
    where = f"corpus.root={base}" if root else f"the standard library ({base})"
    if not base.is_dir():
        raise ValueError(f"{where} is not a directory; set corpus.root to a folder of .py files (null: the stdlib)")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"corpus.val_fraction={val_fraction} must lie in (0, 1); e.g. 0.1")
    files = source_files(base)
    if not files:
        raise ValueError(f"{where} holds no .py files outside test folders; set corpus.root to a folder with "
                         f"Python sources")
    chosen, total = [], 0
    for rel in sorted(files, key=lambda f: _rank(seed, f, "order")):
        size = (base / rel).stat().st_size
        if max_bytes and total + size > max_bytes and chosen:
            continue  # a smaller file further down may still fit
        chosen.append(rel)
        total += size
    if total < min_bytes:
        raise ValueError(f"corpus too small: {total} bytes in {len(chosen)} files of {where}, need at least "
                         f"corpus.min_bytes={min_bytes}; raise corpus.max_bytes or point corpus.root at more sources")
    by_split = sorted(chosen, key=lambda f: _rank(seed, f, "split"))
    cut = int(val_fraction * _RANK_SPACE)
    n_val = sum(_rank(seed, f, "split") < cut for f in by_split)
    n_val = min(max(n_val, 1), len(by_split) - 1)  # a capped corpus of few files still gets one of each
    val, train = sorted(by_split[:n_val]), sorted(by_split[n_val:])
    if not val or not train:
        raise ValueError(f"corpus too small to split: {len(chosen)} files of {where} give {len(train)} training and "
                         f"{len(val)} validation files at corpus.val_fraction={val_fraction}; raise corpus.max_bytes "
                         f"or change corpus.val_fraction")
    h = hashlib.sha256()
    for rel in sorted(chosen):
        h.update(rel.encode() + b"\0" + hashlib.sha256((base / rel).read_bytes()).digest())
    return Corpus(root=base, train_files=tuple(train), val_files=tuple(val), digest=h.hexdigest(), n_bytes=total)
