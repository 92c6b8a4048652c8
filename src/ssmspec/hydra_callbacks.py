"""Hydra callbacks of ``ssmspec run`` (named under ``hydra.callbacks`` in conf/hydra/default.yaml)."""
from __future__ import annotations

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
