"""Launch-option sweep of the packed tree scan (``ops/tree_scan/triton.py``) against the unrolled paths that share
one state read, the comparison of raised goal P8 (``stree_fig3_tree_forward``: the packed form at depth 6 no
slower than ``unrolled_shared``).

    python -m ssmspec.bench.tree_scan_sweep                       # GPU: mamba2-2.7b mixer, batch 1, depths 4-6
    python -m ssmspec.bench.tree_scan_sweep --presets mamba2-2.7b nemotron-h-4b --batch 1 4 --iters 200
    TRITON_INTERPRET=1 python -m ssmspec.bench.tree_scan_sweep --tiny   # CPU smoke (set automatically without CUDA)

Per (preset, batch, depth) of full binary trees (``bench/tree.py:full_binary_tree``): ``unrolled_shared`` and the
packed scan at its defaults are timed, then a coordinate descent over the option groups of ``scan_launch``
(``STAGES``: the readout's precision, its steps over the state width, P columns a program x warps), each group's
variants timed on top of the best configuration so far, the fastest kept. Times are as in ``stree_fig3``: a CUDA
graph of ``rot`` calls, each on its own copy of the committed state so that together they exceed 4x L2, timed
with CUDA events, ``--iters`` replays after ``--warmup`` (eager ``perf_counter`` on CPU, where the interpreter
runs: a smoke test of the options, not a timing). Every variant's y is compared with the y of the defaults
with an exact fp32 readout (norm-relative difference; over 1e-2 the row is marked BAD and never chosen), a
variant the GPU cannot hold (OutOfResources) is a ``failed`` row and one ``scan_launch`` refuses (bad values,
or the launch Triton 3.6 miscompiles) a ``refused`` row. Prints one table and, per point, the best configuration as the keyword
arguments of ``tree_scan_triton``; ``--json`` writes every row.

On CUDA every measurement runs in a process of its own (``--isolate``, the default there): a launch that faults
(an illegal memory access poisons the CUDA context of its process, and the first GPU sweep died of one) is a
``crashed`` row with the child's last error line, and the descent goes on. ``--no-isolate`` measures in this
process (the interpreter's default: one import instead of one per variant).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

STAGES = ("readout precision", "readout steps", "P block x warps")
BAD_REL = 1e-2  # a variant's y further than this (norm-relative) from the exact readout's is wrong, not rounded


def variants(stage: str, best: dict, N: int, tiny: bool) -> list[dict]:
    """The variants of one option group on top of ``best`` (``scan_launch`` keywords)."""
    if tiny:  # the interpreter: one variant of each group still crosses every code path
        return {"readout precision": [dict(readout="tf32x3")], "readout steps": [dict(readout_block=16)],
                "P block x warps": [dict(block_p=16, num_warps=8)]}[stage]
    if stage == "readout precision":  # the defaults' is tf32 for the bf16 inputs of the GPU sweep
        return [dict(readout=r) for r in ("ieee", "tf32x3")]
    if stage == "readout steps":
        bn = max(16, 1 << (N - 1).bit_length())
        return [dict(readout_block=r) for r in (16, 32, 64) if r < bn]
    return [dict(block_p=p, num_warps=w) for p, w in ((64, 4), (64, 8), (32, 4), (32, 8), (16, 4), (16, 2))]


def timed(fn, rot: int, a, cuda: bool) -> list[float]:
    from ssmspec.bench.timing import time_cuda_graph, time_eager

    if cuda:
        return [s / rot for s in time_cuda_graph(fn, warmup=a.warmup, iters=a.iters)]
    return time_eager(fn, warmup=a.warmup, iters=a.iters, device="cpu")


def run_point(preset: str, bsz: int, depth: int, a, cuda: bool) -> list[dict]:
    """The rows of one (preset, batch, depth): unrolled_shared, the packed defaults, then the descent."""
    measure = (lambda launch, impl="packed": isolated(preset, bsz, depth, impl, launch, a)) if a.isolate else \
        Point(preset, bsz, depth, a, cuda).measure
    rows = [measure(None, "unrolled_shared")]
    best = measure({})
    rows.append(best)
    for stage in STAGES:
        for v in variants(stage, best["launch"], Point.state_width(preset), a.tiny):
            row = measure({**best["launch"], **v})
            rows.append(row)
            if row["status"] == "ok" and (best["status"] != "ok" or row["ms"] < best["ms"]):
                best = row
    rows.append(dict(best, impl="packed-best"))
    return rows


def isolated(preset: str, bsz: int, depth: int, impl: str, launch: dict | None, a) -> dict:
    """One measurement in a child process (``--one``): its row, or a ``crashed`` row with its last error line."""
    spec = dict(preset=preset, batch=bsz, depth=depth, impl=impl, launch=launch)
    argv = [sys.executable, "-m", "ssmspec.bench.tree_scan_sweep", "--one", json.dumps(spec),
            "--iters", str(a.iters), "--warmup", str(a.warmup)] + (["--tiny"] if a.tiny else [])
    out = subprocess.run(argv, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    err = [ln.strip() for ln in (out.stderr + out.stdout).splitlines() if ln.strip()]
    reason = next((ln for ln in reversed(err) if "Error" in ln or ln.startswith("error")), err[-1] if err else "")
    return dict(model=preset, batch=bsz, depth=depth, impl=impl, launch=dict(launch or {}), ms=None, rel=None,
                status="crashed", reason=f"exit {out.returncode}: {reason[:160]}")


class Point:
    """The inputs of one (preset, batch, depth) and the measurement of a launch on them."""

    @staticmethod
    def state_width(preset: str) -> int:
        from ssmspec.bench.kernels import mixer_sizes

        return mixer_sizes(preset)["N"]

    def __init__(self, preset: str, bsz: int, depth: int, a, cuda: bool) -> None:
        import math

        from ssmspec.bench.kernels import make_inputs, mixer_sizes, random_states, state_bytes
        from ssmspec.bench.tree import full_binary_tree

        torch.manual_seed(0)  # every process of an isolated sweep times the same inputs
        device = "cuda" if cuda else "cpu"
        z = mixer_sizes(preset)
        H, P, N = z["H"], z["P"], z["N"]
        self.mask, self.paths, self.first = full_binary_tree(depth, bsz, device)
        n = self.mask.shape[-1]
        dtype = torch.bfloat16 if cuda else torch.float32
        self.inp = make_inputs(bsz, n, H, P, z["G"], N, dtype, device)
        l2 = torch.cuda.get_device_properties(device).L2_cache_size if cuda else 0
        self.rot = max(1, min(256, math.ceil(4 * l2 / state_bytes(bsz, H, P, N)))) if cuda else 1
        self.states = random_states(self.rot, (bsz, H, P, N), device)
        self.base = dict(model=preset, batch=bsz, depth=depth, nodes=n, rot=self.rot)
        self.a, self.cuda = a, cuda
        self._ref = None  # the y of the defaults with readout ieee, what every launch is compared with

    def packed(self, launch: dict, st: torch.Tensor) -> torch.Tensor:
        from ssmspec.ops.tree_scan.triton import tree_scan_triton

        i = self.inp
        return tree_scan_triton(st, i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], tree_mask=self.mask,
                                dt_bias=i["dt_bias"], dt_softplus=True, **launch)

    def measure(self, launch: dict | None, impl: str = "packed") -> dict:
        """The row of ``launch`` (``impl`` packed) or of the unrolled paths sharing one state read (launch None)."""
        from ssmspec.bench.kernels import chain
        from ssmspec.bench.tree import _form

        if impl == "unrolled_shared":
            fn = chain([_form("unrolled_shared", s, self.inp, self.mask, self.paths, self.first, None, 0, [])
                        for s in self.states])
            fn()
            ms = statistics.median(timed(fn, self.rot, self.a, self.cuda))
            return dict(self.base, impl=impl, launch={}, ms=ms, rel=None, status="ok")
        row = dict(self.base, impl="packed", launch=dict(launch))
        try:
            if self._ref is None:  # exact fp32 products in the readout
                self._ref = self.packed({"readout": "ieee"}, self.states[0]).float()
            y = self.packed(launch, self.states[0]).float()
            rel = float((y - self._ref).norm() / self._ref.norm().clamp_min(1e-30))
            fns = [lambda s=s: self.packed(launch, s) for s in self.states]
            row.update(ms=statistics.median(timed(chain(fns), self.rot, self.a, self.cuda)), rel=rel,
                       status="ok" if rel <= BAD_REL else "BAD")
        except ValueError as e:  # a launch scan_launch refuses (one Triton miscompiles)
            row.update(ms=None, rel=None, status="refused", reason=str(e).splitlines()[0][:160])
        except Exception as e:  # noqa: BLE001 - OutOfResources (shared memory, registers) or out of memory
            if not ("OutOfResources" in type(e).__name__ or isinstance(e, torch.cuda.OutOfMemoryError)):
                raise
            row.update(ms=None, rel=None, status="failed", reason=str(e).splitlines()[0][:120])
        return row


def report(rows: list[dict]) -> str:
    out = [f"{'model':<14} {'B':>3} {'depth':>5} {'impl':<16} {'ms':>9} {'vs shared':>9} {'rel':>8}  launch"]
    shared = {}
    for r in rows:
        key = (r["model"], r["batch"], r["depth"])
        if r["impl"] == "unrolled_shared":
            shared[key] = r["ms"]
        ratio = f"{shared[key] / r['ms']:.2f}x" if r.get("ms") and key in shared else "-"
        ms = f"{r['ms']:.4f}" if r.get("ms") is not None else r["status"]
        rel = f"{r['rel']:.1e}" if r.get("rel") is not None else "-"
        flag = "" if r["status"] == "ok" else f"  [{r['status']}]"
        out.append(f"{r['model']:<14} {r['batch']:>3} {r['depth']:>5} {r['impl']:<16} {ms:>9} {ratio:>9} {rel:>8}  "
                   f"{r['launch']}{flag}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="*", default=None, help="model presets whose Mamba-2 mixer is swept")
    p.add_argument("--batch", nargs="*", type=int, default=[1])
    p.add_argument("--depth", nargs="*", type=int, default=None, help="full binary tree depths (default 4 5 6)")
    p.add_argument("--tiny", action="store_true", help="tiny-mamba2, depth 4, one variant a group (interpreter)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="each measurement in a process of its own (default: on CUDA)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child of --isolate: one measurement
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.tiny
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        if "ssmspec.ops.tree_scan.triton" in sys.modules:
            raise SystemExit("error: no CUDA here; run with TRITON_INTERPRET=1 set before ssmspec's Triton modules "
                             "are imported (python -m ssmspec.bench.tree_scan_sweep --tiny sets it itself)")
        os.environ["TRITON_INTERPRET"] = "1"
    if not cuda:
        a.tiny = True
    a.presets = a.presets or (["tiny-mamba2"] if a.tiny else ["mamba2-2.7b"])
    a.depth = a.depth or ([4] if a.tiny else [4, 5, 6])
    a.iters = a.iters or (1 if a.tiny else 100)
    a.warmup = a.warmup if a.warmup is not None else (0 if a.tiny else 5)
    a.isolate = cuda if a.isolate is None else a.isolate
    if a.one is not None:  # the child: one row as the last line of stdout
        spec = json.loads(a.one)
        with torch.no_grad():
            row = Point(spec["preset"], spec["batch"], spec["depth"], a, cuda).measure(spec["launch"], spec["impl"])
        print(json.dumps(row))
        return [row]
    rows = []
    with torch.no_grad():
        for preset in a.presets:
            for bsz in a.batch:
                for depth in a.depth:
                    rows += run_point(preset, bsz, depth, a, cuda)
    print(report(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
