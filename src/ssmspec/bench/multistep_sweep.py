"""Launch-option sweep of the fused multi-step update (``ops/multistep/triton.py``) at the point of goal P3
(``snl_tab1_kernels``: L = 10 tokens at batch 16, the fused kernel at least 2.5x mamba_ssm's chunk scan).

    python -m ssmspec.bench.multistep_sweep --out multistep_sweep.jsonl   # GPU: both mixers, batch 16 and 256
    python -m ssmspec.bench.multistep_sweep --presets nemotron-h-4b --batch 16 --iters 50 --out rows.jsonl
    python -m ssmspec.bench.multistep_sweep --tiny --out rows.jsonl        # CPU smoke under the interpreter

Per (preset, batch): every launch of block_p {8, 16, 32} x num_warps {1, 2, 4} x prefetch {off, on} x
num_stages {1, 2} (36), then mamba_ssm's chunk scan where it imports. Each is timed as ``snl_tab1_kernels``
times it, through the same calls (``bench/kernels.py``: ``Ctx.time``, ``fused_fn``, ``chunk_scan_fn``): a CUDA
graph of ``rot`` calls, each on its own copy of the state so that together they exceed 4x L2, timed with CUDA
events over ``--iters`` replays after ``--warmup``; rows carry the raw samples, ms_p50 / p20 / p80 and the HBM
fraction. Inputs are bf16 on the GPU (fp32 under the interpreter), the state fp32.

Before it is timed, each launch runs once from one fixed state: ``rel`` is the norm-relative difference of its y
from the default launch's (the kernel's own choice at that batch on that GPU, ``default_launch``: prefetch is on
for a small grid; block_p and num_warps change the order of the y = S C reduction, so rounding moves), and
``same_bits`` says whether y and the state equal, bit for bit, those of the same blocks with neither prefetch nor
stages -- those two only move loads, so False is a bug: the row is ``BAD``, as is one with ``rel`` over 1e-2. A
launch the GPU cannot hold (OutOfResources) is a ``failed`` row. Prints one table per point, fastest first, with
each launch's time against the default launch and the chunk scan; ``--out`` writes every row as a JSON line.

``--tiny`` (the default without CUDA) runs the tiny-mamba2 mixer, 2 tokens at batch 1, over a reduced grid under
the CPU interpreter (TRITON_INTERPRET=1, set here before the kernels are imported): a smoke test of the options
and of the rows, not a timing.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

GRID = dict(block_p=(8, 16, 32), num_warps=(1, 2, 4), prefetch=(False, True), num_stages=(1, 2))
# the interpreter ignores warps and stages; block_p 32 > P = 16 of tiny-mamba2 masks half the rows of a program
TINY_GRID = dict(block_p=(16, 32), num_warps=(1,), prefetch=(False, True), num_stages=(1, 2))
BAD_REL = 1e-2  # a launch's y further than this (norm-relative) from the default launch's is wrong, not rounded


def launches(grid: dict) -> list[dict]:
    """Every combination of ``grid`` (keyword arguments of ``ssm_multistep_triton``), each (block_p, num_warps)
    first without prefetch and stages: the launch its variants must match bit for bit."""
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def default_launch(bsz: int, L: int, H: int, P: int, N: int, device) -> dict:
    """The launch ``ssm_multistep_triton`` takes when given no option, on ``device`` (its SM count decides
    prefetch: ``ops/multistep/triton.py:_default_prefetch``), as a row of ``launches``."""
    from ssmspec.ops.multistep.triton import default_launch as kernel_default
    from ssmspec.ops.multistep.triton import sm_count

    d = kernel_default(bsz, L, H, P, N, sm_count(device))
    return dict(block_p=d["block_p"], num_warps=d["num_warps"], prefetch=d["prefetch"], num_stages=1)


def run_point(ctx, preset: str, bsz: int, L: int, grid: dict, a) -> list[dict]:
    """The rows of one (preset, batch): every launch of ``grid``, then the chunk scan (or its skipped row)."""
    from ssmspec.bench.kernels import (chain, chunk_scan_fn, fused_fn, io_bytes, make_inputs, mamba_ssm_ops,
                                       mixer_sizes, random_states, state_bytes)

    z = mixer_sizes(preset)
    H, P, N, G = z["H"], z["P"], z["N"], z["G"]
    inp = make_inputs(bsz, L, H, P, G, N, ctx.dtype, ctx.device)
    sb = state_bytes(bsz, H, P, N)
    rot = ctx.rotation(sb)
    nbytes = 2 * sb + io_bytes(bsz, L, H, P, G, N, ctx.dtype.itemsize)
    base = dict(model=preset, batch=bsz, L=L, H=H, P=P, N=N, G=G, rot=rot)
    s0 = random_states(1, (bsz, H, P, N), ctx.device)[0]

    def once(launch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        st = s0.clone()
        return fused_fn(st, inp, **launch)(), st

    default = default_launch(bsz, L, H, P, N, ctx.device)
    y_default = once(default)[0].float()
    plain = (None, None, None)  # (block_p, num_warps) of the group so far, its y and state without prefetch, stages
    states = random_states(rot, (bsz, H, P, N), ctx.device)
    rows = []
    for launch in launches(grid):
        fields = dict(base, impl="fused", **launch, default=launch == default)
        try:
            y, st = once(launch)
            if plain[0] != (launch["block_p"], launch["num_warps"]):  # a group's first launch is its plain one
                plain = ((launch["block_p"], launch["num_warps"]), y, st)
            same = torch.equal(y, plain[1]) and torch.equal(st, plain[2])
            rel = float((y.float() - y_default).norm() / y_default.norm().clamp_min(1e-30))
            samples = ctx.time(chain([fused_fn(s, inp, **launch) for s in states]), per_call=rot)
            row = ctx.row(samples, nbytes, **fields, rel=rel, same_bits=same)
            if not same or rel > BAD_REL:
                row["status"] = "BAD"
        except Exception as e:  # noqa: BLE001 -- a launch the GPU cannot hold is a row; anything else is raised
            if type(e).__name__ != "OutOfResources":
                raise
            row = dict(fields, status="failed", reason=str(e).splitlines()[0][:120])
        rows.append(row)
    if a.baseline:
        _, chunk_m, why = mamba_ssm_ops()
        fields = dict(base, impl="chunk_scan_mamba_ssm", chunk_size=a.chunk_size)
        if chunk_m is None:
            rows.append(dict(fields, status="skipped", reason=why))
        else:
            samples = ctx.time(chain([chunk_scan_fn(chunk_m, s, inp, a.chunk_size) for s in states]), per_call=rot)
            rows.append(ctx.row(samples, nbytes, **fields))
    del states
    ctx.sync()
    return rows


def report(rows: list[dict]) -> str:
    """One table per (model, batch), fastest launch first; times in us."""
    out = []
    for key in dict.fromkeys((r["model"], r["batch"]) for r in rows):
        rs = [r for r in rows if (r["model"], r["batch"]) == key]
        ref = next((r["ms_p50"] for r in rs if r.get("default") and "ms_p50" in r), None)
        chunk = next((r for r in rs if r["impl"] == "chunk_scan_mamba_ssm"), None)
        theirs = "not timed" if chunk is None else f"{chunk['ms_p50'] * 1e3:.1f} us" if "ms_p50" in chunk else \
            f"{chunk['status']} ({chunk['reason'][:70]})"
        out.append(f"== {key[0]}, batch {key[1]}, L = {rs[0]['L']}: chunk scan {theirs}")
        out.append(f"  {'block_p':>7} {'warps':>5} {'prefetch':>8} {'stages':>6} {'us p50':>9} {'p20-p80':>15} "
                   f"{'vs default':>10} {'vs chunk':>8} {'rel':>8}")
        fused = sorted((r for r in rs if r["impl"] == "fused"), key=lambda r: r.get("ms_p50", float("inf")))
        for r in fused:
            if "ms_p50" not in r:
                out.append(f"  {r['block_p']:>7} {r['num_warps']:>5} {r['prefetch']!s:>8} {r['num_stages']:>6} "
                           f"  [{r['status']}: {r['reason']}]")
                continue
            us = r["ms_p50"] * 1e3
            spread = f"{r['ms_p20'] * 1e3:.1f}-{r['ms_p80'] * 1e3:.1f}"
            vs_default = f"{ref / r['ms_p50']:.2f}x" if ref else "-"
            vs_chunk = f"{chunk['ms_p50'] / r['ms_p50']:.2f}x" if chunk and "ms_p50" in chunk else "-"
            flags = ("  default" if r["default"] else "") + ("" if r["status"] == "ok" else f"  [{r['status']}]")
            out.append(f"  {r['block_p']:>7} {r['num_warps']:>5} {r['prefetch']!s:>8} {r['num_stages']:>6} "
                       f"{us:>9.1f} {spread:>15} {vs_default:>10} {vs_chunk:>8} {r['rel']:>8.1e}{flags}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="*", default=None, help="model presets whose Mamba-2 mixer is swept")
    p.add_argument("--batch", nargs="*", type=int, default=None, help="default 16 256")
    p.add_argument("--L", type=int, default=None, help="tokens a call (default 10)")
    p.add_argument("--tiny", action="store_true", help="tiny-mamba2, a reduced grid, the CPU interpreter")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--chunk-size", type=int, default=128, help="mamba_ssm's chunk size (snl_tab1_kernels')")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="time mamba_ssm's chunk scan too (where it imports)")
    p.add_argument("--out", default=None, help="write every row here, one JSON line each")
    a = p.parse_args(argv)
    a.tiny = a.tiny or not torch.cuda.is_available()
    if a.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        if "ssmspec.ops.multistep.triton" in sys.modules:
            raise SystemExit("error: --tiny runs under the interpreter; set TRITON_INTERPRET=1 before ssmspec's "
                             "Triton modules are imported (python -m ssmspec.bench.multistep_sweep --tiny sets it)")
        os.environ["TRITON_INTERPRET"] = "1"
    from omegaconf import OmegaConf

    from ssmspec.bench.kernels import Ctx

    presets = a.presets or (["tiny-mamba2"] if a.tiny else ["mamba2-2.7b", "nemotron-h-4b"])
    batches = a.batch or ([1] if a.tiny else [16, 256])
    L = a.L or (2 if a.tiny else 10)
    warmup = a.warmup if a.warmup is not None else (0 if a.tiny else 3)
    bench = dict(warmup=warmup, iters=a.iters or (1 if a.tiny else 20))  # snl_tab1_kernels' gpu profile
    ctx = Ctx(OmegaConf.create(dict(device="cpu" if a.tiny else "cuda", dtype="auto", bench=bench)))
    rows = []
    with torch.no_grad():
        for preset in presets:
            for bsz in batches:
                rows += run_point(ctx, preset, bsz, L, TINY_GRID if a.tiny else GRID, a)
                print(report([r for r in rows if (r["model"], r["batch"]) == (preset, bsz)]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
