"""Gated DeltaNet rows of the ReplaySSM kernel figures (seed 000, Figs. 6, 7 and 9, Qwen3.5 / Qwen3-Next):
``replay_fig6_speedup`` / ``replay_fig7_buffer`` and ``replay_fig9_verify_cost`` add them for every name in
``bench.gdn_presets`` (rows with ``family: gdn``; the Mamba-2 rows of ``bench.presets`` are unchanged).

Rows (impl):
- ``ssu_fla``: fla-core's ``fused_recurrent_gated_delta_rule`` on one token from a state, final state out
  (state read + written: the standard decode step GDN serving runs); ``ssu_ours``: ``gdn_recurrent_update``
  in place. ``status: skipped`` where fla-core cannot be imported (CPU, or no fla on the path).
- ``replay`` (per R): the steady state of ReplaySSM for GDN, one ``gdn_replay_verify`` (flush rule decided
  on the device; one-token calls in the split form, ``replay-fused`` rows: in the fused form) plus
  ``gdn_replay_commit`` per step, sequences staggered over the count cycle and a whole
  cycle in one CUDA graph (as in bench/replay_measure.py); Fig. 9 has one row per S, R and accepted count
  (``replay-rows``: the row form of the state kernel, beside the default GEMM form of 16-bit inputs).
- Fig. 9 only: ``snapshot`` (``gdn_multistep_snapshot``: one state load, a state store per token -- the
  speculative baseline of seed 000, Alg. 7), ``fla_recurrent`` and ``fla_chunk`` (fla's fused recurrent and
  ``chunk_gated_delta_rule`` over the L tokens, initial state in, final state out: one store, not one per
  draft, so they are lower bounds of a snapshot baseline built on fla).
Goals (issue 11, P9): replay decode >= 1.7x ``ssu_fla`` at the best R (paper: 1.43-1.64x, best R = 16);
replay verify at S = 6 <= 1.2x one standard decode step (paper: 1.27-1.72x).

No GDN model preset exists yet, so the mixer sizes are constants here (``GDN_MIXERS``). Bytes per row are
the fewest bytes the implementation must move, as in bench/kernels.py; fp32 states, activations in
``cfg.dtype`` (bf16 on the GPU profile), gates g fp32.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from ssmspec.bench.kernels import Ctx, chain, random_states, state_bytes
from ssmspec.bench.replay_measure import count_cycle
from ssmspec.bench.timing import time_eager
from ssmspec.ops.gdn import gdn_multistep_snapshot, gdn_recurrent_update, gdn_replay_commit, gdn_replay_verify

log = logging.getLogger("ssmspec.bench.kernels_gdn")

# GDN mixer sizes: H value heads, G key heads, N = dk, P = dv, from the published text configs of Qwen3.5-4B
# (Qwen3_5ForConditionalGeneration text_config) and Qwen3-Next-80B-A3B: linear_num_value_heads 32,
# linear_num_key_heads 16, linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4
GDN_MIXERS = {
    "qwen3.5-4b": dict(H=32, G=16, N=128, P=128),  # Qwen3.5-4B: 32 layers, 24 of them GDN
    "qwen3-next-80b": dict(H=32, G=16, N=128, P=128),  # Qwen3-Next-80B-A3B: 48 layers, 36 GDN (same mixer)
    "tiny-gdn": dict(H=4, G=2, N=32, P=48),  # CPU profile and tests
}


def gdn_presets(bench: DictConfig) -> list[str]:
    """``bench.gdn_presets`` checked before anything is measured."""
    names = list(bench.get("gdn_presets", None) or [])
    unknown = [n for n in names if n not in GDN_MIXERS]
    if unknown:
        raise ValueError(f"bench.gdn_presets: unknown GDN mixer(s) {unknown}; choose from {', '.join(GDN_MIXERS)}")
    return names


def fla_ops() -> tuple[Callable | None, Callable | None, str]:
    """(fused_recurrent_gated_delta_rule, chunk_gated_delta_rule, reason) from fla-core, None where missing."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001 -- any import failure means: no baseline on this machine
        return None, None, f"fla-core not importable: {type(e).__name__}: {e}"
    return fused_recurrent_gated_delta_rule, chunk_gated_delta_rule, ""


def gdn_inputs(bsz: int, L: int, z: dict, dtype, device, seed: int = 0) -> dict:
    """Decode inputs as the mixer hands them over: l2-normed q, k (B, L, G, N), v (B, L, H, P), g (B, L, H)
    fp32 log-decays −exp(A_log)·softplus(a), beta (B, L, H) = sigmoid(b)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    H, G, N, P = z["H"], z["G"], z["N"], z["P"]
    q = F.normalize(torch.randn(bsz, L, G, N, generator=gen), dim=-1)
    k = F.normalize(torch.randn(bsz, L, G, N, generator=gen), dim=-1)
    g = -torch.rand(H, generator=gen).add(0.5) * F.softplus(torch.randn(bsz, L, H, generator=gen) - 1.0)
    v = torch.randn(bsz, L, H, P, generator=gen)
    beta = torch.sigmoid(torch.randn(bsz, L, H, generator=gen))
    return dict(q=q.to(device, dtype), k=k.to(device, dtype), v=v.to(device, dtype), g=g.to(device),
                beta=beta.to(device, dtype))


def gdn_io_bytes(bsz: int, L: int, z: dict, act: int) -> int:
    """Per call of L tokens: q, k read (per key head), v read and y written (per value head), g (fp32) and
    beta read."""
    H, G, N, P = z["H"], z["G"], z["N"], z["P"]
    return bsz * L * (2 * G * N * act + 2 * H * P * act + H * (4 + act))


def gdn_replay_step_bytes(counts: list[int], L: int, R: int, z: dict, act: int) -> float:
    """Bytes one replay step moves for one sequence, averaged over ``counts``: the checkpoint read, on flush
    steps the fold (committed entries) and one state store, the window entries read, the call's inputs and
    outputs, the appended entries. One ring entry: u (P) and g (fp32) per value head, k (N) per key head."""
    H, G, N, P = z["H"], z["G"], z["N"], z["P"]
    entry = H * (act * P + 4) + G * act * N
    total = 0.0
    for c in counts:
        flush = c + 2 * L > R
        b = H * 4 * N * P  # checkpoint read once
        if flush:
            b += H * 4 * N * P + c * entry
        b += (0 if flush else c) * entry + gdn_io_bytes(1, L, z, act) + L * entry
        total += b
    return total / len(counts)


def _ring_state(bsz: int, R: int, z: dict, dtype, device, counts: list[int]) -> dict:
    """Checkpoint and a full ring (every slot finite: any window is a valid one), sequence b at phase b of
    the count cycle."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    H, G, N, P = z["H"], z["G"], z["N"], z["P"]
    phase = torch.arange(bsz) % len(counts)
    return dict(S0=torch.randn(bsz, H, N, P, device=device) * 0.1,
                ring_k=F.normalize(torch.randn(bsz, R, G, N, generator=gen), dim=-1).to(device, dtype),
                ring_u=(0.1 * torch.randn(bsz, R, H, P, generator=gen)).to(device, dtype),
                ring_g=-(0.02 + 0.3 * torch.rand(bsz, R, H, generator=gen)).to(device),
                head=torch.randint(0, R, (bsz,), generator=gen).to(device),
                count=torch.tensor([counts[int(p)] for p in phase], device=device, dtype=torch.long))


def replay_measure(ctx: Ctx, bsz: int, L: int, R: int, accepted: int, z: dict,
                   **blocks) -> tuple[list[float], float, list[int]]:
    """(ms per step samples, bytes per step, count cycle) of the GDN replay steady state: one step is what a
    GDN layer of the `replay` strategy runs, ``gdn_replay_verify`` then ``gdn_replay_commit``."""
    cyc = count_cycle(L, R, accepted)
    st = _ring_state(bsz, R, z, ctx.dtype, ctx.device, cyc)
    inp = gdn_inputs(bsz, L, z, ctx.dtype, ctx.device)
    acc = torch.full((bsz,), accepted, device=ctx.device, dtype=torch.long)
    if blocks:
        from ssmspec.ops.gdn.replay import gdn_replay_verify_triton as verify
    else:
        verify = gdn_replay_verify

    def step() -> None:
        verify(st["S0"], st["ring_k"], st["ring_u"], st["ring_g"], st["head"], st["count"], inp["q"], inp["k"],
               inp["v"], inp["g"], inp["beta"], flush=None, **blocks)
        gdn_replay_commit(st["count"], acc)

    K = len(cyc)
    samples = ctx.time(chain([step] * K), per_call=K)
    nbytes = bsz * gdn_replay_step_bytes(cyc, L, R, z, ctx.dtype.itemsize)
    st.clear()  # free ring and checkpoint before the next configuration allocates its own
    ctx.sync()
    return samples, nbytes, cyc


def _fla_fn(fla: Callable, st: torch.Tensor, inp: dict) -> Callable[[], object]:
    """fla's kernel on the call's tokens from ``st`` (B, H, N, P) = fla's [N, HV, K, V], final state out."""
    return lambda: fla(q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"], initial_state=st,
                       output_final_state=True)


def _time_fla(ctx: Ctx, fn: Callable[[], object], per_call: int, nbytes: float, **fields) -> dict:
    """A row for fla's kernel: CUDA-graph timing like every other row, eager (said in ``timing``) where fla's
    launcher cannot be captured."""
    try:
        return ctx.row(ctx.time(fn, per_call=per_call), nbytes, **fields)
    except RuntimeError as e:
        log.warning("fla kernel not capturable in a CUDA graph (%s); timing it eagerly", e)
        torch.cuda.synchronize()
        samples = time_eager(fn, warmup=ctx.warmup, iters=ctx.iters, device=ctx.device)
        return {**ctx.row([s / per_call for s in samples], nbytes, **fields), "timing": "eager"}


def _ours_fn(st: torch.Tensor, inp: dict, **blocks) -> Callable[[], object]:
    one = {key: t[:, 0] for key, t in inp.items()}
    if blocks:
        from ssmspec.ops.gdn.recurrent import gdn_multistep_triton
        return lambda: gdn_multistep_triton(st, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **blocks)
    return lambda: gdn_recurrent_update(st, one["q"], one["k"], one["v"], one["g"], one["beta"])


def _decode_baselines(ctx: Ctx, bsz: int, z: dict, fla, why: str, base: dict, sweep=()) -> Iterator[dict]:
    """Standard decode (one token, state read + written): fla's fused recurrent kernel and ours (plus
    ``ssu_ours-sweep`` rows for other launches of ours)."""
    inp = gdn_inputs(bsz, 1, z, ctx.dtype, ctx.device)
    sb = state_bytes(bsz, z["H"], z["P"], z["N"])
    rot = ctx.rotation(sb)
    nbytes = 2 * sb + gdn_io_bytes(bsz, 1, z, ctx.dtype.itemsize)
    runs = [("ssu_fla", {}), ("ssu_ours", {})]
    runs += [("ssu_ours-sweep", dict(block_p=bp, num_warps=nw)) for bp, nw in sweep]
    for impl, blocks in runs:
        if impl == "ssu_fla" and fla is None:
            yield dict(base, impl=impl, status="skipped", reason=why)
            continue
        states = random_states(rot, (bsz, z["H"], z["N"], z["P"]), ctx.device)
        fields = dict(base, impl=impl, rot=rot, **blocks)
        if impl == "ssu_fla":
            yield _time_fla(ctx, chain([_fla_fn(fla, s, inp) for s in states]), rot, nbytes, **fields)
        else:
            yield ctx.row(ctx.time(chain([_ours_fn(s, inp, **blocks) for s in states]), per_call=rot), nbytes,
                          **fields)
        del states
    ctx.sync()


def buffer_rows(ctx: Ctx, b: DictConfig, presets: list[str]) -> Iterator[dict]:
    """Figs. 6 / 7 for GDN: standard decode of `replay` (L = 1) per R in ``bench.R`` against the one-token
    kernels, with ``bound_speedup`` (bytes of the one-token step / bytes of the replay step) and
    ``flush_period``; on CUDA, ``replay-fused`` rows per R time the one-token call through the fused
    launches of multi-token calls (the form before the split decode), and ``bench.gdn_sweep``
    [[block_p, num_warps], ...] rows time other launches of our one-token kernel and of the split decode's
    state kernel (at ``bench.sweep_R``)."""
    fla, _, why = fla_ops()
    sweep = [tuple(int(v) for v in s) for s in b.get("gdn_sweep", [])] if ctx.cuda else []
    for preset in presets:
        z = GDN_MIXERS[preset]
        for bsz in b.batch:
            base = dict(family="gdn", model=preset, batch=bsz, L=1, **z)
            yield from _decode_baselines(ctx, bsz, z, fla, why, base, sweep)
            one = 2 * state_bytes(bsz, z["H"], z["P"], z["N"]) + gdn_io_bytes(bsz, 1, z, ctx.dtype.itemsize)
            runs = [("replay", int(R), {}) for R in b.R]
            if ctx.cuda:  # the one-token call through the fused launches of multi-token calls, for comparison
                runs += [("replay-fused", int(R), dict(split=False)) for R in b.R]
            runs += [("replay-sweep", int(b.sweep_R), dict(block_p=bp, num_warps=nw)) for bp, nw in sweep]
            for impl, R, blocks in runs:
                samples, nbytes, cyc = replay_measure(ctx, bsz, 1, R, 0, z, **blocks)
                yield ctx.row(samples, nbytes, **base, impl=impl, R=R, flush_period=len(cyc),
                              bound_speedup=one / nbytes, **blocks)


def verify_rows(ctx: Ctx, b: DictConfig, presets: list[str]) -> Iterator[dict]:
    """Fig. 9 for GDN: verify of S drafts (L = 1 + S tokens) per S in ``bench.gdn_S`` (default ``bench.S``) and
    R in ``bench.gdn_R`` (default ``bench.R``; a smaller grid keeps the GPU run short): snapshot (ours), fla's
    fused recurrent and chunk kernels (one final state), replay per R >= L and accepted count 0..S, with the
    one-token kernels (S = 0) as the unit; on CUDA, ``replay-rows`` rows at R = ``bench.gdn_rows_R`` (0: none)
    time the row form of the state kernel (rank-1 fold, column reductions) beside the default GEMM form."""
    fla, chunk, why = fla_ops()
    act = ctx.dtype.itemsize
    S_list, R_list = b.get("gdn_S", None) or b.S, b.get("gdn_R", None) or b.R
    for preset in presets:
        z = GDN_MIXERS[preset]
        H, N, P = z["H"], z["N"], z["P"]
        for bsz in b.batch:
            base = dict(family="gdn", model=preset, batch=bsz, **z)
            yield from _decode_baselines(ctx, bsz, z, fla, why, dict(base, S=0, L=1))
            sb = state_bytes(bsz, H, P, N)
            for S in S_list:
                L = int(S) + 1
                inp = gdn_inputs(bsz, L, z, ctx.dtype, ctx.device)
                pool = torch.randn(bsz * L, H, N, P, device=ctx.device) * 0.1
                src = torch.arange(bsz, device=ctx.device) * L
                dst = src[:, None] + torch.arange(L, device=ctx.device)[None]  # includes src: read before stored

                def snap(pool=pool, inp=inp, src=src, dst=dst) -> None:
                    gdn_multistep_snapshot(pool, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], src_slot=src,
                                           dst_slots=dst)

                yield ctx.row(ctx.time(snap), (1 + L) * sb + gdn_io_bytes(bsz, L, z, act), **base, impl="snapshot",
                              S=S, L=L)
                del snap, pool
                for impl, fn in (("fla_recurrent", fla), ("fla_chunk", chunk)):
                    if fn is None:
                        yield dict(base, impl=impl, S=S, L=L, status="skipped", reason=why)
                        continue
                    st = torch.randn(bsz, H, N, P, device=ctx.device) * 0.1
                    yield _time_fla(ctx, _fla_fn(fn, st, inp), 1, 2 * sb + gdn_io_bytes(bsz, L, z, act), **base,
                                    impl=impl, S=S, L=L)
                    del st
                runs = [("replay", int(R), {}) for R in R_list]
                if ctx.cuda and b.get("gdn_rows_R", 0):
                    runs.append(("replay-rows", int(b.gdn_rows_R), dict(gemm=False)))
                for impl, R, blocks in runs:
                    if R < L:
                        continue
                    for a in range(L):
                        samples, nbytes, cyc = replay_measure(ctx, bsz, L, R, a, z, **blocks)
                        yield ctx.row(samples, nbytes, **base, impl=impl, S=S, L=L, R=R, accepted=a,
                                      flush_period=len(cyc))
                ctx.sync()
