"""CUDA-graph capture on a named GPU.

``torch.cuda.graph(g)`` without a stream captures on a class-wide default capture stream that torch makes once
per process, on whichever GPU is current at the first capture. Entering that stream makes its GPU current. So
after one capture for a model on cuda:1, every later default capture in the process -- a model on cuda:0
included -- ran on cuda:1's stream: the cuda:0 work was not captured at all, a random draw failed with "Offset
increment outside graph capture encountered unexpectedly", and a Triton launch with cuda:0 pointers failed with
"Pointer argument cannot be accessed from Triton". (Seen on two H100s: 54 GPU tests failed in the pytest workers
that had first captured on cuda:1.) Every graph the engine captures goes through ``capture_on``, which captures on
a stream of the given GPU: one per GPU and role, kept for the process as torch keeps its own.

Roles: graphs that may replay at the same time on two streams of one GPU are captured on different streams. torch
gives cuBLAS a workspace per (handle, current stream), and a captured GEMM keeps the address of its capture
stream's workspace; two graphs of one capture stream replayed at once would share that scratch (any GEMM that
splits its reduction writes partial sums there). The engine's graphs replay in order on one stream (``main``);
the speculation of an asynchronous drafter replays beside the target's step on a side stream
(``engine/speculate.py``), so it is captured with the role ``speculate``.
"""
from __future__ import annotations

import torch

_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}
ROLES = ("main", "speculate")


def _index(device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"a CUDA graph captures on a GPU; got device {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def capture_stream(device, role: str = "main") -> torch.cuda.Stream:
    """The side stream of ``device`` (a CUDA device; no index: the current one) that its graphs of ``role``
    (``ROLES``, module doc) capture on."""
    if role not in ROLES:
        raise ValueError(f"unknown capture role {role!r}; choose one of {', '.join(ROLES)}")
    key = (_index(device), role)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(key[0])
    return _STREAMS[key]


def capture_on(graph: torch.cuda.CUDAGraph, device, role: str = "main") -> torch.cuda.graph:
    """``torch.cuda.graph(graph)`` capturing on ``device``'s own capture stream for ``role`` (module doc)."""
    return torch.cuda.graph(graph, stream=capture_stream(device, role))
