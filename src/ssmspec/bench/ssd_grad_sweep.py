"""Launch-option sweep of the trainable SSD scan (``ops/ssd_grad``): forward + backward time per configuration.

    python -m ssmspec.bench.ssd_grad_sweep                  # GPU: seed004, nemotron-h-4b, mamba2-2.7b at 8K, 32K
    python -m ssmspec.bench.ssd_grad_sweep --shapes seed004:16:32768 --iters 10
    TRITON_INTERPRET=1 python -m ssmspec.bench.ssd_grad_sweep --tiny   # CPU smoke (set automatically without CUDA)

On the first shape of each mixer (mixer:batch:seqlen; a mixer is ``seed004`` or a model preset,
``bench/ssd.py:mixer``) a coordinate descent over groups of launch options (``STAGES``): each stage times every
variant of its group on top of the best configuration so far and keeps the fastest, starting from
``default_launch``; so a shape costs about 30 timings, not the product of the groups. The mixer's other shapes
(other lengths) time their defaults and the three fastest changes found there, on top of their own defaults:
every new combination of compile-time options compiles its kernels (seconds each), and these reuse them. Each timing is the median of ``--iters`` calls of forward + ``torch.autograd.grad`` for
every input (bf16 x, B, C, fp32 dt and an fp32 initial state, as ``bench/ssd.py:scan_inputs``) after ``--warmup``
calls, CUDA events around each call (perf_counter on CPU). A variant that the GPU cannot hold (OutOfResources) or
that runs out of memory is a row marked ``failed``; with ``--check`` each variant's dx, dB, dC, d dt on a strided
subset of tokens are compared with the defaults' (norm-relative; a row over 2e-2 bf16 / 1e-3 fp32 is marked BAD).
With ``--baseline``, mamba_ssm's ``mamba_chunk_scan_combined`` is timed too where it imports and x has fewer than
2^31 elements (its 32-bit offsets, see ``bench/ssd_grad.py``); off by default, as its autotuner's first calls alone
take minutes (``experiment=ssd_kernel_fwdbwd`` is the comparison). Prints one table and, per shape, the best
configuration as a ``LAUNCH_KEYS`` dict; ``--json`` writes every row. ``--time-limit`` (seconds, 195 by default) is
shared out equally over the mixers: a shape past its share times no further variant (its best so far is reported),
so a run ends within about 4 minutes, compiles included (Triton's cache makes a second run on a machine faster).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

TINY = ["tiny:1:40"]  # tiny: H=2, P=16, N=16, G=1 (interpreter)
GPU_SHAPES = [f"{m}:16:{L}" for m in ("seed004", "nemotron-h-4b", "mamba2-2.7b") for L in (32768, 8192)]
GRAD_KEYS = ("x", "dt", "A", "B", "C", "D", "s0")


STAGES = ("dx tile x warps", "dB/dC tile x warps", "checkpoints", "state dtype", "heads a program", "dS pass",
          "stages", "forward")


def variants(stage: str, d: dict, z: dict, tiny: bool) -> list[dict]:
    """The variants of one option group (dicts of ``LAUNCH_KEYS``) on top of ``d``, the best configuration so
    far (``merge`` keeps the checkpoints whole multiples of the tiles). Kept short: every new combination of
    compile-time options compiles (seconds each)."""
    hpg, m = z["H"] // z["G"], max(d["block_t"], d["bc_block_t"])
    if tiny:  # the interpreter: a few variants that still cross every code path
        return {"dx tile x warps": [dict(fwd_block_t=16, block_t=16, bc_block_t=16, checkpoint=32, dcheckpoint=32,
                                         pass_block_t=16), dict(block_t=32, num_warps=2, bc_block_t=32)],
                "heads a program": [dict(heads_per_program=1, bc_atomic=a) for a in (0, 1)] if hpg > 1 else [],
                }.get(stage, [])
    if stage == "dx tile x warps":  # (32, 4) and (64, 8) spill least (ptxas, sm_90)
        return [dict(block_t=t, num_warps=w) for t, w in ((32, 4), (32, 8), (64, 4), (64, 8), (128, 8))]
    if stage == "dB/dC tile x warps":
        return [dict(bc_block_t=t, bc_num_warps=w) for t, w in ((32, 8), (64, 4), (64, 8), (128, 8))]
    if stage == "checkpoints":  # the states' and dS states' spacing: memory and bandwidth against replay
        return [dict(fwd_block_t=64, fwd_num_warps=4, checkpoint=max(64, m), dcheckpoint=max(64, m)),
                dict(checkpoint=max(128, m), dcheckpoint=m), dict(checkpoint=max(128, m), dcheckpoint=max(128, m)),
                dict(checkpoint=max(256, m), dcheckpoint=max(128, m))]
    if stage == "state dtype":
        return [dict(state_bf16=b) for b in (0, 1)]
    if stage == "heads a program":
        sizes = sorted({h for h in (1, 2, hpg // 2, hpg) if h >= 1 and hpg % h == 0})
        return [dict(heads_per_program=h, bc_atomic=a) for h in sizes for a in ((0, 1) if h < hpg else (0,))
                if h >= hpg // 4 or h == 1]
    if stage == "stages":
        return [dict(num_stages=s) for s in (1, 2)]
    if stage == "forward":  # the forward's tile, P block (more programs, C·Bᵀ made again per block) and warps
        return [dict(fwd_block_t=t, fwd_block_p=p, fwd_num_warps=w) for t, p, w in ((128, 64, 8), (128, 32, 8),
                                                                                    (64, 32, 4), (64, 64, 4))]
    grid = ((64, 16, 4), (128, 16, 4), (128, 32, 4), (256, 16, 4), (128, 64, 8)) if z["N"] <= 64 else \
        ((64, 64, 8), (64, 32, 8), (128, 32, 8), (64, 16, 4), (128, 16, 4))  # (tile, P block, warps) that spill little
    return [dict(pass_block_t=t, block_p=p, pass_num_warps=w) for t, p, w in grid]  # the dS pass


def merge(best: dict, v: dict) -> dict:
    """``best`` with ``v`` on top, the checkpoints raised to whole multiples of the tiles ``v`` sets (all powers of
    two) and the dS pass's tile lowered to divide dcheckpoint, unless ``v`` sets them itself."""
    o = {**best, **v}
    if "checkpoint" not in v:
        o["checkpoint"] = max(o["checkpoint"], o["fwd_block_t"], o["block_t"], o["bc_block_t"])
    if "dcheckpoint" not in v:
        o["dcheckpoint"] = max(o["dcheckpoint"], o["block_t"], o["bc_block_t"])
    if "pass_block_t" not in v:
        o["pass_block_t"] = min(o["pass_block_t"], o["dcheckpoint"] & -o["dcheckpoint"])
    o["pass_block_t"] = min(o["pass_block_t"], o["dcheckpoint"])
    return o


def shape_of(spec: str) -> tuple[str, dict, int, int]:
    name, bsz, L = spec.split(":")
    if name == "tiny":
        z = dict(H=2, P=16, N=16, G=1)
    else:
        from ssmspec.bench.ssd import mixer
        z = mixer(name)
    return name, z, int(bsz), int(L)


def inputs(z: dict, bsz: int, L: int, dtype, device: str) -> dict:
    from ssmspec.bench.ssd import scan_inputs
    inp = scan_inputs(bsz, L, z, dtype, device, initial_state=True)
    leaves = {k: inp[k].detach().clone().requires_grad_() for k in GRAD_KEYS}
    g = torch.Generator(device=device).manual_seed(1)  # the upstream gradients too: every run sweeps one draw
    leaves["dy"] = torch.empty_like(inp["x"]).normal_(generator=g)
    leaves["dfinal"] = torch.empty_like(inp["s0"]).normal_(generator=g)
    return leaves


def fwdbwd(i: dict, call):
    with torch.enable_grad():
        y, s = call()
        return torch.autograd.grad((y, s), [i[k] for k in GRAD_KEYS], (i["dy"], i["dfinal"]))


def timed(fn, iters: int, warmup: int, cuda: bool) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def sample(grads, step: int) -> dict:
    """dx, d dt, dB, dC (and the small ones) on every ``step``-th token, fp32."""
    return {k: (g[:, ::step] if k in ("x", "dt", "B", "C") else g).float().clone() for k, g in zip(GRAD_KEYS, grads)}


def run_shape(spec: str, a, cuda: bool, deadline: float, diffs: list[dict] | None = None) -> list[dict]:
    """The descent over ``STAGES`` on one shape; with ``diffs`` (option changes found on another length of the same
    mixer) instead the defaults and each of them on top of this shape's defaults."""
    from ssmspec.ops.ssd_grad.triton import _sm_count, default_launch, ssd_chunk_scan_grad_triton
    name, z, bsz, L = shape_of(spec)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    dev = "cuda" if cuda else "cpu"
    i = inputs(z, bsz, L, dtype, dev)
    base = default_launch(L, z["P"], z["N"], itemsize=dtype.itemsize, chains=bsz * z["H"], heads=z["H"],
                          groups=z["G"], bf16=dtype == torch.bfloat16, sms=_sm_count(torch.device(dev)))
    step = max(1, (bsz * L * z["H"] * z["P"]) >> 22)
    rows, ref = [], None

    def measure(stage: str, opts: dict) -> dict:
        nonlocal ref
        row = dict(shape=spec, stage=stage, **{k: opts[k] for k in sorted(opts)})

        def call():
            return ssd_chunk_scan_grad_triton(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], initial_state=i["s0"],
                                              **opts)
        try:
            g = fwdbwd(i, call)
            if a.check:
                got = sample(g, step)
                if ref is None:
                    ref = got
                row["rel_err"] = max(((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item() for k in ref)
                row["bad"] = row["rel_err"] >= a.tol
            del g
            row["ms"] = statistics.median(timed(lambda: fwdbwd(i, call), a.iters, a.warmup, cuda))
        except Exception as e:  # noqa: BLE001 -- resource failures are rows, anything else is re-raised
            if type(e).__name__ not in ("OutOfResources", "OutOfMemoryError", "ValueError"):
                raise
            row.update(ms=None, failed=f"{type(e).__name__}: {str(e)[:80]}")
            if cuda:
                torch.cuda.empty_cache()
        rows.append(row)
        return row

    best_opts = dict(base)
    best = measure("default", best_opts)
    for v in diffs or []:
        opts = merge(base, v)
        if opts != base and time.monotonic() < deadline:
            row = measure("best elsewhere", opts)
            if cost(row) < cost(best):
                best, best_opts = row, opts
    for stage in STAGES if diffs is None else ():
        if time.monotonic() > deadline:
            print(f"# {spec}: time limit reached before stage {stage!r}", file=sys.stderr)
            break
        for v in variants(stage, best_opts, z, a.tiny):
            opts = merge(best_opts, v)
            if opts == best_opts:
                continue
            if time.monotonic() > deadline:
                print(f"# {spec}: time limit reached inside stage {stage!r}", file=sys.stderr)
                break
            row = measure(stage, opts)
            if cost(row) < cost(best):
                best, best_opts = row, opts
    rows.append(dict(shape=spec, stage="best", ms=best["ms"], **{k: best_opts[k] for k in sorted(best_opts)},
                     speedup_over_default=rows[0]["ms"] / best["ms"] if rows[0]["ms"] and best["ms"] else None))
    rows.extend(baseline(spec, i, z, bsz, L, a, cuda))
    i.clear()  # the inputs' memory goes before the next shape's
    if cuda:
        torch.cuda.empty_cache()
    return rows


def top_diffs(rows: list[dict], k: int = 3) -> list[dict]:
    """The option changes (against the shape's defaults) of the ``k`` fastest distinct configurations timed."""
    keys = [c for c in rows[0] if c in KEYS]
    out = []
    for r in sorted((r for r in rows if r["stage"] not in ("best", "mamba_ssm")), key=cost):
        d = {c: r[c] for c in keys if r[c] != rows[0][c]}
        if cost(r) < float("inf") and d and d not in out:
            out.append(d)
    return out[:k]


def cost(row: dict) -> float:
    """A row's time for the descent: failed or wrong rows never win."""
    return float("inf") if row.get("ms") is None or row.get("bad") else row["ms"]


def baseline(spec: str, i: dict, z: dict, bsz: int, L: int, a, cuda: bool) -> list[dict]:
    if not cuda or not a.baseline or bsz * L * z["H"] * z["P"] >= 2 ** 31:
        return []
    from ssmspec.bench.kernels import mamba_ssm_ops
    _, chunk, why = mamba_ssm_ops()
    if chunk is None:
        return [dict(shape=spec, stage="mamba_ssm", ms=None, failed=why[:80])]

    def call():
        return chunk(i["x"], i["dt"], i["A"], i["B"], i["C"], chunk_size=256, D=i["D"], initial_states=i["s0"],
                     dt_softplus=False, return_final_states=True)
    return [dict(shape=spec, stage="mamba_ssm", ms=statistics.median(timed(lambda: fwdbwd(i, call), a.iters,
                                                                               a.warmup, cuda)))]


def report(rows: list[dict]) -> str:
    """The table (ms and the options that differ from the shape's defaults) and the best config per shape."""
    lines = []
    for spec in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == spec]
        d = rs[0]
        mamba = next((r["ms"] for r in rs if r["stage"] == "mamba_ssm"), None)
        theirs = f"{mamba:.3f} ms" if mamba else "not run"
        lines.append(f"== {spec}  (defaults: {fmt(d, {})})  mamba_ssm fwd+bwd: {theirs}")
        for r in rs:
            if r["stage"] in ("best", "mamba_ssm"):
                continue
            err = f"  rel_err {r['rel_err']:.1e}" if "rel_err" in r else ""
            flag = "  BAD" if r.get("bad") else ""
            lines.append(f"  {r['stage']:18s} {ms(r['ms'])}  {fmt(r, d) or '(defaults)'}{err}{flag}"
                         f"{'  ' + r['failed'] if 'failed' in r else ''}")
        b = next(r for r in rs if r["stage"] == "best")
        vs = f", {mamba / b['ms']:.2f}x mamba_ssm" if mamba and b["ms"] else ""
        gain = f"{b['speedup_over_default']:.2f}x" if b["speedup_over_default"] else "n/a"
        lines.append(f"  BEST {ms(b['ms'])} ({gain} the defaults{vs}): "
                     f"{ {k: b[k] for k in KEYS if k in b} }")
    return "\n".join(lines)


KEYS: tuple = ()  # LAUNCH_KEYS, once the kernels' module is imported (after TRITON_INTERPRET is set)


def ms(v) -> str:
    return f"{v:10.3f} ms" if v is not None else "    failed   "


def fmt(r: dict, d: dict) -> str:
    return " ".join(f"{k}={r[k]}" for k in KEYS if k in r and (not d or r[k] != d.get(k)))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", help="mixer:batch:seqlen (default: the GPU grid, or a tiny shape on CPU)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape and few variants (the CPU interpreter)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--baseline", action="store_true", help="also time mamba_ssm (its autotuning takes minutes)")
    p.add_argument("--time-limit", type=float, default=195.0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    a.tiny = a.tiny or not cuda
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' first import
    a.iters = a.iters or (1 if a.tiny else 3)
    a.warmup = a.warmup if a.warmup is not None else (0 if a.tiny else 1)
    a.tol = 2e-2 if a.dtype == "bf16" else 1e-3
    from ssmspec.ops.ssd_grad.triton import LAUNCH_KEYS
    global KEYS
    KEYS = LAUNCH_KEYS
    end = time.monotonic() + a.time_limit
    rows = []
    groups: dict[str, list[str]] = {}  # mixer -> its shapes: the first gets the descent, the others re-time it
    for spec in a.shapes or (TINY if a.tiny else GPU_SHAPES):
        groups.setdefault(spec.split(":")[0], []).append(spec)
    for k, specs in enumerate(groups.values()):  # each mixer an equal share of the time left, a fifth to re-time
        share = (end - time.monotonic()) / (len(groups) - k)
        rows.extend(run_shape(specs[0], a, cuda, time.monotonic() + share * (0.8 if specs[1:] else 1.0)))
        print(report([r for r in rows if r["shape"] == specs[0]]), flush=True)
        diffs = top_diffs([r for r in rows if r["shape"] == specs[0]])
        for j, spec in enumerate(specs[1:]):
            rows.extend(run_shape(spec, a, cuda, time.monotonic() + (end - time.monotonic()) / (len(groups) - k)
                                  / (len(specs) - 1 - j), diffs))
            print(report([r for r in rows if r["shape"] == spec]), flush=True)
    print("\n== best configuration per shape (ms forward + backward; options that differ from the defaults)")
    for r in rows:
        if r["stage"] == "best":
            d = next(x for x in rows if x["shape"] == r["shape"] and x["stage"] == "default")
            print(f"  {r['shape']:24s} {ms(r['ms'])}  {fmt(r, d) or '(defaults)'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
