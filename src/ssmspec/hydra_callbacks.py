"""Hydra callbacks of ``ssmspec run`` (named under ``hydra.callbacks`` in conf/hydra/default.yaml) and the
resolver that keeps its run-directory names short (``dirname``)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepStart(Callback):
    """Tells the command line the directory of a sweep as the sweep starts (``hydra.sweep.dir``: its
    ``${now:...}`` is resolved once per config, so this is the directory the sweeper makes): a sweep stopped
    before its first job (a closed stdout at Hydra's "Launching" line) removes the multirun.yaml left there."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from ssmspec.cli import _STATE

        _STATE.sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()


DIRNAME_MAX = 120  # bytes of a run directory's name made of overrides; file systems allow 255


def dirname(overrides: str) -> str:
    """A run directory's name from Hydra's ``override_dirname``: as it is when short, else its first characters
    and a hash of the whole (an inline ``+bench.throughput={...}`` override alone can pass the 255 bytes a file
    name may have, and two sweep jobs that differ only at the end still get two directories)."""
    if len(overrides.encode()) <= DIRNAME_MAX:
        return overrides
    digest = hashlib.sha1(overrides.encode()).hexdigest()[:12]
    head = overrides.encode()[:DIRNAME_MAX - len(digest) - 1].decode(errors="ignore")
    return f"{head}~{digest}"


def register_resolvers() -> None:
    """``${ssmspec_dirname:...}`` for conf/hydra/default.yaml (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("ssmspec_dirname"):
        OmegaConf.register_new_resolver("ssmspec_dirname", dirname)
