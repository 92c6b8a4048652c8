"""Gated DeltaNet ops (Qwen3-Next / Qwen3.5 mixers; seed 000, Alg. 5-8): the recurrent update, the `snapshot`
baseline, and ReplaySSM for GDN; the chunked WY scan of the prefill and the tree-masked WY solve (``chunk.py``,
PyTorch) and the l2norm of q and k (``l2norm.py``). The maths and the notation are in ``ops/gdn/naive.py``,
whose per-token recurrence is the ground truth of every op here.

Shapes (the signatures the GDN strategies call; the mixer hands over its post-conv, l2-normed q and k):
    state, S0      (B, H, N, P) fp32, k-major like fla-core's and transformers' [B, HV, dk, dv]
    q, k           (B, L, G, N)  l2-normalized; G key heads shared by H value heads (H % G == 0)
    v              (B, L, H, P)
    g, beta        (B, L, H)     log-decay −exp(A_log)·softplus(a + dt_bias), and sigmoid(b)
Forms (``forms.py``, fla-core's): gdn_chunk_scan, gdn_multistep and gdn_recurrent_update also take q, k raw
(``use_qk_l2norm``), the raw gate (g=None, a (B, L, H), A_log and dt_bias (H,)), beta as logits
(``beta_logits``); gdn_chunk_scan takes packed sequences too (``cu_seqlens``, B == 1, a state per sequence).
    ring_k         (B, R, G, N)  activation dtype;  ring_u (B, R, H, P): cached corrections u instead of v;
    ring_g         (B, R, H) fp32;  head, count (B,) int64 ring pointers
    scale          float, default N^-1/2 (as fla and transformers apply to q)
Strategy → op:
    every strategy     ``gdn_chunk_scan`` (prefill), ``l2norm`` (q and k after the conv, ``models.gdn.GDNParams``)
    stree, replay      ``gdn_tree_scan`` (a token tree verified with one masked WY solve)
    autoregressive     ``gdn_recurrent_update`` (one token, state in place)
    activation_replay  ``gdn_multistep`` (update_count / store_state / output=False: advance by accepted inputs)
    snapshot           ``gdn_multistep_snapshot`` (one state store per token into the given slots)
    replay             ``gdn_replay_verify`` (flush decided on the device, output-only readout through the
                       triangular solve, append) then ``gdn_replay_commit`` (count += accepted + 1, device-side)
Every op takes ``backend="auto" | "triton" | "reference"`` (``ssmspec.ops.dispatch``).
"""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.gdn.chunk import gdn_chunk_scan, gdn_tree_scan
from ssmspec.ops.gdn.forms import check_forms, raw_gate, resolve_forms
from ssmspec.ops.gdn.l2norm import l2norm
from ssmspec.ops.gdn.naive import (gdn_multistep_ref, gdn_multistep_snapshot_ref, gdn_recurrence_ref,
                                   gdn_replay_commit, gdn_replay_flush_flags, gdn_replay_state_ref,
                                   gdn_replay_verify_ref, l2norm_ref)


def gdn_multistep(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, *,
                  scale: float | None = None, state_batch_indices: Tensor | None = None,
                  update_count: Tensor | None = None, store_state: bool = True, output: bool = True,
                  use_qk_l2norm: bool = False, a: Tensor | None = None, A_log: Tensor | None = None,
                  dt_bias: Tensor | None = None, beta_logits: bool = False, backend: str = "auto") -> Tensor | None:
    """L tokens of the gated delta rule from a stored state: one state load, every output, one store.

    state (Bs, H, N, P) fp32 in place, row state_batch_indices[b] (default b; negative: a pad sequence,
    y = 0, nothing stored); q, k (B, L, G, N); v (B, L, H, P); g, beta (B, L, H); update_count (B,) int:
    with ``store_state`` the stored state is the one after update_count[b] tokens (None: all L; 0: unchanged)
    while y follows all L tokens; ``output=False`` skips y. Returns y (B, L, H, P) in v's dtype, or None.
    fla-core's forms (``ops/gdn/forms.py``; in-kernel on the Triton path): ``use_qk_l2norm`` (q, k raw),
    g=None with a (B, L, H), A_log and dt_bias (H,), ``beta_logits`` (beta = sigmoid(beta)).
    """
    forms = dict(use_qk_l2norm=use_qk_l2norm, a=a, A_log=A_log, dt_bias=dt_bias, beta_logits=beta_logits)
    check_forms(g, beta, a=a, A_log=A_log, dt_bias=dt_bias, H=beta.shape[-1])
    if use_triton(state, q, k, v, g, a, beta, A_log, dt_bias, backend=backend):
        from ssmspec.ops.gdn.recurrent import gdn_multistep_triton
        return gdn_multistep_triton(state, q, k, v, g, beta, scale=scale, state_batch_indices=state_batch_indices,
                                    update_count=update_count, store_state=store_state, output=output, **forms)
    q, k, g, beta = resolve_forms(q, k, g, beta, **forms)
    return gdn_multistep_ref(state, q, k, v, g, beta, scale=scale, state_batch_indices=state_batch_indices,
                             update_count=update_count, store_state=store_state, output=output)


def gdn_recurrent_update(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, *,
                         scale: float | None = None, state_batch_indices: Tensor | None = None,
                         use_qk_l2norm: bool = False, a: Tensor | None = None, A_log: Tensor | None = None,
                         dt_bias: Tensor | None = None, beta_logits: bool = False, backend: str = "auto") -> Tensor:
    """One token in place (seed 000, Alg. 5): state (Bs, H, N, P) fp32; q, k (B, G, N); v (B, H, P);
    g (or a), beta (B, H); state_batch_indices (B,) (negative: pad); the forms as ``gdn_multistep``.
    Returns y (B, H, P) in v's dtype."""
    gate = a if g is None else g
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or (gate is not None and gate.dim() != 2) or beta.dim() != 2:
        raise ValueError(f"gdn_recurrent_update takes one token: q, k (B, G, N), v (B, H, P), g (or a) and beta "
                         f"(B, H); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{None if gate is None else tuple(gate.shape)}, {tuple(beta.shape)} "
                         f"(use gdn_multistep for L tokens)")
    one = lambda t: None if t is None else t[:, None]  # noqa: E731  (B, ...) -> (B, 1, ...)
    y = gdn_multistep(state, q[:, None], k[:, None], v[:, None], one(g), beta[:, None], scale=scale,
                      state_batch_indices=state_batch_indices, use_qk_l2norm=use_qk_l2norm, a=one(a), A_log=A_log,
                      dt_bias=dt_bias, beta_logits=beta_logits, backend=backend)
    return y[:, 0]


def gdn_multistep_snapshot(state_pool: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                           scale: float | None = None, src_slot: Tensor, dst_slots: Tensor,
                           backend: str = "auto") -> Tensor:
    """The `snapshot` baseline (seed 000, Alg. 7) fused: start from slot src_slot[b] (B,) of state_pool
    (Nslots, H, N, P) fp32, store the state after token t into slot dst_slots[b, t] (B, L) (negative: no
    store; a dst may equal the sequence's own src). Returns y (B, L, H, P)."""
    if use_triton(state_pool, q, k, v, g, beta, backend=backend):
        from ssmspec.ops.gdn.recurrent import gdn_multistep_snapshot_triton
        return gdn_multistep_snapshot_triton(state_pool, q, k, v, g, beta, scale=scale, src_slot=src_slot,
                                             dst_slots=dst_slots)
    return gdn_multistep_snapshot_ref(state_pool, q, k, v, g, beta, scale=scale, src_slot=src_slot,
                                      dst_slots=dst_slots)


def gdn_replay_verify(S0: Tensor, ring_k: Tensor, ring_u: Tensor, ring_g: Tensor, head: Tensor, count: Tensor,
                      q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                      flush: Tensor | None = None, backend: str = "auto") -> Tensor:
    """One ReplaySSM call of L tokens for GDN (seed 000, Alg. 6 for L = 1, Alg. 8 for the pending token and
    S drafts): where ``flush[b]`` (None: count + 2L > R, decided on the device) fold the count[b] committed
    entries into S0[b] (one state store; head += count mod R, count = 0); the output of every token from S0
    and the ring through the triangular solve of the WY form (no state materialized); append (k, u, g) at
    ring slots (head + count + s) % R. ``count`` is not advanced (``gdn_replay_commit`` does that). Shapes in
    the package docstring; needs count + L <= R after the flush. Returns y (B, L, H, P) in v's dtype."""
    if use_triton(S0, ring_k, ring_u, q, k, v, backend=backend):
        from ssmspec.ops.gdn.replay import gdn_replay_verify_triton
        return gdn_replay_verify_triton(S0, ring_k, ring_u, ring_g, head, count, q, k, v, g, beta, scale=scale,
                                        flush=flush)
    return gdn_replay_verify_ref(S0, ring_k, ring_u, ring_g, head, count, q, k, v, g, beta, scale=scale, flush=flush)


__all__ = ["gdn_chunk_scan", "gdn_multistep", "gdn_multistep_ref", "gdn_multistep_snapshot",
           "gdn_multistep_snapshot_ref", "gdn_recurrence_ref", "gdn_recurrent_update", "gdn_replay_commit",
           "gdn_replay_flush_flags", "gdn_replay_state_ref", "gdn_replay_verify", "gdn_replay_verify_ref",
           "gdn_tree_scan", "l2norm", "l2norm_ref", "raw_gate", "resolve_forms"]
