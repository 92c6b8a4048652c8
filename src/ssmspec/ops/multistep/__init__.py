"""Fused multi-token Mamba-2 state update (seed 001, App. A) and its snapshot form (seed 000, Alg. 3)."""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.multistep.naive import ssm_multistep_ref, ssm_multistep_snapshot_ref

_INF = float("inf")


def ssm_multistep(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                  dt_bias: Tensor | None = None, dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, _INF),
                  z: Tensor | None = None, state_batch_indices: Tensor | None = None,
                  update_count: Tensor | None = None, store_state: bool = True, output: bool = True,
                  backend: str = "auto") -> Tensor | None:
    """Load the state once, run L tokens in registers, write every output, store the state once.

    state (Bs, H, P, N) fp32, in place; x (B, L, H, P); dt (B, L, H) raw (``dt_softplus``: softplus(dt +
    dt_bias) clamped to dt_limit) or already discretized (``dt_softplus=False``, 0 on pad / no-op tokens);
    A (H,); B, C (B, L, G, N); D (H,); z (B, L, H, P) output gate silu(z); state_batch_indices (B,) int;
    update_count (B,) int: with ``store_state`` the stored state is the one after update_count[b] tokens
    (None: all L; 0: unchanged), y still covers all L tokens; ``output=False`` skips y entirely (the replay
    form of activation_replay / stree: advance by the accepted cached inputs). Returns y (B, L, H, P) in
    x's dtype, or None when ``output`` is False.
    """
    if use_triton(state, x, dt, A, B, C, backend=backend):
        from ssmspec.ops.multistep.triton import ssm_multistep_triton
        return ssm_multistep_triton(state, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                    dt_limit=dt_limit, z=z, state_batch_indices=state_batch_indices,
                                    update_count=update_count, store_state=store_state, output=output)
    return ssm_multistep_ref(state, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                             z=z, state_batch_indices=state_batch_indices, update_count=update_count,
                             store_state=store_state, output=output)


def ssm_multistep_snapshot(state_pool: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           D: Tensor | None = None, *, dt_bias: Tensor | None = None, dt_softplus: bool = True,
                           dt_limit: tuple[float, float] = (0.0, _INF), src_slot: Tensor, dst_slots: Tensor,
                           z: Tensor | None = None, backend: str = "auto") -> Tensor:
    """The `snapshot` baseline fused: start from slot src_slot[b], store the state after token t into slot
    dst_slots[b, t] (negative: no store). state_pool (Nslots, H, P, N) fp32; src_slot (B,) int; dst_slots
    (B, L) int; other shapes as ``ssm_multistep``. One state load, one store per token. Returns y (B, L, H, P)."""
    if use_triton(state_pool, x, dt, A, B, C, backend=backend):
        from ssmspec.ops.multistep.triton import ssm_multistep_snapshot_triton
        return ssm_multistep_snapshot_triton(state_pool, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                             dt_limit=dt_limit, src_slot=src_slot, dst_slots=dst_slots, z=z)
    return ssm_multistep_snapshot_ref(state_pool, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                      dt_limit=dt_limit, src_slot=src_slot, dst_slots=dst_slots, z=z)


__all__ = ["ssm_multistep", "ssm_multistep_ref", "ssm_multistep_snapshot", "ssm_multistep_snapshot_ref"]
