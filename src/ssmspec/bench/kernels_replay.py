"""ReplaySSM kernel benchmarks (seed 000): ``replay_fig6_speedup`` / ``replay_fig7_buffer`` (output-only
standard decode vs mamba_ssm's kernel over buffer sizes R) and ``replay_fig9_verify_cost`` (verify of S
drafts relative to the standard decode kernel, `snapshot` vs `replay`, per accepted count).

A replay measurement is a steady state, not one call: every step runs what each Mamba-2 layer of the
`replay` strategy runs -- ``replay_verify`` with the flush rule count + 2L > R decided inside it (scores,
window readout, state kernel, ring append) -- and the commit (count += accepted + 1). Sequences are staggered over the count cycle
(sequence b starts at phase b of the cycle that a constant accepted count drives), and one CUDA graph holds a
whole cycle of K steps, so every sequence flushes exactly once per graph and a sample is the graph time / K.

Bytes per step (for ``hbm_fraction`` and the bound) follow the same cycle, per sequence and head: the
checkpoint read (4PN), on flush steps the state store (4PN) and the folded entries, the window entries read
(x: 2P, dt: 4, B: 2N per group), the call's inputs and outputs, and the appended entries. ``bound_speedup`` =
bytes of the single-token baseline (state read + written) / bytes of this replay step: the speedup if both
kernels ran at the same fraction of bandwidth.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial

import torch
from omegaconf import DictConfig

from ssmspec.bench.kernels import (Ctx, chain, io_bytes, make_inputs, mamba_ssm_ops, mixer_grid, random_states,
                                   ssu_fn, state_bytes)
from ssmspec.ops.multistep import ssm_multistep_snapshot
from ssmspec.ops.replay import replay_commit, replay_verify

log = logging.getLogger("ssmspec.bench.kernels_replay")


def count_cycle(L: int, R: int, accepted: int) -> list[int]:
    """The counts h seen at call time in steady state when every call accepts ``accepted`` drafts."""
    seen: list[int] = []
    c = 0
    while c not in seen:
        seen.append(c)
        c = (0 if c + 2 * L > R else c) + accepted + 1
    return seen[seen.index(c):]


def replay_step_bytes(counts: list[int], L: int, R: int, H: int, P: int, G: int, N: int, act: int) -> float:
    """Bytes one replay step moves for one sequence per count in ``counts`` (averaged over them)."""
    head = 4 * P * N  # checkpoint tile of one head
    entry = H * (act * P + 4) + G * act * N  # one ring entry: x and dt per head, B per group
    total = 0.0
    for c in counts:
        flush = c + 2 * L > R
        b = H * head  # checkpoint read once
        if flush:
            b += H * head + c * entry  # fold: the committed entries, one state store
        window = 0 if flush else c
        b += window * entry  # ring entries the readout reads
        b += L * (H * act * P * 2 + 2 * G * act * N + H * act)  # x, y, B, C, raw dt of the call
        b += L * entry  # append
        total += b
    return total / len(counts)


def _ring_state(bsz: int, R: int, H: int, P: int, G: int, N: int, dtype, device, counts: list[int]) -> dict:
    g = torch.Generator(device="cpu").manual_seed(1)
    phase = torch.arange(bsz) % len(counts)
    return dict(S0=torch.randn(bsz, H, P, N, device=device) * 0.1,
                ring_x=torch.randn(bsz, R, H, P, generator=g).to(device, dtype),
                ring_dt=(0.01 + 0.05 * torch.rand(bsz, R, H, generator=g)).to(device),
                ring_B=(0.3 * torch.randn(bsz, R, G, N, generator=g)).to(device, dtype),
                head=torch.randint(0, R, (bsz,), generator=g).to(device),
                count=torch.tensor([counts[int(p)] for p in phase], device=device, dtype=torch.long))


def replay_measure(ctx: Ctx, bsz: int, L: int, R: int, accepted: int, z: dict, **blocks) -> tuple[list[float], float,
                                                                                                   list[int]]:
    """(ms per step samples, bytes per step, count cycle) of the replay steady state. Like the single-token
    kernels (``Ctx.rotation``), the graph cycles through copies of the checkpoint + ring that together exceed
    4x the L2, so small batches are not timed from L2: every cycle step runs once on each copy."""
    H, P, N, G = z["H"], z["P"], z["N"], z["G"]
    cyc = count_cycle(L, R, accepted)
    ring = bsz * R * (H * P * ctx.dtype.itemsize + 4 * H + G * N * ctx.dtype.itemsize)  # x, dt fp32, B
    rot = ctx.rotation(state_bytes(bsz, H, P, N) + ring)
    copies = [_ring_state(bsz, R, H, P, G, N, ctx.dtype, ctx.device, cyc) for _ in range(rot)]
    inp = make_inputs(bsz, L, H, P, G, N, ctx.dtype, ctx.device)
    acc = torch.full((bsz,), accepted, device=ctx.device, dtype=torch.long)
    if blocks:
        from ssmspec.ops.replay.triton import replay_verify_triton as verify
    else:
        verify = replay_verify

    def step(st: dict) -> None:  # one layer of the `replay` strategy: verify (flush decided in the call), commit
        verify(st["S0"], st["ring_x"], st["ring_dt"], st["ring_B"], st["head"], st["count"], inp["x"], inp["dt"],
               inp["A"], inp["B"], inp["C"], inp["D"], dt_bias=inp["dt_bias"], flush=None, **blocks)
        replay_commit(st["count"], acc)

    K = len(cyc)
    samples = ctx.time(chain([partial(step, st) for _ in range(K) for st in copies]), per_call=K * rot)
    nbytes = bsz * replay_step_bytes(cyc, L, R, H, P, G, N, ctx.dtype.itemsize)
    copies.clear()  # free the rings and checkpoints before the next configuration allocates its own
    ctx.sync()
    return samples, nbytes, cyc


def snapshot_measure(ctx: Ctx, bsz: int, L: int, z: dict) -> tuple[list[float], float]:
    """(ms per call samples, bytes) of `snapshot` verify of L tokens: one state load, L snapshot stores
    (``ssm_multistep_snapshot``), cycling pool copies that together exceed 4x the L2."""
    H, P, N, G = z["H"], z["P"], z["N"], z["G"]
    inp = make_inputs(bsz, L, H, P, G, N, ctx.dtype, ctx.device)
    sb = state_bytes(bsz, H, P, N)
    rot = ctx.rotation(L * sb)
    pools = [torch.randn(bsz * L, H, P, N, device=ctx.device) * 0.1 for _ in range(rot)]
    src = torch.arange(bsz, device=ctx.device) * L  # slot of the last accepted token (any slot)
    dst = src[:, None] + torch.arange(L, device=ctx.device)[None]  # includes src: read before stored

    def snap(pool: torch.Tensor) -> None:
        ssm_multistep_snapshot(pool, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"],
                               dt_bias=inp["dt_bias"], src_slot=src, dst_slots=dst)

    samples = ctx.time(chain([partial(snap, pool) for pool in pools]), per_call=rot)
    pools.clear()
    ctx.sync()
    return samples, (1 + L) * sb + io_bytes(bsz, L, H, P, G, N, ctx.dtype.itemsize)


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
    from ssmspec.bench import kernels_gdn  # imports this module
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
    from ssmspec.bench.steps_replay import step_speedup_rows  # Fig. 6 whole-step rows (bench.step_presets)

    yield from step_speedup_rows(cfg)


def run_verify_cost(cfg: DictConfig) -> Iterator[dict]:
    """Verify of S drafts (L = 1 + S tokens) per accepted count a = 0..S: `snapshot` (fused: one state load,
    L state stores into snapshot slots) and `replay` (per R in ``bench.R``), with the standard decode kernels
    (L = 1) of the same batch as the unit (seed 000, Fig. 9). GDN rows for ``bench.gdn_presets`` follow."""
    from ssmspec.bench import kernels_gdn  # imports this module
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


_SWEEP_KEYS = {"gemm": bool, "precision": str, "block_p": int, "num_warps": int, "window_warps": int}


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
    window_warps), each timed at S = ``bench.sweep_S`` for every R and accepted count (impl replay-sweep, the
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
