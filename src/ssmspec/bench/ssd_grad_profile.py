"""Where the trainable SSD scan's forward + backward time goes: its kernels and mamba_ssm's under torch.profiler.

    python -m ssmspec.bench.ssd_grad_profile                                   # GPU: seed 004's size at 32K
    python -m ssmspec.bench.ssd_grad_profile --shapes seed004:16:32768 nemotron-h-4b:16:8192 --json prof.json
    python -m ssmspec.bench.ssd_grad_profile --tiny                            # CPU smoke (the interpreter)

Per shape (mixer:batch:seqlen, as ``bench/ssd_grad_sweep``: ``seed004`` or a model preset's Mamba-2 mixer) and
implementation (``ours``: ``ops/ssd_grad`` at its launch defaults; ``mamba_ssm``: ``mamba_chunk_scan_combined``,
chunk 256, where it imports and x has fewer than 2^31 elements), ``--iters`` calls of forward +
``torch.autograd.grad`` of every input against y and the final state (the calls of ``experiment=ssd_kernel_fwdbwd``,
``bench/ssd_grad.ours_call`` on the Triton backend and ``mamba_call``; inputs and gradients as
``bench/ssd_grad_sweep``) run under the profiler after ``--warmup`` calls. The table gives, per kernel
name, its launches and device microseconds per call and its share of the call's kernel time, longest first, and
the total: the kernel time of one forward + backward (not its wall time: launch gaps are not in it). On CPU
(``--tiny``, or no CUDA) the kernels run under the Triton interpreter and the profiler sees host operators, so
the table checks the pipeline, not the GPU's split.
"""
from __future__ import annotations

import argparse
import collections
import json
import os

import torch

NAME_CHARS = 80  # Triton kernel names are short; cuBLAS / ATen ones are C++ signatures: their head names them
GPU_SHAPES = ["seed004:16:32768"]
TINY = ["tiny:1:40"]


def kernel_table(events, calls: int, *, cuda: bool, top: int = 16) -> tuple[float, list[dict]]:
    """(microseconds per call, the ``top`` longest kernels: name, launches and microseconds per call, share) from
    profiler events; memory copies and sets count as kernels (they take device time too)."""
    if calls < 1:
        raise ValueError(f"kernel_table needs calls >= 1, got {calls}")
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    count, micros = collections.Counter(), collections.Counter()
    for e in events:
        if e.device_type != kind or (not cuda and e.cpu_parent is not None):  # CPU: top-level operators only
            continue
        name = e.name[:NAME_CHARS]
        count[name] += 1
        micros[name] += e.device_time_total if cuda else e.cpu_time_total
    total = sum(micros.values())
    table = [{"kernel": n, "per_call": count[n] / calls, "us_per_call": micros[n] / calls,
              "share": micros[n] / total if total else 0.0} for n, _ in micros.most_common(top)]
    return total / calls, table


def profile_shape(spec: str, iters: int, warmup: int, cuda: bool) -> list[dict]:
    from ssmspec.bench.kernels import mamba_ssm_ops
    from ssmspec.bench.ssd_grad import mamba_call, ours_call
    from ssmspec.bench.ssd_grad_sweep import fwdbwd, inputs, shape_of
    from torch.profiler import ProfilerActivity, profile

    name, z, bsz, L = shape_of(spec)
    dtype = torch.bfloat16 if cuda else torch.float32
    i = inputs(z, bsz, L, dtype, "cuda" if cuda else "cpu")
    calls = {"ours": ours_call(i, "triton")}
    rows = []
    _, chunk, why = mamba_ssm_ops() if cuda else (None, None, "no CUDA")
    if chunk is None or bsz * L * z["H"] * z["P"] >= 2 ** 31:
        reason = why if chunk is None else "x has >= 2^31 elements (mamba_ssm's 32-bit offsets)"
        rows.append(dict(shape=spec, impl="mamba_ssm", status="skipped", reason=str(reason)[:200]))
    else:
        calls["mamba_ssm"] = mamba_call(chunk, i, 256)
    for impl, call in calls.items():
        for _ in range(warmup):
            fwdbwd(i, call)
        if cuda:
            torch.cuda.synchronize()
        acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            for _ in range(iters):
                fwdbwd(i, call)
            if cuda:
                torch.cuda.synchronize()
        us, table = kernel_table(prof.events(), iters, cuda=cuda)
        rows.append(dict(shape=spec, impl=impl, status="ok", iters=iters, us_per_call=us, kernels=table,
                         device=torch.cuda.get_device_name() if cuda else "cpu (interpreter)"))
    return rows


def report(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"== {r['shape']} {r['impl']}: skipped ({r['reason']})")
            continue
        lines.append(f"== {r['shape']} {r['impl']} ({r['device']}): {r['us_per_call'] / 1e3:.3f} ms of kernels "
                     f"per forward + backward")
        lines += [f"  {k['us_per_call']:10.1f} us {k['share']:6.1%}  x{k['per_call']:g}  {k['kernel']}"
                  for k in r["kernels"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", help="mixer:batch:seqlen (default: seed004:16:32768, or tiny on CPU)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU interpreter")
    p.add_argument("--iters", type=int, default=None, help="profiled calls (default 5; 1 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="calls before (default 3; 1 with --tiny)")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.tiny
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' first import
    iters = a.iters if a.iters is not None else (5 if cuda else 1)
    warmup = a.warmup if a.warmup is not None else (3 if cuda else 1)
    if iters < 1 or warmup < 0:
        raise SystemExit(f"error: --iters must be >= 1 and --warmup >= 0 (got {iters}, {warmup})")
    rows = []
    for spec in a.shapes or (GPU_SHAPES if cuda else TINY):
        if spec.count(":") != 2:
            raise SystemExit(f"error: shape {spec!r} is not mixer:batch:seqlen (e.g. seed004:16:32768)")
        rows += profile_shape(spec, iters, warmup, cuda)
    print(report(rows), flush=True)
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, a.json)
    return rows


if __name__ == "__main__":
    main()
