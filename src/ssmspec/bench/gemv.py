"""Benchmark of the decode kernels of issue 26: ``decode_kernels``. Rows of kind ``gemv`` (the decode GEMVs of
``ops/gemv``, below) and of kind ``conv_ssm`` (one Mamba-2 mixer's decode conv + SSM update: fused, our two
kernels, causal-conv1d + mamba_ssm's two; ``bench/conv_ssm.py``), one per (model, batch, impl).

For every projection of a model preset's blocks (``layer_shapes``: Mamba-2 in_proj after the block's norm and
out_proj after the gated norm; attention q / k / v and the MLP's up_proj after the block's norm, o_proj and
down_proj alone) and every row count M (B' x L) of the grid, one row per ``impl``:
- ``ours``: ``linear_small`` (one Triton launch, W read once, no split-K);
- ``cublas``: ``F.linear`` (cuBLAS on CUDA, with its split-K reduce at these shapes);
- ``fused``: the norm and the projection in one launch (``add_rms_norm_linear`` / ``gated_norm_linear``; the
  projections no norm precedes have none);
- ``unfused``: the norm op (``ops/norm``, Triton on CUDA) then ``F.linear``, what the blocks ran before;
- ``copy``: a device-to-device copy of the weight's bytes, the same run's ceiling for streaming them.
Every time is a CUDA-graph replay timed with CUDA events (eager with perf_counter on CPU, where every op is its
twin): a graph holds ``rot`` calls, each on its own copy of the weight, ``rot`` chosen so the copies together
exceed 4x L2 (a 26 MB out_proj would otherwise be read from L2). ``gbps`` = weight bytes / median time (the
copy moves them twice: read and write, ``gbps`` counts both); ``copy_fraction`` = gbps / the copy's gbps of
the same shape; ``hbm_fraction`` against the 1 GiB copy of ``bench.timing.measure_hbm_bandwidth``. ``ours`` and
``fused`` carry ``speedup`` over ``cublas`` / ``unfused`` (same run) and, on CUDA, the blocks the kernel picked
(``config``) and the first call's wall time (``first_call_s``: compilation, untimed otherwise).
Goal (issue 26): ours >= 0.9 of copy bandwidth at M = 1..8.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from ssmspec.bench.kernels import Ctx
from ssmspec.models.config import load_preset
from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.gemv import add_rms_norm_linear, gated_norm_linear, linear_small
from ssmspec.ops.norm import add_rms_norm, gated_rms_norm



def layer_shapes(preset: str) -> list[dict]:
    """The projections of a preset's Mamba-2 / attention / MLP blocks: {layer, N, K, norm, group_size}, norm
    one of "add" (the block's add + RMSNorm precedes it), "gated" (Mamba-2's gated norm) or None."""
    c = load_preset(preset)
    d, kinds = c.d_model, set(c.pattern)
    rows = []
    if "M" in kinds:
        rows += [dict(layer="in_proj", N=c.in_proj_dim, K=d, norm="add"),
                 dict(layer="out_proj", N=d, K=c.d_inner, norm="gated", group_size=c.d_inner // c.n_groups)]
    if "*" in kinds:
        hd = c.attn_head_dim
        rows += [dict(layer="q_proj", N=c.n_heads * hd, K=d, norm="add"),
                 dict(layer="kv_proj", N=c.n_kv_heads * hd, K=d, norm="add"),
                 dict(layer="o_proj", N=d, K=c.n_heads * hd, norm=None)]
    if "-" in kinds:
        rows += [dict(layer="up_proj", N=c.d_ff, K=d, norm="add"), dict(layer="down_proj", N=d, K=c.d_ff, norm=None)]
    return [{"group_size": None, **r, "residual_in_fp32": c.residual_in_fp32} for r in rows]


def _inputs(shape: dict, m: int, rot: int, dtype, device, seed: int = 0) -> tuple[dict, list[torch.Tensor]]:
    """Activations for M rows (x, the residual stream, z, norm weight) and ``rot`` copies of the weight."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    N, K = shape["N"], shape["K"]

    def r(*s, scale=1.0, dt=dtype):
        return (torch.randn(*s, generator=g) * scale).to(device, dt)

    res_dt = torch.float32 if shape["residual_in_fp32"] else dtype
    act = dict(x=r(m, 1, K), residual=r(m, 1, K, dt=res_dt), z=r(m, 1, K), norm_weight=r(K, scale=0.2) + 1)
    return act, [r(N, K, scale=K ** -0.5) for _ in range(rot)]


def _impls(shape: dict, a: dict, backend: str) -> dict[str, Callable[[torch.Tensor], object]]:
    """impl -> a call on one weight copy, each baseline before the kernel it is compared with."""
    x, res, z, nw, eps, fp32 = a["x"], a["residual"], a["z"], a["norm_weight"], 1e-5, shape["residual_in_fp32"]
    fns = {"cublas": lambda w: F.linear(x, w), "ours": lambda w: linear_small(x, w, backend=backend)}
    if shape["norm"] == "add":
        fns["unfused"] = lambda w: F.linear(add_rms_norm(x, res, nw, eps=eps, residual_in_fp32=fp32)[0], w)
        fns["fused"] = lambda w: add_rms_norm_linear(x, res, nw, w, eps=eps, residual_in_fp32=fp32, backend=backend)
    elif shape["norm"] == "gated":
        gs = shape["group_size"]
        fns["unfused"] = lambda w: F.linear(gated_rms_norm(x, z, nw, group_size=gs, eps=eps), w)
        fns["fused"] = lambda w: gated_norm_linear(x, z, nw, w, group_size=gs, eps=eps, backend=backend)
    return fns


def _block_config(weight: torch.Tensor) -> str:
    """The blocks ``ops/gemv`` picks for an (N, K) weight of this dtype on this GPU (its ``_config`` rule)."""
    from ssmspec.ops.gemv.triton import _config, _sm_count

    return str(_config(*weight.shape, _sm_count(weight.device), weight.element_size()))


def run_decode_kernels(cfg: DictConfig) -> Iterator[dict]:
    """Rows for every preset x layer x M x impl of the GEMV grid, then every preset x batch x impl of the conv +
    SSM grid (module doc)."""
    b = cfg.bench
    bad = [m for m in b.rows if not 1 <= int(m) <= 16]
    if bad:
        raise ValueError(f"decode_kernels: bench.rows must lie in 1..16 (the GEMV kernel's rows), got {bad}")
    batches = [int(x) for x in b.get("conv_ssm_batch") or []]
    if any(x < 1 for x in batches):
        raise ValueError(f"decode_kernels: bench.conv_ssm_batch needs batch sizes >= 1, got {batches}")
    ctx = Ctx(cfg)
    for preset in b.models:
        for shape in layer_shapes(str(preset)):
            for m in b.rows:
                yield from ({"kind": "gemv", **r} for r in _point(ctx, str(preset), shape, int(m),
                                                                    str(b.get("backend", "auto"))))
                ctx.sync()
    for preset in b.models:
        if "M" not in load_preset(str(preset)).pattern:
            continue
        for bsz in batches:
            yield from conv_ssm_rows(ctx, str(preset), bsz, int(b.warmup), int(b.iters))


def conv_ssm_rows(ctx: Ctx, preset: str, bsz: int, warmup: int, iters: int) -> Iterator[dict]:
    """One row per impl of ``bench.conv_ssm.time_conv_ssm`` at (preset, batch); speedups on the fused row."""
    from ssmspec.bench.conv_ssm import time_conv_ssm

    t = time_conv_ssm(preset, bsz, device=str(ctx.device), dtype=ctx.dtype, warmup=max(warmup, 1), iters=iters)
    head = {k: t[k] for k in ("model", "batch", "H", "P", "N", "G", "W", "rot", "bytes", "dtype", "timing")}
    for impl in ("fused", "unfused", "mamba_ssm"):
        row = {"kind": "conv_ssm", **head, "impl": impl, **t[impl]}
        if impl == "fused":
            row.update({k: t[k] for k in ("speedup_vs_unfused", "speedup_vs_mamba_ssm") if k in t})
        yield row


def _point(ctx: Ctx, preset: str, shape: dict, m: int, backend: str) -> Iterator[dict]:
    """The copy row, then every impl's row, of one layer shape at M rows (its tensors freed on return)."""
    wbytes = shape["N"] * shape["K"] * ctx.dtype.itemsize
    rot = ctx.rotation(wbytes)
    act, ws = _inputs(shape, m, rot, ctx.dtype, ctx.device)
    ran = "triton" if use_triton(act["x"], ws[0], backend=backend) else "reference"
    base = dict(model=preset, **shape, M=m, rot=rot, weight_bytes=wbytes)
    copies = [torch.empty_like(w) for w in ws]
    copy = ctx.row(ctx.time(lambda: [c.copy_(w) for c, w in zip(copies, ws)], per_call=rot), 2 * wbytes, **base,
                   impl="copy", backend="torch")
    copy["gbps"] = 2 * wbytes / (copy["ms_p50"] * 1e-3) / 1e9  # read + write
    yield copy
    copies.clear()
    times = {}
    for impl, fn in _impls(shape, act, backend).items():
        t0 = time.perf_counter()
        fn(ws[0])
        ctx.sync()
        first = time.perf_counter() - t0
        row = ctx.row(ctx.time(lambda fn=fn: [fn(w) for w in ws], per_call=rot), wbytes, **base, impl=impl,
                      backend=ran if impl in ("ours", "fused") else "torch")
        row["gbps"] = wbytes / (row["ms_p50"] * 1e-3) / 1e9
        row["copy_fraction"] = row["gbps"] / copy["gbps"]
        times[impl] = row["ms_p50"]
        if impl in ("ours", "fused"):
            row["first_call_s"] = first
            row["config"] = _block_config(ws[0]) if ran == "triton" and ctx.cuda else None
            row["speedup"] = times["cublas" if impl == "ours" else "unfused"] / row["ms_p50"]
        yield row
