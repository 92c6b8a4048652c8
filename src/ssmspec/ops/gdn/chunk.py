"""The WY form of the gated delta rule over many tokens in PyTorch: ``gdn_chunk_scan`` (the chunked prefill of a
GDN mixer) and ``gdn_tree_scan`` (one chunk from a state, under a causal or a token-tree mask; what ``stree``
and ``replay`` verify trees with). Their ground truth is the per-token recurrence ``naive.gdn_recurrence_ref``
(tests/ops/test_gdn_chunk.py). Shapes and notation as the package docstring.

Multi-token maths (seed 000's WY form): from a state S, the tokens of a call whose ancestors are given by a
mask M (M[s, t]: t is s itself or an ancestor; causal for a chain) have, per value head,
    Γ_s = Σ_{t: M[s,t]} g_t,  R_s = β_s (v_s − e^{Γ_s} Sᵀk_s),  A[s, t] = β_s e^{Γ_s − Γ_t} k_t·k_s (t ≠ s, M[s,t])
    U = (I + A)⁻¹ R,   y_s = scale (e^{Γ_s} Sᵀq_s + Σ_{t: M[s,t]} e^{Γ_s − Γ_t} (k_t·q_s) U_t)
and, for a chain, the state after the last token is e^{Γ_L} S + Σ_t e^{Γ_L − Γ_t} k_t U_tᵀ. With a causal
mask this is the chunk of the chunked prefill (``gdn_chunk_scan``); with a tree mask every node's U_t depends
on its ancestors only (A is supported on ancestors, so forward substitution in node order never reads a
sibling), so one solve verifies a whole token tree (``gdn_tree_scan``, used by ``stree`` and ``replay``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.gdn.forms import resolve_forms
from ssmspec.ops.gdn.naive import _cd


def gdn_tree_scan(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                  mask: Tensor | None = None, scale: float | None = None,
                  final_state: bool = False, corrections: bool = False):
    """The WY form of L tokens from ``state`` (module doc), output only unless ``final_state`` (chains).

    state (B, H, N, P) fp32 (not modified); q, k (B, L, G, N) l2-normed; v (B, L, H, P); g, beta (B, L, H)
    (g = beta = 0 on pad tokens: the state passes through them); mask (B, L, L) bool ancestor-or-self (None:
    causal). Returns y (B, L, H, P) in v's dtype and, with ``final_state``, the state after the last token
    (B, H, N, P) in the compute dtype (fp64 for fp64 inputs; only meaningful for a chain), else None; with
    ``corrections`` also U (B, L, H, P), each node's correction u_t = β_t(v_t − e^{g_t} S_{t-1}ᵀk_t) along its
    own path (what ReplaySSM for GDN caches)."""
    bsz, L, H, P = v.shape
    G, N = q.shape[2], q.shape[3]
    cd = torch.promote_types(_cd(v), state.dtype)
    sc = N ** -0.5 if scale is None else scale
    dev = v.device
    qh = q.to(cd).repeat_interleave(H // G, dim=2)  # (B, L, H, N)
    kh = k.to(cd).repeat_interleave(H // G, dim=2)
    if mask is None:
        mask = torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None].expand(bsz, L, L)
    gf, bf = g.to(cd), beta.to(cd)
    gam = torch.einsum("bst,bth->bsh", mask.to(cd), gf)  # (B, L, H) Γ_s along each node's ancestors
    S = state.to(cd)
    hk = torch.einsum("bhnp,blhn->blhp", S, kh)  # Sᵀk_s
    hq = torch.einsum("bhnp,blhn->blhp", S, qh)  # Sᵀq_s
    eg = torch.exp(gam)[..., None]  # (B, L, H, 1)
    Rv = bf[..., None] * (v.to(cd) - eg * hk)
    diff = gam[:, :, None] - gam[:, None]  # (B, Ls, Lt, H) Γ_s − Γ_t
    dec = torch.where(mask[..., None], torch.exp(torch.where(mask[..., None], diff, 0.0)), 0.0)
    kk = torch.einsum("bshn,bthn->bsth", kh, kh)
    kq = torch.einsum("bshn,bthn->bsth", qh, kh)
    off = ~torch.eye(L, dtype=torch.bool, device=dev)
    A = bf[:, :, None] * dec * kk * off[None, :, :, None]  # (B, Ls, Lt, H) strictly "lower" on the tree
    M = torch.eye(L, dtype=cd, device=dev) + A.permute(0, 3, 1, 2)  # (B, H, L, L) unit lower triangular
    U = torch.linalg.solve_triangular(M, Rv.permute(0, 2, 1, 3), upper=False, unitriangular=True)
    U = U.permute(0, 2, 1, 3)  # (B, L, H, P)
    y = sc * (eg * hq + torch.einsum("bsth,bthp->bshp", dec * kq, U))
    new = None
    if final_state:
        last = gam[:, -1]  # (B, H) Γ_L
        w = torch.exp(last[:, None] - gam)  # (B, L, H)
        new = torch.exp(last)[..., None, None] * S + torch.einsum("blh,blhn,blhp->bhnp", w, kh, U)
    if corrections:
        return y.to(v.dtype), new, U
    return y.to(v.dtype), new


def gdn_chunk_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, *, chunk_size: int = 64,
                   initial_state: Tensor | None = None, scale: float | None = None, use_qk_l2norm: bool = False,
                   a: Tensor | None = None, A_log: Tensor | None = None, dt_bias: Tensor | None = None,
                   beta_logits: bool = False, cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule over a whole sequence (the prefill): the WY form per chunk of ``chunk_size``
    tokens, the state carried between chunks. Shapes as ``gdn_tree_scan``; returns y (B, L, H, P) and the
    final state (B, H, N, P) fp32.

    The forms of fla-core's ``chunk_gated_delta_rule`` (``ops/gdn/forms.py``): ``use_qk_l2norm`` (q, k raw),
    g=None with a (B, L, H), A_log and dt_bias (H,) (g = −exp(A_log)·softplus(a + dt_bias)), ``beta_logits``
    (beta = sigmoid(beta)); and ``cu_seqlens`` (S + 1,) int, 0 = cu[0] <= ... <= cu[S] = L: B == 1 packs S
    sequences, sequence s owning tokens cu[s]:cu[s+1], each scanned from its own initial_state[s]
    (initial_state (S, H, N, P) or None), the final state (S, H, N, P) one per sequence."""
    q, k, g, beta = resolve_forms(q, k, g, beta, use_qk_l2norm=use_qk_l2norm, a=a, A_log=A_log, dt_bias=dt_bias,
                                  beta_logits=beta_logits)
    if cu_seqlens is not None:
        return _varlen_scan(q, k, v, g, beta, cu_seqlens, chunk_size=chunk_size, initial_state=initial_state,
                            scale=scale)
    bsz, L, H, P = v.shape
    N = q.shape[3]
    S = (torch.zeros(bsz, H, N, P, device=v.device, dtype=torch.float32) if initial_state is None
         else initial_state.float())
    ys = []
    for c0 in range(0, L, chunk_size):
        sl = slice(c0, min(L, c0 + chunk_size))
        y, S = gdn_tree_scan(S, q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale=scale, final_state=True)
        ys.append(y)
    y = torch.cat(ys, dim=1) if ys else v.new_zeros(bsz, 0, H, P)
    return y, S.float()


def _varlen_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, *, chunk_size: int,
                 initial_state: Tensor | None, scale: float | None) -> tuple[Tensor, Tensor]:
    """Packed sequences as one padded batch: row s holds sequence s from its first token (so its chunks are
    the ones a run of that sequence alone takes), right-padded with g = beta = 0 tokens, which the state
    passes through unchanged (``gdn_tree_scan``); the pad outputs are dropped."""
    bounds = _check_cu_seqlens(cu_seqlens, v, initial_state)
    T = v.shape[1]
    dev = v.device
    starts = torch.tensor(bounds[:-1], device=dev)
    lens = torch.tensor(bounds[1:], device=dev) - starts  # (S,)
    Lmax = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    pos = torch.arange(Lmax, device=dev)
    valid = pos[None] < lens[:, None]  # (S, Lmax)
    idx = (starts[:, None] + pos[None]).clamp(max=max(T - 1, 0))  # (S, Lmax) packed token of each slot
    gp = torch.where(valid[..., None], g[0, idx], 0.0)  # (S, Lmax, H): pads decay nothing ...
    bp = torch.where(valid[..., None], beta[0, idx], 0.0)  # ... and write nothing
    y, S = gdn_chunk_scan(q[0, idx], k[0, idx], v[0, idx], gp, bp, chunk_size=chunk_size,
                          initial_state=initial_state, scale=scale)
    return y[valid][None], S  # (1, T, H, P) in packed order, (S, H, N, P)


def _check_cu_seqlens(cu_seqlens: Tensor, v: Tensor, initial_state: Tensor | None) -> list[int]:
    """cu_seqlens as a host list (one sync, as fla-core's varlen prep takes), after checking it packs v's tokens."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor (S + 1,) of sequence offsets [0, ..., L], got "
                         f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    if v.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed along L: pass B == 1 (reshape (B, L, ...) to "
                         f"(1, B*L, ...)), got B = {v.shape[0]}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    T = v.shape[1]
    if bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the packed length L = {T}; got "
                         f"{bounds[:4]}{'...' if len(bounds) > 4 else ''}{bounds[-1:] if len(bounds) > 4 else ''}")
    if initial_state is not None and initial_state.shape[0] != len(bounds) - 1:
        raise ValueError(f"with cu_seqlens initial_state holds one state per sequence: ({len(bounds) - 1}, H, N, P), "
                         f"got {tuple(initial_state.shape)}")
    return bounds
