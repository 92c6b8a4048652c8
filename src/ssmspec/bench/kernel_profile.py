"""Where a decode step's time goes: the GPU kernels of a few engine steps under torch.profiler (CUPTI sees the
kernels inside CUDA graph replays too), counted and timed per step.

``profile_steps(eng, steps)`` launches ``steps`` more real steps of an engine that has already run (its graphs
captured) and returns the kernels per step and a table, one entry per kernel name: launches per step, device
microseconds per step and the share of the step's kernel time, longest first. The profiled steps are not the
timed ones (profiling slows the host); the table says what the timed steps launch, not how long they took.
"""
from __future__ import annotations

import collections

import torch

NAME_CHARS = 90  # kernel names are long C++ signatures: the head names the kernel


def profile_steps(eng, *, steps: int = 3, top: int = 20) -> tuple[float, list[dict]]:
    """(kernels per step, per-kernel table of the ``top`` longest) over ``steps`` launches of ``eng``."""
    from torch.profiler import ProfilerActivity, profile

    if steps < 1:
        raise ValueError(f"profile_steps needs steps >= 1, got {steps}")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.launch()
            eng.collect(keep=1)
        eng.collect(keep=0)
        torch.cuda.synchronize()
    count, micros = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            name = e.name[:NAME_CHARS]
            count[name] += 1
            micros[name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(micros.values()) or 1.0
    table = [{"kernel": n, "per_step": count[n] / steps, "us_per_step": micros[n] / steps, "share": micros[n] / total}
             for n, _ in micros.most_common(top)]
    return sum(count.values()) / steps, table
