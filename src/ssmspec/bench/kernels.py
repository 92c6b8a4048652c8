"""Kernel benchmarks of the Mamba-2 decode ops: ``kernel_parity`` and ``snl_tab1_kernels`` (this file),
the ReplaySSM figures in ``bench/kernels_replay.py``.

Every time is a CUDA-graph replay timed with CUDA events (eager with perf_counter on CPU, the reference
twins there): a graph holds ``rot`` calls, each on its own copy of the state, ``rot`` chosen so the copies
together exceed 4x the L2 cache (small batches would otherwise be timed from L2), and one sample is the
replay time over ``rot``. Rows carry the raw samples (``samples_ms``), ms_p50 / p20 / p80, ``bytes`` -- the
fewest bytes the implementation must move (every input read once, every output written once, the state
read and written as often as that implementation has to) -- and ``hbm_fraction`` = bytes / time / the copy
bandwidth measured on the device (``bench.timing.measure_hbm_bandwidth``).

Mixer sizes come from the model presets (nemotron-h-4b: H=112, P=64, N=128, G=8; mamba2-2.7b: H=80, P=64,
N=128, G=1); fp32 state, inputs in ``cfg.dtype`` (bf16 on the GPU profile). mamba_ssm's Triton kernels are the
baseline (``selective_state_update`` called the way its Mamba-2 layer calls it at decode, with A, dt, dt_bias
and D broadcast over P by stride-0 views; ``mamba_chunk_scan_combined`` with initial and final states); rows
say ``status: skipped`` where mamba_ssm cannot be imported (CPU, or no mamba_ssm on the path).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator

import torch
from omegaconf import DictConfig

from ssmspec import config as Cfg
from ssmspec.bench.timing import hbm_fraction, measure_hbm_bandwidth, summarize, time_cuda_graph, time_eager
from ssmspec.models.config import load_preset
from ssmspec.ops.multistep import ssm_multistep
from ssmspec.ops.selective_state_update import selective_state_update

log = logging.getLogger("ssmspec.bench.kernels")
F32 = 4
ROTATION_CAP = 256  # most state copies one timed graph cycles through (Ctx.rotation)


# shared pieces ---------------------------------------------------------------------------------------
def mixer_sizes(preset: str) -> dict:
    """{H, P, N, G} of a preset's Mamba-2 mixer."""
    m = load_preset(preset)
    return dict(H=m.ssm_heads, P=m.head_dim, N=m.state_size, G=m.n_groups)


def mixer_grid(bench: DictConfig, *, device: str | None = None) -> Iterator[tuple[str, dict, int]]:
    """(preset, its mixer sizes, batch) for every preset x batch of a kernel benchmark's grid. With ``device``,
    every point is first checked against the free memory there (a few fp32 states plus a window of inputs
    per sequence): a batch that cannot fit is refused before anything is allocated, not after minutes of
    building inputs."""
    points = [(preset, mixer_sizes(preset), int(bsz)) for preset in bench.presets for bsz in bench.batch]
    if device is not None:
        from ssmspec.engine.memory import check_fits

        for preset, z, bsz in points:
            parts = {"states": 3 * state_bytes(bsz, z["H"], z["P"], z["N"]),
                     "inputs": 2 * io_bytes(bsz, 16, z["H"], z["P"], z["G"], z["N"], F32)}
            check_fits(parts, device, what=f"the {preset} mixer at batch {bsz}", fix="lower bench.batch")
    yield from points


class Ctx:
    """Device, dtype, timing settings and the measured peak of one benchmark run."""

    def __init__(self, cfg: DictConfig) -> None:
        self.device = str(cfg.device)
        self.dtype = Cfg.resolve_dtype(str(cfg.dtype), self.device)
        self.graph = Cfg.use_cuda_graph(cfg.bench.get("cuda_graph", "auto"), self.device)
        self.warmup, self.iters = int(cfg.bench.warmup), int(cfg.bench.iters)
        self.cuda = self.device.startswith("cuda")
        self.peak_gbps = measure_hbm_bandwidth(self.device) if self.cuda else None
        self.l2 = torch.cuda.get_device_properties(self.device).L2_cache_size if self.cuda else 0

    def rotation(self, state_bytes: int, cap: int = ROTATION_CAP) -> int:
        """State copies per timed graph so that together they exceed 4x L2 (1 on CPU). The cap only bounds
        the calls one graph holds for tiny states: every GPU preset's state at batch 1 needs at most ~100
        copies of a 50 MiB L2 (nemotron-h-4b: 3.7 MB -> 55, mamba2-2.7b: 2.6 MB -> 77, Qwen3.5 GDN: 2 MB ->
        100), about 4x L2 + one state of memory in all."""
        return 1 if not self.cuda else max(1, min(cap, math.ceil(4 * self.l2 / max(state_bytes, 1))))

    def time(self, fn: Callable[[], object], per_call: int = 1) -> list[float]:
        """ms per call of the work ``fn`` does ``per_call`` times (graph replay on CUDA)."""
        if self.graph:
            samples = time_cuda_graph(fn, warmup=self.warmup, iters=self.iters)
        else:
            samples = time_eager(fn, warmup=self.warmup, iters=self.iters, device=self.device)
        return [s / per_call for s in samples]

    def row(self, samples: list[float], nbytes: float, **fields) -> dict:
        out = {**fields, **summarize(samples), "samples_ms": samples, "bytes": nbytes, "status": "ok",
               "dtype": str(self.dtype).removeprefix("torch."), "timing": "cuda_graph" if self.graph else "eager",
               "peak_gbps": self.peak_gbps}
        out["hbm_fraction"] = hbm_fraction(nbytes, out["ms_p50"], self.peak_gbps) if self.peak_gbps else None
        return out

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def make_inputs(bsz: int, L: int, H: int, P: int, G: int, N: int, dtype, device, seed: int = 0) -> dict:
    """Random decode inputs (never zeros): x, raw dt, B, C in ``dtype``; A, D, dt_bias fp32."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    return dict(x=r(bsz, L, H, P).to(dtype), dt=(r(bsz, L, H) - 3.0).to(dtype),
                A=-(0.5 + 7.5 * torch.rand(H, generator=g)).to(device), B=r(bsz, L, G, N, scale=0.3).to(dtype),
                C=r(bsz, L, G, N, scale=0.3).to(dtype), D=r(H), dt_bias=r(H, scale=0.5))


def random_states(n: int, shape: tuple, device) -> list[torch.Tensor]:
    return [torch.randn(*shape, device=device) * 0.1 for _ in range(n)]


def io_bytes(bsz: int, L: int, H: int, P: int, G: int, N: int, act: int) -> int:
    """Per call of L tokens: x read, y written, B and C read, raw dt read (activations of ``act`` bytes)."""
    return bsz * L * (2 * H * P * act + 2 * G * N * act + H * act)


def state_bytes(bsz: int, H: int, P: int, N: int) -> int:
    return bsz * H * P * N * F32


def mamba_ssm_ops() -> tuple[Callable | None, Callable | None, str]:
    """(selective_state_update, mamba_chunk_scan_combined, reason) from mamba_ssm, None where unavailable."""
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as ssu
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as chunk
    except Exception as e:  # noqa: BLE001 -- any import failure means: no baseline on this machine
        return None, None, f"mamba_ssm not importable: {type(e).__name__}: {e}"
    return ssu, chunk, ""


def mamba_ssu_call(ssu: Callable, state, x, dt, A, B, C, D, dt_bias):
    """mamba_ssm's selective_state_update as its Mamba-2 layer calls it at decode (tie_hdim views)."""
    H, P, N = state.shape[1:]
    return ssu(state, x, dt[..., None].expand(-1, -1, P), A[:, None, None].expand(H, P, N), B, C,
               D=D[:, None].expand(H, P), z=None, dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True)


def ssu_fn(impl: str, ssu_mamba, st: torch.Tensor, inp: dict, t: int = 0, **blocks) -> Callable[[], object]:
    """One single-token update of token t on state ``st`` by ``impl`` (ours | mamba_ssm)."""
    x, dt, B, C = inp["x"][:, t], inp["dt"][:, t], inp["B"][:, t], inp["C"][:, t]
    if impl == "mamba_ssm":
        return lambda: mamba_ssu_call(ssu_mamba, st, x, dt, inp["A"], B, C, inp["D"], inp["dt_bias"])
    if blocks:
        from ssmspec.ops.selective_state_update.triton import selective_state_update_triton
        return lambda: selective_state_update_triton(st, x, dt, inp["A"], B, C, inp["D"], None, inp["dt_bias"], True,
                                                     **blocks)
    return lambda: selective_state_update(st, x, dt, inp["A"], B, C, inp["D"], None, inp["dt_bias"], True)


def fused_fn(st: torch.Tensor, inp: dict, **launch) -> Callable[[], object]:
    """Our fused multi-step update of every token of ``inp`` on state ``st``: ``ssm_multistep`` (the kernel on
    CUDA, the twin on CPU), or with launch options (``ssm_multistep_triton``'s) the kernel under them."""
    args = (st, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"])
    if not launch:
        return lambda: ssm_multistep(*args, dt_bias=inp["dt_bias"], dt_softplus=True)
    from ssmspec.ops.multistep.triton import ssm_multistep_triton
    return lambda: ssm_multistep_triton(*args, dt_bias=inp["dt_bias"], dt_softplus=True, **launch)


def chunk_scan_fn(chunk_m: Callable, st: torch.Tensor, inp: dict, chunk_size: int) -> Callable[[], object]:
    """mamba_ssm's ``mamba_chunk_scan_combined`` over every token of ``inp`` from state ``st`` (final state out)."""
    return lambda: chunk_m(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size=chunk_size, D=inp["D"],
                           dt_bias=inp["dt_bias"], dt_softplus=True, initial_states=st, return_final_states=True)


def chain(fns: list[Callable[[], object]]) -> Callable[[], None]:
    def run() -> None:
        for f in fns:
            f()
    return run


# kernel_parity --------------------------------------------------------------------------------------
def run_kernel_parity(cfg: DictConfig) -> Iterator[dict]:
    """Our single-token kernel vs mamba_ssm's ``selective_state_update`` per model and batch (goal: ours
    >= 0.95x as fast at batch 1, 16, 64, 256), plus a sweep of our block sizes (rows ``impl: ours-sweep``),
    the evidence for the hand-picked ``BLOCK_P`` / ``num_warps`` of ``ops/multistep/triton.py:_blocks``."""
    ctx = Ctx(cfg)
    b = cfg.bench
    ssu_m, _, why = mamba_ssm_ops()
    for preset, z, bsz in mixer_grid(b, device=ctx.device):
        H, P, N, G = z["H"], z["P"], z["N"], z["G"]
        inp = make_inputs(bsz, 1, H, P, G, N, ctx.dtype, ctx.device)
        sb = state_bytes(bsz, H, P, N)
        rot = ctx.rotation(sb)
        nbytes = 2 * sb + io_bytes(bsz, 1, H, P, G, N, ctx.dtype.itemsize)
        base = dict(model=preset, batch=bsz, H=H, P=P, N=N, G=G, rot=rot)
        configs = [("ours", {}), ("mamba_ssm", {})]
        if ctx.cuda and bsz in b.get("sweep_batch", []):
            configs += [("ours-sweep", dict(block_p=bp, num_warps=nw)) for bp, nw in b.sweep]
        for impl, blocks in configs:
            if impl == "mamba_ssm" and ssu_m is None:
                yield dict(base, impl=impl, status="skipped", reason=why)
                continue
            states = random_states(rot, (bsz, H, P, N), ctx.device)
            fns = [ssu_fn("mamba_ssm" if impl == "mamba_ssm" else "ours", ssu_m, s, inp, **blocks) for s in states]
            samples = ctx.time(chain(fns), per_call=rot)
            yield ctx.row(samples, nbytes, **base, impl=impl, **blocks)
            del states
        ctx.sync()


# snl_tab1_kernels -------------------------------------------------------------------------------------
# fused_ours is the kernel's default launch (prefetch on for a small grid: ops/multistep/triton.py's
# _default_prefetch); _prefetch and _noprefetch force that option either way, so every batch compares both
SNL_LAUNCH = {"fused_ours_prefetch": dict(prefetch=True), "fused_ours_noprefetch": dict(prefetch=False),
              "fused_ours_stages2": dict(num_stages=2)}
SNL_IMPLS = ("loop_ours", "loop_mamba_ssm", "chunk_scan_mamba_ssm", "fused_ours", *SNL_LAUNCH)


def run_snl_tab1(cfg: DictConfig) -> Iterator[dict]:
    """Multi-token update of L tokens (seed 001, Table 1): a loop of single-token kernels (ours and mamba_ssm's),
    mamba_ssm's ``mamba_chunk_scan_combined`` (initial state in, final state out) and our fused multi-step
    kernel (state loaded once, L tokens in registers, every output written, final state stored once).
    ``SNL_LAUNCH`` names the fused kernel under a launch option given explicitly (goal P3: the next token's
    operands prefetched or not, whatever the default picks at that grid; or the token loop in Triton's pipeliner,
    the rest as by default); these are Triton launches, so their rows say ``status: skipped`` on CPU, where
    ``fused_ours`` times the reference twin."""
    b = cfg.bench
    unknown = [i for i in b.impls if i not in SNL_IMPLS]
    if unknown:  # before any measurement
        raise ValueError(f"snl_tab1_kernels: unknown impl(s) {unknown}; choose from {', '.join(SNL_IMPLS)}")
    ctx = Ctx(cfg)
    ssu_m, chunk_m, why = mamba_ssm_ops()
    for preset, z, bsz in mixer_grid(b, device=ctx.device):
        H, P, N, G = z["H"], z["P"], z["N"], z["G"]
        for L in b.L:
            inp = make_inputs(bsz, L, H, P, G, N, ctx.dtype, ctx.device)
            sb = state_bytes(bsz, H, P, N)
            rot = ctx.rotation(sb)
            once = 2 * sb + io_bytes(bsz, L, H, P, G, N, ctx.dtype.itemsize)
            loop = L * (2 * sb + io_bytes(bsz, 1, H, P, G, N, ctx.dtype.itemsize))
            base = dict(model=preset, batch=bsz, L=L, H=H, P=P, N=N, G=G, rot=rot)
            for impl in b.impls:
                if impl in ("loop_mamba_ssm", "chunk_scan_mamba_ssm") and ssu_m is None:
                    yield dict(base, impl=impl, status="skipped", reason=why)
                    continue
                if impl in SNL_LAUNCH and not ctx.cuda:
                    yield dict(base, impl=impl, status="skipped", reason="a launch option of the Triton kernel: "
                               "needs CUDA")
                    continue
                states = random_states(rot, (bsz, H, P, N), ctx.device)
                if impl == "loop_ours":
                    fns = [ssu_fn("ours", None, s, inp, t) for s in states for t in range(L)]
                elif impl == "loop_mamba_ssm":
                    fns = [ssu_fn("mamba_ssm", ssu_m, s, inp, t) for s in states for t in range(L)]
                elif impl == "fused_ours" or impl in SNL_LAUNCH:
                    fns = [fused_fn(s, inp, **SNL_LAUNCH.get(impl, {})) for s in states]
                else:  # chunk_scan_mamba_ssm
                    fns = [chunk_scan_fn(chunk_m, s, inp, int(b.chunk_size)) for s in states]
                samples = ctx.time(chain(fns), per_call=rot)
                yield ctx.row(samples, loop if impl.startswith("loop") else once, **base, impl=impl)
                del states
            ctx.sync()
