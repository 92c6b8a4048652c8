"""Benchmarks of the SSD prefill scan (seed 004): ``ssd_kernel_fwd`` and ``ssd_kernel_blockt``.

``ssd_kernel_fwd``: our one-kernel scan (``ssmspec.ops.ssd.ssd_chunk_scan``, the call the models' prefill
makes) against mamba_ssm's five-launch ``mamba_chunk_scan_combined`` in the same run, per mixer size, batch
and sequence length; goal (P10): >= 1.6x at 32K tokens (seed 004 measured 1.56x on an H200).
``ssd_kernel_blockt``: our kernel at every (BLOCK_T, num_warps) of the grid, with mamba_ssm's time at the same
size as the line to beat -- the evidence for the defaults of ``ops/ssd/triton.py:_blocks``.

Both implementations get the same inputs: x, B, C in ``cfg.dtype``, dt already discretized in fp32 (mamba_ssm
with ``dt_softplus=False``, as our models call the scan), D, and an initial state when ``bench.initial_state``.
Mixer sizes: ``seed004`` is seed 004's benchmark (8 heads, N = 64; P = 64, Mamba-2's head dim; G = 1), any
other name a model preset's Mamba-2 mixer (nemotron-h-4b: H=112, P=64, N=128, G=8; mamba2-2.7b: H=80, P=64,
N=128, G=1). Timing as in ``bench/kernels.py`` (``Ctx``): CUDA-graph replay with CUDA events on the GPU, a
graph holding ``rot`` calls on input copies that together exceed 4x L2; eager perf_counter on CPU. ``bytes``
is the least a scan must move: x, B, C, dt read once, y written once, the final state written (and the
initial state read); ``hbm_fraction`` = bytes / time / the measured copy bandwidth. Rows of mamba_ssm say
``status: skipped`` where it cannot be imported; a block size the GPU cannot hold says ``status: failed``.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from ssmspec.bench.kernels import Ctx, chain, mamba_ssm_ops, mixer_sizes
from ssmspec.ops.dispatch import interpret_mode, use_triton
from ssmspec.ops.ssd import ssd_chunk_scan

log = logging.getLogger("ssmspec.bench.ssd")
F32 = 4
SEED004 = dict(H=8, P=64, N=64, G=1)  # seed 004: batch 16, 8 heads, d_state 64


def mixer(name: str) -> dict:
    """{H, P, N, G} of ``seed004`` or of a model preset's Mamba-2 mixer."""
    return dict(SEED004) if name == "seed004" else mixer_sizes(name)


def scan_inputs(bsz: int, L: int, z: dict, dtype, device: str, *, initial_state: bool, seed: int = 0) -> dict:
    """Random prefill inputs drawn on the device (GB-sized at 32K tokens): x, B, C in ``dtype``; dt =
    softplus(N(-3, 1)) ~ 0.05 in fp32; A in [-8, -0.5]; D; an fp32 initial state or None."""
    H, P, N, G = z["H"], z["P"], z["N"], z["G"]
    g = torch.Generator(device=device).manual_seed(seed)

    def r(*shape, scale=1.0, dt=torch.float32):
        return torch.empty(*shape, dtype=dt, device=device).normal_(0.0, scale, generator=g)

    return dict(x=r(bsz, L, H, P, dt=dtype), dt=F.softplus(r(bsz, L, H) - 3.0),
                A=-(0.5 + 7.5 * torch.rand(H, generator=g, device=device)), B=r(bsz, L, G, N, scale=0.3, dt=dtype),
                C=r(bsz, L, G, N, scale=0.3, dt=dtype), D=r(H),
                s0=r(bsz, H, P, N, scale=0.1) if initial_state else None)


def scan_bytes(bsz: int, L: int, z: dict, act: int, *, initial_state: bool) -> int:
    """Least bytes one scan moves: x read and y written (act bytes), B and C read, fp32 dt read, the final
    state written and, with an initial state, read."""
    H, P, N, G = z["H"], z["P"], z["N"], z["G"]
    state = bsz * H * P * N * F32
    return bsz * L * (2 * H * P * act + 2 * G * N * act + H * F32) + state * (2 if initial_state else 1)


def _copies(inp: dict, rot: int) -> list[dict]:
    """``rot`` input sets: the first is ``inp``, the others clones (a graph of rot calls streams from HBM)."""
    return [inp] + [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
                    for _ in range(rot - 1)]


def ours_fn(i: dict, *, backend: str = "auto", **launch) -> Callable[[], object]:
    """Our scan on one input set: the public dispatch (what prefill runs), or the kernel with launch options."""
    if launch:
        from ssmspec.ops.ssd.triton import ssd_chunk_scan_triton
        return lambda: ssd_chunk_scan_triton(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], initial_state=i["s0"],
                                             **launch)
    return lambda: ssd_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], initial_state=i["s0"],
                                  backend=backend)


def mamba_fn(chunk: Callable, i: dict, chunk_size: int) -> Callable[[], object]:
    return lambda: chunk(i["x"], i["dt"], i["A"], i["B"], i["C"], chunk_size=chunk_size, D=i["D"],
                         initial_states=i["s0"], dt_softplus=False, return_final_states=True)


def _measure(ctx: Ctx, fns: list[Callable[[], object]], nbytes: int, **fields) -> dict:
    """Time the chain of ``fns`` (one call each per sample); a launch the GPU cannot hold (Triton's
    OutOfResources: shared memory or registers) or an out-of-memory is a row with ``status: failed``."""
    try:
        fns[0]()  # compile first: a failure here leaves no half-captured graph behind
        samples = ctx.time(chain(fns), per_call=len(fns))
    except Exception as e:  # noqa: BLE001 -- only resource failures are results; anything else is re-raised
        name = type(e).__name__
        if name not in ("OutOfResources", "OutOfMemoryError"):
            raise
        log.warning("%s: %s", fields, e)
        ctx.sync()
        return dict(fields, status="failed", reason=f"{name}: {e}")
    return ctx.row(samples, nbytes, **fields)


def _grid(b: DictConfig) -> Iterator[tuple[str, dict, int, int]]:
    for name in b.mixers:
        z = mixer(name)
        for bsz in b.batch:
            for L in b.seqlen:
                yield name, z, int(bsz), int(L)


# ssd_kernel_fwd --------------------------------------------------------------------------------------------
def run_ssd_fwd(cfg: DictConfig) -> Iterator[dict]:
    """Ours (``impl: ours``, with the ``backend`` that ran: triton on CUDA, the reference on CPU) vs
    mamba_ssm's ``mamba_chunk_scan_combined`` (``impl: mamba_ssm``) for every mixer x batch x seqlen."""
    ctx = Ctx(cfg)
    b = cfg.bench
    _, chunk_m, why = mamba_ssm_ops()
    backend = str(b.get("backend", "auto"))
    for name, z, bsz, L in _grid(b):
        init = bool(b.initial_state)
        inp = scan_inputs(bsz, L, z, ctx.dtype, ctx.device, initial_state=init)
        nbytes = scan_bytes(bsz, L, z, ctx.dtype.itemsize, initial_state=init)
        rot = ctx.rotation(nbytes)
        sets = _copies(inp, rot)
        base = dict(model=name, batch=bsz, seqlen=L, **z, rot=rot, initial_state=init)
        ran = "triton" if use_triton(inp["x"], inp["dt"], inp["A"], inp["B"], backend=backend) else "reference"
        row = _measure(ctx, [ours_fn(i, backend=backend) for i in sets], nbytes, **base, impl="ours", backend=ran)
        if ran == "triton":  # what the defaults resolved to (after any step-down on this GPU)
            from ssmspec.ops.ssd.triton import default_launch
            row.update(default_launch(ctx.dtype, L, z["P"], z["N"], chains=bsz * z["H"], device=ctx.device))
        yield row
        big = bsz * L * z["H"] * z["P"] >= 2 ** 31
        if chunk_m is None:
            yield dict(base, impl="mamba_ssm", status="skipped", reason=why)
        elif big:  # a fault here would poison the CUDA context and end the whole run
            yield dict(base, impl="mamba_ssm", status="skipped",
                       reason="x has >= 2^31 elements: mamba_ssm 2.3.2's _chunk_scan_fwd indexes with 32-bit offsets "
                              "and raised an illegal memory access in this run's grid on an H100")
        else:
            yield _measure(ctx, [mamba_fn(chunk_m, i, int(b.chunk_size)) for i in sets], nbytes, **base,
                           impl="mamba_ssm", chunk_size=int(b.chunk_size))
        del sets, inp
        ctx.sync()


# ssd_kernel_blockt -----------------------------------------------------------------------------------------
def run_ssd_blockt(cfg: DictConfig) -> Iterator[dict]:
    """Our kernel at every BLOCK_T x num_warps x BLOCK_P x segment length of the grid (``impl: ours``,
    ``block_t``, ``num_warps``, ``block_p``, ``segment_len`` and the ``segments`` it makes; a null block_p is
    the default of ``_blocks``, a null segment_len the default cut of ``_segment_len``) and mamba_ssm once per
    size (``impl: mamba_ssm``)."""
    if not (str(cfg.device).startswith("cuda") or interpret_mode()):
        raise ValueError("ssd_kernel_blockt times the Triton kernel's block sizes: run it on a GPU "
                         "(profile=gpu), or with TRITON_INTERPRET=1 set for the CPU interpreter")
    b = cfg.bench
    for key in ("block_t", "block_p"):  # before any measurement
        bad = [v for v in b[key] if v is not None and (int(v) < 16 or int(v) & (int(v) - 1))]
        if bad:
            raise ValueError(f"ssd_kernel_blockt: bench.{key} must hold powers of two >= 16 (null: the default "
                             f"block_p), got {bad}")
    segs = list(b.get("segment_len") or [None])
    bad = [v for v in segs if v is not None and (int(v) < 1 or any(int(v) % int(t) for t in b.block_t))]
    if bad:
        raise ValueError(f"ssd_kernel_blockt: bench.segment_len must hold multiples of every block_t (null: the "
                         f"default cut, ops/ssd/triton.py:_segment_len), got {bad}")
    bad = [w for w in b.num_warps if int(w) not in (1, 2, 4, 8, 16)]
    if bad:
        raise ValueError(f"ssd_kernel_blockt: bench.num_warps must hold 1, 2, 4, 8 or 16, got {bad}")
    from ssmspec.ops.ssd.triton import _blocks, _segment_len, _sm_count
    ctx = Ctx(cfg)
    _, chunk_m, why = mamba_ssm_ops()
    for name, z, bsz, L in _grid(b):
        init = bool(b.initial_state)
        inp = scan_inputs(bsz, L, z, ctx.dtype, ctx.device, initial_state=init)
        nbytes = scan_bytes(bsz, L, z, ctx.dtype.itemsize, initial_state=init)
        rot = ctx.rotation(nbytes)
        sets = _copies(inp, rot)
        base = dict(model=name, batch=bsz, seqlen=L, **z, rot=rot, initial_state=init)
        for bt, nw, bp, sl in itertools.product(b.block_t, b.num_warps, b.block_p, segs):
            launch = dict(block_t=int(bt), num_warps=int(nw), block_p=int(bp or _blocks(L, z["P"], z["N"])[1]))
            chains = bsz * z["H"] * -(-z["P"] // launch["block_p"])
            seg = int(sl) if sl is not None else _segment_len(L, int(bt), chains, _sm_count(torch.device(ctx.device)))
            launch["segment_len"] = min(seg, max(L, 1))
            yield _measure(ctx, [ours_fn(i, **launch) for i in sets], nbytes, **base, impl="ours",
                           backend="triton", segments=-(-L // launch["segment_len"]), **launch)
        big = bsz * L * z["H"] * z["P"] >= 2 ** 31
        if chunk_m is None:
            yield dict(base, impl="mamba_ssm", status="skipped", reason=why)
        elif big:  # a fault here would poison the CUDA context and end the whole run
            yield dict(base, impl="mamba_ssm", status="skipped",
                       reason="x has >= 2^31 elements: mamba_ssm 2.3.2's _chunk_scan_fwd indexes with 32-bit offsets "
                              "and raised an illegal memory access in this run's grid on an H100")
        else:
            yield _measure(ctx, [mamba_fn(chunk_m, i, int(b.chunk_size)) for i in sets], nbytes, **base,
                           impl="mamba_ssm", chunk_size=int(b.chunk_size))
        del sets, inp
        ctx.sync()
