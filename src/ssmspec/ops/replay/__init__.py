"""ReplaySSM (seed 000): checkpoint state + ring buffer of recent inputs, output-only decode and verify.

``replay_verify`` dispatches the Triton kernels on CUDA: four launches (the per-group inner products B_jᵀC_s,
the window readout per head, the state kernel -- flush and output-only readout --, the ring append that moves
the pointers: ``ops/replay/triton.py``), or all of it in one launch per (sequence, head) where the call's state is small
(``ops/replay/fused.py``); ``replay_commit`` and
``replay_flush_flags`` are single device-side elementwise ops (graph-safe, no host sync)."""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.replay.naive import replay_commit, replay_commit_path, replay_flush_flags, replay_verify_ref


def replay_verify(S0: Tensor, ring_x: Tensor, ring_dt: Tensor, ring_B: Tensor, head: Tensor, count: Tensor,
                  x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                  dt_bias: Tensor | None, dt_limit: tuple[float, float] = (0.0, float("inf")),
                  flush: Tensor | None = None,
                  tree_mask: Tensor | None = None, workspace: Tensor | None = None, backend: str = "auto") -> Tensor:
    """One ReplaySSM call of L tokens (seed 000, Alg. 2 / 4): flush where ``flush[b]`` (fold the count[b]
    committed entries into S0[b], head += count mod R, count = 0), append the L tokens at ring slots
    (head + count + s) % R, output-only readout over the window under a causal mask. ``count`` is not
    advanced (``replay_commit`` does that).

    S0 (B, H, P, N) fp32; ring_x (B, R, H, P); ring_dt (B, R, H) fp32 discretized; ring_B (B, R, G, N);
    head, count (B,) int64; x (B, L, H, P); dt (B, L, H) raw; A (H,); B, C (B, L, G, N); D (H,);
    flush (B,) bool, or None for seed 000's rule count + 2L > R decided on the device inside the call (one
    launch fewer than passing ``replay_flush_flags``); tree_mask (B, L, L) bool ancestor-or-self mask when the
    call's tokens are a packed token tree (None: a causal chain). Needs count + L <= R after the flush.
    workspace: (B,) int32 zeros the one-launch Triton form counts its programs in (and leaves zero), kept by the
    caller per state so that no launch allocates one (None: allocated per call; unused by the reference).
    Returns y (B, L, H, P) in x's dtype.
    """
    if use_triton(S0, ring_x, x, B, C, backend=backend):
        from ssmspec.ops.replay.triton import replay_verify_triton
        return replay_verify_triton(S0, ring_x, ring_dt, ring_B, head, count, x, dt, A, B, C, D, dt_bias=dt_bias,
                                    dt_limit=dt_limit, flush=flush, tree_mask=tree_mask, workspace=workspace)
    return replay_verify_ref(S0, ring_x, ring_dt, ring_B, head, count, x, dt, A, B, C, D, dt_bias=dt_bias,
                             dt_limit=dt_limit, flush=flush, tree_mask=tree_mask)


__all__ = ["replay_commit", "replay_commit_path", "replay_flush_flags", "replay_verify", "replay_verify_ref"]
