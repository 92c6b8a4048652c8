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


def gdn_chunk_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, chunk_size: int = 64,
                   initial_state: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule over a whole sequence (the prefill): the WY form per chunk of ``chunk_size``
    tokens, the state carried between chunks. Shapes as ``gdn_tree_scan``; returns y (B, L, H, P) and the
    final state (B, H, N, P) fp32."""
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
