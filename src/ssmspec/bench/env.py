"""env.json: what a result was measured on, so numbers from different machines are never mixed up.

Keys: time (UTC, ISO 8601), host, platform, python, cpu_count, torch_threads, device (cpu | cuda), device_name,
device_count, device_memory_gb, compute_capability, driver, cuda (torch's CUDA build), torch, triton,
transformers, ssmspec, git_sha, git_dirty, weights ("random" or the checkpoint path), ops_backend, decode_fusion, pdl, gemv_prefetch,
and the provenance of ``ssmspec/provenance.py``: git_sha_from (git or SSMSPEC_GIT_SHA), source_hash (the hash of src/,
conf/ and pyproject.toml as they ran), source_paths, source_commit (the commit with exactly that tree, checked
where it ran, else None) and source_check (git | mismatch | unchecked).
"""
from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata

import torch

from ssmspec import provenance
from ssmspec.paths import ROOT


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str], cwd=None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def git_dirty() -> bool | None:
    """Whether the checkout has uncommitted changes to tracked files (None: no git here, or the sha is a
    ``SSMSPEC_GIT_SHA`` hint, whose tree ``provenance.record`` checks instead)."""
    if "SSMSPEC_GIT_SHA" in os.environ or _run(["git", "rev-parse", "HEAD"], cwd=ROOT) is None:
        return None
    return _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT) is not None  # None: no output


def _driver() -> str | None:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def collect_env(*, device: str | torch.device = "cpu", weights: str = "random") -> dict:
    """The env.json dict of a run on ``device`` whose model weights are ``weights``."""
    dev = torch.device(device)
    source = provenance.record()
    env = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": dev.type,
        "device_name": platform.processor() or platform.machine(),
        "device_count": 0,
        "device_memory_gb": None,
        "compute_capability": None,
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "ssmspec": _version("ssmspec") or "source",
        "git_sha": source.pop("git_sha"),
        "git_dirty": git_dirty(),
        **source,
        "weights": weights,
        "ops_backend": os.environ.get("SSMSPEC_OPS_BACKEND", "auto"),
        "decode_fusion": os.environ.get("SSMSPEC_DECODE_FUSION", "default (gemv)"),  # the decode kernels (ops.dispatch)
        "draft_decode_fusion": os.environ.get("SSMSPEC_DRAFT_DECODE_FUSION", "the target's"),  # a draft model's
        "pdl": os.environ.get("SSMSPEC_PDL", "auto"),  # programmatic dependent launch (ops/triton_common.py)
        "gemv_prefetch": os.environ.get("SSMSPEC_GEMV_PREFETCH", "default"),  # weight lines prefetched under PDL
    }
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        env.update(device_name=props.name, device_count=torch.cuda.device_count(),
                   device_memory_gb=round(props.total_memory / 2**30, 1),
                   compute_capability=f"{props.major}.{props.minor}", driver=_driver())
    return env
