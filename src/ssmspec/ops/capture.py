"""Device tensors kept across calls, and CUDA graph capture.

A tensor made while a CUDA graph is being captured is a node of that graph: its memory belongs to the graph's
pool and it holds its values only once the graph replays. Code that keeps small device constants between calls
(a chain's layout, a GEMV's split-K counters) therefore keeps only what it made outside a capture; a capture
that finds nothing kept makes its own for itself and keeps nothing.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

T = TypeVar("T")


def capturing(device) -> bool:
    """Whether ``device``'s current CUDA stream is capturing a graph (False off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def kept(store: dict, key: Hashable, device, build: Callable[[], T]) -> T:
    """``store[key]``, else ``build()`` on ``device``, kept in ``store`` only when made outside a graph capture
    (module doc). What it returns is shared between callers: read only."""
    hit = store.get(key)
    if hit is None:
        hit = build()
        if not capturing(device):
            store[key] = hit
    return hit
