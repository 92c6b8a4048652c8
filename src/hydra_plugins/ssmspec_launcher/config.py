"""The ``gpu_queue`` launcher's settings, registered as ``hydra/launcher=gpu_queue``.

No ``from __future__ import annotations`` in this package's dataclass modules: Hydra's plugin scan executes
them without registering them in sys.modules, where dataclasses looks string annotations up."""

from dataclasses import dataclass
from typing import List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class GpuQueueLauncherConf:
    _target_: str = "hydra_plugins.ssmspec_launcher.launcher.GpuQueueLauncher"
    # GPU ids handed out to jobs (each job's CUDA_VISIBLE_DEVICES); null: $SSMSPEC_DEVICES (comma-separated),
    # else $CUDA_VISIBLE_DEVICES, else every GPU torch counts. [] runs every job on the CPU. An id this
    # machine does not show is refused before any job starts.
    devices: Optional[List[str]] = None
    gpus_per_job: int = 1  # GPUs per job; jobs at once = len(devices) // gpus_per_job
    cpu_jobs: int = 1  # jobs at once when there is no GPU (CPU timings of parallel jobs disturb each other)
    logs_subdir: str = "logs"  # per-job logs: <sweep dir>/<logs_subdir>/<job subdir>.log


ConfigStore.instance().store(group="hydra/launcher", name="gpu_queue", node=GpuQueueLauncherConf,
                             provider="ssmspec")
