"""How a ReplaySSM kernel step is measured (seed 000), shared by the kernel benchmarks (``kernels_replay``,
``kernels_gdn``) and the whole-step ones (``steps_replay``).

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

from functools import partial

import torch

from ssmspec.bench.kernels import Ctx, chain, io_bytes, make_inputs, state_bytes
from ssmspec.ops.multistep import ssm_multistep_snapshot
from ssmspec.ops.replay import replay_commit, replay_verify


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

    for st in copies:  # the one-launch form's program counters, kept per state as the strategy keeps them
        st["workspace"] = torch.zeros(bsz, device=ctx.device, dtype=torch.int32)

    def step(st: dict) -> None:  # one layer of the `replay` strategy: verify (flush decided in the call), commit
        verify(st["S0"], st["ring_x"], st["ring_dt"], st["ring_B"], st["head"], st["count"], inp["x"], inp["dt"],
               inp["A"], inp["B"], inp["C"], inp["D"], dt_bias=inp["dt_bias"], flush=None,
               workspace=st["workspace"], **blocks)
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
