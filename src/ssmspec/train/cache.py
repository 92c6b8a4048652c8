"""The training cache: ``<cache_dir>/<key>/``, key = sha256 of (corpus hash, resolved config, seed, format).

An entry is built in ``<cache_dir>/.tmp-<key>-<pid>/`` and renamed into place only once every file is written,
``manifest.json`` last: an interrupted or failed run leaves nothing under the key (its staging folder is
removed on the way out, or at the next run when the process was killed). The manifest lists every file with its
size; an entry whose manifest is missing, unreadable or disagrees with the files is corrupt and is refused with
the fix (``rm -rf <dir>`` or ``--retrain``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

FORMAT = 1  # bump when what an entry holds changes: old entries then miss instead of being read wrongly
MANIFEST = "manifest.json"


def cache_key(corpus_hash: str, config: dict, seed: int) -> str:
    blob = json.dumps({"corpus": corpus_hash, "config": config, "seed": seed, "format": FORMAT}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def file_sizes(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def read_entry(entry: Path) -> dict:
    """The manifest of a complete entry; ``ValueError`` naming the fix when the entry is corrupt."""
    fix = f"remove it (rm -rf {entry}) or rerun with --retrain"
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        listed = manifest["files"]
    except FileNotFoundError:
        raise ValueError(f"cache entry {entry} is corrupt: no {MANIFEST} (an entry is written whole); {fix}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cache entry {entry} is corrupt: {MANIFEST} unreadable ({type(e).__name__}); {fix}") from None
    found = file_sizes(entry)
    bad = sorted(f for f, size in listed.items() if found.get(f) != size)
    if bad:
        raise ValueError(f"cache entry {entry} is corrupt: {len(bad)} file(s) missing or changed ({', '.join(bad[:4])}"
                         f"); {fix}")
    return manifest


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(cache_dir: Path) -> None:
    """Staging folders of runs whose process is gone (killed without cleanup)."""
    for d in cache_dir.glob(".tmp-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


class Staging:
    """``with Staging(cache_dir, key) as tmp:`` build the entry in ``tmp``; ``commit(manifest)`` writes the
    manifest and renames the folder to ``cache_dir/key``; leaving the block without commit removes it (and the
    folder above it when it made it and left it empty)."""

    def __init__(self, cache_dir: Path, key: str) -> None:
        self.final = cache_dir / key
        self.tmp = cache_dir / f".tmp-{key}-{os.getpid()}"

    def __enter__(self) -> Path:
        self.made_parent = not self.final.parent.exists()
        self.final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(self.final.parent)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def commit(self, manifest: dict, *, replace: bool = True) -> Path:
        """``replace=False``: an entry another process committed meanwhile (same key, so the same run) is kept and
        this one dropped, so a reader of that entry never sees it removed under it."""
        manifest = {**manifest, "files": file_sizes(self.tmp)}
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if self.final.exists() and not replace:
            return self.final
        if self.final.exists():
            shutil.rmtree(self.final)  # --retrain over an old or corrupt entry
        os.replace(self.tmp, self.final)
        return self.final

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.made_parent:  # a folder this run made (cache_dir/targets): removed when left empty, so nothing stays
            with contextlib.suppress(OSError):  # not empty: an entry committed, or another run's staging
                self.final.parent.rmdir()
