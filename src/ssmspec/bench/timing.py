"""Timing helpers for every benchmark: CUDA-graph replay and eager timing with raw samples kept, summaries,
and the fraction of HBM bandwidth a kernel achieves.

Conventions (STYLE.md 8): warm-up calls run first and are not timed (compilation, autotuning, allocator,
graph capture); every timed call is one sample in milliseconds; summaries are medians with p20/p80 for
kernels and p90/p99 for end-to-end numbers. On CUDA each sample is the time between two CUDA events
recorded around one call; on CPU it is ``time.perf_counter`` around one call.

    samples = time_cuda_graph(lambda: step(), warmup=3, iters=20)   # list of ms, one per replay
    row = {**summarize(samples), "samples_ms": samples}
    row["hbm_fraction"] = hbm_fraction(bytes_moved, row["ms_p50"], measure_hbm_bandwidth())
"""
from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch


def _device_of(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def time_eager(fn: Callable[[], object], warmup: int = 3, iters: int = 10, *, device=None) -> list[float]:
    """Run ``fn()`` ``warmup`` times untimed, then ``iters`` times, each timed; returns ms per call.

    ``device``: where ``fn`` does its work (None: CUDA when available, else CPU). On CUDA the samples
    come from CUDA events (asynchronous launches included, host overhead between calls excluded only as
    far as the GPU is busy); on CPU from ``perf_counter``.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    dev = _device_of(device)
    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return samples
    torch.cuda.synchronize(dev)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(dev)
    return [start.elapsed_time(end) for start, end in events]


def capture_cuda_graph(fn: Callable[[], object], warmup: int = 3) -> torch.cuda.CUDAGraph:
    """Warm ``fn`` up on a side stream (as graph capture requires), then capture one call of it.

    The captured work runs once more on every ``graph.replay()``; tensors ``fn`` reads and writes must
    keep their addresses (static buffers). Raises RuntimeError when ``fn`` cannot be captured (host syncs,
    data-dependent shapes, CPU tensors). It captures on torch's default capture stream, which lives on the GPU
    current at the process's first default capture: call it with ``fn``'s GPU current, in a process that has
    captured on no other GPU that way (the engine captures on each GPU's own stream: ``engine/graphs.py``).
    """
    if not torch.cuda.is_available():
        raise ValueError("CUDA-graph timing needs a CUDA device; use time_eager (bench.cuda_graph=false) on CPU")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 1)):  # at least one call before capture (lazy init, autotuning)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def time_cuda_graph(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> list[float]:
    """Capture ``fn`` in a CUDA graph (after ``warmup`` eager calls) and time ``iters`` replays with CUDA
    events; returns ms per replay. One more untimed replay precedes the timed ones. Note that the
    warm-up and capture calls run ``fn``'s side effects too (a decode step advances its caches)."""
    if iters < 1:
        raise ValueError(f"need iters >= 1, got {iters}")
    graph = capture_cuda_graph(fn, warmup)
    graph.replay()  # first replay uploads the graph; not timed
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    samples = [start.elapsed_time(end) for start, end in events]
    del graph
    return samples


def _percentile(sorted_vals: list[float], q: float) -> float:
    """Linear-interpolated percentile q in [0, 100] of an ascending list (numpy's default method)."""
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def summarize(samples: list[float]) -> dict:
    """ms samples -> {ms_p50, ms_p20, ms_p80, ms_p90, ms_p99, n}."""
    if not samples:
        raise ValueError("summarize needs at least one timing sample")
    vals = sorted(float(s) for s in samples)
    out = {f"ms_p{q}": _percentile(vals, q) for q in (50, 20, 80, 90, 99)}
    out["n"] = len(vals)
    return out


WALL_TOLERANCE = 0.02  # a timed loop whose wall clock differs from its summed step times by more is flagged


def wall_check(samples_ms: list[float], wall_ms: float) -> dict:
    """The wall-clock time of a timed loop beside the sum of its per-step samples (CUDA events see only the
    device's work; host gaps between steps show as a longer wall clock): ``loop_wall_ms``, ``steps_sum_ms``,
    ``wall_excess`` = wall / sum - 1, and ``wall_flag`` where that exceeds ``WALL_TOLERANCE`` either way."""
    total = float(sum(samples_ms))
    excess = wall_ms / total - 1.0 if total > 0 else float("inf")
    return {"loop_wall_ms": float(wall_ms), "steps_sum_ms": total, "wall_excess": excess,
            "wall_flag": bool(abs(excess) > WALL_TOLERANCE)}


def hbm_fraction(bytes_moved: float, ms: float, peak_gbps: float) -> float:
    """Fraction of peak memory bandwidth achieved: (bytes_moved / time) / peak, peak in GB/s (1e9 B/s)."""
    if ms <= 0 or peak_gbps <= 0:
        raise ValueError(f"need ms > 0 and peak_gbps > 0, got ms={ms}, peak_gbps={peak_gbps}")
    return bytes_moved / (ms * 1e-3) / (peak_gbps * 1e9)


@functools.cache
def measure_hbm_bandwidth(device: str = "cuda", nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Achievable HBM bandwidth in GB/s: a device-to-device copy of ``nbytes`` (read + write, so 2 x
    nbytes move per copy), median of ``iters`` timed copies. Cached per process and arguments."""
    if not torch.cuda.is_available():
        raise ValueError("measure_hbm_bandwidth needs a CUDA device; HBM fractions are GPU-only numbers")
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    samples = time_eager(lambda: dst.copy_(src), warmup=3, iters=iters, device=device)
    ms = statistics.median(samples)
    return 2 * n * 4 / (ms * 1e-3) / 1e9
