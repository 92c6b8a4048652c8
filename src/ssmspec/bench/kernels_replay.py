"""ReplaySSM kernel benchmarks (seed 000): ``replay_fig6_speedup`` / ``replay_fig7_buffer`` (output-only
standard decode vs mamba_ssm's kernel over buffer sizes R) and ``replay_fig9_verify_cost`` (verify of S
drafts relative to the standard decode kernel, `snapshot` vs `replay`, per accepted count).

How one replay step is measured (the count cycle, one CUDA graph per cycle, the bytes per step) is
``bench/replay_measure.py``; the GDN rows are ``bench/kernels_gdn.py``, the whole-step rows ``bench/steps_replay.py``.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

from omegaconf import DictConfig

from ssmspec.bench import kernels_gdn
from ssmspec.bench.kernels import (Ctx, chain, io_bytes, make_inputs, mamba_ssm_ops, mixer_grid, random_states,
                                   ssu_fn, state_bytes)
from ssmspec.bench.replay_measure import replay_measure, snapshot_measure
from ssmspec.bench.steps_replay import step_speedup_rows

log = logging.getLogger("ssmspec.bench.kernels_replay")


def _ssu_baselines(ctx: Ctx, bsz: int, z: dict, ssu_m, why: str, base: dict) -> Iterator[dict]:
    """Standard decode with the single-token kernel: mamba_ssm's and ours (state read + written)."""
    H, P, N, G = z["H"], z["P"], z["N"], z["G"]
    inp = make_inputs(bsz, 1, H, P, G, N, ctx.dtype, ctx.device)
    sb = state_bytes(bsz, H, P, N)
    rot = ctx.rotation(sb)
    for impl in ("mamba_ssm", "ours"):
        if impl == "mamba_ssm" and ssu_m is None:
            yield dict(base, impl=f"ssu_{impl}", status="skipped", reason=why)
            continue
        states = random_states(rot, (bsz, H, P, N), ctx.device)
        samples = ctx.time(chain([ssu_fn(impl, ssu_m, s, inp) for s in states]), per_call=rot)
        yield ctx.row(samples, 2 * sb + io_bytes(bsz, 1, H, P, G, N, ctx.dtype.itemsize), **base,
                      impl=f"ssu_{impl}", rot=rot)
        del states
    ctx.sync()


def run_replay_buffer(cfg: DictConfig) -> Iterator[dict]:
    """Output-only standard decode (L = 1) of `replay` over buffer sizes R vs the single-token kernels,
    per model at ``bench.batch`` (seed 000, Fig. 6 kernel part and Fig. 7). Rows: impl ssu_mamba_ssm /
    ssu_ours (no R) and replay (per R, with ``bound_speedup`` and ``flush_period``); optional
    ``bench.sweep`` rows (impl replay-sweep) time other (BLOCK_P, num_warps) of the state kernel and
    ``bench.window_sweep`` rows (impl replay-window-sweep) other num_warps of the window kernel. GDN rows
    for ``bench.gdn_presets`` follow (bench/kernels_gdn.py), then whole engine steps for
    ``bench.step_presets`` (impl step_autoregressive / step_replay, bench/steps_replay.py)."""
    b = cfg.bench
    gdn = kernels_gdn.gdn_presets(b)  # refused before anything is measured
    ctx = Ctx(cfg)
    ssu_m, _, why = mamba_ssm_ops()
    for preset, z, bsz in mixer_grid(b, device=ctx.device):
        base = dict(model=preset, batch=bsz, L=1, **z)
        yield from _ssu_baselines(ctx, bsz, z, ssu_m, why, base)
        base_bytes = 2 * state_bytes(bsz, z["H"], z["P"], z["N"]) + io_bytes(bsz, 1, z["H"], z["P"], z["G"],
                                                                              z["N"], ctx.dtype.itemsize)
        runs = [("replay", R, {}) for R in b.R]
        if ctx.cuda:
            runs += [("replay-sweep", int(b.sweep_R), dict(block_p=bp, num_warps=nw)) for bp, nw in b.get("sweep", [])]
            runs += [("replay-window-sweep", int(b.sweep_R), dict(window_warps=int(w)))
                     for w in b.get("window_sweep", [])]
        for impl, R, blocks in runs:
            samples, nbytes, cyc = replay_measure(ctx, bsz, 1, R, 0, z, **blocks)
            yield ctx.row(samples, nbytes, **base, impl=impl, R=R, flush_period=len(cyc),
                          bound_speedup=base_bytes / nbytes, **blocks)
    yield from kernels_gdn.buffer_rows(ctx, b, gdn)
    yield from step_speedup_rows(cfg)  # Fig. 6 whole-step rows (bench.step_presets)


def run_verify_cost(cfg: DictConfig) -> Iterator[dict]:
    """Verify of S drafts (L = 1 + S tokens) per accepted count a = 0..S: `snapshot` (fused: one state load,
    L state stores into snapshot slots) and `replay` (per R in ``bench.R``), with the standard decode kernels
    (L = 1) of the same batch as the unit (seed 000, Fig. 9). GDN rows for ``bench.gdn_presets`` follow."""
    b = cfg.bench
    gdn = kernels_gdn.gdn_presets(b)
    sweeps = _verify_sweeps(b)  # refused before anything is measured
    ctx = Ctx(cfg)
    ssu_m, _, why = mamba_ssm_ops()
    for preset, z, bsz in mixer_grid(b, device=ctx.device):
        base = dict(model=preset, batch=bsz, **z)
        yield from _ssu_baselines(ctx, bsz, z, ssu_m, why, dict(base, S=0, L=1))
        for S in b.S:
            L = S + 1
            samples, nbytes = snapshot_measure(ctx, bsz, L, z)
            yield ctx.row(samples, nbytes, **base, impl="snapshot", S=S, L=L)
            for R in b.R:
                if R < L:
                    continue
                for a in range(S + 1):
                    samples, nbytes, cyc = replay_measure(ctx, bsz, L, R, a, z)
                    yield ctx.row(samples, nbytes, **base, impl="replay", S=S, L=L, R=R, accepted=a,
                                  flush_period=len(cyc))
        if ctx.cuda:  # other launches of the state kernel at S = sweep_S (GPU only): the evidence for the defaults
            yield from _verify_sweep_rows(ctx, b, sweeps, bsz, z, base)
    yield from kernels_gdn.verify_rows(ctx, b, gdn)


_SWEEP_KEYS = {"gemm": bool, "precision": str, "block_p": int, "num_warps": int, "window_warps": int, "fused": bool}


def _verify_sweeps(b) -> list[dict]:
    """``bench.verify_sweep`` as typed launch options, an unknown key refused with the known ones."""
    out = []
    for opts in b.get("verify_sweep", []):
        opts = dict(opts)
        bad = sorted(set(opts) - set(_SWEEP_KEYS))
        if bad:
            raise ValueError(f"bench.verify_sweep: unknown launch option(s) {bad}; use {sorted(_SWEEP_KEYS)}")
        out.append({k: _SWEEP_KEYS[k](v) for k, v in opts.items()})
    return out


def _verify_sweep_rows(ctx: Ctx, b, sweeps: list[dict], bsz: int, z: dict, base: dict) -> Iterator[dict]:
    """``bench.verify_sweep``: launch options of ``replay_verify_triton`` (gemm, precision, block_p, num_warps,
    window_warps, fused: the one-launch form or the four launches), each timed at S = ``bench.sweep_S`` for every R and accepted count (impl replay-sweep, the
    options as columns)."""
    S = int(b.get("sweep_S", 6))
    L = S + 1
    for opts in sweeps:
        for R in b.R:
            if R < L:
                continue
            for a in range(S + 1):
                samples, nbytes, cyc = replay_measure(ctx, bsz, L, R, a, z, **opts)
                yield ctx.row(samples, nbytes, **base, impl="replay-sweep", S=S, L=L, R=R, accepted=a,
                              flush_period=len(cyc), **opts)
